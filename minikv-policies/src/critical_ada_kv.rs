//! CriticalAdaKV (Feng et al. 2025; kvpress's `CriticalAdaKVPress`):
//! CriticalKV's two-stage refinement with Ada-KV's per-head budgets.
//!
//! Per KV head `h`, with `s` the inner scorer's scores (mean over the group's
//! query heads) and `b` the selection's per-head budget:
//! 1. each head's best `max(1, ⌊αb⌋)` tokens are safe; the layer's `H·b` best
//!    tokens over all heads (safe ones first) give each head its budget `b_h`;
//! 2. each head's best `⌊b_h · first_stage_ratio⌋` tokens (safe ones first)
//!    are taken by the inner scores alone;
//! 3. the others are rescored `(s_j + ε)·‖W_o^h v_j‖₁` (CriticalKV) and each
//!    head keeps its `b_h` best.
//!
//! The kept tokens score above all others, so the `ada_kv` selector with the
//! same `alpha` takes exactly them (a head's floor never exceeds its `b_h`);
//! with `top_k` every head would keep `b` tokens instead. Ties go to the lower
//! position (the reference's `topk` leaves them unspecified).

use crate::criticalkv::kv_scores_and_norms;
use minikv_core::{Needs, Result, ScoreInputs, TokenScorer, check_range, register};
use serde::{Deserialize, Serialize};

/// CriticalAdaKV wrapper (kvpress defaults: α = 0.2, ε = 1e-4, first stage 0.5).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticalAdaKv {
    /// Ada-KV's safeguard share of the budget per head (0.2).
    pub alpha: f64,
    /// Share of each head's budget chosen by the inner scorer alone (0.5).
    pub first_stage_ratio: f64,
    /// Added to the inner score before the projection-norm product (1e-4).
    pub epsilon: f32,
    /// The scorer refined.
    pub scorer: Box<dyn TokenScorer>,
}

impl Default for CriticalAdaKv {
    fn default() -> Self {
        Self {
            alpha: 0.2,
            first_stage_ratio: 0.5,
            epsilon: 1e-4,
            scorer: Box::new(crate::SnapKv::default()),
        }
    }
}

/// Indices of the `k` best of `key` (descending, ties to the lower index).
fn best(key: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..key.len()).collect();
    idx.sort_by(|&a, &b| key[b].total_cmp(&key[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// The kept positions per head from KV-head scores `s` (`[H][T]`), projection
/// norms `norm` (`[H][T]`) and the per-head budget.
pub fn select(
    s: &[f32],
    norm: &[f32],
    t: usize,
    budget: usize,
    alpha: f64,
    first_stage: f64,
    eps: f32,
) -> Vec<Vec<usize>> {
    let nh = s.len() / t.max(1);
    let b = budget.min(t);
    let safe_n = if alpha > 0.0 && b > 0 {
        ((b as f64 * alpha) as usize).max(1)
    } else {
        0
    };
    // Stage 0: safe tokens lifted to +inf, then the global budget split.
    let mut key = s.to_vec();
    for h in 0..nh {
        for j in best(&s[h * t..(h + 1) * t], safe_n) {
            key[h * t + j] = f32::INFINITY;
        }
    }
    let mut hb = vec![0usize; nh];
    for i in best(&key, nh * b) {
        hb[i / t] += 1;
    }
    // Stage 1 and 2, per head.
    (0..nh)
        .map(|h| {
            let row = &key[h * t..(h + 1) * t];
            let first = best(row, (hb[h] as f64 * first_stage) as usize);
            let mut r: Vec<f32> = row
                .iter()
                .zip(&norm[h * t..(h + 1) * t])
                .map(|(&x, &n)| if x.is_finite() { (x + eps) * n } else { x })
                .collect();
            for j in first {
                r[j] = f32::INFINITY;
            }
            let mut kept = best(&r, hb[h]);
            kept.sort_unstable();
            kept
        })
        .collect()
}

#[typetag::serde(name = "critical_ada_kv")]
impl TokenScorer for CriticalAdaKv {
    fn needs(&self) -> Needs {
        self.scorer.needs().union(Needs {
            output_projection: true,
            ..Default::default()
        })
    }
    fn validate(&self) -> Result<()> {
        check_range("cache.scorer.alpha", self.alpha, 0.0, 1.0)?;
        check_range(
            "cache.scorer.first_stage_ratio",
            self.first_stage_ratio,
            0.0,
            1.0,
        )?;
        check_range("cache.scorer.epsilon", self.epsilon, 0.0, 1e6)?;
        self.scorer.validate()
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        self.scorer.score(inp, out)?;
        let t = inp.t;
        let (hkv, g) = (inp.spec.n_kv_heads, inp.spec.group());
        let (mut s, norm) = kv_scores_and_norms(inp, out, "critical_ada_kv")?;
        let Some(budget) = inp.budget else {
            // No budget (decode-time re-scoring): CriticalKV's rescaled scores.
            for kv in 0..hkv {
                for h in kv * g..(kv + 1) * g {
                    for j in 0..t {
                        out[h * t + j] = (s[kv * t + j] + self.epsilon) * norm[kv * t + j];
                    }
                }
            }
            return Ok(());
        };
        let kept = select(
            &s,
            &norm,
            t,
            budget,
            self.alpha,
            self.first_stage_ratio,
            self.epsilon,
        );
        for kv in 0..hkv {
            let row = &mut s[kv * t..(kv + 1) * t];
            row.iter_mut().for_each(|x| *x = 0.0);
            for &j in &kept[kv] {
                row[j] = 1.0;
            }
            for h in kv * g..(kv + 1) * g {
                out[h * t..(h + 1) * t].copy_from_slice(row);
            }
        }
        Ok(())
    }
}
register!(
    Scorer,
    "critical_ada_kv",
    CriticalAdaKv,
    "CriticalAdaKV: CriticalKV's two stages inside Ada-KV's per-head budgets (use with the ada_kv selector)"
);
