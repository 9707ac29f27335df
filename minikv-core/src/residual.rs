//! Residual rules (`cache.quant.residual_mode`): when the rows of a quantized
//! cache's full-precision residual stream into the quantized part
//! (docs/algorithms.md §2). A rule is pure arithmetic on lengths: how many of
//! the kept prompt rows are quantized at the end of prefill, and how many
//! rows leave the front of the key and value residuals before and after each
//! decode step's attention. The head store does the moving; every rule gets
//! whole quantizer groups because `R` is a multiple of the key group.
//!
//! `minikv` (here, the default) flushes the whole residual once it holds `R`
//! rows, before attention; `kivi` (in `minikv-quant`) flushes keys after
//! attention and slides a window of exactly `R` values. A new rule is one
//! file plus one `register!(Residual, ...)` line; in a config
//! `residual_mode = "kivi"` is shorthand for `residual_mode = { type = "kivi" }`.
//!
//! ```
//! use minikv_core::residual::{MinikvResidual, ResidualRule, ResidualShape};
//!
//! // T = 11 prompt rows, R = 4, G = 2: MiniKV quantizes 10 keys and 10 values.
//! let shape = ResidualShape { r: 4, granularity: 2 };
//! assert_eq!(MinikvResidual::default().prompt_split(11, &shape), (10, 10));
//! // A residual of 4 keys and 4 values is flushed whole before attention.
//! assert_eq!(MinikvResidual::default().before_attend(4, 4, &shape), (4, 4));
//! ```

use crate::Result;
use crate::config::QuantConfig;
use serde::{Deserialize, Serialize};
use std::fmt::Debug;

/// The residual's length and the quantizers' append unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResidualShape {
    /// Residual length `R` (`cache.quant.residual`).
    pub r: usize,
    /// Tokens per quantizer append: the group `G` of a per-channel
    /// quantizer, 1 per token (the larger of the key and value quantizers').
    pub granularity: usize,
}

/// When residual rows stream into the quantized part. Counts returned are
/// rows taken from the front (oldest) of the key and value residuals; a
/// count for a part without a quantizer is ignored.
#[typetag::serde(tag = "type")]
pub trait ResidualRule: Send + Sync + Debug + dyn_clone::DynClone {
    /// Checks the rule against the quantizers; errors name the field.
    fn validate(&self, quant: &QuantConfig) -> Result<()> {
        let _ = quant;
        Ok(())
    }
    /// Of `n` kept prompt rows, how many keys and values are quantized at
    /// the end of prefill.
    fn prompt_split(&self, n: usize, shape: &ResidualShape) -> (usize, usize);
    /// After a decoded row is appended and before attention, with `keys`
    /// and `values` rows in the residuals: rows to quantize.
    fn before_attend(&self, keys: usize, values: usize, shape: &ResidualShape) -> (usize, usize) {
        let _ = (keys, values, shape);
        (0, 0)
    }
    /// After attention: rows to quantize.
    fn after_attend(&self, keys: usize, values: usize, shape: &ResidualShape) -> (usize, usize) {
        let _ = (keys, values, shape);
        (0, 0)
    }
}

dyn_clone::clone_trait_object!(ResidualRule);

/// MiniKV's rule: the prompt leaves `n mod G` rows in full precision; the
/// whole residual is quantized once it holds `R` rows, before attention.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MinikvResidual {}

#[typetag::serde(name = "minikv")]
impl ResidualRule for MinikvResidual {
    fn prompt_split(&self, n: usize, shape: &ResidualShape) -> (usize, usize) {
        let q = n - n % shape.granularity;
        (q, q)
    }

    fn before_attend(&self, keys: usize, values: usize, shape: &ResidualShape) -> (usize, usize) {
        let full = |n: usize| if n >= shape.r { n } else { 0 };
        (full(keys), full(values))
    }
}

crate::register!(
    Residual,
    "minikv",
    MinikvResidual,
    "MiniKV: the prompt leaves n mod G rows full; the residual is quantized whole at R rows, before attention (default)"
);
