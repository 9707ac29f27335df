//! The tiled backend's extra memory is O(T), never T x T: measured with a
//! counting global allocator (peak bytes above the inputs during prefill).

use minikv_core::attention::{AttentionBackend, PrefillArgs, TiledBackend};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

struct Counting;
static CUR: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let now = CUR.fetch_add(l.size(), SeqCst) + l.size();
        PEAK.fetch_max(now, SeqCst);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        CUR.fetch_sub(l.size(), SeqCst);
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn extra_bytes(t: usize) -> usize {
    let (hq, d) = (2, 64);
    let q = vec![0.01f32; hq * t * d];
    let k = vec![0.02f32; t * d];
    let mut out = vec![0.0f32; hq * t * d];
    let mut cu = vec![0.0f32; hq * t];
    // Warm rayon and thread-local scratch so that one-time costs are not counted.
    let be = TiledBackend::default();
    let run = |out: &mut [f32], cu: &mut [f32]| {
        be.prefill(PrefillArgs {
            n_q_heads: hq,
            head_dim: d,
            q: &q,
            n: t,
            keys: &[&k],
            values: &[&k],
            t,
            out,
            cumulative: Some(cu),
            window: None,
            history: None,
        })
        .unwrap()
    };
    run(&mut out, &mut cu);
    let base = CUR.load(SeqCst);
    PEAK.store(base, SeqCst);
    run(&mut out, &mut cu);
    PEAK.load(SeqCst) - base
}

#[test]
fn tiled_prefill_extra_memory_is_linear_in_t() {
    let small = extra_bytes(1024);
    let large = extra_bytes(8192);
    // A T x T score matrix for T = 8192 and 2 heads would be 512 MiB. With
    // `A_cumul` each thread keeps at most ~1 MiB of a row block's
    // exponentials, plus 8 partial column-sum rows per head (O(T)), and the
    // call keeps one transposed copy of the keys (T x d per KV head, O(T)).
    let threads = rayon::current_num_threads().max(2);
    let bound = threads * ((1 << 20) + (64 << 10)) + 2 * 8 * 8192 * 4 + 8192 * 64 * 4;
    assert!(
        large < bound,
        "extra memory at T = 8192 is {large} bytes (bound {bound})"
    );
    // 8x the tokens: at most ~8x the extra bytes, not 64x. A thread's scratch
    // can still grow in the measured run (a task with a longer key span than
    // any it ran while warming up), by at most the per-thread cap.
    let slack = threads * ((1 << 20) + (64 << 10));
    assert!(large <= 8 * small + slack, "small {small}, large {large}");
    eprintln!("extra bytes: T=1024 -> {small}, T=8192 -> {large}");
}
