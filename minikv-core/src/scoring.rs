//! Token scorers: how important is each prompt token? (higher = keep)

use crate::{ModelSpec, Result};
use serde::{Deserialize, Serialize};
use std::fmt::Debug;

/// What a component (scorer, layer-budget policy, compensator) needs the cache
/// to collect during prefill; the cache collects the union of all needs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    /// Column sums of the causal softmax over all prompt rows (`A_cumul`, §3).
    pub cumulative_attention: bool,
    /// Keep the last `query_window` prompt queries (post-RoPE) for the scorer.
    pub query_window: usize,
    /// Mean and covariance of the pre-RoPE prompt queries per query head, over
    /// prompt positions from this one on (and the model's RoPE): the
    /// statistics of future queries (Expected Attention).
    pub query_stats_from: Option<usize>,
    /// The layer's attention output projection (CriticalKV).
    pub output_projection: bool,
    /// Per prompt token, the maximum attention it receives from a context
    /// reconstruction pass (KVzip); the value is the number of leading sink
    /// tokens the pass's attention also sees.
    pub reconstruction: Option<usize>,
    /// With `reconstruction`: the pass repeats the whole context as it is,
    /// in one pass, its queries attending to every token before them
    /// (KVCompose), instead of KVzip's instruction and chunks.
    pub plain_pass: bool,
    /// The model's rotary embedding ([`LayerSignals::rope`]), for scorers that
    /// read pre-RoPE keys ([`crate::Rope::unrotate`]).
    pub rope: bool,
}

impl Needs {
    /// A `query_window` that keeps every prompt query (non-causal scorers).
    pub const ALL_QUERIES: usize = usize::MAX;

    /// Union of two needs.
    pub fn union(self, o: Needs) -> Needs {
        Needs {
            cumulative_attention: self.cumulative_attention || o.cumulative_attention,
            query_window: self.query_window.max(o.query_window),
            query_stats_from: match (self.query_stats_from, o.query_stats_from) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
            output_projection: self.output_projection || o.output_projection,
            reconstruction: match (self.reconstruction, o.reconstruction) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            },
            plain_pass: self.plain_pass || o.plain_pass,
            rope: self.rope || o.rope,
        }
    }
}

/// One decode step of one storage head, as a decode-time score rule sees it.
#[derive(Debug, Clone, Copy)]
pub struct DecodeStep<'a> {
    /// Position of each stored row (storage order: after decode-time eviction
    /// rows are not in position order, so rules read positions from here).
    pub positions: &'a [u32],
    /// This step's attention over the head's rows, reduced over the query heads
    /// of the group as `cache.gqa_reduce` says (sum in `per_query` mode).
    pub probs: &'a [f32],
    /// This step's attention averaged over every query head of the layer, when
    /// the rule asked for it ([`DecodeScore::wants_layer_mean`]) and every head
    /// of the layer holds the same rows; `None` otherwise.
    pub layer_mean: Option<&'a [f32]>,
}

/// A scorer's own decode-time signal: how the running score of each stored row
/// evolves while tokens are generated (H2O accumulates attention, TOVA takes
/// the last query's, StreamingLLM uses the position).
///
/// A scorer without one still gets decode-time eviction: the cache then
/// re-runs [`TokenScorer::score`] on the stored rows (in position order) with
/// the latest decode queries as its query window, every `cache.decode.every`
/// steps (the analogue of kvpress's decoding-time wrapper).
pub trait DecodeScore: Send + Sync + Debug {
    /// Whether [`DecodeStep::layer_mean`] should be computed.
    fn wants_layer_mean(&self) -> bool {
        false
    }
    /// The running score a row starts with: at the end of prefill
    /// `prefill_score` is the scorer's prompt score; a generated token starts
    /// with `prefill_score = 0`.
    fn initial(&self, position: u32, prefill_score: f32) -> f32 {
        let _ = position;
        prefill_score
    }
    /// Updates the running scores (`scores[i]` belongs to row `i`) after a step.
    fn update(&self, step: &DecodeStep<'_>, scores: &mut [f32]);
}

/// The signals of one layer, as a scorer (and a signal-driven layer-budget
/// policy, through [`BudgetRequest::layers`](crate::BudgetRequest::layers))
/// sees them: what the cache collected during prefill because a component
/// asked for it through its [`Needs`].
///
/// All slices are head-major. Query-head arrays have `Hq` heads; key/value arrays
/// `Hkv` heads. During decode-time rescoring the view is one storage head's
/// (`spec.n_kv_heads = 1`, `spec.n_q_heads` = the query heads reading it).
#[derive(Debug, Clone, Copy)]
pub struct LayerSignals<'a> {
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
    /// Pre-RoPE query statistics, if requested ([`Needs::query_stats_from`]).
    pub query_stats: Option<QueryStats<'a>>,
    /// The layer's output projection `[hidden][Hq * d]`, if requested.
    pub output_projection: Option<&'a [f32]>,
    /// Reconstruction scores `[Hq][T]` (per query head, the maximum attention
    /// each prompt token received from the pass's queries), if requested.
    pub reconstruction: Option<&'a [f32]>,
    /// Tokens the selection will keep per storage head in this layer (heavy
    /// hitters, recent window excluded), when scores feed a selection (not
    /// when a layer-budget policy reads the signals).
    pub budget: Option<usize>,
    /// The model's rotary embedding, if requested ([`Needs::rope`]) and the
    /// model hands it over; prompt token `j` sits at position `j`.
    pub rope: Option<&'a crate::Rope>,
}

/// Statistics of a layer's pre-RoPE prompt queries, per query head.
#[derive(Debug, Clone, Copy)]
pub struct QueryStats<'a> {
    /// Queries counted.
    pub n: usize,
    /// Mean `[Hq][d]`.
    pub mean: &'a [f64],
    /// Covariance `[Hq][d][d]` (divided by `n`).
    pub cov: &'a [f64],
    /// The RoPE the model applies to them.
    pub rope: &'a crate::Rope,
}

/// The scorer's view of a layer: the same as [`LayerSignals`].
pub type ScoreInputs<'a> = LayerSignals<'a>;

/// A token-importance signal. Implementations live in `minikv-policies`.
///
/// `score` writes one score per **query head** and prompt token into `out`
/// (`[Hq][T]`, higher = keep); the cache aggregates query heads into KV heads as the
/// config says (`cache.gqa_reduce`), or keeps them per query head (`cache.heads =
/// "per_query"`). Scorers that only look at keys write the same row for every
/// query head of a group.
#[typetag::serde(tag = "type")]
pub trait TokenScorer: Send + Sync + Debug + dyn_clone::DynClone {
    /// What the cache must collect during prefill.
    fn needs(&self) -> Needs;
    /// Scores `[Hq][T]` for one layer.
    fn score(&self, inputs: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()>;
    /// The scorer's own decode-time signal for `cache.decode = "evict"`.
    /// `None` (the default) means that decode-time eviction re-runs
    /// [`score`](TokenScorer::score) on the stored rows with the latest decode
    /// queries as the window; every scorer can therefore evict during decode.
    fn decode_score(&self) -> Option<&dyn DecodeScore> {
        None
    }
    /// Checks parameters; called when a cache is built.
    fn validate(&self) -> Result<()> {
        Ok(())
    }
    /// Makes relative file paths in the scorer's parameters relative to
    /// `dir`, the folder of the config file that named them.
    fn resolve_paths(&mut self, _dir: &std::path::Path) {}
}

dyn_clone::clone_trait_object!(TokenScorer);

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

/// The inverse direction of [`reduce_gqa`]: KV-head rows `[Hkv][T]` copied to
/// every query head of their group, `out` `[Hq][T]` (for scorers that score
/// per KV head).
pub fn broadcast_kv(kv_rows: &[f32], hq: usize, hkv: usize, t: usize, out: &mut [f32]) {
    let g = hq / hkv;
    for (h, row) in out.chunks_exact_mut(t).take(hq).enumerate() {
        row.copy_from_slice(&kv_rows[(h / g) * t..(h / g + 1) * t]);
    }
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
