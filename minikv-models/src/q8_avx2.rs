//! 8-bit dots (`--activations q8`) on AVX2 registers in tiles: the
//! products of CPUs without AVX-512 VNNI (`MINIKV_MAX_ISA=avx2` runs them
//! on one with it) for `Q5_0`, `Q4_K` and `Q6_K` weights. One input
//! against four rows (decode of one sequence: four independent chains),
//! one row against four inputs (batched decode: each unit of 32 weights
//! unpacked once). Every result is bitwise the single-row dot's
//! ([`crate::kquant_q8::dot`]).

use crate::blocks::GgmlType;
#[cfg(x86_kernels)]
use crate::kquant_q8::x86 as kq;
use crate::q8::Q8Vec;

/// [`crate::kquant_q8::dot`] of one row of `ty` (`Q5_0`, `Q4_K`, `Q6_K`)
/// against each input of `a` (`out[j]`),
/// bitwise: on AVX2 registers, each unit unpacked once for up to four
/// inputs (batched decode on CPUs without AVX-512 VNNI).
pub(crate) fn dots(ty: GgmlType, src: &[u8], a: &[&Q8Vec], out: &mut [f32]) {
    #[cfg(x86_kernels)]
    {
        let nb = a.first().map_or(0, |v| v.d.len());
        let whole = |v: &&Q8Vec| v.d.len() == nb && v.q.len() == 32 * nb && v.s.len() >= nb;
        if a.iter().all(whole) && src.len() >= ty.row_bytes(32 * nb) {
            let mut j = 0;
            while j < a.len() {
                let n = if a.len() - j >= 4 { 4 } else { 1 };
                let o = &mut out[j..j + n];
                let r = [src.as_ptr()];
                // SAFETY: AVX2/FMA/F16C compiled in (cfg); the row holds `nb`
                // units and every input `nb` blocks (checked above).
                unsafe {
                    match (ty, n) {
                        (GgmlType::Q5_0, 4) => kq::tile::<kq::Q5_0, 1, 4>(r, a4(a, j), o),
                        (GgmlType::Q4_K, 4) => kq::tile::<kq::Q4K, 1, 4>(r, a4(a, j), o),
                        (GgmlType::Q6_K, 4) => kq::tile::<kq::Q6K, 1, 4>(r, a4(a, j), o),
                        _ => o[0] = crate::kquant_q8::dot_fast(ty, src, a[j]),
                    }
                }
                j += n;
            }
            return;
        }
    }
    for (o, v) in out.iter_mut().zip(a) {
        *o = crate::kquant_q8::dot(ty, src, v);
    }
}

/// Inputs `j .. j + 4` of `a`.
#[cfg(x86_kernels)]
fn a4<'a>(a: &[&'a Q8Vec], j: usize) -> [&'a Q8Vec; 4] {
    [a[j], a[j + 1], a[j + 2], a[j + 3]]
}

/// `out[r] = crate::q8::dot(ty, row r of w, a)` for the consecutive rows
/// of `w` (one per output), bitwise: `Q5_0`, `Q4_K` and `Q6_K` rows four
/// at a time on AVX2 registers (four independent chains), `Q8_0` rows in
/// pairs (each block of the input loaded once for both, block `i` of the
/// row eight rows on prefetched), other types one by one. The
/// single-input product of CPUs without AVX-512 VNNI.
pub(crate) fn dot_rows(ty: GgmlType, w: &[u8], a: &Q8Vec, out: &mut [f32]) {
    let rb = ty.row_bytes(32 * a.d.len());
    #[cfg(x86_kernels)]
    if crate::kquant_q8::takes(ty)
        && a.q.len() == 32 * a.d.len()
        && a.s.len() >= a.d.len()
        && w.len() >= rb * out.len()
    {
        crate::blocks_x86::in_groups(rb, w, out, |w, o, left| {
            if left < 4 {
                o[0] = crate::kquant_q8::dot_fast(ty, &w[..rb], a);
                return 1;
            }
            let rows: [*const u8; 4] = std::array::from_fn(|k| w[rb * k..].as_ptr());
            // SAFETY: AVX2/FMA/F16C compiled in (cfg); the four rows lie in
            // `w` and the input is whole (checked above).
            unsafe {
                match ty {
                    GgmlType::Q5_0 => kq::tile::<kq::Q5_0, 4, 1>(rows, [a], &mut o[..4]),
                    GgmlType::Q4_K => kq::tile::<kq::Q4K, 4, 1>(rows, [a], &mut o[..4]),
                    _ => kq::tile::<kq::Q6K, 4, 1>(rows, [a], &mut o[..4]),
                }
            }
            4
        });
        return;
    }
    #[cfg(x86_kernels)]
    if ty == GgmlType::Q8_0 && a.q.len() == 32 * a.d.len() && w.len() >= rb * out.len() {
        crate::blocks_x86::in_groups(rb, w, out, |w, o, left| {
            let pair = left >= 2;
            // SAFETY: AVX2/FMA/F16C compiled in (cfg); `w` holds the `left`
            // remaining rows (checked above), the input is whole.
            unsafe {
                match pair {
                    true => dot_q8_0_rows::<2>(w, a, o),
                    false => dot_q8_0_rows::<1>(w, a, o),
                }
            }
            if pair { 2 } else { 1 }
        });
        return;
    }
    for (row, o) in w.chunks_exact(rb).zip(out) {
        *o = crate::q8::dot(ty, row, a);
    }
}

/// `R` consecutive `Q8_0` rows against one 8-bit input: `out[r]` is
/// bitwise [`crate::q8::dot_q8_0`] of row `r` (its operations in order, in
/// its own accumulator); the input's block is loaded once for the `R` rows,
/// and block `i` of the row eight rows on is prefetched.
///
/// # Safety
/// AVX2, FMA and F16C available; `src` holds `R` rows of `a.d.len()` blocks
/// and `a.q` `32 a.d.len()` codes.
#[cfg(x86_kernels)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0_rows<const R: usize>(src: &[u8], a: &Q8Vec, out: &mut [f32]) {
    use crate::blocks_x86::{PF_ROWS, lanes_sum, scale_pair};
    use std::arch::x86_64::*;
    let nb = a.d.len();
    let rb = 34 * nb;
    debug_assert!(src.len() >= R * rb && a.q.len() >= 32 * nb && out.len() >= R);
    // SAFETY: every pointer stays within block `b < nb` of each of the `R`
    // rows and of the input, as the caller guarantees.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let xq = _mm256_loadu_si256(a.q.as_ptr().add(32 * b) as *const __m256i);
            let dx = *a.d.get_unchecked(b);
            for (r, acc) in acc.iter_mut().enumerate() {
                let blk = src.as_ptr().add(r * rb + 34 * b);
                _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PF_ROWS * rb) as *const i8);
                let w = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
                let isum = _mm256_madd_epi16(p, ones);
                let dd = _mm256_set1_ps(_mm_cvtss_f32(scale_pair(blk)) * dx);
                *acc = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(isum), *acc);
            }
        }
        for r in 0..R {
            out[r] = lanes_sum(&[acc[r]]);
        }
    }
}

#[cfg(all(test, x86_kernels))]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// `Q8_0` rows in pairs (then one) against one 8-bit input are bitwise
    /// the single-row dot, for 1-9 rows of 1-18 blocks (codes over the
    /// whole byte range, scales over many magnitudes and both signs).
    #[test]
    fn q8_0_row_pairs_are_bitwise_the_single_row_dots() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(41);
        for nb in [1usize, 2, 7, 18] {
            let x: Vec<f32> = (0..32 * nb)
                .map(|_| rng.random_range(-2.0f32..2.0) * 2f32.powi(rng.random_range(-6..6)))
                .collect();
            let mut a = Q8Vec::default();
            a.quantize(&x);
            let rows: Vec<u8> = (0..9 * nb)
                .flat_map(|_| {
                    let d = rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-12..0));
                    let mut b = half::f16::from_f32(d).to_le_bytes().to_vec();
                    b.extend((0..32).map(|_| rng.random::<u8>()));
                    b
                })
                .collect();
            let rb = 34 * nb;
            let want: Vec<u32> = rows
                .chunks_exact(rb)
                .map(|r| crate::q8::dot(GgmlType::Q8_0, r, &a).to_bits())
                .collect();
            for n in 1..=9 {
                let mut got = vec![f32::NAN; n];
                dot_rows(GgmlType::Q8_0, &rows[..n * rb], &a, &mut got);
                let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want[..n], "{nb} blocks, {n} rows");
            }
        }
    }
}
