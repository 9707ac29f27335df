//! Worked examples of docs/algorithms.md §3-§5 and invariants of budgets and selectors.

use minikv_core::attention::{AttentionBackend, PrefillArgs, TiledBackend};
use minikv_core::{
    BudgetRequest, CacheBuilder, KvCache, LayerBudget, ModelSpec, RunConfig, SelectionInput,
    SelectionPolicy, Selector,
};
use minikv_policies::budgets::budgets_from_statistics;
use minikv_policies::{AdaKv, PerLayer, Pyramid, PyramidKv, TopK, Uniform, VarInv, VarProp};
use minikv_quant as _;
use proptest::prelude::*;

fn req(n_layers: usize, t: usize, heavy: usize, recent: usize) -> BudgetRequest<'static> {
    BudgetRequest {
        n_layers,
        prompt_len: t,
        heavy,
        recent,
        sinks: 0,
        layers: &[],
    }
}

/// Budgets of a policy; var-prop and var-inv take the per-layer statistics
/// directly (their signal-view path is tested through a cache below).
fn budgets(
    p: &dyn SelectionPolicy,
    r: &BudgetRequest<'_>,
    stats: Option<&[f32]>,
) -> minikv_core::Result<Vec<LayerBudget>> {
    let name = serde_json::to_value(p).unwrap()["type"]
        .as_str()
        .unwrap()
        .to_string();
    match (name.as_str(), stats) {
        ("var_prop", Some(s)) => budgets_from_statistics(r, s, false, "var_prop"),
        ("var_inv", Some(s)) => budgets_from_statistics(r, s, true, "var_inv"),
        _ => p.layer_budgets(r),
    }
}

fn heavy(b: &[LayerBudget]) -> Vec<usize> {
    b.iter().map(|l| l.heavy).collect()
}

/// §4: A_cumul of the worked example and the kept set [0, 1, 3, 9, 10, 11].
#[test]
fn minikv_worked_example_keeps_the_documented_set() {
    let (t, d) = (12, 4);
    let q: Vec<f32> = (0..t)
        .flat_map(|i| (0..d).map(move |c| 2.0 * (1.0 + 0.7 * i as f32 + 1.3 * c as f32).sin()))
        .collect();
    let k: Vec<f32> = (0..t)
        .flat_map(|j| (0..d).map(move |c| 2.0 * (0.3 + 1.1 * j as f32 + 0.9 * c as f32).cos()))
        .collect();
    let mut out = vec![0.0; t * d];
    let mut cu = vec![0.0; t];
    TiledBackend::default()
        .prefill(PrefillArgs {
            n_q_heads: 1,
            head_dim: d,
            q: &q,
            n: t,
            keys: &[&k],
            values: &[&k],
            t,
            out: &mut out,
            cumulative: Some(&mut cu),
            window: None,
            history: None,
        })
        .unwrap();
    let mut kept = Vec::new();
    let budget = LayerBudget {
        heavy: 3,
        recent: 3,
    }; // floor(12 * 0.25) each
    TopK::default()
        .select(
            &SelectionInput {
                scores: &cu,
                n_heads: 1,
                t,
                budget,
                sinks: 0,
                layer: 0,
            },
            &mut kept,
        )
        .unwrap();
    assert_eq!(kept, vec![vec![0, 1, 3, 9, 10, 11]]);

    // The same through a whole cache built from config: 6 tokens stay.
    let spec = ModelSpec {
        n_layers: 1,
        n_q_heads: 1,
        n_kv_heads: 1,
        head_dim: d,
        max_seq_len: 64,
        windows: Vec::new(),
    };
    let cfg = RunConfig::parse(
        "[cache]\nheavy = 0.25\nrecent = 0.25\nscorer = { type = \"cumulative_attention\" }",
        false,
    )
    .unwrap();
    let mut cache = CacheBuilder::new(spec).build(&cfg.cache).unwrap();
    cache.append(0, &k, &k, t).unwrap();
    cache.attend(0, &q, t, &mut out).unwrap();
    cache.end_prefill().unwrap();
    assert_eq!(cache.memory().layers[0].heads[0].tokens, 6);
}

/// §5: MiniKV pyramid ratios for L = 32 and L = 4.
#[test]
fn pyramid_ratios() {
    let r = Pyramid::default().ratios(32, 0.25);
    for (i, want) in [(0, 0.4642857), (1, 0.4504608), (31, 0.0357143)] {
        assert!((r[i] - want).abs() < 1e-6, "layer {i}: {}", r[i]);
    }
    let r = Pyramid::default().ratios(4, 0.25);
    for (a, b) in r.iter().zip([0.4643, 0.3214, 0.1786, 0.0357]) {
        assert!((a - b).abs() < 1e-4);
    }
    assert!((r.iter().sum::<f64>() / 4.0 - 0.25).abs() < 1e-12);
    // Counts: total conserved exactly, lower layers get more.
    let b = heavy(
        &Pyramid::default()
            .layer_budgets(&req(32, 4096, 1024, 1024))
            .unwrap(),
    );
    assert_eq!(b.iter().sum::<usize>(), 32 * 1024);
    assert!(b.windows(2).all(|w| w[0] >= w[1]) && b[0] > b[31]);
}

/// §5: PyramidKV's integer schedule and its fallbacks.
#[test]
fn pyramidkv_capacities() {
    let p = PyramidKv::default();
    // C = 512, W = 8, L = 32, T = 4000: 983, 953, ..., 53; sum 16576 vs 16128.
    let b = heavy(&p.layer_budgets(&req(32, 4000, 504, 8)).unwrap());
    assert_eq!((b[0], b[1], b[31]), (983, 953, 53));
    assert_eq!(b.iter().sum::<usize>(), 16576);
    // T < C: nothing evicted.
    assert!(
        heavy(&p.layer_budgets(&req(32, 500, 504, 8)).unwrap())
            .iter()
            .all(|&h| h == 500)
    );
    // C <= T < 2(C - W): uniform C - W.
    assert!(
        heavy(&p.layer_budgets(&req(32, 1000, 504, 8)).unwrap())
            .iter()
            .all(|&h| h == 504)
    );
    // max clamped to T - W (C = 512, W = 64, T = 900): max = 836, min = 896 - 836 = 60.
    let b = heavy(&p.layer_budgets(&req(32, 900, 448, 64)).unwrap());
    assert_eq!((b[0], b[1]), (836, 836 - (836 - 60) / 31));
}

#[test]
fn var_policies_follow_the_statistic() {
    let stats = [1.0f32, 2.0, 4.0, 8.0];
    let p = heavy(&budgets(&VarProp::default(), &req(4, 1000, 150, 0), Some(&stats)).unwrap());
    let i = heavy(&budgets(&VarInv::default(), &req(4, 1000, 150, 0), Some(&stats)).unwrap());
    assert_eq!(p.iter().sum::<usize>(), 600);
    assert_eq!(i.iter().sum::<usize>(), 600);
    assert_eq!(p, vec![40, 80, 160, 320]);
    assert_eq!(i, vec![320, 160, 80, 40]);
    let e = VarProp::default()
        .layer_budgets(&req(4, 1000, 150, 0))
        .unwrap_err();
    assert!(e.to_string().contains("statistics"), "{e}");
}

#[test]
fn per_layer_list_is_checked_against_the_model() {
    let p = PerLayer {
        heavy: vec![0.5, 0.25],
        heavy_tokens: vec![],
    };
    assert_eq!(
        heavy(&p.layer_budgets(&req(2, 100, 0, 10)).unwrap()),
        vec![50, 25]
    );
    let e = p.layer_budgets(&req(3, 100, 0, 10)).unwrap_err();
    assert!(
        e.to_string().contains("lists 2 layers, the model has 3"),
        "{e}"
    );
}

fn policies() -> Vec<Box<dyn SelectionPolicy>> {
    vec![
        Box::new(Uniform::default()),
        Box::new(Pyramid::default()),
        Box::new(Pyramid { depth: 2.0 }),
        Box::new(VarProp::default()),
        Box::new(VarInv::default()),
    ]
}

proptest! {
    /// Budgets conserve the total (exactly, unless capped by the prompt), never
    /// exceed the prompt, and grow monotonically with the total.
    #[test]
    fn budgets_conserve_cap_and_are_monotone(
        l in 1usize..40, t in 1usize..5000, hr in 0.0f64..1.0, rr in 0.0f64..0.5,
        stats in prop::collection::vec(0.0f32..100.0, 40),
    ) {
        let (h, r) = ((t as f64 * hr) as usize, (t as f64 * rr) as usize);
        for p in policies() {
            let b = budgets(p.as_ref(), &req(l, t, h, r), Some(&stats[..l])).unwrap();
            let cap = t - r;
            let sum: usize = b.iter().map(|x| x.heavy).sum();
            prop_assert!(b.iter().all(|x| x.heavy <= cap && x.recent == r));
            prop_assert_eq!(sum, (l * h).min(l * cap), "{:?}", p);
            let b2 = budgets(p.as_ref(), &req(l, t, (h + 7).min(t), r), Some(&stats[..l])).unwrap();
            prop_assert!(b.iter().zip(&b2).all(|(a, c)| a.heavy <= c.heavy), "not monotone: {:?}", p);
        }
        // PyramidKV: documented floors make the total exceed L * (C - W) by < L(L-1)/2 + L.
        let b = PyramidKv::default().layer_budgets(&req(l, t, h, r)).unwrap();
        let sum: usize = b.iter().map(|x| x.heavy).sum();
        prop_assert!(sum <= l * t && sum + l >= (l * h).min(l * t.saturating_sub(r)));
        prop_assert!(sum <= l * h.max(t) + l * l);
    }

    /// Kept sets are sorted, unique, include sinks and the recent window, and have
    /// the budgeted size; Ada-KV spends the same layer total over ragged heads.
    #[test]
    fn selections_keep_protected_tokens(
        t in 1usize..300, hr in 0.0f64..1.0, rr in 0.0f64..0.5, sinks in 0usize..6, heads in 1usize..5,
        seed in prop::collection::vec(0.0f32..1.0, 1200),
    ) {
        let scores: Vec<f32> = (0..heads * t).map(|i| seed[i % seed.len()] + (i % 7) as f32).collect();
        let budget = LayerBudget { heavy: (t as f64 * hr) as usize, recent: (t as f64 * rr) as usize };
        let input = SelectionInput { scores: &scores, n_heads: heads, t, budget, sinks, layer: 0 };
        let keep_all = sinks + budget.heavy + budget.recent >= t;
        for sel in [Box::new(TopK::default()) as Box<dyn Selector>, Box::new(AdaKv::default())] {
            let mut out = Vec::new();
            sel.select(&input, &mut out).unwrap();
            prop_assert_eq!(out.len(), heads);
            let mut total = 0;
            for k in &out {
                prop_assert!(k.windows(2).all(|w| w[0] < w[1]));
                prop_assert!(k.last().is_none_or(|&p| (p as usize) < t));
                for p in (0..sinks.min(t)).chain(t - budget.recent..t) {
                    prop_assert!(k.contains(&(p as u32)), "missing protected {}", p);
                }
                total += k.len();
            }
            let want = if keep_all { heads * t } else { heads * (sinks + budget.heavy + budget.recent) };
            prop_assert_eq!(total, want);
        }
    }
}

fn tiny(spec: ModelSpec, toml: &str) -> Box<dyn KvCache> {
    let cfg = RunConfig::parse(toml, false).unwrap();
    CacheBuilder::new(spec).build(&cfg.cache).unwrap()
}

fn noise(n: usize, s: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            (((i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(s.wrapping_mul(97)))
                % 1000) as f32
                / 250.0
                - 2.0
        })
        .collect()
}

/// Prefills `t` noise tokens into every layer of `c`, then compresses.
fn prefill_noise(c: &mut dyn KvCache, t: usize) {
    let s = c.spec().clone();
    let (kv, qd) = (s.n_kv_heads * s.head_dim, s.n_q_heads * s.head_dim);
    let mut out = vec![0.0; t * qd];
    for l in 0..s.n_layers {
        c.append(l, &noise(t * kv, 1), &noise(t * kv, 2), t)
            .unwrap();
        c.attend(l, &noise(t * qd, 3), t, &mut out).unwrap();
    }
    c.end_prefill().unwrap();
}

/// Decode step `step` (noise) in every layer; returns the last layer's output.
fn decode_noise(c: &mut dyn KvCache, step: u32) -> Vec<f32> {
    let s = c.spec().clone();
    let (kv, qd) = (s.n_kv_heads * s.head_dim, s.n_q_heads * s.head_dim);
    let mut out = vec![0.0; qd];
    for l in 0..s.n_layers {
        c.append(l, &noise(kv, 10 + step), &noise(kv, 20 + step), 1)
            .unwrap();
        c.attend(l, &noise(qd, 30 + step), 1, &mut out).unwrap();
    }
    out
}

/// H2O holds exactly sinks + heavy + recent tokens after every decode step.
#[test]
fn h2o_holds_its_budget_while_decoding() {
    let spec = ModelSpec {
        n_layers: 2,
        n_q_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        max_seq_len: 256,
        windows: Vec::new(),
    };
    for scorer in ["h2o", "tova", "recency"] {
        let mut c = tiny(
            spec.clone(),
            &format!(
                "[cache]\nsinks = 1\nheavy_tokens = 4\nrecent_tokens = 3\ndecode = \"evict\"\nscorer = {{ type = \"{scorer}\" }}"
            ),
        );
        prefill_noise(c.as_mut(), 20);
        for step in 0..15 {
            decode_noise(c.as_mut(), step);
            for layer in &c.memory().layers {
                for h in &layer.heads {
                    assert_eq!(h.tokens, 8, "{scorer} after step {step}");
                }
            }
        }
    }
}

/// kvpress's decoding presses as `evict` targets: `target_tokens` brings
/// every head to that many rows at each eviction (`DecodingPress`),
/// `target_ratio` to `max(1, floor(seen · (1 - ratio)))`
/// (`CompressionRatioDecodingPress`); a `scorer` in the regime ranks the rows
/// while decoding in place of the config's (`PrefillDecodingPress`).
#[test]
fn evict_targets_and_decoding_scorer() {
    let spec = ModelSpec {
        n_layers: 1,
        n_q_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        max_seq_len: 256,
        windows: Vec::new(),
    };
    let held = |c: &dyn KvCache| -> Vec<usize> {
        c.memory().layers[0]
            .heads
            .iter()
            .map(|h| h.tokens)
            .collect()
    };
    let base = "[cache]\nheavy = 1.0\nscorer = { type = \"key_norm\" }\n";
    // 40 prompt tokens kept whole, then an eviction every 4 steps.
    for (target, want) in [
        ("target_tokens = 10", [10, 10]),
        ("target_ratio = 0.5", [22, 24]),
        ("target_ratio = 0.0", [44, 48]),
    ] {
        let mut c = tiny(
            spec.clone(),
            &format!("{base}decode = {{ type = \"evict\", every = 4, {target} }}"),
        );
        prefill_noise(c.as_mut(), 40);
        assert_eq!(held(c.as_ref()), [40, 40]);
        let mut at = Vec::new();
        for step in 0..8 {
            decode_noise(c.as_mut(), step);
            if step % 4 == 3 {
                at.push(held(c.as_ref())[0]);
            }
            assert!(held(c.as_ref()).iter().all(|&n| n == held(c.as_ref())[0]));
        }
        assert_eq!(at, want, "{target}");
    }
    // The regime's own scorer decides while decoding: key norm in the
    // regime over H2O's prompt selection gives key norm's outputs.
    let run = |text: &str| -> Vec<f32> {
        let mut c = tiny(spec.clone(), text);
        prefill_noise(c.as_mut(), 40);
        (0..12).map(|s| decode_noise(c.as_mut(), s)).last().unwrap()
    };
    let target = "every = 4, target_tokens = 12";
    let norm = run(&format!("{base}decode = {{ type = \"evict\", {target} }}"));
    let h2o = "[cache]\nheavy = 1.0\nscorer = { type = \"h2o\" }\n";
    let over_h2o = run(&format!(
        "{h2o}decode = {{ type = \"evict\", {target}, scorer = {{ type = \"key_norm\" }} }}"
    ));
    let plain_h2o = run(&format!("{h2o}decode = {{ type = \"evict\", {target} }}"));
    assert_eq!(norm, over_h2o);
    assert_ne!(norm, plain_h2o);
    // A target (or recent window) far beyond the context reserves at most
    // the context: the cache builds, decodes and stays small.
    for big in ["target_tokens = 4294967296", "target_tokens = 12"] {
        let text = format!(
            "[cache]\nheavy = 1.0\nrecent_tokens = 4294967296\nscorer = {{ type = \"key_norm\" }}\ndecode = {{ type = \"evict\", every = 4, {big} }}"
        );
        let mut c = tiny(spec.clone(), &text);
        prefill_noise(c.as_mut(), 40);
        decode_noise(c.as_mut(), 0);
        assert!(c.memory().total_bytes() < 1 << 20, "{big}");
        assert!(c.projected_kv_bytes(40, 8).unwrap() < 1 << 20, "{big}");
    }
    // Bad targets name their field.
    for (bad, field) in [
        ("target_tokens = 4, target_ratio = 0.5", "target_tokens"),
        ("target_ratio = 1.0", "target_ratio"),
        ("target_tokens = 0", "target_tokens"),
    ] {
        let cfg = RunConfig::parse(
            &format!("{base}decode = {{ type = \"evict\", {bad} }}"),
            false,
        )
        .unwrap();
        let e = cfg.validate(None).unwrap_err().to_string();
        assert!(e.contains(&format!("cache.decode.{field}")), "{bad}: {e}");
    }
}

/// Ada-KV stores ragged per-head lengths: memory really differs per head.
#[test]
fn ada_kv_heads_are_ragged_and_memory_shrinks() {
    let spec = ModelSpec {
        n_layers: 1,
        n_q_heads: 4,
        n_kv_heads: 4,
        head_dim: 8,
        max_seq_len: 256,
        windows: Vec::new(),
    };
    let mut c = tiny(
        spec,
        "[cache]\nheavy_tokens = 10\nrecent_tokens = 2\nscorer = { type = \"cumulative_attention\" }\nselector = { type = \"ada_kv\", alpha = 0.2 }",
    );
    let t = 64;
    // Head 0 attends sharply (large keys), the others diffusely.
    let k: Vec<f32> = noise(t * 32, 5)
        .iter()
        .enumerate()
        .map(|(i, x)| if (i / 8) % 4 == 0 { x * 6.0 } else { x * 0.1 })
        .collect();
    let mut out = vec![0.0; t * 32];
    c.append(0, &k, &noise(t * 32, 6), t).unwrap();
    c.attend(0, &noise(t * 32, 7), t, &mut out).unwrap();
    c.end_prefill().unwrap();
    let m = c.memory();
    let toks: Vec<usize> = m.layers[0].heads.iter().map(|h| h.tokens).collect();
    assert_eq!(toks.iter().sum::<usize>(), 4 * 12, "{toks:?}");
    assert!(
        toks.iter().any(|&x| x != 12),
        "heads should be ragged: {toks:?}"
    );
    let bytes: Vec<usize> = m.layers[0].heads.iter().map(|h| h.fp).collect();
    assert!(bytes.iter().min() < bytes.iter().max(), "{bytes:?}");
}

/// Runs a 1-layer prompt of `t` tokens plus 3 decode steps; returns the decode
/// outputs and the cache.
fn run_reskv(toml: &str, t: usize) -> (Vec<f32>, Box<dyn KvCache>) {
    let spec = ModelSpec {
        n_layers: 1,
        n_q_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        max_seq_len: 256,
        windows: Vec::new(),
    };
    let mut c = tiny(spec, toml);
    prefill_noise(c.as_mut(), t);
    let outs = (0..3)
        .flat_map(|step| decode_noise(c.as_mut(), step))
        .collect();
    (outs, c)
}

/// ResKV (§7): with r = 0 (ratio 0, or a proxy that never clears `delta`) it
/// is exactly plain selection; with r > 0 each head holds b - r exact tokens
/// plus r cluster entries whose counts cover every evicted token, the memory
/// report counts the cluster bytes, and the decode output changes.
#[test]
fn reskv_splits_the_budget_and_reduces_to_plain_selection_at_r0() {
    let base = "[cache]\nheavy_tokens = 12\nrecent_tokens = 4\nscorer = { type = \"snapkv\", window = 4, kernel = 3, pooling = \"max\" }\n";
    let t = 64;
    let (plain, _) = run_reskv(base, t);
    let (r0, c0) = run_reskv(
        &format!("{base}[cache.compensator]\ntype = \"reskv\"\nratio = 0.0\n"),
        t,
    );
    assert_eq!(plain, r0);
    assert!(c0.memory().layers[0].heads.iter().all(|h| h.clusters == 0));
    let (never, _) = run_reskv(
        &format!(
            "{base}[cache.compensator]\ntype = \"reskv\"\nselect = \"proxy\"\ndelta = 0.999\nheld_out = 4\n"
        ),
        t,
    );
    assert_eq!(plain, never, "a proxy that needs 99.9% gain keeps r = 0");
    let (with, c) = run_reskv(
        &format!("{base}[cache.compensator]\ntype = \"reskv\"\nratio = 0.25\n"),
        t,
    );
    assert_ne!(plain, with);
    assert!(with.iter().all(|x| x.is_finite()));
    let m = c.memory();
    for h in &m.layers[0].heads {
        // b = 16 slots: 12 exact tokens (+3 decoded) and 4 cluster entries.
        assert_eq!(h.tokens, 12 + 3);
        // fp16 mean key + mean value, f32 bias.
        assert_eq!(h.clusters, 4 * ((8 + 8) * 2 + 4));
    }
    let d = c.diagnostics();
    let st = &d["reskv"].values;
    assert_eq!(st["clusters"], 4.0);
    assert_eq!(st["evicted"], (t - 12) as f64);
    assert_eq!(d["reskv"].per_layer.len(), 1);
    for k in [
        "eta",
        "denominator_error",
        "numerator_error",
        "output_error",
    ] {
        assert!(st[k].is_finite(), "{k}: {d:?}");
    }
}

/// ResKV config errors name the field.
#[test]
fn reskv_config_errors() {
    for (toml, want) in [
        (
            "[cache.compensator]\ntype = \"reskv\"\nratio = 0.1\n",
            "cache.compensator",
        ),
        (
            "[cache]\nheavy = 0.2\nscorer = { type = \"h2o\" }\n[cache.compensator]\ntype = \"reskv\"\nratio = 1.2\n",
            "cache.compensator.ratio",
        ),
        (
            "[cache]\nheavy = 0.2\nscorer = { type = \"h2o\" }\n[cache.compensator]\ntype = \"reskv\"\nratoi = 0.1\n",
            "ratoi",
        ),
        (
            "[cache]\nheavy = 0.2\ndecode = \"evict\"\nscorer = { type = \"h2o\" }\n[cache.compensator]\ntype = \"reskv\"\n",
            "evict",
        ),
    ] {
        let err = RunConfig::parse(toml, false)
            .and_then(|mut c| {
                c.resolve()?;
                c.validate(None)
            })
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{toml}: {err}");
    }
}

/// Decode-time eviction over a scorer that has no decode rule of its own
/// (`key_norm`): every `every` steps the cache re-scores its rows with
/// the scorer and evicts down to the budget, sinks and recent window
/// protected. Every decode output equals attention over the rows an
/// independent simulation of that rule keeps (computed here in f64).
#[test]
fn decode_eviction_over_any_scorer_matches_a_simulation() {
    use half::f16;
    let (t, d, steps) = (24usize, 8usize, 12usize);
    let spec = ModelSpec {
        n_layers: 1,
        n_q_heads: 2,
        n_kv_heads: 1,
        head_dim: d,
        max_seq_len: 256,
        windows: Vec::new(),
    };
    let (sinks, heavy, recent) = (1usize, 5usize, 3usize);
    let keys = noise((t + steps) * d, 41);
    let vals = noise((t + steps) * d, 42);
    let qs = noise((t + steps) * 2 * d, 43);
    let r16 = |x: &[f32]| -> Vec<f64> { x.iter().map(|&v| f16::from_f32(v).to_f64()).collect() };
    let norm = |p: usize, round: bool| -> f32 {
        let k = &keys[p * d..(p + 1) * d];
        if round {
            -(r16(k).iter().map(|x| x * x).sum::<f64>() as f32).sqrt()
        } else {
            -k.iter().map(|x| x * x).sum::<f32>().sqrt()
        }
    };
    for every in [1usize, 4] {
        let mut c = tiny(
            spec.clone(),
            &format!(
                "[cache]\nsinks = {sinks}\nheavy_tokens = {heavy}\nrecent_tokens = {recent}\ndecode = {{ type = \"evict\", every = {every} }}\nscorer = {{ type = \"key_norm\" }}"
            ),
        );
        let mut out = vec![0.0; t * 2 * d];
        c.append(0, &keys[..t * d], &vals[..t * d], t).unwrap();
        c.attend(0, &qs[..t * 2 * d], t, &mut out).unwrap();
        c.end_prefill().unwrap();
        // Simulation: selection at the end of prefill on exact keys.
        let mut rest: Vec<usize> = (sinks..t - recent).collect();
        rest.sort_by(|&a, &b| norm(b, false).total_cmp(&norm(a, false)).then(a.cmp(&b)));
        let mut kept: Vec<usize> = (0..sinks).chain(t - recent..t).collect();
        kept.extend(&rest[..heavy]);
        let cap = kept.len();
        for i in 0..steps {
            let p = t + i;
            c.append(0, &keys[p * d..(p + 1) * d], &vals[p * d..(p + 1) * d], 1)
                .unwrap();
            let q = &qs[p * 2 * d..(p + 1) * 2 * d];
            c.attend(0, q, 1, &mut out[..2 * d]).unwrap();
            kept.push(p);
            // Attention over the simulated rows (fp16 as stored), per query head.
            for h in 0..2 {
                let qh = &q[h * d..(h + 1) * d];
                let logits: Vec<f64> = kept
                    .iter()
                    .map(|&r| {
                        let k = r16(&keys[r * d..(r + 1) * d]);
                        k.iter().zip(qh).map(|(a, &b)| a * b as f64).sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for ch in 0..d {
                    let o: f64 = kept
                        .iter()
                        .zip(&w)
                        .map(|(&r, wi)| wi * r16(&vals[r * d..(r + 1) * d])[ch])
                        .sum::<f64>()
                        / z;
                    let got = out[h * d + ch] as f64;
                    assert!(
                        (got - o).abs() < 1e-4,
                        "every {every}, step {i}, head {h}: {got} vs {o}"
                    );
                }
            }
            // Eviction when due: re-score (stored fp16 keys), drop the lowest.
            if (i + 1) % every == 0 {
                let recent_start = p + 1 - recent;
                while kept.len() > cap {
                    let v = kept
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| **r >= sinks && **r < recent_start)
                        .min_by(|a, b| {
                            norm(*a.1, true)
                                .total_cmp(&norm(*b.1, true))
                                .then(a.1.cmp(b.1))
                        })
                        .map(|(j, _)| j)
                        .unwrap();
                    kept.remove(v);
                }
            }
            let tokens = c.memory().layers[0].heads[0].tokens;
            assert_eq!(tokens, kept.len(), "every {every}, step {i}");
            assert!(tokens < cap + every);
        }
    }
}

/// Storage grows in pages: a full cache holds at most one page of slack per
/// store (K and V of each head), and the report gives used bytes beside it.
#[test]
fn full_cache_slack_is_under_one_page_per_store() {
    let spec = ModelSpec {
        n_layers: 2,
        n_q_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        max_seq_len: 1024,
        windows: Vec::new(),
    };
    for page in [16usize, 256] {
        let mut c = tiny(spec.clone(), &format!("[cache]\npage_tokens = {page}\n"));
        prefill_noise(c.as_mut(), 300);
        for step in 0..37 {
            decode_noise(c.as_mut(), step);
        }
        let m = c.memory();
        assert_eq!(m.used_bytes(), m.full_fp16_bytes);
        let row = 8 * 2; // fp16 bytes of one row of one store
        for h in m.layers.iter().flat_map(|l| &l.heads) {
            assert_eq!(h.used, 2 * 337 * row);
            assert!(
                h.fp >= h.used && h.fp - h.used < 2 * page * row,
                "{page}: {h:?}"
            );
            assert_eq!(h.fp, 2 * 337usize.div_ceil(page) * page * row);
        }
    }
}

/// KeyDiff on the §4 worked example's keys: scores equal an independent
/// plain-Python mirror (reference/keydiff_reference.py), and the kept set is
/// the three most distinctive keys before the recent window.
#[test]
fn keydiff_worked_example() {
    use minikv_core::{LayerSignals, TokenScorer};
    let (t, d) = (12usize, 4usize);
    let k: Vec<f32> = (0..t)
        .flat_map(|j| (0..d).map(move |c| 2.0 * (0.3 + 1.1 * j as f32 + 0.9 * c as f32).cos()))
        .collect();
    let spec = ModelSpec {
        n_layers: 1,
        n_q_heads: 1,
        n_kv_heads: 1,
        head_dim: d,
        max_seq_len: 64,
        windows: Vec::new(),
    };
    let mut out = vec![0.0f32; t];
    minikv_policies::KeyDiff::default()
        .score(
            &LayerSignals {
                spec: &spec,
                layer: 0,
                t,
                keys: &[&k],
                values: &[&k],
                cumulative: None,
                window_queries: None,
                window: 0,
                query_stats: None,
                output_projection: None,
                reconstruction: None,
                budget: None,
                rope: None,
            },
            &mut out,
        )
        .unwrap();
    let want = [
        -0.979568, -0.305550, 0.791308, 0.942478, 0.133095, -0.877053, -0.886213, 0.047585,
        0.939053, 0.809984, -0.228061, -0.978812,
    ];
    for (a, b) in out.iter().zip(want) {
        assert!((a - b).abs() < 1e-5, "{out:?}");
    }
    let mut c = tiny(
        spec,
        "[cache]\nheavy_tokens = 3\nrecent_tokens = 3\nscorer = { type = \"key_diff\" }",
    );
    let mut o = vec![0.0; t * d];
    c.append(0, &k, &k, t).unwrap();
    c.attend(0, &k, t, &mut o).unwrap();
    c.end_prefill().unwrap();
    // Kept: 2, 3, 8 (the largest scores of 0..9) and the window 9, 10, 11: six rows,
    // and decoding over them equals attention over exactly those rows.
    let q = [0.3f32, -0.7, 0.2, 0.9];
    c.append(0, &k[..d], &k[..d], 1).unwrap();
    c.attend(0, &q, 1, &mut o[..d]).unwrap();
    let rows = [2usize, 3, 8, 9, 10, 11, 0];
    let logits: Vec<f64> = rows
        .iter()
        .map(|&r| {
            let kr: f64 = (0..d)
                .map(|c| half::f16::from_f32(k[r * d + c]).to_f64() * q[c] as f64)
                .sum();
            kr / (d as f64).sqrt()
        })
        .collect();
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
    let z: f64 = w.iter().sum();
    for ch in 0..d {
        let e: f64 = rows
            .iter()
            .zip(&w)
            .map(|(&r, wi)| wi * half::f16::from_f32(k[r * d + ch]).to_f64())
            .sum::<f64>()
            / z;
        assert!(
            (o[ch] as f64 - e).abs() < 1e-4,
            "channel {ch}: {} vs {e}",
            o[ch]
        );
    }
}

/// A method composes with 2-bit storage and per-head (Ada-KV) budgets in one
/// config: heads keep ragged lengths whose total is the layer's budget, the
/// kept rows are stored in packed 2-bit codes, and decoding stays finite.
#[test]
fn keydiff_composes_with_2bit_and_adakv() {
    let spec = ModelSpec {
        n_layers: 2,
        n_q_heads: 4,
        n_kv_heads: 4,
        head_dim: 16,
        max_seq_len: 512,
        windows: Vec::new(),
    };
    let mut c = tiny(
        spec,
        "[cache]\nheavy_tokens = 64\nrecent_tokens = 16\nscorer = { type = \"key_diff\" }\nselector = { type = \"ada_kv\", alpha = 0.2 }\n[cache.quant]\nresidual = 32\nkeys = { type = \"minmax\", bits = 2, group = 16, axis = \"channel\" }\nvalues = { type = \"minmax\", bits = 2, group = 16, axis = \"token\" }\n",
    );
    let t = 256;
    // Head 0's keys cluster tightly (little diversity), the others spread.
    let k: Vec<f32> = noise(t * 64, 8)
        .iter()
        .enumerate()
        .map(|(i, x)| {
            if (i / 16) % 4 == 0 {
                1.0 + 0.01 * x
            } else {
                *x
            }
        })
        .collect();
    let mut out = vec![0.0; t * 64];
    for l in 0..2 {
        c.append(l, &k, &noise(t * 64, 9), t).unwrap();
        c.attend(l, &noise(t * 64, 10), t, &mut out).unwrap();
    }
    c.end_prefill().unwrap();
    let m = c.memory();
    for layer in &m.layers {
        let toks: Vec<usize> = layer.heads.iter().map(|h| h.tokens).collect();
        assert_eq!(toks.iter().sum::<usize>(), 4 * (64 + 16), "{toks:?}");
        assert!(toks.iter().any(|&n| n != toks[0]), "ragged heads: {toks:?}");
        assert!(
            layer
                .heads
                .iter()
                .all(|h| h.quant_codes > 0 && h.quant_keys > 0)
        );
    }
    for step in 0..40 {
        for l in 0..2 {
            c.append(l, &noise(64, 50 + step), &noise(64, 90 + step), 1)
                .unwrap();
            c.attend(l, &noise(64, 130 + step), 1, &mut out[..64])
                .unwrap();
            assert!(out[..64].iter().all(|x| x.is_finite()));
        }
    }
}

/// ChunkKV over key-norm scores on the §4 keys (reference/chunkkv_reference.py):
/// chunk sums -11.500776, -11.093541, -11.427111; a 4-token budget keeps the
/// whole middle chunk, tokens 4..8, whatever the per-token scores inside it.
#[test]
fn chunkkv_keeps_whole_chunks() {
    use minikv_core::{LayerSignals, TokenScorer};
    let (t, d) = (12usize, 4usize);
    let k: Vec<f32> = (0..t)
        .flat_map(|j| (0..d).map(move |c| 2.0 * (0.3 + 1.1 * j as f32 + 0.9 * c as f32).cos()))
        .collect();
    let spec = ModelSpec {
        n_layers: 1,
        n_q_heads: 1,
        n_kv_heads: 1,
        head_dim: d,
        max_seq_len: 64,
        windows: Vec::new(),
    };
    let s = minikv_policies::ChunkKv {
        chunk: 4,
        scorer: Box::new(minikv_policies::KeyNorm {}),
        ..Default::default()
    };
    let mut out = vec![0.0f32; t];
    let sig = LayerSignals {
        spec: &spec,
        layer: 0,
        t,
        keys: &[&k],
        values: &[&k],
        cumulative: None,
        window_queries: None,
        window: 0,
        query_stats: None,
        output_projection: None,
        reconstruction: None,
        budget: None,
        rope: None,
    };
    s.score(&sig, &mut out).unwrap();
    for (i, want) in [-11.500776f32, -11.093541, -11.427111].iter().enumerate() {
        for x in &out[i * 4..i * 4 + 4] {
            assert!((x - want).abs() < 1e-4, "{out:?}");
        }
    }
    let cfg = "[cache]\nheavy_tokens = 4\nrecent_tokens = 0\nscorer = { type = \"chunk_kv\", chunk = 4, scorer = { type = \"key_norm\" } }";
    let mut c = tiny(spec, cfg);
    let mut o = vec![0.0; t * d];
    c.append(0, &k, &k, t).unwrap();
    c.attend(0, &k, t, &mut o).unwrap();
    c.end_prefill().unwrap();
    assert_eq!(c.memory().layers[0].heads[0].tokens, 4);
    // The kept rows are 4..8: attention over them alone.
    let q = [0.5f32, 0.1, -0.4, 0.8];
    c.append(0, &k[..d], &k[..d], 1).unwrap();
    c.attend(0, &q, 1, &mut o[..d]).unwrap();
    let rows = [4usize, 5, 6, 7, 0];
    let h = |x: f32| half::f16::from_f32(x).to_f64();
    let w: Vec<f64> = rows
        .iter()
        .map(|&r| ((0..d).map(|c| h(k[r * d + c]) * q[c] as f64).sum::<f64>() / 2.0).exp())
        .collect();
    let z: f64 = w.iter().sum();
    for ch in 0..d {
        let e: f64 = rows
            .iter()
            .zip(&w)
            .map(|(&r, wi)| wi * h(k[r * d + ch]))
            .sum::<f64>()
            / z;
        assert!((o[ch] as f64 - e).abs() < 1e-4, "{} vs {e}", o[ch]);
    }
}
