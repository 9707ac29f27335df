//! The fused 2- and 4-bit decode loops written with AVX2/FMA intrinsics
//! (compiled when `target-cpu=native` enables them, as on the machines
//! minikv is built for).
//!
//! They perform the operations of the portable loops in [`crate::store`] in
//! the same order per lane (the same fused multiply-adds, the same banks of
//! accumulators added in bank order, the same final additions); the property
//! tests check both against dequantize-then-attend. What differs is that the
//! compiler is told which values live in registers: a word's codes are widened
//! once (`vpsrlvd`, `vpand`, `vcvtdq2ps`: the portable `u32 as f32` took five
//! instructions per vector) and feed every query head of the group, and `B`
//! banks of `NG x P/8` accumulators give the FMA units independent chains.

// Indexed loops over the constant-size register arrays unroll into named
// registers; iterator chains over them did not (accumulators spilled).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

/// Codes of one word as `P / 8` vectors of 8 floats (`P` = 8 or 16).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen<const P: usize>(w: u32, sh: &[__m256i; 2], mask: __m256i) -> [__m256; 2] {
    let wv = _mm256_set1_epi32(w as i32);
    let mut c = [_mm256_setzero_ps(); 2];
    for v in 0..P / 8 {
        c[v] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(wv, sh[v]), mask));
    }
    c
}

/// Per-lane shift counts `bits * l` for lanes `l = 0 .. 16`, and the code mask.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn shifts(bits: u32) -> ([__m256i; 2], __m256i) {
    let b = bits as i32;
    let lane = |l: i32| b * l;
    let sh = [
        _mm256_setr_epi32(
            lane(0),
            lane(1),
            lane(2),
            lane(3),
            lane(4),
            lane(5),
            lane(6),
            lane(7),
        ),
        _mm256_setr_epi32(
            lane(8),
            lane(9),
            lane(10),
            lane(11),
            lane(12),
            lane(13),
            lane(14),
            lane(15),
        ),
    ];
    (sh, _mm256_set1_epi32((1 << b) - 1))
}

/// Key scores of one block of `P` tokens (one word per channel, `words.len()`
/// channels): `out[j][l] = sum_c qs[j][c] * code(l, c)` with channel `c` in
/// bank `c % B` (the last `len % B` channels in bank 0), banks added in order,
/// then `bias[j]` added.
///
/// # Safety
/// AVX2 and FMA must be available (the module is compiled only then);
/// `qs[j]` must hold at least `words.len()` values.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn key_block<const P: usize, const NG: usize, const B: usize>(
    words: &[u32],
    bits: u32,
    qs: &[[f32; crate::store::MAX_D]; NG],
    bias: &[f32; NG],
    out: &mut [[f32; 16]; NG],
) {
    // SAFETY: the caller upholds this function's contract.
    unsafe {
        let (sh, mask) = shifts(bits);
        let mut acc = [[[_mm256_setzero_ps(); 2]; NG]; B];
        let d = words.len();
        let whole = d / B * B;
        let mut c = 0;
        while c < whole {
            for (i, bank) in acc.iter_mut().enumerate() {
                let codes = widen::<P>(*words.get_unchecked(c + i), &sh, mask);
                for j in 0..NG {
                    let s = _mm256_set1_ps(*qs[j].get_unchecked(c + i));
                    for v in 0..P / 8 {
                        bank[j][v] = _mm256_fmadd_ps(s, codes[v], bank[j][v]);
                    }
                }
            }
            c += B;
        }
        while c < d {
            let codes = widen::<P>(*words.get_unchecked(c), &sh, mask);
            for j in 0..NG {
                let s = _mm256_set1_ps(*qs[j].get_unchecked(c));
                for v in 0..P / 8 {
                    acc[0][j][v] = _mm256_fmadd_ps(s, codes[v], acc[0][j][v]);
                }
            }
            c += 1;
        }
        for j in 0..NG {
            for v in 0..P / 8 {
                let mut x = acc[0][j][v];
                for bank in &acc[1..] {
                    x = _mm256_add_ps(x, bank[j][v]);
                }
                x = _mm256_add_ps(x, _mm256_set1_ps(bias[j]));
                _mm256_storeu_ps(out[j].as_mut_ptr().add(8 * v), x);
            }
        }
    }
}

/// Weighted sum of one word column over `n` tokens (word of token `t` at
/// `words[t * wpt]`): `out[j][l] += (sum_t a[j * n + t] * code(t, l)) + macc[j]`
/// with token `t` in bank `t % B` (the last `n % B` tokens in bank 0), banks
/// added in order.
///
/// # Safety
/// AVX2 and FMA must be available; `words` must hold `(n - 1) * wpt + 1`
/// words and `a` at least `NG * n` values.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn value_column<const P: usize, const NG: usize, const B: usize>(
    words: &[u32],
    wpt: usize,
    n: usize,
    bits: u32,
    a: &[f32],
    macc: &[f32; NG],
    out: &mut [f32],
    d: usize,
) {
    // SAFETY: the caller upholds this function's contract.
    unsafe {
        let (sh, mask) = shifts(bits);
        let mut acc = [[[_mm256_setzero_ps(); 2]; NG]; B];
        let whole = n / B * B;
        let wp = words.as_ptr();
        let ap = a.as_ptr();
        let mut t = 0;
        while t < whole {
            for (i, bank) in acc.iter_mut().enumerate() {
                let codes = widen::<P>(*wp.add((t + i) * wpt), &sh, mask);
                for j in 0..NG {
                    let s = _mm256_set1_ps(*ap.add(j * n + t + i));
                    for v in 0..P / 8 {
                        bank[j][v] = _mm256_fmadd_ps(s, codes[v], bank[j][v]);
                    }
                }
            }
            t += B;
        }
        while t < n {
            let codes = widen::<P>(*wp.add(t * wpt), &sh, mask);
            for j in 0..NG {
                let s = _mm256_set1_ps(*ap.add(j * n + t));
                for v in 0..P / 8 {
                    acc[0][j][v] = _mm256_fmadd_ps(s, codes[v], acc[0][j][v]);
                }
            }
            t += 1;
        }
        for j in 0..NG {
            for v in 0..P / 8 {
                let mut x = acc[0][j][v];
                for bank in &acc[1..] {
                    x = _mm256_add_ps(x, bank[j][v]);
                }
                x = _mm256_add_ps(x, _mm256_set1_ps(macc[j]));
                let o = out.as_mut_ptr().add(j * d + 8 * v);
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), x));
            }
        }
    }
}
