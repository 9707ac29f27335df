//! `passkey`, `needle`, `kv-retrieval`: a fact hidden in essay filler at a
//! depth, asked for after compression; greedy answers, exact match.

use super::{EvalTask, Input, Outcomes, TaskContext, TaskMemory, TaskMetric, TaskOutput, to_json};
use crate::Retrieval;
use minikv_core::Result;

/// One retrieval task.
pub struct RetrievalTask(pub Retrieval);

impl EvalTask for RetrievalTask {
    fn name(&self) -> &'static str {
        match self.0 {
            Retrieval::Passkey => "passkey",
            Retrieval::Needle => "needle",
            Retrieval::KvRetrieval => "kv-retrieval",
        }
    }
    fn summary(&self) -> &'static str {
        match self.0 {
            Retrieval::Passkey => "a random 5-digit pass key hidden in essay text",
            Retrieval::Needle => "the San Francisco needle sentence hidden in essay text",
            Retrieval::KvRetrieval => "synthetic `key: value` lines; one key is asked for",
        }
    }
    fn metric(&self) -> TaskMetric {
        TaskMetric {
            name: "accuracy",
            higher_is_better: true,
            outcomes: Outcomes::Binary,
        }
    }
    fn input(&self) -> Input {
        Input::Haystack
    }
    fn run(&self, cx: &TaskContext<'_>) -> Result<TaskOutput> {
        let spec = crate::PasskeySpec {
            context: cx.spec.context,
            depth: cx.spec.depth,
            trials: cx.spec.trials,
            seed: cx.seed,
        };
        let r = crate::retrieval(self.0, cx.model, cx.tok, cx.tokens, spec, cx.cache)?;
        Ok(TaskOutput {
            memory: TaskMemory::Bytes {
                kv_bytes: r.kv_bytes,
                full_fp16_bytes: r.full_fp16_bytes,
            },
            metrics: to_json(&r),
        })
    }
}

crate::register_task!(RetrievalTask(Retrieval::Passkey));
crate::register_task!(RetrievalTask(Retrieval::Needle));
crate::register_task!(RetrievalTask(Retrieval::KvRetrieval));
