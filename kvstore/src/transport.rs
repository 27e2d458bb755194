//! Raft messages between kvstore nodes over tonic.
//!
//! [`Transport`] owns one outgoing queue and sender task per peer; the node actor hands it messages and never waits:
//! a full queue drops the message, a failed send drops its batch and the next batch reconnects. Raft retransmits
//! what was lost, but only once it knows: every loss comes back to the node as a [`SendFailure`] so that it can
//! report it to raft (a lost snapshot otherwise leaves the peer waiting for it until leadership changes).
//! [`RaftService`] is the receiving side: it checks that a batch is addressed to this node, decodes it and passes it
//! to the local node actor.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use pagoda_proto::kvstore as pb;
use pb::raft_client::RaftClient;
use protobuf::Message as _;
use raft::eraftpb::{Message, MessageType};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status};

use crate::node::NodeHandle;

/// Messages waiting for one peer before new ones are dropped.
const PEER_QUEUE: usize = 4096;
/// Send failures waiting for the node actor. A lost snapshot waits for room (its report must arrive); other
/// failures are dropped when it is full, since the next failed send reports the peer again.
const FAILURE_QUEUE: usize = 1024;
/// Most messages in one RPC.
pub const MAX_BATCH: usize = 1024;
/// Largest gRPC message between peers (a snapshot of a large directory travels in one).
pub const MAX_RAFT_MESSAGE_BYTES: usize = 256 << 20;
const SEND_TIMEOUT: Duration = Duration::from_secs(10);
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Raft messages for a peer that never reached it, as the node must report them to raft.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendFailure {
    /// A snapshot for this peer was lost: raft keeps the peer in its Snapshot state, sending it nothing else, until
    /// told that the snapshot failed.
    Snapshot(u64),
    /// Other messages for this peer were lost: raft should probe it instead of streaming entries at it.
    Unreachable(u64),
}

impl SendFailure {
    /// What losing messages of the types `lost` (for peer `to`) means to raft; `None` when nothing was lost.
    fn of_lost(to: u64, lost: impl IntoIterator<Item = MessageType>) -> Option<Self> {
        let mut any = false;
        for t in lost {
            if t == MessageType::MsgSnapshot {
                return Some(Self::Snapshot(to));
            }
            any = true;
        }
        any.then_some(Self::Unreachable(to))
    }
}

struct Peer {
    addr: String,
    tx: mpsc::Sender<Message>,
    task: JoinHandle<()>,
    /// Snapshots queued or in flight whose fate the task has not settled (sent, or reported lost): the task can be
    /// aborted with one, and raft must then hear of its loss from whoever aborted it.
    snapshots: Arc<AtomicUsize>,
}

/// Outgoing raft traffic of one node.
pub struct Transport {
    id: u64,
    peers: HashMap<u64, Peer>,
    /// Where the peer tasks report lost sends.
    failures: mpsc::Sender<SendFailure>,
    /// Messages the node's own `send` dropped (a full queue), reported without a channel that could be full too.
    dropped: Vec<SendFailure>,
}

impl Transport {
    /// A transport for node `id`, and the receiving end of its [`SendFailure`] reports.
    pub fn new(id: u64) -> (Self, mpsc::Receiver<SendFailure>) {
        let (failures, rx) = mpsc::channel(FAILURE_QUEUE);
        (Self { id, peers: HashMap::new(), failures, dropped: Vec::new() }, rx)
    }

    /// Adds a peer, or points it at a new address. What was queued for the old address is lost, and reported as
    /// lost (raft keeps the peer: a snapshot it never hears about again would stall that peer for good).
    pub fn set_peer(&mut self, id: u64, addr: &str) {
        if id == self.id || self.peers.get(&id).is_some_and(|p| p.addr == addr) {
            return;
        }
        if let Some(old) = self.peers.remove(&id) {
            old.task.abort();
            self.dropped.push(SendFailure::Unreachable(id));
            if old.snapshots.load(Ordering::Acquire) > 0 {
                self.dropped.push(SendFailure::Snapshot(id));
            }
        }
        let (tx, rx) = mpsc::channel(PEER_QUEUE);
        let snapshots = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(run_peer(self.id, id, addr.to_string(), rx, self.failures.clone(), snapshots.clone()));
        self.peers.insert(id, Peer { addr: addr.to_string(), tx, task, snapshots });
    }

    /// Drops a peer that left the cluster; raft forgot it, so nothing lost is reported.
    pub fn remove_peer(&mut self, id: u64) {
        if let Some(p) = self.peers.remove(&id) {
            p.task.abort();
        }
    }

    pub fn send(&mut self, msgs: Vec<Message>) {
        for m in msgs {
            match self.peers.get(&m.to) {
                Some(p) => {
                    let snapshot = m.get_msg_type() == MessageType::MsgSnapshot;
                    // Counted before the task can see it, so that it never settles one not yet counted.
                    if snapshot {
                        p.snapshots.fetch_add(1, Ordering::AcqRel);
                    }
                    if let Err(e) = p.tx.try_send(m) {
                        let m = match e {
                            mpsc::error::TrySendError::Full(m) | mpsc::error::TrySendError::Closed(m) => m,
                        };
                        if snapshot {
                            p.snapshots.fetch_sub(1, Ordering::AcqRel);
                        }
                        tracing::debug!(peer = p.addr, "raft queue full; message dropped");
                        self.dropped.extend(SendFailure::of_lost(m.to, [m.get_msg_type()]));
                    }
                }
                None => tracing::debug!(to = m.to, "raft message to an unknown peer dropped"),
            }
        }
    }

    /// The failures of [`Self::send`] since the last call.
    pub fn take_dropped(&mut self) -> Vec<SendFailure> {
        std::mem::take(&mut self.dropped)
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        for p in self.peers.values() {
            p.task.abort();
        }
    }
}

async fn report(failures: &mpsc::Sender<SendFailure>, failure: Option<SendFailure>) {
    match failure {
        // Awaiting only blocks this peer's task, never the node actor, which drains the channel.
        Some(f @ SendFailure::Snapshot(_)) => {
            let _ = failures.send(f).await;
        }
        Some(f @ SendFailure::Unreachable(_)) => {
            let _ = failures.try_send(f);
        }
        None => {}
    }
}

async fn run_peer(
    from: u64,
    to: u64,
    addr: String,
    mut rx: mpsc::Receiver<Message>,
    failures: mpsc::Sender<SendFailure>,
    snapshots: Arc<AtomicUsize>,
) {
    // Called once the snapshots among `settled` were sent or reported lost.
    let settle = |settled: &[MessageType]| {
        let n = settled.iter().filter(|t| **t == MessageType::MsgSnapshot).count();
        if n > 0 {
            snapshots.fetch_sub(n, Ordering::AcqRel);
        }
    };
    let endpoint = match pagoda_proto::tls::endpoint(&addr) {
        Ok(e) => e.connect_timeout(Duration::from_secs(1)).timeout(SEND_TIMEOUT).tcp_nodelay(true),
        Err(e) => {
            tracing::error!(peer = to, addr, "invalid peer address: {e}");
            // Nothing will ever reach this peer; raft must still hear of each loss.
            while let Some(m) = rx.recv().await {
                report(&failures, SendFailure::of_lost(to, [m.get_msg_type()])).await;
                settle(&[m.get_msg_type()]);
            }
            return;
        }
    };
    // A lazy channel reconnects by itself after the peer comes back.
    let mut client = RaftClient::new(endpoint.connect_lazy())
        .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES);
    while let Some(first) = rx.recv().await {
        let mut batch = Vec::with_capacity(16);
        // Only the types are kept: a snapshot's data need not stay alive beside its encoding.
        let mut sent = Vec::with_capacity(16);
        let mut unencodable = Vec::new();
        let mut next = Some(first);
        while let Some(m) = next {
            match m.write_to_bytes() {
                Ok(b) => {
                    batch.push(b);
                    sent.push(m.get_msg_type());
                }
                Err(e) => {
                    tracing::error!(peer = to, "raft message encode: {e}");
                    unencodable.push(m.get_msg_type());
                }
            }
            next = if batch.len() < MAX_BATCH { rx.try_recv().ok() } else { None };
        }
        report(&failures, SendFailure::of_lost(to, unencodable.iter().copied())).await;
        settle(&unencodable);
        if batch.is_empty() {
            continue;
        }
        if let Err(e) = client.send(pb::RaftBatch { from, messages: batch }).await {
            tracing::debug!(peer = to, addr, "raft send failed: {}", e.message());
            // Raft resends what matters once it hears of the loss; pausing keeps a dead peer from spinning the task.
            tokio::time::sleep(RETRY_PAUSE).await;
            while let Ok(m) = rx.try_recv() {
                sent.push(m.get_msg_type());
            }
            report(&failures, SendFailure::of_lost(to, sent.iter().copied())).await;
        }
        settle(&sent);
    }
}

/// Why a message in a batch from `sender` must not reach the raft node `local`: raft-rs trusts both ids, and a
/// message meant for another node id (one that this address used to host) can carry a commit index beyond the local
/// log, which raft treats as corruption and panics on.
fn misaddressed(local: u64, sender: u64, m: &Message) -> Option<String> {
    if m.to != local {
        return Some(format!("raft message for node {} reached node {local}", m.to));
    }
    if m.from != sender {
        return Some(format!("raft message from node {} in a batch from node {sender}", m.from));
    }
    None
}

/// The receiving side of the raft transport.
pub struct RaftService {
    id: u64,
    node: NodeHandle,
    /// Batches refused as misaddressed, for the rate-limited warning.
    misaddressed: AtomicU64,
}

impl RaftService {
    /// The service of raft node `id`.
    pub fn new(id: u64, node: NodeHandle) -> Self {
        Self { id, node, misaddressed: AtomicU64::new(0) }
    }
}

#[tonic::async_trait]
impl pb::raft_server::Raft for RaftService {
    async fn send(&self, request: Request<pb::RaftBatch>) -> Result<Response<pb::RaftAck>, Status> {
        let batch = request.into_inner();
        if batch.messages.len() > MAX_BATCH {
            return Err(Status::invalid_argument(format!(
                "{} raft messages in one batch (at most {MAX_BATCH})",
                batch.messages.len()
            )));
        }
        let mut msgs = Vec::with_capacity(batch.messages.len());
        for b in &batch.messages {
            let mut m = Message::default();
            m.merge_from_bytes(b).map_err(|e| Status::invalid_argument(format!("raft message: {e}")))?;
            if let Some(why) = misaddressed(self.id, batch.from, &m) {
                let count = self.misaddressed.fetch_add(1, Ordering::Relaxed) + 1;
                // A replaced node's old peers keep sending every tick until membership catches up.
                if count.is_power_of_two() {
                    tracing::warn!(node = self.id, count, "misaddressed raft batch refused: {why}");
                } else {
                    tracing::debug!(node = self.id, count, "misaddressed raft batch refused: {why}");
                }
                return Err(Status::invalid_argument(why));
            }
            msgs.push(m);
        }
        self.node.step(msgs).await.map_err(Status::from)?;
        Ok(Response::new(pb::RaftAck {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(kind: MessageType, to: u64) -> Message {
        let mut m = Message::default();
        m.set_msg_type(kind);
        m.from = 1;
        m.to = to;
        m
    }

    /// An address that refuses connections: a port that was just released.
    async fn refusing_addr() -> String {
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().to_string()
    }

    #[test]
    fn a_lost_snapshot_outranks_other_losses() {
        let append = message(MessageType::MsgAppend, 2);
        let snapshot = message(MessageType::MsgSnapshot, 2);
        assert_eq!(
            SendFailure::of_lost(2, [&append, &snapshot, &append].map(Message::get_msg_type)),
            Some(SendFailure::Snapshot(2))
        );
        assert_eq!(SendFailure::of_lost(2, [append.get_msg_type()]), Some(SendFailure::Unreachable(2)));
        assert_eq!(SendFailure::of_lost(2, []), None);
    }

    #[test]
    fn only_messages_for_this_node_from_the_batch_sender_pass() {
        let heartbeat = message(MessageType::MsgHeartbeat, 3);
        assert_eq!(misaddressed(3, 1, &heartbeat), None);
        assert!(misaddressed(5, 1, &heartbeat).unwrap().contains("for node 3 reached node 5"));
        assert!(misaddressed(3, 2, &heartbeat).unwrap().contains("from node 1 in a batch from node 2"));
    }

    #[tokio::test]
    async fn failed_sends_come_back_as_reports() {
        let (mut transport, mut failures) = Transport::new(1);
        transport.set_peer(2, &refusing_addr().await);
        async fn next(failures: &mut mpsc::Receiver<SendFailure>) -> SendFailure {
            tokio::time::timeout(Duration::from_secs(10), failures.recv()).await.unwrap().unwrap()
        }
        transport.send(vec![message(MessageType::MsgAppend, 2)]);
        assert_eq!(next(&mut failures).await, SendFailure::Unreachable(2));
        transport.send(vec![message(MessageType::MsgSnapshot, 2)]);
        assert_eq!(next(&mut failures).await, SendFailure::Snapshot(2));
        assert!(transport.take_dropped().is_empty());
    }

    #[tokio::test]
    async fn a_snapshot_dropped_on_a_full_queue_is_reported() {
        let (mut transport, _failures) = Transport::new(1);
        transport.set_peer(2, &refusing_addr().await);
        // On this single-threaded runtime the peer task cannot drain its queue before `send` returns.
        let mut msgs: Vec<Message> = (0..PEER_QUEUE).map(|_| message(MessageType::MsgAppend, 2)).collect();
        msgs.push(message(MessageType::MsgSnapshot, 2));
        msgs.push(message(MessageType::MsgAppend, 2));
        transport.send(msgs);
        assert_eq!(transport.take_dropped(), [SendFailure::Snapshot(2), SendFailure::Unreachable(2)]);
        assert!(transport.take_dropped().is_empty());
    }

    #[tokio::test]
    async fn a_peer_moved_to_a_new_address_reports_what_its_old_queue_lost() {
        let (mut transport, _failures) = Transport::new(1);
        transport.set_peer(2, &refusing_addr().await);
        // On this single-threaded runtime the old peer task has not taken the snapshot when it is aborted.
        transport.send(vec![message(MessageType::MsgSnapshot, 2)]);
        transport.set_peer(2, &refusing_addr().await);
        assert_eq!(transport.take_dropped(), [SendFailure::Unreachable(2), SendFailure::Snapshot(2)]);
        // Without a snapshot queued, only the other losses.
        transport.send(vec![message(MessageType::MsgAppend, 2)]);
        transport.set_peer(2, &refusing_addr().await);
        assert_eq!(transport.take_dropped(), [SendFailure::Unreachable(2)]);
        // The same address again changes nothing.
        let addr = transport.peers[&2].addr.clone();
        transport.set_peer(2, &addr);
        assert!(transport.take_dropped().is_empty());
    }

    #[tokio::test]
    async fn a_settled_snapshot_is_not_reported_again_when_the_peer_moves() {
        let (mut transport, mut failures) = Transport::new(1);
        transport.set_peer(2, &refusing_addr().await);
        transport.send(vec![message(MessageType::MsgSnapshot, 2)]);
        let reported = tokio::time::timeout(Duration::from_secs(10), failures.recv()).await.unwrap();
        assert_eq!(reported, Some(SendFailure::Snapshot(2)));
        // The task settles the snapshot right after reporting it.
        for _ in 0..100 {
            if transport.peers[&2].snapshots.load(Ordering::Acquire) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        transport.set_peer(2, &refusing_addr().await);
        assert_eq!(transport.take_dropped(), [SendFailure::Unreachable(2)]);
    }
}
