//! Serde configs: a run config holds a [`CacheConfig`], which names the
//! components (scorer, policy, selector, quantizers) by their `type`.
//!
//! Unknown fields and unknown `type` names are errors; [`CacheConfig::validate`]
//! checks ranges and combinations and names the offending field.

use crate::quant::{Axis, Quantizer};
use crate::{Error, GqaReduce, ModelSpec, Result, SelectionPolicy, Selector, TokenScorer};
use serde::{Deserialize, Serialize};
use std::path::Path;

pub use crate::components::from_type_name;

/// The layer budget policy a config with a scorer gets when it names none.
pub const DEFAULT_POLICY: &str = "uniform";
/// The selector a config with a scorer gets when it names none.
pub const DEFAULT_SELECTOR: &str = "top_k";

/// A whole run config file (`configs/*.toml`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// Seed of every random choice made under this config.
    pub seed: u64,
    /// Attention backend, by registered name: `tiled` (default), `reference`,
    /// `cuda` (registered by `minikv-kernels`).
    pub backend: String,
    /// The KV cache.
    pub cache: CacheConfig,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            backend: "tiled".into(),
            cache: CacheConfig::default(),
        }
    }
}

/// How many heads the cache stores.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeadMode {
    /// `Hkv` heads; query-head scores are reduced per GQA group (default).
    #[default]
    PerKv,
    /// `Hq` heads, K/V copied per query head, as the MiniKV and SnapKV reference
    /// code do (a reproduction preset; stores `Hq/Hkv` times more).
    PerQuery,
}

/// Low-bit storage of the kept tokens.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuantConfig {
    /// Quantizer for keys (none: keys stay fp16).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keys: Option<Box<dyn Quantizer>>,
    /// Quantizer for values (none: values stay fp16).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub values: Option<Box<dyn Quantizer>>,
    /// Full-precision residual length `R` (must be a multiple of channel-axis groups).
    pub residual: usize,
    /// When residual rows stream into the quantized part (a
    /// [`ResidualRule`](crate::residual::ResidualRule): `minikv`, the
    /// default, or `kivi`); a name or a table.
    #[serde(with = "crate::regime::name_or_table")]
    pub residual_mode: Box<dyn crate::residual::ResidualRule>,
}

impl Default for QuantConfig {
    fn default() -> Self {
        Self {
            keys: None,
            values: None,
            residual: 128,
            residual_mode: Box::new(crate::residual::MinikvResidual::default()),
        }
    }
}

/// The KV cache: which tokens are kept (selection) and how they are stored (quant).
///
/// Without `scorer` nothing is evicted; without `quant` K/V are stored as fp16:
/// the default config is the full fp16 cache of the papers.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    /// Heads stored: per KV head (default) or per query head.
    pub heads: HeadMode,
    /// Reduction of query-head scores into KV-head scores.
    pub gqa_reduce: GqaReduce,
    /// Heavy-hitter budget as a ratio of the prompt length, in `[0, 1]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heavy: Option<f64>,
    /// Heavy-hitter budget in tokens (instead of `heavy`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heavy_tokens: Option<usize>,
    /// Recent window as a ratio of the prompt length, in `[0, 1]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recent: Option<f64>,
    /// Recent window in tokens (instead of `recent`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recent_tokens: Option<usize>,
    /// Attention sinks: the first `sinks` tokens are always kept.
    pub sinks: usize,
    /// The decode regime (default `frozen`; `evict` keeps evicting down to
    /// the budget with the scorer's decode-time rule). A name
    /// (`decode = "evict"`) or a table (`decode = { type = "evict", every = 16 }`).
    #[serde(with = "crate::regime::name_or_table")]
    pub decode: Box<dyn crate::regime::DecodeRegime>,
    /// Key re-rotation (kvpress's `KeyRerotationPress`, the rotation of
    /// HF's SinkCache and FINCH): after selection, each head's kept key of
    /// prompt position `p`, the `i`-th kept, is re-rotated to position `i`,
    /// so the kept keys sit at consecutive positions; decoded tokens keep
    /// their own positions. Needs the model's RoPE.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub rerotate_keys: bool,
    /// Storage grows in pages of this many tokens per head (allocation slack
    /// is below one page per store; appending allocates once per page).
    pub page_tokens: usize,
    /// Token scorer; none means no eviction.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scorer: Option<Box<dyn TokenScorer>>,
    /// Layer budget policy (default `uniform`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<Box<dyn SelectionPolicy>>,
    /// Selector (default `top_k`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub selector: Option<Box<dyn Selector>>,
    /// Quantized storage; none means fp16.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quant: Option<QuantConfig>,
    /// Compensation for evicted tokens (e.g. `type = "reskv"`); none means
    /// they are dropped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compensator: Option<Box<dyn crate::Compensator>>,
    /// Key-channel pruning (e.g. `type = "think"`); none keeps every channel.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub channels: Option<Box<dyn crate::ChannelPruner>>,
    /// Query-aware page selection at decode (every token stored, the
    /// top-scored pages read; Quest by default); none reads every stored
    /// token. `[cache.quest]` is accepted as its first name.
    #[serde(skip_serializing_if = "Option::is_none", alias = "quest")]
    pub pages: Option<crate::pages::PagesConfig>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            heads: HeadMode::default(),
            gqa_reduce: GqaReduce::default(),
            heavy: None,
            heavy_tokens: None,
            recent: None,
            recent_tokens: None,
            sinks: 0,
            decode: Box::new(crate::regime::Frozen::default()),
            rerotate_keys: false,
            page_tokens: 256,
            scorer: None,
            policy: None,
            selector: None,
            quant: None,
            compensator: None,
            channels: None,
            pages: None,
        }
    }
}

/// Rejects NaN and infinities anywhere in a serializable config (every float
/// field of every component, including ones added later), naming the field.
pub fn check_finite_fields<T: Serialize>(prefix: &str, value: &T) -> Result<()> {
    fn walk(path: &str, v: &toml::Value) -> Result<()> {
        match v {
            toml::Value::Float(x) if !x.is_finite() => Err(Error::config(
                path,
                format!("must be a finite number, got {x}"),
            )),
            toml::Value::Table(t) => t.iter().try_for_each(|(k, v)| {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                walk(&p, v)
            }),
            toml::Value::Array(a) => a
                .iter()
                .enumerate()
                .try_for_each(|(i, v)| walk(&format!("{path}[{i}]"), v)),
            _ => Ok(()),
        }
    }
    let v = toml::Value::try_from(value).map_err(|e| Error::config(prefix, e.to_string()))?;
    walk(prefix, &v)
}

/// A budget given as a ratio of a `prompt`-token prompt, in tokens:
/// `floor(prompt x ratio)`, at least one token for a non-zero ratio of a
/// non-empty prompt (a short prompt never rounds a budget the config asked
/// for down to nothing). The one ratio-to-tokens conversion: the cache, its
/// memory projection, layer policies and `minikv budgets` use it.
pub fn ratio_tokens(prompt: usize, ratio: f64) -> usize {
    let t = (prompt as f64 * ratio).floor() as usize;
    if ratio > 0.0 && prompt > 0 {
        t.max(1)
    } else {
        t
    }
}

fn check_ratio(field: &str, v: Option<f64>, tokens: Option<usize>) -> Result<()> {
    if let Some(r) = v {
        if !(0.0..=1.0).contains(&r) || r.is_nan() {
            return Err(Error::config(
                field,
                format!("must be a ratio in [0, 1], got {r}"),
            ));
        }
        if tokens.is_some() {
            return Err(Error::config(
                field,
                format!("set either `{field}` (ratio) or `{field}_tokens`, not both"),
            ));
        }
    }
    Ok(())
}

impl CacheConfig {
    /// The heavy and recent budgets in tokens for a `prompt`-token prompt:
    /// `heavy_tokens` / `recent_tokens` when given, else `floor(prompt x ratio)`
    /// with a floor of one token for a non-zero ratio (a short prompt never
    /// rounds a budget the config asked for down to an empty cache).
    pub fn token_budgets(&self, prompt: usize) -> (usize, usize) {
        let of = |tokens: Option<usize>, ratio: Option<f64>| {
            tokens.unwrap_or_else(|| ratio_tokens(prompt, ratio.unwrap_or(0.0)))
        };
        (
            of(self.heavy_tokens, self.heavy),
            of(self.recent_tokens, self.recent),
        )
    }

    /// True when the cache neither evicts nor quantizes.
    pub fn is_full(&self) -> bool {
        self.scorer.is_none() && self.quant.is_none()
    }

    /// Fills in the default policy and selector where a scorer is set (needs the
    /// `minikv-policies` crate linked; otherwise a clear error).
    pub fn resolve(&mut self) -> Result<()> {
        if self.scorer.is_some() {
            if self.policy.is_none() {
                self.policy = Some(from_type_name("cache.policy", DEFAULT_POLICY)?);
            }
            if self.selector.is_none() {
                self.selector = Some(from_type_name("cache.selector", DEFAULT_SELECTOR)?);
            }
        }
        Ok(())
    }

    /// Checks ranges and combinations; errors name the field.
    pub fn validate(&self, spec: Option<&ModelSpec>) -> Result<()> {
        self.validate_budget()?;
        self.validate_components()?;
        self.validate_quant(spec)
    }

    /// Ranges of the token counts and ratios, and a budget that keeps a token.
    fn validate_budget(&self) -> Result<()> {
        check_finite_fields("cache", self)?;
        if !(1..=1 << 16).contains(&self.page_tokens) {
            return Err(Error::config(
                "cache.page_tokens",
                format!("must be in 1..=65536, got {}", self.page_tokens),
            ));
        }
        for (field, v) in [
            ("cache.heavy_tokens", self.heavy_tokens),
            ("cache.recent_tokens", self.recent_tokens),
            ("cache.sinks", Some(self.sinks)),
        ] {
            if v.is_some_and(|v| v > 1 << 32) {
                return Err(Error::config(
                    field,
                    format!("must be at most 4294967296 tokens, got {}", v.unwrap_or(0)),
                ));
            }
        }
        if self.scorer.is_some()
            && self.heavy.unwrap_or(0.0) == 0.0
            && self.heavy_tokens.unwrap_or(0) == 0
            && self.recent.unwrap_or(0.0) == 0.0
            && self.recent_tokens.unwrap_or(0) == 0
            && self.sinks == 0
            && (self.heavy.is_some()
                || self.heavy_tokens.is_some()
                || self.recent.is_some()
                || self.recent_tokens.is_some())
        {
            return Err(Error::config(
                "cache.heavy",
                "the budget keeps no token (heavy, recent and sinks are all 0)",
            ));
        }
        check_ratio("cache.heavy", self.heavy, self.heavy_tokens)?;
        check_ratio("cache.recent", self.recent, self.recent_tokens)?;
        Ok(())
    }

    /// The components and the combinations they support.
    fn validate_components(&self) -> Result<()> {
        let budget_set = self.heavy.is_some()
            || self.heavy_tokens.is_some()
            || self.recent.is_some()
            || self.recent_tokens.is_some()
            || self.sinks > 0;
        match &self.scorer {
            None => {
                if budget_set {
                    return Err(Error::config(
                        "cache.scorer",
                        "a token budget (heavy/recent/sinks) is set but no scorer: set cache.scorer",
                    ));
                }
                if self.policy.is_some() || self.selector.is_some() {
                    return Err(Error::config(
                        "cache.scorer",
                        "policy/selector given without a scorer",
                    ));
                }
                if self.rerotate_keys {
                    return Err(Error::config(
                        "cache.rerotate_keys",
                        "re-rotates the keys a selection kept: set cache.scorer and a budget",
                    ));
                }
            }
            Some(s) => {
                s.validate()?;
                if !budget_set {
                    return Err(Error::config(
                        "cache.heavy",
                        "a scorer is set but no budget: set heavy/recent (ratios) or heavy_tokens/recent_tokens",
                    ));
                }
                if let Some(p) = &self.policy {
                    p.validate()?;
                }
                if let Some(p) = &self.selector {
                    p.validate()?;
                }
            }
        }
        self.decode.validate(self)?;
        if let Some(r) = &self.compensator {
            r.validate()?;
            if self.scorer.is_none() {
                return Err(Error::config(
                    "cache.compensator",
                    "a compensator summarizes evicted tokens: set cache.scorer and a budget",
                ));
            }
            if self.decode.evicts() {
                return Err(Error::Unsupported(format!(
                    "cache.compensator with cache.decode = \"{}\": compensation is computed at the end of prefill only",
                    self.decode.typetag_name()
                )));
            }
        }
        if let Some(c) = &self.channels {
            c.validate()?;
        }
        if let Some(p) = &self.pages {
            p.validate()?;
            if self.quant.is_some() {
                return Err(Error::Unsupported(
                    "cache.pages with cache.quant: page selection reads full-precision keys and values only".into(),
                ));
            }
            if self.decode.evicts() {
                return Err(Error::Unsupported(format!(
                    "cache.pages with cache.decode = \"{}\": pages need every row in position order",
                    self.decode.typetag_name()
                )));
            }
        }
        Ok(())
    }

    /// The quantizers, against the model's head dimension when known.
    fn validate_quant(&self, spec: Option<&ModelSpec>) -> Result<()> {
        if let Some(q) = &self.quant {
            if q.keys.is_none() && q.values.is_none() {
                return Err(Error::config(
                    "cache.quant",
                    "set keys and/or values quantizers",
                ));
            }
            if q.residual == 0 {
                return Err(Error::config("cache.quant.residual", "must be positive"));
            }
            for (name, qz) in [("keys", &q.keys), ("values", &q.values)] {
                let Some(qz) = qz else { continue };
                let field = format!("cache.quant.{name}");
                // Head dim 0 = not known yet: only the head-dim-independent checks run.
                qz.validate(spec.map_or(0, |s| s.head_dim))
                    .map_err(|e| Error::config(&field, e.to_string()))?;
                if qz.axis() == Axis::Channel && q.residual % qz.group() != 0 {
                    return Err(Error::config(
                        "cache.quant.residual",
                        format!(
                            "R = {} is not a multiple of the {name} group size {}",
                            q.residual,
                            qz.group()
                        ),
                    ));
                }
            }
            q.residual_mode.validate(q)?;
        }
        Ok(())
    }
}

/// Deepest nesting of objects and arrays a JSON config may have.
pub const MAX_CONFIG_DEPTH: usize = 32;

/// The deepest nesting of `{`/`[` in JSON text (strings skipped).
fn json_depth(text: &str) -> usize {
    let (mut depth, mut max, mut in_str, mut esc) = (0usize, 0usize, false, false);
    for b in text.bytes() {
        if in_str {
            match (esc, b) {
                (true, _) => esc = false,
                (false, b'\\') => esc = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'{' | b'[' => {
                depth += 1;
                max = max.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

impl RunConfig {
    /// Parses TOML (`.toml`) or JSON (anything else) text. Error messages
    /// longer than 1000 characters keep their start and their end (where a
    /// parser puts the reason), with the middle cut. JSON nested deeper than
    /// [`MAX_CONFIG_DEPTH`] is refused before it is deserialized (a chain of
    /// wrapper components would otherwise exhaust the stack).
    pub fn parse(text: &str, json: bool) -> Result<Self> {
        let short = |m: String| {
            // A field that moved: say where to.
            let m = match m.contains("unknown field `evict_every`") {
                true => format!("{m} (it moved: decode = {{ type = \"evict\", every = N }})"),
                false => m,
            };
            let m = m.trim_end();
            let n = m.chars().count();
            if n > 1000 {
                let head: String = m.chars().take(500).collect();
                let tail: String = m.chars().skip(n - 400).collect();
                format!("{head} [... {} characters cut ...] {tail}", n - 900)
            } else {
                m.to_string()
            }
        };
        if json {
            let depth = json_depth(text);
            if depth > MAX_CONFIG_DEPTH {
                return Err(Error::Parse(format!(
                    "the config nests {depth} levels deep; at most {MAX_CONFIG_DEPTH} are allowed"
                )));
            }
        }
        if json {
            // Errors name the field's path (`cache.heavy_tokens: ...`).
            let mut de = serde_json::Deserializer::from_str(text);
            let cfg: Self = serde_path_to_error::deserialize(&mut de).map_err(|e| {
                let path = e.path().to_string();
                let inner = e.into_inner().to_string();
                Error::Parse(short(if path.is_empty() || path == "." {
                    inner
                } else {
                    format!("{path}: {inner}")
                }))
            })?;
            de.end().map_err(|e| Error::Parse(short(e.to_string())))?;
            Ok(cfg)
        } else {
            toml::from_str(text).map_err(|e| Error::Parse(short(e.to_string())))
        }
    }

    /// Reads, parses, resolves defaults and validates a config file.
    pub fn load(path: &Path) -> Result<Self> {
        use std::io::Read;
        const MAX: u64 = 1 << 20;
        // Read at most MAX + 1 bytes: a device or a pipe reports no length.
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let mut bytes = Vec::new();
        file.take(MAX + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| Error::io(path, e))?;
        if bytes.len() as u64 > MAX {
            return Err(Error::Parse(format!(
                "{}: more than {MAX} bytes; a config is a small text file (at most 1 MiB)",
                path.display()
            )));
        }
        let text = String::from_utf8(bytes)
            .map_err(|e| Error::Parse(format!("{}: not UTF-8 text ({e})", path.display())))?;
        let json = path.extension().is_some_and(|e| e == "json");
        let mut cfg = Self::parse(&text, json).map_err(|e| match e {
            Error::Parse(m) => Error::Parse(format!("{}: {m}", path.display())),
            e => e,
        })?;
        cfg.resolve()?;
        if let Some(dir) = path.parent() {
            if let Some(sel) = cfg.cache.selector.as_mut() {
                sel.resolve_paths(dir);
            }
            if let Some(sc) = cfg.cache.scorer.as_mut() {
                sc.resolve_paths(dir);
            }
        }
        cfg.validate(None)?;
        Ok(cfg)
    }

    /// Fills in defaults (see [`CacheConfig::resolve`]).
    pub fn resolve(&mut self) -> Result<()> {
        self.cache.resolve()
    }

    /// Validates the whole config.
    pub fn validate(&self, spec: Option<&ModelSpec>) -> Result<()> {
        crate::attention::backend_info(&self.backend)?;
        self.cache.validate(spec)
    }

    /// The resolved config as TOML.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| Error::Parse(e.to_string()))
    }
}
