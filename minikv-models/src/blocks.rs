//! ggml tensor types (llama.cpp's block definitions): dequantization and dot
//! products against f32 vectors straight from the blocks.
//!
//! * `Q4_0`: 32 weights in 18 bytes: fp16 `d`, 16 bytes of nibbles; `x = (q - 8) d`.
//! * `Q4_1`: 32 weights in 20 bytes: fp16 `d`, fp16 `m`, 16 bytes; `x = q d + m`.
//! * `Q8_0`: 32 weights in 34 bytes: fp16 `d`, 32 `i8`; `x = q d`.
//!
//! * `Q5_0`: 32 weights in 22 bytes: fp16 `d`, 4 bytes of fifth bits `qh`
//!   (bit `j` for weight `j`), 16 bytes of nibbles; `x = (q - 16) d`.
//! * `Q4_K`: 256 weights in 144 bytes: fp16 `d`, fp16 `dmin`, 12 bytes of
//!   6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of nibbles;
//!   `x = d sc_j q - dmin m_j`. Sub-blocks `2c` and `2c + 1` share bytes
//!   `32c .. 32c + 32` (low nibbles, then high).
//! * `Q6_K`: 256 weights in 210 bytes: 128 bytes of low nibbles, 64 bytes of
//!   high 2-bit pairs, 16 signed 8-bit scales (one per 16 weights), fp16 `d`
//!   last; `x = d sc (q - 32)`.
//!
//! Nibble order (`Q4_0`, `Q4_1`, `Q5_0`): byte `j` holds weight `j` in its low
//! nibble and `j + 16` in its high one.

use half::{bf16, f16};
use minikv_core::simd::fmadd;

/// Supported ggml tensor types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 4-bit, symmetric, blocks of 32.
    Q4_0,
    /// 4-bit with minimum, blocks of 32.
    Q4_1,
    /// 8-bit, blocks of 32.
    Q8_0,
    /// 5-bit, symmetric, blocks of 32.
    Q5_0,
    /// 4-bit k-quant: super-blocks of 256 with 6-bit sub-block scales and mins.
    #[allow(non_camel_case_types)]
    Q4_K,
    /// 6-bit k-quant: super-blocks of 256 with 8-bit sub-block scales.
    #[allow(non_camel_case_types)]
    Q6_K,
}

impl GgmlType {
    /// From the ggml type id.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            8 => Self::Q8_0,
            12 => Self::Q4_K,
            14 => Self::Q6_K,
            30 => Self::Bf16,
            _ => return None,
        })
    }
    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => 1,
            Self::Q4_K | Self::Q6_K => 256,
            _ => 32,
        }
    }
    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
            Self::Q5_0 => 22,
            Self::Q4_K => 144,
            Self::Q6_K => 210,
        }
    }
    /// Bytes of a row of `n` elements.
    pub fn row_bytes(self, n: usize) -> usize {
        n / self.block_size() * self.block_bytes()
    }
    /// Index of the first element (or block, for quantized types) of `bytes`
    /// whose value or scale is NaN or infinite: codes are integers, so a
    /// quantized block can only be non-finite through its f16 scale or min.
    pub fn first_non_finite(self, bytes: &[u8]) -> Option<usize> {
        let f16_bad = |b: &[u8]| !half::f16::from_le_bytes([b[0], b[1]]).is_finite();
        let chunks = bytes.chunks_exact(self.block_bytes());
        let mut it = chunks.enumerate();
        match self {
            Self::F32 => {
                it.find(|(_, b)| !f32::from_le_bytes((*b).try_into().expect("4 bytes")).is_finite())
            }
            Self::F16 => it.find(|(_, b)| f16_bad(b)),
            Self::Bf16 => it.find(|(_, b)| !half::bf16::from_le_bytes([b[0], b[1]]).is_finite()),
            Self::Q4_0 | Self::Q8_0 | Self::Q5_0 => it.find(|(_, b)| f16_bad(&b[..2])),
            Self::Q4_1 | Self::Q4_K => it.find(|(_, b)| f16_bad(&b[..2]) || f16_bad(&b[2..4])),
            Self::Q6_K => it.find(|(_, b)| f16_bad(&b[208..210])),
        }
        .map(|(i, _)| i)
    }
}

#[inline]
pub(crate) fn h(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes one row (`out.len()` elements) from its bytes.
pub fn dequantize_row(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    #[cfg(x86_kernels)]
    if crate::dequant_x86_512::available(ty)
        && src.len() >= out.len() / ty.block_size() * ty.block_bytes()
    {
        // SAFETY: the CPU has AVX-512F (and the build AVX2, FMA, F16C) and
        // a kernel for `ty`; `src` holds the row's blocks.
        unsafe { crate::dequant_x86_512::dequantize(ty, src, out) };
        return;
    }
    dequantize_row_portable(ty, src, out);
}

/// [`dequantize_row`] in portable loops (the definition of its values: the
/// vector paths give the same bits).
pub(crate) fn dequantize_row_portable(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Bf16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(18)) {
                let d = h(b, 0);
                let qs = &b[2..18];
                for j in 0..16 {
                    o[j] = ((qs[j] & 15) as i32 - 8) as f32 * d;
                    o[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(20)) {
                let (d, m) = (h(b, 0), h(b, 2));
                let qs = &b[4..20];
                for j in 0..16 {
                    o[j] = (qs[j] & 15) as f32 * d + m;
                    o[j + 16] = (qs[j] >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(34)) {
                let d = h(b, 0);
                for j in 0..32 {
                    o[j] = b[2 + j] as i8 as f32 * d;
                }
            }
        }
        GgmlType::Q5_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(22)) {
                let d = h(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                let qs = &b[6..22];
                for j in 0..16 {
                    let (lo, hi) = q5_pair(qs[j], qh, j);
                    o[j] = lo * d;
                    o[j + 16] = hi * d;
                }
            }
        }
        GgmlType::Q4_K => {
            for (o, b) in out.chunks_exact_mut(256).zip(src.chunks_exact(144)) {
                let dmin = h(b, 2);
                for c in 0..4 {
                    let ([d1, d2], [m1, m2]) = q4k_pair(b, c);
                    let (m1, m2) = (dmin * m1, dmin * m2);
                    let q = &b[16 + 32 * c..16 + 32 * (c + 1)];
                    let o = &mut o[64 * c..64 * (c + 1)];
                    for l in 0..32 {
                        o[l] = d1 * (q[l] & 15) as f32 - m1;
                        o[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
                    }
                }
            }
        }
        GgmlType::Q6_K => {
            for (o, b) in out.chunks_exact_mut(256).zip(src.chunks_exact(210)) {
                let d = h(b, 208);
                for n in 0..2 {
                    let ql = &b[64 * n..64 * (n + 1)];
                    let qh = &b[128 + 32 * n..128 + 32 * (n + 1)];
                    let sc = &b[192 + 8 * n..192 + 8 * (n + 1)];
                    let o = &mut o[128 * n..128 * (n + 1)];
                    for l in 0..32 {
                        let is = l / 16;
                        let q = q6_quad(ql, qh, l);
                        for (k, &qk) in q.iter().enumerate() {
                            o[l + 32 * k] = d * (sc[is + 2 * k] as i8) as f32 * qk;
                        }
                    }
                }
            }
        }
    }
}

/// The two 5-bit weights of `Q5_0` byte `j` (minus 16): elements `j` and `j + 16`.
#[inline(always)]
fn q5_pair(q: u8, qh: u32, j: usize) -> (f32, f32) {
    let lo = ((q & 15) as u32 | ((qh >> j) & 1) << 4) as i32 - 16;
    let hi = ((q >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4) as i32 - 16;
    (lo as f32, hi as f32)
}

/// Scale and min of `Q4_K` sub-block `j` (6 bits each, packed in 12 bytes).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `Q4_K` block `b`, sub-blocks `2c` and `2c + 1` (sharing code bytes
/// `32c .. 32c + 32`): their scales `d * sc` and their 6-bit minimums (to be
/// multiplied by `dmin`).
#[inline(always)]
pub(crate) fn q4k_pair(b: &[u8], c: usize) -> ([f32; 2], [f32; 2]) {
    let d = h(b, 0);
    let sc: &[u8; 12] = b[4..16].try_into().expect("12");
    let (s1, m1) = scale_min_k4(2 * c, sc);
    let (s2, m2) = scale_min_k4(2 * c + 1, sc);
    ([d * s1 as f32, d * s2 as f32], [m1 as f32, m2 as f32])
}

/// The four 6-bit weights (minus 32) of `Q6_K` lane `l` of a 128-half:
/// elements `l`, `l + 32`, `l + 64`, `l + 96`.
#[inline(always)]
fn q6_quad(ql: &[u8], qh: &[u8], l: usize) -> [f32; 4] {
    let h = qh[l];
    [
        ((ql[l] & 15) | (h & 3) << 4) as i32 - 32,
        ((ql[l + 32] & 15) | ((h >> 2) & 3) << 4) as i32 - 32,
        ((ql[l] >> 4) | ((h >> 4) & 3) << 4) as i32 - 32,
        ((ql[l + 32] >> 4) | ((h >> 6) & 3) << 4) as i32 - 32,
    ]
    .map(|v| v as f32)
}

/// Per-32-block sums of `x` (used by `Q4_1`'s `m * sum(x)` term).
pub fn block_sums(x: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.extend(x.chunks_exact(32).map(|c| c.iter().sum::<f32>()));
}

/// True when [`dot_row`] needs the [`block_sums`] of `x` (`Q4_1`, `Q4_K`).
pub fn needs_block_sums(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_1 | GgmlType::Q4_K)
}

/// The portable `Q4_1` row dot (16 lanes of fused multiply-adds, then the
/// minimums' term); `blocks_x86` computes exactly this with intrinsics.
pub(crate) fn dot_q4_1_portable(src: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut macc = 0.0f32;
    for ((b, xb), xs) in src.chunks_exact(20).zip(x.chunks_exact(32)).zip(xsum) {
        let d = h(b, 0);
        macc += h(b, 2) * xs;
        let qs: &[u8; 16] = b[4..20].try_into().expect("16");
        let (xl, xh) = xb.split_at(16);
        for j in 0..16 {
            acc[j] = fmadd(
                d,
                fmadd((qs[j] & 15) as f32, xl[j], (qs[j] >> 4) as f32 * xh[j]),
                acc[j],
            );
        }
    }
    acc.iter().sum::<f32>() + macc
}

/// The portable `Q8_0` row dot (32 lanes of fused multiply-adds).
pub(crate) fn dot_q8_0_portable(src: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 32];
    for (b, xb) in src.chunks_exact(34).zip(x.chunks_exact(32)) {
        let d = h(b, 0);
        let qs: &[u8; 32] = b[2..34].try_into().expect("32");
        for j in 0..32 {
            acc[j] = fmadd(d, qs[j] as i8 as f32 * xb[j], acc[j]);
        }
    }
    acc.iter().sum()
}

/// `row . x` straight from the row's bytes. `xsum` = [`block_sums`] of `x`
/// (for `Q4_1` and `Q4_K`: their minimums multiply sums of 32 inputs).
#[inline]
pub fn dot_row(ty: GgmlType, src: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
    #[cfg(x86_kernels)]
    if let Some(v) = crate::blocks_x86::dot_row(ty, src, x, xsum) {
        return v;
    }
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => {
            let mut buf = [0.0f32; 64];
            let bs = ty.block_bytes();
            let mut acc = 0.0;
            for (xc, sc) in x.chunks(64).zip(src.chunks(64 * bs)) {
                let b = &mut buf[..xc.len()];
                dequantize_row(ty, sc, b);
                acc += minikv_core::simd::dot(b, xc);
            }
            acc
        }
        GgmlType::Q4_0 => {
            // Per-lane accumulators across blocks; one horizontal sum per row.
            let mut acc = [0.0f32; 16];
            for (b, xb) in src.chunks_exact(18).zip(x.chunks_exact(32)) {
                let d = h(b, 0);
                let qs: &[u8; 16] = b[2..18].try_into().expect("16");
                let (xl, xh) = xb.split_at(16);
                for j in 0..16 {
                    let lo = (qs[j] & 15) as f32 - 8.0;
                    let hi = (qs[j] >> 4) as f32 - 8.0;
                    acc[j] = fmadd(d, fmadd(lo, xl[j], hi * xh[j]), acc[j]);
                }
            }
            acc.iter().sum()
        }
        GgmlType::Q4_1 => dot_q4_1_portable(src, x, xsum),
        GgmlType::Q8_0 => dot_q8_0_portable(src, x),
        GgmlType::Q5_0 => dot_q5_0_portable(src, x),
        GgmlType::Q4_K => dot_q4_k_portable(src, x, xsum),
        GgmlType::Q6_K => dot_q6_k_portable(src, x),
    }
}

/// The portable `Q5_0` row dot (16 lanes of fused multiply-adds).
pub(crate) fn dot_q5_0_portable(src: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    for (b, xb) in src.chunks_exact(22).zip(x.chunks_exact(32)) {
        let d = h(b, 0);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs: &[u8; 16] = b[6..22].try_into().expect("16");
        let (xl, xh) = xb.split_at(16);
        for j in 0..16 {
            let (lo, hi) = q5_pair(qs[j], qh, j);
            acc[j] = fmadd(d, fmadd(lo, xl[j], hi * xh[j]), acc[j]);
        }
    }
    acc.iter().sum()
}

/// The portable `Q4_K` row dot (32 lanes of fused multiply-adds, then the
/// minimums' term); `xsum` holds the 32-block sums of `x`.
pub(crate) fn dot_q4_k_portable(src: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
    let mut acc = [0.0f32; 32];
    let mut macc = 0.0f32;
    for ((b, xb), xs) in src
        .chunks_exact(144)
        .zip(x.chunks_exact(256))
        .zip(xsum.chunks_exact(8))
    {
        let dmin = h(b, 2);
        for c in 0..4 {
            let ([d1, d2], [m1, m2]) = q4k_pair(b, c);
            macc += dmin * (m1 * xs[2 * c] + m2 * xs[2 * c + 1]);
            let q: &[u8; 32] = b[16 + 32 * c..16 + 32 * (c + 1)].try_into().expect("32");
            let (xl, xh) = xb[64 * c..64 * (c + 1)].split_at(32);
            for l in 0..32 {
                acc[l] = fmadd(
                    d1,
                    (q[l] & 15) as f32 * xl[l],
                    fmadd(d2, (q[l] >> 4) as f32 * xh[l], acc[l]),
                );
            }
        }
    }
    acc.iter().sum::<f32>() - macc
}

/// The portable `Q6_K` row dot (16 lanes of fused multiply-adds).
pub(crate) fn dot_q6_k_portable(src: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    for (b, xb) in src.chunks_exact(210).zip(x.chunks_exact(256)) {
        let d = h(b, 208);
        for n in 0..2 {
            let ql = &b[64 * n..64 * (n + 1)];
            let qh = &b[128 + 32 * n..128 + 32 * (n + 1)];
            let sc = &b[192 + 8 * n..192 + 8 * (n + 1)];
            let xb = &xb[128 * n..128 * (n + 1)];
            for half in 0..2 {
                let ds = [0, 2, 4, 6].map(|k| d * (sc[half + k] as i8) as f32);
                for (j, a) in acc.iter_mut().enumerate() {
                    let l = 16 * half + j;
                    let q = q6_quad(ql, qh, l);
                    for k in 0..4 {
                        *a = fmadd(ds[k] * q[k], xb[l + 32 * k], *a);
                    }
                }
            }
        }
    }
    acc.iter().sum()
}

#[cfg(test)]
#[path = "blocks_tests.rs"]
pub(crate) mod tests;
