//! The `native` group codec: each block's K then V, f32 little-endian, blocks in group order
//! (`layer * n_kv_heads + head`). Lossless and cheap (a copy), so it is the fallback while no compressing codec is
//! configured.

use pagoda_kernels::KvStorage;

use super::{EncodedGroup, TierError};
use crate::cache::BlockId;

pub const NAME: &str = "native";

/// Encoded size of a group of `n_blocks` blocks of `block_len` floats each.
pub fn group_bytes(n_blocks: usize, block_len: usize) -> usize {
    n_blocks * block_len * 2 * 4
}

/// Encodes blocks `blocks` of `kv`.
pub fn encode(kv: &KvStorage, blocks: &[BlockId]) -> EncodedGroup {
    let mut bytes = Vec::with_capacity(group_bytes(blocks.len(), kv.block_len()));
    for &b in blocks {
        for part in [kv.block_k(b), kv.block_v(b)] {
            for x in part {
                bytes.extend_from_slice(&x.to_le_bytes());
            }
        }
    }
    EncodedGroup { codec: NAME.to_owned(), bytes }
}

/// Decodes `group` into blocks `blocks` of `kv`. Checks the codec and the exact length first, so a group from a
/// different model shape is refused instead of half-written.
pub fn decode(group: &EncodedGroup, kv: &mut KvStorage, blocks: &[BlockId]) -> Result<(), TierError> {
    if group.codec != NAME {
        return Err(TierError::UnknownCodec(group.codec.clone()));
    }
    let bl = kv.block_len();
    let expected = group_bytes(blocks.len(), bl);
    if group.bytes.len() != expected {
        return Err(TierError::BadLength { codec: NAME.to_owned(), expected, got: group.bytes.len() });
    }
    if let Some(&bad) = blocks.iter().find(|&&b| b as usize >= kv.num_blocks()) {
        return Err(TierError::BadLength { codec: NAME.to_owned(), expected: kv.num_blocks(), got: bad as usize });
    }
    let (k, v) = kv.arenas_mut();
    let mut chunks = group.bytes.chunks_exact(bl * 4);
    for &b in blocks {
        let r = b as usize * bl..(b as usize + 1) * bl;
        for dst in [&mut k[r.clone()], &mut v[r]] {
            let Some(src) = chunks.next() else { break };
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_bad_shapes() {
        let mut kv = KvStorage::new(6, 4, 3);
        for b in 0..6u32 {
            for (i, x) in kv.block_k_mut(b).iter_mut().enumerate() {
                *x = b as f32 * 100.0 + i as f32;
            }
            for (i, x) in kv.block_v_mut(b).iter_mut().enumerate() {
                *x = -(b as f32 * 100.0 + i as f32);
            }
        }
        let g = encode(&kv, &[1, 4]);
        assert_eq!(g.bytes.len(), group_bytes(2, 12));
        decode(&g, &mut kv, &[2, 5]).unwrap();
        assert_eq!(kv.block_k(2), kv.block_k(1));
        assert_eq!(kv.block_v(5), kv.block_v(4));
        assert!(matches!(decode(&g, &mut kv, &[0]), Err(TierError::BadLength { .. })));
        assert!(matches!(decode(&g, &mut kv, &[0, 9]), Err(TierError::BadLength { .. })));
        let other = EncodedGroup { codec: "int8".into(), bytes: g.bytes.clone() };
        assert!(matches!(decode(&other, &mut kv, &[2, 5]), Err(TierError::UnknownCodec(_))));
    }
}
