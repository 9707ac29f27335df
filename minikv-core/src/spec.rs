//! Shape of the attention part of a model, as the cache sees it.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// What a KV cache needs to know about a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
}

impl ModelSpec {
    /// Query heads per KV head (`Hq / Hkv`).
    pub fn group(&self) -> usize {
        self.n_q_heads / self.n_kv_heads
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

    /// Bytes of a full fp16 K+V cache for `tokens` tokens (all layers, KV heads).
    pub fn full_fp16_bytes(&self, tokens: usize) -> usize {
        2 * self.n_layers * self.n_kv_heads * self.head_dim * tokens * 2
    }
}
