//! `fidelity`: next-token agreement (KL, top-1) of the compressed cache with
//! the full cache on the same tokens.

use super::{EvalTask, Input, Outcomes, TaskContext, TaskMetric, TaskOutput};
use minikv_core::Result;

/// KL(full || compressed) of the next-token distributions after the context.
pub struct Fidelity;

impl EvalTask for Fidelity {
    fn name(&self) -> &'static str {
        "fidelity"
    }
    fn summary(&self) -> &'static str {
        "KL and top-1 agreement with the full cache, teacher-forced after the context"
    }
    fn metric(&self) -> TaskMetric {
        TaskMetric {
            name: "kl",
            higher_is_better: false,
            outcomes: Outcomes::Continuous,
        }
    }
    fn input(&self) -> Input {
        Input::Windows
    }
    fn run(&self, cx: &TaskContext<'_>) -> Result<TaskOutput> {
        cx.each_window_with_cache(|comp, ids| {
            // The full cache's logits of this window, shared by every config
            // the caller runs on it.
            let reference = (cx.reference)(ids)?;
            crate::fidelity_against(cx.model, comp, ids, cx.spec.context, &reference)
        })
    }
}

crate::register_task!(Fidelity);
