//! [`CudaRunner`] (feature `cuda`): the engine's [`ModelRunner`] on an NVIDIA GPU. The scheduler, block pool,
//! prefix cache, tiers and API are the CPU worker's; only the forward step runs on the device ([`CudaLlama`]), with
//! the KV cache in device memory under the same block tables.
//!
//! The host, disk and peer tiers copy block groups through [`GroupKv`]: the four compressing codecs encode and
//! decode on the GPU (`codecs.cu`), f16 groups move as packed blocks (`kv.cu`), and the other formats go through a
//! host copy of the group and the CPU codecs. The bytes are the CPU runner's, so a tier holds groups from either.
//!
//! What the GPU runner does not serve yet, each refused at start-up with a clear error rather than run
//! differently: KV dtypes other than f16, AMX, and EvicPress placement (its profiler prunes copies with the
//! eviction policies). Eviction policies need the host KV: the runner reports none ([`ModelRunner::policy_io`]),
//! so the engine refuses a default policy other than `full` at start-up and a request that names one with an
//! invalid-request error, rather than serve it a full cache it did not ask for.

use pagoda_kernels::codec::validate_block;
use pagoda_kernels::cuda::codecs::GPU_CODECS;
use pagoda_kernels::cuda::{CudaContext, CudaError};
use pagoda_kernels::{KvDtype, KvStorage};

use crate::cache::BlockId;
use crate::engine::{
    Device, EngineConfig, EngineError, ModelInfo, ModelRunner, StepSeq, TierPlacement, load_model, recycle_forward,
};
use crate::model::ForwardSeq;
use crate::model::cuda::CudaLlama;
use crate::tiers::codec::{self, GroupKv};
use crate::tiers::{EncodedGroup, GroupCodec, TierError, native};

/// The model on a GPU, driven by the engine thread.
pub struct CudaRunner {
    model: CudaLlama,
    info: ModelInfo,
    batch: Vec<ForwardSeq<'static>>,
}

impl std::fmt::Debug for CudaRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRunner").field("model", &self.model).finish()
    }
}

/// Why `cfg` cannot run on the GPU runner, if it cannot.
fn unsupported(cfg: &EngineConfig) -> Option<String> {
    if cfg.kv_dtype != KvDtype::F16 {
        return Some(format!("the CUDA backend keeps its KV cache in f16; --kv-dtype {} is CPU-only", cfg.kv_dtype));
    }
    if cfg.amx {
        return Some("--amx is a CPU option".into());
    }
    if matches!(cfg.placement, TierPlacement::EvicPress(_)) {
        return Some(
            "--tier-placement evicpress profiles pruned copies with the eviction policies, which run on the CPU \
             backend only for now (lru and lru+CODEC placements run on the GPU)"
                .into(),
        );
    }
    None
}

impl CudaRunner {
    /// Opens the GPU of `cfg.device`, loads the model ([`load_model`]) and uploads it with an f16 KV arena of
    /// `info.num_blocks` blocks. The host copy of the weights is dropped once uploaded.
    pub fn load(cfg: &EngineConfig) -> Result<CudaRunner, EngineError> {
        let Device::Cuda(ordinal) = cfg.device else {
            return Err(EngineError::Config(format!("the CUDA runner cannot serve --device {}", cfg.device)));
        };
        if let Some(why) = unsupported(cfg) {
            return Err(EngineError::Config(why));
        }
        let cx = CudaContext::new(ordinal)
            .map_err(|e| EngineError::Config(format!("cannot start the CUDA backend on device {ordinal}: {e}")))?;
        tracing::info!(device = %cx.info().name, arch = %cx.info().arch, "CUDA backend ready");
        let (model, info) = load_model(cfg)?;
        let model = CudaLlama::new(cx, &model, info.num_blocks, cfg.block_size)
            .map_err(|e| EngineError::Model(format!("cannot upload the model to the GPU: {e}")))?;
        Ok(CudaRunner { model, info, batch: Vec::new() })
    }

    /// The GPU model (for benchmarks that report the device).
    pub fn model(&self) -> &CudaLlama {
        &self.model
    }
}

impl ModelRunner for CudaRunner {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn forward(&mut self, seqs: &[StepSeq<'_>], logits: &mut Vec<f32>) -> Result<(), EngineError> {
        let mut batch = recycle_forward(std::mem::take(&mut self.batch));
        // The GPU forward ignores capture_q and attention_sums (no host KV for policies).
        batch.extend(seqs.iter().map(StepSeq::forward_seq));
        let r = self.model.forward(&batch, logits);
        self.batch = recycle_forward(batch);
        r.map_err(|e| EngineError::Forward(e.to_string()))
    }

    fn group_kv(&mut self) -> Option<&mut dyn GroupKv> {
        Some(self)
    }
}

fn device_err(e: CudaError) -> TierError {
    TierError::Device(e.to_string())
}

/// Packed f16 halves (the layout of [`CudaContext::read_blocks`]) as a native f16 group's bytes, and back.
fn halves_to_bytes(halves: &[u16]) -> Vec<u8> {
    halves.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl CudaRunner {
    /// Blocks `blocks` of the device arenas as a host f16 cache of `blocks.len()` blocks, in order.
    fn host_copy(&self, blocks: &[BlockId]) -> Result<KvStorage, TierError> {
        let (cx, kv) = self.model.kv();
        let (bs, hd) = (kv.block_size(), kv.head_dim());
        let packed = cx.read_blocks(kv, blocks).map_err(device_err)?;
        let mut host = KvStorage::with_dtype(blocks.len(), bs, hd, KvDtype::F16);
        let group =
            EncodedGroup { codec: native::codec_name(KvDtype::F16).to_owned(), bytes: halves_to_bytes(&packed) };
        let all: Vec<BlockId> = (0..blocks.len() as BlockId).collect();
        native::decode(&group, &mut host, &all)?;
        Ok(host)
    }
}

impl GroupKv for CudaRunner {
    fn native_codec(&self) -> GroupCodec {
        GroupCodec::Native(KvDtype::F16)
    }

    fn encode_group(&self, blocks: &[BlockId], codec: GroupCodec) -> Result<EncodedGroup, TierError> {
        let (cx, kv) = self.model.kv();
        match codec {
            GroupCodec::Kv(c) if GPU_CODECS.contains(&c) => {
                let full: Vec<(u32, usize)> = blocks.iter().map(|&b| (b, kv.block_size())).collect();
                let bytes = cx.encode_blocks(kv, c, &full).map_err(device_err)?;
                // The CPU encoder refuses non-finite KV; the kernels do not look, so the blocks are checked here
                // and such a group falls back to the native format as it would on the CPU.
                let len = bytes.len() / blocks.len().max(1);
                for blk in bytes.chunks_exact(len.max(1)) {
                    validate_block(blk).map_err(|e| TierError::Config(format!("encoding with {c}: {e}")))?;
                }
                Ok(EncodedGroup { codec: c.name().to_owned(), bytes })
            }
            GroupCodec::Native(KvDtype::F16) => {
                let packed = cx.read_blocks(kv, blocks).map_err(device_err)?;
                Ok(EncodedGroup { codec: native::codec_name(KvDtype::F16).to_owned(), bytes: halves_to_bytes(&packed) })
            }
            _ => {
                let all: Vec<BlockId> = (0..blocks.len() as BlockId).collect();
                codec::encode(&self.host_copy(blocks)?, &all, codec)
            }
        }
    }

    fn decode_group(&mut self, group: &EncodedGroup, blocks: &[BlockId]) -> Result<(), TierError> {
        let (cx, kv) = self.model.kv_mut();
        let (bs, hd) = (kv.block_size(), kv.head_dim());
        match group.codec.parse::<GroupCodec>()? {
            // decode_blocks validates every block (header, shape, scales, codes) before it launches.
            GroupCodec::Kv(c) if GPU_CODECS.contains(&c) => {
                cx.decode_blocks(kv, c, &group.bytes, blocks).map_err(|e| TierError::Corrupt {
                    path: format!("<{} group>", group.codec).into(),
                    reason: e.to_string(),
                })
            }
            _ => {
                // Every other format decodes on the host (checked whole there), then moves up as packed f16 blocks.
                let mut host = KvStorage::with_dtype(blocks.len(), bs, hd, KvDtype::F16);
                let all: Vec<BlockId> = (0..blocks.len() as BlockId).collect();
                codec::decode(group, &mut host, &all)?;
                let packed = native::encode(&host, &all).bytes;
                let halves: Vec<u16> = packed.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
                cx.write_blocks(kv, blocks, &halves).map_err(device_err)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_the_gpu_runner_does_not_serve_are_refused_by_name() {
        let ok = EngineConfig { device: Device::Cuda(0), ..EngineConfig::default() };
        assert_eq!(unsupported(&ok), None);
        let f32_kv = EngineConfig { kv_dtype: KvDtype::F32, ..ok.clone() };
        assert!(unsupported(&f32_kv).is_some_and(|w| w.contains("f32")));
        let amx = EngineConfig { amx: true, ..ok.clone() };
        assert!(unsupported(&amx).is_some_and(|w| w.contains("--amx")));
        let mut tiers = ok.clone();
        tiers.tiers.host_bytes = 1 << 20;
        assert_eq!(unsupported(&tiers), None);
        let evicpress = EngineConfig { placement: TierPlacement::EvicPress(Default::default()), ..tiers };
        assert!(unsupported(&evicpress).is_some_and(|w| w.contains("evicpress")));
        let cpu = EngineConfig::default();
        assert!(CudaRunner::load(&cpu).is_err_and(|e| e.to_string().contains("--device cpu")));
    }
}
