//! `Q5_0`, `Q4_K` and `Q6_K` row dots on 256-bit registers (AVX2, FMA,
//! F16C): the kernels a CPU without AVX-512 runs for Gemma 3's weights
//! (`MINIKV_MAX_ISA=avx2` runs them on one with it).
//!
//! Each kernel performs its portable loop's arithmetic
//! ([`crate::blocks::dot_row`]) lane for lane in the same order: the
//! portable loops keep 16 (`Q5_0`, `Q6_K`) or 32 (`Q4_K`) lane sums, here
//! two or four vectors of eight, summed first to last at the end. So every
//! logit is bitwise what the portable loops and the 512-bit kernels give.
//! A tile is `R` rows x `N` inputs: one input against four rows (two for
//! `Q4_K`, whose 32 lanes take four registers) gives a decode step
//! independent multiply-add chains to overlap, one row against up to four
//! inputs unpacks each block's codes once for all of them (batched decode:
//! one input per sequence).
//!
//! Codes are widened to 32-bit lanes (`vpmovzxbd`) and converted to f32;
//! `Q5_0`'s fifth bits are tested against one bit per lane of its 32-bit
//! `qh`, a clear bit subtracting 16 (`code - 16` is the nibble less 16 when
//! the fifth bit is clear, the nibble when set).

use crate::blocks::{GgmlType, q4k_pair};
use crate::blocks_x86::{PREFETCH, lanes_sum, scale_pair};
use std::arch::x86_64::*;

/// The widest tile (inputs per unpacked block); `Q4_K`, with four
/// accumulators per input, takes at most [`TILE_Q4_K`].
const TILE: usize = 4;
/// `Q4_K`'s widest tile.
const TILE_Q4_K: usize = 2;

/// True when `ty` has a kernel here.
#[inline]
pub(crate) fn handles(ty: GgmlType) -> bool {
    crate::kquant_q8::takes(ty)
}

/// Eight bytes at `p` widened to 32-bit lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen8(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 8 readable bytes at `p`.
    unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)) }
}

/// Eight 32-bit integer lanes as floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float(v: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(v)
}

/// `R` `Q5_0` rows (`nb` blocks each) dot `N` inputs: `out[r N + j]` is
/// bitwise `dot_q5_0_portable(rows[r], xs[j])`.
///
/// # Safety
/// AVX2, FMA and F16C available; each `rows[r]` points at `nb` blocks of
/// 22 bytes, each `xs[j]` at `32 nb` values; `out` holds `R N` values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_tile<const R: usize, const N: usize>(
    rows: [*const u8; R],
    nb: usize,
    xs: [*const f32; N],
    out: &mut [f32],
) {
    assert!(out.len() >= R * N);
    // SAFETY: block `i < nb` of each row and of each input (as the caller
    // guarantees).
    unsafe {
        let one = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        // Lane masks for fifth bits 0-7, 8-15, 16-23, 24-31 of `qh`.
        let bits = [
            one,
            _mm256_slli_epi32::<8>(one),
            _mm256_slli_epi32::<16>(one),
            _mm256_slli_epi32::<24>(one),
        ];
        let (nib, sixteen) = (_mm256_set1_epi32(15), _mm256_set1_epi32(16));
        let mut acc = [[[_mm256_setzero_ps(); 2]; N]; R];
        for i in 0..nb {
            for (row, acc) in rows.iter().zip(acc.iter_mut()) {
                let b = row.add(22 * i);
                _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH) as *const i8);
                let d = _mm256_broadcastss_ps(scale_pair(b));
                let qh = _mm256_set1_epi32((b.add(2) as *const i32).read_unaligned());
                // `code - 16`: the nibble, less 16 where the fifth bit is clear.
                let code = |q: __m256i, m: __m256i| {
                    let set = _mm256_cmpeq_epi32(_mm256_and_si256(qh, m), m);
                    float(_mm256_sub_epi32(q, _mm256_andnot_si256(set, sixteen)))
                };
                for g in 0..2 {
                    let q = widen8(b.add(6 + 8 * g));
                    // Lanes 8g..8g+8: weights j (low nibble, fifth bit j) and
                    // j + 16 (high nibble, fifth bit j + 16).
                    let lo = code(_mm256_and_si256(q, nib), bits[g]);
                    let hi = code(_mm256_srli_epi32::<4>(q), bits[2 + g]);
                    for (a, x) in acc.iter_mut().zip(xs) {
                        let xp = x.add(32 * i + 8 * g);
                        let inner = _mm256_fmadd_ps(
                            lo,
                            _mm256_loadu_ps(xp),
                            _mm256_mul_ps(hi, _mm256_loadu_ps(xp.add(16))),
                        );
                        a[g] = _mm256_fmadd_ps(d, inner, a[g]);
                    }
                }
            }
        }
        for (o, a) in out.iter_mut().zip(acc.iter().flatten()) {
            *o = lanes_sum(a);
        }
    }
}

/// `R` `Q4_K` rows (`nb` super-blocks each) dot `N` inputs: `out[r N + j]`
/// is bitwise `dot_q4_k_portable(rows[r], xs[j], sums[j])`.
///
/// # Safety
/// AVX2, FMA and F16C available; each `rows[r]` points at `nb` blocks of
/// 144 bytes, each `xs[j]` at `256 nb` values and `sums[j]` at `8 nb`;
/// `out` holds `R N` values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_tile<const R: usize, const N: usize>(
    rows: [*const u8; R],
    nb: usize,
    xs: [*const f32; N],
    sums: [*const f32; N],
    out: &mut [f32],
) {
    assert!(out.len() >= R * N);
    // SAFETY: block `i < nb` of each row, of each input and of its sums (as
    // the caller guarantees).
    unsafe {
        let nib = _mm256_set1_epi32(15);
        let mut acc = [[[_mm256_setzero_ps(); 4]; N]; R];
        let mut macc = [[0.0f32; N]; R];
        for i in 0..nb {
            for ((row, acc), macc) in rows.iter().zip(acc.iter_mut()).zip(macc.iter_mut()) {
                let b = row.add(144 * i);
                let blk = std::slice::from_raw_parts(b, 144);
                _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH + 64) as *const i8);
                let dmin = _mm_cvtss_f32(_mm_movehdup_ps(scale_pair(b)));
                for c in 0..4 {
                    let ([d1, d2], [m1, m2]) = q4k_pair(blk, c);
                    for (m, s) in macc.iter_mut().zip(sums) {
                        let s = s.add(8 * i + 2 * c);
                        *m += dmin * (m1 * *s + m2 * *s.add(1));
                    }
                    let (d1, d2) = (_mm256_set1_ps(d1), _mm256_set1_ps(d2));
                    for k in 0..4 {
                        let q = widen8(b.add(16 + 32 * c + 8 * k));
                        let lo = float(_mm256_and_si256(q, nib));
                        let hi = float(_mm256_srli_epi32::<4>(q));
                        for (a, x) in acc.iter_mut().zip(xs) {
                            let xp = x.add(256 * i + 64 * c + 8 * k);
                            let h = _mm256_mul_ps(hi, _mm256_loadu_ps(xp.add(32)));
                            let t = _mm256_fmadd_ps(d2, h, a[k]);
                            a[k] = _mm256_fmadd_ps(d1, _mm256_mul_ps(lo, _mm256_loadu_ps(xp)), t);
                        }
                    }
                }
            }
        }
        let all = acc.iter().flatten().zip(macc.iter().flatten());
        for (o, (a, m)) in out.iter_mut().zip(all) {
            *o = lanes_sum(a) - m;
        }
    }
}

/// `R` `Q6_K` rows (`nb` super-blocks each) dot `N` inputs: `out[r N + j]`
/// is bitwise `dot_q6_k_portable(rows[r], xs[j])`.
///
/// # Safety
/// AVX2, FMA and F16C available; each `rows[r]` points at `nb` blocks of
/// 210 bytes, each `xs[j]` at `256 nb` values; `out` holds `R N` values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_tile<const R: usize, const N: usize>(
    rows: [*const u8; R],
    nb: usize,
    xs: [*const f32; N],
    out: &mut [f32],
) {
    assert!(out.len() >= R * N);
    // SAFETY: block `i < nb` of each row and of each input (as the caller
    // guarantees).
    unsafe {
        let (nib, three, bias) = (
            _mm256_set1_epi32(15),
            _mm256_set1_epi32(3),
            _mm256_set1_epi32(32),
        );
        let mut acc = [[[_mm256_setzero_ps(); 2]; N]; R];
        for i in 0..nb {
            for (row, acc) in rows.iter().zip(acc.iter_mut()) {
                let b = row.add(210 * i);
                for p in [0, 64, 128, 192] {
                    _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH + p) as *const i8);
                }
                let d = crate::blocks::h(std::slice::from_raw_parts(b, 210), 208);
                for n in 0..2 {
                    let (ql, qh, sc) = (b.add(64 * n), b.add(128 + 32 * n), b.add(192 + 8 * n));
                    for half in 0..2 {
                        let ds: [__m256; 4] = std::array::from_fn(|k| {
                            _mm256_set1_ps(d * (*sc.add(half + 2 * k) as i8) as f32)
                        });
                        for g in 0..2 {
                            let l = 16 * half + 8 * g;
                            let (a, c, h) =
                                (widen8(ql.add(l)), widen8(ql.add(l + 32)), widen8(qh.add(l)));
                            let hb =
                                |s: __m256i| _mm256_slli_epi32::<4>(_mm256_and_si256(s, three));
                            let q = [
                                _mm256_or_si256(_mm256_and_si256(a, nib), hb(h)),
                                _mm256_or_si256(
                                    _mm256_and_si256(c, nib),
                                    hb(_mm256_srli_epi32::<2>(h)),
                                ),
                                _mm256_or_si256(
                                    _mm256_srli_epi32::<4>(a),
                                    hb(_mm256_srli_epi32::<4>(h)),
                                ),
                                _mm256_or_si256(
                                    _mm256_srli_epi32::<4>(c),
                                    hb(_mm256_srli_epi32::<6>(h)),
                                ),
                            ];
                            // Each code's weight `ds[k] * (code - 32)`, rounded as
                            // the portable loop rounds it.
                            let w: [__m256; 4] = std::array::from_fn(|k| {
                                _mm256_mul_ps(ds[k], float(_mm256_sub_epi32(q[k], bias)))
                            });
                            for (acc, x) in acc.iter_mut().zip(xs) {
                                let xp = x.add(256 * i + 128 * n + l);
                                for (k, w) in w.iter().enumerate() {
                                    let xv = _mm256_loadu_ps(xp.add(32 * k));
                                    acc[g] = _mm256_fmadd_ps(*w, xv, acc[g]);
                                }
                            }
                        }
                    }
                }
            }
        }
        for (o, a) in out.iter_mut().zip(acc.iter().flatten()) {
            *o = lanes_sum(a);
        }
    }
}

/// A tile of `R` rows x `N` inputs of `ty` (`out[r N + j]`).
///
/// # Safety
/// As the tile functions: `ty` is one of the three, the rows hold `nb`
/// blocks, the inputs (and for `Q4_K` their sums) `nb` blocks' worth.
#[inline]
unsafe fn tile<const R: usize, const N: usize>(
    ty: GgmlType,
    rows: [*const u8; R],
    nb: usize,
    xs: [*const f32; N],
    sums: &[*const f32],
    out: &mut [f32],
) {
    // SAFETY: as the caller guarantees.
    unsafe {
        match ty {
            GgmlType::Q5_0 => q5_0_tile::<R, N>(rows, nb, xs, out),
            GgmlType::Q4_K => {
                let s = sums.try_into().expect("a sum pointer per input");
                q4_k_tile::<R, N>(rows, nb, xs, s, out)
            }
            _ => q6_k_tile::<R, N>(rows, nb, xs, out),
        }
    }
}

/// One row of `ty` (`nb` blocks) dot each input of `xs` (with `sums`, the
/// inputs' 32-block sums, for `Q4_K`; empty otherwise): `out[j]` bitwise
/// the portable loop's dot, in tiles of up to [`TILE`] inputs.
///
/// # Safety
/// AVX2, FMA and F16C available; [`handles`] `ty`; `row` holds `nb` blocks;
/// each `xs[j]` points at `nb` blocks' values and (for `Q4_K`) `sums[j]`
/// at `8 nb` sums.
pub(crate) unsafe fn row_dots(
    ty: GgmlType,
    row: &[u8],
    nb: usize,
    xs: &[*const f32],
    sums: &[*const f32],
    out: &mut [f32],
) {
    assert!(out.len() == xs.len() && (ty != GgmlType::Q4_K || sums.len() == xs.len()));
    assert!(row.len() >= nb * ty.block_bytes());
    let widest = if ty == GgmlType::Q4_K {
        TILE_Q4_K
    } else {
        TILE
    };
    let sum = |j: usize, n: usize| match ty {
        GgmlType::Q4_K => &sums[j..j + n],
        _ => &[],
    };
    let r = [row.as_ptr()];
    let mut j = 0;
    while j < xs.len() {
        let left = xs.len() - j;
        let o = &mut out[j..];
        // SAFETY: as the caller guarantees, for inputs `j ..`.
        unsafe {
            j += match () {
                _ if left >= 4 && widest >= 4 => {
                    let x = xs[j..j + 4].try_into().expect("4 inputs");
                    tile::<1, 4>(ty, r, nb, x, sum(j, 4), o);
                    4
                }
                _ if left >= 2 => {
                    let x = xs[j..j + 2].try_into().expect("2 inputs");
                    tile::<1, 2>(ty, r, nb, x, sum(j, 2), o);
                    2
                }
                _ => {
                    tile::<1, 1>(ty, r, nb, [xs[j]], sum(j, 1), o);
                    1
                }
            };
        }
    }
}

/// `out[r] = row r . x` for the consecutive rows of `w` (one per output),
/// in groups of four rows (two for `Q4_K`), each bitwise its portable dot
/// (`xsum`: the input's 32-block sums, for `Q4_K`).
///
/// # Safety
/// AVX2, FMA and F16C available; [`handles`] `ty`; `w` holds `out.len()`
/// rows of `x.len()` weights, a whole number of blocks; for `Q4_K`, `xsum`
/// holds `x.len() / 32` sums.
pub(crate) unsafe fn matvec(ty: GgmlType, w: &[u8], x: &[f32], xsum: &[f32], out: &mut [f32]) {
    let nb = x.len() / ty.block_size();
    let rb = nb * ty.block_bytes();
    assert!(w.len() >= rb * out.len() && (ty != GgmlType::Q4_K || xsum.len() >= 8 * nb));
    let (xs, s) = ([x.as_ptr()], [xsum.as_ptr()]);
    let sums: &[*const f32] = if ty == GgmlType::Q4_K { &s } else { &[] };
    let group = if ty == GgmlType::Q4_K { 2 } else { 4 };
    let row = |r: usize| w[rb * r..].as_ptr();
    let mut r = 0;
    // SAFETY: rows `r ..` lie in `w` (asserted); the input and sums are
    // whole, as the caller guarantees.
    unsafe {
        while r < out.len() {
            let left = out.len() - r;
            let o = &mut out[r..];
            r += match left {
                _ if left >= 4 && group == 4 => {
                    tile::<4, 1>(
                        ty,
                        [row(r), row(r + 1), row(r + 2), row(r + 3)],
                        nb,
                        xs,
                        sums,
                        o,
                    );
                    4
                }
                _ if left >= 2 => {
                    tile::<2, 1>(ty, [row(r), row(r + 1)], nb, xs, sums, o);
                    2
                }
                _ => {
                    tile::<1, 1>(ty, [row(r)], nb, xs, sums, o);
                    1
                }
            };
        }
    }
}

/// [`crate::blocks::dot_row`] for a `Q5_0`, `Q4_K` or `Q6_K` row; `None`
/// for other types or a row or sums too short (the portable loops handle
/// those as they do).
#[inline]
pub(crate) fn dot_row(ty: GgmlType, src: &[u8], x: &[f32], xsum: &[f32]) -> Option<f32> {
    let nb = x.len() / ty.block_size();
    let whole = handles(ty)
        && nb > 0
        && src.len() >= nb * ty.block_bytes()
        && (ty != GgmlType::Q4_K || xsum.len() >= 8 * nb);
    if !whole {
        return None;
    }
    let mut o = [0.0f32];
    let sums: &[*const f32] = match ty {
        GgmlType::Q4_K => &[xsum.as_ptr()],
        _ => &[],
    };
    // SAFETY: AVX2/FMA/F16C enabled (this module's cfg); the row, input and
    // sums are whole (checked above).
    unsafe { row_dots(ty, src, nb, &[x.as_ptr()], sums, &mut o) };
    Some(o[0])
}

#[cfg(test)]
mod tests {
    use crate::blocks::tests::random_k_rows;
    use crate::blocks::{
        GgmlType, block_sums, dot_q4_k_portable, dot_q5_0_portable, dot_q6_k_portable,
    };
    /// The 256-bit `Q5_0`, `Q4_K` and `Q6_K` kernels (CPUs without AVX-512)
    /// give each dot bitwise the portable loop's: one row against 1-9
    /// inputs (tiles of 4, 2 and 1), one input against 1-9 rows (groups of
    /// 4 or 2, then 1), rows of one block to Gemma 3's widths, and one input
    /// through their `dot_row`.
    #[test]
    fn x86_k_quant_dots_are_bitwise_equal_to_the_portable_loops() {
        use super as k;
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(16);
        for (ty, widths) in [
            (GgmlType::Q5_0, &[32usize, 64, 160, 640][..]),
            (GgmlType::Q4_K, &[256, 512, 1024, 2048][..]),
            (GgmlType::Q6_K, &[256, 512, 1024, 2048][..]),
        ] {
            for &cols in widths {
                let nb = cols / ty.block_size();
                let row = random_k_rows(&mut rng, ty, 1, nb);
                for n in 1..=9usize {
                    let x: Vec<Vec<f32>> = (0..n)
                        .map(|_| {
                            let mut r = |_| {
                                rng.random_range(-3.0f32..3.0) * 2f32.powi(rng.random_range(-8..8))
                            };
                            (0..cols).map(&mut r).collect()
                        })
                        .collect();
                    let sums: Vec<Vec<f32>> = x
                        .iter()
                        .map(|x| {
                            let mut s = Vec::new();
                            block_sums(x, &mut s);
                            s
                        })
                        .collect();
                    let want: Vec<u32> = (0..n)
                        .map(|j| match ty {
                            GgmlType::Q5_0 => dot_q5_0_portable(&row, &x[j]),
                            GgmlType::Q4_K => dot_q4_k_portable(&row, &x[j], &sums[j]),
                            _ => dot_q6_k_portable(&row, &x[j]),
                        })
                        .map(f32::to_bits)
                        .collect();
                    let xp: Vec<*const f32> = x.iter().map(|v| v.as_ptr()).collect();
                    let sp: Vec<*const f32> = match ty {
                        GgmlType::Q4_K => sums.iter().map(|v| v.as_ptr()).collect(),
                        _ => Vec::new(),
                    };
                    let mut got = vec![f32::NAN; n];
                    // SAFETY: AVX2/FMA/F16C enabled (cfg); the row holds `nb`
                    // blocks, each input `cols` values and its block sums.
                    unsafe { k::row_dots(ty, &row, nb, &xp, &sp, &mut got) };
                    let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "{ty:?} cols={cols} inputs={n}");
                    let one = k::dot_row(ty, &row, &x[0], &sums[0]).expect("a whole row");
                    assert_eq!(one.to_bits(), want[0], "{ty:?} cols={cols} dot_row");
                }
                // One input against 1-9 rows: groups of four (two for
                // `Q4_K`) and the rows left over.
                let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-3.0f32..3.0)).collect();
                let mut xs = Vec::new();
                block_sums(&x, &mut xs);
                let rb = ty.row_bytes(cols);
                let w = random_k_rows(&mut rng, ty, 9, nb);
                let want: Vec<u32> = w
                    .chunks_exact(rb)
                    .map(|r| match ty {
                        GgmlType::Q5_0 => dot_q5_0_portable(r, &x),
                        GgmlType::Q4_K => dot_q4_k_portable(r, &x, &xs),
                        _ => dot_q6_k_portable(r, &x),
                    })
                    .map(f32::to_bits)
                    .collect();
                for rows in 1..=9 {
                    let mut got = vec![f32::NAN; rows];
                    // SAFETY: AVX2/FMA/F16C enabled (cfg); `w` holds 9 rows
                    // of `cols` weights, `xs` the input's block sums.
                    unsafe { k::matvec(ty, &w, &x, &xs, &mut got) };
                    let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want[..rows], "{ty:?} cols={cols} rows={rows}");
                }
            }
        }
    }
}
