//! Every command's flags, in-process on the real model.
//!
//! The command tree comes from clap (`minikv_cli::command()`), so a new flag
//! is fuzzed without touching this file. The input bytes choose a command,
//! which of its flags to give, and each value: one of the flag's possible
//! values, an edge value (0, -1, NaN, 1e308, 2^64, empty, quotes, commas), a
//! small number, a file (every preset, the model, a text, /dev/null,
//! /dev/zero, a folder, a missing path, a config written from the input
//! bytes themselves) or a raw string. Numbers stay small (at most 300) so an
//! accepted run ends in seconds; the edge values test the range checks.
//!
//! Not run: `serve` and `bench serve` (they listen or connect).

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use std::path::PathBuf;
use std::sync::OnceLock;

struct Flag {
    long: Option<String>,
    id: String,
    takes_value: bool,
    repeatable: bool,
    required: bool,
    /// A size of the work (tokens, runs, trials, depths, seconds, ...) or a
    /// default above 300: always given, and mostly a small value, so that
    /// an input runs in seconds under the instrumentation.
    pinned: bool,
    possible: Vec<String>,
}

struct Leaf {
    path: Vec<String>,
    flags: Vec<Flag>,
}

fn leaves() -> &'static [Leaf] {
    static L: OnceLock<Vec<Leaf>> = OnceLock::new();
    L.get_or_init(|| {
        let mut out = Vec::new();
        walk(&minikv_cli::command(), &mut Vec::new(), &mut out);
        out.retain(|l| {
            let p = l.path.join(" ");
            p != "serve" && p != "bench serve"
        });
        out
    })
}

fn walk(cmd: &clap::Command, path: &mut Vec<String>, out: &mut Vec<Leaf>) {
    let subs: Vec<_> = cmd.get_subcommands().collect();
    if subs.is_empty() {
        let flags = cmd
            .get_arguments()
            .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
            .map(|a| Flag {
                long: a.get_long().map(str::to_string),
                id: a.get_id().to_string(),
                takes_value: a.get_action().takes_values(),
                repeatable: matches!(a.get_action(), clap::ArgAction::Append),
                required: a.is_required_set(),
                pinned: SIZES.contains(&a.get_id().as_str())
                    || a.get_default_values().iter().any(|v| {
                        v.to_string_lossy()
                            .split(',')
                            .any(|n| n.parse::<f64>().is_ok_and(|n| n > 300.0))
                    }),
                possible: a
                    .get_possible_values()
                    .iter()
                    .map(|v| v.get_name().to_string())
                    .collect(),
            })
            .collect();
        out.push(Leaf {
            path: path.clone(),
            flags,
        });
        return;
    }
    for s in subs {
        if s.get_name() == "help" {
            continue;
        }
        path.push(s.get_name().to_string());
        walk(s, path, out);
        path.pop();
    }
}

/// Flags that size the work.
const SIZES: &[&str] = &[
    "tokens",
    "max_tokens",
    "runs",
    "warmup",
    "trials",
    "depth",
    "context",
    "requests",
    "seconds",
    "chunks",
    "prefill",
    "window",
];

const EDGE: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "8",
    "64",
    "300",
    "-1",
    "-0",
    "0.5",
    "1.5",
    "1e308",
    "-1e308",
    "NaN",
    "inf",
    "18446744073709551616",
    "99999999999",
    "",
    " ",
    "a",
    "x,\"y\"",
    "\n",
    "é",
    "passkey",
    "ruler-niah",
    "a vs b",
    "cache.heavy=0.1",
    "cache.heavy_tokens=-1",
    "seed=1",
];

/// Files a path flag gets.
fn files() -> &'static [String] {
    static F: OnceLock<Vec<String>> = OnceLock::new();
    F.get_or_init(|| {
        let root = crate::root();
        let mut v: Vec<String> = std::fs::read_dir(root.join("configs"))
            .map(|d| {
                d.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "toml" || x == "json"))
                    .map(|p| p.display().to_string())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        let assets = root.join("assets");
        for p in [
            assets.join("SmolLM2-135M-Instruct.Q4_1.gguf"),
            assets.join("paul_graham"),
            assets.join("paul_graham/addiction.txt"),
            root.join("configs"),
            root.join("Cargo.toml"),
            PathBuf::from("/dev/null"),
            PathBuf::from("/dev/zero"),
            PathBuf::from("/nonexistent/minikv"),
        ] {
            v.push(p.display().to_string());
        }
        for s in [
            "fuzz.toml",
            "fuzz.json",
            "fuzz.jsonl",
            "out.jsonl",
            "o/p.json",
            "",
            ".",
        ] {
            v.push(s.to_string());
        }
        v
    })
}

/// The files that suit a path flag, by its id (most values come from here;
/// the rest from every file, so a model named as a config still happens).
fn suited(id: &str) -> Vec<String> {
    let all = files();
    let pick = |f: &dyn Fn(&str) -> bool| all.iter().filter(|p| f(p)).cloned().collect::<Vec<_>>();
    match id {
        "config" | "base" | "configs" => pick(&|p| p.ends_with(".toml") || p.ends_with(".json")),
        "model" => pick(&|p| p.ends_with(".gguf") || p.starts_with("/dev/") || p == "fuzz.toml"),
        "text" => {
            pick(&|p| p.contains("paul_graham") || p.starts_with("/dev/") || p.ends_with(".jsonl"))
        }
        "input" | "dataset" | "results" | "file" => {
            pick(&|p| p.starts_with("fuzz.") || p.starts_with("/dev/") || p.contains("nonexistent"))
        }
        "out" | "export" => pick(&|p| !p.starts_with('/') && !p.starts_with("fuzz.")),
        _ => all.to_vec(),
    }
}

fn value(u: &mut Unstructured, f: &Flag, path_like: bool) -> Result<String> {
    if !f.possible.is_empty() && u.ratio(7, 8)? {
        return Ok(u.choose(&f.possible)?.clone());
    }
    if path_like && u.ratio(3, 4)? {
        let pool = suited(&f.id);
        if !pool.is_empty() {
            return Ok(u.choose(&pool)?.clone());
        }
    }
    Ok(match u.int_in_range(0..=9)? {
        0..=3 if path_like => u.choose(files())?.clone(),
        0..=3 | 4 => u.choose(EDGE)?.to_string(),
        5..=7 => u.int_in_range(0..=48u32)?.to_string(),
        8 => format!("{:.3}", u.int_in_range(0..=2000u32)? as f64 / 1000.0),
        _ => {
            let n = u.int_in_range(0..=12)?;
            let b = u.bytes(n)?;
            String::from_utf8_lossy(b).replace('\0', "")
        }
    })
}

fn is_path(id: &str) -> bool {
    matches!(
        id,
        "config"
            | "model"
            | "text"
            | "input"
            | "dataset"
            | "results"
            | "file"
            | "base"
            | "out"
            | "export"
            | "chat_template"
            | "pattern"
            | "configs"
    )
}

fn argv(u: &mut Unstructured) -> Result<Vec<String>> {
    let leaf = u.choose(leaves())?;
    let mut argv = vec!["minikv".to_string()];
    argv.extend(leaf.path.iter().cloned());
    // An exhausted input gives defaults (true, 0): stop adding then.
    let some = |u: &mut Unstructured, n: u8, d: u8| -> Result<bool> {
        Ok(!u.is_empty() && u.ratio(n, d)?)
    };
    for f in &leaf.flags {
        // A flag with a list of values (`--task`) is often what makes a
        // command run at all (`required_unless_present`): given more often.
        let odds = if f.possible.is_empty() { 3 } else { 2 };
        if !(f.required || f.pinned || some(u, 1, odds)?) {
            continue;
        }
        let v = if f.pinned && !some(u, 1, 8)? {
            u.int_in_range(1..=24u32)?.to_string()
        } else {
            value(u, f, is_path(&f.id))?
        };
        match &f.long {
            Some(l) if f.takes_value => argv.extend([format!("--{l}"), v]),
            Some(l) => argv.push(format!("--{l}")),
            None => argv.push(v),
        }
        // Any flag now and then twice (clap refuses a single-use one; a
        // repeatable one, `--set`, `--pair`, `--config`, takes both).
        if f.takes_value && f.long.is_some() && some(u, 1, if f.repeatable { 4 } else { 20 })? {
            argv.push(format!("--{}", f.long.as_ref().expect("long")));
            argv.push(value(u, f, is_path(&f.id))?);
        }
    }
    if some(u, 1, 12)? {
        argv.push(u.choose(EDGE)?.to_string());
    }
    Ok(argv)
}

/// One fuzz input: the first half of the bytes picks the command line, the
/// rest becomes `fuzz.toml` / `fuzz.json` / `fuzz.jsonl` in the working
/// folder, so config, dataset and results contents are fuzzed through the
/// commands too.
pub fn run(data: &[u8]) {
    crate::quiet();
    let dir = crate::scratch().join("cli");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("o")).expect("cli folder");
    // SAFETY: set once per process before any command runs; the fuzzer is
    // single-threaded between inputs.
    unsafe {
        std::env::set_var("MINIKV_ASSETS", crate::root().join("assets"));
    }
    std::env::set_current_dir(&dir).expect("cd into the scratch folder");
    let (head, tail) = data.split_at(data.len() / 2);
    for name in ["fuzz.toml", "fuzz.json", "fuzz.jsonl"] {
        std::fs::write(dir.join(name), tail).expect("write fuzz file");
    }
    let Ok(args) = argv(&mut Unstructured::new(head)) else {
        return;
    };
    if let Some(log) = std::env::var_os("MINIKV_FUZZ_LOG") {
        let _ = std::fs::write(
            format!("{}.last", log.to_string_lossy()),
            format!("{args:?}\n"),
        );
    }
    let r = minikv_cli::run_args(&args);
    // MINIKV_FUZZ_LOG=FILE: one line per input, the command and its outcome
    // (to see what the fuzzer reaches; stdout is /dev/null).
    if let Some(log) = std::env::var_os("MINIKV_FUZZ_LOG") {
        use std::io::Write;
        let outcome = match &r {
            Ok(()) => "ok".to_string(),
            Err(e) => format!("error: {}", e.to_string().lines().next().unwrap_or("")),
        };
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
        {
            let _ = writeln!(f, "{args:?} => {outcome}");
        }
    }
}
