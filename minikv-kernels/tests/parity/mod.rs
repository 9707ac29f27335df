//! Parity checks of the CUDA backend on any [`Device`] against minikv's CPU
//! reference: the same checks run under emulation in every `cargo test`
//! (`tests/emulated.rs`) and on a GPU (`examples/gpucheck.rs`). Test code:
//! it is compiled into those two, never into the library, so `minikv-quant`
//! (the CPU reference of the packing) is only a dev-dependency.
//!
//! * prefill outputs and `A_cumul` (GQA, sliding windows, `A_cumul` added to
//!   what is there) against [`ReferenceBackend`] (f64), on both prefill
//!   paths: the scalar f32 kernels within 1e-4 of the largest value, the
//!   tensor-core ones (fp16 operands) within [`TOL_MMA`];
//! * SnapKV window scores (max and average pooling) against the reference
//!   backend's column sums pooled on the host, within the same bounds;
//! * quantization: words equal to [`minikv_quant::quantize_row`] packed by
//!   [`minikv_quant::pack`], scales and minimums equal to its rounded ones,
//!   dequantized rows bit-equal to the CPU store's, at 2/4/8 bits, both
//!   axes, fp16 and f32 scales, appended in several calls across pages;
//! * fused decode over ragged heads (quantized keys and values split
//!   differently, fp16 residuals, extra entries with a logit bias), with
//!   decode-time probabilities, against [`TiledBackend`] over CPU stores
//!   holding the same data, within 1e-4, on each fused kernel a case is
//!   given (`mk_decode_fast` and `mk_decode_staged`), each row also saying
//!   whether its outputs have the same bits as the first kernel's and the
//!   kernel and split size that ran.

#![allow(dead_code)] // each includer uses part of it

use minikv_core::attention::{
    AttentionBackend, DecodeArgs, ExtraView, HeadView, PrefillArgs, ReferenceBackend, TiledBackend,
};
use minikv_core::storage::{FpStore, StorageFactory};
use minikv_core::{Axis, QuantStore, Quantizer, Result};
use minikv_kernels::backend::{CudaBackend, PrefillPath, WindowPooling};
use minikv_kernels::{DecodeKernel, Device};
use minikv_quant::{MinMax, ScaleDtype, pack, quantize_row};
use serde_json::{Value, json};
use std::sync::Arc;

/// Tolerance relative to the largest reference value.
pub const TOL: f32 = 1e-4;
/// Prefill on tensor cores: queries, keys, values and probabilities enter
/// the products as fp16 (relative rounding 2^-11 each), so scores move by
/// about 2^-11 x |q| |k| / sqrt(d) and outputs by the same order relative to
/// the largest value. Measured on these shapes (emulation): outputs at most
/// 6.2e-4, `A_cumul` 1.2e-4, window scores 1.9e-4.
pub const TOL_MMA: f32 = 2e-3;

/// The bound for prefill results of `be` at head dim `d`.
pub fn prefill_tol(be: &CudaBackend, d: usize) -> f32 {
    if be.prefill_on_tensor_cores(d) {
        TOL_MMA
    } else {
        TOL
    }
}

/// Fused decode: the largest output error relative to the largest value
/// magnitude (outputs that cancel to a small fraction of the values, as
/// over thousands of random tokens, are measured on the values' scale).
pub const TOL_V: f32 = 1e-5;

/// Deterministic values in `[-s, s)` (a 64-bit LCG; no dependency).
pub fn rand_vec(seed: &mut u64, n: usize, s: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * s
        })
        .collect()
}

/// Largest `|a - b|` relative to the largest `|b|` (infinite on a length
/// mismatch or a non-finite value).
pub fn max_rel_err(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let e = (x - y).abs() / scale;
            if e.is_finite() { e } else { f32::INFINITY }
        })
        .fold(0.0, f32::max)
}

/// The outcome of the checks.
#[derive(Debug, Default)]
pub struct Report {
    /// One JSON object per check (`check`, `ok`, measured errors).
    pub rows: Vec<Value>,
}

impl Report {
    /// True when every check passed.
    pub fn ok(&self) -> bool {
        self.rows.iter().all(|r| r["ok"] == json!(true))
    }
    fn push(&mut self, ok: bool, mut row: Value) {
        row["ok"] = json!(ok);
        self.rows.push(row);
    }
    /// Runs one group of checks; an error (a failed launch, a copy, a
    /// missing kernel) becomes a failing row that names the group and the
    /// error, and the next group still runs, so one fault does not hide
    /// what else works.
    pub fn stage(&mut self, name: &str, f: impl FnOnce(&mut Self) -> Result<()>) {
        if let Err(e) = f(self) {
            self.push(false, json!({"check": name, "error": e.to_string()}));
        }
    }
}

/// The small prefill cases. Head dims 64 and 128 also run on tensor cores:
/// several row blocks, key counts off the 64-key tile, windows, and rows =
/// keys.
const PREFILL_CASES: [PrefillCase; 6] = [
    (4, 2, 5, 9, 16, 0),
    (6, 2, 40, 170, 64, 0),
    (4, 1, 33, 33, 256, 7),
    (2, 2, 130, 300, 32, 64),
    (4, 2, 70, 200, 128, 50),
    (2, 1, 130, 130, 64, 0),
];

/// Runs every check on `dev` (small shapes: a few blocks per launch).
pub fn run_all(dev: Arc<dyn Device>) -> Result<Report> {
    let scalar = CudaBackend::new(dev.clone()).with_prefill_path(PrefillPath::Scalar);
    let staged = CudaBackend::new(dev.clone()).with_decode_kernel(DecodeKernel::Staged);
    let pipelined = CudaBackend::new(dev.clone()).with_prefill_path(PrefillPath::Pipelined);
    let be = CudaBackend::new(dev);
    let mut r = Report::default();
    let mut seed = 7u64;
    r.stage("prefill", |r| {
        prefill(&[&scalar, &be, &pipelined], &mut seed, r, &PREFILL_CASES)
    });
    r.stage("window scores (scalar)", |r| {
        window_scores(&scalar, &mut seed, r)
    });
    r.stage("window scores", |r| window_scores(&be, &mut seed, r));
    r.stage("window scores (pipelined)", |r| {
        window_scores(&pipelined, &mut seed, r)
    });
    r.stage("quantization", |r| quantization(&be, &mut seed, r));
    decode_stages(&be, &staged, &mut seed, &mut r);
    Ok(r)
}

/// The checks of [`run_all`] whose kernels fill shared memory by
/// asynchronous copies: the fused decode on both fused kernels and the
/// small prefill cases on the pipelined path (for a slow checker such as
/// compute-sanitizer's racecheck).
pub fn run_staged(dev: Arc<dyn Device>) -> Result<Report> {
    let staged = CudaBackend::new(dev.clone()).with_decode_kernel(DecodeKernel::Staged);
    let pipelined = CudaBackend::new(dev.clone()).with_prefill_path(PrefillPath::Pipelined);
    let be = CudaBackend::new(dev);
    let mut r = Report::default();
    let mut seed = 7u64;
    decode_stages(&be, &staged, &mut seed, &mut r);
    r.stage("prefill", |r| {
        prefill(&[&pipelined], &mut seed, r, &PREFILL_CASES)
    });
    Ok(r)
}

/// The small fused decode cases on `be` (the fast kernel) and `staged`.
fn decode_stages(be: &CudaBackend, staged: &CudaBackend, seed: &mut u64, r: &mut Report) {
    r.stage("decode", |r| {
        decode(&[be, staged], seed, r, small_decode_cases())
    });
    // f32 scales and key scale groups of 32 tokens (another scale load, a
    // group spanning two key tiles), at d = 64 and at d = 16 (two channels
    // per lane), 2- and 8-bit.
    r.stage("decode (f32 scales)", |r| {
        let cases = vec![
            (
                64,
                8,
                vec![(200, 160, 190, 2), (75, 64, 70, 0)],
                2,
                Axis::Channel,
            ),
            (16, 4, vec![(130, 96, 128, 1)], 8, Axis::Channel),
        ];
        decode_scaled(&[be, staged], seed, r, cases, 32, ScaleDtype::F32)
    });
    // Key scale groups of 128 tokens, longer than the 32-token splits a
    // short cache gets: a split reads part of one group.
    r.stage("decode (key groups of 128)", |r| {
        let cases = vec![(64, 4, vec![(600, 512, 590, 1)], 2, Axis::Channel)];
        decode_scaled(&[be, staged], seed, r, cases, 128, ScaleDtype::F16)
    });
    r.stage("decode (int8 keys)", |r| {
        let cases = vec![
            (
                64,
                8,
                vec![(300, 288, 299, 3), (700, 640, 690, 0)],
                2,
                Axis::Channel,
            ),
            (32, 4, vec![(530, 512, 500, 2)], 4, Axis::Channel),
            (16, 6, vec![(90, 80, 70, 1)], 2, Axis::Channel),
            (128, 4, vec![(600, 592, 580, 0)], 4, Axis::Channel),
            // Four tokens a lane at d = 256 (eight elsewhere).
            (256, 3, vec![(300, 288, 280, 2)], 2, Axis::Channel),
        ];
        decode_int8(&[be, staged], seed, r, cases)
    });
}

/// The checks at a real model's shapes: 32 query and 8 KV heads of
/// dimension 128, `tokens` keys (many waves of blocks, offsets past 2^27
/// elements): the last rows of a long prefill with `A_cumul`, and fused
/// 2-bit decode over ragged heads, the longest `tokens` long.
/// The prefill runs on `paths` (the tensor-core one at this shape means
/// millions of warp-wide products: hours under the emulation).
pub fn run_large(dev: Arc<dyn Device>, tokens: usize, paths: &[PrefillPath]) -> Result<Report> {
    let be = CudaBackend::new(dev.clone());
    let staged = CudaBackend::new(dev.clone()).with_decode_kernel(DecodeKernel::Staged);
    let mut r = Report::default();
    let mut seed = 17u64;
    let on: Vec<CudaBackend> = paths
        .iter()
        .map(|&p| CudaBackend::new(dev.clone()).with_prefill_path(p))
        .collect();
    let on: Vec<&CudaBackend> = on.iter().collect();
    r.stage("prefill (large)", |r| {
        prefill(&on, &mut seed, r, &[(32, 8, 4, tokens, 128, 0)])
    });
    let heads: Vec<(usize, usize, usize, usize)> = (0..8)
        .map(|i| {
            // Ragged: the longest head holds `tokens`, the others less; a
            // residual of up to 127 rows, extra entries on two heads.
            let len = tokens - i * tokens / 11;
            let nq = (len - 1 - (i * 37) % 127) / 16 * 16;
            (len, nq, nq, if i % 4 == 1 { 3 } else { 0 })
        })
        .collect();
    // One KV head of a third of the tokens: its splits shrink to 32 tokens
    // to fill the grid, some 340 splits at 32K tokens, which the
    // combination takes with its most split lanes (32 warps a block).
    let lone = tokens / 3;
    let lone_q = lone.saturating_sub(40) / 16 * 16;
    r.stage("decode (large)", |r| {
        decode(
            &[&be, &staged],
            &mut seed,
            r,
            vec![
                (128, 32, heads.clone(), 2, Axis::Channel),
                (128, 32, heads, 4, Axis::Channel),
                (128, 4, vec![(lone, lone_q, lone_q, 0)], 2, Axis::Channel),
            ],
        )
    });
    Ok(r)
}

/// (query heads, KV heads, rows, keys, head dim, window).
type PrefillCase = (usize, usize, usize, usize, usize, usize);

/// Each case on each backend of `on` (a backend whose path at that head dim
/// is another's is skipped: the scalar kernels run once).
fn prefill(
    on: &[&CudaBackend],
    seed: &mut u64,
    r: &mut Report,
    cases: &[PrefillCase],
) -> Result<()> {
    for &(hq, hkv, n, t, d, window) in cases {
        let q = rand_vec(seed, hq * n * d, 2.0);
        let k = rand_vec(seed, hkv * t * d, 2.0);
        let v = rand_vec(seed, hkv * t * d, 1.0);
        let start = rand_vec(seed, hq * t, 1.0);
        let keys: Vec<&[f32]> = k.chunks(t * d).collect();
        let vals: Vec<&[f32]> = v.chunks(t * d).collect();
        let run = |b: &dyn AttentionBackend| -> Result<(Vec<f32>, Vec<f32>)> {
            let mut out = vec![0.0f32; q.len()];
            let mut cu = start.clone();
            b.prefill(PrefillArgs {
                n_q_heads: hq,
                head_dim: d,
                q: &q,
                n,
                keys: &keys,
                values: &vals,
                t,
                out: &mut out,
                cumulative: Some(&mut cu),
                window: (window > 0).then_some(window),
                history: None,
            })?;
            Ok((out, cu))
        };
        let (ro, rc) = run(&ReferenceBackend)?;
        let mut seen = Vec::new();
        // The plain tensor-core results, which the pipelined kernels must
        // match bit for bit (the same products in the same order).
        let mut plain: Option<(Vec<f32>, Vec<f32>)> = None;
        for be in on {
            let path = path_name(be, d);
            if seen.contains(&path) {
                continue;
            }
            seen.push(path);
            let (go, gc) = run(*be)?;
            let (eo, ec) = (max_rel_err(&go, &ro), max_rel_err(&gc, &rc));
            let tol = prefill_tol(be, d);
            let mut row = json!({"check": "prefill + A_cumul", "path": path, "hq": hq,
                   "hkv": hkv, "n": n, "t": t, "d": d, "window": window,
                   "out_err": eo, "cumul_err": ec, "tol": tol});
            if path == PIPELINED {
                row["same_bits_as_tensor_cores"] = json!(plain.as_ref().map(|(po, pc)| raw_bits(
                    &go
                )
                    == raw_bits(po)
                    && raw_bits(&gc) == raw_bits(pc)));
            } else if path == "tensor cores" {
                plain = Some((go, gc));
            }
            r.push(eo <= tol && ec <= tol, row);
        }
    }
    Ok(())
}

/// The pipelined tensor-core prefill's name in the report.
pub const PIPELINED: &str = "tensor cores, pipelined";

/// The kernels `be` runs prefill with head dim `d` on.
fn path_name(be: &CudaBackend, d: usize) -> &'static str {
    match (be.prefill_on_tensor_cores(d), be.prefill_path()) {
        (false, _) => "scalar",
        (true, PrefillPath::Pipelined) => PIPELINED,
        (true, _) => "tensor cores",
    }
}

/// Pooling with `same` padding (max: -inf padding; average: zeros counted).
fn pool(x: &[f32], kernel: usize, max: bool) -> Vec<f32> {
    let rad = kernel / 2;
    (0..x.len())
        .map(|j| {
            let (lo, hi) = (j.saturating_sub(rad), (j + rad).min(x.len() - 1));
            let w = &x[lo..=hi];
            if max {
                w.iter().copied().fold(f32::NEG_INFINITY, f32::max)
            } else {
                w.iter().sum::<f32>() / kernel as f32
            }
        })
        .collect()
}

/// The reference backend's column sums `[Hq][t]` of the softmax of the last
/// `w` queries `q_window [Hq][w][d]` over keys `[Hkv][t][d]` (SnapKV's
/// window scores before pooling).
pub fn reference_column_sums(
    q_window: &[f32],
    keys: &[&[f32]],
    d: usize,
    t: usize,
    w: usize,
) -> Result<Vec<f32>> {
    let hq = q_window.len() / (w * d);
    let mut out = vec![0.0f32; q_window.len()];
    let mut cu = vec![0.0f32; hq * t];
    ReferenceBackend.prefill(PrefillArgs {
        n_q_heads: hq,
        head_dim: d,
        q: q_window,
        n: w,
        keys,
        values: keys,
        t,
        out: &mut out,
        cumulative: Some(&mut cu),
        window: None,
        history: None,
    })?;
    Ok(cu)
}

/// Window scores of two shapes on `be`; a tensor-core backend skips the
/// head dims it hands to the scalar kernels (the scalar backend's run has
/// those rows already).
fn window_scores(be: &CudaBackend, seed: &mut u64, r: &mut Report) -> Result<()> {
    for (hq, hkv, t, d, w, kernel, max) in [
        (4usize, 2usize, 100usize, 32usize, 8usize, 5usize, true),
        (3, 1, 300, 64, 32, 7, false),
    ] {
        if be.prefill_path() != PrefillPath::Scalar && !be.prefill_on_tensor_cores(d) {
            continue;
        }
        let qw = rand_vec(seed, hq * w * d, 2.0);
        let k = rand_vec(seed, hkv * t * d, 2.0);
        let keys: Vec<&[f32]> = k.chunks(t * d).collect();
        let got = be.window_scores(&qw, &keys, d, t, w, WindowPooling { kernel, max })?;
        let cu = reference_column_sums(&qw, &keys, d, t, w)?;
        let p = t - w;
        let want: Vec<f32> = (0..hq)
            .flat_map(|h| pool(&cu[h * t..h * t + p], kernel, max))
            .collect();
        let e = max_rel_err(&got, &want);
        let tol = prefill_tol(be, d);
        r.push(
            e <= tol,
            json!({"check": "window scores", "path": path_name(be, d), "hq": hq, "t": t, "d": d, "w": w, "kernel": kernel,
                   "pooling": if max { "max" } else { "avg" }, "err": e}),
        );
    }
    Ok(())
}

fn quantization(be: &CudaBackend, seed: &mut u64, r: &mut Report) -> Result<()> {
    for (bits, group, axis, dtype, d) in [
        (2u32, 16usize, Axis::Channel, ScaleDtype::F16, 32usize),
        (4, 32, Axis::Channel, ScaleDtype::F16, 64),
        (2, 8, Axis::Channel, ScaleDtype::F32, 16),
        (8, 16, Axis::Channel, ScaleDtype::F16, 8),
        (2, 16, Axis::Token, ScaleDtype::F16, 32),
        (4, 32, Axis::Token, ScaleDtype::F32, 64),
        (8, 8, Axis::Token, ScaleDtype::F16, 16),
    ] {
        let q = MinMax {
            bits,
            group,
            axis,
            scale_dtype: dtype,
            arithmetic: Default::default(),
        };
        let gran = q.token_granularity();
        let mut dev = be.storage().quant_store(&q, d, 2 * gran)?;
        let mut cpu = q.new_store(d, 2 * gran)?;
        // Appends of 1, 3 and 2 granules cross page boundaries.
        let mut all = Vec::new();
        for m in [1usize, 3, 2] {
            let rows = rand_vec(seed, m * gran * d, 3.0);
            dev.append(&rows)?;
            cpu.append(&rows)?;
            all.extend(rows);
        }
        let n = all.len() / d;
        let dq = dev
            .as_any()
            .downcast_ref::<minikv_kernels::DeviceQuantStore>()
            .expect("a device store");
        let words = dq.words()?;
        let (scales, mins) = dq.scales_and_mins()?;
        let p = 32 / bits as usize;
        let (mut want_w, mut want_s, mut want_m) = (Vec::new(), Vec::new(), Vec::new());
        match axis {
            Axis::Channel => {
                want_w = vec![0u32; n.div_ceil(p) * d];
                want_s = vec![0.0f32; n / group * d];
                want_m = want_s.clone();
                for gi in 0..n / group {
                    for c in 0..d {
                        let col: Vec<f32> =
                            (0..group).map(|i| all[(gi * group + i) * d + c]).collect();
                        let z = quantize_row(&col, bits, group, dtype)?;
                        want_s[gi * d + c] = dtype.round(z.scale[0]);
                        want_m[gi * d + c] = dtype.round(z.min[0]);
                        for (i, &code) in z.codes.iter().enumerate() {
                            let tk = gi * group + i;
                            want_w[(tk / p) * d + c] |= (code as u32) << (bits as usize * (tk % p));
                        }
                    }
                }
            }
            Axis::Token => {
                for row in all.chunks(d) {
                    let z = quantize_row(row, bits, group, dtype)?;
                    want_w.extend(pack(&z.codes, bits));
                    want_s.extend(z.scale.iter().map(|&x| dtype.round(x)));
                    want_m.extend(z.min.iter().map(|&x| dtype.round(x)));
                }
            }
        }
        let mut a = vec![0.0f32; n * d];
        let mut b = vec![0.0f32; n * d];
        dev.dequantize(&mut a);
        cpu.dequantize(&mut b);
        let bits_eq = |x: &[f32], y: &[f32]| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        };
        let ok_w = words == want_w;
        let ok_s = bits_eq(&scales, &want_s) && bits_eq(&mins, &want_m);
        let ok_d = bits_eq(&a, &b);
        let used = dev.used_bytes() == cpu.used_bytes();
        r.push(
            ok_w && ok_s && ok_d && used,
            json!({"check": "quantize and pack", "bits": bits, "group": group,
                   "axis": format!("{axis:?}"), "scales": format!("{dtype:?}"), "d": d, "tokens": n,
                   "words_equal": ok_w, "scales_equal": ok_s, "dequantized_equal": ok_d,
                   "used_bytes_equal": used, "device_bytes": dev.bytes().codes + dev.bytes().scales}),
        );
    }
    Ok(())
}

/// One head's stores built by a storage factory.
struct Stores {
    qk: Option<Box<dyn QuantStore>>,
    qv: Option<Box<dyn QuantStore>>,
    fk: Box<dyn FpStore>,
    fv: Box<dyn FpStore>,
    ek: Box<dyn FpStore>,
    ev: Box<dyn FpStore>,
    bias: Vec<f32>,
}

struct HeadData {
    nqk: usize,
    nqv: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    ek: Vec<f32>,
    ev: Vec<f32>,
    bias: Vec<f32>,
}

fn build(
    st: &dyn StorageFactory,
    h: &HeadData,
    kq: &MinMax,
    vq: &MinMax,
    d: usize,
) -> Result<Stores> {
    let mut s = Stores {
        qk: None,
        qv: None,
        fk: st.fp_store(d, 64),
        fv: st.fp_store(d, 64),
        ek: st.fp_store(d, 1),
        ev: st.fp_store(d, 1),
        bias: h.bias.clone(),
    };
    if h.nqk > 0 {
        let mut z = st.quant_store(kq, d, 64)?;
        z.append(&h.k[..h.nqk * d])?;
        s.qk = Some(z);
    }
    if h.nqv > 0 {
        let mut z = st.quant_store(vq, d, 64)?;
        z.append(&h.v[..h.nqv * d])?;
        s.qv = Some(z);
    }
    s.fk.push(&h.k[h.nqk * d..]);
    s.fv.push(&h.v[h.nqv * d..]);
    s.ek.push(&h.ek);
    s.ev.push(&h.ev);
    Ok(s)
}

fn views(s: &[Stores]) -> Vec<HeadView<'_>> {
    s.iter()
        .map(|x| HeadView {
            quant_keys: x.qk.as_deref(),
            quant_values: x.qv.as_deref(),
            fp_keys: x.fk.as_ref(),
            fp_values: x.fv.as_ref(),
            extra: (!x.bias.is_empty()).then_some(ExtraView {
                keys: x.ek.as_ref(),
                values: x.ev.as_ref(),
                bias: &x.bias,
                gate: None,
            }),
        })
        .collect()
}

/// (head dim, query heads, per head: (len, quantized keys, quantized
/// values, extra entries), bits, key axis).
type DecodeCase = (usize, usize, Vec<(usize, usize, usize, usize)>, u32, Axis);

fn small_decode_cases() -> Vec<DecodeCase> {
    vec![
        (
            64,
            6,
            vec![(300, 288, 299, 3), (40, 32, 40, 0), (700, 640, 690, 5)],
            2,
            Axis::Channel,
        ),
        (
            32,
            4,
            vec![(17, 0, 0, 0), (530, 512, 500, 2)],
            4,
            Axis::Channel,
        ),
        (128, 2, vec![(260, 256, 256, 1)], 2, Axis::Token),
        // Five query heads per KV head (two blocks of the fast kernel per
        // head, the second one partly used) at d = 16; three at d = 256
        // with 8-bit codes.
        (
            16,
            10,
            vec![(90, 80, 70, 1), (33, 16, 20, 0)],
            4,
            Axis::Channel,
        ),
        (256, 3, vec![(300, 288, 280, 2)], 8, Axis::Channel),
        // A head with no token and no extra entry (its output is 0).
        (
            64,
            4,
            vec![(0, 0, 0, 0), (100, 96, 90, 0)],
            2,
            Axis::Channel,
        ),
    ]
}

fn decode(
    bes: &[&CudaBackend],
    seed: &mut u64,
    r: &mut Report,
    cases: Vec<DecodeCase>,
) -> Result<()> {
    decode_scaled(bes, seed, r, cases, 16, ScaleDtype::F16)
}

/// [`decode`] with keys quantized in scale groups of `key_group` tokens and
/// scales (keys and values) stored as `dtype`: a row per case and backend.
fn decode_scaled(
    bes: &[&CudaBackend],
    seed: &mut u64,
    r: &mut Report,
    cases: Vec<DecodeCase>,
    key_group: usize,
    dtype: ScaleDtype,
) -> Result<()> {
    for (d, hq, heads, bits, kaxis) in cases {
        let kq = MinMax {
            bits,
            group: key_group,
            axis: kaxis,
            scale_dtype: dtype,
            arithmetic: Default::default(),
        };
        let vq = MinMax {
            bits,
            group: 16,
            axis: Axis::Token,
            scale_dtype: dtype,
            arithmetic: Default::default(),
        };
        let data = case_data(seed, d, &heads);
        let q = rand_vec(seed, hq * d, 2.0);
        let run = |b: &dyn AttentionBackend| run_decode(b, &data, &kq, &vq, &q, d);
        let (ro, rp) = run(&TiledBackend::default())?;
        // An output is a convex combination of values: with many tokens it
        // cancels to a small fraction of them, and its rounding error is
        // then measured against the values' scale (`TOL_V`).
        let vmax = values_scale(&data);
        let tokens = heads.iter().map(|h| h.0).max().unwrap_or(0);
        let mut first: Option<Vec<f32>> = None;
        for be in bes {
            let (go, gp) = run(*be)?;
            let plan = be.last_decode_plan();
            let eo = max_rel_err(&go, &ro);
            let ep = probs_err(&gp, &rp);
            let ev = max_abs_err(&go, &ro) / vmax;
            let finite = go.iter().all(|x| x.is_finite());
            let same_bits = first
                .as_deref()
                .is_none_or(|f| raw_bits(f) == raw_bits(&go));
            r.push(
                (eo <= TOL || ev <= TOL_V) && ep <= TOL && finite,
                json!({"check": "fused decode", "kernel": be.decode_kernel().name(), "d": d,
                       "hq": hq, "heads": heads.len(), "bits": bits, "key_group": key_group,
                       "scales": format!("{dtype:?}"), "tokens": tokens,
                       "key_axis": format!("{kaxis:?}"), "out_err": eo, "out_err_of_values": ev,
                       "probs_err": ep, "finite": finite, "same_bits_as_first": same_bits,
                       "launched": plan.map(|p| p.kernel), "split": plan.map(|p| p.chunk),
                       "splits": plan.map(|p| p.splits)}),
            );
            first.get_or_insert(go);
        }
    }
    Ok(())
}

/// Random data of a decode case's heads: (len, quantized keys, quantized
/// values, extra entries) each.
fn case_data(seed: &mut u64, d: usize, heads: &[(usize, usize, usize, usize)]) -> Vec<HeadData> {
    heads
        .iter()
        .map(|&(len, nqk, nqv, ne)| HeadData {
            nqk,
            nqv,
            k: rand_vec(seed, len * d, 2.0),
            v: rand_vec(seed, len * d, 1.0),
            ek: rand_vec(seed, ne * d, 2.0),
            ev: rand_vec(seed, ne * d, 1.0),
            bias: rand_vec(seed, ne, 1.0),
        })
        .collect()
}

/// One fused decode of query `q` over `data` stored by `b`'s storage with
/// quantizers `kq` and `vq`: outputs and decode-time probabilities.
fn run_decode(
    b: &dyn AttentionBackend,
    data: &[HeadData],
    kq: &MinMax,
    vq: &MinMax,
    q: &[f32],
    d: usize,
) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
    let hq = q.len() / d;
    let stores = data
        .iter()
        .map(|h| build(b.storage(), h, kq, vq, d))
        .collect::<Result<Vec<_>>>()?;
    let v = views(&stores);
    let mut out = vec![0.0f32; hq * d];
    let mut probs = vec![Vec::new(); hq];
    b.decode(DecodeArgs {
        q,
        heads: &v,
        head_dim: d,
        out: &mut out,
        probs: Some(&mut probs),
    })?;
    Ok((out, probs))
}

/// Fused decode with `arithmetic = "int8"` (integer key products, f32
/// values: docs/algorithms.md §1) on each of `bes`, per case: the CPU's
/// integer kernels round at other points (a query step per segment of up to
/// 4096 tokens where the GPU takes one per split, the value weights to 8
/// bits as well), so the two are compared through their distance to exact
/// arithmetic on the same stores: the GPU's output error (of the values'
/// scale) and probability error must stay within twice the CPU's plus
/// 1e-4. The GPU's outputs must differ from its own exact ones (the
/// integer path ran).
fn decode_int8(
    bes: &[&CudaBackend],
    seed: &mut u64,
    r: &mut Report,
    cases: Vec<DecodeCase>,
) -> Result<()> {
    use minikv_quant::Arithmetic;
    for (d, hq, heads, bits, kaxis) in cases {
        let quant = |group, axis, arithmetic| MinMax {
            bits,
            group,
            axis,
            scale_dtype: ScaleDtype::F16,
            arithmetic,
        };
        let (kx, vx) = (
            quant(16, kaxis, Arithmetic::Exact),
            quant(16, Axis::Token, Arithmetic::Exact),
        );
        let (k8, v8) = (
            quant(16, kaxis, Arithmetic::Int8),
            quant(16, Axis::Token, Arithmetic::Int8),
        );
        let data = case_data(seed, d, &heads);
        let q = rand_vec(seed, hq * d, 2.0);
        let cpu = TiledBackend::default();
        let (xo, xp) = run_decode(&cpu, &data, &kx, &vx, &q, d)?;
        let (co, cp) = run_decode(&cpu, &data, &k8, &v8, &q, d)?;
        let vmax = values_scale(&data);
        let errs = |o: &[f32], p: &[Vec<f32>]| (max_abs_err(o, &xo) / vmax, probs_err(p, &xp));
        let (cpu_eo, cpu_ep) = errs(&co, &cp);
        let mut first: Option<Vec<f32>> = None;
        for be in bes {
            let (go, gp) = run_decode(*be, &data, &k8, &v8, &q, d)?;
            let (gx, _) = run_decode(*be, &data, &kx, &vx, &q, d)?;
            let (eo, ep) = errs(&go, &gp);
            let finite = go.iter().all(|x| x.is_finite());
            let integer = raw_bits(&go) != raw_bits(&gx);
            let same_bits = first
                .as_deref()
                .is_none_or(|f| raw_bits(f) == raw_bits(&go));
            // Same bits on every kernel: asserted under the emulation (as
            // for the exact rows), reported on a GPU, where two kernels'
            // float code may be compiled differently.
            r.push(
                eo <= 2.0 * cpu_eo + 1e-4 && ep <= 2.0 * cpu_ep + 1e-4 && finite && integer,
                json!({"check": "fused decode (int8 keys)", "kernel": be.decode_kernel().name(),
                       "d": d, "hq": hq, "heads": heads.len(), "bits": bits,
                       "key_axis": format!("{kaxis:?}"),
                       "out_err_of_values": eo, "probs_err": ep,
                       "cpu_int8_out_err_of_values": cpu_eo, "cpu_int8_probs_err": cpu_ep,
                       "finite": finite, "differs_from_exact": integer,
                       "same_bits_as_first": same_bits,
                       "launched": be.last_decode_plan().map(|p| p.kernel)}),
            );
            first.get_or_insert(go);
        }
    }
    Ok(())
}

/// The largest magnitude of the values of a case (at least 1e-6): an
/// output is a convex combination of them.
fn values_scale(data: &[HeadData]) -> f32 {
    data.iter()
        .flat_map(|h| h.v.iter().chain(&h.ev))
        .fold(0.0f32, |m, x| m.max(x.abs()))
        .max(1e-6)
}

/// The largest absolute difference of `a` and `b`.
fn max_abs_err(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// The largest relative error of the heads' probabilities `a` against `b`.
fn probs_err(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| max_rel_err(x, y))
        .fold(0.0f32, f32::max)
}

/// The bits of `v`, for comparing outputs exactly.
fn raw_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
