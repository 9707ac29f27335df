//! `ruler-fwe`: the three most frequent words of a coded text whose words
//! are drawn with Zipf weights.

use super::{RulerGenerator, TrialContext};
use crate::qa::{Answer, Metric, QaRow};
use minikv_core::{Error, Result};
use rand::{Rng, rngs::StdRng};

/// Frequent words extraction.
pub struct FrequentWords;

impl RulerGenerator for FrequentWords {
    fn name(&self) -> &'static str {
        "ruler-fwe"
    }
    fn summary(&self) -> &'static str {
        "the three most frequent words of a coded text (Zipf-distributed)"
    }
    fn row(&self, cx: &TrialContext<'_>, rng: &mut StdRng) -> Result<QaRow> {
        fwe(cx, rng)
    }
}

crate::register_ruler!(FrequentWords);

fn fwe(cx: &TrialContext<'_>, rng: &mut StdRng) -> Result<QaRow> {
    let (tok, budget) = (cx.tok, cx.budget);
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
