//! The llama forward pass over head-paged KV blocks: [`LlamaModel`] (weights loaded from a [`Gguf`] into
//! `pagoda_kernels::QMatrix`), [`ForwardSeq`] (one sequence's share of a batched step), [`LogitsWanted`] and
//! [`Scratch`] (reusable activation buffers).
//!
//! One step batches every sequence's tokens into a single activation matrix, so each weight matmul runs once with
//! `n` = total tokens. Per layer: RMSNorm → q/k/v → RoPE (llama.cpp "normal" adjacent pairs; the GGUF converter
//! permuted Wq/Wk for it) at positions `start_pos + i` → KV write into each sequence's block tables → paged
//! attention (scale 1/√head_dim, GQA) → o-projection + residual → RMSNorm → SiLU(gate)·up → down + residual.
//! Then the final norm and the LM head run only for the rows whose logits were asked for.

use std::ops::Range;

use pagoda_kernels::{AttnProbs, AttnSeq, Backend, KvStorage, QMatrix, RopeTable, WeightType};

use super::config::ModelConfig;
use super::error::ModelError;
use super::gguf::{GgmlType, Gguf};
use super::lora::{LoraAdapter, LoraTarget, adapter_runs, apply_lora};

/// Which logits rows a sequence wants from a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// The last token's row (decode, or the final chunk of a prefill).
    Last,
    /// One row per token of the step.
    All,
    /// No logits (a non-final prefill chunk).
    None,
}

impl LogitsWanted {
    /// Rows of logits a step of `n` tokens gives.
    pub fn rows(self, n: usize) -> usize {
        match self {
            LogitsWanted::Last => 1,
            LogitsWanted::All => n,
            LogitsWanted::None => 0,
        }
    }
}

/// One sequence's share of a batched forward step.
#[derive(Debug, Clone, Copy)]
pub struct ForwardSeq<'a> {
    /// Tokens to compute this step (non-empty).
    pub tokens: &'a [u32],
    /// RoPE position of `tokens[0]` (= tokens already processed, NOT cache length).
    pub start_pos: u32,
    /// `n_layers * n_kv_heads` block tables, index `layer * n_kv_heads + head`.
    pub tables: &'a [Vec<u32>],
    /// `n_layers * n_kv_heads` cache lengths before this step.
    pub prior_lens: &'a [usize],
    /// Which logits rows to append to the output.
    pub logits: LogitsWanted,
    /// How many trailing tokens of this step have their post-RoPE queries copied to [`Scratch::captured_q`]
    /// (eviction policies score the cache with them; 0 for none).
    pub capture_q: usize,
    /// Have the attention kernel sum this step's attention probabilities, each raised to this power, over the
    /// step's tokens into [`Scratch::attn_probs`] (policies that rank slots by accumulated attention read them
    /// instead of scoring the keys again). `None`: no probabilities.
    pub attention_sums: Option<u32>,
    /// The LoRA adapter this sequence runs with (`None`: the base model). Consecutive sequences with the same
    /// adapter share its small matmuls.
    pub lora: Option<&'a LoraAdapter>,
}

/// Reusable activation buffers for [`LlamaModel::forward`]. Buffers grow to the largest step seen and are then
/// reused, so steady-state decoding does not allocate.
#[derive(Debug, Default)]
pub struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    ids: Vec<u32>,
    positions: Vec<u32>,
    /// The step's RoPE rotation, filled once per forward pass for every layer's queries and keys.
    rope: RopeTable,
    /// Rows (into the batch) whose logits are wanted, in output order.
    out_rows: Vec<usize>,
    head_in: Vec<f32>,
    /// The queries the step captured for the eviction policies.
    captured: CapturedQueries,
    /// Summed attention probabilities per batch sequence (reused buffers; only those with `attention_sums` are
    /// written in a step): `[layer][n_heads][stride]`.
    probs: Vec<Vec<f32>>,
    /// Each batch sequence's row stride in `probs`, `None` when it captured none this step.
    probs_stride: Vec<Option<usize>>,
    head_norm: Vec<f32>,
    /// The allocations of a step's per-layer attention views and probability sinks. Those borrow the step's block
    /// tables and `probs`, so they are kept empty between steps and given each step's lifetime by
    /// [`recycle_views`] and [`recycle_sinks`].
    spare_views: Vec<AttnSeq<'static>>,
    spare_sinks: Vec<AttnProbs<'static>>,
}

impl Scratch {
    /// Empty scratch; grows on first use.
    pub fn new() -> Scratch {
        Scratch::default()
    }

    /// Scratch pre-sized for steps of up to `max_tokens` tokens.
    pub fn with_capacity(cfg: &ModelConfig, max_tokens: usize) -> Scratch {
        let mut s = Scratch::default();
        s.ensure(cfg, max_tokens);
        s
    }

    /// Queries captured by the last [`LlamaModel::forward`] for batch sequence `seq` (its index in the step):
    /// `[layer][capture_q][q_dim]`, post-RoPE. Empty when that sequence captured nothing.
    pub fn captured_q(&self, seq: usize) -> &[f32] {
        self.captured.of(seq)
    }

    /// Summed attention probabilities the last [`LlamaModel::forward`] wrote for batch sequence `seq` (one with
    /// `attention_sums`) and their row stride: `[layer][n_heads][stride]`, row `(layer, head)` holding, for each of
    /// the `prior_lens[layer, head / group] + n` slots the step's last token saw, the sum over the step's tokens of
    /// their probability of that slot raised to the power asked (as [`pagoda_kernels::AttnProbs`] lays it out; the
    /// rest of the row is stale). `None` when that sequence captured none.
    pub fn attn_probs(&self, seq: usize) -> Option<(&[f32], usize)> {
        let stride = self.probs_stride.get(seq).copied().flatten()?;
        Some((self.probs.get(seq)?.as_slice(), stride))
    }

    fn ensure(&mut self, cfg: &ModelConfig, n: usize) {
        fn fit<T: Default + Clone>(v: &mut Vec<T>, len: usize) {
            if v.len() != len {
                v.resize(len, T::default());
            }
        }
        fit(&mut self.x, n * cfg.hidden);
        fit(&mut self.xn, n * cfg.hidden);
        fit(&mut self.q, n * cfg.q_dim());
        fit(&mut self.k, n * cfg.kv_dim());
        fit(&mut self.v, n * cfg.kv_dim());
        fit(&mut self.attn, n * cfg.q_dim());
        fit(&mut self.proj, n * cfg.hidden);
        fit(&mut self.gate, n * cfg.ffn);
        fit(&mut self.up, n * cfg.ffn);
    }
}

/// One transformer block's weights.
pub(super) struct Layer {
    pub(super) attn_norm: Vec<f32>,
    pub(super) wq: QMatrix,
    pub(super) wk: QMatrix,
    pub(super) wv: QMatrix,
    pub(super) wo: QMatrix,
    pub(super) ffn_norm: Vec<f32>,
    pub(super) w_gate: QMatrix,
    pub(super) w_up: QMatrix,
    pub(super) w_down: QMatrix,
}

/// A llama-family model's weights.
pub struct LlamaModel {
    config: ModelConfig,
    pub(super) embed: QMatrix,
    pub(super) layers: Vec<Layer>,
    pub(super) norm: Vec<f32>,
    /// `output.weight`; `None` when the embeddings are tied (the LM head is `token_embd`).
    pub(super) output: Option<QMatrix>,
}

impl LlamaModel {
    /// The input embedding of each of `ids` (rows of `hidden` floats, one after another) into `out`, which the
    /// caller sized to `ids.len() × hidden`. Ids must be below the vocabulary.
    pub fn token_embeddings(&self, backend: &dyn Backend, ids: &[u32], out: &mut [f32]) {
        backend.embedding(&self.embed, ids, out);
    }
}

impl std::fmt::Debug for LlamaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaModel")
            .field("config", &self.config)
            .field("tied_embeddings", &self.output.is_none())
            .finish()
    }
}

fn load_matrix(g: &Gguf, name: &str, rows: usize, cols: usize) -> Result<QMatrix, ModelError> {
    let info = g.tensor_info(name).ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    let bad = |reason: String| ModelError::BadTensor { name: name.to_string(), reason };
    if info.dims != [cols as u64, rows as u64] {
        return Err(bad(format!("dims {:?}, expected [{cols}, {rows}]", info.dims)));
    }
    let ty = WeightType::from_ggml(info.ggml_type.id()).map_err(|e| bad(e.to_string()))?;
    let bytes = g.info_bytes(info)?;
    QMatrix::from_gguf(ty, rows, cols, bytes).map_err(|e| ModelError::Kernel(format!("{name}: {e}")))
}

fn load_vector(g: &Gguf, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let info = g.tensor_info(name).ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    let bad = |reason: String| ModelError::BadTensor { name: name.to_string(), reason };
    if info.n_elements() != len as u64 || info.dims.first().copied() != Some(len as u64) {
        return Err(bad(format!("dims {:?}, expected [{len}]", info.dims)));
    }
    let bytes = g.info_bytes(info)?;
    let v: Vec<f32> = match info.ggml_type {
        GgmlType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        GgmlType::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        GgmlType::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => return Err(bad(format!("type {other:?}, expected F32/F16/BF16"))),
    };
    if v.len() != len {
        return Err(bad(format!("{} values, expected {len}", v.len())));
    }
    Ok(v)
}

fn invalid(msg: String) -> ModelError {
    ModelError::InvalidInput(msg)
}

impl LlamaModel {
    /// Loads the weights named by llama.cpp's GGUF conventions (`token_embd`, `blk.N.attn_q`, ..., `output_norm`,
    /// optional `output`). Shapes and types are checked against the metadata.
    pub fn load(g: &Gguf) -> Result<LlamaModel, ModelError> {
        let config = ModelConfig::from_gguf(g)?;
        let c = &config;
        let embed = load_matrix(g, "token_embd.weight", c.vocab, c.hidden)?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: load_vector(g, &n("attn_norm"), c.hidden)?,
                wq: load_matrix(g, &n("attn_q"), c.q_dim(), c.hidden)?,
                wk: load_matrix(g, &n("attn_k"), c.kv_dim(), c.hidden)?,
                wv: load_matrix(g, &n("attn_v"), c.kv_dim(), c.hidden)?,
                wo: load_matrix(g, &n("attn_output"), c.hidden, c.q_dim())?,
                ffn_norm: load_vector(g, &n("ffn_norm"), c.hidden)?,
                w_gate: load_matrix(g, &n("ffn_gate"), c.ffn, c.hidden)?,
                w_up: load_matrix(g, &n("ffn_up"), c.ffn, c.hidden)?,
                w_down: load_matrix(g, &n("ffn_down"), c.hidden, c.ffn)?,
            });
        }
        let norm = load_vector(g, "output_norm.weight", c.hidden)?;
        let output = if g.tensor_info("output.weight").is_some() {
            Some(load_matrix(g, "output.weight", c.vocab, c.hidden)?)
        } else {
            None
        };
        Ok(LlamaModel { config, embed, layers, norm, output })
    }

    /// A model from weights built elsewhere in `model/` (the synthetic generator); shapes follow `config`.
    pub(super) fn from_parts(
        config: ModelConfig,
        embed: QMatrix,
        layers: Vec<Layer>,
        norm: Vec<f32>,
        output: Option<QMatrix>,
    ) -> LlamaModel {
        LlamaModel { config, embed, layers, norm, output }
    }

    /// A copy with every weight matrix dequantised to F32 (about 4 bytes per parameter). The F32 matmul does not
    /// quantise activations, so this isolates the forward pass from quantisation error (reference tests).
    pub fn to_f32_weights(&self) -> Result<LlamaModel, ModelError> {
        fn deq(m: &QMatrix) -> Result<QMatrix, ModelError> {
            let (rows, cols) = (m.rows(), m.cols());
            let mut values = vec![0.0f32; rows * cols];
            for (r, out) in values.chunks_exact_mut(cols).enumerate() {
                m.dequantize_row(r, out);
            }
            QMatrix::from_f32(rows, cols, &values).map_err(|e| ModelError::Kernel(e.to_string()))
        }
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    attn_norm: l.attn_norm.clone(),
                    wq: deq(&l.wq)?,
                    wk: deq(&l.wk)?,
                    wv: deq(&l.wv)?,
                    wo: deq(&l.wo)?,
                    ffn_norm: l.ffn_norm.clone(),
                    w_gate: deq(&l.w_gate)?,
                    w_up: deq(&l.w_up)?,
                    w_down: deq(&l.w_down)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(LlamaModel {
            config: self.config.clone(),
            embed: deq(&self.embed)?,
            layers,
            norm: self.norm.clone(),
            output: self.output.as_ref().map(deq).transpose()?,
        })
    }

    /// F32 weights ([`LlamaModel::to_f32_weights`]) with `adapter`'s deltas added (PEFT's `merge_and_unload`):
    /// the reference that serving the adapter unmerged is checked against.
    pub fn merged_with(&self, adapter: &LoraAdapter) -> Result<LlamaModel, ModelError> {
        let mut merged = self.to_f32_weights()?;
        let cfg = self.config.clone();
        for (li, layer) in merged.layers.iter_mut().enumerate() {
            for target in LoraTarget::ALL {
                let Some(delta) = adapter.delta(li, target, &cfg) else { continue };
                let w = match target {
                    LoraTarget::Q => &mut layer.wq,
                    LoraTarget::K => &mut layer.wk,
                    LoraTarget::V => &mut layer.wv,
                    LoraTarget::O => &mut layer.wo,
                    LoraTarget::Gate => &mut layer.w_gate,
                    LoraTarget::Up => &mut layer.w_up,
                    LoraTarget::Down => &mut layer.w_down,
                };
                let (rows, cols) = (w.rows(), w.cols());
                let mut values = vec![0.0f32; rows * cols];
                for (r, out) in values.chunks_exact_mut(cols).enumerate() {
                    w.dequantize_row(r, out);
                }
                for (v, d) in values.iter_mut().zip(&delta) {
                    *v += d;
                }
                *w = QMatrix::from_f32(rows, cols, &values).map_err(|e| ModelError::Kernel(e.to_string()))?;
            }
        }
        Ok(merged)
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Vocabulary size (width of each logits row).
    pub fn vocab_size(&self) -> usize {
        self.config.vocab
    }

    /// Whether the LM head shares the token embedding matrix.
    pub fn tied_embeddings(&self) -> bool {
        self.output.is_none()
    }

    /// Runs one batched step; appends logits rows (vocab each) for each sequence in order to `out`.
    ///
    /// The caller reserves blocks so every table has room for `prior_lens + tokens.len()` slots, and advances the
    /// lengths afterwards. Inputs are validated first (token ids, context length, table count and capacity, block
    /// ids); on error nothing is written.
    pub fn forward(
        &self,
        backend: &dyn Backend,
        kv: &mut KvStorage,
        seqs: &[ForwardSeq<'_>],
        scratch: &mut Scratch,
        out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let total = validate_step(&self.config, (kv.head_dim(), kv.block_size(), kv.num_blocks()), seqs)?;
        if total == 0 {
            return Ok(());
        }
        let c = &self.config;
        let (hidden, qd, kvd, nkv) = (c.hidden, c.q_dim(), c.kv_dim(), c.n_kv_heads);
        scratch.ensure(c, total);

        step_rows(seqs, &mut scratch.ids, &mut scratch.positions, &mut scratch.out_rows);
        let captures = scratch.captured.layout(seqs, c.n_layers, qd) > 0;
        scratch.probs_stride.clear();
        if scratch.probs.len() < seqs.len() {
            scratch.probs.resize_with(seqs.len(), Vec::new);
        }
        for (s, buf) in seqs.iter().zip(scratch.probs.iter_mut()) {
            if s.attention_sums.is_none() {
                scratch.probs_stride.push(None);
                continue;
            }
            let stride = s.prior_lens.iter().max().copied().unwrap_or(0) + s.tokens.len();
            buf.resize(c.n_layers * c.n_heads * stride, 0.0);
            scratch.probs_stride.push(Some(stride));
        }
        let any_probs = scratch.probs_stride.iter().any(Option::is_some);
        let Scratch {
            x,
            xn,
            q,
            k,
            v,
            attn,
            proj,
            gate,
            up,
            ids,
            positions,
            rope,
            out_rows,
            head_in,
            head_norm,
            captured,
            probs,
            probs_stride,
            spare_views,
            spare_sinks: kept_sinks,
        } = scratch;
        // Adds the step's adapters' deltas of one projection (nothing when no sequence has an adapter). The runs
        // of rows per adapter are found once; at most two allocations per step with adapters, none without.
        let mut runs = Vec::new();
        adapter_runs(seqs, &mut runs);
        let mut segments = Vec::new();
        let mut lora = |li: usize, target: LoraTarget, x: &[f32], y: &mut [f32]| {
            if !runs.is_empty() {
                let (input, output) = target.dims(c);
                apply_lora(backend, &runs, (li, target), (x, input), (y, output), &mut segments);
            }
        };
        backend.embedding(&self.embed, ids, x);
        rope.fill(positions, c.head_dim, c.rope_theta);

        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let mut attn_seqs = recycle_views(std::mem::take(spare_views));
        // Each layer's probability sinks borrow its own rows of `probs`; the layers share one allocation.
        let mut spare_sinks = recycle_sinks(std::mem::take(kept_sinks));
        for (li, layer) in self.layers.iter().enumerate() {
            backend.rmsnorm(x, &layer.attn_norm, c.rms_eps, xn);
            backend.matmul_shared_input(
                &[&layer.wq, &layer.wk, &layer.wv],
                xn,
                total,
                &mut [&mut q[..], &mut k[..], &mut v[..]],
            );
            lora(li, LoraTarget::Q, xn, q);
            lora(li, LoraTarget::K, xn, k);
            lora(li, LoraTarget::V, xn, v);
            backend.rope(q, rope, c.n_heads);
            backend.rope(k, rope, nkv);
            if captures {
                captured
                    .copy_layer(seqs, li, |dst, src| {
                        dst.copy_from_slice(&q[src]);
                        Ok::<(), std::convert::Infallible>(())
                    })
                    .unwrap_or_else(|never| match never {});
            }

            layer_views(seqs, li, nkv, &mut attn_seqs);
            backend.kv_write(kv, k, v, &attn_seqs, nkv);
            if any_probs {
                let mut sinks = recycle_sinks(std::mem::take(&mut spare_sinks));
                for (i, ((s, buf), stride)) in seqs.iter().zip(probs.iter_mut()).zip(probs_stride.iter()).enumerate() {
                    if let (Some(stride), Some(power)) = (*stride, s.attention_sums) {
                        let per = c.n_heads * stride;
                        sinks.push(AttnProbs { seq: i, power, stride, sums: &mut buf[li * per..(li + 1) * per] });
                    }
                }
                backend.paged_attention_with_probs(q, kv, &attn_seqs, c.n_heads, nkv, scale, attn, &mut sinks);
                spare_sinks = recycle_sinks(sinks);
            } else {
                backend.paged_attention(q, kv, &attn_seqs, c.n_heads, nkv, scale, attn);
            }

            backend.matmul(&layer.wo, attn, total, proj);
            lora(li, LoraTarget::O, attn, proj);
            add_assign(x, proj);

            backend.rmsnorm(x, &layer.ffn_norm, c.rms_eps, xn);
            backend.matmul_shared_input(&[&layer.w_gate, &layer.w_up], xn, total, &mut [&mut gate[..], &mut up[..]]);
            lora(li, LoraTarget::Gate, xn, gate);
            lora(li, LoraTarget::Up, xn, up);
            backend.silu_mul(gate, up);
            backend.matmul(&layer.w_down, gate, total, proj);
            lora(li, LoraTarget::Down, gate, proj);
            add_assign(x, proj);
        }
        *spare_views = recycle_views(attn_seqs);
        *kept_sinks = recycle_sinks(spare_sinks);
        debug_assert_eq!(x.len(), total * hidden);
        debug_assert_eq!(q.len(), total * qd);
        debug_assert_eq!(k.len(), total * kvd);

        let m = out_rows.len();
        if m == 0 {
            return Ok(());
        }
        head_in.clear();
        for &r in out_rows.iter() {
            head_in.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        head_norm.resize(m * hidden, 0.0);
        backend.rmsnorm(head_in, &self.norm, c.rms_eps, head_norm);
        let lm_head = self.output.as_ref().unwrap_or(&self.embed);
        let start = out.len();
        out.resize(start + m * c.vocab, 0.0);
        backend.matmul(lm_head, head_norm, m, &mut out[start..]);
        Ok(())
    }
}

/// Checks a step against the model and a KV arena of `kv_shape` = (head_dim, block_size, num_blocks); returns
/// the step's total tokens. Shared by the CPU forward and its GPU twin.
pub(super) fn validate_step(
    c: &ModelConfig,
    kv_shape: (usize, usize, usize),
    seqs: &[ForwardSeq<'_>],
) -> Result<usize, ModelError> {
    let (head_dim, block_size, num_blocks) = kv_shape;
    if head_dim != c.head_dim {
        return Err(invalid(format!("KV storage head_dim {head_dim} != model head_dim {}", c.head_dim)));
    }
    let n_tables = c.n_kv_tables();
    let mut total = 0usize;
    for (si, s) in seqs.iter().enumerate() {
        let n = s.tokens.len();
        if n == 0 {
            return Err(invalid(format!("sequence {si} has no tokens")));
        }
        if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= c.vocab) {
            return Err(invalid(format!("sequence {si}: token id {bad} >= vocabulary size {}", c.vocab)));
        }
        let end = (s.start_pos as usize).checked_add(n).filter(|&e| e <= c.ctx_len).ok_or_else(|| {
            invalid(format!(
                "sequence {si}: positions {}..{} exceed the context length {}",
                s.start_pos,
                s.start_pos as usize + n,
                c.ctx_len
            ))
        })?;
        debug_assert!(end <= u32::MAX as usize);
        if s.tables.len() != n_tables || s.prior_lens.len() != n_tables {
            return Err(invalid(format!(
                "sequence {si}: {} tables and {} lengths, expected n_layers * n_kv_heads = {n_tables}",
                s.tables.len(),
                s.prior_lens.len()
            )));
        }
        for (ti, (table, &prior)) in s.tables.iter().zip(s.prior_lens).enumerate() {
            let need = prior.checked_add(n).ok_or_else(|| invalid(format!("sequence {si}: cache length overflows")))?;
            let cap = table.len().saturating_mul(block_size);
            if cap < need {
                return Err(invalid(format!(
                    "sequence {si}, table {ti} (layer {}, kv-head {}): {} blocks hold {cap} slots, need {need}",
                    ti / c.n_kv_heads,
                    ti % c.n_kv_heads,
                    table.len()
                )));
            }
            if let Some(&b) = table.iter().find(|&&b| b as usize >= num_blocks) {
                return Err(invalid(format!(
                    "sequence {si}, table {ti}: block {b} >= {num_blocks} blocks in KV storage"
                )));
            }
        }
        total = total.checked_add(n).ok_or_else(|| invalid("too many tokens".into()))?;
    }
    Ok(total)
}

/// The post-RoPE queries a step captures for the eviction policies: per batch sequence, its last `capture_q`
/// tokens' queries as `[layer][capture_q][q_dim]`, the sequences back to back in batch order. The CPU forward
/// (in [`Scratch`]) and its GPU twin fill the same layout, so the policies read either alike.
#[derive(Debug, Default)]
pub struct CapturedQueries {
    q: Vec<f32>,
    /// Each batch sequence's `(start, len)` in `q`.
    at: Vec<(usize, usize)>,
    q_dim: usize,
}

impl CapturedQueries {
    /// Batch sequence `seq`'s captured queries (empty when it captured none).
    pub fn of(&self, seq: usize) -> &[f32] {
        let (at, n) = self.at.get(seq).copied().unwrap_or((0, 0));
        self.q.get(at..at + n).unwrap_or(&[])
    }

    /// Sizes the buffer for the step `seqs`; returns how many floats it captures.
    pub(super) fn layout(&mut self, seqs: &[ForwardSeq<'_>], n_layers: usize, q_dim: usize) -> usize {
        self.at.clear();
        self.q_dim = q_dim;
        let mut total = 0;
        for s in seqs {
            let n = s.capture_q.min(s.tokens.len()) * n_layers * q_dim;
            self.at.push((total, n));
            total += n;
        }
        self.q.resize(total, 0.0);
        total
    }

    /// Hands `copy` each capturing sequence's destination for layer `li` and the range of the batch's
    /// `[rows][q_dim]` queries that goes there.
    pub(super) fn copy_layer<E>(
        &mut self,
        seqs: &[ForwardSeq<'_>],
        li: usize,
        mut copy: impl FnMut(&mut [f32], Range<usize>) -> Result<(), E>,
    ) -> Result<(), E> {
        let qd = self.q_dim;
        let mut row = 0usize;
        for (s, &(at, _)) in seqs.iter().zip(&self.at) {
            let n = s.tokens.len();
            let cap = s.capture_q.min(n);
            if cap > 0 {
                let dst = at + li * cap * qd;
                copy(&mut self.q[dst..dst + cap * qd], (row + n - cap) * qd..(row + n) * qd)?;
            }
            row += n;
        }
        Ok(())
    }
}

/// The step's rows: every sequence's token ids and RoPE positions in batch order, and the rows whose logits are
/// wanted (`out_rows`, in output order). Shared by the CPU forward and its GPU twin, so both lay out a batch alike.
pub(super) fn step_rows(
    seqs: &[ForwardSeq<'_>],
    ids: &mut Vec<u32>,
    positions: &mut Vec<u32>,
    out_rows: &mut Vec<usize>,
) {
    ids.clear();
    positions.clear();
    out_rows.clear();
    let mut row = 0usize;
    for s in seqs {
        let n = s.tokens.len();
        ids.extend_from_slice(s.tokens);
        positions.extend((0..n as u32).map(|i| s.start_pos + i));
        match s.logits {
            LogitsWanted::Last => out_rows.push(row + n - 1),
            LogitsWanted::All => out_rows.extend(row..row + n),
            LogitsWanted::None => {}
        }
        row += n;
    }
}

/// Each sequence's view of layer `li` for the attention kernels (its rows in the step, that layer's tables and
/// lengths), into `out`. Shared by the CPU forward and its GPU twin.
pub(super) fn layer_views<'s, 'a: 's>(seqs: &'s [ForwardSeq<'a>], li: usize, nkv: usize, out: &mut Vec<AttnSeq<'s>>) {
    out.clear();
    let mut q_row = 0usize;
    for s in seqs {
        let r = li * nkv..(li + 1) * nkv;
        out.push(AttnSeq { q_row, n_new: s.tokens.len(), tables: &s.tables[r.clone()], prior_lens: &s.prior_lens[r] });
        q_row += s.tokens.len();
    }
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Empties a vector of attention views and hands its allocation to a new lifetime, as [`recycle_sinks`] does.
#[allow(clippy::unnecessary_filter_map)] // `filter` cannot change the element lifetime; `filter_map` can.
fn recycle_views<'b>(mut v: Vec<AttnSeq<'_>>) -> Vec<AttnSeq<'b>> {
    v.clear();
    v.into_iter().filter_map(|_| None).collect()
}

/// Empties a sink vector and hands its allocation to a new lifetime (the in-place `collect` keeps the buffer, as
/// the engine's batch recycling does), so the layers of one step share one allocation.
#[allow(clippy::unnecessary_filter_map)] // `filter` cannot change the element lifetime; `filter_map` can.
fn recycle_sinks<'b>(mut v: Vec<AttnProbs<'_>>) -> Vec<AttnProbs<'b>> {
    v.clear();
    v.into_iter().filter_map(|_| None).collect()
}
