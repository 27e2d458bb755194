//! Pagoda gRPC contracts: the `.proto` files under `proto/pagoda/` and their generated tonic/prost code.
//!
//! - [`worker`]: the `Worker` service (Generate, Health, Stats) a router uses to drive a worker.
//! - [`kvstore`]: the `KvStore` service (Publish, Watch, Read, membership) and the `Raft` peer transport.
//! - [`trace_context`]: W3C trace context through HTTP headers and gRPC metadata, and shared span shapes.

pub mod trace_context;

/// `pagoda.worker.v1`: token ids in, token ids out.
pub mod worker {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("pagoda.worker.v1");
}

/// `pagoda.kvstore.v1`: the replicated block directory and its raft transport.
pub mod kvstore {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("pagoda.kvstore.v1");
}
