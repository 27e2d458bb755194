//! Runs the engine bench on the real model. Ignored by default (minutes on a small machine):
//! `cargo test -p pagoda-worker --test engine_bench -- --ignored --nocapture`.
//! `PAGODA_BENCH_QUICK=1` shrinks it (128-token prompts, 16 new tokens) for a smoke run.

use std::path::PathBuf;

use pagoda_worker::bench::{BenchOptions, engine_bench};

#[test]
#[ignore = "benchmark: run explicitly"]
fn engine_bench_real_model() {
    let path = std::env::var_os("PAGODA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let mut opts = BenchOptions::default();
    if let Some(t) = std::env::var("PAGODA_BENCH_THREADS").ok().and_then(|t| t.parse().ok()) {
        opts.threads = t;
    }
    if std::env::var_os("PAGODA_BENCH_QUICK").is_some() {
        opts.prefill_tokens = 128;
        opts.decode_prompt_tokens = 128;
        opts.decode_new_tokens = 16;
        opts.concurrency = vec![1, 4];
    }
    let report = engine_bench(&path, &opts).expect("bench runs");
    println!("{}", report.to_markdown());
    println!("{}", report.to_json_string());
    assert!(report.prefill.tokens_per_s > 0.0);
    assert_eq!(report.decode.len(), opts.concurrency.len());
    for d in &report.decode {
        assert_eq!(d.decode_tokens, d.concurrency * (d.new_tokens - 1));
        assert!(d.tokens_per_s > 0.0);
    }
}
