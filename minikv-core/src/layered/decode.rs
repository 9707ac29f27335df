//! One decode step of a layer: append the token's K/V to every storage head
//! (and Quest's page bounds, and the evictor's positions), then attend over
//! the stored rows (Quest's selected pages where configured) and let the
//! residual rule and the decode-time evictor act.

use super::LayeredCache;
use super::evict::EvictParams;
use crate::Result;
use crate::attention::{DecodeArgs, HeadView};
use smallvec::SmallVec;

impl LayeredCache {
    pub(super) fn decode_append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
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
            ev.push(l.seen as u32);
        }
        l.seen += 1;
        Ok(())
    }

    pub(super) fn decode_attend(&mut self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<()> {
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
