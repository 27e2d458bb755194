//! Group codecs of the lower tiers: how one block group (every (layer, kv-head) block of a 16-token chunk) is turned
//! into the bytes a tier stores, and back into device blocks. Two families share the [`EncodedGroup::codec`] name:
//!
//! - the [`native`](super::native) formats (`f16`, `f32`, legacy `native`): the device arena's elements, lossless;
//! - the compressing KV codecs of the kernels crate (`bf16`, `int8`, `fp8_e4m3`, `fp8_e4m3_rotated`, `int4_kivi`,
//!   `int2_kivi`): each block encoded with [`Codec::encode_block`] (self-describing 16-byte header, validated on
//!   decode), the blocks concatenated in group order. The kernels' `f16`/`f32` codecs are not offered here: their names belong to the
//!   native formats, which are smaller (no header) and already lossless.
//!
//! Decoding dispatches on the stored name, so one tier holds groups of any mix of codecs, and a group written by
//! EvicPress in `int4_kivi` onboards exactly like a native one. Every length and header is checked first, so a
//! group of another model shape (or corrupt bytes that passed a checksum) is refused instead of half-written.

use std::fmt;
use std::str::FromStr;

use pagoda_kernels::{Codec, KvDtype, KvStorage, decode_block};

use super::{EncodedGroup, TierError, native};
use crate::cache::BlockId;

/// A lower-tier group format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupCodec {
    /// The device cache's element type, raw.
    Native(KvDtype),
    /// A kernels codec other than `f32`/`f16`, one encoded block per (layer, kv-head).
    Kv(Codec),
}

impl GroupCodec {
    /// The compressing codecs, in decreasing size.
    pub const COMPRESSING: [Codec; 4] = [Codec::Int8, Codec::Fp8E4m3, Codec::Int4Kivi, Codec::Int2Kivi];

    /// The name stored with each group.
    pub fn name(self) -> &'static str {
        match self {
            GroupCodec::Native(d) => native::codec_name(d),
            GroupCodec::Kv(c) => c.name(),
        }
    }

    /// Encoded bytes of a group of `n_blocks` blocks of `block_size` × `head_dim`.
    pub fn group_bytes(self, n_blocks: usize, block_size: usize, head_dim: usize) -> Result<usize, TierError> {
        match self {
            GroupCodec::Native(d) => Ok(native::group_bytes(n_blocks, block_size, head_dim, d)),
            GroupCodec::Kv(c) => c
                .encoded_len(block_size, head_dim)
                .map(|n| n * n_blocks)
                .map_err(|e| TierError::Config(format!("codec {c}: {e}"))),
        }
    }
}

impl fmt::Display for GroupCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for GroupCodec {
    type Err = TierError;

    /// `native`, `f32`, `f16`, `native-int8` and `native-fp8_e4m3` are the native formats; the other kernels codecs
    /// by name.
    fn from_str(s: &str) -> Result<GroupCodec, TierError> {
        if let Some(d) = native::dtype_of(s) {
            return Ok(GroupCodec::Native(d));
        }
        s.parse::<Codec>().map(GroupCodec::Kv).map_err(|_| TierError::UnknownCodec(s.chars().take(64).collect()))
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
        GroupCodec::Kv(c) => c,
    };
    let (bs, hd) = (kv.block_size(), kv.head_dim());
    let block = c.encoded_len(bs, hd).map_err(|e| TierError::Config(format!("codec {c}: {e}")))?;
    let mut bytes = vec![0u8; block * blocks.len()];
    let (mut k, mut v) = (vec![0.0f32; kv.block_len()], vec![0.0f32; kv.block_len()]);
    for (&b, out) in blocks.iter().zip(bytes.chunks_exact_mut(block)) {
        kv.read_block(b, &mut k, &mut v);
        c.encode_block(bs, hd, &k, &v, out).map_err(|e| TierError::Config(format!("encoding with {c}: {e}")))?;
    }
    Ok(EncodedGroup { codec: c.name().to_owned(), bytes })
}

/// Decodes `group` (any codec) into blocks `blocks` of `kv`, checking the codec, the exact length and, for the
/// kernels codecs, every block header and payload before anything is written.
pub fn decode(group: &EncodedGroup, kv: &mut KvStorage, blocks: &[BlockId]) -> Result<(), TierError> {
    let c = match group.codec.parse::<GroupCodec>()? {
        GroupCodec::Native(_) => return native::decode(group, kv, blocks),
        GroupCodec::Kv(c) => c,
    };
    let (bs, hd) = (kv.block_size(), kv.head_dim());
    let block = c.encoded_len(bs, hd).map_err(|e| TierError::Config(format!("codec {c}: {e}")))?;
    let expected = block * blocks.len();
    if group.bytes.len() != expected {
        return Err(TierError::BadLength { codec: group.codec.clone(), expected, got: group.bytes.len() });
    }
    if let Some(&bad) = blocks.iter().find(|&&b| b as usize >= kv.num_blocks()) {
        return Err(TierError::BadLength { codec: group.codec.clone(), expected: kv.num_blocks(), got: bad as usize });
    }
    // Decode everything first: a bad block in the middle must not leave the group half-written.
    let n = kv.block_len();
    let mut decoded = vec![0.0f32; 2 * n * blocks.len()];
    for (bytes, out) in group.bytes.chunks_exact(block).zip(decoded.chunks_exact_mut(2 * n)) {
        let (k, v) = out.split_at_mut(n);
        let h = decode_block(bytes, k, v).map_err(|e| TierError::Corrupt {
            path: std::path::PathBuf::from(format!("<{} group>", group.codec)),
            reason: e.to_string(),
        })?;
        if h.codec != c || h.block_size != bs || h.head_dim != hd {
            return Err(TierError::BadLength { codec: group.codec.clone(), expected: block, got: bytes.len() });
        }
    }
    for (&b, out) in blocks.iter().zip(decoded.chunks_exact(2 * n)) {
        let (k, v) = out.split_at(n);
        kv.write_block(b, k, v);
    }
    Ok(())
}

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

    /// Every codec's worst absolute error on these blocks (|K| ≤ 2, |V| ≤ 0.5): generous bounds, the per-element
    /// bounds are tested in the kernels crate; here the point is that the right decoder ran.
    fn bound(c: GroupCodec) -> f32 {
        match c {
            GroupCodec::Native(KvDtype::F16) => 2e-3,
            GroupCodec::Native(KvDtype::F32) => 0.0,
            GroupCodec::Native(KvDtype::Int8) | GroupCodec::Kv(Codec::Int8) | GroupCodec::Kv(Codec::Bf16) => 2e-2,
            GroupCodec::Native(KvDtype::Fp8 | KvDtype::Fp8Rotated) | GroupCodec::Kv(Codec::Fp8E4m3) => 0.13,
            GroupCodec::Kv(Codec::Int4Kivi) => 0.2,
            GroupCodec::Kv(_) => 1.0,
        }
    }

    fn all_codecs() -> Vec<GroupCodec> {
        let mut v: Vec<GroupCodec> = KvDtype::ALL.into_iter().map(GroupCodec::Native).collect();
        v.push(GroupCodec::Kv(Codec::Bf16));
        v.extend(GroupCodec::COMPRESSING.map(GroupCodec::Kv));
        v.push(GroupCodec::Kv(Codec::Fp8E4m3Rotated));
        v
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
}
