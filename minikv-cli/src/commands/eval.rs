//! `eval` and the tasks it (and `sweep`) runs.

use super::*;

use crate::EvalArgs;
use crate::provenance::provenance;
use minikv_core::{Error, Result, RunConfig};
use serde_json::json;
use std::path::{Path, PathBuf};

/// Every evaluation task, as `--task` spells it.
pub const TASKS: [&str; 17] = [
    "perplexity",
    "fidelity",
    "generation",
    "passkey",
    "needle",
    "kv-retrieval",
    "attention-error",
    "dataset",
    "ruler-niah-single-number",
    "ruler-niah-single-word",
    "ruler-niah-single-uuid",
    "ruler-niah-multikey",
    "ruler-niah-multivalue",
    "ruler-niah-multiquery",
    "ruler-vt",
    "ruler-cwe",
    "ruler-fwe",
];

/// Checks a task name against [`TASKS`].
pub fn check_task(t: &str) -> Result<()> {
    if TASKS.contains(&t) {
        Ok(())
    } else {
        Err(Error::Input(format!(
            "unknown task `{t}` ({})",
            TASKS.join(", ")
        )))
    }
}

type RefLogits = std::sync::Arc<Vec<Vec<f32>>>;

/// Full-cache reference logits of `fidelity` windows, shared by every row of
/// one process: a sweep computes the full cache once per (window, context,
/// backend, model) instead of once per config. Bounded in memory (oldest
/// entries dropped); optionally also kept on disk (`--reference-cache DIR`),
/// so that separate sweeps and reruns share them too.
#[derive(Default)]
pub struct RefMemo {
    dir: Option<PathBuf>,
    inner: std::sync::Mutex<(
        std::collections::HashMap<String, RefLogits>,
        std::collections::VecDeque<String>,
    )>,
}

impl RefMemo {
    /// Entries kept in memory (each is `tokens x vocab` f32).
    const CAP: usize = 32;

    /// A memo that also reads and writes `dir`.
    pub fn on_disk(dir: Option<PathBuf>) -> Self {
        Self {
            dir,
            ..Self::default()
        }
    }

    /// File header: magic, sha256 of the key, rows, columns, sha256 of the payload.
    const MAGIC: &'static [u8; 8] = b"MKVREF1\0";
    const HEADER: usize = 8 + 32 + 4 + 4 + 32;

    /// Reads a reference file written for `key`; `Err` says why it cannot
    /// be used (wrong key, truncated, corrupted, non-finite values).
    fn load(path: &Path, key: &str) -> std::result::Result<Vec<Vec<f32>>, String> {
        use sha2::{Digest, Sha256};
        let b = std::fs::read(path).map_err(|e| e.to_string())?;
        if b.len() < Self::HEADER || &b[..8] != Self::MAGIC {
            return Err("not a minikv reference file".into());
        }
        if b[8..40] != Sha256::digest(key.as_bytes())[..] {
            return Err("written for another key".into());
        }
        let word = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes")) as usize;
        let (n, v) = (word(40), word(44));
        let want = n
            .checked_mul(v)
            .and_then(|x| x.checked_mul(4))
            .ok_or("impossible size")?;
        let payload = &b[Self::HEADER..];
        if payload.len() != want || v == 0 {
            return Err(format!(
                "{} payload bytes, header says {want}",
                payload.len()
            ));
        }
        if b[48..80] != Sha256::digest(payload)[..] {
            return Err("checksum mismatch (corrupted)".into());
        }
        let rows: Vec<Vec<f32>> = payload
            .chunks_exact(4 * v)
            .map(|r| {
                r.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect()
            })
            .collect();
        if rows.iter().flatten().any(|x| !x.is_finite()) {
            return Err("non-finite logits".into());
        }
        Ok(rows)
    }

    fn store(path: &Path, key: &str, rows: &[Vec<f32>]) -> Result<()> {
        use sha2::{Digest, Sha256};
        let v = rows.first().map_or(0, Vec::len);
        let mut payload = Vec::with_capacity(rows.len() * v * 4);
        for x in rows.iter().flatten() {
            payload.extend_from_slice(&x.to_le_bytes());
        }
        let mut b = Vec::with_capacity(Self::HEADER + payload.len());
        b.extend_from_slice(Self::MAGIC);
        b.extend_from_slice(&Sha256::digest(key.as_bytes()));
        b.extend_from_slice(&(rows.len() as u32).to_le_bytes());
        b.extend_from_slice(&(v as u32).to_le_bytes());
        b.extend_from_slice(&Sha256::digest(&payload));
        b.extend_from_slice(&payload);
        // Write then rename: a killed run never leaves a torn file behind.
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, &b).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
    }

    fn get_or(&self, key: &str, f: impl FnOnce() -> Result<Vec<Vec<f32>>>) -> Result<RefLogits> {
        use sha2::{Digest, Sha256};
        let h: String = Sha256::digest(key.as_bytes())
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect();
        if let Some(v) = self.inner.lock().expect("lock").0.get(&h) {
            return Ok(v.clone());
        }
        let file = self.dir.as_ref().map(|d| d.join(format!("{h}.ref")));
        let loaded = match &file {
            Some(p) if p.exists() => match Self::load(p, key) {
                Ok(v) => Some(v),
                Err(why) => {
                    eprintln!(
                        "warning: reference file {} is not usable ({why}); recomputing it",
                        p.display()
                    );
                    None
                }
            },
            _ => None,
        };
        let v = match loaded {
            Some(v) => v,
            None => {
                let v = f()?;
                if let (Some(d), Some(p)) = (&self.dir, &file) {
                    std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))?;
                    Self::store(p, key, &v)?;
                }
                v
            }
        };
        let v = std::sync::Arc::new(v);
        let mut g = self.inner.lock().expect("lock");
        if !g.0.contains_key(&h) {
            g.1.push_back(h.clone());
            if g.1.len() > Self::CAP {
                let old = g.1.pop_front().expect("non-empty");
                g.0.remove(&old);
            }
        }
        g.0.insert(h, v.clone());
        Ok(v)
    }
}

/// What one evaluation runs (shared by `eval` and `sweep`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct TaskSpec {
    /// perplexity | fidelity | generation | passkey.
    pub task: String,
    /// Prompt/context tokens.
    pub context: usize,
    /// Tokens after the context.
    pub tokens: usize,
    /// Trials (passkey) or text windows.
    pub trials: usize,
    /// Passkey depth (None: uniform).
    pub depth: Option<f64>,
    /// Text file or directory.
    pub text: PathBuf,
    /// Question tasks: whether the question is compressed with the context.
    #[serde(skip_serializing_if = "is_agnostic")]
    pub query: minikv_eval::qa::QueryMode,
    /// `dataset`: the JSONL file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dataset: Option<PathBuf>,
    /// Token ids to cut windows from instead of the text (`--ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ids: Option<PathBuf>,
}

fn is_agnostic(q: &minikv_eval::qa::QueryMode) -> bool {
    *q == minikv_eval::qa::QueryMode::Agnostic
}

/// The query mode of `--query-aware`.
pub fn query_mode(aware: bool) -> minikv_eval::qa::QueryMode {
    if aware {
        minikv_eval::qa::QueryMode::Aware
    } else {
        minikv_eval::qa::QueryMode::Agnostic
    }
}

/// The rows a question task asks: a dataset file's, or generated RULER-style
/// with `text` (the task's `--text`) as the haystack.
pub fn question_rows(
    t: &TaskSpec,
    tok: &minikv_models::Tokenizer,
    seed: u64,
    text: &str,
) -> Result<Vec<minikv_eval::qa::QaRow>> {
    use minikv_eval::{qa, ruler};
    if t.task == "dataset" {
        let p = t
            .dataset
            .as_ref()
            .ok_or_else(|| Error::Input("task `dataset` needs --dataset FILE.jsonl".into()))?;
        return qa::read_dataset(p);
    }
    let task = ruler::RulerTask::from_task(&t.task)
        .ok_or_else(|| Error::Input(format!("`{}` is not a question task", t.task)))?;
    ruler::generate(
        task,
        tok,
        text,
        ruler::RulerSpec {
            context: t.context,
            depth: t.depth,
            trials: t.trials,
            seed,
        },
    )
}

/// Reads a JSON array of token ids, each checked against the vocabulary.
fn read_ids(p: &Path, vocab: usize) -> Result<Vec<u32>> {
    let s = minikv_core::files::read_text_bounded(p, 256 * minikv_core::files::MIB, "token ids")?;
    let ids: Vec<u32> = serde_json::from_str(&s).map_err(|e| {
        Error::Input(format!(
            "{}: expected a JSON array of token ids: {e}",
            p.display()
        ))
    })?;
    if let Some((i, t)) = ids.iter().enumerate().find(|(_, t)| **t as usize >= vocab) {
        return Err(Error::Input(format!(
            "{}: token id {t} at index {i} is outside the vocabulary of {vocab}",
            p.display()
        )));
    }
    Ok(ids)
}

/// Runs one task for one config and seed on a loaded model; returns the result
/// row (task, metrics, memory, wall time). Texts are tokenized once per call.
pub fn run_task(
    l: &Loaded,
    cfg: &RunConfig,
    t: &TaskSpec,
    seed: u64,
    memo: &RefMemo,
) -> Result<serde_json::Value> {
    check_task(&t.task)?;
    use minikv_eval as eval;
    use rand::{Rng, SeedableRng};
    let m = l.model.as_ref();
    let full_cfg = RunConfig {
        backend: cfg.backend.clone(),
        ..RunConfig::default()
    };
    let questions = t.task == "dataset" || t.task.starts_with("ruler-");
    // The text is read once, and tokenized only for the tasks that cut windows
    // or haystacks from its tokens (a dataset brings its own contexts).
    let text = if t.task == "dataset" || t.ids.is_some() {
        String::new()
    } else {
        read_text(&t.text)?
    };
    let all = match &t.ids {
        Some(_) if questions || minikv_eval::Retrieval::from_task(&t.task).is_some() => {
            return Err(Error::Input(format!(
                "--ids gives windows of tokens for perplexity, fidelity, generation and \
                 attention-error, not `{}`",
                t.task
            )));
        }
        Some(p) => read_ids(p, m.vocab_size())?,
        None if questions => Vec::new(),
        None => l.tok.encode(&text)?,
    };
    let max = m.spec().max_seq_len;
    // Retrieval and question prompts are `context` tokens in all; the other
    // tasks add `tokens` after the context.
    let prompt_only = minikv_eval::Retrieval::from_task(&t.task).is_some() || questions;
    let need = t.context + if prompt_only { 0 } else { t.tokens };
    if need > max {
        return Err(Error::ContextOverflow { len: need, max });
    }
    if t.trials == 0 {
        return Err(Error::Input("--trials must be positive".into()));
    }
    // Windows of the text at seeded offsets (one per trial).
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut window = || -> Result<Vec<u32>> {
        if all.len() < need {
            return Err(Error::Input(format!(
                "{} has {} tokens, fewer than the {need} needed",
                t.text.display(),
                all.len()
            )));
        }
        let start = rng.random_range(0..=all.len() - need);
        Ok(all[start..start + need].to_vec())
    };
    let t0 = std::time::Instant::now();
    let mut mem = None;
    let metrics = match t.task.as_str() {
        _ if questions => {
            let rows = question_rows(t, &l.tok, seed, &text)?;
            let r = minikv_eval::qa::evaluate(m, &l.tok, &rows, t.query, || build_cache(m, cfg))?;
            serde_json::to_value(&r).expect("json")
        }
        "passkey" | "needle" | "kv-retrieval" => {
            let kind = eval::Retrieval::from_task(&t.task).expect("retrieval task");
            let spec = eval::PasskeySpec {
                context: t.context,
                depth: t.depth,
                trials: t.trials,
                seed,
            };
            let r = eval::retrieval(kind, m, &l.tok, &all, spec, || build_cache(m, cfg))?;
            serde_json::to_value(&r).expect("json")
        }
        task @ ("perplexity" | "fidelity" | "generation" | "attention-error") => {
            let mut rows = Vec::new();
            for _ in 0..t.trials {
                let ids = window()?;
                if task == "attention-error" {
                    let (e, shadow_mem, diag) = eval::attention_error(
                        m,
                        build_cache(m, &full_cfg)?,
                        build_cache(m, cfg)?,
                        &ids,
                        t.context,
                    )?;
                    mem = Some(shadow_mem);
                    let mut v = serde_json::to_value(e).expect("json");
                    add_diagnostics(&mut v, &diag);
                    rows.push(v);
                    continue;
                }
                let mut comp = build_cache(m, cfg)?;
                let v = match task {
                    "perplexity" => serde_json::to_value(minikv_models::perplexity(
                        m,
                        comp.as_mut(),
                        &ids,
                        t.context,
                        |_| {},
                    )?),
                    "fidelity" => {
                        let key = format!(
                            "{}/{:?}/{}/{}",
                            l.sha256()?,
                            full_cfg.backend,
                            t.context,
                            ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
                        );
                        let reference = memo.get_or(&key, || {
                            eval::reference_logits(
                                m,
                                build_cache(m, &full_cfg)?.as_mut(),
                                &ids,
                                t.context,
                            )
                        })?;
                        serde_json::to_value(eval::fidelity_against(
                            m,
                            comp.as_mut(),
                            &ids,
                            t.context,
                            &reference,
                        )?)
                    }
                    _ => serde_json::to_value(eval::generation_agreement(
                        m,
                        &l.tok,
                        build_cache(m, &full_cfg)?.as_mut(),
                        comp.as_mut(),
                        &ids[..t.context],
                        t.tokens,
                    )?),
                }
                .expect("json");
                let mut v = v;
                add_diagnostics(&mut v, &comp.diagnostics());
                mem = Some(comp.memory());
                rows.push(v);
            }
            mean_rows(&rows)
        }
        other => unreachable!("checked task `{other}`"),
    };
    let wall_s = t0.elapsed().as_secs_f64();
    let mut out = json!({"task": t.task, "context": t.context, "tokens": t.tokens, "trials": t.trials, "metrics": metrics, "wall_s": wall_s});
    if questions {
        out["query"] = json!(t.query);
    }
    if let Some(d) = &t.dataset {
        out["dataset"] = json!(d);
    }
    if t.task == "dataset" {
        // Each row brings its context and answer length: the --context and
        // --tokens flags were not used, so they are not recorded.
        out["context"] = serde_json::Value::Null;
        out["tokens"] = serde_json::Value::Null;
    }
    match &mem {
        Some(m) => out["memory"] = memory_json(m),
        None => {
            let (kv, full) = (
                out["metrics"]["kv_bytes"].as_u64().unwrap_or(0),
                out["metrics"]["full_fp16_bytes"].as_u64().unwrap_or(1),
            );
            out["memory"] = json!({"kv_bytes": kv, "full_fp16_bytes": full, "compression_ratio": kv as f64 / full as f64});
        }
    }
    Ok(out)
}

pub fn eval(a: &EvalArgs) -> Result<()> {
    let cfg = load_config(a.config.as_deref())?;
    let seed = a.seed.unwrap_or(cfg.seed);
    let task = match (&a.task, &a.opts.dataset) {
        (Some(t), None) if t == "dataset" => {
            return Err(Error::Input(
                "--task dataset needs --dataset FILE.jsonl".into(),
            ));
        }
        (Some(t), Some(_)) if t != "dataset" => {
            return Err(Error::Input(format!(
                "--dataset runs the `dataset` task, not `{t}`"
            )));
        }
        (Some(t), _) => t.clone(),
        (None, _) => "dataset".into(),
    };
    let l = load_model(&a.model)?;
    let spec = TaskSpec {
        task,
        context: a.opts.context,
        tokens: a.opts.tokens,
        trials: a.opts.trials,
        depth: a.depth,
        text: a.opts.text.clone().unwrap_or_else(default_text),
        query: query_mode(a.opts.query_aware),
        dataset: a.opts.dataset.clone(),
        ids: a.ids.clone(),
    };
    if let Some(path) = &a.export {
        if !spec.task.starts_with("ruler-") {
            return Err(Error::Input(format!(
                "--export writes generated ruler-* tasks; `{}` is not one",
                spec.task
            )));
        }
        let rows = question_rows(&spec, &l.tok, seed, &read_text(&spec.text)?)?;
        minikv_eval::qa::write_dataset(path, &rows)?;
        eprintln!(
            "{} rows of {} written to {}",
            rows.len(),
            spec.task,
            path.display()
        );
        return Ok(());
    }
    let mut out = run_task(&l, &cfg, &spec, seed, &RefMemo::default())?;
    out["provenance"] = serde_json::to_value(provenance(
        Some(&l.path),
        seed,
        Some(serde_json::to_value(&cfg).expect("json")),
    )?)
    .expect("json");
    if a.json {
        print_json(&out);
    } else {
        println!(
            "{}: {}",
            spec.task,
            serde_json::to_string(&out["metrics"]).expect("json")
        );
        println!(
            "KV {} bytes ({:.1}% of fp16), {:.1}s",
            out["memory"]["kv_bytes"],
            100.0 * out["memory"]["compression_ratio"].as_f64().unwrap_or(0.0),
            out["wall_s"]
        );
    }
    Ok(())
}

/// Mean of each numeric field over rows (with the per-row values kept), plus a
/// 95% normal interval when there are several rows.
/// Flattens a cache's diagnostics into a trial's metrics, so that trials
/// average them: a compensator's means as `<type>_<stat>` (`reskv_eta`,
/// `cam_merged`), other methods' numbers as `<method>_<field>`
/// (`quest_bytes_read_per_token`), and ResKV's per-layer errors.
fn add_diagnostics(v: &mut serde_json::Value, diag: &serde_json::Value) {
    if let Some(methods) = diag.as_object() {
        for (name, d) in methods {
            let flat = d["mean"].as_object().or_else(|| d.as_object());
            for (k, x) in flat.into_iter().flatten() {
                if x.is_number() {
                    v[format!("{name}_{k}")] = x.clone();
                }
            }
        }
    }
    let r = &diag["reskv"];
    if let Some(pl) = r["per_layer"].as_array() {
        for k in ["output_error", "output_error_dropped", "eta"] {
            v[format!("reskv_{k}_per_layer")] = pl.iter().map(|x| x[k].clone()).collect();
        }
    }
}

fn mean_rows(rows: &[serde_json::Value]) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    if let Some(first) = rows.first().and_then(|r| r.as_object()) {
        for k in first.keys() {
            // Numeric arrays of one length (per-layer figures): element-wise mean.
            let arrays: Vec<Vec<f64>> = rows
                .iter()
                .filter_map(|r| r[k].as_array())
                .map(|a| a.iter().filter_map(|x| x.as_f64()).collect::<Vec<_>>())
                .collect();
            if arrays.len() == rows.len()
                && let Some(n) = arrays.first().map(Vec::len).filter(|&n| n > 0)
                && arrays.iter().all(|a| a.len() == n)
                && first[k].as_array().is_some_and(|a| a.len() == n)
            {
                let m = rows.len() as f64;
                let mean: Vec<f64> = (0..n)
                    .map(|i| arrays.iter().map(|a| a[i]).sum::<f64>() / m)
                    .collect();
                out.insert(k.clone(), json!(mean));
                continue;
            }
            let xs: Vec<f64> = rows.iter().filter_map(|r| r[k].as_f64()).collect();
            if xs.len() != rows.len() {
                continue;
            }
            let n = xs.len() as f64;
            let mean = xs.iter().sum::<f64>() / n;
            out.insert(k.clone(), json!(mean));
            if let Some((lo, hi, _)) = crate::report::stats::interval_for(k, &xs) {
                out.insert(format!("{k}_ci95"), json!([lo, hi]));
            }
        }
    }
    out.insert("per_trial".into(), json!(rows));
    serde_json::Value::Object(out)
}
