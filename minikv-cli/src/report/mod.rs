//! `minikv report`: tables (Markdown, CSV, kvpress leaderboard columns) and SVG
//! plots from sweep results, with mean and a Student-t 95% interval over seeds.

use clap::Args;
use minikv_core::{Error, Result};
use plotters::prelude::*;
use serde_json::Value;
use std::fmt::Write as _;
use std::path::PathBuf;

mod aggregate;
mod plots;
pub(crate) mod stats;

pub use aggregate::*;
use plots::*;
pub use stats::*;

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
    let (csv, lb) = csv_tables(&aggs, &rows, &a.dataset);
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
    per_layer_plots(&rows, &a.out)?;
    eprintln!(
        "report: {} rows, {} (task, config) groups -> {}",
        rows.len(),
        aggs.len(),
        a.out.display()
    );
    Ok(())
}

/// `results.csv` (one line per aggregate) and `leaderboard.csv` (kvpress's
/// columns).
fn csv_tables(aggs: &[Agg], rows: &[Value], dataset: &str) -> (String, String) {
    let mut csv = String::from(
        "task,method,metric,mean,ci95_lo,ci95_hi,interval,n,seeds,compression_ratio,kv_bytes,config_hash\n",
    );
    let mut lb = String::from("dataset,model,method,compression_ratio,score\n");
    for g in aggs {
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
            csv_field(&format!("{}/{}", dataset, g.task)),
            csv_field(&model_name(rows, &g.model)),
            csv_quoted(&g.method),
            csv_num(1.0 - g.ratio),
            csv_num(g.mean)
        );
    }
    (csv, lb)
}

/// Per-layer figures: budgets (tokens held per layer, all KV heads) from one
/// task's rows, and per-layer attention-output error.
fn per_layer_plots(rows: &[Value], out: &std::path::Path) -> Result<()> {
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
        // A task whose rows also carry per-layer metrics first, else the
        // first by name.
        let pick = tasks
            .iter()
            .copied()
            .find(|t| {
                rows.iter()
                    .any(|r| r["task"] == *t && r.pointer("/metrics/per_layer").is_some())
            })
            .or(tasks.first().copied());
        rows.iter()
            .filter(|r| Some(r["task"].as_str().unwrap_or("")) == pick)
            .collect()
    };
    let budgets = per_layer_series(&with_layers, "/memory/per_layer_tokens");
    if !budgets.is_empty() {
        line_plot(
            &out.join("per_layer_budgets.svg"),
            "tokens held per layer (all KV heads) after compression",
            "tokens",
            &budgets,
        )?;
    }
    let err_rows: Vec<&Value> = rows
        .iter()
        .filter(|r| r.pointer("/metrics/per_layer").is_some())
        .collect();
    let errs = per_layer_series(&err_rows, "/metrics/per_layer");
    if !errs.is_empty() {
        line_plot(
            &out.join("attention_error_per_layer.svg"),
            "per-layer attention-output error vs the full cache",
            "|o - o_full| / |o_full|",
            &errs,
        )?;
    }
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
        assert_eq!(minikv_eval::stats::t975(40), 1.96);
    }

    /// Intervals of non-negative metrics stay non-negative: the main job's
    /// report once gave perplexity [-0.14, 60.9] and KL [-0.046, 0.213] on
    /// three windows with Student t.
    #[test]
    fn intervals_fit_the_metric() {
        let ppl = [12.0, 45.0, 16.0];
        let (lo, hi, how) = stats::interval_for("ppl", &ppl).unwrap();
        assert_eq!(how, "t (log)");
        // exp(mean(ln x) -/+ t(2) sd(ln x) / sqrt(3)), computed by hand.
        let l: Vec<f64> = ppl.iter().map(|x: &f64| x.ln()).collect();
        let m = l.iter().sum::<f64>() / 3.0;
        let sd = (l.iter().map(|x| (x - m).powi(2)).sum::<f64>() / 2.0).sqrt();
        let h = 4.303 * sd / 3f64.sqrt();
        assert!((lo - (m - h).exp()).abs() < 1e-9 && (hi - (m + h).exp()).abs() < 1e-9);
        assert!(lo > 0.0);
        // KL: Student t would go below zero; all positive, so the log scale.
        let kl = [0.01, 0.02, 0.16];
        let (m, h) = mean_ci(&kl);
        assert!(m - h < 0.0);
        let (lo, hi, how) = stats::interval_for("kl", &kl).unwrap();
        assert_eq!(how, "t (log)");
        assert!(lo > 0.0 && lo < 0.01 && hi > 0.16, "[{lo}, {hi}]");
        // A zero among the values: the t interval floored at 0.
        let (lo, hi, how) = stats::interval_for("kl", &[0.0, 0.02, 0.16]).unwrap();
        assert!(how == "t, floored" && lo == 0.0 && hi > 0.16);
        // A t interval that stays above 0 is kept as it is.
        let (lo, _, how) = stats::interval_for("kl", &[0.10, 0.11, 0.12]).unwrap();
        assert!(how == "t" && lo > 0.0);
        // Signed values keep Student t.
        let (lo, _, how) = stats::interval_for("delta", &[-1.0, 0.5, 2.0]).unwrap();
        assert!(how == "t" && lo < -1.0);
        assert_eq!(stats::interval_for("kl", &[0.1]), None);
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
