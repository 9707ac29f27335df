//! Query-aware page selection at decode (`[cache.pages]`): every token stays
//! stored; each head's rows are cut into pages of `page_size` rows (storage
//! order = position order), each page keeps a small summary of its keys, and
//! every decode step reads only the pages whose summaries score highest for
//! the step's queries, up to `token_budget` rows (the page holding the newest
//! token always). Bytes read per decoded token are reported beside bytes held.
//!
//! What a page's summary is and how it is scored is a component
//! ([`PageScore`]): Quest's per-channel key bounds ([`QuestBound`], the
//! default) here, others in `minikv-policies`; a new one is one file plus one
//! `register!(PageScore, ...)` line (docs/adding-a-policy.md).
//!
//! Page selection reads full-precision keys and values: it refuses quantized
//! storage (its bounds would cover dequantized keys and the selected rows
//! would have to be dequantized into a gather buffer every step, which the
//! fused quantized kernels exist to avoid) and regimes that evict (pages need
//! every row in position order).
//!
//! ```
//! use minikv_core::RunConfig;
//!
//! let cfg = RunConfig::parse("[cache.pages]\npage_size = 16\ntoken_budget = 256", false)?;
//! let pages = cfg.cache.pages.as_ref().unwrap();
//! assert_eq!(pages.score.typetag_name(), "quest"); // the default page score
//! // `[cache.quest]` is the same section under its first name.
//! let old = RunConfig::parse("[cache.quest]\ntoken_budget = 256", false)?;
//! assert_eq!(old.cache.pages.unwrap().token_budget, 256);
//! # Ok::<(), minikv_core::Error>(())
//! ```

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt::Debug;

/// `[cache.pages]`: page size, rows read per step, and the page score.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PagesConfig {
    /// Rows per page (Quest's default 16).
    pub page_size: usize,
    /// Rows read per decode step and head (whole pages; Quest's budgets are
    /// 256-4096 tokens).
    pub token_budget: usize,
    /// How pages are summarized and scored (default `quest`).
    pub score: Box<dyn PageScore>,
}

impl Default for PagesConfig {
    fn default() -> Self {
        Self {
            page_size: 16,
            token_budget: 512,
            score: Box::new(QuestBound::default()),
        }
    }
}

impl PagesConfig {
    /// Checks the numbers and the page score.
    pub fn validate(&self) -> Result<()> {
        if !(1..=4096).contains(&self.page_size) {
            return Err(Error::config(
                "cache.pages.page_size",
                format!("must be in 1..=4096, got {}", self.page_size),
            ));
        }
        if self.token_budget < self.page_size || self.token_budget > 1 << 24 {
            return Err(Error::config(
                "cache.pages.token_budget",
                format!(
                    "must be at least one page ({}) and at most 16777216, got {}",
                    self.page_size, self.token_budget
                ),
            ));
        }
        self.score.validate()
    }
}

/// How a page of keys is summarized and scored against a decode query.
///
/// The summary of a page is `summary_len(d)` floats, built row by row as keys
/// arrive ([`add_row`](PageScore::add_row)); [`score`](PageScore::score)
/// ranks pages for the query heads that read the storage head. Higher is
/// read first; ties go to the earlier page.
#[typetag::serde(tag = "type")]
pub trait PageScore: Send + Sync + Debug + dyn_clone::DynClone {
    /// Checks parameters; errors name the field (`cache.pages.score.x`).
    fn validate(&self) -> Result<()> {
        Ok(())
    }
    /// Floats per page summary for `d`-wide keys.
    fn summary_len(&self, d: usize) -> usize;
    /// Folds key `row` (`[d]`) into `summary`; `first` for a page's first row
    /// (the summary holds whatever the previous page's first row left: zeros
    /// only for a new allocation, so write every float on `first`).
    fn add_row(&self, summary: &mut [f32], row: &[f32], first: bool);
    /// The page's score for queries `q` (`[g][d]`, the query heads of the
    /// storage head).
    fn score(&self, summary: &[f32], q: &[f32], d: usize) -> f32;
}

dyn_clone::clone_trait_object!(PageScore);

/// Quest (Tang et al. 2024): a page keeps the per-channel minimum and maximum
/// of its keys, `[min; d][max; d]`; its score is the upper bound on any of
/// its logits, `max_j Σ_c max(q_jc·min_c, q_jc·max_c)` over the query heads `j`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuestBound {}

#[typetag::serde(name = "quest")]
impl PageScore for QuestBound {
    fn summary_len(&self, d: usize) -> usize {
        2 * d
    }

    fn add_row(&self, summary: &mut [f32], row: &[f32], first: bool) {
        let (lo, hi) = summary.split_at_mut(row.len());
        if first {
            lo.copy_from_slice(row);
            hi.copy_from_slice(row);
            return;
        }
        for ((l, h), &x) in lo.iter_mut().zip(hi.iter_mut()).zip(row) {
            *l = l.min(x);
            *h = h.max(x);
        }
    }

    fn score(&self, summary: &[f32], q: &[f32], d: usize) -> f32 {
        let (lo, hi) = summary.split_at(d);
        q.chunks_exact(d)
            .map(|qj| {
                (0..d)
                    .map(|c| (qj[c] * lo[c]).max(qj[c] * hi[c]))
                    .sum::<f32>()
            })
            .fold(f32::NEG_INFINITY, f32::max)
    }
}

crate::register!(
    PageScore,
    "quest",
    QuestBound,
    "Quest: per-channel key min/max per page, scored by the upper bound on q.k (default)"
);
