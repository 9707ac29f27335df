//! The prefill history promise (`PrefillArgs::history`): the layered cache
//! gives each layer's staged rows one identity, only appends to them under
//! it, and releases it when the rows leave the staging (end of prefill), a
//! reconstruction pass truncates them (KVzip, from this crate) or the cache
//! is dropped mid-prefill. A checking backend verifies the promise on every
//! call.

use minikv_core::attention::{AttentionBackend, DecodeArgs, PrefillArgs, TiledBackend};
use minikv_core::storage::StorageFactory;
use minikv_core::{CacheBuilder, CacheConfig, KvHistory, ModelSpec, Result, RunConfig};
// Linked for its registered components (typetag): the `kvzip` scorer.
use minikv_policies as _;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 8;
const LAYERS: usize = 3;

#[derive(Debug, Default)]
struct Seen {
    /// Rows (keys then values, per KV head) of each live history's last call.
    rows: HashMap<KvHistory, Vec<Vec<f32>>>,
    calls: usize,
    released: Vec<KvHistory>,
}

/// Checks the promise, then computes with the tiled backend.
#[derive(Debug, Default)]
struct Checking {
    inner: TiledBackend,
    seen: Mutex<Seen>,
}

impl AttentionBackend for Checking {
    fn name(&self) -> &'static str {
        "checking"
    }
    fn prefill(&self, a: PrefillArgs<'_>) -> Result<()> {
        let h = a.history.expect("the layered cache names its staged rows");
        let now: Vec<Vec<f32>> = a.keys.iter().chain(a.values).map(|r| r.to_vec()).collect();
        let mut s = self.seen.lock().unwrap();
        assert!(!s.released.contains(&h), "a released history came back");
        if let Some(before) = s.rows.get(&h) {
            for (b, n) in before.iter().zip(&now) {
                assert!(
                    n.len() >= b.len() && n[..b.len()] == b[..],
                    "rows changed under {h:?}"
                );
            }
        }
        s.rows.insert(h, now);
        s.calls += 1;
        drop(s);
        self.inner.prefill(a)
    }
    fn release_history(&self, h: KvHistory) {
        let mut s = self.seen.lock().unwrap();
        assert!(
            s.rows.remove(&h).is_some(),
            "released {h:?} twice or never used"
        );
        s.released.push(h);
    }
    fn decode(&self, a: DecodeArgs<'_>) -> Result<()> {
        self.inner.decode(a)
    }
    fn storage(&self) -> &dyn StorageFactory {
        self.inner.storage()
    }
}

fn spec() -> ModelSpec {
    ModelSpec {
        n_layers: LAYERS,
        n_q_heads: HQ,
        n_kv_heads: HKV,
        head_dim: D,
        max_seq_len: 256,
        windows: vec![None; LAYERS],
    }
}

fn chunk(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7 + seed * 13) % 29) as f32 - 14.0) / 9.0)
        .collect()
}

/// A cache of `cfg` on a new checking backend.
fn on_checking(cfg: &CacheConfig) -> (Arc<Checking>, Box<dyn minikv_core::KvCache>) {
    let be = Arc::new(Checking::default());
    let cache = CacheBuilder::new(spec())
        .backend(be.clone())
        .build(cfg)
        .unwrap();
    (be, cache)
}

/// Prefills `chunks` into every layer of a cache on `be`.
fn prefill(cache: &mut dyn minikv_core::KvCache, chunks: &[usize]) {
    for (c, &n) in chunks.iter().enumerate() {
        for l in 0..LAYERS {
            let (k, v) = (chunk(n * HKV * D, c + l), chunk(n * HKV * D, c + l + 5));
            cache.append(l, &k, &v, n).unwrap();
            let mut out = vec![0.0; n * HQ * D];
            cache.attend(l, &chunk(n * HQ * D, c), n, &mut out).unwrap();
        }
    }
}

#[test]
fn each_layer_appends_under_one_history_released_at_the_end_of_prefill() {
    let (be, mut cache) = on_checking(&CacheConfig::default());
    prefill(cache.as_mut(), &[9, 4, 11]);
    {
        let s = be.seen.lock().unwrap();
        assert_eq!(s.calls, 3 * LAYERS);
        assert_eq!(s.rows.len(), LAYERS, "one history per layer");
        assert!(s.released.is_empty());
    }
    cache.end_prefill().unwrap();
    let s = be.seen.lock().unwrap();
    assert!(
        s.rows.is_empty(),
        "every history released: {:?}",
        s.rows.keys()
    );
    assert_eq!(s.released.len(), LAYERS);
}

#[test]
fn a_cache_dropped_mid_prefill_releases_its_histories() {
    let (be, mut cache) = on_checking(&CacheConfig::default());
    prefill(cache.as_mut(), &[6, 6]);
    assert_eq!(be.seen.lock().unwrap().rows.len(), LAYERS);
    drop(cache);
    let s = be.seen.lock().unwrap();
    assert!(s.rows.is_empty());
    assert_eq!(s.released.len(), LAYERS);
}

#[test]
fn a_reset_starts_new_histories() {
    let (be, mut cache) = on_checking(&CacheConfig::default());
    prefill(cache.as_mut(), &[5]);
    cache.reset().unwrap();
    assert_eq!(be.seen.lock().unwrap().released.len(), LAYERS);
    // The same layers again: fresh identities, so a shorter prompt under
    // them is no broken promise.
    prefill(cache.as_mut(), &[3, 2]);
    assert_eq!(be.seen.lock().unwrap().rows.len(), LAYERS);
}

#[test]
fn a_reconstruction_pass_ends_the_histories_it_truncates() {
    let cfg = RunConfig::parse(
        "[cache]\nheavy = 0.25\nrecent_tokens = 8\nscorer = { type = \"kvzip\", n_sink = 4 }",
        false,
    )
    .unwrap();
    let (be, mut cache) = on_checking(&cfg.cache);
    assert!(cache.wants(0).reconstruction);
    prefill(cache.as_mut(), &[9, 4]);
    cache.begin_pass(0..13).unwrap();
    prefill(cache.as_mut(), &[5]);
    cache.end_pass().unwrap();
    {
        let s = be.seen.lock().unwrap();
        assert!(
            s.rows.is_empty(),
            "the pass's truncation ended every history"
        );
        assert_eq!(s.released.len(), LAYERS);
    }
    // Nothing left to release at the end of prefill: the staging holds no
    // history after the truncation.
    cache.end_prefill().unwrap();
    assert_eq!(be.seen.lock().unwrap().released.len(), LAYERS);
}
