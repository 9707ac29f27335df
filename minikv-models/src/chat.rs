//! Chat templates: the model's own Jinja template (GGUF
//! `tokenizer.chat_template`, or a Hugging Face `tokenizer_config.json`),
//! rendered with `minijinja` as Hugging Face's `apply_chat_template` does:
//! `messages`, `add_generation_prompt`, `bos_token` and `eos_token` in the
//! context, blocks trimmed, Python string methods (`strip`, `startswith`,
//! ...) and `raise_exception` available.

use minikv_core::{Error, Result};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (whatever the template knows).
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message of `role` saying `content`.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<minijinja::Environment<'static>>,
    source: Arc<str>,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_chars", &self.source.len())
            .finish()
    }
}

fn raise_exception(msg: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        msg,
    ))
}

impl ChatTemplate {
    /// Compiles `source`; `bos` and `eos` are the special tokens' texts the
    /// template may name.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| Error::Format(format!("chat template: {e}")))?;
        Ok(Self {
            env: Arc::new(env),
            source: source.into(),
            bos: bos.into(),
            eos: eos.into(),
        })
    }

    /// The template's source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prompt for `messages`; with `add_generation_prompt`, it ends with
    /// the header of the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        if messages.is_empty() {
            return Err(Error::Input("a chat needs at least one message".into()));
        }
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| Error::Format(format!("chat template: {e}")))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })
        .map_err(|e| {
            // The template's own `raise_exception` message is the reason.
            let detail = e
                .detail()
                .map(str::to_owned)
                .unwrap_or_else(|| e.to_string());
            Error::Input(format!("chat template: {detail}"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's template, as its GGUF carries it.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_with_default_system_prompt() {
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        let s = t
            .render(&[ChatMessage::new("user", "Hi there")], true)
            .unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        );
        // A system message replaces the default; no generation prompt.
        let s = t
            .render(
                &[
                    ChatMessage::new("system", "Be brief."),
                    ChatMessage::new("user", "Hi"),
                    ChatMessage::new("assistant", "Hello."),
                ],
                false,
            )
            .unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        );
    }

    #[test]
    fn gemma_style_template_with_python_methods_and_exceptions() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools: ' + m['role']) }}{% endif %}\
{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}\
{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";
        let t = ChatTemplate::new(src, "<bos>", "<eos>").unwrap();
        let s = t
            .render(&[ChatMessage::new("user", "  Why?  ")], true)
            .unwrap();
        assert_eq!(
            s,
            "<bos><start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n"
        );
        let e = t
            .render(&[ChatMessage::new("tool", "x")], true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no tools: tool"), "{e}");
        let py = ChatTemplate::new("{{ messages[0]['content'].strip().upper() }}", "", "").unwrap();
        assert_eq!(
            py.render(&[ChatMessage::new("user", " a ")], false)
                .unwrap(),
            "A"
        );
    }

    #[test]
    fn bad_templates_and_empty_chats_are_errors() {
        let e = ChatTemplate::new("{% for %}", "", "")
            .unwrap_err()
            .to_string();
        assert!(e.contains("chat template"), "{e}");
        let t = ChatTemplate::new(SMOLLM2, "", "").unwrap();
        assert!(
            t.render(&[], true)
                .unwrap_err()
                .to_string()
                .contains("at least one message")
        );
    }
}
