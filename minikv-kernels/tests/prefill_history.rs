//! Prefill histories on the device (`PrefillArgs::history`), under the CPU
//! emulation: a chunked prefill that names its history gives bitwise the
//! results of whole uploads while uploading only each chunk's new rows, and
//! a release frees the kept rows.

use minikv_core::KvHistory;
use minikv_core::attention::{AttentionBackend, PrefillArgs};
use minikv_kernels::emulated::EmuDevice;
use minikv_kernels::{CudaBackend, PrefillPath};

const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 64;

fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 31 + seed * 17) % 61) as f32 - 30.0) / 25.0)
        .collect()
}

/// One prefill call of the last `n` of `t` rows; returns the output, the
/// `A_cumul` sums and the bytes uploaded.
fn call(
    be: &CudaBackend,
    rows: &[(Vec<f32>, Vec<f32>)],
    t: usize,
    n: usize,
    history: Option<KvHistory>,
) -> (Vec<f32>, Vec<f32>, u64) {
    let keys: Vec<&[f32]> = rows.iter().map(|(k, _)| &k[..t * D]).collect();
    let values: Vec<&[f32]> = rows.iter().map(|(_, v)| &v[..t * D]).collect();
    let q = data(HQ * n * D, t);
    let mut out = vec![0.0f32; HQ * n * D];
    let mut cumul = vec![0.0f32; HQ * t];
    let before = be.calls();
    be.prefill(PrefillArgs {
        n_q_heads: HQ,
        head_dim: D,
        q: &q,
        n,
        keys: &keys,
        values: &values,
        t,
        out: &mut out,
        cumulative: Some(&mut cumul),
        window: None,
        history,
    })
    .unwrap();
    (out, cumul, be.calls().since(&before).upload_bytes)
}

#[test]
fn a_named_history_uploads_only_new_rows_with_the_same_results() {
    for path in [
        PrefillPath::TensorCores,
        PrefillPath::Pipelined,
        PrefillPath::Scalar,
    ] {
        history_on(path);
    }
}

/// The check on one prefill path; the tensor-core kernels take keys and
/// values as fp16 (2 bytes each, uploaded and kept so), the scalar ones as
/// f32.
fn history_on(path: PrefillPath) {
    let total = 150;
    let rows: Vec<(Vec<f32>, Vec<f32>)> = (0..HKV)
        .map(|h| (data(total * D, h), data(total * D, h + 9)))
        .collect();
    let kept_dev = EmuDevice::new();
    let kept = CudaBackend::new(kept_dev.clone()).with_prefill_path(path);
    let whole = CudaBackend::new(EmuDevice::new()).with_prefill_path(path);
    let es = if kept.prefill_on_tensor_cores(D) {
        2
    } else {
        4
    };
    assert_eq!(es == 2, path != PrefillPath::Scalar);
    let h = KvHistory::fresh();
    let mut t = 0;
    for n in [48usize, 40, 62] {
        t += n;
        let (o1, c1, b1) = call(&kept, &rows, t, n, Some(h));
        let (o2, c2, b2) = call(&whole, &rows, t, n, None);
        assert_eq!(o1, o2, "{path:?}: outputs at t = {t}");
        assert_eq!(c1, c2, "{path:?}: A_cumul at t = {t}");
        // The whole upload carries every earlier row again; the history
        // only the chunk's (a batch's copy table aside).
        let earlier = (2 * HKV * (t - n) * D * es) as u64;
        assert!(b2 >= b1 + earlier - 1024, "t = {t}: {b1} vs {b2} bytes");
        // And rows of `es` bytes: queries (f32; fp16 on the pipelined
        // path), A_cumul in, keys and values.
        let qs = if path == PrefillPath::Pipelined { 2 } else { 4 };
        let whole_bytes = (HQ * n * D * qs + HQ * t * 4 + 2 * HKV * t * D * es) as u64;
        assert!(
            (whole_bytes..whole_bytes + 1024).contains(&b2),
            "{path:?}: {b2} bytes uploaded, {whole_bytes} expected"
        );
        assert!(kept.kept_histories() == 1);
    }
    // A shorter call under the same identity (a broken promise) is
    // uploaded whole, not misread.
    let (o1, c1, _) = call(&kept, &rows, 100, 30, Some(h));
    let (o2, c2, _) = call(&whole, &rows, 100, 30, None);
    assert_eq!((o1, c1), (o2, c2));
    // The pipelined path ran its own kernels on the kept rows (they are
    // 16-byte aligned), in each of the four calls.
    for kernel in ["mk_prefill_mma_pipe64", "mk_column_sums_mma_pipe64"] {
        let pipe = kept_dev.launches(kernel);
        assert_eq!(pipe, if path == PrefillPath::Pipelined { 4 } else { 0 });
    }
    kept.release_history(h);
    assert_eq!(kept.kept_histories(), 0);
}

/// `time_prefill_kernels` launches the path's own kernels on the call's
/// operands: the outputs and `A_cumul` (added once to the caller's sums,
/// however many runs) are bitwise those of a prefill call, each kernel ran
/// once untimed and `runs` times timed, and a call without `A_cumul` times
/// the forward kernel only.
#[test]
fn the_kernels_alone_are_timed_on_a_calls_operands() {
    let (t, n, runs) = (130, 70, 2);
    let rows: Vec<(Vec<f32>, Vec<f32>)> = (0..HKV)
        .map(|h| (data(t * D, h + 3), data(t * D, h + 5)))
        .collect();
    let keys: Vec<&[f32]> = rows.iter().map(|(k, _)| &k[..]).collect();
    let values: Vec<&[f32]> = rows.iter().map(|(_, v)| &v[..]).collect();
    let q = data(HQ * n * D, 7);
    for (path, fwd, cols) in [
        (
            PrefillPath::TensorCores,
            "mk_prefill_mma64",
            "mk_column_sums_mma64",
        ),
        (
            PrefillPath::Pipelined,
            "mk_prefill_mma_pipe64",
            "mk_column_sums_mma_pipe64",
        ),
        (PrefillPath::Scalar, "mk_prefill_fwd", "mk_column_sums"),
    ] {
        for window in [None, Some(40)] {
            let kv = (&keys[..], &values[..]);
            let start: Vec<f32> = data(HQ * t, 11);
            let (mut o1, mut c1) = (vec![0.0f32; HQ * n * D], start.clone());
            let (mut o2, mut c2) = (vec![0.0f32; HQ * n * D], start.clone());
            let be = CudaBackend::new(EmuDevice::new()).with_prefill_path(path);
            be.prefill(args(&q, kv, (n, t), window, &mut o1, Some(&mut c1)))
                .unwrap();
            let dev = EmuDevice::new();
            let timer = CudaBackend::new(dev.clone()).with_prefill_path(path);
            let times = timer
                .time_prefill_kernels(args(&q, kv, (n, t), window, &mut o2, Some(&mut c2)), runs)
                .unwrap();
            assert_eq!(o1, o2, "{path:?} {window:?}: outputs");
            assert_eq!(c1, c2, "{path:?} {window:?}: A_cumul");
            assert_eq!(times.forward_kernel, fwd);
            assert_eq!(times.column_sums_kernel, Some(cols));
            assert_eq!(times.runs, runs);
            let secs = [times.forward_seconds, times.column_sums_seconds.unwrap()];
            assert!(secs.iter().all(|s| s.is_finite() && *s > 0.0), "{times:?}");
            assert_eq!(dev.launches(fwd), runs as u64 + 1);
            assert_eq!(dev.launches(cols), runs as u64 + 1);
            // Without A_cumul: the forward kernel only.
            let t2 = timer
                .time_prefill_kernels(args(&q, kv, (n, t), window, &mut o2, None), 1)
                .unwrap();
            assert_eq!(
                (t2.column_sums_kernel, t2.column_sums_seconds),
                (None, None)
            );
            assert_eq!(o1, o2);
            assert_eq!(dev.launches(cols), runs as u64 + 1);
        }
    }
    let be = CudaBackend::new(EmuDevice::new());
    let mut out = vec![0.0f32; HQ * n * D];
    let e = be
        .time_prefill_kernels(args(&q, (&keys, &values), (n, t), None, &mut out, None), 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("runs = 0"), "{e}");
}

/// Prefill arguments without a history: `n` queries at the end of `t` rows.
fn args<'a>(
    q: &'a [f32],
    (keys, values): (&'a [&'a [f32]], &'a [&'a [f32]]),
    (n, t): (usize, usize),
    window: Option<usize>,
    out: &'a mut [f32],
    cumulative: Option<&'a mut [f32]>,
) -> PrefillArgs<'a> {
    PrefillArgs {
        n_q_heads: HQ,
        head_dim: D,
        q,
        n,
        keys,
        values,
        t,
        out,
        cumulative,
        window,
        history: None,
    }
}
