//! The etcd registry through real processes: a real etcd on loopback, a one-voter `pagoda kvstore`, a `pagoda
//! worker` and a `pagoda router` that find each other only through it. Loss of the worker's lease (the process frozen past the 10 s TTL, as a
//! hung host would be) must take it out of placement, and it must rejoin by itself when it runs again.

mod common;

use std::time::Duration;

use common::BIN;
use pagoda_e2e::cluster::die_with_parent;
use pagoda_e2e::serde_json::json;
use pagoda_e2e::{Http, MODEL_ID, Proc, free_port, require_model, wait_until};
use pagoda_registry::local::LocalEtcd;

async fn wait_for(http: &Http, addr: &str, want: Option<bool>, limit: Duration) -> Duration {
    wait_until(&format!("the router to see {addr} as {want:?}"), limit, || async {
        http.worker_ready(addr).await == want
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_lease_expires_leaves_placement_and_rejoins() {
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let etcd = LocalEtcd::start("e2e-lease").await.unwrap();
    let url = etcd.client_url.clone();
    let kv_addr = format!("127.0.0.1:{}", free_port().unwrap());
    let kv_dir = std::env::temp_dir().join(format!("pagoda-e2e-lease-kv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&kv_dir);
    let kv_dir_s = kv_dir.to_string_lossy().into_owned();
    let peer = format!("1={kv_addr}");
    let kargs =
        ["kvstore", "--node-id", "1", "--listen", &kv_addr, "--peer", &peer, "--data-dir", &kv_dir_s, "--etcd", &url];
    let mut kvstore = Proc::spawn_with(BIN.as_ref(), "lease-kvstore", &kargs, die_with_parent).unwrap();
    kvstore.wait_line("pagoda kvstore listening on ", Duration::from_secs(60)).unwrap();
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let wargs = ["worker", "--listen", &addr, "--model", &model, "--threads", "1", "--etcd", &url, "--worker-id", "w0"];
    let mut worker = Proc::spawn_with(BIN.as_ref(), "lease-worker", &wargs, die_with_parent).unwrap();
    worker.wait_line("pagoda worker listening on ", Duration::from_secs(120)).unwrap();
    let rargs = ["router", "--listen", "127.0.0.1:0", "--model", &model, "--etcd", &url];
    let mut router = Proc::spawn_with(BIN.as_ref(), "lease-router", &rargs, die_with_parent).unwrap();
    let http = Http::new(router.wait_line("pagoda router listening on ", Duration::from_secs(60)).unwrap());
    wait_for(&http, &addr, Some(true), Duration::from_secs(30)).await;
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
