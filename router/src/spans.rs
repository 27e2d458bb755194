//! The router's trace spans: `router.request` around every HTTP request (continued from the client's
//! `traceparent`), `router.place` for the worker choice, and the gRPC client span of a worker call, whose context
//! travels to the worker in the request metadata. The span shapes live here so the handlers only record values.

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use pagoda_proto::trace_context;
use tracing::field::Empty;
use tracing::{Instrument as _, Span};

/// Axum middleware: runs the request inside a `router.request` span and records its status.
pub async fn trace_request(req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_owned());
    let span = tracing::info_span!(
        "router.request",
        otel.kind = "server",
        http.request.method = %req.method(),
        http.route = route.as_deref().unwrap_or("unmatched"),
        url.path = req.uri().path(),
        http.response.status_code = Empty,
        model = Empty,
        request_id = Empty,
        otel.status_code = Empty,
    );
    trace_context::continue_from_headers(&span, req.headers());
    let resp = next.run(req).instrument(span.clone()).await;
    let status = resp.status();
    span.record("http.response.status_code", i64::from(status.as_u16()));
    // Client errors are the client's; a server span is in error only for the server's own failures.
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    resp
}

/// Records the request's model and id on the current `router.request` span.
pub fn record_request(model: &str, request_id: &str) {
    let span = Span::current();
    span.record("model", model);
    span.record("request_id", request_id);
}

/// `router.place`: one placement decision. `strategy` names the selector; the chosen worker and the reason are
/// recorded with [`placed`].
pub fn place_span(strategy: &'static str, candidates: usize) -> Span {
    tracing::info_span!("router.place", strategy, candidates = candidates as i64, worker = Empty, reason = Empty)
}

/// Records the outcome of a placement.
pub fn placed(span: &Span, worker: &str, reason: &str) {
    span.record("worker", worker);
    span.record("reason", reason);
}

/// The client span of one `Worker/Generate` call to `worker` (an attempt: a failover makes another). It stays
/// open while the response stream is read.
pub fn generate_call_span(worker: &str) -> Span {
    tracing::info_span!(
        "pagoda.worker.v1.Worker/Generate",
        otel.kind = "client",
        rpc.system = "grpc",
        rpc.service = "pagoda.worker.v1.Worker",
        rpc.method = "Generate",
        server.address = worker,
        rpc.grpc.status_code = Empty,
        completion_tokens = Empty,
        otel.status_code = Empty,
        otel.status_description = Empty,
    )
}

/// The client span of a remote prefill: `Generate` on a prefill worker for a disaggregated request's prompt.
pub fn remote_prefill_span(worker: &str, prompt_tokens: usize) -> Span {
    tracing::info_span!(
        "remote_prefill",
        otel.kind = "client",
        rpc.system = "grpc",
        rpc.service = "pagoda.worker.v1.Worker",
        rpc.method = "Generate",
        server.address = worker,
        prompt_tokens = prompt_tokens as i64,
        rpc.grpc.status_code = Empty,
        otel.status_code = Empty,
        otel.status_description = Empty,
    )
}

/// Marks a call span failed with the gRPC status it ended with.
pub fn call_failed(span: &Span, status: &tonic::Status) {
    span.record("rpc.grpc.status_code", status.code() as i32);
    span.record("otel.status_code", "ERROR");
    span.record("otel.status_description", status.message());
}
