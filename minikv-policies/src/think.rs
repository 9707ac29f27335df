//! ThinK (Xu et al. 2025; kvpress's `ThinKPress`, docs/algorithms.md "ThinK"):
//! key channels pruned per head by query-key magnitude.
//!
//! Per storage head, channel `c` scores `mean_w(q_c²) · mean_t(k_c²)`: the
//! mean squared value of the channel over the last `window` prompt queries
//! (averaged over the query heads reading the head) times that over the
//! keys the head stores (after token selection, as a channel press composed
//! after a token press sees them). The `floor(d · ratio)` lowest-scored channels are dropped
//! and the head's key stores hold only the others (kvpress zeroes them and
//! keeps the full width; minikv stores fewer channels). Keys of decoded
//! tokens keep every channel (as kvpress: a full-width store beside the
//! pruned one) unless `prune_appended = true`. Composes with any token
//! selection and with quantization.

use minikv_core::{ChannelInput, ChannelPruner, Error, Needs, Result, check_range, register};
use serde::{Deserialize, Serialize};

/// ThinK channel pruner.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Think {
    /// Share of key channels removed (kvpress's
    /// `key_channel_compression_ratio`; ThinK's experiments use 0.4-0.5).
    pub ratio: f64,
    /// Last prompt queries the channel statistics use (32).
    pub window: usize,
    /// Prune the keys of decoded tokens too (`false`, as kvpress: they are
    /// stored with every channel beside the pruned prompt keys).
    pub prune_appended: bool,
}

impl Default for Think {
    fn default() -> Self {
        Self {
            ratio: 0.5,
            window: 32,
            prune_appended: false,
        }
    }
}

#[typetag::serde(name = "think")]
impl ChannelPruner for Think {
    fn needs(&self) -> Needs {
        Needs {
            query_window: self.window,
            ..Default::default()
        }
    }
    fn validate(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.ratio) {
            return Err(Error::config(
                "cache.channels.ratio",
                format!("must be in [0, 1), got {}", self.ratio),
            ));
        }
        check_range("cache.channels.window", self.window, 1, 65536)
    }
    fn prune_appended(&self) -> bool {
        self.prune_appended
    }
    fn select(&self, inp: &ChannelInput<'_>) -> Result<Vec<u16>> {
        let s = inp.signals;
        let (t, d, w) = (s.t, s.spec.head_dim, s.window);
        let wq = s.window_queries.ok_or_else(|| {
            Error::Unsupported("think: the window queries were not collected".into())
        })?;
        let mut qn = vec![0.0f64; d];
        for h in inp.q_heads.clone() {
            for i in 0..w {
                let q = &wq[(h * w + i) * d..(h * w + i + 1) * d];
                qn.iter_mut()
                    .zip(q)
                    .for_each(|(a, &x)| *a += (x as f64) * (x as f64));
            }
        }
        // The keys the head stores: the statistic of a channel press composed
        // after the token selection.
        let k = s.keys[inp.kv];
        let mut kn = vec![0.0f64; d];
        for &p in inp.kept.iter().filter(|&&p| (p as usize) < t) {
            let row = &k[p as usize * d..(p as usize + 1) * d];
            kn.iter_mut()
                .zip(row)
                .for_each(|(a, &x)| *a += (x as f64) * (x as f64));
        }
        let n = inp.kept.len().clamp(1, t.max(1));
        let norm = (inp.q_heads.len() * w.max(1)) as f64 * n as f64;
        let score: Vec<f64> = qn.iter().zip(&kn).map(|(a, b)| a * b / norm).collect();
        let pruned = ((d as f64 * self.ratio) as usize).min(d - 1);
        let mut order: Vec<usize> = (0..d).collect();
        // Highest first; ties to the lower channel.
        order.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
        let mut kept: Vec<u16> = order[..d - pruned].iter().map(|&c| c as u16).collect();
        kept.sort_unstable();
        Ok(kept)
    }
}
register!(
    Channels,
    "think",
    Think,
    "ThinK: per head, the key channels with the lowest mean(q_c^2)*mean(k_c^2) are not stored (ratio of channels removed)"
);
