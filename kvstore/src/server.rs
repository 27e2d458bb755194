//! Starting and stopping one kvstore node: its redb file under the data dir, the node actor, and one tonic server
//! carrying both the `KvStore` client service and the `Raft` peer service on the same address.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use pagoda_proto::kvstore::kv_store_server::KvStoreServer;
use pagoda_proto::kvstore::raft_server::RaftServer;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::node::{FatalError, Node, NodeHandle, RaftConfig};
use crate::service::KvStoreService;
use crate::storage::RaftStore;
use crate::transport::{MAX_RAFT_MESSAGE_BYTES, RaftService};

/// Largest client request (a Publish of [`crate::machine::MAX_EVENTS_PER_BATCH`] events fits).
pub const MAX_CLIENT_MESSAGE_BYTES: usize = 16 << 20;

/// How to run one node.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub id: u64,
    pub listen: SocketAddr,
    /// The address peers and clients reach this node at; empty means the bound listen address.
    pub advertise: String,
    /// The initial voters (`id -> address`), this node included or not.
    pub peers: BTreeMap<u64, String>,
    pub data_dir: PathBuf,
    /// Join an existing cluster (the leader adds this node with AddNode) instead of bootstrapping one.
    pub join: bool,
    pub tick: Duration,
    /// Take a snapshot and compact the log every this many applied entries.
    pub snapshot_every: u64,
}

impl NodeConfig {
    pub fn new(id: u64, listen: SocketAddr, data_dir: PathBuf) -> Self {
        Self {
            id,
            listen,
            advertise: String::new(),
            peers: BTreeMap::new(),
            data_dir,
            join: false,
            tick: Duration::from_millis(100),
            snapshot_every: 10_000,
        }
    }
}

#[derive(Debug, Error)]
pub enum ServerError {
    #[error("kvstore: {0}")]
    Io(#[from] std::io::Error),
    #[error("kvstore: {0}")]
    Node(#[from] FatalError),
    #[error("kvstore: {0}")]
    Store(#[from] crate::storage::StoreError),
    #[error("kvstore: invalid configuration: {0}")]
    Config(String),
    #[error("kvstore: node task: {0}")]
    Join(String),
    #[error("kvstore: TLS: {0}")]
    Tls(String),
}

/// A running node; [`RunningNode::stop`] shuts it down and releases its data dir.
pub struct RunningNode {
    pub id: u64,
    pub addr: SocketAddr,
    pub handle: NodeHandle,
    shutdown: Option<oneshot::Sender<()>>,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    actor: JoinHandle<Result<(), FatalError>>,
    /// Which of the two [`RunningNode::wait`] saw end (a finished task's handle must not be awaited again).
    server_ended: bool,
    actor_ended: bool,
}

impl RunningNode {
    /// Stops serving, stops the actor and waits until its storage is closed (so the data dir can be reopened).
    pub async fn stop(mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        // The actor goes first: that ends the watch streams, which graceful shutdown would otherwise wait for.
        drop(self.handle);
        // An actor that ended already (what `wait` reported) has closed its storage.
        let actor = if self.actor_ended {
            Ok(())
        } else {
            self.actor.abort();
            match (&mut self.actor).await {
                Ok(r) => r.map_err(ServerError::from),
                Err(e) if e.is_cancelled() => Ok(()),
                Err(e) => Err(ServerError::Join(e.to_string())),
            }
        };
        if !self.server_ended && tokio::time::timeout(Duration::from_secs(2), &mut self.server).await.is_err() {
            self.server.abort();
        }
        actor
    }

    /// Waits until the node stops by itself (a fatal storage error) or the server fails.
    /// The node is then to be stopped ([`RunningNode::stop`]), not waited on again.
    pub async fn wait(&mut self) -> Result<(), ServerError> {
        tokio::select! {
            r = &mut self.actor, if !self.actor_ended => {
                self.actor_ended = true;
                match r {
                    Ok(r) => r.map_err(ServerError::from),
                    Err(e) => Err(ServerError::Join(e.to_string())),
                }
            }
            r = &mut self.server, if !self.server_ended => {
                self.server_ended = true;
                match r {
                    Ok(r) => r.map_err(|e| ServerError::Config(e.to_string())),
                    Err(e) => Err(ServerError::Join(e.to_string())),
                }
            }
            else => Ok(()),
        }
    }
}

/// Binds `cfg.listen` and starts the node.
pub async fn start(cfg: NodeConfig) -> Result<RunningNode, ServerError> {
    let listener = TcpListener::bind(cfg.listen).await?;
    start_on(cfg, listener).await
}

/// Starts the node on an already bound listener (tests bind every node's port before starting any).
pub async fn start_on(mut cfg: NodeConfig, listener: TcpListener) -> Result<RunningNode, ServerError> {
    if cfg.id == 0 {
        return Err(ServerError::Config("node id 0 is reserved by raft".into()));
    }
    if cfg.peers.contains_key(&0) {
        return Err(ServerError::Config("peer id 0 is reserved by raft".into()));
    }
    let addr = listener.local_addr()?;
    if cfg.advertise.is_empty() {
        cfg.advertise = cfg.peers.get(&cfg.id).cloned().unwrap_or_else(|| addr.to_string());
    }
    std::fs::create_dir_all(&cfg.data_dir)?;
    let store = RaftStore::open(&cfg.data_dir.join("raft.redb"))?;
    let raft_cfg = RaftConfig {
        id: cfg.id,
        advertise: cfg.advertise.clone(),
        peers: cfg.peers.clone(),
        join: cfg.join,
        tick: cfg.tick,
        snapshot_every: cfg.snapshot_every,
    };
    let node = Node::open(&raft_cfg, store)?;
    let (handle, actor) = node.spawn();
    let (shutdown, rx) = oneshot::channel::<()>();
    let kv = KvStoreServer::new(KvStoreService::new(handle.clone()))
        .max_decoding_message_size(MAX_CLIENT_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES);
    let raft = RaftServer::new(RaftService::new(cfg.id, handle.clone()))
        .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES);
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let server = tokio::spawn(
        pagoda_proto::tls::server()
            .map_err(|e| ServerError::Tls(e.to_string()))?
            .tcp_nodelay(true)
            .add_service(kv)
            .add_service(raft)
            .serve_with_incoming_shutdown(incoming, async {
                let _ = rx.await;
            }),
    );
    tracing::info!(node = cfg.id, %addr, advertise = cfg.advertise, "kvstore node listening");
    Ok(RunningNode {
        id: cfg.id,
        addr,
        handle,
        shutdown: Some(shutdown),
        server,
        actor,
        server_ended: false,
        actor_ended: false,
    })
}

/// An embedded one-voter kvstore (node 1) for `pagoda up`: it elects itself at once and commits alone.
pub async fn start_embedded(data_dir: PathBuf, listen: SocketAddr) -> Result<RunningNode, ServerError> {
    let mut cfg = NodeConfig::new(1, listen, data_dir);
    cfg.tick = Duration::from_millis(50);
    start(cfg).await
}
