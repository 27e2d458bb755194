//! [`TierStore`]: the host and disk stores plus the cost model, owned by the engine thread. It moves groups down
//! (device → host → disk) and answers where a hash lives and what loading it would cost.

use std::path::PathBuf;

use super::{CostModel, DiskStore, EncodedGroup, GroupCodec, HostStore, Tier, TierError, TierUsage};
use crate::events::BlockChange;

/// Which lower tiers to run. A capacity of 0 disables that tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierConfig {
    /// Root of the worker's persistent state; disk-tier files live under `<data_dir>/kv/`.
    pub data_dir: Option<PathBuf>,
    pub host_bytes: u64,
    pub disk_bytes: u64,
}

impl TierConfig {
    pub fn is_enabled(&self) -> bool {
        self.host_bytes > 0 || self.disk_bytes > 0
    }
}

/// Monotonic counters since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// Idle device groups copied down into host (or disk when there is no host tier).
    pub offloaded_groups: u64,
    /// Host LRU victims written to disk.
    pub demoted_groups: u64,
    /// Groups brought back into device blocks, per source tier ([`Tier::index`]; the device slot stays 0).
    pub onboarded_groups: [u64; 3],
    /// Disk writes or reads that failed with an I/O error (the group is then simply not kept).
    pub disk_errors: u64,
    /// Groups from peers refused on import: an unknown codec, or a length no group of this model has.
    pub refused_imports: u64,
    /// Groups dropped from the tiers because they failed to decode when onboarded.
    pub undecodable_groups: u64,
}

/// The shape every group of this model has: what an imported group's length is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupShape {
    /// Blocks per group (every (layer, kv-head) of one token block).
    pub n_blocks: usize,
    pub block_size: usize,
    pub head_dim: usize,
}

impl GroupShape {
    /// Parses `group`'s codec and checks that its length is exactly what that codec gives a group of this shape.
    /// Cheap (no decoding), so it runs on every import; what it cannot see (a corrupt header or scale inside a
    /// well-sized payload) is caught when the group is onboarded, which then drops it.
    pub fn check(&self, group: &EncodedGroup) -> Result<GroupCodec, TierError> {
        let codec: GroupCodec = group.codec.parse()?;
        let expected = codec.group_bytes(self.n_blocks, self.block_size, self.head_dim)?;
        if group.bytes.len() != expected {
            return Err(TierError::BadLength { codec: group.codec.clone(), expected, got: group.bytes.len() });
        }
        Ok(codec)
    }
}

#[derive(Debug)]
pub struct TierStore {
    host: Option<HostStore>,
    disk: Option<DiskStore>,
    cost: CostModel,
    counters: TierCounters,
}

impl TierStore {
    /// Opens the configured tiers (rebuilding the disk index). `max_group_bytes` bounds a disk read. Returns
    /// `None` when no lower tier is configured.
    pub fn open(cfg: &TierConfig, max_group_bytes: u64) -> Result<Option<TierStore>, TierError> {
        if !cfg.is_enabled() {
            return Ok(None);
        }
        let host = (cfg.host_bytes > 0).then(|| HostStore::new(cfg.host_bytes));
        let disk = if cfg.disk_bytes > 0 {
            let Some(root) = &cfg.data_dir else {
                return Err(TierError::Config("the disk tier needs a data dir (--data-dir)".into()));
            };
            Some(DiskStore::open(root.join("kv"), cfg.disk_bytes, max_group_bytes)?)
        } else {
            None
        };
        if let Some(d) = &disk {
            tracing::info!(dir = %d.dir().display(), groups = d.len(), bytes = d.used_bytes(),
                corrupted = d.corrupted(), "disk KV tier opened");
        }
        Ok(Some(TierStore { host, disk, cost: CostModel::default(), counters: TierCounters::default() }))
    }

    pub fn host(&self) -> Option<&HostStore> {
        self.host.as_ref()
    }

    pub fn disk(&self) -> Option<&DiskStore> {
        self.disk.as_ref()
    }

    pub fn cost(&self) -> &CostModel {
        &self.cost
    }

    pub fn cost_mut(&mut self) -> &mut CostModel {
        &mut self.cost
    }

    pub fn counters(&self) -> TierCounters {
        self.counters
    }

    /// Starts recording what enters and leaves the host and disk tiers (see [`TierStore::take_changes`]).
    pub fn track_changes(&mut self) {
        if let Some(h) = &mut self.host {
            h.track_changes();
        }
        if let Some(d) = &mut self.disk {
            d.track_changes();
        }
    }

    /// The host then the disk tier's changes since the last call (each tier in order; the two never share a key,
    /// which includes the tier), moved into `out`.
    pub fn take_changes(&mut self, out: &mut Vec<BlockChange>) {
        if let Some(h) = &mut self.host {
            h.take_changes(out);
        }
        if let Some(d) = &mut self.disk {
            d.take_changes(out);
        }
    }

    /// Every group held below the device, as `Stored` changes (a snapshot's lower-tier part).
    pub fn residency(&self, out: &mut Vec<BlockChange>) {
        let tiers = [
            (Tier::Host, self.host.as_ref().map(|h| h.iter().collect::<Vec<_>>())),
            (Tier::Disk, self.disk.as_ref().map(|d| d.iter().collect::<Vec<_>>())),
        ];
        for (tier, groups) in tiers {
            for (hash, codec, bytes) in groups.into_iter().flatten() {
                out.push(BlockChange::Stored { hash, tier, codec: codec.to_owned().into(), bytes });
            }
        }
    }

    /// Corrupt disk files found since start.
    pub fn disk_corrupted(&self) -> u64 {
        self.disk.as_ref().map_or(0, DiskStore::corrupted)
    }

    /// Disk writes that found the file system full, since start.
    pub fn disk_full_events(&self) -> u64 {
        self.disk.as_ref().map_or(0, DiskStore::full_events)
    }

    /// The fastest lower tier holding `hash`, and the bytes a load would move.
    pub fn locate(&self, hash: u64) -> Option<(Tier, u64)> {
        if let Some(n) = self.host.as_ref().and_then(|h| h.size_of(hash)) {
            return Some((Tier::Host, n));
        }
        self.disk.as_ref().and_then(|d| d.size_of(hash)).map(|n| (Tier::Disk, n))
    }

    /// Codec of the group under `hash` in the fastest lower tier holding it.
    pub fn codec_of(&self, hash: u64) -> Option<&str> {
        if let Some(c) = self.host.as_ref().and_then(|h| h.codec_of(hash)) {
            return Some(c);
        }
        self.disk.as_ref().and_then(|d| d.codec_of(hash))
    }

    /// True when some lower tier holds `hash`; marks it recently used there.
    pub fn touch(&mut self, hash: u64) -> bool {
        self.host.as_mut().is_some_and(|h| h.touch(hash)) || self.disk.as_mut().is_some_and(|d| d.touch(hash))
    }

    /// Stores a group that is leaving (or may leave) the device: into host, whose LRU victims go to disk; straight
    /// to disk without a host tier.
    pub fn offload(&mut self, hash: u64, group: EncodedGroup) {
        self.counters.offloaded_groups += 1;
        let victims = match &mut self.host {
            Some(h) => h.put(hash, group),
            None => vec![(hash, group)],
        };
        for (h, g) in victims {
            self.demote(h, &g);
        }
    }

    /// Stores a group that arrived from another worker into the host tier (its LRU victims go to disk). Returns
    /// whether a lower tier holds it afterwards; without a host tier nothing is stored. A group that does not fit
    /// `shape` (unknown codec, wrong length) is refused and counted: the peer's checksum only proves the bytes
    /// arrived as sent, and a group kept here is onboarded, served to other peers and reported to the kvstore.
    pub fn import(&mut self, hash: u64, group: EncodedGroup, shape: GroupShape) -> bool {
        let Some(h) = &mut self.host else { return false };
        if let Err(e) = shape.check(&group) {
            self.counters.refused_imports += 1;
            tracing::warn!(hash, error = %e, "refusing a KV group from a peer");
            return false;
        }
        for (h, g) in h.put(hash, group) {
            self.demote(h, &g);
        }
        self.locate(hash).is_some()
    }

    fn demote(&mut self, hash: u64, group: &EncodedGroup) {
        let Some(d) = &mut self.disk else { return };
        match d.put(hash, group) {
            Ok(true) => self.counters.demoted_groups += 1,
            Ok(false) => {}
            Err(e) => {
                self.counters.disk_errors += 1;
                tracing::warn!(error = %e, "writing a KV group to disk failed; it is dropped");
            }
        }
    }

    /// Runs `f` on the group under `hash` in `tier` (host: borrowed in place; disk: read and verified). `None`
    /// when it is not there (any more) or the file was corrupt: the caller recomputes.
    pub fn with_group<R>(&mut self, hash: u64, tier: Tier, f: impl FnOnce(&EncodedGroup) -> R) -> Option<R> {
        match tier {
            Tier::Device => None,
            Tier::Host => self.host.as_mut()?.get(hash).map(f),
            Tier::Disk => match self.disk.as_mut()?.get(hash) {
                Ok(g) => g.as_ref().map(f),
                Err(e) => {
                    self.counters.disk_errors += 1;
                    tracing::warn!(error = %e, "reading a KV group from disk failed");
                    None
                }
            },
        }
    }

    /// Stores `group` under `hash` in exactly `tier` (placement decided elsewhere, e.g. by EvicPress), replacing
    /// what that tier held under `hash`. Returns false when the tier is not configured or refused the group (too
    /// large, or a disk error, which is counted).
    pub fn place(&mut self, tier: Tier, hash: u64, group: EncodedGroup) -> bool {
        match tier {
            Tier::Device => false,
            Tier::Host => {
                let Some(h) = &mut self.host else { return false };
                let victims = h.put(hash, group);
                // The planner keeps the host tier within capacity, so victims are rare (its size estimate is an
                // upper bound); they are demoted like LRU victims rather than lost.
                let refused = victims.iter().any(|(v, _)| *v == hash);
                for (v, g) in victims {
                    self.demote(v, &g);
                }
                !refused
            }
            Tier::Disk => {
                let Some(d) = &mut self.disk else { return false };
                if let Err(e) = d.remove(hash) {
                    self.counters.disk_errors += 1;
                    tracing::warn!(error = %e, "removing a replaced KV group from disk failed");
                }
                match d.put(hash, &group) {
                    Ok(ok) => ok,
                    Err(e) => {
                        self.counters.disk_errors += 1;
                        tracing::warn!(error = %e, "writing a KV group to disk failed; it is dropped");
                        false
                    }
                }
            }
        }
    }

    /// Drops the group under `hash` after it failed to decode when onboarded (corrupt bytes that passed the
    /// checks on the way in), so that it is recomputed and rewritten instead of being onboarded, served to peers
    /// and reported again. Counted; the removal is reported like any other.
    pub fn drop_undecodable(&mut self, hash: u64) {
        self.counters.undecodable_groups += 1;
        self.remove(hash);
    }

    /// Removes `hash` from every lower tier.
    pub fn remove(&mut self, hash: u64) {
        if let Some(h) = &mut self.host {
            h.remove(hash);
        }
        if let Some(d) = &mut self.disk
            && let Err(e) = d.remove(hash)
        {
            self.counters.disk_errors += 1;
            tracing::warn!(error = %e, "removing a KV group from disk failed");
        }
    }

    /// A copy of the group under `hash` from the fastest tier holding it (disk reads are verified).
    pub fn read(&mut self, hash: u64) -> Option<(Tier, EncodedGroup)> {
        let (tier, _) = self.locate(hash)?;
        self.with_group(hash, tier, |g| (tier, g.clone()))
    }

    /// Bytes free in `tier` (0 when it is not configured).
    pub fn free_bytes(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Device => 0,
            Tier::Host => self.host.as_ref().map_or(0, |h| h.capacity_bytes() - h.used_bytes()),
            Tier::Disk => self.disk.as_ref().map_or(0, |d| d.capacity_bytes().saturating_sub(d.used_bytes())),
        }
    }

    /// Records that a group from `tier` was onboarded.
    pub fn count_onboard(&mut self, tier: Tier) {
        self.counters.onboarded_groups[tier.index()] += 1;
    }

    /// Moves everything in host down to disk (graceful shutdown: host RAM does not survive a restart).
    pub fn spill_host(&mut self) {
        let Some(h) = &mut self.host else { return };
        for (hash, g) in h.drain_lru() {
            self.demote(hash, &g);
        }
    }

    /// Appends the used and capacity bytes per lower tier and codec to `out` (the engine's stats, rebuilt every
    /// step in place). A tier that holds nothing reports one row with an empty codec so its capacity is still visible.
    pub fn usage_into(&self, out: &mut Vec<TierUsage>) {
        if let Some(h) = &self.host {
            let before = out.len();
            for (codec, used) in h.used_by_codec() {
                out.push(TierUsage {
                    tier: Tier::Host,
                    codec: codec.to_owned().into(),
                    used_bytes: used,
                    capacity_bytes: h.capacity_bytes(),
                });
            }
            if out.len() == before {
                out.push(TierUsage {
                    tier: Tier::Host,
                    codec: "".into(),
                    used_bytes: 0,
                    capacity_bytes: h.capacity_bytes(),
                });
            }
        }
        if let Some(d) = &self.disk {
            let by = d.used_by_codec();
            if by.is_empty() {
                out.push(TierUsage {
                    tier: Tier::Disk,
                    codec: "".into(),
                    used_bytes: 0,
                    capacity_bytes: d.capacity_bytes(),
                });
            }
            for (codec, used) in by {
                out.push(TierUsage {
                    tier: Tier::Disk,
                    codec: codec.into(),
                    used_bytes: used,
                    capacity_bytes: d.capacity_bytes(),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Groups of 2 blocks of 4 slots × 3 elements: 192 bytes native f32, 96 bytes f16.
    const SHAPE: GroupShape = GroupShape { n_blocks: 2, block_size: 4, head_dim: 3 };

    #[test]
    fn imported_groups_land_in_host_and_are_reported() {
        let cfg = TierConfig { data_dir: None, host_bytes: 250, disk_bytes: 0 };
        let mut t = TierStore::open(&cfg, 1 << 20).unwrap().unwrap();
        t.track_changes();
        assert!(t.import(7, g(192, 7), SHAPE));
        assert_eq!(t.locate(7), Some((Tier::Host, 192)));
        assert_eq!(t.counters().offloaded_groups, 0, "a pulled group is not an offload");
        let mut changes = Vec::new();
        t.take_changes(&mut changes);
        assert!(changes.iter().any(|c| matches!(c, BlockChange::Stored { hash: 7, tier: Tier::Host, .. })));
        // Larger than the whole host tier, with no disk below: not kept.
        let big = GroupShape { n_blocks: 4, ..SHAPE };
        assert!(!t.import(8, g(384, 8), big));
        assert_eq!(t.counters().refused_imports, 0, "a valid group that does not fit is no refusal");
        // Without a host tier nothing is imported.
        let dir = std::env::temp_dir().join(format!("pagoda-tierstore-import-{}", std::process::id()));
        let disk_only = TierConfig { data_dir: Some(dir.clone()), host_bytes: 0, disk_bytes: 1 << 20 };
        let mut t = TierStore::open(&disk_only, 1 << 20).unwrap().unwrap();
        assert!(!t.import(7, g(192, 7), SHAPE));
        assert_eq!(t.locate(7), None);
        drop(t);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn imports_of_unknown_codecs_or_wrong_lengths_are_refused() {
        let cfg = TierConfig { data_dir: None, host_bytes: 1 << 20, disk_bytes: 0 };
        let mut t = TierStore::open(&cfg, 1 << 20).unwrap().unwrap();
        t.track_changes();
        let bad = [
            ("zstd", 192),
            ("", 192),
            ("native", 100),
            ("native", 191),
            ("f16", 192),
            ("f32", 0),
            ("native-int8", 192),
            ("int4_kivi+int8@1/2", 192),
        ];
        for (i, (codec, n)) in bad.into_iter().enumerate() {
            let hash = 100 + i as u64;
            let group = EncodedGroup { codec: codec.into(), bytes: vec![1; n] };
            assert!(!t.import(hash, group, SHAPE), "{codec} of {n} bytes accepted");
            assert_eq!(t.locate(hash), None);
        }
        assert_eq!(t.counters().refused_imports, bad.len() as u64);
        let mut changes = Vec::new();
        t.take_changes(&mut changes);
        assert!(changes.is_empty(), "nothing refused is reported: {changes:?}");
        // The exact length of each native width is accepted.
        assert!(t.import(1, EncodedGroup { codec: "f16".into(), bytes: vec![0; 96] }, SHAPE));
        assert!(t.import(2, EncodedGroup { codec: "f32".into(), bytes: vec![0; 192] }, SHAPE));
        assert_eq!(t.counters().refused_imports, bad.len() as u64);
    }

    #[test]
    fn an_undecodable_group_is_dropped_from_every_tier_and_reported() {
        let dir = std::env::temp_dir().join(format!("pagoda-tierstore-undecodable-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = TierConfig { data_dir: Some(dir.clone()), host_bytes: 1 << 20, disk_bytes: 1 << 20 };
        let mut t = TierStore::open(&cfg, 1 << 20).unwrap().unwrap();
        t.track_changes();
        assert!(t.import(5, g(192, 5), SHAPE));
        t.spill_host();
        assert!(t.import(5, g(192, 5), SHAPE));
        let mut changes = Vec::new();
        t.take_changes(&mut changes);
        t.drop_undecodable(5);
        assert_eq!(t.locate(5), None);
        assert_eq!(t.counters().undecodable_groups, 1);
        changes.clear();
        t.take_changes(&mut changes);
        for tier in [Tier::Host, Tier::Disk] {
            let removed = BlockChange::Removed { hash: 5, tier, codec: "native".into() };
            assert!(changes.contains(&removed), "{tier:?}: {changes:?}");
        }
        drop(t);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn g(n: usize, seed: u8) -> EncodedGroup {
        EncodedGroup { codec: "native".into(), bytes: vec![seed; n] }
    }

    #[test]
    fn groups_flow_down_and_are_found_where_they_are() {
        let dir = std::env::temp_dir().join(format!("pagoda-tierstore-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = TierConfig { data_dir: Some(dir.clone()), host_bytes: 250, disk_bytes: 1 << 20 };
        let mut t = TierStore::open(&cfg, 1 << 20).unwrap().unwrap();
        for h in 1..=3u64 {
            t.offload(h, g(100, h as u8));
        }
        // Host holds 2 groups of 100 bytes; the oldest went to disk.
        assert_eq!(t.locate(1).map(|l| l.0), Some(Tier::Disk));
        assert_eq!(t.locate(3), Some((Tier::Host, 100)));
        assert_eq!(t.with_group(1, Tier::Disk, |g| g.bytes[0]), Some(1));
        assert_eq!(t.with_group(3, Tier::Host, |g| g.bytes[0]), Some(3));
        assert_eq!(t.with_group(3, Tier::Disk, |_| ()), None);
        assert_eq!(t.counters().demoted_groups, 1);
        let mut usage = Vec::new();
        t.usage_into(&mut usage);
        assert_eq!(usage.len(), 2);
        assert_eq!((usage[0].tier, usage[0].used_bytes, usage[0].capacity_bytes), (Tier::Host, 200, 250));
        assert_eq!(usage[1].tier, Tier::Disk);
        // Shutdown spills host: everything is on disk for the next start.
        t.spill_host();
        drop(t);
        let t = TierStore::open(&cfg, 1 << 20).unwrap().unwrap();
        assert!((1..=3).all(|h| t.locate(h).map(|l| l.0) == Some(Tier::Disk)));
        // One store per directory: this one goes before the next opens.
        drop(t);
        // Tracked changes: a store into host and the demotion of its victim to disk.
        let mut t = TierStore::open(&cfg, 1 << 20).unwrap().unwrap();
        t.track_changes();
        t.offload(10, g(200, 10));
        let mut changes = Vec::new();
        t.take_changes(&mut changes);
        let removed_from_host = BlockChange::Removed { hash: 10, tier: Tier::Host, codec: "native".into() };
        assert!(!changes.contains(&removed_from_host), "nothing left host yet: {changes:?}");
        assert!(changes.contains(&BlockChange::Stored {
            hash: 10,
            tier: Tier::Host,
            codec: "native".into(),
            bytes: 200
        }));
        t.offload(11, g(200, 11));
        changes.clear();
        t.take_changes(&mut changes);
        assert!(changes.contains(&removed_from_host), "{changes:?}");
        assert!(changes.iter().any(|c| matches!(c, BlockChange::Stored { hash: 10, tier: Tier::Disk, .. })));
        let mut all = Vec::new();
        t.residency(&mut all);
        assert!(all.iter().any(|c| matches!(c, BlockChange::Stored { hash: 11, tier: Tier::Host, .. })));
        drop(t);
        // The disk tier without a data dir is a config error; no tiers at all is None.
        let bad = TierConfig { data_dir: None, host_bytes: 0, disk_bytes: 10 };
        assert!(matches!(TierStore::open(&bad, 1), Err(TierError::Config(_))));
        assert!(TierStore::open(&TierConfig::default(), 1).unwrap().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
