//! `pagoda bench kvstore`: block events/s that a 3-node cluster (in this process, real tonic on loopback, redb on
//! disk) sustains under concurrent publishers, and the event-to-visible latency a watcher on a follower sees.
//!
//! Each publisher is a worker with its own sequence numbers; every Publish carries `batch` Stored events (one raft
//! entry). The watcher measures, per batch, the time from just before Publish was sent to the moment the batch's
//! command arrived on its Watch stream.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pagoda_proto::kvstore as pb;
use tokio::net::TcpListener;

use crate::client::Client;
use crate::server::{NodeConfig, RunningNode, start_on};

pub struct BenchConfig {
    pub seconds: u64,
    pub publishers: usize,
    pub batch: usize,
    /// Node data lives here; `None` = a fresh temp dir removed afterwards.
    pub data_dir: Option<PathBuf>,
}

#[derive(Debug)]
pub struct BenchReport {
    pub seconds: f64,
    pub publishers: usize,
    pub batch: usize,
    pub events: u64,
    pub events_per_s: f64,
    pub publish_p50_ms: f64,
    pub publish_p99_ms: f64,
    pub visible_p50_ms: f64,
    pub visible_p99_ms: f64,
    pub visible_max_ms: f64,
    pub batches_seen_by_watcher: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Server(#[from] crate::server::ServerError),
    #[error("{0}")]
    Rpc(#[from] tonic::Status),
    #[error("{0}")]
    Other(String),
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

impl BenchReport {
    pub fn markdown(&self) -> String {
        format!(
            "| publishers | events/Publish | seconds | events | events/s | Publish p50 ms | Publish p99 ms | visible p50 ms | visible p99 ms | visible max ms |\n\
             |---|---|---|---|---|---|---|---|---|---|\n\
             | {} | {} | {:.1} | {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            self.publishers,
            self.batch,
            self.seconds,
            self.events,
            self.events_per_s,
            self.publish_p50_ms,
            self.publish_p99_ms,
            self.visible_p50_ms,
            self.visible_p99_ms,
            self.visible_max_ms
        )
    }

    /// The report as `(name, value)` pairs for JSON output by the caller.
    pub fn fields(&self) -> BTreeMap<&'static str, f64> {
        BTreeMap::from([
            ("seconds", self.seconds),
            ("publishers", self.publishers as f64),
            ("batch", self.batch as f64),
            ("events", self.events as f64),
            ("events_per_s", self.events_per_s),
            ("publish_p50_ms", self.publish_p50_ms),
            ("publish_p99_ms", self.publish_p99_ms),
            ("visible_p50_ms", self.visible_p50_ms),
            ("visible_p99_ms", self.visible_p99_ms),
            ("visible_max_ms", self.visible_max_ms),
            ("batches_seen_by_watcher", self.batches_seen_by_watcher as f64),
        ])
    }
}

/// Send instants by (worker, first_seq): written by publishers just before sending, read by the watcher. The lock
/// is held for one map operation, never across an await.
type SendTimes = Arc<Mutex<HashMap<(String, u64), Instant>>>;

pub async fn run(cfg: BenchConfig) -> Result<BenchReport, BenchError> {
    if cfg.publishers == 0 || cfg.batch == 0 || cfg.batch > crate::machine::MAX_EVENTS_PER_BATCH {
        return Err(BenchError::Other("publishers and batch must be > 0 (batch <= 65536)".into()));
    }
    let tmp;
    let root = match &cfg.data_dir {
        Some(d) => d.clone(),
        None => {
            tmp = TempDir::new()?;
            tmp.0.clone()
        }
    };
    let mut listeners = Vec::new();
    for _ in 0..3 {
        listeners.push(TcpListener::bind("127.0.0.1:0").await?);
    }
    let mut peers = BTreeMap::new();
    for (i, l) in listeners.iter().enumerate() {
        peers.insert(i as u64 + 1, l.local_addr()?.to_string());
    }
    let mut nodes: Vec<RunningNode> = Vec::new();
    for (i, l) in listeners.into_iter().enumerate() {
        let id = i as u64 + 1;
        let mut nc = NodeConfig::new(id, l.local_addr()?, root.join(format!("node{id}")));
        nc.peers = peers.clone();
        nodes.push(start_on(nc, l).await?);
    }
    let endpoints: Vec<String> = peers.values().cloned().collect();
    let result = drive(&cfg, &endpoints).await;
    for n in nodes {
        n.stop().await?;
    }
    result
}

async fn drive(cfg: &BenchConfig, endpoints: &[String]) -> Result<BenchReport, BenchError> {
    // Register every publisher (this also waits out the first election).
    let mut admin = Client::new(endpoints.to_vec())?;
    for p in 0..cfg.publishers {
        admin.register(&format!("bench-w{p}"), "127.0.0.1:1", 1).await?;
    }
    let leader = Client::status_of(admin.current()).await?.leader_address;
    let follower = endpoints.iter().find(|e| **e != leader).cloned().unwrap_or_else(|| endpoints[0].clone());
    let applied = Client::status_of(&follower).await?.applied_index;
    let mut watch = Client::watch(&follower, applied + 1).await?;

    let times: SendTimes = Arc::new(Mutex::new(HashMap::new()));
    let start = Instant::now();
    let until = start + Duration::from_secs(cfg.seconds);
    let mut tasks = Vec::new();
    for p in 0..cfg.publishers {
        let times = times.clone();
        let endpoints = endpoints.to_vec();
        let batch = cfg.batch;
        tasks.push(tokio::spawn(async move {
            let worker = format!("bench-w{p}");
            let mut client = Client::new(endpoints)?;
            let mut seq = 1u64;
            let mut lat = Vec::new();
            while Instant::now() < until {
                let events = (0..batch as u64)
                    .map(|i| pb::BlockEvent {
                        kind: Some(pb::block_event::Kind::Stored(pb::Stored {
                            hash: ((p as u64) << 40) | (seq + i),
                            tier: pb::Tier::Device as i32,
                            codec: "f16".into(),
                            bytes: 16 * 1024,
                        })),
                    })
                    .collect();
                let req = pb::PublishRequest { worker: worker.clone(), epoch: 1, first_seq: seq, events, load: None };
                let t0 = Instant::now();
                if let Ok(mut m) = times.lock() {
                    m.insert((worker.clone(), seq), t0);
                }
                client.publish(req).await?;
                lat.push(t0.elapsed().as_secs_f64() * 1e3);
                seq += batch as u64;
            }
            Ok::<_, BenchError>((seq - 1, lat))
        }));
    }

    let watcher_times = times.clone();
    let published = Arc::new(AtomicBool::new(false));
    let all_published = published.clone();
    let watcher = tokio::spawn(async move {
        let mut visible = Vec::new();
        let deadline = until + Duration::from_secs(60);
        let drained =
            || all_published.load(Ordering::Acquire) && watcher_times.lock().map(|m| m.is_empty()).unwrap_or(true);
        while Instant::now() < deadline && !drained() {
            let msg = match tokio::time::timeout(Duration::from_millis(500), watch.message()).await {
                Ok(Ok(Some(m))) => m,
                Ok(Ok(None)) | Ok(Err(_)) => break,
                Err(_) => continue,
            };
            if let Some(pb::watch_event::Body::Command(pb::Command { op: Some(pb::command::Op::Publish(p)) })) =
                msg.body
            {
                let sent = watcher_times.lock().ok().and_then(|mut m| m.remove(&(p.worker.clone(), p.first_seq)));
                if let Some(t) = sent {
                    visible.push(t.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
        visible
    });

    let mut events = 0u64;
    let mut publish = Vec::new();
    for t in tasks {
        let (n, lat) = t.await.map_err(|e| BenchError::Other(e.to_string()))??;
        events += n;
        publish.extend(lat);
    }
    let elapsed = start.elapsed().as_secs_f64();
    published.store(true, Ordering::Release);
    let mut visible = watcher.await.map_err(|e| BenchError::Other(e.to_string()))?;
    let lost = times.lock().map(|m| m.len()).unwrap_or(0);
    if lost > 0 {
        return Err(BenchError::Other(format!("{lost} acknowledged batches never reached the watcher")));
    }
    publish.sort_by(f64::total_cmp);
    visible.sort_by(f64::total_cmp);
    Ok(BenchReport {
        seconds: elapsed,
        publishers: cfg.publishers,
        batch: cfg.batch,
        events,
        events_per_s: events as f64 / elapsed,
        publish_p50_ms: pct(&publish, 0.5),
        publish_p99_ms: pct(&publish, 0.99),
        visible_p50_ms: pct(&visible, 0.5),
        visible_p99_ms: pct(&visible, 0.99),
        visible_max_ms: visible.last().copied().unwrap_or(0.0),
        batches_seen_by_watcher: visible.len(),
    })
}

/// A directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> std::io::Result<Self> {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let p = std::env::temp_dir().join(format!("pagoda-bench-kvstore-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p)?;
        Ok(Self(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
