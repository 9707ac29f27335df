//! Compactor (Chari & Van Durme 2025; kvpress's `CompactorPress`): a
//! query-agnostic blend of key leverage ([`crate::leverage`]) and non-causal
//! chunked attention ([`crate::non_causal`]).
//!
//! The first `sinks_start` and last `sinks_end` prompt tokens are protected
//! (they score the maximum of the others); both terms are computed on the
//! tokens between, each z-normalized over the layer, and the score is
//! `blending · leverage + attention`. Without an explicit `blending` the
//! reference uses the compression ratio; here that is the share of the prompt
//! the selection evicts, `1 - budget / T` (0.35 when no budget is known).

use minikv_core::{Needs, Result, ScoreInputs, TokenScorer, check_range, register};
use serde::{Deserialize, Serialize};

/// Compactor scorer (kvpress defaults).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Compactor {
    /// Protected leading tokens (8).
    pub sinks_start: usize,
    /// Protected trailing tokens (4).
    pub sinks_end: usize,
    /// Chunk of the non-causal attention (256).
    pub chunk: usize,
    /// Columns of the leverage sketch (48).
    pub sketch: usize,
    /// Seed of the sketch.
    pub seed: u64,
    /// Weight of the leverage term; absent: the evicted share of the prompt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blending: Option<f32>,
}

impl Default for Compactor {
    fn default() -> Self {
        Self {
            sinks_start: 8,
            sinks_end: 4,
            chunk: 256,
            sketch: 48,
            seed: 0,
            blending: None,
        }
    }
}

#[typetag::serde(name = "compactor")]
impl TokenScorer for Compactor {
    fn needs(&self) -> Needs {
        Needs {
            query_window: Needs::ALL_QUERIES,
            rope: true,
            ..Default::default()
        }
    }
    fn validate(&self) -> Result<()> {
        check_range("cache.scorer.chunk", self.chunk, 1, 65536)?;
        check_range("cache.scorer.sketch", self.sketch, 1, 1024)?;
        if let Some(b) = self.blending {
            check_range("cache.scorer.blending", b, 0.0, 1e3)?;
        }
        Ok(())
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let d = inp.spec.head_dim;
        let phi = |kv| crate::leverage::sketch(self.seed, inp.layer, kv, d, self.sketch);
        self.score_with_sketch(inp, out, &phi)
    }
}

impl Compactor {
    /// [`TokenScorer::score`] with the leverage sketch of KV head `kv` given
    /// by `phi(kv)` (`[d][sketch]`) instead of drawn from the seed: for
    /// cross-checks against another implementation's draw.
    pub fn score_with_sketch(
        &self,
        inp: &ScoreInputs<'_>,
        out: &mut [f32],
        phi: &dyn Fn(usize) -> Vec<f32>,
    ) -> Result<()> {
        let (t, g) = (inp.t, inp.spec.group());
        let left = self.sinks_start.min(t);
        let right = self.sinks_end.min(t - left);
        let (from, to) = (left, t - right);
        let n = to - from;
        let blend = self.blending.unwrap_or_else(|| {
            inp.budget
                .map_or(0.35, |b| 1.0 - b.min(t) as f32 / t.max(1) as f32)
        });
        let mut s = vec![0.0f32; inp.spec.n_kv_heads * n];
        if n > 0 {
            let lev = crate::leverage::layer_leverage(inp, from, to, self.sketch, phi)?;
            let att = crate::non_causal::layer_scores(inp, from, to, self.chunk)?;
            s.iter_mut()
                .zip(lev.iter().zip(&att))
                .for_each(|(x, (l, a))| *x = blend * l + a);
        }
        let top = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let top = if top.is_finite() { top } else { 0.0 };
        for h in 0..inp.spec.n_q_heads {
            let kv = h / g;
            let row = &mut out[h * t..(h + 1) * t];
            row[..from].fill(top);
            row[from..to].copy_from_slice(&s[kv * n..(kv + 1) * n]);
            row[to..].fill(top);
        }
        Ok(())
    }
}
register!(
    Scorer,
    "compactor",
    Compactor,
    "Compactor: blend of pre-RoPE key leverage and non-causal chunked attention, both z-normalized; ends protected"
);
