//! The tonic `Worker` gRPC service over the engine: validates requests and maps failures to gRPC status codes
//! (`invalid_argument`, `resource_exhausted`, `unavailable`), turns engine events into the `Generate` response
//! stream, and cancels the engine request when the client drops the stream. Each stream carries a
//! `worker.generate` span, continued from the caller's trace context in the request metadata, with span events at
//! the request's milestones (`prefill`, `decode` first token and finish, `evict`), never per token. A request that
//! carries a router's peer hint first pulls its missing prefix from that peer ([`crate::transfer`]), in a
//! `transfer` child span; on a worker that reports to a kvstore, only from a peer its worker table lists
//! ([`crate::reporter::KnownPeers`]).
//!
//! It also owns admission: [`AdmissionLimits`] bound the requests on the worker and the prompt tokens still
//! waiting for prefill. Past them a request is refused with `resource_exhausted` carrying
//! [`pagoda_proto::BUSY_RETRY_AFTER_MS`], before the engine sees it, so a burst sheds load instead of queueing
//! without bound.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::Stream;
use pagoda_proto::trace_context::{self, KeyValue};
use pagoda_proto::worker::worker_server::{Worker, WorkerServer};
use pagoda_proto::worker::{
    self as pb, Finished, GenerateResponse, HealthRequest, HealthResponse, PolicyEvictions, StatsRequest, StatsResponse,
};
use tokio::sync::mpsc::UnboundedReceiver;
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status};
use tracing::Span;

use crate::adapters::{AdapterError, Origin};
use crate::engine::{
    EngineError, EngineHandle, FinishReason, GUIDE_NEEDS_TOKENIZER, GenerateEvent, GenerateRequest, SamplingParams,
};
use crate::events::BlockChange;
use crate::grammar_guide::Grammar;
use crate::json_schema::JsonSchema;
use crate::model::LoraAdapter;
use crate::model::lora::cache_namespace;
use crate::placement::EvicPressStats;
use crate::policy::{PolicyKind, PolicySpec};
use crate::regex_guide::ByteDfa;
use crate::reporter::ReportProgress;
use crate::sampling::TokenLogprobs;
use crate::scheduler::SchedError;
use crate::tiers::{GroupCodec, Tier};
use crate::transfer::{PeerCounters, PeerFetcher};

/// Longest `request_id` / `namespace`, in bytes.
pub const MAX_ID_BYTES: usize = 256;
/// Most stop token ids per request.
pub const MAX_STOP_TOKEN_IDS: usize = 64;
/// Largest accepted temperature.
pub const MAX_TEMPERATURE: f32 = 100.0;
/// Most tokens sent in one stream message (tokens already waiting are coalesced).
const MAX_TOKENS_PER_MESSAGE: usize = 64;
/// Most groups one `Residency` page lists (about 1 MiB encoded with the codec names workers use): a worker holds up
/// to millions, far more than one message a default gRPC client (4 MiB) takes, so the answer comes in pages.
pub const MAX_RESIDENCY_PAGE_GROUPS: usize = 32 * 1024;
/// Most bytes the groups of one `Residency` page encode to, whatever their codec names: half a default client's
/// 4 MiB limit, leaving room for the rest of the message and its framing.
pub const MAX_RESIDENCY_PAGE_BYTES: usize = 2 << 20;
/// The wait a worker suggests when a `Residency` snapshot is being taken already.
const RESIDENCY_BUSY_RETRY_AFTER_MS: &str = "1000";

/// How much work a worker takes before it refuses new requests as busy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Requests on the worker, from admission to the end of their stream: the running batch plus the queue
    /// behind it (`--max-running` + `--max-queued-requests`).
    pub max_requests: usize,
    /// Prompt tokens of the requests still waiting for their first token: the prefill backlog a new request
    /// would queue behind. A request is always admitted when no other waits, however long its prompt.
    pub max_queued_prompt_tokens: u64,
}

/// Default `--max-queued-requests`: requests waiting behind a full running batch.
pub const DEFAULT_MAX_QUEUED_REQUESTS: usize = 256;
/// Default `--max-queued-prompt-tokens`.
pub const DEFAULT_MAX_QUEUED_PROMPT_TOKENS: u64 = 32_768;
/// Largest `GenerateRequest.tenant_weight` (the router's keys file takes its `weight=` bound from here).
pub const MAX_TENANT_WEIGHT: u32 = 1000;
/// The wait a worker suggests when every adapter slot is pinned or in use (a few decode steps' time).
const LORA_BUSY_RETRY_AFTER_MS: &str = "500";
/// Longest a request waits for an adapter slot before it is refused as busy: well inside the router's default
/// first-token timeout (30 s), which would otherwise take the worker for dead.
pub const LORA_SLOT_WAIT: Duration = Duration::from_secs(10);

impl Default for AdmissionLimits {
    fn default() -> Self {
        AdmissionLimits {
            max_requests: 64 + DEFAULT_MAX_QUEUED_REQUESTS,
            max_queued_prompt_tokens: DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
        }
    }
}

/// The shared counters behind [`AdmissionLimits`]; each admitted request holds a [`QueueSlot`].
#[derive(Debug, Default)]
struct AdmissionQueue {
    limits: AdmissionLimits,
    requests: AtomicUsize,
    prompt_tokens: AtomicU64,
    refused: AtomicU64,
}

/// A request's place on the worker: its prompt tokens count as backlog until its first token, the request
/// itself until its stream ends.
struct QueueSlot {
    queue: Arc<AdmissionQueue>,
    /// 0 once the first token is out.
    prompt_tokens: u64,
}

impl QueueSlot {
    fn started(&mut self) {
        self.queue.prompt_tokens.fetch_sub(std::mem::take(&mut self.prompt_tokens), Ordering::AcqRel);
    }
}

impl AdmissionQueue {
    /// Takes a slot for a request of `prompt_tokens`, or refuses with a hint of how long to wait.
    fn enter(self: &Arc<Self>, prompt_tokens: u64) -> Result<QueueSlot, Status> {
        let requests = self.requests.fetch_add(1, Ordering::AcqRel);
        let backlog = self.prompt_tokens.fetch_add(prompt_tokens, Ordering::AcqRel);
        let slot = QueueSlot { queue: self.clone(), prompt_tokens };
        let over_requests = requests >= self.limits.max_requests;
        let over_tokens = backlog > 0 && backlog + prompt_tokens > self.limits.max_queued_prompt_tokens;
        if !(over_requests || over_tokens) {
            return Ok(slot);
        }
        drop(slot);
        self.refused.fetch_add(1, Ordering::Relaxed);
        let mut status = Status::resource_exhausted(format!(
            "worker busy: {requests} requests in flight (limit {}), {backlog} prompt tokens waiting for prefill \
             (limit {})",
            self.limits.max_requests, self.limits.max_queued_prompt_tokens
        ));
        // A coarse hint (the router only turns it into `Retry-After`): a second, plus one per 4k tokens of backlog.
        let retry_after_ms = (1000 + backlog / 4).min(30_000);
        if let Ok(v) = retry_after_ms.to_string().parse() {
            status.metadata_mut().insert(pagoda_proto::BUSY_RETRY_AFTER_MS, v);
        }
        Err(status)
    }
}

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.started();
        self.queue.requests.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The gRPC service. Cheap to clone.
#[derive(Clone)]
pub struct WorkerService {
    engine: EngineHandle,
    next_id: Arc<AtomicU64>,
    worker_id: String,
    /// What the router may send this worker, announced in `Health` (`pagoda worker --role`).
    role: String,
    admission: Arc<AdmissionQueue>,
    /// Peer pulls; `None` when they are off.
    peer: Option<Arc<PeerFetcher>>,
    /// The peer tier's counters (this worker's pulls and what its Transfer service served), for `Stats`.
    peer_counters: Arc<PeerCounters>,
    /// Where block-event reporting stands, for `Stats` (zeros without a kvstore).
    report_progress: Arc<ReportProgress>,
    /// One `Residency` snapshot at a time: each walks every group of every tier on the engine thread, between
    /// steps, so a burst of them would stall generation.
    residency_walk: Arc<tokio::sync::Semaphore>,
    /// [`MAX_RESIDENCY_PAGE_GROUPS`] and [`MAX_RESIDENCY_PAGE_BYTES`], lowered by tests.
    residency_page: (usize, usize),
    /// This process's `Health.boot_id`.
    boot_id: u64,
}

impl WorkerService {
    pub fn new(engine: EngineHandle) -> WorkerService {
        WorkerService {
            engine,
            next_id: Arc::new(AtomicU64::new(1)),
            worker_id: String::new(),
            role: String::new(),
            admission: Arc::new(AdmissionQueue::default()),
            peer: None,
            peer_counters: Arc::default(),
            report_progress: Arc::default(),
            residency_walk: Arc::new(tokio::sync::Semaphore::new(1)),
            residency_page: (MAX_RESIDENCY_PAGE_GROUPS, MAX_RESIDENCY_PAGE_BYTES),
            boot_id: rand::random::<u64>() | 1,
        }
    }

    /// Reports this block-event reporter's progress in `Stats`.
    pub fn with_report_progress(mut self, progress: Arc<ReportProgress>) -> WorkerService {
        self.report_progress = progress;
        self
    }

    /// Sets the admission limits (see [`AdmissionLimits`]).
    pub fn with_admission(mut self, limits: AdmissionLimits) -> WorkerService {
        self.admission = Arc::new(AdmissionQueue { limits, ..AdmissionQueue::default() });
        self
    }

    /// Requests refused as busy since start.
    pub fn refused_busy(&self) -> u64 {
        self.admission.refused.load(Ordering::Relaxed)
    }

    /// Reports these peer-tier counters in `Stats` (share them with the worker's `TransferService`).
    pub fn with_peer_counters(mut self, counters: Arc<PeerCounters>) -> WorkerService {
        self.peer_counters = counters;
        self
    }

    /// Pulls hinted prefixes from peers before running a request (see [`crate::transfer`]).
    pub fn with_peer_fetch(mut self, fetcher: PeerFetcher) -> WorkerService {
        self.peer = Some(Arc::new(fetcher));
        self
    }

    /// The adapter `name` for a request: the loaded one, or (with `--lora-on-demand`) one loaded now from
    /// `--lora-dir` on a blocking thread, which the request's span records. While every adapter slot is pinned
    /// or held by running requests, the request waits for one to free (as it would queue behind a full batch),
    /// for at most [`LORA_SLOT_WAIT`]; then it is refused as busy.
    async fn adapter(&self, name: &str, span: &Span) -> Result<Arc<LoraAdapter>, Status> {
        if let Some(adapter) = self.engine.lora_loaded(name) {
            return Ok(adapter);
        }
        let started = Instant::now();
        let mut pause = Duration::from_millis(2);
        let adapter = loop {
            let (engine, owned) = (self.engine.clone(), name.to_string());
            // Reading an adapter's weights (up to 2 GiB) must not hold a runtime thread.
            let resolved = tokio::task::spawn_blocking(move || engine.resolve_lora(&owned))
                .await
                .map_err(|e| Status::internal(format!("loading the adapter panicked: {e}")))?;
            match resolved {
                Err(EngineError::Lora(AdapterError::AllInUse(..))) if started.elapsed() < LORA_SLOT_WAIT => {
                    // Polled, not signalled: a slot frees when the last request holding its adapter drops it,
                    // deep in the engine. The registry's check is a map scan under a read lock.
                    let registry = self.engine.lora_registry();
                    while !registry.has_room() && started.elapsed() < LORA_SLOT_WAIT {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_millis(20));
                    }
                }
                other => break other.map_err(|e| status_from_engine(&e))?,
            }
        };
        trace_context::span_event(
            span,
            "lora_load",
            vec![KeyValue::new("adapter", name.to_string()), KeyValue::new("seconds", started.elapsed().as_secs_f64())],
        );
        Ok(adapter)
    }

    /// Announces `id` in `Health`: the id this worker reports its blocks under in the kvstore.
    pub fn with_worker_id(mut self, id: String) -> WorkerService {
        self.worker_id = id;
        self
    }

    /// Announces `role` in `Health` ("both", "prefill" or "decode"): which requests routers send this worker.
    pub fn with_role(mut self, role: String) -> WorkerService {
        self.role = role;
        self
    }

    /// The tonic server wrapper, ready for `Server::add_service`.
    pub fn into_server(self) -> WorkerServer<WorkerService> {
        WorkerServer::new(self)
    }

    /// Checks a request against the model and the bounds, and converts it to the engine's type, its guide compiled.
    /// The engine's request id is made unique (`<client id>#<n>`) so that cancelling it cannot touch another
    /// client's request.
    pub fn to_engine_request(&self, req: pb::GenerateRequest) -> Result<GenerateRequest, Status> {
        let (mut req, guide) = self.check_request(req)?;
        guide.compile_into(&mut req.sampling)?;
        Ok(req)
    }

    /// [`WorkerService::to_engine_request`] but for the guide, which is returned as text: compiling one costs up
    /// to ~0.1 s of CPU, which `generate` spends only on an admitted request, on a blocking thread.
    fn check_request(&self, req: pb::GenerateRequest) -> Result<(GenerateRequest, GuideText), Status> {
        let info = self.engine.model_info();
        if req.request_id.len() > MAX_ID_BYTES {
            return Err(Status::invalid_argument(format!("request_id is longer than {MAX_ID_BYTES} bytes")));
        }
        if req.namespace.len() > MAX_ID_BYTES {
            return Err(Status::invalid_argument(format!("namespace is longer than {MAX_ID_BYTES} bytes")));
        }
        // Before a peer pull hashes the prompt in it, not only where the engine takes the request.
        crate::cache::check_namespace(&req.namespace).map_err(Status::invalid_argument)?;
        if req.prompt_token_ids.is_empty() {
            return Err(Status::invalid_argument("prompt_token_ids is empty"));
        }
        if req.prompt_token_ids.len() >= info.context_length {
            return Err(Status::invalid_argument(format!(
                "the prompt has {} tokens; the model context length is {}",
                req.prompt_token_ids.len(),
                info.context_length
            )));
        }
        if let Some(bad) = req.prompt_token_ids.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(Status::invalid_argument(format!(
                "prompt token id {bad} is outside the vocabulary ({})",
                info.vocab_size
            )));
        }
        if req.max_tokens == 0 {
            return Err(Status::invalid_argument("max_tokens must be at least 1"));
        }
        if req.prompt_token_ids.len() + req.max_tokens as usize > info.context_length {
            return Err(Status::invalid_argument(format!(
                "prompt ({}) + max_tokens ({}) exceeds the model context length {}",
                req.prompt_token_ids.len(),
                req.max_tokens,
                info.context_length
            )));
        }
        if req.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(Status::invalid_argument(format!("at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed")));
        }
        if let Some(bad) = req.stop_token_ids.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(Status::invalid_argument(format!("stop token id {bad} is outside the vocabulary")));
        }
        let profile_queries: Vec<Vec<u32>> = req.kv_profile_queries.into_iter().map(|q| q.token_ids).collect();
        crate::placement::check_profile_queries(
            &profile_queries,
            req.prompt_token_ids.len(),
            info.vocab_size,
            info.context_length,
        )
        .map_err(|e| Status::invalid_argument(format!("kv_profile_queries: {e}")))?;
        let mut guide = GuideText::default();
        let sampling = match req.sampling {
            None => SamplingParams::greedy(),
            Some(s) => {
                if !s.temperature.is_finite() || !(0.0..=MAX_TEMPERATURE).contains(&s.temperature) {
                    return Err(Status::invalid_argument(format!(
                        "temperature must be in [0, {MAX_TEMPERATURE}], got {}",
                        s.temperature
                    )));
                }
                // proto3 default 0 means "not set": no nucleus filtering.
                let top_p = if s.top_p == 0.0 { 1.0 } else { s.top_p };
                if !top_p.is_finite() || top_p <= 0.0 || top_p > 1.0 {
                    return Err(Status::invalid_argument(format!("top_p must be in (0, 1], got {}", s.top_p)));
                }
                if s.top_k as usize > info.vocab_size {
                    return Err(Status::invalid_argument(format!(
                        "top_k {} is larger than the vocabulary ({})",
                        s.top_k, info.vocab_size
                    )));
                }
                // The engine checks the bias and the penalties (`EngineHandle::validate`); its error is an
                // InvalidArgument too.
                let guides = [s.json_object, !s.json_schema.is_empty(), !s.regex.is_empty(), !s.grammar.is_empty()];
                if guides.iter().filter(|&&g| g).count() > 1 {
                    return Err(Status::invalid_argument(
                        "at most one of json_object, json_schema, regex and grammar may guide a request",
                    ));
                }
                let params = SamplingParams {
                    temperature: s.temperature,
                    top_p,
                    top_k: s.top_k,
                    seed: s.seed,
                    logit_bias: s.logit_bias.iter().map(|b| (b.token_id, b.bias)).collect(),
                    allowed_token_ids: s.allowed_token_ids.clone(),
                    bad_words: s.bad_words.iter().map(|w| w.token_ids.clone()).collect(),
                    presence_penalty: s.presence_penalty,
                    frequency_penalty: s.frequency_penalty,
                    prior_output_tokens: s.prior_output_tokens,
                    // proto3 default 0 means "not set": no repetition penalty.
                    repetition_penalty: if s.repetition_penalty == 0.0 { 1.0 } else { s.repetition_penalty },
                    min_p: s.min_p,
                    min_tokens: s.min_tokens,
                    json_object: s.json_object,
                    json_schema: None,
                    regex: None,
                    grammar: None,
                };
                guide = GuideText { json_schema: s.json_schema, regex: s.regex, grammar: s.grammar };
                params
            }
        };
        let policy = if req.kv_policy.is_empty() && req.kv_budget_tokens == 0 {
            None
        } else {
            let name = (!req.kv_policy.is_empty()).then_some(req.kv_policy.as_str());
            let budget = (req.kv_budget_tokens > 0).then_some(req.kv_budget_tokens as usize);
            Some(
                PolicySpec::parse(name, budget, self.engine.default_policy(), info.context_length)
                    .map_err(|e| Status::invalid_argument(e.to_string()))?,
            )
        };
        let tier_codec = match req.kv_codec.as_str() {
            "" => None,
            name => match name.parse::<GroupCodec>() {
                // The worker layers a KIVI codec itself (`--kivi-int8-layers`); a request names the codec.
                Ok(GroupCodec::Layered { base, .. }) => {
                    return Err(Status::invalid_argument(format!(
                        "kv_codec: {name} is a stored format; name {base} (this worker's --kivi-int8-layers layers it)"
                    )));
                }
                Ok(codec) => Some(codec),
                Err(e) => return Err(Status::invalid_argument(format!("kv_codec: {e}"))),
            },
        };
        if req.tenant_weight > MAX_TENANT_WEIGHT {
            return Err(Status::invalid_argument(format!(
                "tenant_weight must be at most {MAX_TENANT_WEIGHT}, got {}",
                req.tenant_weight
            )));
        }
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let req = GenerateRequest {
            request_id: format!("{}#{n}", req.request_id),
            prompt: req.prompt_token_ids,
            max_tokens: req.max_tokens,
            sampling,
            stop_token_ids: req.stop_token_ids,
            namespace: req.namespace,
            policy,
            ignore_eos: req.ignore_eos,
            profile_queries,
            logprobs: req.logprobs.then_some(req.top_logprobs),
            prompt_logprobs: req.prompt_logprobs.then_some(req.top_logprobs),
            priority: req.priority,
            tenant_weight: req.tenant_weight.max(1),
            tier_codec,
            lora: (!req.lora.is_empty()).then_some(req.lora),
        };
        Ok((req, guide))
    }
}

/// A request's guide as it came (at most one of them is set; empty: none).
#[derive(Debug, Default)]
struct GuideText {
    json_schema: String,
    regex: String,
    grammar: String,
}

impl GuideText {
    fn is_empty(&self) -> bool {
        self.json_schema.is_empty() && self.regex.is_empty() && self.grammar.is_empty()
    }

    /// Compiles the guide into `sampling`. CPU-bound: on the async runtime, call it from a blocking thread.
    fn compile_into(self, sampling: &mut SamplingParams) -> Result<(), Status> {
        if !self.json_schema.is_empty() {
            let schema = JsonSchema::parse(&self.json_schema).map_err(|e| Status::invalid_argument(e.to_string()))?;
            sampling.json_schema = Some(Arc::new(schema));
        }
        if !self.regex.is_empty() {
            let dfa = ByteDfa::compile(&self.regex).map_err(|e| Status::invalid_argument(format!("regex: {e}")))?;
            sampling.regex = Some(Arc::new(dfa));
        }
        if !self.grammar.is_empty() {
            let grammar =
                Grammar::compile(&self.grammar).map_err(|e| Status::invalid_argument(format!("grammar: {e}")))?;
            sampling.grammar = Some(Arc::new(grammar));
        }
        Ok(())
    }
}

/// Maps an engine refusal to the gRPC status a router understands.
pub fn status_from_engine(e: &EngineError) -> Status {
    match e {
        EngineError::InvalidRequest(m) => Status::invalid_argument(m.clone()),
        EngineError::Rejected(
            SchedError::EmptyPrompt
            | SchedError::PromptTooLong { .. }
            | SchedError::ZeroMaxTokens
            | SchedError::PriorityNotEnabled(_),
        ) => Status::invalid_argument(e.to_string()),
        // Permanent: no amount of waiting frees more blocks than the pool has, so this is the request's fault,
        // not a load condition a client should retry.
        EngineError::Rejected(SchedError::TooLargeForPool { .. }) => {
            Status::invalid_argument(format!("{e}: lower `max_tokens` or shorten the prompt"))
        }
        EngineError::Rejected(_) => Status::resource_exhausted(e.to_string()),
        EngineError::Stopped => Status::unavailable(e.to_string()),
        EngineError::Lora(a) => match a {
            AdapterError::Unknown(_) => Status::not_found(e.to_string()),
            AdapterError::Exists(_) => Status::already_exists(e.to_string()),
            AdapterError::RuntimeOff => Status::failed_precondition(e.to_string()),
            AdapterError::Full(_) => Status::resource_exhausted(e.to_string()),
            // Busy, not wrong: the router tries another worker, and the client may retry after a decode or two.
            AdapterError::AllInUse(..) => {
                let mut status = Status::resource_exhausted(e.to_string());
                status
                    .metadata_mut()
                    .insert(pagoda_proto::BUSY_RETRY_AFTER_MS, MetadataValue::from_static(LORA_BUSY_RETRY_AFTER_MS));
                status
            }
            AdapterError::Invalid(_) => Status::invalid_argument(e.to_string()),
        },
        EngineError::Model(_) | EngineError::Config(_) | EngineError::Forward(_) => Status::internal(e.to_string()),
    }
}

fn pb_logprobs(lp: TokenLogprobs) -> pb::TokenLogprobs {
    let (top_token_ids, top_logprobs) = lp.top.into_iter().unzip();
    pb::TokenLogprobs { logprob: lp.logprob, top_token_ids, top_logprobs }
}

fn finish_reason(r: FinishReason) -> pb::FinishReason {
    match r {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Cancelled => pb::FinishReason::Cancelled,
    }
}

/// Owns the engine receiver for one stream. Dropping it (tonic drops the stream when the client goes away)
/// closes the receiver and tells the engine to cancel, which frees the request's blocks.
struct EventStream {
    rx: UnboundedReceiver<GenerateEvent>,
    engine: EngineHandle,
    request_id: String,
    /// An event taken from the channel but not yet sent.
    pending: Option<GenerateEvent>,
    done: bool,
    /// `worker.generate`: open for as long as the stream lives.
    span: Span,
    submitted: Instant,
    first_token: bool,
    /// The request's share of the admission limits, given back as it starts and ends.
    queue_slot: QueueSlot,
}

impl EventStream {
    /// The first token ends prefill (queueing included) and starts decode.
    fn on_first_token(&mut self) {
        self.first_token = true;
        self.queue_slot.started();
        let ms = self.submitted.elapsed().as_secs_f64() * 1e3;
        trace_context::span_event(&self.span, "prefill", vec![KeyValue::new("queue_and_prefill_ms", ms)]);
        trace_context::span_event(&self.span, "decode", vec![KeyValue::new("phase", "first_token")]);
    }

    fn on_finished(&self, reason: FinishReason, completion_tokens: u32, cached_tokens: u32, evicted: (u64, u64)) {
        let span = &self.span;
        span.record("completion_tokens", i64::from(completion_tokens));
        span.record("cached_tokens", i64::from(cached_tokens));
        let reason = match reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        };
        span.record("finish_reason", reason);
        if evicted.0 > 0 {
            trace_context::span_event(
                span,
                "evict",
                vec![KeyValue::new("evicted_slots", evicted.0 as i64), KeyValue::new("freed_blocks", evicted.1 as i64)],
            );
        }
        trace_context::span_event(
            span,
            "decode",
            vec![KeyValue::new("phase", "finish"), KeyValue::new("completion_tokens", i64::from(completion_tokens))],
        );
    }

    fn on_failed(&self, message: &str) {
        self.span.record("otel.status_code", "ERROR");
        self.span.record("otel.status_description", message);
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        if !self.done {
            tracing::debug!(request_id = %self.request_id, "generate stream dropped; cancelling");
            self.span.record("finish_reason", "cancelled");
            let _ = self.engine.cancel(&self.request_id);
        }
    }
}

/// Converts one engine event (plus any tokens already queued behind it) into a stream message.
fn next_message(s: &mut EventStream, first: GenerateEvent) -> Result<GenerateResponse, Status> {
    let mut msg = GenerateResponse::default();
    let mut ev = Some(first);
    while let Some(e) = ev.take() {
        match e {
            GenerateEvent::Token { id: t, logprobs } => {
                if !s.first_token {
                    s.on_first_token();
                }
                msg.token_ids.push(t);
                if let Some(lp) = logprobs {
                    msg.logprobs.push(pb_logprobs(lp));
                }
                if msg.token_ids.len() < MAX_TOKENS_PER_MESSAGE {
                    ev = s.rx.try_recv().ok();
                }
            }
            // One step's prompt positions (at most a step's prompt-logits tokens) per message, which keeps messages
            // small; they come before any token, so the message holds nothing else yet.
            GenerateEvent::PromptLogprobs(entries) => {
                msg.prompt_logprobs = entries.into_iter().map(pb_logprobs).collect();
            }
            GenerateEvent::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                // Which tier the cached tokens came from is the worker's metrics', not the client's.
                onboarded_tokens: _,
                evicted_slots,
                evicted_blocks,
                queue_seconds,
                stop_token,
            } => {
                s.done = true;
                s.on_finished(reason, completion_tokens, cached_tokens, (evicted_slots, evicted_blocks));
                msg.finished = Some(Finished {
                    reason: finish_reason(reason) as i32,
                    usage: Some(pb::Usage { prompt_tokens, completion_tokens, cached_tokens }),
                    queue_seconds,
                    stop_token_id: stop_token,
                });
            }
            GenerateEvent::Failed(m) if msg.token_ids.is_empty() => {
                s.done = true;
                s.on_failed(&m);
                return Err(Status::internal(format!("generation failed: {m}")));
            }
            GenerateEvent::Refused(m) if msg.token_ids.is_empty() => {
                s.done = true;
                s.on_failed(&m);
                return Err(Status::invalid_argument(m));
            }
            failed @ (GenerateEvent::Failed(_) | GenerateEvent::Refused(_)) => {
                // Deliver the tokens first; the failure goes out as the next item.
                s.pending = Some(failed);
            }
        }
    }
    Ok(msg)
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Worker for WorkerService {
    type GenerateStream = GenerateStream;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<GenerateStream>, Status> {
        let span = tracing::info_span!(
            "worker.generate",
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.method = "pagoda.worker.v1.Worker/Generate",
            request_id = tracing::field::Empty,
            prompt_tokens = tracing::field::Empty,
            max_tokens = tracing::field::Empty,
            policy = tracing::field::Empty,
            budget_tokens = tracing::field::Empty,
            completion_tokens = tracing::field::Empty,
            cached_tokens = tracing::field::Empty,
            finish_reason = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            otel.status_description = tracing::field::Empty,
        );
        trace_context::continue_from_metadata(&span, request.metadata());
        let refused = |st: Status| {
            span.record("otel.status_code", "ERROR");
            span.record("otel.status_description", st.message());
            st
        };
        let mut inner = request.into_inner();
        // A request scoring its prompt computes every position itself: a peer's blocks would go unused.
        let hint = inner.peer_hint.take().filter(|h| !h.address.is_empty() && h.blocks > 0 && !inner.prompt_logprobs);
        if let Some(h) = &hint
            && h.address.len() > MAX_ID_BYTES
        {
            return Err(refused(Status::invalid_argument(format!(
                "peer_hint.address is longer than {MAX_ID_BYTES} bytes"
            ))));
        }
        let (mut req, guide) = self.check_request(inner).map_err(refused)?;
        let request_id = req.request_id.clone();
        let policy = req.policy.unwrap_or_else(|| self.engine.default_policy());
        span.record("request_id", request_id.as_str());
        span.record("prompt_tokens", req.prompt.len() as i64);
        span.record("max_tokens", i64::from(req.max_tokens));
        span.record("policy", policy.kind.name());
        span.record("budget_tokens", policy.budget_tokens as i64);
        // Refused as busy before any pull or guide compile: work for a request that cannot run would be wasted,
        // and a burst of refused guided requests would otherwise keep the runtime's threads busy compiling.
        let queue_slot = self.admission.enter(req.prompt.len() as u64).map_err(refused)?;
        if !guide.is_empty() {
            // The engine would refuse it too (`EngineHandle::validate`), but only after the compile.
            if self.engine.model_info().token_bytes.is_none() {
                return Err(refused(Status::invalid_argument(GUIDE_NEEDS_TOKENIZER)));
            }
            let mut sampling = std::mem::replace(&mut req.sampling, SamplingParams::greedy());
            req.sampling = tokio::task::spawn_blocking(move || guide.compile_into(&mut sampling).map(|()| sampling))
                .await
                .map_err(|e| refused(Status::internal(format!("compiling the guide panicked: {e}"))))?
                .map_err(refused)?;
        }
        let adapter = match &req.lora {
            Some(name) => Some(self.adapter(name, &span).await.map_err(refused)?),
            None => None,
        };
        // Only the directory's workers may be pulled from: a hint is the router's, but anyone reaching this service
        // could send one naming any Transfer server.
        let hint = hint.filter(|h| {
            let known = self.report_progress.peers().admits(&h.address);
            if !known && self.peer.is_some() {
                // Every hint is refused alike when the router's names for workers are not the addresses they
                // register: said once, loudly; the rest are counted in Stats.
                if self.peer_counters.count_refused_hint() == 0 {
                    tracing::warn!(peer = %h.address, "a peer hint names no worker the kvstore lists; prefilling");
                } else {
                    tracing::debug!(peer = %h.address, "a peer hint names no worker the kvstore lists; prefilling");
                }
            }
            known
        });
        if let (Some(peer), Some(hint)) = (&self.peer, &hint) {
            let namespace = match &adapter {
                Some(a) => cache_namespace(&req.namespace, a.cache_id()),
                None => req.namespace.clone(),
            };
            let pulled = peer.pull_prefix(&req.prompt, &namespace, hint, &span).await;
            if pulled > 0 {
                trace_context::span_event(
                    &span,
                    "onboard",
                    vec![KeyValue::new("from", "peer"), KeyValue::new("blocks", pulled as i64)],
                );
            }
        }
        let rx = self.engine.submit_with(req, adapter).map_err(|e| refused(status_from_engine(&e)))?;
        let state = EventStream {
            rx,
            engine: self.engine.clone(),
            request_id,
            pending: None,
            done: false,
            span,
            submitted: Instant::now(),
            first_token: false,
            queue_slot,
        };
        let stream = futures::stream::unfold(state, |mut s| async move {
            if s.done {
                return None;
            }
            let ev = match s.pending.take() {
                Some(ev) => Some(ev),
                None => s.rx.recv().await,
            };
            let item = match ev {
                Some(ev) => next_message(&mut s, ev),
                None => {
                    s.done = true;
                    Err(Status::internal("the engine dropped the request"))
                }
            };
            Some((item, s))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn health(&self, _request: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        let info = self.engine.model_info();
        let lora = self.engine.lora_registry();
        Ok(Response::new(HealthResponse {
            // A worker whose engine died answers, but serves nothing: routers take it out of placement.
            ready: self.engine.is_running(),
            model: info.model_id.clone(),
            context_length: u32::try_from(info.context_length).unwrap_or(u32::MAX),
            block_size: u32::try_from(info.block_size).unwrap_or(u32::MAX),
            kv_group_size: u32::try_from(info.layout().group_size()).unwrap_or(u32::MAX),
            worker_id: self.worker_id.clone(),
            role: self.role.clone(),
            lora_adapters: lora.list_with_origin().iter().map(|(a, origin)| lora_info(a, *origin)).collect(),
            lora_on_demand: lora.on_demand(),
            lora_available: lora.available().to_vec(),
            max_loras: u32::try_from(lora.max_loaded()).unwrap_or(u32::MAX),
            lora_load_seconds: lora.mean_load_seconds(),
            scheduling_policy: self.engine.scheduling_policy().name().to_string(),
            boot_id: self.boot_id,
        }))
    }

    async fn stats(&self, _request: Request<StatsRequest>) -> Result<Response<StatsResponse>, Status> {
        let s = self.engine.stats();
        let p = self.peer_counters.snapshot();
        let r = self.report_progress.snapshot();
        let lora = self.engine.lora_registry().counters();
        Ok(Response::new(StatsResponse {
            blocks_total: s.blocks_total,
            blocks_used: s.blocks_used,
            blocks_free: s.blocks_total.saturating_sub(s.blocks_used),
            blocks_cached: s.blocks_cached_free,
            running: s.running,
            waiting: s.waiting,
            computed_tokens_total: s.computed_tokens_total,
            cached_tokens_total: s.cached_tokens_total,
            evictions: PolicyKind::ALL
                .iter()
                .filter(|k| s.evicted_slots[k.index()] > 0 || s.evicted_blocks[k.index()] > 0)
                .map(|k| PolicyEvictions {
                    policy: k.name().to_owned(),
                    evicted_slots: s.evicted_slots[k.index()],
                    freed_blocks: s.evicted_blocks[k.index()],
                })
                .collect(),
            preemptions_total: s.preemptions_total,
            steps_total: s.steps_total,
            step_sequences_total: s.step_seqs_total,
            spec_draft_tokens_total: s.draft_tokens_total,
            spec_accepted_tokens_total: s.accepted_draft_tokens_total,
            spec_drafts_total: s.drafts_total,
            tiers: s
                .tier_usage
                .iter()
                .map(|u| pb::TierUsage {
                    tier: u.tier.name().to_owned(),
                    codec: u.codec.to_string(),
                    used_bytes: u.used_bytes,
                    capacity_bytes: u.capacity_bytes,
                })
                .collect(),
            prefix_hits: Tier::ALL
                .iter()
                .map(|t| pb::TierHits { tier: t.name().to_owned(), tokens: s.prefix_hit_tokens[t.index()] })
                .collect(),
            offloaded_groups_total: s.offloaded_groups,
            disk_corrupted_total: s.disk_corrupted,
            peer_fetched_blocks_total: p.fetched_blocks,
            peer_fetched_bytes_total: p.fetched_bytes,
            peer_fetch_failures_total: p.fetch_failures,
            peer_fetches_total: p.fetches,
            peer_fetch_seconds_total: p.fetch_seconds,
            peer_served_blocks_total: p.served_blocks,
            peer_served_bytes_total: p.served_bytes,
            peer_linked_fetches_total: p.linked_fetches,
            peer_link_refusals_total: p.link_refusals,
            peer_refused_hints_total: p.refused_hints,
            report_epoch: r.epoch,
            report_acked_seq: r.acked_seq,
            report_snapshots_total: r.snapshots,
            disk_errors_total: s.disk_errors,
            disk_full_total: s.disk_full,
            refused_imports_total: s.refused_imports,
            undecodable_groups_total: s.undecodable_groups,
            evicpress: s.evicpress.as_ref().map(evicpress_stats),
            lora_loads_total: lora.loads,
            lora_on_demand_loads_total: lora.on_demand_loads,
            lora_evictions_total: lora.evictions,
            lora_load_seconds_total: lora.load_seconds,
            prefill_tokens_per_s: s.prefill_tokens_per_s,
            kv_group_bytes: s.kv_group_bytes,
            load_bandwidth: [Tier::Host, Tier::Disk]
                .into_iter()
                .filter(|t| s.load_bytes_per_s[t.index()] > 0.0)
                .map(|t| pb::TierBandwidth { tier: t.name().to_owned(), bytes_per_s: s.load_bytes_per_s[t.index()] })
                // Only a worker that pulls from peers has a peer link to price.
                .chain(
                    self.peer
                        .as_ref()
                        .map(|f| pb::TierBandwidth { tier: "peer".to_owned(), bytes_per_s: f.peer_bytes_per_s() }),
                )
                .collect(),
        }))
    }

    async fn residency(
        &self,
        request: Request<pb::ResidencyRequest>,
    ) -> Result<Response<pb::ResidencyResponse>, Status> {
        let req = request.into_inner();
        let after = match &req.after {
            None => None,
            Some(c) => {
                let tier = Tier::ALL.into_iter().find(|t| t.name() == c.tier).ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "after.tier must be device, host or disk, got {:?}",
                        c.tier.chars().take(16).collect::<String>()
                    ))
                })?;
                Some((c.hash, tier))
            }
        };
        let (max_groups, max_bytes) = self.residency_page;
        let limit = match usize::try_from(req.limit) {
            Ok(0) | Err(_) => max_groups,
            Ok(n) => n.min(max_groups),
        };
        let Ok(_walk) = self.residency_walk.try_acquire() else {
            let mut status = Status::resource_exhausted("a Residency snapshot is being taken already");
            status
                .metadata_mut()
                .insert(pagoda_proto::BUSY_RETRY_AFTER_MS, MetadataValue::from_static(RESIDENCY_BUSY_RETRY_AFTER_MS));
            return Err(status);
        };
        // Every page walks the whole engine (its tiers are hash maps, with no order to resume in): the pages
        // cost that many walks, one at a time, instead of one message too large for the caller.
        let snap = self.engine.residency_snapshot().await.map_err(|e| Status::unavailable(e.to_string()))?;
        let (groups, next) = residency_page(snap.blocks, after, limit, max_bytes);
        Ok(Response::new(pb::ResidencyResponse { seq: snap.seq, groups, next }))
    }

    async fn load_lora(&self, request: Request<pb::LoadLoraRequest>) -> Result<Response<pb::LoadLoraResponse>, Status> {
        let pb::LoadLoraRequest { name, path, replace } = request.into_inner();
        let engine = self.engine.clone();
        // Reading an adapter's weights (up to 2 GiB) must not hold a runtime thread. The blocking task runs to the
        // end even when the caller goes away, so a replace is never left half done.
        let loaded = tokio::task::spawn_blocking(move || {
            if replace {
                engine.lora_registry().replace(&name, &path).map_err(EngineError::Lora)
            } else {
                engine.load_lora(&name, &path)
            }
        })
        .await
        .map_err(|e| Status::internal(format!("loading the adapter panicked: {e}")))?;
        let adapter = loaded.map_err(|e| status_from_engine(&e))?;
        Ok(Response::new(pb::LoadLoraResponse { adapter: Some(lora_info(&adapter, Origin::Admin)) }))
    }

    async fn unload_lora(
        &self,
        request: Request<pb::UnloadLoraRequest>,
    ) -> Result<Response<pb::UnloadLoraResponse>, Status> {
        self.engine.unload_lora(&request.into_inner().name).map_err(|e| status_from_engine(&e))?;
        Ok(Response::new(pb::UnloadLoraResponse {}))
    }
}

/// One `Residency` page out of a snapshot's `blocks`: the stored groups after `after` in (hash, tier) order, at
/// most `limit` of them (at least one) and, past the first, at most `max_bytes` of them encoded; with the cursor of
/// its last group when more remain.
fn residency_page(
    blocks: Vec<BlockChange>,
    after: Option<(u64, Tier)>,
    limit: usize,
    max_bytes: usize,
) -> (Vec<pb::ResidentGroup>, Option<pb::ResidencyCursor>) {
    let mut rest: Vec<(u64, Tier, std::borrow::Cow<'static, str>, u64)> = blocks
        .into_iter()
        .filter_map(|c| match c {
            BlockChange::Stored { hash, tier, codec, bytes } if after.is_none_or(|a| (hash, tier) > a) => {
                Some((hash, tier, codec, bytes))
            }
            _ => None,
        })
        .collect();
    let limit = limit.max(1);
    let mut more = rest.len() > limit;
    if more {
        // The page's groups only need sorting, not the whole walk's.
        rest.select_nth_unstable_by_key(limit, |g| (g.0, g.1));
        rest.truncate(limit);
    }
    rest.sort_unstable_by_key(|g| (g.0, g.1));
    let mut groups = Vec::with_capacity(rest.len());
    let mut encoded = 0;
    for (hash, tier, codec, bytes) in rest {
        let g = pb::ResidentGroup { hash, tier: tier.name().to_owned(), codec: codec.into_owned(), bytes };
        let len = prost::Message::encoded_len(&g);
        // The field's tag, the length prefix, the message.
        let framed = 1 + prost::length_delimiter_len(len) + len;
        if encoded + framed > max_bytes && !groups.is_empty() {
            more = true;
            break;
        }
        encoded += framed;
        groups.push(g);
    }
    let next =
        if more { groups.last().map(|g| pb::ResidencyCursor { hash: g.hash, tier: g.tier.clone() }) } else { None };
    (groups, next)
}

/// An adapter as `Health` and `LoadLora` describe it.
fn lora_info(a: &LoraAdapter, origin: Origin) -> pb::LoraAdapterInfo {
    pb::LoraAdapterInfo {
        name: a.name().to_string(),
        cache_id: a.cache_id().to_string(),
        rank: u32::try_from(a.rank()).unwrap_or(u32::MAX),
        on_demand: origin == Origin::OnDemand,
    }
}

/// EvicPress's planner state as the `Stats` RPC carries it: placed contexts for the tiers below the device, and
/// the mean quality of the variants measured so far.
fn evicpress_stats(e: &EvicPressStats) -> pb::EvicPressStats {
    pb::EvicPressStats {
        contexts: e.contexts,
        placed: [Tier::Host, Tier::Disk]
            .iter()
            .map(|t| pb::TierContexts { tier: t.name().to_owned(), contexts: e.placed[t.index()] })
            .collect(),
        profiles_total: e.profiles,
        spot_checks_total: e.spot_checks,
        reprofiles_total: e.reprofiles,
        profile_seconds_total: e.profile_ms as f64 / 1e3,
        placed_with_prior_total: e.placed_with_prior,
        compressed_total: e.compressed,
        moved_down_total: e.moved_down,
        dropped_total: e.dropped,
        pruned_onboards_total: e.pruned_onboards,
        lost_copies_total: e.lost_copies,
        upgrades_total: e.upgrades,
        profiles_on_own_queries_total: e.profiles_on_own_queries,
        pending: e.pending,
        answer_horizon: e.answer_horizon,
        profile_questions: e.profile_questions,
        variants: e
            .variants
            .iter()
            .zip(&e.mean_quality)
            .enumerate()
            .filter_map(|(i, (v, q))| {
                q.map(|q| pb::VariantQuality {
                    variant: v.clone(),
                    mean_quality: q,
                    mean_embedding_similarity: e.mean_embedding_similarity.get(i).copied().flatten(),
                })
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt;
    use pagoda_proto::worker::SamplingParams as PbSampling;

    use super::*;
    use crate::engine::{Engine, EngineConfig, FakeRunner};

    fn service(num_blocks: usize, delay_ms: u64) -> WorkerService {
        let cfg = EngineConfig { block_size: 4, num_blocks, ..EngineConfig::default() };
        let engine =
            Engine::start_with(cfg, move |_| Ok(FakeRunner::new(1000, num_blocks, Duration::from_millis(delay_ms))))
                .expect("fake engine starts");
        WorkerService::new(engine)
    }

    fn request(prompt: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
        pb::GenerateRequest {
            request_id: "r".into(),
            prompt_token_ids: prompt,
            max_tokens,
            sampling: Some(PbSampling { temperature: 0.0, top_p: 1.0, ..Default::default() }),
            stop_token_ids: vec![],
            namespace: "ns".into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn generate_streams_tokens_then_finish_with_usage() {
        let svc = service(256, 0);
        let mut stream = svc.generate(Request::new(request(vec![1, 2, 3], 5))).await.unwrap().into_inner();
        let mut tokens = Vec::new();
        let mut finished = None;
        while let Some(msg) = stream.next().await {
            let msg = msg.unwrap();
            assert!(finished.is_none(), "nothing may follow the finish message");
            tokens.extend(msg.token_ids);
            finished = msg.finished;
        }
        let f = finished.expect("a finish message");
        assert_eq!(f.reason, pb::FinishReason::Length as i32);
        let u = f.usage.unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (3, 5));
        assert_eq!(tokens.len(), 5);
        // The fake model's greedy continuation: token = (position + last) % vocab.
        assert_eq!(tokens[0], 6);
    }

    #[tokio::test]
    async fn invalid_requests_are_invalid_argument() {
        let svc = service(256, 0);
        let too_long = vec![1; 64];
        let mut bad_temp = request(vec![1], 1);
        bad_temp.sampling = Some(PbSampling { temperature: f32::NAN, top_p: 1.0, ..Default::default() });
        let mut bad_top_p = request(vec![1], 1);
        bad_top_p.sampling = Some(PbSampling { temperature: 1.0, top_p: 1.5, ..Default::default() });
        let biased = |logit_bias: Vec<(u32, f32)>| {
            let mut r = request(vec![1], 1);
            let logit_bias = logit_bias.into_iter().map(|(token_id, bias)| pb::LogitBias { token_id, bias }).collect();
            r.sampling = Some(PbSampling { temperature: 0.0, top_p: 1.0, logit_bias, ..Default::default() });
            r
        };
        let penalised = |presence_penalty: f32, prior_output_tokens: u32| {
            let mut r = request(vec![1, 2], 1);
            r.sampling = Some(PbSampling { presence_penalty, prior_output_tokens, ..Default::default() });
            r
        };
        let mut bad_stop = request(vec![1], 1);
        bad_stop.stop_token_ids = vec![5000];
        let mut allowed_outside_vocab = request(vec![1], 1);
        allowed_outside_vocab.sampling = Some(PbSampling { allowed_token_ids: vec![3, 5000], ..Default::default() });
        let banning = |words: Vec<Vec<u32>>| {
            let mut r = request(vec![1], 1);
            let bad_words = words.into_iter().map(|token_ids| pb::TokenSequence { token_ids }).collect();
            r.sampling = Some(PbSampling { bad_words, ..Default::default() });
            r
        };
        let mut long_id = request(vec![1], 1);
        long_id.request_id = "x".repeat(MAX_ID_BYTES + 1);
        let query = |token_ids: Vec<u32>| pb::ProfileQuery { token_ids };
        let mut empty_query = request(vec![1], 1);
        empty_query.kv_profile_queries = vec![query(vec![])];
        let mut query_outside_vocab = request(vec![1], 1);
        query_outside_vocab.kv_profile_queries = vec![query(vec![2, 5000])];
        let mut too_many_queries = request(vec![1], 1);
        too_many_queries.kv_profile_queries = vec![query(vec![2]); crate::placement::MAX_PROFILE_QUESTIONS + 1];
        let mut query_past_context = request(vec![1; 40], 1);
        query_past_context.kv_profile_queries = vec![query(vec![2; 20])];
        // This worker serves in arrival order (the default).
        let mut prioritised = request(vec![1], 1);
        prioritised.priority = -1;
        let mut unknown_codec = request(vec![1], 1);
        unknown_codec.kv_codec = "zstd".into();
        let mut heavy_weight = request(vec![1], 1);
        heavy_weight.tenant_weight = MAX_TENANT_WEIGHT + 1;
        let guided = |regex: &str, grammar: &str| {
            let mut r = request(vec![1], 1);
            r.sampling = Some(PbSampling { regex: regex.into(), grammar: grammar.into(), ..Default::default() });
            r
        };
        let namespaced = |namespace: String| {
            let mut r = request(vec![1], 1);
            r.namespace = namespace;
            r
        };
        let client_salted = |ns: &str, id: &str| crate::cache::salted_namespace(ns, crate::cache::CLIENT_SALT_KIND, id);
        for (name, req) in [
            ("empty prompt", request(vec![], 4)),
            ("prompt at context", request(too_long, 1)),
            ("token outside vocab", request(vec![1, 5000], 4)),
            ("max_tokens 0", request(vec![1], 0)),
            ("prompt + max_tokens over context", request(vec![1; 10], 60)),
            ("temperature NaN", bad_temp),
            ("top_p > 1", bad_top_p),
            ("logit_bias outside vocab", biased(vec![(5000, 1.0)])),
            ("logit_bias above 100", biased(vec![(3, 100.5)])),
            ("logit_bias NaN", biased(vec![(3, f32::NAN)])),
            ("logit_bias twice for a token", biased(vec![(3, 1.0), (3, -1.0)])),
            ("presence_penalty above 2", penalised(2.5, 0)),
            ("presence_penalty NaN", penalised(f32::NAN, 0)),
            ("prior output longer than the prompt", penalised(1.0, 3)),
            ("stop id outside vocab", bad_stop),
            ("allowed token outside vocab", allowed_outside_vocab),
            ("bad word outside vocab", banning(vec![vec![3, 5000]])),
            ("empty bad word", banning(vec![vec![]])),
            ("bad word of 33 tokens", banning(vec![vec![3; 33]])),
            ("request id too long", long_id),
            ("empty profile query", empty_query),
            ("profile query outside vocab", query_outside_vocab),
            ("nine profile queries", too_many_queries),
            ("profile query past the context", query_past_context),
            ("priority without priority scheduling", prioritised),
            ("unknown kv codec", unknown_codec),
            ("tenant weight above 1000", heavy_weight),
            ("grammar without a root rule", guided("", "start ::= \"a\"")),
            ("grammar and regex at once", guided("a", "root ::= \"a\"")),
            // Adapter `sql`'s namespace for tenant ns: the base model's KV would land in that adapter's cache.
            ("namespace spelling an adapter's salt", namespaced(cache_namespace("ns", "sql@00ff"))),
            ("adapter salt after a client salt", namespaced(cache_namespace(&client_salted("ns", "0f"), "sql@00ff"))),
            ("namespace salted twice", namespaced(client_salted(&client_salted("ns", "0f"), "1e"))),
            ("namespace with a control character", namespaced("ns\n".into())),
        ] {
            let err = svc.generate(Request::new(req)).await.err().unwrap_or_else(|| panic!("{name} accepted"));
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{name}: {err:?}");
        }
        // Within bounds, training queries ride along with the request.
        let mut with_queries = request(vec![1, 2, 3], 2);
        with_queries.kv_profile_queries = vec![query(vec![4, 5]), query(vec![6; 8])];
        assert!(svc.generate(Request::new(with_queries)).await.is_ok());
        // The router's cache_salt namespace is the one salted form a request may bring.
        assert!(svc.generate(Request::new(namespaced(client_salted("ns", "0f")))).await.is_ok());
    }

    /// A guide compiles only once the request is admitted: a refused request costs no compile (up to ~0.1 s of a
    /// runtime thread each), so even a broken guide is refused as busy first.
    #[tokio::test]
    async fn a_guided_request_is_admitted_before_its_guide_compiles() {
        let svc = service(256, 20).with_admission(AdmissionLimits { max_requests: 1, max_queued_prompt_tokens: 1000 });
        let held = svc.generate(Request::new(request(vec![1, 2], 3))).await.unwrap().into_inner();
        let mut broken = request(vec![1], 1);
        broken.sampling = Some(PbSampling { grammar: "start ::= \"a\"".into(), ..Default::default() });
        let err = svc.generate(Request::new(broken.clone())).await.err().expect("refused while full");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
        assert!(busy_hint(&err).is_some(), "{err:?}");
        drop(held);
        let err = svc.generate(Request::new(broken)).await.err().expect("refused once admitted");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    }

    #[tokio::test]
    async fn one_residency_snapshot_at_a_time() {
        // Steps of 100 ms: the engine answers a snapshot only between them.
        let svc = service(256, 100);
        let mut done =
            svc.generate(Request::new(request(vec![1, 2, 3, 4, 5, 6, 7, 8, 9], 1))).await.unwrap().into_inner();
        while let Some(m) = done.next().await {
            m.unwrap();
        }
        let mut running = svc.generate(Request::new(request(vec![9, 8, 7], 40))).await.unwrap().into_inner();
        assert!(!running.next().await.unwrap().unwrap().token_ids.is_empty());
        let first = tokio::spawn({
            let svc = svc.clone();
            async move { svc.residency(Request::new(pb::ResidencyRequest::default())).await }
        });
        for _ in 0..10_000 {
            if svc.residency_walk.available_permits() == 0 {
                break;
            }
            tokio::task::yield_now().await;
        }
        let err =
            svc.residency(Request::new(pb::ResidencyRequest::default())).await.expect_err("a second walk at once");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
        assert!(busy_hint(&err).is_some(), "{err:?}");
        let snap = first.await.unwrap().expect("the first walk answers").into_inner();
        assert!(!snap.groups.is_empty(), "the first request's prompt is cached");
        // Done, it lets the next one through.
        assert!(svc.residency(Request::new(pb::ResidencyRequest::default())).await.is_ok());
        drop(running);
    }

    /// A residency of more groups than one message a default gRPC client takes (4 MiB) comes back whole over a
    /// real connection, page after page, in (hash, tier) order; each page stays under its byte bound, and a
    /// lowered bound or a caller's `limit` only makes more pages.
    #[tokio::test]
    async fn a_residency_larger_than_a_message_comes_back_whole_in_pages() {
        use crate::tiers::{EncodedGroup, TierConfig, native};
        use pagoda_proto::worker::worker_client::WorkerClient;

        let tiers = TierConfig { data_dir: None, host_bytes: 128 << 20, disk_bytes: 0 };
        let cfg = EngineConfig { block_size: 4, num_blocks: 64, tiers, ..EngineConfig::default() };
        let engine = Engine::start_with(cfg, |_| Ok(FakeRunner::new(32, 64, Duration::ZERO))).unwrap();
        let info = engine.model_info().clone();
        let bytes = native::group_bytes(info.layout().group_size(), info.block_size, info.head_dim, info.kv_dtype);
        let codec = native::codec_name(info.kv_dtype);
        // ~27 bytes each encoded (a full 64-bit hash): 160k groups are over 4 MiB in one message.
        let n = 160_000u64;
        let hash = |i: u64| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1 << 63;
        for chunk in (0..n).collect::<Vec<_>>().chunks(20_000) {
            let groups = chunk.iter().map(|&i| (hash(i), EncodedGroup { codec: codec.into(), bytes: vec![0; bytes] }));
            assert_eq!(engine.import_groups(groups.collect()).await.unwrap(), chunk.len());
        }
        let mut want: Vec<(u64, String)> = (0..n).map(|i| (hash(i), "host".to_owned())).collect();
        want.sort();

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let svc = WorkerService::new(engine.clone());
        let small = WorkerService { residency_page: (1000, 8 << 10), ..svc.clone() };
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        tokio::spawn(tonic::transport::Server::builder().add_service(svc.into_server()).serve_with_incoming(incoming));
        let mut client = WorkerClient::connect(format!("http://{addr}")).await.unwrap();
        let mut got = Vec::new();
        let mut after = None;
        let mut pages = 0;
        loop {
            let page = client.residency(pb::ResidencyRequest { after, limit: 0 }).await.unwrap().into_inner();
            pages += 1;
            let size = prost::Message::encoded_len(&page);
            assert!(size <= MAX_RESIDENCY_PAGE_BYTES + 64, "page {pages}: {size} bytes");
            assert!(page.groups.len() <= MAX_RESIDENCY_PAGE_GROUPS);
            got.extend(page.groups.into_iter().map(|g| (g.hash, g.tier)));
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        assert!(pages > 1, "one page held {} groups", got.len());
        assert!(got == want, "the pages hold every group once, in order ({} of {n})", got.len());

        // A lowered bound, by bytes before groups: each page under it.
        let mut after = None;
        let mut total = 0;
        for _ in 0..3 {
            let page = small.residency(Request::new(pb::ResidencyRequest { after, limit: 0 })).await.unwrap();
            let page = page.into_inner();
            assert!(prost::Message::encoded_len(&page) <= (8 << 10) + 64);
            assert!(!page.groups.is_empty() && page.groups.len() < 1000, "{} groups", page.groups.len());
            assert_eq!(page.groups[0].hash, want[total].0, "each page starts after the last");
            total += page.groups.len();
            after = page.next;
        }
        let three = small.residency(Request::new(pb::ResidencyRequest { after: None, limit: 3 })).await.unwrap();
        assert_eq!(three.get_ref().groups.len(), 3);
        let bad = pb::ResidencyRequest { after: Some(pb::ResidencyCursor { hash: 1, tier: "gpu".into() }), limit: 0 };
        let err = small.residency(Request::new(bad)).await.expect_err("no such tier");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        engine.shutdown();
    }

    /// A page's order breaks ties between tiers: a group on the device and in host around a page boundary is
    /// listed once per tier, and a byte bound smaller than one group still lists one per page.
    #[test]
    fn residency_pages_order_by_hash_then_tier() {
        let stored = |hash, tier| BlockChange::Stored { hash, tier, codec: "f16".into(), bytes: 10 };
        let blocks = || {
            vec![
                stored(9, Tier::Disk),
                stored(5, Tier::Host),
                BlockChange::Removed { hash: 1, tier: Tier::Host, codec: "f16".into() },
                stored(5, Tier::Device),
                stored(2, Tier::Host),
            ]
        };
        let key = |g: &pb::ResidentGroup| (g.hash, g.tier.clone());
        let (page, next) = residency_page(blocks(), None, 2, 1 << 20);
        assert_eq!(page.iter().map(key).collect::<Vec<_>>(), [(2, "host".into()), (5, "device".into())]);
        let next = next.expect("more to come");
        assert_eq!((next.hash, next.tier.as_str()), (5, "device"));
        let (page, next) = residency_page(blocks(), Some((5, Tier::Device)), 2, 1 << 20);
        assert_eq!(page.iter().map(key).collect::<Vec<_>>(), [(5, "host".into()), (9, "disk".into())]);
        assert!(next.is_none(), "the last page");
        let (page, next) = residency_page(blocks(), None, 0, 1);
        assert_eq!((page.len(), next.map(|c| c.hash)), (1, Some(2)), "one group at least, then a cursor");
        let (page, next) = residency_page(blocks(), Some((9, Tier::Disk)), 10, 1 << 20);
        assert!(page.is_empty() && next.is_none());
    }

    /// On a worker that reports to a kvstore, a peer hint is followed only when it names a worker the kvstore's
    /// worker table lists: a hint naming another address is not pulled from but counted, and its request is
    /// prefilled. A worker without a kvstore has no table to ask and follows every hint.
    #[tokio::test]
    async fn peer_hints_are_followed_only_to_workers_the_kvstore_lists() {
        use crate::reporter::{self, ReporterConfig};
        use crate::tiers::TierConfig;
        use crate::transfer::{PeerFetchConfig, PeerFetcher};

        let dir = std::env::temp_dir().join(format!("pagoda-worker-known-peers-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let kv = pagoda_kvstore::start_embedded(dir.clone(), "127.0.0.1:0".parse().unwrap()).await.unwrap();
        let kv_addr = kv.addr.to_string();
        // A listed peer that has gone away: a pull from it is tried and fails at once.
        let listed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().to_string();
        let unlisted = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().to_string();
        let mut kv_client = pagoda_kvstore::Client::new(vec![kv_addr.clone()]).unwrap();
        let started = Instant::now();
        while let Err(e) = kv_client.register("peer-a", &listed, 1).await {
            assert!(started.elapsed() < Duration::from_secs(30), "the kvstore never took a registration: {e}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        let tiers = TierConfig { data_dir: None, host_bytes: 1 << 20, disk_bytes: 0 };
        let cfg = EngineConfig { block_size: 4, num_blocks: 64, tiers, ..EngineConfig::default() };
        let engine = Engine::start_with(cfg, |_| Ok(FakeRunner::new(32, 64, Duration::ZERO))).unwrap();
        let service = || {
            let counters = Arc::new(PeerCounters::default());
            let fetcher = PeerFetcher::new(engine.clone(), counters.clone(), PeerFetchConfig::default());
            WorkerService::new(engine.clone()).with_peer_counters(counters).with_peer_fetch(fetcher)
        };
        let mut rc = ReporterConfig::new(
            "me".into(),
            "127.0.0.1:1".into(),
            pagoda_kvstore::Endpoints::fixed(vec![kv_addr.clone()]),
        );
        rc.peers_every = Duration::from_millis(50);
        let reporter = reporter::spawn(engine.clone(), rc).unwrap();
        assert!(!reporter.progress.peers().admits(&listed), "nothing is known before the table is read");
        while !reporter.progress.peers().admits(&listed) {
            assert!(started.elapsed() < Duration::from_secs(30), "the worker table was never read");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let svc = service().with_report_progress(reporter.progress.clone());
        // Two full blocks of a prompt this worker does not hold, each request its own.
        let hinted = |first: u32, address: &str| {
            let mut r = request((first..first + 9).collect(), 2);
            r.peer_hint = Some(pb::PeerHint { address: address.into(), blocks: 2, remote_prefill: true });
            r
        };
        let finish = |svc: &WorkerService, req| {
            let svc = svc.clone();
            async move {
                let mut stream = svc.generate(Request::new(req)).await.unwrap().into_inner();
                let mut finished = false;
                while let Some(m) = stream.next().await {
                    finished |= m.unwrap().finished.is_some();
                }
                assert!(finished, "the request runs to its end");
                svc.stats(Request::new(StatsRequest {})).await.unwrap().into_inner()
            }
        };
        let s = finish(&svc, hinted(1, &unlisted)).await;
        assert_eq!((s.peer_fetches_total, s.peer_refused_hints_total), (0, 1), "an unlisted peer is not pulled from");
        let s = finish(&svc, hinted(11, &format!("http://{listed}"))).await;
        assert_eq!((s.peer_fetches_total, s.peer_refused_hints_total), (1, 1), "a listed peer is");
        assert_eq!(s.peer_fetch_failures_total, 1, "it has gone away: the request prefilled");

        let s = finish(&service(), hinted(21, &unlisted)).await;
        assert_eq!((s.peer_fetches_total, s.peer_refused_hints_total), (1, 0), "without a kvstore, every hint");
        reporter.task.abort();
        engine.shutdown();
        kv.stop().await.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn busy_hint(err: &Status) -> Option<u64> {
        err.metadata().get(pagoda_proto::BUSY_RETRY_AFTER_MS)?.to_str().ok()?.parse().ok()
    }

    #[tokio::test]
    async fn worker_at_its_request_limit_refuses_as_busy_until_a_stream_ends() {
        let svc = service(256, 20).with_admission(AdmissionLimits { max_requests: 2, max_queued_prompt_tokens: 1000 });
        let a = svc.generate(Request::new(request(vec![1, 2], 3))).await.unwrap().into_inner();
        let mut b = svc.generate(Request::new(request(vec![3, 4], 3))).await.unwrap().into_inner();
        let err = svc.generate(Request::new(request(vec![5], 3))).await.err().expect("third request refused");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
        assert!(busy_hint(&err).is_some_and(|ms| ms >= 1000), "busy hint: {err:?}");
        assert_eq!(svc.refused_busy(), 1);
        // Started is not done: a streaming request holds its place until its stream ends.
        assert!(!b.next().await.unwrap().unwrap().token_ids.is_empty());
        assert!(svc.generate(Request::new(request(vec![5], 3))).await.is_err());
        while let Some(m) = b.next().await {
            m.unwrap();
        }
        drop(b);
        assert!(svc.generate(Request::new(request(vec![5], 3))).await.is_ok(), "b's place came back");
        drop(a);
        // A request that can never fit the pool is not "busy": no hint, so the router does not retry it elsewhere.
        let too_big = service(8, 0).generate(Request::new(request(vec![1; 10], 10))).await.err().unwrap();
        assert_eq!(busy_hint(&too_big), None);
    }

    #[tokio::test]
    async fn queued_prompt_tokens_are_bounded_but_a_lone_request_always_enters() {
        let svc = service(256, 200).with_admission(AdmissionLimits { max_requests: 100, max_queued_prompt_tokens: 10 });
        // Alone, a prompt longer than the token bound still enters ...
        let long = svc.generate(Request::new(request(vec![1; 12], 2))).await.unwrap().into_inner();
        // ... but nothing else while it waits.
        let err = svc.generate(Request::new(request(vec![1], 2))).await.err().expect("refused behind the long one");
        assert!(busy_hint(&err).is_some(), "{err:?}");
        // A refused or finished request leaves no trace in the counters.
        drop(long);
        let mut ok = None;
        for _ in 0..100 {
            if let Ok(s) = svc.generate(Request::new(request(vec![1; 6], 2))).await {
                ok = Some(s);
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut s = ok.expect("room again once the long request's stream is gone").into_inner();
        let refused = svc.generate(Request::new(request(vec![1; 5], 2))).await.err().expect("6 + 5 > 10");
        assert!(busy_hint(&refused).is_some());
        while let Some(m) = s.next().await {
            m.unwrap();
        }
        assert!(svc.generate(Request::new(request(vec![1; 5], 2))).await.is_ok());
    }

    #[tokio::test]
    async fn request_larger_than_pool_is_invalid_argument() {
        // 8 blocks of 4 slots over 2 layers x 2 kv-heads: room for 8 tokens in all. No wait frees more than the
        // pool holds, so this is the request's fault, not a load condition to retry (and carries no busy hint).
        let svc = service(8, 0);
        let err = svc.generate(Request::new(request(vec![1; 10], 10))).await.err().expect("rejected");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(busy_hint(&err).is_none());
        assert!(err.message().contains("max_tokens"), "{err:?}");
    }

    #[tokio::test]
    async fn dropping_the_stream_cancels_and_frees_blocks() {
        let svc = service(256, 10);
        let mut stream = svc.generate(Request::new(request(vec![1, 2, 3, 4, 5], 50))).await.unwrap().into_inner();
        let first = stream.next().await.unwrap().unwrap();
        assert!(!first.token_ids.is_empty());
        let stats = svc.stats(Request::new(StatsRequest {})).await.unwrap().into_inner();
        assert_eq!(stats.running, 1);
        assert!(stats.blocks_used > 0);
        drop(stream);
        for _ in 0..200 {
            let s = svc.stats(Request::new(StatsRequest {})).await.unwrap().into_inner();
            if s.running == 0 && s.waiting == 0 && s.blocks_used == 0 {
                assert_eq!(s.blocks_free, s.blocks_total);
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("request still holds blocks after its stream was dropped");
    }

    #[tokio::test]
    async fn health_reports_the_model() {
        let svc = service(256, 0);
        let h = svc.health(Request::new(HealthRequest {})).await.unwrap().into_inner();
        assert!(h.ready);
        assert_eq!(h.model, "fake");
        assert_eq!(h.context_length, 64);
        assert_eq!(h.block_size, 4);
        svc.engine.shutdown();
        let h = svc.health(Request::new(HealthRequest {})).await.unwrap().into_inner();
        assert!(!h.ready, "an engine that stopped is not ready");
    }
}
