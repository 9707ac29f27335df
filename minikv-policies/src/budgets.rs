//! Layer budget policies (docs/algorithms.md §5).

use minikv_core::{
    BudgetRequest, Error, LayerBudget, Needs, Result, SelectionPolicy, apportion, register,
};
use serde::{Deserialize, Serialize};

fn heavy_cap(req: &BudgetRequest<'_>) -> usize {
    req.prompt_len.saturating_sub(req.recent + req.sinks)
}

fn with_recent(heavy: Vec<usize>, req: &BudgetRequest<'_>) -> Vec<LayerBudget> {
    heavy
        .into_iter()
        .map(|h| LayerBudget {
            heavy: h,
            recent: req.recent,
        })
        .collect()
}

/// Every layer keeps the mean budget.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Uniform {}

#[typetag::serde(name = "uniform")]
impl SelectionPolicy for Uniform {
    fn layer_budgets(&self, req: &BudgetRequest<'_>) -> Result<Vec<LayerBudget>> {
        let h = req.heavy.min(heavy_cap(req));
        Ok(with_recent(vec![h; req.n_layers], req))
    }
}
register!(
    Policy,
    "uniform",
    Uniform,
    "every layer keeps the mean heavy budget"
);

/// MiniKV pyramid: linear from `2x - x/depth` (bottom) to `x/depth` (top); lower
/// layers get more. Integer counts by largest remainder: the sum is exactly
/// `L * mean` (unless capped by the prompt).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Pyramid {
    /// Depth `delta` (MiniKV default 7).
    pub depth: f64,
}
impl Default for Pyramid {
    fn default() -> Self {
        Self { depth: 7.0 }
    }
}

impl Pyramid {
    /// Per-layer ratios for mean ratio `x` (docs/algorithms.md §5).
    pub fn ratios(&self, n_layers: usize, x: f64) -> Vec<f64> {
        if n_layers == 1 {
            return vec![x];
        }
        let (k0, kl) = (2.0 * x - x / self.depth, x / self.depth);
        (0..n_layers)
            .map(|l| k0 + (kl - k0) * l as f64 / (n_layers - 1) as f64)
            .collect()
    }
}

#[typetag::serde(name = "pyramid")]
impl SelectionPolicy for Pyramid {
    fn validate(&self) -> Result<()> {
        if !self.depth.is_finite() || !(1.0..=1e6).contains(&self.depth) {
            return Err(Error::config(
                "cache.policy.depth",
                format!("must be a finite number in [1, 1e6], got {}", self.depth),
            ));
        }
        Ok(())
    }
    fn layer_budgets(&self, req: &BudgetRequest<'_>) -> Result<Vec<LayerBudget>> {
        let w = self.ratios(req.n_layers, 1.0);
        let h = apportion(&w, req.n_layers * req.heavy, heavy_cap(req))?;
        Ok(with_recent(h, req))
    }
}
register!(
    Policy,
    "pyramid",
    Pyramid,
    "MiniKV pyramid: heavy budget linear in depth, 2x - x/depth at layer 0 down to x/depth; total conserved"
);

/// PyramidKV schedule: capacity `C = heavy + recent`, window `W = recent`,
/// `min = (C-W)//beta`, `max = 2(C-W) - min` clamped to `T - W`, integer steps.
/// Its floors make the total exceed uniform by at most `L(L-1)/2` tokens.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PyramidKv {
    /// `beta` (PyramidKV default 20).
    pub beta: usize,
}
impl Default for PyramidKv {
    fn default() -> Self {
        Self { beta: 20 }
    }
}

#[typetag::serde(name = "pyramidkv")]
impl SelectionPolicy for PyramidKv {
    fn validate(&self) -> Result<()> {
        if !(1..=65536).contains(&self.beta) {
            return Err(Error::config(
                "cache.policy.beta",
                format!("must be in 1..=65536, got {}", self.beta),
            ));
        }
        Ok(())
    }
    fn layer_budgets(&self, req: &BudgetRequest<'_>) -> Result<Vec<LayerBudget>> {
        let (l, t, w) = (req.n_layers, req.prompt_len, req.recent);
        let cw = req.heavy; // C - W
        let c = cw + w;
        if t < c {
            return Ok(with_recent(vec![t; l], req)); // nothing evicted
        }
        if t < 2 * cw || l == 1 {
            return Ok(with_recent(vec![cw; l], req));
        }
        let mut min = cw / self.beta;
        let mut max = 2 * cw - min;
        if max > t - w {
            max = t - w;
            min = 2 * cw - max;
        }
        let steps = (max - min) / (l - 1);
        Ok(with_recent((0..l).map(|i| max - i * steps).collect(), req))
    }
}
register!(
    Policy,
    "pyramidkv",
    PyramidKv,
    "PyramidKV: C = heavy + recent, W = recent, beta schedule with its integer floors and fallbacks"
);

/// PyramidKV with kvpress's schedule (`PyramidKVPress`), which differs from
/// KVCache-Factory's ([`PyramidKv`]): with `K = heavy` the tokens the cache
/// keeps per layer on average (`T·(1 − compression_ratio)`, the window counted
/// inside) and `W` the scorer's window, `max_capacity = W + K`,
/// `min = K / beta`, `max = 2K − min`; if `max ≥ T − W` then `max = T − W`
/// and `min = 2K − max`; unless `T ≥ max ≥ min ≥ W` every layer keeps
/// `round(K)`; otherwise layer `l` keeps `round(max − l·(max − min)/(L − 1))`
/// tokens, window included. Use with `recent_tokens = 0` and a scorer that
/// ranks its window first (SnapKV does), as kvpress does.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PyramidKvPress {
    /// `beta` (20).
    pub beta: usize,
    /// The window `W` of the schedule (kvpress's `window_size`, 64).
    pub window: usize,
}
impl Default for PyramidKvPress {
    fn default() -> Self {
        Self {
            beta: 20,
            window: 64,
        }
    }
}

impl PyramidKvPress {
    /// Tokens kept by each of `l` layers for a prompt of `t` tokens keeping
    /// `k` per layer on average.
    pub fn schedule(&self, l: usize, t: usize, k: f64) -> Vec<usize> {
        let w = self.window as f64;
        let tf = t as f64;
        let mut min = k / self.beta as f64;
        let mut max = 2.0 * k - min;
        if max >= tf - w {
            max = tf - w;
            min = 2.0 * k - max;
        }
        if l < 2 || !(tf >= max && max >= min && min >= w) {
            return vec![k.round_ties_even() as usize; l];
        }
        let steps = (max - min) / (l - 1) as f64;
        (0..l)
            .map(|i| ((max - i as f64 * steps).round_ties_even().max(0.0) as usize).min(t))
            .collect()
    }
}

#[typetag::serde(name = "pyramidkv_kvpress")]
impl SelectionPolicy for PyramidKvPress {
    fn validate(&self) -> Result<()> {
        if !(1..=65536).contains(&self.beta) {
            return Err(Error::config(
                "cache.policy.beta",
                format!("must be in 1..=65536, got {}", self.beta),
            ));
        }
        minikv_core::check_range("cache.policy.window", self.window, 0, 1 << 20)
    }
    fn layer_budgets(&self, req: &BudgetRequest<'_>) -> Result<Vec<LayerBudget>> {
        let kept = self.schedule(req.n_layers, req.prompt_len, req.heavy as f64);
        Ok(kept
            .into_iter()
            .map(|heavy| LayerBudget {
                heavy,
                recent: req.recent,
            })
            .collect())
    }
}
register!(
    Policy,
    "pyramidkv_kvpress",
    PyramidKvPress,
    "PyramidKV with kvpress's schedule: max_capacity = W + heavy, window counted inside, round(max - l*steps), uniform fallback"
);

/// A per-layer statistic of `A_cumul` (MiniKV §4.2), computed by var-prop and
/// var-inv from the layer signals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LayerStatistic {
    /// Variance over positions of `A_cumul`, averaged over query heads.
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

/// `A_cumul` is what var-prop and var-inv need.
fn cumul_needs() -> Needs {
    Needs {
        cumulative_attention: true,
        query_window: 0,
        ..Default::default()
    }
}

fn stat_budgets(
    req: &BudgetRequest<'_>,
    stat: LayerStatistic,
    inverse: bool,
    field: &str,
) -> Result<Vec<LayerBudget>> {
    if req.layers.len() != req.n_layers {
        return Err(Error::Budget(format!(
            "{field} needs per-layer attention statistics from a model run ({} of {} layers given)",
            req.layers.len(),
            req.n_layers
        )));
    }
    let stats: Vec<f32> = req
        .layers
        .iter()
        .map(|l| {
            let c = l.cumulative.ok_or_else(|| {
                Error::Budget(format!("{field} needs A_cumul, which was not collected"))
            })?;
            Ok(stat.compute(c, l.spec.n_q_heads, l.t))
        })
        .collect::<Result<_>>()?;
    budgets_from_statistics(req, &stats, inverse, field)
}

/// Heavy budgets proportional to `stats` (or to their inverses), total
/// conserved: the arithmetic of var-prop / var-inv once the per-layer
/// statistics are known. A statistic of 0 takes the smallest positive one.
pub fn budgets_from_statistics(
    req: &BudgetRequest<'_>,
    stats: &[f32],
    inverse: bool,
    field: &str,
) -> Result<Vec<LayerBudget>> {
    if stats.len() != req.n_layers {
        return Err(Error::shape(
            format!("{field} layer statistics"),
            req.n_layers,
            stats.len(),
        ));
    }
    if stats.iter().any(|v| !v.is_finite() || *v < 0.0) {
        return Err(Error::Budget(format!(
            "{field}: statistics must be finite and >= 0: {stats:?}"
        )));
    }
    let floor = stats
        .iter()
        .copied()
        .filter(|v| *v > 0.0)
        .fold(f32::INFINITY, f32::min);
    let w: Vec<f64> = stats
        .iter()
        .map(|&v| {
            let v = if v > 0.0 {
                v as f64
            } else if floor.is_finite() {
                floor as f64
            } else {
                1.0
            };
            if inverse { 1.0 / v } else { v }
        })
        .collect();
    let h = apportion(&w, req.n_layers * req.heavy, heavy_cap(req))?;
    Ok(with_recent(h, req))
}

/// Var-prop (MiniKV §4.2): heavy budget proportional to a per-layer statistic.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VarProp {
    /// The statistic (default: variance of `A_cumul`, mean over heads).
    #[serde(default)]
    pub statistic: LayerStatistic,
}

#[typetag::serde(name = "var_prop")]
impl SelectionPolicy for VarProp {
    fn needs(&self) -> Needs {
        cumul_needs()
    }
    fn layer_budgets(&self, req: &BudgetRequest<'_>) -> Result<Vec<LayerBudget>> {
        stat_budgets(req, self.statistic, false, "var_prop")
    }
}
register!(
    Policy,
    "var_prop",
    VarProp,
    "heavy budget proportional to a per-layer statistic (default Var(A_cumul)); total conserved"
);

/// Var-inv: heavy budget proportional to the inverse of the statistic.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VarInv {
    /// The statistic (default: variance of `A_cumul`, mean over heads).
    #[serde(default)]
    pub statistic: LayerStatistic,
}

#[typetag::serde(name = "var_inv")]
impl SelectionPolicy for VarInv {
    fn needs(&self) -> Needs {
        cumul_needs()
    }
    fn layer_budgets(&self, req: &BudgetRequest<'_>) -> Result<Vec<LayerBudget>> {
        stat_budgets(req, self.statistic, true, "var_inv")
    }
}
register!(
    Policy,
    "var_inv",
    VarInv,
    "heavy budget proportional to 1 / per-layer statistic; total conserved"
);

/// An explicit heavy budget per layer, as ratios of the prompt (`heavy`) or
/// token counts (`heavy_tokens`); the mean budget of the cache is ignored.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PerLayer {
    /// Ratios per layer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub heavy: Vec<f64>,
    /// Tokens per layer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub heavy_tokens: Vec<usize>,
}

#[typetag::serde(name = "per_layer")]
impl SelectionPolicy for PerLayer {
    fn validate(&self) -> Result<()> {
        if self.heavy.is_empty() == self.heavy_tokens.is_empty() {
            return Err(Error::config(
                "cache.policy",
                "per_layer needs exactly one of `heavy` (ratios) or `heavy_tokens`",
            ));
        }
        if let Some(r) = self.heavy.iter().find(|r| !(0.0..=1.0).contains(*r)) {
            return Err(Error::config(
                "cache.policy.heavy",
                format!("ratios must be in [0, 1], got {r}"),
            ));
        }
        Ok(())
    }
    fn layer_budgets(&self, req: &BudgetRequest<'_>) -> Result<Vec<LayerBudget>> {
        self.validate()?;
        let n = self.heavy.len().max(self.heavy_tokens.len());
        if n != req.n_layers {
            return Err(Error::config(
                "cache.policy",
                format!("per_layer lists {n} layers, the model has {}", req.n_layers),
            ));
        }
        let cap = heavy_cap(req);
        let h = if self.heavy.is_empty() {
            self.heavy_tokens.iter().map(|&x| x.min(cap)).collect()
        } else {
            self.heavy
                .iter()
                .map(|&r| minikv_core::config::ratio_tokens(req.prompt_len, r).min(cap))
                .collect()
        };
        Ok(with_recent(h, req))
    }
}
register!(
    Policy,
    "per_layer",
    PerLayer,
    "explicit per-layer heavy budgets (ratios or tokens)"
);
