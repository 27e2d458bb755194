//! Launch wrappers for the row-wise and element-wise kernels (`elementwise.cu`), weights on the device
//! ([`CudaWeight`]: GGUF weights dequantised to f16 on load) and the cuBLAS GEMM `y = x·Wᵀ` (f16 inputs, f32
//! accumulation and output).
//!
//! CPU twins: [`CudaContext::rmsnorm`] ↔ `Backend::rmsnorm`, [`CudaContext::rope`] ↔ `Backend::rope`,
//! [`CudaContext::silu_mul`] ↔ `Backend::silu_mul`, [`CudaContext::embedding`] ↔ `Backend::embedding`,
//! [`CudaWeight::from_qmatrix`] ↔ `QMatrix::dequantize_row`, [`CudaContext::matmul`] ↔ `Backend::matmul`.
//! All launches are asynchronous on the context's stream.

use super::context::CudaContext;
use super::error::CudaError;
use crate::quant::{QData, QMatrix};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};

const THREADS: u32 = 256;

/// A 1-D grid-stride launch over `n` elements.
pub(crate) fn grid_1d(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 1 << 20) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

pub(crate) fn to_i32(op: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::invalid(op, format!("{what} = {v} does not fit in i32")))
}

pub(crate) fn grid_dim(op: &'static str, what: &str, v: usize, max: usize) -> Result<u32, CudaError> {
    if v == 0 || v > max {
        return Err(CudaError::invalid(op, format!("{what} = {v} is outside 1..={max}")));
    }
    Ok(v as u32)
}

/// A weight matrix on the device as row-major f16 (`rows` = output features, `cols` = input features).
pub struct CudaWeight {
    data: CudaSlice<u16>,
    rows: usize,
    cols: usize,
}

impl std::fmt::Debug for CudaWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaWeight").field("rows", &self.rows).field("cols", &self.cols).finish()
    }
}

impl CudaWeight {
    /// Uploads `w`; Q4_1 and Q8_0 are dequantised to f16 on the device, F32 is rounded to f16 on the host.
    pub fn from_qmatrix(cx: &CudaContext, w: &QMatrix) -> Result<CudaWeight, CudaError> {
        let (rows, cols) = (w.rows(), w.cols());
        let n = rows
            .checked_mul(cols)
            .ok_or_else(|| CudaError::invalid("CudaWeight::from_qmatrix", "rows * cols overflows"))?;
        let data = match &w.data {
            QData::F32(v) => cx.upload(&v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect::<Vec<u16>>())?,
            QData::F16(v) => cx.upload(v)?,
            QData::Q4_1(b) => dequant(cx, "dequant_q4_1_f16", b, n)?,
            QData::Q8_0(b) => dequant(cx, "dequant_q8_0_f16", b, n)?,
        };
        Ok(CudaWeight { data, rows, cols })
    }

    /// One weight whose rows are `parts`' rows in order (all of one width): projections that read the same input
    /// (q, k and v; gate and up) become one GEMM.
    pub fn stacked(cx: &CudaContext, parts: &[&CudaWeight]) -> Result<CudaWeight, CudaError> {
        let cols = parts.first().map_or(0, |w| w.cols);
        if parts.is_empty() || parts.iter().any(|w| w.cols != cols) {
            return Err(CudaError::invalid("CudaWeight::stacked", "parts must be one or more weights of one width"));
        }
        let rows: usize = parts.iter().map(|w| w.rows).sum();
        let mut data = cx.zeros::<u16>(rows * cols)?;
        let mut at = 0;
        for w in parts {
            let n = w.rows * w.cols;
            cx.stream().memcpy_dtod(&w.data, &mut data.slice_mut(at..at + n))?;
            at += n;
        }
        Ok(CudaWeight { data, rows, cols })
    }

    /// Wraps f16 values already on the device (`data.len() == rows * cols`).
    pub fn from_f16(data: CudaSlice<u16>, rows: usize, cols: usize) -> Result<CudaWeight, CudaError> {
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(CudaError::invalid("CudaWeight::from_f16", format!("{} values for {rows}x{cols}", data.len())));
        }
        Ok(CudaWeight { data, rows, cols })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The f16 values (raw bits), row-major.
    pub fn data(&self) -> &CudaSlice<u16> {
        &self.data
    }
}

fn dequant(cx: &CudaContext, kernel: &'static str, bytes: &[u8], n: usize) -> Result<CudaSlice<u16>, CudaError> {
    let src = cx.upload(bytes)?;
    let mut out = cx.zeros::<u16>(n)?;
    if n > 0 {
        let n64 = n as i64;
        // SAFETY: the kernel reads n/32 whole blocks of `src` (its length was checked by QMatrix) and writes n values.
        unsafe { cx.stream().launch_builder(cx.func(kernel)?).arg(&src).arg(&n64).arg(&mut out).launch(grid_1d(n)) }?;
    }
    Ok(out)
}

/// Threads of an argmax block: one block per row, strided over the vocabulary.
const ARGMAX_THREADS: u32 = 512;

impl CudaContext {
    /// `out[r] = x[r] / sqrt(mean(x[r]²) + eps) * weight`; x, out: `[n][weight.len()]`.
    pub fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.rmsnorm_into("rmsnorm_f32", x, weight, eps, out)
    }

    /// [`CudaContext::rmsnorm`] with each value rounded to f16 (raw bits) for a GEMM: rmsnorm then
    /// [`CudaContext::f32_to_f16`], in one launch.
    pub fn rmsnorm_f16(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        self.rmsnorm_into("rmsnorm_f16", x, weight, eps, out)
    }

    fn rmsnorm_into<T: DeviceRepr>(
        &self,
        kernel: &'static str,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        let d = weight.len();
        if d == 0 || x.len() != out.len() || !x.len().is_multiple_of(d) {
            return Err(CudaError::invalid("rmsnorm", "x and out must be [n][weight.len()]"));
        }
        let rows = x.len() / d;
        if rows == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (grid_dim("rmsnorm", "rows", rows, i32::MAX as usize)?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let d = to_i32("rmsnorm", "dim", d)?;
        // SAFETY: rows * d elements of x and out, d of weight, all checked above.
        unsafe {
            self.stream().launch_builder(self.func(kernel)?).arg(x).arg(weight).arg(&eps).arg(&d).arg(out).launch(cfg)
        }?;
        Ok(())
    }

    /// Llama "normal" RoPE in place on x: `[positions.len()][n_heads * head_dim]`.
    pub fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &CudaSlice<u32>,
        n_heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<(), CudaError> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) || x.len() != positions.len() * n_heads * head_dim {
            return Err(CudaError::invalid("rope", "x must be [positions][n_heads*head_dim] with an even head_dim"));
        }
        let pairs = x.len() / 2;
        if pairs == 0 {
            return Ok(());
        }
        let (n, nh, hd) = (
            to_i32("rope", "n", positions.len())?,
            to_i32("rope", "n_heads", n_heads)?,
            to_i32("rope", "head_dim", head_dim)?,
        );
        // SAFETY: the kernel touches n * n_heads * head_dim floats of x and n positions, as checked.
        unsafe {
            self.stream()
                .launch_builder(self.func("rope_f32")?)
                .arg(x)
                .arg(positions)
                .arg(&n)
                .arg(&nh)
                .arg(&hd)
                .arg(&theta)
                .launch(grid_1d(pairs))
        }?;
        Ok(())
    }

    /// Splits the output of a stacked q|k|v projection (`qkv`: `[n][(n_heads + 2 * n_kv) * head_dim]`) into `q`,
    /// `k` and `v` (`[n][heads * head_dim]` each), rotating q and k as [`CudaContext::rope`] does, in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_split_qkv(
        &self,
        qkv: &CudaSlice<f32>,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        positions: &CudaSlice<u32>,
        heads: (usize, usize),
        head_dim: usize,
        theta: f32,
    ) -> Result<(), CudaError> {
        const OP: &str = "rope_split_qkv";
        let (n_heads, n_kv) = heads;
        let n = positions.len();
        if head_dim == 0
            || !head_dim.is_multiple_of(2)
            || q.len() != n * n_heads * head_dim
            || k.len() != n * n_kv * head_dim
            || v.len() != k.len()
            || qkv.len() != q.len() + 2 * k.len()
        {
            return Err(CudaError::invalid(OP, "qkv, q, k and v must be [positions][heads*head_dim], head_dim even"));
        }
        let pairs = qkv.len() / 2;
        if pairs == 0 {
            return Ok(());
        }
        let (ni, nh, nkv, hd) = (
            to_i32(OP, "n", n)?,
            to_i32(OP, "n_heads", n_heads)?,
            to_i32(OP, "n_kv_heads", n_kv)?,
            to_i32(OP, "head_dim", head_dim)?,
        );
        // SAFETY: the kernel reads n rows of qkv and writes n rows of q, k and v, and reads n positions, as checked.
        unsafe {
            self.stream()
                .launch_builder(self.func("rope_split_qkv_f32")?)
                .arg(qkv)
                .arg(q)
                .arg(k)
                .arg(v)
                .arg(positions)
                .arg(&ni)
                .arg(&nh)
                .arg(&nkv)
                .arg(&hd)
                .arg(&theta)
                .launch(grid_1d(pairs))
        }?;
        Ok(())
    }

    /// `out[r][i] = f16(silu(gu[r][i]) * gu[r][ffn + i])` over the output of a stacked gate|up projection
    /// (`gu`: `[rows][2 * ffn]`, `out`: `[rows][ffn]`): [`CudaContext::silu_mul`] then [`CudaContext::f32_to_f16`] on the two
    /// halves, in one launch.
    pub fn silu_mul_stacked_f16(
        &self,
        gu: &CudaSlice<f32>,
        ffn: usize,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        if ffn == 0 || gu.len() != 2 * out.len() || !out.len().is_multiple_of(ffn) {
            return Err(CudaError::invalid("silu_mul_stacked_f16", "gu must be [rows][2*ffn] and out [rows][ffn]"));
        }
        if out.is_empty() {
            return Ok(());
        }
        let (n, f) = (out.len() as i64, to_i32("silu_mul_stacked_f16", "ffn", ffn)?);
        let cfg = grid_1d(out.len());
        // SAFETY: n outputs, each reading two values of its row of gu, as checked.
        unsafe {
            self.stream()
                .launch_builder(self.func("silu_mul_stacked_f16")?)
                .arg(gu)
                .arg(&f)
                .arg(&n)
                .arg(out)
                .launch(cfg)
        }?;
        Ok(())
    }

    /// `gate[i] = silu(gate[i]) * up[i]`.
    pub fn silu_mul(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>) -> Result<(), CudaError> {
        if gate.len() != up.len() {
            return Err(CudaError::invalid("silu_mul", "gate and up differ in length"));
        }
        if gate.is_empty() {
            return Ok(());
        }
        let n = gate.len() as i64;
        let cfg = grid_1d(gate.len());
        // SAFETY: n elements of each, checked equal.
        unsafe { self.stream().launch_builder(self.func("silu_mul_f32")?).arg(gate).arg(up).arg(&n).launch(cfg) }?;
        Ok(())
    }

    /// `out[i] = table.row(ids[i])` in f32; an id outside the table gives a zero row. out: `[ids.len()][cols]`.
    pub fn embedding(
        &self,
        table: &CudaWeight,
        ids: &CudaSlice<u32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if out.len() != ids.len() * table.cols {
            return Err(CudaError::invalid("embedding", "out must be [ids.len()][table.cols()]"));
        }
        if ids.is_empty() || table.cols == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (grid_dim("embedding", "ids", ids.len(), i32::MAX as usize)?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (vocab, dim) = (to_i32("embedding", "rows", table.rows)?, to_i32("embedding", "cols", table.cols)?);
        // SAFETY: ids are bounds-checked in the kernel; out holds ids * cols floats.
        unsafe {
            self.stream()
                .launch_builder(self.func("embedding_f16")?)
                .arg(&table.data)
                .arg(ids)
                .arg(&vocab)
                .arg(&dim)
                .arg(out)
                .launch(cfg)
        }?;
        Ok(())
    }

    /// Rounds f32 values to f16 (raw bits).
    pub fn f32_to_f16(&self, x: &CudaSlice<f32>, out: &mut CudaSlice<u16>) -> Result<(), CudaError> {
        if x.len() != out.len() {
            return Err(CudaError::invalid("f32_to_f16", "lengths differ"));
        }
        if x.is_empty() {
            return Ok(());
        }
        let n = x.len() as i64;
        // SAFETY: n elements each.
        unsafe {
            self.stream().launch_builder(self.func("f32_to_f16")?).arg(x).arg(&n).arg(out).launch(grid_1d(x.len()))
        }?;
        Ok(())
    }

    /// `out[r]` = the index of the largest value of row `r` of `logits` (`[rows][vocab]`): the lowest index wins
    /// ties, NaN never wins, a row with nothing above -inf gives 0 (CPU twin: `pagoda_worker::sampling::argmax`).
    pub fn argmax_rows(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        out: &mut CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        if vocab == 0 || logits.len() != out.len() * vocab {
            return Err(CudaError::invalid("argmax_rows", "logits must be [out.len()][vocab] with vocab > 0"));
        }
        if out.is_empty() {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (grid_dim("argmax_rows", "rows", out.len(), i32::MAX as usize)?, 1, 1),
            block_dim: (ARGMAX_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let vocab = to_i32("argmax_rows", "vocab", vocab)?;
        // SAFETY: out.len() rows of vocab floats, checked above.
        unsafe {
            self.stream().launch_builder(self.func("argmax_rows")?).arg(logits).arg(&vocab).arg(out).launch(cfg)
        }?;
        Ok(())
    }

    /// Widens f16 values (raw bits) to f32.
    pub fn f16_to_f32(&self, x: &CudaSlice<u16>, out: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        if x.len() != out.len() {
            return Err(CudaError::invalid("f16_to_f32", "lengths differ"));
        }
        if x.is_empty() {
            return Ok(());
        }
        let n = x.len() as i64;
        // SAFETY: n elements each.
        unsafe {
            self.stream().launch_builder(self.func("f16_to_f32")?).arg(x).arg(&n).arg(out).launch(grid_1d(x.len()))
        }?;
        Ok(())
    }

    /// cuBLAS GEMM: `out[n][w.rows()] = x[n][w.cols()] · wᵀ` with f16 x and w, f32 accumulation and output.
    pub fn gemm_f16(
        &self,
        w: &CudaWeight,
        x: &CudaSlice<u16>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.gemm_f16_beta("gemm_f16", w, x, n, out, 0.0)
    }

    /// `out[n][w.rows()] += x[n][w.cols()] · wᵀ`: cuBLAS adds into `out` (beta = 1), so a projection lands on the
    /// residual stream without a separate add. CPU twin: `Backend::matmul` followed by an element-wise add.
    pub fn gemm_f16_accumulate(
        &self,
        w: &CudaWeight,
        x: &CudaSlice<u16>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.gemm_f16_beta("gemm_f16_accumulate", w, x, n, out, 1.0)
    }

    fn gemm_f16_beta(
        &self,
        op: &'static str,
        w: &CudaWeight,
        x: &CudaSlice<u16>,
        n: usize,
        out: &mut CudaSlice<f32>,
        beta: f32,
    ) -> Result<(), CudaError> {
        if x.len() != n * w.cols || out.len() != n * w.rows {
            return Err(CudaError::invalid(op, "x must be [n][cols] and out [n][rows]"));
        }
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        let (m, nn, k) = (to_i32(op, "rows", w.rows)?, to_i32(op, "n", n)?, to_i32(op, "cols", w.cols)?);
        let alpha = 1.0f32;
        let stream = self.stream();
        let (wp, _gw) = w.data.device_ptr(stream);
        let (xp, _gx) = x.device_ptr(stream);
        let (op, _go) = out.device_ptr_mut(stream);
        // Column-major view: outᵀ (rows x n) = W (k x rows, transposed) · xᵀ (k x n).
        // SAFETY: the pointers cover rows*cols, n*cols and n*rows elements (checked); cuBLAS runs on our stream.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas().handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m,
                nn,
                k,
                (&alpha as *const f32).cast(),
                wp as *const _,
                cudaDataType::CUDA_R_16F,
                k,
                xp as *const _,
                cudaDataType::CUDA_R_16F,
                k,
                (&beta as *const f32).cast(),
                op as *mut _,
                cudaDataType::CUDA_R_32F,
                m,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }

    /// `out[n][w.rows()] = x[n][w.cols()] · wᵀ` for f32 x: rounds x to f16, then [`CudaContext::gemm_f16`].
    pub fn matmul(
        &self,
        w: &CudaWeight,
        x: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if x.len() != n * w.cols {
            return Err(CudaError::invalid("matmul", "x must be [n][cols]"));
        }
        let mut xh = self.zeros::<u16>(x.len())?;
        self.f32_to_f16(x, &mut xh)?;
        self.gemm_f16(w, &xh, n, out)
    }
}
