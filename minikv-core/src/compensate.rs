//! Compensation for evicted tokens: the extension point behind ResKV (residual
//! cluster summaries) and merge-style methods (evicted values folded into the
//! kept ones).
//!
//! At the end of prefill, after selection, the cache hands each storage head's
//! prompt, its kept set and its scores to the [`Compensator`]. It returns the
//! final kept set (it may demote kept tokens to make room), optional
//! replacement values for the kept rows (merge methods), and extra attention
//! entries: keys, values and a logit bias each, which join the decode softmax
//! beside the real tokens. An optional [`LogitGate`] adds a per-query
//! `log g(q)` to every extra entry's logit, computed from the query's logits
//! over the head's real tokens. Backends know only these generic entries.
//!
//! ```
//! use minikv_core::compensate::{CompensateInput, Compensation, Compensator};
//! use minikv_core::Result;
//!
//! /// Keeps every evicted token's mean as one extra entry with bias ln(count).
//! #[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
//! struct MeanOfEvicted;
//!
//! #[typetag::serde(name = "mean_of_evicted_doc")]
//! impl Compensator for MeanOfEvicted {
//!     fn compensate(&self, inp: &CompensateInput<'_>) -> Result<Compensation> {
//!         let evicted = inp.evicted();
//!         let mut c = Compensation::keep(inp.kept.to_vec());
//!         if !evicted.is_empty() {
//!             let (mut k, mut v) = (vec![0.0; inp.d], vec![0.0; inp.d]);
//!             for &p in &evicted {
//!                 for c in 0..inp.d {
//!                     k[c] += inp.key(p)[c] / evicted.len() as f32;
//!                     v[c] += inp.value(p)[c] / evicted.len() as f32;
//!                 }
//!             }
//!             c.push_entry(&k, &v, (evicted.len() as f32).ln());
//!         }
//!         Ok(c)
//!     }
//! }
//!
//! let keys: Vec<f32> = (0..8).map(|i| i as f32).collect(); // 4 tokens, d = 2
//! let inp = CompensateInput {
//!     layer: 0, head: 0, d: 2, t: 4, keys: &keys, values: &keys,
//!     kept: &[0, 3], scores: &[1.0, 0.0, 0.0, 1.0], sinks: 0, recent: 1,
//!     queries: &[], n_queries: 0,
//! };
//! let c = MeanOfEvicted.compensate(&inp)?;
//! assert_eq!(c.entries.keys, vec![3.0, 4.0]); // mean of tokens 1 and 2
//! assert_eq!(c.entries.bias, vec![2f32.ln()]);
//! # Ok::<(), minikv_core::Error>(())
//! ```

use crate::{Needs, Result};
use std::fmt::Debug;
use std::sync::Arc;

/// One storage head's prompt at the end of prefill, with its selection.
#[derive(Debug, Clone, Copy)]
pub struct CompensateInput<'a> {
    /// Layer index.
    pub layer: usize,
    /// Storage head index.
    pub head: usize,
    /// Head dimension.
    pub d: usize,
    /// Prompt length `T`.
    pub t: usize,
    /// The head's prompt keys `[T][d]` (post-RoPE, full precision).
    pub keys: &'a [f32],
    /// The head's prompt values `[T][d]`.
    pub values: &'a [f32],
    /// Kept positions, increasing.
    pub kept: &'a [u32],
    /// The head's scores `[T]` (higher = more important).
    pub scores: &'a [f32],
    /// Protected prefix (attention sinks).
    pub sinks: usize,
    /// Protected recent window of this layer.
    pub recent: usize,
    /// The last prompt queries of the query heads reading this head,
    /// `[n_queries][d]` (token-major, then query head), unscaled; as many as
    /// [`Compensator::needs`] asked for (`query_window` tokens).
    pub queries: &'a [f32],
    /// Rows in `queries`.
    pub n_queries: usize,
}

impl CompensateInput<'_> {
    /// Key of prompt position `p`.
    pub fn key(&self, p: u32) -> &[f32] {
        &self.keys[p as usize * self.d..(p as usize + 1) * self.d]
    }
    /// Value of prompt position `p`.
    pub fn value(&self, p: u32) -> &[f32] {
        &self.values[p as usize * self.d..(p as usize + 1) * self.d]
    }
    /// Positions not in `kept`, increasing.
    pub fn evicted(&self) -> Vec<u32> {
        evicted_of(self.kept, self.t)
    }
}

/// Positions in `0..t` not in the increasing list `kept`.
pub fn evicted_of(kept: &[u32], t: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(t - kept.len().min(t));
    let mut k = kept.iter().peekable();
    for p in 0..t as u32 {
        if k.peek() == Some(&&p) {
            k.next();
        } else {
            out.push(p);
        }
    }
    out
}

/// Extra attention entries of one head: each has a key, a value and a logit
/// bias, and joins the decode softmax beside the real tokens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExtraEntries {
    /// Keys `[c][d]`.
    pub keys: Vec<f32>,
    /// Values `[c][d]`.
    pub values: Vec<f32>,
    /// Logit bias per entry `[c]`.
    pub bias: Vec<f32>,
}

impl ExtraEntries {
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.bias.len()
    }
    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.bias.is_empty()
    }
}

/// What a compensator returns for one head.
#[derive(Debug, Clone, Default)]
pub struct Compensation {
    /// Final kept positions, increasing (a subset of the input's kept set).
    pub kept: Vec<u32>,
    /// Replacement values for the kept rows, `[kept.len()][d]` (merge
    /// methods); `None` keeps the prompt's values.
    pub values: Option<Vec<f32>>,
    /// Extra attention entries.
    pub entries: ExtraEntries,
    /// Named measurements (averaged per layer and overall into the cache's
    /// diagnostics under the compensator's type name).
    pub stats: Vec<(&'static str, f64)>,
}

impl Compensation {
    /// Keeps `kept` unchanged, no entries.
    pub fn keep(kept: Vec<u32>) -> Self {
        Self {
            kept,
            ..Default::default()
        }
    }
    /// Appends one extra entry.
    pub fn push_entry(&mut self, key: &[f32], value: &[f32], bias: f32) {
        self.entries.keys.extend_from_slice(key);
        self.entries.values.extend_from_slice(value);
        self.entries.bias.push(bias);
    }
}

/// A per-query gate on the extra entries: `log g(q)` is added to every extra
/// entry's logit, computed from the query's scaled logits over the head's real
/// tokens.
pub trait LogitGate: Send + Sync + Debug {
    /// `log g` from f32 logits (the tiled backend).
    fn log_gate(&self, exact_logits: &[f32]) -> f32;
    /// `log g` from f64 logits (the reference backend); by default through f32.
    fn log_gate_f64(&self, exact_logits: &[f64]) -> f64 {
        let v: Vec<f32> = exact_logits.iter().map(|&x| x as f32).collect();
        self.log_gate(&v) as f64
    }
}

/// Compensation for evicted tokens. Implementations live in `minikv-policies`
/// (`reskv`); set under `[cache.compensator]` with a `type`.
#[typetag::serde(tag = "type")]
pub trait Compensator: Send + Sync + Debug + dyn_clone::DynClone {
    /// What the cache must collect during prefill (e.g. held-out queries).
    fn needs(&self) -> Needs {
        Needs::default()
    }
    /// Checks parameters; errors name the field (`cache.compensator.x`).
    fn validate(&self) -> Result<()> {
        Ok(())
    }
    /// The decode-time gate shared by every head, if any.
    fn gate(&self) -> Option<Arc<dyn LogitGate>> {
        None
    }
    /// Compensates one head.
    fn compensate(&self, input: &CompensateInput<'_>) -> Result<Compensation>;
}

dyn_clone::clone_trait_object!(Compensator);
