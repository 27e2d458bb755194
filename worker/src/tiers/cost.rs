//! The onboarding cost model: measured load bandwidth per tier and measured prefill speed, updated as the engine
//! runs. Onboarding `k` groups is worth it when loading them is expected to take less time than recomputing their
//! tokens.
//!
//! A prefill step's time is not proportional to its tokens alone: each token also attends to every position before
//! it, so a chunk deep in a long prompt is slower than the same chunk at its start (measured on SmolLM2 on 2 cores:
//! 1,018 prompt tokens/s for 1K-token prompts, 512 for 4K; `scripts/zipf-requests.py` on
//! `docs/bench-tiers-zipf-full-mix-noise.json`). One rate cannot price both, and a rate averaged over the
//! last few steps says whatever position those happened to sit at. So the model fits each step's time as
//! `a · tokens + b · attended pairs` (a token at position `p` attends `p + 1` positions), by least squares with
//! exponential forgetting, and prices a prefill of `n` tokens after `s` as `a · n + b · (n·s + n(n+1)/2)`.

use super::Tier;

/// Load bandwidth per tier ([`Tier::index`]) until the first load from it is measured: RAM copies at a few GB/s, a
/// local disk at a few hundred MB/s.
pub const PRIOR_LOAD_BYTES_PER_S: [f64; 3] = [8e9, 2e9, 3e8];

/// Weight of the newest sample.
const ALPHA: f64 = 0.2;

/// A moving average that starts from a prior and forgets it as samples come in.
#[derive(Debug, Clone, Copy)]
pub struct Ewma {
    value: f64,
    samples: u64,
}

impl Ewma {
    pub fn new(prior: f64) -> Ewma {
        Ewma { value: prior, samples: 0 }
    }

    pub fn update(&mut self, x: f64) {
        if !x.is_finite() || x <= 0.0 {
            return;
        }
        // The first sample replaces the prior outright: the prior is a guess, the sample a measurement.
        self.value = if self.samples == 0 { x } else { ALPHA * x + (1.0 - ALPHA) * self.value };
        self.samples += 1;
    }

    pub fn value(&self) -> f64 {
        self.value
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }
}

/// Positions attended by `tokens` prompt tokens that follow the first `start` (causal attention: the token at
/// position `p` attends `p + 1`).
pub fn attended_pairs(start: usize, tokens: usize) -> f64 {
    let (s, n) = (start as f64, tokens as f64);
    n * s + n * (n + 1.0) / 2.0
}

/// The price of a prefill: seconds per token (weights, norms, sampling) and per attended position (attention).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillCost {
    pub secs_per_token: f64,
    pub secs_per_pair: f64,
}

impl PrefillCost {
    /// A cost that grows with the tokens alone: `tokens_per_s`.
    pub fn per_token(tokens_per_s: f64) -> PrefillCost {
        PrefillCost { secs_per_token: 1.0 / tokens_per_s.max(1e-3), secs_per_pair: 0.0 }
    }

    /// Expected seconds to prefill `tokens` tokens that follow the first `start` of a sequence.
    pub fn secs(&self, start: usize, tokens: usize) -> f64 {
        self.secs_per_token * tokens as f64 + self.secs_per_pair * attended_pairs(start, tokens)
    }

    /// Whether it can price anything: finite, a positive per-token term and a non-negative attention term.
    pub fn is_valid(&self) -> bool {
        self.secs_per_token.is_finite()
            && self.secs_per_token > 0.0
            && self.secs_per_pair.is_finite()
            && self.secs_per_pair >= 0.0
    }
}

/// Weight kept by the older samples at each new one: about the last 50 prefill steps count.
const FIT_FORGETTING: f64 = 0.98;
/// Steps measured before the fit replaces the per-token rate.
const FIT_MIN_SAMPLES: u64 = 4;

/// Least squares of step time on (tokens, attended pairs), without an intercept, with exponential forgetting:
/// the discounted sums of the normal equations.
#[derive(Debug, Clone, Copy, Default)]
struct PrefillFit {
    tt: f64,
    tp: f64,
    pp: f64,
    ty: f64,
    py: f64,
    yy: f64,
    samples: u64,
}

impl PrefillFit {
    fn update(&mut self, tokens: f64, pairs: f64, secs: f64) {
        let k = FIT_FORGETTING;
        self.tt = k * self.tt + tokens * tokens;
        self.tp = k * self.tp + tokens * pairs;
        self.pp = k * self.pp + pairs * pairs;
        self.ty = k * self.ty + tokens * secs;
        self.py = k * self.py + pairs * secs;
        self.yy = k * self.yy + secs * secs;
        self.samples += 1;
    }

    /// Weighted squared error of `c` over the samples.
    fn residual(&self, c: PrefillCost) -> f64 {
        let (a, b) = (c.secs_per_token, c.secs_per_pair);
        self.yy - 2.0 * (a * self.ty + b * self.py) + a * a * self.tt + 2.0 * a * b * self.tp + b * b * self.pp
    }

    /// The best fit with both coefficients non-negative and a positive per-token term: the unconstrained solution
    /// when it is, else the better of the per-token-only fit and nothing (`None`: too few or degenerate samples).
    fn cost(&self) -> Option<PrefillCost> {
        if self.samples < FIT_MIN_SAMPLES || self.tt <= 0.0 {
            return None;
        }
        let per_token = PrefillCost { secs_per_token: self.ty / self.tt, secs_per_pair: 0.0 };
        let det = self.tt * self.pp - self.tp * self.tp;
        // Steps all at one depth cannot tell the terms apart: keep the per-token fit.
        let both = (det > 1e-9 * self.tt * self.pp).then(|| PrefillCost {
            secs_per_token: (self.ty * self.pp - self.py * self.tp) / det,
            secs_per_pair: (self.py * self.tt - self.ty * self.tp) / det,
        });
        [both, Some(per_token)]
            .into_iter()
            .flatten()
            .filter(PrefillCost::is_valid)
            .min_by(|x, y| self.residual(*x).total_cmp(&self.residual(*y)))
    }
}

#[derive(Debug, Clone)]
pub struct CostModel {
    /// Bytes per second, fetch + decode into device blocks, per tier ([`Tier::index`]).
    load_bw: [Ewma; 3],
    /// Tokens per second of prefill forward steps, whatever their depth (what `Stats` and the router are told).
    prefill_tps: Ewma,
    /// Step time against tokens and attended positions (what onboarding and placement price a recompute by).
    prefill_fit: PrefillFit,
}

impl Default for CostModel {
    fn default() -> CostModel {
        // Priors until the first measurements: RAM copies at a few GB/s, a local disk at a few hundred MB/s, and a
        // CPU prefill of a small model at a few thousand tokens per second.
        CostModel {
            load_bw: PRIOR_LOAD_BYTES_PER_S.map(Ewma::new),
            prefill_tps: Ewma::new(2e3),
            prefill_fit: PrefillFit::default(),
        }
    }
}

impl CostModel {
    pub fn record_load(&mut self, tier: Tier, bytes: u64, secs: f64) {
        if secs > 0.0 {
            self.load_bw[tier.index()].update(bytes as f64 / secs);
        }
    }

    /// One prefill-dominated step: `tokens` computed, attending `pairs` positions in all ([`attended_pairs`] summed
    /// over the step's sequences), in `secs`.
    pub fn record_prefill(&mut self, tokens: usize, pairs: f64, secs: f64) {
        if secs > 0.0 && secs.is_finite() && tokens > 0 && pairs.is_finite() && pairs >= 0.0 {
            self.prefill_tps.update(tokens as f64 / secs);
            self.prefill_fit.update(tokens as f64, pairs, secs);
        }
    }

    pub fn load_bandwidth(&self, tier: Tier) -> f64 {
        self.load_bw[tier.index()].value()
    }

    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prefill_tps.value()
    }

    /// The prefill speed once a step has measured it; `None` while it is still the prior.
    pub fn measured_prefill_tokens_per_s(&self) -> Option<f64> {
        (self.prefill_tps.samples() > 0).then(|| self.prefill_tps.value())
    }

    /// Expected seconds to load `bytes` from `tier`.
    pub fn load_secs(&self, tier: Tier, bytes: u64) -> f64 {
        bytes as f64 / self.load_bandwidth(tier).max(1.0)
    }

    /// The price of a prefill: the fit over tokens and attended positions once it has enough steps, the recent
    /// per-token rate before.
    pub fn prefill_cost(&self) -> PrefillCost {
        self.prefill_fit.cost().unwrap_or_else(|| PrefillCost::per_token(self.prefill_tokens_per_s()))
    }

    /// Expected seconds to prefill `tokens` tokens that follow the first `start` of a sequence.
    pub fn prefill_secs(&self, start: usize, tokens: usize) -> f64 {
        self.prefill_cost().secs(start, tokens)
    }

    /// How many leading groups of `groups` (tier and encoded size each, in prefix order, the first at token
    /// `start`) to onboard, each standing for `tokens_per_group` tokens: the longest prefix whose expected load
    /// time beats recomputing it. Only a contiguous prefix can be adopted, so a slow group in the middle can still
    /// be worth loading when the groups around it are fast.
    pub fn plan(&self, groups: &[(Tier, u64)], start: usize, tokens_per_group: usize) -> usize {
        let prefill = self.prefill_cost();
        let (mut load, mut best) = (0.0, 0);
        for (i, &(tier, bytes)) in groups.iter().enumerate() {
            load += self.load_secs(tier, bytes);
            if load < prefill.secs(start, (i + 1) * tokens_per_group) {
                best = i + 1;
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ewma_replaces_the_prior_then_averages() {
        let mut e = Ewma::new(100.0);
        e.update(10.0);
        assert_eq!(e.value(), 10.0);
        e.update(20.0);
        assert!((e.value() - 12.0).abs() < 1e-9);
        e.update(f64::NAN);
        e.update(-1.0);
        assert_eq!(e.samples(), 2);
    }

    #[test]
    fn plan_follows_measurements() {
        let mut c = CostModel::default();
        // Prefill 1000 tok/s: 16 tokens = 16 ms. Host 1 GB/s: a 1 MB group = 1 ms; disk 10 MB/s: 100 ms.
        assert_eq!(c.measured_prefill_tokens_per_s(), None, "the prior is not a measurement");
        c.record_prefill(1000, 0.0, 1.0);
        assert_eq!(c.measured_prefill_tokens_per_s(), Some(1000.0));
        c.record_load(Tier::Host, 1_000_000_000, 1.0);
        c.record_load(Tier::Disk, 10_000_000, 1.0);
        let host = (Tier::Host, 1_000_000);
        let disk = (Tier::Disk, 1_000_000);
        assert_eq!(c.plan(&[host; 5], 0, 16), 5);
        assert_eq!(c.plan(&[disk; 5], 0, 16), 0);
        // A slow group between fast ones pays off once enough fast ones follow: after 7 host groups the
        // cumulative load (100 + 7 ms) beats recomputing 8 groups (128 ms).
        let mut mixed = vec![host, disk];
        mixed.extend([host; 6]);
        assert_eq!(c.plan(&mixed, 0, 16), 8);
        // Prefill gets much faster: loading from host no longer pays.
        for _ in 0..50 {
            c.record_prefill(10_000_000, 0.0, 1.0);
        }
        assert_eq!(c.plan(&[host; 5], 0, 16), 0);
    }

    #[test]
    fn prefill_is_priced_by_tokens_and_the_positions_they_attend() {
        let mut c = CostModel::default();
        // A prefill whose steps cost 1 ms per token plus 1 µs per attended position, in 512-token chunks of prompts
        // of 1K to 4K tokens (what the engine records), with ±2% noise.
        let truth = PrefillCost { secs_per_token: 1e-3, secs_per_pair: 1e-6 };
        let mut noise = 0.98;
        for prompt in [1024, 4096, 2048, 3072, 1536] {
            for start in (0..prompt).step_by(512) {
                let n = 512.min(prompt - start);
                noise = if noise > 1.0 { 0.98 } else { 1.02 };
                c.record_prefill(n, attended_pairs(start, n), truth.secs(start, n) * noise);
            }
        }
        let fit = c.prefill_cost();
        assert!((fit.secs_per_token / truth.secs_per_token - 1.0).abs() < 0.05, "{fit:?}");
        assert!((fit.secs_per_pair / truth.secs_per_pair - 1.0).abs() < 0.05, "{fit:?}");
        // A 4K-token recompute costs more than four 1K ones, and a chunk deep in a prompt more than at its start.
        assert!(c.prefill_secs(0, 4096) > 4.0 * c.prefill_secs(0, 1024) * 1.5);
        assert!(c.prefill_secs(3584, 512) > 2.0 * c.prefill_secs(0, 512));
        // The flat rate averages whatever depth the last steps had; the fit does not depend on it.
        let flat = 4096.0 / c.prefill_tokens_per_s();
        assert!((flat - truth.secs(0, 4096)).abs() > (c.prefill_secs(0, 4096) - truth.secs(0, 4096)).abs());
    }

    #[test]
    fn the_prefill_fit_waits_for_samples_and_never_goes_negative() {
        let mut c = CostModel::default();
        // Before any step: the prior rate, 2,000 tokens/s.
        assert!((c.prefill_secs(0, 2000) - 1.0).abs() < 1e-9);
        // Steps all at one depth: the terms cannot be told apart, so the per-token fit prices them.
        for _ in 0..10 {
            c.record_prefill(500, attended_pairs(0, 500), 0.5);
        }
        let flat = c.prefill_cost();
        assert_eq!(flat.secs_per_pair, 0.0);
        assert!((flat.secs(0, 500) - 0.5).abs() < 1e-9);
        // Deeper steps that are faster (a noisy machine) would need a negative attention term: it is clamped away.
        for start in [1000, 2000, 3000, 4000] {
            c.record_prefill(500, attended_pairs(start, 500), 0.3);
        }
        assert!(c.prefill_cost().is_valid());
        // Nonsense samples are ignored.
        let before = c.prefill_cost();
        c.record_prefill(100, f64::NAN, 1.0);
        c.record_prefill(100, 10.0, f64::INFINITY);
        c.record_prefill(0, 0.0, 1.0);
        assert_eq!(c.prefill_cost(), before);
    }
}
