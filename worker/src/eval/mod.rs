//! The data layer of `pagoda eval`, the quality harness that compares each KV-eviction policy and budget against
//! the full cache. It owns the inputs and their scoring, nothing that runs the model:
//!
//! - [`tasks`]: deterministic synthetic long-context tasks after RULER (Hsieh et al., 2024): passkey, multi-key
//!   needle-in-a-haystack, key-value retrieval, variable tracking and common-word extraction, each grown to a token
//!   target and scored by RULER's string match.
//! - [`prose`]: real English prose (fetched by `scripts/fetch-prose.sh` into `data/prose/`) split into documents of
//!   a token range, for teacher-forced scoring.
//!
//! - [`codecs`]: `pagoda eval --codecs`, next-token agreement with the full cache when every filled KV block goes
//!   through a codec (runs the model itself, unlike the data modules above).
//!
//! Everything here takes a `count_tokens` callback instead of a tokenizer so that the data layer does not depend on
//! which model the runner loads, and can be tested with a stand-in counter.

pub mod codecs;
pub mod prose;
pub mod runner;
pub mod tasks;
pub(crate) mod words;

use std::path::PathBuf;

use thiserror::Error;

pub use prose::{Document, load_documents};

use crate::engine::EngineError;
use crate::model::{ChatMessage, ChatTemplate, Tokenizer};

/// The chat prompt for one user message, rendered with the model's template and tokenized (both eval runners ask
/// the model the same way the API does).
pub fn chat_tokens(template: &ChatTemplate, tokenizer: &Tokenizer, user: &str) -> Result<Vec<u32>, EngineError> {
    let text =
        template.render(&[ChatMessage::new("user", user)], true).map_err(|e| EngineError::Model(e.to_string()))?;
    Ok(tokenizer.encode(&text, false))
}
pub use tasks::{EvalItem, TaskKind, generate, score};

/// Failures of the eval data layer: reading and bounding the prose files, and bad arguments.
#[derive(Debug, Error)]
pub enum EvalError {
    /// Reading a directory or file failed.
    #[error("i/o error on {path}: {source}")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A prose file is not valid UTF-8.
    #[error("{path} is not UTF-8 text")]
    NotUtf8 {
        /// The file.
        path: PathBuf,
    },
    /// A prose file is larger than the loader accepts.
    #[error("{path} is over the {limit}-byte limit for one prose file")]
    FileTooLarge {
        /// The file.
        path: PathBuf,
        /// The limit in bytes.
        limit: u64,
    },
    /// The prose directory holds more text than the loader accepts, in files or in bytes.
    #[error("{dir} holds more prose than the loader accepts: {reason}")]
    TooMuchText {
        /// The directory.
        dir: PathBuf,
        /// Which limit was hit.
        reason: String,
    },
    /// No file in the directory yields a document of the requested size.
    #[error("no prose document of at least {min_tokens} tokens in {dir} (run scripts/fetch-prose.sh to fetch some)")]
    NoDocuments {
        /// The directory.
        dir: PathBuf,
        /// The requested minimum document length.
        min_tokens: usize,
    },
    /// An argument is out of its accepted range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}
