//! The exact (f32) fused decode loops on 512-bit registers (compiled when
//! `target-cpu=native` enables AVX-512F, chosen for group sizes that are a
//! multiple of 16 and 2- or 4-bit codes).
//!
//! Every output lane goes through the operations of the portable loops in
//! [`crate::exact`] in the same order (the same fused multiply-adds into the
//! same banks, banks added in bank order, then the same final additions), so
//! the results are bitwise those of the portable and AVX2 loops (tested
//! below). What changes is what runs side by side: a register holds 16 lanes
//! (one 2-bit word, or two 4-bit words of the same group), and the kernels
//! keep several independent outputs in flight: two 16-token vectors of key
//! scores, and up to four 16-channel vectors of a value row, so that the FMA
//! units see 6-24 independent chains where one output alone is a single
//! chain over 64 channels or every token (the bank count is fixed by the
//! results and is small when several query heads share a word).

// Indexed loops over the constant-size register arrays unroll into named
// registers.
#![allow(clippy::needless_range_loop)]

use crate::store::{MAX_D, MinMaxStore};
use minikv_core::simd;
use std::arch::x86_64::*;

/// 16 codes as floats: lane `l` holds code `l % P` of word `l / P` (`P = 16`:
/// `w0` alone; `P = 8`: `w0`, then `w1`).
#[inline(always)]
unsafe fn widen<const P: usize>(w0: u32, w1: u32, sh: __m512i, mask: __m512i) -> __m512 {
    // SAFETY: AVX-512F is enabled at compile time (the module's cfg).
    unsafe {
        let wv = if P == 16 {
            _mm512_set1_epi32(w0 as i32)
        } else {
            _mm512_mask_set1_epi32(_mm512_set1_epi32(w0 as i32), 0xFF00, w1 as i32)
        };
        _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(wv, sh), mask))
    }
}

/// Per-lane shift counts `bits * (l % P)` and the code mask.
#[inline(always)]
fn shifts<const P: usize>(bits: u32) -> (__m512i, __m512i) {
    let sh: [i32; 16] = std::array::from_fn(|l| (bits as usize * (l % P)) as i32);
    // SAFETY: AVX-512F is enabled at compile time; `sh` holds 16 lanes.
    unsafe {
        (
            _mm512_loadu_si512(sh.as_ptr().cast()),
            _mm512_set1_epi32((1 << bits) - 1),
        )
    }
}

/// Whether the 512-bit loops apply: 2- or 4-bit codes and groups of a
/// multiple of 16 tokens (keys) or channels (values).
pub(crate) fn applies(bits: u32, group: usize) -> bool {
    matches!(bits, 2 | 4) && group.is_multiple_of(16)
}

/// Key scores of `V` vectors of 16 tokens: vector `v` reads the words of
/// blocks `w[v][0]` (and `w[v][1]` when `P = 8`), one per channel, and
/// writes `out[j][16 v + l] = (sum_c qs[v][j][c] * code(l, c)) + bias[v][j]`
/// with channel `c` in bank `c % B` (the last `d % B` in bank 0), banks added
/// in order: [`crate::x86::key_block`]'s arithmetic per lane.
///
/// # Safety
/// Every `w[v][k]` points at `d` words (`k = 1` only read when `P = 8`),
/// `qs[v][j]` holds `d` values, `out[j]` has room for `16 V` floats.
#[inline(always)]
unsafe fn key_vectors<const P: usize, const NG: usize, const B: usize, const V: usize>(
    w: [[*const u32; 2]; V],
    d: usize,
    bits: u32,
    qs: [&[[f32; MAX_D]; NG]; V],
    bias: [[f32; NG]; V],
    out: [*mut f32; NG],
) {
    // SAFETY: the caller upholds this function's contract; AVX-512F is on.
    unsafe {
        let (sh, mask) = shifts::<P>(bits);
        let mut acc = [[[_mm512_setzero_ps(); NG]; V]; B];
        let step = |acc: &mut [[__m512; NG]; V], c: usize| {
            for v in 0..V {
                let w1 = if P == 16 { 0 } else { *w[v][1].add(c) };
                let codes = widen::<P>(*w[v][0].add(c), w1, sh, mask);
                for j in 0..NG {
                    let s = _mm512_set1_ps(*qs[v][j].get_unchecked(c));
                    acc[v][j] = _mm512_fmadd_ps(s, codes, acc[v][j]);
                }
            }
        };
        let whole = d / B * B;
        let mut c = 0;
        while c < whole {
            for (i, bank) in acc.iter_mut().enumerate() {
                step(bank, c + i);
            }
            c += B;
        }
        while c < d {
            step(&mut acc[0], c);
            c += 1;
        }
        for v in 0..V {
            for j in 0..NG {
                let mut x = acc[0][v][j];
                for bank in &acc[1..] {
                    x = _mm512_add_ps(x, bank[v][j]);
                }
                x = _mm512_add_ps(x, _mm512_set1_ps(bias[v][j]));
                _mm512_storeu_ps(out[j].add(16 * v), x);
            }
        }
    }
}

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
        let (sh, mask) = shifts::<P>(bits);
        let step = |acc: &mut [[__m512; NG]; U], t: usize| {
            let row = words.add(t * wpt);
            for u in 0..U {
                let w1 = if P == 16 { 0 } else { *row.add(k[u] + 1) };
                let codes = widen::<P>(*row.add(k[u]), w1, sh, mask);
                for j in 0..NG {
                    let s = _mm512_set1_ps(*a[u].add(j * TILE + t - t0));
                    acc[u][j] = _mm512_fmadd_ps(s, codes, acc[u][j]);
                }
            }
        };
        let mut t = t0;
        while t < t1.min(whole) {
            for (i, bank) in acc.iter_mut().enumerate() {
                step(bank, t + i);
            }
            t += B;
        }
        while t < t1 {
            step(&mut acc[0], t);
            t += 1;
        }
    }
}

/// Adds the banks in order, then `macc[u][j]`, to `out[u] + j d`
/// ([`crate::x86::value_column`]'s final additions).
///
/// # Safety
/// `out[u]` points at 16 channels of the first of `NG` rows `d` floats apart.
#[inline(always)]
unsafe fn value_flush<const NG: usize, const B: usize, const U: usize>(
    acc: &ValueAcc<NG, U, B>,
    macc: [[f32; NG]; U],
    out: [*mut f32; U],
    d: usize,
) {
    // SAFETY: the caller upholds this function's contract; AVX-512F is on.
    unsafe {
        for u in 0..U {
            for j in 0..NG {
                let mut x = acc[0][u][j];
                for bank in &acc[1..] {
                    x = _mm512_add_ps(x, bank[u][j]);
                }
                x = _mm512_add_ps(x, _mm512_set1_ps(macc[u][j]));
                let o = out[u].add(j * d);
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), x));
            }
        }
    }
}

/// 16-token vectors of key scores per rayon task.
const SPAN_VECTORS: usize = 64;

/// Tokens from which a head's value sums are cut into tasks.
const SPLIT_TOKENS: usize = 2048;

/// An output pointer that spans of one call share (each writes its own
/// elements).
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: the pointer is only written through at elements that one task
// alone owns (the spans' contracts), and the call that hands it out waits for
// every task.
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

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
        let base = Out(out.as_mut_ptr());
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
        out: Out,
        stride: usize,
        mut v0: usize,
        v1: usize,
    ) {
        let (d, grp, bits) = (self.d, self.q.group, self.q.bits);
        // Pre-scaled queries and `q . min` of the (at most four, consecutive)
        // groups of the vectors in flight: slot `s` holds group `first + s`.
        let mut qs = [[[0.0f32; MAX_D]; NG]; 4];
        let mut bias = [[0.0f32; NG]; 4];
        let (mut sc, mut mn) = ([0.0f32; 4 * MAX_D], [0.0f32; 4 * MAX_D]);
        let mut prepare = |first: usize,
                           count: usize,
                           qs: &mut [[[f32; MAX_D]; NG]; 4],
                           bias: &mut [[f32; NG]; 4]| {
            self.scale[0].read(first * d, &mut sc[..count * d]);
            self.min[0].read(first * d, &mut mn[..count * d]);
            let m = |s: usize| &mn[s.min(count - 1) * d..][..d];
            for j in 0..NG {
                let qj = &q[j * d..(j + 1) * d];
                for (s, qs) in qs.iter_mut().enumerate().take(count) {
                    let sc = &sc[s * d..(s + 1) * d];
                    for ((x, a), s) in qs[j][..d].iter_mut().zip(qj).zip(sc) {
                        *x = a * s;
                    }
                }
                // Four interleaved chains, each `simd::dot(qj, min)` bitwise.
                let b = simd::dot4(qj, [m(0), m(1), m(2), m(3)]);
                for s in 0..count {
                    bias[s][j] = b[s];
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
            prepare(first, src[m - 1] + 1, &mut qs, &mut bias);
            // SAFETY: within `out`'s rows (the caller's contract).
            let o: [*mut f32; NG] =
                std::array::from_fn(|j| unsafe { out.0.add(j * stride + 16 * v0) });
            macro_rules! run {
                ($v:literal) => {
                    // SAFETY: AVX-512F is enabled (the module's cfg); the
                    // vectors' blocks hold `d` words each, `qs` `d` values
                    // per head, and `out` 16 tokens a vector from `16 v0` in
                    // each of the `NG` rows.
                    unsafe {
                        key_vectors::<P, NG, B, $v>(
                            std::array::from_fn(|v| blocks(v0 + v)),
                            d,
                            bits,
                            std::array::from_fn(|v| &qs[src[v]]),
                            std::array::from_fn(|v| bias[src[v]]),
                            o,
                        )
                    }
                };
            }
            match m {
                4 => run!(4),
                2 => run!(2),
                _ => run!(1),
            }
            v0 += m;
        }
    }

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
        let base = Out(out.as_mut_ptr());
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
    /// `p . min` carried on ([`simd::dot`]'s lanes and order: [`Dot8`]),
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
        out: Out,
    ) -> usize {
        let (d, grp, n) = (self.d, self.q.group, self.len);
        let gi: [usize; U] = std::array::from_fn(|u| 16 * (u0 + u) / grp);
        // The weights' slot of each vector: the previous vector's when they
        // share a group.
        let mut src = [0usize; U];
        for u in 1..U {
            src[u] = if gi[u] == gi[u - 1] { src[u - 1] } else { u };
        }
        let mut tile = [[0.0f32; TILE]; 24];
        let mut macc = [[Dot8::default(); NG]; U];
        // SAFETY: the caller upholds this function's contract.
        unsafe {
            let mut acc = [[[_mm512_setzero_ps(); NG]; U]; B];
            let whole = n / B * B;
            let (mut sv, mut mv) = ([0.0f32; TILE], [0.0f32; TILE]);
            let mut t0 = 0;
            while t0 < n {
                let t1 = (t0 + TILE).min(n);
                let m = t1 - t0;
                for u in (0..U).filter(|&u| src[u] == u) {
                    self.scale[gi[u]].read(t0, &mut sv[..m]);
                    self.min[gi[u]].read(t0, &mut mv[..m]);
                    for j in 0..NG {
                        let pj = &p[j * stride + t0..j * stride + t1];
                        let aj = &mut tile[u * NG + j][..m];
                        for ((a, x), s) in aj.iter_mut().zip(pj).zip(&sv[..m]) {
                            *a = x * s;
                        }
                        macc[u][j].add(pj, &mv[..m]);
                    }
                }
                value_tile::<P, NG, B, U>(
                    &mut acc,
                    self.words.as_ptr(),
                    d / P,
                    self.q.bits,
                    std::array::from_fn(|u| 16 * (u0 + u) / P),
                    std::array::from_fn(|u| tile[src[u] * NG].as_ptr()),
                    (t0, t1, whole),
                );
                t0 = t1;
            }
            value_flush(
                &acc,
                std::array::from_fn(|u| std::array::from_fn(|j| macc[src[u]][j].sum)),
                std::array::from_fn(|u| out.0.add(16 * (u0 + u))),
                d,
            );
        }
        U
    }
}

/// [`simd::dot`] taken in pieces: the same eight lanes of fused
/// multiply-adds over whole 8-element chunks (pieces are multiples of 8
/// except the last), the same reduction, then the same remainder.
#[derive(Clone, Copy, Default)]
struct Dot8 {
    acc: [f32; 8],
    sum: f32,
}

impl Dot8 {
    /// Adds `a . b` of one piece; a piece shorter than a multiple of 8 is
    /// the last one: its remainder follows the reduction into `sum`.
    #[inline(always)]
    fn add(&mut self, a: &[f32], b: &[f32]) {
        let ca = a.chunks_exact(8);
        let cb = b.chunks_exact(8);
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            for i in 0..8 {
                self.acc[i] = simd::fmadd(x[i], y[i], self.acc[i]);
            }
        }
        let c = &self.acc;
        let mut s = (c[0] + c[4]) + (c[1] + c[5]) + ((c[2] + c[6]) + (c[3] + c[7]));
        for (x, y) in ra.iter().zip(rb) {
            s += x * y;
        }
        self.sum = s;
    }
}
#[cfg(test)]
#[path = "x86_512_tests.rs"]
mod tests;
