//! The router's placement state: it owns the residency index, the round-robin cursor and the ring of recent
//! decisions, and turns one request into an ordered list of workers to try (DESIGN §6).
//!
//! Until the kvstore feeds the index with the workers' block events, the index holds the router's own predictions
//! (Dynamo's "approximate" mode): after placing a full-cache request on a worker, the request's prefix blocks are
//! expected there for `prediction_ttl`. Load comes from the router's own in-flight accounting
//! ([`crate::workers::WorkerLoad`]): prompt tokens sent but not yet answered, and streams decoding. Free device
//! blocks come from the workers' `Stats`, polled with their health.
//!
//! The cost model itself is [`crate::placement`]; this module only gathers its inputs and keeps the record. It also
//! names, for the worker a request goes to, the peer that holds a longer prefix of it ([`Placer::peer_hint`]), so
//! that the worker may pull those blocks through `Transfer` rather than recompute them.

use std::collections::VecDeque;
use std::str::FromStr;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::placement::{
    CostBreakdown, HitTier, PlacementError, RequestView, TierHits, WorkerView, least_loaded, place, prefix_overlap,
    round_robin, tie_rank,
};
use crate::residency::{ResidencyIndex, WorkerIdx};

/// Which selector places requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Pagoda's cost model ([`crate::placement::place`]).
    Kv,
    /// Dynamo's `prefill_blocks − overlap + decode_blocks`.
    PrefixOverlap,
    LeastLoaded,
    RoundRobin,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Kv => "kv",
            Strategy::PrefixOverlap => "prefix_overlap",
            Strategy::LeastLoaded => "least_loaded",
            Strategy::RoundRobin => "round_robin",
        }
    }
}

impl FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Strategy, String> {
        match s {
            "kv" => Ok(Strategy::Kv),
            "prefix_overlap" => Ok(Strategy::PrefixOverlap),
            "least_loaded" => Ok(Strategy::LeastLoaded),
            "round_robin" => Ok(Strategy::RoundRobin),
            _ => Err(format!("unknown placement `{s}`; known: kv, prefix_overlap, least_loaded, round_robin")),
        }
    }
}

/// What a placement is for. Round robin keeps one turn per purpose, so that the two placements of a
/// disaggregated request do not both advance the whole requests' turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A whole request (prompt and decode): any worker but a prefill worker, unless only prefill workers are ready.
    Whole = 0,
    /// The prompt of a disaggregated request: prefill workers only.
    RemotePrefill = 1,
}

/// Placement settings.
#[derive(Debug, Clone)]
pub struct PlacerConfig {
    pub strategy: Strategy,
    /// Prefill speed assumed for every worker (tokens/s) until workers report measured speeds.
    pub prefill_tokens_per_s: f64,
    /// Decode time one running sequence adds to a step (seconds).
    pub decode_s_per_seq: f64,
    /// How long a predicted residency counts without a report.
    pub prediction_ttl: Duration,
    /// Sampling temperature over costs (seconds); `None` = always the cheapest.
    pub temperature: Option<f64>,
    /// Blocks the residency index holds at most.
    pub max_index_blocks: usize,
    /// Disaggregated serving: a request with at least this many prompt tokens to compute on the worker chosen for
    /// it has its prompt prefilled on a prefill worker first, when one is ready (0: never). Dynamo's
    /// `max_local_prefill_length` plays the same part.
    pub remote_prefill_min_tokens: u64,
    /// Conditional disaggregation: a prefill worker that already has this many prompt tokens queued (sent and not
    /// yet answered) takes no more remote prefills; the request's own worker prefills instead (0: no bound).
    /// Dynamo's `max_prefill_queue_size` in tokens.
    pub remote_prefill_max_queued_tokens: u64,
}

impl Default for PlacerConfig {
    fn default() -> PlacerConfig {
        PlacerConfig {
            strategy: Strategy::Kv,
            prefill_tokens_per_s: 400.0,
            decode_s_per_seq: 0.004,
            prediction_ttl: Duration::from_secs(120),
            temperature: None,
            max_index_blocks: 1 << 20,
            remote_prefill_min_tokens: 256,
            remote_prefill_max_queued_tokens: 0,
        }
    }
}

/// What the router knows about one worker right now, for placement.
#[derive(Debug, Clone, Copy, Default)]
pub struct WorkerSnapshot {
    pub ready: bool,
    /// Seconds the worker would spend loading the request's LoRA adapter first (0: loaded, or none asked).
    pub adapter_load_s: f64,
    pub queued_tokens: u64,
    pub decoding: u32,
    pub free_blocks: u64,
    pub group_size: u32,
    /// What the worker's `Stats` say its costs are ([`WorkerCosts`]).
    pub costs: WorkerCosts,
}

/// A worker's own measured costs, as its `Stats` last reported them: what placement prices its prefill and its
/// lower-tier loads with. A worker that does not say (an older one, or one that has not prefilled yet) is priced at
/// the mean speed of those that do, or at [`PlacerConfig::prefill_tokens_per_s`] when none does, and its
/// lower-tier hits load for free, as before workers reported.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkerCosts {
    /// Prompt tokens per second over its recent prefill-dominated steps.
    pub prefill_tokens_per_s: Option<f64>,
    /// Bytes of one block group in its device KV format (0: not reported).
    pub group_bytes: u64,
    /// Load bandwidth per tier in bytes/s, in [`HitTier`] order (the device's unused).
    /// Only a worker that pulls from peers reports the peer link's.
    pub load_bytes_per_s: [Option<f64>; 4],
    /// Its host tier's capacity (0: none, or not reported): a peer pull brings at most half of it.
    pub host_capacity_bytes: u64,
}

/// Bandwidths placement assumes for a tier a reporting worker gave none for (a tier it does not have, so a hit
/// there is unlikely), in [`HitTier`] order: the worker's own priors.
const PRIOR_LOAD_BYTES_PER_S: [f64; 4] = {
    use pagoda_worker::tiers::cost::PRIOR_LOAD_BYTES_PER_S as TIER_PRIORS;
    [0.0, TIER_PRIORS[1], TIER_PRIORS[2], pagoda_worker::transfer::PRIOR_PEER_BYTES_PER_S]
};

/// Largest prefill speed and bandwidth taken from a report; anything above is not a measurement.
const MAX_REPORTED_RATE: f64 = 1e13;
/// Largest block group taken from a report (a 1M-token-context model's group is far below).
const MAX_REPORTED_GROUP_BYTES: u64 = 1 << 32;

impl WorkerCosts {
    /// The costs a worker's `Stats` report, each value kept only when it is a plausible measurement (positive,
    /// finite, bounded): a report is input from another process.
    pub fn from_stats(stats: &pagoda_proto::worker::StatsResponse) -> WorkerCosts {
        let rate = |x: f64| (x.is_finite() && x > 0.0 && x <= MAX_REPORTED_RATE).then_some(x);
        let mut load_bytes_per_s = [None; 4];
        for b in &stats.load_bandwidth {
            if let Some(t) = crate::placement::HitTier::ALL.iter().position(|t| t.name() == b.tier).filter(|&i| i > 0) {
                load_bytes_per_s[t] = rate(b.bytes_per_s);
            }
        }
        WorkerCosts {
            prefill_tokens_per_s: rate(stats.prefill_tokens_per_s),
            group_bytes: if stats.kv_group_bytes <= MAX_REPORTED_GROUP_BYTES { stats.kv_group_bytes } else { 0 },
            load_bytes_per_s,
            host_capacity_bytes: stats
                .tiers
                .iter()
                .filter(|t| t.tier == "host")
                .map(|t| t.capacity_bytes)
                .max()
                .unwrap_or(0),
        }
    }

    /// The most blocks the worker pulls from a peer for one request ([`crate::disagg::pull_cap_blocks`]).
    pub fn pull_cap_blocks(&self) -> usize {
        crate::disagg::pull_cap_blocks(self.host_capacity_bytes, self.group_bytes)
    }

    /// The per-tier bandwidths a [`WorkerView`] takes: reported ones, priors for the rest.
    fn view_bandwidths(&self) -> [f64; 4] {
        std::array::from_fn(|i| self.load_bytes_per_s[i].unwrap_or(PRIOR_LOAD_BYTES_PER_S[i]).max(1.0))
    }
}

/// One candidate's part of a recorded decision.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateRecord {
    pub worker: String,
    pub hits_device: u32,
    pub hits_host: u32,
    pub hits_disk: u32,
    pub hits_peer: u32,
    /// The prefill speed this worker was priced at: its own measurement, else its peers' mean or the configured one.
    pub prefill_tokens_per_s: f64,
    pub prefill_s: f64,
    pub load_s: f64,
    pub queue_s: f64,
    pub total_s: f64,
    pub feasible: bool,
}

/// A recorded decision, for `/debug/placements` and the dashboard.
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRecord {
    pub request_id: String,
    pub strategy: Strategy,
    pub chosen: String,
    pub reason: String,
    pub prompt_tokens: u32,
    pub prompt_blocks: usize,
    pub decision_us: f64,
    pub candidates: Vec<CandidateRecord>,
}

/// One request as the placer sees it.
pub struct PlaceRequest<'a> {
    pub request_id: &'a str,
    pub hashes: &'a [u64],
    pub view: RequestView,
    /// Whether the request's blocks will be published as a prefix (full cache): only then is residency predicted.
    pub publishes_prefix: bool,
    /// The LoRA adapter the request runs with: only workers that have it loaded or load it on demand are
    /// candidates (the pool leaves the others out of the snapshots, and charges a worker that must load it the
    /// load's time in [`WorkerSnapshot::adapter_load_s`]; the selectors never see the adapter).
    pub lora: Option<&'a str>,
    /// Workers (by address) this request already failed on. They count as not ready, so that neither the decision
    /// nor the residency prediction goes to a worker the request will not use: a worker that answered Busy stays
    /// ready for everybody else, and would otherwise keep winning this request's prefix without serving it.
    pub exclude: &'a [String],
}

const RECENT_DECISIONS: usize = 64;

/// Another worker that holds more of a request's prefix than the one it goes to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeerHint {
    /// The peer's gRPC address.
    pub address: String,
    /// Leading prompt blocks the peer holds (device, host or disk).
    pub blocks: u32,
}

/// See the module docs.
pub struct Placer {
    cfg: PlacerConfig,
    index: ResidencyIndex,
    /// Round robin's turn, one per [`Purpose`].
    cursors: [usize; 2],
    rng: StdRng,
    recent: VecDeque<DecisionRecord>,
    hits: Vec<TierHits>,
    views: Vec<WorkerView>,
}

impl Placer {
    pub fn new(cfg: PlacerConfig) -> Placer {
        Placer {
            index: ResidencyIndex::new(cfg.max_index_blocks),
            cfg,
            cursors: [0; 2],
            rng: StdRng::from_os_rng(),
            recent: VecDeque::with_capacity(RECENT_DECISIONS),
            hits: Vec::new(),
            views: Vec::new(),
        }
    }

    pub fn config(&self) -> &PlacerConfig {
        &self.cfg
    }

    pub fn strategy(&self) -> Strategy {
        self.cfg.strategy
    }

    pub fn recent(&self) -> impl Iterator<Item = &DecisionRecord> {
        self.recent.iter().rev()
    }

    pub fn index_mut(&mut self) -> &mut ResidencyIndex {
        &mut self.index
    }

    /// Prompt blocks the last decision expected `worker` to hold in some tier.
    pub fn expected_hits(&self, worker: usize) -> u32 {
        self.hits.get(worker).map_or(0, |h| h.total())
    }

    /// After [`Placer::order`]: the ready worker other than `worker` holding the longest prefix of that request,
    /// when it is longer than what `worker` holds (ties go to the lower index). `names` are the workers' addresses.
    pub fn peer_hint(&self, worker: usize, names: &[&str]) -> Option<PeerHint> {
        let held = |i: usize| self.hits.get(i).map_or(0, |h| h.total() - h.get(HitTier::Peer));
        let local = held(worker);
        let (best, blocks) = (0..self.views.len())
            .filter(|&i| i != worker && self.views[i].ready)
            .map(|i| (i, held(i)))
            .fold(None, |acc: Option<(usize, u32)>, (i, n)| match acc {
                Some((_, m)) if m >= n => acc,
                _ => Some((i, n)),
            })?;
        let address = names.get(best)?;
        (blocks > local).then(|| PeerHint { address: address.to_string(), blocks })
    }

    /// Orders the workers to try for `req`: the chosen one first, then the rest of the ready ones, cheapest first.
    /// The decision is recorded (see [`Placer::recent`]) and, for a full-cache request, its residency predicted.
    pub fn order(
        &mut self,
        req: &PlaceRequest<'_>,
        workers: &[WorkerSnapshot],
        names: &[&str],
    ) -> Result<Vec<usize>, PlacementError> {
        self.order_for(req, workers, names, Purpose::Whole)
    }

    /// [`Placer::order`] for a placement of `purpose` (`workers` shows ready only the workers that take it).
    pub fn order_for(
        &mut self,
        req: &PlaceRequest<'_>,
        workers: &[WorkerSnapshot],
        names: &[&str],
        purpose: Purpose,
    ) -> Result<Vec<usize>, PlacementError> {
        let (order, record) = self.decide(req, workers, names, Some(purpose))?;
        if self.recent.len() == RECENT_DECISIONS {
            self.recent.pop_front();
        }
        self.recent.push_back(record);
        Ok(order)
    }

    /// The decision [`Placer::order`] would make for `req` now, without making it: nothing is recorded or
    /// predicted and the round-robin turn does not advance (`POST /debug/place`).
    pub fn explain(
        &mut self,
        req: &PlaceRequest<'_>,
        workers: &[WorkerSnapshot],
        names: &[&str],
    ) -> Result<DecisionRecord, PlacementError> {
        Ok(self.decide(req, workers, names, None)?.1)
    }

    fn decide(
        &mut self,
        req: &PlaceRequest<'_>,
        workers: &[WorkerSnapshot],
        names: &[&str],
        commit: Option<Purpose>,
    ) -> Result<(Vec<usize>, DecisionRecord), PlacementError> {
        let t0 = Instant::now();
        let first_block = req.hashes.first().copied().unwrap_or(0);
        self.index.match_prefix(req.hashes, workers.len(), t0, &mut self.hits);
        self.views.clear();
        // A worker that has not measured its prefill yet is priced like the ones that have (a fleet is mostly one
        // kind of machine): the configured speed would make it look slower or faster than its peers for no reason.
        let measured = workers.iter().filter_map(|w| w.costs.prefill_tokens_per_s);
        let (sum, n) = measured.fold((0.0, 0u32), |(s, n), x| (s + x, n + 1));
        let unmeasured_speed = if n > 0 { sum / f64::from(n) } else { self.cfg.prefill_tokens_per_s };
        for (i, (w, h)) in workers.iter().zip(&self.hits).enumerate() {
            self.views.push(WorkerView {
                tie_rank: tie_rank(names.get(i).copied().unwrap_or_default(), first_block),
                ready: w.ready,
                hits: *h,
                prefill_tokens_per_s: w.costs.prefill_tokens_per_s.unwrap_or(unmeasured_speed),
                // Device hits cost nothing to load; a worker that reports no group size loads for free.
                load_bytes_per_s: w.costs.view_bandwidths(),
                group_bytes: w.costs.group_bytes,
                queued_tokens: w.queued_tokens,
                running: w.decoding,
                step_s: self.cfg.decode_s_per_seq,
                free_blocks: w.free_blocks,
                group_size: w.group_size.max(1),
                adapter_load_s: w.adapter_load_s,
            });
        }
        let mut reason = String::new();
        let mut costs: Vec<Option<CostBreakdown>> =
            self.views.iter().map(|v| v.ready.then(|| crate::placement::cost(&req.view, v))).collect();
        let chosen = match self.cfg.strategy {
            Strategy::Kv => {
                let temp = self.cfg.temperature.map(|t| (t, self.rng.random::<f64>()));
                match place(&req.view, &self.views, temp) {
                    Ok(d) => {
                        costs = d.costs;
                        reason.push_str("lowest cost");
                        d.worker
                    }
                    Err(PlacementError::NoRoom { needed, most_free }) => {
                        reason = format!(
                            "no worker has room now (needs {needed} blocks, most free {most_free}); least loaded"
                        );
                        least_loaded(&self.views)?
                    }
                    Err(e) => return Err(e),
                }
            }
            Strategy::PrefixOverlap => {
                reason.push_str("prefill_blocks - overlap + decode_blocks");
                prefix_overlap(&req.view, &self.views)?
            }
            Strategy::LeastLoaded => {
                reason.push_str("fewest queued tokens, then running");
                least_loaded(&self.views)?
            }
            Strategy::RoundRobin => {
                reason.push_str("next in turn");
                let turn = commit.unwrap_or(Purpose::Whole) as usize;
                let cursor = self.cursors[turn].wrapping_add(1);
                if commit.is_some() {
                    self.cursors[turn] = cursor;
                }
                round_robin(&self.views, cursor)?
            }
        };
        let mut order: Vec<usize> = (0..workers.len()).filter(|&i| i != chosen && workers[i].ready).collect();
        order.sort_by(|&a, &b| {
            let c = |i: usize| costs[i].map_or(f64::INFINITY, |c| c.total_s);
            c(a).total_cmp(&c(b))
        });
        order.insert(0, chosen);
        if commit.is_some()
            && req.publishes_prefix
            && let Ok(w) = WorkerIdx::try_from(chosen)
        {
            self.index.predict(w, req.hashes, t0 + self.cfg.prediction_ttl);
        }
        let record = DecisionRecord {
            request_id: req.request_id.to_owned(),
            strategy: self.cfg.strategy,
            chosen: names.get(chosen).copied().unwrap_or_default().to_owned(),
            reason,
            prompt_tokens: req.view.prompt_tokens,
            prompt_blocks: req.hashes.len(),
            decision_us: t0.elapsed().as_secs_f64() * 1e6,
            candidates: costs
                .iter()
                .enumerate()
                .filter_map(|(i, c)| {
                    let c = (*c)?;
                    Some(CandidateRecord {
                        worker: names.get(i).copied().unwrap_or_default().to_owned(),
                        hits_device: c.hits.get(HitTier::Device),
                        hits_host: c.hits.get(HitTier::Host),
                        hits_disk: c.hits.get(HitTier::Disk),
                        hits_peer: c.hits.get(HitTier::Peer),
                        prefill_tokens_per_s: self.views.get(i).map_or(0.0, |v| v.prefill_tokens_per_s),
                        prefill_s: c.prefill_s,
                        load_s: c.load_s,
                        queue_s: c.queue_s,
                        total_s: c.total_s,
                        feasible: c.feasible,
                    })
                })
                .collect(),
        };
        Ok((order, record))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(queued: u64) -> WorkerSnapshot {
        WorkerSnapshot {
            ready: true,
            queued_tokens: queued,
            decoding: 0,
            free_blocks: 1_000_000,
            group_size: 90,
            adapter_load_s: 0.0,
            costs: WorkerCosts::default(),
        }
    }

    fn req<'a>(id: &'a str, hashes: &'a [u64]) -> PlaceRequest<'a> {
        PlaceRequest {
            request_id: id,
            hashes,
            view: RequestView {
                prompt_tokens: hashes.len() as u32 * 16 + 5,
                max_tokens: 32,
                block_size: 16,
                budget_tokens: None,
            },
            publishes_prefix: true,
            lora: None,
            exclude: &[],
        }
    }

    #[test]
    fn kv_placement_follows_its_own_predictions_and_records_why() {
        let mut p = Placer::new(PlacerConfig::default());
        let names = ["a", "b", "c"];
        let shared: Vec<u64> = (0..32).collect();
        let first = p.order(&req("r1", &shared), &[snap(0), snap(0), snap(0)], &names).unwrap();
        assert_eq!(first.len(), 3);
        // A second request with the same prefix goes where the first went, even though that worker is now busier.
        let mut load = [snap(0), snap(0), snap(0)];
        load[first[0]].queued_tokens = 500;
        let second = p.order(&req("r2", &shared), &load, &names).unwrap();
        assert_eq!(second[0], first[0]);
        let rec = p.recent().next().unwrap();
        assert_eq!(rec.request_id, "r2");
        assert_eq!(rec.candidates.iter().find(|c| c.worker == names[first[0]]).unwrap().hits_device, 32);
        // An unrelated prompt avoids the busy worker.
        let other: Vec<u64> = (100..132).collect();
        assert_ne!(p.order(&req("r3", &other), &load, &names).unwrap()[0], first[0]);
    }

    #[test]
    fn baselines_ignore_the_prefix() {
        let mut p = Placer::new(PlacerConfig { strategy: Strategy::RoundRobin, ..PlacerConfig::default() });
        let names = ["a", "b"];
        let h: Vec<u64> = (0..8).collect();
        let a = p.order(&req("1", &h), &[snap(0), snap(0)], &names).unwrap()[0];
        let b = p.order(&req("2", &h), &[snap(0), snap(0)], &names).unwrap()[0];
        assert_ne!(a, b, "round robin alternates");
        let mut p = Placer::new(PlacerConfig { strategy: Strategy::LeastLoaded, ..PlacerConfig::default() });
        assert_eq!(p.order(&req("3", &h), &[snap(9), snap(1)], &names).unwrap()[0], 1);
        let mut down = snap(0);
        down.ready = false;
        assert_eq!(p.order(&req("4", &h), &[down, snap(5)], &names).unwrap(), vec![1]);
        assert!(p.order(&req("5", &h), &[down, down], &names).is_err());
    }

    #[test]
    fn no_room_anywhere_falls_back_to_least_loaded_with_a_reason() {
        let mut p = Placer::new(PlacerConfig::default());
        let mut a = snap(50);
        let mut b = snap(10);
        a.free_blocks = 0;
        b.free_blocks = 0;
        let h: Vec<u64> = (0..8).collect();
        assert_eq!(p.order(&req("1", &h), &[a, b], &["a", "b"]).unwrap()[0], 1);
        assert!(p.recent().next().unwrap().reason.starts_with("no worker has room"));
    }

    #[test]
    fn peer_hint_names_the_worker_with_the_longest_prefix() {
        let mut p = Placer::new(PlacerConfig::default());
        let names = ["a", "b", "c"];
        let shared: Vec<u64> = (0..32).collect();
        let first = p.order(&req("r1", &shared), &[snap(0), snap(0), snap(0)], &names).unwrap()[0];
        // The same prompt again: the holder itself needs no hint, every other worker is pointed at it.
        p.order(&req("r2", &shared), &[snap(0), snap(0), snap(0)], &names).unwrap();
        assert_eq!(p.peer_hint(first, &names), None);
        let other = (first + 1) % 3;
        assert_eq!(p.peer_hint(other, &names), Some(PeerHint { address: names[first].into(), blocks: 32 }));
        // A holder that is down is never named.
        let mut snaps = [snap(0), snap(0), snap(0)];
        snaps[first].ready = false;
        p.order(&req("r3", &shared), &snaps, &names).unwrap();
        assert_eq!(p.peer_hint(other, &names), None);
        // An unrelated prompt: nobody holds more than anybody.
        let unrelated: Vec<u64> = (500..510).collect();
        p.order(&req("r4", &unrelated), &[snap(0), snap(0), snap(0)], &names).unwrap();
        assert!((0..3).all(|w| p.peer_hint(w, &names).is_none()));
    }

    fn reporting(prefill_tokens_per_s: f64, host: f64, disk: f64) -> WorkerCosts {
        WorkerCosts {
            prefill_tokens_per_s: Some(prefill_tokens_per_s),
            group_bytes: 737_280,
            load_bytes_per_s: [None, Some(host), Some(disk), None],
            host_capacity_bytes: 1 << 30,
        }
    }

    /// Each worker is priced with what it measured: a cold prompt goes to the worker that prefills faster, and of
    /// two workers holding the same prefix in a lower tier, to the one that loads it sooner. A worker that reports
    /// nothing keeps the configured speed and free lower-tier loads.
    #[test]
    fn workers_are_priced_with_their_reported_prefill_speed_and_tier_bandwidth() {
        use crate::placement::HitTier;
        use crate::residency::ResidencyDelta;
        let mut p = Placer::new(PlacerConfig::default());
        let names = ["slow", "fast"];
        let (mut slow, mut fast) = (snap(0), snap(0));
        slow.costs = reporting(400.0, 8e9, 3e8);
        fast.costs = reporting(4000.0, 8e9, 3e8);
        let cold: Vec<u64> = (0..64).collect();
        assert_eq!(p.order(&req("cold", &cold), &[slow, fast], &names).unwrap()[0], 1);
        let rec = p.recent().next().unwrap();
        let prefill = |w: &str| rec.candidates.iter().find(|c| c.worker == w).unwrap().prefill_s;
        assert!((prefill("slow") / prefill("fast") - 10.0).abs() < 1e-9, "{rec:?}");

        // The same 64 groups on host at one and on disk at the other, both at the same prefill speed.
        let mut p = Placer::new(PlacerConfig::default());
        let warm: Vec<u64> = (1000..1064).collect();
        for &hash in &warm {
            // Sizes not reported: priced at the workers' group size.
            p.index_mut().apply(ResidencyDelta::Stored { hash, worker: 0, tier: HitTier::Disk, bytes: 0 });
            p.index_mut().apply(ResidencyDelta::Stored { hash, worker: 1, tier: HitTier::Host, bytes: 0 });
        }
        let (mut on_disk, mut on_host) = (snap(0), snap(0));
        // A disk at 20 MB/s: 64 groups of 737 KB take 2.4 s to load from it, against 6 ms from host.
        on_disk.costs = reporting(4000.0, 8e9, 2e7);
        on_host.costs = reporting(4000.0, 8e9, 2e7);
        assert_eq!(p.order(&req("warm", &warm), &[on_disk, on_host], &["d", "h"]).unwrap()[0], 1);
        let rec = p.recent().next().unwrap();
        let load = |w: &str| rec.candidates.iter().find(|c| c.worker == w).unwrap().load_s;
        assert!((load("d") - 64.0 * 737_280.0 / 2e7).abs() < 1e-9, "{rec:?}");
        assert!((load("h") - 64.0 * 737_280.0 / 8e9).abs() < 1e-9, "{rec:?}");

        // Workers that report nothing: the configured speed, and lower-tier hits are free, as before reports.
        let (quiet_disk, quiet_host) = (snap(0), snap(0));
        p.order(&req("warm-again", &warm), &[quiet_disk, quiet_host], &["d", "h"]).unwrap();
        let rec = p.recent().next().unwrap();
        assert!(rec.candidates.iter().all(|c| c.load_s == 0.0), "{rec:?}");
        assert!(rec.candidates.iter().all(|c| c.prefill_tokens_per_s == 400.0), "{rec:?}");
        // One that has not measured yet beside two that have: priced at their mean, not the configured speed.
        let mut p = Placer::new(PlacerConfig::default());
        let (mut a, mut b, fresh) = (snap(0), snap(0), snap(0));
        a.costs.prefill_tokens_per_s = Some(1000.0);
        b.costs.prefill_tokens_per_s = Some(2000.0);
        p.order(&req("fresh", &cold), &[a, b, fresh], &["a", "b", "fresh"]).unwrap();
        let rec = p.recent().next().unwrap();
        let speeds: Vec<f64> = rec.candidates.iter().map(|c| c.prefill_tokens_per_s).collect();
        assert_eq!(speeds, [1000.0, 2000.0, 1500.0], "{rec:?}");
    }

    /// Two workers hold the same context on disk, one as int2 KIVI (what EvicPress may keep a cold context in) and
    /// one in the device format. The compressed copy loads in under a quarter of the bytes, so its holder wins
    /// even with the slower disk, and each load is priced at the bytes its holder reported.
    #[test]
    fn a_compressed_copy_is_priced_at_its_own_size() {
        use crate::placement::HitTier;
        use crate::residency::ResidencyDelta;
        const INT2_GROUP: u64 = 737_280 * 356 / 1600; // 3.56 bits per element against f16's 16
        let mut p = Placer::new(PlacerConfig::default());
        let context: Vec<u64> = (0..128).collect();
        for &hash in &context {
            let tier = HitTier::Disk;
            p.index_mut().apply(ResidencyDelta::Stored { hash, worker: 0, tier, bytes: 737_280 });
            p.index_mut().apply(ResidencyDelta::Stored { hash, worker: 1, tier, bytes: INT2_GROUP });
        }
        let (mut full, mut compressed) = (snap(0), snap(0));
        full.costs = reporting(2000.0, 8e9, 3e8);
        compressed.costs = reporting(2000.0, 8e9, 2e8);
        assert_eq!(p.order(&req("c", &context), &[full, compressed], &["full", "int2"]).unwrap()[0], 1);
        let rec = p.recent().next().unwrap();
        let load = |w: &str| rec.candidates.iter().find(|c| c.worker == w).unwrap().load_s;
        assert!((load("full") - 128.0 * 737_280.0 / 3e8).abs() < 1e-9, "{rec:?}");
        assert!((load("int2") - 128.0 * INT2_GROUP as f64 / 2e8).abs() < 1e-9, "{rec:?}");
    }

    /// A report is another process's input: implausible values are left out, not priced.
    #[test]
    fn reported_costs_keep_only_plausible_values() {
        use pagoda_proto::worker::{StatsResponse, TierBandwidth};
        let bw = |tier: &str, bytes_per_s: f64| TierBandwidth { tier: tier.into(), bytes_per_s };
        let stats = StatsResponse {
            prefill_tokens_per_s: f64::NAN,
            kv_group_bytes: u64::MAX,
            load_bandwidth: vec![
                bw("host", 5e9),
                bw("disk", -1.0),
                bw("peer", f64::INFINITY),
                bw("device", 1e9),
                bw("tape", 1e6),
            ],
            ..Default::default()
        };
        let c = WorkerCosts::from_stats(&stats);
        let expected = WorkerCosts {
            prefill_tokens_per_s: None,
            group_bytes: 0,
            load_bytes_per_s: [None, Some(5e9), None, None],
            host_capacity_bytes: 0,
        };
        assert_eq!(c, expected);
        let [_, _, disk, peer] = PRIOR_LOAD_BYTES_PER_S;
        assert_eq!(c.view_bandwidths(), [1.0, 5e9, disk, peer], "priors where the report said nothing usable");
        assert_eq!((disk, peer), (3e8, 1e8), "the worker's priors for disk and a peer link");
        let host = pagoda_proto::worker::TierUsage {
            tier: "host".into(),
            codec: String::new(),
            used_bytes: 0,
            capacity_bytes: 1 << 30,
        };
        let stats = StatsResponse {
            prefill_tokens_per_s: 812.5,
            kv_group_bytes: 737_280,
            tiers: vec![host],
            ..Default::default()
        };
        let c = WorkerCosts::from_stats(&stats);
        assert_eq!((c.prefill_tokens_per_s, c.group_bytes, c.host_capacity_bytes), (Some(812.5), 737_280, 1 << 30));
    }

    #[test]
    fn strategies_parse_by_name() {
        for s in [Strategy::Kv, Strategy::PrefixOverlap, Strategy::LeastLoaded, Strategy::RoundRobin] {
            assert_eq!(s.name().parse::<Strategy>().unwrap(), s);
        }
        assert!("random".parse::<Strategy>().is_err());
    }
}
