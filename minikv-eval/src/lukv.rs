//! The measurements behind an LU-KV budget curve (docs/algorithms.md
//! "LU-KV"): per (layer, KV head), how much of the future the head's
//! scorer keeps at each budget.
//!
//! For one text chunk of `context + future` tokens:
//! 1. the first `context` tokens run through a cache with the scorer under
//!    study and a [`ScoreTap`] selector, which records each layer's scores
//!    (per storage head, after the GQA reduction, as a selector sees them)
//!    and keeps every token;
//! 2. the whole chunk runs through a full cache that records keys, values,
//!    the last `future` queries and the output projection; the *oracle
//!    importance* of prompt token `j` for KV head `h` is the largest norm it
//!    adds to the layer's output over the next `future` positions:
//!    `I(h, j) = max over the group's query heads q and future steps k of
//!    A(q, k, j) · ‖W_o^q v_j‖` (the continuation is the text's own, teacher
//!    forced);
//! 3. the head's *utility* of a budget `b` is the importance of the `b`
//!    tokens it would keep (the keep order comes from the caller: the
//!    selector's own, protected tokens first, then by score):
//!    `U(h, b) = Σ_{i < b} I(h, order_i)`, `U(h, 0) = 0`, with `I` first
//!    divided by the layer's total ([`Normalize`]).
//!
//! The curves are averaged over chunks; `minikv-policies` solves the budget
//! split from them.

use crate::duo::Recording;
use minikv_core::{Error, KvCache, Result, SelectionInput, Selector, simd};
use minikv_models::{LanguageModel, Logits, Workspace, finish_prefill};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};

/// What one selection saw: `(layer, scores [H][T], heads, sinks, recent)`.
pub type TapRecord = (usize, Vec<f32>, usize, usize, usize);

/// A selector that keeps every token and records the scores it was given
/// (calibration only: it is not a registered component). Clones share the
/// record, so the copy inside a cache reports to the one the caller holds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScoreTap {
    #[serde(skip)]
    seen: Arc<Mutex<Vec<TapRecord>>>,
}

impl ScoreTap {
    /// Takes what was recorded so far.
    pub fn take(&self) -> Vec<TapRecord> {
        std::mem::take(&mut *self.seen.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[typetag::serde(name = "lukv_score_tap")]
impl Selector for ScoreTap {
    fn select(&self, input: &SelectionInput<'_>, out: &mut Vec<Vec<u32>>) -> Result<()> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).push((
            input.layer,
            input.scores.to_vec(),
            input.n_heads,
            input.sinks,
            input.budget.recent,
        ));
        out.clear();
        out.extend((0..input.n_heads).map(|_| (0..input.t as u32).collect()));
        Ok(())
    }
}

/// How a chunk's oracle importance is scaled before the utilities are
/// summed (the budget split compares utilities across heads and layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Normalize {
    /// As a share of the layer's total (every head, every prompt token):
    /// each layer's future output counts the same, heads within a layer by
    /// their own magnitude. The default.
    Layer,
    /// As a share of the head's own total: every head counts the same.
    Head,
    /// As measured: layers with larger outputs weigh more.
    None,
}

/// Mean utility curves `[layer][kv head][context + 1]` over `chunks`, each
/// `context + future` tokens, the importance scaled as `norm` says.
/// `scored_cache` builds a cache with the scorer under study whose selector
/// is `tap`; `order(scores, sinks, recent)` is the selector's keep order of
/// one head.
#[allow(clippy::too_many_arguments)]
pub fn utility_curves(
    model: &dyn LanguageModel,
    chunks: &[Vec<u32>],
    context: usize,
    norm: Normalize,
    tap: &ScoreTap,
    scored_cache: impl Fn() -> Result<Box<dyn KvCache>>,
    full_cache: impl Fn() -> Result<Box<dyn KvCache>>,
    order: impl Fn(&[f32], usize, usize) -> Vec<u32>,
) -> Result<Vec<Vec<Vec<f64>>>> {
    let spec = model.spec();
    if spec.has_windows() {
        return Err(Error::Unsupported(
            "calibrate lukv: this model has sliding-window layers, which are never compressed; a curve indexes every layer, so it is calibrated on models with global attention only for now".into(),
        ));
    }
    let (l, hkv) = (spec.n_layers, spec.n_kv_heads);
    let mut util = vec![vec![vec![0.0f64; context + 1]; hkv]; l];
    let mut ws = Workspace::default();
    for ids in chunks {
        if ids.len() <= context {
            return Err(Error::Input(format!(
                "calibrate lukv: a chunk of {} tokens leaves no future after the {context}-token context",
                ids.len()
            )));
        }
        let prompt = &ids[..context];
        let mut c = scored_cache()?;
        tap.take();
        model.forward(prompt, c.as_mut(), &mut ws, Logits::None)?;
        finish_prefill(model, c.as_mut(), prompt, &mut ws)?;
        let seen = tap.take();
        if seen.len() != l {
            return Err(Error::Input(format!(
                "calibrate lukv: the scored cache selected {} layers of {l} (its selector must be the tap)",
                seen.len()
            )));
        }
        let imp = oracle_importance(model, ids, context, &full_cache, &mut ws)?;
        for (layer, scores, nh, sinks, recent) in seen {
            if nh != hkv {
                return Err(Error::Input(format!(
                    "calibrate lukv: the cache stores {nh} heads per layer, the model has {hkv} KV heads (a curve is per KV head: cache.heads = \"per_kv\")"
                )));
            }
            let layer_total: f64 = imp[layer].iter().flatten().map(|&x| x as f64).sum();
            for (h, u) in util[layer].iter_mut().enumerate() {
                let ord = order(&scores[h * context..(h + 1) * context], sinks, recent);
                let row = &imp[layer][h];
                let div = match norm {
                    Normalize::Layer => layer_total,
                    Normalize::Head => row.iter().map(|&x| x as f64).sum(),
                    Normalize::None => 1.0,
                }
                .max(f64::MIN_POSITIVE);
                let mut acc = 0.0f64;
                for (b, &j) in ord.iter().enumerate() {
                    acc += row[j as usize] as f64 / div;
                    u[b + 1] += acc;
                }
            }
        }
    }
    let n = chunks.len().max(1) as f64;
    util.iter_mut().flatten().flatten().for_each(|x| *x /= n);
    Ok(util)
}

/// Oracle importance `[layer][kv head][context]` of the first `context`
/// tokens of `ids` over the positions after them (see the module docs).
pub fn oracle_importance(
    model: &dyn LanguageModel,
    ids: &[u32],
    context: usize,
    full_cache: &dyn Fn() -> Result<Box<dyn KvCache>>,
    ws: &mut Workspace,
) -> Result<Vec<Vec<Vec<f32>>>> {
    use rayon::prelude::*;
    let spec = model.spec();
    let (l, hq, hkv, d) = (
        spec.n_layers,
        spec.n_q_heads,
        spec.n_kv_heads,
        spec.head_dim,
    );
    let future = ids.len() - context;
    let mut rec = Recording::new(full_cache()?, l, future).with_values_and_wo();
    model.forward(ids, &mut rec, ws, Logits::None)?;
    let values = rec.values.take().unwrap_or_default();
    let wo = rec.wo.take().unwrap_or_default();
    let g = hq / hkv;
    let inv = 1.0 / (d as f32).sqrt();
    let n = ids.len();
    (0..l)
        .into_par_iter()
        .map(|layer| {
            let (k, v, q, w) = (
                &rec.keys[layer],
                &values[layer],
                &rec.queries[layer],
                &wo[layer],
            );
            if w.len() % (hq * d) != 0 || w.is_empty() {
                return Err(Error::Unsupported(format!(
                    "calibrate lukv: the model handed no output projection for layer {layer}"
                )));
            }
            let hidden = w.len() / (hq * d);
            let mut imp = vec![vec![0.0f32; context]; hkv];
            let mut s = vec![0.0f32; n];
            let mut gram = vec![0.0f32; d * d];
            for qh in 0..hq {
                let kv = qh / g;
                // Largest attention over the future steps.
                let mut amax = vec![0.0f32; context];
                for i in 0..future {
                    let pos = context + i;
                    let qi = &q[(i * hq + qh) * d..(i * hq + qh + 1) * d];
                    for (j, sj) in s[..=pos].iter_mut().enumerate() {
                        *sj = simd::dot(qi, &k[(j * hkv + kv) * d..(j * hkv + kv + 1) * d]) * inv;
                    }
                    simd::softmax_inplace(&mut s[..=pos]);
                    amax.iter_mut()
                        .zip(&s[..context])
                        .for_each(|(a, &x)| *a = a.max(x));
                }
                // ‖W_o^q v‖² = vᵀ (W_o^qᵀ W_o^q) v.
                gram.iter_mut().for_each(|x| *x = 0.0);
                for r in 0..hidden {
                    let row = &w[r * hq * d + qh * d..r * hq * d + (qh + 1) * d];
                    for a in 0..d {
                        let ra = row[a];
                        gram[a * d..(a + 1) * d]
                            .iter_mut()
                            .zip(row)
                            .for_each(|(x, &rb)| *x += ra * rb);
                    }
                }
                for (j, &a) in amax.iter().enumerate() {
                    let vj = &v[(j * hkv + kv) * d..(j * hkv + kv + 1) * d];
                    let sq: f32 = (0..d)
                        .map(|r| vj[r] * simd::dot(&gram[r * d..(r + 1) * d], vj))
                        .sum();
                    let x = a * sq.max(0.0).sqrt();
                    let m = &mut imp[kv][j];
                    *m = m.max(x);
                }
            }
            Ok(imp)
        })
        .collect()
}
