//! Non-causal chunked attention (Chari & Van Durme 2025, Compactor's
//! attention term; kvpress's `NonCausalAttnPress`).
//!
//! The prompt is cut into aligned chunks of `chunk` tokens. Inside each chunk
//! every query attends to every key of the chunk, before and after it
//! (softmax of `q·k`, unscaled, as the reference does), and each key sums the
//! probability it receives. Per KV head the sums are averaged over the group's
//! query heads, multiplied by `‖v_j‖`, smoothed by a 3-wide average with zero
//! padding, and the layer's scores are z-normalized together. Every prompt
//! query is kept during prefill for this (`Needs::ALL_QUERIES`).
//!
//! Departure: the reference pads the last, shorter chunk with zero queries and
//! keys, so padded keys take probability and each padded query adds about
//! `1/chunk` to every key of that chunk; here the last chunk is attended as
//! it is.

use crate::leverage::z_normalize;
use minikv_core::{
    Error, Needs, Result, ScoreInputs, TokenScorer, broadcast_kv, check_range, register, simd,
};
use serde::{Deserialize, Serialize};

/// Non-causal chunked attention scorer (kvpress default: chunks of 256).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NonCausalAttention {
    /// Chunk length (256).
    pub chunk: usize,
}

impl Default for NonCausalAttention {
    fn default() -> Self {
        Self { chunk: 256 }
    }
}

/// Column sums of non-causal attention inside aligned chunks of `chunk`
/// rows, for one query head: `q` and `k` are `[n][d]`.
pub fn chunked_column_sums(q: &[f32], k: &[f32], n: usize, d: usize, chunk: usize) -> Vec<f32> {
    let mut acc = vec![0.0f32; n];
    let mut s = vec![0.0f32; chunk.min(n)];
    for c0 in (0..n).step_by(chunk.max(1)) {
        let c1 = (c0 + chunk).min(n);
        for i in c0..c1 {
            let qi = &q[i * d..(i + 1) * d];
            let row = &mut s[..c1 - c0];
            for (j, r) in row.iter_mut().enumerate() {
                *r = simd::dot(qi, &k[(c0 + j) * d..(c0 + j + 1) * d]);
            }
            simd::softmax_inplace(row);
            acc[c0..c1]
                .iter_mut()
                .zip(row.iter())
                .for_each(|(a, p)| *a += p);
        }
    }
    acc
}

/// The z-normalized scores `[Hkv][to - from]` of rows `from..to`, computed on
/// those rows alone (chunks aligned at `from`).
pub fn layer_scores(
    inp: &ScoreInputs<'_>,
    from: usize,
    to: usize,
    chunk: usize,
) -> Result<Vec<f32>> {
    use rayon::prelude::*;
    let (t, d, g) = (inp.t, inp.spec.head_dim, inp.spec.group());
    let wq = inp
        .window_queries
        .filter(|_| inp.window == t)
        .ok_or_else(|| {
            Error::Unsupported(
                "non-causal attention needs every prompt query, which is kept during prefill only"
                    .into(),
            )
        })?;
    let n = to - from;
    let per_q: Vec<Vec<f32>> = (0..inp.spec.n_q_heads)
        .into_par_iter()
        .map(|h| {
            let q = &wq[(h * t + from) * d..(h * t + to) * d];
            let k = &inp.keys[h / g][from * d..to * d];
            chunked_column_sums(q, k, n, d, chunk)
        })
        .collect();
    let mut all = vec![0.0f32; inp.spec.n_kv_heads * n];
    for (kv, row) in all
        .chunks_exact_mut(n.max(1))
        .enumerate()
        .take(inp.spec.n_kv_heads)
    {
        let mut a = vec![0.0f32; n];
        for p in &per_q[kv * g..(kv + 1) * g] {
            a.iter_mut().zip(p).for_each(|(x, y)| *x += y / g as f32);
        }
        let v = inp.values[kv];
        for (j, x) in a.iter_mut().enumerate() {
            let vj = &v[(from + j) * d..(from + j + 1) * d];
            *x *= simd::dot(vj, vj).sqrt();
        }
        for (j, r) in row.iter_mut().enumerate() {
            let lo = j.saturating_sub(1);
            let hi = (j + 1).min(n - 1);
            *r = a[lo..=hi].iter().sum::<f32>() / 3.0;
        }
    }
    z_normalize(&mut all);
    Ok(all)
}

#[typetag::serde(name = "non_causal_attention")]
impl TokenScorer for NonCausalAttention {
    fn needs(&self) -> Needs {
        Needs {
            query_window: Needs::ALL_QUERIES,
            ..Default::default()
        }
    }
    fn validate(&self) -> Result<()> {
        check_range("cache.scorer.chunk", self.chunk, 1, 65536)
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let s = layer_scores(inp, 0, inp.t, self.chunk)?;
        broadcast_kv(&s, inp.spec.n_q_heads, inp.spec.n_kv_heads, inp.t, out);
        Ok(())
    }
}
register!(
    Scorer,
    "non_causal_attention",
    NonCausalAttention,
    "Non-causal attention inside aligned chunks (Compactor's attention term): column sums x value norm, smoothed, z-normalized"
);
