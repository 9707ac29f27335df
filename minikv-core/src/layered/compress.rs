//! The end of prefill: signals -> layer budgets -> scores -> selection ->
//! compensation -> stores. Each step is a component; this file only wires them.

use super::pages::PageHead;
use super::{Layer, LayeredCache};
use crate::compensate::{CompensateInput, Compensation};
use crate::config::HeadMode;
use crate::plan::Selection;
use crate::scoring::{LayerSignals, reduce_gqa};
use crate::select::SelectionInput;
use crate::{BudgetRequest, Error, LayerBudget, Phase, Result, check_len};

/// What one layer keeps, per storage head.
struct Plan {
    comps: Vec<Compensation>,
    scores: Option<Vec<f32>>,
}

impl LayeredCache {
    pub(super) fn compress(&mut self) -> Result<()> {
        if self.phase == Phase::Decode {
            return Err(Error::Unsupported("end_prefill called twice".into()));
        }
        let t = self.layers[0].seen;
        if self.layers.iter().any(|l| l.seen != t) {
            return Err(Error::shape(
                "end_prefill: tokens per layer",
                t,
                "differing lengths",
            ));
        }
        let Some(sel) = self.selection.clone() else {
            return self.keep_all(t);
        };
        let budgets = self.layer_budgets(&sel, t)?;
        for (layer, &budget) in budgets.iter().enumerate() {
            let plan = self.plan_layer(&sel, layer, t, budget)?;
            self.store_layer(layer, plan, budget, Some(&sel))?;
        }
        self.budgets = budgets;
        self.phase = Phase::Decode;
        Ok(())
    }

    /// Without a selection: every token of every layer to the stores.
    fn keep_all(&mut self, t: usize) -> Result<()> {
        let all: Vec<u32> = (0..t as u32).collect();
        for layer in 0..self.spec.n_layers {
            let comps = (0..self.n_store)
                .map(|_| Compensation::keep(all.clone()))
                .collect();
            let budget = LayerBudget {
                heavy: t,
                recent: 0,
            };
            let plan = Plan {
                comps,
                scores: None,
            };
            self.store_layer(layer, plan, budget, None)?;
        }
        self.phase = Phase::Decode;
        Ok(())
    }

    /// The policy's per-layer budgets, from the layer signals it asked for.
    fn layer_budgets(&self, sel: &Selection, t: usize) -> Result<Vec<LayerBudget>> {
        let spec = &self.spec;
        let (heavy, recent) = self.cfg.token_budgets(t);
        let policy = &sel.policy;
        let pw = policy.needs().query_window;
        let views: Vec<_> = self
            .layers
            .iter()
            .map(|l| {
                l.staging
                    .views(spec, l.staging.staged_queries(spec).min(pw))
            })
            .collect();
        let signals: Vec<LayerSignals<'_>> = views
            .iter()
            .enumerate()
            .map(|(i, v)| v.signals(spec, i, t))
            .collect();
        let req = BudgetRequest {
            n_layers: spec.n_layers,
            prompt_len: t,
            heavy,
            recent,
            sinks: self.cfg.sinks,
            layers: &signals,
        };
        let budgets = policy.layer_budgets(&req)?;
        check_len("policy budgets", spec.n_layers, budgets.len())?;
        Ok(budgets)
    }

    /// Scores, selection and compensation of one layer.
    fn plan_layer(
        &self,
        sel: &Selection,
        layer: usize,
        t: usize,
        budget: LayerBudget,
    ) -> Result<Plan> {
        use rayon::prelude::*;
        let spec = &self.spec;
        let (hq, hkv) = (spec.n_q_heads, spec.n_kv_heads);
        let l = &self.layers[layer];
        let scorer = &sel.scorer;
        let w = l
            .staging
            .staged_queries(spec)
            .min(scorer.needs().query_window);
        let views = l.staging.views(spec, w);
        let mut inputs = views.signals(spec, layer, t);
        inputs.budget = Some(budget.heavy);
        let mut sq = vec![0.0f32; hq * t];
        scorer.score(&inputs, &mut sq)?;
        if let Some(i) = sq.iter().position(|x| x.is_nan()) {
            return Err(Error::Input(format!(
                "scorer produced NaN at layer {layer}, index {i}"
            )));
        }
        let scores = match self.cfg.heads {
            HeadMode::PerKv => reduce_gqa(&sq, hq, hkv, t, self.cfg.gqa_reduce),
            HeadMode::PerQuery => sq,
        };
        let mut kept = Vec::new();
        sel.selector.select(
            &SelectionInput {
                scores: &scores,
                n_heads: self.n_store,
                t,
                budget,
                sinks: self.cfg.sinks,
                layer,
            },
            &mut kept,
        )?;
        check_len("selector heads", self.n_store, kept.len())?;
        for k in &kept {
            if k.windows(2).any(|w| w[0] >= w[1]) || k.last().is_some_and(|&p| p as usize >= t) {
                return Err(Error::Input(
                    "selector returned unsorted or out-of-range positions".into(),
                ));
            }
        }
        let Some(comp) = self.cfg.compensator.as_ref() else {
            let comps = kept.into_iter().map(Compensation::keep).collect();
            return Ok(Plan {
                comps,
                scores: Some(scores),
            });
        };
        let cw = l
            .staging
            .staged_queries(spec)
            .min(comp.needs().query_window);
        let g = hq / self.n_store;
        let d = spec.head_dim;
        let comps = kept
            .par_iter()
            .enumerate()
            .map(|(s, kept)| {
                let kv = self.kv_of_store(s);
                let queries = l.staging.group_queries(spec, s * g..(s + 1) * g, cw);
                let c = comp.compensate(&CompensateInput {
                    layer,
                    head: s,
                    d,
                    t,
                    keys: &l.staging.k[kv],
                    values: &l.staging.v[kv],
                    kept,
                    scores: &scores[s * t..(s + 1) * t],
                    sinks: self.cfg.sinks,
                    recent: budget.recent,
                    queries: &queries,
                    n_queries: cw * g,
                })?;
                check_compensation(&c, kept, d)?;
                Ok(c)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Plan {
            comps,
            scores: Some(scores),
        })
    }

    /// Key channels each storage head keeps, when a channel pruner is set
    /// (`kept[s]`: the prompt positions head `s` keeps).
    fn plan_channels(
        &self,
        layer: usize,
        t: usize,
        kept: &[&[u32]],
    ) -> Result<Option<Vec<Vec<u16>>>> {
        let Some(pruner) = self.cfg.channels.as_ref() else {
            return Ok(None);
        };
        let spec = &self.spec;
        let l = &self.layers[layer];
        let w = l
            .staging
            .staged_queries(spec)
            .min(pruner.needs().query_window);
        let views = l.staging.views(spec, w);
        let signals = views.signals(spec, layer, t);
        let g = spec.n_q_heads / self.n_store;
        (0..self.n_store)
            .map(|s| {
                let ch = pruner.select(&crate::ChannelInput {
                    kept: kept[s],
                    signals: &signals,
                    kv: self.kv_of_store(s),
                    q_heads: s * g..(s + 1) * g,
                })?;
                if ch.is_empty()
                    || ch.windows(2).any(|w| w[0] >= w[1])
                    || ch.last().is_some_and(|&c| c as usize >= spec.head_dim)
                {
                    return Err(Error::Input(format!(
                        "channel pruner returned an empty, unsorted or out-of-range channel list for layer {layer}, head {s}"
                    )));
                }
                Ok(ch)
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// Moves one layer's kept rows into its stores and frees its staging.
    fn store_layer(
        &mut self,
        layer: usize,
        plan: Plan,
        budget: LayerBudget,
        sel: Option<&Selection>,
    ) -> Result<()> {
        let d = self.spec.head_dim;
        let t = self.layers[layer].seen;
        let kept: Vec<&[u32]> = plan.comps.iter().map(|c| c.kept.as_slice()).collect();
        let channels = self.plan_channels(layer, t, &kept)?;
        let st = self.backend.clone();
        let st = st.storage();
        let mut kept_all = Vec::with_capacity(self.n_store);
        let mut stats = Vec::new();
        for (s, c) in plan.comps.into_iter().enumerate() {
            let kv = self.kv_of_store(s);
            let Layer { staging, heads, .. } = &mut self.layers[layer];
            let (ks, vs) = (&staging.k[kv], &staging.v[kv]);
            let n = c.kept.len();
            let mut kbuf = Vec::with_capacity(n * d);
            let mut vbuf = Vec::with_capacity(n * d);
            for &p in &c.kept {
                let p = p as usize;
                kbuf.extend_from_slice(&ks[p * d..(p + 1) * d]);
                vbuf.extend_from_slice(&vs[p * d..(p + 1) * d]);
            }
            if let Some(v) = &c.values {
                vbuf.copy_from_slice(v);
            }
            if self.cfg.rerotate_keys {
                // The i-th kept key, of prompt position p, to position i.
                let rope = staging.rope.as_ref().ok_or_else(|| {
                    Error::Unsupported(
                        "cache.rerotate_keys: the model handed over no RoPE (a model without rotary positions cannot re-rotate keys)".into(),
                    )
                })?;
                for (i, &p) in c.kept.iter().enumerate() {
                    rope.rotate(&mut kbuf[i * d..(i + 1) * d], i as i64 - p as i64);
                }
            }
            if let Some(ch) = &channels {
                heads[s].restrict_keys(&self.cfg, st, ch[s].clone(), d)?;
            }
            heads[s].load(st, &kbuf, &vbuf, d, &self.residual, c.entries)?;
            if !c.stats.is_empty() {
                stats.push(c.stats);
            }
            kept_all.push(c.kept);
        }
        if !stats.is_empty() {
            self.comp_stats.push(stats);
        }
        let start = crate::regime::RegimeStart {
            spec: &self.spec,
            layer,
            scorer: sel.map(|s| s.scorer.as_ref()),
            kept: kept_all,
            scores: plan.scores.as_deref(),
            t,
            sinks: self.cfg.sinks,
            budget,
            reduce: match self.cfg.heads {
                HeadMode::PerKv => self.cfg.gqa_reduce,
                HeadMode::PerQuery => crate::GqaReduce::Sum,
            },
        };
        let regime = self.cfg.decode.start(start)?;
        let l = &mut self.layers[layer];
        if let Some(r) = &regime {
            for (s, h) in l.heads.iter_mut().enumerate() {
                if let Some(max) = r.max_rows(s) {
                    // A bounded head never grows again: room for it at once.
                    h.reserve_fp(max.saturating_sub(h.len()));
                }
            }
        }
        l.regime = regime;
        if let Some(pc) = &self.cfg.pages {
            l.pages = l
                .heads
                .iter()
                .map(|h| {
                    let (fk, _) = h.fp();
                    let mut ph = PageHead::new(
                        pc,
                        d,
                        st.fp_store(d, pc.token_budget),
                        st.fp_store(d, pc.token_budget),
                    );
                    let mut rows = vec![0.0f32; fk.len() * d];
                    fk.to_f32(&mut rows);
                    ph.add_rows(&rows);
                    ph
                })
                .collect();
        }
        let staging = std::mem::take(&mut self.layers[layer].staging);
        if let Some(h) = staging.history {
            self.backend.release_history(h);
        }
        Ok(())
    }
}

fn check_compensation(c: &Compensation, kept: &[u32], d: usize) -> Result<()> {
    let bad = |m: String| Err(Error::Input(format!("compensator: {m}")));
    if c.kept.windows(2).any(|w| w[0] >= w[1])
        || c.kept.iter().any(|p| kept.binary_search(p).is_err())
    {
        return bad("returned kept positions that are unsorted or not in the selection".into());
    }
    let e = &c.entries;
    if e.keys.len() != e.len() * d || e.values.len() != e.len() * d {
        return bad(format!(
            "{} entries need {} key and value floats",
            e.len(),
            e.len() * d
        ));
    }
    if c.values
        .as_ref()
        .is_some_and(|v| v.len() != c.kept.len() * d)
    {
        return bad("replacement values must be [kept][d]".into());
    }
    if e.keys
        .iter()
        .chain(&e.values)
        .chain(&e.bias)
        .any(|x| !x.is_finite())
    {
        return bad("non-finite extra entries".into());
    }
    Ok(())
}
