//! The worker list: worker gRPC addresses, health-polled (with their free KV blocks), each with the router's own
//! in-flight load accounting, and placement through [`Placer`]. The router talks to workers only through the
//! `Worker` gRPC service.
//!
//! The list is static (`--worker`) or follows the etcd registry ([`crate::membership`]): workers are added and
//! removed while requests run. Each worker has a stable *slot* (its index in the residency index); a removed
//! worker's slot is emptied and its residency dropped, and a later worker may reuse the slot. The slot table is
//! copy-on-write behind a std `RwLock` that is only held to clone or swap it, never across an await; requests in
//! flight keep their `Arc<Worker>` and finish on it.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use pagoda_proto::worker::worker_client::WorkerClient;
use pagoda_proto::worker::{HealthRequest, LoraAdapterInfo, StatsRequest, StatsResponse};
use tonic::transport::Channel;

use crate::feed::FeedStatus;
use crate::placement::PlacementError;
use crate::placer::{
    DecisionRecord, PeerHint, PlaceRequest, Placer, PlacerConfig, Purpose, WorkerCosts, WorkerSnapshot,
};
use crate::residency::{ResidencyIndex, WorkerIdx};

const RPC_TIMEOUT: Duration = Duration::from_secs(2);
/// HTTP/2 ping interval on every worker channel: a connection whose pings go unanswered for [`RPC_TIMEOUT`] is
/// dropped and the next call reconnects.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
/// How long a worker that stayed silent past a request's bound is left out of placement the first time; each
/// further strike without a first token in between doubles it, up to [`EJECTION_MAX`]. Its health check cannot
/// clear it: a worker whose engine is stuck still answers `Health`, and every request placed on it would wait
/// the whole first-token timeout. Short enough that a worker stopped for a few seconds (a GC-like pause, a
/// SIGSTOP) is back soon after it resumes.
pub const EJECTION_BASE: Duration = Duration::from_secs(5);
/// The longest outlier ejection: a stuck worker is still tried every two minutes, and comes back on its own once
/// it answers.
pub const EJECTION_MAX: Duration = Duration::from_secs(120);

/// What the last health probe said about a worker.
#[derive(Debug, Clone, Default)]
pub struct WorkerStatus {
    pub ready: bool,
    pub model: String,
    pub context_length: u32,
    pub block_size: u32,
    /// Blocks per block group (layers × kv-heads).
    pub kv_group_size: u32,
    /// Free + reclaimable device blocks at the last probe.
    pub free_blocks: u64,
    /// Its measured prefill speed, tier bandwidths and host tier capacity at the last probe.
    pub costs: WorkerCosts,
    /// The id the worker reports its blocks under in the kvstore (empty when it does not say).
    pub worker_id: String,
    pub role: WorkerRole,
    /// The LoRA adapters it has loaded (`pagoda worker --lora`, run-time and on-demand loads).
    pub lora_adapters: Vec<LoraAdapterInfo>,
    /// Whether it loads an adapter a request names from its `--lora-dir` (`--lora-on-demand`).
    pub lora_on_demand: bool,
    /// With `lora_on_demand`, the adapters it can load that way.
    pub lora_available: Vec<String>,
    /// The mean time its run-time adapter loads took, in seconds (0 before the first).
    pub lora_load_seconds: f64,
    /// Most adapters it holds at once (`--max-loras`; 0 when it does not say).
    pub max_loras: u32,
    /// How it orders requests (`--scheduling-policy`), as it says (at most 16 bytes kept; empty when it does not say).
    pub scheduling_policy: String,
    /// Cache ids of adapters it had loaded at some probe, by name, newest kept ([`MAX_REMEMBERED_LORA_IDS`]):
    /// an adapter evicted on demand leaves its blocks cached under its salt, which placement should still match.
    pub lora_seen: Vec<(String, String)>,
    /// The worker process's `Health.boot_id` (0: not reported).
    pub boot_id: u64,
    pub last_error: Option<String>,
}

/// Where a request's LoRA adapter stands on a worker, for placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraSlot {
    /// Loaded: nothing to pay.
    Loaded,
    /// A free slot: one load.
    Free,
    /// Every slot taken, one by an idle on-demand adapter: one load, and one more later for the adapter it evicts
    /// (here or elsewhere), as llm-d's affinity scorer prefers pods with room over pods that must evict.
    Evict,
    /// Every slot pinned or held by requests: the request would wait for one to free. Left out while another
    /// worker can take it.
    Blocked,
}

/// Most adapter cache ids a worker's status remembers after the adapters are unloaded.
pub const MAX_REMEMBERED_LORA_IDS: usize = 256;

/// What placement charges a worker for loading an adapter before it has measured a load (seconds): about what a
/// rank-16 adapter of the 135M model takes here, a few tens of milliseconds.
pub const DEFAULT_LORA_LOAD_SECONDS: f64 = 0.05;

impl WorkerStatus {
    /// Whether it has the adapter named `name` loaded.
    pub fn serves_lora(&self, name: &str) -> bool {
        self.lora_adapters.iter().any(|a| a.name == name)
    }

    /// Whether it can serve the adapter `name`: loaded, or loadable on demand.
    pub fn can_serve_lora(&self, name: &str) -> bool {
        self.serves_lora(name) || (self.lora_on_demand && self.lora_available.iter().any(|n| n == name))
    }

    /// Where the adapter `name` stands on this worker, `load` being the router's own count of its requests.
    pub fn lora_slot(&self, name: &str, load: &WorkerLoad) -> LoraSlot {
        if self.serves_lora(name) {
            return LoraSlot::Loaded;
        }
        if self.max_loras == 0 || self.lora_adapters.len() < self.max_loras as usize {
            return LoraSlot::Free;
        }
        // Only an adapter loaded on demand gives way, and only while no request holds it.
        if self.lora_adapters.iter().any(|a| a.on_demand && load.adapter_requests(&a.name) == 0) {
            LoraSlot::Evict
        } else {
            LoraSlot::Blocked
        }
    }

    /// What serving a request with `name` costs it in adapter loads, in seconds, at `slot` (see [`LoraSlot`]);
    /// `unmeasured` is what a load costs on a worker that has not measured one yet.
    pub fn lora_load_cost(&self, slot: LoraSlot, unmeasured: f64) -> f64 {
        let load = self.measured_lora_load().unwrap_or(unmeasured);
        match slot {
            LoraSlot::Loaded => 0.0,
            LoraSlot::Free => load,
            LoraSlot::Evict | LoraSlot::Blocked => 2.0 * load,
        }
    }

    /// The mean time its adapter loads took, once it has loaded one.
    fn measured_lora_load(&self) -> Option<f64> {
        (self.lora_load_seconds.is_finite() && self.lora_load_seconds > 0.0).then_some(self.lora_load_seconds)
    }

    /// The cache id `name` had here, loaded now or at an earlier probe.
    pub fn lora_cache_id(&self, name: &str) -> Option<&str> {
        self.lora_adapters
            .iter()
            .find(|a| a.name == name)
            .map(|a| a.cache_id.as_str())
            .or_else(|| self.lora_seen.iter().find(|(n, _)| n == name).map(|(_, id)| id.as_str()))
    }

    /// Carries `before`'s remembered cache ids over, adding those loaded now, newest first and bounded.
    fn remember_lora_ids(&mut self, before: &WorkerStatus) {
        let mut seen: Vec<(String, String)> =
            self.lora_adapters.iter().map(|a| (a.name.clone(), a.cache_id.clone())).collect();
        for (name, id) in before
            .lora_adapters
            .iter()
            .map(|a| (&a.name, &a.cache_id))
            .chain(before.lora_seen.iter().map(|(n, id)| (n, id)))
        {
            if seen.len() < MAX_REMEMBERED_LORA_IDS && !seen.iter().any(|(n, _)| n == name) {
                seen.push((name.clone(), id.clone()));
            }
        }
        self.lora_seen = seen;
    }
}

/// What a worker takes, as it announces in `Health` (`pagoda worker --role`): disaggregated serving sends the
/// prompts of long requests to `Prefill` workers and everything else to the others.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WorkerRole {
    /// Whole requests (and no remote prefills): the default, and what a worker that names no role gets.
    #[default]
    Both,
    /// Only the prompts of disaggregated requests; whole requests only while no other worker is ready.
    Prefill,
    /// Whole requests, whose long prompts it pulls from a prefill worker when one is ready.
    Decode,
}

impl WorkerRole {
    /// The role a `Health` answer names; anything unknown is `Both`, what a worker that predates roles does.
    pub fn from_health(role: &str) -> WorkerRole {
        match role {
            "prefill" => WorkerRole::Prefill,
            "decode" => WorkerRole::Decode,
            _ => WorkerRole::Both,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WorkerRole::Both => "both",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }
}

/// The router's own count of what it has sent a worker: prompt tokens still to prefill (the part placement expected
/// the worker not to find cached) of requests waiting for their first token, and streams decoding. Immediate, unlike
/// polled stats. Counting whole prompts instead would charge a worker for the cached prefixes it skips, and steer
/// conversations away from their caches exactly when they are busiest.
#[derive(Debug, Default)]
pub struct WorkerLoad {
    prefill_tokens: AtomicU64,
    decoding: AtomicU32,
    /// Requests in flight per LoRA adapter (an adapter a request holds cannot give way to another on the worker).
    /// A handful of entries: std Mutex, held only to bump a count.
    adapters: Mutex<Vec<(String, u32)>>,
}

/// One request in flight on a worker; updates [`WorkerLoad`] as it moves from prefill to decode, and on drop.
#[derive(Debug)]
pub struct InFlight {
    load: Arc<WorkerLoad>,
    prompt_tokens: u64,
    decoding: bool,
    adapter: Option<String>,
}

impl WorkerLoad {
    /// Prompt tokens sent and still waiting for their first token.
    pub fn queued_tokens(&self) -> u64 {
        self.prefill_tokens.load(Ordering::Relaxed)
    }

    /// Streams decoding.
    pub fn decoding(&self) -> u32 {
        self.decoding.load(Ordering::Relaxed)
    }

    /// Requests in flight with the adapter `name`.
    pub fn adapter_requests(&self, name: &str) -> u32 {
        let adapters = self.adapters.lock().unwrap_or_else(|p| p.into_inner());
        adapters.iter().find(|(n, _)| n == name).map_or(0, |(_, c)| *c)
    }

    fn count_adapter(&self, name: &str, up: bool) {
        let mut adapters = self.adapters.lock().unwrap_or_else(|p| p.into_inner());
        match adapters.iter().position(|(n, _)| n == name) {
            Some(i) if up => adapters[i].1 += 1,
            Some(i) => {
                adapters[i].1 = adapters[i].1.saturating_sub(1);
                if adapters[i].1 == 0 {
                    adapters.swap_remove(i);
                }
            }
            None if up => adapters.push((name.to_string(), 1)),
            None => {}
        }
    }
}

impl InFlight {
    pub fn new(load: Arc<WorkerLoad>, prompt_tokens: u64) -> InFlight {
        InFlight::with_adapter(load, prompt_tokens, None)
    }

    /// A request that runs with the LoRA adapter `adapter` (`None`: the base model).
    pub fn with_adapter(load: Arc<WorkerLoad>, prompt_tokens: u64, adapter: Option<&str>) -> InFlight {
        load.prefill_tokens.fetch_add(prompt_tokens, Ordering::Relaxed);
        if let Some(name) = adapter {
            load.count_adapter(name, true);
        }
        InFlight { load, prompt_tokens, decoding: false, adapter: adapter.map(str::to_owned) }
    }

    /// A stream that will decode on this worker once its prompt is computed elsewhere (a remote prefill): counted
    /// as decoding from the start, since it queues no prompt work here.
    pub fn reserved_decode(load: Arc<WorkerLoad>, adapter: Option<&str>) -> InFlight {
        let mut reserved = InFlight::with_adapter(load, 0, adapter);
        reserved.first_token();
        reserved
    }

    /// The first token arrived: the prompt is no longer queued work.
    pub fn first_token(&mut self) {
        if !self.decoding {
            self.decoding = true;
            self.load.prefill_tokens.fetch_sub(self.prompt_tokens, Ordering::Relaxed);
            self.load.decoding.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.decoding {
            self.load.decoding.fetch_sub(1, Ordering::Relaxed);
        } else {
            self.load.prefill_tokens.fetch_sub(self.prompt_tokens, Ordering::Relaxed);
        }
        if let Some(name) = &self.adapter {
            self.load.count_adapter(name, false);
        }
    }
}

/// Outlier ejection, as Envoy's: a worker that let a request wait past its bound (no first token, a silent
/// stream) is left out of placement for a time that doubles with each such strike, and a first token clears the
/// strikes.
#[derive(Debug, Default)]
struct Ejection {
    until: Option<std::time::Instant>,
    strikes: u32,
}

/// One worker endpoint.
pub struct Worker {
    pub addr: String,
    client: WorkerClient<Channel>,
    // std Mutex: only held for short, synchronous reads and writes, never across an await.
    status: Mutex<WorkerStatus>,
    load: Arc<WorkerLoad>,
    /// Set by a probe that learned a new worker id; the pool turns it into a new id generation.
    id_changed: std::sync::atomic::AtomicBool,
    /// Set by a probe that found it ready after it was not (its first answer, or back from a restart); the pool's
    /// health round then gives it the adapters loaded through the admin API while it was away.
    became_ready: std::sync::atomic::AtomicBool,
    /// A probe [`Worker::probe_soon`] started is still running: a burst of requests asks for one probe, not one each.
    probe_pending: std::sync::atomic::AtomicBool,
    ejection: Mutex<Ejection>,
}

impl Worker {
    /// A worker at `addr` (`host:port` or a URL); the connection is made lazily.
    fn connect(addr: &str) -> Result<Worker, String> {
        let endpoint = pagoda_proto::tls::endpoint(addr)
            .map_err(|e| format!("invalid worker address `{addr}`: {e}"))?
            .connect_timeout(RPC_TIMEOUT)
            .tcp_nodelay(true)
            // A partition leaves a connection open but silent; without HTTP/2 pings the channel would wait on it
            // for the kernel's TCP timeout (many minutes) and never reconnect once the network heals.
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(RPC_TIMEOUT)
            .keep_alive_while_idle(true);
        Ok(Worker {
            addr: addr.to_string(),
            client: WorkerClient::new(endpoint.connect_lazy()),
            status: Mutex::new(WorkerStatus::default()),
            load: Arc::new(WorkerLoad::default()),
            id_changed: std::sync::atomic::AtomicBool::new(false),
            became_ready: std::sync::atomic::AtomicBool::new(false),
            probe_pending: std::sync::atomic::AtomicBool::new(false),
            ejection: Mutex::new(Ejection::default()),
        })
    }

    pub fn client(&self) -> WorkerClient<Channel> {
        self.client.clone()
    }

    pub fn load(&self) -> &Arc<WorkerLoad> {
        &self.load
    }

    /// A copy of what the last probe learned. It holds the adapter lists, so hot paths read it in place with
    /// [`Worker::with_status`] instead.
    pub fn status(&self) -> WorkerStatus {
        self.with_status(WorkerStatus::clone)
    }

    /// `f` of what the last probe learned, read in place (under a std mutex: `f` must not block).
    pub fn with_status<R>(&self, f: impl FnOnce(&WorkerStatus) -> R) -> R {
        let status = self.status.lock().unwrap_or_else(|p| p.into_inner());
        f(&status)
    }

    /// Whether the last probe found the worker ready.
    pub fn is_ready(&self) -> bool {
        self.with_status(|s| s.ready)
    }

    fn set_status(&self, st: WorkerStatus) {
        if let Ok(mut s) = self.status.lock() {
            *s = st;
        }
    }

    /// Marks the worker unreachable until the next successful probe.
    pub fn mark_down(&self, why: String) {
        if let Ok(mut s) = self.status.lock() {
            s.ready = false;
            s.last_error = Some(why);
        }
    }

    /// Leaves the worker out of placement for a while after it stayed silent past a request's bound (see
    /// [`EJECTION_BASE`]; `why` names the bound, for the log). While it is out, further failures add no strike (the
    /// requests waiting on it fail together); one that fails after the ejection ended (a request placed before it,
    /// whose first-token timeout is longer) adds the next.
    pub fn eject_silent(&self, why: &str) {
        if let Some(out_for) = self.eject_silent_at(std::time::Instant::now()) {
            tracing::warn!(worker = %self.addr, why, out_for_ms = out_for.as_millis() as u64,
                "worker stayed silent: ejected from placement");
        }
    }

    /// [`Worker::eject_silent`] at `now`: for how long, or `None` when it is out already.
    fn eject_silent_at(&self, now: std::time::Instant) -> Option<Duration> {
        let mut ejection = self.ejection.lock().unwrap_or_else(|p| p.into_inner());
        if ejection.until.is_some_and(|until| now < until) {
            return None;
        }
        ejection.strikes = ejection.strikes.saturating_add(1);
        let doublings = (ejection.strikes - 1).min(16);
        let out_for = EJECTION_BASE.saturating_mul(1 << doublings).min(EJECTION_MAX);
        ejection.until = Some(now + out_for);
        Some(out_for)
    }

    /// A request got its first token here: the worker is serving, and its strikes are cleared.
    pub fn answered(&self) {
        let mut ejection = self.ejection.lock().unwrap_or_else(|p| p.into_inner());
        if ejection.strikes > 0 {
            *ejection = Ejection::default();
        }
    }

    /// How long the worker stays out of placement after staying silent (zero: it is in).
    pub fn ejected_for(&self) -> Duration {
        self.ejected_for_at(std::time::Instant::now())
    }

    fn ejected_for_at(&self, now: std::time::Instant) -> Duration {
        let ejection = self.ejection.lock().unwrap_or_else(|p| p.into_inner());
        ejection.until.map_or(Duration::ZERO, |until| until.saturating_duration_since(now))
    }

    /// Probes `Health` in the background now, unless such a probe is running already.
    pub fn probe_soon(self: &Arc<Self>) {
        if self.probe_pending.swap(true, Ordering::AcqRel) {
            return;
        }
        let worker = Arc::clone(self);
        tokio::spawn(async move {
            worker.probe().await;
            worker.probe_pending.store(false, Ordering::Release);
        });
    }

    /// Probes `Health` once and records the answer.
    pub async fn probe(&self) -> bool {
        let mut client = self.client();
        let res = tokio::time::timeout(RPC_TIMEOUT, client.health(HealthRequest {})).await;
        let st = match res {
            Ok(Ok(resp)) => {
                let h = resp.into_inner();
                WorkerStatus {
                    ready: h.ready,
                    model: h.model,
                    context_length: h.context_length,
                    block_size: h.block_size,
                    kv_group_size: h.kv_group_size,
                    free_blocks: 0,
                    costs: WorkerCosts::default(),
                    worker_id: h.worker_id,
                    role: WorkerRole::from_health(&h.role),
                    lora_adapters: h.lora_adapters,
                    lora_on_demand: h.lora_on_demand,
                    lora_available: h.lora_available,
                    lora_load_seconds: h.lora_load_seconds,
                    max_loras: h.max_loras,
                    scheduling_policy: h.scheduling_policy.chars().take(16).collect(),
                    lora_seen: Vec::new(),
                    boot_id: h.boot_id,
                    last_error: None,
                }
            }
            Ok(Err(status)) => WorkerStatus { last_error: Some(status.message().to_string()), ..Default::default() },
            Err(_) => WorkerStatus { last_error: Some("health check timed out".into()), ..Default::default() },
        };
        let mut st = st;
        if st.ready
            && let Some(stats) = self.stats().await
        {
            st.free_blocks = stats.blocks_free + stats.blocks_cached;
            st.costs = WorkerCosts::from_stats(&stats);
        }
        let ready = st.ready;
        // A probe that fails keeps the id learned before: it still names the worker's blocks in the directory.
        let before = self.status();
        if st.worker_id.is_empty() {
            st.worker_id = before.worker_id.clone();
        }
        st.remember_lora_ids(&before);
        let new_id = st.worker_id != before.worker_id;
        // Back from a restart this probe saw nothing of (it was quicker than the probe interval) counts too.
        let restarted = st.boot_id != 0 && before.boot_id != 0 && st.boot_id != before.boot_id;
        if ready && (!before.ready || restarted) {
            self.became_ready.store(true, Ordering::Relaxed);
        }
        self.set_status(st);
        if new_id {
            self.id_changed.store(true, Ordering::Relaxed);
        }
        ready
    }

    /// Current occupancy, or `None` when the worker does not answer in time.
    pub async fn stats(&self) -> Option<StatsResponse> {
        let mut client = self.client();
        match tokio::time::timeout(RPC_TIMEOUT, client.stats(StatsRequest {})).await {
            Ok(Ok(resp)) => Some(resp.into_inner()),
            _ => None,
        }
    }
}

/// Marks the workers flagged in `out` not ready, unless that would leave none ready: serving beats refusing.
fn leave_out_while_others_ready(snaps: &mut [WorkerSnapshot], out: &[bool]) {
    if snaps.iter().zip(out).any(|(s, &o)| s.ready && !o) {
        for (s, &o) in snaps.iter_mut().zip(out) {
            s.ready &= !o;
        }
    }
}

/// Leaves ready only the workers whose role takes a placement of `purpose`. Whole requests go to prefill workers
/// only when nothing else is ready: serving beats refusing.
fn restrict_to_role(snaps: &mut [WorkerSnapshot], roles: &[WorkerRole], purpose: Purpose) {
    let takes = |role: WorkerRole| match purpose {
        Purpose::Whole => role != WorkerRole::Prefill,
        Purpose::RemotePrefill => role == WorkerRole::Prefill,
    };
    if purpose == Purpose::Whole && !snaps.iter().zip(roles).any(|(s, &r)| s.ready && takes(r)) {
        return;
    }
    for (s, &r) in snaps.iter_mut().zip(roles) {
        s.ready &= takes(r);
    }
}

/// Most worker slots (the residency index numbers workers with a u16).
pub const MAX_WORKER_SLOTS: usize = 4096;

/// What the registry watch last told the pool (for metrics and `/debug/placements`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RegistryStatus {
    pub enabled: bool,
    /// Registered workers: (registry id, address).
    pub workers: Vec<(String, String)>,
    pub joined_total: u64,
    pub left_total: u64,
}

/// A worker to try, with the peer it may pull a longer prefix from.
#[derive(Clone)]
pub struct Candidate {
    pub worker: Arc<Worker>,
    pub peer_hint: Option<PeerHint>,
    /// Prompt tokens placement expects this worker to find cached (any tier, or pulled from its peer): the rest is
    /// the prefill work the request adds to its queue.
    pub cached_tokens: u64,
}

/// Who is in the pool, and the load records removed workers left behind.
#[derive(Default)]
struct Table {
    slots: Arc<Vec<Option<Arc<Worker>>>>,
    /// The load records of removed workers, by address, for as long as something (a request in flight) holds
    /// them: a worker that leaves and comes back at the same address (a lost registry lease) gets its record back,
    /// or placement would take it for idle while the requests it still runs count down a record nobody reads.
    departed: Vec<(String, Weak<WorkerLoad>)>,
}

/// The worker list.
pub struct WorkerPool {
    // std RwLock: only held to clone or replace the slot table, never across an await. Replaced only under the
    // placer lock too, so that a placement sees the same workers from its snapshot to its residency prediction.
    table: std::sync::RwLock<Table>,
    registry: Mutex<RegistryStatus>,
    next: AtomicUsize,
    // std Mutex: placement is synchronous and short (tens of microseconds); never held across an await.
    placer: Mutex<Placer>,
    /// Written by the directory feed task only ([`crate::feed`]); read by placement, metrics and the debug page.
    feed: Mutex<FeedStatus>,
    id_generation: AtomicU64,
    /// Written by the admin API's handlers only ([`crate::lora_admin`]); std Mutex, never held across an await.
    lora_intents: Mutex<crate::lora_admin::LoraIntents>,
}

pub(crate) fn strip_scheme(a: &str) -> &str {
    a.strip_prefix("http://").or_else(|| a.strip_prefix("https://")).unwrap_or(a)
}

impl WorkerPool {
    /// `addrs` are `host:port` or `http://host:port`. Connections are made lazily.
    pub fn new(addrs: &[String]) -> Result<WorkerPool, String> {
        WorkerPool::with_placement(addrs, PlacerConfig::default())
    }

    /// [`WorkerPool::new`] with placement settings.
    pub fn with_placement(addrs: &[String], placement: PlacerConfig) -> Result<WorkerPool, String> {
        if addrs.is_empty() {
            return Err("at least one worker address is required".into());
        }
        WorkerPool::dynamic(addrs, placement)
    }

    /// A pool that may start empty: workers come and go through [`WorkerPool::add`] and [`WorkerPool::remove`].
    pub fn dynamic(addrs: &[String], placement: PlacerConfig) -> Result<WorkerPool, String> {
        if addrs.len() > MAX_WORKER_SLOTS {
            return Err(format!("{} workers (at most {MAX_WORKER_SLOTS})", addrs.len()));
        }
        let mut workers = Vec::with_capacity(addrs.len());
        for a in addrs {
            workers.push(Some(Arc::new(Worker::connect(a)?)));
        }
        Ok(WorkerPool {
            table: std::sync::RwLock::new(Table { slots: Arc::new(workers), departed: Vec::new() }),
            registry: Mutex::new(RegistryStatus::default()),
            next: AtomicUsize::new(0),
            placer: Mutex::new(Placer::new(placement)),
            feed: Mutex::new(FeedStatus::default()),
            id_generation: AtomicU64::new(0),
            lora_intents: Mutex::new(crate::lora_admin::LoraIntents::default()),
        })
    }

    /// Which worker of this pool the kvstore's `worker` (registered at `address`) is: the one that announced that
    /// id in `Health`, else the one configured at that address.
    pub fn resolve(&self, worker: &str, address: &str) -> Option<usize> {
        let slots = self.slots();
        let by_id = slots
            .iter()
            .position(|w| w.as_ref().is_some_and(|w| !worker.is_empty() && w.with_status(|s| s.worker_id == worker)));
        by_id.or_else(|| {
            let address = strip_scheme(address);
            slots
                .iter()
                .position(|w| w.as_ref().is_some_and(|w| !address.is_empty() && strip_scheme(&w.addr) == address))
        })
    }

    /// The slot table: index = the worker's slot in the residency index; `None` = a free slot.
    pub fn slots(&self) -> Arc<Vec<Option<Arc<Worker>>>> {
        self.table.read().map(|t| t.slots.clone()).unwrap_or_default()
    }

    /// Each slot's worker address (empty for a free slot), for the feed's status.
    pub fn slot_names(&self) -> Vec<String> {
        self.slots().iter().map(|w| w.as_ref().map(|w| w.addr.clone()).unwrap_or_default()).collect()
    }

    /// Adds the worker at `addr` unless it is in the pool; returns it when it is new. Its residency is learned
    /// from the next directory snapshot (the feed resynchronises on the id generation bump).
    pub fn add(&self, addr: &str) -> Result<Option<Arc<Worker>>, String> {
        let mut worker = Worker::connect(addr)?;
        let mut placer = self.placer.lock().map_err(|_| "placer poisoned".to_string())?;
        let mut table = self.table.write().map_err(|_| "worker table poisoned".to_string())?;
        let same = |a: &str| strip_scheme(a) == strip_scheme(addr);
        if table.slots.iter().flatten().any(|w| same(&w.addr)) {
            return Ok(None);
        }
        let mut next: Vec<Option<Arc<Worker>>> = table.slots.as_ref().clone();
        let slot = match next.iter().position(Option::is_none) {
            Some(free) => free,
            None if next.len() < MAX_WORKER_SLOTS => {
                next.push(None);
                next.len() - 1
            }
            None => return Err(format!("the pool is full ({MAX_WORKER_SLOTS} workers)")),
        };
        table.departed.retain(|(_, load)| load.strong_count() > 0);
        if let Some(i) = table.departed.iter().position(|(a, _)| same(a)) {
            let (_, load) = table.departed.swap_remove(i);
            if let Some(load) = load.upgrade() {
                worker.load = load;
            }
        }
        let worker = Arc::new(worker);
        next[slot] = Some(worker.clone());
        table.slots = Arc::new(next);
        // A reused slot may still carry this router's predictions for its previous worker.
        if let Ok(idx) = WorkerIdx::try_from(slot) {
            placer.index_mut().remove_worker(idx);
        }
        self.id_generation.fetch_add(1, Ordering::Relaxed);
        Ok(Some(worker))
    }

    /// Removes the worker at `addr` and everything the residency index holds for it; returns whether it was there.
    /// Requests already running on it go on (they hold the worker); no new one is placed there.
    pub fn remove(&self, addr: &str) -> bool {
        let Ok(mut placer) = self.placer.lock() else { return false };
        let Ok(mut table) = self.table.write() else { return false };
        let Some(slot) =
            table.slots.iter().position(|w| w.as_ref().is_some_and(|w| strip_scheme(&w.addr) == strip_scheme(addr)))
        else {
            return false;
        };
        let mut next: Vec<Option<Arc<Worker>>> = table.slots.as_ref().clone();
        if let Some(gone) = next[slot].take() {
            table.departed.retain(|(_, load)| load.strong_count() > 0);
            table.departed.push((gone.addr.clone(), Arc::downgrade(&gone.load)));
        }
        table.slots = Arc::new(next);
        if let Ok(idx) = WorkerIdx::try_from(slot) {
            placer.index_mut().remove_worker(idx);
        }
        true
    }

    /// The registry watch's latest state (disabled without `--etcd`).
    pub fn registry_status(&self) -> RegistryStatus {
        self.registry.lock().map(|r| r.clone()).unwrap_or_default()
    }

    pub fn set_registry_status(&self, status: RegistryStatus) {
        if let Ok(mut r) = self.registry.lock() {
            *r = status;
        }
    }

    /// Bumped whenever a probe learns a worker id it did not know (the feed then re-reads the directory).
    pub fn id_generation(&self) -> u64 {
        self.id_generation.load(Ordering::Relaxed)
    }

    /// Runs `f` on the residency index (briefly: placement waits for it).
    pub fn with_index<T>(&self, f: impl FnOnce(&mut ResidencyIndex) -> T) -> Option<T> {
        self.placer.lock().ok().map(|mut p| f(p.index_mut()))
    }

    /// Distinct block hashes in the residency index.
    pub fn index_blocks(&self) -> usize {
        self.with_index(|i| i.len()).unwrap_or(0)
    }

    /// The directory feed's latest published state (disabled without `--kvstore`).
    pub fn feed_status(&self) -> FeedStatus {
        self.feed.lock().map(|f| f.clone()).unwrap_or_default()
    }

    pub fn set_feed_status(&self, status: FeedStatus) {
        if let Ok(mut f) = self.feed.lock() {
            *f = status;
        }
    }

    /// The workers to try for `req`, best first (see [`Placer::order`]), each with the peer it may pull a longer
    /// prefix from ([`Placer::peer_hint`]).
    pub fn place(&self, req: &PlaceRequest<'_>) -> Result<Vec<Candidate>, PlacementError> {
        self.place_for(req, Purpose::Whole)
    }

    /// The prefill worker to compute `req`'s prompt for a decode worker (the best by the same cost model, among
    /// ready prefill workers only), or `None` when no prefill worker is ready.
    pub fn place_remote_prefill(&self, req: &PlaceRequest<'_>) -> Option<Arc<Worker>> {
        self.place_for(req, Purpose::RemotePrefill).ok()?.into_iter().next().map(|c| c.worker)
    }

    /// Prompts with at least this many tokens to compute on their decode worker are prefilled on a prefill worker
    /// (0: never), unless that worker has `.1` prompt tokens queued already (0: no bound).
    pub fn remote_prefill_bounds(&self) -> (u64, u64) {
        self.placer
            .lock()
            .map(|p| (p.config().remote_prefill_min_tokens, p.config().remote_prefill_max_queued_tokens))
            .unwrap_or((0, 0))
    }

    fn place_for(&self, req: &PlaceRequest<'_>, purpose: Purpose) -> Result<Vec<Candidate>, PlacementError> {
        // The table is read under the placer lock: a slot emptied and refilled between the read and the decision
        // would hand the old worker's residency prediction to the new one.
        let mut placer = self.placer.lock().map_err(|_| PlacementError::NoReadyWorker)?;
        let slots = self.slots();
        let names: Vec<&str> = slots.iter().map(|w| w.as_ref().map_or("", |w| w.addr.as_str())).collect();
        let snaps = self.snapshots(&slots, &names, purpose, req);
        if purpose == Purpose::RemotePrefill && !snaps.iter().any(|s| s.ready) {
            // Asked on every long prompt: without a prefill worker it must leave no decision (nor move the
            // round-robin cursor).
            return Err(PlacementError::NoReadyWorker);
        }
        let order = placer.order_for(req, &snaps, &names, purpose)?;
        Ok(order
            .into_iter()
            .filter_map(|i| {
                let peer_hint = placer.peer_hint(i, &names);
                let hit_blocks = peer_hint.as_ref().map_or(0, |h| h.blocks).max(placer.expected_hits(i));
                let cached_tokens =
                    u64::from(req.view.prompt_tokens).saturating_sub(req.view.compute_tokens(hit_blocks));
                Some(Candidate { worker: slots.get(i).cloned().flatten()?, peer_hint, cached_tokens })
            })
            .collect())
    }

    /// The decision [`WorkerPool::place`] would make for `req` now, without making it (see [`Placer::explain`]).
    pub fn explain(&self, req: &PlaceRequest<'_>) -> Result<DecisionRecord, PlacementError> {
        let mut placer = self.placer.lock().map_err(|_| PlacementError::NoReadyWorker)?;
        let slots = self.slots();
        let names: Vec<&str> = slots.iter().map(|w| w.as_ref().map_or("", |w| w.addr.as_str())).collect();
        let snaps = self.snapshots(&slots, &names, Purpose::Whole, req);
        placer.explain(req, &snaps, &names)
    }

    /// What placement knows about each slot's worker now, for a placement of `purpose` of `req`: a worker whose
    /// role does not take it, that lacks its adapter, or that it already failed on, counts as not ready.
    fn snapshots(
        &self,
        slots: &[Option<Arc<Worker>>],
        names: &[&str],
        purpose: Purpose,
        req: &PlaceRequest<'_>,
    ) -> Vec<WorkerSnapshot> {
        let lora = req.lora;
        // A worker that has not loaded an adapter yet is charged what loads took on the others: a guess of its own
        // would make it look cheaper or dearer than the measured ones for no reason.
        let unmeasured = if lora.is_none() {
            DEFAULT_LORA_LOAD_SECONDS
        } else {
            let (sum, n) = slots
                .iter()
                .flatten()
                .filter_map(|w| w.with_status(WorkerStatus::measured_lora_load))
                .fold((0.0, 0usize), |(sum, n), s| (sum + s, n + 1));
            if n == 0 { DEFAULT_LORA_LOAD_SECONDS } else { sum / n as f64 }
        };
        let mut blocked = vec![false; slots.len()];
        let mut ejected = vec![false; slots.len()];
        let now = std::time::Instant::now();
        let (mut snaps, roles): (Vec<WorkerSnapshot>, Vec<WorkerRole>) = slots
            .iter()
            .zip(blocked.iter_mut().zip(ejected.iter_mut()))
            .map(|(w, (blocked, ejected))| {
                let Some(w) = w else { return (WorkerSnapshot::default(), WorkerRole::Both) };
                *ejected = !w.ejected_for_at(now).is_zero();
                w.with_status(|st| {
                    let slot = lora.map(|name| st.lora_slot(name, &w.load));
                    *blocked = slot == Some(LoraSlot::Blocked);
                    let snap = WorkerSnapshot {
                        ready: st.ready
                            && !req.exclude.contains(&w.addr)
                            && lora.is_none_or(|name| st.can_serve_lora(name)),
                        adapter_load_s: slot.map_or(0.0, |slot| st.lora_load_cost(slot, unmeasured)),
                        queued_tokens: w.load.prefill_tokens.load(Ordering::Relaxed),
                        decoding: w.load.decoding.load(Ordering::Relaxed),
                        free_blocks: st.free_blocks,
                        group_size: st.kv_group_size,
                        costs: st.costs,
                    };
                    (snap, st.role)
                })
            })
            .unzip();
        restrict_to_role(&mut snaps, &roles, purpose);
        // A worker ejected for staying silent is left out while another can serve; a remote prefill has the decode
        // worker to fall back on, so it never waits on one.
        if purpose == Purpose::RemotePrefill {
            for (s, &out) in snaps.iter_mut().zip(&ejected) {
                s.ready &= !out;
            }
        } else {
            leave_out_while_others_ready(&mut snaps, &ejected);
        }
        // A worker whose adapter slots are all held would make the request wait: left out while another can take it.
        leave_out_while_others_ready(&mut snaps, &blocked);
        // A worker whose reports stopped is left out while a fresh one is ready: its residency cannot be trusted.
        // With every ready worker stale the alarm is already up (metrics, logs); serving beats refusing then.
        let feed = self.feed_status();
        if feed.enabled {
            let stale: Vec<bool> = (0..snaps.len()).map(|i| feed.is_stale(i, names)).collect();
            leave_out_while_others_ready(&mut snaps, &stale);
        }
        snaps
    }

    /// The placement strategy's name.
    pub fn strategy_name(&self) -> &'static str {
        self.placer.lock().map(|p| p.strategy().name()).unwrap_or("unknown")
    }

    /// Why the latest decision was made (for its trace span).
    pub fn last_reason(&self) -> String {
        self.placer.lock().ok().and_then(|p| p.recent().next().map(|r| r.reason.clone())).unwrap_or_default()
    }

    /// The most recent placement decisions, newest first.
    pub fn recent_decisions(&self) -> Vec<DecisionRecord> {
        self.placer.lock().map(|p| p.recent().cloned().collect()).unwrap_or_default()
    }

    /// The block size and model id the ready workers hash prefixes with (the first ready worker's).
    pub fn hashing(&self) -> Option<(u32, String)> {
        self.slots().iter().flatten().find_map(|w| w.with_status(|s| s.ready.then(|| (s.block_size, s.model.clone()))))
    }

    /// The cache id a ready worker announces for the adapter `name` (what salts its block hashes): one that has
    /// it loaded, else one that had it loaded at an earlier probe. `None` when no ready worker has had it. Workers
    /// that hold different weights under one name announce different ids; the first ready one's is used, and the
    /// others' blocks then simply do not match (they hash their own).
    pub fn lora_cache_id(&self, name: &str) -> Option<String> {
        let slots = self.slots();
        let ready = || slots.iter().flatten();
        ready()
            .find_map(|w| {
                w.with_status(|s| {
                    s.ready.then(|| s.lora_adapters.iter().find(|a| a.name == name).map(|a| a.cache_id.clone()))?
                })
            })
            .or_else(|| {
                ready().find_map(|w| w.with_status(|s| s.ready.then(|| s.lora_cache_id(name).map(str::to_owned))?))
            })
    }

    /// Whether some ready worker can serve the adapter `name`: has it loaded, or loads it on demand.
    pub fn lora_servable(&self, name: &str) -> bool {
        self.slots().iter().flatten().any(|w| w.with_status(|s| s.ready && s.can_serve_lora(name)))
    }

    /// The adapters some ready worker serves, by name, each with its rank: those loaded, then those only loadable
    /// on demand (rank 0: not known until loaded).
    pub fn lora_adapters(&self) -> Vec<(String, u32)> {
        let mut all: Vec<(String, u32)> = Vec::new();
        let statuses: Vec<WorkerStatus> = self.workers().iter().map(|w| w.status()).filter(|s| s.ready).collect();
        for st in &statuses {
            for a in &st.lora_adapters {
                if !all.iter().any(|(n, _)| *n == a.name) {
                    all.push((a.name.clone(), a.rank));
                }
            }
        }
        for name in statuses.iter().filter(|s| s.lora_on_demand).flat_map(|s| &s.lora_available) {
            if !all.iter().any(|(n, _)| n == name) {
                all.push((name.clone(), 0));
            }
        }
        all.sort();
        all
    }

    /// The workers in the pool now, in slot order.
    pub fn workers(&self) -> Vec<Arc<Worker>> {
        self.slots().iter().flatten().cloned().collect()
    }

    /// The worker at `addr`, if it is in the pool.
    pub fn find(&self, addr: &str) -> Option<Arc<Worker>> {
        self.slots().iter().flatten().find(|w| w.addr == addr).cloned()
    }

    /// True when at least one worker answered its last health probe as ready.
    pub fn any_ready(&self) -> bool {
        self.slots().iter().flatten().any(|w| w.is_ready())
    }

    /// Round-robin over ready workers: the candidates in the order to try them.
    pub fn candidates(&self) -> Vec<Arc<Worker>> {
        let mut ready: Vec<Arc<Worker>> = self.workers().into_iter().filter(|w| w.is_ready()).collect();
        if !ready.is_empty() {
            let start = self.next.fetch_add(1, Ordering::Relaxed) % ready.len();
            ready.rotate_left(start);
        }
        ready
    }

    /// Probes every worker once. A worker found ready after it was not is given, in the background, the adapters
    /// the admin API loaded that it lacks ([`crate::lora_admin::replay`]).
    pub async fn refresh(&self) {
        let workers = self.workers();
        futures::future::join_all(workers.iter().map(|w| w.probe())).await;
        if workers.iter().any(|w| w.id_changed.swap(false, Ordering::Relaxed)) {
            self.id_generation.fetch_add(1, Ordering::Relaxed);
        }
        let returned: Vec<Arc<Worker>> =
            workers.into_iter().filter(|w| w.became_ready.swap(false, Ordering::Relaxed) && w.is_ready()).collect();
        if returned.is_empty() {
            return;
        }
        let intents = self.lora_intents();
        if intents.is_empty() {
            return;
        }
        for w in returned {
            tokio::spawn(crate::lora_admin::replay(w, intents.clone()));
        }
    }

    /// Records that the admin API loaded `name` from `path` (`Some`) or unloaded it (`None`), for workers that
    /// become ready later. Returns what was recorded before, to put back when the call fails everywhere; refuses a
    /// new name past [`crate::lora_admin::MAX_LORA_INTENTS`].
    pub fn set_lora_intent(
        &self,
        name: &str,
        path: Option<String>,
    ) -> Result<Option<String>, crate::lora_admin::TooManyIntents> {
        self.lora_intents.lock().unwrap_or_else(|p| p.into_inner()).set(name, path)
    }

    /// The adapters the admin API has loaded, by name, with their paths.
    pub fn lora_intents(&self) -> Vec<(String, String)> {
        self.lora_intents.lock().unwrap_or_else(|p| p.into_inner()).list()
    }

    /// Re-probes the workers every `interval` for as long as the pool lives.
    pub fn spawn_health_loop(self: &std::sync::Arc<Self>, interval: Duration) -> tokio::task::JoinHandle<()> {
        let weak = std::sync::Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(pool) = weak.upgrade() else { break };
                pool.refresh().await;
                // Probe quickly until the first worker is ready, then at the normal pace.
                let wait = if pool.any_ready() { interval } else { interval.min(Duration::from_millis(200)) };
                drop(pool);
                tokio::time::sleep(wait).await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::RequestView;

    #[tokio::test]
    async fn round_robin_over_ready_workers() {
        let pool = WorkerPool::new(&["127.0.0.1:1".into(), "http://127.0.0.1:2".into(), "127.0.0.1:3".into()]).unwrap();
        assert!(pool.candidates().is_empty());
        assert!(!pool.any_ready());
        for w in pool.workers() {
            w.set_status(WorkerStatus { ready: true, ..Default::default() });
        }
        pool.workers()[1].mark_down("gone".into());
        let firsts: Vec<String> = (0..4).map(|_| pool.candidates()[0].addr.clone()).collect();
        assert_eq!(firsts, vec!["127.0.0.1:1", "127.0.0.1:3", "127.0.0.1:1", "127.0.0.1:3"]);
        assert_eq!(pool.candidates().len(), 2);
    }

    #[tokio::test]
    async fn a_candidates_queued_work_is_the_part_of_the_prompt_it_does_not_hold() {
        let addrs = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
        let pool = WorkerPool::with_placement(&addrs, PlacerConfig::default()).unwrap();
        for w in pool.workers() {
            w.set_status(WorkerStatus { ready: true, free_blocks: 1 << 20, kv_group_size: 90, ..Default::default() });
        }
        let view = |prompt_tokens| RequestView { prompt_tokens, max_tokens: 16, block_size: 16, budget_tokens: None };
        let hashes: Vec<u64> = (1..=12).collect();
        let first = PlaceRequest {
            request_id: "r1",
            hashes: &hashes[..8],
            view: view(130),
            publishes_prefix: true,
            exclude: &[],
            lora: None,
        };
        let c = pool.place(&first).unwrap();
        assert_eq!(c[0].cached_tokens, 0, "nothing is cached yet");
        // The same conversation, longer: its first 8 blocks are predicted on the worker that took r1.
        let next = PlaceRequest {
            request_id: "r2",
            hashes: &hashes,
            view: view(200),
            publishes_prefix: true,
            exclude: &[],
            lora: None,
        };
        let c2 = pool.place(&next).unwrap();
        assert_eq!(c2[0].worker.addr, c[0].worker.addr);
        assert_eq!(c2[0].cached_tokens, 8 * 16);
        let in_flight = InFlight::new(c2[0].worker.load().clone(), 200 - c2[0].cached_tokens);
        assert_eq!(c2[0].worker.load().queued_tokens(), 200 - 128);
        drop(in_flight);
        assert_eq!(c2[0].worker.load().queued_tokens(), 0);
        // A whole-prompt hit still leaves the last token to compute.
        let again = PlaceRequest {
            request_id: "r3",
            hashes: &hashes[..8],
            view: view(128),
            publishes_prefix: true,
            exclude: &[],
            lora: None,
        };
        assert_eq!(pool.place(&again).unwrap()[0].cached_tokens, 127);
    }

    #[tokio::test]
    async fn a_retry_places_and_predicts_on_a_worker_it_has_not_failed_on() {
        let addrs = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
        let pool = WorkerPool::with_placement(&addrs, PlacerConfig::default()).unwrap();
        for w in pool.workers() {
            w.set_status(WorkerStatus { ready: true, free_blocks: 1 << 20, kv_group_size: 90, ..Default::default() });
        }
        // Worker 2 has a little queued, so a fresh prefix would go to worker 1 (the one that just failed).
        let queued = InFlight::new(pool.workers()[1].load().clone(), 16);
        let view = RequestView { prompt_tokens: 130, max_tokens: 16, block_size: 16, budget_tokens: None };
        let hashes: Vec<u64> = (1..=8).collect();
        let failed = [addrs[0].clone()];
        let retry = PlaceRequest {
            request_id: "r1",
            hashes: &hashes,
            view,
            publishes_prefix: true,
            lora: None,
            exclude: &failed,
        };
        let c = pool.place(&retry).unwrap();
        let tried: Vec<&str> = c.iter().map(|c| c.worker.addr.as_str()).collect();
        assert_eq!(tried, [addrs[1].as_str()], "the failed worker is no candidate");
        // The prediction went to the worker that served: the same prefix now goes there, and finds it cached.
        let next = PlaceRequest { exclude: &[], request_id: "r2", ..retry };
        let c = pool.place(&next).unwrap();
        assert_eq!(c[0].worker.addr, addrs[1]);
        assert_eq!(c[0].cached_tokens, 8 * 16);
        let decision = &pool.recent_decisions()[0];
        let hits = |addr: &str| decision.candidates.iter().find(|c| c.worker == addr).map(|c| c.hits_device);
        assert_eq!((hits(&addrs[0]), hits(&addrs[1])), (Some(0), Some(8)), "nothing was predicted on the failed one");
        drop(queued);
    }

    /// What one whole-request placement costs the pool (statuses read, snapshots, the placer's decision) with many
    /// workers that each announce adapters and remember evicted adapters' ids, as a LoRA fleet's do.
    #[tokio::test]
    #[ignore = "timing, not a check; run by hand"]
    async fn pool_placement_latency_with_many_workers() {
        const WORKERS: usize = 64;
        let addrs: Vec<String> = (0..WORKERS).map(|i| format!("127.0.0.1:{}", 1000 + i)).collect();
        let pool = WorkerPool::with_placement(&addrs, PlacerConfig::default()).unwrap();
        let adapter = |i: usize| LoraAdapterInfo {
            name: format!("adapter-{i}"),
            cache_id: format!("adapter-{i}@{:016x}", i * 7919),
            rank: 16,
            on_demand: true,
        };
        for w in pool.workers() {
            w.set_status(WorkerStatus {
                ready: true,
                model: "SmolLM2-135M-Instruct".into(),
                block_size: 16,
                free_blocks: 1 << 20,
                kv_group_size: 90,
                lora_adapters: (0..8).map(adapter).collect(),
                lora_on_demand: true,
                lora_available: (0..64).map(|i| format!("adapter-{i}")).collect(),
                max_loras: 8,
                lora_seen: (0..MAX_REMEMBERED_LORA_IDS)
                    .map(|i| (format!("adapter-{i}"), adapter(i).cache_id))
                    .collect(),
                ..Default::default()
            });
        }
        let hashes: Vec<u64> = (1..=256).collect();
        for lora in [None, Some("adapter-3")] {
            let mut times = Vec::with_capacity(2000);
            for k in 0..2000 {
                let id = format!("r{k}");
                let req = PlaceRequest {
                    request_id: &id,
                    hashes: &hashes,
                    view: RequestView { prompt_tokens: 4096, max_tokens: 64, block_size: 16, budget_tokens: None },
                    publishes_prefix: false,
                    exclude: &[],
                    lora,
                };
                let t = std::time::Instant::now();
                let _ = pool.hashing();
                if let Some(name) = lora {
                    assert!(pool.lora_cache_id(name).is_some());
                }
                let placed = pool.place(&req).unwrap();
                times.push(t.elapsed());
                assert!(!placed.is_empty());
            }
            times.sort();
            let p = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
            println!("pool placement, {WORKERS} workers, lora {lora:?}: p50 {:?} p99 {:?}", p(0.5), p(0.99));
        }
    }

    #[tokio::test]
    async fn a_silent_worker_is_ejected_for_a_doubling_time_that_a_first_token_clears() {
        let pool = WorkerPool::new(&["127.0.0.1:1".into()]).unwrap();
        let w = &pool.workers()[0];
        let t0 = std::time::Instant::now();
        assert_eq!(w.eject_silent_at(t0), Some(EJECTION_BASE));
        assert!(w.ejected_for() > Duration::ZERO);
        assert_eq!(w.eject_silent_at(t0 + Duration::from_secs(1)), None, "the same stall: one strike");
        assert_eq!(w.eject_silent_at(t0 + EJECTION_BASE), Some(2 * EJECTION_BASE), "a second strike doubles it");
        let mut at = t0 + 3 * EJECTION_BASE;
        for _ in 0..20 {
            let out_for = w.eject_silent_at(at).unwrap();
            assert!(out_for <= EJECTION_MAX);
            at += out_for;
        }
        assert_eq!(w.eject_silent_at(at), Some(EJECTION_MAX));
        w.answered();
        assert_eq!(w.ejected_for(), Duration::ZERO, "a first token brings it back");
        assert_eq!(w.eject_silent_at(at), Some(EJECTION_BASE), "and clears the strikes");
    }

    #[tokio::test]
    async fn an_ejected_worker_is_placed_only_when_no_other_can_serve() {
        let addrs = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
        let pool = WorkerPool::with_placement(&addrs, PlacerConfig::default()).unwrap();
        for w in pool.workers() {
            w.set_status(WorkerStatus { ready: true, free_blocks: 1 << 20, kv_group_size: 90, ..Default::default() });
        }
        let hashes: Vec<u64> = (1..=4).collect();
        let req = PlaceRequest {
            request_id: "r1",
            hashes: &hashes,
            view: RequestView { prompt_tokens: 70, max_tokens: 16, block_size: 16, budget_tokens: None },
            publishes_prefix: true,
            exclude: &[],
            lora: None,
        };
        let placed =
            |pool: &WorkerPool| pool.place(&req).unwrap().iter().map(|c| c.worker.addr.clone()).collect::<Vec<_>>();
        pool.workers()[0].eject_silent("test");
        assert_eq!(placed(&pool), [addrs[1].as_str()], "the ejected worker is no candidate");
        pool.workers()[1].eject_silent("test");
        assert_eq!(placed(&pool).len(), 2, "with every worker ejected, serving beats refusing");
    }

    #[tokio::test]
    async fn a_worker_back_after_a_lease_blip_keeps_counting_the_requests_it_still_runs() {
        let pool = WorkerPool::dynamic(&[], PlacerConfig::default()).unwrap();
        let first = pool.add("127.0.0.1:1").unwrap().unwrap();
        let mut running = InFlight::new(first.load().clone(), 40);
        running.first_token();
        assert!(pool.remove("127.0.0.1:1"));
        drop(first);
        let back = pool.add("http://127.0.0.1:1").unwrap().unwrap();
        assert_eq!((back.load().decoding(), back.load().queued_tokens()), (1, 0), "still decoding there");
        drop(running);
        assert_eq!((back.load().decoding(), back.load().queued_tokens()), (0, 0));
        // Once nothing holds the old record, a worker coming back starts from it no more.
        assert!(pool.remove("127.0.0.1:1"));
        drop(back);
        let fresh = pool.add("127.0.0.1:1").unwrap().unwrap();
        assert!(pool.table.read().unwrap().departed.is_empty(), "dead records are dropped");
        assert_eq!(fresh.load().decoding(), 0);
    }

    #[tokio::test]
    async fn an_adapters_requests_go_only_to_ready_workers_that_serve_it() {
        let addrs = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string(), "127.0.0.1:3".to_string()];
        let pool = WorkerPool::with_placement(&addrs, PlacerConfig::default()).unwrap();
        let info = |name: &str, cache_id: &str| LoraAdapterInfo {
            name: name.into(),
            cache_id: cache_id.into(),
            rank: 8,
            ..Default::default()
        };
        let adapters = [vec![], vec![info("sql", "sql@1")], vec![info("sql", "sql@1"), info("chat", "chat@2")]];
        for (w, lora_adapters) in pool.workers().iter().zip(adapters) {
            w.set_status(WorkerStatus {
                ready: true,
                free_blocks: 1 << 20,
                kv_group_size: 90,
                lora_adapters,
                ..Default::default()
            });
        }
        assert_eq!(pool.lora_adapters(), vec![("chat".to_string(), 8), ("sql".to_string(), 8)]);
        assert_eq!(pool.lora_cache_id("chat").as_deref(), Some("chat@2"));
        assert_eq!(pool.lora_cache_id("nope"), None);
        let view = RequestView { prompt_tokens: 40, max_tokens: 16, block_size: 16, budget_tokens: None };
        let hashes: Vec<u64> = (1..=2).collect();
        let addrs_for = |lora: Option<&str>| -> Vec<String> {
            let req =
                PlaceRequest { request_id: "r", hashes: &hashes, view, publishes_prefix: true, exclude: &[], lora };
            let mut a: Vec<String> = pool.place(&req).unwrap().into_iter().map(|c| c.worker.addr.clone()).collect();
            a.sort();
            a
        };
        assert_eq!(addrs_for(None).len(), 3);
        assert_eq!(addrs_for(Some("sql")), vec!["127.0.0.1:2", "127.0.0.1:3"]);
        assert_eq!(addrs_for(Some("chat")), vec!["127.0.0.1:3"]);
        // Only ready workers count: with the third one down, nobody serves `chat`.
        pool.workers()[2].mark_down("gone".into());
        assert_eq!(pool.lora_cache_id("chat"), None);
        assert_eq!(addrs_for(Some("sql")), vec!["127.0.0.1:2"]);
        let req = PlaceRequest {
            request_id: "r",
            hashes: &hashes,
            view,
            publishes_prefix: true,
            exclude: &[],
            lora: Some("chat"),
        };
        assert!(pool.place(&req).is_err());
    }

    #[tokio::test]
    async fn an_adapters_requests_go_where_it_is_loaded_then_where_loading_it_displaces_nothing() {
        let addrs: Vec<String> = (1..=3).map(|i| format!("127.0.0.1:{i}")).collect();
        let pool = WorkerPool::with_placement(&addrs, PlacerConfig::default()).unwrap();
        let info =
            |name: &str| LoraAdapterInfo { name: name.into(), cache_id: format!("{name}@7"), rank: 8, on_demand: true };
        let on_demand = |loaded: Vec<LoraAdapterInfo>| WorkerStatus {
            ready: true,
            free_blocks: 1 << 20,
            kv_group_size: 90,
            lora_adapters: loaded,
            lora_on_demand: true,
            lora_available: vec!["a".into(), "b".into(), "c".into()],
            lora_load_seconds: 0.2,
            max_loras: 1,
            ..Default::default()
        };
        // 1 holds `a` (its only slot), 2 has a free slot, 3 loads nothing on demand.
        pool.workers()[0].set_status(on_demand(vec![info("a")]));
        pool.workers()[1].set_status(on_demand(Vec::new()));
        pool.workers()[2].set_status(WorkerStatus {
            ready: true,
            free_blocks: 1 << 20,
            kv_group_size: 90,
            ..Default::default()
        });
        assert!(pool.lora_servable("b") && !pool.lora_servable("zzz"));
        assert_eq!(
            pool.lora_adapters(),
            vec![("a".to_string(), 8), ("b".to_string(), 0), ("c".to_string(), 0)],
            "loadable adapters are listed, their rank unknown until loaded"
        );
        let view = RequestView { prompt_tokens: 40, max_tokens: 16, block_size: 16, budget_tokens: None };
        let hashes: Vec<u64> = (1..=2).collect();
        let place = |lora: &str| -> Vec<String> {
            let req = PlaceRequest {
                request_id: "r",
                hashes: &hashes,
                view,
                publishes_prefix: true,
                exclude: &[],
                lora: Some(lora),
            };
            pool.place(&req).unwrap().into_iter().map(|c| c.worker.addr.clone()).collect()
        };
        assert_eq!(place("a"), vec![addrs[0].clone(), addrs[1].clone()], "loaded first, then loadable; 3 never");
        assert_eq!(place("b"), vec![addrs[1].clone(), addrs[0].clone()], "a free slot beats evicting idle `a`");
        let (w0, w1) = (pool.workers()[0].status(), pool.workers()[1].status());
        let load0 = pool.workers()[0].load().clone();
        assert_eq!((w0.lora_slot("a", &load0), w0.lora_slot("b", &load0)), (LoraSlot::Loaded, LoraSlot::Evict));
        assert_eq!(w1.lora_slot("b", pool.workers()[1].load()), LoraSlot::Free);
        assert_eq!(w0.lora_load_cost(LoraSlot::Evict, 0.1), 0.4, "the load, and the evicted adapter's reload");
        assert_eq!((w1.lora_load_cost(LoraSlot::Free, 0.1), w0.lora_load_cost(LoraSlot::Loaded, 0.1)), (0.2, 0.0));
        let unmeasured = WorkerStatus { lora_load_seconds: 0.0, ..on_demand(Vec::new()) };
        assert_eq!(unmeasured.lora_load_cost(LoraSlot::Free, 0.1), 0.1);

        // A long request holds `a` on worker 1: its queue outweighs a load, so `a` goes where it must be loaded,
        // and `b` may not go there at all (it would wait for `a`'s slot) while worker 2 can take it.
        let busy = InFlight::with_adapter(load0.clone(), 4000, Some("a"));
        assert_eq!(w0.lora_slot("b", &load0), LoraSlot::Blocked);
        assert_eq!(place("a")[0], addrs[1]);
        assert_eq!(place("b"), vec![addrs[1].clone()]);
        pool.workers()[1].mark_down("gone".into());
        assert_eq!(place("b"), vec![addrs[0].clone()], "serving (after a wait) beats refusing");
        drop(busy);
        assert_eq!(load0.adapter_requests("a"), 0);
        assert_eq!(place("a")[0], addrs[0]);
        // A pinned adapter never gives way.
        pool.workers()[0].set_status(on_demand(vec![LoraAdapterInfo { on_demand: false, ..info("a") }]));
        assert_eq!(pool.workers()[0].status().lora_slot("b", &load0), LoraSlot::Blocked);

        // Unloaded (evicted) later, `a` keeps the cache id its blocks are salted with there.
        pool.workers()[0].set_status(on_demand(vec![info("a")]));
        assert_eq!(pool.lora_cache_id("a").as_deref(), Some("a@7"));
        let mut evicted = on_demand(vec![info("b")]);
        evicted.remember_lora_ids(&pool.workers()[0].status());
        pool.workers()[0].set_status(evicted);
        assert_eq!(pool.lora_cache_id("a").as_deref(), Some("a@7"));
    }

    #[tokio::test]
    async fn prefill_workers_take_remote_prefills_and_whole_requests_only_when_alone() {
        let addrs = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string(), "127.0.0.1:3".to_string()];
        let pool = WorkerPool::with_placement(&addrs, PlacerConfig::default()).unwrap();
        let roles = [WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Both];
        for (w, role) in pool.workers().iter().zip(roles) {
            w.set_status(WorkerStatus {
                ready: true,
                free_blocks: 1 << 20,
                kv_group_size: 90,
                role,
                ..Default::default()
            });
        }
        let view = RequestView { prompt_tokens: 300, max_tokens: 16, block_size: 16, budget_tokens: None };
        let hashes: Vec<u64> = (1..=18).collect();
        for i in 0..6 {
            let id = format!("r{i}");
            let req = PlaceRequest {
                request_id: &id,
                hashes: &hashes,
                view,
                publishes_prefix: true,
                exclude: &[],
                lora: None,
            };
            let whole: Vec<String> = pool.place(&req).unwrap().iter().map(|c| c.worker.addr.clone()).collect();
            assert!(!whole.contains(&addrs[0]), "a prefill worker takes no whole request: {whole:?}");
            assert_eq!(whole.len(), 2);
            assert_eq!(pool.place_remote_prefill(&req).unwrap().addr, addrs[0]);
        }
        // Without a ready prefill worker there is no remote prefill; with only prefill workers ready they serve.
        pool.workers()[0].mark_down("gone".into());
        let req =
            PlaceRequest { request_id: "x", hashes: &hashes, view, publishes_prefix: true, exclude: &[], lora: None };
        assert!(pool.place_remote_prefill(&req).is_none());
        pool.workers()[0].set_status(WorkerStatus {
            ready: true,
            free_blocks: 1 << 20,
            kv_group_size: 90,
            role: WorkerRole::Prefill,
            ..Default::default()
        });
        pool.workers()[1].mark_down("gone".into());
        pool.workers()[2].mark_down("gone".into());
        let alone: Vec<String> = pool.place(&req).unwrap().iter().map(|c| c.worker.addr.clone()).collect();
        assert_eq!(alone, [addrs[0].clone()], "serving beats refusing");
        // Round robin alternates the decode workers, however many remote prefills come between.
        let cfg = PlacerConfig { strategy: crate::placer::Strategy::RoundRobin, ..Default::default() };
        let rr = WorkerPool::with_placement(&addrs, cfg).unwrap();
        let roles = [WorkerRole::Decode, WorkerRole::Prefill, WorkerRole::Decode];
        for (w, role) in rr.workers().iter().zip(roles) {
            w.set_status(WorkerStatus { ready: true, role, ..Default::default() });
        }
        let firsts: Vec<String> = (0..4)
            .map(|_| {
                let whole = rr.place(&req).unwrap()[0].worker.addr.clone();
                assert_eq!(rr.place_remote_prefill(&req).unwrap().addr, addrs[1]);
                whole
            })
            .collect();
        assert_eq!(firsts, [&addrs[2], &addrs[0], &addrs[2], &addrs[0]].map(String::clone));
        assert_eq!(WorkerRole::from_health("prefill"), WorkerRole::Prefill);
        assert_eq!(WorkerRole::from_health(""), WorkerRole::Both);
        assert_eq!(WorkerRole::from_health("anything"), WorkerRole::Both);
    }

    #[test]
    fn rejects_bad_addresses() {
        assert!(WorkerPool::new(&[]).is_err());
        assert!(WorkerPool::new(&["http://exa mple:1".into()]).is_err());
    }

    #[tokio::test]
    async fn unreachable_worker_is_not_ready() {
        // Port 9 on loopback: nothing listens there.
        let pool = WorkerPool::new(&["127.0.0.1:9".into()]).unwrap();
        pool.refresh().await;
        assert!(!pool.any_ready());
        assert!(pool.workers()[0].status().last_error.is_some());
    }
}
