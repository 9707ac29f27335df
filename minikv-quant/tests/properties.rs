//! Property tests: error bounds, packing round trips, fused == dequantize + attend.

use minikv_core::attention::{
    AttentionBackend, DecodeArgs, HeadView, ReferenceBackend, TiledBackend,
};
use minikv_core::storage::{Fp16Rows, FpStore};
use minikv_core::{Axis, QuantStore, Quantizer};
use minikv_quant::{MinMax, ScaleDtype, pack, quantize_row, unpack};
use proptest::prelude::*;

proptest! {
    #[test]
    fn reconstruction_error_within_half_scale(
        bits in prop::sample::select(vec![2u32, 4, 8]),
        xs in prop::collection::vec(-100.0f32..100.0, 32),
        f16 in any::<bool>(),
    ) {
        let dtype = if f16 { ScaleDtype::F16 } else { ScaleDtype::F32 };
        let r = quantize_row(&xs, bits, 16, dtype).unwrap();
        for (gi, chunk) in xs.chunks(16).enumerate() {
            let mn = chunk.iter().copied().fold(f32::INFINITY, f32::min);
            let mx = chunk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exact_scale = (mx - mn) / ((1u32 << bits) - 1) as f32;
            // fp16 rounding of scale and min adds at most 2^-11 relative each, times the code.
            let fp16 = if f16 { (mn.abs() + exact_scale * ((1u32 << bits) - 1) as f32) * 2f32.powi(-10) } else { 0.0 };
            for (i, &x) in chunk.iter().enumerate() {
                let e = (x - r.dequant[gi * 16 + i]).abs();
                prop_assert!(e <= exact_scale / 2.0 * (1.0 + 1e-5) + fp16 + 1e-6, "x={x} e={e} scale={exact_scale}");
            }
        }
    }

    #[test]
    fn pack_unpack_identity(bits in prop::sample::select(vec![2u32, 4, 8]), seed in prop::collection::vec(0u8..=255, 1..100)) {
        let codes: Vec<u8> = seed.iter().map(|c| c & (((1u8 << bits.min(7)) - 1) | if bits == 8 { 0x80 } else { 0 })).collect();
        prop_assert_eq!(unpack(&pack(&codes, bits), bits, codes.len()), codes);
    }

    /// Fused per-channel keys + per-token values decode equals dequantize-then-reference.
    #[test]
    fn fused_decode_equals_dequantized_reference(
        bits in prop::sample::select(vec![2u32, 4, 8]),
        kgroup in prop::sample::select(vec![8usize, 16, 32, 12]),
        vgroup in prop::sample::select(vec![16usize, 32, 64]),
        kaxis in prop::sample::select(vec![Axis::Channel, Axis::Token]),
        blocks in 0usize..6,
        nres in 0usize..9,
        seed in 0u64..1000,
    ) {
        let d = 64;
        // No quantized token yet (everything in the residual) is a case too.
        let nres = if blocks == 0 { nres.max(1) } else { nres };
        let kgroup = if kaxis == Axis::Token { 16 } else { kgroup };
        let n = blocks * kgroup * 2;
        let mut x = seed as f32;
        let mut rnd = |s: f32| { x = (x * 1.37 + 0.61).fract() * 7.3; x.sin() * s };
        let mk = |a: Axis, g: usize| MinMax { bits, group: g, axis: a, scale_dtype: ScaleDtype::F32, ..Default::default() };
        let mut heads = Vec::new();
        for _ in 0..2 {
            let mut qk = mk(kaxis, kgroup).new_store(d, 256).unwrap();
            let mut qv = mk(Axis::Token, vgroup).new_store(d, 256).unwrap();
            let ks: Vec<f32> = (0..n * d).map(|i| rnd(2.0) + if i % d == 5 { 8.0 } else { 0.0 }).collect();
            let vs: Vec<f32> = (0..n * d).map(|_| rnd(1.0)).collect();
            qk.append(&ks).unwrap();
            qv.append(&vs).unwrap();
            let mut fk = Fp16Rows::new(d, 256);
            let mut fv = Fp16Rows::new(d, 256);
            fk.push(&(0..nres * d).map(|_| rnd(2.0)).collect::<Vec<_>>());
            fv.push(&(0..nres * d).map(|_| rnd(1.0)).collect::<Vec<_>>());
            heads.push((qk, qv, fk, fv));
        }
        let views: Vec<HeadView<'_>> = heads.iter().map(|(qk, qv, fk, fv)| HeadView {
            quant_keys: Some(qk.as_ref()), quant_values: Some(qv.as_ref()), fp_keys: fk, fp_values: fv, extra: None,
        }).collect();
        let q: Vec<f32> = (0..2 * 3 * d).map(|_| rnd(1.5)).collect();
        let mut o1 = vec![0.0; q.len()];
        let mut o2 = vec![0.0; q.len()];
        TiledBackend::default().decode(DecodeArgs { q: &q, heads: &views, head_dim: d, out: &mut o1, probs: None }).unwrap();
        ReferenceBackend.decode(DecodeArgs { q: &q, heads: &views, head_dim: d, out: &mut o2, probs: None }).unwrap();
        for (a, b) in o1.iter().zip(&o2) {
            prop_assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }
}

/// KIVI's observation: keys with outlier channels lose much less attention-score
/// accuracy when quantized per channel than per token.
#[test]
fn per_channel_keys_beat_per_token_on_outlier_channels() {
    let (d, n) = (64, 256);
    let mut s = 1u64;
    let mut rnd = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    };
    let keys: Vec<f32> = (0..n * d)
        .map(|i| {
            let c = i % d;
            let outlier = if c == 3 || c == 17 || c == 40 {
                20.0 + rnd()
            } else {
                0.0
            };
            rnd() + outlier
        })
        .collect();
    let q: Vec<f32> = (0..d).map(|_| rnd() * 2.0).collect();
    let exact: Vec<f32> = (0..n)
        .map(|t| (0..d).map(|c| q[c] * keys[t * d + c]).sum())
        .collect();
    let err = |axis| {
        let mut st = MinMax {
            bits: 2,
            group: 16,
            axis,
            scale_dtype: ScaleDtype::F16,
            arithmetic: Default::default(),
        }
        .new_store(d, 256)
        .unwrap();
        st.append(&keys).unwrap();
        let mut sc = vec![0.0; n];
        st.scores(&q, 1, &mut sc, n);
        sc.iter()
            .zip(&exact)
            .map(|(a, b)| (a - b).abs())
            .sum::<f32>()
            / n as f32
    };
    let (chan, tok) = (err(Axis::Channel), err(Axis::Token));
    eprintln!("mean |score error|: per-channel {chan}, per-token {tok}");
    assert!(
        chan * 3.0 < tok,
        "per-channel error {chan} vs per-token {tok}"
    );
}

/// `arithmetic = "int8"` through the tiled backend on heads long enough to be
/// cut into parallel segments, of ragged lengths (a long head in 4096-token
/// segments, shorter ones in 2048-token segments, so the split decode cuts
/// each head by its own segment): the same bits with 1, 2 and 3 threads and
/// with the softmax maxima taken after the key call instead of from the key
/// kernel, and close to dequantize-then-attend.
#[test]
fn int8_decode_is_thread_count_independent_and_close_to_reference() {
    use minikv_quant::Arithmetic;
    let (d, nres, kv, g) = (64, 7, 3, 3);
    // Quantized tokens and full-precision residual rows per head: the last
    // head has none, so its last block (976 tokens, not a whole segment) is
    // quantized only, like the other heads' whole blocks.
    let lens = [9024usize, 5008, 3024];
    let res = [nres, nres, 0];
    let mut s = 7u64;
    let mut rnd = |a: f32| {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0) * a
    };
    let mk = |a: Axis| MinMax {
        bits: 2,
        group: 16,
        axis: a,
        arithmetic: Arithmetic::Int8,
        ..Default::default()
    };
    let mut heads = Vec::new();
    for (&n, &nres) in lens[..kv].iter().zip(&res) {
        let mut qk = mk(Axis::Channel).new_store(d, 256).unwrap();
        let mut qv = mk(Axis::Token).new_store(d, 256).unwrap();
        let ks: Vec<f32> = (0..n * d).map(|_| rnd(2.0)).collect();
        let vs: Vec<f32> = (0..n * d).map(|_| rnd(1.0)).collect();
        qk.append(&ks).unwrap();
        qv.append(&vs).unwrap();
        let mut fk = Fp16Rows::new(d, 256);
        let mut fv = Fp16Rows::new(d, 256);
        fk.push(&(0..nres * d).map(|_| rnd(2.0)).collect::<Vec<_>>());
        fv.push(&(0..nres * d).map(|_| rnd(1.0)).collect::<Vec<_>>());
        heads.push((qk, qv, fk, fv));
    }
    let views: Vec<HeadView<'_>> = heads
        .iter()
        .map(|(qk, qv, fk, fv)| HeadView {
            quant_keys: Some(qk.as_ref()),
            quant_values: Some(qv.as_ref()),
            fp_keys: fk,
            fp_values: fv,
            extra: None,
        })
        .collect();
    // A peaked query, so that attention is far from uniform.
    let q: Vec<f32> = (0..kv * g * d).map(|_| rnd(3.0)).collect();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut o = vec![0.0f32; q.len()];
        pool.install(|| {
            TiledBackend::default()
                .decode(DecodeArgs {
                    q: &q,
                    heads: &views,
                    head_dim: d,
                    out: &mut o,
                    probs: None,
                })
                .unwrap()
        });
        o
    };
    let one = run(1);
    for t in [2, 3] {
        let o = run(t);
        assert!(
            o.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{t} threads differ from 1"
        );
    }
    // Blocks of quantized keys only take their softmax maxima from the key
    // kernel: the same bits as the trait's default (scores, then
    // `simd::max` of each row), which a wrapper without the override runs.
    let plain: Vec<DefaultMax<'_>> = heads.iter().map(|h| DefaultMax(h.0.as_ref())).collect();
    let views2: Vec<HeadView<'_>> = heads
        .iter()
        .zip(&plain)
        .map(|((_, qv, fk, fv), pk)| HeadView {
            quant_keys: Some(pk as &dyn QuantStore),
            quant_values: Some(qv.as_ref()),
            fp_keys: fk,
            fp_values: fv,
            extra: None,
        })
        .collect();
    let mut o2 = vec![0.0f32; q.len()];
    TiledBackend::default()
        .decode(DecodeArgs {
            q: &q,
            heads: &views2,
            head_dim: d,
            out: &mut o2,
            probs: None,
        })
        .unwrap();
    assert!(
        o2.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
        "maxima from the key kernel change the output"
    );
    let mut r = vec![0.0f32; q.len()];
    ReferenceBackend
        .decode(DecodeArgs {
            q: &q,
            heads: &views,
            head_dim: d,
            out: &mut r,
            probs: None,
        })
        .unwrap();
    let err = one
        .iter()
        .zip(&r)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    // Values lie in [-1, 1]: within 1% of that range (0.0063 here, about
    // half from the keys' and half from the values' rounding; exact products
    // give 3e-6 on the same heads).
    assert!(err < 0.01, "max error {err}");
}

/// A quantized store's decode calls without its own
/// `QuantStore::scores_range_max` (the trait's default runs instead).
#[derive(Debug)]
struct DefaultMax<'a>(&'a dyn QuantStore);

impl QuantStore for DefaultMax<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn head_dim(&self) -> usize {
        self.0.head_dim()
    }
    fn append(&mut self, _: &[f32]) -> minikv_core::Result<()> {
        unreachable!("decode only")
    }
    fn scores(&self, q: &[f32], g: usize, out: &mut [f32], stride: usize) {
        self.0.scores(q, g, out, stride)
    }
    fn accumulate(&self, p: &[f32], g: usize, stride: usize, out: &mut [f32]) {
        self.0.accumulate(p, g, stride, out)
    }
    fn split_rows(&self, g: usize) -> Option<usize> {
        self.0.split_rows(g)
    }
    fn scores_range(
        &self,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
        rows: std::ops::Range<usize>,
    ) {
        self.0.scores_range(q, g, out, stride, rows)
    }
    fn accumulate_range(
        &self,
        p: &[f32],
        g: usize,
        stride: usize,
        out: &mut [f32],
        rows: std::ops::Range<usize>,
    ) {
        self.0.accumulate_range(p, g, stride, out, rows)
    }
    fn dequantize(&self, out: &mut [f32]) {
        self.0.dequantize(out)
    }
    fn bytes(&self) -> minikv_core::QuantBytes {
        self.0.bytes()
    }
    fn used_bytes(&self) -> usize {
        self.0.used_bytes()
    }
    fn shrink(&mut self) {
        unreachable!("decode only")
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self.0.as_any()
    }
}
