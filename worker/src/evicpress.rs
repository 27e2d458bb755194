//! EvicPress placement (DESIGN §5; `shared/papers/evicpress.txt` §4.2–4.4 and Algorithm 1), as a pure planner.
//!
//! It owns the per-context profiles (measured quality of every compression configuration, access frequency) and
//! the occupancy of each tier, and decides where each context's KV lives and in which configuration:
//!
//! - a **configuration** is (tier, codec, keep ratio): where the KV sits, how it is quantised, and what fraction of
//!   its tokens an eviction policy keeps;
//! - its **utility** is the paper's `U = (α · quality − load_time) · frequency`, with `quality` from the profiler
//!   (token agreement with the full-cache answer, in [0, 1]) and `load_time` the measured time to bring the
//!   compressed KV to the device (0 on device);
//! - a new context is inserted in its best-quality configuration on the top tier (Algorithm 1, lines 1–4); while a
//!   tier is over capacity, the planner applies the single operation with the **smallest utility drop** over all
//!   contexts on that tier — compress further in place, or move down a tier in any configuration — and repeats
//!   (lines 5–14); what moved down may in turn overflow the lower tier, which is resolved the same way. Below the
//!   last tier a context is dropped;
//! - a dropped context is not lost: its next request recomputes it, at full quality and the cost of a prefill. So
//!   the planner prices a drop as one more configuration, **recompute**, with `U = (α · 1 − prefill_time) ·
//!   frequency` from the measured prefill cost (per token and per attended position: a 4K-token context costs
//!   more than four 1K ones). That is what lets α trade a lossy codec against recomputing: at a small α a context
//!   is squeezed into a cheap codec to stay loadable, at a large α it is dropped rather than served from a variant
//!   that loses quality.
//!
//! The planner does no I/O: it returns the operations, and the tier stores carry them out. Profiles are bounded:
//! past `max_contexts` the least recently used context that holds no space is forgotten.

use std::collections::HashMap;

use thiserror::Error;

pub use crate::tiers::cost::PrefillCost;

/// A storage tier, fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Device,
    Host,
    Disk,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    fn index(self) -> usize {
        self as usize
    }

    fn below(self) -> Option<Tier> {
        match self {
            Tier::Device => Some(Tier::Host),
            Tier::Host => Some(Tier::Disk),
            Tier::Disk => None,
        }
    }
}

/// A compression variant the profiler measured: a codec (by name) and the fraction of tokens kept.
#[derive(Debug, Clone, PartialEq)]
pub struct Variant {
    pub codec: String,
    /// Bytes per token of KV (all layers and kv-heads) in this codec.
    pub bytes_per_token: f64,
    /// Fraction of the context's tokens an eviction policy keeps, in (0, 1].
    pub keep_ratio: f64,
    /// The context's last tokens stored in another format (KIVI's full-precision residual), if any.
    pub residual: Option<Residual>,
}

/// The tail of a context a variant stores in a wider format than the rest.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Residual {
    /// Tokens of the tail, a whole number of granules.
    pub tokens: u64,
    /// Bytes per token of the tail's format.
    pub bytes_per_token: f64,
}

/// Where and how one context's KV is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub tier: Tier,
    /// Index into the planner's variants.
    pub variant: usize,
}

/// One planned change, for the tier stores to carry out in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Operation {
    /// A new context stored in this placement.
    Insert { context: u64, to: Placement },
    /// Re-encode in place (same tier, smaller variant) or move down a tier.
    Change { context: u64, from: Placement, to: Placement },
    /// Evicted from the last tier: recompute on the next request.
    Drop { context: u64, from: Placement },
}

#[derive(Debug, Clone, PartialEq, Error)]
pub enum PlanError {
    #[error("variant {0} has no measured quality for this context")]
    NoQuality(usize),
    #[error("invalid planner setting: {0}")]
    Invalid(&'static str),
    #[error("unknown context {0:#x}")]
    UnknownContext(u64),
}

/// How Algorithm 1's greedy step ranks the candidate changes on an over-full tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum GreedyRule {
    /// The paper's rule (Algorithm 1, line 6): the change with the least utility drop, whatever it frees.
    #[default]
    Drop,
    /// The change with the least utility drop per byte it frees: the classic greedy of a knapsack, which ranks
    /// items by value density. The paper's rule prefers dropping a rarely used context whole (a small drop that
    /// frees all of it) to compressing a popular one a step (a slightly larger drop that frees half), and so keeps
    /// fewer contexts in a tier; per byte, compressing many contexts a little usually comes first.
    DropPerByte,
}

impl GreedyRule {
    /// The flag's names.
    const NAMES: [(&'static str, GreedyRule); 2] =
        [(GreedyRule::Drop.name(), GreedyRule::Drop), (GreedyRule::DropPerByte.name(), GreedyRule::DropPerByte)];

    /// The flag's name, also in the bench's configuration names.
    pub const fn name(self) -> &'static str {
        match self {
            GreedyRule::Drop => "drop",
            GreedyRule::DropPerByte => "per-byte",
        }
    }
}

impl std::str::FromStr for GreedyRule {
    type Err = String;

    fn from_str(s: &str) -> Result<GreedyRule, String> {
        parse_flag_value(s, &GreedyRule::NAMES)
    }
}

/// A flag's value by name among `choices`; the error names them all.
pub(crate) fn parse_flag_value<T: Copy>(s: &str, choices: &[(&str, T)]) -> Result<T, String> {
    choices.iter().find(|(name, _)| *name == s).map(|(_, v)| *v).ok_or_else(|| {
        let names: Vec<&str> = choices.iter().map(|(name, _)| *name).collect();
        format!("expected {}, got {:?}", names.join(" or "), s.chars().take(32).collect::<String>())
    })
}

/// The planner's fixed inputs.
#[derive(Debug, Clone)]
pub struct PlannerConfig {
    /// EvicPress's trade-off α (quality per second of load time).
    pub alpha: f64,
    /// Tier capacities in bytes, in [`Tier`] order.
    pub capacity: [u64; 3],
    /// Measured load bandwidth of each tier to the device, bytes/s ([`Tier::Device`]'s is unused).
    pub bandwidth: [f64; 3],
    /// Measured price of a prefill (per token and per attended position): the price of recomputing a dropped
    /// context.
    pub prefill: PrefillCost,
    /// The measured compression variants; index 0 should be the lossless one.
    pub variants: Vec<Variant>,
    /// Tokens per stored group: a pruned copy's kept tokens are stored in whole groups, so its size rounds up.
    pub granule_tokens: u64,
    /// Profiles kept at most.
    pub max_contexts: usize,
    /// How the greedy step ranks changes.
    pub greedy: GreedyRule,
}

#[derive(Debug, Clone)]
struct Context {
    tokens: u64,
    frequency: f64,
    /// Measured quality per variant (None = not profiled: never chosen).
    quality: Vec<Option<f64>>,
    placement: Option<Placement>,
    last_use: u64,
    /// Online quality observations since the last profile.
    observed_n: u32,
    observed_sum: f64,
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct Planner {
    cfg: PlannerConfig,
    contexts: HashMap<u64, Context>,
    used: [u64; 3],
    clock: u64,
}

impl Planner {
    pub fn new(cfg: PlannerConfig) -> Result<Planner, PlanError> {
        if !(cfg.alpha.is_finite() && cfg.alpha >= 0.0) {
            return Err(PlanError::Invalid("alpha must be finite and non-negative"));
        }
        if cfg.granule_tokens == 0 {
            return Err(PlanError::Invalid("granule must be at least one token"));
        }
        if cfg.variants.is_empty() {
            return Err(PlanError::Invalid("at least one variant"));
        }
        for v in &cfg.variants {
            if !(v.bytes_per_token.is_finite() && v.bytes_per_token > 0.0 && v.keep_ratio > 0.0 && v.keep_ratio <= 1.0)
            {
                return Err(PlanError::Invalid("variant sizes must be positive and keep ratios in (0, 1]"));
            }
            if v.residual.is_some_and(|r| !(r.bytes_per_token.is_finite() && r.bytes_per_token > 0.0)) {
                return Err(PlanError::Invalid("a residual's size must be positive"));
            }
        }
        if cfg.bandwidth[1..].iter().any(|b| !(b.is_finite() && *b > 0.0)) {
            return Err(PlanError::Invalid("host and disk bandwidths must be positive"));
        }
        if !cfg.prefill.is_valid() {
            return Err(PlanError::Invalid("prefill cost must be finite, per token positive"));
        }
        Ok(Planner { cfg, contexts: HashMap::new(), used: [0; 3], clock: 0 })
    }

    /// Bytes in use per tier.
    pub fn used(&self) -> [u64; 3] {
        self.used
    }

    /// Tier capacities in bytes, in [`Tier`] order.
    pub fn capacity(&self) -> [u64; 3] {
        self.cfg.capacity
    }

    /// Contexts profiled and not forgotten.
    pub fn len(&self) -> usize {
        self.contexts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.contexts.is_empty()
    }

    /// Replaces the load bandwidths and the prefill cost with fresh measurements (non-positive or non-finite ones
    /// are ignored), so `load_time` and the price of a recompute follow the cost model as it learns.
    pub fn set_costs(&mut self, bandwidth: [f64; 3], prefill: PrefillCost) {
        for (t, b) in bandwidth.into_iter().enumerate().skip(1) {
            if b.is_finite() && b > 0.0 {
                self.cfg.bandwidth[t] = b;
            }
        }
        if prefill.is_valid() {
            self.cfg.prefill = prefill;
        }
    }

    /// The profiled quality of each variant for `context`.
    pub fn quality(&self, context: u64) -> Option<&[Option<f64>]> {
        self.contexts.get(&context).map(|c| c.quality.as_slice())
    }

    pub fn placement(&self, context: u64) -> Option<Placement> {
        self.contexts.get(&context).and_then(|c| c.placement)
    }

    /// Bytes of `tokens` tokens in variant `v`: the kept tokens, in whole groups.
    pub fn bytes(&self, tokens: u64, v: usize) -> u64 {
        let var = &self.cfg.variants[v];
        let kept = crate::tiers::pruned::kept_tokens(tokens as usize, var.keep_ratio) as u64;
        let g = self.cfg.granule_tokens;
        let stored = kept.div_ceil(g) * g;
        let (tail, tail_bytes) = var.residual.map_or((0, 0.0), |r| {
            let t = r.tokens.min(stored);
            (t, t as f64 * r.bytes_per_token)
        });
        ((stored - tail) as f64 * var.bytes_per_token + tail_bytes).ceil() as u64
    }

    /// The next tier below `tier` that has any capacity: a tier of capacity 0 is not there (a worker without a
    /// disk tier), and moving a context into it would only be a slower way to drop it.
    fn existing_tier_below(&self, tier: Tier) -> Option<Tier> {
        let mut t = tier.below();
        while let Some(x) = t
            && self.cfg.capacity[x.index()] == 0
        {
            t = x.below();
        }
        t
    }

    /// Whether the stored variant `from` can be turned into `to` without the data it lacks: a copy keeps no more
    /// tokens and no more bytes per token than what it is made from (what was dropped or rounded away cannot be
    /// restored, so a larger variant would only claim a quality the stored KV no longer has).
    fn derivable(&self, from: usize, to: usize) -> bool {
        let (a, b) = (&self.cfg.variants[from], &self.cfg.variants[to]);
        b.keep_ratio <= a.keep_ratio && b.bytes_per_token <= a.bytes_per_token
    }

    /// Seconds to bring the context to the device from `p`.
    pub fn load_time(&self, tokens: u64, p: Placement) -> f64 {
        match p.tier {
            Tier::Device => 0.0,
            t => self.bytes(tokens, p.variant) as f64 / self.cfg.bandwidth[t.index()],
        }
    }

    /// Seconds to recompute `tokens` tokens from the start: the load time of a dropped context.
    pub fn recompute_time(&self, tokens: u64) -> f64 {
        self.cfg.prefill.secs(0, tokens as usize)
    }

    fn utility_of(&self, c: &Context, p: Option<Placement>) -> f64 {
        match p {
            // Dropped: the next request recomputes it, at full quality.
            None => (self.cfg.alpha - self.recompute_time(c.tokens)) * c.frequency,
            Some(p) => match c.quality[p.variant] {
                Some(q) => (self.cfg.alpha * q - self.load_time(c.tokens, p)) * c.frequency,
                None => f64::NEG_INFINITY,
            },
        }
    }

    /// `U` of `context` in placement `p` (None = dropped, so recomputed).
    pub fn utility(&self, context: u64, p: Option<Placement>) -> Result<f64, PlanError> {
        let c = self.contexts.get(&context).ok_or(PlanError::UnknownContext(context))?;
        Ok(self.utility_of(c, p))
    }

    /// Records (or replaces) the profiler's measured quality of each variant for `context`.
    pub fn set_profile(&mut self, context: u64, tokens: u64, quality: Vec<Option<f64>>) -> Result<(), PlanError> {
        if quality.len() != self.cfg.variants.len() {
            return Err(PlanError::Invalid("one quality entry per variant"));
        }
        if quality.iter().flatten().any(|q| !(q.is_finite() && (0.0..=1.0).contains(q))) {
            return Err(PlanError::Invalid("quality must be in [0, 1]"));
        }
        self.clock += 1;
        let clock = self.clock;
        let c = self.contexts.entry(context).or_insert(Context {
            tokens,
            frequency: 0.0,
            quality: Vec::new(),
            placement: None,
            last_use: clock,
            observed_n: 0,
            observed_sum: 0.0,
        });
        c.tokens = tokens;
        c.quality = quality;
        c.observed_n = 0;
        c.observed_sum = 0.0;
        self.forget_excess();
        Ok(())
    }

    /// Sets `variant`'s quality to `quality` in every profile that measured it, leaving the rest of each profile
    /// (and what requests were observed to get) as it was: profiles pooled over contexts, for a variant whose
    /// contexts differ less than one context's few probes can tell.
    pub fn set_variant_quality(&mut self, variant: usize, quality: f64) -> Result<(), PlanError> {
        if variant >= self.cfg.variants.len() {
            return Err(PlanError::Invalid("no such variant"));
        }
        if !(quality.is_finite() && (0.0..=1.0).contains(&quality)) {
            return Err(PlanError::Invalid("quality must be in [0, 1]"));
        }
        for c in self.contexts.values_mut() {
            if let Some(q) = c.quality.get_mut(variant).and_then(Option::as_mut) {
                *q = quality;
            }
        }
        Ok(())
    }

    /// Counts one access of `context` (the utility's frequency term).
    pub fn record_access(&mut self, context: u64) -> Result<(), PlanError> {
        self.clock += 1;
        let clock = self.clock;
        let c = self.contexts.get_mut(&context).ok_or(PlanError::UnknownContext(context))?;
        c.frequency += 1.0;
        c.last_use = clock;
        Ok(())
    }

    fn forget_excess(&mut self) {
        while self.contexts.len() > self.cfg.max_contexts.max(1) {
            let victim = self.contexts.iter().filter(|(_, c)| c.placement.is_none()).min_by_key(|(_, c)| c.last_use);
            let Some((&id, _)) = victim else { break };
            self.contexts.remove(&id);
        }
    }

    fn set_placement(&mut self, context: u64, to: Option<Placement>) {
        let Some(c) = self.contexts.get(&context) else { return };
        let (tokens, from) = (c.tokens, c.placement);
        if let Some(p) = from {
            self.used[p.tier.index()] -= self.bytes(tokens, p.variant);
        }
        if let Some(p) = to {
            self.used[p.tier.index()] += self.bytes(tokens, p.variant);
        }
        if let Some(c) = self.contexts.get_mut(&context) {
            c.placement = to;
        }
    }

    /// Algorithm 1: stores a new (profiled) context in its best-quality variant on the device tier, then relieves
    /// every tier that overflowed. Returns the operations in the order to apply them.
    pub fn insert(&mut self, context: u64) -> Result<Vec<Operation>, PlanError> {
        let c = self.contexts.get(&context).ok_or(PlanError::UnknownContext(context))?;
        // Line 1: r_i = argmax_r Q_i(r); ties go to the smaller variant.
        let mut best: Option<(usize, f64, u64)> = None;
        for (v, q) in c.quality.iter().enumerate() {
            let Some(q) = *q else { continue };
            let size = self.bytes(c.tokens, v);
            if best.is_none_or(|(_, bq, bs)| q > bq || (q == bq && size < bs)) {
                best = Some((v, q, size));
            }
        }
        let Some((variant, _, _)) = best else { return Err(PlanError::NoQuality(0)) };
        let mut ops = Vec::new();
        if let Some(from) = c.placement {
            self.set_placement(context, None);
            ops.push(Operation::Drop { context, from });
        }
        let to = Placement { tier: Tier::Device, variant };
        self.set_placement(context, Some(to));
        ops.push(Operation::Insert { context, to });
        for tier in Tier::ALL {
            self.relieve(tier, &mut ops);
        }
        Ok(ops)
    }

    /// Lines 5–14 for one tier: while it is over capacity, apply the operation with the least utility drop.
    fn relieve(&mut self, tier: Tier, ops: &mut Vec<Operation>) {
        while self.used[tier.index()] > self.cfg.capacity[tier.index()] {
            let Some((context, from, to)) = self.cheapest_step(tier) else { break };
            self.set_placement(context, to);
            ops.push(match to {
                Some(to) => Operation::Change { context, from, to },
                None => Operation::Drop { context, from },
            });
        }
    }

    /// Over all contexts on `tier`, the change that frees space on it with the smallest utility drop, or drop per
    /// byte freed under [`GreedyRule::DropPerByte`] (ties: the one that frees more bytes, then the lower context
    /// id, so plans are deterministic).
    fn cheapest_step(&self, tier: Tier) -> Option<(u64, Placement, Option<Placement>)> {
        let lower = self.existing_tier_below(tier);
        let mut best: Option<(f64, u64, u64, Placement, Option<Placement>)> = None;
        for (&id, c) in &self.contexts {
            let Some(from) = c.placement.filter(|p| p.tier == tier) else { continue };
            let here = self.utility_of(c, Some(from));
            let size = self.bytes(c.tokens, from.variant);
            let mut consider = |to: Option<Placement>, freed: u64| {
                let drop = here - self.utility_of(c, to);
                let drop = match self.cfg.greedy {
                    GreedyRule::Drop => drop,
                    GreedyRule::DropPerByte => drop / freed as f64,
                };
                if !drop.is_finite() {
                    return;
                }
                let better = match best {
                    None => true,
                    Some((bd, bf, bid, _, _)) => drop < bd || (drop == bd && (freed > bf || (freed == bf && id < bid))),
                };
                if better {
                    best = Some((drop, freed, id, from, to));
                }
            };
            for v in 0..self.cfg.variants.len() {
                if c.quality[v].is_none() || !self.derivable(from.variant, v) {
                    continue;
                }
                // Compress in place: only variants that actually save space on this tier, and that the tier could
                // hold at all. A copy too big for the tier's whole capacity (the device's, with nothing of it
                // placed there) must move down anyway, and moving it down in that variant is its own candidate:
                // taking the in-place step first would commit to the variant by its quality loss alone, without
                // the lower tier's load time that decides between the variants there.
                let smaller = self.bytes(c.tokens, v);
                if smaller < size && smaller <= self.cfg.capacity[tier.index()] {
                    consider(Some(Placement { tier, variant: v }), size - smaller);
                }
                if let Some(lower) = lower {
                    consider(Some(Placement { tier: lower, variant: v }), size);
                }
            }
            if lower.is_none() {
                consider(None, size);
            }
        }
        best.map(|(_, _, id, from, to)| (id, from, to))
    }

    /// Whether recomputing `context` is worth more than reusing its stored copy, which loads in `load_secs` (0 when
    /// the device holds it, decoded). A copy only loses quality as it is compressed, and a prefill is the one way
    /// back to full precision; Algorithm 1 has no such step, because the paper's contexts do not change frequency
    /// after they are placed. Here they do: a context profiled and compressed after one access may be asked for
    /// dozens of times. The utility sets the price. The recomputed context would be inserted again (Algorithm 1
    /// at its current frequency, tried on a copy of the plan), and each expected reuse (the frequency so far, the
    /// utility's own predictor) gains `α · (q_new − q_copy)` over the copy. The prefill costs
    /// `recompute_time − load_secs`, once. False for an unplaced or unknown context, and when the insert would
    /// store it no better (so a context the tiers cannot hold better is never recomputed over and over).
    pub fn recompute_pays(&self, context: u64, load_secs: f64) -> bool {
        let Some(c) = self.contexts.get(&context) else { return false };
        let Some(Some(q_copy)) = c.placement.map(|p| c.quality[p.variant]) else { return false };
        let cost = self.recompute_time(c.tokens) - load_secs;
        let most = self.cfg.alpha * (c.quality.iter().flatten().fold(q_copy, |a, &b| a.max(b)) - q_copy) * c.frequency;
        // The trial insert below copies the plan: skip it when even the best variant would not pay.
        if !(most > 0.0 && most > cost) {
            return false;
        }
        let mut trial = self.clone();
        trial.set_placement(context, None);
        if trial.insert(context).is_err() {
            return false;
        }
        let Some(Some(q_new)) = trial.contexts.get(&context).and_then(|c| c.placement.map(|p| c.quality[p.variant]))
        else {
            return false;
        };
        let gain = self.cfg.alpha * (q_new - q_copy) * c.frequency;
        gain > 0.0 && gain > cost
    }

    /// Records the quality one served request actually got from `context`'s stored variant (token agreement with a
    /// full-cache answer, sampled by the profiler when the worker is idle). Returns true when the running mean has
    /// drifted below the profiled quality of that variant by more than `threshold` (relative): the paper's trigger
    /// to re-profile the context.
    pub fn observe_quality(&mut self, context: u64, quality: f64, threshold: f64) -> Result<bool, PlanError> {
        if !(quality.is_finite() && (0.0..=1.0).contains(&quality)) {
            return Err(PlanError::Invalid("quality must be in [0, 1]"));
        }
        let c = self.contexts.get_mut(&context).ok_or(PlanError::UnknownContext(context))?;
        let Some(p) = c.placement else { return Ok(false) };
        let Some(profiled) = c.quality[p.variant] else { return Ok(false) };
        c.observed_n += 1;
        c.observed_sum += quality;
        let mean = c.observed_sum / c.observed_n as f64;
        Ok(mean < profiled * (1.0 - threshold))
    }

    /// Records that the stores no longer hold `context`'s copy (a write was refused, a file was corrupt): its
    /// placement and the bytes it held are released, its profile and frequency are kept, so that the next insert
    /// plans it like any recomputed context.
    pub fn lose(&mut self, context: u64) {
        self.set_placement(context, None);
    }

    /// Removes a context's placement (its KV was lost or invalidated) without planning anything else.
    pub fn forget(&mut self, context: u64) {
        self.set_placement(context, None);
        self.contexts.remove(&context);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes per token: f32 K+V for SmolLM2 (30 layers × 3 kv-heads × 64 × 2 × 4) and two codecs.
    const F32: f64 = 46_080.0;

    fn planner(capacity: [u64; 3], alpha: f64) -> Planner {
        Planner::new(PlannerConfig {
            alpha,
            capacity,
            bandwidth: [0.0, 10e9, 1e9],
            prefill: PrefillCost::per_token(1000.0),
            variants: vec![
                Variant { codec: "native".into(), bytes_per_token: F32, keep_ratio: 1.0, residual: None },
                Variant { codec: "int8".into(), bytes_per_token: F32 / 4.0, keep_ratio: 1.0, residual: None },
                Variant { codec: "int4_kivi".into(), bytes_per_token: F32 / 8.0, keep_ratio: 0.5, residual: None },
            ],
            max_contexts: 1000,
            granule_tokens: 1,
            greedy: GreedyRule::Drop,
        })
        .unwrap()
    }

    #[test]
    fn utility_is_the_papers_formula() {
        let mut p = planner([u64::MAX; 3], 1.0);
        p.set_profile(1, 1000, vec![Some(1.0), Some(0.99), Some(0.9)]).unwrap();
        p.record_access(1).unwrap();
        p.record_access(1).unwrap();
        let host_int8 = Placement { tier: Tier::Host, variant: 1 };
        // (1 · 0.99 − 1000 · 11520 B / 10 GB/s) · 2
        let want = (0.99 - 1000.0 * 11_520.0 / 10e9) * 2.0;
        assert!((p.utility(1, Some(host_int8)).unwrap() - want).abs() < 1e-12);
        // Dropped = recomputed at full quality: (1 · 1 − 1000 tokens / 1000 tokens/s) · 2.
        assert_eq!(p.utility(1, None).unwrap(), 0.0);
        p.set_costs([0.0, f64::NAN, -1.0], PrefillCost::per_token(500.0));
        assert_eq!(p.utility(1, None).unwrap(), (1.0 - 2.0) * 2.0);
        assert!((p.utility(1, Some(host_int8)).unwrap() - want).abs() < 1e-12, "bad bandwidths are ignored");
        // A recompute also pays for attention: 2 ms per token and 1 µs per attended position make 1,000 tokens
        // 2 s + 0.5005 s.
        p.set_costs([0.0; 3], PrefillCost { secs_per_token: 2e-3, secs_per_pair: 1e-6 });
        assert!((p.recompute_time(1000) - 2.5005).abs() < 1e-9);
        assert!((p.utility(1, None).unwrap() - (1.0 - 2.5005) * 2.0).abs() < 1e-9);
        // An invalid cost is ignored like a bad bandwidth.
        p.set_costs([0.0; 3], PrefillCost { secs_per_token: 1e-3, secs_per_pair: f64::NAN });
        assert!((p.recompute_time(1000) - 2.5005).abs() < 1e-9);
    }

    #[test]
    fn a_variants_quality_is_set_in_every_profile_that_measured_it() {
        let mut p = planner([u64::MAX; 3], 1.0);
        p.set_profile(1, 1000, vec![Some(1.0), Some(0.8), None]).unwrap();
        p.set_profile(2, 500, vec![Some(1.0), Some(0.95), Some(0.7)]).unwrap();
        p.record_access(2).unwrap();
        let host_int8 = Some(Placement { tier: Tier::Host, variant: 1 });
        let before = p.utility(2, host_int8).unwrap();
        p.set_variant_quality(1, 0.9).unwrap();
        assert_eq!(p.contexts[&1].quality, vec![Some(1.0), Some(0.9), None]);
        assert_eq!(p.contexts[&2].quality, vec![Some(1.0), Some(0.9), Some(0.7)]);
        // (α · q − load) · frequency with frequency 1: the utility moves by the quality's change.
        assert!((p.utility(2, host_int8).unwrap() - (before - 0.05)).abs() < 1e-12);
        assert_eq!(p.contexts[&2].frequency, 1.0, "accesses are kept");
        assert!(p.set_variant_quality(3, 0.5).is_err());
        assert!(p.set_variant_quality(1, 1.5).is_err());
        assert!(p.set_variant_quality(1, f64::NAN).is_err());
        assert_eq!(p.contexts[&1].quality[1], Some(0.9), "a refused call changes nothing");
    }

    #[test]
    fn a_copy_the_tier_cannot_hold_moves_down_in_the_variant_best_there() {
        // Nothing may stay on the device. int8 loses 4 ms of quality (α (1 − q) = 0.004), less than the native copy
        // takes to load from host (46.08 MB at 10 GB/s: 4.6 ms), but more than the native copy's extra load over
        // int8's (4.6 − 1.2 ms): on the host, native is worth more.
        let mut p = planner([0, u64::MAX, 0], 1.0);
        p.set_profile(1, 1000, vec![Some(1.0), Some(0.996), None]).unwrap();
        p.record_access(1).unwrap();
        let host = |variant| Some(Placement { tier: Tier::Host, variant });
        assert!(p.utility(1, host(0)).unwrap() > p.utility(1, host(1)).unwrap());
        // Compressing in place on the device would be the least drop of one step (4 ms against 4.6 ms), and the
        // move down would then keep int8.
        p.insert(1).unwrap();
        assert_eq!(p.placement(1), host(0));
    }

    #[test]
    fn a_lost_copy_releases_its_bytes_and_keeps_its_profile() {
        let mut p = planner([u64::MAX; 3], 1.0);
        p.set_profile(3, 100, vec![Some(1.0), Some(0.9), Some(0.8)]).unwrap();
        p.record_access(3).unwrap();
        p.insert(3).unwrap();
        assert!(p.used()[0] > 0);
        p.lose(3);
        assert_eq!((p.placement(3), p.used()), (None, [0; 3]));
        assert_eq!(p.quality(3), Some(&[Some(1.0), Some(0.9), Some(0.8)][..]), "the profile stays");
        // Placed again like any recomputed context, with its frequency: (1 · 1 − 0) · 2 on the device.
        p.record_access(3).unwrap();
        p.insert(3).unwrap();
        assert_eq!(p.utility(3, p.placement(3)).unwrap(), 2.0);
    }

    #[test]
    fn insert_takes_the_best_quality_variant_on_device() {
        let mut p = planner([u64::MAX; 3], 1.0);
        p.set_profile(7, 100, vec![Some(1.0), Some(1.0), Some(0.8)]).unwrap();
        let ops = p.insert(7).unwrap();
        // Lossless and int8 tie on quality: the smaller one wins the tie.
        assert_eq!(ops, vec![Operation::Insert { context: 7, to: Placement { tier: Tier::Device, variant: 1 } }]);
        assert_eq!(p.used()[0], 100 * 11_520);
    }

    #[test]
    fn a_full_tier_compresses_the_insensitive_context_and_keeps_the_sensitive_one() {
        // Room for one lossless 1000-token context and a bit.
        let cap = (1000.0 * F32 * 1.3) as u64;
        let mut p = planner([cap, u64::MAX, u64::MAX], 1.0);
        // Context 1 tolerates int4 (quality 0.97); context 2 does not (0.4).
        p.set_profile(1, 1000, vec![Some(1.0), Some(0.999), Some(0.97)]).unwrap();
        p.set_profile(2, 1000, vec![Some(1.0), Some(0.99), Some(0.4)]).unwrap();
        for id in [1, 2] {
            p.record_access(id).unwrap();
        }
        p.insert(1).unwrap();
        let ops = p.insert(2).unwrap();
        assert!(p.used()[0] <= cap, "{:?}", p.used());
        // The cheapest way to make room: compress the insensitive context rather than move anyone down.
        assert_eq!(p.placement(2).unwrap().tier, Tier::Device);
        assert_eq!(p.placement(1).unwrap().tier, Tier::Device);
        assert!(ops.iter().all(|o| !matches!(o, Operation::Drop { .. })), "{ops:?}");
        assert_ne!(p.placement(2).unwrap().variant, 2, "the sensitive context is never taken to int4");
    }

    #[test]
    fn overflow_cascades_down_the_tiers_and_drops_only_below_the_last() {
        let ctx = (1000.0 * F32) as u64;
        let mut p = planner([ctx, ctx, ctx], 1.0);
        for id in 0..8u64 {
            // Only lossless is allowed, so every relief is a move down.
            p.set_profile(id, 1000, vec![Some(1.0), None, None]).unwrap();
            for _ in 0..=id {
                p.record_access(id).unwrap();
            }
            p.insert(id).unwrap();
            for t in Tier::ALL {
                assert!(p.used()[t.index()] <= ctx, "tier {t:?} over capacity after inserting {id}");
            }
        }
        // The most frequently used context (7) sits on device; the least used were dropped.
        assert_eq!(p.placement(7).unwrap().tier, Tier::Device);
        let kept: Vec<u64> = (0..8).filter(|id| p.placement(*id).is_some()).collect();
        assert_eq!(kept.len(), 3, "one per tier: {kept:?}");
        assert!(kept.iter().all(|&id| id >= 5), "the frequent ones stay: {kept:?}");
    }

    #[test]
    fn alpha_trades_quality_for_load_time() {
        // Device fits nothing; host is fast for int4, lossless on disk is slow but perfect.
        let ctx = (4000.0 * F32) as u64;
        let run = |alpha: f64| {
            let mut p = planner([0, ctx / 8, u64::MAX], alpha);
            p.set_profile(1, 4000, vec![Some(1.0), Some(0.99), Some(0.85)]).unwrap();
            p.record_access(1).unwrap();
            p.insert(1).unwrap();
            p.placement(1).unwrap()
        };
        // α = 0.01: load time dominates, so the context is squeezed to int4 and kept on the fast host tier.
        assert_eq!(run(0.01), Placement { tier: Tier::Host, variant: 2 });
        // α = 100: quality dominates; lossless on disk (0.18 s to load) beats int4 on host (quality 0.85).
        assert_eq!(run(100.0), Placement { tier: Tier::Disk, variant: 0 });
    }

    #[test]
    fn alpha_trades_a_lossy_codec_against_recomputing() {
        // Only the 4000-token context's int4 variant (keep ratio 0.5) fits anywhere: on disk, 0.01 s to load.
        // Recomputing it takes 4 s at 1000 tokens/s.
        let int4 = (4000.0 * F32 / 16.0) as u64;
        let run = |alpha: f64| {
            let mut p = planner([0, 0, int4], alpha);
            p.set_profile(1, 4000, vec![Some(1.0), Some(0.99), Some(0.6)]).unwrap();
            p.record_access(1).unwrap();
            let ops = p.insert(1).unwrap();
            (p.placement(1), ops)
        };
        // α = 1: int4's 0.4 quality loss is worth less than 4 s of prefill, so the context stays, squeezed.
        let (kept, _) = run(1.0);
        assert_eq!(kept, Some(Placement { tier: Tier::Disk, variant: 2 }));
        // α = 20: 0.4 quality is worth 8 s, more than the recompute costs, so the context is dropped instead.
        let (dropped, ops) = run(20.0);
        assert_eq!(dropped, None);
        assert!(matches!(ops.last(), Some(Operation::Drop { context: 1, .. })), "{ops:?}");
    }

    #[test]
    fn the_per_byte_rule_compresses_a_big_context_where_the_papers_drops_a_small_one() {
        // Device room for 4500 lossless tokens, nothing below: relief is compress in place or drop (recompute at
        // 1000 tokens/s). Context 1 (4000 tokens, used 5 times) loses 0.3 in int8: compressing it costs
        // 1 · 0.3 · 5 = 1.5 and frees 3000 tokens' worth. Context 2 (1000 tokens, used once, int8 not profiled)
        // dropped costs its 1 s recompute · 1 = 1.0 and frees 1000 tokens' worth.
        let run = |greedy: GreedyRule| {
            let cap = (4500.0 * F32) as u64;
            let mut p = Planner::new(PlannerConfig { greedy, ..planner([cap, 0, 0], 1.0).cfg }).unwrap();
            p.set_profile(1, 4000, vec![Some(1.0), Some(0.7), None]).unwrap();
            p.set_profile(2, 1000, vec![Some(1.0), None, None]).unwrap();
            for _ in 0..5 {
                p.record_access(1).unwrap();
            }
            p.record_access(2).unwrap();
            p.insert(1).unwrap();
            p.insert(2).unwrap();
            assert!(p.used()[0] <= cap, "{:?}", p.used());
            (p.placement(1).map(|x| x.variant), p.placement(2).map(|x| x.variant))
        };
        // The paper's rule: the smaller drop (1.0 < 1.5), so context 2 is recomputed on its next request.
        assert_eq!(run(GreedyRule::Drop), (Some(0), None));
        // Per byte: 1.5 / 3000 < 1.0 / 1000, so context 1 goes to int8 and both stay.
        assert_eq!(run(GreedyRule::DropPerByte), (Some(1), Some(0)));
        assert_eq!("per-byte".parse(), Ok(GreedyRule::DropPerByte));
        assert_eq!("drop".parse::<GreedyRule>().map(GreedyRule::name), Ok("drop"));
        assert!("density".parse::<GreedyRule>().is_err());
    }

    #[test]
    fn recomputing_pays_once_a_lossy_copy_is_reused_often_enough() {
        // 1000 tokens recompute in 1 s at 1000 tok/s; int4 keeps 0.9 of the quality.
        let mut p = planner([0, 1 << 30, 0], 4.0);
        p.set_profile(1, 1000, vec![Some(1.0), Some(0.9), None]).unwrap();
        assert!(!p.recompute_pays(1, 0.0), "not placed: nothing to upgrade");
        p.record_access(1).unwrap();
        p.insert(1).unwrap();
        assert_eq!(p.placement(1).map(|pl| pl.variant), Some(0), "room for lossless");
        assert!(!p.recompute_pays(1, 0.0), "the copy is already the best");
        p.set_profile(1, 1000, vec![Some(1.0), Some(0.9), None]).unwrap();
        p.set_placement(1, Some(Placement { tier: Tier::Host, variant: 1 }));
        // Gain α·0.1·f = 0.4·f against 1 s of prefill less the load time.
        for (accesses, load, pays) in [(1, 0.0, false), (2, 0.0, false), (3, 0.0, true), (2, 0.3, true)] {
            while p.contexts[&1].frequency < accesses as f64 {
                p.record_access(1).unwrap();
            }
            assert_eq!(p.recompute_pays(1, load), pays, "{accesses} accesses, load {load} s");
        }
        assert!(!p.recompute_pays(2, 0.0), "unknown context");
        // Room for int8 (11.5 MB) but not lossless (46 MB): recomputing would store the same copy again.
        let mut tight = planner([0, 20_000_000, 0], 4.0);
        tight.set_profile(1, 1000, vec![Some(1.0), Some(0.9), None]).unwrap();
        (0..100).for_each(|_| tight.record_access(1).unwrap());
        tight.insert(1).unwrap();
        assert_eq!(tight.placement(1).map(|pl| pl.variant), Some(1));
        assert!(!tight.recompute_pays(1, 0.0), "no better placement to recompute for");
        assert_eq!(tight.used()[1], tight.bytes(1000, 1), "the trial leaves the plan as it was");
        let mut never = planner([0, 1 << 30, 0], 0.0);
        never.set_profile(1, 1000, vec![Some(1.0), Some(0.5), None]).unwrap();
        never.set_placement(1, Some(Placement { tier: Tier::Host, variant: 1 }));
        (0..100).for_each(|_| never.record_access(1).unwrap());
        assert!(!never.recompute_pays(1, 0.0), "α = 0 prices quality at nothing");
    }

    #[test]
    fn quality_drift_below_the_threshold_asks_for_a_reprofile() {
        let mut p = planner([u64::MAX; 3], 1.0);
        p.set_profile(3, 100, vec![Some(1.0), Some(0.98), None]).unwrap();
        p.insert(3).unwrap();
        assert!(!p.observe_quality(3, 0.99, 0.05).unwrap());
        assert!(!p.observe_quality(3, 0.95, 0.05).unwrap(), "mean 0.97 is within 5% of 1.0");
        assert!(p.observe_quality(3, 0.5, 0.05).unwrap(), "mean 0.81 drifted");
        // A fresh profile starts a fresh mean.
        p.set_profile(3, 100, vec![Some(0.8), Some(0.8), None]).unwrap();
        assert!(!p.observe_quality(3, 0.79, 0.05).unwrap());
        assert!(p.observe_quality(3, f64::NAN, 0.05).is_err());
    }

    #[test]
    fn a_pruned_copy_never_turns_back_into_a_whole_context() {
        // 1000 tokens: whole native 46 MB, a quarter kept 11.8 MB (250 tokens in 16 groups of 16), int2 5.8 MB.
        let variants = vec![
            Variant { codec: "native".into(), bytes_per_token: F32, keep_ratio: 1.0, residual: None },
            Variant { codec: "native@0.25".into(), bytes_per_token: F32, keep_ratio: 0.25, residual: None },
            Variant { codec: "int2".into(), bytes_per_token: F32 / 8.0, keep_ratio: 1.0, residual: None },
        ];
        let cfg = PlannerConfig { variants, granule_tokens: 16, ..planner([0, 12_000_000, 0], 1.0).cfg };
        let mut p = Planner::new(cfg).unwrap();
        assert_eq!(p.bytes(1000, 1), (256.0 * F32) as u64, "kept tokens round up to whole groups");
        assert_eq!(p.bytes(1000, 2), (1008.0 * F32 / 8.0) as u64);
        let q = vec![Some(1.0), Some(0.95), Some(0.5)];
        let mut ops = Vec::new();
        for c in 1..=3u64 {
            p.set_profile(c, 1000, q.clone()).unwrap();
            p.record_access(c).unwrap();
            ops.extend(p.insert(c).unwrap());
            assert!(p.used()[1] <= 12_000_000, "{:?}", p.used());
        }
        // No disk tier: the host keeps one pruned copy (the best use of its 12 MB), the others are dropped.
        let on_host: Vec<_> = (1..=3).filter_map(|c| p.placement(c)).collect();
        assert_eq!(on_host, [Placement { tier: Tier::Host, variant: 1 }], "{ops:?}");
        // int2 is smaller than the pruned copy, but it needs the tokens the copy dropped.
        assert!(
            !ops.iter()
                .any(|o| matches!(o, Operation::Change { from, to, .. } if from.variant == 1 && to.variant != 1)),
            "{ops:?}"
        );
    }

    #[test]
    fn bad_settings_and_profiles_are_rejected_and_profiles_are_bounded() {
        let mut cfg = planner([1; 3], 1.0).cfg.clone();
        cfg.alpha = f64::NAN;
        assert!(Planner::new(cfg.clone()).is_err());
        cfg.alpha = 1.0;
        cfg.prefill = PrefillCost { secs_per_token: 0.0, secs_per_pair: 1e-6 };
        assert!(Planner::new(cfg.clone()).is_err());
        cfg.prefill = PrefillCost { secs_per_token: 1e-3, secs_per_pair: -1e-9 };
        assert!(Planner::new(cfg.clone()).is_err());
        cfg.prefill = PrefillCost::per_token(1000.0);
        cfg.bandwidth[2] = 0.0;
        assert!(Planner::new(cfg).is_err());
        let mut p = planner([u64::MAX; 3], 1.0);
        assert!(p.set_profile(1, 10, vec![Some(1.0)]).is_err(), "one entry per variant");
        assert!(p.set_profile(1, 10, vec![Some(1.5), None, None]).is_err(), "quality in [0, 1]");
        assert_eq!(p.insert(99), Err(PlanError::UnknownContext(99)));
        let mut p = Planner::new(PlannerConfig { max_contexts: 10, ..planner([u64::MAX; 3], 1.0).cfg }).unwrap();
        for id in 0..100 {
            p.set_profile(id, 10, vec![Some(1.0), None, None]).unwrap();
        }
        assert!(p.contexts.len() <= 10);
    }
}
