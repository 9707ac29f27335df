//! ggml tensor types (llama.cpp's block definitions): dequantization and dot
//! products against f32 vectors straight from the blocks.
//!
//! * `Q4_0`: 32 weights in 18 bytes: fp16 `d`, 16 bytes of nibbles; `x = (q - 8) d`.
//! * `Q4_1`: 32 weights in 20 bytes: fp16 `d`, fp16 `m`, 16 bytes; `x = q d + m`.
//! * `Q8_0`: 32 weights in 34 bytes: fp16 `d`, 32 `i8`; `x = q d`.
//!
//! Nibble order: byte `j` holds weight `j` in its low nibble and `j + 16` in its high one.

use half::{bf16, f16};
use minikv_core::kernels::fmadd;

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
}

impl GgmlType {
    /// From the ggml type id.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::Bf16,
            _ => return None,
        })
    }
    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => 1,
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
        }
    }
    /// Bytes of a row of `n` elements.
    pub fn row_bytes(self, n: usize) -> usize {
        n / self.block_size() * self.block_bytes()
    }
}

#[inline]
fn h(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes one row (`out.len()` elements) from its bytes.
pub fn dequantize_row(ty: GgmlType, src: &[u8], out: &mut [f32]) {
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
    }
}

/// Per-32-block sums of `x` (used by `Q4_1`'s `m * sum(x)` term).
pub fn block_sums(x: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.extend(x.chunks_exact(32).map(|c| c.iter().sum::<f32>()));
}

/// `row . x` straight from the row's bytes. `xsum` = [`block_sums`] of `x` (for `Q4_1`).
#[inline]
pub fn dot_row(ty: GgmlType, src: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => {
            let mut buf = [0.0f32; 64];
            let bs = ty.block_bytes();
            let mut acc = 0.0;
            for (xc, sc) in x.chunks(64).zip(src.chunks(64 * bs)) {
                let b = &mut buf[..xc.len()];
                dequantize_row(ty, sc, b);
                acc += minikv_core::kernels::dot(b, xc);
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
        GgmlType::Q4_1 => {
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
        GgmlType::Q8_0 => {
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
    }
}
