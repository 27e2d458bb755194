//! How much of the machine's CPU a test's own processes could use, sampled while its load runs.
//!
//! A throughput measured on a shared machine moves with whatever else runs there: a build or a benchmark that starts
//! halfway through a chaos test's load reads as a cluster that never recovered. [`CpuWatch`] samples, every 250 ms,
//! the machine's busy CPU time (`/proc/stat`) and the CPU time of this process and all its descendants (the cluster
//! it started, restarted workers included). Their difference is the CPU that went to foreign processes; what the
//! test's own processes could have had is the rest ([`CpuTimeline::available_cpu_seconds`]). Dividing completions
//! by it gives a throughput that a neighbour's load does not move, while a cluster that idles after a fault (stuck
//! on a timeout, a worker left out of placement) still reads as slow: idle CPU counts as available.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// One sample: when, the machine's busy CPU seconds so far, and this process tree's CPU seconds so far.
#[derive(Debug, Clone, Copy)]
pub struct CpuSample {
    pub at: Duration,
    pub machine_busy: f64,
    pub ours: f64,
}

/// The samples of one run.
#[derive(Debug, Clone)]
pub struct CpuTimeline {
    pub samples: Vec<CpuSample>,
    /// CPUs the machine has.
    pub cores: f64,
}

impl CpuTimeline {
    /// The sample nearest to `at`.
    fn at(&self, at: Duration) -> Option<CpuSample> {
        self.samples.iter().min_by_key(|s| s.at.abs_diff(at)).copied()
    }

    /// CPU seconds that went to processes outside this test in `[from, to)` (never negative).
    pub fn foreign_cpu_seconds(&self, from: Duration, to: Duration) -> f64 {
        match (self.at(from), self.at(to)) {
            (Some(a), Some(b)) => ((b.machine_busy - a.machine_busy) - (b.ours - a.ours)).max(0.0),
            _ => 0.0,
        }
    }

    /// CPU seconds this test's own processes used in `[from, to)`.
    pub fn ours_cpu_seconds(&self, from: Duration, to: Duration) -> f64 {
        match (self.at(from), self.at(to)) {
            (Some(a), Some(b)) => (b.ours - a.ours).max(0.0),
            _ => 0.0,
        }
    }

    /// The share of the machine's CPU that went to foreign processes in `[from, to)`.
    pub fn foreign_share(&self, from: Duration, to: Duration) -> f64 {
        let total = (to.saturating_sub(from)).as_secs_f64() * self.cores;
        if total > 0.0 { self.foreign_cpu_seconds(from, to) / total } else { 0.0 }
    }

    /// CPU seconds this test's processes could have used in `[from, to)`: all of the machine's, less the foreign
    /// ones (idle time counts as available).
    pub fn available_cpu_seconds(&self, from: Duration, to: Duration) -> f64 {
        to.saturating_sub(from).as_secs_f64() * self.cores - self.foreign_cpu_seconds(from, to)
    }
}

/// Samples the CPU times in the background until stopped (bounded: at most 10 minutes of samples).
pub struct CpuWatch {
    over: Arc<AtomicBool>,
    sampler: tokio::task::JoinHandle<Vec<CpuSample>>,
}

impl CpuWatch {
    /// Starts sampling; sample times are measured from `t0`.
    pub fn start(t0: Instant) -> CpuWatch {
        let over = Arc::new(AtomicBool::new(false));
        let sampler = {
            let over = over.clone();
            tokio::spawn(async move {
                let root = std::process::id();
                let mut seen = HashMap::new();
                let mut samples = Vec::new();
                for _ in 0..2400 {
                    if over.load(Ordering::Relaxed) {
                        break;
                    }
                    if let Some(machine_busy) = machine_busy_seconds() {
                        let ours = tree_cpu_seconds(root, &mut seen);
                        samples.push(CpuSample { at: t0.elapsed(), machine_busy, ours });
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                samples
            })
        };
        CpuWatch { over, sampler }
    }

    /// Stops sampling (after one last sample, so that the timeline covers up to now).
    pub async fn stop(self) -> CpuTimeline {
        self.over.store(true, Ordering::Relaxed);
        let samples = self.sampler.await.unwrap_or_default();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        CpuTimeline { samples, cores }
    }
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 { ticks as f64 } else { 100.0 }
}

/// The machine's busy CPU seconds since boot, over all CPUs: user, nice, system, irq, softirq and steal time of the
/// first line of `/proc/stat` (idle and iowait are not busy).
pub fn machine_busy_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<f64> =
        stat.lines().next()?.strip_prefix("cpu ")?.split_whitespace().filter_map(|f| f.parse().ok()).collect();
    let busy = [0, 1, 2, 5, 6, 7].iter().filter_map(|&i| fields.get(i)).sum::<f64>();
    Some(busy / clock_ticks_per_second())
}

/// The user plus system CPU seconds `pid` has used so far (`None` once it is gone).
pub fn process_cpu_seconds(pid: u32) -> Option<f64> {
    process_stat(pid).map(|(_, _, cpu)| cpu)
}

/// Of `/proc/<pid>/stat`: the parent pid, the start time (which tells a reused pid from the old one) and the user
/// plus system CPU seconds.
fn process_stat(pid: u32) -> Option<(u32, u64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses; the fields after its closing one are plain.
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ppid = fields.get(1)?.parse().ok()?;
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    let start: u64 = fields.get(19)?.parse().ok()?;
    Some((ppid, start, (utime + stime) / clock_ticks_per_second()))
}

/// The CPU seconds of `root` and every process descended from it, counting every process ever seen: one that has
/// exited (a SIGKILLed worker) keeps the time it had at its last sample, so the sum never falls.
fn tree_cpu_seconds(root: u32, seen: &mut HashMap<(u32, u64), f64>) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else { return seen.values().sum() };
    let stats: Vec<(u32, (u32, u64, f64))> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, process_stat(pid)?)))
        .collect();
    let mut children: HashMap<u32, Vec<usize>> = HashMap::new();
    for (i, (_, (ppid, _, _))) in stats.iter().enumerate() {
        children.entry(*ppid).or_default().push(i);
    }
    let mut stack = vec![root];
    if let Some((_, (_, start, cpu))) = stats.iter().find(|(pid, _)| *pid == root) {
        seen.insert((root, *start), *cpu);
    }
    while let Some(parent) = stack.pop() {
        for &i in children.get(&parent).map(Vec::as_slice).unwrap_or_default() {
            let (pid, (_, start, cpu)) = stats[i];
            seen.insert((pid, start), cpu);
            stack.push(pid);
        }
    }
    seen.values().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_child_spinning_counts_as_ours_not_foreign() {
        let t0 = Instant::now();
        let watch = CpuWatch::start(t0);
        // A child that burns one CPU until it is killed.
        let mut child = std::process::Command::new("sh").args(["-c", "while :; do :; done"]).spawn().expect("sh runs");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let timeline = watch.stop().await;
        let _ = child.kill();
        let _ = child.wait();
        let (first, last) = (timeline.samples[0], *timeline.samples.last().expect("sampled"));
        let ours = last.ours - first.ours;
        assert!(ours > 0.5, "the spinning child's CPU counts as ours: {ours:.2} s");
        let wall = (last.at - first.at).as_secs_f64();
        assert!(timeline.available_cpu_seconds(first.at, last.at) <= wall * timeline.cores + 1e-9);
    }

    #[test]
    fn foreign_time_is_machine_time_less_ours() {
        let s = |at: u64, machine_busy, ours| CpuSample { at: Duration::from_secs(at), machine_busy, ours };
        let timeline = CpuTimeline { samples: vec![s(0, 100.0, 10.0), s(10, 118.0, 22.0)], cores: 2.0 };
        let (from, to) = (Duration::ZERO, Duration::from_secs(10));
        assert_eq!(timeline.foreign_cpu_seconds(from, to), 6.0);
        assert_eq!(timeline.foreign_share(from, to), 0.3);
        assert_eq!(timeline.available_cpu_seconds(from, to), 14.0);
    }
}
