//! GGUF v2/v3 reader over a memory map: header, every metadata value type (arrays included), tensor infos,
//! `general.alignment`, typed metadata getters and bounds-checked tensor byte slices.
//!
//! Every length and offset read from the file is checked against the file size before use, so a truncated or
//! corrupt file yields [`ModelError`], never a panic or an oversized allocation.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use super::error::ModelError;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Upper bound on tensor rank; ggml uses 4.
const MAX_DIMS: u32 = 8;
/// Pre-allocation cap for counts read from the file (they are still bounds-checked; this only stops a corrupt
/// count from reserving gigabytes before the read fails).
const MAX_PREALLOC: usize = 1 << 16;
/// Most metadata array elements in one file, all arrays together. Each element becomes a 32-byte [`MetaValue`] (a
/// u8 element is 32 times its size on disk), so the file's length alone does not bound the memory. Real tokenizers
/// need well under a million (Llama 3: 128,256 tokens, 280,147 merges and 128,256 token types; Gemma 3: 262,144
/// tokens with scores and types); this leaves ten times that and holds the arrays to 512 MiB.
pub const MAX_METADATA_ARRAY_ELEMENTS: usize = 1 << 24;

/// A metadata value of any GGUF type.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Array elements all share one type; arrays may nest.
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// The GGUF type name, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::F32(_) => "f32",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F64(_) => "f64",
        }
    }

    /// Any integer type (or bool) as i128, so that range checks are exact.
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v as i128,
            MetaValue::I8(v) => v as i128,
            MetaValue::U16(v) => v as i128,
            MetaValue::I16(v) => v as i128,
            MetaValue::U32(v) => v as i128,
            MetaValue::I32(v) => v as i128,
            MetaValue::U64(v) => v as i128,
            MetaValue::I64(v) => v as i128,
            MetaValue::Bool(v) => v as i128,
            _ => return None,
        })
    }

    /// Any numeric type as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_int().map(|v| v as f64),
        }
    }

    /// The string, if this is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, if this is an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// ggml tensor element types. Only the ones with a known block layout are accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    I8,
    I16,
    I32,
    I64,
    F64,
    BF16,
}

impl GgmlType {
    /// Maps the on-disk type id.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            9 => GgmlType::Q8_1,
            10 => GgmlType::Q2_K,
            11 => GgmlType::Q3_K,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            15 => GgmlType::Q8_K,
            24 => GgmlType::I8,
            25 => GgmlType::I16,
            26 => GgmlType::I32,
            27 => GgmlType::I64,
            28 => GgmlType::F64,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// The on-disk type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q8_1 => 9,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::Q8_K => 15,
            GgmlType::I8 => 24,
            GgmlType::I16 => 25,
            GgmlType::I32 => 26,
            GgmlType::I64 => 27,
            GgmlType::F64 => 28,
            GgmlType::BF16 => 30,
        }
    }

    /// (elements per block, bytes per block).
    pub fn block_layout(self) -> (u64, u64) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 => (1, 2),
            GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q8_1 => (32, 36),
            GgmlType::Q2_K => (256, 84),
            GgmlType::Q3_K => (256, 110),
            GgmlType::Q4_K => (256, 144),
            GgmlType::Q5_K => (256, 176),
            GgmlType::Q6_K => (256, 210),
            GgmlType::Q8_K => (256, 292),
            GgmlType::I8 => (1, 1),
            GgmlType::I16 => (1, 2),
            GgmlType::I32 => (1, 4),
            GgmlType::I64 => (1, 8),
            GgmlType::F64 => (1, 8),
        }
    }
}

/// One tensor's description from the header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension, i.e. the columns of a weight matrix.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset relative to the start of the data section (already validated to lie inside the file).
    pub offset: u64,
    /// Size in bytes (validated).
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

enum Storage {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file: metadata, tensor infos and the mapped bytes.
pub struct Gguf {
    storage: Storage,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: HashMap<String, MetaValue>,
    /// Keys in file order.
    keys: Vec<String>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("n_metadata", &self.keys.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Metadata array elements read so far, against [`MAX_METADATA_ARRAY_ELEMENTS`].
    array_elements: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ModelError> {
        if n > self.remaining() {
            return Err(ModelError::corrupt(format!(
                "truncated reading {what}: need {n} bytes at offset {}, file has {}",
                self.pos,
                self.buf.len()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], ModelError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &str) -> Result<u8, ModelError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, ModelError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &str) -> Result<u32, ModelError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, ModelError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count that must be satisfiable by the remaining bytes, each element taking at least `min_elem` bytes.
    fn count(&mut self, what: &str, min_elem: usize) -> Result<usize, ModelError> {
        let n = self.u64(what)?;
        let max = (self.remaining() / min_elem.max(1)) as u64;
        if n > max {
            return Err(ModelError::corrupt(format!(
                "{what} = {n} exceeds what the remaining {} bytes can hold",
                self.remaining()
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, ModelError> {
        let n = self.count(what, 1)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| ModelError::corrupt(format!("{what} at offset {} is not UTF-8", self.pos - n)))
    }

    fn value(&mut self, ty: u32, depth: u32, what: &str) -> Result<MetaValue, ModelError> {
        Ok(match ty {
            0 => MetaValue::U8(self.u8(what)?),
            1 => MetaValue::I8(self.u8(what)? as i8),
            2 => MetaValue::U16(self.u16(what)?),
            3 => MetaValue::I16(self.u16(what)? as i16),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(self.u32(what)? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32(what)?)),
            7 => match self.u8(what)? {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(ModelError::corrupt(format!("{what}: bool byte {b}"))),
            },
            8 => MetaValue::String(self.string(what)?),
            9 => {
                if depth >= 4 {
                    return Err(ModelError::corrupt(format!("{what}: arrays nested too deep")));
                }
                let elem_ty = self.u32(what)?;
                let min_elem = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8..=12 => 8,
                    _ => return Err(ModelError::corrupt(format!("{what}: unknown array element type {elem_ty}"))),
                };
                let n = self.count(what, min_elem)?;
                self.array_elements = self.array_elements.saturating_add(n);
                if self.array_elements > MAX_METADATA_ARRAY_ELEMENTS {
                    return Err(ModelError::corrupt(format!(
                        "{what}: metadata arrays hold more than {MAX_METADATA_ARRAY_ELEMENTS} elements in all"
                    )));
                }
                let mut items = Vec::with_capacity(n.min(MAX_PREALLOC));
                for _ in 0..n {
                    items.push(self.value(elem_ty, depth + 1, what)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(self.u64(what)? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64(what)?)),
            _ => return Err(ModelError::corrupt(format!("{what}: unknown metadata value type {ty}"))),
        })
    }
}

impl Gguf {
    /// Maps and parses a GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<Gguf, ModelError> {
        let path = path.as_ref();
        let io = |source| ModelError::Io { path: path.display().to_string(), source };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only; the model file must not be modified while it is served (documented
        // requirement, as for every mmap-based model loader).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(Storage::Mmap(mmap))
    }

    /// Parses GGUF bytes held in memory (tests, embedded models).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Gguf, ModelError> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<Gguf, ModelError> {
        let buf = storage.bytes();
        let mut r = Reader { buf, pos: 0, array_elements: 0 };
        let magic = r.take(4, "magic")?;
        if magic != GGUF_MAGIC {
            return Err(ModelError::corrupt(format!("bad magic {magic:02x?}, expected \"GGUF\"")));
        }
        let version = r.u32("version")?;
        if version != 2 && version != 3 {
            return Err(ModelError::Unsupported(format!("GGUF version {version} (need 2 or 3)")));
        }
        // A tensor info takes at least 8 (name len) + 4 (n_dims) + 4 (type) + 8 (offset) bytes.
        let n_tensors = r.count("tensor count", 24)?;
        // A key/value takes at least 8 (key len) + 4 (type) + 1 bytes.
        let n_kv = r.count("metadata count", 13)?;

        let mut metadata = HashMap::with_capacity(n_kv.min(MAX_PREALLOC));
        let mut keys = Vec::with_capacity(n_kv.min(MAX_PREALLOC));
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let ty = r.u32(&format!("type of `{key}`"))?;
            let value = r.value(ty, 0, &format!("value of `{key}`"))?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(ModelError::corrupt(format!("duplicate metadata key `{key}`")));
            }
            keys.push(key);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_int() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= 1 << 20 => a as u64,
                _ => return Err(ModelError::bad_meta("general.alignment", format!("{v:?} is not a power of two"))),
            },
        };

        let mut infos = Vec::with_capacity(n_tensors.min(MAX_PREALLOC));
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor #{i} name"))?;
            let n_dims = r.u32(&format!("rank of `{name}`"))?;
            if n_dims > MAX_DIMS {
                return Err(ModelError::corrupt(format!("tensor `{name}` has rank {n_dims}")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&format!("dims of `{name}`"))?);
            }
            let ty_id = r.u32(&format!("type of `{name}`"))?;
            let ggml_type = GgmlType::from_id(ty_id)
                .ok_or_else(|| ModelError::Unsupported(format!("tensor `{name}` has ggml type {ty_id}")))?;
            let offset = r.u64(&format!("offset of `{name}`"))?;
            infos.push((name, dims, ggml_type, offset));
        }

        let header_end = r.pos as u64;
        let data_offset = header_end
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| ModelError::corrupt("data offset overflows"))?;
        let file_len = buf.len() as u64;
        if data_offset > file_len {
            return Err(ModelError::corrupt("file ends before the tensor data section"));
        }
        let data_len = file_len - data_offset;

        let mut tensors = Vec::with_capacity(infos.len());
        let mut tensor_index = HashMap::with_capacity(infos.len());
        for (name, dims, ggml_type, offset) in infos {
            let mut n_elem: u64 = 1;
            for &d in &dims {
                n_elem = n_elem
                    .checked_mul(d)
                    .ok_or_else(|| ModelError::corrupt(format!("tensor `{name}` element count overflows")))?;
            }
            let (block_elems, block_bytes) = ggml_type.block_layout();
            let inner = dims.first().copied().unwrap_or(1);
            if inner % block_elems != 0 {
                return Err(ModelError::corrupt(format!(
                    "tensor `{name}`: row length {inner} is not a multiple of the {ggml_type:?} block size {block_elems}"
                )));
            }
            let n_bytes = (n_elem / block_elems)
                .checked_mul(block_bytes)
                .ok_or_else(|| ModelError::corrupt(format!("tensor `{name}` byte size overflows")))?;
            if offset % alignment != 0 {
                return Err(ModelError::corrupt(format!(
                    "tensor `{name}` offset {offset} is not aligned to {alignment}"
                )));
            }
            let end = offset
                .checked_add(n_bytes)
                .ok_or_else(|| ModelError::corrupt(format!("tensor `{name}` end overflows")))?;
            if end > data_len {
                return Err(ModelError::corrupt(format!(
                    "tensor `{name}` [{offset}, {end}) lies past the end of the data section ({data_len} bytes)"
                )));
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(ModelError::corrupt(format!("duplicate tensor `{name}`")));
            }
            tensors.push(TensorInfo { name, dims, ggml_type, offset, n_bytes });
        }

        Ok(Gguf { storage, version, alignment, data_offset, metadata, keys, tensors, tensor_index })
    }

    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data-section alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the tensor data section in the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Metadata keys in file order.
    pub fn metadata_keys(&self) -> &[String] {
        &self.keys
    }

    /// A raw metadata value.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn require(&self, key: &str) -> Result<&MetaValue, ModelError> {
        self.get(key).ok_or_else(|| ModelError::MissingKey(key.to_string()))
    }

    fn int_in_range(&self, key: &str, lo: i128, hi: i128) -> Result<i128, ModelError> {
        let v = self.require(key)?;
        let i = v
            .as_int()
            .ok_or_else(|| ModelError::bad_meta(key, format!("expected an integer, found {}", v.type_name())))?;
        if i < lo || i > hi {
            return Err(ModelError::bad_meta(key, format!("{i} is out of range")));
        }
        Ok(i)
    }

    /// An integer key (any integer type) that fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<u32, ModelError> {
        Ok(self.int_in_range(key, 0, u32::MAX as i128)? as u32)
    }

    /// An integer key (any integer type) that fits in u64.
    pub fn get_u64(&self, key: &str) -> Result<u64, ModelError> {
        Ok(self.int_in_range(key, 0, u64::MAX as i128)? as u64)
    }

    /// An integer key (any integer type) that fits in i64.
    pub fn get_i64(&self, key: &str) -> Result<i64, ModelError> {
        Ok(self.int_in_range(key, i64::MIN as i128, i64::MAX as i128)? as i64)
    }

    /// A u32 key, or `None` when absent (still an error when present with a bad type).
    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>, ModelError> {
        if self.get(key).is_none() { Ok(None) } else { self.get_u32(key).map(Some) }
    }

    /// A numeric key as f32.
    pub fn get_f32(&self, key: &str) -> Result<f32, ModelError> {
        let v = self.require(key)?;
        v.as_f64()
            .map(|f| f as f32)
            .ok_or_else(|| ModelError::bad_meta(key, format!("expected a number, found {}", v.type_name())))
    }

    /// A numeric key as f32, or `None` when absent.
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>, ModelError> {
        if self.get(key).is_none() { Ok(None) } else { self.get_f32(key).map(Some) }
    }

    /// A bool key.
    pub fn get_bool(&self, key: &str) -> Result<bool, ModelError> {
        match self.require(key)? {
            MetaValue::Bool(b) => Ok(*b),
            v => Err(ModelError::bad_meta(key, format!("expected a bool, found {}", v.type_name()))),
        }
    }

    /// A bool key, or `None` when absent.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>, ModelError> {
        if self.get(key).is_none() { Ok(None) } else { self.get_bool(key).map(Some) }
    }

    /// A string key.
    pub fn get_str(&self, key: &str) -> Result<&str, ModelError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| ModelError::bad_meta(key, format!("expected a string, found {}", v.type_name())))
    }

    /// A string key, or `None` when absent.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>, ModelError> {
        if self.get(key).is_none() { Ok(None) } else { self.get_str(key).map(Some) }
    }

    /// An array key.
    pub fn get_array(&self, key: &str) -> Result<&[MetaValue], ModelError> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| ModelError::bad_meta(key, format!("expected an array, found {}", v.type_name())))
    }

    /// An array-of-strings key.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, ModelError> {
        self.get_array(key)?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str().ok_or_else(|| {
                    ModelError::bad_meta(key, format!("element {i} is {}, expected string", v.type_name()))
                })
            })
            .collect()
    }

    /// An array-of-integers key as i64.
    pub fn get_int_array(&self, key: &str) -> Result<Vec<i64>, ModelError> {
        self.get_array(key)?
            .iter()
            .enumerate()
            .map(|(i, v)| match v.as_int() {
                Some(x) if x >= i64::MIN as i128 && x <= i64::MAX as i128 => Ok(x as i64),
                _ => Err(ModelError::bad_meta(key, format!("element {i} is {}, expected integer", v.type_name()))),
            })
            .collect()
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor's info by name.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor's raw bytes (validated at parse time to lie inside the file).
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], ModelError> {
        let info = self.tensor_info(name).ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        self.info_bytes(info)
    }

    /// The bytes of a tensor described by `info` (which must come from this file).
    pub fn info_bytes(&self, info: &TensorInfo) -> Result<&[u8], ModelError> {
        let buf = self.storage.bytes();
        let start = self
            .data_offset
            .checked_add(info.offset)
            .ok_or_else(|| ModelError::corrupt(format!("tensor `{}` offset overflows", info.name)))?;
        let end = start
            .checked_add(info.n_bytes)
            .ok_or_else(|| ModelError::corrupt(format!("tensor `{}` end overflows", info.name)))?;
        if end > buf.len() as u64 {
            return Err(ModelError::corrupt(format!("tensor `{}` lies past the end of the file", info.name)));
        }
        Ok(&buf[start as usize..end as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a small valid GGUF v3 file in memory.
    pub(crate) fn tiny_gguf() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes()); // tensors
        b.extend_from_slice(&5u64.to_le_bytes()); // kv
        let s = |b: &mut Vec<u8>, s: &str| {
            b.extend_from_slice(&(s.len() as u64).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        };
        s(&mut b, "general.architecture");
        b.extend_from_slice(&8u32.to_le_bytes());
        s(&mut b, "llama");
        s(&mut b, "general.alignment");
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&64u32.to_le_bytes());
        s(&mut b, "x.f");
        b.extend_from_slice(&12u32.to_le_bytes());
        b.extend_from_slice(&1.5f64.to_le_bytes());
        s(&mut b, "x.arr");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        s(&mut b, "a");
        s(&mut b, "bc");
        s(&mut b, "x.b");
        b.extend_from_slice(&7u32.to_le_bytes());
        b.push(1);
        // tensor infos
        s(&mut b, "t0");
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes()); // f32
        b.extend_from_slice(&0u64.to_le_bytes());
        s(&mut b, "t1");
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&32u64.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes()); // q8_0
        b.extend_from_slice(&64u64.to_le_bytes());
        while b.len() % 64 != 0 {
            b.push(0);
        }
        for i in 0..8 {
            b.extend_from_slice(&(i as f32).to_le_bytes());
        }
        b.extend_from_slice(&[0u8; 32]);
        b.extend_from_slice(&[7u8; 34]);
        b
    }

    #[test]
    fn parses_tiny_file() {
        let g = Gguf::from_bytes(tiny_gguf()).unwrap();
        assert_eq!(g.version(), 3);
        assert_eq!(g.alignment(), 64);
        assert_eq!(g.data_offset() % 64, 0);
        assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(g.get_f32("x.f").unwrap(), 1.5);
        assert_eq!(g.get_str_array("x.arr").unwrap(), vec!["a", "bc"]);
        assert!(g.get_bool("x.b").unwrap());
        assert!(matches!(g.get_u32("general.architecture"), Err(ModelError::BadMetadata { .. })));
        assert!(matches!(g.get_u32("nope"), Err(ModelError::MissingKey(_))));
        let t0 = g.tensor_bytes("t0").unwrap();
        assert_eq!(t0.len(), 32);
        assert_eq!(f32::from_le_bytes(t0[4..8].try_into().unwrap()), 1.0);
        assert_eq!(g.tensor_info("t0").unwrap().dims, vec![4, 2]);
        assert_eq!(g.tensor_bytes("t1").unwrap(), &[7u8; 34][..]);
        assert!(matches!(g.tensor_bytes("t9"), Err(ModelError::MissingTensor(_))));
    }

    #[test]
    fn type_ids_round_trip() {
        for id in 0..64 {
            if let Some(t) = GgmlType::from_id(id) {
                assert_eq!(t.id(), id);
            }
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        let full = tiny_gguf();
        for len in 0..full.len() {
            let r = Gguf::from_bytes(full[..len].to_vec());
            assert!(r.is_err(), "truncated to {len} bytes parsed");
        }
    }

    #[test]
    fn corrupt_bytes_never_panic() {
        let full = tiny_gguf();
        // Flip every byte of the header to a few hostile values; parsing may succeed or fail but must not panic,
        // and whatever parses must hand out only in-bounds slices.
        let header_len = full.len() - 98;
        for i in 0..header_len {
            for v in [0x00u8, 0xff, 0x7f, 0x80, 0x09] {
                let mut b = full.clone();
                b[i] = v;
                if let Ok(g) = Gguf::from_bytes(b) {
                    for t in g.tensors() {
                        let _ = g.info_bytes(t);
                    }
                }
            }
        }
    }

    #[test]
    fn rejects_bad_magic_version_and_huge_counts() {
        let mut b = tiny_gguf();
        b[0] = b'X';
        assert!(matches!(Gguf::from_bytes(b), Err(ModelError::Corrupt(_))));
        let mut b = tiny_gguf();
        b[4] = 1;
        assert!(matches!(Gguf::from_bytes(b), Err(ModelError::Unsupported(_))));
        let mut b = tiny_gguf();
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(Gguf::from_bytes(b), Err(ModelError::Corrupt(_))));
        let mut b = tiny_gguf();
        b[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(Gguf::from_bytes(b), Err(ModelError::Corrupt(_))));
    }

    /// A GGUF v3 file with no tensors and one metadata array per entry of `arrays` (u8 elements, all zero).
    fn gguf_with_u8_arrays(arrays: &[usize]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&(arrays.len() as u64).to_le_bytes());
        for (i, &n) in arrays.iter().enumerate() {
            let key = format!("x.a{i}");
            b.extend_from_slice(&(key.len() as u64).to_le_bytes());
            b.extend_from_slice(key.as_bytes());
            b.extend_from_slice(&9u32.to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
            b.extend_from_slice(&(n as u64).to_le_bytes());
            b.resize(b.len() + n, 0);
        }
        b
    }

    #[test]
    fn metadata_arrays_are_bounded_in_elements_not_just_bytes() {
        let err = Gguf::from_bytes(gguf_with_u8_arrays(&[MAX_METADATA_ARRAY_ELEMENTS + 1])).unwrap_err();
        assert!(matches!(err, ModelError::Corrupt(_)) && err.to_string().contains("metadata arrays"), "{err}");
        // The bound is on all arrays together.
        let half = MAX_METADATA_ARRAY_ELEMENTS / 2;
        let err = Gguf::from_bytes(gguf_with_u8_arrays(&[half, half + 1])).unwrap_err();
        assert!(err.to_string().contains("`x.a1`"), "{err}");
        let g = Gguf::from_bytes(gguf_with_u8_arrays(&[1000, 1000])).unwrap();
        assert_eq!(g.get_array("x.a1").unwrap().len(), 1000);
    }

    #[test]
    fn rejects_tensor_past_end() {
        let mut b = tiny_gguf();
        b.truncate(b.len() - 1);
        let e = Gguf::from_bytes(b).unwrap_err();
        assert!(e.to_string().contains("t1"), "{e}");
    }
}
