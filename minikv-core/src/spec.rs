//! Shape of the attention part of a model, as the cache sees it.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// What a KV cache needs to know about a model.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Number of transformer layers `L`.
    pub n_layers: usize,
    /// Query heads `Hq`.
    pub n_q_heads: usize,
    /// Key/value heads `Hkv` (GQA: `Hq % Hkv == 0`).
    pub n_kv_heads: usize,
    /// Head dimension `d`.
    pub head_dim: usize,
    /// Longest sequence the model supports.
    pub max_seq_len: usize,
    /// Per layer, `Some(w)` for sliding-window attention (a query sees the
    /// last `w` positions, itself included) or `None` for global attention.
    /// Empty: every layer is global (Llama).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub windows: Vec<Option<usize>>,
}

impl ModelSpec {
    /// Query heads per KV head (`Hq / Hkv`).
    pub fn group(&self) -> usize {
        self.n_q_heads / self.n_kv_heads
    }

    /// The sliding window of `layer` (`None`: global attention).
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.windows.get(layer).copied().flatten()
    }

    /// Layers with global attention, in order.
    pub fn global_layers(&self) -> Vec<usize> {
        (0..self.n_layers)
            .filter(|&l| self.window(l).is_none())
            .collect()
    }

    /// True when some layer attends through a sliding window.
    pub fn has_windows(&self) -> bool {
        self.windows.iter().any(Option::is_some)
    }

    /// KV head read by query head `h`.
    pub fn kv_head_of(&self, h: usize) -> usize {
        h / self.group()
    }

    /// Checks that the numbers are positive and that `Hkv` divides `Hq`.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("n_layers", self.n_layers),
            ("n_q_heads", self.n_q_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("max_seq_len", self.max_seq_len),
        ] {
            if v == 0 {
                return Err(Error::config(format!("spec.{name}"), "must be positive"));
            }
        }
        if !self.windows.is_empty() && self.windows.len() != self.n_layers {
            return Err(Error::config(
                "spec.windows",
                format!(
                    "{} entries for {} layers (one per layer, or none)",
                    self.windows.len(),
                    self.n_layers
                ),
            ));
        }
        if self.windows.contains(&Some(0)) {
            return Err(Error::config(
                "spec.windows",
                "a sliding window must be positive",
            ));
        }
        if !self.n_q_heads.is_multiple_of(self.n_kv_heads) {
            return Err(Error::config(
                "spec.n_kv_heads",
                format!(
                    "{} KV heads do not divide {} query heads",
                    self.n_kv_heads, self.n_q_heads
                ),
            ));
        }
        Ok(())
    }

    /// Bytes of an uncompressed fp16 K+V cache after `tokens` tokens (all
    /// layers and KV heads; a sliding-window layer holds at most its window).
    pub fn full_fp16_bytes(&self, tokens: usize) -> usize {
        let held: usize = (0..self.n_layers)
            .map(|l| self.window(l).map_or(tokens, |w| tokens.min(w)))
            .sum();
        2 * held * self.n_kv_heads * self.head_dim * 2
    }
}
