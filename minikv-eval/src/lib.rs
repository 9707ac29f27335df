//! # minikv-eval
//!
//! Evaluation tasks: compare a compressed cache with the full cache on the same
//! model and tokens (fidelity KL, perplexity-style agreement, retrieval tasks
//! with Wilson intervals, per-layer attention error). Every task is seeded;
//! nothing is downloaded.
//!
//! This is harness code, not model code: it builds pairs of caches and wraps
//! them in [`minikv_core::AttentionProbe`], so it lives in its own crate and
//! `minikv-models` stays a crate that names only the cache traits.
//!
//! ```
//! use minikv_eval::{kl_divergence, token_f1, wilson95};
//! assert_eq!(kl_divergence(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]), 0.0);
//! assert_eq!(token_f1(&[1, 2, 3], &[1, 2, 3]), 1.0);
//! let (lo, hi) = wilson95(8, 10);
//! assert!((lo - 0.4902).abs() < 1e-4 && (hi - 0.9433).abs() < 1e-4);
//! ```

#![warn(missing_docs)]

pub mod duo;
pub mod lukv;
pub mod qa;
pub mod qfilters;
pub mod ruler;
pub mod stats;
pub mod tasks;

#[doc(hidden)]
pub use inventory as __inventory;

use minikv_core::{Error, KvCache, Result};
use minikv_models::{LanguageModel, Logits, Tokenizer, Workspace, argmax, nll_of};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::Serialize;

/// Next-token agreement of a compressed cache with the full cache.
#[derive(Debug, Clone, Serialize)]
pub struct Fidelity {
    /// Predictions compared (made after compression).
    pub predictions: usize,
    /// Mean KL(full || compressed) of the next-token distributions (nats).
    pub kl: f64,
    /// Fraction of positions where the argmax agrees.
    pub top1: f64,
    /// Mean NLL of the true next tokens, full cache.
    pub nll_full: f64,
    /// Mean NLL of the true next tokens, compressed cache.
    pub nll_compressed: f64,
    /// KL(full || compressed) at each prediction, in order (the curve whose
    /// mean is `kl`).
    pub kl_per_step: Vec<f64>,
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|&v| v as f64 - z).collect()
}

/// `KL(p || q)` from logits.
pub fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p_logits), log_softmax(q_logits));
    lp.iter()
        .zip(&lq)
        .map(|(a, b)| a.exp() * (a - b))
        .sum::<f64>()
        .max(0.0)
}

/// Prefills `ids[..context]` into both caches, compresses them, then
/// teacher-forces the rest one token per step and compares the predictions.
pub fn fidelity(
    model: &dyn LanguageModel,
    full: &mut dyn KvCache,
    comp: &mut dyn KvCache,
    ids: &[u32],
    context: usize,
) -> Result<Fidelity> {
    let reference = reference_logits(model, full, ids, context)?;
    fidelity_against(model, comp, ids, context, &reference)
}

/// The full cache's next-token logits at every compared position of
/// [`fidelity`]: after the context, then after each teacher-forced token
/// (`ids.len() - context` rows). Compute once, compare many caches.
pub fn reference_logits(
    model: &dyn LanguageModel,
    full: &mut dyn KvCache,
    ids: &[u32],
    context: usize,
) -> Result<Vec<Vec<f32>>> {
    check_context(ids, context)?;
    let mut w = Workspace::default();
    let mut rows = Vec::with_capacity(ids.len() - context);
    rows.push(model.forward(&ids[..context], full, &mut w, Logits::Last)?);
    minikv_models::finish_prefill(model, full, &ids[..context], &mut w)?;
    for i in context..ids.len() - 1 {
        rows.push(model.forward(&ids[i..i + 1], full, &mut w, Logits::Last)?);
    }
    Ok(rows)
}

fn check_context(ids: &[u32], context: usize) -> Result<()> {
    if context == 0 || context >= ids.len() {
        return Err(Error::Input(format!(
            "the context ({context} tokens) must be shorter than the tokens given ({}): at least one token must follow it",
            ids.len()
        )));
    }
    Ok(())
}

/// [`fidelity`] of `comp` against precomputed [`reference_logits`] of the same
/// `ids` and `context`.
pub fn fidelity_against(
    model: &dyn LanguageModel,
    comp: &mut dyn KvCache,
    ids: &[u32],
    context: usize,
    reference: &[Vec<f32>],
) -> Result<Fidelity> {
    check_context(ids, context)?;
    let n = ids.len() - context;
    if reference.len() != n {
        return Err(Error::Input(format!(
            "fidelity: {} reference rows for {n} positions",
            reference.len()
        )));
    }
    let mut wc = Workspace::default();
    let mut lc = model.forward(&ids[..context], comp, &mut wc, Logits::Last)?;
    minikv_models::finish_prefill(model, comp, &ids[..context], &mut wc)?;
    let (mut kl, mut agree, mut nf, mut nc) = (0.0, 0usize, 0.0, 0.0);
    let mut steps = Vec::with_capacity(n);
    for (j, i) in (context..ids.len()).enumerate() {
        let lf = &reference[j];
        let step = kl_divergence(lf, &lc);
        steps.push(step);
        kl += step;
        agree += usize::from(argmax(lf) == argmax(&lc));
        nf += nll_of(lf, ids[i]);
        nc += nll_of(&lc, ids[i]);
        if i + 1 < ids.len() {
            lc = model.forward(&ids[i..i + 1], comp, &mut wc, Logits::Last)?;
        }
    }
    let k = n as f64;
    Ok(Fidelity {
        predictions: n,
        kl: kl / k,
        top1: agree as f64 / k,
        nll_full: nf / k,
        nll_compressed: nc / k,
        kl_per_step: steps,
    })
}

/// Per-layer attention-output error of a compressed cache (see
/// [`minikv_core::AttentionProbe`]).
#[derive(Debug, Clone, Serialize)]
pub struct AttentionError {
    /// Decode steps compared.
    pub steps: usize,
    /// Mean over layers of the relative L2 error.
    pub rel_error: f64,
    /// Mean over layers of the per-head cosine similarity.
    pub cosine: f64,
    /// Per layer: relative L2 error `|o_c - o_full| / |o_full|` over all
    /// decode-time query heads.
    pub per_layer: Vec<f64>,
    /// Per layer: mean cosine similarity per query head.
    pub per_layer_cosine: Vec<f64>,
}

/// Prefills `ids[..context]` through the full cache with `comp` shadowing it,
/// compresses, then teacher-forces the rest; every layer's decode attention is
/// computed on both caches with the full model's queries, so the per-layer
/// error is that layer's own (no propagation from earlier layers).
pub fn attention_error(
    model: &dyn LanguageModel,
    full: Box<dyn KvCache>,
    comp: Box<dyn KvCache>,
    ids: &[u32],
    context: usize,
) -> Result<(
    AttentionError,
    minikv_core::MemoryReport,
    minikv_core::Diagnostics,
)> {
    check_context(ids, context)?;
    let mut probe = minikv_core::AttentionProbe::new(full, comp)?;
    let mut w = Workspace::default();
    model.forward(&ids[..context], &mut probe, &mut w, Logits::None)?;
    minikv_models::finish_prefill(model, &mut probe, &ids[..context], &mut w)?;
    for i in context..ids.len() {
        model.forward(&ids[i..i + 1], &mut probe, &mut w, Logits::None)?;
    }
    let per_layer = probe.relative_errors();
    let per_layer_cosine = probe.cosines();
    let l = per_layer.len().max(1) as f64;
    Ok((
        AttentionError {
            steps: ids.len() - context,
            rel_error: per_layer.iter().sum::<f64>() / l,
            cosine: per_layer_cosine.iter().sum::<f64>() / l,
            per_layer,
            per_layer_cosine,
        },
        probe.shadow().memory(),
        probe.diagnostics(),
    ))
}

/// Wilson score interval (95%) for `k` successes in `n` trials.
pub fn wilson95(k: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (z, nf) = (1.959_963_984_540_054, n as f64);
    let p = k as f64 / nf;
    let den = 1.0 + z * z / nf;
    let c = (p + z * z / (2.0 * nf)) / den;
    let h = z * ((p * (1.0 - p) + z * z / (4.0 * nf)) / nf).sqrt() / den;
    ((c - h).max(0.0), (c + h).min(1.0))
}

/// Retrieval tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Retrieval {
    /// A random 5-digit pass key hidden in essay text.
    Passkey,
    /// The classic needle sentence ("the best thing to do in San Francisco ...").
    Needle,
    /// Synthetic `key: value` lines; one key is asked for.
    KvRetrieval,
}

impl Retrieval {
    fn answer_tokens(self) -> usize {
        match self {
            Self::Passkey => 8,
            Self::Needle => 16,
            Self::KvRetrieval => 10,
        }
    }
}

fn hex(rng: &mut StdRng, n: usize) -> String {
    (0..n)
        .map(|_| char::from_digit(rng.random_range(0..16u32), 16).expect("digit"))
        .collect()
}

/// One trial's prompt of exactly `context` tokens and the answer that must
/// appear in the greedy continuation. Essay filler comes from `haystack` at a
/// seeded offset; the fact sits at relative `depth`.
pub fn retrieval_prompt(
    kind: Retrieval,
    tok: &Tokenizer,
    haystack: &[u32],
    context: usize,
    depth: f64,
    rng: &mut StdRng,
) -> Result<(Vec<u32>, String)> {
    let mut intro = Vec::new();
    let (fact, question, answer, filler_src): (Vec<u32>, Vec<u32>, String, Vec<u32>) = match kind {
        Retrieval::Passkey => {
            // The standard passkey format (used by the Landmark Attention and
            // LongLoRA evaluations): an instruction, essay filler, the fact
            // after a sentence end, and the question at the end.
            intro = tok.encode(PASSKEY_INSTRUCTION)?;
            let key = format!("{}", rng.random_range(10000..100000u32));
            (
                tok.encode(&format!(" The pass key is {key}. Remember it. {key} is the pass key."))?,
                tok.encode("\nWhat is the pass key? The pass key is")?,
                key,
                Vec::new(),
            )
        }
        Retrieval::Needle => (
            tok.encode(" The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day. ")?,
            tok.encode("\n\nWhat is the best thing to do in San Francisco? The best thing to do in San Francisco is")?,
            "sandwich".into(),
            Vec::new(),
        ),
        Retrieval::KvRetrieval => {
            // Lines `k-xxxxxx: v-yyyyyy` fill the context; the asked key is at `depth`.
            let (k, v) = (hex(rng, 6), hex(rng, 6));
            let mut filler = Vec::new();
            while filler.len() < context {
                filler.extend(tok.encode(&format!("k-{}: v-{}\n", hex(rng, 6), hex(rng, 6)))?);
            }
            (tok.encode(&format!("k-{k}: v-{v}\n"))?, tok.encode(&format!("\nk-{k}:"))?, format!("v-{v}"), filler)
        }
    };
    let filler = context
        .checked_sub(intro.len() + fact.len() + question.len())
        .filter(|&f| f > 0)
        .ok_or_else(|| {
            Error::Input(format!(
                "context {context} is too short for the {kind:?} fact and question"
            ))
        })?;
    // Whether token `i` of `b` ends a sentence.
    let ends_sentence = |b: &[u32], i: usize| -> Result<bool> {
        let t = tok.decode(&b[i..i + 1])?;
        Ok(t.trim_end().ends_with(['.', '!', '?']))
    };
    let body: Vec<u32> = if kind == Retrieval::KvRetrieval {
        filler_src[..filler].to_vec()
    } else {
        if haystack.len() < filler + 1 {
            return Err(Error::Input(format!(
                "the haystack has {} tokens, fewer than the {filler} needed",
                haystack.len()
            )));
        }
        let mut start = rng.random_range(0..=haystack.len() - filler);
        if kind == Retrieval::Passkey {
            // Begin at a sentence start when one is near.
            let mut s = start;
            while s > 0 && start - s < 64 && !ends_sentence(haystack, s - 1)? {
                s -= 1;
            }
            if s == 0 || ends_sentence(haystack, s - 1)? {
                start = s;
            }
        }
        haystack[start..start + filler].to_vec()
    };
    let mut at = ((filler as f64) * depth.clamp(0.0, 1.0)) as usize;
    if kind == Retrieval::KvRetrieval {
        // Insert at a line boundary so the fact stays one line.
        let nl = tok.encode("\n")?;
        while at > 0 && !nl.contains(&body[at - 1]) {
            at -= 1;
        }
    } else if kind == Retrieval::Passkey {
        // Insert after a sentence end (the nearest one before `at`, else after).
        let mut j = at;
        while j > 0 && !ends_sentence(&body, j - 1)? {
            j -= 1;
        }
        if j == 0 && at > 0 {
            j = at;
            while j < body.len() && !ends_sentence(&body, j - 1)? {
                j += 1;
            }
        }
        at = j.min(body.len());
    }
    let mut ids = Vec::with_capacity(context);
    ids.extend_from_slice(&intro);
    ids.extend_from_slice(&body[..at]);
    ids.extend_from_slice(&fact);
    ids.extend_from_slice(&body[at..]);
    ids.extend_from_slice(&question);
    Ok((ids, answer))
}

/// The instruction that opens a passkey prompt.
pub const PASSKEY_INSTRUCTION: &str = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about the important information there.\n";

/// One passkey trial's prompt (see [`retrieval_prompt`]).
pub fn passkey_prompt(
    tok: &Tokenizer,
    haystack: &[u32],
    context: usize,
    depth: f64,
    rng: &mut StdRng,
) -> Result<(Vec<u32>, String)> {
    retrieval_prompt(Retrieval::Passkey, tok, haystack, context, depth, rng)
}

/// What a retrieval run tests.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PasskeySpec {
    /// Prompt length in tokens.
    pub context: usize,
    /// Fact depth in [0, 1]; `None` = uniform per trial.
    pub depth: Option<f64>,
    /// Number of trials.
    pub trials: usize,
    /// Seed of keys, offsets and depths.
    pub seed: u64,
}

/// Result of [`retrieval`].
#[derive(Debug, Clone, Serialize)]
pub struct Passkey {
    /// Trials run.
    pub trials: usize,
    /// Trials whose greedy answer contains the expected answer.
    pub correct: usize,
    /// `correct / trials`.
    pub accuracy: f64,
    /// Wilson 95% interval.
    pub ci95: (f64, f64),
    /// Per trial, in order: whether the answer was retrieved (for paired
    /// comparisons: every config sees the same trials for a seed).
    pub outcomes: Vec<bool>,
    /// Per trial: the depth of the fact in the context.
    pub depths: Vec<f64>,
    /// KV bytes allocated after the last trial.
    pub kv_bytes: usize,
    /// Full fp16 bytes for the same tokens.
    pub full_fp16_bytes: usize,
}

/// Passkey retrieval (see [`retrieval`]).
pub fn passkey(
    model: &dyn LanguageModel,
    tok: &Tokenizer,
    haystack: &[u32],
    spec: PasskeySpec,
    new_cache: impl FnMut() -> Result<Box<dyn KvCache>>,
) -> Result<Passkey> {
    retrieval(Retrieval::Passkey, model, tok, haystack, spec, new_cache)
}

/// Retrieval accuracy: `trials` seeded prompts, greedy answer through a fresh
/// cache from `new_cache` per trial, Wilson 95% interval.
pub fn retrieval(
    kind: Retrieval,
    model: &dyn LanguageModel,
    tok: &Tokenizer,
    haystack: &[u32],
    spec: PasskeySpec,
    mut new_cache: impl FnMut() -> Result<Box<dyn KvCache>>,
) -> Result<Passkey> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let (mut correct, mut kv_bytes, mut full_fp16_bytes) = (0, 0, 0);
    let (mut outcomes, mut depths) = (Vec::new(), Vec::new());
    for _ in 0..spec.trials {
        let d = spec.depth.unwrap_or_else(|| rng.random::<f64>());
        let (ids, answer) = retrieval_prompt(kind, tok, haystack, spec.context, d, &mut rng)?;
        let mut cache = new_cache()?;
        let g = minikv_models::generate(
            model,
            tok,
            cache.as_mut(),
            &ids,
            kind.answer_tokens(),
            minikv_models::SamplingConfig::default(),
            |_| {},
        )?;
        let ok = g.text.contains(&answer);
        correct += usize::from(ok);
        outcomes.push(ok);
        depths.push(d);
        let m = cache.memory();
        (kv_bytes, full_fp16_bytes) = (m.used_bytes(), m.full_fp16_bytes);
    }
    let trials = spec.trials;
    Ok(Passkey {
        trials,
        correct,
        accuracy: correct as f64 / trials.max(1) as f64,
        ci95: wilson95(correct, trials),
        outcomes,
        depths,
        kv_bytes,
        full_fp16_bytes,
    })
}

/// Greedy-generation agreement with the full cache.
#[derive(Debug, Clone, Serialize)]
pub struct Agreement {
    /// Tokens generated by the full cache.
    pub reference_tokens: usize,
    /// Length of the common prefix.
    pub prefix_match: usize,
    /// Token-level F1 (bag of tokens) between the two generations.
    pub token_f1: f64,
}

/// Bag-of-tokens F1 of two sequences (token ids, or words).
pub fn token_f1<T: Eq + std::hash::Hash>(a: &[T], b: &[T]) -> f64 {
    if a.is_empty() && b.is_empty() {
        return 1.0;
    }
    let mut counts = std::collections::HashMap::<&T, i64>::new();
    for t in a {
        *counts.entry(t).or_default() += 1;
    }
    let mut common = 0;
    for t in b {
        if let Some(c) = counts.get_mut(t).filter(|c| **c > 0) {
            *c -= 1;
            common += 1;
        }
    }
    if common == 0 {
        return 0.0;
    }
    let (p, r) = (
        common as f64 / b.len() as f64,
        common as f64 / a.len() as f64,
    );
    2.0 * p * r / (p + r)
}

/// Greedy generation of `max_tokens` with both caches; prefix match and F1.
pub fn generation_agreement(
    model: &dyn LanguageModel,
    tok: &Tokenizer,
    full: &mut dyn KvCache,
    comp: &mut dyn KvCache,
    prompt: &[u32],
    max_tokens: usize,
) -> Result<Agreement> {
    let s = minikv_models::SamplingConfig::default();
    let a = minikv_models::generate(model, tok, full, prompt, max_tokens, s, |_| {})?.tokens;
    let b = minikv_models::generate(model, tok, comp, prompt, max_tokens, s, |_| {})?.tokens;
    let prefix_match = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    Ok(Agreement {
        reference_tokens: a.len(),
        prefix_match,
        token_f1: token_f1(&a, &b),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Wilson intervals from the closed form (e.g. Newcombe 1998, table values).
    #[test]
    fn wilson_known_values() {
        for (k, n, lo, hi) in [
            (5, 10, 0.2366, 0.7634),
            (0, 10, 0.0, 0.2775),
            (10, 10, 0.7225, 1.0),
            (81, 263, 0.2553, 0.3662),
        ] {
            let (a, b) = wilson95(k, n);
            assert!(
                (a - lo).abs() < 1e-4 && (b - hi).abs() < 1e-4,
                "{k}/{n}: ({a}, {b})"
            );
        }
    }

    #[test]
    fn f1_and_kl_known_values() {
        assert_eq!(token_f1(&[1, 2, 3, 4], &[1, 2, 3, 4]), 1.0);
        assert_eq!(token_f1(&[1, 2], &[3, 4]), 0.0);
        // 2 common of 4 and 2: p = 1, r = 0.5 -> 2/3.
        assert!((token_f1(&[1, 2, 3, 4], &[2, 1]) - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(kl_divergence(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]), 0.0);
        // KL([.5,.5] || [.9,.1]) = .5 ln(.5/.9) + .5 ln(.5/.1) = 0.5108...
        let q = [0.9f32.ln(), 0.1f32.ln()];
        assert!((kl_divergence(&[0.0, 0.0], &q) - 0.510_825_6).abs() < 1e-6);
    }
}
