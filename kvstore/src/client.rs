//! A kvstore client for a cluster: it sends writes to the leader, following the redirect a follower answers with
//! (UNAVAILABLE + [`crate::service::LEADER_ADDR`]), tries the next node when one is down, and retries while the
//! cluster elects a leader, up to a deadline that bounds every attempt too, pausing with a capped, jittered exponential
//! backoff between nodes that do not answer. Every write is idempotent, so a retry after a lost answer is safe.
//! A client made with [`Client::following`] takes up a new node list (from the etcd registry) between attempts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pagoda_proto::kvstore as pb;
use pb::kv_store_client::KvStoreClient;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::endpoints::Endpoints;
use crate::server::MAX_CLIENT_MESSAGE_BYTES;
use crate::service::LEADER_ADDR;

/// How long one call keeps retrying before giving up.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(20);
/// The first pause before trying the next node; it doubles with every failure up to [`MAX_RETRY_PAUSE`].
const RETRY_PAUSE: Duration = Duration::from_millis(50);
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Capped exponential backoff with jitter: clients that failed together (a leader loss) do not retry in lockstep.
struct Backoff {
    step: Duration,
    rng: u64,
}

impl Backoff {
    fn new() -> Self {
        // Jitter only has to differ between clients, not be unpredictable: the clock and a process-wide counter do.
        static CLIENTS: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let seed = nanos ^ CLIENTS.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        Self { step: RETRY_PAUSE, rng: seed | 1 }
    }

    /// The next pause: between half and all of the current step, which then doubles.
    fn pause(&mut self) -> Duration {
        // xorshift64: enough spread for jitter without a random-number crate.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let half = self.step / 2;
        let spread = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX).saturating_add(1);
        self.step = (self.step * 2).min(MAX_RETRY_PAUSE);
        half + Duration::from_nanos(self.rng % spread)
    }
}

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

    /// Runs `call` against the leader, following redirects and retrying retryable failures until the deadline; no
    /// attempt or pause runs past it.
    pub async fn call<T, F, Fut>(&mut self, mut call: F) -> Result<T, Status>
    where
        F: FnMut(KvStoreClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let start = Instant::now();
        let mut backoff = Backoff::new();
        loop {
            self.take_update();
            let client = self.client(self.current)?;
            let left = self.deadline.saturating_sub(start.elapsed());
            let err = match tokio::time::timeout(left, call(client)).await {
                Ok(Ok(r)) => return Ok(r.into_inner()),
                Ok(Err(e)) => e,
                Err(_) => Status::deadline_exceeded(format!(
                    "no answer from the kvstore at {} within the {:?} deadline",
                    self.endpoints[self.current], self.deadline
                )),
            };
            let retryable =
                matches!(err.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled);
            if !retryable || start.elapsed() >= self.deadline {
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
                    let pause = backoff.pause();
                    if start.elapsed() + pause >= self.deadline {
                        // No attempt would fit after the pause.
                        return Err(err);
                    }
                    tokio::time::sleep(pause).await;
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

    #[test]
    fn backoff_doubles_up_to_its_cap_with_jitter() {
        let mut backoff = Backoff::new();
        let mut step = RETRY_PAUSE;
        for _ in 0..12 {
            let pause = backoff.pause();
            assert!(pause >= step / 2 && pause <= step, "{pause:?} outside [{:?}, {step:?}]", step / 2);
            step = (step * 2).min(MAX_RETRY_PAUSE);
        }
        assert_eq!(backoff.step, MAX_RETRY_PAUSE);
        let pauses: Vec<Duration> = (0..8).map(|_| backoff.pause()).collect();
        assert!(pauses.windows(2).any(|w| w[0] != w[1]), "no jitter: {pauses:?}");
    }

    #[tokio::test]
    async fn a_call_to_a_node_that_never_answers_ends_at_the_deadline() {
        // Connections complete in the kernel's backlog, but nothing ever answers on them.
        let blackhole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = blackhole.local_addr().unwrap().to_string();
        let deadline = Duration::from_millis(800);
        let mut c = Client::new(vec![addr]).unwrap().with_deadline(deadline);
        let t0 = Instant::now();
        let err = c.read(pb::ReadRequest::default()).await.unwrap_err();
        let took = t0.elapsed();
        assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
        assert!(took >= deadline && took < deadline + Duration::from_millis(700), "took {took:?}");
        drop(blackhole);
    }

    #[tokio::test]
    async fn retries_against_refusing_nodes_stop_at_the_deadline() {
        // A port nothing listens on any more: every attempt fails at once, so only the pauses take time.
        let refused = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().to_string();
        let deadline = Duration::from_millis(600);
        let mut c = Client::new(vec![refused]).unwrap().with_deadline(deadline);
        let t0 = Instant::now();
        let err = c.read(pb::ReadRequest::default()).await.unwrap_err();
        let took = t0.elapsed();
        assert_eq!(err.code(), Code::Unavailable, "{err:?}");
        assert!(took < deadline + Duration::from_millis(500), "took {took:?}");
    }

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
