//! The host tier: a bounded RAM pool of encoded block groups keyed by chain hash, LRU by last use, capacity in
//! bytes. A plain struct owned by [`TierStore`](super::TierStore) on the engine thread; what it evicts is handed
//! back to the caller (to be demoted to disk), never silently dropped here.

use std::collections::{BTreeMap, HashMap};

use super::{EncodedGroup, Tier};
use crate::events::BlockChange;
use crate::journal::Journal;

#[derive(Debug)]
struct Entry {
    group: EncodedGroup,
    tick: u64,
}

#[derive(Debug)]
pub struct HostStore {
    capacity: u64,
    used: u64,
    map: HashMap<u64, Entry>,
    /// tick → hash; the smallest tick is the least recently used.
    lru: BTreeMap<u64, u64>,
    tick: u64,
    used_by_codec: BTreeMap<String, u64>,
    /// Stores and removals since the last [`HostStore::take_changes`], when tracking is on.
    changes: Journal<BlockChange>,
}

impl HostStore {
    pub fn new(capacity_bytes: u64) -> HostStore {
        HostStore {
            capacity: capacity_bytes,
            used: 0,
            map: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            used_by_codec: BTreeMap::new(),
            changes: Journal::default(),
        }
    }

    /// Starts recording stores and removals (see [`HostStore::take_changes`]).
    pub fn track_changes(&mut self) {
        self.changes.start();
    }

    /// The stores and removals since the last call, in order, moved into `out`.
    pub fn take_changes(&mut self, out: &mut Vec<BlockChange>) {
        self.changes.drain_into(out);
    }

    /// Every group held: hash, codec, encoded bytes.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &str, u64)> {
        self.map.iter().map(|(h, e)| (*h, e.group.codec.as_str(), e.group.len()))
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity
    }

    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes held per codec (codecs holding nothing are left out).
    pub fn used_by_codec(&self) -> impl Iterator<Item = (&str, u64)> {
        self.used_by_codec.iter().filter(|e| *e.1 > 0).map(|(c, b)| (c.as_str(), *b))
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.map.contains_key(&hash)
    }

    /// Encoded size of the group stored under `hash`.
    pub fn size_of(&self, hash: u64) -> Option<u64> {
        self.map.get(&hash).map(|e| e.group.len())
    }

    /// Codec of the group stored under `hash`.
    pub fn codec_of(&self, hash: u64) -> Option<&str> {
        self.map.get(&hash).map(|e| e.group.codec.as_str())
    }

    /// The group under `hash`, marked most recently used.
    pub fn get(&mut self, hash: u64) -> Option<&EncodedGroup> {
        self.touch(hash);
        self.map.get(&hash).map(|e| &e.group)
    }

    /// Marks `hash` most recently used. Returns false when absent.
    pub fn touch(&mut self, hash: u64) -> bool {
        let Some(e) = self.map.get_mut(&hash) else { return false };
        self.lru.remove(&e.tick);
        self.tick += 1;
        e.tick = self.tick;
        self.lru.insert(self.tick, hash);
        true
    }

    /// Stores `group` under `hash` as most recently used, evicting least recently used groups until it fits.
    /// Returns the evicted groups, oldest first; a group larger than the whole capacity comes straight back.
    /// Storing a hash that is present replaces its bytes.
    pub fn put(&mut self, hash: u64, group: EncodedGroup) -> Vec<(u64, EncodedGroup)> {
        let mut evicted = Vec::new();
        if group.len() > self.capacity {
            evicted.push((hash, group));
            return evicted;
        }
        self.remove(hash);
        while self.used + group.len() > self.capacity {
            let Some((_, victim)) = self.lru.pop_first() else { break };
            if let Some(g) = self.take(victim) {
                evicted.push((victim, g));
            }
        }
        self.used += group.len();
        *self.used_by_codec.entry(group.codec.clone()).or_default() += group.len();
        self.tick += 1;
        self.lru.insert(self.tick, hash);
        self.changes.record_with(|| BlockChange::Stored {
            hash,
            tier: Tier::Host,
            codec: group.codec.clone().into(),
            bytes: group.len(),
        });
        self.map.insert(hash, Entry { group, tick: self.tick });
        evicted
    }

    /// Removes and returns the group under `hash`.
    pub fn remove(&mut self, hash: u64) -> Option<EncodedGroup> {
        let tick = self.map.get(&hash)?.tick;
        self.lru.remove(&tick);
        self.take(hash)
    }

    /// Removes every group, least recently used first (for spilling to disk on shutdown).
    pub fn drain_lru(&mut self) -> Vec<(u64, EncodedGroup)> {
        let order: Vec<u64> = std::mem::take(&mut self.lru).into_values().collect();
        order.into_iter().filter_map(|h| self.take(h).map(|g| (h, g))).collect()
    }

    /// Drops `hash` from the map and the byte counts; the LRU entry is the caller's business.
    fn take(&mut self, hash: u64) -> Option<EncodedGroup> {
        let e = self.map.remove(&hash)?;
        self.used -= e.group.len();
        if let Some(c) = self.used_by_codec.get_mut(&e.group.codec) {
            *c -= e.group.len();
        }
        self.changes.record_with(|| BlockChange::Removed {
            hash,
            tier: Tier::Host,
            codec: e.group.codec.clone().into(),
        });
        Some(e.group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(n: usize, codec: &str) -> EncodedGroup {
        EncodedGroup { codec: codec.into(), bytes: vec![n as u8; n] }
    }

    #[test]
    fn capacity_is_enforced_in_lru_order() {
        let mut h = HostStore::new(100);
        assert!(h.put(1, g(40, "native")).is_empty());
        assert!(h.put(2, g(40, "native")).is_empty());
        assert_eq!(h.used_bytes(), 80);
        // Touch 1: 2 becomes the oldest.
        assert!(h.get(1).is_some());
        let ev = h.put(3, g(30, "int8"));
        assert_eq!(ev.iter().map(|e| e.0).collect::<Vec<_>>(), vec![2]);
        assert_eq!(ev[0].1, g(40, "native"));
        assert_eq!(h.used_bytes(), 70);
        assert_eq!(h.used_by_codec().collect::<Vec<_>>(), vec![("int8", 30), ("native", 40)]);
        // Two more evictions for a big one: 1 (older) then 3.
        let ev = h.put(4, g(100, "native"));
        assert_eq!(ev.iter().map(|e| e.0).collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!((h.len(), h.used_bytes()), (1, 100));
        assert_eq!(h.used_by_codec().collect::<Vec<_>>(), vec![("native", 100)]);
        // Too big for the tier at all: handed straight back, nothing else disturbed.
        let ev = h.put(5, g(101, "native"));
        assert_eq!(ev.iter().map(|e| e.0).collect::<Vec<_>>(), vec![5]);
        assert!(h.contains(4) && !h.contains(5));
    }

    #[test]
    fn replace_remove_and_drain() {
        let mut h = HostStore::new(100);
        h.put(1, g(10, "native"));
        h.put(2, g(20, "native"));
        h.put(1, g(30, "native"));
        assert_eq!((h.len(), h.used_bytes()), (2, 50));
        assert_eq!(h.size_of(1), Some(30));
        // 1 was re-put last, so 2 is the oldest.
        assert_eq!(h.drain_lru().iter().map(|e| e.0).collect::<Vec<_>>(), vec![2, 1]);
        assert_eq!((h.len(), h.used_bytes()), (0, 0));
        h.put(7, g(5, "native"));
        assert_eq!(h.remove(7), Some(g(5, "native")));
        assert_eq!(h.remove(7), None);
        assert!(!h.touch(7));
        assert_eq!(h.used_bytes(), 0);
        // A zero-capacity store keeps nothing.
        let mut z = HostStore::new(0);
        assert_eq!(z.put(1, g(1, "native")).len(), 1);
        assert!(z.is_empty());
    }
}
