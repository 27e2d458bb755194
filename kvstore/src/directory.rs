//! The block directory: which worker holds which KV block, in which tier and codec.
//!
//! This is the replicated state machine that the kvstore serves (DESIGN §6). It owns two maps: block hash →
//! residencies, and the [`WorkerTable`] (worker id → worker record). Workers send batches of block events stamped
//! with their epoch and a per-worker monotonic sequence number; the directory applies each event at most once,
//! ignores replays, and reports a gap (so the kvstore can ask that worker for a full snapshot) instead of guessing.
//! It is a plain struct with one owner: replication (raft) and transport live elsewhere and only call
//! [`BlockDirectory::apply`].
//!
//! The [`WorkerTable`] alone decides which events of a batch are fresh. A watcher that keeps its own bounded view of
//! the blocks (the router's residency index) runs the same table over the same commands, so it takes the same events
//! as fresh. What it then keeps is its own: the directory's copy caps ([`MAX_COPIES_PER_WORKER`], [`MAX_COPY_BYTES`],
//! [`MAX_COPIES_PER_BLOCK_PER_WORKER`]) bound the replicated state and its snapshots, and the router's index has its
//! own bound by hashes, so a copy past a directory cap can still be a placement hint in a router until a snapshot
//! replaces its view.

use std::collections::{BTreeMap, HashMap, HashSet};

use thiserror::Error;

/// A chain hash of one full block of tokens (DESIGN §2).
pub type BlockHash = u64;

/// Workers the table holds. Registration past it is refused, so a caller that registers under ever new names
/// cannot grow every replica's table (and every snapshot) without bound.
pub const MAX_WORKERS: usize = 1024;
/// Block copies the directory keeps for one worker: as many as one worker snapshot may list. A `Stored` past it is
/// counted as applied (the sequence moves on) but not kept: the directory is a placement hint, and a worker that
/// claims more copies than it could ever snapshot is not one to route by.
pub const MAX_COPIES_PER_WORKER: u64 = crate::machine::MAX_SNAPSHOT_BLOCKS as u64;
/// Snapshot bytes the whole directory's copies may take, each charged [`copy_cost`]: what one directory snapshot
/// can carry (see [`crate::machine::MAX_DIRECTORY_COPY_BUDGET_BYTES`]). Past it a `Stored` is counted as applied but
/// not kept, as past [`MAX_COPIES_PER_WORKER`]; every replica applies the same log to the same sum, so all keep the
/// same copies.
pub const MAX_COPY_BYTES: u64 = crate::machine::MAX_DIRECTORY_COPY_BUDGET_BYTES as u64;

/// What a copy held by `worker` in `codec` is charged against [`MAX_COPY_BYTES`].
fn copy_cost(worker: &str, codec: &str) -> u64 {
    crate::machine::directory_copy_bytes(worker.len(), codec.len()) as u64
}
/// Copies of one block on one worker (tier × codec). Three tiers under a few codecs each is what a worker holds;
/// the bound keeps one block's copy list, which every `Stored` of that block searches, short.
pub const MAX_COPIES_PER_BLOCK_PER_WORKER: usize = 16;

/// A worker's identity in the directory.
pub type WorkerId = String;

/// Where a block copy lives on a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Device,
    Host,
    Disk,
}

/// One copy of a block on one worker.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Residency {
    pub worker: WorkerId,
    pub tier: Tier,
    /// Codec name (`f32`, `f16`, `int8`, ...); part of the identity: two codecs are two copies.
    pub codec: String,
    pub bytes: u64,
}

/// What happened to one block on a worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockEvent {
    Stored {
        hash: BlockHash,
        tier: Tier,
        codec: String,
        bytes: u64,
    },
    Removed {
        hash: BlockHash,
        tier: Tier,
        codec: String,
    },
    /// The worker dropped everything (restart without a durable tier, or an explicit clear).
    Cleared,
}

/// A batch of events from one worker: events carry sequence numbers `first_seq, first_seq + 1, ...`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventBatch {
    pub worker: WorkerId,
    pub epoch: u64,
    pub first_seq: u64,
    pub events: Vec<BlockEvent>,
    /// The worker's occupancy when it sent the batch (a batch without events is a heartbeat).
    pub load: Option<WorkerLoad>,
}

/// Bytes a worker holds in one tier under one codec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierOccupancy {
    pub tier: Tier,
    pub codec: String,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
}

/// A worker's occupancy report: bytes per tier and codec, its scheduler's queues, its free device blocks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerLoad {
    pub occupancy: Vec<TierOccupancy>,
    pub running: u32,
    pub waiting: u32,
    pub free_blocks: u64,
    pub total_blocks: u64,
    /// The worker's wall clock at the report (unix ms), as the worker stamped it.
    pub reported_at_ms: u64,
}

/// The directory's record of a worker.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerRecord {
    pub address: String,
    pub epoch: u64,
    /// The last sequence number applied in `epoch` (0 = none yet; sequences start at 1).
    pub applied_seq: u64,
    pub blocks: u64,
    /// The latest occupancy report.
    pub load: Option<WorkerLoad>,
}

/// Which events of a batch are new: `batch.events[skipped..]`, or none because of a gap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admitted {
    pub outcome: ApplyOutcome,
    /// Events at the front of the batch that were replays (all of them on a gap: nothing is applied).
    pub skipped: usize,
}

/// What registering did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registration {
    /// A new worker, or a new epoch of a known one: every residency it had is gone.
    NewEpoch,
    /// The same epoch again (a retried Register): only the address may change.
    SameEpoch,
}

/// Worker id → record: epochs, sequence numbers and occupancy. The one place that decides what a batch applies.
#[derive(Clone, Debug, Default)]
pub struct WorkerTable {
    workers: BTreeMap<WorkerId, WorkerRecord>,
}

impl WorkerTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a worker or a new epoch of it (sequence numbering restarts); refuses an older epoch.
    pub fn register(&mut self, worker: &str, address: &str, epoch: u64) -> Result<Registration, DirectoryError> {
        if let Some(record) = self.workers.get_mut(worker) {
            if epoch < record.epoch {
                return Err(DirectoryError::StaleEpoch {
                    worker: worker.to_string(),
                    got: epoch,
                    current: record.epoch,
                });
            }
            if epoch == record.epoch {
                record.address = address.to_string();
                return Ok(Registration::SameEpoch);
            }
        } else if self.workers.len() >= MAX_WORKERS {
            return Err(DirectoryError::TooManyWorkers { worker: worker.to_string(), max: MAX_WORKERS });
        }
        self.workers.insert(
            worker.to_string(),
            WorkerRecord { address: address.to_string(), epoch, applied_seq: 0, blocks: 0, load: None },
        );
        Ok(Registration::NewEpoch)
    }

    pub fn remove(&mut self, worker: &str) -> bool {
        self.workers.remove(worker).is_some()
    }

    /// Decides which events of `batch` are fresh and advances the worker's sequence past them. The batch's load
    /// report is taken unless the whole batch is a replay (a retried send must not roll the report back).
    pub fn admit(&mut self, batch: &EventBatch) -> Result<Admitted, DirectoryError> {
        let record =
            self.workers.get_mut(&batch.worker).ok_or_else(|| DirectoryError::UnknownWorker(batch.worker.clone()))?;
        if batch.epoch != record.epoch {
            return Err(DirectoryError::StaleEpoch {
                worker: batch.worker.clone(),
                got: batch.epoch,
                current: record.epoch,
            });
        }
        if batch.first_seq == 0 {
            return Err(DirectoryError::ZeroSequence(batch.worker.clone()));
        }
        // A snapshot may have put the worker at the last sequence number; what follows it cannot be numbered.
        let exhausted = || DirectoryError::SequenceExhausted(batch.worker.clone());
        let expected = record.applied_seq.checked_add(1).ok_or_else(exhausted)?;
        if batch.first_seq > expected {
            return Ok(Admitted {
                outcome: ApplyOutcome::Gap { expected, got: batch.first_seq },
                skipped: batch.events.len(),
            });
        }
        let skipped = usize::try_from(expected - batch.first_seq)
            .map_or(batch.events.len(), |already| already.min(batch.events.len()));
        let applied = batch.events.len() - skipped;
        record.applied_seq = record.applied_seq.checked_add(applied as u64).ok_or_else(exhausted)?;
        // The batch is at the worker's frontier when it brings new events, or is a heartbeat at the next number;
        // a batch of replays only is an old send retried.
        let at_frontier = applied > 0 || (batch.events.is_empty() && batch.first_seq == expected);
        if at_frontier && let Some(load) = &batch.load {
            record.load = Some(load.clone());
        }
        Ok(Admitted { outcome: ApplyOutcome::Applied { applied, skipped }, skipped })
    }

    /// A full snapshot of the worker at `seq` replaces its sequence position (and its load, when reported).
    pub fn snapshot(
        &mut self,
        worker: &str,
        epoch: u64,
        seq: u64,
        load: Option<&WorkerLoad>,
    ) -> Result<(), DirectoryError> {
        let record = self.workers.get_mut(worker).ok_or_else(|| DirectoryError::UnknownWorker(worker.to_string()))?;
        if epoch != record.epoch {
            return Err(DirectoryError::StaleEpoch { worker: worker.to_string(), got: epoch, current: record.epoch });
        }
        record.applied_seq = seq;
        if let Some(load) = load {
            record.load = Some(load.clone());
        }
        Ok(())
    }

    pub fn get(&self, worker: &str) -> Option<&WorkerRecord> {
        self.workers.get(worker)
    }

    pub fn contains(&self, worker: &str) -> bool {
        self.workers.contains_key(worker)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&WorkerId, &WorkerRecord)> {
        self.workers.iter()
    }

    pub fn len(&self) -> usize {
        self.workers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    fn get_mut(&mut self, worker: &str) -> Option<&mut WorkerRecord> {
        self.workers.get_mut(worker)
    }
}

impl FromIterator<(WorkerId, WorkerRecord)> for WorkerTable {
    fn from_iter<I: IntoIterator<Item = (WorkerId, WorkerRecord)>>(iter: I) -> Self {
        Self { workers: iter.into_iter().collect() }
    }
}

/// What applying a batch did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// `applied` new events; `skipped` were replays of already-applied sequence numbers.
    Applied { applied: usize, skipped: usize },
    /// The batch starts after the next expected sequence number: events were lost in between. Nothing was applied;
    /// the worker must send a snapshot.
    Gap { expected: u64, got: u64 },
}

/// Errors from directory operations.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DirectoryError {
    #[error("worker {0:?} is not registered")]
    UnknownWorker(WorkerId),
    #[error("batch from worker {worker:?} has stale epoch {got} (current {current})")]
    StaleEpoch { worker: WorkerId, got: u64, current: u64 },
    #[error("sequence numbers start at 1; got first_seq 0 from worker {0:?}")]
    ZeroSequence(WorkerId),
    #[error("worker {0:?} has used up the sequence numbers of its epoch; it must register a new epoch")]
    SequenceExhausted(WorkerId),
    #[error("cannot register worker {worker:?}: the directory holds {max} workers already")]
    TooManyWorkers { worker: WorkerId, max: usize },
}

/// What a run of events amounts to: a `Cleared` wipes every earlier event of the worker, so only the events after
/// the last one matter, applied to a cleared worker. Applying this instead of each event costs a batch at most one
/// scan of the directory, however many `Cleared` it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollapsedEvents<'a> {
    /// The worker's blocks are cleared before `events` apply.
    pub clears: bool,
    /// The events after the last `Cleared`; none of them is a `Cleared`.
    pub events: &'a [BlockEvent],
}

/// Collapses the `Cleared` events of `events` into at most one (see [`CollapsedEvents`]).
pub fn collapse_clears(events: &[BlockEvent]) -> CollapsedEvents<'_> {
    match events.iter().rposition(|e| matches!(e, BlockEvent::Cleared)) {
        Some(last) => CollapsedEvents { clears: true, events: &events[last + 1..] },
        None => CollapsedEvents { clears: false, events },
    }
}

/// Hash → residencies, plus the worker table.
#[derive(Debug, Default)]
pub struct BlockDirectory {
    blocks: HashMap<BlockHash, Vec<Residency>>,
    /// Worker → the hashes of the blocks it holds at least one copy of in `blocks`: what lets a `Cleared`, a new
    /// epoch, a worker snapshot or a removal drop one worker's copies at the cost of those copies, where a scan of
    /// `blocks` would hold the raft actor for as long as the whole directory takes (a second at millions of copies).
    ///
    /// Derived from `blocks` (rebuilt by [`Self::from_parts`], never exported, so snapshots are unchanged) and kept
    /// exactly in step with it: a worker is a key iff it holds a copy, and a hash is in its set iff one of the block's
    /// copies is the worker's. Cost: one `u64` per (worker, block) pair, which is at most one per copy, in a hash set
    /// of 8-byte slots plus a control byte at 7/16 to 7/8 load: about 10 to 21 bytes per pair (beside a copy's own 64
    /// bytes of [`Residency`] and its two strings), and one map entry per worker holding copies. A worker's set is
    /// freed whole when its residency is dropped; removals do not shrink it, so it stays at most the size of the
    /// worker's largest holding ([`MAX_COPIES_PER_WORKER`] pairs).
    held: HashMap<WorkerId, HashSet<BlockHash>>,
    workers: WorkerTable,
    /// Copies in `blocks`, over all workers.
    copies: u64,
    /// Their [`copy_cost`]s (held against [`MAX_COPY_BYTES`]).
    copy_bytes: u64,
}

impl BlockDirectory {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a worker, or re-registers it with a new epoch. A new epoch means the worker restarted: its device
    /// and host copies are gone (disk copies are re-announced by the worker's snapshot), so all its residencies are
    /// dropped and sequence numbering restarts.
    pub fn register_worker(&mut self, worker: &str, address: &str, epoch: u64) -> Result<(), DirectoryError> {
        if self.workers.register(worker, address, epoch)? == Registration::NewEpoch {
            self.drop_worker_residency(worker);
        }
        Ok(())
    }

    /// Removes a worker and every block copy it held (lease loss, DESIGN §6).
    pub fn remove_worker(&mut self, worker: &str) -> bool {
        self.drop_worker_residency(worker);
        self.workers.remove(worker)
    }

    /// Applies a batch idempotently: replayed sequence numbers are skipped, a gap applies nothing.
    pub fn apply(&mut self, batch: &EventBatch) -> Result<ApplyOutcome, DirectoryError> {
        let admitted = self.workers.admit(batch)?;
        let fresh = collapse_clears(&batch.events[admitted.skipped..]);
        if fresh.clears {
            self.drop_worker_residency(&batch.worker);
        }
        for event in fresh.events {
            self.apply_one(&batch.worker, event);
        }
        Ok(admitted.outcome)
    }

    /// Replaces everything known about a worker with a full snapshot taken at `seq` (after a gap).
    pub fn apply_snapshot(
        &mut self,
        worker: &str,
        epoch: u64,
        seq: u64,
        residency: &[(BlockHash, Tier, String, u64)],
        load: Option<&WorkerLoad>,
    ) -> Result<(), DirectoryError> {
        self.workers.snapshot(worker, epoch, seq, load)?;
        self.drop_worker_residency(worker);
        for (hash, tier, codec, bytes) in residency {
            self.apply_one(
                worker,
                &BlockEvent::Stored { hash: *hash, tier: *tier, codec: codec.clone(), bytes: *bytes },
            );
        }
        Ok(())
    }

    /// Every copy of a block, in a stable order.
    pub fn residency(&self, hash: BlockHash) -> &[Residency] {
        self.blocks.get(&hash).map(Vec::as_slice).unwrap_or(&[])
    }

    /// How many leading blocks of `chain` each worker holds in any tier: the prefix-match length per worker.
    pub fn prefix_matches(&self, chain: &[BlockHash]) -> BTreeMap<WorkerId, usize> {
        let mut matched: BTreeMap<WorkerId, usize> = BTreeMap::new();
        for (i, hash) in chain.iter().enumerate() {
            let mut any = false;
            for r in self.residency(*hash) {
                let entry = matched.entry(r.worker.clone()).or_insert(0);
                // A worker only extends its match if it held every earlier block too.
                if *entry == i {
                    *entry = i + 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        matched.retain(|_, n| *n > 0);
        matched
    }

    pub fn worker(&self, worker: &str) -> Option<&WorkerRecord> {
        self.workers.get(worker)
    }

    pub fn workers(&self) -> impl Iterator<Item = (&WorkerId, &WorkerRecord)> {
        self.workers.iter()
    }

    pub fn worker_table(&self) -> &WorkerTable {
        &self.workers
    }

    /// Every block with its copies, in no particular order (for snapshots).
    pub fn blocks(&self) -> impl Iterator<Item = (&BlockHash, &[Residency])> {
        self.blocks.iter().map(|(h, copies)| (h, copies.as_slice()))
    }

    /// Rebuilds a directory from what [`Self::workers`] and [`Self::blocks`] exported. Copies are re-sorted and
    /// de-duplicated, and copies of unknown workers dropped, so that the rebuilt directory upholds the same invariants
    /// as one built by events.
    pub fn from_parts(
        workers: impl IntoIterator<Item = (WorkerId, WorkerRecord)>,
        blocks: impl IntoIterator<Item = (BlockHash, Vec<Residency>)>,
    ) -> Self {
        let workers: WorkerTable = workers.into_iter().collect();
        let mut map: HashMap<BlockHash, Vec<Residency>> = HashMap::new();
        for (hash, mut copies) in blocks {
            copies.retain(|r| workers.contains(&r.worker));
            copies.sort();
            copies.dedup_by(|a, b| a.worker == b.worker && a.tier == b.tier && a.codec == b.codec);
            if !copies.is_empty() {
                map.entry(hash).or_default().extend(copies);
            }
        }
        let copies = map.values().map(|c| c.len() as u64).sum();
        let copy_bytes = map.values().flatten().map(|r| copy_cost(&r.worker, &r.codec)).sum();
        let mut held: HashMap<WorkerId, HashSet<BlockHash>> = HashMap::new();
        for (hash, copies) in &map {
            // Sorted: a worker's copies of one block are adjacent.
            for (i, r) in copies.iter().enumerate() {
                if i == 0 || copies[i - 1].worker != r.worker {
                    held.entry(r.worker.clone()).or_default().insert(*hash);
                }
            }
        }
        Self { blocks: map, held, workers, copies, copy_bytes }
    }

    /// Number of distinct block hashes with at least one copy.
    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// Block copies over all workers.
    pub fn copy_count(&self) -> u64 {
        self.copies
    }

    /// Their charge against [`MAX_COPY_BYTES`] (at most that once built by events).
    pub fn copy_bytes(&self) -> u64 {
        self.copy_bytes
    }

    fn apply_one(&mut self, worker: &str, event: &BlockEvent) {
        match event {
            BlockEvent::Stored { hash, tier, codec, bytes } => {
                let cost = copy_cost(worker, codec);
                if self.copy_bytes + cost > MAX_COPY_BYTES
                    || self.workers.get(worker).is_some_and(|r| r.blocks >= MAX_COPIES_PER_WORKER)
                {
                    return;
                }
                let copies = self.blocks.entry(*hash).or_default();
                let mut own = 0;
                for r in copies.iter().filter(|r| r.worker == worker) {
                    if r.tier == *tier && &r.codec == codec {
                        return;
                    }
                    own += 1;
                }
                if own >= MAX_COPIES_PER_BLOCK_PER_WORKER {
                    return;
                }
                let copy = Residency { worker: worker.to_string(), tier: *tier, codec: codec.clone(), bytes: *bytes };
                // Kept sorted: an insert at its place, where a push and a sort would sort the list every time.
                let at = copies.partition_point(|r| *r < copy);
                copies.insert(at, copy);
                if own == 0 {
                    match self.held.get_mut(worker) {
                        Some(hashes) => {
                            hashes.insert(*hash);
                        }
                        None => {
                            self.held.insert(worker.to_string(), HashSet::from([*hash]));
                        }
                    }
                }
                self.copies += 1;
                self.copy_bytes += cost;
                self.adjust_block_count(worker, 1);
            }
            BlockEvent::Removed { hash, tier, codec } => {
                let mut removed = 0;
                let mut last_own = false;
                if let Some(copies) = self.blocks.get_mut(hash) {
                    let before = copies.len();
                    copies.retain(|r| !(r.worker == worker && r.tier == *tier && &r.codec == codec));
                    removed = before - copies.len();
                    last_own = removed > 0 && !copies.iter().any(|r| r.worker == worker);
                    if copies.is_empty() {
                        self.blocks.remove(hash);
                    }
                }
                if last_own && let Some(hashes) = self.held.get_mut(worker) {
                    hashes.remove(hash);
                    if hashes.is_empty() {
                        self.held.remove(worker);
                    }
                }
                if removed > 0 {
                    self.copies = self.copies.saturating_sub(removed as u64);
                    self.copy_bytes = self.copy_bytes.saturating_sub(removed as u64 * copy_cost(worker, codec));
                    self.adjust_block_count(worker, -1);
                }
            }
            BlockEvent::Cleared => self.drop_worker_residency(worker),
        }
    }

    fn adjust_block_count(&mut self, worker: &str, delta: i64) {
        if let Some(record) = self.workers.get_mut(worker) {
            record.blocks = record.blocks.saturating_add_signed(delta);
        }
    }

    /// Drops every copy `worker` holds: the blocks in its `held` set only, never a scan of the directory.
    /// The order the set yields them in does not matter (each block's list is edited on its own), so every replica
    /// reaches the same state.
    fn drop_worker_residency(&mut self, worker: &str) {
        let (mut dropped, mut dropped_bytes) = (0, 0);
        for hash in self.held.remove(worker).unwrap_or_default() {
            let Some(copies) = self.blocks.get_mut(&hash) else { continue };
            copies.retain(|r| {
                let keep = r.worker != worker;
                if !keep {
                    dropped += 1;
                    dropped_bytes += copy_cost(&r.worker, &r.codec);
                }
                keep
            });
            if copies.is_empty() {
                self.blocks.remove(&hash);
            }
        }
        self.copies = self.copies.saturating_sub(dropped);
        self.copy_bytes = self.copy_bytes.saturating_sub(dropped_bytes);
        if let Some(record) = self.workers.get_mut(worker) {
            record.blocks = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hash: BlockHash, tier: Tier) -> BlockEvent {
        BlockEvent::Stored { hash, tier, codec: "f32".into(), bytes: 8192 }
    }

    fn batch(worker: &str, epoch: u64, first_seq: u64, events: Vec<BlockEvent>) -> EventBatch {
        EventBatch { worker: worker.into(), epoch, first_seq, events, load: None }
    }

    #[test]
    fn replayed_events_apply_once() {
        let mut dir = BlockDirectory::new();
        dir.register_worker("w1", "127.0.0.1:1", 1).unwrap();
        let b = batch("w1", 1, 1, vec![stored(10, Tier::Device), stored(11, Tier::Device)]);
        assert_eq!(dir.apply(&b).unwrap(), ApplyOutcome::Applied { applied: 2, skipped: 0 });
        assert_eq!(dir.apply(&b).unwrap(), ApplyOutcome::Applied { applied: 0, skipped: 2 });
        // Overlapping batch: seq 2 is a replay, seq 3 is new.
        let overlap = batch(
            "w1",
            1,
            2,
            vec![stored(11, Tier::Device), BlockEvent::Removed { hash: 10, tier: Tier::Device, codec: "f32".into() }],
        );
        assert_eq!(dir.apply(&overlap).unwrap(), ApplyOutcome::Applied { applied: 1, skipped: 1 });
        assert!(dir.residency(10).is_empty());
        assert_eq!(dir.residency(11).len(), 1);
        assert_eq!(dir.worker("w1").unwrap().blocks, 1);
        assert_eq!(dir.worker("w1").unwrap().applied_seq, 3);
    }

    #[test]
    fn a_gap_applies_nothing_and_a_snapshot_heals_it() {
        let mut dir = BlockDirectory::new();
        dir.register_worker("w1", "a", 1).unwrap();
        dir.apply(&batch("w1", 1, 1, vec![stored(1, Tier::Device)])).unwrap();
        let out = dir.apply(&batch("w1", 1, 5, vec![stored(2, Tier::Device)])).unwrap();
        assert_eq!(out, ApplyOutcome::Gap { expected: 2, got: 5 });
        assert!(dir.residency(2).is_empty());
        dir.apply_snapshot("w1", 1, 5, &[(2, Tier::Host, "int8".into(), 100)], None).unwrap();
        assert!(dir.residency(1).is_empty());
        assert_eq!(dir.residency(2)[0].tier, Tier::Host);
        assert_eq!(
            dir.apply(&batch("w1", 1, 6, vec![stored(3, Tier::Device)])).unwrap(),
            ApplyOutcome::Applied { applied: 1, skipped: 0 }
        );
    }

    #[test]
    fn new_epoch_drops_residency_and_stale_epochs_are_rejected() {
        let mut dir = BlockDirectory::new();
        dir.register_worker("w1", "a", 1).unwrap();
        dir.apply(&batch("w1", 1, 1, vec![stored(1, Tier::Device)])).unwrap();
        dir.register_worker("w1", "a", 2).unwrap();
        assert!(dir.residency(1).is_empty());
        assert_eq!(dir.worker("w1").unwrap().applied_seq, 0);
        let err = dir.apply(&batch("w1", 1, 2, vec![stored(1, Tier::Device)])).unwrap_err();
        assert!(matches!(err, DirectoryError::StaleEpoch { got: 1, current: 2, .. }));
        assert!(dir.register_worker("w1", "a", 1).is_err());
        assert_eq!(
            dir.apply(&batch("nobody", 1, 1, vec![])).unwrap_err(),
            DirectoryError::UnknownWorker("nobody".into())
        );
        assert_eq!(dir.apply(&batch("w1", 2, 0, vec![])).unwrap_err(), DirectoryError::ZeroSequence("w1".into()));
    }

    #[test]
    fn prefix_matches_require_contiguous_blocks() {
        let mut dir = BlockDirectory::new();
        dir.register_worker("a", "a", 1).unwrap();
        dir.register_worker("b", "b", 1).unwrap();
        dir.apply(&batch("a", 1, 1, vec![stored(1, Tier::Device), stored(2, Tier::Host), stored(3, Tier::Disk)]))
            .unwrap();
        // b holds blocks 1 and 3 but not 2: its match stops at 1.
        dir.apply(&batch("b", 1, 1, vec![stored(1, Tier::Device), stored(3, Tier::Device)])).unwrap();
        let m = dir.prefix_matches(&[1, 2, 3, 4]);
        assert_eq!(m.get("a"), Some(&3));
        assert_eq!(m.get("b"), Some(&1));
        assert!(dir.prefix_matches(&[9, 1]).is_empty());
    }

    #[test]
    fn removing_a_worker_removes_its_copies_only() {
        let mut dir = BlockDirectory::new();
        dir.register_worker("a", "a", 1).unwrap();
        dir.register_worker("b", "b", 1).unwrap();
        dir.apply(&batch("a", 1, 1, vec![stored(1, Tier::Device), stored(2, Tier::Device)])).unwrap();
        dir.apply(&batch("b", 1, 1, vec![stored(1, Tier::Host)])).unwrap();
        assert!(dir.remove_worker("a"));
        assert_eq!(dir.block_count(), 1);
        assert_eq!(dir.residency(1)[0].worker, "b");
        dir.apply(&batch("b", 1, 2, vec![BlockEvent::Cleared])).unwrap();
        assert_eq!(dir.block_count(), 0);
        assert_eq!(dir.worker("b").unwrap().blocks, 0);
    }

    #[test]
    fn load_reports_follow_the_frontier_and_replays_do_not_roll_them_back() {
        let mut dir = BlockDirectory::new();
        dir.register_worker("a", "a", 1).unwrap();
        let load = |running| WorkerLoad { running, ..WorkerLoad::default() };
        let mut b = batch("a", 1, 1, vec![stored(1, Tier::Device), stored(2, Tier::Device)]);
        b.load = Some(load(1));
        dir.apply(&b).unwrap();
        // A heartbeat at the frontier (seq 3, no events) carries a newer report.
        let mut heartbeat = batch("a", 1, 3, vec![]);
        heartbeat.load = Some(load(2));
        assert_eq!(dir.apply(&heartbeat).unwrap(), ApplyOutcome::Applied { applied: 0, skipped: 0 });
        assert_eq!(dir.worker("a").unwrap().load.as_ref().unwrap().running, 2);
        // The first batch again (a retry after a lost answer): a replay, its older report is ignored.
        assert_eq!(dir.apply(&b).unwrap(), ApplyOutcome::Applied { applied: 0, skipped: 2 });
        assert_eq!(dir.worker("a").unwrap().load.as_ref().unwrap().running, 2);
        // A new epoch starts without a report.
        dir.register_worker("a", "a", 2).unwrap();
        assert!(dir.worker("a").unwrap().load.is_none());
    }

    #[test]
    fn duplicate_stores_and_unknown_removes_do_not_skew_counts() {
        let mut dir = BlockDirectory::new();
        dir.register_worker("a", "a", 1).unwrap();
        dir.apply(&batch(
            "a",
            1,
            1,
            vec![
                stored(1, Tier::Device),
                stored(1, Tier::Device),
                BlockEvent::Removed { hash: 99, tier: Tier::Device, codec: "f32".into() },
                stored(1, Tier::Host),
            ],
        ))
        .unwrap();
        assert_eq!(dir.worker("a").unwrap().blocks, 2);
        assert_eq!(dir.residency(1).len(), 2);
    }

    fn removed(hash: BlockHash, tier: Tier) -> BlockEvent {
        BlockEvent::Removed { hash, tier, codec: "f32".into() }
    }

    #[test]
    fn collapsing_keeps_only_what_follows_the_last_clear() {
        let events = vec![
            stored(1, Tier::Device),
            BlockEvent::Cleared,
            stored(2, Tier::Device),
            BlockEvent::Cleared,
            BlockEvent::Cleared,
            stored(3, Tier::Host),
            removed(3, Tier::Host),
            stored(4, Tier::Disk),
        ];
        let collapsed = collapse_clears(&events);
        assert!(collapsed.clears);
        assert_eq!(collapsed.events, &events[5..]);
        assert_eq!(collapse_clears(&events[..2]), CollapsedEvents { clears: true, events: &[] });
        assert_eq!(collapse_clears(&events[5..]), CollapsedEvents { clears: false, events: &events[5..] });
        assert_eq!(collapse_clears(&[]), CollapsedEvents { clears: false, events: &[] });
        // However many clears a batch holds, what is left to apply after the one clear holds none.
        let many: Vec<BlockEvent> =
            (0..65_536).map(|i| if i % 2 == 0 { BlockEvent::Cleared } else { stored(i, Tier::Device) }).collect();
        let collapsed = collapse_clears(&many);
        assert!(collapsed.clears);
        assert_eq!(collapsed.events, &many[many.len() - 1..]);
        assert!(!collapsed.events.iter().any(|e| matches!(e, BlockEvent::Cleared)));
    }

    #[test]
    fn a_batch_with_clears_applies_like_its_events_one_at_a_time() {
        let events = vec![
            stored(1, Tier::Device),
            stored(2, Tier::Host),
            BlockEvent::Cleared,
            stored(3, Tier::Device),
            removed(3, Tier::Device),
            stored(4, Tier::Device),
            BlockEvent::Cleared,
            BlockEvent::Cleared,
            stored(5, Tier::Disk),
            stored(1, Tier::Host),
            removed(9, Tier::Host),
            stored(5, Tier::Disk),
        ];
        for split in 0..=events.len() {
            let mut batched = BlockDirectory::new();
            let mut one_by_one = BlockDirectory::new();
            for dir in [&mut batched, &mut one_by_one] {
                dir.register_worker("w", "w", 1).unwrap();
                dir.register_worker("other", "o", 1).unwrap();
                dir.apply(&batch("other", 1, 1, vec![stored(1, Tier::Device), stored(4, Tier::Host)])).unwrap();
            }
            // Two batches that meet at `split`, the second overlapping the first by one replayed event.
            batched.apply(&batch("w", 1, 1, events[..split].to_vec())).unwrap();
            let from = split.saturating_sub(1);
            let outcome = batched.apply(&batch("w", 1, from as u64 + 1, events[from..].to_vec())).unwrap();
            assert_eq!(outcome, ApplyOutcome::Applied { applied: events.len() - split, skipped: split - from });
            for (i, event) in events.iter().enumerate() {
                one_by_one.apply(&batch("w", 1, i as u64 + 1, vec![event.clone()])).unwrap();
            }
            for hash in 0..10 {
                assert_eq!(batched.residency(hash), one_by_one.residency(hash), "hash {hash}, split {split}");
            }
            assert_eq!(batched.worker("w"), one_by_one.worker("w"), "split {split}");
            assert_eq!(batched.worker("other"), one_by_one.worker("other"));
            assert_eq!(batched.block_count(), one_by_one.block_count());
        }
        let mut dir = BlockDirectory::new();
        dir.register_worker("w", "w", 1).unwrap();
        dir.apply(&batch("w", 1, 1, events)).unwrap();
        let held: Vec<BlockHash> = (0..10).filter(|h| !dir.residency(*h).is_empty()).collect();
        assert_eq!(held, [1, 5]);
        assert_eq!(dir.worker("w").unwrap().blocks, 2);
    }

    #[test]
    fn a_worker_at_the_last_sequence_number_is_refused_not_overflowed() {
        let mut dir = BlockDirectory::new();
        dir.register_worker("w", "w", 1).unwrap();
        dir.apply_snapshot("w", 1, u64::MAX, &[(7, Tier::Device, "f32".into(), 1)], None).unwrap();
        let next = batch("w", 1, 1, vec![stored(8, Tier::Device)]);
        assert_eq!(dir.apply(&next), Err(DirectoryError::SequenceExhausted("w".into())));
        assert_eq!(dir.worker("w").unwrap().applied_seq, u64::MAX);
        assert!(dir.residency(8).is_empty());
        // A batch that runs past the last number is refused whole, even when not built by validation.
        dir.apply_snapshot("w", 1, u64::MAX - 1, &[], None).unwrap();
        let past_the_end = batch("w", 1, u64::MAX, vec![stored(8, Tier::Device), stored(9, Tier::Device)]);
        assert_eq!(dir.apply(&past_the_end), Err(DirectoryError::SequenceExhausted("w".into())));
        assert_eq!(dir.worker("w").unwrap().applied_seq, u64::MAX - 1);
        assert!(dir.residency(8).is_empty());
        // A new epoch starts the numbering over.
        dir.register_worker("w", "w", 2).unwrap();
        assert_eq!(
            dir.apply(&batch("w", 2, 1, vec![stored(8, Tier::Device)])).unwrap(),
            ApplyOutcome::Applied { applied: 1, skipped: 0 }
        );
    }

    #[test]
    fn registration_past_the_worker_cap_is_refused_and_known_workers_still_reregister() {
        let mut dir = BlockDirectory::new();
        for i in 0..MAX_WORKERS {
            dir.register_worker(&format!("w{i}"), "a:1", 1).unwrap();
        }
        assert_eq!(
            dir.register_worker("one-more", "a:1", 1),
            Err(DirectoryError::TooManyWorkers { worker: "one-more".into(), max: MAX_WORKERS })
        );
        assert!(dir.worker("one-more").is_none());
        // A known worker's new epoch, and a removal making room, still work at the cap.
        dir.register_worker("w0", "a:2", 2).unwrap();
        assert!(dir.remove_worker("w1"));
        dir.register_worker("one-more", "a:1", 1).unwrap();
        assert_eq!(dir.workers().count(), MAX_WORKERS);
    }

    #[test]
    fn copies_past_the_per_block_cap_are_sequenced_but_not_kept() {
        let mut dir = BlockDirectory::new();
        dir.register_worker("w", "a:1", 1).unwrap();
        dir.register_worker("other", "a:2", 1).unwrap();
        let codecs: Vec<BlockEvent> = (0..MAX_COPIES_PER_BLOCK_PER_WORKER + 5)
            .map(|i| BlockEvent::Stored { hash: 7, tier: Tier::Host, codec: format!("c{i:02}"), bytes: 1 })
            .collect();
        let applied = dir.apply(&batch("w", 1, 1, codecs.clone())).unwrap();
        assert_eq!(applied, ApplyOutcome::Applied { applied: MAX_COPIES_PER_BLOCK_PER_WORKER + 5, skipped: 0 });
        assert_eq!(dir.residency(7).len(), MAX_COPIES_PER_BLOCK_PER_WORKER);
        assert_eq!(dir.worker("w").unwrap().blocks, MAX_COPIES_PER_BLOCK_PER_WORKER as u64);
        assert_eq!(dir.worker("w").unwrap().applied_seq, codecs.len() as u64);
        // The cap is per worker: another worker's copy of the block is kept, and the list stays sorted.
        dir.apply(&batch("other", 1, 1, vec![stored(7, Tier::Device)])).unwrap();
        let copies = dir.residency(7);
        assert_eq!(copies.len(), MAX_COPIES_PER_BLOCK_PER_WORKER + 1);
        assert!(copies.windows(2).all(|w| w[0] < w[1]), "{copies:?}");
        // Removing a copy makes room for one more; removing one never kept changes nothing.
        let mut seq = codecs.len() as u64 + 1;
        let removed_dropped = BlockEvent::Removed { hash: 7, tier: Tier::Host, codec: "c20".into() };
        dir.apply(&batch("w", 1, seq, vec![removed_dropped])).unwrap();
        seq += 1;
        assert_eq!(dir.worker("w").unwrap().blocks, MAX_COPIES_PER_BLOCK_PER_WORKER as u64);
        let removed_kept = BlockEvent::Removed { hash: 7, tier: Tier::Host, codec: "c00".into() };
        dir.apply(&batch("w", 1, seq, vec![removed_kept, codecs[20].clone()])).unwrap();
        assert!(dir.residency(7).iter().any(|r| r.codec == "c20"));
        assert!(!dir.residency(7).iter().any(|r| r.codec == "c00"));
        assert_eq!(dir.worker("w").unwrap().blocks, MAX_COPIES_PER_BLOCK_PER_WORKER as u64);
    }

    #[test]
    fn copies_past_the_per_worker_cap_are_not_kept() {
        let mut dir = BlockDirectory::new();
        dir.register_worker("w", "a:1", 1).unwrap();
        let full: Vec<(BlockHash, Tier, String, u64)> =
            (0..MAX_COPIES_PER_WORKER).map(|h| (h, Tier::Disk, "int4_kivi".to_string(), 1)).collect();
        dir.apply_snapshot("w", 1, 1, &full, None).unwrap();
        assert_eq!(dir.worker("w").unwrap().blocks, MAX_COPIES_PER_WORKER);
        let past = dir.apply(&batch("w", 1, 2, vec![stored(u64::MAX, Tier::Device)])).unwrap();
        assert_eq!(past, ApplyOutcome::Applied { applied: 1, skipped: 0 });
        assert!(dir.residency(u64::MAX).is_empty());
        assert_eq!(dir.block_count(), MAX_COPIES_PER_WORKER as usize);
        // One removed, one stored.
        let swap = vec![
            BlockEvent::Removed { hash: 0, tier: Tier::Disk, codec: "int4_kivi".into() },
            stored(u64::MAX, Tier::Device),
        ];
        dir.apply(&batch("w", 1, 3, swap)).unwrap();
        assert_eq!(dir.residency(u64::MAX).len(), 1);
        assert_eq!(dir.worker("w").unwrap().blocks, MAX_COPIES_PER_WORKER);
    }

    #[test]
    fn copies_past_the_directory_wide_byte_budget_are_not_kept() {
        let mut dir = BlockDirectory::new();
        // The longest names: the budget holds the fewest copies (about 640 thousand).
        let name = |i: u64| format!("{i:0>width$}", width = crate::machine::MAX_NAME_LEN);
        let codec = "c".repeat(crate::machine::MAX_CODEC_LEN);
        let cost = copy_cost(&name(0), &codec);
        let fit = MAX_COPY_BYTES / cost;
        let mut workers = 0;
        let mut next_hash = 0;
        while dir.copy_count() < fit {
            let worker = name(workers);
            workers += 1;
            dir.register_worker(&worker, "a:1", 1).unwrap();
            let take = MAX_COPIES_PER_WORKER.min(fit - dir.copy_count());
            let copies: Vec<(BlockHash, Tier, String, u64)> =
                (next_hash..next_hash + take).map(|h| (h, Tier::Host, codec.clone(), 1)).collect();
            next_hash += take;
            dir.apply_snapshot(&worker, 1, 1, &copies, None).unwrap();
        }
        assert_eq!(dir.copy_bytes(), fit * cost);
        let late = name(u64::from(u32::MAX));
        dir.register_worker(&late, "a:2", 1).unwrap();
        let stored_late = || BlockEvent::Stored { hash: u64::MAX, tier: Tier::Device, codec: codec.clone(), bytes: 1 };
        // Counted as applied (the sequence moves on), not kept: the worker is far below its own cap.
        let past = dir.apply(&batch(&late, 1, 1, vec![stored_late()])).unwrap();
        assert_eq!(past, ApplyOutcome::Applied { applied: 1, skipped: 0 });
        assert_eq!(dir.worker(&late).unwrap().applied_seq, 1);
        assert!(dir.residency(u64::MAX).is_empty());
        assert_eq!(dir.copy_count(), fit);
        // A removal anywhere makes room again.
        let removed = BlockEvent::Removed { hash: 0, tier: Tier::Host, codec: codec.clone() };
        dir.apply(&batch(&name(0), 1, 2, vec![removed])).unwrap();
        dir.apply(&batch(&late, 1, 2, vec![stored_late()])).unwrap();
        assert_eq!(dir.residency(u64::MAX).len(), 1);
        assert_eq!((dir.copy_count(), dir.copy_bytes()), (fit, fit * cost));
        // Dropping a worker gives back all its copies.
        let first = MAX_COPIES_PER_WORKER.min(fit);
        assert!(dir.remove_worker(&name(0)));
        assert_eq!(dir.copy_count(), fit - (first - 1));
        assert_eq!(dir.copy_bytes(), (fit - (first - 1)) * cost);
        let rebuilt = BlockDirectory::from_parts(
            dir.workers().map(|(w, r)| (w.clone(), r.clone())),
            dir.blocks().map(|(h, c)| (*h, c.to_vec())),
        );
        assert_eq!((rebuilt.copy_count(), rebuilt.copy_bytes()), (dir.copy_count(), dir.copy_bytes()));
    }

    /// Recounts from `blocks` alone what the directory keeps beside it (the per-worker index, the copy and byte
    /// counters, each worker's copy count) and checks each block's list is sorted, duplicate-free and non-empty.
    fn assert_consistent(dir: &BlockDirectory) {
        let mut held: HashMap<WorkerId, HashSet<BlockHash>> = HashMap::new();
        let mut per_worker: BTreeMap<WorkerId, u64> = BTreeMap::new();
        let (mut copies, mut bytes) = (0, 0);
        for (hash, list) in &dir.blocks {
            assert!(!list.is_empty(), "block {hash} kept with no copies");
            assert!(list.windows(2).all(|w| w[0] < w[1]), "block {hash}: {list:?}");
            for r in list {
                held.entry(r.worker.clone()).or_default().insert(*hash);
                *per_worker.entry(r.worker.clone()).or_default() += 1;
                copies += 1;
                bytes += copy_cost(&r.worker, &r.codec);
                assert!(dir.workers.contains(&r.worker), "copy of unknown worker {r:?}");
            }
        }
        assert_eq!(dir.held, held);
        assert_eq!((dir.copies, dir.copy_bytes), (copies, bytes));
        for (worker, record) in dir.workers() {
            assert_eq!(record.blocks, per_worker.get(worker).copied().unwrap_or(0), "worker {worker}");
        }
    }

    /// Every copy, sorted: what two directories must agree on to hold the same blocks.
    fn all_copies(dir: &BlockDirectory) -> Vec<(BlockHash, Residency)> {
        let mut all: Vec<_> = dir.blocks().flat_map(|(h, c)| c.iter().map(|r| (*h, r.clone()))).collect();
        all.sort();
        all
    }

    fn rebuilt(dir: &BlockDirectory) -> BlockDirectory {
        BlockDirectory::from_parts(
            dir.workers().map(|(w, r)| (w.clone(), r.clone())),
            dir.blocks().map(|(h, c)| (*h, c.to_vec())),
        )
    }

    fn both(dir: &mut BlockDirectory, replica: &mut BlockDirectory, mut f: impl FnMut(&mut BlockDirectory)) {
        f(dir);
        f(replica);
    }

    #[test]
    fn the_worker_index_follows_the_blocks_through_random_operations() {
        // xorshift64*: deterministic, no dependency.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move |n: u64| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            state.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
        };
        let workers = ["a", "b", "c", "dd", "eee"];
        let tiers = [Tier::Device, Tier::Host, Tier::Disk];
        // Three tiers under six codecs: more copies of one block than the per-block cap lets one worker keep.
        let codecs = ["f32", "f16", "int8", "fp8", "q4", "bf16"];
        // `dir` goes through a snapshot round trip now and then, `replica` never: the same log must give both the
        // same state.
        let mut dir = BlockDirectory::new();
        let mut replica = BlockDirectory::new();
        let mut epochs: BTreeMap<&str, u64> = BTreeMap::new();
        for step in 0..20_000 {
            let worker = workers[next(workers.len() as u64) as usize];
            let event = |next: &mut dyn FnMut(u64) -> u64| {
                let hash = next(40);
                let tier = tiers[next(3) as usize];
                let codec = codecs[next(codecs.len() as u64) as usize].to_string();
                match next(20) {
                    0 => BlockEvent::Cleared,
                    1..=7 => BlockEvent::Removed { hash, tier, codec },
                    _ => BlockEvent::Stored { hash, tier, codec, bytes: next(1 << 20) },
                }
            };
            match next(100) {
                // Register: a new worker or a new epoch (drops its copies), or the same epoch again (keeps them).
                0..=4 => {
                    let epoch = epochs.entry(worker).or_insert(0);
                    if next(2) == 0 || *epoch == 0 {
                        *epoch += 1;
                    }
                    let epoch = *epoch;
                    both(&mut dir, &mut replica, |d| d.register_worker(worker, "a:1", epoch).unwrap());
                }
                5..=6 => {
                    epochs.remove(worker);
                    both(&mut dir, &mut replica, |d| {
                        d.remove_worker(worker);
                    });
                }
                7..=10 => {
                    let Some(&epoch) = epochs.get(worker) else { continue };
                    let seq = dir.worker(worker).unwrap().applied_seq + 5;
                    let residency: Vec<(BlockHash, Tier, String, u64)> = (0..next(30))
                        .map(|_| (next(40), tiers[next(3) as usize], codecs[next(6) as usize].to_string(), 1))
                        .collect();
                    both(&mut dir, &mut replica, |d| d.apply_snapshot(worker, epoch, seq, &residency, None).unwrap());
                }
                11..=12 => dir = rebuilt(&dir),
                _ => {
                    let Some(&epoch) = epochs.get(worker) else { continue };
                    let first_seq = dir.worker(worker).unwrap().applied_seq + 1;
                    let events: Vec<BlockEvent> = (0..1 + next(8)).map(|_| event(&mut next)).collect();
                    let b = batch(worker, epoch, first_seq, events);
                    both(&mut dir, &mut replica, |d| {
                        d.apply(&b).unwrap();
                    });
                }
            }
            assert_consistent(&dir);
            if step % 64 == 0 {
                assert_consistent(&replica);
                assert_eq!(all_copies(&dir), all_copies(&replica), "step {step}");
            }
        }
        assert_consistent(&replica);
        assert_eq!(all_copies(&dir), all_copies(&replica));
        assert!(dir.copy_count() > 0, "the mix should end with copies held");
    }

    /// A directory of `others` copies (each its own block, over 100 workers) plus a worker `victim` holding
    /// `victim_copies` copies on blocks the others also hold.
    fn crowded_directory(others: u64, victim_copies: u64) -> BlockDirectory {
        let workers = 100;
        let record = |epoch| WorkerRecord { address: "a:1".into(), epoch, applied_seq: 1, ..WorkerRecord::default() };
        let names: Vec<String> = (0..workers).map(|w| format!("w{w}")).collect();
        let mut table: Vec<(WorkerId, WorkerRecord)> = names.iter().map(|n| (n.clone(), record(1))).collect();
        table.push(("victim".into(), record(1)));
        let blocks = (0..others).map(|h| {
            let worker = names[(h % workers) as usize].clone();
            (h, vec![Residency { worker, tier: Tier::Host, codec: "f16".into(), bytes: 1 }])
        });
        let mut dir = BlockDirectory::from_parts(table, blocks);
        let copies: Vec<(BlockHash, Tier, String, u64)> =
            (0..victim_copies).map(|i| (i * (others / victim_copies), Tier::Device, "f16".into(), 1)).collect();
        dir.apply_snapshot("victim", 1, 1, &copies, None).unwrap();
        assert_eq!(dir.copy_count(), others + victim_copies);
        dir
    }

    /// Run with `cargo test --release -p pagoda-kvstore --lib dropping_a_small_worker_from_a_large_directory_is_fast
    /// -- --ignored --nocapture`: how long one `[Cleared]` of a worker with 1k copies holds the raft actor when the
    /// directory holds 1M copies of other workers.
    #[test]
    #[ignore = "timing; run in release"]
    fn dropping_a_small_worker_from_a_large_directory_is_fast() {
        let (others, victim_copies) = (1_000_000, 1_000);
        let mut dir = crowded_directory(others, victim_copies);
        let mut times = Vec::new();
        for round in 0..20u64 {
            let seq = dir.worker("victim").unwrap().applied_seq + 1;
            let start = std::time::Instant::now();
            dir.apply(&batch("victim", 1, seq, vec![BlockEvent::Cleared])).unwrap();
            times.push(start.elapsed());
            assert_eq!(dir.copy_count(), others);
            let copies: Vec<(BlockHash, Tier, String, u64)> = (0..victim_copies)
                .map(|i| (i * (others / victim_copies) + round % 7, Tier::Device, "f16".into(), 1))
                .collect();
            dir.apply_snapshot("victim", 1, seq + 1, &copies, None).unwrap();
        }
        let start = std::time::Instant::now();
        assert!(dir.remove_worker("victim"));
        let removal = start.elapsed();
        times.sort();
        println!(
            "drop of {victim_copies} copies beside {others}: Cleared median {:?} (min {:?}, max {:?}), RemoveWorker {:?}",
            times[times.len() / 2],
            times[0],
            times[times.len() - 1],
            removal
        );
        assert_eq!(dir.copy_count(), others);
    }
}
