//! `minikv report`: tables (Markdown, CSV, kvpress leaderboard columns) and SVG
//! plots from sweep results, with mean and a Student-t 95% interval over seeds.

use clap::Args;
use minikv_core::{Error, Result};
use plotters::prelude::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct ReportArgs {
    /// Sweep results (JSONL).
    pub results: PathBuf,
    /// Output folder (report.md, results.csv, leaderboard.csv, *.svg).
    #[arg(long)]
    pub out: PathBuf,
    /// Dataset name for the leaderboard columns.
    #[arg(long, default_value = "paul_graham")]
    pub dataset: String,
    /// Paired comparison `A vs B` (repeatable): per-unit differences A - B of the
    /// primary metric over the text windows / trials both configs saw (same
    /// seeds), with a Student-t 95% interval. A and B are row labels (see
    /// `minikv sweep --label`), method names or config-hash prefixes.
    #[arg(long = "pair", value_name = "A vs B")]
    pub pairs: Vec<String>,
}

/// The score a task is ranked by, and whether higher is better.
pub fn primary_metric(task: &str) -> (&'static str, bool) {
    match task {
        "fidelity" => ("kl", false),
        "perplexity" => ("ppl", false),
        "passkey" | "needle" | "kv-retrieval" => ("accuracy", true),
        "generation" => ("token_f1", true),
        "attention-error" => ("rel_error", false),
        t if t == "dataset" || t.starts_with("ruler-") => ("score", true),
        _ => ("", true),
    }
}

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

/// A short method name from a resolved config.
pub fn method_name(cfg: &Value) -> String {
    let c = &cfg["cache"];
    let mut parts = Vec::new();
    match c["scorer"]["type"].as_str() {
        Some(s) => {
            parts.push(s.to_string());
            if let Some(p) = c["policy"]["type"].as_str().filter(|p| *p != "uniform") {
                parts.push(p.to_string());
            }
            if let Some(sel) = c["selector"]["type"].as_str().filter(|s| *s != "top_k") {
                parts.push(sel.to_string());
            }
            let b = |r: &str, t: &str| {
                c[r].as_f64()
                    .map(|x| format!("{x}"))
                    .or_else(|| c[t].as_u64().map(|x| format!("{x}t")))
            };
            parts.push(format!(
                "h{}/r{}",
                b("heavy", "heavy_tokens").unwrap_or("0".into()),
                b("recent", "recent_tokens").unwrap_or("0".into())
            ));
        }
        None => parts.push(if c["quant"].is_object() {
            "kivi".into()
        } else {
            "full".into()
        }),
    }
    if let Some(k) = c["quant"]["keys"]["bits"].as_u64() {
        let ax = if c["quant"]["keys"]["axis"] == "token" {
            "tok"
        } else {
            "ch"
        };
        parts.push(format!("K{k}{ax}"));
    }
    if let Some(v) = c["quant"]["values"]["bits"].as_u64() {
        parts.push(format!("V{v}"));
    }
    parts.join(" ")
}

/// One aggregated row.
#[derive(Debug, Clone)]
pub struct Agg {
    pub task: String,
    pub method: String,
    /// The model's checksum (first 12 hex digits).
    pub model: String,
    pub config_hash: String,
    pub metric: &'static str,
    pub mean: f64,
    /// 95% interval.
    pub lo: f64,
    pub hi: f64,
    /// Units behind the interval (text windows or trials), and seeds.
    pub n: usize,
    pub seeds: usize,
    /// How the interval was computed.
    pub interval: &'static str,
    pub ratio: f64,
    pub kv_bytes: f64,
}

fn is_retrieval(task: &str) -> bool {
    matches!(task, "passkey" | "needle" | "kv-retrieval")
}

/// A row's label: `label` written by the sweep, else a name derived from the config.
pub fn row_label(r: &Value) -> String {
    r["label"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| method_name(&r["config"]))
}

/// The primary metric of a row per unit: `((seed, index), value)` for every
/// text window (per-trial rows) or retrieval trial (outcomes); rows without
/// per-unit data give one unit, their mean.
pub fn units(r: &Value) -> Vec<((u64, usize), f64)> {
    let task = r["task"].as_str().unwrap_or("");
    let (metric, _) = primary_metric(task);
    let seed = r["seed"].as_u64().unwrap_or(0);
    let m = &r["metrics"];
    if let Some(o) = m["outcomes"].as_array() {
        return o
            .iter()
            .enumerate()
            .map(|(i, b)| ((seed, i), f64::from(u8::from(b.as_bool().unwrap_or(false)))))
            .collect();
    }
    if let Some(t) = m["per_trial"].as_array() {
        let v: Vec<_> = t
            .iter()
            .enumerate()
            .filter_map(|(i, x)| x[metric].as_f64().map(|y| ((seed, i), y)))
            .collect();
        if v.len() == t.len() && !v.is_empty() {
            return v;
        }
    }
    m[metric]
        .as_f64()
        .map(|y| vec![((seed, 0), y)])
        .unwrap_or_default()
}

/// The result rows of a results file: lines that are JSON objects with a
/// `key`, a `task` and `metrics`, the first row of each key only. Returns the
/// rows, the lines skipped as not rows, and the rows dropped as duplicates.
pub fn read_rows(bytes: &[u8]) -> (Vec<Value>, usize, usize) {
    let (mut rows, mut skipped, mut dup) = (Vec::new(), 0, 0);
    let mut seen = std::collections::HashSet::new();
    for line in bytes.split(|&b| b == b'\n') {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let Ok((key, v)) = crate::results::parse_row(line) else {
            skipped += 1;
            continue;
        };
        if seen.insert(key) {
            rows.push(v);
        } else {
            dup += 1;
        }
    }
    (rows, skipped, dup)
}

/// A model's name for the leaderboard: the file name the rows give
/// (`provenance.model`), with its checksum prefix.
fn model_name(rows: &[Value], sha12: &str) -> String {
    let file = rows
        .iter()
        .find(|r| row_model(r) == sha12)
        .and_then(|r| r["model"].as_str().or(r["provenance"]["model"].as_str()))
        .and_then(|p| {
            Path::new(p)
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "model".into());
    format!("{file} ({sha12})")
}

/// The model of a row: its checksum (first 12 hex digits), or `?`.
pub fn row_model(r: &Value) -> String {
    r["model_sha256"]
        .as_str()
        .or(r["provenance"]["model_sha256"].as_str())
        .map(|m| m.chars().take(12).collect())
        .unwrap_or_else(|| "?".into())
}

/// Groups rows by (task, config, model) and aggregates: mean and Student-t 95%
/// interval over every text window (seeds x trials); for retrieval tasks the
/// accuracy over all trials with its Wilson 95% interval.
pub fn aggregate(rows: &[Value]) -> Vec<Agg> {
    // Rows are pooled only when they ran the same task setting (context,
    // query mode, dataset), config, label and model.
    type Key = (String, String, String, String, String);
    let mut groups: BTreeMap<Key, Vec<&Value>> = BTreeMap::new();
    for r in rows {
        let task = r["task"].as_str().unwrap_or("?").to_string();
        let h = r["config_hash"].as_str().unwrap_or("?").to_string();
        let setting = format!("{}/{}/{}", r["context"], r["query"], r["dataset"]);
        groups
            .entry((task, h, row_model(r), row_label(r), setting))
            .or_default()
            .push(r);
    }
    let models: std::collections::BTreeSet<&String> = groups.keys().map(|k| &k.2).collect();
    let several = models.len() > 1;
    // Contexts per (task, label): when a label ran several, name the context.
    let mut contexts: BTreeMap<(String, String), std::collections::BTreeSet<String>> =
        BTreeMap::new();
    for (task, _, _, label, setting) in groups.keys() {
        contexts
            .entry((task.clone(), label.clone()))
            .or_default()
            .insert(setting.clone());
    }
    let mut out = Vec::new();
    for ((task, h, model, label, _setting), rs) in groups {
        let (metric, _) = primary_metric(&task);
        let xs: Vec<f64> = rs.iter().flat_map(|r| units(r)).map(|u| u.1).collect();
        if xs.is_empty() {
            continue;
        }
        // Binary outcomes (retrieval, single-answer questions): Wilson.
        let question = task == "dataset" || task.starts_with("ruler-");
        let binary = is_retrieval(&task)
            || (question && xs.len() > 1 && xs.iter().all(|&x| x == 0.0 || x == 1.0));
        let (mean, lo, hi, interval) = if binary {
            let k = xs.iter().filter(|&&x| x > 0.5).count();
            let (lo, hi) = minikv_eval::wilson95(k, xs.len());
            (k as f64 / xs.len() as f64, lo, hi, "Wilson")
        } else {
            let (m, h) = mean_ci(&xs);
            if xs.len() > 1 && (m - h).is_finite() && (m + h).is_finite() {
                (m, m - h, m + h, "t")
            } else {
                (m, f64::NAN, f64::NAN, "n/a")
            }
        };
        let avg = |f: &str| {
            rs.iter()
                .filter_map(|r| r["memory"][f].as_f64())
                .sum::<f64>()
                / rs.len() as f64
        };
        let mut seeds: Vec<u64> = rs.iter().filter_map(|r| r["seed"].as_u64()).collect();
        seeds.sort_unstable();
        seeds.dedup();
        let mut method = label.clone();
        if contexts[&(task.clone(), label.clone())].len() > 1 {
            method = format!("{method} @{}", rs[0]["context"]);
        }
        if several {
            method = format!("{method} [model {model}]");
        }
        out.push(Agg {
            method,
            model,
            task,
            config_hash: h,
            metric,
            mean,
            lo,
            hi,
            n: xs.len(),
            seeds: seeds.len().max(1),
            interval,
            ratio: avg("compression_ratio"),
            kv_bytes: avg("kv_bytes"),
        });
    }
    // RULER-style average: per config and model with several ruler-* tasks,
    // the mean of their scores (an average over tasks: no interval).
    let mut ruler: BTreeMap<(String, String, String), Vec<&Agg>> = BTreeMap::new();
    for a in out.iter().filter(|a| a.task.starts_with("ruler-")) {
        ruler
            .entry((a.config_hash.clone(), a.model.clone(), a.method.clone()))
            .or_default()
            .push(a);
    }
    let averages: Vec<Agg> = ruler
        .into_values()
        .filter(|v| v.len() > 1)
        .map(|v| Agg {
            task: "ruler-average".into(),
            mean: v.iter().map(|a| a.mean).sum::<f64>() / v.len() as f64,
            lo: f64::NAN,
            hi: f64::NAN,
            n: v.len(),
            interval: "tasks",
            ..v[0].clone()
        })
        .collect();
    out.extend(averages);
    // Per task, largest caches first.
    out.sort_by(|a, b| {
        a.task
            .cmp(&b.task)
            .then(b.ratio.total_cmp(&a.ratio))
            .then(a.method.cmp(&b.method))
    });
    out
}

/// A paired comparison of two configs on one task.
#[derive(Debug, Clone)]
pub struct Paired {
    pub task: String,
    pub a: String,
    pub b: String,
    pub metric: &'static str,
    /// Mean of A - B over the shared units, and its Student-t 95% interval.
    pub diff: f64,
    pub lo: f64,
    pub hi: f64,
    pub n: usize,
}

impl Paired {
    /// "A better", "B better" or "no significant difference" at 95%
    /// ("n/a" with a single unit).
    pub fn verdict(&self) -> &'static str {
        let (_, hb) = primary_metric(&self.task);
        if self.n < 2 {
            "n/a (1 unit)"
        } else if !(self.lo > 0.0 || self.hi < 0.0) {
            "no significant difference"
        } else if (self.lo > 0.0) == hb {
            "A better"
        } else {
            "B better"
        }
    }
}

fn matches(r: &Value, sel: &str) -> bool {
    row_label(r) == sel
        || method_name(&r["config"]) == sel
        || r["config_hash"]
            .as_str()
            .is_some_and(|h| sel.len() >= 4 && h.starts_with(sel))
}

/// Paired differences `A - B` per task over the units (seed, window or trial)
/// both have; errors name a side that matches no row.
pub fn paired(rows: &[Value], a: &str, b: &str) -> Result<Vec<Paired>> {
    for side in [a, b] {
        if !rows.iter().any(|r| matches(r, side)) {
            return Err(Error::Input(format!(
                "--pair: `{side}` matches no row (labels: {})",
                {
                    let mut l: Vec<String> = rows.iter().map(row_label).collect();
                    l.sort();
                    l.dedup();
                    l.join(", ")
                }
            )));
        }
    }
    let mut models: Vec<String> = rows
        .iter()
        .filter(|r| matches(r, a) || matches(r, b))
        .map(row_model)
        .collect();
    models.sort();
    models.dedup();
    if models.len() > 1 {
        return Err(Error::Input(format!(
            "--pair `{a} vs {b}`: the rows come from {} models ({}); pair rows of one model (report a file per model)",
            models.len(),
            models.join(", ")
        )));
    }
    let mut tasks: Vec<&str> = rows.iter().filter_map(|r| r["task"].as_str()).collect();
    tasks.sort_unstable();
    tasks.dedup();
    // Units are keyed by (seed, window): rows of one task at several
    // contexts would collide and one would win silently.
    for &t in &tasks {
        let mut ctx: Vec<String> = rows
            .iter()
            .filter(|r| r["task"] == t && (matches(r, a) || matches(r, b)))
            .map(|r| r["context"].to_string())
            .collect();
        ctx.sort();
        ctx.dedup();
        if ctx.len() > 1 {
            return Err(Error::Input(format!(
                "--pair `{a} vs {b}`: task {t} ran at {} contexts ({}); pair rows of one context (report a file per context)",
                ctx.len(),
                ctx.join(", ")
            )));
        }
    }
    let mut out = Vec::new();
    for t in tasks {
        let side = |sel: &str| -> BTreeMap<(u64, usize), f64> {
            rows.iter()
                .filter(|r| r["task"] == t && matches(r, sel))
                .flat_map(units)
                .collect()
        };
        let (ua, ub) = (side(a), side(b));
        let d: Vec<f64> = ua
            .iter()
            .filter_map(|(k, x)| ub.get(k).map(|y| x - y))
            .collect();
        if d.is_empty() {
            continue;
        }
        let (m, h) = mean_ci(&d);
        let h = if d.len() > 1 { h } else { f64::NAN };
        out.push(Paired {
            task: t.to_string(),
            a: a.to_string(),
            b: b.to_string(),
            metric: primary_metric(t).0,
            diff: m,
            lo: m - h,
            hi: m + h,
            n: d.len(),
        });
    }
    Ok(out)
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
fn interval(lo: f64, hi: f64, none: &str) -> String {
    if lo.is_finite() {
        format!("[{lo:.4}, {hi:.4}]")
    } else {
        none.to_string()
    }
}

/// Markdown report text.
pub fn markdown(aggs: &[Agg], pairs: &[Paired]) -> String {
    let mut s = String::from(
        "# minikv report\n\nMean and 95% interval: Student-t over every text window (seeds x trials), Wilson over all trials for retrieval accuracy. `kv/fp16` is the bytes the cache holds (packed codes, scales and minimums, fp16 rows, positions and scores, extra entries, counted from the stores' contents) over the bytes of a full fp16 cache of the same tokens; the rows also carry `kv_bytes_allocated`, which adds page-growth slack (under one page per store), staging and work buffers.\n",
    );
    let mut task = "";
    for a in aggs {
        if a.task != task {
            task = &a.task;
            let (m, hb) = primary_metric(task);
            let _ = write!(
                s,
                "\n## {task} ({m}, {} is better)\n\n| method | {m} | 95% CI | n | seeds | kv/fp16 | config |\n|---|---|---|---|---|---|---|\n",
                if hb { "higher" } else { "lower" }
            );
        }
        let none = if a.interval == "tasks" {
            format!("mean of {} tasks", a.n)
        } else {
            "n/a (1 unit)".to_string()
        };
        let ci = interval(a.lo, a.hi, &none);
        let _ = writeln!(
            s,
            "| {} | {:.4} | {ci} | {} | {} | {:.3} | `{}` |",
            a.method, a.mean, a.n, a.seeds, a.ratio, a.config_hash
        );
    }
    if !pairs.is_empty() {
        s.push_str("\n## Paired differences (A - B over the same windows / trials, Student-t 95%)\n\n| task | A | B | metric | A - B | 95% CI | n | verdict |\n|---|---|---|---|---|---|---|---|\n");
        for p in pairs {
            let ci = interval(p.lo, p.hi, "n/a");
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {:+.4} | {ci} | {} | {} |",
                p.task,
                p.a,
                p.b,
                p.metric,
                p.diff,
                p.n,
                p.verdict()
            );
        }
    }
    s
}

fn plot(
    path: &Path,
    title: &str,
    pts: &[(f64, f64, String)],
    higher_better: bool,
    y_label: &str,
) -> Result<()> {
    let err = |e: String| Error::Input(format!("plot {}: {e}", path.display()));
    // Only points a chart can place; ranges padded without overflowing.
    let pts: Vec<&(f64, f64, String)> = pts
        .iter()
        .filter(|p| p.0.is_finite() && p.1.is_finite())
        .collect();
    let (x0, x1) = pts
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = pts
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let pad = |a: f64, b: f64| {
        let d = ((b / 2.0 - a / 2.0) * 0.2).max(1e-6);
        (a - d, b + d)
    };
    let ((x0, x1), (y0, y1)) = (pad(x0, x1), pad(y0, y1));
    if pts.is_empty()
        || ![x0, x1, y0, y1]
            .iter()
            .all(|v| v.is_finite() && v.abs() < 1e300)
    {
        eprintln!(
            "report: {} not drawn: its values are beyond what a chart can scale",
            path.display()
        );
        return Ok(());
    }
    let root = SVGBackend::new(path, (720, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("KV bytes / full fp16")
        .y_desc(y_label)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    chart
        .draw_series(
            pts.iter()
                .map(|p| Circle::new((p.0, p.1), 4, BLUE.filled())),
        )
        .map_err(|e| err(e.to_string()))?;
    chart
        .draw_series(
            pts.iter()
                .map(|p| Text::new(p.2.clone(), (p.0, p.1), ("sans-serif", 11))),
        )
        .map_err(|e| err(e.to_string()))?;
    let xy: Vec<(f64, f64)> = pts.iter().map(|p| (p.0, p.1)).collect();
    let mut front: Vec<(f64, f64)> = pareto(&xy, higher_better)
        .into_iter()
        .map(|i| xy[i])
        .collect();
    front.sort_by(|a, b| a.0.total_cmp(&b.0));
    chart
        .draw_series(LineSeries::new(front, RED.stroke_width(2)))
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// One line per series over the layers (per-layer budgets, per-layer errors).
fn line_plot(path: &Path, title: &str, y_label: &str, series: &[(String, Vec<f64>)]) -> Result<()> {
    let err = |e: String| Error::Input(format!("plot {}: {e}", path.display()));
    let n = series.iter().map(|s| s.1.len()).max().unwrap_or(0).max(1);
    let y1 = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
        .max(1e-6)
        * 1.08;
    if !(y1.is_finite() && y1 < 1e300) {
        eprintln!(
            "report: {} not drawn: its values are beyond what a chart can scale",
            path.display()
        );
        return Ok(());
    }
    let root = SVGBackend::new(path, (820, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..(n - 1).max(1) as f64, 0f64..y1)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("layer")
        .y_desc(y_label)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, (name, ys)) in series.iter().enumerate() {
        let c = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                ys.iter().enumerate().map(|(l, &y)| (l as f64, y)),
                c.stroke_width(2),
            ))
            .map_err(|e| err(e.to_string()))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 11))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// Element-wise mean of numeric arrays at `field` (a JSON pointer) over rows,
/// per label, in first-seen order.
fn per_layer_series(rows: &[&Value], field: &str) -> Vec<(String, Vec<f64>)> {
    let mut order: Vec<String> = Vec::new();
    let mut acc: BTreeMap<String, (Vec<f64>, usize)> = BTreeMap::new();
    for r in rows {
        let Some(a) = r.pointer(field).and_then(Value::as_array) else {
            continue;
        };
        let v: Vec<f64> = a.iter().filter_map(Value::as_f64).collect();
        if v.is_empty() || v.len() != a.len() {
            continue;
        }
        let name = row_label(r);
        let e = acc.entry(name.clone()).or_insert_with(|| {
            order.push(name);
            (vec![0.0; v.len()], 0)
        });
        if e.0.len() == v.len() {
            e.0.iter_mut().zip(&v).for_each(|(s, x)| *s += x);
            e.1 += 1;
        }
    }
    order
        .into_iter()
        .map(|n| {
            let (s, k) = &acc[&n];
            (n.clone(), s.iter().map(|x| x / *k as f64).collect())
        })
        .collect()
}

pub fn report(a: &ReportArgs) -> Result<()> {
    let bytes = minikv_core::files::read_bounded(
        &a.results,
        256 * minikv_core::files::MIB,
        "a results file",
    )?;
    let (rows, skipped, duplicates) = read_rows(&bytes);
    if skipped > 0 {
        eprintln!(
            "warning: {}: {skipped} line(s) are not result rows (not UTF-8, not JSON, or without key/task/metrics) and were skipped",
            a.results.display()
        );
    }
    if duplicates > 0 {
        eprintln!(
            "warning: {}: {duplicates} row(s) repeat a key already seen and were not counted again",
            a.results.display()
        );
    }
    if rows.is_empty() {
        return Err(Error::Input(format!(
            "{}: no result rows",
            a.results.display()
        )));
    }
    if a.out.exists() && !a.out.is_dir() {
        return Err(Error::Input(format!(
            "report --out {}: a file of that name exists; --out is a directory for report.md, CSVs and plots",
            a.out.display()
        )));
    }
    std::fs::create_dir_all(&a.out).map_err(|e| Error::io(&a.out, e))?;
    let aggs = aggregate(&rows);
    let write = |name: &str, s: String| {
        let p = a.out.join(name);
        std::fs::write(&p, s).map_err(|e| Error::io(&p, e))
    };
    let mut pairs = Vec::new();
    for p in &a.pairs {
        let (x, y) = p
            .split_once(" vs ")
            .ok_or_else(|| Error::Input(format!("--pair `{p}`: expected `A vs B`")))?;
        pairs.extend(paired(&rows, x.trim(), y.trim())?);
    }
    write("report.md", markdown(&aggs, &pairs))?;
    let mut csv = String::from(
        "task,method,metric,mean,ci95_lo,ci95_hi,interval,n,seeds,compression_ratio,kv_bytes,config_hash\n",
    );
    let mut lb = String::from("dataset,model,method,compression_ratio,score\n");
    for g in &aggs {
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{},{},{},{},{},{},{}",
            csv_field(&g.task),
            csv_quoted(&g.method),
            csv_field(g.metric),
            csv_num(g.mean),
            csv_num(g.lo),
            csv_num(g.hi),
            csv_field(g.interval),
            g.n,
            g.seeds,
            csv_num(g.ratio),
            csv_num(g.kv_bytes),
            csv_field(&g.config_hash)
        );
        // kvpress columns: compression_ratio = fraction of the KV cache removed.
        let _ = writeln!(
            lb,
            "{},{},{},{},{}",
            csv_field(&format!("{}/{}", a.dataset, g.task)),
            csv_field(&model_name(&rows, &g.model)),
            csv_quoted(&g.method),
            csv_num(1.0 - g.ratio),
            csv_num(g.mean)
        );
    }
    write("results.csv", csv)?;
    write("leaderboard.csv", lb)?;
    let mut tasks: Vec<&str> = aggs.iter().map(|g| g.task.as_str()).collect();
    tasks.dedup();
    for t in tasks {
        let (m, hb) = primary_metric(t);
        let pts: Vec<(f64, f64, String)> = aggs
            .iter()
            .filter(|g| g.task == t)
            .map(|g| (g.ratio, g.mean, g.method.clone()))
            .collect();
        plot(
            &a.out.join(format!("{t}_vs_kv_bytes.svg")),
            &format!("{t}: {m} vs KV bytes"),
            &pts,
            hb,
            m,
        )?;
    }
    // Per-layer figures: budgets (tokens held per layer, all KV heads) from one
    // task's rows, and per-layer attention-output error.
    let with_layers: Vec<&Value> = {
        let mut tasks: Vec<&str> = rows
            .iter()
            .filter(|r| r.pointer("/memory/per_layer_tokens").is_some())
            .filter_map(|r| r["task"].as_str())
            .collect();
        tasks.sort_unstable();
        tasks.dedup();
        let pick = ["attention-error", "fidelity", "perplexity", "generation"]
            .into_iter()
            .find(|t| tasks.contains(t))
            .or(tasks.first().copied());
        rows.iter()
            .filter(|r| Some(r["task"].as_str().unwrap_or("")) == pick)
            .collect()
    };
    let budgets = per_layer_series(&with_layers, "/memory/per_layer_tokens");
    if !budgets.is_empty() {
        line_plot(
            &a.out.join("per_layer_budgets.svg"),
            "tokens held per layer (all KV heads) after compression",
            "tokens",
            &budgets,
        )?;
    }
    let err_rows: Vec<&Value> = rows
        .iter()
        .filter(|r| r["task"] == "attention-error")
        .collect();
    let errs = per_layer_series(&err_rows, "/metrics/per_layer");
    if !errs.is_empty() {
        line_plot(
            &a.out.join("attention_error_per_layer.svg"),
            "per-layer attention-output error vs the full cache",
            "|o - o_full| / |o_full|",
            &errs,
        )?;
    }
    eprintln!(
        "report: {} rows, {} (task, config) groups -> {}",
        rows.len(),
        aggs.len(),
        a.out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_on_known_numbers() {
        // [1, 2, 3]: mean 2, sd 1, t(2) = 4.303 -> half-width 4.303 / sqrt(3) = 2.4843.
        let (m, h) = mean_ci(&[1.0, 2.0, 3.0]);
        assert_eq!(m, 2.0);
        assert!((h - 2.484_33).abs() < 1e-4, "{h}");
        assert_eq!(mean_ci(&[5.0]), (5.0, 0.0));
        assert_eq!(t975(40), 1.96);
    }

    /// One config run at several contexts gives one row per context.
    #[test]
    fn contexts_are_not_pooled() {
        let mut rows = Vec::new();
        for (ctx, kl) in [(512, 0.1), (512, 0.2), (2048, 0.9)] {
            let mut r = row("snapkv", "fidelity", 0, serde_json::json!({"kl": kl}));
            r["context"] = ctx.into();
            rows.push(r);
        }
        let aggs = aggregate(&rows);
        assert_eq!(aggs.len(), 2);
        let m: Vec<(&str, usize)> = aggs.iter().map(|a| (a.method.as_str(), a.n)).collect();
        assert!(
            m.contains(&("snapkv @512", 2)) && m.contains(&("snapkv @2048", 1)),
            "{m:?}"
        );
    }

    /// Question tasks: binary per-trial scores get a Wilson interval,
    /// fractional ones Student-t; several ruler tasks give a ruler-average.
    #[test]
    fn question_tasks_intervals_and_ruler_average() {
        let trials = |xs: &[f64]| {
            serde_json::json!({"score": xs.iter().sum::<f64>() / xs.len() as f64,
                "per_trial": xs.iter().map(|x| serde_json::json!({"score": x})).collect::<Vec<_>>()})
        };
        let rows = vec![
            row(
                "m",
                "ruler-niah-single-number",
                0,
                trials(&[1.0, 1.0, 0.0, 1.0]),
            ),
            row(
                "m",
                "ruler-niah-multivalue",
                0,
                trials(&[0.5, 0.75, 1.0, 0.25]),
            ),
        ];
        let aggs = aggregate(&rows);
        let get = |t: &str| aggs.iter().find(|a| a.task == t).unwrap();
        let single = get("ruler-niah-single-number");
        assert_eq!((single.interval, single.mean), ("Wilson", 0.75));
        let (lo, hi) = minikv_eval::wilson95(3, 4);
        assert_eq!((single.lo, single.hi), (lo, hi));
        assert_eq!(get("ruler-niah-multivalue").interval, "t");
        let avg = get("ruler-average");
        assert_eq!((avg.mean, avg.n), ((0.75 + 0.625) / 2.0, 2));
        assert_eq!(primary_metric("ruler-vt"), ("score", true));
    }

    /// Junk lines are skipped with a count, a repeated key counts once, and
    /// rows of different models are never pooled.
    #[test]
    fn rows_are_read_deduplicated_and_grouped_by_model() {
        let mk = |key: &str, model: &str, kl: f64| {
            let mut r = row("snapkv", "fidelity", 0, serde_json::json!({"kl": kl}));
            r["key"] = key.into();
            r["model_sha256"] = model.into();
            format!("{r}\n")
        };
        let mut text = String::new();
        text += &mk("k1", "aaaaaaaaaaaaaaaa", 0.1);
        text += "not json\n{\"hello\": 1}\n";
        text += &mk("k1", "aaaaaaaaaaaaaaaa", 0.1); // the same row twice
        text += &mk("k2", "bbbbbbbbbbbbbbbb", 0.9);
        let mut bytes = text.into_bytes();
        bytes.extend_from_slice(&[0xff, 0xfe, b'\n']);
        let (rows, skipped, dups) = read_rows(&bytes);
        assert_eq!((rows.len(), skipped, dups), (2, 3, 1));
        let aggs = aggregate(&rows);
        assert_eq!(aggs.len(), 2, "one group per model");
        let mut means: Vec<f64> = aggs.iter().map(|a| a.mean).collect();
        means.sort_by(f64::total_cmp);
        assert_eq!(means, vec![0.1, 0.9]);
        assert!(
            aggs.iter()
                .all(|a| a.n == 1 && a.method.contains("[model "))
        );
        let e = paired(&rows, "snapkv", "snapkv").unwrap_err().to_string();
        assert!(e.contains("2 models"), "{e}");
    }

    fn row(label: &str, task: &str, seed: u64, metrics: Value) -> Value {
        serde_json::json!({"label": label, "task": task, "seed": seed, "config_hash": label,
            "config": {}, "metrics": metrics, "memory": {"compression_ratio": 0.5, "kv_bytes": 10}})
    }

    #[test]
    fn paired_differences_on_known_numbers() {
        // Per-window KL: A = B + [1, 2, 3] on seeds 0 (two windows) and 1 (one).
        let kl = |v: &[f64]| serde_json::json!({"kl": 0.0, "per_trial": v.iter().map(|x| serde_json::json!({"kl": x})).collect::<Vec<_>>()});
        let rows = vec![
            row("A", "fidelity", 0, kl(&[1.5, 2.5])),
            row("A", "fidelity", 1, kl(&[3.5])),
            row("B", "fidelity", 0, kl(&[0.5, 0.5])),
            row("B", "fidelity", 1, kl(&[0.5])),
            // A unit B lacks (seed 2) is not paired.
            row("A", "fidelity", 2, kl(&[9.0])),
        ];
        let p = paired(&rows, "A", "B").unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!((p[0].n, p[0].diff), (3, 2.0));
        // mean 2, sd 1, t(2) = 4.303: half-width 2.4843 -> interval spans 0.
        assert!((p[0].hi - 4.48433).abs() < 1e-4, "{:?}", p[0]);
        assert_eq!(p[0].verdict(), "no significant difference");
        let tight = vec![
            row("A", "fidelity", 0, kl(&[1.0, 1.1, 0.9, 1.0])),
            row("B", "fidelity", 0, kl(&[0.0, 0.0, 0.0, 0.0])),
        ];
        // KL: lower is better, so A (higher) loses.
        assert_eq!(paired(&tight, "A", "B").unwrap()[0].verdict(), "B better");
        assert_eq!(paired(&tight, "B", "A").unwrap()[0].verdict(), "A better");
        assert!(paired(&tight, "C", "A").is_err());
    }

    #[test]
    fn retrieval_accuracy_pools_trials_with_wilson() {
        let pk = |o: &[bool]| serde_json::json!({"accuracy": 0.0, "outcomes": o});
        let rows = vec![
            row("A", "passkey", 0, pk(&[true, false, true, true, true])),
            row("A", "passkey", 1, pk(&[true, true, false, true, true])),
        ];
        let a = aggregate(&rows);
        // 8 of 10: Wilson 95% = [0.4902, 0.9433].
        assert_eq!((a[0].n, a[0].seeds, a[0].mean), (10, 2, 0.8));
        assert!(
            (a[0].lo - 0.4902).abs() < 1e-4 && (a[0].hi - 0.9433).abs() < 1e-4,
            "{:?}",
            a[0]
        );
        assert_eq!(a[0].interval, "Wilson");
    }

    #[test]
    fn pareto_frontier() {
        // (bytes, kl), lower kl better: (0.5, 0.2) is dominated by (0.4, 0.1).
        let p = [(1.0, 0.0), (0.5, 0.2), (0.4, 0.1), (0.2, 0.5)];
        assert_eq!(pareto(&p, false), vec![0, 2, 3]);
        assert_eq!(pareto(&[(1.0, 0.9), (0.5, 0.95)], true), vec![1]);
    }
}
