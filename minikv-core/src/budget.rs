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
/// by largest remainder (ties to the lower index); the sum is exactly
/// `min(total, cap * n)`. Weights must be finite and non-negative.
pub fn apportion(weights: &[f64], total: usize, cap: usize) -> Result<Vec<usize>> {
    let n = weights.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    if weights.iter().any(|w| !w.is_finite() || *w < 0.0) {
        return Err(Error::Budget(format!(
            "weights must be finite and non-negative: {weights:?}"
        )));
    }
    let total = total.min(cap.saturating_mul(n));
    let mut out = vec![0usize; n];
    let mut fixed = vec![false; n];
    let mut remaining = total;
    // Water-filling: layers whose share exceeds the cap are fixed at the cap.
    loop {
        let wsum: f64 = (0..n).filter(|&i| !fixed[i]).map(|i| weights[i]).sum();
        let free: Vec<usize> = (0..n).filter(|&i| !fixed[i]).collect();
        if free.is_empty() {
            break;
        }
        let share = |i: usize| {
            if wsum > 0.0 {
                remaining as f64 * weights[i] / wsum
            } else {
                remaining as f64 / free.len() as f64
            }
        };
        let over: Vec<usize> = free.iter().copied().filter(|&i| share(i) > cap as f64).collect();
        if over.is_empty() {
            let mut assigned = 0usize;
            let mut rema: Vec<(f64, usize)> = Vec::with_capacity(free.len());
            for &i in &free {
                let s = share(i);
                out[i] = s.floor() as usize;
                assigned += out[i];
                rema.push((s - s.floor(), i));
            }
            let mut left = remaining - assigned;
            rema.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            for &(_, i) in &rema {
                if left == 0 {
                    break;
                }
                if out[i] < cap {
                    out[i] += 1;
                    left -= 1;
                }
            }
            break;
        }
        for i in over {
            fixed[i] = true;
            out[i] = cap;
            remaining -= cap;
        }
    }
    Ok(out)
}
