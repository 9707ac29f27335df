//! Prefill staging of one layer: the prompt's keys and values in full
//! precision, and the signals components asked for ([`Needs`]): `A_cumul`
//! and the last prompt queries. Freed at the end of prefill.

use crate::attention::{AttentionBackend, KvHistory, PrefillArgs};
use crate::{Error, LayerSignals, ModelSpec, Needs, Result};

/// One layer's prompt, as collected during prefill.
#[derive(Debug, Default)]
pub(crate) struct Staging {
    /// Keys per KV head, `[t][d]`.
    pub k: Vec<Vec<f32>>,
    /// Values per KV head, `[t][d]`.
    pub v: Vec<Vec<f32>>,
    /// `A_cumul` `[Hq][t]` (when needed).
    pub cumul: Vec<f32>,
    /// Last prompt queries, token-major `[w][Hq * d]` (when needed).
    pub window: Vec<f32>,
    /// Running sums of the pre-RoPE queries (when needed).
    pub qstats: Option<QuerySums>,
    /// The layer's output projection `[hidden][Hq * d]` (when needed).
    pub out_proj: Vec<f32>,
    /// Reconstruction scores `[Hq][t0]` (when a pass ran).
    pub recon: Vec<f32>,
    /// The model's RoPE (when needed).
    pub rope: Option<crate::Rope>,
    /// The identity of `k` and `v` as an append-only history for the
    /// backend (given at the first attention; taken, and released by the
    /// owner, when rows are truncated or the staging is freed).
    pub history: Option<KvHistory>,
}

/// A context-reconstruction pass in progress (see [`Staging::pass_scores`]).
#[derive(Debug, Clone)]
pub(crate) struct Pass {
    /// Prompt positions being reconstructed.
    pub context: std::ops::Range<usize>,
    /// Prompt length before the pass (its tokens start here).
    pub t0: usize,
    /// Leading sink tokens the pass's scoring attention also sees.
    pub sink: usize,
}

/// Sums of a layer's pre-RoPE prompt queries per query head, in f64.
#[derive(Debug)]
pub(crate) struct QuerySums {
    n: usize,
    sum: Vec<f64>,
    outer: Vec<f64>,
    rope: crate::Rope,
    scratch: Vec<f64>,
}

impl QuerySums {
    /// Adds the chunk's queries `[n][Hq * d]` at positions `pos0..pos0 + n`
    /// from position `from` on.
    pub fn add(&mut self, spec: &ModelSpec, q: &[f32], n: usize, pos0: usize, from: usize) {
        let (hq, d) = (spec.n_q_heads, spec.head_dim);
        let skip = from.saturating_sub(pos0).min(n);
        let m = n - skip;
        if m == 0 {
            return;
        }
        self.sum.resize(hq * d, 0.0);
        self.outer.resize(hq * d * d, 0.0);
        self.scratch.resize(m * d, 0.0);
        for h in 0..hq {
            for i in 0..m {
                let src = &q[((skip + i) * hq + h) * d..((skip + i) * hq + h + 1) * d];
                for (c, &x) in src.iter().enumerate() {
                    self.scratch[i * d + c] = x as f64;
                    self.sum[h * d + c] += x as f64;
                }
            }
            let x = self.scratch.as_ptr();
            // outer[h] += X^T X, X = scratch [m][d].
            // SAFETY: X is m x d and outer[h] is d x d, both contiguous and
            // in bounds for the strides given; they do not overlap.
            unsafe {
                matrixmultiply::dgemm(
                    d,
                    m,
                    d,
                    1.0,
                    x,
                    1,
                    d as isize,
                    x,
                    d as isize,
                    1,
                    1.0,
                    self.outer[h * d * d..].as_mut_ptr(),
                    d as isize,
                    1,
                );
            }
        }
        self.n += m;
    }

    /// Mean `[Hq][d]` and covariance `[Hq][d][d]` (divided by `n`).
    pub fn finish(&self, spec: &ModelSpec) -> (Vec<f64>, Vec<f64>) {
        let (hq, d) = (spec.n_q_heads, spec.head_dim);
        let n = self.n.max(1) as f64;
        let mean: Vec<f64> = (0..hq * d)
            .map(|i| self.sum.get(i).copied().unwrap_or(0.0) / n)
            .collect();
        let mut cov = vec![0.0f64; hq * d * d];
        if self.n > 0 {
            for h in 0..hq {
                for a in 0..d {
                    for b in 0..d {
                        cov[(h * d + a) * d + b] =
                            self.outer[(h * d + a) * d + b] / n - mean[h * d + a] * mean[h * d + b];
                    }
                }
            }
        }
        (mean, cov)
    }

    fn bytes(&self) -> usize {
        8 * (self.sum.capacity() + self.outer.capacity() + self.scratch.capacity())
            + 8 * self.rope.inv_freq.capacity()
    }
}

impl Staging {
    pub fn new(hkv: usize) -> Self {
        Self {
            k: vec![Vec::new(); hkv],
            v: vec![Vec::new(); hkv],
            ..Default::default()
        }
    }

    /// Stages `n` tokens (`[n][Hkv * d]`).
    pub fn append(&mut self, spec: &ModelSpec, k: &[f32], v: &[f32], n: usize) {
        append_per_head(&mut self.k, &mut self.v, k, v, n, spec.head_dim);
    }

    /// Exact causal attention of the last `n` of `t` staged tokens, collecting
    /// what `needs` asks for.
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &mut self,
        backend: &dyn AttentionBackend,
        spec: &ModelSpec,
        needs: Needs,
        t: usize,
        q: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let (hq, d) = (spec.n_q_heads, spec.head_dim);
        if n > t {
            return Err(Error::shape(
                "queries vs appended tokens",
                format!("<= {t}"),
                n,
            ));
        }
        // Token-major -> head-major.
        let mut qh = vec![0.0f32; hq * n * d];
        crate::attention::to_head_major(q, n, hq, d, &mut qh);
        let mut oh = vec![0.0f32; hq * n * d];
        let mut cumul = Vec::new();
        if needs.cumulative_attention {
            let old = t - n;
            cumul = vec![0.0f32; hq * t];
            if !self.cumul.is_empty() {
                for h in 0..hq {
                    cumul[h * t..h * t + old].copy_from_slice(&self.cumul[h * old..(h + 1) * old]);
                }
            }
        }
        let keys: Vec<&[f32]> = self.k.iter().map(|x| x.as_slice()).collect();
        let values: Vec<&[f32]> = self.v.iter().map(|x| x.as_slice()).collect();
        backend.prefill(PrefillArgs {
            n_q_heads: hq,
            head_dim: d,
            q: &qh,
            n,
            keys: &keys,
            values: &values,
            t,
            out: &mut oh,
            cumulative: needs.cumulative_attention.then_some(&mut cumul[..]),
            window: None,
            history: Some(*self.history.get_or_insert_with(KvHistory::fresh)),
        })?;
        if needs.cumulative_attention {
            self.cumul = cumul;
        }
        crate::attention::to_token_major(&oh, n, hq, d, out);
        if needs.query_window > 0 {
            let row = hq * d;
            self.window.extend_from_slice(&q[..n * row]);
            let keep = needs.query_window.saturating_mul(row);
            if self.window.len() > keep {
                self.window.drain(..self.window.len() - keep);
            }
        }
        Ok(())
    }

    /// Scoring of a reconstruction pass's last `n` of `t` staged tokens
    /// (queries `q`, token-major): per query head and query, the softmax over
    /// the sinks, the reconstructed context and the pass tokens so far
    /// (causal; a plain pass has no sinks and the whole prompt as its
    /// context, so this is the query's ordinary attention); each context
    /// token keeps, per query head, the maximum probability it receives over
    /// the pass's queries (KVzip then takes the maximum over the group,
    /// KVCompose the mean).
    pub fn pass_scores(&mut self, spec: &ModelSpec, pass: &Pass, q: &[f32], n: usize, t: usize) {
        use rayon::prelude::*;
        let (hq, hkv, d) = (spec.n_q_heads, spec.n_kv_heads, spec.head_dim);
        let g = hq / hkv;
        let t0 = pass.t0;
        if self.recon.len() != hq * t0 {
            self.recon = vec![0.0; hq * t0];
        }
        let sink = pass.sink.min(pass.context.start);
        let ctx = pass.context.clone();
        let scale = 1.0 / (d as f32).sqrt();
        let keys = &self.k;
        let per_head: Vec<Vec<f32>> = (0..hq)
            .into_par_iter()
            .map(|h| {
                let k = &keys[h / g];
                let mut best = vec![0.0f32; ctx.len()];
                let mut s = Vec::with_capacity(sink + ctx.len() + n);
                for i in 0..n {
                    let pos = t - n + i;
                    let qi = &q[(i * hq + h) * d..(i * hq + h + 1) * d];
                    s.clear();
                    let idx = (0..sink).chain(ctx.clone()).chain(t0..=pos);
                    s.extend(idx.map(|j| crate::simd::dot(qi, &k[j * d..(j + 1) * d]) * scale));
                    crate::simd::softmax_inplace(&mut s);
                    for (b, &p) in best.iter_mut().zip(&s[sink..sink + ctx.len()]) {
                        *b = b.max(p);
                    }
                }
                best
            })
            .collect();
        for (h, best) in per_head.iter().enumerate() {
            let row = &mut self.recon[h * t0 + ctx.start..h * t0 + ctx.end];
            row.iter_mut().zip(best).for_each(|(r, &b)| *r = r.max(b));
        }
    }

    /// Removes the tokens staged after position `t0` (the end of a pass).
    /// That ends the rows' append-only history: returns its identity, for
    /// the caller to release (the next attention starts a new one).
    #[must_use = "the ended history must be released to the backend"]
    pub fn truncate(&mut self, spec: &ModelSpec, t0: usize) -> Option<KvHistory> {
        let d = spec.head_dim;
        for x in self.k.iter_mut().chain(self.v.iter_mut()) {
            x.truncate(t0 * d);
        }
        self.history.take()
    }

    /// Records an observation from the model (see [`crate::Observation`]).
    pub fn observe(
        &mut self,
        spec: &ModelSpec,
        needs: Needs,
        pos0: usize,
        obs: crate::Observation<'_>,
    ) -> Result<()> {
        let row = spec.n_q_heads * spec.head_dim;
        match obs {
            crate::Observation::PreRopeQueries { q, n, rope } => {
                if needs.rope && self.rope.is_none() {
                    crate::check_len("RoPE frequencies", spec.head_dim / 2, rope.inv_freq.len())?;
                    self.rope = Some(rope.clone());
                }
                let Some(from) = needs.query_stats_from else {
                    return Ok(());
                };
                crate::check_len("pre-RoPE queries", n * row, q.len())?;
                crate::check_len("RoPE frequencies", spec.head_dim / 2, rope.inv_freq.len())?;
                let sums = self.qstats.get_or_insert_with(|| QuerySums {
                    n: 0,
                    sum: Vec::new(),
                    outer: Vec::new(),
                    rope: rope.clone(),
                    scratch: Vec::new(),
                });
                sums.add(spec, q, n, pos0, from);
            }
            crate::Observation::OutputProjection { w, hidden } => {
                if !needs.output_projection {
                    return Ok(());
                }
                crate::check_len("output projection", hidden * row, w.len())?;
                crate::check_finite("output projection", w)?;
                self.out_proj.clear();
                self.out_proj.extend_from_slice(w);
            }
        }
        Ok(())
    }

    /// Staged query rows.
    pub fn staged_queries(&self, spec: &ModelSpec) -> usize {
        self.window.len() / (spec.n_q_heads * spec.head_dim)
    }

    /// The last `w` staged queries, head-major `[Hq][w][d]`.
    pub fn window_head_major(&self, spec: &ModelSpec, w: usize) -> Vec<f32> {
        let (hq, d) = (spec.n_q_heads, spec.head_dim);
        let staged = self.staged_queries(spec);
        let mut wq = vec![0.0f32; hq * w * d];
        for i in 0..w {
            let src = staged - w + i;
            for h in 0..hq {
                wq[(h * w + i) * d..(h * w + i + 1) * d]
                    .copy_from_slice(&self.window[(src * hq + h) * d..(src * hq + h + 1) * d]);
            }
        }
        wq
    }

    /// The last `w` staged queries of query heads `heads`, `[w][heads][d]`.
    pub fn group_queries(
        &self,
        spec: &ModelSpec,
        heads: std::ops::Range<usize>,
        w: usize,
    ) -> Vec<f32> {
        let (hq, d) = (spec.n_q_heads, spec.head_dim);
        let staged = self.staged_queries(spec);
        let mut qs = Vec::with_capacity(w * heads.len() * d);
        for i in staged - w..staged {
            for h in heads.clone() {
                qs.extend_from_slice(&self.window[(i * hq + h) * d..(i * hq + h + 1) * d]);
            }
        }
        qs
    }

    /// The buffers behind a signals view with a query window of `w` rows.
    pub fn views(&self, spec: &ModelSpec, w: usize) -> Views<'_> {
        Views {
            staging: self,
            keys: self.k.iter().map(Vec::as_slice).collect(),
            values: self.v.iter().map(Vec::as_slice).collect(),
            wq: self.window_head_major(spec, w),
            w,
            stats: self.qstats.as_ref().map(|s| s.finish(spec)),
        }
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        4 * (self
            .k
            .iter()
            .chain(&self.v)
            .map(Vec::capacity)
            .sum::<usize>()
            + self.cumul.capacity()
            + self.window.capacity()
            + self.out_proj.capacity()
            + self.recon.capacity())
            + self.qstats.as_ref().map_or(0, QuerySums::bytes)
            + self.rope.as_ref().map_or(0, |r| 8 * r.inv_freq.capacity())
            + std::mem::size_of::<Vec<f32>>() * (self.k.capacity() + self.v.capacity())
    }
}

/// Head-major views of one layer's staging, from which [`LayerSignals`] borrow.
pub(crate) struct Views<'a> {
    staging: &'a Staging,
    keys: Vec<&'a [f32]>,
    values: Vec<&'a [f32]>,
    wq: Vec<f32>,
    w: usize,
    stats: Option<(Vec<f64>, Vec<f64>)>,
}

impl<'a> Views<'a> {
    /// The signals view of layer `layer` with `t` prompt tokens.
    pub fn signals(&'a self, spec: &'a ModelSpec, layer: usize, t: usize) -> LayerSignals<'a> {
        LayerSignals {
            spec,
            layer,
            t,
            keys: &self.keys,
            values: &self.values,
            cumulative: (!self.staging.cumul.is_empty()).then_some(&self.staging.cumul[..]),
            window_queries: (self.w > 0).then_some(&self.wq[..]),
            window: self.w,
            query_stats: match (&self.stats, &self.staging.qstats) {
                (Some((mean, cov)), Some(sums)) => Some(crate::QueryStats {
                    n: sums.n,
                    mean,
                    cov,
                    rope: &sums.rope,
                }),
                _ => None,
            },
            output_projection: (!self.staging.out_proj.is_empty())
                .then_some(&self.staging.out_proj[..]),
            reconstruction: (!self.staging.recon.is_empty()).then_some(&self.staging.recon[..]),
            budget: None,
            rope: self.staging.rope.as_ref(),
        }
    }
}

/// Appends `n` token-major rows `[n][Hkv * d]` of keys and values to per-KV-head
/// buffers `[Hkv][rows][d]`.
pub(crate) fn append_per_head(
    dk: &mut [Vec<f32>],
    dv: &mut [Vec<f32>],
    k: &[f32],
    v: &[f32],
    n: usize,
    d: usize,
) {
    let hkv = dk.len();
    for i in 0..n {
        for h in 0..hkv {
            let src = (i * hkv + h) * d..(i * hkv + h + 1) * d;
            dk[h].extend_from_slice(&k[src.clone()]);
            dv[h].extend_from_slice(&v[src]);
        }
    }
}
