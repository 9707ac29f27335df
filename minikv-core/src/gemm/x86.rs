//! The products' kernels on x86-64: 512-bit registers (AVX-512F) and
//! 256-bit ones (AVX2 with FMA), the two kernels `matrixmultiply` itself
//! picks on those CPUs, with its sums (see the parent module).
//!
//! A tile is `R` output rows by `NV` vectors of columns; its sums stay in
//! registers over the whole inner dimension, each step loading the `NV`
//! vectors of `b`'s row once for all `R` rows and broadcasting one element
//! of `a` per row. 6 x 4 tiles of 16 lanes hold 24 sums in the 32 512-bit
//! registers; 4 x 2 tiles of 8 lanes hold 8 in the 16 256-bit ones.

use std::arch::x86_64::*;

/// One product's operands and shape along the inner dimension: `a` (`m x
/// k`, any strides), `b` (`k x n`, rows `rsb` apart, columns contiguous),
/// `c` (`m x n`, rows `rsc` apart), stored (`add` false) or added to.
pub(super) struct Product {
    k: usize,
    a: *const f32,
    rsa: usize,
    csa: usize,
    b: *const f32,
    rsb: usize,
    add: bool,
    c: *mut f32,
    rsc: usize,
}

impl Product {
    /// The operands' pointers and strides.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        k: usize,
        a: &[f32],
        (rsa, csa): (usize, usize),
        b: &[f32],
        rsb: usize,
        add: bool,
        c: &mut [f32],
        rsc: usize,
    ) -> Self {
        Self {
            k,
            a: a.as_ptr(),
            rsa,
            csa,
            b: b.as_ptr(),
            rsb,
            add,
            c: c.as_mut_ptr(),
            rsc,
        }
    }
}

/// A tile's view of the product: `a` at its first row, `b` and `c` at its
/// first column; `valid` lanes of its last vector are columns.
struct Tile<'a> {
    p: &'a Product,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    valid: usize,
}

/// Walks the product in tiles of up to `mr` rows and `lanes * nv` columns
/// and calls `run(tile, rows, vectors)` for each.
///
/// # Safety
/// The operands are valid for `m x n` and the product's strides.
#[inline(always)]
unsafe fn tiles(
    m: usize,
    n: usize,
    p: &Product,
    (mr, lanes, nv): (usize, usize, usize),
    mut run: impl FnMut(&Tile<'_>, usize, usize),
) {
    let mut j0 = 0;
    while j0 < n {
        let w = (n - j0).min(lanes * nv);
        let mut i0 = 0;
        while i0 < m {
            let rows = (m - i0).min(mr);
            // SAFETY: (i0, j0) lies within the caller's shapes.
            let t = unsafe {
                Tile {
                    p,
                    a: p.a.add(i0 * p.rsa),
                    b: p.b.add(j0),
                    c: p.c.add(i0 * p.rsc + j0),
                    valid: w - (w.div_ceil(lanes) - 1) * lanes,
                }
            };
            run(&t, rows, w.div_ceil(lanes));
            i0 += rows;
        }
        j0 += w;
    }
}

/// `c (+)= a b` on 512-bit registers.
///
/// # Safety
/// AVX-512F; the operands as [`Product`] says, for `m x n`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn gemm512(m: usize, n: usize, p: &Product) {
    // SAFETY: the caller's.
    unsafe {
        tiles(m, n, p, (6, 16, 4), |t, rows, nv| match (rows, nv) {
            (1, 1) => t.k512::<1, 1>(),
            (1, 2) => t.k512::<1, 2>(),
            (1, 3) => t.k512::<1, 3>(),
            (1, _) => t.k512::<1, 4>(),
            (2, 1) => t.k512::<2, 1>(),
            (2, 2) => t.k512::<2, 2>(),
            (2, 3) => t.k512::<2, 3>(),
            (2, _) => t.k512::<2, 4>(),
            (3, 1) => t.k512::<3, 1>(),
            (3, 2) => t.k512::<3, 2>(),
            (3, 3) => t.k512::<3, 3>(),
            (3, _) => t.k512::<3, 4>(),
            (4, 1) => t.k512::<4, 1>(),
            (4, 2) => t.k512::<4, 2>(),
            (4, 3) => t.k512::<4, 3>(),
            (4, _) => t.k512::<4, 4>(),
            (5, 1) => t.k512::<5, 1>(),
            (5, 2) => t.k512::<5, 2>(),
            (5, 3) => t.k512::<5, 3>(),
            (5, _) => t.k512::<5, 4>(),
            (_, 1) => t.k512::<6, 1>(),
            (_, 2) => t.k512::<6, 2>(),
            (_, 3) => t.k512::<6, 3>(),
            (_, _) => t.k512::<6, 4>(),
        })
    }
}

/// `c (+)= a b` on 256-bit registers.
///
/// # Safety
/// AVX2 and FMA; the operands as [`Product`] says, for `m x n`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn gemm256(m: usize, n: usize, p: &Product) {
    // SAFETY: the caller's.
    unsafe {
        tiles(m, n, p, (4, 8, 2), |t, rows, nv| match (rows, nv) {
            (1, 1) => t.k256::<1, 1>(),
            (1, _) => t.k256::<1, 2>(),
            (2, 1) => t.k256::<2, 1>(),
            (2, _) => t.k256::<2, 2>(),
            (3, 1) => t.k256::<3, 1>(),
            (3, _) => t.k256::<3, 2>(),
            (_, 1) => t.k256::<4, 1>(),
            (_, _) => t.k256::<4, 2>(),
        })
    }
}

impl Tile<'_> {
    /// Element `(r, q)` of the tile's `a`.
    ///
    /// # Safety
    /// Within the product.
    #[inline(always)]
    unsafe fn a_at(&self, r: usize, q: usize) -> *const f32 {
        unsafe { self.a.add(r * self.p.rsa + q * self.p.csa) }
    }

    /// `R` x `NV` sums on 512-bit registers: from zero, one fused
    /// multiply-add per step of the inner dimension in order, then stored
    /// or added once to `c` (the last vector masked to its valid lanes).
    ///
    /// # Safety
    /// As [`gemm512`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn k512<const R: usize, const NV: usize>(&self) {
        let last = ((1u32 << self.valid) - 1) as u16;
        let mask = |v: usize| if v + 1 == NV { last } else { u16::MAX };
        let mut acc = [[_mm512_setzero_ps(); NV]; R];
        for q in 0..self.p.k {
            // SAFETY: row `q` of `b`, the tile's columns (masked lanes are
            // not read); column `q` of `a`'s rows.
            unsafe {
                let bq = self.b.add(q * self.p.rsb);
                let mut bv = [_mm512_setzero_ps(); NV];
                for (v, x) in bv.iter_mut().enumerate() {
                    *x = _mm512_maskz_loadu_ps(mask(v), bq.add(16 * v));
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(*self.a_at(r, q));
                    for (x, bx) in row.iter_mut().zip(&bv) {
                        *x = _mm512_fmadd_ps(av, *bx, *x);
                    }
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                // SAFETY: row `r` of `c`, the tile's columns.
                unsafe {
                    let cp = self.c.add(r * self.p.rsc + 16 * v);
                    let out = if self.p.add {
                        _mm512_add_ps(_mm512_maskz_loadu_ps(mask(v), cp), *x)
                    } else {
                        *x
                    };
                    _mm512_mask_storeu_ps(cp, mask(v), out);
                }
            }
        }
    }

    /// [`Self::k512`] on 256-bit registers.
    ///
    /// # Safety
    /// As [`gemm256`].
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn k256<const R: usize, const NV: usize>(&self) {
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let last = _mm256_cmpgt_epi32(_mm256_set1_epi32(self.valid as i32), lanes);
        let mask = |v: usize| {
            if v + 1 == NV {
                last
            } else {
                _mm256_set1_epi32(-1)
            }
        };
        let mut acc = [[_mm256_setzero_ps(); NV]; R];
        for q in 0..self.p.k {
            // SAFETY: as in `k512`.
            unsafe {
                let bq = self.b.add(q * self.p.rsb);
                let mut bv = [_mm256_setzero_ps(); NV];
                for (v, x) in bv.iter_mut().enumerate() {
                    *x = _mm256_maskload_ps(bq.add(8 * v), mask(v));
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let av = _mm256_set1_ps(*self.a_at(r, q));
                    for (x, bx) in row.iter_mut().zip(&bv) {
                        *x = _mm256_fmadd_ps(av, *bx, *x);
                    }
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                // SAFETY: as in `k512`.
                unsafe {
                    let cp = self.c.add(r * self.p.rsc + 8 * v);
                    let out = if self.p.add {
                        _mm256_add_ps(_mm256_maskload_ps(cp, mask(v)), *x)
                    } else {
                        *x
                    };
                    _mm256_maskstore_ps(cp, mask(v), out);
                }
            }
        }
    }
}
