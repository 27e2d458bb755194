//! KV block codecs on the GPU (`codecs.cu`): [`CudaContext::encode_blocks`] encodes blocks of the f16 arenas into
//! the self-describing byte format the tiers store, [`CudaContext::decode_blocks`] decodes such blocks back into
//! arena blocks: int8 and fp8 e4m3 (encoded by `encode_blocks_q8`), int4_kivi and int2_kivi (`encode_blocks_kivi`),
//! all decoded by `decode_blocks`. The lossless formats (f32, f16, bf16) are plain copies and stay on the host.
//!
//! CPU twins: `Codec::encode_block` over the arena's values (the bytes are identical) and `decode_block` followed by
//! the arena's f16 rounding (the values are identical).

use super::attention::{PagedKv, SMEM_LIMIT};
use super::context::CudaContext;
use super::error::CudaError;
use super::kv::{CudaKv, per_block_cfg, sorted_distinct, visible_blocks};
use super::ops::to_i32;
use crate::codec::{Codec, EncodedKv, validate_block};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Most blocks of a [`CudaEncodedKv`]: attention names a slot as `block << 8 | slot` (block_size is at most 256).
const MAX_ENCODED_BLOCKS: usize = 1 << 24;

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
        Codec::F32 | Codec::F16 | Codec::Bf16 | Codec::Fp8E4m3Rotated => {
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
        // Attention names a slot by its block and its place in the block in one 32-bit word (block << 8 | slot).
        if kv.num_blocks() > MAX_ENCODED_BLOCKS {
            return Err(CudaError::invalid(OP, format!("at most {MAX_ENCODED_BLOCKS} blocks")));
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

impl CudaEncodedKv {
    /// The arena and the bytes of one block.
    pub(crate) fn arena(&self) -> (&CudaSlice<u8>, usize) {
        (&self.bytes, self.block_len)
    }
}

impl PagedKv for CudaEncodedKv {
    fn block_size(&self) -> usize {
        self.block_size
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn check_table(&self, op: &'static str, table: &[u32], slots: usize) -> Result<(), CudaError> {
        let bs = self.block_size;
        // The filled counts also bound the block ids: an id past them is outside the arena.
        for (bi, &b) in visible_blocks(op, table, slots, bs)?.iter().enumerate() {
            let filled = *self.filled.get(b as usize).ok_or_else(|| {
                CudaError::invalid(op, format!("block {b} is outside the arena of {}", self.filled.len()))
            })?;
            if filled < (slots - bi * bs).min(bs) {
                return Err(CudaError::invalid(op, format!("block {b} holds {filled} slots, attention reads more")));
            }
        }
        Ok(())
    }
    fn read_bytes(&self, slots: usize) -> usize {
        slots.div_ceil(self.block_size) * self.block_len
    }
    fn codec(&self) -> Option<Codec> {
        Some(self.codec)
    }
    fn num_blocks(&self) -> usize {
        self.filled.len()
    }
}
