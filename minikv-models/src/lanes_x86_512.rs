//! Lane sums of up to 16 accumulators at once, in the portable loops' order.
//!
//! A batched tile ends with one 16-lane accumulator per (row, input), and
//! the portable loops sum an accumulator's lanes one after another, in
//! index order (`acc.iter().sum::<f32>()`). Done per accumulator, that is a
//! store and 16 dependent scalar additions each: with 18 blocks a row (a
//! 576-wide input) it cost about a quarter of a tile's multiply-adds. Here
//! the tile's accumulators are transposed (64 shuffles, which run beside
//! the arithmetic) so that lane `l` of every accumulator sits in one
//! register, and the sums run down the registers: 15 vector additions,
//! each one step of 16 chains at once, in the same order, so every sum has
//! the portable loop's bits. (`iter().sum()` starts from `-0.0`, and
//! `-0.0 + l0` is `l0` for every `l0`: the chains start from lane 0.)

use std::arch::x86_64::*;

/// Accumulators from which a tile sums its lanes all at once (64 shuffles
/// and 15 additions for up to 16) rather than one accumulator after another
/// (a store and 16 scalar additions each).
pub(crate) const AT_ONCE: usize = 4;

/// The 16 lanes of `v`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn lanes(v: __m512) -> [f32; 16] {
    let mut o = [0.0f32; 16];
    // SAFETY: 16 lanes into 16 floats.
    unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
    o
}

/// Two 128-bit lanes of `a` then two of `b`, picked by `IMM` as
/// `_mm512_shuffle_f32x4` does.
#[inline]
#[target_feature(enable = "avx512f")]
fn quads<const IMM: i32>(a: __m512, b: __m512) -> __m512 {
    _mm512_shuffle_f32x4::<IMM>(a, b)
}

/// The columns of the 16 x 16 matrix whose rows are `v`: lane `k` of
/// result `l` is lane `l` of `v[k]`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn transpose(v: [__m512; 16]) -> [__m512; 16] {
    // Pairs of rows interleaved: t[2i] = (a0 b0 a1 b1 | a4 b4 a5 b5 | ...),
    // t[2i + 1] = (a2 b2 a3 b3 | ...), for rows a = v[2i], b = v[2i + 1].
    let t: [__m512; 16] = std::array::from_fn(|k| {
        let (a, b) = (v[k & !1], v[k | 1]);
        if k % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    // Groups of four rows g: u[4g + c] holds, in 128-bit lane q, column
    // c + 4q of rows 4g .. 4g + 4.
    let u: [__m512; 16] = std::array::from_fn(|k| {
        let (g, c) = (k / 4, k % 4);
        let (a, b) = (
            _mm512_castps_pd(t[4 * g + c / 2]),
            _mm512_castps_pd(t[4 * g + 2 + c / 2]),
        );
        _mm512_castpd_ps(if c % 2 == 0 {
            _mm512_unpacklo_pd(a, b)
        } else {
            _mm512_unpackhi_pd(a, b)
        })
    });
    // Column c + 4q gathers lane q of u[c], u[4 + c], u[8 + c], u[12 + c].
    let mut out = [_mm512_setzero_ps(); 16];
    for c in 0..4 {
        let lo01 = quads::<0x88>(u[c], u[4 + c]);
        let hi01 = quads::<0xDD>(u[c], u[4 + c]);
        let lo23 = quads::<0x88>(u[8 + c], u[12 + c]);
        let hi23 = quads::<0xDD>(u[8 + c], u[12 + c]);
        out[c] = quads::<0x88>(lo01, lo23);
        out[c + 8] = quads::<0xDD>(lo01, lo23);
        out[c + 4] = quads::<0x88>(hi01, hi23);
        out[c + 12] = quads::<0xDD>(hi01, hi23);
    }
    out
}

/// Lane `k`: the sum of `v[k]`'s 16 lanes in index order, bitwise the
/// portable `lanes.iter().sum::<f32>()`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn sums(v: [__m512; 16]) -> __m512 {
    let c = transpose(v);
    c[1..].iter().fold(c[0], |s, &l| _mm512_add_ps(s, l))
}

/// Lane `k` (`k < 8`): the sum of the 32 lanes of `v[k]` then `v[k + 8]`
/// in index order, bitwise the portable sum over the two registers of a
/// `Q8_0` accumulator. Lanes 8-15 are left over.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn sums32(v: [__m512; 16]) -> __m512 {
    let c = transpose(v);
    // The second registers' lanes, moved down to lanes 0-7.
    let swap = |l: __m512| quads::<0b0100_1110>(l, l);
    let first = c[1..].iter().fold(c[0], |s, &l| _mm512_add_ps(s, l));
    c.iter().fold(first, |s, &l| _mm512_add_ps(s, swap(l)))
}

/// Lane `k`: the sums of `v[k]`'s even lanes and of its odd lanes, each in
/// index order (two inputs sharing a register, as the 8-bit pair kernels
/// keep them).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn pair_sums(v: [__m512; 16]) -> (__m512, __m512) {
    let c = transpose(v);
    let (mut even, mut odd) = (c[0], c[1]);
    for l in 1..8 {
        even = _mm512_add_ps(even, c[2 * l]);
        odd = _mm512_add_ps(odd, c[2 * l + 1]);
    }
    (even, odd)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values whose sums depend on the order (large and small magnitudes,
    /// signed zeros): any other order than the portable loop's shows.
    fn rows(seed: u32) -> [[f32; 16]; 16] {
        let mut s = seed;
        std::array::from_fn(|_| {
            std::array::from_fn(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                match s >> 29 {
                    0 => -0.0,
                    1 => 1e7 * (s >> 8) as f32 / 16_777_216.0,
                    _ => ((s >> 8) as f32 / 8_388_608.0 - 1.0) * 3.7,
                }
            })
        })
    }

    fn load(r: &[[f32; 16]; 16]) -> [__m512; 16] {
        // SAFETY: AVX-512F checked by the callers; 16 floats per row.
        std::array::from_fn(|k| unsafe { _mm512_loadu_ps(r[k].as_ptr()) })
    }

    #[test]
    fn sums_have_the_portable_bits() {
        if !std::is_x86_feature_detected!("avx512f") {
            return;
        }
        for seed in 0..50 {
            let r = rows(seed);
            let v = load(&r);
            // SAFETY: AVX-512F detected above.
            let (t, s, s32, e, o) = unsafe {
                let (e, o) = pair_sums(v);
                let t = transpose(v).map(|c| lanes(c));
                (t, lanes(sums(v)), lanes(sums32(v)), lanes(e), lanes(o))
            };
            for k in 0..16 {
                for (l, c) in t.iter().enumerate() {
                    assert_eq!(c[k].to_bits(), r[k][l].to_bits());
                }
                let want = r[k].iter().sum::<f32>();
                assert_eq!(s[k].to_bits(), want.to_bits(), "seed {seed} row {k}");
                let even = (0..8).map(|l| r[k][2 * l]).sum::<f32>();
                let odd = (0..8).map(|l| r[k][2 * l + 1]).sum::<f32>();
                assert_eq!(e[k].to_bits(), even.to_bits());
                assert_eq!(o[k].to_bits(), odd.to_bits());
                if k < 8 {
                    let want = r[k].iter().chain(&r[k + 8]).sum::<f32>();
                    assert_eq!(s32[k].to_bits(), want.to_bits(), "seed {seed} pair {k}");
                }
            }
        }
    }
}
