//! From generated tokens to text, incrementally: a token's text may depend on
//! its neighbours, and a character may span tokens.

use crate::Tokenizer;
use minikv_core::Result;

/// Turns tokens into text deltas whose concatenation is the decode of all
/// tokens: each delta is the decode of a window of recent tokens minus the
/// decode of the window without the newest ones, released once it does not
/// end in a partial character (U+FFFD). A token costs the decode of that
/// window, not of everything generated before it.
///
/// ```no_run
/// # fn main() -> minikv_core::Result<()> {
/// let (_, tok) = minikv_models::load(std::path::Path::new("assets/SmolLM2-135M-Instruct.Q4_1.gguf"))?;
/// let mut d = minikv_models::Detokenizer::default();
/// let mut text = String::new();
/// for id in tok.encode("Hello, world")? {
///     text.push_str(&d.push(&tok, id)?);
/// }
/// text.push_str(&d.flush(&tok)?);
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Detokenizer {
    /// Adds a token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let prev = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        if now.len() > prev.len() && !now.ends_with('\u{FFFD}') {
            let delta = after(&prev, &now);
            self.prefix = self.read;
            self.read = self.ids.len();
            return Ok(delta);
        }
        Ok(String::new())
    }

    /// The text still held back (a trailing partial character), at the end.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let prev = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(after(&prev, &now))
    }
}

/// What `now` adds to `prev`: the rest of `now` after `prev`, or after as
/// many characters when the decode of the longer window rewrote them.
fn after(prev: &str, now: &str) -> String {
    match now.strip_prefix(prev) {
        Some(d) => d.to_owned(),
        None => now.chars().skip(prev.chars().count()).collect(),
    }
}
