//! 8-bit activations for decode matvecs: llama.cpp's arithmetic, opt-in.
//!
//! By default minikv multiplies the weights' blocks with f32 activations
//! (exact up to f32 rounding). [`Activations::Q8`] instead rounds each block
//! of 32 inputs to 8-bit integers with one f32 scale (`d = max|x| / 127`,
//! `q = round(x / d)`, ties to even; plus `s = d * sum(q)` for the
//! minimums of `Q4_1`), as llama.cpp does before its `Q4_1 x Q8_1` and
//! `Q8_0 x Q8_0` dot products, and computes each block's dot product in
//! integers: `d_w * d_x * sum(w_q * x_q)` (+ `m_w * s_x` for `Q4_1`). On AVX2
//! that is `vpmaddubsw` + `vpmaddwd` on 32 weights at once. It applies to
//! decode and to prefill chunks of at most 32 tokens (short prompts, where
//! it is faster; each sequence's chunk by its own length); longer chunks
//! keep the exact f32 matmul (`matrix_prefill.rs`, `Q8_MOST`). `Q5_0`, `Q4_K`
//! and `Q6_K` weights take the same input (`kquant_q8.rs` has how their
//! blocks line up with it); other weight types keep the exact dot.
//!
//! The rounding costs accuracy: `minikv perplexity --activations q8` reports
//! it (docs/performance.md has the numbers).

use crate::blocks::{GgmlType, h};
use serde::{Deserialize, Serialize};

/// How decode matvecs treat activations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activations {
    /// f32 activations against the weights' blocks (exact up to f32 rounding).
    #[default]
    F32,
    /// 8-bit activations per block of 32 and integer dot products
    /// (llama.cpp's arithmetic) for `Q4_1`, `Q8_0`, `Q5_0`, `Q4_K` and
    /// `Q6_K` weights.
    Q8,
}

impl std::str::FromStr for Activations {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "q8" => Ok(Self::Q8),
            other => Err(format!(
                "unknown activations `{other}` (expected f32 or q8)"
            )),
        }
    }
}

impl Activations {
    /// The name `--activations` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Q8 => "q8",
        }
    }
}

/// One input vector in blocks of 32 8-bit integers.
#[derive(Debug, Clone, Default)]
pub struct Q8Vec {
    /// Codes, `32` per block.
    pub q: Vec<i8>,
    /// Scale per block.
    pub d: Vec<f32>,
    /// `d * sum(q)` per block.
    pub s: Vec<f32>,
}

impl Q8Vec {
    /// Quantizes `x` (a multiple of 32 long) in place of the previous contents.
    pub fn quantize(&mut self, x: &[f32]) {
        let nb = x.len() / 32;
        self.q.resize(nb * 32, 0);
        self.d.resize(nb, 0.0);
        self.s.resize(nb, 0.0);
        let fast = fast_quantizer();
        for (b, (xb, q)) in x
            .chunks_exact(32)
            .zip(self.q.chunks_exact_mut(32))
            .enumerate()
        {
            let (d, sum) = fast
                .and_then(|f| f(xb, q))
                .unwrap_or_else(|| quantize_block(xb, q));
            self.d[b] = d;
            self.s[b] = d * sum as f32;
        }
    }
}

/// This CPU's vectorized [`quantize_block`] (bitwise equal; `None` from it
/// for a block it leaves to the portable loop), when it has one.
type FastBlock = fn(&[f32], &mut [i8]) -> Option<(f32, i32)>;

/// The [`FastBlock`] of this CPU, detected at run time.
fn fast_quantizer() -> Option<FastBlock> {
    #[cfg(x86_kernels)]
    if crate::q8_x86_512::available() {
        // SAFETY: the features were just detected; the kernel asserts that
        // it has 32 values and 32 codes.
        return Some(|xb, q| unsafe { crate::q8_x86_512::quantize_block(xb, q) });
    }
    None
}

/// One block of 32 values to codes `q`: returns the scale `d = max|x| / 127`
/// and the codes' sum. Each code is `x / d` rounded to nearest, ties to
/// even, within `[-127, 127]` (0 where `d` is 0).
pub(crate) fn quantize_block(xb: &[f32], q: &mut [i8]) -> (f32, i32) {
    let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, v) in q.iter_mut().zip(xb) {
        let r = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
        *q = r;
        sum += r as i32;
    }
    (d, sum)
}

/// True for the weight types with an 8-bit dot: `Q4_1`, `Q8_0` (here) and
/// `Q5_0`, `Q4_K`, `Q6_K` (`kquant_q8.rs`).
pub fn applies(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_1 | GgmlType::Q8_0) || crate::kquant_q8::takes(ty)
}

/// A row of `ty` (one [`applies`] to; callers check) dot a quantized input.
pub(crate) fn dot(ty: GgmlType, src: &[u8], a: &Q8Vec) -> f32 {
    match ty {
        GgmlType::Q4_1 => dot_q4_1(src, a),
        GgmlType::Q8_0 => dot_q8_0(src, a),
        _ => crate::kquant_q8::dot_fast(ty, src, a),
    }
}

/// `Q4_1` row dot a quantized input: per block `d_w d_x sum(w_q x_q) + m_w s_x`,
/// the blocks' terms added in order.
pub fn dot_q4_1(src: &[u8], a: &Q8Vec) -> f32 {
    #[cfg(x86_kernels)]
    if src.len() >= a.d.len() * 20 {
        // SAFETY: AVX2/FMA are enabled (cfg); `src` holds `a.d.len()` blocks.
        return unsafe { x86::dot_q4_1(src, a) };
    }
    dot_q4_1_portable(src, a)
}

/// The portable loop of [`dot_q4_1`] (what the AVX2 kernel computes, bitwise).
fn dot_q4_1_portable(src: &[u8], a: &Q8Vec) -> f32 {
    // Eight lanes as the AVX2 kernel keeps them: lane `l` holds weights
    // `4l .. 4l + 4` of every block.
    let mut acc = [0.0f32; 8];
    let mut macc = 0.0f32;
    for (b, (blk, xq)) in src.chunks_exact(20).zip(a.q.chunks_exact(32)).enumerate() {
        let qs = &blk[4..20];
        let w = |j: usize| if j < 16 { qs[j] & 15 } else { qs[j - 16] >> 4 } as i32;
        let dd = h(blk, 0) * a.d[b];
        for (l, acc) in acc.iter_mut().enumerate() {
            let isum: i32 = (4 * l..4 * l + 4).map(|j| w(j) * xq[j] as i32).sum();
            *acc = dd.mul_add(isum as f32, *acc);
        }
        macc += h(blk, 2) * a.s[b];
    }
    acc.iter().sum::<f32>() + macc
}

/// `Q8_0` row dot a quantized input: per block `d_w d_x sum(w_q x_q)`.
pub fn dot_q8_0(src: &[u8], a: &Q8Vec) -> f32 {
    #[cfg(x86_kernels)]
    if src.len() >= a.d.len() * 34 {
        // SAFETY: AVX2/FMA are enabled (cfg); `src` holds `a.d.len()` blocks.
        return unsafe { x86::dot_q8_0(src, a) };
    }
    dot_q8_0_portable(src, a)
}

/// The portable loop of [`dot_q8_0`] (what the AVX2 kernel computes, bitwise).
fn dot_q8_0_portable(src: &[u8], a: &Q8Vec) -> f32 {
    let mut acc = [0.0f32; 8];
    for (b, (blk, xq)) in src.chunks_exact(34).zip(a.q.chunks_exact(32)).enumerate() {
        let dd = h(blk, 0) * a.d[b];
        for (l, acc) in acc.iter_mut().enumerate() {
            let isum: i32 = (4 * l..4 * l + 4)
                .map(|j| blk[2 + j] as i8 as i32 * xq[j] as i32)
                .sum();
            *acc = dd.mul_add(isum as f32, *acc);
        }
    }
    acc.iter().sum::<f32>()
}

#[cfg(x86_kernels)]
mod x86 {
    use super::Q8Vec;
    use crate::blocks_x86::{PREFETCH, lanes_sum, scale_pair};
    use std::arch::x86_64::*;

    /// The block's `[d, m]` (its first two fp16 values).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dm(blk: &[u8]) -> (f32, f32) {
        debug_assert!(blk.len() >= 4);
        // SAFETY: every block holds at least 4 bytes.
        let v = unsafe { scale_pair(blk.as_ptr()) };
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }

    /// The portable loop's arithmetic: per block, 8 lanes of exact integer
    /// sums of 4 products (`vpmaddubsw`, `vpmaddwd`) scaled by `d_w d_x` into
    /// 8 f32 accumulators; the minimums' terms in block order.
    ///
    /// # Safety
    /// AVX2/FMA available; `src` holds `a.d.len()` blocks of 20 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1(src: &[u8], a: &Q8Vec) -> f32 {
        let mask = _mm_set1_epi8(15);
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        let mut macc = 0.0f32;
        for b in 0..a.d.len() {
            let blk = &src[20 * b..20 * b + 20];
            // Weights stream from memory: ask for the bytes ~1 KiB ahead (a
            // prefetch never faults, past the row's end included).
            _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(PREFETCH) as *const i8);
            // SAFETY: 16 code bytes at offset 4 of the block, 32 codes of `a.q`.
            let (qs, xq) = unsafe {
                (
                    _mm_loadu_si128(blk.as_ptr().add(4) as *const __m128i),
                    _mm256_loadu_si256(a.q.as_ptr().add(32 * b) as *const __m256i),
                )
            };
            let lo = _mm_and_si128(qs, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
            let w = _mm256_set_m128i(hi, lo);
            let isum = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), ones);
            let (d, m) = dm(blk);
            let dd = _mm256_set1_ps(d * a.d[b]);
            acc = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(isum), acc);
            macc += m * a.s[b];
        }
        // SAFETY: AVX2 is available (this function's contract).
        unsafe { lanes_sum(&[acc]) + macc }
    }

    /// As [`dot_q4_1`] for `Q8_0` (signed weights: `|w| * sign(w) x`).
    ///
    /// # Safety
    /// AVX2/FMA available; `src` holds `a.d.len()` blocks of 34 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0(src: &[u8], a: &Q8Vec) -> f32 {
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        for b in 0..a.d.len() {
            let blk = &src[34 * b..34 * b + 34];
            _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(PREFETCH) as *const i8);
            // SAFETY: 32 code bytes at offset 2 of the block, 32 codes of `a.q`.
            let (w, xq) = unsafe {
                (
                    _mm256_loadu_si256(blk.as_ptr().add(2) as *const __m256i),
                    _mm256_loadu_si256(a.q.as_ptr().add(32 * b) as *const __m256i),
                )
            };
            let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
            let isum = _mm256_madd_epi16(p, ones);
            let dd = _mm256_set1_ps(dm(blk).0 * a.d[b]);
            acc = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(isum), acc);
        }
        // SAFETY: AVX2 is available (this function's contract).
        unsafe { lanes_sum(&[acc]) }
    }

    /// [`dot_q4_1`] of one row against `N` inputs: each block's codes are
    /// widened once; per input the operations are [`dot_q4_1`]'s, in order
    /// (bitwise equal to separate calls).
    ///
    /// # Safety
    /// As [`dot_q4_1`], for every input (all of `a[0].d.len()` blocks).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1_n<const N: usize>(
        src: &[u8],
        a: [&Q8Vec; N],
        out: &mut [f32; N],
    ) {
        let mask = _mm_set1_epi8(15);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut macc = [0.0f32; N];
        for b in 0..a[0].d.len() {
            let blk = &src[20 * b..20 * b + 20];
            _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(PREFETCH) as *const i8);
            // SAFETY: 16 code bytes at offset 4 of the block.
            let qs = unsafe { _mm_loadu_si128(blk.as_ptr().add(4) as *const __m128i) };
            let lo = _mm_and_si128(qs, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
            let w = _mm256_set_m128i(hi, lo);
            let (d, m) = dm(blk);
            for j in 0..N {
                // SAFETY: 32 codes of block `b` of input `j`.
                let xq =
                    unsafe { _mm256_loadu_si256(a[j].q.as_ptr().add(32 * b) as *const __m256i) };
                let isum = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), ones);
                let dd = _mm256_set1_ps(d * a[j].d[b]);
                acc[j] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(isum), acc[j]);
                macc[j] += m * a[j].s[b];
            }
        }
        for j in 0..N {
            // SAFETY: AVX2 is available (this function's contract).
            out[j] = unsafe { lanes_sum(&[acc[j]]) } + macc[j];
        }
    }

    /// [`dot_q8_0`] of one row against `N` inputs (bitwise equal to separate calls).
    ///
    /// # Safety
    /// As [`dot_q8_0`], for every input.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0_n<const N: usize>(
        src: &[u8],
        a: [&Q8Vec; N],
        out: &mut [f32; N],
    ) {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..a[0].d.len() {
            let blk = &src[34 * b..34 * b + 34];
            _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(PREFETCH) as *const i8);
            // SAFETY: 32 code bytes at offset 2 of the block.
            let w = unsafe { _mm256_loadu_si256(blk.as_ptr().add(2) as *const __m256i) };
            let aw = _mm256_sign_epi8(w, w);
            let d = dm(blk).0;
            for j in 0..N {
                // SAFETY: 32 codes of block `b` of input `j`.
                let xq =
                    unsafe { _mm256_loadu_si256(a[j].q.as_ptr().add(32 * b) as *const __m256i) };
                let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xq, w));
                let isum = _mm256_madd_epi16(p, ones);
                let dd = _mm256_set1_ps(d * a[j].d[b]);
                acc[j] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(isum), acc[j]);
            }
        }
        for j in 0..N {
            // SAFETY: AVX2 is available (this function's contract).
            out[j] = unsafe { lanes_sum(&[acc[j]]) };
        }
    }
}

/// A row of `ty` (one [`applies`] to) dot every input of `a`, into `out`:
/// bitwise equal to [`dot`] per input, with each `Q4_1` / `Q8_0` weight
/// block widened once per group of up to four inputs on AVX2.
pub(crate) fn dot_many(src: &[u8], ty: GgmlType, a: &[&Q8Vec], out: &mut [f32]) {
    #[cfg(x86_kernels)]
    {
        let q4 = ty == GgmlType::Q4_1;
        let bb = if q4 { 20 } else { 34 };
        let nb = a.first().map_or(0, |v| v.d.len());
        let grouped = matches!(ty, GgmlType::Q4_1 | GgmlType::Q8_0);
        if grouped && a.iter().all(|v| v.d.len() == nb) && src.len() >= nb * bb {
            // Groups of four inputs, the last one of what is left.
            //
            // SAFETY (callers): AVX2/FMA enabled (cfg); `src` holds `nb`
            // blocks and every input `nb` blocks.
            unsafe fn group<const N: usize>(src: &[u8], q4: bool, g: &[&Q8Vec], out: &mut [f32]) {
                let (g, mut o) = (std::array::from_fn(|k| g[k]), [0.0; N]);
                // SAFETY: as the caller guarantees.
                unsafe {
                    match q4 {
                        true => x86::dot_q4_1_n::<N>(src, g, &mut o),
                        false => x86::dot_q8_0_n::<N>(src, g, &mut o),
                    }
                }
                out[..N].copy_from_slice(&o);
            }
            for j in (0..a.len()).step_by(4) {
                let (g, o) = (&a[j..], &mut out[j..]);
                // SAFETY: `src` holds `nb` blocks and every input `nb`
                // blocks (checked above).
                unsafe {
                    match a.len() - j {
                        1 => group::<1>(src, q4, g, o),
                        2 => group::<2>(src, q4, g, o),
                        3 => group::<3>(src, q4, g, o),
                        _ => group::<4>(src, q4, g, o),
                    }
                }
            }
            return;
        }
    }
    if crate::kquant_q8::takes(ty) {
        return crate::q8_avx2::dots(ty, src, a, out);
    }
    for (o, v) in out.iter_mut().zip(a) {
        *o = dot(ty, src, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn f16b(x: f32) -> [u8; 2] {
        half::f16::from_f32(x).to_le_bytes()
    }

    /// Quantization per block: max |x| maps to +-127, error <= d / 2, and
    /// `s = d * sum(q)`; an all-zero block has scale 0 and codes 0.
    #[test]
    fn quantize_blocks() {
        let mut x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) / 7.0).collect();
        x[32..].fill(0.0);
        let mut a = Q8Vec::default();
        a.quantize(&x);
        let d = 20.0 / 7.0 / 127.0;
        assert!((a.d[0] - d).abs() < 1e-7);
        assert_eq!(a.q[0], -127);
        for (q, v) in a.q[..32].iter().zip(&x[..32]) {
            assert!((*q as f32 * a.d[0] - v).abs() <= a.d[0] / 2.0 + 1e-6);
        }
        let sum: i32 = a.q[..32].iter().map(|&q| q as i32).sum();
        assert_eq!(a.s[0], a.d[0] * sum as f32);
        assert_eq!((a.d[1], a.s[1]), (0.0, 0.0));
        assert!(a.q[32..].iter().all(|&q| q == 0));
    }

    /// The integer dots equal the same sums written out in f64 from the
    /// blocks' definitions (the only f32 rounding is in the per-block
    /// scale products), on SmolLM2-sized rows.
    #[test]
    fn integer_dots_match_their_definition() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for _ in 0..100 {
            let nb = 18;
            let x: Vec<f32> = (0..32 * nb).map(|_| rng.random_range(-2.0..2.0)).collect();
            let mut a = Q8Vec::default();
            a.quantize(&x);
            let (mut q41, mut q80) = (Vec::new(), Vec::new());
            let (mut want41, mut want80) = (0.0f64, 0.0f64);
            for b in 0..nb {
                let (d, m) = (rng.random_range(0.001..0.05), rng.random_range(-0.5..0.5));
                let (d, m) = (
                    half::f16::from_f32(d).to_f32(),
                    half::f16::from_f32(m).to_f32(),
                );
                q41.extend(f16b(d));
                q41.extend(f16b(m));
                let codes: Vec<u8> = (0..16).map(|_| rng.random()).collect();
                q41.extend(&codes);
                let d8 = half::f16::from_f32(rng.random_range(0.001..0.05)).to_f32();
                q80.extend(f16b(d8));
                let c8: Vec<u8> = (0..32).map(|_| rng.random()).collect();
                q80.extend(&c8);
                let xq = &a.q[32 * b..32 * b + 32];
                let mut i41 = 0i64;
                for j in 0..16 {
                    i41 += (codes[j] & 15) as i64 * xq[j] as i64
                        + (codes[j] >> 4) as i64 * xq[j + 16] as i64;
                }
                want41 += d as f64 * a.d[b] as f64 * i41 as f64 + m as f64 * a.s[b] as f64;
                let i80: i64 = c8
                    .iter()
                    .zip(xq)
                    .map(|(&w, &x)| w as i8 as i64 * x as i64)
                    .sum();
                want80 += d8 as f64 * a.d[b] as f64 * i80 as f64;
            }
            let (g41, g80) = (dot_q4_1(&q41, &a), dot_q8_0(&q80, &a));
            assert!(
                (g41 as f64 - want41).abs() <= 1e-4 * (1.0 + want41.abs()),
                "{g41} vs {want41}"
            );
            assert!(
                (g80 as f64 - want80).abs() <= 1e-4 * (1.0 + want80.abs()),
                "{g80} vs {want80}"
            );
        }
    }

    /// The 512-bit block quantizer gives the portable loop's codes, scale
    /// and sum, bit for bit: random blocks of several magnitudes, exact
    /// ties (max 127, so `x / d = x`: 2.5 -> 2, -3.5 -> -4, 0.5 -> 0), a
    /// zero block, and values one ulp past the clamp; it declines blocks
    /// with an infinity or a NaN.
    #[cfg(x86_kernels)]
    #[test]
    fn x86_512_quantize_equals_portable_bitwise() {
        if !crate::q8_x86_512::available() {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let mut blocks: Vec<Vec<f32>> = (0..2000)
            .map(|i| {
                let scale = [1e-6f32, 0.01, 1.0, 300.0, 1e30][i % 5];
                (0..32)
                    .map(|_| rng.random_range(-1.0..1.0) * scale)
                    .collect()
            })
            .collect();
        let mut ties = vec![127.0f32, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5];
        ties.resize(32, 4.5);
        blocks.push(ties);
        blocks.push(vec![0.0; 32]);
        let mut near = vec![-127.0f32; 32];
        near[3] = 127.0f32.next_up();
        blocks.push(near);
        for xb in &blocks {
            let (mut q1, mut q2) = ([0i8; 32], [0i8; 32]);
            let want = quantize_block(xb, &mut q1);
            // SAFETY: the features were detected; 32 values and codes.
            let got = unsafe { crate::q8_x86_512::quantize_block(xb, &mut q2) }.unwrap();
            assert_eq!(
                (got.0.to_bits(), got.1),
                (want.0.to_bits(), want.1),
                "{xb:?}"
            );
            assert_eq!(q1, q2, "{xb:?}");
        }
        let tie_codes = {
            let mut q = [0i8; 32];
            quantize_block(&blocks[2000], &mut q);
            q
        };
        assert_eq!(tie_codes[..8], [127, 2, -4, 0, 0, 2, 126, -126]);
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut xb = blocks[0].clone();
            xb[17] = bad;
            // SAFETY: as above.
            assert!(unsafe { crate::q8_x86_512::quantize_block(&xb, &mut [0; 32]) }.is_none());
        }
    }

    /// A row against 1 to 11 inputs at once (AVX2 groups of up to four) is
    /// bitwise each input's own dot.
    #[test]
    fn many_inputs_are_bitwise_the_single_dots() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let nb = 18;
        let (q41, q80) = crate::blocks::tests::random_rows(&mut rng, nb);
        for n in 1..=11 {
            let a: Vec<Q8Vec> = (0..n)
                .map(|_| {
                    let x: Vec<f32> = (0..32 * nb).map(|_| rng.random_range(-4.0..4.0)).collect();
                    let mut a = Q8Vec::default();
                    a.quantize(&x);
                    a
                })
                .collect();
            let refs: Vec<&Q8Vec> = a.iter().collect();
            for (ty, row) in [(GgmlType::Q4_1, &q41), (GgmlType::Q8_0, &q80)] {
                let mut out = vec![f32::NAN; n];
                dot_many(row, ty, &refs, &mut out);
                for (j, v) in a.iter().enumerate() {
                    assert_eq!(
                        out[j].to_bits(),
                        dot(ty, row, v).to_bits(),
                        "{ty:?} n={n} input {j}"
                    );
                }
            }
        }
    }

    /// The AVX2 kernels are bitwise equal to the portable loops.
    #[cfg(x86_kernels)]
    #[test]
    fn x86_equals_portable_bitwise() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for nb in [1usize, 3, 18, 48] {
            for _ in 0..100 {
                let x: Vec<f32> = (0..32 * nb).map(|_| rng.random_range(-4.0..4.0)).collect();
                let mut a = Q8Vec::default();
                a.quantize(&x);
                let (q41, q80) = crate::blocks::tests::random_rows(&mut rng, nb);
                // SAFETY: AVX2/FMA enabled (cfg); nb blocks each.
                let (g41, g80) = unsafe { (x86::dot_q4_1(&q41, &a), x86::dot_q8_0(&q80, &a)) };
                assert_eq!(g41.to_bits(), dot_q4_1_portable(&q41, &a).to_bits());
                assert_eq!(g80.to_bits(), dot_q8_0_portable(&q80, &a).to_bits());
            }
        }
    }
}
