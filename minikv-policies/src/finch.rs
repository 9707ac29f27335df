//! FINCH (Corallo & Papotti 2024; kvpress's `FinchPress`): SnapKV-style
//! prompt-guided scores with each window row weighted by how many keys it sees.
//!
//! The last `window` prompt queries (in FINCH, the question) attend causally
//! to the prompt; row `i` of the window (at position `T - W + i`) has its
//! probabilities multiplied by `T - W + i`, the rows are averaged, then the
//! query heads of a KV group; the window itself scores above everything.
//!
//! Departures: the reference finds the window from a delimiter token put
//! between context and question; here the window is a parameter (an
//! evaluation task whose question ends the prompt can set it to the question's
//! length). The reference re-rotates kept keys to consecutive positions;
//! minikv keeps every token at its own position.

use minikv_core::{Needs, Result, ScoreInputs, TokenScorer, check_range, register};
use serde::{Deserialize, Serialize};

/// FINCH scorer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Finch {
    /// Window of prompt queries (32).
    pub window: usize,
    /// Weight each window row by the keys it sees (FINCH's normalization; true).
    pub normalize: bool,
}

impl Default for Finch {
    fn default() -> Self {
        Self {
            window: 32,
            normalize: true,
        }
    }
}

#[typetag::serde(name = "finch")]
impl TokenScorer for Finch {
    fn needs(&self) -> Needs {
        Needs {
            query_window: self.window,
            ..Default::default()
        }
    }
    fn validate(&self) -> Result<()> {
        check_range("cache.scorer.window", self.window, 1, 65536)
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let (t, w, g) = (inp.t, inp.window, inp.spec.group());
        let prefix = t - w;
        let mut kv_rows = vec![0.0f32; inp.spec.n_kv_heads * prefix];
        for h in 0..inp.spec.n_q_heads {
            let acc = &mut kv_rows[(h / g) * prefix..(h / g + 1) * prefix];
            crate::scorers::window_softmax(inp, h, |i, p| {
                let c = if self.normalize {
                    (prefix + i) as f32
                } else {
                    1.0
                };
                let s = c / (w * g) as f32;
                acc.iter_mut().zip(p).for_each(|(a, b)| *a += b * s);
            })?;
        }
        let top = kv_rows.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let top = if top.is_finite() { top + 1.0 } else { 1.0 };
        for h in 0..inp.spec.n_q_heads {
            let kv = h / g;
            let row = &mut out[h * t..(h + 1) * t];
            row[..prefix].copy_from_slice(&kv_rows[kv * prefix..(kv + 1) * prefix]);
            row[prefix..].fill(top);
        }
        Ok(())
    }
}
register!(
    Scorer,
    "finch",
    Finch,
    "FINCH: window attention with each row weighted by the keys it sees, averaged over the group; window kept"
);
