//! KV block codecs: the [`Codec`] names, the self-describing byte format of one encoded block, the scalar encoder
//! and decoder, and [`EncodedKv`], an arena of encoded blocks that the dequantise-on-load attention kernel
//! ([`crate::cpu::codecs`]) reads directly.
//!
//! A block is `block_size` slots of ONE (layer, kv-head), `head_dim` floats each, for K and for V; `filled <=
//! block_size` of them hold data (a partial block is the tail of a sequence). One encoded block is
//!
//! ```text
//! header (16 bytes)  "PGKV" | version u8 = 1 | codec id u8 | block_size u16 | head_dim u16 | filled u16 | 0u32
//! K half             codec-specific, fixed length for (codec, block_size, head_dim)
//! V half             same length as the K half except for the KIVI codecs
//! ```
//!
//! All integers and floats are little-endian; the length depends only on (codec, block_size, head_dim), so a
//! tier can store encoded blocks in fixed-size slots. Halves, with B = block_size, D = head_dim, G = ⌈D/32⌉:
//!
//! | codec | K half | V half | error bound per element (see `tests/codecs.rs`) |
//! |---|---|---|---|
//! | `f32` | `f32[B][D]` | same | exact |
//! | `f16` | `f16[B][D]` | same | RNE: ≤ 2⁻¹¹·\|x\| (normal range), \|x\| ≤ 65504 else rejected |
//! | `bf16` | `bf16[B][D]` | same | RNE: ≤ 2⁻⁸·\|x\| |
//! | `int8` | `f32 scale[B]`, `i8[B][D]` | same | symmetric per slot: scale = absmax/127, ≤ scale/2 |
//! | `fp8_e4m3` | `f32 scale`, `e4m3[B][D]` | same | per block (= per head): scale = absmax/448; ≤ 2⁻⁴·\|x\| for normals, ≤ 2⁻¹⁰·scale below |
//! | `fp8_e4m3_rotated` | `f32 scale`, `e4m3[B][D]` of each key rotated by [`hadamard_rotate`], less the mean where its slot's bit is set; `f32 mean scale`, `e4m3 mean[D]` (rotated), `u8 centred[⌈B/8⌉]` | `fp8_e4m3`'s | V as `fp8_e4m3`; K: the rotated key's bound, ≤ 2⁻⁴·‖key‖₂ + √D·2⁻¹⁰·scale per element (a centred row is never longer than its key) |
//! | `int4_kivi` | `f16 scale[D]`, `f16 min[D]`, `u4[B][D]` | `f16 scale[B][G]`, `f16 min[B][G]`, `u4[B][D]` | asymmetric: ≤ scale/2 (+ f16 rounding of min) |
//! | `int2_kivi` | as int4 with `u2` codes | as int4 with `u2` codes | as int4 with 3 levels instead of 15 |
//!
//! KIVI (Liu et al., 2024) quantises keys per channel and values per token. Values: each slot's channels are cut
//! into groups of [`KIVI_GROUP`] (32) consecutive channels, each with its own fp16 scale and min, as in the paper.
//! Keys: the paper groups G tokens of one channel; here the group is the block's filled slots (16 by default), so
//! every block stays independently decodable: eviction, compaction and the tiers move single blocks, and a 32-token
//! group would tie two blocks together. That is a finer grouping than the paper's (more scale bytes, lower error).
//! The paper also keeps the most recent tokens in full precision; here the block being filled stays f32 and is only
//! encoded once full, which plays the same role.
//!
//! `fp8_e4m3_rotated` stores each key rotated by the normalised Walsh–Hadamard transform (in chunks of the largest
//! power of two dividing D: the whole of a 64- or 128-wide head). e4m3's error is relative to each element, so
//! a q·k sum whose weight sits in a few channels (RoPE's low frequencies carry most of it) takes most of its error
//! from those few; rotated, the same energy is spread over every channel and the errors average out
//! (`docs/BENCHMARKS.md`: 3.8× lower KL than `fp8_e4m3` on the real model). The transform is orthonormal and its
//! own inverse, so `q·k = (Hq)·(Hk)`: the attention kernel rotates the query once per head and reads the codes as
//! `fp8_e4m3`'s, and the decoder rotates each key back. Values are not rotated: their error enters the output as
//! a norm, which a rotation does not change.
//!
//! Its keys are also centred: a block's keys share a large per-channel offset (three quarters of their energy on
//! SmolLM2), and e4m3 spends its relative precision on that shared part. Each rotated key is stored less the
//! block's rotated channel mean (kept once, in e4m3 with its own scale), except keys the mean would move away from
//! zero, the attention sink's above all, which are stored as they are; a bit per slot says which. Decoding adds the
//! mean back where the bit is set, and the attention kernel adds `(Hq)·mean` to those slots' scores. 70 bytes more
//! per 16 × 64 block (8.37 bits per element against 8.09; int8 takes 8.56); the KL at 2K falls by about half
//! (`docs/BENCHMARKS.md`, "Centred keys").
//!
//! Packed codes: `u4` row byte `j` holds channel `j` in its low nibble and channel `j + D/2` in its high nibble;
//! `u2` row byte `j` holds channel `j + t·D/4` in bits `2t..2t+2`. This keeps 8 consecutive channels in 8
//! consecutive bytes, which is what the AVX2 kernels load.
//!
//! Non-finite inputs are rejected ([`CodecError::NonFinite`]) by every codec: a NaN or infinity in the KV cache
//! means the forward pass already failed, and refusing it keeps every scale, and so every decoded block, finite.
//! Values a format cannot hold (beyond f16's 65504 for `f16` and the KIVI scale/min) are rejected too
//! ([`CodecError::OutOfRange`]). Decoding validates the header, the length, every scale and min, and (for the float
//! formats and fp8) every payload element, so corrupt bytes from disk or a peer give an error, never NaN KV.

use crate::cpu::scalar::dot_f32;
use crate::key_rounding::KeyRounding;
use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};
use thiserror::Error;

/// Symmetric int8 quantisation of one slot (the `int8` codec's rule, and an int8 [`crate::KvStorage`]'s): returns
/// the scale `absmax / 127` and writes `round(x / scale)` into `out` as two's-complement bytes. An all-zero row gets
/// scale 0 and zero codes; a row holding a NaN or an infinity gets a NaN scale (zero codes), so it reads back as
/// NaN, as a float cache would hold it. The codec rejects non-finite input before it gets here.
pub(crate) fn quantize_row_i8(x: &[f32], out: &mut [u8]) -> f32 {
    quantize_row(x, out, 127.0, |y| y.round().clamp(-127.0, 127.0) as i8 as u8)
}

/// e4m3 quantisation of one slot with its own scale `absmax / 448` (an fp8 [`crate::KvStorage`]'s rule: the
/// `fp8_e4m3` codec's, with one scale per slot instead of per block, since the pool writes a slot at a time). Zero
/// and non-finite rows as [`quantize_row_i8`].
pub(crate) fn quantize_row_e4m3(x: &[f32], out: &mut [u8]) -> f32 {
    quantize_row(x, out, E4M3_MAX, e4m3_from_f32)
}

fn quantize_row(x: &[f32], out: &mut [u8], top: f32, code: impl Fn(f32) -> u8) -> f32 {
    debug_assert_eq!(x.len(), out.len());
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if !(amax.is_finite() && x.iter().all(|v| !v.is_nan())) {
        out.fill(0);
        return f32::NAN;
    }
    let s = amax / top;
    if s > 0.0 {
        for (q, &v) in out.iter_mut().zip(x) {
            *q = code(v / s);
        }
    } else {
        out.fill(0);
    }
    s
}

/// Bytes of the block header.
pub const HEADER_LEN: usize = 16;
/// First four bytes of every encoded block.
pub const MAGIC: [u8; 4] = *b"PGKV";
/// The byte format version this crate writes and reads.
pub const FORMAT_VERSION: u8 = 1;
/// Largest block size a codec accepts (bounds the kernels' stack buffers).
pub const MAX_BLOCK_SIZE: usize = 256;
/// Largest head dimension a codec accepts (bounds the kernels' stack buffers).
pub const MAX_HEAD_DIM: usize = 256;
/// Channels per KIVI value group.
pub const KIVI_GROUP: usize = 32;
/// Largest magnitude e4m3 (fn variant: no infinities) represents.
pub const E4M3_MAX: f32 = 448.0;

/// How one KV block is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Uncompressed native f32 (the device arena's format).
    F32,
    F16,
    Bf16,
    /// Symmetric int8, one f32 scale per slot.
    Int8,
    /// FP8 E4M3 (fn: no infinities, max 448), one f32 scale per block.
    Fp8E4m3,
    /// [`Codec::Fp8E4m3`] over keys rotated by [`hadamard_rotate`]; values as `fp8_e4m3`.
    Fp8E4m3Rotated,
    /// KIVI 4-bit: keys per channel, values per token in groups of 32, fp16 scale and min.
    Int4Kivi,
    /// KIVI 2-bit, same layout as [`Codec::Int4Kivi`].
    Int2Kivi,
}

/// Which half of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    K,
    V,
}

impl fmt::Display for Half {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Half::K => "K",
            Half::V => "V",
        })
    }
}

/// Errors of encoding, decoding and storing KV blocks.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CodecError {
    #[error(
        "unknown codec {0:?} (expected one of f32, f16, bf16, int8, fp8_e4m3, fp8_e4m3_rotated, int4_kivi, int2_kivi)"
    )]
    UnknownCodec(String),
    #[error("{codec} cannot encode blocks of {block_size} slots x head_dim {head_dim}: {reason}")]
    BadShape { codec: Codec, block_size: usize, head_dim: usize, reason: &'static str },
    #[error("{what}: expected {expected} floats, got {got}")]
    BadInputLength { what: &'static str, expected: usize, got: usize },
    #[error("encoded block buffer: expected {expected} bytes, got {got}")]
    BadOutputLength { expected: usize, got: usize },
    #[error("{half} element {index} is not finite ({value})")]
    NonFinite { half: Half, index: usize, value: f32 },
    #[error("{codec} cannot represent {half} element {index} = {value}")]
    OutOfRange { codec: Codec, half: Half, index: usize, value: f32 },
    #[error("encoded block: {0}")]
    BadHeader(&'static str),
    #[error("encoded block has format version {0}, this build reads version 1")]
    UnsupportedVersion(u8),
    #[error("encoded block has unknown codec id {0}")]
    UnknownCodecId(u8),
    #[error("encoded block: expected {expected} bytes for its header's codec and shape, got {got}")]
    BadBlockLength { expected: usize, got: usize },
    #[error("encoded {codec} block, {half} half: {reason}")]
    Corrupt { codec: Codec, half: Half, reason: &'static str },
    #[error("encoded block is {got}, the arena holds {expected}")]
    WrongCodec { expected: Codec, got: Codec },
    #[error("block {block} out of range ({num_blocks} blocks)")]
    BlockOutOfRange { block: usize, num_blocks: usize },
    #[error("arena of {num_blocks} blocks x {block_len} bytes is too large")]
    TooLarge { num_blocks: usize, block_len: usize },
    #[error("key rounding for head_dim {head_dim}: {reason}")]
    BadKeyRounding { head_dim: usize, reason: &'static str },
}

impl Codec {
    /// Every codec, uncompressed first.
    pub const ALL: [Codec; 8] = [
        Codec::F32,
        Codec::F16,
        Codec::Bf16,
        Codec::Int8,
        Codec::Fp8E4m3,
        Codec::Fp8E4m3Rotated,
        Codec::Int4Kivi,
        Codec::Int2Kivi,
    ];

    /// The codec's name (what [`FromStr`] accepts).
    pub fn name(self) -> &'static str {
        match self {
            Codec::F32 => "f32",
            Codec::F16 => "f16",
            Codec::Bf16 => "bf16",
            Codec::Int8 => "int8",
            Codec::Fp8E4m3 => "fp8_e4m3",
            Codec::Fp8E4m3Rotated => "fp8_e4m3_rotated",
            Codec::Int4Kivi => "int4_kivi",
            Codec::Int2Kivi => "int2_kivi",
        }
    }

    /// The id stored in the header byte 5. Stable: part of the on-disk format.
    pub fn id(self) -> u8 {
        match self {
            Codec::F32 => 0,
            Codec::F16 => 1,
            Codec::Bf16 => 2,
            Codec::Int8 => 3,
            Codec::Fp8E4m3 => 4,
            Codec::Int4Kivi => 5,
            Codec::Int2Kivi => 6,
            // 7 was fp8_e4m3_rotated before its keys were centred (no channel mean): retired, so such blocks are
            // refused as an unknown codec rather than read with the wrong layout.
            Codec::Fp8E4m3Rotated => 8,
        }
    }

    /// The codec with header id `id`.
    pub fn from_id(id: u8) -> Option<Codec> {
        Codec::ALL.into_iter().find(|c| c.id() == id)
    }

    /// Checks that this codec can encode `[block_size][head_dim]` blocks.
    pub fn check_shape(self, block_size: usize, head_dim: usize) -> Result<(), CodecError> {
        let bad = |reason| Err(CodecError::BadShape { codec: self, block_size, head_dim, reason });
        if block_size == 0 || head_dim == 0 {
            return bad("block_size and head_dim must be non-zero");
        }
        if block_size > MAX_BLOCK_SIZE || head_dim > MAX_HEAD_DIM {
            return bad("block_size and head_dim are at most 256");
        }
        match self {
            Codec::Int4Kivi if !head_dim.is_multiple_of(2) => {
                bad("int4_kivi packs two channels per byte: head_dim must be even")
            }
            Codec::Int2Kivi if !head_dim.is_multiple_of(4) => {
                bad("int2_kivi packs four channels per byte: head_dim must be a multiple of 4")
            }
            _ => Ok(()),
        }
    }

    /// Bytes of one half (K or V) of an encoded block. The shape must have passed [`Codec::check_shape`].
    pub(crate) fn half_len(self, half: Half, bs: usize, hd: usize) -> usize {
        let groups = hd.div_ceil(KIVI_GROUP);
        let n = bs * hd;
        match (self, half) {
            (Codec::F32, _) => 4 * n,
            (Codec::F16 | Codec::Bf16, _) => 2 * n,
            (Codec::Int8, _) => 4 * bs + n,
            (Codec::Fp8E4m3Rotated, Half::K) => 4 + n + KeyMean::len(bs, hd),
            (Codec::Fp8E4m3 | Codec::Fp8E4m3Rotated, _) => 4 + n,
            (Codec::Int4Kivi, Half::K) => 4 * hd + n / 2,
            (Codec::Int4Kivi, Half::V) => 4 * bs * groups + n / 2,
            (Codec::Int2Kivi, Half::K) => 4 * hd + n / 4,
            (Codec::Int2Kivi, Half::V) => 4 * bs * groups + n / 4,
        }
    }

    /// Bytes of one encoded block (header included) of `block_size` slots × `head_dim`.
    pub fn encoded_len(self, block_size: usize, head_dim: usize) -> Result<usize, CodecError> {
        self.check_shape(block_size, head_dim)?;
        Ok(HEADER_LEN + self.half_len(Half::K, block_size, head_dim) + self.half_len(Half::V, block_size, head_dim))
    }

    /// Encodes one block into `out` (exactly [`Codec::encoded_len`] bytes). `k` and `v` hold the block's filled
    /// slots, `[filled][head_dim]` with `filled <= block_size`; the slots past `filled` are stored as zeros.
    /// Returns the header written.
    pub fn encode_block(
        self,
        block_size: usize,
        head_dim: usize,
        k: &[f32],
        v: &[f32],
        out: &mut [u8],
    ) -> Result<BlockHeader, CodecError> {
        self.encode_block_with(block_size, head_dim, k, v, out, None)
    }

    /// [`Codec::encode_block`], rounding `fp8_e4m3_rotated` keys for the queries of `keys` (query-aware rounding,
    /// [`crate::key_rounding`]) instead of to the nearest code. Other codecs ignore `keys`. The bytes decode as any
    /// other block of the codec.
    pub fn encode_block_with(
        self,
        block_size: usize,
        head_dim: usize,
        k: &[f32],
        v: &[f32],
        out: &mut [u8],
        keys: Option<&KeyRounding>,
    ) -> Result<BlockHeader, CodecError> {
        if let Some(r) = keys.filter(|r| r.head_dim() != head_dim) {
            return Err(CodecError::BadKeyRounding { head_dim: r.head_dim(), reason: "made for another head_dim" });
        }
        let expected = self.encoded_len(block_size, head_dim)?;
        if out.len() != expected {
            return Err(CodecError::BadOutputLength { expected, got: out.len() });
        }
        if !k.len().is_multiple_of(head_dim) || k.len() > block_size * head_dim {
            let expected = (k.len() / head_dim).min(block_size) * head_dim;
            return Err(CodecError::BadInputLength { what: "K ([filled][head_dim])", expected, got: k.len() });
        }
        if v.len() != k.len() {
            return Err(CodecError::BadInputLength { what: "V (same length as K)", expected: k.len(), got: v.len() });
        }
        for (half, x) in [(Half::K, k), (Half::V, v)] {
            if let Some((index, &value)) = x.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                return Err(CodecError::NonFinite { half, index, value });
            }
        }
        let header = BlockHeader { codec: self, block_size, head_dim, filled: k.len() / head_dim };
        header.write(&mut out[..HEADER_LEN]);
        let (kb, vb) = out[HEADER_LEN..].split_at_mut(self.half_len(Half::K, block_size, head_dim));
        encode_half(self, Half::K, block_size, head_dim, k, kb, keys)?;
        encode_half(self, Half::V, block_size, head_dim, v, vb, None)?;
        Ok(header)
    }

    /// Bits per KV element including scales, for a `[block_size][head_dim]` block (header included).
    pub fn bits_per_element(self, block_size: usize, head_dim: usize) -> Result<f64, CodecError> {
        Ok(self.encoded_len(block_size, head_dim)? as f64 * 8.0 / (2 * block_size * head_dim) as f64)
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Codec {
    type Err = CodecError;

    fn from_str(s: &str) -> Result<Codec, CodecError> {
        Codec::ALL.into_iter().find(|c| c.name() == s).ok_or_else(|| {
            // Bound what an error message echoes back from outside.
            CodecError::UnknownCodec(s.chars().take(64).collect())
        })
    }
}

/// The parsed 16-byte header of an encoded block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    pub codec: Codec,
    pub block_size: usize,
    pub head_dim: usize,
    /// Slots holding data; the rest decode as zeros.
    pub filled: usize,
}

impl BlockHeader {
    fn write(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&MAGIC);
        out[4] = FORMAT_VERSION;
        out[5] = self.codec.id();
        // check_shape bounds both dimensions by 256, so they fit u16.
        out[6..8].copy_from_slice(&(self.block_size as u16).to_le_bytes());
        out[8..10].copy_from_slice(&(self.head_dim as u16).to_le_bytes());
        out[10..12].copy_from_slice(&(self.filled as u16).to_le_bytes());
        out[12..16].fill(0);
    }

    /// Parses and validates the header of `bytes` (the whole encoded block), including that `bytes` has the
    /// length the header implies.
    pub fn parse(bytes: &[u8]) -> Result<BlockHeader, CodecError> {
        if bytes.len() < HEADER_LEN {
            return Err(CodecError::BadHeader("shorter than the 16-byte header"));
        }
        if bytes[..4] != MAGIC {
            return Err(CodecError::BadHeader("bad magic (not a Pagoda KV block)"));
        }
        if bytes[4] != FORMAT_VERSION {
            return Err(CodecError::UnsupportedVersion(bytes[4]));
        }
        let codec = Codec::from_id(bytes[5]).ok_or(CodecError::UnknownCodecId(bytes[5]))?;
        let u16_at = |i: usize| usize::from(u16::from_le_bytes([bytes[i], bytes[i + 1]]));
        let (block_size, head_dim, filled) = (u16_at(6), u16_at(8), u16_at(10));
        if bytes[12..16] != [0; 4] {
            return Err(CodecError::BadHeader("reserved bytes are not zero"));
        }
        let expected = codec.encoded_len(block_size, head_dim)?;
        if filled > block_size {
            return Err(CodecError::BadHeader("more filled slots than the block size"));
        }
        if bytes.len() != expected {
            return Err(CodecError::BadBlockLength { expected, got: bytes.len() });
        }
        Ok(BlockHeader { codec, block_size, head_dim, filled })
    }
}

/// Decodes one encoded block (self-describing: codec and shape come from its header) into `k_out` and `v_out`,
/// each exactly `block_size * head_dim` floats; slots past `filled` are set to zero. Validates everything (see the
/// module docs), so it is safe on bytes from disk or the network.
pub fn decode_block(bytes: &[u8], k_out: &mut [f32], v_out: &mut [f32]) -> Result<BlockHeader, CodecError> {
    let h = parse_for_outputs(bytes, k_out, v_out)?;
    validate_payload(&h, bytes)?;
    decode_payload(&h, bytes, k_out, v_out);
    Ok(h)
}

/// Decodes a block that [`decoded_magnitude_bound`] or [`validate_block`] accepted, without checking its payload a
/// second time: the header is parsed again (so lengths always agree with the bytes), the scales and codes are not.
/// On bytes that were not validated the values may be non-finite, never out of bounds.
pub fn decode_validated_block(bytes: &[u8], k_out: &mut [f32], v_out: &mut [f32]) -> Result<BlockHeader, CodecError> {
    let h = parse_for_outputs(bytes, k_out, v_out)?;
    decode_payload(&h, bytes, k_out, v_out);
    Ok(h)
}

/// The header of `bytes`, once the outputs are checked to hold `block_size * head_dim` floats each.
fn parse_for_outputs(bytes: &[u8], k_out: &[f32], v_out: &[f32]) -> Result<BlockHeader, CodecError> {
    let h = BlockHeader::parse(bytes)?;
    let n = h.block_size * h.head_dim;
    for (what, got) in [("K output ([block_size][head_dim])", k_out.len()), ("V output", v_out.len())] {
        if got != n {
            return Err(CodecError::BadInputLength { what, expected: n, got });
        }
    }
    Ok(h)
}

/// Decodes the payload of `bytes`, whose header `h` parsed, into outputs of `block_size * head_dim` floats each.
fn decode_payload(h: &BlockHeader, bytes: &[u8], k_out: &mut [f32], v_out: &mut [f32]) {
    let (kb, vb) = halves(h, bytes);
    let filled = h.filled * h.head_dim;
    // Formats with parameters shared by a block or a group widen them once per block; the others go row by row.
    let rows = |half: Half, b: &[u8], out: &mut [f32]| {
        for (slot, o) in out.chunks_exact_mut(h.head_dim).enumerate() {
            decode_row(h.codec, half, h.block_size, h.head_dim, b, slot, o);
        }
    };
    match h.codec {
        Codec::Int4Kivi | Codec::Int2Kivi => decode_kivi_keys(h.codec, h.head_dim, kb, h.filled, &mut k_out[..filled]),
        Codec::Fp8E4m3Rotated => decode_rotated_keys(h.block_size, h.head_dim, kb, h.filled, &mut k_out[..filled]),
        _ => rows(Half::K, kb, &mut k_out[..filled]),
    }
    match h.codec {
        Codec::Int4Kivi | Codec::Int2Kivi => {
            decode_kivi_values(h.codec, h.block_size, h.head_dim, vb, h.filled, &mut v_out[..filled])
        }
        _ => rows(Half::V, vb, &mut v_out[..filled]),
    }
    k_out[filled..].fill(0.0);
    v_out[filled..].fill(0.0);
}

/// Validates an encoded block completely (header, length, every scale and min, and payload elements where a bit
/// pattern can be non-finite) without decoding it: what [`decode_block`] checks, for consumers that decode elsewhere
/// (the GPU codecs).
pub fn validate_block(bytes: &[u8]) -> Result<BlockHeader, CodecError> {
    let h = BlockHeader::parse(bytes)?;
    validate_payload(&h, bytes)?;
    Ok(h)
}

/// Validates a block as [`validate_block`] does and bounds what it decodes to: no element's magnitude exceeds the
/// result. For consumers that decode into a narrower arena elsewhere (the GPU codecs into f16), which must refuse a
/// block whose values that arena would round to infinity. Exact for the float codecs, `int8` and `fp8_e4m3`; for
/// KIVI the top of each group's range; for rotated keys the codes' bound times √head_dim (the inverse rotation's
/// largest growth).
pub fn decoded_magnitude_bound(bytes: &[u8]) -> Result<f32, CodecError> {
    let h = validate_block(bytes)?;
    let (bs, hd, codec) = (h.block_size, h.head_dim, h.codec);
    let (kb, vb) = halves(&h, bytes);
    let mut bound = 0.0f32;
    for (half, b) in [(Half::K, kb), (Half::V, vb)] {
        let m = match codec {
            Codec::F32 => b.chunks_exact(4).map(|c| f32_at(c, 0).abs()).fold(0.0, f32::max),
            Codec::F16 => b.chunks_exact(2).map(|c| f16_at(c, 0).abs()).fold(0.0, f32::max),
            Codec::Bf16 => {
                b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32().abs()).fold(0.0, f32::max)
            }
            Codec::Int8 => (0..bs)
                .map(|i| {
                    let codes = &b[4 * bs + i * hd..4 * bs + (i + 1) * hd];
                    f32::from(codes.iter().map(|&q| (q as i8).unsigned_abs()).max().unwrap_or(0)) * f32_at(b, 4 * i)
                })
                .fold(0.0, f32::max),
            Codec::Fp8E4m3 | Codec::Fp8E4m3Rotated => {
                // e4m3 magnitudes order as their 7-bit codes do, so the largest code gives the largest value.
                let largest = |codes: &[u8]| e4m3_to_f32(codes.iter().fold(0, |top, &q| top.max(q & 0x7F)));
                if codec == Codec::Fp8E4m3Rotated && half == Half::K {
                    let mean = KeyMean::of(b, bs, hd);
                    let m = largest(&b[4..KeyMean::offset(bs, hd)]) * f32_at(b, 0) + largest(mean.codes) * mean.scale;
                    m * (hd as f32).sqrt()
                } else {
                    largest(&b[4..]) * f32_at(b, 0)
                }
            }
            Codec::Int4Kivi | Codec::Int2Kivi => {
                let pairs = if half == Half::K { hd } else { bs * hd.div_ceil(KIVI_GROUP) };
                let top = f32::from(kivi_levels(codec));
                let (scale_bytes, min_bytes) = b[..4 * pairs].split_at(2 * pairs);
                let (mut scales, mut mins) = ([0.0f32; 64], [0.0f32; 64]);
                let mut bound = 0.0f32;
                for (sb, mb) in scale_bytes.chunks(2 * 64).zip(min_bytes.chunks(2 * 64)) {
                    let (scales, mins) = (&mut scales[..sb.len() / 2], &mut mins[..mb.len() / 2]);
                    f16s_to_f32(sb, scales);
                    f16s_to_f32(mb, mins);
                    let chunk = scales.iter().zip(&*mins).map(|(&s, &m)| m.abs().max((m + top * s).abs()));
                    bound = chunk.fold(bound, f32::max);
                }
                bound
            }
        };
        bound = bound.max(m);
    }
    Ok(bound)
}

/// The K and V halves of a block whose header `h` was parsed from `bytes`.
fn halves<'a>(h: &BlockHeader, bytes: &'a [u8]) -> (&'a [u8], &'a [u8]) {
    bytes[HEADER_LEN..].split_at(h.codec.half_len(Half::K, h.block_size, h.head_dim))
}

/// Checks every scale and min of a block, and every payload element where a bit pattern can be non-finite, so
/// that decoding and the attention kernels only ever see finite values.
fn validate_payload(h: &BlockHeader, bytes: &[u8]) -> Result<(), CodecError> {
    let (bs, hd, codec) = (h.block_size, h.head_dim, h.codec);
    let (kb, vb) = halves(h, bytes);
    for (half, b) in [(Half::K, kb), (Half::V, vb)] {
        let corrupt = |reason| Err(CodecError::Corrupt { codec, half, reason });
        match codec {
            Codec::F32 => {
                if b.chunks_exact(4).any(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite()) {
                    return corrupt("non-finite element");
                }
            }
            Codec::F16 => {
                if b.chunks_exact(2).any(|c| !f16::from_le_bytes([c[0], c[1]]).is_finite()) {
                    return corrupt("non-finite element");
                }
            }
            Codec::Bf16 => {
                if b.chunks_exact(2).any(|c| !bf16::from_le_bytes([c[0], c[1]]).is_finite()) {
                    return corrupt("non-finite element");
                }
            }
            Codec::Int8 => {
                if (0..bs).any(|i| !valid_scale(f32_at(b, 4 * i), I8_MAX_CODE)) {
                    return corrupt("negative or non-finite scale, or one that overflows a code");
                }
                // The encoder clamps to ±127; -128 is only ever a corrupt byte.
                if b[4 * bs..].contains(&I8_NEVER_WRITTEN) {
                    return corrupt("int8 code -128");
                }
            }
            Codec::Fp8E4m3Rotated if half == Half::K => {
                let top = rotated_key_top(hd);
                let mean = KeyMean::of(b, bs, hd);
                if !valid_scale(f32_at(b, 0), top) || !valid_scale(mean.scale, top) {
                    return corrupt("negative or non-finite scale, or one that overflows a code");
                }
                if has_e4m3_nan(&b[4..KeyMean::offset(bs, hd)]) || has_e4m3_nan(mean.codes) {
                    return corrupt("e4m3 NaN code");
                }
                // The encoder sets bits of filled slots only: any other is a flipped bit.
                if (h.filled..8 * mean.centred.len()).any(|i| mean.is_centred(i)) {
                    return corrupt("a slot past the filled ones is marked centred");
                }
            }
            Codec::Fp8E4m3 | Codec::Fp8E4m3Rotated => {
                if !valid_scale(f32_at(b, 0), E4M3_MAX) {
                    return corrupt("negative or non-finite scale, or one that overflows a code");
                }
                if has_e4m3_nan(&b[4..]) {
                    return corrupt("e4m3 NaN code");
                }
            }
            Codec::Int4Kivi | Codec::Int2Kivi => {
                let params = match half {
                    Half::K => 2 * hd,
                    Half::V => 2 * bs * hd.div_ceil(KIVI_GROUP),
                };
                let scales = params / 2;
                // No overflow bound here: scale and min are f16 (at most 65504), so min + 15 × scale stays far
                // inside f32. On the bits: exponent all ones is infinity or NaN; a scale may be +0 or -0, no
                // other value with the sign bit.
                let bad = b[..2 * params].chunks_exact(2).enumerate().fold(false, |bad, (i, c)| {
                    let x = u16::from_le_bytes([c[0], c[1]]);
                    bad | (x & 0x7C00 == 0x7C00) | (i < scales && x > 0x8000)
                });
                if bad {
                    return corrupt("negative or non-finite scale, or non-finite min");
                }
            }
        }
    }
    Ok(())
}

/// Whether any of `codes` is an e4m3 NaN. A fold over every byte rather than `any`, which stops early and so does
/// not vectorise.
fn has_e4m3_nan(codes: &[u8]) -> bool {
    codes.iter().fold(false, |bad, &q| bad | (q & 0x7F == 0x7F))
}

/// Largest magnitude of an int8 code the encoders write.
pub const I8_MAX_CODE: f32 = 127.0;
/// The int8 code (-128) no encoder writes: quantisation is symmetric, clamped to ±127.
pub const I8_NEVER_WRITTEN: u8 = 0x80;

/// Whether `s` is a scale under which every code of magnitude up to `top` decodes to a finite value. A finite
/// scale is not enough: 3e38 × 127 is infinite, and one infinite key turns a softmax into NaN.
pub fn valid_scale(s: f32, top: f32) -> bool {
    s >= 0.0 && (s * top).is_finite()
}

/// Bound on what an e4m3 half decodes to before scaling, counting the growth of the inverse rotation for rotated
/// keys: its unnormalised butterflies sum up to `head_dim` values (a chunk is at most the row) before the
/// `1/sqrt(n)`, so the scale must keep that sum finite too. The factor 2 covers the rounding of those sums.
pub fn max_e4m3_magnitude(rotated: bool, head_dim: usize) -> f32 {
    if rotated { E4M3_MAX * (2 * head_dim.max(1)) as f32 } else { E4M3_MAX }
}

#[inline]
pub(crate) fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

#[inline]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Widens the little-endian f16 values of `b` (`2 × out.len()` bytes) into `out` through the F16C loop
/// ([`crate::cpu::widen_f16`]) a chunk at a time, where [`f16_at`] converts (and checks the CPU) one value at a time.
fn f16s_to_f32(b: &[u8], out: &mut [f32]) {
    const CHUNK: usize = 64;
    let mut bits = [0u16; CHUNK];
    for (o, bc) in out.chunks_mut(CHUNK).zip(b.chunks(2 * CHUNK)) {
        let bits = &mut bits[..o.len()];
        for (h, c) in bits.iter_mut().zip(bc.chunks_exact(2)) {
            *h = u16::from_le_bytes([c[0], c[1]]);
        }
        crate::cpu::widen_f16(bits, o);
    }
}

/// 2^120: moves an e4m3 exponent placed in an f32's exponent field to its true value (see [`e4m3_to_f32`]).
pub(crate) const E4M3_RESCALE: f32 = f32::from_bits((120 + 127) << 23);

/// 2^8: the same for an e4m3 code widened through an f16 (the vector kernels' form, exponent bias 15 against 7).
pub(crate) const E4M3_F16_RESCALE: f32 = 256.0;

/// Decodes one e4m3 byte. Placing the 7 magnitude bits at f32 bits 20..27 makes an f32 whose exponent is the e4m3
/// exponent biased by 127 instead of 7 (subnormals included: both become f32 subnormals or normals consistently),
/// so one multiplication by 2^120 gives the exact value. The AVX2 kernel does the same in registers.
#[inline]
pub fn e4m3_to_f32(b: u8) -> f32 {
    let mag = f32::from_bits(u32::from(b & 0x7F) << 20) * E4M3_RESCALE;
    if b & 0x80 != 0 { -mag } else { mag }
}

/// Encodes `y` (finite) as e4m3 with round-to-nearest-even, saturating at ±448 (e4m3fn has no infinity).
#[inline]
pub fn e4m3_from_f32(y: f32) -> u8 {
    let sign = if y.is_sign_negative() { 0x80 } else { 0 };
    let a = y.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    if a < 2f32.powi(-6) {
        // Subnormal range, step 2^-9; the result 8 is the smallest normal, whose code is also 8.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let e = (bits >> 23) as i32 - 127;
    let man = bits & 0x7F_FFFF;
    let mut q = (((e + 7) as u32) << 3) | (man >> 20);
    let rem = man & 0xF_FFFF;
    // A carry out of the mantissa correctly bumps the exponent.
    if rem > 0x8_0000 || (rem == 0x8_0000 && q & 1 == 1) {
        q += 1;
    }
    sign | q.min(0x7E) as u8
}

/// Quantisation levels of the KIVI codecs (2^bits - 1).
#[inline]
pub(crate) fn kivi_levels(codec: Codec) -> u8 {
    if codec == Codec::Int2Kivi { 3 } else { 15 }
}

/// fp16 scale and min of a KIVI group with extremes `mn`, `mx`. The min is rounded to nearest and the scale is
/// computed from that rounded min, so the codes 0..=levels cover [min_h, max] up to one f16 rounding of the scale.
fn kivi_params(codec: Codec, half: Half, index: usize, mn: f32, mx: f32) -> Result<(f16, f16), CodecError> {
    let min_h = f16::from_f32(mn);
    if !min_h.is_finite() {
        return Err(CodecError::OutOfRange { codec, half, index, value: mn });
    }
    let range = (mx - min_h.to_f32()).max(0.0);
    let scale_h = f16::from_f32(range / f32::from(kivi_levels(codec)));
    if !scale_h.is_finite() {
        return Err(CodecError::OutOfRange { codec, half, index, value: mx });
    }
    Ok((scale_h, min_h))
}

#[inline]
fn kivi_code(x: f32, min: f32, scale: f32, levels: u8) -> u8 {
    if scale > 0.0 { ((x - min) / scale).round().clamp(0.0, f32::from(levels)) as u8 } else { 0 }
}

/// Packs `codes[c]` (one per channel) into a row of `u4` or `u2` codes (layout in the module docs).
fn pack_row(codec: Codec, codes: &[u8], row: &mut [u8]) {
    let hd = codes.len();
    if codec == Codec::Int4Kivi {
        let h = hd / 2;
        for (j, b) in row.iter_mut().enumerate() {
            *b = codes[j] | (codes[j + h] << 4);
        }
    } else {
        let q = hd / 4;
        for (j, b) in row.iter_mut().enumerate() {
            *b = codes[j] | (codes[j + q] << 2) | (codes[j + 2 * q] << 4) | (codes[j + 3 * q] << 6);
        }
    }
}

/// Code of channel `c` in a packed row.
#[inline]
fn unpack(codec: Codec, row: &[u8], hd: usize, c: usize) -> u8 {
    if codec == Codec::Int4Kivi {
        let h = hd / 2;
        if c < h { row[c] & 0x0F } else { row[c - h] >> 4 }
    } else {
        let q = hd / 4;
        (row[c % q] >> (2 * (c / q))) & 0x03
    }
}

/// Bytes of one packed row.
#[inline]
pub(crate) fn packed_row_len(codec: Codec, hd: usize) -> usize {
    if codec == Codec::Int4Kivi { hd / 2 } else { hd / 4 }
}

/// Encodes `x` (`[filled][hd]`, finite) into one half `out`; slots past `filled` become zeros. `keys` rounds the
/// rotated fp8 keys for the queries (see [`Codec::encode_block_with`]).
fn encode_half(
    codec: Codec,
    half: Half,
    bs: usize,
    hd: usize,
    x: &[f32],
    out: &mut [u8],
    keys: Option<&KeyRounding>,
) -> Result<(), CodecError> {
    let filled = x.len() / hd;
    let range = |codec, index, value| CodecError::OutOfRange { codec, half, index, value };
    match codec {
        Codec::F32 => {
            for (o, &v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
            out[4 * x.len()..].fill(0);
        }
        Codec::F16 => {
            for (i, (o, &v)) in out.chunks_exact_mut(2).zip(x).enumerate() {
                let h = f16::from_f32(v);
                if !h.is_finite() {
                    return Err(range(codec, i, v));
                }
                o.copy_from_slice(&h.to_le_bytes());
            }
            out[2 * x.len()..].fill(0);
        }
        Codec::Bf16 => {
            for (i, (o, &v)) in out.chunks_exact_mut(2).zip(x).enumerate() {
                let h = bf16::from_f32(v);
                if !h.is_finite() {
                    return Err(range(codec, i, v));
                }
                o.copy_from_slice(&h.to_le_bytes());
            }
            out[2 * x.len()..].fill(0);
        }
        Codec::Int8 => {
            let (scales, qs) = out.split_at_mut(4 * bs);
            scales.fill(0);
            qs.fill(0);
            for (i, row) in x.chunks_exact(hd).enumerate() {
                let s = quantize_row_i8(row, &mut qs[i * hd..(i + 1) * hd]);
                scales[4 * i..4 * i + 4].copy_from_slice(&s.to_le_bytes());
            }
        }
        Codec::Fp8E4m3Rotated if half == Half::K => encode_rotated_keys(bs, hd, x, out, keys)?,
        Codec::Fp8E4m3 | Codec::Fp8E4m3Rotated => {
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let s = amax / E4M3_MAX;
            out[..4].copy_from_slice(&s.to_le_bytes());
            let qs = &mut out[4..];
            qs.fill(0);
            if s > 0.0 {
                for (q, &v) in qs.iter_mut().zip(x) {
                    *q = e4m3_from_f32(v / s);
                }
            }
        }
        Codec::Int4Kivi | Codec::Int2Kivi => {
            let levels = kivi_levels(codec);
            let rl = packed_row_len(codec, hd);
            let mut codes = [0u8; MAX_HEAD_DIM];
            let codes = &mut codes[..hd];
            match half {
                Half::K => {
                    let (params, qs) = out.split_at_mut(4 * hd);
                    qs.fill(0);
                    let mut scale = [0.0f32; MAX_HEAD_DIM];
                    let mut min = [0.0f32; MAX_HEAD_DIM];
                    for c in 0..hd {
                        let (mut mn, mut mx) = (f32::INFINITY, f32::NEG_INFINITY);
                        for row in x.chunks_exact(hd) {
                            mn = mn.min(row[c]);
                            mx = mx.max(row[c]);
                        }
                        let (s, m) =
                            if filled == 0 { (f16::ZERO, f16::ZERO) } else { kivi_params(codec, half, c, mn, mx)? };
                        params[2 * c..2 * c + 2].copy_from_slice(&s.to_le_bytes());
                        params[2 * (hd + c)..2 * (hd + c) + 2].copy_from_slice(&m.to_le_bytes());
                        scale[c] = s.to_f32();
                        min[c] = m.to_f32();
                    }
                    for (row, out_row) in x.chunks_exact(hd).zip(qs.chunks_exact_mut(rl)) {
                        for c in 0..hd {
                            codes[c] = kivi_code(row[c], min[c], scale[c], levels);
                        }
                        pack_row(codec, codes, out_row);
                    }
                }
                Half::V => {
                    let groups = hd.div_ceil(KIVI_GROUP);
                    let (params, qs) = out.split_at_mut(4 * bs * groups);
                    params.fill(0);
                    qs.fill(0);
                    let mins = 2 * bs * groups;
                    for (i, (row, out_row)) in x.chunks_exact(hd).zip(qs.chunks_exact_mut(rl)).enumerate() {
                        for g in 0..groups {
                            let ch = g * KIVI_GROUP..((g + 1) * KIVI_GROUP).min(hd);
                            let (mn, mx) = row[ch.clone()]
                                .iter()
                                .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| (a.min(v), b.max(v)));
                            let (s, m) = kivi_params(codec, half, i * hd + ch.start, mn, mx)?;
                            let p = 2 * (i * groups + g);
                            params[p..p + 2].copy_from_slice(&s.to_le_bytes());
                            params[mins + p..mins + p + 2].copy_from_slice(&m.to_le_bytes());
                            let (s, m) = (s.to_f32(), m.to_f32());
                            for c in ch {
                                codes[c] = kivi_code(row[c], m, s, levels);
                            }
                        }
                        pack_row(codec, codes, out_row);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Rounds of [`encode_rotated_keys`]' choice of rows to centre: each drops the rows the mean moved away from zero
/// and takes the mean of the rest again. An attention sink (a key far from its block's others) leaves in the first.
const KEY_MEAN_ROUNDS: usize = 3;

/// The channel mean that closes an `fp8_e4m3_rotated` key half, after the codes (layout in the module docs).
pub(crate) struct KeyMean<'a> {
    /// Scale of the mean's e4m3 codes.
    pub(crate) scale: f32,
    /// The mean of the rotated keys, e4m3 codes `[D]`.
    pub(crate) codes: &'a [u8],
    /// Bit `i % 8` of byte `i / 8` set: slot `i` was stored less the mean.
    pub(crate) centred: &'a [u8],
}

impl<'a> KeyMean<'a> {
    /// Bytes after the codes: the mean's scale, its codes, one bit per slot.
    pub(crate) fn len(bs: usize, hd: usize) -> usize {
        4 + hd + bs.div_ceil(8)
    }

    /// Where the mean starts in a key half: after the block's scale and codes.
    pub(crate) fn offset(bs: usize, hd: usize) -> usize {
        4 + bs * hd
    }

    /// The mean of the key half `b` of a `[bs][hd]` block.
    pub(crate) fn of(b: &'a [u8], bs: usize, hd: usize) -> KeyMean<'a> {
        let at = Self::offset(bs, hd);
        KeyMean { scale: f32_at(b, at), codes: &b[at + 4..at + 4 + hd], centred: &b[at + 4 + hd..] }
    }

    pub(crate) fn is_centred(&self, slot: usize) -> bool {
        self.centred[slot / 8] >> (slot % 8) & 1 == 1
    }
}

/// Encodes the keys of an `fp8_e4m3_rotated` block into its K half `out`: each key rotated, less the block's
/// channel mean where that brings it closer to zero, in e4m3 under one scale; then the mean (rotated, e4m3, its own
/// scale) and which slots were centred.
///
/// Why a mean: a model's keys share a large per-channel offset (RoPE's slow pairs barely turn within a block), and
/// e4m3's error is relative to what it rounds, so most of a key's rounding error is spent on the part every key of
/// the block shares. Why per row: the attention sink's key is far from the others, and centring it would only
/// enlarge it; it is stored as it is, and the mean is taken over the rows it helps.
fn encode_rotated_keys(
    bs: usize,
    hd: usize,
    x: &[f32],
    out: &mut [u8],
    keys: Option<&KeyRounding>,
) -> Result<(), CodecError> {
    let range = |index, value| CodecError::OutOfRange { codec: Codec::Fp8E4m3Rotated, half: Half::K, index, value };
    out.fill(0);
    let mut centred = [true; MAX_BLOCK_SIZE];
    let mut mean = [0.0f32; MAX_HEAD_DIM];
    let mean = &mut mean[..hd];
    for _ in 0..KEY_MEAN_ROUNDS {
        mean.fill(0.0);
        let mut n = 0usize;
        for (r, _) in x.chunks_exact(hd).zip(&centred).filter(|(_, c)| **c) {
            mean.iter_mut().zip(r).for_each(|(m, &v)| *m += v);
            n += 1;
        }
        let inv = if n > 0 { 1.0 / n as f32 } else { 0.0 };
        mean.iter_mut().for_each(|m| *m *= inv);
        let mm = dot_f32(mean, mean);
        let mut changed = false;
        for (r, c) in x.chunks_exact(hd).zip(centred.iter_mut()) {
            // ‖r - m‖² < ‖r‖²
            let closer = 2.0 * dot_f32(r, mean) > mm;
            changed |= closer != *c;
            *c = closer;
        }
        if !changed {
            break;
        }
    }
    // The mean is stored rotated, in e4m3: decoding adds back exactly what is stored, so its rounding costs
    // nothing but a slightly different centre.
    hadamard_rotate(mean);
    let mean_amax = mean.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if !mean_amax.is_finite() {
        // Only a mean of values near f32::MAX gets here (the input is finite).
        return Err(range(0, x.iter().fold(0.0f32, |m, v| m.max(v.abs()))));
    }
    let mean_scale = mean_amax / E4M3_MAX;
    let (codes, tail) = out.split_at_mut(KeyMean::offset(bs, hd));
    tail[..4].copy_from_slice(&mean_scale.to_le_bytes());
    for (q, m) in tail[4..4 + hd].iter_mut().zip(mean.iter_mut()) {
        *q = if mean_scale > 0.0 { e4m3_from_f32(*m / mean_scale) } else { 0 };
        *m = e4m3_to_f32(*q) * mean_scale;
    }
    // The final choice is against the stored mean, so a centred row is never longer than the key it stands for
    // (the error bound of the module docs holds as without the mean).
    let mut unrotated = [0.0f32; MAX_HEAD_DIM];
    let unrotated = rotated_copy(mean, &mut unrotated);
    let mm = dot_f32(mean, mean);
    let mask = &mut tail[4 + hd..];
    for (i, r) in x.chunks_exact(hd).enumerate() {
        centred[i] = mm > 0.0 && 2.0 * dot_f32(r, unrotated) > mm;
        mask[i / 8] |= u8::from(centred[i]) << (i % 8);
    }
    // Residual rows are computed twice (for the scale, then for the codes) rather than kept: a whole block of them
    // would need a heap buffer, and encoding runs per block moved to a tier, not per token.
    let mut buf = [0.0f32; MAX_HEAD_DIM];
    let residual = |i: usize, r: &[f32], buf: &mut [f32; MAX_HEAD_DIM]| {
        let y = rotated_copy(r, &mut buf[..hd]);
        if centred[i] {
            y.iter_mut().zip(mean.iter()).for_each(|(v, m)| *v -= m);
        }
    };
    let mut amax = 0.0f32;
    for (i, r) in x.chunks_exact(hd).enumerate() {
        residual(i, r, &mut buf);
        amax = buf[..hd].iter().fold(amax, |m, v| m.max(v.abs()));
        if !amax.is_finite() {
            return Err(range(i * hd, r.iter().fold(0.0f32, |m, v| m.max(v.abs()))));
        }
    }
    let s = amax / E4M3_MAX;
    let top = rotated_key_top(hd);
    if !valid_scale(s, top) || !valid_scale(mean_scale, top) {
        return Err(range(0, x.iter().fold(0.0f32, |m, v| m.max(v.abs()))));
    }
    codes[..4].copy_from_slice(&s.to_le_bytes());
    if s > 0.0 {
        for (i, (r, q)) in x.chunks_exact(hd).zip(codes[4..].chunks_exact_mut(hd)).enumerate() {
            residual(i, r, &mut buf);
            match keys {
                Some(rounding) => rounding.round_row(&mut buf[..hd], s, q),
                None => q.iter_mut().zip(&buf[..hd]).for_each(|(q, &v)| *q = e4m3_from_f32(v / s)),
            }
        }
    }
    Ok(())
}

/// The scale bound ([`valid_scale`]) of both scales of an `fp8_e4m3_rotated` key half: a decoded element is a
/// code times the scale plus a mean code times its scale, summed over the inverse rotation, so each scale keeps
/// twice [`max_e4m3_magnitude`]'s headroom.
fn rotated_key_top(hd: usize) -> f32 {
    2.0 * max_e4m3_magnitude(true, hd)
}

/// `x` rotated by [`hadamard_rotate`] into the start of `buf` (at least as long), `x` left as it is: how the
/// rotated-key formats rotate a query or a key they may not overwrite.
pub(crate) fn rotated_copy<'a>(x: &[f32], buf: &'a mut [f32]) -> &'a mut [f32] {
    let r = &mut buf[..x.len()];
    r.copy_from_slice(x);
    hadamard_rotate(r);
    r
}

/// Rotates `x` in place by the normalised Walsh–Hadamard transform `H / √n`, applied to consecutive chunks of
/// `n` = the largest power of two dividing `x.len()` (the whole row when its length is a power of two). The
/// transform is orthonormal and symmetric, so it is its own inverse: applying it twice gives `x` back up to f32
/// rounding. `fp8_e4m3_rotated` applies it to keys before quantising and after decoding, and the attention
/// kernels to the query.
pub fn hadamard_rotate(x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let n = 1usize << x.len().trailing_zeros();
    let norm = 1.0 / (n as f32).sqrt();
    #[cfg(target_arch = "x86_64")]
    if n >= 8 && crate::cpu::avx2_available() {
        // SAFETY: AVX2/FMA/F16C checked just above; `n` is a power of two of at least 8 dividing `x.len()`.
        unsafe { crate::cpu::codecs_avx2::hadamard_rotate(x, n, norm) };
        return;
    }
    hadamard_rotate_scalar(x, n, norm);
}

/// [`hadamard_rotate`] one butterfly at a time: the reference the AVX2 form equals bit for bit (the same sums and
/// differences in the same order, then the same product by `norm`).
pub(crate) fn hadamard_rotate_scalar(x: &mut [f32], n: usize, norm: f32) {
    for c in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for i in (0..n).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (c[j], c[j + h]);
                    c[j] = a + b;
                    c[j + h] = a - b;
                }
            }
            h *= 2;
        }
        for v in c.iter_mut() {
            *v *= norm;
        }
    }
}

/// Decodes slot `slot` of one half `b` (a validated block) into `out` (`head_dim` floats). Shared by
/// [`decode_block`] and the scalar attention kernel, so both produce identical values.
#[inline]
pub(crate) fn decode_row(codec: Codec, half: Half, bs: usize, hd: usize, b: &[u8], slot: usize, out: &mut [f32]) {
    match codec {
        Codec::F32 => {
            for (c, o) in out.iter_mut().enumerate() {
                *o = f32_at(b, 4 * (slot * hd + c));
            }
        }
        Codec::F16 => {
            for (c, o) in out.iter_mut().enumerate() {
                *o = f16_at(b, 2 * (slot * hd + c));
            }
        }
        Codec::Bf16 => {
            for (c, o) in out.iter_mut().enumerate() {
                let i = 2 * (slot * hd + c);
                *o = bf16::from_le_bytes([b[i], b[i + 1]]).to_f32();
            }
        }
        Codec::Int8 => {
            let s = f32_at(b, 4 * slot);
            let row = &b[4 * bs + slot * hd..4 * bs + (slot + 1) * hd];
            for (o, &q) in out.iter_mut().zip(row) {
                *o = f32::from(q as i8) * s;
            }
        }
        Codec::Fp8E4m3 | Codec::Fp8E4m3Rotated => {
            let s = f32_at(b, 0);
            for (o, &q) in out.iter_mut().zip(&b[4 + slot * hd..4 + (slot + 1) * hd]) {
                *o = e4m3_to_f32(q) * s;
            }
            if codec == Codec::Fp8E4m3Rotated && half == Half::K {
                let mean = KeyMean::of(b, bs, hd);
                if mean.is_centred(slot) {
                    for (o, &q) in out.iter_mut().zip(mean.codes) {
                        *o += e4m3_to_f32(q) * mean.scale;
                    }
                }
                hadamard_rotate(out);
            }
        }
        Codec::Int4Kivi | Codec::Int2Kivi => {
            let rl = packed_row_len(codec, hd);
            match half {
                Half::K => {
                    let row = &b[4 * hd + slot * rl..4 * hd + (slot + 1) * rl];
                    for (c, o) in out.iter_mut().enumerate() {
                        let (s, m) = (f16_at(b, 2 * c), f16_at(b, 2 * (hd + c)));
                        *o = m + f32::from(unpack(codec, row, hd, c)) * s;
                    }
                }
                Half::V => {
                    let groups = hd.div_ceil(KIVI_GROUP);
                    let params = 4 * bs * groups;
                    let row = &b[params + slot * rl..params + (slot + 1) * rl];
                    for (c, o) in out.iter_mut().enumerate() {
                        let p = 2 * (slot * groups + c / KIVI_GROUP);
                        let (s, m) = (f16_at(b, p), f16_at(b, 2 * bs * groups + p));
                        *o = m + f32::from(unpack(codec, row, hd, c)) * s;
                    }
                }
            }
        }
    }
}

/// The codes of one packed KIVI row, widened to f32 in channel order (`out[..hd]`). Each packing gets its own
/// loop over whole bytes, which the compiler vectorises, where a per-channel [`unpack`] branches on every element.
#[inline]
fn unpack_row(codec: Codec, row: &[u8], hd: usize, out: &mut [f32; MAX_HEAD_DIM]) {
    if codec == Codec::Int4Kivi {
        let (lo, hi) = out[..hd].split_at_mut(hd / 2);
        for ((l, h), &byte) in lo.iter_mut().zip(hi.iter_mut()).zip(row) {
            *l = f32::from(byte & 0x0F);
            *h = f32::from(byte >> 4);
        }
    } else {
        let q = hd / 4;
        for (shift, part) in out[..hd].chunks_exact_mut(q).enumerate() {
            for (o, &byte) in part.iter_mut().zip(row) {
                *o = f32::from((byte >> (2 * shift)) & 0x03);
            }
        }
    }
}

/// The K half of a validated KIVI block, slots `0..filled` into `out` (`[filled][hd]`): [`decode_row`]'s values
/// (the same `min + code × scale` in f32, so bit for bit), with each channel's fp16 scale and min widened once per
/// block instead of once per element.
fn decode_kivi_keys(codec: Codec, hd: usize, b: &[u8], filled: usize, out: &mut [f32]) {
    let (mut scale, mut min) = ([0.0f32; MAX_HEAD_DIM], [0.0f32; MAX_HEAD_DIM]);
    let (scale, min) = (&mut scale[..hd], &mut min[..hd]);
    f16s_to_f32(&b[..2 * hd], scale);
    f16s_to_f32(&b[2 * hd..4 * hd], min);
    let rl = packed_row_len(codec, hd);
    let mut codes = [0.0f32; MAX_HEAD_DIM];
    for (o, row) in out.chunks_exact_mut(hd).take(filled).zip(b[4 * hd..].chunks_exact(rl)) {
        unpack_row(codec, row, hd, &mut codes);
        for (((x, &q), &s), &m) in o.iter_mut().zip(&codes[..hd]).zip(&*scale).zip(&*min) {
            *x = m + q * s;
        }
    }
}

/// The K half of a validated `fp8_e4m3_rotated` block, slots `0..filled` into `out` (`[filled][hd]`):
/// [`decode_row`]'s values bit for bit, with the block's mean widened once per block instead of once per slot.
fn decode_rotated_keys(bs: usize, hd: usize, b: &[u8], filled: usize, out: &mut [f32]) {
    let mean = KeyMean::of(b, bs, hd);
    let mut widened = [0.0f32; MAX_HEAD_DIM];
    for (m, &q) in widened.iter_mut().zip(mean.codes) {
        *m = e4m3_to_f32(q) * mean.scale;
    }
    let s = f32_at(b, 0);
    for (slot, (o, row)) in out.chunks_exact_mut(hd).take(filled).zip(b[4..].chunks_exact(hd)).enumerate() {
        for (o, &q) in o.iter_mut().zip(row) {
            *o = e4m3_to_f32(q) * s;
        }
        if mean.is_centred(slot) {
            o.iter_mut().zip(&widened[..hd]).for_each(|(o, m)| *o += m);
        }
        hadamard_rotate(o);
    }
}

/// The V half of a validated KIVI block, slots `0..filled` into `out`: [`decode_row`]'s values, bit for bit, with
/// each group's fp16 scale and min widened once per group instead of once per element.
fn decode_kivi_values(codec: Codec, bs: usize, hd: usize, b: &[u8], filled: usize, out: &mut [f32]) {
    let groups = hd.div_ceil(KIVI_GROUP);
    let pairs = bs * groups;
    let rl = packed_row_len(codec, hd);
    let mut codes = [0.0f32; MAX_HEAD_DIM];
    for (slot, (o, row)) in out.chunks_exact_mut(hd).take(filled).zip(b[4 * pairs..].chunks_exact(rl)).enumerate() {
        unpack_row(codec, row, hd, &mut codes);
        for (g, (og, qg)) in o.chunks_mut(KIVI_GROUP).zip(codes[..hd].chunks(KIVI_GROUP)).enumerate() {
            let p = 2 * (slot * groups + g);
            let (s, m) = (f16_at(b, p), f16_at(b, 2 * pairs + p));
            for (x, &q) in og.iter_mut().zip(qg) {
                *x = m + q * s;
            }
        }
    }
}

/// An arena of `num_blocks` encoded blocks of one codec and shape: the compressed twin of
/// [`crate::KvStorage`]. Blocks enter only through the encoder or a fully validated load, so the attention kernels
/// read it without re-validating payloads.
#[derive(Clone, Debug)]
pub struct EncodedKv {
    codec: Codec,
    num_blocks: usize,
    block_size: usize,
    head_dim: usize,
    block_len: usize,
    bytes: Vec<u8>,
}

impl EncodedKv {
    /// An arena of empty blocks (each a valid encoding of zero filled slots).
    pub fn new(codec: Codec, num_blocks: usize, block_size: usize, head_dim: usize) -> Result<EncodedKv, CodecError> {
        let block_len = codec.encoded_len(block_size, head_dim)?;
        let total = num_blocks.checked_mul(block_len).ok_or(CodecError::TooLarge { num_blocks, block_len })?;
        let mut bytes = vec![0u8; total];
        for blk in bytes.chunks_exact_mut(block_len) {
            codec.encode_block(block_size, head_dim, &[], &[], blk)?;
        }
        Ok(EncodedKv { codec, num_blocks, block_size, head_dim, block_len, bytes })
    }

    pub fn codec(&self) -> Codec {
        self.codec
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Bytes of one encoded block.
    pub fn block_len(&self) -> usize {
        self.block_len
    }

    fn range(&self, b: usize) -> Result<std::ops::Range<usize>, CodecError> {
        if b >= self.num_blocks {
            return Err(CodecError::BlockOutOfRange { block: b, num_blocks: self.num_blocks });
        }
        Ok(b * self.block_len..(b + 1) * self.block_len)
    }

    /// Encodes `k`, `v` (`[filled][head_dim]`) into block `b`.
    pub fn store(&mut self, b: usize, k: &[f32], v: &[f32]) -> Result<(), CodecError> {
        let r = self.range(b)?;
        self.codec.encode_block(self.block_size, self.head_dim, k, v, &mut self.bytes[r])?;
        Ok(())
    }

    /// Copies an encoded block (from a tier, a peer) into block `b` after validating it completely; it must have
    /// this arena's codec and shape.
    pub fn load(&mut self, b: usize, bytes: &[u8]) -> Result<(), CodecError> {
        let r = self.range(b)?;
        let h = BlockHeader::parse(bytes)?;
        if h.codec != self.codec {
            return Err(CodecError::WrongCodec { expected: self.codec, got: h.codec });
        }
        if (h.block_size, h.head_dim) != (self.block_size, self.head_dim) {
            return Err(CodecError::BadHeader("block shape differs from the arena's"));
        }
        validate_payload(&h, bytes)?;
        self.bytes[r].copy_from_slice(bytes);
        Ok(())
    }

    /// The encoded bytes of block `b` (header included), ready for a tier or a peer.
    pub fn block_bytes(&self, b: usize) -> Result<&[u8], CodecError> {
        Ok(&self.bytes[self.range(b)?])
    }

    /// Filled slots of block `b` (from its header).
    pub fn filled(&self, b: usize) -> Result<usize, CodecError> {
        let r = self.range(b)?;
        Ok(usize::from(u16::from_le_bytes([self.bytes[r.start + 10], self.bytes[r.start + 11]])))
    }

    /// Decodes block `b` into `k_out`, `v_out` (`block_size * head_dim` each).
    pub fn decode(&self, b: usize, k_out: &mut [f32], v_out: &mut [f32]) -> Result<BlockHeader, CodecError> {
        decode_block(self.block_bytes(b)?, k_out, v_out)
    }

    /// The whole arena and the length of one block: what the attention kernels walk.
    pub(crate) fn raw(&self) -> (&[u8], usize) {
        (&self.bytes, self.block_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys sharing a large channel offset are stored less their block's mean, which shrinks their rounding error
    /// with the part they share; a sink key far from the rest is stored as it is and leaves the mean to the others.
    #[test]
    fn rotated_keys_are_centred_on_their_blocks_mean_except_a_sink() {
        let (bs, hd) = (16usize, 64usize);
        let noise = |i: usize| ((i as f32 * 0.618).sin() * 43758.547).rem_euclid(1.0) - 0.5;
        let offset = |c: usize| if c % 16 < 4 { 6.0 } else { 0.3 };
        let mut k: Vec<f32> = (0..bs * hd).map(|i| offset(i % hd) + noise(i)).collect();
        // Slot 0 is the sink: large where the others are small, and the other way round.
        for (c, v) in k[..hd].iter_mut().enumerate() {
            *v = if c % 16 < 4 { -0.5 } else { 4.0 };
        }
        let v = k.clone();
        let codec = Codec::Fp8E4m3Rotated;
        let mut bytes = vec![0u8; codec.encoded_len(bs, hd).unwrap()];
        codec.encode_block(bs, hd, &k, &v, &mut bytes).unwrap();
        let kb = &bytes[HEADER_LEN..HEADER_LEN + codec.half_len(Half::K, bs, hd)];
        let mean = KeyMean::of(kb, bs, hd);
        assert!(!mean.is_centred(0), "the sink is stored as it is");
        assert!((1..bs).all(|i| mean.is_centred(i)), "every other key is centred");
        // The mean is the other keys', not pulled towards the sink: rotated back, its offset channels hold ~6.
        let mut m: Vec<f32> = mean.codes.iter().map(|&q| e4m3_to_f32(q) * mean.scale).collect();
        hadamard_rotate(&mut m);
        assert!((m[0] - 6.0).abs() < 0.5 && (m[5] - 0.3).abs() < 0.2, "mean {:?}", &m[..6]);
        // Centred, the keys' error is bounded by the noise they do not share, well under e4m3's 2^-4 of the key.
        let (mut dk, mut dv) = (vec![0.0; bs * hd], vec![0.0; bs * hd]);
        decode_block(&bytes, &mut dk, &mut dv).unwrap();
        for slot in 1..bs {
            let row = slot * hd..(slot + 1) * hd;
            let err = dk[row.clone()].iter().zip(&k[row.clone()]).map(|(a, b)| (a - b) * (a - b)).sum::<f32>();
            let norm = k[row].iter().map(|v| v * v).sum::<f32>();
            assert!(
                err.sqrt() < norm.sqrt() * 2f32.powi(-4) / 4.0,
                "slot {slot}: error {} of {}",
                err.sqrt(),
                norm.sqrt()
            );
        }
        // A block without a shared offset (zero-mean keys) centres few rows and still decodes within its bound;
        // an empty block stores a zero mean and no centred slot.
        codec.encode_block(bs, hd, &[], &[], &mut bytes).unwrap();
        let kb = &bytes[HEADER_LEN..HEADER_LEN + codec.half_len(Half::K, bs, hd)];
        let empty = KeyMean::of(kb, bs, hd);
        assert!(empty.scale == 0.0 && empty.centred.iter().all(|&b| b == 0));
    }

    /// The block decoder's rotated-key path (the mean widened once per block) gives exactly the per-slot decoder's
    /// values, centred and uncentred slots alike, for full and partly filled blocks.
    #[test]
    fn rotated_key_block_decode_equals_the_per_slot_decoder() {
        let codec = Codec::Fp8E4m3Rotated;
        for (bs, hd, filled) in [(16usize, 64usize, 16usize), (16, 64, 5), (8, 48, 8), (4, 128, 3)] {
            let x = |i: usize, salt: f32| {
                ((i as f32 * 0.731 + salt).sin() * 3.0) + if i.is_multiple_of(5) { 4.0 } else { 0.0 }
            };
            let mut k: Vec<f32> = (0..filled * hd).map(|i| x(i, 0.3)).collect();
            k[..hd].iter_mut().for_each(|v| *v = -*v * 2.0);
            let v: Vec<f32> = (0..filled * hd).map(|i| x(i, 1.7) * 0.5).collect();
            let mut bytes = vec![0u8; codec.encoded_len(bs, hd).unwrap()];
            codec.encode_block(bs, hd, &k, &v, &mut bytes).unwrap();
            let (mut dk, mut dv) = (vec![0.0; bs * hd], vec![0.0; bs * hd]);
            decode_block(&bytes, &mut dk, &mut dv).unwrap();
            let kb = &bytes[HEADER_LEN..HEADER_LEN + codec.half_len(Half::K, bs, hd)];
            let mut row = vec![0.0f32; hd];
            for slot in 0..filled {
                decode_row(codec, Half::K, bs, hd, kb, slot, &mut row);
                let got = &dk[slot * hd..(slot + 1) * hd];
                assert!(got.iter().zip(&row).all(|(a, b)| a.to_bits() == b.to_bits()), "{bs}x{hd}, slot {slot}");
            }
            assert!(dk[filled * hd..].iter().all(|&v| v == 0.0));
        }
    }

    /// The block decoder's KIVI fast path (parameters widened once per block or group) gives exactly the values of
    /// the per-slot decoder that the attention kernels use, for full and partly filled blocks, with a group that
    /// does not divide head_dim.
    #[test]
    fn kivi_block_decode_equals_the_per_slot_decoder() {
        for codec in [Codec::Int4Kivi, Codec::Int2Kivi] {
            for (bs, hd, filled) in [(16usize, 64usize, 16usize), (16, 64, 5), (8, 48, 8), (4, 128, 3)] {
                let x = |i: usize, salt: f32| ((i as f32 * 0.731 + salt).sin() * 3.0) + (i % 7) as f32 * 0.1;
                let k: Vec<f32> = (0..filled * hd).map(|i| x(i, 0.3)).collect();
                let v: Vec<f32> = (0..filled * hd).map(|i| x(i, 1.7) * 0.5).collect();
                let mut bytes = vec![0u8; codec.encoded_len(bs, hd).unwrap()];
                codec.encode_block(bs, hd, &k, &v, &mut bytes).unwrap();
                let (mut kd, mut vd) = (vec![f32::NAN; bs * hd], vec![f32::NAN; bs * hd]);
                let h = decode_block(&bytes, &mut kd, &mut vd).unwrap();
                let (kb, vb) = halves(&h, &bytes);
                let mut row = vec![0.0f32; hd];
                for slot in 0..filled {
                    let r = slot * hd..(slot + 1) * hd;
                    decode_row(codec, Half::K, bs, hd, kb, slot, &mut row);
                    assert_eq!(&kd[r.clone()], &row[..], "{codec} K slot {slot} ({bs}x{hd})");
                    decode_row(codec, Half::V, bs, hd, vb, slot, &mut row);
                    assert_eq!(&vd[r], &row[..], "{codec} V slot {slot} ({bs}x{hd})");
                }
                assert!(kd[filled * hd..].iter().chain(&vd[filled * hd..]).all(|&z| z == 0.0));
            }
        }
    }

    /// The bound holds every decoded element of every codec, is tight where it claims to be exact, and tells a
    /// block past f16's range (an `int8` block of millions) from one inside it.
    #[test]
    fn the_decoded_magnitude_bound_covers_what_a_block_decodes_to() {
        let (bs, hd) = (16usize, 64usize);
        for scale in [3.0f32, 2e6] {
            let x = |i: usize, salt: f32| ((i as f32 * 0.731 + salt).sin() * scale) + (i % 7) as f32 * 0.1;
            let k: Vec<f32> = (0..bs * hd).map(|i| x(i, 0.3)).collect();
            let v: Vec<f32> = (0..bs * hd).map(|i| x(i, 1.7) * 0.5).collect();
            for codec in Codec::ALL {
                let mut bytes = vec![0u8; codec.encoded_len(bs, hd).unwrap()];
                if codec.encode_block(bs, hd, &k, &v, &mut bytes).is_err() {
                    assert!(scale > 65504.0 && matches!(codec, Codec::F16 | Codec::Int4Kivi | Codec::Int2Kivi));
                    continue;
                }
                let (mut kd, mut vd) = (vec![0.0; bs * hd], vec![0.0; bs * hd]);
                decode_block(&bytes, &mut kd, &mut vd).unwrap();
                let got = kd.iter().chain(&vd).fold(0.0f32, |m, x| m.max(x.abs()));
                let bound = decoded_magnitude_bound(&bytes).unwrap();
                assert!(got <= bound, "{codec} x{scale}: {got} over the bound {bound}");
                if !matches!(codec, Codec::Fp8E4m3Rotated | Codec::Int4Kivi | Codec::Int2Kivi) {
                    assert_eq!(got, bound, "{codec} x{scale}: exact");
                }
                assert_eq!(bound < 65504.0, scale < 10.0, "{codec} x{scale}: {bound}");
            }
        }
        assert!(decoded_magnitude_bound(&[0u8; 64]).is_err(), "validated first");
    }
}
