//! Typed errors of the CUDA backend ([`CudaError`]).

use thiserror::Error;

/// Everything that can go wrong while starting or driving the CUDA backend.
#[derive(Debug, Error)]
pub enum CudaError {
    /// `libcuda` could not be loaded (no NVIDIA driver on this machine).
    #[error("the CUDA driver library (libcuda) could not be loaded")]
    DriverUnavailable,
    /// The driver loaded but reports no device, or the requested ordinal does not exist.
    #[error("no CUDA device{}", .0.map(|o| format!(" with ordinal {o}")).unwrap_or_default())]
    NoDevice(Option<usize>),
    /// `libnvrtc` could not be loaded (set LD_LIBRARY_PATH to the folder that holds libnvrtc.so.13).
    #[error("the NVRTC library (libnvrtc) could not be loaded; put its folder on LD_LIBRARY_PATH")]
    NvrtcUnavailable,
    /// `libcublas` could not be loaded.
    #[error("the cuBLAS library (libcublas) could not be loaded; put its folder on LD_LIBRARY_PATH")]
    CublasUnavailable,
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// `libnccl` could not be loaded: peers fall back to the gRPC block stream.
    #[error("the NCCL library (libnccl) could not be loaded; put its folder on LD_LIBRARY_PATH")]
    NcclUnavailable,
    /// An NCCL call failed.
    #[error("NCCL: {0}")]
    Nccl(String),
    /// An NCCL wait passed its deadline (a peer that never joined, or stopped mid-transfer); the link was or
    /// must be aborted.
    #[error("NCCL: {op} timed out")]
    NcclTimeout { op: &'static str },
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0:?}")]
    Cublas(#[from] cudarc::cublas::result::CublasError),
    /// NVRTC rejected a kernel source.
    #[error("NVRTC failed to compile {module} for {arch}: {log}")]
    Compile { module: &'static str, arch: String, log: String },
    /// The on-disk PTX cache could not be read or written.
    #[error("PTX cache at {path}: {source}")]
    Cache { path: String, source: std::io::Error },
    /// Arguments whose shapes or values do not fit the kernel contract.
    #[error("invalid arguments for {op}: {why}")]
    Invalid { op: &'static str, why: String },
    /// A shape or option the GPU kernels do not implement (for example an unsupported head_dim).
    #[error("unsupported by the CUDA kernels: {0}")]
    Unsupported(String),
}

impl CudaError {
    /// True when the error only says that this machine has no usable GPU (driver or device missing).
    pub fn is_no_device(&self) -> bool {
        matches!(self, CudaError::DriverUnavailable | CudaError::NoDevice(_))
    }

    pub(crate) fn invalid(op: &'static str, why: impl Into<String>) -> CudaError {
        CudaError::Invalid { op, why: why.into() }
    }
}
