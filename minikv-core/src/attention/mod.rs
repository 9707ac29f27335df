//! Attention backends: prefill attention (optionally producing `A_cumul`) and
//! decode attention over a compressed layer.

mod reference;
mod tiled;

pub use reference::ReferenceBackend;
pub use tiled::TiledBackend;

use crate::compensate::LogitGate;
use crate::quant::QuantStore;
use crate::storage::{FpStore, StorageFactory};
use crate::{Error, Result};
use std::fmt::Debug;
use std::sync::Arc;

/// Prefill attention for one layer.
///
/// The `n` queries sit at positions `t - n .. t`; query `i` sees keys `0 ..= t - n + i`,
/// or with a sliding window `w` only the last `w` of them (`t - n + i + 1 - w ..= t - n + i`).
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
    /// Sliding window: each query sees only the last `w` keys up to itself
    /// (`None`: all of them).
    pub window: Option<usize>,
    /// The key/value history these rows belong to, when the caller keeps
    /// one: rows are only appended to a history, so every call with the
    /// same identity sees the rows of the earlier calls with it, unchanged,
    /// at the front of `keys` and `values`. A backend may keep them between
    /// calls (the CUDA backend keeps them on the device and uploads only
    /// the new rows) until [`AttentionBackend::release_history`]. `None`:
    /// no such promise (every call stands alone).
    pub history: Option<KvHistory>,
}

impl PrefillArgs<'_> {
    /// The keys query `i` sees: `lo ..= hi` (positions in the key slice).
    pub fn visible(&self, i: usize) -> (usize, usize) {
        let hi = self.t - self.n + i;
        let lo = self.window.map_or(0, |w| (hi + 1).saturating_sub(w));
        (lo, hi)
    }
}

/// Token-major rows `[n][heads * d]` to the head-major layout `[heads][n][d]`
/// of [`PrefillArgs`].
pub fn to_head_major(x: &[f32], n: usize, heads: usize, d: usize, out: &mut [f32]) {
    for i in 0..n {
        for h in 0..heads {
            out[(h * n + i) * d..(h * n + i + 1) * d]
                .copy_from_slice(&x[(i * heads + h) * d..(i * heads + h + 1) * d]);
        }
    }
}

/// The inverse of [`to_head_major`]: `[heads][n][d]` to `[n][heads * d]`.
pub fn to_token_major(x: &[f32], n: usize, heads: usize, d: usize, out: &mut [f32]) {
    for i in 0..n {
        for h in 0..heads {
            out[(i * heads + h) * d..(i * heads + h + 1) * d]
                .copy_from_slice(&x[(h * n + i) * d..(h * n + i + 1) * d]);
        }
    }
}

/// Extra attention entries of one head (from a [`Compensator`](crate::Compensator),
/// e.g. ResKV's cluster summaries): they join the softmax with a per-entry
/// logit bias, plus `log g(q)` from an optional gate.
#[derive(Debug, Clone, Copy)]
pub struct ExtraView<'a> {
    /// Entry keys.
    pub keys: &'a dyn FpStore,
    /// Entry values.
    pub values: &'a dyn FpStore,
    /// Logit bias per entry.
    pub bias: &'a [f32],
    /// Per-query gate: `log g` from the query's scaled logits over the head's
    /// real tokens, added to every entry's logit.
    pub gate: Option<&'a dyn LogitGate>,
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
    /// Extra entries (compensation for evicted tokens).
    pub extra: Option<ExtraView<'a>>,
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
    /// Tokens held (excluding extra entries).
    pub fn len(&self) -> usize {
        self.n_quant_keys() + self.fp_keys.len()
    }
    /// True when the head holds no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Extra entries.
    pub fn n_extra(&self) -> usize {
        self.extra.map_or(0, |c| c.bias.len())
    }
    /// Checks that keys and values agree.
    pub fn validate(&self) -> Result<()> {
        let nv = self.n_quant_values() + self.fp_values.len();
        if self.len() != nv {
            return Err(Error::shape("decode head: values vs keys", self.len(), nv));
        }
        if let Some(c) = self.extra {
            let n = c.bias.len();
            if c.keys.len() != n || c.values.len() != n {
                return Err(Error::shape("extra entries", n, c.keys.len()));
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
    /// (extra entries excluded) are written here (resized as needed).
    pub probs: Option<&'a mut [Vec<f32>]>,
}

/// The identity of an append-only key/value history of prefill calls (see
/// [`PrefillArgs::history`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvHistory(u64);

impl KvHistory {
    /// A new identity, distinct from every other one of this process.
    pub fn fresh() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

/// An attention implementation. Models call it only through the cache.
pub trait AttentionBackend: Send + Sync + Debug {
    /// Name used in configs and reports.
    fn name(&self) -> &'static str;
    /// Causal prefill attention, optionally accumulating `A_cumul`.
    fn prefill(&self, args: PrefillArgs<'_>) -> Result<()>;
    /// The history will not be prefilled again (its rows were truncated,
    /// moved into a cache or dropped): a backend frees what it kept of it.
    /// Does nothing by default.
    fn release_history(&self, history: KvHistory) {
        let _ = history;
    }
    /// Decode attention over a compressed layer.
    fn decode(&self, args: DecodeArgs<'_>) -> Result<()>;
    /// Creates the stores of caches that use this backend.
    fn storage(&self) -> &dyn StorageFactory;
}

/// A registered attention backend: `backend = "<name>"` in a run config.
///
/// Backends register themselves next to their definition with
/// `inventory::submit!` (see [`crate::register_backend!`]); nothing matches on
/// backend names anywhere else. `make` may fail with a clear error (e.g. `cuda`
/// on a machine without a CUDA driver).
pub struct BackendInfo {
    /// Name in configs.
    pub name: &'static str,
    /// One line saying what it is.
    pub summary: &'static str,
    /// Creates the backend.
    pub make: fn() -> Result<Arc<dyn AttentionBackend>>,
}

inventory::collect!(BackendInfo);

/// Registers an attention backend under a config name.
///
/// ```ignore
/// minikv_core::register_backend!("tiled", "summary", || Ok(Arc::new(TiledBackend::default())));
/// ```
#[macro_export]
macro_rules! register_backend {
    ($name:literal, $summary:literal, $make:expr) => {
        $crate::__inventory::submit! {
            $crate::attention::BackendInfo { name: $name, summary: $summary, make: $make }
        }
    };
}

crate::register_backend!(
    "tiled",
    "CPU flash-style tiles (online softmax, rayon), fused low-bit decode; the default",
    || Ok(Arc::new(TiledBackend::default()))
);
crate::register_backend!(
    "reference",
    "CPU naive f64 attention, exact; for checks",
    || Ok(Arc::new(ReferenceBackend))
);

/// Every registered backend, sorted by name.
pub fn backends() -> Vec<&'static BackendInfo> {
    let mut v: Vec<_> = inventory::iter::<BackendInfo>.into_iter().collect();
    v.sort_by_key(|b| b.name);
    v
}

/// Looks a backend up by name; an unknown name is a config error listing the
/// registered ones.
pub fn backend_info(name: &str) -> Result<&'static BackendInfo> {
    let all = backends();
    all.iter().find(|b| b.name == name).copied().ok_or_else(|| {
        let names: Vec<_> = all.iter().map(|b| b.name).collect();
        Error::config(
            "backend",
            format!(
                "unknown backend `{name}` (registered: {}; `cuda` is registered by minikv-kernels, `cuda-emulated` by its `emulate` feature: `minikv` built with `--features emulate`)",
                names.join(", ")
            ),
        )
    })
}

/// Creates the backend registered as `name`.
pub fn make_backend(name: &str) -> Result<Arc<dyn AttentionBackend>> {
    (backend_info(name)?.make)()
}

/// Checks a prefill call's shapes; returns `(Hkv, Hq / Hkv)`. For backends.
pub fn check_prefill(a: &PrefillArgs<'_>) -> Result<(usize, usize)> {
    let (hq, d, n, t) = (a.n_q_heads, a.head_dim, a.n, a.t);
    let hkv = a.keys.len();
    if hkv == 0 || hq % hkv != 0 || a.values.len() != hkv {
        return Err(Error::shape(
            "prefill heads (Hq, Hkv)",
            "Hkv | Hq",
            format!("({hq}, {hkv})"),
        ));
    }
    if d == 0 {
        return Err(Error::shape("prefill head_dim", "> 0", 0));
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
    if a.window == Some(0) {
        return Err(Error::shape("prefill window", "> 0", 0));
    }
    Ok((hkv, hq / hkv))
}

/// Checks a decode call's shapes; returns the query heads per storage head.
/// For backends.
pub fn check_decode(a: &DecodeArgs<'_>) -> Result<usize> {
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
        h.validate()?;
    }
    Ok(hq / hs)
}
