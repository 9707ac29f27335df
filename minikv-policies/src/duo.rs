//! DuoAttention-style head split (Xiao et al. 2025, docs/algorithms.md
//! "DuoAttention"): *retrieval* heads keep every prompt token, *streaming*
//! heads keep only the attention sinks (`cache.sinks`) and the recent window
//! (`cache.recent_tokens`). Heads hold ragged lengths, so memory really drops.
//!
//! Which heads retrieve comes from a per-model pattern file that minikv
//! produces itself (`minikv calibrate duo`, no downloaded patterns): one score
//! per (layer, KV head), the mean attention mass that a synthetic retrieval
//! prompt's final queries put outside the sinks and the recent window. The
//! `retrieval_fraction` highest-scored heads of the whole model are retrieval
//! heads (ties to the lower layer and head).

use minikv_core::{Error, Result, SelectionInput, Selector, check_range, register};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, OnceLock};

/// A DuoAttention pattern file (JSON): per layer, one score per KV head.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DuoPattern {
    /// Format marker: always `minikv-duo-pattern-v1`.
    pub format: String,
    /// Model file name the pattern was calibrated on.
    pub model: String,
    /// Its sha256.
    pub model_sha256: String,
    /// How the scores were measured (prompts, context, seed, sinks, window).
    pub calibration: serde_json::Value,
    /// `scores[layer][kv_head]`: long-range attention mass, higher = retrieval.
    pub scores: Vec<Vec<f32>>,
}

impl DuoPattern {
    /// The format marker.
    pub const FORMAT: &'static str = "minikv-duo-pattern-v1";

    /// Reads and checks a pattern file.
    pub fn load(path: &str) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::config(
                "cache.selector.pattern",
                format!("cannot read {path}: {e} (make one with `minikv calibrate duo`)"),
            )
        })?;
        let p: DuoPattern = serde_json::from_str(&text)
            .map_err(|e| Error::config("cache.selector.pattern", format!("{path}: {e}")))?;
        if p.format != Self::FORMAT {
            return Err(Error::config(
                "cache.selector.pattern",
                format!("{path}: format {:?}, expected {:?}", p.format, Self::FORMAT),
            ));
        }
        if p.scores.is_empty()
            || p.scores
                .iter()
                .any(|l| l.len() != p.scores[0].len() || l.is_empty())
            || p.scores.iter().flatten().any(|x| !x.is_finite())
        {
            return Err(Error::config(
                "cache.selector.pattern",
                format!("{path}: scores must be a non-empty rectangular table of finite numbers"),
            ));
        }
        // A score is an attention mass: a share of one.
        if let Some((l, h, x)) = p
            .scores
            .iter()
            .enumerate()
            .flat_map(|(l, hs)| hs.iter().enumerate().map(move |(h, &x)| (l, h, x)))
            .find(|&(_, _, x)| !(0.0..=1.0).contains(&x))
        {
            return Err(Error::config(
                "cache.selector.pattern",
                format!("{path}: scores[{l}][{h}] = {x}: a score is an attention mass in [0, 1]"),
            ));
        }
        Ok(p)
    }

    /// Whether each (layer, head) is a retrieval head, the `fraction`
    /// highest-scored ones of the model (at least one when `fraction > 0`).
    pub fn retrieval_heads(&self, fraction: f64) -> Vec<Vec<bool>> {
        let mut all: Vec<(usize, usize, f32)> = self
            .scores
            .iter()
            .enumerate()
            .flat_map(|(l, hs)| hs.iter().enumerate().map(move |(h, &s)| (l, h, s)))
            .collect();
        let n = all.len();
        let k = if fraction > 0.0 {
            ((n as f64 * fraction).round() as usize).clamp(1, n)
        } else {
            0
        };
        all.sort_by(|a, b| b.2.total_cmp(&a.2).then((a.0, a.1).cmp(&(b.0, b.1))));
        let mut out: Vec<Vec<bool>> = self.scores.iter().map(|l| vec![false; l.len()]).collect();
        for &(l, h, _) in &all[..k] {
            out[l][h] = true;
        }
        out
    }
}

/// DuoAttention selector.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DuoAttention {
    /// Pattern file (from `minikv calibrate duo`). In a config file, a
    /// relative path is relative to the config file's folder (a path that
    /// exists only relative to the working directory is still taken, as
    /// before).
    pub pattern: String,
    /// Share of the model's KV heads that keep everything (0.5).
    pub retrieval_fraction: f64,
    #[serde(skip)]
    loaded: OnceLock<std::result::Result<Arc<Vec<Vec<bool>>>, String>>,
}

impl Default for DuoAttention {
    fn default() -> Self {
        Self {
            pattern: "configs/patterns/smollm2-135m-instruct-q4_1.duo.json".into(),
            retrieval_fraction: 0.5,
            loaded: OnceLock::new(),
        }
    }
}

impl DuoAttention {
    fn heads(&self) -> Result<Arc<Vec<Vec<bool>>>> {
        self.loaded
            .get_or_init(|| {
                DuoPattern::load(&self.pattern)
                    .map(|p| Arc::new(p.retrieval_heads(self.retrieval_fraction)))
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(Error::Input)
    }
}

#[typetag::serde(name = "duo_attention")]
impl Selector for DuoAttention {
    fn validate(&self) -> Result<()> {
        check_range(
            "cache.selector.retrieval_fraction",
            self.retrieval_fraction,
            0.0,
            1.0,
        )
    }
    fn resolve_paths(&mut self, dir: &std::path::Path) {
        let p = std::path::Path::new(&self.pattern);
        if p.is_relative() {
            let beside = dir.join(p);
            if beside.is_file() || !p.is_file() {
                self.pattern = beside.to_string_lossy().into_owned();
            }
        }
    }
    fn select(&self, input: &SelectionInput<'_>, out: &mut Vec<Vec<u32>>) -> Result<()> {
        let heads = self.heads()?;
        let t = input.t;
        let row = heads.get(input.layer).ok_or_else(|| {
            Error::Input(format!(
                "duo_attention: {} has {} layers, the model has more (layer {})",
                self.pattern,
                heads.len(),
                input.layer
            ))
        })?;
        if row.len() != input.n_heads {
            return Err(Error::Input(format!(
                "duo_attention: {} has {} heads per layer, the cache stores {} (a pattern holds KV heads: use cache.heads = \"per_kv\")",
                self.pattern,
                row.len(),
                input.n_heads
            )));
        }
        let sinks = input.sinks.min(t);
        let recent_from = t.saturating_sub(input.budget.recent).max(sinks);
        out.clear();
        for &retrieval in row {
            out.push(if retrieval {
                (0..t as u32).collect()
            } else {
                (0..sinks as u32)
                    .chain(recent_from as u32..t as u32)
                    .collect()
            });
        }
        Ok(())
    }
}
register!(
    Selector,
    "duo_attention",
    DuoAttention,
    "DuoAttention head split: retrieval heads (the retrieval_fraction highest in a calibrated pattern file) keep every token, streaming heads keep cache.sinks + the recent window"
);
