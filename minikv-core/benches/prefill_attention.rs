//! Prefill attention with `A_cumul`: tiled (flash-style) vs the exact reference.
//! `cargo bench -p minikv-core --bench prefill_attention`

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use minikv_core::attention::{AttentionBackend, PrefillArgs, ReferenceBackend, TiledBackend};
use std::hint::black_box;

fn data(n: usize, s: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            (((i as u32).wrapping_mul(2654435761).wrapping_add(s)) % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let (hq, hkv, d) = (9, 3, 64);
    let mut g = c.benchmark_group("prefill_attention_with_cumul");
    g.sample_size(10);
    for t in [512usize, 1024, 2048, 4096, 8192] {
        let q = data(hq * t * d, 1);
        let k: Vec<Vec<f32>> = (0..hkv).map(|h| data(t * d, 2 + h as u32)).collect();
        let v: Vec<Vec<f32>> = (0..hkv).map(|h| data(t * d, 9 + h as u32)).collect();
        let keys: Vec<&[f32]> = k.iter().map(|x| x.as_slice()).collect();
        let vals: Vec<&[f32]> = v.iter().map(|x| x.as_slice()).collect();
        let mut out = vec![0.0f32; hq * t * d];
        let mut cu = vec![0.0f32; hq * t];
        let backends: Vec<(&str, Box<dyn AttentionBackend>)> = if t <= 2048 {
            vec![
                ("tiled", Box::new(TiledBackend::default())),
                ("reference", Box::new(ReferenceBackend)),
            ]
        } else {
            vec![("tiled", Box::new(TiledBackend::default()))]
        };
        for (name, b) in backends {
            g.bench_with_input(BenchmarkId::new(name, t), &t, |bch, &t| {
                bch.iter(|| {
                    b.prefill(PrefillArgs {
                        n_q_heads: hq,
                        head_dim: d,
                        q: &q,
                        n: t,
                        keys: &keys,
                        values: &vals,
                        t,
                        out: &mut out,
                        cumulative: Some(&mut cu),
                        window: None,
                        history: None,
                    })
                    .unwrap();
                    black_box(&cu);
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
