//! fp16 rows attended in registers (x86-64 with AVX2, FMA and F16C, which
//! `target-cpu=native` enables on the machines minikv is built for): each
//! 8-channel chunk of a row is loaded and widened once (`vcvtph2ps`) and
//! used by every query head of the group, instead of converting blocks of
//! rows to f32 through a buffer and reading them back per head.
//!
//! Bitwise equal to the portable path ([`crate::simd::dot`] lanes and
//! reduction for scores; rows applied in order with fused multiply-adds for
//! the weighted sum), so every result of the cache is unchanged.

use half::f16;
use std::arch::x86_64::*;

/// Query heads handled per pass over the rows (12 accumulators + 1 row
/// chunk + 1 query chunk fit the 16 vector registers).
const MAX_G: usize = 3;

/// `out[j * stride + r] = q_j . row_r` for the `m = rows.len() / d` rows,
/// `g` queries `q [g][d]`; `d` a multiple of 8.
pub fn scores(rows: &[f16], d: usize, q: &[f32], g: usize, out: &mut [f32], stride: usize) {
    debug_assert!(d.is_multiple_of(8) && q.len() >= g * d);
    let m = rows.len() / d;
    let mut j0 = 0;
    while j0 < g {
        let gj = MAX_G.min(g - j0);
        let qs = &q[j0 * d..(j0 + gj) * d];
        let o = &mut out[j0 * stride..];
        // SAFETY: the target features are enabled at compile time (cfg on
        // the module); every index is within `rows`, `qs` and `o` (m rows of
        // d channels, gj queries, rows written at j * stride + r < len).
        unsafe {
            match gj {
                1 => scores_g::<1>(rows, d, m, qs, o, stride),
                2 => scores_g::<2>(rows, d, m, qs, o, stride),
                _ => scores_g::<3>(rows, d, m, qs, o, stride),
            }
        }
        j0 += gj;
    }
}

/// Rows ahead of the one being read whose halves the loops ask the cache
/// for: a model's layers do not fit in the caches, and a hint never changes
/// a result.
const PREFETCH_ROWS: usize = 128;

/// Hints the cache lines of halves `at .. at + n` of `rows` (those within
/// it) into the first-level cache.
#[inline(always)]
fn prefetch_rows(rows: &[f16], at: usize, n: usize) {
    let end = (at + n).min(rows.len());
    let mut i = at;
    while i < end {
        // SAFETY: `i < rows.len()`; a prefetch reads nothing.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(rows.as_ptr().add(i) as *const i8) };
        i += 32;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_row(rows: &[f16], at: usize) -> __m256 {
    debug_assert!(at + 8 <= rows.len());
    // SAFETY: 8 halves (16 bytes) at `at` are in bounds (callers' loop
    // bounds). Loaded under an all-lanes mask, as in `load8`.
    unsafe {
        let p = rows.as_ptr().add(at) as *const i32;
        _mm256_cvtph_ps(_mm_maskload_epi32(p, _mm_set1_epi32(-1)))
    }
}

/// 8 floats at `p`, loaded under an all-lanes mask rather than with
/// `_mm256_loadu_ps`: that one is a `read_unaligned`, which with debug
/// assertions (the tests' profile, where this crate is still optimized)
/// keeps std's checks and sends each vector through the stack. In release
/// builds the compiler turns the all-lanes masked load into the same plain
/// `vmovups`.
///
/// # Safety
/// AVX2; 32 readable bytes at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load8(p: *const f32) -> __m256 {
    // SAFETY: as the caller guarantees.
    unsafe { _mm256_maskload_ps(p, _mm256_set1_epi32(-1)) }
}

/// Stores 8 floats at `p` under an all-lanes mask (see [`load8`]).
///
/// # Safety
/// AVX2; 32 writable bytes at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store8(p: *mut f32, x: __m256) {
    // SAFETY: as the caller guarantees.
    unsafe { _mm256_maskstore_ps(p, _mm256_set1_epi32(-1), x) }
}

/// [`crate::simd::dot`]'s reduction of 4 accumulators at once:
/// `(a0 + a4) + (a1 + a5) + ((a2 + a6) + (a3 + a7))` per row.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn reduce4(a: [__m256; 4]) -> __m128 {
    let s = |v: __m256| _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let (s0, s1, s2, s3) = (s(a[0]), s(a[1]), s(a[2]), s(a[3]));
    _mm_hadd_ps(_mm_hadd_ps(s0, s1), _mm_hadd_ps(s2, s3))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_g<const G: usize>(
    rows: &[f16],
    d: usize,
    m: usize,
    q: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let m4 = m - m % 4;
    let mut r = 0;
    while r < m4 {
        prefetch_rows(rows, (r + PREFETCH_ROWS) * d, 4 * d);
        let mut acc = [[_mm256_setzero_ps(); 4]; G];
        let mut c = 0;
        while c < d {
            for k in 0..4 {
                // SAFETY: row r + k < m, channel chunk c + 8 <= d.
                let x = unsafe { load_row(rows, (r + k) * d + c) };
                for (j, a) in acc.iter_mut().enumerate() {
                    // SAFETY: j < G queries of d channels.
                    let qv = unsafe { load8(q.as_ptr().add(j * d + c)) };
                    a[k] = _mm256_fmadd_ps(qv, x, a[k]);
                }
            }
            c += 8;
        }
        for (j, a) in acc.iter().enumerate() {
            let v = unsafe { reduce4(*a) };
            let o = &mut out[j * stride + r..j * stride + r + 4];
            // SAFETY: 4 floats in bounds (slice above).
            unsafe { _mm_storeu_ps(o.as_mut_ptr(), v) };
        }
        r += 4;
    }
    while r < m {
        let mut acc = [_mm256_setzero_ps(); G];
        let mut c = 0;
        while c < d {
            let x = unsafe { load_row(rows, r * d + c) };
            for (j, a) in acc.iter_mut().enumerate() {
                let qv = unsafe { load8(q.as_ptr().add(j * d + c)) };
                *a = _mm256_fmadd_ps(qv, x, *a);
            }
            c += 8;
        }
        for (j, a) in acc.iter().enumerate() {
            let z = _mm256_setzero_ps();
            let v = unsafe { reduce4([*a, z, z, z]) };
            out[j * stride + r] = _mm_cvtss_f32(v);
        }
        r += 1;
    }
}

/// `out[j][c] += sum_r w[j * stride + r] * row_r[c]` over the `m` rows in
/// order (each row one fused multiply-add per element, as
/// [`crate::simd::axpy`] applied row after row); `d` a multiple of 8.
pub fn accumulate(rows: &[f16], d: usize, w: &[f32], g: usize, stride: usize, out: &mut [f32]) {
    debug_assert!(d.is_multiple_of(8) && out.len() >= g * d);
    let m = rows.len() / d;
    let mut j0 = 0;
    while j0 < g {
        let gj = 4.min(g - j0);
        let ws = &w[j0 * stride..];
        let o = &mut out[j0 * d..(j0 + gj) * d];
        // SAFETY: features enabled at compile time; indices within bounds
        // (m rows of d, gj weight rows of stride >= m, gj output rows of d).
        unsafe {
            match gj {
                1 => accumulate_g::<1>(rows, d, m, ws, stride, o),
                2 => accumulate_g::<2>(rows, d, m, ws, stride, o),
                3 => accumulate_g::<3>(rows, d, m, ws, stride, o),
                _ => accumulate_g::<4>(rows, d, m, ws, stride, o),
            }
        }
        j0 += gj;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate_g<const G: usize>(
    rows: &[f16],
    d: usize,
    m: usize,
    w: &[f32],
    stride: usize,
    out: &mut [f32],
) {
    // Up to 12 accumulators: G heads x NC chunks of 8 channels, so that
    // enough independent FMA chains hide the FMA latency.
    let mut c = 0;
    if G <= 3 {
        while c + 32 <= d {
            // SAFETY: channels c..c + 32 <= d (loop bound), as below.
            unsafe { accumulate_chunks::<G, 4>(rows, d, m, w, stride, out, c) };
            c += 32;
        }
    }
    while c + 16 <= d {
        unsafe { accumulate_chunks::<G, 2>(rows, d, m, w, stride, out, c) };
        c += 16;
    }
    while c < d {
        unsafe { accumulate_chunks::<G, 1>(rows, d, m, w, stride, out, c) };
        c += 8;
    }
}

/// Channels `c .. c + 8 NC` of the weighted sum: each output chunk in a
/// register over blocks of rows small enough to stay in L1; every element
/// still receives its rows in order, one fused multiply-add each.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate_chunks<const G: usize, const NC: usize>(
    rows: &[f16],
    d: usize,
    m: usize,
    w: &[f32],
    stride: usize,
    out: &mut [f32],
    c: usize,
) {
    debug_assert!(c + 8 * NC <= d && w.len() >= (G - 1) * stride + m);
    const BLOCK: usize = 64;
    let mut r0 = 0;
    while r0 < m {
        let r1 = (r0 + BLOCK).min(m);
        let mut y = [[_mm256_setzero_ps(); NC]; G];
        for (j, y) in y.iter_mut().enumerate() {
            for (u, y) in y.iter_mut().enumerate() {
                // SAFETY: output row j < G, channels c + 8u + 8 <= d.
                *y = unsafe { load8(out.as_ptr().add(j * d + c + 8 * u)) };
            }
        }
        for r in r0..r1 {
            if c == 0 {
                prefetch_rows(rows, (r + PREFETCH_ROWS) * d, d);
            }
            let mut x = [_mm256_setzero_ps(); NC];
            for (u, x) in x.iter_mut().enumerate() {
                // SAFETY: row r < m, channels in bounds.
                *x = unsafe { load_row(rows, r * d + c + 8 * u) };
            }
            for (j, y) in y.iter_mut().enumerate() {
                // SAFETY: j * stride + r < w.len() (asserted shape).
                let p = _mm256_set1_ps(unsafe { *w.get_unchecked(j * stride + r) });
                for (y, x) in y.iter_mut().zip(&x) {
                    *y = _mm256_fmadd_ps(p, *x, *y);
                }
            }
        }
        for (j, y) in y.iter().enumerate() {
            for (u, y) in y.iter().enumerate() {
                // SAFETY: as the loads above.
                unsafe { store8(out.as_mut_ptr().add(j * d + c + 8 * u), *y) };
            }
        }
        r0 = r1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2654435761).wrapping_add(seed);
                (x >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    /// Bitwise equal to `simd::dot` per row and to `simd::axpy` row after
    /// row, for every query count, remainder rows and head dims 8..256.
    #[test]
    fn equal_to_the_portable_loops_bit_for_bit() {
        for (d, m) in [(8usize, 1usize), (64, 37), (256, 9), (72, 4), (128, 130)] {
            let rows: Vec<f16> = data(m * d, 1).iter().map(|&x| f16::from_f32(x)).collect();
            let rf: Vec<f32> = rows.iter().map(|x| x.to_f32()).collect();
            for g in 1..=7 {
                let q = data(g * d, 2);
                let stride = m + 3;
                let mut got = vec![0.0f32; g * stride];
                scores(&rows, d, &q, g, &mut got, stride);
                for j in 0..g {
                    for r in 0..m {
                        let want = simd::dot(&q[j * d..(j + 1) * d], &rf[r * d..(r + 1) * d]);
                        assert_eq!(got[j * stride + r].to_bits(), want.to_bits(), "d {d} g {g}");
                    }
                }
                let w = data(g * stride, 3);
                let mut acc = data(g * d, 4);
                let mut want = acc.clone();
                accumulate(&rows, d, &w, g, stride, &mut acc);
                for j in 0..g {
                    for r in 0..m {
                        simd::axpy(
                            w[j * stride + r],
                            &rf[r * d..(r + 1) * d],
                            &mut want[j * d..(j + 1) * d],
                        );
                    }
                }
                let same = acc
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "accumulate d {d} g {g}");
            }
        }
    }
}
