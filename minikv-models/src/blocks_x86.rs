//! `Q4_1` and `Q8_0` row dot products written with AVX2/FMA/F16C intrinsics
//! (compiled when `target-cpu=native` enables them).
//!
//! They perform the portable loops' arithmetic of [`crate::blocks::dot_row`]
//! exactly, lane for lane and in the same order (so every logit is bitwise
//! unchanged, `tests` below). What they fix is the scalar loads of each
//! block's fp16 scale and minimum: the compiler inserted them into a register
//! with `vpinsrw`, which merges into (so waits for) whatever that register
//! last held, in practice the running sum of the minimum terms, chaining every
//! block's loads behind the previous block's additions. Here the two fp16
//! values are read as one 32-bit word into a fresh register (`vmovd`) and
//! widened together (`vcvtph2ps`).

use crate::blocks::GgmlType;
use std::arch::x86_64::*;

/// Software prefetch distance in bytes.
pub(crate) const PREFETCH: usize = 1024;

/// The block's leading fp16 pair (`d`, and `m` for `Q4_1`) as `[d, m, 0, 0]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn scale_pair(b: *const u8) -> __m128 {
    // SAFETY: the caller guarantees 4 readable bytes at `b`.
    unsafe { _mm_cvtph_ps(_mm_cvtsi32_si128((b as *const i32).read_unaligned())) }
}

/// Sum of the lanes in index order: the portable `acc.iter().sum::<f32>()`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn lanes_sum(acc: &[__m256]) -> f32 {
    let mut lanes = [0.0f32; 32];
    for (k, a) in acc.iter().enumerate() {
        // SAFETY: at most 4 vectors, 32 lanes.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * k), *a) };
    }
    lanes[..8 * acc.len()].iter().sum::<f32>()
}

/// [`crate::blocks::dot_row`] for `Q4_1` and `Q8_0` rows on the widest
/// kernel the CPU has (512-bit where AVX-512F is detected, else these AVX2
/// ones), for `Q5_0`, `Q4_K` and `Q6_K` rows on the 512-bit kernels of
/// `kquant_x86_512` where AVX-512F is detected, else the 256-bit ones of
/// `kquant_x86`; `None` otherwise (other types, or a row or sums too
/// short, which the portable loops handle as they do).
#[inline]
pub(crate) fn dot_row(ty: GgmlType, src: &[u8], x: &[f32], xsum: &[f32]) -> Option<f32> {
    use crate::blocks_x86_512 as wide;
    let nb = x.len() / 32;
    let w = wide::available(ty);
    // SAFETY: AVX2/FMA/F16C are enabled (this module's cfg), AVX-512F where
    // detected; the row holds `nb` blocks and `xsum` one sum per block.
    unsafe {
        match ty {
            GgmlType::Q4_1 if src.len() >= nb * 20 && xsum.len() >= nb => Some(match w {
                true => wide::dot_q4_1(src, x, xsum),
                false => dot_q4_1(src, x, xsum),
            }),
            GgmlType::Q8_0 if src.len() >= nb * 34 => Some(match w {
                true => wide::dot_q8_0(src, x),
                false => dot_q8_0(src, x),
            }),
            _ => crate::kquant_x86_512::dot_row(ty, src, x, xsum)
                .or_else(|| crate::kquant_x86::dot_row(ty, src, x, xsum)),
        }
    }
}

/// `Q4_1` row (`x.len() / 32` blocks of 20 bytes) dot `x`, with `xsum` the
/// 32-block sums of `x`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `src` must hold `x.len() / 32`
/// blocks and `xsum` as many sums.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_1(src: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
    let nb = x.len() / 32;
    // SAFETY: every pointer below stays within block `i < nb` of `src`, `x`
    // and `xsum`, as the caller guarantees.
    unsafe {
        let mask = _mm_set1_epi8(15);
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut macc = 0.0f32;
        for i in 0..nb {
            let b = src.as_ptr().add(20 * i);
            // Weights stream from memory: ask for the bytes ~1 KiB ahead (a
            // prefetch never faults, past the row's end included).
            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH) as *const i8);
            let dm = scale_pair(b);
            let d = _mm256_broadcastss_ps(dm);
            let m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
            macc += m * *xsum.get_unchecked(i);
            let qs = _mm_loadu_si128(b.add(4) as *const __m128i);
            let lo = _mm_and_si128(qs, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
            let f = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
            let xp = x.as_ptr().add(32 * i);
            // Lanes j = 0..16: weight j (low nibble, x[j]) and j + 16 (high, x[j + 16]).
            let in0 = _mm256_fmadd_ps(
                f(lo),
                _mm256_loadu_ps(xp),
                _mm256_mul_ps(f(hi), _mm256_loadu_ps(xp.add(16))),
            );
            let in1 = _mm256_fmadd_ps(
                f(_mm_srli_si128(lo, 8)),
                _mm256_loadu_ps(xp.add(8)),
                _mm256_mul_ps(f(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(xp.add(24))),
            );
            acc0 = _mm256_fmadd_ps(d, in0, acc0);
            acc1 = _mm256_fmadd_ps(d, in1, acc1);
        }
        lanes_sum(&[acc0, acc1]) + macc
    }
}

/// `Q8_0` row (`x.len() / 32` blocks of 34 bytes) dot `x`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `src` must hold `x.len() / 32` blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q8_0(src: &[u8], x: &[f32]) -> f32 {
    let nb = x.len() / 32;
    // SAFETY: every pointer below stays within block `i < nb` of `src` and `x`
    // (the fp16 scale is read as a 4-byte word: its 2 bytes and the first two
    // codes, which the conversion then ignores).
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in 0..nb {
            let b = src.as_ptr().add(34 * i);
            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH) as *const i8);
            let d = _mm256_broadcastss_ps(scale_pair(b));
            let xp = x.as_ptr().add(32 * i);
            for (k, a) in acc.iter_mut().enumerate() {
                let q8 = _mm_loadl_epi64(b.add(2 + 8 * k) as *const __m128i);
                let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
                let qx = _mm256_mul_ps(q, _mm256_loadu_ps(xp.add(8 * k)));
                *a = _mm256_fmadd_ps(d, qx, *a);
            }
        }
        lanes_sum(&acc)
    }
}

/// [`dot_q4_1`] of one row against `N` inputs at once: each block's codes are
/// unpacked once and multiplied with every input. Per input the operations
/// are those of [`dot_q4_1`], in the same order, so each result is bitwise
/// equal to a separate call (`tests` below).
///
/// # Safety
/// As [`dot_q4_1`], for every input: AVX2, FMA and F16C available; `src`
/// holds `nb` blocks; each `xs[j]` holds `32 nb` values and `sums[j]` `nb`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_1_n<const N: usize>(
    src: &[u8],
    nb: usize,
    xs: [*const f32; N],
    sums: [*const f32; N],
    out: &mut [f32; N],
) {
    // SAFETY: every pointer stays within block `i < nb` of `src` and of
    // each input, as the caller guarantees.
    unsafe {
        let mask = _mm_set1_epi8(15);
        let mut acc0 = [_mm256_setzero_ps(); N];
        let mut acc1 = [_mm256_setzero_ps(); N];
        let mut macc = [0.0f32; N];
        for i in 0..nb {
            let b = src.as_ptr().add(20 * i);
            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH) as *const i8);
            let dm = scale_pair(b);
            let d = _mm256_broadcastss_ps(dm);
            let m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
            let qs = _mm_loadu_si128(b.add(4) as *const __m128i);
            let lo = _mm_and_si128(qs, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
            let f = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
            let (wl0, wh0) = (f(lo), f(hi));
            let (wl1, wh1) = (f(_mm_srli_si128(lo, 8)), f(_mm_srli_si128(hi, 8)));
            for j in 0..N {
                macc[j] += m * *sums[j].add(i);
                let xp = xs[j].add(32 * i);
                let in0 = _mm256_fmadd_ps(
                    wl0,
                    _mm256_loadu_ps(xp),
                    _mm256_mul_ps(wh0, _mm256_loadu_ps(xp.add(16))),
                );
                let in1 = _mm256_fmadd_ps(
                    wl1,
                    _mm256_loadu_ps(xp.add(8)),
                    _mm256_mul_ps(wh1, _mm256_loadu_ps(xp.add(24))),
                );
                acc0[j] = _mm256_fmadd_ps(d, in0, acc0[j]);
                acc1[j] = _mm256_fmadd_ps(d, in1, acc1[j]);
            }
        }
        for j in 0..N {
            out[j] = lanes_sum(&[acc0[j], acc1[j]]) + macc[j];
        }
    }
}

/// [`dot_q8_0`] of one row against `N` inputs at once (codes widened once per
/// block); bitwise equal to separate calls.
///
/// # Safety
/// As [`dot_q8_0`], for every input: `src` holds `nb` blocks and each
/// `xs[j]` `32 nb` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q8_0_n<const N: usize>(
    src: &[u8],
    nb: usize,
    xs: [*const f32; N],
    out: &mut [f32; N],
) {
    // SAFETY: as in `dot_q8_0`, for every input.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 4]; N];
        for i in 0..nb {
            let b = src.as_ptr().add(34 * i);
            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH) as *const i8);
            let d = _mm256_broadcastss_ps(scale_pair(b));
            let q: [__m256; 4] = std::array::from_fn(|k| {
                let q8 = _mm_loadl_epi64(b.add(2 + 8 * k) as *const __m128i);
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8))
            });
            for j in 0..N {
                let xp = xs[j].add(32 * i);
                for k in 0..4 {
                    let qx = _mm256_mul_ps(q[k], _mm256_loadu_ps(xp.add(8 * k)));
                    acc[j][k] = _mm256_fmadd_ps(d, qx, acc[j][k]);
                }
            }
        }
        for j in 0..N {
            out[j] = lanes_sum(&acc[j]);
        }
    }
}

/// `out[r]` = the row dot of row `r` of `w` (consecutive `Q4_1` or `Q8_0`
/// rows of `x.len() / 32` blocks) against `x`: `Q4_1` rows four at a time
/// (four independent chains of fused multiply-adds, each block of the
/// input loaded once for the four), `Q8_0` rows two at a time (their four
/// accumulators each fill the registers at four rows: SmolLM2's head
/// measured 10% faster in pairs, and no faster in fours than alone), the
/// rest one by one. Each result is bitwise
/// [`dot_q4_1`] / [`dot_q8_0`] of its row: the single-input product of
/// CPUs with AVX2 but no AVX-512 (`blocks_x86_512::matvec` on those with).
///
/// # Safety
/// AVX2, FMA and F16C must be available; `ty` is `Q4_1` or `Q8_0`; `w`
/// holds `out.len()` rows; for `Q4_1` `xsum` holds the `x.len() / 32`
/// block sums of `x`.
pub(crate) unsafe fn matvec(ty: GgmlType, w: &[u8], x: &[f32], xsum: &[f32], out: &mut [f32]) {
    let nb = x.len() / 32;
    let rb = ty.row_bytes(32 * nb);
    assert!(w.len() >= out.len() * rb && (ty != GgmlType::Q4_1 || xsum.len() >= nb));
    // SAFETY: AVX2/FMA/F16C (the caller); `w` holds the `left` remaining
    // rows (asserted above), `xsum` the block sums for `Q4_1`.
    in_groups(rb, w, out, |w, o, left| unsafe {
        match (ty, left) {
            (GgmlType::Q4_1, 4..) => {
                dot_q4_1_rows::<4>(w, nb, x, xsum, o);
                4
            }
            (GgmlType::Q4_1, _) => {
                dot_q4_1_rows::<1>(w, nb, x, xsum, o);
                1
            }
            (_, 2..) => {
                dot_q8_0_rows::<2>(w, nb, x, o);
                2
            }
            _ => {
                dot_q8_0_rows::<1>(w, nb, x, o);
                1
            }
        }
    });
}

/// Walks `out` (one output per row of `w`, `rb` bytes a row) in groups:
/// `group(the rows from r on, their outputs, rows left)` takes the first
/// rows of what it is given and returns how many (at least one).
pub(crate) fn in_groups(
    rb: usize,
    w: &[u8],
    out: &mut [f32],
    mut group: impl FnMut(&[u8], &mut [f32], usize) -> usize,
) {
    let mut r = 0;
    while r < out.len() {
        let left = out.len() - r;
        r += group(&w[r * rb..], &mut out[r..], left);
    }
}

/// How far ahead the AVX2 row groups prefetch, in rows: block `i` of row
/// `r` asks for block `i` of row `r + PF_ROWS` (two groups of four `Q4_1`
/// rows, four pairs of `Q8_0` rows; a fixed distance in bytes would reach,
/// from inside a group of short rows, only into the group itself).
pub(crate) const PF_ROWS: usize = 8;

/// `R` consecutive `Q4_1` rows (`nb` blocks each) dot one input: `out[r]`
/// is bitwise [`dot_q4_1`] of row `r` (its own two accumulators and
/// minimums' sum, the same operations in the same order); the input's
/// block is loaded once for the `R` rows.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `src` holds `R` rows of `nb`
/// blocks; `x` holds `32 nb` values and `xsum` `nb` sums.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_1_rows<const R: usize>(
    src: &[u8],
    nb: usize,
    x: &[f32],
    xsum: &[f32],
    out: &mut [f32],
) {
    debug_assert!(src.len() >= R * nb * 20 && x.len() >= 32 * nb && xsum.len() >= nb);
    // SAFETY: every pointer stays within block `i < nb` of each of the `R`
    // rows, of `x` and of `xsum`, as the caller guarantees.
    unsafe {
        let mask = _mm_set1_epi8(15);
        let f = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        let mut acc0 = [_mm256_setzero_ps(); R];
        let mut acc1 = [_mm256_setzero_ps(); R];
        let mut macc = [0.0f32; R];
        let rb = 20 * nb;
        for i in 0..nb {
            let xp = x.as_ptr().add(32 * i);
            let xv = [0, 8, 16, 24].map(|k| _mm256_loadu_ps(xp.add(k)));
            let s = *xsum.get_unchecked(i);
            for r in 0..R {
                let b = src.as_ptr().add(r * rb + 20 * i);
                _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PF_ROWS * rb) as *const i8);
                let dm = scale_pair(b);
                macc[r] += _mm_cvtss_f32(_mm_movehdup_ps(dm)) * s;
                let qs = _mm_loadu_si128(b.add(4) as *const __m128i);
                let lo = _mm_and_si128(qs, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                let in0 = _mm256_fmadd_ps(f(lo), xv[0], _mm256_mul_ps(f(hi), xv[2]));
                let in1 = _mm256_fmadd_ps(
                    f(_mm_srli_si128(lo, 8)),
                    xv[1],
                    _mm256_mul_ps(f(_mm_srli_si128(hi, 8)), xv[3]),
                );
                let d = _mm256_broadcastss_ps(dm);
                acc0[r] = _mm256_fmadd_ps(d, in0, acc0[r]);
                acc1[r] = _mm256_fmadd_ps(d, in1, acc1[r]);
            }
        }
        for r in 0..R {
            out[r] = lanes_sum(&[acc0[r], acc1[r]]) + macc[r];
        }
    }
}

/// `R` consecutive `Q8_0` rows (`nb` blocks each) dot one input: `out[r]`
/// is bitwise [`dot_q8_0`] of row `r`, as [`dot_q4_1_rows`] does for
/// `Q4_1`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `src` holds `R` rows of `nb`
/// blocks; `x` holds `32 nb` values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0_rows<const R: usize>(src: &[u8], nb: usize, x: &[f32], out: &mut [f32]) {
    debug_assert!(src.len() >= R * nb * 34 && x.len() >= 32 * nb);
    // SAFETY: every pointer stays within block `i < nb` of each of the `R`
    // rows and of `x`, as the caller guarantees (the fp16 scale is read as a
    // 4-byte word: its 2 bytes and the first two codes, which the
    // conversion ignores).
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        let rb = 34 * nb;
        for i in 0..nb {
            let xp = x.as_ptr().add(32 * i);
            for (r, acc) in acc.iter_mut().enumerate() {
                let b = src.as_ptr().add(r * rb + 34 * i);
                _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PF_ROWS * rb) as *const i8);
                let d = _mm256_broadcastss_ps(scale_pair(b));
                for (k, a) in acc.iter_mut().enumerate() {
                    let q8 = _mm_loadl_epi64(b.add(2 + 8 * k) as *const __m128i);
                    let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
                    let qx = _mm256_mul_ps(q, _mm256_loadu_ps(xp.add(8 * k)));
                    *a = _mm256_fmadd_ps(d, qx, *a);
                }
            }
        }
        for r in 0..R {
            out[r] = lanes_sum(&acc[r]);
        }
    }
}
