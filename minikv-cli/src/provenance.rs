//! What produced a result: config, seed, model checksum, git revision.

use minikv_core::{Error, Result};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Attached to every JSON result.
#[derive(Debug, Clone, Serialize)]
pub struct Provenance {
    /// minikv version.
    pub minikv: &'static str,
    /// `git describe`-style revision of the source tree (`-dirty` if modified).
    pub git_rev: String,
    /// Model path, if a model was used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// sha256 of the model file (or of `model.safetensors`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_sha256: Option<String>,
    /// Decode matvec activations when not the exact default (`q8`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activations: Option<&'static str>,
    /// `avx2` when `MINIKV_MAX_ISA` kept minikv's 512-bit kernels out: the
    /// result says which kernels produced it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_isa: Option<&'static str>,
    /// Seed.
    pub seed: u64,
    /// Resolved config.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<serde_json::Value>,
}

/// The activations the process's model was loaded with (one model per process).
static ACTIVATIONS: std::sync::OnceLock<minikv_models::Activations> = std::sync::OnceLock::new();

/// Records the loaded model's activations for every later [`Provenance`].
pub fn set_activations(a: minikv_models::Activations) {
    let _ = ACTIVATIONS.set(a);
}

/// The source revision, recorded when the binary was built (`build.rs`):
/// running `git` at run time would touch the source tree wherever the
/// binary runs.
pub fn git_rev() -> String {
    env!("MINIKV_GIT_REV").to_string()
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let file = if path.is_dir() {
        path.join("model.safetensors")
    } else {
        path.to_path_buf()
    };
    let mut f = std::fs::File::open(&file).map_err(|e| Error::io(&file, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(&file, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

pub fn provenance(
    model: Option<&Path>,
    seed: u64,
    config: Option<serde_json::Value>,
) -> Result<Provenance> {
    Ok(Provenance {
        minikv: env!("CARGO_PKG_VERSION"),
        git_rev: git_rev(),
        model: model.map(|p| p.display().to_string()),
        model_sha256: model.map(sha256_file).transpose()?,
        activations: ACTIVATIONS
            .get()
            .copied()
            .filter(|a| *a != minikv_models::Activations::F32)
            .map(|a| a.name()),
        max_isa: match minikv_core::cpu::max_isa()? {
            minikv_core::cpu::MaxIsa::Avx2 => Some("avx2"),
            minikv_core::cpu::MaxIsa::Native => None,
        },
        seed,
        config,
    })
}

/// The kernels a timing ran on, for the benches' JSON: `avx2` when
/// `MINIKV_MAX_ISA` kept minikv's 512-bit kernels out, else `native` (the
/// cap was checked when the process started).
pub fn max_isa_name() -> &'static str {
    match minikv_core::cpu::max_isa() {
        Ok(minikv_core::cpu::MaxIsa::Avx2) => "avx2",
        _ => "native",
    }
}

/// Models `scripts/fetch-assets.sh` fetches, by the short names `--model` accepts.
pub const KNOWN_MODELS: [(&str, &str); 2] = [
    ("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf"),
];

/// Resolves `--model`: a short name of [`KNOWN_MODELS`] (found like the
/// default model), else a path.
pub fn resolve_model(arg: &Path) -> Result<PathBuf> {
    match KNOWN_MODELS.iter().find(|(n, _)| Path::new(n) == arg) {
        Some((_, file)) => find_asset_model(file),
        None => Ok(arg.to_path_buf()),
    }
}

/// The default model: `$MINIKV_MODEL`, else the fetched SmolLM2 in `$MINIKV_ASSETS`,
/// `./assets` or the source tree's `assets/`.
pub fn default_model() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("MINIKV_MODEL") {
        return resolve_model(Path::new(&p));
    }
    find_asset_model(KNOWN_MODELS[0].1)
}

fn find_asset_model(name: &str) -> Result<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Ok(a) = std::env::var("MINIKV_ASSETS") {
        dirs.push(PathBuf::from(a));
    }
    dirs.push(PathBuf::from("assets"));
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets"));
    dirs.iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            Error::Input(format!(
                "{name} not found in {dirs:?}: run scripts/fetch-assets.sh"
            ))
        })
}

/// The assets folder (for texts).
pub fn assets_dir() -> PathBuf {
    if let Ok(a) = std::env::var("MINIKV_ASSETS") {
        return PathBuf::from(a);
    }
    let local = PathBuf::from("assets");
    if local.is_dir() {
        local
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets")
    }
}
