//! One decode step of a layer: append the token's K/V to every storage head
//! (and the page summaries, and the regime's positions), then attend over
//! the stored rows (the selected pages where configured) and let the
//! residual rule and the decode regime act.

use super::LayeredCache;
use crate::Result;
use crate::attention::{DecodeArgs, HeadView};
use crate::regime::{RegimeStep, StoredHeads};
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
        for (s, ph) in l.pages.iter_mut().enumerate() {
            let kv = s * hkv / n_store;
            ph.add_rows(&k[kv * d..(kv + 1) * d]);
        }
        if let Some(r) = l.regime.as_mut() {
            r.push(l.seen as u32);
        }
        l.seen += 1;
        Ok(())
    }

    pub(super) fn decode_attend(&mut self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<()> {
        let l = &mut self.layers[layer];
        let gate = self.gate.as_deref();
        if let Some(pc) = &self.cfg.pages {
            let (d, g) = (self.spec.head_dim, self.spec.n_q_heads / self.n_store);
            for (s, ph) in l.pages.iter_mut().enumerate() {
                let read = ph.select(&l.heads[s], &q[s * g * d..(s + 1) * g * d], pc.token_budget);
                self.page_stats.bytes_read += read as u64;
                self.page_stats.bytes_all += ph.held_bytes() as u64;
            }
            if layer == 0 {
                self.page_stats.steps += 1;
            }
        }
        {
            let views: SmallVec<[HeadView<'_>; 16]> = l
                .heads
                .iter()
                .enumerate()
                .map(|(s, h)| {
                    let mut v = h.view(gate);
                    if let Some(ph) = l.pages.get(s).filter(|ph| ph.selected) {
                        v.fp_keys = ph.sel_k.as_ref();
                        v.fp_values = ph.sel_v.as_ref();
                    }
                    v
                })
                .collect();
            self.backend.decode(DecodeArgs {
                q,
                heads: &views,
                head_dim: self.spec.head_dim,
                out,
                probs: l.regime.as_mut().and_then(|r| r.probs()),
            })?;
        }
        for h in &mut l.heads {
            h.after_attend(&self.residual, &mut self.scratch)?;
        }
        if let Some(r) = l.regime.as_mut() {
            let step = RegimeStep {
                spec: &self.spec,
                layer,
                seen: l.seen,
                query: q,
            };
            r.step(
                &mut StoredHeads {
                    heads: &mut l.heads,
                },
                &step,
            )?;
        }
        Ok(())
    }
}
