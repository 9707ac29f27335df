//! Tiled attention against the exact reference; `A_cumul` against explicit sums.

use minikv_core::LogitGate;
use minikv_core::attention::{
    AttentionBackend, DecodeArgs, ExtraView, HeadView, PrefillArgs, ReferenceBackend, TiledBackend,
};
use minikv_core::storage::{Fp16Rows, FpStore};
use rand::{Rng, SeedableRng, rngs::StdRng};

fn rand_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
}

struct Case {
    hq: usize,
    hkv: usize,
    d: usize,
    n: usize,
    t: usize,
}

fn run(
    backend: &dyn AttentionBackend,
    c: &Case,
    q: &[f32],
    k: &[Vec<f32>],
    v: &[Vec<f32>],
    cumul: bool,
) -> (Vec<f32>, Vec<f32>) {
    run_window(backend, c, q, k, v, cumul, None)
}

fn run_window(
    backend: &dyn AttentionBackend,
    c: &Case,
    q: &[f32],
    k: &[Vec<f32>],
    v: &[Vec<f32>],
    cumul: bool,
    window: Option<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0.0; c.hq * c.n * c.d];
    let mut cu = vec![0.0; c.hq * c.t];
    let keys: Vec<&[f32]> = k.iter().map(|x| x.as_slice()).collect();
    let vals: Vec<&[f32]> = v.iter().map(|x| x.as_slice()).collect();
    backend
        .prefill(PrefillArgs {
            n_q_heads: c.hq,
            head_dim: c.d,
            q,
            n: c.n,
            keys: &keys,
            values: &vals,
            t: c.t,
            out: &mut out,
            cumulative: cumul.then_some(&mut cu[..]),
            window,
            history: None,
        })
        .unwrap();
    (out, cu)
}

fn rel_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * scale.max(y.abs()),
            "{what}[{i}]: {x} vs {y} (tol {tol})"
        );
    }
}

#[test]
fn tiled_equals_reference_on_random_shapes() {
    let mut rng = StdRng::seed_from_u64(7);
    let cases = [
        Case {
            hq: 9,
            hkv: 3,
            d: 64,
            n: 1,
            t: 1,
        }, // T = 1
        Case {
            hq: 4,
            hkv: 4,
            d: 32,
            n: 100,
            t: 100,
        }, // MHA, T not a multiple of 64
        Case {
            hq: 6,
            hkv: 2,
            d: 16,
            n: 130,
            t: 130,
        }, // GQA
        Case {
            hq: 9,
            hkv: 3,
            d: 64,
            n: 700,
            t: 700,
        }, // long T
        Case {
            hq: 4,
            hkv: 2,
            d: 8,
            n: 37,
            t: 200,
        }, // a chunk after a prefix
        Case {
            hq: 2,
            hkv: 1,
            d: 64,
            n: 1,
            t: 333,
        }, // one query over many keys
    ];
    for c in &cases {
        let q = rand_vec(&mut rng, c.hq * c.n * c.d, 2.0);
        let k: Vec<Vec<f32>> = (0..c.hkv)
            .map(|_| rand_vec(&mut rng, c.t * c.d, 2.0))
            .collect();
        let v: Vec<Vec<f32>> = (0..c.hkv)
            .map(|_| rand_vec(&mut rng, c.t * c.d, 1.0))
            .collect();
        let (ro, rc) = run(&ReferenceBackend, c, &q, &k, &v, true);
        for backend in [
            TiledBackend::default(),
            TiledBackend {
                block_q: 16,
                block_k: 48,
            },
        ] {
            let (to, tc) = run(&backend, c, &q, &k, &v, true);
            rel_close(&to, &ro, 1e-5, "out");
            rel_close(&tc, &rc, 1e-5, "cumul");
            let (to2, _) = run(&backend, c, &q, &k, &v, false);
            assert_eq!(
                to, to2,
                "output must not depend on whether A_cumul is requested"
            );
        }
    }
}

/// Sliding-window prefill: each query's output equals full attention over
/// exactly its last `w` keys (computed as a one-query prefill over that
/// slice), on the reference and the tiled backends, with `A_cumul`, for
/// windows smaller and larger than the tiles and chunks after a prefix.
#[test]
fn sliding_window_prefill_equals_attention_over_the_window() {
    let mut rng = StdRng::seed_from_u64(11);
    for (c, w) in [
        (
            Case {
                hq: 4,
                hkv: 1,
                d: 16,
                n: 150,
                t: 150,
            },
            7,
        ),
        (
            Case {
                hq: 4,
                hkv: 2,
                d: 8,
                n: 90,
                t: 300,
            },
            64,
        ),
        (
            Case {
                hq: 2,
                hkv: 1,
                d: 32,
                n: 200,
                t: 200,
            },
            129,
        ),
        (
            Case {
                hq: 2,
                hkv: 1,
                d: 8,
                n: 40,
                t: 40,
            },
            1000,
        ),
    ] {
        let q = rand_vec(&mut rng, c.hq * c.n * c.d, 2.0);
        let k: Vec<Vec<f32>> = (0..c.hkv)
            .map(|_| rand_vec(&mut rng, c.t * c.d, 2.0))
            .collect();
        let v: Vec<Vec<f32>> = (0..c.hkv)
            .map(|_| rand_vec(&mut rng, c.t * c.d, 1.0))
            .collect();
        // Expected: per query, a one-query prefill over its window's keys.
        let d = c.d;
        let mut want = vec![0.0f32; c.hq * c.n * d];
        let mut want_cu = vec![0.0f32; c.hq * c.t];
        for i in 0..c.n {
            let hi = c.t - c.n + i;
            let lo = (hi + 1).saturating_sub(w);
            let sub = Case {
                hq: c.hq,
                hkv: c.hkv,
                d,
                n: 1,
                t: hi + 1 - lo,
            };
            let qi: Vec<f32> = (0..c.hq)
                .flat_map(|h| q[(h * c.n + i) * d..(h * c.n + i + 1) * d].to_vec())
                .collect();
            let ks: Vec<Vec<f32>> = k.iter().map(|x| x[lo * d..(hi + 1) * d].to_vec()).collect();
            let vs: Vec<Vec<f32>> = v.iter().map(|x| x[lo * d..(hi + 1) * d].to_vec()).collect();
            let (o, cu) = run(&ReferenceBackend, &sub, &qi, &ks, &vs, true);
            for h in 0..c.hq {
                want[(h * c.n + i) * d..(h * c.n + i + 1) * d]
                    .copy_from_slice(&o[h * d..(h + 1) * d]);
                for j in 0..sub.t {
                    want_cu[h * c.t + lo + j] += cu[h * sub.t + j];
                }
            }
        }
        for backend in [
            &ReferenceBackend as &dyn AttentionBackend,
            &TiledBackend::default(),
            &TiledBackend {
                block_q: 16,
                block_k: 48,
            },
        ] {
            let (o, cu) = run_window(backend, &c, &q, &k, &v, true, Some(w));
            rel_close(&o, &want, 1e-5, "windowed out");
            rel_close(&cu, &want_cu, 1e-5, "windowed cumul");
        }
    }
}

/// `A_cumul` equals the column sums of the explicit causal softmax and sums to T.
#[test]
fn cumulative_attention_is_explicit_column_sums() {
    let mut rng = StdRng::seed_from_u64(3);
    let c = Case {
        hq: 4,
        hkv: 2,
        d: 16,
        n: 150,
        t: 150,
    };
    let q = rand_vec(&mut rng, c.hq * c.n * c.d, 3.0);
    let k: Vec<Vec<f32>> = (0..c.hkv)
        .map(|_| rand_vec(&mut rng, c.t * c.d, 3.0))
        .collect();
    let v = k.clone();
    let (_, cu) = run(&TiledBackend::default(), &c, &q, &k, &v, true);
    let d = c.d;
    for h in 0..c.hq {
        let kh = &k[h / 2];
        let mut explicit = vec![0.0f64; c.t];
        for i in 0..c.t {
            let qi = &q[(h * c.n + i) * d..(h * c.n + i + 1) * d];
            let s: Vec<f64> = (0..=i)
                .map(|j| {
                    qi.iter()
                        .zip(&kh[j * d..(j + 1) * d])
                        .map(|(a, b)| (*a as f64) * (*b as f64))
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for j in 0..=i {
                explicit[j] += (s[j] - m).exp() / z;
            }
        }
        let row = &cu[h * c.t..(h + 1) * c.t];
        for j in 0..c.t {
            assert!(
                (row[j] as f64 - explicit[j]).abs() < 1e-4 * explicit[j].max(1.0),
                "h{h} j{j}"
            );
        }
        let total: f64 = row.iter().map(|&x| x as f64).sum();
        assert!(
            (total - c.t as f64).abs() < 1e-3,
            "mass per head must be T, got {total}"
        );
    }
}

/// docs/algorithms.md §4 worked example.
#[test]
fn worked_example_section_4() {
    let (t, d) = (12, 4);
    let q: Vec<f32> = (0..t)
        .flat_map(|i| (0..d).map(move |c| 2.0 * (1.0 + 0.7 * i as f32 + 1.3 * c as f32).sin()))
        .collect();
    let k: Vec<f32> = (0..t)
        .flat_map(|j| (0..d).map(move |c| 2.0 * (0.3 + 1.1 * j as f32 + 0.9 * c as f32).cos()))
        .collect();
    let c = Case {
        hq: 1,
        hkv: 1,
        d,
        n: t,
        t,
    };
    let (_, cu) = run(
        &TiledBackend {
            block_q: 5,
            block_k: 5,
        },
        &c,
        &q,
        std::slice::from_ref(&k),
        std::slice::from_ref(&k),
        true,
    );
    let expected = [
        3.34844, 1.52279, 1.46448, 2.18724, 0.98198, 1.09805, 1.0605, 0.27813, 0.0182, 0.00165,
        0.00448, 0.03406,
    ];
    for (a, e) in cu.iter().zip(expected) {
        assert!((a - e).abs() < 6e-5, "{cu:?}");
    }
}

/// A gate for the test: `g = sigmoid(alpha (tau - s))`, `s` the largest
/// probability over the real tokens, computed in the precision asked.
#[derive(Debug)]
struct MaxProbGate {
    tau: f64,
    alpha: f64,
}

impl LogitGate for MaxProbGate {
    fn log_gate(&self, l: &[f32]) -> f32 {
        let v: Vec<f64> = l.iter().map(|&x| x as f64).collect();
        self.log_gate_f64(&v) as f32
    }
    fn log_gate_f64(&self, l: &[f64]) -> f64 {
        let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s = 1.0 / l.iter().map(|x| (x - m).exp()).sum::<f64>();
        (1.0 / (1.0 + (-self.alpha * (self.tau - s)).exp())).ln()
    }
}

/// Decode over fp16 rows plus extra entries (gated and not): tiled (fused)
/// equals reference (f64).
#[test]
fn decode_tiled_equals_reference_with_clusters() {
    let mut rng = StdRng::seed_from_u64(11);
    let (d, hs, g, n, nc) = (64, 3, 3, 77, 5);
    let mut fk: Vec<Fp16Rows> = Vec::new();
    let mut fv: Vec<Fp16Rows> = Vec::new();
    for _ in 0..hs {
        let mut a = Fp16Rows::new(d, 256);
        a.push(&rand_vec(&mut rng, n * d, 2.0));
        let mut b = Fp16Rows::new(d, 256);
        b.push(&rand_vec(&mut rng, n * d, 1.0));
        fk.push(a);
        fv.push(b);
    }
    let mut ck = Fp16Rows::new(d, 1);
    ck.push(&rand_vec(&mut rng, nc * d, 1.0));
    let mut cv = Fp16Rows::new(d, 1);
    cv.push(&rand_vec(&mut rng, nc * d, 1.0));
    let gate = MaxProbGate {
        tau: 0.25,
        alpha: 12.0,
    };
    let bias: Vec<f32> = (0..nc).map(|i| (i as f32 + 1.0).ln()).collect();
    let views: Vec<HeadView<'_>> = (0..hs)
        .map(|s| HeadView {
            quant_keys: None,
            quant_values: None,
            fp_keys: &fk[s],
            fp_values: &fv[s],
            extra: (s != 1).then_some(ExtraView {
                keys: &ck,
                values: &cv,
                bias: &bias,
                // Head 0 gated (a max-prob gate), head 2 not.
                gate: (s == 0).then_some(&gate as &dyn LogitGate),
            }),
        })
        .collect();
    let q = rand_vec(&mut rng, hs * g * d, 2.0);
    let mut outs = Vec::new();
    for b in [
        &ReferenceBackend as &dyn AttentionBackend,
        &TiledBackend::default(),
    ] {
        let mut out = vec![0.0; hs * g * d];
        let mut probs = vec![Vec::new(); hs * g];
        b.decode(DecodeArgs {
            q: &q,
            heads: &views,
            head_dim: d,
            out: &mut out,
            probs: Some(&mut probs),
        })
        .unwrap();
        outs.push((out, probs));
    }
    rel_close(&outs[1].0, &outs[0].0, 1e-5, "decode out");
    for (a, b) in outs[1].1.iter().zip(&outs[0].1) {
        rel_close(a, b, 1e-5, "decode probs");
    }
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let k = vec![0.0f32; 10 * 8];
    let mut out = vec![0.0; 4 * 8];
    let err = TiledBackend::default()
        .prefill(PrefillArgs {
            n_q_heads: 3,
            head_dim: 8,
            q: &[0.0; 24],
            n: 1,
            keys: &[&k, &k],
            values: &[&k, &k],
            t: 10,
            out: &mut out,
            cumulative: None,
            window: None,
            history: None,
        })
        .unwrap_err();
    assert!(err.to_string().contains("shape mismatch"), "{err}");
    // A head dimension of 0 is named, on both CPU backends.
    let backends: [&dyn AttentionBackend; 2] = [&TiledBackend::default(), &ReferenceBackend];
    for be in backends {
        let err = be
            .prefill(PrefillArgs {
                n_q_heads: 1,
                head_dim: 0,
                q: &[],
                n: 1,
                keys: &[&[]],
                values: &[&[]],
                t: 1,
                out: &mut [],
                cumulative: None,
                window: None,
                history: None,
            })
            .unwrap_err();
        assert!(err.to_string().contains("head_dim"), "{}: {err}", be.name());
    }
}

/// Split-K decode (long full-precision heads, ragged lengths, some shorter
/// than one block) equals the exact reference, with a block that a short
/// head leaves empty.
#[test]
fn split_decode_matches_reference_on_long_ragged_heads() {
    let mut rng = StdRng::seed_from_u64(77);
    let (g, d) = (3usize, 64usize);
    let lens = [5000usize, 2100, 700];
    let mut fk = Vec::new();
    let mut fv = Vec::new();
    for &n in &lens {
        let mut k = Fp16Rows::new(d, 256);
        let mut v = Fp16Rows::new(d, 256);
        k.push(&rand_vec(&mut rng, n * d, 2.0));
        v.push(&rand_vec(&mut rng, n * d, 1.0));
        fk.push(k);
        fv.push(v);
    }
    let views: Vec<HeadView<'_>> = (0..lens.len())
        .map(|s| HeadView {
            quant_keys: None,
            quant_values: None,
            fp_keys: &fk[s],
            fp_values: &fv[s],
            extra: None,
        })
        .collect();
    let q = rand_vec(&mut rng, lens.len() * g * d, 2.0);
    let mut outs = Vec::new();
    for b in [
        &ReferenceBackend as &dyn AttentionBackend,
        &TiledBackend::default(),
    ] {
        let mut out = vec![0.0; lens.len() * g * d];
        b.decode(DecodeArgs {
            q: &q,
            heads: &views,
            head_dim: d,
            out: &mut out,
            probs: None,
        })
        .unwrap();
        outs.push(out);
    }
    rel_close(&outs[1], &outs[0], 1e-5, "split decode out");
}
