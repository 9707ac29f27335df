//! Entropy-gated ChunkKV (kvpress's `EntropyGatedChunkKVPress`): whole
//! chunks are kept by mean score, except chunks that are important but spiky
//! (high mean, low entropy of their scores), which keep only their best
//! `spiky_keep` tokens; the budget freed goes to further chunks.
//!
//! The inner scorer's scores are summed over heads; the prompt is cut into
//! aligned chunks of `chunk` tokens. Each chunk has its mean score and the
//! normalized entropy of its scores (shifted to be non-negative, divided by
//! `ln(len)`; 0 for a one-token chunk). A chunk is spiky when its mean is at
//! least the median of means and its entropy below the median of entropies
//! (medians as torch takes them: the lower middle). Chunks are visited by
//! decreasing mean and filled while the budget lasts (the best tokens of a
//! chunk when only part of it fits); budget left at the end goes to the best
//! remaining tokens. The selection is the same for every head. The chosen
//! tokens score above all others, so the selector takes exactly them when the
//! budget is the selection's heavy count; without a budget (decode-time
//! re-scoring) the summed scores are returned.

use minikv_core::{Error, Needs, Result, ScoreInputs, TokenScorer, register, top_k_indices};
use serde::{Deserialize, Serialize};

/// Entropy-gated ChunkKV wrapper.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EntropyGatedChunkKv {
    /// Tokens per chunk (10).
    pub chunk: usize,
    /// Tokens kept from a spiky chunk (4).
    pub spiky_keep: usize,
    /// The scorer whose scores are gated.
    pub scorer: Box<dyn TokenScorer>,
}

impl Default for EntropyGatedChunkKv {
    fn default() -> Self {
        Self {
            chunk: 10,
            spiky_keep: 4,
            scorer: Box::new(crate::SnapKv::default()),
        }
    }
}

const EPS: f32 = 1e-8;

/// Normalized entropy of a chunk's scores.
fn entropy(s: &[f32]) -> f32 {
    if s.len() < 2 {
        return 0.0;
    }
    let lo = s.iter().copied().fold(f32::INFINITY, f32::min).min(0.0);
    let sum: f32 = s.iter().map(|x| x - lo).sum::<f32>() + EPS;
    let h: f32 = s
        .iter()
        .map(|x| {
            let p = (x - lo) / sum;
            -p * (p + EPS).ln()
        })
        .sum();
    (h / (s.len() as f32).ln()).clamp(0.0, 1.0)
}

/// torch's `median()`: the lower of the two middle values.
fn lower_median(x: &[f32]) -> f32 {
    let mut v = x.to_vec();
    v.sort_by(f32::total_cmp);
    v[(v.len() - 1) / 2]
}

/// The kept positions (increasing) for summed scores `s` and a budget.
pub fn gated_selection(s: &[f32], chunk: usize, spiky_keep: usize, budget: usize) -> Vec<u32> {
    let t = s.len();
    let bounds: Vec<(usize, usize)> = (0..t)
        .step_by(chunk)
        .map(|a| (a, (a + chunk).min(t)))
        .collect();
    let means: Vec<f32> = bounds
        .iter()
        .map(|&(a, b)| s[a..b].iter().sum::<f32>() / (b - a) as f32)
        .collect();
    let ents: Vec<f32> = bounds.iter().map(|&(a, b)| entropy(&s[a..b])).collect();
    let (mt, et) = (lower_median(&means), lower_median(&ents));
    let mut order: Vec<usize> = (0..bounds.len()).collect();
    order.sort_by(|&a, &b| means[b].total_cmp(&means[a]).then(a.cmp(&b)));
    let mut keep = vec![false; t];
    let mut left = budget.min(t);
    for c in order {
        if left == 0 {
            break;
        }
        let (a, b) = bounds[c];
        let mut n = (b - a).min(left);
        if means[c] >= mt && ents[c] < et {
            n = n.min(spiky_keep);
        }
        let cand: Vec<u32> = (a as u32..b as u32).collect();
        for p in top_k_indices(s, &cand, n) {
            keep[p as usize] = true;
        }
        left -= n;
    }
    if left > 0 {
        let rest: Vec<u32> = (0..t as u32).filter(|&p| !keep[p as usize]).collect();
        for p in top_k_indices(s, &rest, left) {
            keep[p as usize] = true;
        }
    }
    (0..t as u32).filter(|&p| keep[p as usize]).collect()
}

#[typetag::serde(name = "entropy_gated_chunk_kv")]
impl TokenScorer for EntropyGatedChunkKv {
    fn needs(&self) -> Needs {
        self.scorer.needs()
    }
    fn validate(&self) -> Result<()> {
        if !(2..=4096).contains(&self.chunk) || !(1..self.chunk).contains(&self.spiky_keep) {
            return Err(Error::config(
                "cache.scorer.spiky_keep",
                format!(
                    "needs chunk > spiky_keep >= 1 and chunk <= 4096, got chunk {} and spiky_keep {}",
                    self.chunk, self.spiky_keep
                ),
            ));
        }
        self.scorer.validate()
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        self.scorer.score(inp, out)?;
        let t = inp.t;
        let mut s = vec![0.0f32; t];
        for row in out.chunks_exact(t) {
            s.iter_mut().zip(row).for_each(|(a, b)| *a += b);
        }
        if let Some(budget) = inp.budget {
            let kept = gated_selection(&s, self.chunk, self.spiky_keep, budget);
            let m = s.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let lift = 2.0 * m + 1.0;
            for p in kept {
                s[p as usize] += lift;
            }
        }
        for row in out.chunks_exact_mut(t) {
            row.copy_from_slice(&s);
        }
        Ok(())
    }
}
register!(
    Scorer,
    "entropy_gated_chunk_kv",
    EntropyGatedChunkKv,
    "ChunkKV gated by the entropy of each chunk's scores: spiky important chunks keep only their best tokens"
);
