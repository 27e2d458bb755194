//! One sequence's KV block tables: a table and a cache length per (layer, kv-head), index
//! `layer * n_kv_heads + head` (the layout `ForwardSeq::tables` expects).
//!
//! While the cache is unpruned every table has the same length, so block `j` of every table forms the sequence's
//! `j`-th block group: [`SeqBlocks::adopt`] takes matched prefix groups by reference and
//! [`SeqBlocks::register_full`] publishes fully computed groups in the prefix index. Eviction policies then make
//! the tables differ: [`SeqBlocks::compact`] keeps a subset of one table's slots (the KV-Compress paper's
//! MoveCache), [`SeqBlocks::remove_block`] drops one whole block (PagedEviction), and both return emptied blocks
//! to the pool at once. A pruned cache no longer equals the full KV of its tokens, so it is never registered, and
//! blocks it shares (adopted prefix groups) are copied before they are written (copy-on-write).
//! [`SeqBlocks::reserve`] grows each table to fit its own length; [`SeqBlocks::free`] drops every reference,
//! tail blocks first, so the LRU evicts the ends of prefix chains before their beginnings.

use crate::policy::PolicyKv;

use super::{BlockId, BlockPool, CacheError, CacheLayout};

#[derive(Debug, Clone)]
pub struct SeqBlocks {
    layout: CacheLayout,
    tables: Vec<Vec<BlockId>>,
    lens: Vec<usize>,
    /// Leading groups already in the prefix index (adopted or registered by this sequence).
    registered: usize,
    /// The tables no longer hold the full, unpruned KV of their tokens; nothing more is registered.
    pruned: bool,
    scratch: Vec<BlockId>,
    /// Blocks a compaction lets go of (reused buffer).
    released: Vec<BlockId>,
}

impl SeqBlocks {
    pub fn new(layout: CacheLayout) -> SeqBlocks {
        let n = layout.group_size();
        SeqBlocks {
            layout,
            tables: vec![Vec::new(); n],
            lens: vec![0; n],
            registered: 0,
            pruned: false,
            scratch: Vec::with_capacity(n),
            released: Vec::new(),
        }
    }

    pub fn layout(&self) -> CacheLayout {
        self.layout
    }

    /// Block table per (layer, kv-head).
    pub fn tables(&self) -> &[Vec<BlockId>] {
        &self.tables
    }

    /// Cache length per (layer, kv-head).
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Cache length of the first table (of every table while unpruned).
    pub fn len(&self) -> usize {
        self.lens.first().copied().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.tables.iter().all(Vec::is_empty)
    }

    /// Blocks of the longest table (the number of block groups while unpruned).
    pub fn num_groups(&self) -> usize {
        self.tables.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Blocks held over all tables.
    pub fn num_blocks(&self) -> usize {
        self.tables.iter().map(Vec::len).sum()
    }

    pub fn num_registered(&self) -> usize {
        self.registered
    }

    /// Slots the first table can hold without allocating.
    pub fn capacity(&self) -> usize {
        self.tables.first().map_or(0, Vec::len) * self.layout.block_size
    }

    /// Marks the cache as pruned: from now on nothing more is registered in the prefix index.
    pub fn mark_pruned(&mut self) {
        self.pruned = true;
    }

    /// Blocks that reserving room for `n_new` more slots in every table would allocate.
    pub fn blocks_needed(&self, n_new: usize) -> usize {
        let bs = self.layout.block_size;
        self.tables.iter().zip(&self.lens).map(|(t, &l)| (l + n_new).div_ceil(bs).saturating_sub(t.len())).sum()
    }

    /// Adopts the longest cached prefix among `hashes` (the sequence's chain hashes, in order), taking a
    /// reference on each matched group. Only valid on an empty sequence. Returns the number of matched groups;
    /// the caller treats `matched * block_size` tokens as already computed.
    pub fn adopt(&mut self, pool: &mut BlockPool, hashes: &[u64]) -> Result<usize, CacheError> {
        debug_assert!(self.is_empty(), "adopt on a non-empty sequence");
        if !self.is_empty() {
            return Ok(0);
        }
        let gs = self.layout.group_size();
        let mut matched = 0;
        for &h in hashes {
            let Some(group) = pool.lookup(h) else { break };
            if group.len() != gs {
                break;
            }
            self.scratch.clear();
            self.scratch.extend_from_slice(group);
            pool.acquire(&self.scratch)?;
            for (t, &b) in self.tables.iter_mut().zip(self.scratch.iter()) {
                t.push(b);
            }
            matched += 1;
        }
        self.registered = matched;
        let len = matched * self.layout.block_size;
        self.lens.iter_mut().for_each(|l| *l = len);
        Ok(matched)
    }

    /// Appends a pruned copy after the current full groups: `packed` holds groups of blocks (block `t` of each goes
    /// to table `t`) with `slots` slots per table, allocated by the caller, whose references the sequence now
    /// owns. The cache counts as pruned from here on.
    pub fn append_pruned(&mut self, packed: &[BlockId], slots: usize) {
        debug_assert!(
            self.lens.iter().all(|&l| l % self.layout.block_size == 0),
            "append_pruned after a partial block"
        );
        debug_assert!(packed.len() == slots.div_ceil(self.layout.block_size) * self.layout.group_size());
        for group in packed.chunks_exact(self.layout.group_size()) {
            for (t, &b) in self.tables.iter_mut().zip(group) {
                t.push(b);
            }
        }
        self.lens.iter_mut().for_each(|l| *l += slots);
        self.pruned = true;
    }

    /// Ensures every table has room for `n_new` more slots. All or nothing.
    pub fn reserve(&mut self, pool: &mut BlockPool, n_new: usize) -> Result<(), CacheError> {
        let needed = self.blocks_needed(n_new);
        if needed == 0 {
            return Ok(());
        }
        self.scratch.clear();
        pool.allocate(needed, &mut self.scratch)?;
        let bs = self.layout.block_size;
        let mut fresh = self.scratch.iter();
        for (t, &l) in self.tables.iter_mut().zip(&self.lens) {
            while t.len() < (l + n_new).div_ceil(bs) {
                // `needed` counted exactly these pushes.
                let Some(&b) = fresh.next() else { break };
                t.push(b);
            }
        }
        Ok(())
    }

    /// Records that `n` more slots were written in every table (after a forward step).
    pub fn advance(&mut self, n: usize) {
        let bs = self.layout.block_size;
        for (l, t) in self.lens.iter_mut().zip(&self.tables) {
            *l = (*l + n).min(t.len() * bs);
        }
    }

    /// Registers every full, computed, unpruned group not yet in the index. `hashes[i]` is the chain hash of
    /// token block `i`; groups beyond `hashes.len()` wait. Groups whose hash another sequence registered first
    /// stay private to this sequence.
    pub fn register_full(&mut self, pool: &mut BlockPool, hashes: &[u64]) {
        if self.pruned {
            return;
        }
        let groups = self.tables.first().map_or(0, Vec::len);
        let full = (self.len() / self.layout.block_size).min(hashes.len()).min(groups);
        while self.registered < full {
            let j = self.registered;
            self.scratch.clear();
            self.scratch.extend(self.tables.iter().map(|t| t[j]));
            pool.register(hashes[j], &self.scratch);
            self.registered += 1;
        }
    }

    /// Keeps only the slots `keep` (strictly ascending, each below the table's length) of table `t`, moved in
    /// order to slots `0..keep.len()`, and releases the blocks that empties. Destination blocks this sequence
    /// shares (adopted prefix groups) are replaced by fresh copies first, so other holders never see the
    /// change; if the pool cannot supply them, nothing changes. Returns the number of blocks released.
    pub fn compact(
        &mut self,
        pool: &mut BlockPool,
        kv: &mut dyn PolicyKv,
        t: usize,
        keep: &[u32],
    ) -> Result<usize, CacheError> {
        let bs = self.layout.block_size;
        let len = self.lens[t];
        if keep.len() > len || keep.windows(2).any(|w| w[0] >= w[1]) || keep.last().is_some_and(|&s| s as usize >= len)
        {
            return Err(CacheError::BadKeep { table: t, len });
        }
        if keep.len() == len {
            return Ok(0);
        }
        let new_blocks = keep.len().div_ceil(bs);
        let shared = self.tables[t][..new_blocks].iter().filter(|&&b| !pool.is_exclusive(b)).count();
        self.scratch.clear();
        pool.allocate(shared, &mut self.scratch)?;
        self.pruned = true;
        // Copy-on-write: a destination block someone else holds becomes a private copy before anything moves.
        self.released.clear();
        let mut fresh = self.scratch.iter();
        for b in self.tables[t][..new_blocks].iter_mut() {
            if !pool.is_exclusive(*b)
                && let Some(&f) = fresh.next()
            {
                kv.copy_block(*b, f);
                self.released.push(*b);
                *b = f;
            }
        }
        kv.compact_table(&self.tables[t], len, keep);
        // The table no longer references its tail, nor the shared blocks it replaced.
        let tail = self.tables[t].len() - new_blocks;
        self.released.extend(self.tables[t].drain(new_blocks..));
        self.lens[t] = keep.len();
        pool.release(&self.released)?;
        Ok(tail)
    }

    /// Drops block `j` of table `t` from the table (no data moves: later blocks shift down one entry) and
    /// releases it. Every block but the last is full, so the table stays dense. Returns the slots removed.
    pub fn remove_block(&mut self, pool: &mut BlockPool, t: usize, j: usize) -> Result<usize, CacheError> {
        let bs = self.layout.block_size;
        let len = self.lens[t];
        if j >= self.tables[t].len() || j * bs >= len {
            return Err(CacheError::BadKeep { table: t, len });
        }
        let slots = (len - j * bs).min(bs);
        let b = self.tables[t].remove(j);
        self.pruned = true;
        self.lens[t] -= slots;
        // A partially filled last block that moved left stays valid: its slots keep their offsets.
        pool.release(&[b])?;
        Ok(slots)
    }

    /// Removes slot `s` of table `t` by moving the table's last slot into it (order is not kept: attention
    /// does not depend on slot order, RoPE is already applied), releasing the last block if it empties. Mirrors
    /// `Vec::swap_remove`, so callers keep per-slot metadata in step with the same call.
    pub fn swap_remove_slot(
        &mut self,
        pool: &mut BlockPool,
        kv: &mut dyn PolicyKv,
        t: usize,
        s: usize,
    ) -> Result<(), CacheError> {
        let bs = self.layout.block_size;
        let len = self.lens[t];
        if s >= len {
            return Err(CacheError::BadKeep { table: t, len });
        }
        let last = len - 1;
        if s != last {
            let j = s / bs;
            let b = self.tables[t][j];
            if !pool.is_exclusive(b) {
                self.scratch.clear();
                pool.allocate(1, &mut self.scratch)?;
                let f = self.scratch[0];
                kv.copy_block(b, f);
                self.tables[t][j] = f;
                pool.release(&[b])?;
            }
            kv.move_slot(self.tables[t][last / bs], last % bs, self.tables[t][j], s % bs);
        }
        self.pruned = true;
        self.lens[t] = last;
        if self.tables[t].len() > last.div_ceil(bs)
            && let Some(b) = self.tables[t].pop()
        {
            pool.release(&[b])?;
        }
        Ok(())
    }

    /// Drops the last `n` slots of every table (a rejected speculative draft: the step appended its tokens to
    /// every table's tail) and releases the blocks that empties, tail first. Slots of registered groups are never
    /// dropped (a speculative step registers only the tokens it accepted): each table keeps at least those.
    pub fn drop_tail(&mut self, pool: &mut BlockPool, n: usize) -> Result<(), CacheError> {
        if n == 0 {
            return Ok(());
        }
        let bs = self.layout.block_size;
        let floor = self.registered * bs;
        for l in &mut self.lens {
            *l = l.saturating_sub(n).max(floor.min(*l));
        }
        let mut result = Ok(());
        for j in (0..self.num_groups()).rev() {
            self.scratch.clear();
            for (t, &l) in self.tables.iter().zip(&self.lens) {
                if j >= l.div_ceil(bs)
                    && let Some(&b) = t.get(j)
                {
                    self.scratch.push(b);
                }
            }
            if self.scratch.is_empty() {
                break;
            }
            if let Err(e) = pool.release(&self.scratch) {
                result = Err(e);
            }
        }
        for (t, &l) in self.tables.iter_mut().zip(&self.lens) {
            t.truncate(l.div_ceil(bs));
        }
        result
    }

    /// Drops this sequence's references, tail blocks first, and empties the tables.
    pub fn free(&mut self, pool: &mut BlockPool) -> Result<(), CacheError> {
        let mut result = Ok(());
        for j in (0..self.num_groups()).rev() {
            self.scratch.clear();
            self.scratch.extend(self.tables.iter().filter_map(|t| t.get(j).copied()));
            if let Err(e) = pool.release(&self.scratch) {
                result = Err(e);
            }
        }
        self.tables.iter_mut().for_each(Vec::clear);
        self.lens.iter_mut().for_each(|l| *l = 0);
        self.registered = 0;
        self.pruned = false;
        result
    }

    /// On finish: publish the full groups, then free everything (cached groups go to the LRU queue).
    pub fn finish(&mut self, pool: &mut BlockPool, hashes: &[u64]) -> Result<(), CacheError> {
        self.register_full(pool, hashes);
        self.free(pool)
    }
}
