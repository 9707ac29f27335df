//! `eval` and the tasks it (and `sweep`) runs.

use super::*;

use crate::EvalArgs;
use crate::provenance::provenance;
use minikv_core::{Error, Result, RunConfig};
use minikv_eval::tasks::{Input, TaskMemory};
use serde_json::json;
use std::path::{Path, PathBuf};

/// Checks a task name against the registry ([`minikv_eval::tasks`]).
pub fn check_task(t: &str) -> Result<()> {
    minikv_eval::tasks::get(t).map(|_| ())
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

pub use minikv_eval::tasks::TaskSpec;

/// The query mode of `--query-aware`.
pub fn query_mode(aware: bool) -> minikv_eval::qa::QueryMode {
    if aware {
        minikv_eval::qa::QueryMode::Aware
    } else {
        minikv_eval::qa::QueryMode::Agnostic
    }
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
/// row (task, metrics, memory, wall time). The task comes from the registry;
/// what is read and checked before it runs follows its [`Input`], the same
/// for every task. Texts are tokenized once per call.
pub fn run_task(
    l: &Loaded,
    cfg: &RunConfig,
    t: &TaskSpec,
    seed: u64,
    memo: &RefMemo,
) -> Result<serde_json::Value> {
    let task = minikv_eval::tasks::get(&t.task)?;
    let input = task.input();
    let m = l.model.as_ref();
    let full_cfg = RunConfig {
        backend: cfg.backend.clone(),
        ..RunConfig::default()
    };
    if t.ids.is_some() && input != Input::Windows {
        let windowed: Vec<&str> = minikv_eval::tasks::all()
            .into_iter()
            .filter(|t| t.input() == Input::Windows)
            .map(|t| t.name())
            .collect();
        return Err(Error::Input(format!(
            "--ids gives windows of tokens for {}, not `{}`",
            windowed.join(", "),
            t.task
        )));
    }
    // The text is read unless the rows bring their contexts or --ids gives
    // the tokens, and tokenized only where prompts are cut from its tokens.
    let text = if input == Input::Dataset || t.ids.is_some() {
        String::new()
    } else {
        read_text(&t.text)?
    };
    let tokens = match &t.ids {
        Some(p) => read_ids(p, m.vocab_size())?,
        None if matches!(input, Input::Windows | Input::Haystack) => l.tok.encode(&text)?,
        None => Vec::new(),
    };
    let max = m.spec().max_seq_len;
    // Prompt-only tasks are `context` tokens in all; windows add `tokens`.
    let need = t.context + if input.prompt_only() { 0 } else { t.tokens };
    if need > max {
        return Err(Error::ContextOverflow { len: need, max });
    }
    if t.trials == 0 {
        return Err(Error::Input("--trials must be positive".into()));
    }
    let cache = || build_cache(m, cfg);
    let full_cache = || build_cache(m, &full_cfg);
    let reference = |ids: &[u32]| {
        let key = format!(
            "{}/{:?}/{}/{}",
            l.sha256()?,
            full_cfg.backend,
            t.context,
            ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
        );
        memo.get_or(&key, || {
            minikv_eval::reference_logits(m, build_cache(m, &full_cfg)?.as_mut(), ids, t.context)
        })
    };
    let cx = minikv_eval::tasks::TaskContext {
        model: m,
        tok: &l.tok,
        spec: t,
        seed,
        text: if input == Input::Questions { &text } else { "" },
        tokens: &tokens,
        cache: &cache,
        full_cache: &full_cache,
        reference: &reference,
    };
    let t0 = std::time::Instant::now();
    let r = task.run(&cx)?;
    let wall_s = t0.elapsed().as_secs_f64();
    let mut out = json!({"task": t.task, "context": t.context, "tokens": t.tokens, "trials": t.trials, "metrics": r.metrics, "wall_s": wall_s});
    if input.asks_questions() {
        out["query"] = json!(t.query);
    }
    if let Some(d) = &t.dataset {
        out["dataset"] = json!(d);
    }
    if input == Input::Dataset {
        // Each row brings its context and answer length: the --context and
        // --tokens flags were not used, so they are not recorded.
        out["context"] = serde_json::Value::Null;
        out["tokens"] = serde_json::Value::Null;
    }
    out["memory"] = match &r.memory {
        TaskMemory::Report(m) => memory_json(m),
        m => {
            let (kv, full) = (m.kv_bytes(), m.full_fp16_bytes().max(1));
            json!({"kv_bytes": kv, "full_fp16_bytes": full, "compression_ratio": kv as f64 / full as f64})
        }
    };
    Ok(out)
}

pub fn eval(a: &EvalArgs) -> Result<()> {
    let cfg = load_config(a.config.as_deref())?;
    let seed = a.seed.unwrap_or(cfg.seed);
    // `--dataset FILE` alone runs the task that reads question rows from a
    // file; such a task needs the file, and the file needs such a task.
    let from_file = || {
        minikv_eval::tasks::all()
            .into_iter()
            .find(|t| t.input() == Input::Dataset)
            .ok_or_else(|| Error::Input("no registered task reads --dataset".into()))
    };
    let task = match &a.task {
        Some(t) => minikv_eval::tasks::get(t)?,
        None => from_file()?,
    };
    match (task.input() == Input::Dataset, &a.opts.dataset) {
        (true, None) => {
            return Err(Error::Input(format!(
                "--task {} needs --dataset FILE.jsonl",
                task.name()
            )));
        }
        (false, Some(_)) => {
            return Err(Error::Input(format!(
                "--dataset runs the `{}` task, not `{}`",
                from_file()?.name(),
                task.name()
            )));
        }
        _ => {}
    }
    let task = task.name().to_string();
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
        let Some(ruler) = minikv_eval::ruler::find(&spec.task) else {
            return Err(Error::Input(format!(
                "--export writes generated ruler-* tasks; `{}` is not one",
                spec.task
            )));
        };
        let rows =
            minikv_eval::tasks::ruler_rows(ruler, &spec, &l.tok, seed, &read_text(&spec.text)?)?;
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
