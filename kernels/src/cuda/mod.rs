//! The CUDA backend (feature `cuda`): GPU twins of the CPU kernels, launched through cudarc with the driver,
//! NVRTC and cuBLAS loaded at run time (so building needs no CUDA installation).
//!
//! - [`compile`]: the embedded `kernels/cuda/*.cu` sources, NVRTC compilation for the device's `sm_XY`, and the
//!   on-disk PTX cache (xxh3 of sources + arch + NVRTC version);
//! - [`context`]: [`CudaContext`], one device with its stream, loaded kernels and cuBLAS handle;
//! - [`ops`]: RMSNorm, RoPE, SiLU·mul, embedding, f16 weights ([`CudaWeight`], GGUF Q4_1/Q8_0 dequantised on load)
//!   and the cuBLAS GEMM;
//! - [`kv`]: the f16 head-paged arenas ([`CudaKv`]), KV write, block copy/compaction, policy scores;
//! - [`bench`]: the GPU measurements of `pagoda bench kernels` (copy bandwidth, decode-attention bandwidth);
//! - [`codecs`]: int8 / fp8 e4m3 / KIVI block encode and decode between the f16 arenas and the tiers' byte format,
//!   and dequantise-on-load attention over an encoded arena ([`CudaEncodedKv`]);
//! - [`nccl`]: NCCL links ([`NcclLink`]) that move arena blocks between GPUs, and pipes ([`NcclPipe`]) that move
//!   encoded groups between workers' host memory through them, built from a [`NcclUniqueId`] with bounded waits;
//! - [`attention`]: paged decode (split-K + reduce) and prefill (tiled, causal) attention with GQA;
//! - [`error`]: the error type, [`CudaError`].
//!
//! Every kernel has a CPU twin in this crate; `kernels/tests/cuda_parity.rs` compares them.

pub mod attention;
pub mod bench;
pub mod codecs;
pub mod compile;
pub mod context;
pub mod error;
pub mod kv;
pub mod nccl;
pub mod ops;

pub use attention::AttnPlan;
pub use codecs::CudaEncodedKv;
pub use context::{CudaContext, DeviceInfo, device_available};
pub use error::CudaError;
pub use kv::KvWritePlan;
pub use kv::{CudaKv, ScoreEntry, SlotRange, SlotScores, WindowEntry};
pub use nccl::{NCCL_ID_BYTES, NcclLink, NcclPipe, NcclUniqueId, nccl_available};
pub use ops::CudaWeight;
