//! Budget policies: how many tokens each layer (and optionally head) keeps.

use crate::{Error, LayerSignals, Needs, Result};
use std::fmt::Debug;

/// The budget of one layer, in tokens per (storage) head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct LayerBudget {
    /// Heavy hitters selected by score (outside the protected sets).
    pub heavy: usize,
    /// Most recent tokens, always kept.
    pub recent: usize,
}

/// Inputs to a budget policy.
#[derive(Debug, Clone)]
pub struct BudgetRequest<'a> {
    /// Number of layers `L`.
    pub n_layers: usize,
    /// Prompt length `T`.
    pub prompt_len: usize,
    /// Mean heavy budget per layer in tokens (`floor(T * heavy)` or `heavy_tokens`).
    pub heavy: usize,
    /// Recent window in tokens.
    pub recent: usize,
    /// Attention sinks (first tokens) that are always kept.
    pub sinks: usize,
    /// Per layer, the signals the cache collected during prefill (`A_cumul`,
    /// keys, values, the last prompt queries: whatever the policy's and the
    /// scorer's [`Needs`] asked for). Empty when the caller has none (e.g.
    /// `minikv budgets` without a model); a policy that needs them then
    /// returns a clear error.
    pub layers: &'a [LayerSignals<'a>],
}

/// A layer-budget policy. Implementations live in `minikv-policies`.
///
/// A signal-driven policy (MiniKV's var-prop, or anything that reads key
/// norms, attention entropy, ...) says what it needs in
/// [`needs`](SelectionPolicy::needs) and reads it per layer from
/// [`BudgetRequest::layers`].
#[typetag::serde(tag = "type")]
pub trait SelectionPolicy: Send + Sync + Debug + dyn_clone::DynClone {
    /// What the cache must collect during prefill for this policy.
    fn needs(&self) -> Needs {
        Needs::default()
    }
    /// Per-layer budgets. Implementations keep `sum(heavy) == L * mean` up to the
    /// rounding they document, and never give a layer more than the prompt holds.
    fn layer_budgets(&self, req: &BudgetRequest<'_>) -> Result<Vec<LayerBudget>>;
    /// Checks parameters; called when a cache is built.
    fn validate(&self) -> Result<()> {
        Ok(())
    }
}

dyn_clone::clone_trait_object!(SelectionPolicy);

/// Splits `total` into integers proportional to `weights`, each at most `cap`,
/// by Webster's highest-averages method (Sainte-Laguë): seats go one at a time
/// to the largest `w_i / (s_i + 1/2)`, ties to the lower index. The sum is
/// exactly `min(total, cap * n)`, each share is within one of its quota, and the
/// method is house-monotone: a larger total never gives a layer fewer tokens.
/// All-zero weights split evenly; otherwise a layer of weight 0 gets nothing
/// (and the sum may then fall short when the others are capped). Weights must be finite and non-negative.
pub fn apportion(weights: &[f64], total: usize, cap: usize) -> Result<Vec<usize>> {
    use std::cmp::Ordering;
    use std::collections::BinaryHeap;
    let n = weights.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    if weights.iter().any(|w| !w.is_finite() || *w < 0.0) {
        return Err(Error::Budget(format!(
            "weights must be finite and non-negative: {weights:?}"
        )));
    }
    let w: Vec<f64> = if weights.iter().all(|&x| x == 0.0) {
        vec![1.0; n]
    } else {
        weights.to_vec()
    };
    let total = total.min(cap.saturating_mul(n));
    #[derive(PartialEq)]
    struct Seat(f64, usize);
    impl Eq for Seat {}
    impl PartialOrd for Seat {
        fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
            Some(self.cmp(o))
        }
    }
    impl Ord for Seat {
        fn cmp(&self, o: &Self) -> Ordering {
            self.0.total_cmp(&o.0).then(o.1.cmp(&self.1))
        }
    }
    let mut out = vec![0usize; n];
    let mut given = 0usize;
    let mut heap: BinaryHeap<Seat> = (0..n)
        .filter(|&i| out[i] < cap && w[i] > 0.0)
        .map(|i| Seat(w[i] / (out[i] as f64 + 0.5), i))
        .collect();
    while given < total {
        let Some(Seat(_, i)) = heap.pop() else { break };
        out[i] += 1;
        given += 1;
        if out[i] < cap {
            heap.push(Seat(w[i] / (out[i] as f64 + 0.5), i));
        }
    }
    Ok(out)
}
