//! The concrete cache every config builds: per layer, per storage head, a
//! quantized part, a full-precision residual and (for dynamic policies) positions
//! and scores. Heads hold ragged lengths: per-head budgets really free memory.

use crate::attention::{AttentionBackend, ClusterView, DecodeArgs, HeadView, PrefillArgs};
use crate::cache::{HeadMemory, KvCache, LayerMemory, MemoryReport, Phase};
use crate::config::{CacheConfig, DecodeMode, HeadMode, ResidualMode};
use crate::quant::QuantStore;
use crate::reskv::{Clusters, RatioSelect, ResidualStats};
use crate::scoring::{DynamicRule, GqaReduce, Needs, ScoreInputs, reduce_gqa};
use crate::select::SelectionInput;
use crate::storage::FpStore;
use crate::{
    BudgetRequest, Error, LayerBudget, LayerStatistic, ModelSpec, Result, check_finite, check_len,
};
use std::sync::Arc;

/// One storage head.
#[derive(Debug)]
struct Head {
    qk: Option<Box<dyn QuantStore>>,
    qv: Option<Box<dyn QuantStore>>,
    fk: Box<dyn FpStore>,
    fv: Box<dyn FpStore>,
    /// Positions of the fp rows (decode-time eviction only).
    pos: Vec<u32>,
    /// Scores of the fp rows (decode-time eviction only).
    score: Vec<f32>,
    /// Capacity kept by decode-time eviction.
    cap: usize,
    /// Recent window protected from decode-time eviction.
    recent: usize,
    /// ResKV residual clusters of the evicted tokens: mean keys and values in
    /// fp16 stores, `beta * ln(count)` biases and counts.
    ck: Box<dyn FpStore>,
    cv: Box<dyn FpStore>,
    cbias: Vec<f32>,
    ccount: Vec<u32>,
}

#[derive(Debug, Default)]
struct Layer {
    seen: usize,
    /// Prefill staging per KV head, `[t][d]`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// `A_cumul` `[Hq][seen]`.
    cumul: Vec<f32>,
    /// Last prompt queries, token-major `[w][Hq * d]`.
    window: Vec<f32>,
    heads: Vec<Head>,
    probs: Vec<Vec<f32>>,
    /// Per head: cluster keys then values as f32 for decode (filled once).
    cbuf: Vec<Vec<f32>>,
}

/// The cache built from a [`CacheConfig`].
#[derive(Debug)]
pub struct LayeredCache {
    spec: ModelSpec,
    cfg: CacheConfig,
    backend: Arc<dyn AttentionBackend>,
    needs: Needs,
    stat: Option<LayerStatistic>,
    phase: Phase,
    layers: Vec<Layer>,
    budgets: Vec<LayerBudget>,
    n_store: usize,
    scratch: Vec<f32>,
    /// Prompt queries the scorer sees (the window may hold more for ResKV).
    scorer_window: usize,
    /// ResKV statistics per layer and head (empty without ResKV).
    res_stats: Vec<Vec<ResidualStats>>,
}

impl LayeredCache {
    /// Builds an empty cache. `cfg` is resolved and validated here.
    pub fn new(
        mut cfg: CacheConfig,
        spec: ModelSpec,
        backend: Arc<dyn AttentionBackend>,
    ) -> Result<Self> {
        spec.validate()?;
        cfg.resolve()?;
        cfg.validate(Some(&spec))?;
        let mut needs = cfg.scorer.as_ref().map(|s| s.needs()).unwrap_or_default();
        let scorer_window = needs.query_window;
        if let Some(r) = &cfg.reskv {
            needs.query_window = needs.query_window.max(r.held_out);
        }
        let stat = cfg.policy.as_ref().and_then(|p| p.layer_statistic());
        if stat.is_some() {
            needs.cumulative_attention = true;
        }
        let n_store = match cfg.heads {
            HeadMode::PerKv => spec.n_kv_heads,
            HeadMode::PerQuery => spec.n_q_heads,
        };
        let mut c = Self {
            spec,
            cfg,
            backend,
            needs,
            stat,
            phase: Phase::Prefill,
            layers: Vec::new(),
            budgets: Vec::new(),
            n_store,
            scratch: Vec::new(),
            scorer_window,
            res_stats: Vec::new(),
        };
        c.reset_layers()?;
        Ok(c)
    }

    /// The resolved config.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    fn new_head(&self) -> Result<Head> {
        let st = self.backend.storage();
        let d = self.spec.head_dim;
        let (qk, qv) = match &self.cfg.quant {
            Some(q) => (
                q.keys
                    .as_deref()
                    .map(|z| st.quant_store(z, d))
                    .transpose()?,
                q.values
                    .as_deref()
                    .map(|z| st.quant_store(z, d))
                    .transpose()?,
            ),
            None => (None, None),
        };
        Ok(Head {
            qk,
            qv,
            fk: st.fp_store(d),
            fv: st.fp_store(d),
            pos: Vec::new(),
            score: Vec::new(),
            cap: usize::MAX,
            recent: 0,
            ck: st.fp_store(d),
            cv: st.fp_store(d),
            cbias: Vec::new(),
            ccount: Vec::new(),
        })
    }

    fn reset_layers(&mut self) -> Result<()> {
        let mut layers = Vec::with_capacity(self.spec.n_layers);
        for _ in 0..self.spec.n_layers {
            let heads = (0..self.n_store)
                .map(|_| self.new_head())
                .collect::<Result<Vec<_>>>()?;
            layers.push(Layer {
                k: vec![Vec::new(); self.spec.n_kv_heads],
                v: vec![Vec::new(); self.spec.n_kv_heads],
                heads,
                probs: vec![Vec::new(); self.spec.n_q_heads],
                ..Default::default()
            });
        }
        self.layers = layers;
        self.budgets.clear();
        self.res_stats.clear();
        self.phase = Phase::Prefill;
        Ok(())
    }

    fn kv_of_store(&self, s: usize) -> usize {
        s * self.spec.n_kv_heads / self.n_store
    }

    fn residual(&self) -> (usize, ResidualMode) {
        self.cfg
            .quant
            .as_ref()
            .map_or((usize::MAX, ResidualMode::Minikv), |q| {
                (q.residual, q.residual_mode)
            })
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.spec.n_layers {
            return Err(Error::shape(
                "layer index",
                format!("< {}", self.spec.n_layers),
                layer,
            ));
        }
        Ok(())
    }

    fn prefill_attend(&mut self, layer: usize, q: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        let (hq, d) = (self.spec.n_q_heads, self.spec.head_dim);
        let needs = self.needs;
        let backend = self.backend.clone();
        let l = &mut self.layers[layer];
        let t = l.seen;
        if n > t {
            return Err(Error::shape(
                "queries vs appended tokens",
                format!("<= {t}"),
                n,
            ));
        }
        // Token-major -> head-major.
        let mut qh = vec![0.0f32; hq * n * d];
        for i in 0..n {
            for h in 0..hq {
                qh[(h * n + i) * d..(h * n + i + 1) * d]
                    .copy_from_slice(&q[(i * hq + h) * d..(i * hq + h + 1) * d]);
            }
        }
        let mut oh = vec![0.0f32; hq * n * d];
        let mut cumul = Vec::new();
        if needs.cumulative_attention {
            let old = t - n;
            cumul = vec![0.0f32; hq * t];
            if !l.cumul.is_empty() {
                for h in 0..hq {
                    cumul[h * t..h * t + old].copy_from_slice(&l.cumul[h * old..(h + 1) * old]);
                }
            }
        }
        let keys: Vec<&[f32]> = l.k.iter().map(|x| x.as_slice()).collect();
        let values: Vec<&[f32]> = l.v.iter().map(|x| x.as_slice()).collect();
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
        })?;
        if needs.cumulative_attention {
            l.cumul = cumul;
        }
        for i in 0..n {
            for h in 0..hq {
                out[(i * hq + h) * d..(i * hq + h + 1) * d]
                    .copy_from_slice(&oh[(h * n + i) * d..(h * n + i + 1) * d]);
            }
        }
        if needs.query_window > 0 {
            let row = hq * d;
            l.window.extend_from_slice(&q[..n * row]);
            let keep = needs.query_window * row;
            if l.window.len() > keep {
                l.window.drain(..l.window.len() - keep);
            }
        }
        Ok(())
    }

    fn flush(
        quant: &mut Option<Box<dyn QuantStore>>,
        fp: &mut Box<dyn FpStore>,
        n: usize,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let Some(qs) = quant.as_mut() else {
            return Ok(());
        };
        scratch.clear();
        fp.drain_front(n, scratch);
        qs.append(scratch)
    }

    fn decode_attend(&mut self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<()> {
        let d = self.spec.head_dim;
        let hq = self.spec.n_q_heads;
        let dynamic = self.cfg.decode == DecodeMode::Evict;
        let rule = self.cfg.scorer.as_ref().and_then(|s| s.dynamic_rule());
        let backend = self.backend.clone();
        let (r, mode) = self.residual();
        let gate = self.cfg.reskv.as_ref().and_then(|c| c.gate());
        let l = &mut self.layers[layer];
        let mut probs = std::mem::take(&mut l.probs);
        // Cluster entries are stored in fp16; decode reads an f32 copy made
        // once per head (they never change after prefill).
        l.cbuf.resize_with(l.heads.len(), Vec::new);
        for (h, buf) in l.heads.iter().zip(&mut l.cbuf) {
            let nc = h.ccount.len();
            if buf.len() != 2 * nc * d {
                buf.resize(2 * nc * d, 0.0);
                let (k, v) = buf.split_at_mut(nc * d);
                h.ck.to_f32(k);
                h.cv.to_f32(v);
            }
        }
        {
            let views: Vec<HeadView<'_>> = l
                .heads
                .iter()
                .zip(&l.cbuf)
                .map(|(h, buf)| HeadView {
                    quant_keys: h.qk.as_deref(),
                    quant_values: h.qv.as_deref(),
                    fp_keys: h.fk.as_ref(),
                    fp_values: h.fv.as_ref(),
                    clusters: (!h.ccount.is_empty()).then(|| {
                        let (keys, values) = buf.split_at(buf.len() / 2);
                        ClusterView {
                            keys,
                            values,
                            bias: &h.cbias,
                            gate,
                        }
                    }),
                })
                .collect();
            backend.decode(DecodeArgs {
                q,
                heads: &views,
                head_dim: d,
                out,
                probs: dynamic.then_some(&mut probs[..]),
            })?;
        }
        // KIVI: flush keys after attention when the residual reaches R; slide values.
        if mode == ResidualMode::Kivi && self.cfg.quant.is_some() {
            for h in &mut l.heads {
                if h.fk.len() >= r {
                    let n = h.fk.len();
                    Self::flush(&mut h.qk, &mut h.fk, n, &mut self.scratch)?;
                }
                if h.fv.len() > r {
                    let n = h.fv.len() - r;
                    Self::flush(&mut h.qv, &mut h.fv, n, &mut self.scratch)?;
                }
            }
        }
        if dynamic {
            let rule = rule.expect("validated: evict has a dynamic rule");
            let g = hq / self.n_store;
            let seen = l.seen;
            let sinks = self.cfg.sinks;
            let reduce = match self.cfg.heads {
                HeadMode::PerKv => self.cfg.gqa_reduce,
                HeadMode::PerQuery => GqaReduce::Sum,
            };
            // TOVA averages over all heads of the layer when their token sets align.
            let layer_mean: Option<Vec<f32>> = (rule == DynamicRule::LastQuery
                && probs.iter().all(|p| p.len() == probs[0].len()))
            .then(|| {
                let mut m = vec![0.0f32; probs[0].len()];
                for p in &probs {
                    m.iter_mut().zip(p).for_each(|(a, b)| *a += b / hq as f32);
                }
                m
            });
            for (s, h) in l.heads.iter_mut().enumerate() {
                let n = h.fk.len();
                let group = &probs[s * g..(s + 1) * g];
                for i in 0..n {
                    let p = match reduce {
                        GqaReduce::Max => {
                            group.iter().map(|p| p[i]).fold(f32::NEG_INFINITY, f32::max)
                        }
                        GqaReduce::Sum => group.iter().map(|p| p[i]).sum(),
                        GqaReduce::Mean => group.iter().map(|p| p[i]).sum::<f32>() / g as f32,
                    };
                    match rule {
                        DynamicRule::Accumulate => h.score[i] += p,
                        DynamicRule::LastQuery => {
                            h.score[i] = layer_mean.as_ref().map_or(p, |m| m[i])
                        }
                        DynamicRule::Recency => h.score[i] = h.pos[i] as f32,
                    }
                }
                while h.fk.len() > h.cap {
                    let recent_start = seen.saturating_sub(h.recent);
                    let mut victim: Option<usize> = None;
                    for i in 0..h.fk.len() {
                        let p = h.pos[i] as usize;
                        if p < sinks || p >= recent_start {
                            continue;
                        }
                        victim = match victim {
                            Some(v)
                                if h.score[v] < h.score[i]
                                    || (h.score[v] == h.score[i] && h.pos[v] > h.pos[i]) =>
                            {
                                Some(v)
                            }
                            _ => Some(i),
                        };
                    }
                    let Some(v) = victim else { break };
                    h.fk.swap_remove(v);
                    h.fv.swap_remove(v);
                    h.pos.swap_remove(v);
                    h.score.swap_remove(v);
                }
            }
        }
        l.probs = probs;
        Ok(())
    }

    /// ResKV for one layer (§7): per storage head, demotes the `r` lowest-scored
    /// kept tokens outside sinks and the recent window, clusters every evicted
    /// token, and measures the result on the held-out prompt queries.
    fn residual_clusters(
        &self,
        layer: usize,
        kept: Vec<Vec<u32>>,
        scores: &[f32],
        budget: LayerBudget,
        rc: &crate::reskv::ResKvConfig,
    ) -> (Vec<Vec<u32>>, Vec<Clusters>, Vec<ResidualStats>) {
        use rayon::prelude::*;
        let (hq, d) = (self.spec.n_q_heads, self.spec.head_dim);
        let l = &self.layers[layer];
        let t = l.seen;
        let staged = l.window.len() / (hq * d);
        let w = staged.min(rc.held_out);
        let g = hq / self.n_store;
        let gate = rc.gate();
        let sinks = self.cfg.sinks;
        let recent_start = t.saturating_sub(budget.recent);
        kept.into_par_iter()
            .enumerate()
            .map(|(s, kept)| {
                let kv = s * self.spec.n_kv_heads / self.n_store;
                let rows = crate::reskv::HeadRows {
                    keys: &l.k[kv],
                    values: &l.v[kv],
                    d,
                };
                // Held-out queries of the query heads reading this head, `[w*g][d]`.
                let mut qs = Vec::with_capacity(w * g * d);
                for i in staged - w..staged {
                    for h in s * g..(s + 1) * g {
                        qs.extend_from_slice(&l.window[(i * hq + h) * d..(i * hq + h + 1) * d]);
                    }
                }
                // Kept tokens that may be demoted, lowest score first.
                let mut demotable: Vec<u32> = kept
                    .iter()
                    .copied()
                    .filter(|&p| (p as usize) >= sinks && (p as usize) < recent_start)
                    .collect();
                demotable.sort_by(|&a, &b| {
                    scores[s * t + a as usize]
                        .total_cmp(&scores[s * t + b as usize])
                        .then(b.cmp(&a))
                });
                let b = kept.len();
                let split = |ratio: f64| {
                    let r = ((ratio * b as f64).round() as usize).min(demotable.len());
                    let mut main: Vec<u32> = kept.clone();
                    let gone: std::collections::HashSet<u32> =
                        demotable[..r].iter().copied().collect();
                    main.retain(|p| !gone.contains(p));
                    let mut in_main = vec![false; t];
                    main.iter().for_each(|&p| in_main[p as usize] = true);
                    let evicted: Vec<u32> =
                        (0..t as u32).filter(|&p| !in_main[p as usize]).collect();
                    let c = Clusters::build(rows, &evicted, r, rc.iters, rc.beta);
                    (main, evicted, c)
                };
                // The full-prompt reference outputs, once per head.
                let full = if w > 0 {
                    crate::reskv::full_outputs(&qs, rows, t)
                } else {
                    Vec::new()
                };
                let with_stats = |ratio: f64| {
                    let (main, evicted, c) = split(ratio);
                    let st = if w > 0 {
                        crate::reskv::residual_stats(&qs, &full, rows, &main, &evicted, &c, gate)
                    } else {
                        ResidualStats {
                            evicted: evicted.len(),
                            clusters: c.len(),
                            ..Default::default()
                        }
                    };
                    (main, c, st)
                };
                match rc.select {
                    RatioSelect::Fixed => with_stats(rc.ratio),
                    RatioSelect::Proxy => {
                        let base = with_stats(0.0);
                        let best = rc
                            .candidates
                            .iter()
                            .filter(|&&c| c > 0.0)
                            .map(|&c| with_stats(c))
                            .min_by(|a, b| a.2.output_error.total_cmp(&b.2.output_error));
                        // Keep r = 0 unless the best is `delta` better.
                        match best {
                            Some(b)
                                if b.2.output_error <= (1.0 - rc.delta) * base.2.output_error =>
                            {
                                b
                            }
                            _ => base,
                        }
                    }
                }
            })
            .collect::<Vec<_>>()
            .into_iter()
            .fold(
                (Vec::new(), Vec::new(), Vec::new()),
                |mut acc, (m, c, st)| {
                    acc.0.push(m);
                    acc.1.push(c);
                    acc.2.push(st);
                    acc
                },
            )
    }

    /// Selection + quantization of one layer's prompt.
    fn compress_layer(
        &mut self,
        layer: usize,
        kept: &[Vec<u32>],
        scores: Option<&[f32]>,
        budget: LayerBudget,
        mut clusters: Vec<Clusters>,
    ) -> Result<()> {
        let d = self.spec.head_dim;
        let (r, mode) = self.residual();
        let gran = self.cfg.quant.as_ref().map_or(1, |q| {
            let a = q.keys.as_ref().map_or(1, |z| z.token_granularity());
            let b = q.values.as_ref().map_or(1, |z| z.token_granularity());
            a.max(b)
        });
        let dynamic = self.cfg.decode == DecodeMode::Evict;
        let rule = self.cfg.scorer.as_ref().and_then(|s| s.dynamic_rule());
        let t = self.layers[layer].seen;
        let sinks = self.cfg.sinks;
        for s in 0..self.n_store {
            let kv = self.kv_of_store(s);
            let l = &mut self.layers[layer];
            let (ks, vs) = (&l.k[kv], &l.v[kv]);
            let rows: Vec<u32> = if kept.is_empty() {
                (0..t as u32).collect()
            } else {
                kept[s].clone()
            };
            let n = rows.len();
            let mut kbuf = Vec::with_capacity(n * d);
            let mut vbuf = Vec::with_capacity(n * d);
            for &p in &rows {
                let p = p as usize;
                kbuf.extend_from_slice(&ks[p * d..(p + 1) * d]);
                vbuf.extend_from_slice(&vs[p * d..(p + 1) * d]);
            }
            let (nqk, nqv) = match (&self.cfg.quant, mode) {
                (None, _) => (0, 0),
                (Some(_), ResidualMode::Minikv) => (n - n % gran, n - n % gran),
                (Some(_), ResidualMode::Kivi) => (n - n % r, n.saturating_sub(r)),
            };
            let h = &mut l.heads[s];
            if let Some(c) = clusters.get_mut(s) {
                let c = std::mem::take(c);
                h.ck.push(&c.keys);
                h.cv.push(&c.values);
                h.ck.shrink();
                h.cv.shrink();
                (h.cbias, h.ccount) = (c.bias, c.counts);
            }
            let nqk = if h.qk.is_some() { nqk } else { 0 };
            let nqv = if h.qv.is_some() { nqv } else { 0 };
            if let Some(q) = h.qk.as_mut() {
                q.append(&kbuf[..nqk * d])?;
            }
            if let Some(q) = h.qv.as_mut() {
                q.append(&vbuf[..nqv * d])?;
            }
            h.fk.push(&kbuf[nqk * d..]);
            h.fv.push(&vbuf[nqv * d..]);
            if dynamic {
                h.pos = rows.clone();
                h.score = match rule {
                    Some(DynamicRule::Recency) => rows.iter().map(|&p| p as f32).collect(),
                    _ => match scores {
                        Some(sc) => rows.iter().map(|&p| sc[s * t + p as usize]).collect(),
                        None => vec![0.0; n],
                    },
                };
                let evicted = n < t;
                h.cap = if evicted {
                    n
                } else {
                    sinks + budget.heavy + budget.recent
                };
                h.recent = budget.recent;
            }
            for st in [h.qk.as_mut(), h.qv.as_mut()].into_iter().flatten() {
                st.shrink();
            }
            h.fk.shrink();
            h.fv.shrink();
        }
        let l = &mut self.layers[layer];
        l.k = vec![Vec::new(); self.spec.n_kv_heads];
        l.v = vec![Vec::new(); self.spec.n_kv_heads];
        l.cumul = Vec::new();
        l.window = Vec::new();
        Ok(())
    }
}

impl KvCache for LayeredCache {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn phase(&self) -> Phase {
        self.phase
    }

    fn seq_len(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, |l| l.seen)
    }

    fn append(&mut self, layer: usize, k: &[f32], v: &[f32], n: usize) -> Result<()> {
        self.check_layer(layer)?;
        let (hkv, d) = (self.spec.n_kv_heads, self.spec.head_dim);
        check_len("append keys", n * hkv * d, k.len())?;
        check_len("append values", n * hkv * d, v.len())?;
        check_finite("append keys", k)?;
        check_finite("append values", v)?;
        let seen = self.layers[layer].seen;
        if seen + n > self.spec.max_seq_len {
            return Err(Error::ContextOverflow {
                len: seen + n,
                max: self.spec.max_seq_len,
            });
        }
        match self.phase {
            Phase::Prefill => {
                let l = &mut self.layers[layer];
                for i in 0..n {
                    for h in 0..hkv {
                        let src = (i * hkv + h) * d..(i * hkv + h + 1) * d;
                        l.k[h].extend_from_slice(&k[src.clone()]);
                        l.v[h].extend_from_slice(&v[src]);
                    }
                }
                l.seen += n;
            }
            Phase::Decode => {
                if n != 1 {
                    return Err(Error::Unsupported(format!(
                        "appending {n} tokens at once after compression: decode appends one token per step"
                    )));
                }
                let (r, mode) = self.residual();
                let dynamic = self.cfg.decode == DecodeMode::Evict;
                let kvs: Vec<usize> = (0..self.n_store).map(|s| self.kv_of_store(s)).collect();
                let l = &mut self.layers[layer];
                for (s, h) in l.heads.iter_mut().enumerate() {
                    let kv = kvs[s];
                    h.fk.push(&k[kv * d..(kv + 1) * d]);
                    h.fv.push(&v[kv * d..(kv + 1) * d]);
                    if dynamic {
                        h.pos.push(seen as u32);
                        h.score.push(0.0);
                    }
                    if mode == ResidualMode::Minikv {
                        if h.qk.is_some() && h.fk.len() >= r {
                            let n = h.fk.len();
                            Self::flush(&mut h.qk, &mut h.fk, n, &mut self.scratch)?;
                        }
                        if h.qv.is_some() && h.fv.len() >= r {
                            let n = h.fv.len();
                            Self::flush(&mut h.qv, &mut h.fv, n, &mut self.scratch)?;
                        }
                    }
                }
                l.seen += 1;
            }
        }
        Ok(())
    }

    fn attend(&mut self, layer: usize, q: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        self.check_layer(layer)?;
        let row = self.spec.n_q_heads * self.spec.head_dim;
        check_len("attend queries", n * row, q.len())?;
        check_len("attend output", n * row, out.len())?;
        match self.phase {
            Phase::Prefill => self.prefill_attend(layer, q, n, out),
            Phase::Decode => {
                if n != 1 {
                    return Err(Error::Unsupported(
                        "decode attends one query per head".into(),
                    ));
                }
                self.decode_attend(layer, q, out)
            }
        }
    }

    fn end_prefill(&mut self) -> Result<()> {
        if self.phase == Phase::Decode {
            return Err(Error::Unsupported("end_prefill called twice".into()));
        }
        let (hq, hkv, d) = (
            self.spec.n_q_heads,
            self.spec.n_kv_heads,
            self.spec.head_dim,
        );
        let t = self.layers[0].seen;
        if self.layers.iter().any(|l| l.seen != t) {
            return Err(Error::shape(
                "end_prefill: tokens per layer",
                t,
                "differing lengths",
            ));
        }
        let Some(scorer) = self.cfg.scorer.as_ref() else {
            for layer in 0..self.spec.n_layers {
                self.compress_layer(
                    layer,
                    &[],
                    None,
                    LayerBudget {
                        heavy: t,
                        recent: 0,
                    },
                    Vec::new(),
                )?;
            }
            self.phase = Phase::Decode;
            return Ok(());
        };
        let heavy = self
            .cfg
            .heavy_tokens
            .unwrap_or_else(|| (t as f64 * self.cfg.heavy.unwrap_or(0.0)).floor() as usize);
        let recent = self
            .cfg
            .recent_tokens
            .unwrap_or_else(|| (t as f64 * self.cfg.recent.unwrap_or(0.0)).floor() as usize);
        let stats: Option<Vec<f32>> = self.stat.map(|st| {
            self.layers
                .iter()
                .map(|l| st.compute(&l.cumul, hq, t))
                .collect()
        });
        let req = BudgetRequest {
            n_layers: self.spec.n_layers,
            prompt_len: t,
            heavy,
            recent,
            sinks: self.cfg.sinks,
            layer_stats: stats.as_deref(),
        };
        let policy = self.cfg.policy.as_ref().expect("resolved");
        let budgets = policy.layer_budgets(&req)?;
        check_len("policy budgets", self.spec.n_layers, budgets.len())?;
        let selector = self.cfg.selector.as_ref().expect("resolved");
        let mut plans = Vec::with_capacity(self.spec.n_layers);
        for (layer, (l, &budget)) in self.layers.iter().zip(&budgets).enumerate() {
            let staged = l.window.len() / (hq * d);
            // The scorer sees its own window (ResKV may stage more queries).
            let w = staged.min(self.scorer_window);
            let mut wq = vec![0.0f32; hq * w * d];
            for i in 0..w {
                let src = staged - w + i;
                for h in 0..hq {
                    wq[(h * w + i) * d..(h * w + i + 1) * d]
                        .copy_from_slice(&l.window[(src * hq + h) * d..(src * hq + h + 1) * d]);
                }
            }
            let keys: Vec<&[f32]> = l.k.iter().map(|x| x.as_slice()).collect();
            let values: Vec<&[f32]> = l.v.iter().map(|x| x.as_slice()).collect();
            let inputs = ScoreInputs {
                spec: &self.spec,
                layer,
                t,
                keys: &keys,
                values: &values,
                cumulative: (!l.cumul.is_empty()).then_some(&l.cumul[..]),
                window_queries: (w > 0).then_some(&wq[..]),
                window: w,
            };
            let mut sq = vec![0.0f32; hq * t];
            scorer.score(&inputs, &mut sq)?;
            if let Some(i) = sq.iter().position(|x| x.is_nan()) {
                return Err(Error::Input(format!(
                    "scorer produced NaN at layer {layer}, index {i}"
                )));
            }
            let scores = match self.cfg.heads {
                HeadMode::PerKv => reduce_gqa(&sq, hq, hkv, t, self.cfg.gqa_reduce),
                HeadMode::PerQuery => sq,
            };
            let mut kept = Vec::new();
            selector.select(
                &SelectionInput {
                    scores: &scores,
                    n_heads: self.n_store,
                    t,
                    budget,
                    sinks: self.cfg.sinks,
                },
                &mut kept,
            )?;
            check_len("selector heads", self.n_store, kept.len())?;
            for k in &kept {
                if k.windows(2).any(|w| w[0] >= w[1]) || k.last().is_some_and(|&p| p as usize >= t)
                {
                    return Err(Error::Input(
                        "selector returned unsorted or out-of-range positions".into(),
                    ));
                }
            }
            let (kept, clusters, stats) = match &self.cfg.reskv {
                Some(rc) => self.residual_clusters(layer, kept, &scores, budget, rc),
                None => (kept, Vec::new(), Vec::new()),
            };
            if self.cfg.reskv.is_some() {
                self.res_stats.push(stats);
            }
            plans.push((kept, scores, clusters));
        }
        for (layer, (kept, scores, clusters)) in plans.into_iter().enumerate() {
            self.compress_layer(layer, &kept, Some(&scores), budgets[layer], clusters)?;
        }
        self.budgets = budgets;
        self.phase = Phase::Decode;
        Ok(())
    }

    fn memory(&self) -> MemoryReport {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let staging = 4
                    * (l.k.iter().chain(&l.v).map(|x| x.capacity()).sum::<usize>()
                        + l.cumul.capacity()
                        + l.window.capacity());
                let heads = l
                    .heads
                    .iter()
                    .map(|h| {
                        let (mut codes, mut scales) = (0, 0);
                        for q in [&h.qk, &h.qv].into_iter().flatten() {
                            let b = q.bytes();
                            codes += b.codes;
                            scales += b.scales;
                        }
                        HeadMemory {
                            tokens: h.fk.len() + h.qk.as_ref().map_or(0, |q| q.len()),
                            quant_keys: h.qk.as_ref().map_or(0, |q| q.len()),
                            quant_values: h.qv.as_ref().map_or(0, |q| q.len()),
                            quant_codes: codes,
                            quant_scales: scales,
                            fp: h.fk.bytes() + h.fv.bytes(),
                            indices: h.pos.capacity() * 4 + h.score.capacity() * 4,
                            clusters: h.ck.bytes()
                                + h.cv.bytes()
                                + 4 * (h.cbias.capacity() + h.ccount.capacity()),
                        }
                    })
                    .collect();
                LayerMemory { heads, staging }
            })
            .collect();
        let seq_len = self.layers.first().map_or(0, |l| l.seen);
        MemoryReport {
            layers,
            seq_len,
            full_fp16_bytes: self.spec.full_fp16_bytes(seq_len),
        }
    }

    fn budgets(&self) -> Vec<LayerBudget> {
        self.budgets.clone()
    }

    /// With ResKV: per layer, the head-averaged [`ResidualStats`] on the
    /// held-out prompt queries, and their mean over layers.
    fn diagnostics(&self) -> serde_json::Value {
        if self.res_stats.is_empty() {
            return serde_json::Value::Null;
        }
        let avg = |xs: &mut dyn Iterator<Item = &ResidualStats>| {
            let v: Vec<&ResidualStats> = xs.collect();
            let n = v.len().max(1) as f64;
            let f = |g: fn(&ResidualStats) -> f64| v.iter().map(|s| g(s)).sum::<f64>() / n;
            serde_json::json!({
                "evicted": f(|s| s.evicted as f64),
                "clusters": f(|s| s.clusters as f64),
                "eta": f(|s| s.eta),
                "denominator_error": f(|s| s.denominator_error),
                "numerator_error": f(|s| s.numerator_error),
                "output_error": f(|s| s.output_error),
                "output_error_dropped": f(|s| s.output_error_dropped),
            })
        };
        let per_layer: Vec<_> = self.res_stats.iter().map(|l| avg(&mut l.iter())).collect();
        serde_json::json!({"reskv": {
            "held_out_queries": self.cfg.reskv.as_ref().map_or(0, |r| r.held_out),
            "mean": avg(&mut self.res_stats.iter().flatten()),
            "per_layer": per_layer,
        }})
    }

    fn reset(&mut self) {
        // Stores were creatable at construction, so they are now.
        self.reset_layers().expect("stores were created before");
    }
}
