//! The axum application: routes, shared state, request accounting, and the handlers of the OpenAI endpoints
//! (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/models`), Anthropic's (`/v1/messages`,
//! `/v1/messages/count_tokens`) plus `/healthz`, `/readyz` and `/metrics`.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::PathRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, RawQuery, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json};
use futures::Stream;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::access::{self, DEFAULT_TENANT};
use crate::auth::{Security, Tenant};
use crate::codec::TextCodec;
use crate::dashboard::{self, Dashboard};
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generate::{self, GenerateContext, Job, MigrationConfig, Piece, TokenLogprob};
use crate::limits::Limiter;
use crate::metrics::Metrics;
use crate::openai::{
    AssistantMessage, ChatChoice, ChatChunk, ChatCompletion, ChatCompletionRequest, ChatLogprobs, ChunkChoice,
    Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, Delta, DetokenizeRequest, DetokenizeResponse,
    FunctionDelta, GenParams, ModelCard, ModelList, PromptInput, StopReason, TokenizeInput, TokenizeRequest,
    TokenizeResponse, ToolCallDelta, Usage, check_lengths, check_min_tokens,
};
use crate::placer::PlacerConfig;
use crate::responses::{NamedEvent, ResponseBackend, ResponseEvents, ResponsesRequest};
use crate::stats_cache::{StatsCache, StatsSnapshot};
use crate::workers::WorkerPool;

/// Default request body limit: 4 MiB.
pub const DEFAULT_BODY_LIMIT: usize = 4 << 20;
/// Default cap on generation requests in flight through one router (beyond it: 503 + `Retry-After`).
pub const DEFAULT_MAX_INFLIGHT: usize = 1024;
/// Default [`RouterConfig::client_timeout`]: long enough for a large body over a slow link or a reader that pauses,
/// short enough that clients which stop cannot hold the in-flight slots for long.
pub const DEFAULT_CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Router settings.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Worker gRPC addresses (`host:port`), used round-robin.
    pub workers: Vec<String>,
    /// Largest accepted request body, in bytes.
    pub body_limit: usize,
    /// How often workers are health-probed.
    pub health_interval: Duration,
    /// How requests are placed on workers.
    pub placement: PlacerConfig,
    /// API keys, tenants and the admin key; the default is auth off (dev mode).
    pub security: Security,
    /// kvstore nodes (`host:port`): the router watches them for the workers' block events and the dashboard shows
    /// their raft status (empty: placement knows only its own predictions; the dashboard says "not configured").
    /// With the etcd registry the list follows kvstore membership.
    pub kvstore: pagoda_kvstore::Endpoints,
    /// A registered worker with no report for this long raises the stale-reports alarm.
    pub stale_reports_after: Duration,
    /// Stall timeouts and the retry limit of request migration.
    pub migration: MigrationConfig,
    /// Most generation requests in flight at once; more are shed with 503 + `Retry-After`.
    pub max_inflight: usize,
    /// How long the router waits on a client: for the rest of its request body (then 408), and for it to take
    /// the next piece of a streamed answer (then the generation is cancelled and the in-flight slot freed).
    /// Without it, clients that stop sending or reading would hold the in-flight slots forever.
    pub client_timeout: Duration,
    /// The etcd registry: with it the worker list follows the registered workers (`workers` stay pinned) and the
    /// router registers itself.
    pub etcd: Option<pagoda_registry::RegistryConfig>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            workers: Vec::new(),
            body_limit: DEFAULT_BODY_LIMIT,
            health_interval: Duration::from_secs(2),
            placement: PlacerConfig::default(),
            security: Security::default(),
            kvstore: pagoda_kvstore::Endpoints::fixed(Vec::new()),
            migration: MigrationConfig::default(),
            stale_reports_after: Duration::from_secs(3),
            max_inflight: DEFAULT_MAX_INFLIGHT,
            client_timeout: DEFAULT_CLIENT_TIMEOUT,
            etcd: None,
        }
    }
}

struct Inner {
    codec: Arc<dyn TextCodec>,
    pool: Arc<WorkerPool>,
    metrics: Arc<Metrics>,
    body_limit: usize,
    created: u64,
    security: Security,
    /// Present when there is a keys file.
    limiter: Option<Arc<Limiter>>,
    dashboard: Dashboard,
    started: Instant,
    migration: MigrationConfig,
    /// One permit per generation request in flight (see [`access::shed_load`]).
    inflight: Arc<tokio::sync::Semaphore>,
    max_inflight: usize,
    /// See [`RouterConfig::client_timeout`].
    client_timeout: Duration,
    /// Stored responses of `/v1/responses`: this router's memory, or etcd with the registry.
    responses: ResponseBackend,
    /// The workers' `Stats`, shared by `/metrics` and the dashboard.
    stats: StatsCache,
}

/// Shared handler state.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

impl AppState {
    /// State without auth (dev mode).
    pub fn new(codec: Arc<dyn TextCodec>, pool: Arc<WorkerPool>, body_limit: usize) -> AppState {
        AppState::with_security(codec, pool, body_limit, Security::default())
    }

    pub fn with_security(
        codec: Arc<dyn TextCodec>,
        pool: Arc<WorkerPool>,
        body_limit: usize,
        security: Security,
    ) -> AppState {
        AppState::with_parts(
            codec,
            pool,
            body_limit,
            security,
            Dashboard::default(),
            MigrationConfig::default(),
            DEFAULT_MAX_INFLIGHT,
        )
    }

    /// State with auth settings, a dashboard (which polls its kvstore nodes) and request-migration settings.
    pub fn with_parts(
        codec: Arc<dyn TextCodec>,
        pool: Arc<WorkerPool>,
        body_limit: usize,
        security: Security,
        dashboard: Dashboard,
        migration: MigrationConfig,
        max_inflight: usize,
    ) -> AppState {
        let max_inflight = max_inflight.clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        let limiter = security.keys.as_deref().map(Limiter::new);
        AppState(Arc::new(Inner {
            codec,
            pool,
            metrics: Arc::new(Metrics::new()),
            body_limit,
            created: unix_now(),
            security,
            limiter,
            dashboard,
            started: Instant::now(),
            migration,
            inflight: Arc::new(tokio::sync::Semaphore::new(max_inflight)),
            max_inflight,
            client_timeout: DEFAULT_CLIENT_TIMEOUT,
            responses: ResponseBackend::default(),
            stats: StatsCache::default(),
        }))
    }

    pub fn dashboard(&self) -> &Dashboard {
        &self.0.dashboard
    }

    fn responses(&self) -> &ResponseBackend {
        &self.0.responses
    }

    /// This state with `/v1/responses` stored in `backend`. Called while building the state, before it is shared
    /// (a shared state keeps its store, and the mistake is logged).
    pub fn with_responses(mut self, backend: ResponseBackend) -> AppState {
        match Arc::get_mut(&mut self.0) {
            Some(inner) => inner.responses = backend,
            None => tracing::error!("the response store can only be set before the router state is shared"),
        }
        self
    }

    /// This state with [`RouterConfig::client_timeout`] `timeout`. Called while building the state, before it is
    /// shared (as [`AppState::with_responses`]).
    pub fn with_client_timeout(mut self, timeout: Duration) -> AppState {
        match Arc::get_mut(&mut self.0) {
            Some(inner) => inner.client_timeout = timeout.max(Duration::from_millis(1)),
            None => tracing::error!("the client timeout can only be set before the router state is shared"),
        }
        self
    }

    /// See [`RouterConfig::client_timeout`].
    pub fn client_timeout(&self) -> Duration {
        self.0.client_timeout
    }

    /// When this state (the router) was created.
    pub fn started(&self) -> Instant {
        self.0.started
    }

    pub fn security(&self) -> &Security {
        &self.0.security
    }

    pub fn limiter(&self) -> Option<&Arc<Limiter>> {
        self.0.limiter.as_ref()
    }

    pub fn inflight(&self) -> &Arc<tokio::sync::Semaphore> {
        &self.0.inflight
    }

    pub fn max_inflight(&self) -> usize {
        self.0.max_inflight
    }

    pub fn body_limit(&self) -> usize {
        self.0.body_limit
    }

    pub fn pool(&self) -> &Arc<WorkerPool> {
        &self.0.pool
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.0.metrics
    }

    /// Every worker's `Stats`, at most [`crate::stats_cache::STATS_MAX_AGE`] old.
    pub async fn worker_stats(&self) -> Option<Arc<StatsSnapshot>> {
        self.0.stats.snapshot(&self.0.pool).await
    }

    /// The base model's id (what `model` names when it names no adapter).
    pub fn base_model_id(&self) -> &str {
        self.0.codec.model_id()
    }

    /// What `model` names: the base model (`None`), or a LoRA adapter a ready worker has loaded or loads on demand
    /// (its name); anything else is a 404.
    fn check_model(&self, model: &str) -> Result<Option<String>, ApiError> {
        if model == self.0.codec.model_id() {
            return Ok(None);
        }
        if self.pool().lora_servable(model) {
            Ok(Some(model.to_string()))
        } else {
            Err(ApiError::model_not_found(model))
        }
    }
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

/// Builds the application for `state`.
pub fn app(state: AppState) -> axum::Router {
    let limit = state.body_limit();
    // Auth runs before any body is read, so an unauthenticated client cannot make the router parse a large body.
    let generation = axum::Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(create_response))
        .route("/v1/messages", post(create_message))
        .route_layer(middleware::from_fn_with_state(state.clone(), access::shed_load));
    let v1 = axum::Router::new()
        .merge(generation)
        .route("/v1/models", get(models))
        .route("/v1/models/{*model}", get(model))
        .route("/v1/responses/{id}", get(get_response).delete(delete_response))
        .route("/v1/messages/count_tokens", post(count_message_tokens))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), access::require_key));
    let admin = axum::Router::new()
        .route("/debug/keys", get(debug_keys))
        .route("/debug/placements", get(debug_placements))
        .route("/debug/place", post(debug_place))
        .route("/v1/load_lora_adapter", post(crate::lora_admin::load))
        .route("/v1/unload_lora_adapter", post(crate::lora_admin::unload))
        .route_layer(middleware::from_fn_with_state(state.clone(), access::require_admin));
    axum::Router::new()
        .merge(v1)
        .merge(admin)
        .merge(dashboard::routes())
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), count_requests))
        .layer(middleware::from_fn(crate::spans::trace_request))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Starts health probing and serves `app` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    codec: Arc<dyn TextCodec>,
    config: RouterConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let pool = match &config.etcd {
        Some(_) => WorkerPool::dynamic(&config.workers, config.placement),
        None => WorkerPool::with_placement(&config.workers, config.placement),
    };
    let pool = Arc::new(pool.map_err(std::io::Error::other)?);
    let membership = config.etcd.clone().map(|cfg| crate::membership::spawn(pool.clone(), cfg, config.workers.clone()));
    let registration = match &config.etcd {
        Some(cfg) => {
            let addr = listener.local_addr()?;
            let me = pagoda_registry::Member {
                id: addr.to_string(),
                address: format!("http://{addr}"),
                epoch: unix_now(),
                node_id: None,
            };
            Some(
                pagoda_registry::register(cfg.clone(), pagoda_registry::Role::Router, me)
                    .map_err(std::io::Error::other)?,
            )
        }
        None => None,
    };
    let dashboard = Dashboard::new(config.kvstore.clone()).map_err(std::io::Error::other)?;
    let health = pool.spawn_health_loop(config.health_interval);
    let feed = (!config.kvstore.is_empty()).then(|| {
        let mut cfg = crate::feed::FeedConfig::new(config.kvstore.clone());
        cfg.stale_after = config.stale_reports_after;
        crate::feed::spawn(pool.clone(), cfg)
    });
    log_security(&config.security);
    let mut state = AppState::with_parts(
        codec,
        pool,
        config.body_limit,
        config.security,
        dashboard,
        config.migration,
        config.max_inflight,
    );
    state = state.with_client_timeout(config.client_timeout);
    if let Some(cfg) = &config.etcd {
        state = state.with_responses(ResponseBackend::shared(cfg.clone()));
    }
    let res = axum::serve(listener, app(state)).with_graceful_shutdown(shutdown).await;
    health.abort();
    if let Some(f) = feed {
        f.abort();
    }
    if let Some(m) = membership {
        m.abort();
    }
    if let Some(r) = registration {
        r.stop().await;
    }
    res
}

fn log_security(sec: &Security) {
    match &sec.keys {
        None => tracing::warn!(
            "API keys are off (no --api-keys-file): every /v1 request is served, as tenant `{DEFAULT_TENANT}`"
        ),
        Some(k) => tracing::info!(keys = k.entries().len(), tenants = k.tenant_count(), "API keys on"),
    }
    match (&sec.admin, &sec.keys) {
        (Some(admin), _) => {
            tracing::info!("admin endpoints (/debug/*, /dashboard) need the admin key");
            if admin.sessions_per_process() {
                tracing::warn!(
                    "the admin key file holds only the key's sha256 digest: dashboard sessions open this router \
                     process only (another replica, or this one after a restart, asks for the key again)"
                );
            }
        }
        (None, None) => {
            tracing::warn!("admin endpoints (/debug/*, /dashboard) are open: no --admin-key-file and no API keys")
        }
        (None, Some(_)) => tracing::info!("admin endpoints (/debug/*, /dashboard) are disabled: no --admin-key-file"),
    }
}

async fn count_requests(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let endpoint = req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string());
    let resp = next.run(req).await;
    st.metrics().count_request(endpoint.as_deref().unwrap_or("unmatched"), resp.status().as_u16());
    resp
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::route_not_found(method.as_str(), uri.path())
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

async fn readyz(State(st): State<AppState>) -> Response {
    let workers: Vec<serde_json::Value> = st
        .pool()
        .workers()
        .iter()
        .map(|w| {
            let s = w.status();
            serde_json::json!({
                "address": w.addr, "ready": s.ready, "role": s.role.name(), "model": s.model, "error": s.last_error,
                "lora_adapters": s.lora_adapters.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(),
                "lora_on_demand": s.lora_on_demand,
                // Out of placement after staying silent, however its health check answers.
                "ejected_for_ms": u64::try_from(w.ejected_for().as_millis()).unwrap_or(u64::MAX),
            })
        })
        .collect();
    let ready = st.pool().any_ready();
    let body = serde_json::json!({
        "status": if ready { "ready" } else { "not ready" },
        "model": st.0.codec.model_id(),
        "workers": workers,
    });
    let code = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(body)).into_response()
}

/// vLLM's `GET /health`, which its charts and clients probe: 200 with an empty body once a worker is ready (as
/// `/readyz`), else 503.
async fn health(State(st): State<AppState>) -> StatusCode {
    if st.pool().any_ready() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }
}

/// vLLM's `GET /version`: this build's version.
async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// `GET /metrics`: the worker gauges come from the shared `Stats` snapshot, so scrapes (however many, and the
/// dashboard's polls) cost the workers one `Stats` call per snapshot age, not one per scrape.
async fn metrics(State(st): State<AppState>) -> Response {
    let snapshot = st.worker_stats().await;
    st.metrics().record_pool(st.pool(), snapshot.as_deref());
    st.metrics().scrape_directory(&st.pool().feed_status());
    st.metrics().scrape_registry(&st.pool().registry_status());
    let mut resp = st.metrics().encode().into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    resp
}

/// `GET /debug/placements` (admin): the most recent placement decisions, newest first, each with every
/// candidate's cost breakdown; and the directory feed (kvstore node, applied index, each registered worker's
/// report age and whether it is stale).
async fn debug_placements(State(st): State<AppState>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "decisions": st.pool().recent_decisions(),
        "directory": st.pool().feed_status(),
        "registry": st.pool().registry_status(),
        "workers": st.pool().workers().iter().map(|w| w.addr.clone()).collect::<Vec<_>>(),
    }))
}

/// `POST /debug/place` (admin): where a chat request would go now and why (its cost breakdown per worker), without
/// running it, recording the decision or predicting residency. Replicas that are caught up answer alike, ties
/// included. `?tenant=` names the prefix-cache namespace (default: the one requests use when auth is off).
async fn debug_place(
    State(st): State<AppState>,
    RawQuery(query): RawQuery,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Json<crate::placer::DecisionRecord>, ApiError> {
    let vocab_size = st.0.codec.vocab_size();
    let (turns, params) = blocking(move || req.validate(vocab_size)).await?;
    let lora = st.check_model(&params.model)?;
    let tenant = query.as_deref().unwrap_or("").split('&').find_map(|kv| kv.strip_prefix("tenant="));
    let namespace = tenant.unwrap_or(DEFAULT_TENANT).to_string();
    if !crate::auth::valid_tenant(&namespace) {
        return Err(ApiError::invalid_param("tenant", "A tenant is 1 to 64 characters of [A-Za-z0-9._-]."));
    }
    let mut prompt = chat_prompt(&st, turns, params.chat_render).await?;
    params.truncate_prompt(&mut prompt);
    let max_tokens = check_lengths(prompt.len(), params.max_tokens, st.0.codec.context_length())?;
    check_min_tokens(&params, max_tokens)?;
    let pool = st.pool();
    let shape = generate::RequestShape::of(pool, &namespace, lora.as_deref(), &prompt, &params, max_tokens)?;
    match pool.explain(&shape.request("debug-place")) {
        Ok(d) => Ok(Json(d)),
        Err(crate::placement::PlacementError::NoReadyWorker) => Err(generate::no_ready_worker()),
        Err(e) => Err(ApiError::internal(format!("placement failed: {e}"))),
    }
}

/// `GET /debug/keys` (admin): every key's tenant, fingerprint, limits and current usage; never the keys.
async fn debug_keys(State(st): State<AppState>) -> Json<serde_json::Value> {
    let Some(keys) = st.security().keys.as_ref() else {
        return Json(serde_json::json!({"auth": false, "keys": []}));
    };
    let usage = st.limiter().map(|l| l.usage()).unwrap_or_default();
    let list: Vec<serde_json::Value> = keys
        .entries()
        .iter()
        .zip(usage)
        .map(|(e, u)| {
            serde_json::json!({
                "tenant": &*e.tenant,
                "fingerprint": e.fingerprint(),
                "limits": {"rps": u.rps, "burst": u.burst, "concurrency": u.concurrency},
                "usage": {
                    "in_flight": u.in_flight,
                    "tokens_available": u.tokens_available,
                    "admitted_total": u.admitted_total,
                    "rejected_rate_total": u.rejected_rate_total,
                    "rejected_concurrency_total": u.rejected_concurrency_total,
                },
            })
        })
        .collect();
    Json(serde_json::json!({"auth": true, "tenants": keys.tenant_count(), "keys": list}))
}

async fn models(State(st): State<AppState>) -> Json<ModelList> {
    let mut data = vec![model_card(&st, None)];
    data.extend(st.pool().lora_adapters().into_iter().map(|(name, _)| model_card(&st, Some(name))));
    Json(ModelList::new(data))
}

/// OpenAI's `GET /v1/models/{model}` (the SDKs' `models.retrieve`): the served model's card, or 404.
async fn model(
    State(st): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<ModelCard>, ApiError> {
    let Path(id) = id.map_err(|e| ApiError::invalid_param("model", format!("The model id in the path: {e}.")))?;
    // An unknown id goes back in the 404 cut to the bound of a body's `model`.
    let shown: String = id.chars().take(crate::openai::MAX_NAME_BYTES).collect();
    let lora = st.check_model(&shown)?;
    Ok(Json(model_card(&st, lora)))
}

/// The base model's card, or the card of its LoRA adapter `lora`.
fn model_card(st: &AppState, lora: Option<String>) -> ModelCard {
    let base = st.0.codec.model_id().to_string();
    let (id, parent) = match lora {
        Some(name) => (name, Some(base)),
        None => (base, None),
    };
    ModelCard::new(id, st.0.created, st.0.codec.context_length(), parent)
}

/// `POST /tokenize` (vLLM's endpoint): a prompt's token ids, or a chat's after the chat template, with the count
/// a completion or chat completion of it would report as `prompt_tokens`.
async fn tokenize(State(st): State<AppState>, ApiJson(req): ApiJson<TokenizeRequest>) -> Result<Response, ApiError> {
    let input = req.validate()?;
    if let Some(m) = &req.model {
        st.check_model(m)?;
    }
    let tokens = match input {
        TokenizeInput::Chat(turns, render) => chat_prompt(&st, turns, render).await?,
        TokenizeInput::Prompt { text, add_special } => text_prompt(&st, text, add_special).await?,
    };
    let token_strs = (req.return_token_strs == Some(true))
        .then(|| tokens.iter().map(|&t| crate::openai::token_text(st.0.codec.as_ref(), t)).collect());
    Ok(Json(TokenizeResponse { count: tokens.len(), max_model_len: st.0.codec.context_length(), tokens, token_strs })
        .into_response())
}

/// `POST /detokenize`: the text of token ids (their bytes joined, invalid UTF-8 replaced).
async fn detokenize(
    State(st): State<AppState>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let tokens = req.validate(st.0.codec.vocab_size())?;
    if let Some(m) = &req.model {
        st.check_model(m)?;
    }
    let mut bytes = Vec::new();
    for &t in &tokens {
        bytes.extend_from_slice(&st.0.codec.token_bytes(t));
    }
    Ok(Json(DetokenizeResponse { prompt: String::from_utf8_lossy(&bytes).into_owned() }))
}

/// Runs CPU-bound work off the async threads: tokenizing, and validating a generation request, which compiles
/// its guide (a JSON schema, pattern or grammar takes up to a tenth of a second).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(format!("a blocking task failed: {e}")))?
}

/// A text prompt's tokens, with the model's BOS/EOS where it asks for them when `add_special` (off the async
/// threads).
async fn text_prompt(st: &AppState, text: String, add_special: bool) -> Result<Vec<u32>, ApiError> {
    let codec = st.0.codec.clone();
    blocking(move || {
        codec
            .encode(&text, add_special)
            .map_err(|e| ApiError::invalid_param("prompt", format!("Could not tokenize: {e}")))
    })
    .await
}

/// The chat's prompt tokens: the model's chat template applied to `turns`, then tokenized (off the async threads).
async fn chat_prompt(
    st: &AppState,
    turns: Vec<crate::openai::Turn>,
    render: crate::openai::ChatRender,
) -> Result<Vec<u32>, ApiError> {
    let codec = st.0.codec.clone();
    blocking(move || {
        let text = codec
            .render_chat(&turns, render)
            .map_err(|e| ApiError::invalid_param("messages", format!("Could not apply the chat template: {e}")))?;
        codec.encode(&text, true).map_err(|e| ApiError::invalid_param("messages", format!("Could not tokenize: {e}")))
    })
    .await
}

async fn chat_completions(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let vocab_size = st.0.codec.vocab_size();
    let (turns, params) = blocking(move || req.validate(vocab_size)).await?;
    let lora = st.check_model(&params.model)?;
    let mut prompt = chat_prompt(&st, turns, params.chat_render).await?;
    params.truncate_prompt(&mut prompt);
    let id = new_id("chatcmpl");
    let choices = start_choices(&st, &tenant, &id, vec![prompt], &params, lora, arrived).await?;
    let created = unix_now();
    if params.stream {
        return Ok(sse(chat_events(choices, id, created, params, st.0.codec.clone())).into_response());
    }
    let (collected, usage) = collect_choices(choices).await?;
    let codec = st.0.codec.as_ref();
    let choices = collected
        .into_iter()
        .enumerate()
        .map(|(index, c)| ChatChoice {
            index: index as u32,
            logprobs: params.logprobs.map(|_| ChatLogprobs::render(&c.logprobs, codec)),
            message: AssistantMessage::new(c.text, params.tool_call.as_deref(), || new_id("call")),
            finish_reason: c.finish_reason,
            stop_reason: c.stop,
        })
        .collect();
    Ok(Json(ChatCompletion { id, object: "chat.completion", created, model: params.model, choices, usage })
        .into_response())
}

/// A chat request translated from another API (Responses, Messages), as the chat path takes it: validated, its
/// model checked, its prompt rendered and truncated; errors name the other API's fields (`rename`).
async fn translated_chat(
    st: &AppState,
    chat: serde_json::Value,
    rename: impl Fn(ApiError) -> ApiError,
) -> Result<(GenParams, Option<String>, Vec<u32>), ApiError> {
    let chat: ChatCompletionRequest =
        serde_json::from_value(chat).map_err(|e| rename(ApiError::invalid(format!("Invalid request: {e}"))))?;
    let vocab_size = st.0.codec.vocab_size();
    let (turns, params) = blocking(move || chat.validate(vocab_size)).await.map_err(&rename)?;
    let lora = st.check_model(&params.model)?;
    let mut prompt = chat_prompt(st, turns, params.chat_render).await.map_err(&rename)?;
    params.truncate_prompt(&mut prompt);
    Ok((params, lora, prompt))
}

/// Starts the one generation of a single-answer request (`/v1/responses`, `/v1/messages`).
async fn start_one(
    st: &AppState,
    tenant: &Tenant,
    id: &str,
    prompt: Vec<u32>,
    params: &GenParams,
    lora: Option<String>,
    arrived: Instant,
) -> Result<Choice, ApiError> {
    let mut choices = start_choices(st, tenant, id, vec![prompt], params, lora, arrived).await?;
    choices.pop().ok_or_else(|| ApiError::internal("no generation started"))
}

/// `POST /v1/responses`: OpenAI's Responses API over the chat path ([`crate::responses`]).
async fn create_response(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    ApiJson(body): ApiJson<serde_json::Value>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let request = ResponsesRequest::parse(body)?;
    let previous = match request.previous_response_id() {
        Some(id) => st.responses().conversation(&tenant.name, id).await?,
        None => Vec::new(),
    };
    let (chat, mut pending) = request.into_chat(previous);
    let (params, lora, prompt) = translated_chat(&st, chat, |e| pending.rename_param(e)).await?;
    pending.set_tool_call(params.tool_call.clone());
    let choice = start_one(&st, &tenant, &pending.id, prompt, &params, lora, arrived)
        .await
        .map_err(|e| pending.rename_param(e))?;
    if params.stream {
        let mut events = ResponseEvents::new(pending);
        let opening = events.start();
        // Everything the stream needs rides in its state: nothing is cloned per token.
        let body = futures::stream::unfold(Some((choice.rx, events, st, tenant.name)), |state| async move {
            let (mut rx, mut events, st, tenant_name) = state?;
            let batch = match rx.recv().await {
                Some(Piece::Text { text, .. }) => {
                    return Some((events.delta(&text), Some((rx, events, st, tenant_name))));
                }
                Some(Piece::Echo { .. }) => return Some((Vec::new(), Some((rx, events, st, tenant_name)))),
                Some(Piece::Done { finish_reason, usage, .. }) => {
                    let (batch, stored) = events.done(finish_reason, &usage);
                    if let Some(stored) = stored {
                        st.responses().insert(tenant_name, events.id().to_string(), stored).await;
                    }
                    batch
                }
                Some(Piece::Error(e)) => events.failed(&e),
                None => events.failed(&ApiError::internal("the generation ended without an answer")),
            };
            Some((batch, None))
        });
        return Ok(sse_batches(opening, body));
    }
    let c = collect(choice.rx).await?;
    let (response, stored) = pending.finish(&c.text, c.finish_reason, &c.usage);
    if let Some(stored) = stored {
        st.responses().insert(tenant.name.clone(), pending.id.clone(), stored).await;
    }
    Ok(Json(response).into_response())
}

/// `POST /v1/messages`: Anthropic's Messages API over the chat path ([`crate::messages`]); errors in Anthropic's
/// shape.
async fn create_message(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    body: Result<ApiJson<serde_json::Value>, ApiError>,
) -> Response {
    let arrived = Instant::now();
    let answer = async {
        use crate::messages::{MessageEvents, MessagesRequest, rename_param};
        let ApiJson(body) = body?;
        let (chat, mut pending) = MessagesRequest::parse(body, false)?.into_chat();
        let (params, lora, prompt) = translated_chat(&st, chat, rename_param).await?;
        pending.set_tool_call(params.tool_call.clone());
        let prompt_tokens = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
        let choice =
            start_one(&st, &tenant, &pending.id, prompt, &params, lora, arrived).await.map_err(rename_param)?;
        if !params.stream {
            let c = collect(choice.rx).await?;
            let stop = c.stop.as_ref().and_then(StopReason::text);
            return Ok(Json(pending.message(&c.text, c.finish_reason, stop, &c.usage)).into_response());
        }
        let events = MessageEvents::new(pending);
        let opening = events.start(prompt_tokens);
        let body = futures::stream::unfold(Some((choice.rx, events)), |state| async move {
            let (mut rx, mut events) = state?;
            let batch = match rx.recv().await {
                Some(Piece::Text { text, .. }) => return Some((events.delta(&text), Some((rx, events)))),
                Some(Piece::Echo { .. }) => return Some((Vec::new(), Some((rx, events)))),
                Some(Piece::Done { finish_reason, usage, stop }) => {
                    events.done(finish_reason, stop.as_ref().and_then(StopReason::text), &usage)
                }
                Some(Piece::Error(e)) => events.failed(&e),
                None => events.failed(&ApiError::internal("the generation ended without an answer")),
            };
            Some((batch, None))
        });
        Ok(sse_batches(opening, body))
    };
    answer.await.unwrap_or_else(crate::messages::error_response)
}

/// `POST /v1/messages/count_tokens`: the prompt a Messages request would run, counted (`{"input_tokens": n}`).
async fn count_message_tokens(
    State(st): State<AppState>,
    body: Result<ApiJson<serde_json::Value>, ApiError>,
) -> Response {
    let counted = async {
        use crate::messages::{MessagesRequest, rename_param};
        let ApiJson(body) = body?;
        let (chat, _) = MessagesRequest::parse(body, true)?.into_chat();
        let (_, _, prompt) = translated_chat(&st, chat, rename_param).await?;
        Ok::<_, ApiError>(Json(serde_json::json!({"input_tokens": prompt.len()})).into_response())
    };
    counted.await.unwrap_or_else(crate::messages::error_response)
}

/// `GET /v1/responses/{id}`: a stored response of the caller's tenant.
async fn get_response(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    Ok(Json(st.responses().response(&tenant.name, &path_id(id)?).await?).into_response())
}

/// `DELETE /v1/responses/{id}`: forgets a stored response of the caller's tenant.
async fn delete_response(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    Ok(Json(st.responses().delete(&tenant.name, &path_id(id)?).await?).into_response())
}

/// The response id of a `/v1/responses/{id}` path, or a 400 that says what is wrong with it.
fn path_id(id: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    id.map(|Path(id)| id).map_err(|e| ApiError::invalid(format!("The response id in the path: {e}.")))
}

async fn completions(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let vocab_size = st.0.codec.vocab_size();
    let (prompts, params) = blocking(move || req.validate(vocab_size)).await?;
    let lora = st.check_model(&params.model)?;
    let mut tokenized = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let mut tokens = match prompt {
            PromptInput::Tokens(t) => t,
            PromptInput::Text(text) => text_prompt(&st, text, true).await?,
        };
        params.truncate_prompt(&mut tokens);
        tokenized.push(tokens);
    }
    let id = new_id("cmpl");
    let choices = start_choices(&st, &tenant, &id, tokenized, &params, lora, arrived).await.map_err(|mut e| {
        if e.param.as_deref() == Some("messages") {
            e.param = Some("prompt".into());
        }
        e
    })?;
    let created = unix_now();
    if params.stream {
        return Ok(sse(completion_events(choices, id, created, params, st.0.codec.clone())).into_response());
    }
    let (collected, usage) = collect_choices(choices).await?;
    let codec = st.0.codec.as_ref();
    let choices = collected
        .into_iter()
        .enumerate()
        .map(|(index, Collected { echo, mut text, logprobs, finish_reason, stop, .. })| {
            let logprobs = params.logprobs.map(|_| match &echo {
                Some((prompt, first, scored)) => {
                    let mut all = CompletionLogprobs::echo(*first, scored, codec);
                    all.extend(&logprobs, codec, u32::try_from(prompt.len()).unwrap_or(u32::MAX));
                    all
                }
                None => CompletionLogprobs::render(&logprobs, codec, 0),
            });
            if let Some((prompt, ..)) = echo {
                text.insert_str(0, &prompt);
            }
            CompletionChoice {
                index: index as u32,
                text,
                logprobs,
                finish_reason: Some(finish_reason),
                stop_reason: stop,
            }
        })
        .collect();
    Ok(Json(Completion {
        id,
        object: "text_completion",
        created,
        model: params.model,
        choices,
        usage: Some(Some(usage)),
    })
    .into_response())
}

/// One generation of a request: a choice.
struct Choice {
    rx: mpsc::Receiver<Piece>,
    /// The first choice of its prompt: the prompt counts in the request's usage once, not once per choice.
    counts_prompt: bool,
    /// Its prompt's length, for the running usage of `continuous_usage_stats`.
    prompt_tokens: u32,
}

/// Starts the request's choices together: `n` generations of each prompt, in OpenAI's `choices` order (by
/// prompt, then sample). The samples of one prompt with a `seed` take `seed`, `seed + 1`, ... so that they
/// differ and repeat. Fails with the first choice that cannot start; the others are then dropped, which cancels
/// them on their workers.
async fn start_choices(
    st: &AppState,
    tenant: &Tenant,
    id: &str,
    prompts: Vec<Vec<u32>>,
    params: &GenParams,
    lora: Option<String>,
    arrived: Instant,
) -> Result<Vec<Choice>, ApiError> {
    if let Some(guide) = params.guide_kind() {
        st.metrics().count_guided(guide);
    }
    if let Some(name) = &lora {
        st.metrics().count_lora_request(name);
    }
    let n = params.n.max(1);
    let total = prompts.len() * n as usize;
    let mut starts = Vec::with_capacity(total);
    for (b, prompt) in prompts.into_iter().enumerate() {
        for j in 0..n {
            let mut p = params.clone();
            p.sampling.seed = p.sampling.seed.map(|s| s.wrapping_add(u64::from(j)));
            let job_id = if total > 1 { format!("{id}-{}", b * n as usize + j as usize) } else { id.to_string() };
            let prompt = prompt.clone();
            let prompt_tokens = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
            let lora = lora.clone();
            starts.push(async move {
                let rx = start_job(st, tenant, &job_id, prompt, p, lora, arrived).await?;
                Ok::<_, ApiError>(Choice { rx, counts_prompt: j == 0, prompt_tokens })
            });
        }
    }
    futures::future::try_join_all(starts).await
}

async fn start_job(
    st: &AppState,
    tenant: &Tenant,
    id: &str,
    prompt: Vec<u32>,
    params: GenParams,
    lora: Option<String>,
    arrived: Instant,
) -> Result<mpsc::Receiver<Piece>, ApiError> {
    let max_tokens = check_lengths(prompt.len(), params.max_tokens, st.0.codec.context_length())?;
    check_min_tokens(&params, max_tokens)?;
    let profile_queries = profile_queries(st, &params.kv_profile_queries, prompt.len()).await?;
    let bad_words = bad_words(st, &params.bad_words).await?;
    let namespace = match &params.cache_salt {
        Some(salt) => crate::openai::salted_namespace(&tenant.name, salt),
        None => tenant.name.to_string(),
    };
    let job = Job {
        request_id: id.to_string(),
        prompt,
        max_tokens,
        params,
        profile_queries,
        bad_words,
        namespace,
        tenant: tenant.name.clone(),
        tenant_weight: tenant.weight,
        lora,
        arrived,
    };
    let ctx = GenerateContext {
        pool: st.pool().clone(),
        codec: st.0.codec.clone(),
        metrics: st.metrics().clone(),
        migration: st.0.migration,
        client_timeout: st.0.client_timeout,
    };
    generate::start(ctx, job).await
}

/// `kv.profile_queries` as token ids (no special tokens: each is scored as a turn appended to the context),
/// checked against the worker's bounds here so that a bad one is a 400 naming the field, not a worker error.
async fn profile_queries(st: &AppState, texts: &[String], prompt_len: usize) -> Result<Vec<Vec<u32>>, ApiError> {
    if texts.is_empty() {
        return Ok(Vec::new());
    }
    let codec = st.0.codec.clone();
    let texts = texts.to_vec();
    blocking(move || {
        let queries = texts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                codec.encode(t, false).map_err(|e| {
                    ApiError::invalid_param(format!("kv.profile_queries[{i}]"), format!("Could not tokenize: {e}"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        pagoda_worker::placement::check_profile_queries(
            &queries,
            prompt_len,
            codec.vocab_size(),
            codec.context_length(),
        )
        .map_err(|e| ApiError::invalid_param("kv.profile_queries", format!("`kv.profile_queries`: {e}.")))?;
        Ok(queries)
    })
    .await
}

/// `bad_words` as the token sequences the worker bans ([`crate::openai::bad_word_sequences`]), checked against the
/// worker's bounds here so that a bad one is a 400 naming the field, not a worker error.
async fn bad_words(st: &AppState, words: &[String]) -> Result<Vec<Vec<u32>>, ApiError> {
    if words.is_empty() {
        return Ok(Vec::new());
    }
    let codec = st.0.codec.clone();
    let words = words.to_vec();
    blocking(move || {
        let sequences = crate::openai::bad_word_sequences(&words, |w| codec.encode(w, false))
            .map_err(|(i, e)| ApiError::invalid_param(format!("bad_words[{i}]"), format!("Could not tokenize: {e}")))?;
        pagoda_worker::sampling::check_bad_words(&sequences, codec.vocab_size())
            .map_err(|e| ApiError::invalid_param("bad_words", format!("`bad_words`: {e}.")))?;
        Ok(sequences)
    })
    .await
}

/// A whole generation, for a non-streaming answer.
struct Collected {
    /// The echoed prompt: text, first token, and scored tokens.
    echo: Option<(String, u32, Vec<TokenLogprob>)>,
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish_reason: &'static str,
    usage: Usage,
    /// The stop string or stop token that ended the text, if one did.
    stop: Option<StopReason>,
}

async fn collect(mut rx: mpsc::Receiver<Piece>) -> Result<Collected, ApiError> {
    let (mut text, mut logprobs, mut echo) = (String::new(), Vec::new(), None);
    while let Some(p) = rx.recv().await {
        match p {
            Piece::Echo { text, first_token, logprobs } => echo = Some((text, first_token, logprobs)),
            Piece::Text { text: t, logprobs: l, .. } => {
                text.push_str(&t);
                logprobs.extend(l);
            }
            Piece::Done { finish_reason, usage, stop } => {
                return Ok(Collected { echo, text, logprobs, finish_reason, usage, stop });
            }
            Piece::Error(e) => return Err(e),
        }
    }
    Err(ApiError::internal("The generation ended unexpectedly."))
}

/// Server-sent events with names (`event:` then `data:`), as the Responses and Messages APIs stream them, no
/// `[DONE]`: the opening events, then every batch `body` yields.
fn sse_batches(opening: Vec<NamedEvent>, body: impl Stream<Item = Vec<NamedEvent>> + Send + 'static) -> Response {
    use futures::StreamExt;
    let events = futures::stream::iter(opening).chain(body.flat_map(futures::stream::iter));
    Sse::new(events.map(|(name, data)| Ok::<_, Infallible>(Event::default().event(name).data(data)))).into_response()
}

fn sse(events: impl Stream<Item = String> + Send + 'static) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    use futures::StreamExt;
    Sse::new(events.map(|data| Ok(Event::default().data(data))))
}

fn to_json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| ApiError::internal(format!("serialisation failed: {e}")).body_json())
}

/// Every choice collected (concurrently), in order, with the request's usage; the first failure fails the
/// request.
async fn collect_choices(choices: Vec<Choice>) -> Result<(Vec<Collected>, Usage), ApiError> {
    let counts: Vec<bool> = choices.iter().map(|c| c.counts_prompt).collect();
    let collected = futures::future::try_join_all(choices.into_iter().map(|c| collect(c.rx))).await?;
    let mut usage = UsageSum::default();
    for (c, &counts_prompt) in collected.iter().zip(&counts) {
        usage.add(&c.usage, counts_prompt);
    }
    Ok((collected, usage.total()))
}

/// A request's usage over its choices: each prompt (and its cached part) once, every choice's completion.
#[derive(Debug, Default)]
struct UsageSum {
    prompt: u32,
    completion: u32,
    cached: u32,
}

impl UsageSum {
    fn add(&mut self, u: &Usage, counts_prompt: bool) {
        if counts_prompt {
            self.prompt = self.prompt.saturating_add(u.prompt_tokens);
            self.cached = self.cached.saturating_add(u.cached_tokens());
        }
        self.completion = self.completion.saturating_add(u.completion_tokens);
    }

    fn total(&self) -> Usage {
        Usage::new(self.prompt, self.completion, self.cached)
    }
}

/// vLLM's `stream_options.continuous_usage_stats`: the usage so far that each chunk of a choice carries (`None`
/// without it: then only the last chunk, after every choice, carries the request's usage).
struct RunningUsage {
    /// Each choice's prompt length, by index; empty when off.
    prompt_tokens: Vec<u32>,
}

impl RunningUsage {
    fn new(params: &GenParams, choices: &[Choice]) -> RunningUsage {
        let on = params.continuous_usage;
        RunningUsage { prompt_tokens: if on { choices.iter().map(|c| c.prompt_tokens).collect() } else { Vec::new() } }
    }

    /// Choice `index` after `completion_tokens` generated tokens.
    fn at(&self, index: u32, completion_tokens: u32) -> Option<Usage> {
        let prompt = *self.prompt_tokens.get(index as usize)?;
        Some(Usage::running(prompt, completion_tokens))
    }

    /// A choice's final usage, on its finish chunk.
    fn done(&self, usage: Usage) -> Option<Usage> {
        (!self.prompt_tokens.is_empty()).then_some(usage)
    }
}

/// The `data:` payloads of a chat stream: a role delta per choice, content deltas, a finish chunk per choice, the
/// optional usage chunk, `[DONE]`.
fn chat_events(
    choices: Vec<Choice>,
    id: String,
    created: u64,
    params: GenParams,
    codec: Arc<dyn TextCodec>,
) -> impl Stream<Item = String> + Send + 'static {
    let include_usage = params.include_usage;
    let running = RunningUsage::new(&params, &choices);
    let model = params.model;
    // `finish`: the finish reason and stop reason of a choice's last chunk.
    let chunk = move |index: u32,
                      delta: Delta,
                      logprobs: Option<ChatLogprobs>,
                      finish: Option<(&'static str, Option<StopReason>)>,
                      usage: Option<Usage>|
          -> ChatChunk {
        let (finish_reason, stop_reason) = finish.map_or((None, None), |(f, s)| (Some(f), s));
        ChatChunk {
            id: id.clone(),
            object: "chat.completion.chunk",
            created,
            model: model.clone(),
            choices: vec![ChunkChoice { index, delta, logprobs, finish_reason, stop_reason }],
            usage: include_usage.then_some(usage),
        }
    };
    // A forced function call streams as its arguments: the first delta names the call, the rest extend it.
    let tool_call = params.tool_call.clone();
    let first: Vec<String> = (0..choices.len() as u32)
        .map(|i| {
            let delta = match &tool_call {
                None => Delta { role: Some("assistant"), content: Some(String::new()), tool_calls: None },
                Some(name) => Delta {
                    role: Some("assistant"),
                    content: None,
                    tool_calls: Some(vec![ToolCallDelta {
                        index: 0,
                        id: Some(new_id("call")),
                        kind: Some("function"),
                        function: FunctionDelta { name: Some(name.clone()), arguments: String::new() },
                    }]),
                },
            };
            to_json(&chunk(i, delta, None, None, running.at(i, 0)))
        })
        .collect();
    let calls = tool_call.is_some();
    let wants_logprobs = params.logprobs.is_some();
    let last_chunk = chunk.clone();
    let body = choices_to_events(
        choices,
        move |i, p| match p {
            // Chat has no `echo`.
            Piece::Echo { .. } => Vec::new(),
            Piece::Text { text, logprobs, completion_tokens } => {
                let usage = running.at(i, completion_tokens);
                let logprobs = wants_logprobs.then(|| ChatLogprobs::render(&logprobs, codec.as_ref()));
                let delta = if calls {
                    let function = FunctionDelta { name: None, arguments: text };
                    let call = ToolCallDelta { index: 0, id: None, kind: None, function };
                    Delta { role: None, content: None, tool_calls: Some(vec![call]) }
                } else {
                    Delta { role: None, content: Some(text), tool_calls: None }
                };
                vec![to_json(&chunk(i, delta, logprobs, None, usage))]
            }
            Piece::Done { finish_reason, usage, stop } => {
                let usage = running.done(usage);
                vec![to_json(&chunk(i, Delta::default(), None, Some((finish_reason, stop)), usage))]
            }
            Piece::Error(e) => vec![e.body_json()],
        },
        move |usage| {
            if !include_usage {
                return Vec::new();
            }
            let mut last = last_chunk(0, Delta::default(), None, None, None);
            last.choices.clear();
            last.usage = Some(Some(usage));
            vec![to_json(&last)]
        },
    );
    futures::StreamExt::chain(futures::stream::iter(first), body)
}

/// The `data:` payloads of a `/v1/completions` stream.
fn completion_events(
    choices: Vec<Choice>,
    id: String,
    created: u64,
    params: GenParams,
    codec: Arc<dyn TextCodec>,
) -> impl Stream<Item = String> + Send + 'static {
    let include_usage = params.include_usage;
    let running = RunningUsage::new(&params, &choices);
    let model = params.model;
    // `finish`: the finish reason and stop reason of a choice's last chunk.
    let chunk = move |index: u32,
                      text: String,
                      logprobs: Option<CompletionLogprobs>,
                      finish: Option<(&'static str, Option<StopReason>)>,
                      usage: Option<Usage>| {
        let (finish_reason, stop_reason) = finish.map_or((None, None), |(f, s)| (Some(f), s));
        Completion {
            id: id.clone(),
            object: "text_completion",
            created,
            model: model.clone(),
            choices: vec![CompletionChoice { index, text, logprobs, finish_reason, stop_reason }],
            usage: include_usage.then_some(usage),
        }
    };
    let wants_logprobs = params.logprobs.is_some();
    // Bytes of each choice's echoed prompt: its completion's offsets start after them.
    let mut echoed = vec![0u32; choices.len()];
    let last_chunk = chunk.clone();
    choices_to_events(
        choices,
        move |i, p| match p {
            Piece::Echo { text, first_token, logprobs } => {
                if let Some(e) = echoed.get_mut(i as usize) {
                    *e = u32::try_from(text.len()).unwrap_or(u32::MAX);
                }
                let logprobs = wants_logprobs.then(|| CompletionLogprobs::echo(first_token, &logprobs, codec.as_ref()));
                vec![to_json(&chunk(i, text, logprobs, None, running.at(i, 0)))]
            }
            Piece::Text { text, logprobs, completion_tokens } => {
                let offset = echoed.get(i as usize).copied().unwrap_or(0);
                let logprobs = wants_logprobs.then(|| CompletionLogprobs::render(&logprobs, codec.as_ref(), offset));
                vec![to_json(&chunk(i, text, logprobs, None, running.at(i, completion_tokens)))]
            }
            Piece::Done { finish_reason, usage, stop } => {
                vec![to_json(&chunk(i, String::new(), None, Some((finish_reason, stop)), running.done(usage)))]
            }
            Piece::Error(e) => vec![e.body_json()],
        },
        move |usage| {
            if !include_usage {
                return Vec::new();
            }
            let mut last = last_chunk(0, String::new(), None, None, None);
            last.choices.clear();
            last.usage = Some(Some(usage));
            vec![to_json(&last)]
        },
    )
}

/// Maps each choice's pieces to payloads as they arrive (choices interleave), then, once every choice is done,
/// appends `last` of the request's usage and `[DONE]`. An error ends the stream at once, with `[DONE]` (the other
/// choices are dropped, which cancels them). A choice whose generation ended without `Done` or `Error` (it gave
/// up on a client that stopped reading, or failed) counts as an error, so a client still there is told rather
/// than left with a stream that just stops.
fn choices_to_events<R, L>(choices: Vec<Choice>, render: R, last: L) -> impl Stream<Item = String> + Send + 'static
where
    R: FnMut(u32, Piece) -> Vec<String> + Send + 'static,
    L: FnOnce(Usage) -> Vec<String> + Send + 'static,
{
    use futures::StreamExt;
    let counts: Vec<bool> = choices.iter().map(|c| c.counts_prompt).collect();
    let open = choices.len();
    let merged = futures::stream::select_all(choices.into_iter().enumerate().map(|(i, c)| {
        futures::stream::unfold(Some(c.rx), |rx| async move {
            let mut rx = rx?;
            let piece = rx
                .recv()
                .await
                .unwrap_or_else(|| Piece::Error(ApiError::internal("The generation ended without finishing.")));
            let terminal = matches!(piece, Piece::Done { .. } | Piece::Error(_));
            Some((piece, (!terminal).then_some(rx)))
        })
        .map(move |p| (i as u32, p))
        .boxed()
    }));
    struct Merge<R, L> {
        merged: futures::stream::SelectAll<futures::stream::BoxStream<'static, (u32, Piece)>>,
        render: R,
        last: Option<L>,
        open: usize,
        counts: Vec<bool>,
        usage: UsageSum,
    }
    let state = Merge { merged, render, last: Some(last), open, counts, usage: UsageSum::default() };
    futures::stream::unfold(Some(state), |state| async move {
        let mut s = state?;
        let (i, piece) = s.merged.next().await?;
        let (ended, is_error) = match &piece {
            Piece::Done { usage, .. } => {
                s.usage.add(usage, s.counts.get(i as usize).copied().unwrap_or(false));
                s.open -= 1;
                (s.open == 0, false)
            }
            Piece::Error(_) => (true, true),
            Piece::Echo { .. } | Piece::Text { .. } => (false, false),
        };
        let mut out = (s.render)(i, piece);
        if !ended {
            return Some((out, Some(s)));
        }
        if !is_error && let Some(last) = s.last.take() {
            out.extend(last(s.usage.total()));
        }
        out.push("[DONE]".to_string());
        Some((out, None))
    })
    .flat_map(futures::stream::iter)
}
