//! CPU SIMD-friendly numeric helpers (dot, axpy, softmax pieces) written so that
//! the compiler vectorizes them. (The CUDA kernels live in the `minikv-kernels` crate.)

/// `a * b + c`, fused where the target has FMA (a plain multiply-add otherwise,
/// never a slow libm call).
#[inline(always)]
pub fn fmadd(a: f32, b: f32, c: f32) -> f32 {
    #[cfg(target_feature = "fma")]
    {
        a.mul_add(b, c)
    }
    #[cfg(not(target_feature = "fma"))]
    {
        a * b + c
    }
}

/// Dot product with 8 independent accumulators (vectorizes to SIMD FMAs).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] = fmadd(x[i], y[i], acc[i]);
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// Four dot products of `q` with rows `r`, interleaved so that the four
/// dependency chains overlap; each is computed exactly as [`dot`] computes
/// it (same lanes, same reduction), so results are bitwise equal.
#[inline]
pub fn dot4(q: &[f32], r: [&[f32]; 4]) -> [f32; 4] {
    let n = q.len().min(r.iter().map(|x| x.len()).min().unwrap_or(0));
    let full = n - n % 8;
    let (mut a0, mut a1, mut a2, mut a3) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
    let it = q[..full]
        .chunks_exact(8)
        .zip(r[0][..full].chunks_exact(8))
        .zip(r[1][..full].chunks_exact(8))
        .zip(r[2][..full].chunks_exact(8))
        .zip(r[3][..full].chunks_exact(8));
    for ((((x, y0), y1), y2), y3) in it {
        for l in 0..8 {
            a0[l] = fmadd(x[l], y0[l], a0[l]);
            a1[l] = fmadd(x[l], y1[l], a1[l]);
            a2[l] = fmadd(x[l], y2[l], a2[l]);
            a3[l] = fmadd(x[l], y3[l], a3[l]);
        }
    }
    let red = |a: &[f32; 8]| (a[0] + a[4]) + (a[1] + a[5]) + ((a[2] + a[6]) + (a[3] + a[7]));
    let mut out = [red(&a0), red(&a1), red(&a2), red(&a3)];
    for (k, o) in out.iter_mut().enumerate() {
        for j in full..n {
            *o += q[j] * r[k][j];
        }
    }
    out
}

/// `y += p[0] r[0] + p[1] r[1] + p[2] r[2] + p[3] r[3]`, applied row after
/// row with fused multiply-adds exactly as four [`axpy`] calls would (bitwise
/// equal), with `y` kept in registers across the four rows.
#[inline]
pub fn axpy4(p: [f32; 4], r: [&[f32]; 4], y: &mut [f32]) {
    let n = y.len();
    let (r0, r1, r2, r3) = (&r[0][..n], &r[1][..n], &r[2][..n], &r[3][..n]);
    for c in 0..n {
        let mut v = fmadd(p[0], r0[c], y[c]);
        v = fmadd(p[1], r1[c], v);
        v = fmadd(p[2], r2[c], v);
        y[c] = fmadd(p[3], r3[c], v);
    }
}

/// `y += a * x`.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y = fmadd(a, *x, *y);
    }
}

/// `exp(x)` for `x <= 0` (softmax arguments), written to vectorize: range
/// reduction `x = k ln2 + r`, degree-6 polynomial on `|r| <= ln2/2`, exponent
/// bits built directly. Relative error below 3e-7 for `x > -20` and 5e-7 down
/// to -87 (the split of `k ln2` leaves about 2e-9 per unit of `k`); `exp(-inf) = 0`; inputs
/// below -87.3 flush to 0.
#[inline(always)]
pub fn exp_neg(x: f32) -> f32 {
    let x = x.max(-87.3);
    let k = (x * std::f32::consts::LOG2_E).round();
    let r = fmadd(k, -0.693_145_75, x);
    let r = fmadd(k, -1.428_606_8e-6, r);
    let mut p = 1.0 / 720.0;
    p = fmadd(p, r, 1.0 / 120.0);
    p = fmadd(p, r, 1.0 / 24.0);
    p = fmadd(p, r, 1.0 / 6.0);
    p = fmadd(p, r, 0.5);
    p = fmadd(p, r, 1.0);
    p = fmadd(p, r, 1.0);
    // `k` is integral with |k| < 2^22, so `k + 1.5 * 2^23` is exact and its bits
    // are `0x4B40_0000 + k`: the exponent field comes from integer arithmetic
    // that vectorizes (`k as i32` saturates and is scalarized lane by lane).
    let kb = (k + 12_582_912.0).to_bits().wrapping_sub(0x4B40_0000 - 127);
    let scale = f32::from_bits(kb << 23);
    if x <= -87.3 { 0.0 } else { p * scale }
}

/// `x[i] = exp(x[i] - m)` for all `i` ([`exp_neg`]; `m` at least every
/// `x[i]`); returns the sum: lane `i % 16` of 16 accumulates element `i` in
/// order, the lanes are added first to last, then the remainder. On a CPU
/// with AVX-512 (in a build with FMA) one 512-bit loop gives the same bits
/// with fewer instructions.
#[inline]
pub fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
    #[cfg(all(target_arch = "x86_64", target_feature = "fma"))]
    if crate::cpu::avx512() {
        // SAFETY: the feature was detected.
        return unsafe { exp512::exp_sub_sum(x, m) };
    }
    exp_sub_sum_portable(x, m)
}

/// [`exp_sub_sum`] in plain Rust that the compiler vectorizes.
#[inline]
fn exp_sub_sum_portable(x: &mut [f32], m: f32) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        for i in 0..16 {
            c[i] = exp_neg(c[i] - m);
            acc[i] += c[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp_neg(*v - m);
        s += *v;
    }
    s
}

/// [`exp_sub_sum`] on 512-bit registers, bit for bit [`exp_neg`] per element.
#[cfg(all(target_arch = "x86_64", target_feature = "fma"))]
mod exp512 {
    use std::arch::x86_64::*;

    /// The loop's constants: the maximum, the clamp, `log2(e)`, 0.49999997
    /// and the sign mask.
    #[derive(Clone, Copy)]
    struct Consts {
        vm: __m512,
        lo: __m512,
        l2e: __m512,
        half: __m512i,
        sign: __m512i,
    }

    /// Per 16 scores: the clamp at -87.3 becomes the final zeroing mask
    /// alone (a lane at or below it, `-inf` or NaN is 0 whatever its
    /// polynomial gave, as in [`super::exp_neg`]), and the power of two is
    /// one `vscalefps` (`p * 2^k`, exact as the product with the built
    /// `2^k`, rounded the same where it is subnormal). `round` is half away
    /// from zero as `f32::round`: `trunc(y + copysign(0.49999997, y))`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
        let set = _mm512_set1_ps;
        let c = Consts {
            vm: set(m),
            lo: set(-87.3),
            l2e: set(std::f32::consts::LOG2_E),
            half: _mm512_castps_si512(set(0.499_999_97)),
            sign: _mm512_set1_epi32(i32::MIN),
        };
        let mut acc = _mm512_setzero_ps();
        let wide = x.len() - x.len() % 128;
        for ch in x[..wide].chunks_exact_mut(128) {
            // SAFETY: the chunk holds 8 vectors; the features are on.
            unsafe { vectors::<8>(ch.as_mut_ptr(), c, &mut acc) };
        }
        let n = x.len() - x.len() % 16;
        for ch in x[wide..n].chunks_exact_mut(16) {
            // SAFETY: as above, one vector.
            unsafe { vectors::<1>(ch.as_mut_ptr(), c, &mut acc) };
        }
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` holds 16 floats.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        let mut s: f32 = lanes.iter().sum();
        for v in &mut x[n..] {
            *v = super::exp_neg(*v - m);
            s += *v;
        }
        s
    }

    /// `U` vectors from `ptr` in place, added to `acc` in order. Each step
    /// runs over the `U` vectors before the next: the polynomial is a chain
    /// of dependent multiply-adds, and `U` of them side by side in the code
    /// keep the multiply-add pipes busy where one vector at a time filled
    /// the scheduler with waiting operations (8 measured 18% faster per
    /// vector than 1). Every lane takes the same operations as one vector
    /// at a time.
    ///
    /// # Safety
    /// AVX-512F; `ptr` is valid for `16 U` floats.
    #[inline]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn vectors<const U: usize>(ptr: *mut f32, c: Consts, acc: &mut __m512) {
        let set = _mm512_set1_ps;
        let zero = _mm512_setzero_ps();
        let (mut xv, mut keep, mut k) = ([zero; U], [0u16; U], [zero; U]);
        for u in 0..U {
            // SAFETY: the vector lies within the caller's `16 U` floats. An
            // all-lanes masked load and store, not `_mm512_loadu_ps` /
            // `_mm512_storeu_ps`: with debug assertions (the tests' profile)
            // std's checks in those send each vector through the stack in
            // halves that store forwarding cannot serve; in release builds
            // the two forms are the same instruction.
            xv[u] = _mm512_sub_ps(
                unsafe { _mm512_maskz_loadu_ps(0xFFFF, ptr.add(16 * u)) },
                c.vm,
            );
            keep[u] = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(xv[u], c.lo);
            let y = _mm512_mul_ps(xv[u], c.l2e);
            // half | (y & sign): 0.49999997 with y's sign.
            let hs = _mm512_ternarylogic_epi32::<0xf8>(c.half, _mm512_castps_si512(y), c.sign);
            k[u] = _mm512_roundscale_ps::<0x0b>(_mm512_add_ps(y, _mm512_castsi512_ps(hs)));
        }
        let mut r = [zero; U];
        for u in 0..U {
            r[u] = _mm512_fmadd_ps(k[u], set(-0.693_145_75), xv[u]);
        }
        for u in 0..U {
            r[u] = _mm512_fmadd_ps(k[u], set(-1.428_606_8e-6), r[u]);
        }
        let mut p = [set(1.0 / 720.0); U];
        for coef in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            for u in 0..U {
                p[u] = _mm512_fmadd_ps(p[u], r[u], set(coef));
            }
        }
        for u in 0..U {
            let e = _mm512_maskz_scalef_ps(keep[u], p[u], k[u]);
            // SAFETY: as the load.
            unsafe { _mm512_mask_storeu_ps(ptr.add(16 * u), 0xFFFF, e) };
            *acc = _mm512_add_ps(*acc, e);
        }
    }
}

/// Maximum of a slice (vectorized); `-inf` when empty. NaNs are ignored,
/// as in a fold with `f32::max` from `-inf`.
#[inline]
pub fn max(x: &[f32]) -> f32 {
    // Four banks of 16 lanes: independent chains (one bank waits on the
    // max's latency every 16 elements). The maximum does not depend on the
    // order, so the result is the same as one pass. `gt` keeps a bank's
    // value unless the element is larger (a NaN never is, and banks start
    // at -inf, so they never hold one): one `vmaxps` per 16 elements.
    let gt = |a: f32, c: f32| if c > a { c } else { a };
    let mut acc = [[f32::NEG_INFINITY; 16]; 4];
    let chunks = x.chunks_exact(64);
    let tail = chunks.remainder().chunks_exact(16);
    let rem = tail.remainder();
    for c in chunks {
        for (b, a) in acc.iter_mut().enumerate() {
            for i in 0..16 {
                a[i] = gt(a[i], c[16 * b + i]);
            }
        }
    }
    for c in tail {
        for i in 0..16 {
            acc[0][i] = gt(acc[0][i], c[i]);
        }
    }
    let mut m = acc[0];
    for a in &acc[1..] {
        for i in 0..16 {
            m[i] = gt(m[i], a[i]);
        }
    }
    m.iter().chain(rem).copied().fold(f32::NEG_INFINITY, gt)
}

/// In-place softmax of `x` (max-subtracted); returns the log-sum-exp.
/// An empty slice returns `-inf`.
pub fn softmax_inplace(x: &mut [f32]) -> f32 {
    let m = max(x);
    if !m.is_finite() {
        return m;
    }
    let s = exp_sub_sum(x, m);
    let inv = 1.0 / s;
    x.iter_mut().for_each(|v| *v *= inv);
    m + s.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp_neg` builds its exponent field with integer arithmetic; it must give
    /// the bits the direct `k as i32` construction gives, and stay within its
    /// documented relative error of the f64 exponential.
    #[test]
    fn exp_neg_exponent_bits_and_accuracy() {
        let direct = |x: f32| -> f32 {
            let x = x.max(-87.3);
            let k = (x * std::f32::consts::LOG2_E).round();
            let r = fmadd(k, -0.693_145_75, x);
            let r = fmadd(k, -1.428_606_8e-6, r);
            let mut p = 1.0 / 720.0;
            for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
                p = fmadd(p, r, c);
            }
            let scale = f32::from_bits(((k as i32 + 127) as u32) << 23);
            if x <= -87.3 { 0.0 } else { p * scale }
        };
        let n = 2_000_000;
        for i in 0..=n {
            let x = -90.0 + 91.0 * i as f32 / n as f32;
            let (got, want) = (exp_neg(x), direct(x));
            assert_eq!(got.to_bits(), want.to_bits(), "x = {x}");
            if x > -87.0 {
                let exact = (x as f64).exp();
                let rel = ((got as f64 - exact) / exact).abs();
                // The k*ln2 split leaves ~2e-9 per unit of k: tighter near 0.
                let bound = if x > -20.0 { 3e-7 } else { 5e-7 };
                assert!(rel < bound, "x = {x}: relative error {rel:e}");
            }
        }
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
        let mut v = [0.0f32, -1.0, -2.0, -200.0, f32::NEG_INFINITY];
        let s = exp_sub_sum(&mut v, 0.0);
        assert_eq!(v[3], 0.0);
        assert!((s as f64 - (1.0 + (-1f64).exp() + (-2f64).exp())).abs() < 1e-6);
    }

    /// `exp_sub_sum` (the 512-bit loop where the CPU has it) gives the bits
    /// of the portable loop, elements and sum, for every length around the
    /// 16- and 128-element blocks, over the whole argument range, at the -87.3 clamp,
    /// at exact halves of `x log2 e` (where `round` goes away from zero),
    /// and for `-inf` and NaN.
    #[test]
    fn exp_sub_sum_matches_the_portable_loop() {
        let mut seed = 11u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
            (seed >> 8) as f32 / (1u32 << 24) as f32
        };
        let mut special = vec![f32::NEG_INFINITY, f32::NAN, -87.3, -87.299_99, -87.300_01];
        special.extend([0.0, -0.0, -1e-30, -126.0, -1000.0]);
        // Every x within 64 ulps of -(k + 1/2) / log2(e) whose product with
        // log2(e) is exactly -(k + 1/2): round's ties.
        let ties = (0..126).flat_map(|k| {
            let y = -(k as f32 + 0.5);
            let x0 = (y / std::f32::consts::LOG2_E).to_bits();
            (x0 - 64..x0 + 64)
                .map(f32::from_bits)
                .filter(move |x| x * std::f32::consts::LOG2_E == y)
        });
        let n_special = special.len();
        special.extend(ties);
        assert!(special.len() > n_special + 100, "too few ties");
        let mut cases: Vec<Vec<f32>> = (0..70)
            .chain(120..150)
            .chain(250..260)
            .map(|n| (0..n).map(|_| -95.0 * rnd()).collect())
            .collect();
        cases.push((0..4099).map(|_| -95.0 * rnd()).collect());
        cases.push((0..4096).map(|_| -3.0 * rnd()).collect());
        cases.push(special);
        for m in [0.0f32, 2.5, -40.0] {
            for c in &cases {
                let (mut a, mut b) = (c.clone(), c.clone());
                a.iter_mut().for_each(|v| *v += m);
                b.iter_mut().for_each(|v| *v += m);
                let (sa, sb) = (exp_sub_sum(&mut a, m), exp_sub_sum_portable(&mut b, m));
                assert_eq!(sa.to_bits(), sb.to_bits(), "sum, n = {}, m = {m}", c.len());
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert_eq!(
                        x.to_bits(),
                        y.to_bits(),
                        "n = {}, i = {i}, x = {}",
                        c.len(),
                        c[i]
                    );
                }
            }
        }
        // Every element of a fine sweep over the range, in 16-lane blocks.
        let mut sweep: Vec<f32> = (0..=400_000)
            .map(|i| -90.0 + 90.0 * i as f32 / 400_000.0)
            .collect();
        let mut want = sweep.clone();
        exp_sub_sum_portable(&mut want, 0.0);
        exp_sub_sum(&mut sweep, 0.0);
        for (x, y) in sweep.iter().zip(&want) {
            assert_eq!(x.to_bits(), y.to_bits());
        }
    }

    /// `max` equals a plain `f32::max` fold from `-inf` bit for bit, for
    /// every length around the 16- and 64-element blocks and with NaNs,
    /// infinities and the maximum in every position class.
    #[test]
    fn max_matches_a_fold() {
        let fold = |x: &[f32]| x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut seed = 7u32;
        for n in 0..200 {
            let mut x: Vec<f32> = (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
                    (seed >> 8) as f32 / (1u32 << 24) as f32 * 20.0 - 15.0
                })
                .collect();
            assert_eq!(max(&x).to_bits(), fold(&x).to_bits(), "n = {n}");
            for (k, special) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e6]
                .into_iter()
                .enumerate()
            {
                if n > 0 {
                    let i = (n * (k + 1) * 37 / 5) % n;
                    let old = x[i];
                    x[i] = special;
                    assert_eq!(max(&x).to_bits(), fold(&x).to_bits(), "n = {n}, at {i}");
                    x[i] = old;
                }
            }
        }
        assert_eq!(max(&[f32::NAN; 70]), f32::NEG_INFINITY);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
    }
}
