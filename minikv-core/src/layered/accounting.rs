//! What the cache reports: memory (the sum of each part's own accounting)
//! and the compensator's statistics.

use super::LayeredCache;
use crate::cache::{LayerMemory, MemoryReport};

impl LayeredCache {
    /// [`crate::KvCache::projected_kv_bytes`]: per storage head, a twin store
    /// built from the same config and storage is loaded with the head's mean
    /// kept count and decodes `max_new` tokens (so quantization groups,
    /// residual flushes and page growth are the real store's); its peak
    /// bytes times the heads, plus what the decode regime and page selection index. Per-layer
    /// and per-head budgets redistribute a conserved total, and loaded stores
    /// are trimmed to fit, so the mean head stands for the ragged ones.
    pub(super) fn projected_bytes(&self, prompt: usize, max_new: usize) -> crate::Result<usize> {
        use super::store::HeadStore;
        let (d, heads) = (self.spec.head_dim, self.spec.n_layers * self.n_store);
        let cfg = &self.cfg;
        let (heavy, recent) = cfg.token_budgets(prompt);
        let budget = cfg.sinks + heavy + recent;
        let kept = match &cfg.scorer {
            None => prompt,
            Some(_) => prompt.min(budget),
        };
        // The decode regime says how far a head grows (a frozen selection:
        // by every decoded token; eviction: to its cap plus the rows that
        // arrive between evictions).
        let growth = cfg.decode.growth(&crate::regime::GrowthQuery {
            prompt,
            kept,
            sinks: cfg.sinks,
            heavy,
            recent,
            max_new,
            max_seq: self.spec.max_seq_len,
        });
        let (steps, cap) = (growth.steps, growth.rows);
        let st = self.backend.storage();
        let mut twin = HeadStore::new(cfg, st, d)?;
        let zeros = vec![0.0f32; kept * d];
        twin.load(st, &zeros, &zeros, d, &self.residual, Default::default())?;
        if growth.bounded {
            // As compression does: room for the most rows at once.
            twin.reserve_fp(cap.saturating_sub(kept));
        }
        let mut peak = twin.memory().total();
        let (row, mut scratch) = (vec![0.0f32; d], Vec::new());
        for _ in 0..steps {
            twin.push(&row, &row, &self.residual, &mut scratch)?;
            twin.after_attend(&self.residual, &mut scratch)?;
            peak = peak.max(twin.memory().total());
        }
        let mut per_head = peak + growth.index_bytes;
        if cfg.channels.as_ref().is_some_and(|c| !c.prune_appended()) {
            // Pruned prompt keys in a store of their own beside the
            // full-width one decoded keys go to (`SplitKeys`): at most the
            // kept rows at full width, plus the channel list.
            per_head += kept * 2 * d + 2 * d;
        }
        if cfg.compensator.is_some() {
            // Extra entries take part of the budget: at most one per kept
            // token, fp16 key and value and an f32 bias each.
            per_head += kept * (4 * d + 4);
        }
        if let Some(p) = &cfg.pages {
            // Per page, the f32 summary of its keys (grown by doubling).
            per_head += 2 * (cap.div_ceil(p.page_size.max(1)) + 1) * 4 * p.score.summary_len(d);
        }
        Ok(heads * per_head)
    }

    /// The sum of each part's own accounting.
    pub(super) fn memory_report(&self) -> MemoryReport {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let heads = l
                    .heads
                    .iter()
                    .enumerate()
                    .map(|(s, h)| {
                        let mut m = h.memory();
                        if let Some(r) = &l.regime {
                            let (alloc, used) = r.head_bytes(s);
                            m.indices = alloc;
                            m.used += used;
                        }
                        if let Some(ph) = l.pages.get(s) {
                            m.indices += ph.bytes().0;
                            m.used += ph.summary_bytes_used();
                        }
                        m
                    })
                    .collect();
                LayerMemory {
                    heads,
                    staging: l.staging.bytes(),
                    work: l.regime.as_ref().map_or(0, |r| r.work_bytes())
                        + l.pages.iter().map(|p| p.bytes().1).sum::<usize>(),
                    window: None,
                }
            })
            .collect();
        let seq_len = self.layers.first().map_or(0, |l| l.seen);
        MemoryReport {
            layers,
            seq_len,
            full_fp16_bytes: self.spec.full_fp16_bytes(seq_len),
            work: 4 * self.scratch.capacity(),
        }
    }

    /// The compensator's per-head statistics averaged per layer and overall.
    pub(super) fn compensator_diagnostics(&self) -> Option<(String, crate::Stats)> {
        let comp = self.cfg.compensator.as_ref()?;
        if self.comp_stats.is_empty() {
            return None;
        }
        let avg = |rows: &[&Vec<(&'static str, f64)>]| {
            let mut m = std::collections::BTreeMap::new();
            if let Some(first) = rows.first() {
                for (i, (k, _)) in first.iter().enumerate() {
                    let s: f64 = rows.iter().map(|r| r[i].1).sum();
                    m.insert((*k).to_string(), s / rows.len() as f64);
                }
            }
            m
        };
        let per_layer: Vec<_> = self
            .comp_stats
            .iter()
            .map(|l| avg(&l.iter().collect::<Vec<_>>()))
            .collect();
        let all: Vec<_> = self.comp_stats.iter().flatten().collect();
        let stats = crate::Stats {
            values: avg(&all),
            per_layer,
        };
        Some((comp.typetag_name().to_string(), stats))
    }
    /// Page selection: bytes read per decoded token (all layers) next to
    /// bytes held.
    fn page_diagnostics(&self) -> crate::Stats {
        let q = &self.page_stats;
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

    /// Every part that measured something, side by side.
    pub(super) fn diagnostics_report(&self) -> crate::Diagnostics {
        // Every part that measured something, side by side.
        let mut d = crate::Diagnostics::new();
        if let Some(p) = &self.cfg.pages {
            // Under the page score's name (`quest_read_fraction`).
            d.insert(p.score.typetag_name().into(), self.page_diagnostics());
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
}
