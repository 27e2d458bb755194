//! End-to-end test of the peer tier: two real `pagoda worker` processes on loopback. Worker A computes a long
//! prompt (its blocks land in A's host tier); worker B then receives the same prompt with a peer hint naming A (as a
//! router sends it), pulls the prefix through A's `Transfer` service, computes only the tail, and answers exactly
//! as A did. Then the fallbacks: a hint naming an address where nobody listens, and a hint naming A for a prompt A
//! never saw; B prefills and answers correctly each time, and counts the failed pulls. Both workers export traces
//! to an in-test OTLP receiver: the pull's `transfer` span on B is a child of B's `worker.generate`, and A's
//! serving `transfer` span continues it, across the two processes.
//!
//! Last, the router's part: `pagoda router --placement round_robin` over the two workers sends the same chat
//! twice, to each worker in turn; its residency index knows the first worker holds the prompt, so the second
//! request carries a peer hint, and the second worker answers the same from the pulled prefix.
//!
//! Cost: two model loads, a router, and about 2.5K prompt tokens prefilled on one thread (well under a minute).

mod common;

use std::time::{Duration, Instant};

use common::otlp::{hex, int_attr, spawn_collector, str_attr};
use common::{BIN, chat, river_log_prompt};
use pagoda_e2e::cluster::ClusterBuilder;
use pagoda_e2e::serde_json::json;
use pagoda_e2e::{Http, MODEL_ID, Proc, StatsResponse, free_port, require_model, worker_stats};
use pagoda_proto::worker::worker_client::WorkerClient;
use pagoda_proto::worker::{GenerateRequest, PeerHint, SamplingParams};

const BLOCK: usize = 16;

/// A deterministic prompt of `n` token ids (ordinary vocabulary ids, no special tokens), distinct per `seed`.
fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 300 + (i.wrapping_mul(7919).wrapping_add(seed.wrapping_mul(104_729))) % 30_000).collect()
}

struct Answer {
    tokens: Vec<u32>,
    cached_tokens: u32,
}

/// One greedy generation over gRPC, optionally with a peer hint and a W3C `traceparent`.
async fn generate(addr: &str, prompt: &[u32], hint: Option<PeerHint>, traceparent: Option<&str>) -> Answer {
    let mut client = WorkerClient::connect(format!("http://{addr}")).await.unwrap();
    let mut req = tonic::Request::new(GenerateRequest {
        request_id: "transfer-e2e".into(),
        prompt_token_ids: prompt.to_vec(),
        max_tokens: 8,
        sampling: Some(SamplingParams { temperature: 0.0, top_p: 1.0, ..Default::default() }),
        peer_hint: hint,
        ..Default::default()
    });
    if let Some(tp) = traceparent {
        req.metadata_mut().insert("traceparent", tp.parse().unwrap());
    }
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut tokens = Vec::new();
    while let Some(msg) = stream.message().await.unwrap() {
        tokens.extend(msg.token_ids);
        if let Some(f) = msg.finished {
            let usage = f.usage.unwrap();
            assert_eq!(usage.prompt_tokens as usize, prompt.len());
            return Answer { tokens, cached_tokens: usage.cached_tokens };
        }
    }
    panic!("the stream ended without a finish message");
}

/// One greedy generation over gRPC in `namespace`, with no stop tokens (so it runs to `max_tokens`).
async fn generate_in(addr: &str, prompt: &[u32], namespace: &str, max_tokens: u32) -> Vec<u32> {
    let mut client = WorkerClient::connect(format!("http://{addr}")).await.unwrap();
    let req = GenerateRequest {
        request_id: "transfer-e2e-reference".into(),
        prompt_token_ids: prompt.to_vec(),
        max_tokens,
        sampling: Some(SamplingParams { temperature: 0.0, top_p: 1.0, ..Default::default() }),
        namespace: namespace.into(),
        ..Default::default()
    };
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut tokens = Vec::new();
    while let Some(msg) = stream.message().await.unwrap() {
        tokens.extend(msg.token_ids);
        if msg.finished.is_some() {
            return tokens;
        }
    }
    panic!("the stream ended without a finish message");
}

/// The worker's stats once `done` holds (stats are published after the engine step that changed them).
async fn stats_when(addr: &str, what: &str, done: impl Fn(&StatsResponse) -> bool) -> StatsResponse {
    let t0 = Instant::now();
    loop {
        let s = worker_stats(addr).await.unwrap();
        if done(&s) {
            return s;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "{addr}: {what} never happened: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn host_hits(s: &StatsResponse) -> u64 {
    s.prefix_hits.iter().filter(|h| h.tier == "host").map(|h| h.tokens).sum()
}

/// `Transfer.OpenLink` and linked fetches against a CPU worker: a well-formed NCCL id is refused with
/// FAILED_PRECONDITION (the caller's cue to keep gRPC payloads), a malformed one with INVALID_ARGUMENT, and a
/// fetch naming a link the worker never opened with NOT_FOUND.
async fn device_links_are_refused_by_a_cpu_worker(addr: &str) {
    use pagoda_proto::transfer::transfer_client::TransferClient;
    use pagoda_proto::transfer::{FetchRequest, OpenLinkRequest};
    let mut client = TransferClient::connect(format!("http://{addr}")).await.unwrap();
    let refused = client.open_link(OpenLinkRequest { nccl_unique_id: vec![7; 128] }).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("no device links"), "{refused:?}");
    let bad = client.open_link(OpenLinkRequest { nccl_unique_id: vec![7; 127] }).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    let unknown = FetchRequest { hashes: vec![1, 2], max_batch_bytes: 1 << 20, nccl_link: 5 };
    let st = client.fetch(unknown).await.unwrap_err();
    assert_eq!(st.code(), tonic::Code::NotFound, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_pulls_a_prefix_from_a_peer_and_falls_back_to_prefill() {
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let (collector, otlp, server) = spawn_collector().await;
    let env = |cmd: &mut std::process::Command| {
        for var in ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_SERVICE_NAME"] {
            cmd.env_remove(var);
        }
        cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp);
    };
    let a_addr = format!("127.0.0.1:{}", free_port().unwrap());
    let b_addr = format!("127.0.0.1:{}", free_port().unwrap());
    let spawn = |name: &str, addr: &str| {
        // `always`: each hint below must be acted on. Under the cost model a pull happens only if the measured
        // peer bandwidth beats the measured prefill speed, and a loaded CI machine can tip that either way.
        let args =
            ["worker", "--listen", addr, "--model", model.as_str(), "--threads", "1", "--peer-fetch-policy", "always"];
        Proc::spawn_with(BIN.as_ref(), name, &args, env).unwrap()
    };
    let mut a = spawn("transfer-a", &a_addr);
    let mut b = spawn("transfer-b", &b_addr);
    a.wait_line("pagoda worker listening on ", Duration::from_secs(120)).unwrap();
    b.wait_line("pagoda worker listening on ", Duration::from_secs(120)).unwrap();

    // A computes the prompt; its full blocks become idle and are written back to A's host tier.
    let shared = prompt(1, 40 * BLOCK);
    let from_a = generate(&a_addr, &shared, None, None).await;
    assert_eq!(from_a.cached_tokens, 0);
    let prompt_blocks = shared.len() / BLOCK;
    // The last prompt token is always computed, so the usable prefix is one block short of the prompt.
    let usable = (shared.len() - 1) / BLOCK;
    stats_when(&a_addr, "write-back of the prompt's blocks", |s| s.offloaded_groups_total >= usable as u64).await;

    // B gets the same prompt and the hint a router would send.
    let trace_id = "5cf92f3577b34da6a3ce929d0e0e4736";
    let traceparent = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let hint = PeerHint { address: a_addr.clone(), blocks: prompt_blocks as u32, ..Default::default() };
    let from_b = generate(&b_addr, &shared, Some(hint), Some(&traceparent)).await;
    assert_eq!(from_b.tokens, from_a.tokens, "greedy output with the pulled prefix equals A's");
    assert_eq!(from_b.cached_tokens as usize, usable * BLOCK, "B computed only the tail");
    let sb = stats_when(&b_addr, "the request finishing", |s| s.running == 0).await;
    assert_eq!(sb.peer_fetched_blocks_total, usable as u64, "{sb:?}");
    assert!(sb.peer_fetched_bytes_total > 0, "{sb:?}");
    assert_eq!((sb.peer_fetches_total, sb.peer_fetch_failures_total), (1, 0), "{sb:?}");
    assert!(sb.peer_fetch_seconds_total > 0.0, "{sb:?}");
    assert_eq!(host_hits(&sb), (usable * BLOCK) as u64, "the pulled groups were onboarded from host: {sb:?}");
    // Prompt tail + the generated tokens, nothing more.
    let tail = (shared.len() - usable * BLOCK) as u64;
    assert!(sb.computed_tokens_total <= tail + 8, "B recomputed more than the tail: {sb:?}");
    let sa = worker_stats(&a_addr).await.unwrap();
    assert_eq!(sa.peer_served_blocks_total, usable as u64, "{sa:?}");
    assert_eq!(sa.peer_served_bytes_total, sb.peer_fetched_bytes_total);
    // CPU workers have no device links: the payloads came inline on the gRPC stream, and B never tried a link.
    assert_eq!((sb.peer_linked_fetches_total, sb.peer_link_refusals_total), (0, 0), "{sb:?}");
    device_links_are_refused_by_a_cpu_worker(&a_addr).await;

    // A hint naming an address where nobody listens: the pull fails, B prefills, the answer is A's.
    let second = prompt(2, 12 * BLOCK + 5);
    let dead = format!("127.0.0.1:{}", free_port().unwrap());
    let from_b =
        generate(&b_addr, &second, Some(PeerHint { address: dead, blocks: 12, ..Default::default() }), None).await;
    assert_eq!(from_b.cached_tokens, 0);
    let from_a = generate(&a_addr, &second, None, None).await;
    assert_eq!(from_b.tokens, from_a.tokens);
    let sb = stats_when(&b_addr, "the failed pull being counted", |s| s.running == 0).await;
    assert_eq!((sb.peer_fetches_total, sb.peer_fetch_failures_total), (2, 1), "{sb:?}");

    // A hint naming A for a prompt A never saw: A streams nothing, B prefills and answers as A then does.
    let third = prompt(3, 12 * BLOCK + 5);
    let from_b =
        generate(&b_addr, &third, Some(PeerHint { address: a_addr.clone(), blocks: 12, ..Default::default() }), None)
            .await;
    assert_eq!(from_b.cached_tokens, 0);
    let from_a = generate(&a_addr, &third, None, None).await;
    assert_eq!(from_b.tokens, from_a.tokens);
    let sb = stats_when(&b_addr, "the empty pull being counted", |s| s.running == 0).await;
    assert_eq!((sb.peer_fetches_total, sb.peer_fetch_failures_total), (3, 2), "{sb:?}");
    assert_eq!(sb.peer_fetched_blocks_total, usable as u64, "nothing more was pulled: {sb:?}");

    // Through a router: round robin sends the repeat to the other worker, with a hint naming the first.
    let mut router = Proc::spawn_with(
        BIN.as_ref(),
        "transfer-router",
        &[
            "router",
            "--listen",
            "127.0.0.1:0",
            "--model",
            &model,
            "--worker",
            &a_addr,
            "--worker",
            &b_addr,
            "--placement",
            "round_robin",
        ],
        env,
    )
    .unwrap();
    let http = Http::new(router.wait_line("pagoda router listening on ", Duration::from_secs(60)).unwrap());
    http.wait_ready(Duration::from_secs(60)).await.unwrap();
    let body = chat(&river_log_prompt(), json!({"temperature": 0, "max_tokens": 8}));
    let both = || async { (worker_stats(&a_addr).await.unwrap(), worker_stats(&b_addr).await.unwrap()) };
    let sum = |s: &(StatsResponse, StatsResponse), f: fn(&StatsResponse) -> u64| f(&s.0) + f(&s.1);
    let before = both().await;
    let (s, first) = http.post_json("/v1/chat/completions", &body).await.unwrap();
    assert_eq!(s, 200, "{first}");
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let blocks = (prompt_tokens - 1) / BLOCK as u64;
    assert!(blocks >= 20, "a long prompt: {first}");
    let t0 = Instant::now();
    loop {
        let now = both().await;
        if sum(&now, |s| s.offloaded_groups_total) >= sum(&before, |s| s.offloaded_groups_total) + blocks {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "the first answer's blocks were not written back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (s, second) = http.post_json("/v1/chat/completions", &body).await.unwrap();
    assert_eq!(s, 200, "{second}");
    assert_eq!(second["choices"][0]["message"]["content"], first["choices"][0]["message"]["content"]);
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert_eq!(cached, blocks * BLOCK as u64, "the other worker pulled the whole usable prefix: {second}");
    let after = both().await;
    let fetched = sum(&after, |s| s.peer_fetched_blocks_total) - sum(&before, |s| s.peer_fetched_blocks_total);
    let served = sum(&after, |s| s.peer_served_blocks_total) - sum(&before, |s| s.peer_served_blocks_total);
    assert_eq!((fetched, served), (blocks, blocks), "{after:?}");
    let (_, metrics) = http.get("/metrics").await.unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("pagoda_router_worker_peer_blocks{") && l.contains("fetched") && !l.ends_with(" 0")),
        "the router exports the peer counters"
    );
    router.kill();

    // Graceful shutdown flushes the spans; then the pull's trace must cross both processes.
    for p in [&mut a, &mut b] {
        let exited = tokio::task::block_in_place(|| p.terminate(Duration::from_secs(30))).unwrap();
        assert!(exited, "{}", p.log_tail());
    }
    server.abort();
    let all = collector.spans.lock().unwrap().clone();
    let trace: Vec<_> = all.iter().filter(|r| hex(&r.span.trace_id) == trace_id).collect();
    let names: Vec<&str> = trace.iter().map(|r| r.span.name.as_str()).collect();
    let generate_span = trace.iter().find(|r| r.span.name == "worker.generate").unwrap_or_else(|| panic!("{names:?}"));
    let transfers: Vec<_> = trace.iter().filter(|r| r.span.name == "transfer").collect();
    assert_eq!(transfers.len(), 2, "one transfer span on each side: {names:?}");
    let pull = transfers
        .iter()
        .find(|r| str_attr(&r.span, "from").as_deref() == Some(a_addr.as_str()))
        .unwrap_or_else(|| panic!("no pulling transfer span from {a_addr}"));
    let serve = transfers
        .iter()
        .find(|r| str_attr(&r.span, "from").as_deref() == Some("cache"))
        .unwrap_or_else(|| panic!("no serving transfer span"));
    assert_eq!(pull.span.parent_span_id, generate_span.span.span_id, "the pull is a child of worker.generate");
    assert_eq!(serve.span.parent_span_id, pull.span.span_id, "A's serving span continues B's pull");
    for t in [pull, serve] {
        assert_eq!(str_attr(&t.span, "direction").as_deref(), Some("peer"));
        assert_eq!(int_attr(&t.span, "bytes"), Some(sb.peer_fetched_bytes_total as i64), "{:?}", t.span.attributes);
    }
}

/// Disaggregated serving through the router: a worker started with `--role prefill` computes long prompts, the
/// `--role decode` worker pulls their blocks (device pool to device pool: neither has a tier) and decodes, and the
/// answer is the one the decode worker gives when it computes the prompt itself. Short prompts never reach the
/// prefill worker, and a dead prefill worker costs nothing but the failed call: the decode worker then prefills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_prefills_long_prompts_on_a_prefill_worker_and_decodes_elsewhere() {
    // Neither has a host tier: P serves from its device pool, and D writes what it pulls into its own.
    let mut cluster = ClusterBuilder::new(BIN, "disagg")
        .workers(2)
        .worker_args_for(0, &["--role", "prefill", "--host-tier-mib", "0"])
        .worker_args_for(1, &["--role", "decode", "--host-tier-mib", "0"])
        .router_args(&["--remote-prefill-min-tokens", "128"])
        .start()
        .await
        .unwrap();
    let (p_addr, d_addr) = (cluster.worker_addr(0).to_string(), cluster.worker_addr(1).to_string());
    let http = cluster.http(0).clone();
    let ready = common::ready_workers(&http).await;
    assert_eq!((&ready[&p_addr]["role"], &ready[&d_addr]["role"]), (&json!("prefill"), &json!("decode")));
    let complete = |tokens: &[u32]| {
        let greedy = json!({"max_tokens": 8, "temperature": 0, "ignore_eos": true});
        let mut body = json!({"model": MODEL_ID, "prompt": tokens});
        body.as_object_mut().unwrap().extend(greedy.as_object().unwrap().clone());
        body
    };
    let text_of = |tokens: Vec<u32>| {
        let http = http.clone();
        async move {
            let (s, body) = http.post_json("/detokenize", &json!({"tokens": tokens})).await.unwrap();
            assert_eq!(s, 200, "{body}");
            body["prompt"].as_str().unwrap().to_string()
        }
    };

    // A long prompt: prefilled on P, pulled and decoded by D.
    let long = prompt(5, 30 * BLOCK + 3);
    let (s, body) = http.post_json("/v1/completions", &complete(&long)).await.unwrap();
    assert_eq!(s, 200, "{body}");
    let usable = (long.len() - 1) / BLOCK;
    let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert_eq!(cached, (usable * BLOCK) as u64, "D pulled every usable block: {body}");
    let sp = stats_when(&p_addr, "the remote prefill finishing", |s| s.running == 0).await;
    let sd = stats_when(&d_addr, "the decode finishing", |s| s.running == 0).await;
    assert_eq!(sp.peer_served_blocks_total, usable as u64, "{sp:?}");
    assert!(sp.computed_tokens_total >= long.len() as u64, "P computed the prompt: {sp:?}");
    assert_eq!((sd.peer_fetched_blocks_total, sd.peer_fetch_failures_total), (usable as u64, 0), "{sd:?}");
    let tail = (long.len() - usable * BLOCK) as u64;
    assert!(sd.computed_tokens_total <= tail + 8, "D computed only the tail and the answer: {sd:?}");
    let reference = generate_in(&d_addr, &long, "reference", 8).await;
    assert_eq!(body["choices"][0]["text"].as_str().unwrap(), text_of(reference).await, "the answer is D's own");
    assert_eq!(http.metric_sum("pagoda_router_remote_prefills_total").await, 1.0);
    let (_, metrics) = http.get("/metrics").await.unwrap();
    assert!(metrics.contains("pagoda_router_remote_prefills_total{outcome=\"ok\"} 1"), "{metrics}");

    // A short prompt stays on D; P computes nothing for it.
    let short = prompt(6, 40);
    let p_before = worker_stats(&p_addr).await.unwrap().computed_tokens_total;
    let (s, body) = http.post_json("/v1/completions", &complete(&short)).await.unwrap();
    assert_eq!(s, 200, "{body}");
    assert_eq!(worker_stats(&p_addr).await.unwrap().computed_tokens_total, p_before);
    assert_eq!(http.metric_sum("pagoda_router_remote_prefills_total").await, 1.0);

    // P dies: the next long prompt is prefilled on D, and answers as D alone would.
    cluster.kill_worker(0).unwrap();
    let other = prompt(7, 20 * BLOCK + 9);
    let (s, body) = http.post_json("/v1/completions", &complete(&other)).await.unwrap();
    assert_eq!(s, 200, "{body}");
    let reference = generate_in(&d_addr, &other, "reference", 8).await;
    assert_eq!(body["choices"][0]["text"].as_str().unwrap(), text_of(reference).await);
}

/// The peer-fetch figure of docs/BENCHMARKS.md: a 2,048-token prompt prefilled by A (recompute), then the same
/// prompt on B, which pulls the 127 usable blocks from A and computes the last one (pull), one generated token
/// each. Whole-request latencies over gRPC. Run:
/// `cargo test -p pagoda --test e2e_transfer -- --ignored --nocapture peer_fetch_of_a_2k_prefix` (the dev profile
/// builds the worker at opt-level 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: about a minute on two cores; run by hand (docs/BENCHMARKS.md)"]
async fn peer_fetch_of_a_2k_prefix_against_recompute() {
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let threads = std::env::var("PAGODA_BENCH_THREADS").unwrap_or_else(|_| "2".into());
    let a_addr = format!("127.0.0.1:{}", free_port().unwrap());
    let b_addr = format!("127.0.0.1:{}", free_port().unwrap());
    let spawn = |name: &str, addr: &str| {
        let args = ["worker", "--listen", addr, "--model", model.as_str(), "--threads", threads.as_str()];
        Proc::spawn(BIN.as_ref(), name, &args).unwrap()
    };
    let mut a = spawn("bench-transfer-a", &a_addr);
    let mut b = spawn("bench-transfer-b", &b_addr);
    a.wait_line("pagoda worker listening on ", Duration::from_secs(120)).unwrap();
    b.wait_line("pagoda worker listening on ", Duration::from_secs(120)).unwrap();
    let p = prompt(9, 2048);
    let blocks = p.len() / BLOCK;
    let t0 = Instant::now();
    let from_a = generate(&a_addr, &p, None, None).await;
    let recompute = t0.elapsed();
    stats_when(&a_addr, "write-back", |s| s.offloaded_groups_total >= blocks as u64).await;
    let t0 = Instant::now();
    let hint = PeerHint { address: a_addr.clone(), blocks: blocks as u32, ..Default::default() };
    let from_b = generate(&b_addr, &p, Some(hint), None).await;
    let pulled = t0.elapsed();
    let sb = stats_when(&b_addr, "finish", |s| s.running == 0).await;
    assert_eq!(from_b.tokens, from_a.tokens);
    println!(
        "2048-token prompt, {threads} threads: recompute {:.3} s, pull + tail {:.3} s ({:.1}x); pulled {} blocks, \
         {:.1} MB in {:.3} s ({:.0} MB/s incl. connect), cached tokens {}",
        recompute.as_secs_f64(),
        pulled.as_secs_f64(),
        recompute.as_secs_f64() / pulled.as_secs_f64(),
        sb.peer_fetched_blocks_total,
        sb.peer_fetched_bytes_total as f64 / 1e6,
        sb.peer_fetch_seconds_total,
        sb.peer_fetched_bytes_total as f64 / 1e6 / sb.peer_fetch_seconds_total.max(1e-9),
        from_b.cached_tokens
    );
}
