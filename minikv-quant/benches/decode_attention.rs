//! Decode attention per token for one layer (9 query / 3 KV heads, d = 64):
//! full fp16 cache vs the fused 2- and 4-bit caches (keys per channel, values
//! per token, G = 16), with exact and with integer (`int8`) arithmetic.
//! `cargo bench -p minikv-quant --bench decode_attention`

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use minikv_core::attention::{AttentionBackend, DecodeArgs, HeadView, TiledBackend};
use minikv_core::storage::{Fp16Rows, FpStore};
use minikv_core::{Axis, QuantStore, Quantizer};
use minikv_quant::{Arithmetic, MinMax, ScaleDtype};
use std::hint::black_box;

mod common;
use common::data;

struct Layer {
    qk: Vec<Option<Box<dyn QuantStore>>>,
    qv: Vec<Option<Box<dyn QuantStore>>>,
    fk: Vec<Fp16Rows>,
    fv: Vec<Fp16Rows>,
}

fn layer(t: usize, bits: Option<u32>, arithmetic: Arithmetic) -> Layer {
    let d = 64;
    let mut l = Layer {
        qk: vec![],
        qv: vec![],
        fk: vec![],
        fv: vec![],
    };
    for h in 0..3 {
        let (k, v) = (data(t * d, h), data(t * d, 7 + h));
        let (mut fk, mut fv) = (Fp16Rows::new(d, 256), Fp16Rows::new(d, 256));
        match bits {
            None => {
                fk.push(&k);
                fv.push(&v);
                l.qk.push(None);
                l.qv.push(None);
            }
            Some(b) => {
                let mut qk = MinMax {
                    bits: b,
                    group: 16,
                    axis: Axis::Channel,
                    scale_dtype: ScaleDtype::F16,
                    arithmetic,
                }
                .new_store(d, 256)
                .unwrap();
                let mut qv = MinMax {
                    bits: b,
                    group: 16,
                    axis: Axis::Token,
                    scale_dtype: ScaleDtype::F16,
                    arithmetic,
                }
                .new_store(d, 256)
                .unwrap();
                qk.append(&k).unwrap();
                qv.append(&v).unwrap();
                l.qk.push(Some(qk));
                l.qv.push(Some(qv));
            }
        }
        l.fk.push(fk);
        l.fv.push(fv);
    }
    l
}

fn bench(c: &mut Criterion) {
    let be = TiledBackend::default();
    let q = data(9 * 64, 99);
    let mut out = vec![0.0f32; 9 * 64];
    let mut g = c.benchmark_group("decode_attention");
    g.sample_size(20);
    for t in [1024usize, 4096, 16384, 32768] {
        for (name, bits, ar) in [
            ("fp16", None, Arithmetic::Exact),
            ("fused_2bit", Some(2), Arithmetic::Exact),
            ("fused_2bit_int8", Some(2), Arithmetic::Int8),
            ("fused_4bit", Some(4), Arithmetic::Exact),
            ("fused_4bit_int8", Some(4), Arithmetic::Int8),
        ] {
            let l = layer(t, bits, ar);
            let views: Vec<HeadView<'_>> = (0..3)
                .map(|s| HeadView {
                    quant_keys: l.qk[s].as_deref(),
                    quant_values: l.qv[s].as_deref(),
                    fp_keys: &l.fk[s],
                    fp_values: &l.fv[s],
                    extra: None,
                })
                .collect();
            g.bench_with_input(BenchmarkId::new(name, t), &t, |b, _| {
                b.iter(|| {
                    be.decode(DecodeArgs {
                        q: &q,
                        heads: &views,
                        head_dim: 64,
                        out: &mut out,
                        probs: None,
                    })
                    .unwrap();
                    black_box(&out);
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
