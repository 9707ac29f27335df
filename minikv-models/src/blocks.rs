//! ggml tensor types (llama.cpp's block definitions): dequantization and dot
//! products against f32 vectors straight from the blocks.
//!
//! * `Q4_0`: 32 weights in 18 bytes: fp16 `d`, 16 bytes of nibbles; `x = (q - 8) d`.
//! * `Q4_1`: 32 weights in 20 bytes: fp16 `d`, fp16 `m`, 16 bytes; `x = q d + m`.
//! * `Q8_0`: 32 weights in 34 bytes: fp16 `d`, 32 `i8`; `x = q d`.
//!
//! Nibble order: byte `j` holds weight `j` in its low nibble and `j + 16` in its high one.

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
            Self::Q4_0 | Self::Q8_0 => it.find(|(_, b)| f16_bad(&b[..2])),
            Self::Q4_1 => it.find(|(_, b)| f16_bad(&b[..2]) || f16_bad(&b[2..4])),
        }
        .map(|(i, _)| i)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    /// Hand-built blocks per llama.cpp's definitions.
    #[test]
    fn block_layouts() {
        // Q4_0: d = 0.5; byte j = low nibble (element j) | high nibble (element j + 16).
        let mut b = f16b(0.5).to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = [0.0f32; 32];
        dequantize_row(GgmlType::Q4_0, &b, &mut out);
        assert_eq!(out[0], -4.0); // (0 - 8) * 0.5
        assert_eq!(out[15], 3.5); // (15 - 8) * 0.5
        assert_eq!(out[16], 3.5); // high nibble of byte 0 = 15
        assert_eq!(out[31], -4.0);
        // Q4_1: d = 0.25, m = -1: x = q d + m.
        let mut b = f16b(0.25).to_vec();
        b.extend(f16b(-1.0));
        b.extend((0..16u8).map(|j| j | (j << 4)));
        dequantize_row(GgmlType::Q4_1, &b, &mut out);
        assert_eq!((out[0], out[3], out[19]), (-1.0, -0.25, -0.25));
        // Q8_0: d = 2, signed bytes.
        let mut b = f16b(2.0).to_vec();
        b.extend((0..32i8).map(|j| (j - 16) as u8));
        dequantize_row(GgmlType::Q8_0, &b, &mut out);
        assert_eq!((out[0], out[16], out[31]), (-32.0, 0.0, 30.0));
        // F16 / BF16 / F32.
        let mut o2 = [0.0f32; 2];
        dequantize_row(GgmlType::F16, &[f16b(1.5), f16b(-2.0)].concat(), &mut o2);
        assert_eq!(o2, [1.5, -2.0]);
        dequantize_row(
            GgmlType::Bf16,
            &[
                bf16::from_f32(3.0).to_le_bytes(),
                bf16::from_f32(-0.5).to_le_bytes(),
            ]
            .concat(),
            &mut o2,
        );
        assert_eq!(o2, [3.0, -0.5]);
        dequantize_row(
            GgmlType::F32,
            &[1.25f32.to_le_bytes(), 7.0f32.to_le_bytes()].concat(),
            &mut o2,
        );
        assert_eq!(o2, [1.25, 7.0]);
    }

    /// The direct dot products equal dequantize-then-dot for every type.
    #[test]
    fn dot_equals_dequantized_dot() {
        let n = 96;
        let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 19) as f32 - 9.0) / 7.0).collect();
        let mut xs = Vec::new();
        block_sums(&x, &mut xs);
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::Bf16,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
        ] {
            let bytes: Vec<u8> = (0..ty.row_bytes(n)).map(|i| (i * 97 % 251) as u8).collect();
            // Keep float scales/values finite: rebuild scale fields as small halves.
            let mut bytes = bytes;
            match ty {
                GgmlType::F32 => {
                    for (i, c) in bytes.chunks_exact_mut(4).enumerate() {
                        c.copy_from_slice(&((i as f32) * 0.1 - 3.0).to_le_bytes());
                    }
                }
                GgmlType::F16 | GgmlType::Bf16 => {
                    for (i, c) in bytes.chunks_exact_mut(2).enumerate() {
                        let v = (i as f32) * 0.1 - 3.0;
                        c.copy_from_slice(&if ty == GgmlType::F16 {
                            f16::from_f32(v).to_le_bytes()
                        } else {
                            bf16::from_f32(v).to_le_bytes()
                        });
                    }
                }
                _ => {
                    for c in bytes.chunks_exact_mut(ty.block_bytes()) {
                        c[..2].copy_from_slice(&f16b(0.37));
                        if ty == GgmlType::Q4_1 {
                            c[2..4].copy_from_slice(&f16b(-0.8));
                        }
                    }
                }
            }
            let mut w = vec![0.0f32; n];
            dequantize_row(ty, &bytes, &mut w);
            let want: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
            let got = dot_row(ty, &bytes, &x, &xs);
            assert!(
                (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{ty:?}: {got} vs {want}"
            );
        }
    }
}
