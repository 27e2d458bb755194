//! A multi-process Pagoda cluster for fault tests: N `pagoda worker` processes and one or more `pagoda router`
//! processes on loopback, each worker on a fixed ephemeral port so that it can be restarted at the same address.
//! The [`Cluster`] owns every process it started (including the ones it killed, whose logs it keeps) and tears them
//! all down on drop, stopped ones included; on a panic every process's log tail is printed. Workers can be killed
//! (SIGKILL), frozen (SIGSTOP), thawed (SIGCONT), gracefully stopped (SIGTERM) and restarted one at a time.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{Http, Proc, free_port, require_model};

/// How long a worker may take to load the model and listen.
const WORKER_START: Duration = Duration::from_secs(120);
/// How long a router may take to load the tokenizer and listen.
const ROUTER_START: Duration = Duration::from_secs(60);

/// What to start.
pub struct ClusterBuilder {
    bin: PathBuf,
    name: String,
    workers: usize,
    routers: usize,
    worker_args: Vec<String>,
    /// Extra arguments of worker `i` alone (after the shared ones).
    own_worker_args: Vec<Vec<String>>,
    router_args: Vec<String>,
}

impl ClusterBuilder {
    /// A cluster of the `pagoda` binary at `bin`; `name` prefixes the process logs.
    pub fn new(bin: impl AsRef<Path>, name: &str) -> ClusterBuilder {
        ClusterBuilder {
            bin: bin.as_ref().to_path_buf(),
            name: name.to_string(),
            workers: 3,
            routers: 1,
            worker_args: vec!["--threads".into(), "1".into()],
            own_worker_args: Vec::new(),
            router_args: Vec::new(),
        }
    }

    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n;
        self
    }

    pub fn routers(mut self, n: usize) -> Self {
        self.routers = n;
        self
    }

    /// Extra arguments for every worker (after `--listen` and `--model`).
    pub fn worker_args(mut self, args: &[&str]) -> Self {
        self.worker_args.extend(args.iter().map(|s| s.to_string()));
        self
    }

    /// Extra arguments for worker `i` only (after those of every worker), e.g. its `--role`.
    pub fn worker_args_for(mut self, i: usize, args: &[&str]) -> Self {
        if self.own_worker_args.len() <= i {
            self.own_worker_args.resize(i + 1, Vec::new());
        }
        self.own_worker_args[i].extend(args.iter().map(|s| s.to_string()));
        self
    }

    /// Extra arguments for every router (after `--listen`, the workers and `--model`).
    pub fn router_args(mut self, args: &[&str]) -> Self {
        self.router_args.extend(args.iter().map(|s| s.to_string()));
        self
    }

    /// Starts the workers (in parallel: each loads the model), then the routers, and waits until every router
    /// sees every worker ready.
    pub async fn start(self) -> Result<Cluster> {
        if self.workers == 0 || self.routers == 0 {
            bail!("a cluster needs at least one worker and one router");
        }
        let model = require_model()?.to_string_lossy().into_owned();
        let mut cluster = Cluster {
            bin: self.bin,
            name: self.name,
            model,
            worker_args: self.worker_args,
            own_worker_args: self.own_worker_args,
            workers: Vec::new(),
            routers: Vec::new(),
            retired: Vec::new(),
        };
        for i in 0..self.workers {
            let port = free_port()?;
            let proc = cluster.spawn_worker(i, port, 0)?;
            cluster.workers.push(WorkerSlot {
                addr: format!("127.0.0.1:{port}"),
                proc: Some(proc),
                stopped: false,
                starts: 1,
            });
        }
        for i in 0..self.workers {
            cluster.wait_worker_listening(i)?;
        }
        let worker_flags: Vec<String> =
            cluster.workers.iter().flat_map(|w| ["--worker".to_string(), w.addr.clone()]).collect();
        for r in 0..self.routers {
            let mut args: Vec<String> = vec!["router".into(), "--listen".into(), "127.0.0.1:0".into()];
            args.extend(worker_flags.iter().cloned());
            args.extend(["--model".into(), cluster.model.clone()]);
            args.extend(self.router_args.iter().cloned());
            let argv: Vec<&str> = args.iter().map(String::as_str).collect();
            let mut proc =
                Proc::spawn_with(&cluster.bin, &format!("{}-router{r}", cluster.name), &argv, die_with_parent)?;
            let base = proc.wait_line("pagoda router listening on ", ROUTER_START)?;
            cluster.routers.push(RouterSlot { http: Http::new(base), proc });
        }
        for r in 0..cluster.routers.len() {
            cluster.wait_all_ready(r, Duration::from_secs(60)).await?;
        }
        Ok(cluster)
    }
}

struct WorkerSlot {
    addr: String,
    /// `None` between a kill and a restart.
    proc: Option<Proc>,
    stopped: bool,
    /// How many processes have served this slot (names the logs of restarts apart).
    starts: u32,
}

struct RouterSlot {
    http: Http,
    proc: Proc,
}

/// A running cluster; dropping it kills every process it started.
pub struct Cluster {
    bin: PathBuf,
    name: String,
    model: String,
    worker_args: Vec<String>,
    own_worker_args: Vec<Vec<String>>,
    workers: Vec<WorkerSlot>,
    routers: Vec<RouterSlot>,
    /// Killed or replaced processes, kept so that their logs are printed if the test fails.
    retired: Vec<Proc>,
}

/// Makes the child get SIGKILL when the test process dies, whatever the way (a drop guard cannot run on SIGKILL).
pub fn die_with_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe and touches only the calling (child) process.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

fn signal(pid: u32, sig: libc::c_int) -> Result<()> {
    let pid = libc::pid_t::try_from(pid).context("pid out of range")?;
    // SAFETY: kill(2) with a pid of a child this process spawned and still owns.
    if unsafe { libc::kill(pid, sig) } != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("kill({pid}, {sig})"));
    }
    Ok(())
}

impl Cluster {
    fn spawn_worker(&self, i: usize, port: u16, generation: u32) -> Result<Proc> {
        let listen = format!("127.0.0.1:{port}");
        let mut args: Vec<&str> = vec!["worker", "--listen", &listen, "--model", &self.model];
        args.extend(self.worker_args.iter().map(String::as_str));
        args.extend(self.own_worker_args.get(i).into_iter().flatten().map(String::as_str));
        let name = if generation == 0 {
            format!("{}-worker{i}", self.name)
        } else {
            format!("{}-worker{i}-restart{generation}", self.name)
        };
        Proc::spawn_with(&self.bin, &name, &args, die_with_parent)
    }

    fn wait_worker_listening(&mut self, i: usize) -> Result<()> {
        let slot = &mut self.workers[i];
        let proc = slot.proc.as_mut().context("worker is not running")?;
        proc.wait_line("pagoda worker listening on ", WORKER_START)?;
        Ok(())
    }

    /// The HTTP client of router `r`.
    pub fn http(&self, r: usize) -> &Http {
        &self.routers[r].http
    }

    /// Every router's client.
    pub fn routers(&self) -> Vec<Http> {
        self.routers.iter().map(|r| r.http.clone()).collect()
    }

    /// How many worker slots there are.
    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    /// The gRPC address of worker `i`.
    pub fn worker_addr(&self, i: usize) -> &str {
        &self.workers[i].addr
    }

    /// Whether router `r` currently reports worker `i` ready.
    pub async fn router_sees_ready(&self, r: usize, i: usize) -> Result<bool> {
        Ok(self.http(r).worker_ready(&self.workers[i].addr).await == Some(true))
    }

    /// Waits until router `r` reports every worker ready.
    pub async fn wait_all_ready(&self, r: usize, timeout: Duration) -> Result<()> {
        for i in 0..self.workers.len() {
            self.wait_router_sees(r, i, true, timeout).await?;
        }
        Ok(())
    }

    /// Waits until router `r` reports worker `i` as `ready` (or not).
    pub async fn wait_router_sees(&self, r: usize, i: usize, ready: bool, timeout: Duration) -> Result<Duration> {
        let t0 = Instant::now();
        loop {
            if self.router_sees_ready(r, i).await.unwrap_or(false) == ready {
                return Ok(t0.elapsed());
            }
            if t0.elapsed() > timeout {
                bail!("router {r} did not see worker {i} ready={ready} within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn running(&mut self, i: usize) -> Result<&mut Proc> {
        self.workers.get_mut(i).and_then(|w| w.proc.as_mut()).with_context(|| format!("worker {i} is not running"))
    }

    /// SIGKILL worker `i` now (it stays dead until [`Cluster::restart_worker`]).
    pub fn kill_worker(&mut self, i: usize) -> Result<()> {
        let mut proc = self.workers[i].proc.take().with_context(|| format!("worker {i} is not running"))?;
        proc.kill();
        self.workers[i].stopped = false;
        self.retired.push(proc);
        Ok(())
    }

    /// SIGSTOP worker `i`: it keeps its sockets but answers nothing.
    pub fn stop_worker(&mut self, i: usize) -> Result<()> {
        let pid = self.running(i)?.pid();
        signal(pid, libc::SIGSTOP)?;
        self.workers[i].stopped = true;
        Ok(())
    }

    /// SIGCONT worker `i`.
    pub fn continue_worker(&mut self, i: usize) -> Result<()> {
        let pid = self.running(i)?.pid();
        signal(pid, libc::SIGCONT)?;
        self.workers[i].stopped = false;
        Ok(())
    }

    /// SIGTERM worker `i` (a graceful shutdown: it drains for a while) and waits for it to exit, SIGKILL after
    /// `timeout`.
    pub fn terminate_worker(&mut self, i: usize, timeout: Duration) -> Result<()> {
        let mut proc = self.workers[i].proc.take().with_context(|| format!("worker {i} is not running"))?;
        if self.workers[i].stopped {
            signal(proc.pid(), libc::SIGCONT)?;
            self.workers[i].stopped = false;
        }
        if !proc.terminate(timeout)? {
            proc.kill();
        }
        self.retired.push(proc);
        Ok(())
    }

    /// Starts worker `i` again at its address (after a kill or terminate; a running one is killed first) and waits
    /// until it listens.
    pub fn restart_worker(&mut self, i: usize) -> Result<()> {
        if self.workers[i].proc.is_some() {
            self.kill_worker(i)?;
        }
        let port: u16 = self.workers[i]
            .addr
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .context("worker address has no port")?;
        let generation = self.workers[i].starts;
        let proc = self.spawn_worker(i, port, generation)?;
        self.workers[i].proc = Some(proc);
        self.workers[i].starts += 1;
        self.wait_worker_listening(i)
    }

    /// Whether worker `i`'s process is alive.
    pub fn worker_alive(&mut self, i: usize) -> bool {
        self.workers[i].proc.as_mut().is_some_and(Proc::alive)
    }

    /// The pid of every live router and worker process, by log name (for [`crate::resident_bytes`]).
    pub fn pids(&self) -> Vec<(String, u32)> {
        let live = self.routers.iter().map(|r| &r.proc).chain(self.workers.iter().filter_map(|w| w.proc.as_ref()));
        live.map(|p| (p.name().to_string(), p.pid())).collect()
    }

    /// Every process's log tail, for a report.
    pub fn log_tails(&self) -> String {
        let mut out = String::new();
        for r in &self.routers {
            out.push_str(&r.proc.log_tail());
            out.push('\n');
        }
        for w in self.workers.iter().filter_map(|w| w.proc.as_ref()) {
            out.push_str(&w.log_tail());
            out.push('\n');
        }
        for p in &self.retired {
            out.push_str(&p.log_tail());
            out.push('\n');
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // A stopped process would never see SIGTERM; SIGKILL works on it, but continue it first so that it exits
        // through the normal path of a killed process and is reaped at once.
        for w in &mut self.workers {
            if let Some(p) = w.proc.as_mut() {
                if w.stopped {
                    let _ = signal(p.pid(), libc::SIGCONT);
                }
                p.kill();
            }
        }
        for r in &mut self.routers {
            r.proc.kill();
        }
        // Each Proc's own drop prints its log tail when the test panicked.
    }
}
