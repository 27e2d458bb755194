//! A bounded pool of KV block ids with ref counts, plus the prefix index and its LRU free queue.
//!
//! Block states:
//! - **free**: ref count 0, no cached content; on the free list.
//! - **used**: ref count ≥ 1 (held by one or more sequences; shared prefix blocks have one ref per holder).
//! - **cached-free**: ref count 0 but part of a block group registered in the prefix index. When every block
//!   of a registered group is idle, the group joins the LRU free queue; it stays reusable by prefix hits
//!   (which take it off the queue) until allocation needs its blocks.
//!
//! Allocation takes truly free blocks first, then evicts whole groups from the LRU end (oldest first),
//! removing their prefix-index entries. Allocation is all-or-nothing.

use std::collections::BTreeMap;

use super::prefix::{CachedGroup, PrefixIndex};
use super::{BlockId, CacheError};
use crate::journal::Journal;

#[derive(Debug)]
pub struct BlockPool {
    refs: Vec<u32>,
    /// Hash of the cached group a block belongs to, if any.
    group_of: Vec<Option<u64>>,
    free: Vec<BlockId>,
    index: PrefixIndex,
    /// LRU free queue of idle cached groups: tick → group hash; the smallest tick is evicted first.
    lru: BTreeMap<u64, u64>,
    tick: u64,
    cached_free_blocks: usize,
    evicted_groups: u64,
    /// High-water mark of [`BlockPool::num_used`]: a snapshot taken between engine steps misses the peak, which
    /// sits inside a step (after the scheduler reserves, before evictions free).
    peak_used: usize,
    /// Groups that joined the LRU queue since the last [`BlockPool::take_newly_idle`], when tracking is on (the
    /// engine copies them to the lower tiers between steps).
    newly_idle: Journal<u64>,
    /// Prefix-index changes since the last [`BlockPool::take_index_changes`], in order, when tracking is on (the
    /// engine reports them to the kvstore).
    index_changes: Journal<IndexChange>,
}

/// A change to the prefix index: a block group registered under a chain hash, or evicted from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexChange {
    Registered(u64),
    Evicted(u64),
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> BlockPool {
        let n = u32::try_from(num_blocks).unwrap_or(u32::MAX) as usize;
        BlockPool {
            refs: vec![0; n],
            group_of: vec![None; n],
            // Pop from the end: hand out low ids first.
            free: (0..n as u32).rev().collect(),
            index: PrefixIndex::new(),
            lru: BTreeMap::new(),
            tick: 0,
            cached_free_blocks: 0,
            evicted_groups: 0,
            peak_used: 0,
            newly_idle: Journal::default(),
            index_changes: Journal::default(),
        }
    }

    /// Starts recording prefix-index changes (see [`BlockPool::take_index_changes`]).
    pub fn track_index_changes(&mut self) {
        self.index_changes.start();
    }

    /// The prefix-index changes since the last call, in the order they happened, moved into `out`.
    pub fn take_index_changes(&mut self, out: &mut Vec<IndexChange>) {
        self.index_changes.drain_into(out);
    }

    /// Starts recording which groups become idle (see [`BlockPool::take_newly_idle`]).
    pub fn track_idle(&mut self) {
        self.newly_idle.start();
    }

    /// Hashes of the groups that became idle since the last call (some may have been evicted or re-acquired
    /// since), moved into `out`.
    pub fn take_newly_idle(&mut self, out: &mut Vec<u64>) {
        self.newly_idle.drain_into(out);
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks with ref count 0 and no cached content.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks of idle cached groups (on the LRU free queue).
    pub fn num_cached_free(&self) -> usize {
        self.cached_free_blocks
    }

    /// Blocks an allocation can obtain: free plus evictable.
    pub fn num_available(&self) -> usize {
        self.free.len() + self.cached_free_blocks
    }

    /// Blocks held by at least one sequence.
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_available()
    }

    /// The most blocks ever held at once since creation.
    pub fn peak_used(&self) -> usize {
        self.peak_used
    }

    /// Groups evicted from the LRU queue since creation.
    pub fn evicted_groups(&self) -> u64 {
        self.evicted_groups
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.refs.get(b as usize).copied().unwrap_or(0)
    }

    /// True when only one holder references `b` and no cached group owns it, so writing it affects no one else.
    pub fn is_exclusive(&self, b: BlockId) -> bool {
        let i = b as usize;
        i < self.refs.len() && self.refs[i] == 1 && self.group_of[i].is_none()
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// The cached group for `hash`, if present.
    pub fn lookup(&self, hash: u64) -> Option<&[BlockId]> {
        self.index.get(hash).map(|g| g.blocks())
    }

    /// Allocates `n` blocks with ref count 1, appending them to `out`. All or nothing.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<BlockId>) -> Result<(), CacheError> {
        if n > self.num_available() {
            return Err(CacheError::OutOfBlocks { needed: n, available: self.num_available() });
        }
        while self.free.len() < n {
            if !self.evict_one() {
                return Err(CacheError::OutOfBlocks { needed: n, available: self.num_available() });
            }
        }
        let start = self.free.len() - n;
        for &b in self.free[start..].iter().rev() {
            self.refs[b as usize] = 1;
            out.push(b);
        }
        self.free.truncate(start);
        self.peak_used = self.peak_used.max(self.num_used());
        Ok(())
    }

    /// Adds one reference to each block (sharing a cached prefix). Blocks must be in use or cached.
    pub fn acquire(&mut self, blocks: &[BlockId]) -> Result<(), CacheError> {
        for &b in blocks {
            let i = b as usize;
            if i >= self.refs.len() {
                return Err(CacheError::InvalidBlock(b));
            }
            if self.refs[i] == 0 && self.group_of[i].is_none() {
                return Err(CacheError::NotAllocated(b));
            }
        }
        for &b in blocks {
            let i = b as usize;
            if self.refs[i] == 0
                && let Some(h) = self.group_of[i]
                && let Some(g) = self.index.get_mut(h)
            {
                if let Some(tick) = g.lru_tick.take() {
                    self.lru.remove(&tick);
                    self.cached_free_blocks -= g.blocks.len();
                }
                g.idle -= 1;
            }
            self.refs[i] += 1;
        }
        self.peak_used = self.peak_used.max(self.num_used());
        Ok(())
    }

    /// Drops one reference from each block. Blocks reaching 0 go to the free list, or, when they belong to a
    /// cached group, count towards that group's idleness; a fully idle group joins the LRU queue.
    pub fn release(&mut self, blocks: &[BlockId]) -> Result<(), CacheError> {
        for &b in blocks {
            let i = b as usize;
            if i >= self.refs.len() {
                return Err(CacheError::InvalidBlock(b));
            }
            if self.refs[i] == 0 {
                return Err(CacheError::NotAllocated(b));
            }
        }
        for &b in blocks {
            let i = b as usize;
            self.refs[i] -= 1;
            if self.refs[i] > 0 {
                continue;
            }
            match self.group_of[i] {
                Some(h) => {
                    let Some(g) = self.index.get_mut(h) else { continue };
                    g.idle += 1;
                    if g.idle == g.blocks.len() {
                        self.tick += 1;
                        g.lru_tick = Some(self.tick);
                        self.lru.insert(self.tick, h);
                        self.cached_free_blocks += g.blocks.len();
                        self.newly_idle.record_with(|| h);
                    }
                }
                None => self.free.push(b),
            }
        }
        Ok(())
    }

    /// Registers `group` (held by the caller) under `hash`. Returns false, changing nothing, when the hash is
    /// already cached (another sequence computed the same prefix) or a block already belongs to a group.
    pub fn register(&mut self, hash: u64, group: &[BlockId]) -> bool {
        if group.is_empty() || self.index.contains(hash) {
            return false;
        }
        if group.iter().any(|&b| (b as usize) >= self.refs.len() || self.group_of[b as usize].is_some()) {
            return false;
        }
        let idle = group.iter().filter(|&&b| self.refs[b as usize] == 0).count();
        if idle > 0 {
            // Only blocks someone holds can be registered; a free block may be handed out at any time.
            return false;
        }
        for &b in group {
            self.group_of[b as usize] = Some(hash);
        }
        self.index.insert(hash, CachedGroup { blocks: group.into(), idle: 0, lru_tick: None, exact: true });
        self.index_changes.record_with(|| IndexChange::Registered(hash));
        true
    }

    /// Marks a registered group as a lossy copy of its prefix (see [`CachedGroup::is_exact`]). Returns false when
    /// `hash` is not cached.
    pub fn mark_inexact(&mut self, hash: u64) -> bool {
        self.index.get_mut(hash).map(|g| g.exact = false).is_some()
    }

    /// Evicts the idle group cached under `hash` (so that the next sequence over that prefix computes it). Returns
    /// false, changing nothing, when it is not cached or a sequence holds it.
    pub fn evict(&mut self, hash: u64) -> bool {
        let Some(tick) = self.index.get(hash).and_then(|g| g.lru_tick) else { return false };
        self.lru.remove(&tick);
        self.remove_idle_group(hash);
        true
    }

    /// Evicts the least recently freed idle group. Returns false when the LRU queue is empty.
    pub fn evict_one(&mut self) -> bool {
        let Some((_, hash)) = self.lru.pop_first() else { return false };
        self.remove_idle_group(hash);
        true
    }

    /// Frees the blocks of an idle group already taken off the LRU queue.
    fn remove_idle_group(&mut self, hash: u64) {
        if let Some(g) = self.index.remove(hash) {
            self.cached_free_blocks -= g.blocks.len();
            for &b in g.blocks.iter() {
                self.group_of[b as usize] = None;
                self.free.push(b);
            }
            self.evicted_groups += 1;
            self.index_changes.record_with(|| IndexChange::Evicted(hash));
        }
    }

    /// Drops every idle cached group (e.g. on a model or namespace reset).
    pub fn clear_cached(&mut self) {
        while self.evict_one() {}
    }

    /// Hashes of the idle groups, least recently freed first.
    pub fn lru_order(&self) -> Vec<u64> {
        self.lru.values().copied().collect()
    }

    /// Checks internal consistency; used by tests. Returns a description of the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut on_free = vec![false; self.refs.len()];
        for &b in &self.free {
            let i = b as usize;
            if on_free[i] {
                return Err(format!("block {b} twice on the free list"));
            }
            on_free[i] = true;
            if self.refs[i] != 0 || self.group_of[i].is_some() {
                return Err(format!("free block {b} has refs {} / group {:?}", self.refs[i], self.group_of[i]));
            }
        }
        let mut cached_free = 0;
        for (h, g) in self.index.iter() {
            let idle = g.blocks.iter().filter(|&&b| self.refs[b as usize] == 0).count();
            if idle != g.idle {
                return Err(format!("group {h:x}: idle {} but {idle} blocks at 0", g.idle));
            }
            if g.blocks.iter().any(|&b| self.group_of[b as usize] != Some(h)) {
                return Err(format!("group {h:x}: block not tagged with its group"));
            }
            match g.lru_tick {
                Some(t) => {
                    if idle != g.blocks.len() || self.lru.get(&t) != Some(&h) {
                        return Err(format!("group {h:x}: on LRU but not idle or not queued"));
                    }
                    cached_free += g.blocks.len();
                }
                None if idle == g.blocks.len() => return Err(format!("group {h:x}: idle but not on LRU")),
                None => {}
            }
        }
        if cached_free != self.cached_free_blocks
            || self.lru.len() != self.index.iter().filter(|g| g.1.is_idle()).count()
        {
            return Err("LRU accounting mismatch".into());
        }
        for (i, r) in self.refs.iter().enumerate() {
            if *r == 0 && self.group_of[i].is_none() && !on_free[i] {
                return Err(format!("block {i} leaked: ref 0, uncached, not free"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_counts_and_reuse() {
        let mut p = BlockPool::new(8);
        let mut a = Vec::new();
        p.allocate(5, &mut a).unwrap();
        assert_eq!(a, vec![0, 1, 2, 3, 4]);
        assert_eq!((p.num_used(), p.num_free()), (5, 3));
        assert_eq!(p.allocate(4, &mut Vec::new()), Err(CacheError::OutOfBlocks { needed: 4, available: 3 }));
        assert_eq!(p.num_used(), 5, "failed allocation must not leak");
        p.release(&a).unwrap();
        assert_eq!((p.num_used(), p.num_free()), (0, 8));
        assert_eq!(p.peak_used(), 5, "the high-water mark survives the release");
        let mut b = Vec::new();
        p.allocate(8, &mut b).unwrap();
        b.sort();
        assert_eq!(b, (0..8).collect::<Vec<_>>());
        assert_eq!(p.peak_used(), 8);
        assert_eq!(p.release(&[9]), Err(CacheError::InvalidBlock(9)));
        p.release(&b).unwrap();
        assert_eq!(p.release(&[0]), Err(CacheError::NotAllocated(0)));
        p.check_invariants().unwrap();
    }

    #[test]
    fn cached_groups_go_lru_and_are_evicted_only_when_needed() {
        let mut p = BlockPool::new(6);
        let mut g1 = Vec::new();
        p.allocate(2, &mut g1).unwrap();
        let mut g2 = Vec::new();
        p.allocate(2, &mut g2).unwrap();
        assert!(p.register(11, &g1));
        assert!(p.register(22, &g2));
        assert!(!p.register(11, &g2), "a hash is registered once");
        p.release(&g1).unwrap();
        p.release(&g2).unwrap();
        assert_eq!((p.num_free(), p.num_cached_free(), p.num_used()), (2, 4, 0));
        assert_eq!(p.lru_order(), vec![11, 22]);
        // Truly free blocks first: the cache survives a 2-block allocation.
        let mut x = Vec::new();
        p.allocate(2, &mut x).unwrap();
        assert_eq!(p.index().len(), 2);
        // Next allocation evicts the least recently freed group (11), not 22.
        let mut y = Vec::new();
        p.allocate(1, &mut y).unwrap();
        assert!(p.lookup(11).is_none());
        assert_eq!(p.lookup(22), Some(&g2[..]));
        assert!(g1.contains(&y[0]));
        assert_eq!(p.evicted_groups(), 1);
        p.check_invariants().unwrap();
    }

    #[test]
    fn a_lossy_group_is_marked_and_an_idle_group_is_evicted_by_hash() {
        let mut p = BlockPool::new(4);
        let (mut g1, mut g2) = (Vec::new(), Vec::new());
        p.allocate(2, &mut g1).unwrap();
        p.allocate(2, &mut g2).unwrap();
        assert!(p.register(11, &g1) && p.register(22, &g2));
        assert!(p.index().get(11).unwrap().is_exact(), "computed groups are exact");
        assert!(p.mark_inexact(22));
        assert!(!p.index().get(22).unwrap().is_exact());
        assert!(!p.mark_inexact(33), "an uncached hash");
        p.release(&g2).unwrap();
        assert!(!p.evict(11), "a held group stays");
        assert!(!p.evict(33), "an uncached hash changes nothing");
        assert!(p.evict(22));
        assert!(p.lookup(22).is_none());
        assert_eq!((p.num_free(), p.num_cached_free(), p.num_used()), (2, 0, 2));
        assert_eq!(p.evicted_groups(), 1);
        p.check_invariants().unwrap();
        p.release(&g1).unwrap();
        assert_eq!(p.lru_order(), vec![11]);
        p.check_invariants().unwrap();
    }

    #[test]
    fn lru_order_follows_release_and_touch() {
        let mut p = BlockPool::new(3);
        let groups: Vec<Vec<BlockId>> = (0..3)
            .map(|i| {
                let mut g = Vec::new();
                p.allocate(1, &mut g).unwrap();
                assert!(p.register(100 + i, &g));
                g
            })
            .collect();
        // Release in order 2, 0, 1.
        for i in [2usize, 0, 1] {
            p.release(&groups[i]).unwrap();
        }
        assert_eq!(p.lru_order(), vec![102, 100, 101]);
        // A prefix hit on 102 takes it off the queue; releasing it again makes it most recent.
        let hit = p.lookup(102).unwrap().to_vec();
        p.acquire(&hit).unwrap();
        assert_eq!(p.lru_order(), vec![100, 101]);
        assert_eq!(p.num_cached_free(), 2);
        p.release(&hit).unwrap();
        assert_eq!(p.lru_order(), vec![100, 101, 102]);
        // Evictions follow that order.
        let mut out = Vec::new();
        for expect_gone in [100u64, 101, 102] {
            p.allocate(1, &mut out).unwrap();
            assert!(p.lookup(expect_gone).is_none());
        }
        p.check_invariants().unwrap();
    }

    #[test]
    fn newly_idle_groups_are_reported_once_when_tracking() {
        let mut p = BlockPool::new(4);
        let mut g = Vec::new();
        p.allocate(2, &mut g).unwrap();
        assert!(p.register(5, &g));
        p.release(&g).unwrap();
        let mut out = Vec::new();
        p.take_newly_idle(&mut out);
        assert!(out.is_empty(), "off until track_idle");
        p.track_idle();
        p.acquire(&g).unwrap();
        p.release(&g).unwrap();
        let mut h = Vec::new();
        p.allocate(1, &mut h).unwrap();
        p.release(&h).unwrap();
        p.take_newly_idle(&mut out);
        assert_eq!(out, vec![5], "only registered groups, once per idle transition");
        out.clear();
        p.take_newly_idle(&mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn prefix_registrations_and_evictions_are_journaled_in_order() {
        let mut p = BlockPool::new(4);
        let mut g = Vec::new();
        p.allocate(2, &mut g).unwrap();
        assert!(p.register(1, &g));
        let mut out = Vec::new();
        p.take_index_changes(&mut out);
        assert!(out.is_empty(), "off until track_index_changes");
        p.track_index_changes();
        let mut h = Vec::new();
        p.allocate(2, &mut h).unwrap();
        assert!(p.register(2, &h));
        assert!(!p.register(2, &h), "a refused registration is no change");
        p.release(&g).unwrap();
        p.release(&h).unwrap();
        // Allocating the whole pool evicts both idle groups, least recently freed first.
        p.allocate(4, &mut Vec::new()).unwrap();
        p.take_index_changes(&mut out);
        assert_eq!(out, vec![IndexChange::Registered(2), IndexChange::Evicted(1), IndexChange::Evicted(2)]);
        out.clear();
        p.take_index_changes(&mut out);
        assert!(out.is_empty(), "taken once");
    }

    #[test]
    fn shared_refcounts() {
        let mut p = BlockPool::new(4);
        let mut g = Vec::new();
        p.allocate(2, &mut g).unwrap();
        assert!(p.register(7, &g));
        p.acquire(&g).unwrap();
        p.acquire(&g).unwrap();
        assert_eq!(p.ref_count(g[0]), 3);
        p.release(&g).unwrap();
        p.release(&g).unwrap();
        assert_eq!((p.num_used(), p.num_cached_free()), (2, 0));
        p.release(&g).unwrap();
        assert_eq!((p.num_used(), p.num_cached_free()), (0, 2));
        // Uncached, unheld blocks cannot be acquired.
        let free = p.free[0];
        assert_eq!(p.acquire(&[free]), Err(CacheError::NotAllocated(free)));
        p.check_invariants().unwrap();
    }
}
