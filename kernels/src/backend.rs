//! The [`Backend`] trait: every piece of model math the forward pass needs, implemented per device.

use crate::cpu::lora::LoraSegment;
use crate::paged::{AttnProbs, AttnSeq, KvStorage};
use crate::quant::QMatrix;
use crate::rope::RopeTable;

/// Model math on one device. All methods take `&self`; implementations parallelise internally.
pub trait Backend: Send + Sync {
    /// Short name for logs ("cpu-avx2", "cpu-scalar", ...).
    fn name(&self) -> &'static str;
    /// `out[n][w.rows()] = x[n][w.cols()] · wᵀ`
    fn matmul(&self, w: &QMatrix, x: &[f32], n: usize, out: &mut [f32]);
    /// [`Backend::matmul`] of several weights over the same `x` (a layer's Q, K and V; its gate and up):
    /// `outs[i][n][ws[i].rows()] = x · ws[i]ᵀ`. A backend may share the work the calls have in common.
    fn matmul_shared_input(&self, ws: &[&QMatrix], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
        assert_eq!(ws.len(), outs.len(), "matmul_shared_input: one output per weight");
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(w, x, n, out);
        }
    }
    /// `out[i] = table.row(ids[i])`; out: `[ids.len()][table.cols()]`.
    fn embedding(&self, table: &QMatrix, ids: &[u32], out: &mut [f32]);
    /// x, out: `[n][weight.len()]`
    fn rmsnorm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]);
    /// x: `[table.len()][n_heads * table.head_dim()]`; llama "normal" RoPE: rotates each head's adjacent pairs
    /// (2i, 2i+1) of row `r` by the angles of the table's position `r` ([`RopeTable`]).
    fn rope(&self, x: &mut [f32], table: &RopeTable, n_heads: usize);
    /// `gate[i] = silu(gate[i]) * up[i]`
    fn silu_mul(&self, gate: &mut [f32], up: &[f32]);
    /// Writes this step's K and V (rows `[q_row, q_row+n_new)` of k, v: `[rows][n_kv_heads*head_dim]`)
    /// into slots `prior_lens[h] .. prior_lens[h]+n_new` of each kv-head.
    fn kv_write(&self, kv: &mut KvStorage, k: &[f32], v: &[f32], seqs: &[AttnSeq<'_>], n_kv_heads: usize);
    /// LoRA deltas (punica's SGMV): for each segment, in row order and disjoint, `y[t] += (x[t] · aᵀ) · bt` over its
    /// rows, with x: `[n][input]`, y: `[n][out]`, `a`: `[rank][input]` and `bt`: `[rank][out]` (B transposed, its
    /// scale folded in), both f16 bits; rank at most [`crate::cpu::lora::MAX_LORA_RANK`].
    fn lora_add(&self, x: &[f32], input: usize, y: &mut [f32], out: usize, segments: &[LoraSegment<'_>]);
    /// q, out: `[rows][n_heads*head_dim]`; GQA: query head qh reads kv-head qh / (n_heads / n_kv_heads).
    #[allow(clippy::too_many_arguments)]
    fn paged_attention(
        &self,
        q: &[f32],
        kv: &KvStorage,
        seqs: &[AttnSeq<'_>],
        n_heads: usize,
        n_kv_heads: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        self.paged_attention_with_probs(q, kv, seqs, n_heads, n_kv_heads, scale, out, &mut []);
    }
    /// [`Backend::paged_attention`] that also writes the softmax probabilities of the sequences named in `probs`
    /// (each sequence at most once) into their rows, as [`AttnProbs`] lays them out.
    #[allow(clippy::too_many_arguments)]
    fn paged_attention_with_probs(
        &self,
        q: &[f32],
        kv: &KvStorage,
        seqs: &[AttnSeq<'_>],
        n_heads: usize,
        n_kv_heads: usize,
        scale: f32,
        out: &mut [f32],
        probs: &mut [AttnProbs<'_>],
    );
}
