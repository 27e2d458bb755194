//! Group codecs of the lower tiers: how one block group (every (layer, kv-head) block of a 16-token chunk) is turned
//! into the bytes a tier stores, and back into device blocks. Two families share the [`EncodedGroup::codec`] name:
//!
//! - the [`native`] formats (`f16`, `f32`, legacy `native`): the device arena's elements, lossless;
//! - the compressing KV codecs of the kernels crate (`bf16`, `int8`, `fp8_e4m3`, `fp8_e4m3_rotated`, `int4_kivi`,
//!   `int2_kivi`): each block encoded with [`Codec::encode_block`] (self-describing 16-byte header, validated on
//!   decode), the blocks concatenated in group order. The kernels' `f16`/`f32` codecs are not offered here: their names belong to the
//!   native formats, which are smaller (no header) and already lossless.
//!
//! Decoding dispatches on the stored name, so one tier holds groups of any mix of codecs, and a group written by
//! EvicPress in `int4_kivi` onboards exactly like a native one. Every length and header is checked first, so a
//! group of another model shape (or corrupt bytes that passed a checksum) is refused instead of half-written.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use pagoda_kernels::{
    BlockHeader, Codec, KeyRounding, KvDtype, KvStorage, decode_validated_block, decoded_magnitude_bound,
};

use super::{EncodedGroup, F16_OVERFLOW, KV_MAGNITUDE_LIMIT, TierError, fits_dtype, native};
use crate::cache::BlockId;

/// A lower-tier group format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupCodec {
    /// The device cache's element type, raw.
    Native(KvDtype),
    /// A kernels codec other than `f32`/`f16`, one encoded block per (layer, kv-head).
    Kv(Codec),
    /// A KIVI codec (`base`) with the blocks of the layers in `int8` stored in `int8` instead
    /// (`--kivi-int8-layers`; name `int4_kivi+int8@17:18/30`: base, layers, the model's layer count).
    Layered { base: Codec, int8: Int8Layers },
}

/// The layers whose blocks a [`GroupCodec::Layered`] group keeps in `int8`, and the model's layer count (so that
/// a group's blocks, in `layer * n_kv_heads + head` order, map to layers without the model at hand).
///
/// Why: KIVI's error reaches the output through the attention scores, and a few layers amplify it far more than
/// the rest. On SmolLM2-135M, layer 18 alone holds 58% of `int2_kivi`'s KL and half of `int4_kivi`'s, almost all
/// of it in its keys, though their relative error is the other layers' (docs/BENCHMARKS.md, "KIVI's sensitive
/// layers").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Int8Layers {
    mask: u64,
    n_layers: u8,
}

impl Int8Layers {
    /// Most layers a model may have for the set (the mask's width).
    pub const MAX_LAYERS: usize = 64;
    /// Most layers a set may list. The set is spelled out in every stored group's codec name, and that name must fit
    /// [`pagoda_proto::MAX_CODEC_NAME_BYTES`] wherever the group goes (disk, peers, the kvstore directory): 15
    /// two-digit layers is the longest list that always fits (`int4_kivi+int8@` + 44 + `/64`).
    pub const MAX_LISTED: usize = 15;

    /// The set `layers` of a model of `n_layers` layers: 1 to [`Self::MAX_LISTED`] layers, each below `n_layers`,
    /// no repeats.
    pub fn new(layers: &[usize], n_layers: usize) -> Result<Int8Layers, String> {
        if n_layers == 0 || n_layers > Self::MAX_LAYERS {
            return Err(format!("a model of 1 to {} layers, got {n_layers}", Self::MAX_LAYERS));
        }
        if layers.is_empty() || layers.len() > Self::MAX_LISTED {
            return Err(format!("list 1 to {} layers, got {}", Self::MAX_LISTED, layers.len()));
        }
        let mut mask = 0u64;
        for &l in layers {
            if l >= n_layers {
                return Err(format!("layer {l} is not below the model's {n_layers}"));
            }
            if mask >> l & 1 == 1 {
                return Err(format!("layer {l} is listed twice"));
            }
            mask |= 1 << l;
        }
        Ok(Int8Layers { mask, n_layers: n_layers as u8 })
    }

    /// Whether layer `layer` is kept in int8.
    pub fn contains(self, layer: usize) -> bool {
        layer < 64 && self.mask >> layer & 1 == 1
    }

    /// The model's layer count.
    pub fn n_layers(self) -> usize {
        usize::from(self.n_layers)
    }

    /// The layers, ascending.
    pub fn layers(self) -> impl Iterator<Item = usize> {
        (0..self.n_layers()).filter(move |&l| self.contains(l))
    }
}

impl GroupCodec {
    /// The compressing codecs, in decreasing size.
    pub const COMPRESSING: [Codec; 4] = [Codec::Int8, Codec::Fp8E4m3, Codec::Int4Kivi, Codec::Int2Kivi];

    /// `codec`, with the KIVI codecs layered by `int8` when a set is given: how a worker stores the codec its
    /// placement chose.
    pub fn stored(codec: Codec, int8: Option<Int8Layers>) -> GroupCodec {
        match int8 {
            Some(int8) if matches!(codec, Codec::Int4Kivi | Codec::Int2Kivi) => {
                GroupCodec::Layered { base: codec, int8 }
            }
            _ => GroupCodec::Kv(codec),
        }
    }

    /// The codec the placement chose: the base of a layered codec.
    pub fn chosen(self) -> Option<Codec> {
        match self {
            GroupCodec::Native(_) => None,
            GroupCodec::Kv(c) | GroupCodec::Layered { base: c, .. } => Some(c),
        }
    }

    /// The name stored with each group: borrowed for every format but a layered one, whose name carries its layers.
    pub fn name(self) -> Cow<'static, str> {
        match self {
            GroupCodec::Native(d) => Cow::Borrowed(native::codec_name(d)),
            GroupCodec::Kv(c) => Cow::Borrowed(c.name()),
            GroupCodec::Layered { base, int8 } => {
                let layers: Vec<String> = int8.layers().map(|l| l.to_string()).collect();
                Cow::Owned(format!("{base}+int8@{}/{}", layers.join(":"), int8.n_layers()))
            }
        }
    }

    /// The kernels codec of block `index` of a group of `n_blocks` blocks (`None` for the native formats, and for a
    /// layered codec when `n_blocks` is not a whole number of blocks per layer).
    pub fn block_codec(self, index: usize, n_blocks: usize) -> Option<Codec> {
        match self {
            GroupCodec::Native(_) => None,
            GroupCodec::Kv(c) => Some(c),
            GroupCodec::Layered { base, int8 } => {
                let n = int8.n_layers();
                if n_blocks == 0 || !n_blocks.is_multiple_of(n) || index >= n_blocks {
                    return None;
                }
                Some(if int8.contains(index / (n_blocks / n)) { Codec::Int8 } else { base })
            }
        }
    }

    /// Encoded bytes of a group of `n_blocks` blocks of `block_size` × `head_dim`.
    pub fn group_bytes(self, n_blocks: usize, block_size: usize, head_dim: usize) -> Result<usize, TierError> {
        if let GroupCodec::Native(d) = self {
            return Ok(native::group_bytes(n_blocks, block_size, head_dim, d));
        }
        (0..n_blocks).try_fold(0, |sum, i| Ok(sum + self.block_format(i, n_blocks, block_size, head_dim)?.1))
    }

    /// The kernels codec of block `index` of a group of `n_blocks`, and its encoded bytes.
    fn block_format(self, index: usize, n_blocks: usize, bs: usize, hd: usize) -> Result<(Codec, usize), TierError> {
        let c = self.block_codec(index, n_blocks).ok_or_else(|| {
            TierError::Config(format!("{self} cannot store a group of {n_blocks} blocks (not whole layers)"))
        })?;
        let len = c.encoded_len(bs, hd).map_err(|e| TierError::Config(format!("codec {c}: {e}")))?;
        Ok((c, len))
    }
}

impl fmt::Display for GroupCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl FromStr for GroupCodec {
    type Err = TierError;

    /// `native`, `f32`, `f16`, `native-int8` and `native-fp8_e4m3` are the native formats; `BASE+int8@L:L/N` a
    /// layered KIVI codec; the other kernels codecs by name.
    fn from_str(s: &str) -> Result<GroupCodec, TierError> {
        if let Some(d) = native::dtype_of(s) {
            return Ok(GroupCodec::Native(d));
        }
        let unknown = || TierError::UnknownCodec(s.chars().take(64).collect());
        if let Some((base, rest)) = s.split_once("+int8@") {
            let base = base.parse::<Codec>().map_err(|_| unknown())?;
            let (list, n) = rest.split_once('/').ok_or_else(unknown)?;
            let n: usize = n.parse().map_err(|_| unknown())?;
            let layers = list.split(':').map(|l| l.parse::<usize>()).collect::<Result<Vec<_>, _>>();
            let int8 = Int8Layers::new(&layers.map_err(|_| unknown())?, n).map_err(|_| unknown())?;
            return match GroupCodec::stored(base, Some(int8)) {
                layered @ GroupCodec::Layered { .. } => Ok(layered),
                _ => Err(unknown()),
            };
        }
        s.parse::<Codec>().map(GroupCodec::Kv).map_err(|_| unknown())
    }
}

/// A KV arena the lower tiers copy groups out of and back into: the CPU runner's [`KvStorage`], or the CUDA runner's
/// device arenas. Both produce the same bytes for a group, so a tier (and a peer) holds groups from either.
pub trait GroupKv {
    /// The arena's own lossless format: the fallback when a codec refuses a group.
    fn native_codec(&self) -> GroupCodec;
    /// Encodes blocks `blocks` with `codec` ([`encode`]'s contract).
    fn encode_group(&self, blocks: &[BlockId], codec: GroupCodec) -> Result<EncodedGroup, TierError>;
    /// Decodes `group` into blocks `blocks` ([`decode`]'s contract: checked whole before anything is written).
    fn decode_group(&mut self, group: &EncodedGroup, blocks: &[BlockId]) -> Result<(), TierError>;

    /// How this arena's encoder rounds rotated fp8 keys, per table ([`KvStorage::set_key_rounding`]); `None`: to
    /// the nearest code.
    fn key_roundings(&self) -> Option<Arc<[KeyRounding]>> {
        None
    }

    /// Encodes with `codec`, or natively when the codec refuses the data (values outside its range).
    fn encode_or_native(&self, blocks: &[BlockId], codec: GroupCodec) -> Result<EncodedGroup, TierError> {
        self.encode_group(blocks, codec).or_else(|e| {
            tracing::debug!(error = %e, "encoding a group in the native format");
            self.encode_group(blocks, self.native_codec())
        })
    }
}

impl GroupKv for KvStorage {
    fn native_codec(&self) -> GroupCodec {
        GroupCodec::Native(self.dtype())
    }

    fn encode_group(&self, blocks: &[BlockId], codec: GroupCodec) -> Result<EncodedGroup, TierError> {
        encode(self, blocks, codec)
    }

    fn decode_group(&mut self, group: &EncodedGroup, blocks: &[BlockId]) -> Result<(), TierError> {
        decode(group, self, blocks)
    }

    fn key_roundings(&self) -> Option<Arc<[KeyRounding]>> {
        KvStorage::key_roundings(self)
    }
}

/// Encodes blocks `blocks` of `kv` with `codec`. Fails only when a codec refuses the data (non-finite KV, or values
/// beyond what the format holds), in which case the caller keeps the group native or drops it.
pub fn encode(kv: &KvStorage, blocks: &[BlockId], codec: GroupCodec) -> Result<EncodedGroup, TierError> {
    let c = match codec {
        GroupCodec::Native(d) if d == kv.dtype() => return Ok(native::encode(kv, blocks)),
        GroupCodec::Native(d) => {
            // Another native width than the arena's: widen/narrow through f32 (into a one-block cache of the
            // target dtype, which quantises 8-bit slots exactly as an arena of that dtype does).
            let (bs, hd) = (kv.block_size(), kv.head_dim());
            let mut one = KvStorage::with_dtype(1, bs, hd, d);
            let mut out = EncodedGroup { codec: native::codec_name(d).to_owned(), bytes: Vec::new() };
            let (mut k, mut v) = (vec![0.0f32; kv.block_len()], vec![0.0f32; kv.block_len()]);
            for &b in blocks {
                kv.read_block(b, &mut k, &mut v);
                one.write_block(0, &k, &v);
                out.bytes.extend_from_slice(&native::encode(&one, &[0]).bytes);
            }
            return Ok(out);
        }
        GroupCodec::Kv(_) | GroupCodec::Layered { .. } => codec,
    };
    let (bs, hd, n) = (kv.block_size(), kv.head_dim(), blocks.len());
    let mut bytes = vec![0u8; c.group_bytes(n, bs, hd)?];
    let (mut k, mut v) = (vec![0.0f32; kv.block_len()], vec![0.0f32; kv.block_len()]);
    let mut at = 0;
    for (i, &b) in blocks.iter().enumerate() {
        let (codec, len) = c.block_format(i, n, bs, hd)?;
        kv.read_block(b, &mut k, &mut v);
        // Block i of a group is table i (`layer * n_kv_heads + head`), whose queries its key rounding is for.
        codec
            .encode_block_with(bs, hd, &k, &v, &mut bytes[at..at + len], kv.key_rounding(i))
            .map_err(|e| TierError::Config(format!("encoding with {codec}: {e}")))?;
        at += len;
    }
    Ok(EncodedGroup { codec: c.name().into_owned(), bytes })
}

/// Decodes `group` (any codec) into blocks `blocks` of `kv`, checking the codec, the exact length and, for the
/// kernels codecs, every block header and payload before anything is written.
pub fn decode(group: &EncodedGroup, kv: &mut KvStorage, blocks: &[BlockId]) -> Result<(), TierError> {
    let c = match group.codec.parse::<GroupCodec>()? {
        GroupCodec::Native(_) => return native::decode(group, kv, blocks),
        c => c,
    };
    let (bs, hd, count) = (kv.block_size(), kv.head_dim(), blocks.len());
    let expected = c.group_bytes(count, bs, hd)?;
    if group.bytes.len() != expected {
        return Err(TierError::BadLength { codec: group.codec.clone(), expected, got: group.bytes.len() });
    }
    if let Some(&bad) = blocks.iter().find(|&&b| b as usize >= kv.num_blocks()) {
        return Err(TierError::BadLength { codec: group.codec.clone(), expected: kv.num_blocks(), got: bad as usize });
    }
    let corrupt = |e: pagoda_kernels::CodecError| TierError::Corrupt {
        path: std::path::PathBuf::from(format!("<{} group>", group.codec)),
        reason: e.to_string(),
    };
    // Every block is validated and its values bounded before anything is written: a bad block in the middle must
    // not leave the group half-written.
    let limit = if kv.dtype() == KvDtype::F16 { F16_OVERFLOW } else { KV_MAGNITUDE_LIMIT };
    let mut bounded = true;
    for block in block_bytes(c, &group.bytes, count, bs, hd) {
        let (codec, bytes) = block?;
        let h = BlockHeader::parse(bytes).map_err(corrupt)?;
        if h.codec != codec || h.block_size != bs || h.head_dim != hd {
            return Err(TierError::BadLength { codec: group.codec.clone(), expected: bytes.len(), got: bytes.len() });
        }
        // The bound is exact or nearly so (rotated keys: the inverse rotation's largest growth); the margin covers
        // the rounding of the decode itself.
        bounded &= decoded_magnitude_bound(bytes).map_err(corrupt)? * BOUND_MARGIN < limit;
    }
    let n = kv.block_len();
    let (mut k, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    if !bounded {
        // Values within the margin of the limit (or a hostile group): decoded once and checked value by value
        // before anything is written, then decoded again below to be written.
        for block in block_bytes(c, &group.bytes, count, bs, hd) {
            decode_validated_block(block?.1, &mut k, &mut v).map_err(corrupt)?;
            if !(fits_dtype(kv.dtype(), &k) && fits_dtype(kv.dtype(), &v)) {
                return Err(TierError::DoesNotFit { codec: group.codec.clone(), dtype: kv.dtype() });
            }
        }
    }
    for (block, &b) in block_bytes(c, &group.bytes, count, bs, hd).zip(blocks) {
        decode_validated_block(block?.1, &mut k, &mut v).map_err(corrupt)?;
        kv.write_block(b, &k, &v);
    }
    Ok(())
}

/// Each of the `count` blocks of a group in `c` (whose length was checked against [`GroupCodec::group_bytes`]):
/// its codec and its bytes, in order.
fn block_bytes(
    c: GroupCodec,
    bytes: &[u8],
    count: usize,
    bs: usize,
    hd: usize,
) -> impl Iterator<Item = Result<(Codec, &[u8]), TierError>> {
    let mut at = 0;
    (0..count).map(move |i| {
        let (codec, len) = c.block_format(i, count, bs, hd)?;
        let block = &bytes[at..at + len];
        at += len;
        Ok((codec, block))
    })
}

/// How far a block's [`decoded_magnitude_bound`] must sit below the arena's limit for its values to go in unchecked.
const BOUND_MARGIN: f32 = 1.001;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiers::{DiskStore, HostStore};

    /// Six blocks of 16 slots × 64 dims with smooth, model-like values (distinct per block).
    fn filled(dtype: KvDtype) -> KvStorage {
        let (bs, hd) = (16, 64);
        let mut kv = KvStorage::with_dtype(12, bs, hd, dtype);
        for b in 0..6u32 {
            let k: Vec<f32> = (0..bs * hd).map(|i| (i as f32 * 0.37 + b as f32).sin() * 2.0).collect();
            let v: Vec<f32> = (0..bs * hd).map(|i| (i as f32 * 0.11 - b as f32).cos() * 0.5).collect();
            kv.write_block(b, &k, &v);
        }
        kv
    }

    fn block(kv: &KvStorage, b: u32) -> (Vec<f32>, Vec<f32>) {
        let (mut k, mut v) = (vec![0.0; kv.block_len()], vec![0.0; kv.block_len()]);
        kv.read_block(b, &mut k, &mut v);
        (k, v)
    }

    fn max_err(a: &KvStorage, ab: u32, b: &KvStorage, bb: u32) -> f32 {
        let ((ka, va), (kb, vb)) = (block(a, ab), block(b, bb));
        ka.iter().chain(&va).zip(kb.iter().chain(&vb)).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    /// A group's block i is encoded with table i's key rounding when the arena has one (rotated fp8 only): the
    /// bytes are what [`Codec::encode_block_with`] gives for that table, and not round-to-nearest's.
    #[test]
    fn a_group_rounds_each_tables_keys_for_its_own_queries() {
        use pagoda_kernels::QueryMoments;
        let mut kv = filled(KvDtype::F32);
        let hd = kv.head_dim();
        // Two tables whose queries point different ways: energy falling with the channel, and rising.
        let roundings: Vec<KeyRounding> = [false, true]
            .iter()
            .map(|&rising| {
                let mut m = QueryMoments::new(hd);
                let q: Vec<f32> = (0..16 * hd)
                    .map(|i| {
                        let ch = if rising { hd - 1 - i % hd } else { i % hd };
                        (i as f32 * 0.71).sin() * 0.8f32.powi(ch as i32 / 2)
                    })
                    .collect();
                m.add(&q);
                KeyRounding::from_moments(&m).expect("moments")
            })
            .collect();
        kv.set_key_rounding(roundings.clone().into());
        let codec = Codec::Fp8E4m3Rotated;
        let group = encode(&kv, &[0, 1], GroupCodec::Kv(codec)).expect("encode");
        let len = codec.encoded_len(kv.block_size(), hd).unwrap();
        assert_eq!(group.bytes.len(), 2 * len);
        for (i, r) in roundings.iter().enumerate() {
            let (k, v) = block(&kv, i as u32);
            let (mut aware, mut nearest) = (vec![0u8; len], vec![0u8; len]);
            codec.encode_block_with(kv.block_size(), hd, &k, &v, &mut aware, Some(r)).unwrap();
            codec.encode_block(kv.block_size(), hd, &k, &v, &mut nearest).unwrap();
            assert_eq!(&group.bytes[i * len..(i + 1) * len], &aware[..], "block {i}");
            assert_ne!(aware, nearest, "block {i}: the rounding changed some codes");
        }
        // Other codecs ignore it.
        let plain = filled(KvDtype::F32);
        let int8 = GroupCodec::Kv(Codec::Int8);
        assert_eq!(encode(&kv, &[0, 1], int8).unwrap().bytes, encode(&plain, &[0, 1], int8).unwrap().bytes);
    }

    /// Every codec's worst absolute error on these blocks (|K| ≤ 2, |V| ≤ 0.5): generous bounds, the per-element
    /// bounds are tested in the kernels crate; here the point is that the right decoder ran.
    fn bound(c: GroupCodec) -> f32 {
        match c {
            GroupCodec::Native(KvDtype::F16) => 2e-3,
            GroupCodec::Native(KvDtype::F32) => 0.0,
            GroupCodec::Native(KvDtype::Int8) | GroupCodec::Kv(Codec::Int8) | GroupCodec::Kv(Codec::Bf16) => 2e-2,
            GroupCodec::Native(KvDtype::Fp8 | KvDtype::Fp8Rotated) | GroupCodec::Kv(Codec::Fp8E4m3) => 0.13,
            GroupCodec::Kv(Codec::Int4Kivi) | GroupCodec::Layered { base: Codec::Int4Kivi, .. } => 0.2,
            GroupCodec::Kv(_) | GroupCodec::Layered { .. } => 1.0,
        }
    }

    fn all_codecs() -> Vec<GroupCodec> {
        let mut v: Vec<GroupCodec> = KvDtype::ALL.into_iter().map(GroupCodec::Native).collect();
        v.push(GroupCodec::Kv(Codec::Bf16));
        v.extend(GroupCodec::COMPRESSING.map(GroupCodec::Kv));
        v.push(GroupCodec::Kv(Codec::Fp8E4m3Rotated));
        // Two-block test groups are one block per layer of a two-layer model.
        v.push(GroupCodec::stored(Codec::Int4Kivi, Some(Int8Layers::new(&[1], 2).unwrap())));
        v
    }

    #[test]
    fn layered_names_parse_back_and_malformed_ones_are_refused() {
        let g = "int2_kivi+int8@17:18/30".parse::<GroupCodec>().unwrap();
        let GroupCodec::Layered { base, int8 } = g else { panic!("{g:?}") };
        assert_eq!((base, int8.layers().collect::<Vec<_>>(), int8.n_layers()), (Codec::Int2Kivi, vec![17, 18], 30));
        assert_eq!(g.name(), "int2_kivi+int8@17:18/30");
        assert_eq!(g.chosen(), Some(Codec::Int2Kivi));
        // 90 blocks: 3 per layer, layers 17 and 18 are blocks 51..57.
        let codecs: Vec<Codec> = (0..90).map(|i| g.block_codec(i, 90).unwrap()).collect();
        assert!(codecs[51..57].iter().all(|&c| c == Codec::Int8));
        assert!(codecs[..51].iter().chain(&codecs[57..]).all(|&c| c == Codec::Int2Kivi));
        let (l2, l8) = (Codec::Int2Kivi.encoded_len(16, 64).unwrap(), Codec::Int8.encoded_len(16, 64).unwrap());
        assert_eq!(g.group_bytes(90, 16, 64).unwrap(), 84 * l2 + 6 * l8);
        assert!(g.group_bytes(91, 16, 64).is_err(), "not whole layers");
        assert_eq!(g.block_codec(90, 90), None);
        for bad in [
            "int4_kivi+int8@30/30",
            "int4_kivi+int8@/30",
            "int4_kivi+int8@1:1/30",
            "int4_kivi+int8@1/0",
            "int4_kivi+int8@1/65",
            "int4_kivi+int8@1",
            "int8+int8@1/30",
            "fp8_e4m3+int8@1/30",
            "zstd+int8@1/30",
            "int4_kivi+int8@-1/30",
        ] {
            assert!(matches!(bad.parse::<GroupCodec>(), Err(TierError::UnknownCodec(_))), "{bad}");
        }
        assert!(Int8Layers::new(&[], 30).is_err());
        // The longest list there may be, of the longest layers, names a group every store and peer accepts; one
        // more layer is refused when the set is made, not when a group fails to travel.
        let longest: Vec<usize> = (49..64).collect();
        assert_eq!(longest.len(), Int8Layers::MAX_LISTED);
        let g = GroupCodec::stored(Codec::Int4Kivi, Some(Int8Layers::new(&longest, 64).unwrap()));
        assert!(g.name().len() <= pagoda_proto::MAX_CODEC_NAME_BYTES, "{} is too long", g.name());
        assert_eq!(g.name().parse::<GroupCodec>().unwrap(), g);
        assert!(Int8Layers::new(&(48..64).collect::<Vec<_>>(), 64).is_err());
        // A set only layers KIVI: the other codecs are stored as named.
        let set = Some(Int8Layers::new(&[18], 30).unwrap());
        assert_eq!(GroupCodec::stored(Codec::Int8, set), GroupCodec::Kv(Codec::Int8));
        assert_eq!(GroupCodec::stored(Codec::Int4Kivi, None), GroupCodec::Kv(Codec::Int4Kivi));
    }

    #[test]
    fn a_layered_group_is_its_codecs_blocks_and_is_refused_when_they_disagree() {
        let src = filled(KvDtype::F32);
        let blocks = [0, 1, 2, 3];
        let layered = GroupCodec::stored(Codec::Int2Kivi, Some(Int8Layers::new(&[1], 2).unwrap()));
        let g = encode(&src, &blocks, layered).unwrap();
        // Two blocks per layer: blocks 0 and 1 as int2_kivi encodes them, 2 and 3 as int8 does.
        let [int2, int8] =
            [Codec::Int2Kivi, Codec::Int8].map(|c| encode(&src, &blocks, GroupCodec::Kv(c)).unwrap().bytes);
        let (l2, l8) = (Codec::Int2Kivi.encoded_len(16, 64).unwrap(), Codec::Int8.encoded_len(16, 64).unwrap());
        assert_eq!(g.bytes, [&int2[..2 * l2], &int8[2 * l8..]].concat());
        let mut dst = KvStorage::with_dtype(12, 16, 64, KvDtype::F32);
        decode(&g, &mut dst, &[4, 5, 6, 7]).unwrap();
        let mut alone = KvStorage::with_dtype(1, 16, 64, KvDtype::F32);
        decode(&encode(&src, &[2], GroupCodec::Kv(Codec::Int8)).unwrap(), &mut alone, &[0]).unwrap();
        assert_eq!(block(&dst, 6), block(&alone, 0), "a layer-1 block decodes as int8 alone");
        // The same bytes under a name that puts int8 on the other layer: the lengths agree, the headers do not.
        let before = block(&dst, 4);
        let swapped = EncodedGroup { codec: "int2_kivi+int8@0/2".into(), bytes: g.bytes.clone() };
        assert!(swapped.bytes.len() == g.bytes.len() && decode(&swapped, &mut dst, &[4, 5, 6, 7]).is_err());
        assert_eq!(block(&dst, 4), before, "nothing written");
        // Three blocks are not whole layers of a two-layer model.
        assert!(encode(&src, &[0, 1, 2], layered).is_err());
        assert!(decode(&g, &mut dst, &[4, 5, 6]).is_err());
    }

    #[test]
    fn every_codec_round_trips_through_host_and_disk() {
        let dir = std::env::temp_dir().join(format!("pagoda-groupcodec-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let src = filled(KvDtype::F16);
        let mut host = HostStore::new(1 << 24);
        let mut disk = DiskStore::open(&dir, 1 << 24, 1 << 20).unwrap();
        for (i, c) in all_codecs().into_iter().enumerate() {
            assert_eq!(c.name().parse::<GroupCodec>().unwrap(), c);
            let g = encode(&src, &[1, 4], c).unwrap();
            assert_eq!(g.codec, c.name());
            assert_eq!(g.bytes.len(), c.group_bytes(2, 16, 64).unwrap(), "{c}");
            let hash = 100 + i as u64;
            assert!(host.put(hash, g.clone()).is_empty());
            assert!(disk.put(hash, &g).unwrap());
            // Fresh process view of the disk tier: the index is rebuilt from the files.
            drop(disk);
            disk = DiskStore::open(&dir, 1 << 24, 1 << 20).unwrap();
            for from_disk in [false, true] {
                let got = if from_disk { disk.get(hash).unwrap().unwrap() } else { host.get(hash).unwrap().clone() };
                assert_eq!(got, g, "{c}: the store gives back the bytes it took");
                let mut dst = KvStorage::with_dtype(12, 16, 64, KvDtype::F32);
                decode(&got, &mut dst, &[7, 2]).unwrap();
                let (e1, e2) = (max_err(&src, 1, &dst, 7), max_err(&src, 4, &dst, 2));
                assert!(e1 <= bound(c) && e2 <= bound(c), "{c}: errors {e1} {e2} over {}", bound(c));
                if c == GroupCodec::Native(KvDtype::F16) {
                    assert_eq!((e1, e2), (0.0, 0.0), "the native format of the arena is exact");
                }
            }
            // Compression actually shrinks the group.
            if let GroupCodec::Kv(k) = c
                && k != Codec::Bf16
            {
                assert!(g.len() < GroupCodec::Native(KvDtype::F16).group_bytes(2, 16, 64).unwrap() as u64, "{c}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A well-formed group of a compressing codec whose values an f16 cache cannot hold (int8 and bf16 blocks past
    /// 65504) is refused whole rather than written as infinities; an f32 cache takes it.
    #[test]
    fn groups_past_f16s_range_are_refused_by_an_f16_cache_and_never_written() {
        let (bs, hd) = (16, 64);
        let mut src = KvStorage::with_dtype(2, bs, hd, KvDtype::F32);
        let small: Vec<f32> = (0..bs * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        let huge: Vec<f32> = (0..bs * hd).map(|i| 1e6 + i as f32).collect();
        src.write_block(0, &small, &small);
        src.write_block(1, &small, &huge);
        for c in [GroupCodec::Kv(Codec::Int8), GroupCodec::Kv(Codec::Bf16), GroupCodec::Kv(Codec::Fp8E4m3)] {
            let g = encode(&src, &[0, 1], c).unwrap();
            let mut dst = filled(KvDtype::F16);
            let before = (block(&dst, 7), block(&dst, 8));
            let got = decode(&g, &mut dst, &[7, 8]);
            assert!(matches!(got, Err(TierError::DoesNotFit { .. })), "{c}: {got:?}");
            assert_eq!((block(&dst, 7), block(&dst, 8)), before, "{c}: nothing written");
            decode(&g, &mut filled(KvDtype::F32), &[7, 8]).unwrap();
            decode(&encode(&src, &[0], c).unwrap(), &mut dst, &[7]).expect("a block within range decodes");
        }
    }

    /// A group whose bound does not settle that it fits (an int8 slot at f16's largest value, 65504, inside the
    /// bound's margin of the overflow) is checked value by value, and kept: it decodes into an f16 cache to what the
    /// unchecked path writes into an f32 one, rounded to f16.
    #[test]
    fn groups_at_f16s_edge_are_checked_value_by_value_and_kept() {
        let (bs, hd) = (16, 64);
        let mut src = KvStorage::with_dtype(2, bs, hd, KvDtype::F32);
        let edge: Vec<f32> = (0..bs * hd).map(|i| if i == 5 { 65504.0 } else { (i as f32 * 0.37).sin() }).collect();
        src.write_block(0, &edge, &edge);
        let g = encode(&src, &[0], GroupCodec::Kv(Codec::Int8)).unwrap();
        let bound = decoded_magnitude_bound(&g.bytes).unwrap();
        assert!(bound < F16_OVERFLOW && bound * BOUND_MARGIN >= F16_OVERFLOW, "{bound}");
        let (mut narrow, mut wide) = (filled(KvDtype::F16), filled(KvDtype::F32));
        decode(&g, &mut narrow, &[7]).expect("every value fits f16");
        decode(&g, &mut wide, &[7]).unwrap();
        let round = |x: &Vec<f32>| x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect::<Vec<_>>();
        let ((nk, nv), (wk, wv)) = (block(&narrow, 7), block(&wide, 7));
        assert_eq!((nk, nv), (round(&wk), round(&wv)));
        assert_eq!(wk[5], bound, "the bound is the decoded value");
    }

    /// A well-formed int8 group whose scale is valid (127 × 2e36 is finite) but decodes a code to 2.5e38 is refused
    /// by a cache of every dtype, nothing written: in an f32 arena q·k overflowed to infinity, and the rotated fp8
    /// arena's butterfly turned it into NaN.
    #[test]
    fn groups_past_the_kv_magnitude_limit_are_refused_by_every_cache() {
        let (bs, hd) = (16, 64);
        let src = filled(KvDtype::F32);
        let mut g = encode(&src, &[0], GroupCodec::Kv(Codec::Int8)).unwrap();
        // After the 16-byte header, K's slot scales, then its codes: slot 0's scale and first code.
        g.bytes[16..20].copy_from_slice(&2e36f32.to_le_bytes());
        g.bytes[16 + 4 * bs] = 127;
        assert!(pagoda_kernels::codec::validate_block(&g.bytes).is_ok(), "a well-formed block");
        for arena in KvDtype::ALL {
            let mut dst = KvStorage::with_dtype(2, bs, hd, arena);
            let before = block(&dst, 1);
            let got = decode(&g, &mut dst, &[1]);
            assert!(matches!(got, Err(TierError::DoesNotFit { .. })), "into {arena}: {got:?}");
            assert_eq!(block(&dst, 1), before, "into {arena}: nothing written");
        }
    }

    #[test]
    fn corrupt_or_mismatched_groups_are_refused_and_never_written() {
        let src = filled(KvDtype::F32);
        let g = encode(&src, &[0, 1], GroupCodec::Kv(Codec::Int4Kivi)).unwrap();
        let mut dst = filled(KvDtype::F32);
        let before = block(&dst, 5);
        // Wrong block count, unknown codec, a header whose codec id disagrees with the stored name.
        assert!(matches!(decode(&g, &mut dst, &[5]), Err(TierError::BadLength { .. })));
        let unknown = EncodedGroup { codec: "zstd".into(), bytes: g.bytes.clone() };
        assert!(matches!(decode(&unknown, &mut dst, &[5, 6]), Err(TierError::UnknownCodec(_))));
        let mut renamed = g.clone();
        renamed.codec = "int2_kivi".into();
        assert!(decode(&renamed, &mut dst, &[5, 6]).is_err());
        // A NaN scale in the second block: nothing is written, not even the first block.
        let mut bad = g.clone();
        let second = bad.bytes.len() / 2;
        bad.bytes[second + 16..second + 18].copy_from_slice(&half::f16::NAN.to_le_bytes());
        assert!(matches!(decode(&bad, &mut dst, &[5, 6]), Err(TierError::Corrupt { .. })));
        assert_eq!(block(&dst, 5), before);

        // On disk, a flipped byte in a compressed group is caught by the file checksum, dropped and counted.
        let dir = std::env::temp_dir().join(format!("pagoda-groupcodec-corrupt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut disk = DiskStore::open(&dir, 1 << 24, 1 << 20).unwrap();
        assert!(disk.put(9, &g).unwrap());
        let path = dir.join(format!("{:016x}.kv", 9));
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x08;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(disk.get(9).unwrap(), None);
        assert_eq!(disk.corrupted(), 1);
        assert!(!path.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// One 16-token group of SmolLM2's shape (30 layers × 3 kv-heads: 90 blocks of 16 slots × 64) encoded with each
    /// compressing codec and decoded into an f16 cache, as an onboarding does: medians of 41 decodes.
    /// `cargo test --release -p pagoda-worker --lib codec_decode_speed -- --ignored --nocapture`
    #[test]
    #[ignore = "timing, run by hand"]
    fn codec_decode_speed() {
        let (blocks, bs, hd) = (90u32, 16, 64);
        let mut kv = KvStorage::with_dtype(blocks as usize * 2, bs, hd, KvDtype::F16);
        for b in 0..blocks {
            // Keys share an offset in a few channels, as a model's do (rotated fp8 then centres them).
            let offset = |i: usize| if i % hd < 8 { 3.0 } else { 0.0 };
            let k: Vec<f32> = (0..bs * hd).map(|i| (i as f32 * 0.37 + b as f32).sin() * 2.0 + offset(i)).collect();
            let v: Vec<f32> = (0..bs * hd).map(|i| (i as f32 * 0.11 - b as f32).cos() * 0.5).collect();
            kv.write_block(b, &k, &v);
        }
        let (from, to): (Vec<u32>, Vec<u32>) = ((0..blocks).collect(), (blocks..2 * blocks).collect());
        let mut codecs = vec![GroupCodec::Native(KvDtype::F16)];
        codecs.extend(GroupCodec::COMPRESSING.map(GroupCodec::Kv));
        codecs.push(GroupCodec::Kv(Codec::Fp8E4m3Rotated));
        for c in codecs {
            let g = encode(&kv, &from, c).unwrap();
            let ms = crate::tiers::median_ms(41, || decode(&g, &mut kv, &to).unwrap());
            println!("{c}: {} bytes, median {ms:.3} ms", g.bytes.len());
        }
    }
}
