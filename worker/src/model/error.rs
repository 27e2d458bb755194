//! `ModelError`: every failure of the model layer (GGUF parsing, tokenizer and chat-template construction,
//! weight loading and forward-pass input validation). Nothing in `model/` panics on bad input; it returns one of these.

use thiserror::Error;

/// Errors of the model layer.
#[derive(Debug, Error)]
pub enum ModelError {
    /// Opening or mapping a file failed.
    #[error("i/o error on {path}: {source}")]
    Io {
        /// The file involved.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The GGUF bytes are malformed, truncated, or inconsistent.
    #[error("corrupt GGUF: {0}")]
    Corrupt(String),
    /// The GGUF is well formed but uses something this reader does not support.
    #[error("unsupported GGUF: {0}")]
    Unsupported(String),
    /// A metadata key is missing.
    #[error("missing GGUF metadata key `{0}`")]
    MissingKey(String),
    /// A metadata key has a type or value we cannot use.
    #[error("bad GGUF metadata `{key}`: {reason}")]
    BadMetadata {
        /// The key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor is missing from the file.
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    /// A tensor has the wrong shape or type for the model.
    #[error("bad tensor `{name}`: {reason}")]
    BadTensor {
        /// The tensor name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Building or running the tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Compiling or rendering the chat template failed.
    #[error("chat template: {0}")]
    Template(String),
    /// A kernel rejected its inputs (e.g. weight bytes of the wrong size).
    #[error("kernel: {0}")]
    Kernel(String),
    /// The caller passed invalid forward-pass inputs (token id out of range, short block table, ...).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A LoRA adapter could not be loaded (bad files, unsupported options, shapes of another model).
    #[error("LoRA adapter: {0}")]
    Lora(String),
}

impl ModelError {
    pub(crate) fn corrupt(msg: impl Into<String>) -> Self {
        ModelError::Corrupt(msg.into())
    }

    pub(crate) fn bad_meta(key: &str, reason: impl Into<String>) -> Self {
        ModelError::BadMetadata { key: key.to_string(), reason: reason.into() }
    }
}
