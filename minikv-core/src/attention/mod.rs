//! Attention backends: prefill attention (optionally producing `A_cumul`) and
//! decode attention over a compressed layer.

mod reference;
mod tiled;

pub use reference::ReferenceBackend;
pub use tiled::TiledBackend;

use crate::quant::QuantStore;
use crate::storage::{FpStore, StorageFactory};
use crate::{Error, Result};
use std::fmt::Debug;
use std::sync::Arc;

/// Prefill attention for one layer.
///
/// The `n` queries sit at positions `t - n .. t`; query `i` sees keys `0 ..= t - n + i`.
#[derive(Debug)]
pub struct PrefillArgs<'a> {
    /// Query heads `Hq`.
    pub n_q_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Queries `[Hq][n][d]` (unscaled; the backend applies `1/sqrt(d)`).
    pub q: &'a [f32],
    /// Number of queries.
    pub n: usize,
    /// Keys per KV head, each `[t][d]`.
    pub keys: &'a [&'a [f32]],
    /// Values per KV head, each `[t][d]`.
    pub values: &'a [&'a [f32]],
    /// Number of keys (`t >= n`).
    pub t: usize,
    /// Output `[Hq][n][d]`.
    pub out: &'a mut [f32],
    /// If set, `A_cumul` column sums `[Hq][t]` are **added** here (§3).
    pub cumulative: Option<&'a mut [f32]>,
}

/// ResKV residual-cluster entries of one head: they join the softmax with a
/// per-entry logit bias (`beta * log(count) + log g`).
#[derive(Debug, Clone, Copy)]
pub struct ClusterView<'a> {
    /// Mean keys `[c][d]`.
    pub keys: &'a [f32],
    /// Mean values `[c][d]`.
    pub values: &'a [f32],
    /// Logit bias per entry `[c]` (`beta * log(count)`).
    pub bias: &'a [f32],
    /// Dynamic gate: `log g(q)` is added to every entry's logit, with `g`
    /// computed from the query's attention over the head's exact tokens.
    pub gate: Option<crate::reskv::Gate>,
}

/// One storage head of a compressed layer, as decode attention sees it.
///
/// Tokens are ordered: the quantized part first, then the full-precision part;
/// keys and values hold the same tokens in the same order but may split them
/// differently (KIVI keeps more values than keys in full precision).
#[derive(Debug, Clone, Copy)]
pub struct HeadView<'a> {
    /// Quantized keys.
    pub quant_keys: Option<&'a dyn QuantStore>,
    /// Quantized values.
    pub quant_values: Option<&'a dyn QuantStore>,
    /// Full-precision keys.
    pub fp_keys: &'a dyn FpStore,
    /// Full-precision values.
    pub fp_values: &'a dyn FpStore,
    /// Residual-cluster entries.
    pub clusters: Option<ClusterView<'a>>,
}

impl HeadView<'_> {
    /// Quantized keys held.
    pub fn n_quant_keys(&self) -> usize {
        self.quant_keys.map_or(0, |s| s.len())
    }
    /// Quantized values held.
    pub fn n_quant_values(&self) -> usize {
        self.quant_values.map_or(0, |s| s.len())
    }
    /// Tokens held (excluding cluster entries).
    pub fn len(&self) -> usize {
        self.n_quant_keys() + self.fp_keys.len()
    }
    /// True when the head holds no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Cluster entries.
    pub fn n_clusters(&self) -> usize {
        self.clusters.map_or(0, |c| c.bias.len())
    }
    /// Checks that keys and values agree.
    pub fn validate(&self, d: usize) -> Result<()> {
        let nv = self.n_quant_values() + self.fp_values.len();
        if self.len() != nv {
            return Err(Error::shape("decode head: values vs keys", self.len(), nv));
        }
        if let Some(c) = self.clusters {
            let n = c.bias.len();
            if c.keys.len() != n * d || c.values.len() != n * d {
                return Err(Error::shape("cluster entries", n * d, c.keys.len()));
            }
        }
        Ok(())
    }
}

/// Decode attention (one new query per query head) for one layer.
#[derive(Debug)]
pub struct DecodeArgs<'a> {
    /// Queries `[Hq][d]` (unscaled).
    pub q: &'a [f32],
    /// Storage heads; query head `h` reads head `h / (Hq / heads.len())`.
    pub heads: &'a [HeadView<'a>],
    /// Head dimension.
    pub head_dim: usize,
    /// Output `[Hq][d]`.
    pub out: &'a mut [f32],
    /// If set, per query head the attention probabilities over the head's tokens
    /// (cluster entries excluded) are written here (resized as needed).
    pub probs: Option<&'a mut [Vec<f32>]>,
}

/// An attention implementation. Models call it only through the cache.
pub trait AttentionBackend: Send + Sync + Debug {
    /// Name used in configs and reports.
    fn name(&self) -> &'static str;
    /// Causal prefill attention, optionally accumulating `A_cumul`.
    fn prefill(&self, args: PrefillArgs<'_>) -> Result<()>;
    /// Decode attention over a compressed layer.
    fn decode(&self, args: DecodeArgs<'_>) -> Result<()>;
    /// Creates the stores of caches that use this backend.
    fn storage(&self) -> &dyn StorageFactory;
}

/// The CPU backends by name: `tiled` (default) and `reference`.
pub fn cpu_backend(name: &str) -> Result<Arc<dyn AttentionBackend>> {
    match name {
        "tiled" => Ok(Arc::new(TiledBackend::default())),
        "reference" => Ok(Arc::new(ReferenceBackend)),
        other => Err(Error::config(
            "backend",
            format!(
                "unknown backend `{other}` (CPU backends: tiled, reference; `cuda` needs minikv-kernels)"
            ),
        )),
    }
}

pub(crate) fn check_prefill(a: &PrefillArgs<'_>) -> Result<(usize, usize)> {
    let (hq, d, n, t) = (a.n_q_heads, a.head_dim, a.n, a.t);
    let hkv = a.keys.len();
    if hkv == 0 || hq % hkv != 0 || a.values.len() != hkv {
        return Err(Error::shape(
            "prefill heads (Hq, Hkv)",
            "Hkv | Hq",
            format!("({hq}, {hkv})"),
        ));
    }
    if n > t {
        return Err(Error::shape(
            "prefill queries vs keys",
            format!("n <= {t}"),
            n,
        ));
    }
    crate::check_len("prefill q", hq * n * d, a.q.len())?;
    crate::check_len("prefill out", hq * n * d, a.out.len())?;
    for (k, v) in a.keys.iter().zip(a.values) {
        crate::check_len("prefill keys", t * d, k.len())?;
        crate::check_len("prefill values", t * d, v.len())?;
    }
    if let Some(c) = &a.cumulative {
        crate::check_len("prefill cumulative", hq * t, c.len())?;
    }
    Ok((hkv, hq / hkv))
}

pub(crate) fn check_decode(a: &DecodeArgs<'_>) -> Result<usize> {
    let d = a.head_dim;
    let hs = a.heads.len();
    let hq = a.q.len() / d;
    if hs == 0 || !hq.is_multiple_of(hs) || a.q.len() != hq * d {
        return Err(Error::shape(
            "decode heads",
            "storage heads dividing Hq",
            format!("{hs} for {hq}"),
        ));
    }
    crate::check_len("decode out", hq * d, a.out.len())?;
    if let Some(p) = &a.probs {
        crate::check_len("decode probs", hq, p.len())?;
    }
    for h in a.heads {
        h.validate(d)?;
    }
    Ok(hq / hs)
}
