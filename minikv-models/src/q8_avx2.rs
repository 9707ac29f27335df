//! 8-bit dots (`--activations q8`) on AVX2 registers in tiles: the
//! products of CPUs without AVX-512 VNNI (`MINIKV_MAX_ISA=avx2` runs them
//! on one with it) for `Q5_0`, `Q4_K` and `Q6_K` weights. One input
//! against four rows (decode of one sequence: four independent chains),
//! one row against four inputs (batched decode: each unit of 32 weights
//! unpacked once). Every result is bitwise the single-row dot's
//! ([`crate::kquant_q8::dot`]).

use crate::blocks::GgmlType;
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
use crate::kquant_q8::x86 as kq;
use crate::q8::Q8Vec;

/// [`crate::kquant_q8::dot`] of one row of `ty` (`Q5_0`, `Q4_K`, `Q6_K`)
/// against each input of `a` (`out[j]`),
/// bitwise: on AVX2 registers, each unit unpacked once for up to four
/// inputs (batched decode on CPUs without AVX-512 VNNI).
pub(crate) fn dots(ty: GgmlType, src: &[u8], a: &[&Q8Vec], out: &mut [f32]) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    ))]
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
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
fn a4<'a>(a: &[&'a Q8Vec], j: usize) -> [&'a Q8Vec; 4] {
    [a[j], a[j + 1], a[j + 2], a[j + 3]]
}

/// `out[r] = crate::q8::dot(ty, row r of w, a)` for the consecutive rows
/// of `w` (one per output), bitwise: `Q5_0`, `Q4_K` and `Q6_K` rows four
/// at a time on AVX2 registers (four independent chains), other types one
/// by one (`Q8_0` measured slower in groups of four). The single-input
/// product of CPUs without AVX-512 VNNI.
pub(crate) fn dot_rows(ty: GgmlType, w: &[u8], a: &Q8Vec, out: &mut [f32]) {
    let rb = ty.row_bytes(32 * a.d.len());
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    ))]
    if crate::kquant_q8::takes(ty)
        && a.q.len() == 32 * a.d.len()
        && a.s.len() >= a.d.len()
        && w.len() >= rb * out.len()
    {
        let mut r = 0;
        while out.len() - r >= 4 {
            let rows: [*const u8; 4] = std::array::from_fn(|k| w[rb * (r + k)..].as_ptr());
            let o = &mut out[r..r + 4];
            // SAFETY: AVX2/FMA/F16C compiled in (cfg); rows `r .. r + 4` lie
            // in `w` and the input is whole (checked above).
            unsafe {
                match ty {
                    GgmlType::Q5_0 => kq::tile::<kq::Q5_0, 4, 1>(rows, [a], o),
                    GgmlType::Q4_K => kq::tile::<kq::Q4K, 4, 1>(rows, [a], o),
                    _ => kq::tile::<kq::Q6K, 4, 1>(rows, [a], o),
                }
            }
            r += 4;
        }
        for (k, o) in out[r..].iter_mut().enumerate() {
            *o = crate::kquant_q8::dot_fast(ty, &w[rb * (r + k)..rb * (r + k + 1)], a);
        }
        return;
    }
    for (row, o) in w.chunks_exact(rb).zip(out) {
        *o = crate::q8::dot(ty, row, a);
    }
}
