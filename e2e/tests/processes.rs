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

/// A worker's stats once it runs and queues nothing (at most 20 s).
async fn idle_stats(addr: &str) -> pagoda_e2e::StatsResponse {
    let t0 = Instant::now();
    loop {
        let s = worker_stats(addr).await.unwrap();
        if (s.running == 0 && s.waiting == 0) || t0.elapsed() > Duration::from_secs(20) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Writes a synthetic rank-8 adapter with `seed` into `dir` (`pagoda lora synth`).
fn synth_adapter(dir: &std::path::Path, seed: u64) {
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let seed = seed.to_string();
    let out = std::process::Command::new(BIN)
        .args(["lora", "synth", "--model", &model, "--rank", "8", "--b-std", "0.3", "--seed", &seed, "--out"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "lora synth: {}", String::from_utf8_lossy(&out.stderr));
}

/// On-demand LoRA through the router (vLLM's filesystem resolver, llm-d's adapter affinity): two workers with
/// one adapter slot each (`--lora-on-demand --max-loras 1`) and two adapters in their `--lora-dir`. The router
/// lists both adapters before either is loaded; the first request of each loads it where it displaces nothing,
/// and every later request of an adapter goes where it is loaded (its prompt cached there), so six alternating
/// chats cost two loads and no eviction. An adapter the directory lacks is a 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_adapters_load_on_demand_and_their_requests_stay_where_they_are_loaded() {
    use pagoda_e2e::cluster::ClusterBuilder;
    let root = std::env::temp_dir().join(format!("pagoda-e2e-lora-on-demand-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    synth_adapter(&root.join("a"), 1);
    synth_adapter(&root.join("b"), 2);
    let flags = ["--lora-dir", root.to_str().unwrap(), "--lora-on-demand", "--max-loras", "1"];
    let cluster = ClusterBuilder::new(BIN, "lora-on-demand").workers(2).worker_args(&flags).start().await.unwrap();
    let http = cluster.http(0).clone();
    let (s, models) = http.get("/v1/models").await.unwrap();
    assert_eq!(s, 200, "{models}");
    let models: pagoda_e2e::serde_json::Value = pagoda_e2e::serde_json::from_str(&models).unwrap();
    let ids: Vec<&str> = models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, [pagoda_e2e::MODEL_ID, "a", "b"]);

    let ask = |model: &str| {
        json!({"model": model, "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
               "max_tokens": 8, "temperature": 0, "ignore_eos": true})
    };
    let mut answers: std::collections::HashMap<&str, Vec<(String, u64)>> = Default::default();
    for model in ["a", "b", "a", "b", "a", "b"] {
        let (s, body) = http.post_json("/v1/chat/completions", &ask(model)).await.unwrap();
        assert_eq!(s, 200, "{body}");
        answers.entry(model).or_default().push((
            body["choices"][0]["message"]["content"].as_str().unwrap().to_string(),
            body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
        ));
    }
    for (model, got) in &answers {
        assert!(got.iter().all(|(text, _)| *text == got[0].0), "{model}: greedy answers differ: {got:?}");
        assert!(got[1..].iter().all(|(_, cached)| *cached > 0), "{model}: later chats found their prompt: {got:?}");
    }
    assert_ne!(answers["a"][0].0, answers["b"][0].0);
    let (mut loads, mut evictions) = (0, 0);
    for i in 0..2 {
        let st = idle_stats(cluster.worker_addr(i)).await;
        loads += st.lora_on_demand_loads_total;
        evictions += st.lora_evictions_total;
    }
    assert_eq!((loads, evictions), (2, 0), "each adapter loaded once, where it displaced nothing");
    let ready = common::ready_workers(&http).await;
    let mut held: Vec<String> = ready.values().map(|w| w["lora_adapters"].to_string()).collect();
    held.sort();
    assert_eq!(held, ["[\"a\"]", "[\"b\"]"], "{ready:?}");

    let (s, body) = http.post_json("/v1/chat/completions", &ask("zzz")).await.unwrap();
    assert_eq!(s, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found");
    assert_eq!(http.metric_sum("pagoda_router_worker_lora_on_demand_loads").await, 2.0);
    let _ = std::fs::remove_dir_all(&root);
}

/// Multi-LoRA through the router: `pagoda lora synth` writes an adapter, one of two workers serves it
/// (`--lora sql=DIR`). The router lists it as a model, sends its requests only to that worker (whatever the
/// placement would otherwise pick), caches its prompts apart from the base model's, answers as the worker does,
/// counts it, and refuses an adapter nobody serves with OpenAI's 404. Then at run time: the admin endpoint loads
/// the same weights under another name on the other worker (`--lora-dir`; the first has none and says so), which
/// then serves it with the same answers, and unloads it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_requests_go_to_the_workers_that_serve_the_adapter() {
    use pagoda_e2e::cluster::ClusterBuilder;
    let root = std::env::temp_dir().join(format!("pagoda-e2e-lora-{}", std::process::id()));
    let dir = root.join("sql");
    synth_adapter(&dir, 1);
    let spec = format!("sql={}", dir.display());
    let mut cluster = ClusterBuilder::new(BIN, "lora")
        .workers(2)
        .worker_args_for(0, &["--lora", &spec])
        .worker_args_for(1, &["--lora-dir", root.to_str().unwrap()])
        // Round robin would send every other request to worker 1: the adapter must override it.
        .router_args(&["--placement", "round_robin"])
        .start()
        .await
        .unwrap();
    let (with, without) = (cluster.worker_addr(0).to_string(), cluster.worker_addr(1).to_string());
    let http = cluster.http(0).clone();
    let (s, models) = http.get("/v1/models").await.unwrap();
    assert_eq!(s, 200, "{models}");
    let models: pagoda_e2e::serde_json::Value = pagoda_e2e::serde_json::from_str(&models).unwrap();
    let ids: Vec<&str> = models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, [pagoda_e2e::MODEL_ID, "sql"]);
    assert_eq!(models["data"][1]["parent"], pagoda_e2e::MODEL_ID);
    let (s, card) = http.get("/v1/models/sql").await.unwrap();
    assert_eq!(s, 200, "{card}");
    let ready = common::ready_workers(&http).await;
    assert_eq!((&ready[&with]["lora_adapters"], &ready[&without]["lora_adapters"]), (&json!(["sql"]), &json!([])));

    let ask = |model: &str, question: &str| {
        json!({"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 12,
               "temperature": 0, "ignore_eos": true})
    };
    let question = "Write a SQL query that counts the rows of the table orders.";
    let before = worker_stats(&without).await.unwrap().computed_tokens_total;
    let mut answers = Vec::new();
    for _ in 0..3 {
        let (s, body) = http.post_json("/v1/chat/completions", &ask("sql", question)).await.unwrap();
        assert_eq!(s, 200, "{body}");
        assert_eq!(body["model"], "sql");
        answers.push((
            body["choices"][0]["message"]["content"].as_str().unwrap().to_string(),
            body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
        ));
    }
    assert_eq!(worker_stats(&without).await.unwrap().computed_tokens_total, before, "worker 1 has no adapter");
    assert!(answers.iter().all(|(text, _)| *text == answers[0].0), "greedy answers differ: {answers:?}");
    assert_eq!(answers[0].1, 0);
    assert!(answers[1].1 > 0, "the adapter's second identical chat reused its cached prompt: {answers:?}");

    // The base model answers otherwise, and does not adopt the adapter's cached prompt on the adapter's worker.
    // Round robin alternates between the two workers: within two requests one lands on the adapter's worker. What
    // the first base chat there finds cached may only be the base model's blocks pulled from the other worker (a
    // peer hint), never the adapter's.
    let mut landed = None;
    for _ in 0..2 {
        // The engine publishes its stats after a step: an answer can reach the client first.
        let before = idle_stats(&with).await;
        let (s, body) = http.post_json("/v1/chat/completions", &ask(pagoda_e2e::MODEL_ID, question)).await.unwrap();
        assert_eq!(s, 200, "{body}");
        assert_ne!(body["choices"][0]["message"]["content"].as_str().unwrap(), answers[0].0);
        let after = idle_stats(&with).await;
        if after.computed_tokens_total > before.computed_tokens_total {
            let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
            let pulled = after.peer_fetched_blocks_total - before.peer_fetched_blocks_total;
            landed = Some(cached.saturating_sub(16 * pulled));
            // A second base chat there would find the first one's blocks, rightly.
            break;
        }
    }
    assert_eq!(landed, Some(0), "the base chat on the adapter's worker adopted none of the adapter's blocks");

    let (s, body) = http.post_json("/v1/chat/completions", &ask("nope", question)).await.unwrap();
    assert_eq!(s, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found");
    assert_eq!(http.metric_sum("pagoda_router_lora_requests_total").await, 3.0);

    // Run time: the same weights as `live` on worker 1, the only one with --lora-dir.
    let (s, body) =
        http.post_json("/v1/load_lora_adapter", &json!({"lora_name": "live", "lora_path": "../sql"})).await.unwrap();
    assert_eq!(s, 400, "{body}");
    let (s, body) =
        http.post_json("/v1/load_lora_adapter", &json!({"lora_name": "live", "lora_path": "sql"})).await.unwrap();
    assert_eq!(s, 200, "{body}");
    let outcome =
        |addr: &str| body["workers"].as_array().unwrap().iter().find(|w| w["address"] == addr).unwrap().clone();
    assert_eq!(outcome(&without)["ok"], true, "{body}");
    assert_eq!(outcome(&with)["ok"], false, "{body}");
    assert!(outcome(&with)["error"].as_str().unwrap().contains("--lora-dir"), "{body}");
    let (_, models) = http.get("/v1/models").await.unwrap();
    assert!(models.contains("\"live\""), "{models}");
    let before = worker_stats(&without).await.unwrap().computed_tokens_total;
    let (s, body) = http.post_json("/v1/chat/completions", &ask("live", question)).await.unwrap();
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"].as_str().unwrap(), answers[0].0, "the same weights");
    assert!(worker_stats(&without).await.unwrap().computed_tokens_total > before, "served by worker 1");
    // Worker 1 restarts and comes back without it; once the router finds it ready again, the router loads the
    // adapters its admin API loaded, and `live` is served again without a second admin call.
    // The router may not even see it down: a restart can be quicker than its probe interval (the new process's
    // `Health.boot_id` tells it). Asked directly, the new process lists `live` only once the router loaded it.
    let boot = pagoda_e2e::worker_health(&without).await.unwrap().boot_id;
    cluster.restart_worker(1).unwrap();
    let health = pagoda_e2e::worker_health(&without).await.unwrap();
    assert_ne!(health.boot_id, boot, "a new process");
    let t0 = Instant::now();
    loop {
        let health = pagoda_e2e::worker_health(&without).await.unwrap();
        if health.lora_adapters.iter().any(|a| a.name == "live") {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "live not loaded again: {health:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.wait_router_sees(0, 1, true, Duration::from_secs(10)).await.unwrap();
    let (s, body) = http.post_json("/v1/chat/completions", &ask("live", question)).await.unwrap();
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"].as_str().unwrap(), answers[0].0, "the same weights");
    // Replacing it in place from a path that holds no adapter fails and leaves it serving; a good path replaces it.
    let replace = |path: &str| json!({"lora_name": "live", "lora_path": path, "load_inplace": true});
    let (s, body) = http.post_json("/v1/load_lora_adapter", &replace("missing")).await.unwrap();
    assert_eq!(s, 400, "{body}");
    let (s, body) = http.post_json("/v1/chat/completions", &ask("live", question)).await.unwrap();
    assert_eq!(s, 200, "the failed replacement left the adapter loaded: {body}");
    assert_eq!(body["choices"][0]["message"]["content"].as_str().unwrap(), answers[0].0);
    let (s, body) = http.post_json("/v1/load_lora_adapter", &replace("sql")).await.unwrap();
    assert_eq!(s, 200, "{body}");
    let (s, body) = http.post_json("/v1/chat/completions", &ask("live", question)).await.unwrap();
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"].as_str().unwrap(), answers[0].0);
    let (s, body) = http.post_json("/v1/unload_lora_adapter", &json!({"lora_name": "live"})).await.unwrap();
    assert_eq!(s, 200, "{body}");
    let (s, body) = http.post_json("/v1/chat/completions", &ask("live", question)).await.unwrap();
    assert_eq!(s, 404, "{body}");
    let (s, body) = http.post_json("/v1/unload_lora_adapter", &json!({"lora_name": "live"})).await.unwrap();
    assert_eq!(s, 404, "{body}");
    let _ = std::fs::remove_dir_all(&root);
}
