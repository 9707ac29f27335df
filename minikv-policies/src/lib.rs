//! # minikv-policies
//!
//! Token scorers, layer budget policies, selectors, channel pruners and
//! compensators: the parts of MiniKV, H2O, SnapKV, StreamingLLM, TOVA,
//! PyramidKV, Ada-KV, ResKV and the kvpress / KVCache-Factory methods
//! (KeyDiff, ChunkKV, Expected Attention, CriticalKV, LagKV, KVzip, ThinK,
//! DuoAttention, CaM merge, Random, CurDKV, leverage scores, non-causal
//! attention, Compactor, FINCH, CAPKV, entropy-gated ChunkKV, CriticalAdaKV,
//! Block, similarity merge, SimLayerKV, Q-Filters, KVCompose, LU-KV) that decide *which* tokens (and key channels) a KV
//! cache keeps and what stands in for the others. Each component is one
//! struct, one `typetag` impl and one `register!` line; configs name them by
//! `type`.
//!
//! ```
//! use minikv_core::{BudgetRequest, SelectionPolicy};
//! use minikv_policies::Pyramid;
//!
//! // MiniKV pyramid, L = 4, mean heavy 0.25 (docs/algorithms.md §5).
//! let r = Pyramid::default().ratios(4, 0.25);
//! assert!((r[0] - 0.4642857).abs() < 1e-6 && (r[3] - 0.0357143).abs() < 1e-6);
//! let req = BudgetRequest { n_layers: 4, prompt_len: 1000, heavy: 250, recent: 250, sinks: 0, layers: &[] };
//! let b = Pyramid::default().layer_budgets(&req).unwrap();
//! assert_eq!(b.iter().map(|b| b.heavy).sum::<usize>(), 4 * 250); // total conserved
//! ```

#![warn(missing_docs)]

pub mod block;
pub mod budgets;
pub mod cam;
pub mod cap;
pub mod compactor;
pub mod critical_ada_kv;
pub mod criticalkv;
pub mod cur;
pub mod duo;
pub mod entropy_gated_chunk;
pub mod evict;
pub mod expected_attention;
pub mod finch;
pub mod kvcompose;
pub mod kvzip;
pub mod lagkv;
pub mod leverage;
pub mod lukv;
pub mod merge;
pub mod non_causal;
pub mod page_mean;
pub mod qfilter;
pub mod random;
pub mod reskv;
pub mod scorers;
pub mod selectors;
pub mod simlayerkv;
pub mod think;

pub use budgets::{
    LayerStatistic, PerLayer, Pyramid, PyramidKv, PyramidKvPress, Uniform, VarInv, VarProp,
};
pub use cam::CamMerge;
pub use criticalkv::CriticalKv;
pub use duo::{DuoAttention, DuoPattern};
pub use evict::Evict;
pub use expected_attention::ExpectedAttention;
pub use kvcompose::{KvCompose, KvComposeScore};
pub use kvzip::{KvZip, KvZipBudget};
pub use lagkv::LagKv;
pub use lukv::{LuKv, LuKvCurve};
pub use page_mean::PageMean;
pub use qfilter::{QFilter, QFilterFile};
pub use reskv::ResKvConfig;
pub use scorers::{
    Accumulate, ChunkKv, CumulativeAttention, H2o, KeyDiff, KeyNorm, LastQuery, Newest, Pooling,
    Recency, SnapKv, Tova, pool1d,
};
pub use selectors::{AdaKv, TopK};
pub use think::Think;

#[cfg(doctest)]
#[doc = include_str!("../../docs/adding-a-policy.md")]
pub struct AddingAPolicyGuide;
