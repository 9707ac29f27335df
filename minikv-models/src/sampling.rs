//! Greedy and seeded sampling (temperature, top-p).

use minikv_core::{Error, Result};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

/// Sampling settings. `temperature = 0` is greedy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingConfig {
    /// Softmax temperature; 0 = greedy (argmax, ties to the lower id).
    pub temperature: f32,
    /// Nucleus mass in (0, 1].
    pub top_p: f32,
    /// RNG seed.
    pub seed: u64,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// A seeded sampler.
#[derive(Debug)]
pub struct Sampler {
    cfg: SamplingConfig,
    rng: StdRng,
    idx: Vec<usize>,
}

impl Sampler {
    /// Checks the settings and seeds the RNG.
    pub fn new(cfg: SamplingConfig) -> Result<Self> {
        let t = cfg.temperature;
        if !(t == 0.0 || (1e-3..=1e3).contains(&t)) {
            return Err(Error::config(
                "temperature",
                format!("must be 0 (greedy) or in [0.001, 1000] (1/T overflows below), got {t}"),
            ));
        }
        if !(cfg.top_p > 0.0 && cfg.top_p <= 1.0) {
            return Err(Error::config(
                "top_p",
                format!("must be in (0, 1], got {}", cfg.top_p),
            ));
        }
        Ok(Self {
            cfg,
            rng: StdRng::seed_from_u64(cfg.seed),
            idx: Vec::new(),
        })
    }

    /// Picks the next token.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        if let Some(i) = logits.iter().position(|x| x.is_nan()) {
            return Err(Error::Input(format!("logit {i} is NaN")));
        }
        if self.cfg.temperature == 0.0 {
            return Ok(argmax(logits));
        }
        let inv_t = 1.0 / self.cfg.temperature;
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut p: Vec<f32> = logits.iter().map(|x| ((x - m) * inv_t).exp()).collect();
        let z: f32 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= z);
        self.idx.clear();
        self.idx.extend(0..p.len());
        self.idx
            .sort_unstable_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let mut mass = 0.0;
        let mut cut = self.idx.len();
        for (k, &i) in self.idx.iter().enumerate() {
            mass += p[i];
            if mass >= self.cfg.top_p {
                cut = k + 1;
                break;
            }
        }
        let r: f32 = self.rng.random::<f32>() * mass;
        let mut acc = 0.0;
        for &i in &self.idx[..cut] {
            acc += p[i];
            if acc >= r {
                return Ok(i as u32);
            }
        }
        Ok(self.idx[cut - 1] as u32)
    }
}

/// Index of the largest value (ties to the lower index).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}
