//! End-to-end test of the multi-process topology: `pagoda router` and `pagoda worker` as separate processes on
//! loopback, the router talking to the worker over gRPC. Covers readiness before/after the worker exists, a
//! real chat answer, the body-size limit, and what clients see when the worker dies.

mod common;

use std::time::{Duration, Instant};

use common::{BIN, assert_error, chat, river_log_prompt, still_serves};
use pagoda_e2e::serde_json::json;
use pagoda_e2e::{Http, Proc, free_port, require_model, worker_stats};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_router_and_worker_processes() {
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let wport = free_port().unwrap();
    let worker_addr = format!("127.0.0.1:{wport}");

    // Router first: alive but not ready while its worker does not exist.
    let mut router = Proc::spawn(
        BIN.as_ref(),
        "router",
        &["router", "--listen", "127.0.0.1:0", "--worker", &worker_addr, "--model", &model, "--body-limit", "65536"],
    )
    .unwrap();
    let base = router.wait_line("pagoda router listening on ", Duration::from_secs(60)).unwrap();
    let http = Http::new(base);
    assert_eq!(http.get("/healthz").await.unwrap().0, 200);
    let (s, body) = http.get("/readyz").await.unwrap();
    assert_eq!(s, 503, "{body}");
    let (s, text) =
        http.post_raw("/v1/chat/completions", chat("hi", json!({})).to_string().into_bytes()).await.unwrap();
    assert_error("no worker yet", s, &text, 503);

    let mut worker =
        Proc::spawn(BIN.as_ref(), "worker", &["worker", "--listen", &worker_addr, "--model", &model, "--threads", "1"])
            .unwrap();
    worker.wait_line("pagoda worker listening on ", Duration::from_secs(120)).unwrap();
    http.wait_ready(Duration::from_secs(30)).await.unwrap();

    let (s, v) = http
        .post_json(
            "/v1/chat/completions",
            &chat("What is the capital of France?", json!({"temperature": 0, "max_tokens": 32})),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!answer.trim().is_empty(), "{v}");
    // The worker publishes its stats after the step that finished the request, a moment after the answer.
    let t0 = std::time::Instant::now();
    let stats = loop {
        let stats = worker_stats(&worker_addr).await.unwrap();
        if stats.running == 0 || t0.elapsed() > Duration::from_secs(10) {
            break stats;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(stats.computed_tokens_total > 0, "{stats:?}");
    assert_eq!(stats.running, 0, "{stats:?}");

    // The configured body limit applies.
    let big = chat(&"a".repeat(100 * 1024), json!({})).to_string().into_bytes();
    let (s, text) = http.post_raw("/v1/chat/completions", big).await.unwrap();
    assert_error("body over --body-limit", s, &text, 413);
    still_serves(&http, "413").await;

    // The worker dies: the router stays up, says not ready, and answers 503 in OpenAI format.
    worker.kill();
    let t0 = Instant::now();
    loop {
        let (s, _) = http.get("/readyz").await.unwrap();
        if s == 503 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "router still ready after its worker died");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (s, text) =
        http.post_raw("/v1/chat/completions", chat("hi", json!({})).to_string().into_bytes()).await.unwrap();
    assert_error("worker gone", s, &text, 503);
    assert_eq!(http.get("/healthz").await.unwrap().0, 200);
    assert!(router.alive());
}

/// The disk KV tier survives a crash: `pagoda up` killed with SIGKILL and restarted on the same data dir serves the
/// prompt's prefix from disk (the index is rebuilt from the files) and gives the same greedy answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_worker_serves_prefix_from_disk() {
    let dir = std::env::temp_dir().join(format!("pagoda-e2e-tiers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_string_lossy().into_owned();
    // Host tier off: idle prefix groups go straight to disk. 8 groups of 16 tokens on the device.
    let args = ["--data-dir", d.as_str(), "--host-tier-mib", "0", "--disk-tier-mib", "64", "--num-blocks", "720"];
    let body = chat(
        "The library on the hill keeps three kinds of books: maps of rivers that no longer flow, recipes written by \
         sailors, and letters that were never sent. Question: what does the librarian keep?",
        json!({"temperature": 0, "max_tokens": 8}),
    );
    let disk_used = |s: &pagoda_e2e::StatsResponse| -> u64 {
        s.tiers.iter().filter(|t| t.tier == "disk").map(|t| t.used_bytes).sum()
    };

    let mut up = common::start_up("up-tiers-1", &args).await.unwrap();
    let (s, first) = up.http.post_json("/v1/chat/completions", &body).await.unwrap();
    assert_eq!(s, 200, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{first}");
    // The finished request's groups are written (and fsynced) right after its last step.
    let t0 = Instant::now();
    loop {
        let stats = worker_stats(&up.worker).await.unwrap();
        if stats.offloaded_groups_total > 0 && disk_used(&stats) > 0 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "nothing reached disk: {stats:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    up.proc.kill();

    let up = common::start_up("up-tiers-2", &args).await.unwrap();
    let before = worker_stats(&up.worker).await.unwrap();
    assert!(disk_used(&before) > 0, "index rebuilt from the files: {before:?}");
    assert_eq!(before.computed_tokens_total, 0);
    let (s, second) = up.http.post_json("/v1/chat/completions", &body).await.unwrap();
    assert_eq!(s, 200, "{second}");
    assert_eq!(second["choices"][0]["message"]["content"], first["choices"][0]["message"]["content"]);
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached >= 16, "the prefix came from disk: {second}");
    let t0 = Instant::now();
    let after = loop {
        let stats = worker_stats(&up.worker).await.unwrap();
        if stats.running == 0 || t0.elapsed() > Duration::from_secs(10) {
            break stats;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let disk_hits: u64 = after.prefix_hits.iter().filter(|h| h.tier == "disk").map(|h| h.tokens).sum();
    assert_eq!(disk_hits, cached, "{after:?}");
    assert_eq!(after.disk_corrupted_total, 0);
    drop(up);
    let _ = std::fs::remove_dir_all(&dir);
}

/// EvicPress placement in a real `pagoda up` with two profiling questions: a finished request's context is
/// profiled (on its own question and the two training queries the request gave in `kv.profile_queries`, in place
/// of the worker's two) while the worker is idle and placed on the host tier, the worker's `Stats` says so, and
/// the router's `/metrics` carries the profile count, the placement and each measured variant's quality. Training
/// queries past their bounds are a 400 naming the field; a bad question set is refused at start with a clear
/// message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicpress_profiles_on_its_questions_and_reports_to_metrics() {
    let dir = std::env::temp_dir().join(format!("pagoda-e2e-evicpress-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_string_lossy().into_owned();
    let mut args = vec![
        "--data-dir",
        d.as_str(),
        "--host-tier-mib",
        "64",
        "--tier-placement",
        "evicpress",
        "--evicpress-keep-ratios",
        "none",
        "--evicpress-upgrade",
        "--evicpress-profile-question",
        "Who is speaking in the passage above?",
        "--evicpress-profile-question",
        "How does the passage end?",
    ];
    let up = common::start_up("up-evicpress", &args).await.unwrap();
    let long_query = "stones ".repeat(140);
    for (case, queries, param) in [
        ("a query past 128 tokens", json!(["Which entry is first?", long_query]), "kv.profile_queries"),
        ("nine queries", json!(vec!["Which entry?"; 9]), "kv.profile_queries"),
        ("an empty query", json!([""]), "kv.profile_queries[0]"),
    ] {
        let body = chat(&river_log_prompt(), json!({"max_tokens": 4, "kv": {"profile_queries": queries}}));
        let (s, v) = up.http.post_json("/v1/chat/completions", &body).await.unwrap();
        let v = assert_error(case, s, &v.to_string(), 400);
        assert_eq!(v["error"]["param"], param, "{case}: {v}");
    }
    let training = json!({"profile_queries": ["Which entry mentions 10 stones?", "How many stones in entry 3?"]});
    let (s, body) = up
        .http
        .post_json("/v1/chat/completions", &chat(&river_log_prompt(), json!({"max_tokens": 4, "kv": training})))
        .await
        .unwrap();
    assert_eq!(s, 200, "{body}");
    let t0 = Instant::now();
    let ep = loop {
        let stats = worker_stats(&up.worker).await.unwrap();
        let ep = stats.evicpress.clone().expect("EvicPress stats under --tier-placement evicpress");
        if ep.profiles_total >= 1 && ep.pending == 0 && ep.placed.iter().any(|p| p.contexts > 0) {
            break ep;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "no profile and placement: {stats:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(ep.profile_questions, 2, "{ep:?}");
    assert_eq!(ep.contexts, 1, "{ep:?}");
    assert_eq!(ep.profiles_on_own_queries_total, ep.profiles_total, "profiled on the request's queries: {ep:?}");
    let host = ep.placed.iter().find(|p| p.tier == "host").map(|p| p.contexts);
    assert_eq!(host, Some(1), "the context fits the host tier: {ep:?}");
    // The native variant (1 by definition) and every codec the profile reached within its time budget.
    assert!(ep.variants.len() >= 2 && ep.variants[0].variant == "f16", "{ep:?}");
    assert!(ep.variants.iter().all(|v| (0.0..=1.0).contains(&v.mean_quality)), "{ep:?}");

    let (s, text) = up.http.get("/metrics").await.unwrap();
    assert_eq!(s, 200);
    let value = |name: &str| -> Option<f64> {
        text.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok())
    };
    let worker = &up.worker;
    let profiles = value(&format!("pagoda_router_worker_evicpress_profiles{{worker=\"{worker}\"}}"));
    assert!(profiles.is_some_and(|p| p >= 1.0), "profiles in /metrics:\n{text}");
    let own = value(&format!("pagoda_router_worker_evicpress_profiles_on_own_queries{{worker=\"{worker}\"}}"));
    assert_eq!(own, profiles, "profiles on own queries in /metrics:\n{text}");
    let placed = value(&format!("pagoda_router_worker_evicpress_placed_contexts{{worker=\"{worker}\",tier=\"host\"}}"));
    assert_eq!(placed, Some(1.0), "placement in /metrics:\n{text}");
    // Upgrades are on, and the context is stored whole: nothing to recompute.
    let upgrades = value(&format!("pagoda_router_worker_evicpress_changes{{worker=\"{worker}\",change=\"upgrade\"}}"));
    assert_eq!(upgrades, Some(0.0), "upgrades in /metrics:\n{text}");
    let first = &ep.variants[1];
    let name =
        format!("pagoda_router_worker_evicpress_variant_quality{{worker=\"{worker}\",variant=\"{}\"}}", first.variant);
    assert_eq!(value(&name), Some(first.mean_quality), "{} quality in /metrics:\n{text}", first.variant);
    let similarity = first.mean_embedding_similarity.expect("the CPU runner offers embeddings");
    assert!((0.0..=1.0).contains(&similarity), "{first:?}");
    let name = format!(
        "pagoda_router_worker_evicpress_variant_embedding_similarity{{worker=\"{worker}\",variant=\"{}\"}}",
        first.variant
    );
    assert_eq!(value(&name), Some(similarity), "{} similarity in /metrics:\n{text}", first.variant);
    drop(up);

    // Nine questions are one too many: the worker refuses to start and says why.
    let nine: Vec<String> = (0..9).map(|i| format!("--evicpress-profile-question=Question {i}?")).collect();
    args.truncate(8);
    args.extend(nine.iter().map(String::as_str));
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let mut argv = vec!["up", "--listen", "127.0.0.1:0", "--model", model.as_str(), "--threads", "1"];
    argv.extend_from_slice(&args);
    let out = std::process::Command::new(BIN).args(&argv).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at most 8 questions"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
