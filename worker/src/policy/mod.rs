//! KV-cache eviction policies (DESIGN §4): which slots of a sequence's head-paged cache to drop, and when.
//!
//! - [`spec`]: the policies, their names and the papers' defaults ([`PolicyKind`], [`PolicySpec`]).
//! - [`PolicyState`]: one sequence's policy state — the position of every slot, accumulated attention metrics,
//!   the observation window of queries — and the hooks the engine calls after each forward step:
//!   [`PolicyState::after_prefill_chunk`], [`PolicyState::after_prefill`], [`PolicyState::after_decode_step`]
//!   and [`PolicyState::at_block_boundary`] (all reached through [`PolicyState::on_step`]), plus
//!   [`PolicyState::compress_to`] for KV-Compress under memory pressure.
//!
//! A policy answers with the slots to keep (or drop) per (layer, kv-head); [`SeqBlocks`] then compacts the
//! survivors into whole blocks and returns the emptied blocks to the pool, so evictions free real memory.
//! Every score comes from `pagoda_kernels::scores`; this module only decides.

pub mod kv;
pub mod spec;

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Range;

use pagoda_kernels::scores::{self, Window};

use crate::cache::{BlockPool, CacheError, SeqBlocks};
pub use kv::PolicyKv;
pub use spec::{PolicyError, PolicyKind, PolicySpec, defaults, policy_names};

/// Attention shape the policies need to read captured queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnDims {
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AttnDims {
    pub fn group(&self) -> usize {
        (self.n_heads / self.n_kv_heads.max(1)).max(1)
    }
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// What one hook did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Eviction {
    /// Slots dropped over all tables.
    pub slots: u64,
    /// Blocks returned to the pool.
    pub blocks: u64,
}

impl Eviction {
    fn add(&mut self, o: Eviction) {
        self.slots += o.slots;
        self.blocks += o.blocks;
    }
}

/// The cache a hook works on: the sequence's tables, the pool they come from and the KV data.
pub struct CacheView<'a> {
    pub blocks: &'a mut SeqBlocks,
    pub pool: &'a mut BlockPool,
    pub kv: &'a mut dyn PolicyKv,
}

/// One forward step of the sequence, as the hooks see it.
#[derive(Debug, Clone, Copy)]
pub struct StepView<'a> {
    /// Position of the first token computed this step.
    pub start: usize,
    /// Tokens computed this step.
    pub n: usize,
    /// The sequence's tokens so far (prompt, or prompt + generated after a resume); prefill ends when
    /// `start + n` reaches it.
    pub total: usize,
    /// Queries captured for the last [`PolicyState::capture_for`] tokens: `[layer][tokens][q_dim]`.
    pub captured_q: &'a [f32],
    /// The attention probabilities of the step's tokens, summed by the attention kernel, when
    /// [`PolicyState::attention_sums`] asked for them.
    pub probs: Option<StepProbs<'a>>,
}

/// Attention probabilities the forward pass summed for one sequence's step: `[layer][n_heads][stride]`, row
/// `(layer, head)` holding, for every slot the step's last token saw (its kv-head's length after the step), the sum
/// over the step's tokens of their softmax probability of that slot, raised to the power
/// [`PolicyState::attention_sums`] asked for: the weights the attention kernel itself used
/// ([`pagoda_kernels::AttnProbs`]).
#[derive(Debug, Clone, Copy)]
pub struct StepProbs<'a> {
    pub sums: &'a [f32],
    pub stride: usize,
}

/// Reusable buffers, so hooks allocate nothing once warmed up.
#[derive(Debug, Default)]
struct Scratch {
    scores: Vec<f32>,
    pooled: Vec<f32>,
    probs: Vec<f32>,
    anchor: Vec<f32>,
    idx: Vec<u32>,
    keep: Vec<u32>,
    picked: Vec<u32>,
    q: Vec<f32>,
    sorted: Vec<f32>,
    /// The observation window being rebuilt ([`PolicyState::push_observation`]), swapped with the current one.
    obs_next: Vec<f32>,
    /// PagedEviction's scoring batch at a block boundary: the tables and slots to score, and where their ratios go.
    /// Empty between uses (the borrows end with the call); kept for their allocations.
    ratio_entries: Vec<(&'static [u32], Range<usize>)>,
    ratio_out: Vec<&'static mut [f32]>,
}

/// One sequence's policy state.
#[derive(Debug)]
pub struct PolicyState {
    spec: PolicySpec,
    dims: AttnDims,
    block_size: usize,
    /// Token position of every slot, per table (slots move when the cache is compacted).
    positions: Vec<Vec<u32>>,
    /// A number per slot, per table, that moves with its slot: accumulated attention (H2O, KV-Compress), the
    /// key's norm (knorm, KeyDiff: computed once when the slot is written instead of over the whole cache every
    /// step), or ‖V‖/‖K‖ (PagedEviction: its first `ratios_scored[t]` slots, scored at a block boundary).
    metrics: Vec<Vec<f32>>,
    /// PagedEviction: how many leading slots of each table hold their ratio in `metrics` (the rest were written
    /// since the last scoring).
    ratios_scored: Vec<usize>,
    /// KeyDiff after prefill: per table, the sum of the cached keys' normalised vectors (its anchor times the
    /// length), kept as keys are written and evicted so a decode step reads each key once instead of twice. Empty
    /// until the prompt is in (prefill compacts whole tables and scores from scratch).
    unit_key_sums: Vec<Vec<f64>>,
    /// Observation window: the last prompt queries, `[layer][window][q_dim]` (SnapKV, KV-Compress, SAGE).
    obs: Vec<f32>,
    obs_tokens: usize,
    /// Sliding-window policies (StreamingLLM, SAGE decode): slots at or past this position slide.
    slide_floor: u32,
    prefilled: bool,
    scratch: Scratch,
}

impl PolicyState {
    pub fn new(spec: PolicySpec, dims: AttnDims, block_size: usize) -> PolicyState {
        let tables = dims.n_layers * dims.n_kv_heads;
        let tracks_metrics = matches!(
            spec.kind,
            PolicyKind::H2o
                | PolicyKind::KvCompress
                | PolicyKind::Knorm
                | PolicyKind::Keydiff
                | PolicyKind::PagedEviction
        );
        PolicyState {
            spec,
            dims,
            block_size,
            positions: if spec.is_full() { Vec::new() } else { vec![Vec::new(); tables] },
            metrics: if tracks_metrics { vec![Vec::new(); tables] } else { Vec::new() },
            ratios_scored: if spec.kind == PolicyKind::PagedEviction { vec![0; tables] } else { Vec::new() },
            unit_key_sums: Vec::new(),
            obs: Vec::new(),
            obs_tokens: 0,
            slide_floor: 0,
            prefilled: false,
            scratch: Scratch::default(),
        }
    }

    pub fn spec(&self) -> PolicySpec {
        self.spec
    }

    pub fn is_full(&self) -> bool {
        self.spec.is_full()
    }

    /// Forgets everything (the sequence was preempted and will recompute from scratch).
    pub fn reset(&mut self) {
        self.positions.iter_mut().for_each(Vec::clear);
        self.metrics.iter_mut().for_each(Vec::clear);
        self.ratios_scored.iter_mut().for_each(|n| *n = 0);
        self.unit_key_sums.clear();
        self.obs.clear();
        self.obs_tokens = 0;
        self.slide_floor = 0;
        self.prefilled = false;
    }

    /// Position of every slot of table `t` (for tests and diagnostics).
    pub fn positions(&self, t: usize) -> &[u32] {
        self.positions.get(t).map_or(&[], Vec::as_slice)
    }

    /// The power to which the attention kernel raises the next step's probabilities as it sums them over the
    /// step's tokens, for the policies that accumulate attention: H2O's running sum (power 1, prefill chunks and
    /// decode steps alike) and KV-Compress's continual Eq. 20 metric (power 2, once the prompt is in). They then
    /// read the weights the attention kernel computed instead of walking the keys a second time (vLLM's
    /// KV-Compress likewise takes its metric from the attention kernel). `None` for every other policy.
    pub fn attention_sums(&self) -> Option<u32> {
        match self.spec.kind {
            PolicyKind::H2o => Some(1),
            PolicyKind::KvCompress if self.prefilled => Some(2),
            _ => None,
        }
    }

    /// The per-slot metric of table `t`: accumulated attention (H2O, KV-Compress), the key norm (knorm, KeyDiff),
    /// ‖V‖/‖K‖ as of the last block boundary (PagedEviction); empty for the others. For tests and diagnostics.
    pub fn metrics(&self, t: usize) -> &[f32] {
        self.metrics.get(t).map_or(&[], Vec::as_slice)
    }

    /// How many trailing tokens of a step computing `start..start + n` (of `total`) need their queries
    /// captured. A policy that reads attention sums takes none when the forward sums for it
    /// (`sums_in_forward`), and every one of the step's otherwise, to score them itself ([`Self::accumulate`]).
    pub fn capture_for(&self, start: usize, n: usize, total: usize, sums_in_forward: bool) -> usize {
        if self.attention_sums().is_some() {
            return if sums_in_forward { 0 } else { n };
        }
        let end = start + n;
        let prefill = !self.prefilled;
        match self.spec.kind {
            // The window is read once, when the prompt is in (KV-Compress then reads attention sums).
            PolicyKind::Snapkv | PolicyKind::KvCompress if prefill => {
                let window_start = total.saturating_sub(defaults::WINDOW).max(start);
                end.saturating_sub(window_start).min(n)
            }
            PolicyKind::Sage if prefill && end >= total => 1,
            _ => 0,
        }
    }

    /// Runs the hooks for one completed forward step of this sequence. The cache lengths already include the
    /// step's tokens.
    pub fn on_step(&mut self, cache: &mut CacheView<'_>, step: StepView<'_>) -> Result<Eviction, CacheError> {
        if self.is_full() {
            return Ok(Eviction::default());
        }
        self.record_step(cache, &step);
        let mut ev = if self.prefilled {
            self.after_decode_step(cache)?
        } else if step.start + step.n < step.total {
            return self.after_prefill_chunk(cache);
        } else {
            self.prefilled = true;
            match self.after_prefill(cache) {
                Ok(ev) => ev,
                Err(e) => {
                    // A compaction the pool could not supply stopped the selection part way (a table is all or
                    // nothing, the sequence is not): the next step selects again over what the tables hold, or a
                    // one-shot policy would leave the rest over its budget for good.
                    self.prefilled = false;
                    return Err(e);
                }
            }
        };
        // After the prompt too: a prompt that ends on a full block at the budget loses a block before the next
        // token opens a new one (PagedEviction's Algorithm 3 checks at the top of each decode step).
        if cache.blocks.len().is_multiple_of(self.block_size) {
            ev.add(self.at_block_boundary(cache)?);
        }
        Ok(ev)
    }

    /// Tracks slot positions and metrics for the new slots and takes in the captured queries.
    fn record_step(&mut self, cache: &CacheView<'_>, step: &StepView<'_>) {
        let lens = cache.blocks.lens();
        for (t, pos) in self.positions.iter_mut().enumerate() {
            // Adopted prefix slots (never computed here) hold positions 0.. in order.
            let before = lens[t].saturating_sub(step.n);
            if pos.len() < before {
                let from = pos.len() as u32;
                pos.extend(from..before as u32);
            }
            pos.extend((step.start..step.start + step.n).map(|p| p as u32));
        }
        let key_norms = matches!(self.spec.kind, PolicyKind::Knorm | PolicyKind::Keydiff);
        for (t, m) in self.metrics.iter_mut().enumerate() {
            let from = m.len();
            m.resize(lens[t], 0.0);
            if key_norms && from < lens[t] {
                let table = &cache.blocks.tables()[t];
                cache.kv.key_norms(table, from..lens[t], m);
                if let Some(sum) = self.unit_key_sums.get_mut(t) {
                    cache.kv.add_unit_keys(table, from..lens[t], m, 1.0, sum);
                }
            }
        }
        let n_q =
            if self.dims.n_layers == 0 { 0 } else { step.captured_q.len() / (self.dims.n_layers * self.dims.q_dim()) };
        let power = match self.spec.kind {
            PolicyKind::H2o => 1,
            PolicyKind::KvCompress if self.prefilled => 2,
            PolicyKind::Snapkv | PolicyKind::KvCompress | PolicyKind::Sage if n_q > 0 => {
                self.push_observation(step.captured_q, n_q);
                return;
            }
            _ => return,
        };
        if let Some(probs) = step.probs {
            self.add_attention_sums(cache, probs);
        } else if n_q > 0 {
            self.accumulate(cache, step.captured_q, n_q, power);
        }
    }

    /// Appends captured queries to the observation window, keeping the last `WINDOW` per layer.
    fn push_observation(&mut self, captured: &[f32], n_q: usize) {
        let (layers, qd) = (self.dims.n_layers, self.dims.q_dim());
        let w = defaults::WINDOW;
        let old = self.obs_tokens;
        let total = (old + n_q).min(w);
        let drop_old = (old + n_q).saturating_sub(w).min(old);
        let mut next = std::mem::take(&mut self.scratch.obs_next);
        next.clear();
        next.resize(layers * total * qd, 0.0);
        for l in 0..layers {
            let dst = &mut next[l * total * qd..(l + 1) * total * qd];
            let keep_old = old - drop_old;
            if keep_old > 0 {
                let src = &self.obs[(l * old + drop_old) * qd..(l * old + old) * qd];
                dst[..keep_old * qd].copy_from_slice(src);
            }
            let take = total - keep_old;
            let src = &captured[(l * n_q + n_q - take) * qd..(l * n_q + n_q) * qd];
            dst[keep_old * qd..].copy_from_slice(src);
        }
        self.scratch.obs_next = std::mem::replace(&mut self.obs, next);
        self.obs_tokens = total;
    }

    /// Copies queries `from..n_tokens` of layer `l` from `src` (`[layer][n_tokens][q_dim]`), for the query heads
    /// `heads` (indices within kv-head `h`'s group), into `dst` as `[token][head][head_dim]`: the layout
    /// `scores::window_attention_scores` reads.
    #[allow(clippy::too_many_arguments)]
    fn gather_queries(
        dst: &mut Vec<f32>,
        src: &[f32],
        n_tokens: usize,
        from: usize,
        l: usize,
        h: usize,
        heads: Range<usize>,
        d: AttnDims,
    ) {
        let (hd, g) = (d.head_dim, d.group());
        dst.clear();
        for i in from..n_tokens {
            let row = (l * n_tokens + i) * d.q_dim() + h * g * hd;
            dst.extend_from_slice(&src[row + heads.start * hd..row + heads.end * hd]);
        }
    }

    /// Adds the attention (raised to `power`) of `n_q` captured queries — the last `n_q` slots of each table —
    /// to every slot's metric (H2O's running sum, KV-Compress's continual compression), scoring the keys again.
    /// The engine hands these policies the attention kernel's sums instead ([`Self::attention_sums`]); this is
    /// the path for a caller that captured queries only, and the reference the tests hold the kernel's sums to.
    fn accumulate(&mut self, cache: &CacheView<'_>, captured: &[f32], n_q: usize, power: u32) {
        let d = self.dims;
        for t in 0..self.metrics.len() {
            let (l, h) = (t / d.n_kv_heads, t % d.n_kv_heads);
            let len = cache.blocks.lens()[t];
            Self::gather_queries(&mut self.scratch.q, captured, n_q, 0, l, h, 0..d.group(), d);
            let table = &cache.blocks.tables()[t];
            let window = Window {
                q: &self.scratch.q,
                n_q,
                group: d.group(),
                scale: d.scale(),
                first_q_slot: len.saturating_sub(n_q),
                power,
            };
            cache.kv.window_attention_scores(table, len, window, &mut self.scratch.probs, &mut self.metrics[t][..len]);
        }
    }

    /// [`Self::accumulate`] from the sums the attention kernel wrote for the step (already raised to the power).
    fn add_attention_sums(&mut self, cache: &CacheView<'_>, probs: StepProbs<'_>) {
        let d = self.dims;
        let (g, stride) = (d.group(), probs.stride);
        for t in 0..self.metrics.len() {
            let (l, h) = (t / d.n_kv_heads, t % d.n_kv_heads);
            let seen = cache.blocks.lens()[t];
            let metric = &mut self.metrics[t][..seen];
            for qh in h * g..(h + 1) * g {
                let at = (l * d.n_heads + qh) * stride;
                metric.iter_mut().zip(&probs.sums[at..at + seen]).for_each(|(m, &p)| *m += p);
            }
        }
    }

    /// After a prefill chunk that did not finish the prompt: KeyDiff's block prompt processing evicts down to
    /// the budget so the cache never holds more than budget + one prompt block.
    pub fn after_prefill_chunk(&mut self, cache: &mut CacheView<'_>) -> Result<Eviction, CacheError> {
        match self.spec.kind {
            PolicyKind::Keydiff => self.keep_by_score(cache, Score::KeydiffCosine),
            _ => Ok(Eviction::default()),
        }
    }

    /// Once, when the prompt is fully in the cache; again at the next step when it fails ([`Self::on_step`]), so
    /// the observation window stays until it succeeds.
    pub fn after_prefill(&mut self, cache: &mut CacheView<'_>) -> Result<Eviction, CacheError> {
        let c = self.spec.budget_tokens;
        let ev = match self.spec.kind {
            PolicyKind::Full => Ok(Eviction::default()),
            PolicyKind::Streaming => {
                self.slide_floor = defaults::SINK_TOKENS as u32;
                self.keep_sinks_and_recent(cache, defaults::SINK_TOKENS, c.saturating_sub(defaults::SINK_TOKENS))
            }
            PolicyKind::Knorm => self.keep_by_score(cache, Score::KeyNorm),
            // The anchor sum starts from the pruned cache, so only once the selection went through.
            PolicyKind::Keydiff => {
                self.keep_by_score(cache, Score::KeydiffCosine).inspect(|_| self.start_unit_key_sums(cache))
            }
            PolicyKind::PagedEviction => self.paged_eviction_prefill(cache),
            PolicyKind::Sage => self.sage_select(cache),
            PolicyKind::Snapkv => self.snapkv_select(cache),
            PolicyKind::H2o => self.h2o_select(cache),
            PolicyKind::KvCompress => {
                self.kv_compress_metrics(cache);
                self.compress_to(cache, self.budget_blocks(cache.blocks))
            }
        };
        if ev.is_ok() {
            // Decode never reads the window: its memory goes.
            self.obs = Vec::new();
            self.scratch.obs_next = Vec::new();
            self.obs_tokens = 0;
        }
        ev
    }

    /// After each decode step: the per-token policies hold the cache at the budget.
    pub fn after_decode_step(&mut self, cache: &mut CacheView<'_>) -> Result<Eviction, CacheError> {
        let c = self.spec.budget_tokens;
        let mut ev = Eviction::default();
        for t in 0..self.positions.len() {
            if cache.blocks.lens()[t] <= c {
                continue;
            }
            let victim = match self.spec.kind {
                PolicyKind::Streaming | PolicyKind::Sage => self.oldest_sliding(t),
                PolicyKind::Knorm => self.argmax_score(cache, t, Score::KeyNorm),
                PolicyKind::Keydiff => self.argmax_score(cache, t, Score::KeydiffCosine),
                PolicyKind::H2o => self.h2o_victim(t),
                _ => None,
            };
            if let Some(s) = victim {
                if let Some(sum) = self.unit_key_sums.get_mut(t) {
                    cache.kv.add_unit_keys(&cache.blocks.tables()[t], s..s + 1, &self.metrics[t], -1.0, sum);
                }
                ev.add(self.swap_remove(cache, t, s)?);
            }
        }
        Ok(ev)
    }

    /// When the last block of the cache has just filled: PagedEviction drops the whole block with the lowest
    /// mean ‖V‖/‖K‖, among the blocks between the first block and that recent one, from every table whose cache
    /// has reached the budget. Algorithm 3 evicts at the top of the decode step whose token would open a new
    /// block (sequence length a multiple of the block size), so a cache never holds more than its budget: a table
    /// of budget `C` (a multiple of the block size) holds `C - B + 1` to `C` slots, never `C + B`. The first block
    /// holds the attention sinks; the authors' code never evicts it (see [`Self::paged_eviction_prefill`]). Only
    /// when no block lies between them (a budget under two blocks) may the first block go, so that the cache
    /// stays bounded (at two blocks).
    pub fn at_block_boundary(&mut self, cache: &mut CacheView<'_>) -> Result<Eviction, CacheError> {
        if self.spec.kind != PolicyKind::PagedEviction {
            return Ok(Eviction::default());
        }
        let bs = self.block_size;
        let mut ev = Eviction::default();
        let sc = &mut self.scratch;
        sc.idx.clear();
        sc.idx.extend((0..self.positions.len() as u32).filter(|&t| {
            let len = cache.blocks.lens()[t as usize];
            len >= self.spec.budget_tokens && len.is_multiple_of(bs) && len >= 2 * bs
        }));
        // A slot's ratio never changes once written, so only the slots written since a table's last scoring are
        // scored, straight into the kept ratios, every table in one call: on a GPU that is one launch and one copy
        // for the whole sequence.
        let lens = cache.blocks.lens();
        let mut entries = recycle_entries(std::mem::take(&mut sc.ratio_entries));
        entries.extend(sc.idx.iter().map(|&t| {
            (cache.blocks.tables()[t as usize].as_slice(), self.ratios_scored[t as usize]..lens[t as usize])
        }));
        // `idx` ascends, so the tables' ratios are picked out in its order.
        let mut wanted = sc.idx.iter().peekable();
        let mut out = recycle_out(std::mem::take(&mut sc.ratio_out));
        for (t, m) in self.metrics.iter_mut().enumerate() {
            if wanted.next_if(|&&w| w as usize == t).is_some() {
                // `record_step` has already grown every metric to its table's length.
                debug_assert_eq!(m.len(), lens[t]);
                out.push(m);
            }
        }
        cache.kv.value_key_ratios_in(&entries, &mut out);
        sc.ratio_entries = recycle_entries(entries);
        sc.ratio_out = recycle_out(out);
        for &t in &sc.idx {
            let t = t as usize;
            let len = cache.blocks.lens()[t];
            let ratios = &mut self.metrics[t];
            self.ratios_scored[t] = len;
            let nb = len / bs;
            sc.pooled.resize(nb, 0.0);
            scores::block_means(ratios, len, bs, &mut sc.pooled);
            // The block that just filled is the "recent block" whose filling triggers the eviction (Figure 1);
            // the victim is chosen among the blocks before it, the first one excepted.
            let Some(j) = scores::select_one(&sc.pooled[..nb - 1], false, |j| j > 0 || nb == 2) else { continue };
            let removed = cache.blocks.remove_block(cache.pool, t, j)?;
            self.positions[t].drain(j * bs..j * bs + removed);
            ratios.drain(j * bs..j * bs + removed);
            self.ratios_scored[t] = len - removed;
            ev.add(Eviction { slots: removed as u64, blocks: 1 });
        }
        Ok(ev)
    }

    /// PagedEviction's prefill eviction (Algorithm 2): every table over budget keeps `budget` slots, ranked by
    /// ‖V‖/‖K‖ (highest kept). Like the authors' implementation (`modeling_llama.py` of
    /// github.com/krishnateja95/PagedEviction, "keep first and last page, evict from middle"), the first block and
    /// the last block (the partial one, or the whole last block when the prompt fills it) are kept whole and only
    /// the tokens between them are ranked. The paper's text does not say so, but without it the ratio evicts the
    /// attention sinks (their values are small) and the prompt's last tokens. Under a budget of two blocks each
    /// end gets half of it.
    fn paged_eviction_prefill(&mut self, cache: &mut CacheView<'_>) -> Result<Eviction, CacheError> {
        let c = self.spec.budget_tokens;
        let bs = self.block_size;
        let mut ev = Eviction::default();
        for t in 0..self.positions.len() {
            let len = cache.blocks.lens()[t];
            if len <= c {
                continue;
            }
            let first = bs.min(c / 2);
            let last = match len % bs {
                0 => bs,
                partial => partial,
            }
            .min(c - first);
            let (ranked, idx, keep) = self.ranked_scores(cache, t, Score::ValueKeyRatio);
            scores::select_k(&ranked[first..len - last], c - first - last, true, idx, keep);
            keep.iter_mut().for_each(|s| *s += first as u32);
            keep.splice(0..0, 0..first as u32);
            keep.extend((len - last) as u32..len as u32);
            // The ratios just computed are kept for the decode steps' block evictions (`apply_keep` keeps them
            // with their slots).
            self.metrics[t].clear();
            self.metrics[t].extend_from_slice(&self.scratch.scores[..len]);
            ev.add(self.apply_keep(cache, t)?);
            self.ratios_scored[t] = self.metrics[t].len();
        }
        Ok(ev)
    }

    /// Total blocks a KV-Compress sequence may keep: the budget's blocks in every table, spent unevenly.
    pub fn budget_blocks(&self, blocks: &SeqBlocks) -> usize {
        blocks.tables().len() * self.spec.budget_tokens.div_ceil(self.block_size)
    }

    /// KV-Compress (§4.2.2): evicts whole blocks until the sequence holds at most `target_blocks`, choosing
    /// across all (layer, kv-head) tables the block evictions with the lowest largest metric. A table's `e`-th
    /// candidate is its `e·B` lowest metrics, counting the empty slots of its last block as zeros, and a table
    /// always keeps at least one block. The last `WINDOW` slots are never evicted.
    pub fn compress_to(&mut self, cache: &mut CacheView<'_>, target_blocks: usize) -> Result<Eviction, CacheError> {
        if self.spec.kind != PolicyKind::KvCompress {
            return Ok(Eviction::default());
        }
        let held = cache.blocks.num_blocks();
        if held <= target_blocks {
            return Ok(Eviction::default());
        }
        let to_evict = held - target_blocks;
        let bs = self.block_size;
        let n_tables = self.metrics.len();
        // Sorted metrics per table (empties first as zeros) flattened, and each table's offset into them.
        let sc = &mut self.scratch;
        sc.sorted.clear();
        let mut offsets = Vec::with_capacity(n_tables + 1);
        for t in 0..n_tables {
            offsets.push(sc.sorted.len());
            let len = cache.blocks.lens()[t];
            let cap = cache.blocks.tables()[t].len() * bs;
            sc.sorted.extend(std::iter::repeat_n(0.0, cap - len));
            let protected = len.saturating_sub(defaults::WINDOW);
            sc.sorted.extend(
                self.metrics[t][..len].iter().enumerate().map(|(i, &m)| if i >= protected { f32::INFINITY } else { m }),
            );
            let s = offsets[t];
            sc.sorted[s..].sort_unstable_by(f32::total_cmp);
        }
        offsets.push(sc.sorted.len());
        // Merge the per-table candidate sequences (each non-decreasing) by their largest metric.
        let mut evict = vec![0usize; n_tables];
        let mut heap = BinaryHeap::with_capacity(n_tables);
        let key = |t: usize, e: usize, sorted: &[f32], offsets: &[usize]| -> Option<OrdF32> {
            let blocks = (offsets[t + 1] - offsets[t]) / bs;
            if e >= blocks {
                return None;
            }
            let m = sorted[offsets[t] + e * bs - 1];
            m.is_finite().then_some(OrdF32(m))
        };
        for t in 0..n_tables {
            if let Some(k) = key(t, 1, &sc.sorted, &offsets) {
                heap.push(Reverse((k, t)));
            }
        }
        let mut done = 0;
        while done < to_evict {
            let Some(Reverse((_, t))) = heap.pop() else { break };
            evict[t] += 1;
            done += 1;
            if let Some(k) = key(t, evict[t] + 1, &sc.sorted, &offsets) {
                heap.push(Reverse((k, t)));
            }
        }
        let mut ev = Eviction::default();
        for (t, &e) in evict.iter().enumerate() {
            if e == 0 {
                continue;
            }
            let len = cache.blocks.lens()[t];
            let cap = cache.blocks.tables()[t].len() * bs;
            let drop = (e * bs).saturating_sub(cap - len).min(len);
            let sc = &mut self.scratch;
            sc.scores.clear();
            let protected = len.saturating_sub(defaults::WINDOW);
            sc.scores.extend(
                self.metrics[t][..len].iter().enumerate().map(|(i, &m)| if i >= protected { f32::INFINITY } else { m }),
            );
            scores::select_k(&sc.scores, len - drop, true, &mut sc.idx, &mut sc.keep);
            ev.add(self.apply_keep(cache, t)?);
        }
        Ok(ev)
    }

    // --- selections -------------------------------------------------------------------------------------------

    /// Keeps the `budget` slots with the lowest `score` in every table over budget (knorm, KeyDiff).
    fn keep_by_score(&mut self, cache: &mut CacheView<'_>, score: Score) -> Result<Eviction, CacheError> {
        let c = self.spec.budget_tokens;
        let mut ev = Eviction::default();
        for t in 0..self.positions.len() {
            let len = cache.blocks.lens()[t];
            if len <= c {
                continue;
            }
            self.select_by_score(cache, t, score, c);
            ev.add(self.apply_keep(cache, t)?);
        }
        Ok(ev)
    }

    /// Keeps the slots of the first `sinks` positions and the last `recent` slots (slots are in position order
    /// until a per-token policy starts swapping them).
    fn keep_sinks_and_recent(
        &mut self,
        cache: &mut CacheView<'_>,
        sinks: usize,
        recent: usize,
    ) -> Result<Eviction, CacheError> {
        let mut ev = Eviction::default();
        for t in 0..self.positions.len() {
            let len = cache.blocks.lens()[t];
            if len <= sinks + recent {
                continue;
            }
            let sc = &mut self.scratch;
            sc.keep.clear();
            sc.keep.extend(0..sinks as u32);
            sc.keep.extend((len - recent) as u32..len as u32);
            ev.add(self.apply_keep(cache, t)?);
        }
        Ok(ev)
    }

    /// SAGE-KV (§3, Steps 1–3): sinks, then for each query head of the group its top-k slots by the last
    /// token's attention, then the recent window and the last token. Decode slides the recent window.
    fn sage_select(&mut self, cache: &mut CacheView<'_>) -> Result<Eviction, CacheError> {
        let d = self.dims;
        let g = d.group();
        let (sink, k, recent) = self.spec.sage_split(g);
        let mut ev = Eviction::default();
        if self.obs_tokens == 0 {
            return Ok(ev);
        }
        for t in 0..self.positions.len() {
            let len = cache.blocks.lens()[t];
            if len <= self.spec.budget_tokens {
                continue;
            }
            // Candidates lie between the sinks and the recent window (which includes the last token).
            let tail = (recent + 1).min(len - sink);
            let cand_end = len - tail;
            self.scratch.picked.clear();
            for qh in 0..g {
                // The last observed query, head `qh` of the group alone.
                self.window_scores(cache, t, 1, qh..qh + 1, 1);
                let sc = &mut self.scratch;
                if cand_end > sink {
                    scores::select_k(&sc.scores[sink..cand_end], k, true, &mut sc.idx, &mut sc.keep);
                    sc.picked.extend(sc.keep.iter().map(|&i| i + sink as u32));
                }
            }
            let sc = &mut self.scratch;
            sc.keep.clear();
            sc.keep.extend(0..sink as u32);
            sc.keep.extend_from_slice(&sc.picked);
            sc.keep.extend(cand_end as u32..len as u32);
            sc.keep.sort_unstable();
            sc.keep.dedup();
            if t == 0 {
                self.slide_floor = self.positions[t].get(cand_end).copied().unwrap_or(0);
            }
            ev.add(self.apply_keep(cache, t)?);
        }
        Ok(ev)
    }

    /// SnapKV: window attention summed over the last w queries and the query group, max-pooled (p = 7) over
    /// the prefix; keep the top budget − w prefix slots plus the window.
    fn snapkv_select(&mut self, cache: &mut CacheView<'_>) -> Result<Eviction, CacheError> {
        let c = self.spec.budget_tokens;
        let mut ev = Eviction::default();
        for t in 0..self.positions.len() {
            let len = cache.blocks.lens()[t];
            if len <= c || self.obs_tokens == 0 {
                continue;
            }
            let w = self.obs_tokens.min(len);
            self.window_scores(cache, t, defaults::WINDOW, 0..self.dims.group(), 1);
            let prefix = len - w;
            let sc = &mut self.scratch;
            sc.pooled.resize(prefix, 0.0);
            scores::max_pool1d(&sc.scores[..prefix], defaults::POOL, &mut sc.pooled[..prefix]);
            scores::select_k(&sc.pooled[..prefix], c.saturating_sub(w), true, &mut sc.idx, &mut sc.keep);
            sc.keep.extend(prefix as u32..len as u32);
            ev.add(self.apply_keep(cache, t)?);
        }
        Ok(ev)
    }

    /// KV-Compress metrics after prefill (eq. 8 with squared attention, eq. 10 query-group sum).
    fn kv_compress_metrics(&mut self, cache: &mut CacheView<'_>) {
        for t in 0..self.metrics.len() {
            let len = cache.blocks.lens()[t];
            if self.obs_tokens == 0 {
                continue;
            }
            self.window_scores(cache, t, defaults::WINDOW, 0..self.dims.group(), 2);
            let sc = &mut self.scratch;
            let m = &mut self.metrics[t];
            m.resize(len, 0.0);
            scores::max_pool1d(&sc.scores[..len], defaults::POOL, &mut m[..len]);
        }
    }

    /// H2O after prefill: half the budget for the heavy hitters by accumulated attention, half for the most
    /// recent tokens.
    fn h2o_select(&mut self, cache: &mut CacheView<'_>) -> Result<Eviction, CacheError> {
        let c = self.spec.budget_tokens;
        let recent = c / 2;
        let mut ev = Eviction::default();
        for t in 0..self.positions.len() {
            let len = cache.blocks.lens()[t];
            if len <= c {
                continue;
            }
            let prefix = len - recent;
            let sc = &mut self.scratch;
            scores::select_k(&self.metrics[t][..prefix], c - recent, true, &mut sc.idx, &mut sc.keep);
            sc.keep.extend(prefix as u32..len as u32);
            ev.add(self.apply_keep(cache, t)?);
        }
        Ok(ev)
    }

    /// Attention (raised to `power`) of the last `last_n` observed queries, query heads `heads` of table `t`'s
    /// group, summed into `scratch.scores[..len]`.
    fn window_scores(&mut self, cache: &CacheView<'_>, t: usize, last_n: usize, heads: Range<usize>, power: u32) {
        let d = self.dims;
        let (l, h) = (t / d.n_kv_heads, t % d.n_kv_heads);
        let len = cache.blocks.lens()[t];
        // The window holds the last obs_tokens queries; if the cache is shorter (tiny prompts) use its tail.
        let n_q = last_n.min(self.obs_tokens).min(len);
        let n_heads = heads.len();
        let sc = &mut self.scratch;
        Self::gather_queries(&mut sc.q, &self.obs, self.obs_tokens, self.obs_tokens - n_q, l, h, heads, d);
        sc.scores.clear();
        sc.scores.resize(len, 0.0);
        let window = Window { q: &sc.q, n_q, group: n_heads, scale: d.scale(), first_q_slot: len - n_q, power };
        cache.kv.window_attention_scores(&cache.blocks.tables()[t], len, window, &mut sc.probs, &mut sc.scores);
    }

    /// KeyDiff, once the prompt is in: the sum of every table's normalised keys, from the kept norms, which
    /// decode then keeps up to date.
    fn start_unit_key_sums(&mut self, cache: &CacheView<'_>) {
        let hd = self.dims.head_dim;
        self.unit_key_sums = vec![vec![0.0; hd]; self.metrics.len()];
        for (t, sum) in self.unit_key_sums.iter_mut().enumerate() {
            let len = cache.blocks.lens()[t];
            cache.kv.add_unit_keys(&cache.blocks.tables()[t], 0..len, &self.metrics[t], 1.0, sum);
        }
    }

    /// The slot with the highest static `score` in table `t` (ties: the lower slot).
    fn argmax_score(&mut self, cache: &CacheView<'_>, t: usize, score: Score) -> Option<usize> {
        let (ranked, _, _) = self.ranked_scores(cache, t, score);
        scores::select_one(ranked, true, |_| true)
    }

    /// The oldest slot of the sliding window (position at or past `slide_floor`).
    fn oldest_sliding(&self, t: usize) -> Option<usize> {
        let floor = self.slide_floor;
        self.positions[t].iter().enumerate().filter(|&(_, &p)| p >= floor).min_by_key(|&(_, &p)| p).map(|(i, _)| i)
    }

    /// H2O decode: the lowest accumulated attention outside the recent half of the budget.
    fn h2o_victim(&mut self, t: usize) -> Option<usize> {
        let pos = &self.positions[t];
        let newest = pos.iter().copied().max().unwrap_or(0);
        let recent_from = newest.saturating_sub((self.spec.budget_tokens / 2) as u32 - 1);
        scores::select_one(&self.metrics[t][..pos.len()], false, |s| pos[s] < recent_from)
    }

    /// Ranks the slots of table `t` by a static `score`: the `k` lowest slot indices, ascending, into
    /// `scratch.keep`.
    fn select_by_score(&mut self, cache: &CacheView<'_>, t: usize, score: Score, k: usize) {
        let (ranked, idx, keep) = self.ranked_scores(cache, t, score);
        scores::select_k(ranked, k, false, idx, keep);
    }

    /// Table `t`'s static `score` per slot ([`static_scores`]), with the selection scratch beside it.
    fn ranked_scores(
        &mut self,
        cache: &CacheView<'_>,
        t: usize,
        score: Score,
    ) -> (&[f32], &mut Vec<u32>, &mut Vec<u32>) {
        let len = cache.blocks.lens()[t];
        let sc = &mut self.scratch;
        let ranked = static_scores(
            cache.kv,
            &cache.blocks.tables()[t],
            len,
            score,
            self.metrics.get(t).map_or(&[], Vec::as_slice),
            self.unit_key_sums.get(t).map(Vec::as_slice),
            &mut sc.scores,
            &mut sc.anchor,
        );
        (ranked, &mut sc.idx, &mut sc.keep)
    }

    // --- applying ---------------------------------------------------------------------------------------------

    /// Compacts table `t` to `scratch.keep` (ascending) and keeps positions and metrics in step.
    fn apply_keep(&mut self, cache: &mut CacheView<'_>, t: usize) -> Result<Eviction, CacheError> {
        let len = cache.blocks.lens()[t];
        let keep = &self.scratch.keep;
        if keep.len() >= len {
            return Ok(Eviction::default());
        }
        let freed = cache.blocks.compact(cache.pool, cache.kv, t, keep)?;
        retain_by_index(&mut self.positions[t], keep);
        if let Some(m) = self.metrics.get_mut(t) {
            m.truncate(len);
            retain_by_index(m, keep);
        }
        Ok(Eviction { slots: (len - keep.len()) as u64, blocks: freed as u64 })
    }

    fn swap_remove(&mut self, cache: &mut CacheView<'_>, t: usize, s: usize) -> Result<Eviction, CacheError> {
        let blocks_before = cache.blocks.tables()[t].len();
        cache.blocks.swap_remove_slot(cache.pool, cache.kv, t, s)?;
        self.positions[t].swap_remove(s);
        if let Some(m) = self.metrics.get_mut(t)
            && s < m.len()
        {
            m.swap_remove(s);
        }
        let freed = blocks_before - cache.blocks.tables()[t].len();
        Ok(Eviction { slots: 1, blocks: freed as u64 })
    }
}

#[derive(Debug, Clone, Copy)]
enum Score {
    KeyNorm,
    ValueKeyRatio,
    KeydiffCosine,
}

/// A table's static `score` for slots `0..len`: knorm's kept norms (`metric`) as they are; KeyDiff's cosines from
/// the kept anchor sum and norms once decode keeps them, from scratch before; ‖V‖/‖K‖ computed. Computed scores go
/// to `out` (grown, never shrunk); `anchor` is KeyDiff's scratch.
#[allow(clippy::too_many_arguments)]
fn static_scores<'a>(
    kv: &dyn PolicyKv,
    table: &[u32],
    len: usize,
    score: Score,
    metric: &'a [f32],
    unit_key_sum: Option<&[f64]>,
    out: &'a mut Vec<f32>,
    anchor: &mut Vec<f32>,
) -> &'a [f32] {
    if let Score::KeyNorm = score {
        return &metric[..len];
    }
    out.resize(len.max(out.len()), 0.0);
    match (score, unit_key_sum) {
        (Score::KeydiffCosine, Some(sum)) => kv.keydiff_cosine_kept(table, len, sum, metric, anchor, out),
        (Score::KeydiffCosine, None) => kv.keydiff_cosine(table, len, anchor, out),
        _ => kv.value_key_ratio(table, len, out),
    }
    &out[..len]
}

/// Empties a vector of borrowed scoring entries and hands its allocation to a new lifetime: the in-place `collect`
/// specialisation keeps the buffer because the element layout does not change, so a block boundary does not
/// allocate.
#[allow(clippy::unnecessary_filter_map)] // `filter` cannot change the element lifetime; `filter_map` can.
fn recycle_entries<'b>(mut v: Vec<(&[u32], Range<usize>)>) -> Vec<(&'b [u32], Range<usize>)> {
    v.clear();
    v.into_iter().filter_map(|_| None).collect()
}

/// [`recycle_entries`] for the slices the scores go to.
#[allow(clippy::unnecessary_filter_map)]
fn recycle_out<'b>(mut v: Vec<&mut [f32]>) -> Vec<&'b mut [f32]> {
    v.clear();
    v.into_iter().filter_map(|_| None).collect()
}

/// Keeps `v[keep[i]]` in order (keep ascending).
fn retain_by_index<T: Copy>(v: &mut Vec<T>, keep: &[u32]) {
    for (i, &k) in keep.iter().enumerate() {
        v[i] = v[k as usize];
    }
    v.truncate(keep.len());
}

/// Total order on f32 for the eviction heap.
#[derive(Debug, Clone, Copy, PartialEq)]
struct OrdF32(f32);
impl Eq for OrdF32 {}
impl PartialOrd for OrdF32 {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for OrdF32 {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scoring batch keeps its allocation across lifetimes; were the in-place `collect` to stop applying,
    /// every block boundary would allocate again.
    #[test]
    fn recycled_scoring_buffers_keep_their_allocation() {
        let table = vec![1u32, 2];
        let mut entries: Vec<(&[u32], Range<usize>)> = Vec::with_capacity(16);
        entries.push((&table, 0..2));
        let ptr = entries.as_ptr() as usize;
        let entries = recycle_entries(entries);
        assert!(entries.is_empty() && entries.capacity() >= 16 && entries.as_ptr() as usize == ptr);
        let mut data = [0.0f32; 4];
        let mut out: Vec<&mut [f32]> = Vec::with_capacity(16);
        out.push(&mut data);
        let ptr = out.as_ptr() as usize;
        let out = recycle_out(out);
        assert!(out.is_empty() && out.capacity() >= 16 && out.as_ptr() as usize == ptr);
    }
}
