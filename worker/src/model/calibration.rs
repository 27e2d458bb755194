//! The query statistics that rotated fp8 keys are rounded for ([`pagoda_kernels::key_rounding`]): a fixed text
//! (`calibration.txt`, a few paragraphs of prose, a list and a little code) runs through the model once, and every
//! token's post-RoPE queries are summed per layer and kv head, then turned by RoPE to positions spread over the
//! whole context (the text is a few hundred tokens; contexts are thousands). Computed once per model load, like vLLM's KV-scale
//! calibration, and fixed afterwards, so an encoded block never depends on what traffic came before it.

use pagoda_kernels::{Backend, KeyRounding, KvStorage, QueryMoments};

use super::{ForwardSeq, LlamaModel, LogitsWanted, ModelError, Scratch, Tokenizer};

/// The text the queries are taken from.
pub const CALIBRATION_TEXT: &str = include_str!("calibration.txt");

/// Most calibration tokens run (the forward runs at every model load).
pub const MAX_CALIBRATION_TOKENS: usize = 512;

/// Most positions the text's queries are turned to ([`QueryMoments::spread_over_positions`]), spread evenly over
/// the context.
const MAX_POSITION_COPIES: usize = 64;

/// Block size of the forward's scratch cache (any size gives the same queries).
const BLOCK: usize = 16;

/// The calibration text's tokens, at most [`MAX_CALIBRATION_TOKENS`].
pub fn calibration_tokens(tokenizer: &Tokenizer) -> Vec<u32> {
    let mut tokens = tokenizer.encode(CALIBRATION_TEXT, true);
    tokens.truncate(MAX_CALIBRATION_TOKENS);
    tokens
}

/// One [`KeyRounding`] per table (`layer * n_kv_heads + head`) from the queries of `tokens` (at most
/// [`MAX_CALIBRATION_TOKENS`], at least one).
pub fn key_rounding(model: &LlamaModel, backend: &dyn Backend, tokens: &[u32]) -> Result<Vec<KeyRounding>, ModelError> {
    let c = model.config();
    if tokens.is_empty() || tokens.len() > MAX_CALIBRATION_TOKENS {
        return Err(ModelError::InvalidInput(format!(
            "calibration takes 1 to {MAX_CALIBRATION_TOKENS} tokens, got {}",
            tokens.len()
        )));
    }
    let (nkv, hd, n) = (c.n_kv_heads, c.head_dim, tokens.len());
    let n_tables = c.n_layers * nkv;
    let per_table = n.div_ceil(BLOCK);
    let mut kv = KvStorage::new(n_tables * per_table, BLOCK, hd);
    let tables: Vec<Vec<u32>> =
        (0..n_tables).map(|t| (t * per_table..(t + 1) * per_table).map(|b| b as u32).collect()).collect();
    let lens = vec![0usize; n_tables];
    let seq = ForwardSeq {
        tokens,
        start_pos: 0,
        tables: &tables,
        prior_lens: &lens,
        logits: LogitsWanted::Last,
        capture_q: n,
        attention_sums: None,
        lora: None,
    };
    let mut scratch = Scratch::new();
    model.forward(backend, &mut kv, &[seq], &mut scratch, &mut Vec::new())?;
    // `[layer][token][q_dim]`; query head h reads kv head h / group.
    let captured = scratch.captured_q(0);
    let group = c.n_heads / nkv;
    let mut moments = vec![QueryMoments::new(hd); n_tables];
    for (li, layer) in captured.chunks_exact(n * c.n_heads * hd).enumerate() {
        for token in layer.chunks_exact(c.n_heads * hd) {
            for (h, q) in token.chunks_exact(hd).enumerate() {
                moments[li * nkv + h / group].add(q);
            }
        }
    }
    // The text covers its first n positions; keys are read by queries anywhere up to the context length.
    let ctx = c.ctx_len.max(n);
    let copies = ctx.div_ceil(n).min(MAX_POSITION_COPIES);
    let offsets: Vec<u32> = (0..copies).map(|i| (i * ctx / copies) as u32).collect();
    moments
        .iter()
        .map(|m| {
            KeyRounding::from_moments(&m.spread_over_positions(c.rope_theta, offsets.iter().copied()))
                .map_err(|e| ModelError::Kernel(format!("calibrating fp8 keys: {e}")))
        })
        .collect()
}
