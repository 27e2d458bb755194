//! One sequence's KV block tables: a table and a cache length per (layer, kv-head), index
//! `layer * n_kv_heads + head` (the layout `ForwardSeq::tables` expects).
//!
//! Uniform policies keep all tables the same length, so block `j` of every table forms the sequence's `j`-th
//! block group. [`SeqBlocks::reserve`] grows every table by whole groups, [`SeqBlocks::adopt`] takes matched
//! prefix groups by reference, [`SeqBlocks::register_full`] publishes fully computed groups in the prefix
//! index, and [`SeqBlocks::free`] drops the sequence's references (tail groups first, so the LRU evicts the
//! ends of prefix chains before their beginnings).

use super::{BlockId, BlockPool, CacheError, CacheLayout};

#[derive(Debug, Clone)]
pub struct SeqBlocks {
    layout: CacheLayout,
    tables: Vec<Vec<BlockId>>,
    lens: Vec<usize>,
    /// Blocks per table (the same for every table).
    n_groups: usize,
    /// Leading groups already in the prefix index (adopted or registered by this sequence).
    registered: usize,
    /// Groups whose contents no longer equal the full, unpruned KV of their tokens; never registered.
    pruned: bool,
    scratch: Vec<BlockId>,
}

impl SeqBlocks {
    pub fn new(layout: CacheLayout) -> SeqBlocks {
        let n = layout.group_size();
        SeqBlocks {
            layout,
            tables: vec![Vec::new(); n],
            lens: vec![0; n],
            n_groups: 0,
            registered: 0,
            pruned: false,
            scratch: Vec::with_capacity(n),
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

    /// Cache length of the first table (all tables under uniform policies).
    pub fn len(&self) -> usize {
        self.lens.first().copied().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.n_groups == 0
    }

    pub fn num_groups(&self) -> usize {
        self.n_groups
    }

    pub fn num_blocks(&self) -> usize {
        self.n_groups * self.layout.group_size()
    }

    pub fn num_registered(&self) -> usize {
        self.registered
    }

    /// Slots every table can hold without allocating.
    pub fn capacity(&self) -> usize {
        self.n_groups * self.layout.block_size
    }

    /// Marks the cache as pruned: from now on nothing more is registered in the prefix index.
    pub fn mark_pruned(&mut self) {
        self.pruned = true;
    }

    /// Blocks that reserving room for `n_new` more tokens would allocate.
    pub fn blocks_needed(&self, n_new: usize) -> usize {
        let groups = self.layout.groups_for_tokens(self.len() + n_new);
        groups.saturating_sub(self.n_groups) * self.layout.group_size()
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
        self.n_groups = matched;
        self.registered = matched;
        let len = matched * self.layout.block_size;
        self.lens.iter_mut().for_each(|l| *l = len);
        Ok(matched)
    }

    /// Ensures every table has room for `n_new` more slots, allocating whole groups. All or nothing.
    pub fn reserve(&mut self, pool: &mut BlockPool, n_new: usize) -> Result<(), CacheError> {
        let needed = self.blocks_needed(n_new);
        if needed == 0 {
            return Ok(());
        }
        self.scratch.clear();
        pool.allocate(needed, &mut self.scratch)?;
        let gs = self.layout.group_size();
        for group in self.scratch.chunks_exact(gs) {
            for (t, &b) in self.tables.iter_mut().zip(group) {
                t.push(b);
            }
        }
        self.n_groups += needed / gs;
        Ok(())
    }

    /// Records that `n` more slots were written in every table (after a forward step).
    pub fn advance(&mut self, n: usize) {
        let cap = self.capacity();
        for l in &mut self.lens {
            *l = (*l + n).min(cap);
        }
    }

    /// Registers every full, computed, unpruned group not yet in the index. `hashes[i]` is the chain hash of
    /// token block `i`; groups beyond `hashes.len()` wait. Groups whose hash another sequence registered first
    /// stay private to this sequence.
    pub fn register_full(&mut self, pool: &mut BlockPool, hashes: &[u64]) {
        if self.pruned {
            return;
        }
        let full = (self.len() / self.layout.block_size).min(hashes.len()).min(self.n_groups);
        while self.registered < full {
            let j = self.registered;
            self.scratch.clear();
            self.scratch.extend(self.tables.iter().map(|t| t[j]));
            pool.register(hashes[j], &self.scratch);
            self.registered += 1;
        }
    }

    /// Drops this sequence's references, tail groups first, and empties the tables.
    pub fn free(&mut self, pool: &mut BlockPool) -> Result<(), CacheError> {
        let mut result = Ok(());
        for j in (0..self.n_groups).rev() {
            self.scratch.clear();
            self.scratch.extend(self.tables.iter().map(|t| t[j]));
            if let Err(e) = pool.release(&self.scratch) {
                result = Err(e);
            }
        }
        self.tables.iter_mut().for_each(Vec::clear);
        self.lens.iter_mut().for_each(|l| *l = 0);
        self.n_groups = 0;
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
