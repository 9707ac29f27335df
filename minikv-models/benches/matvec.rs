//! Decode matrix-vector products on the real model's weights (needs
//! `scripts/fetch-assets.sh`): one weight matrix against a batch of `n`
//! inputs (`QMatrix::matvec_rows`, one input per sequence of a batched
//! decode step), f32 and 8-bit activations, for the three shapes that carry
//! a SmolLM2-135M token's bytes: `ffn_up` (1536 x 576, `Q4_1`), `ffn_down`
//! (576 x 1536, `Q4_1`) and the tied output head (49152 x 576, `Q8_0`).
//! Throughput is in inputs per second: at `n = 1` it is one sequence's rate
//! for that matrix; how it grows with `n` is what batching buys. `matmul/*`
//! times the prefill product (`QMatrix::matmul`) of `ffn_up`, `ffn_down`
//! and `attn_k` (192 x 576)
//! for prompt chunks of 16-512 tokens. `kquant/*` times Gemma 3 270M's
//! `Q5_0`, `Q4_K` and `Q6_K` matrices (its `Q4_K_M` file) against one and
//! four inputs, and their prefill product for 16 tokens, and (`q8/n`)
//! against 1, 4 and 16 inputs with 8-bit activations.
//! `cargo bench -p minikv-models --bench matvec`

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use minikv_models::Activations;
use minikv_models::gguf::Gguf;
use minikv_models::matrix::QMatrix;
use std::path::Path;

/// The real model's matrices named by `labels` (`ffn_up`, `ffn_down`,
/// `attn_k`, `head`), with their labels.
fn matrices(labels: &[&'static str]) -> Vec<(&'static str, QMatrix)> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/SmolLM2-135M-Instruct.Q4_1.gguf");
    let g = Gguf::open(&path).expect("run scripts/fetch-assets.sh first");
    let shapes = [
        ("ffn_up", "blk.0.ffn_up.weight", 1536, 576),
        ("ffn_down", "blk.0.ffn_down.weight", 576, 1536),
        ("attn_k", "blk.0.attn_k.weight", 192, 576),
        ("head", "token_embd.weight", 49152, 576),
    ];
    shapes
        .into_iter()
        .filter(|s| labels.contains(&s.0))
        .map(|(label, name, rows, cols)| {
            let m = QMatrix::from_gguf(&g, name, rows, cols).expect("tensor");
            (label, m)
        })
        .collect()
}

/// `len` input values of decode-like magnitude, distinct per sequence.
fn inputs(len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7919 % 1999) as f32 / 999.5 - 1.0) * 0.7)
        .collect()
}

fn bench(c: &mut Criterion) {
    for (label, mut m) in matrices(&["ffn_up", "ffn_down", "head"]) {
        let (rows, cols) = (m.rows, m.cols);
        for act in [Activations::F32, Activations::Q8] {
            m.set_activations(act);
            let mut grp = c.benchmark_group(format!("matvec/{label}/{act:?}"));
            grp.sample_size(20);
            grp.warm_up_time(std::time::Duration::from_millis(300));
            grp.measurement_time(std::time::Duration::from_secs(1));
            for n in [1usize, 2, 3, 4, 6, 8, 16] {
                // Inputs of decode-like magnitude, distinct per sequence.
                let x = inputs(n * cols);
                let sel: Vec<usize> = (0..n).collect();
                let mut y = vec![0.0f32; n * rows];
                grp.throughput(Throughput::Elements(n as u64));
                grp.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
                    b.iter(|| m.matvec_rows(&x, &mut y, &sel))
                });
            }
            grp.finish();
        }
    }
}

/// Prefill products (`QMatrix::matmul`: tiles of weights dequantized, then
/// `sgemm`) for prompt chunks of `n` tokens, in tokens per second.
fn prefill(c: &mut Criterion) {
    for (label, m) in matrices(&["ffn_up", "ffn_down", "attn_k"]) {
        let (rows, cols) = (m.rows, m.cols);
        let mut grp = c.benchmark_group(format!("matmul/{label}"));
        grp.sample_size(10);
        grp.warm_up_time(std::time::Duration::from_millis(300));
        grp.measurement_time(std::time::Duration::from_secs(1));
        for n in [8usize, 16, 32, 64, 128, 512] {
            let x = inputs(n * cols);
            let mut y = vec![0.0f32; n * rows];
            grp.throughput(Throughput::Elements(n as u64));
            grp.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
                b.iter(|| m.matmul(&x, n, &mut y))
            });
        }
        grp.finish();
    }
}

/// Gemma 3 270M's first matrix of each of its types `Q5_0`, `Q4_K` and
/// `Q6_K` (the weights of its decode besides the `Q8_0` head), labelled
/// with type and shape: decode against 1 and 4 inputs, prefill of 16 tokens.
fn kquant(c: &mut Criterion) {
    use minikv_models::blocks::GgmlType;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/gemma-3-270m-q4_k_m.gguf");
    let g = Gguf::open(&path).expect("run scripts/fetch-assets.sh first");
    for ty in [GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        let found = (0..18).find_map(|l| {
            ["attn_q", "attn_output", "ffn_up", "ffn_down"]
                .iter()
                .map(|n| format!("blk.{l}.{n}.weight"))
                .find(|n| g.tensor(n).is_ok_and(|t| t.dtype == ty))
        });
        let name = found.expect("the Q4_K_M file has every type");
        let t = g.tensor(&name).expect("tensor");
        let (cols, rows) = (t.dims[0], t.dims[1]);
        let mut m = QMatrix::from_gguf(&g, &name, rows, cols).expect("tensor");
        let mut grp = c.benchmark_group(format!("kquant/{ty:?}_{rows}x{cols}"));
        grp.sample_size(20);
        grp.warm_up_time(std::time::Duration::from_millis(300));
        grp.measurement_time(std::time::Duration::from_secs(1));
        for n in [1usize, 4, 16] {
            let x = inputs(n * cols);
            let sel: Vec<usize> = (0..n).collect();
            let mut y = vec![0.0f32; n * rows];
            grp.throughput(Throughput::Elements(n as u64));
            if n == 16 {
                grp.bench_function("matmul/16", |b| b.iter(|| m.matmul(&x, n, &mut y)));
            } else {
                grp.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
                    b.iter(|| m.matvec_rows(&x, &mut y, &sel))
                });
            }
        }
        // The same decode products with 8-bit activations (`q8/n`).
        m.set_activations(Activations::Q8);
        for n in [1usize, 4, 16] {
            let x = inputs(n * cols);
            let sel: Vec<usize> = (0..n).collect();
            let mut y = vec![0.0f32; n * rows];
            grp.throughput(Throughput::Elements(n as u64));
            grp.bench_function(format!("q8/{n}"), |b| {
                b.iter(|| m.matvec_rows(&x, &mut y, &sel))
            });
        }
        grp.finish();
    }
}

criterion_group!(benches, bench, prefill, kquant);
criterion_main!(benches);
