//! Bad inputs get a clear error that names the problem, with exit code 2
//! (3 for I/O), never a panic and never a silently wrong result: the cases
//! found by trying about 190 bad inputs as a new user would.

use minikv_test_support::{root, run_in_root, tmp_dir};
use std::path::PathBuf;

/// A folder of its own per call: tests run in parallel and remove theirs.
fn tmp() -> PathBuf {
    tmp_dir("bad")
}

/// Runs the binary; returns (exit code, stderr).
fn run(args: &[&str]) -> (i32, String) {
    let r = run_in_root(env!("CARGO_BIN_EXE_minikv"), args);
    (r.code, r.stderr)
}

fn expect_error(args: &[&str], code: i32, want: &[&str]) {
    let (c, err) = run(args);
    assert_eq!(c, code, "minikv {args:?}: exit {c}: {err}");
    assert!(!err.contains("panicked"), "minikv {args:?} panicked: {err}");
    for w in want {
        assert!(err.contains(w), "minikv {args:?}: `{w}` not in: {err}");
    }
}

#[test]
fn numeric_flags_have_ranges_named_in_the_error() {
    let table: &[(&[&str], &[&str])] = &[
        (
            &["bench", "attention", "--tokens", "64", "--head-dim", "0"],
            &["--head-dim", "16..=1024"],
        ),
        (
            &["bench", "attention", "--tokens", "64", "--seconds", "inf"],
            &["--seconds", "finite"],
        ),
        (
            &["bench", "attention", "--tokens", "64", "--seconds", "NaN"],
            &["--seconds"],
        ),
        (
            &["bench", "attention", "--tokens", "64", "--seconds", "-1"],
            &["--seconds", "(0, 3600]"],
        ),
        (
            &["bench", "attention", "--tokens", "100000000000"],
            &["--tokens", "1..=16777216"],
        ),
        (
            &[
                "budgets",
                "configs/minikv.toml",
                "--layers",
                "100000000",
                "--tokens",
                "2048",
            ],
            &["--layers", "1..=4096"],
        ),
        (
            &[
                "budgets",
                "configs/minikv.toml",
                "--layers",
                "30",
                "--tokens",
                "18446744073709551615",
            ],
            &["--tokens"],
        ),
        (
            &["generate", "--prompt", "Hi", "--temperature", "1e-40"],
            &["--temperature", "0.001"],
        ),
        (
            &["generate", "--prompt", "Hi", "--temperature", "-1"],
            &["--temperature", "[0, 1000]"],
        ),
        (
            &["generate", "--prompt", "Hi", "--temperature", "1e308"],
            &["--temperature", "[0, 1000]"],
        ),
        (
            &["generate", "--prompt", "Hi", "--max-tokens", "0"],
            &["--max-tokens"],
        ),
        (
            &["eval", "--task", "passkey", "--depth", "-1"],
            &["--depth", "[0, 1]"],
        ),
        (
            &["eval", "--task", "passkey", "--depth", "1.5"],
            &["--depth"],
        ),
        (
            &["eval", "--task", "passkey", "--depth", "NaN"],
            &["--depth"],
        ),
        (
            &["eval", "--task", "attention-error", "--tokens", "0"],
            &["--tokens", "1..="],
        ),
        (
            &["eval", "--task", "generation", "--tokens", "0"],
            &["--tokens"],
        ),
        (
            &[
                "sweep",
                "configs/full.toml",
                "--task",
                "fidelity",
                "--seeds",
                "0",
                "--out",
                "x.jsonl",
            ],
            &["--seeds"],
        ),
    ];
    for (args, want) in table {
        expect_error(args, 2, want);
    }
}

#[test]
fn bad_configs_and_files_are_named() {
    let d = tmp();
    let w = |name: &str, text: &str| {
        let p = d.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_string_lossy().into_owned()
    };
    // A NaN in a sweep's base config is named, not dropped.
    let nan = w(
        "nan.toml",
        "[cache]\nheavy = nan\nscorer = { type = \"h2o\" }\n",
    );
    let out = d.join("x.jsonl");
    expect_error(
        &[
            "sweep",
            &nan,
            "--task",
            "fidelity",
            "--out",
            out.to_str().unwrap(),
        ],
        2,
        &["cache.heavy", "finite"],
    );
    // A budget that keeps nothing.
    let none = w(
        "none.toml",
        "[cache]\nheavy = 0\nrecent = 0\nscorer = { type = \"h2o\" }\n",
    );
    expect_error(
        &["config", "check", &none],
        2,
        &["cache.heavy", "keeps no token"],
    );
    // A huge config is refused by size, not echoed back.
    let big = w("big.toml", &format!("x = \"{}\"\n", "a".repeat(2 << 20)));
    let (c, err) = run(&["config", "check", &big]);
    assert!(
        c == 2 && err.contains("at most 1 MiB") && err.len() < 2000,
        "{err}"
    );
    // `report --out` onto an existing file.
    let file = w("exists.txt", "hello");
    expect_error(
        &[
            "report",
            "minikv-cli/tests/fixtures/sweep_fidelity.jsonl",
            "--out",
            &file,
        ],
        2,
        &["--out", "exists", "directory"],
    );
    // A model directory without config.json.
    let dir = d.join("model_dir");
    std::fs::create_dir_all(&dir).unwrap();
    expect_error(
        &["info", "--model", dir.to_str().unwrap()],
        2,
        &["config.json is missing"],
    );
    std::fs::remove_dir_all(&d).ok();
}

/// Corrupt model files: each error names the file and what is wrong.
#[test]
fn corrupt_gguf_files_are_named() {
    let src = root().join("assets/SmolLM2-135M-Instruct.Q4_1.gguf");
    let bytes = std::fs::read(&src).unwrap();
    let d = tmp();
    let write = |name: &str, b: &[u8]| {
        let p = d.join(name);
        std::fs::write(&p, b).unwrap();
        p.to_string_lossy().into_owned()
    };
    // The header says no metadata entries.
    let mut b = bytes.clone();
    b[16..24].copy_from_slice(&0u64.to_le_bytes());
    let p = write("nokv.gguf", &b);
    expect_error(
        &["info", "--model", &p],
        2,
        &["nokv.gguf", "no metadata entries"],
    );
    // block_count smaller than the layers the file holds.
    let key = b"llama.block_count";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    let mut b = bytes.clone();
    assert_eq!(
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap()),
        4,
        "u32 type"
    );
    assert_eq!(
        u32::from_le_bytes(b[at + 4..at + 8].try_into().unwrap()),
        30
    );
    b[at + 4..at + 8].copy_from_slice(&5u32.to_le_bytes());
    let p = write("blocks.gguf", &b);
    expect_error(
        &["info", "--model", &p],
        2,
        &["blocks.gguf", "block_count = 5", "blk.29"],
    );
    // A NaN scale in one weight block.
    let g = minikv_models::gguf::Gguf::open(&src).unwrap();
    let t = g.tensor("blk.3.attn_q.weight").unwrap().clone();
    drop(g);
    let mut b = bytes.clone();
    let off = t.offset + 5 * t.dtype.block_bytes();
    b[off..off + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
    let p = write("nan.gguf", &b);
    expect_error(
        &["info", "--model", &p],
        2,
        &["nan.gguf", "blk.3.attn_q.weight", "block 5", "NaN"],
    );
    std::fs::remove_dir_all(&d).ok();
}
