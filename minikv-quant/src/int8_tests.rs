//! Unit tests of the integer kernels (`int8.rs`, `x86_int8.rs`).

use super::*;
use crate::{Arithmetic, MinMax, ScaleDtype};
use minikv_core::{Axis, QuantStore};
use rand::{Rng, SeedableRng, rngs::StdRng};

fn store(axis: Axis, bits: u32, group: usize, d: usize, n: usize, seed: u64) -> MinMaxStore {
    store_as(axis, bits, group, d, n, seed, ScaleDtype::F16)
}

/// A store of `n` random rows in `[-1, 1)` (int8 arithmetic; see [`exact`]).
pub(crate) fn store_as(
    axis: Axis,
    bits: u32,
    group: usize,
    d: usize,
    n: usize,
    seed: u64,
    scale_dtype: ScaleDtype,
) -> MinMaxStore {
    let mut rng = StdRng::seed_from_u64(seed);
    let q = MinMax {
        bits,
        group,
        axis,
        scale_dtype,
        arithmetic: Arithmetic::Int8,
    };
    let mut st = MinMaxStore::new(q, d, 64);
    let x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    st.append(&x).unwrap();
    st
}

/// The bit patterns of `v` (bitwise comparisons of kernel results).
fn bit_patterns(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `st`'s int8 scores (`g` rows of `stride`) on the portable loops, after
/// checking that every kernel set this CPU runs gives the same bits
/// (`what` names the case in a failure).
fn scores_on_every_isa(
    st: &MinMaxStore,
    q: &[f32],
    g: usize,
    stride: usize,
    what: &str,
) -> Vec<f32> {
    let mut want = vec![0.0f32; g * stride];
    st.scores_int8(Isa::Portable, q, g, &mut want, stride);
    for isa in Isa::available() {
        let mut got = vec![0.0f32; g * stride];
        st.scores_int8(isa, q, g, &mut got, stride);
        assert_eq!(bit_patterns(&got), bit_patterns(&want), "{isa:?} {what}");
    }
    want
}

/// `base` plus `st`'s int8 weighted values on the portable loops, after
/// checking that every kernel set this CPU runs gives the same bits.
fn accumulate_on_every_isa(
    st: &MinMaxStore,
    p: &[f32],
    g: usize,
    stride: usize,
    base: &[f32],
    what: &str,
) -> Vec<f32> {
    let mut want = base.to_vec();
    st.accumulate_int8(Isa::Portable, p, g, stride, &mut want);
    for isa in Isa::available() {
        let mut got = base.to_vec();
        st.accumulate_int8(isa, p, g, stride, &mut got);
        assert_eq!(bit_patterns(&got), bit_patterns(&want), "{isa:?} {what}");
    }
    want
}

/// The same store with exact arithmetic.
pub(crate) fn exact(st: &MinMaxStore) -> MinMaxStore {
    let mut e = st.clone();
    e.q.arithmetic = Arithmetic::Exact;
    e
}

/// Every kernel set this CPU runs gives bitwise the portable result,
/// within the rounding bound of the exact products.
#[test]
fn key_kernels_agree_bitwise_and_within_bound() {
    let mut rng = StdRng::seed_from_u64(7);
    for (bits, group, d, n, g) in [
        (2, 16, 64, 160, 3),
        (2, 32, 64, 96, 1),
        (4, 16, 64, 64, 3),
        (4, 8, 32, 48, 2),
        (2, 16, 128, 32, 4),
        (4, 32, 64, 64, 8),
        (2, 16, 24, 32, 5),
        (2, 16, 64, 32, 16),
        (2, 16, 64, 2 * SEG_TOKENS + 160, 3),
        (2, 16, 256, 64, 4),
        (4, 16, 256, 48, 8),
        (2, 32, 512, 64, 2),
        (4, 8, 48, 40, 6),
    ] {
        // The 512-bit kernels read f16 or f32 scales: both, on a share of shapes.
        let dtype = if n % 3 == 0 {
            ScaleDtype::F32
        } else {
            ScaleDtype::F16
        };
        let st = store_as(
            Axis::Channel,
            bits,
            group,
            d,
            n,
            bits as u64 * 31 + d as u64,
            dtype,
        );
        let q: Vec<f32> = (0..g * d).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let stride = n + 3;
        let what = format!("bits {bits} G {group} d {d} g {g}");
        let want = scores_on_every_isa(&st, &q, g, stride, &what);
        let mut ex = vec![0.0f32; g * stride];
        exact(&st).scores(&q, g, &mut ex, stride);
        // |sigma * q8 - q * scale| <= sigma / 2 per channel, codes <= qmax,
        // sigma <= max |q| * max scale / 127, scale <= 2 / qmax.
        let qmax_abs = q.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let bound = d as f32 * qmax_abs * 2.0 / 127.0 / 2.0 + 1e-3;
        for j in 0..g {
            for t in 0..n {
                let (a, b) = (want[j * stride + t], ex[j * stride + t]);
                assert!((a - b).abs() <= bound, "{a} vs {b} (bound {bound})");
            }
        }
        // And close in practice: the mean error is far below the bound.
        let mean: f32 = (0..g)
            .flat_map(|j| (0..n).map(move |t| j * stride + t))
            .map(|i| (want[i] - ex[i]).abs())
            .sum::<f32>()
            / (g * n) as f32;
        assert!(mean < bound / 8.0, "mean error {mean} (bound {bound})");
    }
}

#[test]
fn value_kernels_agree_bitwise_and_within_bound() {
    let mut rng = StdRng::seed_from_u64(9);
    for (bits, group, d, n, g) in [
        (2, 16, 64, 100, 3),
        (2, 32, 64, 64, 1),
        (4, 16, 64, 37, 3),
        (4, 8, 32, 70, 2),
        (2, 16, 128, 33, 4),
        (4, 32, 64, 5, 8),
        (2, 16, 64, 2, 6),
        (2, 16, 48, 40, 3),
        (2, 16, 64, 50, 5),
        (2, 16, 64, 2 * SEG_TOKENS + 77, 3),
        (4, 16, 64, SEG_TOKENS + 32, 2),
        (2, 16, 256, 45, 8),
        (4, 16, 256, 71, 4),
        (4, 8, 64, 33, 3),
        (2, 32, 128, 19, 2),
        (2, 16, 512, 35, 3),
        (4, 16, 64, 15, 1),
        (2, 64, 64, 96, 6),
        // Groups that 16-byte row chunks cut unevenly (no weight period):
        // the 512-bit kernel gathers the weights per dword.
        (4, 48, 96, 70, 3),
        (2, 48, 192, 45, 2),
        (4, 128, 128, 40, 3),
    ] {
        let dtype = if n % 3 == 0 {
            ScaleDtype::F32
        } else {
            ScaleDtype::F16
        };
        let st = store_as(
            Axis::Token,
            bits,
            group,
            d,
            n,
            bits as u64 * 17 + n as u64,
            dtype,
        );
        let stride = n + 2;
        let mut p = vec![0.0f32; g * stride];
        for j in 0..g {
            let row = &mut p[j * stride..j * stride + n];
            for x in row.iter_mut() {
                *x = rng.random_range(0.0f32..1.0).powi(6);
            }
            let s: f32 = row.iter().sum();
            row.iter_mut().for_each(|x| *x /= s);
        }
        let base: Vec<f32> = (0..g * d).map(|i| (i % 7) as f32 * 0.01).collect();
        let what = format!("bits {bits} G {group} d {d} n {n} g {g}");
        let want = accumulate_on_every_isa(&st, &p, g, stride, &base, &what);
        let mut ex = base.clone();
        exact(&st).accumulate(&p, g, stride, &mut ex);
        let qmax = ((1u32 << bits) - 1) as f32;
        for j in 0..g {
            // |tau * a8 - p * scale| <= tau / 2, tau <= max p * max scale / 255.
            let pmax = p[j * stride..j * stride + n]
                .iter()
                .fold(0.0f32, |m, &x| m.max(x));
            let bound = n as f32 * qmax * pmax * (2.0 / qmax) / 255.0 / 2.0 + 1e-5;
            for c in 0..d {
                let (a, b) = (want[j * d + c], ex[j * d + c]);
                assert!((a - b).abs() <= bound, "{a} vs {b} (bound {bound})");
            }
        }
    }
}

/// Queries and weights so small that a rounding step leaves the normal range
/// or its inverse overflows (`steps`): the 512-bit key kernel keeps the two
/// products (`sig` times the exact sum) instead of one folded factor, and
/// every kernel gives the portable bits, for the tiny head and the normal
/// one beside it.
#[test]
fn tiny_steps_agree_bitwise() {
    let mut rng = StdRng::seed_from_u64(11);
    for (bits, dtype) in [(2, ScaleDtype::F16), (4, ScaleDtype::F32)] {
        let (d, n, g) = (64, 160, 2);
        let st = store_as(Axis::Channel, bits, 16, d, n, 5, dtype);
        // 1e-35: a step whose product with 2^-(bits s) is subnormal (one
        // folded factor would round differently); 1e-38: an overflowing
        // inverse.
        for tiny in [1e-35f32, 1e-38] {
            let mut q: Vec<f32> = (0..g * d).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            q[d..].iter_mut().for_each(|x| *x *= tiny);
            let want = scores_on_every_isa(&st, &q, g, n, &format!("bits {bits} query x {tiny}"));
            assert!(want[n..].iter().any(|&x| x != 0.0), "the tiny head scores");
        }
        // Weights of one head so small that whole blocks' steps overflow.
        let v = store_as(Axis::Token, bits, 16, d, n, 6, dtype);
        let mut p: Vec<f32> = (0..g * n).map(|_| rng.random_range(0.0f32..1.0)).collect();
        p[n..].iter_mut().for_each(|x| *x *= 1e-37);
        let zeros = vec![0.0f32; g * d];
        accumulate_on_every_isa(&v, &p, g, n, &zeros, &format!("values bits {bits}"));
    }
}

/// On a CPU with AVX-512 VNNI and VBMI the 512-bit kernels are among those
/// compared (and the shapes above reach them and the fallbacks).
#[test]
#[cfg(target_arch = "x86_64")]
fn the_512_bit_kernels_are_compared_where_the_cpu_has_them() {
    assert_eq!(
        Isa::available().contains(&Isa::Avx512),
        crate::x86_int8_512::detected()
    );
    let keys = store(Axis::Channel, 2, 16, 64, 32, 1);
    assert!(crate::x86_int8_512::keys_ok(&keys, 3));
    assert!(!crate::x86_int8_512::keys_ok(
        &store(Axis::Channel, 2, 16, 512, 32, 1),
        3
    ));
    let values = store(Axis::Token, 2, 16, 64, 32, 1);
    assert!(crate::x86_int8_512::values_ok(&values, 3));
    assert!(!crate::x86_int8_512::values_ok(
        &store(Axis::Token, 2, 16, 512, 32, 1),
        3
    ));
}

#[test]
fn int8_is_taken_only_where_it_applies() {
    let st = store(Axis::Channel, 2, 16, 64, 32, 1);
    assert!(st.int8_ok(3));
    assert!(!st.int8_ok(17));
    assert!(!exact(&st).int8_ok(3));
    let st8 = store(Axis::Channel, 8, 16, 64, 32, 1);
    assert!(!st8.int8_ok(3), "8-bit codes run exact");
}

#[test]
fn query_rounding_is_symmetric_and_bounded() {
    // The step comes from the largest |q_c| * max scale_c: here 2 * 0.5.
    let mut qi = [0.0f32; 4];
    let s = segment_query(&[1.0, -0.5, 0.25, -2.0], &[1.0, 1.0, 1.0, 0.5], &mut qi);
    assert_eq!(s, 1.0 / 127.0);
    let mut q8 = [0i8; 4];
    round_query(&qi, &[1.0, 1.0, 1.0, 0.5], &mut q8);
    assert_eq!(q8, [127, -64, 32, -127]); // -63.5 and 31.75 round to even/nearest
    assert_eq!(segment_query(&[0.0; 4], &[1.0; 4], &mut qi), 0.0);
    round_query(&qi, &[1.0; 4], &mut q8);
    assert_eq!(q8, [0; 4]);
}

/// The ranged calls decode uses for one segment of a long head (weights and
/// scores indexed from the segment's start) agree bitwise across kernel sets
/// and with the whole-head scores of that segment.
#[test]
fn segment_ranges_agree_across_kernels() {
    let mut rng = StdRng::seed_from_u64(11);
    // A long head (4096-token segments) and a short one (2048, `seg_tokens`).
    for (bits, d, g, n, span) in [
        (2, 64, 3, 2 * SEG_TOKENS + 96, SEG_TOKENS..2 * SEG_TOKENS),
        (4, 64, 2, 2 * SEG_TOKENS + 96, SEG_TOKENS..2 * SEG_TOKENS),
        (2, 128, 4, 2 * SEG_TOKENS + 96, SEG_TOKENS..2 * SEG_TOKENS),
        (2, 64, 3, SHORT_HEAD, SHORT_SEG_TOKENS..2 * SHORT_SEG_TOKENS),
        (
            4,
            64,
            2,
            SEG_TOKENS + 96,
            SHORT_SEG_TOKENS..2 * SHORT_SEG_TOKENS,
        ),
    ] {
        let m = span.len();
        let keys = store(Axis::Channel, bits, 16, d, n, 5 + bits as u64);
        let q: Vec<f32> = (0..g * d).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let mut whole = vec![0.0f32; g * n];
        keys.scores_int8(Isa::Portable, &q, g, &mut whole, n);
        for isa in Isa::available() {
            let mut got = vec![0.0f32; g * m];
            let mut max = [f32::NAN; 8];
            // SAFETY: `got` holds `g` rows of `m`, the segment's tokens.
            unsafe {
                keys.scores_int8_range(
                    isa,
                    &q,
                    g,
                    got.as_mut_ptr(),
                    m,
                    span.start / 16,
                    span.end / 16,
                    span.start,
                    Some(&mut max),
                )
            };
            for j in 0..g {
                let w = &whole[j * n + span.start..j * n + span.end];
                // The maximum kept while scoring is the row's.
                let want = minikv_core::simd::max(w);
                assert!(
                    max[j] == want,
                    "{isa:?} max bits {bits} d {d}: {} vs {want}",
                    max[j]
                );
                assert!(
                    got[j * m..(j + 1) * m]
                        .iter()
                        .zip(w)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa:?} keys bits {bits} d {d}"
                );
            }
        }
        let values = store(Axis::Token, bits, 16, d, n, 9 + bits as u64);
        let p: Vec<f32> = (0..g * m)
            .map(|_| rng.random_range(0.0f32..1.0).powi(4))
            .collect();
        let mut want = vec![0.0f32; g * d];
        values.accumulate_int8_span(Isa::Portable, &p, g, m, &mut want, span.clone());
        for isa in Isa::available() {
            let mut got = vec![0.0f32; g * d];
            values.accumulate_int8_span(isa, &p, g, m, &mut got, span.clone());
            assert_eq!(
                bit_patterns(&got),
                bit_patterns(&want),
                "{isa:?} values bits {bits} d {d}"
            );
        }
        // Against the exact store with the weights spread over the head.
        let mut spread = vec![0.0f32; g * n];
        for j in 0..g {
            spread[j * n + span.start..j * n + span.end].copy_from_slice(&p[j * m..(j + 1) * m]);
        }
        let mut ex = vec![0.0f32; g * d];
        exact(&values).accumulate(&spread, g, n, &mut ex);
        let mass: f32 = p.iter().sum::<f32>() / g as f32;
        for (a, b) in want.iter().zip(&ex) {
            assert!((a - b).abs() <= 0.01 * mass, "{a} vs {b} (mass {mass})");
        }
    }
}
