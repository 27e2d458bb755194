//! A kvstore client for a cluster: it sends writes to the leader, following the redirect a follower answers with
//! (UNAVAILABLE + [`crate::service::LEADER_ADDR`]), tries the next node when one is down, and retries while the
//! cluster elects a leader, up to a deadline. Every write is idempotent, so a retry after a lost answer is safe.
//! A client made with [`Client::following`] takes up a new node list (from the etcd registry) between attempts.

use std::time::{Duration, Instant};

use pagoda_proto::kvstore as pb;
use pb::kv_store_client::KvStoreClient;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::endpoints::Endpoints;
use crate::server::MAX_CLIENT_MESSAGE_BYTES;
use crate::service::LEADER_ADDR;

/// How long one call keeps retrying before giving up.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(20);
const RETRY_PAUSE: Duration = Duration::from_millis(50);

pub struct Client {
    endpoints: Vec<String>,
    /// Index into `endpoints` of the node believed to lead.
    current: usize,
    channels: Vec<Option<KvStoreClient<Channel>>>,
    deadline: Duration,
    /// Where a new node list comes from, for a client that follows membership.
    updates: Option<Endpoints>,
}

fn channel(addr: &str) -> Result<KvStoreClient<Channel>, Status> {
    let endpoint = pagoda_proto::tls::endpoint(addr)
        .map_err(|e| Status::invalid_argument(format!("bad kvstore address {addr}: {e}")))?
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(15))
        .tcp_nodelay(true);
    Ok(KvStoreClient::new(endpoint.connect_lazy())
        .max_decoding_message_size(crate::transport::MAX_RAFT_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_CLIENT_MESSAGE_BYTES))
}

impl Client {
    /// A client for the nodes at `endpoints` (`host:port`); connections are made lazily.
    pub fn new(endpoints: Vec<String>) -> Result<Self, Status> {
        if endpoints.is_empty() {
            return Err(Status::invalid_argument("no kvstore endpoints"));
        }
        let channels = endpoints.iter().map(|_| None).collect();
        Ok(Self { endpoints, current: 0, channels, deadline: DEFAULT_DEADLINE, updates: None })
    }

    /// A client for the nodes `endpoints` lists now, which takes up each new list before its next attempt.
    pub fn following(mut endpoints: Endpoints) -> Result<Self, Status> {
        let mut client = Self::new(endpoints.latest())?;
        client.updates = Some(endpoints);
        Ok(client)
    }

    /// Switches to a new node list, keeping the connection to the node believed to lead when it is still listed.
    fn take_update(&mut self) {
        let Some(list) = self.updates.as_mut().and_then(Endpoints::changed) else { return };
        if list.is_empty() || list == self.endpoints {
            return;
        }
        let leader = self.endpoints.get(self.current).cloned();
        let mut old: Vec<(String, Option<KvStoreClient<Channel>>)> =
            self.endpoints.drain(..).zip(self.channels.drain(..)).collect();
        for addr in list {
            let channel = old.iter_mut().find(|(a, _)| *a == addr).and_then(|(_, c)| c.take());
            self.endpoints.push(addr);
            self.channels.push(channel);
        }
        self.current = leader.and_then(|l| self.endpoints.iter().position(|e| *e == l)).unwrap_or(0);
    }

    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// The address of the node the next call goes to first.
    pub fn current(&self) -> &str {
        &self.endpoints[self.current]
    }

    fn client(&mut self, i: usize) -> Result<KvStoreClient<Channel>, Status> {
        if self.channels[i].is_none() {
            self.channels[i] = Some(channel(&self.endpoints[i])?);
        }
        self.channels[i].clone().ok_or_else(|| Status::internal("no channel"))
    }

    /// Runs `call` against the leader, following redirects and retrying retryable failures until the deadline.
    pub async fn call<T, F, Fut>(&mut self, mut call: F) -> Result<T, Status>
    where
        F: FnMut(KvStoreClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let start = Instant::now();
        loop {
            self.take_update();
            let client = self.client(self.current)?;
            let err = match call(client).await {
                Ok(r) => return Ok(r.into_inner()),
                Err(e) => e,
            };
            let retryable =
                matches!(err.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled);
            if !retryable || start.elapsed() > self.deadline {
                return Err(err);
            }
            let redirect = err.metadata().get(LEADER_ADDR).and_then(|v| v.to_str().ok()).map(str::to_string);
            match redirect {
                Some(addr) => {
                    let i = match self.endpoints.iter().position(|e| *e == addr) {
                        Some(i) => i,
                        None => {
                            self.endpoints.push(addr);
                            self.channels.push(None);
                            self.endpoints.len() - 1
                        }
                    };
                    self.current = i;
                }
                None => {
                    // The node is down or knows no leader yet: try the next one after a pause.
                    self.current = (self.current + 1) % self.endpoints.len();
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }

    pub async fn register(&mut self, worker: &str, address: &str, epoch: u64) -> Result<pb::RegisterResponse, Status> {
        let req = pb::RegisterRequest { worker: worker.into(), address: address.into(), epoch };
        self.call(|mut c| {
            let req = req.clone();
            async move { c.register(req).await }
        })
        .await
    }

    pub async fn publish(&mut self, req: pb::PublishRequest) -> Result<pb::PublishResponse, Status> {
        self.call(|mut c| {
            let req = req.clone();
            async move { c.publish(req).await }
        })
        .await
    }

    pub async fn publish_snapshot(
        &mut self,
        req: pb::WorkerSnapshotRequest,
    ) -> Result<pb::WorkerSnapshotResponse, Status> {
        self.call(|mut c| {
            let req = req.clone();
            async move { c.publish_snapshot(req).await }
        })
        .await
    }

    pub async fn remove_worker(&mut self, worker: &str) -> Result<pb::RemoveWorkerResponse, Status> {
        let req = pb::RemoveWorkerRequest { worker: worker.into() };
        self.call(|mut c| {
            let req = req.clone();
            async move { c.remove_worker(req).await }
        })
        .await
    }

    /// A linearizable read (any node answers it; a node without a leader fails over to the next).
    pub async fn read(&mut self, req: pb::ReadRequest) -> Result<pb::ReadResponse, Status> {
        self.call(|mut c| {
            let req = req.clone();
            async move { c.read(req).await }
        })
        .await
    }

    pub async fn add_node(&mut self, node_id: u64, address: &str) -> Result<pb::MembershipResponse, Status> {
        let req = pb::AddNodeRequest { node_id, address: address.into() };
        self.call(|mut c| {
            let req = req.clone();
            async move { c.add_node(req).await }
        })
        .await
    }

    pub async fn remove_node(&mut self, node_id: u64) -> Result<pb::MembershipResponse, Status> {
        self.call(|mut c| async move { c.remove_node(pb::RemoveNodeRequest { node_id }).await }).await
    }

    /// The status of one node (no redirect).
    pub async fn status_of(addr: &str) -> Result<pb::StatusResponse, Status> {
        let mut c = channel(addr)?;
        Ok(c.status(pb::StatusRequest {}).await?.into_inner())
    }

    /// A watch stream from one node.
    pub async fn watch(addr: &str, from_index: u64) -> Result<tonic::Streaming<pb::WatchEvent>, Status> {
        let mut c = channel(addr)?;
        Ok(c.watch(pb::WatchRequest { from_index }).await?.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_following_client_takes_up_a_new_node_list_and_keeps_its_leader() {
        let (source, endpoints) = Endpoints::updating(vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()]);
        let mut c = Client::following(endpoints).unwrap();
        c.current = 1;
        c.client(1).unwrap();
        source.publish(vec!["127.0.0.1:3".into(), "127.0.0.1:2".into()]);
        c.take_update();
        assert_eq!(c.endpoints, ["127.0.0.1:2", "127.0.0.1:3"]);
        assert_eq!(c.current(), "127.0.0.1:2", "the believed leader is kept");
        assert!(c.channels[0].is_some(), "its connection is kept");
        assert!(c.channels[1].is_none());
        // The leader left the list: start over at the first node.
        source.publish(vec!["127.0.0.1:4".into()]);
        c.take_update();
        assert_eq!(c.current(), "127.0.0.1:4");
        assert_eq!(c.channels.len(), 1);
    }
}
