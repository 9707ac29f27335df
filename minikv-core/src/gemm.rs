//! f32 matrix products with `matrixmultiply`'s bits, without its packing:
//! `c = a b` or `c += a b`.
//!
//! A general matrix library copies both operands into panels on every
//! call. When one operand is small or the call is one of many small ones,
//! the copies cost as much as the products: the tiled attention's block
//! products (64 x 64 x 64 at a head dimension of 64; in a 4096-token
//! prefill `matrixmultiply`'s copies took about 40% as long as its
//! products) and a prompt chunk of a few tokens against a weight matrix
//! (every weight copied for a few multiply-adds each). Here the left
//! operand is read where it lies (one broadcast per element) and the right
//! one must have contiguous rows; a caller whose right operand has not
//! (the keys of the scores `Q K^T`, the inputs of a weight product) lays it
//! out transposed once.
//!
//! Each output is `matrixmultiply`'s on a CPU with AVX-512 or with AVX2 and
//! FMA, bit for bit: the inner dimension split into its passes of
//! [`ONE_PASS`], each pass's sum started from zero and taken by fused
//! multiply-adds in the order of the inner dimension, then stored (the
//! first pass with `beta = 0`) or added once to what the output held. So a
//! caller may switch between this and `matrixmultiply::sgemm` (with `alpha
//! = 1`) without changing a bit, and an output's value does not depend on
//! the shape of the product it was computed in. On other CPUs, or with
//! another `beta`, the call goes to `matrixmultiply` itself.
//!
//! ```
//! use minikv_core::gemm::gemm;
//!
//! // c (2 x 3) = a (2 x 300) b (300 x 3): two passes over the inner dimension.
//! let (m, k, n) = (2, 300, 3);
//! let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
//! let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
//! let mut c = vec![0.0; m * n];
//! gemm(m, k, n, &a, (k, 1), &b, (n, 1), 0.0, &mut c, n);
//! let mut want = vec![0.0; m * n];
//! // SAFETY: the shapes and strides fit the slices.
//! unsafe {
//!     matrixmultiply::sgemm(
//!         m, k, n, 1.0, a.as_ptr(), k as isize, 1, b.as_ptr(), n as isize, 1, 0.0,
//!         want.as_mut_ptr(), n as isize, 1,
//!     )
//! };
//! assert_eq!(c, want);
//! ```

/// The inner dimensions `matrixmultiply` sums in one pass (its `kc` for
/// f32, 256): a longer inner dimension is summed in passes of this many,
/// each pass's sum added to the output.
pub const ONE_PASS: usize = 256;

/// `c = a(m x k) * b(k x n) + beta * c` with explicit strides (`(rows,
/// columns)` for `a` and `b`; `c`'s rows `rsc` apart, its columns
/// contiguous), with `matrixmultiply::sgemm`'s bits (`alpha = 1`; see the
/// module doc). Fast when `beta` is 0 or 1 and `b`'s columns are contiguous
/// (`b.1 == 1`) on a CPU with AVX-512F or with AVX2 and FMA.
///
/// # Panics
/// If the shapes and strides reach past a slice.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn gemm(
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
    if csb == 1 && k > 0 && (beta == 0.0 || beta == 1.0) {
        // `matrixmultiply`'s own choice of kernel, whose sums these are.
        let kernel: Option<Kernel> = if crate::cpu::avx512() {
            Some(x86::gemm512)
        } else if std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("avx2") {
            Some(x86::gemm256)
        } else {
            None
        };
        if let Some(kernel) = kernel {
            // SAFETY: the kernel's features were detected; the asserts above
            // keep every element it reads or writes inside the slices.
            unsafe {
                in_passes(
                    kernel,
                    (m, k, n),
                    a,
                    (rsa, csa),
                    b,
                    rsb,
                    beta == 1.0,
                    c,
                    rsc,
                )
            };
            return;
        }
    }
    // SAFETY: as above.
    unsafe { sgemm((m, k, n), a, (rsa, csa), b, (rsb, csb), beta, c, rsc) }
}

/// Rows `lo .. t` of a `[t][d]` matrix (`rows`) transposed into panels of
/// `bk` rows, the layout [`gemm`]'s right operand needs when the product
/// reads those rows as its columns (the keys of the scores `Q K^T`): the
/// element `c` of row `lo + p bk + j` at `p bk d + c bk + j`, the last panel
/// padded with zeros.
///
/// # Panics
/// If `lo` is past the rows or `bk` is 0.
pub fn transpose_panels(rows: &[f32], d: usize, lo: usize, bk: usize) -> Vec<f32> {
    let t = rows.len() / d;
    let mut out = vec![0.0; (t - lo).div_ceil(bk) * bk * d];
    for (p, panel) in out.chunks_exact_mut(bk * d).enumerate() {
        let j0 = lo + p * bk;
        let keys = &rows[j0 * d..(j0 + bk).min(t) * d];
        for (c, row) in panel.chunks_exact_mut(bk).enumerate() {
            for (x, key) in row.iter_mut().zip(keys.chunks_exact(d)) {
                *x = key[c];
            }
        }
    }
    out
}

/// A kernel of [`x86`]: `c (+)= a b` for `m x n` outputs over one pass.
#[cfg(target_arch = "x86_64")]
type Kernel = unsafe fn(usize, usize, &x86::Product);

/// `kernel` over `matrixmultiply`'s passes of the inner dimension: the
/// first stores its sums (or adds them, `add`), each later one adds them.
///
/// # Safety
/// The kernel's CPU features are available; the shapes and strides keep
/// every element inside the slices; `k > 0`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn in_passes(
    kernel: Kernel,
    (m, k, n): (usize, usize, usize),
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    rsb: usize,
    add: bool,
    c: &mut [f32],
    rsc: usize,
) {
    for (pass, q0) in (0..k).step_by(ONE_PASS).enumerate() {
        let p = x86::Product::new(
            ONE_PASS.min(k - q0),
            &a[q0 * csa..],
            (rsa, csa),
            &b[q0 * rsb..],
            rsb,
            add || pass > 0,
            c,
            rsc,
        );
        // SAFETY: the caller's.
        unsafe { kernel(m, n, &p) };
    }
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
    /// from 1 to several of `matrixmultiply`'s passes, both strides of `a`,
    /// both `beta`: `product` gives `matrixmultiply`'s bits.
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
            // Several passes over the inner dimension: a weight product's.
            (7, 576, 19),
            (13, 1536, 3),
            (2, 513, 70),
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

    /// The products give `matrixmultiply`'s bits: through the
    /// dispatch, and each x86 kernel the CPU has on its own (an AVX-512
    /// machine checks the 256-bit kernel too).
    #[test]
    fn products_have_matrixmultiplys_bits() {
        check("gemm", &|m, k, n, a, sa, b, rsb, beta, c, rsc| {
            gemm(m, k, n, a, sa, b, (rsb, 1), beta, c, rsc)
        });
        #[cfg(target_arch = "x86_64")]
        {
            let direct = |kernel: Kernel| {
                move |m, k, n, a: &[f32], sa, b: &[f32], rsb, beta, c: &mut [f32], rsc| {
                    // SAFETY: the features were detected by the caller; the
                    // shapes fit the slices.
                    unsafe { in_passes(kernel, (m, k, n), a, sa, b, rsb, beta == 1.0, c, rsc) }
                }
            };
            if std::is_x86_feature_detected!("avx512f") {
                check("gemm512", &direct(x86::gemm512));
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                check("gemm256", &direct(x86::gemm256));
            }
        }
    }

    #[test]
    fn transposed_rows_are_in_panels() {
        let (t, d, bk, lo) = (11, 3, 4, 2);
        let k: Vec<f32> = (0..t * d).map(|x| x as f32).collect();
        let kt = transpose_panels(&k, d, lo, bk);
        // Rows 2..11: panels of 4, 4 and 1 (padded).
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
