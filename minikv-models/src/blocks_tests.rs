//! Unit tests of `blocks.rs`.

use super::*;

fn f16b(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

/// Hand-built blocks per llama.cpp's definitions.
#[test]
fn block_layouts() {
    // Q4_0: d = 0.5; byte j = low nibble (element j) | high nibble (element j + 16).
    let mut b = f16b(0.5).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut out = [0.0f32; 32];
    dequantize_row(GgmlType::Q4_0, &b, &mut out);
    assert_eq!(out[0], -4.0); // (0 - 8) * 0.5
    assert_eq!(out[15], 3.5); // (15 - 8) * 0.5
    assert_eq!(out[16], 3.5); // high nibble of byte 0 = 15
    assert_eq!(out[31], -4.0);
    // Q4_1: d = 0.25, m = -1: x = q d + m.
    let mut b = f16b(0.25).to_vec();
    b.extend(f16b(-1.0));
    b.extend((0..16u8).map(|j| j | (j << 4)));
    dequantize_row(GgmlType::Q4_1, &b, &mut out);
    assert_eq!((out[0], out[3], out[19]), (-1.0, -0.25, -0.25));
    // Q8_0: d = 2, signed bytes.
    let mut b = f16b(2.0).to_vec();
    b.extend((0..32i8).map(|j| (j - 16) as u8));
    dequantize_row(GgmlType::Q8_0, &b, &mut out);
    assert_eq!((out[0], out[16], out[31]), (-32.0, 0.0, 30.0));
    // F16 / BF16 / F32.
    let mut o2 = [0.0f32; 2];
    dequantize_row(GgmlType::F16, &[f16b(1.5), f16b(-2.0)].concat(), &mut o2);
    assert_eq!(o2, [1.5, -2.0]);
    dequantize_row(
        GgmlType::Bf16,
        &[
            bf16::from_f32(3.0).to_le_bytes(),
            bf16::from_f32(-0.5).to_le_bytes(),
        ]
        .concat(),
        &mut o2,
    );
    assert_eq!(o2, [3.0, -0.5]);
    dequantize_row(
        GgmlType::F32,
        &[1.25f32.to_le_bytes(), 7.0f32.to_le_bytes()].concat(),
        &mut o2,
    );
    assert_eq!(o2, [1.25, 7.0]);
}

/// Hand-built `Q5_0`, `Q4_K` and `Q6_K` blocks per llama.cpp's definitions.
#[test]
fn k_quant_and_q5_layouts() {
    // Q5_0: d = 0.5, fifth bits set for elements 0..16 only.
    let mut b = f16b(0.5).to_vec();
    b.extend(0x0000_FFFFu32.to_le_bytes());
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut out = [0.0f32; 32];
    dequantize_row(GgmlType::Q5_0, &b, &mut out);
    assert_eq!((out[0], out[15], out[16], out[31]), (0.0, 7.5, -0.5, -8.0));
    // Q4_K: d = 1, dmin = 0.5; sub-block 0: scale 2, min 3 (6-bit fields
    // in bytes 0 and 4); sub-block 4: scale 1 | 1 << 4 = 17, min 2 (low
    // nibbles of byte 8, high bits from bytes 0 and 4); every code 3 (low)
    // or 5 (high).
    let mut b = f16b(1.0).to_vec();
    b.extend(f16b(0.5));
    let mut sc = [0u8; 12];
    sc[0] = 2 | 1 << 6;
    sc[4] = 3;
    sc[8] = 1 | 2 << 4;
    b.extend(sc);
    b.extend([0x53u8; 128]);
    let mut out = [0.0f32; 256];
    dequantize_row(GgmlType::Q4_K, &b, &mut out);
    assert_eq!(out[0], 2.0 * 3.0 - 0.5 * 3.0); // sub-block 0, low nibble
    assert_eq!(out[32], 0.0); // sub-block 1: scale 0, min 0
    assert_eq!(out[128], 17.0 * 3.0 - 0.5 * 2.0); // sub-block 4, low nibble
    // Q6_K: d = 0.25 (last 2 bytes); scales 2, -1, 4, 1 for the four
    // 32-element groups of the first half's lanes 0..16.
    let mut b = vec![0u8; 210];
    b[0] = 0x21; // element 0 low nibble 1, element 64 low nibble 2
    b[32] = 0x0F; // element 32 low nibble 15, element 96 low nibble 0
    b[128] = 0b11_10_01_00; // high 2-bit pairs of elements 0, 32, 64, 96
    b[192] = 2;
    b[194] = (-1i8) as u8;
    b[196] = 4;
    b[198] = 1;
    b[208..210].copy_from_slice(&f16b(0.25));
    dequantize_row(GgmlType::Q6_K, &b, &mut out);
    assert_eq!(out[0], 0.25 * 2.0 * (1 - 32) as f32);
    assert_eq!(out[32], -0.25 * (15 + 16 - 32) as f32);
    assert_eq!(out[64], 0.25 * 4.0 * (2 + 32 - 32) as f32);
    assert_eq!(out[96], 0.25 * 1.0 * (48 - 32) as f32);
}

/// The direct dot products equal dequantize-then-dot for every type.
#[test]
fn dot_equals_dequantized_dot() {
    let n = 512;
    let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 19) as f32 - 9.0) / 7.0).collect();
    let mut xs = Vec::new();
    block_sums(&x, &mut xs);
    for ty in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Bf16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ] {
        let bytes: Vec<u8> = (0..ty.row_bytes(n)).map(|i| (i * 97 % 251) as u8).collect();
        // Keep float scales/values finite: rebuild scale fields as small halves.
        let mut bytes = bytes;
        match ty {
            GgmlType::F32 => {
                for (i, c) in bytes.chunks_exact_mut(4).enumerate() {
                    c.copy_from_slice(&((i as f32) * 0.1 - 3.0).to_le_bytes());
                }
            }
            GgmlType::F16 | GgmlType::Bf16 => {
                for (i, c) in bytes.chunks_exact_mut(2).enumerate() {
                    let v = (i as f32) * 0.1 - 3.0;
                    c.copy_from_slice(&if ty == GgmlType::F16 {
                        f16::from_f32(v).to_le_bytes()
                    } else {
                        bf16::from_f32(v).to_le_bytes()
                    });
                }
            }
            GgmlType::Q6_K => {
                for c in bytes.chunks_exact_mut(210) {
                    c[208..210].copy_from_slice(&f16b(0.37));
                }
            }
            _ => {
                for c in bytes.chunks_exact_mut(ty.block_bytes()) {
                    c[..2].copy_from_slice(&f16b(0.37));
                    if matches!(ty, GgmlType::Q4_1 | GgmlType::Q4_K) {
                        c[2..4].copy_from_slice(&f16b(-0.8));
                    }
                }
            }
        }
        let mut w = vec![0.0f32; n];
        dequantize_row(ty, &bytes, &mut w);
        let want: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
        let got = dot_row(ty, &bytes, &x, &xs);
        assert!(
            (got - want).abs() <= 1e-4 * want.abs().max(1.0),
            "{ty:?}: {got} vs {want}"
        );
    }
}

/// A random `Q4_1` row and a random `Q8_0` row of `nb` blocks each (random
/// scales, minimums and codes).
#[cfg(x86_kernels)]
pub(crate) fn random_rows(rng: &mut rand::rngs::StdRng, nb: usize) -> (Vec<u8>, Vec<u8>) {
    use rand::Rng;
    let mut q41 = Vec::new();
    let mut q80 = Vec::new();
    for _ in 0..nb {
        q41.extend(f16b(rng.random_range(-0.1..0.1)));
        q41.extend(f16b(rng.random_range(-1.0..1.0)));
        q41.extend((0..16).map(|_| rng.random::<u8>()));
        q80.extend(f16b(rng.random_range(-0.1..0.1)));
        q80.extend((0..32).map(|_| rng.random::<u8>()));
    }
    (q41, q80)
}

/// `rows` consecutive rows of [`random_rows`] (`Q4_1`, `Q8_0`).
#[cfg(x86_kernels)]
fn random_row_set(rng: &mut rand::rngs::StdRng, rows: usize, nb: usize) -> (Vec<u8>, Vec<u8>) {
    let (mut q41, mut q80) = (Vec::new(), Vec::new());
    for _ in 0..rows {
        let (a, b) = random_rows(rng, nb);
        q41.extend(a);
        q80.extend(b);
    }
    (q41, q80)
}

/// The AVX2 `Q4_1` and `Q8_0` dots are bitwise equal to the portable loops
/// on random rows (random scales, minimums, codes and inputs, including
/// rows of one block and of SmolLM2's 18 and 48 blocks).
#[cfg(x86_kernels)]
#[test]
fn x86_dots_are_bitwise_equal_to_the_portable_loops() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for &nb in &[1usize, 2, 18, 48, 5] {
        for _ in 0..200 {
            let x: Vec<f32> = (0..32 * nb).map(|_| rng.random_range(-3.0..3.0)).collect();
            let mut xs = Vec::new();
            block_sums(&x, &mut xs);
            let (q41, q80) = random_rows(&mut rng, nb);
            // SAFETY: the features are enabled (cfg); nb blocks each.
            let (a, b) = unsafe {
                (
                    crate::blocks_x86::dot_q4_1(&q41, &x, &xs),
                    crate::blocks_x86::dot_q8_0(&q80, &x),
                )
            };
            assert_eq!(a.to_bits(), dot_q4_1_portable(&q41, &x, &xs).to_bits());
            assert_eq!(b.to_bits(), dot_q8_0_portable(&q80, &x).to_bits());
        }
    }
}

/// The 512-bit kernels, one input and grouped (every group size, tiles of
/// rows for small batches and the rows left over, inputs in any order),
/// against the portable loops, bit for bit. On a CPU without
/// AVX-512F there is nothing to compare (the kernels never run there).
#[cfg(x86_kernels)]
#[test]
fn x86_512_dots_are_bitwise_equal_to_the_portable_loops() {
    use crate::blocks_x86_512 as k;
    use rand::{Rng, SeedableRng};
    if !k::available(GgmlType::Q4_1) {
        eprintln!("no AVX-512F on this CPU: the 512-bit kernels are not compared");
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for &nb in &[1usize, 2, 5, 18, 48] {
        for n in [1usize, 2, 3, 4, 5, 6, 7, 8, 15, 16, 17, 31] {
            let cols = 32 * nb;
            // Inputs of every magnitude's sign; rows taken out of order.
            let x: Vec<f32> = (0..(n + 2) * cols)
                .map(|_| rng.random_range(-3.0f32..3.0) * 2f32.powi(rng.random_range(-8..8)))
                .collect();
            let mut sel: Vec<usize> = (0..n + 2).collect();
            sel.swap(0, n + 1);
            sel.truncate(n);
            sel.reverse();
            // 9 weight rows: whole tiles of 4 or 2 rows and a row left over.
            let rows = 9;
            let (q41, q80) = random_row_set(&mut rng, rows, nb);
            let row = |j: usize| &x[sel[j] * cols..(sel[j] + 1) * cols];
            let mut sums = vec![0.0f32; nb * n];
            let mut s = Vec::new();
            for j in 0..n {
                block_sums(row(j), &mut s);
                for (b, &v) in s.iter().enumerate() {
                    sums[b * n + j] = v;
                }
            }
            for (ty, w) in [(GgmlType::Q4_1, &q41), (GgmlType::Q8_0, &q80)] {
                let rb = ty.row_bytes(cols);
                let want: Vec<u32> = (0..rows * n)
                    .map(|i| {
                        let (wr, j) = (&w[i / n * rb..(i / n + 1) * rb], i % n);
                        block_sums(row(j), &mut s);
                        match ty {
                            GgmlType::Q4_1 => dot_q4_1_portable(wr, row(j), &s),
                            _ => dot_q8_0_portable(wr, row(j)),
                        }
                        .to_bits()
                    })
                    .collect();
                let mut got = vec![f32::NAN.to_bits(); rows * n];
                let inp = k::Inputs {
                    x: &x,
                    sel: &sel,
                    sums: &sums,
                    nb,
                };
                // SAFETY: AVX-512F detected; `rows` rows of nb blocks, nb
                // blocks per input, nb * n sums.
                unsafe {
                    k::dots(ty, w, rows, &inp, |r, j, v| {
                        for (t, v) in v.iter().enumerate() {
                            got[r * n + j + t] = v.to_bits();
                        }
                    })
                };
                assert_eq!(got, want, "{ty:?} nb={nb} n={n}");
                // One input alone, through `dot_row`'s kernels.
                block_sums(row(0), &mut s);
                // SAFETY: as above, one input.
                let one = unsafe {
                    match ty {
                        GgmlType::Q4_1 => k::dot_q4_1(&w[..rb], row(0), &s),
                        _ => k::dot_q8_0(&w[..rb], row(0)),
                    }
                };
                assert_eq!(one.to_bits(), want[0], "{ty:?} nb={nb} alone");
            }
        }
    }
}

/// The single-input matvecs on 256-bit and (where the CPU has AVX-512F)
/// 512-bit registers, four rows side by side, then one at a time, give each
/// row bitwise the portable loop's dot: row counts 1-13 (every split into
/// fours and a remainder), rows of 1-48 blocks.
#[cfg(x86_kernels)]
#[test]
fn x86_row_groups_are_bitwise_equal_to_the_portable_loops() {
    use rand::{Rng, SeedableRng};
    let wide = crate::blocks_x86_512::available(GgmlType::Q4_1);
    if !wide {
        eprintln!("no AVX-512F on this CPU: the 512-bit kernels are not compared");
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    for &nb in &[1usize, 2, 5, 18, 48] {
        let x: Vec<f32> = (0..32 * nb)
            .map(|_| rng.random_range(-3.0f32..3.0) * 2f32.powi(rng.random_range(-8..8)))
            .collect();
        let mut xs = Vec::new();
        block_sums(&x, &mut xs);
        for rows in 1..=13usize {
            let (q41, q80) = random_row_set(&mut rng, rows, nb);
            for (ty, w) in [(GgmlType::Q4_1, &q41), (GgmlType::Q8_0, &q80)] {
                let rb = ty.row_bytes(32 * nb);
                let want: Vec<u32> = (0..rows)
                    .map(|r| {
                        let row = &w[r * rb..(r + 1) * rb];
                        match ty {
                            GgmlType::Q4_1 => dot_q4_1_portable(row, &x, &xs),
                            _ => dot_q8_0_portable(row, &x),
                        }
                        .to_bits()
                    })
                    .collect();
                for k512 in [false, true] {
                    if k512 && !wide {
                        continue;
                    }
                    let mut got = vec![f32::NAN; rows];
                    // SAFETY: AVX2/FMA/F16C (cfg), AVX-512F where `k512`
                    // (detected); `w` holds `rows` rows of `nb` blocks, `xs`
                    // the input's block sums.
                    unsafe {
                        match k512 {
                            true => crate::blocks_x86_512::matvec(ty, w, &x, &xs, &mut got),
                            false => crate::blocks_x86::matvec(ty, w, &x, &xs, &mut got),
                        }
                    };
                    let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "{ty:?} nb={nb} rows={rows} 512-bit={k512}");
                }
            }
        }
    }
}

/// The 512-bit dequantization gives the portable loops' bits, for random
/// blocks (scales and minimums of both signs over many magnitudes) and row
/// lengths of one block to SmolLM2's 48, with a short tail ignored as the
/// portable loop ignores it.
#[cfg(x86_kernels)]
#[test]
fn x86_512_dequantization_is_bitwise_the_portable_loops() {
    use rand::{Rng, SeedableRng};
    if !crate::blocks_x86_512::available(GgmlType::Q4_1) {
        eprintln!("no AVX-512F on this CPU: the 512-bit dequantization is not compared");
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    for &nb in &[1usize, 2, 5, 18, 48] {
        for _ in 0..50 {
            let (mut q41, mut q80) = random_rows(&mut rng, nb);
            // Scales and minimums over many magnitudes (the sums round).
            for (blk, bs) in q41
                .chunks_exact_mut(20)
                .map(|b| (b, 20))
                .chain(q80.chunks_exact_mut(34).map(|b| (b, 34)))
            {
                let e = 2f32.powi(rng.random_range(-12..6));
                blk[..2].copy_from_slice(&f16b(rng.random_range(-1.0..1.0) * e));
                if bs == 20 {
                    blk[2..4].copy_from_slice(&f16b(rng.random_range(-1.0..1.0) * e * 7.0));
                }
            }
            for (ty, row) in [(GgmlType::Q4_1, &q41), (GgmlType::Q8_0, &q80)] {
                let n = 32 * nb + 5;
                let (mut want, mut got) = (vec![-1.0f32; n], vec![-1.0f32; n]);
                dequantize_row_portable(ty, row, &mut want);
                dequantize_row(ty, row, &mut got);
                assert!(
                    want.iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{ty:?} {nb} blocks"
                );
            }
        }
    }
}

/// `rows` random rows of `nb` blocks of `ty` (`Q5_0`, `Q4_K` or `Q6_K`):
/// random codes, scales and minimums (fp16 values over many magnitudes, of
/// both signs).
pub(crate) fn random_k_rows(
    rng: &mut rand::rngs::StdRng,
    ty: GgmlType,
    rows: usize,
    nb: usize,
) -> Vec<u8> {
    use rand::Rng;
    let mut w: Vec<u8> = (0..rows * nb * ty.block_bytes())
        .map(|_| rng.random::<u8>())
        .collect();
    for b in w.chunks_exact_mut(ty.block_bytes()) {
        let mut f = || f16b(rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-12..4)));
        match ty {
            GgmlType::Q5_0 => b[..2].copy_from_slice(&f()),
            GgmlType::Q4_K => {
                b[..2].copy_from_slice(&f());
                b[2..4].copy_from_slice(&f());
            }
            _ => b[208..].copy_from_slice(&f()),
        }
    }
    w
}

/// The 512-bit `Q5_0`, `Q4_K` and `Q6_K` kernels give each row bitwise the
/// portable loop's dot: row counts 1-9 (groups of four and rows left
/// over), rows of one block to Gemma 3's widths (640 columns of `Q5_0`,
/// 1024 and 2048 of the k-quants), and through `dot_row`.
#[cfg(x86_kernels)]
#[test]
fn x86_512_k_quant_dots_are_bitwise_equal_to_the_portable_loops() {
    use crate::kquant_x86_512 as k;
    use rand::{Rng, SeedableRng};
    if !k::available(GgmlType::Q4_K) {
        eprintln!("no AVX-512F on this CPU: the 512-bit k-quant kernels are not compared");
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    for (ty, widths) in [
        (GgmlType::Q5_0, &[32usize, 64, 160, 640][..]),
        (GgmlType::Q4_K, &[256, 512, 1024, 2048][..]),
        (GgmlType::Q6_K, &[256, 512, 1024, 2048][..]),
    ] {
        for &cols in widths {
            let x: Vec<f32> = (0..cols)
                .map(|_| rng.random_range(-3.0f32..3.0) * 2f32.powi(rng.random_range(-8..8)))
                .collect();
            let mut xs = Vec::new();
            block_sums(&x, &mut xs);
            for rows in 1..=9usize {
                let w = random_k_rows(&mut rng, ty, rows, cols / ty.block_size());
                let rb = ty.row_bytes(cols);
                let portable = |row: &[u8]| match ty {
                    GgmlType::Q5_0 => dot_q5_0_portable(row, &x),
                    GgmlType::Q4_K => dot_q4_k_portable(row, &x, &xs),
                    _ => dot_q6_k_portable(row, &x),
                };
                let want: Vec<u32> = w.chunks_exact(rb).map(|r| portable(r).to_bits()).collect();
                let mut got = vec![f32::NAN; rows];
                // SAFETY: AVX-512F detected; `w` holds `rows` rows of `cols`
                // weights, `xs` the input's block sums.
                unsafe { k::matvec(ty, &w, &x, &xs, &mut got) };
                let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "{ty:?} cols={cols} rows={rows}");
                assert_eq!(dot_row(ty, &w[..rb], &x, &xs).to_bits(), want[0]);
            }
        }
    }
}

/// The 512-bit dequantization of `Q5_0`, `Q4_K` and `Q6_K` rows gives the
/// portable loops' bits (random codes, scales and minimums; rows of one
/// block to Gemma 3's widths, with a short tail left alone as the portable
/// loop leaves it).
#[cfg(x86_kernels)]
#[test]
fn x86_512_k_quant_dequantization_is_bitwise_the_portable_loops() {
    use rand::SeedableRng;
    if !crate::kquant_x86_512::available(GgmlType::Q4_K) {
        eprintln!("no AVX-512F on this CPU: the 512-bit dequantization is not compared");
        return;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(15);
    for ty in [GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        for nb in [1usize, 2, 3, 8, 20] {
            for _ in 0..20 {
                let row = random_k_rows(&mut rng, ty, 1, nb);
                let n = ty.block_size() * nb + 5;
                let (mut want, mut got) = (vec![-1.0f32; n], vec![-1.0f32; n]);
                dequantize_row_portable(ty, &row, &mut want);
                dequantize_row(ty, &row, &mut got);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{ty:?} {nb} blocks");
            }
        }
    }
}
