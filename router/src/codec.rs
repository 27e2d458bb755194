//! The router's view of the model's text side: chat template, tokenizer and the context length.
//! [`TextCodec`] is what the HTTP layer needs; [`GgufCodec`](crate::gguf_codec::GgufCodec) implements it over `pagoda_worker::model`.

use std::borrow::Cow;

use crate::openai::{ChatRender, Turn};

/// `rendered` (a chat rendered without the generation prompt) cut just after the last occurrence of the final
/// turn's content, as vLLM's `continue_final_message` does: the template's end-of-turn after it goes, so the model
/// continues that message. An error when the template did not write the content verbatim.
pub fn cut_after_final_message(mut rendered: String, turns: &[Turn]) -> Result<String, String> {
    let content = turns.last().map(|t| t.content.as_str()).unwrap_or_default();
    if content.is_empty() {
        return Err("the final message to continue is empty".into());
    }
    let end = rendered
        .rfind(content)
        .ok_or("the chat template did not write the final message's content verbatim, so it cannot be continued")?
        + content.len();
    rendered.truncate(end);
    Ok(rendered)
}

/// Text <-> tokens for one served model.
pub trait TextCodec: Send + Sync + 'static {
    /// The model id clients send in `model`.
    fn model_id(&self) -> &str;
    /// Maximum prompt + completion tokens.
    fn context_length(&self) -> usize;
    fn vocab_size(&self) -> usize;
    /// Renders the conversation with the model's chat template: with the generation prompt appended, or cut
    /// where the final message's content ends ([`ChatRender`]).
    fn render_chat(&self, turns: &[Turn], render: ChatRender) -> Result<String, String>;
    /// Tokenizes text; `add_special` adds BOS when the model wants it. Special-token text is parsed as specials.
    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String>;
    /// The raw bytes a token stands for; empty for special/control tokens that never appear in text.
    fn token_bytes(&self, id: u32) -> Cow<'_, [u8]>;
    /// Token ids that end generation (EOS, end-of-turn).
    fn stop_token_ids(&self) -> Vec<u32>;
}
