//! `pagoda bench tiers --workload zipf`: EvicPress against its baselines on reused long contexts (the EvicPress
//! paper's Figure 7 setting, scaled to this model and machine).
//!
//! The workload: `contexts` documents of `min_tokens..=max_tokens` tokens (windows of the prose under
//! `data/prose/`, or seeded random tokens without it), each length a multiple of the block size so that the
//! question starts a fresh group. `requests` requests pick a document by Zipf(`zipf_s`) over a seeded random
//! ranking and append one of a few short questions; each generates `answer_tokens` greedy tokens. Every
//! configuration replays the same requests, one at a time, on a fresh engine with the same device pool, host and
//! disk capacities:
//!
//! - **recompute**: prefix caching off, no tiers; its answers are the reference for quality;
//! - **lru**: the tiers hold every idle group in the native format, least recently used evicted;
//! - **lru+CODEC**: the same with every group in one compressing codec;
//! - **evicpress**: EvicPress places each context (tier × codec) by utility, with its idle-time profiler; with
//!   several `alphas`, one configuration per α (`evicpress a=α`), the points of the paper's quality–TTFT curve;
//!   with both greedy rules (`greedy`), one per rule and α (`evicpress a=α per-byte`).
//!
//! Per configuration it reports mean and p99 TTFT (submit → first token), the quality score (the fraction of
//! answer tokens equal, position by position, to the recompute answer, averaged over requests) and the fraction of
//! prompt tokens served from each tier. Between requests the harness waits until the engine is idle and has placed
//! (and, for EvicPress, profiled) the finished request's context, so TTFT never includes profiling; the profiling
//! time is reported on its own.
//!
//! With `arrival_rate` the measured requests instead arrive as a seeded Poisson process (the same arrival times for
//! every configuration) and each is submitted at its arrival, whatever is still running: TTFT then counts from the
//! arrival, so it includes the wait behind earlier requests, and EvicPress's idle-time profiling competes with
//! them. The engine serves one sequence at a time either way (`max_running` 1), so requests queue in arrival order.
//! Each request's tier hits come from the engine's own per-request count
//! ([`GenerateEvent::Finished`]'s `onboarded_tokens`).
//!
//! With `offline_phase`, every configuration but recompute first ingests each context once, untimed, with a
//! training question that none of the measured requests asks: the paper's initial offline phase (§4.1, §4.4), in
//! which every context is computed and placed (and, for EvicPress, profiled) before online requests arrive. Without
//! it, each context's first request is computed in the measured run by every configuration alike.
//!
//! The phase's prefill is shared ([`Seeds`]): one engine computes every context once and keeps its KV in the
//! native format on its own disk tier, and each configuration's phase writes a context's groups into its device
//! pool ([`EngineHandle::seed_device`]) just before asking the training question over them. The configuration then
//! offloads, places and profiles them as it would groups it had computed, bit for bit the same, and a full-size run
//! prefills the workload once instead of once per configuration.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::bench_eviction::percentile;
use crate::cache::block_hashes;
use crate::engine::{
    Engine, EngineConfig, EngineError, EngineHandle, EngineStats, ExportFrom, GenerateEvent, GenerateRequest,
    SamplingParams, TierPlacement,
};
use crate::eval::TaskKind;
use crate::evicpress::GreedyRule;
use crate::model::{Gguf, Tokenizer};
use crate::placement::{AnswerHorizon, EvicPressConfig, ProfileScoring, agreement};
use crate::policy::PolicySpec;
use crate::tiers::residual;
use crate::tiers::{GroupCodec, Tier, TierConfig};

/// Questions appended to a context (each well under one 16-token group beyond the context's last group).
const QUESTIONS: [&str; 6] = [
    "\n\nQuestion: Who is the main character of this passage? Answer:",
    "\n\nQuestion: Where does the scene above take place? Answer:",
    "\n\nQuestion: What happens next in the story? Answer:",
    "\n\nQuestion: Summarise the passage in one sentence. Answer:",
    "\n\nQuestion: What is the tone of the text above? Answer:",
    "\n\nQuestion: Which word best describes the narrator? Answer:",
];
/// The offline phase's training question: a question about the context that no measured request asks (the
/// paper profiles on training queries and measures on separate test queries).
const TRAINING_QUESTION: &str = "\n\nQuestion: What is this passage about? Answer:";
/// The profiler's questions (`profile_questions`): the paper's per-context query set, stood in for by generic
/// questions about a passage that no measured request and not the training question asks.
pub const PROFILE_QUESTIONS: [&str; 4] = [
    "\n\nQuestion: Who is speaking in the passage above? Answer:",
    "\n\nQuestion: What is the first thing the passage mentions? Answer:",
    "\n\nQuestion: How does the passage end? Answer:",
    "\n\nQuestion: What time of day is it in the passage? Answer:",
];
/// Largest number of contexts or requests accepted (bounds the workload the harness builds in memory).
pub const MAX_ITEMS: usize = 100_000;
/// Most EvicPress configurations (values of α) in one run.
pub const MAX_ALPHAS: usize = 8;
/// Name of the EvicPress configuration; with several α each is named `evicpress a=α`.
pub const EVICPRESS: &str = "evicpress";
/// How long one request may take before the run is abandoned.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

/// With arrivals ([`ZipfBenchOptions::arrival_rate`]), the measured requests must all have finished this long
/// per request after the last arrival, besides [`REQUEST_TIMEOUT`]: a bound on the queue an overloaded
/// configuration (recompute at full size runs several times slower than requests arrive) may build.
const OPEN_LOOP_WORK_PER_REQUEST: Duration = Duration::from_secs(20);

/// The largest arrival rate accepted (requests per second).
const MAX_ARRIVAL_RATE: f64 = 1000.0;
/// Without a data dir, the shared offline prefill keeps the workload's KV in RAM only up to this size; beyond it,
/// each configuration computes its offline phase itself.
const MAX_SEEDS_IN_RAM: u64 = 1 << 30;
/// Offline contexts every configuration computes itself before the shared prefill writes the rest: its cost model
/// measures prefill speed only on steps it computes, and EvicPress prices a drop by it from its first placement.
const OFFLINE_COMPUTED_FIRST: usize = 4;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ZipfBenchOptions {
    pub threads: usize,
    pub contexts: usize,
    pub min_tokens: usize,
    pub max_tokens: usize,
    pub requests: usize,
    pub zipf_s: f64,
    pub answer_tokens: usize,
    /// Device pool size in tokens (rounded up to whole groups).
    pub device_tokens: usize,
    pub host_mib: u64,
    pub disk_mib: u64,
    /// Where the disk tiers live (one directory per configuration, removed afterwards); required when
    /// `disk_mib > 0`.
    pub data_dir: Option<PathBuf>,
    /// Codecs of the fixed-codec LRU baselines (and the variants EvicPress may choose).
    pub codecs: Vec<String>,
    /// EvicPress's α, one EvicPress configuration each (the paper's quality–TTFT curve is drawn by varying it).
    pub alphas: Vec<f64>,
    /// EvicPress's token-dropping ratios (pruned copies, with every codec); empty for whole contexts only.
    pub keep_ratios: Vec<f64>,
    /// Prose for the contexts (`*.txt`); seeded random tokens when `None`.
    pub prose_dir: Option<PathBuf>,
    pub seed: u64,
    /// Matmuls in bf16 ([`EngineConfig::bf16_matmuls`]), for every configuration alike. Saved reports from before
    /// the option's rename call it `amx`.
    #[serde(alias = "amx")]
    pub bf16_matmuls: bool,
    /// Ingest every context once, untimed, before the measured requests (the paper's offline phase).
    pub offline_phase: bool,
    /// Where the offline phase's shared prefill keeps the contexts' KV ([`Seeds`]): kept after the run, and reused
    /// by a later run of the same model and workload, which then computes only the contexts it lacks. Without it,
    /// under the run's data dir, removed afterwards.
    #[serde(default)]
    pub seed_dir: Option<PathBuf>,
    /// How EvicPress's profiler scores a variant.
    pub profile_scoring: ProfileScoring,
    /// How many answer positions EvicPress's profiler scores.
    pub horizon: AnswerHorizon,
    /// Shrink EvicPress's profiles toward each variant's mean.
    pub shrink: bool,
    /// Plan EvicPress on each variant's mean over all contexts ([`EvicPressConfig::pooled`]).
    #[serde(default)]
    pub pooled: bool,
    /// EvicPress's greedy rules, one configuration per rule and α (named `… drop` / `… per-byte` unless the
    /// rule is the paper's alone). Reports written before the option read back as the paper's rule.
    #[serde(default = "papers_greedy_rule")]
    pub greedy: Vec<GreedyRule>,
    /// Training queries EvicPress scores each context on besides its creating request's question (at most
    /// [`PROFILE_QUESTIONS`]'s length): the first this many of the context's own, which its requests give the
    /// engine ([`GenerateRequest::profile_queries`]): for prose the fixed [`PROFILE_QUESTIONS`], for a task item
    /// questions of its own family on its own context
    /// ([`EvalItem::training_questions`](crate::eval::EvalItem::training_questions)). No measured request asks
    /// any of them. Reports before `TODO` gave task items the prose questions.
    #[serde(default)]
    pub profile_questions: usize,
    /// EvicPress with and/or without recomputing contexts served from lossy copies when that pays
    /// ([`EvicPressConfig::upgrade`]), one configuration per value, rule and α (named `… upgrade` when on).
    #[serde(default = "without_upgrades")]
    pub upgrade: Vec<bool>,
    /// KIVI's full-precision residuals, in tokens ([`EngineConfig::kivi_residual_tokens`]): each KIVI baseline
    /// and each EvicPress configuration runs once per value, named with ` r=R` where R is not 0.
    #[serde(default = "without_residual")]
    pub kivi_residual_tokens: Vec<usize>,
    /// Layers whose blocks the KIVI codecs store in int8 ([`EngineConfig::kivi_int8_layers`]), in every
    /// configuration. Empty: none.
    #[serde(default)]
    pub kivi_int8_layers: Vec<usize>,
    /// The baselines to run besides recompute (`lru`, `lru+CODEC`); None: all of them. Recompute always runs: its
    /// answers are every configuration's reference.
    #[serde(default)]
    pub baselines: Option<Vec<String>>,
    /// Share of the contexts (0..=1) that are synthetic long-context task items ([`TaskKind`], the five families
    /// in turn, each asked its own question) instead of prose windows: a workload whose contexts differ in how
    /// much a codec hurts them, as the paper's mix of LongBench datasets does. 0: prose only.
    #[serde(default)]
    pub task_share: f64,
    /// Arrivals per second of the measured requests, a seeded Poisson process with the same arrival times for
    /// every configuration: each request is submitted at its arrival whatever is still running, and its TTFT
    /// counts from that arrival, so it includes the wait behind earlier requests (the paper's TTFT: "from the
    /// arrival of a query"). EvicPress's idle-time profiling then competes with arrivals. 0: one request at a
    /// time, each submitted once the engine has settled from the last (no queueing).
    #[serde(default)]
    pub arrival_rate: f64,
}

fn min_question_slack() -> u64 {
    RequestKind::MIN_QUESTION_SLACK_TOKENS
}

fn without_upgrades() -> Vec<bool> {
    vec![false]
}

fn without_residual() -> Vec<usize> {
    vec![0]
}

fn papers_greedy_rule() -> Vec<GreedyRule> {
    vec![GreedyRule::Drop]
}

impl Default for ZipfBenchOptions {
    fn default() -> ZipfBenchOptions {
        ZipfBenchOptions {
            threads: 0,
            contexts: 200,
            min_tokens: 1024,
            max_tokens: 4096,
            requests: 600,
            zipf_s: 1.1,
            answer_tokens: 4,
            device_tokens: 8192,
            host_mib: 1024,
            disk_mib: 2048,
            data_dir: None,
            codecs: ["int8", "fp8_e4m3", "int4_kivi", "int2_kivi"].map(String::from).to_vec(),
            alphas: vec![1.0],
            keep_ratios: crate::placement::DEFAULT_KEEP_RATIOS.to_vec(),
            prose_dir: None,
            seed: 11,
            bf16_matmuls: false,
            offline_phase: false,
            seed_dir: None,
            profile_scoring: ProfileScoring::TeacherForced,
            horizon: AnswerHorizon::Fixed,
            shrink: false,
            pooled: false,
            greedy: papers_greedy_rule(),
            profile_questions: 0,
            upgrade: without_upgrades(),
            kivi_residual_tokens: without_residual(),
            kivi_int8_layers: Vec::new(),
            baselines: None,
            task_share: 0.0,
            arrival_rate: 0.0,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ZipfConfigResult {
    pub name: String,
    pub requests: usize,
    pub completed: usize,
    pub ttft_ms_mean: f64,
    pub ttft_ms_p99: f64,
    /// Mean fraction of answer tokens equal to the recompute answer, in [0, 1].
    pub quality: f64,
    /// The same mean over the requests that reused stored KV (any prefix hit, or a pruned copy): what the stored
    /// KV gives, without the requests computed whole, whose answers are recompute's. A device hit counts: under a
    /// codec, groups onboarded from a lossy copy stay on the device for later requests. `None` without reuse.
    pub reuse_quality: Option<f64>,
    /// Fraction of all prompt tokens served from each tier ([`Tier::index`]).
    pub hit_rate: [f64; 3],
    /// Fraction of prompt tokens computed.
    pub computed_rate: f64,
    /// Most bytes each lower tier held after any request, and its capacity ([`Tier::index`]; device unused).
    pub peak_used_bytes: [u64; 3],
    pub capacity_bytes: [u64; 3],
    /// EvicPress only: its final counters, and its planner's largest accounted bytes per tier.
    pub evicpress: Option<crate::placement::EvicPressStats>,
    pub peak_planned_bytes: [u64; 3],
    pub seconds: f64,
    /// Of `seconds`, the untimed offline phase (0 without one).
    pub offline_seconds: f64,
    /// Tokens the offline phase computed: the training questions and answers, plus any context it could not be
    /// given from the shared prefill ([`Seeds`]). Absent in reports written before the shared prefill.
    #[serde(default)]
    pub offline_computed_tokens: u64,
    /// Offline contexts whose KV the shared prefill wrote into the device pool whole.
    #[serde(default)]
    pub offline_seeded: usize,
    /// Every request in order: where its prompt came from and its TTFT, so a mean can be taken apart.
    pub per_request: Vec<RequestRecord>,
}

/// One request of one configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Which context (index into the workload's documents).
    pub context: usize,
    pub prompt_tokens: usize,
    pub ttft_ms: f64,
    /// Prompt tokens computed, and served from each tier ([`Tier::index`]).
    pub computed_tokens: u64,
    pub hit_tokens: [u64; 3],
    /// EvicPress only: the request started from a pruned copy of its context.
    pub pruned: bool,
    /// Fraction of its answer tokens equal to the recompute answer's (1 for recompute itself).
    pub quality: f64,
}

impl RequestRecord {
    /// Whether the request reused stored KV: a prefix hit in any tier, or a pruned copy.
    pub fn reused(&self) -> bool {
        self.pruned || self.hit_tokens.iter().any(|&h| h > 0)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ZipfReport {
    pub model: String,
    pub options: ZipfBenchOptions,
    /// Where the contexts came from.
    pub source: String,
    /// KV bytes of all contexts in the device's format, and of the device pool.
    pub workload_kv_bytes: u64,
    pub device_bytes: u64,
    /// Seconds of the offline phase's shared prefill (0 when every configuration computed its own, or without
    /// the phase).
    #[serde(default)]
    pub seed_seconds: f64,
    /// Contexts the shared prefill computed (fewer than all when its `seed_dir` kept some from an earlier run).
    #[serde(default)]
    pub seed_computed: usize,
    /// What each context is (`prose`, `random` or a task family's name), by context index: a request's
    /// [`RequestRecord::context`] indexes it. Empty in reports written before the task mix.
    #[serde(default)]
    pub context_kinds: Vec<String>,
    /// Prompt tokens a reusing request may compute and still count as served from its context
    /// ([`RequestKind::of`]): the longest question one group more, at least
    /// [`RequestKind::MIN_QUESTION_SLACK_TOKENS`] (the value of reports written before it was recorded).
    #[serde(default = "min_question_slack")]
    pub question_slack_tokens: u64,
    pub results: Vec<ZipfConfigResult>,
}

impl ZipfReport {
    pub fn to_markdown(&self) -> String {
        let o = &self.options;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let mut s = format!(
            "Model {}, {} contexts of {}..={} tokens ({}), {} requests, Zipf({}), {} answer tokens. KV of the \
             workload {:.0} MiB; device {:.0} MiB + host {} MiB (×{:.1}), disk {} MiB. {} EvicPress scores \
             variants {} over {}{}{}.\n\n\
             | configuration | mean TTFT ms | p99 TTFT ms | quality | quality when reusing | device hit | host hit | \
             disk hit | computed | completed |\n|---|---|---|---|---|---|---|---|---|---|\n",
            self.model,
            o.contexts,
            o.min_tokens,
            o.max_tokens,
            self.source,
            o.requests,
            o.zipf_s,
            o.answer_tokens,
            mib(self.workload_kv_bytes),
            mib(self.device_bytes),
            o.host_mib,
            self.workload_kv_bytes as f64 / (self.device_bytes + (o.host_mib << 20)).max(1) as f64,
            o.disk_mib,
            match (o.offline_phase, self.seed_seconds > 0.0) {
                (false, _) => "No offline phase: each context's first request is computed in the measured run.".into(),
                (true, shared) => format!(
                    "Offline phase: every context ingested once, untimed, before the measured requests (not by \
                     recompute){}.",
                    if shared {
                        format!(", its KV prefilled once for all configurations ({:.0} s)", self.seed_seconds)
                    } else {
                        String::new()
                    }
                ),
            },
            match o.profile_scoring {
                ProfileScoring::TeacherForced => "teacher-forced",
                ProfileScoring::FreeRunning => "on free-running answers",
            },
            match o.horizon {
                AnswerHorizon::Observed => "the requests' answer length".to_owned(),
                AnswerHorizon::Fixed => format!("{} positions", EvicPressConfig::default().answer_tokens),
            },
            if o.profile_questions > 0 {
                format!(", after the request's question and {} profiling questions", o.profile_questions)
            } else {
                String::new()
            },
            if o.pooled {
                ", pooled: every context planned on each variant's mean"
            } else if o.shrink {
                ", shrunk toward each variant's mean"
            } else {
                ""
            }
        );
        if o.arrival_rate > 0.0 {
            s.insert_str(
                s.find("\n\n").unwrap_or(s.len()),
                &format!(
                    " Requests arrive as a Poisson process of {} per second, each submitted at its arrival; TTFT \
                     counts from the arrival, queueing included.",
                    o.arrival_rate
                ),
            );
        }
        if o.kivi_residual_tokens.iter().any(|&r| r > 0) {
            s.insert_str(
                s.find("\n\n").unwrap_or(s.len()),
                " With ` r=R`, KIVI codecs keep each stored prompt's last R tokens in the device's format.",
            );
        }
        for r in &self.results {
            s += &format!(
                "| {} | {:.1} | {:.1} | {:.3} | {} | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {}/{} |\n",
                r.name,
                r.ttft_ms_mean,
                r.ttft_ms_p99,
                r.quality,
                r.reuse_quality.map_or_else(|| "–".to_owned(), |q| format!("{q:.3}")),
                100.0 * r.hit_rate[0],
                100.0 * r.hit_rate[1],
                100.0 * r.hit_rate[2],
                100.0 * r.computed_rate,
                r.completed,
                r.requests
            );
        }
        for (name, ep) in self.results.iter().filter_map(|r| Some((&r.name, r.evicpress.as_ref()?))) {
            s += &format!(
                "\n{name}: {} contexts, {} profiles{} ({:.1} s in all, idle time{}), {} drift spot checks \
                 ({} re-profiles), {} placed with the prior; {} compressions, {} moves down, {} drops, {} copies \
                 the stores lost, {} contexts recomputed from lossy copies; {} requests started from a pruned copy. \
                 Mean profiled quality: {}.{}{}\n",
                ep.contexts,
                ep.profiles,
                // Reports before the counter existed read back 0: nothing to say.
                match ep.profiles_on_own_queries {
                    0 => String::new(),
                    n => format!(", {n} on the contexts' own training queries"),
                },
                ep.profile_ms as f64 / 1e3,
                if o.arrival_rate > 0.0 { ", which arrivals may wait behind" } else { ", not in TTFT" },
                ep.spot_checks,
                ep.reprofiles,
                ep.placed_with_prior,
                ep.compressed,
                ep.moved_down,
                ep.dropped,
                ep.lost_copies,
                ep.upgrades,
                ep.pruned_onboards,
                ep.variants
                    .iter()
                    .zip(&ep.mean_quality)
                    .map(|(v, q)| match q {
                        Some(q) => format!("{v} {q:.3}"),
                        None => format!("{v} unmeasured"),
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
                similarity_note(ep),
                if ep.shrunk_profiles > 0 {
                    format!(
                        " {} variant profiles shrunk toward their variant's mean, by {:.3} on average.",
                        ep.shrunk_profiles,
                        ep.shrink_total / ep.shrunk_profiles as f64
                    )
                } else {
                    String::new()
                }
            );
        }
        s += &self.breakdown();
        s += &self.by_context_kind();
        s += &self.by_turn();
        s += &self.comparison();
        s
    }

    /// Each configuration's requests split by what their context is ([`ZipfReport::context_kinds`]): per kind,
    /// the requests, their mean TTFT and their mean quality. Empty when every context is of one kind.
    pub fn by_context_kind(&self) -> String {
        let mut kinds: Vec<&str> = self.context_kinds.iter().map(String::as_str).collect();
        kinds.sort_unstable();
        kinds.dedup();
        if kinds.len() < 2 {
            return String::new();
        }
        let mut s = String::from(
            "\nBy what the context is (requests, mean TTFT ms, quality):\n\n| configuration | mean TTFT ms | quality |",
        );
        for k in &kinds {
            s += &format!(" {k} |");
        }
        s += &format!("\n|---|---|---|{}\n", "---|".repeat(kinds.len()));
        for r in &self.results {
            s += &format!("| {} | {:.1} | {:.3} |", r.name, r.ttft_ms_mean, r.quality);
            for k in &kinds {
                let of_kind =
                    || r.per_request.iter().filter(|q| self.context_kinds.get(q.context).is_some_and(|c| c == k));
                let n = of_kind().count();
                if n == 0 {
                    s += " – |";
                    continue;
                }
                let ttft = of_kind().map(|q| q.ttft_ms).sum::<f64>() / n as f64;
                s += &format!(" {n}, {ttft:.0}, {:.3} |", mean_quality(of_kind()));
            }
            s += "\n";
        }
        s
    }

    /// Each configuration's mean TTFT split by where its requests' KV came from ([`RequestKind`]): per kind, the
    /// requests, their median TTFT, their share of the mean (their TTFTs summed over all requests) and their mean
    /// quality.
    pub fn breakdown(&self) -> String {
        let mut s = String::from(
            "\nWhere each mean comes from (requests, median TTFT, share of the mean in ms, their quality):\n\n\
             | configuration | mean TTFT ms |",
        );
        for k in RequestKind::ALL {
            s += &format!(" {} |", k.name());
        }
        s += &format!("\n|---|---|{}\n", "---|".repeat(RequestKind::ALL.len()));
        for r in &self.results {
            s += &format!("| {} | {:.1} |", r.name, r.ttft_ms_mean);
            let total = r.per_request.len().max(1) as f64;
            for kind in RequestKind::ALL {
                let of_kind =
                    || r.per_request.iter().filter(|q| RequestKind::of(q, self.question_slack_tokens) == kind);
                let mut ttfts: Vec<f64> = of_kind().map(|q| q.ttft_ms).collect();
                if ttfts.is_empty() {
                    s += " – |";
                    continue;
                }
                ttfts.sort_by(f64::total_cmp);
                let share = ttfts.iter().sum::<f64>() / total;
                let quality = mean_quality(of_kind());
                s += &format!(" {}, {:.0} ms, {share:.1}, {quality:.3} |", ttfts.len(), percentile(&ttfts, 50.0));
            }
            s.push('\n');
        }
        s
    }

    /// Quality by the request's turn on its context (its first, second, third or a later request in the run: how
    /// many accesses the utility had counted when it came), and on the most asked context: its requests' quality,
    /// how many answered with quality 0 and how many computed it whole. Every configuration replays the same
    /// requests, so the turns are the workload's.
    pub fn by_turn(&self) -> String {
        const TURNS: [&str; 4] = ["1st", "2nd", "3rd", "4th+"];
        let turns = |requests: &[RequestRecord]| -> Vec<usize> {
            let mut seen = std::collections::HashMap::<usize, usize>::new();
            requests
                .iter()
                .map(|q| {
                    let n = seen.entry(q.context).or_default();
                    *n += 1;
                    (*n).min(TURNS.len()) - 1
                })
                .collect()
        };
        let Some(first) = self.results.first() else { return String::new() };
        let first_turns = turns(&first.per_request);
        let mut count = [0usize; TURNS.len()];
        first_turns.iter().for_each(|&t| count[t] += 1);
        let mut asked = std::collections::HashMap::<usize, usize>::new();
        first.per_request.iter().for_each(|q| *asked.entry(q.context).or_default() += 1);
        let Some((top, top_n)) = asked.into_iter().max_by_key(|&(c, n)| (n, std::cmp::Reverse(c))) else {
            return String::new();
        };
        let mut s = format!(
            "\nBy the request's turn on its context (their quality), and context {top}, the most asked ({top_n} \
             requests: their quality, requests answered with quality 0, requests that computed it):\n\n\
             | configuration |"
        );
        for (name, n) in TURNS.iter().zip(count) {
            s += &format!(" {name} ({n}) |");
        }
        s += &format!(" context {top} |\n|---|{}---|\n", "---|".repeat(TURNS.len()));
        for r in &self.results {
            s += &format!("| {} |", r.name);
            let turn = turns(&r.per_request);
            for t in 0..TURNS.len() {
                s += &format!(
                    " {:.3} |",
                    mean_quality(r.per_request.iter().zip(&turn).filter(|(_, u)| **u == t).map(|(q, _)| q))
                );
            }
            let on_top = || r.per_request.iter().filter(|q| q.context == top);
            let zeros = on_top().filter(|q| q.quality == 0.0).count();
            let cold = on_top().filter(|q| RequestKind::of(q, self.question_slack_tokens) == RequestKind::Cold).count();
            s += &format!(" {:.3}, {zeros}, {cold} |\n", mean_quality(on_top()));
        }
        s
    }

    /// The two targets, stated whether or not they hold, read as the paper's Figure 7 reads its curves:
    /// for each fixed codec + LRU, the fastest EvicPress point of equal or better quality, and how many times lower
    /// its mean TTFT is (target: at least 1.4x); and the fastest EvicPress point within 3% of LRU's quality
    /// (target: at least 1.2x below LRU).
    pub fn comparison(&self) -> String {
        let mut s = String::new();
        let evicpress: Vec<&ZipfConfigResult> = self.results.iter().filter(|r| r.name.starts_with(EVICPRESS)).collect();
        if evicpress.is_empty() {
            return s;
        }
        let point = |r: &ZipfConfigResult| format!("{} ({:.3}, {:.1} ms)", r.name, r.quality, r.ttft_ms_mean);
        // One line per baseline: the fastest EvicPress point of at least `floor` quality (`which` says which floor)
        // and whether it is `target` times below the baseline's mean TTFT.
        let mut against = |b: &ZipfConfigResult, floor: f64, which: &str, target: f64| {
            s += &match fastest_at_quality(&evicpress, floor) {
                Some(ep) => {
                    let ratio = b.ttft_ms_mean / ep.ttft_ms_mean.max(1e-9);
                    format!(
                        "\nvs {}: {}, the fastest EvicPress point {which}, is {ratio:.2}x lower in mean TTFT (target \
                         >= {target}x: {}).",
                        point(b),
                        point(ep),
                        if ratio >= target { "met" } else { "not met" }
                    )
                }
                None => format!("\nvs {}: no EvicPress point {which}.", point(b)),
            };
        };
        for b in self.results.iter().filter(|r| r.name.starts_with("lru+")) {
            against(b, b.quality, "of equal or better quality", 1.4);
        }
        if let Some(lru) = self.results.iter().find(|r| r.name == "lru") {
            against(lru, lru.quality - 0.03, "within 3% of its quality", 1.2);
        }
        s.push('\n');
        s
    }

    pub fn to_json_string(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// The configuration of `points` with the lowest mean TTFT among those whose quality is at least `quality`: the
/// point of a quality–TTFT curve that a baseline of that quality is measured against.
fn fastest_at_quality<'a>(points: &[&'a ZipfConfigResult], quality: f64) -> Option<&'a ZipfConfigResult> {
    points.iter().copied().filter(|r| r.quality >= quality).min_by(|a, b| a.ttft_ms_mean.total_cmp(&b.ttft_ms_mean))
}

/// Where a request's prompt KV came from, for [`ZipfReport::breakdown`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    /// (Nearly) the whole prompt computed: a context seen for the first time, or dropped.
    Cold,
    /// Part of the context reused, a real part computed.
    Partial,
    /// The context found on the device.
    Device,
    /// The context loaded whole from the host or disk tier.
    Tier,
    /// Started from an EvicPress pruned copy.
    Pruned,
}

impl RequestKind {
    pub const ALL: [RequestKind; 5] =
        [RequestKind::Cold, RequestKind::Partial, RequestKind::Device, RequestKind::Tier, RequestKind::Pruned];
    /// The least [`ZipfReport::question_slack_tokens`]: two groups, room for a prose question (under one
    /// 16-token group) and the group it may complete.
    pub const MIN_QUESTION_SLACK_TOKENS: u64 = 32;

    pub fn name(self) -> &'static str {
        match self {
            RequestKind::Cold => "cold",
            RequestKind::Partial => "partial",
            RequestKind::Device => "device",
            RequestKind::Tier => "tier",
            RequestKind::Pruned => "pruned",
        }
    }

    /// The request's kind, counting up to `slack` computed prompt tokens ([`ZipfReport::question_slack_tokens`])
    /// as its question rather than its context.
    pub fn of(r: &RequestRecord, slack: u64) -> RequestKind {
        let prompt = r.prompt_tokens as u64;
        if r.computed_tokens + slack >= prompt {
            RequestKind::Cold
        } else if r.pruned {
            RequestKind::Pruned
        } else if r.hit_tokens[Tier::Device.index()] + slack >= prompt {
            RequestKind::Device
        } else if r.computed_tokens <= slack {
            RequestKind::Tier
        } else {
            RequestKind::Partial
        }
    }
}

/// One request of the workload.
#[derive(Debug, Clone)]
struct Request {
    context: usize,
    prompt: Vec<u32>,
}

/// The workload's documents, lengths multiples of `bs`.
#[derive(Default)]
struct Documents {
    docs: Vec<Vec<u32>>,
    /// A task item's own question (with the tokens cut from its context's end to reach a whole group); `None`
    /// for prose and random documents, which are asked one of [`QUESTIONS`].
    own_questions: Vec<Option<Vec<u32>>>,
    /// What each document is ([`ZipfReport::context_kinds`]).
    kinds: Vec<String>,
    /// Each document's training queries for EvicPress's profiler, continuing the document as its requests'
    /// questions do: a task item's [`EvalItem::training_questions`](crate::eval::EvalItem), prose's and random
    /// tokens' [`PROFILE_QUESTIONS`]. None is a question a measured request asks.
    training: Vec<Vec<Vec<u32>>>,
    source: String,
}

impl Documents {
    fn push(&mut self, doc: Vec<u32>, own_question: Option<Vec<u32>>, training: Vec<Vec<u32>>, kind: &str) {
        self.docs.push(doc);
        self.own_questions.push(own_question);
        self.training.push(training);
        self.kinds.push(kind.to_owned());
    }
}

/// Longest task question accepted (with the tokens moved from its context): bounds what a request appends to
/// its context, and so the report's question slack.
const MAX_TASK_QUESTION_TOKENS: usize = 72;

/// The documents: task items for the first `task_share` of them (popularity is assigned by a seeded shuffle, so
/// which documents come first does not matter), then prose windows or random tokens.
fn contexts(
    opts: &ZipfBenchOptions,
    tokenizer: &Tokenizer,
    vocab: u32,
    bs: usize,
    rng: &mut StdRng,
) -> Result<Documents, EngineError> {
    let lens: Vec<usize> =
        (0..opts.contexts).map(|_| (rng.random_range(opts.min_tokens..=opts.max_tokens) / bs).max(1) * bs).collect();
    let n_tasks = (opts.task_share * opts.contexts as f64).round() as usize;
    let generic: Vec<Vec<u32>> = PROFILE_QUESTIONS.iter().map(|q| tokenizer.encode(q, false)).collect();
    let mut out = Documents::default();
    for (i, &n) in lens.iter().enumerate().take(n_tasks) {
        let kind = TaskKind::ALL[i % TaskKind::ALL.len()];
        let item = task_document(kind, opts.seed.wrapping_add(i as u64), n, tokenizer, bs)?;
        out.push(item.doc, Some(item.question), item.training, kind.name());
    }
    let rest = &lens[n_tasks..];
    let stream = match &opts.prose_dir {
        Some(dir) if !rest.is_empty() => Some((dir, prose_tokens(dir, tokenizer, opts.max_tokens * 8)?)),
        _ => None,
    };
    let what = match stream {
        Some((dir, stream)) if stream.len() > opts.max_tokens + 1 => {
            for &n in rest {
                let start = rng.random_range(0..stream.len() - n);
                out.push(stream[start..start + n].to_vec(), None, generic.clone(), "prose");
            }
            format!("prose windows from {}", dir.display())
        }
        _ => {
            for &n in rest {
                out.push((0..n).map(|_| rng.random_range(0..vocab)).collect(), None, generic.clone(), "random");
            }
            (if rest.is_empty() { "no prose" } else { "random tokens" }).to_owned()
        }
    };
    out.source = if n_tasks == 0 {
        what
    } else {
        let families: Vec<&str> = TaskKind::ALL.iter().map(|k| k.name()).collect();
        format!("{n_tasks} task items ({} in turn), {what}", families.join(", "))
    };
    Ok(out)
}

/// A task item as the workload's document, the question its requests ask, and its training queries.
struct TaskDocument {
    doc: Vec<u32>,
    question: Vec<u32>,
    training: Vec<Vec<u32>>,
}

/// One synthetic task item of about `tokens` tokens as a document and its question: the item's instruction and
/// haystack, cut to whole groups (the cut tokens lead the question, so the text a request sees is the item's
/// whole), and `\n\n` + the item's question (+ ` Answer:` unless it already ends in a colon). Its training
/// questions continue the document the same way.
fn task_document(
    kind: TaskKind,
    seed: u64,
    tokens: usize,
    tokenizer: &Tokenizer,
    bs: usize,
) -> Result<TaskDocument, EngineError> {
    let count = |s: &str| tokenizer.encode(s, false).len();
    // The question and its group's slack come out of the document's length.
    let item =
        crate::eval::generate(kind, seed, tokens.saturating_sub(bs).max(crate::eval::tasks::MIN_TARGET_TOKENS), &count);
    let (context, question) = item
        .context_and_question()
        .ok_or_else(|| EngineError::Config(format!("{kind} item {seed} has no question after a blank line")))?;
    let mut doc = tokenizer.encode(context, false);
    if doc.len() < bs {
        return Err(EngineError::Config(format!("{kind} item {seed}: {} tokens, under one group", doc.len())));
    }
    let whole = doc.len() / bs * bs;
    let cut = doc.split_off(whole);
    let ask = |question: &str| {
        let suffix = if question.ends_with(':') { "" } else { " Answer:" };
        let mut tokens = cut.clone();
        tokens.extend(tokenizer.encode(&format!("\n\n{question}{suffix}"), false));
        if tokens.len() > MAX_TASK_QUESTION_TOKENS {
            return Err(EngineError::Config(format!(
                "{kind} item {seed}: question of {} tokens, over {MAX_TASK_QUESTION_TOKENS}",
                tokens.len()
            )));
        }
        Ok(tokens)
    };
    let training = item.training_questions.iter().map(|q| ask(q)).collect::<Result<_, _>>()?;
    Ok(TaskDocument { doc, question: ask(question)?, training })
}

/// The `*.txt` files of `dir` (bounded), tokenized, at least `want` tokens when there is that much.
fn prose_tokens(dir: &Path, tokenizer: &Tokenizer, want: usize) -> Result<Vec<u32>, EngineError> {
    let err = |e: std::io::Error| EngineError::Config(format!("prose dir {}: {e}", dir.display()));
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(err)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files.into_iter().take(64) {
        let len = std::fs::metadata(&f).map_err(err)?.len();
        if len > 16 << 20 {
            continue;
        }
        let text = std::fs::read_to_string(&f).map_err(err)?;
        // Tokenize paragraph runs, so that a small want does not pay for a whole book.
        for chunk in text.split("\n\n").collect::<Vec<_>>().chunks(32) {
            out.extend(tokenizer.encode(&chunk.join("\n\n"), false));
            if out.len() >= want {
                return Ok(out);
            }
        }
    }
    Ok(out)
}

/// Zipf(s) over `n` ranks: cumulative weights.
fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let mut acc = 0.0;
    let mut cdf: Vec<f64> = (1..=n)
        .map(|k| {
            acc += 1.0 / (k as f64).powf(s);
            acc
        })
        .collect();
    for x in &mut cdf {
        *x /= acc;
    }
    cdf
}

fn request(prompt: Vec<u32>, answer_tokens: usize, profile_queries: &[Vec<u32>]) -> GenerateRequest {
    GenerateRequest {
        request_id: "zipf".into(),
        prompt,
        max_tokens: answer_tokens as u32,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        namespace: String::new(),
        policy: Some(PolicySpec::full()),
        ignore_eos: true,
        profile_queries: profile_queries.to_vec(),
        logprobs: None,
        prompt_logprobs: None,
        priority: 0,
        tenant_weight: 1,
        tier_codec: None,
        lora: None,
    }
}

/// Runs one request: TTFT and the answer.
fn run_one(
    engine: &EngineHandle,
    prompt: Vec<u32>,
    answer_tokens: usize,
    profile_queries: &[Vec<u32>],
) -> Result<(f64, Vec<u32>), EngineError> {
    let t0 = Instant::now();
    let mut rx = engine.submit(request(prompt, answer_tokens, profile_queries))?;
    let mut ttft = None;
    let mut answer = Vec::new();
    loop {
        if t0.elapsed() > REQUEST_TIMEOUT {
            return Err(EngineError::Forward("request timed out".into()));
        }
        match rx.blocking_recv() {
            Some(GenerateEvent::Token { id: t, .. }) => {
                ttft.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                answer.push(t);
            }
            // These requests ask for no prompt log-probabilities.
            Some(GenerateEvent::PromptLogprobs(_)) => {}
            Some(GenerateEvent::Finished { .. }) => break,
            Some(GenerateEvent::Failed(e) | GenerateEvent::Refused(e)) => return Err(EngineError::Forward(e)),
            None => return Err(EngineError::Stopped),
        }
    }
    Ok((ttft.unwrap_or_else(|| t0.elapsed().as_secs_f64()), answer))
}

/// Waits until the engine is idle with the request's tokens counted and nothing left to place.
fn settled(engine: &EngineHandle, computed_before: u64) -> Result<EngineStats, EngineError> {
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    loop {
        let s = engine.stats();
        let placed = s.evicpress.as_ref().is_none_or(|e| e.pending == 0);
        if s.running == 0 && s.waiting == 0 && s.computed_tokens_total > computed_before && placed {
            return Ok(s);
        }
        if Instant::now() > deadline {
            return Err(EngineError::Forward("the engine did not settle".into()));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Arrival offsets in seconds of `n` requests at `rate` per second: exponential gaps (a Poisson process) from a
/// generator of their own, so that the workload's contexts and questions do not depend on the rate. The first
/// arrives at 0.
fn arrival_times(seed: u64, rate: f64, n: usize) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xA7_7172_4A15);
    let mut at = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                let u: f64 = rng.random_range(f64::EPSILON..1.0);
                at += -u.ln() / rate;
            }
            at
        })
        .collect()
}

/// What one request submitted at its arrival came back with.
struct Arrived {
    /// Seconds from its arrival (not its submission) to its first token.
    ttft: f64,
    answer: Vec<u32>,
    /// Prompt tokens it found cached, and of them those onboarded from each lower tier for it.
    cached_tokens: u64,
    onboarded_tokens: [u64; 3],
}

/// Reads one request's events to the end; `arrival` is when it was due.
fn collect_arrived(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<GenerateEvent>,
    arrival: Instant,
) -> Result<Arrived, EngineError> {
    let (mut ttft, mut answer) = (None, Vec::new());
    loop {
        match rx.blocking_recv() {
            Some(GenerateEvent::Token { id, .. }) => {
                ttft.get_or_insert_with(|| arrival.elapsed().as_secs_f64());
                answer.push(id);
            }
            Some(GenerateEvent::PromptLogprobs(_)) => {}
            Some(GenerateEvent::Finished { cached_tokens, onboarded_tokens, .. }) => {
                let ttft = ttft.unwrap_or_else(|| arrival.elapsed().as_secs_f64());
                return Ok(Arrived { ttft, answer, cached_tokens: u64::from(cached_tokens), onboarded_tokens });
            }
            Some(GenerateEvent::Failed(e) | GenerateEvent::Refused(e)) => return Err(EngineError::Forward(e)),
            None => return Err(EngineError::Stopped),
        }
    }
}

/// The measured requests submitted at their `arrivals` (seconds from now), each read by a thread of its own;
/// `sample` sees the engine's stats at every arrival and completion. Fails if a request fails or they have not
/// all finished [`OPEN_LOOP_WORK_PER_REQUEST`] per request plus [`REQUEST_TIMEOUT`] after the last arrival.
fn run_arrivals(
    engine: &EngineHandle,
    workload: &[Request],
    arrivals: &[f64],
    answer_tokens: usize,
    offline: Offline<'_>,
    mut sample: impl FnMut(&EngineStats),
) -> Result<Vec<Arrived>, EngineError> {
    use std::sync::mpsc::RecvTimeoutError;
    let (done_tx, done_rx) = std::sync::mpsc::channel::<(usize, Result<Arrived, EngineError>)>();
    let mut done: Vec<Option<Arrived>> = (0..workload.len()).map(|_| None).collect();
    let start = Instant::now();
    let due = |i: usize| start + Duration::from_secs_f64(arrivals[i]);
    let slack = OPEN_LOOP_WORK_PER_REQUEST.saturating_mul(u32::try_from(workload.len()).unwrap_or(u32::MAX));
    let deadline = due(workload.len().saturating_sub(1)) + REQUEST_TIMEOUT + slack;
    let (mut submitted, mut finished) = (0, 0);
    while finished < workload.len() {
        // The next event: the next arrival, or else a completion before the deadline.
        let until = if submitted < workload.len() { due(submitted) } else { deadline };
        match done_rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok((i, answer)) => {
                sample(&engine.stats());
                done[i] = Some(answer?);
                finished += 1;
            }
            Err(RecvTimeoutError::Timeout) if submitted < workload.len() => {
                let (i, r) = (submitted, &workload[submitted]);
                let req = request(r.prompt.clone(), answer_tokens, offline.queries(r.context));
                let rx = engine.submit(GenerateRequest { request_id: format!("zipf-{i}"), ..req })?;
                let (tx, arrival) = (done_tx.clone(), due(i));
                std::thread::spawn(move || {
                    let _ = tx.send((i, collect_arrived(rx, arrival)));
                });
                sample(&engine.stats());
                submitted += 1;
            }
            // `done_tx` is held here, so the channel never disconnects first.
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                return Err(EngineError::Forward("the arriving requests did not finish in time".into()));
            }
        }
    }
    done.into_iter().map(|d| d.ok_or(EngineError::Stopped)).collect()
}

/// One configuration over the whole request sequence.
fn run_config(
    model: &Path,
    opts: &ZipfBenchOptions,
    name: &str,
    cfg: EngineConfig,
    workload: &[Request],
    offline: Offline<'_>,
    reference: Option<&[Vec<u32>]>,
) -> Result<(ZipfConfigResult, Vec<Vec<u32>>), EngineError> {
    let t0 = Instant::now();
    let engine = Engine::start(EngineConfig { model_path: model.to_path_buf(), ..cfg })?;
    let offline_t0 = Instant::now();
    let mut offline_seeded = 0;
    for (i, prompt) in offline.prompts.iter().enumerate() {
        if let Some(seeds) = offline.seeds.filter(|_| i >= OFFLINE_COMPUTED_FIRST)
            && seeds.write_into(&engine, prompt)?
        {
            offline_seeded += 1;
        }
        let before = engine.stats().computed_tokens_total;
        run_one(&engine, prompt.clone(), opts.answer_tokens, offline.queries(i))?;
        settled(&engine, before)?;
    }
    let offline_seconds = if offline.prompts.is_empty() { 0.0 } else { offline_t0.elapsed().as_secs_f64() };
    let offline_computed_tokens = engine.stats().computed_tokens_total;
    let mut peak_used = [0u64; 3];
    let mut capacity = [0u64; 3];
    let mut peak_planned = [0u64; 3];
    let pruned_onboards = |st: &EngineStats| st.evicpress.as_ref().map_or(0, |e| e.pruned_onboards);
    let mut last = engine.stats();
    let mut sample_tiers = |s: &EngineStats| {
        for tier in [Tier::Host, Tier::Disk] {
            let used: u64 = s.tier_usage.iter().filter(|u| u.tier == tier).map(|u| u.used_bytes).sum();
            peak_used[tier.index()] = peak_used[tier.index()].max(used);
            if let Some(u) = s.tier_usage.iter().find(|u| u.tier == tier) {
                capacity[tier.index()] = u.capacity_bytes;
            }
        }
        if let Some(ep) = &s.evicpress {
            for (peak, planned) in peak_planned.iter_mut().zip(ep.planned_bytes) {
                *peak = (*peak).max(planned);
            }
        }
    };
    // Each request's record (quality filled in below) and its answer.
    let quality_of =
        |i: usize, answer: &[u32]| reference.and_then(|refs| refs.get(i)).map_or(1.0, |w| agreement(answer, w));
    let mut per_request = Vec::with_capacity(workload.len());
    let mut answers = Vec::with_capacity(workload.len());
    if opts.arrival_rate > 0.0 {
        let arrivals = arrival_times(opts.seed, opts.arrival_rate, workload.len());
        let arrived = run_arrivals(&engine, workload, &arrivals, opts.answer_tokens, offline, &mut sample_tiers)?;
        last = settled(&engine, last.computed_tokens_total)?;
        sample_tiers(&last);
        for (i, (r, a)) in workload.iter().zip(arrived).enumerate() {
            let onboarded: u64 = a.onboarded_tokens.iter().sum();
            let mut hit_tokens = a.onboarded_tokens;
            hit_tokens[Tier::Device.index()] = a.cached_tokens.saturating_sub(onboarded);
            per_request.push(RequestRecord {
                context: r.context,
                prompt_tokens: r.prompt.len(),
                ttft_ms: a.ttft * 1e3,
                computed_tokens: (r.prompt.len() as u64).saturating_sub(a.cached_tokens),
                hit_tokens,
                // A pruned copy's tokens count among the onboarded ones; which requests had one is not reported
                // per request.
                pruned: false,
                quality: quality_of(i, &a.answer),
            });
            answers.push(a.answer);
        }
    } else {
        for (i, r) in workload.iter().enumerate() {
            let (ttft, answer) = run_one(&engine, r.prompt.clone(), opts.answer_tokens, offline.queries(r.context))?;
            let s = settled(&engine, last.computed_tokens_total)?;
            per_request.push(RequestRecord {
                context: r.context,
                prompt_tokens: r.prompt.len(),
                ttft_ms: ttft * 1e3,
                // Prompt tokens computed = all computed minus the decode steps (every answer token but the last).
                computed_tokens: (s.computed_tokens_total - last.computed_tokens_total)
                    .saturating_sub(answer.len().saturating_sub(1) as u64),
                hit_tokens: std::array::from_fn(|t| s.prefix_hit_tokens[t].saturating_sub(last.prefix_hit_tokens[t])),
                pruned: pruned_onboards(&s) > pruned_onboards(&last),
                quality: quality_of(i, &answer),
            });
            sample_tiers(&s);
            answers.push(answer);
            last = s;
        }
    }
    let ttfts: Vec<f64> = per_request.iter().map(|r| r.ttft_ms).collect();
    let hits: [u64; 3] = std::array::from_fn(|t| per_request.iter().map(|r| r.hit_tokens[t]).sum());
    let prompt_tokens: u64 = per_request.iter().map(|r| r.prompt_tokens as u64).sum();
    let computed: u64 = per_request.iter().map(|r| r.computed_tokens).sum();
    engine.shutdown();
    let quality = mean_quality(per_request.iter());
    let reuse_quality =
        per_request.iter().any(RequestRecord::reused).then(|| mean_quality(per_request.iter().filter(|r| r.reused())));
    let mut sorted = ttfts.clone();
    sorted.sort_by(f64::total_cmp);
    let pt = prompt_tokens.max(1) as f64;
    let result = ZipfConfigResult {
        name: name.to_owned(),
        requests: workload.len(),
        completed: answers.iter().filter(|a| a.len() == opts.answer_tokens).count(),
        ttft_ms_mean: ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64,
        ttft_ms_p99: percentile(&sorted, 99.0),
        quality,
        reuse_quality,
        hit_rate: hits.map(|h| h as f64 / pt),
        computed_rate: computed as f64 / pt,
        peak_used_bytes: peak_used,
        capacity_bytes: capacity,
        evicpress: last.evicpress.clone(),
        peak_planned_bytes: peak_planned,
        seconds: t0.elapsed().as_secs_f64(),
        offline_seconds,
        offline_computed_tokens,
        offline_seeded,
        per_request,
    };
    Ok((result, answers))
}

/// What a configuration ingests before its measured requests: the offline phase's prompts (none without it), and
/// where their contexts' KV comes from when it is not computed again; and each context's training queries, which
/// every request on it gives EvicPress (the offline phase's first creates the context).
#[derive(Clone, Copy)]
struct Offline<'a> {
    prompts: &'a [Vec<u32>],
    seeds: Option<&'a Seeds>,
    profile_queries: &'a [Vec<Vec<u32>>],
}

impl Offline<'_> {
    /// Training queries of context `i` (the offline prompts are the contexts in order).
    fn queries(&self, i: usize) -> &[Vec<u32>] {
        self.profile_queries.get(i).map_or(&[], Vec::as_slice)
    }
}

/// The offline phase's shared prefill (see the module doc): an engine whose tiers hold every context's groups in
/// the native format, lossless, from which each configuration's device pool is written before its request.
struct Seeds {
    engine: EngineHandle,
    /// Drives the engine handle's async calls from this synchronous harness.
    runtime: tokio::runtime::Runtime,
    model_id: String,
    block_size: usize,
    seconds: f64,
    /// Contexts computed here (the others were on its disk tier already).
    computed: usize,
}

impl Seeds {
    /// Computes every prompt of `offline` once on an engine like `base` with `tiers` (native format, least
    /// recently used, large enough for the whole workload), skipping those whose groups a disk tier kept from an
    /// earlier run.
    fn prefill(base: &EngineConfig, tiers: TierConfig, offline: &[Vec<u32>]) -> Result<Seeds, EngineError> {
        let t0 = Instant::now();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .map_err(|e| EngineError::Config(format!("a runtime for the shared prefill: {e}")))?;
        let engine = Engine::start(EngineConfig { tiers, placement: TierPlacement::Lru, ..base.clone() })?;
        let info = engine.model_info().clone();
        let block_size = info.layout().block_size;
        let mut seeds = Seeds { engine, runtime, block_size, model_id: info.model_id, seconds: 0.0, computed: 0 };
        for prompt in offline {
            let hashes = seeds.hashes(prompt);
            let groups = hashes.len();
            if seeds.runtime.block_on(seeds.engine.probe_prefix(hashes))?.local_blocks == groups {
                continue;
            }
            let before = seeds.engine.stats().computed_tokens_total;
            run_one(&seeds.engine, prompt.clone(), 1, &[])?;
            settled(&seeds.engine, before)?;
            seeds.computed += 1;
        }
        seeds.seconds = t0.elapsed().as_secs_f64();
        tracing::info!(
            contexts = offline.len(),
            computed = seeds.computed,
            seconds = seeds.seconds,
            "bench tiers zipf: shared prefill done"
        );
        Ok(seeds)
    }

    /// Chain hashes of the full groups of `prompt` that a prefill caches.
    fn hashes(&self, prompt: &[u32]) -> Vec<u64> {
        let bs = self.block_size;
        let full = prompt.len().saturating_sub(1) / bs;
        block_hashes(&self.model_id, "", &prompt[..full * bs], bs)
    }

    /// Writes the groups of `prompt` held here into `engine`'s device pool; whether it holds all of them now. A
    /// group missing here (never expected) is left for `engine` to compute.
    fn write_into(&self, engine: &EngineHandle, prompt: &[u32]) -> Result<bool, EngineError> {
        let hashes = self.hashes(prompt);
        let want = hashes.len();
        let groups = self.runtime.block_on(self.engine.export_groups(hashes, u64::MAX, ExportFrom::DeviceFirst))?;
        Ok(self.runtime.block_on(engine.seed_device(groups))? == want)
    }
}

/// " Embedding similarity: int8 0.991, …." over the lossy variants measured, or nothing (reports written before
/// the similarity existed, or from a runner without embeddings).
fn similarity_note(ep: &crate::placement::EvicPressStats) -> String {
    let shown: Vec<String> = ep
        .variants
        .iter()
        .zip(&ep.mean_embedding_similarity)
        .skip(1)
        .filter_map(|(v, q)| Some(format!("{v} {:.3}", (*q)?)))
        .collect();
    if shown.is_empty() { String::new() } else { format!(" Embedding similarity: {}.", shown.join(", ")) }
}

/// Mean quality of `requests` (0 when there are none).
fn mean_quality<'a>(requests: impl Iterator<Item = &'a RequestRecord>) -> f64 {
    let (sum, n) = requests.fold((0.0, 0usize), |(s, n), r| (s + r.quality, n + 1));
    sum / n.max(1) as f64
}

/// Runs every configuration on the same workload.
pub fn zipf_bench(model: &Path, opts: &ZipfBenchOptions) -> Result<ZipfReport, EngineError> {
    zipf_bench_with_progress(model, opts, |_| {})
}

/// [`zipf_bench`], calling `progress` with the report of the configurations finished so far after each one.
///
/// A full-size run takes hours, so the configurations run in the order of what the comparison needs most: recompute
/// first (its answers are every other configuration's reference), then EvicPress, then the fixed codecs, then
/// LRU over native KV. In a run with KIVI residuals, EvicPress without one runs last: it is the residual's
/// comparison point, not the codecs'. The report lists them in the usual order (recompute, LRU, codecs, EvicPress) whatever
/// finished, so an interrupted run still leaves a readable partial report.
pub fn zipf_bench_with_progress(
    model: &Path,
    opts: &ZipfBenchOptions,
    mut progress: impl FnMut(&ZipfReport),
) -> Result<ZipfReport, EngineError> {
    let bad = |m: String| Err(EngineError::Config(m));
    if opts.contexts == 0 || opts.contexts > MAX_ITEMS || opts.requests == 0 || opts.requests > MAX_ITEMS {
        return bad(format!("contexts and requests must be in 1..={MAX_ITEMS}"));
    }
    if opts.min_tokens < 32 || opts.min_tokens > opts.max_tokens {
        return bad(format!(
            "context tokens {}..={} must be at least 32 and ordered",
            opts.min_tokens, opts.max_tokens
        ));
    }
    if !(opts.zipf_s.is_finite() && opts.zipf_s > 0.0) || opts.answer_tokens == 0 || opts.answer_tokens > 64 {
        return bad("zipf exponent must be > 0 and answer tokens in 1..=64".into());
    }
    if opts.disk_mib > 0 && opts.data_dir.is_none() {
        return bad("the disk tier needs a data dir".into());
    }
    if !(0.0..=MAX_ARRIVAL_RATE).contains(&opts.arrival_rate) {
        return bad(format!(
            "the arrival rate must be in 0..={MAX_ARRIVAL_RATE} requests per second (0: one at a time)"
        ));
    }
    if opts.kivi_residual_tokens.is_empty() || opts.kivi_residual_tokens.len() > MAX_ALPHAS {
        return bad(format!("give 1..={MAX_ALPHAS} KIVI residuals"));
    }
    if let Some(e) = opts.kivi_residual_tokens.iter().find_map(|&r| residual::check_tokens(r).err()) {
        return bad(format!("KIVI residual: {e}"));
    }
    if opts.alphas.is_empty() || opts.alphas.len() > MAX_ALPHAS {
        return bad(format!("give 1..={MAX_ALPHAS} EvicPress alphas"));
    }
    if let Some(a) = opts.alphas.iter().find(|a| !(a.is_finite() && **a >= 0.0)) {
        return bad(format!("EvicPress alpha must be finite and >= 0, got {a}"));
    }
    if let Err(e) = crate::tiers::pruned::check_keep_ratios(&opts.keep_ratios) {
        return bad(format!("EvicPress keep ratios: {e}"));
    }
    if !(0.0..=1.0).contains(&opts.task_share) {
        return bad(format!("task share must be in 0..=1, got {}", opts.task_share));
    }
    if opts.profile_questions > PROFILE_QUESTIONS.len() {
        return bad(format!("at most {} profiling questions", PROFILE_QUESTIONS.len()));
    }
    // One or two different values: one EvicPress configuration per value.
    let one_or_two = |n: usize, distinct: bool| n == 1 || (n == 2 && distinct);
    if !one_or_two(opts.greedy.len(), opts.greedy.first() != opts.greedy.last()) {
        return bad("give one or both EvicPress greedy rules (drop, per-byte), each once".into());
    }
    if !one_or_two(opts.upgrade.len(), opts.upgrade.first() != opts.upgrade.last()) {
        return bad("give EvicPress upgrades off, on, or both, each once".into());
    }
    let codecs = crate::bench_tiers::compressing_codecs(&opts.codecs)?;
    let gguf = Gguf::open(model).map_err(|e| EngineError::Model(e.to_string()))?;
    let tokenizer = Tokenizer::from_gguf(&gguf).map_err(|e| EngineError::Model(e.to_string()))?;
    drop(gguf);
    let probe = Engine::start(EngineConfig { num_blocks: 90, threads: 1, max_running: 1, ..EngineConfig::new(model) })?;
    let info = probe.model_info().clone();
    probe.shutdown();
    let layout = info.layout();
    let bs = layout.block_size;
    let questions: Vec<Vec<u32>> = QUESTIONS.iter().map(|q| tokenizer.encode(q, false)).collect();
    let training_question = tokenizer.encode(TRAINING_QUESTION, false);
    let profile_questions: Vec<Vec<u32>> =
        PROFILE_QUESTIONS[..opts.profile_questions].iter().map(|q| tokenizer.encode(q, false)).collect();
    let longest_q =
        questions.iter().chain([&training_question]).chain(&profile_questions).map(Vec::len).max().unwrap_or(0);
    if opts.max_tokens + longest_q.max(MAX_TASK_QUESTION_TOKENS) + opts.answer_tokens >= info.context_length {
        return bad(format!("contexts of {} tokens do not fit the model's {}", opts.max_tokens, info.context_length));
    }
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let Documents { docs, own_questions, kinds: context_kinds, training, source } =
        contexts(opts, &tokenizer, info.vocab_size as u32, bs, &mut rng)?;
    // Every request gives its context the first `profile_questions` of its training queries.
    let profile_queries: Vec<Vec<Vec<u32>>> =
        training.into_iter().map(|t| t.into_iter().take(opts.profile_questions).collect()).collect();
    let longest_q = own_questions.iter().flatten().map(Vec::len).fold(longest_q, usize::max);
    let question_slack_tokens = (longest_q as u64 + bs as u64).max(RequestKind::MIN_QUESTION_SLACK_TOKENS);
    let mut ranking: Vec<usize> = (0..docs.len()).collect();
    ranking.shuffle(&mut rng);
    let cdf = zipf_cdf(docs.len(), opts.zipf_s);
    let workload: Vec<Request> = (0..opts.requests)
        .map(|_| {
            let u: f64 = rng.random();
            let rank = cdf.partition_point(|&c| c < u).min(docs.len() - 1);
            let context = ranking[rank];
            let q = match &own_questions[context] {
                Some(own) => own,
                None => &questions[rng.random_range(0..questions.len())],
            };
            let mut prompt = docs[context].clone();
            prompt.extend_from_slice(q);
            Request { context, prompt }
        })
        .collect();

    let token_bytes = (2 * info.kv_dtype.slot_bytes(info.head_dim) * layout.group_size()) as u64;
    let workload_kv_bytes = docs.iter().map(|d| d.len() as u64).sum::<u64>() * token_bytes;
    // The pool holds the largest prompt and its answer, at least `device_tokens`.
    let device_tokens = opts.device_tokens.max(opts.max_tokens + longest_q + opts.answer_tokens + bs);
    let num_blocks = layout.blocks_for_tokens(device_tokens);
    let device_bytes = (num_blocks / layout.group_size() * bs) as u64 * token_bytes;
    let base = EngineConfig {
        num_blocks,
        threads: opts.threads,
        max_running: 1,
        bf16_matmuls: opts.bf16_matmuls,
        kivi_int8_layers: opts.kivi_int8_layers.clone(),
        ..EngineConfig::new(model)
    };
    let run_dir = opts.data_dir.as_ref().map(|d| d.join(format!("bench-tiers-zipf-{}", std::process::id())));
    let tiers = |name: &str| TierConfig {
        data_dir: run_dir.as_ref().map(|d| d.join(name)),
        host_bytes: opts.host_mib << 20,
        disk_bytes: if run_dir.is_some() { opts.disk_mib << 20 } else { 0 },
    };

    let mut configs: Vec<(String, EngineConfig)> =
        vec![("recompute".into(), EngineConfig { enable_prefix_cache: false, ..base.clone() })];
    let mut baselines = vec![("lru".to_owned(), TierPlacement::default())];
    baselines.extend(codecs.iter().map(|c| (format!("lru+{c}"), TierPlacement::LruCodec(*c))));
    if let Some(wanted) = &opts.baselines
        && let Some(unknown) = wanted.iter().find(|w| !baselines.iter().any(|(name, _)| name == *w))
    {
        let names: Vec<&str> = baselines.iter().map(|(name, _)| name.as_str()).collect();
        return bad(format!("unknown baseline {unknown:?}; expected some of {}", names.join(", ")));
    }
    let with_residual = |name: &str, r: usize| if r == 0 { name.to_owned() } else { format!("{name} r={r}") };
    for (name, placement) in baselines {
        if opts.baselines.as_ref().is_none_or(|wanted| wanted.contains(&name)) {
            let kivi = matches!(placement, TierPlacement::LruCodec(c) if residual::has_residual(GroupCodec::Kv(c)));
            for &r in if kivi { &opts.kivi_residual_tokens[..] } else { &[0] } {
                let name = with_residual(&name, r);
                let cfg = EngineConfig {
                    tiers: tiers(&name),
                    placement: placement.clone(),
                    kivi_residual_tokens: r,
                    ..base.clone()
                };
                configs.push((name, cfg));
            }
        }
    }
    let evicpress_variants = opts
        .alphas
        .iter()
        .flat_map(|&a| opts.greedy.iter().flat_map(move |&g| opts.upgrade.iter().map(move |&u| (a, g, u))))
        .flat_map(|v| opts.kivi_residual_tokens.iter().map(move |&r| (v, r)));
    for ((alpha, greedy, upgrade), residual_tokens) in evicpress_variants {
        let ep = EvicPressConfig {
            alpha,
            codecs: codecs.clone(),
            keep_ratios: opts.keep_ratios.clone(),
            scoring: opts.profile_scoring,
            // Observed, the profiler scores the workload's answer length (`answer_tokens`), in steps of
            // 1/answer_tokens; fixed, its default 16 positions.
            horizon: opts.horizon,
            shrink: opts.shrink,
            pooled: opts.pooled,
            greedy,
            // Each context's own, given by its requests (`profile_queries`).
            profile_questions: Vec::new(),
            upgrade,
            ..EvicPressConfig::default()
        };
        let mut name = EVICPRESS.to_owned();
        if opts.alphas.len() > 1 {
            name += &format!(" a={alpha}");
        }
        if opts.greedy != [GreedyRule::Drop] {
            name += &format!(" {}", greedy.name());
        }
        if upgrade {
            name += " upgrade";
        }
        let name = with_residual(&name, residual_tokens);
        configs.push((
            name.clone(),
            EngineConfig {
                tiers: tiers(&name),
                placement: TierPlacement::EvicPress(ep),
                kivi_residual_tokens: residual_tokens,
                ..base.clone()
            },
        ));
    }

    // Ingested in the documents' order, which the seeded shuffle made independent of their popularity.
    let offline: Vec<Vec<u32>> = if opts.offline_phase {
        docs.iter().map(|d| [d.as_slice(), &training_question].concat()).collect()
    } else {
        Vec::new()
    };
    // The shared prefill keeps the workload's native KV on its own disk tier (RAM when there is no data dir and it
    // is small), with room for each file's header.
    let seed_bytes = workload_kv_bytes + workload_kv_bytes / 16 + (16 << 20);
    let seed_tiers = match (&opts.seed_dir, &run_dir) {
        _ if offline.is_empty() => None,
        (Some(d), _) => Some(TierConfig { data_dir: Some(d.clone()), host_bytes: 0, disk_bytes: seed_bytes }),
        (None, Some(d)) => Some(TierConfig { data_dir: Some(d.join("seed")), host_bytes: 0, disk_bytes: seed_bytes }),
        (None, None) => (seed_bytes <= MAX_SEEDS_IN_RAM).then_some(TierConfig {
            data_dir: None,
            host_bytes: seed_bytes,
            disk_bytes: 0,
        }),
    };
    let seeds = match seed_tiers {
        Some(t) => {
            Some(Seeds::prefill(&EngineConfig { model_path: model.to_path_buf(), ..base.clone() }, t, &offline)?)
        }
        None => None,
    };
    let (seed_seconds, seed_computed) = seeds.as_ref().map_or((0.0, 0), |s| (s.seconds, s.computed));
    let model_name = model.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let report = |results: Vec<ZipfConfigResult>| ZipfReport {
        model: model_name.clone(),
        options: opts.clone(),
        source: source.clone(),
        context_kinds: context_kinds.clone(),
        question_slack_tokens,
        workload_kv_bytes,
        device_bytes,
        seed_seconds,
        seed_computed,
        results,
    };
    // Listed order is the report's; `run_rank` ranks what the comparison needs first (see the doc comment).
    let run_rank = |name: &str| match name {
        "recompute" => 0,
        n if n.starts_with(EVICPRESS) && (n.contains(" r=") || opts.kivi_residual_tokens.iter().all(|&r| r == 0)) => 1,
        n if n.starts_with(EVICPRESS) => 4,
        "lru" => 3,
        _ => 2,
    };
    let mut in_run_order: Vec<(usize, (String, EngineConfig))> = configs.into_iter().enumerate().collect();
    in_run_order.sort_by_key(|(_, (name, _))| run_rank(name));
    let mut finished: Vec<(usize, ZipfConfigResult)> = Vec::new();
    let mut reference: Option<Vec<Vec<u32>>> = None;
    let mut outcome = Ok(());
    for (index, (name, cfg)) in in_run_order {
        tracing::info!(config = %name, "bench tiers zipf: running");
        // Recompute keeps nothing, so an offline phase would change nothing but its run time.
        let ingest = Offline {
            prompts: if cfg.enable_prefix_cache { offline.as_slice() } else { &[] },
            seeds: seeds.as_ref(),
            profile_queries: &profile_queries,
        };
        match run_config(model, opts, &name, cfg, &workload, ingest, reference.as_deref()) {
            Ok((r, answers)) => {
                // A full-size run takes hours; each configuration's summary is logged as it finishes, so that an
                // interrupted run still leaves the configurations it completed.
                tracing::info!(
                    config = %name,
                    ttft_ms_mean = r.ttft_ms_mean,
                    ttft_ms_p99 = r.ttft_ms_p99,
                    quality = r.quality,
                    reuse_quality = ?r.reuse_quality,
                    hit_rate = ?r.hit_rate,
                    computed_rate = r.computed_rate,
                    seconds = r.seconds,
                    offline_seconds = r.offline_seconds,
                    "bench tiers zipf: configuration done"
                );
                if reference.is_none() {
                    reference = Some(answers);
                }
                finished.push((index, r));
                finished.sort_by_key(|(i, _)| *i);
                progress(&report(finished.iter().map(|(_, r)| r.clone()).collect()));
            }
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
    }
    if let Some(s) = seeds {
        s.engine.shutdown();
    }
    if let Some(d) = &run_dir {
        let _ = std::fs::remove_dir_all(d);
    }
    outcome?;
    Ok(report(finished.into_iter().map(|(_, r)| r).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task item's requests ask its own question and its training queries ask others, each continuing the
    /// group-aligned document with the tokens cut from it, so that the text a query sees is the item's own.
    #[test]
    fn task_items_carry_their_own_training_queries() {
        let tokenizer = crate::eval::tasks::tests::tokenizer();
        for (i, kind) in TaskKind::ALL.into_iter().enumerate() {
            let seed = 11 + i as u64;
            let item = crate::eval::generate(kind, seed, 1024 - 16, &|s| tokenizer.encode(s, false).len());
            let (context, _) = item.context_and_question().expect("item has a question");
            let d = task_document(kind, seed, 1024, tokenizer, 16).expect("task document");
            assert_eq!(d.doc.len() % 16, 0, "{kind}");
            assert_eq!(d.training.len(), item.training_questions.len(), "{kind}");
            assert!((1..=PROFILE_QUESTIONS.len()).contains(&d.training.len()), "{kind}");
            for (t, text) in d.training.iter().zip(&item.training_questions) {
                assert_ne!(t, &d.question, "{kind}: a training query is the question requests ask");
                assert!(t.len() <= MAX_TASK_QUESTION_TOKENS, "{kind}: {} tokens", t.len());
                let whole = tokenizer.decode(&[d.doc.as_slice(), t].concat(), false);
                assert!(whole.starts_with(context) && whole.contains(text.as_str()), "{kind}: {whole:?}");
            }
        }
    }

    #[test]
    fn requests_are_classified_by_where_their_kv_came_from() {
        let r = |computed, hit: [u64; 3], pruned| RequestRecord {
            context: 0,
            prompt_tokens: 800,
            ttft_ms: 1.0,
            computed_tokens: computed,
            hit_tokens: hit,
            pruned,
            quality: 1.0,
        };
        let kind = |r: RequestRecord| RequestKind::of(&r, RequestKind::MIN_QUESTION_SLACK_TOKENS);
        assert_eq!(kind(r(800, [0; 3], false)), RequestKind::Cold);
        assert_eq!(kind(r(13, [0, 0, 784], true)), RequestKind::Pruned);
        assert_eq!(kind(r(13, [784, 0, 0], false)), RequestKind::Device);
        assert_eq!(kind(r(13, [160, 624, 0], false)), RequestKind::Tier);
        assert_eq!(kind(r(400, [0, 0, 400], false)), RequestKind::Partial);
        // Reuse: a hit in any tier, or a pruned copy; computing the whole prompt is not.
        let reused: Vec<bool> = [r(800, [0; 3], false), r(13, [0, 0, 784], true), r(13, [784, 0, 0], false)]
            .iter()
            .chain(&[r(400, [0, 400, 0], false), r(13, [0; 3], true)])
            .map(RequestRecord::reused)
            .collect();
        assert_eq!(reused, [false, true, true, true, true]);
    }

    /// Each fixed codec is measured against the fastest EvicPress point at its quality or above, and LRU against
    /// the fastest within 3% of its quality (the first run of docs/BENCHMARKS.md's bf16 capacity-bound section).
    #[test]
    fn targets_compare_each_baseline_with_the_fastest_evicpress_point_at_its_quality() {
        let result = |name: &str, ttft_ms_mean: f64, quality: f64| ZipfConfigResult {
            name: name.into(),
            requests: 128,
            completed: 128,
            ttft_ms_mean,
            ttft_ms_p99: ttft_ms_mean,
            quality,
            reuse_quality: None,
            hit_rate: [0.0; 3],
            computed_rate: 0.0,
            peak_used_bytes: [0; 3],
            capacity_bytes: [0; 3],
            evicpress: None,
            peak_planned_bytes: [0; 3],
            seconds: 0.0,
            offline_seconds: 0.0,
            offline_computed_tokens: 0,
            offline_seeded: 0,
            per_request: Vec::new(),
        };
        let report = ZipfReport {
            model: String::new(),
            options: ZipfBenchOptions::default(),
            source: String::new(),
            workload_kv_bytes: 0,
            device_bytes: 0,
            seed_seconds: 0.0,
            seed_computed: 0,
            context_kinds: Vec::new(),
            question_slack_tokens: RequestKind::MIN_QUESTION_SLACK_TOKENS,
            results: vec![
                result("lru", 374.2, 1.0),
                result("lru+int8", 318.4, 0.994),
                result("lru+int4_kivi", 232.4, 0.912),
                result("lru+int2_kivi", 141.1, 0.639),
                result("evicpress a=1", 100.0, 0.713),
                result("evicpress a=4", 237.5, 0.988),
                result("evicpress a=16", 268.4, 0.995),
            ],
        };
        let text = report.comparison();
        // The line that starts with `baseline`: it names `point`, gives `ratio` and says whether the target is met.
        let says = |baseline: &str, point: &str, ratio: &str, met: bool| {
            let line = text.lines().find(|l| l.starts_with(baseline)).unwrap_or_default();
            let verdict = if met { ": met)." } else { ": not met)." };
            line.contains(point) && line.contains(&format!("is {ratio}x lower")) && line.ends_with(verdict)
        };
        assert!(says("vs lru+int2_kivi", "evicpress a=1 (0.713, 100.0 ms)", "1.41", true), "{text}");
        assert!(says("vs lru+int4_kivi", "evicpress a=4 (0.988, 237.5 ms)", "0.98", false), "{text}");
        assert!(says("vs lru+int8", "evicpress a=16 (0.995, 268.4 ms)", "1.19", false), "{text}");
        assert!(says("vs lru (1.000", "evicpress a=4 (0.988, 237.5 ms)", "1.58", true), "{text}");

        let unreached =
            ZipfReport { results: vec![result("lru+f16", 50.0, 1.0), result("evicpress a=16", 40.0, 0.9)], ..report };
        assert!(
            unreached.comparison().contains("no EvicPress point of equal or better quality"),
            "{}",
            unreached.comparison()
        );
    }

    #[test]
    fn arrivals_are_a_seeded_poisson_process() {
        let a = arrival_times(11, 2.0, 4000);
        assert_eq!(a[0], 0.0);
        assert!(a.windows(2).all(|w| w[0] < w[1]), "arrivals only move forward");
        assert_eq!(a, arrival_times(11, 2.0, 4000), "the same arrivals for every configuration of a run");
        assert_ne!(a, arrival_times(12, 2.0, 4000));
        // Exponential gaps of mean 1/rate: the mean over 3,999 gaps is within a few percent of 0.5 s, and about
        // 1 - e^-1 of them are shorter than the mean.
        let gaps: Vec<f64> = a.windows(2).map(|w| w[1] - w[0]).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((mean - 0.5).abs() < 0.05, "{mean}");
        let short = gaps.iter().filter(|&&g| g < 0.5).count() as f64 / gaps.len() as f64;
        assert!((short - (1.0 - (-1.0f64).exp())).abs() < 0.05, "{short}");
    }

    #[test]
    fn zipf_favours_low_ranks() {
        let cdf = zipf_cdf(200, 1.1);
        assert!((cdf[199] - 1.0).abs() < 1e-12);
        assert!(cdf.windows(2).all(|w| w[0] < w[1]));
        // Rank 1's share is 1 / H(200, 1.1) ≈ 0.2.
        assert!(cdf[0] > 0.15 && cdf[0] < 0.25, "{}", cdf[0]);
    }
}
