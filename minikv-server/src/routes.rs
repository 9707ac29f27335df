//! The HTTP handlers: parse and check a request, submit it to the engine,
//! and answer with one JSON body or a stream of server-sent events.

use crate::App;
use crate::api::{self, ChatRequest, CompletionRequest, PromptInput};
use crate::error::ApiError;
use crate::text::{Detokenizer, StopText};
use crate::worker::{Cmd, Out};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use minikv_engine::{Finish, Finished, Request, TokenLogprob};
use minikv_models::SamplingConfig;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

type Shared = State<Arc<App>>;

/// Which endpoint, with its logprob settings.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// `/v1/completions` (`logprobs`: alternatives per token).
    Completion { logprobs: Option<usize> },
    /// `/v1/chat/completions`.
    Chat { logprobs: bool, top: usize },
}

/// A checked request, ready for the engine.
struct Job {
    kind: Kind,
    req: Request,
    stops: Vec<String>,
    stream: bool,
    include_usage: bool,
    echo: Option<String>,
}

/// Cancels its request when dropped (the client left) unless the request
/// ended.
struct Guard {
    id: u64,
    cmd: std::sync::mpsc::Sender<Cmd>,
    armed: bool,
}

impl Guard {
    fn cancel(&mut self) {
        if self.armed {
            let _ = self.cmd.send(Cmd::Cancel(self.id));
            self.armed = false;
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// One token's log-probability entry, with texts.
struct Lp {
    text: String,
    logprob: f32,
    top: Vec<(String, f32)>,
    offset: usize,
}

/// Tokens to text pieces, stop strings, logprobs and counts.
struct Gen {
    detok: Detokenizer,
    stop: StopText,
    app: Arc<App>,
    tokens: usize,
    chars: usize,
    stopped: bool,
}

impl Gen {
    fn new(app: &Arc<App>, stops: Vec<String>, chars: usize) -> Self {
        Self {
            detok: Detokenizer::new(app.tok.clone()),
            stop: StopText::new(stops),
            app: app.clone(),
            tokens: 0,
            chars,
            stopped: false,
        }
    }

    /// The text a token releases and its logprob entry.
    fn token(
        &mut self,
        token: u32,
        lp: Option<TokenLogprob>,
    ) -> Result<(String, Option<Lp>), ApiError> {
        if self.stopped {
            return Ok((String::new(), None));
        }
        self.tokens += 1;
        let offset = self.chars;
        let delta = self
            .detok
            .push(token)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let r = self.stop.push(&delta);
        self.stopped = r.stopped;
        self.chars += r.text.chars().count();
        let tok = &self.app.tok;
        let lp = lp.map(|l| Lp {
            text: tok.token_text(token),
            logprob: l.logprob,
            top: l.top.iter().map(|&(t, p)| (tok.token_text(t), p)).collect(),
            offset,
        });
        Ok((r.text, lp))
    }

    /// What is held back, at the end.
    fn flush(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let tail = self.detok.flush().unwrap_or_default();
        let mut r = self.stop.push(&tail);
        if r.stopped {
            self.stopped = true;
        } else {
            r.text.push_str(&self.stop.flush());
        }
        self.chars += r.text.chars().count();
        r.text
    }

    fn finish_reason(&self, f: &Finished) -> Result<&'static str, ApiError> {
        if self.stopped {
            return Ok("stop");
        }
        match &f.finish {
            Finish::Stop | Finish::Cancelled => Ok("stop"),
            Finish::Length | Finish::Context => Ok("length"),
            Finish::Error(m) => Err(ApiError::internal(format!("the sequence failed: {m}"))),
        }
    }

    fn usage(&self, f: &Finished) -> Value {
        let ratio = if f.full_fp16_bytes > 0 {
            f.kv_bytes as f64 / f.full_fp16_bytes as f64
        } else {
            0.0
        };
        json!({
            "prompt_tokens": f.prompt_tokens,
            "completion_tokens": self.tokens,
            "total_tokens": f.prompt_tokens + self.tokens,
            "kv_bytes": f.kv_bytes,
            "kv_peak_bytes": f.peak_kv_bytes,
            "kv_fp16_bytes": f.full_fp16_bytes,
            "kv_ratio_to_fp16": ratio,
            "kv_reserved_bytes": f.reserved,
            "queue_seconds": f.queue_s,
            "time_to_first_token_seconds": f.ttft_s,
        })
    }
}

fn bytes_of(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

/// Logprobs as each endpoint writes them.
fn logprobs_json(kind: Kind, lps: &[Lp]) -> Value {
    match kind {
        Kind::Completion { .. } => json!({
            "tokens": lps.iter().map(|l| &l.text).collect::<Vec<_>>(),
            "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
            "top_logprobs": lps.iter().map(|l| {
                l.top.iter().map(|(t, p)| (t.clone(), json!(p))).collect::<serde_json::Map<_, _>>()
            }).collect::<Vec<_>>(),
            "text_offset": lps.iter().map(|l| l.offset).collect::<Vec<_>>(),
        }),
        Kind::Chat { .. } => json!({
            "content": lps.iter().map(|l| json!({
                "token": l.text,
                "logprob": l.logprob,
                "bytes": bytes_of(&l.text),
                "top_logprobs": l.top.iter().map(|(t, p)| json!({
                    "token": t, "logprob": p, "bytes": bytes_of(t),
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        }),
    }
}

fn wants_logprobs(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Completion { logprobs: Some(_) } | Kind::Chat { logprobs: true, .. }
    )
}

/// Reads a body up to the server's limit.
async fn read_body(app: &App, body: Body) -> Result<axum::body::Bytes, ApiError> {
    let limit = app.cfg.max_body_bytes;
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_big = std::error::Error::source(&e)
            .is_some_and(|s| s.to_string().contains("length limit"))
            || e.to_string().contains("length limit");
        if too_big {
            ApiError::invalid(format!("the request body is larger than {limit} bytes"))
                .with_status(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error")
        } else {
            ApiError::invalid(format!("could not read the request body: {e}"))
        }
    })
}

impl App {
    fn sampling(&self, k: &api::Knobs, id: u64) -> SamplingConfig {
        SamplingConfig {
            temperature: k.temperature,
            top_p: k.top_p,
            seed: k.seed.unwrap_or(self.cfg.seed.wrapping_add(id)),
        }
    }

    /// Checks the prompt against the context and picks `max_new`.
    fn max_new(&self, name: &str, prompt: usize, asked: Option<usize>) -> Result<usize, ApiError> {
        let ctx = self.ctx;
        let over = |want: usize| {
            ApiError::param(
                name,
                format!(
                    "This model's maximum context length is {ctx} tokens. However, you requested {} tokens ({prompt} in the prompt, {want} for the completion). Please reduce the prompt or the completion length.",
                    prompt + want
                ),
            )
            .with_code("context_length_exceeded")
        };
        if prompt >= ctx {
            return Err(ApiError::param(
                "prompt",
                format!("This model's maximum context length is {ctx} tokens, but the prompt has {prompt} tokens (at least one must be left to generate)."),
            )
            .with_code("context_length_exceeded"));
        }
        match asked {
            Some(m) if prompt.saturating_add(m) > ctx => Err(over(m)),
            Some(m) => Ok(m),
            None => Ok(self.cfg.default_max_tokens.min(ctx - prompt)),
        }
    }

    fn stop_ids(&self, ignore_eos: bool) -> Vec<u32> {
        if ignore_eos {
            Vec::new()
        } else {
            self.tok.stop.clone()
        }
    }
}

fn encode(app: &App, text: &str) -> Result<Vec<u32>, ApiError> {
    let ids = app
        .tok
        .encode(text)
        .map_err(|e| ApiError::param("prompt", e.to_string()))?;
    if ids.is_empty() {
        return Err(ApiError::param("prompt", "the prompt encodes to no tokens"));
    }
    Ok(ids)
}

fn completion_job(app: &App, r: CompletionRequest) -> Result<Job, ApiError> {
    let k = api::knobs(
        r.temperature,
        r.top_p,
        r.seed,
        r.stop,
        ("max_tokens", r.max_tokens),
        r.n,
        [
            ("presence_penalty", r.presence_penalty),
            ("frequency_penalty", r.frequency_penalty),
        ],
        &r.logit_bias,
    )?;
    if let Some(b) = r.best_of
        && b != 1
    {
        return Err(ApiError::param(
            "best_of",
            format!("best_of must be 1, got {b}"),
        ));
    }
    if r.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::param(
            "suffix",
            "suffix (insertion) is not supported",
        ));
    }
    let logprobs = match r.logprobs {
        None => None,
        Some(n @ 0..=5) => Some(n as usize),
        Some(n) => {
            return Err(ApiError::param(
                "logprobs",
                format!("logprobs must be in 0..=5, got {n}"),
            ));
        }
    };
    if r.echo && logprobs.is_some() {
        return Err(ApiError::param(
            "echo",
            "echo with logprobs (prompt log-probabilities) is not supported",
        ));
    }
    let (ids, text) = match api::prompt(r.prompt, app.vocab)? {
        PromptInput::Text(t) => (encode(app, &t)?, Some(t)),
        PromptInput::Ids(ids) => (ids, None),
    };
    let max_new = app.max_new("max_tokens", ids.len(), k.max_tokens)?;
    let echo = if r.echo {
        Some(match text {
            Some(t) => t,
            None => app
                .tok
                .decode(&ids)
                .map_err(|e| ApiError::param("prompt", e.to_string()))?,
        })
    } else {
        None
    };
    let id = app.next_id.fetch_add(1, Ordering::Relaxed);
    Ok(Job {
        kind: Kind::Completion { logprobs },
        req: Request {
            id,
            prompt: ids,
            max_new,
            sampling: app.sampling(&k, id),
            stop: app.stop_ids(r.ignore_eos),
            logprobs,
        },
        stops: k.stop,
        stream: r.stream,
        include_usage: r.stream_options.is_some_and(|o| o.include_usage),
        echo,
    })
}

fn chat_job(app: &App, r: ChatRequest) -> Result<Job, ApiError> {
    let (mt_name, mt) = match (r.max_completion_tokens, r.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    let k = api::knobs(
        r.temperature,
        r.top_p,
        r.seed,
        r.stop,
        (mt_name, mt),
        r.n,
        [
            ("presence_penalty", r.presence_penalty),
            ("frequency_penalty", r.frequency_penalty),
        ],
        &r.logit_bias,
    )?;
    if r.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::param("tools", "tool calling is not supported"));
    }
    if let Some(tc) = &r.tool_choice
        && tc != "none"
    {
        return Err(ApiError::param(
            "tool_choice",
            "tool calling is not supported",
        ));
    }
    if let Some(f) = &r.response_format
        && f.get("type").and_then(|t| t.as_str()) != Some("text")
    {
        return Err(ApiError::param(
            "response_format",
            "only {\"type\": \"text\"} is supported (no JSON mode or schemas)",
        ));
    }
    let top = match r.top_logprobs {
        None => 0,
        Some(n @ 0..=20) => n as usize,
        Some(n) => {
            return Err(ApiError::param(
                "top_logprobs",
                format!("top_logprobs must be in 0..=20, got {n}"),
            ));
        }
    };
    if r.top_logprobs.is_some() && !r.logprobs {
        return Err(ApiError::param(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
    let messages = api::messages(r.messages)?;
    let mut text = app
        .tok
        .render_chat(&messages)
        .map_err(|e| ApiError::param("messages", e.to_string()))?;
    // The template may write BOS itself; the tokenizer adds one too.
    if app.tok.add_bos
        && let Some(b) = app.tok.bos
    {
        let bos = app.tok.token_text(b);
        if !bos.is_empty()
            && let Some(rest) = text.strip_prefix(bos.as_str())
        {
            text = rest.to_owned();
        }
    }
    let ids = encode(app, &text)?;
    let max_new = app.max_new(mt_name, ids.len(), k.max_tokens)?;
    let id = app.next_id.fetch_add(1, Ordering::Relaxed);
    Ok(Job {
        kind: Kind::Chat {
            logprobs: r.logprobs,
            top,
        },
        req: Request {
            id,
            prompt: ids,
            max_new,
            sampling: app.sampling(&k, id),
            stop: app.stop_ids(r.ignore_eos),
            logprobs: r.logprobs.then_some(top),
        },
        stops: k.stop,
        stream: r.stream,
        include_usage: r.stream_options.is_some_and(|o| o.include_usage),
        echo: None,
    })
}

/// `POST /v1/completions`.
pub async fn completions(State(app): Shared, body: Body) -> Response {
    let job = async {
        let b = read_body(&app, body).await?;
        completion_job(&app, api::parse(&b)?)
    };
    match job.await {
        Ok(j) => run(app, j).await,
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/chat/completions`.
pub async fn chat(State(app): Shared, body: Body) -> Response {
    let job = async {
        let b = read_body(&app, body).await?;
        chat_job(&app, api::parse(&b)?)
    };
    match job.await {
        Ok(j) => run(app, j).await,
        Err(e) => e.into_response(),
    }
}

/// Submits; waits for the engine to take the request (or refuse it).
async fn submit(app: &Arc<App>, req: Request) -> Result<(UnboundedReceiver<Out>, Guard), ApiError> {
    let (tx, mut rx) = unbounded_channel();
    let id = req.id;
    let cmd = app.cmd.clone();
    cmd.send(Cmd::Submit { req, tx })
        .map_err(|_| ApiError::unavailable("the engine has stopped"))?;
    let guard = Guard {
        id,
        cmd,
        armed: true,
    };
    match rx.recv().await {
        Some(Out::Accepted) => Ok((rx, guard)),
        Some(Out::Rejected(e)) => {
            let mut g = guard;
            g.armed = false;
            Err(e.into())
        }
        _ => Err(ApiError::unavailable("the engine has stopped")),
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
}

impl Meta {
    fn new(app: &App, kind: Kind, id: u64) -> Self {
        let prefix = match kind {
            Kind::Completion { .. } => "cmpl",
            Kind::Chat { .. } => "chatcmpl",
        };
        Self {
            id: format!("{prefix}-{:x}-{id}", app.started),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: app.cfg.model_name.clone(),
            fingerprint: app.fingerprint.clone(),
        }
    }

    fn body(&self, kind: Kind, stream: bool, choices: Value) -> Value {
        let object = match (kind, stream) {
            (Kind::Completion { .. }, _) => "text_completion",
            (Kind::Chat { .. }, false) => "chat.completion",
            (Kind::Chat { .. }, true) => "chat.completion.chunk",
        };
        json!({
            "id": self.id, "object": object, "created": self.created,
            "model": self.model, "system_fingerprint": self.fingerprint,
            "choices": choices,
        })
    }
}

async fn run(app: Arc<App>, job: Job) -> Response {
    let meta = Meta::new(&app, job.kind, job.req.id);
    let (rx, guard) = match submit(&app, job.req.clone()).await {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    if job.stream {
        stream_response(app, job, meta, rx, guard)
    } else {
        match collect(app, &job, &meta, rx, guard).await {
            Ok(v) => axum::Json(v).into_response(),
            Err(e) => e.into_response(),
        }
    }
}

async fn collect(
    app: Arc<App>,
    job: &Job,
    meta: &Meta,
    mut rx: UnboundedReceiver<Out>,
    mut guard: Guard,
) -> Result<Value, ApiError> {
    let start = job.echo.as_ref().map_or(0, |e| e.chars().count());
    let mut g = Gen::new(&app, job.stops.clone(), start);
    let mut text = job.echo.clone().unwrap_or_default();
    let mut lps = Vec::new();
    let f = loop {
        match rx.recv().await {
            Some(Out::Token { token, logprob }) => {
                let (t, lp) = g.token(token, logprob)?;
                text.push_str(&t);
                lps.extend(lp);
                if g.stopped {
                    guard.cancel();
                }
            }
            Some(Out::Done(f)) => break f,
            Some(_) => {}
            None => return Err(ApiError::unavailable("the engine stopped mid-request")),
        }
    };
    guard.armed = false;
    text.push_str(&g.flush());
    let reason = g.finish_reason(&f)?;
    let lp = wants_logprobs(job.kind).then(|| logprobs_json(job.kind, &lps));
    let choice = match job.kind {
        Kind::Completion { .. } => json!({
            "index": 0, "text": text, "logprobs": lp, "finish_reason": reason,
        }),
        Kind::Chat { .. } => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": lp, "finish_reason": reason,
        }),
    };
    let mut body = meta.body(job.kind, false, json!([choice]));
    body["usage"] = g.usage(&f);
    Ok(body)
}

struct StreamState {
    rx: UnboundedReceiver<Out>,
    guard: Guard,
    text: Gen,
    kind: Kind,
    meta: Meta,
    include_usage: bool,
    queue: VecDeque<SseEvent>,
    done: bool,
}

impl StreamState {
    fn chunk(&mut self, delta: Option<String>, lps: Vec<Lp>, finish: Option<&str>) {
        let lp =
            (wants_logprobs(self.kind) && !lps.is_empty()).then(|| logprobs_json(self.kind, &lps));
        let choice = match self.kind {
            Kind::Completion { .. } => json!({
                "index": 0, "text": delta.unwrap_or_default(), "logprobs": lp, "finish_reason": finish,
            }),
            Kind::Chat { .. } => {
                let d = match delta {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!({"index": 0, "delta": d, "logprobs": lp, "finish_reason": finish})
            }
        };
        let body = self.meta.body(self.kind, true, json!([choice]));
        self.queue
            .push_back(SseEvent::default().data(body.to_string()));
    }

    /// Takes the next message from the engine and queues what it makes.
    async fn advance(&mut self) {
        match self.rx.recv().await {
            Some(Out::Token { token, logprob }) => match self.text.token(token, logprob) {
                Ok((t, lp)) => {
                    let stopped = self.text.stopped;
                    if !t.is_empty() || lp.is_some() {
                        self.chunk(Some(t), lp.into_iter().collect(), None);
                    }
                    if stopped {
                        self.guard.cancel();
                    }
                }
                Err(e) => self.fail(e),
            },
            Some(Out::Done(f)) => {
                self.guard.armed = false;
                let tail = self.text.flush();
                if !tail.is_empty() {
                    self.chunk(Some(tail), Vec::new(), None);
                }
                match self.text.finish_reason(&f) {
                    Ok(reason) => {
                        self.chunk(None, Vec::new(), Some(reason));
                        if self.include_usage {
                            let mut body = self.meta.body(self.kind, true, json!([]));
                            body["usage"] = self.text.usage(&f);
                            self.queue
                                .push_back(SseEvent::default().data(body.to_string()));
                        }
                        self.queue.push_back(SseEvent::default().data("[DONE]"));
                        self.done = true;
                    }
                    Err(e) => self.fail(e),
                }
            }
            Some(_) => {}
            None => self.fail(ApiError::unavailable("the engine stopped mid-request")),
        }
    }

    fn fail(&mut self, e: ApiError) {
        self.queue
            .push_back(SseEvent::default().data(e.body().to_string()));
        self.queue.push_back(SseEvent::default().data("[DONE]"));
        self.guard.cancel();
        self.done = true;
    }
}

fn stream_response(
    app: Arc<App>,
    job: Job,
    meta: Meta,
    rx: UnboundedReceiver<Out>,
    guard: Guard,
) -> Response {
    let start = job.echo.as_ref().map_or(0, |e| e.chars().count());
    let mut st = StreamState {
        rx,
        guard,
        text: Gen::new(&app, job.stops, start),
        kind: job.kind,
        meta,
        include_usage: job.include_usage,
        queue: VecDeque::new(),
        done: false,
    };
    match job.kind {
        Kind::Chat { .. } => {
            let body = st.meta.body(
                st.kind,
                true,
                json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
            );
            st.queue
                .push_back(SseEvent::default().data(body.to_string()));
        }
        Kind::Completion { .. } => {
            if let Some(e) = job.echo {
                st.chunk(Some(e), Vec::new(), None);
            }
        }
    }
    let events = stream::unfold(st, |mut st| async move {
        loop {
            if let Some(ev) = st.queue.pop_front() {
                return Some((Ok::<_, Infallible>(ev), st));
            }
            if st.done {
                return None;
            }
            st.advance().await;
        }
    });
    let mut resp = Sse::new(events)
        .keep_alive(KeepAlive::new().interval(app.cfg.keep_alive))
        .into_response();
    resp.headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

/// `GET /v1/models`.
pub async fn models(State(app): Shared) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": app.cfg.model_name,
            "object": "model",
            "created": app.started,
            "owned_by": "minikv",
            "max_model_len": app.ctx,
            "minikv": app.cfg.provenance,
        }],
    }))
    .into_response()
}

/// `GET /health`.
pub async fn health(State(app): Shared) -> Response {
    if app.engine_alive.load(Ordering::Relaxed) {
        axum::Json(json!({"status": "ok"})).into_response()
    } else {
        ApiError::unavailable("the engine has stopped").into_response()
    }
}

/// `GET /metrics`.
pub async fn metrics(State(app): Shared) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.encode(),
    )
        .into_response()
}

/// Unknown paths.
pub async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::invalid(format!("no route for {}", uri.path()))
        .with_status(StatusCode::NOT_FOUND, "not_found_error")
        .into_response()
}

/// Known paths, wrong method.
pub async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    ApiError::invalid(format!("{method} is not allowed on {}", uri.path()))
        .with_status(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error")
        .into_response()
}
