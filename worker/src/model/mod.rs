//! The model layer: GGUF reader ([`gguf`]), tokenizer built from GGUF metadata ([`tokenizer`]), chat template
//! rendering ([`chat`]), model hyper-parameters ([`config`]) and the llama forward pass over head-paged KV blocks
//! ([`llama`]). All numeric work goes through `pagoda_kernels::Backend`.

pub mod chat;
pub mod config;
pub mod error;
pub mod gguf;
pub mod llama;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use config::ModelConfig;
pub use error::ModelError;
pub use gguf::{GgmlType, Gguf, MetaValue, TensorInfo};
pub use llama::{ForwardSeq, LlamaModel, LogitsWanted, Scratch};
pub use tokenizer::Tokenizer;
