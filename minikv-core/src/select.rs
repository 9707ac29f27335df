//! Selectors: from scores and budgets to the set of kept tokens per head.

use crate::{LayerBudget, Result};
use std::fmt::Debug;

/// One layer's selection problem.
#[derive(Debug)]
pub struct SelectionInput<'a> {
    /// Scores `[H][T]` (H = storage heads), higher = keep.
    pub scores: &'a [f32],
    /// Number of storage heads.
    pub n_heads: usize,
    /// Prompt length.
    pub t: usize,
    /// The layer's budget (per head mean).
    pub budget: LayerBudget,
    /// Protected prefix (attention sinks).
    pub sinks: usize,
    /// Layer index (for per-layer patterns, e.g. DuoAttention's head split).
    pub layer: usize,
}

/// Picks kept token positions. Implementations live in `minikv-policies`.
///
/// Output: for every head, the kept positions **in increasing order**. The last
/// `budget.recent` and first `sinks` positions are always kept; heavy hitters are
/// the best-scored of the rest, ties broken towards the lower position.
#[typetag::serde(tag = "type")]
pub trait Selector: Send + Sync + Debug + dyn_clone::DynClone {
    /// Selects kept positions per head into `out` (cleared first).
    fn select(&self, input: &SelectionInput<'_>, out: &mut Vec<Vec<u32>>) -> Result<()>;
    /// Checks parameters; called when a cache is built.
    fn validate(&self) -> Result<()> {
        Ok(())
    }
    /// Resolves relative file paths among the parameters against `dir`, the
    /// folder of the config file they were written in (called once by
    /// [`RunConfig::load`](crate::RunConfig::load)); selectors without files
    /// keep the default, which does nothing.
    fn resolve_paths(&mut self, _dir: &std::path::Path) {}
    /// Whether every KV head of a layer keeps the layer's budget (so the
    /// per-head budgets are known without scores); `false` by default (the
    /// selector may share a layer's budget unequally among heads).
    fn equal_heads(&self) -> bool {
        false
    }
}

dyn_clone::clone_trait_object!(Selector);

/// Indices of the `k` largest `scores[i]` for `i` in `candidates`, ties to the lower
/// index, returned in increasing index order.
pub fn top_k_indices(scores: &[f32], candidates: &[u32], k: usize) -> Vec<u32> {
    let mut c: Vec<u32> = candidates.to_vec();
    let k = k.min(c.len());
    if k == 0 {
        return Vec::new();
    }
    let cmp = |a: &u32, b: &u32| {
        scores[*b as usize]
            .total_cmp(&scores[*a as usize])
            .then(a.cmp(b))
    };
    if k < c.len() {
        c.select_nth_unstable_by(k - 1, cmp);
        c.truncate(k);
    }
    c.sort_unstable();
    c
}
