//! Dequantise-on-load paged attention: the same online-softmax attention as [`super::attention`], reading K and V
//! straight from an [`EncodedKv`] arena instead of f32 blocks. Each block is decoded in registers (AVX2) or one row
//! at a time into a stack buffer (scalar) as the kernel reaches it, so the memory traffic is the encoded size.

use super::{CpuBackend, Simd, attention};
use crate::codec::{Codec, EncodedKv, HEADER_LEN, Half, MAX_BLOCK_SIZE, MAX_HEAD_DIM, decode_row, rotated_copy};
use crate::paged::AttnSeq;

#[cfg(target_arch = "x86_64")]
use super::codecs_avx2;

/// Paged attention over an encoded arena; the contract is [`crate::Backend::paged_attention`]'s with `kv` an
/// [`EncodedKv`]. Every block a sequence reads must hold at least the slots read from it (its header's `filled`);
/// this is checked, like the table lengths and block ids, before any work starts.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_encoded(
    be: &CpuBackend,
    q: &[f32],
    kv: &EncodedKv,
    seqs: &[AttnSeq<'_>],
    n_heads: usize,
    n_kv_heads: usize,
    scale: f32,
    out: &mut [f32],
) {
    let hd = kv.head_dim();
    let w = n_heads * hd;
    assert!(n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads), "n_heads must be a multiple of n_kv_heads");
    assert_eq!(q.len(), out.len(), "paged_attention_encoded: q and out differ in length");
    assert!(w > 0 && q.len().is_multiple_of(w), "paged_attention_encoded: q must be [rows][n_heads*head_dim]");
    let rows = q.len() / w;
    let bs = kv.block_size();
    for s in seqs {
        attention::check_seq(s, n_kv_heads, rows);
        for h in 0..n_kv_heads {
            let len = s.prior_lens[h] + s.n_new;
            let need = len.div_ceil(bs);
            assert!(s.tables[h].len() >= need, "AttnSeq: block table too short for prior_len + n_new");
            for (bi, &b) in s.tables[h][..need].iter().enumerate() {
                let filled = kv.filled(b as usize).unwrap_or_else(|e| panic!("paged_attention_encoded: {e}"));
                assert!(filled >= (len - bi * bs).min(bs), "block {b} holds {filled} slots, attention reads more");
            }
        }
    }
    attention::check_disjoint(seqs);
    let simd = be.simd();
    attention::par_queries(
        be,
        q,
        seqs,
        n_heads,
        n_kv_heads,
        hd,
        out,
        &[],
        &|qv, table, len, acc, _| attend_one(simd, qv, kv, table, len, scale, acc),
        None,
    );
}

/// Attention of one query over the first `len` slots of `table` (ids and fill checked by the caller).
fn attend_one(simd: Simd, q: &[f32], kv: &EncodedKv, table: &[u32], len: usize, scale: f32, out: &mut [f32]) {
    let (arena, block_len) = kv.raw();
    let bs = kv.block_size();
    let ids = &table[..len.div_ceil(bs)];
    let codec = kv.codec();
    #[cfg(target_arch = "x86_64")]
    if simd.has_avx2() {
        // The vector kernel scores rotated keys against the rotated query ((Hq)·(Hk) = q·k), reading them as
        // e4m3 codes plus the block's rotated channel mean. The buffer is cleared only for that codec: this runs
        // per (query, head).
        let mut rotated: [f32; MAX_HEAD_DIM];
        let q = match codec {
            Codec::Fp8E4m3Rotated => {
                rotated = [0.0; MAX_HEAD_DIM];
                &*rotated_copy(q, &mut rotated)
            }
            _ => q,
        };
        // SAFETY: block ids were checked against the arena by `filled` in the caller, every block in the arena
        // was written by the encoder or validated on load, the shape passed `check_shape` (bs <= 256) and the
        // CPU features were detected before Simd::Avx2 was selected.
        let r = unsafe {
            match q.len() {
                32 => codecs_avx2::attend_one::<4>(codec, q, arena, block_len, bs, ids, len, scale, out),
                64 => codecs_avx2::attend_one::<8>(codec, q, arena, block_len, bs, ids, len, scale, out),
                96 => codecs_avx2::attend_one::<12>(codec, q, arena, block_len, bs, ids, len, scale, out),
                128 => codecs_avx2::attend_one::<16>(codec, q, arena, block_len, bs, ids, len, scale, out),
                _ => false,
            }
        };
        if r {
            return;
        }
    }
    let _ = simd;
    attend_one_scalar(codec, q, arena, block_len, bs, ids, len, scale, out);
}

/// The portable reference: each row is decoded by [`decode_row`] (exactly what `decode_block` produces, rotated
/// keys turned back) and folded in with the same arithmetic as [`super::scalar::attend_block`].
#[allow(clippy::too_many_arguments)]
fn attend_one_scalar(
    codec: Codec,
    q: &[f32],
    arena: &[u8],
    block_len: usize,
    bs: usize,
    ids: &[u32],
    len: usize,
    scale: f32,
    out: &mut [f32],
) {
    let hd = q.len();
    let khl = codec.half_len(Half::K, bs, hd);
    let mut row = [0.0f32; MAX_HEAD_DIM];
    let row = &mut row[..hd];
    let mut sc = [0.0f32; MAX_BLOCK_SIZE];
    out.fill(0.0);
    let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
    for (bi, &b) in ids.iter().enumerate() {
        let n = (len - bi * bs).min(bs);
        let blk = &arena[b as usize * block_len + HEADER_LEN..(b as usize + 1) * block_len];
        let (kb, vb) = blk.split_at(khl);
        let mut mx = m;
        for (i, s) in sc[..n].iter_mut().enumerate() {
            decode_row(codec, Half::K, bs, hd, kb, i, row);
            *s = super::scalar::dot_f32(q, row) * scale;
            mx = mx.max(*s);
        }
        let corr = (m - mx).exp();
        l *= corr;
        for a in out.iter_mut() {
            *a *= corr;
        }
        for (i, &s) in sc[..n].iter().enumerate() {
            let p = (s - mx).exp();
            l += p;
            decode_row(codec, Half::V, bs, hd, vb, i, row);
            for (a, &v) in out.iter_mut().zip(row.iter()) {
                *a += p * v;
            }
        }
        m = mx;
    }
    let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
    for a in out.iter_mut() {
        *a *= inv;
    }
}

impl CpuBackend {
    /// Paged attention reading K and V from compressed blocks (dequantise on load); see
    /// [`paged_attention_encoded`].
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_encoded(
        &self,
        q: &[f32],
        kv: &EncodedKv,
        seqs: &[AttnSeq<'_>],
        n_heads: usize,
        n_kv_heads: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        paged_attention_encoded(self, q, kv, seqs, n_heads, n_kv_heads, scale, out);
    }
}
