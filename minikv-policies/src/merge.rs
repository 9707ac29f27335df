//! Merge-on-evict by key similarity (kvpress's `MergingPress`, after Token
//! Merging and D2O): each evicted token's value is folded into the kept token
//! whose key is most cosine-similar, instead of being dropped.
//!
//! Per head, evicted token `i` finds its target `t(i)` = the kept token of
//! highest `s_i = cos(k_i, k_t)` (keys divided by `max(‖k‖, 1e-6)`). It merges
//! when `s_i ≥ similarity_threshold` and, with `merge_fraction < 1`, when
//! `s_i` is at least the `1 - merge_fraction` quantile (linear interpolation)
//! of the similarities, failed ones counted as `-inf`. Its weight is
//! `w_i = max(s_i, 0) · ‖v_i‖ / (‖v_i‖ + ‖v_t‖ + 1e-6)`; a kept value that
//! received anything becomes `(v_t + Σ w_i v_i) / (1 + Σ w_i)`. Keys are
//! unchanged (RoPE-safe) and nothing extra is stored.

use minikv_core::compensate::{CompensateInput, Compensation, Compensator};
use minikv_core::{Result, check_range, register, simd};
use serde::{Deserialize, Serialize};

/// Similarity merge compensator (kvpress defaults).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimilarityMerge {
    /// Minimum cosine similarity for a merge (0).
    pub similarity_threshold: f32,
    /// Share of the evicted tokens merged, most similar first (1).
    pub merge_fraction: f64,
}

impl Default for SimilarityMerge {
    fn default() -> Self {
        Self {
            similarity_threshold: 0.0,
            merge_fraction: 1.0,
        }
    }
}

const EPS: f32 = 1e-6;

/// torch's `quantile` (linear interpolation) of `x` at `q`.
fn quantile(x: &[f32], q: f64) -> f32 {
    let mut v = x.to_vec();
    v.sort_by(f32::total_cmp);
    let pos = q * (v.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = (lo + 1).min(v.len() - 1);
    let f = (pos - lo as f64) as f32;
    v[lo] + (v[hi] - v[lo]) * f
}

#[typetag::serde(name = "merge_similar")]
impl Compensator for SimilarityMerge {
    fn validate(&self) -> Result<()> {
        check_range(
            "cache.compensator.similarity_threshold",
            self.similarity_threshold,
            0.0,
            1.0,
        )?;
        if !(self.merge_fraction > 0.0 && self.merge_fraction <= 1.0) {
            return Err(minikv_core::Error::config(
                "cache.compensator.merge_fraction",
                format!("must be in (0, 1], got {}", self.merge_fraction),
            ));
        }
        Ok(())
    }
    fn compensate(&self, inp: &CompensateInput<'_>) -> Result<Compensation> {
        let d = inp.d;
        let kept = inp.kept;
        let ev = inp.evicted();
        let mut out = Compensation::keep(kept.to_vec());
        if ev.is_empty() || kept.is_empty() {
            out.stats = vec![("merged", 0.0)];
            return Ok(out);
        }
        let unit = |p: u32| {
            let k = inp.key(p);
            let n = simd::dot(k, k).sqrt().max(EPS);
            k.iter().map(|x| x / n).collect::<Vec<f32>>()
        };
        let kept_units: Vec<Vec<f32>> = kept.iter().map(|&p| unit(p)).collect();
        let (mut sim, mut target) = (Vec::with_capacity(ev.len()), Vec::with_capacity(ev.len()));
        for &i in &ev {
            let u = unit(i);
            let (mut best, mut at) = (f32::NEG_INFINITY, 0usize);
            for (j, kj) in kept_units.iter().enumerate() {
                let s = simd::dot(&u, kj);
                if s > best {
                    best = s;
                    at = j;
                }
            }
            sim.push(best);
            target.push(at);
        }
        let mut ok: Vec<bool> = sim
            .iter()
            .map(|&s| s >= self.similarity_threshold)
            .collect();
        if self.merge_fraction < 1.0 && ok.iter().any(|&o| o) {
            let gated: Vec<f32> = sim
                .iter()
                .zip(&ok)
                .map(|(&s, &o)| if o { s } else { f32::NEG_INFINITY })
                .collect();
            let th = quantile(&gated, 1.0 - self.merge_fraction);
            ok.iter_mut()
                .zip(&sim)
                .for_each(|(o, &s)| *o = *o && s >= th);
        }
        let norm = |v: &[f32]| simd::dot(v, v).sqrt();
        let mut acc = vec![0.0f32; kept.len() * d];
        let mut wsum = vec![0.0f32; kept.len()];
        let mut merged = 0usize;
        for (e, &i) in ev.iter().enumerate() {
            if !ok[e] {
                continue;
            }
            let t = target[e];
            let (vi, vt) = (inp.value(i), inp.value(kept[t]));
            let (ni, nt) = (norm(vi), norm(vt));
            let w = sim[e].max(0.0) * ni / (ni + nt + EPS);
            simd::axpy(w, vi, &mut acc[t * d..(t + 1) * d]);
            wsum[t] += w;
            merged += usize::from(w > 0.0);
        }
        let mut values: Vec<f32> = kept.iter().flat_map(|&p| inp.value(p).to_vec()).collect();
        for (j, &w) in wsum.iter().enumerate() {
            if w > 0.0 {
                for (v, a) in values[j * d..(j + 1) * d]
                    .iter_mut()
                    .zip(&acc[j * d..(j + 1) * d])
                {
                    *v = (*v + a) / (1.0 + w);
                }
            }
        }
        out.values = Some(values);
        out.stats = vec![("merged", merged as f64)];
        Ok(out)
    }
}
register!(
    Compensator,
    "merge_similar",
    SimilarityMerge,
    "Similarity merge: each evicted value folded into the kept token of most similar key, weighted by similarity and value norms"
);
