//! The naive, exact reference backend (f64 accumulation, dequantize then attend).

use super::{AttentionBackend, DecodeArgs, PrefillArgs, check_decode, check_prefill};
use crate::Result;
use crate::storage::{CpuStorage, StorageFactory};

/// Exact attention: explicit scores, f64 softmax. Slow; for tests and checks.
#[derive(Debug, Default, Clone, Copy)]
pub struct ReferenceBackend;

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

impl AttentionBackend for ReferenceBackend {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn prefill(&self, mut a: PrefillArgs<'_>) -> Result<()> {
        let (_, g) = check_prefill(&a)?;
        let (hq, d, n, t) = (a.n_q_heads, a.head_dim, a.n, a.t);
        let scale = 1.0 / (d as f64).sqrt();
        let mut s = vec![0.0f64; t];
        for h in 0..hq {
            let (k, v) = (a.keys[h / g], a.values[h / g]);
            for i in 0..n {
                let (lo, hi) = a.visible(i);
                let vis = lo..hi + 1;
                let q = &a.q[(h * n + i) * d..(h * n + i + 1) * d];
                let mut m = f64::NEG_INFINITY;
                for j in vis.clone() {
                    s[j] = dot64(q, &k[j * d..(j + 1) * d]) * scale;
                    m = m.max(s[j]);
                }
                let mut z = 0.0;
                for x in &mut s[vis.clone()] {
                    *x = (*x - m).exp();
                    z += *x;
                }
                let o = &mut a.out[(h * n + i) * d..(h * n + i + 1) * d];
                for c in 0..d {
                    let mut acc = 0.0;
                    for j in vis.clone() {
                        acc += s[j] * v[j * d + c] as f64;
                    }
                    o[c] = (acc / z) as f32;
                }
                if let Some(cu) = a.cumulative.as_deref_mut() {
                    for j in vis {
                        cu[h * t + j] += (s[j] / z) as f32;
                    }
                }
            }
        }
        Ok(())
    }

    fn decode(&self, a: DecodeArgs<'_>) -> Result<()> {
        let g = check_decode(&a)?;
        let d = a.head_dim;
        let scale = 1.0 / (d as f64).sqrt();
        let mut probs = a.probs;
        for (s, head) in a.heads.iter().enumerate() {
            let n = head.len();
            let mut keys = vec![0.0f32; n * d];
            let mut vals = vec![0.0f32; n * d];
            let (nqk, nqv) = (head.n_quant_keys(), head.n_quant_values());
            if let Some(qk) = head.quant_keys {
                qk.dequantize(&mut keys[..nqk * d]);
            }
            head.fp_keys.to_f32(&mut keys[nqk * d..]);
            if let Some(qv) = head.quant_values {
                qv.dequantize(&mut vals[..nqv * d]);
            }
            head.fp_values.to_f32(&mut vals[nqv * d..]);
            let nc = head.n_extra();
            let mut ek = vec![0.0f32; nc * d];
            let mut ev = vec![0.0f32; nc * d];
            if let Some(c) = head.extra {
                c.keys.to_f32(&mut ek);
                c.values.to_f32(&mut ev);
            }
            for j in 0..g {
                let h = s * g + j;
                let q = &a.q[h * d..(h + 1) * d];
                let mut sc: Vec<f64> = (0..n)
                    .map(|t| dot64(q, &keys[t * d..(t + 1) * d]) * scale)
                    .collect();
                if let Some(c) = head.extra {
                    let log_g = c.gate.map_or(0.0, |gt| gt.log_gate_f64(&sc));
                    for e in 0..nc {
                        sc.push(
                            dot64(q, &ek[e * d..(e + 1) * d]) * scale + c.bias[e] as f64 + log_g,
                        );
                    }
                }
                let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = w.iter().sum();
                let o = &mut a.out[h * d..(h + 1) * d];
                for c in 0..d {
                    let mut acc = 0.0;
                    for t in 0..n {
                        acc += w[t] * vals[t * d + c] as f64;
                    }
                    for e in 0..nc {
                        acc += w[n + e] * ev[e * d + c] as f64;
                    }
                    o[c] = if z > 0.0 { (acc / z) as f32 } else { 0.0 };
                }
                if let Some(p) = probs.as_deref_mut() {
                    p[h].clear();
                    p[h].extend(w[..n].iter().map(|x| (x / z) as f32));
                }
            }
        }
        Ok(())
    }

    fn storage(&self) -> &dyn StorageFactory {
        &CpuStorage
    }
}
