//! Chaos tests: faults under load against a real multi-process cluster (3 `pagoda worker` processes behind a
//! `pagoda router`, the real model). Each test computes the greedy reference of every prompt on the healthy cluster,
//! runs closed-loop load, injects one fault mid-stream, and checks the invariants: no accepted request is lost (each
//! completed, or failed cleanly before its first token), every completed answer equals the greedy reference (no
//! duplicate, no gap across a migration), every request ends within its deadline, no process's resident memory grows
//! by 512 MiB or more, and the throughput comes back to 90% of its pre-fault level (the time it takes is measured and
//! printed as a `CHAOS {json}` line).
//!
//! Disk faults run one worker with a disk tier: its files corrupted in place, and its file system filled up (a
//! small tmpfs). The kvstore leader and router faults need the whole cluster and live in `ha.rs`.
//!
//! Clock pressure is its own test: a burst at 5× the measured sustainable rate must be shed with 503/429 and
//! `Retry-After`, lose nothing it accepted, and keep every process's memory bounded.
//!
//! The full-size 15 s check is judged on generated tokens/s per CPU-second the machine left to the test (see
//! `pagoda_e2e::cpu`), in the median of three runs, against a no-fault control held to the same check. The CI-size
//! SIGSTOP test judges the stopped worker against the other workers of the same run (`Require::VictimBack`): on
//! this shared machine the healthy load's tokens/s per CPU drifts by up to 30% within a run, and only a comparison
//! within the run cancels that.
//!
//! CI runs the reduced versions; the full ones are `#[ignore]`d:
//! `cargo test --release -p pagoda --test e2e_chaos -- --ignored --nocapture --test-threads 1`.

mod common;

use std::time::{Duration, Instant};

use common::BIN;
use pagoda_e2e::cluster::{Cluster, ClusterBuilder};
use pagoda_e2e::cpu::CpuWatch;
use pagoda_e2e::load::{self, LoadConfig, Mode, Outcome, Report, Streaming};
use pagoda_e2e::serde_json::json;
use pagoda_e2e::{Http, metric_samples, resident_bytes, worker_stats};

/// Router flags of every scenario: 2 s without a token and no answer to a health check is a stall; the first token
/// (and any silence of a live worker) may take 30 s on a loaded 2-core machine.
/// Chaos tests measure throughput and recovery, which a second test's cluster on the same cores would distort:
/// every test holds this for its whole run, so they run one at a time whatever `--test-threads` says.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const ROUTER_ARGS: &[&str] = &["--stall-timeout-ms", "2000", "--first-token-timeout-ms", "30000", "--max-retries", "2"];

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// No fault: the control that shows how the healthy load's own swings read as recovery.
    Nothing,
    /// SIGKILL one worker. With `restart` it is started again at once, as its supervisor would (a Kubernetes pod's
    /// container is restarted immediately after its first crash), and the time to recover includes its restart;
    /// without, it stays dead.
    Kill { restart: bool },
    /// SIGSTOP one worker for this long, then SIGCONT.
    Stop(Duration),
    /// Not a fault of the cluster: a process outside the test spins on one of the machine's cores for this long, as
    /// a build or a benchmark beside the test would. It is started detached (its parent is not the test), so it
    /// counts as foreign CPU.
    Neighbour(Duration),
    /// SIGTERM and restart every worker in turn, each back in placement before the next.
    RollingRestart,
}

struct Scenario {
    name: &'static str,
    fault: Fault,
    concurrency: usize,
    /// The answer lengths asked for, in turn (see `LoadConfig::max_tokens`).
    max_tokens: &'static [u32],
    /// Load is issued for this long; the fault comes at `fault_at`.
    duration: Duration,
    warmup: Duration,
    fault_at: Duration,
    deadline: Duration,
    /// What recovery the test asserts (both measures are always printed).
    require: Require,
}

/// The recovery a scenario must show.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Require {
    /// Nothing: the fault removes capacity for good (a SIGKILLed worker that is not restarted; on 2 shared cores the
    /// others may or may not absorb its share).
    Nothing,
    /// Every 3 s window of generated tokens from some point on (up to the end of the span the 15 s check uses) reaches
    /// 90% of the pre-fault rate, both per CPU-second left to the test. Tokens, not completions: 24 streams complete
    /// in waves, and a 5 s baseline that caught two high waves failed a SIGSTOP run whose token rate never left
    /// 388–412 after the fault. Judged over up to [`RUNS`] runs, by their majority ([`run_window_by_window`]): a
    /// SIGSTOP run once read 405 tokens/s per CPU before the fault and 350–379 after it with the cores all the
    /// test's, while the same test's next two runs read 380 and 357 before and 385 and 364 after.
    WindowByWindow,
    /// The stopped worker is back in placement and doing its share, judged against the other workers of the same
    /// run: from 5 s after it resumes to the end of the load, it runs at least one sequence on average and computes
    /// at least half the tokens per second the others do on average ([`VICTIM_SHARE_FLOOR`]). A machine that slows
    /// down slows every worker alike, so this does not move with it, while a worker left out of placement, or one
    /// back but stuck, fails it. Throughput window by window did move with it: the no-fault control of this load
    /// missed that check in 1 of 3 runs, its tokens/s per CPU drifting by 30% over 20 s with every process's CPU
    /// unchanged (`no_fault_control_window_by_window`). The cluster as a whole is held to a floor instead
    /// ([`CLUSTER_FLOOR`]): a cluster stuck after the fault reads far below it, the machine's own drift did not.
    VictimBack,
    /// The target read directly: from 15 s after the fault, over a span as long as the one from the warmup to
    /// the fault, the cluster generates at least 90% of its pre-fault tokens per second. Both rates are averages over 15 s or more, and tokens, unlike
    /// completions, do not come in waves: window by window, completions read the no-fault control as "recovered"
    /// only 26.5 s after a fault that never came, and completions over the same spans read a kill run at 0.88 and
    /// the control at 1.24. Both rates are taken per CPU-second the machine left to the test, so that another load
    /// on the same cores (which made the control fail at 0.85 once) is not read as the fault's.
    BackWithin15s,
}

/// The recovery target.
const RECOVERY_TARGET: Duration = Duration::from_secs(15);

/// [`Require::VictimBack`]: the share of the other workers' mean tokens/s the resumed worker must compute. Recovered
/// runs read 0.97 and 1.04; one earlier run had 2–5 sequences on the resumed worker against 8–11 on each other one
/// for the rest of its load (the prompts it held were cached elsewhere while it was stopped, and the router follows
/// the cache), and its computed tokens/s still read roughly 0.8 of theirs (by eye, from the per-worker computed
/// tokens/s its CHAOS line prints; that run predates the printed share).
const VICTIM_SHARE_FLOOR: f64 = 0.5;

/// [`Require::VictimBack`]: tokens/s per available CPU from 15 s after the fault, against before. Healthy and
/// recovered runs of the CI load read 0.73–1.31 on this machine.
const CLUSTER_FLOOR: f64 = 0.6;

/// The sum of `pagoda_router_migrations_total` over its reasons, with the per-reason lines.
async fn migrations(http: &Http) -> (u64, Vec<String>) {
    let (_, text) = http.get("/metrics").await.unwrap_or_default();
    let samples: Vec<(&str, f64)> = metric_samples(&text, "pagoda_router_migrations_total").collect();
    (samples.iter().map(|(_, v)| *v as u64).sum(), samples.iter().map(|(l, _)| l.to_string()).collect())
}

/// Samples the resident memory and the CPU time of a fixed set of processes every 200 ms (bounded: at most 10 min)
/// until stopped. The CPU time shows where a slow stretch went: a process that burns CPU without producing tokens
/// (a retry loop after a fault) reads differently from a machine that got slower for everyone.
struct MemoryWatch {
    pids: Vec<(String, u32)>,
    before: Vec<u64>,
    over: std::sync::Arc<std::sync::atomic::AtomicBool>,
    sampler: tokio::task::JoinHandle<(Vec<u64>, Vec<CpuByProcess>)>,
}

/// When, and each watched process's CPU seconds so far (the last value seen once a process is gone).
type CpuByProcess = (Duration, Vec<f64>);

/// How much any one process may grow while a test's load runs: the workers' KV pools and the router's request
/// state are bounded, so growth past this is a leak or an unbounded queue.
const MEMORY_GROWTH_BOUND: u64 = 512 << 20;

impl MemoryWatch {
    /// Watches `pids` and this test process itself (the load generator), with sample times measured from `t0`.
    fn start(mut pids: Vec<(String, u32)>, t0: Instant) -> MemoryWatch {
        pids.push(("test-process".to_owned(), std::process::id()));
        let before: Vec<u64> = pids.iter().map(|(_, p)| resident_bytes(*p).unwrap_or(0)).collect();
        let over = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sampler = {
            let (pids, over) = (pids.clone(), over.clone());
            tokio::spawn(async move {
                let mut peak = vec![0u64; pids.len()];
                let mut cpu_now = vec![0.0; pids.len()];
                let mut cpu = Vec::new();
                for _ in 0..3000 {
                    for (i, (_, pid)) in pids.iter().enumerate() {
                        // A process killed by the test reads as 0 from then on.
                        peak[i] = peak[i].max(resident_bytes(*pid).unwrap_or(0));
                        if let Some(secs) = pagoda_e2e::cpu::process_cpu_seconds(*pid) {
                            cpu_now[i] = secs;
                        }
                    }
                    cpu.push((t0.elapsed(), cpu_now.clone()));
                    if over.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                (peak, cpu)
            })
        };
        MemoryWatch { pids, before, over, sampler }
    }

    /// Stops sampling: each process's resident bytes before and at its peak, and its CPU time.
    async fn stop(self) -> MemoryReport {
        self.over.store(true, std::sync::atomic::Ordering::Relaxed);
        let (peak, cpu) = self.sampler.await.unwrap_or_default();
        MemoryReport { pids: self.pids, before: self.before, peak, cpu }
    }
}

struct MemoryReport {
    pids: Vec<(String, u32)>,
    before: Vec<u64>,
    peak: Vec<u64>,
    cpu: Vec<CpuByProcess>,
}

impl MemoryReport {
    fn json(&self) -> pagoda_e2e::serde_json::Value {
        json!({
            "processes": self.pids.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
            "rss_mib_before": self.before.iter().map(|b| b >> 20).collect::<Vec<_>>(),
            "rss_mib_peak": self.peak.iter().map(|b| b >> 20).collect::<Vec<_>>(),
        })
    }

    /// The CPU cores each process used on average in `[from, to)`, rounded to hundredths.
    fn cpu_cores(&self, from: Duration, to: Duration) -> Vec<f64> {
        let nearest = |at: Duration| self.cpu.iter().min_by_key(|(t, _)| t.abs_diff(at));
        let (Some((t_from, a)), Some((t_to, b))) = (nearest(from), nearest(to)) else { return Vec::new() };
        let secs = t_to.saturating_sub(*t_from).as_secs_f64();
        if secs <= 0.0 {
            return Vec::new();
        }
        a.iter().zip(b).map(|(a, b)| ((b - a).max(0.0) / secs * 100.0).round() / 100.0).collect()
    }

    /// The first process that grew by [`MEMORY_GROWTH_BOUND`] or more, as a message.
    fn unbounded(&self) -> Option<String> {
        self.pids.iter().zip(self.before.iter().zip(&self.peak)).find_map(|((name, _), (&before, &peak))| {
            // The test's own records grow with the load; the bound is on the cluster's processes.
            (name != "test-process" && peak >= before + MEMORY_GROWTH_BOUND)
                .then(|| format!("{name} grew from {} MiB to {} MiB", before >> 20, peak >> 20))
        })
    }
}

/// Samples every worker's `Stats` once a second while the load runs (bounded: at most 10 minutes), to show where a
/// slow stretch comes from: requests piled on one worker, preemptions, or the machine.
struct WorkerWatch {
    over: std::sync::Arc<std::sync::atomic::AtomicBool>,
    sampler: tokio::task::JoinHandle<Vec<WorkerSample>>,
}

/// When, and per worker (`None`: no answer) its running and waiting sequences, computed tokens and preemptions.
type WorkerSample = (Duration, Vec<Option<(u64, u64, u64, u64)>>);

impl WorkerWatch {
    fn start(addrs: Vec<String>, t0: Instant) -> WorkerWatch {
        let over = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sampler = {
            let over = over.clone();
            tokio::spawn(async move {
                let mut samples = Vec::new();
                for _ in 0..600 {
                    if over.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    let mut row = Vec::with_capacity(addrs.len());
                    for a in &addrs {
                        let stats = tokio::time::timeout(Duration::from_millis(300), worker_stats(a)).await;
                        row.push(
                            stats
                                .ok()
                                .and_then(Result::ok)
                                .map(|s| (s.running, s.waiting, s.computed_tokens_total, s.preemptions_total)),
                        );
                    }
                    samples.push((t0.elapsed(), row));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                samples
            })
        };
        WorkerWatch { over, sampler }
    }

    /// Stops sampling.
    async fn stop(self) -> WorkerTimeline {
        self.over.store(true, std::sync::atomic::Ordering::Relaxed);
        WorkerTimeline { samples: self.sampler.await.unwrap_or_default() }
    }
}

/// Every worker's samples of one run.
struct WorkerTimeline {
    samples: Vec<WorkerSample>,
}

impl WorkerTimeline {
    /// Worker `w`'s mean running sequences and its computed tokens per second in `[from, to]`, from the first and
    /// last samples it answered there; `None` if it answered fewer than two.
    fn work(&self, w: usize, from: Duration, to: Duration) -> Option<(f64, f64)> {
        let answered: Vec<(Duration, u64, u64)> = self
            .samples
            .iter()
            .filter(|(at, _)| *at >= from && *at <= to)
            .filter_map(|(at, row)| {
                row.get(w).copied().flatten().map(|(running, _, computed, _)| (*at, running, computed))
            })
            .collect();
        let (first, last) = (answered.first()?, answered.last()?);
        let secs = last.0.saturating_sub(first.0).as_secs_f64();
        if answered.len() < 2 || secs <= 0.0 {
            return None;
        }
        let running = answered.iter().map(|a| a.1 as f64).sum::<f64>() / answered.len() as f64;
        Some((running, last.2.saturating_sub(first.2) as f64 / secs))
    }

    /// Worker `victim`'s mean running sequences in `[from, to]`, and its tokens per second there as a share of the
    /// other workers' mean; `(0, 0)` if it was not answering.
    fn victim_share(&self, victim: usize, from: Duration, to: Duration) -> (f64, f64) {
        let workers = self.samples.first().map_or(0, |(_, r)| r.len());
        let others: Vec<f64> =
            (0..workers).filter(|&w| w != victim).filter_map(|w| self.work(w, from, to)).map(|(_, t)| t).collect();
        let Some((running, tokens)) = self.work(victim, from, to) else { return (0.0, 0.0) };
        let others_mean = others.iter().sum::<f64>() / others.len().max(1) as f64;
        (running, if others_mean > 0.0 { tokens / others_mean } else { 0.0 })
    }

    /// Per worker, its running/waiting and computed tokens per second at each sample.
    fn json(&self) -> pagoda_e2e::serde_json::Value {
        let samples = &self.samples;
        let workers = samples.first().map_or(0, |(_, r)| r.len());
        let per_worker: Vec<_> = (0..workers)
            .map(|w| {
                let mut last: Option<(Duration, u64)> = None;
                let rows: Vec<_> = samples
                    .iter()
                    .map(|(at, row)| match row[w] {
                        Some((running, waiting, computed, preempted)) => {
                            let rate = last
                                .filter(|(t, c)| computed >= *c && at > t)
                                .map(|(t, c)| ((computed - c) as f64 / (*at - t).as_secs_f64()).round());
                            last = Some((*at, computed));
                            json!([at.as_secs(), running, waiting, rate, preempted])
                        }
                        None => {
                            last = None;
                            json!([at.as_secs(), null])
                        }
                    })
                    .collect();
                json!(rows)
            })
            .collect();
        json!({ "columns": ["s", "running", "waiting", "computed_tokens_per_s", "preemptions_total"], "workers": per_worker })
    }
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

/// The worker a fault strikes.
const VICTIM: usize = 1;

async fn inject(cluster: &mut Cluster, fault: Fault, t0: Instant) -> (Duration, u64) {
    match fault {
        Fault::Nothing => (t0.elapsed(), 0),
        Fault::Neighbour(for_) => {
            let spin = format!("timeout {} sh -c 'while :; do :; done'", for_.as_secs().max(1));
            let status = std::process::Command::new("setsid").args(["-f", "sh", "-c", &spin]).status();
            assert!(status.is_ok_and(|s| s.success()), "setsid starts the neighbour");
            (t0.elapsed(), 0)
        }
        Fault::Kill { restart } => {
            let running = wait_busy(cluster, VICTIM).await;
            let at = t0.elapsed();
            cluster.kill_worker(VICTIM).unwrap();
            if restart {
                cluster.restart_worker(VICTIM).unwrap();
                cluster.wait_router_sees(0, VICTIM, true, Duration::from_secs(30)).await.unwrap();
            }
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

/// How a run came back from its fault.
struct Recovery {
    /// Tokens/s per available CPU from 15 s after the fault, against before (what [`Require::BackWithin15s`]
    /// judges, over several runs, in [`run_repeated`]).
    tokens_after_vs_before: f64,
    /// When every 3 s window from then on reached 90% of the pre-fault rate (what [`Require::WindowByWindow`]
    /// judges, over several runs, in [`run_window_by_window`]); `None` if that never held.
    tokens_back_after: Option<Duration>,
    /// The resumed worker's mean running sequences, and its tokens/s as a share of the other workers' mean, from 5 s
    /// after it resumed to the end of the load (what [`Require::VictimBack`] judges); `None` without such a fault.
    victim: Option<(f64, f64)>,
}

/// Runs one scenario and checks its invariants; returns how it recovered, which its caller judges.
async fn run(s: Scenario) -> Recovery {
    let mut cluster = ClusterBuilder::new(BIN, s.name).workers(3).router_args(ROUTER_ARGS).start().await.unwrap();
    let http = cluster.http(0).clone();
    let prompts = load::prompt_mix(6, 6);
    let reference = load::reference(&http, &prompts, s.max_tokens).await.unwrap();
    let cfg = LoadConfig {
        mode: Mode::Closed { concurrency: s.concurrency },
        prompts,
        max_tokens: s.max_tokens.to_vec(),
        streaming: Streaming::Mixed,
        deadline: s.deadline,
        duration: s.duration,
        max_requests: 100_000,
        urgent: None,
    };
    let (before, _) = migrations(&http).await;
    let load_http = http.clone();
    let t0 = Instant::now();
    let memory = MemoryWatch::start(cluster.pids(), t0);
    let cpu = CpuWatch::start(t0);
    let workers =
        WorkerWatch::start((0..cluster.worker_count()).map(|i| cluster.worker_addr(i).to_string()).collect(), t0);
    let load = tokio::spawn(async move { load::run(&load_http, &cfg).await });
    tokio::time::sleep(s.fault_at).await;
    let (fault_at, running_at_fault) = inject(&mut cluster, s.fault, t0).await;
    let fault_done = t0.elapsed();
    let records = load.await.unwrap().unwrap();
    let memory = memory.stop().await;
    let cpu = cpu.stop().await;
    let workers = workers.stop().await;
    let (after, reasons) = migrations(&http).await;
    let report = Report::new(&records, &reference);
    let window = load::recovery_window(&records, s.warmup, fault_at, Duration::from_secs(3));
    let rec = load::recovery(&records, s.warmup, fault_at, s.duration, window, 0.9);
    // The healthy load's own floor: a closed loop's completions come in waves, and a window the cluster saw before
    // the fault is no sign of damage after it.
    let floor_before = load::worst_window(&records, s.warmup, fault_at, window);
    let (back_to_floor, _) = load::recovered_above(
        &records,
        fault_at,
        s.duration,
        window,
        (0.9 * rec.baseline).min(floor_before),
        load::throughput,
    );
    let settle = fault_at + rec.recovered_after.unwrap_or(s.duration - fault_at).max(fault_done - fault_at);
    // What the 15 s target is judged on: generated tokens per second (completions come in waves; tokens do not),
    // each rate per CPU-second the machine left to the test (see `pagoda_e2e::cpu`), so that a build starting on
    // the same cores halfway through is not read as a cluster that never recovered.
    // Spans of equal length, the later one ending well before the load does (as the load stops, the streams left
    // decode faster).
    let before_span = (s.warmup, fault_at);
    let after_span = (fault_at + RECOVERY_TARGET, (fault_at + RECOVERY_TARGET + (fault_at - s.warmup)).min(s.duration));
    let (foreign_before, foreign_after) =
        (cpu.foreign_share(before_span.0, before_span.1), cpu.foreign_share(after_span.0, after_span.1));
    let per_available_cpu = |r: &[load::Record], from: Duration, to: Duration| {
        load::token_rate(r, from, to) / (1.0 - cpu.foreign_share(from, to)).max(0.05)
    };
    let tokens_before = per_available_cpu(&records, before_span.0, before_span.1);
    let tokens_after = per_available_cpu(&records, after_span.0, after_span.1);
    let tokens_after_vs_before = if tokens_before > 0.0 { tokens_after / tokens_before } else { 0.0 };
    // Tokens do not come in waves, so 3 s windows of them show when the cluster was back. Each window's rate is
    // taken per CPU-second left to the test, like the 15 s check's, so that another process taking part of a core
    // for a few seconds is not read as the fault's (one raw run missed the bar by 0.2%, at 0.898 in its last window).
    let (tokens_back_after, tokens_worst) = load::recovered_above(
        &records,
        fault_at,
        after_span.1,
        Duration::from_secs(3),
        0.9 * tokens_before,
        per_available_cpu,
    );
    // A stopped worker resumes when the fault is done; a worker killed and restarted is back by then too.
    let victim = matches!(s.fault, Fault::Stop(_) | Fault::Kill { restart: true })
        .then(|| workers.victim_share(VICTIM, fault_done + Duration::from_secs(5), s.duration));
    let after_target = load::throughput(&records, after_span.0, after_span.1);
    let after_target_vs_before = if rec.baseline > 0.0 { after_target / rec.baseline } else { 0.0 };
    let p99_during = load::p99_latency_between(&records, fault_at, settle);
    let p99_after = load::p99_latency_between(&records, settle, s.duration + s.deadline);
    let mut summary = json!({
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
        "recovery_window_s": window.as_secs_f64(),
        "worst_window_before_fault_rps": floor_before,
        "recovered_to_healthy_floor_after_s": back_to_floor.map(|d| d.as_secs_f64()),
        "worst_window_rps": rec.worst,
        "recovered_after_s": rec.recovered_after.map(|d| d.as_secs_f64()),
        "rps_from_15s_after_fault": after_target,
        "rps_from_15s_after_fault_vs_before": after_target_vs_before,
        "foreign_cpu_share_before_fault": foreign_before,
        "foreign_cpu_share_from_15s_after_fault": foreign_after,
        "tokens_per_s_per_available_cpu_before_fault": tokens_before,
        "tokens_per_s_per_available_cpu_from_15s_after_fault": tokens_after,
        "tokens_per_s_from_15s_after_fault_vs_before": tokens_after_vs_before,
        "tokens_per_s_per_available_cpu_back_to_90pct_in_3s_windows_after_s": tokens_back_after.map(|d| d.as_secs_f64()),
        "tokens_per_s_per_available_cpu_worst_3s_window_after_fault": tokens_worst,
        "p99_latency_s": report.p99_latency.as_secs_f64(),
        "p99_latency_during_s": p99_during.as_secs_f64(),
        "p99_latency_after_s": p99_after.as_secs_f64(),
        "p99_ttft_s": report.p99_ttft.as_secs_f64(),
        "max_latency_s": report.max_latency.as_secs_f64(),
        // Completions per second in consecutive 3 s windows from the start of the load, for the recovery curve.
        "completions_per_s_by_3s": (0..(s.duration.as_secs() / 3))
            .map(|i| load::throughput(&records, Duration::from_secs(3 * i), Duration::from_secs(3 * i + 3)))
            .collect::<Vec<_>>(),
        "tokens_per_s_by_3s": (0..(s.duration.as_secs() / 3))
            .map(|i| load::token_rate(&records, Duration::from_secs(3 * i), Duration::from_secs(3 * i + 3)).round())
            .collect::<Vec<_>>(),
        "memory": memory.json(),
        // Per process (in `memory.processes` order): CPU cores used before the fault and in the span the 15 s check
        // judges, to tell a process burning CPU after the fault from a machine that got slower for everyone.
        "cpu_cores_by_process_before_fault": memory.cpu_cores(before_span.0, before_span.1),
        "cpu_cores_by_process_from_15s_after_fault": memory.cpu_cores(after_span.0, after_span.1),
        // CPU cores this test's processes used, per 3 s window.
        "our_cpu_cores_by_3s": (0..(s.duration.as_secs() / 3))
            .map(|i| {
                let (a, b) = (Duration::from_secs(3 * i), Duration::from_secs(3 * i + 3));
                (cpu.ours_cpu_seconds(a, b) / 3.0 * 100.0).round() / 100.0
            })
            .collect::<Vec<_>>(),
        "workers": workers.json(),
    });
    // Past what one `json!` expands within the default recursion limit.
    summary["victim_running_from_5s_after_resume"] = json!(victim.map(|v| v.0));
    summary["victim_tokens_per_s_vs_others_from_5s_after_resume"] = json!(victim.map(|v| v.1));
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
    if let Some(grew) = memory.unbounded() {
        fail(&format!("memory is not bounded: {grew}"));
    }
    if report.completed == 0 || report.completed + report.failed_clean != report.sent {
        fail("requests unaccounted for");
    }
    if matches!(s.fault, Fault::Kill { .. } | Fault::Stop(_)) && running_at_fault > 0 && after == before {
        fail("the victim had streams running but nothing migrated");
    }
    Recovery { tokens_after_vs_before, tokens_back_after, victim }
}

/// How many times a full-size scenario runs; its recovery is the median of the runs. One minute of load on a shared
/// machine has its own slow stretches (a no-fault control once read 0.897 from a 12 s dip with the CPU all the
/// test's), and one run cannot tell those from the fault's.
const RUNS: usize = 3;

/// Runs `scenario()` [`RUNS`] times, each on a fresh cluster with all its invariants checked, and requires the
/// median of their recovery ratios to be at least 0.9 ([`Require::BackWithin15s`]).
async fn run_repeated(scenario: impl Fn() -> Scenario) {
    let mut ratios = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let s = scenario();
        assert_eq!(s.require, Require::BackWithin15s, "only the 15 s check is judged over repeated runs");
        ratios.push(run(s).await.tokens_after_vs_before);
    }
    ratios.sort_by(f64::total_cmp);
    let median = ratios[RUNS / 2];
    println!("CHAOS-MEDIAN {}", json!({ "scenario": scenario().name, "ratios": ratios, "median": median }));
    assert!(
        median >= 0.9,
        "from 15 s after the fault on, the median run's tokens/s per available CPU is {median:.3} of its pre-fault \
         level (runs: {ratios:?}); the target is 0.9"
    );
}

/// Runs `scenario()` until [`RUNS`] / 2 + 1 runs agree (at most [`RUNS`] runs, each on a fresh cluster with all
/// its invariants checked), and requires that in the majority the stopped worker came back to placement and did its
/// share, and the cluster held its floor ([`Require::VictimBack`]).
async fn run_victim_back(scenario: impl Fn() -> Scenario) {
    let majority = RUNS / 2 + 1;
    let (mut back, mut not_back) = (Vec::new(), Vec::new());
    while back.len() < majority && not_back.len() < majority {
        let s = scenario();
        assert_eq!(s.require, Require::VictimBack);
        let r = run(s).await;
        let (running, share) = r.victim.expect("a fault with a victim");
        let cluster = r.tokens_after_vs_before;
        let run = json!({ "victim_running": running, "victim_share": share, "cluster_after_vs_before": cluster });
        if running >= 1.0 && share >= VICTIM_SHARE_FLOOR && cluster >= CLUSTER_FLOOR {
            back.push(run);
        } else {
            not_back.push(run);
        }
    }
    println!("CHAOS-VICTIM {}", json!({ "scenario": scenario().name, "back": back, "not_back": not_back }));
    assert!(
        back.len() >= majority,
        "the stopped worker did not come back to at least {VICTIM_SHARE_FLOOR} of the others' tokens/s with a \
         sequence running on average, or the cluster stayed under {CLUSTER_FLOOR} of its pre-fault tokens/s per \
         available CPU, in {} of {} runs: {not_back:?}",
        not_back.len(),
        back.len() + not_back.len()
    );
}

/// Runs `scenario()` until [`RUNS`] / 2 + 1 runs agree (at most [`RUNS`] runs, each on a fresh cluster with all
/// its invariants checked), and requires that in the majority, tokens/s per available CPU came back to 90% of the
/// pre-fault rate for good, window by window ([`Require::WindowByWindow`]).
async fn run_window_by_window(scenario: impl Fn() -> Scenario) {
    let majority = RUNS / 2 + 1;
    let (mut back, mut not_back) = (Vec::new(), 0);
    while back.len() < majority && not_back < majority {
        let s = scenario();
        assert_eq!(s.require, Require::WindowByWindow);
        match run(s).await.tokens_back_after {
            Some(after) => back.push(after.as_secs_f64()),
            None => not_back += 1,
        }
    }
    println!("CHAOS-WINDOWS {}", json!({ "scenario": scenario().name, "back_after_s": back, "not_back": not_back }));
    assert!(
        back.len() >= majority,
        "tokens/s in 3 s windows did not come back to 90% of the pre-fault rate for good in {not_back} of {} runs",
        back.len() + not_back
    );
}

/// SIGKILL of a worker while ~24 streams run on 3 workers (CI size).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_worker_mid_stream() {
    let _alone = ONE_AT_A_TIME.lock().await;
    run(Scenario {
        name: "chaos-kill",
        fault: Fault::Kill { restart: false },
        concurrency: 24,
        max_tokens: &[24],
        duration: Duration::from_secs(30),
        warmup: Duration::from_secs(3),
        fault_at: Duration::from_secs(8),
        require: Require::Nothing,
        deadline: Duration::from_secs(60),
    })
    .await;
}

/// SIGSTOP of a worker for 5 s (longer than the router's 2 s stall timeout), then SIGCONT: its streams move on,
/// and it comes back into placement once its health check passes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_worker_longer_than_the_stall_timeout() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let stop = Fault::Stop(Duration::from_secs(5));
    run_victim_back(|| Scenario { require: Require::VictimBack, ..ci_size("chaos-stop", stop) }).await;
}

/// The same load with no fault, held to the window-by-window check the test above used to be judged by: it shows
/// how often the healthy load alone misses that check on this machine (1 run of 3 when measured).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement of the check's noise (3 runs of ~35 s); run with --ignored"]
async fn no_fault_control_window_by_window() {
    let _alone = ONE_AT_A_TIME.lock().await;
    run_window_by_window(|| ci_size("chaos-control-windows", Fault::Nothing)).await;
}

/// The CI-size scenario: 24 streams on 3 workers, the fault 8 s in, judged window by window unless changed.
fn ci_size(name: &'static str, fault: Fault) -> Scenario {
    Scenario {
        name,
        fault,
        concurrency: 24,
        max_tokens: &[24],
        duration: Duration::from_secs(32),
        warmup: Duration::from_secs(3),
        fault_at: Duration::from_secs(8),
        require: Require::WindowByWindow,
        deadline: Duration::from_secs(60),
    }
}

/// Varied answer lengths (mean 32), as real traffic has: with one length, a closed loop of 100 completes its
/// requests in lockstep waves and the healthy baseline itself swings by half.
const VARIED_LENGTHS: &[u32] = &[16, 24, 32, 40, 48];

/// Full size: SIGKILL of a worker while 100 streams run; its supervisor starts it again at once (a worker that stays
/// dead takes its share of capacity with it for good). From 15 s after the kill on, the cluster must generate at
/// least 90% of its pre-fault tokens/s per available CPU, in the median of three runs ([`Require::BackWithin15s`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "full size (100 streams, 3 runs of ~1.3 min); run with --ignored"]
async fn sigkill_worker_mid_stream_100_streams() {
    let _alone = ONE_AT_A_TIME.lock().await;
    run_repeated(|| full_size("chaos-kill-100", Fault::Kill { restart: true })).await;
}

/// The control of the test above: the same load with no fault, held to the same check, which shows that check's
/// noise floor. (The printed window-by-window recovery in completions is the noise floor of that older measure:
/// the healthy load's own swings read as if a fault had come at 25 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "full size (100 streams, 3 runs of ~1.3 min); run with --ignored"]
async fn no_fault_control_100_streams() {
    let _alone = ONE_AT_A_TIME.lock().await;
    run_repeated(|| full_size("chaos-control-100", Fault::Nothing)).await;
}

/// The control again, with a foreign process spinning on one of the two cores from 25 s to 70 s: the invariants must
/// hold under that contention, and the printed ratios show what the per-CPU correction does and does not cancel.
/// The raw tokens/s fall to 35–49% of the pre-fault rate; per available CPU they read 0.76–1.00, not 1.0, because
/// contention also costs efficiency (a worker's kernel threads wait on each other when one is descheduled), so this
/// is a measurement of the instrument, not a recovery check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "full size (100 streams, ~1.3 min); run with --ignored"]
async fn no_fault_with_a_neighbour_on_one_core_100_streams() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let neighbour = Fault::Neighbour(Duration::from_secs(45));
    run(Scenario { require: Require::Nothing, ..full_size("chaos-neighbour-100", neighbour) }).await;
}

fn full_size(name: &'static str, fault: Fault) -> Scenario {
    Scenario {
        name,
        fault,
        concurrency: 100,
        max_tokens: VARIED_LENGTHS,
        // The recovery spans are 8–25 s and 40–57 s; the load goes on past the second (see `run`).
        duration: Duration::from_secs(66),
        warmup: Duration::from_secs(8),
        fault_at: Duration::from_secs(25),
        require: Require::BackWithin15s,
        deadline: Duration::from_secs(120),
    }
}

/// Rolling restart: every worker SIGTERMed and restarted in turn, under load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long (three restarts under load, ~1.5 min); run with --ignored"]
async fn rolling_restart_of_all_workers() {
    let _alone = ONE_AT_A_TIME.lock().await;
    run_window_by_window(|| Scenario {
        name: "chaos-rolling",
        fault: Fault::RollingRestart,
        concurrency: 24,
        max_tokens: &[24],
        duration: Duration::from_secs(70),
        warmup: Duration::from_secs(3),
        // 15 s of healthy load first: the baseline the recovery is judged against needs more than a few windows.
        fault_at: Duration::from_secs(18),
        require: Require::WindowByWindow,
        deadline: Duration::from_secs(90),
    })
    .await;
}

/// The open-loop mode of the load generator on a healthy cluster (no fault): arrivals at a fixed rate, mixed
/// streaming, every answer equal to the greedy reference, nothing lost or shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_load_matches_the_reference() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let cluster = ClusterBuilder::new(BIN, "chaos-open").workers(2).router_args(ROUTER_ARGS).start().await.unwrap();
    let http = cluster.http(0).clone();
    let prompts = load::prompt_mix(2, 2);
    let reference = load::reference(&http, &prompts, &[12]).await.unwrap();
    let cfg = LoadConfig {
        mode: Mode::Open { per_second: 3.0, max_in_flight: 64 },
        prompts,
        max_tokens: vec![12],
        streaming: Streaming::Mixed,
        deadline: Duration::from_secs(60),
        duration: Duration::from_secs(5),
        max_requests: 1000,
        urgent: None,
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

/// The sum of the samples of a counter family in a router's `/metrics`.
async fn counter_sum(http: &Http, family: &str) -> u64 {
    http.metric_sum(family).await as u64
}

/// Clock pressure: open-loop arrivals at 5× the rate the cluster sustains. The workers' admission queues fill
/// (`--max-queued-requests`), the router tries the other worker and then sheds with 503 + `Retry-After`; nothing
/// accepted is lost or wrong, every request ends within its deadline, no process's memory runs away, and the
/// cluster serves normally right after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_at_five_times_the_sustainable_rate_is_shed_with_retry_after() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let cluster = ClusterBuilder::new(BIN, "chaos-burst")
        .workers(2)
        .worker_args(&["--max-running", "8", "--max-queued-requests", "4"])
        .router_args(ROUTER_ARGS)
        .start()
        .await
        .unwrap();
    let http = cluster.http(0).clone();
    let prompts = load::prompt_mix(4, 4);
    let max_tokens = 16;
    let reference = load::reference(&http, &prompts, &[max_tokens]).await.unwrap();
    let deadline = Duration::from_secs(60);

    // The sustainable rate: closed loop at the cluster's running capacity (2 workers x 8 sequences).
    let steady = LoadConfig {
        mode: Mode::Closed { concurrency: 16 },
        prompts: prompts.clone(),
        max_tokens: vec![max_tokens],
        streaming: Streaming::Mixed,
        deadline,
        duration: Duration::from_secs(8),
        max_requests: 10_000,
        urgent: None,
    };
    let t = Instant::now();
    let steady_records = load::run(&http, &steady).await.unwrap();
    let steady_secs = t.elapsed().as_secs_f64();
    let steady_report = Report::new(&steady_records, &reference);
    assert_eq!(steady_report.lost, 0, "{steady_report:?}");
    let sustainable = steady_report.completed as f64 / steady_secs;
    assert!(sustainable > 0.0, "{steady_report:?}");

    let memory = MemoryWatch::start(cluster.pids(), Instant::now());
    let busy_before = counter_sum(&http, "pagoda_router_worker_busy_total").await;
    let shed_before = counter_sum(&http, "pagoda_router_shed_total").await;
    let burst = LoadConfig {
        mode: Mode::Open { per_second: 5.0 * sustainable, max_in_flight: 1024 },
        prompts,
        max_tokens: vec![max_tokens],
        streaming: Streaming::Mixed,
        deadline,
        duration: Duration::from_secs(6),
        max_requests: 600,
        urgent: None,
    };
    let records = load::run(&http, &burst).await.unwrap();
    let memory = memory.stop().await;
    let report = Report::new(&records, &reference);
    let shed = counter_sum(&http, "pagoda_router_shed_total").await - shed_before;
    let busy = counter_sum(&http, "pagoda_router_worker_busy_total").await - busy_before;
    let rejected: Vec<_> = records.iter().filter(|r| r.outcome == Outcome::Rejected).collect();
    let summary = json!({
        "scenario": "chaos-burst",
        "sustainable_rps": sustainable,
        "steady": {"sent": steady_report.sent, "completed": steady_report.completed,
                   "failed_clean": steady_report.failed_clean, "shed_by_router": shed_before},
        "burst_rps": 5.0 * sustainable,
        "sent": report.sent,
        "completed": report.completed,
        "failed_clean": report.failed_clean,
        "lost": report.lost,
        "mismatched": report.mismatches.len(),
        "shed_by_router": shed,
        "busy_refusals": busy,
        "p99_latency_s": report.p99_latency.as_secs_f64(),
        "p99_ttft_s": report.p99_ttft.as_secs_f64(),
        "max_latency_s": report.max_latency.as_secs_f64(),
        "memory": memory.json(),
    });
    println!("CHAOS {summary}");
    assert_eq!(report.lost, 0, "{summary:#}\n{:#?}", report.lost_examples);
    assert!(report.mismatches.is_empty(), "{summary:#}\n{:#?}", report.mismatches);
    assert!(report.max_latency < deadline, "{summary:#}");
    assert!(report.completed > 0, "{summary:#}");
    assert!(!rejected.is_empty(), "a 5x burst was not shed at all: {summary:#}");
    for r in &rejected {
        assert!(matches!(r.status, Some(503 | 429)), "refused with {:?}: {:?}", r.status, r.error);
        let after: u64 = r.retry_after.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0);
        assert!((1..=60).contains(&after), "refusal without a usable Retry-After: {r:?}");
    }
    assert!(shed > 0 && busy > 0, "the router shed after workers said busy: {summary:#}");
    if let Some(grew) = memory.unbounded() {
        panic!("memory is not bounded during the burst: {grew}\n{summary:#}");
    }
    // Right after the burst the cluster serves as before.
    let (s, v) = http
        .post_json(
            "/v1/chat/completions",
            &json!({"model": pagoda_e2e::MODEL_ID, "messages": [{"role": "user", "content": "Say hi."}],
                    "max_tokens": 4, "temperature": 0}),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
}

/// `pagoda bench load`, the load generator as a command against a running router: a short closed-loop run whose
/// JSON summary accounts for every request and checks every answer against the greedy reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_load_command_reports_a_checked_run() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let cluster = ClusterBuilder::new(BIN, "bench-load").workers(1).router_args(ROUTER_ARGS).start().await.unwrap();
    let router = cluster.http(0).base.clone();
    let out = std::env::temp_dir().join(format!("pagoda-bench-load-{}.json", std::process::id()));
    let args: Vec<String> = [
        "bench",
        "load",
        "--router",
        &router,
        "--concurrency",
        "4",
        "--duration-secs",
        "4",
        "--max-tokens",
        "8",
        "--shared-prompts",
        "2",
        "--unique-prompts",
        "2",
        "--deadline-secs",
        "60",
        // Every second request is urgent; priority 0, which this FCFS worker accepts, only marks the class.
        "--urgent-every",
        "2",
        "--urgent-priority=0",
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([out.to_string_lossy().into_owned()])
    .collect();
    let output = tokio::task::spawn_blocking(move || std::process::Command::new(BIN).args(&args).output())
        .await
        .unwrap()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let v: pagoda_e2e::serde_json::Value =
        pagoda_e2e::serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    assert_eq!(v["model"], pagoda_e2e::MODEL_ID, "{v:#}");
    assert_eq!(v["lost"], 0, "{v:#}");
    assert_eq!(v["mismatched"], 0, "{v:#}");
    let (sent, completed) = (v["sent"].as_u64().unwrap(), v["completed"].as_u64().unwrap());
    assert!(completed >= 4 && completed + v["failed_clean"].as_u64().unwrap() == sent, "{v:#}");
    assert!(v["p99_latency_s"].as_f64().unwrap() > 0.0 && v["completion_tokens_per_s"].as_f64().unwrap() > 0.0);
    // The classes split the completed requests (odd indices urgent), each with its own latencies.
    let (urgent, others) = (&v["urgent"], &v["others"]);
    assert_eq!(urgent["completed"].as_u64().unwrap() + others["completed"].as_u64().unwrap(), completed, "{v:#}");
    assert!(urgent["completed"].as_u64().unwrap() >= 2, "{v:#}");
    for class in [urgent, others] {
        assert!(class["p50_ttft_s"].as_f64().unwrap() > 0.0, "{v:#}");
        assert!(class["p99_latency_s"].as_f64() >= class["p50_latency_s"].as_f64(), "{v:#}");
    }
}

/// Flips one byte in the middle of every file under `dir` (recursively); returns how many files it touched.
fn corrupt_every_file(dir: &std::path::Path) -> usize {
    let mut touched = 0;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            touched += corrupt_every_file(&path);
            continue;
        }
        let Ok(mut bytes) = std::fs::read(&path) else { continue };
        if bytes.is_empty() {
            continue;
        }
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x5a;
        // Written in place (not renamed over): what a bad disk or a stray writer does to a live file.
        if std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, &bytes))
            .is_ok()
        {
            touched += 1;
        }
    }
    touched
}

/// Long prompts (about 400 tokens each) that share nothing, so that every one of them is worth onboarding.
fn long_prompts(n: usize) -> Vec<String> {
    const WORDS: [&str; 16] = [
        "harbor", "lantern", "granite", "meadow", "copper", "orchard", "glacier", "violet", "thunder", "saddle",
        "pepper", "marble", "falcon", "timber", "crystal", "willow",
    ];
    (0..n)
        .map(|p| {
            let mut s = format!("Document {p}. Read the list and then name its first word.");
            for i in 0..300 {
                s.push(' ');
                s.push_str(WORDS[(i * (p + 3) + p) % WORDS.len()]);
            }
            s
        })
        .collect()
}

/// One worker behind a router whose device pool holds about two of 5 long prompts, with no host tier and a disk
/// tier of `disk_mib` under `data_dir`, so prefixes cycle device -> disk -> device; the prompts' greedy references
/// (6 tokens); and a closed loop of 2 over them for `duration`.
async fn disk_tier_worker(
    name: &str,
    data_dir: &std::path::Path,
    disk_mib: u32,
    duration: Duration,
) -> (Cluster, load::Reference, LoadConfig) {
    let data = data_dir.to_string_lossy().into_owned();
    let disk = disk_mib.to_string();
    // 90 blocks per 16-token group (30 layers x 3 kv-heads): 60 groups of device KV, about two 400-token prompts.
    let args =
        ["--num-blocks", "5400", "--max-running", "2", "--host-tier-mib", "0", "--disk-tier-mib", &disk, "--data-dir"];
    let mut args: Vec<&str> = args.to_vec();
    args.push(&data);
    let cluster = ClusterBuilder::new(BIN, name).workers(1).worker_args(&args).router_args(ROUTER_ARGS);
    let cluster = cluster.start().await.unwrap();
    let prompts = long_prompts(5);
    let max_tokens = 6;
    let reference = load::reference(cluster.http(0), &prompts, &[max_tokens]).await.unwrap();
    let cfg = LoadConfig {
        mode: Mode::Closed { concurrency: 2 },
        prompts,
        max_tokens: vec![max_tokens],
        streaming: Streaming::Mixed,
        deadline: Duration::from_secs(90),
        duration,
        max_requests: 200,
        urgent: None,
    };
    (cluster, reference, cfg)
}

/// Disk-tier corruption under load: a worker whose device pool holds about two of the prompts keeps their
/// prefixes only on disk (no host tier), and onboards them from there on reuse. Mid-load every disk-tier file is
/// corrupted in place, twice. The checksums must catch it: corrupt files are counted and dropped, their prefixes
/// recomputed, no request is lost, and every answer still equals the greedy reference (no corrupted KV is used).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_disk_tier_files_are_never_used() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let data_dir = std::env::temp_dir().join(format!("pagoda-chaos-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data_dir);
    std::fs::create_dir_all(&data_dir).unwrap();
    let (cluster, reference, cfg) = disk_tier_worker("chaos-disk", &data_dir, 256, Duration::from_secs(16)).await;
    let http = cluster.http(0).clone();
    let load_http = http.clone();
    let load = tokio::spawn(async move { load::run(&load_http, &cfg).await });
    let kv_dir = data_dir.join("kv");
    let mut corrupted_files = 0;
    for at in [4, 9] {
        tokio::time::sleep(Duration::from_secs(if at == 4 { 4 } else { 5 })).await;
        corrupted_files += corrupt_every_file(&kv_dir);
    }
    let records = load.await.unwrap().unwrap();
    let report = Report::new(&records, &reference);
    let stats = worker_stats(cluster.worker_addr(0)).await.unwrap();
    let disk_hits: u64 = stats.prefix_hits.iter().filter(|h| h.tier == "disk").map(|h| h.tokens).sum();
    let summary = json!({
        "scenario": "chaos-disk-corruption",
        "sent": report.sent,
        "completed": report.completed,
        "failed_clean": report.failed_clean,
        "lost": report.lost,
        "mismatched": report.mismatches.len(),
        "files_corrupted": corrupted_files,
        "disk_corrupted_total": stats.disk_corrupted_total,
        "disk_hit_tokens": disk_hits,
        "offloaded_groups": stats.offloaded_groups_total,
        "p99_latency_s": report.p99_latency.as_secs_f64(),
    });
    println!("CHAOS {summary}");
    drop(cluster);
    let _ = std::fs::remove_dir_all(&data_dir);
    assert_eq!(report.lost, 0, "{summary:#}\n{:#?}", report.lost_examples);
    assert!(report.mismatches.is_empty(), "corrupted KV reached an answer: {summary:#}\n{:#?}", report.mismatches);
    assert!(report.completed > 0 && report.completed + report.failed_clean == report.sent, "{summary:#}");
    assert!(corrupted_files > 0, "nothing was on disk to corrupt: {summary:#}");
    assert!(disk_hits > 0, "no prefix was ever onboarded from disk: {summary:#}");
    assert!(stats.disk_corrupted_total > 0, "no corrupt file was detected: {summary:#}");
}

/// A tmpfs of a few MiB mounted at a directory for the guard's life: a disk that really fills up (the test runs as
/// root, as CI does). Unmounted lazily on drop, after the processes using it are gone.
struct SmallTmpfs(std::path::PathBuf);

impl SmallTmpfs {
    fn mount(dir: &std::path::Path, mib: u64) -> SmallTmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m,mode=0700"), "pagoda-chaos-full"])
            .arg(dir)
            .status()
            .unwrap();
        assert!(status.success(), "mounting a {mib} MiB tmpfs at {} failed: this test needs root", dir.display());
        SmallTmpfs(dir.to_path_buf())
    }
}

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `pagoda up`'s embedded kvstore loses its disk (the data dir is a 4 MiB tmpfs, filled once `up` serves): the
/// requests' block events make its raft log write, which fails, and the kvstore stops. `up` must stop with it,
/// draining the rest and exiting non-zero with the reason, not panic, and not serve on without its directory: a
/// supervisor restarts a process that exits, and cannot see one that stays up half broken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_exits_when_its_embedded_kvstore_stops() {
    let _alone = ONE_AT_A_TIME.lock().await;
    use pagoda_e2e::{Proc, cluster::die_with_parent, free_port, require_model};
    let dir = std::env::temp_dir().join(format!("pagoda-chaos-up-disk-{}", std::process::id()));
    let _disk = SmallTmpfs::mount(&dir, 4);
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let (worker, kvstore) =
        (format!("127.0.0.1:{}", free_port().unwrap()), format!("127.0.0.1:{}", free_port().unwrap()));
    let data_dir = dir.to_string_lossy().into_owned();
    let args = [
        "up",
        "--listen",
        "127.0.0.1:0",
        "--worker-listen",
        &worker,
        "--kvstore-listen",
        &kvstore,
        "--model",
        &model,
        "--threads",
        "1",
        "--data-dir",
        &data_dir,
    ];
    // Without a backtrace, the error `up` exits with ends its log rather than a few KiB of frames before it.
    let quiet = |cmd: &mut std::process::Command| {
        die_with_parent(cmd);
        cmd.env("RUST_BACKTRACE", "0");
    };
    let mut up = Proc::spawn_with(BIN.as_ref(), "chaos-up-disk", &args, quiet).unwrap();
    let http = Http::new(up.wait_line("pagoda router listening on ", Duration::from_secs(120)).unwrap());
    // Nothing left for the raft log to grow into.
    let mut filler = std::fs::File::create(dir.join("filler")).unwrap();
    let chunk = vec![0u8; 64 << 10];
    while std::io::Write::write_all(&mut filler, &chunk).is_ok() {}
    drop(filler);
    let t0 = Instant::now();
    let mut sent = 0;
    while up.alive() && t0.elapsed() < Duration::from_secs(60) && sent < 200 {
        let body = json!({"model": pagoda_e2e::MODEL_ID, "max_tokens": 4,
            "prompt": format!("Request {sent}: a story about the sea, the mountains and the rivers.")});
        let _ = tokio::time::timeout(Duration::from_secs(30), http.post_json("/v1/completions", &body)).await;
        sent += 1;
    }
    let status = up.wait_exit(Duration::from_secs(30));
    let log = up.log_tail();
    let status = status.unwrap_or_else(|| panic!("up still runs after {sent} requests on a full disk\n{log}"));
    assert_eq!(status.code(), Some(1), "an error exit, not a panic (101) or success: {status}\n{log}");
    assert!(log.contains("the embedded kvstore stopped") && log.contains("No space left"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

/// The disk tier fills up under load: the worker's data dir is a 2 MiB tmpfs while its disk tier is configured for
/// 64 MiB, and every idle prefix group (about 0.35 MiB each) is written there. Writes hit ENOSPC within the first
/// requests. The tier must shrink to what it holds and keep turning over its own files; no request is lost, every
/// answer equals the greedy reference, no I/O error escapes, and the worker keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_disk_tier_filling_up_is_survived() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let data_dir = std::env::temp_dir().join(format!("pagoda-chaos-full-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data_dir);
    let tmpfs = SmallTmpfs::mount(&data_dir, 2);
    let (cluster, reference, cfg) = disk_tier_worker("chaos-full", &data_dir, 64, Duration::from_secs(12)).await;
    let http = cluster.http(0).clone();
    let records = load::run(&http, &cfg).await.unwrap();
    let report = Report::new(&records, &reference);
    let stats = worker_stats(cluster.worker_addr(0)).await.unwrap();
    let disk_tier = stats.tiers.iter().filter(|t| t.tier == "disk");
    let disk_used: u64 = disk_tier.clone().map(|t| t.used_bytes).sum();
    // One entry per codec, each with the tier's capacity.
    let disk_capacity: u64 = disk_tier.map(|t| t.capacity_bytes).max().unwrap_or(0);
    let disk_hits: u64 = stats.prefix_hits.iter().filter(|h| h.tier == "disk").map(|h| h.tokens).sum();
    let summary = json!({
        "scenario": "chaos-disk-full",
        "sent": report.sent,
        "completed": report.completed,
        "failed_clean": report.failed_clean,
        "lost": report.lost,
        "mismatched": report.mismatches.len(),
        "disk_full_total": stats.disk_full_total,
        "disk_errors_total": stats.disk_errors_total,
        "disk_used_bytes": disk_used,
        "disk_capacity_bytes_in_force": disk_capacity,
        "disk_hit_tokens": disk_hits,
        "offloaded_groups": stats.offloaded_groups_total,
        "p99_latency_s": report.p99_latency.as_secs_f64(),
    });
    println!("CHAOS {summary}");
    let still_serving = load::chat_once(
        &http,
        &json!({"model": pagoda_e2e::MODEL_ID, "max_tokens": 2,
        "messages": [{"role": "user", "content": "Say hi."}]}),
        false,
    )
    .await;
    drop(cluster);
    drop(tmpfs);
    assert_eq!(report.lost, 0, "{summary:#}\n{:#?}", report.lost_examples);
    assert!(report.mismatches.is_empty(), "{summary:#}\n{:#?}", report.mismatches);
    assert!(report.completed > 0 && report.completed + report.failed_clean == report.sent, "{summary:#}");
    assert!(stats.disk_full_total > 0, "the disk never filled up: {summary:#}");
    assert_eq!(stats.disk_errors_total, 0, "a full disk surfaced as I/O errors: {summary:#}");
    assert!(disk_capacity <= 2 << 20 && disk_used <= disk_capacity, "the tier did not shrink to the disk: {summary:#}");
    assert_eq!(still_serving.outcome, Outcome::Completed, "{:?}", still_serving.error);
}

/// Whether the router at `http` reports the worker it reaches at `addr` ready.
async fn router_sees(http: &Http, addr: &str) -> bool {
    http.worker_ready(addr).await == Some(true)
}

/// A network partition of one worker from the router: the router reaches worker 1 only through a fault-injecting
/// TCP proxy, which blackholes every connection (open and new) for 6 s mid-load, then heals for new connections
/// only (the old ones stay dead, as after a real partition). The stalled streams migrate, the worker leaves
/// placement, and after the heal the router's HTTP/2 keepalive drops the dead connection and the worker comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_of_a_worker_from_the_router() {
    let _alone = ONE_AT_A_TIME.lock().await;
    use pagoda_e2e::proxy::{Fault, FaultProxy};
    use pagoda_e2e::{Proc, cluster::die_with_parent, free_port, require_model};
    let model = require_model().unwrap().to_string_lossy().into_owned();
    let mut workers = Vec::new();
    for i in 0..2 {
        let addr = format!("127.0.0.1:{}", free_port().unwrap());
        let args = ["worker", "--listen", &addr, "--model", &model, "--threads", "1"];
        let proc = Proc::spawn_with(BIN.as_ref(), &format!("chaos-partition-worker{i}"), &args, die_with_parent);
        workers.push((addr, proc.unwrap()));
    }
    for (_, p) in &mut workers {
        p.wait_line("pagoda worker listening on ", Duration::from_secs(120)).unwrap();
    }
    let proxy = FaultProxy::start(workers[1].0.parse().unwrap()).await.unwrap();
    let via_proxy = proxy.addr().to_string();
    let mut args = vec!["router", "--listen", "127.0.0.1:0", "--model", &model, "--worker", &workers[0].0];
    args.extend(["--worker", &via_proxy]);
    args.extend(ROUTER_ARGS);
    let mut router = Proc::spawn_with(BIN.as_ref(), "chaos-partition-router", &args, die_with_parent).unwrap();
    let http = Http::new(router.wait_line("pagoda router listening on ", Duration::from_secs(60)).unwrap());
    for addr in [&workers[0].0, &via_proxy] {
        let t0 = Instant::now();
        while !router_sees(&http, addr).await {
            assert!(t0.elapsed() < Duration::from_secs(60), "router never saw {addr} ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let prompts = load::prompt_mix(4, 4);
    let max_tokens = 24;
    let reference = load::reference(&http, &prompts, &[max_tokens]).await.unwrap();
    let duration = Duration::from_secs(32);
    let cfg = LoadConfig {
        mode: Mode::Closed { concurrency: 12 },
        prompts,
        max_tokens: vec![max_tokens],
        streaming: Streaming::Mixed,
        deadline: Duration::from_secs(60),
        duration,
        max_requests: 100_000,
        urgent: None,
    };
    let (before, _) = migrations(&http).await;
    let load_http = http.clone();
    let t0 = Instant::now();
    let load = tokio::spawn(async move { load::run(&load_http, &cfg).await });
    tokio::time::sleep(Duration::from_secs(6)).await;
    let victim_running = {
        let t = Instant::now();
        let mut running = 0;
        while running == 0 && t.elapsed() < Duration::from_secs(10) {
            running = worker_stats(&workers[1].0).await.map(|s| s.running).unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        running
    };
    let fault_at = t0.elapsed();
    proxy.set(Fault::Blackhole);
    let t = Instant::now();
    while router_sees(&http, &via_proxy).await && t.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left_placement_after = t.elapsed();
    tokio::time::sleep(Duration::from_secs(6).saturating_sub(left_placement_after)).await;
    proxy.set(Fault::None);
    let healed_at = t0.elapsed();
    let t = Instant::now();
    while !router_sees(&http, &via_proxy).await && t.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let back_after = t.elapsed();
    let records = load.await.unwrap().unwrap();
    let (after, reasons) = migrations(&http).await;
    let report = Report::new(&records, &reference);
    let window = load::recovery_window(&records, Duration::from_secs(3), fault_at, Duration::from_secs(3));
    let rec = load::recovery(&records, Duration::from_secs(3), fault_at, duration, window, 0.9);
    let summary = json!({
        "scenario": "chaos-partition",
        "sent": report.sent,
        "completed": report.completed,
        "failed_clean": report.failed_clean,
        "lost": report.lost,
        "mismatched": report.mismatches.len(),
        "migrated": after - before,
        "migrations_by_reason": reasons,
        "running_on_victim_at_fault": victim_running,
        "fault_at_s": fault_at.as_secs_f64(),
        "left_placement_after_s": left_placement_after.as_secs_f64(),
        "healed_at_s": healed_at.as_secs_f64(),
        "back_in_placement_after_heal_s": back_after.as_secs_f64(),
        "baseline_rps": rec.baseline,
        "recovery_window_s": window.as_secs_f64(),
        "worst_window_rps": rec.worst,
        "recovered_after_s": rec.recovered_after.map(|d| d.as_secs_f64()),
        "p99_latency_s": report.p99_latency.as_secs_f64(),
        "max_latency_s": report.max_latency.as_secs_f64(),
        "proxy_blackholed_connections": proxy.counters().blackholed.load(std::sync::atomic::Ordering::Relaxed),
    });
    println!("CHAOS {summary}");
    assert_eq!(report.lost, 0, "{summary:#}\n{:#?}", report.lost_examples);
    assert!(report.mismatches.is_empty(), "{summary:#}\n{:#?}", report.mismatches);
    assert!(report.completed > 0 && report.completed + report.failed_clean == report.sent, "{summary:#}");
    assert!(report.max_latency < Duration::from_secs(60), "{summary:#}");
    assert!(left_placement_after < Duration::from_secs(10), "the partitioned worker stayed in placement: {summary:#}");
    assert!(back_after < Duration::from_secs(20), "the worker did not come back after the heal: {summary:#}");
    if victim_running > 0 {
        assert!(after > before, "streams ran on the partitioned worker but nothing migrated: {summary:#}");
    }
    router.kill();
}
