//! The block directory through real processes: workers report their blocks to a `pagoda kvstore` node, a router
//! places by what it learns from the kvstore's Watch feed (not only by its own predictions), and a worker whose
//! reports stop raises the router's stale-reports alarm. Also `pagoda up`'s embedded directory.

mod common;

use std::time::{Duration, Instant};

use common::BIN;
use pagoda_e2e::serde_json::{Value, json};
use pagoda_e2e::{Http, Proc, free_port, require_model, worker_stats};
use pagoda_kvstore::Client;
use pagoda_kvstore::proto as pb;

/// A system prompt of several hundred tokens: dozens of full blocks shared by every request that starts with it.
fn long_prefix() -> String {
    let mut s = String::from("You are the archivist of a lighthouse library. ");
    for i in 0..40 {
        s.push_str(&format!("Shelf {i} holds the logbooks of keeper number {i}, bound in blue leather. "));
    }
    s
}

fn shared_prefix_request(question: &str) -> Value {
    json!({
        "model": pagoda_e2e::MODEL_ID,
        "messages": [
            {"role": "system", "content": long_prefix()},
            {"role": "user", "content": question}
        ],
        "max_tokens": 2,
        "temperature": 0
    })
}

fn spawn_router(name: &str, model: &str, workers: &[&str], kvstore: &str) -> (Proc, Http) {
    let mut args =
        vec!["router", "--listen", "127.0.0.1:0", "--model", model, "--placement", "kv", "--kvstore", kvstore];
    for w in workers {
        args.push("--worker");
        args.push(w);
    }
    let mut p = Proc::spawn(BIN.as_ref(), name, &args).unwrap();
    let base = p.wait_line("pagoda router listening on ", Duration::from_secs(60)).unwrap();
    (p, Http::new(base))
}

fn spawn_worker(name: &str, model: &str, addr: &str, kvstore: &str) -> Proc {
    let args =
        ["worker", "--listen", addr, "--model", model, "--threads", "1", "--kvstore", kvstore, "--worker-id", name];
    let mut p = Proc::spawn(BIN.as_ref(), name, &args).unwrap();
    p.wait_line("pagoda worker listening on ", Duration::from_secs(120)).unwrap();
    p
}

/// Polls `/debug/placements` until `done` holds for it.
async fn wait_placements(http: &Http, what: &str, timeout: Duration, done: impl Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let (s, body) = http.get("/debug/placements").await.unwrap();
        assert_eq!(s, 200, "{body}");
        let v: Value = pagoda_e2e::serde_json::from_str(&body).unwrap();
        if done(&v) {
            return v;
        }
        assert!(t0.elapsed() < timeout, "{what} not within {timeout:?}: {v:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The directory's worker table, read linearizably.
async fn directory_workers(kvstore: &str) -> Vec<pb::WorkerInfo> {
    let mut c = Client::new(vec![kvstore.to_string()]).unwrap();
    c.read(pb::ReadRequest { workers: true, ..Default::default() }).await.unwrap().workers
}

async fn wait_directory_blocks(kvstore: &str, worker: &str, min_blocks: u64, timeout: Duration) -> pb::WorkerInfo {
    let t0 = Instant::now();
    loop {
        let workers = directory_workers(kvstore).await;
        if let Some(w) = workers.iter().find(|w| w.worker == worker && w.blocks >= min_blocks) {
            return w.clone();
        }
        assert!(t0.elapsed() < timeout, "{worker} has < {min_blocks} blocks in the directory: {workers:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn metric_line(http: &Http, prefix: &str) -> Option<String> {
    let (_, text) = http.get("/metrics").await.ok()?;
    text.lines().find(|l| l.starts_with(prefix)).map(str::to_string)
}

async fn wait_metric(http: &Http, line: &str, timeout: Duration) {
    let t0 = Instant::now();
    loop {
        let (_, text) = http.get("/metrics").await.unwrap();
        if text.lines().any(|l| l == line) {
            return;
        }
        assert!(t0.elapsed() < timeout, "no `{line}` in /metrics within {timeout:?}:\n{text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_router_places_by_the_directory_and_silent_workers_raise_the_alarm() {
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let tmp = std::env::temp_dir().join(format!("pagoda-e2e-directory-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let kv = format!("127.0.0.1:{}", free_port().unwrap());
    let kv_dir = tmp.join("kv").to_string_lossy().into_owned();
    let peer = format!("1={kv}");
    let mut kvstore = Proc::spawn(
        BIN.as_ref(),
        "kvstore",
        &["kvstore", "--node-id", "1", "--listen", &kv, "--peer", &peer, "--data-dir", &kv_dir],
    )
    .unwrap();
    kvstore.wait_line("pagoda kvstore listening on ", Duration::from_secs(30)).unwrap();

    let addr0 = format!("127.0.0.1:{}", free_port().unwrap());
    let addr1 = format!("127.0.0.1:{}", free_port().unwrap());
    let mut procs = vec![spawn_worker("wa", &model, &addr0, &kv), spawn_worker("wb", &model, &addr1, &kv)];

    // With nothing cached anywhere the costs tie, and the tie goes by a rank hashed from the worker's name and the
    // prompt's first block. Whichever worker that is, call it b (it holds the prefix from now on) and the other a.
    let (router1, http) = spawn_router("router1", &model, &[&addr0, &addr1], &kv);
    http.wait_ready(Duration::from_secs(30)).await.unwrap();
    let (s, v) = http.post_json("/v1/chat/completions", &shared_prefix_request("Where is shelf 3?")).await.unwrap();
    assert_eq!(s, 200, "{v}");
    let first = wait_placements(&http, "the first decision", Duration::from_secs(5), |v| {
        v["decisions"].as_array().is_some_and(|d| !d.is_empty())
    })
    .await;
    let holder = usize::from(first["decisions"][0]["chosen"] == addr1.as_str());
    assert_eq!(first["decisions"][0]["chosen"], [&addr0, &addr1][holder].as_str(), "{first:#}");
    let (a, b) = if holder == 1 { (addr0.clone(), addr1.clone()) } else { (addr1.clone(), addr0.clone()) };
    let (a_id, b_id) = if holder == 1 { ("wa", "wb") } else { ("wb", "wa") };
    let wa = procs.remove(1 - holder);
    let prompt_blocks = first["decisions"][0]["prompt_blocks"].as_u64().unwrap();
    assert!(prompt_blocks >= 20, "the prefix spans many blocks: {first:#}");

    // The kvstore's directory lists b's blocks (device, and host once idle), and none of a's.
    let info = wait_directory_blocks(&kv, b_id, prompt_blocks, Duration::from_secs(10)).await;
    assert!(info.blocks >= prompt_blocks, "{info:?}");
    assert_eq!(info.address, b);
    assert!(info.load.as_ref().is_some_and(|l| l.total_blocks > 0 && !l.occupancy.is_empty()), "{info:?}");
    let workers = directory_workers(&kv).await;
    assert_eq!(workers.iter().find(|w| w.worker == a_id).map(|w| w.blocks), Some(0), "{workers:?}");

    // A new router: it predicted nothing, so only the Watch feed can tell it that b holds the prefix (the hits in
    // its decision below come from nowhere else).
    drop(router1);
    let (_router2, http) = spawn_router("router2", &model, &[&a, &b], &kv);
    http.wait_ready(Duration::from_secs(30)).await.unwrap();
    wait_placements(&http, "the feed to map b's blocks", Duration::from_secs(15), |v| {
        let d = &v["directory"];
        d["connected"] == true
            && d["index_blocks"].as_u64().unwrap_or(0) >= prompt_blocks
            && d["workers"]
                .as_array()
                .is_some_and(|w| w.iter().any(|w| w["worker"] == b_id && w["router_worker"] == b.as_str()))
    })
    .await;
    let b_before = worker_stats(&b).await.unwrap();
    let hits_before = b_before.cached_tokens_total;
    let (s, v) = http.post_json("/v1/chat/completions", &shared_prefix_request("Where is shelf 7?")).await.unwrap();
    assert_eq!(s, 200, "{v}");
    let second = wait_placements(&http, "the second decision", Duration::from_secs(5), |v| {
        v["decisions"].as_array().is_some_and(|d| !d.is_empty())
    })
    .await;
    let d = &second["decisions"][0];
    assert_eq!(d["chosen"], b.as_str(), "placed by the directory: {second:#}");
    let cand = d["candidates"].as_array().unwrap().iter().find(|c| c["worker"] == b.as_str()).unwrap();
    let hits = cand["hits_device"].as_u64().unwrap() + cand["hits_host"].as_u64().unwrap();
    assert!(hits >= prompt_blocks - 2, "b's reported hits: {second:#}");
    // b prefilled the first request, and priced with the speed it measured then (nothing ran on it since).
    assert!(b_before.prefill_tokens_per_s > 0.0, "{b_before:?}");
    assert_eq!(cand["prefill_tokens_per_s"].as_f64(), Some(b_before.prefill_tokens_per_s), "{second:#}");
    let hits_after = worker_stats(&b).await.unwrap().cached_tokens_total;
    assert!(hits_after >= hits_before + 16 * (prompt_blocks - 2), "b served the prefix from cache: {hits_after}");

    // Freeze worker a: its heartbeats stop, and within a few seconds the router raises the alarm.
    assert_eq!(
        metric_line(&http, &format!("pagoda_router_worker_reports_stale{{worker=\"{a_id}\"}}")).await.as_deref(),
        Some(format!("pagoda_router_worker_reports_stale{{worker=\"{a_id}\"}} 0").as_str())
    );
    let pid = wa.pid().to_string();
    assert!(std::process::Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    let t0 = Instant::now();
    wait_metric(&http, &format!("pagoda_router_worker_reports_stale{{worker=\"{a_id}\"}} 1"), Duration::from_secs(15))
        .await;
    let raised = t0.elapsed();
    assert!(raised >= Duration::from_secs(2), "raised after {raised:?}: faster than the 3 s threshold allows");
    wait_metric(&http, &format!("pagoda_router_worker_reports_stale{{worker=\"{b_id}\"}} 0"), Duration::from_secs(1))
        .await;
    let v = wait_placements(&http, "a stale in the debug page", Duration::from_secs(2), |v| {
        v["directory"]["workers"]
            .as_array()
            .is_some_and(|w| w.iter().any(|w| w["worker"] == a_id && w["stale"] == true))
    })
    .await;
    assert!(v["directory"]["workers"].as_array().unwrap().iter().any(|w| w["worker"] == b_id && w["stale"] == false));
    // Thawed, it reports again and the alarm clears.
    assert!(std::process::Command::new("kill").args(["-CONT", &pid]).status().unwrap().success());
    wait_metric(&http, &format!("pagoda_router_worker_reports_stale{{worker=\"{a_id}\"}} 0"), Duration::from_secs(15))
        .await;
    let _ = std::fs::remove_dir_all(&tmp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pagoda_up_runs_a_real_directory() {
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let tmp = std::env::temp_dir().join(format!("pagoda-e2e-up-directory-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let data = tmp.to_string_lossy().into_owned();
    let mut up = Proc::spawn(
        BIN.as_ref(),
        "up-directory",
        &["up", "--listen", "127.0.0.1:0", "--model", &model, "--threads", "1", "--data-dir", &data],
    )
    .unwrap();
    let kv = up.wait_line("pagoda kvstore listening on ", Duration::from_secs(120)).unwrap();
    let worker = up.wait_line("pagoda worker listening on ", Duration::from_secs(30)).unwrap();
    let base = up.wait_line("pagoda router listening on ", Duration::from_secs(30)).unwrap();
    let http = Http::new(base);
    http.wait_ready(Duration::from_secs(60)).await.unwrap();
    let (s, v) = http.post_json("/v1/chat/completions", &shared_prefix_request("Where is shelf 1?")).await.unwrap();
    assert_eq!(s, 200, "{v}");
    // The embedded one-voter kvstore holds the embedded worker's blocks, registered at the worker's address.
    let t0 = Instant::now();
    let info = loop {
        let workers = directory_workers(&kv).await;
        if let Some(w) = workers.iter().find(|w| w.address == worker && w.blocks >= 20) {
            break w.clone();
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no blocks in the embedded directory: {workers:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(info.applied_seq > 0, "{info:?}");
    // Its raft log lives under the data dir, and the router's feed sees the same directory.
    assert!(tmp.join("kvstore").join("raft.redb").is_file());
    let v = wait_placements(&http, "the embedded feed", Duration::from_secs(10), |v| {
        v["directory"]["connected"] == true && v["directory"]["index_blocks"].as_u64().unwrap_or(0) >= 20
    })
    .await;
    assert_eq!(v["directory"]["workers"][0]["router_worker"], worker.as_str(), "{v:#}");
    drop(up);
    let _ = std::fs::remove_dir_all(&tmp);
}
