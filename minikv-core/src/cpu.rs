//! Which vector instruction sets the CPU kernels may use.
//!
//! Every crate picks its x86 kernels at run time from what the CPU reports.
//! `MINIKV_MAX_ISA=avx2` caps that choice below AVX-512: the 512-bit
//! kernels (matvecs, dequantization, attention, `gemm`) stand aside and the
//! 256-bit ones run, as on a CPU without AVX-512. That lets one machine
//! measure and test the AVX2 paths a researcher's laptop takes; their
//! results are bitwise the same wherever a kernel defines its bits by a
//! portable loop. `MINIKV_MAX_ISA=native` (or unset) uses everything
//! detected.
//!
//! ```
//! // Without the variable set, the cap is `native`: nothing is excluded.
//! let cap = minikv_core::cpu::max_isa().unwrap();
//! assert!(matches!(cap, minikv_core::cpu::MaxIsa::Native | minikv_core::cpu::MaxIsa::Avx2));
//! ```

use crate::{Error, Result};
use std::sync::OnceLock;

/// The environment variable read by [`max_isa`].
pub const MAX_ISA_VAR: &str = "MINIKV_MAX_ISA";

/// The widest instruction set the kernels may choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxIsa {
    /// Everything the CPU reports.
    Native,
    /// At most AVX2 (with FMA, F16C and 256-bit VNNI where reported): no
    /// AVX-512 kernel runs.
    Avx2,
}

/// Parses a [`MAX_ISA_VAR`] value (`native` or `avx2`, any case).
pub fn parse_max_isa(v: &str) -> Result<MaxIsa> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "native" => Ok(MaxIsa::Native),
        "avx2" => Ok(MaxIsa::Avx2),
        other => Err(Error::Input(format!(
            "environment variable {MAX_ISA_VAR}={other:?}: expected \"native\" or \"avx2\""
        ))),
    }
}

/// The cap from [`MAX_ISA_VAR`], read once per process; an unknown value is
/// an error naming it (the CLI refuses to start with one).
pub fn max_isa() -> Result<MaxIsa> {
    static CAP: OnceLock<Option<String>> = OnceLock::new();
    match CAP.get_or_init(|| std::env::var(MAX_ISA_VAR).ok()) {
        Some(v) => parse_max_isa(v),
        None => Ok(MaxIsa::Native),
    }
}

/// True when the 512-bit kernels may run: the CPU reports AVX-512F and
/// [`max_isa`] does not cap below it (an invalid cap counts as `avx2`, the
/// safe side; the CLI has refused it already). Callers still test the
/// further AVX-512 features they need (VNNI, BW, ...).
#[inline]
pub fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static WIDE: OnceLock<bool> = OnceLock::new();
        *WIDE.get_or_init(|| {
            std::is_x86_feature_detected!("avx512f") && matches!(max_isa(), Ok(MaxIsa::Native))
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_parse_and_unknown_ones_are_named() {
        assert_eq!(parse_max_isa("native").unwrap(), MaxIsa::Native);
        assert_eq!(parse_max_isa("AVX2").unwrap(), MaxIsa::Avx2);
        assert_eq!(parse_max_isa("").unwrap(), MaxIsa::Native);
        let e = parse_max_isa("avx512").unwrap_err().to_string();
        assert!(e.contains("MINIKV_MAX_ISA") && e.contains("avx512"), "{e}");
    }
}
