//! Tokenizer built from GGUF metadata: a Hugging Face `tokenizers::Tokenizer` (byte-level BPE for
//! `tokenizer.ggml.model = gpt2`) with the vocabulary, merges, control tokens as special added tokens, the
//! pre-tokenizer chosen by `tokenizer.ggml.pre`, and a ByteLevel decoder. Also per-token raw bytes for incremental
//! detokenisation, and the end-of-generation id set.

use std::collections::HashMap;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::error::ModelError;
use super::gguf::Gguf;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-2's byte ↔ printable-char table (`bytes_to_unicode`): the alphabet byte-level BPE vocabularies are spelled in.
fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u32 {
        let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        // Every value here is < 0x200, a valid scalar.
        table[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    table
}

/// A tokenizer built from a GGUF file's metadata.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Raw bytes each token stands for (byte-level alphabet undone; special tokens: their text).
    token_bytes: Vec<Vec<u8>>,
    special: Vec<bool>,
    /// Token id of each single byte where the vocabulary has one (byte-level vocabularies may lack a few control
    /// bytes; BPE drops those too), used as a fallback encoding.
    byte_tokens: [Option<u32>; 256],
    bos: Option<u32>,
    eos: Option<u32>,
    pad: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    pre: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.token_bytes.len())
            .field("pre", &self.pre)
            .field("bos", &self.bos)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

/// The pre-tokenizer for a `tokenizer.ggml.pre` value, matching the Hugging Face `tokenizer.json` of that family.
fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper, ModelError> {
    let byte_level_regex = || PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true));
    let split_then_bytes = |regex: &str| -> Result<PreTokenizerWrapper, ModelError> {
        let split = Split::new(SplitPattern::Regex(regex.to_string()), SplitDelimiterBehavior::Isolated, false)
            .map_err(tok_err)?;
        Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Split(split),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
        ])))
    };
    match pre {
        // SmolLM / SmolLM2 (and StarCoder-style vocabularies): every digit on its own, then GPT-2's regex.
        "smollm" | "starcoder" | "refact" => Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level_regex(),
        ]))),
        "default" | "gpt2" | "gpt-2" => Ok(byte_level_regex()),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "smaug-bpe" | "dbrx" => split_then_bytes(LLAMA3_SPLIT),
        "qwen2" | "deepseek-r1-qwen" => split_then_bytes(QWEN2_SPLIT),
        other => Err(ModelError::Unsupported(format!("tokenizer.ggml.pre = {other:?}"))),
    }
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata. Only byte-level BPE (`gpt2`) vocabularies are supported.
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer, ModelError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(ModelError::Unsupported(format!("tokenizer.ggml.model = {model:?} (only gpt2 BPE)")));
        }
        let pre = g.get_str_opt("tokenizer.ggml.pre")?.unwrap_or("default").to_string();
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let merges_raw = g.get_str_array("tokenizer.ggml.merges")?;
        let n = tokens.len();
        if n == 0 || n > u32::MAX as usize {
            return Err(ModelError::bad_meta("tokenizer.ggml.tokens", format!("{n} tokens")));
        }
        let token_types = match g.get("tokenizer.ggml.token_type") {
            Some(_) => g.get_int_array("tokenizer.ggml.token_type")?,
            None => vec![1; n],
        };
        if token_types.len() != n {
            return Err(ModelError::bad_meta(
                "tokenizer.ggml.token_type",
                format!("{} entries for {n} tokens", token_types.len()),
            ));
        }
        let id_key = |key: &str| -> Result<Option<u32>, ModelError> {
            match g.get_u32_opt(key)? {
                Some(id) if (id as usize) >= n => {
                    Err(ModelError::bad_meta(key, format!("token id {id} >= vocabulary size {n}")))
                }
                other => Ok(other),
            }
        };
        let bos = id_key("tokenizer.ggml.bos_token_id")?;
        let eos = id_key("tokenizer.ggml.eos_token_id")?;
        let pad = id_key("tokenizer.ggml.padding_token_id")?;
        let eot = id_key("tokenizer.ggml.eot_token_id")?;
        let eom = id_key("tokenizer.ggml.eom_token_id")?;
        let add_bos = g.get_bool_opt("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
        let add_eos = g.get_bool_opt("tokenizer.ggml.add_eos_token")?.unwrap_or(false);

        let mut vocab: HashMap<String, u32> = HashMap::with_capacity(n);
        for (id, t) in tokens.iter().enumerate() {
            vocab.entry((*t).to_string()).or_insert(id as u32);
        }
        let mut merges = Vec::with_capacity(merges_raw.len());
        for (i, m) in merges_raw.iter().enumerate() {
            let (a, b) = m.split_once(' ').ok_or_else(|| {
                ModelError::bad_meta("tokenizer.ggml.merges", format!("merge #{i} {m:?} has no space"))
            })?;
            if !vocab.contains_key(a) || !vocab.contains_key(b) || !vocab.contains_key(&format!("{a}{b}")) {
                return Err(ModelError::bad_meta(
                    "tokenizer.ggml.merges",
                    format!("merge #{i} {m:?} uses tokens not in the vocabulary"),
                ));
            }
            merges.push((a.to_string(), b.to_string()));
        }

        let vocab: tokenizers::models::bpe::Vocab = vocab.into_iter().collect();
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(tok_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tokenizer_for(&pre)?));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        let unicode = bytes_to_unicode();
        let mut byte_of: HashMap<char, u8> = HashMap::with_capacity(256);
        for (b, c) in unicode.iter().enumerate() {
            byte_of.insert(*c, b as u8);
        }

        let mut special = vec![false; n];
        let mut control_tokens = Vec::new();
        let mut user_tokens = Vec::new();
        for (id, (&t, &ty)) in tokens.iter().zip(&token_types).enumerate() {
            // A byte-level vocabulary spells every real token in the byte alphabet; llama.cpp sometimes marks
            // others as control by mistake, and Hugging Face's converter skips those too.
            let in_alphabet = t.chars().all(|c| byte_of.contains_key(&c));
            if ty == TOKEN_TYPE_CONTROL && in_alphabet {
                special[id] = true;
                control_tokens.push(AddedToken::from(t.to_string(), true).normalized(false));
            } else if ty == TOKEN_TYPE_USER_DEFINED {
                user_tokens.push(AddedToken::from(t.to_string(), false).normalized(false));
            }
        }
        inner.add_special_tokens(&control_tokens);
        inner.add_tokens(&user_tokens);
        if inner.get_vocab_size(true) != n {
            return Err(ModelError::Tokenizer(format!(
                "vocabulary has {} entries after adding special tokens, expected {n} (duplicate tokens?)",
                inner.get_vocab_size(true)
            )));
        }

        let token_bytes: Vec<Vec<u8>> = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| {
                if special[id] || token_types[id] == TOKEN_TYPE_USER_DEFINED {
                    t.as_bytes().to_vec()
                } else {
                    let mut out = Vec::with_capacity(t.len());
                    for c in t.chars() {
                        match byte_of.get(&c) {
                            Some(&b) => out.push(b),
                            None => {
                                let mut buf = [0u8; 4];
                                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                            }
                        }
                    }
                    out
                }
            })
            .collect();

        let mut byte_tokens = [None; 256];
        for (b, c) in unicode.iter().enumerate() {
            byte_tokens[b] = inner.token_to_id(&c.to_string());
        }

        let mut eos_ids = Vec::new();
        let mut push = |id: Option<u32>| {
            if let Some(id) = id
                && !eos_ids.contains(&id)
            {
                eos_ids.push(id);
            }
        };
        push(eos);
        push(eot);
        push(eom);
        for name in ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>"] {
            let id = inner.token_to_id(name);
            if id.is_some_and(|id| special[id as usize]) {
                push(id);
            }
        }

        Ok(Tokenizer { inner, token_bytes, special, byte_tokens, bos, eos, pad, eos_ids, add_bos, add_eos, pre })
    }

    /// Encodes text. Special tokens written in the text (e.g. `<|im_start|>`) are always recognised; `add_special`
    /// adds BOS/EOS where the GGUF asks for them (`tokenizer.ggml.add_bos_token` / `add_eos_token`).
    pub fn encode(&self, text: &str, add_special: bool) -> Vec<u32> {
        let mut ids = Vec::new();
        if add_special
            && self.add_bos
            && let Some(b) = self.bos
        {
            ids.push(b);
        }
        match self.inner.encode_fast(text, false) {
            Ok(enc) => ids.extend_from_slice(enc.get_ids()),
            Err(e) => {
                // Byte-level BPE has no failure mode on plain text, so this is not expected; fall back to one
                // token per byte (bytes without a token are dropped, as BPE itself does).
                tracing::warn!("tokenizer encode failed ({e}); falling back to byte tokens");
                ids.extend(text.bytes().filter_map(|b| self.byte_tokens[b as usize]));
            }
        }
        if add_special
            && self.add_eos
            && let Some(e) = self.eos
        {
            ids.push(e);
        }
        ids
    }

    /// Decodes ids to text (invalid UTF-8 becomes U+FFFD). Ids out of range are skipped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids, skip_special)).into_owned()
    }

    /// The raw bytes `ids` stand for, concatenated (for incremental detokenisation: emit the longest valid UTF-8
    /// prefix, keep the rest for the next token).
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for &id in ids {
            if skip_special && self.is_special(id) {
                continue;
            }
            if let Some(b) = self.token_bytes(id) {
                out.extend_from_slice(b);
            }
        }
        out
    }

    /// The raw bytes one token stands for; `None` when `id` is out of range.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(Vec::as_slice)
    }

    /// Whether `id` is a special (control) token such as `<|im_end|>`.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// The vocabulary's spelling of a token (byte-level alphabet), e.g. `Ġthe`.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token spelled in the vocabulary's alphabet.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of token ids (the model's vocabulary size).
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// `tokenizer.ggml.bos_token_id`.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// `tokenizer.ggml.eos_token_id`.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// `tokenizer.ggml.padding_token_id`.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// Every id that ends generation: the metadata eos (and eot/eom when present) plus the special tokens
    /// `<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, `<|end_of_text|>` where the vocabulary has them.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The text of a special token id (e.g. for the chat template's `bos_token`).
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.token_bytes(id).map(|b| String::from_utf8_lossy(b).into_owned())
    }

    /// `tokenizer.ggml.pre`, the pre-tokenizer family in use.
    pub fn pre_tokenizer(&self) -> &str {
        &self.pre
    }

    /// The underlying Hugging Face tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection() {
        let t = bytes_to_unicode();
        let mut seen = std::collections::HashSet::new();
        for c in t {
            assert!(seen.insert(c));
        }
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
    }

    #[test]
    fn unknown_pre_is_unsupported() {
        assert!(matches!(pre_tokenizer_for("nonesuch"), Err(ModelError::Unsupported(_))));
        assert!(pre_tokenizer_for("smollm").is_ok());
        assert!(pre_tokenizer_for("llama-bpe").is_ok());
    }
}
