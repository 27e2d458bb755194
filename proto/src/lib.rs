//! Pagoda gRPC contracts: the `.proto` files under `proto/pagoda/` and their generated tonic/prost code.
//!
//! - [`worker`]: the `Worker` service (Generate, Health, Stats) a router uses to drive a worker.
//! - [`kvstore`]: the `KvStore` service (Publish, Watch, Read, membership) and the `Raft` peer transport.
//! - [`transfer`]: the `Transfer` service (Fetch) workers pull each other's KV block groups through.
//! - [`trace_context`]: W3C trace context through HTTP headers and gRPC metadata, and shared span shapes.
//! - [`tls`]: optional mutual TLS for every channel and server between components.

pub mod tls;
pub mod trace_context;

/// gRPC metadata key on a worker's `resource_exhausted` refusal when its admission queue is full (not when the
/// request can never fit): milliseconds after which the worker expects room. The request is fine; the router tries
/// another worker and sheds load with 503 + `Retry-After` when all of them are full.
pub const BUSY_RETRY_AFTER_MS: &str = "pagoda-busy-retry-after-ms";

/// Longest codec name a KV block group may carry, in bytes: the kvstore directory's copies, the `Transfer`
/// service's blocks and the disk tier's file header all bound it by this one constant, so that a name a worker
/// stores is one its peers, its disk and the directory accept. The longest name made is a layered KIVI codec's
/// (`int4_kivi+int8@17:18/30`), whose list of layers the worker bounds to fit.
pub const MAX_CODEC_NAME_BYTES: usize = 64;

/// `pagoda.worker.v1`: token ids in, token ids out.
pub mod worker {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("pagoda.worker.v1");
}

/// `pagoda.transfer.v1`: KV block groups between workers, in bounded checksummed batches.
pub mod transfer {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("pagoda.transfer.v1");
}

/// `pagoda.kvstore.v1`: the replicated block directory and its raft transport.
pub mod kvstore {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("pagoda.kvstore.v1");
}
