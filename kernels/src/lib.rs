//! Pagoda numeric kernels.
//!
//! This crate owns every piece of model math the serving engine runs:
//!
//! - [`quant`]: weight matrices as they come from GGUF ([`WeightType`]: F32, F16, Q4_1, Q8_0) in a [`QMatrix`],
//!   row dequantisation, and the Q8_1 activation format used by the quantised matmul;
//! - [`paged`]: the head-paged KV arenas ([`KvStorage`]) and the per-sequence attention view ([`AttnSeq`]);
//! - [`backend`]: the [`Backend`] trait (matmul, embedding, RMSNorm, RoPE, SiLU·mul, KV write, paged attention);
//! - [`rope`]: [`RopeTable`], a step's RoPE rotation, computed once per forward pass for every layer;
//! - [`cpu`]: [`CpuBackend`], the always-available implementation, with AVX2/FMA/F16C kernels selected at run time
//!   and portable scalar kernels that double as the test reference;
//! - [`scores`]: the KV-cache eviction score kernels (key norms, PagedEviction's value/key ratio, KeyDiff, windowed
//!   attention for SnapKV/H2O/KV-Compress, pooling, block means, top-k) that eviction policies rank slots with;
//! - [`attention_bench`]: decode-attention bandwidth per KV format (`pagoda bench kernels`);
//! - [`codec`]: KV block codecs (f16, bf16, int8, fp8 e4m3, KIVI int4/int2) with a versioned byte format, and
//!   [`EncodedKv`], the compressed arena that [`cpu::codecs`] runs dequantise-on-load attention over.
//!
//! ```
//! use pagoda_kernels::{Backend, CpuBackend, QMatrix, WeightType};
//! let w = QMatrix::quantize(WeightType::Q8_0, 2, 32, &[0.5; 64]).unwrap();
//! let be = CpuBackend::new(1);
//! let mut out = [0.0f32; 2];
//! be.matmul(&w, &[1.0; 32], 1, &mut out);
//! assert!((out[0] - 16.0).abs() < 0.1);
//! ```

pub mod attention_bench;
pub mod backend;
pub mod codec;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod key_rounding;
pub mod paged;
pub mod quant;
pub mod rope;

pub use backend::Backend;
pub use codec::{
    BlockHeader, Codec, CodecError, EncodedKv, decode_block, decode_validated_block, decoded_magnitude_bound,
    hadamard_rotate,
};
pub use cpu::lora::LoraSegment;
pub use cpu::scores;
pub use cpu::{CpuBackend, Simd};
/// The cudarc version the CUDA backend is built on, for callers that hold its buffers.
#[cfg(feature = "cuda")]
pub use cudarc;
pub use error::KernelError;
pub use key_rounding::{KeyRounding, QueryMoments};
pub use paged::{AttnProbs, AttnSeq, KvArenas, KvDtype, KvStorage};
pub use quant::{QMatrix, WeightType};
pub use rope::RopeTable;
