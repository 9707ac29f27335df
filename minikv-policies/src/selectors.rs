//! Selectors: protected sets, top-k, Ada-KV.

use minikv_core::{Error, Result, SelectionInput, Selector, register, top_k_indices};
use serde::{Deserialize, Serialize};

/// Splits positions into (protected, candidates) for a head; `None` means keep all.
fn split(input: &SelectionInput<'_>) -> Option<(Vec<u32>, Vec<u32>)> {
    let t = input.t;
    let b = input.budget;
    if input.sinks + b.heavy + b.recent >= t {
        return None;
    }
    let rs = t - b.recent;
    let mut protected: Vec<u32> = (0..input.sinks.min(rs) as u32).collect();
    protected.extend(rs as u32..t as u32);
    let cand: Vec<u32> = (input.sinks.min(rs) as u32..rs as u32).collect();
    Some((protected, cand))
}

fn merge(mut a: Vec<u32>, b: &[u32]) -> Vec<u32> {
    a.extend_from_slice(b);
    a.sort_unstable();
    a
}

/// Per head: sinks + recent window + the `heavy` best-scored other tokens
/// (ties to the lower position). If the budget covers the prompt, keep all.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopK {}

#[typetag::serde(name = "top_k")]
impl Selector for TopK {
    fn equal_heads(&self) -> bool {
        true
    }
    fn select(&self, input: &SelectionInput<'_>, out: &mut Vec<Vec<u32>>) -> Result<()> {
        out.clear();
        let t = input.t;
        for h in 0..input.n_heads {
            let sc = &input.scores[h * t..(h + 1) * t];
            out.push(match split(input) {
                None => (0..t as u32).collect(),
                Some((prot, cand)) => merge(top_k_indices(sc, &cand, input.budget.heavy), &prot),
            });
        }
        Ok(())
    }
}
register!(
    Selector,
    "top_k",
    TopK,
    "per head: sinks + recent + top `heavy` by score, ties to the lower position"
);

/// Ada-KV: the layer's `H * heavy` heavy slots are chosen jointly across heads,
/// each head guaranteed `floor(alpha * heavy)`; heads end up with different
/// lengths (stored ragged).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdaKv {
    /// Safeguard fraction of the mean budget every head keeps.
    pub alpha: f64,
}
impl Default for AdaKv {
    fn default() -> Self {
        Self { alpha: 0.2 }
    }
}

#[typetag::serde(name = "ada_kv")]
impl Selector for AdaKv {
    fn validate(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.alpha) {
            return Err(Error::config(
                "cache.selector.alpha",
                format!("must be in [0, 1], got {}", self.alpha),
            ));
        }
        Ok(())
    }
    fn select(&self, input: &SelectionInput<'_>, out: &mut Vec<Vec<u32>>) -> Result<()> {
        out.clear();
        let (t, nh) = (input.t, input.n_heads);
        let Some((prot, cand)) = split(input) else {
            out.extend((0..nh).map(|_| (0..t as u32).collect()));
            return Ok(());
        };
        let b = input.budget.heavy;
        let floor = ((self.alpha * b as f64).floor() as usize).min(b);
        let mut chosen: Vec<Vec<u32>> = Vec::with_capacity(nh);
        let mut rest: Vec<(f32, u32, u32)> = Vec::new(); // (score, pos, head)
        for h in 0..nh {
            let sc = &input.scores[h * t..(h + 1) * t];
            let base = top_k_indices(sc, &cand, floor);
            let mut taken = vec![false; t];
            base.iter().for_each(|&p| taken[p as usize] = true);
            rest.extend(
                cand.iter()
                    .filter(|&&p| !taken[p as usize])
                    .map(|&p| (sc[p as usize], p, h as u32)),
            );
            chosen.push(base);
        }
        let extra = (nh * b - nh * floor).min(rest.len());
        if extra > 0 && extra < rest.len() {
            rest.select_nth_unstable_by(extra - 1, |a, b| {
                b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2))
            });
        }
        for &(_, p, h) in &rest[..extra] {
            chosen[h as usize].push(p);
        }
        for c in chosen {
            out.push(merge(c, &prot));
        }
        Ok(())
    }
}
register!(
    Selector,
    "ada_kv",
    AdaKv,
    "Ada-KV: heavy slots chosen jointly across heads with a per-head floor alpha * heavy (ragged heads)"
);
