//! `Q4_1` and `Q8_0` row dot products on 512-bit registers, for CPUs with
//! AVX-512F (detected at run time), against one input or a group of inputs.
//!
//! Each kernel performs the portable loops' arithmetic
//! ([`crate::blocks::dot_row`]) lane for lane and in the same order, as the
//! AVX2 kernels of `blocks_x86` do, so every logit is bitwise unchanged. The
//! portable `Q4_1` loop keeps 16 lanes (one 512-bit register instead of two
//! 256-bit ones) and the `Q8_0` loop 32 (two instead of four): per input and
//! block the unpacked weights meet the input in half as many instructions.
//! Batched decode (several inputs) goes through tiles of rows x inputs
//! ([`dot_q4_1_tile`], [`dot_q8_0_tile`]): each weight block is unpacked
//! once for the tile's inputs, each input block loaded once for its rows,
//! and the tile's products keep up to 16 accumulators in flight (32
//! registers). The minimums' term of `Q4_1` (`macc += m * s`, one scalar
//! product and sum per input and block in the portable loop) runs for a
//! row's inputs in one vector product and sum, lane `j` being input `j`:
//! for that the inputs' block sums are laid out block by block
//! (`sums[i * stride + j]`). A tile of four accumulators or more sums
//! their lanes all at once ([`crate::lanes_x86_512`]), in the portable
//! order, and hands out a row's results for its inputs in one call.
//!
//! One input against many rows (`QMatrix::matvec`, single-sequence decode)
//! takes four rows side by side ([`matvec`]): one row alone is a single
//! chain of fused multiply-adds, one block after another, and four rows
//! keep four chains in flight, share each block of the input, and prefetch
//! the rows two groups ahead as they go.
//!
//! Batched decode (`QMatrix::matvec_rows`) is bound by these multiply-adds
//! and the unpacking (docs/performance.md, "Depth 0: one sequence against a
//! batch", and "Small batches: tiles of rows x inputs").

use crate::blocks::GgmlType;
use crate::blocks_x86::{PREFETCH, scale_pair};
use crate::lanes_x86_512::{AT_ONCE, lanes};
use std::arch::x86_64::*;

/// How far ahead the row-group kernels prefetch, in rows: block `i` of row
/// `r` asks for block `i` of row `r + PF`, two groups of four ahead. Against
/// [`PREFETCH`] bytes ahead (which from inside a group of four rows reaches
/// only into that group) it measured 20-25% fewer ns per block; four rows
/// ahead measured the same as eight.
pub(crate) const PF: usize = 8;

/// True when the CPU has AVX-512F and `ty` has a kernel here.
#[inline]
pub(crate) fn available(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_1 | GgmlType::Q8_0) && minikv_core::cpu::avx512()
}

/// 16 floats at `p` (unaligned). A load under an all-lanes mask rather
/// than `_mm512_loadu_ps`: that one is a `read_unaligned`, which in a build
/// with debug assertions (the tests' profile) keeps std's checks and goes
/// through the stack as two 256-bit halves and one 512-bit reload, which
/// store forwarding cannot serve.
///
/// # Safety
/// AVX-512F; 64 readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn load(p: *const f32) -> __m512 {
    // SAFETY: as the caller guarantees.
    unsafe { _mm512_maskz_loadu_ps(0xFFFF, p) }
}

/// A `Q4_1` block's 32 codes as floats, in the portable loops' lanes: byte
/// `l` zero-extended to lane `l`, its low nibble weight `l` (first vector),
/// its high nibble weight `l + 16` (second).
///
/// # Safety
/// AVX-512F; the block's 20 bytes readable at `b`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn q4_1_codes(b: *const u8) -> [__m512; 2] {
    // SAFETY: bytes 4..20 of the block, as the caller guarantees.
    let q = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(b.add(4) as *const __m128i)) };
    [
        _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))),
        _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(q)),
    ]
}

/// A `Q8_0` block's 32 codes as floats, 16 a vector.
///
/// # Safety
/// AVX-512F; the block's 34 bytes readable at `b`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn q8_0_codes(b: *const u8) -> [__m512; 2] {
    // SAFETY: bytes 2..34 of the block, as the caller guarantees.
    std::array::from_fn(|k| unsafe {
        let q8 = _mm_loadu_si128(b.add(2 + 16 * k) as *const __m128i);
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8))
    })
}

/// Sum of the lanes in index order (the portable `acc.iter().sum()`).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn lanes_sum(acc: &[__m512]) -> f32 {
    let mut lanes = [0.0f32; 32];
    for (k, a) in acc.iter().enumerate() {
        // SAFETY: at most 2 vectors, 32 lanes.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr().add(16 * k), *a) };
    }
    lanes[..16 * acc.len()].iter().sum::<f32>()
}

/// `R` consecutive `Q4_1` rows (`rb` bytes apart, `nb` blocks of 20 bytes
/// each) dot `N` inputs: `out[r][j]` is bitwise the portable
/// `dot_q4_1(row r, xs[j], sums of xs[j])`. Each weight block is unpacked
/// once for the `N` inputs, and the `R N` products keep as many chains of
/// multiply-adds in flight (a row against one or two inputs alone is only
/// one or two chains, each block waiting for the previous one).
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C must be available; `src` holds `R` rows of
/// `nb` blocks, `rb` bytes apart; each `xs[j]` holds `32 nb` values;
/// `sums + i * stride + j` is input `j`'s sum of block `i` for every
/// `i < nb`, `j < N` (`N <= 16`).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_1_tile<const R: usize, const N: usize>(
    src: &[u8],
    rb: usize,
    nb: usize,
    xs: [*const f32; N],
    sums: *const f32,
    stride: usize,
    out: &mut [[f32; N]; R],
) {
    const { assert!(N >= 1 && N <= 16 && R >= 1 && R * N <= 16) };
    let live: __mmask16 = ((1u32 << N) - 1) as __mmask16;
    // SAFETY: every pointer stays within block `i < nb` of each of the `R`
    // rows, of each input and of the sums, as the caller guarantees (the
    // masked load reads lanes `j < N` only).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        let mut macc = [_mm512_setzero_ps(); R];
        for i in 0..nb {
            let s = _mm512_maskz_loadu_ps(live, sums.add(i * stride));
            // Each row's block unpacked once: byte l zero-extended to lane
            // l, its low nibble weight l (against x[l]), its high nibble
            // weight l + 16 (against x[l + 16]).
            let mut wl = [_mm512_setzero_ps(); R];
            let mut wh = [_mm512_setzero_ps(); R];
            let mut d = [_mm512_setzero_ps(); R];
            for r in 0..R {
                let b = src.as_ptr().add(r * rb + 20 * i);
                _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH) as *const i8);
                let dm = scale_pair(b);
                d[r] = _mm512_broadcastss_ps(dm);
                let m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
                // Lane j of every input: m * s_j, then added (not fused), as
                // the portable `macc += m * s`.
                macc[r] = _mm512_add_ps(macc[r], _mm512_mul_ps(m, s));
                [wl[r], wh[r]] = q4_1_codes(b);
            }
            // Each input's block loaded once for the R rows.
            for j in 0..N {
                let xp = xs[j].add(32 * i);
                let (xl, xh) = (load(xp), load(xp.add(16)));
                for r in 0..R {
                    let inner = _mm512_fmadd_ps(wl[r], xl, _mm512_mul_ps(wh[r], xh));
                    acc[r][j] = _mm512_fmadd_ps(d[r], inner, acc[r][j]);
                }
            }
        }
        let o = if R * N >= AT_ONCE {
            let zero = _mm512_setzero_ps();
            let v = std::array::from_fn(|k| if k < R * N { acc[k / N][k % N] } else { zero });
            lanes(crate::lanes_x86_512::sums(v))
        } else {
            std::array::from_fn(|k| {
                if k < R * N {
                    lanes_sum(&[acc[k / N][k % N]])
                } else {
                    0.0
                }
            })
        };
        for r in 0..R {
            let m = lanes(macc[r]);
            for j in 0..N {
                out[r][j] = o[r * N + j] + m[j];
            }
        }
    }
}

/// `R` consecutive `Q8_0` rows (`rb` bytes apart, `nb` blocks of 34 bytes
/// each) dot `N` inputs: `out[r][j]` is bitwise the portable
/// `dot_q8_0(row r, xs[j])`, as [`dot_q4_1_tile`] does for `Q4_1`.
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C must be available; `src` holds `R` rows of
/// `nb` blocks, `rb` bytes apart; each `xs[j]` holds `32 nb` values.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q8_0_tile<const R: usize, const N: usize>(
    src: &[u8],
    rb: usize,
    nb: usize,
    xs: [*const f32; N],
    out: &mut [[f32; N]; R],
) {
    const { assert!(N >= 1 && R >= 1 && R * N <= 8) };
    // SAFETY: every pointer stays within block `i < nb` of each of the `R`
    // rows and of each input (the fp16 scale is read as a 4-byte word: its
    // 2 bytes and the first two codes, which the conversion ignores).
    unsafe {
        let mut acc = [[[_mm512_setzero_ps(); 2]; N]; R];
        for i in 0..nb {
            // Each row's block converted once, each input's loaded once.
            let mut q = [[_mm512_setzero_ps(); 2]; R];
            let mut d = [_mm512_setzero_ps(); R];
            for r in 0..R {
                let b = src.as_ptr().add(r * rb + 34 * i);
                _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH) as *const i8);
                d[r] = _mm512_broadcastss_ps(scale_pair(b));
                q[r] = q8_0_codes(b);
            }
            for j in 0..N {
                let xp = xs[j].add(32 * i);
                for k in 0..2 {
                    let xk = load(xp.add(16 * k));
                    for r in 0..R {
                        let qx = _mm512_mul_ps(q[r][k], xk);
                        acc[r][j][k] = _mm512_fmadd_ps(d[r], qx, acc[r][j][k]);
                    }
                }
            }
        }
        let o = if R * N >= AT_ONCE {
            let zero = _mm512_setzero_ps();
            let v = std::array::from_fn(|k| match (k % 8 < R * N, k / 8) {
                (true, h) => acc[k % 8 / N][k % 8 % N][h],
                (false, _) => zero,
            });
            lanes(crate::lanes_x86_512::sums32(v))
        } else {
            std::array::from_fn(|k| {
                if k < R * N {
                    lanes_sum(&acc[k / N][k % N])
                } else {
                    0.0
                }
            })
        };
        for r in 0..R {
            out[r].copy_from_slice(&o[r * N..(r + 1) * N]);
        }
    }
}

/// `R` consecutive `Q4_1` rows (`nb` blocks each, the first at `src`) dot
/// one input: `out[r]` is bitwise [`dot_q4_1`] of row `r` (each row's
/// multiply-adds in its own accumulator, in the same order, and its
/// minimums' term `macc += m * s` in its own scalar). A row alone is one
/// chain of fused multiply-adds, one block after another; `R` rows side by
/// side keep `R` chains in flight and share each block of the input.
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C must be available; `src` holds `R` rows of
/// `nb` blocks; `x` holds `32 nb` values and `xsum` `nb` sums.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_1_rows<const R: usize>(
    src: &[u8],
    nb: usize,
    x: &[f32],
    xsum: &[f32],
    out: &mut [f32],
) {
    const { assert!(R >= 1 && R <= 8) };
    debug_assert!(src.len() >= R * nb * 20 && x.len() >= 32 * nb && xsum.len() >= nb);
    // SAFETY: every pointer stays within block `i < nb` of each of the `R`
    // rows, of `x` and of `xsum`, as the caller guarantees.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); R];
        let mut macc = [0.0f32; R];
        let rb = 20 * nb;
        for i in 0..nb {
            let xp = x.as_ptr().add(32 * i);
            let (xl, xh) = (load(xp), load(xp.add(16)));
            let s = *xsum.get_unchecked(i);
            for r in 0..R {
                let b = src.as_ptr().add(r * rb + 20 * i);
                _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PF * rb) as *const i8);
                let dm = scale_pair(b);
                macc[r] += _mm_cvtss_f32(_mm_movehdup_ps(dm)) * s;
                let [wl, wh] = q4_1_codes(b);
                let inner = _mm512_fmadd_ps(wl, xl, _mm512_mul_ps(wh, xh));
                acc[r] = _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), inner, acc[r]);
            }
        }
        for r in 0..R {
            out[r] = lanes_sum(&[acc[r]]) + macc[r];
        }
    }
}

/// `R` consecutive `Q8_0` rows (`nb` blocks each, the first at `src`) dot
/// one input: `out[r]` is bitwise [`dot_q8_0`] of row `r`, as
/// [`dot_q4_1_rows`] does for `Q4_1`.
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C must be available; `src` holds `R` rows of
/// `nb` blocks; `x` holds `32 nb` values.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q8_0_rows<const R: usize>(
    src: &[u8],
    nb: usize,
    x: &[f32],
    out: &mut [f32],
) {
    const { assert!(R >= 1 && R <= 8) };
    debug_assert!(src.len() >= R * nb * 34 && x.len() >= 32 * nb);
    // SAFETY: every pointer stays within block `i < nb` of each of the `R`
    // rows and of `x`, as the caller guarantees (the fp16 scale is read as a
    // 4-byte word: its 2 bytes and the first two codes, which the
    // conversion ignores).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        let rb = 34 * nb;
        for i in 0..nb {
            let xp = x.as_ptr().add(32 * i);
            let xv = [load(xp), load(xp.add(16))];
            for (r, acc) in acc.iter_mut().enumerate() {
                let b = src.as_ptr().add(r * rb + 34 * i);
                _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PF * rb) as *const i8);
                let d = _mm512_broadcastss_ps(scale_pair(b));
                let q = q8_0_codes(b);
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(d, _mm512_mul_ps(q[k], xv[k]), *a);
                }
            }
        }
        for r in 0..R {
            out[r] = lanes_sum(&acc[r]);
        }
    }
}

/// `out[r] = row r . x` for the consecutive rows of `w` (`out.len()` rows of
/// type `ty`, `x.len() / 32` blocks each), four rows at a time
/// ([`dot_q4_1_rows`], [`dot_q8_0_rows`]), each result bitwise
/// [`crate::blocks::dot_row`] of its row alone.
///
/// # Safety
/// [`available`] must have returned true for `ty` (`Q4_1` or `Q8_0`); `w`
/// holds `out.len()` rows; for `Q4_1` `xsum` holds the `x.len() / 32`
/// block sums of `x`.
pub(crate) unsafe fn matvec(ty: GgmlType, w: &[u8], x: &[f32], xsum: &[f32], out: &mut [f32]) {
    let nb = x.len() / 32;
    let rb = ty.row_bytes(32 * nb);
    assert!(w.len() >= out.len() * rb && (ty != GgmlType::Q4_1 || xsum.len() >= nb));
    // SAFETY: AVX-512F and the rest (the caller checked `available`); `w`
    // holds the `left` remaining rows (asserted above).
    crate::blocks_x86::in_groups(rb, w, out, |w, o, left| unsafe {
        match (ty, left) {
            (GgmlType::Q4_1, 4..) => {
                dot_q4_1_rows::<4>(w, nb, x, xsum, o);
                4
            }
            (GgmlType::Q4_1, _) => {
                dot_q4_1_rows::<1>(w, nb, x, xsum, o);
                1
            }
            (_, 4..) => {
                dot_q8_0_rows::<4>(w, nb, x, o);
                4
            }
            _ => {
                dot_q8_0_rows::<1>(w, nb, x, o);
                1
            }
        }
    });
}

/// `Q4_1` row dot one input ([`dot_q4_1_tile`] with `R = N = 1`).
///
/// # Safety
/// As [`dot_q4_1_tile`]: AVX-512F, AVX2, FMA, F16C; `src` holds `x.len() / 32`
/// blocks and `xsum` as many sums.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_1(src: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
    let mut o = [[0.0]];
    let (xs, nb) = ([x.as_ptr()], x.len() / 32);
    // SAFETY: as the caller guarantees; the sums of one input have stride 1.
    unsafe { dot_q4_1_tile::<1, 1>(src, 0, nb, xs, xsum.as_ptr(), 1, &mut o) };
    o[0][0]
}

/// `Q8_0` row dot one input ([`dot_q8_0_tile`] with `R = N = 1`).
///
/// # Safety
/// As [`dot_q8_0_tile`]: AVX-512F, AVX2, FMA, F16C; `src` holds `x.len() / 32` blocks.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q8_0(src: &[u8], x: &[f32]) -> f32 {
    let mut o = [[0.0]];
    // SAFETY: as the caller guarantees.
    unsafe { dot_q8_0_tile::<1, 1>(src, 0, x.len() / 32, [x.as_ptr()], &mut o) };
    o[0][0]
}

/// The inputs of a grouped row dot: rows `sel` of `x` (`[.][32 nb]`), and
/// for `Q4_1` their block sums laid out block by block
/// (`sums[i * sel.len() + j]`: block `i` of input `j`).
pub(crate) struct Inputs<'a> {
    /// The inputs' matrix.
    pub x: &'a [f32],
    /// Its rows taken, in order.
    pub sel: &'a [usize],
    /// Block sums, block-major (empty for `Q8_0`).
    pub sums: &'a [f32],
    /// Blocks per input.
    pub nb: usize,
}

impl Inputs<'_> {
    /// Start of input `j`.
    fn x(&self, j: usize) -> *const f32 {
        self.x[self.sel[j] * 32 * self.nb..].as_ptr()
    }
}

/// Weight rows per tile for a batch of `n` inputs of type `ty`. A tile
/// unpacks each weight block once for its inputs and loads each input
/// block once for its rows, and keeps `rows x inputs` chains of
/// multiply-adds in flight (a row against one or two inputs alone keeps one
/// or two). Chosen on `benches/matvec.rs` (docs/performance.md): four rows
/// for 2-4 `Q4_1` inputs and two for more (the accumulators of 8 inputs
/// per row fill the registers at two rows); two for 2-3 `Q8_0` inputs and
/// one for more (two accumulators per input: four inputs already keep
/// eight in flight, and two rows measured no faster).
fn tile_rows(ty: GgmlType, n: usize) -> usize {
    match (ty, n) {
        (GgmlType::Q4_1, 2..=4) => 4,
        (GgmlType::Q4_1, 5..) | (_, 2 | 3) => 2,
        _ => 1,
    }
}

/// The `rows` consecutive rows of `w` (`nb` blocks each) dot every input:
/// `out(r, j, values)` receives row `r`'s results for inputs `j ..`, bitwise
/// equal to [`crate::blocks::dot_row`] of that row and input alone. Rows go
/// in tiles of [`tile_rows`] (the rows left over in smaller ones), inputs
/// in groups of up to 16 register accumulators (`Q4_1`: one per row and
/// input; `Q8_0`: two).
///
/// # Safety
/// [`available`] must have returned true for `ty` (`Q4_1` or `Q8_0`); `w`
/// holds `rows` rows of `nb` blocks; each selected row of `x` is whole; for
/// `Q4_1` `sums.len() >= nb * sel.len()`.
pub(crate) unsafe fn dots(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    inp: &Inputs<'_>,
    mut out: impl FnMut(usize, usize, &[f32]),
) {
    let (rb, n) = (ty.row_bytes(32 * inp.nb), inp.sel.len());
    let g = tile_rows(ty, n);
    let mut r = 0;
    while r < rows {
        let (w, o) = (&w[r * rb..], &mut |dr: usize, j: usize, v: &[f32]| {
            out(r + dr, j, v)
        });
        let t = match rows - r {
            left if left >= 4 && g >= 4 => 4,
            left if left >= 2 && g >= 2 => 2,
            _ => 1,
        };
        let mut j = 0;
        while j < n {
            // SAFETY: as the caller guarantees, for rows r .. r + t and
            // inputs j .. j + (what the tile returns).
            j += unsafe { tile(ty, t, w, rb, inp, j, o) };
        }
        r += t;
    }
}

/// Rows `0 .. t` of `w` (`rb` bytes apart; `t` is 1, 2 or 4) against the
/// next group of inputs from `j`; returns the group's size.
///
/// # Safety
/// As [`dots`], for those rows.
unsafe fn tile(
    ty: GgmlType,
    t: usize,
    w: &[u8],
    rb: usize,
    inp: &Inputs<'_>,
    j: usize,
    out: &mut impl FnMut(usize, usize, &[f32]),
) -> usize {
    use GgmlType::Q4_1;
    // SAFETY: as the caller guarantees.
    unsafe {
        match (ty, t, inp.sel.len() - j) {
            (Q4_1, 4, 4..) => q4::<4, 4>(w, rb, inp, j, out),
            (Q4_1, 4, 3) => q4::<4, 3>(w, rb, inp, j, out),
            (Q4_1, 4, 2) => q4::<4, 2>(w, rb, inp, j, out),
            (Q4_1, 4, _) => q4::<4, 1>(w, rb, inp, j, out),
            (Q4_1, 2, 8..) => q4::<2, 8>(w, rb, inp, j, out),
            (Q4_1, 2, 7) => q4::<2, 7>(w, rb, inp, j, out),
            (Q4_1, 2, 6) => q4::<2, 6>(w, rb, inp, j, out),
            (Q4_1, 2, 5) => q4::<2, 5>(w, rb, inp, j, out),
            (Q4_1, 2, 4) => q4::<2, 4>(w, rb, inp, j, out),
            (Q4_1, 2, 3) => q4::<2, 3>(w, rb, inp, j, out),
            (Q4_1, 2, 2) => q4::<2, 2>(w, rb, inp, j, out),
            (Q4_1, 2, _) => q4::<2, 1>(w, rb, inp, j, out),
            (Q4_1, _, 16..) => q4::<1, 16>(w, rb, inp, j, out),
            (Q4_1, _, 8..) => q4::<1, 8>(w, rb, inp, j, out),
            (Q4_1, _, 4..) => q4::<1, 4>(w, rb, inp, j, out),
            (Q4_1, _, 2..) => q4::<1, 2>(w, rb, inp, j, out),
            (Q4_1, _, _) => q4::<1, 1>(w, rb, inp, j, out),
            (_, 4, 2..) => q8::<4, 2>(w, rb, inp, j, out),
            (_, 4, _) => q8::<4, 1>(w, rb, inp, j, out),
            (_, 2, 4..) => q8::<2, 4>(w, rb, inp, j, out),
            (_, 2, 3) => q8::<2, 3>(w, rb, inp, j, out),
            (_, 2, 2) => q8::<2, 2>(w, rb, inp, j, out),
            (_, 2, _) => q8::<2, 1>(w, rb, inp, j, out),
            (_, _, 8..) => q8::<1, 8>(w, rb, inp, j, out),
            (_, _, 4..) => q8::<1, 4>(w, rb, inp, j, out),
            (_, _, 2..) => q8::<1, 2>(w, rb, inp, j, out),
            _ => q8::<1, 1>(w, rb, inp, j, out),
        }
    }
}

/// `Q4_1` rows `0 .. R` of `w` (`rb` bytes apart) dot inputs `j .. j + N`
/// ([`dot_q4_1_tile`]); returns `N`.
///
/// # Safety
/// As [`dots`], for those rows and inputs.
unsafe fn q4<const R: usize, const N: usize>(
    w: &[u8],
    rb: usize,
    inp: &Inputs<'_>,
    j: usize,
    out: &mut impl FnMut(usize, usize, &[f32]),
) -> usize {
    let (sums, n) = (inp.sums[j..].as_ptr(), inp.sel.len());
    // SAFETY: as the caller guarantees; lanes j .. j + N of each block's sums.
    run(inp, j, out, |xs, o| unsafe {
        dot_q4_1_tile::<R, N>(w, rb, inp.nb, xs, sums, n, o)
    })
}

/// `Q8_0` rows `0 .. R` of `w` (`rb` bytes apart) dot inputs `j .. j + N`
/// ([`dot_q8_0_tile`]); returns `N`.
///
/// # Safety
/// As [`dots`], for those rows and inputs.
unsafe fn q8<const R: usize, const N: usize>(
    w: &[u8],
    rb: usize,
    inp: &Inputs<'_>,
    j: usize,
    out: &mut impl FnMut(usize, usize, &[f32]),
) -> usize {
    // SAFETY: as the caller guarantees.
    run(inp, j, out, |xs, o| unsafe {
        dot_q8_0_tile::<R, N>(w, rb, inp.nb, xs, o)
    })
}

/// Runs a tile (`tile(inputs j .. j + N, results)`) and hands out its
/// results (row `r`, inputs from `j`); returns `N`.
fn run<const R: usize, const N: usize>(
    inp: &Inputs<'_>,
    j: usize,
    out: &mut impl FnMut(usize, usize, &[f32]),
    tile: impl FnOnce([*const f32; N], &mut [[f32; N]; R]),
) -> usize {
    let mut o = [[0.0; N]; R];
    tile(std::array::from_fn(|k| inp.x(j + k)), &mut o);
    for (r, o) in o.iter().enumerate() {
        out(r, j, o);
    }
    N
}
