//! Intervals, quantiles, Pareto fronts and CSV escaping for reports.

/// The score a task is ranked by, and whether higher is better (from the
/// task's registration; `("", true)` for a task this build does not know).
pub fn primary_metric(task: &str) -> (&'static str, bool) {
    minikv_eval::tasks::find(task).map_or(("", true), |t| {
        let m = t.metric();
        (m.name, m.higher_is_better)
    })
}

/// How the units of a task's metric are counted (continuous for a task this
/// build does not know).
pub fn outcomes(task: &str) -> minikv_eval::tasks::Outcomes {
    minikv_eval::tasks::find(task).map_or(minikv_eval::tasks::Outcomes::Continuous, |t| {
        t.metric().outcomes
    })
}

pub use minikv_eval::stats::{interval_for, mean_ci};

/// A CSV field: quoted (inner quotes doubled) when it holds a comma, a
/// quote or a line break.
pub fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// A CSV field always quoted (inner quotes doubled): method names.
pub fn csv_quoted(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// A CSV number: empty when not finite (no interval, no value).
pub fn csv_num(x: f64) -> String {
    if x.is_finite() {
        x.to_string()
    } else {
        String::new()
    }
}

/// Points on the Pareto frontier (fewer bytes and a better score), by index.
pub fn pareto(points: &[(f64, f64)], higher_better: bool) -> Vec<usize> {
    let better = |a: f64, b: f64| if higher_better { a > b } else { a < b };
    (0..points.len())
        .filter(|&i| {
            !points.iter().enumerate().any(|(j, q)| {
                j != i
                    && q.0 <= points[i].0
                    && !better(points[i].1, q.1)
                    && (q.0 < points[i].0 || better(q.1, points[i].1))
            })
        })
        .collect()
}

/// `[lo, hi]` to 4 decimals, or `none` when there is no interval.
pub(crate) fn interval(lo: f64, hi: f64, none: &str) -> String {
    if lo.is_finite() {
        format!("[{lo:.4}, {hi:.4}]")
    } else {
        none.to_string()
    }
}
