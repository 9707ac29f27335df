//! FlashAttention-style CPU backend: tiled, online softmax, f32 log-sum-exp, rayon
//! over (head, row block), fully masked causal blocks skipped, `A_cumul` in a
//! second pass with `O(T)` extra memory per head.

use super::{AttentionBackend, DecodeArgs, PrefillArgs, check_decode, check_prefill};
use crate::simd::softmax_inplace;
use crate::storage::{CpuStorage, StorageFactory};
use crate::{Error, Result};
use rayon::prelude::*;
use std::cell::RefCell;

/// Tiled CPU attention.
#[derive(Debug, Clone, Copy)]
pub struct TiledBackend {
    /// Query rows per tile.
    pub block_q: usize,
    /// Key columns per tile.
    pub block_k: usize,
}

impl Default for TiledBackend {
    fn default() -> Self {
        Self {
            block_q: 64,
            block_k: 64,
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Split-K partial results of one decode call (on the calling thread).
    static PARTIALS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Rows per task when a decode splits heads over their tokens.
const SPLIT_ROWS: usize = 1024;

/// Runs `f` with a thread-local scratch buffer of at least `n` floats (reused
/// across calls: no allocation per token once warm).
fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < n {
            s.resize(n, 0.0);
        }
        f(&mut s[..n])
    })
}

/// `c = alpha * a(m x k) * b(k x n) + beta * c`, all with explicit strides.
#[allow(clippy::too_many_arguments)]
#[inline]
fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
    beta: f32,
    c: &mut [f32],
    rsc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    debug_assert!(a.len() > (m - 1) * rsa + (k.max(1) - 1) * csa);
    debug_assert!(b.len() > (k.max(1) - 1) * rsb + (n - 1) * csb);
    debug_assert!(c.len() > (m - 1) * rsc + (n - 1));
    // SAFETY: the strides and lengths above keep every access inside the slices.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr(),
            rsc as isize,
            1,
        );
    }
}

impl TiledBackend {
    fn check_blocks(&self) -> Result<()> {
        if self.block_q == 0 || self.block_k == 0 {
            return Err(Error::config(
                "backend.block",
                "block sizes must be positive",
            ));
        }
        Ok(())
    }
}

impl AttentionBackend for TiledBackend {
    fn name(&self) -> &'static str {
        "tiled"
    }

    fn prefill(&self, a: PrefillArgs<'_>) -> Result<()> {
        self.check_blocks()?;
        let (_, g) = check_prefill(&a)?;
        let (d, n, t) = (a.head_dim, a.n, a.t);
        let (br, bk) = (self.block_q, self.block_k);
        let scale = 1.0 / (d as f32).sqrt();
        let off = t - n; // position of query 0
        // Sliding window: row `i` sees keys `lo(i) ..= off + i`.
        let win = a.window.unwrap_or(usize::MAX);
        let lo_of = move |pos: usize| (pos + 1).saturating_sub(win);
        let q = a.q;
        let keys = a.keys;
        let values = a.values;
        // Per-row log-sum-exp: the only O(T) extra state (per head) of pass 1.
        let mut lse = vec![0.0f32; a.n_q_heads * n];
        if n == 0 {
            return Ok(());
        }

        a.out
            .par_chunks_mut(n * d)
            .zip(lse.par_chunks_mut(n))
            .enumerate()
            .for_each(|(h, (oh, lh))| {
                let (k, v) = (keys[h / g], values[h / g]);
                oh.par_chunks_mut(br * d)
                    .zip(lh.par_chunks_mut(br))
                    .enumerate()
                    .for_each(|(rb, (acc, lrow))| {
                        let r0 = rb * br;
                        let nr = lrow.len();
                        with_scratch(nr * d + nr * bk + 2 * nr, |buf| {
                            let (qb, rest) = buf.split_at_mut(nr * d);
                            let (s, rest) = rest.split_at_mut(nr * bk);
                            let (m, l) = rest.split_at_mut(nr);
                            for (dst, src) in qb
                                .iter_mut()
                                .zip(&q[(h * n + r0) * d..(h * n + r0 + nr) * d])
                            {
                                *dst = src * scale;
                            }
                            m.fill(f32::NEG_INFINITY);
                            l.fill(0.0);
                            acc.fill(0.0);
                            let first_pos = off + r0;
                            let last_pos = off + r0 + nr - 1;
                            let mut c0 = lo_of(first_pos) / bk * bk;
                            while c0 <= last_pos {
                                let nc = bk.min(t - c0);
                                let s = &mut s[..nr * nc];
                                gemm(nr, d, nc, qb, (d, 1), &k[c0 * d..], (1, d), 0.0, s, nc);
                                let needs_mask = c0 + nc - 1 > first_pos || lo_of(last_pos) > c0;
                                for i in 0..nr {
                                    let row = &mut s[i * nc..(i + 1) * nc];
                                    if needs_mask {
                                        let pos = first_pos + i;
                                        let vis = (pos + 1).saturating_sub(c0).min(nc);
                                        row[vis..].fill(f32::NEG_INFINITY);
                                        let below = lo_of(pos).saturating_sub(c0).min(nc);
                                        row[..below].fill(f32::NEG_INFINITY);
                                    }
                                    let bm = crate::simd::max(row);
                                    let mnew = m[i].max(bm);
                                    if mnew == f32::NEG_INFINITY {
                                        row.fill(0.0);
                                        continue;
                                    }
                                    let alpha = crate::simd::exp_neg(m[i] - mnew);
                                    let sum = crate::simd::exp_sub_sum(row, mnew);
                                    l[i] = l[i] * alpha + sum;
                                    m[i] = mnew;
                                    if alpha != 1.0 {
                                        acc[i * d..(i + 1) * d]
                                            .iter_mut()
                                            .for_each(|x| *x *= alpha);
                                    }
                                }
                                gemm(nr, nc, d, s, (nc, 1), &v[c0 * d..], (d, 1), 1.0, acc, d);
                                c0 += bk;
                            }
                            for i in 0..nr {
                                let inv = 1.0 / l[i];
                                acc[i * d..(i + 1) * d].iter_mut().for_each(|x| *x *= inv);
                                lrow[i] = m[i] + l[i].ln();
                            }
                        })
                    });
            });

        // Pass 2: A_cumul[h, j] += sum_i exp(s_ij - lse_i), one task per (head, key block).
        if let Some(cumul) = a.cumulative {
            let lse = &lse;
            cumul.par_chunks_mut(t).enumerate().for_each(|(h, ch)| {
                let k = keys[h / g];
                ch.par_chunks_mut(bk).enumerate().for_each(|(kb, col)| {
                    let c0 = kb * bk;
                    let nc = col.len();
                    // First query row that sees key c0; rows past `i_end`
                    // see no key of the block (sliding window).
                    let i_start = c0.saturating_sub(off);
                    let i_end = (c0 + nc - 1).saturating_add(win).saturating_sub(off).min(n);
                    if i_start >= i_end {
                        return;
                    }
                    with_scratch(br * d + br * nc, |buf| {
                        let (qb, s) = buf.split_at_mut(br * d);
                        let mut i0 = i_start;
                        while i0 < i_end {
                            let nr = br.min(i_end - i0);
                            let qb = &mut qb[..nr * d];
                            for (dst, src) in qb
                                .iter_mut()
                                .zip(&q[(h * n + i0) * d..(h * n + i0 + nr) * d])
                            {
                                *dst = src * scale;
                            }
                            let s = &mut s[..nr * nc];
                            gemm(nr, d, nc, qb, (d, 1), &k[c0 * d..], (1, d), 0.0, s, nc);
                            for i in 0..nr {
                                let pos = off + i0 + i;
                                let vis = (pos + 1).saturating_sub(c0).min(nc);
                                let below = lo_of(pos).saturating_sub(c0).min(vis);
                                let li = lse[h * n + i0 + i];
                                let row = &s[i * nc + below..i * nc + vis];
                                for (c, x) in col[below..vis].iter_mut().zip(row) {
                                    *c += crate::simd::exp_neg(x - li);
                                }
                            }
                            i0 += nr;
                        }
                    })
                });
            });
        }
        Ok(())
    }

    fn decode(&self, a: DecodeArgs<'_>) -> Result<()> {
        let g = check_decode(&a)?;
        let nmax = a.heads.iter().map(|h| h.len()).max().unwrap_or(0);
        let plain = a.probs.is_none()
            && a.heads
                .iter()
                .all(|h| h.quant_keys.is_none() && h.quant_values.is_none() && h.extra.is_none());
        if plain && nmax >= 2 * SPLIT_ROWS {
            split_decode(a, g, nmax);
            return Ok(());
        }
        let d = a.head_dim;
        let scale = 1.0 / (d as f32).sqrt();
        let q = a.q;
        let heads = a.heads;
        let run = |s: usize, out: &mut [f32], probs: Option<&mut [Vec<f32>]>| {
            let head = &heads[s];
            let n = head.len();
            let nc = head.n_extra();
            let stride = n + nc;
            with_scratch(g * d + g * stride, |buf| {
                let (qs, sc) = buf.split_at_mut(g * d);
                for (dst, src) in qs.iter_mut().zip(&q[s * g * d..(s + 1) * g * d]) {
                    *dst = src * scale;
                }
                let nqk = head.n_quant_keys();
                if let Some(qk) = head.quant_keys {
                    qk.scores(qs, g, sc, stride);
                }
                head.fp_keys.scores(qs, g, &mut sc[nqk..], stride);
                if let Some(c) = head.extra {
                    c.keys.scores(qs, g, &mut sc[n..], stride);
                    for j in 0..g {
                        let row = &mut sc[j * stride..(j + 1) * stride];
                        let log_g = c.gate.map_or(0.0, |gt| gt.log_gate(&row[..n]));
                        for (x, b) in row[n..].iter_mut().zip(c.bias) {
                            *x = *x + b + log_g;
                        }
                    }
                }
                for j in 0..g {
                    softmax_inplace(&mut sc[j * stride..(j + 1) * stride]);
                }
                out.fill(0.0);
                let nqv = head.n_quant_values();
                if let Some(qv) = head.quant_values {
                    qv.accumulate(sc, g, stride, out);
                }
                head.fp_values.accumulate(&sc[nqv..], g, stride, out);
                if let Some(c) = head.extra {
                    c.values.accumulate(&sc[n..], g, stride, out);
                }
                if let Some(p) = probs {
                    for j in 0..g {
                        p[j].clear();
                        p[j].extend_from_slice(&sc[j * stride..j * stride + n]);
                    }
                }
            })
        };
        match a.probs {
            Some(p) => a
                .out
                .par_chunks_mut(g * d)
                .zip(p.par_chunks_mut(g))
                .enumerate()
                .for_each(|(s, (o, p))| run(s, o, Some(p))),
            None => a
                .out
                .par_chunks_mut(g * d)
                .enumerate()
                .for_each(|(s, o)| run(s, o, None)),
        }
        Ok(())
    }

    fn storage(&self) -> &dyn StorageFactory {
        &CpuStorage
    }
}

/// Flash-decoding over full-precision heads: every head's tokens are cut into
/// blocks of [`SPLIT_ROWS`], each (head, block) task computes its block's
/// maximum logit, exp-sum and unnormalized output per query head, and the
/// blocks are combined exactly (`out = Σ e^{m_b - M} o_b / Σ e^{m_b - M} l_b`).
/// Balances 3 KV heads over 2 cores (or any heads over any cores).
fn split_decode(a: DecodeArgs<'_>, g: usize, nmax: usize) {
    let d = a.head_dim;
    let scale = 1.0 / (d as f32).sqrt();
    let blocks = nmax.div_ceil(SPLIT_ROWS);
    let part = g * (d + 2);
    let heads = a.heads;
    let q = a.q;
    PARTIALS.with(|pb| {
        let mut pb = pb.borrow_mut();
        let need = heads.len() * blocks * part;
        if pb.len() < need {
            pb.resize(need, 0.0);
        }
        pb[..need]
            .par_chunks_mut(part)
            .enumerate()
            .for_each(|(task, pt)| {
                let (s, b) = (task / blocks, task % blocks);
                let head = &heads[s];
                let (lo, hi) = (b * SPLIT_ROWS, ((b + 1) * SPLIT_ROWS).min(head.len()));
                let (ms, rest) = pt.split_at_mut(g);
                let (ls, os) = rest.split_at_mut(g);
                if lo >= hi {
                    ms.fill(f32::NEG_INFINITY);
                    ls.fill(0.0);
                    return;
                }
                let len = hi - lo;
                with_scratch(g * d + g * len, |buf| {
                    let (qs, sc) = buf.split_at_mut(g * d);
                    for (dst, src) in qs.iter_mut().zip(&q[s * g * d..(s + 1) * g * d]) {
                        *dst = src * scale;
                    }
                    head.fp_keys.scores_rows(qs, g, sc, len, lo..hi);
                    for j in 0..g {
                        let row = &mut sc[j * len..(j + 1) * len];
                        let m = crate::simd::max(row);
                        ms[j] = m;
                        ls[j] = crate::simd::exp_sub_sum(row, m);
                    }
                    os.fill(0.0);
                    head.fp_values.accumulate_rows(sc, g, len, os, lo..hi);
                });
            });
        for (s, out) in a.out.chunks_mut(g * d).enumerate() {
            let parts = &pb[s * blocks * part..(s + 1) * blocks * part];
            for j in 0..g {
                let m = parts
                    .chunks_exact(part)
                    .map(|p| p[j])
                    .fold(f32::NEG_INFINITY, f32::max);
                let o = &mut out[j * d..(j + 1) * d];
                o.fill(0.0);
                let mut z = 0.0f32;
                for p in parts.chunks_exact(part) {
                    if p[j] == f32::NEG_INFINITY {
                        continue;
                    }
                    let w = (p[j] - m).exp();
                    z += w * p[g + j];
                    crate::simd::axpy(w, &p[2 * g + j * d..2 * g + (j + 1) * d], o);
                }
                let inv = 1.0 / z;
                o.iter_mut().for_each(|x| *x *= inv);
            }
        }
    });
}
