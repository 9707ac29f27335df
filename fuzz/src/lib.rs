//! Shared bodies of the fuzz targets (`fuzz_targets/*.rs` are one line each).
//!
//! Oracles: no panic (debug assertions and overflow checks are on), no hang
//! (libFuzzer's `-timeout`), no runaway memory (`-rss_limit_mb`), plus the
//! per-target checks below.

use minikv_core::{CacheBuilder, ModelSpec, RunConfig};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

// typetag registers impls only in binaries that reference their crate.
use minikv_policies as _;
use minikv_quant as _;

pub mod cli;

/// A scratch folder of this process (one per fuzzer worker).
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("minikv-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("scratch folder");
        d
    })
}

/// The repository root (configs, assets).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Sends this process's stdout to /dev/null (the commands print a lot; the
/// oracles do not read it; stderr stays, for libFuzzer's reports and panic
/// messages). Idempotent.
pub fn quiet() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        if std::env::var_os("MINIKV_FUZZ_VERBOSE").is_some() {
            return;
        }
        // SAFETY: plain fd duplication onto 1 of a file we opened.
        unsafe {
            let fd = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
            if fd >= 0 {
                libc::dup2(fd, 1);
                libc::close(fd);
            }
        }
    });
}

/// Any config text `config check` accepts must build a cache that prefills,
/// compresses and decodes a few steps without a panic and with finite
/// outputs (errors are fine).
pub fn config(text: &str, json: bool) {
    let Ok(mut cfg) = RunConfig::parse(text, json) else {
        return;
    };
    if cfg.resolve().and_then(|_| cfg.validate(None)).is_err() {
        return;
    }
    let spec = ModelSpec {
        n_layers: 2,
        n_q_heads: 4,
        n_kv_heads: 2,
        head_dim: 32,
        max_seq_len: 256,
        windows: Vec::new(),
    };
    let Ok(mut c) = CacheBuilder::new(spec).build(&cfg.cache) else {
        return;
    };
    let (t, kv, qd) = (48, 64, 128);
    let x: Vec<f32> = (0..t * qd)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let mut out = vec![0.0; t * qd];
    for l in 0..2 {
        if c.append(l, &x[..t * kv], &x[t * kv..2 * t * kv], t)
            .is_err()
            || c.attend(l, &x, t, &mut out).is_err()
        {
            return;
        }
    }
    if c.end_prefill().is_err() {
        return;
    }
    for s in 0..4 {
        for l in 0..2 {
            let k = &x[s * kv..(s + 1) * kv];
            if c.append(l, k, k, 1).is_err() || c.attend(l, &x[..qd], 1, &mut out[..qd]).is_err() {
                return;
            }
            assert!(
                out[..qd].iter().all(|v| v.is_finite()),
                "non-finite attention output"
            );
        }
    }
    let _ = c.memory();
}

/// `minikv report` on arbitrary bytes as the results file: an error or a
/// report whose CSVs hold no NaN or infinite number and parse back with the
/// same number of fields on every line.
pub fn report(data: &[u8]) {
    quiet();
    let dir = scratch().join("report");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("report folder");
    let results = dir.join("results.jsonl");
    std::fs::write(&results, data).expect("write results");
    let out = dir.join("out");
    let mut args = vec![
        "minikv".to_string(),
        "report".into(),
        results.display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ];
    match data.len() % 3 {
        1 => args.extend(["--pair".into(), "a vs b".into()]),
        2 => args.extend(["--dataset".into(), "x,\"y\"".into()]),
        _ => {}
    }
    if minikv_cli::run_args(&args).is_err() {
        return;
    }
    for name in ["results.csv", "leaderboard.csv"] {
        let Ok(text) = std::fs::read_to_string(out.join(name)) else {
            continue;
        };
        let mut widths = Vec::new();
        for line in csv_records(&text) {
            for f in &line {
                let l = f.to_ascii_lowercase();
                assert!(
                    l != "nan" && l != "inf" && l != "-inf",
                    "{name}: field {f:?}"
                );
            }
            widths.push(line.len());
        }
        assert!(
            widths.windows(2).all(|w| w[0] == w[1]),
            "{name}: ragged rows {widths:?}"
        );
    }
}

/// Records of a CSV file, read by the `csv` crate (an independent RFC 4180
/// reader; ragged rows are returned, for the width check; a file it cannot
/// read is a finding).
fn csv_records(text: &str) -> Vec<Vec<String>> {
    csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .from_reader(text.as_bytes())
        .records()
        .map(|r| {
            r.expect("report wrote unreadable CSV")
                .iter()
                .map(str::to_string)
                .collect()
        })
        .collect()
}

/// The dataset reader on arbitrary bytes: an error, or rows that pass the
/// documented checks and survive a write and a second read unchanged.
pub fn dataset(data: &[u8]) {
    use minikv_eval::qa::{read_dataset, write_dataset};
    let dir = scratch().join("dataset");
    std::fs::create_dir_all(&dir).expect("dataset folder");
    let p = dir.join("rows.jsonl");
    std::fs::write(&p, data).expect("write dataset");
    let Ok(rows) = read_dataset(&p) else { return };
    for r in &rows {
        assert!(!r.context.trim().is_empty());
        assert!((1..=4096).contains(&r.max_new_tokens));
        assert!(r.depth.is_none_or(|d| (0.0..=1.0).contains(&d)));
    }
    let q = dir.join("again.jsonl");
    write_dataset(&q, &rows).expect("write back");
    let again = read_dataset(&q).expect("a written dataset reads back");
    assert_eq!(rows, again, "rows changed through a write and a read");
}
