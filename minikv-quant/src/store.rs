//! Per-head quantized storage with fused attention kernels.
//!
//! Layouts (`P = 32 / b` codes per word):
//! * per channel (keys): tokens in blocks of `P`; block `k` holds `d` words, word
//!   `k * d + c` packs tokens `k*P .. k*P + P` of channel `c`. Scale/min `[group][d]`.
//! * per token (values): token `t` holds `d / P` words packing its channels.
//!   Scale/min `[t][d / G]`.

use crate::{MinMax, ScaleDtype, code_of, store_pair};
use half::f16;
use minikv_core::{Axis, Error, QuantBytes, QuantStore, Result, check_finite, simd};
use std::any::Any;
use std::ops::Range;

#[derive(Debug, Clone)]
pub(crate) enum Buf {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl Buf {
    fn new(d: ScaleDtype) -> Self {
        match d {
            ScaleDtype::F16 => Buf::F16(Vec::new()),
            ScaleDtype::F32 => Buf::F32(Vec::new()),
        }
    }
    #[inline]
    pub(crate) fn get(&self, i: usize) -> f32 {
        match self {
            Buf::F16(v) => v[i].to_f32(),
            Buf::F32(v) => v[i],
        }
    }
    fn push(&mut self, x: f32) {
        match self {
            Buf::F16(v) => v.push(f16::from_f32(x)),
            Buf::F32(v) => v.push(x),
        }
    }
    fn bytes(&self) -> usize {
        match self {
            Buf::F16(v) => v.capacity() * 2,
            Buf::F32(v) => v.capacity() * 4,
        }
    }
    fn used(&self) -> usize {
        match self {
            Buf::F16(v) => v.len() * 2,
            Buf::F32(v) => v.len() * 4,
        }
    }
    fn shrink(&mut self) {
        match self {
            Buf::F16(v) => v.shrink_to_fit(),
            Buf::F32(v) => v.shrink_to_fit(),
        }
    }
    /// Converts `[i0, i0 + out.len())` to f32.
    pub(crate) fn read(&self, i0: usize, out: &mut [f32]) {
        match self {
            Buf::F16(v) => {
                use half::slice::HalfFloatSliceExt;
                v[i0..i0 + out.len()].convert_to_f32_slice(out)
            }
            Buf::F32(v) => out.copy_from_slice(&v[i0..i0 + out.len()]),
        }
    }
}

/// Largest head dimension the fused kernels keep on the stack.
pub(crate) const MAX_D: usize = 512;
/// Largest GQA group the fused kernels keep on the stack.
pub(crate) const MAX_G: usize = 16;

/// Returns `$s.$m::<P, G, { banks(P, G) }>(args)` where the codes per
/// word `p` and the query group `g` are a pair the fast kernels are
/// instantiated for (P in 16, 8, 4; G in 1, 2, 3, 4, 6, 8), and falls
/// through otherwise.
macro_rules! fast_kernel {
    ($s:ident . $m:ident ($($a:expr),*); $p:expr, $g:expr) => {
        match $p {
            16 => fast_kernel!(@g 16, $s.$m($($a),*), $g),
            8 => fast_kernel!(@g 8, $s.$m($($a),*), $g),
            4 => fast_kernel!(@g 4, $s.$m($($a),*), $g),
            _ => {}
        }
    };
    (@g $p:literal, $s:ident . $m:ident ($($a:expr),*), $g:expr) => {
        match $g {
            1 => return $s.$m::<$p, 1, { banks($p, 1) }>($($a),*),
            2 => return $s.$m::<$p, 2, { banks($p, 2) }>($($a),*),
            3 => return $s.$m::<$p, 3, { banks($p, 3) }>($($a),*),
            4 => return $s.$m::<$p, 4, { banks($p, 4) }>($($a),*),
            6 => return $s.$m::<$p, 6, { banks($p, 6) }>($($a),*),
            8 => return $s.$m::<$p, 8, { banks($p, 8) }>($($a),*),
            _ => {}
        }
    };
}

/// Accumulator banks of the fused kernels for `p` codes per word and `ng`
/// query heads: about 6 independent 8-lane FMA chains, 1 to 4 banks (more
/// accumulators than that spill to the stack with 16 vector registers).
pub(crate) const fn banks(p: usize, ng: usize) -> usize {
    let b = 48 / (p * ng);
    if b == 0 {
        1
    } else if b > 4 {
        4
    } else {
        b
    }
}

/// One head's quantized keys or values.
#[derive(Debug, Clone)]
pub struct MinMaxStore {
    pub(crate) q: MinMax,
    pub(crate) d: usize,
    /// Growth page in tokens.
    page: usize,
    pub(crate) len: usize,
    pub(crate) words: Vec<u32>,
    /// Scales and minimums. Per channel: one buffer `[group][d]`. Per token: one
    /// buffer per channel group, each `[token]` (contiguous for the fused loops).
    pub(crate) scale: Vec<Buf>,
    pub(crate) min: Vec<Buf>,
}

impl MinMaxStore {
    /// An empty store (the quantizer must have been validated for `d`) that
    /// grows in pages of `page_tokens` tokens.
    pub fn new(q: MinMax, d: usize, page_tokens: usize) -> Self {
        Self {
            q,
            d,
            page: page_tokens.max(1),
            len: 0,
            words: Vec::new(),
            scale: (0..Self::n_bufs(q, d))
                .map(|_| Buf::new(q.scale_dtype))
                .collect(),
            min: (0..Self::n_bufs(q, d))
                .map(|_| Buf::new(q.scale_dtype))
                .collect(),
        }
    }

    fn n_bufs(q: MinMax, d: usize) -> usize {
        match q.axis {
            Axis::Channel => 1,
            Axis::Token => d / q.group,
        }
    }

    /// Makes room for `new_len` tokens, growing every buffer to a whole
    /// number of pages (one allocation per page, not per token).
    fn grow_to(&mut self, new_len: usize) {
        fn room<T>(v: &mut Vec<T>, need: usize, cap: usize) {
            if v.capacity() < need {
                v.reserve_exact(cap - v.len());
            }
        }
        let (d, p, g) = (self.d, self.per_word(), self.q.group);
        let cap_tokens = new_len.div_ceil(self.page) * self.page;
        let (words, words_cap, scales, scales_cap) = match self.q.axis {
            Axis::Channel => (
                new_len.div_ceil(p) * d,
                cap_tokens.div_ceil(p) * d,
                new_len / g * d,
                cap_tokens.div_ceil(g) * d,
            ),
            Axis::Token => (new_len * (d / p), cap_tokens * (d / p), new_len, cap_tokens),
        };
        room(&mut self.words, words, words_cap);
        for b in self.scale.iter_mut().chain(self.min.iter_mut()) {
            match b {
                Buf::F16(v) => room(v, scales, scales_cap),
                Buf::F32(v) => room(v, scales, scales_cap),
            }
        }
    }

    fn per_word(&self) -> usize {
        32 / self.q.bits as usize
    }

    pub(crate) fn mask(&self) -> u32 {
        (1u32 << self.q.bits) - 1
    }

    /// Code of token `t`, channel `c`.
    #[inline]
    fn code(&self, t: usize, c: usize) -> u32 {
        let (p, b) = (self.per_word(), self.q.bits as usize);
        let (w, sh) = match self.q.axis {
            Axis::Channel => ((t / p) * self.d + c, b * (t % p)),
            Axis::Token => (t * (self.d / p) + c / p, b * (c % p)),
        };
        (self.words[w] >> sh) & self.mask()
    }

    /// Scale and min of token `t`, channel `c`.
    #[inline]
    fn scale_min(&self, t: usize, c: usize) -> (f32, f32) {
        let (b, i) = match self.q.axis {
            Axis::Channel => (0, (t / self.q.group) * self.d + c),
            Axis::Token => (c / self.q.group, t),
        };
        (self.scale[b].get(i), self.min[b].get(i))
    }

    /// Dequantizes tokens `t0 .. t0 + n` into `out` (`[n][d]`).
    fn dequant_range(&self, t0: usize, n: usize, out: &mut [f32]) {
        let d = self.d;
        for i in 0..n {
            let t = t0 + i;
            for c in 0..d {
                let (sc, mn) = self.scale_min(t, c);
                out[i * d + c] = self.code(t, c) as f32 * sc + mn;
            }
        }
    }

    fn append_channel(&mut self, rows: &[f32], n: usize) -> Result<()> {
        let (d, g, bits) = (self.d, self.q.group, self.q.bits);
        let p = self.per_word();
        let qmax = ((1u32 << bits) - 1) as f32;
        let new_len = self.len + n;
        self.grow_to(new_len);
        let words_needed = new_len.div_ceil(p) * d;
        self.words.resize(words_needed, 0);
        let mut stack = [0.0f32; 256];
        let mut heap = Vec::new();
        let col: &mut [f32] = if g <= stack.len() {
            &mut stack[..g]
        } else {
            heap.resize(g, 0.0);
            &mut heap
        };
        for gi in 0..n / g {
            for c in 0..d {
                for (i, x) in col.iter_mut().enumerate() {
                    *x = rows[(gi * g + i) * d + c];
                }
                let mn = col.iter().copied().fold(f32::INFINITY, f32::min);
                let mx = col.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let scale = (mx - mn) / qmax;
                if !scale.is_finite() {
                    return Err(Error::Input(format!(
                        "quantize: range {mn}..{mx} overflows f32"
                    )));
                }
                let (sc, m) = store_pair(self.q.scale_dtype, scale, mn)?;
                self.scale[0].push(sc);
                self.min[0].push(m);
                if scale > 0.0 {
                    for (i, &x) in col.iter().enumerate() {
                        let t = self.len + gi * g + i;
                        let code = code_of(x, mn, scale, qmax) as u32;
                        self.words[(t / p) * d + c] |= code << (bits as usize * (t % p));
                    }
                }
            }
        }
        self.len = new_len;
        Ok(())
    }

    fn append_token(&mut self, rows: &[f32], n: usize) -> Result<()> {
        let (d, g, bits) = (self.d, self.q.group, self.q.bits);
        let p = self.per_word();
        let wpt = d / p;
        let qmax = ((1u32 << bits) - 1) as f32;
        self.grow_to(self.len + n);
        for i in 0..n {
            let row = &rows[i * d..(i + 1) * d];
            let base = self.words.len();
            self.words.resize(base + wpt, 0);
            for (gi, chunk) in row.chunks(g).enumerate() {
                let mn = chunk.iter().copied().fold(f32::INFINITY, f32::min);
                let mx = chunk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let scale = (mx - mn) / qmax;
                if !scale.is_finite() {
                    return Err(Error::Input(format!(
                        "quantize: range {mn}..{mx} overflows f32"
                    )));
                }
                let (s, m) = store_pair(self.q.scale_dtype, scale, mn)?;
                self.scale[gi].push(s);
                self.min[gi].push(m);
                if scale > 0.0 {
                    for (j, &x) in chunk.iter().enumerate() {
                        let c = gi * g + j;
                        let code = code_of(x, mn, scale, qmax) as u32;
                        self.words[base + c / p] |= code << (bits as usize * (c % p));
                    }
                }
            }
        }
        self.len += n;
        Ok(())
    }

    fn fast_ok(&self, g: usize) -> bool {
        self.d <= MAX_D && g <= MAX_G
    }
}

impl QuantStore for MinMaxStore {
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
                "quantized append",
                format!("a multiple of {d}"),
                rows.len(),
            ));
        }
        let n = rows.len() / d;
        if n == 0 {
            return Ok(());
        }
        check_finite("quantized append", rows)?;
        match self.q.axis {
            Axis::Channel => {
                if !n.is_multiple_of(self.q.group) {
                    return Err(Error::shape(
                        "per-channel append (tokens)",
                        format!("a multiple of G = {}", self.q.group),
                        n,
                    ));
                }
                self.append_channel(rows, n)
            }
            Axis::Token => self.append_token(rows, n),
        }
    }

    fn scores(&self, q: &[f32], g: usize, out: &mut [f32], stride: usize) {
        if self.q.axis == Axis::Channel && self.int8_ok(g) {
            return self.scores_int8(crate::int8::Isa::detected(), q, g, out, stride);
        }
        let d = self.d;
        let p = self.per_word();
        if self.q.axis == Axis::Channel && self.q.group.is_multiple_of(p) && self.fast_ok(g) {
            fast_kernel!(self.scores_channel_fast(q, out, stride); p, g);
        }
        if self.q.axis == Axis::Token && self.fast_ok(g) {
            // score_t = sum_groups s * (q . codes) + m * sum(q) over the group.
            let grp = self.q.group;
            let gpt = d / grp;
            let mut qsum = [0.0f32; MAX_G * MAX_D];
            for j in 0..g {
                for gi in 0..gpt {
                    qsum[j * gpt + gi] = q[j * d + gi * grp..j * d + (gi + 1) * grp].iter().sum();
                }
            }
            let mut codes = [0.0f32; MAX_D];
            for t in 0..self.len {
                for (c, x) in codes[..d].iter_mut().enumerate() {
                    *x = self.code(t, c) as f32;
                }
                for j in 0..g {
                    let mut s = 0.0;
                    for gi in 0..gpt {
                        let dq = simd::dot(
                            &q[j * d + gi * grp..j * d + (gi + 1) * grp],
                            &codes[gi * grp..(gi + 1) * grp],
                        );
                        s += self.scale[gi].get(t) * dq + self.min[gi].get(t) * qsum[j * gpt + gi];
                    }
                    out[j * stride + t] = s;
                }
            }
            return;
        }
        // Generic path: dequantize one block of tokens at a time.
        let blk = p.max(1);
        let mut tile = vec![0.0f32; blk * d];
        let mut t0 = 0;
        while t0 < self.len {
            let n = blk.min(self.len - t0);
            self.dequant_range(t0, n, &mut tile);
            for j in 0..g {
                for i in 0..n {
                    out[j * stride + t0 + i] =
                        simd::dot(&q[j * d..(j + 1) * d], &tile[i * d..(i + 1) * d]);
                }
            }
            t0 += n;
        }
    }

    /// The integer kernels run per segment of the store's length (4096
    /// tokens; 2048 for heads of at most 6144): keys (per channel) score by
    /// ranges, values (per token) accumulate by ranges.
    fn split_rows(&self, g: usize) -> Option<usize> {
        self.int8_ok(g).then(|| crate::int8::seg_tokens(self.len))
    }

    fn scores_range(
        &self,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
        rows: Range<usize>,
    ) {
        self.scores_range_opt_max(q, g, out, stride, rows, None)
    }

    fn scores_range_max(
        &self,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
        rows: Range<usize>,
        max: &mut [f32],
    ) {
        self.scores_range_opt_max(q, g, out, stride, rows, Some(max))
    }

    fn accumulate_range(
        &self,
        p: &[f32],
        g: usize,
        stride: usize,
        out: &mut [f32],
        rows: Range<usize>,
    ) {
        if self.q.axis == Axis::Token
            && self.int8_ok(g)
            && rows.start.is_multiple_of(crate::int8::seg_tokens(self.len))
            && rows.end <= self.len
        {
            return self.accumulate_int8_span(
                crate::int8::Isa::detected(),
                p,
                g,
                stride,
                out,
                rows,
            );
        }
        minikv_core::quant::accumulate_range_by_whole(self, p, g, stride, out, rows)
    }

    fn accumulate(&self, p: &[f32], g: usize, stride: usize, out: &mut [f32]) {
        if self.q.axis == Axis::Token && self.int8_ok(g) {
            return self.accumulate_int8(crate::int8::Isa::detected(), p, g, stride, out);
        }
        let d = self.d;
        if self.q.axis == Axis::Token
            && self.q.group.is_multiple_of(self.per_word())
            && self.fast_ok(g)
        {
            fast_kernel!(self.accumulate_token_fast(p, stride, out); self.per_word(), g);
        }
        let blk = self.per_word();
        let mut tile = vec![0.0f32; blk * d];
        let mut t0 = 0;
        while t0 < self.len {
            let n = blk.min(self.len - t0);
            self.dequant_range(t0, n, &mut tile);
            for j in 0..g {
                for i in 0..n {
                    simd::axpy(
                        p[j * stride + t0 + i],
                        &tile[i * d..(i + 1) * d],
                        &mut out[j * d..(j + 1) * d],
                    );
                }
            }
            t0 += n;
        }
    }

    fn dequantize(&self, out: &mut [f32]) {
        self.dequant_range(0, self.len, out);
    }

    fn bytes(&self) -> QuantBytes {
        QuantBytes {
            codes: self.words.capacity() * 4,
            scales: self
                .scale
                .iter()
                .chain(&self.min)
                .map(Buf::bytes)
                .sum::<usize>()
                + std::mem::size_of::<Buf>() * (self.scale.capacity() + self.min.capacity()),
        }
    }
    fn used_bytes(&self) -> usize {
        self.words.len() * 4
            + self
                .scale
                .iter()
                .chain(&self.min)
                .map(Buf::used)
                .sum::<usize>()
    }

    fn shrink(&mut self) {
        self.words.shrink_to_fit();
        for b in self.scale.iter_mut().chain(self.min.iter_mut()) {
            b.shrink();
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
