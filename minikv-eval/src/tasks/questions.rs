//! Question tasks: the RULER-style `ruler-*` tasks (questions generated
//! with the text as haystack) and `dataset` (rows from a JSONL file), scored
//! by `qa::evaluate` in the task's query mode.

use super::{EvalTask, Input, Outcomes, TaskContext, TaskMetric, TaskOutput, TaskSpec, to_json};
use crate::qa::{self, QaRow};
use crate::ruler::{self, RulerTask};
use minikv_core::{Error, Result};
use minikv_models::Tokenizer;

/// A set of question rows: generated RULER-style, or read from `--dataset`.
pub struct QuestionSet(pub Option<RulerTask>);

const SCORE: TaskMetric = TaskMetric {
    name: "score",
    higher_is_better: true,
    outcomes: Outcomes::Score,
};

/// The rows of a RULER-style task, generated with `text` as the haystack
/// (also what `minikv eval --export` writes).
pub fn ruler_rows(
    task: RulerTask,
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

impl EvalTask for QuestionSet {
    fn name(&self) -> &'static str {
        self.0.map_or("dataset", RulerTask::name)
    }
    fn summary(&self) -> &'static str {
        match self.0 {
            None => "question rows of a JSONL file (--dataset), each with its context",
            Some(_) => "RULER-style questions generated with the text as haystack",
        }
    }
    fn metric(&self) -> TaskMetric {
        SCORE
    }
    fn input(&self) -> Input {
        match self.0 {
            None => Input::Dataset,
            Some(_) => Input::Questions,
        }
    }
    fn family(&self) -> Option<&'static str> {
        self.0.map(|_| "ruler")
    }
    fn run(&self, cx: &TaskContext<'_>) -> Result<TaskOutput> {
        let rows = match self.0 {
            Some(t) => ruler_rows(t, cx.spec, cx.tok, cx.seed, cx.text)?,
            None => {
                let p = cx.spec.dataset.as_ref().ok_or_else(|| {
                    Error::Input("task `dataset` needs --dataset FILE.jsonl".into())
                })?;
                qa::read_dataset(p)?
            }
        };
        let r = qa::evaluate(cx.model, cx.tok, &rows, cx.spec.query, cx.cache)?;
        Ok(TaskOutput {
            metrics: to_json(&r),
            memory: None,
        })
    }
}

crate::register_task!(QuestionSet(None));
crate::register_task!(QuestionSet(Some(RulerTask::NiahSingleNumber)));
crate::register_task!(QuestionSet(Some(RulerTask::NiahSingleWord)));
crate::register_task!(QuestionSet(Some(RulerTask::NiahSingleUuid)));
crate::register_task!(QuestionSet(Some(RulerTask::NiahMultikey)));
crate::register_task!(QuestionSet(Some(RulerTask::NiahMultivalue)));
crate::register_task!(QuestionSet(Some(RulerTask::NiahMultiquery)));
crate::register_task!(QuestionSet(Some(RulerTask::VariableTracking)));
crate::register_task!(QuestionSet(Some(RulerTask::CommonWords)));
crate::register_task!(QuestionSet(Some(RulerTask::FrequentWords)));
