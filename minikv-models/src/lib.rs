//! # minikv-models
//!
//! Llama-family models (SmolLM2-135M-Instruct by default) on CPU: a validating
//! memory-mapped GGUF reader (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K), a safetensors
//! loader for Hugging Face checkpoints, the byte-level BPE tokenizer built in
//! memory with the `tokenizers` crate, and the forward pass.
//!
//! Models depend on `minikv-core` alone: attention goes through
//! [`minikv_core::KvCache`], so every cache, policy, quantizer and backend works
//! with every model without a model change.
//!
//! ```no_run
//! use minikv_core::{CacheBuilder, CacheConfig};
//! use minikv_models::{LanguageModel, load, generate, SamplingConfig};
//!
//! let (model, tok) = load(std::path::Path::new("assets/SmolLM2-135M-Instruct.Q4_1.gguf"))?;
//! let mut cache = CacheBuilder::new(model.spec()).build(&CacheConfig::default())?;
//! let ids = tok.encode("The capital of France is")?;
//! let g = generate(model.as_ref(), &tok, cache.as_mut(), &ids, 8, SamplingConfig::default(), |s| print!("{s}"))?;
//! assert!(g.text.starts_with(" Paris"));
//! # Ok::<(), minikv_core::Error>(())
//! ```

#![warn(missing_docs)]

pub mod batch;
pub mod blocks;
#[cfg(x86_kernels)]
mod blocks_x86;
#[cfg(x86_kernels)]
mod blocks_x86_512;
pub mod chat;
#[cfg(x86_kernels)]
mod dequant_x86_512;
mod detok;
pub mod gemma3;
mod generate;
pub mod gguf;
mod kquant_q8;
#[cfg(x86_kernels)]
mod kquant_x86;
#[cfg(x86_kernels)]
mod kquant_x86_512;
#[cfg(x86_kernels)]
mod lanes_x86_512;
pub mod llama;
pub mod matrix;
pub mod q8;
mod q8_avx2;
pub use q8::Activations;
#[cfg(x86_kernels)]
mod q8_x86_512;
mod safetensors;
mod sampling;
mod tokenizer;

pub use batch::SeqStep;
pub use chat::{ChatMessage, ChatTemplate};
pub use detok::Detokenizer;
pub use gemma3::{Gemma3, Gemma3Config};
pub use generate::{
    ChunkedPerplexity, Generation, Perplexity, StopReason, generate, nll_of, perplexity,
    perplexity_chunked,
};
pub use llama::{Llama, LlamaConfig, RopeLayout};
pub use safetensors::{export_hf, load_hf};
pub use sampling::{Sampler, SamplingConfig, argmax};
pub use tokenizer::Tokenizer;

use minikv_core::{Error, KvCache, ModelSpec, Result};
use std::path::Path;

/// Which logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (prefill without prediction).
    None,
    /// The last position only (`[vocab]`).
    Last,
    /// Every position (`[n][vocab]`).
    All,
}

/// Reusable activation buffers (no allocation per token once warm).
#[derive(Debug, Default)]
pub struct Workspace {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    f: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// How the rows of a pass split into sequences.
    segs: matrix::Segments,
    /// The same for the rows whose logits were asked for.
    head_segs: matrix::Segments,
    /// Logits of a pass's wanted rows.
    logits: Vec<f32>,
}

/// A causal language model that attends only through a [`KvCache`].
pub trait LanguageModel: Send + Sync + std::fmt::Debug {
    /// The attention shape (what a cache needs).
    fn spec(&self) -> ModelSpec;
    /// Vocabulary size.
    fn vocab_size(&self) -> usize;
    /// Architecture, hyper-parameters and weight storage, for reports.
    fn describe(&self) -> serde_json::Value;
    /// The concrete model, for code that needs one architecture's parts
    /// (e.g. exporting Llama weights).
    fn as_any(&self) -> &dyn std::any::Any;
    /// The instruction tokens of a context-reconstruction pass, if the model
    /// has them (see [`finish_prefill`]).
    fn reconstruction_prompts(&self) -> Option<&ReconstructionPrompts> {
        None
    }
    /// Sets how every weight matrix's decode matvec treats its input (see
    /// [`q8`]); [`Activations::F32`], the default, is exact.
    fn set_activations(&mut self, act: Activations);
    /// Runs `tokens` at the cache's next positions; returns the requested
    /// logits (a batch of one: [`forward_batch`](LanguageModel::forward_batch)).
    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut dyn KvCache,
        ws: &mut Workspace,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let mut step = [SeqStep {
            tokens,
            cache,
            logits,
        }];
        Ok(self.forward_batch(&mut step, ws)?.pop().unwrap_or_default())
    }
    /// Runs several sequences in one step, each with its own cache (its own
    /// length and compression state): weight products once over all their
    /// rows, attention per sequence in parallel. Returns each sequence's
    /// requested logits, in order. Each result is bitwise equal to
    /// [`forward`](LanguageModel::forward) of that sequence alone (see
    /// [`batch`]). Every sequence is checked before any cache changes.
    fn forward_batch(&self, steps: &mut [SeqStep<'_>], ws: &mut Workspace)
    -> Result<Vec<Vec<f32>>>;
}

/// The checks every forward pass starts with: tokens present and inside the
/// vocabulary, a cache built for this model, room in the context.
pub(crate) fn check_forward(
    model: &dyn LanguageModel,
    tokens: &[u32],
    cache: &dyn KvCache,
) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::Input("forward: no tokens".into()));
    }
    let vocab = model.vocab_size();
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Input(format!(
            "token id {t} is outside the vocabulary of {vocab}"
        )));
    }
    let spec = model.spec();
    if cache.spec() != &spec {
        return Err(Error::shape(
            "cache spec vs model",
            format!("{spec:?}"),
            format!("{:?}", cache.spec()),
        ));
    }
    let pos0 = cache.seq_len(0);
    if pos0 + tokens.len() > spec.max_seq_len {
        return Err(Error::ContextOverflow {
            len: pos0 + tokens.len(),
            max: spec.max_seq_len,
        });
    }
    Ok(())
}

/// Loads a model: a `.gguf` file (`llama` or `gemma3` architecture), or a
/// directory with `config.json`, `*.safetensors` and `tokenizer.json` (Llama).
pub fn load(path: &Path) -> Result<(Box<dyn LanguageModel>, Tokenizer)> {
    // Every model-format error names the file it is about.
    let named = |e: Error| match e {
        Error::Format(m) if !m.contains(&*path.to_string_lossy()) => {
            Error::Format(format!("{}: {m}", path.display()))
        }
        e => e,
    };
    if path.is_dir() {
        let cfg = path.join("config.json");
        if !cfg.is_file() {
            return Err(Error::Format(format!(
                "{}: a model directory needs config.json, *.safetensors and tokenizer.json (config.json is missing); or pass a .gguf file",
                path.display()
            )));
        }
        let mut m = load_hf(path).map_err(named)?;
        let t = Tokenizer::from_file(&path.join("tokenizer.json")).map_err(named)?;
        m.reconstruction = Some(ReconstructionPrompts::new(&t)?);
        return Ok((Box::new(m), t));
    }
    let g = gguf::Gguf::open(path).map_err(named)?;
    let t = Tokenizer::from_gguf(&g).map_err(named)?;
    let prompts = Some(ReconstructionPrompts::new(&t)?);
    let arch = g.get_str("general.architecture").map_err(named)?;
    let all = architectures();
    let entry = all.iter().find(|a| a.name == arch).ok_or_else(|| {
        let names: Vec<_> = all.iter().map(|a| a.name).collect();
        named(Error::Format(format!(
            "unsupported architecture `{arch}` (supported: {})",
            names.join(", ")
        )))
    })?;
    let m = (entry.from_gguf)(&g, prompts).map_err(named)?;
    Ok((m, t))
}

/// A model architecture [`load`] reads from a GGUF file, found by the file's
/// `general.architecture`. Each registers itself next to its definition with
/// [`register_architecture!`]; nothing matches on architecture names
/// elsewhere, so a new architecture is one file plus its registration line.
pub struct Architecture {
    /// The GGUF `general.architecture` value.
    pub name: &'static str,
    /// Builds the model from the file; the reconstruction prompts (KVzip)
    /// come from the file's tokenizer.
    pub from_gguf: FromGguf,
}

/// How a registered architecture builds its model from a GGUF file.
pub type FromGguf =
    fn(&gguf::Gguf, Option<ReconstructionPrompts>) -> Result<Box<dyn LanguageModel>>;

minikv_core::__inventory::collect!(Architecture);

/// Registers an [`Architecture`] (see `llama.rs` and `gemma3.rs`).
#[macro_export]
macro_rules! register_architecture {
    ($name:literal, $from_gguf:expr) => {
        minikv_core::__inventory::submit! {
            $crate::Architecture { name: $name, from_gguf: $from_gguf }
        }
    };
}

/// Every registered architecture, sorted by name.
pub fn architectures() -> Vec<&'static Architecture> {
    let mut v: Vec<_> = minikv_core::__inventory::iter::<Architecture>
        .into_iter()
        .collect();
    v.sort_by_key(|a| a.name);
    v
}

/// KVzip's context-reconstruction instructions, tokenized (kvpress's
/// wording; no chat template: the suffix is a newline).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconstructionPrompts {
    /// "\n\nRepeat the previous context exactly."
    pub first: Vec<u32>,
    /// "\n\nRepeat the part of the previous context exactly, starting with"
    /// (followed by the previous chunk's last 8 tokens).
    pub next: Vec<u32>,
    /// Between the instruction and the repeated text: "\n".
    pub suffix: Vec<u32>,
}

impl ReconstructionPrompts {
    /// Tokenizes the instructions.
    pub fn new(tok: &Tokenizer) -> Result<Self> {
        Ok(Self {
            first: tok.encode("\n\nRepeat the previous context exactly.")?,
            next: tok
                .encode("\n\nRepeat the part of the previous context exactly, starting with")?,
            suffix: tok.encode("\n")?,
        })
    }
}

/// Context chunk length of a reconstruction pass (kvpress: 2048).
pub const RECONSTRUCTION_CHUNK: usize = 2048;

/// Ends the prefill of `context` (the tokens just run through `cache`): when
/// the cache asks for context reconstruction (KVzip), runs one pass per chunk
/// of at most [`RECONSTRUCTION_CHUNK`] tokens (instruction, the previous
/// chunk's last 8 tokens for later chunks, a newline, the chunk itself) and
/// removes the pass tokens; when it asks for a plain pass (KVCompose), runs
/// the context once more as it is, in one pass; then compresses. Every driver calls this instead
/// of [`KvCache::end_prefill`] directly.
pub fn finish_prefill(
    model: &dyn LanguageModel,
    cache: &mut dyn KvCache,
    context: &[u32],
    ws: &mut Workspace,
) -> Result<()> {
    let wants = cache.wants(0);
    if wants.reconstruction && wants.plain_pass && !context.is_empty() {
        // KVCompose: the context once more, as it is, in one pass.
        if cache.seq_len(0) != context.len() {
            return Err(Error::Input(format!(
                "finish_prefill: the cache holds {} tokens, the context {}",
                cache.seq_len(0),
                context.len()
            )));
        }
        cache.begin_pass(0..context.len())?;
        let r = model.forward(context, cache, ws, Logits::None);
        cache.end_pass()?;
        r?;
    } else if wants.reconstruction && !context.is_empty() {
        let p = model.reconstruction_prompts().ok_or_else(|| {
            Error::Unsupported(
                "this cache scores by context reconstruction (KVzip), but the model has no reconstruction prompt".into(),
            )
        })?;
        if cache.seq_len(0) != context.len() {
            return Err(Error::Input(format!(
                "finish_prefill: the cache holds {} tokens, the context {}",
                cache.seq_len(0),
                context.len()
            )));
        }
        for (i, chunk) in context.chunks(RECONSTRUCTION_CHUNK).enumerate() {
            let start = i * RECONSTRUCTION_CHUNK;
            let mut ids = if i == 0 {
                p.first.clone()
            } else {
                p.next.clone()
            };
            if i > 0 {
                ids.extend_from_slice(&context[start.saturating_sub(8)..start]);
            }
            ids.extend_from_slice(&p.suffix);
            ids.extend_from_slice(chunk);
            cache.begin_pass(start..start + chunk.len())?;
            let r = model.forward(&ids, cache, ws, Logits::None);
            cache.end_pass()?;
            r?;
        }
    }
    cache.end_prefill()
}

/// Checks a model's sizes before any tensor is read: every one of `dims`
/// and of the attention layout `(heads, KV heads, head dim)` in
/// `1..=2^24`, the heads a whole number of groups per KV head, and the
/// head dimension even (RoPE rotates pairs).
pub(crate) fn check_shape(
    dims: &[(&str, usize)],
    (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
) -> Result<()> {
    let layout = [
        ("n_heads", n_heads),
        ("n_kv_heads", n_kv_heads),
        ("head_dim", head_dim),
    ];
    for &(k, v) in dims.iter().chain(&layout) {
        if v == 0 || v > 1 << 24 {
            return Err(Error::Format(format!(
                "model config `{k}` = {v} is out of range"
            )));
        }
    }
    if !n_heads.is_multiple_of(n_kv_heads) || !head_dim.is_multiple_of(2) {
        return Err(Error::Format(format!(
            "model config: {n_heads} heads / {n_kv_heads} KV heads / head dim {head_dim} is not a valid GQA layout"
        )));
    }
    Ok(())
}
