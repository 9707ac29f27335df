//! LagKV (Liang et al. 2025; kvpress's `LagKVPress`, docs/algorithms.md
//! "LagKV"): attention-free scoring of each partition of `lag` tokens against
//! the min/max statistics of the partition that follows it.
//!
//! Per KV head, after `n_sink` sink tokens the prompt is cut into partitions
//! of `lag` tokens; the last whole partition and the remainder (the tail)
//! have no successor and are kept. A token `x` of partition `p` (keys and
//! values alike) is normalized by the per-channel min and max of partition
//! `p + 1`, `(x − min)/(max − min)`; its score is the standard deviation of
//! that over channels, softmaxed within the partition, averaged over keys and
//! values. Without `cross_scoring` the score is the token's rank within its
//! partition divided by `lag`. Sinks and the tail score 1 (above all ranks;
//! 2 with cross scoring, above any softmax value).
//! A prompt shorter than `n_sink + 2·lag` is not partitioned: scores rise
//! with position. Channels whose successor range is 0 contribute 0.

use minikv_core::{Needs, Result, ScoreInputs, TokenScorer, check_range, register, simd};
use serde::{Deserialize, Serialize};

/// LagKV scorer (kvpress defaults: 4 sinks, partitions of 128).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LagKv {
    /// Protected leading tokens (4).
    pub n_sink: usize,
    /// Partition length (128).
    pub lag_size: usize,
    /// Keep the softmaxed statistics as scores instead of in-partition ranks
    /// (comparable across partitions and heads, e.g. under Ada-KV).
    pub cross_scoring: bool,
}

impl Default for LagKv {
    fn default() -> Self {
        Self {
            n_sink: 4,
            lag_size: 128,
            cross_scoring: false,
        }
    }
}

/// Rows `s .. s + lag` of `m` (`[T][d]`).
fn span(m: &[f32], s: usize, lag: usize, d: usize) -> &[f32] {
    &m[s * d..(s + lag) * d]
}

/// Scores of partition rows `x` (`[lag][d]`) against reference rows `r`.
fn lag_scores(x: &[f32], r: &[f32], d: usize, out: &mut [f32]) {
    let (mut lo, mut hi) = (vec![f32::INFINITY; d], vec![f32::NEG_INFINITY; d]);
    for row in r.chunks_exact(d) {
        for c in 0..d {
            lo[c] = lo[c].min(row[c]);
            hi[c] = hi[c].max(row[c]);
        }
    }
    let mut z = vec![0.0f32; d];
    for (o, row) in out.iter_mut().zip(x.chunks_exact(d)) {
        for c in 0..d {
            let range = hi[c] - lo[c];
            z[c] = if range > 0.0 {
                (row[c] - lo[c]) / range
            } else {
                0.0
            };
        }
        let mean = z.iter().sum::<f32>() / d as f32;
        let var = z.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / (d.max(2) - 1) as f32;
        *o = var.sqrt();
    }
    simd::softmax_inplace(out);
}

#[typetag::serde(name = "lagkv")]
impl TokenScorer for LagKv {
    fn needs(&self) -> Needs {
        Needs::default()
    }
    fn validate(&self) -> Result<()> {
        check_range("cache.scorer.lag_size", self.lag_size, 1, 65536)?;
        check_range("cache.scorer.n_sink", self.n_sink, 0, 65536)
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let (t, d, g) = (inp.t, inp.spec.head_dim, inp.spec.group());
        let (sink, lag) = (self.n_sink, self.lag_size);
        // Protected tokens score 1 above every rank; with cross scoring 2, as
        // a softmax can round to exactly 1 (kvpress writes 1 in both modes).
        let top = if self.cross_scoring { 2.0 } else { 1.0 };
        let mut row = vec![top; t];
        for kv in 0..inp.spec.n_kv_heads {
            row.fill(top);
            if t < sink + 2 * lag {
                if t > sink {
                    for (i, r) in row[sink..].iter_mut().enumerate() {
                        *r = i as f32 / (t - sink) as f32;
                    }
                }
            } else {
                let parts = (t - sink) / lag - 1; // partitions with a successor
                let (mut ks, mut vs) = (vec![0.0f32; lag], vec![0.0f32; lag]);
                for p in 0..parts {
                    let a = sink + p * lag;
                    let (k, v) = (inp.keys[kv], inp.values[kv]);
                    lag_scores(span(k, a, lag, d), span(k, a + lag, lag, d), d, &mut ks);
                    lag_scores(span(v, a, lag, d), span(v, a + lag, lag, d), d, &mut vs);
                    let s = &mut row[a..a + lag];
                    for i in 0..lag {
                        s[i] = (ks[i] + vs[i]) / 2.0;
                    }
                    if !self.cross_scoring {
                        let mut order: Vec<usize> = (0..lag).collect();
                        order.sort_by(|&x, &y| s[x].total_cmp(&s[y]).then(x.cmp(&y)));
                        for (rank, &i) in order.iter().enumerate() {
                            ks[i] = rank as f32 / lag as f32;
                        }
                        s.copy_from_slice(&ks);
                    }
                }
            }
            for h in kv * g..(kv + 1) * g {
                out[h * t..(h + 1) * t].copy_from_slice(&row);
            }
        }
        Ok(())
    }
}
register!(
    Scorer,
    "lagkv",
    LagKv,
    "LagKV: each partition of lag_size tokens scored by the spread of its keys and values normalized by the next partition's min/max; sinks and the last partition kept"
);
