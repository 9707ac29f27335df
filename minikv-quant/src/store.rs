//! Per-head quantized storage with fused attention kernels.
//!
//! Layouts (`P = 32 / b` codes per word):
//! * per channel (keys): tokens in blocks of `P`; block `k` holds `d` words, word
//!   `k * d + c` packs tokens `k*P .. k*P + P` of channel `c`. Scale/min `[group][d]`.
//! * per token (values): token `t` holds `d / P` words packing its channels.
//!   Scale/min `[t][d / G]`.

use crate::{MinMax, ScaleDtype, code_of, store_pair};
use half::f16;
use minikv_core::{Axis, Error, QuantBytes, QuantStore, Result, check_finite, kernels};
use std::any::Any;

#[derive(Debug, Clone)]
enum Buf {
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
    fn get(&self, i: usize) -> f32 {
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
    fn reserve_exact(&mut self, n: usize) {
        match self {
            Buf::F16(v) => v.reserve_exact(n),
            Buf::F32(v) => v.reserve_exact(n),
        }
    }
    fn bytes(&self) -> usize {
        match self {
            Buf::F16(v) => v.capacity() * 2,
            Buf::F32(v) => v.capacity() * 4,
        }
    }
    fn shrink(&mut self) {
        match self {
            Buf::F16(v) => v.shrink_to_fit(),
            Buf::F32(v) => v.shrink_to_fit(),
        }
    }
    /// Converts `[i0, i0 + out.len())` to f32.
    fn read(&self, i0: usize, out: &mut [f32]) {
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
const MAX_D: usize = 512;
/// Largest GQA group the fused kernels keep on the stack.
const MAX_G: usize = 16;

/// One head's quantized keys or values.
#[derive(Debug, Clone)]
pub struct MinMaxStore {
    q: MinMax,
    d: usize,
    len: usize,
    words: Vec<u32>,
    scale: Buf,
    min: Buf,
}

impl MinMaxStore {
    /// An empty store (the quantizer must have been validated for `d`).
    pub fn new(q: MinMax, d: usize) -> Self {
        Self {
            q,
            d,
            len: 0,
            words: Vec::new(),
            scale: Buf::new(q.scale_dtype),
            min: Buf::new(q.scale_dtype),
        }
    }

    fn per_word(&self) -> usize {
        32 / self.q.bits as usize
    }

    fn mask(&self) -> u32 {
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

    /// Index of the scale/min of token `t`, channel `c`.
    #[inline]
    fn sidx(&self, t: usize, c: usize) -> usize {
        match self.q.axis {
            Axis::Channel => (t / self.q.group) * self.d + c,
            Axis::Token => t * (self.d / self.q.group) + c / self.q.group,
        }
    }

    /// Dequantizes tokens `t0 .. t0 + n` into `out` (`[n][d]`).
    fn dequant_range(&self, t0: usize, n: usize, out: &mut [f32]) {
        let d = self.d;
        for i in 0..n {
            let t = t0 + i;
            for c in 0..d {
                let si = self.sidx(t, c);
                out[i * d + c] = self.code(t, c) as f32 * self.scale.get(si) + self.min.get(si);
            }
        }
    }

    fn append_channel(&mut self, rows: &[f32], n: usize) -> Result<()> {
        let (d, g, bits) = (self.d, self.q.group, self.q.bits);
        let p = self.per_word();
        let qmax = ((1u32 << bits) - 1) as f32;
        let new_len = self.len + n;
        let words_needed = new_len.div_ceil(p) * d;
        self.words
            .reserve_exact(words_needed.saturating_sub(self.words.len()));
        self.words.resize(words_needed, 0);
        self.scale.reserve_exact(n / g * d);
        self.min.reserve_exact(n / g * d);
        let mut col = vec![0.0f32; g];
        for gi in 0..n / g {
            let mut pairs = Vec::with_capacity(d);
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
                pairs.push(store_pair(self.q.scale_dtype, scale, mn)?);
                if scale > 0.0 {
                    for (i, &x) in col.iter().enumerate() {
                        let t = self.len + gi * g + i;
                        let code = code_of(x, mn, scale, qmax) as u32;
                        self.words[(t / p) * d + c] |= code << (bits as usize * (t % p));
                    }
                }
            }
            for (s, m) in pairs {
                self.scale.push(s);
                self.min.push(m);
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
        self.words.reserve_exact(n * wpt);
        self.scale.reserve_exact(n * d / g);
        self.min.reserve_exact(n * d / g);
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
                self.scale.push(s);
                self.min.push(m);
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

    /// Fast path: per-channel keys with `G % P == 0` (every word block in one group).
    fn scores_channel_fast<const P: usize>(
        &self,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let (d, grp, b) = (self.d, self.q.group, self.q.bits as usize);
        let mask = self.mask();
        let mut qs = [0.0f32; MAX_G * MAX_D];
        let mut sc = [0.0f32; MAX_D];
        let mut mn = [0.0f32; MAX_D];
        let shifts: [u32; P] = std::array::from_fn(|j| (b * j) as u32);
        for gi in 0..self.len / grp {
            self.scale.read(gi * d, &mut sc[..d]);
            self.min.read(gi * d, &mut mn[..d]);
            let mut bias = [0.0f32; MAX_G];
            for j in 0..g {
                let qj = &q[j * d..(j + 1) * d];
                for c in 0..d {
                    qs[j * d + c] = qj[c] * sc[c];
                }
                bias[j] = kernels::dot(qj, &mn[..d]);
            }
            for k in (gi * grp / P)..((gi + 1) * grp / P) {
                let mut acc = [[0.0f32; P]; MAX_G];
                let words = &self.words[k * d..(k + 1) * d];
                for (c, &w) in words.iter().enumerate() {
                    let codes: [f32; P] = std::array::from_fn(|j| ((w >> shifts[j]) & mask) as f32);
                    for j in 0..g {
                        let s = qs[j * d + c];
                        for (a, x) in acc[j].iter_mut().zip(&codes) {
                            *a += s * x;
                        }
                    }
                }
                for j in 0..g {
                    let o = &mut out[j * stride + k * P..j * stride + (k + 1) * P];
                    for (o, a) in o.iter_mut().zip(&acc[j]) {
                        *o = a + bias[j];
                    }
                }
            }
        }
    }

    /// Fast path: per-token values, `out[j] += sum_t p_jt * v_hat_t`.
    fn accumulate_token_fast<const P: usize>(
        &self,
        p: &[f32],
        g: usize,
        stride: usize,
        out: &mut [f32],
    ) {
        let (d, grp, b) = (self.d, self.q.group, self.q.bits as usize);
        let mask = self.mask();
        let wpt = d / P;
        let gpt = d / grp;
        let shifts: [u32; P] = std::array::from_fn(|j| (b * j) as u32);
        let mut codes = [0.0f32; MAX_D];
        let mut sc = [0.0f32; MAX_D];
        let mut mn = [0.0f32; MAX_D];
        for t in 0..self.len {
            let words = &self.words[t * wpt..(t + 1) * wpt];
            for (k, &w) in words.iter().enumerate() {
                for j in 0..P {
                    codes[k * P + j] = ((w >> shifts[j]) & mask) as f32;
                }
            }
            self.scale.read(t * gpt, &mut sc[..gpt]);
            self.min.read(t * gpt, &mut mn[..gpt]);
            for j in 0..g {
                let pj = p[j * stride + t];
                if pj == 0.0 {
                    continue;
                }
                let o = &mut out[j * d..(j + 1) * d];
                for gi in 0..gpt {
                    let (a, bb) = (pj * sc[gi], pj * mn[gi]);
                    let cs = &codes[gi * grp..(gi + 1) * grp];
                    for (o, x) in o[gi * grp..(gi + 1) * grp].iter_mut().zip(cs) {
                        *o += a * x + bb;
                    }
                }
            }
        }
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
        let d = self.d;
        let p = self.per_word();
        if self.q.axis == Axis::Channel && self.q.group.is_multiple_of(p) && self.fast_ok(g) {
            match p {
                16 => return self.scores_channel_fast::<16>(q, g, out, stride),
                8 => return self.scores_channel_fast::<8>(q, g, out, stride),
                4 => return self.scores_channel_fast::<4>(q, g, out, stride),
                _ => {}
            }
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
                        let si = t * gpt + gi;
                        let dq = kernels::dot(
                            &q[j * d + gi * grp..j * d + (gi + 1) * grp],
                            &codes[gi * grp..(gi + 1) * grp],
                        );
                        s += self.scale.get(si) * dq + self.min.get(si) * qsum[j * gpt + gi];
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
                        kernels::dot(&q[j * d..(j + 1) * d], &tile[i * d..(i + 1) * d]);
                }
            }
            t0 += n;
        }
    }

    fn accumulate(&self, p: &[f32], g: usize, stride: usize, out: &mut [f32]) {
        let d = self.d;
        if self.q.axis == Axis::Token && self.fast_ok(g) {
            match self.per_word() {
                16 => return self.accumulate_token_fast::<16>(p, g, stride, out),
                8 => return self.accumulate_token_fast::<8>(p, g, stride, out),
                4 => return self.accumulate_token_fast::<4>(p, g, stride, out),
                _ => {}
            }
        }
        let blk = self.per_word();
        let mut tile = vec![0.0f32; blk * d];
        let mut t0 = 0;
        while t0 < self.len {
            let n = blk.min(self.len - t0);
            self.dequant_range(t0, n, &mut tile);
            for j in 0..g {
                for i in 0..n {
                    kernels::axpy(
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
            scales: self.scale.bytes() + self.min.bytes(),
        }
    }

    fn shrink(&mut self) {
        self.words.shrink_to_fit();
        self.scale.shrink();
        self.min.shrink();
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
