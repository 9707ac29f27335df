//! From a checked request body to a [`Job`] for the engine: the prompt's
//! tokens (the chat template for chat), `max_new` against the context, the
//! sampler's settings and seed, stop strings and logprob settings.

use crate::App;
use crate::api::{self, ChatRequest, CompletionRequest, PromptInput};
use crate::error::ApiError;
use minikv_engine::Request;
use minikv_models::SamplingConfig;
use std::sync::atomic::Ordering;

/// Which endpoint, with its logprob settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    /// `/v1/completions` (`logprobs`: alternatives per token).
    Completion { logprobs: Option<usize> },
    /// `/v1/chat/completions`.
    Chat { logprobs: bool, top: usize },
}

/// A checked request, ready for the engine.
pub(crate) struct Job {
    pub(crate) kind: Kind,
    pub(crate) req: Request,
    pub(crate) stops: Vec<String>,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) echo: Option<String>,
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

pub(crate) fn completion_job(app: &App, r: CompletionRequest) -> Result<Job, ApiError> {
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

pub(crate) fn chat_job(app: &App, r: ChatRequest) -> Result<Job, ApiError> {
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
