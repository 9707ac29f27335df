//! LU-KV (Tang et al. 2026, "Predicting Future Utility"; kvpress's
//! `LUKVPress`): per (layer, KV head) budgets read from an offline budget
//! curve, around any scorer.
//!
//! A curve file holds, for each target compression ratio `r = 1%, 2%, …,
//! 99%` and each (layer, KV head), the share of the prompt that head prunes
//! (`prune[r][layer][head]`). The curves come from an offline optimization of
//! future utility per head (`minikv calibrate lukv`, docs/algorithms.md
//! "LU-KV"); heads whose scorer predicts future use well get more tokens.
//!
//! At the end of prefill, in layer `l` with prompt length `T`, the selector
//! does what kvpress does:
//! 1. the target ratio is the share of the prompt the layer's budget removes,
//!    `r = 1 - (sinks + heavy + recent) / T`; the curve row is
//!    `ceil(100 r) - 1`, clamped to `0..=98` (`r <= 0` keeps everything;
//!    kvpress rounds to the nearest percent, minikv up, so that a curve
//!    never keeps more than the budget);
//! 2. head `h` ideally keeps `(1 - prune[h]) · T` tokens; the layer keeps
//!    `round(Σ_h ideal)` (at least `H`, at most `H·T`), each head the floor of
//!    its ideal, the remainder one each to the heads with the largest
//!    fractional parts (ties to the lower head), every head at least 1;
//! 3. each head keeps the sinks and the recent window first (kvpress lifts
//!    them above every score), then its best-scored other tokens, ties to the
//!    lower position.
//!
//! The heads then hold ragged lengths (the memory is really freed; kvpress
//! masks the pruned keys instead).

use minikv_core::{Error, Result, SelectionInput, Selector, register};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, OnceLock};

/// Target ratios a curve holds: 1% … 99%.
pub const CURVE_ROWS: usize = 99;

/// An LU-KV budget-curve file (JSON).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LuKvCurve {
    /// Format marker: always `minikv-lukv-curve-v1`.
    pub format: String,
    /// Model file name the curve was calibrated on.
    pub model: String,
    /// Its sha256.
    pub model_sha256: String,
    /// The scorer the curve was made for (its config, as JSON): a curve
    /// belongs to one scorer.
    pub scorer: serde_json::Value,
    /// How the utilities were measured and the curve solved.
    pub calibration: serde_json::Value,
    /// `prune[i][layer][kv_head]`: the share of the prompt the head prunes
    /// at target compression ratio `(i + 1) / 100`, in `[0, 1]`.
    pub prune: Vec<Vec<Vec<f32>>>,
}

impl LuKvCurve {
    /// The format marker.
    pub const FORMAT: &'static str = "minikv-lukv-curve-v1";

    /// Reads and checks a curve file.
    pub fn load(path: &str) -> Result<Self> {
        let bad = |m: String| Error::config("cache.selector.curve", m);
        let text = std::fs::read_to_string(path).map_err(|e| {
            bad(format!(
                "cannot read {path}: {e} (make one with `minikv calibrate lukv`)"
            ))
        })?;
        let c: LuKvCurve = serde_json::from_str(&text).map_err(|e| bad(format!("{path}: {e}")))?;
        if c.format != Self::FORMAT {
            return Err(bad(format!(
                "{path}: format {:?}, expected {:?}",
                c.format,
                Self::FORMAT
            )));
        }
        c.check().map_err(|m| bad(format!("{path}: {m}")))?;
        Ok(c)
    }

    /// Checks the shape (`[99][layers][kv heads]`, rectangular, non-empty)
    /// and that every share is a finite number in `[0, 1]`.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.prune.len() != CURVE_ROWS {
            return Err(format!(
                "prune must hold {CURVE_ROWS} rows (target ratios 1% to 99%), it holds {}",
                self.prune.len()
            ));
        }
        let (l, h) = self.shape();
        if l == 0
            || h == 0
            || self
                .prune
                .iter()
                .any(|r| r.len() != l || r.iter().any(|hs| hs.len() != h))
        {
            return Err("prune must be [99][layers][kv heads], non-empty and rectangular".into());
        }
        for (i, r) in self.prune.iter().enumerate() {
            for (layer, hs) in r.iter().enumerate() {
                if let Some((head, x)) = hs
                    .iter()
                    .enumerate()
                    .find(|&(_, x)| !(0.0..=1.0).contains(x))
                {
                    return Err(format!(
                        "prune[{i}][{layer}][{head}] = {x}: a pruned share is a number in [0, 1]"
                    ));
                }
            }
        }
        Ok(())
    }

    /// `(layers, kv heads)`.
    pub fn shape(&self) -> (usize, usize) {
        let l = self.prune.first().map_or(0, Vec::len);
        let h = self
            .prune
            .first()
            .and_then(|r| r.first())
            .map_or(0, Vec::len);
        (l, h)
    }
}

/// The curve row of target compression ratio `ratio`: `ceil(100 r) - 1`,
/// clamped to `0..=98` (the whole percent at or above `r`, so the curve
/// never keeps more than the budget; kvpress rounds to the nearest, the same
/// row whenever `r` is a whole percent or its fraction is at least a half);
/// `None` when nothing is removed.
pub fn curve_row(ratio: f64) -> Option<usize> {
    if ratio <= 0.0 {
        return None;
    }
    // The tolerance keeps a ratio computed as 1 - k/T on its whole percent.
    let pct = (ratio * 100.0 - 1e-9).ceil() as i64;
    Some((pct - 1).clamp(0, CURVE_ROWS as i64 - 1) as usize)
}

/// Per-head keep counts from one layer's pruned shares and the prompt
/// length (kvpress's arithmetic, in f32 as there: ideal `(1 - p)·T`, the
/// layer's total rounded half to even and clamped to `[H, H·T]`, floors,
/// the remainder to the largest fractional parts, each head in `[1, T]`).
pub fn head_keep_counts(prune: &[f32], t: usize) -> Vec<usize> {
    let nh = prune.len();
    let tf = t as f32;
    let ideal: Vec<f32> = prune
        .iter()
        .map(|p| (1.0 - p).clamp(0.0, 1.0) * tf)
        .collect();
    let total =
        (ideal.iter().sum::<f32>().round_ties_even() as i64).clamp(nh as i64, (nh * t) as i64);
    let mut keep: Vec<i64> = ideal.iter().map(|x| x.floor() as i64).collect();
    let rem = total - keep.iter().sum::<i64>();
    if rem > 0 {
        let mut order: Vec<usize> = (0..nh).collect();
        let frac = |h: usize| ideal[h] - keep[h] as f32;
        order.sort_by(|&a, &b| frac(b).total_cmp(&frac(a)).then(a.cmp(&b)));
        for &h in order.iter().take((rem as usize).min(nh)) {
            keep[h] += 1;
        }
    }
    keep.into_iter()
        .map(|k| (k.max(1) as usize).min(t.max(1)))
        .collect()
}

/// The positions a head keeps: the protected ones (the first `sinks` and
/// the last `recent`, in position order) first, then the others by score
/// (descending, ties to the lower position); the first `n` of that order,
/// returned in increasing position order.
pub fn keep_head(scores: &[f32], sinks: usize, recent: usize, n: usize) -> Vec<u32> {
    keep_order(scores, sinks, recent)
        .into_iter()
        .take(n)
        .collect::<std::collections::BTreeSet<u32>>()
        .into_iter()
        .collect()
}

/// Every position of a head in LU-KV's keep order (see [`keep_head`]): the
/// calibration ranks tokens the same way the selector keeps them.
pub fn keep_order(scores: &[f32], sinks: usize, recent: usize) -> Vec<u32> {
    let t = scores.len();
    let sinks = sinks.min(t);
    let rs = t.saturating_sub(recent).max(sinks);
    let mut order: Vec<u32> = (0..sinks as u32).chain(rs as u32..t as u32).collect();
    let mut rest: Vec<u32> = (sinks as u32..rs as u32).collect();
    rest.sort_by(|&a, &b| {
        scores[b as usize]
            .total_cmp(&scores[a as usize])
            .then(a.cmp(&b))
    });
    order.extend(rest);
    order
}

/// The upper concave hull of `(b, u[b])`, `b = 0..u.len()`: its vertices'
/// budgets, in increasing order (the first and the last point included).
pub fn concave_hull(u: &[f64]) -> Vec<usize> {
    let mut hull: Vec<usize> = Vec::with_capacity(u.len());
    for b in 0..u.len() {
        while hull.len() >= 2 {
            let (i, j) = (hull[hull.len() - 2], hull[hull.len() - 1]);
            // j lies on or below the chord from i to b: not a vertex.
            let cross = (j - i) as f64 * (u[b] - u[i]) - (b - i) as f64 * (u[j] - u[i]);
            if cross >= 0.0 {
                hull.pop();
            } else {
                break;
            }
        }
        hull.push(b);
    }
    hull
}

/// LU-KV's budget split (docs/algorithms.md "LU-KV"): from each (layer,
/// head)'s utility curve `util[layer][head][b]` (`b = 0..=T`), the pruned
/// shares `[99][layer][head]` at target ratios 1% … 99%.
///
/// Each curve is relaxed to its upper concave hull; the hulls' segments,
/// sorted by marginal utility (slope, descending; ties to the lower layer,
/// head and budget), are taken in that order until the model keeps
/// `(1 - r) · L · H · T` tokens, the last one in part. On the hulls greedy
/// is optimal, and the split differs from the best integer split by at most
/// the one segment taken in part.
pub fn solve_budget_curve(util: &[Vec<Vec<f64>>], t: usize) -> Result<Vec<Vec<Vec<f32>>>> {
    let heads: usize = util.iter().map(Vec::len).sum();
    if t == 0 || heads == 0 || util.iter().flatten().any(|u| u.len() != t + 1) {
        return Err(Error::Input(format!(
            "lukv: every utility curve needs {} points (budgets 0..={t})",
            t + 1
        )));
    }
    if let Some(x) = util.iter().flatten().flatten().find(|x| !x.is_finite()) {
        return Err(Error::Input(format!("lukv: a utility is not finite ({x})")));
    }
    // (slope, layer, head, from, length)
    let mut segs: Vec<(f64, usize, usize, usize, usize)> = Vec::new();
    for (l, hs) in util.iter().enumerate() {
        for (h, u) in hs.iter().enumerate() {
            let v = concave_hull(u);
            for w in v.windows(2) {
                let len = w[1] - w[0];
                segs.push(((u[w[1]] - u[w[0]]) / len as f64, l, h, w[0], len));
            }
        }
    }
    segs.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3)))
    });
    let mut out = Vec::with_capacity(CURVE_ROWS);
    for i in 0..CURVE_ROWS {
        let r = (i + 1) as f64 / 100.0;
        let mut left = (1.0 - r) * (heads * t) as f64;
        let mut b: Vec<Vec<f64>> = util.iter().map(|hs| vec![0.0; hs.len()]).collect();
        for &(_, l, h, _, len) in &segs {
            if left <= 0.0 {
                break;
            }
            let take = left.min(len as f64);
            b[l][h] += take;
            left -= take;
        }
        out.push(
            b.iter()
                .map(|hs| {
                    hs.iter()
                        .map(|&x| (1.0 - x / t as f64).clamp(0.0, 1.0) as f32)
                        .collect()
                })
                .collect(),
        );
    }
    Ok(out)
}

/// The LU-KV selector: per-head budgets from a curve file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LuKv {
    /// Budget-curve file (from `minikv calibrate lukv`; a curve belongs to
    /// one model and one scorer). In a config file, a relative path is
    /// relative to the config file's folder (a path that exists only
    /// relative to the working directory is still taken).
    pub curve: String,
    #[serde(skip)]
    loaded: OnceLock<std::result::Result<Arc<LuKvCurve>, String>>,
}

impl Default for LuKv {
    fn default() -> Self {
        Self {
            curve: "configs/patterns/smollm2-135m-instruct-q4_1.lukv.json".into(),
            loaded: OnceLock::new(),
        }
    }
}

impl LuKv {
    /// A selector over an already loaded curve (tests, embedding).
    pub fn from_curve(curve: LuKvCurve) -> Self {
        let s = Self::default();
        let _ = s.loaded.set(Ok(Arc::new(curve)));
        s
    }
    fn file(&self) -> Result<Arc<LuKvCurve>> {
        self.loaded
            .get_or_init(|| {
                LuKvCurve::load(&self.curve)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(Error::Input)
    }
}

#[typetag::serde(name = "lukv")]
impl Selector for LuKv {
    fn validate(&self) -> Result<()> {
        self.file().map(|_| ())
    }
    fn resolve_paths(&mut self, dir: &std::path::Path) {
        let p = std::path::Path::new(&self.curve);
        if p.is_relative() {
            let beside = dir.join(p);
            if beside.is_file() || !p.is_file() {
                self.curve = beside.to_string_lossy().into_owned();
            }
        }
    }
    fn select(&self, input: &SelectionInput<'_>, out: &mut Vec<Vec<u32>>) -> Result<()> {
        let curve = self.file()?;
        let (t, nh) = (input.t, input.n_heads);
        out.clear();
        let kept = input.sinks + input.budget.heavy + input.budget.recent;
        let row = (t > 0)
            .then(|| curve_row(1.0 - kept as f64 / t as f64))
            .flatten();
        let Some(row) = row else {
            out.extend((0..nh).map(|_| (0..t as u32).collect()));
            return Ok(());
        };
        let (depth, heads) = curve.shape();
        if input.layer >= depth || heads != nh {
            return Err(Error::Input(format!(
                "lukv: {} is a curve of {depth} layers x {heads} KV heads; the cache asks for layer {} of {nh} heads (a curve belongs to one model: make one with `minikv calibrate lukv`, and store per KV head: cache.heads = \"per_kv\")",
                self.curve, input.layer
            )));
        }
        let counts = head_keep_counts(&curve.prune[row][input.layer], t);
        for (h, &n) in counts.iter().enumerate() {
            out.push(keep_head(
                &input.scores[h * t..(h + 1) * t],
                input.sinks,
                input.budget.recent,
                n,
            ));
        }
        Ok(())
    }
}
register!(
    Selector,
    "lukv",
    LuKv,
    "LU-KV: per (layer, KV head) budgets from an offline budget curve (`minikv calibrate lukv`); sinks and the recent window first, then the best-scored tokens (ragged heads)"
);

#[cfg(test)]
mod tests {
    use super::*;

    /// kvpress's arithmetic by hand: T = 10, shares (0.25, 0.5, 0.9):
    /// ideal 7.5, 5, 1 -> total round(13.5) = 14 (half to even), floors
    /// 7, 5, 1 = 13, one more to the largest fraction (head 0).
    #[test]
    fn keep_counts_follow_kvpress() {
        assert_eq!(head_keep_counts(&[0.25, 0.5, 0.9], 10), vec![8, 5, 1]);
        // total 12.5 rounds to 12 (even): no remainder.
        assert_eq!(head_keep_counts(&[0.25, 0.5, 1.0], 10), vec![7, 5, 1]);
        // Everything pruned: the layer keeps at least H, each head 1.
        assert_eq!(head_keep_counts(&[1.0, 1.0], 10), vec![1, 1]);
        // Nothing pruned.
        assert_eq!(head_keep_counts(&[0.0, 0.0], 7), vec![7, 7]);
        // Two fractions tie: the lower head first.
        assert_eq!(head_keep_counts(&[0.55, 0.55, 0.0], 10), vec![5, 4, 10]);
    }

    /// Rows round the removed share up to a whole percent.
    #[test]
    fn rows_round_the_ratio_up() {
        assert_eq!(curve_row(0.0), None);
        assert_eq!(curve_row(0.5), Some(49));
        assert_eq!(curve_row(1.0 - 1024.0 / 2048.0), Some(49));
        assert_eq!(curve_row(1.0 - 71.0 / 100.0), Some(28));
        assert_eq!(curve_row(0.004), Some(0));
        assert_eq!(curve_row(0.996), Some(98));
        assert_eq!(curve_row(0.2549), Some(25));
        // The cross-check's budgets (sinks 4 + window 1 + half of 2048).
        assert_eq!(curve_row(1.0 - 1029.0 / 2048.0), Some(49));
    }

    /// By hand: head A's utility is concave (slopes 4, 2, 1, 0.5), head B's
    /// is not (0, 0, 5, 5, 5: its hull jumps to 5 at b = 2, slope 2.5).
    /// Greedy order: A 1 token, B 2 tokens, A, A, A, then B's flat part.
    #[test]
    fn budget_split_by_hand() {
        assert_eq!(concave_hull(&[0.0, 0.0, 5.0, 5.0, 5.0]), vec![0, 2, 4]);
        assert_eq!(
            concave_hull(&[0.0, 4.0, 6.0, 7.0, 7.5]),
            vec![0, 1, 2, 3, 4]
        );
        let util = vec![vec![
            vec![0.0, 4.0, 6.0, 7.0, 7.5],
            vec![0.0, 0.0, 5.0, 5.0, 5.0],
        ]];
        let c = solve_budget_curve(&util, 4).unwrap();
        assert_eq!(c.len(), CURVE_ROWS);
        let at = |r: usize| c[r - 1][0].clone();
        // keep 4 of 8: A 2, B 2.
        assert_eq!(at(50), vec![0.5, 0.5]);
        // keep 2: A 1, B 1 (B's segment taken in part).
        assert_eq!(at(75), vec![0.75, 0.75]);
        // keep 6: A 4, B 2.
        assert_eq!(at(25), vec![0.0, 0.5]);
        // keep 6.96: A 4, B 2.96.
        let r13 = at(13);
        assert_eq!(r13[0], 0.0);
        assert!((r13[1] - 0.26).abs() < 1e-6, "{r13:?}");
        // The kept total is (1 - r) of the model at every row.
        for (i, row) in c.iter().enumerate() {
            let kept: f64 = row[0].iter().map(|&p| 4.0 * (1.0 - p as f64)).sum();
            assert!((kept - 8.0 * (1.0 - (i + 1) as f64 / 100.0)).abs() < 1e-4);
        }
        assert!(solve_budget_curve(&[vec![vec![0.0; 3]]], 4).is_err());
        assert!(solve_budget_curve(&[vec![vec![0.0, f64::NAN]]], 1).is_err());
    }

    /// Protected first (sinks, then the window), then by score, ties lower.
    #[test]
    fn keep_order_protects_then_ranks() {
        let s = [0.0, 5.0, 1.0, 5.0, 9.0, 0.5];
        assert_eq!(keep_order(&s, 1, 1), vec![0, 5, 4, 1, 3, 2]);
        assert_eq!(keep_head(&s, 1, 1, 4), vec![0, 1, 4, 5]);
        assert_eq!(keep_head(&s, 1, 1, 1), vec![0]);
        assert_eq!(keep_head(&s, 0, 0, 2), vec![1, 4]);
    }
}
