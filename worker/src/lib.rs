//! Pagoda worker: the engine that owns a model and its KV cache.
//!
//! - [`model`]: GGUF reader, tokenizer and chat template from GGUF metadata, the llama forward pass, LoRA adapters.
//! - [`adapters`]: the LoRA adapters a worker serves, loaded at start-up and at run time.
//! - [`cache`]: head-paged block pool, per-sequence block tables, the prefix index over chain hashes.
//! - [`scheduler`]: continuous batching with a per-step token budget, chunked prefill, preemption by recompute.
//! - [`vtc`]: the virtual token counters that share weighted tokens fairly between tenants (`--scheduling-policy
//!   vtc`).
//! - [`sampling`]: greedy, temperature, top-k, top-p, seeded.
//! - [`speculative`]: n-gram speculative decoding's draft proposer (prompt lookup).
//! - [`evicpress`]: EvicPress's utility and greedy multi-choice knapsack over (tier, codec, keep ratio).
//! - [`placement`]: EvicPress driving the tiers: contexts, the idle-time quality profiler, applying the plan.
//! - [`tiers`]: the host and disk KV tiers below the device pool, offload/onboard and their cost model.
//! - [`events`]: the block-event log (engine side) and outbox (reporter side), sequence numbers, snapshots.
//! - [`transfer`]: the peer tier: the `Transfer` gRPC service and pulling a prefix from another worker.
//! - [`peer_link`]: device links between GPU workers that carry the peer tier's payloads (NCCL in
//!   `peer_link_nccl`, feature `cuda`), with gRPC as the fallback.
//! - [`reporter`]: the task that publishes block events, occupancy and heartbeats to the kvstore.
//! - [`bench`](mod@bench), [`bench_eviction`], [`bench_tiers`]: the engine micro-benchmark, throughput under KV memory
//!   pressure, and onboarding a prefix from the host/disk tiers against recomputing it; [`bench_zipf`]: EvicPress
//!   against LRU and fixed codecs on Zipf-reused contexts.

pub mod adapters;
pub mod bench;
pub mod bench_eviction;
pub mod bench_tiers;
pub mod bench_zipf;
pub mod cache;
pub mod engine;
pub mod eval;
pub mod events;
pub mod evicpress;
pub mod grammar_guide;
pub mod journal;
pub mod json_guide;
pub mod json_schema;
pub mod model;
pub mod peer_link;
#[cfg(feature = "cuda")]
pub mod peer_link_nccl;
pub mod placement;
pub mod policy;
pub mod regex_guide;
pub mod reporter;
#[cfg(feature = "cuda")]
pub mod runner_cuda;
pub mod sampling;
pub mod scheduler;
pub mod service;
pub mod speculative;
pub mod tiers;
pub mod transfer;
pub mod vtc;
