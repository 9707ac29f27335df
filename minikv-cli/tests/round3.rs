//! The defects a hostile probe found (reliability round three), one case
//! each: the command, its exit code, and the message or the correct result.

use minikv_test_support::{root, run_in_root, tmp_dir};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn tmp(tag: &str) -> PathBuf {
    tmp_dir(&format!("r3-{tag}"))
}

/// Runs the binary: (exit code, stdout, stderr).
fn run(args: &[&str]) -> (i32, String, String) {
    let r = run_in_root(env!("CARGO_BIN_EXE_minikv"), args);
    (r.code, r.stdout, r.stderr)
}

fn expect(args: &[&str], code: i32, want: &[&str]) -> String {
    let (c, out, err) = run(args);
    assert_eq!(c, code, "minikv {args:?}: exit {c}: {err}");
    assert!(!err.contains("panicked"), "minikv {args:?} panicked: {err}");
    for w in want {
        assert!(
            err.contains(w) || out.contains(w),
            "minikv {args:?}: `{w}` not in: {err}"
        );
    }
    out
}

/// Records of a CSV file, read by the `csv` crate (an independent RFC 4180
/// reader; ragged rows are returned, for the width check).
fn csv(text: &str) -> Vec<Vec<String>> {
    csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .from_reader(text.as_bytes())
        .records()
        .map(|r| r.unwrap().iter().map(str::to_string).collect())
        .collect()
}

#[test]
fn deep_json_configs_and_devices_are_refused_cleanly() {
    let d = tmp("deep");
    let mut s = String::from("{\"type\": \"snapkv\"}");
    for _ in 0..90 {
        s = format!("{{\"type\": \"chunk_kv\", \"scorer\": {s}}}");
    }
    let f = d.join("deep.json");
    std::fs::write(
        &f,
        format!("{{\"cache\": {{\"heavy\": 0.25, \"scorer\": {s}}}}}"),
    )
    .unwrap();
    expect(
        &["config", "check", f.to_str().unwrap()],
        2,
        &["nests", "at most 32"],
    );
    // A device reports no length: the 1 MiB limit still holds.
    expect(
        &["config", "check", "/dev/zero"],
        2,
        &["more than 1048576 bytes"],
    );
    // A JSON error names the field's path.
    let g = d.join("neg.json");
    std::fs::write(&g, r#"{"cache": {"heavy_tokens": -5}}"#).unwrap();
    expect(
        &["config", "check", g.to_str().unwrap()],
        2,
        &["cache.heavy_tokens"],
    );
    // Long TOML errors keep their reason (the end of the message).
    let h = d.join("long.toml");
    std::fs::write(&h, format!("[cache]\nheavy = \"{}\"\n", "x".repeat(3000))).unwrap();
    expect(
        &["config", "check", h.to_str().unwrap()],
        2,
        &["characters cut", "expected"],
    );
}

#[test]
fn a_closed_pipe_ends_quietly() {
    for args in [
        &["components"][..],
        &["info"],
        &["tokenize", "--prompt", "hello world"],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_minikv"))
            .args(args)
            .current_dir(root())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the reader is gone before the first write
        let o = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_ne!(o.status.code(), Some(101), "{args:?}: {err}");
    }
}

/// Result rows for `report`: one task, two seeds, the given values.
fn rows(label: &str, values: &[f64]) -> String {
    let mut s = String::new();
    for (i, v) in values.iter().enumerate() {
        s += &serde_json::json!({
            "key": format!("{label}-{i}"), "label": label, "task": "perplexity", "seed": i,
            "config": {"cache": {}}, "config_hash": format!("h-{label}"), "context": 64,
            "metrics": {"ppl": v}, "memory": {"compression_ratio": 1.0, "kv_bytes": 10},
        })
        .to_string();
        s.push('\n');
    }
    s
}

#[test]
fn report_survives_extreme_values_and_escapes_csv() {
    let d = tmp("report");
    let f = d.join("r.jsonl");
    let text = rows("huge", &[1e308, -1e308, 1e308])
        + &rows("one, \"quoted\" label", &[3.5])
        + &rows("plain", &[2.0, 3.0]);
    std::fs::write(&f, text).unwrap();
    let out = d.join("out");
    let t0 = std::time::Instant::now();
    expect(
        &[
            "report",
            f.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--dataset",
            "my,\"set\"",
        ],
        0,
        &[],
    );
    assert!(
        t0.elapsed().as_secs() < 60,
        "report took {:?}",
        t0.elapsed()
    );
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        !md.contains("NaN") && !md.contains("inf]") && !md.contains("[-inf"),
        "{md}"
    );
    for name in ["results.csv", "leaderboard.csv"] {
        let table = csv(&std::fs::read_to_string(out.join(name)).unwrap());
        let width = table[0].len();
        assert!(table.iter().all(|r| r.len() == width), "{name}: {table:?}");
        assert!(
            table.iter().flatten().all(|f| f != "NaN" && f != "inf"),
            "{name}: {table:?}"
        );
        if name == "results.csv" {
            let r = table
                .iter()
                .find(|r| r[1] == "one, \"quoted\" label")
                .unwrap();
            assert_eq!(
                (r[4].as_str(), r[5].as_str()),
                ("", ""),
                "n = 1: no interval"
            );
            let plain = table.iter().find(|r| r[1] == "plain").unwrap();
            assert_eq!(plain[3], "2.5");
        } else {
            assert!(
                table.iter().any(|r| r[0] == "my,\"set\"/perplexity"),
                "{table:?}"
            );
        }
    }
}

#[test]
fn short_prompts_keep_a_floor_of_one_token_per_ratio() {
    let out = expect(
        &[
            "generate",
            "--prompt",
            "The history of",
            "--config",
            "configs/h2o.toml",
            "--max-tokens",
            "4",
            "--json",
        ],
        0,
        &[],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let per_layer = v["memory"]["per_layer_tokens"].as_array().unwrap();
    assert!(
        per_layer.iter().all(|t| t.as_u64().unwrap() >= 1),
        "{}",
        v["memory"]
    );
    // The ratios' floors in the budgets table agree.
    let out = expect(
        &[
            "budgets",
            "configs/h2o.toml",
            "--layers",
            "2",
            "--tokens",
            "3",
            "--json",
        ],
        0,
        &[],
    );
    let b: serde_json::Value = serde_json::from_str(&out).unwrap();
    for l in b["layers"].as_array().unwrap() {
        assert!(
            l["heavy"].as_u64().unwrap() >= 1 && l["recent"].as_u64().unwrap() >= 1,
            "{b}"
        );
    }
}

#[test]
fn sweep_refuses_a_path_set_twice() {
    expect(
        &[
            "sweep",
            "configs/minikv.toml",
            "--set",
            "cache.heavy=0.1",
            "--set",
            "cache.heavy=0.2",
            "--task",
            "fidelity",
            "--out",
            "/tmp/never.jsonl",
        ],
        2,
        &["--set cache.heavy is given twice"],
    );
}

#[test]
fn dataset_rows_carry_their_task_and_no_git_runs_at_run_time() {
    let d = tmp("ds");
    let f = d.join("q.jsonl");
    let row = serde_json::json!({"context": "The pass key is 4521. Remember it. ".repeat(4), "question": " What is the pass key?", "answer_prefix": " The pass key is", "answer": "4521", "max_new_tokens": 4, "task": "my-task"});
    std::fs::write(&f, format!("{row}\n")).unwrap();
    // A `git` on PATH that leaves a mark if anything runs it.
    let bin = d.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let mark = d.join("git-ran");
    let fake = bin.join("git");
    std::fs::write(
        &fake,
        format!("#!/bin/sh\ntouch {}\nexit 1\n", mark.display()),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let o = Command::new(env!("CARGO_BIN_EXE_minikv"))
        .args([
            "eval",
            "--dataset",
            f.to_str().unwrap(),
            "--config",
            "configs/full.toml",
            "--json",
        ])
        .env("PATH", path)
        .current_dir(root())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["metrics"]["per_trial"][0]["task"], "my-task", "{v}");
    // The rows bring their own contexts: no unused --context is recorded.
    assert!(v["context"].is_null() && v["tokens"].is_null(), "{v}");
    assert!(
        v["provenance"]["git_rev"]
            .as_str()
            .is_some_and(|r| !r.is_empty()),
        "{v}"
    );
    assert!(!mark.exists(), "the binary ran git at run time");
}

fn sweep_into(out: &Path) -> (i32, String) {
    let (c, _, err) = run(&[
        "sweep",
        "configs/minikv.toml",
        "--set",
        "cache.heavy=0.1",
        "--task",
        "fidelity",
        "--context",
        "64",
        "--tokens",
        "4",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ]);
    (c, err)
}

#[test]
fn quarantine_follows_symlinks_and_refuses_read_only_files() {
    let d = tmp("quarantine");
    let target = d.join("target.jsonl");
    let link = d.join("link.jsonl");
    std::fs::write(&target, "junk line\n").unwrap();
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let (c, err) = sweep_into(&link);
    assert_eq!(c, 0, "{err}");
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink(),
        "the link was replaced"
    );
    let text = std::fs::read_to_string(&target).unwrap();
    assert!(
        !text.contains("junk") && text.lines().count() == 1,
        "{text}"
    );
    assert!(
        std::fs::read_to_string(d.join("target.jsonl.rejected"))
            .unwrap()
            .contains("junk")
    );
    // A read-only file with a bad line: refused, untouched, no temporary left.
    let ro = d.join("ro.jsonl");
    std::fs::write(&ro, "junk\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o444)).unwrap();
    let (c, err) = sweep_into(&ro);
    assert_eq!(c, 2, "{err}");
    assert!(
        err.contains("read-only") && err.contains("ro.jsonl"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&ro).unwrap(), "junk\n");
    let mode = std::fs::metadata(&ro).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o444);
    assert!(!d.join("ro.jsonl.tmp").exists() && !d.join("ro.jsonl.rejected").exists());
}

#[test]
fn minor_cases() {
    let d = tmp("minor");
    // Duplicate GGUF metadata keys are refused, as duplicate tensors are.
    let model = std::fs::read(root().join("assets/SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    let (dup, key) = duplicate_first_key(&model);
    let f = d.join("dup.gguf");
    std::fs::write(&f, dup).unwrap();
    expect(
        &["info", "--model", f.to_str().unwrap()],
        2,
        &["appears twice", &key],
    );
    // calibrate duo with sinks + recent covering the context.
    expect(
        &[
            "calibrate",
            "duo",
            "--context",
            "64",
            "--sinks",
            "4",
            "--recent",
            "60",
            "--trials",
            "1",
            "--out",
            d.join("p.json").to_str().unwrap(),
        ],
        2,
        &["--sinks 4 + --recent 60"],
    );
    // Pattern scores outside [0, 1].
    let p = d.join("pat.json");
    std::fs::write(&p, serde_json::json!({"format": "minikv-duo-pattern-v1", "model": "m", "model_sha256": "0", "calibration": {}, "scores": vec![vec![1.5f32; 3]; 30]}).to_string()).unwrap();
    let c = d.join("duo.toml");
    std::fs::write(&c, format!("[cache]\nsinks = 4\nrecent_tokens = 64\nheavy = 1.0\nscorer = {{ type = \"cumulative_attention\" }}\nselector = {{ type = \"duo_attention\", pattern = \"{}\" }}\n", p.display())).unwrap();
    expect(
        &[
            "generate",
            "--prompt",
            "Hello there, how",
            "--config",
            c.to_str().unwrap(),
            "--max-tokens",
            "2",
        ],
        2,
        &["scores[0][0] = 1.5", "[0, 1]"],
    );
    // Devices named as inputs are read with a bound, never until memory
    // runs out: a text, a results file, a dataset, a quantize input.
    expect(
        &["perplexity", "--text", "/dev/zero", "--tokens", "8"],
        2,
        &["/dev/zero: more than"],
    );
    expect(
        &[
            "report",
            "/dev/zero",
            "--out",
            d.join("r").to_str().unwrap(),
        ],
        2,
        &["/dev/zero: more than"],
    );
    expect(
        &["eval", "--dataset", "/dev/zero"],
        2,
        &["/dev/zero: more than"],
    );
    expect(
        &[
            "quantize",
            "--bits",
            "2",
            "--group",
            "4",
            "--axis",
            "token",
            "--input",
            "/dev/zero",
        ],
        2,
        &["/dev/zero: more than"],
    );
}

/// The GGUF with its first metadata entry written twice (the count raised).
fn duplicate_first_key(b: &[u8]) -> (Vec<u8>, String) {
    let n_kv = u64::from_le_bytes(b[16..24].try_into().unwrap());
    let key_len = u64::from_le_bytes(b[24..32].try_into().unwrap()) as usize;
    let key = String::from_utf8(b[32..32 + key_len].to_vec()).unwrap();
    let ty = u32::from_le_bytes(b[32 + key_len..36 + key_len].try_into().unwrap());
    assert_eq!(ty, 8, "the first entry is a string");
    let vlen = u64::from_le_bytes(b[36 + key_len..44 + key_len].try_into().unwrap()) as usize;
    let end = 44 + key_len + vlen;
    let mut out = b[..16].to_vec();
    out.extend_from_slice(&(n_kv + 1).to_le_bytes());
    out.extend_from_slice(&b[24..end]);
    out.extend_from_slice(&b[24..]);
    (out, key)
}

#[test]
fn components_say_which_parameters_are_required_and_pairs_refuse_mixed_contexts() {
    let out = expect(&["components"], 0, &[]);
    let i = out.find("  minmax").unwrap();
    let block: String = out[i..].lines().take(3).collect::<Vec<_>>().join("\n");
    assert!(
        block.contains("required (e.g.): axis")
            && block.contains("defaults: arithmetic = \"exact\", scale_dtype"),
        "{block}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&expect(&["components", "--json"], 0, &[])).unwrap();
    let mm = v
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "minmax")
        .unwrap();
    assert_eq!(mm["required"], serde_json::json!(["axis", "bits", "group"]));
    let d = tmp("pair");
    let f = d.join("r.jsonl");
    let mut text = rows("a", &[1.0, 2.0]) + &rows("b", &[1.5, 2.5]);
    text += &rows("b-long", &[1.0, 1.0])
        .replace("\"context\":64", "\"context\":128")
        .replace("\"label\":\"b-long\"", "\"label\":\"b\"");
    std::fs::write(&f, text).unwrap();
    expect(
        &[
            "report",
            f.to_str().unwrap(),
            "--out",
            d.join("o").to_str().unwrap(),
            "--pair",
            "a vs b",
        ],
        2,
        &["2 contexts"],
    );
}

/// A pattern file named in a config resolves against the config's folder,
/// wherever the command runs.
#[test]
fn duo_pattern_paths_are_relative_to_the_config_file() {
    let d = tmp("duo-rel");
    std::fs::create_dir_all(d.join("patterns")).unwrap();
    std::fs::copy(
        root().join("configs/patterns/smollm2-135m-instruct-q4_1.duo.json"),
        d.join("patterns/p.json"),
    )
    .unwrap();
    let cfg = d.join("duo.toml");
    std::fs::write(
        &cfg,
        "[cache]\nsinks = 4\nheavy_tokens = 0\nrecent_tokens = 16\nscorer = { type = \"recency\" }\n\
         selector = { type = \"duo_attention\", pattern = \"patterns/p.json\", retrieval_fraction = 0.25 }\n",
    )
    .unwrap();
    let run_in = |dir: &Path| {
        Command::new(env!("CARGO_BIN_EXE_minikv"))
            .args([
                "generate",
                "--prompt",
                "The history of the city",
                "--max-tokens",
                "2",
            ])
            .args([
                "--model",
                root()
                    .join("assets/SmolLM2-135M-Instruct.Q4_1.gguf")
                    .to_str()
                    .unwrap(),
            ])
            .arg("--config")
            .arg(&cfg)
            .current_dir(dir)
            .output()
            .unwrap()
    };
    let o = run_in(&std::env::temp_dir());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The shipped preset runs from outside the repository too.
    let o = Command::new(env!("CARGO_BIN_EXE_minikv"))
        .args(["config", "check", "--json"])
        .arg(root().join("configs/duo-attention.toml"))
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let p = v["cache"]["selector"]["pattern"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(Path::new(&p).is_file(), "{p}");
    // A missing file is an error naming the field, not a panic.
    std::fs::remove_file(d.join("patterns/p.json")).unwrap();
    let o = run_in(&std::env::temp_dir());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("cache.selector.pattern"), "{err}");
}
