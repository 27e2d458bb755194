//! The `pagoda` CLI: one binary for every role.
//!
//! - `pagoda up`: the embedded single-machine cluster: engine, worker gRPC service on a loopback port, a one-voter
//!   kvstore (the block directory) on a loopback port, and the router on `--listen`, in one process; the router still
//!   talks to the worker over gRPC and learns its blocks through the kvstore, as in a cluster.
//! - `pagoda worker`: the engine behind the `Worker` gRPC service.
//! - `pagoda router`: the OpenAI HTTP API in front of one or more workers.
//! - `pagoda kvstore`: one node of the raft-replicated block directory (`--peer` lists the initial voters).
//! - `pagoda bench kvstore`: publish throughput and watch latency of an in-process 3-node kvstore cluster.
//! - `pagoda bench engine`: the engine micro-benchmark.
//! - `pagoda bench tiers`: onboarding a 2K-token prefix from the host/disk KV tier against recomputing it;
//!   `--workload zipf`: EvicPress against recompute, LRU and fixed codecs on Zipf-reused contexts (Figure 7).
//! - `pagoda bench eviction`: throughput of each KV eviction policy against full cache on a pool too small for
//!   the load (markdown table, JSON, PNG chart).
//!
//! Without `--model`, the default model `models/SmolLM2-135M-Instruct.Q4_1.gguf` is used and fetched with
//! `scripts/fetch-model.sh` when missing.

mod bench_disagg;
mod bench_kernels;
mod bench_plot;
mod bench_routing;
mod eval_plot;
mod kernels_plot;
mod telemetry;
mod tiers_plot;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, Parser, Subcommand};
use pagoda_kernels::codec::MAX_BLOCK_SIZE;
use pagoda_kernels::{KvDtype, WeightType};
use pagoda_kvstore::{Endpoints, EndpointsSource};
use pagoda_router::{GgufCodec, RouterConfig, Security, TextCodec};
use pagoda_worker::engine::{Device, Engine, EngineConfig, EngineHandle, LoraSpec};
use pagoda_worker::engine::{MAX_RUNNING, MAX_STEP_TOKENS, MAX_THREADS};
use pagoda_worker::evicpress::GreedyRule;
use pagoda_worker::model::SyntheticSpec;
use pagoda_worker::peer_link::LinkFactory;
use pagoda_worker::placement::{AnswerHorizon, EvicPressConfig, ProfileScoring, TierPlacement};
use pagoda_worker::policy::{PolicyKind, PolicySpec, policy_names};
use pagoda_worker::scheduler::{ReserveConfig, SchedulingPolicy};
use pagoda_worker::service::{AdmissionLimits, WorkerService};
use pagoda_worker::speculative::NgramConfig;
use pagoda_worker::tiers::TierConfig;
use pagoda_worker::transfer::{PeerCounters, PeerFetchConfig, PeerFetcher, PullPolicy, TransferService};
use tokio::net::TcpListener;
use tokio::sync::watch;

const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
/// How long in-flight requests get to finish after a shutdown signal.
const DRAIN: Duration = Duration::from_secs(5);

#[derive(Parser)]
#[command(name = "pagoda", version, about = "Pagoda: KV-cache-aware LLM serving")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run engine, worker and router in one process (the embedded single-machine cluster).
    Up(UpArgs),
    /// Run a worker: the engine behind the Worker gRPC service.
    Worker(WorkerArgs),
    /// Run a router: the OpenAI-compatible HTTP API over workers.
    Router(RouterArgs),
    /// Run a kvstore node: one voter of the raft-replicated block directory and worker table.
    Kvstore(KvstoreArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Quality of the KV eviction policies against the full cache: synthetic long-context tasks and
    /// teacher-forced prose, per policy × budget.
    Eval(EvalArgs),
    /// Parses a pagoda command line without running it: exits 0 when it is valid, prints the error and exits
    /// non-zero otherwise (the Helm chart's CLI-drift check, scripts/check-helm.sh, runs every rendered
    /// invocation through it). The first word after `--` is the program name.
    #[command(hide = true)]
    CheckArgs(CheckArgsArgs),
    /// LoRA adapter tools.
    #[command(subcommand)]
    Lora(LoraCommand),
}

#[derive(Subcommand)]
enum LoraCommand {
    /// Write a SYNTHETIC LoRA adapter (random weights, labelled as such) in PEFT format for the model, to exercise
    /// `--lora` without a trained adapter: its outputs are meaningless.
    Synth(LoraSynthArgs),
}

#[derive(Args)]
struct LoraSynthArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Directory to write adapter_config.json, adapter_model.safetensors and README.md into.
    #[arg(long)]
    out: PathBuf,
    /// Rank r.
    #[arg(long, default_value_t = 8,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=pagoda_worker::model::lora::MAX_LORA_RANK as u64))]
    rank: usize,
    /// lora_alpha (the deltas are scaled by alpha / r).
    #[arg(long, default_value_t = 16.0)]
    alpha: f32,
    /// Adapted projections (comma-separated PEFT module names, or "all-linear").
    #[arg(long, value_delimiter = ',', default_value = "all-linear")]
    targets: Vec<String>,
    /// Standard deviation of B's entries (A's are uniform in ±1/√fan-in).
    #[arg(long, default_value_t = 0.02)]
    b_std: f32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Args)]
struct CheckArgsArgs {
    /// The command line to check, program name first.
    #[arg(last = true, required = true, allow_hyphen_values = true)]
    argv: Vec<String>,
}

#[derive(Args)]
struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// With --codecs: run the model's matmuls in bf16 (the worker's --bf16-matmuls) instead of over Q8_1
    /// activations, so that each lane's disagreement is its codec's and not the activation rounding's.
    #[arg(long, alias = "amx")]
    bf16_matmuls: bool,
    /// Policies to compare with the full cache (comma-separated; "all" = every eviction policy).
    #[arg(long, value_delimiter = ',', default_value = "all")]
    policies: Vec<String>,
    /// Budgets in tokens per (layer, kv-head).
    #[arg(long, value_delimiter = ',', default_value = "128,256,512,1024,2048")]
    budgets: Vec<usize>,
    /// Synthetic tasks (comma-separated; "all" = passkey, multikey_niah, kv_retrieval, variable_tracking,
    /// common_words; "none" = skip them).
    #[arg(long, value_delimiter = ',', default_value = "all")]
    tasks: Vec<String>,
    /// Context sizes of the synthetic items, in tokens.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096,6144")]
    contexts: Vec<usize>,
    /// Items per task and context.
    #[arg(long, default_value_t = 2)]
    items: usize,
    /// Seed of the synthetic items.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Prose documents scored by teacher forcing (0 = none). Fetched with scripts/fetch-prose.sh when missing.
    #[arg(long, default_value_t = 4)]
    prose_docs: usize,
    /// Prose context before the scored continuation, in tokens.
    #[arg(long, default_value_t = 2048)]
    prose_context: usize,
    /// Prose continuation scored per document, in tokens.
    #[arg(long, default_value_t = 64)]
    prose_continuation: usize,
    /// Directory of prose text files.
    #[arg(long, default_value = "data/prose")]
    prose_dir: PathBuf,
    /// Compute threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// KV pool size in GiB (past it the scheduler preempts and recomputes).
    #[arg(long, default_value_t = 4.0)]
    pool_gib: f64,
    /// Write the full report (every item and cell) as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the markdown tables.
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Draw score against budget per policy (PNG).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Do not run: re-render the tables and the plot from JSON reports written by `--json` (comma-separated).
    /// Several are merged: their items pooled and every cell recomputed, as for runs of the same sweep over
    /// different items (`--seed` where another run's items stopped); `--json` then writes the merged report.
    #[arg(long, value_delimiter = ',')]
    from_json: Vec<PathBuf>,
    /// Compare KV codecs with the full cache instead of eviction policies (comma-separated: f16, bf16, int8,
    /// fp8_e4m3, fp8_e4m3_rotated, int4_kivi, int2_kivi, or "all"): every filled block is encoded and decoded back
    /// in place, and each codec's next-token argmax is compared with the full cache's on the synthetic items
    /// (greedy continuation of --codec-tokens) and the prose documents (forced continuation). `pool:DTYPE`
    /// (pool:int8, pool:fp8_e4m3, pool:fp8_e4m3_rotated) is the device pool of that --kv-dtype instead: every slot
    /// rounded as the pool stores it. `BASE+int8@L:L/N` (int2_kivi+int8@18/30) is a KIVI codec with the listed
    /// layers of an N-layer model in int8, as `--kivi-int8-layers` stores groups. Writes --json/--markdown.
    #[arg(long, value_delimiter = ',')]
    codecs: Vec<String>,
    /// Greedy tokens per synthetic item in the --codecs comparison.
    #[arg(long, default_value_t = 64)]
    codec_tokens: usize,
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// GGUF model file (llama family). Default: models/SmolLM2-135M-Instruct.Q4_1.gguf, fetched when missing.
    #[arg(long, env = "PAGODA_MODEL")]
    model: Option<PathBuf>,
}

#[derive(Args, Clone)]
struct EngineArgs {
    /// KV blocks in the pool (0 = room for two full contexts). One block is --block-size tokens of one layer's one
    /// KV head; --kv-cache-tokens is the same budget counted in tokens.
    #[arg(long, default_value_t = 0)]
    num_blocks: usize,
    /// KV pool size in tokens (every layer and KV head), instead of --num-blocks: at most this many cached and
    /// running tokens fit on the worker at once.
    #[arg(long, default_value_t = 0, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1 << 24))]
    kv_cache_tokens: usize,
    /// Token slots per KV block, 1 to 256 (the largest block the KV tier codecs encode).
    #[arg(long, default_value_t = 16,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_BLOCK_SIZE as u64))]
    block_size: usize,
    /// Token budget of one engine step (chunked prefill + decode), 1 to 65,536 (the step's activations are sized
    /// for it at start).
    #[arg(long, default_value_t = 512,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_STEP_TOKENS as u64))]
    max_step_tokens: usize,
    /// Most sequences running at once, 1 to 4,096.
    #[arg(long, default_value_t = 64,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_RUNNING as u64))]
    max_running: usize,
    /// Compute threads (0 = all cores), at most 1,024.
    #[arg(long, default_value_t = 0,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=MAX_THREADS as u64))]
    threads: usize,
    /// Turn the prefix cache off.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Default KV eviction policy for requests that name none: full, streaming, knorm, keydiff, paged_eviction,
    /// sage, snapkv, h2o, kv_compress.
    #[arg(long, default_value = "full")]
    kv_policy: String,
    /// Default KV budget in tokens per (layer, kv-head) for that policy.
    #[arg(long, default_value_t = pagoda_worker::policy::defaults::BUDGET_TOKENS)]
    kv_budget: usize,
    /// Admission: `reserve` keeps room for the running sequences' expected growth (SGLang's new-token ratio);
    /// `greedy` admits whatever fits now and preempts later.
    #[arg(long, default_value = "reserve", value_parser = ["reserve", "greedy"])]
    admission: String,
    /// Request order (vLLM's flag): `fcfs` serves requests in arrival order and refuses a `priority` other than 0;
    /// `priority` admits the lowest `priority` first and preempts the highest first, arrival breaking ties; `fair`
    /// admits next the request of the tenant (API key's tenant) running the fewest sequences and preempts the
    /// youngest of the tenant running the most, so one tenant's burst cannot hold the whole batch; `vtc` (Virtual
    /// Token Counter, Sheng et al. OSDI 2024) admits next from the tenant that has received the fewest weighted
    /// tokens (prompt 1, output 2, over the key's weight), so long prompts cost their tenant more turns.
    #[arg(long, default_value = "fcfs", value_parser = ["fcfs", "priority", "fair", "vtc"])]
    scheduling_policy: String,
    /// Directory for the worker's persistent state; the disk KV tier lives in DATA_DIR/kv/.
    #[arg(long, env = "PAGODA_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Host-RAM KV tier size in MiB: idle prefix blocks evicted from the device pool are kept here (0 disables).
    #[arg(long, default_value_t = 1024)]
    host_tier_mib: u64,
    /// Disk KV tier size in MiB under --data-dir: host-tier victims and, on shutdown, the host tier (0 disables).
    #[arg(long, default_value_t = 0)]
    disk_tier_mib: u64,
    /// Element type of the device KV cache: f16 (half the memory and bandwidth of f32), f32 (bit-exact with an f32
    /// reference), int8, fp8_e4m3 or fp8_e4m3_rotated (one f32 scale per slot: 0.53x f16's bytes at head_dim 64,
    /// dequantised by the attention kernel as it loads; the rotated fp8 stores keys rotated by a Walsh-Hadamard
    /// transform, closer to f16 for the same bytes; CPU only).
    #[arg(long, default_value = "f16", value_parser = parse_kv_dtype)]
    kv_dtype: KvDtype,
    /// Run the quantised matmuls in bf16 over weights widened to bf16 once (+2 bytes per weight): on AMX tiles where
    /// the CPU has them (faster prefill and batched decode), else with AVX-512 BF16 dot products; logits closer to
    /// float32, slower single-stream decode. Refused on CPUs with neither. (`--amx` is the old name.)
    #[arg(long, alias = "amx")]
    bf16_matmuls: bool,
    /// How `fp8_e4m3_rotated` blocks round their keys when they are encoded for a tier: `queries` for the model's
    /// queries (calibrated once at load on a fixed text; about a second on 2 cores), or `nearest` (each element to
    /// its nearest code). The bytes and their decoding are the same either way.
    #[arg(long, default_value = "queries", value_parser = ["queries", "nearest"])]
    fp8_key_rounding: String,
    /// Compute device: cpu, or cuda / cuda:N for the GPU runner (binaries built with `--features cuda`). On a GPU
    /// the KV cache is f16 in device memory; eviction policies, the host/disk tiers with LRU placement, and peer
    /// pulls (over NCCL links between GPU workers, else gRPC) run there too; EvicPress placement is CPU-only.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: Device,
    /// N-gram speculative decoding (prompt lookup): draft tokens proposed per step for a decoding full-cache
    /// sequence whose last tokens repeat earlier ones; the model checks them in the same step. Answers are
    /// unchanged (greedy and seeded alike). 0 turns it off.
    #[arg(long, default_value_t = 0,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=pagoda_worker::speculative::MAX_DRAFT_TOKENS as u64))]
    speculative_tokens: usize,
    /// Shortest suffix (tokens) the n-gram proposer looks up.
    #[arg(long, default_value_t = 2,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=pagoda_worker::speculative::MAX_NGRAM as u64))]
    speculative_ngram_min: usize,
    /// Longest suffix the n-gram proposer looks up; the longest that occurred before wins.
    #[arg(long, default_value_t = 4,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=pagoda_worker::speculative::MAX_NGRAM as u64))]
    speculative_ngram_max: usize,
    /// Speculate only while at most this many sequences run (a fuller batch keeps the step busy without drafts).
    #[arg(long, default_value_t = 4,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    speculative_max_batch: usize,
    /// Pin the cost of a draft token, in single-token steps (0 to 16), instead of measuring it from the worker's
    /// steps; 0 drafts as long as --speculative-tokens allows whenever a suffix matches.
    #[arg(long)]
    speculative_draft_cost: Option<f64>,
    /// Serve a LoRA adapter beside the base model (repeatable): NAME=DIR, DIR a PEFT adapter directory
    /// (adapter_config.json and adapter_model.safetensors, as vLLM's --lora-modules takes). Requests choose it with
    /// `"model": "NAME"`; its KV is cached apart from the base model's. CPU backend only.
    #[arg(long = "lora", value_name = "NAME=DIR", value_parser = parse_lora_spec)]
    lora: Vec<LoraSpec>,
    /// Highest LoRA rank a --lora adapter may have.
    #[arg(long, default_value_t = 64,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=pagoda_worker::model::lora::MAX_LORA_RANK as u64))]
    max_lora_rank: usize,
    /// Allow loading and unloading LoRA adapters at run time (the router's POST /v1/load_lora_adapter and
    /// /v1/unload_lora_adapter, admin only), from PEFT directories under DIR only.
    #[arg(long, value_name = "DIR")]
    lora_dir: Option<PathBuf>,
    /// Most LoRA adapters loaded at once, --lora ones included.
    #[arg(long, default_value_t = 16,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=pagoda_worker::adapters::MAX_LOADED_LORAS as u64))]
    max_loras: usize,
    /// Load a LoRA adapter that a request names and this worker lacks from --lora-dir/NAME (vLLM's filesystem
    /// resolver), evicting the least recently used idle adapter loaded that way when --max-loras are loaded.
    /// Workers announce what they can load, and the router charges each worker the load in its placement cost.
    #[arg(long, requires = "lora_dir")]
    lora_on_demand: bool,
    /// Most requests queued behind a full running batch (--max-running); more are refused as busy (the router
    /// tries another worker, then sheds load with 503 + Retry-After).
    #[arg(long, default_value_t = pagoda_worker::service::DEFAULT_MAX_QUEUED_REQUESTS,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    max_queued_requests: usize,
    /// Most prompt tokens waiting for prefill (requests before their first token); a request is always taken
    /// when none waits. Bounds the time to first token of a new request.
    #[arg(long, default_value_t = pagoda_worker::service::DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    max_queued_prompt_tokens: u64,
    /// What fills the host/disk tiers: `lru` (every idle group in --tier-codec, least recently used evicted) or
    /// `evicpress` (tier and codec per context by EvicPress's utility, quality profiled while idle).
    #[arg(long, default_value = "lru", value_parser = ["lru", "evicpress"])]
    tier_placement: String,
    /// Codec of the groups LRU placement stores: native (the device dtype), bf16, int8, fp8_e4m3, fp8_e4m3_rotated
    /// (fp8 over Hadamard-rotated keys), int4_kivi or int2_kivi.
    #[arg(long, default_value = "native",
          value_parser = ["native", "f16", "f32", "bf16", "int8", "fp8_e4m3", "fp8_e4m3_rotated", "int4_kivi", "int2_kivi"])]
    tier_codec: String,
    /// KIVI's full-precision residual for stored prompts, in tokens: the last groups of each prompt stored in
    /// int4_kivi or int2_kivi (by LRU or EvicPress) keep the device's format. KIVI's paper uses 128. 0: none.
    #[arg(long, default_value_t = 0)]
    kivi_residual_tokens: usize,
    /// Layers (comma-separated, 0-based) whose blocks a KIVI codec (int4_kivi, int2_kivi) stores in int8 instead,
    /// whichever placement chose it: the layers whose attention amplifies KIVI's key error most. For
    /// SmolLM2-135M, 18 (docs/BENCHMARKS.md, "KIVI's sensitive layers"; find them for another model with
    /// `pagoda eval --codecs int2_kivi+int8@L/N,...`). Default: none.
    #[arg(long, value_delimiter = ',')]
    kivi_int8_layers: Vec<usize>,
    /// EvicPress's α in U = (α·quality − load seconds)·frequency.
    #[arg(long, default_value_t = 1.0)]
    evicpress_alpha: f64,
    /// EvicPress's token-dropping ratios, comma-separated, each in (0, 1): the fraction of every table's slots a
    /// pruned copy keeps (KeyDiff), offered with every codec. `none` offers whole contexts only.
    #[arg(long, value_delimiter = ',', default_value = "0.5,0.25", value_parser = parse_keep_ratio)]
    evicpress_keep_ratios: Vec<KeepRatio>,
    /// How EvicPress's profiler scores a variant: `forced` (one teacher-forced step over the full-precision
    /// answer) or `free` (the variant's own greedy answer against it, what a request served from it gets).
    #[arg(long, default_value = "forced")]
    evicpress_profile: ProfileScoring,
    /// How many answer positions EvicPress's profiler scores: `fixed` (always 16) or `observed` (as many as this
    /// worker's requests generate, a moving average, at most 16).
    #[arg(long, default_value = "fixed")]
    evicpress_horizon: AnswerHorizon,
    /// Shrink each context's profiled quality toward its variant's mean over all contexts (empirical Bayes), so
    /// that a lucky profile over few answer positions does not pass for a lossless variant.
    #[arg(long)]
    evicpress_shrink: bool,
    /// Plan every context on each variant's mean quality over all contexts profiled, not on its own profile (full
    /// pooling; for contexts that lose about the same to each codec, where a few probes per context mostly add
    /// noise).
    #[arg(long)]
    evicpress_pooled_profiles: bool,
    /// How EvicPress's greedy step ranks the changes that make room on a full tier: `drop` (the paper's
    /// Algorithm 1: the least utility drop) or `per-byte` (the least utility drop per byte freed).
    #[arg(long, default_value = "drop")]
    evicpress_greedy: GreedyRule,
    /// EvicPress recomputes a context it would serve from a lossy copy once the quality regained over its
    /// expected reuses (α · quality gain · accesses so far) outweighs one prefill, and stores it again from full
    /// precision. Not in the paper's Algorithm 1.
    #[arg(long)]
    evicpress_upgrade: bool,
    /// A question EvicPress's profiler also scores every context on, besides the question of the request that
    /// computed it; repeat the flag for a set (at most 8, each 1..=32 tokens). The paper profiles a context on a
    /// set of queries (§4.1); a profile is then the mean over them, at one profiling run per question. None by
    /// default.
    #[arg(long = "evicpress-profile-question", value_name = "TEXT", value_parser = parse_profile_question)]
    evicpress_profile_questions: Vec<String>,
}

impl EngineArgs {
    fn admission(&self) -> AdmissionLimits {
        AdmissionLimits {
            max_requests: self.max_running.saturating_add(self.max_queued_requests),
            max_queued_prompt_tokens: self.max_queued_prompt_tokens,
        }
    }
}

/// One value of `--evicpress-keep-ratios`: a ratio in (0, 1), or `none` (no pruned copies).
#[derive(Debug, Clone, Copy)]
struct KeepRatio(Option<f64>);

fn parse_keep_ratio(s: &str) -> Result<KeepRatio, String> {
    if s.trim() == "none" {
        return Ok(KeepRatio(None));
    }
    let r: f64 = s.trim().parse().map_err(|_| format!("expected a number in (0, 1) or none, got {s:?}"))?;
    pagoda_worker::tiers::pruned::check_keep_ratios(&[r])?;
    Ok(KeepRatio(Some(r)))
}

/// Longest `--evicpress-profile-question` text accepted before tokenizing (the token bound is checked after).
const MAX_PROFILE_QUESTION_BYTES: usize = 512;

fn parse_profile_question(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("a profiling question cannot be empty".into());
    }
    if s.len() > MAX_PROFILE_QUESTION_BYTES {
        return Err(format!("a profiling question is at most {MAX_PROFILE_QUESTION_BYTES} bytes, got {}", s.len()));
    }
    Ok(s.to_owned())
}

/// The checks of `--evicpress-profile-question` that need no model: how many, and only with EvicPress.
fn check_profile_question_flags(e: &EngineArgs) -> Result<()> {
    let (n, most) = (e.evicpress_profile_questions.len(), pagoda_worker::placement::MAX_PROFILE_QUESTIONS);
    if n > 0 && e.tier_placement != "evicpress" {
        bail!("--evicpress-profile-question applies to --tier-placement evicpress");
    }
    if n > most {
        bail!("--evicpress-profile-question: at most {most} questions, got {n}");
    }
    Ok(())
}

/// The model's own tokenizer, read from its GGUF.
fn load_tokenizer(model: &Path) -> Result<pagoda_worker::model::Tokenizer> {
    let gguf = pagoda_worker::model::Gguf::open(model).context("cannot open the model")?;
    pagoda_worker::model::Tokenizer::from_gguf(&gguf).context("cannot read the tokenizer")
}

/// Tokenizes the profiling questions; their token bounds are checked where EvicPress takes them
/// (`EvicPress::new`).
fn tokenize_profile_questions(model: &Path, texts: &[String]) -> Result<Vec<Vec<u32>>> {
    if texts.is_empty() {
        return Ok(Vec::new());
    }
    let tok = load_tokenizer(model)?;
    Ok(texts.iter().map(|t| tok.encode(t, false)).collect())
}

fn keep_ratios(v: &[KeepRatio]) -> Vec<f64> {
    v.iter().filter_map(|k| k.0).collect()
}

fn parse_kv_dtype(s: &str) -> Result<KvDtype, String> {
    s.parse()
}

fn parse_device(s: &str) -> Result<Device, String> {
    s.parse()
}

fn parse_lora_spec(s: &str) -> Result<LoraSpec, String> {
    s.parse()
}

/// `pagoda lora synth`: a random adapter for the model's shape.
fn lora_synth(a: &LoraSynthArgs) -> Result<()> {
    use pagoda_worker::model::{Gguf, LoraTarget, ModelConfig, SyntheticLora};
    let path = resolve_model(&a.model)?;
    let gguf = Gguf::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let cfg = ModelConfig::from_gguf(&gguf).context("reading the model's shape")?;
    let targets = if a.targets.iter().any(|t| t == "all-linear") {
        LoraTarget::ALL.to_vec()
    } else {
        a.targets
            .iter()
            .map(|t| LoraTarget::from_module(t).with_context(|| format!("--targets: {t:?} is not a projection")))
            .collect::<Result<Vec<_>>>()?
    };
    if !(a.alpha.is_finite() && a.alpha > 0.0 && a.b_std.is_finite() && a.b_std >= 0.0) {
        bail!("--alpha must be positive and --b-std non-negative");
    }
    let spec = SyntheticLora { rank: a.rank, alpha: a.alpha, targets, seed: a.seed, b_std: a.b_std };
    pagoda_worker::model::lora::write_synthetic_peft(&a.out, &cfg, &spec)
        .with_context(|| format!("writing the adapter to {}", a.out.display()))?;
    println!("wrote a SYNTHETIC rank-{} adapter for {} to {}", a.rank, path.display(), a.out.display());
    Ok(())
}

#[derive(Args, Clone)]
struct HttpArgs {
    /// Largest accepted request body, in bytes: 1 KiB to 1 GiB.
    #[arg(long, default_value_t = pagoda_router::DEFAULT_BODY_LIMIT,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1024..=1 << 30))]
    body_limit: usize,
    /// Serve the model under this id instead of the GGUF file stem.
    #[arg(long)]
    model_id: Option<String>,
    /// API keys file: one `<key> <tenant> [rps=N] [burst=N] [concurrency=N]` per line, `#` comments (README,
    /// "API keys and tenants"). Every /v1 request then needs `Authorization: Bearer <key>`; without it auth is off.
    #[arg(long, env = "PAGODA_API_KEYS_FILE")]
    api_keys_file: Option<PathBuf>,
    /// File whose first non-comment line is the admin key, which opens the admin endpoints (/debug/*, /dashboard).
    #[arg(long, env = "PAGODA_ADMIN_KEY_FILE")]
    admin_key_file: Option<PathBuf>,
    /// Most generation requests in flight through this router; more get 503 with Retry-After (load shedding).
    #[arg(long, default_value_t = pagoda_router::DEFAULT_MAX_INFLIGHT,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    max_inflight: usize,
    /// Seconds the router waits on a client: for the rest of a request body (then 408), and for it to read the
    /// next piece of a streamed answer (then the generation is cancelled and its in-flight slot freed).
    #[arg(long, default_value_t = pagoda_router::DEFAULT_CLIENT_TIMEOUT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    client_timeout_secs: u64,
}

impl HttpArgs {
    /// `--client-timeout-secs` as the router's [`pagoda_router::RouterConfig::client_timeout`].
    fn client_timeout(&self) -> Duration {
        Duration::from_secs(self.client_timeout_secs)
    }
}

#[derive(Args)]
struct UpArgs {
    /// HTTP address of the router.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// gRPC address of the embedded worker (port 0 = any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    worker_listen: SocketAddr,
    /// gRPC address of the embedded one-voter kvstore (port 0 = any free port). Its raft log lives under
    /// DATA_DIR/kvstore, or in a temporary directory removed at exit without --data-dir.
    #[arg(long, default_value = "127.0.0.1:0")]
    kvstore_listen: SocketAddr,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    http: HttpArgs,
}

#[derive(Args)]
struct WorkerArgs {
    /// gRPC address to serve the Worker service on.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    /// kvstore node (host:port) to report block events, occupancy and heartbeats to; repeat or comma-separate for
    /// a cluster. Without it the worker reports nothing.
    #[arg(long, value_delimiter = ',')]
    kvstore: Vec<String>,
    /// This worker's id in the kvstore directory; keep it stable across restarts (default: HOSTNAME:PORT).
    #[arg(long, env = "PAGODA_WORKER_ID")]
    worker_id: Option<String>,
    /// The gRPC address routers reach this worker at, registered in the kvstore (default: the bound --listen
    /// address, or HOSTNAME:PORT when it listens on all interfaces).
    #[arg(long)]
    advertise: Option<String>,
    /// Never pull a prefix from the peer a router names (Transfer); recompute instead. The Transfer service still
    /// serves other workers.
    #[arg(long)]
    no_peer_fetch: bool,
    /// Longest a peer pull may take before the request is prefilled without it, in milliseconds.
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    peer_fetch_timeout_ms: u64,
    /// When to pull a hinted prefix: `cost` only when the measured peer bandwidth and prefill speed say the pull
    /// beats prefilling; `always` whenever the peer holds blocks this worker lacks.
    #[arg(long, default_value = "cost", value_parser = ["cost", "always"])]
    peer_fetch_policy: String,
    /// Disaggregated serving: `prefill` workers compute only the prompts of long requests, which `decode` workers
    /// then pull (Transfer) and decode; routers send a `decode` or `both` worker whole requests. Announced in
    /// `Health`, so routers need no configuration of their own.
    #[arg(long, default_value = "both", value_parser = ["both", "prefill", "decode"])]
    role: String,
    #[command(flatten)]
    etcd: EtcdArgs,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

/// The etcd registry (workers, routers and kvstore nodes register with 10 s leases).
#[derive(Args)]
struct EtcdArgs {
    /// etcd client endpoints (host:port or http://host:port), comma-separated or repeated. With it this process
    /// registers itself under --etcd-prefix, and --kvstore (and a router's --worker) may be left out: they are
    /// read from the registry.
    #[arg(long, value_delimiter = ',')]
    etcd: Vec<String>,
    /// The cluster's key prefix in etcd.
    #[arg(long, default_value = "/pagoda/default")]
    etcd_prefix: String,
}

impl EtcdArgs {
    fn config(&self) -> Result<Option<pagoda_registry::RegistryConfig>> {
        if self.etcd.is_empty() {
            return Ok(None);
        }
        let cfg = pagoda_registry::RegistryConfig::new(self.etcd.clone(), &self.etcd_prefix).context("--etcd")?;
        Ok(Some(cfg))
    }
}

/// Mutual TLS between components (all three files, or none: plaintext).
#[derive(Args)]
struct TlsArgs {
    /// This component's certificate (PEM). With --tls-key and --tls-ca, every gRPC server of this process asks
    /// clients for a certificate signed by the CA, and every gRPC call it makes presents this one and checks the
    /// server's certificate against the CA and the address dialled.
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// Private key of --tls-cert (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_ca"])]
    tls_key: Option<PathBuf>,
    /// The CA that signs every component's certificate (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// Installs the process's TLS identity, when one is given.
    fn install(&self) -> Result<()> {
        let (Some(cert), Some(key), Some(ca)) = (&self.tls_cert, &self.tls_key, &self.tls_ca) else { return Ok(()) };
        let files = pagoda_proto::tls::TlsFiles { cert: cert.clone(), key: key.clone(), ca: ca.clone() };
        pagoda_proto::tls::install(&files).context("--tls-cert/--tls-key/--tls-ca")?;
        tracing::info!(cert = %cert.display(), ca = %ca.display(), "mutual TLS between components");
        Ok(())
    }
}

/// How long a process waits for the registry to list the kvstore nodes it needs.
const REGISTRY_WAIT: Duration = Duration::from_secs(60);

/// The kvstore nodes to use: `--kvstore` when given (fixed), else every node registered in etcd (waiting for one),
/// kept current as nodes join and leave the registry.
async fn kvstore_endpoints(given: Vec<String>, etcd: Option<&pagoda_registry::RegistryConfig>) -> Result<Endpoints> {
    let Some(cfg) = etcd.filter(|_| given.is_empty()) else {
        if given.len() > pagoda_kvstore::endpoints::MAX_ENDPOINTS {
            bail!("at most {} --kvstore addresses, got {}", pagoda_kvstore::endpoints::MAX_ENDPOINTS, given.len());
        }
        return Ok(Endpoints::fixed(given));
    };
    let nodes = pagoda_registry::wait_for_members(cfg, pagoda_registry::Role::Kvstore, 1, REGISTRY_WAIT)
        .await
        .context("no kvstore node registered in etcd")?;
    let addrs: Vec<String> = nodes.into_iter().map(|m| m.address).collect();
    tracing::info!(kvstore = ?addrs, "kvstore nodes from the etcd registry");
    let (source, endpoints) = Endpoints::updating(addrs);
    tokio::spawn(follow_kvstore_membership(cfg.clone(), source));
    Ok(endpoints)
}

/// Keeps `source` equal to the kvstore nodes registered in etcd, until no one reads it any more.
async fn follow_kvstore_membership(cfg: pagoda_registry::RegistryConfig, source: EndpointsSource) {
    use pagoda_registry::MembershipEvent;
    let (mut events, watch) = pagoda_registry::watch(cfg, pagoda_registry::Role::Kvstore);
    let mut members: BTreeMap<String, String> = BTreeMap::new();
    while let Some(event) = events.recv().await {
        match event {
            MembershipEvent::Listed(all) => members = all.into_iter().map(|m| (m.id, m.address)).collect(),
            MembershipEvent::Joined(m) => {
                members.insert(m.id, m.address);
            }
            MembershipEvent::Left(id) => {
                members.remove(&id);
            }
        }
        if source.is_closed() {
            break;
        }
        let addrs: Vec<String> = members.values().cloned().collect();
        if source.publish(addrs.clone()) {
            tracing::info!(kvstore = ?addrs, "kvstore membership changed in the etcd registry");
        }
    }
    watch.abort();
}

#[derive(Args)]
struct RouterArgs {
    /// HTTP address to serve the OpenAI API on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Worker gRPC address (host:port); repeat for several workers. Required without --etcd; with it, workers come
    /// and go as they register (addresses given here stay regardless).
    #[arg(long = "worker", required_unless_present = "etcd")]
    workers: Vec<String>,
    /// How requests are placed: `kv` (prefix hits, prefill, load and queue cost), `prefix_overlap` (Dynamo's
    /// cost), `least_loaded` or `round_robin`.
    #[arg(long, default_value = "kv", value_parser = ["kv", "prefix_overlap", "least_loaded", "round_robin"])]
    placement: String,
    /// Sample placements with this temperature in seconds of cost instead of always taking the cheapest (spreads
    /// near-ties across router replicas).
    #[arg(long)]
    placement_temperature: Option<f64>,
    /// kvstore node (host:port): the router watches it for the workers' block events (failing over between nodes)
    /// and the dashboard shows its raft leader, term and apply lag; repeat or comma-separate for a cluster. Without
    /// it placement knows only its own predictions and the dashboard shows the kvstore as not configured.
    #[arg(long, value_name = "ADDR", value_delimiter = ',')]
    kvstore: Vec<String>,
    /// Disaggregated serving: a request whose chosen worker would compute at least this many prompt tokens has its
    /// prompt prefilled on a worker started with `--role prefill` first (when one is ready), and its worker pulls
    /// the KV instead of computing it. 0 turns remote prefill off.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(0..=1 << 24))]
    remote_prefill_min_tokens: u64,
    /// Conditional disaggregation: while the chosen prefill worker has this many prompt tokens queued (sent by this
    /// router and not answered yet), requests are prefilled by their own worker instead. 0: no bound.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1 << 32))]
    remote_prefill_max_queued_tokens: u64,
    /// Seconds without a report (block events or heartbeat) from a registered worker before the router raises the
    /// stale-reports alarm and leaves the worker out of placement.
    #[arg(long, default_value_t = 3.0)]
    stale_reports_secs: f64,
    #[command(flatten)]
    etcd: EtcdArgs,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    http: HttpArgs,
    #[command(flatten)]
    migration: MigrationArgs,
}

/// Request migration: when a worker counts as failed under a request, and how often the request moves on.
#[derive(Args)]
struct MigrationArgs {
    /// A stream that sends no token for this long (between tokens) moves to another worker, unless its worker still
    /// answers a health check (overloaded, not stuck: the wait goes on up to --first-token-timeout-ms).
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    stall_timeout_ms: u64,
    /// Longest wait from opening a worker stream to its first token (queueing and prefill), and the longest silence
    /// of any stream, before it moves.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    first_token_timeout_ms: u64,
    /// Re-issues to another worker per request after failures; the failure after the last one reaches the client.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(0..=16))]
    max_retries: u32,
}

impl MigrationArgs {
    fn config(&self) -> pagoda_router::MigrationConfig {
        pagoda_router::MigrationConfig {
            stall_timeout: Duration::from_millis(self.stall_timeout_ms),
            first_token_timeout: Duration::from_millis(self.first_token_timeout_ms),
            max_retries: self.max_retries,
        }
    }
}

#[derive(Args)]
struct KvstoreArgs {
    /// This node's raft id (> 0, unique in the cluster).
    #[arg(long)]
    node_id: u64,
    /// Address to serve the KvStore and Raft gRPC services on.
    #[arg(long, default_value = "0.0.0.0:7400")]
    listen: SocketAddr,
    /// The address other nodes and clients reach this node at (default: this node's --peer entry, else --listen).
    #[arg(long)]
    advertise: Option<String>,
    /// An initial voter as `<id>=<host:port>`; repeat for every voter (this node may be listed or not).
    #[arg(long = "peer", value_parser = parse_peer)]
    peers: Vec<(u64, String)>,
    /// Where the raft log, hard state and snapshots live (created when missing).
    #[arg(long)]
    data_dir: PathBuf,
    /// Join a running cluster (a leader adds this node with AddNode) instead of bootstrapping from --peer. With
    /// --etcd the node asks the registered nodes to add it.
    #[arg(long)]
    join: bool,
    /// Snapshot and compact the raft log every this many applied entries (at least 1).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    snapshot_every: u64,
    /// With --etcd and no --peer: wait until this many kvstore nodes (this one included) are registered and
    /// bootstrap the cluster from their registered raft addresses.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=7))]
    expect_voters: u64,
    #[command(flatten)]
    etcd: EtcdArgs,
    #[command(flatten)]
    tls: TlsArgs,
}

fn parse_peer(s: &str) -> Result<(u64, String), String> {
    let (id, addr) = s.split_once('=').ok_or_else(|| format!("{s:?} is not <id>=<host:port>"))?;
    let id: u64 = id.trim().parse().map_err(|e| format!("peer id {id:?}: {e}"))?;
    if id == 0 {
        return Err("peer id 0 is reserved".into());
    }
    if addr.trim().is_empty() {
        return Err(format!("peer {id} has no address"));
    }
    Ok((id, addr.trim().to_string()))
}

#[derive(Args)]
struct BenchKvstoreArgs {
    /// Seconds of sustained load.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    seconds: u64,
    /// Concurrent publishers (each one a worker with its own sequence numbers).
    #[arg(long, default_value_t = 8, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    publishers: usize,
    /// Block events per Publish (one raft entry).
    #[arg(long, default_value_t = 1000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    batch: usize,
    /// Where the nodes keep their data (default: a fresh directory under the system temp dir, removed after).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Block events/s a 3-node kvstore cluster (in process, loopback gRPC, redb on disk) sustains, and the
    /// event-to-visible latency a watcher on a follower sees.
    Kvstore(BenchKvstoreArgs),
    /// Prefill and decode throughput of the engine on the real model.
    Engine(BenchEngineArgs),
    /// Decode-attention bandwidth (bytes of K and V read per second) per KV format, batch size and context, on the
    /// CPU or a GPU, next to the machine's copy bandwidth.
    Kernels(bench_kernels::BenchKernelsArgs),
    /// Throughput under KV memory pressure: full cache against each eviction policy and budget, same load, same
    /// pool, one fresh engine per configuration.
    Eviction(BenchEvictionArgs),
    /// Serving a long context's prefix from the host (and disk) KV tier against recomputing it.
    Tiers(Box<BenchTiersArgs>),
    /// Load against a running router's OpenAI API (closed loop or open loop, streaming mix, shared-prefix and
    /// unique prompts); every completed answer is checked against the greedy reference of its prompt.
    Load(BenchLoadArgs),
    /// Placement strategies side by side: a multi-turn chat trace with shared system prompts replayed on fresh
    /// local worker processes behind a router of each strategy (TTFT, prefix hit rate, throughput, decision time).
    Routing(BenchRoutingArgs),
    /// Disaggregated serving against colocated: the same open-loop stream of long-prompt chat requests on two
    /// workers that both prefill and decode, and on a prefill worker and a decode worker (TTFT, inter-token latency,
    /// time per output token, throughput).
    Disaggregation(BenchDisaggArgs),
}

#[derive(Args)]
struct BenchDisaggArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Compute threads of each of the two workers.
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    worker_threads: usize,
    /// Requests per deployment and round.
    #[arg(long, default_value_t = 24, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=10_000))]
    requests: usize,
    /// Arrivals per second (a Poisson process).
    #[arg(long, default_value_t = 0.5)]
    rate: f64,
    #[arg(long, default_value_t = 400, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=6000))]
    min_prompt_words: usize,
    #[arg(long, default_value_t = 800, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=6000))]
    max_prompt_words: usize,
    /// Output tokens of every request (greedy, ignore_eos).
    #[arg(long, default_value_t = 96, value_parser = clap::value_parser!(u32).range(2..=4096))]
    max_tokens: u32,
    /// The disaggregated router's --remote-prefill-min-tokens.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=1 << 24))]
    remote_prefill_min_tokens: u64,
    /// Also run a third deployment, `conditional`: disaggregated with the router's
    /// --remote-prefill-max-queued-tokens at this bound (0: not run).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1 << 32))]
    remote_prefill_max_queued_tokens: u64,
    /// Rounds; each round runs the deployments in the reverse order of the one before.
    #[arg(long, default_value_t = 2, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=20))]
    rounds: usize,
    #[arg(long, default_value_t = 7)]
    seed: u64,
    #[command(flatten)]
    out: ClusterBenchOutput,
}

/// What every bench over local clusters shares: its deadline and where its report goes.
#[derive(Args)]
struct ClusterBenchOutput {
    /// Every request must end within this many seconds.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=3600))]
    deadline_secs: u64,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the report's chart into this PNG (routing: TTFT and prefix hit rate per strategy;
    /// disaggregation: inter-token latency and TTFT by percentile per deployment).
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Args)]
struct BenchRoutingArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Worker processes per strategy.
    #[arg(long, default_value_t = 4, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=16))]
    workers: usize,
    /// Compute threads of each worker.
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    worker_threads: usize,
    /// Strategies, comma-separated, run in this order.
    #[arg(long, value_delimiter = ',', default_value = "round_robin,least_loaded,prefix_overlap,kv",
          value_parser = ["kv", "prefix_overlap", "least_loaded", "round_robin"])]
    strategies: Vec<String>,
    #[arg(long, default_value_t = 4, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    system_prompts: usize,
    #[arg(long, default_value_t = 24, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1000))]
    conversations: usize,
    #[arg(long, default_value_t = 4, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=32))]
    turns: usize,
    /// Reply length cap per turn.
    #[arg(long, default_value_t = 24, value_parser = clap::value_parser!(u32).range(1..=1024))]
    max_tokens: u32,
    /// Each worker's KV pool in tokens (worker --kv-cache-tokens; 0 = the worker's default, two full contexts).
    #[arg(long, default_value_t = 0, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1 << 24))]
    worker_kv_tokens: usize,
    /// Each worker's host-RAM KV tier in MiB (worker --host-tier-mib; default: the worker's).
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    worker_host_tier_mib: Option<u64>,
    /// Milliseconds between the starts of consecutive conversations.
    #[arg(long, default_value_t = 150, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    conversation_gap_ms: u64,
    #[arg(long, default_value_t = 11)]
    seed: u64,
    /// Multi-LoRA trace: conversation c chats with adapter lora-{c mod N}, one of N SYNTHETIC adapters the workers
    /// load on demand (--lora-dir, --lora-on-demand). 0: the base model only.
    #[arg(long, default_value_t = 0, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=256))]
    lora_adapters: usize,
    /// Rank of the multi-LoRA trace's adapters (all seven projections).
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    lora_rank: usize,
    /// Each worker's adapter slots in a multi-LoRA trace (worker --max-loras).
    #[arg(long, default_value_t = 2, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    max_loras: usize,
    #[command(flatten)]
    out: ClusterBenchOutput,
}

#[derive(Args)]
struct BenchLoadArgs {
    /// The router's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    router: String,
    /// Model id to request (default: the first of the router's /v1/models).
    #[arg(long)]
    model_id: Option<String>,
    /// API key (when the router has a keys file).
    #[arg(long, env = "PAGODA_API_KEY")]
    api_key: Option<String>,
    /// `closed`: --concurrency requests in flight at all times; `open`: --rate arrivals per second.
    #[arg(long, default_value = "closed", value_parser = ["closed", "open"])]
    mode: String,
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=10_000))]
    concurrency: usize,
    /// Arrivals per second (open loop).
    #[arg(long, default_value_t = 4.0)]
    rate: f64,
    /// Open loop: arrivals beyond this many in flight are counted as shed by the client, not sent.
    #[arg(long, default_value_t = 1024, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    max_in_flight: usize,
    /// No request is sent after this many seconds.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    duration_secs: u64,
    /// No more requests than this are sent.
    #[arg(long, default_value_t = 100_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=10_000_000))]
    max_requests: usize,
    /// Every request must end within this many seconds (else it counts as lost).
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=3_600))]
    deadline_secs: u64,
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    max_tokens: u32,
    /// Which requests stream: all, none, or mixed (three of every four).
    #[arg(long, default_value = "mixed", value_parser = ["all", "none", "mixed"])]
    streaming: String,
    /// Prompts sharing a long common preamble (prefix caching matters) and prompts sharing nothing.
    #[arg(long, default_value_t = 6, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1000))]
    shared_prompts: usize,
    #[arg(long, default_value_t = 6, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1000))]
    unique_prompts: usize,
    /// Prefix every prompt with this many words of filler notes, different for each prompt and each
    /// --prompt-seed: long prompts that share no cached prefix (0: none).
    #[arg(long, default_value_t = 0, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=4096))]
    prompt_words: usize,
    /// Seed of the --prompt-words filler.
    #[arg(long, default_value_t = 0)]
    prompt_seed: u64,
    /// Every this many requests, one is urgent: it sends `"priority": --urgent-priority`, and the summary reports
    /// the urgent and the other requests apart (0: no class).
    #[arg(long, default_value_t = 0, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1_000_000))]
    urgent_every: usize,
    /// The priority urgent requests send (lower is more urgent on a server with --scheduling-policy priority); 0
    /// marks the class without asking for anything, for the same load against an FCFS server.
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    urgent_priority: i32,
    /// Skip the greedy reference (answers are then not checked).
    #[arg(long)]
    no_reference: bool,
    /// Also write the summary as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct BenchTiersArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Run the quantised matmuls in bf16 (the worker's --bf16-matmuls; zipf workload; every configuration alike).
    #[arg(long, alias = "amx")]
    bf16_matmuls: bool,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Compute threads (0 = all cores).
    #[arg(long, default_value_t = 0, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1024))]
    threads: usize,
    /// Prompt length.
    #[arg(long, default_value_t = 2048, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 20))]
    context_tokens: usize,
    /// Repeats (fresh prompts); the report keeps medians.
    #[arg(long, default_value_t = 3, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100))]
    repeats: usize,
    /// Host tier size in MiB (also the disk tier's).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(0..=1 << 24))]
    host_tier_mib: u64,
    /// Also measure the disk tier with files under this directory (removed afterwards). For `--workload zipf`:
    /// where each configuration's disk tier lives.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// 2k: also onboard the prefix from host with every group stored in each of these codecs, comma-separated
    /// (`--tier-codec`: int8, fp8_e4m3, fp8_e4m3_rotated, bf16, int4_kivi, int2_kivi).
    #[arg(long, value_delimiter = ',')]
    onboard_codecs: Vec<String>,
    /// `2k`: one long prefix from host/disk against recomputing it. `zipf`: EvicPress against recompute, LRU and
    /// each fixed codec + LRU on contexts reused with a Zipf distribution (the flags below).
    #[arg(long, default_value = "2k", value_parser = ["2k", "zipf"])]
    workload: String,
    /// zipf: number of contexts.
    #[arg(long, default_value_t = 200)]
    contexts: usize,
    /// zipf: shortest and longest context in tokens.
    #[arg(long, default_value_t = 1024)]
    min_context_tokens: usize,
    #[arg(long, default_value_t = 4096)]
    max_context_tokens: usize,
    /// zipf: requests (each a short question on one context).
    #[arg(long, default_value_t = 600)]
    requests: usize,
    /// zipf: the Zipf exponent of context reuse.
    #[arg(long, default_value_t = 1.1)]
    zipf_s: f64,
    /// zipf: tokens generated per request (the answer compared with recompute's).
    #[arg(long, default_value_t = 4)]
    answer_tokens: usize,
    /// zipf: device KV pool in tokens.
    #[arg(long, default_value_t = 8192, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 24))]
    device_tokens: usize,
    /// zipf: disk tier in MiB under --data-dir (the host tier is --host-tier-mib).
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u64).range(0..=1 << 24))]
    disk_tier_mib: u64,
    /// zipf: codecs of the fixed-codec baselines and EvicPress's variants, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "int8,fp8_e4m3,int4_kivi,int2_kivi")]
    codecs: Vec<String>,
    /// zipf: EvicPress's α, comma-separated for one EvicPress configuration each (the quality–TTFT curve).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    evicpress_alpha: Vec<f64>,
    /// zipf: EvicPress's token-dropping ratios, comma-separated (`none`: whole contexts only).
    #[arg(long, value_delimiter = ',', default_value = "0.5,0.25", value_parser = parse_keep_ratio)]
    evicpress_keep_ratios: Vec<KeepRatio>,
    /// zipf: prose for the contexts (random tokens when the directory has no text).
    #[arg(long, default_value = "data/prose")]
    prose_dir: PathBuf,
    /// zipf: draw mean TTFT against quality, one point per configuration, into this PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// zipf: do not run: print the tables of a JSON report written by `--json` (a finished or stopped run), and
    /// draw it with `--plot`.
    #[arg(long)]
    from_json: Option<PathBuf>,
    /// zipf: the EvicPress paper's offline phase: every configuration but recompute ingests each context once,
    /// untimed, with a training question no measured request asks, before the measured requests.
    #[arg(long)]
    offline_phase: bool,
    /// zipf, with --offline-phase: keep the contexts' prefilled KV in this directory after the run (about 12.5 GB
    /// at full size) and reuse what it holds from an earlier run of the same model and workload. Default: under
    /// --data-dir, removed afterwards.
    #[arg(long)]
    offline_seed_dir: Option<PathBuf>,
    /// zipf: how EvicPress's profiler scores a variant: `forced` (one teacher-forced step over the reference
    /// answer) or `free` (the variant's own greedy answer against the reference, as a request would get it).
    #[arg(long, default_value = "forced")]
    evicpress_profile: ProfileScoring,
    /// zipf: how many answer positions EvicPress's profiler scores: `fixed` (16) or `observed` (the requests'
    /// answer length, --answer-tokens).
    #[arg(long, default_value = "fixed")]
    evicpress_horizon: AnswerHorizon,
    /// zipf: shrink EvicPress's profiles toward each variant's mean (empirical Bayes).
    #[arg(long)]
    evicpress_shrink: bool,
    /// zipf: plan every context on each variant's mean quality over all contexts profiled (full pooling).
    #[arg(long)]
    evicpress_pooled_profiles: bool,
    /// zipf: EvicPress's greedy rule, comma-separated for one EvicPress configuration per rule and α: `drop`
    /// (the paper's least utility drop) or `per-byte` (least utility drop per byte freed).
    #[arg(long, value_delimiter = ',', default_value = "drop")]
    evicpress_greedy: Vec<GreedyRule>,
    /// zipf: profiling questions EvicPress scores each context on besides the request's own (the paper's query
    /// set per context; 0..=4 of a fixed list no measured request asks).
    #[arg(long, default_value_t = 0, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=4))]
    evicpress_profile_questions: usize,
    /// zipf: EvicPress recomputes a context served from a lossy copy once that pays by its utility
    /// (`serve --evicpress-upgrade`); comma-separated for one EvicPress configuration per value.
    #[arg(long, value_delimiter = ',', default_value = "false")]
    evicpress_upgrade: Vec<bool>,
    /// zipf: KIVI's full-precision residual in tokens (`serve --kivi-residual-tokens`), for the int4_kivi and
    /// int2_kivi baselines and EvicPress alike; comma-separated for one such configuration per value. 0: none.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    kivi_residual_tokens: Vec<usize>,
    /// zipf: layers whose blocks the KIVI codecs store in int8 (`serve --kivi-int8-layers`), for the int4_kivi
    /// and int2_kivi baselines and EvicPress's KIVI variants alike. Default: none.
    #[arg(long, value_delimiter = ',')]
    kivi_int8_layers: Vec<usize>,
    /// zipf: the baselines to run besides recompute, comma-separated (`lru`, `lru+CODEC` for a --codecs entry).
    /// Default: all of them.
    #[arg(long, value_delimiter = ',')]
    baselines: Option<Vec<String>>,
    /// zipf: share of the contexts (0..=1) that are synthetic task items (passkey, multikey_niah, kv_retrieval,
    /// variable_tracking, common_words in turn), each asked its own question, instead of prose windows.
    #[arg(long, default_value_t = 0.0)]
    task_share: f64,
    /// zipf: arrivals per second of the measured requests (a seeded Poisson process, the same for every
    /// configuration); each request is submitted at its arrival and its TTFT counts from it, queueing included.
    /// 0: one request at a time, no queueing.
    #[arg(long, default_value_t = 0.0)]
    arrival_rate: f64,
}

#[derive(Args)]
struct BenchEvictionArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw tokens/s and the largest running batch against budget into this PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Compute threads (0 = all cores).
    #[arg(long, default_value_t = 0, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1024))]
    threads: usize,
    /// Requests submitted at once.
    #[arg(long, default_value_t = 64, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    requests: usize,
    /// Prompt length of every request.
    #[arg(long, default_value_t = 1024, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 20))]
    prompt_tokens: usize,
    /// Tokens every request generates (EOS is ignored).
    #[arg(long, default_value_t = 512, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 20))]
    new_tokens: usize,
    /// The KV pool holds exactly this many full-cache sequences of prompt + new tokens.
    #[arg(long, default_value_t = 8, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    pool_seqs: usize,
    /// Policies, comma-separated; `full` is the baseline and runs once. Default: every policy.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "full,streaming,knorm,keydiff,paged_eviction,sage,snapkv,h2o,kv_compress"
    )]
    policies: Vec<String>,
    /// KV budgets in tokens per (layer, kv-head), comma-separated; every non-full policy runs at each.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 20))]
    budgets: Vec<usize>,
    /// Token budget of one engine step.
    #[arg(long, default_value_t = 512, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=65_536))]
    max_step_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 64, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=4096))]
    max_running: usize,
    /// Token slots per KV block, 1 to 256 (the largest block the KV tier codecs encode).
    #[arg(long, default_value_t = 16,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_BLOCK_SIZE as u64))]
    block_size: usize,
    /// Seed of the prompts.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Runs of every configuration, round-robin; the report keeps each one's median run by tokens/s (more than one
    /// evens out a shared or noisy machine).
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100))]
    repeats: usize,
    /// Admission: `reserve` (the engine default) or `greedy`.
    #[arg(long, default_value = "reserve", value_parser = ["reserve", "greedy"])]
    admission: String,
    /// Element type of the device KV cache (f16, f32, int8, fp8_e4m3, fp8_e4m3_rotated); the pool keeps the memory
    /// of --pool-seqs f16 sequences, so the 8-bit dtypes hold more blocks in it.
    #[arg(long, default_value = "f16", value_parser = parse_kv_dtype)]
    kv_dtype: KvDtype,
    /// Compute device: cpu, or cuda / cuda:N (binaries built with `--features cuda`; H2O and KV-Compress run on
    /// the CPU only).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: Device,
}

#[derive(Args)]
struct BenchEngineArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Measure LoRA adapters beside the base model (repeatable, NAME=DIR): every phase again with all sequences
    /// on the first adapter, and with two or more, the adapters in turn across the batch.
    #[arg(long = "lora", value_name = "NAME=DIR", value_parser = parse_lora_spec)]
    lora: Vec<LoraSpec>,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Compute threads (0 = all cores).
    #[arg(long, default_value_t = 0, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1024))]
    threads: usize,
    /// Token slots per KV block, 1 to 256 (the largest block the KV tier codecs encode).
    #[arg(long, default_value_t = 16,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_BLOCK_SIZE as u64))]
    block_size: usize,
    /// Engine step budget for the prefill measurement.
    #[arg(long, default_value_t = 512, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=65_536))]
    max_step_tokens: usize,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 1024, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 20))]
    prefill_tokens: usize,
    /// Prompt length of each decode sequence.
    #[arg(long, default_value_t = 512, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 20))]
    decode_prompt_tokens: usize,
    /// New tokens per decode sequence.
    #[arg(long, default_value_t = 128, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 20))]
    decode_new_tokens: usize,
    /// Decode concurrencies, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=4096))]
    concurrency: Vec<usize>,
    /// Element type of the KV cache: f16, f32, int8, fp8_e4m3 or fp8_e4m3_rotated.
    #[arg(long, default_value = "f16", value_parser = parse_kv_dtype)]
    kv_dtype: KvDtype,
    /// Run the quantised matmuls in bf16 over weights widened to bf16 once (+2 bytes per weight): on AMX tiles where
    /// the CPU has them (faster prefill and batched decode), else with AVX-512 BF16 dot products; logits closer to
    /// float32, slower single-stream decode. Refused on CPUs with neither. (`--amx` is the old name.)
    #[arg(long, alias = "amx")]
    bf16_matmuls: bool,
    /// SYNTHETIC WEIGHTS: bench a model of this llama shape filled with random weights; it replaces --model
    /// (throughput only; outputs are meaningless). A preset (smollm2-135m, llama-1b, llama-8b) or a list such as
    /// layers=2,hidden=256,heads=4,kv_heads=2,ffn=512,vocab=1024.
    #[arg(long, value_parser = parse_synthetic_spec)]
    synthetic_model: Option<SyntheticSpec>,
    /// Storage format of the synthetic weights: q4_1 (as the real model), q8_0 or f16.
    #[arg(long, default_value = "q4_1", value_parser = parse_synthetic_weights, requires = "synthetic_model")]
    synthetic_weights: WeightType,
    /// Compute device: cpu, or cuda / cuda:N (binaries built with `--features cuda`).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: Device,
}

fn parse_synthetic_spec(s: &str) -> Result<SyntheticSpec, String> {
    s.parse().map_err(|e: pagoda_worker::model::ModelError| e.to_string())
}

fn parse_synthetic_weights(s: &str) -> Result<WeightType, String> {
    pagoda_worker::model::parse_synthetic_weights(s).map_err(|e| e.to_string())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let telemetry = telemetry::init(service_name(&cli.command))?;
    let res = match cli.command {
        Command::Bench(BenchCommand::Engine(args)) => bench_engine(args),
        Command::Bench(BenchCommand::Kernels(args)) => bench_kernels::run(args),
        Command::Eval(args) => eval(args),
        Command::Bench(BenchCommand::Eviction(args)) => bench_eviction(args),
        Command::Bench(BenchCommand::Tiers(args)) => bench_tiers(*args),
        Command::Bench(BenchCommand::Load(args)) => run_async(bench_load(args)),
        Command::Bench(BenchCommand::Routing(args)) => run_async(bench_routing(args)),
        Command::Bench(BenchCommand::Disaggregation(args)) => run_async(bench_disaggregation(args)),
        Command::Up(a) => run_async(up(a)),
        Command::Worker(a) => run_async(worker(a)),
        Command::Router(a) => run_async(router(a)),
        Command::CheckArgs(a) => check_args(&a.argv),
        Command::Kvstore(a) => run_async(kvstore(a)),
        Command::Bench(BenchCommand::Kvstore(a)) => run_async(bench_kvstore(a)),
        Command::Lora(LoraCommand::Synth(a)) => lora_synth(&a),
    };
    // After the servers drained (SIGTERM included): the last spans reach the collector before the process ends.
    telemetry.shutdown();
    res
}

/// The process's name in its traces when `OTEL_SERVICE_NAME` is not set.
fn service_name(command: &Command) -> &'static str {
    match command {
        Command::Up(_) => "pagoda",
        Command::Worker(_) => "pagoda-worker",
        Command::Router(_) => "pagoda-router",
        Command::Bench(_) => "pagoda-bench",
        Command::Eval(_) => "pagoda-eval",
        Command::CheckArgs(_) => "pagoda-check-args",
        Command::Kvstore(_) => "pagoda-kvstore",
        Command::Lora(_) => "pagoda-lora",
    }
}

/// `pagoda check-args -- ARGV...`: the clap parse of ARGV plus the start-up checks that need no files or network
/// (the default KV policy and budget, the profiling questions' count), so a deployment's command line fails here
/// rather than in a crash loop.
fn check_args(argv: &[String]) -> Result<()> {
    let cli = Cli::try_parse_from(argv).map_err(|e| {
        let text = e.render().to_string();
        anyhow::anyhow!("{}", text.trim_start_matches("error: ").trim_end())
    })?;
    let engine = match &cli.command {
        Command::Up(a) => Some(&a.engine),
        Command::Worker(a) => Some(&a.engine),
        Command::CheckArgs(_) => bail!("check-args does not check itself"),
        _ => None,
    };
    if let Some(e) = engine {
        PolicySpec::parse(Some(&e.kv_policy), Some(e.kv_budget), PolicySpec::full(), usize::MAX)
            .context("--kv-policy / --kv-budget")?;
        check_profile_question_flags(e)?;
    }
    println!("ok: {}", argv.join(" "));
    Ok(())
}

fn run_async(fut: impl std::future::Future<Output = Result<()>>) -> Result<()> {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().context("cannot start the tokio runtime")?;
    let res = runtime.block_on(fut);
    // Dropping the runtime would wait for every blocking task without end, an engine that did not stop in time
    // ([`stop_engine`]) included; everything that had to finish has finished by now.
    runtime.shutdown_timeout(Duration::from_secs(1));
    res
}

/// Where the repository (scripts/, models/) is: the current directory when it has scripts/fetch-model.sh,
/// else the source tree this binary was built from.
fn repo_root() -> PathBuf {
    if Path::new("scripts/fetch-model.sh").exists() {
        return PathBuf::from(".");
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The model file to use: `--model` as given (it must exist), or the default, fetched when missing.
fn resolve_model(args: &ModelArgs) -> Result<PathBuf> {
    if let Some(p) = &args.model {
        if !p.is_file() {
            bail!("model file {} does not exist", p.display());
        }
        return Ok(p.clone());
    }
    let cwd_default = PathBuf::from(DEFAULT_MODEL);
    if cwd_default.is_file() {
        return Ok(cwd_default);
    }
    let root = repo_root();
    let path = root.join(DEFAULT_MODEL);
    if path.is_file() {
        return Ok(path);
    }
    let script = root.join("scripts/fetch-model.sh");
    eprintln!("model {} is missing; fetching it with {} ...", path.display(), script.display());
    let status = std::process::Command::new("bash")
        .arg(&script)
        .arg(root.join("models"))
        .status()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !status.success() {
        bail!("{} failed ({status}); fetch the model by hand or pass --model PATH", script.display());
    }
    if !path.is_file() {
        bail!("{} finished but {} is still missing", script.display(), path.display());
    }
    Ok(path)
}

fn speculative_config(e: &EngineArgs) -> Result<NgramConfig> {
    let cfg = NgramConfig {
        num_tokens: e.speculative_tokens,
        min_n: e.speculative_ngram_min,
        max_n: e.speculative_ngram_max,
        max_batch: e.speculative_max_batch,
        draft_cost: e.speculative_draft_cost,
    };
    cfg.validate().map_err(|m| anyhow!(m)).context("--speculative-*")?;
    Ok(cfg)
}

fn engine_config(model: &Path, e: &EngineArgs) -> Result<EngineConfig> {
    let default_policy = PolicySpec::parse(Some(&e.kv_policy), Some(e.kv_budget), PolicySpec::full(), usize::MAX)
        .context("--kv-policy / --kv-budget")?;
    Ok(EngineConfig {
        model_path: model.to_path_buf(),
        num_blocks: e.num_blocks,
        kv_cache_tokens: e.kv_cache_tokens,
        block_size: e.block_size,
        max_step_tokens: e.max_step_tokens,
        max_running: e.max_running,
        enable_prefix_cache: !e.no_prefix_cache,
        threads: e.threads,
        default_policy,
        reserve: ReserveConfig::from_name(&e.admission).context("--admission")?,
        scheduling: SchedulingPolicy::from_name(&e.scheduling_policy).context("--scheduling-policy")?,
        tiers: tier_config(e)?,
        kv_dtype: e.kv_dtype,
        bf16_matmuls: e.bf16_matmuls,
        fp8_keys_for_queries: e.fp8_key_rounding == "queries",
        synthetic: None,
        device: e.device,
        kivi_residual_tokens: e.kivi_residual_tokens,
        kivi_int8_layers: e.kivi_int8_layers.clone(),
        speculative: speculative_config(e)?,
        lora: e.lora.clone(),
        max_lora_rank: e.max_lora_rank,
        lora_dir: e.lora_dir.clone(),
        max_loras: e.max_loras,
        lora_on_demand: e.lora_on_demand,
        placement: TierPlacement::from_flags(
            &e.tier_placement,
            &e.tier_codec,
            EvicPressConfig {
                alpha: e.evicpress_alpha,
                keep_ratios: keep_ratios(&e.evicpress_keep_ratios),
                scoring: e.evicpress_profile,
                horizon: e.evicpress_horizon,
                shrink: e.evicpress_shrink,
                pooled: e.evicpress_pooled_profiles,
                greedy: e.evicpress_greedy,
                upgrade: e.evicpress_upgrade,
                ..EvicPressConfig::default()
            },
        )
        .map_err(|m| anyhow!(m))?,
    })
}

fn tier_config(e: &EngineArgs) -> Result<TierConfig> {
    let mib = |n: u64, flag: &str| n.checked_mul(1 << 20).with_context(|| format!("{flag} {n} is too large"));
    let cfg = TierConfig {
        data_dir: e.data_dir.clone(),
        host_bytes: mib(e.host_tier_mib, "--host-tier-mib")?,
        disk_bytes: mib(e.disk_tier_mib, "--disk-tier-mib")?,
    };
    if cfg.disk_bytes > 0 && cfg.data_dir.is_none() {
        bail!("--disk-tier-mib needs --data-dir");
    }
    Ok(cfg)
}

async fn start_engine(model: &Path, e: &EngineArgs) -> Result<EngineHandle> {
    check_profile_question_flags(e)?;
    let mut cfg = engine_config(model, e)?;
    let questions = e.evicpress_profile_questions.clone();
    let shown = model.display().to_string();
    tracing::info!(model = %shown, "loading model");
    let engine = tokio::task::spawn_blocking(move || -> Result<EngineHandle> {
        if let TierPlacement::EvicPress(ep) = &mut cfg.placement {
            ep.profile_questions = tokenize_profile_questions(&cfg.model_path, &questions)?;
        }
        Ok(Engine::start(cfg)?)
    })
    .await
    .context("engine start panicked")?
    .with_context(|| format!("cannot start the engine on {shown}"))?;
    let info = engine.model_info();
    tracing::info!(
        model = %info.model_id,
        context = info.context_length,
        kv_blocks = info.num_blocks,
        block_size = info.block_size,
        "engine ready"
    );
    Ok(engine)
}

/// Loads the keys file and admin key file, failing at start on any malformed line.
fn load_security(http: &HttpArgs) -> Result<Security> {
    Security::load(http.api_keys_file.as_deref(), http.admin_key_file.as_deref())
        .context("cannot load the API keys (--api-keys-file / --admin-key-file)")
}

async fn load_codec(model: &Path, http: &HttpArgs) -> Result<Arc<dyn TextCodec>> {
    let path = model.to_path_buf();
    let mut codec = tokio::task::spawn_blocking(move || GgufCodec::load(&path))
        .await
        .context("tokenizer load panicked")?
        .map_err(anyhow::Error::msg)
        .context("cannot load the tokenizer and chat template")?;
    if let Some(id) = &http.model_id {
        codec = codec.with_model_id(id.clone());
    }
    Ok(Arc::new(codec))
}

/// A watch channel that flips to `true` on Ctrl-C or SIGTERM. A second one exits the process at once, without
/// the rest of the drain: once the handler is installed the signal no longer kills the process by default, and
/// an operator pressing Ctrl-C again (or a supervisor sending SIGTERM again) means not to wait.
fn shutdown_signal() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let mut signals = StopSignals::new();
        signals.next().await;
        tracing::info!("shutting down; a second Ctrl-C or SIGTERM exits at once");
        let _ = tx.send(true);
        let signo = signals.next().await;
        eprintln!("a second stop signal: exiting now, without finishing the drain");
        std::process::exit(128 + signo);
    });
    rx
}

/// SIGINT (Ctrl-C) and, on Unix, SIGTERM, as one sequence of stop requests. On Unix both are listened to for the
/// life of the process, so a signal arriving between two waits is not lost.
struct StopSignals {
    #[cfg(unix)]
    interrupt: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    terminate: Option<tokio::signal::unix::Signal>,
}

impl StopSignals {
    fn new() -> StopSignals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let listen = |kind: SignalKind, name: &str| {
                signal(kind).inspect_err(|e| tracing::warn!("cannot listen for {name}: {e}")).ok()
            };
            StopSignals {
                interrupt: listen(SignalKind::interrupt(), "Ctrl-C"),
                terminate: listen(SignalKind::terminate(), "SIGTERM"),
            }
        }
        #[cfg(not(unix))]
        StopSignals {}
    }

    /// Waits for the next stop signal and returns its number (never, if neither could be listened to).
    async fn next(&mut self) -> i32 {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = recv_or_never(&mut self.interrupt) => 2,
                _ = recv_or_never(&mut self.terminate) => 15,
            }
        }
        #[cfg(not(unix))]
        {
            if let Err(e) = tokio::signal::ctrl_c().await {
                tracing::warn!("cannot listen for Ctrl-C: {e}");
                std::future::pending::<()>().await;
            }
            2
        }
    }
}

/// The next delivery of `signal`; never when it could not be listened to.
#[cfg(unix)]
async fn recv_or_never(signal: &mut Option<tokio::signal::unix::Signal>) {
    match signal {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// A process's drain trigger: SIGINT/SIGTERM ([`shutdown_signal`]), the engine thread stopping by itself (a
/// panic), or a caller's [`Shutdown::stop_because`] (another embedded part that stopped). A part that stopped by
/// itself is kept as the reason, and the process exits non-zero with it: a supervisor then restarts it, where it
/// would otherwise stay up failing every request.
struct Shutdown {
    tx: Arc<watch::Sender<bool>>,
    rx: watch::Receiver<bool>,
    reason: Arc<std::sync::OnceLock<String>>,
}

/// How often the engine thread is checked for having stopped.
const ENGINE_WATCH: Duration = Duration::from_millis(500);

impl Shutdown {
    fn on_signal_or_engine_exit(engine: &EngineHandle) -> Shutdown {
        let signal = shutdown_signal();
        let (tx, rx) = watch::channel(false);
        let shutdown = Shutdown { tx: Arc::new(tx), rx, reason: Arc::new(std::sync::OnceLock::new()) };
        let (tx, reason, engine) = (shutdown.tx.clone(), shutdown.reason.clone(), engine.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = wait_for(signal) => {}
                _ = async { while engine.is_running() { tokio::time::sleep(ENGINE_WATCH).await } } => {
                    let _ = reason.set("the engine stopped by itself".to_owned());
                }
                // Another trigger fired: nothing left to watch.
                _ = wait_for(tx.subscribe()) => {}
            }
            let _ = tx.send(true);
        });
        shutdown
    }

    fn rx(&self) -> watch::Receiver<bool> {
        self.rx.clone()
    }

    fn stop_because(&self, why: String) {
        tracing::error!("{why}: shutting down");
        let _ = self.reason.set(why);
        let _ = self.tx.send(true);
    }

    /// What stopped by itself, if anything did: the process's exit error.
    fn failure(&self) -> Result<()> {
        match self.reason.get() {
            Some(why) => Err(anyhow::anyhow!("{why}")),
            None => Ok(()),
        }
    }
}

async fn wait_for(mut rx: watch::Receiver<bool>) {
    while !*rx.borrow() {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Serves the Worker and Transfer services on one listener; `peer_fetch` turns on pulling hinted prefixes.
/// What a worker's gRPC server serves besides the engine.
struct WorkerServing {
    worker_id: String,
    /// `--role`, announced in `Health`.
    role: String,
    /// The engine's device: GPU workers carry peer payloads over NCCL links where both ends can.
    device: Device,
    admission: AdmissionLimits,
    peer_fetch: Option<PeerFetchConfig>,
    /// The block-event reporter's progress, when the worker reports to a kvstore.
    report_progress: Option<std::sync::Arc<pagoda_worker::reporter::ReportProgress>>,
}

async fn serve_worker(
    listener: TcpListener,
    engine: EngineHandle,
    serving: WorkerServing,
    shutdown: watch::Receiver<bool>,
) -> Result<()> {
    let WorkerServing { worker_id, role, device, admission, peer_fetch, report_progress } = serving;
    let links = device_links(device);
    match &links {
        Ok(_) => tracing::info!(%device, "peer payloads go over NCCL links to GPU peers that accept them"),
        Err(why) => tracing::debug!(%device, why, "peer payloads go over gRPC only"),
    }
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let counters = std::sync::Arc::new(PeerCounters::default());
    let mut service = WorkerService::new(engine.clone())
        .with_worker_id(worker_id)
        .with_role(role)
        .with_admission(admission)
        .with_peer_counters(counters.clone());
    if let Some(progress) = report_progress {
        service = service.with_report_progress(progress);
    }
    if let Some(cfg) = peer_fetch {
        let mut fetcher = PeerFetcher::new(engine.clone(), counters.clone(), cfg);
        if let Ok(factory) = &links {
            fetcher = fetcher.with_device_links(factory.clone());
        }
        service = service.with_peer_fetch(fetcher);
    }
    pagoda_proto::tls::server()?
        .add_service(service.into_server())
        .add_service(TransferService::new(engine, counters).with_device_links(links).into_server())
        .serve_with_incoming_shutdown(incoming, wait_for(shutdown))
        .await?;
    Ok(())
}

/// How this worker joins NCCL links to GPU peers, or why it cannot (a CPU worker, a build without CUDA, or no
/// libnccl): then peers' payloads go over gRPC.
fn device_links(device: Device) -> std::result::Result<Arc<dyn LinkFactory>, String> {
    match device {
        Device::Cpu => Err("this worker runs on the CPU".into()),
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => {
            pagoda_worker::peer_link_nccl::NcclLinks::new(ordinal).map(|links| Arc::new(links) as Arc<dyn LinkFactory>)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err("this binary was built without the cuda feature".into()),
    }
}

/// How long the engine gets to stop after the drain: it offloads idle KV and writes the host tier to disk.
/// Within Kubernetes' default 30 s grace period, after the drain.
const ENGINE_STOP: Duration = Duration::from_secs(20);

/// Stops the engine thread, waiting at most [`ENGINE_STOP`]: past that the process exits and the thread with it.
/// The disk tier loses nothing it already reported: each block file is written whole and then renamed.
async fn stop_engine(engine: EngineHandle) {
    let stopping = tokio::task::spawn_blocking(move || engine.shutdown());
    if tokio::time::timeout(ENGINE_STOP, stopping).await.is_err() {
        tracing::error!(
            seconds = ENGINE_STOP.as_secs(),
            "the engine did not stop in time; exiting without the rest of its host tier written to disk"
        );
    }
}

/// Runs `fut` until it ends, or until `DRAIN` after the shutdown signal (streams may keep a server busy).
async fn until_drained<T>(fut: impl std::future::Future<Output = T>, shutdown: watch::Receiver<bool>) -> Option<T> {
    tokio::select! {
        r = fut => Some(r),
        _ = async { wait_for(shutdown).await; tokio::time::sleep(DRAIN).await } => None,
    }
}

async fn bind(addr: SocketAddr, what: &str) -> Result<TcpListener> {
    TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr} for the {what}"))
}

async fn up(args: UpArgs) -> Result<()> {
    let security = load_security(&args.http)?;
    let model = resolve_model(&args.model)?;
    let engine = start_engine(&model, &args.engine).await?;
    let shutdown = Shutdown::on_signal_or_engine_exit(&engine);
    let worker_listener = bind(args.worker_listen, "worker").await?;
    let worker_addr = worker_listener.local_addr().context("worker address")?;
    let router_listener = bind(args.listen, "router").await?;
    let router_addr = router_listener.local_addr().context("router address")?;
    // The embedded directory: a one-voter raft that elects itself at once.
    let (kv_dir, kv_dir_is_temp) = match &args.engine.data_dir {
        Some(d) => (d.join("kvstore"), false),
        None => {
            sweep_dead_temp_dirs(&std::env::temp_dir(), TEMP_KVSTORE_PREFIX);
            (std::env::temp_dir().join(format!("{TEMP_KVSTORE_PREFIX}{}", std::process::id())), true)
        }
    };
    let mut kvstore = pagoda_kvstore::start_embedded(kv_dir.clone(), args.kvstore_listen)
        .await
        .with_context(|| format!("cannot start the embedded kvstore in {}", kv_dir.display()))?;
    let kv_addr = kvstore.addr.to_string();
    let worker_id = format!("{}:{}", hostname(), worker_addr.port());
    let reporter = pagoda_worker::reporter::spawn(
        engine.clone(),
        pagoda_worker::reporter::ReporterConfig::new(
            worker_id.clone(),
            worker_addr.to_string(),
            Endpoints::fixed(vec![kv_addr.clone()]),
        ),
    )
    .context("cannot start block-event reporting")?;
    let codec = load_codec(&model, &args.http).await?;
    let model_id = codec.model_id().to_string();
    let config = RouterConfig {
        workers: vec![worker_addr.to_string()],
        body_limit: args.http.body_limit,
        max_inflight: args.http.max_inflight,
        client_timeout: args.http.client_timeout(),
        security,
        kvstore: Endpoints::fixed(vec![kv_addr.clone()]),
        ..RouterConfig::default()
    };
    println!("pagoda kvstore listening on {kv_addr}");
    println!("pagoda worker listening on {worker_addr}");
    println!("pagoda router listening on http://{router_addr}");
    println!(
        "serving {model_id}: try  curl http://{router_addr}/v1/chat/completions -H 'content-type: application/json' \
              -d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'"
    );
    // One worker has no peer to pull from.
    let serving = WorkerServing {
        worker_id,
        role: "both".into(),
        device: args.engine.device,
        admission: args.engine.admission(),
        peer_fetch: None,
        report_progress: Some(reporter.progress.clone()),
    };
    let worker_task = tokio::spawn(serve_worker(worker_listener, engine.clone(), serving, shutdown.rx()));
    let router_fut = pagoda_router::serve(router_listener, codec, config, wait_for(shutdown.rx()));
    tokio::pin!(router_fut);
    // The embedded kvstore stopping by itself (a fatal storage error) drains the rest, as a signal would.
    let res = tokio::select! {
        r = &mut router_fut => Some(r),
        r = kvstore.wait() => {
            shutdown.stop_because(match r {
                Ok(()) => "the embedded kvstore stopped".to_owned(),
                Err(e) => format!("the embedded kvstore stopped: {e}"),
            });
            None
        }
    };
    let res = match res {
        Some(r) => Some(r),
        None => until_drained(router_fut, shutdown.rx()).await,
    };
    let _ = until_drained(worker_task, shutdown.rx()).await;
    stop_engine(engine).await;
    reporter.task.abort();
    if let Err(e) = kvstore.stop().await {
        tracing::warn!(error = %e, "stopping the embedded kvstore");
    }
    if kv_dir_is_temp {
        let _ = std::fs::remove_dir_all(&kv_dir);
    }
    if let Some(r) = res {
        r.context("router failed")?;
    }
    shutdown.failure()
}

/// Name prefix of the embedded kvstore's directory when `up` runs without `--data-dir`; the process id follows.
const TEMP_KVSTORE_PREFIX: &str = "pagoda-up-kvstore-";

/// Removes `<dir>/<prefix><pid>` directories whose process is gone: an `up` that was killed (SIGKILL, OOM) could
/// not remove its own. A pid that is alive again, or any name that is not `<prefix><digits>`, is left alone.
fn sweep_dead_temp_dirs(dir: &Path, prefix: &str) {
    // Liveness is read from /proc: without it (not Linux) every directory would look dead.
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(prefix)).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !Path::new("/proc").join(pid.to_string()).exists() {
            match std::fs::remove_dir_all(entry.path()) {
                Ok(()) => tracing::info!(dir = %entry.path().display(), "removed a dead run's kvstore directory"),
                Err(e) => {
                    tracing::warn!(dir = %entry.path().display(), error = %e, "cannot remove a dead run's kvstore directory")
                }
            }
        }
    }
}

/// This machine's host name (the default worker id's first half): `$HOSTNAME`, else the kernel's, else localhost.
fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

async fn worker(args: WorkerArgs) -> Result<()> {
    args.tls.install()?;
    let model = resolve_model(&args.model)?;
    let engine = start_engine(&model, &args.engine).await?;
    let shutdown = Shutdown::on_signal_or_engine_exit(&engine);
    let listener = bind(args.listen, "worker").await?;
    let addr = listener.local_addr().context("worker address")?;
    let worker_id = args.worker_id.clone().unwrap_or_else(|| format!("{}:{}", hostname(), addr.port()));
    let advertise = args.advertise.clone().unwrap_or_else(|| {
        if addr.ip().is_unspecified() { format!("{}:{}", hostname(), addr.port()) } else { addr.to_string() }
    });
    let etcd = args.etcd.config()?;
    let kvstore = kvstore_endpoints(args.kvstore.clone(), etcd.as_ref()).await?;
    let reporter = if kvstore.is_empty() {
        None
    } else {
        let cfg = pagoda_worker::reporter::ReporterConfig::new(worker_id.clone(), advertise.clone(), kvstore.clone());
        let task = pagoda_worker::reporter::spawn(engine.clone(), cfg).context("cannot start block-event reporting")?;
        tracing::info!(worker = %worker_id, kvstore = ?kvstore.current(), "reporting block events to the kvstore");
        Some(task)
    };
    // Registered once it serves: routers add it as soon as the key appears.
    let registration = match etcd {
        Some(cfg) => {
            let me = pagoda_registry::Member {
                id: worker_id.clone(),
                address: advertise,
                epoch: unix_micros(),
                node_id: None,
            };
            Some(pagoda_registry::register(cfg, pagoda_registry::Role::Worker, me).context("--etcd")?)
        }
        None => None,
    };
    println!("pagoda worker listening on {addr}");
    tracing::info!(role = %args.role, "worker role");
    let peer_fetch = (!args.no_peer_fetch).then(|| PeerFetchConfig {
        timeout: Duration::from_millis(args.peer_fetch_timeout_ms),
        policy: match args.peer_fetch_policy.as_str() {
            "always" => PullPolicy::Always,
            _ => PullPolicy::WhenItPays,
        },
        ..PeerFetchConfig::default()
    });
    let serving = WorkerServing {
        worker_id,
        role: args.role.clone(),
        device: args.engine.device,
        admission: args.engine.admission(),
        peer_fetch,
        report_progress: reporter.as_ref().map(|r| r.progress.clone()),
    };
    let served = serve_worker(listener, engine.clone(), serving, shutdown.rx());
    let res = until_drained(served, shutdown.rx()).await;
    if let Some(r) = registration {
        r.stop().await;
    }
    stop_engine(engine).await;
    if let Some(r) = reporter {
        r.task.abort();
    }
    if let Some(r) = res {
        r.context("worker gRPC server failed")?;
    }
    shutdown.failure()
}

async fn router(args: RouterArgs) -> Result<()> {
    args.tls.install()?;
    let security = load_security(&args.http)?;
    let model = resolve_model(&args.model)?;
    let shutdown = shutdown_signal();
    let codec = load_codec(&model, &args.http).await?;
    let listener = bind(args.listen, "router").await?;
    let addr = listener.local_addr().context("router address")?;
    let placement = pagoda_router::placer::PlacerConfig {
        strategy: args.placement.parse().map_err(anyhow::Error::msg).context("--placement")?,
        temperature: args.placement_temperature.filter(|t| t.is_finite() && *t > 0.0),
        remote_prefill_min_tokens: args.remote_prefill_min_tokens,
        remote_prefill_max_queued_tokens: args.remote_prefill_max_queued_tokens,
        ..Default::default()
    };
    if !(args.stale_reports_secs.is_finite() && (0.1..=3600.0).contains(&args.stale_reports_secs)) {
        bail!("--stale-reports-secs must be between 0.1 and 3600");
    }
    let etcd = args.etcd.config()?;
    let kvstore = kvstore_endpoints(args.kvstore, etcd.as_ref()).await?;
    let config = RouterConfig {
        workers: args.workers,
        etcd,
        body_limit: args.http.body_limit,
        max_inflight: args.http.max_inflight,
        client_timeout: args.http.client_timeout(),
        placement,
        security,
        kvstore,
        migration: args.migration.config(),
        stale_reports_after: Duration::try_from_secs_f64(args.stale_reports_secs)
            .ok()
            .filter(|d| !d.is_zero())
            .with_context(|| format!("--stale-reports-secs {} must be a positive number", args.stale_reports_secs))?,
        ..RouterConfig::default()
    };
    println!("pagoda router listening on http://{addr}");
    let fut = pagoda_router::serve(listener, codec, config, wait_for(shutdown.clone()));
    match until_drained(fut, shutdown).await {
        Some(r) => r.context("router failed"),
        None => Ok(()),
    }
}

fn eval(args: EvalArgs) -> Result<()> {
    use pagoda_worker::eval::{TaskKind, runner};
    use pagoda_worker::policy::PolicyKind;
    if !args.from_json.is_empty() {
        let reports = args
            .from_json
            .iter()
            .map(|src| read_json_report(src, "an eval report"))
            .collect::<Result<Vec<runner::EvalReport>>>()?;
        let report = runner::merge(reports).context("cannot merge the eval reports")?;
        return write_eval_outputs(&report, &args);
    }
    let model = resolve_model(&args.model)?;
    if !args.codecs.is_empty() {
        return eval_codecs(&model, &args);
    }
    let mut policies = Vec::new();
    for p in &args.policies {
        if p == "all" {
            policies.extend(PolicyKind::ALL.into_iter().filter(|k| *k != PolicyKind::Full));
        } else {
            let k = PolicyKind::parse(p).with_context(|| format!("unknown policy {p:?}"))?;
            if k != PolicyKind::Full && !policies.contains(&k) {
                policies.push(k);
            }
        }
    }
    let mut tasks = Vec::new();
    for t in &args.tasks {
        match t.as_str() {
            "all" => tasks.extend(TaskKind::ALL),
            "none" => {}
            _ => tasks.push(TaskKind::parse(t).with_context(|| format!("unknown task {t:?}"))?),
        }
    }
    if args.budgets.iter().any(|&b| b < pagoda_worker::policy::defaults::MIN_BUDGET_TOKENS) {
        bail!("budgets must be at least {} tokens", pagoda_worker::policy::defaults::MIN_BUDGET_TOKENS);
    }
    if !(0.01..=64.0).contains(&args.pool_gib) {
        bail!("--pool-gib must be in 0.01..=64");
    }
    let opts = runner::EvalOptions {
        threads: args.threads,
        policies,
        budgets: args.budgets.clone(),
        tasks,
        contexts: args.contexts.clone(),
        items_per_task: args.items,
        seed: args.seed,
        prose_docs: args.prose_docs,
        prose_context: args.prose_context,
        prose_continuation: args.prose_continuation,
        pool_bytes: (args.pool_gib * (1u64 << 30) as f64) as usize,
    };
    let prose = if opts.prose_docs > 0 {
        if !args.prose_dir.is_dir() {
            let script = repo_root().join("scripts/fetch-prose.sh");
            let status = std::process::Command::new("bash")
                .arg(&script)
                .arg(&args.prose_dir)
                .status()
                .with_context(|| format!("cannot run {}", script.display()))?;
            if !status.success() {
                bail!("{} failed ({status})", script.display());
            }
        }
        let tok = load_tokenizer(&model)?;
        let need = opts.prose_context + opts.prose_continuation;
        pagoda_worker::eval::load_documents(&args.prose_dir, need, &|s: &str| tok.encode(s, false).len())
            .with_context(|| format!("cannot load prose from {}", args.prose_dir.display()))?
    } else {
        Vec::new()
    };
    let report = runner::run(&model, &opts, &prose).context("eval failed")?;
    eprintln!("eval took {:.1} s", report.seconds);
    write_eval_outputs(&report, &args)
}

/// `pagoda eval --codecs`: next-token agreement of each codec with the full cache.
fn eval_codecs(model: &Path, args: &EvalArgs) -> Result<()> {
    use pagoda_kernels::Codec;
    use pagoda_worker::eval::codecs::{self, CodecItem, Continuation, LaneFormat};
    use pagoda_worker::eval::{TaskKind, generate};
    let mut list = Vec::new();
    for c in &args.codecs {
        let formats = if c == "all" {
            Codec::ALL.into_iter().filter(|c| *c != Codec::F32).map(LaneFormat::Codec).collect()
        } else {
            vec![c.parse::<LaneFormat>().map_err(|e| anyhow!("bad --codecs entry {c:?}: {e}"))?]
        };
        for f in formats {
            if !list.contains(&f) {
                list.push(f);
            }
        }
    }
    if !(2..=4096).contains(&args.codec_tokens) {
        bail!("--codec-tokens must be in 2..=4096");
    }
    let mut tasks = Vec::new();
    for t in &args.tasks {
        match t.as_str() {
            "all" => tasks.extend(TaskKind::ALL),
            "none" => {}
            _ => tasks.push(TaskKind::parse(t).with_context(|| format!("unknown task {t:?}"))?),
        }
    }
    let prose = if args.prose_docs > 0 {
        let tok = load_tokenizer(model)?;
        let need = args.prose_context + args.prose_continuation;
        pagoda_worker::eval::load_documents(&args.prose_dir, need, &|s: &str| tok.encode(s, false).len())
            .with_context(|| format!("cannot load prose from {} (scripts/fetch-prose.sh)", args.prose_dir.display()))?
    } else {
        Vec::new()
    };
    let make_items = |ev: &codecs::CodecEvaluator| {
        let mut items = Vec::new();
        for &ctx in &args.contexts {
            for &task in &tasks {
                for i in 0..args.items {
                    let seed = args.seed.wrapping_add(i as u64 * 7919);
                    let tok = ev.tokenizer();
                    let item = generate(task, seed, ctx, &|s: &str| tok.encode(s, false).len());
                    items.push(CodecItem {
                        name: format!("{}/{ctx}/{seed}", task.name()),
                        prompt: ev.chat_tokens(&item.prompt)?,
                        continuation: Continuation::Greedy(args.codec_tokens),
                    });
                }
            }
        }
        for doc in prose.iter().take(args.prose_docs) {
            let ids = ev.tokenizer().encode(&doc.text, false);
            let (c, n) = (args.prose_context, args.prose_continuation);
            if ids.len() >= c + n {
                items.push(CodecItem {
                    name: doc.name.clone(),
                    prompt: ids[..c].to_vec(),
                    continuation: Continuation::Forced(ids[c..c + n].to_vec()),
                });
            }
        }
        Ok(items)
    };
    let report =
        codecs::run(model, args.threads, args.bf16_matmuls, &list, &make_items).context("codec eval failed")?;
    eprintln!("codec eval took {:.1} s", report.seconds);
    let md = codecs::render_markdown(&report);
    println!("{md}");
    if let Some(path) = &args.markdown {
        std::fs::write(path, &md).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report).context("cannot serialise the report")?;
        std::fs::write(path, json).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn write_eval_outputs(report: &pagoda_worker::eval::runner::EvalReport, args: &EvalArgs) -> Result<()> {
    let md = pagoda_worker::eval::runner::render_markdown(report);
    println!("{md}");
    if let Some(path) = &args.markdown {
        std::fs::write(path, &md).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        eval_plot::draw_eval(report, path)?;
        eprintln!("wrote {}", path.display());
    }
    // A report read back unchanged is not written again; a merged one is new.
    if let Some(path) = &args.json
        && args.from_json.len() != 1
    {
        let json = serde_json::to_string_pretty(report).context("cannot serialise the report")?;
        std::fs::write(path, json).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// Prints a bench report as Markdown and, when asked, writes its JSON to `json`.
/// A report written by a command's `--json`, read back for `--from-json`; `what` names it in the error.
fn read_json_report<T: serde::de::DeserializeOwned>(src: &Path, what: &str) -> Result<T> {
    let text = std::fs::read_to_string(src).with_context(|| format!("cannot read {}", src.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not {what}", src.display()))
}

fn print_report(markdown: &str, json_text: &str, json: Option<&Path>) -> Result<()> {
    println!("{markdown}");
    if let Some(path) = json {
        std::fs::write(path, json_text).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

async fn bench_routing(a: BenchRoutingArgs) -> Result<()> {
    let model = resolve_model(&a.model)?;
    let report = bench_routing::run(bench_routing::RoutingBenchOptions {
        model,
        workers: a.workers,
        worker_threads: a.worker_threads,
        strategies: a.strategies,
        system_prompts: a.system_prompts,
        conversations: a.conversations,
        turns: a.turns,
        max_tokens: a.max_tokens,
        worker_kv_tokens: a.worker_kv_tokens,
        worker_host_tier_mib: a.worker_host_tier_mib,
        conversation_gap_ms: a.conversation_gap_ms,
        seed: a.seed,
        deadline_secs: a.out.deadline_secs,
        lora_adapters: a.lora_adapters,
        lora_rank: a.lora_rank,
        max_loras: a.max_loras,
    })
    .await?;
    let failed = report.results.iter().map(|r| r.failed).sum();
    finish_cluster_bench(&report, report.markdown(), |p| report.draw(p), failed, &a.out)
}

/// The end of a bench over local clusters: prints its table, writes its JSON and plot when asked, and fails when
/// `failed` requests did.
fn finish_cluster_bench(
    report: &impl serde::Serialize,
    markdown: String,
    draw: impl FnOnce(&Path) -> Result<()>,
    failed: usize,
    out: &ClusterBenchOutput,
) -> Result<()> {
    println!("{markdown}");
    if let Some(path) = &out.json {
        std::fs::write(path, serde_json::to_string_pretty(report)?)
            .with_context(|| format!("write {}", path.display()))?;
    }
    if let Some(path) = &out.plot {
        draw(path)?;
    }
    if failed > 0 {
        bail!("{failed} requests failed");
    }
    Ok(())
}

async fn bench_disaggregation(a: BenchDisaggArgs) -> Result<()> {
    let model = resolve_model(&a.model)?;
    let report = bench_disagg::run(bench_disagg::DisaggBenchOptions {
        model,
        worker_threads: a.worker_threads,
        requests: a.requests,
        rate: a.rate,
        min_prompt_words: a.min_prompt_words,
        max_prompt_words: a.max_prompt_words,
        max_tokens: a.max_tokens,
        remote_prefill_min_tokens: a.remote_prefill_min_tokens,
        remote_prefill_max_queued_tokens: a.remote_prefill_max_queued_tokens,
        rounds: a.rounds,
        seed: a.seed,
        deadline_secs: a.out.deadline_secs,
    })
    .await?;
    let failed = report.rounds.iter().map(|r| r.failed).sum();
    finish_cluster_bench(&report, report.markdown(), |p| report.draw(p), failed, &a.out)
}

async fn bench_load(a: BenchLoadArgs) -> Result<()> {
    use pagoda_e2e::load::{self, LoadConfig, Mode, Report, Streaming};
    if a.shared_prompts + a.unique_prompts == 0 {
        anyhow::bail!("--shared-prompts + --unique-prompts must be at least 1");
    }
    let mut http = pagoda_e2e::Http::new(a.router.trim_end_matches('/'));
    if let Some(key) = &a.api_key {
        http = http.with_api_key(key)?;
    }
    let model = match a.model_id {
        Some(m) => m,
        None => {
            let (status, body) = http.get("/v1/models").await.context("GET /v1/models")?;
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            v["data"][0]["id"]
                .as_str()
                .map(str::to_string)
                .with_context(|| format!("no model in the router's /v1/models ({status}): {body}"))?
        }
    };
    let http = http.with_model(model.clone());
    let mode = match a.mode.as_str() {
        "open" if a.rate.is_finite() && a.rate > 0.0 => {
            Mode::Open { per_second: a.rate, max_in_flight: a.max_in_flight }
        }
        "open" => anyhow::bail!("--rate must be a positive number of arrivals per second, got {}", a.rate),
        _ => Mode::Closed { concurrency: a.concurrency },
    };
    let streaming = match a.streaming.as_str() {
        "all" => Streaming::All,
        "none" => Streaming::None,
        _ => Streaming::Mixed,
    };
    let mut prompts = load::prompt_mix(a.shared_prompts, a.unique_prompts);
    load::pad_prompts(&mut prompts, a.prompt_words, a.prompt_seed);
    let reference = if a.no_reference {
        load::Reference::default()
    } else {
        load::reference(&http, &prompts, &[a.max_tokens]).await.context("the greedy reference (healthy cluster)")?
    };
    let cfg = LoadConfig {
        mode,
        prompts,
        max_tokens: vec![a.max_tokens],
        streaming,
        deadline: Duration::from_secs(a.deadline_secs),
        duration: Duration::from_secs(a.duration_secs),
        max_requests: a.max_requests,
        urgent: (a.urgent_every > 0).then_some(load::Urgent { every: a.urgent_every, priority: a.urgent_priority }),
    };
    let started = std::time::Instant::now();
    let records = load::run(&http, &cfg).await?;
    let wall = started.elapsed().as_secs_f64();
    let report = Report::new(&records, &reference);
    let rejected_by_status = records.iter().filter_map(|r| r.status.filter(|&s| s != 200)).fold(
        std::collections::BTreeMap::<u16, usize>::new(),
        |mut m, s| {
            *m.entry(s).or_default() += 1;
            m
        },
    );
    let completion_tokens: u64 = records.iter().filter_map(|r| r.completion_tokens).sum();
    let mut summary = serde_json::json!({
        "router": a.router,
        "model": model,
        "mode": a.mode,
        "concurrency": a.concurrency,
        "rate": a.rate,
        "duration_s": a.duration_secs,
        "max_tokens": a.max_tokens,
        "sent": report.sent,
        "completed": report.completed,
        "failed_clean": report.failed_clean,
        "refused_by_status": rejected_by_status,
        "lost": report.lost,
        "timed_out": report.timed_out,
        "shed_by_client": report.shed,
        "checked_against_reference": !a.no_reference,
        "mismatched": if a.no_reference { None } else { Some(report.mismatches.len()) },
        "wall_s": wall,
        "completed_per_s": report.completed as f64 / wall,
        "completion_tokens_per_s": completion_tokens as f64 / wall,
        "prompt_tokens_per_s": records.iter().filter_map(|r| r.prompt_tokens).sum::<u64>() as f64 / wall,
        "p50_latency_s": report.p50_latency.as_secs_f64(),
        "p99_latency_s": report.p99_latency.as_secs_f64(),
        "p50_ttft_s": report.p50_ttft.as_secs_f64(),
        "p99_ttft_s": report.p99_ttft.as_secs_f64(),
        "max_latency_s": report.max_latency.as_secs_f64(),
        "lost_examples": report.lost_examples,
    });
    if a.urgent_every > 0 {
        summary["urgent_every"] = a.urgent_every.into();
        summary["urgent_priority"] = a.urgent_priority.into();
        summary["urgent"] = load::ClassStats::of(&records, true).to_json();
        summary["others"] = load::ClassStats::of(&records, false).to_json();
    }
    let text = serde_json::to_string_pretty(&summary)?;
    println!("{text}");
    if let Some(path) = &a.json {
        std::fs::write(path, &text).with_context(|| format!("write {}", path.display()))?;
    }
    if report.lost > 0 || (!a.no_reference && !report.mismatches.is_empty()) {
        anyhow::bail!(
            "{} requests lost, {} answers differ from the greedy reference",
            report.lost,
            report.mismatches.len()
        );
    }
    Ok(())
}

fn bench_engine(args: BenchEngineArgs) -> Result<()> {
    let synthetic = args
        .synthetic_model
        .map(|spec| spec.with_weights(args.synthetic_weights))
        .transpose()
        .context("--synthetic-weights")?;
    // A synthetic model replaces the GGUF: none is read or fetched.
    let model = match &synthetic {
        Some(_) => PathBuf::new(),
        None => resolve_model(&args.model)?,
    };
    let opts = pagoda_worker::bench::BenchOptions {
        threads: args.threads,
        block_size: args.block_size,
        max_step_tokens: args.max_step_tokens,
        prefill_tokens: args.prefill_tokens,
        decode_prompt_tokens: args.decode_prompt_tokens,
        decode_new_tokens: args.decode_new_tokens,
        concurrency: args.concurrency,
        kv_dtype: args.kv_dtype,
        bf16_matmuls: args.bf16_matmuls,
        synthetic,
        device: args.device,
        lora: args.lora,
        ..Default::default()
    };
    let shown = opts.synthetic.as_ref().map_or_else(|| model.display().to_string(), |s| s.model_name());
    let report =
        pagoda_worker::bench::engine_bench(&model, &opts).with_context(|| format!("engine bench on {shown} failed"))?;
    print_report(&report.to_markdown(), &report.to_json_string(), args.json.as_deref())?;
    Ok(())
}

fn bench_tiers(args: BenchTiersArgs) -> Result<()> {
    if let Some(src) = &args.from_json {
        let report: pagoda_worker::bench_zipf::ZipfReport =
            read_json_report(src, "a `bench tiers --workload zipf` report")?;
        println!("{}", report.to_markdown());
        if let Some(path) = &args.plot {
            tiers_plot::draw_tiers(&report, path).with_context(|| format!("cannot draw {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        return Ok(());
    }
    let model = resolve_model(&args.model)?;
    if args.workload == "zipf" {
        return bench_tiers_zipf(&model, args);
    }
    let opts = pagoda_worker::bench_tiers::TiersBenchOptions {
        threads: args.threads,
        context_tokens: args.context_tokens,
        repeats: args.repeats,
        host_mib: args.host_tier_mib,
        data_dir: args.data_dir,
        codecs: args.onboard_codecs.iter().map(|c| c.trim().to_owned()).collect(),
        ..Default::default()
    };
    let report = pagoda_worker::bench_tiers::tiers_bench(&model, &opts)
        .with_context(|| format!("tiers bench on {} failed", model.display()))?;
    print_report(&report.to_markdown(), &report.to_json_string(), args.json.as_deref())?;
    Ok(())
}

fn bench_tiers_zipf(model: &Path, args: BenchTiersArgs) -> Result<()> {
    let opts = pagoda_worker::bench_zipf::ZipfBenchOptions {
        threads: args.threads,
        contexts: args.contexts,
        min_tokens: args.min_context_tokens,
        max_tokens: args.max_context_tokens,
        requests: args.requests,
        zipf_s: args.zipf_s,
        answer_tokens: args.answer_tokens,
        device_tokens: args.device_tokens,
        host_mib: args.host_tier_mib,
        disk_mib: if args.data_dir.is_some() { args.disk_tier_mib } else { 0 },
        data_dir: args.data_dir,
        codecs: args.codecs.iter().map(|c| c.trim().to_owned()).collect(),
        alphas: args.evicpress_alpha,
        keep_ratios: keep_ratios(&args.evicpress_keep_ratios),
        prose_dir: args.prose_dir.is_dir().then_some(args.prose_dir),
        bf16_matmuls: args.bf16_matmuls,
        offline_phase: args.offline_phase,
        seed_dir: args.offline_seed_dir,
        profile_scoring: args.evicpress_profile,
        horizon: args.evicpress_horizon,
        shrink: args.evicpress_shrink,
        pooled: args.evicpress_pooled_profiles,
        greedy: args.evicpress_greedy,
        profile_questions: args.evicpress_profile_questions,
        upgrade: args.evicpress_upgrade,
        kivi_residual_tokens: args.kivi_residual_tokens,
        kivi_int8_layers: args.kivi_int8_layers,
        baselines: args.baselines,
        task_share: args.task_share,
        arrival_rate: args.arrival_rate,
        ..Default::default()
    };
    // The JSON and plot are rewritten after every configuration, so a run stopped part way keeps what finished.
    // The last write is the finished report's, so its outcome is the command's.
    let write = |report: &pagoda_worker::bench_zipf::ZipfReport| -> Result<()> {
        if let Some(path) = &args.json {
            std::fs::write(path, report.to_json_string())
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        if let Some(path) = &args.plot {
            tiers_plot::draw_tiers(report, path).with_context(|| format!("cannot draw {}", path.display()))?;
        }
        Ok(())
    };
    let mut last_write = Ok(());
    let report = pagoda_worker::bench_zipf::zipf_bench_with_progress(model, &opts, |partial| {
        last_write = write(partial);
        if let Err(e) = &last_write {
            tracing::warn!(error = %format!("{e:#}"), "bench tiers zipf: cannot write the partial report");
        }
    })
    .with_context(|| format!("tiers zipf bench on {} failed", model.display()))?;
    println!("{}", report.to_markdown());
    last_write?;
    for path in args.json.iter().chain(&args.plot) {
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn bench_eviction(args: BenchEvictionArgs) -> Result<()> {
    let model = resolve_model(&args.model)?;
    let mut policies = Vec::with_capacity(args.policies.len());
    for name in &args.policies {
        let name = name.trim();
        let Some(kind) = PolicyKind::parse(name) else {
            bail!("--policies: unknown policy `{name}`; known: {}", policy_names());
        };
        if !policies.contains(&kind) {
            policies.push(kind);
        }
    }
    let opts = pagoda_worker::bench_eviction::EvictionBenchOptions {
        threads: args.threads,
        block_size: args.block_size,
        max_step_tokens: args.max_step_tokens,
        max_running: args.max_running,
        requests: args.requests,
        prompt_tokens: args.prompt_tokens,
        new_tokens: args.new_tokens,
        pool_seqs: args.pool_seqs,
        policies,
        budgets: args.budgets,
        seed: args.seed,
        repeats: args.repeats,
        admission_reserve: args.admission == "reserve",
        kv_dtype: args.kv_dtype,
        device: args.device,
    };
    let report = pagoda_worker::bench_eviction::eviction_bench(&model, &opts)
        .with_context(|| format!("eviction bench on {} failed", model.display()))?;
    print_report(&report.to_markdown(), &report.to_json_string(), args.json.as_deref())?;
    if let Some(path) = args.plot {
        bench_plot::draw_eviction(&report, &path).with_context(|| format!("cannot draw {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

async fn kvstore(args: KvstoreArgs) -> Result<()> {
    args.tls.install()?;
    let mut cfg = pagoda_kvstore::NodeConfig::new(args.node_id, args.listen, args.data_dir);
    for (id, addr) in args.peers {
        if let Some(prev) = cfg.peers.insert(id, addr.clone())
            && prev != addr
        {
            bail!("--peer {id} given twice with different addresses ({prev}, {addr})");
        }
    }
    if let Some(a) = args.advertise {
        cfg.advertise = a;
    }
    if !args.join
        && cfg.peers.keys().any(|id| *id != args.node_id)
        && !cfg.peers.contains_key(&args.node_id)
        && cfg.advertise.is_empty()
    {
        bail!("--advertise is required when this node is not among the --peer entries");
    }
    cfg.join = args.join;
    cfg.snapshot_every = args.snapshot_every;
    let etcd = args.etcd.config()?;
    let registration = match &etcd {
        Some(etcd) => Some(discover_peers(&mut cfg, etcd.clone(), args.expect_voters).await?),
        None => None,
    };
    let shutdown = shutdown_signal();
    let others: Vec<String> = cfg.peers.iter().filter(|(p, _)| **p != cfg.id).map(|(_, a)| a.clone()).collect();
    let (id, advertise) = (cfg.id, cfg.advertise.clone());
    let mut node = pagoda_kvstore::start(cfg).await.context("cannot start the kvstore node")?;
    println!("pagoda kvstore listening on {}", node.addr);
    let joining = (args.join && etcd.is_some()).then(|| tokio::spawn(ask_to_join(id, advertise, others)));
    let ended = tokio::select! {
        r = node.wait() => Some(r),
        _ = wait_for(shutdown) => None,
    };
    if let Some(j) = joining {
        j.abort();
    }
    if let Some(r) = registration {
        r.stop().await;
    }
    if let Some(r) = ended {
        return r.context("kvstore node stopped");
    }
    node.stop().await.context("stopping the kvstore node")
}

/// Registers this kvstore node's raft address in etcd and, without --peer, waits (bounded) until `expect_voters`
/// nodes are registered and takes them as the initial voters. A node whose store is already initialised ignores
/// the voters (raft's own membership wins), so a restarted node finds its cluster again.
async fn discover_peers(
    cfg: &mut pagoda_kvstore::NodeConfig,
    etcd: pagoda_registry::RegistryConfig,
    expect_voters: u64,
) -> Result<pagoda_registry::Registration> {
    if cfg.advertise.is_empty() {
        if cfg.listen.ip().is_unspecified() || cfg.listen.port() == 0 {
            bail!("--etcd needs --advertise (or a --listen with a concrete address and port) to register");
        }
        cfg.advertise = cfg.listen.to_string();
    }
    let me = pagoda_registry::Member {
        id: cfg.id.to_string(),
        address: cfg.advertise.clone(),
        epoch: unix_micros(),
        node_id: Some(cfg.id),
    };
    let mut registration =
        pagoda_registry::register(etcd.clone(), pagoda_registry::Role::Kvstore, me).context("--etcd")?;
    registration.wait_registered(REGISTRY_WAIT).await.context("cannot register in etcd")?;
    if cfg.join {
        // The running cluster's nodes, to ask for membership and to reach before the leader's snapshot names them.
        let nodes = pagoda_registry::wait_for_members(&etcd, pagoda_registry::Role::Kvstore, 2, REGISTRY_WAIT)
            .await
            .context("no kvstore node to join registered in etcd")?;
        for n in nodes {
            if let Some(peer) = n.node_id.filter(|p| *p != cfg.id) {
                cfg.peers.entry(peer).or_insert(n.address);
            }
        }
    } else if cfg.peers.is_empty() {
        let want = usize::try_from(expect_voters).unwrap_or(1);
        let nodes = pagoda_registry::wait_for_members(&etcd, pagoda_registry::Role::Kvstore, want, REGISTRY_WAIT)
            .await
            .with_context(|| format!("fewer than {want} kvstore nodes registered in etcd"))?;
        for n in nodes {
            if let Some(id) = n.node_id {
                cfg.peers.insert(id, n.address);
            }
        }
        if cfg.peers.len() != want {
            bail!("the registry lists {} kvstore nodes, --expect-voters is {want}: {:?}", cfg.peers.len(), cfg.peers);
        }
        tracing::info!(peers = ?cfg.peers, "kvstore voters from the etcd registry");
    }
    Ok(registration)
}

/// How long a joining node keeps asking the cluster to add it.
const JOIN_WAIT: Duration = Duration::from_secs(120);

/// Asks the cluster at `others` (found in the registry) to add this node as a voter at `advertise`. Adding a node
/// that is already a voter only refreshes its address, so a restarted node may ask again.
async fn ask_to_join(id: u64, advertise: String, others: Vec<String>) {
    let mut client = match pagoda_kvstore::Client::new(others) {
        Ok(c) => c.with_deadline(JOIN_WAIT),
        Err(e) => {
            tracing::error!(error = %e.message(), "no kvstore node to ask for membership");
            return;
        }
    };
    match client.add_node(id, &advertise).await {
        Ok(m) => tracing::info!(
            node = id,
            members = ?m.members.iter().map(|m| m.node_id).collect::<Vec<_>>(),
            "joined the kvstore cluster"
        ),
        Err(e) => tracing::error!(node = id, error = %e.message(), "the kvstore cluster did not add this node"),
    }
}

fn unix_micros() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

async fn bench_kvstore(args: BenchKvstoreArgs) -> Result<()> {
    let report = pagoda_kvstore::bench::run(pagoda_kvstore::bench::BenchConfig {
        seconds: args.seconds,
        publishers: args.publishers,
        batch: args.batch,
        data_dir: args.data_dir,
    })
    .await
    .context("kvstore benchmark")?;
    println!("{}", report.markdown());
    if let Some(p) = args.json {
        std::fs::write(&p, serde_json::to_string_pretty(&report.fields())?)
            .with_context(|| format!("write {}", p.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::Parser;

    use super::{Cli, Command, check_args, sweep_dead_temp_dirs};

    #[test]
    fn sweep_removes_only_dead_runs_directories() {
        let root = std::env::temp_dir().join(format!("pagoda-sweep-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let prefix = "pagoda-up-kvstore-";
        // 999999999 is above Linux's largest pid (2^22), so no process has it; pid 1 is always alive.
        let names = ["pagoda-up-kvstore-999999999", "pagoda-up-kvstore-1", "pagoda-up-kvstore-x1", "other-999999999"];
        let own = format!("{prefix}{}", std::process::id());
        for n in names.iter().copied().chain([own.as_str()]) {
            std::fs::create_dir_all(root.join(n).join("inner")).unwrap();
        }
        sweep_dead_temp_dirs(&root, prefix);
        assert!(!root.join(names[0]).exists(), "a dead run's directory is removed");
        for n in names[1..].iter().copied().chain([own.as_str()]) {
            assert!(root.join(n).exists(), "{n} is kept");
        }
        std::fs::remove_dir_all(&root).unwrap();
    }

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn client_timeout_is_a_bounded_flag_of_router_and_up() {
        let timeout = |line: &str| match Cli::try_parse_from(argv(line)).map(|c| c.command) {
            Ok(Command::Router(a)) => Ok(a.http.client_timeout()),
            Ok(Command::Up(a)) => Ok(a.http.client_timeout()),
            Ok(_) => panic!("{line}: another command"),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(timeout("pagoda router --worker=w:1"), Ok(pagoda_router::DEFAULT_CLIENT_TIMEOUT));
        assert_eq!(timeout("pagoda router --worker=w:1 --client-timeout-secs=5"), Ok(Duration::from_secs(5)));
        assert_eq!(timeout("pagoda up --client-timeout-secs 3600"), Ok(Duration::from_secs(3600)));
        for bad in ["0", "3601", "-1", "1.5"] {
            let err = timeout(&format!("pagoda router --worker=w:1 --client-timeout-secs={bad}")).unwrap_err();
            assert!(err.contains("invalid value"), "{bad}: {err}");
        }
    }

    #[test]
    fn check_args_accepts_valid_command_lines() {
        for line in [
            "/app/pagoda worker --listen=0.0.0.0:50051 --model=/m.gguf --kv-policy=snapkv --kv-budget=256",
            "/app/pagoda router --listen=0.0.0.0:8080 --worker=w-0.w.ns.svc:50051 --worker=w-1.w.ns.svc:50051",
            "pagoda up --listen 127.0.0.1:0",
            "pagoda worker --block-size=256",
            "pagoda worker --tier-placement=evicpress --evicpress-profile-question=Who? --evicpress-profile-question=Why?",
        ] {
            check_args(&argv(line)).unwrap_or_else(|e| panic!("{line}: {e:#}"));
        }
    }

    #[test]
    fn check_args_rejects_what_the_binary_would_reject() {
        for (line, why) in [
            ("pagoda worker --no-such-flag", "unexpected argument"),
            ("pagoda worker --block-size=0", "invalid value"),
            ("pagoda up --block-size=257", "invalid value"),
            ("pagoda bench engine --block-size=257", "invalid value"),
            ("pagoda bench eviction --block-size=1024", "invalid value"),
            ("pagoda worker --listen=worker-0:50051", "invalid value"),
            ("pagoda router --listen=0.0.0.0:8080", "--worker"),
            ("pagoda worker --kv-policy=lru", "unknown KV policy"),
            ("pagoda worker --kv-policy=snapkv --kv-budget=1", "below the minimum"),
            ("pagoda no-such-subcommand", "unrecognized subcommand"),
            ("pagoda check-args -- pagoda up", "does not check itself"),
            ("pagoda worker --evicpress-profile-question=Who?", "applies to --tier-placement evicpress"),
            ("pagoda up --threads=18446744073709551615", "invalid value"),
            ("pagoda worker --threads=1025", "invalid value"),
            ("pagoda worker --max-running=0", "invalid value"),
            ("pagoda worker --max-running=4097", "invalid value"),
            ("pagoda up --max-step-tokens=0", "invalid value"),
            ("pagoda worker --max-step-tokens=65537", "invalid value"),
            ("pagoda router --worker=127.0.0.1:1 --body-limit=0", "invalid value"),
            ("pagoda up --body-limit=1073741825", "invalid value"),
            ("pagoda kvstore --node-id=1 --snapshot-every=0", "invalid value"),
            ("pagoda worker --tier-placement=evicpress --evicpress-profile-question=", "cannot be empty"),
            // Bench flags: a count or a size near 2^64 would wrap or overflow, or run for ever.
            ("pagoda bench kvstore --seconds=18446744073709551615", "invalid value"),
            ("pagoda bench kvstore --batch=0", "invalid value"),
            ("pagoda bench eviction --requests=18446744073709551615", "invalid value"),
            ("pagoda bench eviction --prompt-tokens=18446744073709551615", "invalid value"),
            ("pagoda bench eviction --budgets=256,0", "invalid value"),
            ("pagoda bench engine --concurrency=1,100000", "invalid value"),
            ("pagoda bench tiers --host-tier-mib=18446744073709551615", "invalid value"),
            ("pagoda bench tiers --repeats=0", "invalid value"),
        ] {
            let err = format!("{:#}", check_args(&argv(line)).expect_err(line));
            assert!(err.contains(why), "{line}: {err}");
        }
        let nine = (0..9).map(|i| format!(" --evicpress-profile-question=Q{i}?")).collect::<String>();
        let err = check_args(&argv(&format!("pagoda worker --tier-placement=evicpress{nine}"))).expect_err("nine");
        assert!(format!("{err:#}").contains("at most 8 questions"), "{err:#}");
        let long = format!("pagoda worker --tier-placement=evicpress --evicpress-profile-question={}", "x".repeat(513));
        assert!(format!("{:#}", check_args(&argv(&long)).expect_err("long")).contains("at most 512 bytes"));
    }
}
