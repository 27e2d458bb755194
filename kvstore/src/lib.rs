//! Pagoda kvstore: the cluster's block directory and worker table (DESIGN §6).
//!
//! [`directory`] is the state machine: idempotent, sequence-numbered block events from workers, gap detection, and
//! prefix-match queries for the router. Replication (raft) and the gRPC service are layered on top of it and never
//! reach into its maps:
//! - [`machine`]: the replicated commands, their validation and application, the directory's snapshot form;
//! - [`storage`]: raft log, hard state, conf state and snapshots on redb;
//! - [`node`]: the actor that owns the raft `RawNode`, the storage and the directory;
//! - [`transport`]: raft messages between nodes over tonic;
//! - [`service`]: the `KvStore` gRPC service; [`server`]: starting a node; [`client`]: a leader-following client;
//! - [`endpoints`]: the kvstore node list a client follows, fixed or kept current by the etcd registry;
//! - [`bench`](mod@bench): `pagoda bench kvstore`.

pub mod bench;
pub mod client;
pub mod directory;
pub mod endpoints;
pub mod machine;
pub mod node;
pub mod server;
pub mod service;
pub mod storage;
pub mod transport;

pub use client::Client;
pub use directory::{
    Admitted, ApplyOutcome, BlockDirectory, BlockEvent, BlockHash, CollapsedEvents, DirectoryError, EventBatch,
    Registration, Residency, Tier, TierOccupancy, WorkerLoad, WorkerRecord, WorkerTable, collapse_clears,
};
pub use endpoints::{Endpoints, EndpointsSource};
pub use pagoda_proto::kvstore as proto;
pub use server::{NodeConfig, RunningNode, ServerError, start, start_embedded};
