//! Q-Filters (Godey et al. 2025; kvpress's `QFilterPress`): a context-free
//! scorer. Queries and keys of a head share a dominant direction `u` (the
//! first right singular vector of the head's queries, signed so that the
//! queries project positively on it); averaged over queries, the logit
//! `<q, k>` is then about `E[<q, u>] · <k, u>`, so a key's score is
//! `<k, u>`: one dot product per key, no attention, no query needed at
//! compression time.
//!
//! The directions are per model: a filter file made by `minikv calibrate
//! qfilters` from the model's own post-RoPE queries on a text (no downloaded
//! filters), one unit vector per (layer, KV head): the queries of every query
//! head of a GQA group are stacked before the decomposition. kvpress scores
//! `-(f · k)` with its own filters, so its `f` is `-u` here (the cross-check
//! hands kvpress `-u`).

use minikv_core::scoring::{Needs, ScoreInputs, TokenScorer};
use minikv_core::{Error, Result, register, simd};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, OnceLock};

/// A Q-Filters file (JSON): per layer and KV head, a unit direction.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QFilterFile {
    /// Format marker: always `minikv-qfilters-v1`.
    pub format: String,
    /// Model file name the filters were calibrated on.
    pub model: String,
    /// Its sha256.
    pub model_sha256: String,
    /// How they were measured (text, context, chunks, which queries).
    pub calibration: serde_json::Value,
    /// `filters[layer][kv_head]`: a unit vector of the head dimension.
    pub filters: Vec<Vec<Vec<f32>>>,
    /// `explained[layer][kv_head]`: the share of the queries' second
    /// moment along the filter (its eigenvalue over the trace), for reports.
    pub explained: Vec<Vec<f32>>,
}

impl QFilterFile {
    /// The format marker.
    pub const FORMAT: &'static str = "minikv-qfilters-v1";

    /// Reads and checks a filter file.
    pub fn load(path: &str) -> Result<Self> {
        let bad = |m: String| Error::config("cache.scorer.filters", m);
        let text = std::fs::read_to_string(path).map_err(|e| {
            bad(format!(
                "cannot read {path}: {e} (make one with `minikv calibrate qfilters`)"
            ))
        })?;
        let f: QFilterFile =
            serde_json::from_str(&text).map_err(|e| bad(format!("{path}: {e}")))?;
        if f.format != Self::FORMAT {
            return Err(bad(format!(
                "{path}: format {:?}, expected {:?}",
                f.format,
                Self::FORMAT
            )));
        }
        let d = f
            .filters
            .first()
            .and_then(|l| l.first())
            .map_or(0, Vec::len);
        let shape_ok = d > 0
            && f.filters.iter().all(|l| {
                !l.is_empty() && l.len() == f.filters[0].len() && l.iter().all(|u| u.len() == d)
            });
        if !shape_ok {
            return Err(bad(format!(
                "{path}: filters must be [layers][kv heads][head dim], non-empty and rectangular"
            )));
        }
        for (l, hs) in f.filters.iter().enumerate() {
            for (h, u) in hs.iter().enumerate() {
                let n = simd::dot(u, u).sqrt();
                if !u.iter().all(|x| x.is_finite()) || (n - 1.0).abs() > 1e-3 {
                    return Err(bad(format!(
                        "{path}: filters[{l}][{h}] is not a finite unit vector (norm {n})"
                    )));
                }
            }
        }
        Ok(f)
    }
}

/// The Q-Filters scorer: `score(j) = <k_j, u>` for the layer's KV head.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QFilter {
    /// Filter file (from `minikv calibrate qfilters`). In a config file, a
    /// relative path is relative to the config file's folder (a path that
    /// exists only relative to the working directory is still taken).
    pub filters: String,
    #[serde(skip)]
    loaded: OnceLock<std::result::Result<Arc<QFilterFile>, String>>,
}

impl Default for QFilter {
    fn default() -> Self {
        Self {
            filters: "configs/patterns/smollm2-135m-instruct-q4_1.qfilters.json".into(),
            loaded: OnceLock::new(),
        }
    }
}

impl QFilter {
    /// A scorer over an already loaded file (tests, embedding).
    pub fn from_file(file: QFilterFile) -> Self {
        let s = Self::default();
        let _ = s.loaded.set(Ok(Arc::new(file)));
        s
    }
    fn file(&self) -> Result<Arc<QFilterFile>> {
        self.loaded
            .get_or_init(|| {
                QFilterFile::load(&self.filters)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(Error::Input)
    }
}

#[typetag::serde(name = "q_filter")]
impl TokenScorer for QFilter {
    fn needs(&self) -> Needs {
        Needs::default()
    }
    fn validate(&self) -> Result<()> {
        self.file().map(|_| ())
    }
    fn resolve_paths(&mut self, dir: &std::path::Path) {
        let p = std::path::Path::new(&self.filters);
        if p.is_relative() {
            let beside = dir.join(p);
            if beside.is_file() || !p.is_file() {
                self.filters = beside.to_string_lossy().into_owned();
            }
        }
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let f = self.file()?;
        let (t, d, hkv) = (inp.t, inp.spec.head_dim, inp.spec.n_kv_heads);
        // One filter row per compressed layer, in order: a file of another
        // depth would silently score with another layer's directions (a
        // model with sliding-window layers compresses only its global ones,
        // which a whole-model file does not index).
        if f.filters.len() != inp.spec.n_layers {
            return Err(Error::Input(format!(
                "q_filter: {} holds {} layers, the cache compresses {} (calibrate the filters on this model; \
                 models with sliding-window layers are not supported yet)",
                self.filters,
                f.filters.len(),
                inp.spec.n_layers
            )));
        }
        let layer = &f.filters[inp.layer];
        if layer.len() != hkv || layer[0].len() != d {
            return Err(Error::Input(format!(
                "q_filter: {} holds {} KV heads of dimension {} per layer, the model {hkv} of {d} (calibrate the filters on this model)",
                self.filters,
                layer.len(),
                layer[0].len()
            )));
        }
        for h in 0..inp.spec.n_q_heads {
            let kv = inp.spec.kv_head_of(h);
            let (k, u) = (inp.keys[kv], &layer[kv]);
            for j in 0..t {
                out[h * t + j] = simd::dot(&k[j * d..(j + 1) * d], u);
            }
        }
        Ok(())
    }
}
register!(
    Scorer,
    "q_filter",
    QFilter,
    "Q-Filters: score = <k, u>, u the dominant direction of the head's queries (calibrated per model: minikv calibrate qfilters)"
);
