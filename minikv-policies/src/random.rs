//! Random eviction (kvpress's `RandomPress`): the baseline every method should
//! beat. Each KV head's prompt tokens get independent uniform scores in
//! `[0, 1)` from a ChaCha8 stream seeded by `(seed, layer, KV head)`, so a run
//! is reproducible from its config and independent of the thread count.

use minikv_core::{Needs, Result, ScoreInputs, TokenScorer, broadcast_kv, register};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Uniform random scores, seeded from the config.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomScores {
    /// Seed of the score streams (0 unless given).
    #[serde(default)]
    pub seed: u64,
}

/// A ChaCha8 stream for `(seed, layer, head)`: the three words mixed into one
/// 64-bit seed (SplitMix64 finalizer), so neighbouring heads get unrelated streams.
pub fn stream(seed: u64, layer: usize, head: usize) -> ChaCha8Rng {
    let mut z = seed
        ^ (layer as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (head as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ChaCha8Rng::seed_from_u64(z ^ (z >> 31))
}

#[typetag::serde(name = "random")]
impl TokenScorer for RandomScores {
    fn needs(&self) -> Needs {
        Needs::default()
    }
    fn score(&self, inp: &ScoreInputs<'_>, out: &mut [f32]) -> Result<()> {
        let (t, hkv) = (inp.t, inp.spec.n_kv_heads);
        let mut kv_rows = vec![0.0f32; hkv * t];
        for (kv, row) in kv_rows.chunks_exact_mut(t).enumerate() {
            let mut rng = stream(self.seed, inp.layer, kv);
            row.iter_mut().for_each(|x| *x = rng.random::<f32>());
        }
        broadcast_kv(&kv_rows, inp.spec.n_q_heads, hkv, t, out);
        Ok(())
    }
}
register!(
    Scorer,
    "random",
    RandomScores,
    "Random: uniform scores from a stream seeded by (seed, layer, head); the baseline"
);
