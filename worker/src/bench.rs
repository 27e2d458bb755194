//! Engine micro-benchmark (`pagoda bench engine`): prefill and decode throughput of the real model through the
//! engine's own pieces (scheduler, block tables, [`LlamaRunner`], greedy sampling), driven inline on the calling
//! thread so that phases can be timed separately.
//!
//! - **prefill**: one prompt of `prefill_tokens` (default 1,024) tokens, chunked by `max_step_tokens` exactly as
//!   the engine chunks it; tokens/s = prompt tokens / prefill time.
//! - **decode**: for each concurrency `c` (default 1, 8, 32), `c` sequences with `decode_prompt_tokens` (512)
//!   prompt tokens each generate `decode_new_tokens` (128) tokens. The step budget is raised so that all prompts
//!   prefill in the first step(s), which are not timed; only pure decode steps count.
//! - **peak RSS**: `VmHWM` from `/proc/self/status` at the end.
//!
//! - **LoRA** (with `lora` adapters): every measurement again with each sequence on an adapter, right after the
//!   base model's on the same prompts: all on the first adapter, and with two or more, the adapters in turn across
//!   the batch (multi-LoRA: each run of rows that share an adapter adds its own small matmuls).
//!
//! Prompts are deterministic pseudo-random token ids; the prefix cache is off so nothing is reused.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use std::sync::Arc;

use crate::engine::{
    Device, EngineConfig, EngineError, LlamaRunner, LoraSpec, ModelRunner, forward_step, model_config,
};
use crate::model::{LoraAdapter, SyntheticSpec};
use crate::scheduler::{ReserveConfig, Scheduler, SchedulerConfig, SeqRequest};
use pagoda_kernels::KvDtype;

#[derive(Debug, Clone, Serialize)]
pub struct BenchOptions {
    /// CPU threads for the backend (0 = all cores).
    pub threads: usize,
    pub block_size: usize,
    /// Engine step budget used for the prefill measurement.
    pub max_step_tokens: usize,
    pub prefill_tokens: usize,
    pub decode_prompt_tokens: usize,
    pub decode_new_tokens: usize,
    pub concurrency: Vec<usize>,
    pub seed: u64,
    /// Element type of the KV arena.
    #[serde(serialize_with = "serialize_dtype")]
    pub kv_dtype: KvDtype,
    /// Matmuls in bf16 ([`EngineConfig::bf16_matmuls`]).
    pub bf16_matmuls: bool,
    /// Bench a synthetic-weights model of this shape instead of the GGUF ([`EngineConfig::synthetic`]).
    #[serde(skip)]
    pub synthetic: Option<SyntheticSpec>,
    /// Where the model runs ([`EngineConfig::device`]).
    #[serde(serialize_with = "serialize_display")]
    pub device: Device,
    /// LoRA adapters to measure beside the base model (none: the base model only).
    #[serde(serialize_with = "serialize_lora")]
    pub lora: Vec<LoraSpec>,
}

fn serialize_lora<S: serde::Serializer>(specs: &[LoraSpec], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(specs.iter().map(|l| format!("{}={}", l.name, l.dir.display())))
}

fn serialize_display<S: serde::Serializer>(d: &Device, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(d)
}

fn serialize_dtype<S: serde::Serializer>(d: &KvDtype, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

impl Default for BenchOptions {
    fn default() -> BenchOptions {
        BenchOptions {
            threads: 0,
            block_size: 16,
            max_step_tokens: 512,
            prefill_tokens: 1024,
            decode_prompt_tokens: 512,
            decode_new_tokens: 128,
            concurrency: vec![1, 8, 32],
            seed: 1234,
            kv_dtype: KvDtype::default(),
            bf16_matmuls: false,
            synthetic: None,
            device: Device::Cpu,
            lora: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct PrefillResult {
    pub prompt_tokens: usize,
    pub chunk_tokens: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct DecodeResult {
    pub concurrency: usize,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// Tokens produced by pure decode steps (each sequence's first token comes from its prefill step).
    pub decode_tokens: usize,
    pub decode_steps: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
    /// Mean time per decode step (one token for each sequence).
    pub ms_per_step: f64,
    /// Of `ms_per_step`: the runner's forward, logits copy included (the rest is host sampling and bookkeeping).
    pub forward_ms_per_step: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub model_path: String,
    /// The weights are synthetic (random): throughput is representative of the shape, outputs are meaningless.
    pub synthetic: bool,
    pub backend: String,
    pub threads: usize,
    pub kv_blocks: usize,
    pub prefill: PrefillResult,
    pub decode: Vec<DecodeResult>,
    /// The same measurements with LoRA adapters, one entry per way of assigning them (empty without adapters).
    pub lora: Vec<LoraVariant>,
    /// `VmHWM` of this process, bytes (0 where /proc is unavailable).
    pub peak_rss_bytes: u64,
    pub options: BenchOptions,
}

/// The base model's measurements again with adapters on every sequence.
#[derive(Debug, Clone, Serialize)]
pub struct LoraVariant {
    /// "1 adapter (NAME, rank R)" or "N adapters in turn".
    pub variant: String,
    pub adapters: Vec<String>,
    pub prefill: PrefillResult,
    pub decode: Vec<DecodeResult>,
}

impl BenchReport {
    /// A markdown table (plus a header line with the setup).
    pub fn to_markdown(&self) -> String {
        let mut s = format!(
            "Engine bench: `{}` on {} ({} threads), block size {}, {} KV blocks of {}\n\n",
            self.model, self.backend, self.threads, self.options.block_size, self.kv_blocks, self.options.kv_dtype
        );
        if self.synthetic {
            s.push_str(&format!(
                "SYNTHETIC WEIGHTS (random; throughput only, outputs meaningless): {}\n\n",
                self.model_path
            ));
        }
        s.push_str(
            "| phase | concurrency | prompt tokens | new tokens | seconds | tokens/s | ms/step | of which forward |\n",
        );
        s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|\n");
        let p = &self.prefill;
        s.push_str(&format!(
            "| prefill (chunk {}) | 1 | {} | — | {:.3} | {:.1} | — | — |\n",
            p.chunk_tokens, p.prompt_tokens, p.seconds, p.tokens_per_s
        ));
        for d in &self.decode {
            s.push_str(&format!(
                "| decode | {} | {} | {} | {:.3} | {:.1} | {:.1} | {:.1} |\n",
                d.concurrency,
                d.prompt_tokens,
                d.new_tokens,
                d.seconds,
                d.tokens_per_s,
                d.ms_per_step,
                d.forward_ms_per_step
            ));
        }
        if !self.lora.is_empty() {
            s.push_str("\nLoRA adapters, measured right after the base model on the same prompts:\n\n");
            s.push_str(
                "| adapters | phase | concurrency | tokens/s | × base | ms/step |\n|---|---|---:|---:|---:|---:|\n",
            );
            for v in &self.lora {
                s.push_str(&format!(
                    "| {} | prefill | 1 | {:.1} | {:.2} | — |\n",
                    v.variant,
                    v.prefill.tokens_per_s,
                    ratio(v.prefill.tokens_per_s, self.prefill.tokens_per_s)
                ));
                for (d, base) in v.decode.iter().zip(&self.decode) {
                    s.push_str(&format!(
                        "| {} | decode | {} | {:.1} | {:.2} | {:.1} |\n",
                        v.variant,
                        d.concurrency,
                        d.tokens_per_s,
                        ratio(d.tokens_per_s, base.tokens_per_s),
                        d.ms_per_step
                    ));
                }
            }
        }
        s.push_str(&format!("\nPeak RSS (VmHWM): {:.1} MiB\n", self.peak_rss_bytes as f64 / (1024.0 * 1024.0)));
        s
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    pub fn to_json_string(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// Runs the benchmark on the GGUF at `model_path`, or on `opts.synthetic` where set.
pub fn engine_bench(model_path: impl AsRef<std::path::Path>, opts: &BenchOptions) -> Result<BenchReport, EngineError> {
    let model_path = model_path.as_ref();
    let max_c = opts.concurrency.iter().copied().max().unwrap_or(1).max(1);
    let bs = opts.block_size.max(1);
    // Blocks for the largest phase (one spare group per sequence): the long prefill alone, or the widest decode.
    let decode_groups = (opts.decode_prompt_tokens + opts.decode_new_tokens + bs).div_ceil(bs) * max_c;
    let prefill_groups = (opts.prefill_tokens + 1 + bs).div_ceil(bs);
    let needed_groups = decode_groups.max(prefill_groups).max((64 + 4 + bs).div_ceil(bs));
    let cfg = EngineConfig {
        model_path: model_path.to_path_buf(),
        num_blocks: 0,
        kv_cache_tokens: 0,
        block_size: bs,
        max_step_tokens: opts.max_step_tokens,
        max_running: max_c,
        enable_prefix_cache: false,
        threads: opts.threads,
        default_policy: crate::policy::PolicySpec::full(),
        reserve: ReserveConfig::off(),
        tiers: crate::tiers::TierConfig::default(),
        kv_dtype: opts.kv_dtype,
        placement: Default::default(),
        kivi_residual_tokens: 0,
        kivi_int8_layers: Vec::new(),
        bf16_matmuls: opts.bf16_matmuls,
        // No tier encodes here: the calibration would only lengthen each start.
        fp8_keys_for_queries: false,
        synthetic: opts.synthetic.clone(),
        device: opts.device,
        speculative: crate::speculative::NgramConfig::off(),
        scheduling: crate::scheduler::SchedulingPolicy::Fcfs,
        lora: Vec::new(),
        max_lora_rank: 64,
        lora_dir: None,
        max_loras: 16,
        lora_on_demand: false,
    };
    // Size the arena from the shape before loading the weights.
    let mc = model_config(&cfg)?;
    let num_blocks = needed_groups * mc.n_kv_tables();
    let cfg = EngineConfig { num_blocks, ..cfg };
    match opts.device {
        Device::Cpu => {
            let threads = crate::engine::resolve_threads(opts.threads);
            bench_runner(&mut LlamaRunner::load(&cfg)?, model_path, opts, "cpu".into(), threads)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let mut runner = crate::runner_cuda::CudaRunner::load(&cfg)?;
            let backend = format!("cuda ({})", runner.model().device().info().name);
            bench_runner(&mut runner, model_path, opts, backend, 0)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::engine::no_cuda_build()),
    }
}

/// The measurements of [`engine_bench`] on a loaded runner.
fn bench_runner<R: ModelRunner>(
    runner: &mut R,
    model_path: &std::path::Path,
    opts: &BenchOptions,
    backend: String,
    threads: usize,
) -> Result<BenchReport, EngineError> {
    let info = runner.info().clone();
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let vocab = info.vocab_size as u32;
    let mut prompt = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(100..vocab.max(101))).collect() };

    // The base model first, then each way of putting adapters on the batch's sequences.
    let adapters: Vec<Arc<LoraAdapter>> = match runner.lora_shape() {
        _ if opts.lora.is_empty() => Vec::new(),
        None => return Err(EngineError::Config("--lora: this backend does not serve LoRA adapters".into())),
        Some(shape) => opts
            .lora
            .iter()
            .map(|s| {
                LoraAdapter::load(&s.name, &s.dir, &shape, crate::model::lora::MAX_LORA_RANK)
                    .map(Arc::new)
                    .map_err(|e| EngineError::Config(e.to_string()))
            })
            .collect::<Result<_, _>>()?,
    };
    let mut variants: Vec<(String, Vec<Arc<LoraAdapter>>)> = vec![(String::new(), Vec::new())];
    if let Some(first) = adapters.first() {
        variants.push((format!("1 adapter ({}, rank {})", first.name(), first.rank()), vec![Arc::clone(first)]));
    }
    if adapters.len() > 1 {
        variants.push((format!("{} adapters in turn", adapters.len()), adapters.clone()));
    }
    // Warm-up (page in weights, grow scratch buffers), each variant once.
    for (_, on) in &variants {
        run_batch(runner, vec![prompt(64)], 4, opts.max_step_tokens, on)?;
    }

    let mut prefills = Vec::new();
    let long = prompt(opts.prefill_tokens);
    for (_, on) in &variants {
        let p = run_batch(runner, vec![long.clone()], 1, opts.max_step_tokens, on)?;
        prefills.push(PrefillResult {
            prompt_tokens: opts.prefill_tokens,
            chunk_tokens: opts.max_step_tokens,
            seconds: p.prefill.as_secs_f64(),
            tokens_per_s: rate(p.prefill_tokens, p.prefill),
        });
    }

    let mut decodes: Vec<Vec<DecodeResult>> = vec![Vec::new(); variants.len()];
    for &c in &opts.concurrency {
        let c = c.max(1);
        let prompts: Vec<Vec<u32>> = (0..c).map(|_| prompt(opts.decode_prompt_tokens)).collect();
        // One step prefills every prompt; all later steps are pure decode.
        let budget = (c * opts.decode_prompt_tokens).max(opts.max_step_tokens);
        for ((_, on), out) in variants.iter().zip(decodes.iter_mut()) {
            let r = run_batch(runner, prompts.clone(), opts.decode_new_tokens, budget, on)?;
            out.push(DecodeResult {
                concurrency: c,
                prompt_tokens: opts.decode_prompt_tokens,
                new_tokens: opts.decode_new_tokens,
                decode_tokens: r.decode_tokens,
                decode_steps: r.decode_steps,
                seconds: r.decode.as_secs_f64(),
                tokens_per_s: rate(r.decode_tokens, r.decode),
                ms_per_step: per_step(r.decode, r.decode_steps),
                forward_ms_per_step: per_step(r.decode_forward, r.decode_steps),
            });
        }
    }
    let mut prefills = prefills.into_iter();
    let mut decodes = decodes.into_iter();
    let (prefill, decode) = match (prefills.next(), decodes.next()) {
        (Some(p), Some(d)) => (p, d),
        _ => return Err(EngineError::Forward("the base model was not measured".into())),
    };
    let lora = variants
        .into_iter()
        .skip(1)
        .zip(prefills.zip(decodes))
        .map(|((variant, on), (prefill, decode))| LoraVariant {
            variant,
            adapters: on.iter().map(|a| a.name().to_string()).collect(),
            prefill,
            decode,
        })
        .collect();

    Ok(BenchReport {
        model: info.name.clone(),
        model_path: match &opts.synthetic {
            Some(spec) => spec.to_string(),
            None => model_path.display().to_string(),
        },
        synthetic: opts.synthetic.is_some(),
        backend,
        threads,
        kv_blocks: info.num_blocks,
        prefill,
        decode,
        lora,
        peak_rss_bytes: peak_rss_bytes(),
        options: opts.clone(),
    })
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

fn rate(tokens: usize, d: Duration) -> f64 {
    let s = d.as_secs_f64();
    if s > 0.0 { tokens as f64 / s } else { 0.0 }
}

#[derive(Debug, Default)]
struct BatchTimes {
    prefill: Duration,
    prefill_tokens: usize,
    decode: Duration,
    decode_tokens: usize,
    decode_steps: usize,
    /// Of `decode`: inside the runner's forward (the rest is sampling and bookkeeping on the host).
    decode_forward: Duration,
}

fn per_step(total: Duration, steps: usize) -> f64 {
    if steps > 0 { total.as_secs_f64() * 1e3 / steps as f64 } else { 0.0 }
}

/// Generates `new_tokens` greedy tokens for every prompt, timing prefill-carrying steps and pure decode steps
/// apart. Sequence `i` runs with adapter `i % adapters.len()` (the base model when there are none).
fn run_batch<R: ModelRunner>(
    runner: &mut R,
    prompts: Vec<Vec<u32>>,
    new_tokens: usize,
    max_step_tokens: usize,
    adapters: &[Arc<LoraAdapter>],
) -> Result<BatchTimes, EngineError> {
    let info = runner.info().clone();
    let cfg = SchedulerConfig {
        max_step_tokens,
        max_running: prompts.len().max(1),
        enable_prefix_cache: false,
        max_model_len: info.context_length,
        model_id: info.model_id.clone(),
        attn: info.attn_dims(),
        // The batch under test runs whole: the pool is sized for it.
        reserve: ReserveConfig::off(),
        speculative: crate::speculative::NgramConfig::off(),
        scheduling: crate::scheduler::SchedulingPolicy::Fcfs,
    };
    let mut sched: Scheduler<()> = Scheduler::new(cfg, info.layout(), info.num_blocks);
    for (i, p) in prompts.into_iter().enumerate() {
        sched.add(SeqRequest {
            prompt: p,
            max_tokens: new_tokens.max(1),
            stop_token_ids: Vec::new(),
            namespace: String::new(),
            policy: crate::policy::PolicySpec::full(),
            prompt_logits: false,
            priority: 0,
            tenant_weight: 1,
            lora: (!adapters.is_empty()).then(|| Arc::clone(&adapters[i % adapters.len()])),
            payload: (),
        })?;
    }
    let mut times = BatchTimes::default();
    let mut logits = Vec::new();
    let mut tokens = Vec::new();
    let mut batch = Vec::new();
    let mut sampled = Vec::new();
    while sched.has_work() {
        let plan = sched.schedule();
        if plan.is_empty() {
            return Err(EngineError::Forward("the bench batch does not fit the KV pool".into()));
        }
        let t0 = Instant::now();
        let pure_decode =
            plan.seqs.iter().all(|e| e.n == 1 && sched.get(e.seq).is_some_and(|s| e.start >= s.prompt_len()));
        forward_step(&mut sched, runner, &plan, &mut batch, &mut logits, Some(&mut tokens))?;
        let forward = t0.elapsed();
        sampled.clear();
        for (row, e) in plan.seqs.iter().filter(|e| e.wants_logits).enumerate() {
            let &tok = tokens.get(row).ok_or_else(|| EngineError::Forward("short greedy tokens".into()))?;
            sampled.push((e.seq, tok));
        }
        for &(id, tok) in &sampled {
            if sched.append_token(id, tok)?.is_some() {
                sched.finish(id);
            }
        }
        let dt = t0.elapsed();
        if pure_decode {
            times.decode += dt;
            times.decode_tokens += plan.seqs.len();
            times.decode_steps += 1;
            times.decode_forward += forward;
        } else {
            times.prefill += dt;
            times.prefill_tokens += plan.num_tokens();
        }
    }
    Ok(times)
}

/// Peak resident set size (`VmHWM`) in bytes; 0 when unavailable.
pub fn peak_rss_bytes() -> u64 {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else { return 0 };
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_rss_is_read() {
        if std::path::Path::new("/proc/self/status").exists() {
            assert!(peak_rss_bytes() > 0);
        }
    }

    #[test]
    fn report_renders_markdown_and_json() {
        let r = BenchReport {
            model: "m".into(),
            model_path: "m.gguf".into(),
            synthetic: false,
            backend: "cpu".into(),
            threads: 2,
            kv_blocks: 90,
            prefill: PrefillResult { prompt_tokens: 1024, chunk_tokens: 512, seconds: 2.0, tokens_per_s: 512.0 },
            decode: vec![DecodeResult {
                concurrency: 8,
                prompt_tokens: 512,
                new_tokens: 128,
                decode_tokens: 1016,
                decode_steps: 127,
                seconds: 4.0,
                tokens_per_s: 254.0,
                ms_per_step: 31.5,
                forward_ms_per_step: 30.0,
            }],
            lora: Vec::new(),
            peak_rss_bytes: 1 << 30,
            options: BenchOptions::default(),
        };
        let md = r.to_markdown();
        assert!(md.contains("| prefill (chunk 512) | 1 | 1024 |"), "{md}");
        assert!(md.contains("| decode | 8 | 512 | 128 | 4.000 | 254.0 | 31.5 |"), "{md}");
        assert!(md.contains("1024.0 MiB"));
        let j = r.to_json();
        assert_eq!(j["decode"][0]["concurrency"], 8);
        assert_eq!(j["prefill"]["tokens_per_s"], 512.0);
    }
}
