//! Unit tests of `matrix.rs`: batched products against single ones.

use super::*;

fn random_matrix(ty: GgmlType, rows: usize, cols: usize, seed: u32) -> QMatrix {
    // Any bytes with finite fp16 scales: write small random codes and
    // scales through the dequantized-f32 round trip of each type's layout.
    let mut s = seed;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        s
    };
    let bs = ty.block_bytes();
    let mut bytes = vec![0u8; rows * ty.row_bytes(cols)];
    for blk in bytes.chunks_exact_mut(bs) {
        for b in blk.iter_mut() {
            *b = next() as u8;
        }
        // fp16 scales/minimums at the front (Q4_1: d, m; Q8_0: d): small
        // finite values (exponent bits cleared of the top).
        let n16 = match ty {
            GgmlType::Q4_1 => 2,
            _ => 1,
        };
        for k in 0..n16 {
            let v = half::f16::from_f32(((next() % 2000) as f32 - 1000.0) * 1e-5);
            blk[2 * k..2 * k + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    QMatrix::new("t", ty, rows, cols, crate::gguf::Blob::owned(bytes)).unwrap()
}

#[test]
fn batched_rows_are_bitwise_equal_to_single_matvecs() {
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
        for act in [Activations::F32, Activations::Q8] {
            let (rows, cols) = (37, 96);
            let mut m = random_matrix(ty, rows, cols, 7);
            m.set_activations(act);
            for n in [2usize, 3, 4, 5, 6, 7, 8, 9, 17, 20, 23] {
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + i as f32 * 1e-3))
                    .collect();
                let sel: Vec<usize> = (0..n).rev().collect();
                let mut y = vec![f32::NAN; n * rows];
                m.matvec_rows(&x, &mut y, &sel);
                for i in 0..n {
                    let mut one = vec![0.0; rows];
                    m.matvec(&x[i * cols..(i + 1) * cols], &mut one);
                    let got = &y[i * rows..(i + 1) * rows];
                    assert!(
                        one.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty:?} {act:?} n={n} input {i}"
                    );
                }
            }
        }
    }
}

/// Each segment of a batch (decode rows together, prefill chunks sharing
/// each dequantized tile of weights) is bitwise its own product, across
/// several tiles of rows, with chunks before, between and after the decode
/// rows, and with tiles wider than a short chunk gets alone.
#[test]
fn segments_match_separate_products() {
    for (ty, rows, cols) in [
        (GgmlType::Q4_1, 40, 64),
        (GgmlType::Q4_1, 130, 96),
        (GgmlType::Q8_0, 70, 64),
    ] {
        let m = random_matrix(ty, rows, cols, 3);
        // The 100-row chunk widens every tile past what the others get alone.
        let lens = [4usize, 1, 5, 2, 0, 1, 3, 100, 7];
        let total: usize = lens.iter().sum();
        let x: Vec<f32> = (0..total * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut segs = Segments::default();
        segs.set(lens);
        assert_eq!(segs.rows(), total);
        let mut y = vec![f32::NAN; total * rows];
        m.matmul_segments(&x, &segs, &mut y);
        let mut a = 0;
        for n in lens {
            let mut one = vec![0.0; n * rows];
            m.matmul(&x[a * cols..(a + n) * cols], n, &mut one);
            assert!(
                one.iter()
                    .zip(&y[a * rows..(a + n) * rows])
                    .all(|(p, q)| p.to_bits() == q.to_bits()),
                "{ty:?} {rows}x{cols}: segment of {n} rows at row {a}"
            );
            a += n;
        }
    }
}

/// The prefill products' two routes (`minikv_core::gemm` on the inputs
/// transposed, `sgemm` per part) give the same bits, for inner dimensions
/// of one and several of `matrixmultiply`'s passes, several tiles of rows
/// and parts of different lengths.
#[test]
fn prefill_routes_have_the_same_bits() {
    for (ty, rows, cols) in [
        (GgmlType::Q4_1, 70, 64),
        (GgmlType::Q4_1, 130, 576),
        (GgmlType::Q8_0, 40, 1536),
    ] {
        let m = random_matrix(ty, rows, cols, 5);
        for parts in [vec![(0, 3)], vec![(0, 17)], vec![(2, 5), (9, 70), (80, 4)]] {
            let n = parts.iter().map(|p| p.0 + p.1).max().unwrap();
            let x: Vec<f32> = (0..n * cols)
                .map(|i| (i as f32 * 0.37).sin() * [1.0, 1e-3, 37.0][i % 3])
                .collect();
            let (mut direct, mut packed) = (vec![0.0; n * rows], vec![0.0; n * rows]);
            m.matmul_direct(&x, &parts, &mut direct);
            m.matmul_packed(&x, &parts, &mut packed);
            for &(a, k) in &parts {
                let (d, p) = (
                    &direct[a * rows..(a + k) * rows],
                    &packed[a * rows..(a + k) * rows],
                );
                assert!(
                    d.iter().zip(p).all(|(d, p)| d.to_bits() == p.to_bits()),
                    "{ty:?} {rows}x{cols} parts {parts:?}: part at {a}"
                );
            }
        }
    }
}

/// `matvec` (rows split into tasks, four rows at a time on 512-bit
/// registers) gives every row bitwise its single-row dot, in f32 and with
/// 8-bit activations, for row counts that leave every remainder.
#[test]
fn matvec_rows_are_bitwise_equal_to_single_row_dots() {
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
        for (rows, cols) in [
            (1, 32),
            (2, 64),
            (3, 96),
            (7, 576),
            (13, 96),
            (37, 1536),
            (130, 64),
        ] {
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + i as f32 * 1e-3))
                .collect();
            let mut m = random_matrix(ty, rows, cols, 3 + rows as u32);
            let (mut xs, mut a) = (Vec::new(), Q8Vec::default());
            block_sums(&x, &mut xs);
            a.quantize(&x);
            for act in [Activations::F32, Activations::Q8] {
                m.set_activations(act);
                let mut y = vec![f32::NAN; rows];
                m.matvec(&x, &mut y);
                for (r, v) in y.iter().enumerate() {
                    let want = match (act, ty) {
                        (Activations::F32, _) => dot_row(ty, m.row(r), &x, &xs),
                        (_, GgmlType::Q4_1) => crate::q8::dot_q4_1(m.row(r), &a),
                        _ => crate::q8::dot_q8_0(m.row(r), &a),
                    };
                    assert_eq!(
                        v.to_bits(),
                        want.to_bits(),
                        "{ty:?} {act:?} {rows}x{cols} row {r}"
                    );
                }
            }
        }
    }
}

/// The batched `Q4_1` and `Q8_0` products a weight row at a time (on AVX2
/// groups of up to four / two inputs: the route of a CPU without AVX-512,
/// run here whatever the CPU has) give every input bitwise its single-row
/// dot, for 1 to 11 inputs taken out of order (every group and remainder).
#[test]
fn row_at_a_time_batches_are_bitwise_the_single_row_dots() {
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
        let (rows, cols) = (19, 192);
        let m = random_matrix(ty, rows, cols, 11);
        for n in 1..=11usize {
            let x: Vec<f32> = (0..(n + 1) * cols)
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + i as f32 * 1e-3))
                .collect();
            let sel: Vec<usize> = (1..=n).rev().collect();
            let mut y = vec![f32::NAN; (n + 1) * rows];
            m.matvec_rows_dots(&x, &mut y, &sel);
            let mut xs = Vec::new();
            for &i in &sel {
                let xi = &x[i * cols..(i + 1) * cols];
                block_sums(xi, &mut xs);
                for r in 0..rows {
                    let want = dot_row(ty, m.row(r), xi, &xs);
                    let got = y[i * rows + r];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{ty:?} n={n} input {i} row {r}"
                    );
                }
            }
        }
    }
}

/// Batched decode products of `Q5_0`, `Q4_K` and `Q6_K` matrices (tiles of
/// up to eight inputs on 512-bit registers where the CPU has AVX-512F)
/// give every input bitwise the portable loop's dot, for batches of 2 to
/// 23 inputs taken out of order (every tile size and remainder).
#[cfg(x86_kernels)]
#[test]
fn k_quant_batches_are_bitwise_the_portable_dots() {
    use crate::blocks::{dot_q4_k_portable, dot_q5_0_portable, dot_q6_k_portable};
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(16);
    for (ty, cols) in [
        (GgmlType::Q5_0, 160),
        (GgmlType::Q4_K, 512),
        (GgmlType::Q6_K, 512),
    ] {
        let rows = 11;
        let bytes = crate::blocks::tests::random_k_rows(&mut rng, ty, rows, cols / ty.block_size());
        let m = QMatrix::new("t", ty, rows, cols, crate::gguf::Blob::owned(bytes)).unwrap();
        for n in [2usize, 3, 4, 5, 7, 8, 9, 15, 16, 17, 23] {
            let x: Vec<f32> = (0..(n + 1) * cols)
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + i as f32 * 1e-3))
                .collect();
            let sel: Vec<usize> = (1..=n).rev().collect();
            let mut y = vec![f32::NAN; (n + 1) * rows];
            m.matvec_rows(&x, &mut y, &sel);
            for &i in &sel {
                let xi = &x[i * cols..(i + 1) * cols];
                let mut xs = Vec::new();
                block_sums(xi, &mut xs);
                for r in 0..rows {
                    let want = match ty {
                        GgmlType::Q5_0 => dot_q5_0_portable(m.row(r), xi),
                        GgmlType::Q4_K => dot_q4_k_portable(m.row(r), xi, &xs),
                        _ => dot_q6_k_portable(m.row(r), xi),
                    };
                    let got = y[i * rows + r];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{ty:?} n={n} input {i} row {r}"
                    );
                }
            }
        }
    }
}

/// Under [`Activations::Q8`] a product of at most `Q8_MOST` input rows
/// gives every row bitwise its single-input 8-bit dot; a longer one is the
/// exact f32 product's, bit for bit.
#[test]
fn short_q8_products_are_the_single_8_bit_dots() {
    use super::prefill::Q8_MOST;
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
        let (rows, cols) = (37, 96);
        let mut m = random_matrix(ty, rows, cols, 11);
        for n in [3, Q8_MOST, Q8_MOST + 1] {
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + i as f32 * 1e-3))
                .collect();
            let mut exact = vec![f32::NAN; n * rows];
            m.set_activations(Activations::F32);
            m.matmul(&x, n, &mut exact);
            m.set_activations(Activations::Q8);
            let mut y = vec![f32::NAN; n * rows];
            m.matmul(&x, n, &mut y);
            for i in 0..n {
                let mut a = Q8Vec::default();
                a.quantize(&x[i * cols..(i + 1) * cols]);
                for r in 0..rows {
                    let want = match n <= Q8_MOST {
                        true => crate::q8::dot(ty, m.row(r), &a),
                        false => exact[i * rows + r],
                    };
                    let got = y[i * rows + r];
                    assert_eq!(got.to_bits(), want.to_bits(), "{ty:?} n={n} {i} {r}");
                }
            }
        }
    }
}

/// In a batch of parts under [`Activations::Q8`] each part goes by its
/// own length: a short part beside a long one gets the rows it gets alone
/// (8-bit), the long one the rows it gets alone (exact f32).
#[test]
fn q8_parts_go_by_their_own_length() {
    use super::prefill::Q8_MOST;
    let (rows, cols) = (21, 64);
    let mut m = random_matrix(GgmlType::Q8_0, rows, cols, 5);
    let (short, long) = (5, Q8_MOST + 7);
    let n = short + long;
    let x: Vec<f32> = (0..n * cols)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + i as f32 * 1e-3))
        .collect();
    let alone = |m: &QMatrix, a: usize, k: usize| {
        let mut y = vec![f32::NAN; k * rows];
        m.matmul(&x[a * cols..(a + k) * cols], k, &mut y);
        y
    };
    m.set_activations(Activations::Q8);
    let mut y = vec![f32::NAN; n * rows];
    m.matmul_parts(&x, &[(0, short), (short, long)], &mut y);
    let (ys, yl) = (alone(&m, 0, short), alone(&m, short, long));
    m.set_activations(Activations::F32);
    let exact_long = alone(&m, short, long);
    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&y[..short * rows]), bits(&ys));
    assert_eq!(bits(&y[short * rows..]), bits(&yl));
    assert_eq!(bits(&yl), bits(&exact_long));
}

/// A stack reads its parts where they lie (no copy, whatever their
/// order or buffers), and every product of it is, bit for bit, the parts'
/// products one after another: with rayon's tasks cut where the parts meet,
/// for decode (one input, several, 8-bit inputs) and prefill (both routes).
#[test]
fn stacks_read_their_parts_in_place_with_the_parts_products() {
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(29);
    let threads = [1usize, 2, 3].map(|n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    });
    for (ty, cols) in [
        (GgmlType::Q4_1, 64),
        (GgmlType::Q8_0, 64),
        (GgmlType::Q4_K, 256),
        (GgmlType::Q6_K, 256),
    ] {
        let rb = ty.row_bytes(cols);
        let mut matrix = |rows: usize, seed: u32| match ty {
            GgmlType::Q4_1 | GgmlType::Q8_0 => random_matrix(ty, rows, cols, seed),
            _ => {
                let bytes = crate::blocks::tests::random_k_rows(&mut rng, ty, rows, cols / 256);
                QMatrix::new("t", ty, rows, cols, crate::gguf::Blob::owned(bytes)).unwrap()
            }
        };
        let a = matrix(48, 7);
        let (top, bottom) = (a.row_view(0, 24), a.row_view(24, 24));
        let (alone, odd) = (matrix(24, 8), matrix(37, 9));
        let ptrs = |m: &QMatrix| {
            m.byte_runs()
                .map(|r| (r.as_ptr(), r.len()))
                .collect::<Vec<_>>()
        };
        assert_eq!(QMatrix::heap_bytes([&top, &bottom]), 48 * rb);

        // Back to back in one buffer: one run, that buffer again.
        let s = QMatrix::concat_rows(&[&top, &bottom]).unwrap();
        assert_eq!((s.rows, ptrs(&s)), (48, ptrs(&a)));
        for ms in [
            vec![&bottom, &top],
            vec![&top, &alone],
            vec![&odd, &top, &bottom, &alone],
        ] {
            let c = QMatrix::concat_rows(&ms).unwrap();
            let parts = || ms.iter().copied();
            // In place: no new buffer, each part's bytes where they were
            // (top and bottom joined where they follow each other).
            assert_eq!(
                QMatrix::heap_bytes(parts().chain([&c])),
                QMatrix::heap_bytes(parts())
            );
            let mut want: Vec<(*const u8, usize)> = Vec::new();
            for p in parts().flat_map(&ptrs) {
                match want.last_mut() {
                    Some(l) if l.0.wrapping_add(l.1) == p.0 => l.1 += p.1,
                    _ => want.push(p),
                }
            }
            assert_eq!(ptrs(&c), want);
            assert_eq!(c.byte_len(), parts().map(|p| p.byte_len()).sum::<usize>());

            // Products against the parts' own, on 1-3 threads.
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            for (pool, act) in threads
                .iter()
                .flat_map(|p| [(p, Activations::F32), (p, Activations::Q8)])
            {
                let (mut c, n) = (c.clone(), 40);
                c.set_activations(act);
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let run = |m: &QMatrix, k: usize| {
                    let mut y = vec![f32::NAN; k * m.rows];
                    pool.install(|| match k {
                        1 => m.matvec(&x[..cols], &mut y),
                        3 => m.matvec_rows(&x, &mut y, &[2, 0, 1]),
                        _ => m.matmul(&x[..k * cols], k, &mut y),
                    });
                    y
                };
                for k in [1, 3, 5, 40] {
                    let got = run(&c, k);
                    let mut parts_y: Vec<Vec<f32>> = Vec::new();
                    for p in parts() {
                        let mut p = p.clone();
                        p.set_activations(act);
                        parts_y.push(run(&p, k));
                    }
                    for i in 0..k {
                        let want: Vec<f32> = ms
                            .iter()
                            .zip(&parts_y)
                            .flat_map(|(p, y)| y[i * p.rows..(i + 1) * p.rows].to_vec())
                            .collect();
                        let (ty, act) = (ty, act);
                        assert_eq!(
                            bits(&got[i * c.rows..(i + 1) * c.rows]),
                            bits(&want),
                            "{ty:?} {act:?} {} parts, {} threads, {k} inputs, input {i}",
                            ms.len(),
                            pool.current_num_threads()
                        );
                    }
                }
            }
            // A view across a seam is the rows of the parts.
            let v = c.row_view(ms[0].rows - 3, 6);
            let (mut r, mut w) = (vec![0.0; cols], vec![0.0; cols]);
            for i in 0..6 {
                v.dequantize_row(i, &mut r);
                c.dequantize_row(ms[0].rows - 3 + i, &mut w);
                assert_eq!(bits(&r), bits(&w));
            }
            assert_eq!(v.byte_runs().count(), 2.min(ptrs(&c).len()));
        }
    }
}
