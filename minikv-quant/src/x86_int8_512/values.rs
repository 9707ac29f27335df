//! The value kernels (see the parent module).

#![allow(clippy::needless_range_loop)]

use super::*;

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
                values_k::<true>,
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
            values_k::<false>,
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

/// The value kernel; `D64`: d = 64 and G = 16 known at compile time.
#[allow(clippy::too_many_arguments)]
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
        let (rb, grp) = if D64 { (8 * bits, 16) } else { (rb, grp) };
        let d = rb * CPB;
        let nh = if D64 { 4 / CPB } else { rb / 16 };
        // vpermb: output byte 4i + r = byte i of row r (input lane r).
        let il: [u8; 64] = std::array::from_fn(|o| (16 * (o % 4) + o / 4) as u8);
        let il = _mm512_loadu_si512(il.as_ptr() as *const __m512i);
        // The same from two registers of four 32-byte rows, per chunk.
        let il2: [__m512i; 2] = std::array::from_fn(|h| {
            let x: [u8; 64] = std::array::from_fn(|o| (32 * (o % 4) + 16 * h + o / 4) as u8);
            _mm512_loadu_si512(x.as_ptr() as *const __m512i)
        });
        let (zone, avi, tvi) = chunk_tables::<CPB>(nh, grp);
        let zero = _mm512_setzero_ps();
        let zi = _mm512_setzero_si512();
        let mut macc = [zero; 8 * 16];
        // The block's rounded weights and taus per head and zone: `zb` two
        // registers (lane L: quad L, then quad 4 + L; dword k: group 4 zone
        // + k), `tauz` lane k: group 4 zone + k's tau in every dword.
        let mut zb = [[[[zi; 2]; 4]; NG]; 2];
        let mut tauz = [[[zero; 4]; NG]; 2];
        // A zone's products `p * scale` per head between the two phases of
        // its rounding, and their group maxima.
        let mut xs = [[[zero; 2]; 4]; NG];
        let mut am = [zero; NG];
        let sm = (&sc[..gpt], &mn[..gpt]);
        // Software-pipelined: the next block's rounding is issued before
        // this block's products (double-buffered weights), so that the core
        // overlaps the two (each alone is bound by its chains).
        macro_rules! round {
            ($t0:expr, $bf:expr) => {{
                let (t0, bf) = ($t0, $bf);
                prefetch_block::<H>(rows, rb, sm.0, sm.1, t0 + PREFETCH_TOKENS);
                let (w, t) = (&mut zb[bf], &mut tauz[bf]);
                round_block::<NG, H>(p, stride, t0, b, sm, &mut macc, (&mut xs, &mut am), (w, t));
            }};
        }
        if a < b {
            round!(a, 0);
        }
        let mut cur = 0;
        let mut t0 = a;
        while t0 < b {
            let nb = TB.min(b - t0);
            if t0 + TB < b {
                round!(t0 + TB, 1 - cur);
            }
            let r0 = rows.add(t0 * rb);
            for h in 0..nh {
                let (zh, w) = (zone[h], &zb[cur]);
                let acc = if nb == TB {
                    products::<CPB, NG, true>(r0, rb, h, nb, il, &il2, &avi[h], w, zh)
                } else {
                    products::<CPB, NG, false>(r0, rb, h, nb, il, &il2, &avi[h], w, zh)
                };
                for j in 0..NG {
                    let tv = _mm512_permutexvar_ps(tvi[h], tauz[cur][j][zh]);
                    flush::<CPB>(&acc[j], tv, facc.add(j * d + h * CPB * 16));
                }
            }
            cur = 1 - cur;
            t0 += TB;
        }
        for j in 0..NG {
            for gi in 0..gpt {
                *msum.add(j * gpt + gi) = hsum16(macc[j * gpt + gi]);
            }
        }
    }
}

/// Rounds the block of tokens from `t0` (below `b`): per zone, the two
/// phases ([`zone_products`] of every head, then [`round_zone`] of every
/// head), whose chains (a maximum's reduction, a division) are independent
/// and side by side in the code, so the core overlaps them (one head at a
/// time left them latency bound); weights and taus into `zb` and `tauz`.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
#[inline(always)]
unsafe fn round_block<const NG: usize, const H: bool>(
    p: *const f32,
    stride: usize,
    t0: usize,
    b: usize,
    sm: (&[*const u8], &[*const u8]),
    macc: &mut [__m512; 8 * 16],
    (xs, am): (&mut [[[__m512; 2]; 4]; NG], &mut [__m512; NG]),
    (zb, tauz): (&mut [[[__m512i; 2]; 4]; NG], &mut [[__m512; 4]; NG]),
) {
    // SAFETY: the caller's weights, scales and minimums hold the block.
    unsafe {
        let (gpt, nb, pt) = (sm.0.len(), TB.min(b - t0), p.wrapping_add(t0));
        for z in 0..gpt.div_ceil(4) {
            if nb == TB {
                zone_products::<NG, H, true>(pt, stride, t0, nb, sm, z, macc, xs, am);
            } else {
                zone_products::<NG, H, false>(pt, stride, t0, nb, sm, z, macc, xs, am);
            }
            for j in 0..NG {
                (tauz[j][z], zb[j][z]) = round_zone(am[j], &xs[j], (gpt - 4 * z).min(4));
            }
        }
    }
}

/// Phase one of zone `z`'s rounding for one block of `nb` tokens from `t0`
/// (`FULL`: `nb` is [`TB`], no lane masks): per head `j` (weights from
/// `pt[j * stride]`) and group `k` of the zone, the products `p * scale` of
/// the block's two halves into `xs[j][k]` and their maximum per group into
/// `am[j]` (lane `k`: group `k`'s, [`hmax4`]); `p . min` into `macc` (head
/// `j`, group `gi` at `j * groups + gi`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn zone_products<const NG: usize, const H: bool, const FULL: bool>(
    pt: *const f32,
    stride: usize,
    t0: usize,
    nb: usize,
    (sc, mn): (&[*const u8], &[*const u8]),
    z: usize,
    macc: &mut [__m512; 8 * 16],
    xs: &mut [[[__m512; 2]; 4]; NG],
    am: &mut [__m512; NG],
) {
    // SAFETY: the caller's weights, scales and minimums hold the block.
    unsafe {
        let gpt = sc.len();
        let ng = (gpt - 4 * z).min(4);
        let zero = _mm512_setzero_ps();
        let (k0, k1) = if FULL {
            (0xffff, 0xffff)
        } else {
            block_masks(nb)
        };
        for j in 0..NG {
            let pj = pt.wrapping_add(j * stride);
            let p0 = _mm512_maskz_loadu_ps(k0, pj);
            let p1 = _mm512_maskz_loadu_ps(k1, pj.wrapping_add(16));
            let mut mx = [zero; 4];
            for k in 0..ng {
                let gi = 4 * z + k;
                let x0 = _mm512_mul_ps(p0, ld::<H>(sc[gi], t0, k0));
                let x1 = _mm512_mul_ps(p1, ld::<H>(sc[gi], t0 + 16, k1));
                mx[k] = _mm512_max_ps(x0, x1);
                xs[j][k] = [x0, x1];
                let m = &mut macc[j * gpt + gi];
                *m = _mm512_mask3_fmadd_ps(p0, ld::<H>(mn[gi], t0, k0), *m, k0);
                *m = _mm512_mask3_fmadd_ps(p1, ld::<H>(mn[gi], t0 + 16, k1), *m, k1);
            }
            am[j] = hmax4(mx);
        }
    }
}

/// The integer sums of row chunk `h` of one block of `nb` tokens from `r0`
/// (`FULL`: `nb` is [`TB`], the loop without partial quads), per head and
/// code position. A quad's weights come from one register of its zone's
/// two by a one-source permute (`avi[quad]`), which leaves the two
/// multiply-add pipes to the products (a two-source permute measured as
/// sharing them).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn products<const CPB: usize, const NG: usize, const FULL: bool>(
    r0: *const u8,
    rb: usize,
    h: usize,
    nb: usize,
    il: __m512i,
    il2: &[__m512i; 2],
    avi: &[__m512i; 8],
    zb: &[[[__m512i; 2]; 4]; NG],
    zh: usize,
) -> [[__m512i; CPB]; NG] {
    // SAFETY: the caller's rows hold `nb` rows of `rb` bytes from `r0`.
    unsafe {
        let bits = 8 / CPB;
        let masks: [__m512i; CPB] = std::array::from_fn(|s| {
            _mm512_set1_epi8((((1u32 << bits) - 1) << shift::<CPB>(s)) as i8)
        });
        let quads = if FULL { TB / 4 } else { nb.div_ceil(4) };
        let mut acc = [[_mm512_setzero_si512(); CPB]; NG];
        for qd in 0..quads {
            let valid = if FULL { 4 } else { (nb - 4 * qd).min(4) };
            let x = interleaved(r0.add(4 * qd * rb), rb, h, valid, il, il2);
            let mut av = [_mm512_setzero_si512(); NG];
            for j in 0..NG {
                av[j] = _mm512_permutexvar_epi32(avi[qd], zb[j][zh][qd / 4]);
            }
            // Times 2^shift(s), undone exactly at the flush.
            let top = _mm512_srl_epi16(x, _mm_cvtsi32_si128(bits as i32));
            for s in 0..CPB {
                let src = if s + 1 == CPB { top } else { x };
                let c = _mm512_and_si512(src, masks[s]);
                for j in 0..NG {
                    acc[j][s] = _mm512_dpbusd_epi32(acc[j][s], av[j], c);
                }
            }
        }
        acc
    }
}

/// `out[j][c] += facc + msum` of the value kernels' layout: position `(h *
/// CPB + s) * 16 + i` of `facc` is channel `(16h + i) * CPB + s`, whose
/// group's `p . min` sum is `msum[j * groups + c / G]`.
pub(crate) fn add_out(st: &MinMaxStore, g: usize, facc: &[f32], msum: &[f32], out: &mut [f32]) {
    let (d, grp, cpb) = (st.d, st.q.group, 8 / st.q.bits as usize);
    let gpt = d / grp;
    // Channel c = (16h + i) cpb + s sits at (h cpb + s) 16 + i: with cpb a
    // power of two, shifts and masks (no division per element).
    let (ls, lm) = (cpb.trailing_zeros(), cpb - 1);
    let pos = |c: usize| {
        let (w, s) = (c >> ls, c & lm);
        ((w >> 4) * cpb + s) * 16 + (w & 15)
    };
    for j in 0..g {
        let (f, o) = (&facc[j * d..(j + 1) * d], &mut out[j * d..(j + 1) * d]);
        for (gi, og) in o.chunks_exact_mut(grp).enumerate() {
            let m = msum[j * gpt + gi];
            for (k, x) in og.iter_mut().enumerate() {
                *x += f[pos(gi * grp + k)] + m;
            }
        }
    }
}

/// Chunk `h` of the four rows from `r0` (the first `valid`), bytewise
/// interleaved (`il`: from one register; `il2[h]`: from two registers of
/// four whole 32-byte rows, one permute without the chunk gathering).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn interleaved(
    r0: *const u8,
    rb: usize,
    h: usize,
    valid: usize,
    il: __m512i,
    il2: &[__m512i; 2],
) -> __m512i {
    // SAFETY: the caller's rows hold `valid` rows of `rb` bytes from `r0`.
    unsafe {
        if valid == 4 && rb == 32 {
            _mm512_permutex2var_epi8(load_si(r0), il2[h], load_si(r0.add(64)))
        } else {
            _mm512_permutexvar_epi8(il, quad(r0.add(16 * h), rb, valid))
        }
    }
}

/// Chunk `r0` of four rows `rb` bytes apart (the first `valid`; zeros after)
/// in the four 128-bit lanes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn quad(r0: *const u8, rb: usize, valid: usize) -> __m512i {
    // SAFETY: the caller's rows hold `valid` chunks from `r0`.
    unsafe {
        if valid == 4 && rb == 16 {
            return load_si(r0);
        }
        let mut z = _mm512_setzero_si512();
        for r in 0..valid {
            let x = _mm_loadu_si128(r0.add(r * rb) as *const __m128i);
            z = _mm512_mask_broadcast_i32x4(z, 0xf << (4 * r), x);
        }
        z
    }
}

/// Per row chunk `h`: the zone of four groups its weights come from, the
/// weight dword of each of its dwords per token quad (an index into the
/// quad's register of the zone, [`round_zone`]'s layout), and the lane of
/// its dwords' taus in the zone's tau register.
#[inline]
#[target_feature(enable = "avx512f")]
#[allow(clippy::type_complexity)]
fn chunk_tables<const CPB: usize>(
    nh: usize,
    grp: usize,
) -> ([usize; 16], [[__m512i; 8]; 16], [__m512i; 16]) {
    // SAFETY: the loads read local arrays of 16 i32.
    unsafe {
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
                let ix: [i32; 16] = std::array::from_fn(|i| 4 * (qq % 4) + gr[i]);
                avi[h][qq as usize] = _mm512_loadu_si512(ix.as_ptr() as *const __m512i);
            }
        }
        (zone, avi, tvi)
    }
}

/// Codes are the signed operand of the value products: code position `s`
/// of a byte is kept in place, times `2^shift(s)` below 128; the top
/// position is first shifted down by one code width (so `bits (s - 1)`).
#[inline(always)]
const fn shift<const CPB: usize>(s: usize) -> usize {
    let bits = 8 / CPB;
    if s + 1 == CPB {
        bits * (s - 1)
    } else {
        bits * s
    }
}

/// Lane masks of the two halves of a block of `nb` tokens.
fn block_masks(nb: usize) -> (u16, u16) {
    let k0 = if nb >= 16 { 0xffff } else { (1u16 << nb) - 1 };
    let k1 = if nb >= 32 {
        0xffff
    } else if nb > 16 {
        (1u16 << (nb - 16)) - 1
    } else {
        0
    };
    (k0, k1)
}

/// Phase two of one zone's rounding (`int8::steps(amax, 255)` of four
/// groups at once, then `round(x / tau)`): the taus (lane k: group k's) and
/// the two weight registers (lane L: quad L, then quad 4 + L; dword k:
/// group k's four weights). `am` holds the groups' maxima (lane k: group
/// k's), `xs` their products' two halves.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn round_zone(am: __m512, xs: &[[__m512; 2]; 4], ng: usize) -> (__m512, [__m512i; 2]) {
    let zero = _mm512_setzero_ps();
    let pos = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(am, zero);
    let inv = _mm512_maskz_div_ps(pos, _mm512_set1_ps(255.0), am);
    // `steps`: a step whose inverse overflows is 0 as well.
    let ok = _mm512_mask_cmp_ps_mask::<_CMP_LE_OQ>(pos, inv, _mm512_set1_ps(f32::MAX));
    let tau = _mm512_maskz_mul_ps(ok, am, _mm512_set1_ps(1.0 / 255.0));
    let inv = _mm512_maskz_mov_ps(ok, inv);
    let mut y = [[_mm512_setzero_si512(); 2]; 4];
    for k in 0..ng {
        let iv = _mm512_permutexvar_ps(_mm512_set1_epi32(4 * k as i32), inv);
        for hf in 0..2 {
            y[k][hf] = _mm512_cvtps_epi32(_mm512_mul_ps(xs[k][hf], iv));
        }
    }
    // Codes are 0 ..= 255: the saturating packs keep them. Lane L of
    // `w[0]`: quads L and 4 + L of group 0, then of group 2 (dwords); of
    // `w[1]`: of groups 1 and 3.
    let w: [__m512i; 2] = std::array::from_fn(|pr| {
        let c = _mm512_packus_epi32(y[pr][0], y[pr][1]);
        let e = _mm512_packus_epi32(y[pr + 2][0], y[pr + 2][1]);
        _mm512_packus_epi16(c, e)
    });
    // Lane L, dword k: quad L (first register) or 4 + L (second) of group k.
    let lo = _mm512_unpacklo_epi32(w[0], w[1]);
    let hi = _mm512_unpackhi_epi32(w[0], w[1]);
    (
        tau,
        [_mm512_unpacklo_epi64(lo, hi), _mm512_unpackhi_epi64(lo, hi)],
    )
}

/// `facc = fma(tau, sum, facc)` for the `CPB` code positions of one chunk
/// (sums held times `2^shift(s)`, below 2^24: exact to undo in f32).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn flush<const CPB: usize>(acc: &[__m512i; CPB], tv: __m512, o: *mut f32) {
    for s in 0..CPB {
        let e = shift::<CPB>(s);
        // SAFETY: the caller's `facc` holds `CPB` registers from `o`.
        unsafe {
            let o = o.add(16 * s);
            let f = _mm512_mul_ps(
                _mm512_cvtepi32_ps(acc[s]),
                _mm512_set1_ps(1.0 / (1u32 << e) as f32),
            );
            store_ps(o, _mm512_fmadd_ps(tv, f, load_ps(o)));
        }
    }
}

/// Hints the block of [`TB`] tokens from `ta` into the cache: its rows
/// (`rb` bytes each), scales and minimums (`crate::prefetch`). One block at
/// a time, spread between the products: a burst of a whole round's lines
/// measured slower.
#[inline(always)]
fn prefetch_block<const H: bool>(
    rows: *const u8,
    rb: usize,
    sc: &[*const u8],
    mn: &[*const u8],
    ta: usize,
) {
    let es = if H { 2 } else { 4 };
    prefetch(rows.wrapping_add(ta * rb), TB * rb);
    for (s, m) in sc.iter().zip(mn) {
        prefetch(s.wrapping_add(ta * es), TB * es);
        prefetch(m.wrapping_add(ta * es), TB * es);
    }
}
