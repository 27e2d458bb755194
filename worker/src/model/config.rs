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

/// Upper bounds on the shape, far above any published llama-family model (Llama 3.1 405B: 126 layers, hidden
/// 16,384, ffn 53,248, 128 heads of 128, 131,072 context). Allocations sized from these fields (the layer list,
/// the KV pool, which defaults to twice the context) happen before any tensor could contradict them, so a
/// corrupt value must fail here rather than abort on a terabyte allocation. The synthetic models use the same.
pub const MAX_LAYERS: usize = 1024;
pub const MAX_HIDDEN: usize = 65_536;
pub const MAX_FFN: usize = 262_144;
pub const MAX_HEADS: usize = 1024;
pub const MAX_HEAD_DIM: usize = 1024;
pub const MAX_CONTEXT: usize = 1 << 21;

/// When the file holds block tensors (`blk.N.*`; a vocabulary-only GGUF holds none), that they number exactly
/// `n_layers`, so that the layer count is backed by weights the file actually has.
fn check_block_tensors(g: &Gguf, n_layers: usize) -> Result<(), String> {
    let mut blocks: Option<usize> = None;
    for t in g.tensors() {
        let Some(index) = t.name.strip_prefix("blk.").and_then(|rest| rest.split('.').next()) else { continue };
        let Ok(index) = index.parse::<usize>() else { continue };
        if index >= n_layers {
            return Err(format!("{n_layers} blocks, but the file holds tensor `{}`", t.name));
        }
        blocks = Some(blocks.map_or(index + 1, |b| b.max(index + 1)));
    }
    match blocks {
        Some(b) if b != n_layers => Err(format!("{n_layers} blocks, but the file's tensors stop at block {}", b - 1)),
        _ => Ok(()),
    }
}

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
        for (k, v, max) in [
            ("block_count", n_layers, MAX_LAYERS),
            ("embedding_length", hidden, MAX_HIDDEN),
            ("feed_forward_length", ffn, MAX_FFN),
            ("attention.head_count", n_heads, MAX_HEADS),
            ("attention.head_count_kv", n_kv_heads, MAX_HEADS),
            ("context_length", ctx_len, MAX_CONTEXT),
        ] {
            if v > max {
                return Err(bad(k, format!("{v} is more than the {max} supported")));
            }
        }
        check_block_tensors(g, n_layers).map_err(|why| bad("block_count", why))?;
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
        if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > MAX_HEAD_DIM {
            return Err(bad(
                "attention.key_length",
                format!("head_dim {head_dim} must be even and in 2..={MAX_HEAD_DIM}"),
            ));
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

#[cfg(test)]
mod tests {
    use super::*;

    enum Meta {
        Str(&'static str),
        U32(u32),
        F32(f32),
    }

    /// A GGUF v3 file with `meta` and, when `blocks` is given, one 4-element f32 `blk.N.attn_norm.weight` per block.
    fn gguf(meta: &[(&str, Meta)], blocks: Option<usize>) -> Vec<u8> {
        let s = |b: &mut Vec<u8>, s: &str| {
            b.extend_from_slice(&(s.len() as u64).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        };
        let n_tensors = blocks.unwrap_or(0);
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&(n_tensors as u64).to_le_bytes());
        b.extend_from_slice(&(meta.len() as u64).to_le_bytes());
        for (key, value) in meta {
            s(&mut b, key);
            match value {
                Meta::Str(v) => {
                    b.extend_from_slice(&8u32.to_le_bytes());
                    s(&mut b, v);
                }
                Meta::U32(v) => {
                    b.extend_from_slice(&4u32.to_le_bytes());
                    b.extend_from_slice(&v.to_le_bytes());
                }
                Meta::F32(v) => {
                    b.extend_from_slice(&6u32.to_le_bytes());
                    b.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        for i in 0..n_tensors {
            s(&mut b, &format!("blk.{i}.attn_norm.weight"));
            b.extend_from_slice(&1u32.to_le_bytes());
            b.extend_from_slice(&4u64.to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
            b.extend_from_slice(&(i as u64 * 32).to_le_bytes());
        }
        while b.len() % 32 != 0 {
            b.push(0);
        }
        b.resize(b.len() + n_tensors * 32, 0);
        b
    }

    /// SmolLM2-135M's shape, with `key` set to `value`.
    fn config_with(key: &'static str, value: u32, blocks: Option<usize>) -> Result<ModelConfig, ModelError> {
        let mut meta = vec![
            ("general.architecture", Meta::Str("llama")),
            ("llama.block_count", Meta::U32(30)),
            ("llama.embedding_length", Meta::U32(576)),
            ("llama.feed_forward_length", Meta::U32(1536)),
            ("llama.attention.head_count", Meta::U32(9)),
            ("llama.attention.head_count_kv", Meta::U32(3)),
            ("llama.context_length", Meta::U32(8192)),
            ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
            ("llama.vocab_size", Meta::U32(49_152)),
        ];
        match meta.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => *v = Meta::U32(value),
            None => meta.push((key, Meta::U32(value))),
        }
        ModelConfig::from_gguf(&Gguf::from_bytes(gguf(&meta, blocks))?)
    }

    #[test]
    fn a_real_shape_reads_back() {
        let c = config_with("llama.block_count", 30, Some(30)).unwrap();
        assert_eq!((c.n_layers, c.hidden, c.head_dim, c.n_kv_heads, c.ctx_len), (30, 576, 64, 3, 8192));
        // A vocabulary-only file (no tensors) is read for its metadata alone.
        assert!(config_with("llama.block_count", 30, None).is_ok());
    }

    #[test]
    fn huge_shapes_are_bad_metadata_not_huge_allocations() {
        for (key, value) in [
            ("llama.block_count", u32::MAX),
            ("llama.context_length", u32::MAX),
            ("llama.context_length", (MAX_CONTEXT + 1) as u32),
            ("llama.embedding_length", 1 << 20),
            ("llama.feed_forward_length", u32::MAX),
            ("llama.attention.key_length", 1 << 16),
            ("llama.attention.head_count", 4096),
        ] {
            match config_with(key, value, None) {
                Err(ModelError::BadMetadata { reason, .. }) => {
                    assert!(reason.contains("supported") || reason.contains("in 2..="), "{key}: {reason}")
                }
                other => panic!("{key} = {value}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_layer_count_must_match_the_block_tensors() {
        let err = config_with("llama.block_count", 1000, Some(30)).unwrap_err().to_string();
        assert!(err.contains("stop at block 29"), "{err}");
        let err = config_with("llama.block_count", 20, Some(30)).unwrap_err().to_string();
        assert!(err.contains("blk.20.attn_norm.weight"), "{err}");
    }
}
