//! 512-bit kernels of [`crate::int8`] (AVX-512 F/BW/VL, VNNI `vpdpbusd` and
//! VBMI `vpermb`, detected at run time), for the shapes the models have:
//! head dimensions that are multiples of 16, at most 16 value groups per
//! token, GQA groups of 1, 2, 3, 4, 6 or 8 query heads.
//!
//! Keys (per channel): one group of tokens at a time, the query of every
//! head is scaled, rounded to 8 bits and laid out for the products in
//! registers (`vpmovsdb`, one `vpermd` per 16 channels); one 64-byte load
//! holds 16 channels' words, transposed per 128-bit lane (`vpshufb`) so that
//! four adjacent bytes hold one byte position of four channels; a shift and
//! a mask per code position give four channels' codes of 16 (2-bit) or 8
//! (4-bit) tokens, multiplied with the query bytes by `vpdpbusd`. The four
//! lanes of the sums are added by a lane transpose (`vshufi32x4`) and put
//! in token order by one `vpermd`.
//!
//! Values (per token): per block of [`TB`] tokens and head, the weights
//! `p * scale` of every value group are rounded to 8 bits in registers (one
//! division for all groups), packed with `vpmovusdb` and laid out per four
//! tokens; four rows' 16-byte chunks are interleaved bytewise by one
//! `vpermb`, so that a shift and a mask per code position give 16 channels'
//! codes of four tokens, multiplied with the four tokens' weight bytes. The
//! `p . min` sums run in the same pass, in [`crate::int8::LANES`] lanes.
//!
//! Every float step is the portable loops' operation on the same numbers
//! (the tests compare bitwise).

#![allow(clippy::needless_range_loop)]

use crate::int8::TB;
use crate::store::{Buf, MinMaxStore};
use std::arch::x86_64::*;

/// Largest head dimension of the key kernels (the rounded query of every
/// head stays on the stack).
const KEYS_MAX_D: usize = 256;

/// True when this CPU runs the 512-bit kernels.
pub(crate) fn detected() -> bool {
    std::is_x86_feature_detected!("avx512f")
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

/// Runs `$f::<CPB, NG, H>` for `$bits`, `$g` and the scale dtype `$h`.
macro_rules! dispatch {
    ($bits:expr, $g:expr, $h:expr, $f:ident, ($($arg:expr),*)) => {{
        macro_rules! ng {
            ($cpb:literal, $hh:literal) => {
                match $g {
                    1 => $f::<$cpb, 1, $hh>($($arg),*),
                    2 => $f::<$cpb, 2, $hh>($($arg),*),
                    3 => $f::<$cpb, 3, $hh>($($arg),*),
                    4 => $f::<$cpb, 4, $hh>($($arg),*),
                    6 => $f::<$cpb, 6, $hh>($($arg),*),
                    8 => $f::<$cpb, 8, $hh>($($arg),*),
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

/// Key scores of groups `g0 .. g1`, one segment (only when [`keys_ok`] and
/// [`detected`]): `out[j * stride + t - origin] = sig * sum + bias` as
/// `crate::int8` documents.
///
/// # Safety
/// `out` must be valid for writes at `j * stride + t - origin` for `j < g`
/// and every token `t` of the groups (all at least `origin`), and no other
/// thread may touch those.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn keys(
    st: &MinMaxStore,
    q: &[f32],
    g: usize,
    out: *mut f32,
    stride: usize,
    g0: usize,
    g1: usize,
    origin: usize,
) {
    let (d, grp, bits) = (st.d, st.q.group, st.q.bits);
    let (sc, h, ns) = src(&st.scale[0]);
    let (mn, _, nm) = src(&st.min[0]);
    assert!(keys_ok(st, g) && detected() && q.len() >= g * d);
    assert!(g1 * grp <= st.len && st.words.len() >= g1 * grp * d * bits as usize / 32);
    assert!(ns >= g1 * d && nm >= g1 * d);
    // SAFETY: the features were detected; the buffers hold the groups'
    // words, scales and minimums (asserted), `out` as the caller guarantees.
    unsafe {
        if d == 64 {
            dispatch!(
                bits,
                g,
                h,
                keys_k64,
                (
                    st.words.as_ptr(),
                    d,
                    grp,
                    sc,
                    mn,
                    q.as_ptr(),
                    out,
                    stride,
                    g0,
                    g1,
                    origin
                )
            );
            return;
        }
        dispatch!(
            bits,
            g,
            h,
            keys_k0,
            (
                st.words.as_ptr(),
                d,
                grp,
                sc,
                mn,
                q.as_ptr(),
                out,
                stride,
                g0,
                g1,
                origin
            )
        )
    }
}

macro_rules! keys_nm {
    ($name:ident, $nm:literal) => {
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma,f16c")]
        unsafe fn $name<const CPB: usize, const NG: usize, const H: bool>(
            words: *const u32,
            d: usize,
            grp: usize,
            sc: *const u8,
            mn: *const u8,
            q: *const f32,
            out: *mut f32,
            stride: usize,
            g0: usize,
            g1: usize,
            origin: usize,
        ) {
            // SAFETY: as `keys`.
            unsafe {
                keys_k::<CPB, NG, H, $nm>(words, d, grp, sc, mn, q, out, stride, g0, g1, origin)
            }
        }
    };
}
keys_nm!(keys_k64, 4);
keys_nm!(keys_k0, 0);

#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma,f16c")]
unsafe fn keys_k<const CPB: usize, const NG: usize, const H: bool, const NM: usize>(
    words: *const u32,
    d: usize,
    grp: usize,
    sc: *const u8,
    mn: *const u8,
    q: *const f32,
    out: *mut f32,
    stride: usize,
    g0: usize,
    g1: usize,
    origin: usize,
) {
    // SAFETY: as `keys`.
    unsafe {
        let bits = 8 / CPB;
        let per = 4 * CPB;
        let nm = if NM > 0 { NM } else { d / 16 };
        let all: __mmask16 = 0xffff;
        let zero = _mm512_setzero_ps();
        // The segment's rounding step per head (`int8::segment_query`).
        let mut smax = [zero; KEYS_MAX_D / 16];
        for gi in g0..g1 {
            for m in 0..nm {
                smax[m] = _mm512_max_ps(smax[m], ld::<H>(sc, gi * d + 16 * m, all));
            }
        }
        let mut qi = [zero; 8 * (KEYS_MAX_D / 16)];
        let mut sig = [0.0f32; NG];
        for j in 0..NG {
            let mut mx = zero;
            for m in 0..nm {
                let x = _mm512_abs_ps(_mm512_loadu_ps(q.add(j * d + 16 * m)));
                mx = _mm512_max_ps(mx, _mm512_mul_ps(x, smax[m]));
            }
            let (s, inv) = crate::int8::steps(_mm512_reduce_max_ps(mx), 127.0);
            sig[j] = s;
            for m in 0..nm {
                qi[j * nm + m] =
                    _mm512_mul_ps(_mm512_loadu_ps(q.add(j * d + 16 * m)), _mm512_set1_ps(inv));
            }
        }
        // One 64-byte load holds 16 channels' words; `vpermb` puts byte
        // position k (tokens 4k .. 4k + 3 at 2 bits, 2k .. 2k + 1 at 4) of
        // the 16 channels in lane k, channel order within the lane, so that
        // the query's 16 bytes broadcast to every lane multiply them.
        let tr: [u8; 64] = std::array::from_fn(|o| (4 * (o % 16) + o / 16) as u8);
        let tr = _mm512_loadu_si512(tr.as_ptr() as *const __m512i);
        let masks: [__m512i; CPB] =
            std::array::from_fn(|s| _mm512_set1_epi8((((1u32 << bits) - 1) << (bits * s)) as i8));
        // Token t's code position: t % 4 at 2 bits, t % 2 at 4.
        let unshift: [f32; 16] = std::array::from_fn(|t| 1.0 / (1u32 << (bits * (t % CPB))) as f32);
        let unshift = _mm512_loadu_ps(unshift.as_ptr());
        // 4-bit: lane k dwords 0 and 1 hold tokens 2k and 2k + 1.
        let pack2 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 0, 0, 0, 0, 0, 0, 0, 0);
        let mut q8 = [_mm_setzero_si128(); 8 * (KEYS_MAX_D / 16)];
        let mut bias = [[0.0f32; 4]; NG];
        let blocks = grp / per;
        let mut gc = g0;
        while gc < g1 {
            let ng = (g1 - gc).min(4);
            // `q . min` of four groups at once, in `dot16`'s order.
            let mut b = [[zero; 4]; NG];
            for k in 0..ng {
                for m in 0..nm {
                    let mv = ld::<H>(mn, (gc + k) * d + 16 * m, all);
                    for j in 0..NG {
                        b[j][k] =
                            _mm512_fmadd_ps(_mm512_loadu_ps(q.add(j * d + 16 * m)), mv, b[j][k]);
                    }
                }
            }
            for j in 0..NG {
                let mut t = [0.0f32; 16];
                _mm512_storeu_ps(t.as_mut_ptr(), tree16x4(b[j]));
                bias[j] = [t[0], t[4], t[8], t[12]];
            }
            for k in 0..ng {
                let gi = gc + k;
                for m in 0..nm {
                    let s = ld::<H>(sc, gi * d + 16 * m, all);
                    for j in 0..NG {
                        // Round half to even (MXCSR default) as the portable
                        // loop; |x| <= 127, so the saturation changes nothing.
                        let x = _mm512_cvtps_epi32(_mm512_mul_ps(qi[j * nm + m], s));
                        q8[j * nm + m] = _mm512_cvtsepi32_epi8(x);
                    }
                }
                for kb in 0..blocks {
                    let blk = gi * blocks + kb;
                    let wp = words.add(blk * d) as *const __m512i;
                    let mut acc = [[_mm512_setzero_si512(); CPB]; NG];
                    for m in 0..nm {
                        let x = _mm512_permutexvar_epi8(tr, _mm512_loadu_si512(wp.add(m)));
                        let qv: [__m512i; NG] =
                            std::array::from_fn(|j| _mm512_broadcast_i32x4(q8[j * nm + m]));
                        // Code position s stays in place (times 2^(bits s),
                        // at most 240: still a u8), undone exactly below.
                        for s in 0..CPB {
                            let c = _mm512_and_si512(x, masks[s]);
                            for j in 0..NG {
                                acc[j][s] = _mm512_dpbusd_epi32(acc[j][s], c, qv[j]);
                            }
                        }
                    }
                    for j in 0..NG {
                        let a = &acc[j];
                        let v = if CPB == 4 {
                            dwords4([a[0], a[1 % CPB], a[2 % CPB], a[3 % CPB]])
                        } else {
                            _mm512_permutexvar_epi32(pack2, dwords2([a[0], a[1 % CPB]]))
                        };
                        // The sums times 2^(bits s) are exact in f32 (below
                        // 2^24), so times 2^-(bits s) gives the sum exactly.
                        let v = _mm512_mul_ps(_mm512_cvtepi32_ps(v), unshift);
                        let f = _mm512_add_ps(
                            _mm512_mul_ps(_mm512_set1_ps(sig[j]), v),
                            _mm512_set1_ps(bias[j][k]),
                        );
                        let o = out.add(j * stride + blk * per - origin);
                        if CPB == 4 {
                            _mm512_storeu_ps(o, f);
                        } else {
                            _mm512_mask_storeu_ps(o, 0x00ff, f);
                        }
                    }
                }
            }
            gc += ng;
        }
    }
}

/// Value sums of tokens `a .. b` (`a` a multiple of 16; only when
/// [`values_ok`] and [`detected`]), token `t`'s weights at `p[j * stride + t
/// - origin]`: the integer parts flushed into `facc`
/// (`g x d`, zeroed by the caller, in the permuted layout [`add_out`]
/// restores) and the `p . min` sums of every head and group into `msum`
/// (`g x groups`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn values(
    st: &MinMaxStore,
    p: &[f32],
    g: usize,
    stride: usize,
    a: usize,
    b: usize,
    origin: usize,
    facc: &mut [f32],
    msum: &mut [f32],
) {
    let (d, grp, bits) = (st.d, st.q.group, st.q.bits as usize);
    let gpt = d / grp;
    let rb = d * bits / 8;
    assert!(values_ok(st, g) && detected() && a.is_multiple_of(16) && a <= b && b <= st.len);
    assert!(origin <= a && p.len() >= (g - 1) * stride + b - origin);
    assert!(facc.len() >= g * d && msum.len() >= g * gpt);
    assert!(st.words.len() * 4 >= st.len * rb);
    let mut sc = [std::ptr::null::<u8>(); 16];
    let mut mn = [std::ptr::null::<u8>(); 16];
    let mut half = true;
    for gi in 0..gpt {
        let (s, h, ns) = src(&st.scale[gi]);
        let (m, _, nm) = src(&st.min[gi]);
        assert!(ns >= b && nm >= b);
        (sc[gi], mn[gi], half) = (s, m, h);
    }
    let rows = st.words.as_ptr() as *const u8;
    // SAFETY: the features were detected; rows, scales and minimums hold
    // every token below `b`, `p`, `facc` and `msum` their lengths (asserted).
    unsafe {
        // The models' shape (d = 64, G = 16) with its loops unrolled.
        if d == 64 && grp == 16 {
            dispatch!(
                bits,
                g,
                half,
                values_k64,
                (
                    rows,
                    rb,
                    grp,
                    &sc[..gpt],
                    &mn[..gpt],
                    p.as_ptr().wrapping_sub(origin),
                    stride,
                    a,
                    b,
                    facc.as_mut_ptr(),
                    msum.as_mut_ptr()
                )
            );
            return;
        }
        dispatch!(
            bits,
            g,
            half,
            values_k0,
            (
                rows,
                rb,
                grp,
                &sc[..gpt],
                &mn[..gpt],
                p.as_ptr().wrapping_sub(origin),
                stride,
                a,
                b,
                facc.as_mut_ptr(),
                msum.as_mut_ptr()
            )
        )
    }
}

/// Value group of dword `i` of row chunk `h` (channels `(16h + i) * CPB ..`).
#[inline(always)]
fn group_of(h: usize, i: usize, cpb: usize, grp: usize) -> usize {
    ((16 * h + i) * cpb) / grp
}

macro_rules! values_shape {
    ($name:ident, $d64:literal) => {
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma,f16c")]
        unsafe fn $name<const CPB: usize, const NG: usize, const H: bool>(
            rows: *const u8,
            rb: usize,
            grp: usize,
            sc: &[*const u8],
            mn: &[*const u8],
            p: *const f32,
            stride: usize,
            a: usize,
            b: usize,
            facc: *mut f32,
            msum: *mut f32,
        ) {
            // SAFETY: as `values`.
            unsafe {
                values_k::<CPB, NG, H, $d64>(rows, rb, grp, sc, mn, p, stride, a, b, facc, msum)
            }
        }
    };
}
values_shape!(values_k64, true);
values_shape!(values_k0, false);

/// The value kernel; `D64`: d = 64 and G = 16 known at compile time.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma,f16c")]
unsafe fn values_k<const CPB: usize, const NG: usize, const H: bool, const D64: bool>(
    rows: *const u8,
    rb: usize,
    grp: usize,
    sc: &[*const u8],
    mn: &[*const u8],
    p: *const f32,
    stride: usize,
    a: usize,
    b: usize,
    facc: *mut f32,
    msum: *mut f32,
) {
    // SAFETY: as `values`.
    unsafe {
        let bits = 8 / CPB;
        let gpt = if D64 { 4 } else { sc.len() };
        let d = rb * CPB;
        let nh = if D64 { 4 / CPB } else { rb / 16 };
        // Codes are the signed operand here: code position s is kept times
        // 2^e(s) below 128, e(s) = bits s except the top position, shifted
        // down by `bits` first (e = bits (s - 1)).
        let e = |s: usize| {
            if s + 1 == CPB {
                bits * (s - 1)
            } else {
                bits * s
            }
        };
        let masks: [__m512i; CPB] =
            std::array::from_fn(|s| _mm512_set1_epi8((((1u32 << bits) - 1) << e(s)) as i8));
        // vpermb: output byte 4i + r = byte i of row r (input lane r).
        let il: [u8; 64] = std::array::from_fn(|o| (16 * (o % 4) + o / 4) as u8);
        let il = _mm512_loadu_si512(il.as_ptr() as *const __m512i);
        // Per chunk: the zone of four groups its weights come from, the
        // weight dword of each of its dwords per token quad (in the two
        // packed registers of the zone, see below), and the lane of its
        // dwords' taus in the zone's tau register.
        let mut zone = [0usize; 16];
        let mut avi = [[_mm512_setzero_si512(); 8]; 16];
        let mut tvi = [_mm512_setzero_si512(); 16];
        for h in 0..nh {
            zone[h] = group_of(h, 0, CPB, grp) / 4;
            let gr: [i32; 16] =
                std::array::from_fn(|i| (group_of(h, i, CPB, grp) - 4 * zone[h]) as i32);
            let tx: [i32; 16] = std::array::from_fn(|i| 4 * gr[i]);
            tvi[h] = _mm512_loadu_si512(tx.as_ptr() as *const __m512i);
            for qq in 0..8i32 {
                let ix: [i32; 16] = std::array::from_fn(|i| {
                    (gr[i] / 2) * 16 + 4 * (qq % 4) + 2 * (gr[i] % 2) + qq / 4
                });
                avi[h][qq as usize] = _mm512_loadu_si512(ix.as_ptr() as *const __m512i);
            }
        }
        let zero = _mm512_setzero_ps();
        let zi = _mm512_setzero_si512();
        let nz = gpt.div_ceil(4);
        let mut macc = [zero; 8 * 16];
        // Rounded weights and taus of up to SB blocks, per block, head and
        // zone: `zb` two registers (groups 0-1 and 2-3 of the zone, packed:
        // lane L holds quads L and 4 + L of the first group, then of the
        // second), `tauz` lane k: group 4 zone + k's tau in every dword.
        const SB: usize = 4;
        let mut zb = [[[[zi; 2]; 4]; NG]; SB];
        let mut tauz = [[[zero; 4]; NG]; SB];
        let mut t00 = a;
        while t00 < b {
            let nblk = (b - t00).div_ceil(TB).min(SB);
            // Rounding of every block first: independent chains the core
            // overlaps (one block's division no longer waits on products).
            for bi in 0..nblk {
                let t0 = t00 + bi * TB;
                let nb = TB.min(b - t0);
                let k0 = if nb >= 16 { 0xffff } else { (1u16 << nb) - 1 };
                let k1 = if nb >= 32 {
                    0xffff
                } else if nb > 16 {
                    (1u16 << (nb - 16)) - 1
                } else {
                    0
                };
                for j in 0..NG {
                    let pj = p.wrapping_add(j * stride + t0);
                    let p0 = _mm512_maskz_loadu_ps(k0, pj);
                    let p1 = _mm512_maskz_loadu_ps(k1, pj.wrapping_add(16));
                    for z in 0..nz {
                        let ng = (gpt - 4 * z).min(4);
                        let mut xs = [[zero; 2]; 4];
                        let mut mx = [zero; 4];
                        for k in 0..ng {
                            let gi = 4 * z + k;
                            let x0 = _mm512_mul_ps(p0, ld::<H>(sc[gi], t0, k0));
                            let x1 = _mm512_mul_ps(p1, ld::<H>(sc[gi], t0 + 16, k1));
                            mx[k] = _mm512_max_ps(x0, x1);
                            xs[k] = [x0, x1];
                            let m = &mut macc[j * gpt + gi];
                            *m = _mm512_mask3_fmadd_ps(p0, ld::<H>(mn[gi], t0, k0), *m, k0);
                            *m = _mm512_mask3_fmadd_ps(p1, ld::<H>(mn[gi], t0 + 16, k1), *m, k1);
                        }
                        // `int8::steps(amax, 255)` of four groups at once.
                        let am = hmax4(mx);
                        let pos = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(am, zero);
                        tauz[bi][j][z] = _mm512_maskz_mul_ps(pos, am, _mm512_set1_ps(1.0 / 255.0));
                        let inv = _mm512_maskz_div_ps(pos, _mm512_set1_ps(255.0), am);
                        let mut y = [[zi; 2]; 4];
                        for k in 0..ng {
                            let iv = _mm512_permutexvar_ps(_mm512_set1_epi32(4 * k as i32), inv);
                            for hf in 0..2 {
                                y[k][hf] = _mm512_cvtps_epi32(_mm512_mul_ps(xs[k][hf], iv));
                            }
                        }
                        // Codes are 0 ..= 255: the saturating packs keep them.
                        for pr in 0..2 {
                            let c = _mm512_packus_epi32(y[2 * pr][0], y[2 * pr][1]);
                            let e = _mm512_packus_epi32(y[2 * pr + 1][0], y[2 * pr + 1][1]);
                            zb[bi][j][z][pr] = _mm512_packus_epi16(c, e);
                        }
                    }
                }
            }
            for bi in 0..nblk {
                let t0 = t00 + bi * TB;
                let nb = TB.min(b - t0);
                let quads = nb.div_ceil(4);
                for h in 0..nh {
                    let zh = zone[h];
                    let mut acc = [[_mm512_setzero_si512(); CPB]; NG];
                    for qd in 0..quads {
                        let valid = (nb - 4 * qd).min(4);
                        let r0 = rows.add((t0 + 4 * qd) * rb + 16 * h);
                        let zr = if valid == 4 && rb == 16 {
                            _mm512_loadu_si512(r0 as *const __m512i)
                        } else {
                            let mut z = _mm512_setzero_si512();
                            for r in 0..valid {
                                let x = _mm_loadu_si128(r0.add(r * rb) as *const __m128i);
                                z = _mm512_mask_broadcast_i32x4(z, 0xf << (4 * r), x);
                            }
                            z
                        };
                        let x = _mm512_permutexvar_epi8(il, zr);
                        let ix = avi[h][qd];
                        let av: [__m512i; NG] = std::array::from_fn(|j| {
                            let w = &zb[bi][j][zh];
                            _mm512_permutex2var_epi32(w[0], ix, w[1])
                        });
                        // Times 2^e(s), undone exactly at the flush.
                        let top = _mm512_srl_epi16(x, _mm_cvtsi32_si128(bits as i32));
                        for s in 0..CPB {
                            let src = if s + 1 == CPB { top } else { x };
                            let c = _mm512_and_si512(src, masks[s]);
                            for j in 0..NG {
                                acc[j][s] = _mm512_dpbusd_epi32(acc[j][s], av[j], c);
                            }
                        }
                    }
                    for j in 0..NG {
                        let tv = _mm512_permutexvar_ps(tvi[h], tauz[bi][j][zh]);
                        for s in 0..CPB {
                            let o = facc.add(j * d + (h * CPB + s) * 16);
                            // Below 2^24 times 2^e(s): exact both ways.
                            let f = _mm512_mul_ps(
                                _mm512_cvtepi32_ps(acc[j][s]),
                                _mm512_set1_ps(1.0 / (1u32 << e(s)) as f32),
                            );
                            _mm512_storeu_ps(o, _mm512_fmadd_ps(tv, f, _mm512_loadu_ps(o)));
                        }
                    }
                }
            }
            t00 += nblk * TB;
        }
        for j in 0..NG {
            for gi in 0..gpt {
                *msum.add(j * gpt + gi) = hsum16(macc[j * gpt + gi]);
            }
        }
    }
}

/// `out[j][c] += facc + msum` of the value kernels' layout: position `(h *
/// CPB + s) * 16 + i` of `facc` is channel `(16h + i) * CPB + s`, whose
/// group's `p . min` sum is `msum[j * groups + c / G]`.
pub(crate) fn add_out(st: &MinMaxStore, g: usize, facc: &[f32], msum: &[f32], out: &mut [f32]) {
    let (d, grp, cpb) = (st.d, st.q.group, 8 / st.q.bits as usize);
    let gpt = d / grp;
    for j in 0..g {
        let (f, o, ms) = (
            &facc[j * d..(j + 1) * d],
            &mut out[j * d..(j + 1) * d],
            &msum[j * gpt..],
        );
        let mut pos = 0;
        for h in 0..d / (16 * cpb) {
            for s in 0..cpb {
                for i in 0..16 {
                    let c = (16 * h + i) * cpb + s;
                    o[c] += f[pos] + ms[c / grp];
                    pos += 1;
                }
            }
        }
    }
}
