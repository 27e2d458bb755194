//! Shared by the e2e test files: starting `pagoda up` and small request helpers.

#![allow(dead_code)]

use std::time::Duration;

use anyhow::Result;
use pagoda_e2e::serde_json::{Value, json};
use pagoda_e2e::{Http, MODEL_ID, Proc};

pub const BIN: &str = env!("CARGO_BIN_EXE_pagoda");

/// A `pagoda up` process with its router URL and its embedded worker's gRPC address.
pub struct Up {
    pub proc: Proc,
    pub http: Http,
    pub worker: String,
}

/// Starts `pagoda up` on ephemeral ports and waits until `/readyz` is 200.
pub async fn start_up(name: &str, extra: &[&str]) -> Result<Up> {
    let model = pagoda_e2e::require_model()?;
    let model = model.to_string_lossy().into_owned();
    let mut args = vec!["up", "--listen", "127.0.0.1:0", "--model", model.as_str(), "--threads", "1"];
    args.extend_from_slice(extra);
    let mut proc = Proc::spawn(BIN.as_ref(), name, &args)?;
    let worker = proc.wait_line("pagoda worker listening on ", Duration::from_secs(120))?;
    let base = proc.wait_line("pagoda router listening on ", Duration::from_secs(60))?;
    let http = Http::new(base);
    http.wait_ready(Duration::from_secs(60)).await?;
    Ok(Up { proc, http, worker })
}

/// The router's `/readyz` entry for each worker, by address.
pub async fn ready_workers(http: &Http) -> std::collections::HashMap<String, Value> {
    let (_, body) = http.get("/readyz").await.unwrap();
    let ready: Value = pagoda_e2e::serde_json::from_str(&body).unwrap();
    let workers = ready["workers"].as_array().cloned().unwrap_or_default();
    workers.into_iter().filter_map(|w| Some((w["address"].as_str()?.to_string(), w))).collect()
}

/// A chat request body for one user message.
pub fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": MODEL_ID, "messages": [{"role": "user", "content": content}]});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

/// A chat prompt of about 700 tokens (45 numbered sentences and a question): long enough that a peer pull of its
/// prefix beats prefilling it.
pub fn river_log_prompt() -> String {
    let text: Vec<String> =
        (0..45).map(|i| format!("Entry {i}: the river carried {} stones past the mill at dawn.", i * 7 + 3)).collect();
    format!("{} Which entry mentions 24 stones?", text.join(" "))
}

/// Asserts an OpenAI-style error body with the given status.
pub fn assert_error(case: &str, status: u16, body: &str, want: u16) -> Value {
    assert_eq!(status, want, "{case}: {body}");
    let v: Value = pagoda_e2e::serde_json::from_str(body).unwrap_or_else(|e| panic!("{case}: not JSON ({e}): {body}"));
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{case}: {v}");
    assert!(e["type"].is_string(), "{case}: {v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{case}: {v}");
    v
}

/// Asserts that a small request still succeeds.
pub async fn still_serves(http: &Http, after: &str) {
    let (s, v) = http
        .post_json("/v1/chat/completions", &chat("Say hi.", json!({"max_tokens": 2, "temperature": 0})))
        .await
        .unwrap_or_else(|e| panic!("after {after}: {e:#}"));
    assert_eq!(s, 200, "after {after}: {v}");
}

/// A real OTLP/gRPC trace receiver for the tracing tests: it keeps every span the processes export.
pub mod otlp {
    use std::sync::{Arc, Mutex};

    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceService;
    use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
    use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
    use opentelemetry_proto::tonic::trace::v1::Span;

    /// An exported span with the `service.name` of the process that sent it.
    #[derive(Clone)]
    pub struct Received {
        pub service: String,
        pub span: Span,
    }

    /// The OTLP trace receiver: keeps every span it is sent.
    #[derive(Clone, Default)]
    pub struct Collector {
        pub spans: Arc<Mutex<Vec<Received>>>,
    }

    #[tonic::async_trait]
    impl TraceService for Collector {
        async fn export(
            &self,
            request: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            let mut got = Vec::new();
            for rs in request.into_inner().resource_spans {
                let service = rs
                    .resource
                    .as_ref()
                    .and_then(|r| attr(&r.attributes, "service.name"))
                    .and_then(as_str)
                    .unwrap_or_default();
                for ss in rs.scope_spans {
                    got.extend(ss.spans.into_iter().map(|span| Received { service: service.clone(), span }));
                }
            }
            self.spans.lock().map_err(|_| tonic::Status::internal("poisoned"))?.extend(got);
            Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
        }
    }

    /// Serves a [`Collector`] on a free loopback port: the collector, its `http://` endpoint (for
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`) and the server task (abort it when done).
    pub async fn spawn_collector() -> (Collector, String, tokio::task::JoinHandle<Result<(), tonic::transport::Error>>)
    {
        let collector = Collector::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the OTLP collector");
        let endpoint = format!("http://{}", listener.local_addr().expect("collector address"));
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(
                    opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::TraceServiceServer::new(
                        collector.clone(),
                    ),
                )
                .serve_with_incoming(incoming),
        );
        (collector, endpoint, server)
    }

    pub fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a AnyValue> {
        attrs.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.as_ref())
    }

    pub fn as_str(v: &AnyValue) -> Option<String> {
        match &v.value {
            Some(any_value::Value::StringValue(s)) => Some(s.clone()),
            _ => None,
        }
    }

    pub fn as_int(v: &AnyValue) -> Option<i64> {
        match &v.value {
            Some(any_value::Value::IntValue(i)) => Some(*i),
            _ => None,
        }
    }

    pub fn str_attr(span: &Span, key: &str) -> Option<String> {
        attr(&span.attributes, key).and_then(as_str)
    }

    pub fn int_attr(span: &Span, key: &str) -> Option<i64> {
        attr(&span.attributes, key).and_then(as_int)
    }

    pub fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
}
