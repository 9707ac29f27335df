//! Command implementations, one module per command family; the helpers
//! every command shares (model and config loading, texts, JSON output) are
//! here.

use crate::ModelArg;
use crate::provenance::{assets_dir, default_model};
use minikv_core::files::{MIB, read_text_bounded};
use minikv_core::{CacheBuilder, Error, KvCache, MemoryReport, Result, RunConfig};
use minikv_models::{LanguageModel, Tokenizer};
use serde_json::json;
use std::path::{Path, PathBuf};

mod calibrate;
mod eval;
mod generate;
mod inspect;
mod perplexity;

pub use calibrate::*;
pub use eval::*;
pub use generate::*;
pub use inspect::*;
pub use perplexity::*;

fn print_json(v: &serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(v).expect("json"));
}

pub fn load_config(path: Option<&Path>) -> Result<RunConfig> {
    match path {
        Some(p) => RunConfig::load(p),
        None => Ok(RunConfig::default()),
    }
}

pub struct Loaded {
    pub model: Box<dyn LanguageModel>,
    pub tok: Tokenizer,
    pub path: PathBuf,
    sha: std::sync::OnceLock<String>,
}

impl Loaded {
    /// The model file's sha256 (computed once).
    pub fn sha256(&self) -> Result<String> {
        if let Some(s) = self.sha.get() {
            return Ok(s.clone());
        }
        let s = crate::provenance::sha256_file(&self.path)?;
        Ok(self.sha.get_or_init(|| s).clone())
    }
}

pub fn load_model(m: &ModelArg) -> Result<Loaded> {
    let path = match &m.model {
        Some(p) => crate::provenance::resolve_model(p)?,
        None => default_model()?,
    };
    let (mut model, tok) = minikv_models::load(&path)?;
    // Building the tokenizer allocates far more than it keeps (Gemma 3's
    // 262,144 pieces: every split of every piece as a pair of strings, about
    // 118 MB at the peak); glibc keeps the freed small blocks mapped, so a
    // run would carry them for its whole life. Hand them back once, here.
    // Measured on Gemma 3 270M during `generate` (docs/performance.md):
    // 128.8 MB of anonymous memory before, 89.4-89.8 MB after.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only returns free heap pages to the system; no
    // live allocation moves.
    unsafe {
        libc::malloc_trim(0);
    }
    model.set_activations(m.activations);
    crate::provenance::set_activations(m.activations);
    Ok(Loaded {
        model,
        tok,
        path,
        sha: Default::default(),
    })
}

pub fn build_cache(model: &dyn LanguageModel, cfg: &RunConfig) -> Result<Box<dyn KvCache>> {
    CacheBuilder::new(model.spec())
        .named_backend(&cfg.backend)?
        .build(&cfg.cache)
}

pub fn memory_json(m: &MemoryReport) -> serde_json::Value {
    let mut v = memory_json_all(m);
    // Models with sliding-window layers: both kinds apart.
    if m.layers.iter().any(|l| l.window.is_some()) {
        let bytes = |windowed: bool| -> usize {
            m.layers
                .iter()
                .filter(|l| l.window.is_some() == windowed)
                .flat_map(|l| &l.heads)
                .map(|h| h.used)
                .sum()
        };
        v["window_layers_kv_bytes"] = json!(bytes(true));
        v["global_layers_kv_bytes"] = json!(bytes(false));
        v["layer_windows"] = json!(m.layers.iter().map(|l| l.window).collect::<Vec<_>>());
    }
    v
}

fn memory_json_all(m: &MemoryReport) -> serde_json::Value {
    json!({
        "kv_bytes": m.used_bytes(),
        "kv_bytes_allocated": m.total_bytes(),
        "full_fp16_bytes": m.full_fp16_bytes,
        "compression_ratio": m.used_bytes() as f64 / m.full_fp16_bytes.max(1) as f64,
        "allocated_ratio": m.ratio(),
        "work": m.work + m.layers.iter().map(|l| l.work).sum::<usize>(),
        "tokens_seen": m.seq_len,
        "quant_codes": m.sum(|h| h.quant_codes),
        "quant_scales": m.sum(|h| h.quant_scales),
        "fp16": m.sum(|h| h.fp),
        "clusters": m.sum(|h| h.clusters),
        "indices": m.sum(|h| h.indices),
        "per_layer_tokens": m.layers.iter().map(|l| l.heads.iter().map(|h| h.tokens).sum::<usize>()).collect::<Vec<_>>(),
        "per_layer_bytes": m.layers.iter().map(|l| l.staging + l.heads.iter().map(|h| h.total()).sum::<usize>()).collect::<Vec<_>>(),
    })
}

/// Reads a text file, or the `.txt` files of a directory in name order.
pub fn read_text(p: &Path) -> Result<String> {
    if p.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(p)
            .map_err(|e| Error::io(p, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|f| f.extension().is_some_and(|x| x == "txt"))
            .collect();
        files.sort();
        let mut s = String::new();
        for f in files {
            s.push_str(&read_text_bounded(&f, TEXT_MAX, "a text")?);
            s.push('\n');
        }
        if s.is_empty() {
            return Err(Error::Input(format!("{}: no .txt files", p.display())));
        }
        return Ok(s);
    }
    read_text_bounded(p, TEXT_MAX, "a text")
}

/// The largest text file read (per file of a directory).
const TEXT_MAX: u64 = 256 * MIB;

/// The first `n` tokens of a text, or an error saying how many it has.
pub fn first_tokens(tok: &Tokenizer, text: &str, n: usize, what: &Path) -> Result<Vec<u32>> {
    let ids = tok.encode(text)?;
    if ids.len() < n {
        return Err(Error::Input(format!(
            "{} has {} tokens, fewer than the {n} requested",
            what.display(),
            ids.len()
        )));
    }
    Ok(ids[..n].to_vec())
}

/// Prompts for load generators (`bench throughput`, `bench serve`): a
/// text's tokens, from which request `i` reads its own stretch.
pub struct PromptSource {
    ids: Vec<u32>,
}

impl PromptSource {
    /// Tokenizes `path` (a text file or a directory of them; default
    /// [`default_text`]); an empty text is an error.
    pub fn load(tok: &minikv_models::Tokenizer, path: Option<&Path>) -> Result<Self> {
        let path = path.map_or_else(default_text, Path::to_path_buf);
        let ids = tok.encode(&read_text(&path)?)?;
        if ids.is_empty() {
            return Err(Error::Input(format!("{}: no tokens", path.display())));
        }
        Ok(Self { ids })
    }

    /// Request `i`'s prompt of `len` tokens: the text from offset
    /// `997 i` (a prime stride, so requests start at different places),
    /// cycled when the text is shorter.
    pub fn prompt(&self, i: usize, len: usize) -> Vec<u32> {
        let off = (i * 997) % self.ids.len();
        self.ids
            .iter()
            .copied()
            .cycle()
            .skip(off)
            .take(len)
            .collect()
    }
}

pub fn default_text() -> PathBuf {
    assets_dir().join("paul_graham")
}
