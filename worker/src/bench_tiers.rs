//! Tier benchmark (`pagoda bench tiers`): serving a long context's prefix from the host (and optionally disk)
//! tier against recomputing it, side by side on one engine configuration.
//!
//! The device pool holds exactly one context (plus one group), so one filler request of the same length pushes
//! every idle group of the previous prompt out of the device. Each repeat, with a fresh pseudo-random prompt:
//! 1. **recompute**: the prompt cold (nothing cached anywhere), `max_tokens = 1`: the full prefill;
//! 2. a filler prompt of the same length (pushes the prompt's groups down to host);
//! 3. **host**: the prompt again: its prefix is onboarded from the host tier, the last partial block and the
//!    first token are computed.
//!
//! With a data dir, a second engine with only a disk tier repeats the sequence (**disk**; the files were just
//! written, so reads are usually served by the OS page cache). Times are whole-request latencies (submit →
//! `Finished`) through the threaded engine; the report keeps the median of each column.

use std::path::{Path, PathBuf};
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use pagoda_kernels::Codec;

use crate::engine::{
    Engine, EngineConfig, EngineError, EngineHandle, GenerateEvent, GenerateRequest, SamplingParams, TierPlacement,
};
use crate::policy::PolicySpec;
use crate::tiers::{Tier, TierConfig};

#[derive(Debug, Clone, Serialize)]
pub struct TiersBenchOptions {
    pub threads: usize,
    pub context_tokens: usize,
    pub repeats: usize,
    pub host_mib: u64,
    /// Also measure the disk tier, with files under `<data_dir>/kv/`.
    pub data_dir: Option<PathBuf>,
    /// Also measure the host tier with every group stored in each of these codecs (`--tier-codec`; the compressing
    /// kernels codecs, not `f16`/`f32`).
    pub codecs: Vec<String>,
    pub seed: u64,
}

impl Default for TiersBenchOptions {
    fn default() -> TiersBenchOptions {
        TiersBenchOptions {
            threads: 0,
            context_tokens: 2048,
            repeats: 3,
            host_mib: 1024,
            data_dir: None,
            codecs: Vec::new(),
            seed: 7,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TierRun {
    pub tier: String,
    /// How the tier stored the prefix's groups: the native format, or the codec every group was encoded with.
    pub stored_as: String,
    /// Median whole-request seconds with the prefix served from this tier.
    pub seconds: f64,
    /// Median seconds of the same request recomputed from scratch (same engine, same repeat).
    pub recompute_seconds: f64,
    pub speedup: f64,
    /// Prompt tokens served from this tier in the measured requests, over all repeats.
    pub onboarded_tokens: u64,
    /// Prompt tokens the measured requests computed, over all repeats (the uncached tail).
    pub computed_tokens: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct TiersReport {
    pub model: String,
    pub options: TiersBenchOptions,
    pub runs: Vec<TierRun>,
}

impl TiersReport {
    pub fn to_markdown(&self) -> String {
        let mut s = format!(
            "Model {}, context {} tokens, {} repeats (medians)\n\n| prefix from | stored as | request s | recompute s | \
             speedup | tokens onboarded | tokens computed |\n|---|---|---|---|---|---|---|\n",
            self.model, self.options.context_tokens, self.options.repeats
        );
        for r in &self.runs {
            s += &format!(
                "| {} | {} | {:.3} | {:.3} | {:.1}x | {} | {} |\n",
                r.tier, r.stored_as, r.seconds, r.recompute_seconds, r.speedup, r.onboarded_tokens, r.computed_tokens
            );
        }
        s
    }

    pub fn to_json_string(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

fn request(prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest {
        request_id: "bench".into(),
        prompt,
        max_tokens: 1,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        namespace: String::new(),
        policy: Some(PolicySpec::full()),
        ignore_eos: true,
        profile_queries: Vec::new(),
        logprobs: None,
        prompt_logprobs: None,
        priority: 0,
        tenant_weight: 1,
        tier_codec: None,
        lora: None,
    }
}

/// Runs one request to `Finished` and returns its latency in seconds.
fn timed(engine: &EngineHandle, prompt: Vec<u32>) -> Result<f64, EngineError> {
    let t0 = Instant::now();
    let mut rx = engine.submit(request(prompt))?;
    loop {
        match rx.blocking_recv() {
            Some(GenerateEvent::Token { .. } | GenerateEvent::PromptLogprobs(_)) => {}
            Some(GenerateEvent::Finished { .. }) => return Ok(t0.elapsed().as_secs_f64()),
            Some(GenerateEvent::Failed(e) | GenerateEvent::Refused(e)) => return Err(EngineError::Forward(e)),
            None => return Err(EngineError::Stopped),
        }
    }
}

/// The engine publishes stats right after a request's last step; wait for the snapshot that includes it.
fn settled(engine: &EngineHandle, computed_at_least: u64) -> crate::engine::EngineStats {
    for _ in 0..1000 {
        let s = engine.stats();
        if s.running == 0 && s.waiting == 0 && s.computed_tokens_total >= computed_at_least {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    engine.stats()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn run_tier(
    model: &Path,
    opts: &TiersBenchOptions,
    tier: Tier,
    tiers: TierConfig,
    codec: Option<Codec>,
) -> Result<TierRun, EngineError> {
    let probe = Engine::start(EngineConfig { num_blocks: 90, threads: 1, max_running: 1, ..EngineConfig::new(model) })?;
    let info = probe.model_info().clone();
    probe.shutdown();
    if opts.context_tokens + 2 >= info.context_length {
        return Err(EngineError::Config(format!(
            "context {} does not fit the model's {}",
            opts.context_tokens, info.context_length
        )));
    }
    let layout = info.layout();
    let cfg = EngineConfig {
        // One context plus one group: a filler of the same length evicts every idle group.
        num_blocks: layout.blocks_for_tokens(opts.context_tokens + 1) + layout.group_size(),
        threads: opts.threads,
        tiers,
        placement: codec.map_or(TierPlacement::Lru, TierPlacement::LruCodec),
        ..EngineConfig::new(model)
    };
    let engine = Engine::start(cfg)?;
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let vocab = info.vocab_size as u32;
    let mut prompt = || (0..opts.context_tokens).map(|_| rng.random_range(0..vocab)).collect::<Vec<u32>>();
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    let (mut onboarded, mut computed) = (0, 0);
    for _ in 0..opts.repeats.max(1) {
        let p = prompt();
        cold.push(timed(&engine, p.clone())?);
        timed(&engine, prompt())?;
        let before = settled(&engine, 0);
        warm.push(timed(&engine, p)?);
        let after = settled(&engine, before.computed_tokens_total + 1);
        onboarded += after.prefix_hit_tokens[tier.index()] - before.prefix_hit_tokens[tier.index()];
        computed += after.computed_tokens_total - before.computed_tokens_total;
    }
    engine.shutdown();
    let (seconds, recompute_seconds) = (median(warm), median(cold));
    Ok(TierRun {
        tier: tier.name().to_owned(),
        stored_as: codec.map_or_else(|| info.kv_dtype.to_string(), |c| c.to_string()),
        seconds,
        recompute_seconds,
        speedup: recompute_seconds / seconds.max(1e-9),
        onboarded_tokens: onboarded,
        computed_tokens: computed,
    })
}

/// The kernels codecs named in `names`, for the benches' tiers: each must parse, and be a compressing one (`f16` and
/// `f32` are the native formats, which every run measures anyway).
pub(crate) fn compressing_codecs(names: &[String]) -> Result<Vec<Codec>, EngineError> {
    names
        .iter()
        .map(|c| match c.parse::<Codec>().map_err(|e| EngineError::Config(e.to_string()))? {
            Codec::F32 | Codec::F16 => {
                Err(EngineError::Config(format!("{c} is the native format, not a compressing codec")))
            }
            codec => Ok(codec),
        })
        .collect()
}

pub fn tiers_bench(model: &Path, opts: &TiersBenchOptions) -> Result<TiersReport, EngineError> {
    let codecs = compressing_codecs(&opts.codecs)?;
    let mut runs = Vec::new();
    let host = TierConfig { data_dir: None, host_bytes: opts.host_mib << 20, disk_bytes: 0 };
    runs.push(run_tier(model, opts, Tier::Host, host.clone(), None)?);
    for c in codecs {
        runs.push(run_tier(model, opts, Tier::Host, host.clone(), Some(c))?);
    }
    if let Some(dir) = &opts.data_dir {
        let root = dir.join(format!("bench-tiers-{}", std::process::id()));
        let disk = TierConfig { data_dir: Some(root.clone()), host_bytes: 0, disk_bytes: opts.host_mib << 20 };
        let r = run_tier(model, opts, Tier::Disk, disk, None);
        let _ = std::fs::remove_dir_all(&root);
        runs.push(r?);
    }
    let name = model.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(TiersReport { model: name, options: opts.clone(), runs })
}
