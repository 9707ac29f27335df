//! # minikv-test-support
//!
//! Helpers the minikv crates' tests share (a dev-dependency only; nothing
//! here is part of the library): the workspace root and its assets, the real
//! model (SmolLM2-135M-Instruct, fetched by `scripts/fetch-assets.sh`) loaded
//! once per test binary, and caches built from the default config or from
//! TOML text.
//!
//! A test binary that builds caches from config text links the component
//! crates it names (`use minikv_policies as _;`, `use minikv_quant as _;`):
//! components register themselves only in binaries that reference their
//! crate.
//!
//! ```
//! let root = minikv_test_support::root();
//! assert!(root.join("Cargo.toml").is_file());
//! // Commands run in the workspace root.
//! let ran = minikv_test_support::run_in_root("ls", &["Cargo.toml"]);
//! assert_eq!((ran.code, ran.stdout.trim()), (0, "Cargo.toml"));
//! // Each call gets a new empty folder.
//! let (a, b) = (minikv_test_support::tmp_dir("doc"), minikv_test_support::tmp_dir("doc"));
//! assert!(a != b && a.is_dir() && b.is_dir());
//! ```

use minikv_core::{CacheBuilder, CacheConfig, KvCache, RunConfig};
use minikv_models::{LanguageModel, Tokenizer};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate sits in the workspace")
        .to_path_buf()
}

/// A file under `assets/` that `scripts/fetch-assets.sh` fetches; panics
/// with the command to run when it is missing.
pub fn asset(rel: &str) -> PathBuf {
    let p = root().join("assets").join(rel);
    assert!(
        p.exists(),
        "{} missing: run scripts/fetch-assets.sh",
        p.display()
    );
    p
}

/// The default model's GGUF file (panics when it was not fetched).
pub fn smollm2_path() -> PathBuf {
    asset("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// A model under `assets/` and its tokenizer, loaded anew.
pub fn load_model(rel: &str) -> (Box<dyn LanguageModel>, Tokenizer) {
    let p = asset(rel);
    minikv_models::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The default model and its tokenizer, loaded once per test binary.
pub fn smollm2() -> (&'static dyn LanguageModel, &'static Tokenizer) {
    static M: OnceLock<(Box<dyn LanguageModel>, Tokenizer)> = OnceLock::new();
    let (m, t) = M.get_or_init(|| load_model("SmolLM2-135M-Instruct.Q4_1.gguf"));
    (m.as_ref(), t)
}

/// A preset of `configs/` by file name, loaded and resolved.
pub fn preset(name: &str) -> RunConfig {
    let p = root().join("configs").join(name);
    let mut c = RunConfig::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    c.resolve().expect("config resolves");
    c
}

/// A full (uncompressed fp16) cache for `m`.
pub fn full_cache(m: &dyn LanguageModel) -> Box<dyn KvCache> {
    CacheBuilder::new(m.spec())
        .build(&CacheConfig::default())
        .expect("the default config builds")
}

/// A cache for `m` from run-config TOML text (defaults resolved).
pub fn cache_from(m: &dyn LanguageModel, toml: &str) -> Box<dyn KvCache> {
    let mut cfg = RunConfig::parse(toml, false).expect("config parses");
    cfg.resolve().expect("config resolves");
    CacheBuilder::new(m.spec())
        .build(&cfg.cache)
        .expect("cache builds")
}

/// What a run of a binary gave.
#[derive(Debug)]
pub struct Ran {
    /// Exit code (-1 when killed by a signal).
    pub code: i32,
    /// Standard output, lossily decoded.
    pub stdout: String,
    /// Standard error, lossily decoded.
    pub stderr: String,
}

/// Runs the binary `bin` (a test's `env!("CARGO_BIN_EXE_...")`) with `args`
/// in the workspace root and waits for it.
pub fn run_in_root(bin: &str, args: &[&str]) -> Ran {
    let o = std::process::Command::new(bin)
        .args(args)
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("{bin} did not start: {e}"));
    Ran {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into(),
        stderr: String::from_utf8_lossy(&o.stderr).into(),
    }
}

/// A new empty folder under the system's temporary folder, unique to this
/// process, `tag` and call (tests run in parallel and remove their own).
pub fn tmp_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("minikv-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
    d
}

/// `text` encoded, then streamed back token by token through a
/// [`minikv_models::Detokenizer`]: (the concatenated deltas, the decode of
/// all the tokens at once). Panics if a delta holds a partial character.
pub fn streamed_and_whole(tok: &Tokenizer, text: &str) -> (String, String) {
    let ids = tok.encode(text).expect("encodes");
    let mut d = minikv_models::Detokenizer::default();
    let mut streamed = String::new();
    for &id in &ids {
        let delta = d.push(tok, id).expect("decodes");
        assert!(!delta.contains('\u{FFFD}'), "{delta:?}");
        streamed.push_str(&delta);
    }
    streamed.push_str(&d.flush(tok).expect("decodes"));
    (streamed, tok.decode(&ids).expect("decodes"))
}
