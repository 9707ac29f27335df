//! `minikv bench throughput`: many sequences at once through the engine
//! (continuous batching, admission by KV bytes), per config and batch limit:
//! generated tokens/s, (prompt + generated)/s, decode tokens/s while the
//! admitted sequences decode, concurrency reached, peak KV bytes, time to
//! first token and inter-token latency (p50/p99).

use clap::Args;
use minikv_core::{CacheBuilder, Error, Result, RunConfig};
use minikv_engine::{Engine, EngineConfig, Event, Finish, Request};
use minikv_models::SamplingConfig;
use plotters::prelude::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A KV budget: bytes, or a number of full-cache sequences of the run's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    /// Bytes.
    Bytes(usize),
    /// `N` times what the full fp16 cache projects for one sequence of
    /// `--prompt + --gen` tokens on this model (`4xfull`).
    FullSeqs(f64),
}

/// Parses `268435456`, `256MiB`, `1.5GB`, `512k` or `4xfull`.
pub fn kv_budget(s: &str) -> std::result::Result<KvBudget, String> {
    let t = s.trim().to_ascii_lowercase();
    if let Some(n) = t.strip_suffix("xfull") {
        let v: f64 = n
            .parse()
            .map_err(|_| format!("`{s}`: expected a number before `xfull`"))?;
        if !(v.is_finite() && v > 0.0 && v <= 1e6) {
            return Err(format!(
                "`{s}`: the number of full sequences must be in (0, 1e6]"
            ));
        }
        return Ok(KvBudget::FullSeqs(v));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("`{s}`: expected a size such as 256MiB, 1.5GB or 4xfull"))?;
    let mult: f64 = match unit.trim() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        u => {
            return Err(format!(
                "`{s}`: unknown unit `{u}` (B, KB, KiB, MB, MiB, GB, GiB, or NxFULL)"
            ));
        }
    };
    let b = v * mult;
    if !(b.is_finite() && (1.0..=1e15).contains(&b)) {
        return Err(format!("`{s}`: a budget must be between 1 byte and 1 PB"));
    }
    Ok(KvBudget::Bytes(b as usize))
}

#[derive(Args)]
pub struct ThroughputArgs {
    #[command(flatten)]
    pub model: crate::ModelArg,
    /// Cache configs (repeatable; none = the full cache). Labels are file stems.
    #[arg(long = "config")]
    pub configs: Vec<PathBuf>,
    /// KV bytes the running sequences may hold together: a size (`256MiB`,
    /// `1.5GB`) or `NxFULL`, N full fp16 caches of `--prompt + --gen` tokens.
    #[arg(long, value_parser = kv_budget)]
    pub kv_budget: KvBudget,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 1024, value_parser = crate::args::tokens)]
    pub prompt: usize,
    /// Tokens generated per request (stop tokens are ignored: every request
    /// generates exactly this many).
    #[arg(long, default_value_t = 64, value_parser = crate::args::new_tokens)]
    pub r#gen: usize,
    /// Requests, all queued at the start.
    #[arg(long, default_value_t = 16, value_parser = crate::args::count)]
    pub requests: usize,
    /// Most sequences running at once (comma-separated: a sweep over batch
    /// sizes; the budget may admit fewer).
    #[arg(long, value_delimiter = ',', default_value = "256", value_parser = crate::args::count)]
    pub max_batch: Vec<usize>,
    /// Sequences that feed a prompt chunk per step.
    #[arg(long, default_value_t = 1, value_parser = crate::args::count)]
    pub max_prefills: usize,
    /// Text the prompts are cut from (default: the fetched Paul Graham essays).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Write an SVG of decode throughput against concurrency per config.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// JSON output (for scripts).
    #[arg(long)]
    pub json: bool,
}

fn pct(v: &mut [f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    Some(v[i])
}

fn label_of(p: &Path) -> String {
    p.file_stem().map_or_else(
        || p.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    )
}

pub fn run(a: &ThroughputArgs) -> Result<()> {
    let l = crate::commands::load_model(&a.model)?;
    let m = l.model.as_ref();
    let max = m.spec().max_seq_len;
    if a.prompt + a.r#gen > max {
        return Err(Error::ContextOverflow {
            len: a.prompt + a.r#gen,
            max,
        });
    }
    let source = crate::commands::PromptSource::load(&l.tok, a.text.as_deref())?;
    // Request i reads the text from its own offset (cycled when short).
    let prompt_of = |i: usize| source.prompt(i, a.prompt);
    let full = CacheBuilder::new(m.spec())
        .build(&RunConfig::default().cache)?
        .projected_kv_bytes(a.prompt, a.r#gen)?;
    let budget = match a.kv_budget {
        KvBudget::Bytes(b) => b,
        KvBudget::FullSeqs(n) => (n * full as f64).ceil() as usize,
    };
    let configs: Vec<(String, RunConfig)> = if a.configs.is_empty() {
        vec![("full".into(), RunConfig::default())]
    } else {
        a.configs
            .iter()
            .map(|p| Ok((label_of(p), crate::commands::load_config(Some(p))?)))
            .collect::<Result<_>>()?
    };
    let total_steps = (configs.len() * a.max_batch.len() * a.requests * a.r#gen) as u64;
    let bar = indicatif::ProgressBar::new(total_steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:>24} [{elapsed_precise}] {wide_bar} {pos}/{len} tokens ({eta})",
        )
        .expect("template"),
    );
    let mut rows = Vec::new();
    for (label, cfg) in &configs {
        for &mb in &a.max_batch {
            bar.set_message(format!("{label} batch<={mb}"));
            let (budgets, prompts) = ((budget, full), &prompt_of);
            rows.push(measure(a, m, (label, cfg), mb, budgets, prompts, &bar)?);
        }
    }
    bar.finish_and_clear();
    if let Some(p) = &a.plot {
        plot(p, &rows, budget)?;
    }
    if a.json {
        let v = json!({
            "bench": "throughput",
            "model": l.path.file_name().map(|f| f.to_string_lossy().into_owned()),
            "model_sha256": l.sha256()?, "threads": rayon::current_num_threads(),
            "activations": a.model.activations.name(),
            "max_isa": crate::provenance::max_isa_name(),
            "git_rev": crate::provenance::git_rev(), "results": rows,
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
        return Ok(());
    }
    print_table(&rows, budget, full, a);
    Ok(())
}

/// Runs `a.requests` requests of one config through the engine with at most
/// `mb` sequences per step; returns the row (throughput, concurrency, peaks,
/// latencies).
fn measure(
    a: &ThroughputArgs,
    m: &dyn minikv_models::LanguageModel,
    (label, cfg): (&str, &RunConfig),
    mb: usize,
    (budget, full): (usize, usize),
    prompt_of: &dyn Fn(usize) -> Vec<u32>,
    bar: &indicatif::ProgressBar,
) -> Result<serde_json::Value> {
    let builder = CacheBuilder::new(m.spec()).named_backend(&cfg.backend)?;
    let ecfg = EngineConfig {
        kv_budget: budget,
        max_batch: mb,
        max_prefills: a.max_prefills,
        ..EngineConfig::default()
    };
    let mut e = Engine::new(m, builder, cfg.cache.clone(), ecfg)?;
    let projected = e.projection(a.prompt, a.r#gen)?;
    for i in 0..a.requests {
        e.submit(Request {
            id: i as u64,
            prompt: prompt_of(i),
            max_new: a.r#gen,
            sampling: SamplingConfig::default(),
            stop: Vec::new(),
            logprobs: None,
        })?;
    }
    let t0 = Instant::now();
    let (mut ttft, mut itl, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    while !e.is_idle() {
        for ev in e.step()? {
            match ev {
                Event::Token { .. } => bar.inc(1),
                Event::Finished(f) => {
                    if let Finish::Error(msg) = &f.finish {
                        errors.push(format!("request {}: {msg}", f.id));
                    }
                    ttft.extend(f.ttft_s);
                    itl.extend(f.itl_s);
                }
            }
        }
    }
    if let Some(first) = errors.first() {
        return Err(Error::Input(format!(
            "bench throughput ({label}): {} request(s) failed; first: {first}",
            errors.len()
        )));
    }
    let wall = t0.elapsed().as_secs_f64();
    let s = e.stats();
    let generated = (a.requests * a.r#gen) as f64;
    Ok(json!({
        "config": label, "max_batch": mb, "requests": a.requests,
        "prompt": a.prompt, "gen": a.r#gen,
        "kv_budget": budget, "projected_kv_bytes_per_seq": projected,
        "full_projected_kv_bytes_per_seq": full,
        "admissible": budget / projected.max(1),
        "wall_s": wall,
        "generated_tok_per_s": generated / wall,
        "total_tok_per_s": (a.requests * (a.prompt + a.r#gen)) as f64 / wall,
        "decode_tok_per_s": if s.decode_only_s > 0.0 { s.decode_only_tokens as f64 / s.decode_only_s } else { 0.0 },
        "decode_only_steps": s.decode_only_steps,
        "mean_decoding": if s.decode_only_steps > 0 { s.decode_only_tokens as f64 / s.decode_only_steps as f64 } else { 0.0 },
        "peak_running": s.peak_running, "peak_decoding": s.peak_decoding,
        "peak_kv_bytes": s.peak_kv_bytes, "peak_total_bytes": s.peak_total_bytes,
        "ttft_p50_s": pct(&mut ttft, 0.5), "ttft_p99_s": pct(&mut ttft, 0.99),
        "itl_p50_s": pct(&mut itl, 0.5), "itl_p99_s": pct(&mut itl, 0.99),
        "steps": s.steps, "over_projection": s.over_projection,
        "cache": cfg.cache,
    }))
}

/// The human-readable table of `bench throughput`.
fn print_table(rows: &[serde_json::Value], budget: usize, full: usize, a: &ThroughputArgs) {
    println!(
        "KV budget {budget} bytes ({:.2} full fp16 sequences of {} + {} tokens)",
        budget as f64 / full as f64,
        a.prompt,
        a.r#gen
    );
    println!(
        "{:<22} {:>5} {:>6} {:>9} {:>9} {:>9} {:>7} {:>12} {:>9} {:>9}",
        "config",
        "batch",
        "admit",
        "gen t/s",
        "all t/s",
        "dec t/s",
        "conc",
        "peak KV B",
        "ttft p50",
        "itl p50"
    );
    for r in rows {
        println!(
            "{:<22} {:>5} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>7.1} {:>12} {:>9.3} {:>9.4}",
            r["config"].as_str().unwrap_or(""),
            r["max_batch"].as_u64().unwrap_or(0),
            r["admissible"].as_u64().unwrap_or(0),
            r["generated_tok_per_s"].as_f64().unwrap_or(0.0),
            r["total_tok_per_s"].as_f64().unwrap_or(0.0),
            r["decode_tok_per_s"].as_f64().unwrap_or(0.0),
            r["mean_decoding"].as_f64().unwrap_or(0.0),
            r["peak_kv_bytes"].as_u64().unwrap_or(0),
            r["ttft_p50_s"].as_f64().unwrap_or(0.0),
            r["itl_p50_s"].as_f64().unwrap_or(0.0),
        );
    }
}

/// Decode tokens/s against the mean number of decoding sequences, one line
/// per config over the batch limits; the budget in the caption.
fn plot(path: &Path, rows: &[serde_json::Value], budget: usize) -> Result<()> {
    let err = |e: String| Error::Input(format!("plot {}: {e}", path.display()));
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in rows {
        let label = r["config"].as_str().unwrap_or("").to_string();
        let pt = (
            r["mean_decoding"].as_f64().unwrap_or(0.0),
            r["decode_tok_per_s"].as_f64().unwrap_or(0.0),
        );
        match series.iter_mut().find(|s| s.0 == label) {
            Some(s) => s.1.push(pt),
            None => series.push((label, vec![pt])),
        }
    }
    let x1 = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.0))
        .fold(1.0f64, f64::max)
        * 1.1;
    let y1 = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .fold(1.0f64, f64::max)
        * 1.1;
    let root = SVGBackend::new(path, (760, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "decode throughput, KV budget {:.1} MiB",
                budget as f64 / (1 << 20) as f64
            ),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x1, 0.0..y1)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("sequences decoding per step (mean)")
        .y_desc("generated tokens/s")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, (label, pts)) in series.iter().enumerate() {
        let c = Palette99::pick(i).to_rgba();
        let mut pts = pts.clone();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c));
        chart
            .draw_series(pts.iter().map(|p| Circle::new(*p, 4, c.filled())))
            .map_err(|e| err(e.to_string()))?;
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}
