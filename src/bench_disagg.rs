//! `pagoda bench disaggregation`: the same open-loop stream of long-prompt chat requests served by two workers
//! that each prefill and decode (colocated), and by a prefill worker and a decode worker (disaggregated: the
//! router sends each long prompt to the prefill worker and the decode worker pulls its KV), side by side in one
//! run, on fresh worker processes each time.
//!
//! **The load** (deterministic from `--seed`): `--requests` chat requests arriving as a Poisson process of
//! `--rate` per second, each with its own user message of `--min-prompt-words`..=`--max-prompt-words` words (no two
//! share a prefix, so every prompt is prefilled somewhere) and exactly `--max-tokens` greedy output tokens
//! (`ignore_eos`). Both deployments get the same requests at the same times, and the deployments alternate for
//! `--rounds` rounds.
//!
//! **Reported**, per deployment (medians over rounds): time to first token (p50, p99), the inter-token latency
//! of every streamed delta (p50, p99, max), each request's mean time per output token (p50, p99), end-to-end
//! latency, generated tokens per second over the run, and how the remote prefills ended. What disaggregation buys
//! is the decode stream's steadiness: a colocated worker runs each arriving prompt's chunks in the steps of the
//! streams it is decoding, which then wait; a decode worker only computes the last block of a prompt.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use pagoda_e2e::load::{self, Outcome};
use pagoda_e2e::metric_samples;
use plotters::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};

use crate::bench_plot::{COLORS, FONT, draw_legend_at, register_font};
use crate::bench_routing::{Deployment, deploy_cluster, percentile, wait_all_ready};

/// What to run.
#[derive(Debug, Clone, Serialize)]
pub struct DisaggBenchOptions {
    pub model: PathBuf,
    pub worker_threads: usize,
    pub requests: usize,
    /// Arrivals per second (Poisson).
    pub rate: f64,
    pub min_prompt_words: usize,
    pub max_prompt_words: usize,
    pub max_tokens: u32,
    /// The router's `--remote-prefill-min-tokens` in the disaggregated deployments.
    pub remote_prefill_min_tokens: u64,
    /// With a bound, a third deployment: disaggregated with `--remote-prefill-max-queued-tokens` this (0: none).
    pub remote_prefill_max_queued_tokens: u64,
    pub rounds: usize,
    pub seed: u64,
    /// Every request must end within this; one that does not fails the run.
    pub deadline_secs: u64,
}

/// The deployments, in the order of the first round: two colocated workers, one prefill and one decode worker,
/// and the same with the prefill queue bounded (conditional disaggregation).
pub const DEPLOYMENTS: [&str; 3] = ["colocated", "disaggregated", "conditional"];

impl DisaggBenchOptions {
    /// The deployments this run compares (the conditional one only with a queue bound).
    pub fn deployments(&self) -> &'static [&'static str] {
        if self.remote_prefill_max_queued_tokens > 0 { &DEPLOYMENTS } else { &DEPLOYMENTS[..2] }
    }
}

/// One deployment's figures in one round.
#[derive(Debug, Clone, Serialize)]
pub struct RoundResult {
    pub deployment: String,
    pub round: usize,
    pub requests: usize,
    pub failed: usize,
    pub p50_ttft_s: f64,
    pub p99_ttft_s: f64,
    pub p50_itl_s: f64,
    pub p99_itl_s: f64,
    pub max_itl_s: f64,
    /// Per request: (end − first token) / (output tokens − 1); p50 and p99 over the requests.
    pub p50_tpot_s: f64,
    pub p99_tpot_s: f64,
    pub p50_e2e_s: f64,
    pub completion_tokens_per_s: f64,
    pub wall_s: f64,
    /// Prompt tokens the answering worker found cached (pulled from the prefill worker when disaggregated).
    pub cached_prompt_share: f64,
    /// `pagoda_router_remote_prefills_total` by outcome.
    pub remote_prefills: Vec<(String, u64)>,
    /// Every inter-token gap (s) and every TTFT (s), sorted, for the plot.
    #[serde(skip)]
    pub itls: Vec<f64>,
    #[serde(skip)]
    pub ttfts: Vec<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DisaggReport {
    pub options: DisaggBenchOptions,
    pub prompt_tokens_mean: f64,
    pub rounds: Vec<RoundResult>,
}

const WORDS: [&str; 40] = [
    "river", "mountain", "garden", "window", "station", "library", "kitchen", "market", "island", "forest", "bridge",
    "harbor", "valley", "castle", "meadow", "village", "desert", "canyon", "theater", "museum", "orchard", "lantern",
    "compass", "journey", "weather", "planet", "signal", "engine", "paper", "letter", "number", "story", "season",
    "morning", "evening", "winter", "summer", "autumn", "spring", "harvest",
];

/// The requests: arrival offsets and user messages.
fn workload(o: &DisaggBenchOptions) -> Vec<(Duration, String)> {
    let mut rng = StdRng::seed_from_u64(o.seed);
    let mut at = 0.0f64;
    (0..o.requests)
        .map(|i| {
            if i > 0 {
                // Exponential gaps: a Poisson process of `rate` arrivals per second.
                let u: f64 = rng.random_range(f64::EPSILON..1.0);
                at += -u.ln() / o.rate;
            }
            let words = rng.random_range(o.min_prompt_words..=o.max_prompt_words);
            let mut text = format!("Request {i}. Summarise this log in one line:");
            for _ in 0..words {
                text.push(' ');
                text.push_str(WORDS[rng.random_range(0..WORDS.len())]);
            }
            (Duration::from_secs_f64(at), text)
        })
        .collect()
}

fn deploy(o: &DisaggBenchOptions, deployment: &str) -> Result<Deployment> {
    let roles: [&str; 2] = if deployment == "colocated" { ["both", "both"] } else { ["prefill", "decode"] };
    let workers: Vec<Vec<String>> = roles.iter().map(|r| vec!["--role".to_string(), r.to_string()]).collect();
    let mut router = vec!["--remote-prefill-min-tokens".to_string(), o.remote_prefill_min_tokens.to_string()];
    if deployment == "conditional" {
        router.extend(["--remote-prefill-max-queued-tokens".into(), o.remote_prefill_max_queued_tokens.to_string()]);
    }
    deploy_cluster(&format!("disagg-{deployment}"), &o.model, o.worker_threads, &workers, &router)
}

async fn run_round(o: &DisaggBenchOptions, deployment: &str, round: usize) -> Result<(RoundResult, Vec<u64>)> {
    let d = deploy(o, deployment)?;
    wait_all_ready(&d).await?;
    let (_, models) = d.http.get("/v1/models").await?;
    let model_id = serde_json::from_str::<Value>(&models)?["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| anyhow!("no model in /v1/models: {models}"))?;
    let http = d.http.clone().with_model(model_id.clone());
    let body = |text: &str| {
        json!({
            "model": model_id, "messages": [{"role": "user", "content": text}], "max_tokens": o.max_tokens,
            "temperature": 0, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
        })
    };
    // One short request first, so that no deployment's first measured request pays for cold caches.
    let warm = load::chat_once(&http, &body("Say hello."), true).await;
    if warm.outcome != Outcome::Completed {
        bail!("{deployment}: the warm-up request failed: {:?}", warm.error);
    }
    let deadline = Duration::from_secs(o.deadline_secs);
    let t0 = Instant::now();
    let tasks = workload(o).into_iter().map(|(at, text)| {
        let (http, body) = (http.clone(), body(&text));
        async move {
            tokio::time::sleep(at).await;
            tokio::time::timeout(deadline, load::chat_once(&http, &body, true)).await.ok()
        }
    });
    let records = futures::future::join_all(tasks).await;
    let wall = t0.elapsed().as_secs_f64();
    let (_, metrics) = d.http.get("/metrics").await?;
    drop(d);
    let mut remote_prefills: Vec<(String, u64)> = metric_samples(&metrics, "pagoda_router_remote_prefills_total")
        .filter_map(|(labels, v)| {
            let outcome = labels.split("outcome=\"").nth(1)?.split('"').next()?;
            Some((outcome.to_string(), v as u64))
        })
        .collect();
    remote_prefills.sort();
    let ok: Vec<&load::Record> =
        records.iter().flatten().filter(|r| r.outcome == Outcome::Completed && r.ttft.is_some()).collect();
    let failed = records.len() - ok.len();
    if failed > 0 {
        let why = records.iter().flatten().find_map(|r| r.error.clone()).unwrap_or_else(|| "timed out".into());
        tracing::warn!(deployment, failed, error = %why, "requests failed");
    }
    let secs = |d: Duration| d.as_secs_f64();
    let mut ttfts: Vec<f64> = ok.iter().filter_map(|r| r.ttft.map(secs)).collect();
    let mut itls: Vec<f64> =
        ok.iter().flat_map(|r| r.delta_times.windows(2).map(|w| secs(w[1].saturating_sub(w[0])))).collect();
    let mut tpots: Vec<f64> = ok
        .iter()
        .filter_map(|r| {
            let (n, ttft) = (r.completion_tokens? as f64, secs(r.ttft?));
            (n > 1.0).then(|| (secs(r.ended_at) - ttft) / (n - 1.0))
        })
        .collect();
    let mut e2e: Vec<f64> = ok.iter().map(|r| secs(r.ended_at)).collect();
    for v in [&mut ttfts, &mut itls, &mut tpots, &mut e2e] {
        v.sort_by(f64::total_cmp);
    }
    let prompt: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let cached: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
    let generated: u64 = ok.iter().filter_map(|r| r.completion_tokens).sum();
    let prompt_lens = ok.iter().filter_map(|r| r.prompt_tokens).collect();
    let result = RoundResult {
        deployment: deployment.to_string(),
        round,
        requests: records.len(),
        failed,
        p50_ttft_s: percentile(&ttfts, 0.5),
        p99_ttft_s: percentile(&ttfts, 0.99),
        p50_itl_s: percentile(&itls, 0.5),
        p99_itl_s: percentile(&itls, 0.99),
        max_itl_s: itls.last().copied().unwrap_or(0.0),
        p50_tpot_s: percentile(&tpots, 0.5),
        p99_tpot_s: percentile(&tpots, 0.99),
        p50_e2e_s: percentile(&e2e, 0.5),
        completion_tokens_per_s: generated as f64 / wall,
        wall_s: wall,
        cached_prompt_share: if prompt > 0 { cached as f64 / prompt as f64 } else { 0.0 },
        remote_prefills,
        itls,
        ttfts,
    };
    Ok((result, prompt_lens))
}

/// Runs both deployments, alternating their order round by round.
pub async fn run(o: DisaggBenchOptions) -> Result<DisaggReport> {
    if o.requests == 0 || o.rounds == 0 || !(o.rate.is_finite() && o.rate > 0.0) {
        bail!("--requests, --rounds and --rate must be positive");
    }
    if o.min_prompt_words == 0 || o.min_prompt_words > o.max_prompt_words {
        bail!("--min-prompt-words must be at least 1 and at most --max-prompt-words");
    }
    let mut rounds = Vec::new();
    let mut prompt_tokens_mean = None;
    for round in 0..o.rounds {
        let mut order = o.deployments().to_vec();
        if round % 2 == 1 {
            order.reverse();
        }
        for deployment in order {
            tracing::info!(deployment, round, "disaggregation bench: running");
            let (r, lens) = run_round(&o, deployment, round).await.with_context(|| deployment.to_string())?;
            prompt_tokens_mean.get_or_insert(lens.iter().sum::<u64>() as f64 / lens.len().max(1) as f64);
            rounds.push(r);
        }
    }
    Ok(DisaggReport { options: o, prompt_tokens_mean: prompt_tokens_mean.unwrap_or(0.0), rounds })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

impl DisaggReport {
    fn rounds_of<'a>(&'a self, deployment: &'a str) -> impl Iterator<Item = &'a RoundResult> + 'a {
        self.rounds.iter().filter(move |r| r.deployment == deployment)
    }

    /// The median over rounds of `f` for `deployment`.
    fn median_of(&self, deployment: &str, f: fn(&RoundResult) -> f64) -> f64 {
        median(self.rounds_of(deployment).map(f).collect())
    }

    /// A markdown table of per-round figures, then the medians with the disaggregated deployment's ratios to the
    /// colocated one's.
    pub fn markdown(&self) -> String {
        type Column = (&'static str, fn(&RoundResult) -> f64, f64);
        let columns: [Column; 9] = [
            ("TTFT p50 (s)", |r| r.p50_ttft_s, 1.0),
            ("TTFT p99 (s)", |r| r.p99_ttft_s, 1.0),
            ("ITL p50 (ms)", |r| r.p50_itl_s, 1e3),
            ("ITL p99 (ms)", |r| r.p99_itl_s, 1e3),
            ("ITL max (ms)", |r| r.max_itl_s, 1e3),
            ("TPOT p50 (ms)", |r| r.p50_tpot_s, 1e3),
            ("TPOT p99 (ms)", |r| r.p99_tpot_s, 1e3),
            ("E2E p50 (s)", |r| r.p50_e2e_s, 1.0),
            ("tokens/s", |r| r.completion_tokens_per_s, 1.0),
        ];
        let header = |first: &str, notes: bool| {
            let mut s = format!("| {first} |");
            for (name, _, _) in &columns {
                s.push_str(&format!(" {name} |"));
            }
            if notes {
                s.push_str(" failed, cached prompt share, remote prefills |");
            }
            s.push_str("\n|---|");
            for _ in &columns {
                s.push_str("---:|");
            }
            if notes {
                s.push_str("---|");
            }
            s.push('\n');
            s
        };
        let mut s = header("deployment, round", true);
        for r in &self.rounds {
            s.push_str(&format!("| {}, {} |", r.deployment, r.round + 1));
            for (_, f, scale) in &columns {
                s.push_str(&format!(" {:.3} |", f(r) * scale));
            }
            let prefills: Vec<String> = r.remote_prefills.iter().map(|(o, n)| format!("{n} {o}")).collect();
            s.push_str(&format!(
                " {}, {:.0}%, {} |\n",
                r.failed,
                r.cached_prompt_share * 100.0,
                if prefills.is_empty() { "none".to_string() } else { prefills.join(", ") }
            ));
        }
        s.push('\n');
        s.push_str(&header("median over rounds", false));
        for &deployment in self.options.deployments() {
            s.push_str(&format!("| {deployment} |"));
            for (_, f, scale) in &columns {
                let v = self.median_of(deployment, *f);
                let base = self.median_of(DEPLOYMENTS[0], *f);
                if deployment == DEPLOYMENTS[0] || base == 0.0 {
                    s.push_str(&format!(" {:.3} |", v * scale));
                } else {
                    s.push_str(&format!(" {:.3} ({:.2}×) |", v * scale, v / base));
                }
            }
            s.push('\n');
        }
        s
    }

    /// Two panels, each deployment's values by percentile (all rounds pooled): inter-token latency, and TTFT.
    pub fn draw(&self, path: &Path) -> Result<()> {
        register_font()?;
        let root = BitMapBackend::new(path, (1200, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        let o = &self.options;
        let title = format!(
            "Colocated vs disaggregated: {} requests at {}/s, prompts of {:.0} tokens (mean), {} output tokens, \
             2 workers x {} thread(s)",
            o.requests, o.rate, self.prompt_tokens_mean, o.max_tokens, o.worker_threads
        );
        let root = root.titled(&title, (FONT, 18)).map_err(|e| anyhow!("{e}"))?;
        let panels = root.split_evenly((1, 2));
        let pooled = |deployment: &str, pick: fn(&RoundResult) -> &Vec<f64>, scale: f64| {
            let mut v: Vec<f64> = self.rounds_of(deployment).flat_map(|r| pick(r).iter().map(|x| x * scale)).collect();
            v.sort_by(f64::total_cmp);
            v
        };
        // (caption, values, scale, log10 y axis, first percentile drawn): inter-token gaps span orders of magnitude,
        // and the deployments differ in their top decile.
        type PanelSpec = (&'static str, fn(&RoundResult) -> &Vec<f64>, f64, bool, f64);
        let specs: [PanelSpec; 2] = [
            ("Inter-token latency (ms, log scale), p90 to the max", |r| &r.itls, 1e3, true, 90.0),
            ("Time to first token (s) by percentile", |r| &r.ttfts, 1.0, false, 0.0),
        ];
        for (panel, (caption, pick, scale, log, from)) in panels.iter().zip(specs) {
            // Gaps under 1 ms are deltas that arrived together; they are drawn at 1 ms.
            let y = |v: f64| if log { v.max(1.0).log10() } else { v };
            let deployments = self.options.deployments();
            let series: Vec<Vec<(f64, f64)>> = deployments
                .iter()
                .map(|d| {
                    let values = pooled(d, pick, scale);
                    let n = values.len().max(1) as f64;
                    let at = |k: usize| (k as f64 + 1.0) / n * 100.0;
                    values.iter().enumerate().map(|(k, v)| (at(k), y(*v))).filter(|(p, _)| *p >= from).collect()
                })
                .collect();
            let (lo, hi) =
                series.iter().flatten().fold((f64::MAX, f64::MIN), |(lo, hi), (_, v)| (lo.min(*v), hi.max(*v)));
            let range = if log { lo.floor()..hi.ceil().max(lo.floor() + 1.0) } else { 0.0..(hi * 1.08).max(1e-3) };
            let mut chart = ChartBuilder::on(panel)
                .caption(caption, (FONT, 17))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(60)
                .build_cartesian_2d(from..100.0, range)
                .map_err(|e| anyhow!("{e}"))?;
            let y_label = |v: &f64| match 10f64.powf(*v) {
                t if log && t < 10.0 => format!("{t:.2}"),
                t if log => format!("{t:.0}"),
                _ => format!("{v:.1}"),
            };
            chart
                .configure_mesh()
                .x_desc("percentile")
                .x_label_formatter(&|x| format!("{x:.0}"))
                .y_label_formatter(&y_label)
                .label_style((FONT, 13))
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
            for (i, (deployment, points)) in deployments.iter().zip(&series).enumerate() {
                let color = COLORS[i];
                chart
                    .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
                    .map_err(|e| anyhow!("{e}"))?
                    .label(*deployment)
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(3)));
            }
            draw_legend_at(&mut chart, 14, SeriesLabelPosition::UpperLeft)?;
        }
        root.present().with_context(|| format!("cannot write {}", path.display()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> DisaggBenchOptions {
        DisaggBenchOptions {
            model: PathBuf::new(),
            worker_threads: 1,
            requests: 200,
            rate: 2.0,
            min_prompt_words: 10,
            max_prompt_words: 20,
            max_tokens: 8,
            remote_prefill_min_tokens: 256,
            remote_prefill_max_queued_tokens: 0,
            rounds: 1,
            seed: 3,
            deadline_secs: 60,
        }
    }

    #[test]
    fn the_workload_is_deterministic_poisson_and_prefix_free() {
        let o = options();
        let w = workload(&o);
        assert_eq!(w, workload(&o));
        let span = w.last().unwrap().0.as_secs_f64();
        // 199 gaps of mean 1 / rate: within 20% of 99.5 s for this many.
        assert!((span - 99.5).abs() < 0.2 * 99.5, "{span}");
        assert!(w.windows(2).all(|p| p[0].0 <= p[1].0));
        for (i, (_, text)) in w.iter().enumerate() {
            assert!(text.starts_with(&format!("Request {i}.")));
            let words = text.split(':').nth(1).unwrap().split_whitespace().count();
            assert!((10..=20).contains(&words), "{words}");
        }
    }

    #[test]
    fn medians_over_rounds() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0]), 2.5);
        assert_eq!(median(Vec::new()), 0.0);
    }
}
