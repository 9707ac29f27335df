//! Token scorers (docs/algorithms.md §3).

use minikv_core::{
    DecodeScore, DecodeStep, Error, Needs, Result, ScoreInputs, TokenScorer, register, simd,
};
use serde::{Deserialize, Serialize};

/// MiniKV / H2O cumulative attention `A_cumul`: column sums of the causal softmax
/// over all prompt rows. Prefill-only (frozen selection, MiniKV).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CumulativeAttention {
    /// Divide each column by the number of rows that see it (kvpress variant).
    #[serde(default)]
    pub normalize: bool,
}

fn cumul_scores(normalize: bool, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
    let c = inp
        .cumulative
        .ok_or_else(|| Error::Unsupported("cumulative attention was not collected".into()))?;
    out.copy_from_slice(c);
    if normalize {
        let t = inp.t;
        for row in out.chunks_mut(t) {
            for (j, x) in row.iter_mut().enumerate() {
                *x /= (t - j) as f32;
            }
        }
    }
    Ok(())
}

#[typetag::serde(name = "cumulative_attention")]
impl TokenScorer for CumulativeAttention {
    fn needs(&self) -> Needs {
        Needs {
            cumulative_attention: true,
            query_window: 0,
            ..Default::default()
        }
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        cumul_scores(self.normalize, inp, out)
    }
}
register!(
    Scorer,
    "cumulative_attention",
    CumulativeAttention,
    "MiniKV/H2O A_cumul: column sums of the causal softmax over all prompt rows (normalize: divide by rows that see the column)"
);

/// H2O: `A_cumul` at the end of prefill, then scores keep accumulating during
/// decode and the lowest-scored token outside the recent window is evicted.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct H2o {
    /// Divide each column by the number of rows that see it.
    #[serde(default)]
    pub normalize: bool,
}

#[typetag::serde(name = "h2o")]
impl TokenScorer for H2o {
    fn needs(&self) -> Needs {
        Needs {
            cumulative_attention: true,
            query_window: 0,
            ..Default::default()
        }
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        cumul_scores(self.normalize, inp, out)
    }
    fn decode_score(&self) -> Option<&dyn DecodeScore> {
        Some(&Accumulate)
    }
}
register!(
    Scorer,
    "h2o",
    H2o,
    "H2O: A_cumul, accumulated during decode (use with decode = \"evict\")"
);

/// SnapKV pooling.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// Average pooling, zero padding counted.
    Avg,
    /// Max pooling, `-inf` padding.
    #[default]
    Max,
}

/// SnapKV: attention of the last `window` prompt queries, pooled.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SnapKv {
    /// Observation window `W` (last prompt queries).
    pub window: usize,
    /// Pooling kernel `k` (odd); 1 disables pooling.
    pub kernel: usize,
    /// Pooling type.
    pub pooling: Pooling,
    /// Average the window rows' attention (kvpress) instead of summing them
    /// (SnapKV's reference). The ranking is the same; a wrapper that adds a
    /// constant to the scores (CriticalKV's `epsilon`) sees the scale.
    #[serde(skip_serializing_if = "is_false")]
    pub average: bool,
}
impl Default for SnapKv {
    /// MiniKV's SnapKV settings: W = 32, k = 7, max pooling.
    fn default() -> Self {
        Self {
            window: 32,
            kernel: 7,
            pooling: Pooling::Max,
            average: false,
        }
    }
}

/// Softmax rows of `q_window · K^T / sqrt(d)` for one query head, causal inside
/// the window; calls `f(row_index, probs)` per row.
pub(crate) fn window_softmax(
    inp: &ScoreInputs<'_>,
    h: usize,
    mut f: impl FnMut(usize, &[f32]),
) -> Result<()> {
    let (t, w, d) = (inp.t, inp.window, inp.spec.head_dim);
    let wq = inp
        .window_queries
        .ok_or_else(|| Error::Unsupported("window queries were not collected".into()))?;
    let k = inp.keys[inp.spec.kv_head_of(h)];
    let scale = 1.0 / (d as f32).sqrt();
    let mut s = vec![0.0f32; t];
    for i in 0..w {
        let pos = t - w + i;
        let qi = &wq[(h * w + i) * d..(h * w + i + 1) * d];
        for j in 0..=pos {
            s[j] = simd::dot(qi, &k[j * d..(j + 1) * d]) * scale;
        }
        simd::softmax_inplace(&mut s[..=pos]);
        f(i, &s[..=pos]);
    }
    Ok(())
}

/// 1-D pooling with `same` padding.
pub fn pool1d(x: &[f32], kernel: usize, pooling: Pooling) -> Vec<f32> {
    if kernel <= 1 {
        return x.to_vec();
    }
    let r = kernel / 2;
    let n = x.len();
    (0..n)
        .map(|i| {
            let lo = i.saturating_sub(r);
            let hi = (i + r).min(n - 1);
            let win = &x[lo..=hi];
            match pooling {
                Pooling::Max => win.iter().copied().fold(f32::NEG_INFINITY, f32::max),
                Pooling::Avg => win.iter().sum::<f32>() / kernel as f32,
            }
        })
        .collect()
}

#[typetag::serde(name = "snapkv")]
impl TokenScorer for SnapKv {
    fn needs(&self) -> Needs {
        Needs {
            cumulative_attention: false,
            query_window: self.window,
            ..Default::default()
        }
    }
    fn validate(&self) -> Result<()> {
        if !(1..=65536).contains(&self.window) {
            return Err(Error::config(
                "cache.scorer.window",
                format!("must be in 1..=65536, got {}", self.window),
            ));
        }
        if self.kernel == 0 || self.kernel.is_multiple_of(2) || self.kernel > 1025 {
            return Err(Error::config(
                "cache.scorer.kernel",
                format!("must be odd and at most 1025, got {}", self.kernel),
            ));
        }
        Ok(())
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let (t, w) = (inp.t, inp.window);
        let prefix = t - w;
        for h in 0..inp.spec.n_q_heads {
            let mut acc = vec![0.0f32; prefix];
            window_softmax(inp, h, |_, p| {
                acc.iter_mut().zip(p).for_each(|(a, b)| *a += b);
            })?;
            if self.average {
                let inv = 1.0 / w as f32;
                acc.iter_mut().for_each(|a| *a *= inv);
            }
            let pooled = pool1d(&acc, self.kernel, self.pooling);
            let row = &mut out[h * t..(h + 1) * t];
            row[..prefix].copy_from_slice(&pooled);
            let top = pooled.iter().copied().fold(0.0f32, f32::max) + 1.0;
            row[prefix..].fill(top);
        }
        Ok(())
    }
}
register!(
    Scorer,
    "snapkv",
    SnapKv,
    "SnapKV: attention of the last `window` prompt queries, pooled (kernel, avg|max); the window itself scores highest"
);

/// TOVA: attention of the latest query, averaged over the heads of the layer.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tova {}

#[typetag::serde(name = "tova")]
impl TokenScorer for Tova {
    fn needs(&self) -> Needs {
        Needs {
            cumulative_attention: false,
            query_window: 1,
            ..Default::default()
        }
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let t = inp.t;
        let hq = inp.spec.n_q_heads;
        let mut mean = vec![0.0f32; t];
        for h in 0..hq {
            window_softmax(inp, h, |_, p| {
                mean.iter_mut()
                    .zip(p)
                    .for_each(|(a, b)| *a += b / hq as f32);
            })?;
        }
        for row in out.chunks_mut(t) {
            row.copy_from_slice(&mean);
        }
        Ok(())
    }
    fn decode_score(&self) -> Option<&dyn DecodeScore> {
        Some(&LastQuery)
    }
}
register!(
    Scorer,
    "tova",
    Tova,
    "TOVA: attention of the latest query, mean over the layer's heads; re-scored every decode step"
);

/// Key norm (Knorm): score = `-||k_j||` (low-norm keys attract attention).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyNorm {}

#[typetag::serde(name = "key_norm")]
impl TokenScorer for KeyNorm {
    fn needs(&self) -> Needs {
        Needs::default()
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let (t, d) = (inp.t, inp.spec.head_dim);
        for h in 0..inp.spec.n_q_heads {
            let k = inp.keys[inp.spec.kv_head_of(h)];
            for j in 0..t {
                let kj = &k[j * d..(j + 1) * d];
                out[h * t + j] = -simd::dot(kj, kj).sqrt();
            }
        }
        Ok(())
    }
}
register!(Scorer, "key_norm", KeyNorm, "Knorm: score = -||k||");

/// Recency: newer tokens score higher. With `heavy = 0`, `sinks = 4` and
/// `decode = "evict"` this is StreamingLLM. `n_sink` makes the first tokens
/// score above all others *inside* the budget (kvpress's StreamingLLMPress,
/// where the sinks are counted in the kept share), unlike `cache.sinks`,
/// which protects them on top of it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recency {
    /// Leading tokens ranked first (0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub n_sink: usize,
}

fn is_zero(x: &usize) -> bool {
    *x == 0
}

#[typetag::serde(name = "recency")]
impl TokenScorer for Recency {
    fn needs(&self) -> Needs {
        Needs::default()
    }
    fn validate(&self) -> Result<()> {
        minikv_core::check_range("cache.scorer.n_sink", self.n_sink, 0, 65536)
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let t = inp.t;
        for row in out.chunks_mut(t) {
            row.iter_mut().enumerate().for_each(|(j, x)| {
                *x = if j < self.n_sink {
                    (t + self.n_sink - j) as f32
                } else {
                    j as f32
                }
            });
        }
        Ok(())
    }
    fn decode_score(&self) -> Option<&dyn DecodeScore> {
        Some(&Newest)
    }
}
register!(
    Scorer,
    "recency",
    Recency,
    "position (newer = higher); StreamingLLM with sinks + recent window and decode = \"evict\""
);

/// H2O's decode-time rule: each step's attention is added to the running score.
#[derive(Debug, Clone, Copy, Default)]
pub struct Accumulate;

impl DecodeScore for Accumulate {
    fn update(&self, step: &DecodeStep<'_>, scores: &mut [f32]) {
        scores.iter_mut().zip(step.probs).for_each(|(s, p)| *s += p);
    }
}

/// TOVA's decode-time rule: the score is the latest query's attention,
/// averaged over the layer's heads when their rows align.
#[derive(Debug, Clone, Copy, Default)]
pub struct LastQuery;

impl DecodeScore for LastQuery {
    fn wants_layer_mean(&self) -> bool {
        true
    }
    fn update(&self, step: &DecodeStep<'_>, scores: &mut [f32]) {
        scores.copy_from_slice(step.layer_mean.unwrap_or(step.probs));
    }
}

/// StreamingLLM's decode-time rule: the score is the position (oldest first out).
#[derive(Debug, Clone, Copy, Default)]
pub struct Newest;

impl DecodeScore for Newest {
    fn initial(&self, position: u32, _prefill: f32) -> f32 {
        position as f32
    }
    fn update(&self, step: &DecodeStep<'_>, scores: &mut [f32]) {
        scores
            .iter_mut()
            .zip(step.positions)
            .for_each(|(s, &p)| *s = p as f32);
    }
}

/// KeyDiff (Park et al. 2025): keys least similar to the layer-head's mean
/// direction are kept. Per KV head, the anchor is the mean of the
/// L2-normalized keys; a token scores `-cos(k_j, anchor)` (kvpress's
/// `KeyDiffPress`). Needs keys only: no attention, no queries.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyDiff {}

#[typetag::serde(name = "key_diff")]
impl TokenScorer for KeyDiff {
    fn needs(&self) -> Needs {
        Needs::default()
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let (t, d) = (inp.t, inp.spec.head_dim);
        let hkv = inp.spec.n_kv_heads;
        let mut anchor = vec![0.0f32; d];
        let mut row = vec![0.0f32; t];
        for kv in 0..hkv {
            let k = inp.keys[kv];
            anchor.fill(0.0);
            for j in 0..t {
                let kj = &k[j * d..(j + 1) * d];
                let n = simd::dot(kj, kj).sqrt().max(1e-12);
                simd::axpy(1.0 / (n * t as f32), kj, &mut anchor);
            }
            let an = simd::dot(&anchor, &anchor).sqrt().max(1e-12);
            for (j, r) in row.iter_mut().enumerate() {
                let kj = &k[j * d..(j + 1) * d];
                let n = simd::dot(kj, kj).sqrt().max(1e-12);
                *r = -simd::dot(kj, &anchor) / (n * an);
            }
            for h in kv * inp.spec.group()..(kv + 1) * inp.spec.group() {
                out[h * t..(h + 1) * t].copy_from_slice(&row);
            }
        }
        Ok(())
    }
}
register!(
    Scorer,
    "key_diff",
    KeyDiff,
    "KeyDiff: -cosine of each key with the mean normalized key of its head (diverse keys kept)"
);

/// ChunkKV (Liu et al. 2025): selection of whole chunks. Wraps any scorer: a
/// token's score becomes the sum of its scorer's scores over the chunk of
/// `chunk` consecutive prompt tokens it belongs to, so top-k selection keeps
/// whole chunks (the last chunk taken may be cut by the budget, lower
/// positions first). By default each head chooses its own chunks; with
/// `shared` the scores are first summed over every head of the layer, so all
/// heads keep the same chunks, and with `mean` a chunk scores the mean of its
/// tokens (the last, shorter chunk is not penalized): together kvpress's
/// `ChunkKVPress`, which also keeps whole chunks only (`⌊chunks·(1 - ratio)⌋`
/// of them, so a few tokens fewer than the budget).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ChunkKv {
    /// Tokens per chunk (ChunkKV's default: 10).
    pub chunk: usize,
    /// One selection for every head: scores summed over heads first.
    #[serde(skip_serializing_if = "is_false")]
    pub shared: bool,
    /// A chunk scores the mean of its tokens instead of their sum.
    #[serde(skip_serializing_if = "is_false")]
    pub mean: bool,
    /// The scorer whose scores are summed per chunk.
    pub scorer: Box<dyn TokenScorer>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl Default for ChunkKv {
    fn default() -> Self {
        Self {
            chunk: 10,
            shared: false,
            mean: false,
            scorer: Box::new(SnapKv::default()),
        }
    }
}

#[typetag::serde(name = "chunk_kv")]
impl TokenScorer for ChunkKv {
    fn needs(&self) -> Needs {
        self.scorer.needs()
    }
    fn validate(&self) -> Result<()> {
        if !(1..=4096).contains(&self.chunk) {
            return Err(Error::config(
                "cache.scorer.chunk",
                format!("must be in 1..=4096, got {}", self.chunk),
            ));
        }
        self.scorer.validate()
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        self.scorer.score(inp, out)?;
        let t = inp.t;
        if self.shared {
            let mut total = vec![0.0f32; t];
            for row in out.chunks(t) {
                total.iter_mut().zip(row).for_each(|(a, b)| *a += b);
            }
            for row in out.chunks_mut(t) {
                row.copy_from_slice(&total);
            }
        }
        for row in out.chunks_mut(t) {
            for c in row.chunks_mut(self.chunk) {
                let s: f32 = c.iter().sum();
                let s = if self.mean { s / c.len() as f32 } else { s };
                c.fill(s);
            }
        }
        Ok(())
    }
}
register!(
    Scorer,
    "chunk_kv",
    ChunkKv,
    "ChunkKV: any scorer's scores summed over chunks of `chunk` tokens, so whole chunks are kept"
);
