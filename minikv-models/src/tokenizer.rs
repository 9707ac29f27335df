//! Tokenizer built in memory from GGUF metadata with the `tokenizers` crate
//! (or loaded from a `tokenizer.json`), plus the chat template.
//!
//! * `gpt2` (SmolLM2): byte-level BPE from the file's vocabulary and merges.
//! * `llama` (SentencePiece-style, Gemma 3): the file has pieces with scores
//!   and no merges. The SentencePiece BPE rule (repeatedly merge the adjacent
//!   pair whose concatenation is the highest-scoring piece, leftmost first)
//!   is expressed as BPE merges: every split of every piece into two pieces,
//!   ranked by the merged piece's score. Spaces become `▁` (no space prefix
//!   unless `tokenizer.ggml.add_space_prefix`), characters outside the
//!   vocabulary fall back to `<0xXX>` byte pieces, and user-defined pieces
//!   (newline and space runs, HTML tags) are matched in the raw text first,
//!   as llama.cpp does.

use crate::chat::{ChatMessage, ChatTemplate};
use crate::gguf::{Gguf, Value};
use minikv_core::{Error, Result};
use std::path::Path;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper};

/// A tokenizer with its special tokens and chat format.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Prepend BOS when encoding (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    /// Beginning-of-sequence id.
    pub bos: Option<u32>,
    /// End-of-sequence / end-of-turn ids (generation stops on them).
    pub stop: Vec<u32>,
    /// The chat template (`Err`: the model's template does not compile, why).
    chat: Option<std::result::Result<ChatTemplate, String>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.vocab_size())
            .field("add_bos", &self.add_bos)
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Format(format!("tokenizer: {e}"))
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata (`gpt2` byte-level
    /// BPE or `llama` SentencePiece-style pieces with scores).
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" && model != "llama" {
            return Err(Error::Format(format!(
                "tokenizer.ggml.model = `{model}`: supported are gpt2 (byte-level BPE) and llama (SentencePiece-style)"
            )));
        }
        let tokens = strings(g, "tokenizer.ggml.tokens")?;
        let types: Vec<i64> = match g.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::I64(x) => *x,
                    Value::U64(x) => *x as i64,
                    _ => 1,
                })
                .collect(),
            _ => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(Error::Format(format!(
                "tokenizer: {} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let inner = if model == "llama" {
            spm_tokenizer(g, &tokens, &types)?
        } else {
            gpt2_tokenizer(g, &tokens, &types)?
        };
        let bos = g
            .metadata
            .get("tokenizer.ggml.bos_token_id")
            .and_then(|v| v.as_u64())
            .map(|v| v as u32);
        let mut stop: Vec<u32> = g
            .metadata
            .get("tokenizer.ggml.eos_token_id")
            .and_then(|v| v.as_u64())
            .map(|v| v as u32)
            .into_iter()
            .collect();
        for name in ["<|im_end|>", "<|endoftext|>", "<end_of_turn>"] {
            if let Some(id) = vocab_lookup(&tokens, name)
                && !stop.contains(&id)
            {
                stop.push(id);
            }
        }
        let add_bos = matches!(
            g.metadata.get("tokenizer.ggml.add_bos_token"),
            Some(Value::Bool(true))
        );
        let text_of = |id: Option<u32>| {
            id.and_then(|i| tokens.get(i as usize))
                .cloned()
                .unwrap_or_default()
        };
        let eos = g
            .metadata
            .get("tokenizer.ggml.eos_token_id")
            .and_then(|v| v.as_u64())
            .map(|v| v as u32);
        let chat = g
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .map(|t| ChatTemplate::new(t, &text_of(bos), &text_of(eos)).map_err(|e| e.to_string()));
        Ok(Self {
            inner,
            add_bos,
            bos,
            stop,
            chat,
        })
    }

    /// Loads a Hugging Face `tokenizer.json` (with `tokenizer_config.json` beside it, if any).
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::Format(format!("{}: {e}", path.display())))?;
        let id = |s: &str| inner.token_to_id(s);
        let stop: Vec<u32> = ["<|im_end|>", "<|endoftext|>", "</s>"]
            .iter()
            .filter_map(|s| id(s))
            .collect();
        let cfg = path.with_file_name("tokenizer_config.json");
        let mut chat = None;
        let mut add_bos = false;
        if let Ok(text) = std::fs::read_to_string(&cfg) {
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::Format(format!("{}: {e}", cfg.display())))?;
            let special = |k: &str| match v.get(k) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(o) => o
                    .get("content")
                    .and_then(|c| c.as_str())
                    .unwrap_or_default()
                    .to_owned(),
                None => String::new(),
            };
            if let Some(t) = v.get("chat_template").and_then(|t| t.as_str()) {
                chat = Some(
                    ChatTemplate::new(t, &special("bos_token"), &special("eos_token"))
                        .map_err(|e| e.to_string()),
                );
            }
            add_bos = v
                .get("add_bos_token")
                .and_then(|b| b.as_bool())
                .unwrap_or(false);
        }
        Ok(Self {
            bos: id("<|im_start|>").or(id("<s>")),
            inner,
            add_bos,
            stop,
            chat,
        })
    }

    /// Saves as `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.inner.save(path, false).map_err(tok_err)
    }

    /// Vocabulary size (with special tokens).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Text -> ids (special tokens in the text are parsed as such).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(tok_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Ids -> text.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(tok_err)
    }

    /// The instruct prompt for one user message (the model's chat template
    /// with its default system prompt, if any), ending with the assistant
    /// turn's header.
    pub fn chat_prompt(&self, user: &str) -> Result<String> {
        self.render_chat(&[ChatMessage::new("user", user)])
    }

    /// The prompt for a conversation through the model's chat template,
    /// ending with the assistant turn's header.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        match &self.chat {
            Some(Ok(t)) => t.render(messages, true),
            Some(Err(e)) => Err(Error::Format(format!("the model's {e}"))),
            None => Err(Error::Input(
                "the model has no chat template (give one, e.g. `--chat-template FILE`)".into(),
            )),
        }
    }

    /// Replaces the chat template (Jinja source, as Hugging Face writes them).
    pub fn set_chat_template(&mut self, source: &str) -> Result<()> {
        let text = |id: Option<u32>| {
            id.and_then(|i| self.inner.id_to_token(i))
                .unwrap_or_default()
        };
        let t = ChatTemplate::new(source, &text(self.bos), &text(self.stop.first().copied()))?;
        self.chat = Some(Ok(t));
        Ok(())
    }

    /// Whether a chat template is there (and compiles).
    pub fn has_chat_template(&self) -> bool {
        matches!(self.chat, Some(Ok(_)))
    }

    /// The text of one token (special tokens included), for logprob reports.
    pub fn token_text(&self, id: u32) -> String {
        self.inner.decode(&[id], false).unwrap_or_default()
    }
}

fn vocab_lookup(tokens: &[String], s: &str) -> Option<u32> {
    tokens.iter().position(|t| t == s).map(|i| i as u32)
}

fn strings(g: &Gguf, key: &str) -> Result<Vec<String>> {
    match g.get(key)? {
        Value::Array(a) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| Error::Format(format!("`{key}` holds a non-string")))
            })
            .collect(),
        _ => Err(Error::Format(format!("`{key}` is not an array"))),
    }
}

/// GPT-2 byte-level BPE from the file's vocabulary and merges.
fn gpt2_tokenizer(g: &Gguf, tokens: &[String], types: &[i64]) -> Result<tokenizers::Tokenizer> {
    let merges_raw = strings(g, "tokenizer.ggml.merges")?;
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = merges_raw
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| Error::Format(format!("bad merge `{m}`")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(tok_err)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let pre = g
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let byte_level = ByteLevel::new(false, true, true);
    let pt: PreTokenizerWrapper = match pre {
        // SmolLM / StarCoder-style: every digit on its own, then the GPT-2 regex.
        "smollm" | "starcoder" | "default" | "gpt2" => {
            Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
        }
        other => {
            return Err(Error::Format(format!(
                "tokenizer.ggml.pre = `{other}` is not supported (smollm, starcoder, gpt2)"
            )));
        }
    };
    inner.with_pre_tokenizer(Some(pt));
    inner.with_decoder(Some(ByteLevel::default()));
    let specials: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, t)| **t == 3 || **t == 4)
        .map(|(s, _)| AddedToken::from(s.clone(), true))
        .collect();
    inner.add_special_tokens(specials).map_err(tok_err)?;
    Ok(inner)
}

/// SentencePiece-style pieces with scores as a BPE with byte fallback.
fn spm_tokenizer(g: &Gguf, tokens: &[String], types: &[i64]) -> Result<tokenizers::Tokenizer> {
    let scores: Vec<f64> = match g.get("tokenizer.ggml.scores")? {
        Value::Array(a) => a
            .iter()
            .map(|v| {
                v.as_f64().ok_or_else(|| {
                    Error::Format("`tokenizer.ggml.scores` holds a non-number".into())
                })
            })
            .collect::<Result<_>>()?,
        _ => {
            return Err(Error::Format(
                "`tokenizer.ggml.scores` is not an array".into(),
            ));
        }
    };
    if scores.len() != tokens.len() {
        return Err(Error::Format(format!(
            "tokenizer: {} scores for {} tokens",
            scores.len(),
            tokens.len()
        )));
    }
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    if vocab.len() != tokens.len() {
        return Err(Error::Format("tokenizer: duplicate pieces".into()));
    }
    for b in 0..=255u8 {
        if !vocab.contains_key(format!("<0x{b:02X}>").as_str()) {
            return Err(Error::Format(format!(
                "tokenizer: byte piece <0x{b:02X}> is missing (needed for byte fallback)"
            )));
        }
    }
    // Every split of every piece into two pieces, ranked by the merged
    // piece's score (highest first), then by its id.
    let mut ranked: Vec<(f64, u32, usize)> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        for (cut, _) in t.char_indices().skip(1) {
            if vocab.contains_key(&t[..cut]) && vocab.contains_key(&t[cut..]) {
                ranked.push((scores[i], i as u32, cut));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Vec<(String, String)> = ranked
        .iter()
        .map(|&(_, i, cut)| {
            let t = &tokens[i as usize];
            (t[..cut].to_owned(), t[cut..].to_owned())
        })
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .build()
        .map_err(tok_err)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let space_prefix = matches!(
        g.metadata.get("tokenizer.ggml.add_space_prefix"),
        Some(Value::Bool(true))
    );
    let replace = Replace::new(" ", "\u{2581}").map_err(tok_err)?;
    if space_prefix {
        inner
            .with_normalizer(Some(NormalizerWrapper::Sequence(
                tokenizers::normalizers::Sequence::new(vec![
                    tokenizers::normalizers::Prepend::new("\u{2581}".into()).into(),
                    replace.into(),
                ]),
            )))
            .map_err(tok_err)?;
    } else {
        inner.with_normalizer(Some(replace)).map_err(tok_err)?;
    }
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new("\u{2581}", " ").map_err(tok_err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if space_prefix {
        decoders.push(tokenizers::decoders::strip::Strip::new(' ', 1, 0).into());
    }
    inner.with_decoder(Some(tokenizers::decoders::sequence::Sequence::new(
        decoders,
    )));
    // Control pieces are special; user-defined pieces (newline and space
    // runs, tags) are plain text matched before the model on the raw text.
    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, t)| **t == 3 || **t == 4)
        .map(|(s, t)| AddedToken::from(s.clone(), *t == 3).normalized(false))
        .collect();
    inner.add_special_tokens(added).map_err(tok_err)?;
    Ok(inner)
}
