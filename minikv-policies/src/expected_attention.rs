//! Expected Attention (kvpress's `ExpectedAttentionPress`, docs/algorithms.md
//! "Expected Attention"): keys are scored by the attention that *future*
//! queries are expected to pay them, from the statistics of the prompt's
//! queries.
//!
//! Per query head, the mean `μ` and covariance `Σ` of the pre-RoPE prompt
//! queries (positions from `n_sink` on) are rotated by the RoPE rotation
//! averaged over the next `n_future_positions` positions, `R̄`:
//! `μ' = R̄μ`, `Σ' = R̄ Σ R̄ᵀ`. For a Gaussian query `q ~ N(μ', Σ')`,
//! `E[exp(q·k/√d)] = exp(μ'·k/√d + kᵀΣ'k / 2d)`; the expected logits are
//! softmaxed over the non-sink tokens, averaged over the query heads of a KV
//! head, and multiplied by the value norm (`(s + ε)·‖v‖`). The first `n_sink`
//! tokens score above every other token. The model supplies the pre-RoPE
//! queries and its RoPE through the cache's observation channel.

use minikv_core::{Error, Needs, Result, ScoreInputs, TokenScorer, check_range, register, simd};
use serde::{Deserialize, Serialize};

/// Expected Attention scorer (kvpress defaults).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExpectedAttention {
    /// Future positions the RoPE rotation is averaged over (512).
    pub n_future_positions: usize,
    /// Leading tokens protected as attention sinks and left out of the query
    /// statistics (4).
    pub n_sink: usize,
    /// Include the covariance term (true).
    pub use_covariance: bool,
    /// Multiply by the value norm (true).
    pub use_vnorm: bool,
    /// Added to the expected attention before the value-norm product (0).
    pub epsilon: f32,
}

impl Default for ExpectedAttention {
    fn default() -> Self {
        Self {
            n_future_positions: 512,
            n_sink: 4,
            use_covariance: true,
            use_vnorm: true,
            epsilon: 0.0,
        }
    }
}

/// `R̄x` for one head: the averaged rotation applied pair by pair.
pub(crate) fn rotate(
    x: &[f64],
    cos: &[f64],
    sin: &[f64],
    pair: impl Fn(usize) -> (usize, usize),
) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for i in 0..cos.len() {
        let (a, b) = pair(i);
        y[a] = cos[i] * x[a] - sin[i] * x[b];
        y[b] = sin[i] * x[a] + cos[i] * x[b];
    }
    y
}

#[typetag::serde(name = "expected_attention")]
impl TokenScorer for ExpectedAttention {
    fn needs(&self) -> Needs {
        Needs {
            query_stats_from: Some(self.n_sink),
            ..Default::default()
        }
    }
    fn validate(&self) -> Result<()> {
        check_range(
            "cache.scorer.n_future_positions",
            self.n_future_positions,
            1,
            1 << 20,
        )?;
        check_range("cache.scorer.n_sink", self.n_sink, 0, 65536)?;
        check_range("cache.scorer.epsilon", self.epsilon, 0.0, 1e6)
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let (t, d, hq) = (inp.t, inp.spec.head_dim, inp.spec.n_q_heads);
        let sink = self.n_sink.min(t);
        if sink == t {
            out.fill(1.0);
            return Ok(());
        }
        let stats = inp.query_stats.ok_or_else(|| {
            Error::Unsupported(
                "expected_attention needs the pre-RoPE query statistics of the prompt, which \
                 the model supplies during prefill (decode-time re-scoring does not have them)"
                    .into(),
            )
        })?;
        let (cos, sin) = stats.rope.mean_rotation(t, self.n_future_positions);
        let pair = |i| stats.rope.pair(i, d);
        let inv_sqrt_d = 1.0 / (d as f64).sqrt();
        let mut covr = vec![0.0f32; d * d];
        let mut tmp = vec![0.0f64; d * d];
        let mut logits = vec![0.0f32; t - sink];
        for h in 0..hq {
            let mu = rotate(&stats.mean[h * d..(h + 1) * d], &cos, &sin, pair);
            let mu32: Vec<f32> = mu.iter().map(|&x| (x * inv_sqrt_d) as f32).collect();
            if self.use_covariance {
                // Σ' = R̄ Σ R̄ᵀ: rotate the columns (rows of Σᵀ = Σ), then the rows.
                let cov = &stats.cov[h * d * d..(h + 1) * d * d];
                for a in 0..d {
                    let col: Vec<f64> = (0..d).map(|b| cov[b * d + a]).collect();
                    let r = rotate(&col, &cos, &sin, pair);
                    for b in 0..d {
                        tmp[b * d + a] = r[b];
                    }
                }
                for b in 0..d {
                    let r = rotate(&tmp[b * d..(b + 1) * d], &cos, &sin, pair);
                    for a in 0..d {
                        covr[b * d + a] = (r[a] / (2.0 * d as f64)) as f32;
                    }
                }
            }
            let k = inp.keys[inp.spec.kv_head_of(h)];
            for (j, l) in (sink..t).zip(logits.iter_mut()) {
                let kj = &k[j * d..(j + 1) * d];
                let mut s = simd::dot(kj, &mu32);
                if self.use_covariance {
                    for (a, &ka) in kj.iter().enumerate() {
                        s += ka * simd::dot(&covr[a * d..(a + 1) * d], kj);
                    }
                }
                *l = s;
            }
            simd::softmax_inplace(&mut logits);
            let v = inp.values[inp.spec.kv_head_of(h)];
            let row = &mut out[h * t..(h + 1) * t];
            for (j, &p) in (sink..t).zip(logits.iter()) {
                row[j] = if self.use_vnorm {
                    let vj = &v[j * d..(j + 1) * d];
                    (p + self.epsilon) * simd::dot(vj, vj).sqrt()
                } else {
                    p
                };
            }
        }
        if sink > 0 {
            let top = (0..hq)
                .flat_map(|h| out[h * t + sink..(h + 1) * t].iter().copied())
                .fold(f32::NEG_INFINITY, f32::max);
            for h in 0..hq {
                out[h * t..h * t + sink].fill(top + 1.0);
            }
        }
        Ok(())
    }
}
register!(
    Scorer,
    "expected_attention",
    ExpectedAttention,
    "Expected Attention: softmax of the attention expected from the prompt queries' mean and covariance, RoPE-averaged over future positions, times the value norm; sinks kept"
);
