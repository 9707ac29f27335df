//! CaM-style cache merging (Zhang et al. 2024, "CaM: Cache Merging for
//! Memory-efficient LLMs Inference"; kvpress's `CAMPress`; docs/algorithms.md
//! "CaM merge"): evicted values are folded into the kept tokens that follow
//! them instead of being dropped.
//!
//! For each evicted token `i` of a head, its merge window is the next
//! `merge_budget` kept tokens after it in position order (fewer at the end).
//! With `A` the head's scores (the scorer's attention statistic, e.g. H2O's
//! `A_cumul` or SnapKV's window attention), the merge probability is
//! `p_i = clamp(A_i / mean(A_window), 0, 1)`, and every kept value of the
//! window receives `p_i · v_i / m` (`m` = window size): the expectation of
//! CaM's Bernoulli merge, so results are deterministic. Keys are unchanged;
//! nothing extra is stored. At the end of prefill, not during decode.
//! `merge_fraction` merges only the highest-scored share of the evicted
//! tokens; `normalize` turns each kept value into the weighted mean of itself
//! (weight 1) and what it received (weights `p_i / m`).

use minikv_core::compensate::{CompensateInput, Compensation, Compensator};
use minikv_core::{Result, check_range, register};
use serde::{Deserialize, Serialize};

/// CaM merge compensator.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CamMerge {
    /// Kept neighbours each evicted value is spread over (kvpress: 32).
    pub merge_budget: usize,
    /// Share of the evicted tokens merged, highest-scored first (1 = all;
    /// CaM merges at each eviction, kvpress merges the top-scored evicted
    /// tokens of each compression).
    pub merge_fraction: f64,
    /// Divide each kept value by its total merge weight (a weighted mean of
    /// itself and what it received) instead of CaM's plain sum.
    pub normalize: bool,
}

impl Default for CamMerge {
    fn default() -> Self {
        Self {
            merge_budget: 32,
            merge_fraction: 1.0,
            normalize: false,
        }
    }
}

#[typetag::serde(name = "cam")]
impl Compensator for CamMerge {
    fn validate(&self) -> Result<()> {
        check_range(
            "cache.compensator.merge_budget",
            self.merge_budget,
            1,
            65536,
        )?;
        check_range(
            "cache.compensator.merge_fraction",
            self.merge_fraction,
            0.0,
            1.0,
        )
    }
    fn compensate(&self, inp: &CompensateInput<'_>) -> Result<Compensation> {
        let d = inp.d;
        let kept = inp.kept;
        let mut values: Vec<f32> = kept.iter().flat_map(|&p| inp.value(p).to_vec()).collect();
        let (mut merged, mut mass) = (0usize, 0.0f64);
        let mut weight = vec![1.0f32; kept.len()];
        let mut ev = inp.evicted();
        if self.merge_fraction < 1.0 {
            let k = (ev.len() as f64 * self.merge_fraction) as usize;
            // Highest-scored first, later positions first on ties (as kvpress).
            ev.sort_by(|a, b| {
                inp.scores[*b as usize]
                    .total_cmp(&inp.scores[*a as usize])
                    .then(b.cmp(a))
            });
            ev.truncate(k);
            ev.sort_unstable();
        }
        for i in ev {
            let start = kept.partition_point(|&k| k <= i);
            let end = (start + self.merge_budget).min(kept.len());
            if start == end {
                continue;
            }
            let m = end - start;
            let mean: f32 = kept[start..end]
                .iter()
                .map(|&k| inp.scores[k as usize])
                .sum::<f32>()
                / m as f32;
            let a = inp.scores[i as usize];
            let p = if mean > 0.0 && a.is_finite() {
                (a / mean).clamp(0.0, 1.0)
            } else {
                0.0
            };
            if p == 0.0 {
                continue;
            }
            let w = p / m as f32;
            let v = inp.value(i);
            for (row, wt) in values[start * d..end * d]
                .chunks_exact_mut(d)
                .zip(&mut weight[start..end])
            {
                *wt += w;
                row.iter_mut().zip(v).for_each(|(r, x)| *r += w * x);
            }
            merged += 1;
            mass += p as f64;
        }
        if self.normalize {
            for (row, wt) in values.chunks_exact_mut(d).zip(&weight) {
                row.iter_mut().for_each(|r| *r /= wt);
            }
        }
        let mut out = Compensation::keep(kept.to_vec());
        out.values = Some(values);
        out.stats = vec![("merged", merged as f64), ("merge_mass", mass)];
        Ok(out)
    }
}
register!(
    Compensator,
    "cam",
    CamMerge,
    "CaM merge: each evicted value spread over the next merge_budget kept tokens, weighted by clamp(A_i / mean A_window, 0, 1)"
);
