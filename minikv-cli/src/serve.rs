//! `minikv serve` (an OpenAI-compatible server on the batched engine) and
//! `minikv bench serve` (a load test against any OpenAI-compatible server:
//! concurrent streaming clients, token-id prompts cut from a real text, so
//! two servers with the same tokenizer get the same tokens).

use crate::throughput::{KvBudget, kv_budget};
use clap::Args;
use minikv_core::{CacheBuilder, Error, Result};
use minikv_engine::EngineConfig;
use minikv_server::{Server, ServerConfig};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: crate::ModelArg,
    /// Cache config (TOML/JSON); default: the full fp16 cache.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// KV bytes the running sequences may hold together (`1GiB`, `512MB`,
    /// or `NxFULL`: N full fp16 caches of the whole context). Each request
    /// reserves what its cache will hold for its prompt and `max_tokens`.
    #[arg(long, default_value = "1GiB", value_parser = kv_budget)]
    pub kv_budget: KvBudget,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 256, value_parser = crate::args::count)]
    pub max_batch: usize,
    /// Sequences that feed a prompt chunk per step.
    #[arg(long, default_value_t = 1, value_parser = crate::args::count)]
    pub max_prefills: usize,
    /// Tokens generated when a request gives no `max_tokens`.
    #[arg(long, default_value_t = 256, value_parser = crate::args::new_tokens)]
    pub default_max_tokens: usize,
    /// Seed of requests that give none (request n gets seed + n; default:
    /// the config's seed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Jinja chat template file (for models without one, or to replace it).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Name the model is served as (default: the model file's stem).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Largest request body.
    #[arg(long, default_value = "4MiB", value_parser = kv_budget)]
    pub max_body: KvBudget,
}

pub fn serve(a: &ServeArgs) -> Result<()> {
    let cfg = crate::commands::load_config(a.config.as_deref())?;
    let l = crate::commands::load_model(&a.model)?;
    let mut tok = l.tok.clone();
    if let Some(p) = &a.chat_template {
        let src =
            minikv_core::files::read_text_bounded(p, minikv_core::files::MIB, "a chat template")?;
        tok.set_chat_template(&src)?;
    }
    let spec = l.model.spec();
    let builder = CacheBuilder::new(spec.clone()).named_backend(&cfg.backend)?;
    let budget = match a.kv_budget {
        KvBudget::Bytes(b) => b,
        KvBudget::FullSeqs(n) => {
            let full = CacheBuilder::new(spec.clone())
                .build(&minikv_core::RunConfig::default().cache)?
                .projected_kv_bytes(spec.max_seq_len.saturating_sub(1).max(1), 1)?;
            (n * full as f64).ceil() as usize
        }
    };
    let max_body = match a.max_body {
        KvBudget::Bytes(b) => b,
        KvBudget::FullSeqs(_) => {
            return Err(Error::config("--max-body", "a size in bytes (e.g. 4MiB)"));
        }
    };
    let seed = a.seed.unwrap_or(cfg.seed);
    // The served model's name: the flag, else the model file's stem.
    const FALLBACK_NAME: &str = "minikv";
    let name = a.model_name.clone().unwrap_or_else(|| {
        l.path
            .file_stem()
            .map_or(FALLBACK_NAME.into(), |s| s.to_string_lossy().into_owned())
    });
    let prov = crate::provenance::provenance(
        Some(&l.path),
        seed,
        Some(serde_json::to_value(&cfg).expect("config serializes")),
    )?;
    let scfg = ServerConfig {
        model_name: name.clone(),
        engine: EngineConfig {
            kv_budget: budget,
            max_batch: a.max_batch,
            max_prefills: a.max_prefills,
            ..EngineConfig::default()
        },
        default_max_tokens: a.default_max_tokens,
        max_body_bytes: max_body,
        seed,
        provenance: serde_json::to_value(&prov).expect("provenance serializes"),
        ..ServerConfig::default()
    };
    let label = a
        .config
        .as_ref()
        .map_or("full fp16 cache".into(), |p| p.display().to_string());
    let server = Server::start(
        l.model,
        tok,
        builder,
        cfg.cache,
        scfg,
        (a.host.as_str(), a.port),
    )?;
    eprintln!(
        "minikv serve: {name} ({label}), KV budget {budget} bytes, {} threads; listening on http://{}",
        rayon::current_num_threads(),
        server.addr()
    );
    // Scripts read the address from this line.
    println!("listening on http://{}", server.addr());
    server.wait_for_ctrl_c()
}

#[derive(Args)]
pub struct LoadArgs {
    /// Base URL of an OpenAI-compatible server (loopback only).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// The model whose tokenizer cuts the prompts (token ids are sent).
    #[command(flatten)]
    pub model: crate::ModelArg,
    /// Concurrent streaming clients.
    #[arg(long, default_value_t = 64, value_parser = crate::args::count)]
    pub clients: usize,
    /// Requests in all (default: one per client).
    #[arg(long, value_parser = crate::args::count)]
    pub requests: Option<usize>,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 512, value_parser = crate::args::tokens)]
    pub prompt: usize,
    /// Tokens generated per request (`ignore_eos`: exactly this many).
    #[arg(long, default_value_t = 128, value_parser = crate::args::new_tokens)]
    pub r#gen: usize,
    /// Text the prompts are cut from (default: the fetched Paul Graham essays).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Give up after this many seconds (requests still open count as failed).
    #[arg(long, default_value_t = 3600.0, value_parser = crate::args::seconds)]
    pub deadline: f64,
    /// Label of this run in the output.
    #[arg(long, default_value = "server")]
    pub label: String,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// One request's client-side timings.
#[derive(Debug, Default)]
struct Sample {
    ttft: Option<f64>,
    itl: Vec<f64>,
    tokens: usize,
    end: f64,
    kv_bytes: Option<u64>,
    error: Option<String>,
}

fn pct(v: &mut [f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[((v.len() - 1) as f64 * p).round() as usize])
}

async fn one(client: reqwest::Client, url: String, body: Value, t0: Instant) -> Sample {
    let mut s = Sample::default();
    let sent = Instant::now();
    let resp = match client.post(&url).json(&body).send().await {
        Ok(r) => r,
        Err(e) => {
            s.error = Some(format!("send: {e}"));
            return s;
        }
    };
    if !resp.status().is_success() {
        let st = resp.status();
        s.error = Some(format!("{st}: {}", resp.text().await.unwrap_or_default()));
        return s;
    }
    use futures_util::StreamExt;
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut last: Option<Instant> = None;
    let mut chunks = 0usize;
    let mut usage_tokens = None;
    'outer: while let Some(piece) = stream.next().await {
        let piece = match piece {
            Ok(p) => p,
            Err(e) => {
                s.error = Some(format!("stream: {e}"));
                break;
            }
        };
        buf.extend_from_slice(&piece);
        // Server-sent events: blank-line separated, `data: ` lines.
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let ev: Vec<u8> = buf.drain(..end + 2).collect();
            for line in String::from_utf8_lossy(&ev).lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    break 'outer;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if let Some(e) = v.get("error") {
                    s.error = Some(e.to_string());
                    break 'outer;
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    usage_tokens = u["completion_tokens"].as_u64();
                    s.kv_bytes = u["kv_bytes"].as_u64();
                }
                let has_text = v["choices"]
                    .get(0)
                    .and_then(|c| c["text"].as_str())
                    .is_some_and(|t| !t.is_empty());
                if has_text {
                    let now = Instant::now();
                    chunks += 1;
                    match last {
                        None => s.ttft = Some((now - sent).as_secs_f64()),
                        Some(l) => s.itl.push((now - l).as_secs_f64()),
                    }
                    last = Some(now);
                }
            }
        }
    }
    s.tokens = usage_tokens.map_or(chunks, |u| u as usize);
    s.end = t0.elapsed().as_secs_f64();
    s
}

/// Sends the prompts from `a.clients` concurrent streaming clients; returns
/// every request's sample and the wall time.
fn drive(
    a: &LoadArgs,
    prompts: Vec<Vec<u32>>,
    model: Option<String>,
) -> Result<(Vec<Sample>, f64)> {
    let endpoint = format!("{}/v1/completions", a.url.trim_end_matches('/'));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| Error::Input(format!("runtime: {e}")))?;
    let deadline = Duration::from_secs_f64(a.deadline);
    rt.block_on(async {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(a.clients)
            .build()
            .map_err(|e| Error::Input(format!("HTTP client: {e}")))?;
        let t0 = Instant::now();
        let queue = std::sync::Arc::new(tokio::sync::Mutex::new(prompts.into_iter()));
        let mut tasks = Vec::new();
        for _ in 0..a.clients {
            let (client, endpoint, queue) = (client.clone(), endpoint.clone(), queue.clone());
            let (gen_n, model) = (a.r#gen, model.clone());
            tasks.push(tokio::spawn(async move {
                let mut out = Vec::new();
                loop {
                    let Some(p) = queue.lock().await.next() else {
                        break;
                    };
                    let body = json!({
                        "model": model, "prompt": p, "max_tokens": gen_n,
                        "temperature": 0, "stream": true, "ignore_eos": true,
                        "stream_options": {"include_usage": true},
                    });
                    out.push(one(client.clone(), endpoint.clone(), body, t0).await);
                }
                out
            }));
        }
        let all = futures_util::future::join_all(tasks);
        let res = tokio::time::timeout(deadline, all).await.map_err(|_| {
            Error::Input(format!(
                "bench serve: not done within --deadline {} s",
                a.deadline
            ))
        })?;
        let mut samples = Vec::new();
        for r in res {
            samples.extend(r.map_err(|e| Error::Input(format!("client task: {e}")))?);
        }
        Ok::<_, Error>((samples, t0.elapsed().as_secs_f64()))
    })
}

pub fn load(a: &LoadArgs) -> Result<()> {
    let url = reqwest::Url::parse(&a.url)
        .map_err(|e| Error::config("--url", format!("`{}`: {e}", a.url)))?;
    let host = url.host_str().unwrap_or_default();
    if !matches!(host, "127.0.0.1" | "localhost" | "[::1]" | "::1") {
        return Err(Error::config(
            "--url",
            format!(
                "the load test sends traffic to loopback only (127.0.0.1, localhost, ::1), got `{host}`"
            ),
        ));
    }
    let l = crate::commands::load_model(&a.model)?;
    let source = crate::commands::PromptSource::load(&l.tok, a.text.as_deref())?;
    let n = a.requests.unwrap_or(a.clients);
    let prompts: Vec<Vec<u32>> = (0..n).map(|i| source.prompt(i, a.prompt)).collect();
    let model = l.path.file_stem().map(|s| s.to_string_lossy().into_owned());
    let (samples, wall) = drive(a, prompts, model)?;
    let errors: Vec<&String> = samples.iter().filter_map(|s| s.error.as_ref()).collect();
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
    let generated: usize = ok.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|s| s.ttft).collect();
    let mut itl: Vec<f64> = ok.iter().flat_map(|s| s.itl.iter().copied()).collect();
    let kv: Vec<u64> = ok.iter().filter_map(|s| s.kv_bytes).collect();
    let row = json!({
        "bench": "serve", "label": a.label, "url": a.url,
        "clients": a.clients, "requests": n, "prompt": a.prompt, "gen": a.r#gen,
        "ok": ok.len(), "errors": errors.len(), "first_error": errors.first(),
        "wall_s": wall,
        "requests_per_s": ok.len() as f64 / wall,
        "generated_tok_per_s": generated as f64 / wall,
        "generated_tokens": generated,
        "ttft_p50_s": pct(&mut ttft, 0.5), "ttft_p99_s": pct(&mut ttft, 0.99),
        "itl_p50_s": pct(&mut itl, 0.5), "itl_p99_s": pct(&mut itl, 0.99),
        "mean_kv_bytes": if kv.is_empty() { None } else { Some(kv.iter().sum::<u64>() as f64 / kv.len() as f64) },
        "model_sha256": l.sha256()?, "git_rev": crate::provenance::git_rev(),
    });
    if a.json {
        println!("{}", serde_json::to_string(&row).expect("json"));
    } else {
        println!(
            "{}: {} ok / {} errors in {:.1} s: {:.3} req/s, {:.1} generated tok/s, TTFT p50 {:.2} s p99 {:.2} s, ITL p50 {:.3} s",
            a.label,
            ok.len(),
            errors.len(),
            wall,
            row["requests_per_s"].as_f64().unwrap_or(0.0),
            row["generated_tok_per_s"].as_f64().unwrap_or(0.0),
            row["ttft_p50_s"].as_f64().unwrap_or(f64::NAN),
            row["ttft_p99_s"].as_f64().unwrap_or(f64::NAN),
            row["itl_p50_s"].as_f64().unwrap_or(f64::NAN),
        );
        if let Some(e) = errors.first() {
            eprintln!("first error: {e}");
        }
    }
    if !errors.is_empty() {
        return Err(Error::Input(format!(
            "bench serve: {} of {n} requests failed",
            errors.len()
        )));
    }
    Ok(())
}
