//! `attention-error`: per-layer attention-output error of the compressed
//! cache against the full cache, on the same hidden states.

use super::{EvalTask, Input, Outcomes, TaskContext, TaskMetric, TaskOutput, Trial, to_json};
use minikv_core::Result;

/// Relative attention-output error per layer (both caches see the full
/// cache's hidden states, so errors do not compound across layers).
pub struct AttentionError;

impl EvalTask for AttentionError {
    fn name(&self) -> &'static str {
        "attention-error"
    }
    fn summary(&self) -> &'static str {
        "per-layer |o - o_full| / |o_full| of attention outputs, on the full cache's states"
    }
    fn metric(&self) -> TaskMetric {
        TaskMetric {
            name: "rel_error",
            higher_is_better: false,
            outcomes: Outcomes::Continuous,
        }
    }
    fn input(&self) -> Input {
        Input::Windows
    }
    fn run(&self, cx: &TaskContext<'_>) -> Result<TaskOutput> {
        cx.each_window(|ids| {
            let (e, memory, diagnostics) = crate::attention_error(
                cx.model,
                (cx.full_cache)()?,
                (cx.cache)()?,
                ids,
                cx.spec.context,
            )?;
            Ok(Trial {
                metrics: to_json(&e),
                memory,
                diagnostics,
            })
        })
    }
}

crate::register_task!(AttentionError);
