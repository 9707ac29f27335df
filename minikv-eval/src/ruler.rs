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
//! ```
//! use minikv_eval::ruler::RulerTask;
//! assert_eq!(RulerTask::from_task("ruler-vt"), Some(RulerTask::VariableTracking));
//! assert_eq!(RulerTask::ALL.len(), 9);
//! ```

use crate::qa::{Answer, Metric, QaRow};
use minikv_core::{Error, Result};
use minikv_models::Tokenizer;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// A RULER-style task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RulerTask {
    /// One needle, a 7-digit number, in essay text.
    NiahSingleNumber,
    /// One needle, a word, in essay text.
    NiahSingleWord,
    /// One needle, a UUID, in essay text.
    NiahSingleUuid,
    /// Four needles with different keys; one key is asked.
    NiahMultikey,
    /// Four values for one key; all are expected.
    NiahMultivalue,
    /// Four keys asked at once; all their values are expected.
    NiahMultiquery,
    /// A chain of five variables assigned one value through each other.
    VariableTracking,
    /// The ten most common words of a numbered list.
    CommonWords,
    /// The three most frequent words of a coded text (Zipf-distributed).
    FrequentWords,
}

const NAMES: [(&str, RulerTask); 9] = [
    ("ruler-niah-single-number", RulerTask::NiahSingleNumber),
    ("ruler-niah-single-word", RulerTask::NiahSingleWord),
    ("ruler-niah-single-uuid", RulerTask::NiahSingleUuid),
    ("ruler-niah-multikey", RulerTask::NiahMultikey),
    ("ruler-niah-multivalue", RulerTask::NiahMultivalue),
    ("ruler-niah-multiquery", RulerTask::NiahMultiquery),
    ("ruler-vt", RulerTask::VariableTracking),
    ("ruler-cwe", RulerTask::CommonWords),
    ("ruler-fwe", RulerTask::FrequentWords),
];

impl RulerTask {
    /// Every task, in order.
    pub const ALL: [RulerTask; 9] = [
        Self::NiahSingleNumber,
        Self::NiahSingleWord,
        Self::NiahSingleUuid,
        Self::NiahMultikey,
        Self::NiahMultivalue,
        Self::NiahMultiquery,
        Self::VariableTracking,
        Self::CommonWords,
        Self::FrequentWords,
    ];

    /// From a task name (`ruler-...`).
    pub fn from_task(name: &str) -> Option<Self> {
        NAMES.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
    }

    /// The task's name.
    pub fn name(self) -> &'static str {
        NAMES.iter().find(|(_, t)| *t == self).expect("named").0
    }

    /// Every task name.
    pub fn names() -> Vec<&'static str> {
        NAMES.iter().map(|(n, _)| *n).collect()
    }
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

const ADJECTIVES: &[&str] = &[
    "amber", "ancient", "brave", "bright", "brisk", "calm", "clever", "cozy", "crisp", "curious",
    "dapper", "dusty", "eager", "early", "fancy", "fierce", "fluffy", "frosty", "gentle", "giant",
    "glossy", "golden", "grumpy", "hasty", "hollow", "humble", "icy", "jolly", "keen", "lively",
    "lofty", "lucky", "mellow", "misty", "modest", "noble", "odd", "pale", "plucky", "polite",
    "proud", "quiet", "rapid", "rusty", "sandy", "shiny", "silent", "silly", "sleepy", "slim",
    "smoky", "snowy", "solid", "spicy", "steady", "stormy", "sunny", "swift", "tame", "tidy",
    "tiny", "vivid", "wary", "witty", "woolly", "zesty",
];

const NOUNS: &[&str] = &[
    "anchor", "apple", "badger", "banjo", "barrel", "beacon", "biscuit", "blanket", "bucket",
    "cactus", "canoe", "castle", "cedar", "comet", "compass", "cotton", "crayon", "dolphin",
    "donkey", "falcon", "feather", "fiddle", "garden", "glacier", "harbor", "helmet", "hammock",
    "island", "jacket", "kettle", "ladder", "lantern", "lemon", "lizard", "magnet", "marble",
    "meadow", "mitten", "needle", "noodle", "orchard", "otter", "paddle", "parrot", "pebble",
    "pepper", "pillow", "pocket", "quilt", "rabbit", "radish", "ribbon", "saddle", "salmon",
    "shovel", "spruce", "squirrel", "teapot", "thimble", "tiger", "tractor", "trumpet", "tulip",
    "turnip", "violin", "walrus", "wagon", "whistle", "willow", "zebra",
];

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

fn key_word(rng: &mut StdRng) -> String {
    format!(
        "{}-{}",
        ADJECTIVES[rng.random_range(0..ADJECTIVES.len())],
        NOUNS[rng.random_range(0..NOUNS.len())]
    )
}

fn number(rng: &mut StdRng) -> String {
    rng.random_range(1_000_000..10_000_000u32).to_string()
}

fn uuid(rng: &mut StdRng) -> String {
    let h = |n: usize, rng: &mut StdRng| -> String {
        (0..n)
            .map(|_| char::from_digit(rng.random_range(0..16u32), 16).expect("hex"))
            .collect()
    };
    format!(
        "{}-{}-{}-{}-{}",
        h(8, rng),
        h(4, rng),
        h(4, rng),
        h(4, rng),
        h(12, rng)
    )
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

fn niah_intro(kind: &str) -> String {
    format!(
        "Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz you about the {kind} afterwards.\n"
    )
}

fn needle(kind: &str, key: &str, value: &str) -> String {
    format!("One of the special magic {kind} for {key} is: {value}.")
}

fn niah_question(kind: &str, keys: &[String]) -> (String, String) {
    let k = match keys {
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
        [] => String::new(),
    };
    (
        format!("\nWhat are all the special magic {kind} for {k} mentioned in the provided text?"),
        format!(" The special magic {kind} for {k} mentioned in the provided text are"),
    )
}

/// Generates `spec.trials` rows of `task`, with `haystack` text as filler.
pub fn generate(
    task: RulerTask,
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
        let mut row = match task {
            RulerTask::NiahSingleNumber
            | RulerTask::NiahSingleWord
            | RulerTask::NiahSingleUuid
            | RulerTask::NiahMultikey
            | RulerTask::NiahMultivalue
            | RulerTask::NiahMultiquery => {
                niah(task, tok, &essay, start, depth, spec.context, &mut rng)?
            }
            RulerTask::VariableTracking => vt(tok, &noise, depth, spec.context, &mut rng)?,
            RulerTask::CommonWords => cwe(tok, &essay, spec.context, &mut rng)?,
            RulerTask::FrequentWords => fwe(tok, spec.context, &mut rng)?,
        };
        row.task = Some(task.name().into());
        rows.push(row);
    }
    Ok(rows)
}

fn niah(
    task: RulerTask,
    tok: &Tokenizer,
    essay: &[String],
    start: usize,
    depth: f64,
    budget: usize,
    rng: &mut StdRng,
) -> Result<QaRow> {
    let (kind, value): (&str, fn(&mut StdRng) -> String) = match task {
        RulerTask::NiahSingleWord => ("words", |r| {
            NOUNS[r.random_range(0..NOUNS.len())].to_string()
        }),
        RulerTask::NiahSingleUuid => ("uuids", uuid),
        _ => ("numbers", number),
    };
    let mut keys: Vec<String> = Vec::new();
    while keys.len() < 4 {
        let k = key_word(rng);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    // (key index, value) of every needle; the first is at `depth`.
    let (needles, asked): (Vec<(usize, String)>, Vec<usize>) = match task {
        RulerTask::NiahMultikey => ((0..4).map(|i| (i, value(rng))).collect(), vec![0]),
        RulerTask::NiahMultivalue => ((0..4).map(|_| (0, value(rng))).collect(), vec![0]),
        RulerTask::NiahMultiquery => ((0..4).map(|i| (i, value(rng))).collect(), vec![0, 1, 2, 3]),
        _ => (vec![(0, value(rng))], vec![0]),
    };
    let facts = needles
        .iter()
        .enumerate()
        .map(|(i, (k, v))| {
            let d = if i == 0 { depth } else { rng.random::<f64>() };
            (d, needle(kind, &keys[*k], v))
        })
        .collect();
    let asked_keys: Vec<String> = asked.iter().map(|&i| keys[i].clone()).collect();
    let (question, answer_prefix) = niah_question(kind, &asked_keys);
    let layout = Layout {
        instruction: niah_intro(kind),
        haystack: essay.to_vec(),
        start,
        facts,
        question,
        answer_prefix,
    };
    let (context, _) = layout.fit(tok, budget)?;
    let answers: Vec<String> = needles
        .iter()
        .filter(|(k, _)| asked.contains(k))
        .map(|(_, v)| v.clone())
        .collect();
    Ok(QaRow {
        context,
        question: layout.question,
        answer_prefix: layout.answer_prefix,
        max_new_tokens: if answers.len() > 1 { 64 } else { 32 },
        answer: Answer::Many(answers),
        task: None,
        metric: Some(Metric::StringMatchAll),
        depth: Some(depth),
    })
}

fn var_name(rng: &mut StdRng) -> String {
    (0..5)
        .map(|_| char::from(b'A' + rng.random_range(0..26u8)))
        .collect()
}

fn vt(
    tok: &Tokenizer,
    noise: &[String],
    depth: f64,
    budget: usize,
    rng: &mut StdRng,
) -> Result<QaRow> {
    let value = rng.random_range(10_000..100_000u32).to_string();
    let mut names: Vec<String> = Vec::new();
    while names.len() < 5 {
        let n = var_name(rng);
        if !names.contains(&n) {
            names.push(n);
        }
    }
    // The chain starts at `depth` and spreads over the rest of the text.
    let mut facts = vec![(depth * 0.5, format!("VAR {} = {value}.", names[0]))];
    for i in 1..names.len() {
        let d = depth * 0.5 + (1.0 - depth * 0.5) * i as f64 / names.len() as f64;
        facts.push((d, format!("VAR {} = VAR {}.", names[i], names[i - 1])));
    }
    let layout = Layout {
        instruction: "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n".into(),
        haystack: noise.to_vec(),
        start: 0,
        facts,
        question: format!("\nQuestion: Find all variables that are assigned the value {value} in the text above."),
        answer_prefix: format!(
            " Answer: According to the chain(s) of variable assignment in the text above, {} variables are assigned the value {value}, they are:",
            names.len()
        ),
    };
    let (context, _) = layout.fit(tok, budget)?;
    Ok(QaRow {
        context,
        question: layout.question,
        answer_prefix: layout.answer_prefix,
        answer: Answer::Many(names),
        max_new_tokens: 30,
        task: None,
        metric: Some(Metric::StringMatchAll),
        depth: Some(depth * 0.5),
    })
}

/// Distinct lowercase words of 4 to 10 letters in the essays.
fn vocabulary(essay: &[String]) -> Vec<String> {
    let mut v: Vec<String> = essay
        .iter()
        .flat_map(|s| s.split(|c: char| !c.is_ascii_alphabetic()))
        .filter(|w| (4..=10).contains(&w.len()) && w.chars().all(|c| c.is_ascii_lowercase()))
        .map(str::to_owned)
        .collect();
    v.sort();
    v.dedup();
    v
}

fn cwe(tok: &Tokenizer, essay: &[String], budget: usize, rng: &mut StdRng) -> Result<QaRow> {
    let mut vocab = vocabulary(essay);
    vocab.shuffle(rng);
    if vocab.len() < 40 {
        return Err(Error::Input(
            "the haystack has too few distinct words for ruler-cwe".into(),
        ));
    }
    let common: Vec<String> = vocab[..10].to_vec();
    let rare = &vocab[10..];
    let question = "\nQuestion: What are the 10 most common words in the above list?".to_string();
    let answer_prefix =
        " Answer: The top 10 words that appear most often in the list are:".to_string();
    let instruction = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n".to_string();
    // Common words `freq` times each (30, or fewer in short contexts), rare
    // ones 3 times: as many rare words as fit.
    let build = |freq: usize, n_rare: usize, rng: &mut StdRng| -> String {
        let mut words: Vec<&str> = Vec::new();
        for w in &common {
            words.extend(std::iter::repeat_n(w.as_str(), freq));
        }
        for w in rare.iter().cycle().take(n_rare) {
            words.extend(std::iter::repeat_n(w.as_str(), 3));
        }
        words.shuffle(rng);
        let list: Vec<String> = words
            .iter()
            .enumerate()
            .map(|(i, w)| format!("{}. {w}", i + 1))
            .collect();
        format!("{instruction}{}", list.join(" "))
    };
    // One shuffle seed for the probes and the result: the fitted list is the one kept.
    let shuffle_seed: u64 = rng.random();
    let len = |freq: usize, n: usize| -> Result<usize> {
        let t = build(freq, n, &mut StdRng::seed_from_u64(shuffle_seed));
        Ok(tok.encode(&format!("{t}{question}{answer_prefix}"))?.len())
    };
    // The most repetitions whose common words take at most 60% of the budget.
    let mut freq = 0;
    for f in [30, 20, 12, 8, 5] {
        if len(f, 0)? * 10 <= budget * 6 {
            freq = f;
            break;
        }
    }
    if freq == 0 {
        return Err(Error::Input(format!(
            "a context of {budget} tokens is too short for ruler-cwe (ten words 5 times each)"
        )));
    }
    let at = |n: usize| build(freq, n, &mut StdRng::seed_from_u64(shuffle_seed));
    let fits = |n: usize| -> Result<bool> { Ok(len(freq, n)? <= budget) };
    let (mut lo, mut hi) = (0usize, rare.len().max(1));
    if fits(hi)? {
        lo = hi;
    } else {
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if fits(mid)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
    }
    let context = at(lo);
    Ok(QaRow {
        context,
        question,
        answer_prefix,
        answer: Answer::Many(common),
        max_new_tokens: 120,
        task: None,
        metric: Some(Metric::StringMatchAll),
        depth: None,
    })
}

fn fwe(tok: &Tokenizer, budget: usize, rng: &mut StdRng) -> Result<QaRow> {
    // A coded vocabulary of random 3-letter words, drawn with Zipf weights.
    let mut codes: Vec<String> = Vec::new();
    while codes.len() < 200 {
        let w: String = (0..3)
            .map(|_| char::from(b'a' + rng.random_range(0..26u8)))
            .collect();
        if !codes.contains(&w) {
            codes.push(w);
        }
    }
    let weights: Vec<f64> = (1..=codes.len())
        .map(|r| 1.0 / (r as f64).powi(2))
        .collect();
    let total: f64 = weights.iter().sum();
    let question = "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?".to_string();
    let answer_prefix =
        " Answer: According to the coded text above, the three most frequently appeared words are:"
            .to_string();
    let instruction = "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. ".to_string();
    let mut words: Vec<usize> = Vec::new();
    let text_of = |words: &[usize]| -> String {
        let t: Vec<&str> = words.iter().map(|&i| codes[i].as_str()).collect();
        format!("{instruction}.... {} ....", t.join(" "))
    };
    let len = |words: &[usize]| -> Result<usize> {
        Ok(tok
            .encode(&format!("{}{question}{answer_prefix}", text_of(words)))?
            .len())
    };
    if len(&words)? > budget {
        return Err(Error::Input(format!(
            "a context of {budget} tokens is too short for ruler-fwe"
        )));
    }
    // Grow in chunks, then trim to fit.
    loop {
        let chunk: Vec<usize> = (0..64)
            .map(|_| {
                let mut u = rng.random::<f64>() * total;
                weights
                    .iter()
                    .position(|w| {
                        u -= w;
                        u <= 0.0
                    })
                    .unwrap_or(0)
            })
            .collect();
        let mut next = words.clone();
        next.extend(chunk);
        if len(&next)? > budget {
            break;
        }
        words = next;
    }
    let mut count = vec![0usize; codes.len()];
    words.iter().for_each(|&i| count[i] += 1);
    let mut order: Vec<usize> = (0..codes.len()).collect();
    order.sort_by(|&a, &b| count[b].cmp(&count[a]).then(a.cmp(&b)));
    let answers: Vec<String> = order[..3].iter().map(|&i| codes[i].clone()).collect();
    Ok(QaRow {
        context: text_of(&words),
        question,
        answer_prefix,
        answer: Answer::Many(answers),
        max_new_tokens: 50,
        task: None,
        metric: Some(Metric::StringMatchAll),
        depth: None,
    })
}

#[cfg(test)]
#[path = "ruler_tests.rs"]
mod tests;
