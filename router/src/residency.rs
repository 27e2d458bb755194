//! The router's in-memory residency index: which worker holds which prefix block, in which tier (DESIGN §6).
//!
//! It owns one bounded map, block chain hash → holders `(worker, tier)`, fed by the kvstore's `Watch` deltas
//! ([`ResidencyIndex::apply`]), and the router's own *predicted* residency: when the router places a request on a
//! worker, that worker will hold the request's prefix within a step or two, long before the event comes back
//! through the kvstore, so [`ResidencyIndex::predict`] records it with an expiry. Without the prediction a burst of
//! requests sharing a system prompt would all see "no holder" and spread over every worker.
//!
//! Memory is bounded by `max_blocks`: beyond it the oldest inserted hashes go first (a FIFO of hashes; an entry
//! that was refreshed later is kept by a generation check). Prefix matching walks a request's chain from its first
//! block and stops per worker at the first block that worker lacks, so a hit count is always a usable prefix.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use crate::placement::{HitTier, TierHits};

/// A worker's slot in the caller's worker list.
pub type WorkerIdx = u16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    worker: WorkerIdx,
    tier: HitTier,
    /// Encoded bytes of the copy, as its holder reported them (0: not reported, or a prediction).
    bytes: u32,
    /// `Some(t)`: predicted by this router, valid until `t`; `None`: reported by the worker through the kvstore.
    predicted_until: Option<Instant>,
}

#[derive(Debug, Default)]
struct Entry {
    holders: Vec<Holder>,
    generation: u64,
}

/// One residency change from the kvstore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResidencyDelta {
    /// `bytes`: the copy's encoded size as the worker reported it (0 when it did not; above `u32::MAX` is taken
    /// as not reported, since no block group is that large).
    Stored {
        hash: u64,
        worker: WorkerIdx,
        tier: HitTier,
        bytes: u64,
    },
    Removed {
        hash: u64,
        worker: WorkerIdx,
        tier: HitTier,
    },
}

/// See the module docs.
#[derive(Debug)]
pub struct ResidencyIndex {
    entries: HashMap<u64, Entry>,
    order: VecDeque<(u64, u64)>,
    next_generation: u64,
    max_blocks: usize,
}

impl ResidencyIndex {
    pub fn new(max_blocks: usize) -> ResidencyIndex {
        ResidencyIndex {
            entries: HashMap::new(),
            order: VecDeque::new(),
            next_generation: 0,
            max_blocks: max_blocks.max(1),
        }
    }

    /// Distinct block hashes held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn touch(&mut self, hash: u64) -> &mut Entry {
        self.next_generation += 1;
        let generation = self.next_generation;
        self.order.push_back((hash, generation));
        let e = self.entries.entry(hash).or_default();
        e.generation = generation;
        e
    }

    fn enforce_bound(&mut self) {
        while self.entries.len() > self.max_blocks || self.order.len() > 2 * self.max_blocks {
            let Some((hash, generation)) = self.order.pop_front() else { break };
            if self.entries.get(&hash).is_some_and(|e| e.generation == generation) {
                self.entries.remove(&hash);
            }
        }
    }

    /// Applies one delta from the kvstore. A reported holder replaces a prediction for the same (worker, tier).
    pub fn apply(&mut self, delta: ResidencyDelta) {
        match delta {
            ResidencyDelta::Stored { hash, worker, tier, bytes } => {
                let bytes = u32::try_from(bytes).unwrap_or(0);
                let e = self.touch(hash);
                e.holders.retain(|h| !(h.worker == worker && h.tier == tier));
                e.holders.push(Holder { worker, tier, bytes, predicted_until: None });
                self.enforce_bound();
            }
            ResidencyDelta::Removed { hash, worker, tier } => {
                if let Some(e) = self.entries.get_mut(&hash) {
                    e.holders.retain(|h| !(h.worker == worker && h.tier == tier));
                    if e.holders.is_empty() {
                        self.entries.remove(&hash);
                    }
                }
            }
        }
    }

    /// Drops everything known about `worker` (its lease expired, or it restarted with a new epoch and a snapshot
    /// follows).
    pub fn remove_worker(&mut self, worker: WorkerIdx) {
        self.entries.retain(|_, e| {
            e.holders.retain(|h| h.worker != worker);
            !e.holders.is_empty()
        });
    }

    /// Drops what `worker` reported, keeping this router's predictions for it (a snapshot of the worker follows).
    pub fn remove_reported(&mut self, worker: WorkerIdx) {
        self.entries.retain(|_, e| {
            e.holders.retain(|h| h.worker != worker || h.predicted_until.is_some());
            !e.holders.is_empty()
        });
    }

    /// Drops every reported holder, keeping predictions (a full directory snapshot follows).
    pub fn clear_reported(&mut self) {
        self.entries.retain(|_, e| {
            e.holders.retain(|h| h.predicted_until.is_some());
            !e.holders.is_empty()
        });
    }

    /// Records that `worker` is about to hold `hashes` on device, until `until` unless a report confirms it.
    pub fn predict(&mut self, worker: WorkerIdx, hashes: &[u64], until: Instant) {
        for &hash in hashes {
            let e = self.touch(hash);
            if !e.holders.iter().any(|h| h.worker == worker && h.tier == HitTier::Device) {
                e.holders.push(Holder { worker, tier: HitTier::Device, bytes: 0, predicted_until: Some(until) });
            }
        }
        self.enforce_bound();
    }

    /// Matched prefix blocks of the chain `hashes` on each of `num_workers` workers, by the fastest tier each block
    /// is held in, with the reported size of each copy matched; expired predictions are ignored.
    pub fn match_prefix(&self, hashes: &[u64], num_workers: usize, now: Instant, out: &mut Vec<TierHits>) {
        out.clear();
        out.resize(num_workers, TierHits::default());
        let mut remaining = num_workers;
        for (matched, hash) in hashes.iter().enumerate() {
            if remaining == 0 {
                break;
            }
            let holders = self.entries.get(hash).map(|e| e.holders.as_slice()).unwrap_or(&[]);
            for (w, hits) in out.iter_mut().enumerate() {
                // A worker's chain is still unbroken when it matched every block so far (no scratch to allocate).
                if hits.total() as usize != matched {
                    continue;
                }
                let best = holders
                    .iter()
                    .filter(|h| h.worker as usize == w && h.predicted_until.is_none_or(|t| t > now))
                    .min_by_key(|h| h.tier);
                match best {
                    Some(h) if h.bytes > 0 => hits.add_sized(h.tier, u64::from(h.bytes)),
                    Some(h) => hits.add(h.tier, 1),
                    None => remaining -= 1,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn stored(hash: u64, worker: WorkerIdx, tier: HitTier) -> ResidencyDelta {
        ResidencyDelta::Stored { hash, worker, tier, bytes: 0 }
    }

    #[test]
    fn matches_contiguous_prefixes_by_fastest_tier() {
        let mut idx = ResidencyIndex::new(100);
        for h in [1, 2, 3] {
            idx.apply(stored(h, 0, HitTier::Device));
        }
        idx.apply(stored(1, 1, HitTier::Host));
        idx.apply(stored(2, 1, HitTier::Disk));
        idx.apply(stored(2, 1, HitTier::Device));
        // Worker 1 lacks block 3 but holds 4: the chain breaks at 3.
        idx.apply(stored(4, 1, HitTier::Device));
        let mut out = Vec::new();
        idx.match_prefix(&[1, 2, 3, 4], 3, Instant::now(), &mut out);
        assert_eq!(out[0].blocks(), [3, 0, 0, 0]);
        assert_eq!(out[1].blocks(), [1, 1, 0, 0]);
        assert_eq!(out[2], TierHits::default());
        idx.apply(ResidencyDelta::Removed { hash: 1, worker: 0, tier: HitTier::Device });
        idx.match_prefix(&[1, 2, 3, 4], 3, Instant::now(), &mut out);
        assert_eq!(out[0].total(), 0, "a removed first block leaves no usable prefix");
    }

    /// Each matched copy counts at the size its holder reported; a copy of unknown size at the caller's group size.
    #[test]
    fn matched_copies_carry_their_reported_size() {
        let mut idx = ResidencyIndex::new(100);
        idx.apply(ResidencyDelta::Stored { hash: 1, worker: 0, tier: HitTier::Disk, bytes: 1_000 });
        idx.apply(ResidencyDelta::Stored { hash: 2, worker: 0, tier: HitTier::Disk, bytes: 2_500 });
        idx.apply(stored(3, 0, HitTier::Disk));
        // Larger than any block group: not a size, so priced as unknown.
        idx.apply(ResidencyDelta::Stored { hash: 4, worker: 0, tier: HitTier::Host, bytes: u64::MAX });
        // Held on device too: the device copy is the one matched, and it loads for nothing.
        idx.apply(ResidencyDelta::Stored { hash: 5, worker: 0, tier: HitTier::Disk, bytes: 9_000 });
        idx.apply(stored(5, 0, HitTier::Device));
        let mut out = Vec::new();
        idx.match_prefix(&[1, 2, 3, 4, 5], 1, Instant::now(), &mut out);
        assert_eq!(out[0].blocks(), [1, 1, 3, 0]);
        assert_eq!(out[0].load_bytes(HitTier::Disk, 700), 1_000.0 + 2_500.0 + 700.0);
        assert_eq!(out[0].load_bytes(HitTier::Host, 700), 700.0);
        // A newer report of the same copy replaces its size.
        idx.apply(ResidencyDelta::Stored { hash: 1, worker: 0, tier: HitTier::Disk, bytes: 400 });
        idx.match_prefix(&[1, 2], 1, Instant::now(), &mut out);
        assert_eq!(out[0].load_bytes(HitTier::Disk, 700), 400.0 + 2_500.0);
    }

    #[test]
    fn predictions_count_until_they_expire_and_reports_replace_them() {
        let mut idx = ResidencyIndex::new(100);
        let t0 = Instant::now();
        idx.predict(2, &[7, 8], t0 + Duration::from_secs(5));
        let mut out = Vec::new();
        idx.match_prefix(&[7, 8], 3, t0, &mut out);
        assert_eq!(out[2].get(HitTier::Device), 2);
        idx.match_prefix(&[7, 8], 3, t0 + Duration::from_secs(6), &mut out);
        assert_eq!(out[2].total(), 0, "expired");
        idx.apply(stored(7, 2, HitTier::Device));
        idx.match_prefix(&[7, 8], 3, t0 + Duration::from_secs(6), &mut out);
        assert_eq!(out[2].get(HitTier::Device), 1, "the report for block 7 never expires");
    }

    #[test]
    fn memory_stays_bounded_and_workers_can_be_dropped() {
        let mut idx = ResidencyIndex::new(1000);
        for h in 0..10_000u64 {
            idx.apply(stored(h, (h % 3) as WorkerIdx, HitTier::Device));
            assert!(idx.len() <= 1000 && idx.order.len() <= 2000);
        }
        let mut out = Vec::new();
        idx.match_prefix(&[9_999], 3, Instant::now(), &mut out);
        assert_eq!(out[0].total(), 1, "the newest survive");
        idx.match_prefix(&[0], 3, Instant::now(), &mut out);
        assert_eq!(out[0].total(), 0, "the oldest went first");
        idx.remove_worker(0);
        assert!(idx.entries.values().all(|e| e.holders.iter().all(|h| h.worker != 0)));
    }

    #[test]
    fn dropping_reports_keeps_this_routers_predictions() {
        let mut idx = ResidencyIndex::new(100);
        let until = Instant::now() + Duration::from_secs(60);
        idx.apply(stored(1, 0, HitTier::Device));
        idx.apply(stored(2, 1, HitTier::Host));
        idx.predict(0, &[3], until);
        idx.remove_reported(0);
        let mut out = Vec::new();
        idx.match_prefix(&[1], 2, Instant::now(), &mut out);
        assert_eq!(out[0].total(), 0, "the report is gone");
        idx.match_prefix(&[3], 2, Instant::now(), &mut out);
        assert_eq!(out[0].total(), 1, "the prediction stays");
        idx.match_prefix(&[2], 2, Instant::now(), &mut out);
        assert_eq!(out[1].total(), 1, "other workers are untouched");
        idx.clear_reported();
        idx.match_prefix(&[2], 2, Instant::now(), &mut out);
        assert_eq!(out[1].total(), 0);
        assert_eq!(idx.len(), 1, "only the prediction is left");
    }
}

#[cfg(test)]
mod latency {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::placement::{RequestView, WorkerView, place};

    /// Decision latency with 100k blocks in the index (issue bar: p99 ≤ 200 µs):
    /// `cargo test --release -p pagoda-router --lib decision_latency -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement; run in release"]
    fn decision_latency_with_100k_blocks() {
        const WORKERS: usize = 4;
        const CHAIN: u64 = 256; // a 4K-token prompt in 16-token blocks
        let mut idx = ResidencyIndex::new(200_000);
        // 100k distinct blocks: 390 chains of 256, spread over the workers and tiers.
        for h in 0..100_000u64 {
            let tier = [HitTier::Device, HitTier::Host, HitTier::Disk][(h / CHAIN % 3) as usize];
            idx.apply(ResidencyDelta::Stored {
                hash: h,
                worker: (h / CHAIN % WORKERS as u64) as WorkerIdx,
                tier,
                bytes: 737_280,
            });
        }
        let view = WorkerView {
            ready: true,
            hits: TierHits::default(),
            prefill_tokens_per_s: 400.0,
            load_bytes_per_s: [0.0, 4e9, 1e9, 1e9],
            group_bytes: 737_280,
            queued_tokens: 0,
            running: 3,
            step_s: 0.02,
            free_blocks: 100_000,
            group_size: 90,
            adapter_load_s: 0.0,
            tie_rank: 0,
        };
        let req = RequestView { prompt_tokens: 4096, max_tokens: 256, block_size: 16, budget_tokens: None };
        let mut hits = Vec::new();
        let mut views = vec![view; WORKERS];
        let mut times = Vec::with_capacity(2000);
        for k in 0..2000u64 {
            let chain: Vec<u64> = (0..CHAIN).map(|j| (k % 390) * CHAIN + j).collect();
            let t = Instant::now();
            idx.match_prefix(&chain, WORKERS, t, &mut hits);
            for (v, h) in views.iter_mut().zip(&hits) {
                v.hits = *h;
            }
            let d = place(&req, &views, None).expect("a worker fits");
            times.push(t.elapsed());
            assert!(d.worker < WORKERS);
        }
        times.sort();
        let p = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
        println!("decision latency, 100k blocks, 4 workers, 256-block chain: p50 {:?} p99 {:?}", p(0.5), p(0.99));
        assert!(p(0.99) < Duration::from_micros(200), "p99 {:?}", p(0.99));
    }
}
