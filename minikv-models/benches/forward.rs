//! Model throughput on SmolLM2-135M (needs `scripts/fetch-assets.sh`): prefill
//! tokens/s at 512 and 2048, decode tokens/s at depth 0, 2K, 4K (full fp16
//! cache). `cargo bench -p minikv-models --bench forward`

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use minikv_core::{CacheBuilder, CacheConfig, KvCache};
use minikv_models::{Logits, Workspace};
use std::path::Path;

fn bench(c: &mut Criterion) {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/SmolLM2-135M-Instruct.Q4_1.gguf");
    let (m, _) = minikv_models::load(&path).expect("run scripts/fetch-assets.sh first");
    let new_cache = || -> Box<dyn KvCache> {
        CacheBuilder::new(m.spec())
            .build(&CacheConfig::default())
            .unwrap()
    };
    let ids: Vec<u32> = (0..6000u32).map(|i| 100 + (i * 7919) % 40000).collect();
    let mut ws = Workspace::default();

    let mut g = c.benchmark_group("prefill");
    g.sample_size(10);
    for t in [512usize, 2048] {
        g.throughput(Throughput::Elements(t as u64));
        g.bench_with_input(BenchmarkId::from_parameter(t), &t, |b, &t| {
            b.iter(|| {
                m.forward(&ids[..t], new_cache().as_mut(), &mut ws, Logits::Last)
                    .unwrap()
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("decode");
    g.sample_size(10);
    g.warm_up_time(std::time::Duration::from_millis(500));
    g.measurement_time(std::time::Duration::from_secs(2));
    g.throughput(Throughput::Elements(1));
    for depth in [0usize, 2048, 4096] {
        // Untimed: a cache holding `depth` tokens (at least one), prepared once;
        // each sample decodes at most 8 tokens, so the depth drifts by ~100 tokens.
        let base = depth.max(1);
        let mut cache = new_cache();
        m.forward(&ids[..base], cache.as_mut(), &mut ws, Logits::None)
            .unwrap();
        cache.end_prefill().unwrap();
        let mut pos = base;
        g.bench_with_input(BenchmarkId::from_parameter(depth), &depth, |b, _| {
            b.iter_custom(|iters| {
                let n = iters.min(8) as usize;
                let t0 = std::time::Instant::now();
                for _ in 0..n {
                    m.forward(&ids[pos..pos + 1], cache.as_mut(), &mut ws, Logits::Last)
                        .unwrap();
                    pos += 1;
                }
                t0.elapsed() * iters as u32 / n as u32
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
