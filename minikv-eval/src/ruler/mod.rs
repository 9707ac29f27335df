//! RULER-style synthetic long-context tasks, generated offline and seeded,
//! with any text as the haystack. Each trial is a [`QaRow`] whose prompt
//! (context, question and answer prefix) is as close to `context` tokens as
//! whole sentences allow, never over it; facts are inserted between
//! sentences at the requested depth.
//!
//! The tasks follow the RULER benchmark's designs (Hsieh et al., 2024):
//! needle in a haystack with one needle (a number, a word or a UUID), several
//! keys (distractors), several values for one key, several keys asked at once;
//! variable tracking through chains of assignments; extraction of the most
//! common words of a list, and of the most frequent words of a coded text.
//! Scoring is RULER's: the fraction of expected strings found in the answer.
//!
//! Each task is a [`RulerGenerator`] in its own file, registered with one
//! line (`register_ruler!`), which also makes it an evaluation task
//! (`minikv eval --task ruler-...`) in the `ruler` family; a new one is one
//! file plus one line.
//!
//! ```
//! let vt = minikv_eval::ruler::find("ruler-vt").unwrap();
//! assert_eq!(vt.name(), "ruler-vt");
//! assert_eq!(minikv_eval::ruler::all().len(), 9);
//! ```

mod cwe;
mod fwe;
mod niah;
mod vt;

use crate::qa::QaRow;
use minikv_core::{Error, Result};
use minikv_models::Tokenizer;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// A RULER-style task: generates one trial's question row.
pub trait RulerGenerator: Send + Sync {
    /// The task name (`ruler-...`), what `--task` takes.
    fn name(&self) -> &'static str;
    /// One line for listings.
    fn summary(&self) -> &'static str;
    /// One trial's row (its `task` field is filled in by [`generate`]).
    fn row(&self, cx: &TrialContext<'_>, rng: &mut StdRng) -> Result<QaRow>;
}

/// What one trial is generated from.
pub struct TrialContext<'a> {
    /// Tokenizer of the model (prompts are fitted to its token count).
    pub tok: &'a Tokenizer,
    /// The haystack text's sentences.
    pub essay: &'a [String],
    /// RULER's noise sentences (the variable-tracking haystack).
    pub noise: &'a [String],
    /// The sentence the haystack starts at (drawn per trial).
    pub start: usize,
    /// Depth of the asked fact in [0, 1] (given, or drawn per trial).
    pub depth: f64,
    /// Tokens of the whole prompt, at most.
    pub budget: usize,
}

/// A registered generator (see `register_ruler!`).
pub struct RulerEntry(pub &'static dyn RulerGenerator);

inventory::collect!(RulerEntry);

/// Registers a [`RulerGenerator`] value (a constant expression): as a
/// generator ([`all`], [`find`]) and as an evaluation task of the `ruler`
/// family.
///
/// ```ignore
/// minikv_eval::register_ruler!(MyTask);
/// ```
#[macro_export]
macro_rules! register_ruler {
    ($gen:expr) => {
        $crate::__inventory::submit! { $crate::ruler::RulerEntry(&$gen) }
        $crate::__inventory::submit! {
            $crate::tasks::TaskEntry(&$crate::tasks::RulerQuestions(&$gen))
        }
    };
}

/// Every registered generator, sorted by name.
pub fn all() -> Vec<&'static dyn RulerGenerator> {
    let mut v: Vec<&'static dyn RulerGenerator> = inventory::iter::<RulerEntry>
        .into_iter()
        .map(|e| e.0)
        .collect();
    v.sort_by_key(|g| g.name());
    v
}

/// The generator named `name`, if registered.
pub fn find(name: &str) -> Option<&'static dyn RulerGenerator> {
    all().into_iter().find(|g| g.name() == name)
}

/// What to generate.
#[derive(Debug, Clone, Copy)]
pub struct RulerSpec {
    /// Tokens of the whole prompt (context + question + answer prefix), at most.
    pub context: usize,
    /// Depth of the (asked) fact in [0, 1]; `None`: uniform per trial.
    pub depth: Option<f64>,
    /// Trials.
    pub trials: usize,
    /// Seed.
    pub seed: u64,
}

/// Generates `spec.trials` rows of `task`, with `haystack` text as filler.
pub fn generate(
    task: &dyn RulerGenerator,
    tok: &Tokenizer,
    haystack: &str,
    spec: RulerSpec,
) -> Result<Vec<QaRow>> {
    let essay = sentences(haystack);
    if essay.len() < 8 {
        return Err(Error::Input(format!(
            "the haystack text has {} sentences; RULER tasks need a text of many sentences",
            essay.len()
        )));
    }
    let noise = sentences(NOISE);
    let mut rng = StdRng::seed_from_u64(spec.seed ^ 0x0052_554c_4552);
    let mut rows = Vec::with_capacity(spec.trials);
    for _ in 0..spec.trials {
        let depth = spec.depth.unwrap_or_else(|| rng.random::<f64>());
        let start = rng.random_range(0..essay.len());
        let cx = TrialContext {
            tok,
            essay: &essay,
            noise: &noise,
            start,
            depth,
            budget: spec.context,
        };
        let mut row = task.row(&cx, &mut rng)?;
        row.task = Some(task.name().into());
        rows.push(row);
    }
    Ok(rows)
}

/// RULER's noise haystack.
const NOISE: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

/// Sentences of `text`, whitespace normalized.
fn sentences(text: &str) -> Vec<String> {
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = flat.chars().peekable();
    while let Some(c) = chars.next() {
        cur.push(c);
        if matches!(c, '.' | '!' | '?') && chars.peek().is_none_or(|n| *n == ' ') {
            let s = cur.trim().to_string();
            if s.len() > 1 {
                out.push(s);
            }
            cur.clear();
        }
    }
    out
}

/// The parts of one prompt before fitting: the haystack sentences to draw
/// from, facts to insert (at depths), and the fixed text around them.
struct Layout {
    instruction: String,
    haystack: Vec<String>,
    start: usize,
    /// (depth, sentence) to insert.
    facts: Vec<(f64, String)>,
    question: String,
    answer_prefix: String,
}

impl Layout {
    fn context(&self, n: usize) -> String {
        let mut body: Vec<&str> = (0..n)
            .map(|i| self.haystack[(self.start + i) % self.haystack.len()].as_str())
            .collect();
        let mut facts: Vec<&(f64, String)> = self.facts.iter().collect();
        facts.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (d, f) in facts {
            let at = ((n as f64) * d).round() as usize;
            body.insert(at.min(body.len()), f);
        }
        format!("{}{}", self.instruction, body.join(" "))
    }

    /// The largest number of haystack sentences whose prompt fits `budget`.
    fn fit(&self, tok: &Tokenizer, budget: usize) -> Result<(String, f64)> {
        let len = |n: usize| -> Result<usize> {
            Ok(tok
                .encode(&format!(
                    "{}{}{}",
                    self.context(n),
                    self.question,
                    self.answer_prefix
                ))?
                .len())
        };
        if len(0)? > budget {
            return Err(Error::Input(format!(
                "a context of {budget} tokens is too short for this task's instruction, facts and question ({} tokens)",
                len(0)?
            )));
        }
        let (mut lo, mut hi) = (0usize, 1usize);
        while len(hi)? <= budget {
            lo = hi;
            hi *= 2;
            if hi > 1 << 20 {
                break;
            }
        }
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if len(mid)? <= budget {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Ok((self.context(lo), self.facts.first().map_or(0.0, |f| f.0)))
    }
}

#[cfg(test)]
mod tests;
