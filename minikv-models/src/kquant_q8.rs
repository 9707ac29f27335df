//! 8-bit activations ([`crate::q8`], `--activations q8`) for the k-quant
//! weight types `Q5_0`, `Q4_K` and `Q6_K`, the ones Gemma 3's `Q4_K_M`
//! file stores most of its projections in.
//!
//! The input is the same [`Q8Vec`] as for `Q4_1` and `Q8_0`: blocks of 32
//! codes with one scale `d_x` each (and `s_x = d_x sum(q)`). The weights are
//! taken in units of 32 that line up with those blocks: a `Q5_0` block is one
//! unit, a `Q4_K` or `Q6_K` super-block of 256 weights is eight. A unit
//! gives 32 integer codes, the f32 scale of each half of 16 (`Q6_K` has a
//! scale per 16 weights; the other two one per unit) and, for `Q4_K`, the
//! minimum's factor:
//!
//! | type | codes | scale of a half | minimum factor |
//! |---|---|---|---|
//! | `Q5_0` | `q - 16` in `[-16, 15]` | `d` | none |
//! | `Q4_K` | `q` in `[0, 15]` | `d sc_j` | `-dmin m_j` |
//! | `Q6_K` | `q - 32` in `[-32, 31]` | `d sc_{2j}`, `d sc_{2j+1}` | none |
//!
//! (The products `d sc` and `dmin m` are exact in f32: an fp16 times an
//! integer of at most 8 bits.) The dot product then has the arithmetic of
//! the `Q4_1` / `Q8_0` ones, which defines the bits every kernel must give:
//! eight lanes, lane `l` of unit `u` adding
//! `(dw_{l/4} d_x[u]) * sum(w[4l..4l+4] x_q[4l..4l+4])` (an exact integer sum
//! of four products, one fused multiply-add) to its accumulator, the lanes
//! summed in index order at the end, plus, for `Q4_K`, the minimum terms
//! `m s_x[u]` added in unit order. [`dot`] is that loop; the kernels on
//! 512-bit registers with VNNI (`q8_x86_512.rs`, taking the units through
//! this file's `x86` module) and the single-row AVX2 kernel (`x86::dot`,
//! through [`dot_fast`], for CPUs without VNNI) give its bits.
//!
//! llama.cpp rounds the input to 8 bits per block of 256 (`Q8_K`) for these
//! types; blocks of 32 keep more of the input, at one scale per 32 codes.

use crate::blocks::{GgmlType, h, scale_min_k4};
use crate::q8::Q8Vec;

/// True for the weight types this file takes.
pub(crate) fn takes(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q5_0 | GgmlType::Q4_K | GgmlType::Q6_K)
}

/// Unit `j` (weights `32 j .. 32 j + 32`) of the block `blk` of `ty`: its
/// integer codes, the scales of its two halves of 16 weights and the
/// minimum's factor (0 where the type has none).
fn unit(ty: GgmlType, blk: &[u8], j: usize) -> ([i8; 32], [f32; 2], f32) {
    let mut w = [0i8; 32];
    match ty {
        GgmlType::Q5_0 => {
            let qh = u32::from_le_bytes(blk[2..6].try_into().expect("4 bytes"));
            for (i, w) in w.iter_mut().enumerate() {
                let nib = (blk[6 + i % 16] >> (4 * (i / 16))) & 15;
                *w = (nib | (((qh >> i) & 1) as u8) << 4) as i8 - 16;
            }
            let d = h(blk, 0);
            (w, [d, d], 0.0)
        }
        GgmlType::Q4_K => {
            let (sc, m) = scale_min_k4(j, blk[4..16].try_into().expect("12 bytes"));
            for (i, w) in w.iter_mut().enumerate() {
                *w = ((blk[16 + 32 * (j / 2) + i] >> (4 * (j % 2))) & 15) as i8;
            }
            let d = h(blk, 0) * sc as f32;
            (w, [d, d], -(h(blk, 2) * m as f32))
        }
        GgmlType::Q6_K => {
            let (n, k) = (j / 4, j % 4);
            for (i, w) in w.iter_mut().enumerate() {
                let ql = (blk[64 * n + 32 * (k % 2) + i] >> (4 * (k / 2))) & 15;
                let qh = (blk[128 + 32 * n + i] >> (2 * k)) & 3;
                *w = (ql | qh << 4) as i8 - 32;
            }
            let (d, sc) = (h(blk, 208), |t: usize| blk[192 + t] as i8 as f32);
            (w, [d * sc(2 * j), d * sc(2 * j + 1)], 0.0)
        }
        other => unreachable!("kquant_q8 takes Q5_0, Q4_K and Q6_K, not {other:?}"),
    }
}

/// The row `src` of `ty` (`Q5_0`, `Q4_K` or `Q6_K`, `a.d.len()` units of
/// 32 weights) dot the quantized input `a`: the loop that defines the bits
/// (module doc).
pub(crate) fn dot(ty: GgmlType, src: &[u8], a: &Q8Vec) -> f32 {
    let (bytes, units) = (ty.block_bytes(), ty.block_size() / 32);
    let mut acc = [0.0f32; 8];
    let mut macc = 0.0f32;
    for (u, xq) in a.q.chunks_exact(32).enumerate() {
        let blk = &src[u / units * bytes..][..bytes];
        let (w, dw, m) = unit(ty, blk, u % units);
        for (l, acc) in acc.iter_mut().enumerate() {
            let isum: i32 = (4 * l..4 * l + 4).map(|i| w[i] as i32 * xq[i] as i32).sum();
            *acc = (dw[l / 4] * a.d[u]).mul_add(isum as f32, *acc);
        }
        macc += m * a.s[u];
    }
    let s = acc.iter().sum::<f32>();
    if ty == GgmlType::Q4_K { s + macc } else { s }
}

/// [`dot`] on AVX2 registers where they are compiled in (bitwise equal),
/// else [`dot`] itself: the single-row dot of CPUs without AVX-512 VNNI.
pub(crate) fn dot_fast(ty: GgmlType, src: &[u8], a: &Q8Vec) -> f32 {
    #[cfg(x86_kernels)]
    if a.q.len() == 32 * a.d.len() && src.len() >= ty.row_bytes(32 * a.d.len()) {
        // SAFETY: AVX2/FMA/F16C are compiled in (cfg); `src` holds the
        // row of `a.d.len()` units (checked).
        unsafe {
            return match ty {
                GgmlType::Q5_0 => x86::dot::<x86::Q5_0>(src, a),
                GgmlType::Q4_K => x86::dot::<x86::Q4K>(src, a),
                GgmlType::Q6_K => x86::dot::<x86::Q6K>(src, a),
                _ => dot(ty, src, a),
            };
        }
    }
    dot(ty, src, a)
}

/// The units of [`unit`] on AVX2 registers, as the 8-bit kernels of
/// `q8_x86_512.rs` take them ([`crate::q8_x86_512::Kind`]).
#[cfg(x86_kernels)]
pub(crate) mod x86 {
    use crate::blocks::{h, scale_min_k4};
    use crate::blocks_x86::scale_pair;
    use crate::q8::Q8Vec;
    use crate::q8_x86_512::{Kind, Unit};
    use std::arch::x86_64::*;

    /// `Q5_0` ([`super::unit`]'s codes `q - 16`, taken as `q` and `OFFSET` 16).
    pub(crate) struct Q5_0;
    /// `Q4_K` (codes `q`, minimum factor `-dmin m_j`).
    pub(crate) struct Q4K;
    /// `Q6_K` (codes `q - 32`, taken as `q` and `OFFSET` 32; a scale per half).
    pub(crate) struct Q6K;

    /// [`super::dot`] of `R` rows of kind `K` against `N` inputs on AVX2
    /// (`out[r N + n]`): per unit, pairs of products (`vpmaddubsw`; the
    /// codes plus their offset are below 64, so no pair saturates 16 bits)
    /// less `OFFSET` (a power of two up to 32) times the pair's input codes
    /// (formed once per input and unit for the `R` rows; the difference
    /// stays within 16 bits), summed into eight lanes of four products
    /// (`vpmaddwd`), scaled and added by one fused multiply-add; the lanes
    /// summed in index order. Each unit is unpacked once for the `N` inputs; the
    /// `R x N` sums are independent chains. Every result is bitwise its
    /// single dot's.
    ///
    /// # Safety
    /// AVX2/FMA/F16C available; each row holds `a[0].d.len()` units of
    /// `K`, every input as many blocks (`q`: 32 codes each) and `out` at
    /// least `R N` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn tile<K: Kind, const R: usize, const N: usize>(
        rows: [*const u8; R],
        a: [&Q8Vec; N],
        out: &mut [f32],
    ) {
        const { assert!(K::OFFSET <= 32 && (K::OFFSET == 0 || K::OFFSET.is_power_of_two())) };
        use crate::blocks_x86::{PREFETCH, lanes_sum};
        use crate::q8_x86_512::{row_bytes, unit_at};
        let nb = a[0].d.len();
        assert!(out.len() >= R * N);
        assert!(
            a.iter()
                .all(|a| a.d.len() == nb && a.q.len() >= 32 * nb && a.s.len() >= nb)
        );
        let (ones, ones8) = (_mm256_set1_epi16(1), _mm256_set1_epi8(1));
        let shift = _mm_cvtsi32_si128(K::OFFSET.trailing_zeros() as i32);
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let mut macc = [[0.0f32; N]; R];
        // The inputs' arrays as raw pointers: plain loops over them (no
        // closures, which would not inherit this function's features).
        let (mut q, mut d, mut sx) = (
            [std::ptr::null(); N],
            [std::ptr::null(); N],
            [std::ptr::null(); N],
        );
        for n in 0..N {
            (q[n], d[n], sx[n]) = (a[n].q.as_ptr(), a[n].d.as_ptr(), a[n].s.as_ptr());
        }
        let (mut xq, mut off) = ([_mm256_setzero_si256(); N], [_mm256_setzero_si256(); N]);
        for b in 0..nb {
            for n in 0..N {
                // SAFETY: block `b < nb` of each input (asserted above).
                xq[n] = unsafe { _mm256_loadu_si256(q[n].add(32 * b) as *const __m256i) };
                // `OFFSET` times each pair of input codes, in 16 bits (at
                // most 32 x 256 in magnitude).
                if K::OFFSET != 0 {
                    off[n] = _mm256_sll_epi16(_mm256_maddubs_epi16(ones8, xq[n]), shift);
                }
            }
            for r in 0..R {
                let ahead = rows[r].wrapping_add(row_bytes::<K>(b) + PREFETCH);
                _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                let (blk, j) = unit_at::<K>(rows[r], b);
                // SAFETY: unit `b < nb` of the row, as the caller guarantees.
                let u = unsafe { K::unit(blk, j) };
                let dw = _mm256_set_m128(_mm_set1_ps(u.dw[1]), _mm_set1_ps(u.dw[0]));
                for n in 0..N {
                    let mut pairs = _mm256_maddubs_epi16(u.w, xq[n]);
                    if K::OFFSET != 0 {
                        pairs = _mm256_sub_epi16(pairs, off[n]);
                    }
                    let isum = _mm256_madd_epi16(pairs, ones);
                    // SAFETY: block `b < nb` of each input (asserted above).
                    let dx = unsafe { *d[n].add(b) };
                    let dd = _mm256_mul_ps(dw, _mm256_set1_ps(dx));
                    acc[r][n] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(isum), acc[r][n]);
                    if K::MIN {
                        // SAFETY: as above.
                        macc[r][n] += u.m * unsafe { *sx[n].add(b) };
                    }
                }
            }
        }
        let all = acc.iter().flatten().zip(macc.iter().flatten());
        for (o, (acc, m)) in out.iter_mut().zip(all) {
            // SAFETY: AVX2 is available (this function's contract).
            let s = unsafe { lanes_sum(&[*acc]) };
            *o = if K::MIN { s + m } else { s };
        }
    }

    /// [`super::dot`] of a row of kind `K` on AVX2 ([`tile`] of one row and
    /// one input).
    ///
    /// # Safety
    /// AVX2/FMA/F16C available; `src` holds `a.d.len()` units of `K`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot<K: Kind>(src: &[u8], a: &Q8Vec) -> f32 {
        let nb = a.d.len();
        assert!(src.len() >= crate::q8_x86_512::row_bytes::<K>(nb) && a.q.len() >= 32 * nb);
        let mut o = [0.0f32];
        // SAFETY: the row and the input are whole (asserted above).
        unsafe { tile::<K, 1, 1>([src.as_ptr()], [a], &mut o) };
        o[0]
    }

    /// The 32 codes of 16 bytes of nibbles at `qs` (`Q4_1`, `Q5_0`): the low
    /// nibbles are codes 0-15, the high ones 16-31.
    ///
    /// # Safety
    /// 16 bytes readable at `qs`.
    #[inline(always)]
    pub(crate) unsafe fn nibble_codes(qs: *const u8) -> __m256i {
        // SAFETY: as the caller guarantees; AVX2 is compiled in (module cfg).
        unsafe {
            let (qs, mask) = (_mm_loadu_si128(qs as *const __m128i), _mm_set1_epi8(15));
            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
            _mm256_set_m128i(hi, _mm_and_si128(qs, mask))
        }
    }

    /// The low (`hi` false) or high nibbles of 32 bytes.
    #[inline(always)]
    fn nibbles(v: __m256i, hi: bool) -> __m256i {
        // SAFETY: AVX2 is compiled in (this module's cfg).
        unsafe {
            let v = if hi { _mm256_srli_epi16(v, 4) } else { v };
            _mm256_and_si256(v, _mm256_set1_epi8(15))
        }
    }

    impl Kind for Q5_0 {
        const BYTES: usize = 22;
        const UNITS: usize = 1;
        const OFFSET: u8 = 16;
        const MIN: bool = false;
        const HALVES: bool = false;
        #[inline(always)]
        unsafe fn unit(blk: *const u8, _: usize) -> Unit {
            // SAFETY: the caller guarantees a whole block of 22 bytes.
            unsafe {
                let qh = (blk.add(2) as *const i32).read_unaligned();
                // Byte `i` of `spread` is byte `i / 8` of `qh`; its bit `i % 8`
                // is weight `i`'s fifth bit.
                let idx = _mm256_setr_epi8(
                    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                    3, 3, 3, 3, 3, 3,
                );
                let spread = _mm256_shuffle_epi8(_mm256_set1_epi32(qh), idx);
                let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
                let q = _mm256_or_si256(
                    nibble_codes(blk.add(6)),
                    _mm256_and_si256(set, _mm256_set1_epi8(16)),
                );
                let d = _mm_cvtss_f32(scale_pair(blk));
                Unit {
                    w: q,
                    dw: [d, d],
                    m: 0.0,
                }
            }
        }
    }

    impl Kind for Q4K {
        const BYTES: usize = 144;
        const UNITS: usize = 8;
        const OFFSET: u8 = 0;
        const MIN: bool = true;
        const HALVES: bool = false;
        #[inline(always)]
        unsafe fn unit(blk: *const u8, j: usize) -> Unit {
            // SAFETY: the caller guarantees a whole block of 144 bytes.
            unsafe {
                let b = std::slice::from_raw_parts(blk, 144);
                let (sc, m) = scale_min_k4(j, b[4..16].try_into().expect("12 bytes"));
                let q = _mm256_loadu_si256(blk.add(16 + 32 * (j / 2)) as *const __m256i);
                // `d` and `dmin`, the block's leading fp16 pair.
                let dm = scale_pair(blk);
                let d = _mm_cvtss_f32(dm) * sc as f32;
                Unit {
                    w: nibbles(q, j % 2 == 1),
                    dw: [d, d],
                    m: -(_mm_cvtss_f32(_mm_movehdup_ps(dm)) * m as f32),
                }
            }
        }
    }

    impl Kind for Q6K {
        const BYTES: usize = 210;
        const UNITS: usize = 8;
        const OFFSET: u8 = 32;
        const MIN: bool = false;
        const HALVES: bool = true;
        #[inline(always)]
        unsafe fn unit(blk: *const u8, j: usize) -> Unit {
            let (n, k) = (j / 4, j % 4);
            // SAFETY: the caller guarantees a whole block of 210 bytes.
            unsafe {
                let b = std::slice::from_raw_parts(blk, 210);
                let ql = _mm256_loadu_si256(blk.add(64 * n + 32 * (k % 2)) as *const __m256i);
                let qh = _mm256_loadu_si256(blk.add(128 + 32 * n) as *const __m256i);
                // Two bits per byte, shifted in 16-bit lanes and masked (a
                // right shift of at most 6 leaves bits 0-1 the byte's own).
                let sh = _mm_cvtsi32_si128(2 * k as i32);
                let hb = _mm256_and_si256(_mm256_srl_epi16(qh, sh), _mm256_set1_epi8(3));
                let q = _mm256_or_si256(nibbles(ql, k >= 2), _mm256_slli_epi16(hb, 4));
                let (d, sc) = (h(b, 208), |t: usize| b[192 + t] as i8 as f32);
                Unit {
                    w: q,
                    dw: [d * sc(2 * j), d * sc(2 * j + 1)],
                    m: 0.0,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::{dequantize_row_portable, tests::random_k_rows};
    use crate::matrix::QMatrix;
    use crate::q8::Activations;
    use rand::SeedableRng;

    fn input(cols: usize, salt: usize) -> Vec<f32> {
        (0..cols)
            .map(|i| {
                let k = (i + 31 * salt) * 7919 % 1000;
                (k as f32 / 500.0 - 1.0) * (1.0 + i as f32 * 1e-3)
            })
            .collect()
    }

    /// The q8 dot of a row is the dot of the row as the (independent)
    /// dequantizer reads it with the input as its 8-bit codes read back
    /// (`d_x q`), computed in f64, up to f32 rounding: a unit decoded with
    /// a wrong layout, scale or sign is far off.
    #[test]
    fn dots_are_the_dequantized_rows_dot_the_rounded_input() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(28);
        for (ty, cols) in [
            (GgmlType::Q5_0, 640),
            (GgmlType::Q4_K, 1024),
            (GgmlType::Q6_K, 1024),
        ] {
            let rows = 6;
            let nb = cols / ty.block_size();
            let bytes = random_k_rows(&mut rng, ty, rows, nb);
            let mut a = Q8Vec::default();
            a.quantize(&input(cols, 1));
            let xr: Vec<f64> =
                a.q.iter()
                    .enumerate()
                    .map(|(i, &q)| a.d[i / 32] as f64 * q as f64)
                    .collect();
            let mut wr = vec![0.0f32; cols];
            for row in bytes.chunks_exact(ty.row_bytes(cols)) {
                dequantize_row_portable(ty, row, &mut wr);
                let terms = wr.iter().zip(&xr).map(|(&w, &x)| w as f64 * x);
                let (want, mag) = terms.fold((0.0, 0.0), |(s, m), t| (s + t, m + t.abs()));
                let got = dot(ty, row, &a) as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * mag + 1e-30,
                    "{ty:?}: {got} vs {want} (magnitude {mag})"
                );
            }
        }
    }

    /// The AVX2 dots (CPUs without AVX-512 VNNI, odd last rows) are
    /// bitwise the defining loop: one row, one row against 1-9 inputs
    /// (`q8_avx2::dots`), one input against 1-9 rows (`q8_avx2::dot_rows`).
    #[test]
    fn fast_dots_are_bitwise_the_defining_loop() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(30);
        for (ty, cols) in [
            (GgmlType::Q5_0, 640),
            (GgmlType::Q4_K, 1024),
            (GgmlType::Q6_K, 2048),
        ] {
            let rb = ty.row_bytes(cols);
            let bytes = random_k_rows(&mut rng, ty, 9, cols / ty.block_size());
            let inputs: Vec<Q8Vec> = (0..9)
                .map(|i| {
                    let mut a = Q8Vec::default();
                    a.quantize(&input(cols, i));
                    a
                })
                .collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (r, row) in bytes.chunks_exact(rb).enumerate() {
                let a = &inputs[r];
                let (got, want) = (dot_fast(ty, row, a), dot(ty, row, a));
                assert_eq!(got.to_bits(), want.to_bits(), "{ty:?} row {r}");
                // One row against 1-9 inputs (tiles of four, then one).
                let want: Vec<f32> = inputs.iter().map(|a| dot(ty, row, a)).collect();
                for n in 1..=9 {
                    let refs: Vec<&Q8Vec> = inputs[..n].iter().collect();
                    let mut got = vec![f32::NAN; n];
                    crate::q8_avx2::dots(ty, row, &refs, &mut got);
                    assert_eq!(bits(&got), bits(&want[..n]), "{ty:?} row {r}, {n} inputs");
                }
            }
            // One input against 1-9 rows (groups of four, then one).
            let a = &inputs[0];
            let want: Vec<f32> = bytes.chunks_exact(rb).map(|row| dot(ty, row, a)).collect();
            for rows in 1..=9 {
                let mut got = vec![f32::NAN; rows];
                crate::q8_avx2::dot_rows(ty, &bytes, a, &mut got);
                assert_eq!(bits(&got), bits(&want[..rows]), "{ty:?} {rows} rows");
            }
        }
    }

    /// `matvec` and the batched `matvec_rows` under [`Activations::Q8`]
    /// (on 512-bit registers with VNNI where the CPU has them: row pairs,
    /// tiles of rows against pairs of inputs) give every row and input
    /// bitwise [`dot`] of that row and input alone, for row counts and
    /// batch sizes that leave every remainder.
    #[test]
    fn q8_products_are_bitwise_the_defining_loop() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(29);
        for (ty, cols) in [
            (GgmlType::Q5_0, 160),
            (GgmlType::Q4_K, 512),
            (GgmlType::Q6_K, 512),
        ] {
            for rows in [1, 2, 3, 5, 9, 37] {
                let nb = cols / ty.block_size();
                let bytes = random_k_rows(&mut rng, ty, rows, nb);
                let blob = crate::gguf::Blob::owned(bytes.clone());
                let mut m = QMatrix::new("t", ty, rows, cols, blob).unwrap();
                m.set_activations(Activations::Q8);
                let row = |r: usize| &bytes[r * ty.row_bytes(cols)..][..ty.row_bytes(cols)];
                for n in [1usize, 2, 3, 4, 5, 8, 9, 16, 17, 23] {
                    let x: Vec<f32> = (0..=n).flat_map(|i| input(cols, i)).collect();
                    let sel: Vec<usize> = (1..=n).rev().collect();
                    let mut y = vec![f32::NAN; (n + 1) * rows];
                    m.matvec_rows(&x, &mut y, &sel);
                    for &i in &sel {
                        let mut a = Q8Vec::default();
                        a.quantize(&x[i * cols..(i + 1) * cols]);
                        for r in 0..rows {
                            let (got, want) = (y[i * rows + r], dot(ty, row(r), &a));
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{ty:?} {rows} rows, n={n}, input {i}, row {r}"
                            );
                        }
                    }
                }
            }
        }
    }
}
