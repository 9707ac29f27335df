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

/// A seeded sampler. Its buffers live as long as it does: a draw allocates
/// nothing once the first one has sized them.
#[derive(Debug)]
pub struct Sampler {
    cfg: SamplingConfig,
    rng: StdRng,
    /// Token ids, most probable first as far as a nucleus draw sorted them.
    idx: Vec<usize>,
    /// Probabilities (or their unnormalized weights) of the current draw.
    p: Vec<f32>,
}

/// Tokens a nucleus draw sorts first; it sorts four times as many more
/// each time the mass so far falls short of `top_p`.
const NUCLEUS_FIRST: usize = 64;

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
            p: Vec::new(),
        })
    }

    /// Picks the next token: the argmax at temperature 0, else a draw from
    /// `softmax(logits / T)`, restricted for `top_p < 1` to the nucleus
    /// (the most probable tokens, ties to the lower id, until their mass
    /// reaches `top_p`).
    ///
    /// One uniform number per draw. With `top_p = 1` the draw walks the
    /// tokens in id order (no sort: two passes over the vocabulary); a
    /// nucleus draw walks the nucleus most probable first, and sorts only
    /// as many of the most probable tokens as it needs to find it.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        // One branch-free pass (it vectorizes); the position only on error.
        if logits.iter().fold(false, |a, x| a | x.is_nan()) {
            let i = logits.iter().position(|x| x.is_nan()).unwrap_or(0);
            return Err(Error::Input(format!("logit {i} is NaN")));
        }
        if self.cfg.temperature == 0.0 || logits.len() < 2 {
            return Ok(argmax(logits));
        }
        let best = argmax(logits);
        let m = logits[best as usize];
        if !m.is_finite() {
            // An infinite logit takes all the mass (all `-inf`: none has
            // any, the argmax's rule picks).
            return Ok(best);
        }
        let inv_t = 1.0 / self.cfg.temperature;
        let p = &mut self.p;
        p.clear();
        p.extend(logits.iter().map(|x| ((x - m) * inv_t).exp()));
        let z: f32 = p.iter().sum();
        if self.cfg.top_p >= 1.0 {
            // The first token whose running weight reaches r; the largest
            // weight is 1 (exp 0), so z >= 1 and the walk ends in range.
            let r: f32 = self.rng.random::<f32>() * z;
            let mut acc = 0.0;
            for (i, &w) in p.iter().enumerate() {
                acc += w;
                if acc >= r && w > 0.0 {
                    return Ok(i as u32);
                }
            }
            return Ok(best);
        }
        p.iter_mut().for_each(|x| *x /= z);
        let (cut, mass) = nucleus(p, &mut self.idx, self.cfg.top_p);
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

/// The nucleus of the probabilities `p`: `idx[..cut]` are its tokens, most
/// probable first (ties to the lower id), and `mass` their probabilities
/// summed in that order, the first prefix whose mass reaches `top_p` (all
/// tokens if none does). Only the tokens up to the cut, and a batch beyond
/// it, are sorted: the first `NUCLEUS_FIRST` picked out by a selection, then
/// four times as many of the rest each time the mass falls short. The
/// order is a strict total one, so the prefix is the full sort's.
fn nucleus(p: &[f32], idx: &mut Vec<usize>, top_p: f32) -> (usize, f32) {
    let n = p.len();
    idx.clear();
    idx.extend(0..n);
    let cmp = |a: &usize, b: &usize| p[*b].total_cmp(&p[*a]).then(a.cmp(b));
    let (mut done, mut batch, mut mass) = (0, NUCLEUS_FIRST, 0.0f32);
    loop {
        let end = (done + batch).min(n);
        if end < n {
            idx[done..].select_nth_unstable_by(end - done - 1, cmp);
        }
        idx[done..end].sort_unstable_by(cmp);
        for (k, &i) in idx[done..end].iter().enumerate() {
            mass += p[i];
            if mass >= top_p {
                return (done + k + 1, mass);
            }
        }
        if end == n {
            return (n, mass);
        }
        (done, batch) = (end, 4 * batch);
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

    /// The nucleus draw as it was written first: every token sorted.
    fn full_sort_draw(cfg: SamplingConfig, rng: &mut StdRng, logits: &[f32]) -> u32 {
        let inv_t = 1.0 / cfg.temperature;
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut p: Vec<f32> = logits.iter().map(|x| ((x - m) * inv_t).exp()).collect();
        let z: f32 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= z);
        let mut idx: Vec<usize> = (0..p.len()).collect();
        idx.sort_unstable_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let (mut mass, mut cut) = (0.0, idx.len());
        for (k, &i) in idx.iter().enumerate() {
            mass += p[i];
            if mass >= cfg.top_p {
                cut = k + 1;
                break;
            }
        }
        let r: f32 = rng.random::<f32>() * mass;
        let mut acc = 0.0;
        for &i in &idx[..cut] {
            acc += p[i];
            if acc >= r {
                return i as u32;
            }
        }
        idx[cut - 1] as u32
    }

    /// A nucleus draw (`top_p < 1`) sorts only what it needs and still
    /// picks, draw for draw, the token of a full sort: peaked and flat
    /// logits, ties, nuclei of one token to most of the vocabulary.
    #[test]
    fn nucleus_draws_are_the_full_sorts() {
        let mut source = StdRng::seed_from_u64(11);
        for (n, spread) in [
            (5usize, 1.0f32),
            (300, 0.1),
            (3000, 4.0),
            (50_000, 8.0),
            (50_000, 0.05),
        ] {
            for top_p in [0.05f32, 0.5, 0.9, 0.95, 0.999] {
                for temperature in [0.3f32, 1.0, 2.5] {
                    let cfg = SamplingConfig {
                        temperature,
                        top_p,
                        seed: 5,
                    };
                    let logits: Vec<f32> = (0..n)
                        .map(|i| match i % 7 {
                            0 => 1.5, // ties
                            _ => source.random_range(-1.0f32..1.0) * spread,
                        })
                        .collect();
                    let mut s = Sampler::new(cfg).unwrap();
                    let mut rng = StdRng::seed_from_u64(cfg.seed);
                    for draw in 0..20 {
                        let want = full_sort_draw(cfg, &mut rng, &logits);
                        assert_eq!(
                            s.sample(&logits).unwrap(),
                            want,
                            "n={n} {cfg:?} draw {draw}"
                        );
                    }
                }
            }
        }
    }

    /// With `top_p = 1` the draws follow the softmax: 40,000 draws over
    /// five tokens land within 0.01 of each probability (a seeded run, so
    /// the counts are fixed), and a token of weight 0 is never drawn.
    #[test]
    fn plain_draws_follow_the_softmax() {
        let logits = [0.0f32, 1.0, 2.0, -1.0, f32::NEG_INFINITY, 0.5];
        let t = 0.7f32;
        let w: Vec<f64> = logits
            .iter()
            .map(|&x| ((x - 2.0) as f64 / t as f64).exp())
            .collect();
        let z: f64 = w.iter().sum();
        let cfg = SamplingConfig {
            temperature: t,
            top_p: 1.0,
            seed: 3,
        };
        let mut s = Sampler::new(cfg).unwrap();
        let mut count = [0usize; 6];
        let draws = 40_000;
        for _ in 0..draws {
            count[s.sample(&logits).unwrap() as usize] += 1;
        }
        assert_eq!(count[4], 0);
        for i in 0..6 {
            let f = count[i] as f64 / draws as f64;
            assert!(
                (f - w[i] / z).abs() < 0.01,
                "token {i}: {f} vs {}",
                w[i] / z
            );
        }
        // An infinite logit is the token (the argmax's rule when all are -inf).
        let mut inf = [0.5f32; 7];
        inf[4] = f32::INFINITY;
        assert_eq!(s.sample(&inf).unwrap(), 4);
        assert_eq!(s.sample(&[f32::NEG_INFINITY; 5]).unwrap(), 0);
        // The same seed, the same draws.
        let mut again = Sampler::new(cfg).unwrap();
        let mut s = Sampler::new(cfg).unwrap();
        for _ in 0..100 {
            assert_eq!(s.sample(&logits).unwrap(), again.sample(&logits).unwrap());
        }
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
