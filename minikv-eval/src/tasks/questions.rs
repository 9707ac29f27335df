//! Question tasks: the RULER-style `ruler-*` tasks (questions generated
//! with the text as haystack, one [`RulerGenerator`] each) and `dataset`
//! (rows from a JSONL file), scored by `qa::evaluate` in the task's query
//! mode.

use super::{
    EvalTask, Input, Outcomes, TaskContext, TaskMemory, TaskMetric, TaskOutput, TaskSpec, to_json,
};
use crate::qa::{self, QaRow};
use crate::ruler::{self, RulerGenerator};
use minikv_core::{Error, Result};
use minikv_models::Tokenizer;

const SCORE: TaskMetric = TaskMetric {
    name: "score",
    higher_is_better: true,
    outcomes: Outcomes::Score,
};

/// The rows of a RULER-style task, generated with `text` as the haystack
/// (also what `minikv eval --export` writes).
pub fn ruler_rows(
    task: &dyn RulerGenerator,
    spec: &TaskSpec,
    tok: &Tokenizer,
    seed: u64,
    text: &str,
) -> Result<Vec<QaRow>> {
    ruler::generate(
        task,
        tok,
        text,
        ruler::RulerSpec {
            context: spec.context,
            depth: spec.depth,
            trials: spec.trials,
            seed,
        },
    )
}

/// Scores question rows in the task's query mode.
fn score(cx: &TaskContext<'_>, rows: &[QaRow]) -> Result<TaskOutput> {
    let r = qa::evaluate(cx.model, cx.tok, rows, cx.spec.query, cx.cache)?;
    Ok(TaskOutput {
        memory: TaskMemory::Bytes {
            kv_bytes: r.kv_bytes,
            full_fp16_bytes: r.full_fp16_bytes,
        },
        metrics: to_json(&r),
    })
}

/// A RULER-style task: its generator's rows, scored (registered by
/// [`crate::register_ruler!`]).
pub struct RulerQuestions(pub &'static dyn RulerGenerator);

impl EvalTask for RulerQuestions {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn summary(&self) -> &'static str {
        self.0.summary()
    }
    fn metric(&self) -> TaskMetric {
        SCORE
    }
    fn input(&self) -> Input {
        Input::Questions
    }
    fn family(&self) -> Option<&'static str> {
        Some("ruler")
    }
    fn run(&self, cx: &TaskContext<'_>) -> Result<TaskOutput> {
        score(cx, &ruler_rows(self.0, cx.spec, cx.tok, cx.seed, cx.text)?)
    }
}

/// Question rows read from `--dataset`, each with its context.
pub struct Dataset;

impl EvalTask for Dataset {
    fn name(&self) -> &'static str {
        "dataset"
    }
    fn summary(&self) -> &'static str {
        "question rows of a JSONL file (--dataset), each with its context"
    }
    fn metric(&self) -> TaskMetric {
        SCORE
    }
    fn input(&self) -> Input {
        Input::Dataset
    }
    fn run(&self, cx: &TaskContext<'_>) -> Result<TaskOutput> {
        let p = cx
            .spec
            .dataset
            .as_ref()
            .ok_or_else(|| Error::Input("task `dataset` needs --dataset FILE.jsonl".into()))?;
        score(cx, &qa::read_dataset(p)?)
    }
}

crate::register_task!(Dataset);
