//! Caches for models that mix sliding-window and global attention layers
//! (Gemma 3: five local layers of window 512 for every global one).
//!
//! A sliding-window layer never needs more than its last `w` tokens, so it is
//! kept as a **ring** of `w` fp16 rows per KV head: its memory is bounded by
//! construction and no compression method touches it. The global layers form
//! one [`LayeredCache`] built from the config over a spec holding only them:
//! every method (selection, quantization, budgets, decode-time eviction)
//! applies to the global layers, and layer budget policies apportion over
//! the layers they govern. [`KvCache::memory`] reports both kinds, each layer
//! with its window.

use crate::attention::{
    AttentionBackend, DecodeArgs, HeadView, PrefillArgs, to_head_major, to_token_major,
};
use crate::cache::{KvCache, LayerMemory, MemoryReport, ModelWants, Observation, Phase};
use crate::config::CacheConfig;
use crate::layered::LayeredCache;
use crate::storage::FpStore;
use crate::{Error, HeadMemory, LayerBudget, ModelSpec, Result, check_finite, check_len};
use smallvec::SmallVec;
use std::sync::Arc;

/// Rows per page of a ring's fp16 stores.
const RING_PAGE: usize = 64;

/// Where a model layer lives.
#[derive(Debug, Clone, Copy)]
enum Slot {
    /// Index into the global cache's layers.
    Global(usize),
    /// Index into the rings.
    Ring(usize),
}

/// One sliding-window layer.
#[derive(Debug)]
struct Ring {
    window: usize,
    /// Head dimension.
    d: usize,
    seen: usize,
    /// Prefill: per KV head the last rows `[rows][d]` in f32 (at most
    /// `window - 1` before a chunk, plus the chunk).
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// Decode: per KV head the last `window` rows in fp16, in ring order.
    keys: Vec<Box<dyn FpStore>>,
    values: Vec<Box<dyn FpStore>>,
    /// The ring slot the next decode token overwrites (once full).
    next: usize,
    /// Rows held when a reconstruction pass began (its tokens are dropped
    /// at its end); no trimming happens during a pass.
    pass_rows: Option<usize>,
}

impl Ring {
    fn rows(&self) -> usize {
        self.k.first().map_or(0, |k| k.len()) / self.d
    }
}

/// A cache whose sliding-window layers are rings and whose global layers are
/// a [`LayeredCache`] built from the config (see the module docs).
#[derive(Debug)]
pub struct HybridCache {
    spec: ModelSpec,
    global: Option<LayeredCache>,
    slots: Vec<Slot>,
    rings: Vec<Ring>,
    backend: Arc<dyn AttentionBackend>,
    phase: Phase,
}

impl HybridCache {
    /// Builds an empty cache for `spec` (which should have windowed layers).
    pub fn new(
        cfg: CacheConfig,
        spec: ModelSpec,
        backend: Arc<dyn AttentionBackend>,
    ) -> Result<Self> {
        spec.validate()?;
        let globals = spec.global_layers();
        let global = if globals.is_empty() {
            let mut cfg = cfg;
            cfg.resolve()?;
            if !cfg.is_full() {
                return Err(Error::config(
                    "cache",
                    "every layer of this model attends through a sliding window: there is no global layer to compress",
                ));
            }
            None
        } else {
            let sub = ModelSpec {
                n_layers: globals.len(),
                windows: Vec::new(),
                ..spec
            };
            Some(LayeredCache::new(cfg, sub, backend.clone())?)
        };
        let (mut gi, mut ri) = (0, 0);
        let slots = (0..spec.n_layers)
            .map(|l| match spec.window(l) {
                None => {
                    gi += 1;
                    Slot::Global(gi - 1)
                }
                Some(_) => {
                    ri += 1;
                    Slot::Ring(ri - 1)
                }
            })
            .collect();
        let mut c = Self {
            spec,
            global,
            slots,
            rings: Vec::new(),
            backend,
            phase: Phase::Prefill,
        };
        c.reset_rings();
        Ok(c)
    }

    /// The cache of the global layers (`None` when every layer is windowed).
    pub fn global(&self) -> Option<&LayeredCache> {
        self.global.as_ref()
    }

    fn reset_rings(&mut self) {
        let (hkv, d) = (self.spec.n_kv_heads, self.spec.head_dim);
        let st = self.backend.storage();
        self.rings = (0..self.spec.n_layers)
            .filter_map(|l| self.spec.window(l))
            .map(|window| Ring {
                window,
                d,
                seen: 0,
                k: vec![Vec::new(); hkv],
                v: vec![Vec::new(); hkv],
                keys: (0..hkv).map(|_| st.fp_store(d, RING_PAGE)).collect(),
                values: (0..hkv).map(|_| st.fp_store(d, RING_PAGE)).collect(),
                next: 0,
                pass_rows: None,
            })
            .collect();
        self.phase = Phase::Prefill;
    }

    fn slot(&self, layer: usize) -> Result<Slot> {
        self.slots
            .get(layer)
            .copied()
            .ok_or_else(|| Error::shape("layer index", format!("< {}", self.spec.n_layers), layer))
    }

    fn global_mut(&mut self) -> &mut LayeredCache {
        self.global
            .as_mut()
            .expect("a global slot implies a global cache")
    }

    fn ring_append(&mut self, r: usize, k: &[f32], v: &[f32], n: usize) -> Result<()> {
        let (hkv, d) = (self.spec.n_kv_heads, self.spec.head_dim);
        let ring = &mut self.rings[r];
        match self.phase {
            Phase::Prefill => {
                // Rows older than the window of the first new query go first
                // (never during a pass: its tokens are dropped at its end).
                let keep = ring.window - 1;
                let rows = ring.rows();
                if ring.pass_rows.is_none() && rows > keep {
                    for h in 0..hkv {
                        ring.k[h].drain(..(rows - keep) * d);
                        ring.v[h].drain(..(rows - keep) * d);
                    }
                }
                crate::layered::staging::append_per_head(&mut ring.k, &mut ring.v, k, v, n, d);
            }
            Phase::Decode => {
                // Until full, rows are pushed (the oldest stays at slot 0);
                // then the oldest slot, `next`, is overwritten.
                let full = ring.keys[0].len() == ring.window;
                for h in 0..hkv {
                    let src = h * d..(h + 1) * d;
                    if full {
                        ring.keys[h].replace(ring.next, &k[src.clone()]);
                        ring.values[h].replace(ring.next, &v[src]);
                    } else {
                        ring.keys[h].push(&k[src.clone()]);
                        ring.values[h].push(&v[src]);
                    }
                }
                if full {
                    ring.next = (ring.next + 1) % ring.window;
                }
            }
        }
        ring.seen += n;
        Ok(())
    }

    fn ring_attend(&mut self, r: usize, q: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        let (hq, d) = (self.spec.n_q_heads, self.spec.head_dim);
        let ring = &self.rings[r];
        match self.phase {
            Phase::Prefill => {
                let t = ring.rows();
                if n > t {
                    return Err(Error::shape(
                        "queries vs appended tokens",
                        format!("<= {t}"),
                        n,
                    ));
                }
                let mut qh = vec![0.0f32; hq * n * d];
                to_head_major(q, n, hq, d, &mut qh);
                let mut oh = vec![0.0f32; hq * n * d];
                let keys: Vec<&[f32]> = ring.k.iter().map(|x| x.as_slice()).collect();
                let values: Vec<&[f32]> = ring.v.iter().map(|x| x.as_slice()).collect();
                self.backend.prefill(PrefillArgs {
                    n_q_heads: hq,
                    head_dim: d,
                    q: &qh,
                    n,
                    keys: &keys,
                    values: &values,
                    t,
                    out: &mut oh,
                    cumulative: None,
                    window: Some(ring.window),
                    history: None,
                })?;
                to_token_major(&oh, n, hq, d, out);
                Ok(())
            }
            Phase::Decode => {
                let views: SmallVec<[HeadView<'_>; 8]> = ring
                    .keys
                    .iter()
                    .zip(&ring.values)
                    .map(|(k, v)| HeadView {
                        quant_keys: None,
                        quant_values: None,
                        fp_keys: k.as_ref(),
                        fp_values: v.as_ref(),
                        extra: None,
                    })
                    .collect();
                self.backend.decode(DecodeArgs {
                    q,
                    heads: &views,
                    head_dim: d,
                    out,
                    probs: None,
                })
            }
        }
    }

    /// Moves each ring's last `window` prompt rows into its fp16 stores.
    fn seal_rings(&mut self) {
        let d = self.spec.head_dim;
        for ring in &mut self.rings {
            let rows = ring.rows();
            let from = rows.saturating_sub(ring.window);
            for h in 0..ring.k.len() {
                ring.keys[h].reserve_exact(ring.window);
                ring.values[h].reserve_exact(ring.window);
                ring.keys[h].push(&ring.k[h][from * d..]);
                ring.values[h].push(&ring.v[h][from * d..]);
                ring.k[h] = Vec::new();
                ring.v[h] = Vec::new();
            }
            ring.next = 0;
        }
    }

    fn ring_memory(&self, ring: &Ring) -> LayerMemory {
        let heads = ring
            .keys
            .iter()
            .zip(&ring.values)
            .map(|(k, v)| HeadMemory {
                tokens: k.len(),
                fp: k.bytes() + v.bytes(),
                used: k.used_bytes() + v.used_bytes(),
                ..Default::default()
            })
            .collect();
        LayerMemory {
            heads,
            staging: 4 * ring
                .k
                .iter()
                .chain(&ring.v)
                .map(Vec::capacity)
                .sum::<usize>(),
            work: 0,
            window: Some(ring.window),
        }
    }
}

impl KvCache for HybridCache {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn phase(&self) -> Phase {
        self.phase
    }

    fn seq_len(&self, layer: usize) -> usize {
        match self.slots.get(layer) {
            Some(Slot::Global(g)) => self.global.as_ref().map_or(0, |c| c.seq_len(*g)),
            Some(Slot::Ring(r)) => self.rings[*r].seen,
            None => 0,
        }
    }

    fn append(&mut self, layer: usize, k: &[f32], v: &[f32], n: usize) -> Result<()> {
        match self.slot(layer)? {
            Slot::Global(g) => self.global_mut().append(g, k, v, n),
            Slot::Ring(r) => {
                let kd = self.spec.n_kv_heads * self.spec.head_dim;
                check_len("append keys", n * kd, k.len())?;
                check_len("append values", n * kd, v.len())?;
                check_finite("append keys", k)?;
                check_finite("append values", v)?;
                let seen = self.rings[r].seen;
                if seen + n > self.spec.max_seq_len {
                    return Err(Error::ContextOverflow {
                        len: seen + n,
                        max: self.spec.max_seq_len,
                    });
                }
                if self.phase == Phase::Decode && n != 1 {
                    return Err(Error::Unsupported(format!(
                        "appending {n} tokens at once after compression: decode appends one token per step"
                    )));
                }
                self.ring_append(r, k, v, n)
            }
        }
    }

    fn attend(&mut self, layer: usize, q: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        match self.slot(layer)? {
            Slot::Global(g) => self.global_mut().attend(g, q, n, out),
            Slot::Ring(r) => {
                let row = self.spec.n_q_heads * self.spec.head_dim;
                check_len("attend queries", n * row, q.len())?;
                check_len("attend output", n * row, out.len())?;
                if self.phase == Phase::Decode && n != 1 {
                    return Err(Error::Unsupported(
                        "decode attends one query per head".into(),
                    ));
                }
                self.ring_attend(r, q, n, out)
            }
        }
    }

    fn end_prefill(&mut self) -> Result<()> {
        if self.phase != Phase::Prefill {
            return Err(Error::Unsupported("end_prefill called twice".into()));
        }
        if let Some(g) = self.global.as_mut() {
            g.end_prefill()?;
        }
        self.seal_rings();
        self.phase = Phase::Decode;
        Ok(())
    }

    fn memory(&self) -> MemoryReport {
        let global = self.global.as_ref().map(KvCache::memory);
        let layers = self
            .slots
            .iter()
            .map(|s| match s {
                Slot::Global(g) => {
                    let mut m = global.as_ref().expect("global layers").layers[*g].clone();
                    m.window = None;
                    m
                }
                Slot::Ring(r) => self.ring_memory(&self.rings[*r]),
            })
            .collect();
        let seq_len = self.seq_len(0);
        MemoryReport {
            layers,
            seq_len,
            full_fp16_bytes: self.spec.full_fp16_bytes(seq_len),
            work: global.map_or(0, |g| g.work),
        }
    }

    /// Per model layer: the global layers' budgets, and for a windowed layer
    /// its window as a recent-only budget (empty before compression).
    /// The global layers' projection plus the rings: each reserves its
    /// whole window of fp16 rows when prefill ends.
    fn projected_kv_bytes(&self, prompt: usize, max_new: usize) -> Result<usize> {
        let global = match &self.global {
            Some(g) => g.projected_kv_bytes(prompt, max_new)?,
            None => 0,
        };
        let (hkv, d) = (self.spec.n_kv_heads, self.spec.head_dim);
        let rings: usize = self
            .rings
            .iter()
            .map(|r| {
                // `seal_rings` reserves `window` rows; a longer sequence
                // overwrites them in place.
                let rows = r
                    .window
                    .max((prompt + max_new).min(r.window).div_ceil(RING_PAGE) * RING_PAGE);
                hkv * 2 * 2 * rows * d
            })
            .sum();
        Ok(global + rings)
    }

    fn budgets(&self) -> Vec<LayerBudget> {
        let Some(g) = &self.global else {
            return Vec::new();
        };
        let gb = g.budgets();
        if gb.is_empty() {
            return gb;
        }
        self.slots
            .iter()
            .map(|s| match s {
                Slot::Global(i) => gb[*i],
                Slot::Ring(r) => LayerBudget {
                    heavy: 0,
                    recent: self.rings[*r].window,
                },
            })
            .collect()
    }

    fn reset(&mut self) -> Result<()> {
        if let Some(g) = self.global.as_mut() {
            g.reset()?;
        }
        self.reset_rings();
        Ok(())
    }

    fn diagnostics(&self) -> crate::Diagnostics {
        self.global
            .as_ref()
            .map_or_else(crate::Diagnostics::new, |g| g.diagnostics())
    }

    fn wants(&self, layer: usize) -> ModelWants {
        match (self.slots.get(layer), &self.global) {
            (Some(Slot::Global(g)), Some(c)) => c.wants(*g),
            // Passes are the driver's business: they run when the global
            // layers ask, whichever layer the driver asks about.
            (_, Some(c)) => ModelWants {
                reconstruction: c.wants(0).reconstruction,
                plain_pass: c.wants(0).plain_pass,
                ..ModelWants::default()
            },
            _ => ModelWants::default(),
        }
    }

    fn observe(&mut self, layer: usize, obs: Observation<'_>) -> Result<()> {
        match self.slot(layer)? {
            Slot::Global(g) => self.global_mut().observe(g, obs),
            Slot::Ring(_) => Ok(()),
        }
    }

    fn begin_pass(&mut self, context: std::ops::Range<usize>) -> Result<()> {
        let Some(g) = self.global.as_mut() else {
            return Err(Error::Unsupported(
                "no component of this cache asked for a reconstruction pass".into(),
            ));
        };
        g.begin_pass(context)?;
        for ring in &mut self.rings {
            ring.pass_rows = Some(ring.rows());
        }
        Ok(())
    }

    fn end_pass(&mut self) -> Result<()> {
        let Some(g) = self.global.as_mut() else {
            return Err(Error::Unsupported("end_pass without begin_pass".into()));
        };
        g.end_pass()?;
        let d = self.spec.head_dim;
        for ring in &mut self.rings {
            if let Some(rows) = ring.pass_rows.take() {
                let added = ring.rows() - rows;
                for h in 0..ring.k.len() {
                    ring.k[h].truncate(rows * d);
                    ring.v[h].truncate(rows * d);
                }
                ring.seen -= added;
            }
        }
        Ok(())
    }
}
