//! The key kernels (see the parent module).

#![allow(clippy::needless_range_loop)]

use super::*;

/// Key scores of groups `g0 .. g1`, one segment (only when [`keys_ok`] and
/// [`detected`]): `out[j * stride + t - origin] = sig * sum + bias` as
/// `crate::int8` documents; with `max`, `max[j]` the largest of head `j`'s
/// scores (`-inf` for no group), kept in registers as they are written.
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
    max: Option<&mut [f32]>,
) {
    let (d, grp, bits) = (st.d, st.q.group, st.q.bits);
    let (sc, h, ns) = src(&st.scale[0]);
    let (mn, _, nm) = src(&st.min[0]);
    assert!(keys_ok(st, g) && detected() && q.len() >= g * d);
    assert!(g1 * grp <= st.len && st.words.len() >= g1 * grp * d * bits as usize / 32);
    assert!(ns >= g1 * d && nm >= g1 * d);
    assert!(max.as_ref().is_none_or(|m| m.len() >= g));
    let mx = max.map_or(std::ptr::null_mut(), |m| m.as_mut_ptr());
    // SAFETY: the features were detected; the buffers hold the groups'
    // words, scales and minimums (asserted), `out` as the caller guarantees.
    unsafe {
        if d == 64 {
            dispatch!(
                bits,
                g,
                h,
                keys_k::<4>,
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
                    origin,
                    mx
                )
            );
            return;
        }
        dispatch!(
            bits,
            g,
            h,
            keys_k::<0>,
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
                origin,
                mx
            )
        )
    }
}

/// The key kernel; `NM`: the number of 16-channel blocks when known at
/// compile time (the models' d = 64), else 0.
#[allow(clippy::too_many_arguments)]
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
    mx_out: *mut f32,
) {
    // SAFETY: as `keys`.
    unsafe {
        let bits = 8 / CPB;
        // Each head's running maximum of the scores written (vmaxps keeps
        // the running value unless the score is larger: `simd::max`'s rule).
        let mut mx = [_mm512_set1_ps(f32::NEG_INFINITY); NG];
        let per = 4 * CPB;
        let nm = if NM > 0 { NM } else { d / 16 };
        let zero = _mm512_setzero_ps();
        // The segment's rounding step per head (`int8::segment_query`).
        let mut qi = [zero; 8 * (KEYS_MAX_D / 16)];
        let mut sig = [0.0f32; NG];
        segment_query::<NG, H>(sc, q, d, nm, g0, g1, &mut qi, &mut sig);
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
        let unshift = load_ps(unshift.as_ptr());
        // sig 2^-(bits s) in one product: exact while it stays a normal
        // number (then sum 2^(bits s) times it rounds as sig times sum).
        let fold = sig
            .iter()
            .all(|&x| x == 0.0 || x >= f32::MIN_POSITIVE * 65536.0);
        let sigu: [__m512; NG] =
            std::array::from_fn(|j| _mm512_mul_ps(unshift, _mm512_set1_ps(sig[j])));
        // 4-bit: lane k dwords 0 and 1 hold tokens 2k and 2k + 1.
        let pack2 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 0, 0, 0, 0, 0, 0, 0, 0);
        // The rounded query of the group in hand and of the next one: the
        // next group's rounding (scale loads, products, conversions) is
        // issued before this group's products, so its latency overlaps them.
        let mut bufs = [[_mm_setzero_si128(); 8 * (KEYS_MAX_D / 16)]; 2];
        let [a, b] = &mut bufs;
        let (mut q8, mut next) = (a, b);
        if g0 < g1 {
            round_query::<NG, H>(sc, &qi, d, nm, g0, q8);
        }
        let blocks = grp / per;
        let mut gc = g0;
        while gc < g1 {
            let ng = (g1 - gc).min(4);
            let bias = group_bias::<NG, H>(mn, q, d, nm, gc, ng);
            for k in 0..ng {
                let gi = gc + k;
                if gi + 1 < g1 {
                    round_query::<NG, H>(sc, &qi, d, nm, gi + 1, next);
                }
                prefetch_group::<H>(words, sc, mn, d, blocks, gi + PREFETCH_TOKENS / grp);
                for kb in 0..blocks {
                    let blk = gi * blocks + kb;
                    let wp = words.add(blk * d) as *const __m512i;
                    let mut acc = [[_mm512_setzero_si512(); CPB]; NG];
                    for m in 0..nm {
                        let x = _mm512_permutexvar_epi8(tr, load_si(wp.add(m).cast()));
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
                    // Each step over every head before the next: the
                    // heads' chains side by side in the code.
                    let mut v = token_sums::<CPB, NG>(&acc, pack2);
                    for j in 0..NG {
                        let sv = if fold {
                            _mm512_mul_ps(v[j], sigu[j])
                        } else {
                            _mm512_mul_ps(_mm512_set1_ps(sig[j]), _mm512_mul_ps(v[j], unshift))
                        };
                        v[j] = _mm512_add_ps(sv, _mm512_set1_ps(bias[j][k]));
                    }
                    for j in 0..NG {
                        let (f, o) = (v[j], out.add(j * stride + blk * per - origin));
                        if CPB == 4 {
                            store_ps(o, f);
                            mx[j] = _mm512_max_ps(f, mx[j]);
                        } else {
                            _mm512_mask_storeu_ps(o, 0x00ff, f);
                            mx[j] = _mm512_mask_max_ps(mx[j], 0x00ff, f, mx[j]);
                        }
                    }
                }
                // The next group's query becomes the one in hand.
                std::mem::swap(&mut q8, &mut next);
            }
            gc += ng;
        }
        store_maxima(&mx, mx_out);
    }
}

/// Each head's 16 token sums of one block as floats, in token order: the
/// four dwords of a lane added by unpacks (2 bits; at 4 bits two, then the
/// tokens packed by `pack2`). The sums times 2^(bits s) are exact in f32
/// (below 2^24), so the caller's times 2^-(bits s) gives each sum exactly.
#[inline(always)]
unsafe fn token_sums<const CPB: usize, const NG: usize>(
    acc: &[[__m512i; CPB]; NG],
    pack2: __m512i,
) -> [__m512; NG] {
    // SAFETY: AVX-512F is enabled in the calling kernel.
    unsafe {
        let mut v = [_mm512_setzero_ps(); NG];
        for j in 0..NG {
            let a = &acc[j];
            let w = if CPB == 4 {
                dwords4([a[0], a[1 % CPB], a[2 % CPB], a[3 % CPB]])
            } else {
                _mm512_permutexvar_epi32(pack2, dwords2([a[0], a[1 % CPB]]))
            };
            v[j] = _mm512_cvtepi32_ps(w);
        }
        v
    }
}

/// `out[j]` = the largest lane of `mx[j]`, unless `out` is null.
///
/// # Safety
/// A non-null `out` is valid for `NG` writes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store_maxima<const NG: usize>(mx: &[__m512; NG], out: *mut f32) {
    if !out.is_null() {
        for (j, m) in mx.iter().enumerate() {
            // SAFETY: as this function's contract.
            unsafe { *out.add(j) = _mm512_reduce_max_ps(*m) };
        }
    }
}

/// The query of every head rounded to 8 bits for key group `gi`: `qi`
/// times the group's scales, 16 channels per entry (`j * nm + m`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn round_query<const NG: usize, const H: bool>(
    sc: *const u8,
    qi: &[__m512],
    d: usize,
    nm: usize,
    gi: usize,
    q8: &mut [__m128i],
) {
    for m in 0..nm {
        // SAFETY: the caller's scales hold group `gi`.
        let s = unsafe { ld::<H>(sc, gi * d + 16 * m, 0xffff) };
        for j in 0..NG {
            // Round half to even (MXCSR default) as the portable loop;
            // |x| <= 127, so the saturation changes nothing.
            let x = _mm512_cvtps_epi32(_mm512_mul_ps(qi[j * nm + m], s));
            q8[j * nm + m] = _mm512_cvtsepi32_epi8(x);
        }
    }
}

/// `q . min` of groups `gc .. gc + ng` (at most four) per head, in
/// `dot16`'s order: `[j][k]` for group `gc + k`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn group_bias<const NG: usize, const H: bool>(
    mn: *const u8,
    q: *const f32,
    d: usize,
    nm: usize,
    gc: usize,
    ng: usize,
) -> [[f32; 4]; NG] {
    // SAFETY: as `keys`: the groups' minimums and `NG` query rows of `d`.
    unsafe {
        let mut b = [[_mm512_setzero_ps(); 4]; NG];
        for k in 0..ng {
            for m in 0..nm {
                let mv = ld::<H>(mn, (gc + k) * d + 16 * m, 0xffff);
                for j in 0..NG {
                    b[j][k] = _mm512_fmadd_ps(load_ps(q.add(j * d + 16 * m)), mv, b[j][k]);
                }
            }
        }
        let mut bias = [[0.0f32; 4]; NG];
        for j in 0..NG {
            let mut t = [0.0f32; 16];
            store_ps(t.as_mut_ptr(), tree16x4(b[j]));
            bias[j] = [t[0], t[4], t[8], t[12]];
        }
        bias
    }
}

/// The segment's step per head and the scaled query `qi` (see
/// `crate::int8::segment_query`), `nm` registers per head.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn segment_query<const NG: usize, const H: bool>(
    sc: *const u8,
    q: *const f32,
    d: usize,
    nm: usize,
    g0: usize,
    g1: usize,
    qi: &mut [__m512],
    sig: &mut [f32; NG],
) {
    // SAFETY: as `keys`.
    unsafe {
        let zero = _mm512_setzero_ps();
        let mut smax = [zero; KEYS_MAX_D / 16];
        if H {
            // Scales are >= 0, whose half-precision bits order as unsigned
            // integers: the maximum of the bits, 32 channels per register,
            // converted once (the same values as the float maxima).
            let mut hm = [_mm512_setzero_si512(); KEYS_MAX_D / 32];
            let s16 = sc as *const i16;
            let pairs = nm.div_ceil(2);
            for gi in g0..g1 {
                let row = s16.add(gi * d);
                for m2 in 0..pairs {
                    // The last of an odd count reads 16 channels only.
                    let k: __mmask32 = if 2 * m2 + 1 < nm { !0 } else { 0xffff };
                    let x = _mm512_maskz_loadu_epi16(k, row.add(32 * m2));
                    hm[m2] = _mm512_max_epu16(hm[m2], x);
                }
            }
            for m in 0..nm {
                let h = hm[m / 2];
                let half = if m % 2 == 0 {
                    _mm512_castsi512_si256(h)
                } else {
                    _mm512_extracti64x4_epi64::<1>(h)
                };
                smax[m] = _mm512_cvtph_ps(half);
            }
        } else {
            for gi in g0..g1 {
                for m in 0..nm {
                    smax[m] = _mm512_max_ps(smax[m], ld::<H>(sc, gi * d + 16 * m, 0xffff));
                }
            }
        }
        for j in 0..NG {
            let mut mx = zero;
            for m in 0..nm {
                let x = _mm512_abs_ps(load_ps(q.add(j * d + 16 * m)));
                mx = _mm512_max_ps(mx, _mm512_mul_ps(x, smax[m]));
            }
            let (s, inv) = crate::int8::steps(_mm512_reduce_max_ps(mx), 127.0);
            sig[j] = s;
            for m in 0..nm {
                qi[j * nm + m] = _mm512_mul_ps(load_ps(q.add(j * d + 16 * m)), _mm512_set1_ps(inv));
            }
        }
    }
}

/// Hints key group `ga`'s codes (`blocks` blocks of `d` words), scales and
/// minimums into the cache (`crate::prefetch`).
#[inline(always)]
fn prefetch_group<const H: bool>(
    words: *const u32,
    sc: *const u8,
    mn: *const u8,
    d: usize,
    blocks: usize,
    ga: usize,
) {
    let es = if H { 2 } else { 4 };
    prefetch(words.wrapping_add(ga * blocks * d).cast(), blocks * d * 4);
    prefetch(sc.wrapping_add(ga * d * es), d * es);
    prefetch(mn.wrapping_add(ga * d * es), d * es);
}
