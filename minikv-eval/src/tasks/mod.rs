//! Evaluation tasks as components: each task is one [`EvalTask`] in its own
//! file, registered with one line (`register_task!`); `minikv eval --task`,
//! `minikv sweep` and `minikv report` find it by name and never name it.
//!
//! A task says what its prompt is made of ([`Input`]: windows of a text,
//! a haystack, generated questions, a dataset), which metric ranks it and
//! how a report aggregates that metric ([`TaskMetric`]), and runs on a
//! [`TaskContext`]: the model, the tokenizer, the prepared text or tokens,
//! and factories for the cache under test and the full cache. The caller
//! (the CLI) prepares the context from the task's [`Input`], the same way
//! for every task, and writes the row (provenance, memory, wall time).
//!
//! How to add one: the page below, compiled as a doctest.
#![doc = include_str!("../../../docs/adding-a-task.md")]

mod attention_error;
mod fidelity;
mod generation;
mod perplexity;
mod questions;
mod retrieval;

pub use questions::{Dataset, RulerQuestions, ruler_rows};

use minikv_core::{Diagnostics, Error, KvCache, MemoryReport, Result};
use minikv_models::{LanguageModel, Tokenizer};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;

/// An evaluation task: a small object registered by name.
pub trait EvalTask: Send + Sync {
    /// The name `--task` takes (kebab-case, unique among registered tasks).
    fn name(&self) -> &'static str;
    /// One line for listings.
    fn summary(&self) -> &'static str;
    /// The metric the task is ranked by, and how a report aggregates it.
    fn metric(&self) -> TaskMetric;
    /// What the task's prompts are made of (decides what the caller reads,
    /// tokenizes and checks before [`run`](EvalTask::run)).
    fn input(&self) -> Input;
    /// A family of tasks a report also averages (`ruler` gives the
    /// `ruler-average` row); `None` by default.
    fn family(&self) -> Option<&'static str> {
        None
    }
    /// Runs the task for one config and seed.
    fn run(&self, cx: &TaskContext<'_>) -> Result<TaskOutput>;
}

/// A task's primary metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskMetric {
    /// The field of the task's metrics that ranks it (`kl`, `accuracy`).
    pub name: &'static str,
    /// Whether a higher value is better.
    pub higher_is_better: bool,
    /// What one unit (a window, a trial, a question) of it is.
    pub outcomes: Outcomes,
}

/// What the units of a metric are, which decides a report's interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcomes {
    /// Each unit is a success or a failure: Wilson interval of the rate.
    Binary,
    /// Scores in `[0, 1]`: Wilson when every unit is 0 or 1 (single-answer
    /// questions), else the mean's interval.
    Score,
    /// Real values: the mean's interval fitted to the metric
    /// ([`crate::stats::interval_for`]: log scale for perplexities, never
    /// below zero for non-negative metrics).
    Continuous,
}

/// What a task's prompts are made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// One window of `context + tokens` tokens per trial, cut at seeded
    /// offsets from the text's tokens (or from `--ids`): the context is
    /// prefilled and compressed, the rest is what is measured.
    Windows,
    /// Prompts of `context` tokens built around the text's tokens
    /// (retrieval: a fact hidden in essay filler).
    Haystack,
    /// Question rows generated from the raw text; prompts of `context` tokens.
    Questions,
    /// Question rows read from `--dataset`; each row brings its context.
    Dataset,
}

impl Input {
    /// Whether the prompt is the whole `context` (no tokens measured after it).
    pub fn prompt_only(self) -> bool {
        self != Self::Windows
    }
    /// Whether the task asks questions (its query mode is recorded).
    pub fn asks_questions(self) -> bool {
        matches!(self, Self::Questions | Self::Dataset)
    }
}

/// What one evaluation runs (shared by `eval` and `sweep`; its JSON is part
/// of a sweep row's key).
#[derive(Debug, Clone, Serialize)]
pub struct TaskSpec {
    /// The task's registered name.
    pub task: String,
    /// Prompt/context tokens.
    pub context: usize,
    /// Tokens after the context.
    pub tokens: usize,
    /// Trials (retrieval, questions) or text windows.
    pub trials: usize,
    /// Depth of the hidden fact (None: uniform).
    pub depth: Option<f64>,
    /// Text file or directory.
    pub text: PathBuf,
    /// Question tasks: whether the question is compressed with the context.
    #[serde(skip_serializing_if = "is_agnostic")]
    pub query: crate::qa::QueryMode,
    /// `dataset`: the JSONL file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dataset: Option<PathBuf>,
    /// Token ids to cut windows from instead of the text (`--ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ids: Option<PathBuf>,
}

fn is_agnostic(q: &crate::qa::QueryMode) -> bool {
    *q == crate::qa::QueryMode::Agnostic
}

/// A fresh cache.
pub type CacheFactory<'a> = &'a (dyn Fn() -> Result<Box<dyn KvCache>> + Sync);

/// Full-cache reference logits of a window ([`crate::reference_logits`]),
/// computed or taken from the caller's memo.
pub type ReferenceFn<'a> = &'a (dyn Fn(&[u32]) -> Result<Arc<Vec<Vec<f32>>>> + Sync);

/// Everything a task runs on.
pub struct TaskContext<'a> {
    /// The model.
    pub model: &'a dyn LanguageModel,
    /// Its tokenizer.
    pub tok: &'a Tokenizer,
    /// The task's settings.
    pub spec: &'a TaskSpec,
    /// The seed of every random choice.
    pub seed: u64,
    /// The raw text ([`Input::Questions`]); empty otherwise.
    pub text: &'a str,
    /// The text's tokens or `--ids` ([`Input::Windows`], [`Input::Haystack`]);
    /// empty otherwise.
    pub tokens: &'a [u32],
    /// A cache of the config under test.
    pub cache: CacheFactory<'a>,
    /// A full (uncompressed) cache on the same backend.
    pub full_cache: CacheFactory<'a>,
    /// The full cache's logits of a window, shared across configs.
    pub reference: ReferenceFn<'a>,
}

/// What a task gives back.
#[derive(Debug)]
pub struct TaskOutput {
    /// The task's metrics (JSON object; the primary metric among them).
    pub metrics: serde_json::Value,
    /// The memory of the cache under test.
    pub memory: TaskMemory,
}

/// The memory a task reports for the cache under test.
#[derive(Debug, Clone)]
pub enum TaskMemory {
    /// The whole report of the cache measured in the last trial (window
    /// tasks measure one cache per trial).
    Report(MemoryReport),
    /// Bytes held by the cache of the last prompt, and the full fp16 cache's
    /// bytes for the same tokens (tasks that build a cache per question).
    Bytes {
        /// Bytes the compressed cache holds.
        kv_bytes: usize,
        /// Bytes a full fp16 cache would hold.
        full_fp16_bytes: usize,
    },
}

impl TaskMemory {
    /// Bytes held by the cache under test.
    pub fn kv_bytes(&self) -> usize {
        match self {
            Self::Report(m) => m.used_bytes(),
            Self::Bytes { kv_bytes, .. } => *kv_bytes,
        }
    }
    /// Bytes a full fp16 cache would hold for the same tokens.
    pub fn full_fp16_bytes(&self) -> usize {
        match self {
            Self::Report(m) => m.full_fp16_bytes,
            Self::Bytes {
                full_fp16_bytes, ..
            } => *full_fp16_bytes,
        }
    }
}

/// One window's measurement ([`TaskContext::each_window`]).
pub struct Trial {
    /// The window's metrics (a JSON object of numbers and numeric arrays).
    pub metrics: serde_json::Value,
    /// The measured cache's memory.
    pub memory: MemoryReport,
    /// The measured cache's diagnostics ([`KvCache::diagnostics`]).
    pub diagnostics: Diagnostics,
}

impl TaskContext<'_> {
    /// Runs `f` on one seeded window of `context + tokens` tokens per trial
    /// and averages the trials' metrics ([`mean_rows`]); the windows are
    /// drawn from one generator seeded with [`seed`](Self::seed), in trial
    /// order.
    pub fn each_window(&self, mut f: impl FnMut(&[u32]) -> Result<Trial>) -> Result<TaskOutput> {
        let need = self.spec.context + self.spec.tokens;
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed);
        let (mut rows, mut memory) = (Vec::new(), None);
        for _ in 0..self.spec.trials {
            let all = self.tokens;
            if all.len() < need {
                return Err(Error::Input(format!(
                    "{} has {} tokens, fewer than the {need} needed",
                    self.spec.text.display(),
                    all.len()
                )));
            }
            let start = rng.random_range(0..=all.len() - need);
            let t = f(&all[start..start + need])?;
            let mut v = t.metrics;
            add_diagnostics(&mut v, &t.diagnostics);
            memory = Some(t.memory);
            rows.push(v);
        }
        let Some(memory) = memory else {
            return Err(Error::Input("trials must be positive".into()));
        };
        Ok(TaskOutput {
            metrics: mean_rows(&rows),
            memory: TaskMemory::Report(memory),
        })
    }

    /// [`each_window`](Self::each_window) with a fresh cache of the config
    /// under test per window: `f` measures it on the window's tokens and
    /// returns the window's metrics; the cache's memory and diagnostics are
    /// taken after `f`.
    pub fn each_window_with_cache<M: Serialize>(
        &self,
        mut f: impl FnMut(&mut dyn KvCache, &[u32]) -> Result<M>,
    ) -> Result<TaskOutput> {
        self.each_window(|ids| {
            let mut comp = (self.cache)()?;
            let metrics = to_json(&f(comp.as_mut(), ids)?);
            Ok(Trial {
                metrics,
                memory: comp.memory(),
                diagnostics: comp.diagnostics(),
            })
        })
    }
}

/// A registered task (see `register_task!`).
pub struct TaskEntry(pub &'static dyn EvalTask);

inventory::collect!(TaskEntry);

/// Registers an [`EvalTask`] value (a constant expression) by its name.
///
/// ```ignore
/// minikv_eval::register_task!(MyTask);
/// ```
#[macro_export]
macro_rules! register_task {
    ($task:expr) => {
        $crate::__inventory::submit! { $crate::tasks::TaskEntry(&$task) }
    };
}

/// Every registered task, sorted by name.
pub fn all() -> Vec<&'static dyn EvalTask> {
    let mut v: Vec<&'static dyn EvalTask> = inventory::iter::<TaskEntry>
        .into_iter()
        .map(|e| e.0)
        .collect();
    v.sort_by_key(|t| t.name());
    v
}

/// Every registered task's name, sorted.
pub fn names() -> Vec<&'static str> {
    all().into_iter().map(|t| t.name()).collect()
}

/// The task named `name`, if registered.
pub fn find(name: &str) -> Option<&'static dyn EvalTask> {
    all().into_iter().find(|t| t.name() == name)
}

/// The task named `name`, or an input error listing the registered ones.
pub fn get(name: &str) -> Result<&'static dyn EvalTask> {
    find(name)
        .ok_or_else(|| Error::Input(format!("unknown task `{name}` ({})", names().join(", "))))
}

/// Flattens a cache's diagnostics into a trial's metrics, so that trials
/// average them, without knowing any part: each part's values as
/// `<part>_<stat>` (`reskv_eta`, `quest_bytes_read_per_token`) and its
/// per-layer values as `<part>_<stat>_per_layer`.
pub fn add_diagnostics(v: &mut serde_json::Value, diag: &Diagnostics) {
    for (part, stats) in diag {
        for (k, x) in &stats.values {
            v[format!("{part}_{k}")] = json!(x);
        }
        let names = stats.per_layer.first().into_iter().flat_map(|l| l.keys());
        for k in names {
            let series: Vec<Option<f64>> =
                stats.per_layer.iter().map(|l| l.get(k).copied()).collect();
            v[format!("{part}_{k}_per_layer")] = json!(series);
        }
    }
}

/// Mean of each numeric field over rows (numeric arrays of one length:
/// element-wise), with a 95% interval fitted to the field
/// ([`crate::stats::interval_for`]) when there are several rows; the rows
/// are kept as `per_trial`.
pub fn mean_rows(rows: &[serde_json::Value]) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    if let Some(first) = rows.first().and_then(|r| r.as_object()) {
        for k in first.keys() {
            let arrays: Vec<Vec<f64>> = rows
                .iter()
                .filter_map(|r| r[k].as_array())
                .map(|a| a.iter().filter_map(|x| x.as_f64()).collect::<Vec<_>>())
                .collect();
            if arrays.len() == rows.len()
                && let Some(n) = arrays.first().map(Vec::len).filter(|&n| n > 0)
                && arrays.iter().all(|a| a.len() == n)
                && first[k].as_array().is_some_and(|a| a.len() == n)
            {
                let m = rows.len() as f64;
                let mean: Vec<f64> = (0..n)
                    .map(|i| arrays.iter().map(|a| a[i]).sum::<f64>() / m)
                    .collect();
                out.insert(k.clone(), json!(mean));
                continue;
            }
            let xs: Vec<f64> = rows.iter().filter_map(|r| r[k].as_f64()).collect();
            if xs.len() != rows.len() {
                continue;
            }
            let mean = xs.iter().sum::<f64>() / xs.len() as f64;
            out.insert(k.clone(), json!(mean));
            if let Some((lo, hi, _)) = crate::stats::interval_for(k, &xs) {
                out.insert(format!("{k}_ci95"), json!([lo, hi]));
            }
        }
    }
    out.insert("per_trial".into(), json!(rows));
    serde_json::Value::Object(out)
}

/// A serializable result as JSON (every result type of this crate is plain
/// data: this cannot fail).
pub(crate) fn to_json(x: &impl Serialize) -> serde_json::Value {
    serde_json::to_value(x).expect("plain data serializes")
}

#[cfg(test)]
mod tests;
