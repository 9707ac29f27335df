//! Block-wise iterative selection (kvpress's `BlockPress`, after KeyDiff's
//! block prompt processing): the prompt is taken block by block as a chunked
//! prefill would see it, and each step keeps the best `budget` of what was
//! kept so far plus the new block.
//!
//! Per KV head, the first `budget` tokens start as kept; for each following
//! block of `block` tokens the inner scorer scores the kept tokens and the
//! block (only their keys and values: a scorer that needs attention
//! statistics or queries is refused), and the `budget` best become the kept
//! set. The final kept tokens score above all others, so the selector takes
//! exactly them when its heavy count is the budget. Without a budget
//! (decode-time re-scoring) the inner scores are returned.

use minikv_core::{
    Error, LayerSignals, ModelSpec, Needs, Result, ScoreInputs, TokenScorer, broadcast_kv,
    check_range, register, top_k_indices,
};
use serde::{Deserialize, Serialize};

/// Block-wise selection wrapper (kvpress default: blocks of 128).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Block {
    /// Tokens per block (128).
    pub block: usize,
    /// The scorer run on each block (keys and values only; default KeyDiff).
    pub scorer: Box<dyn TokenScorer>,
}

impl Default for Block {
    fn default() -> Self {
        Self {
            block: 128,
            scorer: Box::new(crate::KeyDiff {}),
        }
    }
}

impl Block {
    /// The kept positions of KV head `kv` for `budget` tokens.
    fn head_selection(&self, inp: &ScoreInputs<'_>, kv: usize, budget: usize) -> Result<Vec<u32>> {
        let (t, d, g) = (inp.t, inp.spec.head_dim, inp.spec.group());
        let sub = ModelSpec {
            n_q_heads: g,
            n_kv_heads: 1,
            windows: Vec::new(),
            ..*inp.spec
        };
        let mut kept: Vec<u32> = (0..budget.min(t) as u32).collect();
        let (mut k, mut v, mut s) = (Vec::new(), Vec::new(), Vec::new());
        let mut start = budget.min(t);
        while start < t {
            let end = (start + self.block).min(t);
            let cur: Vec<u32> = kept
                .iter()
                .copied()
                .chain(start as u32..end as u32)
                .collect();
            k.clear();
            v.clear();
            for &p in &cur {
                let p = p as usize;
                k.extend_from_slice(&inp.keys[kv][p * d..(p + 1) * d]);
                v.extend_from_slice(&inp.values[kv][p * d..(p + 1) * d]);
            }
            let n = cur.len();
            let (keys, values) = ([&k[..]], [&v[..]]);
            let sig = LayerSignals {
                spec: &sub,
                layer: inp.layer,
                t: n,
                keys: &keys,
                values: &values,
                cumulative: None,
                window_queries: None,
                window: 0,
                query_stats: None,
                output_projection: None,
                reconstruction: None,
                budget: Some(budget),
                rope: None,
            };
            s.clear();
            s.resize(g * n, 0.0);
            self.scorer.score(&sig, &mut s)?;
            let mean: Vec<f32> = (0..n)
                .map(|j| (0..g).map(|h| s[h * n + j]).sum::<f32>() / g as f32)
                .collect();
            let all: Vec<u32> = (0..n as u32).collect();
            kept = top_k_indices(&mean, &all, budget)
                .into_iter()
                .map(|i| cur[i as usize])
                .collect();
            kept.sort_unstable();
            start = end;
        }
        Ok(kept)
    }
}

#[typetag::serde(name = "block")]
impl TokenScorer for Block {
    fn needs(&self) -> Needs {
        Needs::default()
    }
    fn validate(&self) -> Result<()> {
        check_range("cache.scorer.block", self.block, 1, 65536)?;
        let n = self.scorer.needs();
        if n != Needs::default() {
            return Err(Error::config(
                "cache.scorer.scorer",
                "block scores each block from its keys and values only; this scorer needs prompt \
                 signals (attention, queries or model facts)",
            ));
        }
        self.scorer.validate()
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let t = inp.t;
        let Some(budget) = inp.budget else {
            return self.scorer.score(inp, out);
        };
        let mut kv_rows = vec![0.0f32; inp.spec.n_kv_heads * t];
        for (kv, row) in kv_rows.chunks_exact_mut(t).enumerate() {
            for p in self.head_selection(inp, kv, budget)? {
                row[p as usize] = 1.0;
            }
        }
        broadcast_kv(&kv_rows, inp.spec.n_q_heads, inp.spec.n_kv_heads, t, out);
        Ok(())
    }
}
register!(
    Scorer,
    "block",
    Block,
    "Block-wise iterative selection: the budget's best of what was kept plus each new block (keys/values scorers)"
);
