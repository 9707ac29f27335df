//! The one error type of minikv.

use std::path::PathBuf;

/// Every fallible operation in minikv returns this error.
///
/// Variants are structured so that callers (and the CLI) can say exactly what was
/// wrong: which config field, which shape, which backend.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Two tensors or a tensor and a spec disagree on a dimension.
    #[error("shape mismatch in {what}: expected {expected}, got {got}")]
    Shape {
        /// Where the mismatch was found.
        what: String,
        /// The expected shape or length.
        expected: String,
        /// The shape or length that was given.
        got: String,
    },
    /// A token budget cannot be met or is inconsistent.
    #[error("invalid budget: {0}")]
    Budget(String),
    /// A config field is missing, unknown or out of range.
    #[error("config field `{field}`: {reason}")]
    Config {
        /// Dotted path of the field (`cache.quant.keys.bits`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The config could not be parsed at all (syntax, unknown `type`, unknown field).
    #[error("config: {0}")]
    Parse(String),
    /// Components that each work but cannot be combined.
    #[error("unsupported combination: {0}")]
    Unsupported(String),
    /// Reading or writing a file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// An attention or storage backend failed or is not available.
    #[error("backend `{backend}`: {reason}")]
    Backend {
        /// Backend name.
        backend: String,
        /// What went wrong.
        reason: String,
    },
    /// A model file is malformed or unsupported.
    #[error("model format: {0}")]
    Format(String),
    /// Bad numeric or user input (NaN, infinity, empty data, ...).
    #[error("invalid input: {0}")]
    Input(String),
    /// A sequence longer than the model (or cache) allows.
    #[error("sequence of {len} tokens exceeds the maximum of {max} tokens")]
    ContextOverflow {
        /// Requested length.
        len: usize,
        /// Maximum allowed.
        max: usize,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A [`Error::Config`] for `field`.
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Config {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// A [`Error::Shape`].
    pub fn shape(what: impl Into<String>, expected: impl ToString, got: impl ToString) -> Self {
        Error::Shape {
            what: what.into(),
            expected: expected.to_string(),
            got: got.to_string(),
        }
    }

    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

/// Returns an error if `len != expected`.
pub fn check_len(what: &str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(Error::shape(what, expected, got));
    }
    Ok(())
}

/// Returns [`Error::Config`] naming `field` unless `lo <= v <= hi` (for a
/// component parameter: `check_range("cache.scorer.window", w, 1, 65536)`).
/// Works for token counts and ratios alike; NaN is out of every range.
pub fn check_range<T>(field: &str, v: T, lo: T, hi: T) -> Result<()>
where
    T: PartialOrd + std::fmt::Display + Copy,
{
    if !(lo <= v && v <= hi) {
        return Err(Error::config(
            field,
            format!("must be in [{lo}, {hi}], got {v}"),
        ));
    }
    Ok(())
}

/// Returns [`Error::Input`] if any value is NaN or infinite.
pub fn check_finite(what: &str, xs: &[f32]) -> Result<()> {
    if let Some(i) = xs.iter().position(|x| !x.is_finite()) {
        return Err(Error::Input(format!(
            "{what}: element {i} is {} (inputs must be finite)",
            xs[i]
        )));
    }
    Ok(())
}
