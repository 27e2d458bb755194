//! [`CudaRunner`] (feature `cuda`): the engine's [`ModelRunner`] on an NVIDIA GPU. The scheduler, block pool,
//! prefix cache and API are the CPU worker's; only the forward step runs on the device ([`CudaLlama`]), with the KV
//! cache in device memory under the same block tables.
//!
//! What the GPU runner does not serve yet, each refused at start-up with a clear error rather than run
//! differently: KV dtypes other than f16, AMX, and host/disk tiers (they copy blocks out of a host KV arena).
//! Eviction policies need the host KV too: the runner reports none ([`ModelRunner::policy_io`]), so requests that
//! name a policy keep their full cache.

use pagoda_kernels::KvDtype;
use pagoda_kernels::cuda::CudaContext;

use crate::engine::{Device, EngineConfig, EngineError, ModelInfo, ModelRunner, StepSeq, load_model, recycle_forward};
use crate::model::ForwardSeq;
use crate::model::cuda::CudaLlama;

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
    if cfg.tiers.is_enabled() {
        return Some("host and disk KV tiers need the CPU backend's host KV arena for now".into());
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
        assert!(unsupported(&tiers).is_some_and(|w| w.contains("tiers")));
        let cpu = EngineConfig::default();
        assert!(CudaRunner::load(&cpu).is_err_and(|e| e.to_string().contains("--device cpu")));
    }
}
