//! Tests of the 512-bit exact loops (`x86_512/`).

use crate::ScaleDtype;
use crate::int8::tests::{exact, store_as};
use crate::store::{MinMaxStore, banks};
use minikv_core::Axis;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// An exact store of `n` random rows.
fn store(axis: Axis, bits: u32, group: usize, d: usize, n: usize, f16: bool) -> MinMaxStore {
    let dtype = if f16 {
        ScaleDtype::F16
    } else {
        ScaleDtype::F32
    };
    let seed = (bits as u64) << 32 | (d * 1000 + n) as u64;
    exact(&store_as(axis, bits, group, d, n, seed, dtype))
}

/// The 512-bit loops give bitwise the AVX2 (or portable) results: query
/// heads 1-8, 2- and 4-bit codes, groups of 16-64, head sizes 16-128
/// (vector counts that leave partial chunks), f16 and f32 scales, token
/// counts around the tile and bank boundaries.
#[test]
fn exact_512_matches_the_256_bit_loops_bitwise() {
    let mut rng = StdRng::seed_from_u64(5);
    macro_rules! case {
        ($p:literal, $ng:literal) => {{
            let bits = 32 / $p;
            for (group, d, n) in [
                (16, 64, 16),
                (16, 64, 1040),
                (32, 48, 480),
                (64, 128, 256),
                (16, 16, 2400),
                (16, 64, 4096),
            ] {
                for f16 in [true, false] {
                    let q: Vec<f32> = (0..$ng * d)
                        .map(|_| rng.random_range(-2.0f32..2.0))
                        .collect();
                    let k = store(Axis::Channel, bits, group, d, n, f16);
                    let stride = n + 5;
                    let (mut a, mut b) = (vec![0.5f32; $ng * stride], vec![0.5f32; $ng * stride]);
                    k.scores_channel_fast::<$p, $ng, { banks($p, $ng) }>(&q, &mut a, stride);
                    k.scores_channel_256::<$p, $ng, { banks($p, $ng) }>(&q, &mut b, stride);
                    assert_eq!(a, b, "keys P={} NG={} G={group} d={d} n={n}", $p, $ng);
                    for m in [1, 7, 239, 240, 241, n + 3] {
                        let vg = if d % group == 0 { group } else { 16 };
                        let v = store(Axis::Token, bits, vg, d, m, f16);
                        let p: Vec<f32> = (0..$ng * (m + 2))
                            .map(|_| rng.random_range(0.0f32..1.0))
                            .collect();
                        let (mut a, mut b) = (vec![0.25f32; $ng * d], vec![0.25f32; $ng * d]);
                        v.accumulate_token_fast::<$p, $ng, { banks($p, $ng) }>(&p, m + 2, &mut a);
                        v.accumulate_token_256::<$p, $ng, { banks($p, $ng) }>(&p, m + 2, &mut b);
                        assert_eq!(a, b, "values P={} NG={} G={group} d={d} n={m}", $p, $ng);
                    }
                }
            }
        }};
    }
    case!(16, 1);
    case!(16, 3);
    case!(16, 4);
    case!(16, 8);
    case!(8, 1);
    case!(8, 2);
    case!(8, 3);
    case!(8, 6);
    case!(8, 8);
}

/// The spans and column tasks give the same bits on 1 and 3 threads (a
/// head long enough to be cut: 8192 tokens, two value tasks, 8 key spans).
#[test]
fn exact_512_is_thread_count_independent() {
    let (d, n) = (64, 8192);
    let mut rng = StdRng::seed_from_u64(9);
    let q: Vec<f32> = (0..3 * d).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    let p: Vec<f32> = (0..3 * n).map(|_| rng.random_range(0.0f32..1.0)).collect();
    let k = store(Axis::Channel, 2, 16, d, n, true);
    let v = store(Axis::Token, 4, 16, d, n, true);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let (mut s, mut o) = (vec![0.0f32; 3 * n], vec![0.0f32; 3 * d]);
            k.scores_channel_fast::<16, 3, { banks(16, 3) }>(&q, &mut s, n);
            v.accumulate_token_fast::<8, 3, { banks(8, 3) }>(&p, n, &mut o);
            (s, o)
        })
    };
    assert_eq!(run(1), run(3));
}
