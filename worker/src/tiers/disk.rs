//! The disk tier: one file per block group under `<data-dir>/kv/`, LRU by last use, capacity in bytes.
//!
//! File `<hash as 16 hex digits>.kv`, all integers little-endian:
//! `"PGKV"` ‖ version u32 ‖ hash u64 ‖ codec length u16 ‖ codec UTF-8 ‖ payload length u64 ‖ payload ‖
//! xxh3_64 of everything before it.
//!
//! Writes are atomic: a `.tmp` file is written, fsynced and renamed over the final name, and the directory is
//! fsynced so that the rename, and with it a group reported stored, survives a power loss; a crash leaves either
//! the old state or the complete new file (stray `.tmp` files are deleted on open). The index is rebuilt on open by
//! reading every file's header: a bad header or a size that disagrees with it (truncation) is deleted and counted
//! there. The checksum covers the payload too, so it is checked on every read; a mismatch deletes the file, counts
//! it and reports a miss, and the caller recomputes the prefix. A plain struct with one owner
//! ([`TierStore`](super::TierStore)).
//!
//! One store owns a directory: [`DiskStore::open`] takes an exclusive `flock` on its `.lock` file, held while the
//! store lives, since two stores (two workers on one data dir) would evict and delete each other's files under
//! their own accounting. An open waits up to [`LOCK_WAIT`] for a store that is going away (an engine whose last
//! handle was just dropped finishes its step before its thread lets go of the tier) before it refuses.
//!
//! A full file system (`ENOSPC`, or a quota's `EDQUOT`) is not an error of the group: the tier shrinks its
//! capacity to what it holds, so that later writes make room by evicting its own oldest files instead of failing
//! one after another, and tries its configured capacity again after [`FULL_RETRY`].

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::{Xxh3Default, xxh3_64};

use super::{EncodedGroup, Tier, TierError};
use crate::events::BlockChange;
use crate::journal::Journal;

const MAGIC: &[u8; 4] = b"PGKV";
const VERSION: u32 = 1;
/// Codec names are short identifiers; anything longer is a corrupt header. The one bound every store of a group
/// shares (a file's header must hold any name a peer or the directory accepts).
const MAX_CODEC_LEN: usize = pagoda_proto::MAX_CODEC_NAME_BYTES;
const FIXED_HEADER: usize = 4 + 4 + 8 + 2;
/// The file in the tier's directory that [`DiskStore::open`] locks (not a `.kv` name: the index scan ignores it).
const LOCK_FILE: &str = ".lock";
/// How long a tier that found its file system full keeps to the capacity it shrank to.
pub const FULL_RETRY: Duration = Duration::from_secs(60);

#[derive(Debug)]
struct Entry {
    /// Whole file size (header + payload + checksum).
    file_bytes: u64,
    codec: String,
    tick: u64,
}

#[derive(Debug)]
pub struct DiskStore {
    dir: PathBuf,
    /// The capacity in force: `configured`, or less while the file system is full.
    capacity: u64,
    configured: u64,
    /// When a write last found the file system full (then `capacity` shrank).
    full_since: Option<Instant>,
    full_events: u64,
    /// Largest payload accepted: bounds what a corrupt length field can make a read allocate.
    max_payload: u64,
    used: u64,
    index: HashMap<u64, Entry>,
    lru: BTreeMap<u64, u64>,
    tick: u64,
    corrupted: u64,
    /// Stores and removals since the last [`DiskStore::take_changes`], when tracking is on.
    changes: Journal<BlockChange>,
    /// The open `.lock` file whose exclusive `flock` marks the directory ours; closing it (dropping the store)
    /// releases the lock.
    _lock: File,
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> TierError + 'a {
    move |source| TierError::Io { op, path: path.to_path_buf(), source }
}

fn is_out_of_space(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::StorageFull || e.kind() == std::io::ErrorKind::QuotaExceeded
}

/// How long [`DiskStore::open`] waits for another store to let go of the directory before it refuses it.
pub const LOCK_WAIT: Duration = Duration::from_secs(2);
/// How often the wait for the directory's lock tries again.
const LOCK_RETRY: Duration = Duration::from_millis(20);

/// Takes an exclusive `flock` on `<dir>/.lock` (created if missing), trying without blocking until `wait` has
/// passed (a bounded wait: a store being dropped elsewhere lets go within a step, a live one never does). `flock`
/// locks belong to the open file description, so a second store refuses the directory whether it is in this
/// process or another, and the lock goes with the process if it dies.
fn lock_dir(dir: &Path, wait: Duration) -> Result<File, TierError> {
    let path = dir.join(LOCK_FILE);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io_err("open", &path))?;
    let deadline = Instant::now() + wait;
    loop {
        // SAFETY: flock on a file descriptor this function owns, open for its whole call.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(f);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::WouldBlock {
            return Err(TierError::Io { op: "lock", path, source: e });
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(TierError::Config(format!(
                "the disk tier directory {} is in use by another store (another worker on the same data dir?); \
                 its lock {} was still held after {:?}",
                dir.display(),
                path.display(),
                wait
            )));
        }
        std::thread::sleep(LOCK_RETRY.min(deadline - now));
    }
}

fn file_name(hash: u64) -> String {
    format!("{hash:016x}.kv")
}

/// The parsed fixed part of a file.
struct Header {
    hash: u64,
    codec: String,
    payload_len: u64,
    header_len: usize,
}

fn parse_header(buf: &[u8], max_payload: u64) -> Result<Header, String> {
    if buf.len() < FIXED_HEADER {
        return Err("shorter than the header".into());
    }
    if &buf[0..4] != MAGIC {
        return Err("bad magic".into());
    }
    let version = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
    if version != VERSION {
        return Err(format!("version {version}, expected {VERSION}"));
    }
    let mut h = [0u8; 8];
    h.copy_from_slice(&buf[8..16]);
    let hash = u64::from_le_bytes(h);
    let codec_len = u16::from_le_bytes([buf[16], buf[17]]) as usize;
    if codec_len == 0 || codec_len > MAX_CODEC_LEN {
        return Err(format!("codec name length {codec_len}"));
    }
    let header_len = FIXED_HEADER + codec_len + 8;
    if buf.len() < header_len {
        return Err("shorter than the header".into());
    }
    let codec = std::str::from_utf8(&buf[FIXED_HEADER..FIXED_HEADER + codec_len])
        .map_err(|_| "codec name is not UTF-8".to_string())?
        .to_owned();
    h.copy_from_slice(&buf[FIXED_HEADER + codec_len..header_len]);
    let payload_len = u64::from_le_bytes(h);
    if payload_len > max_payload {
        return Err(format!("payload length {payload_len} over the limit {max_payload}"));
    }
    Ok(Header { hash, codec, payload_len, header_len })
}

impl DiskStore {
    /// Opens (creating) `dir` and rebuilds the index from the files there, oldest modification first in the LRU.
    /// Files over `capacity_bytes` in total are evicted, oldest first.
    pub fn open(dir: impl Into<PathBuf>, capacity_bytes: u64, max_payload: u64) -> Result<DiskStore, TierError> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(io_err("create", &dir))?;
        // Before anything is read or deleted: the files may be another live store's.
        let lock = lock_dir(&dir, LOCK_WAIT)?;
        let mut store = DiskStore {
            dir,
            capacity: capacity_bytes,
            configured: capacity_bytes,
            full_since: None,
            full_events: 0,
            max_payload,
            used: 0,
            index: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            corrupted: 0,
            changes: Journal::default(),
            _lock: lock,
        };
        let mut found = Vec::new();
        let entries = fs::read_dir(&store.dir).map_err(io_err("list", &store.dir))?;
        for entry in entries {
            let entry = entry.map_err(io_err("list", &store.dir))?;
            let path = entry.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
            if name.ends_with(".kv.tmp") {
                // An interrupted write: never renamed, so never valid.
                let _ = fs::remove_file(&path);
                continue;
            }
            let Some(stem) = name.strip_suffix(".kv") else { continue };
            let Ok(hash) = u64::from_str_radix(stem, 16) else { continue };
            if name != file_name(hash) {
                // `from_str_radix` also takes upper case, a '+' and other widths: such a name aliases the hash of
                // a canonical file, and indexing both would count its bytes twice and orphan an LRU entry. This
                // store never writes such names, so the file is dropped like a corrupt one (it is in our own
                // directory under our extension, and left alone it would hold disk space forever, unaccounted).
                store.discard(&path, "not a canonical file name");
                continue;
            }
            match store.check_file(&path, hash) {
                Ok((file_bytes, codec)) => {
                    let mtime = entry.metadata().and_then(|m| m.modified()).ok();
                    found.push((mtime, hash, file_bytes, codec));
                }
                Err(reason) => store.discard(&path, &reason),
            }
        }
        found.sort_by_key(|f| (f.0, f.1));
        for (_, hash, file_bytes, codec) in found {
            store.insert(hash, file_bytes, codec);
        }
        store.evict_until(0)?;
        Ok(store)
    }

    /// Reads the header of `path` and checks it against the file name and the file size.
    fn check_file(&self, path: &Path, hash: u64) -> Result<(u64, String), String> {
        let mut f = File::open(path).map_err(|e| e.to_string())?;
        let size = f.metadata().map_err(|e| e.to_string())?.len();
        let (buf, n) = read_head(&mut f).map_err(|e| e.to_string())?;
        let h = parse_header(&buf[..n], self.max_payload)?;
        if h.hash != hash {
            return Err(format!("header hash {:016x} does not match the file name", h.hash));
        }
        let expected = h.header_len as u64 + h.payload_len + 8;
        if size != expected {
            return Err(format!("{size} bytes, header says {expected} (truncated?)"));
        }
        Ok((size, h.codec))
    }

    fn discard(&mut self, path: &Path, reason: &str) {
        tracing::warn!(path = %path.display(), reason, "discarding corrupt KV file");
        let _ = fs::remove_file(path);
        self.corrupted += 1;
    }

    fn insert(&mut self, hash: u64, file_bytes: u64, codec: String) {
        // One entry per hash: a second insert must not leave the first one's bytes and LRU tick behind.
        self.forget(hash);
        self.tick += 1;
        self.lru.insert(self.tick, hash);
        self.used += file_bytes;
        self.changes.record_with(|| BlockChange::Stored {
            hash,
            tier: Tier::Disk,
            codec: codec.clone().into(),
            bytes: file_bytes,
        });
        self.index.insert(hash, Entry { file_bytes, codec, tick: self.tick });
    }

    fn forget(&mut self, hash: u64) -> Option<Entry> {
        let e = self.index.remove(&hash)?;
        self.lru.remove(&e.tick);
        self.used -= e.file_bytes;
        self.changes.record_with(|| BlockChange::Removed { hash, tier: Tier::Disk, codec: e.codec.clone().into() });
        Some(e)
    }

    /// Starts recording stores and removals (see [`DiskStore::take_changes`]); files found at open are not changes.
    pub fn track_changes(&mut self) {
        self.changes.start();
    }

    /// The stores and removals since the last call, in order, moved into `out`.
    pub fn take_changes(&mut self, out: &mut Vec<BlockChange>) {
        self.changes.drain_into(out);
    }

    /// Every file held: hash, codec, file bytes.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &str, u64)> {
        self.index.iter().map(|(h, e)| (*h, e.codec.as_str(), e.file_bytes))
    }

    /// Deletes least recently used files until `extra` more bytes fit.
    fn evict_until(&mut self, extra: u64) -> Result<(), TierError> {
        while self.used + extra > self.capacity {
            // Popped, not peeked: an LRU entry whose index entry is gone must not be picked again forever.
            let Some((_, victim)) = self.lru.pop_first() else { break };
            if !self.index.contains_key(&victim) {
                continue;
            }
            if let Err(e) = self.delete(victim) {
                // Still on disk, so still counted; the newest now, so that the next write evicts the files after
                // it instead of failing on it again.
                self.touch(victim);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Deletes the file under `hash`, then forgets it. A file that cannot be deleted (other than one already gone)
    /// stays indexed: its bytes are still on disk, and the tier's accounting must keep counting them.
    fn delete(&mut self, hash: u64) -> Result<(), TierError> {
        let path = self.path(hash);
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(TierError::Io { op: "remove", path, source: e }),
        }
        self.forget(hash);
        Ok(())
    }

    fn path(&self, hash: u64) -> PathBuf {
        self.dir.join(file_name(hash))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The capacity in force (less than configured while the file system is full).
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity
    }

    /// Writes that found the file system full, since open.
    pub fn full_events(&self) -> u64 {
        self.full_events
    }

    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Corrupt or truncated files found (and deleted) since open, including during open.
    pub fn corrupted(&self) -> u64 {
        self.corrupted
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.index.contains_key(&hash)
    }

    /// Payload size of the file under `hash` (what a read transfers, roughly).
    pub fn size_of(&self, hash: u64) -> Option<u64> {
        self.index.get(&hash).map(|e| e.file_bytes)
    }

    /// Codec of the file under `hash`, as its index entry records it.
    pub fn codec_of(&self, hash: u64) -> Option<&str> {
        self.index.get(&hash).map(|e| e.codec.as_str())
    }

    /// Bytes held per codec (codecs holding nothing are left out).
    pub fn used_by_codec(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for e in self.index.values() {
            *out.entry(e.codec.clone()).or_default() += e.file_bytes;
        }
        out
    }

    /// Writes `group` under `hash` atomically as most recently used, evicting older files to make room. A group
    /// that cannot fit the whole tier is not written (returns false). An existing file is only touched.
    pub fn put(&mut self, hash: u64, group: &EncodedGroup) -> Result<bool, TierError> {
        if self.contains(hash) {
            self.touch(hash);
            return Ok(true);
        }
        if group.codec.is_empty() || group.codec.len() > MAX_CODEC_LEN {
            return Err(TierError::UnknownCodec(group.codec.clone()));
        }
        let mut buf = Vec::with_capacity(FIXED_HEADER + group.codec.len() + 16 + group.bytes.len());
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&VERSION.to_le_bytes());
        buf.extend_from_slice(&hash.to_le_bytes());
        buf.extend_from_slice(&(group.codec.len() as u16).to_le_bytes());
        buf.extend_from_slice(group.codec.as_bytes());
        buf.extend_from_slice(&group.len().to_le_bytes());
        buf.extend_from_slice(&group.bytes);
        let sum = xxh3_64(&buf);
        buf.extend_from_slice(&sum.to_le_bytes());
        let size = buf.len() as u64;
        if self.full_since.is_some_and(|t| t.elapsed() >= FULL_RETRY) {
            self.full_since = None;
            self.capacity = self.configured;
        }
        if size > self.capacity || group.len() > self.max_payload {
            return Ok(false);
        }
        self.evict_until(size)?;
        let path = self.path(hash);
        let tmp = self.dir.join(format!("{}.tmp", file_name(hash)));
        let write = || -> std::io::Result<()> {
            let mut f = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp)?;
            f.write_all(&buf)?;
            f.sync_all()
        };
        if let Err(e) = write() {
            let _ = fs::remove_file(&tmp);
            if is_out_of_space(&e) {
                // Keep to what we hold: the next write evicts our own oldest files to make room.
                self.capacity = self.used;
                self.full_since = Some(Instant::now());
                self.full_events += 1;
                tracing::warn!(
                    dir = %self.dir.display(),
                    capacity = self.capacity,
                    "the disk tier's file system is full; holding to what it stores for {FULL_RETRY:?}"
                );
                return Ok(false);
            }
            return Err(TierError::Io { op: "write", path: tmp, source: e });
        }
        if let Err(e) = fs::rename(&tmp, &path) {
            let _ = fs::remove_file(&tmp);
            return Err(TierError::Io { op: "rename", path, source: e });
        }
        // The rename is durable only once the directory is: without this a power loss could lose a file the
        // tier reported stored (to the kvstore and to peers). The file is complete and renamed either way, so a
        // failure here (a file system that cannot sync directories) is logged, not a lost group.
        if let Err(e) = File::open(&self.dir).and_then(|d| d.sync_all()) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "syncing the disk tier's directory failed");
        }
        self.insert(hash, size, group.codec.clone());
        Ok(true)
    }

    /// Marks `hash` most recently used. Returns false when absent.
    pub fn touch(&mut self, hash: u64) -> bool {
        let Some(e) = self.index.get_mut(&hash) else { return false };
        self.lru.remove(&e.tick);
        self.tick += 1;
        e.tick = self.tick;
        self.lru.insert(self.tick, hash);
        true
    }

    /// Reads and verifies the group under `hash`. A missing, truncated or corrupt file is deleted, counted and
    /// reported as `Ok(None)`: the caller recomputes. `Err` is left for I/O failures other than a vanished file.
    pub fn get(&mut self, hash: u64) -> Result<Option<EncodedGroup>, TierError> {
        let Some(expected_size) = self.index.get(&hash).map(|e| e.file_bytes) else { return Ok(None) };
        let path = self.path(hash);
        let read = match read_group(&path, expected_size, self.max_payload, hash) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.forget(hash);
                return Ok(None);
            }
            Err(e) => {
                // An unreadable file (EIO, EACCES) stays unreadable: indexed, every admission would try it again.
                // Forgotten and deleted like a corrupt one (bytes that cannot even be deleted are past our help).
                self.forget(hash);
                let _ = fs::remove_file(&path);
                return Err(TierError::Io { op: "read", path, source: e });
            }
        };
        match read {
            Ok(group) => {
                self.touch(hash);
                Ok(Some(group))
            }
            Err(reason) => {
                self.forget(hash);
                self.discard(&path, &reason);
                Ok(None)
            }
        }
    }

    /// Deletes the file under `hash`. A file that cannot be deleted stays indexed and counted (`Err`).
    pub fn remove(&mut self, hash: u64) -> Result<bool, TierError> {
        if !self.contains(hash) {
            return Ok(false);
        }
        self.delete(hash)?;
        Ok(true)
    }
}

/// The start of a group file, up to the longest header there can be: what it holds and how many bytes it read
/// (fewer at the end of a short file).
fn read_head(f: &mut impl Read) -> std::io::Result<([u8; FIXED_HEADER + MAX_CODEC_LEN + 8], usize)> {
    let mut buf = [0u8; FIXED_HEADER + MAX_CODEC_LEN + 8];
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok((buf, n))
}

/// Reads and verifies the group file at `path` for `hash`: the header onto the stack, the payload straight into a
/// buffer of its own size (the bytes an onboarding decodes are copied once, by the kernel), then the checksum,
/// which covers both. Reads at most `limit + 1` bytes (`limit`: the size the index recorded), so a file that grew
/// behind our back fails the size check rather than allocating without bound. `Err`: I/O; `Ok(Err)`: why the
/// file is not the group.
fn read_group(path: &Path, limit: u64, max_payload: u64, hash: u64) -> std::io::Result<Result<EncodedGroup, String>> {
    let mut f = File::open(path)?.take(limit + 1);
    let (head, n) = read_head(&mut f)?;
    let h = match parse_header(&head[..n], max_payload) {
        Ok(h) => h,
        Err(reason) => return Ok(Err(reason)),
    };
    if h.hash != hash {
        return Ok(Err("header hash does not match".into()));
    }
    let expected = h.header_len as u64 + h.payload_len + 8;
    let wrong_size = || Ok(Err(format!("the file's size is not the {expected} bytes its header says (truncated?)")));
    if expected > limit + 1 {
        return wrong_size();
    }
    // The head read past the header: those bytes start the payload (and, for a tiny one, the checksum).
    let mut rest = (&head[h.header_len..n]).chain(f);
    let mut payload = Vec::with_capacity(h.payload_len as usize);
    let mut sum = [0u8; 8];
    if (&mut rest).take(h.payload_len).read_to_end(&mut payload)? as u64 != h.payload_len {
        return wrong_size();
    }
    match rest.read_exact(&mut sum) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return wrong_size(),
        Err(e) => return Err(e),
    }
    if rest.read(&mut [0u8; 1])? != 0 {
        return wrong_size();
    }
    let mut x = Xxh3Default::new();
    x.update(&head[..h.header_len]);
    x.update(&payload);
    if x.digest() != u64::from_le_bytes(sum) {
        return Ok(Err("checksum mismatch".into()));
    }
    Ok(Ok(EncodedGroup { codec: h.codec, bytes: payload }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(n: usize, seed: u8) -> EncodedGroup {
        EncodedGroup { codec: "native".into(), bytes: (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect() }
    }

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pagoda-disk-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    /// Entries of `dir` other than the store's lock file.
    fn kv_files(dir: &Path) -> usize {
        fs::read_dir(dir).unwrap().filter(|e| e.as_ref().unwrap().file_name() != LOCK_FILE).count()
    }

    /// Size of the file `put` writes for `g(n, _)`.
    fn file_size(n: usize) -> u64 {
        (FIXED_HEADER + "native".len() + 8 + n + 8) as u64
    }

    /// A real ENOSPC from the kernel: the write lands on /dev/full through a symlink at the temporary file's name.
    #[test]
    fn a_full_file_system_shrinks_the_tier_to_what_it_holds() {
        let dir = tmpdir("full");
        let mut d = DiskStore::open(&dir, file_size(100) * 10, 1 << 20).unwrap();
        assert!(d.put(1, &g(100, 1)).unwrap());
        assert!(d.put(2, &g(100, 2)).unwrap());
        std::os::unix::fs::symlink("/dev/full", dir.join(format!("{}.tmp", file_name(3)))).unwrap();
        assert!(!d.put(3, &g(100, 3)).unwrap(), "a full disk refuses the group; it is no error of the group");
        assert_eq!(d.full_events(), 1);
        assert_eq!(d.capacity_bytes(), file_size(100) * 2, "held to what it stores");
        assert!(!d.contains(3) && d.len() == 2);
        assert!(!dir.join(format!("{}.tmp", file_name(3))).exists(), "the failed write left nothing behind");
        // The next write makes room by evicting the tier's own oldest file, and succeeds.
        assert!(d.put(4, &g(100, 4)).unwrap());
        assert!(!d.contains(1) && d.contains(2) && d.contains(4));
        assert_eq!(d.get(4).unwrap(), Some(g(100, 4)));
        assert_eq!(d.used_bytes(), file_size(100) * 2);
        // After FULL_RETRY the configured capacity is tried again.
        d.full_since = Some(Instant::now() - FULL_RETRY);
        assert!(d.put(5, &g(100, 5)).unwrap());
        assert_eq!(d.capacity_bytes(), file_size(100) * 10);
        assert_eq!(d.len(), 3);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn round_trip_capacity_and_lru() {
        let dir = tmpdir("lru");
        let cap = file_size(100) * 2;
        let mut d = DiskStore::open(&dir, cap, 1 << 20).unwrap();
        assert!(d.put(1, &g(100, 1)).unwrap());
        assert!(d.put(2, &g(100, 2)).unwrap());
        assert_eq!(d.used_bytes(), cap);
        assert_eq!(d.get(1).unwrap(), Some(g(100, 1)));
        // 1 was read last: 2 goes.
        assert!(d.put(3, &g(100, 3)).unwrap());
        assert!(d.contains(1) && !d.contains(2) && d.contains(3));
        assert!(!dir.join(file_name(2)).exists());
        assert_eq!(d.get(2).unwrap(), None);
        // Bigger than the tier: not written, nothing evicted.
        assert!(!d.put(4, &g(300, 4)).unwrap());
        assert_eq!(d.len(), 2);
        assert_eq!(d.used_by_codec().get("native"), Some(&cap));
        assert!(d.remove(3).unwrap());
        assert!(!d.remove(3).unwrap());
        assert_eq!(d.used_bytes(), file_size(100));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn restart_rebuilds_the_index_and_drops_temp_files() {
        let dir = tmpdir("restart");
        {
            let mut d = DiskStore::open(&dir, 1 << 20, 1 << 20).unwrap();
            d.put(0xabc, &g(64, 7)).unwrap();
            d.put(0xdef, &g(32, 8)).unwrap();
        }
        fs::write(dir.join("0000000000000123.kv.tmp"), b"half a write").unwrap();
        fs::write(dir.join("notes.txt"), b"not ours").unwrap();
        let mut d = DiskStore::open(&dir, 1 << 20, 1 << 20).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d.used_bytes(), file_size(64) + file_size(32));
        assert_eq!(d.get(0xabc).unwrap(), Some(g(64, 7)));
        assert_eq!(d.get(0xdef).unwrap(), Some(g(32, 8)));
        assert_eq!(d.corrupted(), 0);
        assert!(!dir.join("0000000000000123.kv.tmp").exists());
        assert!(dir.join("notes.txt").exists(), "files that are not ours are left alone");
        // Reopening with a smaller capacity evicts down to it.
        drop(d);
        let d = DiskStore::open(&dir, file_size(64), 1 << 20).unwrap();
        assert_eq!(d.len(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Names `from_str_radix` reads as a stored hash but this store never writes (upper case, a '+', another
    /// width) are dropped on open: indexed next to the canonical file they double-counted its bytes and orphaned
    /// an LRU tick, on which eviction spun forever once the tier filled.
    #[test]
    fn aliased_file_names_are_dropped_and_a_full_tier_still_evicts() {
        let dir = tmpdir("aliases");
        let cap = file_size(100) * 3;
        {
            let mut d = DiskStore::open(&dir, cap, 1 << 20).unwrap();
            assert!(d.put(0xabc, &g(100, 1)).unwrap());
        }
        let canonical = dir.join(file_name(0xabc));
        let aliases = ["0000000000000ABC.kv", "+000000000000abc.kv", "abc.kv", "00000000000000000abc.kv"];
        for a in aliases {
            fs::copy(&canonical, dir.join(a)).unwrap();
        }
        // On a thread: before the fix, opening (whose eviction pass saw the doubled bytes) or filling spun forever.
        let (tx, rx) = std::sync::mpsc::channel();
        let at = dir.clone();
        std::thread::spawn(move || {
            let mut d = DiskStore::open(&at, cap, 1 << 20).unwrap();
            let opened = (d.len(), d.used_bytes(), d.corrupted(), d.get(0xabc).unwrap());
            for h in 1..=10u64 {
                d.put(h, &g(100, h as u8)).unwrap();
            }
            let _ = tx.send((opened, d));
        });
        let (opened, d) = rx.recv_timeout(Duration::from_secs(20)).expect("opening and filling the tier terminate");
        assert_eq!(opened, (1, file_size(100), aliases.len() as u64, Some(g(100, 1))), "the canonical file, once");
        assert!(aliases.iter().all(|a| !dir.join(a).exists()));
        assert_eq!(d.len(), 3);
        assert_eq!(d.used_bytes(), cap);
        assert!(d.contains(10) && d.contains(9) && d.contains(8) && !d.contains(0xabc));
        assert_eq!(kv_files(&dir), 3);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Eviction pops LRU entries, so one left behind by a lost index entry is skipped rather than picked forever.
    #[test]
    fn eviction_skips_an_orphaned_lru_entry() {
        let dir = tmpdir("orphan");
        let mut d = DiskStore::open(&dir, file_size(100) * 2, 1 << 20).unwrap();
        assert!(d.put(1, &g(100, 1)).unwrap());
        // Tick 0 is never handed out, so it is the oldest entry.
        d.lru.insert(0, 77);
        assert!(d.put(2, &g(100, 2)).unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = d.put(3, &g(100, 3)).unwrap();
            let _ = tx.send((d, r));
        });
        let (d, stored) = rx.recv_timeout(Duration::from_secs(20)).expect("eviction terminates");
        assert!(stored);
        assert!(!d.contains(1) && d.contains(2) && d.contains(3));
        assert_eq!(d.lru.len(), 2);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A read that fails for another reason than a vanished file (EIO, EACCES) forgets the entry and deletes the
    /// file: left indexed it was retried by every admission. Tests may run as root, where `chmod 000` does not stop
    /// a read, so the file is replaced by a symlink to a directory: opening it succeeds and reading fails (EISDIR),
    /// and the removal takes the link.
    #[test]
    fn an_unreadable_file_is_forgotten_and_deleted() {
        let dir = tmpdir("unreadable");
        let mut d = DiskStore::open(&dir, 1 << 20, 1 << 20).unwrap();
        assert!(d.put(1, &g(100, 1)).unwrap() && d.put(2, &g(100, 2)).unwrap());
        let p1 = dir.join(file_name(1));
        fs::remove_file(&p1).unwrap();
        std::os::unix::fs::symlink(".", &p1).unwrap();
        let got = d.get(1);
        assert!(matches!(got, Err(TierError::Io { op: "read", .. })), "{got:?}");
        assert!(!d.contains(1) && d.contains(2));
        assert_eq!(d.used_bytes(), file_size(100));
        assert!(fs::symlink_metadata(&p1).is_err(), "the unreadable file is deleted");
        assert_eq!(d.get(1).unwrap(), None, "and never read again");
        assert_eq!(d.get(2).unwrap(), Some(g(100, 2)));
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A rename that fails (here onto a directory of the file's name) leaves no temporary file behind.
    #[test]
    fn a_failed_rename_removes_the_temporary_file() {
        let dir = tmpdir("rename");
        let mut d = DiskStore::open(&dir, 1 << 20, 1 << 20).unwrap();
        fs::create_dir(dir.join(file_name(3))).unwrap();
        let got = d.put(3, &g(100, 3));
        assert!(matches!(got, Err(TierError::Io { op: "rename", .. })), "{got:?}");
        assert!(!dir.join(format!("{}.tmp", file_name(3))).exists(), "the temporary file is removed");
        assert!(!d.contains(3) && d.used_bytes() == 0);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A file that cannot be deleted (here a directory under its name: EISDIR) stays indexed and counted, by
    /// `remove` and by eviction, so the tier's accounting never drops bytes still on disk; eviction moves it to
    /// the newest end and the next write evicts the files after it.
    #[test]
    fn a_file_that_cannot_be_deleted_stays_counted() {
        let dir = tmpdir("undeletable");
        let mut d = DiskStore::open(&dir, file_size(100) * 2, 1 << 20).unwrap();
        assert!(d.put(1, &g(100, 1)).unwrap() && d.put(2, &g(100, 2)).unwrap());
        let p1 = dir.join(file_name(1));
        fs::remove_file(&p1).unwrap();
        fs::create_dir(&p1).unwrap();
        assert!(matches!(d.remove(1), Err(TierError::Io { op: "remove", .. })));
        assert!(d.contains(1) && d.used_bytes() == file_size(100) * 2);
        // Making room for 3 must evict 1, which cannot go.
        assert!(matches!(d.put(3, &g(100, 3)), Err(TierError::Io { op: "remove", .. })));
        assert!(d.contains(1) && d.contains(2) && !d.contains(3));
        assert_eq!(d.used_bytes(), file_size(100) * 2);
        assert_eq!(d.lru.len(), d.len(), "every indexed file is on the LRU");
        // The next write evicts 2, now the oldest.
        assert!(d.put(3, &g(100, 3)).unwrap());
        assert!(d.contains(1) && !d.contains(2) && d.contains(3));
        assert_eq!(d.used_bytes(), file_size(100) * 2);
        fs::remove_dir(&p1).unwrap();
        assert!(d.remove(1).unwrap(), "gone meanwhile: forgotten");
        assert_eq!(d.used_bytes(), file_size(100));
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Two stores over one directory would evict and delete each other's files under their accounting: the
    /// second open (another open file description, as another process's would be) is refused while the first
    /// store lives, and succeeds once it is dropped.
    #[test]
    fn a_directory_held_by_another_store_is_refused() {
        let dir = tmpdir("lock");
        let mut d = DiskStore::open(&dir, 1 << 20, 1 << 20).unwrap();
        assert!(d.put(1, &g(100, 1)).unwrap());
        let err = DiskStore::open(&dir, 1 << 20, 1 << 20).expect_err("the directory is in use");
        assert!(err.to_string().contains("in use by another"), "{err}");
        assert_eq!(d.get(1).unwrap(), Some(g(100, 1)), "the first store is untouched");
        drop(d);
        let d = DiskStore::open(&dir, 1 << 20, 1 << 20).unwrap();
        assert!(d.contains(1));
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A store that is going away (dropped by another thread a moment later) does not fail the next open: it waits
    /// for the lock, within [`LOCK_WAIT`], and then finds the first store's files.
    #[test]
    fn an_open_waits_for_a_store_that_is_going_away() {
        let dir = tmpdir("lock-wait");
        let mut d = DiskStore::open(&dir, 1 << 20, 1 << 20).unwrap();
        assert!(d.put(1, &g(100, 1)).unwrap());
        let dropper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            drop(d);
        });
        let t0 = Instant::now();
        let mut d = DiskStore::open(&dir, 1 << 20, 1 << 20).expect("the first store lets go within the wait");
        let waited = t0.elapsed();
        dropper.join().unwrap();
        assert!(waited >= Duration::from_millis(100) && waited < LOCK_WAIT, "waited {waited:?}");
        assert_eq!(d.get(1).unwrap(), Some(g(100, 1)));
        drop(d);
        // A lock that is never let go is refused once the wait is over, not waited on for ever.
        let held = lock_dir(&dir, Duration::ZERO).unwrap();
        let t0 = Instant::now();
        let err = lock_dir(&dir, Duration::from_millis(100)).expect_err("still held");
        assert!(err.to_string().contains("still held after"), "{err}");
        assert!(t0.elapsed() >= Duration::from_millis(100) && t0.elapsed() < LOCK_WAIT);
        drop(held);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// The read path takes the header, the payload and the checksum from one stream: payloads shorter than the
    /// longest header (their checksum read with the head) round-trip, and a file that grew, lost its checksum's last
    /// byte, had it flipped, or holds another hash's group is dropped on read, each counted once.
    #[test]
    fn reads_check_every_part_of_the_file() {
        let dir = tmpdir("read-parts");
        let mut d = DiskStore::open(&dir, 1 << 20, 1 << 20).unwrap();
        for (h, n) in [(1u64, 0usize), (2, 1), (3, 7), (4, 4096)] {
            d.put(h, &g(n, h as u8)).unwrap();
            assert_eq!(d.get(h).unwrap(), Some(g(n, h as u8)), "{n} bytes");
        }
        for h in 10..=13u64 {
            d.put(h, &g(300, h as u8)).unwrap();
        }
        let edit = |h: u64, f: &dyn Fn(&mut Vec<u8>)| {
            let p = dir.join(file_name(h));
            let mut bytes = fs::read(&p).unwrap();
            f(&mut bytes);
            fs::write(&p, &bytes).unwrap();
        };
        edit(10, &|b| b.push(0));
        edit(11, &|b| {
            b.pop();
        });
        edit(12, &|b| *b.last_mut().unwrap() ^= 1);
        fs::copy(dir.join(file_name(10 + 3)), dir.join(file_name(1))).unwrap();
        for (n, h) in [10u64, 11, 12, 1].into_iter().enumerate() {
            assert_eq!(d.get(h).unwrap(), None, "file {h}");
            assert_eq!(d.corrupted(), n as u64 + 1, "file {h}");
            assert!(!d.contains(h) && !dir.join(file_name(h)).exists(), "file {h}");
        }
        assert_eq!(d.get(13).unwrap(), Some(g(300, 13)));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn corruption_is_detected_deleted_and_counted() {
        let dir = tmpdir("corrupt");
        let mut d = DiskStore::open(&dir, 1 << 20, 1 << 20).unwrap();
        for h in 1..=4u64 {
            d.put(h, &g(256, h as u8)).unwrap();
        }
        // A flipped payload byte: only the checksum sees it, on read.
        let p1 = dir.join(file_name(1));
        let mut bytes = fs::read(&p1).unwrap();
        bytes[100] ^= 0x40;
        fs::write(&p1, &bytes).unwrap();
        assert_eq!(d.get(1).unwrap(), None);
        assert_eq!(d.corrupted(), 1);
        assert!(!p1.exists() && !d.contains(1));
        // A truncated file, found on read...
        let p2 = dir.join(file_name(2));
        let bytes = fs::read(&p2).unwrap();
        fs::write(&p2, &bytes[..bytes.len() - 10]).unwrap();
        assert_eq!(d.get(2).unwrap(), None);
        assert_eq!(d.corrupted(), 2);
        assert!(!p2.exists());
        // ... and on reopen, with a bad magic and a file renamed to another hash.
        let p3 = dir.join(file_name(3));
        let bytes = fs::read(&p3).unwrap();
        fs::write(&p3, &bytes[..bytes.len() / 2]).unwrap();
        let p4 = dir.join(file_name(4));
        let mut bytes = fs::read(&p4).unwrap();
        bytes[0] = b'X';
        fs::write(&p4, &bytes).unwrap();
        fs::copy(dir.join(file_name(4)), dir.join(file_name(5))).unwrap();
        let mut bytes = fs::read(&p4).unwrap();
        bytes[0] = b'P';
        fs::write(dir.join(file_name(6)), &bytes).unwrap();
        drop(d);
        let d = DiskStore::open(&dir, 1 << 20, 1 << 20).unwrap();
        assert_eq!(d.corrupted(), 4, "truncated 3, bad magic 4 and its copy 5, 6 names another hash");
        assert!(d.is_empty());
        assert_eq!(kv_files(&dir), 0);
        drop(d);
        // A corrupt length field cannot make a read allocate past the limit.
        let mut small = DiskStore::open(&dir, 1 << 20, 128).unwrap();
        assert!(!small.put(9, &g(256, 9)).unwrap());
        assert_eq!(small.get(9).unwrap(), None);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Timing, not a check: reading back 64 groups of one SmolLM2 f16 group's size (30 layers × 16 slots × 3
    /// kv-heads × 64 × K, V × 2 bytes), page cache warm, medians of 15. `cargo test --release -p pagoda-worker
    /// --lib disk_get_speed -- --ignored --nocapture`; docs/BENCHMARKS.md has the figures.
    #[test]
    #[ignore = "timing; run by hand in release"]
    fn disk_get_speed() {
        let dir = tmpdir("get-speed");
        let mut d = DiskStore::open(&dir, 1 << 30, 1 << 26).unwrap();
        let n = 30 * 16 * 3 * 64 * 2 * 2;
        for h in 0..64u64 {
            d.put(h, &g(n, h as u8)).unwrap();
        }
        let mut ms: Vec<f64> = (0..15)
            .map(|_| {
                let start = std::time::Instant::now();
                for h in 0..64u64 {
                    std::hint::black_box(d.get(h).unwrap().unwrap());
                }
                start.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        ms.sort_by(f64::total_cmp);
        println!("64 groups of {n} bytes: median {:.2} ms", ms[7]);
        fs::remove_dir_all(&dir).unwrap();
    }
}
