//! Models with sliding-window layers: rings of the last `w` tokens next to
//! the config's cache for the global layers.

use minikv_core::{CacheBuilder, CacheConfig, ModelSpec, Phase};
use rand::{Rng, SeedableRng, rngs::StdRng};

const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 8;
const W: usize = 5;

fn spec() -> ModelSpec {
    ModelSpec {
        n_layers: 3,
        n_q_heads: HQ,
        n_kv_heads: HKV,
        head_dim: D,
        max_seq_len: 256,
        // Local, global, local.
        windows: vec![Some(W), None, Some(W)],
    }
}

/// Exact attention of one query (`[Hq][d]`) over rows `keys[h]` `[t][d]`.
fn attend(q: &[f32], keys: &[Vec<f32>], values: &[Vec<f32>]) -> Vec<f32> {
    let g = HQ / HKV;
    let mut out = vec![0.0f32; HQ * D];
    for h in 0..HQ {
        let (k, v) = (&keys[h / g], &values[h / g]);
        let t = k.len() / D;
        let s: Vec<f64> = (0..t)
            .map(|j| {
                (0..D)
                    .map(|c| q[h * D + c] as f64 * k[j * D + c] as f64)
                    .sum::<f64>()
                    / (D as f64).sqrt()
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
        for c in 0..D {
            let acc: f64 = (0..t).map(|j| (s[j] - m).exp() * v[j * D + c] as f64).sum();
            out[h * D + c] = (acc / z) as f32;
        }
    }
    out
}

fn f16r(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
}

/// Prefill in chunks then decode past the window: every output equals exact
/// attention over the last `w` tokens (windowed layers) or all of them
/// (global layer); stored rows are fp16 after prefill.
#[test]
fn windowed_layers_attend_over_their_window_and_hold_only_it() {
    let mut rng = StdRng::seed_from_u64(5);
    let mut cache = CacheBuilder::new(spec())
        .build(&CacheConfig::default())
        .unwrap();
    let kd = HKV * D;
    let qd = HQ * D;
    // Per layer, all rows so far (per KV head), as the cache should see them.
    let mut hist_k = vec![vec![Vec::<f32>::new(); HKV]; 3];
    let mut hist_v = vec![vec![Vec::<f32>::new(); HKV]; 3];
    let rand = |rng: &mut StdRng, n: usize| -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.5f32..1.5)).collect()
    };
    let mut pos = 0;
    for (step, n) in [7usize, 3, 1, 1, 1, 1, 1, 1, 1, 1].into_iter().enumerate() {
        if step == 2 {
            cache.end_prefill().unwrap();
            assert_eq!(cache.phase(), Phase::Decode);
            // From here on, stored rows are fp16.
            for l in 0..3 {
                for h in 0..HKV {
                    hist_k[l][h] = f16r(&hist_k[l][h]);
                    hist_v[l][h] = f16r(&hist_v[l][h]);
                }
            }
        }
        for l in 0..3 {
            let (k, v, q) = (
                rand(&mut rng, n * kd),
                rand(&mut rng, n * kd),
                rand(&mut rng, n * qd),
            );
            cache.append(l, &k, &v, n).unwrap();
            let mut out = vec![0.0; n * qd];
            cache.attend(l, &q, n, &mut out).unwrap();
            let decode = cache.phase() == Phase::Decode;
            for i in 0..n {
                for h in 0..HKV {
                    let (kr, vr) = (&k[(i * HKV + h) * D..][..D], &v[(i * HKV + h) * D..][..D]);
                    hist_k[l][h].extend(if decode { f16r(kr) } else { kr.to_vec() });
                    hist_v[l][h].extend(if decode { f16r(vr) } else { vr.to_vec() });
                }
                let p = pos + i + 1; // rows visible to query i: up to position pos + i
                let from = match spec().window(l) {
                    Some(w) => p.saturating_sub(w),
                    None => 0,
                };
                let keys: Vec<Vec<f32>> = (0..HKV)
                    .map(|h| hist_k[l][h][from * D..p * D].to_vec())
                    .collect();
                let vals: Vec<Vec<f32>> = (0..HKV)
                    .map(|h| hist_v[l][h][from * D..p * D].to_vec())
                    .collect();
                let want = attend(&q[i * qd..(i + 1) * qd], &keys, &vals);
                for (a, b) in out[i * qd..(i + 1) * qd].iter().zip(&want) {
                    assert!(
                        (a - b).abs() < 2e-3,
                        "layer {l} pos {} step {step}: {a} vs {b}",
                        pos + i
                    );
                }
            }
        }
        pos += n;
        assert_eq!(cache.seq_len(0), pos);
        let mem = cache.memory();
        for (l, lm) in mem.layers.iter().enumerate() {
            assert_eq!(lm.window, spec().window(l));
            if cache.phase() == Phase::Decode {
                let held = spec().window(l).map_or(pos, |w| pos.min(w));
                assert!(
                    lm.heads.iter().all(|h| h.tokens == held),
                    "layer {l}: {:?}",
                    lm.heads
                );
            }
        }
        if cache.phase() == Phase::Decode {
            // The uncompressed cache of this model: rings of W plus the global layer.
            assert_eq!(
                mem.full_fp16_bytes,
                2 * 2 * HKV * D * (pos + 2 * pos.min(W))
            );
            assert_eq!(mem.used_bytes(), mem.full_fp16_bytes);
        }
    }
    cache.reset().unwrap();
    assert_eq!(cache.seq_len(0), 0);
    assert_eq!(cache.phase(), Phase::Prefill);
}

#[test]
fn bad_window_specs_are_config_errors() {
    let mut s = spec();
    s.windows = vec![Some(W), None];
    let e = CacheBuilder::new(s)
        .build(&CacheConfig::default())
        .unwrap_err();
    assert!(e.to_string().contains("spec.windows"), "{e}");
    let mut s = spec();
    s.windows = vec![Some(0), None, None];
    let e = CacheBuilder::new(s)
        .build(&CacheConfig::default())
        .unwrap_err();
    assert!(e.to_string().contains("positive"), "{e}");
    // Every layer windowed: nothing to compress, and the full cache works.
    let mut s = spec();
    s.windows = vec![Some(W); 3];
    let mut c = CacheBuilder::new(s).build(&CacheConfig::default()).unwrap();
    c.append(0, &[0.5; 2 * HKV * D], &[0.5; 2 * HKV * D], 2)
        .unwrap();
    assert_eq!(c.seq_len(0), 2);
}
