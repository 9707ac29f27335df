//! Full-precision (fp16) row storage and the storage factory through which a
//! backend creates every store of a cache.

use crate::quant::{QuantStore, Quantizer};
use crate::{Result, simd};
use half::f16;
use half::slice::HalfFloatSliceExt;
use std::any::Any;
use std::fmt::Debug;
use std::ops::Range;

/// Rows of one head kept in full precision (the residual, or the whole cache when
/// nothing is quantized).
pub trait FpStore: Send + Sync + Debug {
    /// Rows held.
    fn len(&self) -> usize;
    /// Width of a row as pushed and read (`d`).
    fn dim(&self) -> usize;
    /// True when empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Appends rows `[n][d]`.
    fn push(&mut self, rows: &[f32]);
    /// Overwrites row `idx`.
    fn replace(&mut self, idx: usize, row: &[f32]);
    /// Removes row `idx`, moving the last row into its place (O(d)).
    fn swap_remove(&mut self, idx: usize);
    /// Removes the first `n` rows, appending them as f32 to `out`.
    fn drain_front(&mut self, n: usize, out: &mut Vec<f32>);
    /// Removes the first `n` rows without reading them (a device store moves
    /// its ring's start; the default drains into a scratch vector).
    fn discard_front(&mut self, n: usize) {
        let mut sink = Vec::new();
        self.drain_front(n, &mut sink);
    }
    /// `out[j * stride + t] = q_j . x_t`.
    fn scores(&self, q: &[f32], g: usize, out: &mut [f32], stride: usize);
    /// `out[j][c] += sum_t p[j * stride + t] * x_t[c]`.
    fn accumulate(&self, p: &[f32], g: usize, stride: usize, out: &mut [f32]);
    /// Rows as f32 `[len][d]`.
    fn to_f32(&self, out: &mut [f32]);
    /// [`scores`](FpStore::scores) of rows `rows` only:
    /// `out[j * stride + (t - rows.start)] = q_j . x_t` (split-K decode).
    fn scores_rows(&self, q: &[f32], g: usize, out: &mut [f32], stride: usize, rows: Range<usize>) {
        let d = self.dim();
        for (t, r) in range_f32(self, rows).chunks_exact(d).enumerate() {
            for j in 0..g {
                out[j * stride + t] = simd::dot(&q[j * d..(j + 1) * d], r);
            }
        }
    }
    /// [`accumulate`](FpStore::accumulate) of rows `rows` only, with
    /// `p[j * stride + (t - rows.start)]` as the weights.
    fn accumulate_rows(
        &self,
        p: &[f32],
        g: usize,
        stride: usize,
        out: &mut [f32],
        rows: Range<usize>,
    ) {
        let d = self.dim();
        for (t, r) in range_f32(self, rows).chunks_exact(d).enumerate() {
            for j in 0..g {
                simd::axpy(p[j * stride + t], r, &mut out[j * d..(j + 1) * d]);
            }
        }
    }
    /// Rows `rows` as f32 into `out` (resized to `rows.len() * d`).
    fn gather(&self, rows: &[u32], out: &mut Vec<f32>) {
        let d = self.dim();
        let mut all = vec![0.0f32; self.len() * d];
        self.to_f32(&mut all);
        out.clear();
        for &r in rows {
            out.extend_from_slice(&all[r as usize * d..(r as usize + 1) * d]);
        }
    }
    /// Removes every row, keeping the allocation.
    fn clear(&mut self) {
        let mut sink = Vec::new();
        self.drain_front(self.len(), &mut sink);
    }
    /// Bytes actually allocated.
    fn bytes(&self) -> usize;
    /// Bytes holding rows (`bytes() - used_bytes()` is growth slack).
    fn used_bytes(&self) -> usize;
    /// Makes room for `rows` more rows with one exact allocation (no slack).
    fn reserve_exact(&mut self, rows: usize);
    /// Releases spare capacity.
    fn shrink(&mut self);
    /// For backends that own their store types.
    fn as_any(&self) -> &dyn Any;
}

/// Rows `rows` of a store as f32 (the generic path of the range methods;
/// [`Fp16Rows`] reads its rows in place instead).
fn range_f32<S: FpStore + ?Sized>(s: &S, rows: Range<usize>) -> Vec<f32> {
    let d = s.dim();
    let mut all = vec![0.0f32; s.len() * d];
    s.to_f32(&mut all);
    all.truncate(rows.end * d);
    all.drain(..rows.start * d);
    all
}

/// Creates the stores of a cache. A device backend returns stores that live on
/// the device; the CPU backends use [`CpuStorage`].
pub trait StorageFactory: Send + Sync + Debug {
    /// An empty fp16 row store for head dimension `d` that grows in pages of
    /// `page_tokens` rows.
    fn fp_store(&self, head_dim: usize, page_tokens: usize) -> Box<dyn FpStore>;
    /// An empty quantized store that grows in pages of `page_tokens` tokens.
    fn quant_store(
        &self,
        q: &dyn Quantizer,
        head_dim: usize,
        page_tokens: usize,
    ) -> Result<Box<dyn QuantStore>> {
        q.new_store(head_dim, page_tokens)
    }
}

/// Host-memory storage.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuStorage;

impl StorageFactory for CpuStorage {
    fn fp_store(&self, head_dim: usize, page_tokens: usize) -> Box<dyn FpStore> {
        Box::new(Fp16Rows::new(head_dim, page_tokens))
    }
}

/// Rows stored as IEEE fp16, grown in whole pages of `page` rows: the
/// allocation exceeds what is used by less than one page (after
/// [`FpStore::shrink`], by nothing), and appending allocates once per page.
#[derive(Debug, Clone)]
pub struct Fp16Rows {
    d: usize,
    page: usize,
    data: Vec<f16>,
}

/// Rows converted to f32 at a time in the fused loops.
const CHUNK: usize = 32;

impl Fp16Rows {
    /// Empty store for head dimension `d`, growing in pages of `page_tokens` rows.
    pub fn new(d: usize, page_tokens: usize) -> Self {
        Self {
            d,
            page: page_tokens.max(1),
            data: Vec::new(),
        }
    }

    fn reserve_rows(&mut self, n: usize) {
        let need = self.data.len() / self.d + n;
        if need * self.d > self.data.capacity() {
            let rows = need.div_ceil(self.page) * self.page;
            self.data.reserve_exact(rows * self.d - self.data.len());
        }
    }
}

impl FpStore for Fp16Rows {
    fn len(&self) -> usize {
        self.data.len() / self.d
    }
    fn dim(&self) -> usize {
        self.d
    }
    fn push(&mut self, rows: &[f32]) {
        let n = rows.len() / self.d;
        self.reserve_rows(n);
        let start = self.data.len();
        self.data.resize(start + rows.len(), f16::ZERO);
        self.data[start..].convert_from_f32_slice(rows);
    }
    fn replace(&mut self, idx: usize, row: &[f32]) {
        let d = self.d;
        self.data[idx * d..(idx + 1) * d].convert_from_f32_slice(row);
    }
    fn swap_remove(&mut self, idx: usize) {
        let d = self.d;
        let last = self.len() - 1;
        if idx != last {
            self.data.copy_within(last * d..(last + 1) * d, idx * d);
        }
        self.data.truncate(last * d);
    }
    fn drain_front(&mut self, n: usize, out: &mut Vec<f32>) {
        let k = n * self.d;
        let start = out.len();
        out.resize(start + k, 0.0);
        self.data[..k].convert_to_f32_slice(&mut out[start..]);
        self.data.drain(..k);
    }
    fn scores(&self, q: &[f32], g: usize, out: &mut [f32], stride: usize) {
        self.scores_rows(q, g, out, stride, 0..self.len());
    }
    fn scores_rows(&self, q: &[f32], g: usize, out: &mut [f32], stride: usize, rows: Range<usize>) {
        let d = self.d;
        let (lo, hi) = (rows.start, rows.end);
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma",
            target_feature = "f16c"
        ))]
        if d.is_multiple_of(8) {
            crate::f16x86::scores(&self.data[lo * d..hi * d], d, q, g, out, stride);
            return;
        }
        if d > 256 {
            let mut row = vec![0.0f32; d];
            for t in lo..hi {
                self.data[t * d..(t + 1) * d].convert_to_f32_slice(&mut row);
                for j in 0..g {
                    out[j * stride + t - lo] = simd::dot(&q[j * d..(j + 1) * d], &row);
                }
            }
            return;
        }
        let mut buf = [0.0f32; CHUNK * 256];
        let mut t0 = lo;
        while t0 < hi {
            let m = CHUNK.min(hi - t0);
            let b = &mut buf[..m * d];
            self.data[t0 * d..(t0 + m) * d].convert_to_f32_slice(b);
            for j in 0..g {
                let qj = &q[j * d..(j + 1) * d];
                let o = &mut out[j * stride + t0 - lo..j * stride + t0 - lo + m];
                let row = |r: usize| &b[r * d..(r + 1) * d];
                let m4 = m - m % 4;
                for r in (0..m4).step_by(4) {
                    let s = simd::dot4(qj, [row(r), row(r + 1), row(r + 2), row(r + 3)]);
                    o[r..r + 4].copy_from_slice(&s);
                }
                for (r, o) in o.iter_mut().enumerate().skip(m4) {
                    *o = simd::dot(qj, row(r));
                }
            }
            t0 += m;
        }
    }
    fn accumulate(&self, p: &[f32], g: usize, stride: usize, out: &mut [f32]) {
        self.accumulate_rows(p, g, stride, out, 0..self.len());
    }
    fn accumulate_rows(
        &self,
        p: &[f32],
        g: usize,
        stride: usize,
        out: &mut [f32],
        rows: Range<usize>,
    ) {
        let d = self.d;
        let lo = rows.start;
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma",
            target_feature = "f16c"
        ))]
        if d.is_multiple_of(8) {
            crate::f16x86::accumulate(&self.data[lo * d..rows.end * d], d, p, g, stride, out);
            return;
        }
        if d > 256 {
            let mut row = vec![0.0f32; d];
            for t in rows {
                self.data[t * d..(t + 1) * d].convert_to_f32_slice(&mut row);
                for j in 0..g {
                    simd::axpy(p[j * stride + t - lo], &row, &mut out[j * d..(j + 1) * d]);
                }
            }
            return;
        }
        // Rows converted CHUNK at a time (one conversion call per block).
        let mut buf = [0.0f32; CHUNK * 256];
        let hi = rows.end;
        let mut t0 = lo;
        while t0 < hi {
            let m = CHUNK.min(hi - t0);
            let b = &mut buf[..m * d];
            self.data[t0 * d..(t0 + m) * d].convert_to_f32_slice(b);
            for j in 0..g {
                let o = &mut out[j * d..(j + 1) * d];
                let w = &p[j * stride + t0 - lo..j * stride + t0 - lo + m];
                let row = |r: usize| &b[r * d..(r + 1) * d];
                let m4 = m - m % 4;
                for r in (0..m4).step_by(4) {
                    simd::axpy4(
                        [w[r], w[r + 1], w[r + 2], w[r + 3]],
                        [row(r), row(r + 1), row(r + 2), row(r + 3)],
                        o,
                    );
                }
                for (r, &wr) in w.iter().enumerate().skip(m4) {
                    simd::axpy(wr, row(r), o);
                }
            }
            t0 += m;
        }
    }
    fn to_f32(&self, out: &mut [f32]) {
        self.data.convert_to_f32_slice(&mut out[..self.data.len()]);
    }
    fn gather(&self, rows: &[u32], out: &mut Vec<f32>) {
        let d = self.d;
        out.resize(rows.len() * d, 0.0);
        // Runs of consecutive rows (Quest's pages) convert in one call.
        let mut i = 0;
        while i < rows.len() {
            let mut j = i + 1;
            while j < rows.len() && rows[j] == rows[j - 1] + 1 {
                j += 1;
            }
            let r0 = rows[i] as usize;
            self.data[r0 * d..(r0 + j - i) * d].convert_to_f32_slice(&mut out[i * d..j * d]);
            i = j;
        }
    }
    fn clear(&mut self) {
        self.data.clear();
    }
    fn bytes(&self) -> usize {
        self.data.capacity() * 2
    }
    fn used_bytes(&self) -> usize {
        self.data.len() * 2
    }
    fn reserve_exact(&mut self, rows: usize) {
        self.data.reserve_exact(rows * self.d);
    }
    fn shrink(&mut self) {
        self.data.shrink_to_fit();
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
