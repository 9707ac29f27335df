//! Per-token value sums of the 512-bit exact loops.

// Indexed loops over the constant-size register arrays unroll into named
// registers.
#![allow(clippy::needless_range_loop)]

use super::*;

/// Tokens per tile of value weights: the weights of a tile (`p * scale`
/// per group and query head) stay in L1 while the codes stream by; a
/// multiple of every bank count (1-4), so banks are those of whole-head
/// passes.
const TILE: usize = 240;

/// Accumulators of [`value_tile`]: bank, vector, query head.
type ValueAcc<const NG: usize, const U: usize, const B: usize> = [[[__m512; NG]; U]; B];

/// Tokens `t0 .. t1` of the weighted sums of `U` vectors of 16 channels:
/// vector `u` reads word `k[u]` (and `k[u] + 1` when `P = 8`) of every token
/// (`wpt` words a token) and adds `a[u][j * TILE + t - t0] * code(t, l)` to
/// `acc[t % B][u][j]` for `t < whole`, to bank 0 after (the last `n % B`
/// tokens): [`crate::x86::value_column`]'s arithmetic per lane.
///
/// # Safety
/// `words` holds the words of tokens up to `t1`, `a[u]` `NG` rows of
/// `TILE` weights, `t0` is a multiple of `B`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn value_tile<const P: usize, const NG: usize, const B: usize, const U: usize>(
    acc: &mut ValueAcc<NG, U, B>,
    words: *const u32,
    wpt: usize,
    bits: u32,
    k: [usize; U],
    a: [*const f32; U],
    (t0, t1, whole): (usize, usize, usize),
) {
    // SAFETY: the caller upholds this function's contract; AVX-512F is on.
    unsafe {
        let (sh, lut) = shifts::<P>(bits);
        let step = |acc: &mut [[__m512; NG]; U], t: usize| {
            let row = words.add(t * wpt);
            for u in 0..U {
                let codes = if P == 16 {
                    widen::<P>(*row.add(k[u]), 0, sh, lut)
                } else {
                    widen_pair(row.add(k[u]))
                };
                for j in 0..NG {
                    let s = _mm512_set1_ps(*a[u].add(j * TILE + t - t0));
                    acc[u][j] = _mm512_fmadd_ps(s, codes, acc[u][j]);
                }
            }
        };
        in_banks(acc, (t0, whole, t1), step);
    }
}

/// Adds the banks in order, then `macc[u][j]`, to `out[u] + j d`
/// ([`crate::x86::value_column`]'s final additions); at 4 bits the lanes
/// come in [`widen_pair`]'s order and go out in channel order.
///
/// # Safety
/// `out[u]` points at 16 channels of the first of `NG` rows `d` floats apart.
#[inline(always)]
unsafe fn value_flush<const P: usize, const NG: usize, const B: usize, const U: usize>(
    acc: &ValueAcc<NG, U, B>,
    macc: [[f32; NG]; U],
    out: [*mut f32; U],
    d: usize,
) {
    // SAFETY: the caller upholds this function's contract; AVX-512F is on.
    unsafe {
        let order = _mm512_loadu_si512(PAIR_ORDER.as_ptr().cast());
        for u in 0..U {
            for j in 0..NG {
                let mut x = bank_sum(acc, (u, j), macc[u][j]);
                if P == 8 {
                    x = _mm512_permutexvar_ps(order, x);
                }
                let o = out[u].add(j * d);
                store_ps(o, _mm512_add_ps(load_ps(o), x));
            }
        }
    }
}

impl MinMaxStore {
    /// [`Self::accumulate_token_fast`]'s results (per-token values) by
    /// [`value_tile`]: tasks of up to four 16-channel vectors of a row (a
    /// head of [`SPLIT_TOKENS`] tokens or more is cut into at least two, run
    /// as rayon tasks, so that heads balance over cores). Every output
    /// channel is computed by the same operations whatever the cut, so
    /// results do not depend on the thread count.
    pub(crate) fn accumulate_token_512<const P: usize, const NG: usize, const B: usize>(
        &self,
        p: &[f32],
        stride: usize,
        out: &mut [f32],
    ) {
        use rayon::prelude::*;
        let (d, n) = (self.d, self.len);
        if n == 0 {
            return; // nothing quantized yet (all tokens still in the residual)
        }
        assert!(p.len() >= (NG - 1) * stride + n && out.len() >= NG * d);
        let base = SyncPtr(out.as_mut_ptr());
        // Vectors a task: as many as keep the accumulators in about 24 of the
        // 32 registers, at most half the row's when the head is long.
        let nvec = d / 16;
        let mut per = (24 / (B * NG)).clamp(1, 4).min(nvec);
        if n >= SPLIT_TOKENS && nvec >= 2 {
            per = per.min(nvec / 2);
        }
        let task = |i: usize| {
            let (mut u0, u1) = (i * per, ((i + 1) * per).min(nvec));
            while u0 < u1 {
                let left = u1 - u0;
                // SAFETY (all three): AVX-512F is enabled (the module's cfg);
                // `out` holds `NG` rows of `d` (asserted), tasks write their
                // own channels.
                u0 += unsafe {
                    if left >= 4 {
                        self.value_run::<P, NG, B, 4>(p, stride, u0, base)
                    } else if left >= 2 {
                        self.value_run::<P, NG, B, 2>(p, stride, u0, base)
                    } else {
                        self.value_run::<P, NG, B, 1>(p, stride, u0, base)
                    }
                };
            }
        };
        let tasks = nvec.div_ceil(per);
        if tasks > 1 && n >= SPLIT_TOKENS {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
    }

    /// The value sums of the `U` 16-channel vectors from `u0`, tile by
    /// tile of tokens: per tile the weights `a_j[t] = p_jt * scale_t` of
    /// each vector's group (the portable loop's products) and the group's
    /// `p . min` carried on ([`minikv_core::simd::dot`]'s lanes and order: [`Dot8`]),
    /// then [`value_tile`]; the banks are added once at the end. Returns
    /// `U`.
    ///
    /// # Safety
    /// AVX-512F (the module's cfg); `out` points at `NG` rows of `d` whose
    /// channels `16 u0 .. 16 (u0 + U)` no other thread writes meanwhile;
    /// `p` holds `NG` rows of `stride >= len`.
    #[inline(always)]
    unsafe fn value_run<const P: usize, const NG: usize, const B: usize, const U: usize>(
        &self,
        p: &[f32],
        stride: usize,
        u0: usize,
        out: SyncPtr,
    ) -> usize {
        let (d, grp, n) = (self.d, self.q.group, self.len);
        let gi: [usize; U] = std::array::from_fn(|u| 16 * (u0 + u) / grp);
        // The weights' slot of each vector: the previous vector's when they
        // share a group.
        let mut src = [0usize; U];
        for u in 1..U {
            src[u] = if gi[u] == gi[u - 1] { src[u - 1] } else { u };
        }
        let mut tbuf = take(&QS);
        tbuf.resize(U * NG * TILE, 0.0);
        let tile = tbuf.as_mut_ptr();
        let mut macc = [[Dot8::default(); NG]; U];
        let rs: [Raw; U] = std::array::from_fn(|u| Raw::of(&self.scale[gi[u]]));
        let rm: [Raw; U] = std::array::from_fn(|u| Raw::of(&self.min[gi[u]]));
        // SAFETY: the caller upholds this function's contract; the groups'
        // buffers hold `n` scales and minimums, `tbuf` U NG TILE floats.
        unsafe {
            let mut acc = [[[_mm512_setzero_ps(); NG]; U]; B];
            let whole = n / B * B;
            let mut t0 = 0;
            while t0 < n {
                let t1 = (t0 + TILE).min(n);
                let m = t1 - t0;
                // The weights `p_jt * scale_t` of the tile, and `p . min`.
                for u in (0..U).filter(|&u| src[u] == u) {
                    for j in 0..NG {
                        let pj = p[j * stride + t0..j * stride + t1].as_ptr();
                        let aj = tile.add((u * NG + j) * TILE);
                        let mut k = 0;
                        while k + 16 <= m {
                            let x = _mm512_mul_ps(load_ps(pj.add(k)), rs[u].ld16(t0 + k));
                            store_ps(aj.add(k), x);
                            k += 16;
                        }
                        for k in k..m {
                            *aj.add(k) = *pj.add(k) * rs[u].get(t0 + k);
                        }
                        macc[u][j].add(pj, rm[u], t0, m, t1 == n);
                    }
                }
                value_tile::<P, NG, B, U>(
                    &mut acc,
                    self.words.as_ptr(),
                    d / P,
                    self.q.bits,
                    std::array::from_fn(|u| 16 * (u0 + u) / P),
                    std::array::from_fn(|u| tile.add(src[u] * NG * TILE).cast_const()),
                    (t0, t1, whole),
                );
                t0 = t1;
            }
            value_flush::<P, NG, B, U>(
                &acc,
                std::array::from_fn(|u| std::array::from_fn(|j| macc[src[u]][j].sum)),
                std::array::from_fn(|u| out.get().add(16 * (u0 + u))),
                d,
            );
        }
        give_back(&QS, tbuf);
        U
    }
}

/// [`minikv_core::simd::dot`] taken in pieces: the same eight lanes of fused
/// multiply-adds over whole 8-element chunks (pieces are multiples of 8
/// except the last), the same reduction, then the same remainder.
#[derive(Clone, Copy, Default)]
struct Dot8 {
    acc: [f32; 8],
    sum: f32,
}

impl Dot8 {
    /// Adds `a[k] * b[i0 + k]` for `k < m` (`minikv_core::simd::dot(a, b)`'s
    /// operand order); on the `last` piece (the only one whose length may be
    /// other than a multiple of 8) the lanes are reduced into `sum` and the
    /// remainder follows.
    ///
    /// # Safety
    /// `a` holds `m` floats, `b` `i0 + m` values.
    #[inline(always)]
    unsafe fn add(&mut self, a: *const f32, b: Raw, i0: usize, m: usize, last: bool) {
        // SAFETY: the caller's contract; AVX2, FMA and F16C are on.
        unsafe {
            let full = m / 8 * 8;
            let mut acc = _mm256_loadu_ps(self.acc.as_ptr());
            for k in (0..full).step_by(8) {
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(k)), b.ld8(i0 + k), acc);
            }
            _mm256_storeu_ps(self.acc.as_mut_ptr(), acc);
            if !last {
                return;
            }
            let mut s = red8(acc);
            for k in full..m {
                s += *a.add(k) * b.get(i0 + k);
            }
            self.sum = s;
        }
    }
}
