//! Calibration of Q-Filters (docs/algorithms.md "Q-Filters"): per (layer, KV
//! head), the dominant direction of the model's own post-RoPE queries over
//! text chunks, the queries of every query head of the GQA group stacked,
//! signed so that they project positively on it
//! ([`dominant_direction`]); the `q_filter` scorer of `minikv-policies`
//! reads the file. The chunks run through
//! a full cache; a recording wrapper keeps every query of each layer.

use crate::duo::Recording;
use minikv_core::{Error, KvCache, Result};
use minikv_models::{LanguageModel, Logits, Workspace};

/// One head's filter (a unit vector) and the share of its queries' second
/// moment along it.
pub type HeadFilter = (Vec<f32>, f32);

/// Per (layer, KV head): the filter and its share. `chunks` are token
/// sequences, each run from an empty cache.
pub fn calibrate_qfilters(
    model: &dyn LanguageModel,
    chunks: &[Vec<u32>],
    full_cache: impl Fn() -> Result<Box<dyn KvCache>>,
) -> Result<Vec<Vec<HeadFilter>>> {
    let spec = model.spec();
    let (l, hq, hkv, d) = (
        spec.n_layers,
        spec.n_q_heads,
        spec.n_kv_heads,
        spec.head_dim,
    );
    let g = hq / hkv;
    // Stacked queries per (layer, KV head): [rows][d].
    let mut stacked = vec![vec![Vec::<f32>::new(); hkv]; l];
    let mut ws = Workspace::default();
    for ids in chunks {
        if ids.is_empty() {
            return Err(Error::Input("calibrate qfilters: an empty chunk".into()));
        }
        let mut c = Recording::new(full_cache()?, l, ids.len());
        model.forward(ids, &mut c, &mut ws, Logits::None)?;
        for (layer, q) in c.queries.iter().enumerate() {
            // Queries arrive as [t][Hq][d].
            for row in q.chunks_exact(hq * d) {
                for h in 0..hq {
                    stacked[layer][h / g].extend_from_slice(&row[h * d..(h + 1) * d]);
                }
            }
        }
    }
    stacked
        .iter()
        .enumerate()
        .map(|(layer, heads)| {
            heads
                .iter()
                .enumerate()
                .map(|(kv, x)| {
                    dominant_direction(x, d).ok_or_else(|| {
                        Error::Input(format!(
                            "calibrate qfilters: no queries for layer {layer}, KV head {kv}"
                        ))
                    })
                })
                .collect()
        })
        .collect()
}

/// The dominant direction of rows `x [n][d]` (the first right singular
/// vector: the top eigenvector of `xᵀx`, by cyclic Jacobi in f64), signed so
/// that the rows project positively on average; with the share of `xᵀx`'s
/// trace along it. `None` for no rows.
pub fn dominant_direction(x: &[f32], d: usize) -> Option<(Vec<f32>, f32)> {
    if d == 0 || x.len() < d || !x.len().is_multiple_of(d) {
        return None;
    }
    let mut a = vec![0.0f64; d * d];
    for r in x.chunks_exact(d) {
        for i in 0..d {
            let ri = r[i] as f64;
            for j in i..d {
                a[i * d + j] += ri * r[j] as f64;
            }
        }
    }
    for i in 0..d {
        for j in 0..i {
            a[i * d + j] = a[j * d + i];
        }
    }
    let trace: f64 = (0..d).map(|i| a[i * d + i]).sum();
    let (vals, vecs) = jacobi_eigen(a, d);
    let top = (0..d).max_by(|&i, &j| vals[i].total_cmp(&vals[j]))?;
    let mut u: Vec<f64> = (0..d).map(|r| vecs[r * d + top]).collect();
    let mean_proj: f64 = x
        .chunks_exact(d)
        .map(|r| r.iter().zip(&u).map(|(&a, &b)| a as f64 * b).sum::<f64>())
        .sum();
    if mean_proj < 0.0 {
        u.iter_mut().for_each(|v| *v = -*v);
    }
    let n = u.iter().map(|v| v * v).sum::<f64>().sqrt();
    let share = if trace > 0.0 { vals[top] / trace } else { 0.0 };
    Some((u.iter().map(|v| (v / n) as f32).collect(), share as f32))
}

/// Eigenvalues and eigenvectors (columns of `[d][d]`) of a symmetric
/// matrix by cyclic Jacobi rotations.
fn jacobi_eigen(mut a: Vec<f64>, d: usize) -> (Vec<f64>, Vec<f64>) {
    let mut v = vec![0.0f64; d * d];
    for i in 0..d {
        v[i * d + i] = 1.0;
    }
    for _sweep in 0..100 {
        let off: f64 = (0..d)
            .flat_map(|i| (0..d).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * d + j] * a[i * d + j])
            .sum();
        let scale: f64 = (0..d).map(|i| a[i * d + i] * a[i * d + i]).sum();
        if off <= 1e-24 * scale.max(1e-300) {
            break;
        }
        for p in 0..d {
            for q in p + 1..d {
                let apq = a[p * d + q];
                if apq == 0.0 {
                    continue;
                }
                let theta = (a[q * d + q] - a[p * d + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..d {
                    let (akp, akq) = (a[k * d + p], a[k * d + q]);
                    a[k * d + p] = c * akp - s * akq;
                    a[k * d + q] = s * akp + c * akq;
                }
                for k in 0..d {
                    let (apk, aqk) = (a[p * d + k], a[q * d + k]);
                    a[p * d + k] = c * apk - s * aqk;
                    a[q * d + k] = s * apk + c * aqk;
                }
                for k in 0..d {
                    let (vkp, vkq) = (v[k * d + p], v[k * d + q]);
                    v[k * d + p] = c * vkp - s * vkq;
                    v[k * d + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    ((0..d).map(|i| a[i * d + i]).collect(), v)
}

#[cfg(test)]
mod tests {
    use super::dominant_direction;

    /// Against numpy's SVD (first right singular vector, signed so that the
    /// rows project positively; share = s_0^2 / sum s_i^2).
    #[test]
    fn dominant_direction_matches_numpy() {
        let q = [3.0f32, 1.0, 2.0, 0.5, -0.1, 0.2, 2.5, 1.5];
        let (u, share) = dominant_direction(&q, 2).unwrap();
        for (a, b) in u.iter().zip([0.925_467, 0.378_828_2]) {
            assert!((a - b).abs() < 1e-6, "{u:?}");
        }
        assert!((share - 0.983_516_6).abs() < 1e-6);
        let q = [
            1.0f32, -2.0, 0.5, 3.0, -1.0, 2.0, 0.3, -3.5, 0.2, 0.1, -0.4, 0.3, 2.0, -4.0, 1.0, 5.5,
            0.0, 1.0, 0.0, -1.0,
        ];
        let (u, share) = dominant_direction(&q, 4).unwrap();
        for (a, b) in u
            .iter()
            .zip([0.264_638_5, -0.544_004_8, 0.092_097_03, 0.790_913])
        {
            assert!((a - b).abs() < 1e-6, "{u:?}");
        }
        assert!((share - 0.985_262_6).abs() < 1e-6);
        // The sign follows the rows: negated rows, negated direction.
        let neg: Vec<f32> = q.iter().map(|x| -x).collect();
        let (v, _) = dominant_direction(&neg, 4).unwrap();
        for (a, b) in u.iter().zip(&v) {
            assert!((a + b).abs() < 1e-6);
        }
        assert!(dominant_direction(&[], 4).is_none());
        assert!(dominant_direction(&[1.0, 2.0, 3.0], 2).is_none());
    }
}
