//! On a machine with an NVIDIA GPU: opens device `MINIKV_CUDA_DEVICE`
//! (default 0), compiles the kernels with NVRTC for it, and runs the CUDA
//! backend's parity checks (`tests/parity/mod.rs`: prefill and
//! `A_cumul`, window scores, bit-exact quantization, fused decode with
//! probabilities) against minikv's CPU reference, the same checks that run
//! under emulation in every `cargo test`. Prints one JSON report; exits 1 on
//! a mismatch or when no driver or device is present (`scripts/gpu-check.sh`
//! runs it: `cargo run --release -p minikv-kernels --example gpucheck`).
//! Not run in CI: there is no GPU there.

#[path = "../tests/parity/mod.rs"]
mod parity;

use serde_json::json;

fn main() {
    let run = || -> minikv_core::Result<(String, parity::Report)> {
        let ordinal = std::env::var("MINIKV_CUDA_DEVICE")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        let dev = minikv_kernels::cuda::CudaDevice::open(ordinal)?;
        let name = minikv_kernels::Device::name(dev.as_ref());
        Ok((name, parity::run_all(dev)?))
    };
    match run() {
        Ok((device, r)) => {
            let ok = r.ok();
            let v = json!({"device": device, "ok": ok, "checks": r.rows});
            println!("{}", serde_json::to_string_pretty(&v).expect("json"));
            std::process::exit(if ok { 0 } else { 1 });
        }
        Err(e) => {
            eprintln!("minikv-kernels-gpucheck: {e}");
            std::process::exit(1);
        }
    }
}
