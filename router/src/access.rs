//! Request admission: the axum middlewares that authenticate `/v1/*` callers (API key → [`Tenant`]) and apply
//! their key's limits, and that guard the admin endpoints (`/debug/*`, and `/dashboard` with its session cookie) with
//! the admin key; and the router's own in-flight cap on the generation endpoints (load shedding).
//!
//! A `/v1` request's [`Permit`] travels inside the response body ([`ReleaseOnEnd`]), so its concurrency slot is
//! held for exactly as long as the response: until the last byte of a stream has been produced, or until the
//! server drops the body because the client disconnected. The router's in-flight slot is also given up when the
//! client stops reading ([`SlotBody`]), so that stalled connections cannot hold every slot.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Frame, SizeHint};

use crate::auth::{Tenant, bearer, presented_key};
use crate::error::ApiError;
use crate::limits::{Denied, Permit};
use crate::server::AppState;

/// The namespace of every request when auth is off (the embedded dev mode).
pub const DEFAULT_TENANT: &str = "default";

/// Whether `path` is Anthropic's API (`/v1/messages` and `/v1/messages/count_tokens`), whose clients read errors
/// only in Anthropic's shape: the middlewares refuse those requests before the handler could shape the error.
fn is_anthropic(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}

/// `e` in the shape the caller's API uses.
fn refusal(e: ApiError, anthropic: bool) -> Response {
    if anthropic { crate::messages::error_response(e) } else { e.into_response() }
}

fn unauthorized(e: ApiError, anthropic: bool) -> Response {
    let mut resp = refusal(e, anthropic);
    resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

fn too_many(d: Denied, tenant: &str, anthropic: bool) -> Response {
    let message = match d {
        Denied::Rate { .. } => {
            format!("Rate limit reached for this API key (tenant `{tenant}`): too many requests per second.")
        }
        Denied::Concurrency { limit } => {
            format!("Rate limit reached for this API key (tenant `{tenant}`): {limit} requests already in flight.")
        }
    };
    refusal(ApiError { retry_after_secs: Some(d.retry_after_secs()), ..ApiError::rate_limited(message) }, anthropic)
}

/// Middleware of `/v1/*`: without a keys file every request is tenant [`DEFAULT_TENANT`]; with one, the presented
/// key (bearer, or `x-api-key`) must be listed (401 otherwise) and within its limits (429 with `Retry-After` otherwise).
pub async fn require_key(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    let Some(keys) = st.security().keys.as_ref() else {
        req.extensions_mut().insert(Tenant { name: DEFAULT_TENANT.into(), key: None, weight: 1 });
        return next.run(req).await;
    };
    let anthropic = is_anthropic(req.uri().path());
    let presented = match presented_key(req.headers()) {
        Ok(k) => k,
        Err(e) => return unauthorized(e, anthropic),
    };
    let Some(entry) = keys.find(presented) else {
        return unauthorized(ApiError::invalid_api_key("Incorrect API key provided."), anthropic);
    };
    let tenant = Tenant { name: entry.tenant.clone(), key: Some(entry.index), weight: entry.weight };
    let permit = match st.limiter().map(|l| l.acquire(entry.index)) {
        Some(Ok(p)) => Some(p),
        Some(Err(d)) => {
            st.metrics().count_rate_limited(&entry.tenant, d);
            return too_many(d, &entry.tenant, anthropic);
        }
        None => None,
    };
    req.extensions_mut().insert(tenant);
    let resp = next.run(req).await;
    match permit {
        Some(p) => resp.map(|body| Body::new(ReleaseOnEnd::new(body, p))),
        None => resp,
    }
}

/// Middleware of the generation endpoints: at most the router's in-flight cap of them run at once; past it a
/// request is refused at once with 503 and `Retry-After` (load shedding), so that a burst cannot grow the router's
/// memory or every request's latency without bound. The slot is held until the response body ends, or until the
/// client stops taking it ([`SlotBody`]).
pub async fn shed_load(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let Ok(slot) = st.inflight().clone().try_acquire_owned() else {
        st.metrics().count_shed("router_inflight");
        let e = ApiError::saturated(
            format!("The router is at its limit of {} requests in flight; retry shortly.", st.max_inflight()),
            1,
        );
        return refusal(e, is_anthropic(req.uri().path()));
    };
    let timeout = st.client_timeout();
    next.run(req).await.map(|body| Body::new(SlotBody::new(body, slot, timeout)))
}

/// Middleware of the admin endpoints: the admin key opens them (see [`admin_access`]).
pub async fn require_admin(State(st): State<AppState>, req: Request, next: Next) -> Response {
    match admin_access(&st, req.headers().get(header::AUTHORIZATION)) {
        Ok(()) => next.run(req).await,
        Err(refused) => *refused,
    }
}

/// Whether a request with this `Authorization` header may use the admin endpoints: the admin key opens them (401
/// for no or an unknown key, 403 for a tenant's key). With neither keys file nor admin key (dev mode) they are
/// open; with a keys file but no admin key they stay closed (403), since tenants must not see each other's usage.
pub fn admin_access(st: &AppState, authorization: Option<&HeaderValue>) -> Result<(), Box<Response>> {
    let sec = st.security();
    let Some(admin) = sec.admin.as_ref() else {
        if sec.keys.is_none() {
            return Ok(());
        }
        return Err(Box::new(
            ApiError::permission_denied(
                "Admin endpoints are disabled: the router has no admin key (--admin-key-file).",
            )
            .into_response(),
        ));
    };
    let presented = bearer(authorization).map_err(|e| Box::new(unauthorized(e, false)))?;
    if admin.matches(presented) {
        return Ok(());
    }
    if sec.keys.as_ref().is_some_and(|k| k.find(presented).is_some()) {
        return Err(Box::new(
            ApiError::permission_denied("This endpoint needs the admin key; an API key is not enough.").into_response(),
        ));
    }
    Err(Box::new(unauthorized(ApiError::invalid_api_key("Incorrect admin key provided."), false)))
}

/// A response body that drops its permit (a key's [`Permit`], a slot of the router's in-flight cap) as soon as
/// the body has produced its last frame (so a client that has read the whole response can send its next request
/// at once), or when the body itself is dropped.
pub struct ReleaseOnEnd<B, P = Permit> {
    inner: B,
    permit: Option<P>,
}

impl<B, P> ReleaseOnEnd<B, P> {
    pub fn new(inner: B, permit: P) -> Self {
        ReleaseOnEnd { inner, permit: Some(permit) }
    }
}

/// What polling a body for its next frame gives.
type PolledFrame<B> = Poll<Option<Result<Frame<<B as http_body::Body>::Data>, <B as http_body::Body>::Error>>>;

/// Whether `polled`, a frame just polled from `inner`, ends the body: the end, an error, or the last frame. Both
/// bodies that hold a slot give it up there.
fn ends_body<B: http_body::Body>(polled: &PolledFrame<B>, inner: &B) -> bool {
    match polled {
        Poll::Ready(None) | Poll::Ready(Some(Err(_))) => true,
        Poll::Ready(Some(Ok(_))) => inner.is_end_stream(),
        Poll::Pending => false,
    }
}

impl<B, P: Unpin> http_body::Body for ReleaseOnEnd<B, P>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if ends_body(&polled, &this.inner) {
            this.permit = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A generation's response body holding its slot of the router's in-flight cap: like [`ReleaseOnEnd`], and also
/// given up when the client stops reading. The server pulls the next frame only once it could write the last one,
/// so a frame handed over and not followed by a pull within the client timeout means the client's connection has
/// stopped draining; the server keeps the body (and would keep the slot) for as long as that connection stays
/// open, so a watchdog task frees the slot instead.
pub struct SlotBody<B> {
    inner: B,
    slot: Arc<Slot>,
}

/// The in-flight slot that a [`SlotBody`] and its watchdog share. It is touched on every streamed frame, so it is
/// atomics rather than a lock: whichever side gives the slot up first (the body's end or drop, or the watchdog)
/// wins the `released` flag and hands the permit back to the semaphore; the other finds it already done.
struct Slot {
    semaphore: Arc<tokio::sync::Semaphore>,
    permits: usize,
    released: AtomicBool,
    /// When the last frame was handed to the server, while it has not asked for the next one: nanoseconds since
    /// `origin`, plus one so that 0 can mean "not waiting on the client".
    handed_at: AtomicU64,
    origin: Instant,
}

impl Slot {
    /// Gives the slot back, once: whether this call did.
    fn release(&self) -> bool {
        if self.released.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.semaphore.add_permits(self.permits);
        true
    }

    fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    fn mark_handed(&self) {
        let nanos = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.handed_at.store(nanos.saturating_add(1).max(1), Ordering::Release);
    }

    fn mark_asked(&self) {
        self.handed_at.store(0, Ordering::Release);
    }

    /// How long the last frame handed over has waited for the server to ask for the next (`None`: it asked).
    fn waiting_on_client(&self) -> Option<Duration> {
        let at = self.handed_at.load(Ordering::Acquire).checked_sub(1)?;
        Some(self.origin.elapsed().saturating_sub(Duration::from_nanos(at)))
    }
}

impl Drop for Slot {
    /// The body was dropped before its end (the client left): the slot goes back with it.
    fn drop(&mut self) {
        self.release();
    }
}

impl<B> SlotBody<B> {
    /// Needs a tokio runtime (it spawns the watchdog).
    pub fn new(inner: B, permit: tokio::sync::OwnedSemaphorePermit, timeout: Duration) -> Self {
        let (semaphore, permits) = (permit.semaphore().clone(), permit.num_permits());
        // The permit's count now lives in `Slot`, which adds it back exactly once.
        permit.forget();
        let slot = Arc::new(Slot {
            semaphore,
            permits,
            released: AtomicBool::new(false),
            handed_at: AtomicU64::new(0),
            origin: Instant::now(),
        });
        let watched = Arc::downgrade(&slot);
        // Weak: the body's end (or drop) ends the watchdog at its next tick.
        let tick = (timeout / 4).max(Duration::from_millis(1));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(tick).await;
                let Some(slot) = watched.upgrade() else { return };
                if slot.is_released() {
                    return;
                }
                if slot.waiting_on_client().is_some_and(|waited| waited >= timeout) {
                    if slot.release() {
                        tracing::warn!(
                            timeout_ms = timeout.as_millis() as u64,
                            "the client stopped reading its response; its in-flight slot is freed"
                        );
                    }
                    return;
                }
            }
        });
        SlotBody { inner, slot }
    }
}

impl<B> http_body::Body for SlotBody<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if ends_body(&polled, &this.inner) {
            this.slot.release();
        } else if polled.is_ready() {
            this.slot.mark_handed();
        } else {
            // The server is asking: the client is keeping up, and the wait is the generation's.
            this.slot.mark_asked();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::Arc;

    use tokio::sync::{Semaphore, mpsc};

    use super::*;

    type Chunks = mpsc::Sender<Result<Bytes, Infallible>>;

    /// A slot body over a channel of chunks, holding the one permit of `slots`.
    fn slot_body(slots: &Arc<Semaphore>, timeout: Duration) -> (SlotBody<Body>, Chunks) {
        let (tx, rx) = mpsc::channel(4);
        let permit = slots.clone().try_acquire_owned().unwrap();
        let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
        (SlotBody::new(body, permit, timeout), tx)
    }

    /// Polls `body` once, as the server does when it asks for the next frame.
    fn poll_once(body: &mut SlotBody<Body>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let waker = futures::task::noop_waker();
        http_body::Body::poll_frame(Pin::new(body), &mut Context::from_waker(&waker))
    }

    const TIMEOUT: Duration = Duration::from_millis(40);
    const PAST_TIMEOUT: Duration = Duration::from_millis(200);

    #[tokio::test]
    async fn a_slot_goes_back_once_whoever_gives_it_up() {
        let slots = Arc::new(Semaphore::new(1));

        // The client stops reading: a frame was handed over and the next is not asked for, so the watchdog frees
        // the slot; the body's later end and drop give nothing more back.
        let (mut body, tx) = slot_body(&slots, TIMEOUT);
        tx.send(Ok(Bytes::from_static(b"a"))).await.unwrap();
        assert!(matches!(poll_once(&mut body), Poll::Ready(Some(Ok(_)))));
        assert_eq!(slots.available_permits(), 0);
        tokio::time::sleep(PAST_TIMEOUT).await;
        assert_eq!(slots.available_permits(), 1, "the watchdog frees a stalled client's slot");
        drop(tx);
        assert!(matches!(poll_once(&mut body), Poll::Ready(None)));
        drop(body);
        assert_eq!(slots.available_permits(), 1, "given back once");

        // The server keeps asking while the generation is slow: that is no stalled client.
        let (mut body, tx) = slot_body(&slots, TIMEOUT);
        assert!(poll_once(&mut body).is_pending());
        tokio::time::sleep(PAST_TIMEOUT).await;
        assert_eq!(slots.available_permits(), 0, "a slow generation keeps its slot");
        // Its end gives the slot back at once, and only once (the watchdog and the drop after it add nothing).
        tx.send(Ok(Bytes::from_static(b"a"))).await.unwrap();
        drop(tx);
        assert!(matches!(poll_once(&mut body), Poll::Ready(Some(Ok(_)))));
        assert!(matches!(poll_once(&mut body), Poll::Ready(None)));
        assert_eq!(slots.available_permits(), 1);
        tokio::time::sleep(PAST_TIMEOUT).await;
        drop(body);
        assert_eq!(slots.available_permits(), 1);

        // A body dropped mid-stream (the client left) gives its slot back with it.
        let (mut body, tx) = slot_body(&slots, TIMEOUT);
        tx.send(Ok(Bytes::from_static(b"a"))).await.unwrap();
        assert!(matches!(poll_once(&mut body), Poll::Ready(Some(Ok(_)))));
        drop(body);
        assert_eq!(slots.available_permits(), 1);
        tokio::time::sleep(PAST_TIMEOUT).await;
        assert_eq!(slots.available_permits(), 1);
    }
}
