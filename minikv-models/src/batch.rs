//! Many sequences in one forward step: the weight products run once over
//! every sequence's rows ([`QMatrix::matmul_segments`]), attention runs per
//! sequence (each with its own cache: own length, own compression state) in
//! parallel.
//!
//! A sequence's result is bitwise equal to running it alone through
//! [`LanguageModel::forward`] with the same
//! chunks: its rows see the same arithmetic (decode rows through the
//! multi-input dot products, which equal the single-input ones bit for bit;
//! prefill chunks through the same matrix product), and its cache sees the
//! same calls. Tested on the real models in `tests/batched.rs`.

use crate::matrix::QMatrix;
use crate::{LanguageModel, Logits, Workspace};
use minikv_core::{KvCache, Result};
use rayon::prelude::*;

/// One sequence's share of a batched forward step.
pub struct SeqStep<'a> {
    /// Tokens to run at the cache's next positions (one for a decode step, a
    /// prompt chunk for prefill).
    pub tokens: &'a [u32],
    /// This sequence's cache.
    pub cache: &'a mut dyn KvCache,
    /// Which logits to return for it.
    pub logits: Logits,
}

impl std::fmt::Debug for SeqStep<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqStep")
            .field("tokens", &self.tokens.len())
            .field("pos", &self.cache.seq_len(0))
            .field("logits", &self.logits)
            .finish()
    }
}

/// One sequence's rows in one pass of at most
/// [`PREFILL_CHUNK`](crate::llama::PREFILL_CHUNK) tokens.
pub(crate) struct Part<'c> {
    /// Index of the sequence in the step (its logits go to `outs[seq]`).
    pub seq: usize,
    pub tokens: &'c [u32],
    pub cache: &'c mut dyn KvCache,
    /// Position of the first token.
    pub pos0: usize,
    pub want: Logits,
}

/// An architecture's pass over the rows of several sequences.
pub(crate) trait BatchPass: LanguageModel {
    /// Runs one pass; appends each part's requested logits to `outs[part.seq]`.
    fn pass(&self, parts: &mut [Part<'_>], ws: &mut Workspace, outs: &mut [Vec<f32>])
    -> Result<()>;
}

/// The batched forward every architecture shares: checks each sequence, then
/// runs passes of at most `PREFILL_CHUNK` tokens per sequence (the chunks a
/// sequence run alone sees).
pub(crate) fn forward_batch<M: BatchPass>(
    model: &M,
    steps: &mut [SeqStep<'_>],
    ws: &mut Workspace,
) -> Result<Vec<Vec<f32>>> {
    for s in steps.iter() {
        crate::check_forward(model, s.tokens, &*s.cache)?;
    }
    let chunk = crate::llama::PREFILL_CHUNK;
    let passes = steps
        .iter()
        .map(|s| s.tokens.len().div_ceil(chunk))
        .max()
        .unwrap_or(0);
    let mut outs = vec![Vec::new(); steps.len()];
    for p in 0..passes {
        let mut parts: Vec<Part<'_>> = steps
            .iter_mut()
            .enumerate()
            .filter_map(|(seq, s)| {
                let n = s.tokens.len();
                let last = n.div_ceil(chunk) - 1;
                (p <= last).then(|| Part {
                    seq,
                    tokens: &s.tokens[p * chunk..((p + 1) * chunk).min(n)],
                    pos0: s.cache.seq_len(0),
                    want: match s.logits {
                        Logits::Last if p != last => Logits::None,
                        w => w,
                    },
                    cache: &mut *s.cache,
                })
            })
            .collect();
        model.pass(&mut parts, ws, &mut outs)?;
    }
    Ok(outs)
}

/// Row offsets of the parts (prefix sums of their lengths).
pub(crate) fn offsets(parts: &[Part<'_>]) -> Vec<usize> {
    let mut o = Vec::with_capacity(parts.len() + 1);
    o.push(0);
    for p in parts {
        o.push(o.last().copied().unwrap_or(0) + p.tokens.len());
    }
    o
}

/// Appends each part's keys and values to its cache and attends its queries,
/// the parts in parallel. `k`, `v` are `[rows][kd]`, `q` and `att` `[rows][qd]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_parts(
    layer: usize,
    parts: &mut [Part<'_>],
    off: &[usize],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    att: &mut [f32],
    (qd, kd): (usize, usize),
) -> Result<()> {
    let one = |p: &mut Part<'_>, a: usize, att: &mut [f32]| -> Result<()> {
        let n = p.tokens.len();
        p.cache
            .append(layer, &k[a * kd..(a + n) * kd], &v[a * kd..(a + n) * kd], n)?;
        p.cache.attend(layer, &q[a * qd..(a + n) * qd], n, att)
    };
    if let [p] = parts {
        let n = p.tokens.len();
        return one(p, 0, &mut att[..n * qd]);
    }
    let mut slices = Vec::with_capacity(parts.len());
    let mut rest = &mut att[..off[parts.len()] * qd];
    for p in parts.iter() {
        let (a, b) = rest.split_at_mut(p.tokens.len() * qd);
        slices.push(a);
        rest = b;
    }
    parts
        .par_iter_mut()
        .zip(slices)
        .zip(off.par_iter())
        .map(|((p, s), &a)| one(p, a, s))
        .collect()
}

/// The final norm and output head of the rows whose logits were asked for:
/// gathers them (normalized by `norm`) into `ws.h`, one product for all, then
/// appends each part's rows to `outs[part.seq]`, through `post` (e.g. a
/// soft cap).
pub(crate) fn logits(
    parts: &[Part<'_>],
    off: &[usize],
    ws: &mut Workspace,
    head: &QMatrix,
    norm: &dyn Fn(&[f32], &mut [f32]),
    post: &dyn Fn(&mut [f32]),
    outs: &mut [Vec<f32>],
) {
    let h = head.cols;
    let vocab = head.rows;
    let wanted = |p: &Part<'_>, a: usize| match p.want {
        Logits::None => a..a,
        Logits::Last => a + p.tokens.len() - 1..a + p.tokens.len(),
        Logits::All => a..a + p.tokens.len(),
    };
    let m: usize = parts
        .iter()
        .zip(off)
        .map(|(p, &a)| wanted(p, a).len())
        .sum();
    if m == 0 {
        return;
    }
    ws.head_segs
        .set(parts.iter().zip(off).map(|(p, &a)| wanted(p, a).len()));
    let mut r = 0;
    for (p, &a) in parts.iter().zip(off) {
        let rows = wanted(p, a);
        let k = rows.len();
        norm(
            &ws.x[rows.start * h..rows.end * h],
            &mut ws.h[r * h..(r + k) * h],
        );
        r += k;
    }
    ws.logits.resize(m * vocab, 0.0);
    head.matmul_segments(&ws.h[..m * h], &ws.head_segs, &mut ws.logits);
    post(&mut ws.logits);
    let mut r = 0;
    for (p, &a) in parts.iter().zip(off) {
        let k = wanted(p, a).len();
        outs[p.seq].extend_from_slice(&ws.logits[r * vocab..(r + k) * vocab]);
        r += k;
    }
}
