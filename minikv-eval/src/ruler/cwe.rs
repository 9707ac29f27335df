//! `ruler-cwe`: the ten most common words of a numbered list.

use super::{RulerGenerator, TrialContext};
use crate::qa::{Answer, Metric, QaRow};
use minikv_core::{Error, Result};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// Common words extraction.
pub struct CommonWords;

impl RulerGenerator for CommonWords {
    fn name(&self) -> &'static str {
        "ruler-cwe"
    }
    fn summary(&self) -> &'static str {
        "the ten most common words of a numbered list"
    }
    fn row(&self, cx: &TrialContext<'_>, rng: &mut StdRng) -> Result<QaRow> {
        cwe(cx, rng)
    }
}

crate::register_ruler!(CommonWords);

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

fn cwe(cx: &TrialContext<'_>, rng: &mut StdRng) -> Result<QaRow> {
    let (tok, essay, budget) = (cx.tok, cx.essay, cx.budget);
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
