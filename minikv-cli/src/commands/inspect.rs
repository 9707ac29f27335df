//! Inspection commands: `components`, `config check`, `info`, `tokenize`,
//! `quantize`, `budgets`.

use super::*;

use crate::{BudgetsArgs, ModelArg, QuantizeArgs};
use minikv_core::files::{MIB, read_text_bounded};
use minikv_core::{BudgetRequest, Error, Result, components};
use minikv_models::{Logits, Workspace};
use serde_json::json;
use std::path::Path;

/// Whether `v` parses as a component of `point` (through its typetag registry).
fn parses(point: minikv_core::components::ExtensionPoint, v: serde_json::Value) -> bool {
    use minikv_core::components::ExtensionPoint as P;
    match point {
        P::Scorer => serde_json::from_value::<Box<dyn minikv_core::TokenScorer>>(v).is_ok(),
        P::Policy => serde_json::from_value::<Box<dyn minikv_core::SelectionPolicy>>(v).is_ok(),
        P::Selector => serde_json::from_value::<Box<dyn minikv_core::Selector>>(v).is_ok(),
        P::Quantizer => serde_json::from_value::<Box<dyn minikv_core::Quantizer>>(v).is_ok(),
        P::Compensator => serde_json::from_value::<Box<dyn minikv_core::Compensator>>(v).is_ok(),
        P::Channels => serde_json::from_value::<Box<dyn minikv_core::ChannelPruner>>(v).is_ok(),
        P::Decode => serde_json::from_value::<Box<dyn minikv_core::DecodeRegime>>(v).is_ok(),
        P::PageScore => serde_json::from_value::<Box<dyn minikv_core::PageScore>>(v).is_ok(),
        P::Residual => serde_json::from_value::<Box<dyn minikv_core::ResidualRule>>(v).is_ok(),
    }
}

/// Parameter names with their (default or example) values.
type Params = Vec<(String, serde_json::Value)>;

/// A component's parameters split into the ones a config must give (the
/// parser refuses the component without them; shown with an example value)
/// and the ones with defaults.
fn params_of(c: &components::ComponentInfo) -> (Params, Params) {
    let d = (c.default)();
    let (mut required, mut defaults) = (Vec::new(), Vec::new());
    for (k, v) in d
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| *k != "type")
    {
        let mut without = d.clone();
        if let Some(o) = without.as_object_mut() {
            o.remove(k);
        }
        if parses(c.point, without) {
            defaults.push((k.clone(), v.clone()));
        } else {
            required.push((k.clone(), v.clone()));
        }
    }
    (required, defaults)
}

pub fn components(json_out: bool) -> Result<()> {
    let all = components::all();
    let backends = minikv_core::attention::backends();
    if json_out {
        let mut v: Vec<_> = all
            .iter()
            .map(|c| {
                let (required, _) = params_of(c);
                let required: Vec<&String> = required.iter().map(|r| &r.0).collect();
                json!({"point": c.point, "name": c.name, "config_key": c.point.config_key(), "summary": c.summary, "default": (c.default)(), "required": required})
            })
            .collect();
        v.extend(backends.iter().map(|b| {
            json!({"point": "backend", "name": b.name, "config_key": "backend", "summary": b.summary, "default": b.name})
        }));
        v.extend(minikv_eval::tasks::all().iter().map(|t| {
            let m = t.metric();
            json!({"point": "task", "name": t.name(), "config_key": "--task", "summary": t.summary(), "metric": m.name, "higher_is_better": m.higher_is_better, "family": t.family()})
        }));
        print_json(&json!(v));
        return Ok(());
    }
    println!("\nbackend (backend):");
    for b in &backends {
        println!("  {:<22} {}", b.name, b.summary);
    }
    let mut last = None;
    for c in all {
        if last != Some(c.point) {
            println!("\n{} ({}):", c.point, c.point.config_key());
            last = Some(c.point);
        }
        let (required, defaults) = params_of(c);
        let show = |ps: &[(String, serde_json::Value)]| {
            ps.iter()
                .map(|(k, v)| format!("{k} = {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!("  {:<22} {}", c.name, c.summary);
        if !required.is_empty() {
            println!("  {:<22} required (e.g.): {}", "", show(&required));
        }
        if !defaults.is_empty() {
            println!("  {:<22} defaults: {}", "", show(&defaults));
        }
    }
    println!("\nevaluation task (minikv eval --task):");
    for t in minikv_eval::tasks::all() {
        let m = t.metric();
        let dir = if m.higher_is_better {
            "higher"
        } else {
            "lower"
        };
        println!(
            "  {:<25} {} [{}, {dir} is better]",
            t.name(),
            t.summary(),
            m.name
        );
    }
    Ok(())
}

pub fn config_check(file: &Path, json_out: bool) -> Result<()> {
    let cfg = load_config(Some(file))?;
    if json_out {
        print_json(&serde_json::to_value(&cfg).expect("json"));
    } else {
        print!("{}", cfg.to_toml()?);
    }
    Ok(())
}

pub fn info(m: &ModelArg) -> Result<()> {
    let l = load_model(m)?;
    let d = l.model.describe();
    print_json(&json!({
        "model": l.path.display().to_string(),
        "architecture": d["architecture"],
        "config": d["config"],
        "spec": l.model.spec(),
        "weight_types": d["weight_types"],
        "weight_bytes": d["weight_bytes"],
        "weight_heap_bytes": d["weight_heap_bytes"],
        "vocab": l.tok.vocab_size(),
        "add_bos": l.tok.add_bos,
        "kv_bytes_per_token_fp16": l.model.spec().full_fp16_bytes(1),
    }));
    Ok(())
}

pub fn tokenize(a: &crate::TokenizeArgs) -> Result<()> {
    let l = load_model(&a.model)?;
    let text = match (&a.prompt, &a.text) {
        (Some(p), _) => p.clone(),
        (None, Some(t)) => read_text(t)?,
        (None, None) => return Err(Error::Input("give --prompt or --text".into())),
    };
    let ids = l.tok.encode(&text)?;
    if a.json {
        print_json(&json!({"n": ids.len(), "ids": ids, "model": l.path.display().to_string()}));
    } else {
        println!("{}", serde_json::to_string(&ids).expect("json"));
    }
    Ok(())
}

pub fn quantize(a: &QuantizeArgs) -> Result<()> {
    use minikv_quant::{ScaleDtype, quantize_row};
    let text = read_text_bounded(&a.input, 64 * MIB, "a JSON array of rows")?;
    let rows: Vec<Vec<f32>> = serde_json::from_str(&text).map_err(|e| {
        Error::Input(format!(
            "{}: expected a JSON array of rows of numbers: {e}",
            a.input.display()
        ))
    })?;
    if rows.is_empty()
        || rows
            .iter()
            .any(|r| r.len() != rows[0].len() || r.is_empty())
    {
        return Err(Error::Input(format!(
            "{}: rows must be non-empty and of equal length",
            a.input.display()
        )));
    }
    let dtype = if a.scale_dtype == "f32" {
        ScaleDtype::F32
    } else {
        ScaleDtype::F16
    };
    // Channel axis: quantize K^T, i.e. each column of the input is one row here.
    let (rows, rows_are) = if a.axis == "channel" {
        let t: Vec<Vec<f32>> = (0..rows[0].len())
            .map(|c| rows.iter().map(|r| r[c]).collect())
            .collect();
        (t, "channels")
    } else {
        (rows, "tokens")
    };
    let out: Vec<_> = rows
        .iter()
        .map(|r| quantize_row(r, a.bits, a.group, dtype))
        .collect::<Result<_>>()?;
    if a.json {
        print_json(
            &json!({"bits": a.bits, "group": a.group, "axis": a.axis, "scale_dtype": a.scale_dtype, "rows_are": rows_are, "rows": out}),
        );
    } else {
        for (i, r) in out.iter().enumerate() {
            println!(
                "row {i}: codes {:?} packed {:?} scale {:?} min {:?} max_abs_error {}",
                r.codes, r.packed, r.scale, r.min, r.max_abs_error
            );
        }
    }
    Ok(())
}

pub fn budgets(a: &BudgetsArgs) -> Result<()> {
    let cfg = load_config(Some(&a.config))?;
    let c = &cfg.cache;
    let t = a.tokens;
    let (layers, heads_json): (Vec<minikv_core::LayerBudget>, Option<Vec<Vec<usize>>>) = match (
        &a.model, &a.text,
    ) {
        (Some(mp), Some(tp)) => {
            let l = load_model(&crate::ModelArg {
                model: Some(mp.clone()),
                activations: Default::default(),
            })?;
            let ids = first_tokens(&l.tok, &read_text(tp)?, t, tp)?;
            let mut cache = build_cache(l.model.as_ref(), &cfg)?;
            let mut ws = Workspace::default();
            l.model
                .forward(&ids, cache.as_mut(), &mut ws, Logits::None)?;
            minikv_models::finish_prefill(l.model.as_ref(), cache.as_mut(), &ids, &mut ws)?;
            let heads = cache
                .memory()
                .layers
                .iter()
                .map(|l| l.heads.iter().map(|h| h.tokens).collect())
                .collect();
            (cache.budgets(), Some(heads))
        }
        (None, None) => {
            let n_layers = a
                .layers
                .ok_or_else(|| Error::Input("--layers is required without --model".into()))?;
            let Some(policy) = &c.policy else {
                return Err(Error::Input(
                    "this config has no scorer/policy: it keeps every token".into(),
                ));
            };
            if policy.needs() != minikv_core::Needs::default() {
                return Err(Error::Input("this policy sets budgets from attention statistics of a model run: pass --model and --text".into()));
            }
            // The same ratio-to-tokens conversion the cache uses.
            let (heavy, recent) = c.token_budgets(t);
            let req = BudgetRequest {
                n_layers,
                prompt_len: t,
                heavy,
                recent,
                sinks: c.sinks,
                layers: &[],
            };
            let b = policy.layer_budgets(&req)?;
            let uniform_heads = c.selector.as_ref().is_some_and(|s| s.equal_heads());
            let heads = uniform_heads.then(|| {
                b.iter()
                    .map(|l| vec![(c.sinks + l.heavy + l.recent).min(t); a.kv_heads])
                    .collect()
            });
            (b, heads)
        }
        _ => return Err(Error::Input("--model and --text go together".into())),
    };
    let rows: Vec<_> = layers
        .iter()
        .enumerate()
        .map(|(i, l)| json!({"heavy": l.heavy, "recent": l.recent, "heads": heads_json.as_ref().map(|h| h[i].clone())}))
        .collect();
    let total: usize = match &heads_json {
        Some(h) => h.iter().map(|l| l.iter().sum::<usize>()).sum(),
        None => layers
            .iter()
            .map(|l| (c.sinks + l.heavy + l.recent).min(t) * a.kv_heads)
            .sum(),
    };
    let v = json!({"tokens": t, "layers": rows, "total": total, "note": if heads_json.is_none() { "per-head counts depend on scores: pass --model and --text" } else { "heads: tokens kept per head" }});
    if a.json {
        print_json(&v);
    } else {
        for (i, l) in layers.iter().enumerate() {
            println!("layer {i:>3}: heavy {:>6} recent {:>6}", l.heavy, l.recent);
        }
        println!("total kept (all layers, heads): {total}");
    }
    Ok(())
}
