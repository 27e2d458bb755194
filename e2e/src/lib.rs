//! Pagoda end-to-end harness: starts the real `pagoda` binary as child processes on ephemeral loopback ports,
//! waits for readiness, and offers HTTP/SSE/gRPC helpers. Every child is killed by a drop guard, so a failing
//! test never leaves processes behind; on failure the child's log tail is printed.
//!
//! - [`cluster`]: N workers and routers as separate processes, with fault injection (SIGKILL, SIGSTOP/SIGCONT,
//!   restart) for the chaos tests.
//! - [`cpu`]: the share of the machine's CPU that went to processes outside the test, for throughput that a
//!   neighbour's load does not move.
//! - [`load`]: the load generator and the checks of its records against a greedy reference.
//! - [`webdriver`]: drives headless Chromium for the browser tests.

pub mod cluster;
pub mod cpu;
pub mod load;
pub mod proxy;
pub mod webdriver;

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use pagoda_proto::worker::worker_client::WorkerClient;
use pagoda_proto::worker::{HealthRequest, HealthResponse, ResidencyRequest, StatsRequest};
pub use pagoda_proto::worker::{ResidencyResponse, StatsResponse};

pub use futures;
pub use reqwest;
pub use serde_json;

/// The model the tests serve (fetched by scripts/fetch-model.sh, which CI runs first).
pub fn model_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The id the model is served under (its file stem).
pub const MODEL_ID: &str = "SmolLM2-135M-Instruct.Q4_1";

/// The resident set size of process `pid` in bytes (`VmRSS` of `/proc/<pid>/status`); `None` once it is gone.
pub fn resident_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim();
    kib.parse::<u64>().ok().map(|k| k * 1024)
}

/// The samples of metric `family` in a Prometheus text exposition: (the whole line, its value).
pub fn metric_samples<'a>(text: &'a str, family: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    text.lines()
        .filter(move |l| l.strip_prefix(family).is_some_and(|rest| rest.starts_with(['{', ' '])))
        .filter_map(|l| Some((l, l.rsplit(' ').next()?.parse::<f64>().ok()?)))
}

/// A running `pagoda` child process. Dropping it kills the process.
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    /// Starts `bin args...`; stdout lines are collected, stderr goes to a log file.
    pub fn spawn(bin: &Path, name: &str, args: &[&str]) -> Result<Proc> {
        Proc::spawn_with(bin, name, args, |_| {})
    }

    /// Like [`Proc::spawn`], with `configure` adjusting the command first (environment variables).
    pub fn spawn_with(bin: &Path, name: &str, args: &[&str], configure: impl FnOnce(&mut Command)) -> Result<Proc> {
        let log = std::env::temp_dir().join(format!("pagoda-e2e-{name}-{}.log", std::process::id()));
        let err = File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let mut cmd = Command::new(bin);
        configure(&mut cmd);
        let mut child = cmd
            .args(args)
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(err))
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Proc { name: name.to_string(), child, log, lines })
    }

    /// Waits for a stdout line starting with `prefix` and returns the rest of it.
    pub fn wait_line(&mut self, prefix: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("{} exited ({status}) before printing {prefix:?}\n{}", self.name, self.log_tail());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("{} did not print {prefix:?} within {timeout:?}\n{}", self.name, self.log_tail());
            }
            match self.lines.recv_timeout(left.min(Duration::from_millis(200))) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return Ok(rest.trim().to_string());
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The name its log carries.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits up to `timeout` for the process to exit by itself; its exit status, or `None` if it still runs.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
                _ => return None,
            }
        }
    }

    /// Sends SIGTERM (a graceful shutdown) and waits up to `timeout` for the process to exit; returns whether it
    /// did.
    pub fn terminate(&mut self, timeout: Duration) -> Result<bool> {
        let status =
            Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().context("run kill -TERM")?;
        if !status.success() {
            bail!("kill -TERM {} failed: {status}", self.child.id());
        }
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(true);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(false)
    }

    /// Kills the process now and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The first 1 KiB and the last 4 KiB of the process's stderr log: the head holds the error of a process that
    /// failed at start (its backtrace follows and fills the tail), the tail what it did last.
    pub fn log_tail(&self) -> String {
        let (mut head, mut tail) = (Vec::new(), Vec::new());
        if let Ok(mut f) = File::open(&self.log) {
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            if len > 5 * 1024 {
                let _ = (&mut f).take(1024).read_to_end(&mut head);
            }
            let _ = f.seek(SeekFrom::Start(len.saturating_sub(4096)));
            let _ = f.read_to_end(&mut tail);
        }
        // Lossy: a seek can land inside a multi-byte character.
        let tail = String::from_utf8_lossy(&tail);
        let head = if head.is_empty() { String::new() } else { format!("{}\n[...]\n", String::from_utf8_lossy(&head)) };
        format!("--- {} log ({}) ---\n{head}{tail}", self.name, self.log.display())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("{}", self.log_tail());
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Checks that the model is there, with a helpful message otherwise.
pub fn require_model() -> Result<PathBuf> {
    let p = model_path();
    if !p.is_file() {
        bail!("{} is missing: run scripts/fetch-model.sh first", p.display());
    }
    Ok(p)
}

/// A loopback port that was free a moment ago, for a process the test starts next.
///
/// Taken below the kernel's ephemeral range (`ip_local_port_range`, 32768–60999 by default), not from port 0:
/// port-0 binds and every outgoing connection of every process take their ports from that range, so one of them
/// could take a port picked there before the server binds it (seen as a kvstore exiting with "Address already in
/// use"). Below it only explicit binds compete. Ports are handed out in turn from a per-process offset, so two
/// calls in one test binary never return the same port.
pub fn free_port() -> Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u32>().ok()))
        .unwrap_or(32768);
    if ephemeral_low < 12_000 {
        // No room below the range: fall back to the kernel's choice.
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        return Ok(l.local_addr()?.port());
    }
    let (low, span) = (10_000, ephemeral_low - 10_000);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(7919) % span,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..span.min(2_000) {
        let port = low + NEXT.fetch_add(1, Ordering::Relaxed) % span;
        let port = port as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free loopback port in {low}..{ephemeral_low}")
}

/// HTTP helpers against one router.
#[derive(Clone)]
pub struct Http {
    pub base: String,
    pub client: reqwest::Client,
    /// The model id the load generator's requests name ([`MODEL_ID`] unless set).
    pub model: String,
}

impl Http {
    pub fn new(base: impl Into<String>) -> Http {
        let client = reqwest::Client::builder().timeout(Duration::from_secs(300)).build().unwrap_or_default();
        Http { base: base.into(), client, model: MODEL_ID.to_string() }
    }

    /// The same router, every request carrying `Authorization: Bearer <key>`.
    pub fn with_api_key(mut self, key: &str) -> Result<Http> {
        let mut auth = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}")).context("API key")?;
        auth.set_sensitive(true);
        let headers = reqwest::header::HeaderMap::from_iter([(reqwest::header::AUTHORIZATION, auth)]);
        self.client = reqwest::Client::builder().timeout(Duration::from_secs(300)).default_headers(headers).build()?;
        Ok(self)
    }

    /// The same router, with requests naming `model`.
    pub fn with_model(mut self, model: impl Into<String>) -> Http {
        self.model = model.into();
        self
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// GET, returning status and body text.
    pub async fn get(&self, path: &str) -> Result<(u16, String)> {
        let r = self.client.get(self.url(path)).send().await?;
        let s = r.status().as_u16();
        Ok((s, r.text().await?))
    }

    /// POST raw bytes as JSON, returning status and body text.
    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> Result<(u16, String)> {
        let r = self.client.post(self.url(path)).header("content-type", "application/json").body(body).send().await?;
        let s = r.status().as_u16();
        Ok((s, r.text().await?))
    }

    /// POST a JSON value, returning status and parsed JSON body.
    pub async fn post_json(&self, path: &str, body: &serde_json::Value) -> Result<(u16, serde_json::Value)> {
        let (s, text) = self.post_raw(path, body.to_string().into_bytes()).await?;
        let v = serde_json::from_str(&text).with_context(|| format!("response is not JSON: {text}"))?;
        Ok((s, v))
    }

    /// The sum of every sample of metric `family` (all label sets) in `/metrics`; 0 when absent or unreachable.
    pub async fn metric_sum(&self, family: &str) -> f64 {
        let (_, text) = self.get("/metrics").await.unwrap_or_default();
        metric_samples(&text, family).map(|(_, v)| v).sum()
    }

    /// How the router's `/readyz` lists the worker at `addr`: `Some(ready)`, or `None` when it is not listed (or
    /// the router does not answer).
    pub async fn worker_ready(&self, addr: &str) -> Option<bool> {
        let (_, body) = self.get("/readyz").await.ok()?;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        v["workers"].as_array()?.iter().find(|w| w["address"] == addr).map(|w| w["ready"] == true)
    }

    /// Polls `/readyz` until it answers 200.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok((200, _)) = self.get("/readyz").await {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{} not ready within {timeout:?}", self.base);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Parses an SSE body strictly: each event is exactly one `data: <payload>` line followed by a blank line.
pub fn sse_payloads(body: &str) -> Result<Vec<String>> {
    if !body.ends_with("\n\n") {
        bail!("SSE body does not end with a blank line: {body:?}");
    }
    body.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|ev| {
            if ev.contains('\n') {
                bail!("event spans several lines: {ev:?}");
            }
            ev.strip_prefix("data: ").map(str::to_string).ok_or_else(|| anyhow!("not a data line: {ev:?}"))
        })
        .collect()
}

/// Polls `check` every 100 ms until it holds; fails the test after `limit`. Returns how long it took.
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = Instant::now();
    while !check().await {
        assert!(t0.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    t0.elapsed()
}

/// The address of the kvstore node among `addrs` that reports itself leader; fails after `limit` without one.
pub async fn kvstore_leader(addrs: &[String], limit: Duration) -> Result<String> {
    let t0 = Instant::now();
    loop {
        for a in addrs {
            if let Ok(s) = pagoda_kvstore::Client::status_of(a).await
                && s.role == "Leader"
            {
                return Ok(a.clone());
            }
        }
        if t0.elapsed() > limit {
            bail!("no leader among {addrs:?} within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every block group the worker holds now (its `Residency` over gRPC, every page): `seq` is the last page's.
pub async fn worker_residency(addr: &str) -> Result<ResidencyResponse> {
    let mut c = WorkerClient::connect(format!("http://{addr}")).await.with_context(|| format!("connect {addr}"))?;
    let mut all = ResidencyResponse::default();
    loop {
        let page = c.residency(ResidencyRequest { after: all.next.take(), limit: 0 }).await?.into_inner();
        all.seq = page.seq;
        all.groups.extend(page.groups);
        all.next = page.next;
        if all.next.is_none() {
            return Ok(all);
        }
    }
}

/// The worker's `Health` over gRPC.
pub async fn worker_health(addr: &str) -> Result<HealthResponse> {
    let mut c = WorkerClient::connect(format!("http://{addr}")).await.with_context(|| format!("connect {addr}"))?;
    Ok(c.health(HealthRequest {}).await?.into_inner())
}

/// The worker's `Stats` over gRPC.
pub async fn worker_stats(addr: &str) -> Result<StatsResponse> {
    let mut c = WorkerClient::connect(format!("http://{addr}")).await.with_context(|| format!("connect {addr}"))?;
    Ok(c.stats(StatsRequest {}).await?.into_inner())
}

#[cfg(test)]
mod tests {
    /// The e2e tests compare floats read back from the router's and workers' JSON with the ones the processes report
    /// over gRPC, exactly. serde_json's default parser is fast but not correctly rounded (it lands an ulp off for a
    /// good share of values); the workspace's `float_roundtrip` feature makes it exact, and this fails without it.
    #[test]
    fn json_floats_parse_back_to_the_value_printed() {
        let mut bits = 250.052_818_757_733_06_f64.to_bits();
        for _ in 0..20_000 {
            let x = f64::from_bits(bits);
            let text = serde_json::to_string(&x).unwrap();
            let back: f64 = serde_json::from_str(&text).unwrap();
            assert_eq!(back.to_bits(), bits, "{text} parsed back as {back:?}");
            bits += 7919;
        }
    }
}
