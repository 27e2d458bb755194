//! The directory feed: the task that keeps this router's residency index in step with the kvstore (DESIGN §6).
//!
//! It owns a `Watch(from_index)` stream on one kvstore node, the [`WorkerTable`] that decides which events of each
//! replicated `Publish` are fresh (the same table the kvstore's directory runs, so both take the same events as
//! fresh; the directory's copy caps are not applied here, the index has its own bound), and the time each
//! registered worker last reported. Deltas go into the placer's bounded
//! [`crate::residency::ResidencyIndex`], mapped from the kvstore's worker id onto the router's worker list (by the id
//! the worker announces in `Health`, else by its registered address); the router's own predictions stay. A full
//! directory snapshot (a new watch from 0, or one that fell behind the compacted log) replaces every reported holder.
//!
//! On a failed or ended stream it reconnects to the next kvstore node and resumes from the last applied index. A
//! registered worker that sent no report (its heartbeat comes at least every second) for `stale_after` is *stale*:
//! a warning is logged, `pagoda_router_worker_reports_stale{worker}` reads 1, `/debug/placements` shows it, and
//! placement leaves the worker out while any fresh worker is ready. Nothing degrades silently.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pagoda_kvstore::machine::{batch_from, load_from, worker_record_from};
use pagoda_kvstore::proto as pb;
use pagoda_kvstore::{BlockEvent, Client, Endpoints, Registration, Tier, WorkerLoad, WorkerTable, collapse_clears};
use pb::command::Op;
use serde::Serialize;

use crate::placement::HitTier;
use crate::residency::{ResidencyDelta, WorkerIdx};
use crate::workers::WorkerPool;

/// Feed settings.
#[derive(Debug, Clone)]
pub struct FeedConfig {
    /// kvstore nodes (`host:port`), tried in turn; a new list (from the registry) is taken up at the next reconnect.
    pub endpoints: Endpoints,
    /// A registered worker silent for this long is stale.
    pub stale_after: Duration,
    /// How often staleness is judged and the status published.
    pub check_every: Duration,
}

impl FeedConfig {
    pub fn new(endpoints: Endpoints) -> FeedConfig {
        FeedConfig { endpoints, stale_after: Duration::from_secs(3), check_every: Duration::from_millis(250) }
    }
}

/// What the router knows about one registered worker from the feed.
#[derive(Debug, Clone, Serialize)]
pub struct ReportedWorker {
    pub worker: String,
    pub address: String,
    pub epoch: u64,
    pub applied_seq: u64,
    /// Seconds since its last report (events, heartbeat, snapshot or registration) reached this router.
    pub report_age_s: f64,
    pub stale: bool,
    /// The router worker it maps to (`--worker` address), when known.
    pub router_worker: Option<String>,
    pub running: Option<u32>,
    pub waiting: Option<u32>,
    pub free_blocks: Option<u64>,
}

/// The feed's published state, for placement, metrics and `/debug/placements`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FeedStatus {
    pub enabled: bool,
    pub connected: bool,
    /// The kvstore node the stream is on (or was last tried).
    pub node: String,
    /// The last raft index applied from the stream.
    pub applied_index: u64,
    pub reconnects: u64,
    pub last_error: Option<String>,
    pub workers: Vec<ReportedWorker>,
    /// Blocks (distinct hashes) in the residency index, reported and predicted.
    pub index_blocks: usize,
}

impl FeedStatus {
    /// Whether the router worker at `slot` maps to a stale registered worker.
    pub fn is_stale(&self, slot: usize, names: &[&str]) -> bool {
        let Some(name) = names.get(slot) else { return false };
        self.workers.iter().any(|w| w.stale && w.router_worker.as_deref() == Some(*name))
    }
}

struct Tracked {
    last_report: Instant,
    stale: bool,
}

/// The feed task's own state (one owner: the task).
struct Feed {
    pool: Arc<WorkerPool>,
    cfg: FeedConfig,
    table: WorkerTable,
    seen: BTreeMap<String, Tracked>,
    next_index: u64,
    status: FeedStatus,
    id_generation: u64,
}

fn hit_tier(t: Tier) -> HitTier {
    match t {
        Tier::Device => HitTier::Device,
        Tier::Host => HitTier::Host,
        Tier::Disk => HitTier::Disk,
    }
}

fn tier_of(v: i32) -> Option<Tier> {
    match pb::Tier::try_from(v).ok()? {
        pb::Tier::Device => Some(Tier::Device),
        pb::Tier::Host => Some(Tier::Host),
        pb::Tier::Disk => Some(Tier::Disk),
    }
}

/// Starts the feed for `pool`; it runs until the pool is dropped.
pub fn spawn(pool: Arc<WorkerPool>, cfg: FeedConfig) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut feed = Feed {
            id_generation: pool.id_generation(),
            pool,
            table: WorkerTable::new(),
            seen: BTreeMap::new(),
            next_index: 0,
            status: FeedStatus { enabled: true, ..FeedStatus::default() },
            cfg,
        };
        feed.run().await;
    })
}

impl Feed {
    async fn run(&mut self) {
        let mut nodes = self.cfg.endpoints.latest();
        let mut node = 0usize;
        let mut failures = 0u32;
        loop {
            if let Some(list) = self.cfg.endpoints.changed() {
                tracing::info!(nodes = ?list, "kvstore membership changed");
                nodes = list;
                node = 0;
                failures = 0;
            }
            let n = nodes.len().max(1);
            let Some(addr) = nodes.get(node % n).cloned() else { return };
            self.status.node = addr.clone();
            match Client::watch(&addr, self.next_index).await {
                Ok(stream) => {
                    failures = 0;
                    self.connected(true, None);
                    tracing::info!(node = %addr, from = self.next_index, "watching the kvstore directory");
                    let why = self.follow(&addr, stream).await;
                    self.connected(false, Some(why.clone()));
                    tracing::warn!(node = %addr, reason = %why, resume = self.next_index, "kvstore watch ended");
                }
                Err(e) => {
                    failures += 1;
                    self.connected(false, Some(e.message().to_string()));
                    if failures == 1 || failures.is_multiple_of(20) {
                        tracing::warn!(node = %addr, error = %e.message(), "cannot watch the kvstore; trying the next node");
                    }
                }
            }
            self.status.reconnects += 1;
            node += 1;
            // Back off a little once every node was tried.
            let pause = if failures as usize >= n { Duration::from_millis(500) } else { Duration::from_millis(50) };
            tokio::time::sleep(pause).await;
        }
    }

    fn connected(&mut self, up: bool, err: Option<String>) {
        self.status.connected = up;
        if err.is_some() {
            self.status.last_error = err;
        }
        if up {
            // Silence while this router was cut off says nothing about the workers: their clocks restart.
            let now = Instant::now();
            for t in self.seen.values_mut() {
                t.last_report = now;
            }
        }
        self.publish();
    }

    /// Applies the stream until it fails; returns why it ended.
    async fn follow(&mut self, addr: &str, mut stream: tonic::Streaming<pb::WatchEvent>) -> String {
        let mut check = tokio::time::interval(self.cfg.check_every);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                msg = stream.message() => match msg {
                    Ok(Some(ev)) => self.apply(ev),
                    Ok(None) => return "the node closed the stream".into(),
                    Err(e) => return e.message().to_string(),
                },
                _ = check.tick() => {
                    if self.pool.id_generation() != self.id_generation {
                        // A worker announced a new id: re-read the whole directory to map its blocks.
                        self.id_generation = self.pool.id_generation();
                        self.next_index = 0;
                        return "worker ids changed; resynchronising from a snapshot".into();
                    }
                    let all_stale = self.judge();
                    self.publish();
                    if !self.cfg.endpoints.contains(addr) {
                        // A node that left the cluster may still answer, with a directory that no longer moves.
                        return "the node left the kvstore membership".into();
                    }
                    if all_stale && self.cfg.endpoints.len() > 1 {
                        return "every registered worker is silent; trying another node".into();
                    }
                }
            }
        }
    }

    fn slot(&self, worker: &str) -> Option<WorkerIdx> {
        let address = self.table.get(worker).map(|r| r.address.as_str()).unwrap_or("");
        self.pool.resolve(worker, address).and_then(|i| WorkerIdx::try_from(i).ok())
    }

    fn heard_from(&mut self, worker: &str) {
        let t = self.seen.entry(worker.to_string()).or_insert(Tracked { last_report: Instant::now(), stale: false });
        t.last_report = Instant::now();
        if t.stale {
            t.stale = false;
            tracing::info!(worker, "worker reports resumed");
        }
    }

    fn apply(&mut self, ev: pb::WatchEvent) {
        let index = ev.index;
        match ev.body {
            Some(pb::watch_event::Body::Snapshot(snap)) => self.apply_snapshot(&snap),
            Some(pb::watch_event::Body::Command(cmd)) => self.apply_command(&cmd),
            None => {}
        }
        self.status.applied_index = index;
        self.next_index = index + 1;
    }

    fn apply_snapshot(&mut self, snap: &pb::DirectorySnapshot) {
        let mut table = Vec::with_capacity(snap.workers.len());
        for w in &snap.workers {
            let load = w.load.as_ref().and_then(|l| load_from(l).ok());
            table.push((w.worker.clone(), worker_record_from(w, load)));
        }
        self.table = table.into_iter().collect();
        self.seen.retain(|w, _| self.table.contains(w));
        let workers: Vec<String> = self.table.iter().map(|(w, _)| w.clone()).collect();
        for w in &workers {
            self.heard_from(w);
        }
        let slots: BTreeMap<String, Option<WorkerIdx>> = workers.iter().map(|w| (w.clone(), self.slot(w))).collect();
        self.pool.with_index(|idx| {
            idx.clear_reported();
            for b in &snap.blocks {
                for c in &b.copies {
                    let (Some(Some(worker)), Some(tier)) = (slots.get(&c.worker), tier_of(c.tier)) else { continue };
                    let (hash, worker, tier, bytes) = (b.hash, *worker, hit_tier(tier), c.bytes);
                    idx.apply(ResidencyDelta::Stored { hash, worker, tier, bytes });
                }
            }
        });
        tracing::info!(workers = workers.len(), blocks = snap.blocks.len(), "applied a directory snapshot");
    }

    fn apply_command(&mut self, cmd: &pb::Command) {
        match &cmd.op {
            Some(Op::Publish(p)) => {
                let Ok(batch) = batch_from(p) else { return };
                let Ok(admitted) = self.table.admit(&batch) else { return };
                self.heard_from(&batch.worker);
                // As the directory does: one scan for however many `Cleared` a batch holds.
                let fresh = collapse_clears(&batch.events[admitted.skipped..]);
                if !fresh.clears && fresh.events.is_empty() {
                    return;
                }
                let Some(worker) = self.slot(&batch.worker) else { return };
                self.pool.with_index(|idx| {
                    if fresh.clears {
                        idx.remove_reported(worker);
                    }
                    for e in fresh.events {
                        match e {
                            BlockEvent::Stored { hash, tier, bytes, .. } => idx.apply(ResidencyDelta::Stored {
                                hash: *hash,
                                worker,
                                tier: hit_tier(*tier),
                                bytes: *bytes,
                            }),
                            BlockEvent::Removed { hash, tier, .. } => {
                                idx.apply(ResidencyDelta::Removed { hash: *hash, worker, tier: hit_tier(*tier) })
                            }
                            BlockEvent::Cleared => idx.remove_reported(worker),
                        }
                    }
                });
            }
            Some(Op::Register(r)) => {
                let Ok(reg) = self.table.register(&r.worker, &r.address, r.epoch) else { return };
                self.heard_from(&r.worker);
                if reg == Registration::NewEpoch
                    && let Some(worker) = self.slot(&r.worker)
                {
                    // A restart: its device and host copies are gone, and so is what this router predicted there.
                    self.pool.with_index(|idx| idx.remove_worker(worker));
                }
            }
            Some(Op::RemoveWorker(r)) => {
                let slot = self.slot(&r.worker);
                if self.table.remove(&r.worker) {
                    self.seen.remove(&r.worker);
                    if let Some(worker) = slot {
                        self.pool.with_index(|idx| idx.remove_worker(worker));
                    }
                }
            }
            Some(Op::WorkerSnapshot(s)) => {
                let load = s.load.as_ref().and_then(|l| load_from(l).ok());
                if self.table.snapshot(&s.worker, s.epoch, s.seq, load.as_ref()).is_err() {
                    return;
                }
                self.heard_from(&s.worker);
                let Some(worker) = self.slot(&s.worker) else { return };
                self.pool.with_index(|idx| {
                    idx.remove_reported(worker);
                    for b in &s.blocks {
                        if let Some(tier) = tier_of(b.tier) {
                            idx.apply(ResidencyDelta::Stored {
                                hash: b.hash,
                                worker,
                                tier: hit_tier(tier),
                                bytes: b.bytes,
                            });
                        }
                    }
                });
            }
            None => {}
        }
    }

    /// Marks silent workers stale (logging each change). Returns true when every registered worker is stale.
    fn judge(&mut self) -> bool {
        let now = Instant::now();
        let mut stale = 0;
        for (worker, t) in self.seen.iter_mut() {
            let silent = now.duration_since(t.last_report);
            let is_stale = silent > self.cfg.stale_after;
            if is_stale && !t.stale {
                tracing::warn!(
                    worker = %worker,
                    silent_s = silent.as_secs_f64(),
                    "no block events or heartbeat from a registered worker: its residency is stale and it is left \
                     out of placement"
                );
            }
            t.stale = is_stale;
            stale += usize::from(is_stale);
        }
        stale > 0 && stale == self.seen.len()
    }

    fn publish(&mut self) {
        let now = Instant::now();
        let names: Vec<String> = self.pool.slot_names();
        let mut workers = Vec::with_capacity(self.table.len());
        for (id, r) in self.table.iter() {
            let t = self.seen.get(id);
            let load: Option<&WorkerLoad> = r.load.as_ref();
            let slot = self.pool.resolve(id, &r.address);
            workers.push(ReportedWorker {
                worker: id.clone(),
                address: r.address.clone(),
                epoch: r.epoch,
                applied_seq: r.applied_seq,
                report_age_s: t.map_or(0.0, |t| now.duration_since(t.last_report).as_secs_f64()),
                stale: self.status.connected && t.is_some_and(|t| t.stale),
                router_worker: slot.and_then(|i| names.get(i).filter(|n| !n.is_empty()).cloned()),
                running: load.map(|l| l.running),
                waiting: load.map(|l| l.waiting),
                free_blocks: load.map(|l| l.free_blocks),
            });
        }
        self.status.workers = workers;
        self.status.index_blocks = self.pool.index_blocks();
        self.pool.set_feed_status(self.status.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::block_event::Kind;

    fn feed(pool: Arc<WorkerPool>) -> Feed {
        Feed {
            id_generation: pool.id_generation(),
            pool,
            cfg: FeedConfig::new(Endpoints::fixed(vec!["127.0.0.1:1".into()])),
            table: WorkerTable::new(),
            seen: BTreeMap::new(),
            next_index: 0,
            status: FeedStatus::default(),
        }
    }

    fn stored(hash: u64) -> pb::BlockEvent {
        let s = pb::Stored { hash, tier: pb::Tier::Host as i32, codec: "f32".into(), bytes: 64 };
        pb::BlockEvent { kind: Some(Kind::Stored(s)) }
    }

    fn cleared() -> pb::BlockEvent {
        pb::BlockEvent { kind: Some(Kind::Cleared(pb::Cleared {})) }
    }

    /// Host blocks of `hash` the index holds for the one worker.
    fn held(pool: &WorkerPool, hash: u64) -> u32 {
        let mut out = Vec::new();
        pool.with_index(|idx| idx.match_prefix(&[hash], 1, Instant::now(), &mut out));
        out.first().map_or(0, |h| h.get(HitTier::Host))
    }

    // The pool's lazy channels need a runtime.
    #[tokio::test]
    async fn a_batch_of_clears_leaves_what_follows_the_last_one() {
        let pool = Arc::new(WorkerPool::new(&["127.0.0.1:1".into()]).unwrap());
        let mut feed = feed(pool.clone());
        let register = pb::RegisterRequest { worker: "w".into(), address: "127.0.0.1:1".into(), epoch: 1 };
        feed.apply_command(&pb::Command { op: Some(Op::Register(register)) });
        let events = vec![stored(1), cleared(), stored(2), cleared(), cleared(), stored(3), stored(4)];
        let publish = pb::PublishRequest { worker: "w".into(), epoch: 1, first_seq: 1, events, load: None };
        feed.apply_command(&pb::Command { op: Some(Op::Publish(publish)) });
        assert_eq!([1, 2, 3, 4].map(|h| held(&pool, h)), [0, 0, 1, 1]);
        // A batch that is all clears empties the worker's reported blocks.
        let publish = pb::PublishRequest {
            worker: "w".into(),
            epoch: 1,
            first_seq: 8,
            events: vec![cleared(); 1000],
            load: None,
        };
        feed.apply_command(&pb::Command { op: Some(Op::Publish(publish)) });
        assert_eq!([3, 4].map(|h| held(&pool, h)), [0, 0]);
    }

    /// The size each copy was reported at reaches the index by all three paths (events, a worker's snapshot, the
    /// directory's snapshot), so placement prices a compressed copy's load at its own bytes.
    #[tokio::test]
    async fn reported_copy_sizes_reach_the_index() {
        let pool = Arc::new(WorkerPool::new(&["127.0.0.1:1".into()]).unwrap());
        let mut feed = feed(pool.clone());
        let register = pb::RegisterRequest { worker: "w".into(), address: "127.0.0.1:1".into(), epoch: 1 };
        feed.apply_command(&pb::Command { op: Some(Op::Register(register)) });
        let host_bytes = |hash: u64| {
            let mut out = Vec::new();
            pool.with_index(|idx| idx.match_prefix(&[hash], 1, Instant::now(), &mut out));
            out.first().map_or(0.0, |h| h.load_bytes(HitTier::Host, 1_000_000))
        };
        let publish =
            pb::PublishRequest { worker: "w".into(), epoch: 1, first_seq: 1, events: vec![stored(1)], load: None };
        feed.apply_command(&pb::Command { op: Some(Op::Publish(publish)) });
        assert_eq!(host_bytes(1), 64.0);

        let copy = pb::BlockCopy { hash: 2, tier: pb::Tier::Host as i32, codec: "int2_kivi".into(), bytes: 300 };
        let snapshot =
            pb::WorkerSnapshotRequest { worker: "w".into(), epoch: 1, seq: 2, blocks: vec![copy], load: None };
        feed.apply_command(&pb::Command { op: Some(Op::WorkerSnapshot(snapshot)) });
        assert_eq!((host_bytes(1), host_bytes(2)), (0.0, 300.0));

        let residency =
            pb::Residency { worker: "w".into(), tier: pb::Tier::Host as i32, codec: "int8".into(), bytes: 500 };
        let info = pb::WorkerInfo { worker: "w".into(), address: "127.0.0.1:1".into(), epoch: 1, ..Default::default() };
        let snap = pb::DirectorySnapshot {
            workers: vec![info],
            blocks: vec![pb::BlockEntry { hash: 3, copies: vec![residency] }],
        };
        feed.apply_snapshot(&snap);
        assert_eq!((host_bytes(2), host_bytes(3)), (0.0, 500.0));
    }
}
