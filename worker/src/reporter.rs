//! The reporter task: the one owner of this worker's link to the kvstore (DESIGN §6).
//!
//! It subscribes to the engine's block changes ([`crate::events`]), registers the worker under a new epoch, sends
//! its full residency as the first report, then every `interval` (100 ms) publishes what queued up, with the worker's
//! occupancy per tier and codec and its running and waiting sequences. When nothing changed for `heartbeat` (1 s) it
//! publishes an empty batch anyway: routers take silence as a dead or stuck worker. A snapshot replaces the queue
//! whenever the numbering has a hole (the engine dropped changes because this task fell behind), the queue
//! overflows, or the kvstore reports a gap. A kvstore that forgot the worker (or saw a newer epoch) gets a fresh
//! registration and a snapshot. Nothing here can stall the engine: the engine only ever `try_send`s.
//!
//! It also reads the kvstore's worker table every `peers_every` (2 s) into [`KnownPeers`]: the addresses of the
//! workers the directory lists, the only peers a request's hint may send this worker to pull from.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pagoda_kvstore::Client;
use pagoda_kvstore::proto as pb;
use tokio::sync::mpsc::error::TryRecvError;
use tokio::task::JoinHandle;
use tonic::Code;

use crate::engine::{EngineError, EngineHandle, EngineStats};
use crate::events::{BlockChange, Outbox};
use crate::tiers::Tier;

/// How one worker reports.
#[derive(Debug, Clone)]
pub struct ReporterConfig {
    /// The worker's id in the directory (stable across restarts).
    pub worker_id: String,
    /// The gRPC address routers reach the worker at.
    pub address: String,
    /// kvstore nodes (`host:port`), fixed or kept current by the registry; writes follow the leader.
    pub kvstore: pagoda_kvstore::Endpoints,
    /// How often queued changes are published.
    pub interval: Duration,
    /// Longest silence: an empty report (a heartbeat, with the occupancy) goes out at least this often.
    pub heartbeat: Duration,
    /// Most changes in one Publish.
    pub max_batch: usize,
    /// Most changes queued before the queue is dropped for a snapshot.
    pub max_queued: usize,
    /// Batches the engine may queue for this task before it drops them.
    pub channel_batches: usize,
    /// How long one kvstore call may keep retrying.
    pub call_deadline: Duration,
    /// How often the worker table is read into [`KnownPeers`].
    pub peers_every: Duration,
}

impl ReporterConfig {
    pub fn new(worker_id: String, address: String, kvstore: pagoda_kvstore::Endpoints) -> ReporterConfig {
        ReporterConfig {
            worker_id,
            address,
            kvstore,
            interval: Duration::from_millis(100),
            heartbeat: Duration::from_secs(1),
            max_batch: 4096,
            max_queued: 1 << 18,
            channel_batches: 4096,
            call_deadline: Duration::from_secs(2),
            peers_every: Duration::from_secs(2),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReporterError {
    #[error("reporter config: {0}")]
    Config(String),
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
}

/// What the reporter knows: where it stands (for `Stats`) and the peers the directory lists (for peer hints).
/// Written by the reporter task only, read by anyone.
#[derive(Debug, Default)]
pub struct ReportProgress {
    epoch: AtomicU64,
    acked_seq: AtomicU64,
    snapshots: AtomicU64,
    peers: KnownPeers,
}

/// The peers a request's `peer_hint` may name: the workers the kvstore's worker table lists, by the address they
/// registered (the one routers reach them at, so the one a router hints). Without a reporter nothing is known
/// and every hint is taken, as before there was a directory to ask; with one, a hint naming an address the
/// directory does not list is not followed, so a caller of the Worker service cannot point this worker's pulls
/// at a Transfer server of its choosing.
#[derive(Debug, Default)]
pub struct KnownPeers {
    /// `None` while no directory is consulted; `Some` (empty until the first read) once a reporter runs.
    addresses: RwLock<Option<HashSet<String>>>,
}

/// An address as peers are compared: routers may write a worker `http://host:port` or `host:port`.
fn peer_key(address: &str) -> &str {
    address.strip_prefix("http://").or_else(|| address.strip_prefix("https://")).unwrap_or(address)
}

impl KnownPeers {
    /// Whether a hint naming `address` may be followed.
    pub fn admits(&self, address: &str) -> bool {
        let known = self.addresses.read().unwrap_or_else(|p| p.into_inner());
        known.as_ref().is_none_or(|set| set.contains(peer_key(address)))
    }

    /// From now on only listed addresses are admitted: none until the first [`KnownPeers::set`].
    fn consult(&self) {
        self.addresses.write().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(HashSet::new);
    }

    /// Replaces the known addresses with those the directory lists now.
    fn set<'a>(&self, addresses: impl IntoIterator<Item = &'a str>) {
        let set = addresses.into_iter().filter(|a| !a.is_empty()).map(|a| peer_key(a).to_owned()).collect();
        *self.addresses.write().unwrap_or_else(|p| p.into_inner()) = Some(set);
    }
}

/// A copy of [`ReportProgress`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReportProgressSnapshot {
    /// The epoch this process registered under (0 before it registered).
    pub epoch: u64,
    /// The last block-event sequence number the kvstore acknowledged.
    pub acked_seq: u64,
    /// Residency snapshots the kvstore accepted since start.
    pub snapshots: u64,
}

impl ReportProgress {
    /// The peers a request's hint may name.
    pub fn peers(&self) -> &KnownPeers {
        &self.peers
    }

    pub fn snapshot(&self) -> ReportProgressSnapshot {
        ReportProgressSnapshot {
            epoch: self.epoch.load(Ordering::Relaxed),
            acked_seq: self.acked_seq.load(Ordering::Relaxed),
            snapshots: self.snapshots.load(Ordering::Relaxed),
        }
    }
}

/// The running reporter task and its progress.
pub struct Reporter {
    pub task: JoinHandle<()>,
    pub progress: Arc<ReportProgress>,
}

/// Subscribes to `engine`'s block changes and starts the reporter task; it ends when the engine stops.
pub fn spawn(engine: EngineHandle, cfg: ReporterConfig) -> Result<Reporter, ReporterError> {
    if cfg.worker_id.is_empty() || cfg.worker_id.len() > pagoda_kvstore::machine::MAX_NAME_LEN {
        return Err(ReporterError::Config(format!(
            "the worker id must be 1 to {} bytes",
            pagoda_kvstore::machine::MAX_NAME_LEN
        )));
    }
    let client = Client::following(cfg.kvstore.clone())
        .map_err(|e| ReporterError::Config(e.message().to_string()))?
        .with_deadline(cfg.call_deadline);
    let rx = engine.report_events(cfg.channel_batches)?;
    let progress = Arc::new(ReportProgress::default());
    progress.peers.consult();
    let task = tokio::spawn(run(engine, cfg, client, rx, progress.clone()));
    Ok(Reporter { task, progress })
}

fn unix_micros() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(1)
}

fn tier_to(t: Tier) -> i32 {
    match t {
        Tier::Device => pb::Tier::Device as i32,
        Tier::Host => pb::Tier::Host as i32,
        Tier::Disk => pb::Tier::Disk as i32,
    }
}

/// The copies a residency snapshot lists, at most `cap` of them (the kvstore refuses a longer snapshot, and a
/// worker refused its snapshot could never report again): the faster tiers first, since those are the copies
/// placement gains most from. Also how many were left out.
fn snapshot_copies(changes: &[BlockChange], cap: usize) -> (Vec<pb::BlockCopy>, usize) {
    let mut copies: Vec<pb::BlockCopy> = changes
        .iter()
        .filter_map(|c| match c {
            BlockChange::Stored { hash, tier, codec, bytes } => {
                Some(pb::BlockCopy { hash: *hash, tier: tier_to(*tier), codec: codec.to_string(), bytes: *bytes })
            }
            BlockChange::Removed { .. } => None,
        })
        .collect();
    let left_out = copies.len().saturating_sub(cap);
    if left_out > 0 {
        // The wire's tier numbers run device, host, disk; the sort is stable, so within a tier the engine's order
        // stands.
        copies.sort_by_key(|c| c.tier);
        copies.truncate(cap);
    }
    (copies, left_out)
}

fn event(c: &BlockChange) -> pb::BlockEvent {
    use pb::block_event::Kind;
    let kind = match c {
        BlockChange::Stored { hash, tier, codec, bytes } => {
            Kind::Stored(pb::Stored { hash: *hash, tier: tier_to(*tier), codec: codec.to_string(), bytes: *bytes })
        }
        BlockChange::Removed { hash, tier, codec } => {
            Kind::Removed(pb::Removed { hash: *hash, tier: tier_to(*tier), codec: codec.to_string() })
        }
    };
    pb::BlockEvent { kind: Some(kind) }
}

/// The worker's occupancy report from its latest stats.
pub fn load_report(s: &EngineStats) -> pb::WorkerLoad {
    pb::WorkerLoad {
        occupancy: s
            .tier_usage
            .iter()
            .map(|u| pb::TierOccupancy {
                tier: tier_to(u.tier),
                codec: u.codec.to_string(),
                used_bytes: u.used_bytes,
                capacity_bytes: u.capacity_bytes,
            })
            .collect(),
        running: u32::try_from(s.running).unwrap_or(u32::MAX),
        waiting: u32::try_from(s.waiting).unwrap_or(u32::MAX),
        free_blocks: s.blocks_total.saturating_sub(s.blocks_used),
        total_blocks: s.blocks_total,
        reported_at_ms: unix_micros() / 1000,
    }
}

/// Logs a failing kvstore at most every 10 s.
struct Complaints {
    last: Option<Instant>,
}

impl Complaints {
    fn warn(&mut self, what: &str, e: &tonic::Status) {
        if self.last.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
            tracing::warn!(code = ?e.code(), error = %e.message(), "kvstore {what} failed; retrying");
            self.last = Some(Instant::now());
        }
    }

    fn recovered(&mut self) {
        if self.last.take().is_some() {
            tracing::info!("kvstore reachable again");
        }
    }
}

struct Link {
    engine: EngineHandle,
    cfg: ReporterConfig,
    client: Client,
    epoch: u64,
    registered: bool,
    outbox: Outbox,
    last_sent: Option<Instant>,
    complaints: Complaints,
    progress: Arc<ReportProgress>,
    /// When the worker table was last read (or tried).
    peers_read: Option<Instant>,
}

async fn run(
    engine: EngineHandle,
    cfg: ReporterConfig,
    client: Client,
    mut rx: tokio::sync::mpsc::Receiver<crate::events::SeqBatch>,
    progress: Arc<ReportProgress>,
) {
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut link = Link {
        outbox: Outbox::new(cfg.max_queued),
        engine,
        cfg,
        client,
        epoch: unix_micros(),
        registered: false,
        last_sent: None,
        complaints: Complaints { last: None },
        progress,
        peers_read: None,
    };
    loop {
        tick.tick().await;
        loop {
            match rx.try_recv() {
                Ok(batch) => link.outbox.accept(batch),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
        if let Err(EngineError::Stopped) = link.report().await {
            return;
        }
        link.read_peers().await;
    }
}

impl Link {
    /// One round: register if needed, then a snapshot or the queued changes (or a heartbeat when it is due).
    async fn report(&mut self) -> Result<(), EngineError> {
        if !self.registered && !self.register().await {
            return Ok(());
        }
        if self.outbox.snapshot_needed() {
            return self.snapshot().await;
        }
        let heartbeat_due = self.last_sent.is_none_or(|t| t.elapsed() >= self.cfg.heartbeat);
        if self.outbox.is_empty() && !heartbeat_due {
            return Ok(());
        }
        // Bounded: a backlog drains over the following rounds.
        for _ in 0..8 {
            let (first_seq, changes) = self.outbox.front(self.cfg.max_batch);
            let n = changes.len();
            let req = pb::PublishRequest {
                worker: self.cfg.worker_id.clone(),
                epoch: self.epoch,
                first_seq,
                events: changes.iter().map(event).collect(),
                load: Some(load_report(&self.engine.stats())),
            };
            match self.client.publish(req).await {
                Ok(r) if r.snapshot_required => {
                    tracing::info!(
                        expected = r.expected_seq,
                        sent = first_seq,
                        "kvstore saw a gap; sending a snapshot"
                    );
                    self.outbox.request_snapshot();
                    return Ok(());
                }
                Ok(_) => {
                    self.outbox.ack(n);
                    self.progress.acked_seq.store(self.outbox.next_seq() - 1, Ordering::Relaxed);
                    self.last_sent = Some(Instant::now());
                    self.complaints.recovered();
                }
                Err(e) => {
                    self.failed("publish", &e);
                    return Ok(());
                }
            }
            if self.outbox.is_empty() {
                break;
            }
        }
        Ok(())
    }

    async fn register(&mut self) -> bool {
        match self.client.register(&self.cfg.worker_id, &self.cfg.address, self.epoch).await {
            Ok(_) => {
                tracing::info!(worker = %self.cfg.worker_id, epoch = self.epoch, "registered with the kvstore");
                self.registered = true;
                self.progress.epoch.store(self.epoch, Ordering::Relaxed);
                self.outbox.request_snapshot();
                self.complaints.recovered();
                true
            }
            Err(e) => {
                if e.code() == Code::FailedPrecondition {
                    // The directory knows a newer epoch of this id (a clock step back, or a twin): go past it.
                    self.epoch = self.newer_epoch().await;
                }
                self.complaints.warn("register", &e);
                false
            }
        }
    }

    /// Reads the worker table into [`KnownPeers`] when `peers_every` has passed. A failed read keeps the last
    /// table: a kvstore that is briefly away does not turn every hint down.
    async fn read_peers(&mut self) {
        if !self.registered || self.peers_read.is_some_and(|t| t.elapsed() < self.cfg.peers_every) {
            return;
        }
        self.peers_read = Some(Instant::now());
        let req = pb::ReadRequest { workers: true, ..Default::default() };
        match self.client.read(req).await {
            Ok(r) => self.progress.peers.set(r.workers.iter().map(|w| w.address.as_str())),
            Err(e) => self.complaints.warn("worker table read", &e),
        }
    }

    async fn newer_epoch(&mut self) -> u64 {
        let req = pb::ReadRequest { workers: true, ..Default::default() };
        let current = match self.client.read(req).await {
            Ok(r) => r.workers.iter().find(|w| w.worker == self.cfg.worker_id).map_or(0, |w| w.epoch),
            Err(_) => 0,
        };
        self.epoch.max(current).max(unix_micros()) + 1
    }

    async fn snapshot(&mut self) -> Result<(), EngineError> {
        let snap = self.engine.residency_snapshot().await?;
        self.outbox.snapshot_taken(snap.seq);
        let (blocks, left_out) = snapshot_copies(&snap.blocks, pagoda_kvstore::machine::MAX_SNAPSHOT_BLOCKS);
        if left_out > 0 {
            tracing::warn!(
                left_out,
                kept = blocks.len(),
                "more block copies than one snapshot carries: the kvstore learns the device and host ones first"
            );
        }
        let n = blocks.len();
        let req = pb::WorkerSnapshotRequest {
            worker: self.cfg.worker_id.clone(),
            epoch: self.epoch,
            seq: snap.seq,
            blocks,
            load: Some(load_report(&self.engine.stats())),
        };
        match self.client.publish_snapshot(req).await {
            Ok(_) => {
                tracing::info!(blocks = n, seq = snap.seq, epoch = self.epoch, "published a residency snapshot");
                self.progress.acked_seq.store(snap.seq, Ordering::Relaxed);
                self.progress.snapshots.fetch_add(1, Ordering::Relaxed);
                self.last_sent = Some(Instant::now());
                self.complaints.recovered();
            }
            Err(e) => {
                self.failed("snapshot", &e);
                self.outbox.request_snapshot();
            }
        }
        Ok(())
    }

    /// A refused write (unknown worker, stale epoch: the kvstore lost or replaced our registration) re-registers;
    /// anything else is retried next round.
    fn failed(&mut self, what: &str, e: &tonic::Status) {
        if e.code() == Code::FailedPrecondition {
            tracing::warn!(error = %e.message(), "kvstore refused the report; registering again");
            self.registered = false;
            self.outbox.request_snapshot();
        } else {
            self.complaints.warn(what, e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hash: u64, tier: Tier) -> BlockChange {
        BlockChange::Stored { hash, tier, codec: "f16".into(), bytes: 1 }
    }

    #[test]
    fn a_snapshot_over_the_cap_keeps_the_faster_tiers() {
        let changes = [
            stored(1, Tier::Disk),
            stored(2, Tier::Host),
            BlockChange::Removed { hash: 9, tier: Tier::Host, codec: "f16".into() },
            stored(3, Tier::Device),
            stored(4, Tier::Disk),
            stored(5, Tier::Device),
        ];
        let (all, left_out) = snapshot_copies(&changes, 8);
        assert_eq!((all.iter().map(|c| c.hash).collect::<Vec<_>>(), left_out), (vec![1, 2, 3, 4, 5], 0));
        let (kept, left_out) = snapshot_copies(&changes, 3);
        assert_eq!(kept.iter().map(|c| c.hash).collect::<Vec<_>>(), [3, 5, 2]);
        assert_eq!(left_out, 2);
        assert!(snapshot_copies(&changes, 0).0.is_empty());
    }
}
