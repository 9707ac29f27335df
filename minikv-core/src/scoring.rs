//! Token scorers: how important is each prompt token? (higher = keep)

use crate::{ModelSpec, Result};
use serde::{Deserialize, Serialize};
use std::fmt::Debug;

/// What a scorer needs the cache to collect during prefill.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    /// Column sums of the causal softmax over all prompt rows (`A_cumul`, §3).
    pub cumulative_attention: bool,
    /// Keep the last `query_window` prompt queries (post-RoPE) for the scorer.
    pub query_window: usize,
}

impl Needs {
    /// Union of two needs.
    pub fn union(self, o: Needs) -> Needs {
        Needs {
            cumulative_attention: self.cumulative_attention || o.cumulative_attention,
            query_window: self.query_window.max(o.query_window),
        }
    }
}

/// How scores evolve during decode, for policies that evict while generating.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DynamicRule {
    /// H2O: add each step's attention row to the kept tokens' scores.
    Accumulate,
    /// TOVA: the score is the attention of the latest query (layer mean over heads).
    LastQuery,
    /// StreamingLLM-style: the score is the position (oldest evicted first).
    Recency,
}

/// The signals available to a scorer at the end of prefill, for one layer.
///
/// All slices are head-major. Query-head arrays have `Hq` heads; key/value arrays
/// `Hkv` heads.
#[derive(Debug)]
pub struct ScoreInputs<'a> {
    /// Model shape.
    pub spec: &'a ModelSpec,
    /// Layer index.
    pub layer: usize,
    /// Prompt length `T`.
    pub t: usize,
    /// Keys `[Hkv][T][d]` (post-RoPE, full precision).
    pub keys: &'a [&'a [f32]],
    /// Values `[Hkv][T][d]`.
    pub values: &'a [&'a [f32]],
    /// `A_cumul` per query head `[Hq][T]`, if requested.
    pub cumulative: Option<&'a [f32]>,
    /// The last `w` prompt queries `[Hq][w][d]`, if requested (`w = min(T, window)`).
    pub window_queries: Option<&'a [f32]>,
    /// Number of rows in `window_queries`.
    pub window: usize,
}

/// A token-importance signal. Implementations live in `minikv-policies`.
///
/// `score` writes one score per **query head** and prompt token into `out`
/// (`[Hq][T]`, higher = keep); the cache aggregates query heads into KV heads as the
/// config says (`cache.gqa_reduce`), or keeps them per query head (`cache.heads =
/// "per_query"`). Scorers that only look at keys write the same row for every
/// query head of a group.
#[typetag::serde(tag = "type")]
pub trait TokenScorer: Send + Sync + Debug {
    /// What the cache must collect during prefill.
    fn needs(&self) -> Needs;
    /// Scores `[Hq][T]` for one layer.
    fn score(&self, inputs: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()>;
    /// How scores evolve during decode when `cache.decode = "evict"`. `None` means
    /// the scorer is prefill-only and cannot drive decode-time eviction.
    fn dynamic_rule(&self) -> Option<DynamicRule> {
        None
    }
    /// Checks parameters; called when a cache is built.
    fn validate(&self) -> Result<()> {
        Ok(())
    }
}

/// How the scores of the query heads of a GQA group become one KV-head score.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GqaReduce {
    /// Mean over the group.
    #[default]
    Mean,
    /// Maximum over the group.
    Max,
    /// Sum over the group.
    Sum,
}

/// Aggregates `[Hq][T]` scores into `[Hkv][T]` with `reduce`.
pub fn reduce_gqa(scores: &[f32], hq: usize, hkv: usize, t: usize, reduce: GqaReduce) -> Vec<f32> {
    let g = hq / hkv;
    let mut out = vec![0.0f32; hkv * t];
    for kv in 0..hkv {
        let o = &mut out[kv * t..(kv + 1) * t];
        for j in 0..g {
            let row = &scores[(kv * g + j) * t..(kv * g + j + 1) * t];
            match reduce {
                GqaReduce::Max => {
                    if j == 0 {
                        o.copy_from_slice(row);
                    } else {
                        o.iter_mut().zip(row).for_each(|(a, b)| *a = a.max(*b));
                    }
                }
                GqaReduce::Mean | GqaReduce::Sum => {
                    o.iter_mut().zip(row).for_each(|(a, b)| *a += b)
                }
            }
        }
        if reduce == GqaReduce::Mean {
            let inv = 1.0 / g as f32;
            o.iter_mut().for_each(|a| *a *= inv);
        }
    }
    out
}
