//! Block events: what this worker tells the kvstore about its KV blocks (DESIGN §6).
//!
//! Every block group the worker stores in or drops from a tier (device prefix-cache registration and eviction,
//! host and disk store and removal) becomes a [`BlockChange`] keyed by the group's prefix chain hash, the same
//! `xxh3(prev ‖ model id ‖ namespace ‖ tokens)` chain the router computes, so the router can look a request's
//! blocks up in the directory.
//!
//! Two owners, one on each side of a bounded channel:
//! - [`EventLog`] lives on the engine thread. It stamps each step's changes with the next per-worker sequence
//!   numbers and hands them over with `try_send`: the engine never waits for the network. When the channel is full
//!   the changes are dropped, and the sequence numbers move on anyway, so the hole is visible downstream.
//! - [`Outbox`] lives in the reporter task ([`crate::reporter`]). It queues what arrives, in sequence order, up to a
//!   bound; a hole in the numbering or an overflow drops the queue and asks for a full snapshot instead, which the
//!   engine takes at a sequence number `S` and which replaces everything up to `S`.

use std::borrow::Cow;
use std::collections::VecDeque;

use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::{self, Receiver, Sender};

use crate::tiers::Tier;

/// One block group entering or leaving one tier. The codec name is borrowed for the device's fixed names (a change
/// per block the engine registers or evicts, so the step does not allocate one each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockChange {
    Stored { hash: u64, tier: Tier, codec: Cow<'static, str>, bytes: u64 },
    Removed { hash: u64, tier: Tier, codec: Cow<'static, str> },
}

/// Changes with consecutive sequence numbers `first_seq, first_seq + 1, ...` (never empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqBatch {
    pub first_seq: u64,
    pub changes: Vec<BlockChange>,
}

impl SeqBatch {
    /// The sequence number after this batch's last one.
    pub fn end_seq(&self) -> u64 {
        self.first_seq + self.changes.len() as u64
    }
}

/// Every block the worker holds, as of sequence number `seq` (all changes up to `seq` are reflected).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidencySnapshot {
    pub seq: u64,
    /// Only [`BlockChange::Stored`] entries.
    pub blocks: Vec<BlockChange>,
}

/// The engine side: stamps changes and hands them to the reporter without ever blocking.
#[derive(Debug)]
pub struct EventLog {
    next_seq: u64,
    tx: Sender<SeqBatch>,
    dropped: u64,
}

impl EventLog {
    /// A log whose batches arrive on the returned receiver; at most `capacity` batches wait in between.
    pub fn channel(capacity: usize) -> (EventLog, Receiver<SeqBatch>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (EventLog { next_seq: 1, tx, dropped: 0 }, rx)
    }

    /// The last sequence number handed out (0 before the first).
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// Batches dropped because the reporter was behind (or gone).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Stamps `changes` (emptied) with the next sequence numbers and queues them. Returns false when the queue was
    /// full and they were dropped; their numbers are used up all the same, so the reporter sees the hole.
    pub fn push(&mut self, changes: &mut Vec<BlockChange>) -> bool {
        if changes.is_empty() {
            return true;
        }
        let batch = SeqBatch { first_seq: self.next_seq, changes: std::mem::take(changes) };
        self.next_seq = batch.end_seq();
        match self.tx.try_send(batch) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) | Err(TrySendError::Closed(_)) => {
                self.dropped += 1;
                false
            }
        }
    }
}

/// The reporter side: changes waiting to be published, contiguous from [`Outbox::next_seq`].
#[derive(Debug)]
pub struct Outbox {
    /// Sequence number of the first queued change (everything before it is published or covered by a snapshot).
    next_seq: u64,
    queue: VecDeque<BlockChange>,
    /// Batches that arrived while a snapshot is pending; sorted out when it is taken.
    held: VecDeque<SeqBatch>,
    held_changes: usize,
    max_changes: usize,
    snapshot_needed: bool,
    overflows: u64,
}

impl Outbox {
    /// An outbox that holds at most `max_changes` changes; it starts by needing a snapshot (a worker's first report
    /// is its full residency).
    pub fn new(max_changes: usize) -> Outbox {
        Outbox {
            next_seq: 1,
            queue: VecDeque::new(),
            held: VecDeque::new(),
            held_changes: 0,
            max_changes: max_changes.max(1),
            snapshot_needed: true,
            overflows: 0,
        }
    }

    /// The sequence number the next published batch starts at.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub fn snapshot_needed(&self) -> bool {
        self.snapshot_needed
    }

    /// Times the queue was dropped for a snapshot (overflow or a hole in the numbering).
    pub fn overflows(&self) -> u64 {
        self.overflows
    }

    /// Drops the queue; the next report must be a snapshot (the kvstore saw a gap, or the worker re-registered).
    pub fn request_snapshot(&mut self) {
        self.queue.clear();
        self.snapshot_needed = true;
    }

    fn overflow(&mut self) {
        self.overflows += 1;
        self.request_snapshot();
        self.held.clear();
        self.held_changes = 0;
    }

    /// Takes one batch from the engine's log.
    pub fn accept(&mut self, batch: SeqBatch) {
        if self.snapshot_needed {
            self.held_changes += batch.changes.len();
            self.held.push_back(batch);
            if self.held_changes > self.max_changes {
                self.overflow();
            }
            return;
        }
        self.append(batch);
    }

    /// Appends a batch at the end of the queue: the part already covered is skipped, a hole needs a snapshot.
    fn append(&mut self, batch: SeqBatch) {
        let expected = self.next_seq + self.queue.len() as u64;
        if batch.end_seq() <= expected {
            return;
        }
        if batch.first_seq > expected {
            self.overflow();
            return;
        }
        let skip = (expected - batch.first_seq) as usize;
        self.queue.extend(batch.changes.into_iter().skip(skip));
        if self.queue.len() > self.max_changes {
            self.overflow();
        }
    }

    /// A snapshot at `seq` was taken: everything up to `seq` is covered by it, the changes held since it was asked
    /// for continue the queue from `seq + 1`.
    pub fn snapshot_taken(&mut self, seq: u64) {
        self.snapshot_needed = false;
        self.queue.clear();
        self.next_seq = seq + 1;
        let held = std::mem::take(&mut self.held);
        self.held_changes = 0;
        for batch in held {
            if self.snapshot_needed {
                break;
            }
            self.append(batch);
        }
    }

    /// Up to `max` changes from the front, with the sequence number of the first (to publish; [`Outbox::ack`] them
    /// once the kvstore applied them). Empty at the frontier: a heartbeat.
    pub fn front(&self, max: usize) -> (u64, Vec<BlockChange>) {
        (self.next_seq, self.queue.iter().take(max).cloned().collect())
    }

    /// The first `n` changes were published.
    pub fn ack(&mut self, n: usize) {
        let n = n.min(self.queue.len());
        self.queue.drain(..n);
        self.next_seq += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hash: u64) -> BlockChange {
        BlockChange::Stored { hash, tier: Tier::Device, codec: "native".into(), bytes: 1 }
    }

    fn hashes(changes: &[BlockChange]) -> Vec<u64> {
        changes
            .iter()
            .map(|c| match c {
                BlockChange::Stored { hash, .. } | BlockChange::Removed { hash, .. } => *hash,
            })
            .collect()
    }

    #[test]
    fn sequence_numbers_are_consecutive_across_batches() {
        let (mut log, mut rx) = EventLog::channel(8);
        assert_eq!(log.last_seq(), 0);
        assert!(log.push(&mut vec![stored(1), stored(2)]));
        assert!(log.push(&mut Vec::new()), "nothing to report uses no number");
        assert!(log.push(&mut vec![stored(3)]));
        assert_eq!(log.last_seq(), 3);
        let a = rx.try_recv().unwrap();
        let b = rx.try_recv().unwrap();
        assert_eq!((a.first_seq, a.end_seq()), (1, 3));
        assert_eq!((b.first_seq, b.end_seq()), (3, 4));
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn a_full_queue_drops_without_blocking_and_leaves_a_visible_hole() {
        let (mut log, mut rx) = EventLog::channel(1);
        assert!(log.push(&mut vec![stored(1)]));
        assert!(!log.push(&mut vec![stored(2)]), "the channel holds one batch");
        assert_eq!(log.dropped(), 1);
        let mut out = Outbox::new(100);
        out.snapshot_taken(0);
        out.accept(rx.try_recv().unwrap());
        assert!(!out.snapshot_needed());
        // The next batch starts at 3, not 2: the outbox drops its queue and wants a snapshot.
        assert!(log.push(&mut vec![stored(3)]));
        out.accept(rx.try_recv().unwrap());
        assert!(out.snapshot_needed());
        assert!(out.is_empty());
        assert_eq!(out.overflows(), 1);
    }

    #[test]
    fn overflow_drops_the_queue_for_a_snapshot_and_later_changes_follow_it() {
        let mut out = Outbox::new(4);
        assert!(out.snapshot_needed(), "the first report is a snapshot");
        out.snapshot_taken(0);
        out.accept(SeqBatch { first_seq: 1, changes: vec![stored(1), stored(2), stored(3)] });
        assert_eq!(out.front(2), (1, vec![stored(1), stored(2)]));
        out.ack(2);
        assert_eq!(out.front(10), (3, vec![stored(3)]));
        out.accept(SeqBatch { first_seq: 4, changes: (4..=8).map(stored).collect() });
        assert!(out.snapshot_needed(), "5 queued changes exceed the bound of 4");
        assert!(out.is_empty());
        // While the snapshot is pending, batches are held; the snapshot (taken at 9) covers the first of them.
        out.accept(SeqBatch { first_seq: 9, changes: vec![stored(9)] });
        out.accept(SeqBatch { first_seq: 10, changes: vec![stored(10), stored(11)] });
        out.snapshot_taken(9);
        assert!(!out.snapshot_needed());
        let (first, changes) = out.front(10);
        assert_eq!((first, hashes(&changes)), (10, vec![10, 11]));
        // A snapshot that covers half of a held batch keeps only the rest.
        out.request_snapshot();
        out.accept(SeqBatch { first_seq: 12, changes: vec![stored(12), stored(13)] });
        out.snapshot_taken(12);
        assert_eq!(out.front(10), (13, vec![stored(13)]));
        // An empty front at the frontier is a heartbeat at the next sequence number.
        out.ack(1);
        assert_eq!(out.front(10), (14, vec![]));
    }
}
