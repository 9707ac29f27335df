//! Rows of `Q4_1`, `Q8_0`, `Q5_0`, `Q4_K` and `Q6_K` weights dequantized
//! to f32 on 512-bit registers (AVX-512F, detected at run time by the
//! caller), with the portable loops' bits: the codes are unpacked as the
//! dot kernels unpack them (`blocks_x86_512`, `kquant_x86_512`), and each
//! weight is the portable loop's product (and difference or sum).

use crate::blocks::{GgmlType, h, q4k_pair};
use crate::blocks_x86::scale_pair;
use crate::blocks_x86_512::{q4_1_codes, q8_0_codes};
use crate::kquant_x86_512::{q4_k_codes, q5_0_codes, q6_k_scales, q6_k_weights};
use std::arch::x86_64::*;

/// True when [`dequantize`] handles `ty` on this CPU.
#[inline]
pub(crate) fn available(ty: GgmlType) -> bool {
    crate::blocks_x86_512::available(ty) || crate::kquant_x86_512::available(ty)
}

/// A row of blocks of `ty` dequantized (`out.len() / block size` blocks),
/// bitwise [`crate::blocks::dequantize_row_portable`]: `Q4_1` each code
/// times the scale, then plus the minimum, `Q8_0` and `Q5_0` each code
/// times the scale, `Q4_K` each code times its sub-block's scale, less its
/// minimum, `Q6_K` each code times its sub-block's scale product, in the
/// portable loop's lane order.
///
/// A prefill's weight products dequantize every weight once per step,
/// whatever the chunk's length: for chunks of a few tokens the portable
/// loop took half the products' time.
///
/// # Safety
/// [`available`] returned true for `ty`; `src` holds `out.len() / block
/// size` blocks.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    let o = out.as_mut_ptr();
    // SAFETY: block `i < out.len() / block size` of `src` and its outputs,
    // as the caller guarantees (the k-quants' blocks are slices: checked).
    unsafe {
        if ty == GgmlType::Q4_1 {
            for i in 0..out.len() / 32 {
                let b = src.as_ptr().add(20 * i);
                let dm = scale_pair(b);
                let d = _mm512_broadcastss_ps(dm);
                let m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
                for (k, w) in q4_1_codes(b).into_iter().enumerate() {
                    _mm512_storeu_ps(
                        o.add(32 * i + 16 * k),
                        _mm512_add_ps(_mm512_mul_ps(w, d), m),
                    );
                }
            }
        } else if ty == GgmlType::Q8_0 {
            for i in 0..out.len() / 32 {
                let b = src.as_ptr().add(34 * i);
                // The fp16 scale and the first two codes, of which lane 0.
                let d = _mm512_broadcastss_ps(scale_pair(b));
                for (k, w) in q8_0_codes(b).into_iter().enumerate() {
                    _mm512_storeu_ps(o.add(32 * i + 16 * k), _mm512_mul_ps(w, d));
                }
            }
        } else if ty == GgmlType::Q5_0 {
            for i in 0..out.len() / 32 {
                let b = src.as_ptr().add(22 * i);
                let d = _mm512_broadcastss_ps(scale_pair(b));
                for (k, w) in q5_0_codes(b).into_iter().enumerate() {
                    _mm512_storeu_ps(o.add(32 * i + 16 * k), _mm512_mul_ps(w, d));
                }
            }
        } else if ty == GgmlType::Q4_K {
            for (i, blk) in src.chunks_exact(144).take(out.len() / 256).enumerate() {
                let dmin = h(blk, 2);
                for c in 0..4 {
                    let ([d1, d2], [m1, m2]) = q4k_pair(blk, c);
                    let (d1, d2) = (_mm512_set1_ps(d1), _mm512_set1_ps(d2));
                    let (m1, m2) = (_mm512_set1_ps(dmin * m1), _mm512_set1_ps(dmin * m2));
                    for k in 0..2 {
                        let [lo, hi] = q4_k_codes(blk.as_ptr().add(16 + 32 * c + 16 * k));
                        let oc = o.add(256 * i + 64 * c + 16 * k);
                        _mm512_storeu_ps(oc, _mm512_sub_ps(_mm512_mul_ps(d1, lo), m1));
                        _mm512_storeu_ps(oc.add(32), _mm512_sub_ps(_mm512_mul_ps(d2, hi), m2));
                    }
                }
            }
        } else {
            for (i, blk) in src.chunks_exact(210).take(out.len() / 256).enumerate() {
                let ds = q6_k_scales(blk);
                for n in 0..2 {
                    for half in 0..2 {
                        let oc = o.add(256 * i + 128 * n + 16 * half);
                        for (k, w) in q6_k_weights(blk, &ds, n, half).into_iter().enumerate() {
                            _mm512_storeu_ps(oc.add(32 * k), w);
                        }
                    }
                }
            }
        }
    }
}
