//! CAPKV (kvpress's `CapPress`): tokens scored by the capacity they add to
//! the span of values that queries are expected to read.
//!
//! Per query head, the anchor `μ` is the mean pre-RoPE prompt query (positions
//! from `n_sink` on) rotated by the RoPE rotation averaged over the next
//! `n_future_positions` positions (as Expected Attention). Over the non-sink
//! tokens: `c_j = cos(μ, k_j)` (clamped to [-1, 1]), `w_j = exp(τ(c_j - max c))`,
//! `A = I + Σ_j (w_j + ε) v_j v_jᵀ` and the score is `w_j · v_jᵀ A⁻¹ v_j`,
//! averaged over the query heads of a KV head. The sinks score above every
//! other token. The model supplies the pre-RoPE query statistics.

use minikv_core::{Error, Needs, Result, ScoreInputs, TokenScorer, check_range, register, simd};
use serde::{Deserialize, Serialize};

/// CAPKV scorer (kvpress defaults).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Cap {
    /// Temperature of the query-key alignment weights (5).
    pub tau: f32,
    /// Future positions the RoPE rotation is averaged over (512).
    pub n_future_positions: usize,
    /// Leading tokens protected and left out of the statistics (4).
    pub n_sink: usize,
    /// Added to the weights inside `A` (1e-6).
    pub epsilon: f32,
}

impl Default for Cap {
    fn default() -> Self {
        Self {
            tau: 5.0,
            n_future_positions: 512,
            n_sink: 4,
            epsilon: 1e-6,
        }
    }
}

/// The scores of one query head over rows `v`/`k` (`[n][d]`) for the rotated
/// anchor `mu`, into `out[n]`.
fn head_scores(
    cap: &Cap,
    mu: &[f64],
    k: &[f32],
    v: &[f32],
    d: usize,
    out: &mut [f32],
) -> Result<()> {
    let n = out.len();
    let mn = mu.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
    let stat: Vec<f64> = k
        .chunks_exact(d)
        .take(n)
        .map(|kj| {
            let kn = kj
                .iter()
                .map(|&x| (x as f64).powi(2))
                .sum::<f64>()
                .sqrt()
                .max(1e-12);
            let dot: f64 = kj.iter().zip(mu).map(|(&a, b)| a as f64 * b).sum();
            (dot / (mn * kn)).clamp(-1.0, 1.0)
        })
        .collect();
    let top = stat.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = stat
        .iter()
        .map(|c| (cap.tau as f64 * (c - top)).exp())
        .collect();
    let mut a = vec![0.0f64; d * d];
    for i in 0..d {
        a[i * d + i] = 1.0;
    }
    for (vj, &wj) in v.chunks_exact(d).zip(&w) {
        let s = wj + cap.epsilon as f64;
        for r in 0..d {
            let x = s * vj[r] as f64;
            for c in 0..d {
                a[r * d + c] += x * vj[c] as f64;
            }
        }
    }
    let l = crate::leverage::cholesky(&a, d)
        .ok_or_else(|| Error::Input("cap: the capacity matrix is not positive definite".into()))?;
    let mut z = vec![0.0f64; d];
    for ((o, vj), &wj) in out.iter_mut().zip(v.chunks_exact(d)).zip(&w) {
        for i in 0..d {
            let s: f64 = (0..i).map(|c| l[i * d + c] * z[c]).sum();
            z[i] = (vj[i] as f64 - s) / l[i * d + i];
        }
        *o = (wj * z.iter().map(|x| x * x).sum::<f64>()) as f32;
    }
    Ok(())
}

#[typetag::serde(name = "cap")]
impl TokenScorer for Cap {
    fn needs(&self) -> Needs {
        Needs {
            query_stats_from: Some(self.n_sink),
            ..Default::default()
        }
    }
    fn validate(&self) -> Result<()> {
        check_range("cache.scorer.tau", self.tau, 0.0, 1e3)?;
        check_range(
            "cache.scorer.n_future_positions",
            self.n_future_positions,
            1,
            1 << 20,
        )?;
        check_range("cache.scorer.epsilon", self.epsilon, 0.0, 1.0)
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let (t, d, g) = (inp.t, inp.spec.head_dim, inp.spec.group());
        let sink = self.n_sink.min(t);
        if sink == t {
            out.fill(1.0);
            return Ok(());
        }
        let stats = inp.query_stats.ok_or_else(|| {
            Error::Unsupported(
                "cap needs the pre-RoPE query statistics of the prompt, which the model supplies \
                 during prefill (decode-time re-scoring does not have them)"
                    .into(),
            )
        })?;
        let (cos, sin) = stats.rope.mean_rotation(t, self.n_future_positions);
        let pair = |i| stats.rope.pair(i, d);
        let n = t - sink;
        let mut kv_rows = vec![0.0f32; inp.spec.n_kv_heads * n];
        let mut row = vec![0.0f32; n];
        for h in 0..inp.spec.n_q_heads {
            let kv = h / g;
            let mu = crate::expected_attention::rotate(
                &stats.mean[h * d..(h + 1) * d],
                &cos,
                &sin,
                pair,
            );
            let k = &inp.keys[kv][sink * d..t * d];
            let v = &inp.values[kv][sink * d..t * d];
            head_scores(self, &mu, k, v, d, &mut row)?;
            simd::axpy(1.0 / g as f32, &row, &mut kv_rows[kv * n..(kv + 1) * n]);
        }
        let top = kv_rows.iter().copied().fold(f32::NEG_INFINITY, f32::max) + 1.0;
        for h in 0..inp.spec.n_q_heads {
            let kv = h / g;
            let r = &mut out[h * t..(h + 1) * t];
            r[..sink].fill(top);
            r[sink..].copy_from_slice(&kv_rows[kv * n..(kv + 1) * n]);
        }
        Ok(())
    }
}
register!(
    Scorer,
    "cap",
    Cap,
    "CAPKV: query-aligned weights times each value's leverage in the weighted value span; sinks kept"
);
