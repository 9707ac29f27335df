//! The server's Prometheus metrics (`GET /metrics`, OpenMetrics text).

use minikv_engine::{EngineStats, Finish, Finished};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FinishLabel {
    finish: &'static str,
}

/// Every metric the server exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    kv_bytes: Gauge,
    kv_budget: Gauge,
    kv_reserved: Gauge,
    kv_peak: Gauge,
    total_bytes: Gauge,
    running: Gauge,
    waiting: Gauge,
    generated: Counter,
    prompt: Counter,
    steps: Counter,
    finished: Family<FinishLabel, Counter>,
    ttft: Histogram,
    itl: Histogram,
    queue: Histogram,
    kv_ratio: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut r = Registry::default();
        let g = |r: &mut Registry, name: &str, help: &str| {
            let m = Gauge::default();
            r.register(name, help, m.clone());
            m
        };
        let c = |r: &mut Registry, name: &str, help: &str| {
            let m = Counter::default();
            r.register(name, help, m.clone());
            m
        };
        let h = |r: &mut Registry, name: &str, help: &str, start: f64, n: u16| {
            let m = Histogram::new(exponential_buckets(start, 2.0, n));
            r.register(name, help, m.clone());
            m
        };
        let kv_bytes = g(
            &mut r,
            "minikv_kv_bytes",
            "KV bytes the running sequences' caches hold (stored K/V with scales, residuals and indices)",
        );
        let kv_budget = g(
            &mut r,
            "minikv_kv_budget_bytes",
            "KV bytes the running sequences may hold together",
        );
        let kv_reserved = g(
            &mut r,
            "minikv_kv_reserved_bytes",
            "KV bytes reserved by the running sequences (their caches' projections)",
        );
        let kv_peak = g(
            &mut r,
            "minikv_kv_peak_bytes",
            "Highest minikv_kv_bytes since start",
        );
        let total_bytes = g(
            &mut r,
            "minikv_cache_total_bytes",
            "Bytes the running caches allocate, prefill staging and work buffers included",
        );
        let running = g(
            &mut r,
            "minikv_running_sequences",
            "Sequences admitted and running",
        );
        let waiting = g(
            &mut r,
            "minikv_waiting_sequences",
            "Requests waiting for KV bytes",
        );
        let generated = c(&mut r, "minikv_generated_tokens", "Tokens generated");
        let prompt = c(&mut r, "minikv_prompt_tokens", "Prompt tokens prefilled");
        let steps = c(&mut r, "minikv_engine_steps", "Batched forward steps run");
        let finished = Family::<FinishLabel, Counter>::default();
        r.register(
            "minikv_requests",
            "Requests ended, by how they ended",
            finished.clone(),
        );
        let ttft = h(
            &mut r,
            "minikv_time_to_first_token_seconds",
            "Seconds from submission to the first generated token",
            0.005,
            16,
        );
        let itl = h(
            &mut r,
            "minikv_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of a sequence",
            0.001,
            16,
        );
        let queue = h(
            &mut r,
            "minikv_queue_seconds",
            "Seconds a request waited for admission",
            0.001,
            18,
        );
        let kv_ratio = Histogram::new((1..=20).map(|i| i as f64 * 0.05));
        r.register(
            "minikv_kv_ratio_to_fp16",
            "KV bytes a finished sequence's cache held over a full fp16 cache's for its tokens",
            kv_ratio.clone(),
        );
        Self {
            registry: r,
            kv_bytes,
            kv_budget,
            kv_reserved,
            kv_peak,
            total_bytes,
            running,
            waiting,
            generated,
            prompt,
            steps,
            finished,
            ttft,
            itl,
            queue,
            kv_ratio,
        }
    }

    /// The engine's accounting after a step.
    pub fn engine(&self, s: &EngineStats, prompt_delta: u64, steps_delta: u64) {
        let i = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        self.kv_bytes.set(i(s.kv_bytes));
        self.kv_budget.set(i(s.kv_budget));
        self.kv_reserved.set(i(s.reserved));
        self.kv_peak.set(i(s.peak_kv_bytes));
        self.total_bytes.set(i(s.total_bytes));
        self.running.set(i(s.running));
        self.waiting.set(i(s.waiting));
        self.prompt.inc_by(prompt_delta);
        self.steps.inc_by(steps_delta);
    }

    /// A token was generated.
    pub fn token(&self) {
        self.generated.inc();
    }

    /// A sequence ended.
    pub fn finished(&self, f: &Finished) {
        let finish = match f.finish {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Context => "context",
            Finish::Cancelled => "cancelled",
            Finish::Error(_) => "error",
        };
        self.finished.get_or_create(&FinishLabel { finish }).inc();
        if let Some(t) = f.ttft_s {
            self.ttft.observe(t);
        }
        for &t in &f.itl_s {
            self.itl.observe(t);
        }
        self.queue.observe(f.queue_s);
        if f.full_fp16_bytes > 0 {
            self.kv_ratio
                .observe(f.kv_bytes as f64 / f.full_fp16_bytes as f64);
        }
    }

    /// OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut s, &self.registry);
        s
    }
}
