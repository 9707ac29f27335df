//! KVCompose (Akulov et al. 2025; kvpress's `KVComposePress`, structured
//! variant): attention-guided scores from a second pass, and one global
//! budget split across layers by "composite tokens".
//!
//! After the prompt, the model reads the context once more, as it is, with
//! the prompt in the cache (a plain reconstruction pass, run by
//! `minikv_models::finish_prefill`; its tokens leave the cache afterwards).
//! Per query head, a prompt token's score is the largest attention any pass
//! query gives it; a KV head's score is the mean over the query heads of its
//! group, plus (`add_mean_across_heads`) the layer's mean over KV heads.
//!
//! The policy sorts each KV head's scores in decreasing order and averages
//! the sorted rows over the layer's KV heads: entry `r` of that *composite*
//! row is the layer's `r`-th best token, aligned across heads. Layer 0's
//! row is raised to the elementwise maximum over layers (kvpress keeps the
//! first layer the largest). The `L x heavy` best composite entries of the
//! whole model decide how many tokens each layer keeps (at least one); every
//! KV head of a layer then keeps that many of its own best tokens (the
//! `top_k` selector over the scorer's scores).

use minikv_core::budget::{BudgetRequest, LayerBudget, SelectionPolicy};
use minikv_core::{Error, Needs, Result, ScoreInputs, TokenScorer, register};
use serde::{Deserialize, Serialize};

/// What KVCompose's pass needs: per prompt token and query head, the largest
/// attention of a plain repetition of the context.
fn pass_needs() -> Needs {
    Needs {
        reconstruction: Some(0),
        plain_pass: true,
        ..Default::default()
    }
}

/// Per-KV-head scores `[Hkv][T]` of one layer from its reconstruction
/// maxima `r [Hq][T]`: the mean over each group, plus the mean over KV
/// heads when `add_mean`.
fn kv_scores(r: &[f32], hq: usize, hkv: usize, t: usize, add_mean: bool) -> Result<Vec<f32>> {
    if r.len() != hq * t || hkv == 0 || !hq.is_multiple_of(hkv) {
        return Err(Error::shape(
            "kvcompose reconstruction scores",
            hq * t,
            r.len(),
        ));
    }
    let g = hq / hkv;
    let mut s = vec![0.0f32; hkv * t];
    for kv in 0..hkv {
        let row = &mut s[kv * t..(kv + 1) * t];
        for j in 0..g {
            let h = kv * g + j;
            row.iter_mut()
                .zip(&r[h * t..(h + 1) * t])
                .for_each(|(a, &b)| *a += b);
        }
        row.iter_mut().for_each(|a| *a /= g as f32);
    }
    if add_mean {
        let mean: Vec<f32> = (0..t)
            .map(|j| (0..hkv).map(|kv| s[kv * t + j]).sum::<f32>() / hkv as f32)
            .collect();
        for kv in 0..hkv {
            s[kv * t..(kv + 1) * t]
                .iter_mut()
                .zip(&mean)
                .for_each(|(a, &m)| *a += m);
        }
    }
    Ok(s)
}

fn reconstruction<'a>(inp: &ScoreInputs<'a>, who: &str) -> Result<&'a [f32]> {
    inp.reconstruction.ok_or_else(|| {
        Error::Unsupported(format!(
            "{who} needs a plain reconstruction pass before the end of prefill, which this \
             driver did not run (drivers call minikv_models::finish_prefill; decode-time \
             re-scoring and the attention probe do not run one)"
        ))
    })
}

/// KVCompose's token scores (kvpress defaults: `agg_task = "max"`,
/// `agg_group = "mean"`, `add_mean_across_heads = true`, no value norms).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvComposeScore {
    /// Add the layer's mean over KV heads to every head's scores (true).
    pub add_mean_across_heads: bool,
}

impl Default for KvComposeScore {
    fn default() -> Self {
        Self {
            add_mean_across_heads: true,
        }
    }
}

#[typetag::serde(name = "kvcompose")]
impl TokenScorer for KvComposeScore {
    fn needs(&self) -> Needs {
        pass_needs()
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let (t, hq, hkv) = (inp.t, inp.spec.n_q_heads, inp.spec.n_kv_heads);
        let r = reconstruction(inp, "kvcompose")?;
        let s = kv_scores(r, hq, hkv, t, self.add_mean_across_heads)?;
        minikv_core::scoring::broadcast_kv(&s, hq, hkv, t, out);
        Ok(())
    }
}
register!(
    Scorer,
    "kvcompose",
    KvComposeScore,
    "KVCompose: per token, the largest attention of a plain second reading of the context (mean over the group, plus the layer's mean over heads)"
);

/// KVCompose's layer budgets from composite tokens (structured: every KV
/// head of a layer keeps the same number of tokens).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvCompose {
    /// As the scorer's (true); the two must agree for kvpress's behaviour.
    pub add_mean_across_heads: bool,
}

impl Default for KvCompose {
    fn default() -> Self {
        Self {
            add_mean_across_heads: true,
        }
    }
}

#[typetag::serde(name = "kvcompose")]
impl SelectionPolicy for KvCompose {
    fn needs(&self) -> Needs {
        pass_needs()
    }
    fn layer_budgets(&self, req: &BudgetRequest<'_>) -> Result<Vec<LayerBudget>> {
        let n = req.n_layers;
        if req.layers.is_empty() {
            return Err(Error::Budget(
                "kvcompose splits the budget from a second reading of the prompt by the model; it has no budget table without one"
                    .into(),
            ));
        }
        if req.layers.len() != n {
            return Err(Error::Budget(format!(
                "kvcompose needs every layer's reconstruction scores ({} of {n} layers given)",
                req.layers.len()
            )));
        }
        let t = req.prompt_len;
        let mut composite = Vec::with_capacity(n);
        for sig in req.layers {
            let (hq, hkv) = (sig.spec.n_q_heads, sig.spec.n_kv_heads);
            let r = reconstruction(sig, "the kvcompose policy")?;
            let s = kv_scores(r, hq, hkv, t, self.add_mean_across_heads)?;
            let mut c = vec![0.0f64; t];
            for kv in 0..hkv {
                let mut row: Vec<f32> = s[kv * t..(kv + 1) * t].to_vec();
                row.sort_by(|a, b| b.total_cmp(a));
                c.iter_mut().zip(&row).for_each(|(a, &b)| *a += b as f64);
            }
            c.iter_mut().for_each(|a| *a /= hkv as f64);
            composite.push(c);
        }
        // The first layer is kept the largest.
        for r in 0..t {
            let m = composite
                .iter()
                .map(|c| c[r])
                .fold(f64::NEG_INFINITY, f64::max);
            composite[0][r] = m;
        }
        let cap = req.prompt_len.saturating_sub(req.recent + req.sinks);
        let total = (n * req.heavy).min(n * cap);
        let mut all: Vec<(f64, usize, usize)> = composite
            .iter()
            .enumerate()
            .flat_map(|(l, c)| c.iter().enumerate().map(move |(r, &v)| (v, l, r)))
            .collect();
        all.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
        let mut counts = vec![0usize; n];
        for &(_, l, _) in &all[..total.min(all.len())] {
            counts[l] += 1;
        }
        Ok(counts
            .into_iter()
            .map(|c| LayerBudget {
                heavy: c.clamp(1.min(cap), cap),
                recent: req.recent,
            })
            .collect())
    }
}
register!(
    Policy,
    "kvcompose",
    KvCompose,
    "KVCompose: one global budget split across layers by composite tokens (each layer's heads' sorted scores averaged), the first layer the largest"
);
