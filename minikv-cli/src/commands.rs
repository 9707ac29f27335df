//! Command implementations.

use crate::provenance::{assets_dir, default_model, provenance};
use crate::{BudgetsArgs, EvalArgs, GenerateArgs, LogitsArgs, ModelArg, PplArgs, QuantizeArgs};
use indicatif::{ProgressBar, ProgressStyle};
use minikv_core::files::{MIB, read_text_bounded};
use minikv_core::{
    BudgetRequest, CacheBuilder, Error, KvCache, MemoryReport, Result, RunConfig, components,
};
use minikv_models::{LanguageModel, Logits, SamplingConfig, Tokenizer, Workspace};
use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};

fn print_json(v: &serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(v).expect("json"));
}

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
    Ok(())
}

pub fn load_config(path: Option<&Path>) -> Result<RunConfig> {
    match path {
        Some(p) => RunConfig::load(p),
        None => Ok(RunConfig::default()),
    }
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

pub struct Loaded {
    pub model: Box<dyn LanguageModel>,
    pub tok: Tokenizer,
    pub path: PathBuf,
    sha: std::sync::OnceLock<String>,
}

impl Loaded {
    /// The model file's sha256 (computed once).
    pub fn sha256(&self) -> Result<String> {
        if let Some(s) = self.sha.get() {
            return Ok(s.clone());
        }
        let s = crate::provenance::sha256_file(&self.path)?;
        Ok(self.sha.get_or_init(|| s).clone())
    }
}

pub fn load_model(m: &ModelArg) -> Result<Loaded> {
    let path = match &m.model {
        Some(p) => crate::provenance::resolve_model(p)?,
        None => default_model()?,
    };
    let (mut model, tok) = minikv_models::load(&path)?;
    model.set_activations(m.activations);
    crate::provenance::set_activations(m.activations);
    Ok(Loaded {
        model,
        tok,
        path,
        sha: Default::default(),
    })
}

pub fn build_cache(model: &dyn LanguageModel, cfg: &RunConfig) -> Result<Box<dyn KvCache>> {
    CacheBuilder::new(model.spec())
        .named_backend(&cfg.backend)?
        .build(&cfg.cache)
}

pub fn memory_json(m: &MemoryReport) -> serde_json::Value {
    let mut v = memory_json_all(m);
    // Models with sliding-window layers: both kinds apart.
    if m.layers.iter().any(|l| l.window.is_some()) {
        let bytes = |windowed: bool| -> usize {
            m.layers
                .iter()
                .filter(|l| l.window.is_some() == windowed)
                .flat_map(|l| &l.heads)
                .map(|h| h.used)
                .sum()
        };
        v["window_layers_kv_bytes"] = json!(bytes(true));
        v["global_layers_kv_bytes"] = json!(bytes(false));
        v["layer_windows"] = json!(m.layers.iter().map(|l| l.window).collect::<Vec<_>>());
    }
    v
}

fn memory_json_all(m: &MemoryReport) -> serde_json::Value {
    json!({
        "kv_bytes": m.used_bytes(),
        "kv_bytes_allocated": m.total_bytes(),
        "full_fp16_bytes": m.full_fp16_bytes,
        "compression_ratio": m.used_bytes() as f64 / m.full_fp16_bytes.max(1) as f64,
        "allocated_ratio": m.ratio(),
        "work": m.work + m.layers.iter().map(|l| l.work).sum::<usize>(),
        "tokens_seen": m.seq_len,
        "quant_codes": m.sum(|h| h.quant_codes),
        "quant_scales": m.sum(|h| h.quant_scales),
        "fp16": m.sum(|h| h.fp),
        "clusters": m.sum(|h| h.clusters),
        "indices": m.sum(|h| h.indices),
        "per_layer_tokens": m.layers.iter().map(|l| l.heads.iter().map(|h| h.tokens).sum::<usize>()).collect::<Vec<_>>(),
        "per_layer_bytes": m.layers.iter().map(|l| l.staging + l.heads.iter().map(|h| h.total()).sum::<usize>()).collect::<Vec<_>>(),
    })
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
        "vocab": l.tok.vocab_size(),
        "add_bos": l.tok.add_bos,
        "kv_bytes_per_token_fp16": l.model.spec().full_fp16_bytes(1),
    }));
    Ok(())
}

pub fn generate(a: &GenerateArgs) -> Result<()> {
    let cfg = load_config(a.config.as_deref())?;
    let l = load_model(&a.model)?;
    let mut cache = build_cache(l.model.as_ref(), &cfg)?;
    let text = if a.chat {
        l.tok.chat_prompt(&a.prompt)?
    } else {
        a.prompt.clone()
    };
    let ids = l.tok.encode(&text)?;
    let sampling = SamplingConfig {
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed.unwrap_or(cfg.seed),
    };
    let stream = !a.json;
    let g = minikv_models::generate(
        l.model.as_ref(),
        &l.tok,
        cache.as_mut(),
        &ids,
        a.max_tokens,
        sampling,
        |s| {
            if stream {
                print!("{s}");
                let _ = std::io::stdout().flush();
            }
        },
    )?;
    let mem = cache.memory();
    let n = g.tokens.len();
    if a.json {
        print_json(&json!({
            "prompt_tokens": g.prompt_tokens,
            "tokens": g.tokens,
            "text": g.text,
            "stop": g.stop,
            "prefill_s": g.prefill_s,
            "decode_s": g.decode_s,
            "prefill_tokens_per_s": g.prompt_tokens as f64 / g.prefill_s,
            "decode_tokens_per_s": if n > 1 { (n - 1) as f64 / g.decode_s } else { 0.0 },
            "memory": memory_json(&mem),
            "provenance": provenance(Some(&l.path), sampling.seed, Some(serde_json::to_value(&cfg).expect("json")))?,
        }));
    } else {
        println!();
        eprintln!(
            "[{} prompt tokens in {:.2}s ({:.0} tok/s), {} generated in {:.2}s ({:.1} tok/s), KV {} bytes = {:.1}% of fp16 ({} allocated), stop: {:?}]",
            g.prompt_tokens,
            g.prefill_s,
            g.prompt_tokens as f64 / g.prefill_s,
            n,
            g.decode_s,
            if n > 1 {
                (n - 1) as f64 / g.decode_s
            } else {
                0.0
            },
            mem.used_bytes(),
            100.0 * mem.used_bytes() as f64 / mem.full_fp16_bytes.max(1) as f64,
            mem.total_bytes(),
            g.stop
        );
    }
    Ok(())
}

pub fn logits(a: &LogitsArgs) -> Result<()> {
    let cfg = load_config(a.config.as_deref())?;
    let l = load_model(&a.model)?;
    let mut cache = build_cache(l.model.as_ref(), &cfg)?;
    let ids = l.tok.encode(&a.prompt)?;
    if ids.is_empty() {
        return Err(Error::Input("the prompt encodes to no tokens".into()));
    }
    let max = l.model.spec().max_seq_len;
    if ids.len() > max {
        return Err(Error::ContextOverflow {
            len: ids.len(),
            max,
        });
    }
    let lg = l.model.forward(
        &ids,
        cache.as_mut(),
        &mut Workspace::default(),
        Logits::Last,
    )?;
    let mut idx: Vec<usize> = (0..lg.len()).collect();
    idx.sort_by(|&x, &y| lg[y].total_cmp(&lg[x]).then(x.cmp(&y)));
    let top: Vec<(u32, f32)> = idx.iter().take(a.top).map(|&i| (i as u32, lg[i])).collect();
    if a.json {
        println!(
            "{}",
            serde_json::to_string(&json!({"ids": ids, "top": top})).expect("json")
        );
    } else {
        println!("ids: {ids:?}");
        for (id, v) in top {
            println!("{id:>6} {v:>10.4} {:?}", l.tok.decode(&[id])?);
        }
    }
    Ok(())
}

/// Reads a text file, or the `.txt` files of a directory in name order.
pub fn read_text(p: &Path) -> Result<String> {
    if p.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(p)
            .map_err(|e| Error::io(p, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|f| f.extension().is_some_and(|x| x == "txt"))
            .collect();
        files.sort();
        let mut s = String::new();
        for f in files {
            s.push_str(&read_text_bounded(&f, TEXT_MAX, "a text")?);
            s.push('\n');
        }
        if s.is_empty() {
            return Err(Error::Input(format!("{}: no .txt files", p.display())));
        }
        return Ok(s);
    }
    read_text_bounded(p, TEXT_MAX, "a text")
}

/// The largest text file read (per file of a directory).
const TEXT_MAX: u64 = 256 * MIB;

/// The first `n` tokens of a text, or an error saying how many it has.
pub fn first_tokens(tok: &Tokenizer, text: &str, n: usize, what: &Path) -> Result<Vec<u32>> {
    let ids = tok.encode(text)?;
    if ids.len() < n {
        return Err(Error::Input(format!(
            "{} has {} tokens, fewer than the {n} requested",
            what.display(),
            ids.len()
        )));
    }
    Ok(ids[..n].to_vec())
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

/// `perplexity --ctx N`: llama.cpp's chunked protocol over the whole text.
fn perplexity_chunked(a: &PplArgs, ctx: usize) -> Result<()> {
    let cfg = RunConfig::default();
    let l = load_model(&a.model)?;
    let max = l.model.spec().max_seq_len;
    if ctx > max {
        return Err(Error::ContextOverflow { len: ctx, max });
    }
    let text = read_text(&a.text)?;
    let ids = l.tok.encode(&text)?;
    let bos = l.tok.bos.filter(|_| l.tok.add_bos);
    let t0 = std::time::Instant::now();
    let r = minikv_models::perplexity_chunked(
        l.model.as_ref(),
        || build_cache(l.model.as_ref(), &cfg),
        &ids,
        ctx,
        a.chunks,
        bos,
    )?;
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        let mut v = serde_json::to_value(&r).expect("json");
        v["text_tokens"] = json!(ids.len());
        v["wall_s"] = json!(secs);
        v["text"] = json!(a.text.display().to_string());
        v["provenance"] =
            serde_json::to_value(provenance(Some(&l.path), cfg.seed, None)?).expect("json");
        print_json(&v);
    } else {
        println!(
            "{} chunks of {ctx} tokens ({} scored, second halves): nll {:.5}, ppl {:.4}; {secs:.1}s",
            r.chunks, r.scored, r.nll, r.ppl
        );
    }
    Ok(())
}

pub fn perplexity(a: &PplArgs) -> Result<()> {
    if let Some(ctx) = a.ctx {
        return perplexity_chunked(a, ctx);
    }
    let cfg = load_config(a.config.as_deref())?;
    let l = load_model(&a.model)?;
    let max = l.model.spec().max_seq_len;
    if a.tokens > max {
        return Err(Error::ContextOverflow { len: a.tokens, max });
    }
    let text = read_text(&a.text)?;
    let ids = first_tokens(&l.tok, &text, a.tokens, &a.text)?;
    let prefill = a.prefill.unwrap_or((a.tokens / 2).max(1));
    let mut cache = build_cache(l.model.as_ref(), &cfg)?;
    let pb = ProgressBar::new((a.tokens - 1).saturating_sub(prefill) as u64);
    pb.set_style(
        ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} tokens, eta {eta}")
            .expect("template"),
    );
    pb.set_message("decode");
    let t0 = std::time::Instant::now();
    let r = minikv_models::perplexity(l.model.as_ref(), cache.as_mut(), &ids, prefill, |i| {
        pb.set_position((i - prefill) as u64)
    })?;
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    let mem = cache.memory();
    if a.json {
        let mut v = serde_json::to_value(&r).expect("json");
        v["wall_s"] = json!(secs);
        v["memory"] = memory_json(&mem);
        v["text"] = json!(a.text.display().to_string());
        v["provenance"] = serde_json::to_value(provenance(
            Some(&l.path),
            cfg.seed,
            Some(serde_json::to_value(&cfg).expect("json")),
        )?)
        .expect("json");
        print_json(&v);
    } else {
        println!(
            "tokens {} (prefill {}), nll {:.4}, ppl {:.3}",
            r.tokens, r.prefill_tokens, r.nll, r.ppl
        );
        if let (Some(n), Some(p)) = (r.decode_nll, r.decode_ppl) {
            println!("after compression: nll {n:.4}, ppl {p:.3}");
        }
        println!(
            "KV {} bytes = {:.1}% of fp16 ({} allocated); {secs:.1}s",
            mem.used_bytes(),
            100.0 * mem.used_bytes() as f64 / mem.full_fp16_bytes.max(1) as f64,
            mem.total_bytes()
        );
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
            let sel = serde_json::to_value(c.selector.as_ref().expect("resolved")).expect("json");
            let uniform_heads = sel["type"] == "top_k";
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

pub fn default_text() -> PathBuf {
    assets_dir().join("paul_graham")
}

/// Every evaluation task, as `--task` spells it.
pub const TASKS: [&str; 17] = [
    "perplexity",
    "fidelity",
    "generation",
    "passkey",
    "needle",
    "kv-retrieval",
    "attention-error",
    "dataset",
    "ruler-niah-single-number",
    "ruler-niah-single-word",
    "ruler-niah-single-uuid",
    "ruler-niah-multikey",
    "ruler-niah-multivalue",
    "ruler-niah-multiquery",
    "ruler-vt",
    "ruler-cwe",
    "ruler-fwe",
];

/// Checks a task name against [`TASKS`].
pub fn check_task(t: &str) -> Result<()> {
    if TASKS.contains(&t) {
        Ok(())
    } else {
        Err(Error::Input(format!(
            "unknown task `{t}` ({})",
            TASKS.join(", ")
        )))
    }
}

type RefLogits = std::sync::Arc<Vec<Vec<f32>>>;

/// Full-cache reference logits of `fidelity` windows, shared by every row of
/// one process: a sweep computes the full cache once per (window, context,
/// backend, model) instead of once per config. Bounded in memory (oldest
/// entries dropped); optionally also kept on disk (`--reference-cache DIR`),
/// so that separate sweeps and reruns share them too.
#[derive(Default)]
pub struct RefMemo {
    dir: Option<PathBuf>,
    inner: std::sync::Mutex<(
        std::collections::HashMap<String, RefLogits>,
        std::collections::VecDeque<String>,
    )>,
}

impl RefMemo {
    /// Entries kept in memory (each is `tokens x vocab` f32).
    const CAP: usize = 32;

    /// A memo that also reads and writes `dir`.
    pub fn on_disk(dir: Option<PathBuf>) -> Self {
        Self {
            dir,
            ..Self::default()
        }
    }

    /// File header: magic, sha256 of the key, rows, columns, sha256 of the payload.
    const MAGIC: &'static [u8; 8] = b"MKVREF1\0";
    const HEADER: usize = 8 + 32 + 4 + 4 + 32;

    /// Reads a reference file written for `key`; `Err` says why it cannot
    /// be used (wrong key, truncated, corrupted, non-finite values).
    fn load(path: &Path, key: &str) -> std::result::Result<Vec<Vec<f32>>, String> {
        use sha2::{Digest, Sha256};
        let b = std::fs::read(path).map_err(|e| e.to_string())?;
        if b.len() < Self::HEADER || &b[..8] != Self::MAGIC {
            return Err("not a minikv reference file".into());
        }
        if b[8..40] != Sha256::digest(key.as_bytes())[..] {
            return Err("written for another key".into());
        }
        let word = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes")) as usize;
        let (n, v) = (word(40), word(44));
        let want = n
            .checked_mul(v)
            .and_then(|x| x.checked_mul(4))
            .ok_or("impossible size")?;
        let payload = &b[Self::HEADER..];
        if payload.len() != want || v == 0 {
            return Err(format!(
                "{} payload bytes, header says {want}",
                payload.len()
            ));
        }
        if b[48..80] != Sha256::digest(payload)[..] {
            return Err("checksum mismatch (corrupted)".into());
        }
        let rows: Vec<Vec<f32>> = payload
            .chunks_exact(4 * v)
            .map(|r| {
                r.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect()
            })
            .collect();
        if rows.iter().flatten().any(|x| !x.is_finite()) {
            return Err("non-finite logits".into());
        }
        Ok(rows)
    }

    fn store(path: &Path, key: &str, rows: &[Vec<f32>]) -> Result<()> {
        use sha2::{Digest, Sha256};
        let v = rows.first().map_or(0, Vec::len);
        let mut payload = Vec::with_capacity(rows.len() * v * 4);
        for x in rows.iter().flatten() {
            payload.extend_from_slice(&x.to_le_bytes());
        }
        let mut b = Vec::with_capacity(Self::HEADER + payload.len());
        b.extend_from_slice(Self::MAGIC);
        b.extend_from_slice(&Sha256::digest(key.as_bytes()));
        b.extend_from_slice(&(rows.len() as u32).to_le_bytes());
        b.extend_from_slice(&(v as u32).to_le_bytes());
        b.extend_from_slice(&Sha256::digest(&payload));
        b.extend_from_slice(&payload);
        // Write then rename: a killed run never leaves a torn file behind.
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, &b).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
    }

    fn get_or(&self, key: &str, f: impl FnOnce() -> Result<Vec<Vec<f32>>>) -> Result<RefLogits> {
        use sha2::{Digest, Sha256};
        let h: String = Sha256::digest(key.as_bytes())
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect();
        if let Some(v) = self.inner.lock().expect("lock").0.get(&h) {
            return Ok(v.clone());
        }
        let file = self.dir.as_ref().map(|d| d.join(format!("{h}.ref")));
        let loaded = match &file {
            Some(p) if p.exists() => match Self::load(p, key) {
                Ok(v) => Some(v),
                Err(why) => {
                    eprintln!(
                        "warning: reference file {} is not usable ({why}); recomputing it",
                        p.display()
                    );
                    None
                }
            },
            _ => None,
        };
        let v = match loaded {
            Some(v) => v,
            None => {
                let v = f()?;
                if let (Some(d), Some(p)) = (&self.dir, &file) {
                    std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))?;
                    Self::store(p, key, &v)?;
                }
                v
            }
        };
        let v = std::sync::Arc::new(v);
        let mut g = self.inner.lock().expect("lock");
        if !g.0.contains_key(&h) {
            g.1.push_back(h.clone());
            if g.1.len() > Self::CAP {
                let old = g.1.pop_front().expect("non-empty");
                g.0.remove(&old);
            }
        }
        g.0.insert(h, v.clone());
        Ok(v)
    }
}

/// What one evaluation runs (shared by `eval` and `sweep`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct TaskSpec {
    /// perplexity | fidelity | generation | passkey.
    pub task: String,
    /// Prompt/context tokens.
    pub context: usize,
    /// Tokens after the context.
    pub tokens: usize,
    /// Trials (passkey) or text windows.
    pub trials: usize,
    /// Passkey depth (None: uniform).
    pub depth: Option<f64>,
    /// Text file or directory.
    pub text: PathBuf,
    /// Question tasks: whether the question is compressed with the context.
    #[serde(skip_serializing_if = "is_agnostic")]
    pub query: minikv_eval::qa::QueryMode,
    /// `dataset`: the JSONL file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dataset: Option<PathBuf>,
}

fn is_agnostic(q: &minikv_eval::qa::QueryMode) -> bool {
    *q == minikv_eval::qa::QueryMode::Agnostic
}

/// The query mode of `--query-aware`.
pub fn query_mode(aware: bool) -> minikv_eval::qa::QueryMode {
    if aware {
        minikv_eval::qa::QueryMode::Aware
    } else {
        minikv_eval::qa::QueryMode::Agnostic
    }
}

/// The rows a question task asks: a dataset file's, or generated RULER-style
/// with `text` (the task's `--text`) as the haystack.
pub fn question_rows(
    t: &TaskSpec,
    tok: &minikv_models::Tokenizer,
    seed: u64,
    text: &str,
) -> Result<Vec<minikv_eval::qa::QaRow>> {
    use minikv_eval::{qa, ruler};
    if t.task == "dataset" {
        let p = t
            .dataset
            .as_ref()
            .ok_or_else(|| Error::Input("task `dataset` needs --dataset FILE.jsonl".into()))?;
        return qa::read_dataset(p);
    }
    let task = ruler::RulerTask::from_task(&t.task)
        .ok_or_else(|| Error::Input(format!("`{}` is not a question task", t.task)))?;
    ruler::generate(
        task,
        tok,
        text,
        ruler::RulerSpec {
            context: t.context,
            depth: t.depth,
            trials: t.trials,
            seed,
        },
    )
}

/// Runs one task for one config and seed on a loaded model; returns the result
/// row (task, metrics, memory, wall time). Texts are tokenized once per call.
pub fn run_task(
    l: &Loaded,
    cfg: &RunConfig,
    t: &TaskSpec,
    seed: u64,
    memo: &RefMemo,
) -> Result<serde_json::Value> {
    check_task(&t.task)?;
    use minikv_eval as eval;
    use rand::{Rng, SeedableRng};
    let m = l.model.as_ref();
    let full_cfg = RunConfig {
        backend: cfg.backend.clone(),
        ..RunConfig::default()
    };
    let questions = t.task == "dataset" || t.task.starts_with("ruler-");
    // The text is read once, and tokenized only for the tasks that cut windows
    // or haystacks from its tokens (a dataset brings its own contexts).
    let text = if t.task == "dataset" {
        String::new()
    } else {
        read_text(&t.text)?
    };
    let all = if questions {
        Vec::new()
    } else {
        l.tok.encode(&text)?
    };
    let max = m.spec().max_seq_len;
    // Retrieval and question prompts are `context` tokens in all; the other
    // tasks add `tokens` after the context.
    let prompt_only = minikv_eval::Retrieval::from_task(&t.task).is_some() || questions;
    let need = t.context + if prompt_only { 0 } else { t.tokens };
    if need > max {
        return Err(Error::ContextOverflow { len: need, max });
    }
    if t.trials == 0 {
        return Err(Error::Input("--trials must be positive".into()));
    }
    // Windows of the text at seeded offsets (one per trial).
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut window = || -> Result<Vec<u32>> {
        if all.len() < need {
            return Err(Error::Input(format!(
                "{} has {} tokens, fewer than the {need} needed",
                t.text.display(),
                all.len()
            )));
        }
        let start = rng.random_range(0..=all.len() - need);
        Ok(all[start..start + need].to_vec())
    };
    let t0 = std::time::Instant::now();
    let mut mem = None;
    let metrics = match t.task.as_str() {
        _ if questions => {
            let rows = question_rows(t, &l.tok, seed, &text)?;
            let r = minikv_eval::qa::evaluate(m, &l.tok, &rows, t.query, || build_cache(m, cfg))?;
            serde_json::to_value(&r).expect("json")
        }
        "passkey" | "needle" | "kv-retrieval" => {
            let kind = eval::Retrieval::from_task(&t.task).expect("retrieval task");
            let spec = eval::PasskeySpec {
                context: t.context,
                depth: t.depth,
                trials: t.trials,
                seed,
            };
            let r = eval::retrieval(kind, m, &l.tok, &all, spec, || build_cache(m, cfg))?;
            serde_json::to_value(&r).expect("json")
        }
        task @ ("perplexity" | "fidelity" | "generation" | "attention-error") => {
            let mut rows = Vec::new();
            for _ in 0..t.trials {
                let ids = window()?;
                if task == "attention-error" {
                    let (e, shadow_mem, diag) = eval::attention_error(
                        m,
                        build_cache(m, &full_cfg)?,
                        build_cache(m, cfg)?,
                        &ids,
                        t.context,
                    )?;
                    mem = Some(shadow_mem);
                    let mut v = serde_json::to_value(e).expect("json");
                    add_diagnostics(&mut v, &diag);
                    rows.push(v);
                    continue;
                }
                let mut comp = build_cache(m, cfg)?;
                let v = match task {
                    "perplexity" => serde_json::to_value(minikv_models::perplexity(
                        m,
                        comp.as_mut(),
                        &ids,
                        t.context,
                        |_| {},
                    )?),
                    "fidelity" => {
                        let key = format!(
                            "{}/{:?}/{}/{}",
                            l.sha256()?,
                            full_cfg.backend,
                            t.context,
                            ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
                        );
                        let reference = memo.get_or(&key, || {
                            eval::reference_logits(
                                m,
                                build_cache(m, &full_cfg)?.as_mut(),
                                &ids,
                                t.context,
                            )
                        })?;
                        serde_json::to_value(eval::fidelity_against(
                            m,
                            comp.as_mut(),
                            &ids,
                            t.context,
                            &reference,
                        )?)
                    }
                    _ => serde_json::to_value(eval::generation_agreement(
                        m,
                        &l.tok,
                        build_cache(m, &full_cfg)?.as_mut(),
                        comp.as_mut(),
                        &ids[..t.context],
                        t.tokens,
                    )?),
                }
                .expect("json");
                let mut v = v;
                add_diagnostics(&mut v, &comp.diagnostics());
                mem = Some(comp.memory());
                rows.push(v);
            }
            mean_rows(&rows)
        }
        other => unreachable!("checked task `{other}`"),
    };
    let wall_s = t0.elapsed().as_secs_f64();
    let mut out = json!({"task": t.task, "context": t.context, "tokens": t.tokens, "trials": t.trials, "metrics": metrics, "wall_s": wall_s});
    if questions {
        out["query"] = json!(t.query);
    }
    if let Some(d) = &t.dataset {
        out["dataset"] = json!(d);
    }
    if t.task == "dataset" {
        // Each row brings its context and answer length: the --context and
        // --tokens flags were not used, so they are not recorded.
        out["context"] = serde_json::Value::Null;
        out["tokens"] = serde_json::Value::Null;
    }
    match &mem {
        Some(m) => out["memory"] = memory_json(m),
        None => {
            let (kv, full) = (
                out["metrics"]["kv_bytes"].as_u64().unwrap_or(0),
                out["metrics"]["full_fp16_bytes"].as_u64().unwrap_or(1),
            );
            out["memory"] = json!({"kv_bytes": kv, "full_fp16_bytes": full, "compression_ratio": kv as f64 / full as f64});
        }
    }
    Ok(out)
}

pub fn eval(a: &EvalArgs) -> Result<()> {
    let cfg = load_config(a.config.as_deref())?;
    let seed = a.seed.unwrap_or(cfg.seed);
    let task = match (&a.task, &a.opts.dataset) {
        (Some(t), None) if t == "dataset" => {
            return Err(Error::Input(
                "--task dataset needs --dataset FILE.jsonl".into(),
            ));
        }
        (Some(t), Some(_)) if t != "dataset" => {
            return Err(Error::Input(format!(
                "--dataset runs the `dataset` task, not `{t}`"
            )));
        }
        (Some(t), _) => t.clone(),
        (None, _) => "dataset".into(),
    };
    let l = load_model(&a.model)?;
    let spec = TaskSpec {
        task,
        context: a.opts.context,
        tokens: a.opts.tokens,
        trials: a.opts.trials,
        depth: a.depth,
        text: a.opts.text.clone().unwrap_or_else(default_text),
        query: query_mode(a.opts.query_aware),
        dataset: a.opts.dataset.clone(),
    };
    if let Some(path) = &a.export {
        if !spec.task.starts_with("ruler-") {
            return Err(Error::Input(format!(
                "--export writes generated ruler-* tasks; `{}` is not one",
                spec.task
            )));
        }
        let rows = question_rows(&spec, &l.tok, seed, &read_text(&spec.text)?)?;
        minikv_eval::qa::write_dataset(path, &rows)?;
        eprintln!(
            "{} rows of {} written to {}",
            rows.len(),
            spec.task,
            path.display()
        );
        return Ok(());
    }
    let mut out = run_task(&l, &cfg, &spec, seed, &RefMemo::default())?;
    out["provenance"] = serde_json::to_value(provenance(
        Some(&l.path),
        seed,
        Some(serde_json::to_value(&cfg).expect("json")),
    )?)
    .expect("json");
    if a.json {
        print_json(&out);
    } else {
        println!(
            "{}: {}",
            spec.task,
            serde_json::to_string(&out["metrics"]).expect("json")
        );
        println!(
            "KV {} bytes ({:.1}% of fp16), {:.1}s",
            out["memory"]["kv_bytes"],
            100.0 * out["memory"]["compression_ratio"].as_f64().unwrap_or(0.0),
            out["wall_s"]
        );
    }
    Ok(())
}

/// Mean of each numeric field over rows (with the per-row values kept), plus a
/// 95% normal interval when there are several rows.
/// Flattens a cache's diagnostics into a trial's metrics, so that trials
/// average them: a compensator's means as `<type>_<stat>` (`reskv_eta`,
/// `cam_merged`), other methods' numbers as `<method>_<field>`
/// (`quest_bytes_read_per_token`), and ResKV's per-layer errors.
fn add_diagnostics(v: &mut serde_json::Value, diag: &serde_json::Value) {
    if let Some(methods) = diag.as_object() {
        for (name, d) in methods {
            let flat = d["mean"].as_object().or_else(|| d.as_object());
            for (k, x) in flat.into_iter().flatten() {
                if x.is_number() {
                    v[format!("{name}_{k}")] = x.clone();
                }
            }
        }
    }
    let r = &diag["reskv"];
    if let Some(pl) = r["per_layer"].as_array() {
        for k in ["output_error", "output_error_dropped", "eta"] {
            v[format!("reskv_{k}_per_layer")] = pl.iter().map(|x| x[k].clone()).collect();
        }
    }
}

fn mean_rows(rows: &[serde_json::Value]) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    if let Some(first) = rows.first().and_then(|r| r.as_object()) {
        for k in first.keys() {
            // Numeric arrays of one length (per-layer figures): element-wise mean.
            let arrays: Vec<Vec<f64>> = rows
                .iter()
                .filter_map(|r| r[k].as_array())
                .map(|a| a.iter().filter_map(|x| x.as_f64()).collect::<Vec<_>>())
                .collect();
            if arrays.len() == rows.len()
                && let Some(n) = arrays.first().map(Vec::len).filter(|&n| n > 0)
                && arrays.iter().all(|a| a.len() == n)
                && first[k].as_array().is_some_and(|a| a.len() == n)
            {
                let m = rows.len() as f64;
                let mean: Vec<f64> = (0..n)
                    .map(|i| arrays.iter().map(|a| a[i]).sum::<f64>() / m)
                    .collect();
                out.insert(k.clone(), json!(mean));
                continue;
            }
            let xs: Vec<f64> = rows.iter().filter_map(|r| r[k].as_f64()).collect();
            if xs.len() != rows.len() {
                continue;
            }
            let n = xs.len() as f64;
            let mean = xs.iter().sum::<f64>() / n;
            out.insert(k.clone(), json!(mean));
            if xs.len() > 1 {
                let sd = (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
                let h = 1.96 * sd / n.sqrt();
                out.insert(format!("{k}_ci95"), json!([mean - h, mean + h]));
            }
        }
    }
    out.insert("per_trial".into(), json!(rows));
    serde_json::Value::Object(out)
}

/// `minikv calibrate duo`: measures the DuoAttention head pattern of a model
/// on seeded passkey prompts and writes it (atomically) as JSON.
pub fn calibrate_duo(a: &crate::DuoArgs) -> Result<()> {
    let l = load_model(&a.model)?;
    let m = l.model.as_ref();
    if a.context > m.spec().max_seq_len {
        return Err(Error::ContextOverflow {
            len: a.context,
            max: m.spec().max_seq_len,
        });
    }
    if a.sinks + a.recent >= a.context {
        return Err(Error::Input(format!(
            "calibrate duo: --sinks {} + --recent {} leave no token of the {}-token context outside them: nothing to measure (make --context larger)",
            a.sinks, a.recent, a.context
        )));
    }
    let text_path = a.text.clone().unwrap_or_else(default_text);
    let haystack = l.tok.encode(&read_text(&text_path)?)?;
    let cal = minikv_eval::duo::DuoCalibration {
        prompts: minikv_eval::PasskeySpec {
            context: a.context,
            depth: None,
            trials: a.trials,
            seed: a.seed,
        },
        sinks: a.sinks,
        recent: a.recent,
        window: a.window,
    };
    let t0 = std::time::Instant::now();
    let full = RunConfig::default();
    let scores =
        minikv_eval::duo::calibrate_duo(m, &l.tok, &haystack, cal, || build_cache(m, &full))?;
    let pattern = minikv_policies::DuoPattern {
        format: minikv_policies::DuoPattern::FORMAT.into(),
        model: l
            .path
            .file_name()
            .map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
        model_sha256: l.sha256()?,
        calibration: serde_json::json!({
            "task": "passkey",
            "statistic": "mean attention mass of the last `window` prompt queries outside the first `sinks` and the last `recent` tokens, averaged over the query heads of each KV head",
            "context": a.context,
            "trials": a.trials,
            "seed": a.seed,
            "sinks": a.sinks,
            "recent": a.recent,
            "window": a.window,
            "text": text_path.file_name().map(|f| f.to_string_lossy().into_owned()),
            "git_revision": crate::provenance::git_rev(),
        }),
        scores,
    };
    let body =
        serde_json::to_string_pretty(&pattern).map_err(|e| Error::Input(e.to_string()))? + "\n";
    let tmp = a.out.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, body).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, &a.out).map_err(|e| Error::io(&a.out, e))?;
    let flat: Vec<f32> = pattern.scores.iter().flatten().copied().collect();
    let mut sorted = flat.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    eprintln!(
        "duo pattern: {} layers x {} KV heads, long-range mass min {:.3} median {:.3} max {:.3}, {:.1}s -> {}",
        pattern.scores.len(),
        pattern.scores[0].len(),
        sorted[0],
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1],
        t0.elapsed().as_secs_f64(),
        a.out.display()
    );
    Ok(())
}
