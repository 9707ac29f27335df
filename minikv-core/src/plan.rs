//! A [`CacheConfig`] resolved once against a model into a [`CachePlan`]
//! (burn's `Config -> init`): defaults filled in, every check run, and the
//! components that go together held together, so the cache that runs it
//! never asks whether a part is there or was validated.
//!
//! ```
//! use minikv_core::{CacheConfig, CachePlan, ModelSpec};
//!
//! let spec = ModelSpec { n_layers: 2, n_q_heads: 4, n_kv_heads: 2, head_dim: 8, max_seq_len: 64, windows: Vec::new() };
//! let plan = CachePlan::new(CacheConfig::default(), &spec)?;
//! assert!(plan.selection.is_none()); // the full cache evicts nothing
//! assert_eq!(plan.n_store, 2); // one store per KV head
//! # Ok::<(), minikv_core::Error>(())
//! ```

use crate::config::{CacheConfig, HeadMode};
use crate::{Error, ModelSpec, Needs, Result, SelectionPolicy, Selector, TokenScorer};

/// Token selection of a config that evicts: the scorer with the budget
/// policy and selector that resolution gave it (the budget itself stays in
/// the config: `CacheConfig::token_budgets`).
#[derive(Debug, Clone)]
pub struct Selection {
    /// Scores the prompt's tokens.
    pub scorer: Box<dyn TokenScorer>,
    /// Splits the budget across layers.
    pub policy: Box<dyn SelectionPolicy>,
    /// Picks the kept tokens of each head from the scores.
    pub selector: Box<dyn Selector>,
}

/// A cache config resolved and checked against one model.
#[derive(Debug, Clone)]
pub struct CachePlan {
    /// The resolved config (what reports and provenance show).
    pub config: CacheConfig,
    /// Token selection; `None` keeps every token.
    pub selection: Option<Selection>,
    /// Everything the components ask of the model and the staging.
    pub needs: Needs,
    /// Storage heads per layer (KV heads, or query heads with
    /// `heads = "per_query"`).
    pub n_store: usize,
}

impl CachePlan {
    /// Resolves defaults ([`CacheConfig::resolve`]), validates the config
    /// against `spec` and gathers the components' needs.
    pub fn new(mut config: CacheConfig, spec: &ModelSpec) -> Result<Self> {
        spec.validate()?;
        config.resolve()?;
        config.validate(Some(spec))?;
        let selection = match (&config.scorer, &config.policy, &config.selector) {
            (None, _, _) => None,
            (Some(scorer), Some(policy), Some(selector)) => Some(Selection {
                scorer: scorer.clone(),
                policy: policy.clone(),
                selector: selector.clone(),
            }),
            (Some(_), _, _) => {
                return Err(Error::config(
                    "cache.policy",
                    "a scorer without a budget policy and selector after resolution",
                ));
            }
        };
        let mut needs = Needs::default();
        if let Some(s) = &selection {
            needs = needs.union(s.scorer.needs()).union(s.policy.needs());
        }
        if let Some(c) = &config.compensator {
            needs = needs.union(c.needs());
        }
        if let Some(c) = &config.channels {
            needs = needs.union(c.needs());
        }
        if config.rerotate_keys {
            needs = needs.union(Needs {
                rope: true,
                ..Needs::default()
            });
        }
        let n_store = match config.heads {
            HeadMode::PerKv => spec.n_kv_heads,
            HeadMode::PerQuery => spec.n_q_heads,
        };
        Ok(Self {
            config,
            selection,
            needs,
            n_store,
        })
    }
}
