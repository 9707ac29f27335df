//! On a machine with an NVIDIA GPU: opens device `MINIKV_CUDA_DEVICE`
//! (default 0; the kernels from a prebuilt CUBIN for its architecture, else
//! compiled by NVRTC) and runs the CUDA backend's parity checks
//! (`tests/parity/mod.rs`) against minikv's CPU reference: the small shapes
//! that run under emulation in every `cargo test`, then a model's shapes
//! (32 query / 8 KV heads, d = 128) at `GPUCHECK_TOKENS` tokens (default
//! 32768), the prefill on its three paths (tensor cores, their pipelined
//! form, scalar f32). Then it times prefill with `A_cumul` at
//! `GPUCHECK_PREFILL` tokens (default 32768; host transfers included) on
//! each path and reports tokens/s and the attention FLOP rate of each, and
//! on tensor cores the kernels alone, their operands already on the device
//! (what FlashAttention's published figures time). Prints one JSON report
//! with the device's info
//! (driver, image loaded, registers per kernel, memory bandwidth bound);
//! exits 1 on a mismatch or when no driver or device is present
//! (`scripts/gpu-check.sh` runs it). Not run in CI: there is no GPU there;
//! `GPUCHECK_DEVICE=emulated` rehearses it on the CPU emulation.
//! `GPUCHECK_ONLY=staged` runs only the checks of the kernels that fill
//! shared memory by asynchronous copies (the small fused decode cases on
//! both fused kernels, the small prefill cases on the pipelined path), for
//! compute-sanitizer's racecheck, which is too slow for the rest.

#[path = "../tests/parity/mod.rs"]
mod parity;

use minikv_core::attention::{AttentionBackend, PrefillArgs};
use minikv_kernels::{CudaBackend, PrefillPath};
use serde_json::{Value, json};
use std::time::Instant;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(default)
}

/// Causal prefill of `t` tokens with `A_cumul` (32 query / 8 KV heads, d =
/// 128): the best of `reps` runs, after `reps` without `A_cumul` (a
/// warm-up, whose best is reported too: the cost of the `A_cumul` pass is
/// the difference). With `kernels`, also the kernels alone, their operands
/// on the device (`CudaBackend::time_prefill_kernels`, `reps` timed runs
/// each): the time FlashAttention's published figures measure.
fn time_prefill(
    be: &CudaBackend,
    t: usize,
    reps: usize,
    kernels: bool,
) -> minikv_core::Result<Value> {
    let (hq, hkv, d) = (32usize, 8usize, 128usize);
    let mut seed = 99u64;
    let q = parity::rand_vec(&mut seed, hq * t * d, 1.0);
    let k = parity::rand_vec(&mut seed, hkv * t * d, 1.0);
    let v = parity::rand_vec(&mut seed, hkv * t * d, 1.0);
    let keys: Vec<&[f32]> = k.chunks(t * d).collect();
    let vals: Vec<&[f32]> = v.chunks(t * d).collect();
    let mut out = vec![0.0f32; q.len()];
    let mut cu = vec![0.0f32; hq * t];
    let mut best = f64::INFINITY;
    let mut best_plain = f64::INFINITY;
    for cumulative in [false, true] {
        for _ in 0..reps {
            let t0 = Instant::now();
            let cu = cumulative.then_some(&mut cu[..]);
            be.prefill(causal((hq, d, t), &q, (&keys, &vals), &mut out, cu))?;
            let took = t0.elapsed().as_secs_f64();
            if cumulative {
                best = best.min(took);
            } else {
                best_plain = best_plain.min(took);
            }
        }
    }
    // Causal attention: QK^T and PV over half the square, 2 FLOPs per MAC.
    let flops = 2.0 * 2.0 * (t as f64) * (t as f64) / 2.0 * d as f64 * hq as f64;
    let finite = out.iter().all(|x| x.is_finite()) && cu.iter().all(|x| x.is_finite());
    let mut r = json!({"tokens": t, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
              "seconds": best, "tokens_per_s": t as f64 / best,
              "attention_tflop_s": flops / best / 1e12, "finite": finite,
              "seconds_without_cumulative": best_plain,
              "attention_tflop_s_without_cumulative": flops / best_plain / 1e12,
              "includes": "uploads of q (f32; fp16 on the pipelined path) and k/v (fp16 on tensor cores, f32 on the scalar kernels), A_cumul, the output's download"});
    if kernels {
        cu.fill(0.0);
        let args = causal((hq, d, t), &q, (&keys, &vals), &mut out, Some(&mut cu[..]));
        let k = be.time_prefill_kernels(args, reps)?;
        let fwd = k.forward_seconds;
        let both = fwd + k.column_sums_seconds.unwrap_or(0.0);
        // The column sums recompute Q K^T: half the forward's products.
        r["kernels"] = json!({"times": k,
            "forward_tflop_s": flops / fwd / 1e12,
            "with_cumulative_tflop_s": 1.5 * flops / both / 1e12,
            "tokens_per_s": t as f64 / both,
            "share_of_call": both / best,
            "finite": out.iter().all(|x| x.is_finite()) && cu.iter().all(|x| x.is_finite())});
    }
    Ok(r)
}

/// Causal prefill of all `t` rows (`hq` query heads of `d`), no history.
fn causal<'a>(
    (hq, d, t): (usize, usize, usize),
    q: &'a [f32],
    (keys, values): (&'a [&'a [f32]], &'a [&'a [f32]]),
    out: &'a mut [f32],
    cumulative: Option<&'a mut [f32]>,
) -> PrefillArgs<'a> {
    PrefillArgs {
        n_q_heads: hq,
        head_dim: d,
        q,
        n: t,
        keys,
        values,
        t,
        out,
        cumulative,
        window: None,
        history: None,
    }
}

/// Device-to-device copy bandwidth (bytes read plus bytes written per
/// second) over 1 GiB buffers, the best of five copies: the practical
/// ceiling that decode's achieved bandwidth is compared with beside the
/// datasheet bound.
fn copy_bandwidth(dev: &std::sync::Arc<dyn minikv_kernels::Device>) -> minikv_core::Result<Value> {
    let bytes = 1usize << 30;
    let a = minikv_kernels::DevBuf::zeroed(dev, bytes)?;
    let b = minikv_kernels::DevBuf::zeroed(dev, bytes)?;
    let mut sync = [0u8; 4];
    let mut best = f64::INFINITY;
    for i in 0..6 {
        let t0 = Instant::now();
        b.copy_from(0, &a, 0, bytes)?;
        // The copy is asynchronous to the host; a small download waits for it.
        b.read(0, &mut sync)?;
        if i > 0 {
            best = best.min(t0.elapsed().as_secs_f64());
        }
    }
    Ok(json!({"bytes": bytes, "seconds": best, "copy_gb_s": 2.0 * bytes as f64 / best / 1e9}))
}

fn main() {
    let run = || -> minikv_core::Result<Value> {
        // `GPUCHECK_DEVICE=emulated`: the same run on the CPU emulation
        // (a rehearsal of the report without a GPU; use small sizes).
        let (dev, info): (std::sync::Arc<dyn minikv_kernels::Device>, Value) =
            if std::env::var("GPUCHECK_DEVICE").as_deref() == Ok("emulated") {
                let d = minikv_kernels::emulated::EmuDevice::new();
                (d, json!({"emulated": true}))
            } else {
                let d = minikv_kernels::cuda::CudaDevice::open(env_usize("MINIKV_CUDA_DEVICE", 0))?;
                let info = d.info();
                (d, info)
            };
        let name = dev.name();
        if std::env::var("GPUCHECK_ONLY").as_deref() == Ok("staged") {
            let r = parity::run_staged(dev)?;
            return Ok(json!({"device": name, "info": info, "ok": r.ok(), "checks": r.rows}));
        }
        let copy = copy_bandwidth(&dev).unwrap_or_else(|e| json!({"error": e.to_string()}));
        let small = parity::run_all(dev.clone())?;
        let paths = [
            PrefillPath::TensorCores,
            PrefillPath::Pipelined,
            PrefillPath::Scalar,
        ];
        let large = parity::run_large(dev.clone(), env_usize("GPUCHECK_TOKENS", 32768), &paths)?;
        let be = CudaBackend::new(dev.clone());
        let pipelined = CudaBackend::new(dev.clone()).with_prefill_path(PrefillPath::Pipelined);
        let scalar = CudaBackend::new(dev).with_prefill_path(PrefillPath::Scalar);
        let tokens = env_usize("GPUCHECK_PREFILL", 32768);
        // A failed timing is reported in its place (the other path and the
        // parity rows above still count).
        // Four runs each on tensor cores; one on the scalar kernels (10-20 s
        // a run at 32K tokens on an H200: repeats would take two minutes of
        // the check and change nothing).
        // The kernels alone on tensor cores only (the scalar forward takes
        // some 20 s at 32K tokens).
        let timed = |b: &CudaBackend, reps, kernels| {
            time_prefill(b, tokens, reps, kernels)
                .unwrap_or_else(|e| json!({"error": e.to_string()}))
        };
        let prefill = json!({"tensor_cores": timed(&be, 4, true),
                             "tensor_cores_pipelined": timed(&pipelined, 4, true),
                             "scalar": timed(&scalar, 1, false)});
        let ok = small.ok()
            && large.ok()
            && ["tensor_cores", "tensor_cores_pipelined", "scalar"]
                .iter()
                .all(|p| prefill[p]["finite"] == true && prefill[p]["kernels"]["finite"] != false);
        let checks: Vec<Value> = small.rows.into_iter().chain(large.rows).collect();
        Ok(
            json!({"device": name, "info": info, "copy_bandwidth": copy, "ok": ok, "checks": checks,
                  "prefill": prefill, "calls": be.calls()}),
        )
    };
    match run() {
        Ok(v) => {
            println!("{}", serde_json::to_string_pretty(&v).expect("json"));
            std::process::exit(if v["ok"] == true { 0 } else { 1 });
        }
        Err(e) => {
            eprintln!("minikv-kernels-gpucheck: {e}");
            std::process::exit(1);
        }
    }
}
