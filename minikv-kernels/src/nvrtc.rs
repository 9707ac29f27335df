//! The kernels' source and their compilation with NVRTC (NVIDIA's runtime
//! compiler, loaded dynamically: no CUDA toolkit or driver at build time).

use minikv_core::{Error, Result};

/// The CUDA C source of every kernel (`cuda/minikv.cu`).
pub const SOURCE: &str = include_str!("../cuda/minikv.cu");

/// The kernels in [`SOURCE`].
pub const KERNELS: [&str; 7] = [
    "mk_prefill_fwd",
    "mk_column_sums",
    "mk_pool1d",
    "mk_quant_keys_channel",
    "mk_quant_values_token",
    "mk_decode_partial",
    "mk_decode_combine",
];

/// Architectures the kernels are compiled and checked for (A100, H100).
pub const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

/// True when `libnvrtc` can be loaded (cudarc panics on use otherwise).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles [`SOURCE`] to PTX for `arch` (e.g. `sm_90`); a compile error
/// carries NVRTC's log.
pub fn compile_ptx(arch: &'static str) -> Result<String> {
    if !nvrtc_available() {
        return Err(Error::Backend {
            backend: "cuda".into(),
            reason: "libnvrtc.so.12 was not found (put it on LD_LIBRARY_PATH; \
                     scripts/fetch-cuda-tools.sh fetches one into third_party/cuda/lib)"
                .into(),
        });
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        // IEEE division: the quantizer's codes must equal the CPU's.
        prec_div: Some(true),
        name: Some("minikv.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
        .map(|p| p.to_src())
        .map_err(|e| Error::Backend {
            backend: "cuda".into(),
            reason: format!("NVRTC could not compile the kernels for {arch}: {e:?}"),
        })
}
