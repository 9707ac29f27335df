//! Unaligned 512-bit loads and stores that are one instruction in every
//! build profile.
//!
//! `_mm512_loadu_ps` and its kin are a `read_unaligned` (`write_unaligned`)
//! in std. In a build with debug assertions (the tests' `dev` profile, where
//! this crate is still compiled at `opt-level = 3`) std keeps its
//! undefined-behaviour checks inside them, and the value goes through the
//! stack as two 256-bit halves and one 512-bit access, which store
//! forwarding cannot serve. The same access under an all-lanes mask has no
//! such checks; in release builds the two forms compile to the same
//! `vmovups`.

use std::arch::x86_64::*;

/// 16 floats at `p`.
///
/// # Safety
/// AVX-512F; 64 readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn load_ps(p: *const f32) -> __m512 {
    // SAFETY: as the caller guarantees.
    unsafe { _mm512_maskz_loadu_ps(0xFFFF, p) }
}

/// Stores 16 floats at `p`.
///
/// # Safety
/// AVX-512F; 64 writable bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn store_ps(p: *mut f32, x: __m512) {
    // SAFETY: as the caller guarantees.
    unsafe { _mm512_mask_storeu_ps(p, 0xFFFF, x) }
}

/// 64 bytes at `p` as one integer register.
///
/// # Safety
/// AVX-512F; 64 readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn load_si(p: *const u8) -> __m512i {
    // SAFETY: as the caller guarantees.
    unsafe { _mm512_maskz_loadu_epi32(0xFFFF, p.cast()) }
}
