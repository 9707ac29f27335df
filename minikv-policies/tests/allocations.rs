//! Allocation tests of the cache core, with a counting global allocator:
//! the memory report equals the bytes the cache allocates (up to a constant
//! of struct headers that does not grow with tokens), and a decode step on the
//! cache path allocates nothing.

use minikv_core::attention::{AttentionBackend, ReferenceBackend, TiledBackend};
use minikv_core::{CacheBuilder, KvCache, ModelSpec, RunConfig};
use minikv_policies as _;
use minikv_quant as _;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
thread_local! {
    /// Bytes live from this thread's allocations and frees (the accounting
    /// test runs all its work on one thread, so other threads cannot disturb it).
    static LIVE_HERE: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
}

fn here(delta: isize) {
    let _ = LIVE_HERE.try_with(|c| c.set(c.get() + delta));
}
static CALLS: AtomicUsize = AtomicUsize::new(0);
/// Tests in this binary run one at a time (the counters are global).
static SERIAL: Mutex<()> = Mutex::new(());

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        CALLS.fetch_add(1, Relaxed);
        LIVE.fetch_add(l.size() as isize, Relaxed);
        here(l.size() as isize);
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        CALLS.fetch_add(1, Relaxed);
        LIVE.fetch_add(l.size() as isize, Relaxed);
        here(l.size() as isize);
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Relaxed);
        here(-(l.size() as isize));
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        CALLS.fetch_add(1, Relaxed);
        LIVE.fetch_add(new as isize - l.size() as isize, Relaxed);
        here(new as isize - l.size() as isize);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

const SPEC: ModelSpec = ModelSpec {
    n_layers: 2,
    n_q_heads: 4,
    n_kv_heads: 2,
    head_dim: 32,
    max_seq_len: 4096,
    windows: Vec::new(),
};

const MINIKV: &str = "[cache]\nheavy = 0.25\nrecent = 0.25\nscorer = { type = \"cumulative_attention\" }\n[cache.quant]\nkeys = { type = \"minmax\", bits = 2, group = 16, axis = \"channel\" }\nvalues = { type = \"minmax\", bits = 2, group = 16, axis = \"token\" }\n";
const KIVI: &str = "[cache.quant]\nresidual = 32\nresidual_mode = \"kivi\"\nkeys = { type = \"minmax\", bits = 2, group = 32, axis = \"channel\" }\nvalues = { type = \"minmax\", bits = 2, group = 32, axis = \"token\" }\n";
const H2O: &str =
    "[cache]\nheavy = 0.1\nrecent = 0.1\ndecode = \"evict\"\nscorer = { type = \"h2o\" }\n";
const TOVA: &str = "[cache]\nheavy_tokens = 64\ndecode = \"evict\"\nscorer = { type = \"tova\" }\n";
const STREAMING: &str = "[cache]\nsinks = 4\nheavy_tokens = 0\nrecent_tokens = 60\ndecode = \"evict\"\nscorer = { type = \"recency\" }\n";
const RESKV: &str = "[cache]\nheavy = 0.2\nrecent_tokens = 8\nscorer = { type = \"snapkv\", window = 8, kernel = 3 }\n[cache.compensator]\ntype = \"reskv\"\nratio = 0.2\nheld_out = 8\n";
const EVERY: &str = "[cache]\nheavy = 0.1\nrecent = 0.1\ndecode = { type = \"evict\", every = 8 }\nscorer = { type = \"h2o\" }\n";

fn noise(n: usize, s: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 2654435761 + s * 97) % 1000) as f32 / 250.0 - 2.0)
        .collect()
}

fn build(toml: &str, backend: Arc<dyn AttentionBackend>) -> Box<dyn KvCache> {
    let cfg = RunConfig::parse(toml, false).unwrap();
    CacheBuilder::new(SPEC)
        .backend(backend)
        .build(&cfg.cache)
        .unwrap()
}

/// Inputs of `steps` decode steps, made before anything is counted.
struct Steps {
    k: Vec<Vec<f32>>,
    q: Vec<Vec<f32>>,
    out: Vec<f32>,
}

fn steps(n: usize) -> Steps {
    let (kv, qd) = (
        SPEC.n_kv_heads * SPEC.head_dim,
        SPEC.n_q_heads * SPEC.head_dim,
    );
    Steps {
        k: (0..n).map(|i| noise(kv, 1000 + i)).collect(),
        q: (0..n).map(|i| noise(qd, 5000 + i)).collect(),
        out: vec![0.0; qd],
    }
}

fn prefill(c: &mut dyn KvCache, t: usize) {
    let (kv, qd) = (
        SPEC.n_kv_heads * SPEC.head_dim,
        SPEC.n_q_heads * SPEC.head_dim,
    );
    let (k, v, q) = (noise(t * kv, 1), noise(t * kv, 2), noise(t * qd, 3));
    let mut out = vec![0.0; t * qd];
    for layer in 0..SPEC.n_layers {
        c.append(layer, &k, &v, t).unwrap();
        c.attend(layer, &q, t, &mut out).unwrap();
    }
    c.end_prefill().unwrap();
}

fn decode(c: &mut dyn KvCache, s: &mut Steps, range: std::ops::Range<usize>) {
    for i in range {
        for layer in 0..SPEC.n_layers {
            c.append(layer, &s.k[i], &s.k[i], 1).unwrap();
            c.attend(layer, &s.q[i], 1, &mut s.out).unwrap();
        }
    }
}

/// Bytes the cache holds beyond what it reports, after prefill of `t`
/// tokens and `n` decode steps.
fn unreported(toml: &str, t: usize, n: usize) -> (isize, usize) {
    let backend: Arc<dyn AttentionBackend> = Arc::new(ReferenceBackend);
    let mut s = steps(n);
    let live = || LIVE_HERE.with(|c| c.get());
    let before = live();
    let mut c = build(toml, backend);
    prefill(c.as_mut(), t);
    decode(c.as_mut(), &mut s, 0..n);
    let held = live() - before;
    let reported = c.memory().total_bytes();
    (held - reported as isize, reported)
}

/// The memory report is the bytes the cache allocated: what is not reported
/// is a constant (boxes, struct headers, the config's components), the same
/// at 200 and 1000 tokens and under 2 KiB per storage head; everything that
/// grows with tokens is counted.
#[test]
fn reported_bytes_are_allocated_bytes() {
    // All work on one thread (rayon included), counted per thread.
    on_one_thread(accounting);
}

/// Runs `f` alone (the counters are global) on a one-thread rayon pool.
fn on_one_thread(f: impl FnOnce() + Send) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(f);
}

fn accounting() {
    let configs = [
        ("full", ""),
        ("minikv", MINIKV),
        ("kivi", KIVI),
        ("h2o", H2O),
        ("streaming", STREAMING),
        ("reskv", RESKV),
    ];
    // Once-per-thread initializations (registries, kernels' thread-local
    // scratch) first: every config once at the largest size.
    for (_, toml) in configs {
        unreported(toml, 1000, 40);
    }
    for (name, toml) in configs {
        let (small, r1) = unreported(toml, 200, 40);
        let (large, r2) = unreported(toml, 1000, 40);
        assert!(r2 >= r1, "{name}: {r1} vs {r2}");
        assert_eq!(small, large, "{name}: unreported bytes grow with tokens");
        let heads = SPEC.n_layers * SPEC.n_kv_heads;
        assert!(
            small >= 0 && (small as usize) < 2048 * heads,
            "{name}: {small} bytes unreported"
        );
    }
}

/// After warm-up, 100 decode steps allocate nothing on the cache path (the
/// tiled backend, fused low-bit kernels, residual flushes, decode-time
/// eviction, extra entries). Pages are 1024 tokens here so that the 100 steps
/// fall inside one page: growth allocates once per page, never per step.
#[test]
fn decode_steps_allocate_nothing() {
    on_one_thread(|| {
        let backend: Arc<dyn AttentionBackend> = Arc::new(TiledBackend::default());
        for (name, toml, t) in [
            ("full", "", 300),
            // Long enough for split-K decode over token blocks.
            ("full, split-K", "", 2100),
            ("minikv", MINIKV, 300),
            ("kivi", KIVI, 300),
            ("h2o", H2O, 300),
            ("h2o every 8", EVERY, 300),
            ("tova", TOVA, 300),
            ("streaming", STREAMING, 300),
            ("reskv", RESKV, 300),
        ] {
            let toml = if toml.contains("[cache]") {
                toml.replacen("[cache]\n", "[cache]\npage_tokens = 1024\n", 1)
            } else {
                format!("[cache]\npage_tokens = 1024\n{toml}")
            };
            let (warm, n) = (130, 100);
            let mut s = steps(warm + n);
            // A first run sizes the backend's per-thread scratch.
            let mut c = build(&toml, backend.clone());
            prefill(c.as_mut(), t);
            decode(c.as_mut(), &mut s, 0..warm + n);
            drop(c);
            let mut c = build(&toml, backend.clone());
            prefill(c.as_mut(), t);
            decode(c.as_mut(), &mut s, 0..warm);
            let before = CALLS.load(Relaxed);
            decode(c.as_mut(), &mut s, warm..warm + n);
            let calls = CALLS.load(Relaxed) - before;
            assert_eq!(calls, 0, "{name}: {calls} allocations in {n} decode steps");
        }
    });
}
