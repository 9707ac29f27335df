//! The integer-product kernels alone, one KV head of SmolLM2's shape (d = 64,
//! three query heads, G = 16), 2- and 4-bit codes: key scores and value sums
//! over 2048 tokens, one segment, so that the call runs on the calling
//! thread (longer heads are cut into segments that run on the rayon pool,
//! and a benchmark of those times thread hand-offs as well).
//! `cargo bench -p minikv-quant --bench int8_kernels`

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use minikv_core::{Axis, QuantStore, Quantizer};
use minikv_quant::{Arithmetic, MinMax, ScaleDtype};
use std::hint::black_box;

mod common;
use common::data;

const D: usize = 64;
const G: usize = 3;
const TOKENS: usize = 2048;

fn store(bits: u32, axis: Axis, seed: u32) -> Box<dyn QuantStore> {
    let mut s = MinMax {
        bits,
        group: 16,
        axis,
        scale_dtype: ScaleDtype::F16,
        arithmetic: Arithmetic::Int8,
    }
    .new_store(D, 256)
    .expect("valid quantizer");
    s.append(&data(TOKENS * D, seed)).expect("append");
    s
}

fn bench(c: &mut Criterion) {
    let q = data(G * D, 3);
    // Softmax-like weights: non-negative, small.
    let p: Vec<f32> = data(G * TOKENS, 4)
        .iter()
        .map(|x| (x + 1.0) / 2000.0)
        .collect();
    let mut scores = vec![0.0f32; G * TOKENS];
    let mut out = vec![0.0f32; G * D];
    let mut g = c.benchmark_group("int8_kernels");
    g.throughput(Throughput::Elements(TOKENS as u64));
    for bits in [2u32, 4] {
        let k = store(bits, Axis::Channel, 1);
        let v = store(bits, Axis::Token, 2);
        g.bench_with_input(BenchmarkId::new("keys", bits), &bits, |b, _| {
            b.iter(|| {
                k.scores_range(&q, G, &mut scores, TOKENS, 0..TOKENS);
                black_box(&scores);
            })
        });
        g.bench_with_input(BenchmarkId::new("values", bits), &bits, |b, _| {
            b.iter(|| {
                out.fill(0.0);
                v.accumulate_range(&p, G, TOKENS, &mut out, 0..TOKENS);
                black_box(&out);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
