//! The replicated commands and their wire form: validation of client requests into directory types, applying a
//! [`Command`](pagoda_proto::kvstore::Command) to a [`BlockDirectory`], and the directory's snapshot encoding.
//!
//! The node applies committed raft entries through [`apply_command`]; a watcher (the router's in-memory index) applies
//! the same commands from `Watch` through the same function, so both sides stay identical by construction.

use pagoda_proto::kvstore as pb;
use pb::command::Op;

use crate::directory::{
    ApplyOutcome, BlockDirectory, BlockEvent, EventBatch, Residency, Tier, TierOccupancy, WorkerLoad, WorkerRecord,
};

/// Most events in one Publish (one raft entry).
pub const MAX_EVENTS_PER_BATCH: usize = 65_536;
/// Longest worker id and address.
pub const MAX_NAME_LEN: usize = 256;
/// Longest codec name of a block copy: the bound the workers' disk tier and peer transfers share.
pub const MAX_CODEC_LEN: usize = pagoda_proto::MAX_CODEC_NAME_BYTES;

/// Bytes a protobuf varint of `v` takes.
const fn varint_len(v: usize) -> usize {
    let mut n = 1;
    let mut v = v >> 7;
    while v > 0 {
        n += 1;
        v >>= 7;
    }
    n
}

/// Bytes a length-delimited field (a string or a message) of `len` bytes takes with its 1-byte tag.
const fn field_len(len: usize) -> usize {
    1 + varint_len(len) + len
}

/// A u64 field at `u64::MAX` with its tag: ten 7-bit groups.
const U64_FIELD: usize = 1 + 10;
/// A known tier (enum value < 128) with its tag.
const TIER_FIELD: usize = 1 + 1;
/// The longest one `BlockCopy` encodes to inside a snapshot request: hash and bytes at `u64::MAX`, a codec of
/// [`MAX_CODEC_LEN`].
const MAX_COPY_BYTES: usize = field_len(U64_FIELD + TIER_FIELD + field_len(MAX_CODEC_LEN) + U64_FIELD);
/// The longest a load report encodes to as a field: [`MAX_OCCUPANCY_ROWS`] rows of longest codecs with every counter
/// at its maximum.
const MAX_LOAD_BYTES: usize = field_len(
    MAX_OCCUPANCY_ROWS * field_len(TIER_FIELD + field_len(MAX_CODEC_LEN) + 2 * U64_FIELD) + 2 * (1 + 5) + 3 * U64_FIELD,
);
/// The longest everything but the copies of a snapshot request encodes to: a worker id of [`MAX_NAME_LEN`], epoch
/// and seq, and the longest load report.
const MAX_SNAPSHOT_FIXED_BYTES: usize = field_len(MAX_NAME_LEN) + 2 * U64_FIELD + MAX_LOAD_BYTES;
/// Room left in a snapshot request under the message limit, so that a field added later does not push a worker at
/// the cap over it.
const SNAPSHOT_MARGIN_BYTES: usize = crate::server::MAX_CLIENT_MESSAGE_BYTES / 16;
/// Most block copies in one PublishSnapshot: as many as fit in one client message in the worst case (see
/// [`MAX_COPY_BYTES`]), less a margin. A larger cap would admit workers that can never publish their snapshot (the
/// message limit refuses it) and so stay stuck on `snapshot_required`.
pub const MAX_SNAPSHOT_BLOCKS: usize =
    (crate::server::MAX_CLIENT_MESSAGE_BYTES - SNAPSHOT_MARGIN_BYTES - MAX_SNAPSHOT_FIXED_BYTES) / MAX_COPY_BYTES;
/// The longest one worker's record encodes to in a directory snapshot: id and address of [`MAX_NAME_LEN`], three
/// counters at `u64::MAX`, the longest load report.
const MAX_WORKER_INFO_BYTES: usize = field_len(2 * field_len(MAX_NAME_LEN) + 3 * U64_FIELD + MAX_LOAD_BYTES);
/// The most one block copy of a worker id of `worker_len` bytes and a codec of `codec_len` bytes adds to a
/// directory snapshot: hash and bytes at their longest varints, and the block entry and hash paid alone (a block
/// with more copies shares them, so it costs less).
pub const fn directory_copy_bytes(worker_len: usize, codec_len: usize) -> usize {
    field_len(U64_FIELD + field_len(field_len(worker_len) + TIER_FIELD + field_len(codec_len) + U64_FIELD))
}
/// Room left under the raft message limit beside the directory: the raft `Message` and snapshot metadata around it,
/// the membership list, the other messages of the same `RaftBatch` (heartbeats: raft sends a peer nothing else
/// while its snapshot is out), the `WatchEvent` framing, and fields added later.
const DIRECTORY_MARGIN_BYTES: usize = crate::transport::MAX_RAFT_MESSAGE_BYTES / 8;
/// Snapshot bytes the whole directory's block copies may take, each counted at [`directory_copy_bytes`] (about
/// 224 MiB: 640 thousand copies at the longest names, 5 to 6 million under names like `worker-12` and `f16`). The
/// directory travels whole in one raft snapshot message and one Watch snapshot event, both capped at
/// [`crate::transport::MAX_RAFT_MESSAGE_BYTES`]; a directory that outgrew it could never reach a new or lagging node
/// nor a new watcher. So the budget is that message less [`crate::directory::MAX_WORKERS`] records of
/// [`MAX_WORKER_INFO_BYTES`] and [`DIRECTORY_MARGIN_BYTES`]. It is counted in bytes, not copies: a count sized for
/// the longest names would keep a seventh of what fits under real ones.
pub const MAX_DIRECTORY_COPY_BUDGET_BYTES: usize = crate::transport::MAX_RAFT_MESSAGE_BYTES
    - DIRECTORY_MARGIN_BYTES
    - crate::directory::MAX_WORKERS * MAX_WORKER_INFO_BYTES
    - DIRECTORY_FRAMING_BYTES;
/// The directory message's own tags and length varints around its workers and blocks.
const DIRECTORY_FRAMING_BYTES: usize = 64;
/// Most hashes (or prefix-chain entries) one Read may ask about.
pub const MAX_READ_HASHES: usize = 65_536;

/// What applying one command did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Published(ApplyOutcome),
    Registered,
    WorkerRemoved(bool),
    SnapshotApplied,
    /// The directory refused the command (unknown worker, stale epoch, ...); nothing changed.
    Rejected(String),
}

fn tier_from(v: i32) -> Result<Tier, String> {
    match pb::Tier::try_from(v) {
        Ok(pb::Tier::Device) => Ok(Tier::Device),
        Ok(pb::Tier::Host) => Ok(Tier::Host),
        Ok(pb::Tier::Disk) => Ok(Tier::Disk),
        Err(_) => Err(format!("unknown tier {v}")),
    }
}

pub fn tier_to(t: Tier) -> i32 {
    match t {
        Tier::Device => pb::Tier::Device as i32,
        Tier::Host => pb::Tier::Host as i32,
        Tier::Disk => pb::Tier::Disk as i32,
    }
}

fn check_name(what: &str, s: &str, max: usize) -> Result<(), String> {
    if s.is_empty() {
        return Err(format!("{what} is empty"));
    }
    if s.len() > max {
        return Err(format!("{what} is {} bytes (at most {max})", s.len()));
    }
    Ok(())
}

fn check_codec(codec: &str) -> Result<(), String> {
    check_name("codec", codec, MAX_CODEC_LEN)
}

/// A client's Publish as a directory batch, or why it is invalid.
pub fn batch_from(req: &pb::PublishRequest) -> Result<EventBatch, String> {
    check_name("worker", &req.worker, MAX_NAME_LEN)?;
    if req.first_seq == 0 {
        return Err("sequence numbers start at 1".into());
    }
    if req.events.len() > MAX_EVENTS_PER_BATCH {
        return Err(format!("{} events in one batch (at most {MAX_EVENTS_PER_BATCH})", req.events.len()));
    }
    if req.first_seq.checked_add(req.events.len() as u64).is_none() {
        return Err("sequence range overflows".into());
    }
    let mut events = Vec::with_capacity(req.events.len());
    for (i, e) in req.events.iter().enumerate() {
        let event = match &e.kind {
            Some(pb::block_event::Kind::Stored(s)) => {
                check_codec(&s.codec)?;
                BlockEvent::Stored { hash: s.hash, tier: tier_from(s.tier)?, codec: s.codec.clone(), bytes: s.bytes }
            }
            Some(pb::block_event::Kind::Removed(r)) => {
                check_codec(&r.codec)?;
                BlockEvent::Removed { hash: r.hash, tier: tier_from(r.tier)?, codec: r.codec.clone() }
            }
            Some(pb::block_event::Kind::Cleared(_)) => BlockEvent::Cleared,
            None => return Err(format!("event {i} has no kind")),
        };
        events.push(event);
    }
    let load = req.load.as_ref().map(load_from).transpose()?;
    Ok(EventBatch { worker: req.worker.clone(), epoch: req.epoch, first_seq: req.first_seq, events, load })
}

/// Most (tier, codec) rows in one occupancy report.
pub const MAX_OCCUPANCY_ROWS: usize = 64;

/// A load report as the directory's type, or why it is invalid.
pub fn load_from(load: &pb::WorkerLoad) -> Result<WorkerLoad, String> {
    if load.occupancy.len() > MAX_OCCUPANCY_ROWS {
        return Err(format!("{} occupancy rows (at most {MAX_OCCUPANCY_ROWS})", load.occupancy.len()));
    }
    let mut occupancy = Vec::with_capacity(load.occupancy.len());
    for o in &load.occupancy {
        if o.codec.len() > MAX_CODEC_LEN {
            return Err(format!("codec is {} bytes (at most {MAX_CODEC_LEN})", o.codec.len()));
        }
        occupancy.push(TierOccupancy {
            tier: tier_from(o.tier)?,
            codec: o.codec.clone(),
            used_bytes: o.used_bytes,
            capacity_bytes: o.capacity_bytes,
        });
    }
    Ok(WorkerLoad {
        occupancy,
        running: load.running,
        waiting: load.waiting,
        free_blocks: load.free_blocks,
        total_blocks: load.total_blocks,
        reported_at_ms: load.reported_at_ms,
    })
}

pub fn load_to(load: &WorkerLoad) -> pb::WorkerLoad {
    pb::WorkerLoad {
        occupancy: load
            .occupancy
            .iter()
            .map(|o| pb::TierOccupancy {
                tier: tier_to(o.tier),
                codec: o.codec.clone(),
                used_bytes: o.used_bytes,
                capacity_bytes: o.capacity_bytes,
            })
            .collect(),
        running: load.running,
        waiting: load.waiting,
        free_blocks: load.free_blocks,
        total_blocks: load.total_blocks,
        reported_at_ms: load.reported_at_ms,
    }
}

/// Validates any command before it is proposed, so that only well-formed commands reach the log.
pub fn validate(cmd: &pb::Command) -> Result<(), String> {
    match &cmd.op {
        Some(Op::Publish(p)) => batch_from(p).map(|_| ()),
        Some(Op::Register(r)) => {
            check_name("worker", &r.worker, MAX_NAME_LEN)?;
            if r.address.len() > MAX_NAME_LEN {
                return Err(format!("address is {} bytes (at most {MAX_NAME_LEN})", r.address.len()));
            }
            Ok(())
        }
        Some(Op::RemoveWorker(r)) => check_name("worker", &r.worker, MAX_NAME_LEN),
        Some(Op::WorkerSnapshot(s)) => {
            check_name("worker", &s.worker, MAX_NAME_LEN)?;
            if s.seq == u64::MAX {
                return Err(format!("snapshot seq {} leaves no sequence number for the next event", s.seq));
            }
            if s.blocks.len() > MAX_SNAPSHOT_BLOCKS {
                return Err(format!("{} blocks in one snapshot (at most {MAX_SNAPSHOT_BLOCKS})", s.blocks.len()));
            }
            for b in &s.blocks {
                tier_from(b.tier)?;
                check_codec(&b.codec)?;
            }
            s.load.as_ref().map(load_from).transpose()?;
            Ok(())
        }
        None => Err("command has no op".into()),
    }
}

/// Applies one command. Deterministic: every replica (and every watcher) gets the same outcome.
pub fn apply_command(dir: &mut BlockDirectory, cmd: &pb::Command) -> Outcome {
    let rejected = |e: &dyn std::fmt::Display| Outcome::Rejected(e.to_string());
    match &cmd.op {
        Some(Op::Publish(p)) => match batch_from(p) {
            Ok(batch) => match dir.apply(&batch) {
                Ok(o) => Outcome::Published(o),
                Err(e) => rejected(&e),
            },
            Err(e) => Outcome::Rejected(e),
        },
        Some(Op::Register(r)) => match dir.register_worker(&r.worker, &r.address, r.epoch) {
            Ok(()) => Outcome::Registered,
            Err(e) => rejected(&e),
        },
        Some(Op::RemoveWorker(r)) => Outcome::WorkerRemoved(dir.remove_worker(&r.worker)),
        Some(Op::WorkerSnapshot(s)) => {
            let mut copies = Vec::with_capacity(s.blocks.len());
            for b in &s.blocks {
                match tier_from(b.tier) {
                    Ok(t) => copies.push((b.hash, t, b.codec.clone(), b.bytes)),
                    Err(e) => return Outcome::Rejected(e),
                }
            }
            let load = match s.load.as_ref().map(load_from).transpose() {
                Ok(l) => l,
                Err(e) => return Outcome::Rejected(e),
            };
            match dir.apply_snapshot(&s.worker, s.epoch, s.seq, &copies, load.as_ref()) {
                Ok(()) => Outcome::SnapshotApplied,
                Err(e) => rejected(&e),
            }
        }
        None => Outcome::Rejected("command has no op".into()),
    }
}

pub fn worker_info(id: &str, r: &WorkerRecord) -> pb::WorkerInfo {
    pb::WorkerInfo {
        worker: id.to_string(),
        address: r.address.clone(),
        epoch: r.epoch,
        applied_seq: r.applied_seq,
        blocks: r.blocks,
        load: r.load.as_ref().map(load_to),
    }
}

pub fn block_entry(hash: u64, copies: &[Residency]) -> pb::BlockEntry {
    pb::BlockEntry {
        hash,
        copies: copies
            .iter()
            .map(|r| pb::Residency {
                worker: r.worker.clone(),
                tier: tier_to(r.tier),
                codec: r.codec.clone(),
                bytes: r.bytes,
            })
            .collect(),
    }
}

/// The whole directory as a message (snapshots and Watch catch-up).
/// The record a [`pb::WorkerInfo`] describes, with its load report already decoded (callers differ in what an
/// undecodable one means: a corrupt snapshot, or just no load).
pub fn worker_record_from(w: &pb::WorkerInfo, load: Option<WorkerLoad>) -> WorkerRecord {
    WorkerRecord { address: w.address.clone(), epoch: w.epoch, applied_seq: w.applied_seq, blocks: w.blocks, load }
}

pub fn directory_to_proto(dir: &BlockDirectory) -> pb::DirectorySnapshot {
    pb::DirectorySnapshot {
        workers: dir.workers().map(|(id, r)| worker_info(id, r)).collect(),
        blocks: dir.blocks().map(|(h, copies)| block_entry(*h, copies)).collect(),
    }
}

/// Rebuilds a directory from its message; an unknown tier is an error (the snapshot is corrupt or from a newer
/// version).
pub fn directory_from_proto(snap: &pb::DirectorySnapshot) -> Result<BlockDirectory, String> {
    let mut workers = Vec::with_capacity(snap.workers.len());
    for w in &snap.workers {
        let load = w.load.as_ref().map(load_from).transpose()?;
        workers.push((w.worker.clone(), worker_record_from(w, load)));
    }
    let mut blocks = Vec::with_capacity(snap.blocks.len());
    for b in &snap.blocks {
        let mut copies = Vec::with_capacity(b.copies.len());
        for c in &b.copies {
            copies.push(Residency {
                worker: c.worker.clone(),
                tier: tier_from(c.tier)?,
                codec: c.codec.clone(),
                bytes: c.bytes,
            });
        }
        blocks.push((b.hash, copies));
    }
    Ok(BlockDirectory::from_parts(workers, blocks))
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;

    fn stored(hash: u64) -> pb::BlockEvent {
        pb::BlockEvent {
            kind: Some(pb::block_event::Kind::Stored(pb::Stored {
                hash,
                tier: pb::Tier::Host as i32,
                codec: "int8".into(),
                bytes: 64,
            })),
        }
    }

    fn publish(first_seq: u64, events: Vec<pb::BlockEvent>) -> pb::Command {
        pb::Command {
            op: Some(Op::Publish(pb::PublishRequest { worker: "w".into(), epoch: 1, first_seq, events, load: None })),
        }
    }

    #[test]
    fn commands_apply_and_the_directory_round_trips_through_its_snapshot() {
        let mut dir = BlockDirectory::new();
        let reg = pb::Command {
            op: Some(Op::Register(pb::RegisterRequest { worker: "w".into(), address: "a:1".into(), epoch: 1 })),
        };
        assert_eq!(apply_command(&mut dir, &reg), Outcome::Registered);
        assert_eq!(
            apply_command(&mut dir, &publish(1, vec![stored(1), stored(2)])),
            Outcome::Published(ApplyOutcome::Applied { applied: 2, skipped: 0 })
        );
        assert_eq!(
            apply_command(&mut dir, &publish(5, vec![stored(3)])),
            Outcome::Published(ApplyOutcome::Gap { expected: 3, got: 5 })
        );
        let back = directory_from_proto(&directory_to_proto(&dir)).unwrap();
        assert_eq!(back.residency(1), dir.residency(1));
        assert_eq!(back.residency(2)[0].tier, Tier::Host);
        assert_eq!(back.worker("w"), dir.worker("w"));
        assert_eq!(back.block_count(), 2);
    }

    #[test]
    fn invalid_requests_are_refused_before_the_log() {
        let bad_tier = pb::BlockEvent {
            kind: Some(pb::block_event::Kind::Stored(pb::Stored { hash: 1, tier: 7, codec: "f32".into(), bytes: 1 })),
        };
        assert!(validate(&publish(1, vec![bad_tier])).unwrap_err().contains("tier"));
        assert!(validate(&publish(0, vec![stored(1)])).unwrap_err().contains("start at 1"));
        assert!(validate(&publish(1, vec![pb::BlockEvent { kind: None }])).is_err());
        assert!(validate(&publish(u64::MAX, vec![stored(1)])).is_err());
        assert!(validate(&pb::Command { op: None }).is_err());
        let long = pb::Command {
            op: Some(Op::RemoveWorker(pb::RemoveWorkerRequest { worker: "x".repeat(MAX_NAME_LEN + 1) })),
        };
        assert!(validate(&long).is_err());
        let last_seq = pb::Command {
            op: Some(Op::WorkerSnapshot(pb::WorkerSnapshotRequest {
                worker: "w".into(),
                epoch: 1,
                seq: u64::MAX,
                ..Default::default()
            })),
        };
        assert!(validate(&last_seq).unwrap_err().contains("no sequence number"));
        let unknown = pb::Command {
            op: Some(Op::Publish(pb::PublishRequest {
                worker: "nobody".into(),
                epoch: 1,
                first_seq: 1,
                events: vec![],
                load: None,
            })),
        };
        assert!(matches!(apply_command(&mut BlockDirectory::new(), &unknown), Outcome::Rejected(_)));
    }

    #[test]
    fn a_worst_case_snapshot_at_the_cap_fits_in_one_client_message() {
        let codec = "c".repeat(MAX_CODEC_LEN);
        let copy = pb::BlockCopy { hash: u64::MAX, tier: pb::Tier::Disk as i32, codec: codec.clone(), bytes: u64::MAX };
        let row = pb::TierOccupancy {
            tier: pb::Tier::Disk as i32,
            codec: codec.clone(),
            used_bytes: u64::MAX,
            capacity_bytes: u64::MAX,
        };
        let req = pb::WorkerSnapshotRequest {
            worker: "w".repeat(MAX_NAME_LEN),
            epoch: u64::MAX,
            seq: u64::MAX - 1,
            blocks: vec![copy; MAX_SNAPSHOT_BLOCKS],
            load: Some(pb::WorkerLoad {
                occupancy: vec![row; MAX_OCCUPANCY_ROWS],
                running: u32::MAX,
                waiting: u32::MAX,
                free_blocks: u64::MAX,
                total_blocks: u64::MAX,
                reported_at_ms: u64::MAX,
            }),
        };
        let cmd = pb::Command { op: Some(Op::WorkerSnapshot(req)) };
        assert_eq!(validate(&cmd), Ok(()), "the worst case at the cap is a valid request");
        let Some(Op::WorkerSnapshot(req)) = &cmd.op else { unreachable!() };
        let len = req.encoded_len();
        assert!(
            len + SNAPSHOT_MARGIN_BYTES <= crate::server::MAX_CLIENT_MESSAGE_BYTES,
            "{len} bytes at the cap of {MAX_SNAPSHOT_BLOCKS} copies leave no margin under the client message limit"
        );
        // The derivation is tight: one copy more per margin's worth would not fit.
        assert!(len + SNAPSHOT_MARGIN_BYTES + MAX_COPY_BYTES > crate::server::MAX_CLIENT_MESSAGE_BYTES, "{len}");
        assert_eq!(crate::directory::MAX_COPIES_PER_WORKER, MAX_SNAPSHOT_BLOCKS as u64);
    }

    /// The directory at its worker cap with every field at its longest, and `copies` copies, each its own block.
    fn worst_case_directory(copies: u64) -> BlockDirectory {
        let codec = "c".repeat(MAX_CODEC_LEN);
        let load = WorkerLoad {
            occupancy: vec![
                TierOccupancy {
                    tier: Tier::Disk,
                    codec: codec.clone(),
                    used_bytes: u64::MAX,
                    capacity_bytes: u64::MAX
                };
                MAX_OCCUPANCY_ROWS
            ],
            running: u32::MAX,
            waiting: u32::MAX,
            free_blocks: u64::MAX,
            total_blocks: u64::MAX,
            reported_at_ms: u64::MAX,
        };
        let name = |i: usize| format!("{i:0>width$}", width = MAX_NAME_LEN);
        let record = WorkerRecord {
            address: "a".repeat(MAX_NAME_LEN),
            epoch: u64::MAX,
            applied_seq: u64::MAX,
            blocks: u64::MAX,
            load: Some(load),
        };
        let workers = (0..crate::directory::MAX_WORKERS).map(|i| (name(i), record.clone()));
        // Hashes at the top of the range take the longest varint.
        let blocks = (0..copies).map(|i| {
            let copy = Residency { worker: name(0), tier: Tier::Disk, codec: codec.clone(), bytes: u64::MAX };
            (u64::MAX - i, vec![copy])
        });
        BlockDirectory::from_parts(workers, blocks)
    }

    #[test]
    fn a_worst_case_directory_at_the_copy_cap_fits_in_one_raft_message() {
        let limit = crate::transport::MAX_RAFT_MESSAGE_BYTES;
        // A scaled-down directory through the real encoders, then the per-copy cost scaled up to the cap: building
        // the full 200+ MiB directory would make this test slow and memory hungry.
        const SAMPLE: u64 = 2_000;
        let empty = worst_case_directory(0);
        let sample = worst_case_directory(SAMPLE);
        assert_eq!(sample.copy_count(), SAMPLE);
        let raft_len = |d: &BlockDirectory| {
            pb::SnapshotData { directory: Some(directory_to_proto(d)), members: Vec::new() }.encoded_len()
        };
        let watch_len = |d: &BlockDirectory| {
            pb::WatchEvent { index: u64::MAX, body: Some(pb::watch_event::Body::Snapshot(directory_to_proto(d))) }
                .encoded_len()
        };
        for (what, len) in [("raft snapshot", &raft_len as &dyn Fn(&BlockDirectory) -> usize), ("watch", &watch_len)] {
            let base = len(&empty);
            let with_copies = len(&sample);
            assert!(base <= crate::directory::MAX_WORKERS * MAX_WORKER_INFO_BYTES + 16, "{what}: {base}");
            // The derived per-copy size is what the encoder spends (up to the outer length varints).
            let per_copy = (with_copies - base) as f64 / SAMPLE as f64;
            assert!(
                (per_copy - directory_copy_bytes(MAX_NAME_LEN, MAX_CODEC_LEN) as f64).abs() < 0.01,
                "{what}: {per_copy} per copy"
            );
            let at_cap = base + MAX_DIRECTORY_COPY_BUDGET_BYTES;
            assert!(
                at_cap + DIRECTORY_MARGIN_BYTES <= limit,
                "{what}: {at_cap} bytes at the copy budget leave no margin under {limit}"
            );
        }
        // Under short names each copy costs what `directory_copy_bytes` charges for them, or less (copies of one
        // block share its entry).
        let short = |copies_per_block: u64| {
            let copy = |w: u64| Residency {
                worker: format!("worker-{w}"),
                tier: Tier::Host,
                codec: "f16".into(),
                bytes: 737_280,
            };
            let blocks = (0..SAMPLE).map(|i| (u64::MAX - i, (0..copies_per_block).map(|w| copy(10 + w)).collect()));
            BlockDirectory::from_parts(std::iter::empty(), blocks)
        };
        for copies_per_block in [1, 3] {
            let d = short(copies_per_block);
            let per_copy = (raft_len(&d) - raft_len(&short(0))) as f64 / (SAMPLE * copies_per_block) as f64;
            assert!(per_copy <= directory_copy_bytes("worker-10".len(), 3) as f64, "{per_copy} per copy");
        }
        let fits =
            |worker_len, codec_len| MAX_DIRECTORY_COPY_BUDGET_BYTES / directory_copy_bytes(worker_len, codec_len);
        assert!(fits(MAX_NAME_LEN, MAX_CODEC_LEN) > 600_000, "{}", fits(MAX_NAME_LEN, MAX_CODEC_LEN));
        assert!(fits("worker-10".len(), 3) > 5_000_000, "{}", fits("worker-10".len(), 3));
    }
}
