//! `generation`: greedy generation from the compressed cache compared with
//! the full cache's.

use super::{EvalTask, Input, Outcomes, TaskContext, TaskMetric, TaskOutput};
use minikv_core::Result;

/// Token F1 (and exact prefix) of greedy continuations, compressed vs full.
pub struct Generation;

impl EvalTask for Generation {
    fn name(&self) -> &'static str {
        "generation"
    }
    fn summary(&self) -> &'static str {
        "greedy `tokens`-token continuations of the context, compressed vs full cache"
    }
    fn metric(&self) -> TaskMetric {
        TaskMetric {
            name: "token_f1",
            higher_is_better: true,
            outcomes: Outcomes::Continuous,
        }
    }
    fn input(&self) -> Input {
        Input::Windows
    }
    fn run(&self, cx: &TaskContext<'_>) -> Result<TaskOutput> {
        cx.each_window_with_cache(|comp, ids| {
            crate::generation_agreement(
                cx.model,
                cx.tok,
                (cx.full_cache)()?.as_mut(),
                comp,
                &ids[..cx.spec.context],
                cx.spec.tokens,
            )
        })
    }
}

crate::register_task!(Generation);
