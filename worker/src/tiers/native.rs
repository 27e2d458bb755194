//! The native group codecs: each block's K then V in the device cache's own element type, little-endian, blocks in
//! group order (`layer * n_kv_heads + head`). Lossless and cheap (a copy of what the arena holds), so they are the
//! fallback while no compressing codec is configured. The codec is named after the element type (`f16`, `f32`);
//! `native` is the name groups written before f16 caches existed carry (f32). A group is decoded into a cache of
//! either dtype, so a disk tier survives a restart with another `--kv-dtype`.

use pagoda_kernels::{KvArenas, KvDtype, KvStorage};

use super::{EncodedGroup, TierError};
use crate::cache::BlockId;

/// Codec name of groups written by f32 caches before the dtype was part of the name.
const LEGACY_F32: &str = "native";

/// Codec name of a cache's groups.
pub fn codec_name(dtype: KvDtype) -> &'static str {
    dtype.name()
}

/// Encoded size of a group of `n_blocks` blocks of `block_len` elements of `dtype` each.
pub fn group_bytes(n_blocks: usize, block_len: usize, dtype: KvDtype) -> usize {
    n_blocks * block_len * 2 * dtype.bytes()
}

/// Encodes blocks `blocks` of `kv` in its own dtype.
pub fn encode(kv: &KvStorage, blocks: &[BlockId]) -> EncodedGroup {
    let bl = kv.block_len();
    let mut bytes = Vec::with_capacity(group_bytes(blocks.len(), bl, kv.dtype()));
    let arenas = kv.arenas_any();
    for &b in blocks {
        let r = b as usize * bl..(b as usize + 1) * bl;
        match arenas {
            KvArenas::F32 { k, v } => {
                for x in k[r.clone()].iter().chain(&v[r]) {
                    bytes.extend_from_slice(&x.to_le_bytes());
                }
            }
            KvArenas::F16 { k, v } => {
                for x in k[r.clone()].iter().chain(&v[r]) {
                    bytes.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
    }
    EncodedGroup { codec: codec_name(kv.dtype()).to_owned(), bytes }
}

/// Decodes `group` into blocks `blocks` of `kv`, converting when the group's dtype is not the cache's. Checks the
/// codec and the exact length first, so a group from a different model shape is refused instead of half-written.
pub fn decode(group: &EncodedGroup, kv: &mut KvStorage, blocks: &[BlockId]) -> Result<(), TierError> {
    let dtype = match group.codec.as_str() {
        LEGACY_F32 => KvDtype::F32,
        name => name.parse::<KvDtype>().map_err(|_| TierError::UnknownCodec(group.codec.clone()))?,
    };
    let bl = kv.block_len();
    let expected = group_bytes(blocks.len(), bl, dtype);
    if group.bytes.len() != expected {
        return Err(TierError::BadLength { codec: group.codec.clone(), expected, got: group.bytes.len() });
    }
    if let Some(&bad) = blocks.iter().find(|&&b| b as usize >= kv.num_blocks()) {
        return Err(TierError::BadLength { codec: group.codec.clone(), expected: kv.num_blocks(), got: bad as usize });
    }
    let (mut k, mut v) = (vec![0.0f32; bl], vec![0.0f32; bl]);
    let elem = dtype.bytes();
    for (&b, block) in blocks.iter().zip(group.bytes.chunks_exact(2 * bl * elem)) {
        let (kb, vb) = block.split_at(bl * elem);
        widen(dtype, kb, &mut k);
        widen(dtype, vb, &mut v);
        kv.write_block(b, &k, &v);
    }
    Ok(())
}

/// Little-endian elements of `dtype` in `src` as f32.
fn widen(dtype: KvDtype, src: &[u8], out: &mut [f32]) {
    match dtype {
        KvDtype::F32 => {
            for (d, s) in out.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        KvDtype::F16 => {
            for (d, s) in out.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(dtype: KvDtype) -> KvStorage {
        let mut kv = KvStorage::with_dtype(6, 4, 3, dtype);
        for b in 0..6u32 {
            let k: Vec<f32> = (0..12).map(|i| b as f32 * 100.0 + i as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            kv.write_block(b, &k, &v);
        }
        kv
    }

    fn block(kv: &KvStorage, b: u32) -> (Vec<f32>, Vec<f32>) {
        let (mut k, mut v) = (vec![0.0; kv.block_len()], vec![0.0; kv.block_len()]);
        kv.read_block(b, &mut k, &mut v);
        (k, v)
    }

    #[test]
    fn round_trips_and_refuses_bad_shapes() {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let mut kv = filled(dtype);
            let g = encode(&kv, &[1, 4]);
            assert_eq!(g.codec, dtype.name());
            assert_eq!(g.bytes.len(), group_bytes(2, 12, dtype));
            decode(&g, &mut kv, &[2, 5]).unwrap();
            assert_eq!(block(&kv, 2), block(&kv, 1));
            assert_eq!(block(&kv, 5), block(&kv, 4));
            assert!(matches!(decode(&g, &mut kv, &[0]), Err(TierError::BadLength { .. })));
            assert!(matches!(decode(&g, &mut kv, &[0, 9]), Err(TierError::BadLength { .. })));
            let other = EncodedGroup { codec: "int8".into(), bytes: g.bytes.clone() };
            assert!(matches!(decode(&other, &mut kv, &[2, 5]), Err(TierError::UnknownCodec(_))));
        }
    }

    #[test]
    fn decodes_across_dtypes_and_the_legacy_name() {
        // These values are exact in f16, so the conversion is lossless both ways.
        let (f32_kv, mut f16_kv) = (filled(KvDtype::F32), filled(KvDtype::F16));
        let mut g = encode(&f32_kv, &[3]);
        decode(&g, &mut f16_kv, &[0]).unwrap();
        assert_eq!(block(&f16_kv, 0), block(&f32_kv, 3));
        g.codec = LEGACY_F32.into();
        decode(&g, &mut f16_kv, &[1]).unwrap();
        assert_eq!(block(&f16_kv, 1), block(&f32_kv, 3));
        let mut back = filled(KvDtype::F32);
        decode(&encode(&f16_kv, &[4]), &mut back, &[0]).unwrap();
        assert_eq!(block(&back, 0), block(&f32_kv, 4));
    }
}
