//! Intervals of a mean, fitted to the metric: what a task's trials and a
//! report's groups are summarized with.
//!
//! ```
//! use minikv_eval::stats::interval_for;
//! // Perplexities average on the log scale: the interval stays above 0.
//! let (lo, hi, how) = interval_for("ppl", &[2.0, 8.0, 30.0]).unwrap();
//! assert!(lo > 0.0 && hi > 8.0 && how == "t (log)");
//! ```

/// Two-sided 97.5% Student-t quantile for `df` degrees of freedom.
pub fn t975(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    if df == 0 {
        f64::NAN
    } else {
        T.get(df - 1).copied().unwrap_or(1.96)
    }
}

/// Mean and 95% half-width (Student t) of `xs`; the half-width is 0 for one value.
/// Computed on the values divided by their largest magnitude, so values near
/// f64's range do not overflow the sums (a half-width that itself exceeds
/// f64's range is infinite: no interval).
pub fn mean_ci(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        if mean.is_finite() || xs.is_empty() {
            return (mean, 0.0);
        }
    } else {
        let sd = (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
        if mean.is_finite() && sd.is_finite() {
            return (mean, t975(xs.len() - 1) * sd / n.sqrt());
        }
    }
    // The sums overflowed: the same on the values over their largest magnitude.
    let scale = xs.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    if !scale.is_finite() {
        return (f64::NAN, f64::NAN);
    }
    let mean_s = xs.iter().map(|x| x / scale).sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean_s * scale, 0.0);
    }
    let sd_s = (xs.iter().map(|x| (x / scale - mean_s).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
    (mean_s * scale, t975(xs.len() - 1) * sd_s / n.sqrt() * scale)
}

/// Whether a metric is a perplexity (a positive quantity whose log, the
/// NLL, is what averages well).
pub fn is_perplexity(metric: &str) -> bool {
    metric == "ppl" || metric.ends_with("_ppl")
}

/// The 95% interval of the mean of `xs`, fitted to the metric, with its
/// method's name; `None` for fewer than two values or no finite interval.
///
/// * perplexities with all values positive: Student t on `ln x`, mapped back
///   (`t (log)`): a ratio-scale spread that never goes below 0;
/// * other non-negative metrics (KL, errors, bytes) whose Student t interval
///   would go below 0: the same log-scale interval when every value is
///   positive, else the t interval with its lower end raised to 0
///   (`t, floored`): the mean of non-negative values is never negative;
/// * otherwise Student t (`t`).
///
/// (A bootstrap was considered: with the two or three windows a run usually
/// has, its percentile interval is little more than `[min, max]`, far too
/// narrow for 95%.)
pub fn interval_for(metric: &str, xs: &[f64]) -> Option<(f64, f64, &'static str)> {
    if xs.len() < 2 || xs.iter().any(|x| !x.is_finite()) {
        return None;
    }
    let log_t = || {
        let logs: Vec<f64> = xs.iter().map(|x| x.ln()).collect();
        let (m, h) = mean_ci(&logs);
        let (lo, hi) = ((m - h).exp(), (m + h).exp());
        (lo.is_finite() && hi.is_finite()).then_some((lo, hi, "t (log)"))
    };
    let positive = xs.iter().all(|&x| x > 0.0);
    if is_perplexity(metric) && positive {
        return log_t();
    }
    let (m, h) = mean_ci(xs);
    let (lo, hi) = (m - h, m + h);
    if !(lo.is_finite() && hi.is_finite()) {
        return None;
    }
    if lo < 0.0 && xs.iter().all(|&x| x >= 0.0) {
        return if positive {
            log_t()
        } else {
            Some((0.0, hi, "t, floored"))
        };
    }
    Some((lo, hi, "t"))
}
