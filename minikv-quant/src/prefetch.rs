//! Software prefetch for the fused decode loops: a model's layers do not fit
//! in the caches, so every decode step streams each layer's codes, scales
//! and minimums from memory; the hardware prefetchers follow long streams
//! but lose time at the start of the many short ones (one per head,
//! segment and group buffer). The loops ask for the lines
//! [`PREFETCH_TOKENS`] tokens ahead of the ones they read. A prefetch is a
//! hint: it never faults and never changes a result. x86-64 only (the
//! kernels that use it are).

/// Tokens ahead of the ones being read whose lines the loops ask for.
pub(crate) const PREFETCH_TOKENS: usize = 256;

/// Hints the cache lines of `bytes` bytes from `p` into the first-level
/// cache (any address: the pointer is formed by wrapping arithmetic and
/// never dereferenced).
#[inline(always)]
pub(crate) fn lines(p: *const u8, bytes: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    let mut o = 0;
    while o < bytes {
        // SAFETY: a prefetch reads nothing and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o) as *const i8) };
        o += 64;
    }
}
