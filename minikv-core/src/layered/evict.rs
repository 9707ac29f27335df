//! Decode-time eviction of one layer, over any scorer (the analogue of
//! kvpress's decoding-time wrapper): each stored row has a position and a
//! running score; every `evict_every` steps the lowest-scored rows outside
//! the sinks and the recent window are evicted down to the head's capacity.
//!
//! The running score follows the scorer's own decode-time rule
//! ([`DecodeScore`]: H2O accumulates, TOVA takes the last query, StreamingLLM
//! the position). A scorer without one is re-run on the stored rows (in
//! position order) with the latest decode queries as its query window.

use super::store::HeadStore;
use crate::config::{CacheConfig, HeadMode};
use crate::scoring::{DecodeStep, GqaReduce, LayerSignals, TokenScorer};
use crate::{LayerBudget, ModelSpec, Result};

/// Positions and running scores of one storage head.
#[derive(Debug, Default)]
struct EvictHead {
    pos: Vec<u32>,
    score: Vec<f32>,
    /// Rows kept after an eviction.
    cap: usize,
    /// Recent window protected from eviction.
    recent: usize,
}

/// Decode-time eviction state of one layer.
#[derive(Debug)]
pub(crate) struct Evictor {
    /// The scorer whose decode-time rule (or re-scoring) drives eviction.
    scorer: Box<dyn TokenScorer>,
    heads: Vec<EvictHead>,
    /// Per query head, this step's attention over its storage head's rows.
    pub probs: Vec<Vec<f32>>,
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
}

/// What the evictor needs from the cache's config.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EvictParams<'a> {
    pub spec: &'a ModelSpec,
    pub layer: usize,
    pub sinks: usize,
    pub every: usize,
    pub reduce: GqaReduce,
    /// Tokens seen by the layer (the next position).
    pub seen: usize,
}

impl EvictParams<'_> {
    pub fn reduce_of(cfg: &CacheConfig) -> GqaReduce {
        match cfg.heads {
            HeadMode::PerKv => cfg.gqa_reduce,
            HeadMode::PerQuery => GqaReduce::Sum,
        }
    }
}

impl Evictor {
    /// State after compression: rows `kept[s]` of each storage head with
    /// their prefill scores (`scores[s * t + p]`, or 0 without scores).
    pub fn new(
        spec: &ModelSpec,
        scorer: Box<dyn TokenScorer>,
        kept: Vec<Vec<u32>>,
        scores: Option<&[f32]>,
        t: usize,
        sinks: usize,
        budget: LayerBudget,
    ) -> Self {
        let rule = scorer.decode_score();
        let heads = kept
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
        }
    }

    /// Most rows a head of this layer will ever hold: its capacity plus the
    /// rows that arrive between evictions.
    pub fn max_rows(&self, s: usize, every: usize) -> usize {
        let h = &self.heads[s];
        h.cap.max(h.pos.len()) + every
    }

    /// Records a decoded token's row in every head.
    pub fn push(&mut self, pos: u32) {
        let rule = self.scorer.decode_score();
        for h in &mut self.heads {
            h.pos.push(pos);
            h.score.push(rule.map_or(0.0, |r| r.initial(pos, 0.0)));
        }
    }

    /// Records the step's queries (`[Hq * d]`) for rescoring.
    pub fn push_query(&mut self, q: &[f32]) {
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
    pub fn step(&mut self, stores: &mut [HeadStore], p: &EvictParams<'_>) -> Result<()> {
        let hq = p.spec.n_q_heads;
        let g = hq / stores.len();
        let rule = self.scorer.decode_score();
        let rescore = rule.is_none();
        self.steps += 1;
        let due = self.steps.is_multiple_of(p.every);
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
                self.reduced.extend((0..n).map(|i| match p.reduce {
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
        for (s, store) in stores.iter_mut().enumerate() {
            if self.heads[s].pos.len() <= self.heads[s].cap {
                continue;
            }
            if rescore {
                self.rescore(s, store, g, p)?;
            }
            let recent_start = p.seen.saturating_sub(self.heads[s].recent);
            let h = &mut self.heads[s];
            while h.pos.len() > h.cap {
                let mut victim: Option<usize> = None;
                for i in 0..h.pos.len() {
                    let q = h.pos[i] as usize;
                    if q < p.sinks || q >= recent_start {
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
                store.swap_remove(v);
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
        store: &HeadStore,
        g: usize,
        p: &EvictParams<'_>,
    ) -> Result<()> {
        let d = p.spec.head_dim;
        let hq = p.spec.n_q_heads;
        let h = &mut self.heads[s];
        let n = h.pos.len();
        self.order.clear();
        self.order.extend(0..n as u32);
        let pos = &h.pos;
        self.order.sort_unstable_by_key(|&i| pos[i as usize]);
        let (fk, fv) = store.fp();
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
            h.score[i as usize] = match p.reduce {
                GqaReduce::Max => col.fold(f32::NEG_INFINITY, f32::max),
                GqaReduce::Sum => col.sum(),
                GqaReduce::Mean => col.sum::<f32>() / g as f32,
            };
        }
        if let Some(i) = h.score.iter().position(|x| x.is_nan()) {
            return Err(crate::Error::Input(format!(
                "scorer produced NaN while re-scoring layer {}, row {i}",
                p.layer
            )));
        }
        Ok(())
    }

    /// Bytes of positions and scores of head `s`.
    pub fn head_bytes(&self, s: usize) -> (usize, usize) {
        let h = &self.heads[s];
        (
            4 * (h.pos.capacity() + h.score.capacity()),
            4 * (h.pos.len() + h.score.len()),
        )
    }

    /// Bytes of the work buffers.
    pub fn work_bytes(&self) -> usize {
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
