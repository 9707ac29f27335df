//! ResKV's clustering and its measurements: k-means of the evicted keys,
//! the cluster summaries, one query's attention over exact tokens plus
//! clusters, and the held-out residual statistics of the proxy.

use super::Gate;
use minikv_core::simd;
use serde::Serialize;

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
