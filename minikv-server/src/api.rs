//! The OpenAI request bodies this server takes, and their checks. Unknown
//! fields are refused (as the OpenAI API does), naming the field; fields the
//! API has but this server cannot honour (`n` > 1, penalties, tools, ...)
//! are refused naming the field, never silently ignored.

use crate::error::ApiError;
use minikv_models::ChatMessage;
use serde::Deserialize;
use serde::de::DeserializeOwned;

/// `prompt`: a string, a list of one string, token ids, or a list of one list of ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Ids(Vec<i64>),
    /// Texts (one allowed).
    Texts(Vec<String>),
    /// Lists of token ids (one allowed).
    IdLists(Vec<Vec<i64>>),
}

/// `stop`: a string or up to 4 strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and empty `choices`).
    #[serde(default)]
    pub include_usage: bool,
}

// The two request types repeat their shared fields on purpose: serde's
// `deny_unknown_fields` does not work through `#[serde(flatten)]`, and
// refusing unknown fields by name is what the API (and this server) does.

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    /// Ignored beyond being a string (one model is served).
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// Most tokens to generate (default: the server's `--default-max-tokens`).
    pub max_tokens: Option<i64>,
    /// Sampling temperature in [0, 2] (default 1; 0: greedy).
    pub temperature: Option<f64>,
    /// Nucleus mass in [0, 1] (default 1; 0: greedy).
    pub top_p: Option<f64>,
    /// Seed (default: the server's seed plus the request's number).
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Log-probabilities of each token and this many alternatives (0..=5).
    pub logprobs: Option<i64>,
    /// Return the prompt before the completion.
    #[serde(default)]
    pub echo: bool,
    /// Must be 1.
    pub n: Option<i64>,
    /// Must be 1.
    pub best_of: Option<i64>,
    /// Must be 0.
    pub presence_penalty: Option<f64>,
    /// Must be 0.
    pub frequency_penalty: Option<f64>,
    /// Must be empty.
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    /// Must be absent.
    pub suffix: Option<String>,
    /// Ignored.
    pub user: Option<String>,
    /// Extension (also llama.cpp's and vLLM's): generate `max_tokens`
    /// tokens, ignoring the end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: bool,
}

/// A chat message's content: a string or a list of text parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Text.
    Text(String),
    /// Parts.
    Parts(Vec<Part>),
}

/// A content part (only text is served).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    /// Must be `text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    pub text: Option<String>,
}

/// A chat message in a request.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// `system`, `developer`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: Option<Content>,
    /// Ignored.
    pub name: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    /// Ignored beyond being a string (one model is served).
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<Message>,
    /// Most tokens to generate (deprecated name).
    pub max_tokens: Option<i64>,
    /// Most tokens to generate.
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature in [0, 2] (default 1; 0: greedy).
    pub temperature: Option<f64>,
    /// Nucleus mass in [0, 1] (default 1; 0: greedy).
    pub top_p: Option<f64>,
    /// Seed.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Log-probabilities of each token.
    #[serde(default)]
    pub logprobs: bool,
    /// Alternatives per token (0..=20, needs `logprobs`).
    pub top_logprobs: Option<i64>,
    /// Must be 1.
    pub n: Option<i64>,
    /// Must be 0.
    pub presence_penalty: Option<f64>,
    /// Must be 0.
    pub frequency_penalty: Option<f64>,
    /// Must be empty.
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    /// Only `{"type": "text"}`.
    pub response_format: Option<serde_json::Value>,
    /// Must be absent or empty (no tool calling).
    pub tools: Option<Vec<serde_json::Value>>,
    /// Must be absent or `none`.
    pub tool_choice: Option<serde_json::Value>,
    /// Ignored.
    pub user: Option<String>,
    /// Extension: ignore end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: bool,
}

/// Parses a JSON body, naming what is wrong (syntax, a field of the wrong
/// type, an unknown field, invalid UTF-8).
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if let Err(e) = std::str::from_utf8(body) {
        return Err(ApiError::invalid(format!(
            "the request body is not valid UTF-8 ({e})"
        )));
    }
    serde_json::from_slice(body).map_err(|e| {
        let msg = e.to_string();
        let param = msg
            .strip_prefix("unknown field `")
            .and_then(|r| r.split('`').next())
            .map(str::to_owned);
        let mut err = ApiError::invalid(format!("invalid request body: {msg}"));
        if let Some(p) = param {
            err.message = format!("Unrecognized request argument supplied: {p} ({msg})");
            err.param = Some(p);
        }
        err
    })
}

/// Sampling and stopping shared by both endpoints, checked.
#[derive(Debug, Clone)]
pub struct Knobs {
    /// Temperature (0: greedy).
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Seed, if given.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Requested maximum, if given.
    pub max_tokens: Option<usize>,
}

/// Checks the fields both endpoints share.
#[allow(clippy::too_many_arguments)]
pub fn knobs(
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<i64>,
    stop: Option<Stop>,
    max_tokens: (&str, Option<i64>),
    n: Option<i64>,
    penalties: [(&str, Option<f64>); 2],
    logit_bias: &Option<serde_json::Map<String, serde_json::Value>>,
) -> Result<Knobs, ApiError> {
    let t = temperature.unwrap_or(1.0);
    if !(t.is_finite() && (0.0..=2.0).contains(&t)) {
        return Err(ApiError::param(
            "temperature",
            format!("temperature must be a number in [0, 2], got {t}"),
        ));
    }
    let p = top_p.unwrap_or(1.0);
    if !(p.is_finite() && (0.0..=1.0).contains(&p)) {
        return Err(ApiError::param(
            "top_p",
            format!("top_p must be a number in [0, 1], got {p}"),
        ));
    }
    if let Some(n) = n
        && n != 1
    {
        return Err(ApiError::param(
            "n",
            format!("n must be 1 (one choice per request), got {n}"),
        ));
    }
    for (name, v) in penalties {
        if let Some(v) = v
            && v != 0.0
        {
            return Err(ApiError::param(
                name,
                format!("{name} is not supported (must be 0), got {v}"),
            ));
        }
    }
    if logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(ApiError::param("logit_bias", "logit_bias is not supported"));
    }
    let stop = match stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > 4 {
        return Err(ApiError::param(
            "stop",
            format!("at most 4 stop strings, got {}", stop.len()),
        ));
    }
    if stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::param("stop", "stop strings must not be empty"));
    }
    let (mt_name, mt) = max_tokens;
    let max_tokens = match mt {
        None => None,
        Some(m) if m >= 1 => Some(usize::try_from(m).unwrap_or(usize::MAX)),
        Some(m) => {
            return Err(ApiError::param(
                mt_name,
                format!("{mt_name} must be at least 1, got {m}"),
            ));
        }
    };
    // Below 1e-3 the sampler's 1/T overflows; such temperatures are greedy
    // in effect. top_p = 0 keeps only the most likely token: greedy too.
    let greedy = t < 1e-3 || p == 0.0;
    Ok(Knobs {
        temperature: if greedy { 0.0 } else { t as f32 },
        top_p: if greedy { 1.0 } else { p as f32 },
        seed: seed.map(|s| s as u64),
        stop,
        max_tokens,
    })
}

/// The prompt's token ids, or its text to encode.
pub enum PromptInput {
    /// Encode this.
    Text(String),
    /// These ids (checked against the vocabulary).
    Ids(Vec<u32>),
}

/// Checks `prompt` (one prompt per request).
pub fn prompt(p: Prompt, vocab: usize) -> Result<PromptInput, ApiError> {
    let ids = |v: Vec<i64>| -> Result<Vec<u32>, ApiError> {
        if v.is_empty() {
            return Err(ApiError::param("prompt", "the prompt is empty"));
        }
        v.into_iter()
            .map(|t| {
                u32::try_from(t)
                    .ok()
                    .filter(|&t| (t as usize) < vocab)
                    .ok_or_else(|| {
                        ApiError::param(
                            "prompt",
                            format!("token id {t} is outside the vocabulary (0..{vocab})"),
                        )
                    })
            })
            .collect()
    };
    let one = |n: usize| {
        ApiError::param(
            "prompt",
            format!("one prompt per request is served, got a list of {n}"),
        )
    };
    match p {
        Prompt::Text(s) => Ok(PromptInput::Text(s)),
        Prompt::Ids(v) => Ok(PromptInput::Ids(ids(v)?)),
        Prompt::Texts(mut v) if v.len() == 1 => Ok(PromptInput::Text(v.remove(0))),
        Prompt::Texts(v) => Err(one(v.len())),
        Prompt::IdLists(mut v) if v.len() == 1 => Ok(PromptInput::Ids(ids(v.remove(0))?)),
        Prompt::IdLists(v) => Err(one(v.len())),
    }
}

/// The conversation as the chat template takes it.
pub fn messages(ms: Vec<Message>) -> Result<Vec<ChatMessage>, ApiError> {
    if ms.is_empty() {
        return Err(ApiError::param("messages", "messages must not be empty"));
    }
    ms.into_iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "developer" => "system".to_owned(),
                "system" | "user" | "assistant" => m.role.clone(),
                r => {
                    return Err(ApiError::param(
                        &format!("messages[{i}].role"),
                        format!("unsupported role `{r}` (system, developer, user, assistant)"),
                    ));
                }
            };
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(s)) => s,
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        if p.kind != "text" {
                            return Err(ApiError::param(
                                &format!("messages[{i}].content"),
                                format!(
                                    "content parts of type `{}` are not supported (text only)",
                                    p.kind
                                ),
                            ));
                        }
                        s.push_str(p.text.as_deref().unwrap_or_default());
                    }
                    s
                }
            };
            Ok(ChatMessage { role, content })
        })
        .collect()
}
