//! Generation and perplexity through any [`KvCache`].

use crate::sampling::{Sampler, SamplingConfig};
use crate::tokenizer::Tokenizer;
use crate::{LanguageModel, Logits, Workspace};
use minikv_core::{Error, KvCache, Phase, Result};
use serde::Serialize;
use std::time::Instant;

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// A stop token was sampled.
    StopToken,
    /// `max_tokens` reached.
    MaxTokens,
    /// The model's context is full.
    Context,
}

/// Result of [`generate`].
#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    /// Prompt ids.
    pub prompt_tokens: usize,
    /// Generated ids (stop token excluded).
    pub tokens: Vec<u32>,
    /// Generated text.
    pub text: String,
    /// Why it stopped.
    pub stop: StopReason,
    /// Prefill wall time (s), compression included.
    pub prefill_s: f64,
    /// Decode wall time (s).
    pub decode_s: f64,
}

/// Prefills `prompt`, compresses the cache, then samples up to `max_tokens`,
/// calling `on_text` with each new piece of text (streaming).
pub fn generate(
    model: &dyn LanguageModel,
    tok: &Tokenizer,
    cache: &mut dyn KvCache,
    prompt: &[u32],
    max_tokens: usize,
    sampling: SamplingConfig,
    mut on_text: impl FnMut(&str),
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(Error::Input("empty prompt".into()));
    }
    let max_ctx = model.spec().max_seq_len;
    if prompt.len() > max_ctx {
        return Err(Error::ContextOverflow {
            len: prompt.len(),
            max: max_ctx,
        });
    }
    let mut sampler = Sampler::new(sampling)?;
    let mut ws = Workspace::default();
    let t0 = Instant::now();
    let mut logits = model.forward(prompt, cache, &mut ws, Logits::Last)?;
    crate::finish_prefill(model, cache, prompt, &mut ws)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut out: Vec<u32> = Vec::new();
    let mut detok = crate::Detokenizer::default();
    let mut stop = StopReason::MaxTokens;
    while out.len() < max_tokens {
        let next = sampler.sample(&logits)?;
        if tok.stop.contains(&next) {
            stop = StopReason::StopToken;
            break;
        }
        out.push(next);
        let delta = detok.push(tok, next)?;
        if !delta.is_empty() {
            on_text(&delta);
        }
        if out.len() >= max_tokens {
            break;
        }
        if prompt.len() + out.len() >= max_ctx {
            stop = StopReason::Context;
            break;
        }
        logits = model.forward(&[next], cache, &mut ws, Logits::Last)?;
    }
    let tail = detok.flush(tok)?;
    if !tail.is_empty() {
        on_text(&tail);
    }
    let text = tok.decode(&out)?;
    Ok(Generation {
        prompt_tokens: prompt.len(),
        tokens: out,
        text,
        stop,
        prefill_s,
        decode_s: t1.elapsed().as_secs_f64(),
    })
}

/// Result of [`perplexity`].
#[derive(Debug, Clone, Serialize)]
pub struct Perplexity {
    /// Tokens evaluated (`N`; `N - 1` predictions).
    pub tokens: usize,
    /// Mean negative log-likelihood over all `N - 1` predictions (nats).
    pub nll: f64,
    /// `exp(nll)`.
    pub ppl: f64,
    /// Tokens prefilled before compression.
    pub prefill_tokens: usize,
    /// Mean NLL of the predictions made after compression (teacher-forced decode).
    pub decode_nll: Option<f64>,
    /// `exp(decode_nll)`.
    pub decode_ppl: Option<f64>,
}

/// `-log softmax(logits)[target]`, stable.
pub fn nll_of(logits: &[f32], target: u32) -> f64 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|&x| (x as f64 - m).exp()).sum();
    -(logits[target as usize] as f64 - m - z.ln())
}

/// Perplexity under llama.cpp's `llama-perplexity` protocol.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ChunkedPerplexity {
    /// Context per chunk.
    pub ctx: usize,
    /// Chunks evaluated (`floor(tokens / ctx)`, at most the requested number).
    pub chunks: usize,
    /// Predictions scored (`chunks * (ctx - 1 - ctx / 2)`).
    pub scored: usize,
    /// Mean negative log-likelihood of the scored predictions (nats).
    pub nll: f64,
    /// `exp(nll)`.
    pub ppl: f64,
    /// Perplexity of each chunk.
    pub per_chunk: Vec<f64>,
}

/// Perplexity as `llama-perplexity` measures it: `ids` (the whole text,
/// tokenized with BOS) is cut into chunks of `ctx` tokens; each chunk runs in
/// a fresh cache with its first token replaced by `bos` (when the model adds
/// one), and only the second half is scored: the logits at positions
/// `ctx/2 .. ctx-1` predicting the next token. The cache is never compressed
/// (a pure prefill).
pub fn perplexity_chunked(
    model: &dyn LanguageModel,
    mut new_cache: impl FnMut() -> Result<Box<dyn KvCache>>,
    ids: &[u32],
    ctx: usize,
    max_chunks: Option<usize>,
    bos: Option<u32>,
) -> Result<ChunkedPerplexity> {
    if ctx < 4 {
        return Err(Error::Input(format!(
            "chunk context must be >= 4, got {ctx}"
        )));
    }
    if ids.len() < 2 * ctx {
        return Err(Error::Input(format!(
            "the text has {} tokens: at least {} are needed for chunks of {ctx}",
            ids.len(),
            2 * ctx
        )));
    }
    let chunks = (ids.len() / ctx)
        .min(max_chunks.unwrap_or(usize::MAX))
        .max(1);
    let v = model.vocab_size();
    let first = ctx / 2;
    let mut ws = Workspace::default();
    let (mut total, mut scored) = (0.0, 0usize);
    let mut per_chunk = Vec::with_capacity(chunks);
    // Scored positions run in pieces so that logits stay small (large vocabularies).
    const PIECE: usize = 64;
    for c in 0..chunks {
        let mut chunk = ids[c * ctx..(c + 1) * ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        let mut cache = new_cache()?;
        model.forward(&chunk[..first], cache.as_mut(), &mut ws, Logits::None)?;
        let (mut sum, mut cnt) = (0.0, 0usize);
        let mut pos = first;
        while pos < ctx {
            let end = (pos + PIECE).min(ctx);
            let logits = model.forward(&chunk[pos..end], cache.as_mut(), &mut ws, Logits::All)?;
            for p in pos..end.min(ctx - 1) {
                sum += nll_of(&logits[(p - pos) * v..(p - pos + 1) * v], chunk[p + 1]);
                cnt += 1;
            }
            pos = end;
        }
        per_chunk.push((sum / cnt as f64).exp());
        total += sum;
        scored += cnt;
    }
    let nll = total / scored as f64;
    Ok(ChunkedPerplexity {
        ctx,
        chunks,
        scored,
        nll,
        ppl: nll.exp(),
        per_chunk,
    })
}

/// Perplexity of `ids`: the first `prefill` tokens are prefilled (exact
/// attention), the cache is compressed, and the rest are teacher-forced one
/// token per decode step through the compressed cache.
pub fn perplexity(
    model: &dyn LanguageModel,
    cache: &mut dyn KvCache,
    ids: &[u32],
    prefill: usize,
    mut progress: impl FnMut(usize),
) -> Result<Perplexity> {
    let n = ids.len();
    if n < 2 {
        return Err(Error::Input(format!(
            "perplexity needs at least 2 tokens, got {n}"
        )));
    }
    if prefill == 0 || prefill > n {
        return Err(Error::Input(format!(
            "prefill must be in 1..={n}, got {prefill}"
        )));
    }
    if cache.phase() != Phase::Prefill || cache.seq_len(0) != 0 {
        return Err(Error::Input("perplexity needs an empty cache".into()));
    }
    let v = model.vocab_size();
    let mut ws = Workspace::default();
    let logits = model.forward(&ids[..prefill], cache, &mut ws, Logits::All)?;
    let mut total = 0.0;
    for i in 0..prefill.min(n - 1) {
        total += nll_of(&logits[i * v..(i + 1) * v], ids[i + 1]);
    }
    crate::finish_prefill(model, cache, &ids[..prefill], &mut ws)?;
    let mut dec = 0.0;
    let mut ndec = 0usize;
    for i in prefill..n - 1 {
        let l = model.forward(&ids[i..i + 1], cache, &mut ws, Logits::Last)?;
        let x = nll_of(&l, ids[i + 1]);
        dec += x;
        total += x;
        ndec += 1;
        progress(i + 1);
    }
    let nll = total / (n - 1) as f64;
    let decode_nll = (ndec > 0).then(|| dec / ndec as f64);
    Ok(Perplexity {
        tokens: n,
        nll,
        ppl: nll.exp(),
        prefill_tokens: prefill,
        decode_nll,
        decode_ppl: decode_nll.map(f64::exp),
    })
}
