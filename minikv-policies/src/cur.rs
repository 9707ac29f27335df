//! CurDKV (Sengupta et al. 2025; kvpress's `CURPress`): approximate leverage
//! scores of keys and values from their squared norms.
//!
//! Per KV head, `k2_j = ‖k_j‖²` and `v2_j = ‖v_j‖²` (optionally of the rows
//! projected by a seeded Gaussian `d × 20` matrix scaled by `1/√20`). With the
//! local approximation each is divided by its sum over the aligned window of
//! `local_window` tokens it falls in (the last window is shorter). The score is
//! `k2`, `v2`, their mean or their product, divided by its sum over the head;
//! the first `sinks` tokens score 1 (above every normalized score).
//! RoPE preserves norms, so post-RoPE keys give the same `k2` as pre-RoPE ones.

use minikv_core::{Error, Needs, Result, ScoreInputs, TokenScorer, broadcast_kv, register};
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

/// Which leverage the score combines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Leverage {
    /// Keys only.
    Key,
    /// Values only.
    Value,
    /// `(k2 + v2) / 2`.
    KvAvg,
    /// `k2 · v2` (the default).
    #[default]
    KvProduct,
}

/// CurDKV scorer (kvpress defaults).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Cur {
    /// Leading tokens that score 1 (4).
    pub sinks: usize,
    /// Which leverage is scored (`kv_product`).
    pub leverage: Leverage,
    /// Project keys and values by a seeded Gaussian matrix first (false).
    pub random_projection: bool,
    /// Seed of that projection.
    pub seed: u64,
    /// Normalize within aligned windows (true).
    pub local: bool,
    /// Window of the local normalization (16).
    pub local_window: usize,
}

impl Default for Cur {
    fn default() -> Self {
        Self {
            sinks: 4,
            leverage: Leverage::default(),
            random_projection: false,
            seed: 0,
            local: true,
            local_window: 16,
        }
    }
}

/// Columns of the random projection (kvpress's `r`).
const PROJECTION: usize = 20;

/// Squared norms of the `t` rows of `x` (`[t][d]`), after the projection `g`
/// (`[d][r]`) when given.
fn sq_norms(x: &[f32], t: usize, d: usize, g: Option<&[f32]>, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate().take(t) {
        let row = &x[j * d..(j + 1) * d];
        *o = match g {
            None => row.iter().map(|a| a * a).sum(),
            Some(g) => (0..PROJECTION)
                .map(|c| {
                    let y: f32 = row
                        .iter()
                        .enumerate()
                        .map(|(i, a)| a * g[i * PROJECTION + c])
                        .sum();
                    y * y
                })
                .sum(),
        };
    }
}

/// Divides each aligned window of `w` entries by its sum.
fn normalize_windows(x: &mut [f32], w: usize) {
    for c in x.chunks_mut(w) {
        let s: f32 = c.iter().sum();
        if s > 0.0 {
            c.iter_mut().for_each(|a| *a /= s);
        }
    }
}

#[typetag::serde(name = "cur")]
impl TokenScorer for Cur {
    fn needs(&self) -> Needs {
        Needs::default()
    }
    fn validate(&self) -> Result<()> {
        if !(1..=65536).contains(&self.local_window) {
            return Err(Error::config(
                "cache.scorer.local_window",
                format!("must be in 1..=65536, got {}", self.local_window),
            ));
        }
        Ok(())
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let (t, d) = (inp.t, inp.spec.head_dim);
        let proj: Option<Vec<f32>> = self.random_projection.then(|| {
            let mut rng = crate::random::stream(self.seed, inp.layer, usize::MAX);
            let s = 1.0 / (PROJECTION as f32).sqrt();
            (0..d * PROJECTION)
                .map(|_| {
                    let x: f64 = StandardNormal.sample(&mut rng);
                    x as f32 * s
                })
                .collect::<Vec<f32>>()
        });
        let (mut k2, mut v2) = (vec![0.0f32; t], vec![0.0f32; t]);
        let mut kv_rows = vec![0.0f32; inp.spec.n_kv_heads * t];
        for (kv, row) in kv_rows.chunks_exact_mut(t).enumerate() {
            sq_norms(inp.keys[kv], t, d, proj.as_deref(), &mut k2);
            sq_norms(inp.values[kv], t, d, proj.as_deref(), &mut v2);
            if self.local {
                normalize_windows(&mut k2, self.local_window);
                normalize_windows(&mut v2, self.local_window);
            }
            for ((r, &a), &b) in row.iter_mut().zip(&k2).zip(&v2) {
                *r = match self.leverage {
                    Leverage::Key => a,
                    Leverage::Value => b,
                    Leverage::KvAvg => (a + b) / 2.0,
                    Leverage::KvProduct => a * b,
                };
            }
            let s: f32 = row.iter().sum();
            if s > 0.0 {
                row.iter_mut().for_each(|r| *r /= s);
            }
            row[..self.sinks.min(t)].fill(1.0);
        }
        broadcast_kv(&kv_rows, inp.spec.n_q_heads, inp.spec.n_kv_heads, t, out);
        Ok(())
    }
}
register!(
    Scorer,
    "cur",
    Cur,
    "CurDKV: key x value leverage from squared norms, normalized in local windows; sinks kept"
);
