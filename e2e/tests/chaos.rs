//! Chaos tests: faults under load against a real multi-process cluster (3 `pagoda worker` processes behind a
//! `pagoda router`, the real model). Each test computes the greedy reference of every prompt on the healthy cluster,
//! runs closed-loop load, injects one fault mid-stream, and checks the invariants: no accepted request is lost (each
//! completed, or failed cleanly before its first token), every completed answer equals the greedy reference (no
//! duplicate, no gap across a migration), every request ends within its deadline, and the throughput comes back to
//! 90% of its pre-fault level (the time it takes is measured and printed as a `CHAOS {json}` line).
//!
//! CI runs the reduced versions; the full ones are `#[ignore]`d:
//! `cargo test --release -p pagoda --test e2e_chaos -- --ignored --nocapture --test-threads 1`.

mod common;

use std::time::{Duration, Instant};

use common::BIN;
use pagoda_e2e::cluster::{Cluster, ClusterBuilder};
use pagoda_e2e::load::{self, LoadConfig, Mode, Report, Streaming};
use pagoda_e2e::serde_json::json;
use pagoda_e2e::{Http, worker_stats};

/// Router flags of every scenario: 2 s without a token and no answer to a health check is a stall; the first token
/// (and any silence of a live worker) may take 30 s on a loaded 2-core machine.
const ROUTER_ARGS: &[&str] = &["--stall-timeout-ms", "2000", "--first-token-timeout-ms", "30000", "--max-retries", "2"];

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// SIGKILL one worker.
    Kill,
    /// SIGSTOP one worker for this long, then SIGCONT.
    Stop(Duration),
    /// SIGTERM and restart every worker in turn, each back in placement before the next.
    RollingRestart,
}

struct Scenario {
    name: &'static str,
    fault: Fault,
    concurrency: usize,
    max_tokens: u32,
    /// Load is issued for this long; the fault comes at `fault_at`.
    duration: Duration,
    warmup: Duration,
    fault_at: Duration,
    deadline: Duration,
    /// Fail unless throughput is back to 90% of its pre-fault level before the load ends. Off where the fault
    /// removes capacity for good (a SIGKILLed worker is not restarted here, and on 2 shared cores the remaining
    /// workers may or may not absorb its share): the recovery time is still measured and printed.
    require_recovery: bool,
}

/// The sum of `pagoda_router_migrations_total` over its reasons, with the per-reason lines.
async fn migrations(http: &Http) -> (u64, Vec<String>) {
    let (_, text) = http.get("/metrics").await.unwrap_or_default();
    let lines: Vec<String> =
        text.lines().filter(|l| l.starts_with("pagoda_router_migrations_total{")).map(str::to_string).collect();
    let total = lines.iter().filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok()).sum();
    (total, lines)
}

/// Waits (bounded) until worker `i` is running at least one sequence, so that the fault lands mid-stream.
async fn wait_busy(cluster: &Cluster, i: usize) -> u64 {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = worker_stats(cluster.worker_addr(i)).await
            && s.running > 0
        {
            return s.running;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            return 0;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn inject(cluster: &mut Cluster, fault: Fault, t0: Instant) -> (Duration, u64) {
    const VICTIM: usize = 1;
    match fault {
        Fault::Kill => {
            let running = wait_busy(cluster, VICTIM).await;
            let at = t0.elapsed();
            cluster.kill_worker(VICTIM).unwrap();
            (at, running)
        }
        Fault::Stop(for_) => {
            let running = wait_busy(cluster, VICTIM).await;
            let at = t0.elapsed();
            cluster.stop_worker(VICTIM).unwrap();
            tokio::time::sleep(for_).await;
            cluster.continue_worker(VICTIM).unwrap();
            (at, running)
        }
        Fault::RollingRestart => {
            let at = t0.elapsed();
            let mut running = 0;
            for i in 0..cluster.worker_count() {
                running += wait_busy(cluster, i).await;
                cluster.terminate_worker(i, Duration::from_secs(15)).unwrap();
                cluster.restart_worker(i).unwrap();
                cluster.wait_router_sees(0, i, true, Duration::from_secs(30)).await.unwrap();
            }
            (at, running)
        }
    }
}

async fn run(s: Scenario) {
    let mut cluster = ClusterBuilder::new(BIN, s.name).workers(3).router_args(ROUTER_ARGS).start().await.unwrap();
    let http = cluster.http(0).clone();
    let prompts = load::prompt_mix(6, 6);
    let reference = load::reference(&http, &prompts, s.max_tokens).await.unwrap();
    let cfg = LoadConfig {
        mode: Mode::Closed { concurrency: s.concurrency },
        prompts,
        max_tokens: s.max_tokens,
        streaming: Streaming::Mixed,
        deadline: s.deadline,
        duration: s.duration,
        max_requests: 100_000,
    };
    let (before, _) = migrations(&http).await;
    let load_http = http.clone();
    let t0 = Instant::now();
    let load = tokio::spawn(async move { load::run(&load_http, &cfg).await });
    tokio::time::sleep(s.fault_at).await;
    let (fault_at, running_at_fault) = inject(&mut cluster, s.fault, t0).await;
    let fault_done = t0.elapsed();
    let records = load.await.unwrap().unwrap();
    let (after, reasons) = migrations(&http).await;
    let report = Report::new(&records, &reference);
    let rec = load::recovery(&records, s.warmup, fault_at, s.duration, Duration::from_secs(3), 0.9);
    let settle = fault_at + rec.recovered_after.unwrap_or(s.duration - fault_at).max(fault_done - fault_at);
    let p99_during = load::p99_latency_between(&records, fault_at, settle);
    let p99_after = load::p99_latency_between(&records, settle, s.duration + s.deadline);
    let summary = json!({
        "scenario": s.name,
        "fault": format!("{:?}", s.fault),
        "concurrency": s.concurrency,
        "max_tokens": s.max_tokens,
        "sent": report.sent,
        "completed": report.completed,
        "failed_clean": report.failed_clean,
        "lost": report.lost,
        "mismatched": report.mismatches.len(),
        "migrated": after - before,
        "migrations_by_reason": reasons,
        "running_on_victim_at_fault": running_at_fault,
        "fault_at_s": fault_at.as_secs_f64(),
        "fault_injection_s": (fault_done - fault_at).as_secs_f64(),
        "baseline_rps": rec.baseline,
        "worst_window_rps": rec.worst,
        "recovered_after_s": rec.recovered_after.map(|d| d.as_secs_f64()),
        "p99_latency_s": report.p99_latency.as_secs_f64(),
        "p99_latency_during_s": p99_during.as_secs_f64(),
        "p99_latency_after_s": p99_after.as_secs_f64(),
        "p99_ttft_s": report.p99_ttft.as_secs_f64(),
        "max_latency_s": report.max_latency.as_secs_f64(),
    });
    println!("CHAOS {summary}");
    let fail = |what: &str| -> ! {
        panic!("{what}\n{summary:#}\nlost: {:#?}\nmismatches: {:#?}", report.lost_examples, report.mismatches)
    };
    if report.lost != 0 {
        fail("accepted requests were lost");
    }
    if !report.mismatches.is_empty() {
        fail("completed answers differ from the greedy reference");
    }
    if report.max_latency >= s.deadline {
        fail("a request outlived its deadline");
    }
    if report.completed == 0 || report.completed + report.failed_clean != report.sent {
        fail("requests unaccounted for");
    }
    if matches!(s.fault, Fault::Kill | Fault::Stop(_)) && running_at_fault > 0 && after == before {
        fail("the victim had streams running but nothing migrated");
    }
    if s.require_recovery && rec.recovered_after.is_none() {
        fail("throughput did not come back to 90% of its pre-fault level before the load ended");
    }
}

/// SIGKILL of a worker while ~24 streams run on 3 workers (CI size).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_worker_mid_stream() {
    run(Scenario {
        name: "chaos-kill",
        fault: Fault::Kill,
        concurrency: 24,
        max_tokens: 24,
        duration: Duration::from_secs(30),
        warmup: Duration::from_secs(3),
        fault_at: Duration::from_secs(8),
        require_recovery: false,
        deadline: Duration::from_secs(60),
    })
    .await;
}

/// SIGSTOP of a worker for 5 s (longer than the router's 2 s stall timeout), then SIGCONT: its streams move on,
/// and it comes back into placement once its health check passes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_worker_longer_than_the_stall_timeout() {
    run(Scenario {
        name: "chaos-stop",
        fault: Fault::Stop(Duration::from_secs(5)),
        concurrency: 24,
        max_tokens: 24,
        duration: Duration::from_secs(32),
        warmup: Duration::from_secs(3),
        fault_at: Duration::from_secs(8),
        require_recovery: true,
        deadline: Duration::from_secs(60),
    })
    .await;
}

/// Full size: SIGKILL of a worker while 100 streams run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "full size (100 streams, ~2 min); run with --ignored"]
async fn sigkill_worker_mid_stream_100_streams() {
    run(Scenario {
        name: "chaos-kill-100",
        fault: Fault::Kill,
        concurrency: 100,
        max_tokens: 32,
        duration: Duration::from_secs(60),
        warmup: Duration::from_secs(8),
        fault_at: Duration::from_secs(25),
        require_recovery: false,
        deadline: Duration::from_secs(120),
    })
    .await;
}

/// Rolling restart: every worker SIGTERMed and restarted in turn, under load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long (three restarts under load, ~1.5 min); run with --ignored"]
async fn rolling_restart_of_all_workers() {
    run(Scenario {
        name: "chaos-rolling",
        fault: Fault::RollingRestart,
        concurrency: 24,
        max_tokens: 24,
        duration: Duration::from_secs(60),
        warmup: Duration::from_secs(3),
        fault_at: Duration::from_secs(8),
        require_recovery: true,
        deadline: Duration::from_secs(90),
    })
    .await;
}

/// The open-loop mode of the load generator on a healthy cluster (no fault): arrivals at a fixed rate, mixed
/// streaming, every answer equal to the greedy reference, nothing lost or shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_load_matches_the_reference() {
    let cluster = ClusterBuilder::new(BIN, "chaos-open").workers(2).router_args(ROUTER_ARGS).start().await.unwrap();
    let http = cluster.http(0).clone();
    let prompts = load::prompt_mix(2, 2);
    let reference = load::reference(&http, &prompts, 12).await.unwrap();
    let cfg = LoadConfig {
        mode: Mode::Open { per_second: 3.0, max_in_flight: 64 },
        prompts,
        max_tokens: 12,
        streaming: Streaming::Mixed,
        deadline: Duration::from_secs(60),
        duration: Duration::from_secs(5),
        max_requests: 1000,
    };
    let records = load::run(&http, &cfg).await.unwrap();
    let report = Report::new(&records, &reference);
    assert!((14..=16).contains(&report.sent), "about 3/s for 5 s: {report:?}");
    assert_eq!((report.lost, report.shed, report.completed), (0, 0, report.sent), "{report:?}");
    assert!(report.mismatches.is_empty(), "{report:?}");
    assert!(records.iter().any(|r| r.stream) && records.iter().any(|r| !r.stream));
    // Arrivals follow the clock, not completions: the n-th request is sent about n/3 s in.
    let last = records.iter().map(|r| r.sent_at).max().unwrap();
    assert!(last >= Duration::from_millis(4300) && last < Duration::from_millis(5200), "{last:?}");
}
