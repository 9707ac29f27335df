//! The tiled backend's block products, `c = a b` or `c += a b`, for one
//! block of query rows against one block of keys (the scores `Q K^T`, then
//! `P V`).
//!
//! Both products have the shape a general matrix library packs before it
//! multiplies: at a head dimension of 64 a block is 64 x 64 x 64, and
//! `matrixmultiply` copied both operands into its panels on every call (in
//! a 4096-token prefill the copies took about 40% as long as the products).
//! Here the left operand is read where it lies (one broadcast per element)
//! and the right one must have contiguous rows: the values do, and the
//! backend lays the keys out transposed once per call ([`transpose_keys`]),
//! each key block a `d x block` panel of its own.
//!
//! Each output is `matrixmultiply`'s on a CPU with AVX-512 or with AVX2 and
//! FMA, bit for bit: a sum started from zero and taken by fused
//! multiply-adds in the order of the inner dimension, then stored
//! (`beta = 0`) or added once to what the output held (`beta = 1`). On other
//! CPUs, with another `beta`, or past `matrixmultiply`'s single pass over
//! the inner dimension, the call goes to `matrixmultiply` itself.

/// Inner dimensions `matrixmultiply` sums in one pass (its `kc` for f32);
/// past it a sum would be split in two, so such calls go to it.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const ONE_PASS: usize = 256;

/// `c = a(m x k) * b(k x n) + beta * c`, with `beta` 0 or 1 and explicit
/// strides (`c`'s columns contiguous).
#[allow(clippy::too_many_arguments)]
#[inline]
pub(super) fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
    beta: f32,
    c: &mut [f32],
    rsc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.len() > (m - 1) * rsa + (k.max(1) - 1) * csa);
    assert!(b.len() > (k.max(1) - 1) * rsb + (n - 1) * csb);
    assert!(c.len() > (m - 1) * rsc + (n - 1));
    #[cfg(target_arch = "x86_64")]
    if csb == 1 && (1..=ONE_PASS).contains(&k) && (beta == 0.0 || beta == 1.0) {
        let p = x86::Product::new(k, a, (rsa, csa), b, rsb, beta == 1.0, c, rsc);
        // `matrixmultiply`'s own choice of kernel, whose sums these are.
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was detected; the asserts above keep every
            // element the product reads or writes inside the slices.
            unsafe { x86::gemm512(m, n, &p) };
            return;
        }
        if std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            unsafe { x86::gemm256(m, n, &p) };
            return;
        }
    }
    // SAFETY: as above.
    unsafe { sgemm((m, k, n), a, (rsa, csa), b, (rsb, csb), beta, c, rsc) }
}

/// `matrixmultiply::sgemm` with `alpha = 1` and `c`'s columns contiguous.
///
/// # Safety
/// The shapes and strides keep every element inside the slices.
#[allow(clippy::too_many_arguments)]
unsafe fn sgemm(
    (m, k, n): (usize, usize, usize),
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
    beta: f32,
    c: &mut [f32],
    rsc: usize,
) {
    // SAFETY: the caller's.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr(),
            rsc as isize,
            1,
        )
    }
}

/// The keys `lo .. t` of one KV head (`[t][d]`), transposed into panels of
/// `bk` keys: key `lo + p bk + j`'s channel `c` at `p bk d + c bk + j`, the
/// last panel padded with zeros.
pub(super) fn transpose_keys(k: &[f32], d: usize, lo: usize, bk: usize) -> Vec<f32> {
    let t = k.len() / d;
    let mut out = vec![0.0; (t - lo).div_ceil(bk) * bk * d];
    for (p, panel) in out.chunks_exact_mut(bk * d).enumerate() {
        let j0 = lo + p * bk;
        let keys = &k[j0 * d..(j0 + bk).min(t) * d];
        for (c, row) in panel.chunks_exact_mut(bk).enumerate() {
            for (x, key) in row.iter_mut().zip(keys.chunks_exact(d)) {
                *x = key[c];
            }
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn data(n: usize, s: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(s);
        // Mixed magnitudes, so that a different order of the sums shows in
        // the last bits.
        (0..n)
            .map(|_| {
                rng.random_range(-0.5f32..0.5) * [1.0, 1e-3, 37.0, 1e3][rng.random_range(0..4)]
            })
            .collect()
    }

    /// A product `(m, k, n, a, (rsa, csa), b, rsb, beta, c, rsc)`.
    type Gemm =
        dyn Fn(usize, usize, usize, &[f32], (usize, usize), &[f32], usize, f32, &mut [f32], usize);

    /// Shapes past each kernel's tiles in rows and columns, inner dimensions
    /// from 1 to one past `matrixmultiply`'s single pass, both strides of
    /// `a`, both `beta`: `product` gives `matrixmultiply`'s bits.
    fn check(name: &str, product: &Gemm) {
        for &(m, k, n) in &[
            (64, 64, 64),
            (1, 1, 1),
            (7, 64, 13),
            (13, 5, 64),
            (6, 64, 17),
            (65, 256, 80),
            (3, 257, 20),
            (8, 33, 130),
        ] {
            for beta in [0.0f32, 1.0] {
                for (rsa, csa) in [(k + 3, 1), (1, m + 1)] {
                    let a = data(m * k + m * rsa + k * csa, 1);
                    let rsb = n + 5;
                    let b = data(k * rsb, 2);
                    let c0 = data(m * (n + 2), 3);
                    let mut want = c0.clone();
                    let sb = (rsb, 1);
                    // SAFETY: the shapes and strides fit the slices.
                    unsafe { sgemm((m, k, n), &a, (rsa, csa), &b, sb, beta, &mut want, n + 2) };
                    let mut got = c0.clone();
                    product(m, k, n, &a, (rsa, csa), &b, rsb, beta, &mut got, n + 2);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "{name} ({m}, {k}, {n}) beta {beta} strides ({rsa}, {csa}): element {i}: {g} != {w}"
                        );
                    }
                }
            }
        }
    }

    /// The block products give `matrixmultiply`'s bits: through the
    /// dispatch, and each x86 kernel the CPU has on its own (an AVX-512
    /// machine checks the 256-bit kernel too).
    #[test]
    fn block_products_have_matrixmultiplys_bits() {
        check("gemm", &|m, k, n, a, sa, b, rsb, beta, c, rsc| {
            gemm(m, k, n, a, sa, b, (rsb, 1), beta, c, rsc)
        });
        #[cfg(target_arch = "x86_64")]
        {
            let direct = |wide: bool| {
                move |m, k, n, a: &[f32], (rsa, csa), b: &[f32], rsb, beta, c: &mut [f32], rsc| {
                    if k > ONE_PASS {
                        return gemm(m, k, n, a, (rsa, csa), b, (rsb, 1), beta, c, rsc);
                    }
                    let p = x86::Product::new(k, a, (rsa, csa), b, rsb, beta == 1.0, c, rsc);
                    // SAFETY: the features were detected by the caller; the
                    // shapes fit the slices.
                    unsafe {
                        if wide {
                            x86::gemm512(m, n, &p)
                        } else {
                            x86::gemm256(m, n, &p)
                        }
                    }
                }
            };
            if std::is_x86_feature_detected!("avx512f") {
                check("gemm512", &direct(true));
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                check("gemm256", &direct(false));
            }
        }
    }

    #[test]
    fn transposed_keys_are_in_panels() {
        let (t, d, bk, lo) = (11, 3, 4, 2);
        let k: Vec<f32> = (0..t * d).map(|x| x as f32).collect();
        let kt = transpose_keys(&k, d, lo, bk);
        // Keys 2..11: panels of 4, 4 and 1 (padded).
        assert_eq!(kt.len(), 3 * bk * d);
        for j in lo..t {
            let (p, jj) = ((j - lo) / bk, (j - lo) % bk);
            for c in 0..d {
                assert_eq!(kt[p * bk * d + c * bk + jj], k[j * d + c]);
            }
        }
        assert!(
            kt[2 * bk * d + 1..2 * bk * d + bk]
                .iter()
                .all(|&x| x == 0.0)
        );
    }
}
