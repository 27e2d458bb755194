//! Pagoda router: the OpenAI-compatible HTTP API in front of the workers.
//!
//! - [`server`]: axum routes and handlers, shared state, [`serve`].
//! - [`openai`]: request/response wire types and input validation (every input bounded).
//! - [`extract`] / [`error`]: JSON body extraction and OpenAI-style error bodies.
//! - [`codec`]: chat template + tokenizer ([`codec::TextCodec`], [`gguf_codec::GgufCodec`]).
//! - [`detok`]: UTF-8-safe incremental detokenisation and stop strings.
//! - [`generate`]: one generation over a worker's gRPC `Generate` stream, migrated to another worker when its own
//!   fails or stalls.
//! - [`responses`]: OpenAI's Responses API over the chat path: translation, events, the bounded response store.
//! - [`lora_admin`]: loading and unloading LoRA adapters on every worker at run time.
//! - [`workers`]: the worker list (static, or following the registry), health probes, round-robin.
//! - [`membership`]: the etcd registry watch that adds and removes workers.
//! - [`placement`]: the KV-aware cost model and selectors (pure), with the routing baselines.
//! - [`placer`]: the router's placement state: residency predictions, strategy, recent decisions.
//! - [`residency`]: the bounded index of which worker holds which prefix block, reported and predicted.
//! - [`feed`]: the kvstore `Watch` task that feeds the residency index and raises the stale-reports alarm.
//! - [`metrics`]: Prometheus metrics.
//! - [`stats_cache`]: the workers' `Stats`, fetched at most once a second for `/metrics` and the dashboard.
//! - [`auth`]: API keys file, tenants, admin key, bearer parsing and constant-time key lookup.
//! - [`limits`]: per-key token bucket and in-flight cap ([`limits::Limiter`]).
//! - [`access`]: the middlewares that apply [`auth`] and [`limits`] to `/v1/*` and the admin endpoints.
//! - [`timeline`]: the last 10 minutes of request counts and TTFT/ITL percentiles in 5 s windows.
//! - [`dashboard`]: the operator dashboard (`/dashboard`): embedded page, login, state JSON, kvstore status.
//! - [`spans`]: the trace spans (`router.request`, `router.place`, the worker call) and context propagation.

pub mod access;
pub mod auth;
pub mod codec;
pub mod dashboard;
pub mod detok;
pub mod disagg;
pub mod error;
pub mod extract;
pub mod feed;
pub mod generate;
pub mod gguf_codec;
pub mod limits;
pub mod lora_admin;
pub mod membership;
pub mod messages;
pub mod metrics;
pub mod openai;
pub mod placement;
pub mod placer;
pub mod residency;
pub mod responses;
pub mod server;
pub mod spans;
pub mod stats_cache;
pub mod timeline;
pub mod workers;

pub use auth::{KeysFileError, Security};
pub use codec::TextCodec;
pub use error::ApiError;
pub use generate::MigrationConfig;
pub use gguf_codec::{GgufCodec, model_id_for};
pub use server::{
    AppState, DEFAULT_BODY_LIMIT, DEFAULT_CLIENT_TIMEOUT, DEFAULT_MAX_INFLIGHT, RouterConfig, app, serve,
};
