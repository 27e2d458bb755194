//! The engine: one dedicated OS thread that owns the model, the KV storage, the block pool, the prefix index
//! and the scheduler, and an [`EngineHandle`] (cheap to clone, usable from async code) that talks to it.
//!
//! Commands (submit, cancel, shutdown) arrive on a std channel; the thread blocks on it while idle and
//! drains it between steps, so new requests join between steps. Each step runs one batched forward over the
//! scheduler's plan, samples with each request's own seeded [`Sampler`], and streams [`GenerateEvent`]s on the
//! request's tokio unbounded channel. A closed channel means the client went away: the request is cancelled
//! and its blocks are freed. Statistics are published after every step into a snapshot that
//! [`EngineHandle::stats`] reads without a round trip (the lock is never held across an `.await`).
//!
//! The model sits behind [`ModelRunner`] so the thread, batching and streaming can be exercised with a stand-in;
//! [`LlamaRunner`] is the real one (GGUF → `LlamaModel::forward` on a `CpuBackend` over a `KvStorage`).

use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use pagoda_kernels::{Backend, Codec, CpuBackend, KeyRounding, KvDtype, KvStorage};

use crate::adapters::{AdapterError, AdapterRegistry};
use crate::cache::{BlockId, CacheLayout, IndexChange};
use crate::events::{BlockChange, EventLog, ResidencySnapshot, SeqBatch};
use crate::json_guide::TokenTable;
use crate::model::calibration;
use crate::model::lora::cache_namespace;
use crate::model::{
    ForwardSeq, Gguf, LlamaModel, LogitsWanted, LoraAdapter, ModelConfig, ModelError, Scratch, SyntheticSpec, Tokenizer,
};
pub use crate::placement::TierPlacement;
use crate::placement::{EvicPress, EvicPressConfig, EvicPressStats};
use crate::policy::{AttnDims, PolicyKind, PolicyKv, PolicySpec, StepProbs};
use crate::sampling::{MAX_TOP_LOGPROBS, SampleBuffer, Sampler, TokenLogprobs, token_logprobs};
use crate::scheduler::{
    ReserveConfig, SchedError, ScheduledSeq, Scheduler, SchedulerConfig, SchedulingPolicy, SeqId, SeqRequest, Sequence,
    StepPlan, check_fits, check_priority,
};
use crate::tiers::codec::GroupKv;
use crate::tiers::pins::CodecPins;
use crate::tiers::residual::{self, ResidualTails};
use crate::tiers::store::GroupShape;
use crate::tiers::{
    EncodedGroup, GroupCodec, HostStore, Int8Layers, Tier, TierConfig, TierError, TierStore, TierUsage, native,
};

pub use crate::sampling::SamplingParams;
pub use crate::scheduler::FinishReason;
use crate::speculative::NgramConfig;

/// How to run the engine. The pool holds `kv_cache_tokens` token slots in every (layer, KV head) when that is set,
/// else `num_blocks` blocks; with both 0 it is sized for two full contexts.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model_path: PathBuf,
    pub num_blocks: usize,
    pub kv_cache_tokens: usize,
    pub block_size: usize,
    pub max_step_tokens: usize,
    pub max_running: usize,
    pub enable_prefix_cache: bool,
    /// Compute threads for the CPU backend (0 = all cores).
    pub threads: usize,
    /// Eviction policy for requests that name none.
    pub default_policy: PolicySpec,
    /// Admission growth reserve of the scheduler.
    pub reserve: ReserveConfig,
    /// First come, first served, or by request priority.
    pub scheduling: SchedulingPolicy,
    /// Host and disk KV tiers below the device pool (off by default).
    pub tiers: TierConfig,
    /// Element type of the device KV arena (f16 by default; f32 for exact comparisons with an f32 reference).
    pub kv_dtype: KvDtype,
    /// Who decides what the lower tiers keep, and in which codec.
    pub placement: TierPlacement,
    /// KIVI's full-precision residual for stored prompts, in tokens: the last groups of each prompt a placement
    /// stores in `int4_kivi` or `int2_kivi` keep the arena's format ([`crate::tiers::residual`]). 0: none.
    pub kivi_residual_tokens: usize,
    /// Layers whose blocks a KIVI codec (`int4_kivi`, `int2_kivi`) stores in int8 instead, whichever placement
    /// chose the codec ([`crate::tiers::GroupCodec::Layered`]): the layers whose attention amplifies KIVI's key
    /// error most, found with `pagoda eval --codecs` (docs/BENCHMARKS.md, "KIVI's sensitive layers"). Empty: none.
    pub kivi_int8_layers: Vec<usize>,
    /// Run the quantised matmuls in bf16 over weights widened to bf16 once and kept (+2 bytes per weight): on AMX
    /// tiles where the CPU has them, else with AVX-512 BF16 dot products ([`CpuBackend::with_bf16_matmuls`]).
    /// Logits closer to float32, and on AMX faster prefill and batched decode, but single-stream decode is slower
    /// (it streams 4× the weight bytes). Off by default; the engine refuses to start with it on a CPU that has
    /// neither.
    pub bf16_matmuls: bool,
    /// Round the keys of `fp8_e4m3_rotated` blocks for the model's queries (query-aware rounding,
    /// [`pagoda_kernels::key_rounding`], calibrated once at load on [`crate::model::calibration`]'s text) instead of
    /// to the nearest code. The bytes are the codec's either way. CPU runner, loaded models only.
    pub fp8_keys_for_queries: bool,
    /// Serve a synthetic-weights model of this shape instead of loading `model_path` (throughput benchmarks of
    /// shapes whose weights are not on the machine; outputs are meaningless, see [`crate::model::synthetic`]).
    pub synthetic: Option<SyntheticSpec>,
    /// Where the model runs: the CPU backend, or a GPU through the CUDA backend (feature `cuda`).
    pub device: Device,
    /// N-gram speculative decoding (off by default): see [`crate::speculative`].
    pub speculative: NgramConfig,
    /// LoRA adapters to serve beside the base model, by name (`--lora NAME=DIR`, PEFT directories).
    pub lora: Vec<LoraSpec>,
    /// The highest adapter rank loaded (`--max-lora-rank`).
    pub max_lora_rank: usize,
    /// Where adapters loaded at run time come from (`--lora-dir`); `None`: run-time loading is off.
    pub lora_dir: Option<PathBuf>,
    /// Most adapters loaded at once, start-up ones included (`--max-loras`).
    pub max_loras: usize,
    /// Load an adapter a request names from `lora_dir/NAME` when it is not loaded (`--lora-on-demand`), evicting
    /// the least recently used idle on-demand adapter when `max_loras` are loaded.
    pub lora_on_demand: bool,
}

/// One adapter to load: the name requests use and its PEFT directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraSpec {
    pub name: String,
    pub dir: PathBuf,
}

impl std::str::FromStr for LoraSpec {
    type Err = String;

    /// `NAME=DIR`.
    fn from_str(s: &str) -> Result<LoraSpec, String> {
        let (name, dir) = s.split_once('=').ok_or_else(|| format!("--lora {s:?}: expected NAME=DIR"))?;
        crate::model::lora::check_lora_name(name).map_err(|e| format!("--lora {s:?}: {e}"))?;
        if dir.is_empty() {
            return Err(format!("--lora {s:?}: the directory is empty"));
        }
        Ok(LoraSpec { name: name.to_string(), dir: PathBuf::from(dir) })
    }
}

/// The compute device of a runner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU backend (`pagoda_kernels::CpuBackend`), KV in host memory.
    #[default]
    Cpu,
    /// CUDA device with this ordinal: weights, activations and KV on the GPU (`crate::runner_cuda`, feature `cuda`).
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(0) => f.write_str("cuda"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Device, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) if n < 64 => Ok(Device::Cuda(n)),
                _ => Err(format!("device {s:?}: expected cpu, cuda or cuda:N (N < 64)")),
            },
        }
    }
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            model_path: PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            num_blocks: 0,
            kv_cache_tokens: 0,
            block_size: 16,
            max_step_tokens: 512,
            max_running: 64,
            enable_prefix_cache: true,
            threads: 0,
            default_policy: PolicySpec::full(),
            reserve: ReserveConfig::default(),
            scheduling: SchedulingPolicy::Fcfs,
            tiers: TierConfig::default(),
            kv_dtype: KvDtype::default(),
            placement: TierPlacement::default(),
            kivi_residual_tokens: 0,
            kivi_int8_layers: Vec::new(),
            bf16_matmuls: false,
            fp8_keys_for_queries: true,
            synthetic: None,
            device: Device::Cpu,
            speculative: NgramConfig::off(),
            lora: Vec::new(),
            max_lora_rank: 64,
            lora_dir: None,
            max_loras: 16,
            lora_on_demand: false,
        }
    }
}

impl EngineConfig {
    pub fn new(model_path: impl Into<PathBuf>) -> EngineConfig {
        EngineConfig { model_path: model_path.into(), ..EngineConfig::default() }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub sampling: SamplingParams,
    pub stop_token_ids: Vec<u32>,
    pub namespace: String,
    /// The request's eviction policy; `None` takes the engine's default.
    pub policy: Option<PolicySpec>,
    /// Do not stop at the model's EOS tokens (they are streamed like any other token); `stop_token_ids` still
    /// stop. For benchmarks, where every request must generate exactly `max_tokens` so that configurations do
    /// the same work.
    pub ignore_eos: bool,
    /// Training queries for the context this request creates under EvicPress placement (token ids, each
    /// continuing the context where the prompt's question does; at most
    /// [`MAX_PROFILE_QUESTIONS`](crate::placement::MAX_PROFILE_QUESTIONS) of at most
    /// [`MAX_PROFILE_QUERY_TOKENS`](crate::placement::MAX_PROFILE_QUERY_TOKENS) tokens): the paper's per-context
    /// query set, which the profiler scores every variant on in place of the worker's generic profiling
    /// questions. Ignored under other placements and by requests that create no context.
    pub profile_queries: Vec<Vec<u32>>,
    /// Report each generated token's log-probability with this many most likely alternatives (at most
    /// [`MAX_TOP_LOGPROBS`]); `None` reports none.
    pub logprobs: Option<u32>,
    /// Report each prompt token's log-probability after the first (given the tokens before it), with this many
    /// alternatives, before the first generated token: what scoring a text needs (OpenAI's `echo` with
    /// `logprobs`). The request then adopts no cached prefix, since cached positions have no logits.
    pub prompt_logprobs: Option<u32>,
    /// vLLM's request priority: lower is admitted first and preempted last; ties go by arrival. Anything but 0 needs
    /// [`SchedulingPolicy::Priority`].
    pub priority: i32,
    /// The weight of the request's tenant under [`SchedulingPolicy::Fair`] (at least 1).
    pub tenant_weight: u32,
    /// The codec this request's groups go down a tier in under LRU placement (the `kv.codec` request extension),
    /// instead of the worker's `--tier-codec`; a native codec means the arena's own lossless format. `None` takes
    /// the worker's. Refused under EvicPress placement, which chooses codecs itself.
    pub tier_codec: Option<GroupCodec>,
    /// The LoRA adapter to run with, by the name the worker loaded it under (`None`: the base model). Its blocks
    /// hash in [`crate::model::lora::cache_namespace`] of the request's namespace, which the engine salts.
    pub lora: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum GenerateEvent {
    /// One generated token, with its log-probabilities when the request asked for them. Stop tokens (eos or a
    /// request stop id) end the stream and are not sent.
    Token { id: u32, logprobs: Option<TokenLogprobs> },
    /// The log-probabilities of the next prompt tokens ([`GenerateRequest::prompt_logprobs`]): all the events of
    /// a request together cover its prompt positions 1.. in order, and come before its first token.
    PromptLogprobs(Vec<TokenLogprobs>),
    Finished {
        reason: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
        cached_tokens: u32,
        /// Of `cached_tokens`, those loaded from each lower tier for this request before it was admitted, by
        /// [`Tier::index`] (the device's entry is 0): the rest came from the device pool's own prefix cache.
        onboarded_tokens: [u64; 3],
        /// KV slots the request's eviction policy dropped, and the blocks that returned to the pool.
        evicted_slots: u64,
        evicted_blocks: u64,
        /// Seconds from the request's arrival at the engine to its first step (0 if it never ran).
        queue_seconds: f64,
        /// With [`FinishReason::Stop`]: the stop token the answer ended on (not sent as a token).
        stop_token: Option<u32>,
    },
    /// The engine could not finish the request (a device error, shutdown): another worker may.
    Failed(String),
    /// The request's own constraints left generation nowhere to go (a guide no allowed token continues): any
    /// worker would end the same way, so it is the client's error, not retried.
    Refused(String),
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub blocks_total: u64,
    pub blocks_used: u64,
    pub blocks_cached_free: u64,
    pub running: u64,
    pub waiting: u64,
    pub computed_tokens_total: u64,
    pub cached_tokens_total: u64,
    pub preemptions_total: u64,
    /// The largest running batch since the engine started (the scheduler's count after admission).
    pub peak_running: u64,
    /// Forward steps since the engine started, and the sequences they computed (summed over steps): their ratio
    /// is the mean batch, which the peak alone does not tell.
    pub steps_total: u64,
    pub step_seqs_total: u64,
    /// The most KV blocks held at once since the engine started, as tracked by the pool on every allocation;
    /// it includes the transient peak inside a step that `blocks_used` snapshots miss.
    pub peak_blocks_used: u64,
    /// Slots evicted by each policy ([`PolicyKind::index`]).
    pub evicted_slots: [u64; PolicyKind::ALL.len()],
    /// Blocks each policy's evictions returned to the pool.
    pub evicted_blocks: [u64; PolicyKind::ALL.len()],
    /// Used and capacity bytes per tier and codec (the device tier first).
    pub tier_usage: Vec<TierUsage>,
    /// Prompt tokens served from a cached prefix, by the tier the prefix came from ([`Tier::index`]); they sum to
    /// `cached_tokens_total`, except that onboarded groups evicted again before admission count for their tier.
    pub prefix_hit_tokens: [u64; 3],
    /// Idle device groups copied down to the lower tiers.
    pub offloaded_groups: u64,
    /// Corrupt or truncated disk-tier files found (and discarded) since start.
    pub disk_corrupted: u64,
    /// Disk-tier writes or reads that failed with an I/O error (the group is not kept), since start.
    pub disk_errors: u64,
    /// Disk-tier writes that found the file system full (the tier then shrinks to what it holds), since start.
    pub disk_full: u64,
    /// Peer groups the host tier refused on import (unknown codec, wrong length), since start.
    pub refused_imports: u64,
    /// Tier groups dropped because they failed to decode when onboarded, since start.
    pub undecodable_groups: u64,
    /// EvicPress's contexts, profiles and occupancy, when it places the tiers.
    pub evicpress: Option<EvicPressStats>,
    /// Speculative drafts computed, their tokens, and the tokens the sampler accepted, since start.
    pub drafts_total: u64,
    pub draft_tokens_total: u64,
    pub accepted_draft_tokens_total: u64,
    /// Prompt tokens per second over recent prefill-dominated steps (0 before the first): what the router prices
    /// this worker's prefill at.
    pub prefill_tokens_per_s: f64,
    /// Bytes of one block group (every layer and kv-head, one block of tokens) in the device's KV format.
    pub kv_group_bytes: u64,
    /// Load bandwidth of the host and disk tiers in bytes/s ([`Tier::index`]; the device's entry is unused):
    /// measured, or the cost model's prior before the first load; 0 for a tier this engine does not have.
    pub load_bytes_per_s: [f64; 3],
}

/// Where [`EngineHandle::export_groups`] copies groups from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportFrom {
    /// What a peer fetches: the device pool's exact copy, encoded in the arena's format, else the tiers' copy.
    DeviceFirst,
    /// The host and disk tiers alone, in the codec they hold each group in.
    Tiers,
}

/// How much of a block chain this worker holds, and the measured costs a peer pull is weighed against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixProbe {
    /// Leading hashes held on the device or in a lower tier.
    pub local_blocks: usize,
    /// False without a host tier: pulled groups have nowhere to land, so no pull is worth starting.
    pub can_import: bool,
    /// Measured prefill speed (the cost model's prior until the first prefill).
    pub prefill_tokens_per_s: f64,
    /// Measured host-tier load (decode into device blocks) bandwidth, bytes per second.
    pub host_load_bytes_per_s: f64,
    /// Capacity of the host tier (0 without one): a pull larger than it would evict its own first groups on
    /// import, and onboarding needs exactly those.
    pub host_capacity_bytes: u64,
}

/// What the loaded model is, as clients need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// Salts the prefix-cache chain hash; routers must use the same value.
    pub model_id: String,
    pub name: String,
    pub context_length: usize,
    pub vocab_size: usize,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Element type of the device KV arena.
    pub kv_dtype: KvDtype,
    /// Every token's bytes (empty for special tokens), for JSON-guided sampling; `None` for a model without a
    /// tokenizer (synthetic weights), which refuses such requests.
    pub token_bytes: Option<Arc<TokenTable>>,
}

impl ModelInfo {
    pub fn layout(&self) -> CacheLayout {
        CacheLayout { n_layers: self.n_layers, n_kv_heads: self.n_kv_heads, block_size: self.block_size }
    }

    pub fn attn_dims(&self) -> AttnDims {
        AttnDims {
            n_layers: self.n_layers,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        }
    }
}

/// Why a guided request is refused by a model without a token table.
pub const GUIDE_NEEDS_TOKENIZER: &str = "guided sampling needs the model's tokenizer, which this worker's model lacks";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error("model: {0}")]
    Model(String),
    #[error("engine config: {0}")]
    Config(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("request rejected: {0}")]
    Rejected(#[from] SchedError),
    #[error("forward step failed: {0}")]
    Forward(String),
    #[error("the engine has stopped")]
    Stopped,
    #[error(transparent)]
    Lora(#[from] AdapterError),
}

/// One sequence's slice of a forward step, in the model's terms.
#[derive(Debug, Clone, Copy)]
pub struct StepSeq<'a> {
    /// Tokens computed this step.
    pub tokens: &'a [u32],
    /// RoPE position of `tokens[0]` (tokens already processed).
    pub start_pos: u32,
    /// `n_layers * n_kv_heads` block tables, index `layer * n_kv_heads + head`.
    pub tables: &'a [Vec<u32>],
    /// Cache lengths before this step, same indexing.
    pub prior_lens: &'a [usize],
    /// Which rows of logits (vocab floats each) to append to the output.
    pub logits: LogitsWanted,
    /// Trailing tokens whose queries the eviction policy needs captured.
    pub capture_q: usize,
    /// Have the attention kernel sum this step's attention probabilities, raised to this power, for the eviction
    /// policy (see [`crate::policy::PolicyState::attention_sums`]).
    pub attention_sums: Option<u32>,
    /// The sequence's LoRA adapter, if its request named one.
    pub lora: Option<&'a LoraAdapter>,
}

impl<'a> StepSeq<'a> {
    /// The model's view of this step ([`ForwardSeq`]); every runner hands its model the same fields.
    pub(crate) fn forward_seq(&self) -> ForwardSeq<'a> {
        ForwardSeq {
            tokens: self.tokens,
            start_pos: self.start_pos,
            tables: self.tables,
            prior_lens: self.prior_lens,
            logits: self.logits,
            capture_q: self.capture_q,
            attention_sums: self.attention_sums,
            lora: self.lora,
        }
    }
}

/// The model as the engine thread drives it. Owns the KV storage.
pub trait ModelRunner {
    fn info(&self) -> &ModelInfo;
    /// Computes one batched step; for each sequence, in order, appends the rows of `vocab_size` logits it wants
    /// (none, its last token's, or one per token) to `logits` (which the caller cleared).
    fn forward(&mut self, seqs: &[StepSeq<'_>], logits: &mut Vec<f32>) -> Result<(), EngineError>;
    /// [`ModelRunner::forward`] for a step whose every logits row is sampled greedily: appends each wanted row's
    /// argmax ([`crate::sampling::argmax`]: the lowest index of the maximum, NaN never) to `tokens` instead of the
    /// row. By default the runner's logits go to `scratch` and are picked on the host; a GPU runner picks on the
    /// device and copies back one token per row instead of a row of logits.
    fn forward_greedy(
        &mut self,
        seqs: &[StepSeq<'_>],
        scratch: &mut Vec<f32>,
        tokens: &mut Vec<u32>,
    ) -> Result<(), EngineError> {
        scratch.clear();
        self.forward(seqs, scratch)?;
        let v = self.info().vocab_size.max(1);
        tokens.extend(scratch.chunks_exact(v).map(crate::sampling::argmax));
        Ok(())
    }
    /// The model's input embedding of each of `ids` (below the vocabulary), rows of the hidden size one after
    /// another, written over `out` (resized). EvicPress's profiler compares answers by it. `false` when the runner
    /// does not offer them; the profiler then reports no embedding similarity.
    fn token_embeddings(&mut self, ids: &[u32], out: &mut Vec<f32>) -> bool {
        let _ = (ids, out);
        false
    }
    /// The host KV storage and the last step's activations: what EvicPress's profiler works on. A runner without
    /// host-side KV returns `None`.
    fn policy_io(&mut self) -> Option<PolicyIo<'_>> {
        None
    }
    /// The KV operations and the last step's captured queries the eviction policies read. By default the host
    /// KV of [`ModelRunner::policy_io`]; `None` when the runner cannot evict.
    fn eviction_io(&mut self) -> Option<EvictionIo<'_>> {
        self.policy_io().map(|io| EvictionIo { kv: io.kv, captured: io.captured })
    }
    /// Whether the forward sums the attention probabilities a step asks for (`StepSeq::attention_sums`: H2O's and
    /// KV-Compress's metric). A runner that does not gets the step's queries captured instead, and the policy
    /// scores them against the keys again (`PolicyKv::window_attention_scores`): the same metric, one more pass.
    fn sums_attention(&self) -> bool {
        true
    }
    /// Whether this runner can run eviction policy `kind`: its scores and moves, and the queries or attention
    /// sums it reads. The engine refuses the others by name.
    fn serves_policy(&mut self, kind: PolicyKind) -> bool {
        kind == PolicyKind::Full || self.eviction_io().is_some()
    }
    /// A device error that a call which cannot fail ([`crate::policy::PolicyKv`]) kept: the engine fails the
    /// step with it.
    fn take_error(&mut self) -> Option<EngineError> {
        None
    }
    /// The model's shape, when this runner applies LoRA adapters (`ForwardSeq::lora`); `None` refuses them.
    fn lora_shape(&self) -> Option<ModelConfig> {
        None
    }
    /// The KV arena the host, disk and peer tiers copy block groups out of and back into. A runner without one
    /// cannot serve tiers.
    fn group_kv(&mut self) -> Option<&mut dyn GroupKv> {
        None
    }
}

/// A runner's host KV and the last step's activations (EvicPress's profiler; the CPU runner's eviction).
pub struct PolicyIo<'a> {
    pub kv: &'a mut KvStorage,
    /// The last step's activations; [`Scratch::captured_q`] and [`Scratch::attn_probs`] give each batch entry's
    /// captured queries and attention probabilities.
    pub captured: &'a Scratch,
}

/// What the eviction hooks need from a runner after a step.
pub struct EvictionIo<'a> {
    pub kv: &'a mut dyn PolicyKv,
    pub captured: &'a dyn StepCaptures,
}

/// What the last forward step captured for the eviction policies, per batch entry.
pub trait StepCaptures {
    /// Batch entry `seq`'s captured post-RoPE queries, `[layer][capture_q][q_dim]` (empty when none).
    fn captured_q(&self, seq: usize) -> &[f32];
    /// Batch entry `seq`'s summed attention probabilities and their row stride (see [`Scratch::attn_probs`]).
    fn attn_probs(&self, seq: usize) -> Option<(&[f32], usize)>;
}

impl StepCaptures for Scratch {
    fn captured_q(&self, seq: usize) -> &[f32] {
        Scratch::captured_q(self, seq)
    }

    fn attn_probs(&self, seq: usize) -> Option<(&[f32], usize)> {
        Scratch::attn_probs(self, seq)
    }
}

/// The logits rows a step computes for entry `e` of sequence `seq`: one per token while prompt positions whose
/// logits are wanted remain in the chunk ([`Sequence::prompt_logits_from`]), else the last one when the entry
/// samples.
pub fn logits_wanted<P>(seq: &Sequence<P>, e: &ScheduledSeq) -> LogitsWanted {
    if seq.prompt_logits_from(e.start) || e.draft > 0 {
        LogitsWanted::All
    } else if e.wants_logits {
        LogitsWanted::Last
    } else {
        LogitsWanted::None
    }
}

/// One forward step over `plan`, shared by the engine thread and the inline drivers (`pagoda bench engine`,
/// `pagoda eval`): builds the batch from the scheduler's sequences (capturing the queries their policies
/// observe), runs it, records it in the scheduler and runs each sequence's eviction hooks. Logits rows of the
/// `wants_logits` entries land in `logits` in plan order, or, with `greedy`, their argmax tokens land there
/// ([`ModelRunner::forward_greedy`]; `logits` is then scratch). `batch` is a reused buffer. An eviction that cannot run
/// (the pool cannot supply a copy-on-write block) is skipped with a warning. Compaction is all or nothing per
/// (layer, kv-head) table, not per sequence: the tables compacted before the failure stay pruned, the rest keep
/// more KV than the budget until a later step evicts again (a one-shot prefill selection is retried at the
/// sequence's next step).
pub fn forward_step<P, R: ModelRunner>(
    sched: &mut Scheduler<P>,
    runner: &mut R,
    plan: &StepPlan,
    batch: &mut Vec<StepSeq<'static>>,
    logits: &mut Vec<f32>,
    greedy: Option<&mut Vec<u32>>,
) -> Result<(), EngineError> {
    logits.clear();
    let sums = runner.sums_attention();
    let mut b = recycle_steps(std::mem::take(batch));
    for e in &plan.seqs {
        let Some(seq) = sched.get(e.seq) else { continue };
        b.push(StepSeq {
            tokens: &seq.tokens()[e.start..e.start + e.n],
            start_pos: e.start as u32,
            tables: seq.tables(),
            prior_lens: seq.lens(),
            logits: logits_wanted(seq, e),
            capture_q: seq.capture_for(e.start, e.n, sums),
            attention_sums: if sums { seq.attention_sums() } else { None },
            lora: seq.lora(),
        });
    }
    let result = match greedy {
        Some(tokens) => {
            tokens.clear();
            runner.forward_greedy(&b, logits, tokens)
        }
        None => runner.forward(&b, logits),
    };
    *batch = recycle_steps(b);
    result?;
    sched.complete_step(plan);
    let Some(io) = runner.eviction_io() else { return Ok(()) };
    // Batch index: the plan entries whose sequence was found above, in order.
    let mut i = 0;
    for e in &plan.seqs {
        let Some(seq) = sched.get(e.seq) else { continue };
        let full = seq.policy().is_full();
        let queries = io.captured.captured_q(i);
        let probs = io.captured.attn_probs(i).map(|(sums, stride)| StepProbs { sums, stride });
        if !full && let Err(err) = sched.apply_policy(e.seq, e.start, e.n, queries, probs, io.kv) {
            tracing::warn!(seq = e.seq, error = %err, "eviction skipped");
        }
        i += 1;
    }
    runner.take_error().map_or(Ok(()), Err)
}

/// `a, b, c` of policy names.
fn policy_list(kinds: &[PolicyKind]) -> String {
    kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ")
}

/// The largest token budget of one step: the step's activations and logits are sized for it at start.
pub const MAX_STEP_TOKENS: usize = 65_536;
/// The most sequences running at once.
pub const MAX_RUNNING: usize = 4096;
/// The most compute threads (each helper polls between calls; more than the machine's cores only costs).
pub const MAX_THREADS: usize = 1024;

/// Compute threads for a requested count: 0 means every core.
pub fn resolve_threads(threads: usize) -> usize {
    if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads }
}

/// Pool size for `num_blocks == 0`: two full contexts.
pub fn auto_num_blocks(layout: CacheLayout, context_length: usize) -> usize {
    layout.blocks_for_tokens(context_length.max(1)) * 2
}

enum Command {
    Submit {
        /// The adapter the request named, resolved by the handle.
        lora: Option<Arc<LoraAdapter>>,
        /// Boxed: a request is far larger than the other commands.
        req: Box<GenerateRequest>,
        events: UnboundedSender<GenerateEvent>,
    },
    Cancel(String),
    /// Start reporting block changes into this log.
    Subscribe(EventLog),
    /// Answer with every block held now and the sequence number that covers.
    Snapshot(tokio::sync::oneshot::Sender<ResidencySnapshot>),
    /// Peer transfer: how much of a chain is held here, and the costs a pull is weighed against.
    ProbePrefix {
        hashes: Vec<u64>,
        reply: tokio::sync::oneshot::Sender<PrefixProbe>,
    },
    /// Peer transfer: copies of the groups continuing from the first hash (see
    /// [`EngineHandle::export_groups`]).
    Export {
        hashes: Vec<u64>,
        max_bytes: u64,
        from: ExportFrom,
        reply: tokio::sync::oneshot::Sender<Vec<(u64, EncodedGroup)>>,
    },
    /// Peer transfer: groups pulled from a peer, stored into the host tier.
    Import {
        groups: Vec<(u64, EncodedGroup)>,
        reply: tokio::sync::oneshot::Sender<usize>,
    },
    /// Native groups written into the device pool as a cached prefix (see [`EngineHandle::seed_device`]).
    SeedDevice {
        groups: Vec<(u64, EncodedGroup)>,
        reply: tokio::sync::oneshot::Sender<usize>,
    },
    Shutdown,
}

struct HandleInner {
    tx: Mutex<Sender<Command>>,
    info: ModelInfo,
    sched_cfg: SchedulerConfig,
    default_policy: PolicySpec,
    /// The eviction policies the runner runs: a request naming another is refused, rather than served with a
    /// full cache it did not ask for.
    policies: Vec<PolicyKind>,
    /// EvicPress places the tiers, over these codecs (besides the native format): a request may name one of them
    /// for its context ([`GenerateRequest::tier_codec`]), which is then stored in it or not at all.
    evicpress_codecs: Option<Vec<Codec>>,
    /// The LoRA adapters loaded now (at start-up and at run time).
    lora: AdapterRegistry,
    stats: Arc<Mutex<EngineStats>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for HandleInner {
    fn drop(&mut self) {
        if let Ok(tx) = self.tx.lock() {
            let _ = tx.send(Command::Shutdown);
        }
    }
}

/// The client side of the engine. Clone freely; the engine stops when the last clone is dropped.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<HandleInner>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle").field("model", &self.inner.info.model_id).finish()
    }
}

impl EngineHandle {
    pub fn model_info(&self) -> &ModelInfo {
        &self.inner.info
    }

    /// The policy requests get when they name none.
    pub fn default_policy(&self) -> PolicySpec {
        self.inner.default_policy
    }

    /// How the scheduler orders requests.
    pub fn scheduling_policy(&self) -> SchedulingPolicy {
        self.inner.sched_cfg.scheduling
    }

    /// Validates and queues a request. Events arrive on the returned receiver; dropping it cancels the
    /// request and frees its blocks.
    pub fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<GenerateEvent>, EngineError> {
        let lora = self.lora_of(&req)?;
        self.submit_with(req, lora)
    }

    /// [`EngineHandle::submit`] for a request whose adapter the caller has resolved already
    /// ([`EngineHandle::resolve_lora`]): holding it, the caller knows no eviction takes it in between.
    pub fn submit_with(
        &self,
        req: GenerateRequest,
        lora: Option<Arc<LoraAdapter>>,
    ) -> Result<UnboundedReceiver<GenerateEvent>, EngineError> {
        if req.lora.as_deref() != lora.as_ref().map(|a| a.name()) {
            return Err(EngineError::InvalidRequest("the adapter given is not the one the request names".into()));
        }
        self.validate(&req)?;
        let mut req = req;
        if let Some(adapter) = &lora {
            req.namespace = cache_namespace(&req.namespace, adapter.cache_id());
        }
        let (events, rx) = unbounded_channel();
        self.send(Command::Submit { req: Box::new(req), lora, events })?;
        Ok(rx)
    }

    /// The adapter `name`, loaded from `--lora-dir` first when `--lora-on-demand` allows it (see
    /// [`AdapterRegistry::resolve`]). May read the adapter's files on the calling thread: call it from a blocking
    /// context unless [`EngineHandle::lora_loaded`] says it is loaded.
    pub fn resolve_lora(&self, name: &str) -> Result<Arc<LoraAdapter>, EngineError> {
        Ok(self.inner.lora.resolve(name)?)
    }

    /// The adapter `name` if it is loaded now.
    pub fn lora_loaded(&self, name: &str) -> Option<Arc<LoraAdapter>> {
        self.inner.lora.get(name).ok()
    }

    /// The worker's adapter registry: what is loaded, what may be loaded on demand, and its counters.
    pub fn lora_registry(&self) -> &AdapterRegistry {
        &self.inner.lora
    }

    /// The adapter `req` names, or `None` for the base model; an error names an adapter this worker lacks.
    fn lora_of(&self, req: &GenerateRequest) -> Result<Option<Arc<LoraAdapter>>, EngineError> {
        let Some(name) = &req.lora else { return Ok(None) };
        Ok(Some(self.inner.lora.get(name)?))
    }

    /// The LoRA adapters this engine serves, by name.
    pub fn lora_adapters(&self) -> Vec<Arc<LoraAdapter>> {
        self.inner.lora.list()
    }

    /// Loads the PEFT adapter at `path` under `--lora-dir` as `name` (see [`AdapterRegistry::load`]). Reads the
    /// adapter's files on the calling thread: call it from a blocking context.
    pub fn load_lora(&self, name: &str, path: &str) -> Result<Arc<LoraAdapter>, EngineError> {
        Ok(self.inner.lora.load(name, path)?)
    }

    /// Unloads the adapter `name`; requests running with it finish with it.
    pub fn unload_lora(&self, name: &str) -> Result<(), EngineError> {
        Ok(self.inner.lora.unload(name)?)
    }

    /// Cancels every queued or running request with this id (no-op when none).
    pub fn cancel(&self, request_id: &str) -> Result<(), EngineError> {
        self.send(Command::Cancel(request_id.to_owned()))
    }

    /// Starts reporting every block the engine stores in or drops from a tier (see [`crate::events`]): batches of
    /// sequence-numbered changes arrive on the returned receiver, at most `capacity` waiting; beyond that the
    /// engine drops them (leaving a hole in the numbering) rather than wait. A second call replaces the first.
    pub fn report_events(&self, capacity: usize) -> Result<tokio::sync::mpsc::Receiver<SeqBatch>, EngineError> {
        let (log, rx) = EventLog::channel(capacity);
        self.send(Command::Subscribe(log))?;
        Ok(rx)
    }

    /// Every block held now in every tier, and the last sequence number of the reported changes it covers. The
    /// engine answers between steps.
    pub async fn residency_snapshot(&self) -> Result<ResidencySnapshot, EngineError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Command::Snapshot(tx))?;
        rx.await.map_err(|_| EngineError::Stopped)
    }

    /// How many leading `hashes` this worker holds on any tier, and its measured costs. Answered between steps.
    pub async fn probe_prefix(&self, hashes: Vec<u64>) -> Result<PrefixProbe, EngineError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.send(Command::ProbePrefix { hashes, reply })?;
        rx.await.map_err(|_| EngineError::Stopped)
    }

    /// Copies of the groups stored under the leading `hashes` where `from` says, in order: it stops at the first
    /// hash held nowhere there, and before the group that would take the total past `max_bytes` (the first group is
    /// always included when present). Answered between steps; marks tier groups recently used.
    pub async fn export_groups(
        &self,
        hashes: Vec<u64>,
        max_bytes: u64,
        from: ExportFrom,
    ) -> Result<Vec<(u64, EncodedGroup)>, EngineError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.send(Command::Export { hashes, max_bytes, from, reply })?;
        rx.await.map_err(|_| EngineError::Stopped)
    }

    /// Stores groups pulled from a peer into the host tier, where the next admission of a request with their
    /// prefix onboards them like any host hit. Returns how many were stored (0 without a host tier).
    pub async fn import_groups(&self, groups: Vec<(u64, EncodedGroup)>) -> Result<usize, EngineError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.send(Command::Import { groups, reply })?;
        rx.await.map_err(|_| EngineError::Stopped)
    }

    /// Writes `groups` (a prefix chain's hashes in order, each with its group in the runner's native, lossless
    /// format) into the device pool as an idle cached prefix, exactly as if their tokens had just been computed
    /// here: the next request with that prefix adopts them as a device hit, and the engine offloads or places them
    /// as it does computed groups. A benchmark's untimed offline phase uses it to prefill each context once for all
    /// the configurations it compares, and a decode worker without a host tier to write a remote prefill's pulled
    /// groups where its request finds them. Groups already on the device are kept as they are. It stops at the first
    /// group in another format, that does not decode, or that finds no room beside the running sequences. Returns
    /// how many leading groups are on the device. Answered between steps.
    pub async fn seed_device(&self, groups: Vec<(u64, EncodedGroup)>) -> Result<usize, EngineError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.send(Command::SeedDevice { groups, reply })?;
        rx.await.map_err(|_| EngineError::Stopped)
    }

    /// The latest statistics snapshot (published after every engine step and command).
    pub fn stats(&self) -> EngineStats {
        self.inner.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Whether the engine thread is still there to serve: false once it has stopped (shut down, or died of a
    /// panic). What serves it reports this as its health, and a process embedding it exits, so that a supervisor
    /// restarts it rather than leaving it up and failing every request.
    pub fn is_running(&self) -> bool {
        self.inner.thread.lock().ok().and_then(|t| t.as_ref().map(|h| !h.is_finished())).unwrap_or(false)
    }

    /// Stops the engine thread: in-flight requests get `Failed`. Blocks until the thread has exited.
    pub fn shutdown(&self) {
        let _ = self.send(Command::Shutdown);
        let handle = self.inner.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
    }

    fn send(&self, cmd: Command) -> Result<(), EngineError> {
        let tx = self.inner.tx.lock().map_err(|_| EngineError::Stopped)?;
        tx.send(cmd).map_err(|_| EngineError::Stopped)
    }

    fn validate(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        let info = &self.inner.info;
        // Here, not only in the gRPC service: whoever submits, a namespace spelling an adapter's salt would write
        // the base model's KV under that adapter's hashes.
        crate::cache::check_namespace(&req.namespace).map_err(EngineError::InvalidRequest)?;
        if let Some(bad) = req.prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(EngineError::InvalidRequest(format!(
                "prompt token id {bad} is outside the vocabulary ({})",
                info.vocab_size
            )));
        }
        let s = &req.sampling;
        if !s.temperature.is_finite() || s.temperature < 0.0 {
            return Err(EngineError::InvalidRequest(format!("temperature must be >= 0, got {}", s.temperature)));
        }
        if !s.top_p.is_finite() || s.top_p <= 0.0 || s.top_p > 1.0 {
            return Err(EngineError::InvalidRequest(format!("top_p must be in (0, 1], got {}", s.top_p)));
        }
        let mut bias = s.logit_bias.clone();
        crate::sampling::check_logit_bias(&mut bias, info.vocab_size).map_err(EngineError::InvalidRequest)?;
        crate::sampling::check_allowed_tokens(&s.allowed_token_ids, info.vocab_size)
            .map_err(EngineError::InvalidRequest)?;
        crate::sampling::check_bad_words(&s.bad_words, info.vocab_size).map_err(EngineError::InvalidRequest)?;
        s.check_penalties(req.prompt.len()).map_err(EngineError::InvalidRequest)?;
        if s.guided() && info.token_bytes.is_none() {
            return Err(EngineError::InvalidRequest(GUIDE_NEEDS_TOKENIZER.into()));
        }
        if s.ends_on_stop() && req.ignore_eos && req.stop_token_ids.is_empty() {
            let guide = if s.regex.is_some() { "regex" } else { "grammar" };
            return Err(EngineError::InvalidRequest(format!(
                "a {guide}-guided answer ends on a stop token once it matches: drop ignore_eos or give stop_token_ids"
            )));
        }
        if s.min_tokens > req.max_tokens {
            return Err(EngineError::InvalidRequest(format!(
                "min_tokens {} is more than max_tokens {}",
                s.min_tokens, req.max_tokens
            )));
        }
        if let Some(n) = [req.logprobs, req.prompt_logprobs].into_iter().flatten().find(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(EngineError::InvalidRequest(format!(
                "top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {n}"
            )));
        }
        crate::placement::check_profile_queries(
            &req.profile_queries,
            req.prompt.len(),
            info.vocab_size,
            info.context_length,
        )
        .map_err(EngineError::InvalidRequest)?;
        if let Some(p) = &req.policy {
            if !self.inner.policies.contains(&p.kind) {
                return Err(EngineError::InvalidRequest(format!(
                    "KV policy {} is not run by this worker's backend (it runs {})",
                    p.kind.name(),
                    policy_list(&self.inner.policies)
                )));
            }
            let budgets = crate::policy::defaults::MIN_BUDGET_TOKENS..=info.context_length;
            if !p.is_full() && !budgets.contains(&p.budget_tokens) {
                return Err(EngineError::InvalidRequest(format!(
                    "KV budget must be in {}..={} tokens, got {}",
                    budgets.start(),
                    budgets.end(),
                    p.budget_tokens
                )));
            }
        }
        check_priority(&self.inner.sched_cfg, req.priority).map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
        if let (Some(GroupCodec::Kv(codec)), Some(offered)) = (req.tier_codec, &self.inner.evicpress_codecs)
            && !offered.contains(&codec)
        {
            let names: Vec<&str> = offered.iter().map(|c| c.name()).collect();
            return Err(EngineError::InvalidRequest(format!(
                "kv.codec {} is not one of the codecs this worker's EvicPress placement stores contexts in: native \
                 or {}",
                codec.name(),
                names.join(", ")
            )));
        }
        // The scheduler would clamp the answer at the context, but a client asking for more than fits is told so
        // (as the gRPC service does), and the sampler sizes its buffers by `max_tokens`. A prompt that is itself
        // too long gets `check_fits`'s error.
        let room = info.context_length.saturating_sub(req.prompt.len());
        if room > 0 && req.max_tokens as usize > room {
            return Err(EngineError::InvalidRequest(format!(
                "prompt ({}) + max_tokens ({}) exceeds the model context length {}",
                req.prompt.len(),
                req.max_tokens,
                info.context_length
            )));
        }
        check_fits(&self.inner.sched_cfg, info.layout(), info.num_blocks, req.prompt.len(), req.max_tokens as usize)?;
        Ok(())
    }
}

pub struct Engine;

impl Engine {
    /// Loads the model `config` names and starts the engine thread with the runner of `config.device`.
    pub fn start(config: EngineConfig) -> Result<EngineHandle, EngineError> {
        match config.device {
            Device::Cpu => Engine::start_with(config, LlamaRunner::load),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => Engine::start_with(config, crate::runner_cuda::CudaRunner::load),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(no_cuda_build()),
        }
    }

    /// Starts the engine thread with a runner built on that thread by `make`.
    pub fn start_with<R, F>(config: EngineConfig, make: F) -> Result<EngineHandle, EngineError>
    where
        R: ModelRunner + 'static,
        F: FnOnce(&EngineConfig) -> Result<R, EngineError> + Send + 'static,
    {
        let max_block = pagoda_kernels::codec::MAX_BLOCK_SIZE;
        if config.block_size == 0 || config.block_size > max_block {
            return Err(EngineError::Config(format!("block_size must be 1 to {max_block}")));
        }
        for (name, value, max) in [
            ("max_step_tokens", config.max_step_tokens, MAX_STEP_TOKENS),
            ("max_running", config.max_running, MAX_RUNNING),
        ] {
            if value == 0 || value > max {
                return Err(EngineError::Config(format!("{name} must be 1 to {max}, not {value}")));
            }
        }
        if config.threads > MAX_THREADS {
            return Err(EngineError::Config(format!("threads must be 0 (every core) to {MAX_THREADS}")));
        }
        let (tx, rx) = mpsc::channel::<Command>();
        type Ready = (ModelInfo, Vec<PolicyKind>, AdapterRegistry);
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<Ready, EngineError>>(1);
        let stats = Arc::new(Mutex::new(EngineStats::default()));
        let thread_stats = Arc::clone(&stats);
        let thread_cfg = config.clone();
        let thread = std::thread::Builder::new()
            .name("pagoda-engine".into())
            .spawn(move || {
                let mut runner = match make(&thread_cfg) {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                // A default policy the runner cannot run is refused rather than silently not applied.
                let policies: Vec<PolicyKind> =
                    PolicyKind::ALL.into_iter().filter(|&k| runner.serves_policy(k)).collect();
                if !policies.contains(&thread_cfg.default_policy.kind) {
                    let _ = ready_tx.send(Err(EngineError::Config(format!(
                        "--kv-policy {}: the {} backend does not run this policy (it runs {})",
                        thread_cfg.default_policy.kind.name(),
                        thread_cfg.device,
                        policy_list(&policies)
                    ))));
                    return;
                }
                let info = runner.info().clone();
                let adapters = match AdapterRegistry::open(runner.lora_shape(), &info.model_id, &thread_cfg) {
                    Ok(a) => a,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let tiers = match open_tiers(&thread_cfg, &info) {
                    Ok(t) => t,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let int8_layers = match kivi_int8_layers(&thread_cfg, &info) {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let mut evicpress = match open_placement(&thread_cfg, &info, tiers.as_ref(), int8_layers) {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                // The profiler encodes the variants it scores as the tiers will store them.
                if let (Some(ep), Some(r)) = (evicpress.as_mut(), runner.group_kv().and_then(|g| g.key_roundings())) {
                    ep.set_key_rounding(r);
                }
                let mut core =
                    EngineLoop::new(runner, sched_config(&thread_cfg, &info), thread_cfg.default_policy, thread_stats);
                core.kivi_int8_layers = int8_layers;
                core.tier_codec = match thread_cfg.placement {
                    TierPlacement::LruCodec(c) => GroupCodec::stored(c, int8_layers),
                    _ => GroupCodec::Native(info.kv_dtype),
                };
                // A request may name a KIVI codec on a worker whose own is not.
                if thread_cfg.kivi_residual_tokens > 0 {
                    core.residual =
                        ResidualTails::new(residual::residual_groups(thread_cfg.kivi_residual_tokens, info.block_size));
                }
                core.evicpress = evicpress;
                if let Some(t) = tiers {
                    core.sched.pool_mut().track_idle();
                    core.tiers = Some(t);
                }
                core.publish_stats();
                if ready_tx.send(Ok((info, policies, adapters))).is_err() {
                    return;
                }
                core.run(rx);
            })
            .map_err(|e| EngineError::Config(format!("cannot spawn the engine thread: {e}")))?;
        let (info, policies, adapters) = match ready_rx.recv() {
            Ok(Ok(ready)) => ready,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(EngineError::Stopped);
            }
        };
        let sched_cfg = sched_config(&config, &info);
        Ok(EngineHandle {
            inner: Arc::new(HandleInner {
                tx: Mutex::new(tx),
                info,
                sched_cfg,
                default_policy: config.default_policy,
                policies,
                evicpress_codecs: match &config.placement {
                    TierPlacement::EvicPress(ep) => Some(ep.codecs.clone()),
                    _ => None,
                },
                lora: adapters,
                stats,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }
}

/// Opens the configured lower tiers. A disk read is bounded by the encoded size of one group of this model.
fn open_tiers(cfg: &EngineConfig, info: &ModelInfo) -> Result<Option<TierStore>, EngineError> {
    // The widest native codec bounds what a disk read may return: groups written under either dtype load.
    let group = native::group_bytes(info.layout().group_size(), info.block_size, info.head_dim, KvDtype::F32) as u64;
    TierStore::open(&cfg.tiers, group).map_err(|e| EngineError::Config(e.to_string()))
}

/// The checked `--kivi-int8-layers` of this model, if any.
fn kivi_int8_layers(cfg: &EngineConfig, info: &ModelInfo) -> Result<Option<Int8Layers>, EngineError> {
    if cfg.kivi_int8_layers.is_empty() {
        return Ok(None);
    }
    Int8Layers::new(&cfg.kivi_int8_layers, info.n_layers)
        .map(Some)
        .map_err(|e| EngineError::Config(format!("--kivi-int8-layers: {e}")))
}

/// The EvicPress driver, when configured (it needs a lower tier to place into).
fn open_placement(
    cfg: &EngineConfig,
    info: &ModelInfo,
    tiers: Option<&TierStore>,
    kivi_int8_layers: Option<Int8Layers>,
) -> Result<Option<EvicPress>, EngineError> {
    residual::check_tokens(cfg.kivi_residual_tokens)
        .map_err(|e| EngineError::Config(format!("--kivi-residual-tokens: {e}")))?;
    match &cfg.placement {
        TierPlacement::Lru => Ok(None),
        TierPlacement::LruCodec(c) => {
            GroupCodec::Kv(*c)
                .group_bytes(1, info.block_size, info.head_dim)
                .map_err(|e| EngineError::Config(format!("--tier-codec: {e}")))?;
            Ok(None)
        }
        TierPlacement::EvicPress(ep) => {
            let Some(tiers) = tiers else {
                return Err(EngineError::Config("EvicPress placement needs a host or disk tier".into()));
            };
            let ep = EvicPressConfig { residual_tokens: cfg.kivi_residual_tokens, kivi_int8_layers, ..ep.clone() };
            EvicPress::new(ep, &info.model_id, info.layout(), info.head_dim, info.kv_dtype, tiers).map(Some)
        }
    }
}

fn sched_config(cfg: &EngineConfig, info: &ModelInfo) -> SchedulerConfig {
    SchedulerConfig {
        max_step_tokens: cfg.max_step_tokens,
        max_running: cfg.max_running,
        enable_prefix_cache: cfg.enable_prefix_cache,
        max_model_len: info.context_length,
        model_id: info.model_id.clone(),
        attn: info.attn_dims(),
        reserve: cfg.reserve,
        speculative: cfg.speculative,
        scheduling: cfg.scheduling,
    }
}

/// Per-request state the scheduler carries for the engine.
struct ReqState {
    request_id: String,
    events: UnboundedSender<GenerateEvent>,
    sampler: Sampler,
    /// [`GenerateRequest::profile_queries`], handed to EvicPress when the request finishes.
    profile_queries: Vec<Vec<u32>>,
    /// [`GenerateRequest::logprobs`].
    logprobs: Option<u32>,
    /// [`GenerateRequest::prompt_logprobs`], and the next prompt position to report (a preempted sequence
    /// computes its prompt again; what was reported is not reported twice).
    prompt_logprobs: Option<u32>,
    prompt_logprobs_next: usize,
    /// [`GenerateRequest::tier_codec`], and how many of the sequence's chain hashes have been pinned to it.
    tier_codec: Option<GroupCodec>,
    pinned_groups: usize,
    /// When the engine took the request, and how long it then waited for its first step.
    arrived: Instant,
    queue_seconds: Option<f64>,
}

/// Pins the sequence's groups hashed since the last call to the codec its request named, if it named one.
fn pin_tier_codec(pins: &mut CodecPins, seq: &mut Sequence<ReqState>) {
    let Some(codec) = seq.payload.tier_codec else { return };
    let hashes = seq.hashes();
    let from = seq.payload.pinned_groups.min(hashes.len());
    pins.pin(&hashes[from..], codec);
    seq.payload.pinned_groups = hashes.len();
}

struct EngineLoop<R> {
    runner: R,
    sched: Scheduler<ReqState>,
    eos: Vec<u32>,
    vocab: usize,
    logits: Vec<f32>,
    /// A greedy step's tokens, one per logits row ([`ModelRunner::forward_greedy`]).
    greedy_tokens: Vec<u32>,
    sample_buf: SampleBuffer,
    /// The tokens a guided sequence's guide forces next (reused).
    forced_draft: Vec<u32>,
    closed: Vec<SeqId>,
    plan: StepPlan,
    batch: Vec<StepSeq<'static>>,
    default_policy: PolicySpec,
    stats: Arc<Mutex<EngineStats>>,
    /// Host and disk tiers, when configured.
    tiers: Option<TierStore>,
    /// The codec of LRU offloads.
    tier_codec: GroupCodec,
    /// `--kivi-int8-layers`, checked against the model.
    kivi_int8_layers: Option<Int8Layers>,
    /// The tails of finished prompts that LRU offloads keep native under a KIVI codec.
    residual: ResidualTails,
    /// The codecs requests named for their groups ([`GenerateRequest::tier_codec`]).
    pins: CodecPins,
    /// EvicPress placement of the tiers, when configured (then it, not LRU offloading, fills them).
    evicpress: Option<EvicPress>,
    /// Reused buffers for tier traffic.
    hashes: Vec<u64>,
    blocks: Vec<u32>,
    /// Prompt tokens onboarded from host and from disk ([`Tier::index`]).
    onboarded_tokens: [u64; 3],
    /// Prompt tokens per second over recent prefill-dominated steps, for the stats, on an engine without lower
    /// tiers; with them the tiers' cost model is the one owner of that average (and of its fit).
    prefill_speed: crate::tiers::cost::Ewma,
    /// Where block changes go once a reporter subscribed.
    events: Option<EventLog>,
    /// Reused buffers for block changes.
    index_changes: Vec<IndexChange>,
    changes: Vec<BlockChange>,
}

enum Flow {
    Continue,
    Stop,
}

impl<R: ModelRunner> EngineLoop<R> {
    fn new(
        runner: R,
        cfg: SchedulerConfig,
        default_policy: PolicySpec,
        stats: Arc<Mutex<EngineStats>>,
    ) -> EngineLoop<R> {
        let info = runner.info();
        let sched = Scheduler::new(cfg, info.layout(), info.num_blocks);
        let eos = info.eos_token_ids.clone();
        let vocab = info.vocab_size;
        let kv_dtype = info.kv_dtype;
        EngineLoop {
            runner,
            sched,
            eos,
            vocab,
            logits: Vec::new(),
            greedy_tokens: Vec::new(),
            sample_buf: SampleBuffer::with_capacity(vocab),
            forced_draft: Vec::new(),
            closed: Vec::new(),
            plan: StepPlan::default(),
            batch: Vec::new(),
            default_policy,
            stats,
            tiers: None,
            tier_codec: GroupCodec::Native(kv_dtype),
            kivi_int8_layers: None,
            residual: ResidualTails::default(),
            pins: CodecPins::default(),
            evicpress: None,
            hashes: Vec::new(),
            blocks: Vec::new(),
            onboarded_tokens: [0; 3],
            prefill_speed: crate::tiers::cost::Ewma::new(0.0),
            events: None,
            index_changes: Vec::new(),
            changes: Vec::new(),
        }
    }

    fn run(&mut self, rx: Receiver<Command>) {
        loop {
            // Idle: block for the next command. Busy: take what has arrived, then step.
            if !self.sched.has_work() {
                match rx.recv() {
                    Ok(cmd) => {
                        if let Flow::Stop = self.handle(cmd) {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
            let mut stop = false;
            loop {
                match rx.try_recv() {
                    Ok(cmd) => {
                        if let Flow::Stop = self.handle(cmd) {
                            stop = true;
                            break;
                        }
                    }
                    // Every handle is gone: finish the work in flight, then exit.
                    Err(TryRecvError::Disconnected) => {
                        if !self.sched.has_work() {
                            stop = true;
                        }
                        break;
                    }
                    Err(TryRecvError::Empty) => break,
                }
            }
            if stop {
                break;
            }
            self.drop_closed();
            let progressed = self.sched.has_work() && self.step();
            self.offload_idle();
            self.place_contexts();
            self.report_changes();
            self.publish_stats();
            if self.sched.has_work() && !progressed {
                // Nothing schedulable (admission checks prevent this); wait instead of spinning.
                match rx.recv_timeout(Duration::from_millis(10)) {
                    Ok(cmd) => {
                        if let Flow::Stop = self.handle(cmd) {
                            break;
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => {}
                }
            }
        }
        self.fail_all("the engine has stopped");
        self.offload_idle();
        if let Some(t) = &mut self.tiers {
            // Host RAM does not survive the process; what fits on disk does.
            t.spill_host();
        }
        self.report_changes();
        self.publish_stats();
    }

    /// Bytes of one device block group (every (layer, kv-head) block of one token block, K and V).
    fn device_group_bytes(&self) -> u64 {
        let info = self.runner.info();
        (2 * info.block_size * info.kv_dtype.slot_bytes(info.head_dim) * info.layout().group_size()) as u64
    }

    /// Hands the block changes since the last call to the reporter (when one subscribed). Never blocks.
    fn report_changes(&mut self) {
        if self.events.is_none() {
            return;
        }
        let group_bytes = self.device_group_bytes();
        self.index_changes.clear();
        self.sched.pool_mut().take_index_changes(&mut self.index_changes);
        let device_codec = native::codec_name(self.runner.info().kv_dtype);
        for c in &self.index_changes {
            let codec = device_codec.into();
            self.changes.push(match *c {
                IndexChange::Registered(hash) => {
                    BlockChange::Stored { hash, tier: Tier::Device, codec, bytes: group_bytes }
                }
                IndexChange::Evicted(hash) => BlockChange::Removed { hash, tier: Tier::Device, codec },
            });
        }
        if let Some(t) = &mut self.tiers {
            t.take_changes(&mut self.changes);
        }
        let Some(log) = &mut self.events else { return };
        let first_drop = log.dropped() == 0;
        if !log.push(&mut self.changes) && first_drop {
            tracing::warn!("block-event queue full: changes dropped; the reporter will send a snapshot");
        }
        self.changes.clear();
    }

    /// Every block held now, at the last reported sequence number.
    fn residency_snapshot(&mut self) -> ResidencySnapshot {
        // Changes not yet handed over are part of what the snapshot covers.
        self.report_changes();
        let group_bytes = self.device_group_bytes();
        let mut blocks: Vec<BlockChange> = self
            .sched
            .pool()
            .index()
            .iter()
            .map(|(hash, _)| BlockChange::Stored {
                hash,
                tier: Tier::Device,
                codec: native::codec_name(self.runner.info().kv_dtype).into(),
                bytes: group_bytes,
            })
            .collect();
        if let Some(t) = &self.tiers {
            t.residency(&mut blocks);
        }
        ResidencySnapshot { seq: self.events.as_ref().map_or(0, EventLog::last_seq), blocks }
    }

    fn handle(&mut self, cmd: Command) -> Flow {
        match cmd {
            Command::Submit { req, lora, events } => {
                let req = *req;
                let mut stop = req.stop_token_ids;
                if !req.ignore_eos {
                    for &e in &self.eos {
                        if !stop.contains(&e) {
                            stop.push(e);
                        }
                    }
                }
                // What the context leaves, not `max_tokens` alone: the sampler reserves room for every token the
                // request can emit.
                let can_emit =
                    (req.max_tokens as usize).min(self.runner.info().context_length.saturating_sub(req.prompt.len()));
                let state = ReqState {
                    request_id: req.request_id,
                    events,
                    sampler: Sampler::for_request(req.sampling, &req.prompt, can_emit, &stop)
                        .with_guide(self.runner.info().token_bytes.as_ref(), &req.prompt),
                    profile_queries: req.profile_queries,
                    logprobs: req.logprobs,
                    prompt_logprobs: req.prompt_logprobs,
                    prompt_logprobs_next: 1,
                    // A native codec is this arena's own format, whatever its element type; a KIVI codec is stored
                    // layered when the worker is (`--kivi-int8-layers`).
                    tier_codec: req.tier_codec.map(|c| match c {
                        GroupCodec::Native(_) => GroupCodec::Native(self.runner.info().kv_dtype),
                        GroupCodec::Kv(c) => GroupCodec::stored(c, self.kivi_int8_layers),
                        layered => layered,
                    }),
                    pinned_groups: 0,
                    arrived: Instant::now(),
                    queue_seconds: None,
                };
                let r = SeqRequest {
                    prompt: req.prompt,
                    max_tokens: req.max_tokens as usize,
                    stop_token_ids: stop,
                    namespace: req.namespace,
                    policy: req.policy.unwrap_or(self.default_policy),
                    prompt_logits: req.prompt_logprobs.is_some(),
                    priority: req.priority,
                    tenant_weight: req.tenant_weight,
                    lora,
                    payload: state,
                };
                // The handle validated already; a rejection here still reaches the client.
                let events = r.payload.events.clone();
                if let Err(e) = self.sched.add(r) {
                    let _ = events.send(GenerateEvent::Failed(e.to_string()));
                }
                Flow::Continue
            }
            Command::Cancel(id) => {
                self.closed.clear();
                self.closed.extend(self.sched.iter().filter(|s| s.payload.request_id == id).map(|s| s.id()));
                for i in 0..self.closed.len() {
                    let sid = self.closed[i];
                    if let Some(seq) = self.sched.cancel(sid) {
                        let _ = seq.payload.events.send(finished(&seq, FinishReason::Cancelled));
                    }
                }
                Flow::Continue
            }
            Command::Subscribe(log) => {
                self.sched.pool_mut().track_index_changes();
                if let Some(t) = &mut self.tiers {
                    t.track_changes();
                }
                self.events = Some(log);
                Flow::Continue
            }
            Command::Snapshot(reply) => {
                let _ = reply.send(self.residency_snapshot());
                Flow::Continue
            }
            Command::ProbePrefix { hashes, reply } => {
                let _ = reply.send(self.probe_prefix(&hashes));
                Flow::Continue
            }
            Command::Export { hashes, max_bytes, from, reply } => {
                let _ = reply.send(self.export_groups(&hashes, max_bytes, from));
                Flow::Continue
            }
            Command::Import { groups, reply } => {
                let mut stored = 0;
                let info = self.runner.info();
                let shape = GroupShape {
                    n_blocks: info.layout().group_size(),
                    block_size: info.block_size,
                    head_dim: info.head_dim,
                };
                if let Some(t) = &mut self.tiers {
                    for (hash, group) in groups {
                        // A group that arrived here meanwhile (computed or pulled by another request) is kept as is.
                        if t.touch(hash) || t.import(hash, group, shape) {
                            stored += 1;
                        }
                    }
                }
                let _ = reply.send(stored);
                Flow::Continue
            }
            Command::SeedDevice { groups, reply } => {
                let _ = reply.send(self.seed_device(&groups));
                Flow::Continue
            }
            Command::Shutdown => Flow::Stop,
        }
    }

    /// [`EngineHandle::seed_device`]. Every block it touches keeps a reference until the end, so allocating a later
    /// group never evicts an earlier one of the same chain.
    fn seed_device(&mut self, groups: &[(u64, EncodedGroup)]) -> usize {
        let Some(kv) = self.runner.group_kv() else { return 0 };
        let native = kv.native_codec().name();
        let gs = self.sched.layout().group_size();
        let mut held: Vec<BlockId> = Vec::with_capacity(groups.len() * gs);
        let mut on_device = 0;
        for (hash, group) in groups {
            let pool = self.sched.pool_mut();
            if let Some(blocks) = pool.lookup(*hash) {
                let start = held.len();
                held.extend_from_slice(blocks);
                if pool.acquire(&held[start..]).is_err() {
                    held.truncate(start);
                    break;
                }
                on_device += 1;
                continue;
            }
            if group.codec != native || onboard_room(&self.sched) < gs {
                break;
            }
            self.blocks.clear();
            let pool = self.sched.pool_mut();
            if pool.allocate(gs, &mut self.blocks).is_err() {
                break;
            }
            held.extend_from_slice(&self.blocks);
            let decoded = match kv.decode_group(group, &self.blocks) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "a seeded KV group does not decode");
                    false
                }
            };
            if !(decoded && self.sched.pool_mut().register(*hash, &self.blocks)) {
                break;
            }
            on_device += 1;
        }
        // Registered blocks become idle cached groups (on the LRU queue, newest); the others go back free.
        if let Err(e) = self.sched.pool_mut().release(&held) {
            tracing::error!(error = %e, "releasing seeded blocks failed");
        }
        on_device
    }

    fn probe_prefix(&self, hashes: &[u64]) -> PrefixProbe {
        let pool = self.sched.pool();
        let tiers = self.tiers.as_ref();
        let local_blocks = hashes
            .iter()
            .take_while(|&&h| pool.lookup(h).is_some() || tiers.is_some_and(|t| t.locate(h).is_some()))
            .count();
        let cost = tiers.map(TierStore::cost).cloned().unwrap_or_default();
        PrefixProbe {
            local_blocks,
            can_import: tiers.is_some_and(|t| t.host().is_some()),
            prefill_tokens_per_s: cost.prefill_tokens_per_s(),
            host_load_bytes_per_s: cost.load_bandwidth(Tier::Host),
            host_capacity_bytes: tiers.and_then(TierStore::host).map_or(0, HostStore::capacity_bytes),
        }
    }

    fn export_groups(&mut self, hashes: &[u64], max_bytes: u64, from: ExportFrom) -> Vec<(u64, EncodedGroup)> {
        let mut out = Vec::new();
        let mut total = 0;
        for &h in hashes {
            let Some(group) = self.export_group(h, from) else { break };
            if !out.is_empty() && total + group.len() > max_bytes {
                break;
            }
            total += group.len();
            out.push((h, group));
        }
        out
    }

    /// A copy of the group under `hash` for a peer: the device pool's, encoded in the arena's own format, else the
    /// lower tiers' (already encoded). The device copy comes first because it is exact where a tier's may be
    /// lossy (a `kv.codec`, EvicPress), and it is there as soon as its block fills: a prompt a prefill worker has
    /// just computed is served whether or not it has been written back yet. A lossy copy onboarded from a tier is
    /// not served from the device as if it were exact.
    fn export_group(&mut self, hash: u64, from: ExportFrom) -> Option<EncodedGroup> {
        if from == ExportFrom::DeviceFirst
            && let Some(group) = self.sched.pool().index().get(hash).filter(|g| g.is_exact())
            && let Some(kv) = self.runner.group_kv()
            && let Ok(encoded) = kv.encode_group(group.blocks(), kv.native_codec())
        {
            return Some(encoded);
        }
        let tiers = self.tiers.as_mut()?;
        let (tier, _) = tiers.locate(hash)?;
        tiers.with_group(hash, tier, EncodedGroup::clone)
    }

    /// Cancels sequences whose client dropped the receiver.
    fn drop_closed(&mut self) {
        self.closed.clear();
        self.closed.extend(self.sched.iter().filter(|s| s.payload.events.is_closed()).map(|s| s.id()));
        for i in 0..self.closed.len() {
            self.sched.cancel(self.closed[i]);
        }
    }

    /// Runs one step. Returns false when nothing could be scheduled.
    fn step(&mut self) -> bool {
        // KV-Compress compresses instead of letting the scheduler preempt: a decode step may need one block per
        // table for every running sequence.
        let needed = self.sched.running_ids().len() * self.sched.layout().group_size();
        if self.sched.pool().num_available() < needed
            && let Some(io) = self.runner.eviction_io()
        {
            self.sched.relieve_pressure(needed, io.kv);
        }
        self.onboard();
        let mut plan = std::mem::take(&mut self.plan);
        self.sched.schedule_into(&mut plan);
        for e in &plan.seqs {
            if let Some(seq) = self.sched.get_mut(e.seq) {
                let p = &mut seq.payload;
                p.queue_seconds.get_or_insert_with(|| p.arrived.elapsed().as_secs_f64());
            }
        }
        // Publish what was just admitted before the step streams its first tokens, so a client that reads the
        // stats after a token sees its request counted.
        self.publish_stats();
        let progressed = !plan.is_empty() && self.run_plan(&plan);
        self.plan = plan;
        progressed
    }

    /// Copies the device groups that became idle since the last call into the lower tiers, while their blocks are
    /// still owned by the prefix index (so unchanged): a later device eviction then loses nothing. Groups already
    /// held below are only marked recently used.
    fn offload_idle(&mut self) {
        let Some(tiers) = &mut self.tiers else { return };
        self.hashes.clear();
        self.sched.pool_mut().take_newly_idle(&mut self.hashes);
        if self.evicpress.is_some() {
            // EvicPress places whole contexts when their requests finish (see `place_contexts`).
            return;
        }
        let Some(kv) = self.runner.group_kv() else { return };
        for &h in &self.hashes {
            let chosen = self.pins.codec_for(h, self.tier_codec);
            let codec = self.residual.codec_for(h, chosen, kv.native_codec());
            // A group stored before it ended a prompt (the middle of an earlier one, or seeded KV) takes the
            // residual's format once it does; otherwise the stored copy stands.
            let replace = tiers.touch(h);
            if replace && (codec == chosen || tiers.codec_of(h).is_none_or(|c| c == codec.name())) {
                continue;
            }
            let pool = self.sched.pool();
            let Some(g) = pool.index().get(h) else { continue };
            // Blocks decoded from a lossy copy hold that codec's values: under a native name they would onboard
            // as exact and go to peers as exact, and through a lossy codec again they would be quantised twice.
            // The lossy copy stands where there is one; without one the group stays on the device alone and is
            // recomputed once evicted.
            if !g.is_exact() {
                continue;
            }
            if replace {
                // One copy per group: the lossy one leaves first.
                tiers.remove(h);
            }
            match kv.encode_or_native(g.blocks(), codec) {
                Ok(group) => tiers.offload(h, group),
                // Only a device copy can fail the native format; the group then stays on the device alone.
                Err(e) => tracing::warn!(error = %e, "a KV group cannot be offloaded"),
            }
        }
    }

    /// EvicPress: places the contexts of the requests finished since the last call, profiling them first when the
    /// engine has nothing else to do.
    fn place_contexts(&mut self) {
        let (Some(ep), Some(tiers)) = (&mut self.evicpress, &mut self.tiers) else { return };
        let idle = !self.sched.has_work();
        ep.place_pending(&mut self.runner, self.sched.pool_mut(), tiers, idle);
    }

    /// Before scheduling: for the next sequence to be admitted, loads the lower-tier groups that continue its
    /// device-resident prefix into fresh device blocks and registers them, so admission adopts them like any
    /// cached prefix — when the cost model expects that to beat recomputing. Groups decoded from a lossy codec
    /// are marked inexact in the pool. First, EvicPress may give up lossy copies of contexts that recomputing now
    /// pays for ([`EvicPress::upgrade_before_admission`]). Disk reads happen here, between
    /// steps. Room is left for one decode block per table of every running sequence plus one group. Where the
    /// groups end and EvicPress holds a pruned copy of the context that follows, that copy is onboarded too
    /// ([`EngineLoop::onboard_pruned`]). Nothing is loaded for a step that cannot admit (the running sequences take
    /// its whole budget): groups loaded then would sit idle while that prefill's own blocks push them out again.
    fn onboard(&mut self) {
        if self.tiers.is_none() {
            return;
        }
        let Some(mut on_device) = self.sched.next_admission_prefix(&mut self.hashes) else { return };
        let budget = self.sched.admission_budget_left();
        if budget == 0 {
            return;
        }
        if let (Some(ep), Some(tiers)) = (&mut self.evicpress, &mut self.tiers)
            && ep.upgrade_before_admission(&self.hashes, self.sched.pool_mut(), tiers) > 0
        {
            on_device = self.sched.pool().index().match_len(&self.hashes);
        }
        if on_device == self.hashes.len() {
            return;
        }
        let loaded = self.onboard_groups(on_device);
        self.onboard_pruned(on_device + loaded, budget);
    }

    /// The group part of [`EngineLoop::onboard`]: returns the groups loaded after the first `on_device`.
    fn onboard_groups(&mut self, on_device: usize) -> usize {
        let Some(tiers) = &mut self.tiers else { return 0 };
        if tiers.locate(self.hashes[on_device]).is_none() {
            return 0;
        }
        let layout = self.sched.layout();
        let gs = layout.group_size();
        let Some(pinned) = pin_prefix(&mut self.sched, &self.hashes[..on_device]) else { return 0 };
        let room = onboard_room(&self.sched) / gs;
        let mut plan: Vec<(Tier, u64)> = Vec::new();
        for &h in self.hashes[on_device..].iter().take(room) {
            match tiers.locate(h) {
                Some(loc) => plan.push(loc),
                None => break,
            }
        }
        let k = tiers.cost().plan(&plan, on_device * layout.block_size, layout.block_size);
        let mut loaded = 0;
        if let Some(kv) = self.runner.group_kv() {
            let native = kv.native_codec().name();
            for (i, &(tier, bytes)) in plan[..k].iter().enumerate() {
                let h = self.hashes[on_device + i];
                self.blocks.clear();
                if self.sched.pool_mut().allocate(gs, &mut self.blocks).is_err() {
                    break;
                }
                let t0 = Instant::now();
                let decoded = tiers.with_group(h, tier, |g| (kv.decode_group(g, &self.blocks), g.codec == native));
                let secs = t0.elapsed().as_secs_f64();
                let pool = self.sched.pool_mut();
                let ok = match decoded {
                    Some((Ok(()), exact)) => pool.register(h, &self.blocks) && (exact || pool.mark_inexact(h)),
                    Some((Err(e), _)) => {
                        tracing::warn!(tier = tier.name(), error = %e, "KV group cannot be onboarded; recomputing");
                        // Left in place it would stay most recently used, be skipped by offloads (already held),
                        // count as local to peers and the kvstore, and fail every later onboard the same way.
                        // A device error is the arena's, not the group's: that group stays.
                        if !matches!(e, TierError::Device(_)) {
                            tiers.drop_undecodable(h);
                        }
                        false
                    }
                    None => false,
                };
                // Registered blocks become an idle cached group (on the LRU queue, newest); others go back free.
                if let Err(e) = pool.release(&self.blocks) {
                    tracing::error!(error = %e, "releasing onboarding blocks failed");
                }
                if !ok {
                    break;
                }
                tiers.cost_mut().record_load(tier, bytes, secs);
                tiers.count_onboard(tier);
                count_onboarded(&mut self.onboarded_tokens, &mut self.sched, tier, layout.block_size);
                loaded += 1;
            }
        }
        unpin(&mut self.sched, &pinned);
        loaded
    }

    /// EvicPress's pruned copies: when the context after the first `frontier` groups of the next admission's
    /// prefix is stored as a pruned copy, and loading it beats recomputing its tokens, decodes it into fresh
    /// device blocks and hands it to that sequence, which starts after the context over fewer slots
    /// ([`Scheduler::preload_front`]). A pruned cache is the sequence's alone (never in the prefix index).
    fn onboard_pruned(&mut self, frontier: usize, budget: usize) {
        let Some(copy) = self.evicpress.as_ref().and_then(|ep| ep.pruned_copy(&self.hashes[frontier..])) else {
            return;
        };
        let Some(tiers) = &mut self.tiers else { return };
        let layout = self.sched.layout();
        let (gs, bs) = (layout.group_size(), layout.block_size);
        let Some(located) = copy.keys.iter().map(|&key| tiers.locate(key)).collect::<Option<Vec<_>>>() else {
            return;
        };
        let cost = tiers.cost();
        let load: f64 = located.iter().map(|&(tier, bytes)| cost.load_secs(tier, bytes)).sum();
        if load >= cost.prefill_secs(frontier * bs, copy.groups * bs) {
            return;
        }
        let covered = (frontier + copy.groups) * bs;
        let Some(chunk_blocks) = self.sched.preload_chunk_blocks(covered, budget) else { return };
        let Some(pinned) = pin_prefix(&mut self.sched, &self.hashes[..frontier]) else { return };
        let needed = copy.keys.len() * gs;
        self.blocks.clear();
        if onboard_room(&self.sched) >= needed + chunk_blocks
            && self.sched.pool_mut().allocate(needed, &mut self.blocks).is_ok()
        {
            let t0 = Instant::now();
            let blocks = &self.blocks;
            let decoded = self.runner.group_kv().is_some_and(|kv| {
                copy.keys.iter().zip(&located).zip(blocks.chunks_exact(gs)).all(|((&key, &(tier, _)), dst)| match tiers
                    .with_group(key, tier, |g| kv.decode_group(g, dst))
                {
                    Some(Ok(())) => true,
                    Some(Err(e)) => {
                        tracing::warn!(tier = tier.name(), error = %e, "pruned copy cannot be onboarded");
                        false
                    }
                    None => false,
                })
            });
            let secs = t0.elapsed().as_secs_f64();
            if decoded && self.sched.preload_front(&self.hashes[..frontier], &self.blocks, copy.kept, covered) {
                let tier = located.iter().map(|&(t, _)| t).max().unwrap_or(Tier::Host);
                let bytes: u64 = located.iter().map(|&(_, b)| b).sum();
                tiers.cost_mut().record_load(tier, bytes, secs);
                for &(t, _) in &located {
                    tiers.count_onboard(t);
                }
                count_onboarded(&mut self.onboarded_tokens, &mut self.sched, tier, copy.groups * bs);
                if let Some(ep) = &mut self.evicpress {
                    ep.record_pruned_onboard();
                }
            } else if let Err(e) = self.sched.pool_mut().release(&self.blocks) {
                tracing::error!(error = %e, "releasing onboarding blocks failed");
            }
        }
        unpin(&mut self.sched, &pinned);
    }

    fn run_plan(&mut self, plan: &StepPlan) -> bool {
        let t0 = Instant::now();
        // When every row is sampled greedily, and no request asked for its rows' log-probabilities, the runner picks
        // the tokens (on a GPU, without copying logits back).
        let greedy = plan.seqs.iter().all(|e| {
            self.sched.get(e.seq).is_none_or(|s| {
                let p = &s.payload;
                logits_wanted(s, e) == LogitsWanted::None
                    || p.sampler.config().picks_argmax() && p.logprobs.is_none() && p.prompt_logprobs.is_none()
            })
        });
        let tokens_out = greedy.then_some(&mut self.greedy_tokens);
        let result =
            forward_step(&mut self.sched, &mut self.runner, plan, &mut self.batch, &mut self.logits, tokens_out);
        if result.is_ok() && self.sched.config().speculative.enabled() {
            self.sched.observe_step(plan, t0.elapsed().as_secs_f64());
        }
        let tokens = plan.num_tokens();
        // Steps dominated by prefill measure prefill speed; single-token decode steps would not.
        if result.is_ok() && tokens >= 2 * plan.seqs.len().max(1) * self.sched.layout().block_size {
            let secs = t0.elapsed().as_secs_f64();
            if let Some(t) = &mut self.tiers {
                // Positions, not live slots: a pruning policy attends fewer, and its steps then teach the fit a
                // cheaper attention term, which is what its prefills do cost.
                let pairs = plan.seqs.iter().map(|e| crate::tiers::cost::attended_pairs(e.start, e.n)).sum();
                t.cost_mut().record_prefill(tokens, pairs, secs);
            } else if secs > 0.0 {
                self.prefill_speed.update(tokens as f64 / secs);
            }
        }
        if let Err(e) = result {
            tracing::error!(error = %e, "forward step failed; failing the step's requests");
            let msg = e.to_string();
            for e in &plan.seqs {
                if let Some(seq) = self.sched.finish(e.seq) {
                    let _ = seq.payload.events.send(GenerateEvent::Failed(msg.clone()));
                }
            }
            return true;
        }
        let rows: usize =
            plan.seqs.iter().filter_map(|e| Some(logits_wanted(self.sched.get(e.seq)?, e).rows(e.n))).sum();
        let (got, want, what) = if greedy {
            (self.greedy_tokens.len(), rows, "tokens")
        } else {
            (self.logits.len(), rows * self.vocab, "logits")
        };
        if got < want {
            let msg = format!("model returned {got} {what} for {rows} rows");
            for e in &plan.seqs {
                if let Some(seq) = self.sched.finish(e.seq) {
                    let _ = seq.payload.events.send(GenerateEvent::Failed(msg.clone()));
                }
            }
            return true;
        }
        // The groups the step registered are stored in the codecs their requests named once they go idle.
        for e in &plan.seqs {
            if let Some(seq) = self.sched.get_mut(e.seq) {
                pin_tier_codec(&mut self.pins, seq);
            }
        }
        // Each entry's rows, in plan order: one per token of a chunk with wanted prompt positions, else one for an
        // entry that samples.
        let mut next_row = 0;
        for e in &plan.seqs {
            let Some(seq) = self.sched.get_mut(e.seq) else { continue };
            let wanted = logits_wanted(seq, e);
            let n_rows = wanted.rows(e.n);
            let first_row = next_row;
            next_row += n_rows;
            if wanted == LogitsWanted::All && !greedy && e.draft == 0 {
                let rows = &self.logits[first_row * self.vocab..(first_row + n_rows) * self.vocab];
                if report_prompt_logprobs(seq, e, rows, self.vocab).is_err() {
                    self.sched.cancel(e.seq);
                    continue;
                }
            }
            if !e.wants_logits {
                continue;
            }
            // A speculative entry's rows are sampled in order while the sampler picks the draft's next token (a
            // stop token ends the answer, so it is never taken as part of a draft); the first token it picks
            // otherwise, or the token after a wholly accepted draft, is the step's last.
            let mut row = first_row + n_rows - 1 - e.draft.min(n_rows - 1);
            let mut accepted = 0;
            let mut gone = false;
            let mut dead_end = None;
            let (token, logprobs) = loop {
                let picked = if greedy {
                    (self.greedy_tokens[row], None)
                } else {
                    let logits = &self.logits[row * self.vocab..(row + 1) * self.vocab];
                    let token = match seq.payload.sampler.sample(logits, &mut self.sample_buf) {
                        Ok(t) => t,
                        Err(err) => {
                            dead_end = Some(err);
                            break (0, None);
                        }
                    };
                    (token, seq.payload.logprobs.map(|n| token_logprobs(logits, token, n as usize)))
                };
                if accepted >= e.draft || seq.draft().get(accepted) != Some(&picked.0) || seq.stops_on(picked.0) {
                    break picked;
                }
                let (id, logprobs) = picked;
                if seq.payload.events.send(GenerateEvent::Token { id, logprobs }).is_err() {
                    gone = true;
                    break (id, None);
                }
                accepted += 1;
                row += 1;
            };
            if let Some(err) = dead_end {
                // Any token now would break the answer the guide promised, and a stop would pass off a cut answer
                // as whole: the request ends with the reason (the tokens sent so far stand).
                tracing::debug!(request_id = %seq.payload.request_id, error = %err, "guided request failed");
                if let Some(seq) = self.sched.finish(e.seq) {
                    let _ = seq.payload.events.send(GenerateEvent::Refused(err.to_string()));
                }
                continue;
            }
            if e.draft > 0 {
                if self.sched.settle_draft(e.seq, accepted).is_err() {
                    continue;
                }
                // Accepted draft tokens may have filled a group.
                if let Some(seq) = self.sched.get_mut(e.seq) {
                    pin_tier_codec(&mut self.pins, seq);
                }
            }
            if gone {
                self.sched.cancel(e.seq);
                continue;
            }
            let reason = match self.sched.append_token(e.seq, token) {
                Ok(r) => r,
                Err(_) => continue,
            };
            // What a guide forces is worth working out only where the next step may draft it.
            let (drafting, max_draft) = (self.sched.drafting(), self.sched.config().speculative.num_tokens);
            let Some(seq) = self.sched.get_mut(e.seq) else { continue };
            if reason != Some(FinishReason::Stop)
                && seq.payload.events.send(GenerateEvent::Token { id: token, logprobs }).is_err()
            {
                self.sched.cancel(e.seq);
                continue;
            }
            if reason.is_none() && drafting && seq.payload.sampler.config().guided() {
                seq.payload.sampler.forced_tokens(&mut self.forced_draft, max_draft);
                seq.set_forced_draft(&self.forced_draft);
            }
            if let Some(reason) = reason
                && let Some(seq) = self.sched.finish(e.seq)
            {
                let _ = seq.payload.events.send(finished(&seq, reason));
                let prompt_groups = seq.prompt_len() / self.sched.layout().block_size;
                self.residual.finished(&seq.hashes()[..prompt_groups.min(seq.hashes().len())]);
                if let Some(ep) = &mut self.evicpress {
                    let prompt = &seq.tokens()[..seq.prompt_len()];
                    let (cached, generated) = (seq.cached_tokens(), seq.generated().len());
                    let (queries, codec) = (&seq.payload.profile_queries, seq.payload.tier_codec);
                    ep.finished(prompt, seq.namespace(), cached, generated, queries, codec);
                }
            }
        }
        true
    }

    fn fail_all(&mut self, msg: &str) {
        let ids: Vec<SeqId> = self.sched.iter().map(|s| s.id()).collect();
        for id in ids {
            if let Some(seq) = self.sched.finish(id) {
                let _ = seq.payload.events.send(GenerateEvent::Failed(msg.to_owned()));
            }
        }
    }

    /// Writes the stats over the last published ones, reusing their vectors: this runs every step.
    fn publish_stats(&self) {
        let Ok(mut published) = self.stats.lock() else { return };
        let s = self.sched.stats();
        let pool = self.sched.pool();
        let info = self.runner.info();
        let block_bytes = (2 * info.block_size * info.kv_dtype.slot_bytes(info.head_dim)) as u64;
        let mut tier_usage = std::mem::take(&mut published.tier_usage);
        tier_usage.clear();
        tier_usage.push(TierUsage {
            tier: Tier::Device,
            codec: native::codec_name(info.kv_dtype).into(),
            used_bytes: (pool.num_used() + pool.num_cached_free()) as u64 * block_bytes,
            capacity_bytes: pool.num_blocks() as u64 * block_bytes,
        });
        let mut prefix_hit_tokens = self.onboarded_tokens;
        prefix_hit_tokens[Tier::Device.index()] =
            s.cached_tokens_total.saturating_sub(self.onboarded_tokens.iter().sum::<u64>());
        let (mut offloaded_groups, mut disk_corrupted, mut disk_errors, mut disk_full) = (0, 0, 0, 0);
        let (mut refused_imports, mut undecodable_groups) = (0, 0);
        let mut load_bytes_per_s = [0.0; 3];
        if let Some(t) = &self.tiers {
            t.usage_into(&mut tier_usage);
            for (tier, present) in [(Tier::Host, t.host().is_some()), (Tier::Disk, t.disk().is_some())] {
                if present {
                    load_bytes_per_s[tier.index()] = t.cost().load_bandwidth(tier);
                }
            }
            offloaded_groups = t.counters().offloaded_groups;
            disk_errors = t.counters().disk_errors;
            refused_imports = t.counters().refused_imports;
            undecodable_groups = t.counters().undecodable_groups;
            disk_corrupted = t.disk_corrupted();
            disk_full = t.disk_full_events();
        }
        let evicpress = self.evicpress.as_ref().map(|ep| {
            let mut kept = published.evicpress.take().unwrap_or_default();
            ep.stats_into(&mut kept);
            kept
        });
        *published = EngineStats {
            blocks_total: pool.num_blocks() as u64,
            blocks_used: pool.num_used() as u64,
            blocks_cached_free: pool.num_cached_free() as u64,
            running: s.running as u64,
            waiting: s.waiting as u64,
            computed_tokens_total: s.computed_tokens_total,
            cached_tokens_total: s.cached_tokens_total,
            preemptions_total: s.preemptions_total,
            peak_running: s.peak_running as u64,
            steps_total: s.steps_total,
            step_seqs_total: s.step_seqs_total,
            peak_blocks_used: pool.peak_used() as u64,
            evicted_slots: s.evicted_slots,
            evicted_blocks: s.evicted_blocks,
            tier_usage,
            prefix_hit_tokens,
            offloaded_groups,
            disk_corrupted,
            disk_errors,
            disk_full,
            refused_imports,
            undecodable_groups,
            evicpress,
            drafts_total: s.drafts_total,
            draft_tokens_total: s.draft_tokens_total,
            accepted_draft_tokens_total: s.accepted_draft_tokens_total,
            prefill_tokens_per_s: match &self.tiers {
                Some(t) => t.cost().measured_prefill_tokens_per_s(),
                None if self.prefill_speed.samples() > 0 => Some(self.prefill_speed.value()),
                None => None,
            }
            .unwrap_or(0.0),
            kv_group_bytes: block_bytes * self.sched.layout().group_size() as u64,
            load_bytes_per_s,
        };
    }
}
/// Sends the log-probabilities of the prompt positions a step's `rows` (one per token of entry `e`) give that
/// `seq` has not reported yet. Fails when the receiver is gone.
fn report_prompt_logprobs(
    seq: &mut Sequence<ReqState>,
    e: &ScheduledSeq,
    rows: &[f32],
    vocab: usize,
) -> Result<(), ()> {
    let Some(top_n) = seq.payload.prompt_logprobs else { return Ok(()) };
    // Row j predicts position e.start + j + 1.
    let from = seq.payload.prompt_logprobs_next.max(e.start + 1);
    let to = (e.start + e.n + 1).min(seq.prompt_len());
    if from >= to {
        return Ok(());
    }
    let entries = (from..to)
        .map(|q| {
            let row = &rows[(q - e.start - 1) * vocab..(q - e.start) * vocab];
            token_logprobs(row, seq.tokens()[q], top_n as usize)
        })
        .collect();
    seq.payload.prompt_logprobs_next = to;
    seq.payload.events.send(GenerateEvent::PromptLogprobs(entries)).map_err(|_| ())
}

/// Pins the device-resident groups of `hashes` (a prefix's first groups) while onboarding allocates: they may be
/// older in the LRU than anything else, and evicting them would make the onboarded continuation unreachable.
/// `None` (nothing pinned) when one is not on the device.
fn pin_prefix<P>(sched: &mut Scheduler<P>, hashes: &[u64]) -> Option<Vec<BlockId>> {
    let mut pinned = Vec::with_capacity(hashes.len() * sched.layout().group_size());
    for &h in hashes {
        pinned.extend_from_slice(sched.pool().lookup(h)?);
    }
    sched.pool_mut().acquire(&pinned).ok()?;
    Some(pinned)
}

fn unpin<P>(sched: &mut Scheduler<P>, pinned: &[BlockId]) {
    if let Err(e) = sched.pool_mut().release(pinned) {
        tracing::error!(error = %e, "unpinning the device prefix failed");
    }
}

/// Blocks onboarding may take: what the pool has beyond one decode block per table of every running sequence
/// plus one group.
fn onboard_room<P>(sched: &Scheduler<P>) -> usize {
    let gs = sched.layout().group_size();
    sched.pool().num_available().saturating_sub((sched.running_ids().len() + 1) * gs)
}

/// Empties a batch vector and hands its allocation to a new lifetime: the in-place `collect` specialisation keeps
/// the buffer because the element layout does not change, so per-step batches do not allocate.
#[allow(clippy::unnecessary_filter_map)] // `filter` cannot change the element lifetime; `filter_map` can.
fn recycle_steps<'b>(mut v: Vec<StepSeq<'_>>) -> Vec<StepSeq<'b>> {
    v.clear();
    v.into_iter().filter_map(|_| None).collect()
}

#[allow(clippy::unnecessary_filter_map)]
pub(crate) fn recycle_forward<'b>(mut v: Vec<ForwardSeq<'_>>) -> Vec<ForwardSeq<'b>> {
    v.clear();
    v.into_iter().filter_map(|_| None).collect()
}

fn finished(seq: &crate::scheduler::Sequence<ReqState>, reason: FinishReason) -> GenerateEvent {
    let mut completion = seq.num_generated();
    let mut stop_token = None;
    if reason == FinishReason::Stop && completion > 0 {
        // The stop token ended the stream and was not sent.
        completion -= 1;
        stop_token = seq.tokens().last().copied();
    }
    GenerateEvent::Finished {
        reason,
        prompt_tokens: seq.prompt_len() as u32,
        completion_tokens: completion as u32,
        cached_tokens: seq.cached_tokens() as u32,
        onboarded_tokens: seq.onboarded_tokens(),
        evicted_slots: seq.evicted().slots,
        evicted_blocks: seq.evicted().blocks,
        queue_seconds: seq.payload.queue_seconds.unwrap_or(0.0),
        stop_token,
    }
}

/// Counts `tokens` onboarded from `tier` in the engine's totals and for the request at the head of the queue, whose
/// prefix they continue (its `Finished` event reports them), so that the two counts never part.
fn count_onboarded<P>(totals: &mut [u64; 3], sched: &mut Scheduler<P>, tier: Tier, tokens: usize) {
    totals[tier.index()] += tokens as u64;
    sched.credit_front_onboarded(tier.index(), tokens);
}

/// The real model: a GGUF llama on the CPU backend, with the device-tier KV arena.
pub struct LlamaRunner {
    model: LlamaModel,
    backend: CpuBackend,
    kv: KvStorage,
    scratch: Scratch,
    info: ModelInfo,
    batch: Vec<ForwardSeq<'static>>,
}

/// The hyper-parameters of the model `cfg` names (its synthetic shape, or the GGUF's metadata), without loading
/// weights: callers size a KV pool from them before paying for the load.
pub fn model_config(cfg: &EngineConfig) -> Result<ModelConfig, EngineError> {
    match &cfg.synthetic {
        Some(spec) => Ok(spec.config()),
        None => Gguf::open(&cfg.model_path)
            .and_then(|g| ModelConfig::from_gguf(&g))
            .map_err(|e| EngineError::Model(e.to_string())),
    }
}

/// The error of a `--device cuda` request to a binary built without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub fn no_cuda_build() -> EngineError {
    EngineError::Config("this binary was built without the CUDA backend: rebuild with `--features cuda`".into())
}

/// Loads `cfg.model_path` (or builds `cfg.synthetic`) and describes it with the KV pool `cfg` asks for
/// (`cfg.num_blocks` blocks, or `cfg.kv_cache_tokens` worth, or two full contexts when both are 0). Every runner
/// starts here, so CPU and GPU workers report the same model the same way.
pub fn load_model(cfg: &EngineConfig) -> Result<(LlamaModel, ModelInfo), EngineError> {
    load_model_and_tokenizer(cfg).map(|(model, info, _)| (model, info))
}

/// [`load_model`], with the GGUF's tokenizer (`None` for a synthetic model), for a runner that needs it again.
fn load_model_and_tokenizer(cfg: &EngineConfig) -> Result<(LlamaModel, ModelInfo, Option<Tokenizer>), EngineError> {
    let model_err = |e: ModelError| EngineError::Model(e.to_string());
    let (model, model_id, name, eos_token_ids, bos_token_id, token_bytes, tokenizer) = match &cfg.synthetic {
        Some(spec) => {
            tracing::warn!(model = %spec, "serving a SYNTHETIC-weights model: its outputs are meaningless");
            let model = LlamaModel::synthetic(spec).map_err(model_err)?;
            (model, spec.model_name(), spec.model_name(), Vec::new(), None, None, None)
        }
        None => {
            let gguf = Gguf::open(&cfg.model_path).map_err(model_err)?;
            let tokenizer = Tokenizer::from_gguf(&gguf).map_err(model_err)?;
            let model = LlamaModel::load(&gguf).map_err(model_err)?;
            let file_stem = cfg.model_path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            let name =
                gguf.get_str_opt("general.name").ok().flatten().map(str::to_owned).unwrap_or_else(|| file_stem.clone());
            let table =
                TokenTable::new((0..tokenizer.vocab_size() as u32).map(|t| {
                    if tokenizer.is_special(t) { &[][..] } else { tokenizer.token_bytes(t).unwrap_or_default() }
                }));
            let (eos, bos) = (tokenizer.eos_token_ids().to_vec(), tokenizer.bos_id());
            (model, file_stem, name, eos, bos, Some(Arc::new(table)), Some(tokenizer))
        }
    };
    let mc = model.config().clone();
    let layout = CacheLayout { n_layers: mc.n_layers, n_kv_heads: mc.n_kv_heads, block_size: cfg.block_size };
    let num_blocks = match (cfg.kv_cache_tokens, cfg.num_blocks) {
        (0, 0) => auto_num_blocks(layout, mc.ctx_len),
        (0, blocks) => blocks,
        (tokens, _) => layout.blocks_for_tokens(tokens),
    };
    if num_blocks < layout.group_size() {
        return Err(EngineError::Config(format!(
            "num_blocks {num_blocks} cannot hold one token group ({} blocks)",
            layout.group_size()
        )));
    }
    let info = ModelInfo {
        model_id,
        name,
        context_length: mc.ctx_len,
        vocab_size: mc.vocab,
        eos_token_ids,
        bos_token_id,
        n_layers: mc.n_layers,
        n_heads: mc.n_heads,
        n_kv_heads: mc.n_kv_heads,
        head_dim: mc.head_dim,
        block_size: cfg.block_size,
        num_blocks,
        kv_dtype: cfg.kv_dtype,
        token_bytes,
    };
    Ok((model, info, tokenizer))
}

/// Refuses a host KV arena of `num_blocks` blocks that could not be allocated: one whose size overflows, or that
/// is larger than the machine's memory (`memory_bytes`, when known). Without this, a model file declaring a huge
/// context (the pool defaults to two contexts) or a mistyped `--num-blocks` aborts the process in the allocator,
/// or succeeds under overcommit and is killed later, mid-request.
fn check_host_arena(
    num_blocks: usize,
    block_size: usize,
    head_dim: usize,
    dtype: KvDtype,
    memory_bytes: Option<u64>,
) -> Result<(), EngineError> {
    let bytes = num_blocks
        .checked_mul(block_size)
        .and_then(|slots| slots.checked_mul(2 * dtype.slot_bytes(head_dim)))
        .map(|b| b as u64);
    let too_big = |what: String| {
        EngineError::Config(format!(
            "a KV pool of {num_blocks} blocks of {block_size} tokens {what}; \
             size it with --kv-cache-tokens or --num-blocks"
        ))
    };
    match (bytes, memory_bytes) {
        (None, _) => Err(too_big("overflows this machine's address space".into())),
        (Some(b), Some(total)) if b > total => Err(too_big(format!(
            "needs {:.1} GiB, more than this machine's {:.1} GiB of memory",
            b as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64
        ))),
        _ => Ok(()),
    }
}

/// The machine's physical memory (`MemTotal` of `/proc/meminfo`), where that can be read.
fn host_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 =
        info.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// The key rounding of every table ([`crate::model::calibration`]): the calibration text through the model.
pub fn calibrate_fp8_keys(
    tokenizer: &Tokenizer,
    model: &LlamaModel,
    backend: &dyn Backend,
) -> Result<Vec<KeyRounding>, EngineError> {
    let model_err = |e: ModelError| EngineError::Model(format!("calibrating fp8 key rounding: {e}"));
    let started = Instant::now();
    let tokens = calibration::calibration_tokens(tokenizer);
    let rounding = calibration::key_rounding(model, backend, &tokens).map_err(model_err)?;
    tracing::info!(tokens = tokens.len(), ms = started.elapsed().as_millis() as u64, "fp8 key rounding calibrated");
    Ok(rounding)
}

/// The CPU backend on `threads` threads (0: every core), its matmuls in bf16 when asked; an error where the CPU
/// cannot run them, rather than a flag that silently does nothing.
pub fn cpu_backend(threads: usize, bf16_matmuls: bool) -> Result<CpuBackend, EngineError> {
    let backend = CpuBackend::new(resolve_threads(threads)).with_bf16_matmuls(bf16_matmuls);
    if bf16_matmuls && !backend.bf16_matmuls() {
        return Err(EngineError::Config(
            "--bf16-matmuls needs AMX bf16 tiles or AVX-512 BF16, and this CPU has neither".into(),
        ));
    }
    Ok(backend)
}

impl LlamaRunner {
    /// Loads the model ([`load_model`]) and allocates its KV arena in host memory.
    pub fn load(cfg: &EngineConfig) -> Result<LlamaRunner, EngineError> {
        if cfg.device != Device::Cpu {
            return Err(EngineError::Config(format!("the CPU runner cannot serve --device {}", cfg.device)));
        }
        let backend = cpu_backend(cfg.threads, cfg.bf16_matmuls)?;
        let (model, info, tokenizer) = load_model_and_tokenizer(cfg)?;
        check_host_arena(info.num_blocks, cfg.block_size, info.head_dim, cfg.kv_dtype, host_memory_bytes())?;
        let mut kv = KvStorage::with_dtype(info.num_blocks, cfg.block_size, info.head_dim, cfg.kv_dtype);
        // A synthetic model has no tokenizer, and no queries worth calibrating on.
        if let Some(tokenizer) = tokenizer.filter(|_| cfg.fp8_keys_for_queries) {
            kv.set_key_rounding(calibrate_fp8_keys(&tokenizer, &model, &backend)?.into());
        }
        Ok(LlamaRunner { kv, scratch: Scratch::new(), backend, model, info, batch: Vec::new() })
    }

    /// The same runner over f32 copies of its weights ([`LlamaModel::to_f32_weights`]): no activation
    /// quantisation, so it is the CPU reference the GPU runner (f16 weights and activations) is compared with.
    pub fn into_f32_weights(self) -> Result<LlamaRunner, EngineError> {
        let model = self.model.to_f32_weights().map_err(|e| EngineError::Model(e.to_string()))?;
        Ok(LlamaRunner { model, ..self })
    }
}

impl ModelRunner for LlamaRunner {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn forward(&mut self, seqs: &[StepSeq<'_>], logits: &mut Vec<f32>) -> Result<(), EngineError> {
        let mut batch = recycle_forward(std::mem::take(&mut self.batch));
        batch.extend(seqs.iter().map(StepSeq::forward_seq));
        let r = self.model.forward(&self.backend, &mut self.kv, &batch, &mut self.scratch, logits);
        self.batch = recycle_forward(batch);
        r.map_err(|e| EngineError::Forward(e.to_string()))
    }

    fn token_embeddings(&mut self, ids: &[u32], out: &mut Vec<f32>) -> bool {
        out.clear();
        out.resize(ids.len() * self.model.config().hidden, 0.0);
        self.model.token_embeddings(&self.backend, ids, out);
        true
    }

    fn policy_io(&mut self) -> Option<PolicyIo<'_>> {
        Some(PolicyIo { kv: &mut self.kv, captured: &self.scratch })
    }

    fn group_kv(&mut self) -> Option<&mut dyn GroupKv> {
        Some(&mut self.kv)
    }

    fn lora_shape(&self) -> Option<ModelConfig> {
        Some(self.model.config().clone())
    }
}

/// A stand-in model for the unit tests here and in `service`: next token = (position + last token) % vocab, as
/// one-hot logits, after `delay`.
#[cfg(test)]
pub(crate) struct FakeRunner {
    pub(crate) info: ModelInfo,
    pub(crate) delay: Duration,
}

#[cfg(test)]
impl FakeRunner {
    /// A fake of 2 layers × 2 heads of 4 dimensions, blocks of 4 slots, a context of 64 tokens and `vocab` tokens
    /// (the last one the end of sequence), with `num_blocks` blocks.
    pub(crate) fn new(vocab: usize, num_blocks: usize, delay: Duration) -> FakeRunner {
        let info = ModelInfo {
            model_id: "fake".into(),
            name: "fake".into(),
            context_length: 64,
            vocab_size: vocab,
            eos_token_ids: vec![vocab as u32 - 1],
            bos_token_id: None,
            n_layers: 2,
            n_heads: 2,
            n_kv_heads: 2,
            head_dim: 4,
            block_size: 4,
            num_blocks,
            kv_dtype: pagoda_kernels::KvDtype::F32,
            token_bytes: None,
        };
        FakeRunner { info, delay }
    }
}

#[cfg(test)]
impl ModelRunner for FakeRunner {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn forward(&mut self, seqs: &[StepSeq<'_>], logits: &mut Vec<f32>) -> Result<(), EngineError> {
        std::thread::sleep(self.delay);
        let v = self.info.vocab_size;
        for s in seqs {
            let first = match s.logits {
                LogitsWanted::None => continue,
                LogitsWanted::Last => {
                    s.tokens.len().checked_sub(1).ok_or_else(|| EngineError::Forward("empty step".into()))?
                }
                LogitsWanted::All => 0,
            };
            for (i, &tok) in s.tokens.iter().enumerate().skip(first) {
                let pos = s.start_pos as usize + i + 1;
                let start = logits.len();
                logits.resize(start + v, 0.0);
                logits[start + (pos + tok as usize) % v] = 1.0;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(num_blocks: usize, delay_ms: u64) -> EngineHandle {
        let cfg = EngineConfig { block_size: 4, ..EngineConfig::default() };
        Engine::start_with(cfg, move |_| Ok(FakeRunner::new(32, num_blocks, Duration::from_millis(delay_ms)))).unwrap()
    }

    fn req(id: &str, prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
        GenerateRequest {
            request_id: id.into(),
            prompt,
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
            namespace: String::new(),
            policy: None,
            ignore_eos: false,
            profile_queries: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            priority: 0,
            tenant_weight: 1,
            tier_codec: None,
            lora: None,
        }
    }

    /// A runner without host KV (the fake here, the CUDA runner) cannot evict: a request naming a policy is refused
    /// by name instead of being served with a full cache, and so is such a default policy at start-up.
    #[test]
    fn policies_are_refused_where_the_runner_cannot_evict() {
        let h = fake(64, 0);
        let streaming = PolicySpec { kind: PolicyKind::Streaming, budget_tokens: 32 };
        let err = h.submit(GenerateRequest { policy: Some(streaming), ..req("p", vec![1, 2, 3], 2) }).unwrap_err();
        assert!(matches!(&err, EngineError::InvalidRequest(m) if m.contains("streaming")), "{err}");
        let (tokens, _) =
            collect(h.submit(GenerateRequest { policy: Some(PolicySpec::full()), ..req("f", vec![1], 2) }).unwrap());
        assert_eq!(tokens.len(), 2, "the full cache is served");
        h.shutdown();
        let info = h.model_info().clone();
        let cfg = EngineConfig { block_size: 4, default_policy: streaming, ..EngineConfig::default() };
        let err = Engine::start_with(cfg, move |_| Ok(FakeRunner { info, delay: Duration::ZERO })).unwrap_err();
        assert!(matches!(&err, EngineError::Config(m) if m.contains("--kv-policy streaming")), "{err}");
    }

    /// A runner whose device fails inside a policy call (which cannot return an error): the call keeps it, and
    /// the engine fails the step's requests with it instead of going on with a half-compacted cache.
    #[test]
    fn a_device_error_inside_an_eviction_fails_the_step() {
        #[derive(Default)]
        struct BrokenKv {
            failed: std::cell::Cell<bool>,
        }
        impl PolicyKv for BrokenKv {
            fn key_norms(&self, _: &[u32], _: std::ops::Range<usize>, _: &mut [f32]) {
                self.failed.set(true);
            }
            fn value_key_ratio(&self, _: &[u32], _: usize, _: &mut [f32]) {
                self.failed.set(true);
            }
            fn keydiff_cosine(&self, _: &[u32], _: usize, _: &mut Vec<f32>, _: &mut [f32]) {
                self.failed.set(true);
            }
            fn add_unit_keys(&self, _: &[u32], _: std::ops::Range<usize>, _: &[f32], _: f64, _: &mut [f64]) {
                self.failed.set(true);
            }
            fn keydiff_cosine_kept(&self, _: &[u32], _: usize, _: &[f64], _: &[f32], _: &mut Vec<f32>, _: &mut [f32]) {
                self.failed.set(true);
            }
            fn window_attention_scores(
                &self,
                _: &[u32],
                _: usize,
                _: pagoda_kernels::scores::Window<'_>,
                _: &mut Vec<f32>,
                _: &mut [f32],
            ) {
                self.failed.set(true);
            }
            fn copy_block(&mut self, _: u32, _: u32) {
                self.failed.set(true);
            }
            fn move_slot(&mut self, _: u32, _: usize, _: u32, _: usize) {
                self.failed.set(true);
            }
            fn compact_table(&mut self, _: &[u32], _: usize, keep: &[u32]) -> usize {
                self.failed.set(true);
                keep.len()
            }
        }
        struct NoCaptures;
        impl StepCaptures for NoCaptures {
            fn captured_q(&self, _: usize) -> &[f32] {
                &[]
            }
            fn attn_probs(&self, _: usize) -> Option<(&[f32], usize)> {
                None
            }
        }
        struct BrokenRunner {
            fake: FakeRunner,
            kv: BrokenKv,
        }
        impl ModelRunner for BrokenRunner {
            fn info(&self) -> &ModelInfo {
                self.fake.info()
            }
            fn forward(&mut self, seqs: &[StepSeq<'_>], logits: &mut Vec<f32>) -> Result<(), EngineError> {
                self.fake.forward(seqs, logits)
            }
            fn eviction_io(&mut self) -> Option<EvictionIo<'_>> {
                Some(EvictionIo { kv: &mut self.kv, captured: &NoCaptures })
            }
            fn take_error(&mut self) -> Option<EngineError> {
                self.kv.failed.replace(false).then(|| EngineError::Forward("device KV operation: lost".into()))
            }
        }
        let info = fake(64, 0).model_info().clone();
        let cfg = EngineConfig { block_size: 4, ..EngineConfig::default() };
        let h = Engine::start_with(cfg, move |_| {
            Ok(BrokenRunner { fake: FakeRunner { info, delay: Duration::ZERO }, kv: BrokenKv::default() })
        })
        .unwrap();
        let streaming = PolicySpec { kind: PolicyKind::Streaming, budget_tokens: 16 };
        let prompt: Vec<u32> = (0..30).collect();
        let rx = h.submit(GenerateRequest { policy: Some(streaming), ..req("s", prompt, 4) }).unwrap();
        let (tokens, end) = collect(rx);
        assert!(tokens.is_empty(), "{tokens:?}");
        assert!(matches!(&end, GenerateEvent::Failed(m) if m.contains("device KV operation")), "{end:?}");
        let (tokens, _) = collect(h.submit(req("after", vec![1, 2], 3)).unwrap());
        assert_eq!(tokens.len(), 3, "the engine goes on serving");
        h.shutdown();
    }

    /// An engine thread that dies (a runner that panics mid-step) reads as not running, as a shut-down one does; a
    /// serving one reads as running.
    #[test]
    fn an_engine_thread_that_died_is_not_running() {
        struct PanickingRunner(FakeRunner);
        impl ModelRunner for PanickingRunner {
            fn info(&self) -> &ModelInfo {
                self.0.info()
            }
            fn forward(&mut self, _: &[StepSeq<'_>], _: &mut Vec<f32>) -> Result<(), EngineError> {
                panic!("a runner bug");
            }
        }
        let info = fake(64, 0).model_info().clone();
        let h = Engine::start_with(EngineConfig { block_size: 4, ..EngineConfig::default() }, move |_| {
            Ok(PanickingRunner(FakeRunner { info, delay: Duration::ZERO }))
        })
        .unwrap();
        assert!(h.is_running());
        let _ = collect(h.submit(req("boom", vec![1, 2], 3)).unwrap());
        let t0 = Instant::now();
        while h.is_running() && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!h.is_running(), "the engine thread died");
        let serving = fake(64, 0);
        assert!(serving.is_running());
        serving.shutdown();
        assert!(!serving.is_running());
    }

    fn collect(mut rx: UnboundedReceiver<GenerateEvent>) -> (Vec<u32>, GenerateEvent) {
        let mut toks = Vec::new();
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                GenerateEvent::Token { id: t, .. } => toks.push(t),
                other => return (toks, other),
            }
        }
        (toks, GenerateEvent::Failed("channel closed".into()))
    }

    fn wait_for(h: &EngineHandle, f: impl Fn(&EngineStats) -> bool) -> EngineStats {
        for _ in 0..500 {
            let s = h.stats();
            if f(&s) {
                return s;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        h.stats()
    }

    /// Block changes reported so far, waiting up to a second for `done` to hold.
    fn drain_until(
        rx: &mut tokio::sync::mpsc::Receiver<SeqBatch>,
        seen: &mut Vec<SeqBatch>,
        done: impl Fn(&[SeqBatch]) -> bool,
    ) {
        for _ in 0..200 {
            while let Ok(b) = rx.try_recv() {
                seen.push(b);
            }
            if done(seen) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn device_hashes(batches: &[SeqBatch], stored: bool) -> Vec<u64> {
        batches
            .iter()
            .flat_map(|b| &b.changes)
            .filter_map(|c| match c {
                BlockChange::Stored { hash, tier: Tier::Device, .. } if stored => Some(*hash),
                BlockChange::Removed { hash, tier: Tier::Device, .. } if !stored => Some(*hash),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn devices_parse_and_print_back() {
        for (text, want) in
            [("cpu", Device::Cpu), ("CUDA", Device::Cuda(0)), ("gpu", Device::Cuda(0)), ("cuda:3", Device::Cuda(3))]
        {
            let d: Device = text.parse().unwrap();
            assert_eq!(d, want, "{text}");
            assert_eq!(d.to_string().parse::<Device>().unwrap(), d);
        }
        for bad in ["tpu", "cuda:", "cuda:-1", "cuda:64", ""] {
            assert!(bad.parse::<Device>().is_err_and(|e| e.contains("expected cpu, cuda")), "{bad}");
        }
    }

    #[test]
    fn a_cpu_runner_refuses_a_gpu_config_and_a_cpu_only_build_says_why() {
        let cfg = EngineConfig { device: Device::Cuda(0), ..EngineConfig::default() };
        assert!(LlamaRunner::load(&cfg).is_err_and(|e| e.to_string().contains("cannot serve --device cuda")));
        #[cfg(not(feature = "cuda"))]
        assert!(Engine::start(cfg).is_err_and(|e| e.to_string().contains("--features cuda")));
    }

    #[test]
    fn prefix_registrations_and_evictions_are_reported_with_the_routers_chain_hash() {
        // 16 blocks of 4 slots, 4 blocks per group: room for 4 token blocks.
        let h = fake(16, 0);
        let mut rx = h.report_events(64).unwrap();
        let prompt: Vec<u32> = (1..10).collect();
        let expected = crate::cache::block_hashes("fake", "", &prompt, 4);
        assert_eq!(expected.len(), 2);
        collect(h.submit(req("a", prompt, 1)).unwrap());
        let mut seen = Vec::new();
        drain_until(&mut rx, &mut seen, |b| expected.iter().all(|e| device_hashes(b, true).contains(e)));
        let stored = device_hashes(&seen, true);
        assert!(expected.iter().all(|e| stored.contains(e)), "{seen:?}");
        // Sequence numbers run from 1 without holes across batches.
        let mut next = 1;
        for b in &seen {
            assert_eq!(b.first_seq, next, "{seen:?}");
            next = b.end_seq();
        }
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let snap = rt.block_on(h.residency_snapshot()).unwrap();
        assert_eq!(snap.seq, next - 1, "the snapshot covers every change handed out");
        let group_bytes = 2 * 4 * 4 * 4 * 4; // K+V × block size × head dim × f32 × group size
        for e in &expected {
            let held = BlockChange::Stored { hash: *e, tier: Tier::Device, codec: "f32".into(), bytes: group_bytes };
            assert!(snap.blocks.contains(&held), "{snap:?}");
        }
        // A prompt that needs the whole pool evicts the idle cached prefix: each eviction is reported.
        collect(h.submit(req("b", (11..25).collect(), 1)).unwrap());
        drain_until(&mut rx, &mut seen, |b| expected.iter().all(|e| device_hashes(b, false).contains(e)));
        let removed = device_hashes(&seen, false);
        assert!(expected.iter().all(|e| removed.contains(e)), "{seen:?}");
        let snap = rt.block_on(h.residency_snapshot()).unwrap();
        assert!(snap.blocks.iter().all(|c| !matches!(c, BlockChange::Stored { hash, .. } if expected.contains(hash))));
        h.shutdown();
    }

    #[test]
    fn streams_tokens_and_finishes_with_usage() {
        let h = fake(64, 0);
        let (toks, fin) = collect(h.submit(req("a", vec![1, 2, 3], 5)).unwrap());
        // pos 3 + last 3 = 6, then pos 4 + 6 = 10, 5 + 10 = 15, 6 + 15 = 21, 7 + 21 = 28.
        assert_eq!(toks, vec![6, 10, 15, 21, 28]);
        let GenerateEvent::Finished { queue_seconds, .. } = fin else { panic!("{fin:?}") };
        assert!(queue_seconds > 0.0 && queue_seconds < 60.0, "{queue_seconds}");
        assert_eq!(
            fin,
            GenerateEvent::Finished {
                reason: FinishReason::Length,
                prompt_tokens: 3,
                completion_tokens: 5,
                cached_tokens: 0,
                onboarded_tokens: [0; 3],
                evicted_slots: 0,
                evicted_blocks: 0,
                queue_seconds,
                stop_token: None,
            }
        );
        // eos (31) stops: prompt [0, 28] → 2 + 28 = 30, 3 + 30 = 33 % 32 = 1, ...
        let (toks, fin) = collect(h.submit(req("b", vec![0, 29], 10)).unwrap());
        // 2 + 29 = 31 = eos straight away: no token streamed.
        assert!(toks.is_empty());
        assert!(matches!(
            fin,
            GenerateEvent::Finished { reason: FinishReason::Stop, completion_tokens: 0, stop_token: Some(31), .. }
        ));
        let s = wait_for(&h, |s| s.running == 0);
        assert_eq!(s.blocks_used, 0);
        h.shutdown();
        assert_eq!(h.submit(req("c", vec![1], 1)).unwrap_err(), EngineError::Stopped);
    }

    #[test]
    fn ignore_eos_generates_max_tokens_and_streams_eos() {
        let h = fake(64, 0);
        // 2 + 29 = 31 = eos on the first token: without the flag the stream ends at once (see above).
        let mut r = req("e", vec![0, 29], 4);
        r.ignore_eos = true;
        let (toks, fin) = collect(h.submit(r).unwrap());
        // Then 3 + 31 = 34 % 32 = 2, 4 + 2 = 6, 5 + 6 = 11.
        assert_eq!(toks, vec![31, 2, 6, 11]);
        assert!(matches!(fin, GenerateEvent::Finished { reason: FinishReason::Length, completion_tokens: 4, .. }));
        // An explicit stop id still stops.
        let mut r = req("s", vec![0, 29], 4);
        r.ignore_eos = true;
        r.stop_token_ids = vec![6];
        let (toks, fin) = collect(h.submit(r).unwrap());
        assert_eq!(toks, vec![31, 2]);
        assert!(matches!(
            fin,
            GenerateEvent::Finished { reason: FinishReason::Stop, completion_tokens: 2, stop_token: Some(6), .. }
        ));
        let s = wait_for(&h, |s| s.running == 0);
        assert_eq!(s.peak_running, 1);
        // One sequence at a time: every step computed exactly one.
        assert!(s.steps_total > 0 && s.step_seqs_total == s.steps_total, "{s:?}");
        assert!(s.peak_blocks_used > 0 && s.peak_blocks_used <= s.blocks_total);
        assert_eq!(s.blocks_used, 0);
    }

    #[test]
    fn rejects_requests_that_cannot_run() {
        let h = fake(16, 0);
        // 16 blocks = 4 groups = 16 tokens.
        assert!(matches!(h.submit(req("x", vec![1; 10], 7)), Err(EngineError::Rejected(_))));
        assert!(matches!(h.submit(req("x", vec![99], 1)), Err(EngineError::InvalidRequest(_))));
        let mut r = req("x", vec![1], 1);
        r.sampling.top_p = 0.0;
        assert!(matches!(h.submit(r), Err(EngineError::InvalidRequest(_))));
        // Training queries are token ids of the vocabulary, bounded in number and length.
        for queries in [vec![vec![]], vec![vec![99]], vec![vec![1]; crate::placement::MAX_PROFILE_QUESTIONS + 1]] {
            let r = GenerateRequest { profile_queries: queries, ..req("x", vec![1], 1) };
            assert!(matches!(h.submit(r), Err(EngineError::InvalidRequest(m)) if m.contains("profile quer")));
        }
        assert!(h.submit(req("ok", vec![1; 10], 6)).is_ok());
    }

    /// Direct submitters get the gRPC service's rule: a `max_tokens` past what the context leaves after the prompt
    /// is refused, not silently clamped (nor sized into the sampler's buffers).
    #[test]
    fn max_tokens_past_the_context_is_refused() {
        // 64 blocks: the whole 64-token context fits, so only the context can refuse.
        let h = fake(64, 0);
        for max_tokens in [55, 1000, u32::MAX] {
            let err = h.submit(req("x", vec![1; 10], max_tokens)).unwrap_err();
            assert!(
                matches!(&err, EngineError::InvalidRequest(m) if m.contains("context length 64")),
                "{max_tokens}: {err}"
            );
        }
        let (tokens, fin) = collect(h.submit(req("fits", vec![1; 10], 54)).unwrap());
        assert!(matches!(fin, GenerateEvent::Finished { .. }), "{fin:?}");
        assert!(tokens.len() <= 54);
    }

    #[test]
    fn a_block_size_past_the_tier_codecs_bound_is_refused_at_start() {
        let start = |block_size| {
            let cfg = EngineConfig { block_size, ..EngineConfig::default() };
            Engine::start_with(cfg, |_| Ok(FakeRunner::new(32, 64, Duration::ZERO)))
        };
        for bad in [0, pagoda_kernels::codec::MAX_BLOCK_SIZE + 1] {
            let Err(err) = start(bad) else { panic!("block_size {bad} started") };
            assert!(matches!(&err, EngineError::Config(m) if m.contains("1 to 256")), "{bad}: {err}");
        }
        assert!(start(pagoda_kernels::codec::MAX_BLOCK_SIZE).is_ok());
    }

    #[test]
    fn step_budget_running_limit_and_threads_out_of_range_are_refused_at_start() {
        let start = |cfg: EngineConfig| Engine::start_with(cfg, |_| Ok(FakeRunner::new(32, 64, Duration::ZERO)));
        let base = EngineConfig::default;
        for (bad, what) in [
            (EngineConfig { max_step_tokens: 0, ..base() }, "max_step_tokens"),
            (EngineConfig { max_step_tokens: MAX_STEP_TOKENS + 1, ..base() }, "max_step_tokens"),
            (EngineConfig { max_running: 0, ..base() }, "max_running"),
            (EngineConfig { max_running: usize::MAX, ..base() }, "max_running"),
            (EngineConfig { threads: usize::MAX, ..base() }, "threads"),
        ] {
            let Err(err) = start(bad) else { panic!("{what} out of range started") };
            assert!(matches!(&err, EngineError::Config(m) if m.contains(what)), "{what}: {err}");
        }
        assert!(start(EngineConfig { max_step_tokens: MAX_STEP_TOKENS, max_running: MAX_RUNNING, ..base() }).is_ok());
    }

    /// A pool past the machine's memory, or past the address space, is a clear error at start, not an abort in
    /// the allocator; the real model's pool on this machine starts.
    #[test]
    fn a_host_kv_pool_larger_than_memory_is_refused_at_start() {
        let gib = 1u64 << 30;
        // 1,024 blocks of 16 f32 slots of 64: 8 MiB.
        assert!(check_host_arena(1024, 16, 64, KvDtype::F32, Some(gib)).is_ok());
        let err = check_host_arena(1 << 20, 16, 64, KvDtype::F32, Some(gib)).unwrap_err();
        assert!(
            matches!(&err, EngineError::Config(m) if m.contains("8.0 GiB") && m.contains("--kv-cache-tokens")),
            "{err}"
        );
        let err = check_host_arena(usize::MAX / 2, 16, 64, KvDtype::F32, None).unwrap_err();
        assert!(matches!(&err, EngineError::Config(m) if m.contains("address space")), "{err}");
        // Through the runner: a synthetic model asking for 2^40 blocks.
        let cfg = EngineConfig {
            synthetic: Some("layers=2,hidden=64,heads=2,kv_heads=1,ffn=128,vocab=64".parse().expect("spec")),
            num_blocks: 1 << 40,
            ..EngineConfig::default()
        };
        let Err(err) = LlamaRunner::load(&cfg) else { panic!("a 2^40-block pool loaded") };
        assert!(matches!(&err, EngineError::Config(m) if m.contains("KV pool")), "{err}");
    }

    #[test]
    fn a_namespace_spelling_an_adapters_salt_is_refused() {
        let h = fake(64, 0);
        let with = |namespace: String| GenerateRequest { namespace, ..req("n", vec![1, 2, 3, 4, 5], 2) };
        for bad in [cache_namespace("acme", "sql@00ff"), "acme\n".into(), "acme\0".into()] {
            let err = h.submit(with(bad.clone())).unwrap_err();
            assert!(matches!(&err, EngineError::InvalidRequest(m) if m.contains("namespace")), "{bad:?}: {err}");
        }
        // The router's cache_salt namespace still runs.
        let salted = crate::cache::salted_namespace("acme", crate::cache::CLIENT_SALT_KIND, "0f");
        let (tokens, fin) = collect(h.submit(with(salted)).unwrap());
        assert_eq!(tokens.len(), 2, "{fin:?}");
    }

    #[test]
    fn dropped_receiver_and_cancel_free_blocks() {
        let h = fake(64, 5);
        let rx = h.submit(req("a", vec![1, 2, 3, 4, 5], 40)).unwrap();
        let s = wait_for(&h, |s| s.running == 1 && s.blocks_used > 0);
        assert!(s.blocks_used > 0);
        drop(rx);
        let s = wait_for(&h, |s| s.running == 0 && s.blocks_used == 0);
        assert_eq!((s.running, s.blocks_used), (0, 0));

        let rx = h.submit(req("b", vec![1, 2, 3, 4, 5], 40)).unwrap();
        wait_for(&h, |s| s.running == 1);
        h.cancel("b").unwrap();
        let (_, fin) = collect(rx);
        assert!(matches!(fin, GenerateEvent::Finished { reason: FinishReason::Cancelled, .. }));
        let s = wait_for(&h, |s| s.blocks_used == 0);
        assert_eq!(s.blocks_used, 0);
    }

    #[test]
    fn concurrent_requests_match_solo_runs() {
        let h = fake(64, 1);
        let prompts: Vec<Vec<u32>> = (0..8u32).map(|i| (0..3 + i).collect()).collect();
        let solo: Vec<Vec<u32>> =
            prompts.iter().map(|p| collect(h.submit(req("s", p.clone(), 12)).unwrap()).0).collect();
        let rxs: Vec<_> = prompts.iter().map(|p| h.submit(req("c", p.clone(), 12)).unwrap()).collect();
        let together: Vec<Vec<u32>> = rxs.into_iter().map(|rx| collect(rx).0).collect();
        assert_eq!(solo, together);
    }
}
