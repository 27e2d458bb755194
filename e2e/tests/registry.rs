//! The etcd registry through real processes: a real etcd on loopback, `pagoda kvstore` nodes, a `pagoda worker`
//! and a `pagoda router` that find each other only through it.
//! - Loss of the worker's lease (the process frozen past the 10 s TTL, as a hung host would be) must take it out of
//!   placement, and it must rejoin by itself when it runs again.
//! - kvstore nodes that join later (`--join`) are added to the raft cluster by asking it, and the worker, the
//!   router's directory feed and its dashboard follow them: once the node they started with dies they carry on
//!   with the new ones.
//! - Two routers on one registry share the Responses API's stored responses.

mod common;

use std::time::{Duration, Instant};

use common::BIN;
use pagoda_e2e::cluster::die_with_parent;
use pagoda_e2e::serde_json::{Value, json};
use pagoda_e2e::{Http, MODEL_ID, Proc, free_port, require_model, wait_until, worker_stats};
use pagoda_kvstore::Client;
use pagoda_kvstore::proto as pb;
use pagoda_registry::local::LocalEtcd;

async fn wait_for(http: &Http, addr: &str, want: Option<bool>, limit: Duration) -> Duration {
    wait_until(&format!("the router to see {addr} as {want:?}"), limit, || async {
        http.worker_ready(addr).await == want
    })
    .await
}

/// A one-node kvstore registered in etcd `url` (workers need one), and its data directory.
fn one_kvstore(name: &str, url: &str) -> (Proc, std::path::PathBuf) {
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let dir = std::env::temp_dir().join(format!("pagoda-e2e-{name}-kv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    (spawn_kvstore(&format!("{name}-kvstore"), 1, &addr, &dir, url, false), dir)
}

/// Worker `w0` and a router, both given only etcd; returns once the router sees the worker ready.
async fn worker_and_router(name: &str, model: &str, etcd: &str) -> (Proc, Proc, Http, String) {
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let wargs = ["worker", "--listen", &addr, "--model", model, "--threads", "1", "--etcd", etcd, "--worker-id", "w0"];
    let mut worker = Proc::spawn_with(BIN.as_ref(), &format!("{name}-worker"), &wargs, die_with_parent).unwrap();
    worker.wait_line("pagoda worker listening on ", Duration::from_secs(120)).unwrap();
    let (router, http) = router_until_ready(&format!("{name}-router"), model, etcd, &addr).await;
    (worker, router, http, addr)
}

/// A router given only etcd; returns once it sees the worker at `worker` ready.
async fn router_until_ready(name: &str, model: &str, etcd: &str, worker: &str) -> (Proc, Http) {
    let rargs = ["router", "--listen", "127.0.0.1:0", "--model", model, "--etcd", etcd];
    let mut router = Proc::spawn_with(BIN.as_ref(), name, &rargs, die_with_parent).unwrap();
    let http = Http::new(router.wait_line("pagoda router listening on ", Duration::from_secs(60)).unwrap());
    wait_for(&http, worker, Some(true), Duration::from_secs(30)).await;
    (router, http)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_lease_expires_leaves_placement_and_rejoins() {
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let etcd = LocalEtcd::start("e2e-lease").await.unwrap();
    let url = etcd.client_url.clone();
    let (mut kvstore, kv_dir) = one_kvstore("lease", &url);
    let (mut worker, mut router, http, addr) = worker_and_router("lease", &model, &url).await;
    let chat = json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
                      "temperature": 0});
    let (s, v) = http.post_json("/v1/chat/completions", &chat).await.unwrap();
    assert_eq!(s, 200, "{v}");

    // Frozen past its 10 s lease: etcd deletes its key, and the router drops it (not just marks it down).
    let pid = worker.pid() as i32;
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let left_after = wait_for(&http, &addr, None, Duration::from_secs(25)).await;
    let (s, v) = http.post_json("/v1/chat/completions", &chat).await.unwrap();
    assert_eq!(s, 503, "no worker is registered: {v}");
    assert!(http.metric_sum("pagoda_router_registry_left").await >= 1.0);

    // Running again: its keep-alive finds the lease gone, it registers under a new one, and the router takes it back.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let back_after = wait_for(&http, &addr, Some(true), Duration::from_secs(30)).await;
    let (s, v) = http.post_json("/v1/chat/completions", &chat).await.unwrap();
    assert_eq!(s, 200, "{v}");
    assert!(http.metric_sum("pagoda_router_registry_joined").await >= 2.0);
    println!(
        "LEASE {}",
        json!({"left_after_stop_s": left_after.as_secs_f64(), "back_after_cont_s": back_after.as_secs_f64()})
    );
    router.kill();
    worker.kill();
    kvstore.kill();
    let _ = std::fs::remove_dir_all(&kv_dir);
}

fn spawn_kvstore(name: &str, id: u64, addr: &str, data: &std::path::Path, etcd: &str, join: bool) -> Proc {
    let (id, data) = (id.to_string(), data.to_string_lossy().into_owned());
    let mut args =
        vec!["kvstore", "--node-id", &id, "--listen", addr, "--advertise", addr, "--data-dir", &data, "--etcd", etcd];
    if join {
        args.push("--join");
    }
    let mut p = Proc::spawn_with(BIN.as_ref(), name, &args, die_with_parent).unwrap();
    p.wait_line("pagoda kvstore listening on ", Duration::from_secs(60)).unwrap();
    p
}

async fn placements(http: &Http) -> Value {
    let (s, body) = http.get("/debug/placements").await.unwrap();
    assert_eq!(s, 200, "{body}");
    pagoda_e2e::serde_json::from_str(&body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_and_routers_follow_kvstore_nodes_that_join_after_them() {
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let etcd = LocalEtcd::start("e2e-kv-members").await.unwrap();
    let url = etcd.client_url.clone();
    let dir = std::env::temp_dir().join(format!("pagoda-e2e-kv-members-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let addrs: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port().unwrap())).collect();

    // One node bootstraps alone; the worker and the router start knowing only it.
    let mut first = spawn_kvstore("members-kv1", 1, &addrs[0], &dir.join("kv1"), &url, false);
    let (mut worker, mut router, http, addr) = worker_and_router("members", &model, &url).await;
    let chat = |text: &str| json!({"model": MODEL_ID, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0});
    let (s, v) =
        http.post_json("/v1/chat/completions", &chat("Name three rivers in Europe and one in Asia.")).await.unwrap();
    assert_eq!(s, 200, "{v}");
    wait_until("the worker's first report", Duration::from_secs(30), || async {
        worker_stats(&addr).await.is_ok_and(|s| s.report_acked_seq > 0)
    })
    .await;

    // Two more nodes join through the registry: each asks the cluster to add it.
    let mut joined: Vec<Proc> = (1..3)
        .map(|i| {
            spawn_kvstore(
                &format!("members-kv{}", i + 1),
                i as u64 + 1,
                &addrs[i],
                &dir.join(format!("kv{}", i + 1)),
                &url,
                true,
            )
        })
        .collect();
    let t0 = Instant::now();
    wait_until("three voters, all caught up", Duration::from_secs(60), || async {
        let Ok(lead) = Client::status_of(&addrs[0]).await else { return false };
        if lead.members.len() != 3 {
            return false;
        }
        let mut caught_up = true;
        for a in &addrs[1..] {
            caught_up &= Client::status_of(a).await.is_ok_and(|s| s.applied_index >= lead.commit_index);
        }
        caught_up
    })
    .await;
    let joined_after = t0.elapsed();
    // The dashboard lists the new nodes.
    wait_until("the dashboard to poll three kvstore nodes", Duration::from_secs(30), || async {
        let Ok((200, body)) = http.get("/dashboard/api/state").await else { return false };
        let v: Value = pagoda_e2e::serde_json::from_str(&body).unwrap_or_default();
        v["kvstore"]["nodes"].as_array().is_some_and(|n| n.len() == 3)
    })
    .await;

    // The node they started with dies; the two joined ones keep a quorum.
    first.kill();
    let killed_at = Instant::now();
    let acked = worker_stats(&addr).await.unwrap().report_acked_seq;
    let (s, v) =
        http.post_json("/v1/chat/completions", &chat("Write a haiku about a lighthouse in the fog.")).await.unwrap();
    assert_eq!(s, 200, "{v}");
    wait_until("the worker's new blocks to be acknowledged by the new nodes", Duration::from_secs(40), || async {
        worker_stats(&addr).await.is_ok_and(|s| s.report_acked_seq > acked)
    })
    .await;
    let acked = worker_stats(&addr).await.unwrap().report_acked_seq;
    let reported_after = killed_at.elapsed();
    // The router's feed moved to a live node and applied everything the worker was told was stored.
    wait_until("the router's feed to follow a joined node", Duration::from_secs(40), || async {
        let v = placements(&http).await;
        let d = &v["directory"];
        let on_new = addrs[1..].iter().any(|a| d["node"] == a.as_str());
        let applied = d["workers"]
            .as_array()
            .and_then(|ws| ws.iter().find(|w| w["worker"] == "w0"))
            .and_then(|w| w["applied_seq"].as_u64())
            .unwrap_or(0);
        on_new && d["connected"] == true && applied >= acked
    })
    .await;
    let followed_after = killed_at.elapsed();
    let mut c = Client::new(addrs[1..].to_vec()).unwrap();
    let table = c.read(pb::ReadRequest { workers: true, ..Default::default() }).await.unwrap().workers;
    let w0 = table.iter().find(|w| w.worker == "w0").expect("w0 in the directory");
    assert!(w0.applied_seq >= acked, "{w0:?}");
    println!(
        "KVSTORE_MEMBERS {}",
        json!({"joined_s": joined_after.as_secs_f64(), "worker_reported_s": reported_after.as_secs_f64(),
               "router_followed_s": followed_after.as_secs_f64()})
    );
    router.kill();
    worker.kill();
    for p in &mut joined {
        p.kill();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The Responses API behind two routers that share the registry: a response stored through one is continued,
/// retrieved and deleted through the other (stored responses live in etcd, under the cluster's prefix, on leases).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_stored_through_one_router_is_continued_through_another() {
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let etcd = LocalEtcd::start("e2e-responses").await.unwrap();
    let url = etcd.client_url.clone();
    let (mut kvstore, kv_dir) = one_kvstore("responses", &url);
    let (mut worker, mut first, a, addr) = worker_and_router("responses", &model, &url).await;
    let (mut second, b) = router_until_ready("responses-router-2", &model, &url, &addr).await;

    let ask = json!({"model": MODEL_ID, "input": "What is the capital city of France? Answer in one word.",
        "temperature": 0, "max_output_tokens": 16});
    let (s, r) = a.post_json("/v1/responses", &ask).await.unwrap();
    assert_eq!(s, 200, "{r}");
    let id = r["id"].as_str().unwrap().to_string();
    let (s, got) = b.get(&format!("/v1/responses/{id}")).await.unwrap();
    assert_eq!(s, 200, "{got}");
    assert_eq!(pagoda_e2e::serde_json::from_str::<Value>(&got).unwrap(), r, "the other router reads it back");
    let follow = json!({"model": MODEL_ID, "input": "And of Germany?", "previous_response_id": id, "temperature": 0,
        "max_output_tokens": 16});
    let (s, f) = b.post_json("/v1/responses", &follow).await.unwrap();
    assert_eq!(s, 200, "the other router continues the conversation: {f}");
    let answer = r["output"][0]["content"][0]["text"].as_str().unwrap();
    let whole = json!({"model": MODEL_ID, "temperature": 0, "max_tokens": 16, "messages": [
        {"role": "user", "content": "What is the capital city of France? Answer in one word."},
        {"role": "assistant", "content": answer}, {"role": "user", "content": "And of Germany?"}]});
    let (s, c) = a.post_json("/v1/chat/completions", &whole).await.unwrap();
    assert_eq!(s, 200, "{c}");
    assert_eq!(f["output"][0]["content"][0]["text"], c["choices"][0]["message"]["content"]);

    let resp = b.client.delete(b.url(&format!("/v1/responses/{id}"))).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let (s, _) = a.get(&format!("/v1/responses/{id}")).await.unwrap();
    assert_eq!(s, 404, "deleted through one router, gone from the other");
    let (s, e) = a.post_json("/v1/responses", &follow).await.unwrap();
    assert_eq!((s, e["error"]["code"].as_str()), (400, Some("previous_response_not_found")), "{e}");
    let (s, _) = a.get("/v1/responses/not%2Fan-id").await.unwrap();
    assert_eq!(s, 404, "an id that cannot be one is not looked up");
    second.kill();
    first.kill();
    worker.kill();
    kvstore.kill();
    let _ = std::fs::remove_dir_all(&kv_dir);
}
