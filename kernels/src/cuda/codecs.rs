//! KV block codecs on the GPU (`codecs.cu`): [`CudaContext::encode_blocks`] encodes blocks of the f16 arenas into
//! the self-describing byte format the tiers store, [`CudaContext::decode_blocks`] decodes such blocks back into
//! arena blocks: int8 and fp8 e4m3 (encoded by `encode_blocks_q8`), int4_kivi and int2_kivi (`encode_blocks_kivi`),
//! all decoded by `decode_blocks`. The lossless formats (f32, f16, bf16) are plain copies and stay on the host.
//!
//! CPU twins: `Codec::encode_block` over the arena's values (the bytes are identical) and `decode_block` followed by
//! the arena's f16 rounding (the values are identical).

use super::attention::SMEM_LIMIT;
use super::context::CudaContext;
use super::error::CudaError;
use super::kv::{CudaKv, check_seq, per_block_cfg, sorted_distinct};
use super::ops::{grid_dim, to_i32};
use crate::codec::{Codec, EncodedKv, validate_block};
use crate::paged::AttnSeq;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// The dequantise-on-load attention kernel of `codec`.
fn encoded_attention_kernel(codec: Codec) -> Result<&'static str, CudaError> {
    Ok(match codec {
        Codec::Int8 => "paged_attention_encoded_int8",
        Codec::Fp8E4m3 => "paged_attention_encoded_fp8_e4m3",
        Codec::Int4Kivi => "paged_attention_encoded_int4_kivi",
        Codec::Int2Kivi => "paged_attention_encoded_int2_kivi",
        other => return Err(CudaError::Unsupported(format!("attention over {other} blocks on the GPU"))),
    })
}

/// Codecs the GPU encodes and decodes.
pub const GPU_CODECS: [Codec; 4] = [Codec::Int8, Codec::Fp8E4m3, Codec::Int4Kivi, Codec::Int2Kivi];

/// The kernels' shape arguments for `codec` over `kv`'s blocks.
struct CodecArgs {
    block_size: i32,
    head_dim: i32,
    codec_id: i32,
    /// Bytes of one encoded block.
    block_len: usize,
    /// The codec family's encoder: `encode_blocks_q8` (int8, fp8) or `encode_blocks_kivi`.
    encode_kernel: &'static str,
    /// Dynamic shared memory of the encoder: the KIVI encoder stages a half's f16 scales and mins there.
    encode_smem: u32,
}

fn gpu_codec(op: &'static str, codec: Codec, kv: &CudaKv) -> Result<CodecArgs, CudaError> {
    let encode_kernel = match codec {
        Codec::Int8 | Codec::Fp8E4m3 => "encode_blocks_q8",
        Codec::Int4Kivi | Codec::Int2Kivi => "encode_blocks_kivi",
        Codec::F32 | Codec::F16 | Codec::Bf16 => {
            return Err(CudaError::Unsupported(format!(
                "{op}: codec {codec} on the GPU (int8, fp8_e4m3, int4_kivi and int2_kivi are)"
            )));
        }
    };
    // Also checks the shape against the codec (KIVI packs 2 or 4 channels per byte).
    let block_len =
        codec.encoded_len(kv.block_size(), kv.head_dim()).map_err(|e| CudaError::invalid(op, e.to_string()))?;
    let encode_smem = if encode_kernel == "encode_blocks_kivi" {
        // Two f16 (scale, min) per parameter: a K channel, or a V (slot, group of 32 channels).
        let params = kv.head_dim().max(kv.block_size() * kv.head_dim().div_ceil(crate::codec::KIVI_GROUP));
        let bytes = 4 * params;
        if bytes > SMEM_LIMIT {
            return Err(CudaError::invalid(
                op,
                format!("{codec} of blocks of this shape needs {bytes} B of shared memory"),
            ));
        }
        bytes as u32
    } else {
        0
    };
    Ok(CodecArgs {
        encode_smem,
        block_size: to_i32(op, "block_size", kv.block_size())?,
        head_dim: to_i32(op, "head_dim", kv.head_dim())?,
        codec_id: i32::from(codec.id()),
        block_len,
        encode_kernel,
    })
}

impl CudaContext {
    /// Encodes each `(block, filled)` of `kv` (its first `filled` slots) with `codec`; returns the encoded blocks
    /// back to back, [`Codec::encoded_len`] bytes each.
    pub fn encode_blocks(&self, kv: &CudaKv, codec: Codec, blocks: &[(u32, usize)]) -> Result<Vec<u8>, CudaError> {
        const OP: &str = "encode_blocks";
        let a = gpu_codec(OP, codec, kv)?;
        if blocks.is_empty() {
            return Ok(Vec::new());
        }
        let mut ids = Vec::with_capacity(blocks.len());
        let mut filled = Vec::with_capacity(blocks.len());
        for &(b, f) in blocks {
            if b as usize >= kv.num_blocks() || f > kv.block_size() {
                return Err(CudaError::invalid(OP, format!("block {b} with {f} filled slots is out of range")));
            }
            ids.push(b);
            filled.push(f as i32);
        }
        let (ids, filled) = (self.upload(&ids)?, self.upload(&filled)?);
        let mut out = self.zeros::<u8>(blocks.len() * a.block_len)?;
        let len = a.block_len as i64;
        let (k, v) = kv.arenas();
        // SAFETY: block ids are inside the arenas and filled <= block_size (checked); `out` holds one encoded block
        // of this codec and shape per entry.
        unsafe {
            self.stream()
                .launch_builder(self.func(a.encode_kernel)?)
                .arg(k)
                .arg(v)
                .arg(&ids)
                .arg(&filled)
                .arg(&a.block_size)
                .arg(&a.head_dim)
                .arg(&a.codec_id)
                .arg(&len)
                .arg(&mut out)
                .launch(LaunchConfig { shared_mem_bytes: a.encode_smem, ..per_block_cfg(OP, blocks.len())? })
        }?;
        self.download(&out)
    }

    /// Decodes the encoded blocks in `bytes` (back to back, each validated first as `decode_block` would, and of
    /// `codec` and the arena's shape) into blocks `dst` of `kv`, one each; destinations must be distinct.
    pub fn decode_blocks(&self, kv: &mut CudaKv, codec: Codec, bytes: &[u8], dst: &[u32]) -> Result<(), CudaError> {
        const OP: &str = "decode_blocks";
        let a = gpu_codec(OP, codec, kv)?;
        let block_len = a.block_len;
        if bytes.len() != dst.len() * block_len {
            return Err(CudaError::invalid(
                OP,
                format!("{} bytes for {} blocks of {block_len}", bytes.len(), dst.len()),
            ));
        }
        let distinct = sorted_distinct(dst.iter().copied());
        if distinct.is_none_or(|d| d.last().is_some_and(|&b| b as usize >= kv.num_blocks())) {
            return Err(CudaError::invalid(OP, "destinations must be distinct blocks of the arena"));
        }
        for (i, blk) in bytes.chunks_exact(block_len).enumerate() {
            let h = validate_block(blk).map_err(|e| CudaError::invalid(OP, format!("block {i}: {e}")))?;
            if h.codec != codec || (h.block_size, h.head_dim) != (kv.block_size(), kv.head_dim()) {
                return Err(CudaError::invalid(OP, format!("block {i} is {} of another shape", h.codec)));
            }
        }
        if dst.is_empty() {
            return Ok(());
        }
        let (src, ids) = (self.upload(bytes)?, self.upload(dst)?);
        let len = block_len as i64;
        let (k, v) = kv.arenas_mut();
        // SAFETY: every block was validated (header, length, scales, codes) and matches the arena's shape; the
        // destinations are distinct blocks inside the arenas.
        unsafe {
            self.stream()
                .launch_builder(self.func("decode_blocks")?)
                .arg(&src)
                .arg(&ids)
                .arg(&a.block_size)
                .arg(&a.head_dim)
                .arg(&a.codec_id)
                .arg(&len)
                .arg(k)
                .arg(v)
                .launch(per_block_cfg(OP, dst.len())?)
        }?;
        Ok(())
    }
}

/// An arena of encoded KV blocks on the GPU (one codec and shape), read by
/// [`CudaContext::paged_attention_encoded`]: the device twin of [`EncodedKv`]. Blocks arrive validated (from an
/// [`EncodedKv`], whose blocks enter only through its encoder or a validated load), and their filled counts stay
/// on the host so a launch can be checked without reading the device.
pub struct CudaEncodedKv {
    codec: Codec,
    block_size: usize,
    head_dim: usize,
    block_len: usize,
    filled: Vec<usize>,
    bytes: CudaSlice<u8>,
}

impl CudaEncodedKv {
    /// Uploads every block of `kv`. The lossless formats are refused like [`CudaContext::encode_blocks`] refuses
    /// them.
    pub fn from_host(cx: &CudaContext, kv: &EncodedKv) -> Result<CudaEncodedKv, CudaError> {
        const OP: &str = "CudaEncodedKv::from_host";
        if !GPU_CODECS.contains(&kv.codec()) {
            return Err(CudaError::Unsupported(format!("{OP}: codec {} on the GPU", kv.codec())));
        }
        let filled = (0..kv.num_blocks())
            .map(|b| kv.filled(b).map_err(|e| CudaError::invalid(OP, e.to_string())))
            .collect::<Result<Vec<_>, _>>()?;
        let (raw, block_len) = kv.raw();
        Ok(CudaEncodedKv {
            codec: kv.codec(),
            block_size: kv.block_size(),
            head_dim: kv.head_dim(),
            block_len,
            filled,
            bytes: cx.upload(raw)?,
        })
    }
}

/// Longest head the encoded attention kernel takes (8 channels per lane of a warp).
const ENCODED_MAX_HEAD_DIM: usize = 256;
/// Shortest split of encoded decode attention, and the multiple every split length is.
const ENCODED_MIN_CHUNK: usize = 64;
/// Most splits of one context.
const ENCODED_MAX_SPLITS: usize = 8192;

impl CudaContext {
    /// Paged attention reading K and V straight from encoded blocks (dequantise on load); the contract is
    /// [`crate::Backend::paged_attention`]'s with `kv` encoded: `q` and `out` are `[rows][n_heads * head_dim]`, new
    /// token `j` of a sequence sees the first `prior_len + j + 1` slots of each kv-head's table. Tables, block ids,
    /// each block's filled slots and the disjointness of the sequences' rows are checked before the launch.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_encoded(
        &self,
        q: &CudaSlice<f32>,
        kv: &CudaEncodedKv,
        seqs: &[AttnSeq<'_>],
        n_heads: usize,
        n_kv_heads: usize,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "paged_attention_encoded";
        let (bs, hd) = (kv.block_size, kv.head_dim);
        let w = n_heads * hd;
        if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(CudaError::invalid(OP, "n_heads must be a multiple of n_kv_heads"));
        }
        if hd > ENCODED_MAX_HEAD_DIM || w == 0 || !q.len().is_multiple_of(w) || q.len() != out.len() {
            return Err(CudaError::invalid(OP, "q and out must be [rows][n_heads*head_dim], head_dim <= 256"));
        }
        let rows = q.len() / w;
        let (mut tables, mut ent_row, mut ent_head, mut ent_len, mut ent_tab) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut spans: Vec<(usize, usize)> = Vec::with_capacity(seqs.len());
        for s in seqs {
            check_seq(OP, s, n_kv_heads, rows)?;
            spans.push((s.q_row, s.q_row + s.n_new));
            for (h, (table, &prior)) in s.tables[..n_kv_heads].iter().zip(s.prior_lens).enumerate() {
                let len = prior + s.n_new;
                let need = len.div_ceil(bs);
                if table.len() < need {
                    return Err(CudaError::invalid(
                        OP,
                        format!("block table has {} blocks, {need} needed", table.len()),
                    ));
                }
                // The filled counts also bound the block ids: an id past them is outside the arena.
                for (bi, &b) in table[..need].iter().enumerate() {
                    let filled = *kv.filled.get(b as usize).ok_or_else(|| {
                        CudaError::invalid(OP, format!("block {b} is outside the arena of {}", kv.filled.len()))
                    })?;
                    if filled < (len - bi * bs).min(bs) {
                        return Err(CudaError::invalid(
                            OP,
                            format!("block {b} holds {filled} slots, attention reads more"),
                        ));
                    }
                }
                let tab = to_i32(OP, "table offset", tables.len())?;
                tables.extend_from_slice(&table[..need]);
                for j in 0..s.n_new {
                    ent_row.push(to_i32(OP, "row", s.q_row + j)?);
                    ent_head.push(to_i32(OP, "kv head", h)?);
                    ent_len.push(to_i32(OP, "length", prior + j + 1)?);
                    ent_tab.push(tab);
                }
            }
        }
        spans.sort_unstable();
        if spans.windows(2).any(|p| p[0].1 > p[1].0) {
            return Err(CudaError::invalid(OP, "sequences' query rows overlap"));
        }
        if ent_row.is_empty() {
            return Ok(());
        }
        let group = n_heads / n_kv_heads;
        let entries = ent_row.len();
        // Split-K: enough (entry, head, split) CTAs to fill the device a few times over, in splits of at least
        // ENCODED_MIN_CHUNK slots.
        let max_len = ent_len.iter().copied().max().unwrap_or(1).max(1) as usize;
        let target = 8 * self.info().sm_count.max(1);
        // At most ENCODED_MAX_SPLITS: the merge keeps one weight per split in shared memory.
        let splits =
            target.div_ceil(entries * group).clamp(1, max_len.div_ceil(ENCODED_MIN_CHUNK).min(ENCODED_MAX_SPLITS));
        let chunk = max_len.div_ceil(splits).next_multiple_of(ENCODED_MIN_CHUNK);
        let max_splits = max_len.div_ceil(chunk);
        let parts = entries * group * max_splits;
        let mut part_o = self.zeros::<f32>(parts * hd)?;
        let mut part_ml = self.zeros::<f32>(parts * 2)?;
        let cfg = LaunchConfig {
            grid_dim: (
                grid_dim(OP, "entries", entries, i32::MAX as usize)?,
                grid_dim(OP, "group", group, 65_535)?,
                grid_dim(OP, "splits", max_splits, 65_535)?,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let tables = self.upload(&tables)?;
        let (ent_row, ent_head) = (self.upload(&ent_row)?, self.upload(&ent_head)?);
        let (ent_len, ent_tab) = (self.upload(&ent_len)?, self.upload(&ent_tab)?);
        let block_len = kv.block_len as i64;
        let (n_heads_i, n_kv_i) = (to_i32(OP, "n_heads", n_heads)?, to_i32(OP, "n_kv_heads", n_kv_heads)?);
        let (bs_i, hd_i) = (to_i32(OP, "block_size", bs)?, to_i32(OP, "head_dim", hd)?);
        let (chunk_i, splits_i) = (to_i32(OP, "chunk", chunk)?, to_i32(OP, "splits", max_splits)?);
        // SAFETY: every entry's table lists blocks inside the arena whose filled slots cover the entry's length
        // (checked above); rows are inside q and out and the sequences' rows are disjoint; the arena's blocks are
        // validated encodings of `codec` and this shape (`CudaEncodedKv::from_host`); the workspace holds
        // entries * group * max_splits partials.
        unsafe {
            self.stream()
                .launch_builder(self.func(encoded_attention_kernel(kv.codec)?)?)
                .arg(q)
                .arg(&kv.bytes)
                .arg(&block_len)
                .arg(&tables)
                .arg(&ent_row)
                .arg(&ent_head)
                .arg(&ent_len)
                .arg(&ent_tab)
                .arg(&n_heads_i)
                .arg(&n_kv_i)
                .arg(&bs_i)
                .arg(&hd_i)
                .arg(&scale)
                .arg(&chunk_i)
                .arg(&splits_i)
                .arg(&mut part_o)
                .arg(&mut part_ml)
                .launch(cfg)
        }?;
        let cfg = LaunchConfig {
            grid_dim: (grid_dim(OP, "entries", entries, i32::MAX as usize)?, grid_dim(OP, "group", group, 65_535)?, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: (4 * max_splits) as u32,
        };
        // SAFETY: reads the partials written above (every split below each entry's split count); writes each
        // entry's row and head of out.
        unsafe {
            self.stream()
                .launch_builder(self.func("paged_encoded_reduce")?)
                .arg(&part_o)
                .arg(&part_ml)
                .arg(&ent_row)
                .arg(&ent_head)
                .arg(&ent_len)
                .arg(&n_heads_i)
                .arg(&n_kv_i)
                .arg(&hd_i)
                .arg(&chunk_i)
                .arg(&splits_i)
                .arg(out)
                .launch(cfg)
        }?;
        Ok(())
    }
}
