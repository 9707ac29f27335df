//! # minikv-policies
//!
//! Token scorers, layer budget policies and selectors: the parts of MiniKV, H2O,
//! SnapKV, StreamingLLM, TOVA, PyramidKV and Ada-KV that decide *which* tokens a
//! KV cache keeps. Each component is one struct, one `typetag` impl and one
//! `register!` line; configs name them by `type`.
//!
//! ```
//! use minikv_core::{BudgetRequest, SelectionPolicy};
//! use minikv_policies::Pyramid;
//!
//! // MiniKV pyramid, L = 4, mean heavy 0.25 (algorithms.md §5).
//! let r = Pyramid::default().ratios(4, 0.25);
//! assert!((r[0] - 0.4642857).abs() < 1e-6 && (r[3] - 0.0357143).abs() < 1e-6);
//! let req = BudgetRequest { n_layers: 4, prompt_len: 1000, heavy: 250, recent: 250, sinks: 0, layer_stats: None };
//! let b = Pyramid::default().layer_budgets(&req).unwrap();
//! assert_eq!(b.iter().map(|b| b.heavy).sum::<usize>(), 4 * 250); // total conserved
//! ```

#![warn(missing_docs)]

pub mod budgets;
pub mod scorers;
pub mod selectors;

pub use budgets::{PerLayer, Pyramid, PyramidKv, Uniform, VarInv, VarProp};
pub use scorers::{CumulativeAttention, H2o, KeyNorm, Pooling, Recency, SnapKv, Tova, pool1d};
pub use selectors::{AdaKv, TopK};

#[cfg(doctest)]
#[doc = include_str!("../../docs/adding-a-policy.md")]
pub struct AddingAPolicyGuide;
