//! The exact (f32) fused decode loops of [`MinMaxStore`]: per-channel key
//! scores and per-token value sums read the packed codes and per-group
//! scale/min directly (the AVX2 versions are in `x86.rs`).

// Indexed loops over constant-size register arrays unroll into registers.
#![allow(clippy::needless_range_loop)]

use crate::store::{MAX_D, MinMaxStore};
use minikv_core::simd;

thread_local! {
    /// Reused per-thread scratch of the fused kernels (no allocation per token).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl MinMaxStore {
    /// Fast path: per-channel keys with `G % P == 0` (every word block lies in
    /// one group). `NG` query heads share each decoded word; the `NG x P`
    /// accumulators stay in registers, in `B` banks that channels take in turn
    /// (`B` independent FMA chains per accumulator hide the FMA latency), added
    /// in bank order at the end of the block.
    pub(crate) fn scores_channel_fast<const P: usize, const NG: usize, const B: usize>(
        &self,
        q: &[f32],
        out: &mut [f32],
        stride: usize,
    ) {
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx512f",
            target_feature = "f16c",
            target_feature = "fma"
        ))]
        if crate::x86_512::applies(self.q.bits, self.q.group, self.d) {
            return self.scores_channel_512::<P, NG, B>(q, out, stride);
        }
        self.scores_channel_256::<P, NG, B>(q, out, stride)
    }

    /// [`Self::scores_channel_fast`] by the AVX2 loops where the build has
    /// them, else the portable ones (the 512-bit path's reference in tests).
    pub(crate) fn scores_channel_256<const P: usize, const NG: usize, const B: usize>(
        &self,
        q: &[f32],
        out: &mut [f32],
        stride: usize,
    ) {
        let (d, grp, b) = (self.d, self.q.group, self.q.bits as usize);
        let mask = self.mask();
        let shifts: [u32; P] = std::array::from_fn(|j| (b * j) as u32);
        let mut qs = [[0.0f32; MAX_D]; NG];
        let mut sc = [0.0f32; MAX_D];
        let mut mn = [0.0f32; MAX_D];
        let whole = d / B * B;
        for gi in 0..self.len / grp {
            self.scale[0].read(gi * d, &mut sc[..d]);
            self.min[0].read(gi * d, &mut mn[..d]);
            let mut bias = [0.0f32; NG];
            for j in 0..NG {
                let qj = &q[j * d..(j + 1) * d];
                for c in 0..d {
                    qs[j][c] = qj[c] * sc[c];
                }
                bias[j] = simd::dot(qj, &mn[..d]);
            }
            for k in (gi * grp / P)..((gi + 1) * grp / P) {
                let words = &self.words[k * d..(k + 1) * d];
                #[cfg(all(
                    target_arch = "x86_64",
                    target_feature = "avx2",
                    target_feature = "fma"
                ))]
                if P == 8 || P == 16 {
                    let mut sums = [[0.0f32; 16]; NG];
                    // SAFETY: AVX2 and FMA are enabled (cfg); `qs[j]` holds `d`
                    // values, one per word of the block.
                    unsafe {
                        crate::x86::key_block::<P, NG, B>(words, b as u32, &qs, &bias, &mut sums)
                    };
                    for (j, sj) in sums.iter().enumerate() {
                        out[j * stride + k * P..j * stride + (k + 1) * P].copy_from_slice(&sj[..P]);
                    }
                    continue;
                }
                let mut acc = [[[0.0f32; P]; NG]; B];
                let step = |bank: &mut [[f32; P]; NG], c: usize, w: u32| {
                    // Codes are below 2^8: `as i32` first is one vector convert.
                    let codes: [f32; P] =
                        std::array::from_fn(|l| ((w >> shifts[l]) & mask) as i32 as f32);
                    for j in 0..NG {
                        let s = qs[j][c];
                        for l in 0..P {
                            bank[j][l] = simd::fmadd(s, codes[l], bank[j][l]);
                        }
                    }
                };
                for (cb, wb) in words[..whole].chunks_exact(B).enumerate() {
                    for (i, bank) in acc.iter_mut().enumerate() {
                        step(bank, cb * B + i, wb[i]);
                    }
                }
                for (c, &w) in words.iter().enumerate().skip(whole) {
                    step(&mut acc[0], c, w);
                }
                for j in 0..NG {
                    let o = &mut out[j * stride + k * P..j * stride + (k + 1) * P];
                    for (l, o) in o.iter_mut().enumerate() {
                        let mut x = acc[0][j][l];
                        for bank in &acc[1..] {
                            x += bank[j][l];
                        }
                        *o = x + bias[j];
                    }
                }
            }
        }
    }

    /// Fast path: per-token values with `G % P == 0`, `out[j] += sum_t p_jt v_hat_t`.
    /// Per channel group: `a_j[t] = p_jt * scale_t` and `sum_t p_jt * min_t` in
    /// vector passes; then per output word the `NG x P` accumulators stay in
    /// registers while tokens stream by (code extraction + `NG` FMAs per token),
    /// in `B` banks that tokens take in turn, added in bank order at the end.
    pub(crate) fn accumulate_token_fast<const P: usize, const NG: usize, const B: usize>(
        &self,
        p: &[f32],
        stride: usize,
        out: &mut [f32],
    ) {
        #[cfg(all(
            target_arch = "x86_64",
            target_feature = "avx512f",
            target_feature = "f16c",
            target_feature = "fma"
        ))]
        if crate::x86_512::applies(self.q.bits, self.q.group, self.d) {
            return self.accumulate_token_512::<P, NG, B>(p, stride, out);
        }
        self.accumulate_token_256::<P, NG, B>(p, stride, out)
    }

    /// [`Self::accumulate_token_fast`] by the AVX2 loops where the build
    /// has them, else the portable ones (the 512-bit path's reference in
    /// tests).
    pub(crate) fn accumulate_token_256<const P: usize, const NG: usize, const B: usize>(
        &self,
        p: &[f32],
        stride: usize,
        out: &mut [f32],
    ) {
        let (d, grp, b) = (self.d, self.q.group, self.q.bits as usize);
        let n = self.len;
        if n == 0 {
            return; // nothing quantized yet (all tokens still in the residual)
        }
        let mask = self.mask();
        let wpt = d / P;
        let shifts: [u32; P] = std::array::from_fn(|j| (b * j) as u32);
        let whole = n / B * B;
        SCRATCH.with(|cell| {
            let mut buf = cell.borrow_mut();
            if buf.len() < (NG + 1) * n {
                buf.resize((NG + 1) * n, 0.0);
            }
            let (sv, a) = buf.split_at_mut(n);
            for gi in 0..d / grp {
                let mut macc = [0.0f32; NG];
                self.min[gi].read(0, &mut sv[..n]);
                for j in 0..NG {
                    macc[j] = simd::dot(&p[j * stride..j * stride + n], &sv[..n]);
                }
                self.scale[gi].read(0, &mut sv[..n]);
                for j in 0..NG {
                    let pj = &p[j * stride..j * stride + n];
                    for ((a, x), s) in a[j * n..(j + 1) * n].iter_mut().zip(pj).zip(&sv[..n]) {
                        *a = x * s;
                    }
                }
                let a = &a[..NG * n];
                for k in gi * grp / P..(gi + 1) * grp / P {
                    #[cfg(all(
                        target_arch = "x86_64",
                        target_feature = "avx2",
                        target_feature = "fma"
                    ))]
                    if P == 8 || P == 16 {
                        // SAFETY: AVX2 and FMA are enabled (cfg); the words of
                        // tokens 0..n at stride `wpt` from `k`, `a` holds
                        // `NG * n` values and `out` `NG` rows of `d` from
                        // channel `k * P`, P of them each.
                        unsafe {
                            crate::x86::value_column::<P, NG, B>(
                                &self.words[k..],
                                wpt,
                                n,
                                b as u32,
                                a,
                                &macc,
                                &mut out[k * P..],
                                d,
                            )
                        };
                        continue;
                    }
                    let mut acc = [[[0.0f32; P]; NG]; B];
                    let step = |bank: &mut [[f32; P]; NG], t: usize, w: u32| {
                        // Codes are below 2^8: `as i32` first is one vector convert.
                        let codes: [f32; P] =
                            std::array::from_fn(|l| ((w >> shifts[l]) & mask) as i32 as f32);
                        for j in 0..NG {
                            let aj = a[j * n + t];
                            for l in 0..P {
                                bank[j][l] = simd::fmadd(aj, codes[l], bank[j][l]);
                            }
                        }
                    };
                    let words = &self.words[k..];
                    for t0 in (0..whole).step_by(B) {
                        for (i, bank) in acc.iter_mut().enumerate() {
                            step(bank, t0 + i, words[(t0 + i) * wpt]);
                        }
                    }
                    for t in whole..n {
                        step(&mut acc[0], t, words[t * wpt]);
                    }
                    for j in 0..NG {
                        let o = &mut out[j * d + k * P..j * d + (k + 1) * P];
                        for (l, o) in o.iter_mut().enumerate() {
                            let mut x = acc[0][j][l];
                            for bank in &acc[1..] {
                                x += bank[j][l];
                            }
                            *o += x + macc[j];
                        }
                    }
                }
            }
        });
    }
}
