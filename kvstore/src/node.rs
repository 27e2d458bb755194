//! The kvstore node actor: one task owns the raft `RawNode` (with its [`RaftStore`]), the [`BlockDirectory`] it
//! replicates, the cluster membership, the pending proposals and reads, and the watchers.
//!
//! Everything reaches it through a bounded channel ([`NodeHandle`]): raft messages from peers, proposals, ReadIndex
//! reads, watch subscriptions, status. It ticks raft every `tick`, persists each `Ready` in one redb transaction,
//! sends messages through the [`Transport`], applies committed entries to the directory, answers the proposers, and
//! snapshots and compacts the log every `snapshot_every` applied entries.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use pagoda_proto::kvstore as pb;
use prost::Message as _;
use protobuf::Message as _;
use raft::eraftpb::{ConfChange, ConfChangeType, Entry, EntryType, Message, Snapshot};
use raft::{RawNode, SnapshotStatus, StateRole};
use thiserror::Error;
use tokio::sync::{mpsc, oneshot};

use crate::directory::BlockDirectory;
use crate::machine::{self, Outcome};
use crate::storage::{RaftStore, StoreError};
use crate::transport::{SendFailure, Transport};

/// Requests waiting for the actor before callers wait for room.
const REQUEST_QUEUE: usize = 8192;
/// Requests handled between two `Ready`s: many proposals land in one durable write.
const DRAIN_PER_ROUND: usize = 4096;
/// Raft payload (proposed commands, received entries and snapshots) taken in between two `Ready`s: 4,096 requests of
/// up to 16 MiB each would put 64 GiB into one Ready and one redb transaction. A request that crosses the budget is
/// still handled (it is already taken), so a round holds at most this plus one request.
const DRAIN_BYTES_PER_ROUND: usize = 64 << 20;
/// Bytes of proposed entries raft holds uncommitted (it refuses proposals past it, which callers see as a
/// retryable drop) and of committed entries one Ready hands over: what a stalled quorum or a long catch-up holds.
const MAX_RAFT_IN_FLIGHT_BYTES: u64 = 64 << 20;
/// Events buffered for one watcher; a watcher further behind is dropped and must Watch again.
pub const WATCH_BUFFER: usize = 4096;
/// A Watch further behind than this many log entries starts from a snapshot instead of replaying the log.
const MAX_CATCHUP_ENTRIES: u64 = 4096;
/// Nor does a Watch replay more log than this: 4,096 entries of full 16 MiB batches would be 64 GiB held for one
/// watcher, where a snapshot is bounded by the directory's own caps.
pub const MAX_CATCHUP_BYTES: u64 = 32 << 20;
/// Raft's election timeout, in ticks.
const ELECTION_TICK: usize = 10;
/// Ticks after which a read still without its index asks again. raft-rs drops a ReadIndex silently at a leader that
/// has not committed an entry in its term yet (one just elected), and a message can be lost on the way; nothing
/// tells the asker. One election timeout gives a new leader time to commit its first entry and keeps retries rare.
const READ_RETRY_TICKS: usize = ELECTION_TICK;
/// How long a caller waits for a commit or a read before giving up.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Most watchers one node serves at once; one more gets RESOURCE_EXHAUSTED. Each router replica holds one watch
/// (spread over the cluster's nodes), so a deployment needs tens; the cap leaves ample room for that while bounding
/// what a client that opens watches in a loop can pin: each new watcher may hold up to [`MAX_CATCHUP_BYTES`] of
/// replayed log and a copy of the directory snapshot, and every applied entry is offered to every watcher.
pub const MAX_WATCHERS: usize = 256;

/// Errors a caller of the node sees.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum NodeError {
    #[error("not the leader (leader: {})", leader.as_ref().map(|(id, a)| format!("node {id} at {a}")).unwrap_or_else(|| "unknown".into()))]
    NotLeader { leader: Option<(u64, String)> },
    #[error("proposal dropped ({0}); retry")]
    Dropped(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("rejected: {0}")]
    Rejected(String),
    #[error("timed out waiting for the cluster")]
    Timeout,
    #[error("too busy: {0}")]
    Exhausted(String),
    #[error("node stopped")]
    Stopped,
}

/// Static configuration of one node.
#[derive(Clone, Debug)]
pub struct RaftConfig {
    pub id: u64,
    pub advertise: String,
    /// Every initial voter's address (may include this node). Empty with `join` for a node added later.
    pub peers: BTreeMap<u64, String>,
    /// Start empty and wait for the leader's snapshot instead of bootstrapping a cluster.
    pub join: bool,
    pub tick: Duration,
    pub snapshot_every: u64,
}

/// What a new watcher gets: the catch-up events (a snapshot or replayed log entries), then live ones.
pub struct WatchStart {
    pub catch_up: Vec<Arc<pb::WatchEvent>>,
    pub live: mpsc::Receiver<Arc<pb::WatchEvent>>,
}

pub struct Committed {
    pub index: u64,
    pub outcome: Outcome,
}

type Reply<T> = oneshot::Sender<Result<T, NodeError>>;

enum Request {
    Step(Vec<Message>),
    Propose { cmd: pb::Command, reply: Reply<Committed> },
    ConfChange { change: ConfChange, reply: Reply<pb::MembershipResponse> },
    Read { req: pb::ReadRequest, reply: Reply<pb::ReadResponse> },
    Watch { from_index: u64, reply: Reply<WatchStart> },
    Status { reply: Reply<pb::StatusResponse> },
    Watchers { reply: Reply<usize> },
}

/// A cheap, cloneable way to talk to the node actor.
#[derive(Clone)]
pub struct NodeHandle {
    tx: mpsc::Sender<Request>,
}

impl NodeHandle {
    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Request) -> Result<T, NodeError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(make(reply)).await.map_err(|_| NodeError::Stopped)?;
        match tokio::time::timeout(REQUEST_TIMEOUT, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(NodeError::Stopped),
            Err(_) => Err(NodeError::Timeout),
        }
    }

    pub async fn step(&self, msgs: Vec<Message>) -> Result<(), NodeError> {
        self.tx.send(Request::Step(msgs)).await.map_err(|_| NodeError::Stopped)
    }

    /// Proposes a command and waits until it is committed and applied here.
    pub async fn propose(&self, cmd: pb::Command) -> Result<Committed, NodeError> {
        machine::validate(&cmd).map_err(NodeError::Invalid)?;
        self.call(|reply| Request::Propose { cmd, reply }).await
    }

    pub async fn add_node(&self, id: u64, address: String) -> Result<pb::MembershipResponse, NodeError> {
        if id == 0 || address.is_empty() || address.len() > machine::MAX_NAME_LEN {
            return Err(NodeError::Invalid("node id must be > 0 and the address non-empty (<= 256 bytes)".into()));
        }
        let mut change = ConfChange::default();
        change.set_change_type(ConfChangeType::AddNode);
        change.node_id = id;
        change.context = address.into_bytes();
        self.call(|reply| Request::ConfChange { change, reply }).await
    }

    pub async fn remove_node(&self, id: u64) -> Result<pb::MembershipResponse, NodeError> {
        let mut change = ConfChange::default();
        change.set_change_type(ConfChangeType::RemoveNode);
        change.node_id = id;
        self.call(|reply| Request::ConfChange { change, reply }).await
    }

    /// A linearizable read: served once this node has applied the leader's commit index as of the request.
    pub async fn read(&self, req: pb::ReadRequest) -> Result<pb::ReadResponse, NodeError> {
        if req.hashes.len() > machine::MAX_READ_HASHES || req.prefix_chain.len() > machine::MAX_READ_HASHES {
            return Err(NodeError::Invalid(format!("at most {} hashes per read", machine::MAX_READ_HASHES)));
        }
        self.call(|reply| Request::Read { req, reply }).await
    }

    pub async fn watch(&self, from_index: u64) -> Result<WatchStart, NodeError> {
        self.call(|reply| Request::Watch { from_index, reply }).await
    }

    pub async fn status(&self) -> Result<pb::StatusResponse, NodeError> {
        self.call(|reply| Request::Status { reply }).await
    }

    /// How many watchers the node holds whose stream is still open (operators and tests check for leaks with it).
    pub async fn watchers(&self) -> Result<usize, NodeError> {
        self.call(|reply| Request::Watchers { reply }).await
    }
}

struct Pending<T> {
    term: u64,
    reply: Reply<T>,
}

struct Watcher {
    from: u64,
    tx: mpsc::Sender<Arc<pb::WatchEvent>>,
}

/// A read waiting for its ReadIndex, with the leader and term it was asked under: raft-rs forgets a pending
/// ReadIndex when the leader or term changes, so such a read would otherwise wait out [`REQUEST_TIMEOUT`].
struct PendingRead {
    req: pb::ReadRequest,
    reply: Reply<pb::ReadResponse>,
    leader: u64,
    term: u64,
    /// Ticks since the ReadIndex was last asked.
    waited: usize,
}

/// Errors that stop the node.
#[derive(Debug, Error)]
pub enum FatalError {
    #[error(transparent)]
    Store(Box<StoreError>),
    #[error("raft: {0}")]
    Raft(Box<raft::Error>),
    #[error("corrupt snapshot: {0}")]
    Snapshot(String),
}

impl From<StoreError> for FatalError {
    fn from(e: StoreError) -> Self {
        Self::Store(Box::new(e))
    }
}

impl From<raft::Error> for FatalError {
    fn from(e: raft::Error) -> Self {
        Self::Raft(Box::new(e))
    }
}

/// The actor's state. Built by [`Node::open`], consumed by [`Node::run`].
pub struct Node {
    id: u64,
    raw: RawNode<RaftStore>,
    dir: BlockDirectory,
    members: BTreeMap<u64, String>,
    transport: Transport,
    /// Raft messages the peer tasks could not deliver.
    send_failures: mpsc::Receiver<SendFailure>,
    applied: u64,
    snapshot_every: u64,
    tick: Duration,
    proposals: HashMap<u64, Pending<Committed>>,
    conf_changes: HashMap<u64, Pending<pb::MembershipResponse>>,
    next_read: u64,
    reads: HashMap<u64, PendingRead>,
    /// The (leader, term) the pending reads were last checked against.
    read_view: (u64, u64),
    ready_reads: Vec<(u64, pb::ReadRequest, Reply<pb::ReadResponse>)>,
    watchers: Vec<Watcher>,
    /// The directory as a watch event at the applied index it was built at: watchers that start from a snapshot at
    /// one index (a router's replicas reconnecting together) share one build instead of one each. Dropped once the
    /// index moves on.
    watch_snapshot: Option<(u64, Arc<pb::WatchEvent>)>,
    leader: u64,
    role: StateRole,
    /// Take a snapshot at the next chance even if `snapshot_every` entries have not passed.
    force_snapshot: bool,
}

fn snapshot_data(dir: &BlockDirectory, members: &BTreeMap<u64, String>) -> Vec<u8> {
    pb::SnapshotData {
        directory: Some(machine::directory_to_proto(dir)),
        members: members.iter().map(|(id, a)| pb::Member { node_id: *id, address: a.clone() }).collect(),
    }
    .encode_to_vec()
}

fn restore(data: &[u8]) -> Result<(BlockDirectory, BTreeMap<u64, String>), FatalError> {
    let snap = pb::SnapshotData::decode(data).map_err(|e| FatalError::Snapshot(e.to_string()))?;
    let dir = match &snap.directory {
        Some(d) => machine::directory_from_proto(d).map_err(FatalError::Snapshot)?,
        None => BlockDirectory::new(),
    };
    Ok((dir, snap.members.into_iter().map(|m| (m.node_id, m.address)).collect()))
}

/// The raft payload a request brings into the next Ready (what [`DRAIN_BYTES_PER_ROUND`] counts); the other requests
/// are small.
fn request_bytes(req: &Request) -> usize {
    match req {
        Request::Propose { cmd, .. } => cmd.encoded_len(),
        Request::Step(msgs) => msgs
            .iter()
            .map(|m| {
                m.get_entries().iter().map(|e| e.get_data().len()).sum::<usize>() + m.get_snapshot().get_data().len()
            })
            .sum(),
        _ => 0,
    }
}

/// Handles `first` and then what is queued behind it, up to `max_requests` more or until `max_bytes` of payload (as
/// `size` counts it) were handled, whichever comes first.
fn drain_round<T, E>(
    first: T,
    rx: &mut mpsc::Receiver<T>,
    max_requests: usize,
    max_bytes: usize,
    size: impl Fn(&T) -> usize,
    mut handle: impl FnMut(T) -> Result<(), E>,
) -> Result<(), E> {
    let mut bytes = size(&first);
    handle(first)?;
    for _ in 0..max_requests {
        if bytes >= max_bytes {
            break;
        }
        match rx.try_recv() {
            Ok(req) => {
                bytes = bytes.saturating_add(size(&req));
                handle(req)?;
            }
            Err(_) => break,
        }
    }
    Ok(())
}

/// Forwards raft-rs's slog records to `tracing`.
struct TracingDrain;

impl slog::Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;
    fn log(&self, record: &slog::Record, _: &slog::OwnedKVList) -> Result<(), slog::Never> {
        match record.level() {
            slog::Level::Critical | slog::Level::Error => tracing::error!(target: "raft", "{}", record.msg()),
            slog::Level::Warning => tracing::warn!(target: "raft", "{}", record.msg()),
            slog::Level::Info => tracing::info!(target: "raft", "{}", record.msg()),
            _ => tracing::debug!(target: "raft", "{}", record.msg()),
        }
        Ok(())
    }
}

impl Node {
    /// Opens (or bootstraps) the node's storage and builds the raft node; restarting from an existing store restores
    /// the directory from its snapshot and lets raft re-apply the committed log after it.
    pub fn open(cfg: &RaftConfig, mut store: RaftStore) -> Result<Self, FatalError> {
        if !store.is_initialized() && !cfg.join {
            let mut members = cfg.peers.clone();
            members.insert(cfg.id, cfg.advertise.clone());
            let voters: Vec<u64> = members.keys().copied().collect();
            store.bootstrap(&voters, snapshot_data(&BlockDirectory::new(), &members))?;
        }
        let (dir, mut members) = if store.snapshot_metadata().index > 0 {
            restore(&store.snapshot_data()?)?
        } else {
            (BlockDirectory::new(), BTreeMap::new())
        };
        // A joining node knows its peers only from the command line until the leader's snapshot arrives.
        for (id, addr) in &cfg.peers {
            members.entry(*id).or_insert_with(|| addr.clone());
        }
        members.insert(cfg.id, cfg.advertise.clone());
        let applied = store.snapshot_metadata().index;
        let config = raft::Config {
            id: cfg.id,
            election_tick: ELECTION_TICK,
            heartbeat_tick: 2,
            applied,
            max_size_per_msg: 4 << 20,
            max_inflight_msgs: 256,
            max_uncommitted_size: MAX_RAFT_IN_FLIGHT_BYTES,
            max_committed_size_per_ready: MAX_RAFT_IN_FLIGHT_BYTES,
            check_quorum: true,
            pre_vote: true,
            ..Default::default()
        };
        config.validate()?;
        let logger = slog::Logger::root(TracingDrain, slog::o!("raft_id" => cfg.id));
        let sole_voter = store.conf_state().voters == [cfg.id];
        let mut raw = RawNode::new(&config, store, &logger)?;
        if sole_voter {
            // A one-voter cluster (the embedded mode) need not wait an election timeout.
            raw.campaign()?;
        }
        let (mut transport, send_failures) = Transport::new(cfg.id);
        for (id, addr) in &members {
            transport.set_peer(*id, addr);
        }
        Ok(Self {
            id: cfg.id,
            raw,
            dir,
            members,
            transport,
            send_failures,
            applied,
            snapshot_every: cfg.snapshot_every.max(1),
            tick: cfg.tick,
            proposals: HashMap::new(),
            conf_changes: HashMap::new(),
            next_read: 1,
            reads: HashMap::new(),
            read_view: (0, 0),
            ready_reads: Vec::new(),
            watchers: Vec::new(),
            watch_snapshot: None,
            leader: 0,
            role: StateRole::Follower,
            force_snapshot: false,
        })
    }

    /// Starts the actor. It runs until every handle is dropped (or a storage error stops it).
    pub fn spawn(self) -> (NodeHandle, tokio::task::JoinHandle<Result<(), FatalError>>) {
        let (tx, rx) = mpsc::channel(REQUEST_QUEUE);
        let task = tokio::spawn(self.run(rx));
        (NodeHandle { tx }, task)
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Request>) -> Result<(), FatalError> {
        let mut ticker = tokio::time::interval(self.tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    self.raw.tick();
                    self.reads.retain(|_, r| !r.reply.is_closed());
                    self.watchers.retain(|w| !w.tx.is_closed());
                    self.retry_reads();
                }
                req = rx.recv() => {
                    let Some(req) = req else { break };
                    drain_round(req, &mut rx, DRAIN_PER_ROUND, DRAIN_BYTES_PER_ROUND, request_bytes, |r| self.handle(r))?;
                }
                Some(failure) = self.send_failures.recv() => self.report_send_failure(failure),
            }
            self.report_send_failures();
            if let Err(e) = self.on_ready() {
                tracing::error!(node = self.id, "kvstore node stops: {e}");
                return Err(e);
            }
        }
        Ok(())
    }

    /// Tells raft about every lost send since the last round, so that it retries them.
    fn report_send_failures(&mut self) {
        for failure in self.transport.take_dropped() {
            self.report_send_failure(failure);
        }
        while let Ok(failure) = self.send_failures.try_recv() {
            self.report_send_failure(failure);
        }
    }

    fn report_send_failure(&mut self, failure: SendFailure) {
        match failure {
            // Without this the leader keeps the peer in its Snapshot state and never sends it anything again.
            SendFailure::Snapshot(to) => {
                tracing::debug!(node = self.id, peer = to, "raft snapshot send failed; raft will resend it");
                self.raw.report_snapshot(to, SnapshotStatus::Failure);
            }
            SendFailure::Unreachable(to) => self.raw.report_unreachable(to),
        }
    }

    fn not_leader(&self) -> NodeError {
        let leader = self.raw.raft.leader_id;
        NodeError::NotLeader {
            leader: (leader != 0 && leader != self.id)
                .then(|| self.members.get(&leader).map(|a| (leader, a.clone())))
                .flatten(),
        }
    }

    fn handle(&mut self, req: Request) -> Result<(), FatalError> {
        match req {
            Request::Step(msgs) => {
                for m in msgs {
                    if let Err(e) = self.raw.step(m) {
                        tracing::debug!(node = self.id, "raft step: {e}");
                    }
                }
            }
            Request::Propose { cmd, reply } => {
                if self.raw.raft.state != StateRole::Leader {
                    let _ = reply.send(Err(self.not_leader()));
                    return Ok(());
                }
                match self.raw.propose(Vec::new(), cmd.encode_to_vec()) {
                    Ok(()) => {
                        let index = self.raw.raft.raft_log.last_index();
                        self.proposals.insert(index, Pending { term: self.raw.raft.term, reply });
                    }
                    Err(e) => {
                        let _ = reply.send(Err(NodeError::Dropped(e.to_string())));
                    }
                }
            }
            Request::ConfChange { change, reply } => {
                if self.raw.raft.state != StateRole::Leader {
                    let _ = reply.send(Err(self.not_leader()));
                    return Ok(());
                }
                if self.raw.raft.has_pending_conf() {
                    let _ = reply.send(Err(NodeError::Dropped("another membership change is in progress".into())));
                    return Ok(());
                }
                let context = change.context.to_vec();
                match self.raw.propose_conf_change(context, change) {
                    Ok(()) => {
                        let index = self.raw.raft.raft_log.last_index();
                        self.conf_changes.insert(index, Pending { term: self.raw.raft.term, reply });
                    }
                    Err(e) => {
                        let _ = reply.send(Err(NodeError::Dropped(e.to_string())));
                    }
                }
            }
            Request::Read { req, reply } => {
                let (leader, term) = (self.raw.raft.leader_id, self.raw.raft.term);
                if leader == 0 {
                    // raft-rs drops a ReadIndex without a leader (a follower after losing it, a candidate) silently.
                    let _ = reply.send(Err(NodeError::Dropped("no raft leader known to confirm the read".into())));
                    return Ok(());
                }
                let ctx = self.next_read;
                self.next_read += 1;
                self.raw.read_index(ctx.to_le_bytes().to_vec());
                self.reads.insert(ctx, PendingRead { req, reply, leader, term, waited: 0 });
            }
            Request::Watch { from_index, reply } => {
                let _ = reply.send(self.watch(from_index));
            }
            Request::Status { reply } => {
                let _ = reply.send(Ok(self.status()));
            }
            Request::Watchers { reply } => {
                self.watchers.retain(|w| !w.tx.is_closed());
                let _ = reply.send(Ok(self.watchers.len()));
            }
        }
        Ok(())
    }

    fn status(&self) -> pb::StatusResponse {
        let raft = &self.raw.raft;
        let leader = raft.leader_id;
        pb::StatusResponse {
            node_id: self.id,
            leader_id: leader,
            leader_address: self.members.get(&leader).cloned().unwrap_or_default(),
            role: format!("{:?}", raft.state),
            term: raft.term,
            commit_index: raft.raft_log.committed,
            applied_index: self.applied,
            first_index: self.raw.store().first(),
            members: self.member_list(),
            blocks: self.dir.block_count() as u64,
        }
    }

    fn member_list(&self) -> Vec<pb::Member> {
        let voters = &self.raw.store().conf_state().voters;
        self.members
            .iter()
            .filter(|(id, _)| voters.contains(id))
            .map(|(id, a)| pb::Member { node_id: *id, address: a.clone() })
            .collect()
    }

    fn watch(&mut self, from_index: u64) -> Result<WatchStart, NodeError> {
        self.watchers.retain(|w| !w.tx.is_closed());
        if self.watchers.len() >= MAX_WATCHERS {
            return Err(NodeError::Exhausted(format!("{MAX_WATCHERS} watchers on this node; watch another node")));
        }
        // A from_index past the next entry is a log this node has not got (a lagging follower, or a cluster rebuilt
        // since the client last watched): the watcher starts from a snapshot, which a router applies as a full
        // resync, rather than waiting silently for an index that may never come.
        let replay = if from_index > 0
            && from_index <= self.applied + 1
            && from_index >= self.raw.store().first()
            && self.applied.saturating_sub(from_index) < MAX_CATCHUP_ENTRIES
        {
            self.replay_from(from_index)?
        } else {
            None
        };
        let (catch_up, from) = match replay {
            Some(events) => (events, self.applied + 1),
            None => (vec![self.snapshot_event()], self.applied + 1),
        };
        let (tx, live) = mpsc::channel(WATCH_BUFFER);
        self.watchers.push(Watcher { from, tx });
        Ok(WatchStart { catch_up, live })
    }

    /// The log's commands from `from_index` to the applied index, or `None` when they exceed
    /// [`MAX_CATCHUP_BYTES`] (the watcher then starts from a snapshot).
    fn replay_from(&self, from_index: u64) -> Result<Option<Vec<Arc<pb::WatchEvent>>>, NodeError> {
        if from_index > self.applied {
            return Ok(Some(Vec::new()));
        }
        let entries = self
            .raw
            .store()
            .read_entries(from_index, self.applied + 1, Some(MAX_CATCHUP_BYTES))
            .map_err(|e| NodeError::Rejected(format!("log read: {e}")))?;
        if entries.last().map(|e| e.index) != Some(self.applied) {
            return Ok(None);
        }
        Ok(Some(entries.iter().filter_map(command_event).map(Arc::new).collect()))
    }

    fn snapshot_event(&mut self) -> Arc<pb::WatchEvent> {
        if let Some((index, ev)) = &self.watch_snapshot
            && *index == self.applied
        {
            return ev.clone();
        }
        let ev = Arc::new(pb::WatchEvent {
            index: self.applied,
            body: Some(pb::watch_event::Body::Snapshot(machine::directory_to_proto(&self.dir))),
        });
        self.watch_snapshot = Some((self.applied, ev.clone()));
        ev
    }

    fn publish(&mut self, ev: pb::WatchEvent) {
        if !self.watchers.is_empty() {
            self.publish_shared(Arc::new(ev));
        }
    }

    fn publish_shared(&mut self, ev: Arc<pb::WatchEvent>) {
        self.watchers.retain(|w| {
            if ev.index < w.from {
                return true;
            }
            // A full buffer drops the watcher: its stream ends and it re-watches from its last index.
            w.tx.try_send(ev.clone()).is_ok()
        });
    }

    fn on_ready(&mut self) -> Result<(), FatalError> {
        if !self.raw.has_ready() {
            self.serve_reads();
            return Ok(());
        }
        let mut ready = self.raw.ready();
        if !ready.messages().is_empty() {
            self.transport.send(ready.take_messages());
        }
        if !ready.snapshot().is_empty() {
            let snap = ready.snapshot().clone();
            self.install_snapshot(&snap)?;
        }
        self.apply(ready.take_committed_entries())?;
        if let Some(ss) = ready.ss() {
            let (leader, role) = (ss.leader_id, ss.raft_state);
            self.on_role(leader, role);
        }
        // Indexes confirmed in this round are good even if the leader changed after; only the rest are orphaned.
        for rs in ready.take_read_states() {
            self.on_read_state(&rs.request_ctx, rs.index);
        }
        self.fail_orphaned_reads();
        let hs = ready.hs().cloned();
        self.raw.mut_store().append(ready.entries(), hs.as_ref())?;
        if !ready.persisted_messages().is_empty() {
            self.transport.send(ready.take_persisted_messages());
        }
        let mut light = self.raw.advance(ready);
        if let Some(commit) = light.commit_index() {
            self.raw.mut_store().set_commit(commit);
        }
        self.transport.send(light.take_messages());
        self.apply(light.take_committed_entries())?;
        self.raw.advance_apply();
        self.serve_reads();
        self.maybe_compact()?;
        Ok(())
    }

    fn on_role(&mut self, leader: u64, role: StateRole) {
        if role != self.role || leader != self.leader {
            tracing::info!(node = self.id, ?role, leader, term = self.raw.raft.term, "kvstore raft role");
        }
        if self.role == StateRole::Leader && role != StateRole::Leader {
            // Entries proposed by this leader may still commit under the next one; the callers retry, and every
            // command is idempotent.
            for (_, p) in self.proposals.drain() {
                let _ = p.reply.send(Err(NodeError::Dropped("leadership lost".into())));
            }
            for (_, p) in self.conf_changes.drain() {
                let _ = p.reply.send(Err(NodeError::Dropped("leadership lost".into())));
            }
        }
        self.role = role;
        self.leader = leader;
    }

    /// Fails the reads asked under another leader or term than now: raft-rs dropped their ReadIndex (a follower's
    /// request went to a leader that is gone; a leader's pending ones are cleared when it steps down).
    fn fail_orphaned_reads(&mut self) {
        let now = (self.raw.raft.leader_id, self.raw.raft.term);
        if now == self.read_view {
            return;
        }
        self.read_view = now;
        for (_, r) in self.reads.extract_if(|_, r| (r.leader, r.term) != now) {
            let _ =
                r.reply.send(Err(NodeError::Dropped("the raft leader changed before the read was confirmed".into())));
        }
    }

    /// Asks again for the index of reads that waited [`READ_RETRY_TICKS`] under the leader they were asked under.
    fn retry_reads(&mut self) {
        let mut again = Vec::new();
        for (ctx, r) in &mut self.reads {
            r.waited += 1;
            if r.waited >= READ_RETRY_TICKS {
                r.waited = 0;
                again.push(*ctx);
            }
        }
        for ctx in again {
            // A second answer for one ctx finds no pending read and is ignored.
            self.raw.read_index(ctx.to_le_bytes().to_vec());
        }
    }

    fn on_read_state(&mut self, ctx: &[u8], index: u64) {
        let Ok(bytes) = <[u8; 8]>::try_from(ctx) else { return };
        if let Some(r) = self.reads.remove(&u64::from_le_bytes(bytes)) {
            self.ready_reads.push((index, r.req, r.reply));
        }
    }

    fn serve_reads(&mut self) {
        if self.ready_reads.is_empty() {
            return;
        }
        let applied = self.applied;
        let (now, later): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.ready_reads).into_iter().partition(|r| r.0 <= applied);
        self.ready_reads = later;
        for (_, req, reply) in now {
            let _ = reply.send(Ok(self.answer(&req)));
        }
    }

    fn answer(&self, req: &pb::ReadRequest) -> pb::ReadResponse {
        pb::ReadResponse {
            blocks: req.hashes.iter().map(|h| machine::block_entry(*h, self.dir.residency(*h))).collect(),
            prefix: if req.prefix_chain.is_empty() {
                Vec::new()
            } else {
                self.dir
                    .prefix_matches(&req.prefix_chain)
                    .into_iter()
                    .map(|(worker, n)| pb::PrefixMatch { worker, blocks: n as u64 })
                    .collect()
            },
            workers: if req.workers {
                self.dir.workers().map(|(id, r)| machine::worker_info(id, r)).collect()
            } else {
                Vec::new()
            },
            index: self.applied,
        }
    }

    fn install_snapshot(&mut self, snap: &Snapshot) -> Result<(), FatalError> {
        let index = snap.get_metadata().index;
        let (dir, members) = restore(&snap.data)?;
        self.raw.mut_store().apply_snapshot(snap)?;
        self.dir = dir;
        for (id, addr) in &members {
            self.transport.set_peer(*id, addr);
        }
        self.members = members;
        self.members.entry(self.id).or_default();
        self.applied = index;
        self.watch_snapshot = None;
        tracing::info!(node = self.id, index, "installed a raft snapshot from the leader");
        if !self.watchers.is_empty() {
            let ev = self.snapshot_event();
            self.publish_shared(ev);
        }
        Ok(())
    }

    fn apply(&mut self, entries: Vec<Entry>) -> Result<(), FatalError> {
        for e in entries {
            if e.index <= self.applied {
                continue;
            }
            self.applied = e.index;
            self.watch_snapshot = None;
            match e.get_entry_type() {
                EntryType::EntryNormal => self.apply_normal(&e),
                EntryType::EntryConfChange => self.apply_conf_change(&e)?,
                EntryType::EntryConfChangeV2 => {
                    tracing::error!(node = self.id, index = e.index, "unexpected ConfChangeV2 entry ignored")
                }
            }
        }
        Ok(())
    }

    fn apply_normal(&mut self, e: &Entry) {
        let pending = self.proposals.remove(&e.index);
        if e.data.is_empty() {
            // The no-op a new leader appends; a proposal waiting on this index was overwritten.
            if let Some(p) = pending {
                let _ = p.reply.send(Err(NodeError::Dropped("entry overwritten by a new leader".into())));
            }
            return;
        }
        let cmd = match pb::Command::decode(&e.data[..]) {
            Ok(c) => c,
            Err(err) => {
                tracing::error!(node = self.id, index = e.index, "undecodable command skipped: {err}");
                return;
            }
        };
        let outcome = machine::apply_command(&mut self.dir, &cmd);
        if let Some(p) = pending {
            let r = if p.term == e.term {
                Ok(Committed { index: e.index, outcome })
            } else {
                Err(NodeError::Dropped("entry overwritten by a new leader".into()))
            };
            let _ = p.reply.send(r);
        }
        self.publish(pb::WatchEvent { index: e.index, body: Some(pb::watch_event::Body::Command(cmd)) });
    }

    fn apply_conf_change(&mut self, e: &Entry) -> Result<(), FatalError> {
        let pending = self.conf_changes.remove(&e.index);
        let mut cc = ConfChange::default();
        if let Err(err) = cc.merge_from_bytes(&e.data) {
            tracing::error!(node = self.id, index = e.index, "undecodable conf change skipped: {err}");
            return Ok(());
        }
        match self.raw.apply_conf_change(&cc) {
            Ok(cs) => {
                self.raw.mut_store().set_conf_state(cs)?;
                match cc.get_change_type() {
                    ConfChangeType::AddNode | ConfChangeType::AddLearnerNode => {
                        let addr = String::from_utf8_lossy(&cc.context).into_owned();
                        self.transport.set_peer(cc.node_id, &addr);
                        self.members.insert(cc.node_id, addr);
                        // A new node catches up by snapshot, and raft refuses one whose membership lacks it.
                        self.force_snapshot = true;
                    }
                    ConfChangeType::RemoveNode => {
                        self.transport.remove_peer(cc.node_id);
                        if cc.node_id != self.id {
                            self.members.remove(&cc.node_id);
                        }
                    }
                }
                tracing::info!(node = self.id, index = e.index, change = ?cc.get_change_type(), target = cc.node_id, "membership changed");
                if let Some(p) = pending {
                    let r = if p.term == e.term {
                        Ok(pb::MembershipResponse { members: self.member_list(), index: e.index })
                    } else {
                        Err(NodeError::Dropped("entry overwritten by a new leader".into()))
                    };
                    let _ = p.reply.send(r);
                }
            }
            Err(err) => {
                tracing::warn!(node = self.id, index = e.index, "conf change refused: {err}");
                if let Some(p) = pending {
                    let _ = p.reply.send(Err(NodeError::Rejected(err.to_string())));
                }
            }
        }
        Ok(())
    }

    fn maybe_compact(&mut self) -> Result<(), FatalError> {
        let store = self.raw.store();
        let due =
            self.force_snapshot || self.applied >= store.snapshot_metadata().index.saturating_add(self.snapshot_every);
        if !due || self.applied > store.hard_state().commit {
            return Ok(());
        }
        self.force_snapshot = false;
        let data = snapshot_data(&self.dir, &self.members);
        let cs = store.conf_state().clone();
        let index = self.applied;
        self.raw.mut_store().compact(index, cs, data)?;
        tracing::debug!(node = self.id, index, "snapshot taken, log compacted");
        Ok(())
    }
}

/// The watch event for a log entry, if it carries a command.
fn command_event(e: &Entry) -> Option<pb::WatchEvent> {
    if e.get_entry_type() != EntryType::EntryNormal || e.data.is_empty() {
        return None;
    }
    let cmd = pb::Command::decode(&e.data[..]).ok()?;
    Some(pb::WatchEvent { index: e.index, body: Some(pb::watch_event::Body::Command(cmd)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_stops_at_its_byte_budget_as_well_as_its_count() {
        const MIB: usize = 1 << 20;
        let (tx, mut rx) = mpsc::channel::<usize>(64);
        for _ in 0..10 {
            tx.try_send(16 * MIB).unwrap();
        }
        let mut handled = Vec::new();
        let first = rx.try_recv().unwrap();
        drain_round(
            first,
            &mut rx,
            DRAIN_PER_ROUND,
            64 * MIB,
            |n| *n,
            |n| {
                handled.push(n);
                Ok::<_, ()>(())
            },
        )
        .unwrap();
        assert_eq!(handled.len(), 4, "64 MiB of 16 MiB requests");
        assert_eq!(rx.len(), 6, "the rest waits for the next round");
        // Small requests stop at the count.
        let (tx, mut rx) = mpsc::channel::<usize>(64);
        for _ in 0..10 {
            tx.try_send(1).unwrap();
        }
        let mut n = 0;
        drain_round(
            0,
            &mut rx,
            3,
            64 * MIB,
            |n| *n,
            |_| {
                n += 1;
                Ok::<_, ()>(())
            },
        )
        .unwrap();
        assert_eq!((n, rx.len()), (4, 7));
        // The payload a proposal brings is its command.
        let cmd = pb::Command {
            op: Some(pb::command::Op::RemoveWorker(pb::RemoveWorkerRequest { worker: "w".repeat(100) })),
        };
        let (reply, _rx) = oneshot::channel();
        assert_eq!(request_bytes(&Request::Propose { cmd: cmd.clone(), reply }), cmd.encoded_len());
    }

    /// A single-voter node that never compacts, opened under `dir`: a sole voter campaigns at open, and a few
    /// rounds make it leader and commit its first entry.
    fn sole_voter_leader(dir: &std::path::Path) -> Node {
        let store = RaftStore::open(&dir.join("raft.redb")).unwrap();
        let cfg = RaftConfig {
            id: 1,
            advertise: "127.0.0.1:1".into(),
            peers: BTreeMap::new(),
            join: false,
            tick: Duration::from_millis(10),
            snapshot_every: u64::MAX,
        };
        let mut node = Node::open(&cfg, store).unwrap();
        for _ in 0..5 {
            node.on_ready().unwrap();
        }
        node
    }

    #[tokio::test]
    async fn proposals_past_the_uncommitted_budget_are_dropped_for_a_retry() {
        let dir = tempfile::tempdir().unwrap();
        let mut node = sole_voter_leader(dir.path());
        assert_eq!(node.raw.raft.state, StateRole::Leader);
        // Nothing commits while the Ready is not handled: the proposals pile up uncommitted, as behind a lost quorum.
        let big = pb::Command {
            op: Some(pb::command::Op::RemoveWorker(pb::RemoveWorkerRequest { worker: "w".repeat(4 << 20) })),
        };
        let mut replies = Vec::new();
        for _ in 0..32 {
            let (reply, rx) = oneshot::channel();
            node.handle(Request::Propose { cmd: big.clone(), reply }).unwrap();
            replies.push(rx);
        }
        let dropped =
            replies.iter_mut().map(|rx| rx.try_recv()).filter(|r| matches!(r, Ok(Err(NodeError::Dropped(_))))).count();
        assert!(dropped >= 32 - 16, "{dropped} of 32 proposals of 4 MiB dropped past a 64 MiB budget");
        assert!(node.raw.raft.uncommitted_size() as u64 <= MAX_RAFT_IN_FLIGHT_BYTES);
    }

    #[tokio::test]
    async fn a_snapshot_interval_of_u64_max_never_overflows_nor_compacts() {
        let dir = tempfile::tempdir().unwrap();
        let node = sole_voter_leader(dir.path());
        let snapshot = node.raw.store().snapshot_metadata().index;
        assert!(node.applied > snapshot, "applied {} is past the snapshot at {snapshot}", node.applied);
        assert_eq!(snapshot, crate::storage::BOOTSTRAP_INDEX, "no snapshot is ever due");
    }
}
