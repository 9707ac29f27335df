//! `perplexity`: perplexity of each window's continuation after the context
//! is prefilled and compressed.

use super::{EvalTask, Input, Outcomes, TaskContext, TaskMetric, TaskOutput};
use minikv_core::Result;

/// Teacher-forced perplexity of the tokens after the compressed context.
pub struct Perplexity;

impl EvalTask for Perplexity {
    fn name(&self) -> &'static str {
        "perplexity"
    }
    fn summary(&self) -> &'static str {
        "perplexity of `tokens` teacher-forced tokens after the compressed context"
    }
    fn metric(&self) -> TaskMetric {
        TaskMetric {
            name: "ppl",
            higher_is_better: false,
            outcomes: Outcomes::Continuous,
        }
    }
    fn input(&self) -> Input {
        Input::Windows
    }
    fn run(&self, cx: &TaskContext<'_>) -> Result<TaskOutput> {
        cx.each_window_with_cache(|comp, ids| {
            minikv_models::perplexity(cx.model, comp, ids, cx.spec.context, |_| {})
        })
    }
}

crate::register_task!(Perplexity);
