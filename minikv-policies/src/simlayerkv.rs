//! SimLayerKV (Zhang et al. 2024; kvpress's `SimLayerKVPress`): "lazy" layers,
//! whose last queries look almost only at the first and the most recent
//! tokens, keep just those; the other layers keep everything.
//!
//! A layer is lazy when the attention of its last `n_last` prompt queries
//! (softmax over the causal span, averaged over every query head and those
//! queries, the queries' own columns dropped) puts more than `lazy_threshold`
//! on the first `cache.sinks` and the last `n_recent` of the remaining
//! columns. A lazy layer keeps the sinks and the last `n_recent - n_last`
//! tokens (as the reference); prompts of at most `sinks + n_recent + n_last`
//! tokens are not compressed. The cache's mean budget is not used: how much a
//! run saves depends on how many layers are lazy (`minikv` reports the bytes).

use minikv_core::{
    BudgetRequest, Error, LayerBudget, Needs, Result, SelectionPolicy, check_range, register, simd,
};
use serde::{Deserialize, Serialize};

/// SimLayerKV layer policy.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimLayerKv {
    /// Attention share above which a layer is lazy (0.9, the reference's
    /// recommendation for Llama 3; 1.0 never compresses).
    pub lazy_threshold: f64,
    /// Last prompt queries that decide (1).
    pub n_last: usize,
    /// Recent tokens a lazy layer keeps, plus `n_last` (1024).
    pub n_recent: usize,
}

impl Default for SimLayerKv {
    fn default() -> Self {
        Self {
            lazy_threshold: 0.9,
            n_last: 1,
            n_recent: 1024,
        }
    }
}

impl SimLayerKv {
    /// The share of attention on the first `sinks` and last `n_recent`
    /// columns, for one layer's signals.
    pub fn lazy_share(&self, sig: &minikv_core::LayerSignals<'_>, sinks: usize) -> Result<f64> {
        let (t, w, d) = (sig.t, sig.window, sig.spec.head_dim);
        let wq = sig
            .window_queries
            .filter(|_| w == self.n_last.min(t))
            .ok_or_else(|| {
                Error::Budget("simlayerkv needs the last prompt queries of every layer".into())
            })?;
        let cols = t - w;
        let mut mean = vec![0.0f64; cols];
        let scale = 1.0 / (d as f32).sqrt();
        let mut s = vec![0.0f32; t];
        for h in 0..sig.spec.n_q_heads {
            let k = sig.keys[sig.spec.kv_head_of(h)];
            for i in 0..w {
                let pos = cols + i;
                let qi = &wq[(h * w + i) * d..(h * w + i + 1) * d];
                for (j, x) in s[..=pos].iter_mut().enumerate() {
                    *x = simd::dot(qi, &k[j * d..(j + 1) * d]) * scale;
                }
                simd::softmax_inplace(&mut s[..=pos]);
                mean.iter_mut()
                    .zip(&s[..cols])
                    .for_each(|(m, &p)| *m += p as f64);
            }
        }
        let n = (sig.spec.n_q_heads * w).max(1) as f64;
        let first: f64 = mean[..sinks.min(cols)].iter().sum();
        let last: f64 = mean[cols.saturating_sub(self.n_recent)..].iter().sum();
        Ok((first + last) / n)
    }
}

#[typetag::serde(name = "simlayerkv")]
impl SelectionPolicy for SimLayerKv {
    fn needs(&self) -> Needs {
        Needs {
            query_window: self.n_last,
            ..Default::default()
        }
    }
    fn validate(&self) -> Result<()> {
        check_range("cache.policy.lazy_threshold", self.lazy_threshold, 0.0, 1.0)?;
        check_range("cache.policy.n_last", self.n_last, 1, 4096)?;
        check_range("cache.policy.n_recent", self.n_recent, 1, 1 << 20)?;
        if self.n_last > self.n_recent {
            return Err(Error::config(
                "cache.policy.n_last",
                format!(
                    "must be at most n_recent ({}), got {}",
                    self.n_recent, self.n_last
                ),
            ));
        }
        Ok(())
    }
    fn layer_budgets(&self, req: &BudgetRequest<'_>) -> Result<Vec<LayerBudget>> {
        let t = req.prompt_len;
        let full = LayerBudget {
            heavy: t.saturating_sub(req.sinks),
            recent: 0,
        };
        if req.layers.len() != req.n_layers {
            return Err(Error::Budget(
                "simlayerkv decides per layer from the prompt's attention; it has no budget table \
                 without a model run"
                    .into(),
            ));
        }
        if self.lazy_threshold >= 1.0 || t <= req.sinks + self.n_recent + self.n_last {
            return Ok(vec![full; req.n_layers]);
        }
        req.layers
            .iter()
            .map(|sig| {
                Ok(if self.lazy_share(sig, req.sinks)? > self.lazy_threshold {
                    LayerBudget {
                        heavy: 0,
                        recent: self.n_recent - self.n_last,
                    }
                } else {
                    full
                })
            })
            .collect()
    }
}
register!(
    Policy,
    "simlayerkv",
    SimLayerKv,
    "SimLayerKV: lazy layers (last queries attend to sinks + recent tokens) keep only those, others keep all"
);
