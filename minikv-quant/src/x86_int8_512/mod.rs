//! 512-bit kernels of [`crate::int8`] (AVX-512 F/BW/VL, VNNI `vpdpbusd` and
//! VBMI `vpermb`, detected at run time), for the shapes the models have:
//! head dimensions that are multiples of 16, at most 16 value groups per
//! token, GQA groups of 1, 2, 3, 4, 6 or 8 query heads.
//!
//! Keys (per channel): one rounding step per head and segment (`int8::seg_tokens`)
//! (`crate::int8::segment_query`), then per key group the pre-scaled query
//! times the group's scales is rounded to 8 bits (`vpmovsdb`), one group
//! ahead of the products that use it; one 64-byte
//! load holds 16 channels' words, and one `vpermb` puts byte position k of
//! the 16 channels in lane k, so that the query's 16 bytes broadcast to every
//! lane multiply them (`vpdpbusd`); code positions are masked in place where
//! the unsigned operand allows (the power of two undone exactly in f32). The
//! four dwords of each lane are added by unpacks, which leaves token order.
//!
//! Values (per token): per block of [`TB`] tokens and head, the weights
//! `p * scale` of every value group are rounded to 8 bits in registers (one
//! division for four groups), packed with `vpackus` and laid out per four
//! tokens (a lane per quad, a dword per group); each block is rounded in
//! two phases over all heads (products and maxima, then steps and codes)
//! one block ahead of its products, so that the core overlaps the chains.
//! Four rows' 16-byte chunks are interleaved bytewise by one `vpermb`, so
//! that a shift and a mask per code position give 16 channels' codes of
//! four tokens, multiplied with the four tokens' weight bytes (gathered by
//! a one-source `vpermd`, which issues beside the products). The `p . min`
//! sums run in the same pass, in [`crate::int8::LANES`] lanes.
//!
//! Every float step is the portable loops' operation on the same numbers
//! (the tests compare bitwise).

#![allow(clippy::needless_range_loop)]

use crate::int8::TB;
use crate::prefetch::{PREFETCH_TOKENS, lines as prefetch};
use crate::simd512::{load_ps, load_si, store_ps};
use crate::store::{Buf, MinMaxStore};
use std::arch::x86_64::*;

/// Largest head dimension of the key kernels (the rounded query of every
/// head stays on the stack).
const KEYS_MAX_D: usize = 256;

/// True when this CPU runs the 512-bit kernels.
pub(crate) fn detected() -> bool {
    minikv_core::cpu::avx512()
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vl")
        && std::is_x86_feature_detected!("avx512vnni")
        && std::is_x86_feature_detected!("avx512vbmi")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
}

fn supported_g(g: usize) -> bool {
    matches!(g, 1 | 2 | 3 | 4 | 6 | 8)
}

/// True when the key kernels handle this store and `g`.
pub(crate) fn keys_ok(st: &MinMaxStore, g: usize) -> bool {
    supported_g(g) && st.d.is_multiple_of(16) && st.d <= KEYS_MAX_D
}

/// True when the value kernels handle this store and `g`: rows a whole
/// number of 16-byte chunks (at most 16 of them), at most 16 groups.
pub(crate) fn values_ok(st: &MinMaxStore, g: usize) -> bool {
    let rb = st.d * st.q.bits as usize / 8;
    let nh = rb / 16;
    supported_g(g) && rb.is_multiple_of(16) && nh <= 16 && st.d / st.q.group <= 16
}

/// A scale or minimum buffer as the kernels read it: base pointer, half
/// precision or not, and its length.
fn src(b: &Buf) -> (*const u8, bool, usize) {
    match b {
        Buf::F16(v) => (v.as_ptr() as *const u8, true, v.len()),
        Buf::F32(v) => (v.as_ptr() as *const u8, false, v.len()),
    }
}

/// 16 scales or minimums from index `i` as f32 (lanes outside `k` are 0 and
/// not read).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn ld<const H: bool>(p: *const u8, i: usize, k: __mmask16) -> __m512 {
    // SAFETY: the caller's buffer holds every index of `k`'s lanes.
    unsafe {
        if H {
            _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                k,
                (p as *const i16).wrapping_add(i),
            ))
        } else {
            _mm512_maskz_loadu_ps(k, (p as *const f32).wrapping_add(i))
        }
    }
}

/// [`crate::int8::tree16`] of one register's lanes.
#[inline]
#[target_feature(enable = "avx512f")]
fn hsum16(v: __m512) -> f32 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s8 = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
}

/// Every dword of lane `k` of the result: the largest of the 16 lanes of
/// `m[k]`.
#[inline]
#[target_feature(enable = "avx512f")]
fn hmax4(m: [__m512; 4]) -> __m512 {
    let c01 = _mm512_max_ps(
        _mm512_shuffle_f32x4::<0x44>(m[0], m[1]),
        _mm512_shuffle_f32x4::<0xEE>(m[0], m[1]),
    );
    let c23 = _mm512_max_ps(
        _mm512_shuffle_f32x4::<0x44>(m[2], m[3]),
        _mm512_shuffle_f32x4::<0xEE>(m[2], m[3]),
    );
    let e = _mm512_max_ps(
        _mm512_shuffle_f32x4::<0x88>(c01, c23),
        _mm512_shuffle_f32x4::<0xDD>(c01, c23),
    );
    let f = _mm512_max_ps(e, _mm512_permute_ps::<0x4E>(e));
    _mm512_max_ps(f, _mm512_permute_ps::<0xB1>(f))
}

/// Lane `k`, dword `s` of the result: the sum of the four dwords of lane `k`
/// of `a[s]`.
#[inline]
#[target_feature(enable = "avx512f")]
fn dwords4(a: [__m512i; 4]) -> __m512i {
    let u0 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(a[0], a[1]),
        _mm512_unpackhi_epi32(a[0], a[1]),
    );
    let u1 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(a[2], a[3]),
        _mm512_unpackhi_epi32(a[2], a[3]),
    );
    _mm512_add_epi32(_mm512_unpacklo_epi64(u0, u1), _mm512_unpackhi_epi64(u0, u1))
}

/// Lane `k`, dwords `s` and `s + 2` of the result: the sum of the four
/// dwords of lane `k` of `a[s]`.
#[inline]
#[target_feature(enable = "avx512f")]
fn dwords2(a: [__m512i; 2]) -> __m512i {
    let u = _mm512_add_epi32(
        _mm512_unpacklo_epi32(a[0], a[1]),
        _mm512_unpackhi_epi32(a[0], a[1]),
    );
    _mm512_add_epi32(u, _mm512_shuffle_epi32::<0x4E>(u))
}

/// Dword 0 of lane `k` of the result: [`crate::int8::tree16`] of `b[k]`'s
/// lanes (the same additions, four registers at once).
#[inline]
#[target_feature(enable = "avx512f")]
fn tree16x4(b: [__m512; 4]) -> __m512 {
    // s8 = l + (l + 8): 128-bit lanes 0 + 2 and 1 + 3.
    let u01 = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x44>(b[0], b[1]),
        _mm512_shuffle_f32x4::<0xEE>(b[0], b[1]),
    );
    let u23 = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x44>(b[2], b[3]),
        _mm512_shuffle_f32x4::<0xEE>(b[2], b[3]),
    );
    // s4 = s8[l] + s8[l + 4], one register per lane.
    let v = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(u01, u23),
        _mm512_shuffle_f32x4::<0xDD>(u01, u23),
    );
    // (s4[0] + s4[2]) + (s4[1] + s4[3]).
    let w = _mm512_add_ps(v, _mm512_permute_ps::<0x4E>(v));
    _mm512_add_ps(w, _mm512_permute_ps::<0xB1>(w))
}

/// Runs `$f::<CPB, NG, H, $x>` for `$bits`, `$g`, the scale dtype `$h` and
/// the kernel's shape parameter `$x` (a literal).
macro_rules! dispatch {
    ($bits:expr, $g:expr, $h:expr, $f:ident::<$x:literal>, ($($arg:expr),*)) => {{
        macro_rules! ng {
            ($cpb:literal, $hh:literal) => {
                match $g {
                    1 => $f::<$cpb, 1, $hh, $x>($($arg),*),
                    2 => $f::<$cpb, 2, $hh, $x>($($arg),*),
                    3 => $f::<$cpb, 3, $hh, $x>($($arg),*),
                    4 => $f::<$cpb, 4, $hh, $x>($($arg),*),
                    6 => $f::<$cpb, 6, $hh, $x>($($arg),*),
                    8 => $f::<$cpb, 8, $hh, $x>($($arg),*),
                    _ => unreachable!("GQA group checked by keys_ok / values_ok"),
                }
            };
        }
        match ($bits, $h) {
            (2, true) => ng!(4, true),
            (2, false) => ng!(4, false),
            (4, true) => ng!(2, true),
            (4, false) => ng!(2, false),
            _ => unreachable!("2 or 4 bits checked by int8_ok"),
        }
    }};
}

mod keys;
mod values;
pub(crate) use keys::keys;
pub(crate) use values::{add_out, values};
