//! Pagoda kvstore: the cluster's block directory and worker table (DESIGN §6).
//!
//! [`directory`] is the state machine: idempotent, sequence-numbered block events from workers, gap detection, and
//! prefix-match queries for the router. Replication (raft) and the gRPC service are layered on top of it and never
//! reach into its maps.

pub mod directory;

pub use directory::{
    ApplyOutcome, BlockDirectory, BlockEvent, BlockHash, DirectoryError, EventBatch, Residency, Tier, WorkerRecord,
};
