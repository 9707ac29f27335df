//! The `minikv` binary end to end, on the real model where a model is needed.

use minikv_test_support::{root, run_in_root};
use std::path::{Path, PathBuf};
use std::process::Command;

fn minikv(args: &[&str]) -> (bool, String, String) {
    let r = run_in_root(env!("CARGO_BIN_EXE_minikv"), args);
    (r.code == 0, r.stdout, r.stderr)
}

/// `minikv report FIXTURE --out DIR ARGS...` on a committed fixture; returns DIR.
fn report_fixture(fixture: &str, tag: &str, args: &[&str]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("minikv-{tag}-{}", std::process::id()));
    let f = format!("minikv-cli/tests/fixtures/{fixture}");
    let mut a = vec!["report", &f, "--out", dir.to_str().unwrap()];
    a.extend_from_slice(args);
    let (ok, _, err) = minikv(&a);
    assert!(ok, "{err}");
    dir
}

fn ok_json(args: &[&str]) -> serde_json::Value {
    let (ok, out, err) = minikv(args);
    assert!(ok, "minikv {args:?} failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[test]
fn components_lists_every_extension_point() {
    let v = ok_json(&["components", "--json"]);
    let points: std::collections::BTreeSet<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["point"].as_str().unwrap())
        .collect();
    assert_eq!(
        points.into_iter().collect::<Vec<_>>(),
        [
            "backend",
            "channels",
            "compensator",
            "decode",
            "page_score",
            "policy",
            "quantizer",
            "residual",
            "scorer",
            "selector",
            "task"
        ]
    );
    let snap = v
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "snapkv")
        .unwrap();
    assert_eq!(snap["default"]["window"], 32);
    // Every method of kvpress 0.5.5 minikv has taken is registered (38
    // components besides the backends when the twelve of a6fe93d landed).
    let methods = v
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["point"] != "backend" && c["point"] != "task")
        .count();
    assert!(methods >= 38, "{methods} components");
    for name in [
        "random",
        "cur",
        "leverage",
        "non_causal_attention",
        "compactor",
        "finch",
        "cap",
        "entropy_gated_chunk_kv",
        "critical_ada_kv",
        "block",
        "merge_similar",
        "simlayerkv",
        "frozen",
        "evict",
        "quest",
        "page_mean",
        "minikv",
        "kivi",
    ] {
        assert!(
            v.as_array().unwrap().iter().any(|c| c["name"] == name),
            "{name} not listed"
        );
    }
}

#[test]
fn config_check_prints_resolved_or_names_the_field() {
    let (ok, out, _) = minikv(&["config", "check", "configs/minikv.toml"]);
    assert!(
        ok && out.contains("type = \"top_k\"") && out.contains("scale_dtype = \"f16\""),
        "{out}"
    );
    let dir = std::env::temp_dir().join(format!("minikv-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[cache]\nheavy = 1.5\nscorer = { type = \"h2o\" }\n").unwrap();
    let (ok, _, err) = minikv(&["config", "check", bad.to_str().unwrap()]);
    assert!(
        !ok && err.contains("cache.heavy") && err.contains("1.5"),
        "{err}"
    );
    // Non-finite floats anywhere, in any component, are rejected by name
    // (TOML writes them as inf / nan); the run commands agree with the check.
    for (cfg, field) in [
        (
            "[cache]\nheavy = 0.25\nrecent = 0.25\nscorer = { type = \"cumulative_attention\" }\npolicy = { type = \"pyramid\", depth = inf }\n",
            "cache.policy.depth",
        ),
        (
            "[cache]\nheavy = nan\nscorer = { type = \"h2o\" }\n",
            "cache.heavy",
        ),
        (
            "[cache]\nheavy = 0.2\nscorer = { type = \"snapkv\" }\n[cache.compensator]\ntype = \"reskv\"\nbeta = -inf\n",
            "cache.compensator.beta",
        ),
    ] {
        std::fs::write(&bad, cfg).unwrap();
        let (ok, _, err) = minikv(&["config", "check", bad.to_str().unwrap()]);
        assert!(!ok && err.contains(field), "{cfg}: {err}");
        let (ok, _, err) = minikv(&[
            "generate",
            "--config",
            bad.to_str().unwrap(),
            "--prompt",
            "Hi",
            "--max-tokens",
            "2",
        ]);
        assert!(
            !ok && err.contains(field) && !err.contains("panicked"),
            "{cfg}: {err}"
        );
    }
}

/// Decode-time compression over a scorer without a decode rule (SnapKV every
/// 16 steps) on the real model: memory stays within budget + 15 tokens per
/// head while 40 tokens are generated, and fidelity is measured.
#[test]
fn snapkv_evicts_while_decoding_on_the_real_model() {
    let v = ok_json(&[
        "eval",
        "--config",
        "configs/snapkv-decode.toml",
        "--task",
        "fidelity",
        "--context",
        "128",
        "--tokens",
        "40",
        "--json",
    ]);
    let kl = v["metrics"]["kl"].as_f64().unwrap();
    assert!(kl.is_finite() && kl > 0.0, "{kl}");
    // 25 heavy (20% of 128) + 32 window per head, 3 KV heads; evictions every 16.
    for n in v["memory"]["per_layer_tokens"].as_array().unwrap() {
        let n = n.as_u64().unwrap();
        assert!((3 * 57..=3 * (57 + 15)).contains(&n), "{n}");
    }
}

/// docs/algorithms.md §1 golden rows through the CLI.
#[test]
fn quantize_reproduces_the_golden_rows() {
    let dir = std::env::temp_dir().join(format!("minikv-q-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("rows.json");
    std::fs::write(&f, "[[0,0.5,1,1.5,2,2.5,3,0.25,0.75,1.25,1.75,2.25,2.75,3,0,1],[-1.2,0.7,0.05,-0.33,1.9,-0.8,0.42,1.1,-1.05,0,0.66,-0.2,1.5,0.9,-0.6,0.3]]").unwrap();
    let v = ok_json(&[
        "quantize",
        "--bits",
        "2",
        "--group",
        "16",
        "--axis",
        "token",
        "--input",
        f.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(v["rows"][0]["packed"][0], "0x4fa53a90");
    assert_eq!(v["rows"][1]["packed"][0], "0x5b64a358");
    let v = ok_json(&[
        "quantize",
        "--bits",
        "4",
        "--group",
        "16",
        "--axis",
        "token",
        "--input",
        f.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(
        v["rows"][0]["packed"],
        serde_json::json!(["0x1fca8520", "0x50feb964"])
    );
    let (ok, _, err) = minikv(&[
        "quantize",
        "--bits",
        "2",
        "--group",
        "5",
        "--axis",
        "token",
        "--input",
        f.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("group size 5"), "{err}");
}

#[test]
fn budgets_reports_layers_heads_and_total() {
    let v = ok_json(&[
        "budgets",
        "configs/minikv-pyramid.toml",
        "--layers",
        "4",
        "--tokens",
        "1000",
        "--kv-heads",
        "3",
        "--json",
    ]);
    let l = v["layers"].as_array().unwrap();
    assert_eq!(l.len(), 4);
    assert_eq!(
        l.iter().map(|x| x["heavy"].as_u64().unwrap()).sum::<u64>(),
        1000
    );
    assert_eq!(l[0]["heads"].as_array().unwrap().len(), 3);
    let (ok, _, err) = minikv(&[
        "budgets",
        "configs/minikv-var-prop.toml",
        "--layers",
        "4",
        "--tokens",
        "100",
        "--json",
    ]);
    assert!(!ok && err.contains("--model and --text"), "{err}");
    // With a model run, statistic-driven budgets and ragged Ada-KV heads come out.
    let v = ok_json(&[
        "budgets",
        "configs/minikv-var-inv.toml",
        "--tokens",
        "128",
        "--model",
        "assets/SmolLM2-135M-Instruct.Q4_1.gguf",
        "--text",
        "assets/paul_graham/addiction.txt",
        "--json",
    ]);
    let heavy: Vec<u64> = v["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["heavy"].as_u64().unwrap())
        .collect();
    assert_eq!(heavy.len(), 30);
    assert_eq!(heavy.iter().sum::<u64>(), 30 * 32);
    assert!(heavy.iter().min() < heavy.iter().max());
}

#[test]
fn logits_json_has_ids_and_top() {
    let v = ok_json(&[
        "logits",
        "--prompt",
        "The capital of France is",
        "--top",
        "3",
        "--json",
    ]);
    assert_eq!(v["ids"], serde_json::json!([504, 3575, 282, 4649, 314]));
    assert_eq!(v["top"][0][0], 7042); // " Paris"
}

#[test]
fn bad_model_and_long_prompt_are_clear_errors() {
    let (ok, _, err) = minikv(&["logits", "--model", "Cargo.toml", "--prompt", "x"]);
    assert!(!ok && err.contains("not a GGUF file"), "{err}");
    let long = "7 ".repeat(8200);
    let (ok, _, err) = minikv(&["logits", "--prompt", &long]);
    assert!(!ok && err.contains("exceeds the maximum of 8192"), "{err}");
}

/// Every preset runs `generate` and `perplexity` end to end on the real model;
/// results carry provenance.
#[test]
fn every_preset_generates_and_scores() {
    let mut presets: Vec<PathBuf> = ["configs", "configs/kvpress"]
        .iter()
        .flat_map(|d| std::fs::read_dir(root().join(d)).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    presets.sort();
    for p in presets {
        let c = p.to_str().unwrap();
        let g = ok_json(&[
            "generate",
            "--config",
            c,
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "4",
            "--json",
        ]);
        assert!(!g["tokens"].as_array().unwrap().is_empty(), "{c}");
        assert_eq!(
            g["provenance"]["model_sha256"],
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
        );
        let r = ok_json(&[
            "perplexity",
            "--config",
            c,
            "--text",
            "assets/paul_graham/addiction.txt",
            "--tokens",
            "80",
            "--prefill",
            "64",
            "--json",
        ]);
        let ppl = r["ppl"].as_f64().unwrap();
        assert!(
            ppl.is_finite() && ppl > 1.0 && ppl < 200.0,
            "{c}: ppl {ppl}"
        );
        assert!(r["memory"]["kv_bytes"].as_u64().unwrap() > 0);
    }
}

/// The kvpress / KVCache-Factory methods that need more than scores, on the
/// real model: Quest reads a fraction of what it holds; ThinK holds fewer key
/// bytes than the same selection without it; `minikv calibrate duo` writes a
/// 30 x 3 pattern, the same twice for one seed, that the DuoAttention preset
/// reads; Expected Attention and CriticalKV get the model facts they ask for.
#[test]
fn kvpress_methods_on_the_real_model() {
    let dir = std::env::temp_dir().join(format!("minikv-kvpress-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = |name: &str, body: &str| {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        p.to_string_lossy().into_owned()
    };
    let eval = |c: &str| {
        ok_json(&[
            "eval",
            "--config",
            c,
            "--task",
            "fidelity",
            "--context",
            "384",
            "--tokens",
            "6",
            "--json",
        ])
    };
    let quest = cfg(
        "quest.toml",
        "[cache.pages]\npage_size = 16\ntoken_budget = 128\n",
    );
    let q = eval(&quest);
    let frac = q["metrics"]["quest_read_fraction"].as_f64().unwrap();
    assert!(frac > 0.3 && frac < 0.6, "Quest read fraction {frac}");
    assert!(q["metrics"]["kl"].as_f64().unwrap().is_finite());
    let snap = cfg(
        "snap.toml",
        "[cache]\nheavy = 0.25\nrecent_tokens = 32\nscorer = { type = \"snapkv\" }\n",
    );
    let think = cfg(
        "think.toml",
        "[cache]\nheavy = 0.25\nrecent_tokens = 32\nscorer = { type = \"snapkv\" }\n[cache.channels]\ntype = \"think\"\nratio = 0.5\n",
    );
    let (a, b) = (eval(&snap), eval(&think));
    let bytes = |v: &serde_json::Value| v["memory"]["kv_bytes"].as_f64().unwrap();
    // Keys lose half their channels: K+V bytes drop by about a quarter.
    let r = bytes(&b) / bytes(&a);
    assert!(r > 0.72 && r < 0.78, "ThinK/SnapKV bytes {r}");
    for p in [
        "configs/expected-attention.toml",
        "configs/criticalkv.toml",
        "configs/kvzip.toml",
    ] {
        let v = eval(p);
        let kl = v["metrics"]["kl"].as_f64().unwrap();
        assert!(kl.is_finite() && kl > 0.0 && kl < 1.0, "{p}: {kl}");
    }
    // KVzip's second forward: the instruction, a newline and the 384-token prompt.
    let z = eval("configs/kvzip.toml");
    let pass = z["metrics"]["reconstruction_pass_tokens"].as_f64().unwrap();
    assert!(pass > 384.0 && pass < 400.0, "{pass}");
    // kvpress's KVzip budget: one ranking over the model gives each layer
    // its share (a multiple of the 3 heads), the total stays 30 x 3 x 192
    // prompt rows (plus the 5 decoded tokens of every head).
    let zk = eval("configs/kvpress/kvzip.toml");
    let per: Vec<u64> = zk["memory"]["per_layer_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(per.iter().sum::<u64>(), 30 * 3 * (192 + 5), "{per:?}");
    assert!(per.iter().any(|&n| n != per[0]), "{per:?}");
    assert!(zk["metrics"]["kl"].as_f64().unwrap().is_finite());
    // KVCompose's second reading: the 384-token prompt itself, once; its
    // global budget gives the first layer the most (every token here).
    let c = eval("configs/kvpress/kvcompose.toml");
    assert_eq!(c["metrics"]["reconstruction_pass_tokens"], 384.0);
    let kl = c["metrics"]["kl"].as_f64().unwrap();
    assert!(kl.is_finite() && kl > 0.0 && kl < 1.0, "kvcompose {kl}");
    let per: Vec<u64> = c["memory"]["per_layer_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert!(
        per.iter().all(|&n| n <= per[0]) && per.iter().any(|&n| n < per[0]),
        "{per:?}"
    );
    let pat = |n: &str| {
        let out = dir.join(n);
        let (ok, _, err) = minikv(&[
            "calibrate",
            "duo",
            "--context",
            "256",
            "--trials",
            "1",
            "--seed",
            "3",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(ok, "{err}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        (out, v)
    };
    let ((p1, v1), (_, v2)) = (pat("a.json"), pat("b.json"));
    assert_eq!(v1["scores"], v2["scores"]);
    let s = v1["scores"].as_array().unwrap();
    assert_eq!(s.len(), 30);
    assert!(s.iter().all(|l| l.as_array().unwrap().len() == 3));
    let duo = cfg(
        "duo.toml",
        &format!(
            "[cache]\nsinks = 4\nheavy_tokens = 0\nrecent_tokens = 64\nscorer = {{ type = \"recency\" }}\nselector = {{ type = \"duo_attention\", pattern = \"{}\", retrieval_fraction = 0.25 }}\n",
            p1.display()
        ),
    );
    let d = eval(&duo);
    let toks: Vec<u64> = d["memory"]["per_layer_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    // All-streaming layers hold 4 + 64 tokens per head plus the decoded
    // ones; layers with a retrieval head hold the whole prompt there.
    assert!(
        toks.iter().any(|&n| n < 3 * 80) && toks.iter().any(|&n| n > 384),
        "{toks:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Q-Filters end to end on the real model: `minikv calibrate qfilters`
/// writes 30 x 3 unit directions of dimension 64, the same twice; a cache
/// scoring with that file keeps half the prompt with a KL well below key
/// norm's at the same budget (the committed preset, too); a text too short
/// for the chunks asked is a clear error.
#[test]
fn q_filters_calibrate_and_score_on_the_real_model() {
    let dir = std::env::temp_dir().join(format!("minikv-qfilters-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = "assets/paul_graham/avg.txt";
    let calibrate = |n: &str| {
        let out = dir.join(n);
        let (ok, _, err) = minikv(&[
            "calibrate",
            "qfilters",
            "--text",
            text,
            "--context",
            "256",
            "--chunks",
            "2",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(ok, "{err}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        (out, v)
    };
    let ((p1, v1), (_, v2)) = (calibrate("a.json"), calibrate("b.json"));
    assert_eq!(v1["filters"], v2["filters"]);
    let layers = v1["filters"].as_array().unwrap();
    assert_eq!(layers.len(), 30);
    for heads in layers {
        let heads = heads.as_array().unwrap();
        assert_eq!(heads.len(), 3);
        for u in heads {
            let u: Vec<f64> = u
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert_eq!(u.len(), 64);
            let n = u.iter().map(|x| x * x).sum::<f64>().sqrt();
            assert!((n - 1.0).abs() < 1e-4, "{n}");
        }
    }
    assert!(
        v1["explained"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|l| l.as_array().unwrap())
            .all(|x| (0.0..=1.0).contains(&x.as_f64().unwrap()))
    );
    let cfg = |name: &str, scorer: &str| {
        let p = dir.join(name);
        std::fs::write(
            &p,
            format!("[cache]\nheavy = 0.5\nrecent_tokens = 0\nscorer = {scorer}\n"),
        )
        .unwrap();
        p.to_string_lossy().into_owned()
    };
    let kl = |c: &str| {
        ok_json(&[
            "eval",
            "--config",
            c,
            "--task",
            "fidelity",
            "--context",
            "384",
            "--tokens",
            "6",
            "--json",
        ])["metrics"]["kl"]
            .as_f64()
            .unwrap()
    };
    let q = kl(&cfg(
        "q.toml",
        &format!("{{ type = \"q_filter\", filters = \"{}\" }}", p1.display()),
    ));
    let knorm = kl(&cfg("k.toml", "{ type = \"key_norm\" }"));
    let preset = kl("configs/kvpress/qfilter.toml");
    assert!(
        q.is_finite() && q > 0.0 && q < 0.5 * knorm,
        "q-filters {q}, key norm {knorm}"
    );
    assert!(
        preset.is_finite() && preset < 0.5 * knorm,
        "preset {preset}, key norm {knorm}"
    );
    let (ok, _, err) = minikv(&[
        "calibrate",
        "qfilters",
        "--text",
        text,
        "--context",
        "1024",
        "--chunks",
        "100",
        "--out",
        dir.join("c.json").to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("fewer than --chunks 100"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// LU-KV end to end on the real model: `minikv calibrate lukv` writes a
/// 99 x 30 x 3 curve, the same twice, whose every row keeps `1 - r` of the
/// model's tokens; it records the scorer it was made for. A cache reading it
/// holds ragged layers that add up to the curve's row; a curve of another
/// depth, a missing file and a config without a scorer are clear errors.
#[test]
fn lukv_calibrates_and_splits_budgets_on_the_real_model() {
    let dir = std::env::temp_dir().join(format!("minikv-lukv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let calibrate = |n: &str, extra: &[&str]| {
        let out = dir.join(n);
        let mut args = vec![
            "calibrate",
            "lukv",
            "--text",
            "assets/paul_graham/avg.txt",
            "--context",
            "256",
            "--future",
            "32",
            "--chunks",
            "1",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let (ok, _, err) = minikv(&args);
        assert!(ok, "{err}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        (out, v)
    };
    let ((p1, v1), (_, v2)) = (calibrate("a.json", &[]), calibrate("b.json", &[]));
    assert_eq!(v1["prune"], v2["prune"]);
    assert_eq!(v1["scorer"]["type"], "expected_attention");
    assert!((v1["scorer"]["epsilon"].as_f64().unwrap() - 0.02).abs() < 1e-7);
    assert_eq!(v1["calibration"]["normalize"], "layer");
    let rows = v1["prune"].as_array().unwrap();
    assert_eq!(rows.len(), 99);
    for (i, row) in rows.iter().enumerate() {
        let layers = row.as_array().unwrap();
        assert_eq!(layers.len(), 30);
        let kept: f64 = layers
            .iter()
            .flat_map(|l| l.as_array().unwrap())
            .map(|p| {
                let p = p.as_f64().unwrap();
                assert!((0.0..=1.0).contains(&p), "{p}");
                1.0 - p
            })
            .sum();
        let want = 90.0 * (1.0 - (i + 1) as f64 / 100.0);
        assert!((kept - want).abs() < 1e-3, "row {i}: {kept} against {want}");
    }
    let (_, raw) = calibrate("raw.json", &["--normalize", "none"]);
    assert_ne!(raw["prune"], v1["prune"]);
    assert_eq!(raw["calibration"]["normalize"], "none");
    let cfg = |name: &str, curve: &std::path::Path| {
        let p = dir.join(name);
        std::fs::write(
            &p,
            format!(
                "[cache]\nheavy = 0.5\nrecent_tokens = 1\nsinks = 4\nscorer = {{ type = \"expected_attention\", epsilon = 0.02 }}\nselector = {{ type = \"lukv\", curve = \"{}\" }}\n",
                curve.display()
            ),
        )
        .unwrap();
        p.to_string_lossy().into_owned()
    };
    let eval = |c: &str| {
        minikv(&[
            "eval",
            "--config",
            c,
            "--task",
            "fidelity",
            "--context",
            "384",
            "--tokens",
            "6",
            "--json",
        ])
    };
    let (ok, out, err) = eval(&cfg("lukv.toml", &p1));
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["metrics"]["kl"].as_f64().unwrap().is_finite());
    let per: Vec<f64> = v["memory"]["per_layer_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert!(per.iter().any(|&n| n != per[0]), "{per:?}");
    // 4 sinks + 192 + 1 of 384 tokens: row round(100 (1 - 197/384)) - 1 =
    // 48 (ratio 0.49), every head keeps its share of the prompt, plus the
    // 5 decoded tokens (the prefill predicts the first).
    let prompt_rows: f64 = per.iter().map(|n| n - 3.0 * 5.0).sum();
    let row: f64 = rows[48]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l.as_array().unwrap())
        .map(|p| (1.0 - p.as_f64().unwrap()) * 384.0)
        .sum();
    assert!(
        (prompt_rows - row).abs() <= 45.0,
        "{prompt_rows} against {row}"
    );
    assert!((row - 0.51 * 90.0 * 384.0).abs() < 1.0, "{row}");
    // A curve of 29 layers is another model's.
    let mut short = v1.clone();
    for r in short["prune"].as_array_mut().unwrap() {
        r.as_array_mut().unwrap().pop();
    }
    let p29 = dir.join("29.json");
    std::fs::write(&p29, serde_json::to_string(&short).unwrap()).unwrap();
    let (ok, _, err) = eval(&cfg("l29.toml", &p29));
    assert!(
        !ok && err.contains("29 layers") && err.contains("layer 29"),
        "{err}"
    );
    let (ok, _, err) = eval(&cfg("none.toml", &dir.join("missing.json")));
    assert!(
        !ok && err.contains("missing.json") && err.contains("minikv calibrate lukv"),
        "{err}"
    );
    let (ok, _, err) = minikv(&[
        "calibrate",
        "lukv",
        "--config",
        "configs/full.toml",
        "--out",
        dir.join("c.json").to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("has none"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// ResKV on the real model: the proxy gives some heads cluster entries, which
/// reconstruct the held-out attention better than dropping the evicted tokens;
/// the diagnostics the review asks for (eta, numerator / denominator error)
/// are in the row; cluster bytes are counted.
#[test]
fn reskv_runs_on_the_real_model_and_reports_its_statistics() {
    let v = ok_json(&[
        "eval",
        "--config",
        "configs/reskv-snapkv.toml",
        "--task",
        "fidelity",
        "--context",
        "384",
        "--tokens",
        "4",
        "--json",
    ]);
    let m = &v["metrics"];
    let f = |k: &str| m[k].as_f64().unwrap_or_else(|| panic!("{k}: {m}"));
    assert!(f("reskv_clusters") > 0.0, "{m}");
    assert!(
        f("reskv_output_error") < f("reskv_output_error_dropped"),
        "{m}"
    );
    for k in [
        "reskv_eta",
        "reskv_denominator_error",
        "reskv_numerator_error",
        "kl",
    ] {
        assert!(f(k).is_finite() && f(k) >= 0.0, "{k}");
    }
    assert_eq!(
        m["reskv_output_error_per_layer"].as_array().unwrap().len(),
        30
    );
    let mem = &v["memory"];
    let b = |k: &str| mem[k].as_u64().unwrap();
    assert!(
        b("clusters") > 0
            && b("kv_bytes_allocated") == b("fp16") + b("clusters") + b("indices") + b("work")
            && b("kv_bytes") <= b("kv_bytes_allocated"),
        "{mem}"
    );
}

#[test]
fn eval_reports_metrics_memory_and_provenance() {
    let v = ok_json(&[
        "eval",
        "--config",
        "configs/minikv.toml",
        "--task",
        "fidelity",
        "--context",
        "96",
        "--tokens",
        "8",
        "--trials",
        "2",
        "--seed",
        "3",
        "--json",
    ]);
    let m = &v["metrics"];
    assert!(m["kl"].as_f64().unwrap() >= 0.0 && m["top1"].as_f64().unwrap() <= 1.0);
    assert_eq!(m["per_trial"].as_array().unwrap().len(), 2);
    assert!(m["kl_ci95"].is_array());
    assert!(v["memory"]["compression_ratio"].as_f64().unwrap() < 1.0);
    assert!(v["wall_s"].as_f64().unwrap() > 0.0);
    assert_eq!(v["provenance"]["seed"], 3);
    let (ok, _, err) = minikv(&["eval", "--task", "fidelity", "--context", "9000"]);
    assert!(!ok && err.contains("exceeds the maximum"), "{err}");
}

/// `eval --ids`: windows cut from a file of token ids (what the kvpress
/// cross-check feeds both sides) give the same numbers as the same tokens
/// from the text; fidelity reports its per-step KL curve; bad id files and
/// tasks that cannot take ids are refused by name.
#[test]
fn eval_takes_token_ids_and_reports_the_kl_curve() {
    let dir = std::env::temp_dir().join(format!("minikv-ids-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = "assets/paul_graham/copy.txt";
    let ids: Vec<u64> = serde_json::from_value(ok_json(&["tokenize", "--text", text])).unwrap();
    let file = dir.join("ids.json");
    std::fs::write(&file, serde_json::to_string(&ids[..120]).unwrap()).unwrap();
    let f = file.to_str().unwrap();
    // The first 120 tokens of the text: `perplexity --prefill` reads the same.
    let direct = ok_json(&[
        "perplexity",
        "--config",
        "configs/snapkv.toml",
        "--text",
        text,
        "--tokens",
        "120",
        "--prefill",
        "96",
        "--json",
    ]);
    let via_ids = ok_json(&[
        "eval",
        "--config",
        "configs/snapkv.toml",
        "--task",
        "perplexity",
        "--ids",
        f,
        "--context",
        "96",
        "--tokens",
        "24",
        "--json",
    ]);
    assert_eq!(via_ids["metrics"]["ppl"], direct["ppl"]);
    let fid = ok_json(&[
        "eval",
        "--config",
        "configs/kvpress/knorm.toml",
        "--task",
        "fidelity",
        "--ids",
        f,
        "--context",
        "96",
        "--tokens",
        "24",
        "--json",
    ]);
    let m = &fid["metrics"];
    let steps: Vec<f64> = serde_json::from_value(m["kl_per_step"].clone()).unwrap();
    assert_eq!(steps.len(), 24);
    // The first prediction comes from the prefill, before compression.
    assert_eq!(steps[0], 0.0);
    assert!(steps[1..].iter().any(|&k| k > 0.0));
    let mean = steps.iter().sum::<f64>() / 24.0;
    assert!((mean - m["kl"].as_f64().unwrap()).abs() < 1e-12);
    // Refused by name.
    std::fs::write(dir.join("bad.json"), "[1, 2, \"x\"]").unwrap();
    std::fs::write(dir.join("big.json"), "[1, 2, 99999999]").unwrap();
    let (bad, big) = (dir.join("bad.json"), dir.join("big.json"));
    let (bad, big) = (bad.to_str().unwrap(), big.to_str().unwrap());
    for (args, msg) in [
        (vec!["--ids", bad], "expected a JSON array of token ids"),
        (
            vec!["--ids", big],
            "token id 99999999 at index 2 is outside the vocabulary",
        ),
        (vec!["--ids", f, "--text", text], "cannot be used with"),
    ] {
        let mut a = vec![
            "eval",
            "--task",
            "fidelity",
            "--context",
            "8",
            "--tokens",
            "2",
        ];
        a.extend(args);
        let (ok, _, err) = minikv(&a);
        assert!(!ok && err.contains(msg), "{a:?}: {err}");
    }
    let (ok, _, err) = minikv(&["eval", "--task", "passkey", "--ids", f, "--context", "64"]);
    assert!(!ok && err.contains("not `passkey`"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A tiny sweep end to end; a rerun adds nothing; after a simulated kill (last
/// row lost, a torn half line left) the rerun completes only the missing row.
#[test]
fn sweep_is_resumable_and_never_duplicates() {
    let dir = std::env::temp_dir().join(format!("minikv-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("r.jsonl");
    let o = out.to_str().unwrap();
    let args = [
        "sweep",
        "configs/minikv.toml",
        "--set",
        "cache.heavy=0.1,0.25",
        "--task",
        "fidelity",
        "--context",
        "64",
        "--tokens",
        "4",
        "--quiet",
        "--out",
        o,
    ];
    let run = || {
        let (ok, _, err) = minikv(&args);
        assert!(ok, "{err}");
        let text = std::fs::read_to_string(&out).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .collect::<Vec<_>>()
    };
    let rows = run();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert_eq!(
            r["model_sha256"],
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
        );
        assert!(
            r["metrics"]["kl"].as_f64().is_some() && r["memory"]["kv_bytes"].as_u64().unwrap() > 0
        );
        assert!(
            r["config"]["cache"]["heavy"].is_number()
                && r["config_hash"].is_string()
                && r["git_rev"].is_string()
        );
    }
    assert_eq!(run().len(), 2, "a finished sweep reruns to nothing");
    let text = std::fs::read_to_string(&out).unwrap();
    let first = text.lines().next().unwrap().to_string();
    std::fs::write(&out, format!("{first}\n{{\"key\": \"torn")).unwrap();
    let rows = run();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        serde_json::to_string(&rows[0]).unwrap(),
        serde_json::to_string(&serde_json::from_str::<serde_json::Value>(&first).unwrap()).unwrap()
    );
    assert_ne!(rows[0]["key"], rows[1]["key"]);
    let (ok, _, err) = minikv(&[
        "sweep",
        "configs/minikv.toml",
        "--set",
        "cache.heavy=1.5",
        "--task",
        "fidelity",
        "--out",
        o,
    ]);
    assert!(!ok && err.contains("cache.heavy"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Report of a committed sweep with labels, per-trial outcomes and per-layer
/// figures (attention-error, fidelity, passkey; 2 configs x 2 seeds x 2 trials):
/// tables with intervals and paired differences as a snapshot, per-layer plots.
#[test]
fn report_pairs_and_per_layer_plots() {
    let dir = report_fixture(
        "sweep_tasks.jsonl",
        "report2",
        &[
            "--pair",
            "minikv policy.type=pyramid vs minikv policy.type=uniform",
        ],
    );
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    insta::assert_snapshot!("report_tasks_md", read("report.md"));
    for f in ["per_layer_budgets.svg", "attention_error_per_layer.svg"] {
        let svg = read(f);
        assert!(
            svg.contains("minikv policy.type=pyramid")
                && svg.contains("minikv policy.type=uniform"),
            "{f}"
        );
        assert_eq!(
            svg.matches("stroke-width=\"2\" points").count(),
            2 + 2,
            "{f}: two lines, two legend marks"
        );
    }
    let (ok, _, err) = minikv(&[
        "report",
        "minikv-cli/tests/fixtures/sweep_tasks.jsonl",
        "--out",
        dir.to_str().unwrap(),
        "--pair",
        "nope vs minikv policy.type=uniform",
    ]);
    assert!(!ok && err.contains("`nope` matches no row"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Report of a committed sweep fixture: tables and leaderboard as snapshots, a plot.
#[test]
fn report_tables_and_plot() {
    let dir = report_fixture("sweep_fidelity.jsonl", "report", &[]);
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    insta::assert_snapshot!("report_md", read("report.md"));
    insta::assert_snapshot!("report_leaderboard_csv", read("leaderboard.csv"));
    assert!(read("results.csv").starts_with("task,method,metric,mean,ci95"));
    let svg = read("fidelity_vs_kv_bytes.svg");
    assert!(svg.starts_with("<svg") && svg.contains("kivi K2ch V2"));
    std::fs::remove_dir_all(&dir).ok();
}

/// `sweep --json` progress lines; the shared full-cache reference (in memory
/// and on disk) gives exactly the numbers of a plain `eval`; attention-error
/// rows carry per-layer errors (0 for the full cache, > 0 for 2-bit MiniKV)
/// and per-layer budgets.
#[test]
fn sweep_json_progress_shared_reference_and_attention_error() {
    let dir = std::env::temp_dir().join(format!("minikv-sweep-json-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("r.jsonl");
    let refs = dir.join("refs");
    let (ok, stdout, err) = minikv(&[
        "sweep",
        "configs/minikv.toml",
        "--set",
        "cache.heavy=0.1,0.25",
        "--task",
        "fidelity",
        "--task",
        "attention-error",
        "--context",
        "96",
        "--tokens",
        "4",
        "--trials",
        "2",
        "--json",
        "--reference-cache",
        refs.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let events: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), 1 + 4 + 1, "{stdout}");
    assert_eq!(
        (events[0]["event"].as_str(), events[0]["todo"].as_u64()),
        (Some("start"), Some(4))
    );
    for (i, e) in events[1..5].iter().enumerate() {
        assert_eq!(e["event"], "row");
        assert_eq!(
            (e["done"].as_u64(), e["total"].as_u64()),
            (Some(i as u64 + 1), Some(4))
        );
        assert!(e["eta_s"].as_f64().unwrap() >= 0.0);
    }
    assert_eq!(events[5]["event"], "end");
    // Two text windows: two reference files, shared by both grid points.
    assert_eq!(std::fs::read_dir(&refs).unwrap().count(), 2);
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let fid = rows
        .iter()
        .find(|r| r["task"] == "fidelity" && r["label"] == "minikv heavy=0.25")
        .unwrap();
    // The same windows through `eval` (no shared reference): identical numbers.
    let (ok, plain, err) = minikv(&[
        "eval",
        "--config",
        "configs/minikv.toml",
        "--task",
        "fidelity",
        "--context",
        "96",
        "--tokens",
        "4",
        "--trials",
        "2",
        "--json",
    ]);
    assert!(ok, "{err}");
    let plain: serde_json::Value = serde_json::from_str(&plain).unwrap();
    assert_eq!(plain["metrics"]["kl"], fid["metrics"]["kl"]);
    assert_eq!(plain["metrics"]["top1"], fid["metrics"]["top1"]);
    for r in rows.iter().filter(|r| r["task"] == "attention-error") {
        let pl = r["metrics"]["per_layer"].as_array().unwrap();
        assert_eq!(pl.len(), 30);
        assert!(
            pl.iter()
                .all(|x| x.as_f64().unwrap() > 0.0 && x.as_f64().unwrap() < 2.0),
            "{pl:?}"
        );
        let toks = r["memory"]["per_layer_tokens"].as_array().unwrap();
        assert_eq!(toks.len(), 30);
        let held: u64 = toks.iter().map(|x| x.as_u64().unwrap()).sum();
        // 3 KV heads x 30 layers, at most the 100 tokens seen, fewer when evicting.
        assert!(held > 0 && held < 3 * 30 * 100, "{held}");
    }
    // The full cache shadowing the full cache: no error at all.
    let (ok, full, err) = minikv(&[
        "eval",
        "--task",
        "attention-error",
        "--context",
        "96",
        "--tokens",
        "2",
        "--json",
    ]);
    assert!(ok, "{err}");
    let full: serde_json::Value = serde_json::from_str(&full).unwrap();
    assert_eq!(full["metrics"]["rel_error"].as_f64(), Some(0.0), "{full}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--emit slurm` writes one validated config per grid point, an array job and a merge script.
#[test]
fn sweep_emits_a_slurm_array_job() {
    let dir = std::env::temp_dir().join(format!("minikv-slurm-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    let (ok, _, err) = minikv(&[
        "sweep",
        "configs/minikv.toml",
        "--set",
        "cache.policy.type=uniform,pyramid",
        "--set",
        "cache.heavy=0.1,0.25,0.5",
        "--seeds",
        "2",
        "--task",
        "fidelity",
        "--out",
        "unused.jsonl",
        "--emit",
        "slurm",
        d,
    ]);
    assert!(ok, "{err}");
    let mut points: Vec<_> = std::fs::read_dir(dir.join("configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    points.sort();
    assert_eq!(points.len(), 6);
    for p in &points {
        let (ok, out, err) = minikv(&["config", "check", p.to_str().unwrap()]);
        assert!(ok && out.contains("[cache.policy]"), "{err}");
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("configs/point_0004.label")).unwrap(),
        "minikv policy.type=pyramid heavy=0.25"
    );
    let sb = std::fs::read_to_string(dir.join("run.sbatch")).unwrap();
    assert!(
        sb.contains("#SBATCH --array=0-5")
            && sb.contains("--seeds 2")
            && sb.contains("--task 'fidelity'"),
        "{sb}"
    );
    assert!(
        sb.contains(&format!("#SBATCH --output={d}/results/")),
        "{sb}"
    );
    assert!(
        std::fs::read_to_string(dir.join("merge.sh"))
            .unwrap()
            .contains("report")
    );
    assert!(
        !root().join("unused.jsonl").exists(),
        "--emit must not run the sweep"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Files under `--reference-cache` carry their key and a checksum: a
/// corrupted or foreign file is detected, recomputed (with a warning) and
/// never changes a result.
#[test]
fn reference_cache_files_are_checked() {
    let dir = std::env::temp_dir().join(format!("minikv-refcheck-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let refs = dir.join("refs");
    let run = |out: &str| {
        let out = dir.join(out);
        let (ok, _, err) = minikv(&[
            "sweep",
            "configs/snapkv.toml",
            "--task",
            "fidelity",
            "--context",
            "96",
            "--tokens",
            "4",
            "--quiet",
            "--reference-cache",
            refs.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(ok, "{err}");
        let row: serde_json::Value = serde_json::from_str(
            std::fs::read_to_string(&out)
                .unwrap()
                .lines()
                .next()
                .unwrap(),
        )
        .unwrap();
        (row["metrics"]["kl"].as_f64().unwrap(), err)
    };
    let (kl, _) = run("a.jsonl");
    let files: Vec<_> = std::fs::read_dir(&refs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1);
    // Flip one byte of the logits.
    let mut b = std::fs::read(&files[0]).unwrap();
    let i = b.len() - 7;
    b[i] ^= 0x40;
    std::fs::write(&files[0], &b).unwrap();
    let (kl2, err) = run("b.jsonl");
    assert!(err.contains("checksum mismatch"), "{err}");
    assert_eq!(kl, kl2);
    // The file was rewritten and is used silently now.
    let (kl3, err) = run("c.jsonl");
    assert!(!err.contains("warning"), "{err}");
    assert_eq!(kl, kl3);
    std::fs::remove_dir_all(&dir).ok();
}

/// Results files survive what broke them before: a bad line anywhere no
/// longer costs the rows after it (other grids' rows included), a line that
/// is not UTF-8 no longer makes the file read as empty, two sweeps writing one
/// file at once write each key once, and a sweep killed mid-run resumes.
#[test]
fn sweep_results_survive_corruption_kills_and_races() {
    use std::collections::HashMap;
    use std::io::Write;
    let dir = std::env::temp_dir().join(format!("minikv-chaos-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let x = dir.join("x.jsonl");
    let o = dir.join("o.jsonl");
    let sweep = |set: &str, out: &Path| -> Vec<String> {
        vec![
            "sweep".into(),
            "configs/minikv.toml".into(),
            "--set".into(),
            set.into(),
            "--task".into(),
            "fidelity".into(),
            "--context".into(),
            "64".into(),
            "--tokens".into(),
            "4".into(),
            "--quiet".into(),
            "--out".into(),
            out.to_string_lossy().into_owned(),
        ]
    };
    let go = |a: &[String]| {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let (ok, _, err) = minikv(&a);
        assert!(ok, "{err}");
        err
    };
    let keys = |p: &Path| -> HashMap<String, usize> {
        let mut m = HashMap::new();
        for l in std::fs::read_to_string(p).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            *m.entry(v["key"].as_str().unwrap().to_string()).or_default() += 1;
        }
        m
    };
    go(&sweep("cache.heavy=0.1", &x));
    go(&sweep("cache.recent=0.1", &o));
    // A bad line, then another grid's rows, appended.
    let other = std::fs::read_to_string(&o).unwrap();
    let mut f = std::fs::OpenOptions::new().append(true).open(&x).unwrap();
    write!(f, "bad\n{other}").unwrap();
    f.write_all(&[0xff, 0xfe, b'\n']).unwrap(); // not UTF-8
    drop(f);
    let err = go(&sweep("cache.heavy=0.1,0.2", &x));
    assert!(err.contains("moved to") && err.contains("line 2"), "{err}");
    let text = std::fs::read_to_string(&x).unwrap();
    assert_eq!(
        text.matches("recent=0.1").count(),
        1,
        "the other grid's row is kept"
    );
    assert_eq!(
        text.matches("heavy=0.1").count(),
        1,
        "heavy=0.1 not run again"
    );
    assert_eq!(text.lines().count(), 3);
    let rejected = std::fs::read_to_string(dir.join("x.jsonl.rejected")).unwrap();
    assert_eq!(rejected.lines().count(), 2, "{rejected}");
    assert!(
        rejected.contains("\"line\":2") && rejected.contains("UTF-8"),
        "{rejected}"
    );

    // Two sweeps of one grid into one file at the same time: one row per key.
    let r = dir.join("race.jsonl");
    let args = sweep("cache.heavy=0.05,0.1,0.15,0.2", &r);
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_minikv"))
            .args(&args)
            .current_dir(root())
            .spawn()
            .unwrap()
    };
    let (mut a, mut b) = (spawn(), spawn());
    assert!(a.wait().unwrap().success() && b.wait().unwrap().success());
    let k = keys(&r);
    assert_eq!(k.len(), 4);
    assert!(k.values().all(|&n| n == 1), "{k:?}");

    // Killed after its first row: the rerun completes, one row per key.
    let kfile = dir.join("kill.jsonl");
    let args = sweep("cache.heavy=0.05,0.1,0.15,0.2", &kfile);
    let mut child = Command::new(env!("CARGO_BIN_EXE_minikv"))
        .args(&args)
        .current_dir(root())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&kfile).map_or(0, |t| t.lines().count()) < 1
        && t0.elapsed().as_secs() < 120
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    go(&args);
    let k = keys(&kfile);
    assert_eq!(k.len(), 4);
    assert!(k.values().all(|&n| n == 1), "{k:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The report of a real main-job run (scripts/demo.sh, committed rows): every
/// row carries an interval (windows or trials), labels are the readable ones
/// the job gives, and a RULER-style task sits beside the others.
#[test]
fn main_job_report_has_intervals_everywhere() {
    let dir = report_fixture(
        "main_job.jsonl",
        "mainjob",
        &["--pair", "MiniKV 2-bit pyramid vs MiniKV 2-bit"],
    );
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(!md.contains("n/a"), "a row without an interval:\n{md}");
    for want in [
        "## ruler-niah-single-number",
        "| full cache |",
        "| MiniKV 2-bit pyramid |",
        "## passkey",
    ] {
        assert!(md.contains(want), "{want} missing:\n{md}");
    }
    insta::assert_snapshot!("main_job_report_md", md);
    std::fs::remove_dir_all(&dir).ok();
}

/// Gemma 3 from the CLI by its short name: generation identical to llama.cpp's
/// greedy continuation (committed reference), token ids, llama-perplexity's
/// protocol, and a compressed eval whose memory report shows both layer kinds.
#[test]
fn gemma3_end_to_end_from_the_cli() {
    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("reference/gemma3/llamacpp.json")).unwrap(),
    )
    .unwrap();
    let g = &r["greedy"][0];
    let v = ok_json(&[
        "generate",
        "--model",
        "gemma3-270m",
        "--prompt",
        g["prompt"].as_str().unwrap(),
        "--max-tokens",
        "32",
        "--json",
    ]);
    assert_eq!(v["text"], g["exact"]);
    assert_eq!(v["memory"]["layer_windows"][5], serde_json::Value::Null);
    assert_eq!(v["memory"]["layer_windows"][0], 512);
    let t = &r["tokenize"][5];
    let ids = ok_json(&[
        "tokenize",
        "--model",
        "gemma3-270m",
        "--prompt",
        t["text"].as_str().unwrap(),
    ]);
    assert_eq!(ids, t["ids"]);
    let p = ok_json(&[
        "perplexity",
        "--model",
        "gemma3-270m",
        "--text",
        "assets/paul_graham/addiction.txt",
        "--ctx",
        "512",
        "--chunks",
        "1",
        "--json",
    ]);
    let first = r["perplexity"]["exact"]["running"][0].as_f64().unwrap();
    assert!(
        (p["ppl"].as_f64().unwrap() / first - 1.0).abs() < 0.005,
        "{p}"
    );
    // MiniKV on a 1024-token context: the three global layers are compressed
    // and quantized; the 15 rings hold 512 fp16 tokens each.
    let e = ok_json(&[
        "eval",
        "--model",
        "gemma3-270m",
        "--config",
        "configs/minikv.toml",
        "--task",
        "fidelity",
        "--context",
        "1024",
        "--tokens",
        "8",
        "--json",
    ]);
    let mem = &e["memory"];
    let ring = 15 * 2 * 2 * 256 * 512;
    let window = mem["window_layers_kv_bytes"].as_u64().unwrap() as usize;
    assert!(window >= ring && window < ring + ring / 8, "{mem}");
    let global = mem["global_layers_kv_bytes"].as_u64().unwrap() as usize;
    assert!(global < 3 * 2 * 2 * 256 * 1032 / 4, "{mem}");
    assert!(e["metrics"]["kl"].as_f64().unwrap().is_finite(), "{e}");
    let (ok, _, err) = minikv(&[
        "generate",
        "--model",
        "gemma3-270m",
        "--prompt",
        "x",
        "--config",
        "configs/quest.toml",
    ]);
    assert!(ok, "{err}");
}

/// Gemma 3 with `--activations q8`: every product of a short prompt and of
/// decode (the `Q8_0` head, the `Q5_0`, `Q4_K` and `Q6_K` projections) in
/// 8-bit integer dots, as llama.cpp computes by default. Where llama.cpp's
/// default run and its exact one part at the very first generated token
/// (a reference prompt found by that property), minikv's exact run follows
/// llama.cpp's exact one and its q8 run llama.cpp's default one, for 32
/// characters or more; with the f32 products (or only the head in 8 bits)
/// the q8 run followed the exact one. Perplexity stays within 1% of exact.
#[test]
fn gemma3_q8_activations_follow_llamacpp_default() {
    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("reference/gemma3/llamacpp.json")).unwrap(),
    )
    .unwrap();
    let first = |t: &serde_json::Value| t.as_str().unwrap().chars().next();
    let g = r["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| first(&g["default"]) != first(&g["exact"]))
        .expect("a prompt where llama.cpp's two runs part at once");
    let run = |act: &str| {
        let v = ok_json(&[
            "generate",
            "--model",
            "gemma3-270m",
            "--prompt",
            g["prompt"].as_str().unwrap(),
            "--max-tokens",
            "32",
            "--activations",
            act,
            "--json",
        ]);
        v["text"].as_str().unwrap().to_string()
    };
    let shared = |a: &str, b: &serde_json::Value| {
        let b = b.as_str().unwrap();
        a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count()
    };
    let (exact, q8) = (run("f32"), run("q8"));
    assert_eq!(exact, g["exact"].as_str().unwrap());
    assert!(
        shared(&q8, &g["default"]) >= 32,
        "{q8:?} vs {}",
        g["default"]
    );
    let ppl = |act: &str| {
        let p = ok_json(&[
            "perplexity",
            "--model",
            "gemma3-270m",
            "--text",
            "assets/paul_graham/addiction.txt",
            "--tokens",
            "160",
            "--prefill",
            "32",
            "--activations",
            act,
            "--json",
        ]);
        p["decode_ppl"].as_f64().unwrap()
    };
    let (exact, q8) = (ppl("f32"), ppl("q8"));
    assert!(
        exact != q8 && (q8 / exact - 1.0).abs() < 0.01,
        "{exact} {q8}"
    );
}

/// The CUDA backend's host code and kernels on the real model, from the CLI,
/// under the CPU emulation of CUDA (`backend = "cuda-emulated"`): MiniKV's
/// selection, 2-bit device quantization (a small residual so that codes are
/// written) and fused decode give the same greedy tokens and the same bytes
/// held as the CPU backend; `bench attention --backend` runs on it; without a
/// driver `backend = "cuda"` is a clear error.
#[test]
fn cuda_backend_under_emulation_on_the_real_model() {
    let dir = std::env::temp_dir().join(format!("minikv-cuda-emu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let body = "seed = 0\n[cache]\nheavy = 0.25\nrecent = 0.25\nscorer = { type = \"cumulative_attention\" }\npolicy = { type = \"uniform\" }\n[cache.quant]\nresidual = 16\nresidual_mode = \"minikv\"\nkeys = { type = \"minmax\", bits = 2, group = 16, axis = \"channel\" }\nvalues = { type = \"minmax\", bits = 2, group = 16, axis = \"token\" }\n";
    let prompt = "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: once or twice she had peeped into the book her sister was reading";
    // Greedy generation of 8 tokens with `cfg` written to `name` first.
    let generate = |name: &str, cfg: &str| {
        let p = dir.join(name);
        std::fs::write(&p, cfg).unwrap();
        ok_json(&[
            "generate",
            "--config",
            p.to_str().unwrap(),
            "--prompt",
            prompt,
            "--max-tokens",
            "8",
            "--json",
        ])
    };
    let mut runs = Vec::new();
    for backend in ["cuda-emulated", "tiled"] {
        let cfg = format!("backend = \"{backend}\"\n{body}");
        runs.push(generate(&format!("{backend}.toml"), &cfg));
    }
    let (gpu, cpu) = (&runs[0], &runs[1]);
    assert_eq!(gpu["tokens"], cpu["tokens"]);
    assert_eq!(gpu["memory"]["kv_bytes"], cpu["memory"]["kv_bytes"]);
    assert!(gpu["memory"]["quant_codes"].as_u64().unwrap() > 0, "{gpu}");
    assert_eq!(gpu["provenance"]["config"]["backend"], "cuda-emulated");
    // The staged decode kernel (MINIKV_CUDA_DECODE=staged) and the
    // pipelined prefill (MINIKV_CUDA_PREFILL=pipelined, A_cumul included,
    // so MiniKV selects the same tokens): the same tokens; an unknown
    // kernel or path name is a clear error.
    let emulated = dir.join("cuda-emulated.toml");
    let with_env = |var: &str, value: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_minikv"))
            .current_dir(minikv_test_support::root())
            .env(var, value)
            .args(["generate", "--config", emulated.to_str().unwrap()])
            .args(["--prompt", prompt])
            .args(["--max-tokens", "8", "--json"])
            .output()
            .unwrap()
    };
    for (var, value, typo) in [
        ("MINIKV_CUDA_DECODE", "staged", "stagged"),
        ("MINIKV_CUDA_PREFILL", "pipelined", "pipelnied"),
    ] {
        let o = with_env(var, value);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let run: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(run["tokens"], cpu["tokens"], "{var}={value}");
        let o = with_env(var, typo);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && e.contains(&format!("\"{typo}\"")),
            "{e}"
        );
    }
    let b = ok_json(&[
        "bench",
        "attention",
        "--tokens",
        "300",
        "--backend",
        "cuda-emulated",
        "--seconds",
        "0.01",
        "--json",
    ]);
    assert_eq!(b["backend"], "cuda-emulated");
    // fp16, then per bit width exact and int8 (integer key products on the
    // CUDA backend), every row timed.
    let rows = b["results"].as_array().unwrap();
    assert_eq!(rows.len(), 5, "{b}");
    assert_eq!(rows.iter().filter(|r| r["arithmetic"] == "int8").count(), 2);
    for r in rows {
        assert!(r["seconds_per_token"].as_f64().unwrap() > 0.0, "{r}");
    }
    // `arithmetic = "int8"` on both quantizers: the CUDA backend's integer
    // key products give the CPU's int8 greedy tokens on this prompt.
    let int8 = |backend: &str| {
        let cfg = format!("backend = \"{backend}\"\n{body}")
            .replace("channel\" }", "channel\", arithmetic = \"int8\" }")
            .replace("token\" }", "token\", arithmetic = \"int8\" }");
        assert_eq!(cfg.matches("int8").count(), 2, "{cfg}");
        generate(&format!("{backend}-int8.toml"), &cfg)
    };
    let (gpu8, cpu8) = (int8("cuda-emulated"), int8("tiled"));
    assert_eq!(gpu8["tokens"], cpu8["tokens"]);
    assert_eq!(
        gpu8["provenance"]["config"]["cache"]["quant"]["keys"]["arithmetic"],
        "int8"
    );
    let p = dir.join("cuda.toml");
    std::fs::write(&p, format!("backend = \"cuda\"\n{body}")).unwrap();
    let (ok, _, err) = minikv(&[
        "generate",
        "--config",
        p.to_str().unwrap(),
        "--prompt",
        "Hi",
    ]);
    if !ok {
        assert!(err.contains("backend `cuda`"), "{err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `--activations q8` (llama.cpp's 8-bit activation arithmetic for decode
/// matvecs) takes effect on the real model, stays close to the exact default,
/// and is recorded in the provenance; the exact default records nothing; an
/// unknown mode is a clear error.
#[test]
fn q8_activations_on_the_real_model() {
    let run = |act: &str| {
        ok_json(&[
            "perplexity",
            "--text",
            "assets/paul_graham/addiction.txt",
            "--tokens",
            "192",
            "--prefill",
            "64",
            "--activations",
            act,
            "--json",
        ])
    };
    let (exact, q8) = (run("f32"), run("q8"));
    let (pe, pq) = (
        exact["decode_ppl"].as_f64().unwrap(),
        q8["decode_ppl"].as_f64().unwrap(),
    );
    // The prefill (a matmul) is exact in both; the 128 decoded tokens differ.
    assert_eq!(exact["prefill_tokens"], q8["prefill_tokens"]);
    assert_ne!(pe, pq, "q8 activations must change the decode arithmetic");
    assert!((pq / pe - 1.0).abs() < 0.02, "exact {pe}, q8 {pq}");
    assert_eq!(q8["provenance"]["activations"], "q8");
    assert!(exact["provenance"].get("activations").is_none());
    let (ok, _, err) = minikv(&["perplexity", "--activations", "q4"]);
    assert!(!ok && err.contains("expected f32 or q8"), "{err}");
}

/// `bench throughput` on the real model: at one KV budget, MiniKV (2-bit,
/// half the prompt kept) admits more sequences than the full cache, every
/// request finishes, nothing exceeds the budget or its projection, and the
/// result carries its provenance.
#[test]
fn bench_throughput_admits_by_kv_bytes() {
    let v = ok_json(&[
        "bench",
        "throughput",
        "--prompt",
        "600",
        "--gen",
        "4",
        "--requests",
        "6",
        "--kv-budget",
        "2xfull",
        "--config",
        "configs/full.toml",
        "--config",
        "configs/minikv.toml",
        "--max-batch",
        "6",
        "--json",
    ]);
    assert_eq!(v["bench"], "throughput");
    assert!(v["model_sha256"].as_str().is_some_and(|s| s.len() == 64));
    assert!(v["git_rev"].is_string());
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    let get = |i: usize, k: &str| rows[i][k].as_f64().unwrap();
    for r in rows {
        let f = |k: &str| r[k].as_f64().unwrap();
        assert!(f("peak_kv_bytes") <= f("kv_budget"));
        assert_eq!(f("over_projection"), 0.0);
        assert!(f("generated_tok_per_s") > 0.0);
        assert!(r["ttft_p50_s"].as_f64().is_some());
    }
    assert_eq!(rows[0]["config"], "full");
    assert_eq!(get(0, "admissible"), 2.0);
    assert_eq!(get(0, "peak_running"), 2.0, "the full cache: two at a time");
    assert!(
        get(1, "admissible") >= 4.0,
        "MiniKV admits at least twice as many"
    );
    assert!(get(1, "peak_running") > get(0, "peak_running"));
}

#[test]
fn bench_throughput_rejects_bad_budgets() {
    for (bad, msg) in [
        ("12XB", "unknown unit"),
        ("0", "between 1 byte"),
        ("3..5MiB", "expected a size"),
        ("0xfull", "must be in (0, 1e6]"),
        ("nanxfull", "must be in (0, 1e6]"),
    ] {
        let (ok, _, err) = minikv(&["bench", "throughput", "--kv-budget", bad]);
        assert!(!ok, "{bad} accepted");
        assert!(err.contains(msg), "{bad}: {err}");
    }
    // A request that can never fit is refused up front, naming the budget.
    let (ok, _, err) = minikv(&[
        "bench",
        "throughput",
        "--kv-budget",
        "100KB",
        "--prompt",
        "64",
        "--gen",
        "4",
        "--requests",
        "1",
    ]);
    assert!(!ok);
    assert!(err.contains("whole KV budget"), "{err}");
}

/// `arithmetic = "int8"` on the quantizers is a config change: it runs end to
/// end on the real model, is recorded in the result's config, changes the
/// numbers (other products) and keeps the fidelity of the exact products
/// (KL within a small margin of theirs).
#[test]
fn int8_products_are_a_config_switch() {
    let base = std::fs::read_to_string(root().join("configs/minikv.toml")).unwrap();
    let int8 = base
        .replace(
            "axis = \"channel\" }",
            "axis = \"channel\", arithmetic = \"int8\" }",
        )
        .replace(
            "axis = \"token\" }",
            "axis = \"token\", arithmetic = \"int8\" }",
        );
    assert_eq!(int8.matches("int8").count(), 2, "{int8}");
    let dir = std::env::temp_dir().join(format!("minikv-int8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("minikv-int8.toml");
    std::fs::write(&cfg, int8).unwrap();
    let run = |c: &str| {
        ok_json(&[
            "eval",
            "--config",
            c,
            "--task",
            "fidelity",
            "--context",
            "320",
            "--tokens",
            "12",
            "--json",
        ])
    };
    let (e, i) = (run("configs/minikv.toml"), run(cfg.to_str().unwrap()));
    let cache = serde_json::to_string(&i["provenance"]["config"]).unwrap();
    assert!(cache.contains("\"arithmetic\":\"int8\""), "{cache}");
    let (ke, ki) = (
        e["metrics"]["kl"].as_f64().unwrap(),
        i["metrics"]["kl"].as_f64().unwrap(),
    );
    assert!(ki.is_finite() && ki != ke, "exact {ke}, int8 {ki}");
    assert!(ki <= ke * 1.25 + 1e-3, "exact {ke}, int8 {ki}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `scripts/gguf-truncate.py` (the GPU bundle's small copy of the real
/// model): keeping every block rewrites the file byte for byte; keeping two
/// gives a model that loads with two layers and the same shapes, and
/// generates; keeping more blocks than the model has is refused.
#[test]
fn gguf_truncation_keeps_the_first_blocks_of_the_real_model() {
    let model = minikv_test_support::smollm2_path();
    let dir = std::env::temp_dir().join(format!("minikv-truncate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let truncate = |out: &Path, blocks: &str| {
        Command::new("python3")
            .arg(root().join("scripts/gguf-truncate.py"))
            .arg(&model)
            .arg(out)
            .arg(blocks)
            .output()
            .unwrap()
    };
    let all = dir.join("all.gguf");
    assert!(truncate(&all, "30").status.success());
    assert!(
        std::fs::read(&all).unwrap() == std::fs::read(&model).unwrap(),
        "keeping all 30 blocks changed the file"
    );
    let two = dir.join("two.gguf");
    assert!(truncate(&two, "2").status.success());
    let full = ok_json(&["info", "--model", model.to_str().unwrap()]);
    let small = ok_json(&["info", "--model", two.to_str().unwrap()]);
    assert_eq!(full["config"]["n_layers"], 30);
    assert_eq!(small["config"]["n_layers"], 2);
    for k in [
        "hidden",
        "head_dim",
        "n_heads",
        "n_kv_heads",
        "ffn",
        "vocab",
    ] {
        assert_eq!(small["config"][k], full["config"][k], "{k}");
    }
    let g = ok_json(&[
        "generate",
        "--model",
        two.to_str().unwrap(),
        "--prompt",
        "Alice was beginning to get very tired",
        "--max-tokens",
        "4",
        "--json",
    ]);
    assert_eq!(g["tokens"].as_array().unwrap().len(), 4);
    let over = truncate(&dir.join("over.gguf"), "31");
    assert!(!over.status.success());
    assert!(String::from_utf8_lossy(&over.stderr).contains("the model has 30"));
    std::fs::remove_dir_all(&dir).ok();
}
