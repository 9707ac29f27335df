//! Every kernel compiles with NVRTC for sm_80 and sm_90, and `ptxas` assembles
//! each within the limits below (no GPU needed). The tools come from
//! `scripts/fetch-cuda-tools.sh` (CI runs it; elsewhere this test is skipped
//! with a message when they are absent, and fails under `CI`).

use std::path::Path;
use std::process::Command;

/// Limits set for the kernels as written (128 threads per block): at most 64
/// registers per thread (4 resident blocks per SM at full occupancy headroom),
/// no spills, at most 64 bytes of stack.
const MAX_REGISTERS: u64 = 64;
const MAX_STACK: u64 = 64;
/// The tensor-core prefill keeps a warp's query (or key) fragments, score
/// tile and output accumulators in registers (d = 128: 32 + 32 + 64 words
/// per lane), as FlashAttention-2 does: the hardware's 255, no spills.
const MAX_REGISTERS_MMA: u64 = 255;
/// The fast decode keeps 8 channels x 4 query heads of value sums per thread
/// and its launch bounds ask for 5 resident blocks per SM (65536 / (5 x 128)
/// = 102 registers): at most 96, no spills.
const MAX_REGISTERS_DECODE: u64 = 96;
/// ... and 5 blocks per SM fit in shared memory on an H100 / H200 (228 KB
/// per SM, of which 1 KB per block is the system's): at most 44.6 KB of
/// static shared memory per block (the staged kernel's 32 KB stage, reused
/// for the final sums, and the queries and scores).
const MAX_SHARED_DECODE: u64 = (228 * 1024) / 5 - 1024;
/// Static shared memory of any block: the 48 KB that needs no opt-in.
const MAX_SHARED: u64 = 48 * 1024;

#[test]
fn kernels_compile_with_nvrtc_and_assemble_within_limits() {
    let tools = Path::new(env!("CARGO_MANIFEST_DIR")).join("../third_party/cuda");
    if !tools.join(".complete").is_file() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{} missing: CI must run scripts/fetch-cuda-tools.sh",
            tools.display()
        );
        eprintln!("skipped: run scripts/fetch-cuda-tools.sh to check the kernels with NVRTC");
        return;
    }
    let out = std::env::temp_dir().join(format!("minikv-nvrtc-{}", std::process::id()));
    let cubins = out.join("cubin");
    let o = Command::new(env!("CARGO_BIN_EXE_minikv-kernels-check"))
        .env("LD_LIBRARY_PATH", tools.join("lib"))
        .arg("--ptxas")
        .arg(tools.join("bin/ptxas"))
        .arg("--out")
        .arg(&out)
        .arg("--cubin-out")
        .arg(&cubins)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for arch in minikv_kernels::nvrtc::ARCHS {
        for k in minikv_kernels::nvrtc::KERNELS {
            let e = &r[arch][k];
            let regs = e["registers"]
                .as_u64()
                .unwrap_or_else(|| panic!("{arch} {k}: {e}"));
            let limit = if k.contains("_mma") {
                MAX_REGISTERS_MMA
            } else if k == "mk_decode_fast" || k == "mk_decode_staged" {
                MAX_REGISTERS_DECODE
            } else {
                MAX_REGISTERS
            };
            assert!(regs <= limit, "{arch} {k}: {regs} registers");
            let smem = e["shared_bytes"].as_u64().unwrap();
            let smem_limit = if k == "mk_decode_fast" || k == "mk_decode_staged" {
                MAX_SHARED_DECODE
            } else {
                MAX_SHARED
            };
            assert!(
                smem <= smem_limit,
                "{arch} {k}: {smem} bytes of shared memory"
            );
            assert_eq!(e["spill_stores"], 0, "{arch} {k}: {e}");
            assert_eq!(e["spill_loads"], 0, "{arch} {k}: {e}");
            assert!(
                e["stack_bytes"].as_u64().unwrap() <= MAX_STACK,
                "{arch} {k}: {e}"
            );
        }
        assert!(out.join(format!("minikv.{arch}.ptx")).is_file());
    }
    // A CUBIN per architecture, an ELF image under the name the backend
    // looks for; a CUBIN of other source (another hash) is never found.
    use minikv_kernels::nvrtc::{CUBIN_ARCHS, cubin_name, find_cubin};
    for arch in CUBIN_ARCHS {
        let (path, b) = find_cubin(arch, std::slice::from_ref(&cubins))
            .unwrap_or_else(|| panic!("{arch}: no CUBIN in {}", cubins.display()));
        assert!(b.starts_with(b"\x7fELF") && b.len() > 10_000, "{arch}");
        assert_eq!(
            path.file_name().unwrap().to_str().unwrap(),
            cubin_name(arch)
        );
        assert_eq!(r["cubins"][arch]["bytes"], b.len());
    }
    std::fs::rename(
        cubins.join(cubin_name("sm_90")),
        cubins.join("minikv-0000000000000000.sm_90.cubin"),
    )
    .unwrap();
    assert!(find_cubin("sm_90", std::slice::from_ref(&cubins)).is_none());
    // Without the library, compiling is a clear error, never a panic.
    let o = Command::new(env!("CARGO_BIN_EXE_minikv-kernels-check"))
        .env("LD_LIBRARY_PATH", "/nonexistent")
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("libnvrtc"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::remove_dir_all(&out).ok();
}
