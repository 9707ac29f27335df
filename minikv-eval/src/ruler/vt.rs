//! `ruler-vt`: variable tracking through a chain of assignments hidden in
//! RULER's noise text.

use super::{Layout, RulerGenerator, TrialContext};
use crate::qa::{Answer, Metric, QaRow};
use minikv_core::Result;
use rand::{Rng, rngs::StdRng};

/// Variable tracking: five variables assigned one value through each other.
pub struct VariableTracking;

impl RulerGenerator for VariableTracking {
    fn name(&self) -> &'static str {
        "ruler-vt"
    }
    fn summary(&self) -> &'static str {
        "a chain of five variables assigned one value through each other"
    }
    fn row(&self, cx: &TrialContext<'_>, rng: &mut StdRng) -> Result<QaRow> {
        vt(cx, rng)
    }
}

crate::register_ruler!(VariableTracking);

fn var_name(rng: &mut StdRng) -> String {
    (0..5)
        .map(|_| char::from(b'A' + rng.random_range(0..26u8)))
        .collect()
}

fn vt(cx: &TrialContext<'_>, rng: &mut StdRng) -> Result<QaRow> {
    let (noise, depth) = (cx.noise, cx.depth);
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
    let (context, _) = layout.fit(cx.tok, cx.budget)?;
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
