//! Token-dropped copies of a context: EvicPress's keep-ratio dimension (`shared/papers/evicpress.txt` §2.2, §6).
//!
//! A pruned copy keeps `ceil(ratio · tokens)` of a context's slots in every (layer, kv-head) table, chosen by
//! KeyDiff (the keys least similar to the table's mean normalised key; the eviction method the paper found best
//! more often than SnapKV and knorm, and one that needs no query, so a copy can be made before the question is
//! known). The kept slots keep their order and are packed densely: packed group `j` holds kept slots
//! `j·block_size ..` of every table, so a pruned copy is stored as ordinary tier groups, under keys derived from
//! the context ([`group_key`]) rather than chain hashes (its groups are not the KV of any token block).
//!
//! Restored, a pruned copy is a sequence whose tables hold fewer slots than its position (exactly what an eviction
//! policy leaves behind): RoPE is already applied to the cached keys, so attention over the kept slots needs no
//! position bookkeeping.
//!
//! [`Pruner`] owns the scratch of the selection and the packing, reused across contexts.

use pagoda_kernels::{KvStorage, scores};
use xxhash_rust::xxh3::xxh3_64;

use crate::cache::BlockId;

/// Kept ratios offered at most ([`crate::placement::EvicPressConfig::keep_ratios`]).
pub const MAX_KEEP_RATIOS: usize = 4;

/// Slots a copy of `tokens` tokens at `ratio` keeps per table: at least one, at most all.
pub fn kept_tokens(tokens: usize, ratio: f64) -> usize {
    ((tokens as f64 * ratio).ceil() as usize).clamp(1.min(tokens), tokens)
}

/// Groups a copy of `kept` slots per table packs into.
pub fn packed_groups(kept: usize, block_size: usize) -> usize {
    kept.div_ceil(block_size)
}

/// The tier key of packed group `j` of `context`'s pruned copy (a context id is its first chain hash).
pub fn group_key(context: u64, j: usize) -> u64 {
    let mut buf = [0u8; 8 + 8 + 12];
    buf[..8].copy_from_slice(&context.to_le_bytes());
    buf[8..16].copy_from_slice(&(j as u64).to_le_bytes());
    buf[16..].copy_from_slice(b"pagoda-prune");
    xxh3_64(&buf)
}

/// Validates keep ratios: each in (0, 1), distinct, at most [`MAX_KEEP_RATIOS`].
pub fn check_keep_ratios(ratios: &[f64]) -> Result<(), String> {
    if ratios.len() > MAX_KEEP_RATIOS {
        return Err(format!("at most {MAX_KEEP_RATIOS} keep ratios, got {}", ratios.len()));
    }
    for (i, r) in ratios.iter().enumerate() {
        if !(r.is_finite() && *r > 0.0 && *r < 1.0) {
            return Err(format!("a keep ratio must be in (0, 1), got {r}"));
        }
        if ratios[..i].contains(r) {
            return Err(format!("keep ratio {r} given twice"));
        }
    }
    Ok(())
}

/// Selection and packing scratch (see the module docs).
#[derive(Debug, Default)]
pub struct Pruner {
    scores: Vec<f32>,
    anchor: Vec<f32>,
    idx: Vec<u32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Pruner {
    /// KeyDiff's choice for every table: `tables[t]` holds `len` slots of `kv`; `keep[t]` gets the `kept` slots to
    /// keep, ascending.
    pub fn select(
        &mut self,
        kv: &KvStorage,
        tables: &[Vec<BlockId>],
        len: usize,
        kept: usize,
        keep: &mut Vec<Vec<u32>>,
    ) {
        keep.resize_with(tables.len(), Vec::new);
        keep.truncate(tables.len());
        self.scores.resize(len.max(self.scores.len()), 0.0);
        for (table, out) in tables.iter().zip(keep.iter_mut()) {
            scores::keydiff_cosine(kv, table, len, &mut self.anchor, &mut self.scores[..len]);
            // Lowest cosine to the anchor first: the most distinctive keys stay.
            scores::select_k(&self.scores[..len], kept, false, &mut self.idx, out);
        }
    }

    /// Packs group `j` of the pruned copy: kept slots `j·block_size ..` of every table of `src` (by `keep`, as
    /// [`Pruner::select`] made it) into block `t` of `dst` for table `t` (slots past the copy's end are zeroed).
    /// Returns the slots written per table.
    pub fn pack_group(
        &mut self,
        src: &KvStorage,
        tables: &[Vec<BlockId>],
        keep: &[Vec<u32>],
        j: usize,
        dst: &mut KvStorage,
        dst_blocks: &[BlockId],
    ) -> usize {
        let (bs, hd) = (src.block_size(), src.head_dim());
        debug_assert_eq!((dst.block_size(), dst.head_dim()), (bs, hd), "pack_group: shapes differ");
        self.k.resize(hd, 0.0);
        self.v.resize(hd, 0.0);
        let mut written = 0;
        for ((table, slots), &d) in tables.iter().zip(keep).zip(dst_blocks) {
            let part = slots.get(j * bs..).unwrap_or(&[]);
            let part = &part[..part.len().min(bs)];
            for (s, &from) in part.iter().enumerate() {
                let from = from as usize;
                src.read_slot(table[from / bs], from % bs, &mut self.k, &mut self.v);
                dst.write_slot(d, s, &self.k, &self.v);
            }
            self.k.fill(0.0);
            self.v.fill(0.0);
            for s in part.len()..bs {
                dst.write_slot(d, s, &self.k, &self.v);
            }
            written = part.len();
        }
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_kernels::KvDtype;

    /// Two tables of 40 slots × 8 dims: keys along one direction (redundant) except a few distinct ones, with
    /// every slot's value tagged by its index so packing can be checked.
    fn cache(dtype: KvDtype) -> (KvStorage, Vec<Vec<BlockId>>, Vec<Vec<u32>>) {
        let (bs, hd, len) = (16, 8, 40);
        let mut kv = KvStorage::with_dtype(8, bs, hd, dtype);
        let tables = vec![vec![0, 1, 2], vec![5, 3, 7]];
        let distinct: [Vec<u32>; 2] = [vec![3, 17, 33], vec![0, 20, 39]];
        for (table, special) in tables.iter().zip(&distinct) {
            for i in 0..len {
                let mut k = vec![1.0f32; hd];
                k[0] += (i % 3) as f32 * 0.01;
                if special.contains(&(i as u32)) {
                    k = (0..hd).map(|d| if d == 1 + i % 6 { 4.0 } else { -0.5 }).collect();
                }
                let v = vec![i as f32; hd];
                kv.write_slot(table[i / bs], i % bs, &k, &v);
            }
        }
        (kv, tables, distinct.to_vec())
    }

    #[test]
    fn keydiff_keeps_the_distinct_keys_and_packing_keeps_their_order() {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let (kv, tables, distinct) = cache(dtype);
            let mut p = Pruner::default();
            let mut keep = Vec::new();
            p.select(&kv, &tables, 40, 3, &mut keep);
            assert_eq!(keep, distinct, "{dtype:?}: the three keys least like the mean");
            // Keep 20 of 40 (ratio 0.5): two packed groups, the second with 4 slots.
            let kept = kept_tokens(40, 0.5);
            assert_eq!((kept, packed_groups(kept, 16)), (20, 2));
            p.select(&kv, &tables, 40, kept, &mut keep);
            for (k, d) in keep.iter().zip(&distinct) {
                assert_eq!(k.len(), 20);
                assert!(k.windows(2).all(|w| w[0] < w[1]), "ascending");
                assert!(d.iter().all(|s| k.contains(s)), "the distinct keys are among the kept");
            }
            let mut dst = KvStorage::with_dtype(4, 16, 8, KvDtype::F32);
            let (mut kr, mut vr) = (vec![0.0; 8], vec![0.0; 8]);
            for j in 0..2 {
                let blocks = [j as u32 * 2, j as u32 * 2 + 1];
                let n = p.pack_group(&kv, &tables, &keep, j, &mut dst, &blocks);
                assert_eq!(n, if j == 0 { 16 } else { 4 });
                for (t, &b) in blocks.iter().enumerate() {
                    for s in 0..16 {
                        dst.read_slot(b, s, &mut kr, &mut vr);
                        let want = keep[t].get(j * 16 + s).map_or(0.0, |&i| i as f32);
                        assert_eq!(vr[0], want, "{dtype:?} table {t} group {j} slot {s}");
                    }
                }
            }
        }
    }

    #[test]
    fn ratios_and_keys() {
        assert_eq!(kept_tokens(4096, 0.25), 1024);
        assert_eq!(kept_tokens(10, 0.01), 1);
        assert_eq!(kept_tokens(0, 0.5), 0);
        assert_ne!(group_key(1, 0), group_key(1, 1));
        assert_ne!(group_key(1, 0), group_key(2, 0));
        assert!(check_keep_ratios(&[0.5, 0.25]).is_ok());
        assert!(check_keep_ratios(&[]).is_ok());
        for bad in [&[1.0][..], &[0.0], &[f64::NAN], &[0.5, 0.5], &[0.1, 0.2, 0.3, 0.4, 0.6]] {
            assert!(check_keep_ratios(bad).is_err(), "{bad:?}");
        }
    }
}
