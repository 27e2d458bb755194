//! The peer tier: KV block groups moving between workers through the `Transfer` gRPC service (DESIGN §5).
//!
//! - [`TransferService`] serves `Fetch` from this worker's device pool (exact groups, in the arena's format) and
//!   its host and disk tiers. The engine thread owns them, so the service asks it for copies of the groups (a
//!   bounded chunk per round trip) and streams them in batches of at most `max_batch_bytes`, each block with an
//!   xxh3 checksum seeded by its hash.
//! - Disaggregated serving uses the same pull: a hint marked `remote_prefill` names a prefill worker that has just
//!   computed the prompt for this request, and is pulled without weighing it against prefilling (the router chose
//!   to move that prefill off this worker).
//! - [`PeerFetcher`] is the pulling side: before a request reaches the engine, when the router named a peer that
//!   holds more of the prompt's prefix than this worker ([`pb_worker::PeerHint`]), it weighs the pull (measured
//!   peer bandwidth, then decoding from host) against prefilling the same tokens, pulls within a deadline, verifies
//!   every block, and hands the verified run to the engine's host tier. Admission then onboards it like any host
//!   hit. A failed, late or corrupt pull costs nothing but the time it took: the request is prefilled as usual.
//! - [`PeerCounters`] owns the peer tier's counters for `Stats`; the fetcher owns the peer bandwidth estimate.
//! - Between GPU workers, both sides may carry the payloads over an NCCL link instead ([`crate::peer_link`]): the
//!   service answers `OpenLink` by joining the caller's communicator (a bounded number of joins at once: each holds
//!   a thread until the caller's rank comes), and a fetch that names a link sends each batch's metadata on the
//!   stream and its payloads on the link. The checksums are verified the same way.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::Stream;
use pagoda_proto::trace_context::{self, TransferDirection};
use pagoda_proto::transfer::transfer_client::TransferClient;
use pagoda_proto::transfer::transfer_server::{Transfer, TransferServer};
use pagoda_proto::transfer::{Block, BlockBatch, FetchRequest, OpenLinkReply, OpenLinkRequest};
use pagoda_proto::worker as pb_worker;
use tokio::sync::{Semaphore, mpsc};
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status};
use tracing::{Instrument, Span};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::engine::{EngineHandle, ExportFrom, PrefixProbe};
use crate::peer_link::{
    LINK_ID_BYTES, LINK_JOIN_TIMEOUT, LINK_TRANSFER_TIMEOUT, LendError, LinkEnd, LinkError, LinkFactory, ServedLinks,
    SharedPeerLinks, TakeLink, attach_payloads, linked_payload_bytes, split_payloads,
};
use crate::tiers::cost::Ewma;
use crate::tiers::{EncodedGroup, GroupCodec, native};

/// Most hashes one `Fetch` may name (4096 blocks: 64K tokens at 16 per block).
pub const MAX_FETCH_HASHES: usize = 4096;
/// Smallest and largest accepted `max_batch_bytes`.
pub const MIN_BATCH_BYTES: u64 = 64 * 1024;
pub const MAX_BATCH_BYTES: u64 = 16 * 1024 * 1024;
/// The batch size a fetcher asks for.
pub const DEFAULT_BATCH_BYTES: u64 = 4 * 1024 * 1024;
/// Longest accepted codec name in a received block: the one bound every store of a group shares.
const MAX_CODEC_BYTES: usize = pagoda_proto::MAX_CODEC_NAME_BYTES;
/// Bytes the server copies out of the engine per round trip: a few batches, so that a long prefix costs few
/// round trips (each waits for the end of an engine step) while the copy held in memory stays bounded.
const EXPORT_CHUNK_BYTES: u64 = 32 * 1024 * 1024;
/// Batches queued between the engine copy and the network.
const BATCHES_IN_FLIGHT: usize = 2;
/// The wait a worker suggests when its joins are at [`MAX_CONCURRENT_JOINS`]: the longest a join holds its slot.
const JOIN_BUSY_RETRY_AFTER_MS: u64 = LINK_JOIN_TIMEOUT.as_millis() as u64;
/// Concurrent `Fetch` streams one worker serves; more get RESOURCE_EXHAUSTED.
const MAX_CONCURRENT_SERVES: usize = 4;
/// Concurrent `OpenLink` joins one worker runs; more get RESOURCE_EXHAUSTED with a retry hint. Each holds a
/// blocking thread (and a half-made communicator) until the caller's rank joins, up to [`LINK_JOIN_TIMEOUT`], and
/// a peer opens one link at a time: a few cover the peers opening at once after a restart, without letting callers
/// that never join pile up threads.
const MAX_CONCURRENT_JOINS: usize = 2;
/// Longest a serve waits for the caller to take one batch. A caller that stops reading (but keeps the connection)
/// would otherwise hold one of the [`MAX_CONCURRENT_SERVES`] slots forever. Well past a puller's own deadline
/// ([`PeerFetchConfig::timeout`], 3 s by default), so a live puller on a slow link never meets it.
pub const SERVE_SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// A peer's bandwidth until the first pull is measured: loopback or a LAN does better, so pulls start only where
/// they clearly pay, and the measurements take over.
pub const PRIOR_PEER_BYTES_PER_S: f64 = 100e6;

/// The checksum of one block: xxh3-64 of its bytes, seeded by its chain hash, so a payload cannot pass for
/// another block's.
pub fn block_checksum(hash: u64, bytes: &[u8]) -> u64 {
    xxh3_64_with_seed(bytes, hash)
}

/// Peer-tier counters since start, shared by the serving and the pulling side.
#[derive(Debug, Default)]
pub struct PeerCounters {
    fetched_blocks: AtomicU64,
    fetched_bytes: AtomicU64,
    fetch_failures: AtomicU64,
    fetches: AtomicU64,
    fetch_micros: AtomicU64,
    served_blocks: AtomicU64,
    served_bytes: AtomicU64,
    linked_fetches: AtomicU64,
    link_refusals: AtomicU64,
    refused_hints: AtomicU64,
}

/// A copy of [`PeerCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PeerStats {
    pub fetched_blocks: u64,
    pub fetched_bytes: u64,
    pub fetch_failures: u64,
    pub fetches: u64,
    pub fetch_seconds: f64,
    pub served_blocks: u64,
    pub served_bytes: u64,
    /// Pulls whose payloads came over a device link (NCCL) rather than the gRPC stream.
    pub linked_fetches: u64,
    /// Link opens that failed or that the peer refused (it has no NCCL): pulls stayed on gRPC.
    pub link_refusals: u64,
    /// Hints not followed because they named no worker the kvstore lists: those requests prefilled.
    pub refused_hints: u64,
}

impl PeerCounters {
    pub fn snapshot(&self) -> PeerStats {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PeerStats {
            fetched_blocks: r(&self.fetched_blocks),
            fetched_bytes: r(&self.fetched_bytes),
            fetch_failures: r(&self.fetch_failures),
            fetches: r(&self.fetches),
            fetch_seconds: r(&self.fetch_micros) as f64 / 1e6,
            served_blocks: r(&self.served_blocks),
            served_bytes: r(&self.served_bytes),
            linked_fetches: r(&self.linked_fetches),
            link_refusals: r(&self.link_refusals),
            refused_hints: r(&self.refused_hints),
        }
    }

    /// A request's hint named no known peer and was not followed. Returns the count before this one.
    pub fn count_refused_hint(&self) -> u64 {
        self.refused_hints.fetch_add(1, Ordering::Relaxed)
    }
}

/// Why a pull stopped short. The verified blocks before the failure are still good.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("peer {addr} unreachable: {reason}")]
    Connect { addr: String, reason: String },
    #[error("peer answered {0}")]
    Status(#[from] Status),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("bad batch: {0}")]
    BadBatch(String),
    #[error("the peer sent {got} of {wanted} blocks")]
    Incomplete { got: usize, wanted: usize },
    #[error("device link: {0}")]
    Link(String),
}

/// What one pull brought back: the verified consecutive run from the first requested hash, and why it ended
/// early, if it did.
#[derive(Debug, Default)]
pub struct FetchOutcome {
    pub groups: Vec<(u64, EncodedGroup)>,
    pub bytes: u64,
    pub error: Option<FetchError>,
    /// The link the pull was given, back when the pull left it in step with the peer; `None` when it broke
    /// (dropping it aborted the communicator) or none was given.
    pub link: Option<(u64, Box<dyn LinkEnd>)>,
}

/// Checks one received batch against the hashes still expected (in order) and the bounds, and converts it. A batch
/// with any bad block is refused whole.
pub fn verify_batch(
    batch: BlockBatch,
    expected: &[u64],
    max_batch_bytes: u64,
    max_group_bytes: u64,
) -> Result<Vec<(u64, EncodedGroup)>, FetchError> {
    let bad = |m: String| Err(FetchError::BadBatch(m));
    if batch.blocks.is_empty() {
        return bad("an empty batch".into());
    }
    if batch.blocks.len() > expected.len() {
        return bad(format!("{} blocks where at most {} were still expected", batch.blocks.len(), expected.len()));
    }
    let total: u64 = batch.blocks.iter().map(|b| b.bytes.len() as u64).sum();
    if total > max_batch_bytes {
        return bad(format!("{total} bytes in a batch limited to {max_batch_bytes}"));
    }
    let mut out = Vec::with_capacity(batch.blocks.len());
    for (b, &want) in batch.blocks.into_iter().zip(expected) {
        if b.hash != want {
            return bad(format!("block {:#x} where {want:#x} was expected", b.hash));
        }
        if b.bytes.is_empty() || b.bytes.len() as u64 > max_group_bytes {
            return bad(format!("block {want:#x} has {} bytes (at most {max_group_bytes})", b.bytes.len()));
        }
        if b.codec.is_empty() || b.codec.len() > MAX_CODEC_BYTES {
            return bad(format!("block {want:#x} has a codec name of {} bytes", b.codec.len()));
        }
        // The checksum only proves the bytes arrived as the peer sent them; a codec no tier can decode is refused
        // here, and the length against the model's shape where the group is stored (`TierStore::import`).
        if b.codec.parse::<GroupCodec>().is_err() {
            return bad(format!("block {want:#x} has an unknown codec {:?}", b.codec));
        }
        if block_checksum(b.hash, &b.bytes) != b.checksum {
            return bad(format!("block {want:#x} fails its checksum"));
        }
        out.push((b.hash, EncodedGroup { codec: b.codec, bytes: b.bytes }));
    }
    Ok(out)
}

/// A `Transfer` client for the worker at `addr`, connected by `deadline`, that accepts batches of up to
/// `max_batch_bytes` of payload.
async fn connect(
    addr: &str,
    deadline: tokio::time::Instant,
    max_batch_bytes: u64,
) -> Result<TransferClient<tonic::transport::Channel>, FetchError> {
    let timeout = deadline.saturating_duration_since(tokio::time::Instant::now());
    let conn = async {
        let endpoint = pagoda_proto::tls::endpoint(addr)
            .map_err(|e| FetchError::Connect { addr: addr.to_owned(), reason: e.to_string() })?
            .connect_timeout(timeout)
            .tcp_nodelay(true);
        endpoint.connect().await.map_err(|e| FetchError::Connect { addr: addr.to_owned(), reason: e.to_string() })
    };
    let channel = tokio::time::timeout_at(deadline, conn).await.map_err(|_| FetchError::Timeout(timeout))??;
    // A batch may hold up to `max_batch_bytes` of payload plus per-block framing.
    let limit = usize::try_from(max_batch_bytes).unwrap_or(usize::MAX).saturating_add(64 * 1024);
    Ok(TransferClient::new(channel).max_decoding_message_size(limit))
}

/// Receives the payloads a linked batch announces over `end`, within `timeout`, and puts them into the batch.
/// Returns the end with the result; an end whose transfer failed must be dropped.
async fn receive_linked(
    batch: BlockBatch,
    mut end: Box<dyn LinkEnd>,
    max_batch_bytes: u64,
    max_group_bytes: u64,
    timeout: Duration,
) -> (Option<Box<dyn LinkEnd>>, Result<BlockBatch, FetchError>) {
    let total = match linked_payload_bytes(&batch, max_batch_bytes, max_group_bytes) {
        Ok(n) => n,
        Err(e) => return (None, Err(FetchError::BadBatch(e))),
    };
    let moved = tokio::task::spawn_blocking(move || {
        let mut payload = Vec::new();
        let r = end.transfer(None, Some((total, &mut payload)), timeout);
        (end, r, payload)
    })
    .await;
    match moved {
        Ok((end, Ok(()), payload)) => match attach_payloads(batch, &payload) {
            Ok(b) => (Some(end), Ok(b)),
            Err(e) => (None, Err(FetchError::BadBatch(e))),
        },
        Ok((_, Err(e), _)) => (None, Err(FetchError::Link(e.to_string()))),
        Err(e) => (None, Err(FetchError::Link(format!("the receiving thread failed: {e}")))),
    }
}

/// Pulls the groups under `hashes` from the worker at `addr` by `deadline`. Never fails as a whole: what was
/// verified before an error or the deadline is returned with the error. With `link` (its id at the peer and this
/// end), the payloads come over the link and the link is handed back in the outcome if it stayed in step.
pub async fn fetch(
    addr: &str,
    hashes: &[u64],
    max_batch_bytes: u64,
    max_group_bytes: u64,
    deadline: tokio::time::Instant,
    span: &Span,
    mut link: Option<(u64, Box<dyn LinkEnd>)>,
) -> FetchOutcome {
    let mut out = FetchOutcome::default();
    let timeout = deadline.saturating_duration_since(tokio::time::Instant::now());
    let mut client = match connect(addr, deadline, max_batch_bytes).await {
        Ok(c) => c,
        Err(e) => {
            // Nothing went over the link: it is still in step.
            out.error = Some(e);
            out.link = link;
            return out;
        }
    };
    let link_id = link.as_ref().map_or(0, |l| l.0);
    let mut request = Request::new(FetchRequest { hashes: hashes.to_vec(), max_batch_bytes, nccl_link: link_id });
    trace_context::inject_into_metadata(span, request.metadata_mut());
    let mut stream = match tokio::time::timeout_at(deadline, client.fetch(request)).await {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(status)) => {
            // A peer that no longer knows the link (it restarted, or dropped it) will never use it again.
            if status.code() != tonic::Code::NotFound {
                out.link = link;
            }
            out.error = Some(status.into());
            return out;
        }
        Err(_) => {
            out.error = Some(FetchError::Timeout(timeout));
            return out;
        }
    };
    loop {
        let batch = match tokio::time::timeout_at(deadline, stream.message()).await {
            Ok(Ok(Some(b))) => b,
            Ok(Ok(None)) => break,
            Ok(Err(status)) => {
                out.error = Some(status.into());
                break;
            }
            Err(_) => {
                out.error = Some(FetchError::Timeout(timeout));
                break;
            }
        };
        let batch = match link.take() {
            None => Ok(batch),
            Some((id, end)) => {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                let (end, batch) = receive_linked(batch, end, max_batch_bytes, max_group_bytes, left).await;
                link = end.map(|e| (id, e));
                batch
            }
        };
        match batch.and_then(|b| verify_batch(b, &hashes[out.groups.len()..], max_batch_bytes, max_group_bytes)) {
            Ok(groups) => {
                out.bytes += groups.iter().map(|(_, g)| g.len()).sum::<u64>();
                out.groups.extend(groups);
            }
            Err(e) => {
                out.error = Some(e);
                break;
            }
        }
    }
    // After an error the peer may still be sending on the link, or waiting for this end: only a clean end of
    // the stream leaves the two in step. A dropped end aborts the communicator, and the peer's send times out.
    if out.error.is_none() {
        out.link = link;
    }
    out
}

/// Opens a device link to the worker at `addr`: joins a fresh communicator as rank 0 while asking the peer to
/// join it as rank 1. On failure says whether the peer cannot do links at all (it has no NCCL), and why.
async fn open_link(addr: &str, factory: Arc<dyn LinkFactory>) -> Result<(u64, Box<dyn LinkEnd>), (bool, String)> {
    let deadline = tokio::time::Instant::now() + LINK_JOIN_TIMEOUT;
    let id = {
        let factory = factory.clone();
        tokio::task::spawn_blocking(move || factory.new_id())
            .await
            .map_err(|e| (false, e.to_string()))?
            .map_err(|e| (false, e.to_string()))?
    };
    let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let join = {
        let (id, cancel) = (id.clone(), cancel.clone());
        tokio::task::spawn_blocking(move || factory.join(&id, 0, LINK_JOIN_TIMEOUT, &cancel))
    };
    let asked = async {
        let mut client = connect(addr, deadline, MIN_BATCH_BYTES).await.map_err(|e| (false, e.to_string()))?;
        let reply = tokio::time::timeout_at(deadline, client.open_link(OpenLinkRequest { nccl_unique_id: id }))
            .await
            .map_err(|_| (false, "OpenLink timed out".to_owned()))?;
        reply.map(|r| r.into_inner().link).map_err(|st| (st.code() == tonic::Code::FailedPrecondition, st.to_string()))
    }
    .await;
    if asked.is_err() {
        // The peer will not join: stop waiting for it.
        cancel.store(true, Ordering::Relaxed);
    }
    let joined = join.await.map_err(|e| (false, e.to_string()));
    let link = asked?;
    let end = joined?.map_err(|e| (false, e.to_string()))?;
    Ok((link, end))
}

/// The batch size a pull asks for: the configured one, raised to hold the largest group this model can have (a
/// server refuses a group larger than the batch, so a model whose groups outgrow the default could never pull).
/// `None` when even [`MAX_BATCH_BYTES`] cannot hold one: such a model prefills.
pub fn pull_batch_bytes(configured: u64, max_group_bytes: u64) -> Option<u64> {
    let batch = configured.clamp(MIN_BATCH_BYTES, MAX_BATCH_BYTES).max(max_group_bytes);
    (batch <= MAX_BATCH_BYTES).then_some(batch)
}

/// The most a pull into the host tier may bring, as a divisor of the tier's capacity. Pulled groups wait there
/// until their request is admitted and onboards them; meanwhile they are the tier's least recently used, and
/// what other requests offload evicts those first. The other half is that headroom, and it keeps one long
/// prompt from flushing everything else the tier caches.
const PULL_HOST_SHARE_DIVISOR: u64 = 2;

/// Bytes one pull may import into a host tier of `host_capacity_bytes` (see [`PULL_HOST_SHARE_DIVISOR`]).
pub fn pull_host_budget(host_capacity_bytes: u64) -> u64 {
    host_capacity_bytes / PULL_HOST_SHARE_DIVISOR
}

/// How many groups of `group_bytes` fit in `budget_bytes`, at most `MAX_FETCH_HASHES`.
pub fn groups_within(budget_bytes: u64, group_bytes: u64) -> usize {
    usize::try_from(budget_bytes / group_bytes.max(1)).map_or(MAX_FETCH_HASHES, |n| n.min(MAX_FETCH_HASHES))
}

/// Keeps the leading `groups` whose sizes add up to at most `budget_bytes` and returns their bytes. The count cap
/// assumes groups of this worker's own format; a peer may send larger ones (another KV dtype), and importing
/// past the budget would evict the pull's own first groups.
fn keep_within(groups: &mut Vec<(u64, EncodedGroup)>, budget_bytes: u64) -> u64 {
    let (mut kept, mut n) = (0u64, 0);
    for (_, g) in groups.iter() {
        match kept.checked_add(g.len()) {
            Some(total) if total <= budget_bytes => (kept, n) = (total, n + 1),
            _ => break,
        }
    }
    groups.truncate(n);
    kept
}

/// Whether pulling `blocks` groups of about `group_bytes` each beats prefilling their tokens: the pull costs the
/// transfer at the peer bandwidth plus decoding the groups from host into device blocks.
pub fn pull_pays(
    blocks: usize,
    block_size: usize,
    group_bytes: u64,
    peer_bytes_per_s: f64,
    probe: &PrefixProbe,
) -> bool {
    if blocks == 0 {
        return false;
    }
    let bytes = blocks as f64 * group_bytes as f64;
    let pull_s = bytes / peer_bytes_per_s.max(1.0) + bytes / probe.host_load_bytes_per_s.max(1.0);
    let prefill_s = (blocks * block_size) as f64 / probe.prefill_tokens_per_s.max(1e-3);
    pull_s < prefill_s
}

/// How the pulling side runs.
#[derive(Debug, Clone)]
pub struct PeerFetchConfig {
    /// Longest a pull may take before the request goes on without it.
    pub timeout: Duration,
    /// Pulls in flight at once; a request that finds none free is prefilled.
    pub max_concurrent: usize,
    pub batch_bytes: u64,
    /// Whether a hinted pull asks the cost model first.
    pub policy: PullPolicy,
}

impl Default for PeerFetchConfig {
    fn default() -> PeerFetchConfig {
        PeerFetchConfig {
            timeout: Duration::from_secs(3),
            max_concurrent: 2,
            batch_bytes: DEFAULT_BATCH_BYTES,
            policy: PullPolicy::WhenItPays,
        }
    }
}

/// When a worker pulls the prefix a router's hint names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullPolicy {
    /// Only when [`pull_pays`] says the transfer and decode beat prefilling, from measured bandwidths and prefill
    /// speed.
    WhenItPays,
    /// Whenever the peer holds blocks this worker lacks (LMCache's retrieve-always). For links the cost model
    /// misjudges, and for tests that need a pull to happen whatever the machine's load makes of the measurements.
    Always,
}

/// The pulling side (see the module docs). Owns the peer bandwidth estimate and its device links to peers.
pub struct PeerFetcher {
    engine: EngineHandle,
    counters: Arc<PeerCounters>,
    cfg: PeerFetchConfig,
    permits: Arc<Semaphore>,
    bandwidth: Mutex<Ewma>,
    device_links: Option<Arc<dyn LinkFactory>>,
    peer_links: SharedPeerLinks,
}

impl PeerFetcher {
    pub fn new(engine: EngineHandle, counters: Arc<PeerCounters>, cfg: PeerFetchConfig) -> PeerFetcher {
        PeerFetcher {
            engine,
            counters,
            permits: Arc::new(Semaphore::new(cfg.max_concurrent.max(1))),
            cfg,
            bandwidth: Mutex::new(Ewma::new(PRIOR_PEER_BYTES_PER_S)),
            device_links: None,
            peer_links: SharedPeerLinks::default(),
        }
    }

    /// Moves payloads over device links (NCCL) to peers that accept one; others stay on gRPC.
    pub fn with_device_links(mut self, factory: Arc<dyn LinkFactory>) -> PeerFetcher {
        self.device_links = Some(factory);
        self
    }

    /// The link a pull to `addr` may use. Starts opening one in the background when there is none: the pull
    /// itself never waits for a communicator to come up.
    fn take_link(&self, addr: &str) -> Option<(u64, Box<dyn LinkEnd>)> {
        let factory = self.device_links.as_ref()?;
        let take = self.peer_links.lock().unwrap_or_else(|p| p.into_inner()).take(addr, Instant::now());
        match take {
            TakeLink::Use(id, end) => Some((id, end)),
            TakeLink::Grpc => None,
            TakeLink::Open => {
                let (factory, links, counters) = (factory.clone(), self.peer_links.clone(), self.counters.clone());
                let addr = addr.to_owned();
                tokio::spawn(async move {
                    let opened = open_link(&addr, factory).await;
                    if let Err((permanent, e)) = &opened {
                        counters.link_refusals.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(peer = %addr, permanent, error = %e, "no device link to peer; pulls use gRPC");
                    } else {
                        tracing::info!(peer = %addr, "device link to peer open");
                    }
                    let opened = opened.map_err(|(permanent, _)| permanent);
                    links.lock().unwrap_or_else(|p| p.into_inner()).opened(&addr, opened, Instant::now());
                });
                None
            }
        }
    }

    /// Measured peer bandwidth, bytes per second.
    pub fn peer_bytes_per_s(&self) -> f64 {
        self.bandwidth.lock().map(|b| b.value()).unwrap_or(PRIOR_PEER_BYTES_PER_S)
    }

    /// Pulls the part of `prompt`'s prefix that `hint` names and this worker lacks into the host tier, when that
    /// pays, and no more of it than half the host tier holds ([`pull_host_budget`]). Returns the blocks stored.
    /// Runs inside `parent` (the request's `worker.generate`); the pull gets its own `transfer` span, whose context
    /// travels to the peer.
    pub async fn pull_prefix(
        &self,
        prompt: &[u32],
        namespace: &str,
        hint: &pb_worker::PeerHint,
        parent: &Span,
    ) -> usize {
        let info = self.engine.model_info();
        let bs = info.block_size;
        // The last prompt token is always computed (its logits give the first output token).
        let usable = prompt.len().saturating_sub(1) / bs.max(1);
        let want = usable.min(hint.blocks as usize).min(MAX_FETCH_HASHES);
        if want == 0 {
            return 0;
        }
        let hashes = crate::cache::block_hashes(&info.model_id, namespace, &prompt[..want * bs], bs);
        let probe = match self.engine.probe_prefix(hashes.clone()).await {
            Ok(p) => p,
            Err(_) => return 0,
        };
        let missing = &hashes[probe.local_blocks.min(hashes.len())..];
        let gs = info.layout().group_size();
        let group_bytes = native::group_bytes(gs, bs, info.head_dim, info.kv_dtype) as u64;
        let max_group_bytes = native::group_bytes(gs, bs, info.head_dim, pagoda_kernels::KvDtype::F32) as u64;
        let Some(batch_bytes) = pull_batch_bytes(self.cfg.batch_bytes, max_group_bytes) else {
            tracing::debug!(max_group_bytes, "a group cannot fit the largest Transfer batch; prefilling");
            return 0;
        };
        // A remote prefill computed these blocks for this request: prefilling them here is what disaggregation
        // avoids, so the cost model is not asked.
        let required = hint.remote_prefill;
        let ask_cost_model = !required && self.cfg.policy == PullPolicy::WhenItPays;
        // Pulled groups land in the host tier. Without one, a remote prefill's groups (served in the device's own
        // format) are written straight into the device pool instead.
        let into_device = required && !probe.can_import;
        // Imported groups go into the host tier in order, and its LRU makes room by evicting the least recently
        // used: a pull larger than the tier evicts its own first groups, and onboarding adopts only a run that
        // continues the device prefix, so the whole pull would be wasted (after flushing the tier). Only the
        // leading groups that fit are pulled; the rest is prefilled. Seeding the device is bounded by its free
        // blocks instead.
        let host_budget = pull_host_budget(probe.host_capacity_bytes);
        let missing =
            if into_device { missing } else { &missing[..missing.len().min(groups_within(host_budget, group_bytes))] };
        if missing.is_empty()
            || !(probe.can_import || into_device)
            || (ask_cost_model && !pull_pays(missing.len(), bs, group_bytes, self.peer_bytes_per_s(), &probe))
        {
            return 0;
        }
        let deadline = tokio::time::Instant::now() + self.cfg.timeout;
        let permit = if required {
            tokio::time::timeout_at(deadline, self.permits.clone().acquire_owned()).await.ok().and_then(Result::ok)
        } else {
            self.permits.clone().try_acquire_owned().ok()
        };
        let Some(_permit) = permit else {
            tracing::debug!(required, "peer pulls at their limit; prefilling");
            return 0;
        };
        let to = if into_device { "device" } else { "host" };
        let span =
            parent.in_scope(|| trace_context::transfer_span(TransferDirection::Peer, &hint.address, to, missing.len()));
        let started = Instant::now();
        let link = self.take_link(&hint.address);
        let loan = link.is_some().then(|| PullLoan::new(self.peer_links.clone(), &hint.address));
        let mut outcome = fetch(&hint.address, missing, batch_bytes, max_group_bytes, deadline, &span, link)
            .instrument(span.clone())
            .await;
        if let Some(mut loan) = loan {
            if !outcome.groups.is_empty() {
                self.counters.linked_fetches.fetch_add(1, Ordering::Relaxed);
            }
            loan.back = outcome.link.take();
        }
        if outcome.error.is_none() && outcome.groups.len() < missing.len() {
            // The router's view was stale, or the peer evicted the rest meanwhile.
            outcome.error = Some(FetchError::Incomplete { got: outcome.groups.len(), wanted: missing.len() });
        }
        let secs = started.elapsed().as_secs_f64();
        let c = &self.counters;
        c.fetches.fetch_add(1, Ordering::Relaxed);
        c.fetch_micros.fetch_add((secs * 1e6) as u64, Ordering::Relaxed);
        span.record("bytes", outcome.bytes as i64);
        if let Some(e) = &outcome.error {
            c.fetch_failures.fetch_add(1, Ordering::Relaxed);
            span.record("otel.status_code", "ERROR");
            tracing::warn!(peer = %hint.address, error = %e, verified = outcome.groups.len(),
                "peer pull failed; prefilling what it did not bring");
        } else if let Ok(mut b) = self.bandwidth.lock() {
            // Only complete pulls measure the link: a short one may have waited on a peer that had nothing.
            b.update(outcome.bytes as f64 / secs.max(1e-6));
        }
        let mut bytes = outcome.bytes;
        if !into_device && bytes > host_budget {
            let got = outcome.groups.len();
            bytes = keep_within(&mut outcome.groups, host_budget);
            tracing::debug!(peer = %hint.address, got, kept = outcome.groups.len(), host_budget,
                "the peer's groups are larger than this worker's; importing only those that fit");
        }
        if outcome.groups.is_empty() {
            return 0;
        }
        let n = outcome.groups.len() as u64;
        let stored = if into_device {
            self.engine.seed_device(outcome.groups).await
        } else {
            self.engine.import_groups(outcome.groups).await
        };
        match stored {
            Ok(stored) => {
                c.fetched_blocks.fetch_add(n, Ordering::Relaxed);
                c.fetched_bytes.fetch_add(bytes, Ordering::Relaxed);
                tracing::debug!(peer = %hint.address, blocks = n, bytes, secs, "pulled prefix from peer");
                stored
            }
            Err(_) => 0,
        }
    }
}

/// A pull's loan of its device link to one peer, which the link table marks lent. Dropping the loan ends it on
/// every path out of the pull, including a pull future dropped mid-await (the client went away): otherwise the
/// peer's link would stay lent forever, and no later pull to it could use one. Without `back` (the pull did not
/// finish in step with the peer, or never finished) the link counts as broken: its end, dropped with the pull,
/// aborted the communicator, and a fresh one is opened after the back-off.
struct PullLoan {
    links: SharedPeerLinks,
    addr: String,
    /// The link, when the pull left it in step with the peer.
    back: Option<(u64, Box<dyn LinkEnd>)>,
}

impl PullLoan {
    fn new(links: SharedPeerLinks, addr: &str) -> PullLoan {
        PullLoan { links, addr: addr.to_owned(), back: None }
    }
}

impl Drop for PullLoan {
    fn drop(&mut self) {
        let back = self.back.take();
        self.links.lock().unwrap_or_else(|p| p.into_inner()).give_back(&self.addr, back, Instant::now());
    }
}

/// The serving side of `Transfer` (see the module docs). Cheap to clone.
#[derive(Clone)]
pub struct TransferService {
    engine: EngineHandle,
    counters: Arc<PeerCounters>,
    serving: Arc<Semaphore>,
    /// How this worker joins device links, or why it cannot.
    device_links: Result<Arc<dyn LinkFactory>, String>,
    served_links: Arc<Mutex<ServedLinks>>,
    /// [`MAX_CONCURRENT_JOINS`] permits, one held by each `OpenLink` join for as long as its thread runs.
    joining: Arc<Semaphore>,
    /// [`SERVE_SEND_TIMEOUT`], shorter in tests.
    send_timeout: Duration,
}

/// Sends `item` to the caller's stream within `timeout`. False when the caller went away or stopped reading: the
/// serve then ends, freeing its slot.
async fn send_within(
    tx: &mpsc::Sender<Result<BlockBatch, Status>>,
    item: Result<BlockBatch, Status>,
    timeout: Duration,
) -> bool {
    match tokio::time::timeout(timeout, tx.send(item)).await {
        Ok(sent) => sent.is_ok(),
        Err(_) => {
            tracing::warn!(?timeout, "the peer stopped reading a fetch; ending it");
            false
        }
    }
}

/// A served link lent to one fetch. Dropping the loan returns the link to the table if it still holds the end
/// (the fetch left it in step with the peer), and forgets it (the end dropped, aborting the communicator)
/// otherwise, on every path out of the fetch.
struct Loan {
    table: Arc<Mutex<ServedLinks>>,
    id: u64,
    end: Option<Box<dyn LinkEnd>>,
}

impl Drop for Loan {
    fn drop(&mut self) {
        self.table.lock().unwrap_or_else(|p| p.into_inner()).give_back(self.id, self.end.take());
    }
}

impl Loan {
    /// Sends one batch's payloads over the link, at most [`LINK_TRANSFER_TIMEOUT`]. On failure the end is gone,
    /// and the link will be forgotten.
    async fn send(&mut self, payload: Vec<u8>) -> Result<(), LinkError> {
        let Some(mut end) = self.end.take() else {
            return Err(LinkError::Failed("the link broke on an earlier batch".into()));
        };
        let (end, sent) = tokio::task::spawn_blocking(move || {
            let r = end.transfer(Some(&payload), None, LINK_TRANSFER_TIMEOUT);
            (end, r)
        })
        .await
        .map_err(|e| LinkError::Failed(format!("the sending thread failed: {e}")))?;
        sent?;
        self.end = Some(end);
        Ok(())
    }

    /// The fetch ended out of step with the peer: the link is forgotten when the loan ends.
    fn abandon(&mut self) {
        self.end = None;
    }
}

impl TransferService {
    pub fn new(engine: EngineHandle, counters: Arc<PeerCounters>) -> TransferService {
        TransferService {
            engine,
            counters,
            serving: Arc::new(Semaphore::new(MAX_CONCURRENT_SERVES)),
            device_links: Err("this worker runs on the CPU".into()),
            served_links: Arc::default(),
            joining: Arc::new(Semaphore::new(MAX_CONCURRENT_JOINS)),
            send_timeout: SERVE_SEND_TIMEOUT,
        }
    }

    /// How long a serve waits for the caller to take a batch before it ends (default [`SERVE_SEND_TIMEOUT`]).
    pub fn with_send_timeout(mut self, timeout: Duration) -> TransferService {
        self.send_timeout = timeout;
        self
    }

    /// How this worker joins device links (NCCL) that peers open, or why it cannot (answered to `OpenLink` as
    /// FAILED_PRECONDITION, so the peer stays on gRPC payloads).
    pub fn with_device_links(mut self, links: Result<Arc<dyn LinkFactory>, String>) -> TransferService {
        self.device_links = links;
        self
    }

    fn lend_link(&self, id: u64) -> Result<Loan, Status> {
        let end = self.served_links.lock().unwrap_or_else(|p| p.into_inner()).lend(id).map_err(|e| match e {
            LendError::Unknown => Status::not_found(format!("no device link {id} on this worker")),
            LendError::Busy => Status::failed_precondition(format!("device link {id} is serving another fetch")),
        })?;
        Ok(Loan { table: self.served_links.clone(), id, end: Some(end) })
    }

    /// The tonic server wrapper, ready for `Server::add_service`.
    pub fn into_server(self) -> TransferServer<TransferService> {
        TransferServer::new(self)
    }
}

/// Checks a `Fetch` request's bounds.
pub fn check_fetch(req: &FetchRequest) -> Result<(), Status> {
    if req.hashes.is_empty() {
        return Err(Status::invalid_argument("hashes is empty"));
    }
    if req.hashes.len() > MAX_FETCH_HASHES {
        return Err(Status::invalid_argument(format!(
            "{} hashes requested; at most {MAX_FETCH_HASHES} per fetch",
            req.hashes.len()
        )));
    }
    if !(MIN_BATCH_BYTES..=MAX_BATCH_BYTES).contains(&req.max_batch_bytes) {
        return Err(Status::invalid_argument(format!(
            "max_batch_bytes must be in {MIN_BATCH_BYTES}..={MAX_BATCH_BYTES}, got {}",
            req.max_batch_bytes
        )));
    }
    Ok(())
}

/// Splits `groups` (in order) into batches of at most `max_batch_bytes`, with checksums. A group larger than a
/// whole batch is FAILED_PRECONDITION.
pub fn into_batches(groups: Vec<(u64, EncodedGroup)>, max_batch_bytes: u64) -> Result<Vec<BlockBatch>, Status> {
    let mut out = Vec::new();
    let mut batch = BlockBatch::default();
    let mut bytes = 0;
    for (hash, g) in groups {
        if g.len() > max_batch_bytes {
            return Err(Status::failed_precondition(format!(
                "block {hash:#x} has {} bytes, more than max_batch_bytes {max_batch_bytes}",
                g.len()
            )));
        }
        if bytes + g.len() > max_batch_bytes {
            out.push(std::mem::take(&mut batch));
            bytes = 0;
        }
        bytes += g.len();
        batch.blocks.push(Block {
            hash,
            checksum: block_checksum(hash, &g.bytes),
            codec: g.codec,
            bytes: g.bytes,
            nccl_bytes: 0,
        });
    }
    if !batch.blocks.is_empty() {
        out.push(batch);
    }
    Ok(out)
}

type FetchStream = Pin<Box<dyn Stream<Item = Result<BlockBatch, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Transfer for TransferService {
    type FetchStream = FetchStream;

    async fn fetch(&self, request: Request<FetchRequest>) -> Result<Response<FetchStream>, Status> {
        let peer = request.remote_addr().map_or_else(|| "peer".to_owned(), |a| a.to_string());
        let span =
            trace_context::transfer_span(TransferDirection::Peer, "cache", &peer, request.get_ref().hashes.len());
        trace_context::continue_from_metadata(&span, request.metadata());
        let req = request.into_inner();
        if let Err(st) = check_fetch(&req) {
            span.record("otel.status_code", "ERROR");
            return Err(st);
        }
        let Ok(permit) = self.serving.clone().try_acquire_owned() else {
            span.record("otel.status_code", "ERROR");
            return Err(Status::resource_exhausted(format!(
                "this worker serves {MAX_CONCURRENT_SERVES} fetches at once; retry later"
            )));
        };
        let mut loan = match req.nccl_link {
            0 => None,
            id => match self.lend_link(id) {
                Ok(l) => Some(l),
                Err(st) => {
                    span.record("otel.status_code", "ERROR");
                    return Err(st);
                }
            },
        };
        let (tx, rx) = mpsc::channel::<Result<BlockBatch, Status>>(BATCHES_IN_FLIGHT);
        let (engine, counters, send_timeout) = (self.engine.clone(), self.counters.clone(), self.send_timeout);
        let task_span = span.clone();
        tokio::spawn(
            async move {
                let _permit = permit;
                let mut sent_bytes = 0u64;
                // Whether the stream ended cleanly: an error status, or a caller that went away, leaves the link
                // out of step with the caller, which drops its end, so this side drops its own.
                let clean = async {
                    let mut next = 0;
                    while next < req.hashes.len() {
                        let chunk = match engine
                            .export_groups(req.hashes[next..].to_vec(), EXPORT_CHUNK_BYTES, ExportFrom::DeviceFirst)
                            .await
                        {
                            Ok(c) if !c.is_empty() => c,
                            Ok(_) => break,
                            Err(e) => {
                                send_within(&tx, Err(Status::unavailable(e.to_string())), send_timeout).await;
                                return false;
                            }
                        };
                        next += chunk.len();
                        let batches = match into_batches(chunk, req.max_batch_bytes) {
                            Ok(b) => b,
                            Err(st) => {
                                task_span.record("otel.status_code", "ERROR");
                                send_within(&tx, Err(st), send_timeout).await;
                                return false;
                            }
                        };
                        for b in batches {
                            let (n, bytes) =
                                (b.blocks.len() as u64, b.blocks.iter().map(|x| x.bytes.len() as u64).sum());
                            let (b, payload) = match &loan {
                                Some(_) => {
                                    let (meta, payload) = split_payloads(b);
                                    (meta, Some(payload))
                                }
                                None => (b, None),
                            };
                            if !send_within(&tx, Ok(b), send_timeout).await {
                                return false;
                            }
                            if let (Some(l), Some(payload)) = (&mut loan, payload)
                                && let Err(e) = l.send(payload).await
                            {
                                task_span.record("otel.status_code", "ERROR");
                                let st = Status::aborted(format!("device link: {e}"));
                                send_within(&tx, Err(st), send_timeout).await;
                                return false;
                            }
                            sent_bytes += bytes;
                            counters.served_blocks.fetch_add(n, Ordering::Relaxed);
                            counters.served_bytes.fetch_add(bytes, Ordering::Relaxed);
                        }
                    }
                    true
                }
                .await;
                if !clean && let Some(l) = &mut loan {
                    l.abandon();
                }
                task_span.record("bytes", sent_bytes as i64);
            }
            .instrument(span),
        );
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn open_link(&self, request: Request<OpenLinkRequest>) -> Result<Response<OpenLinkReply>, Status> {
        let id = request.into_inner().nccl_unique_id;
        if id.len() != LINK_ID_BYTES {
            return Err(Status::invalid_argument(format!(
                "nccl_unique_id has {} bytes; it must have {LINK_ID_BYTES}",
                id.len()
            )));
        }
        let factory = match &self.device_links {
            Ok(f) => f.clone(),
            Err(why) => {
                return Err(Status::failed_precondition(format!(
                    "this worker has no device links ({why}); fetch with payloads inline"
                )));
            }
        };
        if !self.served_links.lock().unwrap_or_else(|p| p.into_inner()).has_room() {
            return Err(Status::resource_exhausted("every device link of this worker is serving a fetch"));
        }
        let Ok(permit) = self.joining.clone().try_acquire_owned() else {
            let mut status = Status::resource_exhausted(format!(
                "this worker joins {MAX_CONCURRENT_JOINS} device links at once; retry later"
            ));
            status
                .metadata_mut()
                .insert(pagoda_proto::BUSY_RETRY_AFTER_MS, MetadataValue::from(JOIN_BUSY_RETRY_AFTER_MS));
            return Err(status);
        };
        // The join waits for the caller's rank, bounded; if the caller gives up, the join times out on its own. The
        // permit goes with the thread, not this handler: a caller that went away must not free a slot whose thread
        // still waits.
        let never_cancelled = std::sync::atomic::AtomicBool::new(false);
        let joined = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            factory.join(&id, 1, LINK_JOIN_TIMEOUT, &never_cancelled)
        })
        .await
        .map_err(|e| Status::internal(format!("the joining thread failed: {e}")))?;
        let end = joined.map_err(|e| match e {
            LinkError::Timeout => Status::deadline_exceeded("the caller's rank did not join in time"),
            LinkError::BadId(why) => Status::invalid_argument(why),
            LinkError::Failed(why) => Status::unavailable(format!("NCCL failed to join: {why}")),
        })?;
        let link = self.served_links.lock().unwrap_or_else(|p| p.into_inner()).insert(end);
        match link {
            Some(link) => Ok(Response::new(OpenLinkReply { link })),
            None => Err(Status::resource_exhausted("every device link of this worker is serving a fetch")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer_link::tests::Unjoined;

    fn group(seed: u8, n: usize) -> EncodedGroup {
        EncodedGroup { codec: "f16".into(), bytes: (0..n).map(|i| seed.wrapping_add(i as u8)).collect() }
    }

    /// A model whose f32 groups outgrow the default batch (80 layers × 8 kv-heads × 128 dims × 16 slots: 10 MiB)
    /// asks for a batch that holds one, which a server then serves; one past the largest batch prefills.
    #[test]
    fn a_pull_asks_for_a_batch_that_holds_the_models_largest_group() {
        let big = native::group_bytes(80 * 8, 16, 128, pagoda_kernels::KvDtype::F32) as u64;
        assert!(big > DEFAULT_BATCH_BYTES);
        let small = native::group_bytes(30 * 3, 16, 64, pagoda_kernels::KvDtype::F32) as u64;
        assert_eq!(pull_batch_bytes(DEFAULT_BATCH_BYTES, small), Some(DEFAULT_BATCH_BYTES));
        assert_eq!(pull_batch_bytes(1, small), Some(MIN_BATCH_BYTES.max(small)));
        let batch = pull_batch_bytes(DEFAULT_BATCH_BYTES, big).expect("fits the largest batch");
        assert_eq!(batch, big);
        let g = vec![(7u64, group(1, big as usize))];
        assert!(into_batches(g.clone(), DEFAULT_BATCH_BYTES).is_err(), "the default batch refuses the group");
        let batches = into_batches(g, batch).unwrap();
        assert_eq!(verify_batch(batches[0].clone(), &[7], batch, big).unwrap().len(), 1);
        assert_eq!(pull_batch_bytes(DEFAULT_BATCH_BYTES, MAX_BATCH_BYTES + 1), None);
    }

    #[test]
    fn batches_respect_the_byte_bound_and_carry_checksums() {
        let groups: Vec<(u64, EncodedGroup)> = (0..7u64).map(|h| (h + 100, group(h as u8, 300))).collect();
        let batches = into_batches(groups.clone(), 1000).unwrap();
        // 3 groups of 300 fit in 1000 bytes: 3 + 3 + 1.
        assert_eq!(batches.iter().map(|b| b.blocks.len()).collect::<Vec<_>>(), vec![3, 3, 1]);
        let expected: Vec<u64> = groups.iter().map(|g| g.0).collect();
        let mut got = Vec::new();
        for b in batches {
            got.extend(verify_batch(b, &expected[got.len()..], 1000, 300).unwrap());
        }
        assert_eq!(got, groups);
        // One group larger than a batch is refused with a clear status.
        let err = into_batches(vec![(1, group(0, 2000))], 1000).unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    }

    #[test]
    fn bad_batches_are_refused_whole() {
        let good = into_batches(vec![(1, group(1, 100)), (2, group(2, 100))], 1 << 20).unwrap().remove(0);
        let expected = [1, 2];
        assert!(verify_batch(good.clone(), &expected, 1 << 20, 100).is_ok());
        let cases: Vec<(&str, BlockBatch, u64, u64)> = vec![
            (
                "flipped byte",
                {
                    let mut b = good.clone();
                    b.blocks[1].bytes[7] ^= 1;
                    b
                },
                1 << 20,
                100,
            ),
            (
                "wrong order",
                {
                    let mut b = good.clone();
                    b.blocks.swap(0, 1);
                    b
                },
                1 << 20,
                100,
            ),
            (
                "payload under another hash",
                {
                    let mut b = good.clone();
                    b.blocks[0].hash = 2;
                    b
                },
                1 << 20,
                100,
            ),
            ("over the batch bound", good.clone(), 150, 100),
            ("group larger than the model's", good.clone(), 1 << 20, 99),
            ("empty", BlockBatch::default(), 1 << 20, 100),
            (
                "empty codec",
                {
                    let mut b = good.clone();
                    b.blocks[0].codec.clear();
                    b
                },
                1 << 20,
                100,
            ),
            (
                "unknown codec, checksum right",
                {
                    let mut b = good.clone();
                    b.blocks[1].codec = "zstd".into();
                    b
                },
                1 << 20,
                100,
            ),
        ];
        for (name, batch, max_batch, max_group) in cases {
            assert!(
                matches!(verify_batch(batch, &expected, max_batch, max_group), Err(FetchError::BadBatch(_))),
                "{name} accepted"
            );
        }
        // More blocks than were asked for.
        assert!(verify_batch(good, &expected[..1], 1 << 20, 100).is_err());
    }

    #[test]
    fn fetch_requests_are_bounded() {
        let ok = FetchRequest { hashes: vec![1, 2], max_batch_bytes: DEFAULT_BATCH_BYTES, nccl_link: 0 };
        assert!(check_fetch(&ok).is_ok());
        for bad in [
            FetchRequest { hashes: vec![], max_batch_bytes: DEFAULT_BATCH_BYTES, nccl_link: 0 },
            FetchRequest { hashes: vec![0; MAX_FETCH_HASHES + 1], max_batch_bytes: DEFAULT_BATCH_BYTES, nccl_link: 0 },
            FetchRequest { hashes: vec![1], max_batch_bytes: MIN_BATCH_BYTES - 1, nccl_link: 0 },
            FetchRequest { hashes: vec![1], max_batch_bytes: MAX_BATCH_BYTES + 1, nccl_link: 0 },
        ] {
            assert_eq!(check_fetch(&bad).unwrap_err().code(), tonic::Code::InvalidArgument);
        }
    }

    /// A `Transfer` server that answers every fetch with fixed batches, then (optionally) hangs.
    #[derive(Clone)]
    struct Scripted {
        batches: Vec<BlockBatch>,
        hang: bool,
    }

    #[tonic::async_trait]
    impl Transfer for Scripted {
        type FetchStream = FetchStream;

        async fn fetch(&self, request: Request<FetchRequest>) -> Result<Response<FetchStream>, Status> {
            check_fetch(request.get_ref())?;
            let items: Vec<Result<BlockBatch, Status>> = self.batches.iter().cloned().map(Ok).collect();
            let stream = futures::stream::iter(items);
            if self.hang {
                Ok(Response::new(Box::pin(futures::StreamExt::chain(stream, futures::stream::pending()))))
            } else {
                Ok(Response::new(Box::pin(stream)))
            }
        }

        async fn open_link(&self, _: Request<OpenLinkRequest>) -> Result<Response<OpenLinkReply>, Status> {
            Err(Status::failed_precondition("a scripted peer has no device links"))
        }
    }

    async fn serve(s: Scripted) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        tokio::spawn(
            tonic::transport::Server::builder().add_service(TransferServer::new(s)).serve_with_incoming(incoming),
        );
        addr
    }

    fn deadline(ms: u64) -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_millis(ms)
    }

    #[tokio::test]
    async fn a_corrupt_batch_is_dropped_and_what_came_before_is_kept() {
        let groups: Vec<(u64, EncodedGroup)> = (1..=6u64).map(|h| (h, group(h as u8, 40_000))).collect();
        let hashes: Vec<u64> = groups.iter().map(|g| g.0).collect();
        let mut batches = into_batches(groups.clone(), MIN_BATCH_BYTES).unwrap();
        assert_eq!(batches.len(), 6, "one 40 KB group per 64 KiB batch");
        batches[2].blocks[0].bytes[100] ^= 0x10;
        let addr = serve(Scripted { batches, hang: false }).await;
        let out = fetch(&addr, &hashes, MIN_BATCH_BYTES, 40_000, deadline(5000), &Span::none(), None).await;
        assert!(matches!(out.error, Some(FetchError::BadBatch(_))), "{:?}", out.error);
        assert_eq!(out.groups, groups[..2].to_vec(), "the batches before the corrupt one are verified and kept");
        assert_eq!(out.bytes, 80_000);

        // A peer that stops sending: the deadline ends the pull with what arrived.
        let batches = into_batches(groups[..3].to_vec(), MIN_BATCH_BYTES).unwrap();
        let addr = serve(Scripted { batches, hang: true }).await;
        let t0 = Instant::now();
        let out = fetch(&addr, &hashes, MIN_BATCH_BYTES, 40_000, deadline(300), &Span::none(), None).await;
        assert!(matches!(out.error, Some(FetchError::Timeout(_))), "{:?}", out.error);
        assert_eq!(out.groups.len(), 3);
        assert!(t0.elapsed() < Duration::from_secs(3));

        // Nobody listening; and a request the server refuses as out of bounds.
        let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().to_string();
        let out = fetch(&dead, &hashes, MIN_BATCH_BYTES, 40_000, deadline(2000), &Span::none(), None).await;
        assert!(matches!(out.error, Some(FetchError::Connect { .. } | FetchError::Timeout(_))), "{:?}", out.error);
        let out = fetch(&addr, &hashes, 1, 40_000, deadline(2000), &Span::none(), None).await;
        match out.error {
            Some(FetchError::Status(st)) => assert_eq!(st.code(), tonic::Code::InvalidArgument),
            other => panic!("{other:?}"),
        }
    }

    /// A caller that opens fetches and never reads them: each serve fills its queue, waits at most the send
    /// timeout, then ends and frees its slot, so later fetches are served again. What it had queued reaches the
    /// caller, then its stream ends short.
    #[tokio::test]
    async fn a_caller_that_stops_reading_frees_its_serve_slot() {
        use crate::engine::{Engine, EngineConfig, FakeRunner};
        use crate::tiers::TierConfig;
        use futures::StreamExt;

        let tiers = TierConfig { data_dir: None, host_bytes: 64 << 20, disk_bytes: 0 };
        let cfg = EngineConfig { block_size: 4, tiers, ..EngineConfig::default() };
        let engine = Engine::start_with(cfg, |_| Ok(FakeRunner::new(32, 64, Duration::ZERO))).unwrap();
        let info = engine.model_info().clone();
        let bytes = native::group_bytes(info.layout().group_size(), info.block_size, info.head_dim, info.kv_dtype);
        let per_batch = MIN_BATCH_BYTES as usize / bytes;
        // More batches than the queue holds, so a serve whose caller does not read blocks.
        let n = (BATCHES_IN_FLIGHT + 2) * per_batch;
        let codec = native::codec_name(info.kv_dtype);
        let groups: Vec<(u64, EncodedGroup)> =
            (1..=n as u64).map(|h| (h, EncodedGroup { codec: codec.into(), bytes: vec![0; bytes] })).collect();
        assert_eq!(engine.import_groups(groups).await.unwrap(), n);

        let timeout = Duration::from_millis(500);
        let svc = TransferService::new(engine.clone(), Arc::default()).with_send_timeout(timeout);
        let req = || {
            Request::new(FetchRequest {
                hashes: (1..=n as u64).collect(),
                max_batch_bytes: MIN_BATCH_BYTES,
                nccl_link: 0,
            })
        };
        let mut unread = Vec::new();
        for _ in 0..MAX_CONCURRENT_SERVES {
            unread.push(svc.fetch(req()).await.unwrap().into_inner());
        }
        let started = Instant::now();
        assert_eq!(svc.fetch(req()).await.err().map(|st| st.code()), Some(tonic::Code::ResourceExhausted));
        let served = loop {
            match svc.fetch(req()).await {
                Ok(r) => break r.into_inner(),
                Err(st) => assert_eq!(st.code(), tonic::Code::ResourceExhausted),
            }
            assert!(started.elapsed() < Duration::from_secs(20), "no serve slot freed after the send timeout");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(started.elapsed() >= timeout / 2, "the slots were held until the timeout");
        // The stalled serve ended: its stream gives what it queued, then ends without the rest.
        let stalled: Vec<_> = unread.remove(0).collect().await;
        assert!(stalled.iter().all(Result::is_ok));
        let got: usize = stalled.iter().flatten().map(|b| b.blocks.len()).sum();
        assert!(got < n, "a stalled serve does not finish: {got} of {n}");
        // A caller that reads gets everything.
        let all: Vec<_> = served.collect().await;
        assert_eq!(all.iter().flatten().map(|b| b.blocks.len()).sum::<usize>(), n);
        engine.shutdown();
    }

    /// A link factory whose joins wait for [`GatedJoins::release`] (or their timeout), as joins wait for a caller
    /// whose rank never comes.
    #[derive(Default)]
    struct GatedJoins {
        joining: std::sync::atomic::AtomicUsize,
        released: Mutex<bool>,
        wake: std::sync::Condvar,
    }

    impl GatedJoins {
        fn release(&self) {
            *self.released.lock().unwrap() = true;
            self.wake.notify_all();
        }
    }

    impl LinkFactory for GatedJoins {
        fn new_id(&self) -> Result<Vec<u8>, LinkError> {
            Ok(vec![1; LINK_ID_BYTES])
        }

        fn join(
            &self,
            _: &[u8],
            _: usize,
            timeout: Duration,
            _: &std::sync::atomic::AtomicBool,
        ) -> Result<Box<dyn LinkEnd>, LinkError> {
            self.joining.fetch_add(1, Ordering::SeqCst);
            let released = self.released.lock().unwrap();
            let (released, _) = self.wake.wait_timeout_while(released, timeout, |r| !*r).unwrap();
            let joined = *released;
            drop(released);
            self.joining.fetch_sub(1, Ordering::SeqCst);
            if joined { Ok(Box::new(Unjoined)) } else { Err(LinkError::Timeout) }
        }
    }

    /// `OpenLink` joins hold a thread each until the caller's rank comes (up to the join timeout): past
    /// [`MAX_CONCURRENT_JOINS`] at once, more are refused as busy with a retry hint instead of taking another
    /// thread. A caller that gives up does not free its slot while its join still runs; once the joins end, links
    /// open again.
    #[tokio::test]
    async fn link_joins_are_bounded_and_extra_ones_refused_as_busy() {
        use crate::engine::{Engine, EngineConfig, FakeRunner};

        let engine =
            Engine::start_with(EngineConfig::default(), |_| Ok(FakeRunner::new(32, 64, Duration::ZERO))).unwrap();
        let gate = Arc::new(GatedJoins::default());
        let factory: Arc<dyn LinkFactory> = gate.clone();
        let svc = TransferService::new(engine.clone(), Arc::default()).with_device_links(Ok(factory));
        let req = || Request::new(OpenLinkRequest { nccl_unique_id: vec![7; LINK_ID_BYTES] });
        let mut joins: Vec<_> = (0..MAX_CONCURRENT_JOINS)
            .map(|_| {
                let svc = svc.clone();
                tokio::spawn(async move { svc.open_link(req()).await })
            })
            .collect();
        let started = Instant::now();
        while gate.joining.load(Ordering::SeqCst) < MAX_CONCURRENT_JOINS {
            assert!(started.elapsed() < Duration::from_secs(10), "the joins did not start");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let busy = |st: &Status| st.metadata().get(pagoda_proto::BUSY_RETRY_AFTER_MS).is_some();
        let err = svc.open_link(req()).await.expect_err("one join too many");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
        assert!(busy(&err), "a retry hint: {err:?}");
        // The caller of the first join goes away: its join still holds a thread, so it still holds its slot.
        let gone = joins.remove(0);
        gone.abort();
        let _ = gone.await;
        let err = svc.open_link(req()).await.expect_err("the abandoned join still runs");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
        assert_eq!(gate.joining.load(Ordering::SeqCst), MAX_CONCURRENT_JOINS, "no join past the bound started");

        gate.release();
        for j in joins {
            assert!(j.await.unwrap().is_ok(), "the admitted joins open their links");
        }
        while gate.joining.load(Ordering::SeqCst) > 0 {
            assert!(started.elapsed() < Duration::from_secs(10), "the abandoned join did not end");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut opened = None;
        while opened.is_none() {
            match svc.open_link(req()).await {
                Ok(r) => opened = Some(r.into_inner().link),
                // The abandoned join's thread may still be handing its slot back.
                Err(st) => {
                    assert_eq!(st.code(), tonic::Code::ResourceExhausted, "{st:?}");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            assert!(started.elapsed() < Duration::from_secs(10), "no join slot came back");
        }
        assert_ne!(opened, Some(0));
        engine.shutdown();
    }

    /// A pull dropped mid-await (its client went away) still ends its link loan: the link leaves the lent state,
    /// so the peer gets a fresh link after the back-off instead of none ever again. A pull that finished in step
    /// hands its link back for the next pull.
    #[tokio::test]
    async fn a_dropped_pull_gives_its_link_back() {
        let links = SharedPeerLinks::default();
        let addr = "peer:1";
        let later = || Instant::now() + Duration::from_secs(3600);
        let lend = |links: &SharedPeerLinks| match links.lock().unwrap().take(addr, Instant::now()) {
            TakeLink::Use(id, end) => (id, end),
            _ => panic!("the idle link is lent"),
        };
        links.lock().unwrap().opened(addr, Ok((7, Box::new(Unjoined))), Instant::now());
        let (id, end) = lend(&links);
        let pull = {
            let loan = PullLoan::new(links.clone(), addr);
            async move {
                let _loan = loan;
                let _end = (id, end);
                futures::future::pending::<()>().await;
            }
        };
        let task = tokio::spawn(pull);
        tokio::task::yield_now().await;
        task.abort();
        let _ = task.await;
        assert!(
            matches!(links.lock().unwrap().take(addr, later()), TakeLink::Open),
            "not left lent: a fresh link is opened once the back-off is over"
        );

        links.lock().unwrap().opened(addr, Ok((8, Box::new(Unjoined))), Instant::now());
        let (id, end) = lend(&links);
        let mut loan = PullLoan::new(links.clone(), addr);
        loan.back = Some((id, end));
        drop(loan);
        assert!(matches!(lend(&links), (8, _)), "a link back in step is lent to the next pull");
    }

    #[test]
    fn a_pull_is_bounded_by_half_the_host_tier() {
        assert_eq!(pull_host_budget(64 << 20), 32 << 20);
        assert_eq!(groups_within(pull_host_budget(10_000), 1_000), 5);
        assert_eq!(groups_within(pull_host_budget(1_999), 1_000), 0, "not even one group fits: prefill");
        assert_eq!(groups_within(u64::MAX, 1), MAX_FETCH_HASHES);
        assert_eq!(groups_within(1_000, 0), MAX_FETCH_HASHES.min(1_000));

        // Larger groups than expected: only the leading ones within the budget are kept.
        let mut groups: Vec<(u64, EncodedGroup)> = (1..=4u64).map(|h| (h, group(h as u8, 300))).collect();
        assert_eq!(keep_within(&mut groups, 1_000), 900);
        assert_eq!(groups.iter().map(|g| g.0).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(keep_within(&mut groups, 299), 0);
        assert!(groups.is_empty());
    }

    #[test]
    fn pulls_pay_only_when_faster_than_prefill() {
        let probe = PrefixProbe {
            local_blocks: 0,
            can_import: true,
            prefill_tokens_per_s: 1000.0,
            host_load_bytes_per_s: 1e9,
            host_capacity_bytes: 64 << 20,
        };
        // 10 groups of 1 MB over 100 MB/s: 100 ms + 10 ms decode, against 160 tokens at 1000 tok/s = 160 ms.
        assert!(pull_pays(10, 16, 1_000_000, 100e6, &probe));
        // Over 10 MB/s the pull takes a second.
        assert!(!pull_pays(10, 16, 1_000_000, 10e6, &probe));
        // A much faster prefill makes even a fast link lose.
        let fast = PrefixProbe { prefill_tokens_per_s: 1e6, ..probe };
        assert!(!pull_pays(10, 16, 1_000_000, 100e6, &fast));
        assert!(!pull_pays(0, 16, 1_000_000, 100e6, &probe));
    }
}
