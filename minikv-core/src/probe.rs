//! [`AttentionProbe`]: measures, layer by layer, how far a compressed cache's
//! attention output is from the full cache's on the *same* queries.
//!
//! The probe is itself a [`KvCache`]: it drives a reference cache (normally the
//! full fp16 one) and a shadow cache (the one under study) with identical keys,
//! values and queries, returns the reference's output to the model, and records
//! the shadow's error after the end of prefill. Because the model only ever
//! sees the reference output, errors do not propagate from layer to layer: each
//! layer's number is the error that layer's compression alone introduces.
//!
//! ```
//! use minikv_core::{AttentionProbe, CacheBuilder, CacheConfig, KvCache, ModelSpec};
//!
//! let spec = ModelSpec { n_layers: 1, n_q_heads: 2, n_kv_heads: 1, head_dim: 4, max_seq_len: 32, windows: Vec::new() };
//! let full = CacheBuilder::new(spec.clone()).build(&CacheConfig::default())?;
//! let same = CacheBuilder::new(spec.clone()).build(&CacheConfig::default())?;
//! let mut probe = AttentionProbe::new(full, same)?;
//! let kv: Vec<f32> = (0..4 * 4).map(|i| (i as f32).sin()).collect();
//! let q: Vec<f32> = (0..4 * 8).map(|i| (i as f32).cos()).collect();
//! let mut out = vec![0.0; 4 * 8];
//! probe.append(0, &kv, &kv, 4)?;
//! probe.attend(0, &q, 4, &mut out)?;
//! probe.end_prefill()?;
//! probe.append(0, &kv[..4], &kv[..4], 1)?;
//! probe.attend(0, &q[..8], 1, &mut out[..8])?;
//! assert_eq!(probe.relative_errors(), vec![0.0]); // the same cache twice: no error
//! # Ok::<(), minikv_core::Error>(())
//! ```

use crate::{Error, KvCache, LayerBudget, MemoryReport, ModelSpec, Phase, Result};

/// A [`KvCache`] that runs a reference and a shadow cache side by side and
/// accumulates the shadow's per-layer attention-output error during decode.
#[derive(Debug)]
pub struct AttentionProbe {
    reference: Box<dyn KvCache>,
    shadow: Box<dyn KvCache>,
    scratch: Vec<f32>,
    /// Per layer: sum of squared differences, sum of squared reference outputs,
    /// sum of cosine similarities per query head, and query heads compared.
    acc: Vec<[f64; 4]>,
}

impl AttentionProbe {
    /// Pairs a reference cache with the cache under study (same model shape).
    pub fn new(reference: Box<dyn KvCache>, shadow: Box<dyn KvCache>) -> Result<Self> {
        if reference.spec() != shadow.spec() {
            return Err(Error::Input(format!(
                "attention probe: reference and shadow caches disagree on the model shape ({:?} vs {:?})",
                reference.spec(),
                shadow.spec()
            )));
        }
        let n = reference.spec().n_layers;
        Ok(Self {
            reference,
            shadow,
            scratch: Vec::new(),
            acc: vec![[0.0; 4]; n],
        })
    }

    /// The cache under study (its memory, budgets).
    pub fn shadow(&self) -> &dyn KvCache {
        self.shadow.as_ref()
    }

    /// Per layer: `sqrt(sum |o_shadow - o_ref|^2 / sum |o_ref|^2)` over every
    /// decode-time query head seen so far (0 where nothing was compared).
    pub fn relative_errors(&self) -> Vec<f64> {
        self.acc
            .iter()
            .map(|a| {
                if a[1] > 0.0 {
                    (a[0] / a[1]).sqrt()
                } else {
                    0.0
                }
            })
            .collect()
    }

    /// Per layer: mean cosine similarity of shadow and reference outputs per
    /// query head (1 where nothing was compared).
    pub fn cosines(&self) -> Vec<f64> {
        self.acc
            .iter()
            .map(|a| if a[3] > 0.0 { a[2] / a[3] } else { 1.0 })
            .collect()
    }
}

impl KvCache for AttentionProbe {
    fn spec(&self) -> &ModelSpec {
        self.reference.spec()
    }
    fn phase(&self) -> Phase {
        self.reference.phase()
    }
    fn seq_len(&self, layer: usize) -> usize {
        self.reference.seq_len(layer)
    }
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32], n: usize) -> Result<()> {
        self.reference.append(layer, k, v, n)?;
        self.shadow.append(layer, k, v, n)
    }
    fn attend(&mut self, layer: usize, q: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        self.reference.attend(layer, q, n, out)?;
        self.scratch.resize(out.len(), 0.0);
        self.shadow.attend(layer, q, n, &mut self.scratch)?;
        if self.shadow.phase() == Phase::Decode {
            let d = self.spec().head_dim;
            let a = self.acc.get_mut(layer).ok_or_else(|| {
                Error::Input(format!("attention probe: layer {layer} out of range"))
            })?;
            for (r, s) in out.chunks_exact(d).zip(self.scratch.chunks_exact(d)) {
                let (mut dd, mut rr, mut ss, mut rs) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
                for (&x, &y) in r.iter().zip(s) {
                    let (x, y) = (x as f64, y as f64);
                    dd += (x - y) * (x - y);
                    rr += x * x;
                    ss += y * y;
                    rs += x * y;
                }
                a[0] += dd;
                a[1] += rr;
                a[2] += if rr > 0.0 && ss > 0.0 {
                    rs / (rr * ss).sqrt()
                } else {
                    1.0
                };
                a[3] += 1.0;
            }
        }
        Ok(())
    }
    fn end_prefill(&mut self) -> Result<()> {
        self.reference.end_prefill()?;
        self.shadow.end_prefill()
    }
    /// Model facts either cache asks for (reconstruction passes are not
    /// probed: both caches would have to run them).
    fn wants(&self, layer: usize) -> crate::ModelWants {
        let (a, b) = (self.reference.wants(layer), self.shadow.wants(layer));
        crate::ModelWants {
            pre_rope_queries: a.pre_rope_queries || b.pre_rope_queries,
            output_projection: a.output_projection || b.output_projection,
            reconstruction: false,
            plain_pass: false,
        }
    }
    fn observe(&mut self, layer: usize, obs: crate::Observation<'_>) -> Result<()> {
        self.reference.observe(layer, obs)?;
        self.shadow.observe(layer, obs)
    }
    /// The reference cache's memory (see [`AttentionProbe::shadow`] for the other).
    fn memory(&self) -> MemoryReport {
        self.reference.memory()
    }
    fn budgets(&self) -> Vec<LayerBudget> {
        self.shadow.budgets()
    }
    /// The shadow cache's diagnostics.
    fn diagnostics(&self) -> crate::Diagnostics {
        self.shadow.diagnostics()
    }
    fn reset(&mut self) -> Result<()> {
        self.reference.reset()?;
        self.shadow.reset()?;
        self.acc.iter_mut().for_each(|a| *a = [0.0; 4]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CacheBuilder, CacheConfig};

    fn spec() -> ModelSpec {
        ModelSpec {
            n_layers: 2,
            n_q_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            max_seq_len: 64,
            windows: Vec::new(),
        }
    }

    /// A cache whose decode outputs are the reference's scaled by 1.5 on layer 1.
    #[derive(Debug)]
    struct Scaled(Box<dyn KvCache>);
    impl KvCache for Scaled {
        fn spec(&self) -> &ModelSpec {
            self.0.spec()
        }
        fn phase(&self) -> Phase {
            self.0.phase()
        }
        fn seq_len(&self, l: usize) -> usize {
            self.0.seq_len(l)
        }
        fn append(&mut self, l: usize, k: &[f32], v: &[f32], n: usize) -> Result<()> {
            self.0.append(l, k, v, n)
        }
        fn attend(&mut self, l: usize, q: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
            self.0.attend(l, q, n, out)?;
            if l == 1 {
                out.iter_mut().for_each(|x| *x *= 1.5);
            }
            Ok(())
        }
        fn end_prefill(&mut self) -> Result<()> {
            self.0.end_prefill()
        }
        fn memory(&self) -> MemoryReport {
            self.0.memory()
        }
        fn budgets(&self) -> Vec<LayerBudget> {
            self.0.budgets()
        }
        fn reset(&mut self) -> Result<()> {
            self.0.reset()
        }
    }

    #[test]
    fn errors_are_per_layer_and_only_after_prefill() {
        let b = CacheBuilder::new(spec());
        let full = || b.build(&CacheConfig::default()).unwrap();
        let mut p = AttentionProbe::new(full(), Box::new(Scaled(full()))).unwrap();
        let kv: Vec<f32> = (0..3 * 4).map(|i| (i as f32 * 0.7).sin()).collect();
        let q: Vec<f32> = (0..3 * 8).map(|i| (i as f32 * 0.3).cos()).collect();
        let mut out = vec![0.0; 3 * 8];
        for l in 0..2 {
            p.append(l, &kv, &kv, 3).unwrap();
            p.attend(l, &q, 3, &mut out).unwrap();
        }
        // Prefill is not compared (the shadow is scaled there too).
        assert_eq!(p.relative_errors(), vec![0.0, 0.0]);
        p.end_prefill().unwrap();
        for l in 0..2 {
            p.append(l, &kv[..4], &kv[..4], 1).unwrap();
            p.attend(l, &q[..8], 1, &mut out[..8]).unwrap();
        }
        // |1.5 o - o| / |o| = 0.5 (up to f32 rounding); cosine 1.
        let e = p.relative_errors();
        assert_eq!(e[0], 0.0);
        assert!((e[1] - 0.5).abs() < 1e-6, "{e:?}");
        assert!((p.cosines()[1] - 1.0).abs() < 1e-9);
        // The model sees the reference output, not the shadow's.
        let mut direct = full();
        let mut o2 = vec![0.0; 3 * 8];
        for l in 0..2 {
            direct.append(l, &kv, &kv, 3).unwrap();
            direct.attend(l, &q, 3, &mut o2).unwrap();
        }
        direct.end_prefill().unwrap();
        direct.append(1, &kv[..4], &kv[..4], 1).unwrap();
        direct.attend(1, &q[..8], 1, &mut o2[..8]).unwrap();
        assert_eq!(out[..8], o2[..8]);
    }

    #[test]
    fn shapes_must_agree() {
        let other = ModelSpec {
            n_layers: 3,
            ..spec()
        };
        let a = CacheBuilder::new(spec())
            .build(&CacheConfig::default())
            .unwrap();
        let b = CacheBuilder::new(other)
            .build(&CacheConfig::default())
            .unwrap();
        assert!(AttentionProbe::new(a, b).is_err());
    }
}
