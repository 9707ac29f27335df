//! The HTTP handlers: parse and check a request, submit it to the engine,
//! and answer with one JSON body or a stream of server-sent events.

use crate::App;
use crate::api;
use crate::error::ApiError;
use crate::job::{Job, Kind, chat_job, completion_job};
use crate::text::StopText;
use crate::worker::{Cmd, Out};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use minikv_engine::{Finish, Finished, Request, TokenLogprob};
use minikv_models::Detokenizer;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

type Shared = State<Arc<App>>;

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
            detok: Detokenizer::default(),
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
            .push(&self.app.tok, token)
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
        let tail = self.detok.flush(&self.app.tok).unwrap_or_default();
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

/// `POST /v1/completions`.
pub async fn completions(State(app): Shared, body: Body) -> Response {
    handle(app, body, completion_job).await
}

/// `POST /v1/chat/completions`.
pub async fn chat(State(app): Shared, body: Body) -> Response {
    handle(app, body, chat_job).await
}

/// Reads and parses the body, checks it into a job, and runs it.
async fn handle<T: serde::de::DeserializeOwned>(
    app: Arc<App>,
    body: Body,
    to_job: fn(&App, T) -> Result<Job, ApiError>,
) -> Response {
    let job = async {
        let b = read_body(&app, body).await?;
        to_job(&app, api::parse(&b)?)
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
