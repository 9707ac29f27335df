//! On a machine with an NVIDIA GPU: compiles the kernels with NVRTC for the
//! device, runs them on random inputs and compares with minikv's CPU
//! reference backend: prefill outputs and `A_cumul` (with and without a
//! sliding window), and split-K fused decode over fp16 heads with biased
//! extra entries (tolerance 1e-4 relative to the largest value). Prints one
//! JSON report; exits 1 on a mismatch or when no driver is present
//! (`scripts/gpu-check.sh` runs it). Not run in CI: there is no GPU there.

use cudarc::driver::{CudaContext, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use minikv_core::attention::{
    AttentionBackend, DecodeArgs, ExtraView, HeadView, PrefillArgs, ReferenceBackend,
};
use minikv_core::storage::{Fp16Rows, FpStore};
use serde_json::json;

/// `MkHead` of `minikv.cu` with device pointers (no quantized part here).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MkHeadDev {
    kwords: u64,
    kscale: u64,
    kmin: u64,
    nqk: i32,
    kgroup: i32,
    kbits: i32,
    vwords: u64,
    vscale: u64,
    vmin: u64,
    nqv: i32,
    vgroup: i32,
    vbits: i32,
    vcap: i32,
    fk: u64,
    fv: u64,
    len: i32,
    ek: u64,
    ev: u64,
    ebias: u64,
    n_extra: i32,
}
// SAFETY: plain data with the C layout of `MkHead`.
unsafe impl DeviceRepr for MkHeadDev {}

type R<T> = Result<T, String>;

fn err(e: impl std::fmt::Debug) -> String {
    format!("{e:?}")
}

/// Deterministic pseudo-random values in [-s, s).
fn rand_vec(seed: &mut u64, n: usize, s: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * s
        })
        .collect()
}

fn max_rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / scale)
        .fold(0.0, f32::max)
}

fn main() {
    match run() {
        Ok(ok) => std::process::exit(if ok { 0 } else { 1 }),
        Err(e) => {
            eprintln!("minikv-kernels-gpucheck: {e}");
            std::process::exit(1);
        }
    }
}

fn run() -> R<bool> {
    // SAFETY: only tries to open the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda) found: this check needs an NVIDIA GPU".into());
    }
    let ctx = CudaContext::new(0).map_err(err)?;
    let (major, minor) = ctx.compute_capability().map_err(err)?;
    let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
    let ptx = minikv_kernels::nvrtc::compile_ptx(arch).map_err(|e| e.to_string())?;
    let stream = ctx.default_stream();
    let module = ctx.load_module(Ptx::from_src(ptx)).map_err(err)?;
    let f_fwd = module.load_function("mk_prefill_fwd").map_err(err)?;
    let f_cols = module.load_function("mk_column_sums").map_err(err)?;
    let f_part = module.load_function("mk_decode_partial").map_err(err)?;
    let f_comb = module.load_function("mk_decode_combine").map_err(err)?;
    let mut seed = 7u64;
    let mut report = Vec::new();
    let mut ok = true;

    // Prefill + A_cumul against the reference backend.
    for (hq, hkv, n, t, d, window) in [
        (8usize, 2usize, 64usize, 300usize, 64usize, 0usize),
        (4, 1, 100, 100, 256, 32),
    ] {
        let q = rand_vec(&mut seed, hq * n * d, 2.0);
        let k = rand_vec(&mut seed, hkv * t * d, 2.0);
        let v = rand_vec(&mut seed, hkv * t * d, 1.0);
        let scale = 1.0 / (d as f32).sqrt();
        let qd = stream.clone_htod(&q).map_err(err)?;
        let kd = stream.clone_htod(&k).map_err(err)?;
        let vd = stream.clone_htod(&v).map_err(err)?;
        let mut od = stream.alloc_zeros::<f32>(hq * n * d).map_err(err)?;
        let mut ld = stream.alloc_zeros::<f32>(hq * n).map_err(err)?;
        let mut cd = stream.alloc_zeros::<f32>(hq * t).map_err(err)?;
        let (ni, ti, di, gi, wi) = (
            n as i32,
            t as i32,
            d as i32,
            (hq / hkv) as i32,
            window as i32,
        );
        let mut b = stream.launch_builder(&f_fwd);
        b.arg(&qd).arg(&kd).arg(&vd).arg(&mut od).arg(&mut ld);
        b.arg(&ni).arg(&ti).arg(&di).arg(&gi).arg(&scale).arg(&wi);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, hq as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types and buffer sizes match the kernel's signature.
        unsafe { b.launch(cfg) }.map_err(err)?;
        let (i0, i1) = (0i32, ni);
        let mut b = stream.launch_builder(&f_cols);
        b.arg(&qd).arg(&kd).arg(&ld).arg(&mut cd);
        b.arg(&ni)
            .arg(&ti)
            .arg(&di)
            .arg(&gi)
            .arg(&scale)
            .arg(&wi)
            .arg(&i0)
            .arg(&i1);
        let cfg = LaunchConfig {
            grid_dim: (t.div_ceil(128) as u32, hq as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.map_err(err)?;
        let out = stream.clone_dtoh(&od).map_err(err)?;
        let cu = stream.clone_dtoh(&cd).map_err(err)?;
        let mut ro = vec![0.0f32; out.len()];
        let mut rc = vec![0.0f32; cu.len()];
        let keys: Vec<&[f32]> = k.chunks(t * d).collect();
        let vals: Vec<&[f32]> = v.chunks(t * d).collect();
        ReferenceBackend
            .prefill(PrefillArgs {
                n_q_heads: hq,
                head_dim: d,
                q: &q,
                n,
                keys: &keys,
                values: &vals,
                t,
                out: &mut ro,
                cumulative: Some(&mut rc),
                window: (window > 0).then_some(window),
            })
            .map_err(|e| e.to_string())?;
        let (eo, ec) = (max_rel_err(&out, &ro), max_rel_err(&cu, &rc));
        ok &= eo <= 1e-4 && ec <= 1e-4;
        report.push(json!({"check": "prefill", "hq": hq, "hkv": hkv, "n": n, "t": t, "d": d, "window": window,
            "out_err": eo, "cumul_err": ec}));
    }

    // Fused decode over fp16 heads with extra entries.
    let (hq, d, chunk) = (8usize, 128usize, 64i32);
    let lens = [(500usize, 3usize), (130, 0)];
    let q = rand_vec(&mut seed, hq * d, 2.0);
    let mut cpu = Vec::new();
    let mut dev = Vec::new();
    let mut heads = Vec::new();
    for &(len, ne) in &lens {
        let (k, v) = (
            rand_vec(&mut seed, len * d, 2.0),
            rand_vec(&mut seed, len * d, 1.0),
        );
        let (ek, ev) = (
            rand_vec(&mut seed, ne.max(1) * d, 2.0),
            rand_vec(&mut seed, ne.max(1) * d, 1.0),
        );
        let bias = rand_vec(&mut seed, ne.max(1), 1.0);
        let bits = |x: &[f32]| {
            x.iter()
                .map(|&f| half::f16::from_f32(f).to_bits())
                .collect::<Vec<u16>>()
        };
        let (fk, fv, ekd, evd) = (
            stream.clone_htod(&bits(&k)).map_err(err)?,
            stream.clone_htod(&bits(&v)).map_err(err)?,
            stream.clone_htod(&bits(&ek)).map_err(err)?,
            stream.clone_htod(&bits(&ev)).map_err(err)?,
        );
        let bd = stream.clone_htod(&bias).map_err(err)?;
        let ptr = |p: u64| p;
        heads.push(MkHeadDev {
            fk: ptr(fk.device_ptr(&stream).0),
            fv: ptr(fv.device_ptr(&stream).0),
            ek: ptr(ekd.device_ptr(&stream).0),
            ev: ptr(evd.device_ptr(&stream).0),
            ebias: ptr(bd.device_ptr(&stream).0),
            len: len as i32,
            n_extra: ne as i32,
            kbits: 2,
            vbits: 2,
            kgroup: 16,
            vgroup: 16,
            ..Default::default()
        });
        let mut stores = [
            Fp16Rows::new(d, 64),
            Fp16Rows::new(d, 64),
            Fp16Rows::new(d, 64),
            Fp16Rows::new(d, 64),
        ];
        stores[0].push(&k);
        stores[1].push(&v);
        stores[2].push(&ek[..ne * d]);
        stores[3].push(&ev[..ne * d]);
        cpu.push((stores, bias[..ne].to_vec()));
        dev.push((fk, fv, ekd, evd, bd));
    }
    let hd = stream.clone_htod(&heads).map_err(err)?;
    let qd = stream.clone_htod(&q).map_err(err)?;
    let longest = lens.iter().map(|&(l, e)| l + e).max().unwrap_or(1);
    let splits = longest.div_ceil(chunk as usize);
    let mut pm = stream.alloc_zeros::<f32>(hq * splits).map_err(err)?;
    let mut pl = stream.alloc_zeros::<f32>(hq * splits).map_err(err)?;
    let mut pa = stream.alloc_zeros::<f32>(hq * splits * d).map_err(err)?;
    let mut od = stream.alloc_zeros::<f32>(hq * d).map_err(err)?;
    let (di, gi, scale, si) = (
        d as i32,
        (hq / lens.len()) as i32,
        1.0 / (d as f32).sqrt(),
        splits as i32,
    );
    let mut b = stream.launch_builder(&f_part);
    b.arg(&qd)
        .arg(&hd)
        .arg(&di)
        .arg(&gi)
        .arg(&scale)
        .arg(&chunk)
        .arg(&mut pm)
        .arg(&mut pl)
        .arg(&mut pa);
    let cfg = LaunchConfig {
        grid_dim: (splits as u32, hq as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the heads' pointers are alive (`dev`) and sized by their counts.
    unsafe { b.launch(cfg) }.map_err(err)?;
    let mut b = stream.launch_builder(&f_comb);
    b.arg(&pm).arg(&pl).arg(&pa).arg(&si).arg(&di).arg(&mut od);
    let cfg = LaunchConfig {
        grid_dim: (hq as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as above.
    unsafe { b.launch(cfg) }.map_err(err)?;
    let got = stream.clone_dtoh(&od).map_err(err)?;
    let views: Vec<HeadView<'_>> = cpu
        .iter()
        .map(|(s, bias)| HeadView {
            quant_keys: None,
            quant_values: None,
            fp_keys: &s[0],
            fp_values: &s[1],
            extra: (!bias.is_empty()).then_some(ExtraView {
                keys: &s[2],
                values: &s[3],
                bias,
                gate: None,
            }),
        })
        .collect();
    let mut want = vec![0.0f32; hq * d];
    ReferenceBackend
        .decode(DecodeArgs {
            q: &q,
            heads: &views,
            head_dim: d,
            out: &mut want,
            probs: None,
        })
        .map_err(|e| e.to_string())?;
    let e = max_rel_err(&got, &want);
    ok &= e <= 1e-4;
    report.push(json!({"check": "decode", "hq": hq, "d": d, "heads": lens.len(), "splits": splits, "err": e}));
    drop(dev);
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({"device": arch, "ok": ok, "checks": report}))
            .expect("json")
    );
    Ok(ok)
}
