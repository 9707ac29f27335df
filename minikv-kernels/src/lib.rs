//! # minikv-kernels
//!
//! The CUDA attention backend of minikv lives here, in its own crate, so that
//! `minikv-core` and every CPU build never depend on CUDA.
//!
//! **Status: not implemented yet.** [`cuda_backend`] returns a clear
//! [`Error::Backend`] naming what is missing; configs with `backend = "cuda"`
//! fail with that message instead of silently running on the CPU. The CPU
//! backends (`tiled`, `reference` in `minikv-core`) implement the same
//! [`AttentionBackend`] contract the CUDA one will: prefill attention returning
//! `A_cumul` with O(T) extra memory, and fused dequantize-and-attend decode over
//! stores created through [`AttentionBackend::storage`].
//!
//! ```
//! let err = minikv_kernels::cuda_backend().unwrap_err();
//! assert!(err.to_string().contains("cuda"));
//! ```

#![warn(missing_docs)]

#[cfg(feature = "emulate")]
pub mod emulated;

use minikv_core::{AttentionBackend, Error, Result};
use std::sync::Arc;

minikv_core::register_backend!(
    "cuda",
    "CUDA via cudarc (not implemented yet: a clear error)",
    cuda_backend
);

/// The CUDA backend, when it exists; for now a clear error.
pub fn cuda_backend() -> Result<Arc<dyn AttentionBackend>> {
    Err(Error::Backend {
        backend: "cuda".into(),
        reason: "the CUDA backend is not implemented in this version of minikv; use backend = \"tiled\" (CPU)".into(),
    })
}
