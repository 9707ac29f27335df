//! ResKV (docs/algorithms.md §7): the tokens a selection evicts are not dropped but
//! summarized by a few residual clusters per (layer, KV head), which join the
//! decode softmax with a logit bias `beta * log(count) + log g(q)`.
//!
//! Each head's budget `b` (what the selector kept) is split into `m` exact
//! tokens and `r = round(ratio * b)` cluster entries: the `r` lowest-scored kept
//! tokens outside the sinks and the recent window are demoted to the evicted
//! set `E`, which Lloyd's k-means (deterministic init: evenly spaced members in
//! position order) partitions in key space. With `select = "proxy"` the ratio
//! is picked per head from `candidates` by the attention-output error on the
//! last `held_out` prompt queries against the full prompt (non-causal, as a
//! decode query sees it), and kept at 0 unless the best is `delta` better.
//!
//! The gate (the seed fixes tau, alpha and g_min but not the sharpness
//! measure; minikv's reading): `s` = largest attention probability over the
//! exact tokens alone, `g = max(g_min, sigmoid(alpha * (tau - s)))`; `none`
//! gives `g = 1`.
//!
//! ```
//! use minikv_policies::reskv::kmeans;
//! // Two well-separated groups of 1-d keys: {0, 0.1, 0.2} and {10, 10.1}.
//! let keys = [0.0, 0.1, 0.2, 10.0, 10.1];
//! let members: Vec<u32> = (0..5).collect();
//! let (centroids, assign) = kmeans(&keys, 1, &members, 2, 5);
//! assert_eq!(assign, vec![0, 0, 0, 1, 1]);
//! assert!((centroids[1] - 10.05).abs() < 1e-6);
//! ```

use minikv_core::compensate::{CompensateInput, Compensation, Compensator, LogitGate, evicted_of};
use minikv_core::{Error, Needs, Result, simd};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// How the residual share of each head is chosen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RatioSelect {
    /// `ratio` for every head.
    #[default]
    Fixed,
    /// Per head from `candidates` by held-out attention-output error (§7).
    Proxy,
}

/// The dynamic gate's sharpness measure.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateMeasure {
    /// `s` = largest attention probability over the exact tokens.
    #[default]
    MaxProb,
    /// No gate (`g = 1`).
    None,
}

fn d_ratio() -> f64 {
    0.1
}
fn d_iters() -> usize {
    5
}
fn d_beta() -> f32 {
    1.0
}
fn d_tau() -> f32 {
    0.25
}
fn d_alpha() -> f32 {
    12.0
}
fn d_held() -> usize {
    32
}
fn d_candidates() -> Vec<f64> {
    vec![0.0, 0.05, 0.10, 0.15, 0.20]
}
fn d_delta() -> f64 {
    0.01
}

/// `[cache.compensator] type = "reskv"`: residual clusters of evicted tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResKvConfig {
    /// Share `r / b` of each head's budget given to cluster entries, in `[0, 1)`.
    #[serde(default = "d_ratio")]
    pub ratio: f64,
    /// `fixed` (use `ratio`) or `proxy` (pick per head from `candidates`).
    #[serde(default)]
    pub select: RatioSelect,
    /// Candidate ratios of the proxy.
    #[serde(default = "d_candidates")]
    pub candidates: Vec<f64>,
    /// Relative improvement the proxy needs over `r = 0`.
    #[serde(default = "d_delta")]
    pub delta: f64,
    /// Lloyd iterations.
    #[serde(default = "d_iters")]
    pub iters: usize,
    /// Weight of `log(count)` in the cluster logit.
    #[serde(default = "d_beta")]
    pub beta: f32,
    /// Gate sharpness measure.
    #[serde(default)]
    pub gate: GateMeasure,
    /// Gate threshold on the sharpness.
    #[serde(default = "d_tau")]
    pub tau: f32,
    /// Gate sigmoid slope.
    #[serde(default = "d_alpha")]
    pub alpha: f32,
    /// Gate floor.
    #[serde(default)]
    pub g_min: f32,
    /// Last prompt queries held out for the proxy and the diagnostics.
    #[serde(default = "d_held")]
    pub held_out: usize,
}

impl Default for ResKvConfig {
    fn default() -> Self {
        serde_json::from_value(serde_json::json!({})).expect("defaults")
    }
}

impl ResKvConfig {
    /// Range checks, naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |f: &str, m: String| Err(Error::config(format!("cache.compensator.{f}"), m));
        if !(0.0..1.0).contains(&self.ratio) {
            return bad("ratio", format!("must be in [0, 1), got {}", self.ratio));
        }
        if self.candidates.is_empty() || self.candidates.iter().any(|c| !(0.0..1.0).contains(c)) {
            return bad(
                "candidates",
                format!(
                    "must be non-empty ratios in [0, 1), got {:?}",
                    self.candidates
                ),
            );
        }
        if !(0.0..1.0).contains(&self.delta) {
            return bad("delta", format!("must be in [0, 1), got {}", self.delta));
        }
        if !(1..=100).contains(&self.iters) {
            return bad("iters", format!("must be in 1..=100, got {}", self.iters));
        }
        if !self.beta.is_finite() || !(0.0..=4.0).contains(&self.beta) {
            return bad("beta", format!("must be in [0, 4], got {}", self.beta));
        }
        if !(0.0..=1.0).contains(&self.tau) {
            return bad("tau", format!("must be in [0, 1], got {}", self.tau));
        }
        if !self.alpha.is_finite() || self.alpha < 0.0 {
            return bad(
                "alpha",
                format!("must be finite and >= 0, got {}", self.alpha),
            );
        }
        if !(0.0..=1.0).contains(&self.g_min) {
            return bad("g_min", format!("must be in [0, 1], got {}", self.g_min));
        }
        if self.select == RatioSelect::Proxy && self.held_out == 0 {
            return bad("held_out", "the proxy needs held-out queries (> 0)".into());
        }
        Ok(())
    }

    /// The decode-time gate.
    pub fn gate(&self) -> Option<Gate> {
        (self.gate == GateMeasure::MaxProb).then_some(Gate {
            tau: self.tau,
            alpha: self.alpha,
            g_min: self.g_min,
        })
    }
}

/// The dynamic gate `g = max(g_min, sigmoid(alpha * (tau - s)))`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gate {
    /// Threshold.
    pub tau: f32,
    /// Slope.
    pub alpha: f32,
    /// Floor.
    pub g_min: f32,
}

impl Gate {
    /// `log g` for sharpness `s` (the largest exact-token probability), never
    /// `-inf` (floored at `log 1e-30`).
    pub fn log_g(&self, s: f32) -> f32 {
        let g = (1.0 / (1.0 + (-self.alpha * (self.tau - s)).exp())).max(self.g_min);
        g.max(1e-30).ln()
    }

    /// `log g` from the exact tokens' scaled logits.
    pub fn log_g_of_logits(&self, logits: &[f32]) -> f32 {
        if logits.is_empty() {
            return self.log_g(0.0);
        }
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = logits.iter().map(|&x| (x - m).exp()).sum();
        self.log_g(1.0 / z)
    }
}

impl LogitGate for Gate {
    fn log_gate(&self, exact_logits: &[f32]) -> f32 {
        self.log_g_of_logits(exact_logits)
    }
    /// The same formula in f64 (the reference backend).
    fn log_gate_f64(&self, sc: &[f64]) -> f64 {
        let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
        let s = if sc.is_empty() { 0.0 } else { 1.0 / z };
        let g = (1.0 / (1.0 + (-(self.alpha as f64) * (self.tau as f64 - s)).exp()))
            .max(self.g_min as f64)
            .max(1e-30);
        g.ln()
    }
}

#[typetag::serde(name = "reskv")]
impl Compensator for ResKvConfig {
    fn needs(&self) -> Needs {
        Needs {
            query_window: self.held_out,
            ..Default::default()
        }
    }
    fn validate(&self) -> Result<()> {
        ResKvConfig::validate(self)
    }
    fn gate(&self) -> Option<Arc<dyn LogitGate>> {
        ResKvConfig::gate(self).map(|g| Arc::new(g) as Arc<dyn LogitGate>)
    }
    /// Demotes the `r` lowest-scored kept tokens outside the sinks and the
    /// recent window, clusters every evicted token, and measures the result on
    /// the held-out prompt queries (fixed ratio, or the per-head proxy).
    fn compensate(&self, inp: &CompensateInput<'_>) -> Result<Compensation> {
        let (t, d) = (inp.t, inp.d);
        let rows = HeadRows {
            keys: inp.keys,
            values: inp.values,
            d,
        };
        let gate = ResKvConfig::gate(self);
        let recent_start = t.saturating_sub(inp.recent);
        let scores = inp.scores;
        let qs = inp.queries;
        let w = inp.n_queries;
        // Kept tokens that may be demoted, lowest score first.
        let mut demotable: Vec<u32> = inp
            .kept
            .iter()
            .copied()
            .filter(|&p| (p as usize) >= inp.sinks && (p as usize) < recent_start)
            .collect();
        demotable.sort_by(|&a, &b| {
            scores[a as usize]
                .total_cmp(&scores[b as usize])
                .then(b.cmp(&a))
        });
        let b = inp.kept.len();
        let split = |ratio: f64| {
            let r = ((ratio * b as f64).round() as usize).min(demotable.len());
            let mut gone = demotable[..r].to_vec();
            gone.sort_unstable();
            let main: Vec<u32> = inp
                .kept
                .iter()
                .copied()
                .filter(|p| gone.binary_search(p).is_err())
                .collect();
            let evicted = evicted_of(&main, t);
            let c = Clusters::build(rows, &evicted, r, self.iters, self.beta);
            (main, evicted, c)
        };
        // The full-prompt reference outputs, once per head.
        let full = if w > 0 {
            full_outputs(qs, rows, t)
        } else {
            Vec::new()
        };
        let with_stats = |ratio: f64| {
            let (main, evicted, c) = split(ratio);
            let st = if w > 0 {
                residual_stats(qs, &full, rows, &main, &evicted, &c, gate)
            } else {
                ResidualStats {
                    evicted: evicted.len(),
                    clusters: c.len(),
                    ..Default::default()
                }
            };
            (main, c, st)
        };
        let (main, c, st) = match self.select {
            RatioSelect::Fixed => with_stats(self.ratio),
            RatioSelect::Proxy => {
                let base = with_stats(0.0);
                let best = self
                    .candidates
                    .iter()
                    .filter(|&&c| c > 0.0)
                    .map(|&c| with_stats(c))
                    .min_by(|a, b| a.2.output_error.total_cmp(&b.2.output_error));
                // Keep r = 0 unless the best is `delta` better.
                match best {
                    Some(b) if b.2.output_error <= (1.0 - self.delta) * base.2.output_error => b,
                    _ => base,
                }
            }
        };
        let mut out = Compensation::keep(main);
        out.entries.keys = c.keys;
        out.entries.values = c.values;
        out.entries.bias = c.bias;
        out.stats = vec![
            ("evicted", st.evicted as f64),
            ("clusters", st.clusters as f64),
            ("eta", st.eta),
            ("denominator_error", st.denominator_error),
            ("numerator_error", st.numerator_error),
            ("output_error", st.output_error),
            ("output_error_dropped", st.output_error_dropped),
        ];
        Ok(out)
    }
}
minikv_core::register!(
    Compensator,
    "reskv",
    ResKvConfig,
    "ResKV: evicted tokens summarized by k-means clusters joining the decode softmax (log-count bias, max-prob gate); fixed ratio or per-head proxy"
);

/// Lloyd's k-means of `members` (rows of `keys`, `[t][d]`) into at most `r`
/// clusters: returns centroids `[r'][d]` and each member's cluster. Init: the
/// members at evenly spaced ranks; empty clusters are dropped at the end.
pub fn kmeans(
    keys: &[f32],
    d: usize,
    members: &[u32],
    r: usize,
    iters: usize,
) -> (Vec<f32>, Vec<u32>) {
    let n = members.len();
    let r = r.min(n);
    if r == 0 {
        return (Vec::new(), Vec::new());
    }
    let row = |p: u32| &keys[p as usize * d..(p as usize + 1) * d];
    let mut cent = Vec::with_capacity(r * d);
    for j in 0..r {
        cent.extend_from_slice(row(members[(2 * j + 1) * n / (2 * r)]));
    }
    let mut assign = vec![0u32; n];
    let mut norms = vec![0.0f32; r];
    let mut sums = vec![0.0f32; r * d];
    let mut counts = vec![0u32; r];
    for it in 0..iters.max(1) {
        for (j, c) in norms.iter_mut().enumerate() {
            *c = simd::dot(&cent[j * d..(j + 1) * d], &cent[j * d..(j + 1) * d]);
        }
        let mut changed = false;
        for (i, &p) in members.iter().enumerate() {
            let k = row(p);
            let mut best = (f32::INFINITY, 0u32);
            for j in 0..r {
                // |k - c|^2 - |k|^2 = |c|^2 - 2 k.c
                let dist = norms[j] - 2.0 * simd::dot(k, &cent[j * d..(j + 1) * d]);
                if dist < best.0 {
                    best = (dist, j as u32);
                }
            }
            changed |= assign[i] != best.1;
            assign[i] = best.1;
        }
        if it > 0 && !changed {
            break;
        }
        sums.fill(0.0);
        counts.fill(0);
        for (i, &p) in members.iter().enumerate() {
            let j = assign[i] as usize;
            counts[j] += 1;
            simd::axpy(1.0, row(p), &mut sums[j * d..(j + 1) * d]);
        }
        for j in 0..r {
            if counts[j] > 0 {
                let inv = 1.0 / counts[j] as f32;
                for (c, s) in cent[j * d..(j + 1) * d]
                    .iter_mut()
                    .zip(&sums[j * d..(j + 1) * d])
                {
                    *c = s * inv;
                }
            }
        }
    }
    // Drop empty clusters, renumbering the assignment.
    let mut counts = vec![0u32; r];
    for &a in &assign {
        counts[a as usize] += 1;
    }
    let mut remap = vec![u32::MAX; r];
    let mut out = Vec::with_capacity(r * d);
    let mut next = 0u32;
    for j in 0..r {
        if counts[j] > 0 {
            remap[j] = next;
            next += 1;
            out.extend_from_slice(&cent[j * d..(j + 1) * d]);
        }
    }
    for a in &mut assign {
        *a = remap[*a as usize];
    }
    (out, assign)
}

/// One head's prompt rows: keys and values `[t][d]`.
#[derive(Debug, Clone, Copy)]
pub struct HeadRows<'a> {
    /// Keys `[t][d]`.
    pub keys: &'a [f32],
    /// Values `[t][d]`.
    pub values: &'a [f32],
    /// Head dimension.
    pub d: usize,
}

impl HeadRows<'_> {
    fn key(&self, p: u32) -> &[f32] {
        &self.keys[p as usize * self.d..(p as usize + 1) * self.d]
    }
    fn value(&self, p: u32) -> &[f32] {
        &self.values[p as usize * self.d..(p as usize + 1) * self.d]
    }
}

/// Cluster entries of one head.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Clusters {
    /// Mean keys `[c][d]` (rounded to fp16, as stored).
    pub keys: Vec<f32>,
    /// Mean values `[c][d]` (rounded to fp16, as stored).
    pub values: Vec<f32>,
    /// Members per cluster.
    pub counts: Vec<u32>,
    /// `beta * ln(count)` per cluster.
    pub bias: Vec<f32>,
    /// The cluster of each summarized token, in the order given to
    /// [`Clusters::build`] (not stored by caches).
    pub assign: Vec<u32>,
}

impl Clusters {
    /// Summarizes `evicted` rows of `keys` / `values` (`[t][d]`) by `r` clusters.
    pub fn build(rows: HeadRows<'_>, evicted: &[u32], r: usize, iters: usize, beta: f32) -> Self {
        let d = rows.d;
        let (ck, assign) = kmeans(rows.keys, d, evicted, r, iters);
        let c = ck.len() / d.max(1);
        let mut cv = vec![0.0f32; c * d];
        let mut counts = vec![0u32; c];
        for (&p, &a) in evicted.iter().zip(&assign) {
            let a = a as usize;
            counts[a] += 1;
            simd::axpy(1.0, rows.value(p), &mut cv[a * d..(a + 1) * d]);
        }
        for (j, &n) in counts.iter().enumerate() {
            let inv = 1.0 / n as f32;
            cv[j * d..(j + 1) * d].iter_mut().for_each(|x| *x *= inv);
        }
        // Entries are stored in fp16: use the stored values from here on.
        let mut ck = ck;
        for x in ck.iter_mut().chain(cv.iter_mut()) {
            *x = half::f16::from_f32(*x).to_f32();
        }
        let bias = counts.iter().map(|&n| beta * (n as f32).ln()).collect();
        Self {
            keys: ck,
            values: cv,
            counts,
            bias,
            assign,
        }
    }

    /// Entries.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// True without entries.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// Bytes as a cache stores them: fp16 keys and values, f32 bias, u32 counts.
    pub fn bytes(&self) -> usize {
        2 * (self.keys.len() + self.values.len()) + 4 * (self.bias.len() + self.counts.len())
    }
}

/// Attention output of `q` (unscaled, `[d]`) over exact rows `main` of
/// `keys`/`values` plus `clusters` (with `gate`), into `out` (`[d]`), in f64.
/// Used by the proxy and the diagnostics, not by decode.
pub fn attend_one(
    q: &[f32],
    rows: HeadRows<'_>,
    main: &[u32],
    clusters: &Clusters,
    gate: Option<Gate>,
    out: &mut [f64],
) {
    let d = rows.d;
    let scale = 1.0 / (d as f32).sqrt();
    let mut lg: Vec<f32> = main
        .iter()
        .map(|&p| simd::dot(q, rows.key(p)) * scale)
        .collect();
    let log_g = gate.map_or(0.0, |g| g.log_g_of_logits(&lg));
    let n = lg.len();
    for j in 0..clusters.len() {
        lg.push(
            simd::dot(q, &clusters.keys[j * d..(j + 1) * d]) * scale + clusters.bias[j] + log_g,
        );
    }
    let m = lg.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    out.fill(0.0);
    let mut z = 0.0f64;
    for (i, &l) in lg.iter().enumerate() {
        let w = ((l - m) as f64).exp();
        z += w;
        let v = if i < n {
            rows.value(main[i])
        } else {
            let j = i - n;
            &clusters.values[j * d..(j + 1) * d]
        };
        for (o, &x) in out.iter_mut().zip(v) {
            *o += w * x as f64;
        }
    }
    if z > 0.0 {
        out.iter_mut().for_each(|o| *o /= z);
    }
}

/// What the review asks ResKV to report, per head, on held-out queries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ResidualStats {
    /// Evicted tokens summarized.
    pub evicted: usize,
    /// Cluster entries.
    pub clusters: usize,
    /// Mean |q.k_p - q.k̄_j| / sqrt(d) over members p of each cluster j (η).
    pub eta: f64,
    /// |D_res - D_E| / D_E: the residual entries' softmax mass (bias and gate
    /// included) against the evicted tokens' exact mass.
    pub denominator_error: f64,
    /// |N_res - N_E| / |N_E| for the value-weighted numerators.
    pub numerator_error: f64,
    /// Attention-output error with the clusters, `|o - o_full| / |o_full|`.
    pub output_error: f64,
    /// The same without the clusters (evicted tokens dropped).
    pub output_error_dropped: f64,
}

/// Attention outputs (`[w][d]`, f64) of `queries` over all `t` prompt rows:
/// the reference of [`residual_stats`], computed once per head.
pub fn full_outputs(queries: &[f32], rows: HeadRows<'_>, t: usize) -> Vec<f64> {
    let all: Vec<u32> = (0..t as u32).collect();
    let empty = Clusters::default();
    let mut out = vec![0.0; queries.len()];
    for (q, o) in queries
        .chunks_exact(rows.d)
        .zip(out.chunks_exact_mut(rows.d))
    {
        attend_one(q, rows, &all, &empty, None, o);
    }
    out
}

/// [`ResidualStats`] of one head on `queries` (`[w][d]`, unscaled), against
/// their [`full_outputs`]; `clusters` must be built from `evicted`.
pub fn residual_stats(
    queries: &[f32],
    full: &[f64],
    rows: HeadRows<'_>,
    main: &[u32],
    evicted: &[u32],
    clusters: &Clusters,
    gate: Option<Gate>,
) -> ResidualStats {
    let d = rows.d;
    let scale = 1.0 / (d as f32).sqrt();
    let ck = &clusters.keys;
    let empty = Clusters::default();
    let (mut eta, mut neta) = (0.0f64, 0usize);
    let (mut den, mut num, mut nq) = (0.0f64, 0.0f64, 0usize);
    let (mut e_c, mut e_d, mut ref_n) = (0.0f64, 0.0f64, 0.0f64);
    let (mut o_c, mut o_d) = (vec![0.0; d], vec![0.0; d]);
    for (q, o_full) in queries.chunks_exact(d).zip(full.chunks_exact(d)) {
        let lmain: Vec<f32> = main
            .iter()
            .map(|&p| simd::dot(q, rows.key(p)) * scale)
            .collect();
        let log_g = gate.map_or(0.0, |g| g.log_g_of_logits(&lmain));
        let lc: Vec<f32> = (0..clusters.len())
            .map(|j| simd::dot(q, &ck[j * d..(j + 1) * d]) * scale)
            .collect();
        let le: Vec<f32> = evicted
            .iter()
            .map(|&p| simd::dot(q, rows.key(p)) * scale)
            .collect();
        for (i, &l) in le.iter().enumerate() {
            if !clusters.is_empty() {
                eta += (l - lc[clusters.assign[i] as usize]).abs() as f64;
                neta += 1;
            }
        }
        if !evicted.is_empty() {
            // Masses relative to a shared maximum.
            let m = le
                .iter()
                .chain(&lc)
                .copied()
                .fold(f32::NEG_INFINITY, f32::max) as f64;
            let (mut de, mut dr) = (0.0f64, 0.0f64);
            let (mut ne, mut nr) = (vec![0.0f64; d], vec![0.0f64; d]);
            for (i, &p) in evicted.iter().enumerate() {
                let w = (le[i] as f64 - m).exp();
                de += w;
                for (a, &v) in ne.iter_mut().zip(rows.value(p)) {
                    *a += w * v as f64;
                }
            }
            for (j, &l) in lc.iter().enumerate() {
                let w = (l as f64 + clusters.bias[j] as f64 + log_g as f64 - m).exp();
                dr += w;
                for (a, &v) in nr.iter_mut().zip(&clusters.values[j * d..(j + 1) * d]) {
                    *a += w * v as f64;
                }
            }
            den += (dr - de).abs() / de;
            let nn: f64 = ne.iter().map(|x| x * x).sum::<f64>().sqrt();
            let dn: f64 = ne
                .iter()
                .zip(&nr)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f64>()
                .sqrt();
            num += if nn > 0.0 { dn / nn } else { 0.0 };
            nq += 1;
        }
        attend_one(q, rows, main, clusters, gate, &mut o_c);
        attend_one(q, rows, main, &empty, None, &mut o_d);
        for c in 0..d {
            e_c += (o_c[c] - o_full[c]).powi(2);
            e_d += (o_d[c] - o_full[c]).powi(2);
            ref_n += o_full[c].powi(2);
        }
    }
    let rel = |e: f64| if ref_n > 0.0 { (e / ref_n).sqrt() } else { 0.0 };
    ResidualStats {
        evicted: evicted.len(),
        clusters: clusters.len(),
        eta: if neta > 0 { eta / neta as f64 } else { 0.0 },
        denominator_error: if nq > 0 { den / nq as f64 } else { 0.0 },
        numerator_error: if nq > 0 { num / nq as f64 } else { 0.0 },
        output_error: rel(e_c),
        output_error_dropped: rel(e_d),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(t: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
        let k = (0..t * d)
            .map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 2.0)
            .collect();
        let v = (0..t * d)
            .map(|i| (i * 53 % 97) as f32 / 48.0 - 1.0)
            .collect();
        (k, v)
    }

    #[test]
    fn one_cluster_per_evicted_token_is_exact() {
        // Every evicted token its own cluster (count 1, bias 0), no gate: the
        // same softmax as the full prompt, up to fp16 storage.
        let (t, d) = (40, 8);
        let (k, v) = data(t, d);
        let main: Vec<u32> = (0..t as u32).filter(|p| p % 3 == 0).collect();
        let ev: Vec<u32> = (0..t as u32).filter(|p| p % 3 != 0).collect();
        let rows = HeadRows {
            keys: &k,
            values: &v,
            d,
        };
        let c = Clusters::build(rows, &ev, ev.len(), 3, 1.0);
        assert_eq!(c.len(), ev.len());
        let q: Vec<f32> = (0..4 * d).map(|i| (i as f32 * 0.3).sin()).collect();
        let full = full_outputs(&q, rows, t);
        let s = residual_stats(&q, &full, rows, &main, &ev, &c, None);
        // Up to the fp16 rounding of the stored entries (2^-11 relative).
        assert!(s.eta < 1e-3 && s.denominator_error < 1e-3, "{s:?}");
        assert!(s.numerator_error < 2e-3 && s.output_error < 2e-3, "{s:?}");
        assert!(s.output_error_dropped > 0.1, "{s:?}");
    }

    #[test]
    fn clusters_conserve_members_and_means() {
        let (t, d) = (64, 4);
        let (k, v) = data(t, d);
        let ev: Vec<u32> = (5..60).collect();
        let rows = HeadRows {
            keys: &k,
            values: &v,
            d,
        };
        let c = Clusters::build(rows, &ev, 7, 5, 1.0);
        assert!(c.len() <= 7 && !c.is_empty());
        assert_eq!(c.counts.iter().sum::<u32>() as usize, ev.len());
        // Weighted mean of cluster means = mean of the evicted values.
        for ch in 0..d {
            let direct: f32 = ev.iter().map(|&p| v[p as usize * d + ch]).sum::<f32>() / 55.0;
            let via: f32 = (0..c.len())
                .map(|j| c.values[j * d + ch] * c.counts[j] as f32)
                .sum::<f32>()
                / 55.0;
            // fp16 storage of the means: |error| <= 2^-11 |mean| per cluster.
            assert!((direct - via).abs() < 1e-3, "{direct} vs {via}");
        }
        for (b, &n) in c.bias.iter().zip(&c.counts) {
            assert_eq!(*b, (n as f32).ln());
        }
        // Deterministic.
        assert_eq!(c, Clusters::build(rows, &ev, 7, 5, 1.0));
    }

    #[test]
    fn gate_formula() {
        let g = Gate {
            tau: 0.25,
            alpha: 12.0,
            g_min: 0.0,
        };
        // s = tau: sigmoid(0) = 1/2.
        assert!((g.log_g(0.25) - 0.5f32.ln()).abs() < 1e-6);
        // Sharp main attention (s = 1): sigmoid(-9).
        let want = (1.0 / (1.0 + 9f32.exp())).ln();
        assert!((g.log_g(1.0) - want).abs() < 1e-5);
        // Two equal logits: s = 1/2.
        assert!((g.log_g_of_logits(&[0.3, 0.3]) - g.log_g(0.5)).abs() < 1e-6);
        let floor = Gate { g_min: 0.5, ..g };
        assert!((floor.log_g(1.0) - 0.5f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn validation_names_the_field() {
        for (c, field) in [
            (
                ResKvConfig {
                    ratio: 1.5,
                    ..Default::default()
                },
                "cache.compensator.ratio",
            ),
            (
                ResKvConfig {
                    iters: 0,
                    ..Default::default()
                },
                "cache.compensator.iters",
            ),
        ] {
            assert!(c.validate().unwrap_err().to_string().contains(field));
        }
        assert!(ResKvConfig::default().validate().is_ok());
        let e = serde_json::from_value::<ResKvConfig>(serde_json::json!({"ratoi": 0.1}));
        assert!(e.unwrap_err().to_string().contains("ratoi"));
    }
}
