//! Golden vectors of docs/algorithms.md §1 and the §6 size formula.

use minikv_core::{Axis, Quantizer};
use minikv_quant::{MinMax, ScaleDtype, pack, quantize_group, quantize_row, unpack};

const ROW0: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 0.25, 0.75, 1.25, 1.75, 2.25, 2.75, 3.0, 0.0, 1.0,
];
const ROW1: [f32; 16] = [
    -1.2, 0.7, 0.05, -0.33, 1.9, -0.8, 0.42, 1.1, -1.05, 0.0, 0.66, -0.2, 1.5, 0.9, -0.6, 0.3,
];

#[test]
fn two_bit_rows() {
    let g = quantize_group(&ROW0, 2).unwrap();
    assert_eq!((g.min, g.scale), (0.0, 1.0));
    assert_eq!(g.codes, [0, 0, 1, 2, 2, 2, 3, 0, 1, 1, 2, 2, 3, 3, 0, 1]);
    assert_eq!(pack(&g.codes, 2), [0x4fa53a90]);
    let g = quantize_group(&ROW1, 2).unwrap();
    assert_eq!(g.min, -1.2);
    assert!((g.scale - 1.0333333).abs() < 1e-6);
    assert_eq!(g.codes, [0, 2, 1, 1, 3, 0, 2, 2, 0, 1, 2, 1, 3, 2, 1, 1]);
    assert_eq!(pack(&g.codes, 2), [0x5b64a358]);
}

#[test]
fn ties_round_half_to_even_and_sign_bit_words() {
    // (x - 0) / 1 = 0.5 -> 0, 1.5 -> 2, 2.5 -> 2 with min 0, max 3.
    let g = quantize_group(&[0.0, 0.5, 1.5, 2.5, 3.0], 2).unwrap();
    assert_eq!(g.codes, [0, 0, 2, 2, 3]);
    assert_eq!(pack(&[3; 16], 2), [0xffffffff]);
    let rep: Vec<u8> = (0..16).map(|i| (i % 4) as u8).collect();
    assert_eq!(pack(&rep, 2), [0xe4e4e4e4]);
    let mut one = [0u8; 16];
    one[15] = 1;
    assert_eq!(pack(&one, 2), [0x40000000]);
    for w in [[0xffffffffu32], [0xe4e4e4e4], [0x40000000]] {
        assert_eq!(pack(&unpack(&w, 2, 16), 2), w);
    }
}

#[test]
fn four_bit_row() {
    let g = quantize_group(&ROW0, 4).unwrap();
    assert!((g.scale - 0.2).abs() < 1e-7);
    assert_eq!(
        g.codes,
        [0, 2, 5, 8, 10, 12, 15, 1, 4, 6, 9, 11, 14, 15, 0, 5]
    );
    assert_eq!(pack(&g.codes, 4), [0x1fca8520, 0x50feb964]);
}

#[test]
fn group_of_8_spans_half_a_word() {
    // Two groups of 8 packed into one 2-bit word.
    let r = quantize_row(&ROW0, 2, 8, ScaleDtype::F32).unwrap();
    assert_eq!(r.scale.len(), 2);
    assert_eq!(r.packed.len(), 1);
    let g0 = quantize_group(&ROW0[..8], 2).unwrap();
    let g1 = quantize_group(&ROW0[8..], 2).unwrap();
    let codes: Vec<u8> = g0.codes.iter().chain(&g1.codes).copied().collect();
    assert_eq!(r.codes, codes);
    assert_eq!(r.packed[0], format!("{:#010x}", pack(&codes, 2)[0]));
}

#[test]
fn constant_group_dequantizes_to_its_min() {
    let r = quantize_row(&[1.25; 16], 2, 16, ScaleDtype::F16).unwrap();
    assert_eq!(r.codes, vec![0; 16]);
    assert_eq!(r.scale, [0.0]);
    assert!(r.dequant.iter().all(|&x| x == 1.25));
}

#[test]
fn non_finite_inputs_are_errors() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut row = ROW0;
        row[3] = bad;
        let e = quantize_group(&row, 2).unwrap_err().to_string();
        assert!(e.contains("element 3"), "{e}");
    }
    // f16 storage overflow is an error, not inf.
    let e = quantize_row(&[0.0, 1e6], 2, 2, ScaleDtype::F16)
        .unwrap_err()
        .to_string();
    assert!(e.contains("f32"), "{e}");
}

#[test]
fn bad_parameters_are_errors() {
    let q = MinMax {
        bits: 3,
        ..Default::default()
    };
    assert!(q.validate(64).unwrap_err().to_string().contains("bits"));
    let q = MinMax {
        group: 24,
        axis: Axis::Token,
        ..Default::default()
    };
    assert!(q.validate(64).unwrap_err().to_string().contains("divide"));
    let mut s = MinMax::default().new_store(64, 256).unwrap();
    assert!(
        s.append(&vec![0.0; 8 * 64])
            .unwrap_err()
            .to_string()
            .contains("multiple of G")
    );
}

/// §6: b = 2, G = 16 stores 8 bytes per 16 elements (codes + fp16 scale + min).
#[test]
fn size_formula_section_6() {
    let (d, n) = (64, 512);
    for axis in [Axis::Channel, Axis::Token] {
        let q = MinMax {
            bits: 2,
            group: 16,
            axis,
            scale_dtype: ScaleDtype::F16,
            arithmetic: Default::default(),
        };
        let mut s = q.new_store(d, 256).unwrap();
        let rows: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.37).sin()).collect();
        s.append(&rows).unwrap();
        s.shrink();
        let b = s.bytes();
        assert_eq!(b.codes, n * d * 2 / 8, "{axis:?}");
        // Data: codes plus an fp16 scale and min per group, 4 bits per
        // element in all, 25% of fp16.
        assert_eq!(s.used_bytes(), n * d * 2 / 8 + n * d / 16 * 4, "{axis:?}");
        assert_eq!(s.used_bytes() * 4, n * d * 2);
        // Allocated: the same after shrink, plus the scale buffers' headers.
        let headers = b.scales - n * d / 16 * 4;
        assert!(
            headers > 0 && headers <= 2 * (d / 16) * 32,
            "{axis:?}: {headers}"
        );
    }
}
