//! Approximate leverage scores of pre-RoPE keys (Chari & Van Durme 2025,
//! Compactor; kvpress's `LeverageScorePress`): tokens whose keys are
//! geometric outliers of their head are kept.
//!
//! Per KV head, the prompt's keys are un-rotated to their pre-RoPE values,
//! centred over the prompt and sketched on the right by a seeded Gaussian
//! `d × k` matrix scaled by `1/√k` (`Y = (K - mean) Φ`). With `G = YᵀY + λI`
//! (Cholesky `G = LLᵀ`, `λ = 0.01`, ten times larger after each failed
//! factorization, five tries) the leverage of token `j` is
//! `y_jᵀ G⁻¹ y_j = ‖L⁻¹ y_j‖²`, clamped at 0. The scores of all KV heads of the
//! layer are then z-normalized together (unbiased standard deviation, at
//! least 1e-6). Prefill only: the model must hand over its RoPE.

use minikv_core::{
    Error, Needs, Result, ScoreInputs, TokenScorer, broadcast_kv, check_range, register,
};
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

/// Leverage-score scorer (kvpress default: sketch of 48 columns).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LeverageScore {
    /// Columns `k` of the Gaussian sketch (48).
    pub sketch: usize,
    /// Seed of the sketch.
    pub seed: u64,
}

impl Default for LeverageScore {
    fn default() -> Self {
        Self {
            sketch: 48,
            seed: 0,
        }
    }
}

/// The Gaussian sketch `[d][k]` of one KV head, scaled by `1/√k`.
pub fn sketch(seed: u64, layer: usize, head: usize, d: usize, k: usize) -> Vec<f32> {
    let mut rng = crate::random::stream(seed, layer, head);
    let s = 1.0 / (k as f64).sqrt();
    (0..d * k)
        .map(|_| {
            let x: f64 = StandardNormal.sample(&mut rng);
            (x * s) as f32
        })
        .collect()
}

/// Checks a sketch's length against `d × k`.
pub(crate) fn check_sketch(p: &[f32], d: usize, k: usize) -> Result<()> {
    minikv_core::check_len("leverage sketch", d * k, p.len())
}

/// Lower Cholesky factor of the symmetric `n × n` matrix `a` (row-major), or
/// `None` when it is not positive definite.
pub(crate) fn cholesky(a: &[f64], n: usize) -> Option<Vec<f64>> {
    let mut l = vec![0.0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let s: f64 = (0..j).map(|k| l[i * n + k] * l[j * n + k]).sum();
            let v = a[i * n + j] - s;
            if i == j {
                if v.is_nan() || v <= 0.0 {
                    return None;
                }
                l[i * n + i] = v.sqrt();
            } else {
                l[i * n + j] = v / l[j * n + j];
            }
        }
    }
    Some(l)
}

/// Leverage of each of the `t` rows of `x` (`[t][d]`, pre-RoPE keys) under the
/// sketch `phi` (`[d][k]`), before normalization.
pub fn leverage(x: &[f32], t: usize, d: usize, phi: &[f32], k: usize) -> Result<Vec<f32>> {
    let mut mean = vec![0.0f64; d];
    for row in x.chunks_exact(d).take(t) {
        mean.iter_mut().zip(row).for_each(|(m, &v)| *m += v as f64);
    }
    mean.iter_mut().for_each(|m| *m /= t.max(1) as f64);
    let centred: Vec<f32> = x[..t * d]
        .chunks_exact(d)
        .flat_map(|r| r.iter().zip(&mean).map(|(&v, &m)| (v as f64 - m) as f32))
        .collect();
    let mut y = vec![0.0f32; t * k];
    // SAFETY: centred is t x d, phi d x k, y t x k, all row-major and in bounds.
    unsafe {
        matrixmultiply::sgemm(
            t,
            d,
            k,
            1.0,
            centred.as_ptr(),
            d as isize,
            1,
            phi.as_ptr(),
            k as isize,
            1,
            0.0,
            y.as_mut_ptr(),
            k as isize,
            1,
        );
    }
    let yd: Vec<f64> = y.iter().map(|&v| v as f64).collect();
    let mut g = vec![0.0f64; k * k];
    // SAFETY: yd is t x k; g = yd^T yd is k x k.
    unsafe {
        matrixmultiply::dgemm(
            k,
            t,
            k,
            1.0,
            yd.as_ptr(),
            1,
            k as isize,
            yd.as_ptr(),
            k as isize,
            1,
            0.0,
            g.as_mut_ptr(),
            k as isize,
            1,
        );
    }
    let mut jitter = 1e-2;
    let mut factor = None;
    for _ in 0..5 {
        let mut a = g.clone();
        for i in 0..k {
            for j in 0..k {
                a[i * k + j] = 0.5 * (g[i * k + j] + g[j * k + i]);
            }
            a[i * k + i] += jitter;
        }
        factor = cholesky(&a, k);
        if factor.is_some() {
            break;
        }
        jitter *= 10.0;
    }
    let l = factor.ok_or_else(|| {
        Error::Input("leverage: the sketched key Gram matrix is not positive definite".into())
    })?;
    let mut z = vec![0.0f64; k];
    Ok(yd
        .chunks_exact(k)
        .map(|row| {
            for i in 0..k {
                let s: f64 = (0..i).map(|c| l[i * k + c] * z[c]).sum();
                z[i] = (row[i] - s) / l[i * k + i];
            }
            z.iter().map(|v| v * v).sum::<f64>().max(0.0) as f32
        })
        .collect())
}

/// Z-normalizes `x` in place: `(x - mean) / max(std, 1e-6)` with the unbiased
/// standard deviation (torch's `std()`).
pub fn z_normalize(x: &mut [f32]) {
    let n = x.len();
    if n == 0 {
        return;
    }
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / (n.max(2) - 1) as f64;
    let sd = var.sqrt().max(1e-6);
    x.iter_mut()
        .for_each(|v| *v = ((*v as f64 - mean) / sd) as f32);
}

/// Pre-RoPE keys of rows `from..to` of KV head `kv`, `[to - from][d]`.
pub fn pre_rope_keys(inp: &ScoreInputs<'_>, kv: usize, from: usize, to: usize) -> Result<Vec<f32>> {
    let rope = inp.rope.ok_or_else(|| {
        Error::Unsupported(
            "this scorer reads pre-RoPE keys and needs the model's RoPE, which the model hands \
             over during prefill only (decode-time re-scoring does not have it)"
                .into(),
        )
    })?;
    let d = inp.spec.head_dim;
    let mut x = inp.keys[kv][from * d..to * d].to_vec();
    for (i, row) in x.chunks_exact_mut(d).enumerate() {
        rope.unrotate(row, from + i);
    }
    Ok(x)
}

/// Z-normalized leverage `[Hkv][to - from]` of rows `from..to` of every KV
/// head, each head sketched by `phi(kv)` (`[d][k]`, e.g. [`sketch`]).
pub fn layer_leverage(
    inp: &ScoreInputs<'_>,
    from: usize,
    to: usize,
    k: usize,
    phi: &dyn Fn(usize) -> Vec<f32>,
) -> Result<Vec<f32>> {
    let d = inp.spec.head_dim;
    let n = to - from;
    let mut all = Vec::with_capacity(inp.spec.n_kv_heads * n);
    for kv in 0..inp.spec.n_kv_heads {
        let x = pre_rope_keys(inp, kv, from, to)?;
        let p = phi(kv);
        check_sketch(&p, d, k)?;
        all.extend(leverage(&x, n, d, &p, k)?);
    }
    z_normalize(&mut all);
    Ok(all)
}

#[typetag::serde(name = "leverage")]
impl TokenScorer for LeverageScore {
    fn needs(&self) -> Needs {
        Needs {
            rope: true,
            ..Default::default()
        }
    }
    fn validate(&self) -> Result<()> {
        check_range("cache.scorer.sketch", self.sketch, 1, 1024)
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let (t, d) = (inp.t, inp.spec.head_dim);
        let phi = |kv| sketch(self.seed, inp.layer, kv, d, self.sketch);
        let s = layer_leverage(inp, 0, t, self.sketch, &phi)?;
        broadcast_kv(&s, inp.spec.n_q_heads, inp.spec.n_kv_heads, t, out);
        Ok(())
    }
}
register!(
    Scorer,
    "leverage",
    LeverageScore,
    "Leverage scores of pre-RoPE keys under a seeded Gaussian sketch (Compactor's geometry term), z-normalized"
);
