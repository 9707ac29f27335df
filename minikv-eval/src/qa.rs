//! Questions over long contexts: the dataset format, question-agnostic and
//! query-aware compression, and scoring.
//!
//! A dataset is a JSONL file, one question per line, following the schema of
//! kvpress's evaluation: `context`, `question`, `answer_prefix`, `answer` (a
//! string or a list of strings), `max_new_tokens`, and optionally `task`,
//! `metric` and `depth`. The RULER-style generators ([`crate::ruler`]) write
//! the same rows, so a generated suite can be frozen and shared.
//!
//! ```
//! use minikv_eval::qa::{Metric, score};
//! // RULER's string_match_all: recall of every expected value.
//! assert_eq!(score(Metric::StringMatchAll, "It is 1234 and 98", &["1234", "5678"]), 0.5);
//! assert_eq!(score(Metric::StringMatchPart, "It is 1234", &["1234", "5678"]), 1.0);
//! assert_eq!(score(Metric::ExactMatch, " Paris.", &["paris"]), 1.0);
//! assert!((score(Metric::TokenF1, "the red house", &["a red house by the sea"]) - 0.6667).abs() < 1e-3);
//! ```

use minikv_core::{Error, KvCache, Result};
use minikv_models::{LanguageModel, Logits, Tokenizer, Workspace, argmax};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The expected answer: one string or several (all expected).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Answer {
    /// One expected string.
    One(String),
    /// Several expected strings.
    Many(Vec<String>),
}

impl Answer {
    /// Every expected string.
    pub fn all(&self) -> Vec<&str> {
        match self {
            Answer::One(s) => vec![s.as_str()],
            Answer::Many(v) => v.iter().map(String::as_str).collect(),
        }
    }
}

/// How a prediction is scored against the expected strings (in [0, 1]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// RULER: the fraction of expected strings found in the prediction
    /// (case-insensitive).
    #[default]
    StringMatchAll,
    /// RULER: 1 if any expected string is found in the prediction.
    StringMatchPart,
    /// The prediction's first line, normalized (case, punctuation, articles,
    /// spaces), equals an expected string normalized the same way.
    ExactMatch,
    /// SQuAD-style token F1 (normalized tokens), best over expected strings.
    TokenF1,
}

fn normalize(s: &str) -> Vec<String> {
    let lower: String = s
        .to_lowercase()
        .chars()
        .map(|c| if c.is_alphanumeric() { c } else { ' ' })
        .collect();
    lower
        .split_whitespace()
        .filter(|w| !matches!(*w, "a" | "an" | "the"))
        .map(str::to_owned)
        .collect()
}

/// Scores `pred` against `answers` with `metric`.
pub fn score(metric: Metric, pred: &str, answers: &[&str]) -> f64 {
    if answers.is_empty() {
        return 0.0;
    }
    let p = pred.to_lowercase();
    let found = |a: &str| p.contains(&a.to_lowercase());
    match metric {
        Metric::StringMatchAll => {
            answers.iter().filter(|a| found(a)).count() as f64 / answers.len() as f64
        }
        Metric::StringMatchPart => f64::from(u8::from(answers.iter().any(|a| found(a)))),
        Metric::ExactMatch => {
            let first = normalize(pred.trim().lines().next().unwrap_or(""));
            f64::from(u8::from(answers.iter().any(|a| normalize(a) == first)))
        }
        Metric::TokenF1 => {
            let pt = normalize(pred);
            answers
                .iter()
                .map(|a| normalize(a))
                .filter(|at| !at.is_empty())
                .map(|at| crate::token_f1(&at, &pt))
                .fold(0.0, f64::max)
        }
    }
}

fn d_new() -> usize {
    32
}

/// One question over a context.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QaRow {
    /// The long context (compressed).
    pub context: String,
    /// The question, asked after the context.
    pub question: String,
    /// Text the answer continues (e.g. "The pass key is").
    #[serde(default)]
    pub answer_prefix: String,
    /// The expected answer(s).
    pub answer: Answer,
    /// Greedy tokens generated for the answer.
    #[serde(default = "d_new")]
    pub max_new_tokens: usize,
    /// The task that produced the row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    /// Scoring (default `string_match_all`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metric: Option<Metric>,
    /// Relative depth of the fact in the context, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth: Option<f64>,
}

impl QaRow {
    fn check(&self) -> std::result::Result<(), String> {
        if self.context.trim().is_empty() {
            return Err("`context` is empty".into());
        }
        if self.answer.all().iter().all(|a| a.trim().is_empty()) {
            return Err("`answer` is empty".into());
        }
        if !(1..=4096).contains(&self.max_new_tokens) {
            return Err(format!(
                "`max_new_tokens` must be in 1..=4096, got {}",
                self.max_new_tokens
            ));
        }
        if self.depth.is_some_and(|d| !(0.0..=1.0).contains(&d)) {
            return Err("`depth` must be in [0, 1]".into());
        }
        Ok(())
    }
}

/// Reads a JSONL dataset; a malformed row is an error naming its line.
pub fn read_dataset(path: &Path) -> Result<Vec<QaRow>> {
    let bytes = minikv_core::files::read_bounded(path, 256 * minikv_core::files::MIB, "a dataset")?;
    let mut rows = Vec::new();
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let bad = |m: String| Error::Input(format!("{} line {}: {m}", path.display(), i + 1));
        let s = std::str::from_utf8(line).map_err(|_| bad("not valid UTF-8".into()))?;
        let row: QaRow = serde_json::from_str(s).map_err(|e| bad(e.to_string()))?;
        row.check().map_err(bad)?;
        rows.push(row);
    }
    if rows.is_empty() {
        return Err(Error::Input(format!("{}: no rows", path.display())));
    }
    Ok(rows)
}

/// Writes rows as JSONL (atomically: a temporary file, then a rename).
pub fn write_dataset(path: &Path, rows: &[QaRow]) -> Result<()> {
    let mut text = String::new();
    for r in rows {
        text += &serde_json::to_string(r).expect("json");
        text.push('\n');
    }
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, text).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// Whether the question is part of what gets compressed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueryMode {
    /// The context is compressed alone; the question comes after compression
    /// (kvpress's default: the cache cannot know the question).
    #[default]
    Agnostic,
    /// Context and question are prefilled together, then compressed.
    Aware,
}

/// What one answered row gave.
#[derive(Debug, Clone, Serialize)]
pub struct QaOutcome {
    /// Score in [0, 1].
    pub score: f64,
    /// The generated answer.
    pub prediction: String,
    /// Tokens of the context and of the question (with the answer prefix).
    pub context_tokens: usize,
    /// Tokens of the question and answer prefix.
    pub question_tokens: usize,
}

/// Answers `row` greedily through `cache` in `mode` and scores it.
pub fn answer(
    model: &dyn LanguageModel,
    tok: &Tokenizer,
    cache: &mut dyn KvCache,
    row: &QaRow,
    mode: QueryMode,
) -> Result<QaOutcome> {
    let ctx = tok.encode(&row.context)?;
    let q = tok.encode(&format!("{}{}", row.question, row.answer_prefix))?;
    let need = ctx.len() + q.len() + row.max_new_tokens;
    let max = model.spec().max_seq_len;
    if need > max {
        return Err(Error::ContextOverflow { len: need, max });
    }
    if q.is_empty() {
        return Err(Error::Input(
            "the question and answer prefix are empty".into(),
        ));
    }
    let mut ws = Workspace::default();
    let mut logits = match mode {
        QueryMode::Aware => {
            let mut p = ctx.clone();
            p.extend_from_slice(&q);
            let l = model.forward(&p, cache, &mut ws, Logits::Last)?;
            minikv_models::finish_prefill(model, cache, &p, &mut ws)?;
            l
        }
        QueryMode::Agnostic => {
            model.forward(&ctx, cache, &mut ws, Logits::None)?;
            minikv_models::finish_prefill(model, cache, &ctx, &mut ws)?;
            // One decode step per question token; only the last one's logits
            // are needed.
            let (last, head) = q.split_last().expect("checked non-empty");
            for &t in head {
                model.forward(&[t], cache, &mut ws, Logits::None)?;
            }
            model.forward(&[*last], cache, &mut ws, Logits::Last)?
        }
    };
    let mut out = Vec::new();
    while out.len() < row.max_new_tokens {
        let next = argmax(&logits);
        if tok.stop.contains(&next) {
            break;
        }
        out.push(next);
        if out.len() == row.max_new_tokens {
            break;
        }
        logits = model.forward(&[next], cache, &mut ws, Logits::Last)?;
    }
    let prediction = tok.decode(&out)?;
    let answers = row.answer.all();
    Ok(QaOutcome {
        score: score(row.metric.unwrap_or_default(), &prediction, &answers),
        prediction,
        context_tokens: ctx.len(),
        question_tokens: q.len(),
    })
}

/// Scores of a set of rows.
#[derive(Debug, Clone, Serialize)]
pub struct QaResult {
    /// Mean score.
    pub score: f64,
    /// Rows answered.
    pub trials: usize,
    /// Per row: score, prediction, depth, token counts.
    pub per_trial: Vec<serde_json::Value>,
    /// Bytes the last cache held (data) and a full fp16 cache of its tokens.
    pub kv_bytes: usize,
    /// Bytes of a full fp16 cache of the same tokens.
    pub full_fp16_bytes: usize,
}

/// Answers every row with a fresh cache each.
pub fn evaluate(
    model: &dyn LanguageModel,
    tok: &Tokenizer,
    rows: &[QaRow],
    mode: QueryMode,
    mut new_cache: impl FnMut() -> Result<Box<dyn KvCache>>,
) -> Result<QaResult> {
    let mut per_trial = Vec::with_capacity(rows.len());
    let (mut sum, mut kv, mut full) = (0.0, 0, 0);
    for r in rows {
        let mut c = new_cache()?;
        let o = answer(model, tok, c.as_mut(), r, mode)?;
        sum += o.score;
        let m = c.memory();
        (kv, full) = (m.used_bytes(), m.full_fp16_bytes);
        let mut t = serde_json::json!({
            "score": o.score, "prediction": o.prediction, "depth": r.depth,
            "context_tokens": o.context_tokens, "question_tokens": o.question_tokens,
        });
        // The row's own task name, as docs/tasks.md promises.
        if let Some(name) = &r.task {
            t["task"] = serde_json::json!(name);
        }
        per_trial.push(t);
    }
    Ok(QaResult {
        score: sum / rows.len().max(1) as f64,
        trials: rows.len(),
        per_trial,
        kv_bytes: kv,
        full_fp16_bytes: full,
    })
}
