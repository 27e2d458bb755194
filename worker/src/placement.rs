//! EvicPress placement in the engine: the driver that feeds the pure [`Planner`] with
//! contexts, profiles and measured bandwidths, and carries out its operations on the [`TierStore`]. Owned by the
//! engine thread (one owner: the planner, the context table and the profiler's state live here and nowhere else).
//!
//! - **Contexts.** A context is a run of a prompt's prefix-chain groups that no earlier context owns: the first
//!   request over a document creates it (at least [`EvicPressConfig::min_context_groups`] groups), later requests
//!   whose chains pass through its groups count as accesses (the utility's frequency). Every group has at most one
//!   owning context, so tier bytes are accounted exactly once. The tokens after the context in the creating
//!   request (bounded by `probe_tokens`) are kept as its profiling probe.
//! - **Profiling.** Right after a request computed a context from scratch, and only when the engine has no other
//!   work, the profiler measures each variant's quality: it greedily decodes the horizon's tokens (as many as
//!   requests generate, [`AnswerHorizon`]; at most `answer_tokens`) after the probe with the full-precision KV (the
//!   answer), then, for each compressing codec, quantises the context's device
//!   blocks in place (encode → decode, what onboarding that variant would produce), runs one teacher-forced step over
//!   the probe and the answer, and scores the fraction of answer positions whose top token is the one the same step
//!   predicts over the original KV (a resolution of one position of the horizon; teacher forcing keeps one early
//!   miss from failing every later position); the original blocks are restored bit-exactly after every variant.
//!   A pruned variant (a keep ratio, [`pruned`]) is scored the same way over the context's prefix followed by its
//!   packed copy, written through the codec over the context's own first blocks (restored after), with the probe
//!   at the context's true position. With profiling questions ([`EvicPressConfig::profile_questions`], the paper's
//!   set of queries per context), or the training queries of the request that created the context
//!   ([`crate::engine::GenerateRequest::profile_queries`], in their place), every variant is scored after each of
//!   them too, and its profile is the mean; each variant is written to the device once for all the probes. Beside
//!   token agreement, each answer's embedding similarity to the full-precision one ([`answer_similarity`]) is
//!   measured and reported per variant; placement plans on agreement.
//!   It is bounded in time ([`EvicPressConfig::profile_budget`]; variants not reached stay unmeasured and are never
//!   chosen) and needs only the probe's blocks from the pool. A context placed while the engine is busy
//!   gets the running mean of the profiles measured so far (lossless only before the first).
//! - **Drift.** When a profiled context that had been dropped is recomputed and the engine is idle, the profiler
//!   re-measures the variant it was last stored in; [`Planner::observe_quality`] says whether the running mean has
//!   drifted below the profile, and if so the context is profiled again in full.
//! - **Placement.** A new or recomputed context is inserted with Algorithm 1; the planner's device capacity is 0
//!   because the device pool keeps its own LRU (its blocks are the scheduler's working set), so the insert relieves
//!   straight into host and disk: compress in place, move down, or drop below disk, by smallest utility drop. The
//!   operations are applied to the stores in an order that frees space before it is used (drops, then what lands
//!   on disk, then host). Groups are encoded from the device blocks when they are still there, else transcoded from
//!   the tier copy; a pruned copy is selected from the device blocks, else from its stored copy decoded. `load_time`
//!   uses the cost model's measured load bandwidth per tier, refreshed before each plan.
//! - **Lost copies.** A copy the stores did not keep whole (a refused write, a corrupt file) is found when the plan
//!   is applied or when a request next passes through its context; it is released in the planner and the context
//!   placed again, so the planner never counts bytes or load time for KV that no request can use. A request that
//!   went through only a context's first groups (a prefix two prompts share) places nothing for it: the device
//!   holds only those groups.
//! - **Pruned copies back.** [`EvicPress::pruned_copy`] tells the engine which copy continues a prompt; the engine
//!   onboards it into the admitted sequence itself (`Scheduler::preload_front`).
//! - **Bounds.** At most `max_contexts` contexts are remembered (the least recently used unplaced ones are
//!   forgotten), at most [`MAX_PENDING`] finished requests wait for placement, a probe is at most `probe_tokens`,
//!   a context keeps at most [`MAX_PROFILE_QUESTIONS`] training queries of [`MAX_PROFILE_QUERY_TOKENS`] tokens.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pagoda_kernels::{Codec, KeyRounding, KvDtype, KvStorage};

use crate::cache::{BlockId, BlockPool, CacheLayout, block_hashes};
use crate::engine::{EngineError, ModelRunner, StepSeq};
use crate::evicpress::{self, GreedyRule, Operation, Planner, PlannerConfig, Residual, Variant};
use crate::model::LogitsWanted;
use crate::sampling::argmax;
use crate::tiers::cost::Ewma;
use crate::tiers::pruned::{self, Pruner, kept_tokens, packed_groups};
use crate::tiers::residual;
use crate::tiers::{EncodedGroup, GroupCodec, Int8Layers, Tier, TierStore, codec, native};

/// Finished requests waiting for placement at most; older ones are dropped (their contexts are simply not placed).
pub const MAX_PENDING: usize = 256;
/// Most profiling questions besides a request's own probe ([`EvicPressConfig::profile_questions`]), and most
/// training queries a request gives its context ([`crate::engine::GenerateRequest::profile_queries`]).
pub const MAX_PROFILE_QUESTIONS: usize = 8;
/// Longest training query a request may give its context.
pub const MAX_PROFILE_QUERY_TOKENS: usize = 128;

/// Checks a request's training queries ([`crate::engine::GenerateRequest::profile_queries`]): at most
/// [`MAX_PROFILE_QUESTIONS`], each of 1..=[`MAX_PROFILE_QUERY_TOKENS`] token ids below `vocab_size` and short
/// enough that the prompt, the query and a profiled answer fit in `context_length`.
pub fn check_profile_queries(
    queries: &[Vec<u32>],
    prompt_len: usize,
    vocab_size: usize,
    context_length: usize,
) -> Result<(), String> {
    if queries.len() > MAX_PROFILE_QUESTIONS {
        return Err(format!("give at most {MAX_PROFILE_QUESTIONS} profile queries, got {}", queries.len()));
    }
    let room = context_length.saturating_sub(prompt_len + EvicPressConfig::default().answer_tokens);
    let most = MAX_PROFILE_QUERY_TOKENS.min(room);
    for (i, q) in queries.iter().enumerate() {
        if q.is_empty() || q.len() > most {
            return Err(format!("profile query {} is {} tokens; each must be 1..={most} here", i + 1, q.len()));
        }
        if let Some(bad) = q.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(format!("profile query {}: token id {bad} is outside the vocabulary ({vocab_size})", i + 1));
        }
    }
    Ok(())
}
/// Upper bound on one group file's bytes beyond its payload (header, codec name, checksum): the planner's size per
/// variant includes it so that the disk tier never has to evict on its own.
const FILE_OVERHEAD: usize = 128;

/// The lower tiers' placement policy (`--tier-placement`).
#[derive(Debug, Clone, PartialEq, Default)]
pub enum TierPlacement {
    /// Every idle device group is copied down in the native format; each tier evicts least recently used groups,
    /// host victims go to disk.
    #[default]
    Lru,
    /// LRU with every group in this compressing codec.
    LruCodec(Codec),
    /// EvicPress chooses tier and codec per context (this module).
    EvicPress(EvicPressConfig),
}

impl TierPlacement {
    /// From the worker's flags: `placement` is `lru` or `evicpress`; `codec` (LRU only) `native` or a compressing
    /// codec; `evicpress` is EvicPress's settings from its flags (α, keep ratios, profiler, greedy rule), checked
    /// here and used when `placement` is `evicpress`.
    pub fn from_flags(placement: &str, codec: &str, evicpress: EvicPressConfig) -> Result<TierPlacement, String> {
        let fixed = match codec.parse::<GroupCodec>() {
            Ok(GroupCodec::Native(_)) => None,
            Ok(GroupCodec::Kv(c)) => Some(c),
            Ok(layered @ GroupCodec::Layered { .. }) => {
                return Err(format!(
                    "--tier-codec: {layered} is a stored format; name the KIVI codec and its layers in --kivi-int8-layers"
                ));
            }
            Err(e) => return Err(format!("--tier-codec: {e}")),
        };
        match placement {
            "lru" => Ok(fixed.map_or(TierPlacement::Lru, TierPlacement::LruCodec)),
            "evicpress" => {
                if fixed.is_some() {
                    return Err("--tier-codec applies to --tier-placement lru; EvicPress chooses codecs itself".into());
                }
                let alpha = evicpress.alpha;
                if !(alpha.is_finite() && alpha >= 0.0) {
                    return Err(format!("--evicpress-alpha must be finite and >= 0, got {alpha}"));
                }
                pruned::check_keep_ratios(&evicpress.keep_ratios)
                    .map_err(|e| format!("--evicpress-keep-ratios: {e}"))?;
                Ok(TierPlacement::EvicPress(evicpress))
            }
            other => Err(format!(
                "--tier-placement: expected lru or evicpress, got {:?}",
                other.chars().take(32).collect::<String>()
            )),
        }
    }
}

/// Keep ratios EvicPress offers by default (`--evicpress-keep-ratios`).
pub const DEFAULT_KEEP_RATIOS: [f64; 2] = [0.5, 0.25];

/// One stored configuration besides the tier: a group codec, and the fraction of tokens kept.
#[derive(Debug, Clone, Copy, PartialEq)]
struct StoredVariant {
    codec: GroupCodec,
    /// 1 for every token (groups under their chain hashes), below 1 for a pruned copy.
    keep_ratio: f64,
}

impl StoredVariant {
    fn pruned(self) -> bool {
        self.keep_ratio < 1.0
    }

    /// The codec's name, with `@ratio` for a pruned copy.
    fn name(self) -> String {
        if self.pruned() {
            format!("{}@{}", self.codec.name(), self.keep_ratio)
        } else {
            self.codec.name().into_owned()
        }
    }
}

/// A pruned copy that continues a prompt (see [`EvicPress::pruned_copy`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PrunedCopy {
    /// Chain groups of the prompt the copy stands for.
    pub groups: usize,
    /// Slots it holds per table.
    pub kept: usize,
    /// Tier keys of its packed groups, in order.
    pub keys: Vec<u64>,
}

/// EvicPress settings (`--tier-placement evicpress`).
#[derive(Debug, Clone, PartialEq)]
pub struct EvicPressConfig {
    /// The utility's α: quality per second of load time.
    pub alpha: f64,
    /// Compressing variants offered besides the lossless native one.
    pub codecs: Vec<Codec>,
    /// The layers whose blocks the KIVI variants keep in int8 ([`crate::engine::EngineConfig::kivi_int8_layers`]).
    pub kivi_int8_layers: Option<Int8Layers>,
    /// Token-dropping ratios (fraction of each table's slots KeyDiff keeps), each offered with the native format
    /// and every codec: the configuration's eviction-ratio dimension ([`pruned`]).
    pub keep_ratios: Vec<f64>,
    /// Contexts remembered at most.
    pub max_contexts: usize,
    /// Tokens after a context kept as its profiling probe.
    pub probe_tokens: usize,
    /// Profiling questions (token ids, each at most `probe_tokens`, at most [`MAX_PROFILE_QUESTIONS`]) scored
    /// after the context besides the request's own probe; a profile is the mean over all of them. The paper
    /// profiles each context on a set of generated queries (§4.1); one question of a few answer tokens measures a
    /// context's sensitivity with a lot of noise. Empty: the request's probe alone.
    pub profile_questions: Vec<Vec<u32>>,
    /// Most greedy tokens of the reference answer; each variant is scored at the first [`EvicPressConfig::horizon`]
    /// of them.
    pub answer_tokens: usize,
    /// How many answer positions a profile scores.
    pub horizon: AnswerHorizon,
    /// How a variant's answer is compared with the reference answer.
    pub scoring: ProfileScoring,
    /// Shrink each context's measured quality toward its variant's mean over all contexts, by how noisy a
    /// measurement over its probes is against how much contexts really differ (empirical Bayes;
    /// [`VariantQuality::shrunk`]). Off: the raw measurement is the profile.
    pub shrink: bool,
    /// Plan every context on each variant's mean over all contexts profiled so far, its own profile counting
    /// toward the mean: full pooling, where `shrink` pools only as far as the profiles' noise says. For
    /// workloads whose contexts lose about the same to each codec, where a context's few probes mostly add noise
    /// (docs/BENCHMARKS.md, "What knowing the frequencies is worth at full size"). Off: each context's own profile.
    pub pooled: bool,
    /// How Algorithm 1's greedy step ranks the changes that make room on a full tier.
    pub greedy: GreedyRule,
    /// Relative drop of observed quality below the profile that triggers a re-profile.
    pub drift_threshold: f64,
    /// Wall time one profile may take per probe; variants not reached stay unmeasured.
    pub profile_budget: Duration,
    /// Groups (of 16 tokens by default) a new context needs at least.
    pub min_context_groups: usize,
    /// Recompute a context served from a lossy copy once its utility says the quality regained over its expected
    /// reuses outweighs one prefill ([`Planner::recompute_pays`]), and store it again from full precision. Not in
    /// the paper's Algorithm 1, so off by default.
    pub upgrade: bool,
    /// KIVI's full-precision residual: the last groups of a whole copy in a KIVI codec covering this many tokens
    /// stay in the arena's format ([`crate::tiers::residual`]). The engine sets it from
    /// [`crate::engine::EngineConfig::kivi_residual_tokens`]. Pruned copies have none.
    pub residual_tokens: usize,
}

impl Default for EvicPressConfig {
    fn default() -> EvicPressConfig {
        EvicPressConfig {
            alpha: 1.0,
            codecs: GroupCodec::COMPRESSING.to_vec(),
            kivi_int8_layers: None,
            keep_ratios: DEFAULT_KEEP_RATIOS.to_vec(),
            max_contexts: 4096,
            probe_tokens: 32,
            profile_questions: Vec::new(),
            answer_tokens: 16,
            horizon: AnswerHorizon::Fixed,
            scoring: ProfileScoring::TeacherForced,
            shrink: false,
            pooled: false,
            greedy: GreedyRule::Drop,
            drift_threshold: 0.1,
            profile_budget: Duration::from_secs(5),
            min_context_groups: 4,
            upgrade: false,
            residual_tokens: 0,
        }
    }
}

/// How the profiler scores a variant against the full-precision answer (`--evicpress-profile`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum ProfileScoring {
    /// One step over the probe and the reference answer: the fraction of answer positions whose top token is the
    /// reference step's. One early miss costs one position, so the estimate is smooth, but it does not see a
    /// free-running answer diverge after a miss.
    #[default]
    TeacherForced,
    /// The variant answers on its own (greedy, `answer_tokens` steps), and the fraction of positions equal to the
    /// reference answer is its quality: what a request served from that variant would get, and what the paper
    /// measures (on generated answers).
    FreeRunning,
}

impl std::str::FromStr for ProfileScoring {
    type Err = String;

    /// The flag's names: `forced` or `free`.
    fn from_str(s: &str) -> Result<ProfileScoring, String> {
        evicpress::parse_flag_value(
            s,
            &[("forced", ProfileScoring::TeacherForced), ("free", ProfileScoring::FreeRunning)],
        )
    }
}

/// How many answer positions the profiler scores (`--evicpress-horizon`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum AnswerHorizon {
    /// As many as this worker's requests generate: a moving average of their output lengths (rounded), at most
    /// `answer_tokens`, and `answer_tokens` before the first request finishes. Quality is then measured over the
    /// answers requests actually get: a variant that keeps a 4-token answer but loses the thread by token 10 is
    /// worth keeping for 4-token requests, and a 16-token profile would call it poor. Not the default: on the
    /// Zipf workload it traded the high-quality end of the α curve for a little speed (BENCHMARKS.md).
    Observed,
    /// Always `answer_tokens`.
    #[default]
    Fixed,
}

impl std::str::FromStr for AnswerHorizon {
    type Err = String;

    /// The flag's names: `observed` or `fixed`.
    fn from_str(s: &str) -> Result<AnswerHorizon, String> {
        evicpress::parse_flag_value(s, &[("observed", AnswerHorizon::Observed), ("fixed", AnswerHorizon::Fixed)])
    }
}

/// Counters and occupancy of the placement (in [`crate::engine::EngineStats`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)] // reports written before a field existed still load (`pagoda bench tiers --from-json`)
pub struct EvicPressStats {
    pub contexts: u64,
    /// The variants (index 0 is the lossless native format; `codec@ratio` for pruned copies), and the mean of
    /// their measured quality over every profile so far (`None`: never measured).
    pub variants: Vec<String>,
    pub mean_quality: Vec<Option<f64>>,
    /// The mean embedding similarity of each variant's answers to the full-precision ones
    /// ([`answer_similarity`]) over every measurement so far: the soft score beside `mean_quality`'s token
    /// agreement (1 for the lossless variant; `None`: never measured, or the runner has no embeddings).
    pub mean_embedding_similarity: Vec<Option<f64>>,
    /// Contexts placed per tier ([`Tier::index`]; the device slot stays 0).
    pub placed: [u64; 3],
    /// Bytes the planner accounts per tier, and its capacities.
    pub planned_bytes: [u64; 3],
    pub capacity_bytes: [u64; 3],
    pub profiles: u64,
    /// Of `profiles`, those scored on the context's own training queries
    /// ([`crate::engine::GenerateRequest::profile_queries`]) rather than the worker's profiling questions.
    pub profiles_on_own_queries: u64,
    /// Drift spot checks run, and the re-profiles they triggered.
    pub spot_checks: u64,
    pub reprofiles: u64,
    pub profile_ms: u64,
    /// Contexts placed with the prior because the engine was busy (or the probe did not fit the pool).
    pub placed_with_prior: u64,
    /// Operations applied: compress in place, move down, drop below the last tier.
    pub compressed: u64,
    pub moved_down: u64,
    pub dropped: u64,
    /// Finished requests waiting to be placed.
    pub pending: u64,
    /// Admissions that started from an onboarded pruned copy.
    pub pruned_onboards: u64,
    /// Answer positions the next profile scores ([`AnswerHorizon`]), after the request's own question and each
    /// of the `profile_questions` ([`EvicPressConfig::profile_questions`]).
    pub answer_horizon: u64,
    pub profile_questions: u64,
    /// Variant profiles shrunk toward their variant's mean (`--evicpress-shrink`), and the sum of how far they
    /// moved (a measured 1.0 stored as 0.9 moves 0.1).
    pub shrunk_profiles: u64,
    pub shrink_total: f64,
    /// Copies the stores did not keep whole (a refused or failed write, a corrupt file), found when applied or at
    /// the context's next request: the planner stops counting on them and places the context again.
    pub lost_copies: u64,
    /// Lossy copies given up before a request so that it recomputed the context at full precision
    /// ([`EvicPress::upgrade_before_admission`]).
    pub upgrades: u64,
}

#[derive(Debug)]
struct Context {
    /// The context's own groups, in chain order.
    groups: Vec<u64>,
    /// Where the stores hold it now (what has been applied).
    stored: Option<evicpress::Placement>,
    /// Quality measured (not the prior).
    profiled: bool,
    last_use: u64,
    /// The training queries its creating request gave ([`crate::engine::GenerateRequest::profile_queries`]):
    /// profiled in place of [`EvicPressConfig::profile_questions`] when there are any.
    queries: Vec<Vec<u32>>,
    /// The codec its creating request named ([`crate::engine::GenerateRequest::tier_codec`]): the context is
    /// stored in that codec whole, or dropped, and in no other configuration.
    codec: Option<GroupCodec>,
}

/// A finished request's view of one context: the whole chain up to the context's end (the profiler needs every
/// group's blocks), the tokens after it, and whether the request computed the context's own groups itself (so
/// that they are full precision, not decoded from a compressed copy).
#[derive(Debug)]
struct Pending {
    context: u64,
    chain: Vec<u64>,
    probe: Vec<u32>,
    fresh: bool,
    /// Of a new context's own groups, those the request found cached (indices into `chain`). No context owned
    /// them, so EvicPress never stored them and the device copy is its own full-precision one, unless a tier holds
    /// a copy it could have been loaded from (left from before a restart): [`EvicPress::place_one`] checks that.
    cached_new: std::ops::Range<usize>,
    /// The request went through the context's first groups only and then on to others (two prompts that share a
    /// prefix: a system prompt, a task's instructions): the device holds just those groups.
    partial: bool,
}

/// The measured qualities of one variant over every profiled context: count, sum and sum of squares; and the
/// spread of the probes within a profile, pooled over the profiles that scored at least two.
#[derive(Debug, Clone, Copy, Default)]
struct VariantQuality {
    n: u64,
    sum: f64,
    sum_sq: f64,
    within_n: u64,
    within_sum: f64,
}

impl VariantQuality {
    fn add(&mut self, q: f64) {
        self.n += 1;
        self.sum += q;
        self.sum_sq += q * q;
    }

    /// One profile's sample variance of its probes' agreements.
    fn add_probe_variance(&mut self, variance: f64) {
        self.within_n += 1;
        self.within_sum += variance;
    }

    fn mean(&self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / self.n as f64)
    }

    /// The unbiased sample variance of what was added; `None` below two.
    fn sample_variance(&self) -> Option<f64> {
        let n = self.n as f64;
        (self.n >= 2).then(|| ((self.sum_sq - self.sum * self.sum / n) / (n - 1.0)).max(0.0))
    }

    /// A new measurement `q`, the mean over `probes` probes of `positions` answer positions in all, shrunk toward
    /// this variant's mean (empirical Bayes, as in James–Stein): `q` moves toward the mean by
    /// noise / (noise + spread), where the spread contexts really have is what the measurements' variance leaves
    /// above the noise.
    ///
    /// The noise is the variance of a mean over `probes` probes, from the probes' own spread pooled over earlier
    /// profiles (a one-way random-effects model). The answer positions of one probe are not independent draws: a
    /// free-running answer that diverges at its first token rarely agrees after it, so a probe scores 0 or 1
    /// far more often than its positions' coin flips would. Until three profiles have scored at least two probes,
    /// the noise is that of `positions` coin flips at the mean, `m(1 − m) / positions`, a lower bound.
    ///
    /// Over four positions a lossy copy that agreed on all four reads 1.0; if copies of that variant average 0.87
    /// and differ little between contexts, most of that 1.0 is luck, and the planner that picks the best-looking
    /// profiles would otherwise pick luck. `None` below three measurements: there is no spread to estimate yet,
    /// and `q` stands.
    fn shrunk(&self, q: f64, probes: usize, positions: usize) -> Option<f64> {
        if self.n < 3 || positions == 0 || probes == 0 {
            return None;
        }
        let mean = self.mean()?;
        let variance = (self.sum_sq / self.n as f64 - mean * mean).max(0.0);
        let noise = if self.within_n >= 3 {
            self.within_sum / self.within_n as f64 / probes as f64
        } else {
            mean * (1.0 - mean) / positions as f64
        };
        let spread = (variance - noise).max(0.0);
        if noise + spread <= 0.0 {
            // Every measurement equal, and at 0 or 1: nothing is noisy.
            return Some(q);
        }
        Some(q - noise / (noise + spread) * (q - mean))
    }
}

/// One profile of a context: per variant (index 0, lossless, is 1 by construction), the mean agreement over the
/// probes, and the sample variance of the probes' agreements where there were at least two.
#[derive(Debug, Clone)]
struct Profiled {
    quality: Vec<Option<f64>>,
    probe_variance: Vec<Option<f64>>,
    probes: usize,
}

/// See the module docs.
pub struct EvicPress {
    cfg: EvicPressConfig,
    planner: Planner,
    /// Index 0 is the lossless native format of the device arena.
    variants: Vec<StoredVariant>,
    /// Their names, made once (the stats carry them every step).
    variant_names: Vec<String>,
    contexts: HashMap<u64, Context>,
    owner: HashMap<u64, u64>,
    pending: VecDeque<Pending>,
    /// Every measured quality per variant, summarised: the prior of unprofiled contexts, and what a new
    /// measurement is shrunk toward.
    prior: Vec<VariantQuality>,
    /// Every measured embedding similarity per variant ([`answer_similarity`]), summarised: reported beside the
    /// quality, not planned on.
    similarity: Vec<VariantQuality>,
    /// Output lengths of finished requests (moving average), for [`AnswerHorizon::Observed`].
    answer_lengths: Ewma,
    model_id: String,
    layout: CacheLayout,
    clock: u64,
    stats: EvicPressStats,
    /// One group's worth of f32 blocks, for transcoding between tier codecs and packing pruned copies, and the
    /// ids of its blocks (`0..group_size`).
    scratch: KvStorage,
    scratch_blocks: Vec<BlockId>,
    logits: Vec<f32>,
    /// Token embeddings of one answer, for [`answer_similarity`].
    embeddings: Vec<f32>,
    pruner: Pruner,
    /// Kept slots per table of the pruned copy being made.
    keep: Vec<Vec<u32>>,
    /// The last chain [`EvicPress::upgrade_before_admission`] looked at (last hash, length, `clock`), so that a
    /// sequence waiting over many steps is checked once.
    upgrade_checked: Option<(u64, usize, u64)>,
}

impl std::fmt::Debug for EvicPress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EvicPress").field("contexts", &self.contexts.len()).finish()
    }
}

impl EvicPress {
    /// Encodes rotated fp8 keys with the device arena's key rounding ([`KvStorage::set_key_rounding`]), so a
    /// profiled variant is what the tiers will store.
    pub fn set_key_rounding(&mut self, rounding: Arc<[KeyRounding]>) {
        self.scratch.set_key_rounding(rounding);
    }

    /// A driver for a model of `layout` × `head_dim` with device arena `dtype`, planning into the free space of
    /// `tiers` with its current bandwidth estimates.
    pub fn new(
        cfg: EvicPressConfig,
        model_id: &str,
        layout: CacheLayout,
        head_dim: usize,
        dtype: KvDtype,
        tiers: &TierStore,
    ) -> Result<EvicPress, EngineError> {
        let bad = |m: String| EngineError::Config(format!("evicpress: {m}"));
        if cfg.probe_tokens == 0 || cfg.answer_tokens == 0 || cfg.min_context_groups == 0 || cfg.max_contexts == 0 {
            return Err(bad("probe, answer, context sizes must be at least 1".into()));
        }
        if cfg.profile_questions.len() > MAX_PROFILE_QUESTIONS {
            return Err(bad(format!(
                "give at most {MAX_PROFILE_QUESTIONS} profiling questions, got {}",
                cfg.profile_questions.len()
            )));
        }
        if let Some((i, q)) =
            cfg.profile_questions.iter().enumerate().find(|(_, q)| q.is_empty() || q.len() > cfg.probe_tokens)
        {
            return Err(bad(format!(
                "profiling question {} is {} tokens; each must be 1..={}",
                i + 1,
                q.len(),
                cfg.probe_tokens
            )));
        }
        if !(cfg.drift_threshold.is_finite() && (0.0..1.0).contains(&cfg.drift_threshold)) {
            return Err(bad(format!("drift threshold {} is not in [0, 1)", cfg.drift_threshold)));
        }
        pruned::check_keep_ratios(&cfg.keep_ratios).map_err(bad)?;
        residual::check_tokens(cfg.residual_tokens).map_err(bad)?;
        let mut codecs = vec![GroupCodec::Native(dtype)];
        for c in &cfg.codecs {
            let v = GroupCodec::stored(*c, cfg.kivi_int8_layers);
            if matches!(c, Codec::F32 | Codec::F16) {
                return Err(bad(format!("{c} is a native format, not a compressing variant")));
            }
            if !codecs.contains(&v) {
                codecs.push(v);
            }
        }
        let mut variants: Vec<StoredVariant> =
            codecs.iter().map(|&codec| StoredVariant { codec, keep_ratio: 1.0 }).collect();
        for &keep_ratio in &cfg.keep_ratios {
            variants.extend(codecs.iter().map(|&codec| StoredVariant { codec, keep_ratio }));
        }
        let gs = layout.group_size();
        let per_token = |c: GroupCodec| -> Result<f64, EngineError> {
            let bytes = c.group_bytes(gs, layout.block_size, head_dim).map_err(|e| bad(e.to_string()))?;
            Ok((bytes + FILE_OVERHEAD) as f64 / layout.block_size as f64)
        };
        let residual = residual::residual_groups(cfg.residual_tokens, layout.block_size);
        let mut planner_variants = Vec::with_capacity(variants.len());
        for v in &variants {
            let with_residual = !v.pruned() && residual::has_residual(v.codec) && residual > 0;
            planner_variants.push(Variant {
                codec: v.name(),
                bytes_per_token: per_token(v.codec)?,
                keep_ratio: v.keep_ratio,
                residual: if with_residual {
                    Some(Residual {
                        tokens: (residual * layout.block_size) as u64,
                        bytes_per_token: per_token(GroupCodec::Native(dtype))?,
                    })
                } else {
                    None
                },
            });
        }
        let cost = tiers.cost();
        let planner = Planner::new(PlannerConfig {
            alpha: cfg.alpha,
            // The device pool keeps its own LRU; the planner places below it.
            capacity: [0, tiers.free_bytes(Tier::Host), tiers.free_bytes(Tier::Disk)],
            bandwidth: [0.0, cost.load_bandwidth(Tier::Host), cost.load_bandwidth(Tier::Disk)],
            prefill: cost.prefill_cost(),
            variants: planner_variants,
            // Forgetting is this driver's business (it must drop the group owners too).
            max_contexts: cfg.max_contexts + 1,
            granule_tokens: layout.block_size as u64,
            greedy: cfg.greedy,
        })
        .map_err(|e| bad(e.to_string()))?;
        let n = variants.len();
        let stats = EvicPressStats { capacity_bytes: planner.capacity(), ..EvicPressStats::default() };
        Ok(EvicPress {
            answer_lengths: Ewma::new(cfg.answer_tokens as f64),
            cfg,
            planner,
            variant_names: variants.iter().map(|v| v.name()).collect(),
            variants,
            contexts: HashMap::new(),
            owner: HashMap::new(),
            pending: VecDeque::new(),
            prior: vec![VariantQuality::default(); n],
            similarity: vec![VariantQuality::default(); n],
            model_id: model_id.to_owned(),
            layout,
            clock: 0,
            stats,
            scratch: KvStorage::with_dtype(gs, layout.block_size, head_dim, KvDtype::F32),
            scratch_blocks: (0..gs as BlockId).collect(),
            logits: Vec::new(),
            embeddings: Vec::new(),
            pruner: Pruner::default(),
            keep: Vec::new(),
            upgrade_checked: None,
        })
    }

    pub fn stats(&self) -> EvicPressStats {
        let mut s = EvicPressStats::default();
        self.stats_into(&mut s);
        s
    }

    /// [`EvicPress::stats`] into `s`, reusing its vectors and names: the engine publishes its stats every step.
    pub fn stats_into(&self, s: &mut EvicPressStats) {
        let mut variants = std::mem::take(&mut s.variants);
        variants.clone_from(&self.variant_names);
        let mut mean_quality = std::mem::take(&mut s.mean_quality);
        let mut mean_embedding_similarity = std::mem::take(&mut s.mean_embedding_similarity);
        // The counters' own vectors are always empty (filled only here), so this copies numbers.
        s.clone_from(&self.stats);
        s.contexts = self.contexts.len() as u64;
        s.planned_bytes = self.planner.used();
        s.pending = self.pending.len() as u64;
        s.answer_horizon = self.horizon() as u64;
        s.profile_questions = self.cfg.profile_questions.len() as u64;
        s.variants = variants;
        mean_quality.clear();
        mean_quality.extend(self.prior.iter().enumerate().map(|(v, p)| if v == 0 { Some(1.0) } else { p.mean() }));
        s.mean_quality = mean_quality;
        let measured = self.similarity.iter().any(|v| v.n > 0);
        mean_embedding_similarity.clear();
        mean_embedding_similarity.extend(
            self.similarity.iter().enumerate().map(|(v, m)| if v == 0 && measured { Some(1.0) } else { m.mean() }),
        );
        s.mean_embedding_similarity = mean_embedding_similarity;
        s.placed = [0; 3];
        for c in self.contexts.values() {
            if let Some(p) = c.stored {
                s.placed[tier_of(p.tier).index()] += 1;
            }
        }
    }

    /// Counts an admission that started from a pruned copy (the engine onboards them).
    pub fn record_pruned_onboard(&mut self) {
        self.stats.pruned_onboards += 1;
    }

    /// Names of the variants, index 0 first (the planner's variant indices).
    pub fn variant_names(&self) -> Vec<String> {
        self.variant_names.clone()
    }

    /// The pruned copy stored for the context that starts at `hashes[0]`, when the whole context lies within
    /// `hashes` (a prompt's chain hashes from the end of what the device holds): onboarding it stands for those
    /// groups. `None` when that context is not stored pruned.
    pub fn pruned_copy(&self, hashes: &[u64]) -> Option<PrunedCopy> {
        let first = *hashes.first()?;
        let id = *self.owner.get(&first)?;
        let ctx = self.contexts.get(&id)?;
        let n = ctx.groups.len();
        if ctx.groups.first() != Some(&first) || n > hashes.len() || hashes[n - 1] != ctx.groups[n - 1] {
            return None;
        }
        let stored = ctx.stored?.variant;
        let v = self.variants[stored];
        if !v.pruned() {
            return None;
        }
        let kept = kept_tokens(n * self.layout.block_size, v.keep_ratio);
        Some(PrunedCopy { groups: n, kept, keys: self.stored_keys(id, stored) })
    }

    /// The tier keys holding `context` in variant `v`: its chain hashes, or its pruned copy's keys.
    fn stored_keys(&self, context: u64, v: usize) -> Vec<u64> {
        let Some(ctx) = self.contexts.get(&context) else { return Vec::new() };
        let var = self.variants[v];
        if !var.pruned() {
            return ctx.groups.clone();
        }
        let bs = self.layout.block_size;
        let kept = kept_tokens(ctx.groups.len() * bs, var.keep_ratio);
        (0..packed_groups(kept, bs)).map(|j| pruned::group_key(context, j)).collect()
    }

    /// Answer positions a profile scores now ([`AnswerHorizon`]).
    fn horizon(&self) -> usize {
        let most = self.cfg.answer_tokens;
        match self.cfg.horizon {
            AnswerHorizon::Fixed => most,
            AnswerHorizon::Observed => (self.answer_lengths.value().round() as usize).clamp(1, most),
        }
    }

    /// Before a request over `chain` (its prompt's group hashes, in order) is admitted, with
    /// [`EvicPressConfig::upgrade`]: every context along it that the request would reuse from a lossy copy (its
    /// stored variant, or blocks the device decoded from one) and for which recomputing pays
    /// ([`Planner::recompute_pays`]) gives up that copy and those blocks. The request then computes the context,
    /// and its placement stores it again from full-precision KV. A context a running sequence holds on the device
    /// is left as it is. Returns how many contexts were given up.
    pub fn upgrade_before_admission(&mut self, chain: &[u64], pool: &mut BlockPool, tiers: &mut TierStore) -> usize {
        // The engine asks before every step while a sequence waits; the answer changes only with what finishes.
        let key = (chain.last().copied().unwrap_or_default(), chain.len(), self.clock);
        if !self.cfg.upgrade || self.upgrade_checked == Some(key) {
            return 0;
        }
        self.upgrade_checked = Some(key);
        self.refresh_costs(tiers);
        let tokens_per_group = self.layout.block_size as u64;
        let mut upgraded = 0;
        let mut start = 0;
        for (id, end) in self.owned_runs(chain) {
            let run = &chain[std::mem::replace(&mut start, end)..end];
            let Some(ctx) = self.contexts.get(&id) else { continue };
            let Some(stored) = ctx.stored else { continue };
            let index = pool.index();
            let lossy_on_device = run.iter().any(|&h| index.holds_inexact(h));
            let all_on_device = run.iter().all(|&h| index.contains(h));
            if all_on_device && !lossy_on_device {
                continue;
            }
            let load = if all_on_device {
                0.0
            } else {
                self.planner.load_time(ctx.groups.len() as u64 * tokens_per_group, stored)
            };
            let held = run.iter().any(|&h| index.get(h).is_some_and(|g| !g.is_idle()));
            if held || !self.planner.recompute_pays(id, load) {
                continue;
            }
            for &h in run {
                if pool.index().holds_inexact(h) {
                    pool.evict(h);
                }
            }
            self.remove_stored(id, Some(stored), tiers);
            self.planner.lose(id);
            if let Some(c) = self.contexts.get_mut(&id) {
                c.stored = None;
            }
            self.stats.upgrades += 1;
            upgraded += 1;
        }
        upgraded
    }

    /// The contexts `chain` passes through, in order, each with the end (exclusive) of its groups in `chain`. Owned
    /// groups form a prefix of the chain (a chain hash fixes everything before it).
    fn owned_runs(&self, chain: &[u64]) -> Vec<(u64, usize)> {
        let mut runs: Vec<(u64, usize)> = Vec::new();
        for (i, h) in chain.iter().enumerate() {
            let Some(&c) = self.owner.get(h) else { break };
            match runs.last_mut() {
                Some((last, end)) if *last == c => *end = i + 1,
                _ => runs.push((c, i + 1)),
            }
        }
        runs
    }

    /// Records a request that finished after generating `generated` tokens: resolves which contexts its prompt
    /// passed through (counting accesses) and creates a new one from its unowned groups, with `queries` (the
    /// request's training queries, checked by [`check_profile_queries`]) as its profiling set and `codec` (the
    /// codec the request named, with a native codec in the arena's own format) as the only one it may be stored
    /// in. Placement happens in [`EvicPress::place_pending`].
    pub fn finished(
        &mut self,
        prompt: &[u32],
        namespace: &str,
        cached_tokens: usize,
        generated: usize,
        queries: &[Vec<u32>],
        codec: Option<GroupCodec>,
    ) {
        let bs = self.layout.block_size;
        self.answer_lengths.update(generated as f64);
        if prompt.len() < 2 {
            return;
        }
        // Full groups before the last prompt token: the probe (what follows) is never empty.
        let full = (prompt.len() - 1) / bs;
        let chain = block_hashes(&self.model_id, namespace, &prompt[..full * bs], bs);
        self.clock += 1;
        let mut touched = self.owned_runs(&chain);
        let i = touched.last().map_or(0, |&(_, end)| end);
        let mut created = None;
        if chain.len() - i >= self.cfg.min_context_groups {
            let id = chain[i];
            created = Some(id);
            for &h in &chain[i..] {
                self.owner.insert(h, id);
            }
            self.contexts.insert(
                id,
                Context {
                    groups: chain[i..].to_vec(),
                    stored: None,
                    profiled: false,
                    last_use: self.clock,
                    queries: queries.to_vec(),
                    codec,
                },
            );
            touched.push((id, chain.len()));
        }
        let cached_groups = cached_tokens / bs;
        let mut start = 0;
        for (context, end) in touched {
            if let Some(c) = self.contexts.get_mut(&context) {
                c.last_use = self.clock;
            }
            // A context's own groups are full precision when this request computed them, whatever the prefix
            // before them, or when they are a new context's (see `Pending::cached_new`). Requiring no cache hit at
            // all would leave every context behind a shared, cached system prompt unprofiled.
            let (fresh, cached_new) = if created == Some(context) {
                (true, start..cached_groups.clamp(start, end))
            } else {
                (cached_tokens <= start * bs, 0..0)
            };
            let partial = self.contexts.get(&context).is_some_and(|c| end - start < c.groups.len());
            start = end;
            let probe_end = (end * bs + self.cfg.probe_tokens).min(prompt.len());
            if self.pending.len() >= MAX_PENDING {
                self.pending.pop_front();
            }
            self.pending.push_back(Pending {
                context,
                chain: chain[..end].to_vec(),
                probe: prompt[end * bs..probe_end].to_vec(),
                fresh,
                cached_new,
                partial,
            });
        }
    }

    /// Places every pending context: accesses are counted; new and recomputed contexts are profiled (only when
    /// `idle`), inserted by Algorithm 1, and the resulting operations applied to `tiers`.
    pub fn place_pending<R: ModelRunner>(
        &mut self,
        runner: &mut R,
        pool: &mut BlockPool,
        tiers: &mut TierStore,
        idle: bool,
    ) {
        if !self.pending.is_empty() {
            // Placements change what recomputing would gain.
            self.upgrade_checked = None;
        }
        while let Some(p) = self.pending.pop_front() {
            if let Err(e) = self.place_one(runner, pool, tiers, p, idle) {
                tracing::warn!(error = %e, "evicpress placement skipped a context");
            }
        }
        self.forget_excess();
    }

    fn place_one<R: ModelRunner>(
        &mut self,
        runner: &mut R,
        pool: &mut BlockPool,
        tiers: &mut TierStore,
        p: Pending,
        idle: bool,
    ) -> Result<(), EngineError> {
        let Some(ctx) = self.contexts.get(&p.context) else { return Ok(()) };
        let (stored, profiled) = (ctx.stored, ctx.profiled);
        let tokens = (ctx.groups.len() * self.layout.block_size) as u64;
        let known = self.planner.quality(p.context).is_some();
        if stored.is_some() && known {
            if self.copy_intact(p.context, stored, tiers) {
                self.planner.record_access(p.context).map_err(plan_err)?;
                return Ok(());
            }
            // The planner would go on counting bytes and load times for a copy that no request can use, and never
            // place the context again: release it, then place the context as the recomputed one it now is.
            self.lose(p.context, stored, tiers, "a group of it left the tiers");
        }
        if p.partial {
            // The device holds only the groups this request shared with the context, so there is no whole context
            // to profile or store; the next request that goes through all of it places it. (Storing it from here
            // found the rest of its groups missing and lost the copy again, at every such request.)
            return Ok(());
        }
        // Blocks the device decoded from a lossy copy are not the context's KV: stored as any variant they would
        // claim that variant's profiled quality. The context waits for a request that computes it.
        if self.contexts.get(&p.context).is_some_and(|c| c.groups.iter().any(|&h| pool.index().holds_inexact(h))) {
            if known {
                self.planner.record_access(p.context).map_err(plan_err)?;
            }
            return Ok(());
        }
        // New, or dropped and now recomputed: measure when possible, then insert.
        let can_profile = idle && p.fresh && p.chain[p.cached_new.clone()].iter().all(|&h| tiers.locate(h).is_none());
        let mut measured_now = false;
        if can_profile
            && !profiled
            && let Some(profiled) = self.profile_all(runner, pool, &p)?
        {
            self.set_measured(p.context, tokens, profiled)?;
            measured_now = true;
        }
        if !measured_now && !known {
            self.stats.placed_with_prior += 1;
            let mut prior = self.prior_quality();
            self.restrict(p.context, &mut prior);
            if prior.iter().all(Option::is_none) {
                // Its request's codec has never been measured: the context waits for a request that computes it
                // while the engine is idle, and a profile.
                return Ok(());
            }
            self.planner.set_profile(p.context, tokens, prior).map_err(plan_err)?;
        }
        self.planner.record_access(p.context).map_err(plan_err)?;
        self.insert(p.context, runner, pool, tiers)?;
        // A profiled context computed again: check the variant it now sits in against its profile.
        if can_profile && profiled && !measured_now {
            let Some(v) = self.planner.placement(p.context).map(|pl| pl.variant).filter(|&v| v != 0) else {
                return Ok(());
            };
            let Some(profiled) = self.profile(runner, pool, &p, &[v])? else { return Ok(()) };
            let Some(observed) = profiled.quality[v] else { return Ok(()) };
            self.stats.spot_checks += 1;
            if self.planner.observe_quality(p.context, observed, self.cfg.drift_threshold).map_err(plan_err)? {
                self.stats.reprofiles += 1;
                if let Some(profiled) = self.profile_all(runner, pool, &p)? {
                    self.set_measured(p.context, tokens, profiled)?;
                    self.insert(p.context, runner, pool, tiers)?;
                }
            }
        }
        Ok(())
    }

    fn set_measured(&mut self, context: u64, tokens: u64, profiled: Profiled) -> Result<(), EngineError> {
        let Profiled { quality: mut q, probe_variance, probes } = profiled;
        // Every probe scores the horizon's positions.
        let positions = self.horizon() * probes;
        for (v, q) in q.iter_mut().enumerate() {
            if let Some(q) = q {
                let measured = *q;
                // The lossless variant is exact by construction: nothing to shrink.
                if self.cfg.shrink
                    && v != 0
                    && let Some(shrunk) = self.prior[v].shrunk(measured, probes, positions)
                {
                    *q = shrunk;
                    self.stats.shrunk_profiles += 1;
                    self.stats.shrink_total += (measured - shrunk).abs();
                }
                self.prior[v].add(measured);
                if let Some(variance) = probe_variance[v] {
                    self.prior[v].add_probe_variance(variance);
                }
            }
        }
        if self.cfg.pooled {
            for (v, q) in q.iter_mut().enumerate().skip(1) {
                if let (Some(q), Some(mean)) = (q.as_mut(), self.prior[v].mean()) {
                    *q = mean;
                }
            }
        }
        self.restrict(context, &mut q);
        self.planner.set_profile(context, tokens, q).map_err(plan_err)?;
        if self.cfg.pooled {
            // Every earlier profile moves to the new means too: the first contexts were pooled over few.
            for v in 1..self.variants.len() {
                if let Some(mean) = self.prior[v].mean() {
                    self.planner.set_variant_quality(v, mean).map_err(plan_err)?;
                }
            }
        }
        if let Some(c) = self.contexts.get_mut(&context) {
            c.profiled = true;
        }
        Ok(())
    }

    /// The variants a context may be stored in: all of them, or only the whole copy in the codec its request
    /// named.
    fn allowed(&self, context: u64, v: usize) -> bool {
        match self.contexts.get(&context).and_then(|c| c.codec) {
            None => true,
            // The engine layered a named KIVI codec as the variants are (`--kivi-int8-layers`).
            Some(codec) => !self.variants[v].pruned() && self.variants[v].codec == codec,
        }
    }

    /// Clears the quality of every variant `context` may not be stored in, so that the planner never chooses one.
    fn restrict(&self, context: u64, quality: &mut [Option<f64>]) {
        for (v, q) in quality.iter_mut().enumerate() {
            if !self.allowed(context, v) {
                *q = None;
            }
        }
    }

    /// Algorithm 1 for `context` with fresh bandwidths, applied to the stores.
    fn insert<R: ModelRunner>(
        &mut self,
        context: u64,
        runner: &mut R,
        pool: &mut BlockPool,
        tiers: &mut TierStore,
    ) -> Result<(), EngineError> {
        let cost = self.refresh_costs(tiers);
        let ops = self.planner.insert(context).map_err(plan_err)?;
        tracing::debug!(
            context = format!("{context:x}"),
            quality = ?self.planner.quality(context),
            host_bw = cost.load_bandwidth(Tier::Host),
            disk_bw = cost.load_bandwidth(Tier::Disk),
            prefill = ?cost.prefill_cost(),
            ops = ?ops,
            "evicpress insert"
        );
        self.apply(ops, runner, pool, tiers);
        Ok(())
    }

    /// Gives the planner the cost model's current bandwidths and prefill speed; returns the cost model.
    fn refresh_costs<'t>(&mut self, tiers: &'t TierStore) -> &'t crate::tiers::cost::CostModel {
        let cost = tiers.cost();
        self.planner
            .set_costs([0.0, cost.load_bandwidth(Tier::Host), cost.load_bandwidth(Tier::Disk)], cost.prefill_cost());
        cost
    }

    /// The prior of an unprofiled context: lossless is exact by construction; the others at the running mean of
    /// the profiles measured so far (unmeasured: never chosen).
    fn prior_quality(&self) -> Vec<Option<f64>> {
        self.prior.iter().enumerate().map(|(v, p)| if v == 0 { Some(1.0) } else { p.mean() }).collect()
    }

    /// The questions a context is profiled on besides its request's probe: the training queries its creating
    /// request gave, else the worker's profiling questions.
    fn profiling_set(&self, context: u64) -> &[Vec<u32>] {
        match self.contexts.get(&context) {
            Some(c) if !c.queries.is_empty() => &c.queries,
            _ => &self.cfg.profile_questions,
        }
    }

    fn profile_all<R: ModelRunner>(
        &mut self,
        runner: &mut R,
        pool: &mut BlockPool,
        p: &Pending,
    ) -> Result<Option<Profiled>, EngineError> {
        let all: Vec<usize> = (1..self.variants.len()).filter(|&v| self.allowed(p.context, v)).collect();
        if all.is_empty() {
            // Pinned to the lossless format: nothing to measure.
            return Ok(None);
        }
        let q = self.profile(runner, pool, p, &all)?;
        if q.is_some() {
            self.stats.profiles += 1;
            if self.contexts.get(&p.context).is_some_and(|c| !c.queries.is_empty()) {
                self.stats.profiles_on_own_queries += 1;
            }
        }
        Ok(q)
    }

    /// Measures `variants` of the context at the end of `p.chain` (see the module docs). `None` when the chain is
    /// not all on the device or the pool has no room for the probe.
    fn profile<R: ModelRunner>(
        &mut self,
        runner: &mut R,
        pool: &mut BlockPool,
        p: &Pending,
        variants: &[usize],
    ) -> Result<Option<Profiled>, EngineError> {
        let t0 = Instant::now();
        let mut groups: Vec<Vec<BlockId>> = Vec::with_capacity(p.chain.len());
        for h in &p.chain {
            match pool.lookup(*h) {
                Some(g) => groups.push(g.to_vec()),
                None => return Ok(None),
            }
        }
        let pinned: Vec<BlockId> = groups.iter().flatten().copied().collect();
        if pool.acquire(&pinned).is_err() {
            return Ok(None);
        }
        let gs = self.layout.group_size();
        let bs = self.layout.block_size;
        let own = self.contexts.get(&p.context).map_or(0, |c| c.groups.len()).min(p.chain.len());
        let answer_len = self.horizon();
        let questions = self.profiling_set(p.context);
        let longest_probe = questions.iter().map(Vec::len).chain([p.probe.len()]).max().unwrap_or(0);
        let tail_blocks = (longest_probe + answer_len).div_ceil(bs);
        let mut tail = Vec::new();
        if pool.allocate(gs * tail_blocks, &mut tail).is_err() {
            release(pool, &pinned);
            return Ok(None);
        }
        let blocks = ProfileBlocks { groups: &groups, own, tail: &tail, tail_blocks };
        let probes: Vec<Vec<u32>> = [p.probe.clone()].into_iter().chain(questions.iter().cloned()).collect();
        let result = self.measure(runner, &blocks, &probes, answer_len, variants, t0);
        release(pool, &tail);
        release(pool, &pinned);
        self.stats.profile_ms += t0.elapsed().as_millis() as u64;
        result.map(Some)
    }

    /// Scores `variants` of the context over every probe (the request's own, then the profiling questions): the
    /// mean agreement with the full-precision answers. Each variant is written to the device once and read by every
    /// probe.
    fn measure<R: ModelRunner>(
        &mut self,
        runner: &mut R,
        b: &ProfileBlocks<'_>,
        probes: &[Vec<u32>],
        answer_len: usize,
        variants: &[usize],
        t0: Instant,
    ) -> Result<Profiled, EngineError> {
        let mut quality = vec![None; self.variants.len()];
        quality[0] = Some(1.0);
        let mut probe_variance = vec![None; self.variants.len()];
        let bs = self.layout.block_size;
        let ctx_tokens = b.groups.len() * bs;
        let full = b.tables(None);
        // Per probe: the probe and all but the last token of its full-precision answer (a teacher-forced step's
        // input), and the reference to score against. Teacher-forced, every variant is scored over the probe and
        // the full-precision answer, so that one early disagreement costs one position rather than the rest of a
        // diverged answer, against the predictions of the very same step over the original KV (only the codec
        // differs). Free-running, the reference is the answer itself.
        let mut references: Vec<(Vec<u32>, Vec<u32>)> = Vec::with_capacity(probes.len());
        for probe in probes {
            let answer = self.greedy(runner, &full, ctx_tokens, ctx_tokens, probe, answer_len)?;
            let mut forced: Vec<u32> = probe.to_vec();
            forced.extend_from_slice(&answer[..answer.len().saturating_sub(1)]);
            let reference = match self.cfg.scoring {
                ProfileScoring::FreeRunning => answer,
                ProfileScoring::TeacherForced => self.predict(runner, &full, ctx_tokens, ctx_tokens, probe, &forced)?,
            };
            references.push((forced, reference));
        }
        // The full-precision answers' mean embeddings, when the runner offers embeddings.
        let mut reference_embeddings = Vec::with_capacity(references.len());
        for (_, reference) in &references {
            match mean_embedding(runner, reference, &mut self.embeddings) {
                Some(e) => reference_embeddings.push(e),
                None => break,
            }
        }
        let Some(io) = runner.policy_io() else {
            return Ok(Profiled { quality, probe_variance, probes: probes.len() });
        };
        let originals: Vec<EncodedGroup> = b.groups.iter().map(|g| native::encode(io.kv, g)).collect();
        let prefix = b.groups.len() - b.own;
        let own_tables = tables_of(&b.groups[prefix..]);
        let mut selected: Option<f64> = None;
        for &v in variants {
            if t0.elapsed() > self.cfg.profile_budget * probes.len() as u32 {
                break;
            }
            let var = self.variants[v];
            let kept = kept_tokens(b.own * bs, var.keep_ratio);
            // The blocks this variant overwrites: the whole chain for a codec, the context's first blocks for a
            // pruned copy.
            let touched = if var.pruned() { prefix..prefix + packed_groups(kept, bs) } else { 0..b.groups.len() };
            // The variant on the device: the pruned copy, encoded and decoded as onboarding would leave it, packed
            // over the context's own first blocks (restored below like a codec's); or the whole chain through the
            // codec. Then (tables, slots held) for the probes to read.
            let written = if var.pruned() {
                if selected != Some(var.keep_ratio) {
                    let Some(io) = runner.policy_io() else { break };
                    self.pruner.select(io.kv, &own_tables, b.own * bs, kept, &mut self.keep);
                    selected = Some(var.keep_ratio);
                }
                self.pack_into_device(runner, &own_tables, kept, var.codec, &b.groups[prefix..])
                    .map(|n| (Cow::Owned(b.tables(Some(n))), prefix * bs + kept))
            } else {
                round_trip(runner, b.groups, var.codec, self.residual_groups())
                    .map(|()| (Cow::Borrowed(&full), ctx_tokens))
            };
            let scored = written.and_then(|(tables, held)| {
                let (mut agreements, mut similarity) = (VariantQuality::default(), 0.0);
                for (i, (probe, (forced, reference))) in probes.iter().zip(&references).enumerate() {
                    let predicted = self.predict(runner, &tables, held, ctx_tokens, probe, forced)?;
                    agreements.add(agreement(&predicted, reference));
                    if let Some(r) = reference_embeddings.get(i)
                        && let Some(p) = mean_embedding(runner, &predicted, &mut self.embeddings)
                    {
                        similarity += answer_similarity(&p, r);
                    }
                }
                let n = probes.len() as f64;
                let similarity = (reference_embeddings.len() == probes.len()).then_some(similarity / n);
                Ok((agreements.mean().unwrap_or(0.0), agreements.sample_variance(), similarity))
            });
            // Restore whatever happened: the device blocks are the prefix cache's.
            if let Some(io) = runner.policy_io() {
                for (g, orig) in b.groups[touched.clone()].iter().zip(&originals[touched]) {
                    native::decode(orig, io.kv, g).map_err(|e| EngineError::Forward(e.to_string()))?;
                }
            }
            match scored {
                Ok((q, variance, similarity)) => {
                    quality[v] = Some(q);
                    probe_variance[v] = variance;
                    if let Some(s) = similarity {
                        self.similarity[v].add(s);
                    }
                }
                // A codec that refuses this KV (out of its range) is simply not a choice for it.
                Err(e) => tracing::debug!(variant = var.name(), error = %e, "variant not profiled"),
            }
        }
        Ok(Profiled { quality, probe_variance, probes: probes.len() })
    }

    /// Packs the pruned copy selected in `self.keep` (`kept` slots of `own_tables`, the tables of `own`) through
    /// `codec` over the first groups of `own` itself, in place. Returns the packed groups. Safe in place: packed
    /// group `j` reads kept slots at or past `j · block_size` (the selection is ascending) and is read whole into
    /// scratch before it is written, so no group overwrites a slot a later one still reads.
    fn pack_into_device<R: ModelRunner>(
        &mut self,
        runner: &mut R,
        own_tables: &[Vec<BlockId>],
        kept: usize,
        codec: GroupCodec,
        own: &[Vec<BlockId>],
    ) -> Result<usize, EngineError> {
        let n = packed_groups(kept, self.layout.block_size);
        let Some(io) = runner.policy_io() else { return Err(EngineError::Forward("the runner has no host KV".into())) };
        let err = |e: crate::tiers::TierError| EngineError::Forward(e.to_string());
        for (j, dst) in own.iter().take(n).enumerate() {
            let enc = self.encode_packed(io.kv, own_tables, j, codec).map_err(err)?;
            codec::decode(&enc, io.kv, dst).map_err(err)?;
        }
        Ok(n)
    }

    /// The answer tokens a variant predicts after `probe`, over `tables` whose first `held` slots hold the
    /// context (fewer than its `pos` tokens for a pruned copy), scored the configured way: its own greedy answer
    /// (free-running), or its top token at each answer position of one step over `forced` (the probe and the
    /// full-precision answer).
    fn predict<R: ModelRunner>(
        &mut self,
        runner: &mut R,
        tables: &[Vec<BlockId>],
        held: usize,
        pos: usize,
        probe: &[u32],
        forced: &[u32],
    ) -> Result<Vec<u32>, EngineError> {
        // `forced` is the probe and all but the last answer token.
        let answer_len = (forced.len() + 1).saturating_sub(probe.len());
        match self.cfg.scoring {
            ProfileScoring::FreeRunning => self.greedy(runner, tables, held, pos, probe, answer_len),
            ProfileScoring::TeacherForced => {
                let lens = vec![held; tables.len()];
                self.teacher_forced(runner, tables, &lens, pos, forced, answer_len)
            }
        }
    }

    /// Greedy decode of `answer_len` tokens after `probe`, over `tables` whose first `held` slots hold the
    /// context (fewer than its `pos` tokens for a pruned copy); the probe starts at position `pos`.
    fn greedy<R: ModelRunner>(
        &mut self,
        runner: &mut R,
        tables: &[Vec<BlockId>],
        held: usize,
        mut pos: usize,
        probe: &[u32],
        answer_len: usize,
    ) -> Result<Vec<u32>, EngineError> {
        let vocab = runner.info().vocab_size;
        let mut lens = vec![held; tables.len()];
        let mut out = Vec::with_capacity(answer_len);
        let mut input: Vec<u32> = probe.to_vec();
        for _ in 0..answer_len {
            self.forward(runner, tables, &input, pos, &lens, LogitsWanted::Last)?;
            if self.logits.len() < vocab {
                return Err(EngineError::Forward("no logits from the profiling step".into()));
            }
            let tok = argmax(&self.logits[..vocab]);
            out.push(tok);
            pos += input.len();
            lens.iter_mut().for_each(|l| *l += input.len());
            input.clear();
            input.push(tok);
        }
        Ok(out)
    }

    /// One profiling step of `tokens` from position `pos` over `tables` holding `lens` slots; its logits land in
    /// `self.logits`.
    fn forward<R: ModelRunner>(
        &mut self,
        runner: &mut R,
        tables: &[Vec<BlockId>],
        tokens: &[u32],
        pos: usize,
        lens: &[usize],
        logits: LogitsWanted,
    ) -> Result<(), EngineError> {
        self.logits.clear();
        let seq = StepSeq {
            tokens,
            start_pos: pos as u32,
            tables,
            prior_lens: lens,
            logits,
            capture_q: 0,
            attention_sums: None,
            lora: None,
        };
        runner.forward(&[seq], &mut self.logits)
    }

    /// One step over `tokens` from position `pos` (teacher forcing) over `tables` holding `lens` slots: the top
    /// token at each of the last `scored` positions.
    fn teacher_forced<R: ModelRunner>(
        &mut self,
        runner: &mut R,
        tables: &[Vec<BlockId>],
        lens: &[usize],
        pos: usize,
        tokens: &[u32],
        scored: usize,
    ) -> Result<Vec<u32>, EngineError> {
        let vocab = runner.info().vocab_size;
        self.forward(runner, tables, tokens, pos, lens, LogitsWanted::All)?;
        if scored > tokens.len() || self.logits.len() < tokens.len() * vocab {
            return Err(EngineError::Forward("too few logits from the profiling step".into()));
        }
        let first = tokens.len() - scored;
        Ok(self.logits[first * vocab..tokens.len() * vocab].chunks_exact(vocab).map(argmax).collect())
    }

    /// Applies the planner's operations. Every context they touch is brought to its final placement, in an order
    /// that frees space before it is used: drops, then contexts landing on disk (in-place compressions first),
    /// then host, new contexts last.
    fn apply<R: ModelRunner>(&mut self, ops: Vec<Operation>, runner: &mut R, pool: &BlockPool, tiers: &mut TierStore) {
        let mut touched: Vec<u64> = Vec::new();
        for op in &ops {
            let (c, counter) = match op {
                Operation::Insert { context, .. } => (*context, None),
                // Steps through the device tier (capacity 0 here) are the planner's way down, not real moves.
                Operation::Change { context, from, .. } if from.tier == evicpress::Tier::Device => (*context, None),
                Operation::Change { context, from, to } => (*context, Some(if from.tier == to.tier { 0 } else { 1 })),
                // A re-insert drops the old placement first; only a final drop counts.
                Operation::Drop { context, .. } => (*context, self.planner.placement(*context).is_none().then_some(2)),
            };
            match counter {
                Some(0) => self.stats.compressed += 1,
                Some(1) => self.stats.moved_down += 1,
                Some(_) => self.stats.dropped += 1,
                None => {}
            }
            if !touched.contains(&c) {
                touched.push(c);
            }
        }
        let rank = |s: &EvicPress, c: u64| -> (u8, u8) {
            let target = s.planner.placement(c).map(|p| tier_of(p.tier));
            let stored = s.contexts.get(&c).and_then(|x| x.stored).map(|p| tier_of(p.tier));
            let t = match target {
                None => 0,
                Some(Tier::Disk) => 1,
                Some(_) => 2,
            };
            (
                t,
                if stored == target {
                    0
                } else if stored.is_some() {
                    1
                } else {
                    2
                },
            )
        };
        touched.sort_by_key(|&c| rank(self, c));
        let Some(io) = runner.policy_io() else { return };
        for c in touched {
            let target = self.planner.placement(c);
            let Some(ctx) = self.contexts.get(&c) else { continue };
            let stored = ctx.stored;
            if stored == target {
                continue;
            }
            let groups = ctx.groups.clone();
            // Why the copy could not be stored whole, for the log; `None` while it can.
            let mut broken: Option<&'static str> = None;
            match target {
                None => self.remove_stored(c, stored, tiers),
                Some(p) if self.variants[p.variant].pruned() => {
                    if let Err(e) = self.store_pruned(c, stored, p, io.kv, pool, tiers) {
                        // Whatever was stored is gone: the next request recomputes the context.
                        tracing::warn!(error = %e, "pruned copy not stored");
                        self.remove_stored(c, stored, tiers);
                        broken = Some("its pruned copy could not be made");
                    }
                }
                Some(p) => {
                    if stored.is_some_and(|s| self.variants[s.variant].pruned()) {
                        // Only a fresh device copy can be stored whole again (the planner never derives it from
                        // the pruned one); the groups below come from the device or not at all.
                        self.remove_stored(c, stored, tiers);
                    }
                    let tier = tier_of(p.tier);
                    let chosen = self.variants[p.variant].codec;
                    let (native, tail) = (GroupCodec::Native(io.kv.dtype()), self.residual_groups());
                    for (i, &h) in groups.iter().enumerate() {
                        let codec = residual::stored_codec(chosen, native, i, groups.len(), tail);
                        let group = match pool.lookup(h) {
                            Some(blocks) => codec::encode(io.kv, blocks, codec),
                            None => match tiers.read(h) {
                                Some((_, g)) => self.transcode(&g, codec),
                                // Evicted from the device before it was stored: the rest of the chain is
                                // unreachable anyway.
                                None => {
                                    broken = Some("a group left the device before it was stored");
                                    break;
                                }
                            },
                        };
                        let group = match group {
                            Ok(g) => g,
                            Err(e) => {
                                tracing::warn!(codec = %codec, error = %e, "KV group not stored");
                                tiers.remove(h);
                                broken = Some("a group could not be encoded");
                                break;
                            }
                        };
                        // One copy per group: whatever tier held it before gives it up.
                        tiers.remove(h);
                        if !tiers.place(tier, h, group) {
                            broken = Some("its tier refused a group");
                            break;
                        }
                    }
                }
            }
            match broken {
                None => {
                    if let Some(ctx) = self.contexts.get_mut(&c) {
                        ctx.stored = target;
                    }
                }
                // A partial copy would claim bytes and a load time for KV a request cannot use whole.
                Some(why) => self.lose(c, target, tiers, why),
            }
        }
    }

    /// Whether the stores hold every group of `context`'s copy in `stored`.
    fn copy_intact(&self, context: u64, stored: Option<evicpress::Placement>, tiers: &TierStore) -> bool {
        let Some(p) = stored else { return false };
        self.stored_keys(context, p.variant).iter().all(|&h| tiers.locate(h).is_some())
    }

    /// Gives up `context`'s copy in `stored`: what is left of it leaves the tiers, and the planner releases its
    /// bytes.
    fn lose(&mut self, context: u64, stored: Option<evicpress::Placement>, tiers: &mut TierStore, why: &str) {
        self.stats.lost_copies += 1;
        let variant = stored.map(|p| self.variants[p.variant].name());
        tracing::debug!(context, ?variant, why, "EvicPress lost a copy");
        self.remove_stored(context, stored, tiers);
        self.planner.lose(context);
        if let Some(c) = self.contexts.get_mut(&context) {
            c.stored = None;
        }
    }

    /// Removes `context`'s copy in `stored` from the tiers.
    fn remove_stored(&self, context: u64, stored: Option<evicpress::Placement>, tiers: &mut TierStore) {
        let Some(p) = stored else { return };
        for h in self.stored_keys(context, p.variant) {
            tiers.remove(h);
        }
    }

    /// Stores `context`'s pruned copy in placement `to`: KeyDiff selects from the device copy while every group is
    /// still there, else from the stored copy `stored` decoded (a pruned copy only ever shrinks further: the
    /// planner never derives a variant that keeps more tokens); the kept slots are packed, encoded, and placed
    /// under the copy's keys once the stored copy is removed.
    fn store_pruned(
        &mut self,
        context: u64,
        stored: Option<evicpress::Placement>,
        to: evicpress::Placement,
        kv: &KvStorage,
        pool: &BlockPool,
        tiers: &mut TierStore,
    ) -> Result<(), String> {
        let Some(groups) = self.contexts.get(&context).map(|c| c.groups.clone()) else { return Ok(()) };
        let (gs, bs) = (self.layout.group_size(), self.layout.block_size);
        let tokens = groups.len() * bs;
        let var = self.variants[to.variant];
        let device: Option<Vec<&[BlockId]>> = groups.iter().map(|h| pool.lookup(*h)).collect();
        // Decoding a stored copy needs its own blocks; they live only for this call.
        let staging: KvStorage;
        let (src, tables, len) = match (device, stored) {
            (Some(dev), _) => (kv, tables_of(&dev), tokens),
            (None, Some(from)) => {
                let keys = self.stored_keys(context, from.variant);
                let ids: Vec<BlockId> = (0..(keys.len() * gs) as BlockId).collect();
                let mut st = KvStorage::with_dtype(ids.len(), bs, kv.head_dim(), kv.dtype());
                for (&key, blocks) in keys.iter().zip(ids.chunks_exact(gs)) {
                    let (_, g) = tiers.read(key).ok_or("a group of the stored copy is missing")?;
                    codec::decode(&g, &mut st, blocks).map_err(|e| e.to_string())?;
                }
                let from_var = self.variants[from.variant];
                let len = if from_var.pruned() { kept_tokens(tokens, from_var.keep_ratio) } else { tokens };
                staging = st;
                (&staging, tables_of(&ids.chunks_exact(gs).collect::<Vec<_>>()), len)
            }
            (None, None) => return Err("the context left the device before it was stored".into()),
        };
        let kept = kept_tokens(tokens, var.keep_ratio).min(len);
        self.pruner.select(src, &tables, len, kept, &mut self.keep);
        let encoded = (0..packed_groups(kept, bs))
            .map(|j| self.encode_packed(src, &tables, j, var.codec))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        self.remove_stored(context, stored, tiers);
        let tier = tier_of(to.tier);
        for (j, g) in encoded.into_iter().enumerate() {
            if !tiers.place(tier, pruned::group_key(context, j), g) {
                for k in 0..j {
                    tiers.remove(pruned::group_key(context, k));
                }
                return Err(format!("the {} tier refused a pruned group", tier.name()));
            }
        }
        Ok(())
    }

    /// Re-encodes a stored group in another codec (through f32); a group already in `to` moves as it is.
    fn transcode(&mut self, g: &EncodedGroup, to: GroupCodec) -> Result<EncodedGroup, crate::tiers::TierError> {
        if g.codec == to.name() {
            return Ok(g.clone());
        }
        codec::decode(g, &mut self.scratch, &self.scratch_blocks)?;
        codec::encode(&self.scratch, &self.scratch_blocks, to)
    }

    /// Packed group `j` of the pruned copy selected in `self.keep` from `tables` of `src`, encoded with `codec`.
    fn encode_packed(
        &mut self,
        src: &KvStorage,
        tables: &[Vec<BlockId>],
        j: usize,
        codec: GroupCodec,
    ) -> Result<EncodedGroup, crate::tiers::TierError> {
        self.pruner.pack_group(src, tables, &self.keep, j, &mut self.scratch, &self.scratch_blocks);
        codec::encode(&self.scratch, &self.scratch_blocks, codec)
    }

    /// Groups at the end of a whole copy in a KIVI codec that keep the arena's format.
    fn residual_groups(&self) -> usize {
        residual::residual_groups(self.cfg.residual_tokens, self.layout.block_size)
    }

    /// Forgets the least recently used unplaced contexts beyond `max_contexts`.
    fn forget_excess(&mut self) {
        while self.contexts.len() > self.cfg.max_contexts {
            let victim =
                self.contexts.iter().filter(|(_, c)| c.stored.is_none()).min_by_key(|(_, c)| c.last_use).map(|e| *e.0);
            let Some(id) = victim else { break };
            if let Some(c) = self.contexts.remove(&id) {
                for h in c.groups {
                    self.owner.remove(&h);
                }
            }
            self.planner.forget(id);
        }
    }
}

fn plan_err(e: evicpress::PlanError) -> EngineError {
    EngineError::Config(format!("evicpress: {e}"))
}

fn tier_of(t: evicpress::Tier) -> Tier {
    match t {
        evicpress::Tier::Device => Tier::Device,
        evicpress::Tier::Host => Tier::Host,
        evicpress::Tier::Disk => Tier::Disk,
    }
}

/// The fraction of positions where a variant's top token is the reference's (1 for no positions: nothing
/// disagreed).
/// The mean of the model's input embeddings of `answer` (`scratch` holds the rows), or `None` when the runner has
/// no embeddings or the answer is empty.
fn mean_embedding<R: ModelRunner>(runner: &mut R, answer: &[u32], scratch: &mut Vec<f32>) -> Option<Vec<f32>> {
    if answer.is_empty() || !runner.token_embeddings(answer, scratch) || scratch.is_empty() {
        return None;
    }
    let hidden = scratch.len() / answer.len();
    let mut mean = vec![0.0f32; hidden];
    for row in scratch.chunks_exact(hidden) {
        mean.iter_mut().zip(row).for_each(|(m, x)| *m += x);
    }
    Some(mean)
}

/// The embedding similarity of two answers: the cosine of their mean input embeddings (the served model's own
/// embedding table, so no second model is needed), clamped to [0, 1]. Token agreement counts a near miss (a
/// digit off, a synonym) as a miss; this scores it by how close the tokens are, as the paper's semantic
/// similarity of generated text does. Two empty or zero answers are equal.
pub(crate) fn answer_similarity(a: &[f32], b: &[f32]) -> f64 {
    let (mut dot, mut na, mut nb) = (0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        dot += f64::from(x) * f64::from(y);
        na += f64::from(x) * f64::from(x);
        nb += f64::from(y) * f64::from(y);
    }
    if na == 0.0 || nb == 0.0 {
        return if na == nb { 1.0 } else { 0.0 };
    }
    (dot / (na.sqrt() * nb.sqrt())).clamp(0.0, 1.0)
}

pub(crate) fn agreement(predicted: &[u32], reference: &[u32]) -> f64 {
    if reference.is_empty() {
        return 1.0;
    }
    let agree = predicted.iter().zip(reference).filter(|(p, r)| p == r).count();
    agree as f64 / reference.len() as f64
}

/// The device blocks of one profile: the chain's groups (the context's own `own` groups last) and the tail blocks
/// the probe and answer are written to (`tail_blocks` per table, table-major).
struct ProfileBlocks<'a> {
    groups: &'a [Vec<BlockId>],
    own: usize,
    tail: &'a [BlockId],
    tail_blocks: usize,
}

impl ProfileBlocks<'_> {
    /// Each table's blocks: the chain's groups, or with `Some(n)` the groups before the context and then the
    /// context's first `n` groups (where its pruned copy was packed); the tail after either.
    fn tables(&self, pruned: Option<usize>) -> Vec<Vec<BlockId>> {
        let used = match pruned {
            Some(n) => &self.groups[..self.groups.len() - self.own + n],
            None => self.groups,
        };
        let mut tables = tables_of(used);
        for (t, table) in tables.iter_mut().enumerate() {
            table.extend_from_slice(&self.tail[t * self.tail_blocks..(t + 1) * self.tail_blocks]);
        }
        tables
    }
}

/// Per-table block lists of a run of block groups (block `t` of each group belongs to table `t`).
fn tables_of<G: AsRef<[BlockId]>>(groups: &[G]) -> Vec<Vec<BlockId>> {
    let gs = groups.first().map_or(0, |g| g.as_ref().len());
    (0..gs).map(|t| groups.iter().map(|g| g.as_ref()[t]).collect()).collect()
}

fn release(pool: &mut BlockPool, blocks: &[BlockId]) {
    if let Err(e) = pool.release(blocks) {
        tracing::error!(error = %e, "releasing profiling blocks failed");
    }
}

/// Quantises the context's device blocks in place with `codec` (encode, then decode back), as a stored copy would
/// hold them: the last `residual` groups stay as they are under a KIVI codec.
fn round_trip<R: ModelRunner>(
    runner: &mut R,
    groups: &[Vec<BlockId>],
    codec: GroupCodec,
    residual: usize,
) -> Result<(), EngineError> {
    let Some(io) = runner.policy_io() else { return Err(EngineError::Forward("the runner has no host KV".into())) };
    let err = |e: crate::tiers::TierError| EngineError::Forward(e.to_string());
    let native = GroupCodec::Native(io.kv.dtype());
    for (i, g) in groups.iter().enumerate() {
        let codec = residual::stored_codec(codec, native, i, groups.len(), residual);
        if codec == native {
            continue;
        }
        let enc = codec::encode(io.kv, g, codec).map_err(err)?;
        codec::decode(&enc, io.kv, g).map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiers::TierConfig;

    #[test]
    fn flags_parse_into_placements_and_bad_ones_are_refused() {
        let from_flags = |p: &str, c: &str, alpha: f64, r: &[f64]| {
            TierPlacement::from_flags(p, c, EvicPressConfig { alpha, keep_ratios: r.to_vec(), ..Default::default() })
        };
        assert_eq!(from_flags("lru", "native", 1.0, &[0.5]), Ok(TierPlacement::Lru));
        assert_eq!(from_flags("lru", "f16", 1.0, &[0.5]), Ok(TierPlacement::Lru));
        assert_eq!(from_flags("lru", "int4_kivi", 1.0, &[0.5]), Ok(TierPlacement::LruCodec(Codec::Int4Kivi)));
        match from_flags("evicpress", "native", 2.5, &[0.5]) {
            Ok(TierPlacement::EvicPress(c)) => {
                assert_eq!(c.alpha, 2.5);
                assert_eq!(c.codecs, GroupCodec::COMPRESSING.to_vec());
                assert_eq!(c.keep_ratios, [0.5]);
                assert_eq!(c.scoring, ProfileScoring::TeacherForced);
                assert_eq!(c.horizon, AnswerHorizon::Fixed);
                assert_eq!(c.greedy, GreedyRule::Drop, "the paper's rule by default");
            }
            other => panic!("{other:?}"),
        }
        assert!(from_flags("evicpress", "int8", 1.0, &[0.5]).is_err(), "EvicPress picks its own codecs");
        assert!(from_flags("evicpress", "native", f64::NAN, &[0.5]).is_err());
        assert!(from_flags("evicpress", "native", -1.0, &[0.5]).is_err());
        assert!(from_flags("evicpress", "native", 1.0, &[1.0]).is_err(), "a ratio keeps less than all");
        assert!(from_flags("evicpress", "native", 1.0, &[]).is_ok(), "whole contexts only");
        assert!(from_flags("fifo", "native", 1.0, &[0.5]).is_err());
        assert!(from_flags("lru", "zstd", 1.0, &[0.5]).is_err());
        let chosen = EvicPressConfig {
            keep_ratios: Vec::new(),
            scoring: ProfileScoring::FreeRunning,
            horizon: AnswerHorizon::Observed,
            shrink: true,
            greedy: GreedyRule::DropPerByte,
            ..Default::default()
        };
        assert_eq!(
            TierPlacement::from_flags("evicpress", "native", chosen.clone()),
            Ok(TierPlacement::EvicPress(chosen))
        );
        assert_eq!("free".parse(), Ok(ProfileScoring::FreeRunning));
        assert!("teacher".parse::<ProfileScoring>().is_err());
        assert_eq!("observed".parse(), Ok(AnswerHorizon::Observed));
        assert_eq!("fixed".parse(), Ok(AnswerHorizon::Fixed));
        assert!("16".parse::<AnswerHorizon>().is_err());
    }

    #[test]
    fn answer_similarity_is_the_cosine_of_mean_embeddings_in_0_1() {
        assert!((answer_similarity(&[1.0, 2.0], &[2.0, 4.0]) - 1.0).abs() < 1e-12);
        assert_eq!(answer_similarity(&[1.0, 0.0], &[0.0, 3.0]), 0.0);
        assert!((answer_similarity(&[1.0, 0.0], &[1.0, 1.0]) - 0.5f64.sqrt()).abs() < 1e-12);
        // Opposite directions are as dissimilar as it gets, not below it.
        assert_eq!(answer_similarity(&[1.0, -1.0], &[-1.0, 1.0]), 0.0);
        assert_eq!(answer_similarity(&[0.0, 0.0], &[0.0, 0.0]), 1.0);
        assert_eq!(answer_similarity(&[0.0, 0.0], &[1.0, 0.0]), 0.0);
    }

    #[test]
    fn agreement_counts_positions_not_prefixes() {
        // One early miss costs one position of 16, not the rest of the answer.
        let reference: Vec<u32> = (0..16).collect();
        let mut predicted = reference.clone();
        predicted[1] = 99;
        assert_eq!(agreement(&predicted, &reference), 15.0 / 16.0);
        assert_eq!(agreement(&reference, &reference), 1.0);
        assert_eq!(agreement(&[7; 16], &reference), 1.0 / 16.0);
        // A short prediction (a step that returned fewer rows) counts its missing positions as misses.
        assert_eq!(agreement(&reference[..8], &reference), 0.5);
        assert_eq!(agreement(&[], &[]), 1.0);
    }

    #[test]
    fn pooled_profiles_plan_every_context_on_each_variants_mean() {
        let dir = std::env::temp_dir().join(format!("pagoda-placement-pooled-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = TierConfig { data_dir: Some(dir.clone()), host_bytes: 1 << 20, disk_bytes: 4 << 20 };
        let tiers = TierStore::open(&cfg, 1 << 20).unwrap().unwrap();
        let layout = CacheLayout { n_layers: 2, n_kv_heads: 2, block_size: 16 };
        let measured = |q: [f64; 5]| Profiled {
            quality: q.iter().map(|&q| Some(q)).collect(),
            probe_variance: vec![None; 5],
            probes: 1,
        };
        let host = |variant| Some(crate::evicpress::Placement { tier: crate::evicpress::Tier::Host, variant });
        for pooled in [false, true] {
            let cfg = EvicPressConfig { keep_ratios: vec![], pooled, ..EvicPressConfig::default() };
            let mut ep = EvicPress::new(cfg, "m", layout, 64, KvDtype::F16, &tiers).unwrap();
            ep.set_measured(1, 64, measured([1.0, 0.9, 0.8, 0.6, 0.2])).unwrap();
            ep.set_measured(2, 64, measured([1.0, 0.7, 1.0, 0.8, 0.4])).unwrap();
            for c in [1, 2] {
                ep.planner.record_access(c).unwrap();
            }
            for v in 0..5 {
                let (one, two) = (ep.planner.utility(1, host(v)).unwrap(), ep.planner.utility(2, host(v)).unwrap());
                // Same tokens, one access each: the utilities differ only by α · (q₁ − q₂).
                let own = [[1.0, 0.9, 0.8, 0.6, 0.2], [1.0, 0.7, 1.0, 0.8, 0.4]];
                let want = if pooled { 0.0 } else { own[0][v] - own[1][v] };
                assert!((one - two - want).abs() < 1e-12, "pooled {pooled}, variant {v}: {one} {two}");
            }
            if pooled {
                // Both sit at the mean of the two profiles (int8: 0.8), the lossless variant at 1.
                let lossless = ep.planner.utility(1, host(0)).unwrap();
                let int8 = ep.planner.utility(1, host(1)).unwrap();
                let load_gap = int8 - lossless + 0.2; // α = 1: the quality gap is 0.2
                assert!(load_gap > 0.0 && load_gap < 0.01, "int8 loads faster by a little: {load_gap}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_planner_is_sized_from_the_tiers_and_codecs() {
        let dir = std::env::temp_dir().join(format!("pagoda-placement-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = TierConfig { data_dir: Some(dir.clone()), host_bytes: 1 << 20, disk_bytes: 4 << 20 };
        let tiers = TierStore::open(&cfg, 1 << 20).unwrap().unwrap();
        let layout = CacheLayout { n_layers: 2, n_kv_heads: 2, block_size: 16 };
        let whole = EvicPressConfig { keep_ratios: vec![], ..EvicPressConfig::default() };
        let ep = EvicPress::new(whole, "m", layout, 64, KvDtype::F16, &tiers).unwrap();
        assert_eq!(ep.variant_names(), ["f16", "int8", "fp8_e4m3", "int4_kivi", "int2_kivi"]);
        assert_eq!(ep.stats().capacity_bytes, [0, 1 << 20, 4 << 20]);
        // Before any profile only the lossless variant has a quality.
        assert_eq!(ep.stats().variants, ep.variant_names());
        assert_eq!(ep.stats().mean_quality, [Some(1.0), None, None, None, None]);
        // Each keep ratio adds a pruned copy in every codec.
        let pruned =
            EvicPressConfig { codecs: vec![Codec::Int4Kivi], keep_ratios: vec![0.5, 0.25], ..Default::default() };
        let ep = EvicPress::new(pruned, "m", layout, 64, KvDtype::F16, &tiers).unwrap();
        assert_eq!(ep.variant_names(), ["f16", "int4_kivi", "f16@0.5", "int4_kivi@0.5", "f16@0.25", "int4_kivi@0.25"]);
        let bad = EvicPressConfig { keep_ratios: vec![0.5, 0.5], ..EvicPressConfig::default() };
        assert!(EvicPress::new(bad, "m", layout, 64, KvDtype::F16, &tiers).is_err());
        // A native format is not a compressing variant; nonsense settings are refused.
        let native = EvicPressConfig { codecs: vec![Codec::F16], ..EvicPressConfig::default() };
        assert!(EvicPress::new(native, "m", layout, 64, KvDtype::F16, &tiers).is_err());
        let drift = EvicPressConfig { drift_threshold: 1.5, ..EvicPressConfig::default() };
        assert!(EvicPress::new(drift, "m", layout, 64, KvDtype::F16, &tiers).is_err());
        // KIVI's residual: a whole KIVI copy prices its last two groups (32 tokens) in the arena's format; int8 and
        // pruned copies have none.
        let with_residual = EvicPressConfig {
            codecs: vec![Codec::Int8, Codec::Int2Kivi],
            keep_ratios: vec![0.5],
            residual_tokens: 20,
            ..Default::default()
        };
        let ep = EvicPress::new(with_residual, "m", layout, 64, KvDtype::F16, &tiers).unwrap();
        assert_eq!(ep.variant_names(), ["f16", "int8", "int2_kivi", "f16@0.5", "int8@0.5", "int2_kivi@0.5"]);
        let group = |c: GroupCodec| (c.group_bytes(4, 16, 64).unwrap() + FILE_OVERHEAD) as u64;
        let (f16, int8, int2) = (
            group(GroupCodec::Native(KvDtype::F16)),
            group(GroupCodec::Kv(Codec::Int8)),
            group(GroupCodec::Kv(Codec::Int2Kivi)),
        );
        assert_eq!(ep.planner.bytes(160, 0), 10 * f16);
        assert_eq!(ep.planner.bytes(160, 1), 10 * int8);
        assert_eq!(ep.planner.bytes(160, 2), 8 * int2 + 2 * f16);
        assert_eq!(ep.planner.bytes(16, 2), f16, "a context shorter than the residual is stored whole natively");
        assert_eq!(ep.planner.bytes(160, 5), 5 * int2, "a pruned copy has no residual");
        let too_long = EvicPressConfig { residual_tokens: residual::MAX_RESIDUAL_TOKENS + 1, ..Default::default() };
        assert!(EvicPress::new(too_long, "m", layout, 64, KvDtype::F16, &tiers).is_err());
        // Profiling questions: bounded in number and each a non-empty probe of at most probe_tokens.
        let questions = |q: Vec<Vec<u32>>| EvicPressConfig { profile_questions: q, ..EvicPressConfig::default() };
        assert!(EvicPress::new(questions(vec![vec![7; 32]; 2]), "m", layout, 64, KvDtype::F16, &tiers).is_ok());
        for bad in [vec![vec![7; 33]], vec![vec![]], vec![vec![7]; MAX_PROFILE_QUESTIONS + 1]] {
            assert!(EvicPress::new(questions(bad), "m", layout, 64, KvDtype::F16, &tiers).is_err());
        }
        drop(tiers);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn contexts_are_the_unowned_runs_of_prompt_groups() {
        let cfg = TierConfig { data_dir: None, host_bytes: 1 << 20, disk_bytes: 0 };
        let tiers = TierStore::open(&cfg, 1 << 20).unwrap().unwrap();
        let layout = CacheLayout { n_layers: 1, n_kv_heads: 1, block_size: 16 };
        let mut ep = EvicPress::new(EvicPressConfig::default(), "m", layout, 64, KvDtype::F32, &tiers).unwrap();
        // 8 full groups before the last token, then a 5-token question.
        let doc: Vec<u32> = (0..128).collect();
        let mut a = doc.clone();
        a.extend([900, 901, 902, 903, 904]);
        ep.finished(&a, "", 0, 4, &[], None);
        assert_eq!(ep.contexts.len(), 1);
        let id = *ep.contexts.keys().next().unwrap();
        assert_eq!(ep.contexts[&id].groups.len(), 8);
        assert_eq!(ep.pending.back().map(|p| (p.probe.clone(), p.fresh)), Some((vec![900, 901, 902, 903, 904], true)));
        // Another question on the same document is an access, not a new context; a short new tail (< 4 groups) is
        // not a context either.
        let mut b = doc.clone();
        b.extend(1000..1040);
        ep.finished(&b, "", 128, 4, &[], None);
        assert_eq!(ep.contexts.len(), 1);
        let last = ep.pending.back().unwrap();
        assert_eq!((last.context, last.chain.len(), last.fresh), (id, 8, false));
        assert_eq!(last.probe, (1000..1032).collect::<Vec<u32>>(), "the probe is bounded by probe_tokens");
        // A document extended by 4+ groups makes a second context owning only the new groups. The request found
        // the document cached and computed the new groups: the new context is fresh (profiled), the document not.
        let mut c = doc.clone();
        c.extend(2000..2080);
        ep.finished(&c, "", 128, 4, &[], None);
        assert_eq!(ep.contexts.len(), 2);
        assert!(ep.contexts.values().any(|x| x.groups.len() == 4));
        let n = ep.pending.len();
        let fresh: Vec<(usize, bool)> = ep.pending.range(n - 2..).map(|p| (p.chain.len(), p.fresh)).collect();
        assert_eq!(fresh, [(8, false), (12, true)]);
        assert!(ep.pending.back().is_some_and(|p| p.cached_new.is_empty()));
        // A new document behind a cached group no context owns (a shared system prompt too short to be a
        // context): fresh, with that group left for placement to check against the tiers.
        let mut d: Vec<u32> = (7000..7016).collect();
        d.extend(5000..5080);
        ep.finished(&d, "", 16, 4, &[], None);
        let last = ep.pending.back().unwrap();
        assert_eq!((last.chain.len(), last.fresh, last.cached_new.len()), (5, true, 1));
        // Another namespace hashes differently: a new context.
        ep.finished(&a, "tenant", 0, 4, &[], None);
        assert_eq!(ep.contexts.len(), 4);
    }

    #[test]
    fn a_context_is_profiled_on_the_training_queries_of_the_request_that_created_it() {
        let cfg = TierConfig { data_dir: None, host_bytes: 1 << 20, disk_bytes: 0 };
        let tiers = TierStore::open(&cfg, 1 << 20).unwrap().unwrap();
        let layout = CacheLayout { n_layers: 1, n_kv_heads: 1, block_size: 16 };
        let generic = vec![vec![1, 2, 3]];
        let config = EvicPressConfig { profile_questions: generic.clone(), ..EvicPressConfig::default() };
        let mut ep = EvicPress::new(config, "m", layout, 64, KvDtype::F32, &tiers).unwrap();
        let own = vec![vec![900, 901], vec![902; 40]];
        let doc: Vec<u32> = (0..128).collect();
        ep.finished(&[doc.as_slice(), &[800, 801]].concat(), "", 0, 4, &own, None);
        let first = ep.pending.back().unwrap().context;
        assert_eq!(ep.profiling_set(first), own.as_slice());
        // A later request's queries do not replace them; a context created without any gets the worker's.
        ep.finished(&[doc.as_slice(), &[810]].concat(), "", 128, 4, &[vec![5]], None);
        assert_eq!(ep.profiling_set(first), own.as_slice());
        ep.finished(&(3000..3100).collect::<Vec<u32>>(), "", 0, 4, &[], None);
        let second = ep.pending.back().unwrap().context;
        assert_ne!(second, first);
        assert_eq!(ep.profiling_set(second), generic.as_slice());
    }

    #[test]
    fn training_queries_are_bounded_and_checked() {
        let ok = vec![vec![1; MAX_PROFILE_QUERY_TOKENS]; MAX_PROFILE_QUESTIONS];
        assert_eq!(check_profile_queries(&ok, 100, 1000, 8192), Ok(()));
        assert_eq!(check_profile_queries(&[], 8192, 1000, 8192), Ok(()));
        let refused = |q: &[Vec<u32>], prompt: usize| check_profile_queries(q, prompt, 1000, 8192).unwrap_err();
        assert!(refused(&vec![vec![1]; MAX_PROFILE_QUESTIONS + 1], 10).contains("at most 8"));
        assert!(refused(&[vec![]], 10).contains("profile query 1 is 0 tokens"));
        assert!(refused(&[vec![1], vec![1; MAX_PROFILE_QUERY_TOKENS + 1]], 10).contains("profile query 2 is 129"));
        assert!(refused(&[vec![7, 1000]], 10).contains("token id 1000 is outside the vocabulary"));
        // The prompt, the query and a profiled answer (16 tokens) must fit the model's context.
        assert!(refused(&[vec![1; 8]], 8192 - 16 - 7).contains("1..=7"));
    }

    #[test]
    fn profiles_shrink_toward_the_variant_mean_by_their_noise() {
        let of = |qs: &[f64]| {
            let mut v = VariantQuality::default();
            qs.iter().for_each(|&q| v.add(q));
            v
        };
        // Too few measurements to tell noise from spread: a profile stands.
        assert_eq!(of(&[0.5, 1.0]).shrunk(1.0, 1, 4), None);
        // Four-position profiles of a variant that averages 0.875, spread no wider than four coin flips at 0.875
        // would spread them: a perfect profile is luck, and reads as the mean.
        let even = of(&[0.75, 1.0, 0.75, 1.0, 0.75, 1.0, 1.0, 0.75]);
        assert!((even.shrunk(1.0, 1, 4).unwrap() - 0.875).abs() < 1e-12);
        assert!((even.shrunk(0.5, 1, 4).unwrap() - 0.875).abs() < 1e-12);
        // Contexts that really differ (half lose everything, half nothing): a profile keeps most of what it says,
        // and more the more positions it scored.
        let split = of(&[0.0, 1.0, 0.0, 1.0, 0.0, 1.0]);
        let (at4, at16) = (split.shrunk(1.0, 1, 4).unwrap(), split.shrunk(1.0, 1, 16).unwrap());
        assert!(at4 < at16 && at16 < 1.0 && at4 > 0.75, "{at4} {at16}");
        // noise 0.25/16, spread 0.25 - noise: the profile moves 1/16 of the way to the mean.
        assert!((at16 - (1.0 - 0.5 / 16.0)).abs() < 1e-12, "{at16}");
        // A variant that is always exact has no noise: nothing moves.
        assert_eq!(of(&[1.0, 1.0, 1.0]).shrunk(1.0, 1, 4), Some(1.0));
    }

    #[test]
    fn the_noise_of_a_profile_is_its_probes_pooled_spread() {
        // Profiles of five probes of four positions whose means spread around 0.6.
        let mut v = VariantQuality::default();
        for q in [0.4, 0.8, 0.4, 0.8, 0.6, 0.6] {
            v.add(q);
        }
        let variance = 0.16 / 6.0; // (4 · 0.04 + 2 · 0) / 6
        // Until three profiles report their probes' spread, the noise is 20 coin flips at 0.6: 0.012.
        let coin = 0.6 * 0.4 / 20.0;
        let expected = 1.0 - coin / variance * 0.4;
        assert!((v.shrunk(1.0, 5, 20).unwrap() - expected).abs() < 1e-12);
        // Probes that each agree wholly or not at all (sample variance 0.3 at 0.6 over five) say a mean of five is
        // far noisier: 0.06 > the measured 0.0267, so every context reads as the mean.
        for _ in 0..3 {
            v.add_probe_variance(0.3);
        }
        assert!((v.shrunk(1.0, 5, 20).unwrap() - 0.6).abs() < 1e-12);
        // Probes that agree with each other (variance 0.01): noise 0.002, a profile keeps most of what it says.
        let mut calm = VariantQuality::default();
        [0.4, 0.8, 0.4, 0.8, 0.6, 0.6].into_iter().for_each(|q| calm.add(q));
        (0..3).for_each(|_| calm.add_probe_variance(0.01));
        let spread = variance - 0.002;
        let kept = calm.shrunk(1.0, 5, 20).unwrap();
        assert!((kept - (1.0 - 0.002 / (0.002 + spread) * 0.4)).abs() < 1e-12, "{kept}");
        assert!(kept > v.shrunk(1.0, 5, 20).unwrap());
        // The probes' spread is the unbiased sample variance: 0, 1, 1, 0, 1 → 0.3.
        let mut probes = VariantQuality::default();
        [0.0, 1.0, 1.0, 0.0, 1.0].into_iter().for_each(|a| probes.add(a));
        assert!((probes.sample_variance().unwrap() - 0.3).abs() < 1e-12);
        assert_eq!(VariantQuality::default().sample_variance(), None);
    }

    #[test]
    fn the_profile_horizon_follows_what_requests_generate() {
        let cfg = TierConfig { data_dir: None, host_bytes: 1 << 20, disk_bytes: 0 };
        let tiers = TierStore::open(&cfg, 1 << 20).unwrap().unwrap();
        let layout = CacheLayout { n_layers: 1, n_kv_heads: 1, block_size: 16 };
        let prompt: Vec<u32> = (0..40).collect();
        let horizon = |ep: &EvicPress| ep.stats().answer_horizon;
        let observed = EvicPressConfig { horizon: AnswerHorizon::Observed, ..EvicPressConfig::default() };
        let mut ep = EvicPress::new(observed, "m", layout, 64, KvDtype::F32, &tiers).unwrap();
        // Before any request: the most, answer_tokens.
        assert_eq!(horizon(&ep), 16);
        // The first output length replaces the prior; later ones move the average (rounded).
        ep.finished(&prompt, "", 0, 4, &[], None);
        assert_eq!(horizon(&ep), 4);
        ep.finished(&prompt, "", 0, 4, &[], None);
        assert_eq!(horizon(&ep), 4);
        ep.finished(&prompt, "", 0, 9, &[], None);
        assert_eq!(horizon(&ep), 5, "4 + 0.2 · (9 − 4) = 5");
        // Bounded by answer_tokens above; an empty output (a request stopped at once) does not count.
        for _ in 0..50 {
            ep.finished(&prompt, "", 0, 500, &[], None);
        }
        assert_eq!(horizon(&ep), 16);
        ep.finished(&prompt, "", 0, 0, &[], None);
        assert_eq!(horizon(&ep), 16);
        // Fixed, the default, ignores the requests.
        let mut ep = EvicPress::new(EvicPressConfig::default(), "m", layout, 64, KvDtype::F32, &tiers).unwrap();
        ep.finished(&prompt, "", 0, 4, &[], None);
        assert_eq!(horizon(&ep), 16);
    }
}
