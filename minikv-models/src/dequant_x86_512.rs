//! Rows of `Q4_1` and `Q8_0` weights dequantized to f32 on 512-bit
//! registers (AVX-512F, detected at run time by the caller), with the
//! portable loops' bits.

use crate::blocks::GgmlType;
use crate::blocks_x86::scale_pair;
use crate::blocks_x86_512::{q4_1_codes, q8_0_codes};
use std::arch::x86_64::*;

/// A row of `Q4_1` or `Q8_0` blocks dequantized (`out.len() / 32` blocks),
/// bitwise [`crate::blocks::dequantize_row_portable`]: `Q4_1` each code
/// times the scale, then plus the minimum, `Q8_0` each code times the
/// scale, in the portable loop's lane order (a code times an fp16 scale is
/// exact in f32, so only the minimum's sum rounds).
///
/// A prefill's weight products dequantize every weight once per step,
/// whatever the chunk's length: for chunks of a few tokens the portable
/// loop took half the products' time.
///
/// # Safety
/// [`crate::blocks_x86_512::available`] returned true for `ty`; `src`
/// holds `out.len() / 32` blocks.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    let o = out.as_mut_ptr();
    // SAFETY: block `i < out.len() / 32` of `src` and its 32 outputs, as
    // the caller guarantees.
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
        } else {
            for i in 0..out.len() / 32 {
                let b = src.as_ptr().add(34 * i);
                // The fp16 scale and the first two codes, of which lane 0.
                let d = _mm512_broadcastss_ps(scale_pair(b));
                for (k, w) in q8_0_codes(b).into_iter().enumerate() {
                    _mm512_storeu_ps(o.add(32 * i + 16 * k), _mm512_mul_ps(w, d));
                }
            }
        }
    }
}
