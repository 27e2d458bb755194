//! Durable raft storage on redb: the log, the hard state, the conf state and the latest snapshot of one node.
//!
//! [`RaftStore`] implements raft-rs's [`raft::Storage`] (read side, called by the `RawNode`) and offers the write
//! side to the node actor that owns it: append entries and hard state in one transaction per `Ready`, apply a
//! snapshot received from the leader, and compact the log behind a snapshot taken locally. Only what raft needs
//! lives here; the directory itself is the state machine's (it reaches this store only as snapshot bytes).

use std::path::Path;

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, StorageError};
use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition};
use thiserror::Error;

const ENTRIES: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_entries");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");
const HARD_STATE: &str = "hard_state";
const CONF_STATE: &str = "conf_state";
const SNAPSHOT_META: &str = "snapshot_meta";
const SNAPSHOT_DATA: &str = "snapshot_data";

/// The index and term a freshly bootstrapped cluster starts from. Starting above zero means a node that joins later
/// (empty log) can only catch up through a snapshot, which carries the initial membership; replaying the log from
/// index 1 would not.
pub const BOOTSTRAP_INDEX: u64 = 1;
pub const BOOTSTRAP_TERM: u64 = 1;

/// Errors of the durable store.
#[derive(Debug, Error)]
pub enum StoreError {
    #[error("raft storage: {0}")]
    Db(Box<redb::Error>),
    #[error("raft storage: corrupt {what}: {source}")]
    Decode { what: &'static str, source: protobuf::ProtobufError },
    #[error("raft storage: {0}")]
    Invalid(String),
}

fn dbe<E: Into<redb::Error>>(e: E) -> StoreError {
    StoreError::Db(Box::new(e.into()))
}

fn decode<M: protobuf::Message + Default>(what: &'static str, bytes: &[u8]) -> Result<M, StoreError> {
    let mut m = M::default();
    m.merge_from_bytes(bytes).map_err(|source| StoreError::Decode { what, source })?;
    Ok(m)
}

fn encode<M: protobuf::Message>(m: &M) -> Result<Vec<u8>, StoreError> {
    m.write_to_bytes().map_err(|source| StoreError::Decode { what: "message (encode)", source })
}

fn to_raft(e: StoreError) -> raft::Error {
    raft::Error::Store(StorageError::Other(Box::new(e)))
}

/// One node's raft log and state in a redb file. Indexes `first_index..=last_index` are in the log; everything up to
/// `snapshot.index` is covered by the stored snapshot.
pub struct RaftStore {
    db: Database,
    hard_state: HardState,
    conf_state: ConfState,
    snapshot: SnapshotMetadata,
    last_index: u64,
}

impl RaftStore {
    /// Opens (or creates) the store at `path` and loads its state: a node restarts from here.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let db = Database::create(path).map_err(dbe)?;
        let txn = db.begin_write().map_err(dbe)?;
        {
            txn.open_table(ENTRIES).map_err(dbe)?;
            txn.open_table(META).map_err(dbe)?;
        }
        txn.commit().map_err(dbe)?;

        let read = db.begin_read().map_err(dbe)?;
        let meta = read.open_table(META).map_err(dbe)?;
        let load = |key: &str| -> Result<Option<Vec<u8>>, StoreError> {
            Ok(meta.get(key).map_err(dbe)?.map(|v| v.value().to_vec()))
        };
        let hard_state: HardState = match load(HARD_STATE)? {
            Some(b) => decode("hard state", &b)?,
            None => HardState::default(),
        };
        let conf_state: ConfState = match load(CONF_STATE)? {
            Some(b) => decode("conf state", &b)?,
            None => ConfState::default(),
        };
        let snapshot: SnapshotMetadata = match load(SNAPSHOT_META)? {
            Some(b) => decode("snapshot metadata", &b)?,
            None => SnapshotMetadata::default(),
        };
        let entries = read.open_table(ENTRIES).map_err(dbe)?;
        let last_index = match entries.last().map_err(dbe)? {
            Some((k, _)) => k.value(),
            None => snapshot.index,
        };
        drop(entries);
        drop(meta);
        drop(read);
        let store = Self { db, hard_state, conf_state, snapshot, last_index };
        store.check()?;
        Ok(store)
    }

    /// Refuses a damaged store: raft-rs panics on one (a commit index past the log at start, an entry it cannot read
    /// once it applies it), where a node must fail to start with an error naming the damage.
    fn check(&self) -> Result<(), StoreError> {
        let (snapshot, commit, last) = (self.snapshot.index, self.hard_state.commit, self.last_index);
        if commit < snapshot || commit > last {
            return Err(StoreError::Invalid(format!(
                "commit index {commit} outside the stored log (snapshot at {snapshot}, last entry {last})"
            )));
        }
        let read = self.db.begin_read().map_err(dbe)?;
        let table = read.open_table(ENTRIES).map_err(dbe)?;
        for (expected, item) in (snapshot + 1..).zip(table.iter().map_err(dbe)?) {
            let (k, v) = item.map_err(dbe)?;
            if k.value() != expected {
                return Err(StoreError::Invalid(format!("log entry {} where {expected} was expected", k.value())));
            }
            let e: Entry = decode("entry", v.value())?;
            if e.index != expected {
                return Err(StoreError::Invalid(format!("entry under key {expected} has index {}", e.index)));
            }
        }
        Ok(())
    }

    /// Whether this store already belongs to a cluster (it has a membership or a snapshot).
    pub fn is_initialized(&self) -> bool {
        !self.conf_state.voters.is_empty() || self.snapshot.index > 0
    }

    /// Makes this store the start of a new cluster of `voters`: a snapshot at [`BOOTSTRAP_INDEX`] holding `data` (the
    /// initial state machine). Every initial voter bootstraps identically.
    pub fn bootstrap(&mut self, voters: &[u64], data: Vec<u8>) -> Result<(), StoreError> {
        if self.is_initialized() {
            return Err(StoreError::Invalid("bootstrap of an initialized store".into()));
        }
        let mut snap = Snapshot::default();
        let meta = snap.mut_metadata();
        meta.index = BOOTSTRAP_INDEX;
        meta.term = BOOTSTRAP_TERM;
        meta.mut_conf_state().voters = voters.to_vec();
        snap.data = data;
        self.apply_snapshot(&snap)
    }

    pub fn hard_state(&self) -> &HardState {
        &self.hard_state
    }

    pub fn conf_state(&self) -> &ConfState {
        &self.conf_state
    }

    /// The metadata of the latest snapshot (index 0 when there is none).
    pub fn snapshot_metadata(&self) -> &SnapshotMetadata {
        &self.snapshot
    }

    pub fn first(&self) -> u64 {
        self.snapshot.index + 1
    }

    pub fn last(&self) -> u64 {
        self.last_index
    }

    /// The data of the latest snapshot (empty when there is none).
    pub fn snapshot_data(&self) -> Result<Vec<u8>, StoreError> {
        let read = self.db.begin_read().map_err(dbe)?;
        let meta = read.open_table(META).map_err(dbe)?;
        Ok(meta.get(SNAPSHOT_DATA).map_err(dbe)?.map(|v| v.value().to_vec()).unwrap_or_default())
    }

    /// Persists new log entries (replacing any conflicting suffix) and the hard state in one durable transaction.
    pub fn append(&mut self, entries: &[Entry], hard_state: Option<&HardState>) -> Result<(), StoreError> {
        if entries.is_empty() && hard_state.is_none() {
            return Ok(());
        }
        let mut hs = hard_state.cloned().unwrap_or_else(|| self.hard_state.clone());
        hs.commit = hs.commit.max(self.hard_state.commit);
        if let Some(first) = entries.first()
            && first.index <= self.snapshot.index
        {
            return Err(StoreError::Invalid(format!(
                "append at index {} behind the snapshot at {}",
                first.index, self.snapshot.index
            )));
        }
        let txn = self.db.begin_write().map_err(dbe)?;
        {
            let mut table = txn.open_table(ENTRIES).map_err(dbe)?;
            if let Some(first) = entries.first()
                && first.index <= self.last_index
            {
                // A new leader overwrote our uncommitted tail.
                table.retain_in(first.index.., |_, _| false).map_err(dbe)?;
            }
            for e in entries {
                table.insert(e.index, encode(e)?.as_slice()).map_err(dbe)?;
            }
            let mut meta = txn.open_table(META).map_err(dbe)?;
            meta.insert(HARD_STATE, encode(&hs)?.as_slice()).map_err(dbe)?;
        }
        txn.commit().map_err(dbe)?;
        if let Some(last) = entries.last() {
            self.last_index = last.index;
        }
        self.hard_state = hs;
        Ok(())
    }

    /// Notes a new commit index (a `LightReady` carries it without a full hard state). It reaches the disk with the
    /// next append or compaction: a lagging commit index on disk is safe, raft learns it again from the leader.
    pub fn set_commit(&mut self, commit: u64) {
        self.hard_state.commit = self.hard_state.commit.max(commit);
    }

    /// Persists the membership after a conf change was applied.
    pub fn set_conf_state(&mut self, cs: ConfState) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(dbe)?;
        {
            let mut meta = txn.open_table(META).map_err(dbe)?;
            meta.insert(CONF_STATE, encode(&cs)?.as_slice()).map_err(dbe)?;
        }
        txn.commit().map_err(dbe)?;
        self.conf_state = cs;
        Ok(())
    }

    /// Installs a snapshot from the leader (or the bootstrap one): it replaces the whole log.
    pub fn apply_snapshot(&mut self, snap: &Snapshot) -> Result<(), StoreError> {
        let meta = snap.get_metadata();
        if meta.index < self.snapshot.index {
            return Err(StoreError::Invalid(format!(
                "snapshot at {} older than the stored one at {}",
                meta.index, self.snapshot.index
            )));
        }
        let mut hs = self.hard_state.clone();
        hs.term = hs.term.max(meta.term);
        hs.commit = hs.commit.max(meta.index);
        let txn = self.db.begin_write().map_err(dbe)?;
        {
            let mut table = txn.open_table(ENTRIES).map_err(dbe)?;
            table.retain(|_, _| false).map_err(dbe)?;
            let mut m = txn.open_table(META).map_err(dbe)?;
            m.insert(SNAPSHOT_META, encode(meta)?.as_slice()).map_err(dbe)?;
            m.insert(SNAPSHOT_DATA, &snap.data[..]).map_err(dbe)?;
            m.insert(CONF_STATE, encode(meta.get_conf_state())?.as_slice()).map_err(dbe)?;
            m.insert(HARD_STATE, encode(&hs)?.as_slice()).map_err(dbe)?;
        }
        txn.commit().map_err(dbe)?;
        self.snapshot = meta.clone();
        self.conf_state = meta.get_conf_state().clone();
        self.hard_state = hs;
        self.last_index = meta.index;
        Ok(())
    }

    /// Stores a snapshot of the state machine taken at applied index `index` and drops the log up to it.
    pub fn compact(&mut self, index: u64, conf_state: ConfState, data: Vec<u8>) -> Result<(), StoreError> {
        if index <= self.snapshot.index {
            return Ok(());
        }
        if index > self.last_index || index > self.hard_state.commit {
            return Err(StoreError::Invalid(format!(
                "compaction to {index} past the log (last {}, commit {})",
                self.last_index, self.hard_state.commit
            )));
        }
        let term = self.term_of(index)?;
        let meta = SnapshotMetadata { index, term, conf_state: Some(conf_state) };
        let txn = self.db.begin_write().map_err(dbe)?;
        {
            let mut table = txn.open_table(ENTRIES).map_err(dbe)?;
            table.retain_in(..=index, |_, _| false).map_err(dbe)?;
            let mut m = txn.open_table(META).map_err(dbe)?;
            m.insert(SNAPSHOT_META, encode(&meta)?.as_slice()).map_err(dbe)?;
            m.insert(SNAPSHOT_DATA, data.as_slice()).map_err(dbe)?;
            // The restarted node resumes at this snapshot, so the commit index on disk must cover it.
            m.insert(HARD_STATE, encode(&self.hard_state)?.as_slice()).map_err(dbe)?;
        }
        txn.commit().map_err(dbe)?;
        self.snapshot = meta;
        Ok(())
    }

    /// Number of entries physically in the log table.
    pub fn stored_entries(&self) -> Result<u64, StoreError> {
        let read = self.db.begin_read().map_err(dbe)?;
        let table = read.open_table(ENTRIES).map_err(dbe)?;
        table.len().map_err(dbe)
    }

    fn term_of(&self, idx: u64) -> Result<u64, StoreError> {
        if idx == self.snapshot.index {
            return Ok(self.snapshot.term);
        }
        let read = self.db.begin_read().map_err(dbe)?;
        let table = read.open_table(ENTRIES).map_err(dbe)?;
        let bytes = table
            .get(idx)
            .map_err(dbe)?
            .ok_or_else(|| StoreError::Invalid(format!("entry {idx} missing from the log")))?;
        let e: Entry = decode("entry", bytes.value())?;
        Ok(e.term)
    }

    /// Entries `[low, high)`, at most `max_size` bytes (but at least one).
    pub fn read_entries(&self, low: u64, high: u64, max_size: Option<u64>) -> Result<Vec<Entry>, StoreError> {
        let read = self.db.begin_read().map_err(dbe)?;
        let table = read.open_table(ENTRIES).map_err(dbe)?;
        let mut out = Vec::with_capacity((high.saturating_sub(low)).min(1024) as usize);
        let mut size = 0u64;
        for item in table.range(low..high).map_err(dbe)? {
            let (k, v) = item.map_err(dbe)?;
            let bytes = v.value();
            if let Some(max) = max_size
                && !out.is_empty()
                && size + bytes.len() as u64 > max
            {
                break;
            }
            size += bytes.len() as u64;
            let e: Entry = decode("entry", bytes)?;
            if e.index != k.value() {
                return Err(StoreError::Invalid(format!("entry under key {} has index {}", k.value(), e.index)));
            }
            out.push(e);
        }
        Ok(out)
    }
}

impl raft::Storage for RaftStore {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState::new(self.hard_state.clone(), self.conf_state.clone()))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low < self.first() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last_index + 1 {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let entries = self.read_entries(low, high, max_size.into()).map_err(to_raft)?;
        if entries.first().map(|e| e.index) != Some(low) && low < high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        Ok(entries)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        if idx == self.snapshot.index {
            return Ok(self.snapshot.term);
        }
        if idx < self.first() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if idx > self.last_index {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        self.term_of(idx).map_err(to_raft)
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.first())
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last_index)
    }

    fn snapshot(&self, _request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        let mut snap = Snapshot::default();
        snap.set_metadata(self.snapshot.clone());
        snap.data = self.snapshot_data().map_err(to_raft)?;
        Ok(snap)
    }
}

#[cfg(test)]
mod tests {
    use raft::Storage as _;

    use super::*;

    fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
        Entry { index, term, data: data.to_vec(), ..Default::default() }
    }

    fn ctx() -> GetEntriesContext {
        GetEntriesContext::empty(false)
    }

    #[test]
    fn log_hard_state_and_snapshot_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raft.redb");
        {
            let mut s = RaftStore::open(&path).unwrap();
            assert!(!s.is_initialized());
            s.bootstrap(&[1, 2, 3], b"initial".to_vec()).unwrap();
            let mut hs = s.hard_state().clone();
            hs.vote = 2;
            hs.term = 3;
            s.append(&[entry(2, 3, b"a"), entry(3, 3, b"b"), entry(4, 3, b"c")], Some(&hs)).unwrap();
            s.set_commit(3);
            s.append(&[], Some(&hs.clone())).unwrap();
        }
        let s = RaftStore::open(&path).unwrap();
        assert!(s.is_initialized());
        let state = s.initial_state().unwrap();
        assert_eq!(state.conf_state.voters, vec![1, 2, 3]);
        assert_eq!((state.hard_state.term, state.hard_state.vote, state.hard_state.commit), (3, 2, 3));
        assert_eq!((s.first_index().unwrap(), s.last_index().unwrap()), (2, 4));
        let got = s.entries(2, 5, None, ctx()).unwrap();
        assert_eq!(
            got.iter().map(|e| e.data.to_vec()).collect::<Vec<_>>(),
            vec![b"a".to_vec(), b"b".into(), b"c".into()]
        );
        assert_eq!(s.term(1).unwrap(), BOOTSTRAP_TERM);
        assert_eq!(s.term(4).unwrap(), 3);
        assert!(matches!(s.term(0), Err(raft::Error::Store(StorageError::Compacted))));
        assert!(matches!(s.term(5), Err(raft::Error::Store(StorageError::Unavailable))));
        assert_eq!(s.snapshot(0, 2).unwrap().data.to_vec(), b"initial".to_vec());
    }

    #[test]
    fn a_new_leader_overwrites_the_uncommitted_tail() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = RaftStore::open(&dir.path().join("raft.redb")).unwrap();
        s.bootstrap(&[1], Vec::new()).unwrap();
        s.append(&[entry(2, 1, b"x"), entry(3, 1, b"y"), entry(4, 1, b"z")], None).unwrap();
        s.append(&[entry(3, 2, b"Y")], None).unwrap();
        assert_eq!(s.last_index().unwrap(), 3);
        let got = s.entries(2, 4, None, ctx()).unwrap();
        assert_eq!((got[1].term, got[1].data.to_vec()), (2, b"Y".to_vec()));
        assert_eq!(s.stored_entries().unwrap(), 2);
        // Size limit: always at least one entry.
        assert_eq!(s.entries(2, 4, Some(1), ctx()).unwrap().len(), 1);
    }

    #[test]
    fn compaction_drops_the_log_behind_the_snapshot_and_persists() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raft.redb");
        {
            let mut s = RaftStore::open(&path).unwrap();
            s.bootstrap(&[1], Vec::new()).unwrap();
            let entries: Vec<Entry> = (2..=10).map(|i| entry(i, 2, &[i as u8])).collect();
            let mut hs = s.hard_state().clone();
            hs.commit = 10;
            s.append(&entries, Some(&hs)).unwrap();
            let cs = s.conf_state().clone();
            // Past the commit index is refused.
            assert!(s.compact(11, cs.clone(), Vec::new()).is_err());
            s.compact(7, cs, b"state@7".to_vec()).unwrap();
            assert_eq!(s.stored_entries().unwrap(), 3);
        }
        let s = RaftStore::open(&path).unwrap();
        assert_eq!((s.first_index().unwrap(), s.last_index().unwrap()), (8, 10));
        assert_eq!(s.term(7).unwrap(), 2);
        assert!(matches!(s.entries(5, 9, None, ctx()), Err(raft::Error::Store(StorageError::Compacted))));
        let snap = s.snapshot(0, 2).unwrap();
        assert_eq!((snap.get_metadata().index, snap.data.to_vec()), (7, b"state@7".to_vec()));
        assert_eq!(snap.get_metadata().get_conf_state().voters, vec![1]);
    }

    #[test]
    fn an_installed_snapshot_replaces_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = RaftStore::open(&dir.path().join("raft.redb")).unwrap();
        s.append(&[entry(1, 1, b"old")], None).unwrap();
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = 20;
        snap.mut_metadata().term = 4;
        snap.mut_metadata().mut_conf_state().voters = vec![1, 2, 3, 4];
        snap.data = b"leader state".to_vec();
        s.apply_snapshot(&snap).unwrap();
        assert_eq!((s.first_index().unwrap(), s.last_index().unwrap()), (21, 20));
        assert_eq!(s.stored_entries().unwrap(), 0);
        assert_eq!(s.hard_state().commit, 20);
        assert_eq!(s.conf_state().voters, vec![1, 2, 3, 4]);
        s.append(&[entry(21, 4, b"next")], None).unwrap();
        assert_eq!(s.entries(21, 22, None, ctx()).unwrap()[0].data.to_vec(), b"next".to_vec());
        // An older snapshot is refused.
        snap.mut_metadata().index = 10;
        assert!(s.apply_snapshot(&snap).is_err());
    }
}
