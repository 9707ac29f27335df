//! `minikv sweep`: the grid over config paths x seeds x tasks, one JSONL row per
//! (grid point, seed, task). Resumable: rows already in the output (by key:
//! config hash, seed, task, model sha) are skipped; every finished row is
//! appended and synced at once under the file's lock ([`ResultsLog`]), so a
//! killed run loses nothing finished, concurrent sweeps on one file write each
//! key once, and lines that are not rows are moved aside, never truncated.

use crate::commands::{Loaded, RefMemo, TaskSpec, default_text, load_model, run_task};
use crate::provenance::git_rev;
use crate::results::{ResultsLog, report_rejected};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use minikv_core::{Error, Result, RunConfig};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

#[derive(Args)]
pub struct SweepArgs {
    /// Base config (TOML/JSON).
    pub base: PathBuf,
    /// `PATH=V1,V2,...` over dotted config paths (repeatable). Setting a
    /// `...type` path replaces that component (other fields reset to defaults).
    #[arg(long = "set", value_name = "PATH=VALUES")]
    pub sets: Vec<String>,
    /// Number of seeds (base seed, base seed + 1, ...).
    #[arg(long, default_value_t = 1, value_parser = crate::args::seeds)]
    pub seeds: u64,
    /// Tasks (repeatable): perplexity, fidelity, generation, passkey, needle,
    /// kv-retrieval, attention-error.
    #[arg(long = "task", required = true)]
    pub tasks: Vec<String>,
    /// Output JSONL (appended; finished rows are skipped on rerun).
    #[arg(long)]
    pub out: PathBuf,
    /// Model (default: the fetched SmolLM2).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub opts: crate::TaskOpts,
    /// Rows evaluated at once (each uses the shared thread pool).
    #[arg(long, default_value_t = 1, value_parser = crate::args::jobs)]
    pub jobs: usize,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Progress as JSON lines on stdout (`start`, one `row` per finished row
    /// with done/total/ETA, `end`) instead of the progress bar.
    #[arg(long)]
    pub json: bool,
    /// Keep the full cache's fidelity reference logits in DIR (raw f32, one
    /// file per text window), shared by separate sweeps and reruns.
    #[arg(long, value_name = "DIR")]
    pub reference_cache: Option<PathBuf>,
    /// Label of the base config in the results (default: its file stem, with
    /// every `--set` value of the grid point appended); with a label, only the
    /// `--set` values that vary across the grid are appended.
    #[arg(long)]
    pub label: Option<String>,
    /// Instead of running, write a Slurm array job to DIR: one resolved config
    /// per grid point, `run.sbatch`, and `merge.sh` (see docs/sweeps.md).
    #[arg(long, num_args = 2, value_names = ["slurm", "DIR"])]
    pub emit: Option<Vec<String>>,
}

/// Parses `a.b.c=1,2,x` into (path, values); numbers and booleans are typed.
pub fn parse_set(s: &str) -> Result<(Vec<String>, Vec<Value>)> {
    let (path, vals) = s
        .split_once('=')
        .ok_or_else(|| Error::Input(format!("--set `{s}`: expected PATH=V1,V2")))?;
    let path: Vec<String> = path.split('.').map(str::to_owned).collect();
    if path.iter().any(|p| p.is_empty()) || vals.is_empty() {
        return Err(Error::Input(format!(
            "--set `{s}`: empty path segment or no values"
        )));
    }
    let vals = vals
        .split(',')
        .map(|v| {
            serde_json::from_str::<Value>(v)
                .ok()
                .filter(|x| x.is_number() || x.is_boolean())
                .unwrap_or_else(|| Value::String(v.to_owned()))
        })
        .collect();
    Ok((path, vals))
}

/// Sets `path` in a JSON config; a final `type` segment replaces the component.
pub fn set_path(cfg: &mut Value, path: &[String], v: Value) -> Result<()> {
    let (last, parents) = path.split_last().expect("non-empty path");
    let mut cur = cfg;
    for p in parents {
        if !cur.is_object() {
            return Err(Error::config(path.join("."), "is not inside a table"));
        }
        cur = cur
            .as_object_mut()
            .expect("object")
            .entry(p.clone())
            .or_insert_with(|| json!({}));
    }
    let obj = cur
        .as_object_mut()
        .ok_or_else(|| Error::config(path.join("."), "is not inside a table"))?;
    if last == "type" {
        obj.clear();
    }
    obj.insert(last.clone(), v);
    Ok(())
}

/// The grid: every combination of the `--set` values applied to `base`, each
/// point with the settings that made it (`heavy=0.1`, `policy.type=pyramid`;
/// the leading `cache.` is dropped) for its label.
pub fn grid(base: &Value, sets: &[(Vec<String>, Vec<Value>)]) -> Result<Vec<(Value, Vec<String>)>> {
    let mut points = vec![(base.clone(), Vec::new())];
    for (path, vals) in sets {
        let mut next = Vec::with_capacity(points.len() * vals.len());
        let short = path
            .strip_prefix(&["cache".to_string()])
            .unwrap_or(path)
            .join(".");
        for (p, applied) in &points {
            for v in vals {
                let mut q = p.clone();
                set_path(&mut q, path, v.clone())?;
                let shown = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
                let mut a = applied.clone();
                a.push(format!("{short}={shown}"));
                next.push((q, a));
            }
        }
        points = next;
    }
    Ok(points)
}

/// A point's label: the base config's file stem and the settings applied.
pub fn label(base: &Path, applied: &[String]) -> String {
    let stem = base
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    std::iter::once(stem)
        .chain(applied.iter().cloned())
        .collect::<Vec<_>>()
        .join(" ")
}

fn hash(v: &Value) -> String {
    let h = Sha256::digest(serde_json::to_string(v).expect("json").as_bytes());
    h.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The base config of a sweep (TOML or JSON) as JSON.
fn read_base(path: &Path) -> Result<Value> {
    let text = minikv_core::files::read_text_bounded(path, minikv_core::files::MIB, "a config")?;
    if path.extension().is_some_and(|e| e == "json") {
        return serde_json::from_str(&text)
            .map_err(|e| Error::Parse(format!("{}: {e}", path.display())));
    }
    let t: toml::Value =
        toml::from_str(&text).map_err(|e| Error::Parse(format!("{}: {e}", path.display())))?;
    // JSON has no NaN or infinity: name such a field instead of losing it.
    minikv_core::check_finite_fields("", &t)
        .map_err(|e| Error::Input(format!("{}: {e}", path.display())))?;
    Ok(serde_json::to_value(t).expect("finite toml converts to json"))
}

/// Every grid point resolved and validated (before anything runs), with its
/// label.
fn grid_points(a: &SweepArgs, base: &Value) -> Result<(Vec<RunConfig>, Vec<String>)> {
    let sets = a
        .sets
        .iter()
        .map(|s| parse_set(s))
        .collect::<Result<Vec<_>>>()?;
    // One path, one `--set`: a second would silently override the first
    // while both named the row.
    for (i, (p, _)) in sets.iter().enumerate() {
        if sets[..i].iter().any(|(q, _)| q == p) {
            let path = p.join(".");
            return Err(Error::Input(format!(
                "--set {path} is given twice; give all its values once: --set {path}=V1,V2"
            )));
        }
    }
    let mut points = Vec::new();
    let mut labels = Vec::new();
    for (i, (p, applied)) in grid(base, &sets)?.into_iter().enumerate() {
        let mut cfg: RunConfig =
            serde_json::from_value(p).map_err(|e| Error::Parse(format!("grid point {i}: {e}")))?;
        cfg.resolve()?;
        cfg.validate(None)
            .map_err(|e| Error::Input(format!("grid point {i}: {e}")))?;
        points.push(cfg);
        labels.push(match &a.label {
            // A given label names the config: only the settings that vary
            // across the grid are appended to it.
            Some(l) => std::iter::once(l.clone())
                .chain(
                    applied
                        .into_iter()
                        .zip(&sets)
                        .filter(|(_, (_, vals))| vals.len() > 1)
                        .map(|(a, _)| a),
                )
                .collect::<Vec<_>>()
                .join(" "),
            None => label(&a.base, &applied),
        });
    }
    Ok((points, labels))
}

pub fn sweep(a: &SweepArgs) -> Result<()> {
    let base = read_base(&a.base)?;
    let (points, labels) = grid_points(a, &base)?;
    if let Some(e) = &a.emit {
        if e[0] != "slurm" {
            return Err(Error::Input(format!(
                "--emit {}: only `slurm` is supported",
                e[0]
            )));
        }
        return emit_slurm(a, &points, &labels, Path::new(&e[1]));
    }
    for t in &a.tasks {
        crate::commands::check_task(t)?;
    }
    let l: Loaded = load_model(&crate::ModelArg {
        model: a.model.clone(),
        // Sweeps run the exact default (their row keys do not name activations).
        activations: Default::default(),
    })?;
    let model_sha = l.sha256()?;
    let o = &a.opts;
    let text_path = o.text.clone().unwrap_or_else(default_text);
    // Rows: (point, seed, task) with a key over everything that determines the result.
    let mut rows = Vec::new();
    for (cfg, name) in points.iter().zip(&labels) {
        let cv = serde_json::to_value(cfg).expect("json");
        let chash = hash(&cv);
        for s in 0..a.seeds {
            let seed = cfg.seed + s;
            for task in &a.tasks {
                let spec = TaskSpec {
                    task: task.clone(),
                    context: o.context,
                    tokens: o.tokens,
                    trials: o.trials,
                    depth: None,
                    text: text_path.clone(),
                    query: crate::commands::query_mode(o.query_aware),
                    dataset: o.dataset.clone(),
                    ids: None,
                };
                let key =
                    hash(&json!({"config": chash, "seed": seed, "task": spec, "model": model_sha}));
                rows.push(Row {
                    key,
                    cfg,
                    name,
                    cv: cv.clone(),
                    chash: chash.clone(),
                    seed,
                    spec,
                });
            }
        }
    }
    execute(a, &l, &rows, points.len())
}

/// One row of a sweep: a grid point, a seed and a task, with its key.
struct Row<'a> {
    key: String,
    cfg: &'a RunConfig,
    name: &'a str,
    cv: Value,
    chash: String,
    seed: u64,
    spec: TaskSpec,
}

/// Runs one row and appends it under the log's lock; returns its wall time,
/// and whether another process had written it meanwhile.
fn run_row(
    l: &Loaded,
    r: &Row<'_>,
    memo: &RefMemo,
    log: &Mutex<ResultsLog>,
    (model_sha, rev): (&str, &str),
) -> Result<(f64, bool)> {
    let mut row = run_task(l, r.cfg, &r.spec, r.seed, memo)?;
    let wall = row["wall_s"].as_f64().unwrap_or(0.0);
    row["key"] = json!(r.key);
    row["label"] = json!(r.name);
    row["config"] = r.cv.clone();
    row["config_hash"] = json!(r.chash);
    row["seed"] = json!(r.seed);
    row["model_sha256"] = json!(model_sha);
    row["model"] = json!(l.path.file_name().map(|f| f.to_string_lossy()));
    row["git_rev"] = json!(rev);
    // Written once per key, under the file's lock.
    let written = log.lock().expect("lock").append(&r.key, &row)?;
    Ok((wall, !written))
}

/// Runs the rows not yet in the results file on `--jobs` threads, with a
/// progress bar or JSON events; the first error stops the sweep.
fn execute(a: &SweepArgs, l: &Loaded, rows: &[Row<'_>], grid_points: usize) -> Result<()> {
    let (model_sha, rev) = (l.sha256()?, git_rev());
    let (log, rejected) = ResultsLog::open(&a.out)?;
    report_rejected(&a.out, &rejected);
    let todo: Vec<_> = rows
        .iter()
        .filter(|r| !log.keys().contains(&r.key))
        .collect();
    let log = Mutex::new(log);
    let skipped = Mutex::new(0usize);
    let pb = if a.quiet || a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(todo.len() as u64)
    };
    pb.set_style(
        ProgressStyle::with_template("sweep {bar:30} {pos}/{len} rows, eta {eta} {msg}")
            .expect("template"),
    );
    pb.println(format!(
        "{} rows ({grid_points} grid points x {} seeds x {} tasks), {} already done",
        rows.len(),
        a.seeds,
        a.tasks.len(),
        rows.len() - todo.len()
    ));
    let total = todo.len();
    let t_start = std::time::Instant::now();
    let done_n = Mutex::new(0usize);
    let emit = |v: Value| {
        if a.json {
            let mut o = std::io::stdout().lock();
            let _ = writeln!(o, "{v}").and_then(|_| o.flush());
        }
    };
    emit(
        json!({"event": "start", "rows": rows.len(), "todo": total, "grid_points": grid_points, "seeds": a.seeds, "tasks": a.tasks, "out": a.out}),
    );
    let memo = RefMemo::on_disk(a.reference_cache.clone());
    let next = Mutex::new(todo.into_iter());
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|sc| {
        for _ in 0..a.jobs.max(1) {
            sc.spawn(|| {
                loop {
                    if failed.lock().expect("lock").is_some() {
                        return;
                    }
                    let Some(r) = next.lock().expect("lock").next() else {
                        return;
                    };
                    // Another process may have written this row meanwhile.
                    match log.lock().expect("lock").contains(&r.key) {
                        Ok((true, _)) => {
                            *skipped.lock().expect("lock") += 1;
                            pb.inc(1);
                            continue;
                        }
                        Ok((false, rej)) => report_rejected(&a.out, &rej),
                        Err(e) => {
                            *failed.lock().expect("lock") = Some(e);
                            return;
                        }
                    }
                    match run_row(l, r, &memo, &log, (&model_sha, &rev)) {
                        Ok((wall, by_other)) => {
                            if by_other {
                                *skipped.lock().expect("lock") += 1;
                            }
                            pb.inc(1);
                            let mut d = done_n.lock().expect("lock");
                            *d += 1;
                            let el = t_start.elapsed().as_secs_f64();
                            let eta = el / *d as f64 * (total - *d) as f64;
                            emit(json!({"event": "row", "done": *d, "total": total, "label": r.name, "task": r.spec.task, "seed": r.seed, "key": r.key, "wall_s": wall, "elapsed_s": el, "eta_s": eta}));
                        }
                        Err(e) => {
                            emit(json!({"event": "error", "label": r.name, "task": r.spec.task, "seed": r.seed, "error": e.to_string()}));
                            *failed.lock().expect("lock") = Some(e);
                        }
                    }
                }
            });
        }
    });
    pb.finish_and_clear();
    if let Some(e) = failed.into_inner().expect("lock") {
        return Err(e);
    }
    let skipped = skipped.into_inner().expect("lock");
    emit(
        json!({"event": "end", "rows": rows.len(), "ran": total - skipped, "written_by_others": skipped, "elapsed_s": t_start.elapsed().as_secs_f64(), "out": a.out}),
    );
    if !a.quiet && !a.json {
        eprintln!("sweep: {} rows in {}", rows.len(), a.out.display());
    }
    Ok(())
}

/// Writes `DIR/configs/point_NNNN.toml`, `DIR/run.sbatch` (array job, one task
/// per grid point, each a resumable single-point sweep) and `DIR/merge.sh`.
fn emit_slurm(a: &SweepArgs, points: &[RunConfig], labels: &[String], dir: &Path) -> Result<()> {
    let cfgs = dir.join("configs");
    std::fs::create_dir_all(&cfgs).map_err(|e| Error::io(&cfgs, e))?;
    std::fs::create_dir_all(dir.join("results")).map_err(|e| Error::io(dir, e))?;
    for (i, p) in points.iter().enumerate() {
        let f = cfgs.join(format!("point_{i:04}.toml"));
        std::fs::write(&f, p.to_toml()?).map_err(|e| Error::io(&f, e))?;
        let f = cfgs.join(format!("point_{i:04}.label"));
        std::fs::write(&f, &labels[i]).map_err(|e| Error::io(&f, e))?;
    }
    let o = &a.opts;
    let q = |s: &str| format!("'{}'", s.replace('\'', "'\\''"));
    let mut args = vec![
        format!("--seeds {}", a.seeds),
        format!("--context {}", o.context),
        format!("--tokens {}", o.tokens),
        format!("--trials {}", o.trials),
    ];
    args.extend(a.tasks.iter().map(|t| format!("--task {}", q(t))));
    if let Some(m) = &a.model {
        args.push(format!("--model {}", q(&m.display().to_string())));
    }
    if let Some(t) = &o.text {
        args.push(format!("--text {}", q(&t.display().to_string())));
    }
    let sbatch = format!(
        "#!/usr/bin/env bash\n#SBATCH --job-name=minikv-sweep\n#SBATCH --array=0-{last}\n#SBATCH --cpus-per-task=8\n#SBATCH --time=04:00:00\n#SBATCH --output={raw}/results/slurm_%A_%a.log\n# Generated by `minikv sweep --emit slurm`: {n} grid points. Each array task runs a\n# resumable single-point sweep; resubmitting reruns only unfinished rows.\nset -euo pipefail\nMINIKV=${{MINIKV:-minikv}}\nid=$(printf %04d \"$SLURM_ARRAY_TASK_ID\")\n\"$MINIKV\" sweep {dir}/configs/point_$id.toml --label \"$(cat {dir}/configs/point_$id.label)\" {args} --quiet --out {dir}/results/point_$id.jsonl\n",
        last = points.len().saturating_sub(1),
        n = points.len(),
        dir = q(&dir.display().to_string()),
        // #SBATCH lines are not shell-parsed: the plain path.
        raw = dir.display(),
        args = args.join(" "),
    );
    let merge = format!(
        "#!/usr/bin/env bash\n# Merge the per-point results (keys include the config hash: no duplicates) and report.\nset -euo pipefail\ncat {dir}/results/point_*.jsonl > {dir}/results.jsonl\n\"${{MINIKV:-minikv}}\" report {dir}/results.jsonl --out {dir}/report\n",
        dir = q(&dir.display().to_string())
    );
    for (name, text) in [("run.sbatch", sbatch), ("merge.sh", merge)] {
        let f = dir.join(name);
        std::fs::write(&f, text).map_err(|e| Error::io(&f, e))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| Error::io(&f, e))?;
        }
    }
    eprintln!(
        "sweep: {} grid points -> {}: sbatch {}/run.sbatch, then {}/merge.sh",
        points.len(),
        dir.display(),
        dir.display(),
        dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_is_the_cartesian_product_and_type_replaces_the_component() {
        let base = json!({"cache": {"heavy": 0.5, "policy": {"type": "var_prop", "statistic": "cumul_std"}}});
        let sets = vec![
            parse_set("cache.policy.type=uniform,pyramid").unwrap(),
            parse_set("cache.heavy=0.1,0.25,0.5").unwrap(),
        ];
        let (g, applied): (Vec<_>, Vec<_>) = grid(&base, &sets).unwrap().into_iter().unzip();
        assert_eq!(g.len(), 6);
        assert_eq!(applied[4], vec!["policy.type=pyramid", "heavy=0.25"]);
        assert_eq!(
            label(Path::new("configs/minikv.toml"), &applied[4]),
            "minikv policy.type=pyramid heavy=0.25"
        );
        assert_eq!(g[0]["cache"]["policy"], json!({"type": "uniform"}));
        assert_eq!(g[5]["cache"]["heavy"], json!(0.5));
        assert_eq!(g[4]["cache"]["policy"]["type"], "pyramid");
        let (p, v) = parse_set("cache.quant.keys.bits=2,4").unwrap();
        assert_eq!((p.len(), v), (4, vec![json!(2), json!(4)]));
        assert!(parse_set("cache.heavy").is_err());
        assert!(parse_set("cache..heavy=1").is_err());
    }
}
