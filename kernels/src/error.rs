//! Error type shared by every fallible kernel entry point ([`KernelError`]).

use thiserror::Error;

/// Errors raised when building kernel-side objects from external data (GGUF tensors).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// The column count is not a multiple of the quantisation block size.
    #[error("{ty:?} matrix needs cols to be a multiple of {block}, got {cols}")]
    BadCols { ty: crate::quant::WeightType, cols: usize, block: usize },
    /// The tensor bytes do not have the length implied by type and shape.
    #[error("{ty:?} matrix {rows}x{cols} needs {expected} bytes, got {got}")]
    BadLength { ty: crate::quant::WeightType, rows: usize, cols: usize, expected: usize, got: usize },
    /// rows * cols (or the byte size) overflows `usize`.
    #[error("matrix shape {rows}x{cols} is too large")]
    TooLarge { rows: usize, cols: usize },
    /// A GGML type id this crate does not implement.
    #[error("unsupported GGML tensor type id {0}")]
    UnsupportedType(u32),
}
