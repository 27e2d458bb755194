//! The llama forward pass on an NVIDIA GPU ([`CudaLlama`], feature `cuda`): the GPU twin of
//! [`LlamaModel::forward`], step for step.
//!
//! Weights are uploaded once and dequantised to f16 on the device (GGUF Q4_1/Q8_0 → f16); activations stay in
//! device f32 buffers; every projection is a cuBLAS GEMM over f16 inputs with f32 accumulation, and the o- and
//! down-projections add straight into the residual stream (beta = 1). The KV cache lives in device f16 arenas
//! ([`CudaKv`]) with the same head-paged block layout, block tables and lengths as the CPU's [`KvStorage`], so the
//! scheduler, block pool and prefix cache drive both alike. Only the logits rows a step asks for come back to the
//! host, through page-locked memory, with the post-RoPE queries a policy asked to capture.
//!
//! A decode step of a small model is bound by the host's launches, not by the GPU, so a step stages every layer's
//! KV-write slots and attention metadata into one buffer and uploads it once, keeps its buffers across steps of the
//! same size, stacks the projections that share an input (q|k|v, gate|up: four GEMMs a layer, not seven), and uses
//! fused kernels where a value only changes type or place (RMSNorm and SiLU·mul straight to f16, the q|k|v split
//! with RoPE in one launch).
//!
//! Not here: the attention sums that H2O and KV-Compress read (the runner captures their queries instead, and the
//! policy scores them with `window_scores`), and CUDA graphs (each step launches its kernels one by one).
//!
//! [`KvStorage`]: pagoda_kernels::KvStorage

use pagoda_kernels::AttnSeq;
use pagoda_kernels::cuda::{AttnPlan, CudaContext, CudaError, CudaKv, CudaWeight, KvWritePlan};
use pagoda_kernels::cudarc::driver::{CudaSlice, DevicePtr, PinnedHostSlice};

use super::config::ModelConfig;
use super::error::ModelError;
use super::llama::{CapturedQueries, ForwardSeq, LlamaModel, layer_views, step_rows, validate_step};

fn gpu_err(e: CudaError) -> ModelError {
    ModelError::Kernel(format!("cuda: {e}"))
}

/// One layer's weights. The projections that read the same input are stacked into one matrix each (q|k|v, and
/// gate|up), so a layer runs four GEMMs instead of seven: a small model's decode step is bound by the host's
/// launches.
struct CudaLayer {
    attn_norm: CudaSlice<f32>,
    wqkv: CudaWeight,
    wo: CudaWeight,
    ffn_norm: CudaSlice<f32>,
    w_gate_up: CudaWeight,
    w_down: CudaWeight,
}

/// Device activations for steps of exactly one row count ([`sized`]): the kernels' shape checks see buffers of
/// exactly the step's size.
struct Buffers {
    x: CudaSlice<f32>,
    /// The normalised `x`, rounded to f16 for the GEMMs (q|k|v and gate|up read the same copy).
    xn_h: CudaSlice<u16>,
    /// The stacked q|k|v projection, `[rows][q_dim + 2 * kv_dim]`, split (and rotated) into q, k and v.
    qkv: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    attn_h: CudaSlice<u16>,
    /// The stacked gate|up projection, `[rows][2 * ffn]`.
    gate_up: CudaSlice<f32>,
    gate_h: CudaSlice<u16>,
}

impl Buffers {
    fn new(cx: &CudaContext, c: &ModelConfig, rows: usize) -> Result<Buffers, CudaError> {
        Ok(Buffers {
            x: cx.zeros(rows * c.hidden)?,
            xn_h: cx.zeros(rows * c.hidden)?,
            qkv: cx.zeros(rows * (c.q_dim() + 2 * c.kv_dim()))?,
            q: cx.zeros(rows * c.q_dim())?,
            k: cx.zeros(rows * c.kv_dim())?,
            v: cx.zeros(rows * c.kv_dim())?,
            attn: cx.zeros(rows * c.q_dim())?,
            attn_h: cx.zeros(rows * c.q_dim())?,
            gate_up: cx.zeros(rows * 2 * c.ffn)?,
            gate_h: cx.zeros(rows * c.ffn)?,
        })
    }
}

/// A llama model and its KV cache on one GPU.
pub struct CudaLlama {
    cx: CudaContext,
    config: ModelConfig,
    embed: CudaWeight,
    layers: Vec<CudaLayer>,
    norm: CudaSlice<f32>,
    /// `None`: the LM head is the embedding (tied).
    output: Option<CudaWeight>,
    kv: CudaKv,
    /// Activations and LM-head buffers, each with the row count it was made for.
    bufs: Option<(usize, Buffers)>,
    head: Option<(usize, HeadBuffers)>,
    /// Page-locked host memory the logits come back through, grown to the most rows a step has asked for: a
    /// pageable copy of a batch's logits (vocab × rows × 4 bytes, 6 MB for 32 SmolLM2 rows) took milliseconds.
    logits_host: Option<PinnedHostSlice<f32>>,
    /// The split-K partials of decode attention (outputs, then (max, sum) pairs), shared by every layer of a step
    /// and grown as steps need.
    attn_ws: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    // Host-side step bookkeeping, reused.
    ids: Vec<u32>,
    positions: Vec<u32>,
    out_rows: Vec<usize>,
    /// The host copy of a step's metadata: every layer's KV-write slots and attention tables, uploaded once.
    stage: Vec<u32>,
    plans: Vec<(KvWritePlan, AttnPlan)>,
}

/// What a step returns: its logits rows, or each row's argmax token.
enum HeadOut<'a> {
    Logits(&'a mut Vec<f32>),
    Greedy(&'a mut Vec<u32>),
}

/// The LM head's device buffers for steps with one count of logits rows ([`sized`]).
struct HeadBuffers {
    gathered: CudaSlice<f32>,
    half: CudaSlice<u16>,
    logits: CudaSlice<f32>,
    /// Each row's argmax, for greedy steps.
    tokens: CudaSlice<u32>,
}

impl HeadBuffers {
    fn new(cx: &CudaContext, c: &ModelConfig, rows: usize) -> Result<HeadBuffers, CudaError> {
        Ok(HeadBuffers {
            gathered: cx.zeros(rows * c.hidden)?,
            half: cx.zeros(rows * c.hidden)?,
            logits: cx.zeros(rows * c.vocab)?,
            tokens: cx.zeros(rows)?,
        })
    }
}

/// The buffers in `slot` for steps of `rows` rows: kept while consecutive steps have that count (steady decode),
/// replaced when it changes, the old set freed first so peak memory holds one. Allocations go through the
/// stream-ordered pool, so a new set costs little.
fn sized<T>(
    slot: &mut Option<(usize, T)>,
    rows: usize,
    make: impl FnOnce() -> Result<T, CudaError>,
) -> Result<&mut T, CudaError> {
    if slot.as_ref().is_some_and(|(r, _)| *r != rows) {
        *slot = None;
    }
    let (_, buffers) = match slot {
        Some(s) => s,
        empty => empty.insert((rows, make()?)),
    };
    Ok(buffers)
}

impl std::fmt::Debug for CudaLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaLlama").field("device", &self.cx.info().name).field("config", &self.config).finish()
    }
}

impl CudaLlama {
    /// Uploads `model` to the GPU of `cx` and allocates `num_blocks` f16 KV blocks of `block_size` slots.
    pub fn new(
        cx: CudaContext,
        model: &LlamaModel,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<CudaLlama, ModelError> {
        let c = model.config().clone();
        let w = |m| CudaWeight::from_qmatrix(&cx, m).map_err(gpu_err);
        let v = |x: &[f32]| cx.upload(x).map_err(gpu_err);
        let layers = model
            .layers
            .iter()
            .map(|l| {
                let stack = |parts: &[&CudaWeight]| CudaWeight::stacked(&cx, parts).map_err(gpu_err);
                // Each part is uploaded, stacked, then dropped, so peak memory holds one layer's parts twice.
                let (wq, wk, wv) = (w(&l.wq)?, w(&l.wk)?, w(&l.wv)?);
                let (w_gate, w_up) = (w(&l.w_gate)?, w(&l.w_up)?);
                Ok(CudaLayer {
                    attn_norm: v(&l.attn_norm)?,
                    wqkv: stack(&[&wq, &wk, &wv])?,
                    wo: w(&l.wo)?,
                    ffn_norm: v(&l.ffn_norm)?,
                    w_gate_up: stack(&[&w_gate, &w_up])?,
                    w_down: w(&l.w_down)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let embed = w(&model.embed)?;
        let output = model.output.as_ref().map(w).transpose()?;
        let norm = v(&model.norm)?;
        let kv = CudaKv::new(&cx, num_blocks, block_size, c.head_dim).map_err(gpu_err)?;
        cx.synchronize().map_err(gpu_err)?;
        Ok(CudaLlama {
            cx,
            config: c,
            embed,
            layers,
            norm,
            output,
            kv,
            bufs: None,
            head: None,
            logits_host: None,
            attn_ws: None,
            ids: Vec::new(),
            positions: Vec::new(),
            out_rows: Vec::new(),
            stage: Vec::new(),
            plans: Vec::new(),
        })
    }

    /// The GPU this model runs on.
    pub fn device(&self) -> &CudaContext {
        &self.cx
    }

    /// The GPU and the model's KV arenas on it.
    pub fn kv(&self) -> (&CudaContext, &CudaKv) {
        (&self.cx, &self.kv)
    }

    /// The GPU and the model's KV arenas, to write blocks into.
    pub fn kv_mut(&mut self) -> (&CudaContext, &mut CudaKv) {
        (&self.cx, &mut self.kv)
    }

    /// Runs one batched step; appends logits rows (vocab each) for each sequence in order to `out`, exactly as
    /// [`LlamaModel::forward`] does, and copies the post-RoPE queries of each sequence's last `capture_q` tokens
    /// into `captured`. Inputs are validated first with the same checks; on error nothing is written.
    /// `attention_sums` is not served on the GPU and is ignored (the engine asks for captured queries instead).
    pub fn forward(
        &mut self,
        seqs: &[ForwardSeq<'_>],
        out: &mut Vec<f32>,
        captured: &mut CapturedQueries,
    ) -> Result<(), ModelError> {
        self.step(seqs, HeadOut::Logits(out), captured)
    }

    /// [`CudaLlama::forward`] that appends each logits row's argmax token to `tokens` instead of the row: the
    /// tokens are picked on the GPU (`argmax_rows`, the engine's greedy rule) and only they come back.
    pub fn forward_greedy(
        &mut self,
        seqs: &[ForwardSeq<'_>],
        tokens: &mut Vec<u32>,
        captured: &mut CapturedQueries,
    ) -> Result<(), ModelError> {
        self.step(seqs, HeadOut::Greedy(tokens), captured)
    }

    fn step(
        &mut self,
        seqs: &[ForwardSeq<'_>],
        out: HeadOut<'_>,
        captured: &mut CapturedQueries,
    ) -> Result<(), ModelError> {
        let kv_shape = (self.kv.head_dim(), self.kv.block_size(), self.kv.num_blocks());
        let total = validate_step(&self.config, kv_shape, seqs)?;
        captured.layout(seqs, self.config.n_layers, self.config.n_heads * self.config.head_dim);
        if total == 0 {
            return Ok(());
        }
        step_rows(seqs, &mut self.ids, &mut self.positions, &mut self.out_rows);
        self.run(seqs, total, out, captured).map_err(gpu_err)
    }

    fn run(
        &mut self,
        seqs: &[ForwardSeq<'_>],
        total: usize,
        out: HeadOut<'_>,
        captured: &mut CapturedQueries,
    ) -> Result<(), CudaError> {
        let c = &self.config;
        let cx = &self.cx;
        let (nkv, scale) = (c.n_kv_heads, 1.0 / (c.head_dim as f32).sqrt());
        let b = sized(&mut self.bufs, total, || Buffers::new(cx, c, total))?;
        let started = std::time::Instant::now();
        // Every layer's KV-write slots and attention metadata go up in one copy, before any layer runs.
        self.stage.clear();
        self.plans.clear();
        let mut attn_seqs: Vec<AttnSeq<'_>> = Vec::with_capacity(seqs.len());
        for li in 0..c.n_layers {
            layer_views(seqs, li, nkv, &mut attn_seqs);
            let write = cx.stage_kv_write(&self.kv, total, &attn_seqs, nkv, &mut self.stage)?;
            let attn = cx.stage_attention(&self.kv, &attn_seqs, total, c.n_heads, nkv, &mut self.stage)?;
            self.plans.push((write, attn));
        }
        let meta = cx.upload(&self.stage)?;
        let parts = self.plans.iter().map(|(_, a)| a.workspace_parts()).max().unwrap_or(0);
        if parts > 0 && self.attn_ws.as_ref().is_none_or(|(_, ml)| ml.len() < parts * 2) {
            // Grown by doubling, so a slowly lengthening batch does not reallocate every step.
            let parts = parts.next_power_of_two();
            self.attn_ws = None;
            self.attn_ws = Some((cx.zeros(parts * c.head_dim)?, cx.zeros(parts * 2)?));
        }
        let ids = cx.upload(&self.ids)?;
        let positions = cx.upload(&self.positions)?;
        cx.embedding(&self.embed, &ids, &mut b.x)?;

        for (li, (layer, (write, attn))) in self.layers.iter().zip(&self.plans).enumerate() {
            cx.rmsnorm_f16(&b.x, &layer.attn_norm, c.rms_eps, &mut b.xn_h)?;
            cx.gemm_f16(&layer.wqkv, &b.xn_h, total, &mut b.qkv)?;
            let heads = (c.n_heads, nkv);
            cx.rope_split_qkv(&b.qkv, &mut b.q, &mut b.k, &mut b.v, &positions, heads, c.head_dim, c.rope_theta)?;
            captured.copy_layer(seqs, li, |dst, src| cx.stream().memcpy_dtoh(&b.q.slice(src), dst))?;

            cx.run_staged_kv_write(write, &meta, &mut self.kv, &b.k, &b.v)?;
            let ws = self.attn_ws.as_mut().map(|(o, ml)| (o, ml));
            cx.run_staged_attention(attn, &meta, ws, &b.q, &self.kv, scale, &mut b.attn)?;
            cx.f32_to_f16(&b.attn, &mut b.attn_h)?;
            cx.gemm_f16_accumulate(&layer.wo, &b.attn_h, total, &mut b.x)?;

            cx.rmsnorm_f16(&b.x, &layer.ffn_norm, c.rms_eps, &mut b.xn_h)?;
            cx.gemm_f16(&layer.w_gate_up, &b.xn_h, total, &mut b.gate_up)?;
            cx.silu_mul_stacked_f16(&b.gate_up, c.ffn, &mut b.gate_h)?;
            cx.gemm_f16_accumulate(&layer.w_down, &b.gate_h, total, &mut b.x)?;
        }

        let m = self.out_rows.len();
        let layers_queued = started.elapsed();
        if m == 0 {
            // Nothing comes back, but the step's KV writes must be done before the caller reuses its tables.
            return cx.synchronize();
        }
        let hidden = c.hidden;
        let head = sized(&mut self.head, m, || HeadBuffers::new(cx, c, m))?;
        // A decode step wants every row's logits, in order: the head reads the hidden states in place.
        let every_row = m == total && self.out_rows.iter().enumerate().all(|(i, &r)| i == r);
        if !every_row {
            for (i, &r) in self.out_rows.iter().enumerate() {
                let src = b.x.slice(r * hidden..(r + 1) * hidden);
                let mut dst = head.gathered.slice_mut(i * hidden..(i + 1) * hidden);
                cx.stream().memcpy_dtod(&src, &mut dst)?;
            }
        }
        let head_in = if every_row { &b.x } else { &head.gathered };
        cx.rmsnorm_f16(head_in, &self.norm, c.rms_eps, &mut head.half)?;
        let lm_head = self.output.as_ref().unwrap_or(&self.embed);
        cx.gemm_f16(lm_head, &head.half, m, &mut head.logits)?;
        let n = m * c.vocab;
        let queued = started.elapsed();
        let greedy = matches!(out, HeadOut::Greedy(_));
        let logits_out = match out {
            HeadOut::Greedy(tokens) => {
                cx.argmax_rows(&head.logits, c.vocab, &mut head.tokens)?;
                let start = tokens.len();
                tokens.resize(start + m, 0);
                // Exactly m tokens: cudarc's memcpy_dtoh copies the length of the host slice.
                cx.stream().memcpy_dtoh(&head.tokens, &mut tokens[start..])?;
                None
            }
            HeadOut::Logits(out) => {
                if self.logits_host.as_ref().is_some_and(|h| h.len() < n) {
                    self.logits_host = None;
                }
                let host = match &mut self.logits_host {
                    Some(h) => h,
                    // SAFETY: page-locked memory that only this model reads and writes, through the one stream; no
                    // flags, so it is cached (not write-combined) memory that the host reads fast.
                    empty => empty.insert(unsafe { cx.driver().alloc_pinned_with_flags::<f32>(n, 0) }?),
                };
                // Into the first n floats of the buffer, which may be longer: cudarc's memcpy_dtoh copies the whole
                // host slice, so a buffer grown by an earlier, wider step would read past this step's logits.
                let dst = &mut host.as_mut_slice()?[..n];
                let (src, _read) = head.logits.device_ptr(cx.stream());
                // SAFETY: dst is n page-locked floats and head.logits holds m * vocab = n floats on this stream; the
                // stream is synchronised below before dst is read.
                unsafe {
                    pagoda_kernels::cudarc::driver::result::memcpy_dtoh_async(dst, src, cx.stream().cu_stream())
                }?;
                Some(out)
            }
        };
        cx.synchronize()?;
        let gpu_done = started.elapsed();
        if let (Some(out), Some(host)) = (logits_out, &self.logits_host) {
            out.extend_from_slice(&host.as_slice()?[..n]);
        }
        // Where a step's time goes: host enqueueing (layers, then the head), waiting for the GPU and the copy of
        // the tokens or the logits (into page-locked memory), and the copy of the logits from there into `out`.
        tracing::debug!(
            rows = total,
            logits_rows = m,
            greedy,
            layers_queued_us = layers_queued.as_micros() as u64,
            queued_us = queued.as_micros() as u64,
            gpu_and_copy_us = (gpu_done - queued).as_micros() as u64,
            host_copy_us = (started.elapsed() - gpu_done).as_micros() as u64,
            "cuda step"
        );
        Ok(())
    }
}
