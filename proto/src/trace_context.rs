//! W3C trace context across Pagoda's process boundaries: carries `traceparent`/`tracestate` from a client's HTTP
//! headers into the router's spans, from a router span into the gRPC metadata of a worker call, and back out on
//! the worker, through the process's global text-map propagator (set by the binary; W3C TraceContext). Also owns
//! the span shapes shared by more than one crate, such as [`transfer_span`] for KV block movement.
//!
//! Every function is a no-op when the process has no OpenTelemetry layer installed (no OTLP endpoint
//! configured): spans then carry no OpenTelemetry context and nothing is injected.

use opentelemetry::propagation::{Extractor, Injector};
use tonic::codegen::http::HeaderMap;
use tonic::metadata::{KeyAndValueRef, MetadataKey, MetadataMap, MetadataValue};
use tracing::Span;

pub use opentelemetry::KeyValue;
pub use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Writes `span`'s context into outgoing gRPC metadata.
pub fn inject_into_metadata(span: &Span, metadata: &mut MetadataMap) {
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut MetadataInjector(metadata)));
}

/// Makes the remote caller's span (from incoming gRPC metadata) the parent of `span`. Without a valid
/// `traceparent` the span stays a root.
pub fn continue_from_metadata(span: &Span, metadata: &MetadataMap) {
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(metadata)));
    // Fails only when no OpenTelemetry layer is installed, where there is nothing to continue.
    let _ = span.set_parent(cx);
}

/// Makes the client's span (from incoming HTTP headers) the parent of `span`.
pub fn continue_from_headers(span: &Span, headers: &HeaderMap) {
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)));
    let _ = span.set_parent(cx);
}

/// Adds a timestamped event to `span`'s OpenTelemetry span without emitting a log line: for milestones of a
/// request (prefill done, first token, eviction) that operators read in a trace, not in the logs.
pub fn span_event(span: &Span, name: &'static str, attributes: Vec<KeyValue>) {
    span.add_event(name, attributes);
}

/// Which way KV blocks move in a [`transfer_span`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferDirection {
    /// Into this worker's device tier (onboarding from host, disk or a peer).
    Onboard,
    /// Out of the device tier (offloading to host or disk).
    Offload,
    /// Sent to or received from another worker.
    Peer,
}

impl TransferDirection {
    pub fn as_str(self) -> &'static str {
        match self {
            TransferDirection::Onboard => "onboard",
            TransferDirection::Offload => "offload",
            TransferDirection::Peer => "peer",
        }
    }
}

/// The `transfer` span for one movement of KV blocks between tiers or workers, a child of the current span (for a
/// request's onboarding, the `worker.generate` span). `from`/`to` name the tiers or peers (`"host"`, `"disk"`,
/// `"device"`, a peer address). Record the outcome on it before it closes: `span.record("bytes", n)` and, on
/// failure, `span.record("otel.status_code", "ERROR")`. Record numbers as `i64`: the OpenTelemetry layer exports
/// unsigned values as strings. For a transfer over gRPC, pass the span to
/// [`inject_into_metadata`] on the sender and [`continue_from_metadata`] on the receiver so both sides share the
/// trace.
pub fn transfer_span(direction: TransferDirection, from: &str, to: &str, blocks: usize) -> Span {
    tracing::info_span!(
        "transfer",
        direction = direction.as_str(),
        from = from,
        to = to,
        blocks = blocks as i64,
        bytes = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The propagator only writes well-formed header names and values; anything else is dropped, not sent.
        if let (Ok(k), Ok(v)) = (MetadataKey::from_bytes(key.as_bytes()), MetadataValue::try_from(value.as_str())) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .iter()
            .filter_map(|kv| match kv {
                KeyAndValueRef::Ascii(k, _) => Some(k.as_str()),
                KeyAndValueRef::Binary(..) => None,
            })
            .collect()
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_through_the_carriers() {
        let mut md = MetadataMap::new();
        let mut inj = MetadataInjector(&mut md);
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        inj.set("traceparent", tp.to_string());
        inj.set("tracestate", "congo=t61rcWkgMzE".to_string());
        // Not a valid header name: must be dropped rather than panic.
        inj.set("bad key", "x".to_string());
        let ext = MetadataExtractor(&md);
        assert_eq!(ext.get("traceparent"), Some(tp));
        assert_eq!(ext.get("tracestate"), Some("congo=t61rcWkgMzE"));
        let mut keys = ext.keys();
        keys.sort_unstable();
        assert_eq!(keys, vec!["traceparent", "tracestate"]);
    }

    #[test]
    fn header_extractor_reads_case_insensitively() {
        let mut h = HeaderMap::new();
        h.insert("TraceParent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".parse().unwrap());
        let ext = HeaderExtractor(&h);
        assert!(ext.get("traceparent").is_some());
        assert_eq!(ext.keys(), vec!["traceparent"]);
    }
}
