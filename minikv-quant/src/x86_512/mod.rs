//! The exact (f32) fused decode loops on 512-bit registers (compiled when
//! `target-cpu=native` enables AVX-512F, F16C and FMA; chosen for 2- or 4-bit
//! codes, groups of a multiple of 16 and heads of a multiple of 16 channels).
//!
//! Every output lane goes through the operations of the portable loops in
//! [`crate::exact`] in the same order (the same fused multiply-adds into the
//! same banks, banks added in bank order, then the same final additions), so
//! the results are bitwise those of the portable and AVX2 loops (tested
//! in `tests.rs`). What changes is what runs side by side: a register holds 16 lanes
//! (one 2-bit word, or two 4-bit words of the same group), and the kernels
//! keep several independent outputs in flight: up to four 16-token vectors
//! of key scores, and up to four 16-channel vectors of a value row, so that the FMA
//! units see 6-24 independent chains where one output alone is a single
//! chain over 64 channels or every token (the bank count is fixed by the
//! results and is small when several query heads share a word).
//!
//! `keys.rs`: per-channel key scores; `values.rs`: per-token value sums.

// Indexed loops over the constant-size register arrays unroll into named
// registers.
#![allow(clippy::needless_range_loop)]

use crate::int8::{SyncPtr, give_back, take};
use crate::simd512::{load_ps, load_si, store_ps};
use crate::store::{Buf, MinMaxStore};
use std::arch::x86_64::*;

/// 16 codes as floats: lane `l` holds code `l % P` of word `l / P` (`P = 16`:
/// `w0` alone; `P = 8`: `w0`, then `w1`). At 2 bits, after the shift, a
/// lane's low four bits index `lut` (code `i & mask` as a float at lane `i`),
/// which masks and converts in one permute.
#[inline(always)]
unsafe fn widen<const P: usize>(w0: u32, w1: u32, sh: __m512i, lut: __m512) -> __m512 {
    // SAFETY: AVX-512F is enabled at compile time (the module's cfg).
    unsafe {
        let wv = if P == 16 {
            _mm512_set1_epi32(w0 as i32)
        } else {
            _mm512_mask_set1_epi32(_mm512_set1_epi32(w0 as i32), 0xFF00, w1 as i32)
        };
        let x = _mm512_srlv_epi32(wv, sh);
        if P == 16 {
            _mm512_permutexvar_ps(x, lut)
        } else {
            // Measured slower through the permute at 4 bits: mask, convert.
            _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(15)))
        }
    }
}

/// Per-lane shift counts `bits * (l % P)` and [`widen`]'s table of codes.
#[inline(always)]
fn shifts<const P: usize>(bits: u32) -> (__m512i, __m512) {
    let sh: [i32; 16] = std::array::from_fn(|l| (bits as usize * (l % P)) as i32);
    let lut: [f32; 16] = std::array::from_fn(|i| (i & ((1 << bits) - 1)) as f32);
    // SAFETY: AVX-512F is enabled at compile time; the arrays hold 16 lanes.
    unsafe { (load_si(sh.as_ptr().cast()), load_ps(lut.as_ptr())) }
}

/// 16 four-bit codes of two adjacent words `w` (a token's 16 channels of a
/// value vector) in the pair order: lane `2m` holds code `m` of the first
/// word, lane `2m + 1` code `m` of the second (channels `m` and `8 + m`).
/// One 64-bit broadcast, no permute ([`PAIR_ORDER`] restores channel order).
#[inline(always)]
unsafe fn widen_pair(w: *const u32) -> __m512 {
    // SAFETY: AVX-512F is enabled at compile time; `w` points at two words.
    unsafe {
        let sh = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
        let wv = _mm512_set1_epi64((w as *const u64).read_unaligned() as i64);
        _mm512_cvtepi32_ps(_mm512_and_si512(
            _mm512_srlv_epi32(wv, sh),
            _mm512_set1_epi32(15),
        ))
    }
}

/// Lane `c` of the channel order from [`widen_pair`]'s order (a `vpermps`
/// index).
const PAIR_ORDER: [i32; 16] = [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15];

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
                Raw::S(p) => load_ps(p.add(i)),
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

/// Steps `from .. to` in banks as the portable loops do: index `i` into
/// `acc[i % B]` while below `whole` (a multiple of `B`; `from` one too), the
/// rest into bank 0.
#[inline(always)]
fn in_banks<A, const B: usize>(
    acc: &mut [A; B],
    (from, whole, to): (usize, usize, usize),
    mut step: impl FnMut(&mut A, usize),
) {
    let mut i = from;
    while i < to.min(whole) {
        for (k, bank) in acc.iter_mut().enumerate() {
            step(bank, i + k);
        }
        i += B;
    }
    while i < to {
        step(&mut acc[0], i);
        i += 1;
    }
}

/// Output `(v, j)` of the banks, added in bank order, then `x`.
#[inline(always)]
fn bank_sum<const NG: usize, const V: usize, const B: usize>(
    acc: &[[[__m512; NG]; V]; B],
    (v, j): (usize, usize),
    x: f32,
) -> __m512 {
    // SAFETY: AVX-512F is enabled at compile time (the module's cfg).
    unsafe {
        let mut s = acc[0][v][j];
        for bank in &acc[1..] {
            s = _mm512_add_ps(s, bank[v][j]);
        }
        _mm512_add_ps(s, _mm512_set1_ps(x))
    }
}

/// Whether the 512-bit loops apply: 2- or 4-bit codes, groups of a
/// multiple of 16 tokens (keys) or channels (values), heads of a multiple of
/// 16 channels.
pub(crate) fn applies(bits: u32, group: usize, d: usize) -> bool {
    matches!(bits, 2 | 4)
        && group.is_multiple_of(16)
        && d.is_multiple_of(16)
        && minikv_core::cpu::avx512()
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

mod keys;
mod values;

#[cfg(test)]
mod tests;
