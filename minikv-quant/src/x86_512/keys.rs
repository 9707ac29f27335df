//! Per-channel key scores of the 512-bit exact loops.

// Indexed loops over the constant-size register arrays unroll into named
// registers.
#![allow(clippy::needless_range_loop)]

use super::*;

/// Key scores of `V` vectors of 16 tokens: vector `v` reads the words of
/// blocks `w[v][0]` (and `w[v][1]` when `P = 8`), one per channel, and
/// writes `out[j][16 v + l] = (sum_c qs[v][j d + c] * code(l, c)) + bias[v][j]`
/// with channel `c` in bank `c % B` (the last `d % B` in bank 0), banks added
/// in order: [`crate::x86::key_block`]'s arithmetic per lane.
///
/// # Safety
/// Every `w[v][k]` points at `d` words (`k = 1` only read when `P = 8`),
/// `qs[v]` holds `NG` rows of `d` values, `out[j]` has room for `16 V`
/// floats.
#[inline(always)]
unsafe fn key_vectors<const P: usize, const NG: usize, const B: usize, const V: usize>(
    w: [[*const u32; 2]; V],
    d: usize,
    bits: u32,
    qs: [*const f32; V],
    bias: [[f32; NG]; V],
    out: [*mut f32; NG],
) {
    // SAFETY: the caller upholds this function's contract; AVX-512F is on.
    unsafe {
        let (sh, lut) = shifts::<P>(bits);
        let mut acc = [[[_mm512_setzero_ps(); NG]; V]; B];
        let step = |acc: &mut [[__m512; NG]; V], c: usize| {
            for v in 0..V {
                let w1 = if P == 16 { 0 } else { *w[v][1].add(c) };
                let codes = widen::<P>(*w[v][0].add(c), w1, sh, lut);
                for j in 0..NG {
                    let s = _mm512_set1_ps(*qs[v].add(j * d + c));
                    acc[v][j] = _mm512_fmadd_ps(s, codes, acc[v][j]);
                }
            }
        };
        in_banks(&mut acc, (0, d / B * B, d), step);
        for v in 0..V {
            for j in 0..NG {
                let x = bank_sum(&acc, (v, j), bias[v][j]);
                store_ps(out[j].add(16 * v), x);
            }
        }
    }
}

/// [`key_vectors`] for 4-bit codes and an even bank count `B`, with
/// channels taken in pairs: the two words of channels `c` and `c + 1` of a
/// block are adjacent, so one 64-bit broadcast gives 8 tokens of both (lane
/// `2t + e`: token `t`, channel `c + e`, [`widen_pair`]'s order), multiplied
/// by the pair's queries (one 64-bit broadcast). Lane parity `e` is bank
/// `c % B + e`: accumulator set `(c % B) / 2` of each half vector holds two
/// banks side by side, so every lane takes the same fused multiply-adds in
/// the same order as [`key_vectors`]; the banks are then added in bank order.
///
/// # Safety
/// As [`key_vectors`], with `d` a multiple of `B`.
#[inline(always)]
unsafe fn key_vectors_pair<const NG: usize, const B: usize, const V: usize>(
    w: [[*const u32; 2]; V],
    d: usize,
    qs: [*const f32; V],
    bias: [[f32; NG]; V],
    out: [*mut f32; NG],
) {
    // SAFETY: the caller upholds this function's contract; AVX-512F is on.
    unsafe {
        let sets = B / 2;
        let mut acc = [[[[_mm512_setzero_ps(); NG]; 2]; V]; 2];
        let mut c = 0;
        while c < d {
            for st in 0..sets {
                let cc = c + 2 * st;
                for v in 0..V {
                    for h in 0..2 {
                        let codes = widen_pair(w[v][h].add(cc));
                        for j in 0..NG {
                            let q2 = (qs[v].add(j * d + cc) as *const f64).read_unaligned();
                            let q2 = _mm512_castpd_ps(_mm512_set1_pd(q2));
                            acc[st][v][h][j] = _mm512_fmadd_ps(q2, codes, acc[st][v][h][j]);
                        }
                    }
                }
            }
            c += B;
        }
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        for v in 0..V {
            for j in 0..NG {
                // Tokens 0-7 from the first half vector, 8-15 from the second.
                let lanes = |st: usize, ix: __m512i| {
                    _mm512_permutex2var_ps(acc[st][v][0][j], ix, acc[st][v][1][j])
                };
                let mut x = _mm512_add_ps(lanes(0, even), lanes(0, odd));
                for st in 1..sets {
                    x = _mm512_add_ps(x, lanes(st, even));
                    x = _mm512_add_ps(x, lanes(st, odd));
                }
                x = _mm512_add_ps(x, _mm512_set1_ps(bias[v][j]));
                store_ps(out[j].add(16 * v), x);
            }
        }
    }
}

impl MinMaxStore {
    /// [`Self::scores_channel_fast`]'s results (per-channel keys) by
    /// [`key_vectors`]: spans of [`SPAN_VECTORS`] 16-token vectors run as
    /// rayon tasks (one head's keys on every core: 3 KV heads balance over
    /// 2 cores), each span up to four vectors at a time. Every score is
    /// computed by the same operations whatever the span, so results do not
    /// depend on the thread count.
    pub(crate) fn scores_channel_512<const P: usize, const NG: usize, const B: usize>(
        &self,
        q: &[f32],
        out: &mut [f32],
        stride: usize,
    ) {
        use rayon::prelude::*;
        let nv = self.len / 16;
        assert!(q.len() >= NG * self.d && out.len() >= (NG - 1) * stride + 16 * nv);
        let base = SyncPtr(out.as_mut_ptr());
        let spans = nv.div_ceil(SPAN_VECTORS);
        let span = |i: usize| {
            let v1 = ((i + 1) * SPAN_VECTORS).min(nv);
            // SAFETY: AVX-512F (the module's cfg); `out` holds `NG` rows of
            // `stride >= 16 nv` (asserted) and spans write disjoint tokens.
            unsafe { self.key_span::<P, NG, B>(q, base, stride, i * SPAN_VECTORS, v1) }
        };
        if spans > 1 {
            (0..spans).into_par_iter().for_each(span);
        } else if spans == 1 {
            span(0);
        }
    }

    /// Key scores of the 16-token vectors `v0 .. v1` into `out`'s rows.
    ///
    /// # Safety
    /// AVX-512F; `out` points at `NG` rows of `stride` floats holding the
    /// vectors' tokens, which no other thread writes meanwhile.
    unsafe fn key_span<const P: usize, const NG: usize, const B: usize>(
        &self,
        q: &[f32],
        out: SyncPtr,
        stride: usize,
        mut v0: usize,
        v1: usize,
    ) {
        let (d, grp, bits) = (self.d, self.q.group, self.q.bits);
        // Pre-scaled queries `qs[s][j][c] = q_jc * scale_c` and `q . min` of
        // the (at most four, consecutive) groups of the vectors in flight:
        // slot `s` holds group `first + s`.
        let mut bias = [[0.0f32; NG]; 4];
        let mut qbuf = take(&QS);
        qbuf.resize(4 * NG * d, 0.0);
        let qs = qbuf.as_mut_ptr();
        let (rs, rm) = (Raw::of(&self.scale[0]), Raw::of(&self.min[0]));
        let qp = q.as_ptr();
        let prepare = |first: usize, count: usize, bias: &mut [[f32; NG]; 4]| {
            // SAFETY: groups `first .. first + count` are stored (`d` scales
            // and minimums each); `qbuf` holds 4 NG d floats, `q` NG d.
            unsafe {
                for s in 0..count {
                    for k in (0..d).step_by(16) {
                        let sv = rs.ld16((first + s) * d + k);
                        for j in 0..NG {
                            let x = _mm512_mul_ps(load_ps(qp.add(j * d + k)), sv);
                            store_ps(qs.add((s * NG + j) * d + k), x);
                        }
                    }
                }
                // `minikv_core::simd::dot(q_j, min)`: eight lanes of fused multiply-adds
                // over the channels' 8-chunks in order, then its reduction.
                let g = |s: usize| (first + s.min(count - 1)) * d;
                for j in 0..NG {
                    let mut acc = [_mm256_setzero_ps(); 4];
                    for k in (0..d).step_by(8) {
                        let qv = _mm256_loadu_ps(qp.add(j * d + k));
                        for (s, a) in acc.iter_mut().enumerate() {
                            *a = _mm256_fmadd_ps(qv, rm.ld8(g(s) + k), *a);
                        }
                    }
                    for s in 0..count {
                        bias[s][j] = red8(acc[s]);
                    }
                }
            }
        };
        let blocks = |v: usize| {
            let k = 16 * v / P;
            // SAFETY (of the caller's reads): block `k` (and `k + 1` when
            // P = 8, same vector) lies within the store's `len` tokens.
            [
                self.words[k * d..].as_ptr(),
                self.words[(k + 16 / P - 1) * d..].as_ptr(),
            ]
        };
        // Vectors in flight: as many as keep the accumulators in about 24 of
        // the 32 registers.
        let fit = 24 / (B * NG);
        while v0 < v1 {
            let left = v1 - v0;
            let m = if left >= 4 && fit >= 4 {
                4
            } else if left >= 2 && fit >= 2 {
                2
            } else {
                1
            };
            let first = 16 * v0 / grp;
            let src: [usize; 4] = std::array::from_fn(|v| (16 * (v0 + v) / grp).max(first) - first);
            prepare(first, src[m - 1] + 1, &mut bias);
            // SAFETY: within `out`'s rows (the caller's contract).
            let o: [*mut f32; NG] =
                std::array::from_fn(|j| unsafe { out.get().add(j * stride + 16 * v0) });
            macro_rules! run {
                ($v:literal) => {{
                    let w = std::array::from_fn(|v| blocks(v0 + v));
                    let q = std::array::from_fn(|v| qs.wrapping_add(src[v] * NG * d).cast_const());
                    let b = std::array::from_fn(|v| bias[src[v]]);
                    // SAFETY: AVX-512F is enabled (the module's cfg); the
                    // vectors' blocks hold `d` words each, `qs` `d` values
                    // per head, and `out` 16 tokens a vector from `16 v0` in
                    // each of the `NG` rows.
                    unsafe {
                        if P == 8 && B % 2 == 0 && B <= 4 {
                            key_vectors_pair::<NG, B, $v>(w, d, q, b, o)
                        } else {
                            key_vectors::<P, NG, B, $v>(w, d, bits, q, b, o)
                        }
                    }
                }};
            }
            match m {
                4 => run!(4),
                2 => run!(2),
                _ => run!(1),
            }
            v0 += m;
        }
        give_back(&QS, qbuf);
    }
}
