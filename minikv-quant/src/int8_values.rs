//! Value accumulation of the integer products (see `crate::int8`).

use super::*;

impl MinMaxStore {
    /// Per-token value accumulation with integer products (see the module
    /// doc). Long heads are cut into segments of [`seg_tokens`] run in
    /// parallel, each with its own accumulators (the integer parts and the
    /// `p . min` sums), added in segment order (the cut is fixed, so the
    /// result does not depend on the thread count).
    pub(crate) fn accumulate_int8(
        &self,
        isa: Isa,
        p: &[f32],
        g: usize,
        stride: usize,
        out: &mut [f32],
    ) {
        self.accumulate_int8_span(isa, p, g, stride, out, 0..self.len);
    }

    /// [`accumulate_int8`](Self::accumulate_int8) of tokens `span` only
    /// (`span.start` a multiple of [`seg_tokens`]), token `t`'s weights at
    /// `p[j * stride + t - span.start]`.
    pub(crate) fn accumulate_int8_span(
        &self,
        isa: Isa,
        p: &[f32],
        g: usize,
        stride: usize,
        out: &mut [f32],
        span: std::ops::Range<usize>,
    ) {
        let (a0, m) = (span.start, span.len());
        if m == 0 {
            return;
        }
        let (d, grp) = (self.d, self.q.group);
        let gpt = d / grp;
        let seg_len = seg_tokens(self.len);
        assert!(a0.is_multiple_of(seg_len) && span.end <= self.len);
        assert!(p.len() >= (g - 1) * stride + m && out.len() >= g * d);
        let nseg = m.div_ceil(seg_len);
        #[cfg(target_arch = "x86_64")]
        let wide = isa == Isa::Avx512 && crate::x86_int8_512::values_ok(self, g);
        #[cfg(not(target_arch = "x86_64"))]
        let wide = false;
        #[cfg(target_arch = "x86_64")]
        let simd = !wide && crate::x86_int8::values_ok(isa, self, g);
        #[cfg(not(target_arch = "x86_64"))]
        let simd = false;
        let mut fb = take(&OUTER);
        // The narrower kernels read the span's scales and minimums widened
        // to f32, `[group][t - a0]`.
        let nsv = if wide { 0 } else { 2 * gpt * m };
        let part = g * (d + gpt);
        let need = nsv + nseg * part;
        if fb.len() < need {
            fb.resize(need, 0.0);
        }
        let (sv, acc) = fb.split_at_mut(nsv);
        for gi in 0..gpt.min(nsv) {
            self.scale[gi].read(a0, &mut sv[gi * m..(gi + 1) * m]);
            self.min[gi].read(a0, &mut sv[(gpt + gi) * m..(gpt + gi + 1) * m]);
        }
        let acc = &mut acc[..nseg * part];
        acc.fill(0.0);
        let sv = &*sv;
        let seg = |s: usize, f: &mut [f32]| {
            let (a, b) = (a0 + s * seg_len, (a0 + (s + 1) * seg_len).min(span.end));
            let (facc, msum) = f.split_at_mut(g * d);
            #[cfg(target_arch = "x86_64")]
            if wide {
                crate::x86_int8_512::values(self, p, g, stride, a, b, a0, facc, msum);
                return;
            }
            self.values_segment(isa, simd, p, g, stride, sv, a, b, a0, facc);
            let (ra, rb) = (a - a0, b - a0);
            for j in 0..g {
                let pj = &p[j * stride + ra..j * stride + rb];
                for gi in 0..gpt {
                    msum[j * gpt + gi] = dot16(pj, &sv[(gpt + gi) * m + ra..(gpt + gi) * m + rb]);
                }
            }
        };
        if nseg == 1 {
            seg(0, acc);
        } else {
            use rayon::prelude::*;
            acc.par_chunks_mut(part)
                .enumerate()
                .for_each(|(s, f)| seg(s, f));
            let (first, rest) = acc.split_at_mut(part);
            for other in rest.chunks(part) {
                for (x, y) in first.iter_mut().zip(other) {
                    *x += y;
                }
            }
        }
        let (facc, msum) = acc[..part].split_at_mut(g * d);
        #[cfg(target_arch = "x86_64")]
        if wide {
            crate::x86_int8_512::add_out(self, g, facc, msum, out);
            give_back(&OUTER, fb);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if simd {
            crate::x86_int8::unpermute(self, g, facc);
        }
        for j in 0..g {
            for c in 0..d {
                out[j * d + c] += facc[j * d + c] + msum[j * gpt + c / grp];
            }
        }
        give_back(&OUTER, fb);
    }

    /// Integer value sums of tokens `a .. b` into `facc` (zeroed, permuted
    /// when `simd`); `sv` holds the scales `[group][t - a0]` of a span of
    /// `sv.len() / (2 groups)` tokens from `a0`, whose weights are at `p[j *
    /// stride + t - a0]`.
    #[allow(clippy::too_many_arguments)]
    fn values_segment(
        &self,
        isa: Isa,
        simd: bool,
        p: &[f32],
        g: usize,
        stride: usize,
        sv: &[f32],
        a: usize,
        b: usize,
        a0: usize,
        facc: &mut [f32],
    ) {
        let gpt = self.d / self.q.group;
        let m = sv.len() / (2 * gpt);
        let nq = TB / 4;
        // At most MAX_D / 8 groups per token (groups hold >= 8 channels).
        let mut tau = [0.0f32; MAX_G * MAX_D / 8];
        let mut ub = take(&INNER);
        if ub.len() < g * nq * gpt {
            ub.resize(g * nq * gpt, 0);
        }
        let a8 = &mut ub[..g * nq * gpt];
        let tau = &mut tau[..g * gpt];
        let mut t0 = a;
        while t0 < b {
            let nb = TB.min(b - t0);
            let tr = t0 - a0;
            #[cfg(target_arch = "x86_64")]
            if simd {
                if nb == TB {
                    crate::x86_int8::round_weights(p, stride, sv, m, tr, g, gpt, tau, a8);
                } else {
                    round_weights(p, stride, sv, m, tr, nb, g, gpt, tau, a8);
                }
                crate::x86_int8::value_block(isa, self, t0, nb, g, a8, tau, facc);
                t0 += nb;
                continue;
            }
            let _ = (isa, simd);
            round_weights(p, stride, sv, m, tr, nb, g, gpt, tau, a8);
            self.value_block_portable(t0, nb, g, a8, tau, facc);
            t0 += nb;
        }
        give_back(&INNER, ub);
    }

    /// Integer sums of one block of tokens, channel order, flushed into `facc`
    /// as `facc = fma(tau, sum, facc)`.
    pub(crate) fn value_block_portable(
        &self,
        t0: usize,
        nb: usize,
        g: usize,
        a8: &[u32],
        tau: &[f32],
        facc: &mut [f32],
    ) {
        let (d, grp, bits) = (self.d, self.q.group, self.q.bits as usize);
        let (p, gpt) = (32 / bits, d / grp);
        let wpt = d / p;
        let mask = (1u32 << bits) - 1;
        let mut isum = [0i32; MAX_D];
        for j in 0..g {
            isum[..d].fill(0);
            for t in 0..nb {
                let row = &self.words[(t0 + t) * wpt..(t0 + t + 1) * wpt];
                let aj = &a8[j * gpt * (TB / 4)..];
                for c in 0..d {
                    let a = ((aj[(c / grp) * (TB / 4) + t / 4] >> (8 * (t % 4))) & 0xff) as i32;
                    let code = ((row[c / p] >> (bits * (c % p))) & mask) as i32;
                    isum[c] += a * code;
                }
            }
            for c in 0..d {
                let f = &mut facc[j * d + c];
                *f = tau[j * gpt + c / grp].mul_add(isum[c] as f32, *f);
            }
        }
    }
}

/// Rounds one block's weights `a = p * scale` to 8 bits per head and channel
/// group: `tau[j][gi]` the step, `a8[(j * gpt + gi) * TB/4 + quad]` four
/// tokens' codes (token `t0 + 4 quad + k` in byte `k`; 0 past the block).
#[allow(clippy::too_many_arguments)]
fn round_weights(
    p: &[f32],
    stride: usize,
    sv: &[f32],
    n: usize,
    t0: usize,
    nb: usize,
    g: usize,
    gpt: usize,
    tau: &mut [f32],
    a8: &mut [u32],
) {
    let nq = TB / 4;
    let mut a = [0.0f32; TB];
    let mut b = [0u8; TB];
    for j in 0..g {
        let pj = &p[j * stride + t0..j * stride + t0 + nb];
        for gi in 0..gpt {
            let s = &sv[gi * n + t0..gi * n + t0 + nb];
            let mut amax = 0.0f32;
            for ((a, x), s) in a.iter_mut().zip(pj).zip(s) {
                *a = x * s;
                amax = amax.max(*a);
            }
            let (step, inv) = steps(amax, 255.0);
            tau[j * gpt + gi] = step;
            for (b, a) in b.iter_mut().zip(&a[..nb]) {
                *b = (a * inv).round_ties_even().clamp(0.0, 255.0) as u8;
            }
            b[nb..].fill(0);
            for q in 0..nq {
                a8[(j * gpt + gi) * nq + q] =
                    u32::from_le_bytes([b[4 * q], b[4 * q + 1], b[4 * q + 2], b[4 * q + 3]]);
            }
        }
    }
}
