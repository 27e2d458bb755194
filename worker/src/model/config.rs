//! `ModelConfig`: llama-family hyper-parameters read from GGUF metadata (`{arch}.block_count`,
//! `{arch}.attention.head_count`, `{arch}.rope.freq_base`, ...), validated for consistency.

use super::error::ModelError;
use super::gguf::Gguf;

/// Hyper-parameters of a llama-family model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `general.architecture` (e.g. "llama").
    pub arch: String,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Embedding width (`{arch}.embedding_length`).
    pub hidden: usize,
    /// Feed-forward width (`{arch}.feed_forward_length`).
    pub ffn: usize,
    pub vocab: usize,
    /// Training context length; forward rejects positions at or beyond it.
    pub ctx_len: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
}

/// Architectures that share llama's tensor names and forward pass.
const LLAMA_LIKE: &[&str] = &["llama", "mistral", "granite"];

impl ModelConfig {
    /// Reads and checks the hyper-parameters. The vocabulary size comes from `{arch}.vocab_size`, else the token
    /// list, else the embedding tensor.
    pub fn from_gguf(g: &Gguf) -> Result<ModelConfig, ModelError> {
        let arch = g.get_str("general.architecture")?.to_string();
        if !LLAMA_LIKE.contains(&arch.as_str()) {
            return Err(ModelError::Unsupported(format!("architecture {arch:?}")));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let usize_key = |k: &str| -> Result<usize, ModelError> { Ok(g.get_u32(&key(k))? as usize) };
        let n_layers = usize_key("block_count")?;
        let hidden = usize_key("embedding_length")?;
        let ffn = usize_key("feed_forward_length")?;
        let n_heads = usize_key("attention.head_count")?;
        let n_kv_heads = match g.get_u32_opt(&key("attention.head_count_kv"))? {
            Some(v) => v as usize,
            None => n_heads,
        };
        let ctx_len = usize_key("context_length")?;
        let rms_eps = g.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        let rope_theta = g.get_f32_opt(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        let bad = |k: &str, why: String| ModelError::bad_meta(&key(k), why);
        if n_layers == 0 || hidden == 0 || ffn == 0 || ctx_len == 0 {
            return Err(bad("block_count", "a model dimension is zero".into()));
        }
        if n_heads == 0 || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(bad("attention.head_count_kv", format!("{n_heads} heads over {n_kv_heads} kv heads")));
        }
        let head_dim = match g.get_u32_opt(&key("attention.key_length"))? {
            Some(v) => v as usize,
            None => {
                if !hidden.is_multiple_of(n_heads) {
                    return Err(bad("attention.head_count", format!("{hidden} is not divisible by {n_heads}")));
                }
                hidden / n_heads
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(bad("attention.key_length", format!("head_dim {head_dim} must be even and non-zero")));
        }
        if let Some(v) = g.get_u32_opt(&key("attention.value_length"))?
            && v as usize != head_dim
        {
            return Err(ModelError::Unsupported(format!("value_length {v} != key_length {head_dim}")));
        }
        if let Some(rot) = g.get_u32_opt(&key("rope.dimension_count"))?
            && rot as usize != head_dim
        {
            return Err(ModelError::Unsupported(format!("partial RoPE ({rot} of {head_dim} dims)")));
        }
        if let Some(scaling) = g.get_str_opt(&key("rope.scaling.type"))?
            && scaling != "none"
        {
            return Err(ModelError::Unsupported(format!("RoPE scaling {scaling:?}")));
        }
        if !rope_theta.is_finite() || rope_theta <= 1.0 {
            return Err(bad("rope.freq_base", format!("{rope_theta}")));
        }
        if !rms_eps.is_finite() || rms_eps <= 0.0 {
            return Err(bad("attention.layer_norm_rms_epsilon", format!("{rms_eps}")));
        }
        let vocab = if let Some(v) = g.get_u32_opt(&key("vocab_size"))? {
            v as usize
        } else if g.get("tokenizer.ggml.tokens").is_some() {
            g.get_array("tokenizer.ggml.tokens")?.len()
        } else {
            let emb = g
                .tensor_info("token_embd.weight")
                .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
            emb.dims.get(1).copied().unwrap_or(0) as usize
        };
        if vocab == 0 || vocab > u32::MAX as usize {
            return Err(bad("vocab_size", format!("{vocab}")));
        }
        Ok(ModelConfig {
            arch,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            hidden,
            ffn,
            vocab,
            ctx_len,
            rope_theta,
            rms_eps,
        })
    }

    /// Width of q (and of the attention output): `n_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of k and v: `n_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Block tables (and cache lengths) per sequence: `n_layers * n_kv_heads`, indexed `layer * n_kv_heads + head`.
    pub fn n_kv_tables(&self) -> usize {
        self.n_layers * self.n_kv_heads
    }
}
