//! Configs: presets resolve (snapshots), bad configs name the field, every
//! registered `type` deserializes, budget tables of every preset (snapshot).

use minikv_core::{BudgetRequest, RunConfig, components};
use minikv_policies as _;
use minikv_policies::budgets::budgets_from_statistics;
use minikv_quant as _;
use std::path::{Path, PathBuf};

/// Every preset: configs/*.toml, then configs/kvpress/*.toml.
fn presets() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    let mut all = Vec::new();
    for dir in [root.clone(), root.join("kvpress")] {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .collect();
        v.sort();
        all.extend(v);
    }
    all
}

/// `snapkv` for configs/snapkv.toml, `kvpress-snapkv` for configs/kvpress/snapkv.toml.
fn name(p: &Path) -> String {
    let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
    match p.parent().and_then(|d| d.file_name()) {
        Some(d) if d == "kvpress" => format!("kvpress-{stem}"),
        _ => stem,
    }
}

#[test]
fn presets_resolve_and_round_trip() {
    for p in presets() {
        let cfg = RunConfig::load(&p).unwrap();
        // TOML and JSON round trips give the same resolved config.
        let toml_back = RunConfig::parse(&cfg.to_toml().unwrap(), false).unwrap();
        let json_back = RunConfig::parse(&serde_json::to_string(&cfg).unwrap(), true).unwrap();
        let v = serde_json::to_value(&cfg).unwrap();
        assert_eq!(v, serde_json::to_value(&toml_back).unwrap());
        assert_eq!(v, serde_json::to_value(&json_back).unwrap());
        // Files named in a preset resolve against its folder: the snapshot
        // shows them from the repository root, as `config check` run there
        // with `configs/...` does.
        let mut v = v;
        strip_prefix(&mut v, &format!("{}/../", env!("CARGO_MANIFEST_DIR")));
        let cfg = RunConfig::parse(&v.to_string(), true).unwrap();
        insta::assert_toml_snapshot!(format!("preset_{}", name(&p)), cfg);
    }
}

fn strip_prefix(v: &mut serde_json::Value, prefix: &str) {
    match v {
        serde_json::Value::String(s) => {
            if let Some(rest) = s.strip_prefix(prefix) {
                *s = rest.to_string();
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(|x| strip_prefix(x, prefix)),
        serde_json::Value::Object(o) => o.values_mut().for_each(|x| strip_prefix(x, prefix)),
        _ => {}
    }
}

fn err(toml: &str) -> String {
    match RunConfig::parse(toml, false).and_then(|mut c| {
        c.resolve()?;
        c.validate(None)
    }) {
        Ok(()) => panic!("config should be rejected:\n{toml}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_configs_name_the_problem() {
    let cases = [
        ("[cache]\nheavvy = 0.2", "heavvy"),
        (
            "[cache]\nscorer = { type = \"snapkvv\" }\nheavy = 0.1",
            "snapkvv",
        ),
        (
            "[cache]\nscorer = { type = \"snapkv\", windw = 3 }\nheavy = 0.1",
            "windw",
        ),
        (
            "[cache]\nheavy = -0.1\nscorer = { type = \"h2o\" }",
            "cache.heavy",
        ),
        (
            "[cache]\nrecent = 1.5\nscorer = { type = \"h2o\" }",
            "cache.recent",
        ),
        (
            "[cache]\nheavy = 0.2\nheavy_tokens = 5\nscorer = { type = \"h2o\" }",
            "not both",
        ),
        ("[cache]\nheavy = 0.2", "cache.scorer"),
        ("[cache]\nscorer = { type = \"h2o\" }", "cache.heavy"),
        (
            "[cache]\nheavy = 0.1\nscorer = { type = \"cumulative_attention\" }\ndecode = \"evict\"",
            "cache.decode",
        ),
        (
            "[cache]\nheavy = 0.1\nscorer = { type = \"h2o\" }\ndecode = \"evict\"\n[cache.quant]\nkeys = { type = \"minmax\", bits = 2, group = 16, axis = \"channel\" }",
            "unsupported combination",
        ),
        (
            "[cache.quant]\nresidual = 100\nkeys = { type = \"minmax\", bits = 2, group = 16, axis = \"channel\" }",
            "cache.quant.residual",
        ),
        (
            "[cache.quant]\nkeys = { type = \"minmax\", bits = 3, group = 16, axis = \"channel\" }",
            "bits",
        ),
        (
            "[cache]\nheavy = 0.1\nscorer = { type = \"snapkv\", kernel = 4 }",
            "cache.scorer.kernel",
        ),
        (
            "[cache]\nheavy = 0.1\nscorer = { type = \"h2o\" }\nselector = { type = \"ada_kv\", alpha = 2.0 }",
            "cache.selector.alpha",
        ),
        ("backend = \"tpu\"", "backend"),
        ("seed = \"x\"", "seed"),
    ];
    for (toml, want) in cases {
        let e = err(toml);
        assert!(
            e.contains(want),
            "{toml:?}: error {e:?} should mention {want:?}"
        );
    }
    // With a model spec, quantizer parameters are checked against the head dim.
    let spec = minikv_core::ModelSpec {
        n_layers: 1,
        n_q_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        max_seq_len: 100,
        windows: Vec::new(),
    };
    let c = RunConfig::parse("[cache.quant]\nresidual = 48\nvalues = { type = \"minmax\", bits = 2, group = 48, axis = \"token\" }", false).unwrap();
    let e = c.validate(Some(&spec)).unwrap_err().to_string();
    assert!(
        e.contains("cache.quant.values") && e.contains("divide"),
        "{e}"
    );
}

/// Every registered `type` deserializes from its default and round-trips.
#[test]
fn every_registered_type_deserializes() {
    let all = components::all();
    let names: Vec<&str> = all.iter().map(|c| c.name).collect();
    for want in [
        "cumulative_attention",
        "h2o",
        "snapkv",
        "tova",
        "key_norm",
        "recency",
        "uniform",
        "pyramid",
        "pyramidkv",
        "var_prop",
        "var_inv",
        "per_layer",
        "top_k",
        "ada_kv",
        "minmax",
    ] {
        assert!(names.contains(&want), "{want} not registered: {names:?}");
    }
    for c in all {
        let v = (c.default)();
        assert_eq!(v["type"], c.name);
        let field = c
            .point
            .config_key()
            .split(' ')
            .next()
            .unwrap()
            .trim_start_matches("cache.");
        let toml = match c.point {
            components::ExtensionPoint::Quantizer => {
                format!("[cache.quant]\nresidual = 512\nkeys = {v}")
            }
            components::ExtensionPoint::Scorer => format!("[cache]\nheavy = 0.1\n{field} = {v}"),
            _ => format!("[cache]\nheavy = 0.1\nscorer = {{ type = \"h2o\" }}\n{field} = {v}"),
        };
        let toml = toml
            .replace("\":", "\" =")
            .replace("{\"", "{ \"")
            .replace(",\"", ", \"");
        let cfg =
            RunConfig::parse(&toml, false).unwrap_or_else(|e| panic!("{}: {e}\n{toml}", c.name));
        let back = serde_json::to_value(&cfg).unwrap();
        let got = match c.point {
            components::ExtensionPoint::Quantizer => &back["cache"]["quant"]["keys"],
            components::ExtensionPoint::PageScore => &back["cache"]["pages"]["score"],
            components::ExtensionPoint::Residual => &back["cache"]["quant"]["residual_mode"],
            _ => &back["cache"][field],
        };
        if got.is_string() {
            // A decode regime or residual rule at its defaults is written
            // back as its name.
            assert_eq!(got, &v["type"], "{}", c.name);
        } else {
            assert_eq!(got, &v, "{}", c.name);
        }
    }
}

/// Budget table of every preset for a 30-layer model and a 2048-token prompt.
/// Statistic-driven policies get a fixed synthetic statistic (layer l: 1 + l / 10).
/// Signal-driven ones without a table show their error message.
#[test]
fn budget_tables_of_presets() {
    let stats: Vec<f32> = (0..30).map(|l| 1.0 + l as f32 / 10.0).collect();
    let mut table = serde_json::Map::new();
    for p in presets() {
        let cfg = RunConfig::load(&p).unwrap();
        let c = &cfg.cache;
        let Some(policy) = &c.policy else {
            table.insert(name(&p), "keeps every token".into());
            continue;
        };
        let t = 2048;
        let req = BudgetRequest {
            n_layers: 30,
            prompt_len: t,
            heavy: c
                .heavy_tokens
                .unwrap_or((t as f64 * c.heavy.unwrap_or(0.0)) as usize),
            recent: c
                .recent_tokens
                .unwrap_or((t as f64 * c.recent.unwrap_or(0.0)) as usize),
            sinks: c.sinks,
            layers: &[],
        };
        let kind = serde_json::to_value(policy).unwrap()["type"].clone();
        let b = match kind.as_str() {
            Some("var_prop") => budgets_from_statistics(&req, &stats, false, "var_prop"),
            Some("var_inv") => budgets_from_statistics(&req, &stats, true, "var_inv"),
            _ => policy.layer_budgets(&req),
        };
        // A policy that decides from the run's own signals (SimLayerKV) has
        // no table without a model: its message is the row.
        let b = match b {
            Ok(b) => b,
            Err(e) => {
                table.insert(name(&p), e.to_string().into());
                continue;
            }
        };
        let heavy: Vec<usize> = b.iter().map(|x| x.heavy).collect();
        table.insert(name(&p), serde_json::json!({"recent": b[0].recent, "sinks": c.sinks, "heavy": heavy, "heavy_total": heavy.iter().sum::<usize>()}));
    }
    insta::assert_json_snapshot!("budget_tables_30_layers_2048_tokens", table);
}

/// `cache.decode` is a name or a table, written back as the name when every
/// parameter is at its default; the old `evict_every` says where it moved;
/// `[cache.quest]` is read as `[cache.pages]`.
#[test]
fn decode_regime_and_pages_sections() {
    let base = "[cache]\nheavy = 0.1\nscorer = { type = \"h2o\" }\n";
    let named = RunConfig::parse(&format!("{base}decode = \"evict\""), false).unwrap();
    assert!(named.to_toml().unwrap().contains("decode = \"evict\""));
    let table = RunConfig::parse(
        &format!("{base}decode = {{ type = \"evict\", every = 16 }}"),
        false,
    )
    .unwrap();
    let back = serde_json::to_value(&table).unwrap();
    assert_eq!(
        back["cache"]["decode"],
        serde_json::json!({ "type": "evict", "every": 16 })
    );
    let again = RunConfig::parse(&table.to_toml().unwrap(), false).unwrap();
    assert_eq!(serde_json::to_value(&again).unwrap(), back);
    for (text, want) in [
        (
            format!("{base}decode = \"evict\"\nevict_every = 4"),
            "every = N",
        ),
        (format!("{base}decode = \"sometimes\""), "sometimes"),
        (
            format!("{base}decode = {{ type = \"evict\", evry = 4 }}"),
            "evry",
        ),
    ] {
        let e = RunConfig::parse(&text, false).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
    let e = RunConfig::parse(
        &format!("{base}decode = {{ type = \"evict\", every = 0 }}"),
        false,
    )
    .unwrap()
    .validate(None)
    .unwrap_err();
    assert!(e.to_string().contains("cache.decode.every"), "{e}");
    let old = RunConfig::parse("[cache.quest]\npage_size = 8\ntoken_budget = 64", false).unwrap();
    let new = RunConfig::parse("[cache.pages]\npage_size = 8\ntoken_budget = 64", false).unwrap();
    assert_eq!(old.to_toml().unwrap(), new.to_toml().unwrap());
    assert!(new.to_toml().unwrap().contains("[cache.pages.score]"));
}
