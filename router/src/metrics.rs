//! Router metrics in Prometheus/OpenMetrics text (prometheus-client), named `pagoda_router_<what>_<unit>`:
//! requests by endpoint and status, TTFT and inter-token latency, prompt/completion tokens, placements, and worker
//! occupancy from the workers' `Stats` (the [`crate::stats_cache`] snapshot the dashboard shares, at most a second
//! old). The `/v1` requests and latencies also feed the dashboard's [`Timeline`] of recent windows.

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use pagoda_proto::worker::StatsResponse;

use crate::stats_cache::StatsSnapshot;
use crate::timeline::Timeline;
use crate::workers::WorkerPool;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    pub worker: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GuideLabels {
    /// `json_object`, `json_schema`, `regex` (with `guided_choice`), `grammar` or `tool_call`.
    pub guide: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoraLabels {
    /// An adapter name some worker announced (the router checks the request's `model` against them first, so the
    /// label takes only those values).
    pub adapter: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantTokenLabels {
    /// The API key's tenant (`default` with auth off): one value per tenant of the keys file.
    pub tenant: String,
    /// `prompt` or `completion`.
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RateLimitLabels {
    pub tenant: String,
    /// `rate` or `concurrency`.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MigrationLabels {
    /// `stall`, `first_token_timeout`, `stream_error`, `stream_ended`, `unavailable`, `cancelled`, `worker_error`.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabels {
    pub worker: String,
    pub policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PlacementLabels {
    pub worker: String,
    pub strategy: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabels {
    pub worker: String,
    pub tier: String,
    pub codec: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerLabels {
    pub worker: String,
    /// `fetched` (pulled from other workers) or `served` (sent to them).
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierHitLabels {
    pub worker: String,
    pub tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EvicPressChangeLabels {
    pub worker: String,
    /// `compress` (in place), `move_down` (to the next tier), `drop` (below the last tier) or `upgrade` (recomputed
    /// instead of reused from a lossy copy, to be stored again at full precision).
    pub change: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VariantLabels {
    pub worker: String,
    /// The device format (lossless, such as `f16`), a codec, or `codec@keep-ratio` for a pruned copy.
    pub variant: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// The label sets a worker's gauges were given beyond its address (tiers, policies, variants: whatever its `Stats`
/// named), so that all of them can be removed when it leaves: a family cannot be searched by one label.
#[derive(Default)]
struct WorkerSeries {
    tiers: HashSet<TierLabels>,
    prefix_hits: HashSet<TierHitLabels>,
    evictions: HashSet<PolicyLabels>,
    evicpress_placed: HashSet<TierHitLabels>,
    evicpress_variants: HashSet<VariantLabels>,
}

/// A per-worker gauge family and the figure of `S` (a worker's `Stats`, or a part of it) that it mirrors: counts
/// (the worker's `u64`s, cast with `as`) and seconds.
type CountGauge<S> = (fn(&Metrics) -> &Family<WorkerLabels, Gauge>, fn(&S) -> u64);
type SecondsGauge<S> = (fn(&Metrics) -> &Family<WorkerLabels, FloatGauge>, fn(&S) -> f64);

/// The gauges labelled by worker alone, set from each worker's `Stats` (and all removed when it leaves).
const WORKER_GAUGES: [CountGauge<StatsResponse>; 20] = [
    (|m| &m.worker_used_blocks, |s| s.blocks_used),
    (|m| &m.worker_capacity_blocks, |s| s.blocks_total),
    (|m| &m.worker_running, |s| s.running),
    (|m| &m.worker_waiting, |s| s.waiting),
    (|m| &m.worker_preemptions, |s| s.preemptions_total),
    (|m| &m.worker_steps, |s| s.steps_total),
    (|m| &m.worker_step_sequences, |s| s.step_sequences_total),
    (|m| &m.worker_spec_draft_tokens, |s| s.spec_draft_tokens_total),
    (|m| &m.worker_spec_accepted_tokens, |s| s.spec_accepted_tokens_total),
    (|m| &m.worker_spec_drafts, |s| s.spec_drafts_total),
    (|m| &m.worker_lora_loads, |s| s.lora_loads_total),
    (|m| &m.worker_lora_on_demand_loads, |s| s.lora_on_demand_loads_total),
    (|m| &m.worker_lora_evictions, |s| s.lora_evictions_total),
    (|m| &m.worker_peer_fetch_failures, |s| s.peer_fetch_failures_total),
    (|m| &m.worker_peer_fetches, |s| s.peer_fetches_total),
    (|m| &m.worker_peer_linked_fetches, |s| s.peer_linked_fetches_total),
    (|m| &m.worker_peer_link_refusals, |s| s.peer_link_refusals_total),
    (|m| &m.worker_peer_refused_hints, |s| s.peer_refused_hints_total),
    (|m| &m.worker_refused_imports, |s| s.refused_imports_total),
    (|m| &m.worker_undecodable_groups, |s| s.undecodable_groups_total),
];
const WORKER_SECONDS_GAUGES: [SecondsGauge<StatsResponse>; 2] = [
    (|m| &m.worker_lora_load_seconds, |s| s.lora_load_seconds_total),
    (|m| &m.worker_peer_fetch_seconds, |s| s.peer_fetch_seconds_total),
];
/// The EvicPress gauges labelled by worker alone (`worker_evicpress_profile_seconds` is the one float beside them).
const EVICPRESS_GAUGES: [CountGauge<pagoda_proto::worker::EvicPressStats>; 4] = [
    (|m| &m.worker_evicpress_contexts, |e| e.contexts),
    (|m| &m.worker_evicpress_profiles, |e| e.profiles_total),
    (|m| &m.worker_evicpress_reprofiles, |e| e.reprofiles_total),
    (|m| &m.worker_evicpress_profiles_on_own_queries, |e| e.profiles_on_own_queries_total),
];

const PEER_DIRECTIONS: [&str; 2] = ["fetched", "served"];
const EVICPRESS_CHANGES: [&str; 4] = ["compress", "move_down", "drop", "upgrade"];

/// All router metrics and their registry.
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub queue: Histogram,
    pub prompt_tokens: Counter,
    pub completion_tokens: Counter,
    pub worker_ready: Family<WorkerLabels, Gauge>,
    pub worker_used_blocks: Family<WorkerLabels, Gauge>,
    pub worker_capacity_blocks: Family<WorkerLabels, Gauge>,
    pub worker_running: Family<WorkerLabels, Gauge>,
    pub worker_waiting: Family<WorkerLabels, Gauge>,
    /// The worker's cumulative eviction counters, by policy (gauges: the router mirrors the worker's totals).
    pub worker_evicted_tokens: Family<PolicyLabels, Gauge>,
    pub worker_evicted_blocks: Family<PolicyLabels, Gauge>,
    pub worker_preemptions: Family<WorkerLabels, Gauge>,
    /// Forward steps per worker since it started, and the sequences they computed: the mean batch is the rise of
    /// the second over the rise of the first.
    pub worker_steps: Family<WorkerLabels, Gauge>,
    pub worker_step_sequences: Family<WorkerLabels, Gauge>,
    /// Speculative decoding per worker: draft tokens computed and accepted since it started.
    pub worker_spec_draft_tokens: Family<WorkerLabels, Gauge>,
    pub worker_spec_accepted_tokens: Family<WorkerLabels, Gauge>,
    pub worker_spec_drafts: Family<WorkerLabels, Gauge>,
    /// LoRA adapters the worker loaded at run time (admin and on demand), those a request caused, and on-demand
    /// adapters it evicted to make room, since it started.
    pub worker_lora_loads: Family<WorkerLabels, Gauge>,
    pub worker_lora_on_demand_loads: Family<WorkerLabels, Gauge>,
    pub worker_lora_evictions: Family<WorkerLabels, Gauge>,
    pub worker_lora_load_seconds: Family<WorkerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// Requests refused by a key's limits, by tenant (bounded by the keys file) and reason.
    pub rate_limited: Family<RateLimitLabels, Counter>,
    /// Prompt and completion tokens per tenant: what fair and token-fair scheduling share out, and usage per tenant.
    pub tenant_tokens: Family<TenantTokenLabels, Counter>,
    /// The same counters by tenant, for the dashboard (a metric family cannot be listed): one entry per tenant
    /// that sent a request, so at most one per tenant of the keys file.
    tenant_counters: Mutex<BTreeMap<String, (Counter, Counter)>>,
    pub guided_requests: Family<GuideLabels, Counter>,
    /// Generation requests that ran with a LoRA adapter, by adapter.
    pub lora_requests: Family<LoraLabels, Counter>,
    /// KV bytes per tier (device, host, disk) and codec on the worker.
    pub worker_tier_used_bytes: Family<TierLabels, Gauge>,
    pub worker_tier_capacity_bytes: Family<TierLabels, Gauge>,
    /// The worker's cumulative prompt tokens served from a cached prefix, by the tier it came from.
    pub worker_prefix_hit_tokens: Family<TierHitLabels, Gauge>,
    /// The worker's peer tier (Transfer) since it started: block groups and bytes pulled and served, failed pulls,
    /// and the pulls' count and total seconds (their mean latency is the ratio).
    pub worker_peer_blocks: Family<PeerLabels, Gauge>,
    pub worker_peer_bytes: Family<PeerLabels, Gauge>,
    pub worker_peer_fetch_failures: Family<WorkerLabels, Gauge>,
    pub worker_peer_fetches: Family<WorkerLabels, Gauge>,
    pub worker_peer_linked_fetches: Family<WorkerLabels, Gauge>,
    pub worker_peer_link_refusals: Family<WorkerLabels, Gauge>,
    pub worker_peer_refused_hints: Family<WorkerLabels, Gauge>,
    pub worker_refused_imports: Family<WorkerLabels, Gauge>,
    pub worker_undecodable_groups: Family<WorkerLabels, Gauge>,
    pub worker_peer_fetch_seconds: Family<WorkerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// EvicPress placement on the worker (`--tier-placement evicpress`): contexts remembered and placed per tier,
    /// profiles and re-profiles since start with their wall time, Algorithm 1's changes since start, and each
    /// variant's mean profiled quality.
    pub worker_evicpress_contexts: Family<WorkerLabels, Gauge>,
    pub worker_evicpress_placed_contexts: Family<TierHitLabels, Gauge>,
    pub worker_evicpress_profiles: Family<WorkerLabels, Gauge>,
    pub worker_evicpress_reprofiles: Family<WorkerLabels, Gauge>,
    pub worker_evicpress_profiles_on_own_queries: Family<WorkerLabels, Gauge>,
    pub worker_evicpress_profile_seconds: Family<WorkerLabels, FloatGauge>,
    pub worker_evicpress_changes: Family<EvicPressChangeLabels, Gauge>,
    pub worker_evicpress_variant_quality: Family<VariantLabels, FloatGauge>,
    pub worker_evicpress_variant_embedding_similarity: Family<VariantLabels, FloatGauge>,
    /// Requests placed, by the worker chosen first and the strategy.
    pub placements: Family<PlacementLabels, Counter>,
    /// Time to choose a worker (gathering the workers' state and running the cost model).
    pub placement_decision: Histogram,
    /// Recent `/v1` requests and latencies in 5 s windows, for the dashboard.
    pub timeline: Timeline,
    /// Requests placed since start, over all workers and strategies (for the dashboard).
    placed: AtomicU64,
    /// Requests refused to shed load (503 + `Retry-After`), by where the limit was hit: `router_inflight` (this
    /// router's in-flight cap) or `workers_busy` (every candidate worker's admission queue was full).
    pub shed: Family<MigrationLabels, Counter>,
    /// Times a worker refused a request because its admission queue was full (the request tried the next one).
    pub worker_busy: Family<WorkerLabels, Counter>,
    /// Requests re-issued to another worker after theirs failed, by why.
    pub migrations: Family<MigrationLabels, Counter>,
    /// Disaggregated serving: prompts sent to a prefill worker before their request went to a decode worker, by
    /// how the prefill ended (`ok`; `busy`, `failed`, `timeout`, `cancelled`: the decode worker prefilled it
    /// itself), and `queue_full`: not sent, the prefill workers' queue being at its bound.
    pub remote_prefills: Family<OutcomeLabels, Counter>,
    /// Time from sending a prompt to a prefill worker to its KV being ready there (queueing included).
    pub remote_prefill: Histogram,
    /// 1 while a registered worker's block events and heartbeats have stopped reaching this router (the alarm).
    pub worker_reports_stale: Family<WorkerLabels, Gauge>,
    /// Seconds since each registered worker's last report reached this router.
    pub worker_report_age: Family<WorkerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// 1 while the kvstore watch stream is up.
    pub kvstore_watch_connected: Gauge,
    /// The last raft index this router applied from the kvstore.
    pub kvstore_applied_index: Gauge,
    /// Distinct block hashes in the router's residency index (reported and predicted).
    pub residency_index_blocks: Gauge,
    /// Workers registered in etcd that this router knows of (only with --etcd).
    pub registry_workers: Gauge,
    /// Workers that joined and left placement through the registry.
    pub registry_joined: Gauge,
    pub registry_left: Gauge,
    /// The workers scraped so far that are still in the pool, with their gauges' label sets, so that a worker
    /// that left the pool loses every gauge.
    scraped: Mutex<BTreeMap<String, WorkerSeries>>,
    /// The registered workers the directory feed reported last time, so that one that left loses its gauges.
    reported: Mutex<Vec<String>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("pagoda_router");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register("requests", "HTTP requests by endpoint and status code", requests.clone());
        // 1 ms .. ~33 s
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register_with_unit(
            "ttft",
            "Time from request arrival to the first token",
            Unit::Seconds,
            ttft.clone(),
        );
        // 0.5 ms .. ~8 s
        let inter_token = Histogram::new(exponential_buckets(0.0005, 2.0, 15));
        registry.register_with_unit(
            "inter_token_latency",
            "Time between consecutive tokens of one stream",
            Unit::Seconds,
            inter_token.clone(),
        );
        // 1 ms .. ~33 s
        let queue = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register_with_unit(
            "queue",
            "Time a request waited in its worker's queue before its first step (the worker's count, last attempt)",
            Unit::Seconds,
            queue.clone(),
        );
        let prompt_tokens = Counter::default();
        registry.register("prompt_tokens", "Prompt tokens sent to workers", prompt_tokens.clone());
        let completion_tokens = Counter::default();
        registry.register("completion_tokens", "Completion tokens received from workers", completion_tokens.clone());
        let worker_ready = Family::<WorkerLabels, Gauge>::default();
        registry.register("worker_ready", "1 when the worker's last health probe said ready", worker_ready.clone());
        let blocks = || Unit::Other("blocks".into());
        let worker_used_blocks = Family::<WorkerLabels, Gauge>::default();
        registry.register_with_unit(
            "worker_used",
            "KV blocks in use on the worker",
            blocks(),
            worker_used_blocks.clone(),
        );
        let worker_capacity_blocks = Family::<WorkerLabels, Gauge>::default();
        registry.register_with_unit(
            "worker_capacity",
            "KV blocks in the worker's pool",
            blocks(),
            worker_capacity_blocks.clone(),
        );
        let seqs = || Unit::Other("sequences".into());
        let worker_running = Family::<WorkerLabels, Gauge>::default();
        registry.register_with_unit(
            "worker_running",
            "Sequences running on the worker",
            seqs(),
            worker_running.clone(),
        );
        let worker_waiting = Family::<WorkerLabels, Gauge>::default();
        registry.register_with_unit(
            "worker_waiting",
            "Sequences waiting on the worker",
            seqs(),
            worker_waiting.clone(),
        );
        let worker_evicted_tokens = Family::<PolicyLabels, Gauge>::default();
        registry.register_with_unit(
            "worker_evicted",
            "KV token slots evicted on the worker since it started, by eviction policy",
            Unit::Other("tokens".into()),
            worker_evicted_tokens.clone(),
        );
        let worker_evicted_blocks = Family::<PolicyLabels, Gauge>::default();
        registry.register_with_unit(
            "worker_evicted",
            "KV blocks evictions returned to the worker's pool since it started, by eviction policy",
            Unit::Other("blocks".into()),
            worker_evicted_blocks.clone(),
        );
        let worker_preemptions = Family::<WorkerLabels, Gauge>::default();
        registry.register_with_unit(
            "worker_preemptions",
            "Sequences the worker preempted (recompute) since it started",
            Unit::Other("sequences".into()),
            worker_preemptions.clone(),
        );
        let worker_steps = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_steps",
            "Forward steps the worker's engine ran since it started",
            worker_steps.clone(),
        );
        let worker_step_sequences = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_step_sequences",
            "Sequences the worker's forward steps computed since it started, summed over steps (over worker_steps: the mean batch)",
            worker_step_sequences.clone(),
        );
        let worker_lora_loads = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_lora_loads",
            "LoRA adapters the worker loaded at run time (admin and on-demand loads) since it started",
            worker_lora_loads.clone(),
        );
        let worker_lora_on_demand_loads = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_lora_on_demand_loads",
            "LoRA adapters the worker loaded because a request named them (--lora-on-demand) since it started",
            worker_lora_on_demand_loads.clone(),
        );
        let worker_lora_evictions = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_lora_evictions",
            "On-demand LoRA adapters the worker evicted (least recently used, idle) to load another, since it started",
            worker_lora_evictions.clone(),
        );
        let worker_lora_load_seconds = Family::<WorkerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register_with_unit(
            "worker_lora_load",
            "Wall time of the worker's run-time LoRA adapter loads since start, in all",
            Unit::Seconds,
            worker_lora_load_seconds.clone(),
        );
        let worker_spec_draft_tokens = Family::<WorkerLabels, Gauge>::default();
        registry.register_with_unit(
            "worker_spec_draft",
            "Speculative draft tokens (n-gram) the worker computed since it started",
            Unit::Other("tokens".into()),
            worker_spec_draft_tokens.clone(),
        );
        let worker_spec_accepted_tokens = Family::<WorkerLabels, Gauge>::default();
        registry.register_with_unit(
            "worker_spec_accepted",
            "Speculative draft tokens the worker's sampler accepted since it started (each saved a decode step)",
            Unit::Other("tokens".into()),
            worker_spec_accepted_tokens.clone(),
        );
        let worker_spec_drafts = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_spec_drafts",
            "Speculative drafts the worker computed since it started (steps of a sequence that carried one)",
            worker_spec_drafts.clone(),
        );
        let rate_limited = Family::<RateLimitLabels, Counter>::default();
        registry.register(
            "rate_limited_requests",
            "Requests refused with 429 by their API key's rate or concurrency limit",
            rate_limited.clone(),
        );
        let tenant_tokens = Family::<TenantTokenLabels, Counter>::default();
        registry.register(
            "tenant_tokens",
            "Prompt and completion tokens of each tenant's requests (prompts counted once each when a worker takes them)",
            tenant_tokens.clone(),
        );
        let guided_requests = Family::<GuideLabels, Counter>::default();
        registry.register(
            "guided_requests",
            "Generation requests whose answer a guide constrains, by guide, counted once each when admitted",
            guided_requests.clone(),
        );
        let lora_requests = Family::<LoraLabels, Counter>::default();
        registry.register(
            "lora_requests",
            "Generation requests whose model is a LoRA adapter, by adapter, counted once each when admitted",
            lora_requests.clone(),
        );
        let worker_tier_used_bytes = Family::<TierLabels, Gauge>::default();
        registry.register_with_unit(
            "worker_tier_used",
            "KV bytes held on the worker, by tier (device, host, disk) and codec",
            Unit::Bytes,
            worker_tier_used_bytes.clone(),
        );
        let worker_tier_capacity_bytes = Family::<TierLabels, Gauge>::default();
        registry.register_with_unit(
            "worker_tier_capacity",
            "KV capacity of each of the worker's tiers, by tier and codec",
            Unit::Bytes,
            worker_tier_capacity_bytes.clone(),
        );
        let worker_prefix_hit_tokens = Family::<TierHitLabels, Gauge>::default();
        registry.register_with_unit(
            "worker_prefix_hit",
            "Prompt tokens the worker served from a cached prefix since it started, by the tier it was found in",
            Unit::Other("tokens".into()),
            worker_prefix_hit_tokens.clone(),
        );
        let worker_peer_blocks = Family::<PeerLabels, Gauge>::default();
        registry.register(
            "worker_peer_blocks",
            "KV block groups the worker pulled from (fetched) or sent to (served) other workers since it started",
            worker_peer_blocks.clone(),
        );
        let worker_peer_bytes = Family::<PeerLabels, Gauge>::default();
        registry.register_with_unit(
            "worker_peer",
            "Encoded KV bytes the worker pulled from (fetched) or sent to (served) other workers since it started",
            Unit::Bytes,
            worker_peer_bytes.clone(),
        );
        let worker_peer_fetch_failures = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_peer_fetch_failures",
            "Peer pulls that failed (unreachable, timeout, bad checksum) and fell back to prefill, since start",
            worker_peer_fetch_failures.clone(),
        );
        let worker_peer_fetches = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_peer_fetches",
            "Peer pulls the worker attempted since start",
            worker_peer_fetches.clone(),
        );
        let worker_peer_linked_fetches = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_peer_linked_fetches",
            "Peer pulls whose payloads came over an NCCL link between GPU workers, since start",
            worker_peer_linked_fetches.clone(),
        );
        let worker_peer_link_refusals = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_peer_link_refusals",
            "NCCL link opens that failed or that the peer refused (pulls stayed on gRPC), since start",
            worker_peer_link_refusals.clone(),
        );
        let worker_peer_refused_hints = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_peer_refused_hints",
            "Peer hints naming an address the kvstore lists for no worker (the prompt was prefilled), since start",
            worker_peer_refused_hints.clone(),
        );
        let worker_refused_imports = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_refused_imports",
            "Groups a peer sent that did not fit the model's shape (refused, then recomputed), since start",
            worker_refused_imports.clone(),
        );
        let worker_undecodable_groups = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_undecodable_groups",
            "Tier groups dropped because they failed to decode when onboarded (then recomputed), since start",
            worker_undecodable_groups.clone(),
        );
        let worker_peer_fetch_seconds = Family::<WorkerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register_with_unit(
            "worker_peer_fetch",
            "Wall time of the worker's peer pulls since start, in all",
            Unit::Seconds,
            worker_peer_fetch_seconds.clone(),
        );
        let worker_evicpress_contexts = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_evicpress_contexts",
            "Contexts EvicPress's planner remembers on the worker (bounded)",
            worker_evicpress_contexts.clone(),
        );
        let worker_evicpress_placed_contexts = Family::<TierHitLabels, Gauge>::default();
        registry.register(
            "worker_evicpress_placed_contexts",
            "Contexts EvicPress holds a copy of, by the tier the copy is on (host, disk)",
            worker_evicpress_placed_contexts.clone(),
        );
        let worker_evicpress_profiles = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_evicpress_profiles",
            "Contexts EvicPress profiled (every variant decoded and scored) while the worker was idle, since start",
            worker_evicpress_profiles.clone(),
        );
        let worker_evicpress_reprofiles = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_evicpress_reprofiles",
            "Profiles EvicPress ran again because a drift spot check found quality below the profile, since start",
            worker_evicpress_reprofiles.clone(),
        );
        let worker_evicpress_profiles_on_own_queries = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_evicpress_profiles_on_own_queries",
            "Profiles EvicPress scored on the context's own training queries (the kv.profile_queries of the request \
             that created it) instead of the worker's profiling questions, since start",
            worker_evicpress_profiles_on_own_queries.clone(),
        );
        let worker_evicpress_profile_seconds = Family::<WorkerLabels, FloatGauge>::default();
        registry.register_with_unit(
            "worker_evicpress_profile",
            "Wall time of EvicPress's profiles on the worker since start, in all",
            Unit::Seconds,
            worker_evicpress_profile_seconds.clone(),
        );
        let worker_evicpress_changes = Family::<EvicPressChangeLabels, Gauge>::default();
        registry.register(
            "worker_evicpress_changes",
            "Changes EvicPress applied since start: its greedy step's to make room on a full tier (compress, move_down, drop), and contexts recomputed from lossy copies (upgrade)",
            worker_evicpress_changes.clone(),
        );
        let worker_evicpress_variant_quality = Family::<VariantLabels, FloatGauge>::default();
        registry.register(
            "worker_evicpress_variant_quality",
            "Mean profiled quality (0..1) of each EvicPress variant on the worker, over the contexts measured so far",
            worker_evicpress_variant_quality.clone(),
        );
        let worker_evicpress_variant_embedding_similarity = Family::<VariantLabels, FloatGauge>::default();
        registry.register(
            "worker_evicpress_variant_embedding_similarity",
            "Mean embedding similarity (0..1, cosine of mean token embeddings) of each EvicPress variant's profiled \
             answers to the full-precision ones, over the contexts measured so far",
            worker_evicpress_variant_embedding_similarity.clone(),
        );
        let placements = Family::<PlacementLabels, Counter>::default();
        registry.register("placements", "Requests placed, by the worker chosen and the strategy", placements.clone());
        // 1 µs .. ~16 ms
        let placement_decision = Histogram::new(exponential_buckets(1e-6, 2.0, 15));
        registry.register_with_unit(
            "placement_decision",
            "Time to choose a worker for a request",
            Unit::Seconds,
            placement_decision.clone(),
        );
        let shed = Family::<MigrationLabels, Counter>::default();
        registry.register(
            "shed",
            "Requests refused with 503 and Retry-After to shed load, by the limit hit (router_inflight, workers_busy)",
            shed.clone(),
        );
        let worker_busy = Family::<WorkerLabels, Counter>::default();
        registry.register(
            "worker_busy",
            "Times a worker refused a request because its admission queue was full (the request tried another)",
            worker_busy.clone(),
        );
        let migrations = Family::<MigrationLabels, Counter>::default();
        registry.register(
            "migrations",
            "Requests re-issued (prompt + tokens so far) to another worker after theirs failed or stalled, by reason",
            migrations.clone(),
        );
        let remote_prefills = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "remote_prefills",
            "Prompts prefilled on a prefill worker and pulled by the decode worker (disaggregated serving), by outcome \
             (ok; busy, failed, timeout, cancelled: prefilled by the decode worker instead; queue_full: not sent, the \
             prefill worker's queue at --remote-prefill-max-queued-tokens)",
            remote_prefills.clone(),
        );
        // 10 ms .. ~160 s
        let remote_prefill = Histogram::new(exponential_buckets(0.01, 2.0, 15));
        registry.register_with_unit(
            "remote_prefill",
            "Time for a prefill worker to compute a disaggregated request's prompt, queueing included",
            Unit::Seconds,
            remote_prefill.clone(),
        );
        let worker_reports_stale = Family::<WorkerLabels, Gauge>::default();
        registry.register(
            "worker_reports_stale",
            "1 when a worker registered in the kvstore sent no block events or heartbeat for longer than the threshold",
            worker_reports_stale.clone(),
        );
        let worker_report_age = Family::<WorkerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register_with_unit(
            "worker_report_age",
            "Time since a registered worker's last report reached this router through the kvstore",
            Unit::Seconds,
            worker_report_age.clone(),
        );
        let kvstore_watch_connected = Gauge::default();
        registry.register(
            "kvstore_watch_connected",
            "1 while this router's kvstore watch stream is up (only with --kvstore)",
            kvstore_watch_connected.clone(),
        );
        let kvstore_applied_index = Gauge::default();
        registry.register(
            "kvstore_applied_index",
            "The last kvstore raft index this router applied",
            kvstore_applied_index.clone(),
        );
        let residency_index_blocks = Gauge::default();
        registry.register_with_unit(
            "residency_index",
            "Distinct block hashes in the router's residency index",
            Unit::Other("blocks".into()),
            residency_index_blocks.clone(),
        );
        let registry_workers = Gauge::default();
        registry.register(
            "registry_workers",
            "Workers registered in etcd under a live lease, as this router's registry watch sees them (only with --etcd)",
            registry_workers.clone(),
        );
        let registry_joined = Gauge::default();
        registry.register(
            "registry_joined",
            "Workers added to placement because they registered in etcd, since start",
            registry_joined.clone(),
        );
        let registry_left = Gauge::default();
        registry.register(
            "registry_left",
            "Workers removed from placement because their etcd lease expired or was revoked, since start",
            registry_left.clone(),
        );
        Metrics {
            registry_workers,
            registry_joined,
            registry_left,
            scraped: Mutex::new(BTreeMap::new()),
            reported: Mutex::new(Vec::new()),
            registry,
            placements,
            placement_decision,
            timeline: Timeline::new(),
            placed: AtomicU64::new(0),
            shed,
            worker_busy,
            migrations,
            remote_prefills,
            remote_prefill,
            worker_reports_stale,
            worker_report_age,
            worker_peer_blocks,
            worker_peer_bytes,
            worker_peer_fetch_failures,
            worker_peer_fetches,
            worker_peer_linked_fetches,
            worker_peer_link_refusals,
            worker_peer_refused_hints,
            worker_refused_imports,
            worker_undecodable_groups,
            worker_peer_fetch_seconds,
            worker_evicpress_contexts,
            worker_evicpress_placed_contexts,
            worker_evicpress_profiles,
            worker_evicpress_reprofiles,
            worker_evicpress_profiles_on_own_queries,
            worker_evicpress_profile_seconds,
            worker_evicpress_changes,
            worker_evicpress_variant_quality,
            worker_evicpress_variant_embedding_similarity,
            kvstore_watch_connected,
            kvstore_applied_index,
            residency_index_blocks,
            rate_limited,
            tenant_tokens,
            tenant_counters: Mutex::new(BTreeMap::new()),
            guided_requests,
            lora_requests,
            worker_tier_used_bytes,
            worker_tier_capacity_bytes,
            worker_prefix_hit_tokens,
            worker_evicted_tokens,
            worker_evicted_blocks,
            worker_preemptions,
            worker_steps,
            worker_step_sequences,
            worker_spec_draft_tokens,
            worker_spec_accepted_tokens,
            worker_spec_drafts,
            worker_lora_loads,
            worker_lora_on_demand_loads,
            worker_lora_evictions,
            worker_lora_load_seconds,
            requests,
            ttft,
            inter_token,
            queue,
            prompt_tokens,
            completion_tokens,
            worker_ready,
            worker_used_blocks,
            worker_capacity_blocks,
            worker_running,
            worker_waiting,
        }
    }

    pub fn count_request(&self, endpoint: &str, status: u16) {
        self.requests.get_or_create(&RequestLabels { endpoint: endpoint.to_string(), status }).inc();
        if endpoint.starts_with("/v1/") {
            self.timeline.record_request(status, Instant::now());
        }
    }

    /// The first token of a stream arrived `seconds` after its request.
    pub fn observe_ttft(&self, seconds: f64, at: Instant) {
        self.ttft.observe(seconds);
        self.timeline.record_ttft(seconds, at);
    }

    /// A token arrived `seconds` after the previous one of its stream.
    pub fn observe_inter_token(&self, seconds: f64, at: Instant) {
        self.inter_token.observe(seconds);
        self.timeline.record_inter_token(seconds, at);
    }

    /// A request was placed on `worker` (first choice) by `strategy`, which took `took`.
    pub fn count_placement(&self, worker: &str, strategy: &'static str, took: Duration) {
        self.placements.get_or_create(&PlacementLabels { worker: worker.to_string(), strategy }).inc();
        self.placement_decision.observe(took.as_secs_f64());
        self.placed.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests placed since start.
    pub fn placements_total(&self) -> u64 {
        self.placed.load(Ordering::Relaxed)
    }

    pub fn count_shed(&self, reason: &'static str) {
        self.shed.get_or_create(&MigrationLabels { reason }).inc();
    }

    pub fn count_worker_busy(&self, worker: &str) {
        self.worker_busy.get_or_create(&WorkerLabels { worker: worker.to_string() }).inc();
    }

    pub fn count_migration(&self, reason: &'static str) {
        self.migrations.get_or_create(&MigrationLabels { reason }).inc();
    }

    /// A request that would have gone to a prefill worker did not, because of `why` (`queue_full`).
    pub fn count_remote_prefill_skipped(&self, why: &'static str) {
        self.remote_prefills.get_or_create(&OutcomeLabels { outcome: why }).inc();
    }

    /// A remote prefill ended with `outcome` after `took`.
    pub fn count_remote_prefill(&self, outcome: &'static str, took: Duration) {
        self.remote_prefills.get_or_create(&OutcomeLabels { outcome }).inc();
        self.remote_prefill.observe(took.as_secs_f64());
    }

    pub fn count_guided(&self, guide: &'static str) {
        self.guided_requests.get_or_create(&GuideLabels { guide }).inc();
    }

    pub fn count_lora_request(&self, adapter: &str) {
        self.lora_requests.get_or_create(&LoraLabels { adapter: adapter.to_string() }).inc();
    }

    /// The counters of `tenant`'s prompt and completion tokens, to hold for a request's life (so counting a token
    /// is an atomic add, with no label lookup).
    pub fn tenant_token_counters(&self, tenant: &str) -> (Counter, Counter) {
        let mut known = self.tenant_counters.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(counters) = known.get(tenant) {
            return counters.clone();
        }
        let of =
            |kind| self.tenant_tokens.get_or_create(&TenantTokenLabels { tenant: tenant.to_string(), kind }).clone();
        let counters = (of("prompt"), of("completion"));
        known.insert(tenant.to_string(), counters.clone());
        counters
    }

    /// Every tenant that sent a request, with its prompt and completion tokens so far, by name.
    pub fn tenant_tokens_by_tenant(&self) -> Vec<(String, u64, u64)> {
        let known = self.tenant_counters.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        known.iter().map(|(t, (p, c))| (t.clone(), p.get(), c.get())).collect()
    }

    pub fn count_rate_limited(&self, tenant: &str, denied: crate::limits::Denied) {
        let reason = match denied {
            crate::limits::Denied::Rate { .. } => "rate",
            crate::limits::Denied::Concurrency { .. } => "concurrency",
        };
        self.rate_limited.get_or_create(&RateLimitLabels { tenant: tenant.to_string(), reason }).inc();
    }

    /// Updates the worker gauges for the workers in `pool` now, from `snapshot` (a worker it lacks, or that did
    /// not answer, keeps its last figures; only its readiness, which the router knows, is set).
    pub fn record_pool(&self, pool: &WorkerPool, snapshot: Option<&StatsSnapshot>) {
        let workers = pool.workers();
        let scraped: Vec<(&str, bool, Option<&StatsResponse>)> =
            workers.iter().map(|w| (w.addr.as_str(), w.is_ready(), snapshot.and_then(|s| s.get(&w.addr)))).collect();
        self.record_workers(&scraped);
    }

    /// Sets the worker gauges from one scrape: each worker's address, readiness and `Stats` (`None`: it did not
    /// answer). Workers scraped before and absent now lose every gauge.
    fn record_workers(&self, scraped: &[(&str, bool, Option<&StatsResponse>)]) {
        let mut known = self.scraped.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let gone: Vec<String> =
            known.keys().filter(|a| !scraped.iter().any(|(s, ..)| *s == a.as_str())).cloned().collect();
        for addr in gone {
            if let Some(series) = known.remove(&addr) {
                self.forget_worker(&addr, &series);
            }
        }
        for &(addr, ready, stats) in scraped {
            let series = known.entry(addr.to_string()).or_default();
            let l = WorkerLabels { worker: addr.to_string() };
            self.worker_ready.get_or_create(&l).set(i64::from(ready));
            let Some(s) = stats else { continue };
            for (family, value) in WORKER_GAUGES {
                family(self).get_or_create(&l).set(value(s) as i64);
            }
            for (family, value) in WORKER_SECONDS_GAUGES {
                family(self).get_or_create(&l).set(value(s));
            }
            for t in &s.tiers {
                let tl = TierLabels { worker: addr.to_string(), tier: t.tier.clone(), codec: t.codec.clone() };
                self.worker_tier_used_bytes.get_or_create(&tl).set(t.used_bytes as i64);
                self.worker_tier_capacity_bytes.get_or_create(&tl).set(t.capacity_bytes as i64);
                series.tiers.insert(tl);
            }
            for h in &s.prefix_hits {
                let hl = TierHitLabels { worker: addr.to_string(), tier: h.tier.clone() };
                self.worker_prefix_hit_tokens.get_or_create(&hl).set(h.tokens as i64);
                series.prefix_hits.insert(hl);
            }
            for (direction, blocks, bytes) in [
                (PEER_DIRECTIONS[0], s.peer_fetched_blocks_total, s.peer_fetched_bytes_total),
                (PEER_DIRECTIONS[1], s.peer_served_blocks_total, s.peer_served_bytes_total),
            ] {
                let pl = PeerLabels { worker: addr.to_string(), direction };
                self.worker_peer_blocks.get_or_create(&pl).set(blocks as i64);
                self.worker_peer_bytes.get_or_create(&pl).set(bytes as i64);
            }
            for e in &s.evictions {
                let pl = PolicyLabels { worker: addr.to_string(), policy: e.policy.clone() };
                self.worker_evicted_tokens.get_or_create(&pl).set(e.evicted_slots as i64);
                self.worker_evicted_blocks.get_or_create(&pl).set(e.freed_blocks as i64);
                series.evictions.insert(pl);
            }
            if let Some(e) = &s.evicpress {
                self.record_evicpress(addr, e, series);
            }
        }
    }

    /// Removes every gauge of the worker at `addr`, which left the pool.
    fn forget_worker(&self, addr: &str, series: &WorkerSeries) {
        let l = WorkerLabels { worker: addr.to_string() };
        self.worker_ready.remove(&l);
        for (family, _) in WORKER_GAUGES {
            family(self).remove(&l);
        }
        for (family, _) in WORKER_SECONDS_GAUGES {
            family(self).remove(&l);
        }
        for (family, _) in EVICPRESS_GAUGES {
            family(self).remove(&l);
        }
        self.worker_evicpress_profile_seconds.remove(&l);
        for direction in PEER_DIRECTIONS {
            let pl = PeerLabels { worker: addr.to_string(), direction };
            self.worker_peer_blocks.remove(&pl);
            self.worker_peer_bytes.remove(&pl);
        }
        for change in EVICPRESS_CHANGES {
            self.worker_evicpress_changes.remove(&EvicPressChangeLabels { worker: addr.to_string(), change });
        }
        for tl in &series.tiers {
            self.worker_tier_used_bytes.remove(tl);
            self.worker_tier_capacity_bytes.remove(tl);
        }
        for hl in &series.prefix_hits {
            self.worker_prefix_hit_tokens.remove(hl);
        }
        for pl in &series.evictions {
            self.worker_evicted_tokens.remove(pl);
            self.worker_evicted_blocks.remove(pl);
        }
        for tl in &series.evicpress_placed {
            self.worker_evicpress_placed_contexts.remove(tl);
        }
        for vl in &series.evicpress_variants {
            self.worker_evicpress_variant_quality.remove(vl);
            self.worker_evicpress_variant_embedding_similarity.remove(vl);
        }
    }

    /// Mirrors one worker's EvicPress planner state into the `worker_evicpress_*` gauges.
    fn record_evicpress(&self, worker: &str, e: &pagoda_proto::worker::EvicPressStats, series: &mut WorkerSeries) {
        let l = WorkerLabels { worker: worker.to_owned() };
        for (family, value) in EVICPRESS_GAUGES {
            family(self).get_or_create(&l).set(value(e) as i64);
        }
        self.worker_evicpress_profile_seconds.get_or_create(&l).set(e.profile_seconds_total);
        for p in &e.placed {
            let tl = TierHitLabels { worker: worker.to_owned(), tier: p.tier.clone() };
            self.worker_evicpress_placed_contexts.get_or_create(&tl).set(p.contexts as i64);
            series.evicpress_placed.insert(tl);
        }
        for (change, n) in EVICPRESS_CHANGES.into_iter().zip([
            e.compressed_total,
            e.moved_down_total,
            e.dropped_total,
            e.upgrades_total,
        ]) {
            let cl = EvicPressChangeLabels { worker: worker.to_owned(), change };
            self.worker_evicpress_changes.get_or_create(&cl).set(n as i64);
        }
        for v in &e.variants {
            let vl = VariantLabels { worker: worker.to_owned(), variant: v.variant.clone() };
            self.worker_evicpress_variant_quality.get_or_create(&vl).set(v.mean_quality);
            if let Some(s) = v.mean_embedding_similarity {
                self.worker_evicpress_variant_embedding_similarity.get_or_create(&vl).set(s);
            }
            series.evicpress_variants.insert(vl);
        }
    }

    /// Updates the registry gauges (nothing without `--etcd`).
    pub fn scrape_registry(&self, status: &crate::workers::RegistryStatus) {
        if !status.enabled {
            return;
        }
        self.registry_workers.set(i64::try_from(status.workers.len()).unwrap_or(i64::MAX));
        self.registry_joined.set(i64::try_from(status.joined_total).unwrap_or(i64::MAX));
        self.registry_left.set(i64::try_from(status.left_total).unwrap_or(i64::MAX));
    }

    /// Updates the directory-feed gauges from the feed's published state (nothing without `--kvstore`).
    pub fn scrape_directory(&self, feed: &crate::feed::FeedStatus) {
        if !feed.enabled {
            return;
        }
        self.kvstore_watch_connected.set(i64::from(feed.connected));
        self.kvstore_applied_index.set(i64::try_from(feed.applied_index).unwrap_or(i64::MAX));
        self.residency_index_blocks.set(i64::try_from(feed.index_blocks).unwrap_or(i64::MAX));
        let now: Vec<String> = feed.workers.iter().map(|w| w.worker.clone()).collect();
        let before = std::mem::replace(
            &mut *self.reported.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
            now.clone(),
        );
        // A worker that left would otherwise keep its last values, a stale alarm of 1 among them, for good.
        for gone in before.iter().filter(|w| !now.contains(w)) {
            let l = WorkerLabels { worker: gone.clone() };
            self.worker_reports_stale.remove(&l);
            self.worker_report_age.remove(&l);
        }
        for w in &feed.workers {
            let l = WorkerLabels { worker: w.worker.clone() };
            self.worker_reports_stale.get_or_create(&l).set(i64::from(w.stale));
            self.worker_report_age.get_or_create(&l).set(w.report_age_s);
        }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_convention() {
        let m = Metrics::new();
        m.count_request("/v1/chat/completions", 200);
        m.count_guided("regex");
        m.count_migration("stall");
        m.ttft.observe(0.05);
        m.inter_token.observe(0.01);
        m.prompt_tokens.inc_by(3);
        m.completion_tokens.inc_by(4);
        let (prompt, completion) = m.tenant_token_counters("acme");
        prompt.inc_by(3);
        completion.inc_by(4);
        // A second request of the tenant adds to the same series.
        m.tenant_token_counters("acme").1.inc();
        m.tenant_token_counters("globex").0.inc_by(2);
        assert_eq!(m.tenant_tokens_by_tenant(), vec![("acme".to_string(), 3, 5), ("globex".to_string(), 2, 0)]);
        m.worker_used_blocks.get_or_create(&WorkerLabels { worker: "w".into() }).set(5);
        let pl = PolicyLabels { worker: "w".into(), policy: "snapkv".into() };
        m.worker_evicted_tokens.get_or_create(&pl).set(7);
        m.worker_evicted_blocks.get_or_create(&pl).set(2);
        let tl = TierLabels { worker: "w".into(), tier: "host".into(), codec: "native".into() };
        m.worker_tier_used_bytes.get_or_create(&tl).set(1024);
        m.worker_tier_capacity_bytes.get_or_create(&tl).set(4096);
        m.worker_prefix_hit_tokens.get_or_create(&TierHitLabels { worker: "w".into(), tier: "disk".into() }).set(32);
        m.count_placement("w", "kv", Duration::from_micros(20));
        m.record_evicpress(
            "w",
            &pagoda_proto::worker::EvicPressStats {
                contexts: 3,
                placed: vec![pagoda_proto::worker::TierContexts { tier: "disk".into(), contexts: 2 }],
                profiles_total: 4,
                profiles_on_own_queries_total: 3,
                profile_seconds_total: 1.5,
                dropped_total: 1,
                upgrades_total: 2,
                variants: vec![pagoda_proto::worker::VariantQuality {
                    variant: "int4_kivi".into(),
                    mean_quality: 0.75,
                    mean_embedding_similarity: Some(0.9),
                }],
                ..Default::default()
            },
            &mut WorkerSeries::default(),
        );
        let text = m.encode();
        for name in [
            "pagoda_router_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1",
            "pagoda_router_ttft_seconds_bucket",
            "pagoda_router_inter_token_latency_seconds_count 1",
            "pagoda_router_prompt_tokens_total 3",
            "pagoda_router_guided_requests_total{guide=\"regex\"} 1",
            "pagoda_router_migrations_total{reason=\"stall\"} 1",
            "pagoda_router_completion_tokens_total 4",
            "pagoda_router_tenant_tokens_total{tenant=\"acme\",kind=\"prompt\"} 3",
            "pagoda_router_tenant_tokens_total{tenant=\"acme\",kind=\"completion\"} 5",
            "pagoda_router_worker_used_blocks{worker=\"w\"} 5",
            "pagoda_router_worker_evicted_tokens{worker=\"w\",policy=\"snapkv\"} 7",
            "pagoda_router_worker_evicted_blocks{worker=\"w\",policy=\"snapkv\"} 2",
            "pagoda_router_worker_tier_used_bytes{worker=\"w\",tier=\"host\",codec=\"native\"} 1024",
            "pagoda_router_worker_tier_capacity_bytes{worker=\"w\",tier=\"host\",codec=\"native\"} 4096",
            "pagoda_router_worker_prefix_hit_tokens{worker=\"w\",tier=\"disk\"} 32",
            "pagoda_router_placements_total{worker=\"w\",strategy=\"kv\"} 1",
            "pagoda_router_placement_decision_seconds_count 1",
            "pagoda_router_worker_evicpress_contexts{worker=\"w\"} 3",
            "pagoda_router_worker_evicpress_placed_contexts{worker=\"w\",tier=\"disk\"} 2",
            "pagoda_router_worker_evicpress_profiles{worker=\"w\"} 4",
            "pagoda_router_worker_evicpress_profiles_on_own_queries{worker=\"w\"} 3",
            "pagoda_router_worker_evicpress_profile_seconds{worker=\"w\"} 1.5",
            "pagoda_router_worker_evicpress_changes{worker=\"w\",change=\"drop\"} 1",
            "pagoda_router_worker_evicpress_changes{worker=\"w\",change=\"compress\"} 0",
            "pagoda_router_worker_evicpress_changes{worker=\"w\",change=\"upgrade\"} 2",
            "pagoda_router_worker_evicpress_variant_quality{worker=\"w\",variant=\"int4_kivi\"} 0.75",
            "pagoda_router_worker_evicpress_variant_embedding_similarity{worker=\"w\",variant=\"int4_kivi\"} 0.9",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
    }

    /// A `Stats` that names every kind of per-worker series: tiers, prefix hits, evictions, peers, EvicPress.
    fn full_stats() -> StatsResponse {
        use pagoda_proto::worker::{
            EvicPressStats, PolicyEvictions, TierContexts, TierHits, TierUsage, VariantQuality,
        };
        StatsResponse {
            blocks_total: 10,
            tiers: vec![TierUsage { tier: "host".into(), codec: "int8".into(), used_bytes: 1, capacity_bytes: 2 }],
            prefix_hits: vec![TierHits { tier: "disk".into(), tokens: 3 }],
            evictions: vec![PolicyEvictions { policy: "snapkv".into(), evicted_slots: 4, freed_blocks: 5 }],
            peer_fetches_total: 6,
            evicpress: Some(EvicPressStats {
                contexts: 1,
                placed: vec![TierContexts { tier: "disk".into(), contexts: 1 }],
                variants: vec![VariantQuality {
                    variant: "int4".into(),
                    mean_quality: 0.5,
                    mean_embedding_similarity: Some(0.5),
                }],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Every per-worker figure of `Stats` lands in its own gauge: each is given a different value, and each value
    /// shows under the gauge's name.
    #[test]
    fn each_stats_figure_sets_its_own_gauge() {
        let mut n = 0u64;
        let mut next = || {
            n += 1;
            n
        };
        let stats = StatsResponse {
            blocks_used: next(),
            blocks_total: next(),
            running: next(),
            waiting: next(),
            preemptions_total: next(),
            steps_total: next(),
            step_sequences_total: next(),
            spec_draft_tokens_total: next(),
            spec_accepted_tokens_total: next(),
            spec_drafts_total: next(),
            lora_loads_total: next(),
            lora_on_demand_loads_total: next(),
            lora_evictions_total: next(),
            peer_fetch_failures_total: next(),
            peer_fetches_total: next(),
            peer_linked_fetches_total: next(),
            peer_link_refusals_total: next(),
            peer_refused_hints_total: next(),
            refused_imports_total: next(),
            undecodable_groups_total: next(),
            lora_load_seconds_total: 0.25,
            peer_fetch_seconds_total: 0.5,
            evicpress: Some(pagoda_proto::worker::EvicPressStats {
                contexts: next(),
                profiles_total: next(),
                reprofiles_total: next(),
                profiles_on_own_queries_total: next(),
                profile_seconds_total: 0.75,
                ..Default::default()
            }),
            ..Default::default()
        };
        let m = Metrics::new();
        m.record_workers(&[("w", true, Some(&stats))]);
        let text = m.encode();
        for (name, value) in [
            ("worker_ready", "1"),
            ("worker_used_blocks", "1"),
            ("worker_capacity_blocks", "2"),
            ("worker_running_sequences", "3"),
            ("worker_waiting_sequences", "4"),
            ("worker_preemptions_sequences", "5"),
            ("worker_steps", "6"),
            ("worker_step_sequences", "7"),
            ("worker_spec_draft_tokens", "8"),
            ("worker_spec_accepted_tokens", "9"),
            ("worker_spec_drafts", "10"),
            ("worker_lora_loads", "11"),
            ("worker_lora_on_demand_loads", "12"),
            ("worker_lora_evictions", "13"),
            ("worker_peer_fetch_failures", "14"),
            ("worker_peer_fetches", "15"),
            ("worker_peer_linked_fetches", "16"),
            ("worker_peer_link_refusals", "17"),
            ("worker_peer_refused_hints", "18"),
            ("worker_refused_imports", "19"),
            ("worker_undecodable_groups", "20"),
            ("worker_lora_load_seconds", "0.25"),
            ("worker_peer_fetch_seconds", "0.5"),
            ("worker_evicpress_contexts", "21"),
            ("worker_evicpress_profiles", "22"),
            ("worker_evicpress_reprofiles", "23"),
            ("worker_evicpress_profiles_on_own_queries", "24"),
            ("worker_evicpress_profile_seconds", "0.75"),
        ] {
            let line = format!("pagoda_router_{name}{{worker=\"w\"}} {value}");
            assert!(text.lines().any(|l| l == line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn a_worker_that_leaves_loses_every_gauge() {
        let m = Metrics::new();
        let stats = full_stats();
        m.record_workers(&[("gone:1", true, Some(&stats)), ("kept:1", true, Some(&stats))]);
        let text = m.encode();
        let series = |worker: &str| text.lines().filter(|l| l.contains(&format!("worker=\"{worker}\""))).count();
        assert!(series("gone:1") >= 30, "{text}");
        m.record_workers(&[("kept:1", false, None)]);
        let text = m.encode();
        let left: Vec<&str> = text.lines().filter(|l| l.contains("worker=\"gone:1\"")).collect();
        assert!(left.is_empty(), "{left:#?}");
        assert!(
            text.contains("pagoda_router_worker_tier_used_bytes{worker=\"kept:1\",tier=\"host\",codec=\"int8\"} 1")
        );
        assert!(text.contains("pagoda_router_worker_ready{worker=\"kept:1\"} 0"));
    }

    #[test]
    fn a_registered_worker_that_leaves_loses_its_stale_alarm() {
        use crate::feed::{FeedStatus, ReportedWorker};
        let reported = |worker: &str| ReportedWorker {
            worker: worker.into(),
            address: format!("{worker}:1"),
            epoch: 1,
            applied_seq: 0,
            report_age_s: 9.0,
            stale: true,
            router_worker: None,
            running: None,
            waiting: None,
            free_blocks: None,
        };
        let m = Metrics::new();
        let feed = |workers| FeedStatus { enabled: true, workers, ..FeedStatus::default() };
        m.scrape_directory(&feed(vec![reported("w1"), reported("w2")]));
        assert!(m.encode().contains("pagoda_router_worker_reports_stale{worker=\"w1\"} 1"));
        m.scrape_directory(&feed(vec![reported("w2")]));
        let text = m.encode();
        assert!(!text.contains("worker=\"w1\""), "{text}");
        assert!(text.contains("pagoda_router_worker_reports_stale{worker=\"w2\"} 1"));
    }
}
