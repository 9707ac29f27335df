//! KIVI's residual rule (`residual_mode = "kivi"`, docs/algorithms.md §2):
//! the prompt quantizes its keys in whole blocks of `R` (`T - T mod R`) and
//! all values but the last `R`; while decoding, keys are quantized all `R`
//! at once after attention once the residual holds `R`, and values keep a
//! sliding window of exactly `R` full-precision rows (the oldest is quantized
//! each step, so values must be quantized per token).
//!
//! ```
//! use minikv_core::residual::{ResidualRule, ResidualShape};
//! use minikv_quant::KiviResidual;
//!
//! // T = 11, R = 4, G = 2: 8 quantized keys (3 fp16), 7 quantized values (4 fp16).
//! let shape = ResidualShape { r: 4, granularity: 2 };
//! assert_eq!(KiviResidual::default().prompt_split(11, &shape), (8, 7));
//! // After attention: 4 keys flush whole, 5 values slide to 4.
//! assert_eq!(KiviResidual::default().after_attend(4, 5, &shape), (4, 1));
//! ```

use minikv_core::residual::{ResidualRule, ResidualShape};
use minikv_core::{Axis, Error, QuantConfig, Result};
use serde::{Deserialize, Serialize};

/// KIVI's residual streaming (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KiviResidual {}

#[typetag::serde(name = "kivi")]
impl ResidualRule for KiviResidual {
    fn validate(&self, quant: &QuantConfig) -> Result<()> {
        if quant
            .values
            .as_ref()
            .is_some_and(|v| v.axis() == Axis::Channel)
        {
            return Err(Error::Unsupported(
                "residual_mode = \"kivi\" slides the value window one token at a time: values must be quantized per token".into(),
            ));
        }
        Ok(())
    }

    fn prompt_split(&self, n: usize, shape: &ResidualShape) -> (usize, usize) {
        (n - n % shape.r, n.saturating_sub(shape.r))
    }

    fn after_attend(&self, keys: usize, values: usize, shape: &ResidualShape) -> (usize, usize) {
        let k = if keys >= shape.r { keys } else { 0 };
        (k, values.saturating_sub(shape.r))
    }
}

minikv_core::register!(
    Residual,
    "kivi",
    KiviResidual,
    "KIVI: keys quantized R at a time after attention, values slide a window of exactly R fp16 rows"
);
