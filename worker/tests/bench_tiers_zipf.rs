//! `pagoda bench tiers --workload zipf` at CI size on the REAL model: 12 contexts of 256–512 tokens reused with
//! Zipf(1.1), the workload's KV over 4× device + host, every configuration side by side. Checks what the benchmark
//! exists to show: every request completes with its answer, the recompute baseline reuses nothing, the tiered
//! configurations serve prompt tokens from the lower tiers, EvicPress profiles its contexts and never plans or
//! stores past a tier's capacity, compressing codecs lose no more than quality allows, and quality stays in [0, 1].
//!
//! The full-size run is `pagoda bench tiers --workload zipf` (docs/BENCHMARKS.md).

use std::path::PathBuf;

use pagoda_worker::bench_zipf::{
    PROFILE_QUESTIONS, ZipfBenchOptions, ZipfReport, zipf_bench, zipf_bench_with_progress,
};
use pagoda_worker::evicpress::GreedyRule;
use pagoda_worker::tiers::residual::MAX_RESIDUAL_TOKENS;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn model_path() -> PathBuf {
    let p = std::env::var_os("PAGODA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(p.exists(), "model not found at {} (run scripts/fetch-model or set PAGODA_MODEL)", p.display());
    p
}

#[test]
fn evicpress_and_baselines_on_a_small_zipf_workload() {
    let dir = std::env::temp_dir().join(format!("pagoda-bench-zipf-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let prose = root().join("data/prose");
    let opts = ZipfBenchOptions {
        threads: 2,
        contexts: 12,
        min_tokens: 256,
        max_tokens: 512,
        requests: 24,
        answer_tokens: 4,
        device_tokens: 0,
        host_mib: 8,
        disk_mib: 16,
        data_dir: Some(dir.clone()),
        // One fixed codec keeps CI short; the full run compares all four.
        codecs: vec!["int4_kivi".into()],
        // One keep ratio: the pruned copies of both formats.
        keep_ratios: vec![0.5],
        prose_dir: prose.is_dir().then_some(prose),
        ..ZipfBenchOptions::default()
    };
    let mut partial_reports: Vec<Vec<String>> = Vec::new();
    let report = zipf_bench_with_progress(&model_path(), &opts, |partial| {
        partial_reports.push(partial.results.iter().map(|r| r.name.clone()).collect());
    })
    .expect("bench runs");
    println!("{}", report.to_markdown());
    // The JSON report reads back (`pagoda bench tiers --from-json`) to the same tables.
    let read_back: ZipfReport = serde_json::from_str(&report.to_json_string()).expect("the report reads back");
    assert_eq!(read_back.to_markdown(), report.to_markdown());
    // Run order recompute, EvicPress, codecs, LRU; each partial report in the listed order.
    assert_eq!(
        partial_reports,
        [
            vec!["recompute"],
            vec!["recompute", "evicpress"],
            vec!["recompute", "lru+int4_kivi", "evicpress"],
            vec!["recompute", "lru", "lru+int4_kivi", "evicpress"],
        ]
    );
    assert!(!dir.join(format!("bench-tiers-zipf-{}", std::process::id())).exists(), "disk tiers cleaned up");

    let names: Vec<&str> = report.results.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["recompute", "lru", "lru+int4_kivi", "evicpress"]);
    let host_bytes = 8u64 << 20;
    assert!(
        report.workload_kv_bytes >= 4 * (report.device_bytes + host_bytes),
        "the workload's KV ({}) is at least 4x device + host ({} + {host_bytes})",
        report.workload_kv_bytes,
        report.device_bytes
    );
    for r in &report.results {
        let n = &r.name;
        assert_eq!((r.requests, r.completed), (24, 24), "{n}: every request completes with its answer");
        assert!((0.0..=1.0).contains(&r.quality), "{n}: quality {}", r.quality);
        let mean = r.per_request.iter().map(|q| q.quality).sum::<f64>() / r.per_request.len() as f64;
        assert!((mean - r.quality).abs() < 1e-9, "{n}: quality is the mean of the requests' qualities");
        let reusing: Vec<f64> = r.per_request.iter().filter(|q| q.reused()).map(|q| q.quality).collect();
        match r.reuse_quality {
            Some(q) => assert!((q - reusing.iter().sum::<f64>() / reusing.len() as f64).abs() < 1e-9, "{n}: {r:?}"),
            None => assert!(reusing.is_empty(), "{n}: {r:?}"),
        }
        // A request that reuses nothing computes what recompute computes: every configuration's losses are in
        // its reuse.
        for q in r.per_request.iter().filter(|q| !q.reused()) {
            assert_eq!(q.quality, 1.0, "{n}: a request computed whole differs from recompute: {q:?}");
        }
        assert!(r.ttft_ms_mean > 0.0 && r.ttft_ms_mean <= r.ttft_ms_p99, "{n}: {r:?}");
        let served: f64 = r.hit_rate.iter().sum::<f64>() + r.computed_rate;
        assert!((served - 1.0).abs() < 0.05, "{n}: every prompt token is served once: {r:?}");
        for t in 1..3 {
            assert!(r.peak_used_bytes[t] <= r.capacity_bytes[t], "{n}: tier {t} over capacity: {r:?}");
        }
    }
    let by = |name: &str| report.results.iter().find(|r| r.name == name).expect("configuration ran");
    let recompute = by("recompute");
    assert_eq!(recompute.quality, 1.0, "recompute is the reference");
    assert_eq!(recompute.hit_rate, [0.0; 3], "no reuse without the prefix cache");
    assert_eq!(recompute.reuse_quality, None, "recompute reuses nothing");
    for name in ["lru", "lru+int4_kivi", "evicpress"] {
        let r = by(name);
        assert!(r.hit_rate[1] + r.hit_rate[2] > 0.0, "{name}: prompt tokens come back from host or disk: {r:?}");
        assert!(r.reuse_quality.is_some_and(|q| (0.0..=1.0).contains(&q)), "{name}: {r:?}");
    }
    // Native groups are lossless: LRU answers what recompute answers, up to near-tie argmax flips.
    assert!(by("lru").quality >= 0.9, "{:?}", by("lru"));
    // A smaller codec keeps more contexts below the device: it recomputes no more than native LRU.
    assert!(by("lru+int4_kivi").computed_rate <= by("lru").computed_rate + 1e-9);

    let ep = by("evicpress");
    let stats = ep.evicpress.as_ref().expect("EvicPress reports its state");
    assert!(stats.profiles > 0 && stats.contexts > 0, "{stats:?}");
    // EvicPress chooses among the same codecs as the fixed baselines; the profiler measured each one, with a
    // resolution finer than the 1/4 of a 4-token answer.
    assert_eq!(stats.variants, ["f16", "int4_kivi", "f16@0.5", "int4_kivi@0.5"]);
    let q: Vec<f64> = stats.mean_quality.iter().map(|q| q.expect("every variant profiled")).collect();
    assert_eq!(q[0], 1.0, "lossless");
    assert!((0.5..=1.0).contains(&q[1]), "int4 keeps most answers: {q:?}");
    assert!(q[2..].iter().all(|q| (0.0..=1.0).contains(q)), "{q:?}");
    // Beside token agreement, each variant's embedding similarity to the full-precision answers: measured for
    // every variant agreement was, 1 for the lossless one, and never below its agreement by much (a near miss
    // still shares most of the answer's tokens).
    let sim: Vec<f64> = stats.mean_embedding_similarity.iter().map(|s| s.expect("similarity measured")).collect();
    assert_eq!(sim[0], 1.0, "lossless");
    assert!(sim.iter().all(|s| (0.0..=1.0).contains(s)), "{sim:?}");
    assert!(sim.iter().zip(&q).all(|(s, q)| *s >= q - 0.25), "similarity {sim:?} against agreement {q:?}");
    for t in 0..3 {
        assert!(ep.peak_planned_bytes[t] <= stats.capacity_bytes[t], "planned over capacity: {ep:?}");
    }
    assert_eq!(stats.capacity_bytes[0], 0, "the device pool keeps its own LRU");
    assert!(stats.compressed + stats.moved_down > 0, "the tiers filled up and the planner made room: {stats:?}");
    assert_eq!(stats.pending, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Requests that arrive as a Poisson process (`--arrival-rate`): each is submitted at its arrival whatever is still
/// running and its TTFT counts from that arrival, so a burst queues; each request's prompt tokens are split into
/// computed, device hits and the tier hits onboarded for it, as the engine reports them per request.
#[test]
fn arrivals_queue_and_each_request_reports_where_its_prompt_came_from() {
    let dir = tempfile::Builder::new().prefix("pagoda-bench-zipf-arrivals-").tempdir().expect("temp dir");
    let prose = root().join("data/prose");
    let opts = ZipfBenchOptions {
        threads: 2,
        contexts: 8,
        min_tokens: 256,
        max_tokens: 384,
        requests: 16,
        answer_tokens: 2,
        device_tokens: 0,
        host_mib: 4,
        disk_mib: 16,
        data_dir: Some(dir.path().to_path_buf()),
        codecs: vec!["int4_kivi".into()],
        keep_ratios: vec![],
        baselines: Some(vec!["lru+int4_kivi".into()]),
        prose_dir: prose.is_dir().then_some(prose),
        // Sixteen requests in about a third of a second: every one after the first waits behind others.
        arrival_rate: 50.0,
        ..ZipfBenchOptions::default()
    };
    for bad in [-1.0, f64::NAN, f64::INFINITY, 1e9] {
        let bad = ZipfBenchOptions { arrival_rate: bad, ..opts.clone() };
        assert!(zipf_bench(&model_path(), &bad).is_err(), "{bad:?}");
    }
    let report = zipf_bench(&model_path(), &opts).expect("bench runs");
    println!("{}", report.to_markdown());
    assert!(report.to_markdown().contains("Poisson process of 50 per second"));
    let read_back: ZipfReport = serde_json::from_str(&report.to_json_string()).expect("the report reads back");
    assert_eq!(read_back.options.arrival_rate, 50.0);
    let names: Vec<&str> = report.results.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["recompute", "lru+int4_kivi", "evicpress"]);
    for r in &report.results {
        let n = &r.name;
        assert_eq!((r.requests, r.completed), (16, 16), "{n}: every request completes with its answer");
        for q in &r.per_request {
            let served = q.computed_tokens + q.hit_tokens.iter().sum::<u64>();
            assert_eq!(served, q.prompt_tokens as u64, "{n}: each prompt token computed or served once: {q:?}");
        }
        let served: f64 = r.hit_rate.iter().sum::<f64>() + r.computed_rate;
        assert!((served - 1.0).abs() < 1e-9, "{n}: {r:?}");
    }
    let by = |name: &str| report.results.iter().find(|r| r.name == name).expect("configuration ran");
    let recompute = by("recompute");
    assert_eq!(recompute.hit_rate, [0.0; 3], "no reuse without the prefix cache");
    // Recomputing 16 prompts of 256-384 tokens takes seconds on 2 cores; they all arrived in well under one, so
    // the last to be served waited behind the others, and its TTFT counts that wait.
    let slowest = recompute.per_request.iter().map(|q| q.ttft_ms).fold(0.0, f64::max);
    let fastest = recompute.per_request.iter().map(|q| q.ttft_ms).fold(f64::MAX, f64::min);
    assert!(slowest > 4.0 * fastest && slowest > 1000.0, "queueing is in TTFT: {fastest} .. {slowest} ms");
    for name in ["lru+int4_kivi", "evicpress"] {
        let r = by(name);
        assert!(
            r.per_request.iter().any(|q| q.hit_tokens[1] + q.hit_tokens[2] > 0),
            "{name}: some request's prompt was onboarded from host or disk: {r:?}"
        );
    }
}

/// The paper's offline phase: every context is ingested before the measured requests, so with tiers that hold the
/// whole workload no measured request computes its context, while recompute (which keeps nothing) skips the phase.
/// EvicPress runs with both greedy rules and profiles over two profiling questions besides the request's own.
#[test]
fn offline_phase_runs_with_profiling_questions() {
    let prose = root().join("data/prose");
    // The shared prefill's disk tier, kept between the two runs below.
    // Removed when the test ends, passing or not: the tier holds about 44 MB.
    let seed_tmp = tempfile::Builder::new().prefix("pagoda-bench-zipf-seeds-").tempdir().expect("temp dir");
    let seed_dir = seed_tmp.path().join("seeds");
    let opts = ZipfBenchOptions {
        threads: 2,
        contexts: 6,
        min_tokens: 256,
        max_tokens: 384,
        requests: 10,
        answer_tokens: 2,
        device_tokens: 0,
        // Host alone holds the six contexts' native KV (at most 6 × 384 tokens × 23,040 bytes = 51 MiB).
        host_mib: 64,
        disk_mib: 0,
        data_dir: None,
        seed_dir: Some(seed_dir.clone()),
        codecs: vec!["int8".into()],
        alphas: vec![16.0],
        keep_ratios: vec![],
        prose_dir: prose.is_dir().then_some(prose),
        offline_phase: true,
        // Six int8 profiles: from the fourth on, each is shrunk toward the ones before it.
        shrink: true,
        greedy: vec![GreedyRule::Drop, GreedyRule::DropPerByte],
        profile_questions: 2,
        ..ZipfBenchOptions::default()
    };
    // Bad options are refused before the model loads.
    for bad in [
        ZipfBenchOptions { profile_questions: PROFILE_QUESTIONS.len() + 1, ..opts.clone() },
        ZipfBenchOptions { greedy: vec![], ..opts.clone() },
        ZipfBenchOptions { greedy: vec![GreedyRule::Drop, GreedyRule::Drop], ..opts.clone() },
        ZipfBenchOptions { upgrade: vec![], ..opts.clone() },
        ZipfBenchOptions { upgrade: vec![true, true], ..opts.clone() },
        ZipfBenchOptions { baselines: Some(vec!["lru+int2_kivi".into()]), ..opts.clone() },
        ZipfBenchOptions { kivi_residual_tokens: vec![], ..opts.clone() },
        ZipfBenchOptions { kivi_residual_tokens: vec![MAX_RESIDUAL_TOKENS + 1], ..opts.clone() },
        ZipfBenchOptions { task_share: 1.5, ..opts.clone() },
        ZipfBenchOptions { task_share: f64::NAN, ..opts.clone() },
    ] {
        assert!(zipf_bench(&model_path(), &bad).is_err(), "{bad:?}");
    }
    let report = zipf_bench(&model_path(), &opts).expect("bench runs");
    println!("{}", report.to_markdown());
    assert!(report.to_markdown().contains("Offline phase: every context ingested once"));
    assert!(report.to_markdown().contains("By the request's turn on its context"));
    assert!(report.seed_seconds > 0.0, "the contexts were prefilled once, for every configuration");
    assert_eq!(report.seed_computed, 6);
    assert!(report.to_markdown().contains("after the request's question and 2 profiling questions"));
    let names: Vec<&str> = report.results.iter().map(|r| r.name.as_str()).collect();
    assert!(names.contains(&"evicpress drop") && names.contains(&"evicpress per-byte"), "{names:?}");
    for r in &report.results {
        let n = &r.name;
        assert_eq!(r.completed, 10, "{n}");
        if n == "recompute" {
            assert_eq!(r.offline_seconds, 0.0, "recompute keeps nothing, so it skips the phase");
            assert!(r.per_request.iter().all(|q| q.computed_tokens as usize >= q.prompt_tokens - 1), "{r:?}");
            continue;
        }
        assert!(r.offline_seconds > 0.0 && r.offline_seconds < r.seconds, "{n}: {r:?}");
        // Each configuration computes its first four contexts (its cost model measures prefill speed); the last
        // two come whole from the shared prefill, and only their questions and answers are computed.
        assert_eq!(r.offline_seeded, 2, "{n}: {r:?}");
        assert!(r.offline_computed_tokens < 4 * (384 + 64) + 2 * 64, "{n}: {r:?}");
        if let Some(e) = &r.evicpress {
            assert!(e.profiles >= 4, "{n}: every context profiled while the engine was idle: {e:?}");
            let shrinkable = 1..=e.profiles - 3;
            assert!(shrinkable.contains(&e.shrunk_profiles), "{n}: shrunk from the fourth profile on: {e:?}");
            assert!(e.shrink_total.is_finite() && e.shrink_total >= 0.0, "{n}: {e:?}");
        }
        for q in &r.per_request {
            // At most the question and the context's last partial block are computed: never the context.
            assert!(q.computed_tokens < 64, "{n}: context {} was computed in the measured run: {q:?}", q.context);
        }
    }
    // A second run on the same seed dir computes no context for the shared prefill: every configuration's
    // offline phase is written from what the first run kept. It runs no baseline but recompute, and EvicPress
    // with upgrades (the host holds every context whole here, so there is nothing to recompute for).
    let rerun =
        ZipfBenchOptions { greedy: vec![GreedyRule::Drop], upgrade: vec![true], baselines: Some(vec![]), ..opts };
    let again = zipf_bench(&model_path(), &rerun).expect("reruns");
    assert_eq!(again.seed_computed, 0, "every context kept from the first run");
    let names: Vec<&str> = again.results.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["recompute", "evicpress upgrade"]);
    let e = again.results[1].evicpress.as_ref().expect("EvicPress stats");
    assert_eq!((e.upgrades, e.dropped), (0, 0), "{e:?}");
    for r in again.results.iter().filter(|r| r.name != "recompute") {
        assert_eq!(r.completed, 10, "{}", r.name);
        assert_eq!(r.offline_seeded, 2, "{}: {r:?}", r.name);
    }
}

/// The task mix: the first `task_share` of the contexts are synthetic task items, the families in turn, each
/// asked its own question (so its requests' prompts differ from the prose contexts' six questions); the report
/// names each context's kind and splits quality and TTFT by it.
#[test]
fn a_task_mix_asks_each_task_item_its_own_question() {
    let prose = root().join("data/prose");
    let opts = ZipfBenchOptions {
        threads: 2,
        contexts: 5,
        min_tokens: 256,
        max_tokens: 384,
        requests: 12,
        answer_tokens: 2,
        device_tokens: 0,
        host_mib: 64,
        disk_mib: 0,
        codecs: vec!["int4_kivi".into()],
        keep_ratios: vec![],
        prose_dir: prose.is_dir().then_some(prose),
        baselines: Some(vec!["lru+int4_kivi".into()]),
        task_share: 0.6,
        profile_questions: 2,
        ..ZipfBenchOptions::default()
    };
    let report = zipf_bench(&model_path(), &opts).expect("bench runs");
    let md = report.to_markdown();
    println!("{md}");
    assert_eq!(report.context_kinds, ["passkey", "multikey_niah", "kv_retrieval", "prose", "prose"]);
    assert!(report.source.starts_with("3 task items"), "{}", report.source);
    assert!(md.contains("By what the context is"), "{md}");
    // A task question is longer than a prose one: the requests are classified with room for it and one group.
    assert!((33..=72 + 16).contains(&report.question_slack_tokens), "{}", report.question_slack_tokens);
    let recompute = &report.results[0];
    assert_eq!(recompute.completed, 12);
    // A context's requests all carry its one question, so all its prompts have one length; a prose context's
    // six questions differ in length.
    for context in 0..3 {
        let lens: Vec<usize> =
            recompute.per_request.iter().filter(|q| q.context == context).map(|q| q.prompt_tokens).collect();
        assert!(lens.windows(2).all(|w| w[0] == w[1]), "task context {context}: {lens:?}");
        // Group-aligned context plus the question: the question (and the cut tokens) is under 80 tokens.
        assert!(lens.iter().all(|&n| (200..=384 + 80).contains(&n)), "task context {context}: {lens:?}");
    }
    let int4 = &report.results[1];
    assert_eq!(int4.name, "lru+int4_kivi");
    assert!(int4.per_request.iter().filter(|q| q.context < 3).any(|q| q.reused()), "task contexts are reused");
    // Every context's requests give it its training queries, and EvicPress profiles on them.
    let ep = report.results[2].evicpress.as_ref().expect("evicpress ran");
    assert!(ep.profiles > 0, "{ep:?}");
    assert_eq!(ep.profiles_on_own_queries, ep.profiles, "{ep:?}");
    assert!(md.contains("on the contexts' own training queries"), "{md}");
    let read_back: ZipfReport = serde_json::from_str(&report.to_json_string()).expect("the report reads back");
    assert_eq!(read_back.to_markdown(), md);
}
