//! # minikv-core
//!
//! Traits, errors, the config-built KV cache and the CPU attention backends of
//! minikv. Every other crate depends on this one; this one depends on no other
//! minikv crate and never on CUDA.
//!
//! * The model-facing contract: [`KvCache`] (append, attend, compress, report
//!   memory) and [`AttentionBackend`] (prefill attention that can return the
//!   cumulative attention `A_cumul`, decode attention over a compressed layer).
//! * The research extension points, object-safe and deserializable by `type`
//!   name with `typetag`: [`TokenScorer`] (with its optional [`DecodeScore`]),
//!   [`SelectionPolicy`] (reading [`LayerSignals`]), [`Selector`],
//!   [`Quantizer`], [`Compensator`], [`ChannelPruner`], [`DecodeRegime`]
//!   (what happens to stored rows while decoding), [`PageScore`] (page
//!   selection at decode) and [`ResidualRule`] (when a quantized cache's
//!   residual rows are quantized). Implementations live in `minikv-policies` and
//!   `minikv-quant` (the defaults, `frozen`, `quest` and `minikv`, here); backends are
//!   found by name in a registry ([`make_backend`]).
//! * [`layered::LayeredCache`]: the cache every config builds, assembled from
//!   parts with one job each (staging, head stores, the decode regime's
//!   state, page summaries).
//! * [`RunConfig`] / [`CacheConfig`]: serde configs (TOML or JSON); a config
//!   without compression is the full fp16 cache.
//!
//! ```
//! use minikv_core::{CacheBuilder, CacheConfig, KvCache, ModelSpec, Phase};
//!
//! let spec = ModelSpec { n_layers: 2, n_q_heads: 4, n_kv_heads: 2, head_dim: 8, max_seq_len: 64, windows: Vec::new() };
//! let mut cache = CacheBuilder::new(spec.clone()).build(&CacheConfig::default())?; // full fp16 cache
//! let (t, kv, qd) = (5, 2 * 8, 4 * 8);
//! let k: Vec<f32> = (0..t * kv).map(|i| (i as f32 * 0.37).sin()).collect();
//! let q: Vec<f32> = (0..t * qd).map(|i| (i as f32 * 0.11).cos()).collect();
//! let mut out = vec![0.0; t * qd];
//! for layer in 0..2 {
//!     cache.append(layer, &k, &k, t)?;
//!     cache.attend(layer, &q, t, &mut out)?;
//! }
//! cache.end_prefill()?;
//! assert_eq!(cache.phase(), Phase::Decode);
//! let mem = cache.memory();
//! assert_eq!(mem.full_fp16_bytes, spec.full_fp16_bytes(t));
//! assert_eq!(mem.used_bytes(), mem.full_fp16_bytes); // the data held: every token in fp16
//! assert!(mem.total_bytes() >= mem.used_bytes()); // allocated: plus page growth slack
//! # Ok::<(), minikv_core::Error>(())
//! ```

#![warn(missing_docs)]

pub mod attention;
pub mod budget;
pub mod builder;
pub mod cache;
pub mod channels;
pub mod compensate;
pub mod components;
pub mod config;
pub mod cpu;
mod error;
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
mod f16x86;
pub mod files;
pub mod gemm;
pub mod hybrid;
pub mod layered;
pub mod pages;
pub mod plan;
pub mod probe;
pub mod quant;
pub mod regime;
pub mod residual;
pub mod scoring;
pub mod select;
pub mod simd;
mod spec;
pub mod storage;

pub use attention::{
    AttentionBackend, BackendInfo, DecodeArgs, ExtraView, HeadView, KvHistory, PrefillArgs,
    ReferenceBackend, TiledBackend, make_backend,
};
pub use budget::{BudgetRequest, LayerBudget, SelectionPolicy, apportion};
pub use builder::{CacheBuilder, build_cache};
pub use cache::{
    Diagnostics, HeadMemory, KvCache, LayerMemory, MemoryReport, ModelWants, Observation, Phase,
    Rope, RopePairs, Stats,
};
pub use channels::{ChannelInput, ChannelPruner, SplitKeys};
pub use compensate::{CompensateInput, Compensation, Compensator, ExtraEntries, LogitGate};
pub use config::{CacheConfig, HeadMode, QuantConfig, RunConfig, check_finite_fields};
pub use error::{Error, Result, check_finite, check_len, check_range};
pub use pages::{PageScore, PagesConfig};
pub use plan::{CachePlan, Selection};
pub use probe::AttentionProbe;
pub use quant::{Axis, MinMaxSpec, QuantBytes, QuantStore, Quantizer};
pub use regime::{DecodeRegime, RegimeLayer, RegimeStart, RegimeStep, StoredHeads};
pub use residual::ResidualRule;
pub use scoring::{
    DecodeScore, DecodeStep, GqaReduce, LayerSignals, Needs, QueryStats, ScoreInputs, TokenScorer,
    broadcast_kv, reduce_gqa,
};
pub use select::{SelectionInput, Selector, top_k_indices};
pub use spec::ModelSpec;

#[doc(hidden)]
pub use inventory as __inventory;
#[doc(hidden)]
pub use serde_json as __serde_json;
