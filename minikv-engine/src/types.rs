//! What goes in and out of the engine: its settings, requests, events and
//! accounting.

use minikv_core::{Error, Result};
use minikv_models::SamplingConfig;
use serde::Serialize;

/// How the engine batches and admits.
#[derive(Debug, Clone, Serialize)]
pub struct EngineConfig {
    /// KV bytes the running sequences' caches may hold together (their
    /// projections are reserved against it).
    pub kv_budget: usize,
    /// Most sequences running at once.
    pub max_batch: usize,
    /// Sequences that feed a prompt chunk in one step.
    pub max_prefills: usize,
    /// Prompt tokens per chunk (at most
    /// [`PREFILL_CHUNK`](minikv_models::llama::PREFILL_CHUNK); with it, a
    /// sequence sees the chunks it sees alone, so its tokens are bitwise
    /// those of [`minikv_models::generate`]).
    pub prefill_chunk: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_budget: 1 << 30,
            max_batch: 256,
            max_prefills: 1,
            prefill_chunk: minikv_models::llama::PREFILL_CHUNK,
        }
    }
}

impl EngineConfig {
    /// Checks the numbers.
    pub fn validate(&self) -> Result<()> {
        let chunk = minikv_models::llama::PREFILL_CHUNK;
        if self.kv_budget == 0 {
            return Err(Error::config("kv_budget", "must be > 0 bytes"));
        }
        if self.max_batch == 0 || self.max_prefills == 0 {
            return Err(Error::config(
                "max_batch / max_prefills",
                "must be at least 1",
            ));
        }
        if self.prefill_chunk == 0 || self.prefill_chunk > chunk {
            return Err(Error::config(
                "prefill_chunk",
                format!("must be in 1..={chunk}, got {}", self.prefill_chunk),
            ));
        }
        Ok(())
    }
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct Request {
    /// Caller's id (unique among the engine's live requests).
    pub id: u64,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_new: usize,
    /// Sampling, with its own seed.
    pub sampling: SamplingConfig,
    /// Token ids that end the sequence (not included in the output).
    pub stop: Vec<u32>,
    /// Report each generated token's log-probability and this many most
    /// likely alternatives (`Some(0)`: the token's own only). Taken from the
    /// model's distribution (log-softmax of the logits, before temperature
    /// and nucleus truncation), as the OpenAI API reports them.
    pub logprobs: Option<usize>,
}

/// A generated token's log-probability under the model, with the most likely
/// alternatives (highest first, ties to the lower id).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    /// The token's log-probability.
    pub logprob: f32,
    /// The `k` most likely tokens and their log-probabilities.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// Log-softmax of `logits` at `token`, and the `k` most likely tokens.
    /// Computed in f64 (a sum over the vocabulary).
    pub fn from_logits(logits: &[f32], token: u32, k: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
        let lse = max as f64 + sum.ln();
        let lp = |i: usize| (logits[i] as f64 - lse) as f32;
        let k = k.min(logits.len());
        let mut top: Vec<(u32, f32)> = Vec::with_capacity(k);
        if k > 0 {
            // One pass keeping the k best (k is small: the API allows <= 20).
            let mut best: Vec<usize> = Vec::with_capacity(k + 1);
            let better =
                |a: usize, b: usize| logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
            for i in 0..logits.len() {
                if best.len() == k && !better(i, best[k - 1]) {
                    continue;
                }
                let pos = best.partition_point(|&b| better(b, i));
                best.insert(pos, i);
                best.truncate(k);
            }
            top.extend(best.into_iter().map(|i| (i as u32, lp(i))));
        }
        Self {
            logprob: lp(token as usize),
            top,
        }
    }
}

/// Why a sequence ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// A stop token was sampled.
    Stop,
    /// `max_new` tokens were generated.
    Length,
    /// The model's context is full.
    Context,
    /// [`Engine::cancel`](crate::Engine::cancel) was called.
    Cancelled,
    /// The step that ran it failed (the message says why).
    Error(String),
}

/// A finished sequence.
#[derive(Debug, Clone, Serialize)]
pub struct Finished {
    /// The request's id.
    pub id: u64,
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: Finish,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Seconds from submission to admission.
    pub queue_s: f64,
    /// Seconds from submission to the first generated token.
    pub ttft_s: Option<f64>,
    /// Seconds between consecutive generated tokens.
    pub itl_s: Vec<f64>,
    /// KV bytes its cache held at the end.
    pub kv_bytes: usize,
    /// The most KV bytes its cache held after any step.
    pub peak_kv_bytes: usize,
    /// Its projection ([`KvCache::projected_kv_bytes`](minikv_core::KvCache::projected_kv_bytes)).
    pub reserved: usize,
    /// Bytes a full fp16 cache would hold for its tokens.
    pub full_fp16_bytes: usize,
}

/// What a step produced.
#[derive(Debug, Clone, Serialize)]
pub enum Event {
    /// A sequence generated a token.
    Token {
        /// The request's id.
        id: u64,
        /// The token.
        token: u32,
        /// Its log-probability, when the request asked for it.
        logprob: Option<TokenLogprob>,
    },
    /// A sequence ended (its bytes are free again).
    Finished(Finished),
}

/// The engine's accounting, from the caches' own reports.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EngineStats {
    /// The budget.
    pub kv_budget: usize,
    /// Projections reserved by the running sequences.
    pub reserved: usize,
    /// Bytes the running caches hold now (`MemoryReport::kv_bytes`).
    pub kv_bytes: usize,
    /// The same plus prefill staging and work buffers (`total_bytes`).
    pub total_bytes: usize,
    /// Highest `kv_bytes` after any step.
    pub peak_kv_bytes: usize,
    /// Highest `total_bytes` after any step.
    pub peak_total_bytes: usize,
    /// Sequences running now, and the most at once.
    pub running: usize,
    /// Most sequences running at once.
    pub peak_running: usize,
    /// Most sequences decoding in one step.
    pub peak_decoding: usize,
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Steps run.
    pub steps: u64,
    /// Tokens generated.
    pub generated: u64,
    /// Prompt tokens run.
    pub prompt_tokens: u64,
    /// Seconds in steps that fed only decode tokens, and the tokens they made.
    pub decode_only_s: f64,
    /// Tokens generated in those steps.
    pub decode_only_tokens: u64,
    /// How many such steps ran.
    pub decode_only_steps: u64,
    /// Times a cache held more than its projection (a projection bug: it
    /// should stay 0; the tests check it). Its reservation then grows to
    /// what it holds.
    pub over_projection: u64,
}
