//! What the cache reports: memory (the sum of each part's own accounting)
//! and the compensator's statistics.

use super::LayeredCache;
use super::evict::Evictor;
use crate::cache::{LayerMemory, MemoryReport};

impl LayeredCache {
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
                        if let Some(ev) = &l.evict {
                            let (alloc, used) = ev.head_bytes(s);
                            m.indices = alloc;
                            m.used += used;
                        }
                        if let Some(qh) = l.quest.get(s) {
                            m.indices += qh.bytes().0;
                            m.used += qh.bound_bytes_used();
                        }
                        m
                    })
                    .collect();
                LayerMemory {
                    heads,
                    staging: l.staging.bytes(),
                    work: l.evict.as_ref().map_or(0, Evictor::work_bytes)
                        + l.quest.iter().map(|q| q.bytes().1).sum::<usize>(),
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
    pub(super) fn compensator_diagnostics(&self) -> serde_json::Value {
        let Some(comp) = &self.cfg.compensator else {
            return serde_json::Value::Null;
        };
        if self.comp_stats.is_empty() {
            return serde_json::Value::Null;
        }
        let avg = |rows: &[&Vec<(&'static str, f64)>]| {
            let mut m = serde_json::Map::new();
            if let Some(first) = rows.first() {
                for (i, (k, _)) in first.iter().enumerate() {
                    let s: f64 = rows.iter().map(|r| r[i].1).sum();
                    m.insert((*k).into(), (s / rows.len() as f64).into());
                }
            }
            serde_json::Value::Object(m)
        };
        let per_layer: Vec<_> = self
            .comp_stats
            .iter()
            .map(|l| avg(&l.iter().collect::<Vec<_>>()))
            .collect();
        let all: Vec<_> = self.comp_stats.iter().flatten().collect();
        serde_json::json!({ comp.typetag_name(): {
            "mean": avg(&all),
            "per_layer": per_layer,
        }})
    }
}
