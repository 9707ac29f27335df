//! Low-bit K/V storage: the [`Quantizer`] extension point and the [`QuantStore`]
//! that holds one head's quantized keys or values.

use crate::Result;
use serde::{Deserialize, Serialize};
use std::any::Any;
use std::fmt::Debug;
use std::ops::Range;

/// Which axis quantization groups run along.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Axis {
    /// Per channel: for each channel, groups of `G` consecutive tokens (KIVI keys).
    Channel,
    /// Per token: for each token, groups of `G` consecutive channels (KIVI values).
    Token,
}

/// A quantization scheme. Implementations live in `minikv-quant`.
#[typetag::serde(tag = "type")]
pub trait Quantizer: Send + Sync + Debug + dyn_clone::DynClone {
    /// Bits per element.
    fn bits(&self) -> u32;
    /// Group size `G`.
    fn group(&self) -> usize;
    /// Grouping axis.
    fn axis(&self) -> Axis;
    /// Checks parameters against the head dimension (`0` = not known yet: check
    /// only what does not depend on it).
    fn validate(&self, head_dim: usize) -> Result<()>;
    /// An empty store for one head's keys or values, growing in pages of
    /// `page_tokens` tokens.
    fn new_store(&self, head_dim: usize, page_tokens: usize) -> Result<Box<dyn QuantStore>>;
    /// Tokens are appended to a store in multiples of this (G per channel, 1 per token).
    fn token_granularity(&self) -> usize {
        match self.axis() {
            Axis::Channel => self.group(),
            Axis::Token => 1,
        }
    }
    /// `Some` when this is the standard asymmetric min-max quantizer
    /// (docs/algorithms.md §1: codes `round_half_even(clamp((x - min) /
    /// scale))`, LSB-first packing): device backends that implement that
    /// quantizer natively may then hold its store on the device. `None` (the
    /// default) for any other scheme, which such backends refuse clearly.
    fn min_max(&self) -> Option<MinMaxSpec> {
        None
    }
}

/// Parameters of a standard min-max quantizer, as [`Quantizer::min_max`]
/// reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MinMaxSpec {
    /// Bits per code (2, 4 or 8).
    pub bits: u32,
    /// Group size.
    pub group: usize,
    /// Grouping axis.
    pub axis: Axis,
    /// Scales and minimums stored as fp16 (else f32).
    pub f16_scales: bool,
    /// The fused products round the query and weights to 8 bits
    /// (`arithmetic = "int8"`; else exact f32).
    pub int8_products: bool,
}

dyn_clone::clone_trait_object!(Quantizer);

/// Bytes held by a quantized store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct QuantBytes {
    /// Packed codes.
    pub codes: usize,
    /// Scales and minimums.
    pub scales: usize,
}

/// `max[j] = simd::max(out[j * stride .. j * stride + n])` for `j < g`: the
/// maxima of [`QuantStore::scores_range_max`] taken after the scores.
pub fn row_maxima(out: &[f32], g: usize, stride: usize, n: usize, max: &mut [f32]) {
    for (j, m) in max[..g].iter_mut().enumerate() {
        *m = crate::simd::max(&out[j * stride..j * stride + n]);
    }
}

/// [`QuantStore::scores_range`] from [`QuantStore::scores`] of every token
/// (the default; for stores without ranged kernels).
pub fn scores_range_by_whole<S: QuantStore + ?Sized>(
    st: &S,
    q: &[f32],
    g: usize,
    out: &mut [f32],
    stride: usize,
    rows: Range<usize>,
) {
    let n = st.len();
    let mut all = vec![0.0f32; g * n];
    st.scores(q, g, &mut all, n);
    for j in 0..g {
        out[j * stride..j * stride + rows.len()]
            .copy_from_slice(&all[j * n + rows.start..j * n + rows.end]);
    }
}

/// [`QuantStore::accumulate_range`] from [`QuantStore::accumulate`] with the
/// weights spread over every token, zeros outside `rows` (the default).
pub fn accumulate_range_by_whole<S: QuantStore + ?Sized>(
    st: &S,
    p: &[f32],
    g: usize,
    stride: usize,
    out: &mut [f32],
    rows: Range<usize>,
) {
    let n = st.len();
    let mut all = vec![0.0f32; g * n];
    for j in 0..g {
        all[j * n + rows.start..j * n + rows.end]
            .copy_from_slice(&p[j * stride..j * stride + rows.len()]);
    }
    st.accumulate(&all, g, n, out);
}

/// One head's quantized keys or values, with fused attention primitives.
///
/// The fused methods work straight from the packed codes and the per-group
/// scale/min: the dequantized tensor is never materialized.
pub trait QuantStore: Send + Sync + Debug {
    /// Tokens held.
    fn len(&self) -> usize;
    /// True when empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Head dimension.
    fn head_dim(&self) -> usize;
    /// Appends `rows` (`[n][d]`, `n` a multiple of the quantizer's token granularity).
    fn append(&mut self, rows: &[f32]) -> Result<()>;
    /// Appends the first `n` rows of `src` without bringing them to the host
    /// (a device store quantizing a device fp16 store's rows in place), as
    /// [`append`](QuantStore::append) of those rows would; `Ok(false)` when
    /// this store cannot read `src` (the default), and the cache then drains
    /// the rows and appends them. `src` is left unchanged either way: the
    /// caller discards the rows after a `true`.
    fn append_front_of(&mut self, src: &dyn crate::storage::FpStore, n: usize) -> Result<bool> {
        let _ = (src, n);
        Ok(false)
    }
    /// `out[j * stride + t] = q_j . x_hat_t` for `g` queries `q` (`[g][d]`) and every token `t`.
    fn scores(&self, q: &[f32], g: usize, out: &mut [f32], stride: usize);
    /// `out[j][c] += sum_t p[j * stride + t] * x_hat_t[c]` for `g` weight rows.
    fn accumulate(&self, p: &[f32], g: usize, stride: usize, out: &mut [f32]);
    /// Tokens per block of the ranged calls ([`scores_range`](QuantStore::scores_range),
    /// [`accumulate_range`](QuantStore::accumulate_range)) for a group of `g`
    /// queries, when this store has kernels over blocks of tokens: decode
    /// then splits a long head into blocks starting at multiples of it,
    /// flash-decoding style (one task per head and block, weights
    /// unnormalized per block, blocks combined exactly). `None` (the
    /// default): whole heads only, with [`scores`](QuantStore::scores) and
    /// [`accumulate`](QuantStore::accumulate).
    fn split_rows(&self, g: usize) -> Option<usize> {
        let _ = g;
        None
    }
    /// [`scores`](QuantStore::scores) of tokens `rows` only (`rows.start` a
    /// multiple of [`split_rows`](QuantStore::split_rows), `rows.end` the
    /// next multiple or the end): `out[j * stride + (t - rows.start)]`. The
    /// default scores every token and keeps the range.
    fn scores_range(
        &self,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
        rows: Range<usize>,
    ) {
        scores_range_by_whole(self, q, g, out, stride, rows)
    }
    /// [`scores_range`](QuantStore::scores_range), and `max[j]` the largest
    /// of query `j`'s scores of the range (a softmax's maximum, read while
    /// the scores are written instead of in a pass of its own). The default
    /// scores, then takes [`simd::max`](crate::simd::max) of each row.
    fn scores_range_max(
        &self,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
        rows: Range<usize>,
        max: &mut [f32],
    ) {
        let n = rows.len();
        self.scores_range(q, g, out, stride, rows);
        row_maxima(out, g, stride, n, max);
    }
    /// [`accumulate`](QuantStore::accumulate) of tokens `rows` only (as
    /// [`scores_range`](QuantStore::scores_range)), with
    /// `p[j * stride + (t - rows.start)]` as the weights. The default spreads
    /// the weights over every token (zeros elsewhere).
    fn accumulate_range(
        &self,
        p: &[f32],
        g: usize,
        stride: usize,
        out: &mut [f32],
        rows: Range<usize>,
    ) {
        accumulate_range_by_whole(self, p, g, stride, out, rows)
    }
    /// Writes the dequantized rows `[len][d]` (for reference checks and tools).
    fn dequantize(&self, out: &mut [f32]);
    /// Bytes actually allocated.
    fn bytes(&self) -> QuantBytes;
    /// Bytes holding codes, scales and minimums of the tokens held (the rest
    /// of [`bytes`](QuantStore::bytes) is growth slack).
    fn used_bytes(&self) -> usize;
    /// Releases spare capacity.
    fn shrink(&mut self);
    /// For backends that own their store types.
    fn as_any(&self) -> &dyn Any;
}
