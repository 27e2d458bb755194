//! The router's view of the model's text side: chat template, tokenizer and the context length.
//! [`TextCodec`] is what the HTTP layer needs; [`GgufCodec`] implements it over `pagoda_worker::model`.

use std::borrow::Cow;

use crate::openai::Turn;

/// Text <-> tokens for one served model.
pub trait TextCodec: Send + Sync + 'static {
    /// The model id clients send in `model`.
    fn model_id(&self) -> &str;
    /// Maximum prompt + completion tokens.
    fn context_length(&self) -> usize;
    fn vocab_size(&self) -> usize;
    /// Renders the conversation with the model's chat template and the generation prompt appended.
    fn render_chat(&self, turns: &[Turn]) -> Result<String, String>;
    /// Tokenizes text; `add_special` adds BOS when the model wants it. Special-token text is parsed as specials.
    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String>;
    /// The raw bytes a token stands for; empty for special/control tokens that never appear in text.
    fn token_bytes(&self, id: u32) -> Cow<'_, [u8]>;
    /// Token ids that end generation (EOS, end-of-turn).
    fn stop_token_ids(&self) -> Vec<u32>;
}
