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

use crate::store::{Buf, MinMaxStore};
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

/// Scales or minimums of a store read in registers (f16 widened exactly by
/// `vcvtph2ps`), without a conversion pass through memory.
#[derive(Clone, Copy)]
enum Raw {
    H(*const u16),
    S(*const f32),
}

impl Raw {
    fn of(b: &Buf) -> Self {
        match b {
            Buf::F16(v) => Raw::H(v.as_ptr().cast()),
            Buf::F32(v) => Raw::S(v.as_ptr()),
        }
    }

    /// 16 values from element `i`.
    ///
    /// # Safety
    /// The buffer holds `i + 16` values.
    #[inline(always)]
    unsafe fn ld16(self, i: usize) -> __m512 {
        // SAFETY: the caller's contract; AVX-512F is on.
        unsafe {
            match self {
                Raw::H(p) => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(i).cast())),
                Raw::S(p) => _mm512_loadu_ps(p.add(i)),
            }
        }
    }

    /// The value at element `i`.
    ///
    /// # Safety
    /// The buffer holds `i + 1` values.
    #[inline(always)]
    unsafe fn get(self, i: usize) -> f32 {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                Raw::H(p) => half::f16::from_bits(*p.add(i)).to_f32(),
                Raw::S(p) => *p.add(i),
            }
        }
    }

    /// 8 values from element `i`.
    ///
    /// # Safety
    /// The buffer holds `i + 8` values.
    #[inline(always)]
    unsafe fn ld8(self, i: usize) -> __m256 {
        // SAFETY: the caller's contract; F16C and AVX are on.
        unsafe {
            match self {
                Raw::H(p) => _mm256_cvtph_ps(_mm_loadu_si128(p.add(i).cast())),
                Raw::S(p) => _mm256_loadu_ps(p.add(i)),
            }
        }
    }
}

/// [`minikv_core::simd::dot`]'s reduction of its eight lanes:
/// `((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))`.
#[inline(always)]
fn red8(a: __m256) -> f32 {
    // SAFETY: AVX is on (the module's cfg).
    unsafe {
        let t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let x = _mm_add_ps(t, _mm_movehdup_ps(t));
        _mm_cvtss_f32(_mm_add_ss(x, _mm_movehl_ps(x, x)))
    }
}

/// Whether the 512-bit loops apply: 2- or 4-bit codes, groups of a
/// multiple of 16 tokens (keys) or channels (values), heads of a multiple of
/// 16 channels.
pub(crate) fn applies(bits: u32, group: usize, d: usize) -> bool {
    matches!(bits, 2 | 4) && group.is_multiple_of(16) && d.is_multiple_of(16)
}

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
        let (sh, mask) = shifts::<P>(bits);
        let mut acc = [[[_mm512_setzero_ps(); NG]; V]; B];
        let step = |acc: &mut [[__m512; NG]; V], c: usize| {
            for v in 0..V {
                let w1 = if P == 16 { 0 } else { *w[v][1].add(c) };
                let codes = widen::<P>(*w[v][0].add(c), w1, sh, mask);
                for j in 0..NG {
                    let s = _mm512_set1_ps(*qs[v].add(j * d + c));
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

thread_local! {
    /// The key spans' pre-scaled queries (taken out while a span runs, so a
    /// nested call finds an empty one and allocates its own).
    static QS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

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
        // Pre-scaled queries `qs[s][j][c] = q_jc * scale_c` and `q . min` of
        // the (at most four, consecutive) groups of the vectors in flight:
        // slot `s` holds group `first + s`.
        let mut bias = [[0.0f32; NG]; 4];
        let mut qbuf = QS.with(|c| std::mem::take(&mut *c.borrow_mut()));
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
                            let x = _mm512_mul_ps(_mm512_loadu_ps(qp.add(j * d + k)), sv);
                            _mm512_storeu_ps(qs.add((s * NG + j) * d + k), x);
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
                            std::array::from_fn(|v| qs.add(src[v] * NG * d).cast_const()),
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
        QS.with(|c| *c.borrow_mut() = qbuf);
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
        let mut tbuf = QS.with(|c| std::mem::take(&mut *c.borrow_mut()));
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
                            let x = _mm512_mul_ps(_mm512_loadu_ps(pj.add(k)), rs[u].ld16(t0 + k));
                            _mm512_storeu_ps(aj.add(k), x);
                            k += 16;
                        }
                        for k in k..m {
                            *aj.add(k) = *pj.add(k) * rs[u].get(t0 + k);
                        }
                        macc[u][j].add(pj, rm[u], t0, m);
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
            value_flush(
                &acc,
                std::array::from_fn(|u| std::array::from_fn(|j| macc[src[u]][j].sum)),
                std::array::from_fn(|u| out.0.add(16 * (u0 + u))),
                d,
            );
        }
        QS.with(|c| *c.borrow_mut() = tbuf);
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
    /// Adds `a[k] * b[i0 + k]` for `k < m` (`minikv_core::simd::dot(a, b)`'s operand
    /// order); a piece of other than a multiple of 8 is the last one: its
    /// remainder follows the reduction into `sum`.
    ///
    /// # Safety
    /// `a` holds `m` floats, `b` `i0 + m` values.
    #[inline(always)]
    unsafe fn add(&mut self, a: *const f32, b: Raw, i0: usize, m: usize) {
        // SAFETY: the caller's contract; AVX2, FMA and F16C are on.
        unsafe {
            let full = m / 8 * 8;
            let mut acc = _mm256_loadu_ps(self.acc.as_ptr());
            for k in (0..full).step_by(8) {
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(k)), b.ld8(i0 + k), acc);
            }
            _mm256_storeu_ps(self.acc.as_mut_ptr(), acc);
            let mut s = red8(acc);
            for k in full..m {
                s += *a.add(k) * b.get(i0 + k);
            }
            self.sum = s;
        }
    }
}

#[cfg(test)]
#[path = "x86_512_tests.rs"]
mod tests;
