//! `pagoda bench eviction` at CI size on the REAL model: a pool for 2 full-cache sequences of 128 + 32 tokens,
//! 8 requests at once, full cache against two evicting policies at a 64-token budget. Checks what the benchmark
//! exists to show, not just that it runs: every request generates exactly its tokens, the pool is never
//! overrun, evicting policies free blocks and so run a larger batch than full cache can.

use std::path::PathBuf;

use pagoda_worker::bench_eviction::{EvictionBenchOptions, eviction_bench};
use pagoda_worker::policy::PolicyKind;

fn model_path() -> PathBuf {
    let p = std::env::var_os("PAGODA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(p.exists(), "model not found at {} (run scripts/fetch-model or set PAGODA_MODEL)", p.display());
    p
}

#[test]
fn evicting_policies_run_larger_batches_on_the_same_pool() {
    let opts = EvictionBenchOptions {
        threads: 2,
        requests: 8,
        prompt_tokens: 128,
        new_tokens: 32,
        pool_seqs: 2,
        policies: vec![PolicyKind::Full, PolicyKind::PagedEviction, PolicyKind::KvCompress],
        budgets: vec![64],
        ..EvictionBenchOptions::default()
    };
    let report = eviction_bench(model_path(), &opts).expect("bench runs");
    println!("{}", report.to_markdown());

    // 2 sequences × ceil(160 / 16) groups × 90 blocks.
    assert_eq!(report.kv_blocks, 2 * 10 * 90);
    assert_eq!(report.results.len(), 3);
    let full = report.full().expect("full cache ran");
    for r in &report.results {
        let label = r.label();
        assert_eq!((r.requests, r.completed, r.short_requests), (8, 8, 0), "{label}");
        assert_eq!(r.generated_tokens, 8 * 32, "{label}: exactly new_tokens per request");
        assert!(r.tokens_per_s > 0.0 && r.seconds > 0.0, "{label}");
        assert_eq!(r.tokens_per_s_runs, vec![r.tokens_per_s], "{label}: one repeat");
        // Every prompt token and every generated token but the last is computed, plus any recompute.
        assert!(r.computed_tokens >= 8 * (128 + 31), "{label}: computed {}", r.computed_tokens);
        assert_eq!(r.preemptions == 0, r.computed_tokens == 8 * (128 + 31), "{label}: {r:?}");
        assert_eq!(r.blocks_total, report.kv_blocks as u64, "{label}");
        assert!(r.peak_blocks_used <= r.blocks_total, "{label}: pool overrun {r:?}");
        assert!(r.peak_blocks_used > 0 && r.peak_running >= 1, "{label}");
        // A generated token comes out of a step that computed its sequence, so the steps' sequences cover them.
        assert!(r.steps > 0 && (1.0..=r.peak_running as f64).contains(&r.mean_batch), "{label}: {r:?}");
        assert!(r.mean_batch * r.steps as f64 + 0.5 >= r.generated_tokens as f64, "{label}: {r:?}");
        assert!(r.ttft_ms_p50 > 0.0 && r.ttft_ms_p50 <= r.ttft_ms_p99, "{label}");
        assert!(r.tpot_ms_p50 > 0.0 && r.tpot_ms_p50 <= r.tpot_ms_p99, "{label}");
        assert!(r.tokens_per_s_vs_full.is_some() && r.concurrency_vs_full.is_some(), "{label}");
        if r.budget_tokens.is_none() {
            assert_eq!(r.evicted_blocks, 0);
            continue;
        }
        assert!(r.evicted_blocks > 0, "{label} evicted nothing");
        assert!(
            r.peak_running > full.peak_running,
            "{label}: largest batch {} is not above full cache's {}",
            r.peak_running,
            full.peak_running
        );
        assert!(
            r.mean_batch > full.mean_batch,
            "{label}: mean batch {} against full's {}",
            r.mean_batch,
            full.mean_batch
        );
    }
    assert!(full.peak_running <= 4, "full cache cannot run many 128-token prompts on a 2-sequence pool");
}
