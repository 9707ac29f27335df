//! The cache every config builds, assembled from parts with one job each:
//!
//! * `staging`: the prompt's K/V in full precision and the signals the
//!   components asked for, until the end of prefill;
//! * `compress`: the end of prefill (budgets, scores, selection,
//!   compensation) wiring the components of the config;
//! * `store`: per storage head, the quantized part, the fp16 residual with
//!   its streaming rule, and extra entries;
//! * `evict`: decode-time eviction over any scorer.
//!
//! Heads hold ragged lengths: per-head budgets really free memory.
//! [`KvCache::memory`] is the sum of each part's own accounting.

mod accounting;
mod compress;
mod evict;
mod quest;
pub(crate) mod staging;
mod store;

use crate::attention::{AttentionBackend, DecodeArgs, HeadView};
use crate::cache::{KvCache, MemoryReport, ModelWants, Observation, Phase};
use crate::compensate::LogitGate;
use crate::config::{CacheConfig, HeadMode};
use crate::{Error, LayerBudget, ModelSpec, Needs, Result, check_finite, check_len};
use evict::{EvictParams, Evictor};
pub use quest::QuestConfig;
use quest::QuestHead;
use smallvec::SmallVec;
use staging::Staging;
use std::sync::Arc;
use store::{HeadStore, ResidualRule};

/// One layer: its staging during prefill, its stores and eviction state after.
#[derive(Debug)]
struct Layer {
    seen: usize,
    staging: Staging,
    heads: Vec<HeadStore>,
    evict: Option<Evictor>,
    /// Quest's page bounds per storage head (empty without `cache.quest`).
    quest: Vec<QuestHead>,
}

/// Quest's running byte counts.
#[derive(Debug, Default, Clone, Copy)]
struct QuestStats {
    steps: u64,
    bytes_read: u64,
    bytes_all: u64,
}

/// The cache built from a [`CacheConfig`].
#[derive(Debug)]
pub struct LayeredCache {
    spec: ModelSpec,
    cfg: CacheConfig,
    backend: Arc<dyn AttentionBackend>,
    needs: Needs,
    phase: Phase,
    layers: Vec<Layer>,
    budgets: Vec<LayerBudget>,
    n_store: usize,
    residual: ResidualRule,
    gate: Option<Arc<dyn LogitGate>>,
    /// Flush scratch shared by the layers.
    scratch: Vec<f32>,
    /// Compensator statistics per layer and head.
    comp_stats: Vec<Vec<Vec<(&'static str, f64)>>>,
    quest_stats: QuestStats,
    /// The context-reconstruction pass in progress, and the passes' totals.
    pass: Option<(staging::Pass, std::time::Instant)>,
    pass_stats: (usize, f64),
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
        let mut needs = Needs::default();
        if let Some(s) = &cfg.scorer {
            needs = needs.union(s.needs());
        }
        if let Some(p) = &cfg.policy {
            needs = needs.union(p.needs());
        }
        if let Some(c) = &cfg.compensator {
            needs = needs.union(c.needs());
        }
        if let Some(c) = &cfg.channels {
            needs = needs.union(c.needs());
        }
        let n_store = match cfg.heads {
            HeadMode::PerKv => spec.n_kv_heads,
            HeadMode::PerQuery => spec.n_q_heads,
        };
        let mut c = Self {
            spec,
            residual: ResidualRule::new(&cfg),
            gate: cfg.compensator.as_ref().and_then(|c| c.gate()),
            cfg,
            backend,
            needs,
            phase: Phase::Prefill,
            layers: Vec::new(),
            budgets: Vec::new(),
            n_store,
            scratch: Vec::new(),
            comp_stats: Vec::new(),
            quest_stats: QuestStats::default(),
            pass: None,
            pass_stats: (0, 0.0),
        };
        c.reset_layers()?;
        Ok(c)
    }

    /// Quest: bytes read per decoded token (all layers) next to bytes held.
    fn quest_diagnostics(&self) -> crate::Stats {
        let q = &self.quest_stats;
        let steps = q.steps.max(1) as f64;
        let read = if q.bytes_all == 0 {
            1.0
        } else {
            q.bytes_read as f64 / q.bytes_all as f64
        };
        let values = [
            ("decode_steps", q.steps as f64),
            ("bytes_read_per_token", q.bytes_read as f64 / steps),
            ("bytes_held_per_token", q.bytes_all as f64 / steps),
            ("read_fraction", read),
        ];
        crate::Stats {
            values: values.into_iter().map(|(k, v)| (k.into(), v)).collect(),
            per_layer: Vec::new(),
        }
    }

    /// The resolved config.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    fn reset_layers(&mut self) -> Result<()> {
        let st = self.backend.storage();
        let d = self.spec.head_dim;
        self.layers = (0..self.spec.n_layers)
            .map(|_| {
                Ok(Layer {
                    seen: 0,
                    staging: Staging::new(self.spec.n_kv_heads),
                    heads: (0..self.n_store)
                        .map(|_| HeadStore::new(&self.cfg, st, d))
                        .collect::<Result<_>>()?,
                    evict: None,
                    quest: Vec::new(),
                })
            })
            .collect::<Result<_>>()?;
        self.budgets.clear();
        self.comp_stats.clear();
        self.quest_stats = QuestStats::default();
        self.pass = None;
        self.pass_stats = (0, 0.0);
        self.phase = Phase::Prefill;
        Ok(())
    }

    fn kv_of_store(&self, s: usize) -> usize {
        s * self.spec.n_kv_heads / self.n_store
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

    fn decode_append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let d = self.spec.head_dim;
        let (n_store, hkv) = (self.n_store, self.spec.n_kv_heads);
        let l = &mut self.layers[layer];
        for (s, h) in l.heads.iter_mut().enumerate() {
            let kv = s * hkv / n_store;
            let (k, v) = (&k[kv * d..(kv + 1) * d], &v[kv * d..(kv + 1) * d]);
            h.push(k, v, &self.residual, &mut self.scratch)?;
        }
        for (s, qh) in l.quest.iter_mut().enumerate() {
            let kv = s * hkv / n_store;
            qh.add_rows(&k[kv * d..(kv + 1) * d]);
        }
        if let Some(ev) = l.evict.as_mut() {
            ev.push(
                l.seen as u32,
                self.cfg.scorer.as_deref().expect("validated"),
            );
        }
        l.seen += 1;
        Ok(())
    }

    fn decode_attend(&mut self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<()> {
        let l = &mut self.layers[layer];
        let gate = self.gate.as_deref();
        if let Some(qc) = &self.cfg.quest {
            let (d, g) = (self.spec.head_dim, self.spec.n_q_heads / self.n_store);
            for (s, qh) in l.quest.iter_mut().enumerate() {
                let read = qh.select(&l.heads[s], &q[s * g * d..(s + 1) * g * d], qc.token_budget);
                self.quest_stats.bytes_read += read as u64;
                self.quest_stats.bytes_all += qh.held_bytes() as u64;
            }
            if layer == 0 {
                self.quest_stats.steps += 1;
            }
        }
        {
            let views: SmallVec<[HeadView<'_>; 16]> = l
                .heads
                .iter()
                .enumerate()
                .map(|(s, h)| {
                    let mut v = h.view(gate);
                    if let Some(qh) = l.quest.get(s).filter(|qh| qh.selected) {
                        v.fp_keys = qh.sel_k.as_ref();
                        v.fp_values = qh.sel_v.as_ref();
                    }
                    v
                })
                .collect();
            self.backend.decode(DecodeArgs {
                q,
                heads: &views,
                head_dim: self.spec.head_dim,
                out,
                probs: l.evict.as_mut().map(|e| &mut e.probs[..]),
            })?;
        }
        for h in &mut l.heads {
            h.after_attend(&self.residual, &mut self.scratch)?;
        }
        if let Some(ev) = l.evict.as_mut() {
            ev.push_query(q);
            let p = EvictParams {
                scorer: self.cfg.scorer.as_deref().expect("validated"),
                spec: &self.spec,
                layer,
                sinks: self.cfg.sinks,
                every: self.cfg.evict_every,
                reduce: EvictParams::reduce_of(&self.cfg),
                seen: l.seen,
            };
            ev.step(&mut l.heads, &p)?;
        }
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
                l.staging.append(&self.spec, k, v, n);
                l.seen += n;
                Ok(())
            }
            Phase::Decode if n != 1 => Err(Error::Unsupported(format!(
                "appending {n} tokens at once after compression: decode appends one token per step"
            ))),
            Phase::Decode => self.decode_append(layer, k, v),
        }
    }

    fn attend(&mut self, layer: usize, q: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        self.check_layer(layer)?;
        let row = self.spec.n_q_heads * self.spec.head_dim;
        check_len("attend queries", n * row, q.len())?;
        check_len("attend output", n * row, out.len())?;
        match self.phase {
            Phase::Prefill => {
                let l = &mut self.layers[layer];
                let t = l.seen;
                match &self.pass {
                    None => l.staging.attend(
                        self.backend.as_ref(),
                        &self.spec,
                        self.needs,
                        t,
                        q,
                        n,
                        out,
                    ),
                    Some((pass, _)) => {
                        // A pass's tokens feed no other signal.
                        l.staging.attend(
                            self.backend.as_ref(),
                            &self.spec,
                            Needs::default(),
                            t,
                            q,
                            n,
                            out,
                        )?;
                        l.staging.pass_scores(&self.spec, pass, q, n, t);
                        Ok(())
                    }
                }
            }
            Phase::Decode if n != 1 => Err(Error::Unsupported(
                "decode attends one query per head".into(),
            )),
            Phase::Decode => self.decode_attend(layer, q, out),
        }
    }

    fn end_prefill(&mut self) -> Result<()> {
        self.compress()
    }

    fn wants(&self, layer: usize) -> ModelWants {
        let Some(l) = self.layers.get(layer) else {
            return ModelWants::default();
        };
        if self.phase != Phase::Prefill {
            return ModelWants::default();
        }
        ModelWants {
            pre_rope_queries: (self.needs.query_stats_from.is_some()
                || (self.needs.rope && l.staging.rope.is_none()))
                && self.pass.is_none(),
            output_projection: self.needs.output_projection && l.staging.out_proj.is_empty(),
            reconstruction: self.needs.reconstruction.is_some(),
        }
    }

    fn begin_pass(&mut self, context: std::ops::Range<usize>) -> Result<()> {
        let Some(sink) = self.needs.reconstruction else {
            return Err(Error::Unsupported(
                "no component of this cache asked for a reconstruction pass".into(),
            ));
        };
        if self.phase != Phase::Prefill || self.pass.is_some() {
            return Err(Error::Unsupported(
                "a reconstruction pass starts during prefill, one at a time".into(),
            ));
        }
        let t0 = self.layers[0].seen;
        if self.layers.iter().any(|l| l.seen != t0)
            || context.start >= context.end
            || context.end > t0
        {
            return Err(Error::Input(format!(
                "reconstruction pass over {context:?}: the prompt holds {t0} tokens in every layer"
            )));
        }
        self.pass = Some((
            staging::Pass { context, t0, sink },
            std::time::Instant::now(),
        ));
        Ok(())
    }

    fn end_pass(&mut self) -> Result<()> {
        let Some((pass, t)) = self.pass.take() else {
            return Err(Error::Unsupported("end_pass without begin_pass".into()));
        };
        for l in &mut self.layers {
            self.pass_stats.0 += l.seen - pass.t0;
            l.staging.truncate(&self.spec, pass.t0);
            l.seen = pass.t0;
        }
        self.pass_stats.1 += t.elapsed().as_secs_f64();
        Ok(())
    }

    fn observe(&mut self, layer: usize, obs: Observation<'_>) -> Result<()> {
        self.check_layer(layer)?;
        if self.phase != Phase::Prefill {
            return Ok(());
        }
        let l = &mut self.layers[layer];
        l.staging.observe(&self.spec, self.needs, l.seen, obs)
    }

    fn memory(&self) -> MemoryReport {
        self.memory_report()
    }

    fn projected_kv_bytes(&self, prompt: usize, max_new: usize) -> Result<usize> {
        self.projected_bytes(prompt, max_new)
    }

    fn budgets(&self) -> Vec<LayerBudget> {
        self.budgets.clone()
    }

    /// With a compensator: its per-head statistics averaged per layer and
    /// overall, under the compensator's type name.
    fn diagnostics(&self) -> crate::Diagnostics {
        // Every part that measured something, side by side.
        let mut d = crate::Diagnostics::new();
        if self.cfg.quest.is_some() {
            d.insert("quest".into(), self.quest_diagnostics());
        }
        if self.needs.reconstruction.is_some() {
            // Per layer tokens are counted once.
            let values = [
                (
                    "pass_tokens".to_string(),
                    (self.pass_stats.0 / self.spec.n_layers.max(1)) as f64,
                ),
                ("pass_seconds".to_string(), self.pass_stats.1),
            ];
            let s = crate::Stats {
                values: values.into_iter().collect(),
                per_layer: Vec::new(),
            };
            d.insert("reconstruction".into(), s);
        }
        d.extend(self.compensator_diagnostics());
        d
    }

    fn reset(&mut self) {
        // Stores were creatable at construction, so they are now.
        self.reset_layers().expect("stores were created before");
    }
}
