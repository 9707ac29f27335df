//! Decode-time eviction over any scorer (`decode = "evict"`; the analogue
//! of kvpress's decoding-time wrapper), a [`DecodeRegime`]: each stored row
//! has a position and a running score; every `every` steps the
//! lowest-scored rows outside the sinks and the recent window are evicted
//! down to the head's capacity (`sinks + heavy + recent`; a head whose
//! selection kept the whole prompt grows to it first).
//!
//! The running score follows the scorer's own decode-time rule
//! ([`DecodeScore`](minikv_core::DecodeScore): H2O accumulates, TOVA takes
//! the last query, StreamingLLM the position). A scorer without one is
//! re-run on the stored rows (in position order) with the latest decode
//! queries as its query window.
//!
//! ```
//! use minikv_core::RunConfig;
//! use minikv_policies as _; // links the `evict` regime
//!
//! let text = "[cache]\nheavy_tokens = 8\nrecent_tokens = 4\nscorer = { type = \"h2o\" }\ndecode = { type = \"evict\", every = 4 }";
//! let cfg = RunConfig::parse(text, false)?;
//! assert_eq!(cfg.cache.decode.typetag_name(), "evict");
//! // Without a scorer there is nothing to rank rows by.
//! let bad = RunConfig::parse("[cache]\ndecode = \"evict\"", false)?;
//! assert!(bad.validate(None).unwrap_err().to_string().contains("needs a scorer"));
//! # Ok::<(), minikv_core::Error>(())
//! ```

use minikv_core::regime::{
    DecodeRegime, Growth, GrowthQuery, RegimeLayer, RegimeStart, RegimeStep, StoredHeads,
};
use minikv_core::scoring::{DecodeStep, GqaReduce, LayerSignals, TokenScorer};
use minikv_core::{CacheConfig, Error, ModelSpec, Result};
use serde::{Deserialize, Serialize};

/// `decode = { type = "evict", every = N }`: evict down to the budget every
/// `N` decode steps (a head holds up to `N - 1` extra rows in between).
///
/// What a head is evicted down to: the config's budget
/// (`sinks + heavy + recent`, the default), or, as kvpress's decoding
/// presses do, a fixed number of rows (`target_tokens`, `DecodingPress`'s
/// `target_size`) or a share of the tokens seen so far (`target_ratio`
/// removed: `max(1, floor(seen · (1 - ratio)))` rows kept,
/// `CompressionRatioDecodingPress`). `scorer` ranks the rows while decoding
/// in place of the config's (kvpress's `PrefillDecodingPress` with a
/// different decoding press; the prompt's scores are then not carried over).
/// Sinks and the config's recent window stay protected in every case.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Evict {
    /// Decode steps between evictions (1: every step).
    pub every: usize,
    /// Rows a head keeps after each eviction, instead of the budget.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_tokens: Option<usize>,
    /// Share of the tokens seen that each eviction removes, in `[0, 1)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_ratio: Option<f64>,
    /// The scorer used while decoding (default: the config's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scorer: Option<Box<dyn TokenScorer>>,
}

impl Default for Evict {
    fn default() -> Self {
        Self {
            every: 1,
            target_tokens: None,
            target_ratio: None,
            scorer: None,
        }
    }
}

/// What each eviction brings a head down to.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Target {
    /// The head's capacity from the budget.
    Budget,
    /// A fixed number of rows.
    Tokens(usize),
    /// `max(1, floor(seen · (1 - ratio)))` rows.
    Ratio(f64),
}

impl Evict {
    fn target(&self) -> Target {
        match (self.target_tokens, self.target_ratio) {
            (Some(n), _) => Target::Tokens(n),
            (None, Some(r)) => Target::Ratio(r),
            (None, None) => Target::Budget,
        }
    }
}

#[typetag::serde(name = "evict")]
impl DecodeRegime for Evict {
    fn validate(&self, cache: &CacheConfig) -> Result<()> {
        if !(1..=1 << 16).contains(&self.every) {
            return Err(Error::config(
                "cache.decode.every",
                format!("must be in 1..=65536, got {}", self.every),
            ));
        }
        if self.target_tokens.is_some() && self.target_ratio.is_some() {
            return Err(Error::config(
                "cache.decode.target_tokens",
                "set either target_tokens or target_ratio, not both",
            ));
        }
        if self.target_tokens == Some(0) || self.target_tokens.is_some_and(|n| n > 1 << 32) {
            return Err(Error::config(
                "cache.decode.target_tokens",
                format!(
                    "must be in 1..=4294967296, got {}",
                    self.target_tokens.unwrap_or(0)
                ),
            ));
        }
        if let Some(r) = self.target_ratio
            && !(0.0..1.0).contains(&r)
        {
            return Err(Error::config(
                "cache.decode.target_ratio",
                format!("must be in [0, 1), got {r}"),
            ));
        }
        if let Some(s) = &self.scorer {
            s.validate()?;
        }
        let Some(prompt) = &cache.scorer else {
            return Err(Error::config(
                "cache.decode",
                "`evict` needs a scorer: set cache.scorer and a budget (heavy = 1.0 keeps the whole prompt)",
            ));
        };
        // The scorer that ranks rows while decoding.
        let s = self.scorer.as_ref().unwrap_or(prompt);
        if s.decode_score().is_none() && s.needs().cumulative_attention {
            return Err(Error::Unsupported(
                "cache.decode = \"evict\" re-scores stored tokens from keys, values and the latest decode queries; this scorer needs prefill A_cumul and has no decode-time rule (use `h2o` for cumulative attention during decode)".into(),
            ));
        }
        if cache.quant.is_some() {
            return Err(Error::Unsupported(
                "cache.decode = \"evict\" with cache.quant: decode-time eviction needs an unquantized cache"
                    .into(),
            ));
        }
        Ok(())
    }

    fn evicts(&self) -> bool {
        true
    }

    fn start(&self, mut s: RegimeStart<'_>) -> Result<Option<Box<dyn RegimeLayer>>> {
        let scorer = match (&self.scorer, s.scorer) {
            (Some(own), _) => {
                // Another scorer's prompt scores mean nothing to this one.
                s.scores = None;
                own.clone()
            }
            (None, Some(cfg)) => dyn_clone::clone_box(cfg),
            (None, None) => return Err(Error::config("cache.decode", "`evict` needs a scorer")),
        };
        Ok(Some(Box::new(Evictor::new(
            s,
            scorer,
            self.every,
            self.target(),
        ))))
    }

    fn growth(&self, q: &GrowthQuery) -> Growth {
        // A head whose selection kept the whole prompt may grow to the
        // budget (the policy clamps the heavy budget to the prompt, not the
        // recent window), any other holds its kept rows; both plus the rows
        // that arrive between evictions.
        let clamped = q.sinks + q.recent + q.heavy.min(q.prompt.saturating_sub(q.sinks + q.recent));
        let cap = match self.target() {
            Target::Budget if q.kept < q.prompt => q.kept,
            Target::Budget => clamped.max(q.kept),
            Target::Tokens(n) => n.max(q.kept),
            // The kept share of everything seen, at its largest at the end.
            Target::Ratio(r) => {
                let seen = q.prompt + q.max_new;
                ((seen as f64 * (1.0 - r)).floor() as usize).max(q.kept)
            }
        };
        // No head holds more rows than the model's context has tokens (as
        // the running evictor's `max_rows`).
        let cap = cap.min(q.max_seq).max(q.kept);
        Growth {
            steps: q.max_new.min(cap - q.kept + self.every),
            rows: (cap + self.every).min(q.max_seq.max(q.kept)),
            // A share of the tokens seen grows: its store grows by pages.
            bounded: !matches!(self.target(), Target::Ratio(_)),
            // Positions and scores (u32 + f32) per held row; the vectors come
            // from selection over the prompt and may grow to twice their length.
            index_bytes: 2 * 8 * cap.max(q.prompt),
        }
    }
}

minikv_core::register!(
    Decode,
    "evict",
    Evict,
    "evict down to the budget while decoding, by the scorer's decode-time rule or by re-scoring (H2O, TOVA, StreamingLLM)"
);

/// Positions and running scores of one storage head.
#[derive(Debug, Default)]
struct EvictHead {
    pos: Vec<u32>,
    score: Vec<f32>,
    /// Rows kept after an eviction (with a target, set at each eviction).
    cap: usize,
    /// Recent window protected from eviction.
    recent: usize,
}

/// Decode-time eviction state of one layer.
#[derive(Debug)]
struct Evictor {
    /// The scorer whose decode-time rule (or re-scoring) drives eviction.
    scorer: Box<dyn TokenScorer>,
    heads: Vec<EvictHead>,
    /// Per query head, this step's attention over its storage head's rows.
    probs: Vec<Vec<f32>>,
    /// Work buffers, reused every step.
    reduced: Vec<f32>,
    mean: Vec<f32>,
    /// Ring of the last decode queries, token-major `[w][Hq * d]` (rescoring).
    queries: Vec<f32>,
    /// Rows the ring holds once full.
    ring_rows: usize,
    n_queries: usize,
    ring_next: usize,
    /// Rescoring buffers: position order, rows, scores.
    order: Vec<u32>,
    kbuf: Vec<f32>,
    vbuf: Vec<f32>,
    tmp: Vec<f32>,
    wq: Vec<f32>,
    sbuf: Vec<f32>,
    steps: usize,
    /// Steps between evictions, sinks, GQA reduction, what heads evict to.
    every: usize,
    sinks: usize,
    reduce: GqaReduce,
    target: Target,
    /// The model's context length (no head holds more rows).
    max_seq: usize,
}

impl Evictor {
    /// State after compression: rows `kept[s]` of each storage head with
    /// their prefill scores (`scores[s * t + p]`, or 0 without scores).
    fn new(
        st: RegimeStart<'_>,
        scorer: Box<dyn TokenScorer>,
        every: usize,
        target: Target,
    ) -> Self {
        let (spec, scores, t, sinks, budget) = (st.spec, st.scores, st.t, st.sinks, st.budget);
        let rule = scorer.decode_score();
        let heads = st
            .kept
            .into_iter()
            .enumerate()
            .map(|(s, rows)| {
                let score = rows
                    .iter()
                    .map(|&p| {
                        let pre = scores.map_or(0.0, |sc| sc[s * t + p as usize]);
                        rule.map_or(pre, |r| r.initial(p, pre))
                    })
                    .collect();
                EvictHead {
                    cap: if rows.len() < t {
                        rows.len()
                    } else {
                        sinks + budget.heavy + budget.recent
                    },
                    pos: rows,
                    score,
                    recent: budget.recent,
                }
            })
            .collect();
        // At most the model's context; the ring grows as decode queries come.
        let w = if rule.is_none() {
            scorer.needs().query_window.min(spec.max_seq_len)
        } else {
            0
        };
        Self {
            scorer,
            heads,
            probs: vec![Vec::new(); spec.n_q_heads],
            reduced: Vec::new(),
            mean: Vec::new(),
            queries: Vec::new(),
            ring_rows: w,
            n_queries: 0,
            ring_next: 0,
            order: Vec::new(),
            kbuf: Vec::new(),
            vbuf: Vec::new(),
            tmp: Vec::new(),
            wq: Vec::new(),
            sbuf: Vec::new(),
            steps: 0,
            every,
            sinks,
            reduce: st.reduce,
            target,
            max_seq: spec.max_seq_len,
        }
    }

    /// Records the step's queries (`[Hq * d]`) for rescoring.
    fn push_query(&mut self, q: &[f32]) {
        let w = self.ring_rows;
        if w == 0 {
            return;
        }
        let row = q.len();
        if self.queries.len() < w * row {
            self.queries.extend_from_slice(q);
        } else {
            self.queries[self.ring_next * row..(self.ring_next + 1) * row].copy_from_slice(q);
        }
        self.ring_next = (self.ring_next + 1) % w;
        self.n_queries = (self.n_queries + 1).min(w);
    }

    /// Updates scores from this step's `probs` and evicts when due.
    fn evict_step(&mut self, stores: &mut StoredHeads<'_>, p: &RegimeStep<'_>) -> Result<()> {
        let hq = p.spec.n_q_heads;
        let g = hq / stores.len();
        let rule = self.scorer.decode_score();
        let rescore = rule.is_none();
        self.steps += 1;
        let due = self.steps.is_multiple_of(self.every);
        if let Some(rule) = rule {
            let aligned = self.probs.iter().all(|x| x.len() == self.probs[0].len());
            let want_mean = rule.wants_layer_mean() && aligned;
            if want_mean {
                self.mean.clear();
                self.mean.resize(self.probs[0].len(), 0.0);
                for pr in &self.probs {
                    self.mean
                        .iter_mut()
                        .zip(pr)
                        .for_each(|(a, b)| *a += b / hq as f32);
                }
            }
            for (s, h) in self.heads.iter_mut().enumerate() {
                let group = &self.probs[s * g..(s + 1) * g];
                let n = h.pos.len();
                self.reduced.clear();
                self.reduced.extend((0..n).map(|i| match self.reduce {
                    GqaReduce::Max => group.iter().map(|x| x[i]).fold(f32::NEG_INFINITY, f32::max),
                    GqaReduce::Sum => group.iter().map(|x| x[i]).sum(),
                    GqaReduce::Mean => group.iter().map(|x| x[i]).sum::<f32>() / g as f32,
                }));
                let step = DecodeStep {
                    positions: &h.pos,
                    probs: &self.reduced,
                    layer_mean: want_mean.then_some(&self.mean[..]),
                };
                rule.update(&step, &mut h.score);
            }
        }
        if !due {
            return Ok(());
        }
        let cap = match self.target {
            Target::Budget => None,
            Target::Tokens(n) => Some(n),
            Target::Ratio(r) => Some(((p.seen as f64 * (1.0 - r)).floor() as usize).max(1)),
        };
        if let Some(cap) = cap {
            self.heads.iter_mut().for_each(|h| h.cap = cap);
        }
        for s in 0..stores.len() {
            if self.heads[s].pos.len() <= self.heads[s].cap {
                continue;
            }
            if rescore {
                self.rescore(s, stores, g, p)?;
            }
            let recent_start = p.seen.saturating_sub(self.heads[s].recent);
            let h = &mut self.heads[s];
            while h.pos.len() > h.cap {
                let mut victim: Option<usize> = None;
                for i in 0..h.pos.len() {
                    let q = h.pos[i] as usize;
                    if q < self.sinks || q >= recent_start {
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
                stores.swap_remove(s, v)?;
                h.pos.swap_remove(v);
                h.score.swap_remove(v);
            }
        }
        Ok(())
    }

    /// Re-runs the scorer on head `s`'s rows in position order, with the
    /// latest decode queries of its query heads as the window.
    fn rescore(
        &mut self,
        s: usize,
        stores: &StoredHeads<'_>,
        g: usize,
        p: &RegimeStep<'_>,
    ) -> Result<()> {
        let d = p.spec.head_dim;
        let hq = p.spec.n_q_heads;
        let h = &mut self.heads[s];
        let n = h.pos.len();
        self.order.clear();
        self.order.extend(0..n as u32);
        let pos = &h.pos;
        self.order.sort_unstable_by_key(|&i| pos[i as usize]);
        let (fk, fv) = stores.fp(s);
        for (src, dst) in [(fk, &mut self.kbuf), (fv, &mut self.vbuf)] {
            self.tmp.resize(n * d, 0.0);
            src.to_f32(&mut self.tmp);
            dst.resize(n * d, 0.0);
            for (j, &i) in self.order.iter().enumerate() {
                let i = i as usize;
                dst[j * d..(j + 1) * d].copy_from_slice(&self.tmp[i * d..(i + 1) * d]);
            }
        }
        // Window queries of this head's group, `[g][w][d]`, oldest first: the
        // latest decode queries whose own rows are still stored, so that they
        // sit at the end of the rows in position order, as a prompt window does.
        let tail = self
            .order
            .iter()
            .rev()
            .zip((0..p.seen as u32).rev())
            .take_while(|&(&i, want)| pos[i as usize] == want)
            .count();
        let w = self.n_queries.min(tail);
        let cap = if w == 0 {
            0
        } else {
            self.queries.len() / (hq * d)
        };
        self.wq.resize(g * w * d, 0.0);
        for i in 0..w {
            let slot = (self.ring_next + cap - w + i) % cap.max(1);
            for j in 0..g {
                let src = (slot * hq + s * g + j) * d;
                self.wq[(j * w + i) * d..(j * w + i + 1) * d]
                    .copy_from_slice(&self.queries[src..src + d]);
            }
        }
        let sub = ModelSpec {
            n_q_heads: g,
            n_kv_heads: 1,
            windows: Vec::new(),
            ..*p.spec
        };
        let keys = [&self.kbuf[..]];
        let values = [&self.vbuf[..]];
        let inputs = LayerSignals {
            spec: &sub,
            layer: p.layer,
            t: n,
            keys: &keys,
            values: &values,
            cumulative: None,
            window_queries: (w > 0).then_some(&self.wq[..]),
            window: w,
            query_stats: None,
            output_projection: None,
            reconstruction: None,
            budget: None,
            rope: None,
        };
        self.sbuf.resize(g * n, 0.0);
        self.scorer.score(&inputs, &mut self.sbuf)?;
        for (j, &i) in self.order.iter().enumerate() {
            let col = (0..g).map(|k| self.sbuf[k * n + j]);
            h.score[i as usize] = match self.reduce {
                GqaReduce::Max => col.fold(f32::NEG_INFINITY, f32::max),
                GqaReduce::Sum => col.sum(),
                GqaReduce::Mean => col.sum::<f32>() / g as f32,
            };
        }
        if let Some(i) = h.score.iter().position(|x| x.is_nan()) {
            return Err(Error::Input(format!(
                "scorer produced NaN while re-scoring layer {}, row {i}",
                p.layer
            )));
        }
        Ok(())
    }
}

impl RegimeLayer for Evictor {
    fn push(&mut self, pos: u32) {
        let rule = self.scorer.decode_score();
        for h in &mut self.heads {
            h.pos.push(pos);
            h.score.push(rule.map_or(0.0, |r| r.initial(pos, 0.0)));
        }
    }

    fn probs(&mut self) -> Option<&mut [Vec<f32>]> {
        Some(&mut self.probs)
    }

    fn step(&mut self, heads: &mut StoredHeads<'_>, step: &RegimeStep<'_>) -> Result<()> {
        self.push_query(step.query);
        self.evict_step(heads, step)
    }

    /// A head's capacity plus the rows that arrive between evictions.
    fn max_rows(&self, s: usize) -> Option<usize> {
        let h = &self.heads[s];
        let rows = match self.target {
            Target::Budget => h.cap.max(h.pos.len()) + self.every,
            Target::Tokens(n) => n.max(h.pos.len()) + self.every,
            // Grows with the tokens seen.
            Target::Ratio(_) => return None,
        };
        // Never more rows than the model's context holds tokens.
        Some(rows.min(self.max_seq.max(h.pos.len())))
    }

    /// Bytes of positions and scores of head `s`.
    fn head_bytes(&self, s: usize) -> (usize, usize) {
        let h = &self.heads[s];
        (
            4 * (h.pos.capacity() + h.score.capacity()),
            4 * (h.pos.len() + h.score.len()),
        )
    }

    /// Bytes of the work buffers.
    fn work_bytes(&self) -> usize {
        let v = std::mem::size_of::<Vec<f32>>();
        4 * (self.probs.iter().map(Vec::capacity).sum::<usize>()
            + self.reduced.capacity()
            + self.mean.capacity()
            + self.queries.capacity()
            + self.order.capacity()
            + self.kbuf.capacity()
            + self.vbuf.capacity()
            + self.tmp.capacity()
            + self.wq.capacity()
            + self.sbuf.capacity())
            + v * self.probs.capacity()
            + std::mem::size_of::<EvictHead>() * self.heads.capacity()
    }
}
