//! KV block codecs on the GPU (`codecs.cu`): [`CudaContext::encode_blocks`] encodes blocks of the f16 arenas into
//! the self-describing byte format the tiers store, [`CudaContext::decode_blocks`] decodes such blocks back into
//! arena blocks: int8, fp8 e4m3 (`*_q8` kernels), int4_kivi and int2_kivi (`*_kivi` kernels). The lossless formats
//! (f32, f16, bf16) are plain copies and stay on the host.
//!
//! CPU twins: `Codec::encode_block` over the arena's values (the bytes are identical) and `decode_block` followed by
//! the arena's f16 rounding (the values are identical).

use super::context::CudaContext;
use super::error::CudaError;
use super::kv::{CudaKv, sorted_distinct};
use super::ops::{grid_dim, to_i32};
use crate::codec::{Codec, validate_block};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Codecs the GPU encodes and decodes.
pub const GPU_CODECS: [Codec; 4] = [Codec::Int8, Codec::Fp8E4m3, Codec::Int4Kivi, Codec::Int2Kivi];

/// The kernels' shape arguments for `codec` over `kv`'s blocks.
struct CodecArgs {
    block_size: i32,
    head_dim: i32,
    codec_id: i32,
    /// Bytes of one encoded block.
    block_len: usize,
    /// The codec family's kernels: `*_q8` (int8, fp8) or `*_kivi`.
    encode_kernel: &'static str,
    decode_kernel: &'static str,
}

fn gpu_codec(op: &'static str, codec: Codec, kv: &CudaKv) -> Result<CodecArgs, CudaError> {
    let (encode_kernel, decode_kernel) = match codec {
        Codec::Int8 | Codec::Fp8E4m3 => ("encode_blocks_q8", "decode_blocks_q8"),
        Codec::Int4Kivi | Codec::Int2Kivi => ("encode_blocks_kivi", "decode_blocks_kivi"),
        Codec::F32 | Codec::F16 | Codec::Bf16 => {
            return Err(CudaError::Unsupported(format!(
                "{op}: codec {codec} on the GPU (int8, fp8_e4m3, int4_kivi and int2_kivi are)"
            )));
        }
    };
    // Also checks the shape against the codec (KIVI packs 2 or 4 channels per byte).
    let block_len =
        codec.encoded_len(kv.block_size(), kv.head_dim()).map_err(|e| CudaError::invalid(op, e.to_string()))?;
    Ok(CodecArgs {
        block_size: to_i32(op, "block_size", kv.block_size())?,
        head_dim: to_i32(op, "head_dim", kv.head_dim())?,
        codec_id: i32::from(codec.id()),
        block_len,
        encode_kernel,
        decode_kernel,
    })
}

fn launch_cfg(op: &'static str, n: usize) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (grid_dim(op, "blocks", n, i32::MAX as usize)?, 2, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
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
                .launch(launch_cfg(OP, blocks.len())?)
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
                .launch_builder(self.func(a.decode_kernel)?)
                .arg(&src)
                .arg(&ids)
                .arg(&a.block_size)
                .arg(&a.head_dim)
                .arg(&a.codec_id)
                .arg(&len)
                .arg(k)
                .arg(v)
                .launch(launch_cfg(OP, dst.len())?)
        }?;
        Ok(())
    }
}
