//! Raft messages between kvstore nodes over tonic.
//!
//! [`Transport`] owns one outgoing queue and sender task per peer; the node actor hands it messages and never waits:
//! a full queue drops the message (raft retransmits), a failed send drops its batch and the next batch reconnects.
//! [`RaftService`] is the receiving side: it decodes a batch and passes it to the local node actor.

use std::collections::HashMap;
use std::time::Duration;

use pagoda_proto::kvstore as pb;
use pb::raft_client::RaftClient;
use protobuf::Message as _;
use raft::eraftpb::Message;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status};

use crate::node::NodeHandle;

/// Messages waiting for one peer before new ones are dropped.
const PEER_QUEUE: usize = 4096;
/// Most messages in one RPC.
pub const MAX_BATCH: usize = 1024;
/// Largest gRPC message between peers (a snapshot of a large directory travels in one).
pub const MAX_RAFT_MESSAGE_BYTES: usize = 256 << 20;
const SEND_TIMEOUT: Duration = Duration::from_secs(10);
const RETRY_PAUSE: Duration = Duration::from_millis(100);

struct Peer {
    addr: String,
    tx: mpsc::Sender<Message>,
    task: JoinHandle<()>,
}

/// Outgoing raft traffic of one node.
pub struct Transport {
    id: u64,
    peers: HashMap<u64, Peer>,
}

impl Transport {
    pub fn new(id: u64) -> Self {
        Self { id, peers: HashMap::new() }
    }

    /// Adds a peer, or points it at a new address.
    pub fn set_peer(&mut self, id: u64, addr: &str) {
        if id == self.id || self.peers.get(&id).is_some_and(|p| p.addr == addr) {
            return;
        }
        self.remove_peer(id);
        let (tx, rx) = mpsc::channel(PEER_QUEUE);
        let task = tokio::spawn(run_peer(self.id, id, addr.to_string(), rx));
        self.peers.insert(id, Peer { addr: addr.to_string(), tx, task });
    }

    pub fn remove_peer(&mut self, id: u64) {
        if let Some(p) = self.peers.remove(&id) {
            p.task.abort();
        }
    }

    pub fn send(&mut self, msgs: Vec<Message>) {
        for m in msgs {
            match self.peers.get(&m.to) {
                Some(p) => {
                    if p.tx.try_send(m).is_err() {
                        tracing::debug!(peer = p.addr, "raft queue full; message dropped");
                    }
                }
                None => tracing::debug!(to = m.to, "raft message to an unknown peer dropped"),
            }
        }
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        for p in self.peers.values() {
            p.task.abort();
        }
    }
}

async fn run_peer(from: u64, to: u64, addr: String, mut rx: mpsc::Receiver<Message>) {
    let endpoint = match pagoda_proto::tls::endpoint(&addr) {
        Ok(e) => e.connect_timeout(Duration::from_secs(1)).timeout(SEND_TIMEOUT).tcp_nodelay(true),
        Err(e) => {
            tracing::error!(peer = to, addr, "invalid peer address: {e}");
            return;
        }
    };
    // A lazy channel reconnects by itself after the peer comes back.
    let mut client = RaftClient::new(endpoint.connect_lazy())
        .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES);
    while let Some(first) = rx.recv().await {
        let mut batch = Vec::with_capacity(16);
        let mut next = Some(first);
        while let Some(m) = next {
            match m.write_to_bytes() {
                Ok(b) => batch.push(b),
                Err(e) => tracing::error!(peer = to, "raft message encode: {e}"),
            }
            next = if batch.len() < MAX_BATCH { rx.try_recv().ok() } else { None };
        }
        if let Err(e) = client.send(pb::RaftBatch { from, messages: batch }).await {
            tracing::debug!(peer = to, addr, "raft send failed: {}", e.message());
            // Raft resends what matters; pausing keeps a dead peer from spinning the task.
            tokio::time::sleep(RETRY_PAUSE).await;
            while rx.try_recv().is_ok() {}
        }
    }
}

/// The receiving side of the raft transport.
pub struct RaftService {
    node: NodeHandle,
}

impl RaftService {
    pub fn new(node: NodeHandle) -> Self {
        Self { node }
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
            msgs.push(m);
        }
        self.node.step(msgs).await.map_err(Status::from)?;
        Ok(Response::new(pb::RaftAck {}))
    }
}
