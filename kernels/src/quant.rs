//! Weight storage and quantisation formats: [`WeightType`], [`QMatrix`] (GGML F32, F16, Q4_1, Q8_0 weights as
//! they come from GGUF), row dequantisation, and the Q8_1 activation blocks the CPU matmul quantises `x` into.

use crate::error::KernelError;
use half::f16;
use std::sync::OnceLock;

/// Weights per quantisation block (Q4_1, Q8_0, Q8_1).
pub const QK: usize = 32;
/// Bytes per Q4_1 block: f16 d, f16 m, 16 bytes of nibbles.
pub const Q4_1_BLOCK_BYTES: usize = 20;
/// Bytes per Q8_0 block: f16 d, 32 i8.
pub const Q8_0_BLOCK_BYTES: usize = 34;

/// Element type of a weight matrix, as GGML names it.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightType {
    /// 32-bit float, little endian.
    F32,
    /// IEEE half, little endian.
    F16,
    /// Blocks of 32: f16 scale d, f16 min m, 32 nibbles; value = d*q + m.
    Q4_1,
    /// Blocks of 32: f16 scale d, 32 i8; value = d*q.
    Q8_0,
}

impl WeightType {
    /// Maps a GGML type id (as stored in GGUF tensor infos) to a [`WeightType`].
    pub fn from_ggml(id: u32) -> Result<WeightType, KernelError> {
        match id {
            0 => Ok(WeightType::F32),
            1 => Ok(WeightType::F16),
            3 => Ok(WeightType::Q4_1),
            8 => Ok(WeightType::Q8_0),
            other => Err(KernelError::UnsupportedType(other)),
        }
    }

    /// The GGML type id.
    pub fn ggml_id(self) -> u32 {
        match self {
            WeightType::F32 => 0,
            WeightType::F16 => 1,
            WeightType::Q4_1 => 3,
            WeightType::Q8_0 => 8,
        }
    }

    /// Weights per block (1 for float types).
    pub fn block_len(self) -> usize {
        match self {
            WeightType::F32 | WeightType::F16 => 1,
            WeightType::Q4_1 | WeightType::Q8_0 => QK,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            WeightType::F32 => 4,
            WeightType::F16 => 2,
            WeightType::Q4_1 => Q4_1_BLOCK_BYTES,
            WeightType::Q8_0 => Q8_0_BLOCK_BYTES,
        }
    }

    /// Bytes a `rows x cols` matrix of this type occupies, or `None` on overflow / bad `cols`.
    pub fn byte_len(self, rows: usize, cols: usize) -> Option<usize> {
        if !cols.is_multiple_of(self.block_len()) {
            return None;
        }
        rows.checked_mul(cols / self.block_len())?.checked_mul(self.block_bytes())
    }
}

/// Storage of a [`QMatrix`]: the GGUF bytes, decoded into a typed vector for float types.
#[derive(Clone)]
pub(crate) enum QData {
    F32(Vec<f32>),
    F16(Vec<u16>),
    /// Raw GGUF Q4_1 blocks, row-major.
    Q4_1(Vec<u8>),
    /// Raw GGUF Q8_0 blocks, row-major.
    Q8_0(Vec<u8>),
}

/// A weight matrix: `rows` = output features, `cols` = input features; row r is contiguous.
#[derive(Clone)]
pub struct QMatrix {
    ty: WeightType,
    rows: usize,
    cols: usize,
    pub(crate) data: QData,
    /// Q4_1 / Q8_0 only: the same weights repacked by [`repack_q4_1x16`] / [`repack_q8_0x16`], built on first use
    /// by a kernel that reads that layout (the AVX-512 VNNI matmul), so CPUs and backends that never use it pay no
    /// memory for it.
    pub(crate) packed: OnceLock<Vec<u8>>,
    /// Q4_1 / Q8_0 only: the weights widened to bf16 (`cpu::amx`'s tile layout), built on the first bf16 matmul
    /// and kept, so no call widens them again.
    pub(crate) bf16_widened: OnceLock<Vec<Align64>>,
}

/// 64 bytes, 64-aligned: the unit of buffers that tile loads read, so every tile row starts on a cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Align64(pub(crate) [u8; 64]);

impl Default for Align64 {
    fn default() -> Align64 {
        Align64([0; 64])
    }
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QMatrix").field("ty", &self.ty).field("rows", &self.rows).field("cols", &self.cols).finish()
    }
}

impl QMatrix {
    /// Builds a matrix from GGUF tensor bytes (little endian, row-major, rows of whole blocks).
    ///
    /// A GGUF tensor with dims `[ne0, ne1]` has `cols = ne0`, `rows = ne1`.
    pub fn from_gguf(ty: WeightType, rows: usize, cols: usize, bytes: &[u8]) -> Result<QMatrix, KernelError> {
        if !cols.is_multiple_of(ty.block_len()) {
            return Err(KernelError::BadCols { ty, cols, block: ty.block_len() });
        }
        let expected = ty.byte_len(rows, cols).ok_or(KernelError::TooLarge { rows, cols })?;
        if bytes.len() != expected {
            return Err(KernelError::BadLength { ty, rows, cols, expected, got: bytes.len() });
        }
        let data = match ty {
            WeightType::F32 => {
                QData::F32(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            WeightType::F16 => QData::F16(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()),
            WeightType::Q4_1 => QData::Q4_1(bytes.to_vec()),
            WeightType::Q8_0 => QData::Q8_0(bytes.to_vec()),
        };
        Ok(QMatrix { ty, rows, cols, data, packed: OnceLock::new(), bf16_widened: OnceLock::new() })
    }

    /// Builds an F32 matrix from row-major values (`values.len() == rows * cols`).
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Result<QMatrix, KernelError> {
        let expected = rows.checked_mul(cols).ok_or(KernelError::TooLarge { rows, cols })?;
        if values.len() != expected {
            return Err(KernelError::BadLength {
                ty: WeightType::F32,
                rows,
                cols,
                expected: expected * 4,
                got: values.len() * 4,
            });
        }
        Ok(QMatrix {
            ty: WeightType::F32,
            rows,
            cols,
            data: QData::F32(values.to_vec()),
            packed: OnceLock::new(),
            bf16_widened: OnceLock::new(),
        })
    }

    /// Quantises row-major f32 values into `ty` the way GGML does (used by tests, benches and synthetic models).
    pub fn quantize(ty: WeightType, rows: usize, cols: usize, values: &[f32]) -> Result<QMatrix, KernelError> {
        if !cols.is_multiple_of(ty.block_len()) {
            return Err(KernelError::BadCols { ty, cols, block: ty.block_len() });
        }
        let n = rows.checked_mul(cols).ok_or(KernelError::TooLarge { rows, cols })?;
        if values.len() != n {
            return Err(KernelError::BadLength { ty, rows, cols, expected: n * 4, got: values.len() * 4 });
        }
        let mut bytes = Vec::with_capacity(ty.byte_len(rows, cols).ok_or(KernelError::TooLarge { rows, cols })?);
        match ty {
            WeightType::F32 => return QMatrix::from_f32(rows, cols, values),
            WeightType::F16 => {
                for &v in values {
                    bytes.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
                }
            }
            WeightType::Q4_1 => {
                for blk in values.chunks_exact(QK) {
                    let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                    let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let d = (max - min) / 15.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    bytes.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                    bytes.extend_from_slice(&f16::from_f32(min).to_bits().to_le_bytes());
                    for j in 0..QK / 2 {
                        let lo = (((blk[j] - min) * id + 0.5) as u8).min(15);
                        let hi = (((blk[j + QK / 2] - min) * id + 0.5) as u8).min(15);
                        bytes.push(lo | (hi << 4));
                    }
                }
            }
            WeightType::Q8_0 => {
                for blk in values.chunks_exact(QK) {
                    let amax = blk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    bytes.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                    for &v in blk {
                        bytes.push(((v * id).round() as i8) as u8);
                    }
                }
            }
        }
        QMatrix::from_gguf(ty, rows, cols, &bytes)
    }

    /// Element type.
    pub fn weight_type(&self) -> WeightType {
        self.ty
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The weights in the 16-row layout of their type ([`repack_q4_1x16`], [`repack_q8_0x16`]) when `simd` has a
    /// kernel for it (built on the first such call, then cached); `None` for other types and instruction sets.
    pub(crate) fn x16_for(&self, simd: crate::cpu::Simd) -> Option<&[u8]> {
        let nb = self.cols / QK;
        match (&self.data, simd) {
            (QData::Q4_1(b), crate::cpu::Simd::Avx512) => {
                Some(self.packed.get_or_init(|| repack_q4_1x16(b, self.rows, nb)))
            }
            (QData::Q8_0(b), crate::cpu::Simd::Avx512) => {
                Some(self.packed.get_or_init(|| repack_q8_0x16(b, self.rows, nb)))
            }
            _ => None,
        }
    }

    /// The weights widened to bf16 in AMX's tile layout (which the AVX-512 BF16 kernel reads too), from the 16-row
    /// packing on first use; `None` for float types. Callers check [`crate::cpu::bf16_matmuls_available`] first.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn bf16_weights(&self) -> Option<&[Align64]> {
        let q8 = match &self.data {
            QData::Q4_1(_) => false,
            QData::Q8_0(_) => true,
            _ => return None,
        };
        let packed = self.x16_for(crate::cpu::Simd::Avx512)?;
        Some(self.bf16_widened.get_or_init(|| crate::cpu::amx::widen_matrix(packed, self.rows, self.cols / QK, q8)))
    }

    /// Bytes of one row in its stored form.
    pub(crate) fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_len() * self.ty.block_bytes()
    }

    /// Decodes row `row` into `out` (`out.len() == cols`). Panics if `row >= rows` or the length is wrong.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.rows, "row {row} out of range ({} rows)", self.rows);
        assert_eq!(out.len(), self.cols, "dequantize_row: out.len() must equal cols");
        let c = self.cols;
        match &self.data {
            QData::F32(v) => out.copy_from_slice(&v[row * c..(row + 1) * c]),
            QData::F16(v) => {
                for (o, &h) in out.iter_mut().zip(&v[row * c..(row + 1) * c]) {
                    *o = f16::from_bits(h).to_f32();
                }
            }
            QData::Q4_1(b) => {
                let rb = self.row_bytes();
                for (blk, o) in b[row * rb..(row + 1) * rb].chunks_exact(Q4_1_BLOCK_BYTES).zip(out.chunks_exact_mut(QK))
                {
                    dequantize_block_q4_1(blk, o);
                }
            }
            QData::Q8_0(b) => {
                let rb = self.row_bytes();
                for (blk, o) in b[row * rb..(row + 1) * rb].chunks_exact(Q8_0_BLOCK_BYTES).zip(out.chunks_exact_mut(QK))
                {
                    dequantize_block_q8_0(blk, o);
                }
            }
        }
    }
}

#[inline]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// One Q4_1 block (20 bytes) into 32 floats.
pub(crate) fn dequantize_block_q4_1(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    let m = f16_at(blk, 2);
    for j in 0..QK / 2 {
        let q = blk[4 + j];
        out[j] = d * f32::from(q & 0x0F) + m;
        out[j + QK / 2] = d * f32::from(q >> 4) + m;
    }
}

/// One Q8_0 block (34 bytes) into 32 floats.
pub(crate) fn dequantize_block_q8_0(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    for j in 0..QK {
        out[j] = d * f32::from(blk[2 + j] as i8);
    }
}

/// Rows per group of the [`repack_q4_1x16`] layout.
pub const Q4_1X16_ROWS: usize = 16;
/// Bytes per block of a [`repack_q4_1x16`] row group: 16 f16 d, 16 f16 m, 16 x 16 bytes of nibbles.
pub const Q4_1X16_BLOCK_BYTES: usize = Q4_1X16_ROWS * Q4_1_BLOCK_BYTES;

/// Repacks row-major GGUF Q4_1 blocks (`rows` rows of `nb` blocks) into groups of 16 rows, so that one 64-byte
/// vector holds the same four columns of 16 rows and an int8 dot-product instruction (`vpdpbusd`) computes 16
/// rows against one broadcast group of four activations.
///
/// Group `g` (rows `16g..16g+16`), block `b` lives at byte `(g * nb + b) * 320`: the 16 rows' f16 `d`, then their
/// 16 f16 `m`, then 4 chunks of 64 bytes; chunk `t` holds, for row `j`, bytes `4t..4t+4` of that row's GGUF nibbles
/// at `64t + 4j` (low nibbles = columns `4t..4t+4`, high nibbles = columns `16+4t..16+4t+4`). Rows past `rows` in
/// the last group are zero (d = m = 0), so they compute 0 and are never stored.
pub fn repack_q4_1x16(raw: &[u8], rows: usize, nb: usize) -> Vec<u8> {
    let rb = nb * Q4_1_BLOCK_BYTES;
    assert_eq!(raw.len(), rows * rb, "repack_q4_1x16: raw must hold rows * nb blocks");
    let groups = rows.div_ceil(Q4_1X16_ROWS);
    let mut out = vec![0u8; groups * nb * Q4_1X16_BLOCK_BYTES];
    for r in 0..rows {
        let (g, j) = (r / Q4_1X16_ROWS, r % Q4_1X16_ROWS);
        for b in 0..nb {
            let src = &raw[r * rb + b * Q4_1_BLOCK_BYTES..r * rb + (b + 1) * Q4_1_BLOCK_BYTES];
            let dst = &mut out[(g * nb + b) * Q4_1X16_BLOCK_BYTES..(g * nb + b + 1) * Q4_1X16_BLOCK_BYTES];
            dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
            dst[32 + 2 * j..32 + 2 * j + 2].copy_from_slice(&src[2..4]);
            for t in 0..4 {
                let o = 64 + 64 * t + 4 * j;
                dst[o..o + 4].copy_from_slice(&src[4 + 4 * t..8 + 4 * t]);
            }
        }
    }
    out
}

/// Bytes per block of a [`repack_q8_0x16`] row group: 16 f16 d, 16 i16 Σq, 16 x 32 i8.
pub const Q8_0X16_BLOCK_BYTES: usize = 32 + 32 + Q4_1X16_ROWS * QK;

/// Repacks row-major GGUF Q8_0 blocks (`rows` rows of `nb` blocks) into groups of 16 rows, like
/// [`repack_q4_1x16`]: group `g`, block `b` lives at byte `(g * nb + b) * 576`: the 16 rows' f16 `d`, their 16
/// i16 sums of quants (`vpdpbusd` multiplies unsigned by signed bytes, so the kernel feeds activations offset by
/// +128 and subtracts 128 Σq), then 8 chunks of 64 bytes; chunk `k` holds row `j`'s quants `4k..4k+4` at
/// `64k + 4j`. Rows past `rows` in the last group are zero.
pub fn repack_q8_0x16(raw: &[u8], rows: usize, nb: usize) -> Vec<u8> {
    let rb = nb * Q8_0_BLOCK_BYTES;
    assert_eq!(raw.len(), rows * rb, "repack_q8_0x16: raw must hold rows * nb blocks");
    let groups = rows.div_ceil(Q4_1X16_ROWS);
    let mut out = vec![0u8; groups * nb * Q8_0X16_BLOCK_BYTES];
    for r in 0..rows {
        let (g, j) = (r / Q4_1X16_ROWS, r % Q4_1X16_ROWS);
        for b in 0..nb {
            let src = &raw[r * rb + b * Q8_0_BLOCK_BYTES..r * rb + (b + 1) * Q8_0_BLOCK_BYTES];
            let dst = &mut out[(g * nb + b) * Q8_0X16_BLOCK_BYTES..(g * nb + b + 1) * Q8_0X16_BLOCK_BYTES];
            dst[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
            let sum: i16 = src[2..].iter().map(|&q| i16::from(q as i8)).sum();
            dst[32 + 2 * j..32 + 2 * j + 2].copy_from_slice(&sum.to_le_bytes());
            for k in 0..8 {
                let o = 64 + 64 * k + 4 * j;
                dst[o..o + 4].copy_from_slice(&src[2 + 4 * k..6 + 4 * k]);
            }
        }
    }
    out
}

/// Q8_1 activation blocks of four interleaved rows: for rows `4g..4g+4` and block `b`, lane `c` holds row `4g+c`'s
/// 32 i8 values, its scale `d` (value ≈ d * q) and `s = d * Σq` (used by Q4_1 · Q8_1 to fold in the min).
/// Interleaving lets the matmul load four rows' scales as one vector and decode a weight block once for all four.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(32))]
pub struct BlockQ8_1x4 {
    /// Scales per lane.
    pub d: [f32; 4],
    /// d * Σ qs per lane.
    pub s: [f32; 4],
    /// Quantised values per lane.
    pub qs: [[i8; QK]; 4],
}

/// Quantises one block of 32 values the way GGML's `quantize_row_q8_1` does: `d = amax / 127`, round to nearest
/// (ties to even, as the AVX2 conversion does). Returns `(d, d * Σq)`.
pub fn quantize_block_q8_1(x: &[f32], qs: &mut [i8; QK]) -> (f32, f32) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in qs.iter_mut().zip(x) {
        let r = (v * id).round_ties_even() as i32;
        *q = r as i8;
        sum += r;
    }
    (d, d * sum as f32)
}

/// Number of [`BlockQ8_1x4`] needed for `n` rows of `cols` values.
pub fn q8_1x4_len(n: usize, cols: usize) -> usize {
    n.div_ceil(4) * (cols / QK)
}

/// Scalar reference quantisation of `x` (`[n][cols]`, cols a multiple of 32) into interleaved Q8_1 blocks;
/// `out[g * nb + b]` holds block `b` of rows `4g..4g+4` (lanes past `n` are zero).
pub fn quantize_rows_q8_1x4(x: &[f32], n: usize, cols: usize, out: &mut [BlockQ8_1x4]) {
    let nb = cols / QK;
    assert!(cols.is_multiple_of(QK) && x.len() == n * cols && out.len() == q8_1x4_len(n, cols));
    for (g, grp) in out.chunks_exact_mut(nb.max(1)).enumerate() {
        for c in 0..4 {
            let i = 4 * g + c;
            for (b, o) in grp.iter_mut().enumerate() {
                if i < n {
                    let (d, s) = quantize_block_q8_1(&x[i * cols + b * QK..i * cols + (b + 1) * QK], &mut o.qs[c]);
                    o.d[c] = d;
                    o.s[c] = s;
                } else {
                    o.d[c] = 0.0;
                    o.s[c] = 0.0;
                    o.qs[c] = [0; QK];
                }
            }
        }
    }
}
