//! The CUDA backend on the CPU emulation of CUDA (`cuda/emulate.h`): the
//! same kernel source, launch geometry, argument lists and device-resident
//! stores as on a GPU, checked against the CPU backend and quantizer
//! (`tests/parity/mod.rs`), then whole caches built on the backend from
//! the repository's presets against the same caches on the CPU.

use half::f16;
use minikv_core::{CacheBuilder, KvCache, ModelSpec, RunConfig};
use minikv_kernels::backend::{PrefillPath, WindowPooling};
use minikv_kernels::device::{Arg, Device, Launch};
use minikv_kernels::emulated::{self, EmuDevice};
mod parity;

use minikv_kernels::{Batched, CudaBackend, DevBuf};
use minikv_policies::scorers::{Pooling, pool1d};
use parity::{max_rel_err, rand_vec};
use rand::{Rng, SeedableRng, rngs::StdRng};
use std::sync::Arc;

#[test]
fn fp16_conversions_are_those_of_half() {
    let mut xs = vec![
        0.0f32, -0.0, 1.0, -2.5, 65504.0, 65520.0, 1e-8, 6.1e-5, 5.96e-8, 2.98e-8, 3.0e-8,
    ];
    xs.extend([
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e10,
        -1e-3,
        0.1,
        1.0 / 3.0,
    ]);
    let mut rng = StdRng::seed_from_u64(1);
    xs.extend(
        (0..20000).map(|_| rng.random_range(-8.0f32..8.0) * 10f32.powi(rng.random_range(-9..5))),
    );
    // Exact ties at every exponent (round half to even).
    xs.extend((0..2048u32).map(|m| f32::from_bits(0x3f80_0000 | (m << 13) | 0x1000)));
    for x in xs {
        let want = f16::from_f32(x).to_bits();
        assert_eq!(emulated::f32_to_f16_bits(x), want, "f32 -> f16 of {x:e}");
        assert_eq!(
            emulated::f16_bits_to_f32(want).to_bits(),
            f16::from_bits(want).to_f32().to_bits()
        );
    }
    assert!(emulated::f16_bits_to_f32(emulated::f32_to_f16_bits(f32::NAN)).is_nan());
}

/// Every parity check of the backend on the emulated device passes.
#[test]
fn the_backend_matches_the_cpu_reference_under_emulation() {
    let dev = EmuDevice::new();
    let r = parity::run_all(dev.clone()).unwrap();
    for row in &r.rows {
        assert_eq!(row["ok"], true, "{row}");
    }
    // prefill 12 (6 cases, 3 of them also on tensor cores and on their
    // pipelined form), window scores 4 (both shapes on the scalar kernels,
    // d = 64 on tensor cores and pipelined), quantization 7, decode 6,
    // decode with f32 scales 2, with key groups of 128 tokens 1 and with
    // int8 key products 5, each on the fast and the staged kernel.
    assert_eq!(r.rows.len(), 51);
    // Keys per token take the general decode kernel (on both backends); the
    // other eight cases the fast one and the staged one (each case decodes
    // once on each), the int8 cases twice (int8, then exact).
    assert_eq!(dev.launches("mk_decode_partial"), 2);
    assert_eq!(dev.launches("mk_decode_fast"), 18);
    assert_eq!(dev.launches("mk_decode_staged"), 18);
    staged_like_fast(&r.rows, &dev);
    let mma = r
        .rows
        .iter()
        .filter(|row| row["path"] == "tensor cores")
        .count();
    assert_eq!(
        mma, 4,
        "the tensor-core prefill ran on every head dim it takes"
    );
    pipelined_like_plain(&r.rows);
    // Its kernels ran (not the plain ones in their place): the prefill
    // cases and window scores at d = 64 and 128, each with `A_cumul`.
    for kernel in ["mk_prefill_mma_pipe", "mk_column_sums_mma_pipe"] {
        let pipe = |d| dev.launches(&format!("{kernel}{d}"));
        assert_eq!((pipe(64), pipe(128)), (3, 1), "{kernel}");
    }
}

/// The pipelined tensor-core prefill ran on every case the plain one did
/// (and its window scores), each with the plain kernel's bits.
fn pipelined_like_plain(rows: &[serde_json::Value]) {
    let pipe: Vec<_> = rows
        .iter()
        .filter(|row| row["path"] == parity::PIPELINED)
        .collect();
    assert_eq!(pipe.len(), 4, "pipelined rows");
    for row in pipe {
        if row["check"] == "prefill + A_cumul" {
            assert_eq!(row["same_bits_as_tensor_cores"], true, "{row}");
        }
    }
}

/// The checks at a model's shapes (32 query / 8 KV heads, d = 128) over
/// 32K tokens: many waves of blocks and large offsets, which the small
/// shapes above never reach. The prefill runs on the scalar kernels here:
/// on tensor cores this shape is about 12 million warp-wide products, hours
/// under the emulation (the GPU check runs both paths at this shape).
#[test]
fn the_backend_matches_the_cpu_reference_at_32k_tokens() {
    let dev = EmuDevice::new();
    let r = parity::run_large(dev.clone(), 32768, &[PrefillPath::Scalar]).unwrap();
    for row in &r.rows {
        assert_eq!(row["ok"], true, "{row}");
    }
    assert_eq!(r.rows.len(), 7);
    // The lone head's rows, fast and staged: past 256 splits, so that the
    // combination ran with its most split lanes (32 warps a block).
    for row in &r.rows[5..] {
        assert!(row["splits"].as_u64().unwrap() > 256, "{row}");
    }
    staged_like_fast(&r.rows, &dev);
}

/// The staged decode kernel computes what the fast one does, in the same
/// order: with the same split size its outputs have the same bits (the
/// host compiler contracts no multiply-add here; on a GPU the two may
/// differ in the last bit and the parity bound is what counts); a smaller
/// split (4-bit codes at 256 tokens do not fit its staging memory) sums in
/// another order, within the parity bound. Some of its blocks on `dev` did
/// stage keys and values (so the copies were exercised, not skipped).
fn staged_like_fast(rows: &[serde_json::Value], dev: &EmuDevice) {
    // A case's rows come in order: the fast kernel's, then the staged one's.
    let pairs: Vec<_> = rows
        .windows(2)
        .filter(|w| w[1]["kernel"] == "staged")
        .collect();
    assert!(!pairs.is_empty());
    for w in pairs {
        let (fast, row) = (&w[0], &w[1]);
        assert_eq!(fast["kernel"], "fast", "{fast}");
        assert_eq!(fast["tokens"], row["tokens"]);
        if row["split"] == fast["split"] {
            assert_eq!(row["same_bits_as_first"], true, "{row}");
        } else {
            assert!(row["split"].as_u64() < fast["split"].as_u64(), "{row}");
        }
    }
    let (keys, values) = dev.staged_blocks();
    assert!(
        keys > 0 && values > 0,
        "staged blocks: {keys} keys, {values} values"
    );
}

/// Every parity check passes on `dev`.
fn all_pass(dev: Arc<EmuDevice>) {
    let r = parity::run_all(dev).unwrap();
    for row in &r.rows {
        assert_eq!(row["ok"], true, "{row}");
    }
}

/// The same checks with every block's threads as OS threads (real
/// concurrency: races that the fibers' fixed order would hide show here).
#[test]
fn the_backend_matches_the_cpu_reference_with_os_threads() {
    all_pass(EmuDevice::with_os_threads());
}

/// The same checks with every block's threads run as fibers from the last
/// to the first: a read of another thread's write that lacks a barrier
/// misses the write in this order or in the default one.
#[test]
fn the_backend_matches_the_cpu_reference_with_reversed_fibers() {
    all_pass(EmuDevice::with_reversed_fibers());
}

/// The same checks with each block's warps in turn, each through a whole
/// phase between two block barriers: a kernel that refills shared memory
/// (the pipelined prefill's next tile, the staged decode's sums) before
/// every warp is done reading it fails here.
#[test]
fn the_backend_matches_the_cpu_reference_with_warps_in_turn() {
    all_pass(EmuDevice::with_warps_in_turn());
}

/// A device that skips one kernel: the checks must notice (they are not
/// vacuous), naming what broke.
#[derive(Debug)]
struct Skipping {
    inner: Arc<EmuDevice>,
    skip: &'static str,
}

impl Device for Skipping {
    fn name(&self) -> String {
        "skipping".into()
    }
    fn alloc(&self, bytes: usize) -> minikv_core::Result<u64> {
        self.inner.alloc(bytes)
    }
    fn free(&self, ptr: u64) {
        self.inner.free(ptr)
    }
    fn upload(&self, dst: u64, src: &[u8]) -> minikv_core::Result<()> {
        self.inner.upload(dst, src)
    }
    fn download(&self, src: u64, dst: &mut [u8]) -> minikv_core::Result<()> {
        self.inner.download(src, dst)
    }
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> minikv_core::Result<()> {
        self.inner.copy(dst, src, bytes)
    }
    fn launch(&self, kernel: &'static str, shape: Launch, args: &[Arg]) -> minikv_core::Result<()> {
        if kernel == self.skip {
            return Ok(());
        }
        self.inner.launch(kernel, shape, args)
    }
}

#[test]
fn the_parity_checks_catch_a_missing_kernel() {
    for (skip, check) in [
        ("mk_column_sums", "prefill + A_cumul"),
        ("mk_column_sums_mma64", "prefill + A_cumul"),
        ("mk_prefill_mma128", "prefill + A_cumul"),
        ("mk_prefill_mma_pipe64", "prefill + A_cumul"),
        ("mk_column_sums_mma_pipe128", "prefill + A_cumul"),
        ("mk_pool1d", "window scores"),
        ("mk_quant_values_token", "quantize and pack"),
        ("mk_decode_combine", "fused decode"),
        ("mk_decode_staged", "fused decode"),
    ] {
        let dev = Arc::new(Skipping {
            inner: EmuDevice::new(),
            skip,
        });
        let r = parity::run_all(dev).unwrap();
        assert!(
            r.rows
                .iter()
                .any(|row| row["check"] == check && row["ok"] == false),
            "skipping {skip} went unnoticed"
        );
    }
}

/// Device buffers check their bounds, and the emulated device checks every
/// copy against its live allocations.
#[test]
fn device_copies_are_bounds_checked() {
    let emu = EmuDevice::new();
    let dev: Arc<dyn Device> = emu.clone();
    let b = DevBuf::zeroed(&dev, 16).unwrap();
    assert!(b.write(8, &[1u32, 2]).is_ok());
    let e = b.write(12, &[1u32, 2]).unwrap_err().to_string();
    assert!(e.contains("past a 16-byte device buffer"), "{e}");
    assert!(dev.upload(b.ptr() + 4096, &[0u8; 4]).is_err());
    assert_eq!(b.to_vec::<u32>(8, 2).unwrap(), [1, 2]);
    let n = emu.allocated();
    drop(b);
    assert_eq!(emu.allocated(), n - 16);
    let e = dev
        .launch(
            "mk_pool1d",
            Launch {
                grid: (1, 1, 1),
                block: (32, 1, 1),
            },
            &[Arg::I32(1)],
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("do not match its parameter list"), "{e}");
}

/// Launches the emulation's self-test kernel (`cuda/emu_host.cpp`) on one
/// block of 64 threads: 16 bytes per thread from `src` to `out` by `order`.
fn selftest(dev: &Arc<dyn Device>, src: u64, out: u64, order: i32) -> minikv_core::Result<()> {
    let launch = Launch {
        grid: (1, 1, 1),
        block: (64, 1, 1),
    };
    dev.launch(
        "mk_emu_selftest_cp",
        launch,
        &[Arg::Ptr(src), Arg::Ptr(out), Arg::I32(order)],
    )
}

/// The emulation's asynchronous copies land at the wait that retires them,
/// not when issued: a read before the wait sees the 0xff fill (so a kernel
/// that forgot its `cp.async.wait_group` fails its parity checks here, as
/// it would race on a GPU), and a thread that never waits fails the launch.
#[test]
fn asynchronous_copies_land_at_their_wait() {
    for os_threads in [false, true] {
        let dev: Arc<dyn Device> = if os_threads {
            EmuDevice::with_os_threads()
        } else {
            EmuDevice::new()
        };
        let src: Vec<u8> = (0..64 * 16).map(|i| (i * 7 % 251) as u8).collect();
        let sb = DevBuf::zeroed(&dev, src.len()).unwrap();
        sb.write(0, &src).unwrap();
        let out = DevBuf::zeroed(&dev, src.len()).unwrap();
        let run = |order: i32| selftest(&dev, sb.ptr(), out.ptr(), order);
        // Waited for, then a barrier: each thread reads its neighbour's bytes.
        run(0).unwrap();
        let got = out.to_vec::<u8>(0, src.len()).unwrap();
        let want: Vec<u8> = (0..64)
            .flat_map(|t| src[((t + 1) % 64) * 16..][..16].to_vec())
            .collect();
        assert_eq!(got, want, "os threads: {os_threads}");
        // Read before the wait: the fill, not the data.
        run(1).unwrap();
        let got = out.to_vec::<u8>(0, src.len()).unwrap();
        assert!(got.iter().all(|&b| b == 0xff), "os threads: {os_threads}");
        // Never waited for: the launch fails and says why.
        let e = run(2).unwrap_err().to_string();
        assert!(e.contains("no wait retired"), "{e}");
    }
}

/// The self-test kernel's output in `order` (3 or 4), launched twice on
/// one device: first with every source byte 1, then 2 (its shared memory
/// keeps what the first launch left).
fn second_launch(dev: &Arc<dyn Device>, order: i32) -> Vec<u8> {
    let out = DevBuf::zeroed(dev, 64 * 16).unwrap();
    for fill in [1u8, 2] {
        let src = DevBuf::zeroed(dev, 64 * 16).unwrap();
        src.write(0, &[fill; 64 * 16]).unwrap();
        selftest(dev, src.ptr(), out.ptr(), order).unwrap();
    }
    out.to_vec::<u8>(0, 64 * 16).unwrap()
}

/// Fibers run first to last between waits by default and last to first on
/// a device made `with_reversed_fibers`: a thread that reads its
/// predecessor's store without a barrier gets it in the first order and
/// misses it in the second.
#[test]
fn fiber_orders_are_first_to_last_and_reversed() {
    for reversed in [false, true] {
        let dev: Arc<dyn Device> = if reversed {
            EmuDevice::with_reversed_fibers()
        } else {
            EmuDevice::new()
        };
        let got = second_launch(&dev, 3);
        // Thread 1's read of thread 0's bytes, in the second launch: the
        // new ones, or (reversed) what an earlier launch left (this test's
        // first, or another test's).
        let seen = got[16..32].iter().all(|&b| b == 2);
        assert_eq!(seen, !reversed, "reversed {reversed}: {:?}", &got[16..32]);
    }
}

/// An `ldmatrix` row that is not 16-byte aligned (a hardware fault) fails
/// the emulated launch with a reason, in fibers and in OS threads.
#[test]
fn a_misaligned_ldmatrix_fails_the_launch() {
    for dev in [EmuDevice::new(), EmuDevice::with_os_threads()] {
        let dev: Arc<dyn Device> = dev;
        let buf = DevBuf::zeroed(&dev, 64 * 16).unwrap();
        let e = selftest(&dev, buf.ptr(), buf.ptr(), 5)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not 16-byte aligned"), "{e}");
        // The next launch on the device is unaffected.
        selftest(&dev, buf.ptr(), buf.ptr(), 0).unwrap();
    }
}

/// With the warps in turn, a warp runs its whole phase before the next one
/// starts: its read of the next warp's shared memory (after a shuffle, but
/// without a block barrier) gets what an earlier launch left, where the
/// default order, which keeps the warps in lockstep, gets the new bytes.
#[test]
fn warps_in_turn_run_a_whole_phase_each() {
    for in_turn in [false, true] {
        let dev: Arc<dyn Device> = if in_turn {
            EmuDevice::with_warps_in_turn()
        } else {
            EmuDevice::new()
        };
        let got = second_launch(&dev, 4);
        // In the second launch, thread 0 reads thread 32's bytes; thread
        // 32 (the last warp) reads thread 0's, which ran before it.
        let seen = got[..16].iter().all(|&b| b == 2);
        assert_eq!(seen, !in_turn, "in turn {in_turn}: {:?}", &got[..16]);
        assert!(got[32 * 16..33 * 16].iter().all(|&b| b == 2));
    }
}

/// A kernel that reads past the end of a device buffer faults at the
/// guard page after it, and with `MINIKV_EMU_GUARD=before` one that reads
/// before its start faults at the guard page before it (each run in a child
/// process, which must die by SIGSEGV), where either would otherwise read
/// a neighbour's bytes unnoticed; an unknown placement is a clear error.
#[test]
fn a_kernel_reading_past_a_buffer_faults() {
    use std::os::unix::process::ExitStatusExt;
    if let Some(side) = std::env::var_os("MINIKV_EMU_GUARD_CHILD") {
        let dev: Arc<dyn Device> = EmuDevice::new();
        let buf = DevBuf::zeroed(&dev, 16 * 63).unwrap();
        let out = DevBuf::zeroed(&dev, 16 * 64).unwrap();
        // 64 threads copy 16 bytes each: from a buffer of 63 x 16 bytes
        // (past its end), or from 16 bytes before its start.
        let src = if side == "before" {
            buf.ptr() - 16
        } else {
            buf.ptr()
        };
        let r = selftest(&dev, src, out.ptr(), 0);
        panic!("the read outside the buffer did not fault: {r:?}");
    }
    for (side, guard) in [("after", None), ("before", Some("before"))] {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "a_kernel_reading_past_a_buffer_faults",
            "--test-threads=1",
        ])
        .env("MINIKV_EMU_GUARD_CHILD", side)
        .env_remove("MINIKV_EMU_GUARD")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
        if let Some(g) = guard {
            cmd.env("MINIKV_EMU_GUARD", g);
        }
        let status = cmd.status().unwrap();
        assert_eq!(status.signal(), Some(11), "{side}: {status:?}");
    }
    // An unknown placement is an error that names it, at the first allocation.
    let o = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_kernel_reading_past_a_buffer_faults",
            "--test-threads=1",
        ])
        .env("MINIKV_EMU_GUARD_CHILD", "after")
        .env("MINIKV_EMU_GUARD", "sideways")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout) + String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.signal().is_none() && !o.status.success(),
        "{:?}",
        o.status
    );
    let named = text.contains("MINIKV_EMU_GUARD=") && text.contains("sideways");
    assert!(named && text.contains("expected after"), "{text}");
}

/// SnapKV window scores on the backend against `minikv-policies`' own
/// pooling of the reference column sums (an implementation independent of
/// the parity module's).
#[test]
fn window_scores_match_the_policies_pooling() {
    let mut seed = 3u64;
    let (hq, hkv, t, d, w, kernel) = (4usize, 2usize, 60usize, 32usize, 8usize, 5usize);
    let be = CudaBackend::new(EmuDevice::new());
    let qw = rand_vec(&mut seed, hq * w * d, 2.0);
    let k = rand_vec(&mut seed, hkv * t * d, 2.0);
    let keys: Vec<&[f32]> = k.chunks(t * d).collect();
    let cu = parity::reference_column_sums(&qw, &keys, d, t, w).unwrap();
    for (max, pooling) in [(true, Pooling::Max), (false, Pooling::Avg)] {
        let got = be
            .window_scores(&qw, &keys, d, t, w, WindowPooling { kernel, max })
            .unwrap();
        let want: Vec<f32> = (0..hq)
            .flat_map(|h| pool1d(&cu[h * t..h * t + t - w], kernel, pooling))
            .collect();
        assert!(max_rel_err(&got, &want) <= 1e-4, "{pooling:?}");
    }
}

fn spec() -> ModelSpec {
    ModelSpec {
        n_layers: 2,
        n_q_heads: 4,
        n_kv_heads: 2,
        head_dim: 32,
        max_seq_len: 4096,
        windows: Vec::new(),
    }
}

/// Prefill in two chunks, the end of prefill, then decode steps; returns
/// every attention output.
fn drive(c: &mut dyn KvCache, t: usize, steps: usize) -> Vec<f32> {
    let s = spec();
    let (hq, hkv, d) = (s.n_q_heads, s.n_kv_heads, s.head_dim);
    let mut rng = StdRng::seed_from_u64(11);
    let mut r = |n: usize, sc: f32| -> Vec<f32> {
        (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0) * sc)
            .collect()
    };
    let mut outs = Vec::new();
    let (a, b) = (t / 3, t);
    let data: Vec<_> = (0..s.n_layers)
        .map(|_| (r(t * hkv * d, 2.0), r(t * hkv * d, 1.0), r(t * hq * d, 2.0)))
        .collect();
    for (lo, hi) in [(0, a), (a, b)] {
        for (l, (k, v, q)) in data.iter().enumerate() {
            let n = hi - lo;
            c.append(
                l,
                &k[lo * hkv * d..hi * hkv * d],
                &v[lo * hkv * d..hi * hkv * d],
                n,
            )
            .unwrap();
            let mut o = vec![0.0f32; n * hq * d];
            c.attend(l, &q[lo * hq * d..hi * hq * d], n, &mut o)
                .unwrap();
            outs.extend(o);
        }
    }
    c.end_prefill().unwrap();
    for _ in 0..steps {
        for l in 0..s.n_layers {
            let (k, v, q) = (r(hkv * d, 2.0), r(hkv * d, 1.0), r(hq * d, 2.0));
            c.append(l, &k, &v, 1).unwrap();
            let mut o = vec![0.0f32; hq * d];
            c.attend(l, &q, 1, &mut o).unwrap();
            outs.extend(o);
        }
    }
    outs
}

/// Whole caches from the repository's presets, built on the emulated CUDA
/// backend and on the CPU: every prefill and decode output within 1e-4,
/// the same tokens held and the same bytes used (device bytes counted).
#[test]
fn presets_on_the_emulated_backend_match_the_cpu() {
    for preset in [
        "full",
        "minikv",
        "minikv-per-token-keys",
        "kivi-2bit",
        "h2o",
        "snapkv-25",
        "tova",
    ] {
        let path = format!("{}/../configs/{preset}.toml", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap();
        let cfg = RunConfig::parse(&text, false).unwrap();
        let mut cpu = CacheBuilder::new(spec()).build(&cfg.cache).unwrap();
        let mut gpu = CacheBuilder::new(spec())
            .named_backend("cuda-emulated")
            .unwrap()
            .build(&cfg.cache)
            .unwrap();
        let (a, b) = (drive(cpu.as_mut(), 96, 24), drive(gpu.as_mut(), 96, 24));
        assert_same_cache(preset, cpu.as_ref(), gpu.as_ref(), &a, &b);
    }
}

/// The two caches' outputs agree within 1e-4 and every head holds the same
/// tokens and bytes (device bytes counted).
fn assert_same_cache(preset: &str, cpu: &dyn KvCache, gpu: &dyn KvCache, a: &[f32], b: &[f32]) {
    let e = max_rel_err(b, a);
    assert!(e <= 1e-4, "{preset}: outputs differ by {e}");
    let (ma, mb) = (cpu.memory(), gpu.memory());
    for (la, lb) in ma.layers.iter().zip(&mb.layers) {
        for (ha, hb) in la.heads.iter().zip(&lb.heads) {
            assert_eq!(ha.tokens, hb.tokens, "{preset}: tokens held");
            assert_eq!(ha.used, hb.used, "{preset}: bytes used");
        }
    }
}

/// What the kernels do not implement is a clear error, not a CPU fallback:
/// ThinK's key-channel subsets (store wrappers) and ResKV's gated summaries.
#[test]
fn unsupported_combinations_are_clear_errors() {
    for (preset, msg) in [
        ("think-snapkv", "not a device store"),
        ("reskv-snapkv", "gated extra entries"),
    ] {
        let e = first_decode_error(preset);
        assert!(e.contains(msg), "{preset}: {e}");
    }
}

fn first_decode_error(preset: &str) -> String {
    let path = format!("{}/../configs/{preset}.toml", env!("CARGO_MANIFEST_DIR"));
    let cfg = RunConfig::parse(&std::fs::read_to_string(path).unwrap(), false).unwrap();
    let mut gpu = CacheBuilder::new(spec())
        .named_backend("cuda-emulated")
        .unwrap()
        .build(&cfg.cache)
        .unwrap();
    let s = spec();
    let (hq, hkv, d, t) = (s.n_q_heads, s.n_kv_heads, s.head_dim, 64);
    let mut seed = 5u64;
    let mut err = None;
    for l in 0..s.n_layers {
        let (k, v, q) = (
            rand_vec(&mut seed, t * hkv * d, 1.0),
            rand_vec(&mut seed, t * hkv * d, 1.0),
            rand_vec(&mut seed, t * hq * d, 1.0),
        );
        gpu.append(l, &k, &v, t).unwrap();
        let mut o = vec![0.0f32; t * hq * d];
        gpu.attend(l, &q, t, &mut o).unwrap();
    }
    gpu.end_prefill().unwrap();
    let (k, v, q) = (
        rand_vec(&mut seed, hkv * d, 1.0),
        rand_vec(&mut seed, hkv * d, 1.0),
        rand_vec(&mut seed, hq * d, 1.0),
    );
    gpu.append(0, &k, &v, 1).unwrap();
    let mut o = vec![0.0f32; hq * d];
    if let Err(e) = gpu.attend(0, &q, 1, &mut o) {
        err = Some(e.to_string());
    }
    err.unwrap_or_else(|| panic!("{preset} on the cuda backend must be refused"))
}

/// A preset with its residual shortened to `r` rows.
fn preset_with_residual(preset: &str, r: usize) -> RunConfig {
    let path = format!("{}/../configs/{preset}.toml", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("residual = 128"), "{preset}");
    let text = text.replace("residual = 128", &format!("residual = {r}"));
    RunConfig::parse(&text, false).unwrap()
}

/// Decode steps on every layer with fresh random rows.
fn steps(c: &mut dyn KvCache, n: usize, seed: u64) -> Vec<f32> {
    let s = spec();
    let (hq, hkv, d) = (s.n_q_heads, s.n_kv_heads, s.head_dim);
    let mut seed = seed;
    let mut outs = Vec::new();
    for _ in 0..n {
        for l in 0..s.n_layers {
            let (k, v, q) = (
                rand_vec(&mut seed, hkv * d, 2.0),
                rand_vec(&mut seed, hkv * d, 1.0),
                rand_vec(&mut seed, hq * d, 2.0),
            );
            c.append(l, &k, &v, 1).unwrap();
            let mut o = vec![0.0f32; hq * d];
            c.attend(l, &q, 1, &mut o).unwrap();
            outs.extend(o);
        }
    }
    outs
}

/// Quantized caches with a 32-row residual on the emulated backend: the
/// device residual ring wraps many times and its rows are quantized on the
/// device straight from the ring; every output matches the CPU's within
/// 1e-4 and the stores hold the same tokens and bytes.
#[test]
fn residual_rings_match_the_cpu() {
    for preset in ["kivi-2bit", "minikv"] {
        let cfg = preset_with_residual(preset, 32);
        let mut cpu = CacheBuilder::new(spec()).build(&cfg.cache).unwrap();
        let mut gpu = CacheBuilder::new(spec())
            .named_backend("cuda-emulated")
            .unwrap()
            .build(&cfg.cache)
            .unwrap();
        let mut a = drive(cpu.as_mut(), 64, 8);
        let mut b = drive(gpu.as_mut(), 64, 8);
        a.extend(steps(cpu.as_mut(), 100, 9));
        b.extend(steps(gpu.as_mut(), 100, 9));
        assert_same_cache(preset, cpu.as_ref(), gpu.as_ref(), &a, &b);
    }
}

/// One decode step of one layer makes a handful of host-device calls, not
/// one per head and row: the rows appended, the head table and the query go
/// up as one copy (plus one scatter launch), the residual is quantized on
/// the device from its ring, and the output comes down in one copy.
#[test]
fn a_decode_step_makes_few_host_device_calls() {
    for (preset, max_sync) in [("minikv", 2.5), ("kivi-2bit", 2.5), ("h2o", 2.5)] {
        let cfg = if preset == "h2o" {
            let path = format!("{}/../configs/h2o.toml", env!("CARGO_MANIFEST_DIR"));
            RunConfig::parse(&std::fs::read_to_string(path).unwrap(), false).unwrap()
        } else {
            preset_with_residual(preset, 32)
        };
        let be = Arc::new(CudaBackend::new(EmuDevice::new()));
        let mut c = CacheBuilder::new(spec())
            .backend(be.clone())
            .build(&cfg.cache)
            .unwrap();
        drive(c.as_mut(), 64, 40);
        let before = be.calls();
        let n = 32;
        steps(c.as_mut(), n, 3);
        let per = be.calls().since(&before);
        let layers = (n * spec().n_layers) as f64;
        let sync = per.synchronous() as f64 / layers;
        eprintln!("{preset}: {per:?} over {layers} layer-steps: {sync:.2} synchronous");
        assert!(
            sync <= max_sync,
            "{preset}: {sync:.2} synchronous calls per layer and step ({per:?})"
        );
    }
}

/// The upload queue keeps every write and copy in order: an entry that
/// overlaps a queued one (either way) lands after it, and disjoint small
/// uploads go up as one copy and one scatter launch.
#[test]
fn queued_uploads_and_copies_land_in_order() {
    let emu = EmuDevice::new();
    let b = Arc::new(Batched::new(emu.clone()));
    let dev: Arc<dyn Device> = b.clone();
    let x = DevBuf::zeroed(&dev, 64).unwrap();
    let c0 = b.calls();
    x.write(0, &[1u32; 4]).unwrap();
    x.write(40, &[9u32; 2]).unwrap();
    x.write(56, &[5u8, 6, 7]).unwrap();
    let c1 = b.calls().since(&c0);
    assert_eq!(c1.synchronous() + c1.launches, 0, "queued: {c1:?}");
    // Overlaps the first write: the queue goes first (the emulator runs a
    // launch's blocks in order, so the flush is checked by its calls).
    x.write(8, &[2u32; 2]).unwrap();
    let c1 = b.calls().since(&c0);
    assert_eq!((c1.uploads, c1.launches), (1, 1), "flushed: {c1:?}");
    // Reads queued bytes, then is overwritten at its source.
    x.copy_from(16, &x, 0, 16).unwrap();
    x.write(0, &[7u32]).unwrap();
    let got: Vec<u32> = x.to_vec(0, 16).unwrap();
    let mut want = [1u32, 1, 2, 2, 1, 1, 2, 2, 0, 0, 9, 9, 0, 0, 0, 0];
    want[0] = 7;
    want[14] = u32::from_le_bytes([5, 6, 7, 0]);
    assert_eq!(got, want);
    // A large upload goes at once.
    let big = DevBuf::zeroed(&dev, 1 << 20).unwrap();
    let c2 = b.calls();
    big.write(0, &vec![3u8; 1 << 20]).unwrap();
    assert_eq!(b.calls().since(&c2).uploads, 1);
    assert!(
        big.to_vec::<u8>(0, 1 << 20)
            .unwrap()
            .iter()
            .all(|&v| v == 3)
    );
    // Three disjoint uploads, then a read: one copy up, one launch.
    let c3 = b.calls();
    for i in 0..3u32 {
        x.write(i as usize * 4, &[i + 10]).unwrap();
    }
    assert_eq!(x.to_vec::<u32>(0, 3).unwrap(), [10, 11, 12]);
    let c = b.calls().since(&c3);
    assert_eq!((c.uploads, c.launches, c.downloads), (1, 1, 1), "{c:?}");
}
