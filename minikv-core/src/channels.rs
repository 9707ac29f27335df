//! Key-channel pruning (ThinK-style): a [`ChannelPruner`] chooses, at the end
//! of prefill, which channels of each storage head's keys are stored. The
//! head's key stores then hold only those channels (`d' < d` per row, fp16 or
//! packed codes), so memory really drops; a query is gathered to the same
//! channels before its dot products, which equals attention with the pruned
//! key channels set to zero. Values are untouched. Keys appended while
//! decoding keep every channel by default ([`SplitKeys`]: the pruned prompt
//! rows, then full-width rows); a pruner may prune them too
//! ([`ChannelPruner::prune_appended`]). Composes with token selection,
//! quantization (a quantized key store holds the kept channels: an appended
//! key loses its pruned channels when the residual flushes it) and
//! decode-time eviction: the wrappers below are ordinary stores to every
//! backend.

use crate::quant::{QuantBytes, QuantStore};
use crate::storage::FpStore;
use crate::{LayerSignals, Needs, Result};
use smallvec::SmallVec;
use std::any::Any;
use std::fmt::Debug;
use std::ops::Range;

/// One storage head at the end of prefill, as a channel pruner sees it.
#[derive(Debug, Clone)]
pub struct ChannelInput<'a> {
    /// The layer's signals (keys, values, window queries, ...).
    pub signals: &'a LayerSignals<'a>,
    /// KV head the storage head holds.
    pub kv: usize,
    /// Query heads that read it.
    pub q_heads: Range<usize>,
    /// The prompt positions the head keeps after token selection,
    /// increasing (every position without a selection): channel statistics
    /// over the stored keys, as a channel press composed after a token press
    /// sees them.
    pub kept: &'a [u32],
}

/// Chooses the key channels a storage head keeps. Implementations live in
/// `minikv-policies` (`think`); set under `[cache.channels]` with a `type`.
#[typetag::serde(tag = "type")]
pub trait ChannelPruner: Send + Sync + Debug + dyn_clone::DynClone {
    /// What the cache must collect during prefill.
    fn needs(&self) -> Needs {
        Needs::default()
    }
    /// Checks parameters; errors name the field (`cache.channels.x`).
    fn validate(&self) -> Result<()> {
        Ok(())
    }
    /// Kept channels of one storage head, increasing, at least one.
    fn select(&self, input: &ChannelInput<'_>) -> Result<Vec<u16>>;
    /// Whether keys appended after compression (decoded tokens) are pruned
    /// too. `false` (the default, as kvpress does): they are stored with
    /// every channel in a full-width store beside the pruned one
    /// ([`SplitKeys`]), its bytes counted.
    fn prune_appended(&self) -> bool {
        false
    }
}

dyn_clone::clone_trait_object!(ChannelPruner);

/// Inline capacity of the gather buffers (no allocation per decode step for
/// `g * d' <= 2048`).
type Buf = SmallVec<[f32; 2048]>;

/// The kept channels of `d`-wide rows: gathering rows to them, scattering
/// back (zeros elsewhere), adding back. Shared by both store wrappers.
#[derive(Debug)]
struct Subset {
    channels: Vec<u16>,
    d: usize,
}

impl Subset {
    /// Rows `[n][d]` cut to the kept channels `[n][d']`.
    fn gather(&self, rows: &[f32]) -> Buf {
        let mut out = Buf::new();
        for r in rows.chunks_exact(self.d) {
            out.extend(self.channels.iter().map(|&c| r[c as usize]));
        }
        out
    }
    /// Rows `[n][d']` written to `out` `[n][d]`, zeros in the dropped channels.
    fn scatter(&self, rows: &[f32], out: &mut [f32]) {
        for (r, o) in rows
            .chunks_exact(self.channels.len())
            .zip(out.chunks_exact_mut(self.d))
        {
            o.fill(0.0);
            for (&c, &x) in self.channels.iter().zip(r) {
                o[c as usize] = x;
            }
        }
    }
    /// `out[j][c] += part[j][c']` for the `g` rows of an accumulation.
    fn scatter_add(&self, part: &[f32], out: &mut [f32]) {
        for (r, o) in part
            .chunks_exact(self.channels.len())
            .zip(out.chunks_exact_mut(self.d))
        {
            for (&c, &x) in self.channels.iter().zip(r) {
                o[c as usize] += x;
            }
        }
    }
    /// Accumulation through a narrow store: `f` adds into `[g][d']`.
    fn accumulate(&self, g: usize, out: &mut [f32], f: impl FnOnce(&mut [f32])) {
        let mut b: Buf = SmallVec::from_elem(0.0, g * self.channels.len());
        f(&mut b);
        self.scatter_add(&b, out);
    }
    fn bytes(&self) -> usize {
        2 * self.channels.capacity()
    }
    fn used_bytes(&self) -> usize {
        2 * self.channels.len()
    }
}

/// An fp16 key store holding only `channels` of each `d`-wide row.
#[derive(Debug)]
pub struct ChannelSubsetFp {
    inner: Box<dyn FpStore>,
    sub: Subset,
}

impl ChannelSubsetFp {
    /// Wraps `inner`, a store of `channels.len()`-wide rows.
    pub fn new(inner: Box<dyn FpStore>, channels: Vec<u16>, d: usize) -> Self {
        Self {
            inner,
            sub: Subset { channels, d },
        }
    }
}

impl FpStore for ChannelSubsetFp {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn dim(&self) -> usize {
        self.sub.d
    }
    fn push(&mut self, rows: &[f32]) {
        self.inner.push(&self.sub.gather(rows));
    }
    fn replace(&mut self, idx: usize, row: &[f32]) {
        self.inner.replace(idx, &self.sub.gather(row));
    }
    fn swap_remove(&mut self, idx: usize) {
        self.inner.swap_remove(idx);
    }
    fn drain_front(&mut self, n: usize, out: &mut Vec<f32>) {
        let mut part = Vec::with_capacity(n * self.sub.channels.len());
        self.inner.drain_front(n, &mut part);
        let start = out.len();
        out.resize(start + n * self.sub.d, 0.0);
        self.sub.scatter(&part, &mut out[start..]);
    }
    fn scores(&self, q: &[f32], g: usize, out: &mut [f32], stride: usize) {
        let q = self.sub.gather(&q[..g * self.sub.d]);
        self.inner.scores(&q, g, out, stride);
    }
    fn scores_rows(
        &self,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
        rows: std::ops::Range<usize>,
    ) {
        let q = self.sub.gather(&q[..g * self.sub.d]);
        self.inner.scores_rows(&q, g, out, stride, rows);
    }
    fn accumulate(&self, p: &[f32], g: usize, stride: usize, out: &mut [f32]) {
        self.sub
            .accumulate(g, out, |b| self.inner.accumulate(p, g, stride, b));
    }
    fn to_f32(&self, out: &mut [f32]) {
        let mut part = vec![0.0f32; self.inner.len() * self.sub.channels.len()];
        self.inner.to_f32(&mut part);
        self.sub.scatter(&part, out);
    }
    fn bytes(&self) -> usize {
        self.inner.bytes() + self.sub.bytes()
    }
    fn used_bytes(&self) -> usize {
        self.inner.used_bytes() + self.sub.used_bytes()
    }
    fn reserve_exact(&mut self, rows: usize) {
        self.inner.reserve_exact(rows);
    }
    fn shrink(&mut self) {
        self.inner.shrink();
        self.sub.channels.shrink_to_fit();
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A quantized key store holding only `channels` of each `d`-wide row.
#[derive(Debug)]
pub struct ChannelSubsetQuant {
    inner: Box<dyn QuantStore>,
    sub: Subset,
}

impl ChannelSubsetQuant {
    /// Wraps `inner`, a store of `channels.len()`-wide rows.
    pub fn new(inner: Box<dyn QuantStore>, channels: Vec<u16>, d: usize) -> Self {
        Self {
            inner,
            sub: Subset { channels, d },
        }
    }
}

impl QuantStore for ChannelSubsetQuant {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn head_dim(&self) -> usize {
        self.sub.d
    }
    fn append(&mut self, rows: &[f32]) -> Result<()> {
        self.inner.append(&self.sub.gather(rows))
    }
    fn scores(&self, q: &[f32], g: usize, out: &mut [f32], stride: usize) {
        let q = self.sub.gather(&q[..g * self.sub.d]);
        self.inner.scores(&q, g, out, stride);
    }
    fn accumulate(&self, p: &[f32], g: usize, stride: usize, out: &mut [f32]) {
        self.sub
            .accumulate(g, out, |b| self.inner.accumulate(p, g, stride, b));
    }
    fn dequantize(&self, out: &mut [f32]) {
        let mut part = vec![0.0f32; self.inner.len() * self.sub.channels.len()];
        self.inner.dequantize(&mut part);
        self.sub.scatter(&part, out);
    }
    fn bytes(&self) -> QuantBytes {
        let b = self.inner.bytes();
        QuantBytes {
            scales: b.scales + self.sub.bytes(),
            ..b
        }
    }
    fn used_bytes(&self) -> usize {
        self.inner.used_bytes() + self.sub.used_bytes()
    }
    fn shrink(&mut self) {
        self.inner.shrink();
        self.sub.channels.shrink_to_fit();
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Keys of a pruned head when appended keys keep every channel: the rows
/// loaded at the end of prefill in a channel-subset store (`head`), every
/// later row full width (`tail`). The first push is the prompt's kept rows
/// (compression loads a head in one push); each later push is a decoded row.
/// Row order is the usual one (head rows, then tail rows); a swap-remove of
/// a head row moves the last row into it through the head's channels.
#[derive(Debug)]
pub struct SplitKeys {
    head: ChannelSubsetFp,
    tail: Box<dyn FpStore>,
    loaded: bool,
}

impl SplitKeys {
    /// The pruned store of the prompt's rows and a full-width one for the rest.
    pub fn new(head: ChannelSubsetFp, tail: Box<dyn FpStore>) -> Self {
        Self {
            head,
            tail,
            loaded: false,
        }
    }

    /// Rows in the pruned part.
    fn n0(&self) -> usize {
        self.head.len()
    }
}

impl FpStore for SplitKeys {
    fn len(&self) -> usize {
        self.head.len() + self.tail.len()
    }
    fn dim(&self) -> usize {
        self.head.dim()
    }
    fn push(&mut self, rows: &[f32]) {
        if self.loaded {
            self.tail.push(rows);
        } else {
            self.head.push(rows);
            self.loaded = true;
        }
    }
    fn replace(&mut self, idx: usize, row: &[f32]) {
        match idx.checked_sub(self.n0()) {
            None => self.head.replace(idx, row),
            Some(i) => self.tail.replace(i, row),
        }
    }
    fn swap_remove(&mut self, idx: usize) {
        let n0 = self.n0();
        if self.tail.is_empty() {
            self.head.swap_remove(idx);
        } else if idx >= n0 {
            self.tail.swap_remove(idx - n0);
        } else {
            let mut last = Vec::new();
            self.tail.gather(&[self.tail.len() as u32 - 1], &mut last);
            self.tail.swap_remove(self.tail.len() - 1);
            self.head.replace(idx, &last);
        }
    }
    fn drain_front(&mut self, n: usize, out: &mut Vec<f32>) {
        let k = n.min(self.n0());
        self.head.drain_front(k, out);
        self.tail.drain_front(n - k, out);
    }
    fn scores(&self, q: &[f32], g: usize, out: &mut [f32], stride: usize) {
        let n0 = self.n0();
        self.head.scores(q, g, out, stride);
        if !self.tail.is_empty() {
            self.tail.scores(q, g, &mut out[n0..], stride);
        }
    }
    fn scores_rows(&self, q: &[f32], g: usize, out: &mut [f32], stride: usize, rows: Range<usize>) {
        let n0 = self.n0();
        if rows.start < n0 {
            self.head
                .scores_rows(q, g, out, stride, rows.start..rows.end.min(n0));
        }
        if rows.end > n0 {
            let from = rows.start.max(n0);
            let out = &mut out[from - rows.start..];
            self.tail
                .scores_rows(q, g, out, stride, from - n0..rows.end - n0);
        }
    }
    fn accumulate(&self, p: &[f32], g: usize, stride: usize, out: &mut [f32]) {
        let n0 = self.n0();
        self.head.accumulate(p, g, stride, out);
        if !self.tail.is_empty() {
            self.tail.accumulate(&p[n0..], g, stride, out);
        }
    }
    fn accumulate_rows(
        &self,
        p: &[f32],
        g: usize,
        stride: usize,
        out: &mut [f32],
        rows: Range<usize>,
    ) {
        let n0 = self.n0();
        if rows.start < n0 {
            self.head
                .accumulate_rows(p, g, stride, out, rows.start..rows.end.min(n0));
        }
        if rows.end > n0 {
            let from = rows.start.max(n0);
            let p = &p[from - rows.start..];
            self.tail
                .accumulate_rows(p, g, stride, out, from - n0..rows.end - n0);
        }
    }
    fn to_f32(&self, out: &mut [f32]) {
        let split = self.n0() * self.dim();
        let (a, b) = out.split_at_mut(split);
        self.head.to_f32(a);
        self.tail.to_f32(b);
    }
    fn bytes(&self) -> usize {
        self.head.bytes() + self.tail.bytes()
    }
    fn used_bytes(&self) -> usize {
        self.head.used_bytes() + self.tail.used_bytes()
    }
    fn reserve_exact(&mut self, rows: usize) {
        self.tail.reserve_exact(rows);
    }
    fn shrink(&mut self) {
        self.head.shrink();
        self.tail.shrink();
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
