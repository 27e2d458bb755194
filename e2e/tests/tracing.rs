//! End-to-end test of distributed tracing: a real OTLP/gRPC trace receiver inside the test, `pagoda router` and
//! `pagoda worker` as separate processes exporting to it, one chat request carrying a client `traceparent`. The
//! exported spans must form one tree across the two processes (client → `router.request` → `router.place` and
//! the gRPC client span → `worker.generate` in the worker), with the request's milestones as span events. The
//! processes are stopped with SIGTERM and the spans are only asserted after that, with the batch exporter's delay
//! left at its default (5 s), so the test also proves that a graceful shutdown flushes the buffered spans.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::otlp::{Received, as_int, as_str, attr, hex, int_attr, spawn_collector, str_attr};
use common::{BIN, chat};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use pagoda_e2e::serde_json::json;
use pagoda_e2e::{Http, MODEL_ID, Proc, free_port, require_model};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_router_and_worker_processes() {
    let model = require_model().unwrap().to_string_lossy().into_owned();

    let (collector, otlp, server) = spawn_collector().await;

    // The worker names itself by default; the router takes OTEL_SERVICE_NAME. Both export to the receiver.
    let env = |service: Option<&'static str>| {
        let otlp = otlp.clone();
        move |cmd: &mut std::process::Command| {
            for var in ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_BSP_SCHEDULE_DELAY"] {
                cmd.env_remove(var);
            }
            cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp);
            match service {
                Some(s) => cmd.env("OTEL_SERVICE_NAME", s),
                None => cmd.env_remove("OTEL_SERVICE_NAME"),
            };
        }
    };
    let worker_addr = format!("127.0.0.1:{}", free_port().unwrap());
    let mut worker = Proc::spawn_with(
        BIN.as_ref(),
        "trace-worker",
        &["worker", "--listen", &worker_addr, "--model", &model, "--threads", "1"],
        env(None),
    )
    .unwrap();
    let mut router = Proc::spawn_with(
        BIN.as_ref(),
        "trace-router",
        &["router", "--listen", "127.0.0.1:0", "--worker", &worker_addr, "--model", &model],
        env(Some("e2e-router")),
    )
    .unwrap();
    worker.wait_line("pagoda worker listening on ", Duration::from_secs(120)).unwrap();
    let http = Http::new(router.wait_line("pagoda router listening on ", Duration::from_secs(60)).unwrap());
    http.wait_ready(Duration::from_secs(60)).await.unwrap();

    // The client's own trace: the router must continue it, not start a new one.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    // A context longer than the budget, so that the streaming policy evicts during the request.
    let question = format!("{}\nWhat is Pagoda?", "Pagoda is a serving system. ".repeat(20));
    let body =
        chat(&question, json!({"temperature": 0, "max_tokens": 4, "kv": {"policy": "streaming", "budget_tokens": 32}}));
    let resp = http
        .client
        .post(http.url("/v1/chat/completions"))
        .header("traceparent", format!("00-{trace_id}-{client_span}-01"))
        .header("tracestate", "client=e2e")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let v: pagoda_e2e::serde_json::Value = resp.json().await.unwrap();
    let completion_tokens = v["usage"]["completion_tokens"].as_i64().unwrap();
    let prompt_tokens = v["usage"]["prompt_tokens"].as_i64().unwrap();
    assert!(completion_tokens >= 1, "{v}");

    // Graceful shutdown flushes: nothing has been exported yet under the default 5 s batch delay, unless the
    // process ends and shuts its tracer provider down.
    for p in [&mut router, &mut worker] {
        let exited = tokio::task::block_in_place(|| p.terminate(Duration::from_secs(30))).unwrap();
        assert!(exited, "{}", p.log_tail());
    }
    server.abort();

    let all = collector.spans.lock().unwrap().clone();
    let trace: Vec<&Received> = all.iter().filter(|r| hex(&r.span.trace_id) == trace_id).collect();
    let names: Vec<(&str, &str)> = trace.iter().map(|r| (r.service.as_str(), r.span.name.as_str())).collect();
    let by_name: HashMap<&str, &Received> = trace.iter().map(|r| (r.span.name.as_str(), *r)).collect();
    let get = |name: &str| {
        by_name.get(name).copied().unwrap_or_else(|| panic!("no {name} span in the client's trace: {names:?}"))
    };
    // One span per stage, none per token.
    assert_eq!(trace.len(), 4, "{names:?}");

    let request = get("router.request");
    assert_eq!(request.service, "e2e-router");
    assert_eq!(hex(&request.span.parent_span_id), client_span, "router.request continues the client's span");
    assert_eq!(request.span.kind, SpanKind::Server as i32);
    assert_eq!(str_attr(&request.span, "http.request.method").as_deref(), Some("POST"));
    assert_eq!(str_attr(&request.span, "http.route").as_deref(), Some("/v1/chat/completions"));
    assert_eq!(int_attr(&request.span, "http.response.status_code"), Some(200), "{:?}", request.span.attributes);
    assert_eq!(str_attr(&request.span, "model").as_deref(), Some(MODEL_ID));
    assert_eq!(request.span.trace_state, "client=e2e", "the client's tracestate is kept");

    let place = get("router.place");
    assert_eq!(place.service, "e2e-router");
    assert_eq!(place.span.parent_span_id, request.span.span_id, "router.place is a child of router.request");
    assert_eq!(str_attr(&place.span, "strategy").as_deref(), Some("kv"));
    assert_eq!(str_attr(&place.span, "worker").as_deref(), Some(worker_addr.as_str()));
    assert!(str_attr(&place.span, "reason").is_some_and(|r| r.contains("lowest cost")), "{:?}", place.span.attributes);

    let call = get("pagoda.worker.v1.Worker/Generate");
    assert_eq!(call.service, "e2e-router");
    assert_eq!(call.span.parent_span_id, request.span.span_id, "the gRPC call is a child of router.request");
    assert_eq!(call.span.kind, SpanKind::Client as i32);
    assert_eq!(str_attr(&call.span, "rpc.system").as_deref(), Some("grpc"));
    assert_eq!(int_attr(&call.span, "completion_tokens"), Some(completion_tokens));

    let generate = get("worker.generate");
    assert_eq!(generate.service, "pagoda-worker", "the worker's default service name");
    assert_eq!(generate.span.parent_span_id, call.span.span_id, "worker.generate continues the router's call span");
    assert_eq!(generate.span.kind, SpanKind::Server as i32);
    assert_eq!(int_attr(&generate.span, "prompt_tokens"), Some(prompt_tokens));
    assert_eq!(int_attr(&generate.span, "completion_tokens"), Some(completion_tokens));
    assert_eq!(str_attr(&generate.span, "policy").as_deref(), Some("streaming"));
    assert!(str_attr(&generate.span, "request_id").is_some_and(|id| id.starts_with("chatcmpl-")));
    let events: Vec<(&str, Option<String>)> =
        generate.span.events.iter().map(|e| (e.name.as_str(), attr(&e.attributes, "phase").and_then(as_str))).collect();
    let has = |name: &str, phase: Option<&str>| events.iter().any(|(n, p)| *n == name && p.as_deref() == phase);
    assert!(has("prefill", None), "{events:?}");
    assert!(has("decode", Some("first_token")), "{events:?}");
    assert!(has("decode", Some("finish")), "{events:?}");
    let evict = generate.span.events.iter().find(|e| e.name == "evict").unwrap_or_else(|| panic!("{events:?}"));
    assert!(attr(&evict.attributes, "evicted_slots").and_then(as_int).is_some_and(|n| n > 0), "{evict:?}");
    // The worker's span starts within the router's call (their ends race: each side closes on its own last message).
    assert!(generate.span.start_time_unix_nano >= call.span.start_time_unix_nano);
}
