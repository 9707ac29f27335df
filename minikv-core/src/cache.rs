//! The model-facing KV cache contract.

use crate::{ModelSpec, Result};
use serde::Serialize;

use std::fmt::Debug;

/// Where a cache is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Prompt chunks are appended in full precision; attention is exact.
    Prefill,
    /// The cache has been compressed; one token per step.
    Decode,
}

/// What a model calls. Models never name a concrete cache, policy, quantizer or
/// backend: a new method is a new config, not a model change.
///
/// Per layer and step, a model calls [`append`](KvCache::append) with the new
/// tokens' keys and values, then [`attend`](KvCache::attend) with their queries.
/// After the whole prompt it calls [`end_prefill`](KvCache::end_prefill).
/// Tensors are token-major: `k`, `v` are `[n][Hkv * d]`, `q` and `out` are
/// `[n][Hq * d]`, all post-RoPE.
pub trait KvCache: Send + Debug {
    /// The model shape this cache was built for.
    fn spec(&self) -> &ModelSpec;
    /// Current phase.
    fn phase(&self) -> Phase;
    /// Tokens seen so far by `layer` (the next token's position).
    fn seq_len(&self, layer: usize) -> usize;
    /// Adds `n` new tokens to `layer`. In decode, `n` must be 1.
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32], n: usize) -> Result<()>;
    /// Attention of the last `n` appended tokens' queries over the layer.
    fn attend(&mut self, layer: usize, q: &[f32], n: usize, out: &mut [f32]) -> Result<()>;
    /// Compresses (selection, quantization) at the end of prefill.
    fn end_prefill(&mut self) -> Result<()>;
    /// Bytes actually allocated, per layer and head.
    fn memory(&self) -> MemoryReport;
    /// Per-layer token budgets chosen at the end of prefill (empty before).
    fn budgets(&self) -> Vec<crate::LayerBudget>;
    /// Empties the cache for a new sequence (fresh stores are created:
    /// an error if the storage cannot make them).
    fn reset(&mut self) -> Result<()>;
    /// An upper bound on the [`MemoryReport::kv_bytes`] this cache will
    /// report from the end of prefill of a `prompt`-token prompt through
    /// `max_new` decoded tokens (stored K/V with their scales, residuals,
    /// indices and extra entries; staging and work buffers excluded). Asked
    /// before the sequence starts: a serving engine admits sequences by it.
    /// Computed from the cache's own parts; the default says the cache cannot.
    fn projected_kv_bytes(&self, prompt: usize, max_new: usize) -> Result<usize> {
        let _ = (prompt, max_new);
        Err(crate::Error::Unsupported(
            "this cache does not project its bytes (projected_kv_bytes), so it cannot be admitted by KV bytes".into(),
        ))
    }
    /// Measurements of the cache's parts (a compensator's statistics,
    /// Quest's bytes read, a reconstruction pass), each under its part's
    /// name; empty when there are none.
    fn diagnostics(&self) -> Diagnostics {
        Diagnostics::new()
    }
    /// What the cache's components need from the model at `layer` beyond
    /// keys, values and post-RoPE queries (see [`Observation`]). Models ask
    /// once per layer and prefill chunk; the default is nothing.
    fn wants(&self, layer: usize) -> ModelWants {
        let _ = layer;
        ModelWants::default()
    }
    /// Receives what [`wants`](KvCache::wants) asked for, for `layer`, before
    /// that layer's [`attend`](KvCache::attend) of the same chunk.
    fn observe(&mut self, layer: usize, obs: Observation<'_>) -> Result<()> {
        let _ = (layer, obs);
        Ok(())
    }
    /// Starts a context-reconstruction pass over prompt positions `context`
    /// (KVzip; asked for through [`ModelWants::reconstruction`]): the tokens
    /// appended until [`end_pass`](KvCache::end_pass) are attended as usual
    /// but only scored, then removed.
    fn begin_pass(&mut self, context: std::ops::Range<usize>) -> Result<()> {
        let _ = context;
        Err(crate::Error::Unsupported(
            "this cache does not run context-reconstruction passes".into(),
        ))
    }
    /// Ends a pass: its tokens leave the cache.
    fn end_pass(&mut self) -> Result<()> {
        Err(crate::Error::Unsupported(
            "this cache does not run context-reconstruction passes".into(),
        ))
    }
}

/// Model facts a component asked for through its needs, beyond K, V and Q.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelWants {
    /// The chunk's queries before RoPE, with the model's RoPE
    /// ([`Observation::PreRopeQueries`]; Expected Attention's statistics).
    pub pre_rope_queries: bool,
    /// The layer's attention output projection
    /// ([`Observation::OutputProjection`]; CriticalKV).
    pub output_projection: bool,
    /// Context-reconstruction passes before the end of prefill (KVzip): the
    /// driver runs them ([`KvCache::begin_pass`]); models ignore this.
    pub reconstruction: bool,
    /// The pass repeats the context as it is, in one pass (KVCompose),
    /// rather than KVzip's instruction and chunks.
    pub plain_pass: bool,
}

impl ModelWants {
    /// True when the model has nothing to hand over (reconstruction passes
    /// are the driver's business, not the model's).
    pub fn is_empty(&self) -> bool {
        !self.pre_rope_queries && !self.output_projection
    }
}

/// Something a model hands the cache because [`KvCache::wants`] asked for it.
#[derive(Debug, Clone, Copy)]
pub enum Observation<'a> {
    /// The queries of the current prefill chunk before RoPE, token-major
    /// `[n][Hq * d]`, with the RoPE the model then applies to them.
    PreRopeQueries {
        /// Queries `[n][Hq * d]`.
        q: &'a [f32],
        /// Tokens in the chunk.
        n: usize,
        /// The model's rotary embedding.
        rope: &'a Rope,
    },
    /// The layer's output projection `W_o`, row-major `[hidden][Hq * d]`
    /// (`attn_out = W_o · concat_h(o_h)`).
    OutputProjection {
        /// The weights, `hidden * Hq * d` floats.
        w: &'a [f32],
        /// Rows (the model's hidden size).
        hidden: usize,
    },
}

/// Which channels RoPE rotates together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RopePairs {
    /// Channels `(2i, 2i + 1)` (GGUF's layout of Llama weights).
    Adjacent,
    /// Channels `(i, i + d/2)` (the "rotate half" layout).
    Halves,
}

/// A rotary position embedding: pair `i` of a head is rotated by the angle
/// `position * inv_freq[i]`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rope {
    /// One inverse frequency per channel pair (`d / 2` of them).
    pub inv_freq: Vec<f64>,
    /// Channel pairing.
    pub pairs: RopePairs,
}

impl Rope {
    /// The channels of pair `i` for head dimension `d`.
    pub fn pair(&self, i: usize, d: usize) -> (usize, usize) {
        match self.pairs {
            RopePairs::Adjacent => (2 * i, 2 * i + 1),
            RopePairs::Halves => (i, i + d / 2),
        }
    }
    /// Undoes the rotation of position `pos` on one head's vector `x` (`d`
    /// channels): the pre-RoPE vector of a post-RoPE key.
    pub fn unrotate(&self, x: &mut [f32], pos: usize) {
        let d = x.len();
        for (i, &f) in self.inv_freq.iter().enumerate().take(d / 2) {
            let (a, b) = self.pair(i, d);
            let (s, c) = (pos as f64 * f).sin_cos();
            let (x0, x1) = (x[a] as f64, x[b] as f64);
            x[a] = (x0 * c + x1 * s) as f32;
            x[b] = (x1 * c - x0 * s) as f32;
        }
    }
    /// Rotates one head's vector `x` (`d` channels) by `delta` positions
    /// (negative: back): a post-RoPE key of position `p` becomes the key of
    /// position `p + delta` (key re-rotation after pruning).
    pub fn rotate(&self, x: &mut [f32], delta: i64) {
        let d = x.len();
        for (i, &f) in self.inv_freq.iter().enumerate().take(d / 2) {
            let (a, b) = self.pair(i, d);
            let (s, c) = (delta as f64 * f).sin_cos();
            let (x0, x1) = (x[a] as f64, x[b] as f64);
            x[a] = (x0 * c - x1 * s) as f32;
            x[b] = (x1 * c + x0 * s) as f32;
        }
    }
    /// The rotation of positions `from .. from + n`, averaged: per pair the
    /// mean cosine and mean sine, `([d/2], [d/2])`.
    pub fn mean_rotation(&self, from: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
        let n = n.max(1);
        self.inv_freq
            .iter()
            .map(|&f| {
                let (mut c, mut s) = (0.0f64, 0.0f64);
                for p in from..from + n {
                    let a = p as f64 * f;
                    c += a.cos();
                    s += a.sin();
                }
                (c / n as f64, s / n as f64)
            })
            .unzip()
    }
}

/// Bytes held by one storage head.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct HeadMemory {
    /// Tokens held (quantized + full precision).
    pub tokens: usize,
    /// Keys held in the quantized part.
    pub quant_keys: usize,
    /// Values held in the quantized part.
    pub quant_values: usize,
    /// Packed low-bit codes (K and V).
    pub quant_codes: usize,
    /// Quantization scales and minimums (K and V).
    pub quant_scales: usize,
    /// Full-precision (fp16) rows: residual, or the whole head when unquantized.
    pub fp: usize,
    /// Stored token positions and scores (decode-time eviction only).
    pub indices: usize,
    /// Extra attention entries (compensation: e.g. ResKV clusters).
    pub clusters: usize,
    /// Of the allocated bytes above, those that hold data (the rest is
    /// growth slack: under one page per store).
    pub used: usize,
}

impl HeadMemory {
    /// Sum of all parts (allocated bytes).
    pub fn total(&self) -> usize {
        self.quant_codes + self.quant_scales + self.fp + self.indices + self.clusters
    }
}

/// Bytes held by one layer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LayerMemory {
    /// Per storage head.
    pub heads: Vec<HeadMemory>,
    /// Prefill staging (full-precision prompt K/V and signals), freed by `end_prefill`.
    pub staging: usize,
    /// Decode work buffers of the layer (attention probabilities and scratch
    /// of decode-time eviction).
    pub work: usize,
    /// `Some(w)`: a sliding-window layer, held as a ring of its last `w`
    /// tokens (never compressed); `None`: a global layer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window: Option<usize>,
}

/// Named statistics one part of a cache contributes to its [`Diagnostics`].
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Stats {
    /// Overall values (means over layers and heads, or per-token rates), by
    /// statistic name.
    pub values: std::collections::BTreeMap<String, f64>,
    /// The same statistics per layer, when the part measures them per layer
    /// (empty otherwise).
    pub per_layer: Vec<std::collections::BTreeMap<String, f64>>,
}

/// A cache's diagnostics: each contributing part's [`Stats`] by its name
/// (a compensator's `type`, `quest`, `reconstruction`). Consumers flatten
/// them without knowing any part (`<part>_<stat>`).
pub type Diagnostics = std::collections::BTreeMap<String, Stats>;

/// Bytes actually allocated by a cache, with the full fp16 cache for comparison.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MemoryReport {
    /// Per layer.
    pub layers: Vec<LayerMemory>,
    /// Tokens seen (sequence length).
    pub seq_len: usize,
    /// Bytes a full fp16 cache would hold for `seq_len` tokens.
    pub full_fp16_bytes: usize,
    /// Cache-wide work buffers (scratch shared by the layers).
    pub work: usize,
}

impl MemoryReport {
    /// Total bytes allocated by the cache (staging and work buffers included).
    pub fn total_bytes(&self) -> usize {
        self.work
            + self
                .layers
                .iter()
                .map(|l| l.staging + l.work + l.heads.iter().map(HeadMemory::total).sum::<usize>())
                .sum::<usize>()
    }
    /// Bytes of the stored K/V and their metadata that hold data (no growth
    /// slack, no staging or work buffers).
    pub fn used_bytes(&self) -> usize {
        self.sum(|h| h.used)
    }
    /// Bytes of the stored K/V and their metadata as allocated (growth slack
    /// included; no staging or work buffers).
    pub fn kv_bytes(&self) -> usize {
        self.sum(HeadMemory::total)
    }
    /// Sum of one field over all heads.
    pub fn sum(&self, f: impl Fn(&HeadMemory) -> usize) -> usize {
        self.layers.iter().flat_map(|l| &l.heads).map(f).sum()
    }
    /// `total / full fp16` (1.0 = no saving; 0.14 = 86% compression).
    pub fn ratio(&self) -> f64 {
        if self.full_fp16_bytes == 0 {
            return 1.0;
        }
        self.total_bytes() as f64 / self.full_fp16_bytes as f64
    }
}
