//! Device-resident stores: fp16 rows ([`DeviceFpStore`]) and min-max
//! quantized codes ([`DeviceQuantStore`], quantized on the device by
//! `mk_quant_keys_channel` / `mk_quant_values_token`). Both grow in pages
//! like the CPU stores and report the device bytes they hold.
//!
//! Decode attention reads them in place (the backend's fused kernel). The
//! trait methods that return host data (`scores`, `accumulate`, `to_f32`,
//! `dequantize`, used by policies that score on the host) download the
//! rows first: correct, and a transfer per call.

use crate::device::{Arg, DevBuf, Device, Launch, Scratch, err, int};
use half::f16;
use half::slice::HalfFloatSliceExt;
use minikv_core::storage::FpStore;
use minikv_core::{Axis, Error, MinMaxSpec, QuantBytes, QuantStore, Result, check_finite, simd};
use std::any::Any;
use std::sync::{Arc, Mutex};

/// A store method that cannot return an error met a device error: the
/// device is lost or out of memory, and continuing would give wrong output.
#[track_caller]
fn fatal(e: Error) -> ! {
    panic!("cuda backend: {e}")
}

/// `out[j * stride + t] = q_j . x_t` over host rows `[n][d]`.
fn host_scores(x: &[f32], d: usize, q: &[f32], g: usize, out: &mut [f32], stride: usize) {
    for (t, r) in x.chunks_exact(d).enumerate() {
        for j in 0..g {
            out[j * stride + t] = simd::dot(&q[j * d..(j + 1) * d], r);
        }
    }
}

/// `out[j][c] += sum_t p[j * stride + t] * x_t[c]` over host rows.
fn host_accumulate(x: &[f32], d: usize, p: &[f32], g: usize, stride: usize, out: &mut [f32]) {
    for (t, r) in x.chunks_exact(d).enumerate() {
        for j in 0..g {
            simd::axpy(p[j * stride + t], r, &mut out[j * d..(j + 1) * d]);
        }
    }
}

/// fp16 rows `[len][d]` on the device, grown in pages of `page` rows, held
/// as a ring: row `i` sits at slot `(start + i) % cap`. Removing rows from
/// the front (a quantized cache's residual, every decode step) moves
/// `start` and copies nothing; the decode kernel reads the ring in place.
#[derive(Debug)]
pub struct DeviceFpStore {
    dev: Arc<dyn Device>,
    d: usize,
    page: usize,
    len: usize,
    start: usize,
    buf: Option<DevBuf>,
    /// A row held an infinite fp16 value (|x| > 65504 when pushed): the
    /// rows are then quantized through the host, whose check reports it.
    nonfinite: bool,
}

impl DeviceFpStore {
    /// An empty store for head dimension `d`.
    pub fn new(dev: Arc<dyn Device>, d: usize, page: usize) -> Self {
        Self {
            dev,
            d,
            page: page.max(1),
            len: 0,
            start: 0,
            buf: None,
            nonfinite: false,
        }
    }
    fn row_bytes(&self) -> usize {
        2 * self.d
    }
    /// Rows the allocation holds (the ring's size).
    pub fn capacity(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len() / self.row_bytes())
    }
    /// The device address of slot 0 (0 when nothing is allocated).
    pub fn ptr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.ptr())
    }
    /// The slot of row 0.
    pub fn start(&self) -> usize {
        self.start
    }
    /// The slot of row `i`.
    fn slot(&self, i: usize) -> usize {
        let cap = self.capacity();
        let s = self.start + i;
        if s >= cap { s - cap } else { s }
    }
    /// Rows `r0 .. r0 + n` as at most two runs of slots `(slot, rows)`.
    fn runs(&self, r0: usize, n: usize) -> [(usize, usize); 2] {
        if n == 0 {
            return [(0, 0), (0, 0)];
        }
        let a = self.slot(r0);
        let first = n.min(self.capacity() - a);
        [(a, first), (0, n - first)]
    }
    /// A new allocation of `rows` rows holding rows `0..len` from slot 0.
    fn realloc(&mut self, rows: usize) -> Result<()> {
        let nb = if rows == 0 {
            None
        } else {
            let nb = DevBuf::zeroed(&self.dev, rows * self.row_bytes())?;
            if let Some(old) = &self.buf {
                let rb = self.row_bytes();
                let mut at = 0;
                for (slot, n) in self.runs(0, self.len) {
                    nb.copy_from(at * rb, old, slot * rb, n * rb)?;
                    at += n;
                }
            }
            Some(nb)
        };
        self.buf = nb;
        self.start = 0;
        Ok(())
    }
    fn ensure(&mut self, extra: usize) -> Result<()> {
        let need = self.len + extra;
        if need > self.capacity() {
            self.realloc(need.div_ceil(self.page) * self.page)?;
        }
        Ok(())
    }
    /// Writes host rows (f32, converted to fp16) at rows `r0..`.
    fn write_rows(&mut self, r0: usize, rows: &[f32]) -> Result<()> {
        let n = rows.len() / self.d;
        let mut h = vec![f16::ZERO; n * self.d];
        h.convert_from_f32_slice(&rows[..n * self.d]);
        self.nonfinite |= h.iter().any(|x| !x.is_finite());
        let (rb, b) = (self.row_bytes(), self.buf.as_ref().expect("allocated"));
        let mut at = 0;
        for (slot, k) in self.runs(r0, n) {
            if k > 0 {
                b.write(slot * rb, &h[at * self.d..(at + k) * self.d])?;
            }
            at += k;
        }
        Ok(())
    }
    fn try_push(&mut self, rows: &[f32]) -> Result<()> {
        let n = rows.len() / self.d;
        if n == 0 {
            return Ok(());
        }
        self.ensure(n)?;
        self.len += n;
        self.write_rows(self.len - n, rows)
    }
    fn read_rows(&self, r0: usize, n: usize, out: &mut [f32]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (rb, b) = (self.row_bytes(), self.buf.as_ref().expect("rows held"));
        let mut at = 0;
        for (slot, k) in self.runs(r0, n) {
            if k > 0 {
                let h: Vec<f16> = b.to_vec(slot * rb, k * self.d)?;
                h.convert_to_f32_slice(&mut out[at * self.d..(at + k) * self.d]);
            }
            at += k;
        }
        Ok(())
    }
    fn all_f32(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.len * self.d];
        self.read_rows(0, self.len, &mut v)
            .unwrap_or_else(|e| fatal(e));
        v
    }
    fn drop_front(&mut self, n: usize) {
        let n = n.min(self.len);
        self.len -= n;
        self.start = if self.len == 0 { 0 } else { self.slot(n) };
    }
    fn try_drain_front(&mut self, n: usize, out: &mut Vec<f32>) -> Result<()> {
        let n = n.min(self.len);
        if n == 0 {
            return Ok(());
        }
        let at = out.len();
        out.resize(at + n * self.d, 0.0);
        self.read_rows(0, n, &mut out[at..])?;
        self.drop_front(n);
        Ok(())
    }
}

impl FpStore for DeviceFpStore {
    fn len(&self) -> usize {
        self.len
    }
    fn dim(&self) -> usize {
        self.d
    }
    fn push(&mut self, rows: &[f32]) {
        self.try_push(rows).unwrap_or_else(|e| fatal(e));
    }
    fn replace(&mut self, idx: usize, row: &[f32]) {
        assert!(idx < self.len, "replace: row {idx} of {}", self.len);
        self.write_rows(idx, &row[..self.d])
            .unwrap_or_else(|e| fatal(e));
    }
    fn swap_remove(&mut self, idx: usize) {
        assert!(idx < self.len, "swap_remove: row {idx} of {}", self.len);
        let last = self.len - 1;
        if idx != last {
            let b = self.buf.as_ref().expect("rows held");
            let rb = self.row_bytes();
            b.copy_from(self.slot(idx) * rb, b, self.slot(last) * rb, rb)
                .unwrap_or_else(|e| fatal(e));
        }
        self.len = last;
        if last == 0 {
            self.start = 0;
        }
    }
    fn drain_front(&mut self, n: usize, out: &mut Vec<f32>) {
        self.try_drain_front(n, out).unwrap_or_else(|e| fatal(e));
    }
    fn discard_front(&mut self, n: usize) {
        self.drop_front(n);
    }
    fn scores(&self, q: &[f32], g: usize, out: &mut [f32], stride: usize) {
        host_scores(&self.all_f32(), self.d, q, g, out, stride);
    }
    fn accumulate(&self, p: &[f32], g: usize, stride: usize, out: &mut [f32]) {
        host_accumulate(&self.all_f32(), self.d, p, g, stride, out);
    }
    fn to_f32(&self, out: &mut [f32]) {
        self.read_rows(0, self.len, out)
            .unwrap_or_else(|e| fatal(e));
    }
    fn bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }
    fn used_bytes(&self) -> usize {
        self.len * self.row_bytes()
    }
    fn reserve_exact(&mut self, rows: usize) {
        if self.len + rows > self.capacity() {
            self.realloc(self.len + rows).unwrap_or_else(|e| fatal(e));
        }
    }
    fn shrink(&mut self) {
        if self.capacity() > self.len {
            self.realloc(self.len).unwrap_or_else(|e| fatal(e));
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Device staging for the rows a quantize kernel reads, shared by the
/// stores of one backend.
pub(crate) type Staging = Mutex<Scratch>;

/// One head's min-max quantized keys or values on the device, in the
/// kernels' layouts (`cuda/minikv.cu`): per channel, word `(j / P) * d + c`
/// and scales `[j / G][d]`; per token, `d / P` words per token and scales
/// `[j][d / G]`. The words are the CPU store's, bit for bit.
#[derive(Debug)]
pub struct DeviceQuantStore {
    dev: Arc<dyn Device>,
    staging: Arc<Staging>,
    spec: MinMaxSpec,
    d: usize,
    page: usize,
    len: usize,
    cap: usize,
    words: Option<DevBuf>,
    scales: Option<DevBuf>,
    mins: Option<DevBuf>,
}

impl DeviceQuantStore {
    pub(crate) fn new(
        dev: Arc<dyn Device>,
        staging: Arc<Staging>,
        spec: MinMaxSpec,
        d: usize,
        page: usize,
    ) -> Result<Self> {
        if !matches!(spec.bits, 2 | 4 | 8) {
            return Err(err(format!(
                "{}-bit codes are not supported (2, 4 or 8)",
                spec.bits
            )));
        }
        if spec.axis == Axis::Token
            && (!d.is_multiple_of(spec.group) || !d.is_multiple_of(32 / spec.bits as usize))
        {
            return Err(Error::config(
                "group",
                format!(
                    "per-token groups of {} at {} bits do not tile head dim {d}",
                    spec.group, spec.bits
                ),
            ));
        }
        // Whole groups per page keep every page boundary on a group boundary.
        let gran = match spec.axis {
            Axis::Channel => spec.group,
            Axis::Token => 1,
        };
        Ok(Self {
            dev,
            staging,
            spec,
            d,
            page: page.max(1).div_ceil(gran) * gran,
            len: 0,
            cap: 0,
            words: None,
            scales: None,
            mins: None,
        })
    }
    /// The quantizer's parameters.
    pub fn spec(&self) -> MinMaxSpec {
        self.spec
    }
    fn per_word(&self) -> usize {
        32 / self.spec.bits as usize
    }
    fn scale_bytes(&self) -> usize {
        if self.spec.f16_scales { 2 } else { 4 }
    }
    /// (words, scale entries) for `n` tokens.
    fn sizes(&self, n: usize) -> (usize, usize) {
        let (p, g, d) = (self.per_word(), self.spec.group, self.d);
        match self.spec.axis {
            Axis::Channel => (n.div_ceil(p) * d, n.div_ceil(g) * d),
            Axis::Token => (n * d / p, n * (d / g)),
        }
    }
    /// Device addresses of the words, scales and minimums (0 when empty).
    pub fn ptrs(&self) -> (u64, u64, u64) {
        let p = |b: &Option<DevBuf>| b.as_ref().map_or(0, |b| b.ptr());
        (p(&self.words), p(&self.scales), p(&self.mins))
    }
    fn realloc(&mut self, cap: usize) -> Result<()> {
        let (w_used, s_used) = self.sizes(self.len);
        let (w_cap, s_cap) = self.sizes(cap);
        let sb = self.scale_bytes();
        let grow = |old: &Option<DevBuf>, bytes: usize, used: usize| -> Result<Option<DevBuf>> {
            if bytes == 0 {
                return Ok(None);
            }
            let nb = DevBuf::zeroed(&self.dev, bytes)?;
            if let Some(o) = old {
                nb.copy_from(0, o, 0, used)?;
            }
            Ok(Some(nb))
        };
        let words = grow(&self.words, w_cap * 4, w_used * 4)?;
        let scales = grow(&self.scales, s_cap * sb, s_used * sb)?;
        let mins = grow(&self.mins, s_cap * sb, s_used * sb)?;
        (self.words, self.scales, self.mins, self.cap) = (words, scales, mins, cap);
        Ok(())
    }
    /// The packed words of the tokens held (layout in the type's docs).
    pub fn words(&self) -> Result<Vec<u32>> {
        let (w, _) = self.sizes(self.len);
        match &self.words {
            Some(b) => b.to_vec(0, w),
            None => Ok(Vec::new()),
        }
    }
    /// Scales and minimums of the tokens held, as f32.
    pub fn scales_and_mins(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let (_, s) = self.sizes(self.len);
        let read = |b: &Option<DevBuf>| -> Result<Vec<f32>> {
            let Some(b) = b else { return Ok(Vec::new()) };
            Ok(if self.spec.f16_scales {
                b.to_vec::<f16>(0, s)?.iter().map(|x| x.to_f32()).collect()
            } else {
                b.to_vec::<f32>(0, s)?
            })
        };
        Ok((read(&self.scales)?, read(&self.mins)?))
    }
    /// Dequantized rows `[len][d]`, computed on the host from the device's
    /// codes (the kernels' formula: `code * scale + min`).
    fn try_dequantize(&self, out: &mut [f32]) -> Result<()> {
        let words = self.words()?;
        let (sc, mn) = self.scales_and_mins()?;
        let (p, g, d, bits) = (
            self.per_word(),
            self.spec.group,
            self.d,
            self.spec.bits as usize,
        );
        let mask = (1u32 << bits) - 1;
        for j in 0..self.len {
            for c in 0..d {
                let (code, s) = match self.spec.axis {
                    Axis::Channel => (
                        (words[(j / p) * d + c] >> (bits * (j % p))) & mask,
                        (j / g) * d + c,
                    ),
                    Axis::Token => (
                        (words[j * (d / p) + c / p] >> (bits * (c % p))) & mask,
                        j * (d / g) + c / g,
                    ),
                };
                out[j * d + c] = code as f32 * sc[s] + mn[s];
            }
        }
        Ok(())
    }
    /// Quantizes `n` rows appended at token `len`: f32 rows `[n][d]` at
    /// `rows`, or (`f16`) fp16 rows of a device ring of `rcap` rows, row
    /// `i` at slot `(r0 + i) % rcap`.
    fn quantize(&mut self, rows: u64, f16: bool, r0: usize, rcap: usize, n: usize) -> Result<()> {
        let (d, g) = (self.d, self.spec.group);
        if self.len + n > self.cap {
            self.realloc((self.len + n).div_ceil(self.page) * self.page)?;
        }
        let (w, s, m) = self.ptrs();
        let (bits, f16s) = (self.spec.bits as i32, i32::from(self.spec.f16_scales));
        let (len, dev, rf) = (self.len, &self.dev, i32::from(f16));
        let rcap = rcap.max(1);
        match self.spec.axis {
            Axis::Channel => {
                for gi in 0..n / g {
                    dev.launch(
                        "mk_quant_keys_channel",
                        Launch {
                            grid: (d.div_ceil(32) as u32, 1, 1),
                            block: (32, 1, 1),
                        },
                        &[
                            Arg::Ptr(rows),
                            Arg::I32(rf),
                            Arg::I32(int((r0 + gi * g) % rcap)?),
                            Arg::I32(int(rcap)?),
                            Arg::I32(int(g)?),
                            Arg::I32(int(d)?),
                            Arg::I32(bits),
                            Arg::I32(int(len + gi * g)?),
                            Arg::Ptr(w),
                            Arg::Ptr(s),
                            Arg::Ptr(m),
                            Arg::I32(f16s),
                        ],
                    )?;
                }
            }
            Axis::Token => dev.launch(
                "mk_quant_values_token",
                Launch {
                    grid: (n.div_ceil(32) as u32, 1, 1),
                    block: (32, 1, 1),
                },
                &[
                    Arg::Ptr(rows),
                    Arg::I32(rf),
                    Arg::I32(int(r0 % rcap)?),
                    Arg::I32(int(rcap)?),
                    Arg::I32(int(n)?),
                    Arg::I32(int(d)?),
                    Arg::I32(int(g)?),
                    Arg::I32(bits),
                    Arg::I32(int(len)?),
                    Arg::Ptr(w),
                    Arg::Ptr(s),
                    Arg::Ptr(m),
                    Arg::I32(f16s),
                ],
            )?,
        }
        self.len += n;
        Ok(())
    }
    fn all_f32(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.len * self.d];
        self.try_dequantize(&mut v).unwrap_or_else(|e| fatal(e));
        v
    }
}

impl QuantStore for DeviceQuantStore {
    fn len(&self) -> usize {
        self.len
    }
    fn head_dim(&self) -> usize {
        self.d
    }
    fn append(&mut self, rows: &[f32]) -> Result<()> {
        let d = self.d;
        if !rows.len().is_multiple_of(d) {
            return Err(Error::shape(
                "quantized append: rows",
                "a multiple of d",
                rows.len(),
            ));
        }
        let n = rows.len() / d;
        let g = self.spec.group;
        if self.spec.axis == Axis::Channel && !n.is_multiple_of(g) {
            return Err(Error::shape(
                "per-channel quantized append: tokens",
                format!("a multiple of the group {g}"),
                n,
            ));
        }
        if n == 0 {
            return Ok(());
        }
        check_finite("quantized append", rows)?;
        let dev = self.dev.clone();
        let staging = self.staging.clone();
        let mut staging = staging.lock().unwrap_or_else(|p| p.into_inner());
        let rp = staging.put(&dev, 0, rows)?;
        self.quantize(rp, false, 0, n, n)
    }
    fn append_front_of(&mut self, src: &dyn FpStore, n: usize) -> Result<bool> {
        let Some(fp) = src.as_any().downcast_ref::<DeviceFpStore>() else {
            return Ok(false);
        };
        if n == 0 {
            return Ok(true);
        }
        if n > fp.len() || fp.dim() != self.d {
            return Err(Error::shape(
                "quantized append from a device store (rows, width)",
                format!("at most {} rows of width {}", fp.len(), self.d),
                format!("{n} rows of width {}", fp.dim()),
            ));
        }
        if self.spec.axis == Axis::Channel && !n.is_multiple_of(self.spec.group) {
            return Err(Error::shape(
                "per-channel quantized append: tokens",
                format!("a multiple of the group {}", self.spec.group),
                n,
            ));
        }
        // The rows were finite when pushed (fp16 of finite f32 may be
        // infinite: the CPU path sees the same values and quantizes them
        // the same way).
        if fp.nonfinite {
            return Ok(false);
        }
        self.quantize(fp.ptr(), true, fp.start(), fp.capacity(), n)?;
        Ok(true)
    }
    fn scores(&self, q: &[f32], g: usize, out: &mut [f32], stride: usize) {
        host_scores(&self.all_f32(), self.d, q, g, out, stride);
    }
    fn accumulate(&self, p: &[f32], g: usize, stride: usize, out: &mut [f32]) {
        host_accumulate(&self.all_f32(), self.d, p, g, stride, out);
    }
    fn dequantize(&self, out: &mut [f32]) {
        self.try_dequantize(out).unwrap_or_else(|e| fatal(e));
    }
    fn bytes(&self) -> QuantBytes {
        let b = |x: &Option<DevBuf>| x.as_ref().map_or(0, |b| b.len());
        QuantBytes {
            codes: b(&self.words),
            scales: b(&self.scales) + b(&self.mins),
        }
    }
    fn used_bytes(&self) -> usize {
        let (w, s) = self.sizes(self.len);
        w * 4 + 2 * s * self.scale_bytes()
    }
    fn shrink(&mut self) {
        if self.cap > self.len {
            self.realloc(self.len).unwrap_or_else(|e| fatal(e));
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
