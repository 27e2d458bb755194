//! The dashboard's view of the kvstore cluster (`pagoda router --kvstore ADDR`, repeatable). It owns one lazily
//! connected gRPC channel per configured node and, when the dashboard refreshes, asks every node for its raft
//! `Status` with a short timeout, then summarises who leads, in which term, and how far each node's applied index
//! trails the commit index.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use pagoda_kvstore::Endpoints;

use pagoda_proto::kvstore::kv_store_client::KvStoreClient;
use pagoda_proto::kvstore::{StatusRequest, StatusResponse};
use serde::Serialize;
use tonic::transport::Channel;

/// Most kvstore nodes the dashboard polls: as many as a node list holds.
pub const MAX_NODES: usize = pagoda_kvstore::endpoints::MAX_ENDPOINTS;
const STATUS_TIMEOUT: Duration = Duration::from_secs(1);

/// The kvstore nodes and their channels.
pub struct KvstoreNodes {
    // std Mutex: held only to take up a new list and clone the channels, never across an await.
    polled: Mutex<Polled>,
}

/// The node list (fixed, or followed through the etcd registry) and a channel per node on it.
struct Polled {
    endpoints: Endpoints,
    nodes: Vec<(String, KvStoreClient<Channel>)>,
}

impl Default for KvstoreNodes {
    /// No kvstore: the dashboard says "not configured".
    fn default() -> KvstoreNodes {
        let endpoints = Endpoints::fixed(Vec::new());
        KvstoreNodes { polled: Mutex::new(Polled { endpoints, nodes: Vec::new() }) }
    }
}

fn channels(addrs: &[String]) -> Result<Vec<(String, KvStoreClient<Channel>)>, String> {
    if addrs.len() > MAX_NODES {
        return Err(format!("at most {MAX_NODES} kvstore addresses, got {}", addrs.len()));
    }
    let mut nodes = Vec::with_capacity(addrs.len());
    for a in addrs {
        let endpoint = pagoda_proto::tls::endpoint(a)
            .map_err(|e| format!("invalid kvstore address `{a}`: {e}"))?
            .connect_timeout(STATUS_TIMEOUT)
            .tcp_nodelay(true);
        nodes.push((a.clone(), KvStoreClient::new(endpoint.connect_lazy())));
    }
    Ok(nodes)
}

/// One node's answer.
#[derive(Debug, Clone, Serialize)]
pub struct NodeView {
    pub address: String,
    pub reachable: bool,
    pub error: Option<String>,
    pub node_id: u64,
    pub role: String,
    pub leader_id: u64,
    pub term: u64,
    pub commit_index: u64,
    pub applied_index: u64,
    /// Entries this node has committed but not applied yet.
    pub apply_lag: u64,
    /// Entries the leader has committed that this node has not applied yet (`None` without a known leader).
    pub behind_leader: Option<u64>,
    pub blocks: u64,
    pub members: usize,
}

/// The cluster as the dashboard shows it.
#[derive(Debug, Clone, Serialize)]
pub struct KvstoreView {
    /// False when the router was started without `--kvstore`.
    pub configured: bool,
    /// The leader as the reachable nodes report it (the highest term's), 0 when none is known.
    pub leader_id: u64,
    pub leader_address: String,
    pub term: u64,
    /// The largest `behind_leader` over the reachable nodes.
    pub max_apply_lag: u64,
    pub nodes: Vec<NodeView>,
}

impl KvstoreNodes {
    /// Channels for `addrs` (`host:port` or `http://host:port`); nothing connects until the first poll.
    pub fn new(addrs: &[String]) -> Result<KvstoreNodes, String> {
        let nodes = channels(addrs)?;
        let endpoints = Endpoints::fixed(addrs.to_vec());
        Ok(KvstoreNodes { polled: Mutex::new(Polled { endpoints, nodes }) })
    }

    /// The nodes `endpoints` lists, following each new list it gets.
    pub fn following(mut endpoints: Endpoints) -> Result<KvstoreNodes, String> {
        let nodes = channels(&endpoints.latest())?;
        Ok(KvstoreNodes { polled: Mutex::new(Polled { endpoints, nodes }) })
    }

    /// The nodes to poll now, after taking up a new list if one came.
    fn current(&self) -> Vec<(String, KvStoreClient<Channel>)> {
        let mut polled = self.polled.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(list) = polled.endpoints.changed() {
            match channels(&list) {
                Ok(c) => polled.nodes = c,
                Err(e) => tracing::warn!(error = %e, "ignoring a kvstore node list the dashboard cannot poll"),
            }
        }
        polled.nodes.clone()
    }

    /// Asks every node for its status, all at once, each bounded by a 1 s timeout.
    pub async fn poll(&self) -> KvstoreView {
        let nodes = self.current();
        let answers = futures::future::join_all(nodes.iter().map(|(_, client)| {
            let mut client = client.clone();
            async move {
                match tokio::time::timeout(STATUS_TIMEOUT, client.status(StatusRequest {})).await {
                    Ok(Ok(r)) => Ok(r.into_inner()),
                    Ok(Err(status)) => Err(status.message().to_string()),
                    Err(_) => Err("no answer within 1 s".to_string()),
                }
            }
        }))
        .await;
        summarise(nodes.iter().map(|(a, _)| a.as_str()).zip(answers))
    }
}

fn summarise<'a>(answers: impl Iterator<Item = (&'a str, Result<StatusResponse, String>)>) -> KvstoreView {
    let answers: Vec<(&str, Result<StatusResponse, String>)> = answers.collect();
    let configured = !answers.is_empty();
    // The freshest view of the leader: the highest term that names one.
    let leader = answers
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .filter(|s| s.leader_id != 0)
        .max_by_key(|s| s.term)
        .map(|s| (s.leader_id, s.leader_address.clone(), s.term));
    let term = answers.iter().filter_map(|(_, r)| r.as_ref().ok()).map(|s| s.term).max().unwrap_or(0);
    let leader_commit = leader.as_ref().and_then(|(id, _, _)| {
        answers.iter().filter_map(|(_, r)| r.as_ref().ok()).find(|s| s.node_id == *id).map(|s| s.commit_index)
    });
    let nodes: Vec<NodeView> = answers
        .into_iter()
        .map(|(address, r)| match r {
            Ok(s) => NodeView {
                address: address.to_string(),
                reachable: true,
                error: None,
                node_id: s.node_id,
                role: s.role.clone(),
                leader_id: s.leader_id,
                term: s.term,
                commit_index: s.commit_index,
                applied_index: s.applied_index,
                apply_lag: s.commit_index.saturating_sub(s.applied_index),
                behind_leader: leader_commit.map(|c| c.saturating_sub(s.applied_index)),
                blocks: s.blocks,
                members: s.members.len(),
            },
            Err(e) => NodeView {
                address: address.to_string(),
                reachable: false,
                error: Some(e),
                node_id: 0,
                role: String::new(),
                leader_id: 0,
                term: 0,
                commit_index: 0,
                applied_index: 0,
                apply_lag: 0,
                behind_leader: None,
                blocks: 0,
                members: 0,
            },
        })
        .collect();
    let max_apply_lag = nodes.iter().filter(|n| n.reachable).map(|n| n.behind_leader.unwrap_or(n.apply_lag)).max();
    let (leader_id, leader_address, _) = leader.unwrap_or_default();
    KvstoreView { configured, leader_id, leader_address, term, max_apply_lag: max_apply_lag.unwrap_or(0), nodes }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(node_id: u64, leader_id: u64, term: u64, commit: u64, applied: u64) -> StatusResponse {
        StatusResponse {
            node_id,
            leader_id,
            leader_address: format!("n{leader_id}"),
            role: if node_id == leader_id { "leader" } else { "follower" }.into(),
            term,
            commit_index: commit,
            applied_index: applied,
            ..Default::default()
        }
    }

    #[test]
    fn leader_term_and_lag_from_the_answers() {
        let view = summarise(
            [
                ("a", Ok(status(1, 2, 3, 100, 99))),
                ("b", Ok(status(2, 2, 3, 120, 118))),
                ("c", Err("connection refused".to_string())),
                // A stale node still believes in an older leader.
                ("d", Ok(status(4, 1, 2, 80, 80))),
            ]
            .into_iter(),
        );
        assert!(view.configured);
        assert_eq!((view.leader_id, view.leader_address.as_str(), view.term), (2, "n2", 3));
        assert_eq!(view.nodes[0].apply_lag, 1);
        assert_eq!(view.nodes[0].behind_leader, Some(21));
        assert_eq!(view.nodes[1].behind_leader, Some(2));
        assert!(!view.nodes[2].reachable);
        assert_eq!(view.max_apply_lag, 40);

        let none = summarise(std::iter::empty());
        assert!(!none.configured);
        assert_eq!(none.leader_id, 0);
    }

    #[tokio::test]
    async fn unreachable_and_invalid_nodes() {
        assert!(KvstoreNodes::new(&["http://exa mple:1".into()]).is_err());
        assert!(KvstoreNodes::new(&vec!["127.0.0.1:1".to_string(); MAX_NODES + 1]).is_err());
        // Port 9 on loopback: nothing listens there.
        let nodes = KvstoreNodes::new(&["127.0.0.1:9".into()]).unwrap();
        let view = nodes.poll().await;
        assert!(view.configured);
        assert!(!view.nodes[0].reachable);
        assert!(view.nodes[0].error.is_some());
        assert_eq!(view.leader_id, 0);
    }

    #[tokio::test]
    async fn a_following_dashboard_polls_the_new_node_list() {
        let (source, endpoints) = Endpoints::updating(vec!["127.0.0.1:9".into()]);
        let nodes = KvstoreNodes::following(endpoints).unwrap();
        assert_eq!(nodes.poll().await.nodes.len(), 1);
        source.publish(vec!["127.0.0.1:7".into(), "127.0.0.1:13".into()]);
        let view = nodes.poll().await;
        let addrs: Vec<&str> = view.nodes.iter().map(|n| n.address.as_str()).collect();
        assert_eq!(addrs, ["127.0.0.1:13", "127.0.0.1:7"]);
    }
}
