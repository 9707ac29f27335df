//! KVzip (Kim et al. 2025; kvpress's `KVzipPress`, docs/algorithms.md
//! "KVzip"): query-agnostic scores from context reconstruction.
//!
//! After the prompt, the model is asked to repeat it ("Repeat the previous
//! context exactly." then the context itself, in chunks of 2048 tokens); the
//! driver runs this pass through the cache (`finish_prefill` in
//! minikv-models), and the cache records, for every
//! prompt token and KV head, the maximum attention it receives from the
//! reconstruction queries (softmax over the sinks, the chunk and the pass
//! tokens so far; max over queries and the group's query heads). The pass
//! tokens then leave the cache. The first `n_sink` tokens score 1. The pass
//! costs a second forward over the prompt (reported as
//! `reconstruction_pass_tokens` / `_seconds` in results).
//!
//! The `kvzip` policy is kvpress's default budget (`layerwise = False`):
//! one ranking of every (layer, KV head, token) score of the model, whose
//! best `L·H·heavy` give each layer its share; with the `ada_kv` selector at
//! `alpha = 0` a layer's heads then share it by score, as kvpress's
//! bottom-k across a layer's heads does.

use minikv_core::budget::{BudgetRequest, LayerBudget, SelectionPolicy};
use minikv_core::{Error, Needs, Result, ScoreInputs, TokenScorer, check_range, register};
use serde::{Deserialize, Serialize};

/// KVzip scorer (kvpress default: 4 sinks).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvZip {
    /// Leading tokens scored 1 and seen by the pass's scoring attention (4).
    pub n_sink: usize,
}

impl Default for KvZip {
    fn default() -> Self {
        Self { n_sink: 4 }
    }
}

#[typetag::serde(name = "kvzip")]
impl TokenScorer for KvZip {
    fn needs(&self) -> Needs {
        Needs {
            reconstruction: Some(self.n_sink),
            ..Default::default()
        }
    }
    fn validate(&self) -> Result<()> {
        check_range("cache.scorer.n_sink", self.n_sink, 0, 65536)
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let (t, g) = (inp.t, inp.spec.group());
        let r = inp.reconstruction.ok_or_else(|| {
            Error::Unsupported(
                "kvzip needs a context-reconstruction pass before the end of prefill, which this \
                 driver did not run (drivers call minikv_models::finish_prefill; decode-time \
                 re-scoring and the attention probe do not run one)"
                    .into(),
            )
        })?;
        let hq = inp.spec.n_q_heads;
        if r.len() != hq * t {
            return Err(Error::shape("reconstruction scores", hq * t, r.len()));
        }
        // The maximum over the query heads of the KV head's group.
        for h in 0..hq {
            let kv = h / g;
            let row = &mut out[h * t..(h + 1) * t];
            row.copy_from_slice(&r[kv * g * t..(kv * g + 1) * t]);
            for j in 1..g {
                let other = &r[(kv * g + j) * t..(kv * g + j + 1) * t];
                row.iter_mut().zip(other).for_each(|(a, &b)| *a = a.max(b));
            }
            row[..self.n_sink.min(t)].fill(1.0);
        }
        Ok(())
    }
}
register!(
    Scorer,
    "kvzip",
    KvZip,
    "KVzip: max attention each token receives while the model repeats the context (a second forward pass); sinks kept"
);

/// KVzip's model-wide budget (kvpress's default, `layerwise = False`): the
/// best `L·H·heavy` of all the model's KVzip scores (sinks first, the
/// protected sinks and recent window of the cache left out of the ranking)
/// give layer `l` its count `c_l`; its per-head mean `c_l / H` is rounded by
/// largest remainders so that the layers' heavy budgets still add up to
/// `L·heavy` (a layer's total is then a multiple of `H`: at most `H − 1`
/// tokens from kvpress's), at most what the layer's prompt holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvZipBudget {
    /// As the scorer's (4); the two must agree for kvpress's behaviour.
    pub n_sink: usize,
}

impl Default for KvZipBudget {
    fn default() -> Self {
        Self { n_sink: 4 }
    }
}

#[typetag::serde(name = "kvzip")]
impl SelectionPolicy for KvZipBudget {
    fn needs(&self) -> Needs {
        KvZip {
            n_sink: self.n_sink,
        }
        .needs()
    }
    fn validate(&self) -> Result<()> {
        check_range("cache.policy.n_sink", self.n_sink, 0, 65536)
    }
    fn layer_budgets(&self, req: &BudgetRequest<'_>) -> Result<Vec<LayerBudget>> {
        let n = req.n_layers;
        if req.layers.len() != n {
            return Err(Error::Budget(format!(
                "the kvzip policy ranks every layer's reconstruction scores ({} of {n} layers given; it has no budget table without a model)",
                req.layers.len()
            )));
        }
        let t = req.prompt_len;
        let lo = req.sinks.min(t);
        let hi = t.saturating_sub(req.recent).max(lo);
        let cap = hi - lo;
        let scorer = KvZip {
            n_sink: self.n_sink,
        };
        // (score, layer, head, position) of every candidate.
        let mut all: Vec<(f32, u32, u32, u32)> = Vec::new();
        let mut heads = 0;
        for (l, sig) in req.layers.iter().enumerate() {
            let (hq, g) = (sig.spec.n_q_heads, sig.spec.group());
            heads = sig.spec.n_kv_heads;
            let mut out = vec![0.0f32; hq * t];
            scorer.score(sig, &mut out)?;
            for kv in 0..heads {
                let row = &out[kv * g * t..(kv * g + 1) * t];
                all.extend((lo..hi).map(|j| (row[j], l as u32, kv as u32, j as u32)));
            }
        }
        let total = (n * heads * req.heavy).min(all.len());
        if total > 0 && total < all.len() {
            all.select_nth_unstable_by(total - 1, |a, b| {
                b.0.total_cmp(&a.0)
                    .then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3)))
            });
        }
        let mut count = vec![0usize; n];
        for &(_, l, _, _) in &all[..total] {
            count[l as usize] += 1;
        }
        // Per-head means, rounded by largest remainders.
        let h = heads.max(1);
        let mut heavy: Vec<usize> = count.iter().map(|c| c / h).collect();
        let left = (total / h).saturating_sub(heavy.iter().sum());
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| (count[b] % h).cmp(&(count[a] % h)).then(a.cmp(&b)));
        for &l in order.iter().take(left) {
            heavy[l] += 1;
        }
        Ok(heavy
            .into_iter()
            .map(|b| LayerBudget {
                heavy: b.min(cap),
                recent: req.recent,
            })
            .collect())
    }
}
register!(
    Policy,
    "kvzip",
    KvZipBudget,
    "KVzip's model-wide budget (kvpress's default): the best of all layers' KVzip scores give each layer its share (use with the ada_kv selector, alpha 0)"
);
