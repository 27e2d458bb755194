//! [`GgufCodec`]: the [`TextCodec`] of a GGUF model, built from its metadata with `pagoda_worker::model`
//! (byte-level BPE tokenizer, minijinja chat template, context length).

use std::borrow::Cow;
use std::path::Path;

use pagoda_worker::model::{ChatMessage, ChatTemplate, Gguf, ModelConfig, Tokenizer};

use crate::codec::{TextCodec, cut_after_final_message};
use crate::openai::{ChatRender, Turn};

/// The model id a GGUF is served under: its file stem (the worker's engine uses the same).
pub fn model_id_for(path: &Path) -> String {
    path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".to_string())
}

/// Tokenizer + chat template + context length of one GGUF model.
pub struct GgufCodec {
    model_id: String,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    context_length: usize,
    stop_ids: Vec<u32>,
}

impl GgufCodec {
    /// Reads the metadata of the GGUF at `path` (tensor data is not touched).
    pub fn load(path: &Path) -> Result<GgufCodec, String> {
        let err = |what: &str, e: &dyn std::fmt::Display| format!("{}: {what}: {e}", path.display());
        let g = Gguf::open(path).map_err(|e| err("cannot open GGUF", &e))?;
        let config = ModelConfig::from_gguf(&g).map_err(|e| err("model config", &e))?;
        let tokenizer = Tokenizer::from_gguf(&g).map_err(|e| err("tokenizer", &e))?;
        let template = ChatTemplate::from_gguf(&g).map_err(|e| err("chat template", &e))?;
        let stop_ids = tokenizer.eos_token_ids().to_vec();
        Ok(GgufCodec { model_id: model_id_for(path), tokenizer, template, context_length: config.ctx_len, stop_ids })
    }

    /// Serves the model under another id.
    pub fn with_model_id(mut self, id: impl Into<String>) -> GgufCodec {
        self.model_id = id.into();
        self
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
}

impl TextCodec for GgufCodec {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn context_length(&self) -> usize {
        self.context_length
    }

    fn vocab_size(&self) -> usize {
        self.tokenizer.vocab_size()
    }

    fn render_chat(&self, turns: &[Turn], render: ChatRender) -> Result<String, String> {
        let messages: Vec<ChatMessage> = turns.iter().map(|t| ChatMessage::new(t.role, t.content.clone())).collect();
        let text = self.template.render(&messages, render.add_generation_prompt).map_err(|e| e.to_string())?;
        if render.continue_final_message { cut_after_final_message(text, turns) } else { Ok(text) }
    }

    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String> {
        // A template that writes BOS itself must not get a second one from the tokenizer.
        let bos = self.template.bos_token();
        let template_wrote_bos = !bos.is_empty() && text.starts_with(bos);
        let add = add_special && !template_wrote_bos;
        Ok(self.tokenizer.encode(text, add))
    }

    fn token_bytes(&self, id: u32) -> Cow<'_, [u8]> {
        if self.tokenizer.is_special(id) {
            return Cow::Borrowed(&[]);
        }
        Cow::Borrowed(self.tokenizer.token_bytes(id).unwrap_or_default())
    }

    fn stop_token_ids(&self) -> Vec<u32> {
        self.stop_ids.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real model's codec, or `None` (with a note) when the model is not fetched.
    fn smollm2_codec() -> Option<GgufCodec> {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        if !p.exists() {
            eprintln!("skipping: model not fetched (scripts/fetch-model.sh)");
            return None;
        }
        Some(GgufCodec::load(&p).unwrap())
    }

    #[test]
    fn smollm2_chat_round_trip() {
        let Some(c) = smollm2_codec() else { return };
        assert_eq!(c.model_id(), "SmolLM2-135M-Instruct.Q4_1");
        assert_eq!(c.context_length(), 8192);
        assert_eq!(c.vocab_size(), 49152);
        let question = Turn { role: "user", content: "What is the capital of France?".into() };
        let text = c.render_chat(std::slice::from_ref(&question), ChatRender::default()).unwrap();
        assert!(text.contains("<|im_start|>user\nWhat is the capital of France?<|im_end|>"), "{text}");
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text:?}");
        // Without the generation prompt the chat ends with the user's turn; continuing an assistant message
        // ends the prompt where its content does.
        let plain = ChatRender { add_generation_prompt: false, continue_final_message: false };
        assert!(c.render_chat(std::slice::from_ref(&question), plain).unwrap().ends_with("France?<|im_end|>\n"));
        let turns = [question, Turn { role: "assistant", content: "The capital is".into() }];
        let cont = ChatRender { add_generation_prompt: false, continue_final_message: true };
        let text = c.render_chat(&turns, cont).unwrap();
        assert!(text.ends_with("<|im_start|>assistant\nThe capital is"), "{text:?}");
        let ids = c.encode(&text, true).unwrap();
        // Special tokens are single ids and decode to nothing; the rest decodes back to the text.
        let im_start = c.tokenizer().token_to_id("<|im_start|>").unwrap();
        assert!(ids.contains(&im_start));
        assert!(c.token_bytes(im_start).is_empty());
        assert!(!c.stop_token_ids().is_empty());
        let mut d = crate::detok::Utf8Decoder::new();
        let mut out = String::new();
        for &id in &c.encode("héllo 🦀 wörld", false).unwrap() {
            out.push_str(&d.push(&c.token_bytes(id)));
        }
        out.push_str(&d.finish());
        assert_eq!(out, "héllo 🦀 wörld");
    }

    /// README, "Chat": text that spells a special token inside a message becomes that token, as in vLLM (whose
    /// chat templates render to text that is then encoded with special tokens recognised).
    #[test]
    fn special_token_text_in_a_message_is_the_special_token() {
        let Some(c) = smollm2_codec() else { return };
        let im_end = c.tokenizer().token_to_id("<|im_end|>").unwrap();
        let count = |content: &str| {
            let turn = Turn { role: "user", content: content.into() };
            let text = c.render_chat(std::slice::from_ref(&turn), ChatRender::default()).unwrap();
            c.encode(&text, true).unwrap().iter().filter(|&&id| id == im_end).count()
        };
        // The template's own ends of turn (its default system turn's and the user's), then one more for the
        // message's spelled-out token.
        let plain = count("hello");
        assert!(plain >= 1);
        assert_eq!(count("hello<|im_end|>"), plain + 1, "the message's spelled-out token is the special id");
        // Text that only resembles a special token stays ordinary text.
        assert_eq!(count("hello<|im_end"), plain);
    }
}
