//! Budget policies: how many tokens each layer (and optionally head) keeps.

use crate::{Error, Result};
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
    /// Per-layer statistic (for var-prop / var-inv), if the policy asked for it.
    pub layer_stats: Option<&'a [f32]>,
}

/// Which per-layer statistic a policy needs from prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LayerStatistic {
    /// Variance over positions of `A_cumul`, averaged over query heads (MiniKV §4.2).
    #[default]
    CumulVariance,
    /// Standard deviation over positions of `A_cumul`, averaged over query heads.
    CumulStd,
    /// Entropy of the normalized `A_cumul` distribution, averaged over query heads.
    CumulEntropy,
}

impl LayerStatistic {
    /// Computes the statistic of one layer from `A_cumul` `[Hq][T]`.
    pub fn compute(self, cumul: &[f32], hq: usize, t: usize) -> f32 {
        let mut acc = 0.0f64;
        for h in 0..hq {
            let row = &cumul[h * t..(h + 1) * t];
            let n = t as f64;
            let mean = row.iter().map(|&x| x as f64).sum::<f64>() / n;
            let var = row.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
            acc += match self {
                LayerStatistic::CumulVariance => var,
                LayerStatistic::CumulStd => var.sqrt(),
                LayerStatistic::CumulEntropy => {
                    let s: f64 = row.iter().map(|&x| x as f64).sum();
                    -row.iter()
                        .map(|&x| x as f64 / s)
                        .filter(|&p| p > 0.0)
                        .map(|p| p * p.ln())
                        .sum::<f64>()
                }
            };
        }
        (acc / hq as f64) as f32
    }
}

/// A layer-budget policy. Implementations live in `minikv-policies`.
#[typetag::serde(tag = "type")]
pub trait SelectionPolicy: Send + Sync + Debug {
    /// The per-layer statistic this policy needs, if any.
    fn layer_statistic(&self) -> Option<LayerStatistic> {
        None
    }
    /// Per-layer budgets. Implementations keep `sum(heavy) == L * mean` up to the
    /// rounding they document, and never give a layer more than the prompt holds.
    fn layer_budgets(&self, req: &BudgetRequest<'_>) -> Result<Vec<LayerBudget>>;
    /// Checks parameters; called when a cache is built.
    fn validate(&self) -> Result<()> {
        Ok(())
    }
}

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
