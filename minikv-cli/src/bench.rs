//! `minikv bench attention`: decode attention per token, full fp16 vs fused low-bit.

use clap::Args;
use clap::builder::TypedValueParser;
use minikv_core::attention::{AttentionBackend, DecodeArgs, HeadView};
use minikv_core::storage::FpStore;
use minikv_core::{Axis, Error, QuantStore, Result};
use minikv_quant::{Arithmetic, MinMax, ScaleDtype};
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

#[derive(Args)]
pub struct AttentionArgs {
    /// Cached tokens T (1 ..= 2^24; the caches must also fit in memory).
    #[arg(long, value_parser = crate::args::tokens)]
    pub tokens: usize,
    /// Head dimension (a multiple of 16).
    #[arg(long, default_value_t = 64, value_parser = crate::args::head_dim)]
    pub head_dim: usize,
    /// Query heads.
    #[arg(long, default_value_t = 9, value_parser = crate::args::heads)]
    pub q_heads: usize,
    /// KV heads (dividing the query heads).
    #[arg(long, default_value_t = 3, value_parser = crate::args::heads)]
    pub kv_heads: usize,
    /// Attention backend by registered name (`minikv components` lists
    /// them; default: the run config's default). Stores are created by the
    /// backend (device-resident for the CUDA backend).
    #[arg(long)]
    pub backend: Option<String>,
    /// Minimum measuring time per variant, seconds in (0, 3600].
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::seconds, allow_negative_numbers = true)]
    pub seconds: f64,
    /// Layers: each timed step decodes this many layers' caches in turn
    /// (distinct data), as a model's decode step does; times are per layer.
    /// With 1 (the default) a cache of a few MB stays in the last-level
    /// cache between steps, which a model's 30 layers do not.
    #[arg(long, default_value_t = 1, value_parser = crate::args::layers)]
    pub layers: usize,
    /// Code widths of the fused rows (the fp16 row always runs: it is the
    /// baseline of the ratios).
    #[arg(long, value_delimiter = ',', default_values_t = [2u32, 4], value_parser = clap::builder::PossibleValuesParser::new(["2", "4"]).map(|s| s.parse::<u32>().expect("2 or 4")))]
    pub bits: Vec<u32>,
    /// Arithmetic of the fused rows: `exact`, `int8` or both.
    #[arg(long, value_delimiter = ',', default_values_t = ["exact".to_string(), "int8".to_string()], value_parser = ["exact", "int8"])]
    pub arithmetic: Vec<String>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

struct Heads {
    qk: Vec<Option<Box<dyn QuantStore>>>,
    qv: Vec<Option<Box<dyn QuantStore>>>,
    fk: Vec<Box<dyn FpStore>>,
    fv: Vec<Box<dyn FpStore>>,
}

impl Heads {
    fn bytes(&self) -> usize {
        let q: usize = self
            .qk
            .iter()
            .chain(&self.qv)
            .flatten()
            .map(|s| {
                let b = s.bytes();
                b.codes + b.scales
            })
            .sum();
        q + self
            .fk
            .iter()
            .chain(&self.fv)
            .map(|s| s.bytes())
            .sum::<usize>()
    }
    fn views(&self) -> Vec<HeadView<'_>> {
        (0..self.fk.len())
            .map(|s| HeadView {
                quant_keys: self.qk[s].as_deref(),
                quant_values: self.qv[s].as_deref(),
                fp_keys: self.fk[s].as_ref(),
                fp_values: self.fv[s].as_ref(),
                extra: None,
            })
            .collect()
    }
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) as f32 / u32::MAX as f32) * 2.0
                - 1.0
        })
        .collect()
}

/// One [`Heads`] per layer (`--layers`), with distinct data.
fn build(
    a: &AttentionArgs,
    be: &dyn AttentionBackend,
    bits: Option<u32>,
    arithmetic: Arithmetic,
) -> Result<Vec<Heads>> {
    (0..a.layers)
        .map(|l| build_layer(a, be, bits, arithmetic, 1000 * l as u32))
        .collect()
}

fn build_layer(
    a: &AttentionArgs,
    be: &dyn AttentionBackend,
    bits: Option<u32>,
    arithmetic: Arithmetic,
    seed: u32,
) -> Result<Heads> {
    let (t, d) = (a.tokens, a.head_dim);
    let st = be.storage();
    let mut h = Heads {
        qk: vec![],
        qv: vec![],
        fk: vec![],
        fv: vec![],
    };
    for s in 0..a.kv_heads {
        let k = data(t * d, seed + 17 + s as u32);
        let v = data(t * d, seed + 91 + s as u32);
        let mut fk = st.fp_store(d, 256);
        let mut fv = st.fp_store(d, 256);
        match bits {
            None => {
                fk.push(&k);
                fv.push(&v);
                h.qk.push(None);
                h.qv.push(None);
            }
            Some(b) => {
                let g = 16;
                let nq = t - t % g;
                let mut qk = st.quant_store(
                    &MinMax {
                        bits: b,
                        group: g,
                        axis: Axis::Channel,
                        scale_dtype: ScaleDtype::F16,
                        arithmetic,
                    },
                    d,
                    256,
                )?;
                let mut qv = st.quant_store(
                    &MinMax {
                        bits: b,
                        group: g,
                        axis: Axis::Token,
                        scale_dtype: ScaleDtype::F16,
                        arithmetic,
                    },
                    d,
                    256,
                )?;
                qk.append(&k[..nq * d])?;
                qv.append(&v[..nq * d])?;
                qk.shrink();
                qv.shrink();
                fk.push(&k[nq * d..]);
                fv.push(&v[nq * d..]);
                h.qk.push(Some(qk));
                h.qv.push(Some(qv));
            }
        }
        fk.shrink();
        fv.shrink();
        h.fk.push(fk);
        h.fv.push(fv);
    }
    Ok(h)
}

/// Median seconds of one step per layer.
fn time(a: &AttentionArgs, be: &dyn AttentionBackend, layers: &[Heads]) -> Result<f64> {
    let q = data(a.q_heads * a.head_dim, 5);
    let mut out = vec![0.0f32; q.len()];
    let views: Vec<Vec<HeadView<'_>>> = layers.iter().map(|h| h.views()).collect();
    let mut step = || {
        for v in &views {
            be.decode(DecodeArgs {
                q: &q,
                heads: v,
                head_dim: a.head_dim,
                out: &mut out,
                probs: None,
            })?;
        }
        Ok::<(), Error>(())
    };
    for _ in 0..3 {
        step()?;
    }
    let mut samples = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < a.seconds || samples.len() < 5 {
        let t = Instant::now();
        step()?;
        samples.push(t.elapsed().as_secs_f64() / layers.len() as f64);
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
}

/// Bytes one layer's caches hold.
fn layer_bytes(layers: &[Heads]) -> usize {
    layers.first().map_or(0, Heads::bytes)
}

pub fn attention(a: &AttentionArgs) -> Result<()> {
    if !a.q_heads.is_multiple_of(a.kv_heads) {
        return Err(Error::Input(format!(
            "--kv-heads {} must divide --q-heads {}",
            a.kv_heads, a.q_heads
        )));
    }
    // Sized before allocating: f32 inputs and fp16 copies of K and V per head.
    // The f32 inputs of one layer at a time, and the fp16 caches of every
    // layer (the fused rows are built after the fp16 ones are dropped).
    let need = (a.tokens as u128)
        * (a.kv_heads as u128)
        * (a.head_dim as u128)
        * (8 + 4 * a.layers as u128);
    const LIMIT: u128 = 8 << 30;
    if need > LIMIT {
        return Err(Error::Input(format!(
            "--tokens {} x --kv-heads {} x --head-dim {} x --layers {} needs {:.1} GiB; the benchmark allows 8 GiB (lower --tokens or --layers)",
            a.tokens,
            a.kv_heads,
            a.head_dim,
            a.layers,
            need as f64 / (1u64 << 30) as f64
        )));
    }
    let name = a
        .backend
        .clone()
        .unwrap_or_else(|| minikv_core::RunConfig::default().backend);
    let be: Arc<dyn AttentionBackend> = minikv_core::attention::make_backend(&name)?;
    let full = build(a, be.as_ref(), None, Arithmetic::Exact)?;
    let tf = time(a, be.as_ref(), &full)?;
    let full_bytes = layer_bytes(&full);
    drop(full);
    let mut rows = vec![
        json!({"cache": "fp16", "seconds_per_token": tf, "bytes_read_per_token": full_bytes, "speedup_vs_fp16": 1.0}),
    ];
    for &b in &a.bits {
        for (ar, an) in [(Arithmetic::Exact, "exact"), (Arithmetic::Int8, "int8")] {
            if !a.arithmetic.iter().any(|x| x == an) {
                continue;
            }
            let h = match build(a, be.as_ref(), Some(b), ar) {
                Ok(h) => h,
                // A backend without integer kernels (CUDA) refuses int8:
                // the row says so instead of failing the benchmark.
                Err(e) if ar == Arithmetic::Int8 => {
                    rows.push(json!({"cache": format!("fused {b}-bit {an}: not run ({e})"), "bits": b, "arithmetic": an, "not_run": e.to_string()}));
                    continue;
                }
                Err(e) => return Err(e),
            };
            let tq = time(a, be.as_ref(), &h)?;
            let hb = layer_bytes(&h);
            rows.push(json!({"cache": format!("fused {b}-bit {an} (G=16, keys per channel, values per token)"), "bits": b, "arithmetic": an, "seconds_per_token": tq, "bytes_read_per_token": hb, "speedup_vs_fp16": tf / tq, "bytes_ratio_vs_fp16": full_bytes as f64 / hb as f64}));
        }
    }
    let v = json!({"backend": name, "tokens": a.tokens, "layers": a.layers, "head_dim": a.head_dim, "q_heads": a.q_heads, "kv_heads": a.kv_heads, "threads": rayon_threads(), "max_isa": crate::provenance::max_isa_name(), "results": rows});
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
    } else {
        if a.layers > 1 {
            println!("{} layers per step; times and bytes per layer", a.layers);
        }
        for r in v["results"].as_array().expect("array") {
            if r.get("not_run").is_some() {
                println!("{}", r["cache"].as_str().unwrap_or(""));
                continue;
            }
            println!(
                "{:<60} {:>10.1} us/token  {:>10} bytes  x{:.2}",
                r["cache"].as_str().unwrap_or(""),
                r["seconds_per_token"].as_f64().unwrap_or(0.0) * 1e6,
                r["bytes_read_per_token"],
                r["speedup_vs_fp16"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Prints a decode or prefill benchmark: JSON with provenance, or a table
/// keyed by `key` (depth or prompt tokens).
fn emit(
    bench: &str,
    key: &str,
    l: &crate::commands::Loaded,
    rows: Vec<serde_json::Value>,
    as_json: bool,
) -> Result<()> {
    if as_json {
        let v = json!({
            "bench": bench, "model": l.path.file_name().map(|f| f.to_string_lossy().into_owned()),
            "model_sha256": l.sha256()?, "threads": rayon::current_num_threads(),
            "max_isa": crate::provenance::max_isa_name(),
            "git_rev": crate::provenance::git_rev(), "results": rows,
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
        return Ok(());
    }
    println!(
        "{:<28} {:>7} {:>10} {:>19}",
        "config", key, "tok/s", "min - max"
    );
    for r in &rows {
        println!(
            "{:<28} {:>7} {:>10.1} {:>8.1} - {:>8.1}",
            r["config"].as_str().unwrap_or(""),
            // The depth that ran (lowered to fit the context), not the one asked.
            r.get(format!("{key}_used")).unwrap_or(&r[key]).to_string(),
            r["tokens_per_s"].as_f64().unwrap_or(0.0),
            r["min"].as_f64().unwrap_or(0.0),
            r["max"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}

/// `minikv bench decode`: end-to-end decode speed of the real model by depth.
#[derive(Args)]
pub struct DecodeBenchArgs {
    #[command(flatten)]
    pub model: crate::ModelArg,
    /// Cache configs (repeatable; none = the full cache). Labels are file stems.
    #[arg(long = "config")]
    pub configs: Vec<std::path::PathBuf>,
    /// Context depths in tokens before the timed steps (comma-separated; 0 =
    /// one prompt token, llama-bench's `-d 0`).
    #[arg(long, value_delimiter = ',', default_value = "0,4096,8192", value_parser = crate::args::tokens_or_zero)]
    pub depth: Vec<usize>,
    /// Decode steps per timed run (llama-bench's `-n`).
    #[arg(long, default_value_t = 64, value_parser = crate::args::new_tokens)]
    pub tokens: usize,
    /// Timed runs per (config, depth); the median is reported with the spread.
    #[arg(long, default_value_t = 3, value_parser = crate::args::count)]
    pub runs: usize,
    /// Untimed decode steps before the runs.
    #[arg(long, default_value_t = 8, value_parser = crate::args::tokens_or_zero)]
    pub warmup: usize,
    /// Text the context is cut from (default: the fetched Paul Graham essays).
    #[arg(long)]
    pub text: Option<std::path::PathBuf>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// `minikv bench prefill`: prompt processing speed by prompt length.
#[derive(Args)]
pub struct PrefillBenchArgs {
    #[command(flatten)]
    pub model: crate::ModelArg,
    /// Cache configs (repeatable; none = the full cache).
    #[arg(long = "config")]
    pub configs: Vec<std::path::PathBuf>,
    /// Prompt lengths (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "512,4096", value_parser = crate::args::tokens)]
    pub tokens: Vec<usize>,
    /// Timed runs per (config, length), each on a fresh cache.
    #[arg(long, default_value_t = 3, value_parser = crate::args::count)]
    pub runs: usize,
    /// Text the prompt is cut from (default: the fetched Paul Graham essays).
    #[arg(long)]
    pub text: Option<std::path::PathBuf>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

fn median_spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let med = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (med, v[0], v[n - 1])
}

/// The configs to run: (label, config); the full cache when none is given.
fn bench_configs(paths: &[std::path::PathBuf]) -> Result<Vec<(String, minikv_core::RunConfig)>> {
    if paths.is_empty() {
        return Ok(vec![("full".into(), minikv_core::RunConfig::default())]);
    }
    paths
        .iter()
        .map(|p| {
            let label = p.file_stem().map_or_else(
                || p.display().to_string(),
                |s| s.to_string_lossy().into_owned(),
            );
            Ok((label, crate::commands::load_config(Some(p))?))
        })
        .collect()
}

/// `n` tokens of the text, repeated if the text is shorter.
fn text_tokens(
    l: &crate::commands::Loaded,
    text: Option<&std::path::Path>,
    n: usize,
) -> Result<Vec<u32>> {
    let path = text.map_or_else(crate::commands::default_text, |p| p.to_path_buf());
    let ids = l.tok.encode(&crate::commands::read_text(&path)?)?;
    if ids.is_empty() {
        return Err(Error::Input(format!("{}: no tokens", path.display())));
    }
    Ok(ids.iter().copied().cycle().take(n).collect())
}

pub fn decode(a: &DecodeBenchArgs) -> Result<()> {
    use minikv_models::{Logits, Workspace};
    let l = crate::commands::load_model(&a.model)?;
    let m = l.model.as_ref();
    // Steps after the context; a depth that leaves no room for them within
    // the model's context is lowered to fit (reported as `depth_used`).
    let steps = a.warmup + a.runs * a.tokens + 1;
    let max = m.spec().max_seq_len;
    if steps + 1 > max {
        return Err(Error::ContextOverflow {
            len: steps + 1,
            max,
        });
    }
    let fit = |depth: usize| depth.max(1).min(max - steps);
    let need = a.depth.iter().map(|&d| fit(d)).max().unwrap_or(1) + steps;
    let ids = text_tokens(&l, a.text.as_deref(), need)?;
    let mut rows = Vec::new();
    for (label, cfg) in bench_configs(&a.configs)? {
        for &depth in &a.depth {
            let d = fit(depth);
            if d < depth {
                eprintln!(
                    "bench decode: depth {depth} lowered to {d} so that {steps} more tokens fit the model's {max}"
                );
            }
            let mut cache = crate::commands::build_cache(m, &cfg)?;
            let mut ws = Workspace::default();
            let t0 = Instant::now();
            m.forward(&ids[..d], cache.as_mut(), &mut ws, Logits::Last)?;
            minikv_models::finish_prefill(m, cache.as_mut(), &ids[..d], &mut ws)?;
            let prefill_s = t0.elapsed().as_secs_f64();
            let mut pos = d;
            for _ in 0..a.warmup {
                m.forward(&ids[pos..pos + 1], cache.as_mut(), &mut ws, Logits::Last)?;
                pos += 1;
            }
            let mut rates = Vec::with_capacity(a.runs);
            for _ in 0..a.runs {
                let t = Instant::now();
                for _ in 0..a.tokens {
                    m.forward(&ids[pos..pos + 1], cache.as_mut(), &mut ws, Logits::Last)?;
                    pos += 1;
                }
                rates.push(a.tokens as f64 / t.elapsed().as_secs_f64());
            }
            let (med, lo, hi) = median_spread(rates.clone());
            let mem = cache.memory();
            rows.push(json!({
                "config": label, "depth": depth, "depth_used": d, "tokens": a.tokens, "runs": rates,
                "tokens_per_s": med, "min": lo, "max": hi,
                "prefill_s": prefill_s, "kv_bytes": mem.used_bytes(),
            }));
        }
    }
    emit("decode", "depth", &l, rows, a.json)
}

pub fn prefill(a: &PrefillBenchArgs) -> Result<()> {
    use minikv_models::{Logits, Workspace};
    let l = crate::commands::load_model(&a.model)?;
    let m = l.model.as_ref();
    let max = a.tokens.iter().copied().max().unwrap_or(1);
    if max > m.spec().max_seq_len {
        return Err(Error::ContextOverflow {
            len: max,
            max: m.spec().max_seq_len,
        });
    }
    let ids = text_tokens(&l, a.text.as_deref(), max)?;
    let mut rows = Vec::new();
    for (label, cfg) in bench_configs(&a.configs)? {
        for &n in &a.tokens {
            let (mut rates, mut compress) = (Vec::new(), Vec::new());
            for _ in 0..a.runs {
                let mut cache = crate::commands::build_cache(m, &cfg)?;
                let mut ws = Workspace::default();
                let t = Instant::now();
                m.forward(&ids[..n], cache.as_mut(), &mut ws, Logits::Last)?;
                let tc = Instant::now();
                minikv_models::finish_prefill(m, cache.as_mut(), &ids[..n], &mut ws)?;
                compress.push(tc.elapsed().as_secs_f64());
                rates.push(n as f64 / t.elapsed().as_secs_f64());
            }
            let (med, lo, hi) = median_spread(rates.clone());
            rows.push(json!({
                "config": label, "tokens": n, "runs": rates, "tokens_per_s": med,
                "min": lo, "max": hi, "end_prefill_s": median_spread(compress).0,
            }));
        }
    }
    emit("prefill", "tokens", &l, rows, a.json)
}
