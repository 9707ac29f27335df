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
        // One branch-free pass (it vectorizes); the position only on error.
        if logits.iter().fold(false, |a, x| a | x.is_nan()) {
            let i = logits.iter().position(|x| x.is_nan()).unwrap_or(0);
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

/// Index of the largest value (ties to the lower index; `-0.0` and `0.0`
/// tie). NaNs never win: a NaN after the first value is skipped, a NaN
/// first gives 0 (what a scan keeping the first of the largest gives).
///
/// The maximum comes from 16 lanes of compare-and-select (they vectorize),
/// then the first index holding it: two passes over a vocabulary of
/// 262,144 logits instead of one branchy scalar scan.
pub fn argmax(x: &[f32]) -> u32 {
    if x.first().is_none_or(|v| v.is_nan()) {
        return 0;
    }
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = if v > *l { v } else { *l };
        }
    }
    let m = lanes
        .iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    // `x[0]` is a number, so the maximum is one of `x`'s values.
    x.iter().position(|&v| v == m).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scan `argmax` replaces: the first index of the largest value.
    fn scan(x: &[f32]) -> u32 {
        let mut best = 0;
        for (i, v) in x.iter().enumerate() {
            if *v > x[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_first_index_of_the_largest_value() {
        let mut rng = StdRng::seed_from_u64(7);
        let specials = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            -f32::MAX,
        ];
        for len in [0usize, 1, 2, 15, 16, 17, 31, 33, 100, 1000] {
            for trial in 0..200 {
                let x: Vec<f32> = (0..len)
                    .map(|_| match rng.random_range(0..10) {
                        // Few distinct values: ties everywhere.
                        0..=3 => rng.random_range(-3..3) as f32,
                        4 => specials[rng.random_range(0..specials.len())],
                        _ => rng.random_range(-1.0f32..1.0),
                    })
                    .collect();
                assert_eq!(argmax(&x), scan(&x), "len {len} trial {trial}: {x:?}");
            }
        }
        assert_eq!(argmax(&[-0.0, 0.0, -0.0]), 0);
        assert_eq!(argmax(&[f32::NAN, 5.0]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 5.0]), 2);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 40]), 0);
    }

    #[test]
    fn a_nan_logit_is_an_error_that_names_it() {
        let mut s = Sampler::new(SamplingConfig::default()).unwrap();
        let mut x = vec![0.5f32; 40];
        assert_eq!(s.sample(&x).unwrap(), 0);
        x[33] = f32::NAN;
        let e = s.sample(&x).unwrap_err().to_string();
        assert!(e.contains("logit 33 is NaN"), "{e}");
    }
}
