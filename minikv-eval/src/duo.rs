//! Calibration of a DuoAttention head split (docs/algorithms.md
//! "DuoAttention"): per (layer, KV head), the mean attention mass that the
//! last `window` queries of seeded passkey prompts put *outside* the first
//! `sinks` tokens and the last `recent` tokens. Heads that read far back are
//! retrieval heads; heads whose attention stays on sinks and recent tokens can
//! stream. The prompts run through a full cache; a recording wrapper keeps
//! the keys and the last queries of each layer.

use crate::{PasskeySpec, passkey_prompt};
use minikv_core::{
    KvCache, LayerBudget, MemoryReport, ModelSpec, ModelWants, Observation, Phase, Result, simd,
};
use minikv_models::{LanguageModel, Logits, Tokenizer, Workspace};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::Serialize;

/// What is measured.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct DuoCalibration {
    /// Prompts, context, seed.
    pub prompts: PasskeySpec,
    /// Leading tokens a streaming head keeps.
    pub sinks: usize,
    /// Recent tokens a streaming head keeps.
    pub recent: usize,
    /// Final prompt queries whose attention is measured.
    pub window: usize,
}

/// A full cache that also keeps every key (and value), the last queries and,
/// when asked, the output projection of each layer.
#[derive(Debug)]
pub(crate) struct Recording {
    pub(crate) inner: Box<dyn KvCache>,
    pub(crate) keys: Vec<Vec<f32>>,
    pub(crate) values: Option<Vec<Vec<f32>>>,
    pub(crate) queries: Vec<Vec<f32>>,
    pub(crate) window: usize,
    /// `Some`: ask the model for each layer's output projection `W_o`
    /// (`[hidden][Hq * d]`) and keep it here.
    pub(crate) wo: Option<Vec<Vec<f32>>>,
}

impl Recording {
    /// Keys and the last `window` queries of each of `layers` layers.
    pub(crate) fn new(inner: Box<dyn KvCache>, layers: usize, window: usize) -> Self {
        Self {
            inner,
            keys: vec![Vec::new(); layers],
            values: None,
            queries: vec![Vec::new(); layers],
            window,
            wo: None,
        }
    }
    /// Also the values and the output projection.
    pub(crate) fn with_values_and_wo(mut self) -> Self {
        let l = self.keys.len();
        self.values = Some(vec![Vec::new(); l]);
        self.wo = Some(vec![Vec::new(); l]);
        self
    }
}

impl KvCache for Recording {
    fn spec(&self) -> &ModelSpec {
        self.inner.spec()
    }
    fn phase(&self) -> Phase {
        self.inner.phase()
    }
    fn seq_len(&self, layer: usize) -> usize {
        self.inner.seq_len(layer)
    }
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32], n: usize) -> Result<()> {
        self.keys[layer].extend_from_slice(k);
        if let Some(vs) = &mut self.values {
            vs[layer].extend_from_slice(v);
        }
        self.inner.append(layer, k, v, n)
    }
    fn attend(&mut self, layer: usize, q: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        let row = q.len() / n.max(1);
        let w = &mut self.queries[layer];
        w.extend_from_slice(q);
        if w.len() > self.window * row {
            w.drain(..w.len() - self.window * row);
        }
        self.inner.attend(layer, q, n, out)
    }
    fn end_prefill(&mut self) -> Result<()> {
        self.inner.end_prefill()
    }
    fn memory(&self) -> MemoryReport {
        self.inner.memory()
    }
    fn budgets(&self) -> Vec<LayerBudget> {
        self.inner.budgets()
    }
    fn reset(&mut self) -> Result<()> {
        self.inner.reset()?;
        self.keys.iter_mut().for_each(Vec::clear);
        self.queries.iter_mut().for_each(Vec::clear);
        if let Some(vs) = &mut self.values {
            vs.iter_mut().for_each(Vec::clear);
        }
        Ok(())
    }
    fn wants(&self, layer: usize) -> ModelWants {
        let mut w = self.inner.wants(layer);
        w.output_projection |= self.wo.is_some();
        w
    }
    fn observe(&mut self, layer: usize, obs: Observation<'_>) -> Result<()> {
        if let (Some(wo), Observation::OutputProjection { w, .. }) = (&mut self.wo, obs)
            && wo[layer].is_empty()
        {
            wo[layer].extend_from_slice(w);
        }
        self.inner.observe(layer, obs)
    }
}

/// Per (layer, KV head) scores, averaged over the prompts.
pub fn calibrate_duo(
    model: &dyn LanguageModel,
    tok: &Tokenizer,
    haystack: &[u32],
    cal: DuoCalibration,
    full_cache: impl Fn() -> Result<Box<dyn KvCache>>,
) -> Result<Vec<Vec<f32>>> {
    let spec = model.spec();
    let (l, hq, hkv, d) = (
        spec.n_layers,
        spec.n_q_heads,
        spec.n_kv_heads,
        spec.head_dim,
    );
    let g = hq / hkv;
    let mut acc = vec![vec![0.0f64; hkv]; l];
    let mut rng = StdRng::seed_from_u64(cal.prompts.seed);
    let mut ws = Workspace::default();
    for _ in 0..cal.prompts.trials {
        let depth = cal
            .prompts
            .depth
            .unwrap_or_else(|| rng.random_range(0.0..1.0));
        let (ids, _) = passkey_prompt(tok, haystack, cal.prompts.context, depth, &mut rng)?;
        let mut c = Recording::new(full_cache()?, l, cal.window);
        model.forward(&ids, &mut c, &mut ws, Logits::None)?;
        let t = ids.len();
        let w = c.queries[0].len() / (hq * d);
        let inv = 1.0 / (d as f32).sqrt();
        let mut s = vec![0.0f32; t];
        for (layer, acc) in acc.iter_mut().enumerate() {
            let (k, q) = (&c.keys[layer], &c.queries[layer]);
            for h in 0..hq {
                let kv = h / g;
                let mut mass = 0.0f64;
                for i in 0..w {
                    let pos = t - w + i;
                    let qi = &q[(i * hq + h) * d..(i * hq + h + 1) * d];
                    for (j, sj) in s[..=pos].iter_mut().enumerate() {
                        *sj = simd::dot(qi, &k[(j * hkv + kv) * d..(j * hkv + kv + 1) * d]) * inv;
                    }
                    simd::softmax_inplace(&mut s[..=pos]);
                    let lo = cal.sinks.min(pos + 1);
                    let hi = (pos + 1).saturating_sub(cal.recent).max(lo);
                    mass += s[lo..hi].iter().map(|&x| x as f64).sum::<f64>();
                }
                acc[kv] += mass / (w.max(1) * g) as f64;
            }
        }
    }
    let n = cal.prompts.trials.max(1) as f64;
    Ok(acc
        .into_iter()
        .map(|hs| hs.into_iter().map(|x| (x / n) as f32).collect())
        .collect())
}
