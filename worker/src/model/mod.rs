//! The model layer: GGUF reader ([`gguf`]), tokenizer built from GGUF metadata ([`tokenizer`]), chat template
//! rendering ([`chat`]), model hyper-parameters ([`config`]), the query statistics fp8 keys are rounded for
//! ([`calibration`]), the llama forward pass over head-paged KV blocks
//! ([`llama`]) LoRA adapters ([`lora`]) and synthetic-weights models of any llama shape for throughput benchmarks ([`synthetic`]). All numeric work goes through `pagoda_kernels::Backend`.

pub mod calibration;
pub mod chat;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod gguf;
pub mod llama;
pub mod lora;
pub mod synthetic;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use config::ModelConfig;
pub use error::ModelError;
pub use gguf::{GgmlType, Gguf, MetaValue, TensorInfo};
pub use llama::{ForwardSeq, LlamaModel, LogitsWanted, Scratch};
pub use lora::{LoraAdapter, LoraTarget, SyntheticLora};
pub use synthetic::{SyntheticSpec, parse_synthetic_weights};
pub use tokenizer::Tokenizer;
