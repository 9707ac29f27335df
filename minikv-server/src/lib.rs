//! # minikv-server
//!
//! An OpenAI-compatible HTTP server over the batched [`minikv_engine`]:
//! every request gets its own compressed KV cache built from one config,
//! continuous batching runs all admitted sequences in one forward per step,
//! and admission is by KV bytes (each request reserves what its cache will
//! hold), so the memory a compression method saves becomes concurrency.
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions` (the model's
//! chat template), both with server-sent-event streaming; `GET /v1/models`,
//! `GET /health`, `GET /metrics` (OpenMetrics text for Prometheus). Each
//! answer's `usage` carries what its cache cost: `kv_bytes`,
//! `kv_peak_bytes`, `kv_fp16_bytes`, `kv_ratio_to_fp16`.
//!
//! Threads: the engine runs on its own thread (its forward uses rayon); the
//! HTTP side is an axum app on a small tokio runtime that talks to it over
//! channels. A client that disconnects drops its response stream, which
//! cancels its sequence and frees its bytes at the next step.
//!
//! ```no_run
//! use minikv_core::{CacheBuilder, RunConfig};
//! use minikv_server::{Server, ServerConfig};
//!
//! let (model, tok) = minikv_models::load(std::path::Path::new("assets/SmolLM2-135M-Instruct.Q4_1.gguf"))?;
//! let mut cfg = RunConfig::load(std::path::Path::new("configs/minikv.toml"))?;
//! cfg.resolve()?;
//! let builder = CacheBuilder::new(model.spec());
//! let server = Server::start(model, tok, builder, cfg.cache, ServerConfig::default(), "127.0.0.1:8080")?;
//! println!("listening on http://{}", server.addr());
//! server.wait_for_ctrl_c()?;
//! # Ok::<(), minikv_core::Error>(())
//! ```

#![warn(missing_docs)]

pub mod api;
pub mod error;
mod job;
pub mod metrics;
mod routes;
pub mod text;
pub mod worker;

use axum::Router;
use axum::routing::{get, post};
use minikv_core::{CacheBuilder, CacheConfig, Error, Result};
use minikv_engine::EngineConfig;
use minikv_models::{LanguageModel, Tokenizer};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The model's name in responses and `/v1/models`.
    pub model_name: String,
    /// Batching and admission.
    pub engine: EngineConfig,
    /// Tokens generated when a request gives no `max_tokens` (capped by
    /// what the context leaves).
    pub default_max_tokens: usize,
    /// Largest request body, bytes (larger: 413).
    pub max_body_bytes: usize,
    /// Seed of requests that give none (request `n` gets `seed + n`).
    pub seed: u64,
    /// What produced the answers (config, seed, model checksum, revision),
    /// shown in `/v1/models`; its hash is each answer's `system_fingerprint`.
    pub provenance: serde_json::Value,
    /// Interval of SSE keep-alive comments (they also notice clients that
    /// left while their request waits).
    pub keep_alive: Duration,
    /// Threads of the HTTP runtime (the engine has its own).
    pub http_threads: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            model_name: "minikv".into(),
            engine: EngineConfig::default(),
            default_max_tokens: 256,
            max_body_bytes: 4 << 20,
            seed: 0,
            provenance: serde_json::Value::Null,
            keep_alive: Duration::from_secs(1),
            http_threads: 2,
        }
    }
}

/// What the handlers share.
pub(crate) struct App {
    cfg: ServerConfig,
    tok: Arc<Tokenizer>,
    cmd: std::sync::mpsc::Sender<worker::Cmd>,
    metrics: Arc<metrics::Metrics>,
    next_id: AtomicU64,
    engine_alive: Arc<AtomicBool>,
    ctx: usize,
    vocab: usize,
    started: u64,
    fingerprint: String,
}

/// A running server (see the crate docs).
pub struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    http: Option<JoinHandle<std::io::Result<()>>>,
    engine: Option<JoinHandle<Result<()>>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("addr", &self.addr).finish()
    }
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// The routes over shared state.
fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/completions", post(routes::completions))
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/models", get(routes::models))
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::wrong_method)
        .with_state(app)
}

impl Server {
    /// Binds `addr` (port 0: any free port), starts the engine thread and
    /// the HTTP runtime, and returns once both run. Errors: the address
    /// cannot be bound, or the engine settings or cache config are invalid.
    pub fn start(
        model: Box<dyn LanguageModel>,
        tok: Tokenizer,
        builder: CacheBuilder,
        cache: CacheConfig,
        cfg: ServerConfig,
        addr: impl ToSocketAddrs,
    ) -> Result<Self> {
        if cfg.default_max_tokens == 0 || cfg.max_body_bytes == 0 || cfg.http_threads == 0 {
            return Err(Error::config(
                "server",
                "default_max_tokens, max_body_bytes and http_threads must be at least 1",
            ));
        }
        let io = |e: std::io::Error| Error::Input(format!("cannot listen: {e}"));
        let listener = std::net::TcpListener::bind(addr).map_err(io)?;
        listener.set_nonblocking(true).map_err(io)?;
        let local = listener.local_addr().map_err(io)?;
        let ctx = model.spec().max_seq_len;
        let vocab = model.vocab_size();
        let metrics = Arc::new(metrics::Metrics::new());
        let (cmd, rx) = std::sync::mpsc::channel();
        let alive = Arc::new(AtomicBool::new(true));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
        let engine = {
            let (metrics, alive, ecfg) = (metrics.clone(), alive.clone(), cfg.engine.clone());
            std::thread::Builder::new()
                .name("minikv-engine".into())
                .spawn(move || {
                    let r = worker::run(model, builder, cache, ecfg, rx, metrics, ready_tx);
                    alive.store(false, Ordering::Relaxed);
                    if let Err(e) = &r {
                        eprintln!("minikv serve: the engine stopped: {e}");
                    }
                    r
                })
                .map_err(|e| Error::Input(format!("cannot start the engine thread: {e}")))?
        };
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = engine.join();
                return Err(e);
            }
            Err(_) => {
                return Err(Error::Input(
                    "the engine thread ended while starting".into(),
                ));
            }
        }
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let fingerprint = format!(
            "minikv-{}-{:016x}",
            env!("CARGO_PKG_VERSION"),
            fnv(&cfg.provenance.to_string())
        );
        let threads = cfg.http_threads;
        let app = Arc::new(App {
            cfg,
            tok: Arc::new(tok),
            cmd,
            metrics,
            next_id: AtomicU64::new(0),
            engine_alive: alive,
            ctx,
            vocab,
            started,
            fingerprint,
        });
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("minikv-http")
            .enable_all()
            .build()
            .map_err(|e| Error::Input(format!("cannot start the HTTP runtime: {e}")))?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let http = std::thread::Builder::new()
            .name("minikv-http-main".into())
            .spawn(move || {
                rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener)?;
                    axum::serve(listener, router(app))
                        .with_graceful_shutdown(async move {
                            let _ = stop_rx.await;
                        })
                        .await
                })
            })
            .map_err(|e| Error::Input(format!("cannot start the HTTP thread: {e}")))?;
        Ok(Self {
            addr: local,
            stop: Some(stop_tx),
            http: Some(http),
            engine: Some(engine),
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops taking connections, lets open responses finish, then stops the
    /// engine.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(h) = self.http.take() {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(Error::Input(format!("HTTP server: {e}"))),
                Err(_) => return Err(Error::Input("the HTTP thread panicked".into())),
            }
        }
        if let Some(h) = self.engine.take() {
            match h.join() {
                Ok(r) => r?,
                Err(_) => return Err(Error::Input("the engine thread panicked".into())),
            }
        }
        Ok(())
    }

    /// Serves until Ctrl-C (or SIGTERM), then shuts down as
    /// [`shutdown`](Self::shutdown) does.
    pub fn wait_for_ctrl_c(mut self) -> Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Input(format!("cannot wait for signals: {e}")))?;
        rt.block_on(async {
            #[cfg(unix)]
            {
                use tokio::signal::unix::{SignalKind, signal};
                let mut term = signal(SignalKind::terminate())
                    .map_err(|e| Error::Input(format!("cannot wait for SIGTERM: {e}")))?;
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            #[cfg(not(unix))]
            {
                let _ = tokio::signal::ctrl_c().await;
            }
            Ok::<(), Error>(())
        })?;
        eprintln!("minikv serve: shutting down (open responses finish first)");
        self.stop_and_join()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}
