//! The CUDA kernels (`cuda/minikv.cu`), run on the CPU under the project's
//! emulation of CUDA (`cuda/emulate.h`), against the CPU backend and
//! quantizer: A_cumul and outputs within 1e-4, SnapKV window scores within
//! 1e-4, quantized codes and scales bit-exact, fused decode within 1e-4 over
//! ragged heads with quantized, fp16 and extra entries.

use half::f16;
use minikv_core::attention::{
    AttentionBackend, DecodeArgs, ExtraView, HeadView, PrefillArgs, ReferenceBackend,
};
use minikv_core::storage::{Fp16Rows, FpStore};
use minikv_core::{Axis, QuantStore, Quantizer};
use minikv_kernels::emulated::{self, MkHead, PrefillShape};
use minikv_policies::scorers::{Pooling, pool1d};
use minikv_quant::{MinMax, ScaleDtype, quantize_row};
use rand::{Rng, SeedableRng, rngs::StdRng};

fn rand_vec(rng: &mut StdRng, n: usize, s: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0) * s).collect()
}

fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * scale, "{what}[{i}]: {x} vs {y}");
    }
}

/// The reference backend's prefill (`A_cumul` on).
fn reference_prefill(s: PrefillShape, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0.0; q.len()];
    let mut cu = vec![0.0; s.hq * s.t];
    let keys: Vec<&[f32]> = k.chunks(s.t * s.d).collect();
    let vals: Vec<&[f32]> = v.chunks(s.t * s.d).collect();
    ReferenceBackend
        .prefill(PrefillArgs {
            n_q_heads: s.hq,
            head_dim: s.d,
            q,
            n: s.n,
            keys: &keys,
            values: &vals,
            t: s.t,
            out: &mut out,
            cumulative: Some(&mut cu),
            window: (s.window > 0).then_some(s.window),
        })
        .unwrap();
    (out, cu)
}

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

#[test]
fn prefill_and_cumulative_attention_match_the_cpu_backend() {
    let mut rng = StdRng::seed_from_u64(2);
    for s in [
        PrefillShape {
            hq: 4,
            hkv: 2,
            n: 19,
            t: 19,
            d: 16,
            window: 0,
        },
        PrefillShape {
            hq: 2,
            hkv: 1,
            n: 9,
            t: 150,
            d: 64,
            window: 0,
        }, // a chunk after a prefix, > 1 tile
        PrefillShape {
            hq: 4,
            hkv: 1,
            n: 40,
            t: 40,
            d: 8,
            window: 7,
        }, // sliding window
        PrefillShape {
            hq: 2,
            hkv: 2,
            n: 3,
            t: 140,
            d: 256,
            window: 130,
        },
    ] {
        let q = rand_vec(&mut rng, s.hq * s.n * s.d, 2.0);
        let k = rand_vec(&mut rng, s.hkv * s.t * s.d, 2.0);
        let v = rand_vec(&mut rng, s.hkv * s.t * s.d, 1.0);
        let (out, _, cu) = emulated::prefill(s, &q, &k, &v, true);
        let (ro, rc) = reference_prefill(s, &q, &k, &v);
        close(&out, &ro, 1e-4, "prefill out");
        close(&cu.unwrap(), &rc, 1e-4, "A_cumul");
    }
}

/// SnapKV's window scores: the last `w` queries' attention over the prefix,
/// summed, then pooled; against the reference backend's A_cumul of those
/// queries alone and `minikv-policies`' pooling.
#[test]
fn snapkv_window_scores_match() {
    let mut rng = StdRng::seed_from_u64(3);
    let s = PrefillShape {
        hq: 4,
        hkv: 2,
        n: 60,
        t: 60,
        d: 32,
        window: 0,
    };
    let w = 8;
    let q = rand_vec(&mut rng, s.hq * s.n * s.d, 2.0);
    let k = rand_vec(&mut rng, s.hkv * s.t * s.d, 2.0);
    let v = rand_vec(&mut rng, s.hkv * s.t * s.d, 1.0);
    let (_, lse, _) = emulated::prefill(s, &q, &k, &v, false);
    // The window's queries alone, as a chunk of w after t - w keys.
    let qw: Vec<f32> = (0..s.hq)
        .flat_map(|h| q[(h * s.n + s.n - w) * s.d..(h * s.n + s.n) * s.d].to_vec())
        .collect();
    let (_, cu) = reference_prefill(PrefillShape { n: w, ..s }, &qw, &k, &v);
    for (kernel, max) in [(7, true), (5, false), (1, true)] {
        let got = emulated::window_scores(s, &q, &k, &lse, w, kernel, max);
        let pooling = if max { Pooling::Max } else { Pooling::Avg };
        let want: Vec<f32> = (0..s.hq)
            .flat_map(|h| pool1d(&cu[h * s.t..h * s.t + s.t - w], kernel, pooling))
            .collect();
        close(&got, &want, 1e-4, "window scores");
    }
}

/// Keys per channel and values per token at 2 and 4 bits: codes, word layout
/// and fp16 scales/minimums bit-exact with the CPU quantizer.
#[test]
fn quantize_and_pack_is_bit_exact() {
    let mut rng = StdRng::seed_from_u64(4);
    for (bits, g, d) in [
        (2u32, 16usize, 32usize),
        (4, 32, 64),
        (2, 32, 16),
        (4, 8, 8),
    ] {
        let p = 32 / bits as usize;
        let groups = 3;
        let rows = rand_vec(&mut rng, groups * g * d, 3.0);
        // Keys: groups of g tokens per channel.
        let (mut words, mut sc, mut mn) = (Vec::new(), Vec::new(), Vec::new());
        for gi in 0..groups {
            emulated::quant_keys(
                &rows[gi * g * d..(gi + 1) * g * d],
                g,
                d,
                bits,
                gi * g,
                &mut words,
                &mut sc,
                &mut mn,
            );
        }
        let mut want = vec![0u32; (groups * g).div_ceil(p) * d];
        for gi in 0..groups {
            for c in 0..d {
                let col: Vec<f32> = (0..g).map(|i| rows[(gi * g + i) * d + c]).collect();
                let r = quantize_row(&col, bits, g, ScaleDtype::F16).unwrap();
                assert_eq!(
                    sc[gi * d + c],
                    f16::from_f32(r.scale[0]).to_bits(),
                    "key scale g{gi} c{c}"
                );
                assert_eq!(
                    mn[gi * d + c],
                    f16::from_f32(r.min[0]).to_bits(),
                    "key min g{gi} c{c}"
                );
                for (i, &code) in r.codes.iter().enumerate() {
                    let t = gi * g + i;
                    want[(t / p) * d + c] |= (code as u32) << (bits as usize * (t % p));
                }
            }
        }
        assert_eq!(words, want, "key words, {bits} bits, G {g}, d {d}");
        // Values: groups of g channels per token.
        let n = groups * g;
        let gv = g.min(d);
        let mut vw = vec![0u32; n * d / p];
        let mut vs = vec![0u16; d / gv * n];
        let mut vm = vec![0u16; d / gv * n];
        emulated::quant_values(&rows, n, d, gv, bits, 0, n, &mut vw, &mut vs, &mut vm);
        for tkn in 0..n {
            let r = quantize_row(&rows[tkn * d..(tkn + 1) * d], bits, gv, ScaleDtype::F16).unwrap();
            let mut w = vec![0u32; d / p];
            for (c, &code) in r.codes.iter().enumerate() {
                w[c / p] |= (code as u32) << (bits as usize * (c % p));
            }
            assert_eq!(
                &vw[tkn * d / p..(tkn + 1) * d / p],
                &w[..],
                "value words of token {tkn}"
            );
            for gi in 0..d / gv {
                assert_eq!(vs[gi * n + tkn], f16::from_f32(r.scale[gi]).to_bits());
                assert_eq!(vm[gi * n + tkn], f16::from_f32(r.min[gi]).to_bits());
            }
        }
    }
}

/// One head's data on both sides.
struct Head {
    nqk: usize,
    nqv: usize,
    len: usize,
    rows_k: Vec<f32>,
    rows_v: Vec<f32>,
    extra_k: Vec<f32>,
    extra_v: Vec<f32>,
    bias: Vec<f32>,
}

fn f16_bits(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| f16::from_f32(v).to_bits()).collect()
}

/// Fused decode over ragged heads (different lengths, different quantized /
/// residual splits for keys and values, extra entries with a logit bias),
/// split over tokens, against the reference backend over the CPU stores.
#[test]
fn fused_decode_matches_the_cpu_backend() {
    let mut rng = StdRng::seed_from_u64(5);
    let (hq, d, bits, gk, gv) = (4usize, 32usize, 2u32, 16usize, 16usize);
    let p = 32 / bits as usize;
    let spec = [(48usize, 64usize, 70usize, 3usize), (32, 32, 45, 0)]; // (nqk, nqv, len, extras)
    let heads: Vec<Head> = spec
        .iter()
        .map(|&(nqk, nqv, len, ne)| Head {
            nqk,
            nqv,
            len,
            rows_k: rand_vec(&mut rng, len * d, 2.0),
            rows_v: rand_vec(&mut rng, len * d, 1.0),
            extra_k: rand_vec(&mut rng, ne * d, 2.0),
            extra_v: rand_vec(&mut rng, ne * d, 1.0),
            bias: rand_vec(&mut rng, ne, 1.0),
        })
        .collect();
    let q = rand_vec(&mut rng, hq * d, 2.0);

    // CPU: MinMax stores (the CPU quantizer), fp16 residuals, extra entries.
    let kq = MinMax {
        bits,
        group: gk,
        axis: Axis::Channel,
        scale_dtype: ScaleDtype::F16,
    };
    let vq = MinMax {
        bits,
        group: gv,
        axis: Axis::Token,
        scale_dtype: ScaleDtype::F16,
    };
    let mut cpu = Vec::new();
    for h in &heads {
        let mut ks = kq.new_store(d, 16).unwrap();
        ks.append(&h.rows_k[..h.nqk * d]).unwrap();
        let mut vs = vq.new_store(d, 16).unwrap();
        vs.append(&h.rows_v[..h.nqv * d]).unwrap();
        let mut fk = Fp16Rows::new(d, 16);
        fk.push(&h.rows_k[h.nqk * d..]);
        let mut fv = Fp16Rows::new(d, 16);
        fv.push(&h.rows_v[h.nqv * d..]);
        let mut ek = Fp16Rows::new(d, 16);
        ek.push(&h.extra_k);
        let mut ev = Fp16Rows::new(d, 16);
        ev.push(&h.extra_v);
        cpu.push((ks, vs, fk, fv, ek, ev));
    }
    let views: Vec<HeadView<'_>> = cpu
        .iter()
        .zip(&heads)
        .map(|((ks, vs, fk, fv, ek, ev), h)| HeadView {
            quant_keys: Some(ks.as_ref() as &dyn QuantStore),
            quant_values: Some(vs.as_ref() as &dyn QuantStore),
            fp_keys: fk,
            fp_values: fv,
            extra: (!h.bias.is_empty()).then_some(ExtraView {
                keys: ek,
                values: ev,
                bias: &h.bias,
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
        .unwrap();

    // GPU kernels: stores quantized by the emulated kernels.
    struct Dev {
        kw: Vec<u32>,
        ks: Vec<u16>,
        km: Vec<u16>,
        vw: Vec<u32>,
        vs: Vec<u16>,
        vm: Vec<u16>,
        fk: Vec<u16>,
        fv: Vec<u16>,
        ek: Vec<u16>,
        ev: Vec<u16>,
    }
    let devs: Vec<Dev> = heads
        .iter()
        .map(|h| {
            let (mut kw, mut ks, mut km) = (Vec::new(), Vec::new(), Vec::new());
            for gi in 0..h.nqk / gk {
                emulated::quant_keys(
                    &h.rows_k[gi * gk * d..(gi + 1) * gk * d],
                    gk,
                    d,
                    bits,
                    gi * gk,
                    &mut kw,
                    &mut ks,
                    &mut km,
                );
            }
            let cap = h.nqv;
            let mut vw = vec![0u32; cap * d / p];
            let mut vs = vec![0u16; d / gv * cap];
            let mut vm = vec![0u16; d / gv * cap];
            emulated::quant_values(
                &h.rows_v[..h.nqv * d],
                h.nqv,
                d,
                gv,
                bits,
                0,
                cap,
                &mut vw,
                &mut vs,
                &mut vm,
            );
            Dev {
                kw,
                ks,
                km,
                vw,
                vs,
                vm,
                fk: f16_bits(&h.rows_k[h.nqk * d..]),
                fv: f16_bits(&h.rows_v[h.nqv * d..]),
                ek: f16_bits(&h.extra_k),
                ev: f16_bits(&h.extra_v),
            }
        })
        .collect();
    let mk: Vec<MkHead> = devs
        .iter()
        .zip(&heads)
        .map(|(x, h)| MkHead {
            kwords: x.kw.as_ptr(),
            kscale: x.ks.as_ptr(),
            kmin: x.km.as_ptr(),
            nqk: h.nqk as i32,
            kgroup: gk as i32,
            kbits: bits as i32,
            vwords: x.vw.as_ptr(),
            vscale: x.vs.as_ptr(),
            vmin: x.vm.as_ptr(),
            nqv: h.nqv as i32,
            vgroup: gv as i32,
            vbits: bits as i32,
            vcap: h.nqv as i32,
            fk: x.fk.as_ptr(),
            fv: x.fv.as_ptr(),
            len: h.len as i32,
            ek: x.ek.as_ptr(),
            ev: x.ev.as_ptr(),
            ebias: h.bias.as_ptr(),
            n_extra: h.bias.len() as i32,
        })
        .collect();
    for chunk in [7usize, 32, 1000] {
        // SAFETY: every pointer in `mk` points into `devs` / `heads`, alive here.
        let got = unsafe { emulated::decode(&q, &mk, hq, d, chunk) };
        close(&got, &want, 1e-4, &format!("decode, chunks of {chunk}"));
    }
}
