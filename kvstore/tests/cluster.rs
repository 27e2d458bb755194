//! An in-process kvstore cluster on loopback (real tonic transport, real redb files): leader election, replicated
//! Publish, linearizable reads on followers, Watch, losing the leader, restarting a node from its data dir,
//! membership change, gaps and bad input, misaddressed raft traffic, a snapshot lost on its way to a new node, watches
//! from past the log, departed and too many watchers, reads while the leader goes away, and damaged stores.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pagoda_kvstore::proto as pb;
use pagoda_kvstore::server::start_on;
use pagoda_kvstore::{Client, NodeConfig, RunningNode};
use prost::Message as _;
use tokio::net::TcpListener;
use tonic::{Code, Status};

fn stored(hash: u64) -> pb::BlockEvent {
    pb::BlockEvent {
        kind: Some(pb::block_event::Kind::Stored(pb::Stored {
            hash,
            tier: pb::Tier::Device as i32,
            codec: "f16".into(),
            bytes: 4096,
        })),
    }
}

fn config(id: u64, addr: SocketAddr, peers: &BTreeMap<u64, String>, dir: &std::path::Path) -> NodeConfig {
    let mut cfg = NodeConfig::new(id, addr, dir.join(format!("node{id}")));
    cfg.peers = peers.clone();
    cfg.tick = Duration::from_millis(20);
    // Small, so that compaction and snapshot installs happen within the test.
    cfg.snapshot_every = 40;
    cfg
}

async fn start_node(cfg: NodeConfig) -> RunningNode {
    let listener = TcpListener::bind(cfg.listen).await.unwrap();
    start_on(cfg, listener).await.unwrap()
}

/// Waits until every listed node agrees on one leader among them; returns its id.
async fn wait_leader(addrs: &[String]) -> u64 {
    let t0 = Instant::now();
    loop {
        let mut leaders = BTreeSet::new();
        let mut ok = true;
        for a in addrs {
            match Client::status_of(a).await {
                // A leader outside the set is a stopped one the others have not given up on yet.
                Ok(s) if s.leader_id != 0 && addrs.contains(&s.leader_address) => {
                    leaders.insert(s.leader_id);
                }
                _ => ok = false,
            }
        }
        if ok && leaders.len() == 1 {
            return *leaders.iter().next().unwrap();
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no agreed leader among {addrs:?}: {leaders:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reads the residency of `hashes` and the worker table from one node only (linearizable through ReadIndex).
async fn read_at(addr: &str, hashes: &[u64]) -> pb::ReadResponse {
    let mut c = Client::new(vec![addr.to_string()]).unwrap().with_deadline(Duration::from_secs(15));
    c.read(pb::ReadRequest { hashes: hashes.to_vec(), prefix_chain: vec![], workers: true }).await.unwrap()
}

async fn wait_applied(addr: &str, index: u64) {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = Client::status_of(addr).await
            && s.applied_index >= index
        {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{addr} did not apply {index}: {:?}",
            Client::status_of(addr).await
        );
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
}

struct Publisher {
    client: Client,
    seq: u64,
    next_hash: u64,
    acked: Vec<u64>,
}

impl Publisher {
    /// Publishes `n` batches of `per` new blocks; every acknowledged block is remembered.
    async fn publish(&mut self, n: usize, per: u64) -> u64 {
        let mut last_index = 0;
        for _ in 0..n {
            let hashes: Vec<u64> = (self.next_hash..self.next_hash + per).collect();
            let req = pb::PublishRequest {
                worker: "w1".into(),
                epoch: 1,
                first_seq: self.seq,
                events: hashes.iter().map(|h| stored(*h)).collect(),
                load: None,
            };
            let r = self.client.publish(req).await.unwrap();
            assert!(!r.snapshot_required, "{r:?}");
            // A retry after a lost answer may find its events already applied: applied + skipped covers the batch.
            assert_eq!(r.applied + r.skipped, per, "{r:?}");
            self.seq += per;
            self.next_hash += per;
            self.acked.extend(hashes);
            last_index = r.index;
        }
        last_index
    }
}

fn held(resp: &pb::ReadResponse) -> Vec<u64> {
    resp.blocks.iter().filter(|b| !b.copies.is_empty()).map(|b| b.hash).collect()
}

/// A 3-node cluster on loopback ports, its data under `dir`: what most tests here start from.
struct ThreeNodes {
    addrs: Vec<SocketAddr>,
    peers: BTreeMap<u64, String>,
    endpoints: Vec<String>,
    nodes: BTreeMap<u64, RunningNode>,
}

async fn three_nodes(dir: &std::path::Path) -> ThreeNodes {
    let mut listeners = Vec::new();
    for _ in 0..3 {
        listeners.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let peers: BTreeMap<u64, String> = (1..=3).map(|i| (i, addrs[i as usize - 1].to_string())).collect();
    let endpoints: Vec<String> = peers.values().cloned().collect();
    let mut nodes: BTreeMap<u64, RunningNode> = BTreeMap::new();
    for (i, l) in listeners.into_iter().enumerate() {
        let id = i as u64 + 1;
        nodes.insert(id, start_on(config(id, addrs[i], &peers, dir), l).await.unwrap());
    }
    ThreeNodes { addrs, peers, endpoints, nodes }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_replicate_fail_over_restart_and_change_membership() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let tmp = tempfile::tempdir().unwrap();
    let ThreeNodes { addrs, peers, endpoints, mut nodes } = three_nodes(tmp.path()).await;
    let leader = wait_leader(&endpoints).await;

    // A write sent to a follower is redirected to the leader.
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let mut raw = pb::kv_store_client::KvStoreClient::connect(format!("http://{}", peers[&follower])).await.unwrap();
    let err = raw
        .register(pb::RegisterRequest { worker: "w1".into(), address: "10.0.0.1:7000".into(), epoch: 1 })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(err.metadata().get("pagoda-leader-addr").unwrap().to_str().unwrap(), peers[&leader]);
    assert_eq!(err.metadata().get("pagoda-leader-id").unwrap().to_str().unwrap(), leader.to_string());

    // The client follows the redirect (it starts at a follower on purpose).
    let mut client = Client::new(vec![peers[&follower].clone()]).unwrap();
    client.register("w1", "10.0.0.1:7000", 1).await.unwrap();

    // A watcher on a follower from the start: snapshot, then every command.
    let mut watch = Client::watch(&peers[&follower], 0).await.unwrap();

    let mut p = Publisher { client, seq: 1, next_hash: 1000, acked: Vec::new() };
    let index = p.publish(60, 10).await;

    // Linearizable read on a follower sees every acknowledged event.
    let r = read_at(&peers[&follower], &p.acked).await;
    assert!(r.index >= index);
    assert_eq!(held(&r), p.acked);
    assert_eq!(r.workers[0].applied_seq, 600);

    // The watcher replays the same commands into its own directory and converges.
    let mut mirror = pagoda_kvstore::BlockDirectory::new();
    let t0 = Instant::now();
    while mirror.block_count() < p.acked.len() {
        assert!(t0.elapsed() < Duration::from_secs(10), "watcher stuck at {} blocks", mirror.block_count());
        let ev = tokio::time::timeout(Duration::from_secs(5), watch.message()).await.unwrap().unwrap().unwrap();
        match ev.body.unwrap() {
            pb::watch_event::Body::Snapshot(s) => mirror = pagoda_kvstore::machine::directory_from_proto(&s).unwrap(),
            pb::watch_event::Body::Command(c) => {
                pagoda_kvstore::machine::apply_command(&mut mirror, &c);
            }
        }
    }
    assert_eq!(mirror.worker("w1").unwrap().applied_seq, 600);

    // Replays are idempotent; a gap asks for a snapshot, which heals it.
    let replay = pb::PublishRequest {
        worker: "w1".into(),
        epoch: 1,
        first_seq: 1,
        events: vec![stored(1000), stored(1001)],
        load: None,
    };
    let r = p.client.publish(replay).await.unwrap();
    assert_eq!((r.applied, r.skipped), (0, 2));
    let gap = pb::PublishRequest { worker: "w1".into(), epoch: 1, first_seq: 700, events: vec![stored(1)], load: None };
    let r = p.client.publish(gap).await.unwrap();
    assert!(r.snapshot_required);
    assert_eq!(r.expected_seq, 601);
    // Bad input gets a status, not a panic.
    let bad = pb::PublishRequest {
        worker: "w1".into(),
        epoch: 1,
        first_seq: 601,
        events: vec![pb::BlockEvent {
            kind: Some(pb::block_event::Kind::Stored(pb::Stored { hash: 1, tier: 9, codec: "f16".into(), bytes: 1 })),
        }],
        load: None,
    };
    assert_eq!(p.client.publish(bad).await.unwrap_err().code(), Code::InvalidArgument);
    let unknown =
        pb::PublishRequest { worker: "nobody".into(), epoch: 1, first_seq: 1, events: vec![stored(1)], load: None };
    assert_eq!(p.client.publish(unknown).await.unwrap_err().code(), Code::FailedPrecondition);

    // Stop the leader: the others elect a new one, and publishing goes on through the same client.
    let old_leader = leader;
    nodes.remove(&old_leader).unwrap().stop().await.unwrap();
    let rest: Vec<String> = (1..=3).filter(|i| *i != old_leader).map(|i| peers[&i].clone()).collect();
    p.client = Client::new(endpoints.clone()).unwrap();
    let leader = wait_leader(&rest).await;
    assert_ne!(leader, old_leader);
    let index = p.publish(60, 10).await;
    for a in &rest {
        assert_eq!(held(&read_at(a, &p.acked).await), p.acked, "node at {a} lost acknowledged events");
    }

    // Restart the old leader from its data dir: it catches up (by snapshot: the log was compacted meanwhile).
    let restarted = start_node(config(old_leader, addrs[old_leader as usize - 1], &peers, tmp.path())).await;
    nodes.insert(old_leader, restarted);
    wait_applied(&peers[&old_leader], index).await;
    let reference = read_at(&peers[&leader], &p.acked).await;
    for a in &endpoints {
        let r = read_at(a, &p.acked).await;
        assert_eq!(r.blocks, reference.blocks, "directory differs on {a}");
        assert_eq!(r.workers, reference.workers, "worker table differs on {a}");
    }
    let status = Client::status_of(&peers[&leader]).await.unwrap();
    assert!(status.first_index > 2, "the log was never compacted: {status:?}");

    // Membership: node 4 joins empty, gets the state by snapshot, then leaves.
    let l4 = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a4 = l4.local_addr().unwrap();
    let mut cfg4 = config(4, a4, &peers, tmp.path());
    cfg4.join = true;
    cfg4.advertise = a4.to_string();
    let n4 = start_on(cfg4, l4).await.unwrap();
    let m = p.client.add_node(4, &a4.to_string()).await.unwrap();
    assert_eq!(m.members.iter().map(|m| m.node_id).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    let index = p.publish(5, 10).await;
    wait_applied(&a4.to_string(), index).await;
    assert_eq!(held(&read_at(&a4.to_string(), &p.acked).await), p.acked);
    let m = p.client.remove_node(4).await.unwrap();
    assert_eq!(m.members.iter().map(|m| m.node_id).collect::<Vec<_>>(), vec![1, 2, 3]);
    n4.stop().await.unwrap();
    // The three remaining voters still commit.
    p.publish(5, 10).await;
    assert_eq!(held(&read_at(&peers[&leader], &p.acked).await), p.acked);

    for (_, n) in nodes {
        n.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_single_voter_commits_alone_and_restarts_from_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let node = pagoda_kvstore::start_embedded(tmp.path().to_path_buf(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = node.addr.to_string();
    let mut c = Client::new(vec![addr.clone()]).unwrap();
    c.register("w", "x:1", 3).await.unwrap();
    let r = c
        .publish(pb::PublishRequest {
            worker: "w".into(),
            epoch: 3,
            first_seq: 1,
            events: (0..100).map(stored).collect(),
            load: None,
        })
        .await
        .unwrap();
    assert_eq!(r.applied, 100);
    node.stop().await.unwrap();

    let node = pagoda_kvstore::start_embedded(tmp.path().to_path_buf(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let r = read_at(&node.addr.to_string(), &(0..100).collect::<Vec<_>>()).await;
    assert_eq!(held(&r), (0..100).collect::<Vec<_>>());
    assert_eq!(r.workers[0].applied_seq, 100);
    node.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misaddressed_raft_message_is_refused_and_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let node = pagoda_kvstore::start_embedded(tmp.path().to_path_buf(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = node.addr.to_string();
    wait_leader(std::slice::from_ref(&addr)).await;
    let mut c = Client::new(vec![addr.clone()]).unwrap();
    c.register("w", "x:1", 1).await.unwrap();
    let before = Client::status_of(&addr).await.unwrap();

    // What node 1's address would get from a leader that still believes node 7 lives there: a newer term and a
    // commit index far beyond node 1's log, which raft would take as corruption and panic on.
    let heartbeat = |to: u64, from: u64| {
        let mut m = raft::eraftpb::Message::default();
        m.set_msg_type(raft::eraftpb::MessageType::MsgHeartbeat);
        m.to = to;
        m.from = from;
        m.term = before.term + 5;
        m.commit = 1_000_000;
        protobuf::Message::write_to_bytes(&m).unwrap()
    };
    let mut raft = pb::raft_client::RaftClient::connect(format!("http://{addr}")).await.unwrap();
    let err = raft.send(pb::RaftBatch { from: 2, messages: vec![heartbeat(7, 2)] }).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("for node 7"), "{err:?}");
    // A message whose sender is not the batch's is refused the same way.
    let err = raft.send(pb::RaftBatch { from: 3, messages: vec![heartbeat(1, 2)] }).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    let after = Client::status_of(&addr).await.unwrap();
    assert_eq!((after.term, after.leader_id, after.commit_index), (before.term, 1, before.commit_index), "{after:?}");
    let r = c
        .publish(pb::PublishRequest { worker: "w".into(), epoch: 1, first_seq: 1, events: vec![stored(1)], load: None })
        .await
        .unwrap();
    assert_eq!(r.applied, 1);
    node.stop().await.unwrap();
}

/// A raft hop in front of a node that loses the first batch carrying a snapshot, as a network would.
struct SnapshotLosingHop {
    target: pb::raft_client::RaftClient<tonic::transport::Channel>,
    snapshots: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl pb::raft_server::Raft for SnapshotLosingHop {
    async fn send(&self, request: tonic::Request<pb::RaftBatch>) -> Result<tonic::Response<pb::RaftAck>, Status> {
        let batch = request.into_inner();
        let carries_snapshot = batch.messages.iter().any(|b| {
            let mut m = raft::eraftpb::Message::default();
            protobuf::Message::merge_from_bytes(&mut m, b).is_ok()
                && m.get_msg_type() == raft::eraftpb::MessageType::MsgSnapshot
        });
        if carries_snapshot && self.snapshots.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(Status::unavailable("snapshot lost on the way"));
        }
        self.target.clone().send(batch).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_joining_node_catches_up_after_its_first_snapshot_is_lost() {
    let tmp = tempfile::tempdir().unwrap();
    let mut listeners = Vec::new();
    for _ in 0..3 {
        listeners.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let peers: BTreeMap<u64, String> = (1..=3).map(|i| (i, addrs[i as usize - 1].to_string())).collect();
    let endpoints: Vec<String> = peers.values().cloned().collect();
    let mut nodes = Vec::new();
    for (i, l) in listeners.into_iter().enumerate() {
        let id = i as u64 + 1;
        nodes.push(start_on(config(id, addrs[i], &peers, tmp.path()), l).await.unwrap());
    }
    wait_leader(&endpoints).await;
    let mut client = Client::new(endpoints.clone()).unwrap();
    client.register("w1", "10.0.0.1:7000", 1).await.unwrap();
    let mut p = Publisher { client, seq: 1, next_hash: 1, acked: Vec::new() };
    p.publish(10, 10).await;

    // Node 4 listens on its own port; the cluster reaches it only through the hop, which loses the first snapshot.
    let l4 = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a4 = l4.local_addr().unwrap().to_string();
    let hop_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hop_addr = hop_listener.local_addr().unwrap();
    let snapshots = Arc::new(AtomicUsize::new(0));
    let hop = SnapshotLosingHop {
        target: pb::raft_client::RaftClient::new(
            tonic::transport::Endpoint::from_shared(format!("http://{a4}")).unwrap().connect_lazy(),
        ),
        snapshots: snapshots.clone(),
    };
    let hop_server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::raft_server::RaftServer::new(hop))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(hop_listener)),
    );
    let mut cfg4 = config(4, l4.local_addr().unwrap(), &peers, tmp.path());
    cfg4.join = true;
    cfg4.advertise = hop_addr.to_string();
    let n4 = start_on(cfg4, l4).await.unwrap();
    p.client.add_node(4, &hop_addr.to_string()).await.unwrap();
    let index = p.publish(2, 10).await;

    // Without the lost snapshot reported to raft, the leader would wait for it forever and node 4 would stay empty.
    wait_applied(&a4, index).await;
    assert_eq!(held(&read_at(&a4, &p.acked).await), p.acked);
    assert!(snapshots.load(Ordering::SeqCst) >= 2, "the first snapshot was lost, a later one went through");

    n4.stop().await.unwrap();
    hop_server.abort();
    for n in nodes {
        n.stop().await.unwrap();
    }
}

/// The first event of a Watch from `from_index`.
async fn first_watch_event(addr: &str, from_index: u64) -> pb::WatchEvent {
    let mut watch = Client::watch(addr, from_index).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), watch.message()).await.unwrap().unwrap().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_behind_by_more_log_bytes_than_the_bound_starts_from_a_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    let node = pagoda_kvstore::start_embedded(tmp.path().to_path_buf(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = node.addr.to_string();
    let mut c = Client::new(vec![addr.clone()]).unwrap().with_deadline(Duration::from_secs(30));
    c.register("w", "x:1", 1).await.unwrap();
    let mut seq = 1;
    let mut publish = async |c: &mut Client, events: Vec<pb::BlockEvent>| {
        let n = events.len() as u64;
        let r = c
            .publish(pb::PublishRequest { worker: "w".into(), epoch: 1, first_seq: seq, events, load: None })
            .await
            .unwrap();
        seq += n;
        r.index
    };
    // Few entries, many bytes: removals of blocks never stored, under the longest codec name, change nothing in the
    // directory but fill the log.
    let removal = pb::BlockEvent {
        kind: Some(pb::block_event::Kind::Removed(pb::Removed {
            hash: u64::MAX,
            tier: pb::Tier::Disk as i32,
            codec: "k".repeat(pagoda_kvstore::machine::MAX_CODEC_LEN),
        })),
    };
    let per_batch = pagoda_kvstore::machine::MAX_EVENTS_PER_BATCH;
    let batch_bytes = (removal.encoded_len() + 3) * per_batch;
    let batches = pagoda_kvstore::node::MAX_CATCHUP_BYTES as usize / batch_bytes + 2;
    let first_big = publish(&mut c, vec![removal.clone(); per_batch]).await;
    for _ in 1..batches {
        publish(&mut c, vec![removal.clone(); per_batch]).await;
    }
    let after_big = publish(&mut c, vec![stored(5)]).await;
    assert!(after_big - first_big < 4096, "few entries: {first_big}..{after_big}");

    // Behind by a few small entries: replayed.
    let ev = first_watch_event(&addr, after_big).await;
    assert_eq!(ev.index, after_big);
    assert!(matches!(ev.body, Some(pb::watch_event::Body::Command(_))), "{ev:?}");
    // Behind by more bytes than the bound, in few entries: a snapshot of the directory now.
    let ev = first_watch_event(&addr, first_big).await;
    assert_eq!(ev.index, after_big);
    let Some(pb::watch_event::Body::Snapshot(snap)) = ev.body else { panic!("expected a snapshot: {ev:?}") };
    let dir = pagoda_kvstore::machine::directory_from_proto(&snap).unwrap();
    assert_eq!(dir.residency(5).len(), 1);
    assert_eq!(dir.worker("w").unwrap().applied_seq, seq - 1);

    // Watchers that start from a snapshot at one index share one build of it.
    let a = node.handle.watch(0).await.unwrap();
    let b = node.handle.watch(0).await.unwrap();
    assert!(Arc::ptr_eq(&a.catch_up[0], &b.catch_up[0]));
    drop((a, b));
    node.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn watches_from_the_future_resync_departed_watchers_are_released_and_watchers_are_capped() {
    let tmp = tempfile::tempdir().unwrap();
    let node = pagoda_kvstore::start_embedded(tmp.path().to_path_buf(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = node.addr.to_string();
    wait_leader(std::slice::from_ref(&addr)).await;
    let mut c = Client::new(vec![addr.clone()]).unwrap();
    let index = c.register("w", "x:1", 1).await.unwrap().index;

    // A from_index this node has not reached (a cluster rebuilt since the client last watched) starts from a
    // snapshot at once instead of waiting silently for an index that may never come.
    let mut streams = Vec::new();
    for _ in 0..40 {
        let mut watch = Client::watch(&addr, index + 1_000_000).await.unwrap();
        let ev = tokio::time::timeout(Duration::from_secs(5), watch.message())
            .await
            .expect("a far-future watch got nothing")
            .unwrap()
            .unwrap();
        assert_eq!(ev.index, index, "{ev:?}");
        assert!(matches!(ev.body, Some(pb::watch_event::Body::Snapshot(_))), "{ev:?}");
        streams.push(watch);
    }
    assert_eq!(node.handle.watchers().await.unwrap(), 40);

    // Clients that go away on an idle cluster release their watchers (and stream tasks) without waiting for an event.
    drop(streams);
    let t0 = Instant::now();
    loop {
        let n = node.handle.watchers().await.unwrap();
        if n == 0 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "{n} watchers of departed clients are still held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Past the cap a watch is refused with RESOURCE_EXHAUSTED; a freed slot is usable again.
    let mut held = Vec::new();
    for _ in 0..pagoda_kvstore::node::MAX_WATCHERS {
        held.push(node.handle.watch(index + 1).await.unwrap());
    }
    let err = Client::watch(&addr, 0).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    held.pop();
    first_watch_event(&addr, 0).await;
    drop(held);
    node.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_on_followers_fail_fast_when_the_leader_goes_away() {
    let tmp = tempfile::tempdir().unwrap();
    let ThreeNodes { peers, endpoints, mut nodes, .. } = three_nodes(tmp.path()).await;
    let leader = wait_leader(&endpoints).await;
    let mut client = Client::new(endpoints.clone()).unwrap();
    client.register("w1", "10.0.0.1:7000", 1).await.unwrap();

    // Kill the leader, then read on both followers at once and over the next moments: some reads go out while the
    // followers still believe in the old leader (their ReadIndex is lost with it), later ones while no leader is
    // known. Each must answer (an error, or a result once a new leader is elected) long before REQUEST_TIMEOUT.
    let stopping = tokio::spawn(nodes.remove(&leader).unwrap().stop());
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut reads = Vec::new();
    for delay_ms in [0u64, 100, 200, 300, 400, 600] {
        for f in (1..=3).filter(|i| *i != leader) {
            let addr = peers[&f].clone();
            reads.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                let mut raw = pb::kv_store_client::KvStoreClient::connect(format!("http://{addr}")).await.unwrap();
                let t0 = Instant::now();
                let r = raw.read(pb::ReadRequest { hashes: vec![], prefix_chain: vec![], workers: true }).await;
                (addr, delay_ms, t0.elapsed(), r.map(|r| r.into_inner()))
            }));
        }
    }
    for r in reads {
        let (addr, delay_ms, took, r) = r.await.unwrap();
        assert!(took < Duration::from_secs(3), "a read at {addr} (+{delay_ms} ms) took {took:?}: {r:?}");
        if let Err(e) = &r {
            assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        }
    }
    stopping.await.unwrap().unwrap();
    for (_, n) in nodes {
        n.stop().await.unwrap();
    }
}

/// Runs `damage` on a stopped embedded node's store, then starts the node again: it must refuse to start.
async fn start_refuses_a_damaged_store(damage: impl FnOnce(&redb::Database)) -> pagoda_kvstore::ServerError {
    let tmp = tempfile::tempdir().unwrap();
    let node = pagoda_kvstore::start_embedded(tmp.path().to_path_buf(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let mut c = Client::new(vec![node.addr.to_string()]).unwrap();
    c.register("w", "x:1", 1).await.unwrap();
    c.publish(pb::PublishRequest { worker: "w".into(), epoch: 1, first_seq: 1, events: vec![stored(1)], load: None })
        .await
        .unwrap();
    node.stop().await.unwrap();
    {
        let db = redb::Database::open(tmp.path().join("raft.redb")).unwrap();
        damage(&db);
    }
    match pagoda_kvstore::start_embedded(tmp.path().to_path_buf(), "127.0.0.1:0".parse().unwrap()).await {
        Ok(node) => {
            node.stop().await.ok();
            panic!("a damaged store started");
        }
        Err(e) => e,
    }
}

const ENTRIES: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("raft_entries");
const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("raft_meta");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_with_a_commit_index_past_its_log_refuses_to_start() {
    let err = start_refuses_a_damaged_store(|db| {
        let txn = db.begin_write().unwrap();
        {
            let mut meta = txn.open_table(META).unwrap();
            let mut hs = raft::eraftpb::HardState::default();
            let stored = redb::ReadableTable::get(&meta, "hard_state").unwrap().unwrap().value().to_vec();
            protobuf::Message::merge_from_bytes(&mut hs, &stored).unwrap();
            hs.commit += 1000;
            meta.insert("hard_state", protobuf::Message::write_to_bytes(&hs).unwrap().as_slice()).unwrap();
        }
        txn.commit().unwrap();
    })
    .await;
    assert!(err.to_string().contains("commit index"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_with_an_undecodable_log_entry_refuses_to_start() {
    let err = start_refuses_a_damaged_store(|db| {
        let txn = db.begin_write().unwrap();
        {
            let mut entries = txn.open_table(ENTRIES).unwrap();
            let last = redb::ReadableTable::last(&entries).unwrap().unwrap().0.value();
            entries.insert(last, &[0xff, 0xff, 0xff][..]).unwrap();
        }
        txn.commit().unwrap();
    })
    .await;
    assert!(err.to_string().contains("corrupt entry"), "{err}");
}
