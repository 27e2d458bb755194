//! Continuous batching with a per-step token budget and chunked prefill (vLLM v1 style), independent of the
//! model: it decides *which tokens of which sequences* the next forward step computes and keeps the KV block
//! bookkeeping ([`BlockPool`], [`SeqBlocks`]) in step.
//!
//! One step ([`Scheduler::schedule`]):
//! 1. running sequences that are decoding (one uncomputed token) go first, first in queue order;
//! 2. running sequences still in (chunked) prefill take chunks from what is left of the budget;
//! 3. waiting sequences are admitted in queue order while budget and `max_running` allow: the prefix index is
//!    consulted, matched block groups are adopted and their tokens are not computed.
//!
//! Queue order is (priority, arrival): vLLM's priority scheduling, where a lower [`SeqRequest::priority`] is served
//! first and arrival breaks ties. Both queues keep that order: the waiting queue decides who is admitted next, the
//! running list who gets the step's budget first and, from its end, who is preempted. With every priority 0 (the
//! engine refuses others unless priority scheduling is on) it is first come, first served.
//!
//! Admission keeps a growth reserve (SGLang's "new token ratio"): a waiting sequence is admitted only while the
//! blocks the running sequences may still grow into fit next to it. Growth is what each sequence's policy lets it
//! reach: prompt plus expected decode for full cache and SnapKV, at most budget + one block per table for the
//! policies that hold their budget while decoding (the budget itself for PagedEviction, which evicts before a token
//! opens a block past it). Expected decode is the remaining `max_tokens` (clipped) times a
//! ratio that starts at 0.7, decays each step towards 0.1, and rises again to the observed decode fraction when a
//! step has to preempt: so pruned sequences stop being admitted into room they will need a few steps later, and
//! recomputing their prompts (the cost of a preemption) becomes rare.
//!
//! When a running sequence cannot get blocks, the last running sequence in queue order (the youngest of the
//! lowest priority) is preempted by recompute: its blocks are freed (full groups stay in the prefix cache, so
//! resuming is usually cheap) and it goes back to its place in the waiting queue, ahead of everything that came
//! after it at its priority, with prompt + generated tokens; it resumes without losing or duplicating tokens. A
//! request whose worst case cannot fit the pool is refused at [`Scheduler::add`], so the first sequence in queue
//! order always fits on its own and scheduling never deadlocks.
//!
//! With n-gram speculation on ([`SchedulerConfig::speculative`]), a decoding full-cache sequence whose last
//! tokens repeat earlier ones carries a draft ([`crate::speculative`]), and one whose guide forces its next
//! tokens carries those ([`Sequence::set_forced_draft`]): its entry computes the next token and the draft
//! together, and the caller keeps the accepted part with [`Scheduler::settle_draft`], which drops the rest
//! from the tokens and the KV before anything of it is registered in the prefix index.
//!
//! The caller runs the forward step for the returned [`StepPlan`], calls [`Scheduler::complete_step`], then
//! for every entry with `wants_logits` samples a token (settling its draft first) and calls
//! [`Scheduler::append_token`].

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::cache::{BlockId, BlockPool, CacheError, CacheLayout, SeqBlocks, extend_block_hashes};
use crate::model::LoraAdapter;
use crate::policy::{
    AttnDims, CacheView, Eviction, PolicyKind, PolicyKv, PolicySpec, PolicyState, StepProbs, StepView,
};
use crate::speculative::{self, Acceptance, DraftCost, NgramConfig};
use crate::vtc::{self, VirtualTokenCounters};

pub type SeqId = u64;

/// Prompt tokens a step computes with every position's logits (for prompt log-probabilities), over all
/// sequences: those rows reach the host as vocabulary-wide logits, so this bounds the step's logits buffer (128
/// rows of SmolLM2's 49,152 tokens: 25 MB).
pub const PROMPT_LOGITS_STEP_TOKENS: usize = 128;

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// A stop token (eos or a request stop id) was generated.
    Stop,
    /// `max_tokens` or the model context length was reached.
    Length,
    /// The client cancelled (or went away).
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Tokens computed per step, over all sequences.
    pub max_step_tokens: usize,
    /// Sequences running at once.
    pub max_running: usize,
    pub enable_prefix_cache: bool,
    /// The model context length: a sequence never holds more tokens.
    pub max_model_len: usize,
    /// Salts the prefix chain hash.
    pub model_id: String,
    /// Attention shape, for policies that read captured queries.
    pub attn: AttnDims,
    /// The admission growth reserve ([`ReserveConfig::off`] admits greedily).
    pub reserve: ReserveConfig,
    /// N-gram speculative decoding of full-cache sequences ([`NgramConfig::off`] by default).
    pub speculative: NgramConfig,
    /// Whether requests may carry a priority other than 0 ([`Scheduler::add`] refuses them under FCFS).
    pub scheduling: SchedulingPolicy,
}

/// The decode-growth estimate behind admission (SGLang's `new_token_ratio` and its defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReserveConfig {
    /// Fraction of the remaining `max_tokens` a new scheduler expects each sequence to still decode.
    pub init_ratio: f64,
    /// The floor the fraction decays to while no step preempts.
    pub min_ratio: f64,
    /// Decay of the fraction per step.
    pub decay_per_step: f64,
    /// Remaining `max_tokens` beyond this count as this many (a default `max_tokens` is the whole context).
    pub clip_tokens: usize,
}

impl ReserveConfig {
    /// No reserve: admit whatever fits now (vLLM's greedy admission), preempt later.
    pub const fn off() -> ReserveConfig {
        ReserveConfig { init_ratio: 0.0, min_ratio: 0.0, decay_per_step: 0.0, clip_tokens: 0 }
    }

    /// The admission modes by name: `reserve` (the default) or `greedy` ([`ReserveConfig::off`]).
    pub fn from_name(name: &str) -> Option<ReserveConfig> {
        match name {
            "reserve" => Some(ReserveConfig::default()),
            "greedy" => Some(ReserveConfig::off()),
            _ => None,
        }
    }
}

impl Default for ReserveConfig {
    fn default() -> ReserveConfig {
        ReserveConfig { init_ratio: 0.7, min_ratio: 0.1, decay_per_step: (0.7 - 0.1) / 600.0, clip_tokens: 4096 }
    }
}

/// How the engine orders requests (vLLM's `--scheduling-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SchedulingPolicy {
    /// First come, first served: every request has priority 0, and one that names another is refused.
    #[default]
    Fcfs,
    /// By [`SeqRequest::priority`] (lower first), then arrival.
    Priority,
    /// Fair share between tenants: admits next the waiting request whose tenant (its namespace, without a LoRA
    /// adapter's salt) has the fewest sequences running, arrival breaking ties, and preempts the youngest sequence
    /// of the tenant running the most. One tenant's burst then delays another's requests by a share of the batch,
    /// not by the whole burst. Priorities must be 0, as under FCFS.
    Fair,
    /// Fair share of weighted tokens between tenants: the Virtual Token Counter of Sheng et al. (OSDI 2024,
    /// [`crate::vtc`]). Admits next from the waiting tenant that has received the fewest weighted tokens (a prompt
    /// token costs 1, a generated token 2, over the tenant's weight), and preempts the youngest sequence of the
    /// tenant that has received the most. A tenant of long prompts then gets fewer slots than one of short
    /// prompts, where [`SchedulingPolicy::Fair`] gives both the same. Priorities must be 0, as under FCFS.
    Vtc,
}

impl SchedulingPolicy {
    pub const ALL: [SchedulingPolicy; 4] =
        [SchedulingPolicy::Fcfs, SchedulingPolicy::Priority, SchedulingPolicy::Fair, SchedulingPolicy::Vtc];

    /// Its `--scheduling-policy` name.
    pub fn name(self) -> &'static str {
        match self {
            SchedulingPolicy::Fcfs => "fcfs",
            SchedulingPolicy::Priority => "priority",
            SchedulingPolicy::Fair => "fair",
            SchedulingPolicy::Vtc => "vtc",
        }
    }

    /// `fcfs`, `priority`, `fair` or `vtc`.
    pub fn from_name(name: &str) -> Option<SchedulingPolicy> {
        SchedulingPolicy::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// Decode steps SGLang adds per running sequence when it re-estimates the ratio after a preemption.
const RESERVE_RETRACT_STEPS: usize = 20;

impl Default for SchedulerConfig {
    fn default() -> SchedulerConfig {
        SchedulerConfig {
            max_step_tokens: 512,
            max_running: 64,
            enable_prefix_cache: true,
            max_model_len: 8192,
            model_id: String::new(),
            attn: AttnDims { n_layers: 0, n_heads: 0, n_kv_heads: 0, head_dim: 0 },
            reserve: ReserveConfig::default(),
            speculative: NgramConfig::off(),
            scheduling: SchedulingPolicy::Fcfs,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens; the model context length is {max_model_len}")]
    PromptTooLong { prompt: usize, max_model_len: usize },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("the request needs up to {needed} KV blocks but the pool has {capacity}")]
    TooLargeForPool { needed: usize, capacity: usize },
    #[error(
        "priority {0} needs priority scheduling (--scheduling-policy priority); this worker does not order requests by priority"
    )]
    PriorityNotEnabled(i32),
    #[error("unknown sequence {0}")]
    UnknownSeq(SeqId),
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// What to add.
#[derive(Debug, Clone)]
pub struct SeqRequest<P> {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub namespace: String,
    /// Eviction policy and budget ([`PolicySpec::full`] keeps everything).
    pub policy: PolicySpec,
    /// Every prompt position's logits are wanted (prompt log-probabilities): the sequence adopts no cached prefix
    /// (those positions would have no logits), and its prefill chunks share [`PROMPT_LOGITS_STEP_TOKENS`].
    pub prompt_logits: bool,
    /// vLLM's request priority: lower is served first (admitted first, preempted last); ties go by arrival.
    pub priority: i32,
    /// Its tenant's weight under [`SchedulingPolicy::Fair`] (a tenant's share is its running sequences over its
    /// weight) and [`SchedulingPolicy::Vtc`] (the tokens it is charged are divided by it); 0 counts as 1.
    pub tenant_weight: u32,
    /// The LoRA adapter the sequence runs with. Its blocks hash in a namespace the adapter salts (the caller's
    /// `namespace` already is: [`crate::model::lora::cache_namespace`]).
    pub lora: Option<Arc<LoraAdapter>>,
    pub payload: P,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    Waiting,
    Running,
}

/// A request being served: its tokens, its cache, and the caller's payload.
#[derive(Debug)]
pub struct Sequence<P> {
    id: SeqId,
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    stop_token_ids: Vec<u32>,
    namespace: String,
    /// Its tenant, for fair scheduling: an xxh3 of the namespace up to the LoRA salt ([`tenant_of`]).
    tenant: u64,
    /// [`SeqRequest::tenant_weight`], at least 1.
    weight: u32,
    /// Tokens whose K/V are in the cache (= RoPE position of the next token to compute).
    num_computed: usize,
    blocks: SeqBlocks,
    hashes: Vec<u64>,
    /// Prompt tokens served from the prefix cache at first admission.
    cached_tokens: usize,
    /// Prompt tokens a pruned copy onboarded before admission stands for (0: none); see
    /// [`Scheduler::preload_front`].
    preloaded: usize,
    /// Prompt tokens loaded into the device pool from each lower tier for this sequence while it waited to be
    /// admitted, by tier index (the engine's onboarding; the device's entry stays 0): the part of
    /// `cached_tokens` that came from the host and disk tiers.
    onboarded_tokens: [u64; 3],
    admitted: bool,
    preemptions: u32,
    status: SeqStatus,
    policy: PolicyState,
    /// What this sequence's policy evicted over its life (its `evict` trace event).
    evicted: Eviction,
    /// [`SeqRequest::prompt_logits`].
    prompt_logits: bool,
    /// Speculative draft tokens at the end of `tokens`, computed by the current step and not yet verified
    /// ([`Scheduler::settle_draft`]); 0 between steps.
    draft: usize,
    /// How this sequence's drafts fared lately: how long its next draft is.
    acceptance: Acceptance,
    /// Tokens its guide forces next ([`Sequence::set_forced_draft`]); the next draft proposes them.
    forced: Vec<u32>,
    /// [`SeqRequest::priority`].
    priority: i32,
    lora: Option<Arc<LoraAdapter>>,
    pub payload: P,
}

impl<P> Sequence<P> {
    pub fn id(&self) -> SeqId {
        self.id
    }
    /// Prompt followed by generated tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
    pub fn num_computed(&self) -> usize {
        self.num_computed
    }
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }
    /// See the field: tokens onboarded from each lower tier for this sequence (by tier index), at most its cached
    /// tokens in all. Groups onboarded for it and evicted again before an admission that then failed for want of
    /// room are loaded a second time for the next try, and count once.
    pub fn onboarded_tokens(&self) -> [u64; 3] {
        let mut left = self.cached_tokens as u64;
        self.onboarded_tokens.map(|t| {
            let t = t.min(left);
            left -= t;
            t
        })
    }
    /// Chain hashes of the sequence's full groups, as far as they were computed (complete once it finished).
    pub fn hashes(&self) -> &[u64] {
        &self.hashes
    }
    pub fn preemptions(&self) -> u32 {
        self.preemptions
    }
    /// Slots evicted from this sequence's cache and blocks that freed, so far.
    pub fn evicted(&self) -> Eviction {
        self.evicted
    }
    pub fn status(&self) -> SeqStatus {
        self.status
    }
    /// The LoRA adapter the sequence runs with, if any.
    pub fn lora(&self) -> Option<&LoraAdapter> {
        self.lora.as_deref()
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    pub fn blocks(&self) -> &SeqBlocks {
        &self.blocks
    }
    pub fn policy(&self) -> &PolicyState {
        &self.policy
    }
    /// Queries the next step of `n` tokens from `start` must capture for the policy; `sums_in_forward`: whether
    /// the runner sums attention for the policies that read it (otherwise they take the step's queries).
    pub fn capture_for(&self, start: usize, n: usize, sums_in_forward: bool) -> usize {
        self.policy.capture_for(start, n, self.tokens.len(), sums_in_forward)
    }
    /// The power the attention kernel raises the next step's probabilities to as it sums them for the policy;
    /// `None` when the policy takes none.
    pub fn attention_sums(&self) -> Option<u32> {
        self.policy.attention_sums()
    }
    /// The tokens this running sequence's next step entry takes out of `budget`, in the scheduling pass it belongs
    /// to (`decode_pass`: one token left; otherwise a prefill chunk, at most the policy's chunk), before drafts and
    /// the prompt-logits cap. `None` when it has nothing to compute or belongs to the other pass.
    fn step_chunk(&self, decode_pass: bool, budget: usize) -> Option<usize> {
        let remaining = self.tokens.len() - self.num_computed;
        (remaining > 0 && (remaining == 1) == decode_pass)
            .then(|| remaining.min(budget).min(self.policy.spec().max_prefill_chunk()))
    }

    /// Whether a step starting at position `start` computes prompt positions whose logits are wanted (every
    /// position but the prompt's last, whose logits sample the first token as any sequence's do).
    pub fn prompt_logits_from(&self, start: usize) -> bool {
        self.prompt_logits && start + 1 < self.prompt_len
    }
    /// Block tables per (layer, kv-head).
    pub fn tables(&self) -> &[Vec<u32>] {
        self.blocks.tables()
    }
    /// Cache lengths per (layer, kv-head) before the current step.
    pub fn lens(&self) -> &[usize] {
        self.blocks.lens()
    }
    /// Whether `token` ends this sequence (one of its stop token ids).
    pub fn stops_on(&self, token: u32) -> bool {
        self.stop_token_ids.contains(&token)
    }
    /// [`SeqRequest::priority`].
    pub fn priority(&self) -> i32 {
        self.priority
    }
    /// Where this sequence stands in queue order: (priority, arrival), lowest first.
    fn queue_key(&self) -> (i32, SeqId) {
        (self.priority, self.id)
    }
    /// Sets the tokens that the request's guide forces after the sequence's last token
    /// ([`crate::sampling::Sampler::forced_tokens`]): with speculation on, its next draft proposes them rather than
    /// an n-gram lookup's. Appending a token clears them.
    pub fn set_forced_draft(&mut self, tokens: &[u32]) {
        self.forced.clear();
        self.forced.extend_from_slice(tokens);
    }
    /// The unverified speculative draft at the end of [`Sequence::tokens`] (empty between steps).
    pub fn draft(&self) -> &[u32] {
        &self.tokens[self.tokens.len() - self.draft..]
    }
    /// Drops an unverified draft from the tokens (and the computed count): the sequence is as before the step
    /// that proposed it, apart from KV slots past `num_computed`, which the next step overwrites.
    fn discard_draft(&mut self) {
        let keep = self.tokens.len() - self.draft;
        self.tokens.truncate(keep);
        self.num_computed = self.num_computed.min(keep);
        self.draft = 0;
    }
}

/// One sequence's share of a step: compute `tokens[start..start + n]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub seq: SeqId,
    pub start: usize,
    pub n: usize,
    /// The chunk reaches the last token: sample the next one from its logits.
    pub wants_logits: bool,
    /// The chunk's last `draft` tokens are a speculative draft: every position's logits are sampled, and
    /// [`Scheduler::settle_draft`] keeps what the sampler agreed with.
    pub draft: usize,
}

#[derive(Debug, Default, Clone)]
pub struct StepPlan {
    pub seqs: Vec<ScheduledSeq>,
    /// Sequences preempted while planning this step.
    pub preempted: Vec<SeqId>,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.n).sum()
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SchedStats {
    pub running: usize,
    pub waiting: usize,
    pub computed_tokens_total: u64,
    pub cached_tokens_total: u64,
    pub preemptions_total: u64,
    pub steps_total: u64,
    /// Sequences computed by those steps, summed: over `steps_total` it is the mean batch a step computed.
    pub step_seqs_total: u64,
    /// The most sequences running at once since creation, counted after admission (the batch a step computes).
    pub peak_running: usize,
    /// Slots evicted, per policy ([`PolicyKind::index`]).
    pub evicted_slots: [u64; PolicyKind::ALL.len()],
    /// Blocks returned to the pool by evictions, per policy.
    pub evicted_blocks: [u64; PolicyKind::ALL.len()],
    /// Speculative drafts computed, their tokens, and the tokens the sampler accepted.
    pub drafts_total: u64,
    pub draft_tokens_total: u64,
    pub accepted_draft_tokens_total: u64,
}

pub struct Scheduler<P> {
    cfg: SchedulerConfig,
    layout: CacheLayout,
    pool: BlockPool,
    seqs: HashMap<SeqId, Sequence<P>>,
    /// In queue order ([`Sequence::queue_key`]): the front is admitted next.
    waiting: VecDeque<SeqId>,
    /// In queue order too: the front gets the step's budget first, the last is preempted first.
    running: Vec<SeqId>,
    next_id: SeqId,
    stats: SchedStats,
    /// The current decode-growth ratio of [`ReserveConfig`].
    reserve_ratio: f64,
    /// Reused buffer of the n-gram proposer.
    draft_buf: Vec<u32>,
    /// What a draft token costs, from the step times the engine reports ([`Scheduler::observe_step`]).
    draft_cost: DraftCost,
    /// Reused under fair scheduling: running sequences per tenant.
    tenant_running: Vec<(u64, usize)>,
    /// Under fair scheduling, when each tenant last had a sequence admitted (in admissions), at most
    /// [`MAX_TRACKED_TENANTS`]: between tenants running as many sequences, the one served least recently goes first.
    tenant_admitted: Vec<(u64, u64)>,
    admissions: u64,
    /// Under VTC scheduling: the weighted tokens each tenant has received.
    vtc: VirtualTokenCounters,
    /// The waiting sequence [`Scheduler::preload_front`] gave a pruned copy to, until the next scheduling either
    /// admits it or takes the copy back.
    preloaded_seq: Option<SeqId>,
}

/// Most tenants fair scheduling remembers the last admission of; beyond it the least recent is forgotten (and then
/// counts as never served, which only moves it forward).
const MAX_TRACKED_TENANTS: usize = 1024;

impl<P> Scheduler<P> {
    pub fn new(cfg: SchedulerConfig, layout: CacheLayout, num_blocks: usize) -> Scheduler<P> {
        Scheduler {
            layout,
            pool: BlockPool::new(num_blocks),
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 1,
            stats: SchedStats::default(),
            reserve_ratio: cfg.reserve.init_ratio,
            draft_buf: Vec::new(),
            draft_cost: DraftCost::default(),
            tenant_running: Vec::new(),
            tenant_admitted: Vec::new(),
            admissions: 0,
            vtc: VirtualTokenCounters::default(),
            preloaded_seq: None,
            cfg,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }
    pub fn layout(&self) -> CacheLayout {
        self.layout
    }
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
    /// The pool, for the engine's tier traffic (tracking idle groups, registering onboarded ones). Blocks held by
    /// sequences must not be touched through it.
    pub fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }
    pub fn stats(&self) -> SchedStats {
        SchedStats { running: self.running.len(), waiting: self.waiting.len(), ..self.stats }
    }
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }
    pub fn get(&self, id: SeqId) -> Option<&Sequence<P>> {
        self.seqs.get(&id)
    }
    pub fn get_mut(&mut self, id: SeqId) -> Option<&mut Sequence<P>> {
        self.seqs.get_mut(&id)
    }
    pub fn running_ids(&self) -> &[SeqId] {
        &self.running
    }
    pub fn waiting_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.waiting.iter().copied()
    }
    /// Every sequence (waiting or running), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &Sequence<P>> {
        self.seqs.values()
    }

    /// Checks that a request with this prompt length and `max_tokens` can ever run on this pool.
    pub fn check_fits(&self, prompt_len: usize, max_tokens: usize) -> Result<(), SchedError> {
        check_fits(&self.cfg, self.layout, self.pool.num_blocks(), prompt_len, max_tokens)
    }

    /// Queues a request at its place in queue order. Fails cleanly when it could never fit.
    pub fn add(&mut self, req: SeqRequest<P>) -> Result<SeqId, SchedError> {
        self.check_fits(req.prompt.len(), req.max_tokens)?;
        check_priority(&self.cfg, req.priority)?;
        let id = self.next_id;
        self.next_id += 1;
        let seq = Sequence {
            id,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            max_tokens: req.max_tokens,
            stop_token_ids: req.stop_token_ids,
            tenant: tenant_of(&req.namespace),
            weight: req.tenant_weight.max(1),
            namespace: req.namespace,
            num_computed: 0,
            blocks: SeqBlocks::new(self.layout),
            hashes: Vec::new(),
            cached_tokens: 0,
            preloaded: 0,
            onboarded_tokens: [0; 3],
            admitted: false,
            preemptions: 0,
            status: SeqStatus::Waiting,
            policy: PolicyState::new(req.policy, self.cfg.attn, self.layout.block_size),
            evicted: Eviction::default(),
            prompt_logits: req.prompt_logits,
            draft: 0,
            acceptance: Acceptance::default(),
            forced: Vec::new(),
            priority: req.priority,
            lora: req.lora,
            payload: req.payload,
        };
        let tenant = seq.tenant;
        if self.cfg.scheduling == SchedulingPolicy::Vtc {
            self.vtc_arrive(tenant);
        }
        self.seqs.insert(id, seq);
        self.enqueue_waiting(id);
        Ok(id)
    }

    /// Under VTC scheduling, a request of `tenant` arrives: with nothing of the tenant waiting, its counter is
    /// lifted to the smallest counter of the waiting tenants (the paper's counter lift).
    fn vtc_arrive(&mut self, tenant: u64) {
        let mut waiting_min: Option<u64> = None;
        for seq in self.waiting.iter().filter_map(|id| self.seqs.get(id)) {
            if seq.tenant == tenant {
                return;
            }
            let c = self.vtc.counter(seq.tenant);
            waiting_min = Some(waiting_min.map_or(c, |m| m.min(c)));
        }
        let seqs = &self.seqs;
        self.vtc.arrive(tenant, waiting_min, |t| seqs.values().any(|s| s.tenant == t));
    }

    /// Under VTC scheduling, charges sequence `id`'s tenant for `tokens` tokens of cost `cost`.
    fn vtc_charge(&mut self, id: SeqId, tokens: usize, cost: u64) {
        if self.cfg.scheduling != SchedulingPolicy::Vtc {
            return;
        }
        let Some((tenant, weight)) = self.seqs.get(&id).map(|s| (s.tenant, s.weight)) else { return };
        let seqs = &self.seqs;
        self.vtc.charge(tenant, tokens, cost, weight, |t| seqs.values().any(|s| s.tenant == t));
    }

    /// The weighted tokens `tenant` has received under VTC scheduling (0 under other policies).
    pub fn vtc_counter(&self, tenant: u64) -> f64 {
        self.vtc.counter_tokens(tenant)
    }

    /// The queue-order key of a known sequence (an unknown one sorts last).
    fn queue_key(&self, id: SeqId) -> (i32, SeqId) {
        self.seqs.get(&id).map_or((i32::MAX, SeqId::MAX), Sequence::queue_key)
    }

    /// Puts `id` into the waiting queue at its place in queue order.
    fn enqueue_waiting(&mut self, id: SeqId) {
        let key = self.queue_key(id);
        let at = self.waiting.partition_point(|&w| self.queue_key(w) < key);
        self.waiting.insert(at, id);
    }

    /// Puts `id` into the running list at its place in queue order.
    fn enqueue_running(&mut self, id: SeqId) {
        let key = self.queue_key(id);
        let at = self.running.partition_point(|&r| self.queue_key(r) < key);
        self.running.insert(at, id);
    }

    /// Plans the next step. An empty plan means there is nothing to do.
    pub fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        self.schedule_into(&mut plan);
        plan
    }

    /// [`Scheduler::schedule`] into a reused plan (no allocation once its vectors have grown).
    pub fn schedule_into(&mut self, plan: &mut StepPlan) {
        plan.seqs.clear();
        plan.preempted.clear();
        let mut budget = self.cfg.max_step_tokens.max(1);
        let mut logits_budget = PROMPT_LOGITS_STEP_TOKENS;
        let r = self.cfg.reserve;
        self.reserve_ratio = (self.reserve_ratio - r.decay_per_step).max(r.min_ratio);

        // 1. decodes, 2. prefill chunks of running sequences.
        for decode_pass in [true, false] {
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let id = self.running[i];
                let Some(seq) = self.seqs.get(&id) else {
                    self.running.remove(i);
                    continue;
                };
                let Some(mut n) =
                    seq.step_chunk(decode_pass, budget).filter(|_| !plan.seqs.iter().any(|s| s.seq == id))
                else {
                    i += 1;
                    continue;
                };
                let prompt_logits = seq.prompt_logits_from(seq.num_computed);
                if prompt_logits {
                    n = n.min(logits_budget);
                    if n == 0 {
                        i += 1;
                        continue;
                    }
                }
                let draft = if decode_pass { self.propose_draft(id, budget - n) } else { 0 };
                // Fair and VTC scheduling may preempt a sequence ahead of `id`: `i` follows `id` down the list.
                if self.reserve_or_preempt(id, n + draft, plan, &mut budget, &mut i) {
                    if prompt_logits {
                        logits_budget -= n;
                    }
                    i += 1;
                    let Some(seq) = self.seqs.get_mut(&id) else { continue };
                    seq.tokens.extend_from_slice(&self.draft_buf[..draft]);
                    seq.draft = draft;
                    let n = n + draft;
                    plan.seqs.push(ScheduledSeq {
                        seq: id,
                        start: seq.num_computed,
                        n,
                        wants_logits: seq.num_computed + n == seq.tokens.len(),
                        draft,
                    });
                    budget -= n;
                }
                // Otherwise `id` preempted itself and left `running`; index i now names the one after it.
            }
        }

        if !plan.preempted.is_empty() {
            self.raise_reserve_ratio();
        }

        // 3. admit waiting sequences (not in a step that had to preempt).
        while plan.preempted.is_empty() && budget > 0 && self.running.len() < self.cfg.max_running.max(1) {
            self.promote_fair_front();
            let Some(&id) = self.waiting.front() else { break };
            // Such a sequence adopts no prefix, so its first chunk starts at 0.
            let prompt_logits = self.seqs.get(&id).is_some_and(|s| s.prompt_logits_from(0));
            let chunk_budget = if prompt_logits { budget.min(logits_budget) } else { budget };
            if chunk_budget == 0 {
                break;
            }
            let Some(n) = self.try_admit(id, chunk_budget) else { break };
            if prompt_logits {
                logits_budget -= n;
            }
            self.waiting.pop_front();
            self.note_admitted(id);
            self.enqueue_running(id);
            let seq = &self.seqs[&id];
            plan.seqs.push(ScheduledSeq {
                seq: id,
                start: seq.num_computed,
                n,
                wants_logits: seq.num_computed + n == seq.tokens.len(),
                draft: 0,
            });
            budget -= n;
        }
        self.drop_unadmitted_preload();
        self.stats.peak_running = self.stats.peak_running.max(self.running.len());
    }

    /// Takes back a pruned copy [`Scheduler::preload_front`] gave a sequence this scheduling did not admit (a
    /// preemption closed admission, the budget ran out, or another sequence went first): admission accounting
    /// counts only running sequences' blocks, so private blocks held while waiting could leave the front of the
    /// queue unable to fit and scheduling stuck. The engine onboards the copy again before a later admission.
    fn drop_unadmitted_preload(&mut self) {
        let Some(id) = self.preloaded_seq.take() else { return };
        let Some(seq) = self.seqs.get_mut(&id) else { return };
        // Admission takes `preloaded`; a sequence still marked was not admitted and holds only the copy.
        if seq.preloaded == 0 || seq.status != SeqStatus::Waiting {
            return;
        }
        seq.preloaded = 0;
        seq.num_computed = 0;
        if let Err(e) = seq.blocks.free(&mut self.pool) {
            tracing::error!(seq = id, error = %e, "releasing a preloaded copy failed");
        }
    }

    /// Proposes a speculative draft for decoding sequence `id` into `draft_buf` and returns its length (0: none).
    /// Its length is the one that pays for itself ([`speculative::draft_length`]) given how the sequence's drafts
    /// fared lately and what a draft token costs ([`Scheduler::draft_token_cost`]). Only full-cache sequences
    /// speculate (a policy's hooks would evict from slots a rejected draft leaves behind), only while at most
    /// [`NgramConfig::max_batch`] sequences run, and only into room the step budget (`budget`), `max_tokens`, the
    /// context and the pool's available blocks have: a draft never preempts.
    fn propose_draft(&mut self, id: SeqId, budget: usize) -> usize {
        let spec = self.cfg.speculative;
        if !self.drafting() {
            return 0;
        }
        let cost = self.draft_token_cost();
        let Some(seq) = self.seqs.get_mut(&id) else { return 0 };
        if !seq.policy.is_full() || seq.tokens.len() < seq.prompt_len + 1 {
            return 0;
        }
        // Accepting `k` drafts and sampling one more token must stay within max_tokens and the context.
        let room = seq
            .max_tokens
            .saturating_sub(seq.num_generated() + 1)
            .min(self.cfg.max_model_len.saturating_sub(seq.tokens.len() + 1));
        let cap = spec.num_tokens.min(room).min(budget);
        // What the guide forces is drafted whole: it is the text unless the model splits it into other tokens.
        if !seq.forced.is_empty() {
            let k = seq.forced.len().min(cap);
            if k == 0 || seq.blocks.blocks_needed(1 + k) > self.pool.num_available() {
                return 0;
            }
            self.draft_buf.clear();
            self.draft_buf.extend_from_slice(&seq.forced[..k]);
            return k;
        }
        let k = speculative::draft_length(seq.acceptance.rate(), cost, cap);
        if k == 0 {
            if cap > 0 {
                seq.acceptance.idle();
            }
            return 0;
        }
        let k = speculative::propose(&seq.tokens, &spec, k, &mut self.draft_buf);
        if k == 0 || seq.blocks.blocks_needed(1 + k) > self.pool.num_available() {
            return 0;
        }
        k
    }

    /// Whether sequences draft at all now: speculation is on and at most [`NgramConfig::max_batch`] run.
    pub fn drafting(&self) -> bool {
        self.cfg.speculative.enabled() && self.running.len() <= self.cfg.speculative.max_batch
    }

    /// Records how long a step over `plan` took, for the cost of a draft token: one-sequence decode steps with and
    /// without a draft are compared (other steps say nothing about it).
    pub fn observe_step(&mut self, plan: &StepPlan, seconds: f64) {
        if let [e] = plan.seqs.as_slice()
            && e.wants_logits
            && e.n == e.draft + 1
            && self.seqs.get(&e.seq).is_some_and(|s| e.start >= s.prompt_len)
        {
            self.draft_cost.observe(e.draft, seconds);
        }
    }

    /// The cost of a draft token in single-token steps that drafting uses: the configured one, else the estimate.
    pub fn draft_token_cost(&self) -> f64 {
        self.cfg.speculative.draft_cost.unwrap_or(self.draft_cost.per_token())
    }

    /// Keeps the first `accepted` tokens of sequence `id`'s draft (those the sampler picked itself) and drops the
    /// rest from its tokens and KV, then publishes its newly full groups. After the step that computed the
    /// draft; the caller then appends the sampler's token after the accepted ones. Counts the draft.
    pub fn settle_draft(&mut self, id: SeqId, accepted: usize) -> Result<(), SchedError> {
        let seq = self.seqs.get_mut(&id).ok_or(SchedError::UnknownSeq(id))?;
        let draft = seq.draft;
        if draft == 0 {
            return Ok(());
        }
        let accepted = accepted.min(draft);
        let rejected = draft - accepted;
        let computed_before = seq.num_computed;
        seq.tokens.truncate(seq.tokens.len() - rejected);
        seq.draft = 0;
        seq.num_computed = seq.num_computed.min(seq.tokens.len());
        if let Err(e) = seq.blocks.drop_tail(&mut self.pool, computed_before - seq.num_computed) {
            tracing::error!(seq = id, error = %e, "dropping a rejected draft's KV failed");
        }
        Self::publish_verified_groups(&self.cfg, &mut self.pool, seq);
        seq.acceptance.record(accepted, draft);
        self.stats.draft_tokens_total += draft as u64;
        self.stats.drafts_total += 1;
        self.stats.accepted_draft_tokens_total += accepted as u64;
        self.vtc_charge(id, accepted, vtc::W_OUTPUT);
        Ok(())
    }

    /// Reserves room for `n` tokens of running sequence `id`, preempting running sequences from the end of queue
    /// order (the youngest of the lowest priority) while blocks are short. Returns false when `id` itself had to be
    /// preempted. `at` is `id`'s index in `running` and stays so as victims ahead of it leave.
    fn reserve_or_preempt(
        &mut self,
        id: SeqId,
        n: usize,
        plan: &mut StepPlan,
        budget: &mut usize,
        at: &mut usize,
    ) -> bool {
        loop {
            let Some(seq) = self.seqs.get_mut(&id) else { return false };
            match seq.blocks.reserve(&mut self.pool, n) {
                Ok(()) => return true,
                Err(_) => {
                    let Some(victim) = self.preemption_victim() else { return false };
                    if let Some(pos) = plan.seqs.iter().position(|s| s.seq == victim) {
                        *budget += plan.seqs[pos].n;
                        plan.seqs.remove(pos);
                    }
                    if self.running.iter().position(|&r| r == victim).is_some_and(|v| v < *at) {
                        *at -= 1;
                    }
                    self.preempt(victim);
                    plan.preempted.push(victim);
                    if victim == id {
                        return false;
                    }
                }
            }
        }
    }

    /// After a preemption: the decode fraction the running sequences actually show (plus SGLang's allowance of a
    /// few more steps each), if that is above the current estimate.
    fn raise_reserve_ratio(&mut self) {
        let clip = self.cfg.reserve.clip_tokens;
        if clip == 0 {
            return;
        }
        let (mut decoded, mut allowed) = (0usize, 0usize);
        for seq in self.running.iter().filter_map(|id| self.seqs.get(id)) {
            decoded += seq.num_generated().min(clip) + RESERVE_RETRACT_STEPS;
            allowed += seq.max_tokens.min(clip);
        }
        if allowed > 0 {
            self.reserve_ratio = self.reserve_ratio.max((decoded as f64 / allowed as f64).min(1.0));
        }
    }

    /// The blocks `seq` is expected to hold at its peak: `(near, last)`. `near` covers the next few steps (the
    /// whole prompt before a one-shot policy prunes it, else one more block per table), `last` the rest of its
    /// life under its policy and the current decode estimate.
    fn peak_blocks(&self, seq: &Sequence<P>) -> (usize, usize) {
        let layout = self.layout;
        let bs = layout.block_size;
        let clip = self.cfg.reserve.clip_tokens;
        let decode_left = seq.max_tokens.saturating_sub(seq.num_generated()).min(clip);
        let expected_decode = (decode_left as f64 * self.reserve_ratio).ceil() as usize;
        let held = seq.blocks.num_blocks();
        let now = seq.blocks.lens().iter().copied().max().unwrap_or(0);
        let uncomputed = seq.tokens.len() - seq.num_computed.min(seq.tokens.len());
        let prefilling = seq.num_computed < seq.prompt_len;
        let grown = now + uncomputed + expected_decode;
        let spec = seq.policy.spec();
        let c = spec.budget_tokens;
        // The most a budget-holding policy's sequence holds while decoding: PagedEviction evicts a block before a
        // token opens a new one past the budget (two blocks at least); the per-token policies write the token
        // first and then evict, one slot past the budget.
        let held_most = if spec.kind == PolicyKind::PagedEviction { c.max(2 * bs) } else { c + bs };
        let (transient, last) = match spec.kind {
            PolicyKind::Full => (now + uncomputed, grown),
            // SnapKV compresses the prompt once; decoded tokens then accumulate.
            PolicyKind::Snapkv if prefilling => (seq.prompt_len, seq.prompt_len.min(c) + expected_decode),
            PolicyKind::Snapkv => (now + uncomputed, grown),
            // The rest hold the budget while decoding (KV-Compress by compressing under pressure). Until the
            // prompt is in, KeyDiff holds budget + one prompt block and the one-shot policies the whole prompt.
            PolicyKind::Keydiff if prefilling => {
                ((c + spec.max_prefill_chunk()).min(seq.prompt_len), grown.min(held_most))
            }
            _ if prefilling => (seq.prompt_len, grown.min(held_most)),
            _ => (now + uncomputed, grown.min(held_most)),
        };
        let last = layout.blocks_for_tokens(last);
        let near = if prefilling {
            layout.blocks_for_tokens(transient).max(held)
        } else {
            (held + layout.group_size()).min(last.max(held))
        };
        (near, last)
    }

    /// Whether admitting `cand` keeps every running sequence's expected peak, and its own, within the blocks they
    /// hold plus what the pool has left, both over the next few steps and over their whole lives.
    fn reserve_admits(&self, cand: &Sequence<P>) -> bool {
        let (mut near, mut last, mut held) = (0, 0, 0);
        for seq in self.running.iter().filter_map(|id| self.seqs.get(id)).chain(std::iter::once(cand)) {
            let (n, l) = self.peak_blocks(seq);
            near += n;
            last += l;
            held += seq.blocks.num_blocks();
        }
        let room = held + self.pool.num_available();
        near <= room && last <= room
    }

    /// Counts the running sequences per tenant into `tenant_running`.
    fn count_tenants(&mut self) {
        self.tenant_running.clear();
        for seq in self.running.iter().filter_map(|id| self.seqs.get(id)) {
            match self.tenant_running.iter_mut().find(|(t, _)| *t == seq.tenant) {
                Some((_, n)) => *n += 1,
                None => self.tenant_running.push((seq.tenant, 1)),
            }
        }
    }

    fn running_of(&self, tenant: u64) -> usize {
        self.tenant_running.iter().find(|(t, _)| *t == tenant).map_or(0, |(_, n)| *n)
    }

    /// Under fair scheduling, records that `id`'s tenant had a sequence admitted now. Under VTC scheduling, charges
    /// its prompt on its first admission (a preempted sequence's recompute is the engine's cost, not the tenant's),
    /// and notes when its tenant has nothing left waiting.
    fn note_admitted(&mut self, id: SeqId) {
        if self.cfg.scheduling == SchedulingPolicy::Vtc {
            let Some((tenant, prompt_len, preemptions)) =
                self.seqs.get(&id).map(|s| (s.tenant, s.prompt_len, s.preemptions))
            else {
                return;
            };
            if preemptions == 0 {
                self.vtc_charge(id, prompt_len, vtc::W_PROMPT);
            }
            if !self.waiting.iter().any(|w| self.seqs.get(w).is_some_and(|s| s.tenant == tenant)) {
                self.vtc.left_queue(tenant);
            }
            return;
        }
        if self.cfg.scheduling != SchedulingPolicy::Fair {
            return;
        }
        let Some(tenant) = self.seqs.get(&id).map(|s| s.tenant) else { return };
        self.admissions += 1;
        match self.tenant_admitted.iter_mut().find(|(t, _)| *t == tenant) {
            Some((_, at)) => *at = self.admissions,
            None => {
                if self.tenant_admitted.len() >= MAX_TRACKED_TENANTS
                    && let Some(oldest) = (0..self.tenant_admitted.len()).min_by_key(|&i| self.tenant_admitted[i].1)
                {
                    self.tenant_admitted.swap_remove(oldest);
                }
                self.tenant_admitted.push((tenant, self.admissions));
            }
        }
    }

    /// Under fair scheduling, moves to the front of the waiting queue the sequence whose tenant runs the fewest
    /// sequences, between those the tenant admitted least recently, then the earliest arrival; under VTC
    /// scheduling, the earliest sequence of the tenant with the smallest counter. The rest keep their order. A
    /// no-op otherwise.
    fn promote_fair_front(&mut self) {
        let vtc = match self.cfg.scheduling {
            SchedulingPolicy::Fair => false,
            SchedulingPolicy::Vtc => true,
            SchedulingPolicy::Fcfs | SchedulingPolicy::Priority => return,
        };
        if self.waiting.len() < 2 {
            return;
        }
        if !vtc {
            self.count_tenants();
        }
        let last_admitted =
            |tenant: u64| self.tenant_admitted.iter().find(|(t, _)| *t == tenant).map_or(0, |(_, at)| *at);
        let mut best: Option<(usize, (u64, u64))> = None;
        for (i, id) in self.waiting.iter().enumerate() {
            let Some(seq) = self.seqs.get(id) else { continue };
            let key = if vtc {
                (self.vtc.counter(seq.tenant), 0)
            } else {
                (share(self.running_of(seq.tenant), seq.weight), last_admitted(seq.tenant))
            };
            if best.is_none_or(|(_, b)| key < b) {
                best = Some((i, key));
            }
        }
        if let Some((i, _)) = best.filter(|&(i, _)| i > 0)
            && let Some(id) = self.waiting.remove(i)
        {
            self.waiting.push_front(id);
        }
    }

    /// The running sequence to preempt when blocks are short: the last in queue order (the youngest of the
    /// lowest priority), under fair scheduling the youngest of the tenant running the most, and under VTC
    /// scheduling the youngest of the tenant that has received the most.
    fn preemption_victim(&mut self) -> Option<SeqId> {
        match self.cfg.scheduling {
            SchedulingPolicy::Fcfs | SchedulingPolicy::Priority => return self.running.last().copied(),
            SchedulingPolicy::Vtc => {
                let counter_of = |id: &SeqId| self.seqs.get(id).map_or(0, |s| self.vtc.counter(s.tenant));
                let most = self.running.iter().map(counter_of).max()?;
                return self.running.iter().rev().find(|id| counter_of(id) == most).copied();
            }
            SchedulingPolicy::Fair => {}
        }
        self.count_tenants();
        let share_of = |id: &SeqId| self.seqs.get(id).map_or(0, |s| share(self.running_of(s.tenant), s.weight));
        let most = self.running.iter().map(share_of).max()?;
        self.running.iter().rev().find(|id| share_of(id) == most).copied()
    }

    /// Frees a running sequence's blocks and puts it back into the waiting queue at its place in queue order: ahead
    /// of every sequence that arrived after it at its priority.
    fn preempt(&mut self, id: SeqId) {
        self.running.retain(|&r| r != id);
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.discard_draft();
            Self::release_blocks(&self.cfg, &mut self.pool, seq);
            seq.num_computed = 0;
            seq.policy.reset();
            seq.preemptions += 1;
            seq.status = SeqStatus::Waiting;
            self.stats.preemptions_total += 1;
        }
        self.enqueue_waiting(id);
    }

    /// For the waiting sequence next in line for admission: the chain hashes of its prompt groups up to what
    /// admission could adopt (the same cap as [`Scheduler::try_admit`]), into `out`, and how many leading ones are
    /// device-resident. `None` (and `out` empty) when nothing is waiting, admission is closed this step, or the
    /// prefix cache is off. The engine onboards lower-tier groups for the rest before scheduling.
    pub fn next_admission_prefix(&mut self, out: &mut Vec<u64>) -> Option<usize> {
        out.clear();
        if !self.cfg.enable_prefix_cache || self.running.len() >= self.cfg.max_running.max(1) {
            return None;
        }
        self.promote_fair_front();
        let id = *self.waiting.front()?;
        let seq = self.seqs.get_mut(&id)?;
        if seq.preloaded > 0 || seq.prompt_logits {
            return None;
        }
        let bs = self.layout.block_size;
        extend_block_hashes(&self.cfg.model_id, &seq.namespace, &seq.tokens, bs, &mut seq.hashes);
        let len = seq.tokens.len();
        let tail = seq.policy.spec().min_computed_tail(len).clamp(1, len);
        let max_groups = ((len - tail) / bs).min(seq.hashes.len());
        out.extend_from_slice(&seq.hashes[..max_groups]);
        Some(self.pool.index().match_len(out))
    }

    /// Credits `tokens` loaded from the lower tier of index `tier` to the sequence next in line for admission: the
    /// one whose prefix [`Scheduler::next_admission_prefix`] named, which the loaded groups continue.
    pub fn credit_front_onboarded(&mut self, tier: usize, tokens: usize) {
        if let Some(seq) = self.waiting.front().and_then(|id| self.seqs.get_mut(id))
            && let Some(t) = seq.onboarded_tokens.get_mut(tier)
        {
            *t += tokens as u64;
        }
    }

    /// The step budget (tokens) the next scheduling leaves for admission once the running sequences have taken
    /// their decodes and prefill chunks, as [`Scheduler::schedule_into`] plans them before drafts. An upper bound:
    /// drafts and a step's prompt-logits cap can only leave less. Zero means the next scheduling admits nothing, so
    /// work done for an admission now (decoding a pruned copy for the front of the queue) would be thrown away.
    pub fn admission_budget_left(&self) -> usize {
        let mut budget = self.cfg.max_step_tokens.max(1);
        for decode_pass in [true, false] {
            for seq in self.running.iter().filter_map(|id| self.seqs.get(id)) {
                budget -= seq.step_chunk(decode_pass, budget).unwrap_or(0);
                if budget == 0 {
                    return 0;
                }
            }
        }
        budget
    }

    /// For a pruned copy of the next admission's prompt up to token `covered` ([`Scheduler::preload_front`]), with
    /// `budget` the step budget left for admission ([`Scheduler::admission_budget_left`]): the fewest device blocks
    /// its first chunk needs beside the copy (the copy's last blocks may have room for a slot per table), or `None`
    /// when the next scheduling cannot admit it at all (no budget, or nothing left of the prompt to compute). The
    /// caller decodes a copy only where it can be admitted: one the step does not admit goes back to the pool, and
    /// decoding it again every step while a long prefill holds the budget wastes the tier's bandwidth.
    pub fn preload_chunk_blocks(&self, covered: usize, budget: usize) -> Option<usize> {
        let seq = self.seqs.get(self.waiting.front()?)?;
        let chunk = seq
            .tokens
            .len()
            .checked_sub(covered)
            .filter(|&n| n > 0)?
            .min(budget)
            .min(seq.policy.spec().max_prefill_chunk());
        (chunk > 0).then(|| (chunk - 1) / self.layout.block_size * self.layout.group_size())
    }

    /// Gives the waiting sequence next in line (the one [`Scheduler::next_admission_prefix`] named) a pruned copy
    /// of its prompt up to token `covered`: it adopts the device-resident groups `prefix`, then owns `packed`
    /// (blocks the caller allocated and filled, group-major, `kept` slots per table) after them. Admission then
    /// starts it at `covered` over those slots: a pruned cache, never registered. Full-cache policy only (an
    /// eviction policy's state is built from the tokens it computed). Returns false, taking nothing, when the
    /// sequence cannot take it; the caller then releases `packed`. The copy lasts until the next scheduling: a
    /// sequence it does not admit gives the blocks back.
    pub fn preload_front(&mut self, prefix: &[u64], packed: &[BlockId], kept: usize, covered: usize) -> bool {
        self.drop_unadmitted_preload();
        let Some(&id) = self.waiting.front() else { return false };
        let Some(seq) = self.seqs.get_mut(&id) else { return false };
        if !seq.blocks.is_empty() || !seq.policy.is_full() || seq.prompt_logits || covered >= seq.tokens.len() {
            return false;
        }
        if seq.blocks.adopt(&mut self.pool, prefix).ok() != Some(prefix.len()) {
            let _ = seq.blocks.free(&mut self.pool);
            return false;
        }
        seq.blocks.append_pruned(packed, kept);
        seq.preloaded = covered;
        self.preloaded_seq = Some(id);
        true
    }

    /// Prefix lookup + first chunk reservation for waiting sequence `id`. Returns the chunk length, or None
    /// (with nothing held) when the pool cannot take it now.
    fn try_admit(&mut self, id: SeqId, budget: usize) -> Option<usize> {
        let seq = self.seqs.get_mut(&id)?;
        debug_assert!(seq.blocks.is_empty() || seq.preloaded > 0);
        let bs = self.layout.block_size;
        let mut matched_tokens = 0;
        if seq.preloaded > 0 {
            matched_tokens = std::mem::take(&mut seq.preloaded);
        } else if self.cfg.enable_prefix_cache && !seq.prompt_logits {
            extend_block_hashes(&self.cfg.model_id, &seq.namespace, &seq.tokens, bs, &mut seq.hashes);
            // Leave at least one token to compute (its logits give the next token), more when the policy
            // observes the queries of the prompt's tail.
            let len = seq.tokens.len();
            let tail = seq.policy.spec().min_computed_tail(len).clamp(1, len);
            let max_groups = ((len - tail) / bs).min(seq.hashes.len());
            let matched = seq.blocks.adopt(&mut self.pool, &seq.hashes[..max_groups]).ok()?;
            matched_tokens = matched * bs;
        }
        if !seq.policy.is_full() {
            // Its blocks will be pruned: never publish them as a full prefix.
            seq.blocks.mark_pruned();
        }
        seq.num_computed = matched_tokens;
        let n = (seq.tokens.len() - matched_tokens).min(budget).min(seq.policy.spec().max_prefill_chunk());
        let fits_reserve = self.reserve_ratio <= 0.0 || self.running.is_empty() || self.reserve_admits(&self.seqs[&id]);
        let seq = self.seqs.get_mut(&id)?;
        if !fits_reserve || seq.blocks.reserve(&mut self.pool, n).is_err() {
            // Keep its cached prefix evictable by others; it will match again when it fits. A pruned copy from
            // `preload_front` goes back to the pool as well (private blocks held while waiting could starve the
            // running sequences); the engine onboards it again before a later admission.
            let _ = seq.blocks.free(&mut self.pool);
            seq.num_computed = 0;
            return None;
        }
        if !seq.admitted {
            seq.admitted = true;
            seq.cached_tokens = matched_tokens;
        }
        seq.status = SeqStatus::Running;
        self.stats.cached_tokens_total += matched_tokens as u64;
        Some(n)
    }

    /// Records that the plan's tokens were computed: advances cache lengths and publishes newly full groups.
    pub fn complete_step(&mut self, plan: &StepPlan) {
        self.stats.steps_total += 1;
        self.stats.step_seqs_total += plan.seqs.len() as u64;
        for s in &plan.seqs {
            let Some(seq) = self.seqs.get_mut(&s.seq) else { continue };
            if seq.num_computed != s.start {
                continue;
            }
            seq.num_computed += s.n;
            seq.blocks.advance(s.n);
            self.stats.computed_tokens_total += s.n as u64;
            Self::publish_verified_groups(&self.cfg, &mut self.pool, seq);
        }
    }

    /// Runs sequence `id`'s eviction hooks for its part of the step just completed (after
    /// [`Scheduler::complete_step`]); `captured_q` and `probs` hold the queries and attention probabilities the
    /// step captured for it.
    pub fn apply_policy(
        &mut self,
        id: SeqId,
        start: usize,
        n: usize,
        captured_q: &[f32],
        probs: Option<StepProbs<'_>>,
        kv: &mut dyn PolicyKv,
    ) -> Result<Eviction, CacheError> {
        let Some(seq) = self.seqs.get_mut(&id) else { return Ok(Eviction::default()) };
        if seq.policy.is_full() || seq.num_computed != start + n {
            return Ok(Eviction::default());
        }
        let step = StepView { start, n, total: seq.tokens.len(), captured_q, probs };
        let mut cache = CacheView { blocks: &mut seq.blocks, pool: &mut self.pool, kv };
        let ev = seq.policy.on_step(&mut cache, step)?;
        seq.evicted.slots += ev.slots;
        seq.evicted.blocks += ev.blocks;
        let k = seq.policy.spec().kind.index();
        self.stats.evicted_slots[k] += ev.slots;
        self.stats.evicted_blocks[k] += ev.blocks;
        Ok(ev)
    }

    /// KV-Compress under memory pressure (the paper's "compress when we would otherwise preempt"): when fewer
    /// than `needed` blocks are available, compresses running KV-Compress sequences that grew past their budget
    /// back to it, in queue order. Returns what was freed.
    pub fn relieve_pressure(&mut self, needed: usize, kv: &mut dyn PolicyKv) -> Eviction {
        let mut total = Eviction::default();
        for i in 0..self.running.len() {
            if self.pool.num_available() >= needed {
                break;
            }
            let id = self.running[i];
            let Some(seq) = self.seqs.get_mut(&id) else { continue };
            if seq.policy.spec().kind != PolicyKind::KvCompress || seq.num_computed < seq.tokens.len().saturating_sub(1)
            {
                continue;
            }
            let target = seq.policy.budget_blocks(&seq.blocks);
            let mut cache = CacheView { blocks: &mut seq.blocks, pool: &mut self.pool, kv };
            match seq.policy.compress_to(&mut cache, target) {
                Ok(ev) => {
                    seq.evicted.slots += ev.slots;
                    seq.evicted.blocks += ev.blocks;
                    let k = PolicyKind::KvCompress.index();
                    self.stats.evicted_slots[k] += ev.slots;
                    self.stats.evicted_blocks[k] += ev.blocks;
                    total.slots += ev.slots;
                    total.blocks += ev.blocks;
                }
                Err(e) => tracing::warn!(seq = id, error = %e, "KV-Compress under pressure failed"),
            }
        }
        total
    }

    /// Appends a sampled token and reports whether the sequence is now finished. The caller then calls
    /// [`Scheduler::finish`] for a finished sequence.
    pub fn append_token(&mut self, id: SeqId, token: u32) -> Result<Option<FinishReason>, SchedError> {
        self.vtc_charge(id, 1, vtc::W_OUTPUT);
        let seq = self.seqs.get_mut(&id).ok_or(SchedError::UnknownSeq(id))?;
        seq.tokens.push(token);
        seq.forced.clear();
        if seq.stop_token_ids.contains(&token) {
            return Ok(Some(FinishReason::Stop));
        }
        if seq.num_generated() >= seq.max_tokens || seq.tokens.len() >= self.cfg.max_model_len {
            return Ok(Some(FinishReason::Length));
        }
        Ok(None)
    }

    /// Removes a sequence (finished, cancelled or failed), publishing its full groups and freeing its blocks.
    pub fn finish(&mut self, id: SeqId) -> Option<Sequence<P>> {
        let mut seq = self.seqs.remove(&id)?;
        seq.discard_draft();
        match seq.status {
            SeqStatus::Running => self.running.retain(|&r| r != id),
            SeqStatus::Waiting => self.waiting.retain(|&w| w != id),
        }
        Self::release_blocks(&self.cfg, &mut self.pool, &mut seq);
        Some(seq)
    }

    /// Cancels a sequence wherever it is. Same as [`Scheduler::finish`].
    pub fn cancel(&mut self, id: SeqId) -> Option<Sequence<P>> {
        self.finish(id)
    }

    /// With the prefix cache on, hashes the computed tokens short of an unverified draft and registers the full
    /// groups they fill: a draft reaches the index only once [`Scheduler::settle_draft`] kept it.
    fn publish_verified_groups(cfg: &SchedulerConfig, pool: &mut BlockPool, seq: &mut Sequence<P>) {
        if !cfg.enable_prefix_cache {
            return;
        }
        let verified = seq.num_computed.min(seq.tokens.len() - seq.draft);
        let bs = seq.blocks.layout().block_size;
        extend_block_hashes(&cfg.model_id, &seq.namespace, &seq.tokens[..verified], bs, &mut seq.hashes);
        seq.blocks.register_full(pool, &seq.hashes);
    }

    fn release_blocks(cfg: &SchedulerConfig, pool: &mut BlockPool, seq: &mut Sequence<P>) {
        Self::publish_verified_groups(cfg, pool, seq);
        // Releasing blocks the sequence holds cannot fail; an error would be a bookkeeping bug.
        if let Err(e) = seq.blocks.free(pool) {
            tracing::error!(seq = seq.id, error = %e, "releasing KV blocks failed");
        }
    }
}

/// Whether a request may carry `priority`: any under priority scheduling, only 0 under FCFS (as vLLM refuses it)
/// and under fair scheduling.
pub fn check_priority(cfg: &SchedulerConfig, priority: i32) -> Result<(), SchedError> {
    if priority != 0 && cfg.scheduling != SchedulingPolicy::Priority {
        return Err(SchedError::PriorityNotEnabled(priority));
    }
    Ok(())
}

/// A tenant's share of the batch under fair scheduling: its running sequences over its weight, in fixed point so
/// that shares compare exactly.
fn share(running: usize, weight: u32) -> u64 {
    (running as u64) * (1 << 20) / u64::from(weight.max(1))
}

/// The tenant a namespace belongs to, as fair scheduling counts it: the namespace up to the separator a LoRA
/// adapter's salt starts with ([`crate::model::lora::cache_namespace`]), so a tenant's adapters share its share.
pub fn tenant_of(namespace: &str) -> u64 {
    let tenant = namespace.split('\u{0}').next().unwrap_or(namespace);
    xxhash_rust::xxh3::xxh3_64(tenant.as_bytes())
}

/// Whether a request can ever run: prompt within the context, and its worst-case KV (prompt + max_tokens, capped
/// at the context length) within the pool.
pub fn check_fits(
    cfg: &SchedulerConfig,
    layout: CacheLayout,
    num_blocks: usize,
    prompt_len: usize,
    max_tokens: usize,
) -> Result<(), SchedError> {
    if prompt_len == 0 {
        return Err(SchedError::EmptyPrompt);
    }
    if max_tokens == 0 {
        return Err(SchedError::ZeroMaxTokens);
    }
    if prompt_len >= cfg.max_model_len {
        return Err(SchedError::PromptTooLong { prompt: prompt_len, max_model_len: cfg.max_model_len });
    }
    let worst = prompt_len.saturating_add(max_tokens).min(cfg.max_model_len);
    let needed = layout.blocks_for_tokens(worst);
    if needed > num_blocks {
        return Err(SchedError::TooLargeForPool { needed, capacity: num_blocks });
    }
    Ok(())
}
