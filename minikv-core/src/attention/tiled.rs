//! FlashAttention-style CPU backend: tiled, online softmax, f32 log-sum-exp, rayon
//! over (head, row block), fully masked causal blocks skipped; `A_cumul` in the
//! same pass, from the exponentials the softmax already took. The block
//! products are [`crate::gemm`]'s, against keys transposed once per call
//! ([`transpose_panels`]).

use super::{AttentionBackend, DecodeArgs, HeadView, PrefillArgs, check_decode, check_prefill};
use crate::gemm::{gemm, transpose_panels};
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
    /// Per head of one split decode call: its block size and first task.
    static HEAD_BLOCKS: RefCell<Vec<(usize, usize)>> = const { RefCell::new(Vec::new()) };
}

/// Rows per task when a decode splits heads over their tokens.
const SPLIT_ROWS: usize = 1024;

/// Runs `f` with a thread-local scratch buffer of at least `n` floats (reused
/// across calls: no allocation per token once warm).
///
/// The buffer is taken out of the thread-local for the call and put back
/// after, so a nested call on the same thread (a store that runs its own
/// rayon tasks lets this thread run another head's task while it waits) gets
/// a buffer of its own instead of a double borrow.
fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut s = SCRATCH.with(|c| std::mem::take(&mut *c.borrow_mut()));
    if s.len() < n {
        s.resize(n, 0.0);
    }
    let r = f(&mut s[..n]);
    SCRATCH.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() < s.len() {
            *c = s;
        }
    });
    r
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

/// One prefill call's shapes and inputs.
struct Prefill<'a> {
    d: usize,
    n: usize,
    t: usize,
    /// Query heads per KV head.
    g: usize,
    br: usize,
    bk: usize,
    scale: f32,
    /// Position of query 0.
    off: usize,
    /// Sliding window (`usize::MAX`: none).
    win: usize,
    q: &'a [f32],
    /// Per KV head, its keys from `k_lo` on in panels of `bk`
    /// ([`transpose_panels`]): the right operand of the scores.
    keys_t: &'a [Vec<f32>],
    /// The first key any row of the call sees, rounded down to a block.
    k_lo: usize,
    values: &'a [&'a [f32]],
}

/// Row segments per head when `A_cumul` is requested.
const CUMUL_SEGMENTS: usize = 8;

/// Floats of kept exponentials per task when `A_cumul` is requested.
const CUMUL_SCRATCH: usize = 1 << 18;

impl Prefill<'_> {
    /// First key position visible to the query at position `pos`.
    fn lo_of(&self, pos: usize) -> usize {
        (pos + 1).saturating_sub(self.win)
    }

    /// Row bounds `0 = b0 < b1 < ... = n` of the `A_cumul` segments: whole row
    /// blocks, cut where the visible keys summed so far pass `k / S` of the total.
    fn segments(&self) -> Vec<usize> {
        let blocks = self.n.div_ceil(self.br);
        let work = |rb: usize| -> usize {
            let last = (self.off + ((rb + 1) * self.br).min(self.n) - 1) as u64;
            (last + 1 - self.lo_of(last as usize) as u64) as usize
        };
        let total: usize = (0..blocks).map(work).sum();
        let segs = CUMUL_SEGMENTS.min(blocks);
        let mut bounds = vec![0];
        let mut done = 0usize;
        for rb in 0..blocks {
            done += work(rb);
            let k = bounds.len();
            if k < segs && done as u128 * segs as u128 >= total as u128 * k as u128 {
                bounds.push(((rb + 1) * self.br).min(self.n));
            }
        }
        if *bounds.last().unwrap() != self.n {
            bounds.push(self.n);
        }
        bounds
    }

    /// Attention output of query head `h`, rows `r0 .. r0 + acc.len() / d`
    /// (online softmax over key blocks). With `col`, also adds
    /// `sum_i exp(s_ij - lse_i)` of these rows to `col[j]`: the exponentials of
    /// every key block are kept with the running maximum they were taken
    /// against, and rescaled by `exp(m - lse)` once the row's `lse` is known.
    fn row_block(&self, h: usize, r0: usize, acc: &mut [f32], col: Option<&mut [f32]>) {
        let (d, t, br, bk) = (self.d, self.t, self.br, self.bk);
        let nr = acc.len() / d;
        debug_assert!(nr <= br);
        let (kt, v) = (&self.keys_t[h / self.g], self.values[h / self.g]);
        let first_pos = self.off + r0;
        let last_pos = first_pos + nr - 1;
        let c_start = self.lo_of(first_pos) / bk * bk;
        let nblocks = (last_pos + 1 - c_start).div_ceil(bk);
        let keep = col.is_some();
        // Scores of one key block, or of all of them when they are kept.
        // (The last block may reach past `last_pos`: its columns are masked.)
        let span = (c_start + nblocks * bk).min(t) - c_start;
        let s_len = if keep { nr * span } else { nr * bk };
        let mb_len = if keep { nr * nblocks } else { 0 };
        with_scratch(nr * d + s_len + mb_len + 2 * nr, |buf| {
            let (qb, rest) = buf.split_at_mut(nr * d);
            let (s_all, rest) = rest.split_at_mut(s_len);
            let (mblk, rest) = rest.split_at_mut(mb_len);
            let (m, l) = rest.split_at_mut(nr);
            for (dst, src) in qb
                .iter_mut()
                .zip(&self.q[(h * self.n + r0) * d..(h * self.n + r0 + nr) * d])
            {
                *dst = src * self.scale;
            }
            m.fill(f32::NEG_INFINITY);
            l.fill(0.0);
            acc.fill(0.0);
            let mut c0 = c_start;
            let mut bi = 0;
            while c0 <= last_pos {
                let nc = bk.min(t - c0);
                let s = if keep {
                    &mut s_all[nr * (c0 - c_start)..nr * (c0 - c_start + nc)]
                } else {
                    &mut s_all[..nr * nc]
                };
                let panel = &kt[(c0 - self.k_lo) * d..];
                gemm(nr, d, nc, qb, (d, 1), panel, (bk, 1), 0.0, s, nc);
                let needs_mask = c0 + nc - 1 > first_pos || self.lo_of(last_pos) > c0;
                for i in 0..nr {
                    let row = &mut s[i * nc..(i + 1) * nc];
                    if needs_mask {
                        let pos = first_pos + i;
                        let vis = (pos + 1).saturating_sub(c0).min(nc);
                        row[vis..].fill(f32::NEG_INFINITY);
                        let below = self.lo_of(pos).saturating_sub(c0).min(nc);
                        row[..below].fill(f32::NEG_INFINITY);
                    }
                    let bm = crate::simd::max(row);
                    let mnew = m[i].max(bm);
                    if mnew == f32::NEG_INFINITY {
                        row.fill(0.0);
                    } else {
                        let alpha = crate::simd::exp_neg(m[i] - mnew);
                        let sum = crate::simd::exp_sub_sum(row, mnew);
                        l[i] = l[i] * alpha + sum;
                        m[i] = mnew;
                        if alpha != 1.0 {
                            acc[i * d..(i + 1) * d].iter_mut().for_each(|x| *x *= alpha);
                        }
                    }
                    if keep {
                        mblk[i * nblocks + bi] = m[i];
                    }
                }
                gemm(nr, nc, d, s, (nc, 1), &v[c0 * d..], (d, 1), 1.0, acc, d);
                c0 += bk;
                bi += 1;
            }
            for i in 0..nr {
                let inv = 1.0 / l[i];
                acc[i * d..(i + 1) * d].iter_mut().for_each(|x| *x *= inv);
            }
            let Some(col) = col else { return };
            for i in 0..nr {
                let lse = m[i] + l[i].ln();
                let mut c0 = c_start;
                for bi in 0..nblocks {
                    let nc = bk.min(t - c0);
                    let w = crate::simd::exp_neg(mblk[i * nblocks + bi] - lse);
                    if w != 0.0 {
                        let base = nr * (c0 - c_start);
                        let p = &s_all[base + i * nc..base + (i + 1) * nc];
                        crate::simd::axpy(w, p, &mut col[c0..c0 + nc]);
                    }
                    c0 += bk;
                }
            }
        })
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
        if n == 0 {
            return Ok(());
        }
        // With `A_cumul` a task keeps `rows x keys` exponentials: fewer rows
        // per task at long contexts bound that to ~1 MiB per thread (8 rows
        // at least). Rows are independent, so outputs do not change.
        let br = match a.cumulative {
            Some(_) => self.block_q.min((CUMUL_SCRATCH / t).max(8)),
            None => self.block_q,
        };
        let (bk, off) = (self.block_k, t - n);
        let win = a.window.unwrap_or(usize::MAX);
        let k_lo = (off + 1).saturating_sub(win) / bk * bk;
        let keys_t: Vec<Vec<f32>> = a
            .keys
            .par_iter()
            .map(|k| transpose_panels(&k[..t * d], d, k_lo, bk))
            .collect();
        let p = Prefill {
            d,
            n,
            t,
            g,
            br,
            bk,
            scale: 1.0 / (d as f32).sqrt(),
            off,
            win,
            q: a.q,
            keys_t: &keys_t,
            k_lo,
            values: a.values,
        };
        let Some(cumul) = a.cumulative else {
            // One task per (head, row block).
            a.out.par_chunks_mut(n * d).enumerate().for_each(|(h, oh)| {
                oh.par_chunks_mut(p.br * d)
                    .enumerate()
                    .for_each(|(rb, acc)| p.row_block(h, rb * p.br, acc, None));
            });
            return Ok(());
        };
        // With `A_cumul`: each head's rows are cut into a fixed number of
        // contiguous segments of about equal causal work (independent of the
        // thread count, so the sums are too). A segment's task walks its row
        // blocks in order and adds their column sums into its own partial row;
        // the partials are then added to `A_cumul` in segment order.
        let bounds = p.segments();
        let segs = bounds.len() - 1;
        let mut partial = vec![0.0f32; a.n_q_heads * segs * t];
        let mut tasks: Vec<(usize, usize, &mut [f32], &mut [f32])> = Vec::new();
        let mut out_rest: &mut [f32] = a.out;
        let mut part_rest: &mut [f32] = &mut partial;
        for h in 0..a.n_q_heads {
            for s in 0..segs {
                let rows = bounds[s + 1] - bounds[s];
                let (o, rest) = out_rest.split_at_mut(rows * d);
                out_rest = rest;
                let (c, rest) = part_rest.split_at_mut(t);
                part_rest = rest;
                tasks.push((h, bounds[s], o, c));
            }
        }
        tasks.into_par_iter().for_each(|(h, r0, out, col)| {
            for (k, acc) in out.chunks_mut(p.br * d).enumerate() {
                p.row_block(h, r0 + k * p.br, acc, Some(col));
            }
        });
        cumul
            .par_chunks_mut(t)
            .zip(partial.par_chunks(segs * t))
            .for_each(|(ch, parts)| {
                for part in parts.chunks(t) {
                    ch.iter_mut().zip(part).for_each(|(c, x)| *c += x);
                }
            });
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
            split_decode(a, g, SPLIT_ROWS);
            return Ok(());
        }
        if let Some(rows) = ranged_rows(&a, g) {
            split_decode(a, g, rows);
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

/// The block size of head `h`'s ranged calls: its quantized stores' common
/// [`QuantStore::split_rows`](crate::QuantStore::split_rows) (`Some(None)`:
/// no quantized store), `None` when a store has no ranged kernels or the
/// two disagree.
fn head_rows(h: &HeadView<'_>, g: usize) -> Option<Option<usize>> {
    let mut rows = None;
    for st in [h.quant_keys, h.quant_values].into_iter().flatten() {
        let r = st.split_rows(g)?;
        if r == 0 || rows.is_some_and(|x| x != r) {
            return None;
        }
        rows = Some(r);
    }
    Some(rows)
}

/// Whether decode can be split flash-decoding style over quantized heads:
/// no probabilities asked for, no head with extra entries, and every
/// quantized store with ranged kernels (the block size may differ between
/// heads). Returns the first head's block size, the one heads without
/// quantized stores use.
fn ranged_rows(a: &DecodeArgs<'_>, g: usize) -> Option<usize> {
    if a.probs.is_some() || a.heads.iter().any(|h| h.extra.is_some()) {
        return None;
    }
    let mut first = None;
    for h in a.heads {
        if let Some(r) = head_rows(h, g)? {
            first.get_or_insert(r);
        }
    }
    first
}

/// Flash-decoding: every head's tokens are cut into blocks (of its stores'
/// block size, `rows` for a head without quantized stores), each (head,
/// block) task computes its block's maximum logit, exp-sum and
/// unnormalized output per query head, and the blocks are combined exactly
/// (`out = Σ e^{m_b - M} o_b / Σ e^{m_b - M} l_b`). Balances 3 KV heads over
/// 2 cores (or any heads over any cores). Quantized tokens (the first
/// `n_quant_*` of a head) go through the stores' ranged kernels, the rest
/// through the full-precision rows; a block of quantized keys only takes
/// its maxima from the key call
/// ([`QuantStore::scores_range_max`](crate::QuantStore::scores_range_max)).
fn split_decode(a: DecodeArgs<'_>, g: usize, rows: usize) {
    let d = a.head_dim;
    let scale = 1.0 / (d as f32).sqrt();
    let part = g * (d + 2);
    let heads = a.heads;
    let q = a.q;
    // Each head's block size and first task, computed once per call (taken
    // out of the thread-local, as `with_scratch` does, so a nested call on
    // this thread gets its own).
    let mut hb = HEAD_BLOCKS.with(|c| std::mem::take(&mut *c.borrow_mut()));
    hb.clear();
    let mut total = 0;
    for h in heads {
        let r = match head_rows(h, g) {
            Some(Some(r)) => r,
            _ => rows,
        };
        hb.push((r, total));
        total += h.len().div_ceil(r).max(1);
    }
    let hb_ref = &hb;
    PARTIALS.with(|pb| {
        let mut pb = pb.borrow_mut();
        let need = total * part;
        if pb.len() < need {
            pb.resize(need, 0.0);
        }
        pb[..need]
            .par_chunks_mut(part)
            .enumerate()
            .for_each(|(task, pt)| {
                // The task's head and block (heads hold their blocks in turn).
                let s = hb_ref.partition_point(|&(_, first)| first <= task) - 1;
                let (r, first) = hb_ref[s];
                let b = task - first;
                let head = &heads[s];
                let (lo, hi) = (b * r, ((b + 1) * r).min(head.len()));
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
                    // Quantized keys of the block, then full-precision ones.
                    let nqk = head.n_quant_keys();
                    let kq = hi.min(nqk).max(lo);
                    // A block of quantized keys only: its maxima come with
                    // the scores.
                    let whole = kq == hi && head.quant_keys.is_some();
                    if let Some(qk) = head.quant_keys.filter(|_| kq > lo) {
                        if whole {
                            qk.scores_range_max(qs, g, sc, len, lo..kq, ms);
                        } else {
                            qk.scores_range(qs, g, sc, len, lo..kq);
                        }
                    }
                    if hi > kq {
                        let fp = &mut sc[kq - lo..];
                        head.fp_keys.scores_rows(qs, g, fp, len, kq - nqk..hi - nqk);
                    }
                    for j in 0..g {
                        let row = &mut sc[j * len..(j + 1) * len];
                        if !whole {
                            ms[j] = crate::simd::max(row);
                        }
                        ls[j] = crate::simd::exp_sub_sum(row, ms[j]);
                    }
                    os.fill(0.0);
                    let nqv = head.n_quant_values();
                    let vq = hi.min(nqv).max(lo);
                    if let Some(qv) = head.quant_values.filter(|_| vq > lo) {
                        qv.accumulate_range(sc, g, len, os, lo..vq);
                    }
                    if hi > vq {
                        let fp = &sc[vq - lo..];
                        head.fp_values
                            .accumulate_rows(fp, g, len, os, vq - nqv..hi - nqv);
                    }
                });
            });
        for (s, out) in a.out.chunks_mut(g * d).enumerate() {
            let first = hb[s].1;
            let end = hb.get(s + 1).map_or(total, |x| x.1);
            let parts = &pb[first * part..end * part];
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
    HEAD_BLOCKS.with(|c| {
        let mut c = c.borrow_mut();
        if c.capacity() < hb.capacity() {
            *c = hb;
        }
    });
}
