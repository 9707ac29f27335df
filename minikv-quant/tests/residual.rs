//! The streaming residual follows docs/algorithms.md §2 exactly, in both semantics.

use minikv_core::{CacheBuilder, KvCache, ModelSpec, RunConfig};
use minikv_quant as _;
use proptest::prelude::*;

fn cache(r: usize, g: usize, mode: &str) -> Box<dyn KvCache> {
    let spec = ModelSpec {
        n_layers: 1,
        n_q_heads: 2,
        n_kv_heads: 1,
        head_dim: 16,
        max_seq_len: 512,
        windows: Vec::new(),
    };
    let cfg = RunConfig::parse(
        &format!(
            "[cache.quant]\nresidual = {r}\nresidual_mode = \"{mode}\"\nkeys = {{ type = \"minmax\", bits = 2, group = {g}, axis = \"channel\" }}\nvalues = {{ type = \"minmax\", bits = 2, group = 16, axis = \"token\" }}"
        ),
        false,
    )
    .unwrap();
    CacheBuilder::new(spec).build(&cfg.cache).unwrap()
}

fn rows(n: usize, s: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 31 + s * 17) % 23) as f32 / 7.0 - 1.5)
        .collect()
}

/// (quantized keys, quantized values) after prefill of `t` tokens, from the table.
#[allow(clippy::implicit_saturating_sub)] // written as the table reads
fn after_prefill(t: usize, r: usize, g: usize, mode: &str) -> (usize, usize) {
    match mode {
        "kivi" => (t - t % r, if t <= r { 0 } else { t - r }),
        _ => (t - t % g, t - t % g),
    }
}

/// Runs `t` prefill tokens then `steps` decode steps; checks every step
/// against an independent model of the §2 table.
fn check(t: usize, r: usize, g: usize, steps: usize, mode: &str) {
    let mut c = cache(r, g, mode);
    let mut out = vec![0.0; t * 32];
    c.append(0, &rows(t * 16, 1), &rows(t * 16, 2), t).unwrap();
    c.attend(0, &rows(t * 32, 3), t, &mut out).unwrap();
    c.end_prefill().unwrap();
    let (mut qk, mut qv) = after_prefill(t, r, g, mode);
    let head = |c: &dyn KvCache| {
        let h = c.memory().layers[0].heads[0];
        (h.quant_keys, h.quant_values)
    };
    assert_eq!(
        head(c.as_ref()),
        (qk, qv),
        "{mode} after prefill T={t} R={r} G={g}"
    );
    for s in 0..steps {
        let n = t + s + 1; // tokens after this step's append
        c.append(0, &rows(16, 10 + s), &rows(16, 20 + s), 1)
            .unwrap();
        if mode == "minikv" {
            // Flush when the residual reaches R, before attention.
            if n - qk == r {
                qk = n;
            }
            if n - qv == r {
                qv = n;
            }
            assert_eq!(
                head(c.as_ref()),
                (qk, qv),
                "minikv before attention, step {s}"
            );
        }
        c.attend(0, &rows(32, 30 + s), 1, &mut out[..32]).unwrap();
        if mode == "kivi" {
            // Keys: flush all R after attention; values: slide, exactly R full.
            if n - qk == r {
                qk = n;
            }
            if n - qv > r {
                qv = n - r;
            }
        }
        assert_eq!(
            head(c.as_ref()),
            (qk, qv),
            "{mode} after step {s} (t = {n})"
        );
    }
}

#[test]
fn worked_example_t11_r4_g2() {
    // KIVI: prefill quantizes 8 keys (3 full) and 7 values (4 full).
    assert_eq!(after_prefill(11, 4, 2, "kivi"), (8, 7));
    check(11, 4, 2, 8, "kivi");
    // MiniKV: 10 and 10 (1 full each), flushes at positions 13 and 17.
    let mut c = cache(4, 2, "minikv");
    let mut out = vec![0.0; 11 * 32];
    c.append(0, &rows(176, 1), &rows(176, 2), 11).unwrap();
    c.attend(0, &rows(352, 3), 11, &mut out).unwrap();
    c.end_prefill().unwrap();
    let mut flushed_at = Vec::new();
    let mut last = c.memory().layers[0].heads[0].quant_keys;
    assert_eq!(last, 10);
    for pos in 11..19 {
        c.append(0, &rows(16, pos), &rows(16, pos + 1), 1).unwrap();
        c.attend(0, &rows(32, pos), 1, &mut out[..32]).unwrap();
        let q = c.memory().layers[0].heads[0].quant_keys;
        if q != last {
            flushed_at.push(pos);
            last = q;
        }
    }
    assert_eq!(flushed_at, vec![13, 17]);
}

proptest! {
    #[test]
    fn residual_bookkeeping_matches_the_table(
        t in 1usize..80, rg in prop::sample::select(vec![(4usize, 2usize), (8, 4), (16, 16), (32, 16), (12, 4)]),
        steps in 0usize..40, kivi in any::<bool>(),
    ) {
        let (r, g) = rg;
        check(t, r, g, steps, if kivi { "kivi" } else { "minikv" });
    }
}
