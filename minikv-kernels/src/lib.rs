//! # minikv-kernels
//!
//! minikv's CUDA kernels, in their own crate so that `minikv-core` and every
//! CPU build never depend on CUDA. The source is one CUDA C file,
//! `cuda/minikv.cu` ([`nvrtc::SOURCE`]):
//!
//! 1. `mk_prefill_fwd`: prefill flash attention (online softmax over key
//!    tiles, optional sliding window) that also writes each row's
//!    log-sum-exp; `mk_column_sums`: MiniKV's `A_cumul` (column sums of the
//!    causal softmax) with one thread per key, so no two threads write one
//!    column: no atomics, no races, O(T) extra memory, no T x T matrix;
//! 2. SnapKV window scores: `mk_column_sums` over the last W queries, then
//!    `mk_pool1d` (max or average, `same` padding);
//! 3. `mk_quant_keys_channel` / `mk_quant_values_token`: 2/4-bit min-max
//!    quantize-and-pack in the CPU store's word layout with its rounding
//!    (IEEE division, clamp, round half to even; fp16 scales rounded to
//!    nearest even);
//! 4. `mk_decode_partial` + `mk_decode_combine`: fused decode over packed
//!    codes, the fp16 residual and extra entries with a logit bias, GQA-aware,
//!    split over tokens (flash-decoding) with an exact final combination.
//!
//! What is verified where:
//!
//! * **Emulated** (every `cargo test`, feature `emulate`): the same source is
//!   compiled by the host C++ compiler under `cuda/emulate.h` (blocks in turn;
//!   a block's threads as OS threads with a barrier for `__syncthreads`;
//!   `__shared__` as per-block statics; warp shuffles through a per-warp
//!   exchange and barrier) and compared with the CPU backend and quantizer:
//!   outputs and `A_cumul` within 1e-4 (windows included), window scores
//!   within 1e-4, codes, words and scales bit-exact, decode within 1e-4 over
//!   ragged heads with extra entries ([`emulated`], `tests/emulated.rs`).
//! * **Compiled** (CI, after `scripts/fetch-cuda-tools.sh`): NVRTC 12.9
//!   compiles every kernel for sm_80 and sm_90 and `ptxas` assembles them
//!   with at most 64 registers, no spills ([`nvrtc`], the
//!   `minikv-kernels-check` binary, `tests/nvrtc.rs`).
//! * **Not verified here**: execution on a GPU (no device on the CI machine),
//!   and the `cuda` backend itself: device-resident stores created through
//!   the backend's storage factory and the launches behind
//!   [`AttentionBackend`] are not written yet, so [`cuda_backend`] returns a
//!   clear [`Error::Backend`]; configs with `backend = "cuda"` fail with that
//!   message instead of silently running on the CPU.
//!
//! ```
//! let err = minikv_kernels::cuda_backend().unwrap_err();
//! assert!(err.to_string().contains("cuda"));
//! assert_eq!(minikv_kernels::nvrtc::KERNELS.len(), 7);
//! ```

#![warn(missing_docs)]

#[cfg(feature = "emulate")]
pub mod emulated;
pub mod nvrtc;

use minikv_core::{AttentionBackend, Error, Result};
use std::sync::Arc;

minikv_core::register_backend!(
    "cuda",
    "CUDA via cudarc (kernels compiled and emulated; the backend's launches are not wired yet: a clear error)",
    cuda_backend
);

/// The CUDA backend, when it exists; for now a clear error (the kernels exist
/// and are checked, see the crate docs; the backend's launches do not).
pub fn cuda_backend() -> Result<Arc<dyn AttentionBackend>> {
    Err(Error::Backend {
        backend: "cuda".into(),
        reason: "the CUDA backend's device stores and launches are not implemented in this version of minikv (its kernels are compiled and tested under emulation); use backend = \"tiled\" (CPU)".into(),
    })
}
