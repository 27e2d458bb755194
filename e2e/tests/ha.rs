//! The whole cluster as the Helm chart deploys it, as real processes on loopback: a real etcd, three `pagoda
//! kvstore` raft nodes that find each other through it, three `pagoda worker`s and two `pagoda router` replicas that
//! are given nothing but the etcd address. Under load it goes through, in turn:
//!
//! 1. SIGKILL of the kvstore leader. No request is lost. On both surviving nodes the directory converges to every
//!    worker's real residency, and no acknowledged block event is lost: no worker had to re-send a snapshot, its
//!    epoch is unchanged, and each node has applied every sequence number the worker saw acknowledged.
//! 2. The routers agree: once caught up, both replicas place the same requests on the same workers
//!    (`POST /debug/place`, a dry run).
//! 3. SIGKILL of a router under load on both. Clients whose connection fails send the request again to the other
//!    router, and nothing is lost; the restarted one finds the workers in etcd and the residency in the kvstore's
//!    Watch feed, and agrees again.
//! 4. A worker restart. It comes back under a new epoch with its disk tier intact, the directory holds those disk
//!    copies under the new epoch, and a request whose prefix is only on that disk is placed there by both routers,
//!    onboarded from disk, and answered exactly as before.
//! 5. SIGKILL of a worker mid-stream under load on both routers: its streams migrate and complete, each equal to
//!    the greedy reference.
//!
//! Each phase prints an `HA {json}` line with its measurements.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::BIN;
use pagoda_e2e::cluster::die_with_parent;
use pagoda_e2e::load::{self, LoadConfig, Mode, Record, Reference, Report, Streaming};
use pagoda_e2e::serde_json::{Value, json};
use pagoda_e2e::{
    Http, MODEL_ID, Proc, ResidencyResponse, free_port, require_model, wait_until, worker_residency, worker_stats,
};
use pagoda_kvstore::Client;
use pagoda_kvstore::proto as pb;
use pagoda_registry::local::LocalEtcd;

const ROUTER_ARGS: &[&str] =
    &["--placement", "kv", "--stall-timeout-ms", "2000", "--first-token-timeout-ms", "30000", "--max-retries", "2"];
const KVSTORES: u64 = 3;
const WORKERS: usize = 3;
const MAX_TOKENS: u32 = 8;

struct Worker {
    id: String,
    addr: String,
    args: Vec<String>,
    proc: Option<Proc>,
}

struct Router {
    proc: Proc,
    http: Http,
}

/// Every process of the cluster; dropping it kills them all (and they die with the test process anyway).
struct Ha {
    model: String,
    etcd: LocalEtcd,
    dir: PathBuf,
    kvstores: BTreeMap<u64, (String, Option<Proc>)>,
    workers: Vec<Worker>,
    routers: Vec<Router>,
    /// Killed processes, kept for their logs.
    retired: Vec<Proc>,
}

impl Drop for Ha {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let live = self.kvstores.values().filter_map(|k| k.1.as_ref());
            let live = live.chain(self.workers.iter().filter_map(|w| w.proc.as_ref()));
            for p in live.chain(self.routers.iter().map(|r| &r.proc)).chain(&self.retired) {
                eprintln!("---- {} ----\n{}", p.name(), p.log_tail());
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn spawn(name: &str, args: &[String]) -> Proc {
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    Proc::spawn_with(BIN.as_ref(), name, &argv, die_with_parent).unwrap()
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

impl Ha {
    async fn start() -> Ha {
        let model = require_model().unwrap().to_string_lossy().into_owned();
        let etcd = LocalEtcd::start("e2e-ha").await.unwrap();
        let dir = std::env::temp_dir().join(format!("pagoda-e2e-ha-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut ha = Ha {
            model,
            etcd,
            dir,
            kvstores: BTreeMap::new(),
            workers: Vec::new(),
            routers: Vec::new(),
            retired: Vec::new(),
        };
        // The kvstore nodes bootstrap from each other's etcd keys: start all three, then wait for each.
        for id in 1..=KVSTORES {
            let addr = format!("127.0.0.1:{}", free_port().unwrap());
            let proc = ha.spawn_kvstore(id, &addr);
            ha.kvstores.insert(id, (addr, Some(proc)));
        }
        for (_, proc) in ha.kvstores.values_mut() {
            proc.as_mut().unwrap().wait_line("pagoda kvstore listening on ", Duration::from_secs(60)).unwrap();
        }
        for i in 0..WORKERS {
            let addr = format!("127.0.0.1:{}", free_port().unwrap());
            let data = ha.dir.join(format!("w{i}")).to_string_lossy().into_owned();
            let id = format!("w{i}");
            // Every idle group is copied down to disk (no host tier), so a restart finds the worker's prefixes there.
            let args = strings(&[
                "worker",
                "--listen",
                &addr,
                "--model",
                &ha.model,
                "--threads",
                "1",
                "--etcd",
                &ha.etcd.client_url,
                "--worker-id",
                &id,
                "--host-tier-mib",
                "0",
                "--disk-tier-mib",
                "64",
                "--data-dir",
                &data,
            ]);
            let proc = spawn(&format!("ha-{id}"), &args);
            ha.workers.push(Worker { id, addr, args, proc: Some(proc) });
        }
        for w in &mut ha.workers {
            w.proc.as_mut().unwrap().wait_line("pagoda worker listening on ", Duration::from_secs(120)).unwrap();
        }
        for r in 0..2 {
            let router = ha.spawn_router(&format!("ha-router{r}")).await;
            ha.routers.push(router);
        }
        ha
    }

    fn spawn_kvstore(&self, id: u64, addr: &str) -> Proc {
        let data = self.dir.join(format!("kv{id}")).to_string_lossy().into_owned();
        let args = strings(&[
            "kvstore",
            "--node-id",
            &id.to_string(),
            "--listen",
            addr,
            "--advertise",
            addr,
            "--data-dir",
            &data,
            "--etcd",
            &self.etcd.client_url,
            "--expect-voters",
            &KVSTORES.to_string(),
            "--snapshot-every",
            "200",
        ]);
        spawn(&format!("ha-kvstore{id}"), &args)
    }

    /// Starts a router replica (given only etcd) and waits until it sees every worker ready.
    async fn spawn_router(&self, name: &str) -> Router {
        let mut args = strings(&["router", "--listen", "127.0.0.1:0", "--model", &self.model, "--etcd"]);
        args.push(self.etcd.client_url.clone());
        args.extend(strings(ROUTER_ARGS));
        let mut proc = spawn(name, &args);
        let http = Http::new(proc.wait_line("pagoda router listening on ", Duration::from_secs(60)).unwrap());
        for w in &self.workers {
            wait_until(&format!("{name} to see {} ready", w.id), Duration::from_secs(60), || async {
                http.worker_ready(&w.addr).await == Some(true)
            })
            .await;
        }
        Router { proc, http }
    }

    fn kvstore_addrs(&self) -> Vec<String> {
        self.kvstores.values().filter(|k| k.1.is_some()).map(|k| k.0.clone()).collect()
    }
}

async fn leader_of(addrs: &[String]) -> String {
    pagoda_e2e::kvstore_leader(addrs, Duration::from_secs(30)).await.unwrap()
}

fn tier_name(t: i32) -> &'static str {
    match pb::Tier::try_from(t) {
        Ok(pb::Tier::Device) => "device",
        Ok(pb::Tier::Host) => "host",
        Ok(pb::Tier::Disk) => "disk",
        Err(_) => "unknown",
    }
}

/// Whether kvstore node `node` holds exactly `worker`'s residency under `epoch`, with every acknowledged sequence
/// number applied; otherwise what differs.
async fn directory_matches(
    node: &str,
    worker: &str,
    epoch: u64,
    acked_seq: u64,
    residency: &ResidencyResponse,
) -> Result<(), String> {
    let mut c = Client::new(vec![node.to_string()]).map_err(|e| e.to_string())?;
    let hashes: Vec<u64> = residency.groups.iter().map(|g| g.hash).collect::<BTreeSet<_>>().into_iter().collect();
    let r = c
        .read(pb::ReadRequest { hashes, prefix_chain: vec![], workers: true })
        .await
        .map_err(|e| format!("read: {e}"))?;
    let info = r.workers.iter().find(|w| w.worker == worker).ok_or_else(|| format!("{worker} not in the table"))?;
    if info.epoch != epoch {
        return Err(format!("epoch {} in the directory, {epoch} on the worker", info.epoch));
    }
    if info.applied_seq < acked_seq {
        return Err(format!("applied seq {} < acknowledged {acked_seq}", info.applied_seq));
    }
    let held: BTreeSet<(u64, &str)> = r
        .blocks
        .iter()
        .flat_map(|b| b.copies.iter().filter(|c| c.worker == worker).map(move |c| (b.hash, tier_name(c.tier))))
        .collect();
    let want: BTreeSet<(u64, &str)> = residency.groups.iter().map(|g| (g.hash, g.tier.as_str())).collect();
    if held != want {
        let missing = want.difference(&held).count();
        let extra = held.difference(&want).count();
        return Err(format!("{missing} resident groups missing, {extra} unknown ones"));
    }
    if info.blocks != want.len() as u64 {
        return Err(format!("{} copies in the directory, {} on the worker", info.blocks, want.len()));
    }
    Ok(())
}

/// Waits until every node in `nodes` holds `worker`'s residency (re-read each try: the worker may still be
/// moving groups) under the epoch and acknowledged sequence number the worker reports.
async fn wait_converged(nodes: &[String], worker: &Worker, limit: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let stats = worker_stats(&worker.addr).await.unwrap();
        let residency = worker_residency(&worker.addr).await.unwrap();
        let mut failures = Vec::new();
        for n in nodes {
            if let Err(e) =
                directory_matches(n, &worker.id, stats.report_epoch, stats.report_acked_seq, &residency).await
            {
                failures.push(format!("{n}: {e}"));
            }
        }
        if failures.is_empty() {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < limit,
            "{}'s directory entry did not converge within {limit:?}: {failures:?}",
            worker.id
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn chat(prompt: &str) -> Value {
    json!({"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
           "temperature": 0})
}

/// Router `http`'s dry-run decision for `prompt`.
async fn place(http: &Http, prompt: &str) -> Value {
    let (s, v) = http.post_json("/debug/place", &chat(prompt)).await.unwrap();
    assert_eq!(s, 200, "{v}");
    v
}

fn candidate<'a>(decision: &'a Value, worker: &str) -> &'a Value {
    decision["candidates"].as_array().and_then(|c| c.iter().find(|c| c["worker"] == worker)).unwrap_or(&Value::Null)
}

fn hits(c: &Value, tier: &str) -> u64 {
    c[format!("hits_{tier}")].as_u64().unwrap_or(0)
}

/// Waits until both routers choose the same worker for every prompt; returns the choices and how long it took.
async fn wait_agreement(a: &Http, b: &Http, prompts: &[String], limit: Duration) -> (Vec<Value>, Duration) {
    let t0 = Instant::now();
    loop {
        let mut decisions = Vec::with_capacity(prompts.len());
        let mut disagree = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let (da, db) = (place(a, p).await, place(b, p).await);
            if da["chosen"] != db["chosen"] {
                disagree.push(format!("prompt {i}: {} vs {}", da["chosen"], db["chosen"]));
            }
            decisions.push(da);
        }
        if disagree.is_empty() {
            return (decisions, t0.elapsed());
        }
        assert!(t0.elapsed() < limit, "the routers still disagree after {limit:?}: {disagree:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn load_config(prompts: &[String], duration: Duration, max_requests: usize) -> LoadConfig {
    LoadConfig {
        mode: Mode::Closed { concurrency: 2 },
        prompts: prompts.to_vec(),
        max_tokens: vec![MAX_TOKENS],
        streaming: Streaming::Mixed,
        deadline: Duration::from_secs(60),
        duration,
        max_requests,
        urgent: None,
    }
}

fn assert_nothing_lost(what: &str, report: &Report) {
    assert_eq!(report.lost, 0, "{what}: lost requests {:?}", report.lost_examples);
    assert!(report.mismatches.is_empty(), "{what}: answers differ from the reference: {:?}", report.mismatches);
    assert!(report.completed > 0, "{what}: nothing completed");
}

/// The greedy reference of every prompt the runs used (the others are never compared).
async fn reference_for<'a>(
    http: &Http,
    prompts: &[String],
    records: impl IntoIterator<Item = &'a Record>,
    max_tokens: u32,
) -> Reference {
    let used = records.into_iter().map(|r| r.prompt + 1).max().unwrap_or(0);
    load::reference(http, &prompts[..used], &[max_tokens]).await.unwrap()
}

fn disk_groups(r: &ResidencyResponse) -> BTreeSet<u64> {
    r.groups.iter().filter(|g| g.tier == "disk").map(|g| g.hash).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_survives_losing_its_kvstore_leader_a_router_and_a_worker() {
    let mut ha = Ha::start().await;
    // Mostly prompts no one has seen: each request stores new blocks, so the workers publish throughout the load.
    // Their greedy references are taken after each load (answers do not depend on what was cached).
    let prompts = load::prompt_mix(4, 600);
    let (r0, r1) = (ha.routers[0].http.clone(), ha.routers[1].http.clone());

    // 1. The kvstore leader dies under load on both routers.
    let nodes = ha.kvstore_addrs();
    let leader = leader_of(&nodes).await;
    let leader_id = *ha.kvstores.iter().find(|(_, k)| k.0 == leader).unwrap().0;
    let mut before = Vec::new();
    // A worker registers with the directory once the kvstore has elected its first leader, which may come after
    // the worker is listening.
    for w in &ha.workers {
        wait_until(&format!("{} to report to the directory", w.id), Duration::from_secs(30), || async {
            worker_stats(&w.addr).await.is_ok_and(|s| s.report_epoch > 0 && s.report_snapshots_total >= 1)
        })
        .await;
        before.push(worker_stats(&w.addr).await.unwrap());
    }
    // Bounded by time (and a count it does not reach): the fault must land mid-load.
    let cfg = load_config(&prompts, Duration::from_secs(14), 1000);
    let loads: Vec<_> = [r0.clone(), r1.clone()]
        .into_iter()
        .map(|http| {
            let cfg = cfg.clone();
            tokio::spawn(async move { load::run(&http, &cfg).await.unwrap() })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let killed_at = Instant::now();
    let mut killed = ha.kvstores.get_mut(&leader_id).unwrap().1.take().unwrap();
    killed.kill();
    ha.retired.push(killed);
    let survivors = ha.kvstore_addrs();
    let new_leader = leader_of(&survivors).await;
    let elected_after = killed_at.elapsed();
    let mut requests_during_kill = Vec::new();
    let mut runs = Vec::new();
    for l in loads {
        runs.push(l.await.unwrap());
    }
    let reference = reference_for(&r1, &prompts, runs.iter().flatten(), MAX_TOKENS).await;
    for (r, records) in runs.into_iter().enumerate() {
        let report = Report::new(&records, &reference);
        assert_nothing_lost(&format!("router {r} while the kvstore leader died"), &report);
        let after_kill = records.iter().filter(|rec| rec.sent_at > Duration::from_secs(5)).count();
        assert!(after_kill > 0, "router {r}: the load was over before the kvstore leader died");
        requests_during_kill.push(json!({"router": r, "sent": report.sent, "completed": report.completed,
            "failed_clean": report.failed_clean, "lost": report.lost, "sent_after_kill": after_kill,
            "p99_latency_s": report.p99_latency.as_secs_f64()}));
    }
    let mut converged = Duration::ZERO;
    let mut reported_during_load = 0;
    for (w, b) in ha.workers.iter().zip(&before) {
        converged = converged.max(wait_converged(&survivors, w, Duration::from_secs(20)).await);
        let s = worker_stats(&w.addr).await.unwrap();
        assert_eq!(s.report_epoch, b.report_epoch, "{} re-registered", w.id);
        assert_eq!(
            s.report_snapshots_total, b.report_snapshots_total,
            "{} had to re-send its residency: the kvstore lost acknowledged events or saw a gap",
            w.id
        );
        reported_during_load += s.report_acked_seq - b.report_acked_seq;
    }
    assert!(reported_during_load > 0, "no block event was published during the load");
    println!(
        "HA {}",
        json!({"phase": "kvstore-leader-kill", "new_leader": new_leader, "elected_after_s": elected_after.as_secs_f64(),
               "events_acknowledged_during_load": reported_during_load, "requests": requests_during_kill,
               "directory_converged_after_load_s": converged.as_secs_f64()})
    );

    // 2. Both replicas, caught up, place alike; prefixes the load cached are placed by their residency.
    let probes = &prompts[..12];
    let (decisions, agreed_after) = wait_agreement(&r0, &r1, probes, Duration::from_secs(20)).await;
    for (i, d) in decisions.iter().enumerate() {
        let c = candidate(d, d["chosen"].as_str().unwrap_or(""));
        assert!(hits(c, "device") + hits(c, "disk") > 0, "prompt {i} was served but is placed cold: {d:#}");
    }
    println!("HA {}", json!({"phase": "routers-agree", "agreed_after_s": agreed_after.as_secs_f64()}));

    // 3. Router 0 dies under load on both routers. Clients send every other request to router 0 and, when its
    //    connection fails (refused, or cut mid-stream), send it again to router 1.
    let cfg = load_config(&prompts, Duration::from_secs(10), 1000);
    let load_both = {
        let routers = [r0.clone(), r1.clone()];
        tokio::spawn(async move { load::run_across(&routers, &cfg).await.unwrap() })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut router0 = ha.routers.remove(0);
    router0.proc.kill();
    ha.retired.push(router0.proc);
    let records = load_both.await.unwrap();
    let reference = reference_for(&r1, &prompts, &records, MAX_TOKENS).await;
    let report = Report::new(&records, &reference);
    assert_nothing_lost("clients of both routers while router 0 died", &report);
    assert!(report.client_retried > 0, "no request needed the other router: {report:?}");
    println!(
        "HA {}",
        json!({"phase": "router-kill-load", "sent": report.sent, "completed": report.completed,
               "failed_clean": report.failed_clean, "lost": report.lost, "client_retried": report.client_retried,
               "p99_latency_s": report.p99_latency.as_secs_f64()})
    );
    let restarted_at = Instant::now();
    let router0 = ha.spawn_router("ha-router0-restart").await;
    let ready_after = restarted_at.elapsed();
    let r0 = router0.http.clone();
    ha.routers.insert(0, router0);
    let (_, agreed_after) = wait_agreement(&r0, &r1, probes, Duration::from_secs(20)).await;
    println!(
        "HA {}",
        json!({"phase": "router-kill", "ready_after_restart_s": ready_after.as_secs_f64(),
               "agreed_after_ready_s": agreed_after.as_secs_f64()})
    );

    // 4. A prompt no one has seen goes to one worker; once both routers know where it is, that worker restarts.
    let probe = "Describe in a few words a lighthouse built of green glass on a silent island.";
    let (s, v) = r1.post_json("/v1/chat/completions", &chat(probe)).await.unwrap();
    assert_eq!(s, 200, "{v}");
    let probe_answer = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    // Every prompt shares its first block (the chat template's system preamble) with all the others: the holder is
    // the one worker with more of the prompt than the rest.
    let holders = |d: &Value| -> Vec<String> {
        let cands = d["candidates"].as_array().cloned().unwrap_or_default();
        let most = cands.iter().map(|c| hits(c, "device")).max().unwrap_or(0);
        let least = cands.iter().map(|c| hits(c, "device")).min().unwrap_or(0);
        let top = cands.iter().filter(|c| most > least && hits(c, "device") == most);
        top.filter_map(|c| c["worker"].as_str().map(String::from)).collect()
    };
    let t0 = Instant::now();
    let chosen = loop {
        let (a, b) = (place(&r0, probe).await, place(&r1, probe).await);
        let (held_a, held_b) = (holders(&a), holders(&b));
        if held_a.len() == 1 && held_a == held_b && a["chosen"] == held_a[0].as_str() && b["chosen"] == a["chosen"] {
            break held_a[0].clone();
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "the routers do not agree where the probe is: {a:#} {b:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let wi = ha.workers.iter().position(|w| w.addr == chosen).unwrap();
    let old_stats = worker_stats(&chosen).await.unwrap();
    let old_disk = disk_groups(&worker_residency(&chosen).await.unwrap());
    assert!(!old_disk.is_empty(), "nothing on {chosen}'s disk tier");
    let mut old = ha.workers[wi].proc.take().unwrap();
    old.kill();
    ha.retired.push(old);
    let w = &mut ha.workers[wi];
    let mut proc = spawn(&format!("ha-{}-restart", w.id), &w.args);
    proc.wait_line("pagoda worker listening on ", Duration::from_secs(120)).unwrap();
    w.proc = Some(proc);
    let new_disk = disk_groups(&worker_residency(&chosen).await.unwrap());
    assert_eq!(new_disk, old_disk, "the disk tier did not survive the restart intact");
    let w = &ha.workers[wi];
    wait_until(&format!("{} to register again", w.id), Duration::from_secs(20), || async {
        worker_stats(&w.addr).await.is_ok_and(|s| s.report_epoch > old_stats.report_epoch)
    })
    .await;
    let nodes = ha.kvstore_addrs();
    let converged = wait_converged(&nodes, w, Duration::from_secs(20)).await;
    let mut routed_after = Duration::ZERO;
    for http in [&r0, &r1] {
        wait_until("the routers to see the restarted worker", Duration::from_secs(30), || async {
            http.worker_ready(&chosen).await == Some(true)
        })
        .await;
        routed_after = routed_after.max(
            wait_until(
                "the routers to place the probe on the restarted worker's disk",
                Duration::from_secs(20),
                || async {
                    let d = place(http, probe).await;
                    d["chosen"] == chosen.as_str() && hits(candidate(&d, &chosen), "disk") > 0
                },
            )
            .await,
        );
    }
    let disk_tokens = |s: &pagoda_e2e::StatsResponse| -> u64 {
        s.prefix_hits.iter().filter(|h| h.tier == "disk").map(|h| h.tokens).sum()
    };
    let before_probe = worker_stats(&chosen).await.unwrap();
    let (s, v) = r1.post_json("/v1/chat/completions", &chat(probe)).await.unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], probe_answer.as_str(), "the answer from disk-held KV differs");
    let after_probe = worker_stats(&chosen).await.unwrap();
    assert!(disk_tokens(&after_probe) > disk_tokens(&before_probe), "the prefix was not onboarded from disk");
    println!(
        "HA {}",
        json!({"phase": "worker-restart", "disk_groups": new_disk.len(), "old_epoch": old_stats.report_epoch,
               "new_epoch": after_probe.report_epoch, "directory_converged_s": converged.as_secs_f64(),
               "placed_on_disk_after_s": routed_after.as_secs_f64(),
               "disk_hit_tokens": disk_tokens(&after_probe) - disk_tokens(&before_probe)})
    );

    // 5. A worker is SIGKILLed mid-stream under load on both routers: its streams finish on the other workers.
    let long_tokens = 32;
    let cfg = LoadConfig {
        max_tokens: vec![long_tokens],
        streaming: Streaming::All,
        ..load_config(&prompts, Duration::from_secs(10), 1000)
    };
    let migrations_before =
        r0.metric_sum("pagoda_router_migrations_total").await + r1.metric_sum("pagoda_router_migrations_total").await;
    let load_both = {
        let routers = [r0.clone(), r1.clone()];
        tokio::spawn(async move { load::run_across(&routers, &cfg).await.unwrap() })
    };
    let t0 = Instant::now();
    let (victim, running) = loop {
        let mut busiest = (0, 0);
        for (i, w) in ha.workers.iter().enumerate() {
            let running = worker_stats(&w.addr).await.map(|s| s.running).unwrap_or(0);
            if running > busiest.1 {
                busiest = (i, running);
            }
        }
        if busiest.1 > 0 {
            break busiest;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no worker ever ran a stream");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut dead = ha.workers[victim].proc.take().unwrap();
    dead.kill();
    ha.retired.push(dead);
    let records = load_both.await.unwrap();
    let reference = reference_for(&r1, &prompts, &records, long_tokens).await;
    let report = Report::new(&records, &reference);
    assert_nothing_lost("both routers while a worker died mid-stream", &report);
    let migrated = r0.metric_sum("pagoda_router_migrations_total").await
        + r1.metric_sum("pagoda_router_migrations_total").await
        - migrations_before;
    assert!(migrated >= 1.0, "no stream was migrated off the killed worker ({running} were running on it)");
    println!(
        "HA {}",
        json!({"phase": "worker-kill-mid-stream", "running_on_victim": running, "sent": report.sent,
               "completed": report.completed, "lost": report.lost, "migrated": migrated,
               "p99_latency_s": report.p99_latency.as_secs_f64()})
    );
}
