//! The kernels' source and their compilation with NVRTC (NVIDIA's runtime
//! compiler, loaded dynamically: no CUDA toolkit or driver at build time).
//!
//! A GPU loads the kernels as a CUBIN compiled for its exact architecture
//! (`sm_XY`), never as PTX: PTX from a newer NVRTC carries a PTX ISA version
//! that an older driver cannot JIT-compile, while a CUBIN needs no JIT. The
//! CUBIN comes from a folder of prebuilt ones (compiled on a build machine
//! with `minikv-kernels-check --cubin-out DIR`, named by the source's hash
//! so a stale one is never loaded) or, failing that, from NVRTC at first use.

use minikv_core::{Error, Result};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The CUDA C source of every kernel (`cuda/minikv.cu`, then the
/// tensor-core prefill of `cuda/prefill_mma.cu`, which uses its helpers, the
/// fast decode of `cuda/decode_fast.cu`, and the pipelined tensor-core
/// prefill of `cuda/prefill_pipe.cu`, which uses both files' helpers).
pub const SOURCE: &str = concat!(
    include_str!("../cuda/minikv.cu"),
    include_str!("../cuda/prefill_mma.cu"),
    include_str!("../cuda/decode_fast.cu"),
    include_str!("../cuda/prefill_pipe.cu")
);

/// The kernels in [`SOURCE`].
pub const KERNELS: [&str; 18] = [
    "mk_prefill_fwd",
    "mk_column_sums",
    "mk_pool1d",
    "mk_quant_keys_channel",
    "mk_quant_values_token",
    "mk_decode_partial",
    "mk_decode_fast",
    "mk_decode_staged",
    "mk_decode_combine",
    "mk_scatter",
    "mk_prefill_mma64",
    "mk_column_sums_mma64",
    "mk_prefill_mma128",
    "mk_column_sums_mma128",
    "mk_prefill_mma_pipe64",
    "mk_prefill_mma_pipe128",
    "mk_column_sums_mma_pipe64",
    "mk_column_sums_mma_pipe128",
];

/// Architectures the kernels are compiled and checked for (A100, H100/H200).
pub const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

/// Architectures prebuilt CUBINs are made for (`--cubin-out`): the data
/// center parts and the consumer ones of the same generations.
pub const CUBIN_ARCHS: [&str; 5] = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100"];

fn backend_err(reason: String) -> Error {
    Error::Backend {
        backend: "cuda".into(),
        reason,
    }
}

/// True when `libnvrtc` can be loaded (cudarc panics on use otherwise).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn need_nvrtc() -> Result<()> {
    if nvrtc_available() {
        return Ok(());
    }
    Err(backend_err(
        "libnvrtc.so.12 was not found (put it on LD_LIBRARY_PATH; \
         scripts/fetch-cuda-tools.sh fetches one into third_party/cuda/lib)"
            .into(),
    ))
}

/// The first 16 hex digits of the SHA-256 of [`SOURCE`] and the compile
/// options: the name a prebuilt CUBIN carries.
pub fn source_hash() -> String {
    let mut h = Sha256::new();
    h.update(SOURCE.as_bytes());
    h.update(OPTIONS.join(" ").as_bytes());
    let d = h.finalize();
    d[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// NVRTC options besides the architecture. IEEE division: the quantizer's
/// codes must equal the CPU's.
const OPTIONS: [&str; 1] = ["--prec-div=true"];

/// The file name of the prebuilt CUBIN for `arch`.
pub fn cubin_name(arch: &str) -> String {
    format!("minikv-{}.{arch}.cubin", source_hash())
}

/// Compiles [`SOURCE`] with NVRTC for `arch` (`compute_XY` gives PTX,
/// `sm_XY` a CUBIN); returns (PTX, CUBIN if any). A compile error carries
/// NVRTC's log.
fn compile(arch: &str) -> Result<(String, Option<Vec<u8>>)> {
    use cudarc::nvrtc::{result, sys};
    need_nvrtc()?;
    let fail = |what: &str, e: &dyn std::fmt::Debug| {
        backend_err(format!(
            "NVRTC could not compile the kernels for {arch} ({what}): {e:?}"
        ))
    };
    let src = std::ffi::CString::new(SOURCE).map_err(|e| fail("source", &e))?;
    let prog = result::create_program(&src, Some(c"minikv.cu")).map_err(|e| fail("create", &e))?;
    let mut opts = vec![format!("--gpu-architecture={arch}")];
    opts.extend(OPTIONS.iter().map(|s| s.to_string()));
    // SAFETY: `prog` is live until destroyed below; the source outlives it.
    unsafe {
        let r = result::compile_program(prog, &opts);
        let r = match r {
            Err(e) => {
                let log = result::get_program_log(prog).unwrap_or_default();
                let log: Vec<u8> = log
                    .iter()
                    .map(|&c| c as u8)
                    .take_while(|&c| c != 0)
                    .collect();
                Err(backend_err(format!(
                    "NVRTC could not compile the kernels for {arch}: {e:?}\n{}",
                    String::from_utf8_lossy(&log)
                )))
            }
            Ok(()) => {
                let ptx = result::get_ptx(prog).map_err(|e| fail("PTX", &e))?;
                let ptx: Vec<u8> = ptx
                    .iter()
                    .map(|&c| c as u8)
                    .take_while(|&c| c != 0)
                    .collect();
                let cubin = if arch.starts_with("sm_") {
                    let mut n = 0usize;
                    sys::nvrtcGetCUBINSize(prog, &mut n)
                        .result()
                        .map_err(|e| fail("CUBIN size", &e))?;
                    let mut buf = vec![0u8; n];
                    sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast())
                        .result()
                        .map_err(|e| fail("CUBIN", &e))?;
                    Some(buf)
                } else {
                    None
                };
                Ok((String::from_utf8_lossy(&ptx).into_owned(), cubin))
            }
        };
        let _ = result::destroy_program(prog);
        r
    }
}

/// Compiles [`SOURCE`] to PTX for `arch` (e.g. `sm_90`); a compile error
/// carries NVRTC's log.
pub fn compile_ptx(arch: &str) -> Result<String> {
    compile(arch).map(|(ptx, _)| ptx)
}

/// Compiles [`SOURCE`] to a CUBIN (machine code, no JIT at load) for
/// `arch` (`sm_XY`).
pub fn compile_cubin(arch: &str) -> Result<Vec<u8>> {
    compile_ptx_and_cubin(arch).map(|(_, cubin)| cubin)
}

/// Compiles [`SOURCE`] once for `arch` (`sm_XY`) and returns both the PTX
/// and the CUBIN that compilation made (what [`compile_ptx`] and
/// [`compile_cubin`] return, for the price of one).
pub fn compile_ptx_and_cubin(arch: &str) -> Result<(String, Vec<u8>)> {
    if !arch.starts_with("sm_") {
        return Err(backend_err(format!(
            "a CUBIN needs a real architecture (sm_XY), not {arch}"
        )));
    }
    let (ptx, cubin) = compile(arch)?;
    let cubin = cubin.unwrap_or_default();
    if !cubin.starts_with(b"\x7fELF") {
        return Err(backend_err(format!(
            "NVRTC returned no CUBIN for {arch} ({} bytes, not an ELF image)",
            cubin.len()
        )));
    }
    Ok((ptx, cubin))
}

/// Folders searched for a prebuilt CUBIN, in order: `MINIKV_CUDA_CUBINS`,
/// then `cubin/` beside the executable and one level up (a bundle's
/// `bin/` and `cubin/`).
pub fn cubin_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("MINIKV_CUDA_CUBINS") {
        dirs.push(PathBuf::from(d));
    }
    if let Some(exe) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        dirs.push(exe.join("cubin"));
        if let Some(up) = exe.parent() {
            dirs.push(up.join("cubin"));
        }
    }
    dirs
}

/// The prebuilt CUBIN for `arch` of this source, if one of `dirs` holds
/// it: (its path, its bytes).
pub fn find_cubin(arch: &str, dirs: &[PathBuf]) -> Option<(PathBuf, Vec<u8>)> {
    let name = cubin_name(arch);
    dirs.iter().find_map(|d| {
        let p = d.join(&name);
        let b = std::fs::read(&p).ok()?;
        b.starts_with(b"\x7fELF").then_some((p, b))
    })
}
