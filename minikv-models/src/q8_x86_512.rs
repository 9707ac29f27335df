//! Batched 8-bit-activation row dots ([`crate::q8`]) on 512-bit registers
//! with AVX-512 VNNI: two inputs per register, one `vpdpbusd` per pair and
//! unit of 32 weights, for every weight type with an 8-bit dot (`Q4_1`,
//! `Q8_0` and, through `kquant_q8.rs`, `Q5_0`, `Q4_K`, `Q6_K`: each a
//! [`Kind`] that hands out its units).
//!
//! The portable loop keeps 8 lanes per input; lane `l` of unit `b` adds
//! `dw d_x * sum(w[4l..4l+4] * x[4l..4l+4])` (an exact integer sum of four
//! products) to its accumulator. Here a pair of inputs shares one register:
//! their codes are interleaved four bytes at a time (lane `2l` is the first
//! input's lane `l`, lane `2l + 1` the second's) and the weight unit is
//! duplicated the same way, so one `vpdpbusd` forms both inputs' eight
//! integer sums. `vpdpbusd` multiplies unsigned bytes by signed ones, so a
//! kind with signed codes hands them out plus an offset (`Q8_0`: 128,
//! `Q5_0`: 16, `Q6_K`: 32, all as unsigned bytes) and each sum starts at
//! `-offset` times the input codes' sum, formed once per pair and unit for
//! the rows that share it: every sum stays exact (no saturation: at most
//! `4 * 255 * 127` in magnitude). One conversion and one fused multiply-add
//! scale and add the sums, and the scales `dw d_x` of both inputs come from
//! one broadcast pair. Minimum terms (`Q4_1`, `Q4_K`: `m s_x`) run for a
//! row's inputs in one vector product and sum. A batch goes through tiles
//! of rows x pairs ([`dots`]): each row's unit is unpacked once for the
//! tile's pairs and each pair's block loaded once for its rows, and a tile
//! of four accumulators or more sums their lanes all at once
//! ([`crate::lanes_x86_512::pair_sums`]). Every result is bitwise that of
//! the portable loop (`matrix::batch_tests` and `kquant_q8.rs`'s tests
//! against the single-input product, itself checked against the portable
//! loop there and in `q8.rs`'s tests).
//!
//! The inputs are laid out once per matrix-vector product ([`Pairs`]), not
//! per row.

use crate::blocks::GgmlType;
use crate::blocks_x86::{PREFETCH, scale_pair};
use crate::kquant_q8::x86 as kq;
use crate::lanes_x86_512::{AT_ONCE, lanes};
use crate::q8::Q8Vec;
use std::arch::x86_64::*;

/// One unit of 32 weights as these kernels take it (lined up with a block
/// of the quantized input).
#[derive(Clone, Copy)]
pub(crate) struct Unit {
    /// The 32 integer codes plus the kind's `OFFSET`, as unsigned bytes.
    pub(crate) w: __m256i,
    /// The weights' scale for lanes 0-3 (weights 0-15) and 4-7 (16-31).
    pub(crate) dw: [f32; 2],
    /// The minimum's factor `m` (the unit adds `m s_x`; where `MIN`).
    pub(crate) m: f32,
}

/// A weight type these kernels take: how a stored block splits into units
/// of 32 weights ([`Unit`]). The arithmetic per unit is the portable
/// loop's (`q8.rs` for `Q4_1` and `Q8_0`, `kquant_q8.rs` for the k-quants).
pub(crate) trait Kind {
    /// Bytes of a stored block.
    const BYTES: usize;
    /// Units of 32 weights per stored block.
    const UNITS: usize;
    /// What the unsigned bytes of [`Unit::w`] add to the codes (0 for
    /// unsigned codes): the kernels start each integer sum at `-OFFSET`
    /// times the input's (`vpdpbusd` takes unsigned weights), which keeps
    /// every sum exact.
    const OFFSET: u8;
    /// Whether units have a minimum term.
    const MIN: bool;
    /// Whether the two halves of a unit may have different scales.
    const HALVES: bool;
    /// Unit `j` of the block at `blk`.
    ///
    /// # Safety
    /// `blk` points at a whole block; `j < UNITS`.
    unsafe fn unit(blk: *const u8, j: usize) -> Unit;
}

/// `Q4_1`: unsigned codes `q`, scale `d`, minimum factor `m`.
pub(crate) struct Q4_1;
/// `Q8_0`: signed codes (`OFFSET` 128: the sign bit flipped), scale `d`.
pub(crate) struct Q8_0;

impl Kind for Q4_1 {
    const BYTES: usize = 20;
    const UNITS: usize = 1;
    const OFFSET: u8 = 0;
    const MIN: bool = true;
    const HALVES: bool = false;
    #[inline(always)]
    unsafe fn unit(blk: *const u8, _: usize) -> Unit {
        // SAFETY: the caller guarantees a whole block of 20 bytes.
        unsafe {
            let dm = scale_pair(blk);
            let d = _mm_cvtss_f32(dm);
            Unit {
                w: kq::nibble_codes(blk.add(4)),
                dw: [d, d],
                m: _mm_cvtss_f32(_mm_movehdup_ps(dm)),
            }
        }
    }
}

impl Kind for Q8_0 {
    const BYTES: usize = 34;
    const UNITS: usize = 1;
    const OFFSET: u8 = 128;
    const MIN: bool = false;
    const HALVES: bool = false;
    #[inline(always)]
    unsafe fn unit(blk: *const u8, _: usize) -> Unit {
        // SAFETY: the caller guarantees a whole block of 34 bytes.
        unsafe {
            let d = _mm_cvtss_f32(scale_pair(blk));
            let w = _mm256_loadu_si256(blk.add(2) as *const __m256i);
            Unit {
                w: _mm256_xor_si256(w, _mm256_set1_epi8(i8::MIN)),
                dw: [d, d],
                m: 0.0,
            }
        }
    }
}

/// The block of unit `u` of the row at `row`, and the unit's index in it.
#[inline(always)]
pub(crate) fn unit_at<K: Kind>(row: *const u8, u: usize) -> (*const u8, usize) {
    (row.wrapping_add(K::BYTES * (u / K::UNITS)), u % K::UNITS)
}

/// Bytes of a row of `nb` units.
#[inline(always)]
pub(crate) fn row_bytes<K: Kind>(nb: usize) -> usize {
    K::BYTES * nb / K::UNITS
}

/// True when the CPU has what these kernels use: AVX-512F/BW/DQ and VNNI.
#[inline]
pub(crate) fn available() -> bool {
    minikv_core::cpu::avx512()
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512dq")
        && std::is_x86_feature_detected!("avx512vnni")
}

/// Quantized inputs laid out for the pair kernels; reused across calls.
#[derive(Debug, Default)]
pub(crate) struct Pairs {
    /// Pair `p`, block `b`: 64 bytes at `(p nb + b) 64`, the two inputs'
    /// codes interleaved four bytes at a time.
    codes: Vec<i8>,
    /// Pair `p`, block `b`: the two inputs' scales at `(p nb + b) 2`.
    d: Vec<f32>,
    /// Block `b`, input `j`: `d * sum(q)` at `b n2 + j` (`n2` = inputs
    /// rounded up to even).
    s: Vec<f32>,
    /// One input quantized ([`Q8Vec::quantize`]), before it is laid out.
    one: Q8Vec,
    /// Blocks per input.
    nb: usize,
    /// Inputs.
    n: usize,
}

impl Pairs {
    /// Quantizes rows `sel` of `x` (`[.][cols]`, `cols` a multiple of 32)
    /// as [`Q8Vec::quantize`] does and lays them out; an odd last input is
    /// paired with zeros (its result is never handed out).
    pub(crate) fn set(&mut self, x: &[f32], cols: usize, sel: &[usize]) {
        let (n, nb) = (sel.len(), cols / 32);
        let (np, n2) = (n.div_ceil(2), n.div_ceil(2) * 2);
        self.codes.clear();
        self.codes.resize(np * nb * 64, 0);
        self.d.clear();
        self.d.resize(np * nb * 2, 0.0);
        self.s.clear();
        self.s.resize(nb * n2, 0.0);
        for (j, &i) in sel.iter().enumerate() {
            self.one.quantize(&x[i * cols..(i + 1) * cols]);
            let (p, e) = (j / 2, j % 2);
            let v = &self.one;
            for b in 0..nb {
                let dst = &mut self.codes[(p * nb + b) * 64..][..64];
                for (l, q) in v.q[32 * b..32 * b + 32].chunks_exact(4).enumerate() {
                    dst[8 * l + 4 * e..8 * l + 4 * e + 4].copy_from_slice(q);
                }
                self.d[(p * nb + b) * 2 + e] = v.d[b];
                self.s[b * n2 + j] = v.s[b];
            }
        }
        (self.nb, self.n) = (nb, n);
    }
}

/// [`crate::q8::quantize_block`] on 512-bit registers, bitwise equal: the
/// maximum is exact in any order, and the product, the rounding (to
/// nearest, ties to even), the clamp and the sum are those of the portable
/// loop lane by lane. `None` (the caller runs the portable loop) when a value
/// is not finite, whose handling is left to that loop alone.
///
/// # Safety
/// [`available`] returned true; `xb` and `q` hold 32 values each.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn quantize_block(xb: &[f32], q: &mut [i8]) -> Option<(f32, i32)> {
    assert!(xb.len() >= 32 && q.len() >= 32);
    // SAFETY: 32 floats in `xb`, 32 bytes in `q` (asserted).
    unsafe {
        let lo = _mm512_maskz_loadu_ps(0xFFFF, xb.as_ptr());
        let hi = _mm512_maskz_loadu_ps(0xFFFF, xb.as_ptr().add(16));
        let (alo, ahi) = (_mm512_abs_ps(lo), _mm512_abs_ps(hi));
        let inf = _mm512_set1_ps(f32::INFINITY);
        // Ordered comparisons: false for NaN and infinity.
        let finite =
            _mm512_cmp_ps_mask::<_CMP_LT_OQ>(alo, inf) & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(ahi, inf);
        if finite != 0xFFFF {
            return None;
        }
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(alo, ahi));
        let d = amax / 127.0;
        let id = _mm512_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let (lim, neg) = (_mm512_set1_ps(127.0), _mm512_set1_ps(-127.0));
        let code = |v: __m512| {
            const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let r = _mm512_roundscale_ps::<NEAREST>(_mm512_mul_ps(v, id));
            _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, neg), lim))
        };
        let (qlo, qhi) = (code(lo), code(hi));
        _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128(
            q.as_mut_ptr().add(16) as *mut __m128i,
            _mm512_cvtepi32_epi8(qhi),
        );
        Some((d, _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi))))
    }
}

/// Lane `2l` and `2l + 1` of the result: 32-bit word `l` of `w`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,avx2,fma,f16c")]
fn duplicate_words(w: __m256i) -> __m512i {
    let idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    _mm512_permutexvar_epi32(idx, _mm512_castsi256_si512(w))
}

/// Per pair, the two inputs' lane sums in index order (even lanes, then odd).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,avx2,fma,f16c")]
fn pair_sums(acc: __m512) -> [f32; 2] {
    let mut l = [0.0f32; 16];
    // SAFETY: 16 lanes into 16 floats.
    unsafe { _mm512_storeu_ps(l.as_mut_ptr(), acc) };
    let even = (0..8).map(|k| l[2 * k]).sum::<f32>();
    let odd = (0..8).map(|k| l[2 * k + 1]).sum::<f32>();
    [even, odd]
}

/// `R` consecutive rows of kind `K` (`rb` bytes apart) dot inputs
/// `2 p0 .. 2 (p0 + P)` of `x`: `out(r, 2 p0, values)` gets row `r`'s
/// results for those of the inputs that exist, bitwise the portable loop's.
/// Each row's unit is unpacked once for the `P` pairs and each pair's block
/// loaded once for the `R` rows; the `R P` accumulators are as many chains
/// of multiply-adds in flight.
///
/// # Safety
/// [`available`] returned true; `src` holds `R` rows of `x.nb` units of
/// `K`, `rb` bytes apart; pairs `p0 .. p0 + P` exist in `x`.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,avx2,fma,f16c")]
// `acc[r][p]` is taken pair by pair with the rows inside.
#[allow(clippy::needless_range_loop)]
unsafe fn dot_pairs<K: Kind, const R: usize, const P: usize>(
    src: &[u8],
    rb: usize,
    x: &Pairs,
    p0: usize,
    out: &mut impl FnMut(usize, usize, &[f32]),
) {
    const { assert!(P >= 1 && R >= 1 && R * P <= 16) };
    let nb = x.nb;
    let n2 = x.n.div_ceil(2) * 2;
    let live_lanes: __mmask16 = ((1u32 << (2 * P)) - 1) as __mmask16;
    // SAFETY: every pointer stays within unit `b < nb` of the `R` rows and
    // of pairs `p0 .. p0 + P` (the masked load reads those pairs' sums only).
    unsafe {
        let zero = _mm512_setzero_si512();
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        let mut macc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            // The weights as unsigned bytes, duplicated for the pairs.
            let mut w2 = [zero; R];
            let mut dw = [_mm512_setzero_ps(); R];
            // The pairs' block sums, the same for every row.
            let s = match K::MIN {
                true => _mm512_maskz_loadu_ps(live_lanes, x.s.as_ptr().add(b * n2 + 2 * p0)),
                false => _mm512_setzero_ps(),
            };
            for r in 0..R {
                let (blk, j) = unit_at::<K>(src.as_ptr().add(r * rb), b);
                let ahead = src
                    .as_ptr()
                    .wrapping_add(r * rb + row_bytes::<K>(b) + PREFETCH);
                _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                let u = K::unit(blk, j);
                dw[r] = match K::HALVES {
                    true => _mm512_insertf32x8::<1>(
                        _mm512_castps256_ps512(_mm256_set1_ps(u.dw[0])),
                        _mm256_set1_ps(u.dw[1]),
                    ),
                    false => _mm512_set1_ps(u.dw[0]),
                };
                if K::MIN {
                    macc[r] = _mm512_add_ps(macc[r], _mm512_mul_ps(_mm512_set1_ps(u.m), s));
                }
                w2[r] = duplicate_words(u.w);
            }
            for p in 0..P {
                let k = (p0 + p) * nb + b;
                // A masked load, not `_mm512_loadu_si512` (see `blocks_x86_512::load`).
                let xq = _mm512_maskz_loadu_epi8(!0, x.codes.as_ptr().add(64 * k));
                let dx = _mm_castsi128_ps(_mm_loadl_epi64(x.d.as_ptr().add(2 * k) as *const _));
                let dx = _mm512_broadcast_f32x2(dx);
                let init = match K::OFFSET {
                    0 => zero,
                    o => _mm512_sub_epi32(
                        zero,
                        _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(o as i8), xq),
                    ),
                };
                for r in 0..R {
                    let isum = _mm512_dpbusd_epi32(init, w2[r], xq);
                    let dd = _mm512_mul_ps(dw[r], dx);
                    acc[r][p] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(isum), acc[r][p]);
                }
            }
        }
        // Pair `p` of row `r`: its two inputs' sums in lanes `r P + p`.
        let (even, odd) = if R * P >= AT_ONCE {
            let zero = _mm512_setzero_ps();
            let v = std::array::from_fn(|k| if k < R * P { acc[k / P][k % P] } else { zero });
            let (e, o) = crate::lanes_x86_512::pair_sums(v);
            (lanes(e), lanes(o))
        } else {
            let s: [[f32; 2]; 16] = std::array::from_fn(|k| {
                if k < R * P {
                    pair_sums(acc[k / P][k % P])
                } else {
                    [0.0; 2]
                }
            });
            (s.map(|s| s[0]), s.map(|s| s[1]))
        };
        let live = (x.n - 2 * p0).min(2 * P);
        for r in 0..R {
            let m = lanes(macc[r]);
            let mut v = [0.0f32; 16];
            for (j, v) in v[..live].iter_mut().enumerate() {
                let k = r * P + j / 2;
                let s = if j % 2 == 0 { even[k] } else { odd[k] };
                *v = if K::MIN { s + m[j] } else { s };
            }
            out(r, 2 * p0, &v[..live]);
        }
    }
}

/// The `rows` consecutive rows of `w` (of type `ty`: `Q4_1`, `Q8_0`,
/// `Q5_0`, `Q4_K` or `Q6_K`) dot every input of `x`: `out(r, j, values)`
/// gets row `r`'s results for inputs `j ..`, bitwise equal to the portable
/// dot of that row and input alone ([`crate::q8::dot`]). Rows go four at a
/// time against up to two pairs (a batch of 2-4 inputs: one row against one
/// pair alone is a single chain of multiply-adds), else two at a time
/// against up to eight pairs (the start of a pair's integer sums, for an
/// `OFFSET`, is formed once for the two rows); the rows left over one at a
/// time.
///
/// # Safety
/// [`available`] returned true; `w` holds `rows` rows of the inputs' block
/// count of the type.
pub(crate) unsafe fn dots(
    w: &[u8],
    rows: usize,
    ty: GgmlType,
    x: &Pairs,
    out: impl FnMut(usize, usize, &[f32]),
) {
    // SAFETY: as the caller guarantees, for the kind of `ty`.
    unsafe {
        match ty {
            GgmlType::Q4_1 => dots_of::<Q4_1>(w, rows, x, out),
            GgmlType::Q8_0 => dots_of::<Q8_0>(w, rows, x, out),
            GgmlType::Q5_0 => dots_of::<kq::Q5_0>(w, rows, x, out),
            GgmlType::Q4_K => dots_of::<kq::Q4K>(w, rows, x, out),
            GgmlType::Q6_K => dots_of::<kq::Q6K>(w, rows, x, out),
            other => unreachable!("no 8-bit kernel for {other:?}"),
        }
    }
}

/// [`dots`] for the kind `K`.
///
/// # Safety
/// As [`dots`].
unsafe fn dots_of<K: Kind>(
    w: &[u8],
    rows: usize,
    x: &Pairs,
    mut out: impl FnMut(usize, usize, &[f32]),
) {
    let np = x.n.div_ceil(2);
    let rb = row_bytes::<K>(x.nb);
    let g = match np {
        ..=2 => 4,
        _ => 2,
    };
    let mut r = 0;
    while r < rows {
        let (w, o) = (&w[r * rb..], &mut |dr: usize, j: usize, v: &[f32]| {
            out(r + dr, j, v)
        });
        let t = if rows - r >= g { g } else { 1 };
        let mut p = 0;
        while p < np {
            // SAFETY: as the caller guarantees, for rows r .. r + t and the
            // pairs the group takes.
            p += unsafe {
                match (t, np - p) {
                    (4, 2..) => group::<K, 4, 2>(w, rb, x, p, o),
                    (4, _) => group::<K, 4, 1>(w, rb, x, p, o),
                    (2, 8..) => group::<K, 2, 8>(w, rb, x, p, o),
                    (2, 4..) => group::<K, 2, 4>(w, rb, x, p, o),
                    (2, 3) => group::<K, 2, 3>(w, rb, x, p, o),
                    (2, 2) => group::<K, 2, 2>(w, rb, x, p, o),
                    (2, _) => group::<K, 2, 1>(w, rb, x, p, o),
                    (_, 8..) => group::<K, 1, 8>(w, rb, x, p, o),
                    (_, 4..) => group::<K, 1, 4>(w, rb, x, p, o),
                    (_, 2..) => group::<K, 1, 2>(w, rb, x, p, o),
                    (_, _) => group::<K, 1, 1>(w, rb, x, p, o),
                }
            };
        }
        r += t;
    }
}

/// Rows `0 .. R` against pairs `p .. p + P`; returns `P`.
///
/// # Safety
/// As [`dots`], for those rows and pairs.
unsafe fn group<K: Kind, const R: usize, const P: usize>(
    src: &[u8],
    rb: usize,
    x: &Pairs,
    p: usize,
    out: &mut impl FnMut(usize, usize, &[f32]),
) -> usize {
    // SAFETY: as the caller guarantees.
    unsafe { dot_pairs::<K, R, P>(src, rb, x, p, out) };
    P
}

/// `2 P` consecutive rows of kind `K` (`a.d.len()` units each, the first
/// at `src`) dot one quantized input: `out[r]` is bitwise the portable dot
/// of row `r` ([`crate::q8::dot`]). Two rows share a register (lanes 0-7
/// the first row's eight lanes, 8-15 the second's) against the input's
/// block in both halves: one `vpdpbusd` forms both rows' integer sums, one
/// conversion and one fused multiply-add scale and add them; the minimum
/// terms stay one scalar per row, in unit order. A row alone is one chain
/// of multiply-adds; `P` pairs keep `P` chains in flight and prefetch the
/// rows [`ROWS_AHEAD`] further on.
///
/// # Safety
/// [`available`] returned true; `src` holds `2 P` rows of `a.d.len()` units.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_row_pairs<K: Kind, const P: usize>(src: &[u8], a: &Q8Vec, out: &mut [f32]) {
    const { assert!(P >= 1 && P <= 4) };
    let nb = a.d.len();
    let rb = row_bytes::<K>(nb);
    assert!(src.len() >= 2 * P * rb && a.q.len() >= 32 * nb && out.len() >= 2 * P);
    // SAFETY: every pointer stays within unit `b < nb` of the `2 P` rows
    // (asserted) and of the input.
    unsafe {
        let zero = _mm512_setzero_si512();
        // Lanes 0-3, 4-7, 8-11, 12-15 take scales 0, 1, 2, 3.
        let quarters = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        let mut acc = [_mm512_setzero_ps(); P];
        // The rows' minimum terms in lanes 0-1, lanes 2-3 zero (stale ones
        // were subnormal at times: a microcode assist per product).
        let mut macc = [_mm_setzero_ps(); P];
        for b in 0..nb {
            let xq = _mm512_broadcast_i64x4(_mm256_loadu_si256(a.q.as_ptr().add(32 * b).cast()));
            let dx = _mm512_set1_ps(a.d[b]);
            // Each lane's integer sum starts at `-OFFSET` times its codes' sum.
            let init = match K::OFFSET {
                0 => zero,
                o => _mm512_sub_epi32(
                    zero,
                    _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(o as i8), xq),
                ),
            };
            for (p, acc) in acc.iter_mut().enumerate() {
                // No closures here (`array::map` would call them out of line).
                let row0 = src.as_ptr().add(2 * p * rb);
                let row1 = row0.add(rb);
                for k in [row0, row1] {
                    let ahead = k.wrapping_add(ROWS_AHEAD * rb + row_bytes::<K>(b));
                    _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                }
                let ((b0, j), (b1, _)) = (unit_at::<K>(row0, b), unit_at::<K>(row1, b));
                let u = [K::unit(b0, j), K::unit(b1, j)];
                let w = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(u[0].w), u[1].w);
                if K::MIN {
                    let m = _mm_setr_ps(u[0].m, u[1].m, 0.0, 0.0);
                    macc[p] = _mm_add_ps(macc[p], _mm_mul_ps(m, _mm_set1_ps(a.s[b])));
                }
                let isum = _mm512_dpbusd_epi32(init, w, xq);
                let dw = if K::HALVES {
                    let q = _mm_setr_ps(u[0].dw[0], u[0].dw[1], u[1].dw[0], u[1].dw[1]);
                    _mm512_permutexvar_ps(quarters, _mm512_castps128_ps512(q))
                } else {
                    _mm512_insertf32x8::<1>(
                        _mm512_castps256_ps512(_mm256_set1_ps(u[0].dw[0])),
                        _mm256_set1_ps(u[1].dw[0]),
                    )
                };
                let dd = _mm512_mul_ps(dw, dx);
                *acc = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(isum), *acc);
            }
        }
        for (p, &v) in acc.iter().enumerate() {
            let (mut l, mut m) = ([0.0f32; 16], [0.0f32; 4]);
            _mm512_storeu_ps(l.as_mut_ptr(), v);
            _mm_storeu_ps(m.as_mut_ptr(), macc[p]);
            for e in 0..2 {
                let s = l[8 * e..8 * e + 8].iter().sum::<f32>();
                out[2 * p + e] = if K::MIN { s + m[e] } else { s };
            }
        }
    }
}

/// Rows ahead that [`dot_row_pairs`] prefetches (unit `b` of row `r` asks
/// for unit `b` of row `r + ROWS_AHEAD`).
const ROWS_AHEAD: usize = 4;

/// `out[r] = row r . a` for the consecutive rows of `w` (`out.len()` rows
/// of type `ty`, as [`dots`] takes), four rows at a time
/// ([`dot_row_pairs`]), an odd last row through the single-row dot; each
/// result bitwise [`crate::q8::dot`] of its row alone.
///
/// # Safety
/// [`available`] returned true; `w` holds `out.len()` rows of `a.d.len()`
/// units of the type.
pub(crate) unsafe fn matvec(ty: GgmlType, w: &[u8], a: &Q8Vec, out: &mut [f32]) {
    // SAFETY: as the caller guarantees, for the kind of `ty`.
    unsafe {
        match ty {
            GgmlType::Q4_1 => matvec_of::<Q4_1>(ty, w, a, out),
            GgmlType::Q8_0 => matvec_of::<Q8_0>(ty, w, a, out),
            GgmlType::Q5_0 => matvec_of::<kq::Q5_0>(ty, w, a, out),
            GgmlType::Q4_K => matvec_of::<kq::Q4K>(ty, w, a, out),
            GgmlType::Q6_K => matvec_of::<kq::Q6K>(ty, w, a, out),
            other => unreachable!("no 8-bit kernel for {other:?}"),
        }
    }
}

/// [`matvec`] for the kind `K` (of type `ty`).
///
/// # Safety
/// As [`matvec`].
unsafe fn matvec_of<K: Kind>(ty: GgmlType, w: &[u8], a: &Q8Vec, out: &mut [f32]) {
    let rb = row_bytes::<K>(a.d.len());
    assert!(w.len() >= out.len() * rb);
    let mut r = 0;
    while r < out.len() {
        let left = out.len() - r;
        let (w, o) = (&w[r * rb..], &mut out[r..]);
        // SAFETY: `available` returned true (the caller's contract); `w`
        // holds the `left` remaining rows (asserted above).
        r += unsafe {
            match left {
                4.. => {
                    dot_row_pairs::<K, 2>(w, a, o);
                    4
                }
                2.. => {
                    dot_row_pairs::<K, 1>(w, a, o);
                    2
                }
                _ => {
                    o[0] = crate::q8::dot(ty, &w[..rb], a);
                    1
                }
            }
        };
    }
}
