//! The onboarding cost model: measured load bandwidth per tier and measured prefill speed, each an exponentially
//! weighted moving average updated as the engine runs. Onboarding `k` groups is worth it when loading them is
//! expected to take less time than recomputing their tokens.

use super::Tier;

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

#[derive(Debug, Clone)]
pub struct CostModel {
    /// Bytes per second, fetch + decode into device blocks, per tier ([`Tier::index`]).
    load_bw: [Ewma; 3],
    /// Tokens per second of prefill forward steps.
    prefill_tps: Ewma,
}

impl Default for CostModel {
    fn default() -> CostModel {
        // Priors until the first measurements: RAM copies at a few GB/s, a local disk at a few hundred MB/s, and a
        // CPU prefill of a small model at a few thousand tokens per second.
        CostModel { load_bw: [Ewma::new(8e9), Ewma::new(2e9), Ewma::new(3e8)], prefill_tps: Ewma::new(2e3) }
    }
}

impl CostModel {
    pub fn record_load(&mut self, tier: Tier, bytes: u64, secs: f64) {
        if secs > 0.0 {
            self.load_bw[tier.index()].update(bytes as f64 / secs);
        }
    }

    pub fn record_prefill(&mut self, tokens: usize, secs: f64) {
        if secs > 0.0 {
            self.prefill_tps.update(tokens as f64 / secs);
        }
    }

    pub fn load_bandwidth(&self, tier: Tier) -> f64 {
        self.load_bw[tier.index()].value()
    }

    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prefill_tps.value()
    }

    /// Expected seconds to load `bytes` from `tier`.
    pub fn load_secs(&self, tier: Tier, bytes: u64) -> f64 {
        bytes as f64 / self.load_bandwidth(tier).max(1.0)
    }

    /// Expected seconds to prefill `tokens`.
    pub fn prefill_secs(&self, tokens: usize) -> f64 {
        tokens as f64 / self.prefill_tokens_per_s().max(1e-3)
    }

    /// How many leading groups of `groups` (tier and encoded size each, in prefix order) to onboard, each standing
    /// for `tokens_per_group` tokens: the longest prefix whose expected load time beats recomputing it. Only a
    /// contiguous prefix can be adopted, so a slow group in the middle can still be worth loading when the groups
    /// around it are fast.
    pub fn plan(&self, groups: &[(Tier, u64)], tokens_per_group: usize) -> usize {
        let (mut load, mut best) = (0.0, 0);
        for (i, &(tier, bytes)) in groups.iter().enumerate() {
            load += self.load_secs(tier, bytes);
            if load < self.prefill_secs((i + 1) * tokens_per_group) {
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
        c.record_prefill(1000, 1.0);
        c.record_load(Tier::Host, 1_000_000_000, 1.0);
        c.record_load(Tier::Disk, 10_000_000, 1.0);
        let host = (Tier::Host, 1_000_000);
        let disk = (Tier::Disk, 1_000_000);
        assert_eq!(c.plan(&[host; 5], 16), 5);
        assert_eq!(c.plan(&[disk; 5], 16), 0);
        // A slow group between fast ones pays off once enough fast ones follow: after 7 host groups the
        // cumulative load (100 + 7 ms) beats recomputing 8 groups (128 ms).
        let mut mixed = vec![host, disk];
        mixed.extend([host; 6]);
        assert_eq!(c.plan(&mixed, 16), 8);
        // Prefill gets much faster: loading from host no longer pays.
        for _ in 0..50 {
            c.record_prefill(10_000_000, 1.0);
        }
        assert_eq!(c.plan(&[host; 5], 16), 0);
    }
}
