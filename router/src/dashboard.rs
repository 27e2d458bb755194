//! The operator dashboard at `/dashboard`: a plain HTML/CSS/JS page (embedded in the binary, no build step) that
//! polls `/dashboard/api/state` once a second, and the state behind it.
//!
//! This module owns the dashboard's routes, its login (the admin key traded once for an HttpOnly, SameSite=Strict
//! session cookie, see [`crate::auth`]), and the cache of what it fetches from the fleet: the kvstore nodes' raft
//! `Status`, with the workers' `Stats` from the snapshot `/metrics` shares ([`crate::stats_cache`]). The cache is
//! refreshed at most once per [`FLEET_MAX_AGE`] and by one request at a time, so any number of open dashboards cost
//! the workers one `Stats` call a second, scrapes included.
//!
//! Access follows the admin endpoints ([`crate::access::admin_access`]): the session cookie or `Authorization:
//! Bearer <admin key>`; open in dev mode (no keys file, no admin key); 403 with a keys file but no admin key.

pub mod kvstore;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{FromRequest, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Json};
use pagoda_proto::worker::StatsResponse;
use serde::{Deserialize, Serialize};

use crate::access::admin_access;
use crate::auth::{ADMIN_SESSION, MAX_KEY_BYTES};
use crate::error::ApiError;
use crate::extract::within_client_timeout;
use crate::placer::DecisionRecord;
use crate::server::{AppState, unix_now};
use crate::stats_cache::StatsSnapshot;
use crate::timeline::TimelineSnapshot;
use kvstore::{KvstoreNodes, KvstoreView};

/// How old the cached worker and kvstore state may get before a dashboard poll refreshes it.
pub const FLEET_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(1);
/// Placement decisions shown.
pub const PLACEMENTS_SHOWN: usize = 12;
/// The session cookie's name.
pub const SESSION_COOKIE: &str = "pagoda_dashboard";
/// Cookie headers longer than this are not looked at.
const MAX_COOKIE_HEADER: usize = 8192;

const PAGE_HTML: &str = include_str!("dashboard/index.html");
const LOGIN_HTML: &str = include_str!("dashboard/login.html");
const STYLE_CSS: &str = include_str!("dashboard/dashboard.css");
const SCRIPT_JS: &str = include_str!("dashboard/dashboard.js");

/// Everything inline is refused: the page's script and style come from the files above.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
     connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// The dashboard's own state: the kvstore nodes it polls and the cached fleet view.
pub struct Dashboard {
    kvstore: KvstoreNodes,
    latest: Mutex<Option<Arc<Fleet>>>,
    refreshing: AtomicBool,
}

/// What the workers and the kvstore said at one moment.
pub struct Fleet {
    fetched: Instant,
    /// The workers' `Stats` (`None`: the first fetch failed).
    stats: Option<Arc<StatsSnapshot>>,
    kvstore: KvstoreView,
}

impl Fleet {
    /// When its oldest figures were fetched.
    fn oldest(&self) -> Instant {
        self.stats.as_ref().map_or(self.fetched, |s| s.fetched.min(self.fetched))
    }
}

/// Clears the refresh flag when the refreshing request ends, even when its client went away mid-refresh.
struct RefreshGuard<'a>(&'a AtomicBool);

impl Drop for RefreshGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Default for Dashboard {
    /// A dashboard without kvstore nodes.
    fn default() -> Dashboard {
        Dashboard { kvstore: KvstoreNodes::default(), latest: Mutex::new(None), refreshing: AtomicBool::new(false) }
    }
}

impl Dashboard {
    /// A dashboard that polls the kvstore nodes at `kvstore` (none: "not configured").
    /// With the registry the list follows kvstore membership.
    pub fn new(kvstore: pagoda_kvstore::Endpoints) -> Result<Dashboard, String> {
        Ok(Dashboard { kvstore: KvstoreNodes::following(kvstore)?, ..Dashboard::default() })
    }

    fn cached(&self) -> Option<Arc<Fleet>> {
        self.latest.lock().ok().and_then(|l| l.clone())
    }

    /// The fleet view, refreshed when older than [`FLEET_MAX_AGE`]. While another request refreshes it, the
    /// previous view is returned (`None` before the first one exists).
    pub async fn fleet(&self, st: &AppState) -> Option<Arc<Fleet>> {
        let cached = self.cached();
        if cached.as_ref().is_some_and(|f| f.oldest().elapsed() < FLEET_MAX_AGE) {
            return cached;
        }
        if self.refreshing.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return cached;
        }
        let _guard = RefreshGuard(&self.refreshing);
        let (stats, kvstore) = futures::join!(st.worker_stats(), self.kvstore.poll());
        let fleet = Arc::new(Fleet { fetched: Instant::now(), stats, kvstore });
        if let Ok(mut l) = self.latest.lock() {
            *l = Some(fleet.clone());
        }
        Some(fleet)
    }
}

/// The dashboard's routes (merged into [`crate::server::app`]).
pub fn routes() -> axum::Router<AppState> {
    axum::Router::new()
        .route("/dashboard", get(page))
        .route("/dashboard/login", post(login))
        .route("/dashboard/logout", post(logout))
        .route("/dashboard/api/state", get(api_state))
        .route("/dashboard/dashboard.css", get(|| async { asset("text/css; charset=utf-8", STYLE_CSS) }))
        .route("/dashboard/dashboard.js", get(|| async { asset("text/javascript; charset=utf-8", SCRIPT_JS) }))
}

/// The value of the session cookie, if the request carries one.
fn session_cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter(|v| v.len() <= MAX_COOKIE_HEADER)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| pair.trim().strip_prefix(SESSION_COOKIE)?.strip_prefix('='))
}

/// [`admin_access`], with a valid session cookie as a third way in.
fn dashboard_access(st: &AppState, headers: &HeaderMap) -> Result<(), Box<Response>> {
    if let (Some(admin), Some(token)) = (st.security().admin.as_ref(), session_cookie(headers))
        && admin.session_valid(token, unix_now())
    {
        return Ok(());
    }
    admin_access(st, headers.get(header::AUTHORIZATION))
}

fn with_page_headers(mut resp: Response, content_type: &'static str) -> Response {
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    resp
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    with_page_headers(body.into_response(), content_type)
}

fn html(status: StatusCode, body: String) -> Response {
    with_page_headers((status, body).into_response(), "text/html; charset=utf-8")
}

fn escape_html(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The login page with `message`; without a form when logging in cannot help (admin endpoints disabled).
fn login_page(status: StatusCode, message: &str, form: bool) -> Response {
    let body = LOGIN_HTML
        .replace("{{message}}", &escape_html(message))
        .replace("{{form_class}}", if form { "" } else { "hidden" });
    html(status, body)
}

fn redirect_to_page(cookie: Option<String>) -> Response {
    let mut resp = StatusCode::SEE_OTHER.into_response();
    resp.headers_mut().insert(header::LOCATION, HeaderValue::from_static("/dashboard"));
    resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Some(c) = cookie.and_then(|c| HeaderValue::from_str(&c).ok()) {
        resp.headers_mut().insert(header::SET_COOKIE, c);
    }
    resp
}

/// Behind a TLS-terminating proxy, the cookie is marked `Secure` too.
fn cookie_attributes(headers: &HeaderMap, max_age: u64) -> String {
    let https = headers.get("x-forwarded-proto").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    format!("Path=/dashboard; Max-Age={max_age}; HttpOnly; SameSite=Strict{}", if https { "; Secure" } else { "" })
}

async fn page(State(st): State<AppState>, headers: HeaderMap) -> Response {
    match dashboard_access(&st, &headers) {
        Ok(()) => html(StatusCode::OK, PAGE_HTML.to_string()),
        Err(refused) if refused.status() == StatusCode::UNAUTHORIZED => {
            login_page(StatusCode::UNAUTHORIZED, "Enter the admin key to open the dashboard.", true)
        }
        Err(refused) => login_page(
            refused.status(),
            "The dashboard is disabled: the router has API keys but no admin key (--admin-key-file).",
            false,
        ),
    }
}

#[derive(Deserialize)]
struct LoginForm {
    key: String,
}

async fn login(State(st): State<AppState>, headers: HeaderMap, req: Request) -> Response {
    let form = match within_client_timeout(&st, Form::<LoginForm>::from_request(req, &st)).await {
        Ok(form) => form,
        Err(timeout) => return timeout.into_response(),
    };
    // The page's own form cannot get here; whatever else does gets the router's JSON errors, not axum's text.
    let form = match form {
        Ok(Form(form)) => form,
        Err(rejection) => {
            let status = rejection.status();
            let text = rejection.body_text();
            return ApiError {
                status,
                ..ApiError::invalid_param("key", format!("Expected a form with the admin key `key`: {text}"))
            }
            .into_response();
        }
    };
    let sec = st.security();
    let Some(admin) = sec.admin.as_ref() else {
        if sec.keys.is_none() {
            return redirect_to_page(None);
        }
        return login_page(
            StatusCode::FORBIDDEN,
            "The dashboard is disabled: the router has API keys but no admin key (--admin-key-file).",
            false,
        );
    };
    let key = form.key.trim();
    if key.len() > MAX_KEY_BYTES || !admin.matches(key.as_bytes()) {
        return login_page(StatusCode::UNAUTHORIZED, "Wrong admin key.", true);
    }
    let token = admin.session_token(unix_now() + ADMIN_SESSION.as_secs());
    let attrs = cookie_attributes(&headers, ADMIN_SESSION.as_secs());
    redirect_to_page(Some(format!("{SESSION_COOKIE}={token}; {attrs}")))
}

async fn logout(headers: HeaderMap) -> Response {
    redirect_to_page(Some(format!("{SESSION_COOKIE}=; {}", cookie_attributes(&headers, 0))))
}

/// One worker's row.
#[derive(Serialize)]
struct WorkerView {
    address: String,
    ready: bool,
    /// What the router sends it: both, prefill (disaggregated prompts) or decode.
    role: &'static str,
    /// How it orders requests: fcfs, priority, fair or vtc.
    scheduling: String,
    model: String,
    /// The LoRA adapters it serves, by name.
    lora_adapters: Vec<String>,
    error: Option<String>,
    /// The router's own count of prompt tokens sent and not answered yet, and of streams decoding.
    queued_tokens: u64,
    decoding: u32,
    /// Absent when the worker did not answer `Stats`.
    stats: Option<WorkerStats>,
}

#[derive(Serialize)]
struct WorkerStats {
    blocks_total: u64,
    blocks_used: u64,
    blocks_cached: u64,
    running: u64,
    waiting: u64,
    computed_tokens_total: u64,
    cached_tokens_total: u64,
    preemptions_total: u64,
    /// Forward steps and the sequences they computed, since the worker started: the page shows their ratio, the
    /// mean batch, overall and since its previous update.
    steps_total: u64,
    step_sequences_total: u64,
    offloaded_groups_total: u64,
    disk_corrupted_total: u64,
    /// Present when the worker places its tiers by EvicPress.
    evicpress: Option<EvicPressView>,
}

/// A worker's EvicPress planner: what it holds and has done, and the mean profiled quality of each variant.
#[derive(Serialize)]
struct EvicPressView {
    contexts: u64,
    /// Contexts with a copy on each tier below the device, in storage order.
    placed: Vec<(String, u64)>,
    profiles_total: u64,
    reprofiles_total: u64,
    profile_questions: u64,
    /// Profiles scored on the context's own training queries (`kv.profile_queries`).
    profiles_on_own_queries_total: u64,
    compressed_total: u64,
    moved_down_total: u64,
    dropped_total: u64,
    /// Per variant: its name, mean token agreement, and mean embedding similarity (when the worker measures it).
    variants: Vec<(String, f64, Option<f64>)>,
}

impl From<&pagoda_proto::worker::EvicPressStats> for EvicPressView {
    fn from(e: &pagoda_proto::worker::EvicPressStats) -> EvicPressView {
        EvicPressView {
            contexts: e.contexts,
            placed: e.placed.iter().map(|p| (p.tier.clone(), p.contexts)).collect(),
            profiles_total: e.profiles_total,
            reprofiles_total: e.reprofiles_total,
            profile_questions: e.profile_questions,
            profiles_on_own_queries_total: e.profiles_on_own_queries_total,
            compressed_total: e.compressed_total,
            moved_down_total: e.moved_down_total,
            dropped_total: e.dropped_total,
            variants: e
                .variants
                .iter()
                .map(|v| (v.variant.clone(), v.mean_quality, v.mean_embedding_similarity))
                .collect(),
        }
    }
}

/// One tier over all workers: capacity, and used bytes by codec.
#[derive(Serialize, Default)]
struct TierView {
    tier: String,
    capacity_bytes: u64,
    used_bytes: u64,
    by_codec: BTreeMap<String, u64>,
}

#[derive(Serialize)]
struct PrefixHitView {
    tier: String,
    tokens: u64,
}

#[derive(Serialize, Default)]
struct EvictionView {
    policy: String,
    evicted_slots: u64,
    freed_blocks: u64,
}

/// A tenant's tokens since the router started (the page turns two polls into a rate).
#[derive(Serialize)]
struct TenantView {
    tenant: String,
    prompt_tokens: u64,
    completion_tokens: u64,
}

#[derive(Serialize)]
struct RouterView {
    strategy: &'static str,
    uptime_s: u64,
    prompt_tokens_total: u64,
    completion_tokens_total: u64,
    placements_total: u64,
}

/// The body of `/dashboard/api/state`.
#[derive(Serialize)]
struct StateView {
    generated_unix_ms: u64,
    /// How old the worker and kvstore figures are (`None` until the first refresh finished).
    fleet_age_ms: Option<u64>,
    router: RouterView,
    workers: Vec<WorkerView>,
    tiers: Vec<TierView>,
    prefix_hits: Vec<PrefixHitView>,
    evictions: Vec<EvictionView>,
    tenants: Vec<TenantView>,
    timeline: TimelineSnapshot,
    kvstore: Option<KvstoreView>,
    placements: Vec<DecisionRecord>,
}

/// Tiers in storage order, whatever order the workers list them in.
fn tier_rank(tier: &str) -> usize {
    ["device", "host", "disk", "peer"].iter().position(|t| *t == tier).unwrap_or(usize::MAX)
}

fn fleet_totals<'a>(
    stats: impl IntoIterator<Item = &'a StatsResponse>,
) -> (Vec<TierView>, Vec<PrefixHitView>, Vec<EvictionView>) {
    let mut tiers: BTreeMap<(usize, String), TierView> = BTreeMap::new();
    let mut hits: BTreeMap<(usize, String), u64> = BTreeMap::new();
    let mut evictions: BTreeMap<String, EvictionView> = BTreeMap::new();
    for s in stats {
        // A worker repeats a tier's capacity on each of its codec rows.
        let mut capacity: BTreeMap<&str, u64> = BTreeMap::new();
        for t in &s.tiers {
            let view = tiers.entry((tier_rank(&t.tier), t.tier.clone())).or_default();
            view.tier.clone_from(&t.tier);
            view.used_bytes += t.used_bytes;
            if !t.codec.is_empty() {
                *view.by_codec.entry(t.codec.clone()).or_default() += t.used_bytes;
            }
            let c = capacity.entry(&t.tier).or_default();
            *c = (*c).max(t.capacity_bytes);
        }
        for (tier, c) in capacity {
            if let Some(view) = tiers.get_mut(&(tier_rank(tier), tier.to_string())) {
                view.capacity_bytes += c;
            }
        }
        for h in &s.prefix_hits {
            *hits.entry((tier_rank(&h.tier), h.tier.clone())).or_default() += h.tokens;
        }
        for e in &s.evictions {
            let view = evictions.entry(e.policy.clone()).or_default();
            view.policy.clone_from(&e.policy);
            view.evicted_slots += e.evicted_slots;
            view.freed_blocks += e.freed_blocks;
        }
    }
    (
        tiers.into_values().collect(),
        hits.into_iter().map(|((_, tier), tokens)| PrefixHitView { tier, tokens }).collect(),
        evictions.into_values().collect(),
    )
}

/// The worker at `addr`'s `Stats` in `fleet`, if it was in the pool then and answered.
fn fleet_stats<'a>(fleet: Option<&'a Fleet>, addr: &str) -> Option<&'a StatsResponse> {
    fleet?.stats.as_deref()?.get(addr)
}

async fn api_state(State(st): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(refused) = dashboard_access(&st, &headers) {
        return *refused;
    }
    let fleet = st.dashboard().fleet(&st).await;
    let now = Instant::now();
    let pool = st.pool();
    let pool_workers = pool.workers();
    let stats_of = |w: &Arc<crate::workers::Worker>| fleet_stats(fleet.as_deref(), &w.addr);
    let workers = pool_workers
        .iter()
        .map(|w| {
            let status = w.status();
            WorkerView {
                address: w.addr.clone(),
                ready: status.ready,
                role: status.role.name(),
                scheduling: status.scheduling_policy.clone(),
                lora_adapters: status.lora_adapters.iter().map(|a| a.name.clone()).collect(),
                model: status.model,
                error: status.last_error,
                queued_tokens: w.load().queued_tokens(),
                decoding: w.load().decoding(),
                stats: stats_of(w).map(|s| WorkerStats {
                    blocks_total: s.blocks_total,
                    blocks_used: s.blocks_used,
                    blocks_cached: s.blocks_cached,
                    running: s.running,
                    waiting: s.waiting,
                    computed_tokens_total: s.computed_tokens_total,
                    cached_tokens_total: s.cached_tokens_total,
                    preemptions_total: s.preemptions_total,
                    steps_total: s.steps_total,
                    step_sequences_total: s.step_sequences_total,
                    offloaded_groups_total: s.offloaded_groups_total,
                    disk_corrupted_total: s.disk_corrupted_total,
                    evicpress: s.evicpress.as_ref().map(EvicPressView::from),
                }),
            }
        })
        .collect();
    let (tiers, prefix_hits, evictions) = fleet_totals(pool_workers.iter().filter_map(stats_of));
    let decisions = pool.recent_decisions();
    let metrics = st.metrics();
    let body = StateView {
        generated_unix_ms: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
        fleet_age_ms: fleet.as_ref().map(|f| now.saturating_duration_since(f.oldest()).as_millis() as u64),
        router: RouterView {
            strategy: pool.strategy_name(),
            uptime_s: st.started().elapsed().as_secs(),
            prompt_tokens_total: metrics.prompt_tokens.get(),
            completion_tokens_total: metrics.completion_tokens.get(),
            placements_total: metrics.placements_total(),
        },
        workers,
        tiers,
        prefix_hits,
        evictions,
        tenants: metrics
            .tenant_tokens_by_tenant()
            .into_iter()
            .map(|(tenant, prompt_tokens, completion_tokens)| TenantView { tenant, prompt_tokens, completion_tokens })
            .collect(),
        timeline: metrics.timeline.snapshot(now),
        kvstore: fleet.as_ref().map(|f| f.kvstore.clone()),
        placements: decisions.into_iter().take(PLACEMENTS_SHOWN).collect(),
    };
    let mut resp = Json(body).into_response();
    resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

#[cfg(test)]
mod tests {
    use pagoda_proto::worker::{PolicyEvictions, TierHits, TierUsage};

    use super::*;

    fn usage(tier: &str, codec: &str, used: u64, cap: u64) -> TierUsage {
        TierUsage { tier: tier.into(), codec: codec.into(), used_bytes: used, capacity_bytes: cap }
    }

    #[test]
    fn fleet_totals_stack_codecs_and_sum_workers() {
        let a = StatsResponse {
            tiers: vec![
                usage("host", "int8", 10, 100),
                usage("device", "native", 5, 50),
                usage("host", "native", 20, 100),
                usage("disk", "", 0, 1000),
            ],
            prefix_hits: vec![
                TierHits { tier: "disk".into(), tokens: 3 },
                TierHits { tier: "device".into(), tokens: 7 },
            ],
            evictions: vec![PolicyEvictions { policy: "snapkv".into(), evicted_slots: 4, freed_blocks: 1 }],
            ..Default::default()
        };
        let b = StatsResponse {
            tiers: vec![usage("device", "native", 1, 50)],
            prefix_hits: vec![TierHits { tier: "device".into(), tokens: 1 }],
            evictions: vec![PolicyEvictions { policy: "snapkv".into(), evicted_slots: 6, freed_blocks: 2 }],
            ..Default::default()
        };
        let (tiers, hits, ev) = fleet_totals([&a, &b]);
        let names: Vec<&str> = tiers.iter().map(|t| t.tier.as_str()).collect();
        assert_eq!(names, ["device", "host", "disk"]);
        assert_eq!((tiers[0].used_bytes, tiers[0].capacity_bytes), (6, 100));
        assert_eq!((tiers[1].used_bytes, tiers[1].capacity_bytes), (30, 100), "capacity counted once per worker");
        assert_eq!(tiers[1].by_codec, BTreeMap::from([("int8".to_string(), 10), ("native".to_string(), 20)]));
        assert!(tiers[2].by_codec.is_empty());
        assert_eq!(hits.iter().map(|h| (h.tier.as_str(), h.tokens)).collect::<Vec<_>>(), [("device", 8), ("disk", 3)]);
        assert_eq!((ev[0].policy.as_str(), ev[0].evicted_slots, ev[0].freed_blocks), ("snapkv", 10, 3));
    }

    #[test]
    fn session_cookie_is_found_among_others_and_bounded() {
        let mut h = HeaderMap::new();
        assert_eq!(session_cookie(&h), None);
        h.append(header::COOKIE, HeaderValue::from_static("a=1; pagoda_dashboardx=2"));
        assert_eq!(session_cookie(&h), None);
        h.append(header::COOKIE, HeaderValue::from_static("b=2;  pagoda_dashboard=123.abc ; c=3"));
        assert_eq!(session_cookie(&h), Some("123.abc"));
        let mut long = HeaderMap::new();
        let big = format!("{SESSION_COOKIE}=1.{}", "a".repeat(MAX_COOKIE_HEADER));
        long.append(header::COOKIE, HeaderValue::from_str(&big).unwrap());
        assert_eq!(session_cookie(&long), None);
    }

    #[test]
    fn login_page_escapes_its_message() {
        let r = login_page(StatusCode::UNAUTHORIZED, "<b>&\"'</b>", false);
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "text/html; charset=utf-8");
        assert!(r.headers()[header::CONTENT_SECURITY_POLICY].to_str().unwrap().contains("script-src 'self'"));
        assert_eq!(escape_html("<b>&\"'</b>"), "&lt;b&gt;&amp;&quot;&#39;&lt;/b&gt;");
    }
}
