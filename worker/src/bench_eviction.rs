//! Throughput under memory pressure (`pagoda bench eviction`): whether KV eviction lets the engine run more
//! sequences at once, and what that buys in generated tokens per second, on a pool too small for the load.
//!
//! This module owns the workload, the measurement and the report (markdown and JSON); the CLI draws the chart.
//!
//! - **Pool**: sized for exactly `pool_seqs` full-cache sequences of `prompt_tokens + new_tokens` tokens
//!   (defaults 8 × (1,024 + 512)), so that full cache can never hold more than `pool_seqs` finished sequences.
//! - **Load**: `requests` (64) such requests submitted at once, then collected concurrently; the engine thread
//!   batches them. Each request generates exactly `new_tokens` (greedy, no stop tokens, EOS ignored through
//!   [`GenerateRequest::ignore_eos`]) so that every configuration does the same work.
//! - **Prompts**: deterministic, distinct English-like text: seeded sentences over the embedded word lists of the
//!   eval harness, tokenized with the model's tokenizer and cut to `prompt_tokens`. Real text rather than random
//!   ids so that attention-based policies see attention patterns that resemble language.
//! - **Configurations**: full cache once, then every non-full policy at every budget. Each runs on a fresh engine
//!   with the prefix cache off, so no configuration benefits from another's cached blocks.
//!
//! Per configuration: generated tokens/s (all generated tokens over the wall time from the first submit to the
//! last finish), the largest running batch and the peak pool usage (high-water marks kept by the engine itself,
//! see [`EngineStats::peak_running`]), the mean batch over the run's steps, TTFT and TPOT medians and p99
//! (nearest rank), preemptions, tokens computed (recomputation after preemption shows here) and evicted blocks,
//! plus tokens/s and largest batch relative to full cache. With `repeats > 1` every configuration runs that many times, round-robin, and the report keeps its
//! median run: on a shared machine a single run can be off by a third.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Serialize, Serializer};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::cache::CacheLayout;
use crate::engine::{
    Device, Engine, EngineConfig, EngineError, EngineHandle, EngineStats, GenerateEvent, GenerateRequest,
    SamplingParams,
};
use crate::eval::words::{ADJECTIVES, NOUNS, VERBS};
use crate::model::{Gguf, ModelConfig, Tokenizer};
use crate::policy::{PolicyKind, PolicySpec, defaults};
use crate::scheduler::ReserveConfig;
use pagoda_kernels::KvDtype;

/// Why the benchmark could not produce a report.
#[derive(Debug, thiserror::Error)]
pub enum EvictionBenchError {
    #[error("invalid benchmark options: {0}")]
    Options(String),
    #[error("cannot read the model: {0}")]
    Model(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("cannot start the collector runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("configuration {config}: {failed} of {requests} requests failed (first error: {first})")]
    RequestsFailed { config: String, failed: usize, requests: usize, first: String },
}

#[derive(Debug, Clone, Serialize)]
pub struct EvictionBenchOptions {
    /// CPU threads for the backend (0 = all cores).
    pub threads: usize,
    pub block_size: usize,
    /// Engine step budget (chunked prefill + decode).
    pub max_step_tokens: usize,
    /// Engine cap on running sequences; high enough that the pool, not this cap, limits full cache.
    pub max_running: usize,
    pub requests: usize,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// Full-cache sequences (`prompt_tokens + new_tokens`) the pool holds.
    pub pool_seqs: usize,
    /// Policies to run; `full` runs once as the baseline, every other at every budget.
    #[serde(serialize_with = "policy_names")]
    pub policies: Vec<PolicyKind>,
    /// KV budgets in tokens per (layer, kv-head).
    pub budgets: Vec<usize>,
    pub seed: u64,
    /// Runs of every configuration; the report keeps each one's median run by tokens/s.
    pub repeats: usize,
    /// Admit with the scheduler's growth reserve (`true`, the engine default) or greedily.
    pub admission_reserve: bool,
    /// Element type of the device KV cache. The pool gets the bytes of `pool_seqs` f16 full-cache sequences
    /// whatever the dtype, so a smaller dtype shows as more blocks in the same memory.
    #[serde(serialize_with = "dtype_name")]
    pub kv_dtype: KvDtype,
    /// The runner: the CPU backend, or a GPU (binaries built with `--features cuda`), where decode at these batch
    /// sizes is bound by memory and throughput follows the batch.
    #[serde(serialize_with = "device_name")]
    pub device: Device,
}

fn device_name<S: Serializer>(d: &Device, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(d)
}

fn dtype_name<S: Serializer>(d: &KvDtype, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

impl Default for EvictionBenchOptions {
    fn default() -> EvictionBenchOptions {
        EvictionBenchOptions {
            threads: 0,
            block_size: 16,
            max_step_tokens: 512,
            max_running: 64,
            requests: 64,
            prompt_tokens: 1024,
            new_tokens: 512,
            pool_seqs: 8,
            policies: PolicyKind::ALL.to_vec(),
            budgets: vec![256, 512, 1024],
            seed: 1234,
            repeats: 1,
            admission_reserve: true,
            kv_dtype: KvDtype::F16,
            device: Device::Cpu,
        }
    }
}

fn policy_names<S: Serializer>(p: &[PolicyKind], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(p.iter().map(|k| k.name()))
}

/// One configuration's measurements.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigResult {
    /// Policy name (`full`, `snapkv`, ...).
    pub policy: String,
    /// KV budget in tokens per (layer, kv-head); `None` for full cache.
    pub budget_tokens: Option<usize>,
    pub requests: usize,
    /// Requests that finished (none failed, or the run would have stopped).
    pub completed: usize,
    /// Requests that generated fewer than `new_tokens` tokens (0 unless something stopped them early).
    pub short_requests: usize,
    /// Token events received over all requests.
    pub generated_tokens: u64,
    /// First submit to last finish.
    pub seconds: f64,
    /// Of the median run when repeated.
    pub tokens_per_s: f64,
    /// Every repeat's tokens/s, in run order.
    pub tokens_per_s_runs: Vec<f64>,
    /// Tokens the engine computed (prompts, generated tokens, and recomputation after preemption): above
    /// `requests * (prompt_tokens + new_tokens - 1)` only by what preemption made it redo.
    pub computed_tokens: u64,
    /// Largest running batch the engine scheduled.
    pub peak_running: u64,
    /// Forward steps the engine ran for the requests, and the sequences a step computed on average: the batch
    /// the tokens/s follows, where `peak_running` is only its high-water mark.
    pub steps: u64,
    pub mean_batch: f64,
    pub ttft_ms_p50: f64,
    pub ttft_ms_p99: f64,
    pub tpot_ms_p50: f64,
    pub tpot_ms_p99: f64,
    pub blocks_total: u64,
    pub peak_blocks_used: u64,
    /// `peak_blocks_used / blocks_total`.
    pub peak_pool_frac: f64,
    pub preemptions: u64,
    pub evicted_blocks: u64,
    pub evicted_slots: u64,
    /// `tokens_per_s` over full cache's (when full cache ran).
    pub tokens_per_s_vs_full: Option<f64>,
    /// `peak_running` over full cache's (when full cache ran).
    pub concurrency_vs_full: Option<f64>,
}

impl ConfigResult {
    /// `full` or `policy@budget`.
    pub fn label(&self) -> String {
        match self.budget_tokens {
            Some(b) => format!("{}@{b}", self.policy),
            None => self.policy.clone(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct EvictionReport {
    pub model: String,
    pub model_path: String,
    pub backend: String,
    pub threads: usize,
    /// Blocks in one block group (layers × kv-heads); a group holds `block_size` tokens of every table.
    pub group_blocks: usize,
    pub kv_blocks: usize,
    pub prompt_source: String,
    pub results: Vec<ConfigResult>,
    /// `VmHWM` of this process, bytes (0 where /proc is unavailable).
    pub peak_rss_bytes: u64,
    pub options: EvictionBenchOptions,
}

impl EvictionReport {
    /// The baseline, when full cache ran.
    pub fn full(&self) -> Option<&ConfigResult> {
        self.results.iter().find(|r| r.budget_tokens.is_none())
    }

    /// A header line with the setup, then one table row per configuration.
    pub fn to_markdown(&self) -> String {
        let o = &self.options;
        let mut s = format!(
            "Eviction bench: `{}` on {} ({} threads); pool {} {} KV blocks = the memory of {} f16 full-cache \
             sequences of {} + {} tokens; {} requests at once; max_step_tokens {}, max_running {}\n\n",
            self.model,
            self.backend,
            self.threads,
            self.kv_blocks,
            o.kv_dtype,
            o.pool_seqs,
            o.prompt_tokens,
            o.new_tokens,
            o.requests,
            o.max_step_tokens,
            o.max_running,
        );
        if o.repeats > 1 {
            s.push_str(&format!(
                "Each configuration ran {} times, round-robin; each row is its median run by tokens/s, and \
                 `tokens/s range` spans all its runs.\n\n",
                o.repeats
            ));
        }
        s.push_str(
            "| policy | budget | tokens/s | tokens/s range | × full | largest batch | × full | mean batch | TTFT p50 (s) | \
             TTFT p99 (s) | TPOT p50 (ms) | TPOT p99 (ms) | peak pool | preemptions | computed tokens | \
             evicted blocks | generated |\n",
        );
        s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        let range = |v: &[f64]| {
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            if v.is_empty() { "—".to_owned() } else { format!("{lo:.1}–{hi:.1}") }
        };
        let ratio = |r: Option<f64>| r.map_or_else(|| "—".to_owned(), |v| format!("{v:.2}"));
        for r in &self.results {
            s.push_str(&format!(
                "| {} | {} | {:.1} | {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0}% | {} | {} | {} | {}/{} |\n",
                r.policy,
                r.budget_tokens.map_or_else(|| "—".to_owned(), |b| b.to_string()),
                r.tokens_per_s,
                range(&r.tokens_per_s_runs),
                ratio(r.tokens_per_s_vs_full),
                r.peak_running,
                ratio(r.concurrency_vs_full),
                r.mean_batch,
                r.ttft_ms_p50 / 1e3,
                r.ttft_ms_p99 / 1e3,
                r.tpot_ms_p50,
                r.tpot_ms_p99,
                r.peak_pool_frac * 100.0,
                r.preemptions,
                r.computed_tokens,
                r.evicted_blocks,
                r.generated_tokens,
                r.requests * o.new_tokens,
            ));
        }
        s.push_str(&format!("\nPeak RSS (VmHWM): {:.1} MiB\n", self.peak_rss_bytes as f64 / (1024.0 * 1024.0)));
        s
    }

    pub fn to_json_string(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// The configurations to run, baseline first: full cache (if listed), then each other policy at each budget.
pub fn configurations(opts: &EvictionBenchOptions) -> Vec<PolicySpec> {
    let mut out = Vec::new();
    if opts.policies.contains(&PolicyKind::Full) {
        out.push(PolicySpec::full());
    }
    for &kind in &opts.policies {
        if kind == PolicyKind::Full || out.iter().any(|s: &PolicySpec| s.kind == kind) {
            continue;
        }
        for &budget_tokens in &opts.budgets {
            out.push(PolicySpec { kind, budget_tokens });
        }
    }
    out
}

/// Runs every configuration on the GGUF at `model_path`. Progress goes to `tracing` at info level.
pub fn eviction_bench(
    model_path: impl AsRef<Path>,
    opts: &EvictionBenchOptions,
) -> Result<EvictionReport, EvictionBenchError> {
    let model_path = model_path.as_ref();
    validate(opts)?;
    let model_err = |e: crate::model::ModelError| EvictionBenchError::Model(e.to_string());
    let gguf = Gguf::open(model_path).map_err(model_err)?;
    let mc = ModelConfig::from_gguf(&gguf).map_err(model_err)?;
    let tokenizer = Tokenizer::from_gguf(&gguf).map_err(model_err)?;
    drop(gguf);
    if opts.prompt_tokens + opts.new_tokens > mc.ctx_len {
        return Err(EvictionBenchError::Options(format!(
            "prompt_tokens + new_tokens = {} exceeds the model context length {}",
            opts.prompt_tokens + opts.new_tokens,
            mc.ctx_len
        )));
    }
    if let Some(&b) = opts.budgets.iter().find(|&&b| !(defaults::MIN_BUDGET_TOKENS..=mc.ctx_len).contains(&b)) {
        return Err(EvictionBenchError::Options(format!(
            "budget {b} is outside {}..={}",
            defaults::MIN_BUDGET_TOKENS,
            mc.ctx_len
        )));
    }
    let layout = CacheLayout { n_layers: mc.n_layers, n_kv_heads: mc.n_kv_heads, block_size: opts.block_size };
    let f16_blocks = layout.blocks_for_tokens(opts.prompt_tokens + opts.new_tokens) * opts.pool_seqs;
    // The same bytes in the bench's dtype, in whole block groups.
    let (f16_slot, slot) = (KvDtype::F16.slot_bytes(mc.head_dim), opts.kv_dtype.slot_bytes(mc.head_dim));
    let kv_blocks = f16_blocks * f16_slot / slot / layout.group_size() * layout.group_size();
    let prompts = make_prompts(&tokenizer, opts.requests, opts.prompt_tokens, opts.seed)?;
    let rt = tokio::runtime::Builder::new_current_thread().build().map_err(EvictionBenchError::Runtime)?;

    let configs = configurations(opts);
    // runs[c] holds configuration c's repeats. Rounds go over every configuration in turn so that a slow spell
    // of a shared machine lands on all of them rather than on one.
    let mut runs: Vec<Vec<ConfigResult>> = vec![Vec::new(); configs.len()];
    let mut model_name = String::new();
    for round in 0..opts.repeats {
        for (c, &spec) in configs.iter().enumerate() {
            let r = run_fresh(model_path, kv_blocks, &rt, spec, &prompts, opts, round)?;
            model_name.clone_from(&r.0);
            runs[c].push(r.1);
        }
    }
    let mut results: Vec<ConfigResult> = runs.into_iter().filter_map(median_run).collect();
    let (full_tps, full_peak) = results
        .iter()
        .find(|r| r.budget_tokens.is_none())
        .map_or((None, None), |f| (Some(f.tokens_per_s), Some(f.peak_running as f64)));
    for r in &mut results {
        r.tokens_per_s_vs_full = full_tps.filter(|&f| f > 0.0).map(|f| r.tokens_per_s / f);
        r.concurrency_vs_full = full_peak.filter(|&f| f > 0.0).map(|f| r.peak_running as f64 / f);
    }
    Ok(EvictionReport {
        model: model_name,
        model_path: model_path.display().to_string(),
        backend: opts.device.to_string(),
        // The GPU runner computes on the device; host threads only matter to the CPU backend.
        threads: if opts.device == crate::engine::Device::Cpu {
            crate::engine::resolve_threads(opts.threads)
        } else {
            0
        },
        group_blocks: layout.group_size(),
        kv_blocks,
        prompt_source: "seeded English sentences over the eval word lists, tokenized, cut to prompt_tokens".into(),
        results,
        peak_rss_bytes: crate::bench::peak_rss_bytes(),
        options: opts.clone(),
    })
}

/// One run of one configuration on a fresh engine. Returns the model's name and the measurements.
fn run_fresh(
    model_path: &Path,
    kv_blocks: usize,
    rt: &tokio::runtime::Runtime,
    spec: PolicySpec,
    prompts: &[Vec<u32>],
    opts: &EvictionBenchOptions,
    round: usize,
) -> Result<(String, ConfigResult), EvictionBenchError> {
    let cfg = EngineConfig {
        model_path: model_path.to_path_buf(),
        num_blocks: kv_blocks,
        kv_cache_tokens: 0,
        block_size: opts.block_size,
        max_step_tokens: opts.max_step_tokens,
        max_running: opts.max_running,
        enable_prefix_cache: false,
        threads: opts.threads,
        default_policy: PolicySpec::full(),
        reserve: if opts.admission_reserve { ReserveConfig::default() } else { ReserveConfig::off() },
        tiers: crate::tiers::TierConfig::default(),
        kv_dtype: opts.kv_dtype,
        placement: Default::default(),
        kivi_residual_tokens: 0,
        kivi_int8_layers: Vec::new(),
        bf16_matmuls: false,
        // No tier encodes here: the calibration would only lengthen each start.
        fp8_keys_for_queries: false,
        synthetic: None,
        device: opts.device,
        speculative: crate::speculative::NgramConfig::off(),
        scheduling: crate::scheduler::SchedulingPolicy::Fcfs,
        lora: Vec::new(),
        max_lora_rank: 64,
        lora_dir: None,
        max_loras: 16,
        lora_on_demand: false,
    };
    let engine = Engine::start(cfg)?;
    let name = engine.model_info().name.clone();
    let label = if spec.is_full() { "full".to_owned() } else { format!("{}@{}", spec.kind.name(), spec.budget_tokens) };
    tracing::info!(config = %label, round, requests = opts.requests, "eviction bench: running");
    let r = run_config(&engine, rt, spec, prompts, opts, &label);
    engine.shutdown();
    let r = r?;
    tracing::info!(
        config = %label,
        round,
        tokens_per_s = format!("{:.1}", r.tokens_per_s),
        peak_running = r.peak_running,
        seconds = format!("{:.1}", r.seconds),
        "eviction bench: done"
    );
    Ok((name, r))
}

/// The repeat with the median tokens/s (the lower middle one for an even count), whole, so that its columns
/// come from one run; every repeat's tokens/s is kept beside it.
fn median_run(mut runs: Vec<ConfigResult>) -> Option<ConfigResult> {
    let all: Vec<f64> = runs.iter().map(|r| r.tokens_per_s).collect();
    runs.sort_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s));
    let mid = runs.len().checked_sub(1)? / 2;
    let mut r = runs.swap_remove(mid);
    r.tokens_per_s_runs = all;
    Some(r)
}

fn validate(o: &EvictionBenchOptions) -> Result<(), EvictionBenchError> {
    let bad = |m: &str| Err(EvictionBenchError::Options(m.to_owned()));
    if o.repeats == 0 {
        return bad("repeats must be at least 1");
    }
    if o.requests == 0 || o.prompt_tokens == 0 || o.new_tokens == 0 || o.pool_seqs == 0 || o.block_size == 0 {
        return bad("requests, prompt_tokens, new_tokens, pool_seqs and block_size must be at least 1");
    }
    if o.block_size > pagoda_kernels::codec::MAX_BLOCK_SIZE {
        return bad("block_size must be at most 256 (the tier codecs' bound)");
    }
    if o.new_tokens > u32::MAX as usize {
        return bad("new_tokens does not fit a request's max_tokens");
    }
    if o.policies.is_empty() {
        return bad("no policy to run");
    }
    if o.policies.iter().any(|k| *k != PolicyKind::Full) && o.budgets.is_empty() {
        return bad("non-full policies need at least one budget");
    }
    Ok(())
}

/// What one request saw, with times relative to nothing in particular (differences only).
#[derive(Debug, Clone, Copy)]
struct Outcome {
    submitted: Instant,
    first_token: Option<Instant>,
    finished: Option<Instant>,
    tokens: u32,
}

fn run_config(
    engine: &EngineHandle,
    rt: &tokio::runtime::Runtime,
    spec: PolicySpec,
    prompts: &[Vec<u32>],
    opts: &EvictionBenchOptions,
    label: &str,
) -> Result<ConfigResult, EvictionBenchError> {
    let request = |i: usize, prompt: &[u32], max_tokens: usize| GenerateRequest {
        request_id: format!("bench-{i}"),
        prompt: prompt.to_vec(),
        max_tokens: max_tokens as u32,
        sampling: SamplingParams::greedy(),
        stop_token_ids: Vec::new(),
        namespace: String::new(),
        policy: (!spec.is_full()).then_some(spec),
        ignore_eos: true,
        profile_queries: Vec::new(),
        logprobs: None,
        prompt_logprobs: None,
        priority: 0,
        tenant_weight: 1,
        tier_codec: None,
        lora: None,
    };
    // Warm-up outside the clock: first-step scratch growth and page faults on the fresh KV arena's first blocks.
    let warm = prompts.first().map_or(&[][..], |p| &p[..p.len().min(32)]);
    if !warm.is_empty() {
        let rx = engine.submit(GenerateRequest { policy: None, ..request(usize::MAX, warm, 2) })?;
        let o = rt.block_on(collect(rx, Instant::now()));
        if let Err(e) = o {
            return Err(EvictionBenchError::RequestsFailed { config: label.into(), failed: 1, requests: 1, first: e });
        }
    }
    // Settled, not the latest snapshot: the warm-up's last step publishes its counters just after its Finished.
    let before = settled_stats(engine);

    let start = Instant::now();
    let mut rxs = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        rxs.push((Instant::now(), engine.submit(request(i, p, opts.new_tokens))?));
    }
    let outcomes = rt.block_on(futures::future::join_all(rxs.into_iter().map(|(t, rx)| collect(rx, t))));
    let mut done = Vec::with_capacity(outcomes.len());
    let mut errors = Vec::new();
    for o in outcomes {
        match o {
            Ok(o) => done.push(o),
            Err(e) => errors.push(e),
        }
    }
    if let Some(first) = errors.first() {
        return Err(EvictionBenchError::RequestsFailed {
            config: label.into(),
            failed: errors.len(),
            requests: prompts.len(),
            first: first.clone(),
        });
    }
    let end = done.iter().filter_map(|o| o.finished).max().unwrap_or(start);
    let seconds = end.duration_since(start).as_secs_f64();
    // Counters are published after the step that sent the last Finished: wait for that snapshot.
    let stats = settled_stats(engine);
    let steps = stats.steps_total.saturating_sub(before.steps_total);

    let generated: u64 = done.iter().map(|o| u64::from(o.tokens)).sum();
    let mut ttft: Vec<f64> =
        done.iter().filter_map(|o| o.first_token.map(|f| ms(f.duration_since(o.submitted)))).collect();
    let mut tpot: Vec<f64> = done
        .iter()
        .filter_map(|o| match (o.first_token, o.finished) {
            (Some(f), Some(e)) if o.tokens > 1 => Some(ms(e.duration_since(f)) / f64::from(o.tokens - 1)),
            _ => None,
        })
        .collect();
    ttft.sort_by(f64::total_cmp);
    tpot.sort_by(f64::total_cmp);
    let k = spec.kind.index();
    Ok(ConfigResult {
        policy: spec.kind.name().to_owned(),
        budget_tokens: (!spec.is_full()).then_some(spec.budget_tokens),
        requests: prompts.len(),
        completed: done.iter().filter(|o| o.finished.is_some()).count(),
        short_requests: done.iter().filter(|o| (o.tokens as usize) < opts.new_tokens).count(),
        generated_tokens: generated,
        seconds,
        tokens_per_s: if seconds > 0.0 { generated as f64 / seconds } else { 0.0 },
        tokens_per_s_runs: Vec::new(),
        computed_tokens: stats.computed_tokens_total.saturating_sub(before.computed_tokens_total),
        peak_running: stats.peak_running,
        steps,
        mean_batch: if steps > 0 {
            stats.step_seqs_total.saturating_sub(before.step_seqs_total) as f64 / steps as f64
        } else {
            0.0
        },
        ttft_ms_p50: percentile(&ttft, 50.0),
        ttft_ms_p99: percentile(&ttft, 99.0),
        tpot_ms_p50: percentile(&tpot, 50.0),
        tpot_ms_p99: percentile(&tpot, 99.0),
        blocks_total: stats.blocks_total,
        peak_blocks_used: stats.peak_blocks_used,
        peak_pool_frac: if stats.blocks_total > 0 {
            stats.peak_blocks_used as f64 / stats.blocks_total as f64
        } else {
            0.0
        },
        preemptions: stats.preemptions_total.saturating_sub(before.preemptions_total),
        evicted_blocks: stats.evicted_blocks[k].saturating_sub(before.evicted_blocks[k]),
        evicted_slots: stats.evicted_slots[k].saturating_sub(before.evicted_slots[k]),
        tokens_per_s_vs_full: None,
        concurrency_vs_full: None,
    })
}

/// Drains one request's events, timing the first token and the finish.
async fn collect(mut rx: UnboundedReceiver<GenerateEvent>, submitted: Instant) -> Result<Outcome, String> {
    let mut o = Outcome { submitted, first_token: None, finished: None, tokens: 0 };
    while let Some(ev) = rx.recv().await {
        match ev {
            // These requests ask for no prompt log-probabilities.
            GenerateEvent::PromptLogprobs(_) => {}
            GenerateEvent::Token { .. } => {
                if o.first_token.is_none() {
                    o.first_token = Some(Instant::now());
                }
                o.tokens += 1;
            }
            GenerateEvent::Finished { .. } => {
                o.finished = Some(Instant::now());
                return Ok(o);
            }
            GenerateEvent::Failed(e) | GenerateEvent::Refused(e) => return Err(e),
        }
    }
    Err("the event stream closed without Finished".into())
}

/// The stats snapshot once the engine is idle (bounded wait: the snapshot follows the last step by microseconds).
fn settled_stats(engine: &EngineHandle) -> EngineStats {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = engine.stats();
        if (s.running == 0 && s.waiting == 0) || Instant::now() >= deadline {
            return s;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Nearest-rank percentile of sorted values (0 when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `count` distinct prompts of exactly `tokens` tokens: seeded sentences, tokenized, cut.
pub fn make_prompts(
    tokenizer: &Tokenizer,
    count: usize,
    tokens: usize,
    seed: u64,
) -> Result<Vec<Vec<u32>>, EvictionBenchError> {
    let nouns: Vec<&str> = NOUNS.split_whitespace().collect();
    let adjectives: Vec<&str> = ADJECTIVES.split_whitespace().collect();
    let verbs: Vec<&str> = VERBS.split_whitespace().collect();
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let mut rng = StdRng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut text = format!("Story {i}.");
        // Ten to fifteen tokens per sentence: start a little above the target, add more in the rare short case.
        let sentences = tokens / 8 + 4;
        loop {
            for _ in 0..sentences {
                let mut pick = |w: &[&'static str]| w[rng.random_range(0..w.len())];
                let (a, n1, v, a2, n2, n3) =
                    (pick(&adjectives), pick(&nouns), pick(&verbs), pick(&adjectives), pick(&nouns), pick(&nouns));
                // Writing to a String cannot fail.
                let _ = match rng.random_range(0..5u32) {
                    0 => write!(text, " The {a} {n1} liked to {v} near the {a2} {n2}."),
                    1 => write!(text, " Every morning a {a} {n1} would {v} past the {n2} and the {n3}."),
                    2 => write!(text, " Nobody knew why the {n1} began to {v} when the {n2} felt {a2}."),
                    3 => write!(text, " In the {a} {n1}, an old {n2} tried to {v} beside a {n3}."),
                    _ => write!(text, " Later, the {n1} and the {a2} {n2} decided to {v} together."),
                };
            }
            let ids = tokenizer.encode(&text, false);
            if ids.len() >= tokens {
                out.push(ids[..tokens].to_vec());
                break;
            }
            if text.len() > 64 * tokens + 4096 {
                return Err(EvictionBenchError::Model(format!(
                    "the tokenizer yields only {} tokens for {} bytes of text",
                    ids.len(),
                    text.len()
                )));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v[..8], 99.0), 8.0);
        assert_eq!(percentile(&[3.0], 50.0), 3.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn configurations_put_full_first_and_cross_policies_with_budgets() {
        let o = EvictionBenchOptions {
            policies: vec![PolicyKind::Snapkv, PolicyKind::Full, PolicyKind::H2o],
            budgets: vec![64, 128],
            ..EvictionBenchOptions::default()
        };
        let c = configurations(&o);
        assert_eq!(c.len(), 5);
        assert!(c[0].is_full());
        assert_eq!(c[1], PolicySpec { kind: PolicyKind::Snapkv, budget_tokens: 64 });
        assert_eq!(c[4], PolicySpec { kind: PolicyKind::H2o, budget_tokens: 128 });
        assert_eq!(configurations(&EvictionBenchOptions::default()).len(), 1 + 8 * 3);
    }

    #[test]
    fn median_run_keeps_the_middle_run_whole() {
        let run = |tps: f64, peak: u64| ConfigResult { tokens_per_s: tps, peak_running: peak, ..sample_row() };
        let m = median_run(vec![run(30.0, 3), run(10.0, 1), run(20.0, 2)]).unwrap();
        assert_eq!((m.tokens_per_s, m.peak_running), (20.0, 2));
        assert_eq!(m.tokens_per_s_runs, vec![30.0, 10.0, 20.0]);
        // Even count: the lower middle.
        let m = median_run(vec![run(40.0, 4), run(10.0, 1)]).unwrap();
        assert_eq!(m.tokens_per_s, 10.0);
        assert!(median_run(Vec::new()).is_none());
    }

    fn sample_row() -> ConfigResult {
        ConfigResult {
            policy: "full".into(),
            budget_tokens: None,
            requests: 1,
            completed: 1,
            short_requests: 0,
            generated_tokens: 1,
            seconds: 1.0,
            tokens_per_s: 1.0,
            tokens_per_s_runs: Vec::new(),
            computed_tokens: 1,
            peak_running: 1,
            steps: 1,
            mean_batch: 1.0,
            ttft_ms_p50: 1.0,
            ttft_ms_p99: 1.0,
            tpot_ms_p50: 1.0,
            tpot_ms_p99: 1.0,
            blocks_total: 1,
            peak_blocks_used: 1,
            peak_pool_frac: 1.0,
            preemptions: 0,
            evicted_blocks: 0,
            evicted_slots: 0,
            tokens_per_s_vs_full: None,
            concurrency_vs_full: None,
        }
    }

    #[test]
    fn options_are_validated() {
        let d = EvictionBenchOptions::default();
        assert!(validate(&d).is_ok());
        assert!(validate(&EvictionBenchOptions { requests: 0, ..d.clone() }).is_err());
        assert!(validate(&EvictionBenchOptions { repeats: 0, ..d.clone() }).is_err());
        assert!(validate(&EvictionBenchOptions { budgets: vec![], ..d.clone() }).is_err());
        let only_full = EvictionBenchOptions { policies: vec![PolicyKind::Full], budgets: vec![], ..d };
        assert!(validate(&only_full).is_ok());
    }

    #[test]
    fn report_renders_ratios_and_json() {
        let row = |policy: &str, budget: Option<usize>, tps: f64, peak: u64, vs: Option<(f64, f64)>| ConfigResult {
            policy: policy.into(),
            budget_tokens: budget,
            requests: 4,
            completed: 4,
            short_requests: 0,
            generated_tokens: 64,
            seconds: 2.0,
            tokens_per_s: tps,
            tokens_per_s_runs: vec![tps],
            computed_tokens: 100,
            peak_running: peak,
            steps: 16,
            mean_batch: 2.5,
            ttft_ms_p50: 1500.0,
            ttft_ms_p99: 2500.0,
            tpot_ms_p50: 20.0,
            tpot_ms_p99: 30.0,
            blocks_total: 100,
            peak_blocks_used: 100,
            peak_pool_frac: 1.0,
            preemptions: 3,
            evicted_blocks: 0,
            evicted_slots: 0,
            tokens_per_s_vs_full: vs.map(|v| v.0),
            concurrency_vs_full: vs.map(|v| v.1),
        };
        let r = EvictionReport {
            model: "m".into(),
            model_path: "m.gguf".into(),
            backend: "cpu".into(),
            threads: 2,
            group_blocks: 90,
            kv_blocks: 100,
            prompt_source: "test".into(),
            results: vec![
                row("full", None, 32.0, 2, Some((1.0, 1.0))),
                row("snapkv", Some(64), 48.0, 4, Some((1.5, 2.0))),
            ],
            peak_rss_bytes: 0,
            options: EvictionBenchOptions { requests: 4, new_tokens: 16, ..EvictionBenchOptions::default() },
        };
        assert_eq!(r.full().map(ConfigResult::label), Some("full".into()));
        assert_eq!(r.results[1].label(), "snapkv@64");
        let md = r.to_markdown();
        assert!(
            md.contains(
                "| full | — | 32.0 | 32.0–32.0 | 1.00 | 2 | 1.00 | 2.5 | 1.5 | 2.5 | 20.0 | 30.0 | 100% | 3 | 100 | 0 | 64/64 |"
            ),
            "{md}"
        );
        assert!(md.contains("| snapkv | 64 | 48.0 | 48.0–48.0 | 1.50 | 4 | 2.00 |"), "{md}");
        let j: serde_json::Value = serde_json::from_str(&r.to_json_string()).unwrap();
        assert_eq!(j["results"][1]["budget_tokens"], 64);
        assert_eq!(j["results"][0]["budget_tokens"], serde_json::Value::Null);
        assert_eq!(j["options"]["policies"][0], "full");
        assert_eq!(j["results"][0]["tokens_per_s_runs"][0], 32.0);
    }
}
