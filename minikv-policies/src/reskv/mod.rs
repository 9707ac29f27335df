//! ResKV (docs/algorithms.md §7): the tokens a selection evicts are not dropped but
//! summarized by a few residual clusters per (layer, KV head), which join the
//! decode softmax with a logit bias `beta * log(count) + log g(q)`.
//!
//! Each head's budget `b` (what the selector kept) is split into `m` exact
//! tokens and `r = round(ratio * b)` cluster entries: the `r` lowest-scored kept
//! tokens outside the sinks and the recent window are demoted to the evicted
//! set `E`, which Lloyd's k-means (deterministic init: evenly spaced members in
//! position order) partitions in key space. With `select = "proxy"` the ratio
//! is picked per head from `candidates` by the attention-output error on the
//! last `held_out` prompt queries against the full prompt (non-causal, as a
//! decode query sees it), and kept at 0 unless the best is `delta` better.
//!
//! The gate (the seed fixes tau, alpha and g_min but not the sharpness
//! measure; minikv's reading): `s` = largest attention probability over the
//! exact tokens alone, `g = max(g_min, sigmoid(alpha * (tau - s)))`; `none`
//! gives `g = 1`.
//!
//! ```
//! use minikv_policies::reskv::kmeans;
//! // Two well-separated groups of 1-d keys: {0, 0.1, 0.2} and {10, 10.1}.
//! let keys = [0.0, 0.1, 0.2, 10.0, 10.1];
//! let members: Vec<u32> = (0..5).collect();
//! let (centroids, assign) = kmeans(&keys, 1, &members, 2, 5);
//! assert_eq!(assign, vec![0, 0, 0, 1, 1]);
//! assert!((centroids[1] - 10.05).abs() < 1e-6);
//! ```

use minikv_core::compensate::{CompensateInput, Compensation, Compensator, LogitGate, evicted_of};
use minikv_core::{Error, Needs, Result};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

mod clusters;
pub use clusters::*;

/// How the residual share of each head is chosen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RatioSelect {
    /// `ratio` for every head.
    #[default]
    Fixed,
    /// Per head from `candidates` by held-out attention-output error (§7).
    Proxy,
}

/// The dynamic gate's sharpness measure.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateMeasure {
    /// `s` = largest attention probability over the exact tokens.
    #[default]
    MaxProb,
    /// No gate (`g = 1`).
    None,
}

/// `[cache.compensator] type = "reskv"`: residual clusters of evicted tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ResKvConfig {
    /// Share `r / b` of each head's budget given to cluster entries, in `[0, 1)`.
    pub ratio: f64,
    /// `fixed` (use `ratio`) or `proxy` (pick per head from `candidates`).
    pub select: RatioSelect,
    /// Candidate ratios of the proxy.
    pub candidates: Vec<f64>,
    /// Relative improvement the proxy needs over `r = 0`.
    pub delta: f64,
    /// Lloyd iterations.
    pub iters: usize,
    /// Weight of `log(count)` in the cluster logit.
    pub beta: f32,
    /// Gate sharpness measure.
    pub gate: GateMeasure,
    /// Gate threshold on the sharpness.
    pub tau: f32,
    /// Gate sigmoid slope.
    pub alpha: f32,
    /// Gate floor.
    pub g_min: f32,
    /// Last prompt queries held out for the proxy and the diagnostics.
    pub held_out: usize,
}

impl Default for ResKvConfig {
    fn default() -> Self {
        Self {
            ratio: 0.1,
            select: RatioSelect::default(),
            candidates: vec![0.0, 0.05, 0.10, 0.15, 0.20],
            delta: 0.01,
            iters: 5,
            beta: 1.0,
            gate: GateMeasure::default(),
            tau: 0.25,
            alpha: 12.0,
            g_min: 0.0,
            held_out: 32,
        }
    }
}

impl ResKvConfig {
    /// Range checks, naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |f: &str, m: String| Err(Error::config(format!("cache.compensator.{f}"), m));
        if !(0.0..1.0).contains(&self.ratio) {
            return bad("ratio", format!("must be in [0, 1), got {}", self.ratio));
        }
        if self.candidates.is_empty() || self.candidates.iter().any(|c| !(0.0..1.0).contains(c)) {
            return bad(
                "candidates",
                format!(
                    "must be non-empty ratios in [0, 1), got {:?}",
                    self.candidates
                ),
            );
        }
        if !(0.0..1.0).contains(&self.delta) {
            return bad("delta", format!("must be in [0, 1), got {}", self.delta));
        }
        if !(1..=100).contains(&self.iters) {
            return bad("iters", format!("must be in 1..=100, got {}", self.iters));
        }
        if !self.beta.is_finite() || !(0.0..=4.0).contains(&self.beta) {
            return bad("beta", format!("must be in [0, 4], got {}", self.beta));
        }
        if !(0.0..=1.0).contains(&self.tau) {
            return bad("tau", format!("must be in [0, 1], got {}", self.tau));
        }
        if !self.alpha.is_finite() || self.alpha < 0.0 {
            return bad(
                "alpha",
                format!("must be finite and >= 0, got {}", self.alpha),
            );
        }
        if !(0.0..=1.0).contains(&self.g_min) {
            return bad("g_min", format!("must be in [0, 1], got {}", self.g_min));
        }
        if self.select == RatioSelect::Proxy && self.held_out == 0 {
            return bad("held_out", "the proxy needs held-out queries (> 0)".into());
        }
        Ok(())
    }

    /// The decode-time gate.
    pub fn gate(&self) -> Option<Gate> {
        (self.gate == GateMeasure::MaxProb).then_some(Gate {
            tau: self.tau,
            alpha: self.alpha,
            g_min: self.g_min,
        })
    }
}

/// The dynamic gate `g = max(g_min, sigmoid(alpha * (tau - s)))`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gate {
    /// Threshold.
    pub tau: f32,
    /// Slope.
    pub alpha: f32,
    /// Floor.
    pub g_min: f32,
}

impl Gate {
    /// `log g` for sharpness `s` (the largest exact-token probability), never
    /// `-inf` (floored at `log 1e-30`).
    pub fn log_g(&self, s: f32) -> f32 {
        let g = (1.0 / (1.0 + (-self.alpha * (self.tau - s)).exp())).max(self.g_min);
        g.max(1e-30).ln()
    }

    /// `log g` from the exact tokens' scaled logits.
    pub fn log_g_of_logits(&self, logits: &[f32]) -> f32 {
        if logits.is_empty() {
            return self.log_g(0.0);
        }
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = logits.iter().map(|&x| (x - m).exp()).sum();
        self.log_g(1.0 / z)
    }
}

impl LogitGate for Gate {
    fn log_gate(&self, exact_logits: &[f32]) -> f32 {
        self.log_g_of_logits(exact_logits)
    }
    /// The same formula in f64 (the reference backend).
    fn log_gate_f64(&self, sc: &[f64]) -> f64 {
        let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
        let s = if sc.is_empty() { 0.0 } else { 1.0 / z };
        let g = (1.0 / (1.0 + (-(self.alpha as f64) * (self.tau as f64 - s)).exp()))
            .max(self.g_min as f64)
            .max(1e-30);
        g.ln()
    }
}

#[typetag::serde(name = "reskv")]
impl Compensator for ResKvConfig {
    fn needs(&self) -> Needs {
        Needs {
            query_window: self.held_out,
            ..Default::default()
        }
    }
    fn validate(&self) -> Result<()> {
        ResKvConfig::validate(self)
    }
    fn gate(&self) -> Option<Arc<dyn LogitGate>> {
        ResKvConfig::gate(self).map(|g| Arc::new(g) as Arc<dyn LogitGate>)
    }
    /// Demotes the `r` lowest-scored kept tokens outside the sinks and the
    /// recent window, clusters every evicted token, and measures the result on
    /// the held-out prompt queries (fixed ratio, or the per-head proxy).
    fn compensate(&self, inp: &CompensateInput<'_>) -> Result<Compensation> {
        let (t, d) = (inp.t, inp.d);
        let rows = HeadRows {
            keys: inp.keys,
            values: inp.values,
            d,
        };
        let gate = ResKvConfig::gate(self);
        let recent_start = t.saturating_sub(inp.recent);
        let scores = inp.scores;
        let qs = inp.queries;
        let w = inp.n_queries;
        // Kept tokens that may be demoted, lowest score first.
        let mut demotable: Vec<u32> = inp
            .kept
            .iter()
            .copied()
            .filter(|&p| (p as usize) >= inp.sinks && (p as usize) < recent_start)
            .collect();
        demotable.sort_by(|&a, &b| {
            scores[a as usize]
                .total_cmp(&scores[b as usize])
                .then(b.cmp(&a))
        });
        let b = inp.kept.len();
        let split = |ratio: f64| {
            let r = ((ratio * b as f64).round() as usize).min(demotable.len());
            let mut gone = demotable[..r].to_vec();
            gone.sort_unstable();
            let main: Vec<u32> = inp
                .kept
                .iter()
                .copied()
                .filter(|p| gone.binary_search(p).is_err())
                .collect();
            let evicted = evicted_of(&main, t);
            let c = Clusters::build(rows, &evicted, r, self.iters, self.beta);
            (main, evicted, c)
        };
        // The full-prompt reference outputs, once per head.
        let full = if w > 0 {
            full_outputs(qs, rows, t)
        } else {
            Vec::new()
        };
        let with_stats = |ratio: f64| {
            let (main, evicted, c) = split(ratio);
            let st = if w > 0 {
                residual_stats(qs, &full, rows, &main, &evicted, &c, gate)
            } else {
                ResidualStats {
                    evicted: evicted.len(),
                    clusters: c.len(),
                    ..Default::default()
                }
            };
            (main, c, st)
        };
        let (main, c, st) = match self.select {
            RatioSelect::Fixed => with_stats(self.ratio),
            RatioSelect::Proxy => {
                let base = with_stats(0.0);
                let best = self
                    .candidates
                    .iter()
                    .filter(|&&c| c > 0.0)
                    .map(|&c| with_stats(c))
                    .min_by(|a, b| a.2.output_error.total_cmp(&b.2.output_error));
                // Keep r = 0 unless the best is `delta` better.
                match best {
                    Some(b) if b.2.output_error <= (1.0 - self.delta) * base.2.output_error => b,
                    _ => base,
                }
            }
        };
        let mut out = Compensation::keep(main);
        out.entries.keys = c.keys;
        out.entries.values = c.values;
        out.entries.bias = c.bias;
        out.stats = vec![
            ("evicted", st.evicted as f64),
            ("clusters", st.clusters as f64),
            ("eta", st.eta),
            ("denominator_error", st.denominator_error),
            ("numerator_error", st.numerator_error),
            ("output_error", st.output_error),
            ("output_error_dropped", st.output_error_dropped),
        ];
        Ok(out)
    }
}
minikv_core::register!(
    Compensator,
    "reskv",
    ResKvConfig,
    "ResKV: evicted tokens summarized by k-means clusters joining the decode softmax (log-count bias, max-prob gate); fixed ratio or per-head proxy"
);

#[cfg(test)]
mod tests;
