//! `Q5_0`, `Q4_K` and `Q6_K` row dot products on 512-bit registers, for
//! CPUs with AVX-512F (detected at run time): the weight types of llama.cpp's
//! `Q4_K_M` files (Gemma 3 270M's projections of 640 columns are `Q5_0`,
//! since 640 is no multiple of a k-quant's 256, the others `Q4_K` and `Q6_K`).
//!
//! As in `blocks_x86_512`, each kernel performs its portable loop's
//! arithmetic ([`crate::blocks::dot_q5_0_portable`],
//! [`crate::blocks::dot_q4_k_portable`], [`crate::blocks::dot_q6_k_portable`])
//! lane for lane and in the same order, so every logit keeps its bits: a
//! vector is the portable loop's 16 accumulators (`Q5_0`, `Q6_K`) or half of
//! its 32 (`Q4_K`), the codes are widened to 32-bit lanes, unpacked with
//! integer operations and converted (exact), and each product and fused
//! multiply-add is the portable one. `Q4_K`'s 6-bit scales and minimums
//! (through [`crate::blocks::q4k_pair`]) and its minimums' term stay scalar
//! and identical; `Q6_K`'s 16 scale products `d * sc` are formed in one
//! vector product ([`q6_k_scales`]), each the portable one. Where the
//! portable loop was one weight at a time (the compiler did not vectorize
//! the unpacking), these take 16 weights per instruction.
//!
//! [`matvec`] (one input: single-sequence decode) takes four rows side by
//! side (four chains of fused multiply-adds in flight, each block of the
//! input loaded once for them, the rows prefetched two groups ahead), then
//! the rows left one at a time. [`row_dots`] (several inputs: batched
//! decode) takes one row against tiles of up to eight inputs, each block
//! unpacked once per tile.

use crate::blocks::{GgmlType, h, q4k_pair};
use crate::blocks_x86::scale_pair;
use crate::blocks_x86_512::{PF, lanes_sum, load};
use std::arch::x86_64::*;

/// True when the CPU has AVX-512F and `ty` has a kernel here.
#[inline]
pub(crate) fn available(ty: GgmlType) -> bool {
    crate::kquant_q8::takes(ty) && minikv_core::cpu::avx512()
}

/// Prefetches, for the block of `bytes` bytes at `b`, the cache lines that
/// begin inside the same block of the row `PF` rows ahead (`rb` bytes a
/// row): each line of the rows ahead once, as the blocks reach it (a
/// prefetch per block and row would ask for a `Q5_0` line three times).
/// The address may be past the weights: a prefetch never faults.
#[inline(always)]
fn prefetch(b: *const u8, rb: usize, bytes: usize) {
    let a = b.wrapping_add(PF * rb) as usize;
    let mut line = (a + 63) & !63;
    while line < a + bytes {
        // SAFETY: a prefetch reads nothing the program sees.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
        line += 64;
    }
}

/// A `Q5_0` block's 32 codes minus 16 as floats, in the portable loop's
/// lanes: byte `j` widened to lane `j`, its low nibble with fifth bit `j`
/// of `qh` (weight `j`, first vector), its high nibble with bit `j + 16`
/// (weight `j + 16`, second).
///
/// # Safety
/// AVX-512F; the block's 22 bytes readable at `b`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn q5_0_codes(b: *const u8) -> [__m512; 2] {
    // SAFETY: bytes 2..22 of the block, as the caller guarantees.
    unsafe {
        let qh = (b.add(2) as *const u32).read_unaligned();
        let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(b.add(6) as *const __m128i));
        let sixteen = _mm512_set1_epi32(16);
        let lo = _mm512_and_si512(q, _mm512_set1_epi32(15));
        let hi = _mm512_srli_epi32::<4>(q);
        let lo = _mm512_mask_or_epi32(lo, qh as __mmask16, lo, sixteen);
        let hi = _mm512_mask_or_epi32(hi, (qh >> 16) as __mmask16, hi, sixteen);
        [lo, hi].map(|v| _mm512_cvtepi32_ps(_mm512_sub_epi32(v, sixteen)))
    }
}

/// 16 bytes at `p` zero-extended to 32-bit lanes.
///
/// # Safety
/// AVX-512F; 16 readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn widen(p: *const u8) -> __m512i {
    // SAFETY: as the caller guarantees.
    unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i)) }
}

/// `Q4_K` codes `32c + 16k .. + 16` of a block's code bytes `q` (sub-block
/// pair `c`): the low nibbles (sub-block `2c`) and the high ones (`2c + 1`)
/// as floats.
///
/// # Safety
/// AVX-512F; 16 readable bytes at `q`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn q4_k_codes(q: *const u8) -> [__m512; 2] {
    // SAFETY: as the caller guarantees.
    let v = unsafe { widen(q) };
    [
        _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))),
        _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v)),
    ]
}

/// The four 6-bit codes minus 32, as floats, of `Q6_K` lanes `l .. l + 16`
/// of a 128-weight half (`ql` its 64 bytes of low nibbles, `qh` its 32 of
/// high pairs): weights `l + 32k` for `k` in `0..4`, as `q6_quad` unpacks
/// them one lane at a time.
///
/// # Safety
/// AVX-512F; `ql + l .. ql + l + 48` and `qh + l .. qh + l + 16` readable.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn q6_k_codes(ql: *const u8, qh: *const u8, l: usize) -> [__m512; 4] {
    // SAFETY: as the caller guarantees.
    let (a, b, hb) = unsafe { (widen(ql.add(l)), widen(ql.add(l + 32)), widen(qh.add(l))) };
    let (m4, m30) = (_mm512_set1_epi32(15), _mm512_set1_epi32(0x30));
    let high = |v: __m512i| _mm512_and_si512(v, m30);
    let q = [
        _mm512_or_si512(_mm512_and_si512(a, m4), high(_mm512_slli_epi32::<4>(hb))),
        _mm512_or_si512(_mm512_and_si512(b, m4), high(_mm512_slli_epi32::<2>(hb))),
        _mm512_or_si512(_mm512_srli_epi32::<4>(a), high(hb)),
        _mm512_or_si512(_mm512_srli_epi32::<4>(b), high(_mm512_srli_epi32::<2>(hb))),
    ];
    q.map(|v| _mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(32))))
}

/// The 16 scale products `d * sc` of a `Q6_K` block (210 bytes at `blk`),
/// as the portable loops form them, one vector product for all.
///
/// # Safety
/// AVX-512F.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn q6_k_scales(blk: &[u8]) -> [f32; 16] {
    let mut ds = [0.0f32; 16];
    let sc: &[u8; 16] = blk[192..208].try_into().expect("16 scales");
    // SAFETY: the 16 scale bytes (a checked slice), 16 floats out.
    unsafe {
        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(sc.as_ptr() as *const __m128i));
        let d = _mm512_set1_ps(h(blk, 208));
        _mm512_storeu_ps(ds.as_mut_ptr(), _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
    }
    ds
}

/// The weights of `Q6_K` lanes `16 half .. + 16` of 128-weight half `n` of
/// a block (`ds` its [`q6_k_scales`]): for `k` in `0..4`, weights
/// `128 n + 16 half + 32 k ..`, each code times its scale product, the
/// portable loops' product.
///
/// # Safety
/// AVX-512F; `blk` is a whole block.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn q6_k_weights(
    blk: &[u8],
    ds: &[f32; 16],
    n: usize,
    half: usize,
) -> [__m512; 4] {
    assert!(blk.len() >= 210 && n < 2 && half < 2);
    let (ql, qh) = (blk[64 * n..].as_ptr(), blk[128 + 32 * n..].as_ptr());
    // SAFETY: bytes `64 n + 16 half .. + 48` and `128 + 32 n + 16 half ..
    // + 16` of the block (asserted whole).
    let q = unsafe { q6_k_codes(ql, qh, 16 * half) };
    std::array::from_fn(|k| _mm512_mul_ps(_mm512_set1_ps(ds[8 * n + half + 2 * k]), q[k]))
}

/// `R` consecutive `Q5_0` rows (`nb` blocks each) dot one input: `out[r]`
/// is bitwise `dot_q5_0_portable` of row `r`.
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C must be available; `src` holds `R` rows of
/// `nb` blocks; `x` holds `32 nb` values.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q5_0_rows<const R: usize>(
    src: &[u8],
    nb: usize,
    x: &[f32],
    out: &mut [f32],
) {
    const { assert!(R >= 1 && R <= 8) };
    assert!(src.len() >= R * nb * 22 && x.len() >= 32 * nb && out.len() >= R);
    // SAFETY: every pointer stays within block `i < nb` of each of the `R`
    // rows and of `x` (asserted above).
    unsafe {
        let mut acc = [_mm512_setzero_ps(); R];
        let rb = 22 * nb;
        for i in 0..nb {
            let xp = x.as_ptr().add(32 * i);
            let (xl, xh) = (load(xp), load(xp.add(16)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let b = src.as_ptr().add(r * rb + 22 * i);
                prefetch(b, rb, 22);
                // The fp16 scale (and the first fifth bits, ignored).
                let d = _mm512_broadcastss_ps(scale_pair(b));
                let [lo, hi] = q5_0_codes(b);
                let inner = _mm512_fmadd_ps(lo, xl, _mm512_mul_ps(hi, xh));
                *acc = _mm512_fmadd_ps(d, inner, *acc);
            }
        }
        for r in 0..R {
            out[r] = lanes_sum(&[acc[r]]);
        }
    }
}

/// `R` consecutive `Q4_K` rows (`nb` super-blocks of 256 each) dot one
/// input: `out[r]` is bitwise `dot_q4_k_portable` of row `r` (`xsum` the
/// input's 32-block sums).
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C must be available; `src` holds `R` rows of
/// `nb` blocks; `x` holds `256 nb` values and `xsum` `8 nb` sums.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q4_k_rows<const R: usize>(
    src: &[u8],
    nb: usize,
    x: &[f32],
    xsum: &[f32],
    out: &mut [f32],
) {
    const { assert!(R >= 1 && R <= 8) };
    assert!(
        src.len() >= R * nb * 144 && x.len() >= 256 * nb && xsum.len() >= 8 * nb && out.len() >= R
    );
    let rb = 144 * nb;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let mut macc = [0.0f32; R];
    for i in 0..nb {
        let xs = &xsum[8 * i..8 * i + 8];
        for (r, (acc, macc)) in acc.iter_mut().zip(&mut macc).enumerate() {
            let blk = &src[r * rb + 144 * i..r * rb + 144 * (i + 1)];
            prefetch(blk.as_ptr(), rb, 144);
            let dmin = h(blk, 2);
            for c in 0..4 {
                let ([d1, d2], [m1, m2]) = q4k_pair(blk, c);
                *macc += dmin * (m1 * xs[2 * c] + m2 * xs[2 * c + 1]);
                let (d1, d2) = (_mm512_set1_ps(d1), _mm512_set1_ps(d2));
                for (k, a) in acc.iter_mut().enumerate() {
                    // SAFETY: code bytes `16 + 32c + 16k .. + 16` of the
                    // block, inputs `256 i + 64 c + 16 k .. + 16` and
                    // `.. + 32 ..` of `x` (asserted above).
                    unsafe {
                        let [lo, hi] = q4_k_codes(blk.as_ptr().add(16 + 32 * c + 16 * k));
                        let xp = x.as_ptr().add(256 * i + 64 * c + 16 * k);
                        let t = _mm512_fmadd_ps(d2, _mm512_mul_ps(hi, load(xp.add(32))), *a);
                        *a = _mm512_fmadd_ps(d1, _mm512_mul_ps(lo, load(xp)), t);
                    }
                }
            }
        }
    }
    for r in 0..R {
        // SAFETY: the features are enabled.
        out[r] = unsafe { lanes_sum(&acc[r]) } - macc[r];
    }
}

/// `R` consecutive `Q6_K` rows (`nb` super-blocks of 256 each) dot one
/// input: `out[r]` is bitwise `dot_q6_k_portable` of row `r`.
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C must be available; `src` holds `R` rows of
/// `nb` blocks; `x` holds `256 nb` values.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q6_k_rows<const R: usize>(
    src: &[u8],
    nb: usize,
    x: &[f32],
    out: &mut [f32],
) {
    const { assert!(R >= 1 && R <= 8) };
    assert!(src.len() >= R * nb * 210 && x.len() >= 256 * nb && out.len() >= R);
    let rb = 210 * nb;
    let mut acc = [_mm512_setzero_ps(); R];
    for i in 0..nb {
        for (r, a) in acc.iter_mut().enumerate() {
            let blk = &src[r * rb + 210 * i..r * rb + 210 * (i + 1)];
            prefetch(blk.as_ptr(), rb, 210);
            // SAFETY: the features are enabled; `blk` is a whole block.
            let ds = unsafe { q6_k_scales(blk) };
            for n in 0..2 {
                for half in 0..2 {
                    // SAFETY: as above; inputs `256 i + 128 n + 16 half +
                    // 32 k .. + 16` (asserted above).
                    unsafe {
                        let w = q6_k_weights(blk, &ds, n, half);
                        let xp = x.as_ptr().add(256 * i + 128 * n + 16 * half);
                        for (k, w) in w.into_iter().enumerate() {
                            *a = _mm512_fmadd_ps(w, load(xp.add(32 * k)), *a);
                        }
                    }
                }
            }
        }
    }
    for r in 0..R {
        // SAFETY: the features are enabled.
        out[r] = unsafe { lanes_sum(&[acc[r]]) };
    }
}

/// `out[r] = row r . x` for the consecutive rows of `w` (`out.len()` rows of
/// type `ty`), four rows at a time, then one: each result bitwise
/// [`crate::blocks::dot_row`]'s portable loop for its row alone.
///
/// # Safety
/// [`available`] must have returned true for `ty`; `w` holds `out.len()`
/// rows of `x.len()` weights; for `Q4_K`, `xsum` holds the input's
/// `x.len() / 32` block sums.
pub(crate) unsafe fn matvec(ty: GgmlType, w: &[u8], x: &[f32], xsum: &[f32], out: &mut [f32]) {
    let nb = x.len() / ty.block_size();
    let rb = ty.row_bytes(x.len());
    let mut r = 0;
    while r < out.len() {
        let four = out.len() - r >= 4;
        let (w, o) = (&w[r * rb..], &mut out[r..]);
        // SAFETY: AVX-512F and the rest (the caller checked `available`);
        // each kernel asserts that its rows, input and sums are whole.
        unsafe {
            match (ty, four) {
                (GgmlType::Q5_0, true) => dot_q5_0_rows::<4>(w, nb, x, o),
                (GgmlType::Q5_0, false) => dot_q5_0_rows::<1>(w, nb, x, o),
                (GgmlType::Q4_K, true) => dot_q4_k_rows::<4>(w, nb, x, xsum, o),
                (GgmlType::Q4_K, false) => dot_q4_k_rows::<1>(w, nb, x, xsum, o),
                (_, true) => dot_q6_k_rows::<4>(w, nb, x, o),
                (_, false) => dot_q6_k_rows::<1>(w, nb, x, o),
            }
        }
        r += if four { 4 } else { 1 };
    }
}

/// One row's dot ([`matvec`] of one row), for [`crate::blocks::dot_row`]:
/// `None` where `ty` has no kernel here or the row, input or sums are
/// short (the portable loops handle those as they do).
#[inline]
pub(crate) fn dot_row(ty: GgmlType, src: &[u8], x: &[f32], xsum: &[f32]) -> Option<f32> {
    let nb = x.len() / ty.block_size();
    let whole = src.len() >= nb * ty.block_bytes()
        && (ty != GgmlType::Q4_K || xsum.len() >= 8 * nb)
        && nb > 0;
    if !whole || !available(ty) {
        return None;
    }
    let mut o = [0.0f32];
    let x = &x[..nb * ty.block_size()];
    // SAFETY: AVX-512F detected and `ty` has a kernel; the row, input and
    // sums are whole (checked above).
    unsafe { matvec(ty, &src[..nb * ty.block_bytes()], x, xsum, &mut o) };
    Some(o[0])
}

/// One `Q5_0` row (`nb` blocks) dot `N` inputs: `out[j]` is bitwise
/// `dot_q5_0_portable(row, xs[j])`. Each block is unpacked once for the
/// `N` inputs (batched decode: one input per sequence).
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C must be available; `row` holds `nb`
/// blocks; each `xs[j]` points at `32 nb` values.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn q5_0_tile<const N: usize>(row: &[u8], nb: usize, xs: [*const f32; N], out: &mut [f32]) {
    assert!(row.len() >= 22 * nb && out.len() >= N);
    // SAFETY: block `i < nb` of the row (asserted) and of each input (as
    // the caller guarantees).
    unsafe {
        let mut acc = [_mm512_setzero_ps(); N];
        for i in 0..nb {
            let b = row.as_ptr().add(22 * i);
            let d = _mm512_broadcastss_ps(scale_pair(b));
            let [lo, hi] = q5_0_codes(b);
            for (a, x) in acc.iter_mut().zip(xs) {
                let xp = x.add(32 * i);
                let inner = _mm512_fmadd_ps(lo, load(xp), _mm512_mul_ps(hi, load(xp.add(16))));
                *a = _mm512_fmadd_ps(d, inner, *a);
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            *o = lanes_sum(&[a]);
        }
    }
}

/// One `Q4_K` row (`nb` super-blocks) dot `N` inputs: `out[j]` is bitwise
/// `dot_q4_k_portable(row, xs[j], sums[j])`, each block unpacked once.
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C must be available; `row` holds `nb`
/// blocks; each `xs[j]` points at `256 nb` values, each `sums[j]` at their
/// `8 nb` block sums.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn q4_k_tile<const N: usize>(
    row: &[u8],
    nb: usize,
    xs: [*const f32; N],
    sums: [*const f32; N],
    out: &mut [f32],
) {
    assert!(row.len() >= 144 * nb && out.len() >= N);
    let mut acc = [[_mm512_setzero_ps(); 2]; N];
    let mut macc = [0.0f32; N];
    for (i, blk) in row.chunks_exact(144).take(nb).enumerate() {
        let dmin = h(blk, 2);
        for c in 0..4 {
            let ([d1, d2], [m1, m2]) = q4k_pair(blk, c);
            for (macc, s) in macc.iter_mut().zip(sums) {
                // SAFETY: sums `8 i + 2 c` and `+ 1` of this input.
                let (s1, s2) = unsafe { (*s.add(8 * i + 2 * c), *s.add(8 * i + 2 * c + 1)) };
                *macc += dmin * (m1 * s1 + m2 * s2);
            }
            let (d1, d2) = (_mm512_set1_ps(d1), _mm512_set1_ps(d2));
            for k in 0..2 {
                // SAFETY: code bytes `16 + 32c + 16k .. + 16` of the block,
                // inputs `256 i + 64 c + 16 k .. + 16` and `.. + 32 ..`.
                unsafe {
                    let [lo, hi] = q4_k_codes(blk.as_ptr().add(16 + 32 * c + 16 * k));
                    for (a, x) in acc.iter_mut().zip(xs) {
                        let xp = x.add(256 * i + 64 * c + 16 * k);
                        let t = _mm512_fmadd_ps(d2, _mm512_mul_ps(hi, load(xp.add(32))), a[k]);
                        a[k] = _mm512_fmadd_ps(d1, _mm512_mul_ps(lo, load(xp)), t);
                    }
                }
            }
        }
    }
    for ((o, a), m) in out.iter_mut().zip(&acc).zip(macc) {
        // SAFETY: the features are enabled.
        *o = unsafe { lanes_sum(a) } - m;
    }
}

/// One `Q6_K` row (`nb` super-blocks) dot `N` inputs: `out[j]` is bitwise
/// `dot_q6_k_portable(row, xs[j])`; each block's weights (code times
/// scale product) are formed once for the `N` inputs.
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C must be available; `row` holds `nb`
/// blocks; each `xs[j]` points at `256 nb` values.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn q6_k_tile<const N: usize>(row: &[u8], nb: usize, xs: [*const f32; N], out: &mut [f32]) {
    assert!(row.len() >= 210 * nb && out.len() >= N);
    let mut acc = [_mm512_setzero_ps(); N];
    for (i, blk) in row.chunks_exact(210).take(nb).enumerate() {
        // SAFETY: the features are enabled; `blk` is a whole block.
        let ds = unsafe { q6_k_scales(blk) };
        for n in 0..2 {
            for half in 0..2 {
                // SAFETY: as above, and each input's `256 i + 128 n + 16
                // half + 32 k .. + 16` (as the caller guarantees).
                unsafe {
                    let w = q6_k_weights(blk, &ds, n, half);
                    for (a, x) in acc.iter_mut().zip(xs) {
                        let xp = x.add(256 * i + 128 * n + 16 * half);
                        for (k, w) in w.iter().enumerate() {
                            *a = _mm512_fmadd_ps(*w, load(xp.add(32 * k)), *a);
                        }
                    }
                }
            }
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: the features are enabled.
        *o = unsafe { lanes_sum(&[a]) };
    }
}

/// Most inputs a tile takes at once: `Q4_K` keeps two accumulators per
/// input, so eight inputs are 16 of the 32 vector registers.
const TILE: usize = 8;

/// One row of `ty` (`nb` blocks) dot several inputs (`xs[j]`, with
/// `sums[j]` their 32-block sums for `Q4_K`, else ignored): `out[j]` is
/// bitwise [`crate::blocks::dot_row`]'s portable loop of that input alone.
/// The inputs go in tiles of eight, four, two and one.
///
/// # Safety
/// [`available`] returned true for `ty`; `row` holds `nb` blocks; each
/// `xs[j]` points at `nb` blocks' inputs and (for `Q4_K`) each `sums[j]`
/// at their block sums; `out`, `xs` (and for `Q4_K` `sums`) have one
/// entry per input.
pub(crate) unsafe fn row_dots(
    ty: GgmlType,
    row: &[u8],
    nb: usize,
    xs: &[*const f32],
    sums: &[*const f32],
    out: &mut [f32],
) {
    assert!(out.len() == xs.len() && (ty != GgmlType::Q4_K || sums.len() == xs.len()));
    let mut j = 0;
    while j < xs.len() {
        let n = [TILE, 4, 2, 1]
            .into_iter()
            .find(|&n| n <= xs.len() - j)
            .unwrap_or(1);
        let o = &mut out[j..j + n];
        // SAFETY: as the caller guarantees, for inputs `j .. j + n`.
        unsafe {
            macro_rules! tile {
                ($n:literal) => {{
                    let x: [*const f32; $n] = xs[j..j + $n].try_into().expect("n inputs");
                    match ty {
                        GgmlType::Q5_0 => q5_0_tile::<$n>(row, nb, x, o),
                        GgmlType::Q4_K => {
                            let s = sums[j..j + $n].try_into().expect("n sums");
                            q4_k_tile::<$n>(row, nb, x, s, o)
                        }
                        _ => q6_k_tile::<$n>(row, nb, x, o),
                    }
                }};
            }
            match n {
                TILE => tile!(8),
                4 => tile!(4),
                2 => tile!(2),
                _ => tile!(1),
            }
        }
        j += n;
    }
}
