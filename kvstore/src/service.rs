//! The `KvStore` gRPC service: turns requests into node proposals, reads and watches, and node errors into gRPC
//! statuses.
//!
//! A write sent to a follower fails with UNAVAILABLE carrying the metadata [`LEADER_ID`] and [`LEADER_ADDR`] (the
//! leader's advertised address) when the leader is known; `crate::Client` follows it.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use pagoda_proto::kvstore as pb;
use pb::command::Op;
use tokio::sync::mpsc;
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status};

use crate::directory::ApplyOutcome;
use crate::machine::Outcome;
use crate::node::{NodeError, NodeHandle, WatchStart};

/// Metadata key: the leader's raft id on a redirect.
pub const LEADER_ID: &str = "pagoda-leader-id";
/// Metadata key: the leader's advertised address on a redirect.
pub const LEADER_ADDR: &str = "pagoda-leader-addr";

impl From<NodeError> for Status {
    fn from(e: NodeError) -> Self {
        let msg = e.to_string();
        match e {
            NodeError::NotLeader { leader } => {
                let mut s = Status::unavailable(msg);
                if let Some((id, addr)) = leader {
                    if let Ok(v) = MetadataValue::try_from(id.to_string()) {
                        s.metadata_mut().insert(LEADER_ID, v);
                    }
                    if let Ok(v) = MetadataValue::try_from(addr) {
                        s.metadata_mut().insert(LEADER_ADDR, v);
                    }
                }
                s
            }
            NodeError::Dropped(_) | NodeError::Stopped => Status::unavailable(msg),
            NodeError::Timeout => Status::deadline_exceeded(msg),
            NodeError::Exhausted(_) => Status::resource_exhausted(msg),
            NodeError::Invalid(_) => Status::invalid_argument(msg),
            NodeError::Rejected(_) => Status::failed_precondition(msg),
        }
    }
}

pub struct KvStoreService {
    node: NodeHandle,
}

impl KvStoreService {
    pub fn new(node: NodeHandle) -> Self {
        Self { node }
    }

    async fn commit(&self, op: Op) -> Result<(u64, Outcome), Status> {
        let c = self.node.propose(pb::Command { op: Some(op) }).await?;
        match c.outcome {
            Outcome::Rejected(why) => Err(Status::failed_precondition(why)),
            o => Ok((c.index, o)),
        }
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::kv_store_server::KvStore for KvStoreService {
    async fn publish(&self, request: Request<pb::PublishRequest>) -> Result<Response<pb::PublishResponse>, Status> {
        let (index, outcome) = self.commit(Op::Publish(request.into_inner())).await?;
        let resp = match outcome {
            Outcome::Published(ApplyOutcome::Applied { applied, skipped }) => pb::PublishResponse {
                applied: applied as u64,
                skipped: skipped as u64,
                snapshot_required: false,
                expected_seq: 0,
                index,
            },
            Outcome::Published(ApplyOutcome::Gap { expected, .. }) => {
                pb::PublishResponse { applied: 0, skipped: 0, snapshot_required: true, expected_seq: expected, index }
            }
            other => return Err(Status::internal(format!("publish applied as {other:?}"))),
        };
        Ok(Response::new(resp))
    }

    async fn register(&self, request: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterResponse>, Status> {
        let (index, _) = self.commit(Op::Register(request.into_inner())).await?;
        Ok(Response::new(pb::RegisterResponse { index }))
    }

    async fn remove_worker(
        &self,
        request: Request<pb::RemoveWorkerRequest>,
    ) -> Result<Response<pb::RemoveWorkerResponse>, Status> {
        let (index, outcome) = self.commit(Op::RemoveWorker(request.into_inner())).await?;
        Ok(Response::new(pb::RemoveWorkerResponse { removed: outcome == Outcome::WorkerRemoved(true), index }))
    }

    async fn publish_snapshot(
        &self,
        request: Request<pb::WorkerSnapshotRequest>,
    ) -> Result<Response<pb::WorkerSnapshotResponse>, Status> {
        let (index, _) = self.commit(Op::WorkerSnapshot(request.into_inner())).await?;
        Ok(Response::new(pb::WorkerSnapshotResponse { index }))
    }

    type WatchStream = WatchStream;

    async fn watch(&self, request: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let WatchStart { catch_up, live } = self.node.watch(request.into_inner().from_index).await?;
        Ok(Response::new(Box::pin(watch_stream(catch_up, live))))
    }

    async fn read(&self, request: Request<pb::ReadRequest>) -> Result<Response<pb::ReadResponse>, Status> {
        Ok(Response::new(self.node.read(request.into_inner()).await?))
    }

    async fn add_node(&self, request: Request<pb::AddNodeRequest>) -> Result<Response<pb::MembershipResponse>, Status> {
        let r = request.into_inner();
        Ok(Response::new(self.node.add_node(r.node_id, r.address).await?))
    }

    async fn remove_node(
        &self,
        request: Request<pb::RemoveNodeRequest>,
    ) -> Result<Response<pb::MembershipResponse>, Status> {
        Ok(Response::new(self.node.remove_node(request.into_inner().node_id).await?))
    }

    async fn status(&self, _request: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        Ok(Response::new(self.node.status().await?))
    }
}

/// Catch-up first, then live events; when the node drops the watcher (it fell [`crate::node::WATCH_BUFFER`] events
/// behind, or the node stopped) the stream ends with ABORTED naming the index to Watch again from.
fn watch_stream(
    catch_up: Vec<Arc<pb::WatchEvent>>,
    mut live: mpsc::Receiver<Arc<pb::WatchEvent>>,
) -> impl Stream<Item = Result<pb::WatchEvent, Status>> + Send {
    async_stream(move |tx| async move {
        let mut last = 0;
        for ev in catch_up {
            last = ev.index;
            // A watcher that is the event's last holder takes it; a shared one (a snapshot, a live event other
            // watchers also get) is copied.
            if tx.send(Ok(Arc::unwrap_or_clone(ev))).await.is_err() {
                return;
            }
        }
        loop {
            // A client that went away must end the task even when no event comes (an idle cluster): otherwise it
            // and its watcher in the node would live on until the next event.
            let ev = tokio::select! {
                ev = live.recv() => ev,
                _ = tx.closed() => return,
            };
            let Some(ev) = ev else { break };
            last = ev.index;
            if tx.send(Ok(Arc::unwrap_or_clone(ev))).await.is_err() {
                return;
            }
        }
        let _ = tx
            .send(Err(Status::aborted(format!(
                "watch ended (too slow or node stopping); Watch again from {}",
                last + 1
            ))))
            .await;
    })
}

/// A stream fed by a task through a small bounded channel; the task stops when the client goes away.
fn async_stream<F, Fut>(f: F) -> impl Stream<Item = Result<pb::WatchEvent, Status>> + Send
where
    F: FnOnce(mpsc::Sender<Result<pb::WatchEvent, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(f(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
