//! x86 integer kernels of [`crate::int8`]: AVX2 (`vpmaddubsw` + `vpmaddwd`),
//! AVX-VNNI and AVX-512 VNNI (`vpdpbusd`), chosen at run time.
//!
//! Keys (per channel, block of `P` tokens, one word per channel): 8 channels'
//! words are loaded at once and each 128-bit lane is transposed (`vpshufb`)
//! so that four adjacent bytes hold one byte position of four channels; a
//! shift and mask per code position give four channels' codes of one token,
//! multiplied with the query's four bytes and summed into one `i32`.
//!
//! Values (per token, rows of `d * bits / 8` bytes): four tokens' rows are
//! interleaved bytewise (`vpunpck*bw`, `vperm2i128`) so that four adjacent
//! bytes hold one byte position of four tokens; a shift and mask per code
//! position give one channel's codes of four tokens, multiplied with the
//! four tokens' 8-bit weights. Sums stay in registers over a block of
//! tokens, then `facc = fma(tau, sum, facc)` in a permuted channel order
//! ([`unpermute`] restores it once per call).

#![allow(clippy::needless_range_loop)]

use crate::int8::{Isa, TB};
use crate::store::MinMaxStore;
use std::arch::x86_64::*;

macro_rules! kernels {
    ($m:ident, $feat:literal, |$acc:ident, $a:ident, $b:ident| $dp:expr) => {
        mod $m {
            use super::*;

            /// `acc + sum of four u8 x i8 products` per 32-bit lane.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn dp($acc: __m256i, $a: __m256i, $b: __m256i) -> __m256i {
                $dp
            }

            /// Scores of one key block (see the module doc): `out[j * stride
            /// + off + l] = sig[j] * sum + bias[j]`; `qx` is the query as
            /// [`query_lanes`] lays it out (`d` i32 per head).
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn keys<const CPB: usize, const NG: usize>(
                words: &[u32],
                qx: &[i32],
                sig: &[f32],
                bias: &[f32],
                out: *mut f32,
                stride: usize,
                off: usize,
            ) {
                // SAFETY: `words.len()` is a multiple of 8, `qx` holds
                // `NG * words.len()` values, `sig` and `bias` NG, and `out`
                // rows `j * stride + off .. + 4 * CPB` (caller).
                unsafe {
                    let d = words.len();
                    let bits = 8 / CPB;
                    let ctrl = _mm256_setr_epi8(
                        0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12, 1, 5, 9,
                        13, 2, 6, 10, 14, 3, 7, 11, 15,
                    );
                    let mask = _mm256_set1_epi8(((1u32 << bits) - 1) as i8);
                    let mut acc = [[_mm256_setzero_si256(); CPB]; NG];
                    let wp = words.as_ptr() as *const __m256i;
                    let qp = qx.as_ptr() as *const __m256i;
                    for m in 0..d / 8 {
                        let x = _mm256_shuffle_epi8(_mm256_loadu_si256(wp.add(m)), ctrl);
                        for s in 0..CPB {
                            let codes = _mm256_and_si256(
                                _mm256_srl_epi16(x, _mm_cvtsi32_si128((bits * s) as i32)),
                                mask,
                            );
                            for j in 0..NG {
                                let qv = _mm256_loadu_si256(qp.add(j * d / 8 + m));
                                acc[j][s] = dp(acc[j][s], codes, qv);
                            }
                        }
                    }
                    for j in 0..NG {
                        // v[s] lane i: token i * CPB + s.
                        let mut v = [_mm_setzero_si128(); CPB];
                        for s in 0..CPB {
                            v[s] = _mm_add_epi32(
                                _mm256_castsi256_si128(acc[j][s]),
                                _mm256_extracti128_si256::<1>(acc[j][s]),
                            );
                        }
                        // Transpose to token order: rows of 4 consecutive tokens.
                        let rows: [__m128i; CPB] = if CPB == 4 {
                            let t0 = _mm_unpacklo_epi32(v[0], v[1]);
                            let t1 = _mm_unpacklo_epi32(v[2], v[3 % CPB]);
                            let t2 = _mm_unpackhi_epi32(v[0], v[1]);
                            let t3 = _mm_unpackhi_epi32(v[2], v[3 % CPB]);
                            let r = [
                                _mm_unpacklo_epi64(t0, t1),
                                _mm_unpackhi_epi64(t0, t1),
                                _mm_unpacklo_epi64(t2, t3),
                                _mm_unpackhi_epi64(t2, t3),
                            ];
                            std::array::from_fn(|i| r[i])
                        } else {
                            let r = [
                                _mm_unpacklo_epi32(v[0], v[1]),
                                _mm_unpackhi_epi32(v[0], v[1]),
                            ];
                            std::array::from_fn(|i| r[i % 2])
                        };
                        let (sv, bv) = (_mm_set1_ps(sig[j]), _mm_set1_ps(bias[j]));
                        let o = out.add(j * stride + off);
                        for i in 0..CPB {
                            let f = _mm_add_ps(_mm_mul_ps(sv, _mm_cvtepi32_ps(rows[i])), bv);
                            _mm_storeu_ps(o.add(4 * i), f);
                        }
                    }
                }
            }

            /// Value sums of `quads` groups of four rows (`rows` at `rb`
            /// bytes per row) plus an optional padded `tail` quad, for chunk
            /// `h` (row bytes `16h .. 16h + 16`), flushed into `facc`.
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn values<const CPB: usize, const NG: usize>(
                rows: *const u8,
                rb: usize,
                quads: usize,
                tail: Option<&[u8]>,
                h: usize,
                a8: &[u32],
                gpt: usize,
                grp: usize,
                tau: &[f32],
                facc: &mut [f32],
                d: usize,
            ) {
                // SAFETY: `rows` holds `4 * quads` rows of `rb` bytes, `tail`
                // four, `16h + 16 <= rb`; `a8`, `tau` and `facc` are laid out
                // as `crate::int8` documents for `NG` heads (caller).
                unsafe {
                    let bits = 8 / CPB;
                    let mask = _mm256_set1_epi8(((1u32 << bits) - 1) as i8);
                    // Channel group of lane `L` of vector `z`.
                    let grp_of = |z: usize, l: usize| group_of(h, z, l, CPB, grp);
                    let mut acc = [[[_mm256_setzero_si256(); CPB]; 2]; NG];
                    let nq = TB / 4;
                    let nall = quads + tail.is_some() as usize;
                    for q in 0..nall {
                        let base = match tail {
                            Some(t) if q == quads => t.as_ptr(),
                            _ => rows.add(4 * q * rb),
                        };
                        let r0 = base.add(16 * h);
                        let a =
                            _mm256_loadu2_m128i(r0.add(rb) as *const __m128i, r0 as *const __m128i);
                        let b = _mm256_loadu2_m128i(
                            r0.add(3 * rb) as *const __m128i,
                            r0.add(2 * rb) as *const __m128i,
                        );
                        let x = _mm256_unpacklo_epi8(a, b);
                        let y = _mm256_unpackhi_epi8(a, b);
                        let x2 = _mm256_permute2x128_si256::<0x20>(x, y);
                        let y2 = _mm256_permute2x128_si256::<0x31>(x, y);
                        let zs = [_mm256_unpacklo_epi8(x2, y2), _mm256_unpackhi_epi8(x2, y2)];
                        for j in 0..NG {
                            let aq = a8.as_ptr().add(j * gpt * nq + q);
                            for z in 0..2 {
                                let av = _mm256_set_m128i(
                                    _mm_set1_epi32(*aq.add(grp_of(z, 1) * nq) as i32),
                                    _mm_set1_epi32(*aq.add(grp_of(z, 0) * nq) as i32),
                                );
                                for s in 0..CPB {
                                    let codes = _mm256_and_si256(
                                        _mm256_srl_epi16(
                                            zs[z],
                                            _mm_cvtsi32_si128((bits * s) as i32),
                                        ),
                                        mask,
                                    );
                                    acc[j][z][s] = dp(acc[j][z][s], av, codes);
                                }
                            }
                        }
                    }
                    for j in 0..NG {
                        let tj = &tau[j * gpt..(j + 1) * gpt];
                        for z in 0..2 {
                            let tv = _mm256_setr_ps(
                                tj[grp_of(z, 0)],
                                tj[grp_of(z, 0)],
                                tj[grp_of(z, 0)],
                                tj[grp_of(z, 0)],
                                tj[grp_of(z, 1)],
                                tj[grp_of(z, 1)],
                                tj[grp_of(z, 1)],
                                tj[grp_of(z, 1)],
                            );
                            for s in 0..CPB {
                                let o = facc.as_mut_ptr().add(j * d + ((h * 2 + z) * CPB + s) * 8);
                                let f = _mm256_cvtepi32_ps(acc[j][z][s]);
                                _mm256_storeu_ps(o, _mm256_fmadd_ps(tv, f, _mm256_loadu_ps(o)));
                            }
                        }
                    }
                }
            }
        }
    };
}

kernels!(avx2, "avx2,fma", |acc, a, b| _mm256_add_epi32(
    acc,
    _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
));
kernels!(avxvnni, "avx2,fma,avxvnni", |acc, a, b| {
    _mm256_dpbusd_avx_epi32(acc, a, b)
});
kernels!(avx512vnni, "avx2,fma,avx512vnni,avx512vl", |acc, a, b| {
    _mm256_dpbusd_epi32(acc, a, b)
});

/// Runs `$f::<CPB, NG>` of the kernel set of `$isa` for `$bits` and `$g`
/// (evaluates to false for a combination without a kernel).
macro_rules! dispatch {
    ($isa:expr, $bits:expr, $g:expr, $f:ident, ($($arg:expr),*)) => {{
        macro_rules! ng {
            ($m:ident, $cpb:literal) => {
                match $g {
                    1 => { $m::$f::<$cpb, 1>($($arg),*); true }
                    2 => { $m::$f::<$cpb, 2>($($arg),*); true }
                    3 => { $m::$f::<$cpb, 3>($($arg),*); true }
                    4 => { $m::$f::<$cpb, 4>($($arg),*); true }
                    6 => { $m::$f::<$cpb, 6>($($arg),*); true }
                    8 => { $m::$f::<$cpb, 8>($($arg),*); true }
                    _ => false,
                }
            };
        }
        macro_rules! cpb {
            ($m:ident) => {
                match $bits {
                    2 => ng!($m, 4),
                    4 => ng!($m, 2),
                    _ => false,
                }
            };
        }
        match $isa {
            Isa::Avx2 => cpb!(avx2),
            Isa::AvxVnni => cpb!(avxvnni),
            // Shapes the 512-bit kernels do not take run the 256-bit ones.
            Isa::Avx512Vnni | Isa::Avx512 => cpb!(avx512vnni),
            Isa::Portable => false,
        }
    }};
}

fn supported_g(g: usize) -> bool {
    matches!(g, 1 | 2 | 3 | 4 | 6 | 8)
}

/// True when the x86 key kernels of `isa` handle this store and `g`.
pub(crate) fn keys_ok(isa: Isa, st: &MinMaxStore, g: usize) -> bool {
    isa != Isa::Portable && supported_g(g) && st.d.is_multiple_of(8)
}

/// One head's query bytes for one key group, as the key kernels read them:
/// `round(qi * sc)` (see `crate::int8`), for channels `8m .. 8m + 8` the
/// bytes of channels `8m .. 8m + 4` four times, then those of `8m + 4 .. 8m +
/// 8` four times; the same numbers as the portable loops.
pub(crate) fn query_group(qi: &[f32], sc: &[f32], qx: &mut [i32]) {
    let d = qi.len();
    assert!(d.is_multiple_of(8) && d <= crate::store::MAX_D);
    assert!(sc.len() == d && qx.len() == d);
    // SAFETY: the key kernels run only where AVX2 and FMA were detected
    // (`keys_ok`); the lengths are asserted above.
    unsafe { query_group_avx2(qi, sc, qx) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn query_group_avx2(qi: &[f32], sc: &[f32], qx: &mut [i32]) {
    // SAFETY: as `query_group`.
    unsafe {
        for m in 0..qi.len() / 8 {
            // Round half to even (the default MXCSR mode), as the portable
            // loop; |x| <= 127 so the saturating packs change nothing.
            let x = _mm256_cvtps_epi32(_mm256_mul_ps(
                _mm256_loadu_ps(qi.as_ptr().add(8 * m)),
                _mm256_loadu_ps(sc.as_ptr().add(8 * m)),
            ));
            let w = _mm256_packs_epi32(x, x);
            let b = _mm256_packs_epi16(w, w);
            _mm256_storeu_si256(qx.as_mut_ptr().add(8 * m) as *mut __m256i, b);
        }
    }
}

/// Scores of one key block with the kernels of `isa` (only when [`keys_ok`]).
///
/// # Safety
/// `out` must be valid for writes at `j * stride + off + l` for `j <
/// sig.len()` and `l < 32 / bits`, and no other thread may touch those.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn key_block(
    isa: Isa,
    words: &[u32],
    bits: u32,
    qx: &[i32],
    sig: &[f32],
    bias: &[f32],
    out: *mut f32,
    stride: usize,
    off: usize,
) {
    let g = sig.len();
    assert!(words.len().is_multiple_of(8) && qx.len() == g * words.len() && bias.len() == g);
    // SAFETY: `isa` was detected on this CPU (`Isa::available`); the
    // lengths are as the kernels require (asserted above), `out` as the
    // caller guarantees.
    let ran = unsafe { dispatch!(isa, bits, g, keys, (words, qx, sig, bias, out, stride, off)) };
    debug_assert!(ran);
}

/// Channel group of lane `l` of transposed vector `z` in row chunk `h`.
#[inline(always)]
fn group_of(h: usize, z: usize, l: usize, cpb: usize, grp: usize) -> usize {
    ((16 * h + 4 * z + 8 * l) * cpb) / grp
}

/// Channel of position `pos` (within one head's `d`) of the kernels'
/// permuted accumulator layout `((h * 2 + z) * cpb + s) * 8 + 4 l + e`.
fn channel_of(pos: usize, cpb: usize) -> usize {
    let (lane, rest) = (pos % 8, pos / 8);
    let (s, hz) = (rest % cpb, rest / cpb);
    let (z, h) = (hz % 2, hz / 2);
    let (l, e) = (lane / 4, lane % 4);
    (16 * h + 4 * z + 8 * l + e) * cpb + s
}

/// True when the x86 value kernels of `isa` handle this store and `g`
/// (rows a whole number of 16-byte chunks).
pub(crate) fn values_ok(isa: Isa, st: &MinMaxStore, g: usize) -> bool {
    isa != Isa::Portable && supported_g(g) && (st.d * st.q.bits as usize / 8).is_multiple_of(16)
}

/// Value sums of tokens `t0 .. t0 + nb` (one block) flushed into `facc` in
/// the permuted layout; only when [`values_ok`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn value_block(
    isa: Isa,
    st: &MinMaxStore,
    t0: usize,
    nb: usize,
    g: usize,
    a8: &[u32],
    tau: &[f32],
    facc: &mut [f32],
) {
    let (d, bits, grp) = (st.d, st.q.bits, st.q.group);
    let rb = d * bits as usize / 8;
    let gpt = d / grp;
    let quads = nb / 4;
    let rows = st.words.as_ptr() as *const u8;
    // SAFETY: the words hold `len * rb` bytes and `t0 + nb <= len`.
    let main = unsafe { rows.add(t0 * rb) };
    // The last partial quad, zero-padded (only the block at a head's end).
    let mut buf;
    let tail = if !nb.is_multiple_of(4) {
        let src_t = t0 + 4 * quads;
        let k = nb % 4;
        // SAFETY: tokens `src_t .. src_t + k` are held.
        let src = unsafe { std::slice::from_raw_parts(rows.add(src_t * rb), k * rb) };
        buf = [0u8; 4 * crate::store::MAX_D];
        buf[..k * rb].copy_from_slice(src);
        Some(&buf[..4 * rb])
    } else {
        None
    };
    for h in 0..rb / 16 {
        // SAFETY: `isa` was detected on this CPU; `main` holds `4 * quads`
        // rows and `tail` four; `rb` is a multiple of 16; `a8`, `tau` and
        // `facc` follow `crate::int8`'s layout for `g` heads.
        let ran = unsafe {
            dispatch!(
                isa,
                bits,
                g,
                values,
                (main, rb, quads, tail, h, a8, gpt, grp, tau, &mut *facc, d)
            )
        };
        debug_assert!(ran);
    }
}

/// Restores channel order in `facc` (`g` heads of `d`).
pub(crate) fn unpermute(st: &MinMaxStore, g: usize, facc: &mut [f32]) {
    let (d, cpb) = (st.d, 8 / st.q.bits as usize);
    let mut tmp = [0.0f32; crate::store::MAX_D];
    for j in 0..g {
        let row = &mut facc[j * d..(j + 1) * d];
        for (pos, &x) in row.iter().enumerate() {
            tmp[channel_of(pos, cpb)] = x;
        }
        row.copy_from_slice(&tmp[..d]);
    }
}

/// [`crate::int8`]'s weight rounding for one whole block of [`TB`] tokens
/// (the same operations: `a = p * s`, `max`, `round(a * (255 / max))`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn round_weights(
    p: &[f32],
    stride: usize,
    sv: &[f32],
    n: usize,
    t0: usize,
    g: usize,
    gpt: usize,
    tau: &mut [f32],
    a8: &mut [u32],
) {
    assert!(
        t0 + TB <= n
            && (g - 1) * stride + t0 + TB <= p.len()
            && gpt * n <= sv.len()
            && tau.len() >= g * gpt
            && a8.len() >= g * gpt * TB / 4
    );
    // SAFETY: AVX2 was detected (the value kernels run only then); the
    // bounds are asserted above.
    unsafe { round_weights_avx2(p, stride, sv, n, t0, g, gpt, tau, a8) }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2")]
unsafe fn round_weights_avx2(
    p: &[f32],
    stride: usize,
    sv: &[f32],
    n: usize,
    t0: usize,
    g: usize,
    gpt: usize,
    tau: &mut [f32],
    a8: &mut [u32],
) {
    // SAFETY: as `round_weights`.
    unsafe {
        // After the two packs, lane 0 holds tokens 0-3, 8-11, 16-19, 24-27 ...;
        // this restores token order of the 32-bit words.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for j in 0..g {
            let pj = p.as_ptr().add(j * stride + t0);
            for gi in 0..gpt {
                let s = sv.as_ptr().add(gi * n + t0);
                let mut a = [_mm256_setzero_ps(); TB / 8];
                let mut m = _mm256_setzero_ps();
                for v in 0..TB / 8 {
                    a[v] = _mm256_mul_ps(
                        _mm256_loadu_ps(pj.add(8 * v)),
                        _mm256_loadu_ps(s.add(8 * v)),
                    );
                    m = _mm256_max_ps(m, a[v]);
                }
                let (step, inv) = crate::int8::steps(hmax(m), 255.0);
                tau[j * gpt + gi] = step;
                let iv = _mm256_set1_ps(inv);
                let c: [__m256i; 4] =
                    std::array::from_fn(|v| _mm256_cvtps_epi32(_mm256_mul_ps(a[v], iv)));
                let w0 = _mm256_packus_epi32(c[0], c[1]);
                let w1 = _mm256_packus_epi32(c[2], c[3]);
                let b = _mm256_packus_epi16(w0, w1);
                let b = _mm256_permutevar8x32_epi32(b, order);
                _mm256_storeu_si256(
                    a8.as_mut_ptr().add((j * gpt + gi) * (TB / 4)) as *mut __m256i,
                    b,
                );
            }
        }
    }
}

/// The largest of 8 non-negative lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn hmax(m: __m256) -> f32 {
    let v = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_max_ss(v, _mm_movehdup_ps(v)))
}
