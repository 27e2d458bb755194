//! Placement: which worker serves a request (DESIGN §6), as pure functions over a snapshot.
//!
//! This module owns the cost model and the selectors, nothing else: callers hand it, per candidate worker, the
//! prefix blocks it already holds (by tier), its measured speeds and its load, and get back a decision with the
//! full cost breakdown of every candidate. Keeping it free of I/O, clocks and shared state makes every decision
//! reproducible in a unit test and cheap enough (a few hundred nanoseconds per worker) to sit on the request path.
//!
//! Pagoda's cost of worker `w` for a request of `P` prompt tokens whose first `h_d, h_h, h_disk, h_peer` blocks
//! `w` holds on device, host, disk and at a peer (a contiguous chain from the first block):
//!
//! ```text
//! cost(w) = (P − B·(h_d + h_h + h_disk + h_peer)) / prefill_tokens_per_s(w)      prefill of the rest
//!         + Σ_tier bytes(h_tier) / bandwidth(w, tier)                           onboarding the lower-tier hits
//!         + adapter_load_s(w)                                                   loading the request's LoRA adapter
//!         + queued_tokens(w) / prefill_tokens_per_s(w) + running(w) · step_s(w)  queue and decode load
//! ```
//!
//! The placer leaves `h_peer` at 0: a worker that could pull a prefix from a peer is priced as computing it (the
//! measured alternative is in docs/BENCHMARKS.md, "Pricing a peer pull in placement").
//! `bytes(h_tier)` is what the holder reported each copy's encoded size to be (a compressed copy loads in fewer
//! bytes than the device format's group), and `block_group_bytes` for a copy whose size was not reported.
//!
//! A worker is infeasible when the request's KV under its policy (the whole prompt + max tokens for full cache,
//! at most budget + one block per table for a pruning policy, plus the prompt while it is prefilled) does not fit
//! its free + reclaimable device blocks. The lowest cost wins; ties break towards the lower worker index so that
//! two routers with the same view place the same way. An optional temperature samples from `exp(−cost/T)` instead,
//! so that router replicas with slightly stale views do not herd onto one worker.
//!
//! The baselines of `pagoda bench routing` live here too: round-robin, least-loaded, and Dynamo's
//! prefix-overlap cost `prefill_blocks − overlap + decode_blocks`.

use thiserror::Error;

/// Where a matched block lives on a worker, fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HitTier {
    Device,
    Host,
    Disk,
    Peer,
}

impl HitTier {
    pub const ALL: [HitTier; 4] = [HitTier::Device, HitTier::Host, HitTier::Disk, HitTier::Peer];

    pub fn name(self) -> &'static str {
        match self {
            HitTier::Device => "device",
            HitTier::Host => "host",
            HitTier::Disk => "disk",
            HitTier::Peer => "peer",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Matched prefix blocks of one request on one worker, per tier, with the encoded size of the copies whose holder
/// reported it: a lower tier may hold each context in a different codec (EvicPress chooses per context), so a
/// hit's load is priced at its own bytes, not at the device format's group size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierHits {
    blocks: [u32; 4],
    /// Encoded bytes of the hits whose size was reported, per tier.
    sized_bytes: [u64; 4],
    /// How many of `blocks` those are, per tier.
    sized_blocks: [u32; 4],
}

impl TierHits {
    /// Hits of unknown size: `blocks[t]` per tier.
    pub fn from_blocks(blocks: [u32; 4]) -> TierHits {
        TierHits { blocks, ..TierHits::default() }
    }

    pub fn get(&self, t: HitTier) -> u32 {
        self.blocks[t.index()]
    }

    /// Blocks per tier, in [`HitTier`] order.
    pub fn blocks(&self) -> [u32; 4] {
        self.blocks
    }

    /// `n` hits in `t` whose size is not known (priced at the worker's group size).
    pub fn add(&mut self, t: HitTier, n: u32) {
        self.blocks[t.index()] += n;
    }

    /// One hit in `t` whose copy is `bytes` long.
    pub fn add_sized(&mut self, t: HitTier, bytes: u64) {
        let i = t.index();
        self.blocks[i] += 1;
        self.sized_blocks[i] += 1;
        self.sized_bytes[i] = self.sized_bytes[i].saturating_add(bytes);
    }

    pub fn total(&self) -> u32 {
        self.blocks.iter().sum()
    }

    /// Bytes to load for the hits in `t`: the reported sizes, and `group_bytes` for each hit of unknown size.
    pub fn load_bytes(&self, t: HitTier, group_bytes: u64) -> f64 {
        let i = t.index();
        let unknown = self.blocks[i] - self.sized_blocks[i];
        self.sized_bytes[i] as f64 + f64::from(unknown) * group_bytes as f64
    }
}

/// What the router knows about one candidate worker at decision time.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView {
    /// False for a worker that is down, draining or whose events stopped: never chosen.
    pub ready: bool,
    /// Prefix blocks of this request the worker holds, per tier.
    pub hits: TierHits,
    /// Measured prefill speed (tokens/s); must be positive.
    pub prefill_tokens_per_s: f64,
    /// Measured load bandwidth per tier, bytes/s, in [`HitTier`] order (device is unused: device hits are free).
    pub load_bytes_per_s: [f64; 4],
    /// Bytes of one block group (all layers × kv-heads for one block of tokens) in the device format: what a
    /// lower-tier hit whose holder did not report its size is priced at.
    pub group_bytes: u64,
    /// Prompt tokens queued ahead of this request (waiting prefill).
    pub queued_tokens: u64,
    /// Sequences decoding now.
    pub running: u32,
    /// Measured duration of one decode step at the current batch (seconds).
    pub step_s: f64,
    /// Device blocks free or reclaimable (idle cached prefixes on the LRU queue).
    pub free_blocks: u64,
    /// Blocks per block group (layers × kv-heads).
    pub group_size: u32,
    /// Seconds the worker would spend loading the request's LoRA adapter before its prefill (0 when it holds it):
    /// an onboarding cost like a lower tier's, so a request goes where its adapter is loaded unless that worker
    /// is busier by more than the load.
    pub adapter_load_s: f64,
    /// Breaks exact cost ties (lowest wins). Derived from the worker's name and the request (see
    /// [`tie_rank`]), never from list order, so that every router replica breaks a tie the same way.
    pub tie_rank: u64,
}

/// The tie-break rank of `worker` for a request whose first block hash is `first_block` (0 for a prompt shorter
/// than a block): rendezvous hashing, so that cold prompts with the same start go to the same worker on every
/// replica, and different ones spread over the workers instead of piling onto the first listed.
pub fn tie_rank(worker: &str, first_block: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(worker.as_bytes(), first_block)
}

/// One request's shape, as placement sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestView {
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    pub block_size: u32,
    /// Tokens per (layer, kv-head) the request's eviction policy keeps; `None` for full cache.
    pub budget_tokens: Option<u32>,
}

impl RequestView {
    /// Prompt tokens left to prefill on a worker holding `hit_blocks` of the prompt's blocks (in any tier). The last
    /// prompt token is always computed: its logits give the first token.
    pub fn compute_tokens(&self, hit_blocks: u32) -> u64 {
        let hit_tokens = u64::from(hit_blocks) * u64::from(self.block_size);
        u64::from(self.prompt_tokens).saturating_sub(hit_tokens).max(1)
    }

    /// Device blocks the request needs at its peak on a worker with `group_size` blocks per group, given `hits`
    /// blocks already on device (shared, not newly allocated).
    pub fn blocks_needed(&self, group_size: u32, device_hits: u32) -> u64 {
        let bs = self.block_size.max(1) as u64;
        let prompt = self.prompt_tokens as u64;
        let total = prompt + self.max_tokens as u64;
        let peak_tokens = match self.budget_tokens {
            None => total,
            // The prompt is whole until the policy prunes it; then budget + the block being filled.
            Some(c) => prompt.max((c as u64 + bs).min(total)),
        };
        let groups = peak_tokens.div_ceil(bs).saturating_sub(device_hits as u64);
        groups * group_size as u64
    }
}

/// One candidate's cost, split into its parts (exported per decision for metrics and the dashboard).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CostBreakdown {
    pub prefill_s: f64,
    pub load_s: f64,
    pub queue_s: f64,
    pub total_s: f64,
    pub hits: TierHits,
    pub blocks_needed: u64,
    pub feasible: bool,
}

/// A placement and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Index of the chosen worker in the caller's slice.
    pub worker: usize,
    /// One breakdown per candidate, in the caller's order (`None` for a worker that was not ready).
    pub costs: Vec<Option<CostBreakdown>>,
}

#[derive(Debug, Clone, PartialEq, Error)]
pub enum PlacementError {
    #[error("no worker is ready")]
    NoReadyWorker,
    #[error("no ready worker has room for this request: it needs {needed} KV blocks, the most free is {most_free}")]
    NoRoom { needed: u64, most_free: u64 },
    #[error("invalid worker view {worker}: {why}")]
    InvalidView { worker: usize, why: &'static str },
}

/// Pagoda's cost of serving `req` on `w` (see the module docs).
pub fn cost(req: &RequestView, w: &WorkerView) -> CostBreakdown {
    let prefill_s = req.compute_tokens(w.hits.total()) as f64 / w.prefill_tokens_per_s;
    let mut load_s = w.adapter_load_s;
    for t in [HitTier::Host, HitTier::Disk, HitTier::Peer] {
        if w.hits.get(t) > 0 {
            load_s += w.hits.load_bytes(t, w.group_bytes) / w.load_bytes_per_s[t.index()];
        }
    }
    let queue_s = w.queued_tokens as f64 / w.prefill_tokens_per_s + w.running as f64 * w.step_s;
    let blocks_needed = req.blocks_needed(w.group_size, w.hits.get(HitTier::Device));
    CostBreakdown {
        prefill_s,
        load_s,
        queue_s,
        total_s: prefill_s + load_s + queue_s,
        hits: w.hits,
        blocks_needed,
        feasible: blocks_needed <= w.free_blocks,
    }
}

fn check_view(i: usize, w: &WorkerView) -> Result<(), PlacementError> {
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if !positive(w.prefill_tokens_per_s) {
        return Err(PlacementError::InvalidView { worker: i, why: "prefill speed must be positive" });
    }
    if !(w.adapter_load_s.is_finite() && w.adapter_load_s >= 0.0) {
        return Err(PlacementError::InvalidView {
            worker: i,
            why: "adapter load time must be finite and non-negative",
        });
    }
    if !(w.step_s.is_finite() && w.step_s >= 0.0) {
        return Err(PlacementError::InvalidView { worker: i, why: "step time must be finite and non-negative" });
    }
    for t in [HitTier::Host, HitTier::Disk, HitTier::Peer] {
        if w.hits.get(t) > 0 && !positive(w.load_bytes_per_s[t.index()]) {
            return Err(PlacementError::InvalidView { worker: i, why: "a tier with hits needs a positive bandwidth" });
        }
    }
    Ok(())
}

/// Pagoda's placement: the feasible worker with the lowest cost. With `temperature` (seconds) and a uniform draw
/// `u ∈ [0, 1)`, samples a feasible worker with probability ∝ `exp(−(cost − min_cost) / temperature)` instead.
pub fn place(
    req: &RequestView,
    workers: &[WorkerView],
    temperature: Option<(f64, f64)>,
) -> Result<Decision, PlacementError> {
    let mut costs = Vec::with_capacity(workers.len());
    let mut best: Option<(usize, f64)> = None;
    let mut most_free = None::<u64>;
    let mut needed_min = u64::MAX;
    for (i, w) in workers.iter().enumerate() {
        if !w.ready {
            costs.push(None);
            continue;
        }
        check_view(i, w)?;
        let c = cost(req, w);
        most_free = Some(most_free.unwrap_or(0).max(w.free_blocks));
        needed_min = needed_min.min(c.blocks_needed);
        let better = |(b_i, b): (usize, f64)| match c.total_s.total_cmp(&b) {
            std::cmp::Ordering::Less => true,
            std::cmp::Ordering::Equal => w.tie_rank < workers[b_i].tie_rank,
            std::cmp::Ordering::Greater => false,
        };
        if c.feasible && best.is_none_or(better) {
            best = Some((i, c.total_s));
        }
        costs.push(Some(c));
    }
    let Some(most_free) = most_free else { return Err(PlacementError::NoReadyWorker) };
    let Some((mut worker, min_cost)) = best else {
        return Err(PlacementError::NoRoom { needed: needed_min, most_free });
    };
    if let Some((t, u)) = temperature.filter(|(t, _)| t.is_finite() && *t > 0.0) {
        let weight = |c: &CostBreakdown| if c.feasible { (-(c.total_s - min_cost) / t).exp() } else { 0.0 };
        let sum: f64 = costs.iter().flatten().map(weight).sum();
        let mut target = u.clamp(0.0, 1.0) * sum;
        for (i, c) in costs.iter().enumerate() {
            let Some(c) = c else { continue };
            let wgt = weight(c);
            if wgt > 0.0 {
                worker = i;
                if target < wgt {
                    break;
                }
                target -= wgt;
            }
        }
    }
    Ok(Decision { worker, costs })
}

/// Dynamo's KV-router cost for the prefix-overlap baseline: `prefill_blocks − overlap + decode_blocks`, where
/// `overlap` counts device hits only and `decode_blocks` is the worker's running sequences. Lowest wins.
pub fn prefix_overlap(req: &RequestView, workers: &[WorkerView]) -> Result<usize, PlacementError> {
    let prefill_blocks = req.prompt_tokens.div_ceil(req.block_size.max(1)) as i64;
    workers
        .iter()
        .enumerate()
        .filter(|(_, w)| w.ready)
        .min_by_key(|(_, w)| prefill_blocks - w.hits.get(HitTier::Device) as i64 + w.running as i64)
        .map(|(i, _)| i)
        .ok_or(PlacementError::NoReadyWorker)
}

/// The least-loaded baseline: fewest queued prompt tokens, then fewest running sequences.
pub fn least_loaded(workers: &[WorkerView]) -> Result<usize, PlacementError> {
    workers
        .iter()
        .enumerate()
        .filter(|(_, w)| w.ready)
        .min_by_key(|(_, w)| (w.queued_tokens, w.running))
        .map(|(i, _)| i)
        .ok_or(PlacementError::NoReadyWorker)
}

/// The round-robin baseline: turn `cursor` among the ready workers, in slot order.
pub fn round_robin(workers: &[WorkerView], cursor: usize) -> Result<usize, PlacementError> {
    // Turns go round the ready workers, so a worker that is not ready (down, or of another role) does not hand
    // its turn to the next one as a second.
    let ready = workers.iter().filter(|w| w.ready).count();
    if ready == 0 {
        return Err(PlacementError::NoReadyWorker);
    }
    (0..workers.len()).filter(|&i| workers[i].ready).nth(cursor % ready).ok_or(PlacementError::NoReadyWorker)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(device: u32, host: u32) -> WorkerView {
        WorkerView {
            ready: true,
            hits: TierHits::from_blocks([device, host, 0, 0]),
            prefill_tokens_per_s: 400.0,
            load_bytes_per_s: [0.0, 4e9, 1e9, 1e9],
            group_bytes: 16 * 90 * 64 * 4 * 2,
            queued_tokens: 0,
            running: 0,
            step_s: 0.02,
            free_blocks: 1_000_000,
            group_size: 90,
            adapter_load_s: 0.0,
            tie_rank: 0,
        }
    }

    const REQ: RequestView = RequestView { prompt_tokens: 1024, max_tokens: 64, block_size: 16, budget_tokens: None };

    #[test]
    fn exact_ties_go_to_the_lowest_tie_rank_not_the_first_listed() {
        let ranked = |rank: u64| WorkerView { tie_rank: rank, ..worker(0, 0) };
        assert_eq!(place(&REQ, &[ranked(7), ranked(3), ranked(9)], None).unwrap().worker, 1);
        assert_eq!(place(&REQ, &[ranked(3), ranked(7), ranked(9)], None).unwrap().worker, 0);
        // A cheaper worker still wins over a lower rank.
        let cheaper = WorkerView { tie_rank: 100, ..worker(8, 0) };
        assert_eq!(place(&REQ, &[ranked(1), cheaper], None).unwrap().worker, 1);
        // Ranks come from names, so two replicas listing the workers in different orders agree.
        let names = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"];
        let chosen = |order: [usize; 3]| {
            let views: Vec<WorkerView> = order.iter().map(|&i| ranked(tie_rank(names[i], 42))).collect();
            order[place(&REQ, &views, None).unwrap().worker]
        };
        assert_eq!(chosen([0, 1, 2]), chosen([2, 0, 1]));
        assert_eq!(chosen([0, 1, 2]), chosen([1, 2, 0]));
    }

    #[test]
    fn prefers_the_worker_holding_the_prefix_and_explains_why() {
        let ws = [worker(0, 0), worker(48, 0), worker(0, 48)];
        let d = place(&REQ, &ws, None).unwrap();
        assert_eq!(d.worker, 1);
        let c: Vec<CostBreakdown> = d.costs.iter().map(|c| c.unwrap()).collect();
        // 1024 tokens at 400 tok/s from scratch; 256 left after 48 device blocks; host hits cost their load time.
        assert!((c[0].prefill_s - 2.56).abs() < 1e-9, "{:?}", c[0]);
        assert!((c[1].prefill_s - 0.64).abs() < 1e-9 && c[1].load_s == 0.0);
        assert!(c[2].load_s > 0.0 && c[2].total_s > c[1].total_s && c[2].total_s < c[0].total_s);
        assert_eq!(c[1].hits.get(HitTier::Device), 48);
    }

    #[test]
    fn queue_load_outweighs_a_short_prefix() {
        let mut busy = worker(4, 0);
        busy.queued_tokens = 8192;
        let d = place(&REQ, &[busy, worker(0, 0)], None).unwrap();
        assert_eq!(d.worker, 1);
    }

    #[test]
    fn infeasible_workers_are_skipped_and_none_feasible_is_a_typed_error() {
        let mut small = worker(48, 0);
        small.free_blocks = 10;
        let d = place(&REQ, &[small.clone(), worker(0, 0)], None).unwrap();
        assert_eq!(d.worker, 1, "the prefix holder has no room");
        assert!(!d.costs[0].unwrap().feasible);
        let err = place(&REQ, &[small], None).unwrap_err();
        assert!(matches!(err, PlacementError::NoRoom { most_free: 10, .. }), "{err}");
    }

    #[test]
    fn a_pruning_policy_needs_only_its_budget_after_the_prompt() {
        let pruned = RequestView { budget_tokens: Some(256), max_tokens: 4096, ..REQ };
        // Peak: the 1,024-token prompt (64 groups) before pruning; budget + block (17 groups) is below it.
        assert_eq!(pruned.blocks_needed(90, 0), 64 * 90);
        assert_eq!(REQ.blocks_needed(90, 0), (1024u64 + 64).div_ceil(16) * 90);
        assert_eq!(REQ.blocks_needed(90, 10), ((1024u64 + 64).div_ceil(16) - 10) * 90);
    }

    #[test]
    fn not_ready_and_invalid_views_are_refused() {
        let mut down = worker(48, 0);
        down.ready = false;
        assert_eq!(place(&REQ, &[down.clone()], None).unwrap_err(), PlacementError::NoReadyWorker);
        let d = place(&REQ, &[down, worker(0, 0)], None).unwrap();
        assert_eq!((d.worker, d.costs[0]), (1, None));
        let mut bad = worker(0, 0);
        bad.prefill_tokens_per_s = 0.0;
        assert!(matches!(place(&REQ, &[bad], None), Err(PlacementError::InvalidView { worker: 0, .. })));
        let mut no_bw = worker(0, 3);
        no_bw.load_bytes_per_s[1] = f64::NAN;
        assert!(matches!(place(&REQ, &[no_bw], None), Err(PlacementError::InvalidView { .. })));
    }

    #[test]
    fn ties_break_to_the_lowest_index_so_replicas_agree() {
        let ws = [worker(8, 0), worker(8, 0), worker(8, 0)];
        for _ in 0..3 {
            assert_eq!(place(&REQ, &ws, None).unwrap().worker, 0);
        }
    }

    #[test]
    fn temperature_spreads_near_ties_but_not_clear_losers() {
        let ws = [worker(8, 0), worker(8, 0), worker(0, 0)];
        let picks: Vec<usize> =
            (0..100).map(|k| place(&REQ, &ws, Some((0.05, k as f64 / 100.0))).unwrap().worker).collect();
        assert!(picks.contains(&0) && picks.contains(&1), "equal workers share the load");
        // Worker 2 is 0.32 s slower: weight e^-6.4 ≈ 0.0017 of the total, below one draw in 100 here.
        assert!(!picks.contains(&2));
        // Infeasible workers are never sampled.
        let mut full = worker(8, 0);
        full.free_blocks = 0;
        let ws = [full, worker(0, 0)];
        assert!((0..50).all(|k| place(&REQ, &ws, Some((10.0, k as f64 / 50.0))).unwrap().worker == 1));
    }

    #[test]
    fn baselines() {
        let mut ws = [worker(0, 0), worker(30, 0), worker(0, 0)];
        ws[1].running = 4;
        ws[2].queued_tokens = 10;
        assert_eq!(prefix_overlap(&REQ, &ws).unwrap(), 1, "64 − 30 + 4 beats 64");
        assert_eq!(least_loaded(&ws).unwrap(), 0);
        ws[1].ready = false;
        assert_eq!(round_robin(&ws, 1).unwrap(), 2);
        assert_eq!(round_robin(&ws, 5).unwrap(), 2);
        for w in &mut ws {
            w.ready = false;
        }
        assert_eq!(round_robin(&ws, 0).unwrap_err(), PlacementError::NoReadyWorker);
        assert_eq!(least_loaded(&ws).unwrap_err(), PlacementError::NoReadyWorker);
    }
}
