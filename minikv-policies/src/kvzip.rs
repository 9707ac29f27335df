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
