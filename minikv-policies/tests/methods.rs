//! Worked examples of the kvpress / KVCache-Factory methods (Expected
//! Attention, CriticalKV, LagKV, CaM merge, kvpress's PyramidKV schedule)
//! against the independent plain-Python mirror
//! `reference/kvpress_methods_reference.py`, their protected tokens, and their
//! composition with 2-bit storage and Ada-KV.

#![allow(clippy::excessive_precision)]
use minikv_core::compensate::{CompensateInput, Compensator};
use minikv_core::{
    BudgetRequest, CacheBuilder, KvCache, LayerSignals, ModelSpec, Observation, QueryStats, Rope,
    RopePairs, RunConfig, SelectionPolicy, TokenScorer,
};
use minikv_policies::{CamMerge, CriticalKv, ExpectedAttention, KeyNorm, LagKv, PyramidKvPress};
use minikv_quant as _;
use proptest::prelude::*;

const T: usize = 12;
const D: usize = 4;
const HQ: usize = 2;

fn keys() -> Vec<f32> {
    (0..T)
        .flat_map(|j| (0..D).map(move |c| 2.0 * (0.3 + 1.1 * j as f32 + 0.9 * c as f32).cos()))
        .collect()
}
fn values() -> Vec<f32> {
    (0..T)
        .flat_map(|j| (0..D).map(move |c| (0.2 + 0.7 * j as f32 - 0.4 * c as f32).cos()))
        .collect()
}
/// Pre-RoPE queries, token-major `[T][HQ * D]`.
fn queries() -> Vec<f32> {
    (0..T)
        .flat_map(|i| {
            (0..HQ).flat_map(move |h| {
                (0..D).map(move |c| {
                    2.0 * (1.0 + 0.7 * i as f32 + 1.3 * c as f32 + 0.5 * h as f32).sin()
                })
            })
        })
        .collect()
}
fn rope() -> Rope {
    Rope {
        inv_freq: (0..D / 2)
            .map(|i| 100f64.powf(-2.0 * i as f64 / D as f64))
            .collect(),
        pairs: RopePairs::Adjacent,
    }
}
fn spec(layers: usize, hq: usize, hkv: usize, d: usize) -> ModelSpec {
    ModelSpec {
        n_layers: layers,
        n_q_heads: hq,
        n_kv_heads: hkv,
        head_dim: d,
        max_seq_len: 1024,
        windows: Vec::new(),
    }
}
fn signals<'a>(s: &'a ModelSpec, k: &'a [&'a [f32]], v: &'a [&'a [f32]]) -> LayerSignals<'a> {
    LayerSignals {
        spec: s,
        layer: 0,
        t: k[0].len() / s.head_dim,
        keys: k,
        values: v,
        cumulative: None,
        window_queries: None,
        window: 0,
        query_stats: None,
        output_projection: None,
        reconstruction: None,
        budget: None,
        rope: None,
    }
}
fn close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len());
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!((a - b).abs() < tol, "index {i}: {a} vs {b}\n{got:?}");
    }
}

/// Expected Attention, n_sink 2, 8 future positions: per-head scores of the
/// mirror (statistics computed here in f64, independently of the cache).
#[test]
fn expected_attention_worked_example() {
    let s = spec(1, HQ, 1, D);
    let (k, v, q) = (keys(), values(), queries());
    let n_sink = 2;
    let n = (T - n_sink) as f64;
    let mut mean = vec![0.0f64; HQ * D];
    let mut cov = vec![0.0f64; HQ * D * D];
    for h in 0..HQ {
        let row = |i: usize, c: usize| q[(i * HQ + h) * D + c] as f64;
        for c in 0..D {
            mean[h * D + c] = (n_sink..T).map(|i| row(i, c)).sum::<f64>() / n;
        }
        for a in 0..D {
            for b in 0..D {
                cov[(h * D + a) * D + b] = (n_sink..T)
                    .map(|i| (row(i, a) - mean[h * D + a]) * (row(i, b) - mean[h * D + b]))
                    .sum::<f64>()
                    / n;
            }
        }
    }
    let r = rope();
    let (kk, vv) = ([&k[..]], [&v[..]]);
    let mut sig = signals(&s, &kk, &vv);
    sig.query_stats = Some(QueryStats {
        n: T - n_sink,
        mean: &mean,
        cov: &cov,
        rope: &r,
    });
    let ea = ExpectedAttention {
        n_future_positions: 8,
        n_sink,
        ..Default::default()
    };
    let mut out = vec![0.0f32; HQ * T];
    ea.score(&sig, &mut out).unwrap();
    let want = [
        1.239843, 1.239843, 0.088136, 0.084837, 0.144565, 0.160685, 0.239843, 0.101608, 0.081912,
        0.184238, 0.156003, 0.123131, 1.239843, 1.239843, 0.093360, 0.083532, 0.147411, 0.140426,
        0.239322, 0.120375, 0.082421, 0.185850, 0.153121, 0.106915,
    ];
    close(&out, &want, 2e-5);
    // Without statistics (decode-time re-scoring) the scorer says what is missing.
    let err = ea.score(&signals(&s, &kk, &vv), &mut out).unwrap_err();
    assert!(
        err.to_string().contains("pre-RoPE query statistics"),
        "{err}"
    );
}

/// Decodes one query over `c` and checks the output equals exact attention
/// over exactly the prompt rows `rows` plus the appended row 0 of `k`/`v`
/// (fp16-rounded): the kept set, seen from outside.
fn assert_kept(c: &mut dyn KvCache, rows: &[usize], k: &[f32], v: &[f32], hq: usize) {
    let all: Vec<usize> = (0..c.spec().head_dim).collect();
    assert_kept_channels(c, rows, &all, k, v, hq);
}

/// As [`assert_kept`], with the dot products over key channels `ch` only.
fn assert_kept_channels(
    c: &mut dyn KvCache,
    rows: &[usize],
    ch: &[usize],
    k: &[f32],
    v: &[f32],
    hq: usize,
) {
    let d = c.spec().head_dim;
    let q: Vec<f32> = (0..hq * d).map(|i| 0.3 - 0.17 * i as f32).collect();
    assert_kept_for(c, rows, ch, ch, k, v, &q);
}

/// As [`assert_kept_channels`], for the decode query `q` (`[hq][d]`), the
/// appended row's key read over channels `new_ch`.
fn assert_kept_for(
    c: &mut dyn KvCache,
    rows: &[usize],
    ch: &[usize],
    new_ch: &[usize],
    k: &[f32],
    v: &[f32],
    q: &[f32],
) {
    let d = c.spec().head_dim;
    let hq = q.len() / d;
    let mut o = vec![0.0f32; hq * d];
    c.append(0, &k[..d], &v[..d], 1).unwrap();
    c.attend(0, q, 1, &mut o).unwrap();
    let all: Vec<usize> = rows.iter().copied().chain([0]).collect();
    let f = |x: f32| half::f16::from_f32(x).to_f64();
    for h in 0..hq {
        let qh = &q[h * d..(h + 1) * d];
        let logits: Vec<f64> = all
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                let ch = if i == rows.len() { new_ch } else { ch };
                ch.iter()
                    .map(|&x| f(k[r * d + x]) * qh[x] as f64)
                    .sum::<f64>()
                    / (d as f64).sqrt()
            })
            .collect();
        let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
        let z: f64 = w.iter().sum();
        for x in 0..d {
            let e: f64 = all
                .iter()
                .zip(&w)
                .map(|(&r, wi)| wi * f(v[r * d + x]))
                .sum::<f64>()
                / z;
            assert!(
                (o[h * d + x] as f64 - e).abs() < 1e-4,
                "head {h} ch {x}: {} vs {e}",
                o[h * d + x]
            );
        }
    }
}

/// Through a cache: the model hands the pre-RoPE queries (in two chunks) and
/// its RoPE; the cache's statistics give the mirror's kept set
/// [0, 1, 5, 6] + the window [9, 10, 11].
#[test]
fn expected_attention_through_the_cache() {
    let s = spec(1, HQ, 1, D);
    let (k, v, q) = (keys(), values(), queries());
    let cfg = RunConfig::parse(
        "[cache]\nheavy_tokens = 4\nrecent_tokens = 3\nscorer = { type = \"expected_attention\", n_sink = 2, n_future_positions = 8 }",
        false,
    )
    .unwrap();
    let mut c = CacheBuilder::new(s).build(&cfg.cache).unwrap();
    assert!(c.wants(0).pre_rope_queries && !c.wants(0).output_projection);
    let r = rope();
    let mut o = vec![0.0f32; T * HQ * D];
    for (a, b) in [(0usize, 5usize), (5, T)] {
        let n = b - a;
        let qs = &q[a * HQ * D..b * HQ * D];
        c.observe(0, Observation::PreRopeQueries { q: qs, n, rope: &r })
            .unwrap();
        c.append(0, &k[a * D..b * D], &v[a * D..b * D], n).unwrap();
        c.attend(0, qs, n, &mut o[..n * HQ * D]).unwrap();
    }
    c.end_prefill().unwrap();
    assert!(!c.wants(0).pre_rope_queries, "nothing wanted after prefill");
    assert_kept(c.as_mut(), &[0, 1, 5, 6, 9, 10, 11], &k, &v, HQ);
}

/// ThinK, window 3, ratio 0.5, alone (every token kept): channels [0, 2]
/// are stored (the mirror's), decoding equals attention with keys cut to
/// them, and the key store holds half the bytes of the value store.
#[test]
fn think_worked_example() {
    let s = spec(1, HQ, 1, D);
    let (k, v, q) = (keys(), values(), queries());
    let all: Vec<usize> = (0..T).collect();
    let every: Vec<usize> = (0..D).collect();
    // Default: the decoded key keeps every channel (a full-width store
    // beside the pruned one); `prune_appended`: it is pruned too.
    for prune in [false, true] {
        let cfg = RunConfig::parse(
            &format!(
                "[cache.channels]\ntype = \"think\"\nratio = 0.5\nwindow = 3\nprune_appended = {prune}"
            ),
            false,
        )
        .unwrap();
        let mut c = CacheBuilder::new(s.clone()).build(&cfg.cache).unwrap();
        let mut o = vec![0.0f32; T * HQ * D];
        c.append(0, &k, &v, T).unwrap();
        c.attend(0, &q, T, &mut o).unwrap();
        c.end_prefill().unwrap();
        let new_ch: &[usize] = if prune { &[0, 2] } else { &every };
        let dq: Vec<f32> = (0..HQ * D).map(|i| 0.3 - 0.17 * i as f32).collect();
        assert_kept_for(c.as_mut(), &all, &[0, 2], new_ch, &k, &v, &dq);
        let m = c.memory().layers[0].heads[0];
        assert_eq!(m.tokens, T + 1);
        // Keys: 12 prompt rows x 2 channels x 2 bytes + 2 channel indices,
        // the decoded row x (2 or 4 channels) x 2 bytes; values 13 x 4 x 2.
        let new_row = if prune { 2 * 2 } else { 4 * 2 };
        assert_eq!(
            m.used,
            12 * 2 * 2 + 2 * 2 + new_row + 13 * 4 * 2,
            "prune {prune}"
        );
    }
    // After a token selection the key statistic covers the stored keys
    // only (kvpress's ComposedPress hands ThinK what the token press left):
    // key norm keeps the 6 smallest-norm rows 1 2 4 5 7 10, over which the
    // channel scores are 2.662923 3.669356 6.934291 1.186092 (the mirror):
    // channels 1 and 2, where all 12 rows would give 0 and 2.
    let cfg = RunConfig::parse(
        "[cache]\nheavy_tokens = 6\nrecent_tokens = 0\nscorer = { type = \"key_norm\" }\n[cache.channels]\ntype = \"think\"\nratio = 0.5\nwindow = 3",
        false,
    )
    .unwrap();
    let mut c = CacheBuilder::new(s).build(&cfg.cache).unwrap();
    let mut o = vec![0.0f32; T * HQ * D];
    c.append(0, &k, &v, T).unwrap();
    c.attend(0, &q, T, &mut o).unwrap();
    c.end_prefill().unwrap();
    let dq: Vec<f32> = (0..HQ * D).map(|i| 0.3 - 0.17 * i as f32).collect();
    assert_kept_for(
        c.as_mut(),
        &[1, 2, 4, 5, 7, 10],
        &[1, 2],
        &every,
        &k,
        &v,
        &dq,
    );
}

/// Quest, pages of 4, budget 8 rows, every token stored: after the decode
/// row is appended (13 rows, pages 0-3, 4-7, 8-11, 12), the newest page and
/// the one page with the highest bound (page 0, bounds 4.944746 / 4.155117 /
/// 3.241712 in the mirror) are read, and attention equals attention over
/// exactly rows 0-3 and the new row; 208 bytes read (5 rows x 16 B + bounds
/// 4 pages x 2 x 16 B) against 13 rows stored.
#[test]
fn quest_worked_example() {
    let s = spec(1, HQ, 1, D);
    let (k, v, q) = (keys(), values(), queries());
    let cfg = RunConfig::parse("[cache.quest]\npage_size = 4\ntoken_budget = 8", false).unwrap();
    let mut c = CacheBuilder::new(s.clone()).build(&cfg.cache).unwrap();
    let mut o = vec![0.0f32; T * HQ * D];
    c.append(0, &k, &v, T).unwrap();
    c.attend(0, &q, T, &mut o).unwrap();
    c.end_prefill().unwrap();
    assert_kept(c.as_mut(), &[0, 1, 2, 3], &k, &v, HQ);
    assert_eq!(c.memory().layers[0].heads[0].tokens, T + 1);
    let diag = c.diagnostics();
    assert_eq!(diag["quest"].values["decode_steps"], 1.0);
    assert_eq!(diag["quest"].values["bytes_read_per_token"], 208.0);
    // Quantized storage or decode-time eviction with Quest: a clear error.
    for extra in [
        "[cache.quant]\nkeys = { type = \"minmax\", bits = 2, group = 4, axis = \"channel\" }",
        "[cache]\nheavy_tokens = 4\ndecode = \"evict\"\nscorer = { type = \"h2o\" }",
    ] {
        let e = RunConfig::parse(
            &format!("{extra}\n[cache.pages]\npage_size = 4\ntoken_budget = 8"),
            false,
        )
        .and_then(|c| CacheBuilder::new(s.clone()).build(&c.cache))
        .unwrap_err();
        assert!(e.to_string().contains("cache.pages"), "{e}");
    }
}

/// Page score ablation, pages of 4, budget 8 rows, decode query
/// `q_i = sin(0.7 i)`: a Python mirror of both scores over the fp16-stored
/// keys gives Quest's bounds 5.0048 / 4.7579 / 4.5307 for pages 0-2 (page 0
/// read) and the mean logits 0.7646 / 1.0084 / 1.4886 (page 2 read), so the
/// two page scores read different rows of the same cache; the diagnostics
/// carry the score's name.
#[test]
fn page_score_is_a_component() {
    let s = spec(1, HQ, 1, D);
    let (k, v, q) = (keys(), values(), queries());
    let dq: Vec<f32> = (0..HQ * D).map(|i| (0.7 * i as f32).sin()).collect();
    let all: Vec<usize> = (0..D).collect();
    for (score, rows) in [("quest", [0, 1, 2, 3]), ("page_mean", [8, 9, 10, 11])] {
        let text = format!(
            "[cache.pages]\npage_size = 4\ntoken_budget = 8\nscore = {{ type = \"{score}\" }}"
        );
        let cfg = RunConfig::parse(&text, false).unwrap();
        let mut c = CacheBuilder::new(s.clone()).build(&cfg.cache).unwrap();
        let mut o = vec![0.0f32; T * HQ * D];
        c.append(0, &k, &v, T).unwrap();
        c.attend(0, &q, T, &mut o).unwrap();
        c.end_prefill().unwrap();
        assert_kept_for(c.as_mut(), &rows, &all, &all, &k, &v, &dq);
        let diag = c.diagnostics();
        // 5 rows x 16 B read, plus every page's summary: Quest 2d floats,
        // the mean d + 1.
        let summary = if score == "quest" { 2 * D } else { D + 1 };
        assert_eq!(
            diag[score].values["bytes_read_per_token"],
            (5 * 16 + 4 * 4 * summary) as f64,
            "{score}"
        );
    }
}

/// CriticalKV over key norm, 4 heavy tokens, first stage 0.5: the mirror's
/// scores (stage-1 tokens 7 and 10 on top), written for both query heads.
#[test]
fn criticalkv_worked_example() {
    let s = spec(1, HQ, 1, D);
    let (k, v) = (keys(), values());
    let wo: Vec<f32> = (0..3)
        .flat_map(|r| (0..HQ * D).map(move |c| 0.5 * (0.3 * r as f32 + 0.7 * c as f32).cos()))
        .collect();
    let (kk, vv) = ([&k[..]], [&v[..]]);
    let mut sig = signals(&s, &kk, &vv);
    sig.output_projection = Some(&wo);
    sig.budget = Some(4);
    let ck = CriticalKv {
        scorer: Box::new(KeyNorm {}),
        ..Default::default()
    };
    assert!(ck.needs().output_projection);
    let mut out = vec![0.0f32; HQ * T];
    ck.score(&sig, &mut out).unwrap();
    let want = [
        -5.791797, -3.273870, -1.952643, -4.964839, -5.482912, -4.576213, -2.462251, -0.952643,
        -5.807618, -5.554185, -0.952643, -2.119951,
    ];
    close(&out[..T], &want, 2e-5);
    close(&out[T..], &want, 2e-5);
}

/// LagKV, 2 sinks, partitions of 3: ranks, cross scores, and the short-prompt
/// rule, as the mirror computes them.
#[test]
fn lagkv_worked_example() {
    let s = spec(1, HQ, 1, D);
    let (k, v) = (keys(), values());
    let (kk, vv) = ([&k[..]], [&v[..]]);
    let mut out = vec![0.0f32; HQ * T];
    let mut lag = LagKv {
        n_sink: 2,
        lag_size: 3,
        cross_scoring: false,
    };
    lag.score(&signals(&s, &kk, &vv), &mut out).unwrap();
    let ranks = [
        1.0, 1.0, 0.666667, 0.333333, 0.0, 0.666667, 0.333333, 0.0, 1.0, 1.0, 1.0, 1.0,
    ];
    close(&out[..T], &ranks, 1e-5);
    close(&out[T..], &ranks, 1e-5);
    lag.cross_scoring = true;
    lag.score(&signals(&s, &kk, &vv), &mut out).unwrap();
    let cross = [
        2.0, 2.0, 0.435528, 0.389388, 0.175084, 0.448197, 0.356539, 0.195264, 2.0, 2.0, 2.0, 2.0,
    ];
    close(&out[..T], &cross, 1e-5);
    lag.cross_scoring = false;
    let (k7, v7) = ([&k[..7 * D]], [&v[..7 * D]]);
    let mut o7 = vec![0.0f32; HQ * 7];
    lag.score(&signals(&s, &k7, &v7), &mut o7).unwrap();
    close(&o7[..7], &[1.0, 1.0, 0.0, 0.2, 0.4, 0.6, 0.8], 1e-6);
}

/// CaM merge with a window of 2 kept successors: the mirror's merged values,
/// plain (CaM's sum) and normalized; keys and the kept set unchanged.
#[test]
fn cam_merge_worked_example() {
    let (k, v) = (keys(), values());
    let kept = [0u32, 3, 4, 8, 10, 11];
    let scores: Vec<f32> = (0..T).map(|j| 1.0 + (j % 5) as f32).collect();
    let inp = CompensateInput {
        layer: 0,
        head: 0,
        d: D,
        t: T,
        keys: &k,
        values: &v,
        kept: &kept,
        scores: &scores,
        sinks: 0,
        recent: 2,
        queries: &[],
        n_queries: 0,
    };
    let mut cam = CamMerge {
        merge_budget: 2,
        ..Default::default()
    };
    let c = cam.compensate(&inp).unwrap();
    assert_eq!(c.kept, kept);
    assert!(c.entries.is_empty());
    let want = [
        0.980067, 0.980067, 0.825336, 0.540302, -0.537874, -0.007485, 0.524085, 0.972913,
        -0.861590, -0.541084, -0.135154, 0.292115, 0.781955, 0.169545, -0.469632, -1.034665,
        0.993081, 0.895884, 0.657247, 0.314845, 0.442292, 0.838270, 1.101903, 1.191570,
    ];
    close(c.values.as_ref().unwrap(), &want, 1e-5);
    cam.normalize = true;
    let c = cam.compensate(&inp).unwrap();
    let want = [
        0.980067, 0.980067, 0.825336, 0.540302, -0.345776, -0.004812, 0.336912, 0.625444,
        -0.553879, -0.347840, -0.086884, 0.187788, 0.372360, 0.080736, -0.223634, -0.492698,
        0.381954, 0.344571, 0.252787, 0.121094, 0.294861, 0.558846, 0.734602, 0.794380,
    ];
    close(c.values.as_ref().unwrap(), &want, 1e-5);
}

/// kvpress's PyramidKV schedule (window counted inside) against the mirror,
/// including its uniform fallback; KVCache-Factory's schedule differs.
#[test]
fn pyramidkv_kvpress_schedule() {
    let p = PyramidKvPress::default();
    let run = |l: usize, t: usize, r: f64| {
        let heavy = (t as f64 * (1.0 - r)) as usize;
        let req = BudgetRequest {
            n_layers: l,
            prompt_len: t,
            heavy,
            recent: 0,
            sinks: 0,
            layers: &[],
        };
        p.layer_budgets(&req)
            .unwrap()
            .iter()
            .map(|b| b.heavy)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        run(30, 2048, 0.5),
        [
            1984, 1918, 1852, 1785, 1719, 1653, 1587, 1521, 1454, 1388, 1322, 1256, 1190, 1123,
            1057, 991, 925, 858, 792, 726, 660, 594, 527, 461, 395, 329, 263, 196, 130, 64
        ]
    );
    assert_eq!(run(30, 2048, 0.75), vec![512; 30]);
    assert_eq!(run(4, 1000, 0.5), [936, 645, 355, 64]);
    let r300 = run(30, 300, 0.5);
    assert_eq!(&r300[..4], &[236, 230, 224, 218]);
    assert_eq!(r300[29], 64);
    let f = minikv_policies::PyramidKv::default()
        .layer_budgets(&BudgetRequest {
            n_layers: 4,
            prompt_len: 1000,
            heavy: 436,
            recent: 64,
            sinks: 0,
            layers: &[],
        })
        .unwrap();
    assert_ne!(
        f.iter().map(|b| b.heavy).collect::<Vec<_>>(),
        [936, 645, 355, 64]
    );
}

/// Runs a prefill of noise through a 2-layer cache built from `toml`,
/// handing the model facts it wants, then 20 decode steps.
fn run_with_facts(toml: &str, t: usize) -> Box<dyn KvCache> {
    let s = spec(2, 4, 2, 16);
    let cfg = RunConfig::parse(toml, false).unwrap();
    let mut c = CacheBuilder::new(s).build(&cfg.cache).unwrap();
    let r = Rope {
        inv_freq: (0..8)
            .map(|i| 10000f64.powf(-2.0 * i as f64 / 16.0))
            .collect(),
        pairs: RopePairs::Halves,
    };
    let noise = |n: usize, seed: u64| -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 2000) as f32 / 500.0 - 2.0
            })
            .collect()
    };
    let wo = noise(32 * 64, 5);
    let mut o = vec![0.0f32; t * 64];
    for l in 0..2 {
        let (k, v, q) = (
            noise(t * 32, 1 + l as u64),
            noise(t * 32, 3 + l as u64),
            noise(t * 64, 7),
        );
        let w = c.wants(l);
        if w.pre_rope_queries {
            c.observe(
                l,
                Observation::PreRopeQueries {
                    q: &q,
                    n: t,
                    rope: &r,
                },
            )
            .unwrap();
        }
        if w.output_projection {
            c.observe(l, Observation::OutputProjection { w: &wo, hidden: 32 })
                .unwrap();
        }
        c.append(l, &k, &v, t).unwrap();
        c.attend(l, &q, t, &mut o).unwrap();
    }
    if c.wants(0).reconstruction {
        // A reconstruction pass of 24 tokens over the whole prompt.
        c.begin_pass(0..t).unwrap();
        for l in 0..2 {
            c.append(l, &noise(24 * 32, 11), &noise(24 * 32, 12), 24)
                .unwrap();
            c.attend(l, &noise(24 * 64, 13), 24, &mut o[..24 * 64])
                .unwrap();
        }
        c.end_pass().unwrap();
    }
    c.end_prefill().unwrap();
    for step in 0..20 {
        for l in 0..2 {
            c.append(l, &noise(32, 100 + step), &noise(32, 200 + step), 1)
                .unwrap();
            c.attend(l, &noise(64, 300 + step), 1, &mut o[..64])
                .unwrap();
            assert!(o[..64].iter().all(|x| x.is_finite()));
        }
    }
    c
}

/// Every new method composes with 2-bit storage and Ada-KV per-head budgets
/// in one config: ragged heads whose total is the layer budget, packed codes.
#[test]
fn new_methods_compose_with_2bit_and_adakv() {
    // ThinK's half of the key channels: key codes halve, value codes stay,
    // against the same selection without it.
    let codes = |channels: &str| {
        let toml = format!(
            "[cache]\nheavy_tokens = 48\nrecent_tokens = 8\nscorer = {{ type = \"snapkv\", window = 8 }}\nselector = {{ type = \"ada_kv\", alpha = 0.2 }}\n[cache.quant]\nresidual = 16\nkeys = {{ type = \"minmax\", bits = 2, group = 16, axis = \"channel\" }}\nvalues = {{ type = \"minmax\", bits = 2, group = 16, axis = \"token\" }}\n{channels}"
        );
        run_with_facts(&toml, 160).memory().sum(|h| h.quant_codes) as f64
    };
    let r = codes("[cache.channels]\ntype = \"think\"\nratio = 0.5\nwindow = 8\n") / codes("");
    assert!((r - 0.75).abs() < 0.02, "ThinK codes ratio {r}");
    let quant = "[cache.quant]\nresidual = 16\nkeys = { type = \"minmax\", bits = 2, group = 16, axis = \"channel\" }\nvalues = { type = \"minmax\", bits = 2, group = 16, axis = \"token\" }\n";
    for (name, scorer, extra) in [
        (
            "expected_attention",
            "{ type = \"expected_attention\" }",
            "",
        ),
        (
            "criticalkv",
            "{ type = \"criticalkv\", scorer = { type = \"snapkv\", window = 8 } }",
            "",
        ),
        (
            "lagkv",
            "{ type = \"lagkv\", lag_size = 16, cross_scoring = true }",
            "",
        ),
        (
            "cam",
            "{ type = \"snapkv\", window = 8 }",
            "[cache.compensator]\ntype = \"cam\"\n",
        ),
        (
            "think",
            "{ type = \"snapkv\", window = 8 }",
            "[cache.channels]\ntype = \"think\"\nratio = 0.5\nwindow = 8\n",
        ),
        ("kvzip", "{ type = \"kvzip\" }", ""),
    ] {
        let toml = format!(
            "[cache]\nheavy_tokens = 48\nrecent_tokens = 8\nscorer = {scorer}\nselector = {{ type = \"ada_kv\", alpha = 0.2 }}\n{quant}{extra}"
        );
        let c = run_with_facts(&toml, 160);
        for layer in &c.memory().layers {
            let toks: Vec<usize> = layer.heads.iter().map(|h| h.tokens).collect();
            assert_eq!(
                toks.iter().sum::<usize>(),
                2 * (48 + 8) + 2 * 20,
                "{name}: {toks:?}"
            );
            assert!(layer.heads.iter().all(|h| h.quant_codes > 0), "{name}");

            if ["expected_attention", "criticalkv"].contains(&name) {
                assert!(
                    toks.iter().any(|&n| n != toks[0]),
                    "{name}: ragged heads {toks:?}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Protected tokens are kept: Expected Attention's sinks and LagKV's sinks
    /// and tail score above every other token, whatever the keys and values.
    #[test]
    fn protected_tokens_score_highest(seed in 0u64..10_000, t in 20usize..90, sink in 0usize..6, lag in 2usize..12) {
        let s = spec(1, 2, 1, 16);
        let mut x = seed | 1;
        let mut rnd = |n: usize| -> Vec<f32> {
            (0..n).map(|_| { x ^= x << 13; x ^= x >> 7; x ^= x << 17; (x % 4001) as f32 / 400.0 - 5.0 }).collect()
        };
        let (k, v) = (rnd(t * 16), rnd(t * 16));
        let (kk, vv) = ([&k[..]], [&v[..]]);
        let mut out = vec![0.0f32; 2 * t];
        let lagkv = LagKv { n_sink: sink, lag_size: lag, cross_scoring: seed % 2 == 0 };
        lagkv.score(&signals(&s, &kk, &vv), &mut out).unwrap();
        if t >= sink + 2 * lag {
            let end = sink + (t - sink) / lag * lag;
            let protected: Vec<usize> = (0..sink).chain(end - lag..t).collect();
            let rest = (sink..end - lag).map(|j| out[j]).fold(f32::NEG_INFINITY, f32::max);
            for j in protected {
                prop_assert!(out[j] > rest, "token {j}: {} vs {rest}", out[j]);
            }
        }
        prop_assert!(out.iter().all(|x| x.is_finite()));
        // Expected Attention with random statistics (covariance A·Aᵀ).
        let mean: Vec<f64> = rnd(32).iter().map(|&x| x as f64).collect();
        let a = rnd(2 * 256);
        let cov: Vec<f64> = (0..2 * 256)
            .map(|i| {
                let (h, r, c) = (i / 256, (i % 256) / 16, i % 16);
                (0..16).map(|m| a[h * 256 + r * 16 + m] as f64 * a[h * 256 + c * 16 + m] as f64).sum::<f64>() / 16.0
            })
            .collect();
        let r = Rope { inv_freq: (0..8).map(|i| 500f64.powf(-(i as f64) / 8.0)).collect(), pairs: RopePairs::Adjacent };
        let mut sig = signals(&s, &kk, &vv);
        sig.query_stats = Some(QueryStats { n: t, mean: &mean, cov: &cov, rope: &r });
        ExpectedAttention { n_sink: sink, ..Default::default() }.score(&sig, &mut out).unwrap();
        prop_assert!(out.iter().all(|x| x.is_finite() && *x >= 0.0));
        for h in 0..2 {
            let row = &out[h * t..(h + 1) * t];
            let rest = row[sink.min(t)..].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for (j, &x) in row.iter().enumerate().take(sink.min(t)) {
                prop_assert!(x > rest, "sink {j}: {x} vs {rest}");
            }
        }
    }
}

/// DuoAttention: with a pattern file whose scores make heads 1 and 2 of layer
/// 0 the retrieval heads (fraction 0.5 of 4 heads), those keep all 40 prompt
/// tokens, the others keep 2 sinks + 6 recent; a missing or ill-shaped
/// pattern is a clear error naming the file.
#[test]
fn duo_attention_splits_heads_by_pattern() {
    let dir = std::env::temp_dir().join(format!("minikv-duo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, scores: &str| {
        let p = dir.join(name);
        std::fs::write(
            &p,
            format!(
                "{{\"format\": \"minikv-duo-pattern-v1\", \"model\": \"m\", \"model_sha256\": \"0\", \"calibration\": {{}}, \"scores\": {scores}}}"
            ),
        )
        .unwrap();
        p.to_string_lossy().into_owned()
    };
    let good = write("good.json", "[[0.1, 0.9, 0.8, 0.2], [0.3, 0.0, 0.05, 0.1]]");
    let s = spec(2, 4, 4, 16);
    let cfg = |pattern: &str| {
        RunConfig::parse(
            &format!("[cache]\nsinks = 2\nheavy_tokens = 0\nrecent_tokens = 6\nscorer = {{ type = \"recency\" }}\nselector = {{ type = \"duo_attention\", pattern = \"{pattern}\", retrieval_fraction = 0.5 }}"),
            false,
        )
        .unwrap()
    };
    let mut c = CacheBuilder::new(s.clone())
        .build(&cfg(&good).cache)
        .unwrap();
    let t = 40;
    let x: Vec<f32> = (0..t * 64)
        .map(|i| ((i * 7919) % 97) as f32 / 50.0 - 1.0)
        .collect();
    let mut o = vec![0.0f32; t * 64];
    for l in 0..2 {
        c.append(l, &x, &x, t).unwrap();
        c.attend(l, &x, t, &mut o).unwrap();
    }
    c.end_prefill().unwrap();
    let m = c.memory();
    let toks = |l: usize| {
        m.layers[l]
            .heads
            .iter()
            .map(|h| h.tokens)
            .collect::<Vec<_>>()
    };
    // Top half of 8 (layer, head) scores: 0.9, 0.8 (layer 0), 0.3 (layer 1), 0.2 (layer 0).
    assert_eq!(toks(0), [8, 40, 40, 40]);
    assert_eq!(toks(1), [40, 8, 8, 8]);
    let mut c = CacheBuilder::new(s.clone())
        .build(&cfg(&dir.join("missing.json").to_string_lossy()).cache)
        .unwrap();
    for l in 0..2 {
        c.append(l, &x, &x, t).unwrap();
        c.attend(l, &x, t, &mut o).unwrap();
    }
    let e = c.end_prefill().unwrap_err().to_string();
    assert!(
        e.contains("missing.json") && e.contains("minikv calibrate duo"),
        "{e}"
    );
    let bad = write("bad.json", "[[0.1, 0.9, 0.8]]");
    let mut c = CacheBuilder::new(s).build(&cfg(&bad).cache).unwrap();
    for l in 0..2 {
        c.append(l, &x, &x, t).unwrap();
        c.attend(l, &x, t, &mut o).unwrap();
    }
    let e = c.end_prefill().unwrap_err().to_string();
    assert!(
        e.contains("bad.json") && e.contains("3 heads per layer"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// KVzip through the cache's pass API: after the 12-token prompt, a pass
/// over positions 0..12 appends 3 reconstruction tokens and attends with
/// their queries; the pass tokens leave the cache, and the mirror's scores
/// (token 4 the best of 2..8) give the kept set [0, 1, 4] + [9, 10, 11].
#[test]
fn kvzip_worked_example() {
    let s = spec(1, HQ, 1, D);
    let (k, v, q) = (keys(), values(), queries());
    let cfg = RunConfig::parse(
        "[cache]\nheavy_tokens = 3\nrecent_tokens = 3\nscorer = { type = \"kvzip\", n_sink = 2 }",
        false,
    )
    .unwrap();
    let mut c = CacheBuilder::new(s.clone()).build(&cfg.cache).unwrap();
    assert!(c.wants(0).reconstruction);
    let mut o = vec![0.0f32; T * HQ * D];
    c.append(0, &k, &v, T).unwrap();
    c.attend(0, &q, T, &mut o).unwrap();
    let n = 3;
    let kp: Vec<f32> = (0..n)
        .flat_map(|i| (0..D).map(move |c| (0.5 + 0.9 * i as f32 + 0.3 * c as f32).cos()))
        .collect();
    let qp: Vec<f32> = (0..n)
        .flat_map(|i| {
            (0..HQ).flat_map(move |h| {
                (0..D).map(move |c| (0.2 + 0.6 * i as f32 + 0.8 * c as f32 + 0.4 * h as f32).sin())
            })
        })
        .collect();
    c.begin_pass(0..T).unwrap();
    // The pass tokens arrive in two chunks, as a model's forward may send them.
    c.append(0, &kp[..D], &kp[..D], 1).unwrap();
    c.attend(0, &qp[..HQ * D], 1, &mut o[..HQ * D]).unwrap();
    c.append(0, &kp[D..], &kp[D..], 2).unwrap();
    c.attend(0, &qp[HQ * D..], 2, &mut o[..2 * HQ * D]).unwrap();
    assert_eq!(c.seq_len(0), T + n);
    c.end_pass().unwrap();
    assert_eq!(c.seq_len(0), T);
    c.end_prefill().unwrap();
    assert_kept(c.as_mut(), &[0, 1, 4, 9, 10, 11], &k, &v, HQ);
    assert_eq!(c.diagnostics()["reconstruction"].values["pass_tokens"], 3.0);
    // Without a pass the scorer says what is missing.
    let mut c = CacheBuilder::new(s).build(&cfg.cache).unwrap();
    c.append(0, &k, &v, T).unwrap();
    c.attend(0, &q, T, &mut o).unwrap();
    let e = c.end_prefill().unwrap_err().to_string();
    assert!(e.contains("context-reconstruction pass"), "{e}");
}

/// Key re-rotation (kvpress's `KeyRerotationPress`): key norm keeps rows
/// 1 2 4 5 7 10 (6 heavy tokens); with `rerotate_keys` the i-th kept key,
/// of position p, is stored rotated by `i - p` positions (RoPE, adjacent
/// pairs, `theta_j = 100^(-2j/d)`: `x0 cos - x1 sin, x1 cos + x0 sin`,
/// computed here from the formula), so attention equals attention over
/// those rotated keys; the decoded key keeps its own rotation.
#[test]
fn key_rerotation_worked_example() {
    let s = spec(1, HQ, 1, D);
    let (k, v, q) = (keys(), values(), queries());
    let kept = [1usize, 2, 4, 5, 7, 10];
    let mut kr = k.clone();
    for (i, &p) in kept.iter().enumerate() {
        let delta = i as f64 - p as f64;
        for j in 0..D / 2 {
            let th = delta * 100f64.powf(-2.0 * j as f64 / D as f64);
            let (x0, x1) = (k[p * D + 2 * j] as f64, k[p * D + 2 * j + 1] as f64);
            kr[p * D + 2 * j] = (x0 * th.cos() - x1 * th.sin()) as f32;
            kr[p * D + 2 * j + 1] = (x1 * th.cos() + x0 * th.sin()) as f32;
        }
    }
    let all: Vec<usize> = (0..D).collect();
    let dq: Vec<f32> = (0..HQ * D).map(|i| 0.3 - 0.17 * i as f32).collect();
    for rerotate in [false, true] {
        let text = format!(
            "[cache]\nheavy_tokens = 6\nrecent_tokens = 0\nrerotate_keys = {rerotate}\nscorer = {{ type = \"key_norm\" }}"
        );
        let cfg = RunConfig::parse(&text, false).unwrap();
        let mut c = CacheBuilder::new(s.clone()).build(&cfg.cache).unwrap();
        assert_eq!(c.wants(0).pre_rope_queries, rerotate, "RoPE asked for");
        let r = rope();
        c.observe(
            0,
            Observation::PreRopeQueries {
                q: &q,
                n: T,
                rope: &r,
            },
        )
        .unwrap();
        let mut o = vec![0.0f32; T * HQ * D];
        c.append(0, &k, &v, T).unwrap();
        c.attend(0, &q, T, &mut o).unwrap();
        c.end_prefill().unwrap();
        let want = if rerotate { &kr } else { &k };
        assert_kept_for(c.as_mut(), &kept, &all, &all, want, &v, &dq);
    }
    // Without a selection there is nothing to re-rotate: a config error.
    let e = RunConfig::parse("[cache]\nrerotate_keys = true", false)
        .unwrap()
        .validate(None)
        .unwrap_err();
    assert!(e.to_string().contains("cache.rerotate_keys"), "{e}");
}

/// Q-Filters with the filter u = (1, -1, 1, -1) / 2: scores are `<k_j, u>`
/// (1.078125 0.412772 -0.703661 -1.051128 -0.249914 0.824408 0.997811
/// 0.080798 -0.924511 -0.919507 0.090341 1.001464 from numpy), so 6 heavy
/// tokens keep rows 0 1 5 6 10 11. A filter file that is not unit vectors,
/// or holds another model's heads, is a clear error.
#[test]
fn q_filter_worked_example() {
    use minikv_policies::{QFilter, QFilterFile};
    let s = spec(1, HQ, 1, D);
    let (k, v, q) = (keys(), values(), queries());
    let file = |filters: Vec<Vec<Vec<f32>>>| QFilterFile {
        format: QFilterFile::FORMAT.into(),
        model: "test".into(),
        model_sha256: String::new(),
        calibration: serde_json::Value::Null,
        explained: filters.iter().map(|l| vec![0.5; l.len()]).collect(),
        filters,
    };
    let u = vec![0.5f32, -0.5, 0.5, -0.5];
    let kk: [&[f32]; 1] = [&k];
    let vv: [&[f32]; 1] = [&v];
    let mut out = vec![0.0f32; HQ * T];
    QFilter::from_file(file(vec![vec![u.clone()]]))
        .score(&signals(&s, &kk, &vv), &mut out)
        .unwrap();
    let want = [
        1.078125, 0.412772, -0.703661, -1.051128, -0.249914, 0.824408, 0.997811, 0.080798,
        -0.924511, -0.919507, 0.090341, 1.001464,
    ];
    close(&out[..T], &want, 1e-5);
    close(&out[T..], &want, 1e-5);
    // Through a cache, the file named in the config.
    let dir = std::env::temp_dir().join(format!("minikv-qfilter-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, f: &QFilterFile| {
        let p = dir.join(name);
        std::fs::write(&p, serde_json::to_string(f).unwrap()).unwrap();
        p.to_string_lossy().into_owned()
    };
    let cfg_for = |path: &str| {
        RunConfig::parse(
            &format!(
                "[cache]\nheavy_tokens = 6\nrecent_tokens = 0\nscorer = {{ type = \"q_filter\", filters = \"{path}\" }}"
            ),
            false,
        )
        .unwrap()
    };
    let good = write("good.json", &file(vec![vec![u.clone()]]));
    let mut c = CacheBuilder::new(s.clone())
        .build(&cfg_for(&good).cache)
        .unwrap();
    let mut o = vec![0.0f32; T * HQ * D];
    c.append(0, &k, &v, T).unwrap();
    c.attend(0, &q, T, &mut o).unwrap();
    c.end_prefill().unwrap();
    assert_kept(c.as_mut(), &[0, 1, 5, 6, 10, 11], &k, &v, HQ);
    // Bad files: named errors, never a panic: a file that is not unit
    // vectors (or is missing) when the cache is built, another model's
    // heads at the end of prefill.
    let p = write("norm.json", &file(vec![vec![vec![1.0, 1.0, 0.0, 0.0]]]));
    let e = CacheBuilder::new(s.clone())
        .build(&cfg_for(&p).cache)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a finite unit vector"), "{e}");
    let e = CacheBuilder::new(s.clone())
        .build(&cfg_for("/nonexistent/q.json").cache)
        .unwrap_err()
        .to_string();
    assert!(e.contains("minikv calibrate qfilters"), "{e}");
    // Another model's heads, or another depth (never another layer's
    // directions): errors at the end of prefill.
    for (name, f, msg) in [
        (
            "heads.json",
            file(vec![vec![u.clone(), u.clone()]]),
            "calibrate the filters on this model",
        ),
        (
            "layers.json",
            file(vec![vec![u.clone()], vec![u.clone()]]),
            "holds 2 layers, the cache compresses 1",
        ),
    ] {
        let p = write(name, &f);
        let mut c = CacheBuilder::new(s.clone())
            .build(&cfg_for(&p).cache)
            .unwrap();
        c.append(0, &k, &v, T).unwrap();
        c.attend(0, &q, T, &mut o).unwrap();
        let e = c.end_prefill().unwrap_err().to_string();
        assert!(e.contains(msg), "{name}: {e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// KVCompose on three layers (4 query / 2 KV heads, 6 tokens) from given
/// reconstruction maxima: the KV-head scores and the layer counts of a plain
/// Python mirror of kvpress's `KVComposePress` (mean over the group, plus
/// the layer's mean over heads; composite rows of sorted scores averaged
/// over heads, layer 0 raised to the maximum over layers; the 9 best
/// composite entries of 18): 4, 3 and 2 tokens per head.
#[test]
fn kvcompose_worked_example() {
    use minikv_core::budget::SelectionPolicy;
    use minikv_policies::{KvCompose, KvComposeScore};
    let (l, hq, hkv, t) = (3usize, 4usize, 2usize, 6usize);
    let s = spec(l, hq, hkv, 1);
    let r: Vec<Vec<f32>> = (0..l)
        .map(|li| {
            (0..hq)
                .flat_map(|h| {
                    (0..t).map(move |j| {
                        ((li * 7 + h * 3 + j * 5) % 11) as f32 / 10.0
                            + 0.013 * li as f32
                            + 0.007 * h as f32
                            + 0.001 * j as f32
                    })
                })
                .collect()
        })
        .collect();
    let k = vec![0.0f32; t];
    let kk: [&[f32]; 2] = [&k, &k];
    let sigs: Vec<LayerSignals<'_>> = (0..l)
        .map(|li| LayerSignals {
            layer: li,
            reconstruction: Some(&r[li][..]),
            ..signals(&s, &kk, &kk)
        })
        .collect();
    let mut out = vec![0.0f32; hq * t];
    KvComposeScore::default().score(&sigs[0], &mut out).unwrap();
    let want = [
        0.614, 1.066, 1.243, 1.145, 1.047, 0.949, 1.228, 0.58, 1.307, 1.209, 1.111, 1.013,
    ];
    // Query heads 0, 1 carry KV head 0's row, 2, 3 KV head 1's.
    close(&out[..t], &want[..t], 1e-5);
    close(&out[t..2 * t], &want[..t], 1e-5);
    close(&out[2 * t..3 * t], &want[t..], 1e-5);
    let req = BudgetRequest {
        n_layers: l,
        prompt_len: t,
        heavy: 3,
        recent: 0,
        sinks: 0,
        layers: &sigs,
    };
    let b = KvCompose::default().layer_budgets(&req).unwrap();
    let heavy: Vec<usize> = b.iter().map(|x| x.heavy).collect();
    assert_eq!(heavy, [4, 3, 2]);
    // Without the reconstruction pass: a clear error, not a silent budget.
    let bare: Vec<LayerSignals<'_>> = (0..l).map(|_| signals(&s, &kk, &kk)).collect();
    let e = KvCompose::default()
        .layer_budgets(&BudgetRequest {
            layers: &bare,
            ..req.clone()
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("reconstruction pass"), "{e}");
}

/// KVzip's model-wide budget by hand (2 layers, 2 KV heads of one query
/// head each, 3 tokens, mean heavy 1: the model keeps 4). Scores: layer 0
/// (0.9, 0.8, 0.1) and (0.85, 0.2, 0.1), layer 1 (0.7, 0.1, 0.1) and
/// (0.05, 0.02, 0.01): the best four are three of layer 0 and one of
/// layer 1 (kvpress's per-layer counts); per head 1.5 and 0.5, rounded by
/// largest remainders (a tie: the lower layer) to 2 and 0. With one sink
/// per head the sinks are the best four: 1 and 1.
#[test]
fn kvzip_budget_worked_example() {
    use minikv_core::budget::SelectionPolicy;
    use minikv_policies::KvZipBudget;
    let (l, hq, hkv, t) = (2usize, 2usize, 2usize, 3usize);
    let s = spec(l, hq, hkv, 1);
    let r: [Vec<f32>; 2] = [
        vec![0.9, 0.8, 0.1, 0.85, 0.2, 0.1],
        vec![0.7, 0.1, 0.1, 0.05, 0.02, 0.01],
    ];
    let k = vec![0.0f32; t];
    let kk: [&[f32]; 2] = [&k, &k];
    let sigs: Vec<LayerSignals<'_>> = (0..l)
        .map(|li| LayerSignals {
            layer: li,
            reconstruction: Some(&r[li][..]),
            ..signals(&s, &kk, &kk)
        })
        .collect();
    let req = BudgetRequest {
        n_layers: l,
        prompt_len: t,
        heavy: 1,
        recent: 0,
        sinks: 0,
        layers: &sigs,
    };
    let heavy = |p: KvZipBudget| -> Vec<usize> {
        p.layer_budgets(&req)
            .unwrap()
            .iter()
            .map(|b| b.heavy)
            .collect()
    };
    assert_eq!(heavy(KvZipBudget { n_sink: 0 }), [2, 0]);
    assert_eq!(heavy(KvZipBudget { n_sink: 1 }), [1, 1]);
    // The total is conserved: L * heavy.
    assert_eq!(heavy(KvZipBudget::default()).iter().sum::<usize>(), 2);
    // Without the pass's scores (no model): a clear error.
    let e = KvZipBudget::default()
        .layer_budgets(&BudgetRequest {
            layers: &[],
            ..req.clone()
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("kvzip policy"), "{e}");
}
