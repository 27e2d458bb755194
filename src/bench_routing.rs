//! `pagoda bench routing`: one multi-turn chat trace replayed against each placement strategy, on fresh local
//! worker processes every time, side by side in one run.
//!
//! **The trace** (deterministic from `--seed`): `--system-prompts` long shared system prompts (about 250 tokens
//! each, as deployed assistants carry) and `--conversations` conversations, conversation `c` on system prompt
//! `c mod S`. Each has `--turns` user turns of 12–60 words (ShareGPT's user turns are short, its median around
//! 40–80 tokens); every turn sends the whole history (system, earlier user turns, the model's own earlier replies)
//! plus the new user message, so conversations grow as they do in real chat. Replies are capped at
//! `--max-tokens` (ShareGPT's replies are longer; CPU time is the limit here). Conversations start
//! `--conversation-gap-ms` apart (150 by default: a burst),
//! run concurrently, and send each turn as soon as the previous reply has arrived.
//!
//! **Per strategy** `--workers` fresh `pagoda worker` processes and one `pagoda router --placement S` (the router
//! predicts residency from its own decisions; no kvstore) serve the trace; the worker processes are replaced
//! between strategies so that no strategy inherits another's cache. Reported: mean and p99 time to first token
//! (streamed), the prefix hit rate (cached / prompt tokens from the API's `usage`), completed requests and
//! generated tokens per second, and the router's decision latency (`pagoda_router_placement_decision_seconds`).
//!
//! **With `--lora-adapters N`** the trace is multi-LoRA: conversation `c` chats with adapter `lora-{c mod N}`, one of
//! N SYNTHETIC adapters (random weights, `--lora-rank`) written into a temporary directory that every worker loads
//! from on demand (`--lora-dir`, `--lora-on-demand`) with `--max-loras` slots. Reported besides: the adapter loads
//! and evictions of each strategy's workers (the router's mirror of their `Stats`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use pagoda_e2e::cluster::die_with_parent;
use pagoda_e2e::load::{self, Outcome};
use pagoda_e2e::{Http, Proc, free_port};
use plotters::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};

use crate::bench_plot::{FONT, register_font};

/// What to run.
#[derive(Debug, Clone, Serialize)]
pub struct RoutingBenchOptions {
    pub model: PathBuf,
    pub workers: usize,
    pub worker_threads: usize,
    pub strategies: Vec<String>,
    pub system_prompts: usize,
    pub conversations: usize,
    pub turns: usize,
    pub max_tokens: u32,
    /// Each worker's KV pool in tokens (`pagoda worker --kv-cache-tokens`; 0: the worker's default, two full
    /// contexts). Small pools put the workers under the memory pressure real deployments run in.
    pub worker_kv_tokens: usize,
    /// Each worker's host-RAM tier (`--host-tier-mib`; `None`: the worker's default).
    pub worker_host_tier_mib: Option<u64>,
    /// Conversation `c` starts `c ×` this many milliseconds into the run.
    pub conversation_gap_ms: u64,
    pub seed: u64,
    /// Every request must end within this; one that does not fails the run.
    pub deadline_secs: u64,
    /// Multi-LoRA trace: adapters the conversations spread over (0: every conversation asks the base model).
    pub lora_adapters: usize,
    pub lora_rank: usize,
    /// Each worker's adapter slots (`--max-loras`).
    pub max_loras: usize,
}

/// One strategy's figures.
#[derive(Debug, Clone, Serialize)]
pub struct StrategyResult {
    pub strategy: String,
    pub requests: usize,
    pub failed: usize,
    pub mean_ttft_s: f64,
    pub p50_ttft_s: f64,
    pub p99_ttft_s: f64,
    /// Cached prompt tokens / prompt tokens over the whole trace.
    pub prefix_hit_rate: f64,
    pub requests_per_s: f64,
    pub completion_tokens_per_s: f64,
    pub wall_s: f64,
    pub decision_mean_us: f64,
    /// Upper bound of the histogram bucket holding the 99th percentile.
    pub decision_p99_us: f64,
    /// Requests placed on each worker, in worker order.
    pub per_worker: Vec<u64>,
    /// Adapters the workers loaded on demand, and those they evicted to do so (multi-LoRA traces; else 0).
    pub lora_loads: u64,
    pub lora_evictions: u64,
    /// Mean wall time of one of those loads (0 without loads).
    pub lora_load_mean_s: f64,
    /// Prompt blocks the workers pulled from each other (peer hints), read from their `Stats` at the end.
    pub peer_pulled_blocks: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RoutingReport {
    pub options: RoutingBenchOptions,
    pub prompt_tokens_mean: f64,
    pub results: Vec<StrategyResult>,
}

const WORDS: [&str; 48] = [
    "account", "answer", "balance", "budget", "change", "client", "design", "detail", "energy", "estimate", "feature",
    "garden", "history", "island", "journey", "kitchen", "language", "library", "machine", "market", "method",
    "morning", "network", "number", "office", "order", "picture", "planet", "policy", "problem", "process", "question",
    "record", "report", "river", "science", "season", "signal", "station", "story", "system", "teacher", "theory",
    "travel", "village", "weather", "window", "winter",
];

fn sentence(rng: &mut StdRng, words: usize) -> String {
    let mut s = String::new();
    for i in 0..words {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

/// The system prompts and every conversation's user turns.
pub fn trace(o: &RoutingBenchOptions) -> (Vec<String>, Vec<Vec<String>>) {
    let mut rng = StdRng::seed_from_u64(o.seed);
    let systems = (0..o.system_prompts.max(1))
        .map(|i| {
            let mut s = format!("You are assistant number {i} of the help desk. Follow these house rules.");
            for r in 0..12 {
                let words = rng.random_range(12..20);
                s.push_str(&format!(" Rule {}: {}.", r + 1, sentence(&mut rng, words)));
            }
            s
        })
        .collect();
    let users = (0..o.conversations)
        .map(|_| {
            (0..o.turns)
                .map(|_| {
                    let words = rng.random_range(12..=60);
                    format!("Please explain {}?", sentence(&mut rng, words))
                })
                .collect()
        })
        .collect();
    (systems, users)
}

struct Turn {
    ttft: Duration,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
    reply: String,
}

/// One streamed chat request through the load generator's client: the reply text, TTFT and usage.
async fn chat(http: &Http, model: &str, messages: &[Value], max_tokens: u32) -> Result<Turn> {
    let body = json!({
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": true, "stream_options": {"include_usage": true},
    });
    let rec = load::chat_once(http, &body, true).await;
    if rec.outcome != Outcome::Completed {
        bail!("{:?}: {}", rec.outcome, rec.error.unwrap_or_default());
    }
    Ok(Turn {
        ttft: rec.ttft.unwrap_or(rec.ended_at),
        prompt_tokens: rec.prompt_tokens.unwrap_or(0),
        cached_tokens: rec.cached_tokens.unwrap_or(0),
        completion_tokens: rec.completion_tokens.unwrap_or(0),
        reply: rec.text,
    })
}

/// Worker and router processes on loopback; dropping it kills them.
pub(crate) struct Deployment {
    _workers: Vec<Proc>,
    _router: Proc,
    pub(crate) http: Http,
    pub(crate) worker_addrs: Vec<String>,
}

/// Starts one `pagoda worker` per entry of `worker_args` (that worker's arguments besides its address, model and
/// threads) and one `pagoda router` over them with `router_args` added; `label` names their logs.
pub(crate) fn deploy_cluster(
    label: &str,
    model: &Path,
    threads: usize,
    worker_args: &[Vec<String>],
    router_args: &[String],
) -> Result<Deployment> {
    let bin = std::env::current_exe().context("the pagoda binary")?;
    let model = model.to_string_lossy().into_owned();
    let threads = threads.to_string();
    let mut workers = Vec::new();
    let mut addrs = Vec::new();
    for (i, extra) in worker_args.iter().enumerate() {
        let addr = format!("127.0.0.1:{}", free_port()?);
        let mut args = vec!["worker", "--listen", &addr, "--model", &model, "--threads", &threads];
        args.extend(extra.iter().map(String::as_str));
        workers.push(Proc::spawn_with(&bin, &format!("{label}-worker{i}"), &args, die_with_parent)?);
        addrs.push(addr);
    }
    for w in &mut workers {
        w.wait_line("pagoda worker listening on ", Duration::from_secs(120))?;
    }
    let mut args = vec!["router", "--listen", "127.0.0.1:0", "--model", &model];
    for a in &addrs {
        args.extend(["--worker", a.as_str()]);
    }
    args.extend(router_args.iter().map(String::as_str));
    let mut router = Proc::spawn_with(&bin, &format!("{label}-router"), &args, die_with_parent)?;
    let base = router.wait_line("pagoda router listening on ", Duration::from_secs(60))?;
    Ok(Deployment { _workers: workers, _router: router, http: Http::new(base), worker_addrs: addrs })
}

fn deploy(o: &RoutingBenchOptions, strategy: &str, lora_dir: Option<&Path>) -> Result<Deployment> {
    let mut worker = Vec::new();
    if let Some(dir) = lora_dir {
        worker.extend(["--lora-dir".to_string(), dir.display().to_string(), "--lora-on-demand".to_string()]);
        worker.extend(["--max-loras".to_string(), o.max_loras.to_string()]);
    }
    if o.worker_kv_tokens > 0 {
        worker.extend(["--kv-cache-tokens".to_string(), o.worker_kv_tokens.to_string()]);
    }
    if let Some(mib) = o.worker_host_tier_mib {
        worker.extend(["--host-tier-mib".to_string(), mib.to_string()]);
    }
    let router = ["--placement".to_string(), strategy.to_string()];
    deploy_cluster(&format!("routing-{strategy}"), &o.model, o.worker_threads, &vec![worker; o.workers], &router)
}

/// Waits until the router reports every worker ready.
pub(crate) async fn wait_all_ready(d: &Deployment) -> Result<()> {
    let t0 = Instant::now();
    for addr in &d.worker_addrs {
        while d.http.worker_ready(addr).await != Some(true) {
            if t0.elapsed() > Duration::from_secs(60) {
                bail!("the router did not see worker {addr} ready within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// Mean and p99 (bucket upper bound) of `pagoda_router_placement_decision_seconds`, in µs, and placements per
/// worker, from the router's metrics.
fn decision_latency(metrics: &str, workers: &[String]) -> (f64, f64, Vec<u64>) {
    let value = |l: &str| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let family = "pagoda_router_placement_decision_seconds";
    let sum = metrics.lines().find(|l| l.starts_with(&format!("{family}_sum"))).map_or(0.0, value);
    let count = metrics.lines().find(|l| l.starts_with(&format!("{family}_count"))).map_or(0.0, value);
    let mut buckets: Vec<(f64, f64)> = metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{family}_bucket")))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, value(l)))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let p99 = buckets.iter().find(|(_, c)| *c >= 0.99 * count).map_or(0.0, |(le, _)| *le);
    let per_worker = workers
        .iter()
        .map(|w| {
            metrics
                .lines()
                .filter(|l| l.starts_with("pagoda_router_placements_total{") && l.contains(&format!("worker=\"{w}\"")))
                .map(|l| value(l) as u64)
                .sum()
        })
        .collect();
    let mean = if count > 0.0 { sum / count * 1e6 } else { 0.0 };
    (mean, p99 * 1e6, per_worker)
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// The model conversation `c` asks: its adapter in a multi-LoRA trace, else the base model.
fn conversation_model(o: &RoutingBenchOptions, base: &str, c: usize) -> String {
    if o.lora_adapters > 0 { format!("lora-{}", c % o.lora_adapters) } else { base.to_string() }
}

/// Writes the multi-LoRA trace's SYNTHETIC adapters (`lora-0` …) into a fresh directory.
fn write_adapters(o: &RoutingBenchOptions) -> Result<PathBuf> {
    use pagoda_worker::model::{Gguf, ModelConfig, SyntheticLora};
    let dir = std::env::temp_dir().join(format!("pagoda-bench-routing-lora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let gguf = Gguf::open(&o.model).with_context(|| format!("opening {}", o.model.display()))?;
    let cfg = ModelConfig::from_gguf(&gguf).context("reading the model's shape")?;
    for i in 0..o.lora_adapters {
        let spec = SyntheticLora { rank: o.lora_rank, seed: 100 + i as u64, ..SyntheticLora::default() };
        pagoda_worker::model::lora::write_synthetic_peft(&dir.join(format!("lora-{i}")), &cfg, &spec)
            .context("writing a synthetic adapter")?;
    }
    Ok(dir)
}

/// The sum over `workers` of the router's gauge `family` (one line per worker).
fn worker_gauge_sum(metrics: &str, family: &str, workers: &[String]) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{family}{{")) && workers.iter().any(|w| l.contains(&format!("\"{w}\""))))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn run_strategy(
    o: &RoutingBenchOptions,
    strategy: &str,
    lora_dir: Option<&Path>,
) -> Result<(StrategyResult, Vec<u64>)> {
    let d = deploy(o, strategy, lora_dir)?;
    wait_all_ready(&d).await?;
    let (_, models) = d.http.get("/v1/models").await?;
    let model_id = serde_json::from_str::<Value>(&models)?["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| anyhow!("no model in /v1/models: {models}"))?;
    let http = d.http.clone().with_model(model_id);
    let (systems, users) = trace(o);
    let deadline = Duration::from_secs(o.deadline_secs);
    let t0 = Instant::now();
    let tasks = users.into_iter().enumerate().map(|(c, turns)| {
        let (http, system) = (http.clone(), systems[c % systems.len()].clone());
        let model = conversation_model(o, &http.model, c);
        let max_tokens = o.max_tokens;
        async move {
            tokio::time::sleep(Duration::from_millis(o.conversation_gap_ms * c as u64)).await;
            let mut messages = vec![json!({"role": "system", "content": system})];
            let mut out = Vec::new();
            for user in turns {
                messages.push(json!({"role": "user", "content": user}));
                let turn = tokio::time::timeout(deadline, chat(&http, &model, &messages, max_tokens))
                    .await
                    .map_err(|_| anyhow!("no answer within {deadline:?}"))
                    .and_then(|r| r);
                match turn {
                    Ok(t) => {
                        messages.push(json!({"role": "assistant", "content": t.reply.clone()}));
                        out.push(Ok(t));
                    }
                    Err(e) => {
                        out.push(Err(e));
                        break;
                    }
                }
            }
            out
        }
    });
    let results: Vec<Result<Turn>> = futures::future::join_all(tasks).await.into_iter().flatten().collect();
    let wall = t0.elapsed().as_secs_f64();
    let (_, metrics) = d.http.get("/metrics").await?;
    let (decision_mean_us, decision_p99_us, per_worker) = decision_latency(&metrics, &d.worker_addrs);
    let lora_loads = worker_gauge_sum(&metrics, "pagoda_router_worker_lora_on_demand_loads", &d.worker_addrs) as u64;
    let lora_evictions = worker_gauge_sum(&metrics, "pagoda_router_worker_lora_evictions", &d.worker_addrs) as u64;
    // Every run-time load in this deployment is an on-demand one.
    let lora_load_s = worker_gauge_sum(&metrics, "pagoda_router_worker_lora_load_seconds", &d.worker_addrs);
    let lora_load_mean_s = if lora_loads > 0 { lora_load_s / lora_loads as f64 } else { 0.0 };
    let mut peer_pulled_blocks = 0;
    for addr in &d.worker_addrs {
        let stats = pagoda_e2e::worker_stats(addr).await.with_context(|| format!("stats of worker {addr}"))?;
        peer_pulled_blocks += stats.peer_fetched_blocks_total;
    }
    drop(d);
    let failed = results.iter().filter(|r| r.is_err()).count();
    if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
        tracing::warn!(strategy, error = %e, failed, "requests failed");
    }
    let ok: Vec<&Turn> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let mut ttfts: Vec<f64> = ok.iter().map(|t| t.ttft.as_secs_f64()).collect();
    ttfts.sort_by(f64::total_cmp);
    let prompt: u64 = ok.iter().map(|t| t.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|t| t.cached_tokens).sum();
    let generated: u64 = ok.iter().map(|t| t.completion_tokens).sum();
    let prompt_lens = ok.iter().map(|t| t.prompt_tokens).collect();
    Ok((
        StrategyResult {
            strategy: strategy.to_string(),
            requests: results.len(),
            failed,
            mean_ttft_s: ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64,
            p50_ttft_s: percentile(&ttfts, 0.5),
            p99_ttft_s: percentile(&ttfts, 0.99),
            prefix_hit_rate: if prompt > 0 { cached as f64 / prompt as f64 } else { 0.0 },
            requests_per_s: ok.len() as f64 / wall,
            completion_tokens_per_s: generated as f64 / wall,
            wall_s: wall,
            decision_mean_us,
            decision_p99_us,
            per_worker,
            lora_loads,
            lora_evictions,
            lora_load_mean_s,
            peer_pulled_blocks,
        },
        prompt_lens,
    ))
}

/// Runs every strategy in turn.
pub async fn run(o: RoutingBenchOptions) -> Result<RoutingReport> {
    if o.workers == 0 || o.conversations == 0 || o.turns == 0 || o.strategies.is_empty() {
        bail!("--workers, --conversations, --turns and --strategies must all be non-empty");
    }
    if o.lora_adapters > 0 && !(1..=pagoda_worker::model::lora::MAX_LORA_RANK).contains(&o.lora_rank) {
        bail!("--lora-rank must be in 1..={}", pagoda_worker::model::lora::MAX_LORA_RANK);
    }
    let lora_dir = if o.lora_adapters > 0 { Some(write_adapters(&o)?) } else { None };
    let mut results = Vec::new();
    // The trace is the same for every strategy; its mean prompt is taken from the first one's answers.
    let mut prompt_tokens_mean = None;
    for s in &o.strategies {
        tracing::info!(strategy = %s, "routing bench: running");
        let ran = run_strategy(&o, s, lora_dir.as_deref()).await.with_context(|| format!("strategy {s}"));
        let (r, lens) = match ran {
            Ok(r) => r,
            Err(e) => {
                if let Some(dir) = &lora_dir {
                    let _ = std::fs::remove_dir_all(dir);
                }
                return Err(e);
            }
        };
        prompt_tokens_mean.get_or_insert(lens.iter().sum::<u64>() as f64 / lens.len().max(1) as f64);
        results.push(r);
    }
    if let Some(dir) = &lora_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    let prompt_tokens_mean = prompt_tokens_mean.unwrap_or(0.0);
    Ok(RoutingReport { options: o, prompt_tokens_mean, results })
}

impl RoutingReport {
    /// A markdown table, with each strategy's mean TTFT relative to round robin's where there is one.
    pub fn markdown(&self) -> String {
        let mean_of = |name: &str| self.results.iter().find(|r| r.strategy == name).map(|r| r.mean_ttft_s);
        let (rr, overlap) = (mean_of("round_robin"), mean_of("prefix_overlap"));
        let lora = self.options.lora_adapters > 0;
        let mut s = String::from(
            "| strategy | requests | failed | mean TTFT (s) | p99 TTFT (s) | × round robin | × prefix overlap | \
             prefix hit rate | req/s | tokens/s | decision mean (µs) | decision p99 ≤ (µs) | requests per worker | \
             blocks pulled from peers |",
        );
        s.push_str(if lora { " adapter loads | evictions | mean load (ms) |\n" } else { "\n" });
        s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|");
        s.push_str(if lora { "---:|---:|---:|\n" } else { "\n" });
        for r in &self.results {
            let ratio = |base: Option<f64>| {
                base.filter(|_| r.mean_ttft_s > 0.0).map_or("—".to_string(), |b| format!("{:.2}", b / r.mean_ttft_s))
            };
            s.push_str(&format!(
                "| {} | {} | {} | {:.3} | {:.3} | {} | {} | {:.1}% | {:.2} | {:.1} | {:.1} | {:.0} | {:?} | {} |",
                r.strategy,
                r.requests,
                r.failed,
                r.mean_ttft_s,
                r.p99_ttft_s,
                ratio(rr),
                ratio(overlap),
                r.prefix_hit_rate * 100.0,
                r.requests_per_s,
                r.completion_tokens_per_s,
                r.decision_mean_us,
                r.decision_p99_us,
                r.per_worker,
                r.peer_pulled_blocks
            ));
            if lora {
                s.push_str(&format!(" {} | {} | {:.1} |", r.lora_loads, r.lora_evictions, r.lora_load_mean_s * 1e3));
            }
            s.push('\n');
        }
        s
    }

    /// Bars of mean and p99 TTFT, and of the prefix hit rate, per strategy.
    pub fn draw(&self, path: &Path) -> Result<()> {
        register_font()?;
        let width = if self.options.lora_adapters > 0 { 1700 } else { 1200 };
        let root = BitMapBackend::new(path, (width, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        let o = &self.options;
        let mut title = format!(
            "Routing: {} conversations x {} turns on {} workers ({} system prompt(s), mean prompt {:.0} tokens)",
            o.conversations, o.turns, o.workers, o.system_prompts, self.prompt_tokens_mean
        );
        if o.lora_adapters > 0 {
            title.push_str(&format!(
                "; {} SYNTHETIC rank-{} LoRA adapters loaded on demand, {} slot(s) per worker",
                o.lora_adapters, o.lora_rank, o.max_loras
            ));
        }
        let root = root.titled(&title, (FONT, 20)).map_err(|e| anyhow!("{e}"))?;
        let lora = o.lora_adapters > 0;
        let panels = root.split_evenly((1, if lora { 3 } else { 2 }));
        let n = self.results.len();
        let names: Vec<String> = self.results.iter().map(|r| r.strategy.clone()).collect();
        let ttft_top = self.results.iter().map(|r| r.p99_ttft_s).fold(0.0, f64::max).max(0.01) * 1.15;
        let loads_top = self.results.iter().map(|r| r.lora_loads as f64).fold(0.0, f64::max).max(1.0) * 1.15;
        // Per panel: caption, y top, and its bars as (colour, value).
        type Bar = (RGBColor, fn(&StrategyResult) -> f64);
        let (blue, orange, green) = (RGBColor(31, 119, 180), RGBColor(255, 127, 14), RGBColor(44, 160, 44));
        let mut series: Vec<(&str, f64, Vec<Bar>)> = vec![
            (
                "Time to first token (s): mean (blue), p99 (orange)",
                ttft_top,
                vec![(blue, |r| r.mean_ttft_s), (orange, |r| r.p99_ttft_s)],
            ),
            ("Prefix hit rate (%)", 100.0, vec![(green, |r| r.prefix_hit_rate * 100.0)]),
        ];
        if lora {
            series.push((
                "LoRA adapter loads (blue), evictions (orange)",
                loads_top,
                vec![(blue, |r| r.lora_loads as f64), (orange, |r| r.lora_evictions as f64)],
            ));
        }
        for (p, (caption, top, bars)) in series.iter().enumerate() {
            let mut chart = ChartBuilder::on(&panels[p])
                .caption(*caption, (FONT, 18))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(56)
                .build_cartesian_2d(-0.5..n as f64 - 0.5, 0.0..*top)
                .map_err(|e| anyhow!("{e}"))?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(2 * n + 1)
                .x_label_formatter(&|x| {
                    let i = x.round();
                    if (x - i).abs() < 1e-6 && i >= 0.0 {
                        names.get(i as usize).cloned().unwrap_or_default()
                    } else {
                        String::new()
                    }
                })
                .label_style((FONT, 13))
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
            let width = if bars.len() == 1 { 0.6 } else { 0.38 };
            for (b, (color, value)) in bars.iter().enumerate() {
                let offset = if bars.len() == 1 { -0.3 } else { 0.4 * b as f64 - 0.39 };
                chart
                    .draw_series(self.results.iter().enumerate().map(|(i, r)| {
                        let x0 = i as f64 + offset;
                        Rectangle::new([(x0, 0.0), (x0 + width, value(r))], color.filled())
                    }))
                    .map_err(|e| anyhow!("{e}"))?;
            }
        }
        root.present().with_context(|| format!("cannot write {}", path.display()))?;
        Ok(())
    }
}
