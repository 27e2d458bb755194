//! Pagoda gRPC contracts: the `.proto` files under `proto/pagoda/` and their generated tonic/prost code.
//!
//! - [`worker`]: the `Worker` service (Generate, Health, Stats) a router uses to drive a worker.
//! - [`trace_context`]: W3C trace context through HTTP headers and gRPC metadata, and shared span shapes.

pub mod trace_context;

/// `pagoda.worker.v1`: token ids in, token ids out.
pub mod worker {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("pagoda.worker.v1");
}
