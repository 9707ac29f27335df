//! Reading result rows, pooling them per (task, config, setting), paired
//! comparisons and the markdown tables.

use super::*;
use minikv_core::{Error, Result};
use minikv_eval::tasks::Outcomes;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// A short method name from a resolved config.
pub fn method_name(cfg: &Value) -> String {
    let c = &cfg["cache"];
    let mut parts = Vec::new();
    match c["scorer"]["type"].as_str() {
        Some(s) => {
            parts.push(s.to_string());
            if let Some(p) = c["policy"]["type"]
                .as_str()
                .filter(|p| *p != minikv_core::config::DEFAULT_POLICY)
            {
                parts.push(p.to_string());
            }
            if let Some(sel) = c["selector"]["type"]
                .as_str()
                .filter(|s| *s != minikv_core::config::DEFAULT_SELECTOR)
            {
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
pub(crate) fn model_name(rows: &[Value], sha12: &str) -> String {
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
        let binary = match outcomes(&task) {
            Outcomes::Binary => true,
            Outcomes::Score => xs.len() > 1 && xs.iter().all(|&x| x == 0.0 || x == 1.0),
            Outcomes::Continuous => false,
        };
        let (mean, lo, hi, interval) = if binary {
            let k = xs.iter().filter(|&&x| x > 0.5).count();
            let (lo, hi) = minikv_eval::wilson95(k, xs.len());
            (k as f64 / xs.len() as f64, lo, hi, "Wilson")
        } else {
            let (m, _) = mean_ci(&xs);
            match interval_for(metric, &xs) {
                Some((lo, hi, how)) => (m, lo, hi, how),
                None => (m, f64::NAN, f64::NAN, "n/a"),
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
    // Family averages (`ruler-average`): per family, config and model with
    // several of the family's tasks, the mean of their scores (an average
    // over tasks: no interval).
    type FamilyKey = (&'static str, String, String, String);
    let mut families: BTreeMap<FamilyKey, Vec<&Agg>> = BTreeMap::new();
    for a in &out {
        if let Some(f) = minikv_eval::tasks::find(&a.task).and_then(|t| t.family()) {
            families
                .entry((f, a.config_hash.clone(), a.model.clone(), a.method.clone()))
                .or_default()
                .push(a);
        }
    }
    let averages: Vec<Agg> = families
        .into_iter()
        .filter(|(_, v)| v.len() > 1)
        .map(|((family, ..), v)| Agg {
            task: format!("{family}-average"),
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

pub(crate) fn matches(r: &Value, sel: &str) -> bool {
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
