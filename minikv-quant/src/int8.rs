//! Integer-product decode attention (`arithmetic = "int8"`, docs/algorithms.md
//! §1, "Integer products"): the query and the attention weights are rounded to 8 bits and
//! multiplied with the stored codes in integers.
//!
//! * Keys (per channel): one rounding step per head and segment of
//!   [`seg_tokens`] tokens (4096, or 2048 in heads of at most 6144 tokens),
//!   `sigma = max |q_c * scale_gc| / 127` over the segment's key groups `g`
//!   and channels (computed as `max_c |q_c| * max_g scale_gc`, the same
//!   number), `qi_c = q_c * (127 / max)`; per key
//!   group `q8_c = round(qi_c * scale_gc)`, and a token's score is
//!   `sigma * sum_c q8_c * code_c + q . min_g` (the min term stays f32).
//! * Values (per token): per head, channel group and block of [`TB`] tokens
//!   `a_t = p_t * scale_t`, `tau = max a / 255`, `a8_t = round(a_t / tau)`;
//!   `out_c += sum_blocks tau * sum_t a8_t * code_tc + sum_t p_t * min_t`.
//!
//! Integer sums are exact, so every kernel (the portable loops here, AVX2
//! `vpmaddubsw`, AVX-VNNI and AVX-512 VNNI `vpdpbusd` on 256 bits in
//! `x86_int8`, the 512-bit AVX-512 VNNI + VBMI kernels in `x86_int8_512`)
//! gives bitwise the same result: the float steps around them are shared or
//! done with the same single-rounding operations in the same order. The two
//! float sums (`q . min` per head and key group, `p . min` per head, value
//! group and segment) run in [`LANES`] lanes ([`dot16`]), the order a
//! 512-bit register accumulates in.

use crate::store::{MAX_D, MAX_G, MinMaxStore};
use std::cell::RefCell;
use std::thread::LocalKey;

/// Tokens per rounding step of the attention weights.
pub(crate) const TB: usize = 32;

/// Tokens per parallel segment of a long head (a multiple of [`TB`] and of
/// every key group that divides it): heads of more than [`SHORT_HEAD`]
/// tokens.
pub(crate) const SEG_TOKENS: usize = 4096;

/// Tokens per segment of a head of at most [`SHORT_HEAD`] tokens: such a
/// head gets up to three segments instead of one or two, so that a few KV
/// heads (3 in SmolLM2) still make enough tasks for the cores.
pub(crate) const SHORT_SEG_TOKENS: usize = 2048;

/// The longest head cut into [`SHORT_SEG_TOKENS`].
pub(crate) const SHORT_HEAD: usize = 6144;

/// The segment length of a head of `len` tokens (a function of the head's
/// own length only, so results do not depend on the thread count or on the
/// other heads).
pub(crate) fn seg_tokens(len: usize) -> usize {
    if len <= SHORT_HEAD {
        SHORT_SEG_TOKENS
    } else {
        SEG_TOKENS
    }
}

/// A pointer the segments of one call share; each writes its own elements.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(pub(crate) *mut f32);
// SAFETY: only used for disjoint writes by the segments of one call, which
// ends before the borrow it came from.
unsafe impl Send for SyncPtr {}
// SAFETY: as above.
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    /// The pointer.
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// The integer kernels a store uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// Plain Rust loops (any CPU).
    Portable,
    /// AVX2 `vpmaddubsw` + `vpmaddwd`.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-VNNI `vpdpbusd` (256-bit, VEX).
    #[cfg(target_arch = "x86_64")]
    AvxVnni,
    /// AVX-512 VNNI `vpdpbusd` on 256-bit vectors (32 registers).
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// AVX-512 VNNI and VBMI on 512-bit vectors: the query and the weights
    /// rounded in registers, one byte permute per four value rows.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The fastest kernels this CPU runs, detected once at run time.
    pub(crate) fn detected() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| Isa::available().pop().unwrap_or(Isa::Portable))
    }

    /// Every kernel set this CPU runs, slowest first (tests compare them all).
    pub(crate) fn available() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                v.push(Isa::Avx2);
                if std::is_x86_feature_detected!("avxvnni") {
                    v.push(Isa::AvxVnni);
                }
                if minikv_core::cpu::avx512()
                    && std::is_x86_feature_detected!("avx512vnni")
                    && std::is_x86_feature_detected!("avx512vl")
                {
                    v.push(Isa::Avx512Vnni);
                    if crate::x86_int8_512::detected() {
                        v.push(Isa::Avx512);
                    }
                }
            }
        }
        v
    }
}

thread_local! {
    /// Scales, minimum sums and segment accumulators of one value call.
    static OUTER: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Rounded weights of one segment.
    static INNER: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Lanes of the float sums next to the integer products (see the module doc).
pub(crate) const LANES: usize = 16;

/// Adds [`LANES`] partial sums as the kernels do: lane `l` and `l + 8`, then
/// `l + 4`, then `l + 2`, then the last two.
#[inline]
pub(crate) fn tree16(a: &[f32; LANES]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
    let s4: [f32; 4] = std::array::from_fn(|l| s8[l] + s8[l + 4]);
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

/// `sum_i a_i b_i` in [`LANES`] lanes: element `i` goes to lane `i % 16` with
/// a fused multiply-add (always fused, as the vector kernels), in order; the
/// lanes are added by [`tree16`].
pub(crate) fn dot16(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a[..n].chunks_exact(LANES), b[..n].chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[l] = x.mul_add(*y, acc[l]);
    }
    tree16(&acc)
}

/// Takes a thread-local scratch buffer out for one call (a nested call on
/// this thread, run while it waits for its segments, gets an empty one).
pub(crate) fn take<T>(key: &'static LocalKey<RefCell<Vec<T>>>) -> Vec<T> {
    key.with(|c| std::mem::take(&mut *c.borrow_mut()))
}

/// Puts a buffer from [`take`] back, keeping the larger of the two.
pub(crate) fn give_back<T>(key: &'static LocalKey<RefCell<Vec<T>>>, v: Vec<T>) {
    key.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() < v.len() {
            *c = v;
        }
    });
}

/// The rounding step of values up to `amax` onto `0 ..= levels` and its
/// inverse: `(amax * (1 / levels), levels / amax)`; `(0, 0)` for `amax = 0`
/// and for an `amax` so small that the inverse overflows (below about
/// `levels / f32::MAX`, 1e-36: the values then round to 0, as a zero query
/// or weight block does, instead of to the infinite codes each kernel
/// saturates its own way).
#[inline]
pub(crate) fn steps(amax: f32, levels: f32) -> (f32, f32) {
    let inv = levels / amax;
    if amax > 0.0 && inv <= f32::MAX {
        (amax * (1.0 / levels), inv)
    } else {
        (0.0, 0.0)
    }
}

/// One segment's query rounding of head `q` (see the module doc): `smax`
/// the largest scale of each channel over the segment's groups; fills `qi`
/// and returns the step `sigma` (0 for a zero query, whose codes are then all
/// 0).
pub(crate) fn segment_query(q: &[f32], smax: &[f32], qi: &mut [f32]) -> f32 {
    let amax = q
        .iter()
        .zip(smax)
        .fold(0.0f32, |m, (x, s)| m.max(x.abs() * s));
    let (step, inv) = steps(amax, 127.0);
    for (o, x) in qi.iter_mut().zip(q) {
        *o = x * inv;
    }
    step
}

/// One key group's query bytes: `q8_c = round(qi_c * scale_c)`, half to even,
/// within +-127.
fn round_query(qi: &[f32], sc: &[f32], q8: &mut [i8]) {
    for ((o, x), s) in q8.iter_mut().zip(qi).zip(sc) {
        *o = (x * s).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
}

/// Portable scores of one key block (`d` words, one per channel):
/// `out[j * stride + off + l] = sig[j] * sum_c q8[j][c] * code(l, c) + bias[j]`.
///
/// # Safety
/// `out` must be valid for writes at `j * stride + off + l` for every head
/// `j < q8.len()` and token `l < 32 / bits`, and no other thread may touch
/// those elements during the call.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn key_block_portable(
    words: &[u32],
    bits: u32,
    q8: &[[i8; MAX_D]],
    sig: &[f32],
    bias: &[f32],
    out: *mut f32,
    stride: usize,
    off: usize,
) {
    let p = 32 / bits as usize;
    let mask = (1u32 << bits) - 1;
    let mut sums = [[0i32; 16]; MAX_G];
    for (c, &w) in words.iter().enumerate() {
        for l in 0..p {
            let code = ((w >> (bits as usize * l)) & mask) as i32;
            for (sj, qj) in sums.iter_mut().zip(q8) {
                sj[l] += qj[c] as i32 * code;
            }
        }
    }
    for (j, sj) in sums.iter().enumerate().take(q8.len()) {
        for (l, &x) in sj[..p].iter().enumerate() {
            // SAFETY: in bounds and exclusive (the caller's contract).
            unsafe { *out.add(j * stride + off + l) = sig[j] * x as f32 + bias[j] };
        }
    }
}

impl MinMaxStore {
    /// True when the integer kernels apply: 2 or 4 bits, `group` a multiple
    /// of the codes per word, within the stack limits.
    pub(crate) fn int8_ok(&self, g: usize) -> bool {
        let q = &self.q;
        q.arithmetic == crate::Arithmetic::Int8
            && (q.bits == 2 || q.bits == 4)
            && q.group.is_multiple_of(32 / q.bits as usize)
            && self.d <= MAX_D
            && (1..=MAX_G).contains(&g)
    }

    /// Per-channel key scores with integer products (see the module doc).
    /// Long heads are cut into segments of [`seg_tokens`] scored in
    /// parallel (each token's score is computed alone, so the result does
    /// not depend on the cut).
    pub(crate) fn scores_int8(
        &self,
        isa: Isa,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let groups = self.len / self.q.group;
        assert!(q.len() >= g * self.d && out.len() >= (g - 1) * stride + groups * self.q.group);
        let per = (seg_tokens(self.len) / self.q.group).max(1);
        let ptr = SyncPtr(out.as_mut_ptr());
        let run = |g0: usize, g1: usize| {
            // SAFETY: `out` holds `g` rows of `stride` covering every token
            // (asserted above); segments write disjoint token ranges.
            unsafe { self.scores_int8_range(isa, q, g, ptr.get(), stride, g0, g1, 0, None) }
        };
        if groups <= per {
            run(0, groups);
        } else {
            use rayon::prelude::*;
            (0..groups.div_ceil(per))
                .into_par_iter()
                .for_each(|s| run(s * per, ((s + 1) * per).min(groups)));
        }
    }

    /// [`QuantStore::scores_range`](minikv_core::QuantStore::scores_range),
    /// and with `max` each head's largest score of the range
    /// ([`QuantStore::scores_range_max`](minikv_core::QuantStore::scores_range_max)).
    pub(crate) fn scores_range_opt_max(
        &self,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
        rows: std::ops::Range<usize>,
        max: Option<&mut [f32]>,
    ) {
        let grp = self.q.group;
        let ok = self.q.axis == minikv_core::Axis::Channel
            && self.int8_ok(g)
            && rows.start.is_multiple_of(seg_tokens(self.len))
            && rows.end.is_multiple_of(grp)
            && rows.end <= self.len;
        if !ok {
            let n = rows.len();
            minikv_core::quant::scores_range_by_whole(self, q, g, out, stride, rows);
            if let Some(mx) = max {
                minikv_core::quant::row_maxima(out, g, stride, n, mx);
            }
            return;
        }
        let m = rows.len();
        assert!(q.len() >= g * self.d && out.len() >= (g - 1) * stride + m && m <= stride);
        // SAFETY: `out` holds `g` rows of `stride >= m` (asserted); the
        // groups' tokens are `rows`, written at `t - rows.start`.
        unsafe {
            self.scores_int8_range(
                Isa::detected(),
                q,
                g,
                out.as_mut_ptr(),
                stride,
                rows.start / grp,
                rows.end / grp,
                rows.start,
                max,
            )
        }
    }

    /// Key scores of groups `g0 .. g1` (one segment: one rounding step per
    /// head), token `t`'s at `out[j * stride + t - origin]`; with `max`,
    /// `max[j]` the largest of head `j`'s (as `simd::max` of the row).
    ///
    /// # Safety
    /// `out` must be valid for writes at `j * stride + t - origin` for `j <
    /// g` and every token `t` of the groups (all at least `origin`), and no
    /// other thread may touch those.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn scores_int8_range(
        &self,
        isa: Isa,
        q: &[f32],
        g: usize,
        out: *mut f32,
        stride: usize,
        g0: usize,
        g1: usize,
        origin: usize,
        max: Option<&mut [f32]>,
    ) {
        let (d, grp, bits) = (self.d, self.q.group, self.q.bits);
        debug_assert!(g0 * grp >= origin);
        debug_assert!(max.as_ref().is_none_or(|m| m.len() >= g));
        let p = 32 / bits as usize;
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512 && crate::x86_int8_512::keys_ok(self, g) {
            // SAFETY: as this function's contract.
            unsafe { crate::x86_int8_512::keys(self, q, g, out, stride, g0, g1, origin, max) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        let simd = crate::x86_int8::keys_ok(isa, self, g);
        #[cfg(not(target_arch = "x86_64"))]
        let simd = false;
        let mut sc = [0.0f32; MAX_D];
        let mut mn = [0.0f32; MAX_D];
        let mut q8 = [[0i8; MAX_D]; MAX_G];
        let mut qx = [0i32; MAX_G * MAX_D];
        let mut sig = [0.0f32; MAX_G];
        let mut bias = [0.0f32; MAX_G];
        // The segment's rounding step per head.
        let mut smax = [0.0f32; MAX_D];
        for gi in g0..g1 {
            self.scale[0].read(gi * d, &mut sc[..d]);
            for (m, s) in smax[..d].iter_mut().zip(&sc[..d]) {
                *m = m.max(*s);
            }
        }
        let mut qi = [0.0f32; MAX_G * MAX_D];
        for j in 0..g {
            sig[j] = segment_query(
                &q[j * d..(j + 1) * d],
                &smax[..d],
                &mut qi[j * d..(j + 1) * d],
            );
        }
        for gi in g0..g1 {
            self.scale[0].read(gi * d, &mut sc[..d]);
            self.min[0].read(gi * d, &mut mn[..d]);
            for j in 0..g {
                let qj = &q[j * d..(j + 1) * d];
                let qij = &qi[j * d..(j + 1) * d];
                bias[j] = dot16(qj, &mn[..d]);
                #[cfg(target_arch = "x86_64")]
                if simd {
                    crate::x86_int8::query_group(qij, &sc[..d], &mut qx[j * d..(j + 1) * d]);
                    continue;
                }
                round_query(qij, &sc[..d], &mut q8[j][..d]);
            }
            for k in (gi * grp / p)..((gi + 1) * grp / p) {
                let words = &self.words[k * d..(k + 1) * d];
                #[cfg(target_arch = "x86_64")]
                if simd {
                    // SAFETY: the block's tokens are in this call's groups.
                    unsafe {
                        crate::x86_int8::key_block(
                            isa,
                            words,
                            bits,
                            &qx[..g * d],
                            &sig[..g],
                            &bias[..g],
                            out,
                            stride,
                            k * p - origin,
                        )
                    };
                    continue;
                }
                // SAFETY: as above.
                unsafe {
                    key_block_portable(
                        words,
                        bits,
                        &q8[..g],
                        &sig[..g],
                        &bias[..g],
                        out,
                        stride,
                        k * p - origin,
                    )
                };
            }
        }
        if let Some(mx) = max {
            let (a, b) = (g0 * grp - origin, g1 * grp - origin);
            for (j, m) in mx[..g].iter_mut().enumerate() {
                // SAFETY: the scores just written (this function's contract).
                let row = unsafe { std::slice::from_raw_parts(out.add(j * stride + a), b - a) };
                *m = minikv_core::simd::max(row);
            }
        }
    }
}

#[path = "int8_values.rs"]
mod values;

#[cfg(test)]
#[path = "int8_tests.rs"]
pub(crate) mod tests;
