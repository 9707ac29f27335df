//! # minikv-kernels
//!
//! minikv's CUDA kernels, in their own crate so that `minikv-core` and every
//! CPU build never depend on CUDA. The source is `cuda/minikv.cu` followed by
//! `cuda/prefill_mma.cu`, `cuda/decode_fast.cu` and `cuda/prefill_pipe.cu`
//! (one NVRTC program, [`nvrtc::SOURCE`]):
//!
//! 1. `mk_prefill_fwd`: prefill flash attention (online softmax over key
//!    tiles, optional sliding window) that also writes each row's
//!    log-sum-exp; `mk_column_sums`: MiniKV's `A_cumul` (column sums of the
//!    causal softmax) with one thread per key, so no two threads write one
//!    column: no atomics, no races, O(T) extra memory, no T x T matrix;
//!    for head dims 64 and 128 their tensor-core forms `mk_prefill_mma{64,128}`
//!    and `mk_column_sums_mma{64,128}` (the default, [`PrefillPath`]):
//!    FlashAttention-2's tiling (4 warps of 16 query rows, tiles of 64 keys
//!    staged as fp16 in shared memory, `mma.sync.m16n8k16` with f32
//!    accumulators, the probabilities reused from registers as the next
//!    product's operand) and `A_cumul` from the same 16 x 8 tiles of `K Q^T`,
//!    each lane summing its keys in a fixed order (deterministic, no
//!    atomics); fp16 operands (keys and values rounded once by the host
//!    and uploaded, and kept in prefill histories, as fp16: half the bytes
//!    of the f32 the scalar kernels take), so results are within about 1e-3
//!    of the f32 kernels, FlashAttention-2's precision;
//!    `mk_prefill_mma_pipe{64,128}` and `mk_column_sums_mma_pipe{64,128}`
//!    ([`PrefillPath::Pipelined`], `MINIKV_CUDA_PREFILL=pipelined`) are the
//!    same products in the same order (the same bits) with the tile loads
//!    off the critical path: key, value and query tiles staged row-major by
//!    asynchronous copies (`cp.async`), each issued ahead of its use, the
//!    B fragments loaded by `ldmatrix` (`.trans` for the values) instead of
//!    two 16-bit shared loads each, and the queries uploaded as fp16 (the
//!    host rounds q / sqrt(d) as the plain kernels do on the device); the
//!    default stays the plain kernels until a GPU run times them;
//! 2. SnapKV window scores: `mk_column_sums` over the last W queries, then
//!    `mk_pool1d` (max or average, `same` padding);
//! 3. `mk_quant_keys_channel` / `mk_quant_values_token`: 2/4-bit min-max
//!    quantize-and-pack in the CPU store's word layout with its rounding
//!    (IEEE division, clamp, round half to even; fp16 scales rounded to
//!    nearest even);
//! 4. `mk_decode_fast` / `mk_decode_partial` + `mk_decode_combine`: fused
//!    decode over packed codes, the fp16 residual (a ring, read in place) and
//!    extra entries with a logit bias, split over tokens (flash-decoding)
//!    with an exact final combination (an empty head gives 0, never 0 / 0;
//!    a block per query head and 32 channels, with 4 to 32 warps of split
//!    lanes by the split count, `MINIKV_CUDA_COMBINE_LANES` to fix them).
//!    `mk_decode_fast` takes the common layouts (keys per channel, values
//!    per token, 2/4/8 bits, head dims 16-256 in powers of two): one block
//!    reads a KV head's split once for up to four of its query heads,
//!    quantized keys go by warp tiles of 16 tokens (vector loads of 4
//!    channels' words and scales, partial sums added by shuffles), a
//!    code costs one fused multiply-add per query head (scales folded into
//!    the query or the probabilities, codes made floats by the exponent
//!    trick, fp16 converted by the hardware), and short caches take smaller
//!    splits to fill the GPU; `mk_decode_partial` (one block per query head,
//!    per-element dequantization) takes every other layout.
//!    `mk_decode_staged` is `mk_decode_fast` after a block's asynchronous
//!    copy (`cp.async`) of everything its chunk reads from the quantized
//!    keys and values into 32 KB of shared memory (key words swizzled
//!    against bank conflicts; a part that does not fit is read in place):
//!    the chunk's loads all in flight at once, the values' under the
//!    scores' arithmetic, where the fast kernel's warps load a tile, wait,
//!    then compute it (what held 2-bit decode to 14% of the bandwidth on
//!    the H200). Same arithmetic in the same order: the same bits.
//!    [`DecodeKernel`] picks (`MINIKV_CUDA_DECODE=fast|staged|general`;
//!    fast stays the default until a GPU run times the staged one).
//!    With `arithmetic = "int8"` on per-channel 2- or 4-bit keys both fast
//!    forms score the keys by integer products (`mk_key_tile_i8`: the
//!    query rounded to 8 bits per key group with one step per split, codes
//!    and query bytes multiplied four at a time by `dp4a`; the values stay
//!    f32, so results are at least as close to exact as the CPU's int8
//!    kernels, not bitwise theirs; docs/algorithms.md §1); the general
//!    kernel multiplies in f32;
//! 5. `mk_scatter`: many small queued uploads and device moves applied by
//!    one launch ([`Batched`]: a decode step makes about two synchronous
//!    host-device calls per layer, whatever the number of heads).
//!
//! The backend ([`CudaBackend`], `backend = "cuda"` in a run config) runs
//! prefill (with `A_cumul`) and decode through these kernels; its storage
//! factory creates device-resident stores ([`DeviceFpStore`], fp16 rows;
//! [`DeviceQuantStore`], codes quantized on the device), so the cache's
//! `memory()` reports device bytes. Its host code talks to a [`Device`]:
//! the CUDA driver through cudarc ([`cuda::CudaDevice`]: a CUBIN for the
//! device's exact architecture, prebuilt by `minikv-kernels-check
//! --cubin-out` or compiled by NVRTC at first use, cached per device; never
//! PTX, which an older driver may be unable to JIT; copies queued on one
//! stream, uploads through pinned host buffers, so that a decode step's
//! host thread waits once per layer, at its download;
//! `MINIKV_CUDA_PINNED=0`: synchronous copies), or the CPU emulation of the same kernels (`emulated::EmuDevice`, feature
//! `emulate`, registered as `backend = "cuda-emulated"`).
//!
//! What is verified where:
//!
//! * **Emulated** (every `cargo test`, feature `emulate`): the same source is
//!   compiled by the host C++ compiler under `cuda/emulate.h` (blocks in turn;
//!   a block's threads as fibers, first to last, last to first or a warp at
//!   a time through each phase between barriers, or as OS threads, with a
//!   barrier for `__syncthreads`; `cp.async` landing only at its wait;
//!   `ldmatrix` from the documented fragment layout;
//!   `__shared__` as per-block statics; warp shuffles through a per-warp
//!   exchange and barrier), and the whole backend runs on it, launch for
//!   launch as on a GPU (`tests/parity/mod.rs`, `tests/emulated.rs`):
//!   prefill outputs and `A_cumul` within 1e-4 of the CPU reference
//!   (windows, GQA) on the scalar kernels and within 2e-3 (measured 6.2e-4)
//!   on the tensor-core ones, whose `mma.sync` the emulation computes from
//!   the fragments' documented layout; window scores within the same
//!   bounds; codes bit-exact with the CPU quantizer (2/4/8 bits, both
//!   axes); fused decode (both kernels: 2/4/8 bits, head dims 16-256, one
//!   to five query heads per KV head, splits of 32-256 tokens) within 1e-4
//!   over ragged heads with extra entries (with int8 key products: within
//!   twice the CPU int8 kernels' distance to exact arithmetic, and not the
//!   exact kernel's bits), the staged form bitwise equal to
//!   the fast one with some blocks staging keys and values (counted), the
//!   pipelined prefill bitwise equal to the plain tensor-core one, and a whole cache (MiniKV, KIVI, H2O with decode-time
//!   probabilities) built on the backend against the same cache on the CPU;
//!   from the CLI, the real model generates with `backend = "cuda-emulated"`,
//!   and `minikv serve` on it batches concurrent requests into the same
//!   engine steps, each answered as `minikv generate` answers it alone
//!   (`minikv-cli/tests/serve.rs`).
//!   The emulated checks also cover a model's shapes (32 query / 8 KV heads,
//!   d = 128, 32K tokens: many waves of blocks, large offsets; the scalar
//!   prefill there, the tensor-core one only at the small shapes), residual
//!   rings that wrap hundreds of times against the CPU cache, the upload
//!   queue's ordering, the number of host-device calls per decode step,
//!   and prefill histories: a chunked prefill keeps each layer's rows on
//!   the device and uploads only each chunk's new rows, bitwise the results
//!   of whole uploads, with the bytes moved counted (fp16 keys and values
//!   for the tensor cores, f32 for the scalar kernels;
//!   `tests/prefill_history.rs`).
//! * **Compiled** (CI, after `scripts/fetch-cuda-tools.sh`): NVRTC 12.9
//!   compiles every kernel for sm_80 and sm_90 and `ptxas` assembles them
//!   with no spills, at most 64 registers (the tensor-core prefill: at most
//!   255 for its fragments in registers; the fast decode: 96, its launch
//!   bounds' five blocks per SM, both forms); CUBINs for sm_80, sm_86, sm_89,
//!   sm_90 and sm_100 are made and found by name ([`nvrtc`], the
//!   `minikv-kernels-check` binary, `tests/nvrtc.rs`).
//! * **On a GPU: an NVIDIA H200, in two sessions** (driver 580, CUDA 13.0;
//!   through `scripts/gpu-bundle.sh` and `scripts/gpu-check.sh`,
//!   docs/performance.md has the figures): the prebuilt sm_90 CUBIN loaded
//!   without NVRTC; every parity check passed with every launch synchronized
//!   and checked (small shapes, f32 and fp16 scales, and 32 query / 8 KV
//!   heads, d = 128, 32K tokens: prefill on tensor cores within 4.3e-4, on
//!   the scalar kernels within 6.1e-6, 2- and 4-bit fused decode within
//!   1.6e-4 of the largest output, 7.3e-6 of the values' scale), so the
//!   emulation's reading of the `mma.sync` fragments holds on the hardware;
//!   compute-sanitizer's memcheck found 0 errors; MiniKV 2-bit generation on
//!   the real model's first blocks gave the same greedy tokens with
//!   `backend = "cuda"` as with `"tiled"`. The `mk_decode_fast` measured
//!   last is this source's but for how a quantized code is read (since:
//!   one `LOP3` where it took a shift and two, its sums scaled by a power
//!   of two; the same bits under the emulation): at 128K tokens fp16 decode reads at
//!   53% of the 4.8 TB/s bound inside the kernel (38% per call, with the
//!   host round trip), 2- and 4-bit at 14% (the 2-bit kernel takes as long
//!   as fp16: instruction- and latency-bound), 12-23 times the general
//!   kernel; prefill with `A_cumul` at 32K tokens 16-17.5 attention
//!   TFLOP/s on tensor cores, host uploads, fp16 conversions and the
//!   download included (the kernels alone were not timed then:
//!   [`CudaBackend::time_prefill_kernels`] now times them, operands on the
//!   device, as FlashAttention's figures are taken). Written after the
//!   second session and not yet run on a GPU: `mk_decode_staged`, the
//!   pinned asynchronous copies, the pipelined prefill kernels and the
//!   int8 key products, and the in-place code reads above;
//!   `scripts/gpu-check.sh` checks their parity (and racecheck the two
//!   kernels that fill shared memory asynchronously) and times each beside
//!   what it may replace (the fast kernel, synchronous copies, the plain
//!   tensor-core prefill).
//!
//! Not implemented by the kernels (clear errors, never a silent CPU
//! fallback): key-channel pruning (store wrappers), gated extra entries,
//! quantizers other than min-max, head dimensions above 256. Store methods
//! that return host data (`scores`, `to_f32`, ...) download first.
//!
//! With no CUDA driver, `backend = "cuda"` is a clear error:
//!
//! ```
//! if !minikv_kernels::cuda::driver_available() {
//!     let err = minikv_kernels::cuda_backend().unwrap_err();
//!     assert!(err.to_string().contains("CUDA driver"));
//! }
//! assert_eq!(minikv_kernels::nvrtc::KERNELS.len(), 18);
//! ```

#![warn(missing_docs)]

pub mod backend;
pub mod cuda;
mod decode;
pub mod device;
#[cfg(feature = "emulate")]
pub mod emulated;
pub mod nvrtc;
mod pinned;
mod prefill;
mod resident;
mod store;

pub use backend::{CudaBackend, DeviceStorage, PrefillKernelTimes, PrefillPath};
pub use decode::DecodeKernel;
pub use device::{Arg, Batched, Calls, DevBuf, Device, Launch};
pub use store::{DeviceFpStore, DeviceQuantStore};

use minikv_core::{AttentionBackend, Result};
use std::sync::Arc;

minikv_core::register_backend!(
    "cuda",
    "CUDA via cudarc: NVRTC-compiled kernels, device-resident stores (device MINIKV_CUDA_DEVICE, default 0)",
    cuda_backend
);

/// Makes sure the linker keeps this crate's backend registrations (`cuda`,
/// and `cuda-emulated` with the `emulate` feature): a binary that selects
/// backends only by name from configs calls this once.
#[inline(never)]
pub fn ensure_registered() {
    std::hint::black_box(cuda_backend as fn() -> Result<Arc<dyn AttentionBackend>>);
    #[cfg(feature = "emulate")]
    emulated::ensure_registered();
}

/// The CUDA backend on device `MINIKV_CUDA_DEVICE` (default 0); a clear
/// error without a CUDA driver, a device, or NVRTC.
pub fn cuda_backend() -> Result<Arc<dyn AttentionBackend>> {
    let ordinal = match std::env::var("MINIKV_CUDA_DEVICE") {
        Ok(s) => s.trim().parse().map_err(|_| {
            minikv_core::Error::config("MINIKV_CUDA_DEVICE", format!("{s:?} is not a device index"))
        })?,
        Err(_) => 0,
    };
    let dev = cuda::CudaDevice::open(ordinal)?;
    Ok(Arc::new(
        CudaBackend::new(dev)
            .with_decode_kernel(DecodeKernel::from_env()?)
            .with_prefill_path(PrefillPath::from_env()?),
    ))
}
