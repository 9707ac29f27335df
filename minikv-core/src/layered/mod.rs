//! The cache every config builds, assembled from parts with one job each:
//!
//! * `staging`: the prompt's K/V in full precision and the signals the
//!   components asked for, until the end of prefill;
//! * `compress`: the end of prefill (budgets, scores, selection,
//!   compensation) wiring the components of the config;
//! * `store`: per storage head, the quantized part, the fp16 residual with
//!   its streaming rule, and extra entries;
//! * `decode`: one decode step (append, attend, residual rule, the decode
//!   regime, [`crate::regime`]);
//! * `pages`: page summaries and per-step page reads ([`crate::pages`]);
//! * `passes`: context-reconstruction passes during prefill;
//! * `accounting`: the memory report, its projection and the diagnostics.
//!
//! Heads hold ragged lengths: per-head budgets really free memory.
//! [`KvCache::memory`] is the sum of each part's own accounting.

mod accounting;
mod compress;
mod decode;
mod pages;
mod passes;
pub(crate) mod staging;
pub(crate) mod store;

use crate::attention::AttentionBackend;
use crate::cache::{KvCache, MemoryReport, ModelWants, Observation, Phase};
use crate::compensate::LogitGate;
use crate::config::CacheConfig;
use crate::plan::{CachePlan, Selection};
use crate::{Error, LayerBudget, ModelSpec, Needs, Result, check_finite, check_len};
use pages::{PageHead, PageStats};
use staging::Staging;
use std::sync::Arc;
use store::{HeadStore, Residual};

impl Drop for LayeredCache {
    /// A cache dropped mid-prefill (a cancelled request) releases what the
    /// backend kept of its prompt.
    fn drop(&mut self) {
        self.release_histories();
    }
}

/// One layer: its staging during prefill, its stores and eviction state after.
#[derive(Debug)]
struct Layer {
    seen: usize,
    staging: Staging,
    heads: Vec<HeadStore>,
    /// The decode regime's state (`None`: frozen).
    regime: Option<Box<dyn crate::regime::RegimeLayer>>,
    /// Page summaries per storage head (empty without `cache.pages`).
    pages: Vec<PageHead>,
}

/// The cache built from a [`CacheConfig`].
#[derive(Debug)]
pub struct LayeredCache {
    spec: ModelSpec,
    cfg: CacheConfig,
    /// Token selection (`None`: every token kept).
    selection: Option<Selection>,
    backend: Arc<dyn AttentionBackend>,
    needs: Needs,
    phase: Phase,
    layers: Vec<Layer>,
    budgets: Vec<LayerBudget>,
    n_store: usize,
    residual: Residual,
    gate: Option<Arc<dyn LogitGate>>,
    /// Flush scratch shared by the layers.
    scratch: Vec<f32>,
    /// Compensator statistics per layer and head.
    comp_stats: Vec<Vec<Vec<(&'static str, f64)>>>,
    page_stats: PageStats,
    /// The context-reconstruction pass in progress, and the passes' totals.
    pass: Option<(staging::Pass, std::time::Instant)>,
    pass_stats: (usize, f64),
}

impl LayeredCache {
    /// Builds an empty cache. `cfg` is resolved and validated here
    /// ([`CachePlan::new`]).
    pub fn new(
        cfg: CacheConfig,
        spec: ModelSpec,
        backend: Arc<dyn AttentionBackend>,
    ) -> Result<Self> {
        let plan = CachePlan::new(cfg, &spec)?;
        Self::from_plan(plan, spec, backend)
    }

    /// Builds an empty cache from a plan made for `spec`.
    pub fn from_plan(
        plan: CachePlan,
        spec: ModelSpec,
        backend: Arc<dyn AttentionBackend>,
    ) -> Result<Self> {
        let CachePlan {
            config: cfg,
            selection,
            needs,
            n_store,
        } = plan;
        let mut c = Self {
            spec,
            residual: Residual::new(&cfg),
            gate: cfg.compensator.as_ref().and_then(|c| c.gate()),
            cfg,
            selection,
            backend,
            needs,
            phase: Phase::Prefill,
            layers: Vec::new(),
            budgets: Vec::new(),
            n_store,
            scratch: Vec::new(),
            comp_stats: Vec::new(),
            page_stats: PageStats::default(),
            pass: None,
            pass_stats: (0, 0.0),
        };
        c.reset_layers()?;
        Ok(c)
    }

    /// The resolved config.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// Releases every layer's prefill history held by the backend.
    fn release_histories(&mut self) {
        for l in &mut self.layers {
            if let Some(h) = l.staging.history.take() {
                self.backend.release_history(h);
            }
        }
    }

    fn reset_layers(&mut self) -> Result<()> {
        self.release_histories();
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
                    regime: None,
                    pages: Vec::new(),
                })
            })
            .collect::<Result<_>>()?;
        self.budgets.clear();
        self.comp_stats.clear();
        self.page_stats = PageStats::default();
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
            Phase::Prefill => self.prefill_attend(layer, q, n, out),
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
            plain_pass: self.needs.plain_pass,
        }
    }

    fn begin_pass(&mut self, context: std::ops::Range<usize>) -> Result<()> {
        self.start_pass(context)
    }

    fn end_pass(&mut self) -> Result<()> {
        self.finish_pass()
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

    /// Every part that measured something, side by side: page selection's reads, the
    /// reconstruction passes, the compensator's per-head statistics.
    fn diagnostics(&self) -> crate::Diagnostics {
        self.diagnostics_report()
    }

    fn reset(&mut self) -> Result<()> {
        self.reset_layers()
    }
}
