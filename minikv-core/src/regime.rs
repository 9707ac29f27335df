//! Decode regimes (`[cache.decode]`): what happens to the stored rows while
//! decoding. The default, [`Frozen`], keeps the selection made at the end of
//! prefill and appends every generated token (MiniKV, SnapKV, PyramidKV);
//! `evict` (in `minikv-policies`) keeps evicting down to the budget with the
//! scorer's decode-time rule (H2O, TOVA, StreamingLLM).
//!
//! A regime is a config object ([`DecodeRegime`]) that starts one state per
//! layer ([`RegimeLayer`]) at the end of prefill; the state sees each decoded
//! token's position, the step's queries and, when it asks, the step's
//! attention probabilities, and may remove stored rows through
//! [`StoredHeads`]. A new regime is one file plus one
//! `register!(Decode, ...)` line: see docs/adding-a-policy.md.
//!
//! In a config, `decode = "evict"` is shorthand for
//! `decode = { type = "evict" }` (every parameter at its default).
//!
//! ```
//! use minikv_core::{CacheConfig, RunConfig};
//!
//! let cfg = RunConfig::parse("[cache]\ndecode = \"frozen\"", false)?;
//! assert_eq!(cfg.cache.decode.typetag_name(), "frozen");
//! // A regime with no parameters set serializes back to its name.
//! assert!(cfg.to_toml()?.contains("decode = \"frozen\""));
//! # Ok::<(), minikv_core::Error>(())
//! ```

use crate::config::CacheConfig;
use crate::layered::store::HeadStore;
use crate::scoring::{GqaReduce, TokenScorer};
use crate::storage::FpStore;
use crate::{Error, LayerBudget, ModelSpec, Result};
use serde::{Deserialize, Serialize};
use std::fmt::Debug;

/// What the cache hands a regime when a layer's selection is stored.
#[derive(Debug)]
pub struct RegimeStart<'a> {
    /// The model.
    pub spec: &'a ModelSpec,
    /// The layer.
    pub layer: usize,
    /// The config's scorer (`None`: the cache keeps every token).
    pub scorer: Option<&'a (dyn TokenScorer + 'static)>,
    /// Per storage head, the prompt positions it kept, increasing; row `i`
    /// of the head holds position `kept[s][i]`.
    pub kept: Vec<Vec<u32>>,
    /// The prefill scores `[n_store][t]` the selection used (when it scored).
    pub scores: Option<&'a [f32]>,
    /// Prompt tokens.
    pub t: usize,
    /// Attention sinks of the config.
    pub sinks: usize,
    /// This layer's budget.
    pub budget: LayerBudget,
    /// How query-head signals reduce into a storage head's (the config's
    /// `gqa_reduce`, or `sum` when each query head has its own store).
    pub reduce: GqaReduce,
}

/// What one decode step tells a regime.
#[derive(Debug, Clone, Copy)]
pub struct RegimeStep<'a> {
    /// The model.
    pub spec: &'a ModelSpec,
    /// The layer.
    pub layer: usize,
    /// Tokens the layer has seen, the decoded one included.
    pub seen: usize,
    /// The step's queries, `[n_q_heads * head_dim]`.
    pub query: &'a [f32],
}

/// The memory projection's question to a regime: how far a head of `kept`
/// rows grows over `max_new` decoded tokens.
#[derive(Debug, Clone, Copy)]
pub struct GrowthQuery {
    /// Prompt tokens.
    pub prompt: usize,
    /// Rows a head keeps at the end of prefill.
    pub kept: usize,
    /// The config's sinks, heavy and recent budgets in tokens.
    pub sinks: usize,
    /// Heavy-hitter budget in tokens.
    pub heavy: usize,
    /// Recent window in tokens.
    pub recent: usize,
    /// Tokens to decode.
    pub max_new: usize,
    /// The model's context length: no head ever holds more rows.
    pub max_seq: usize,
}

/// The answer: tokens appended before the head stops growing, the most
/// rows it holds at once, and the regime's own bytes per head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Growth {
    /// Decode steps during which the head grows (a simulation runs this many).
    pub steps: usize,
    /// Most rows held at once (storage is reserved for them when bounded).
    pub rows: usize,
    /// Whether the head's length is bounded (storage reserved once).
    pub bounded: bool,
    /// Bytes the regime's own state holds per head (positions, scores).
    pub index_bytes: usize,
}

/// A decode regime: a config object, one state per layer.
#[typetag::serde(tag = "type")]
pub trait DecodeRegime: Send + Sync + Debug + dyn_clone::DynClone {
    /// Checks parameters and the rest of the config this regime runs with;
    /// errors name the field (`cache.decode.x`).
    fn validate(&self, cache: &CacheConfig) -> Result<()> {
        let _ = cache;
        Ok(())
    }
    /// Whether the regime removes stored rows after prefill (page selection
    /// and compensators, which need every row in position order, refuse it).
    fn evicts(&self) -> bool;
    /// One layer's state at the end of prefill (`None`: nothing to do for it).
    fn start(&self, start: RegimeStart<'_>) -> Result<Option<Box<dyn RegimeLayer>>>;
    /// How a head grows while decoding (the memory projection).
    fn growth(&self, q: &GrowthQuery) -> Growth {
        Growth {
            steps: q.max_new,
            rows: q.kept + q.max_new,
            bounded: false,
            index_bytes: 0,
        }
    }
}

dyn_clone::clone_trait_object!(DecodeRegime);

/// One layer's regime state while decoding.
pub trait RegimeLayer: Send + Sync + Debug {
    /// A token at position `pos` was appended to every storage head.
    fn push(&mut self, pos: u32);
    /// Per query head, buffers the backend fills with this step's attention
    /// over the storage head's rows (`None`: not needed; asking costs time).
    fn probs(&mut self) -> Option<&mut [Vec<f32>]> {
        None
    }
    /// After attention: update state, remove rows.
    fn step(&mut self, heads: &mut StoredHeads<'_>, step: &RegimeStep<'_>) -> Result<()>;
    /// Most rows storage head `s` will ever hold (`None`: unbounded).
    fn max_rows(&self, s: usize) -> Option<usize> {
        let _ = s;
        None
    }
    /// Bytes of head `s`'s state: (allocated, used).
    fn head_bytes(&self, s: usize) -> (usize, usize) {
        let _ = s;
        (0, 0)
    }
    /// Bytes of work buffers.
    fn work_bytes(&self) -> usize {
        0
    }
}

/// A layer's storage heads as a regime may read and edit them. Row indices
/// count full-precision rows in storage order (appended rows at the end,
/// a removed row's place taken by the last one); a regime that removes rows
/// refuses quantized caches in its `validate`, where every row is full
/// precision.
pub struct StoredHeads<'a> {
    pub(crate) heads: &'a mut [HeadStore],
}

impl StoredHeads<'_> {
    /// Storage heads of the layer.
    pub fn len(&self) -> usize {
        self.heads.len()
    }

    /// Whether the layer has no storage head.
    pub fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }

    /// Rows head `s` holds (quantized and full precision).
    pub fn rows(&self, s: usize) -> usize {
        self.heads[s].len()
    }

    /// Head `s`'s full-precision keys and values.
    pub fn fp(&self, s: usize) -> (&dyn FpStore, &dyn FpStore) {
        self.heads[s].fp()
    }

    /// Removes full-precision row `i` of head `s` (the last row takes its place).
    pub fn swap_remove(&mut self, s: usize, i: usize) -> Result<()> {
        let n = self.heads[s].fp().0.len();
        if i >= n {
            return Err(Error::shape("regime: row to remove", format!("< {n}"), i));
        }
        self.heads[s].swap_remove(i);
        Ok(())
    }
}

/// The default regime: the selection made at the end of prefill stays;
/// generated tokens are appended.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Frozen {}

#[typetag::serde(name = "frozen")]
impl DecodeRegime for Frozen {
    fn evicts(&self) -> bool {
        false
    }
    fn start(&self, _: RegimeStart<'_>) -> Result<Option<Box<dyn RegimeLayer>>> {
        Ok(None)
    }
}

crate::register!(
    Decode,
    "frozen",
    Frozen,
    "selection made once at the end of prefill, generated tokens appended (default)"
);

/// Serde for a component field that takes a name or a table (`cache.decode`,
/// `cache.quant.residual_mode`): written back as the name when every
/// parameter is at its default.
pub(crate) mod name_or_table {
    use serde::de::{self, DeserializeOwned, MapAccess, Visitor};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::fmt;
    use std::marker::PhantomData;

    #[allow(clippy::borrowed_box)] // the signature `serde(with)` calls
    pub fn serialize<T, S>(r: &Box<T>, s: S) -> Result<S::Ok, S::Error>
    where
        T: ?Sized,
        Box<T>: Serialize + DeserializeOwned,
        S: Serializer,
    {
        let v = serde_json::to_value(r).map_err(serde::ser::Error::custom)?;
        let name = v.get("type").cloned().unwrap_or_default();
        let default = serde_json::from_value::<Box<T>>(serde_json::json!({ "type": name }))
            .ok()
            .and_then(|d| serde_json::to_value(d).ok());
        match (default == Some(v), name.as_str()) {
            (true, Some(n)) => n.serialize(s),
            _ => r.serialize(s),
        }
    }

    pub fn deserialize<'de, T, D>(d: D) -> Result<Box<T>, D::Error>
    where
        T: ?Sized,
        Box<T>: DeserializeOwned,
        D: Deserializer<'de>,
    {
        struct V<T: ?Sized>(PhantomData<Box<T>>);
        impl<'de, T: ?Sized> Visitor<'de> for V<T>
        where
            Box<T>: DeserializeOwned,
        {
            type Value = Box<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a component name or a table with a `type`")
            }
            fn visit_str<E: de::Error>(self, name: &str) -> Result<Self::Value, E> {
                serde_json::from_value(serde_json::json!({ "type": name }))
                    .map_err(|e| E::custom(e.to_string()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                Box::<T>::deserialize(de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_any(V::<T>(PhantomData))
    }
}
