//! Needle in a haystack: one needle (a number, a word or a UUID), several
//! keys (distractors), several values for one key, several keys asked at
//! once; every needle is a sentence inserted in the essay text.

use super::{Layout, RulerGenerator, TrialContext};
use crate::qa::{Answer, Metric, QaRow};
use minikv_core::Result;
use rand::{Rng, rngs::StdRng};

/// What a needle's value is.
#[derive(Debug, Clone, Copy)]
enum Value {
    Number,
    Word,
    Uuid,
}

/// Which needles are hidden and which are asked.
#[derive(Debug, Clone, Copy)]
enum Needles {
    /// One needle, asked.
    Single,
    /// Four needles with different keys; one key is asked.
    MultiKey,
    /// Four values for one key; all are expected.
    MultiValue,
    /// Four keys asked at once; all their values are expected.
    MultiQuery,
}

/// A needle-in-a-haystack task.
pub struct Niah {
    name: &'static str,
    summary: &'static str,
    value: Value,
    needles: Needles,
}

impl RulerGenerator for Niah {
    fn name(&self) -> &'static str {
        self.name
    }
    fn summary(&self) -> &'static str {
        self.summary
    }
    fn row(&self, cx: &TrialContext<'_>, rng: &mut StdRng) -> Result<QaRow> {
        niah(self, cx, rng)
    }
}

const fn task(name: &'static str, summary: &'static str, value: Value, needles: Needles) -> Niah {
    Niah {
        name,
        summary,
        value,
        needles,
    }
}

crate::register_ruler!(task(
    "ruler-niah-single-number",
    "one needle, a 7-digit number, in essay text",
    Value::Number,
    Needles::Single
));
crate::register_ruler!(task(
    "ruler-niah-single-word",
    "one needle, a word, in essay text",
    Value::Word,
    Needles::Single
));
crate::register_ruler!(task(
    "ruler-niah-single-uuid",
    "one needle, a UUID, in essay text",
    Value::Uuid,
    Needles::Single
));
crate::register_ruler!(task(
    "ruler-niah-multikey",
    "four needles with different keys; one key is asked",
    Value::Number,
    Needles::MultiKey
));
crate::register_ruler!(task(
    "ruler-niah-multivalue",
    "four values for one key; all are expected",
    Value::Number,
    Needles::MultiValue
));
crate::register_ruler!(task(
    "ruler-niah-multiquery",
    "four keys asked at once; all their values are expected",
    Value::Number,
    Needles::MultiQuery
));

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

fn niah_intro(kind: &str) -> String {
    format!(
        "Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz you about the {kind} afterwards.\n"
    )
}

fn needle(kind: &str, key: &str, value: &str) -> String {
    format!("One of the special magic {kind} for {key} is: {value}.")
}

pub(super) fn niah_question(kind: &str, keys: &[String]) -> (String, String) {
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

fn niah(n: &Niah, cx: &TrialContext<'_>, rng: &mut StdRng) -> Result<QaRow> {
    let (depth, budget) = (cx.depth, cx.budget);
    let (kind, value): (&str, fn(&mut StdRng) -> String) = match n.value {
        Value::Word => ("words", |r| {
            NOUNS[r.random_range(0..NOUNS.len())].to_string()
        }),
        Value::Uuid => ("uuids", uuid),
        Value::Number => ("numbers", number),
    };
    let mut keys: Vec<String> = Vec::new();
    while keys.len() < 4 {
        let k = key_word(rng);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    // (key index, value) of every needle; the first is at `depth`.
    let (needles, asked): (Vec<(usize, String)>, Vec<usize>) = match n.needles {
        Needles::MultiKey => ((0..4).map(|i| (i, value(rng))).collect(), vec![0]),
        Needles::MultiValue => ((0..4).map(|_| (0, value(rng))).collect(), vec![0]),
        Needles::MultiQuery => ((0..4).map(|i| (i, value(rng))).collect(), vec![0, 1, 2, 3]),
        Needles::Single => (vec![(0, value(rng))], vec![0]),
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
        haystack: cx.essay.to_vec(),
        start: cx.start,
        facts,
        question,
        answer_prefix,
    };
    let (context, _) = layout.fit(cx.tok, budget)?;
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
