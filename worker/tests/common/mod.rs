//! Helpers shared by the engine tests (`mod common;` in each); each test crate uses a part of them.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use pagoda_worker::engine::{EngineHandle, EngineStats, GenerateEvent, GenerateRequest, SamplingParams};

/// The real model's KV block group: 90 blocks (30 layers × 3 kv heads).
pub const GROUP: usize = 90;
/// Tokens per block (and per group).
pub const BS: usize = 16;

/// The real model (SmolLM2-135M-Instruct Q4_1): `$PAGODA_MODEL`, else the one `scripts/fetch-model.sh` fetches.
pub fn model_path() -> PathBuf {
    let p = std::env::var_os("PAGODA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(p.exists(), "model not found at {} (run scripts/fetch-model or set PAGODA_MODEL)", p.display());
    p
}

/// The engine's stats once `done` holds, polled for at most a minute.
pub fn wait_stats(h: &EngineHandle, what: &str, done: impl Fn(&EngineStats) -> bool) -> EngineStats {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = h.stats();
        if done(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {s:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A greedy request (temperature 0, no stop tokens) of `max_tokens` tokens.
pub fn greedy_request(id: &str, prompt: &[u32], max_tokens: u32, ignore_eos: bool) -> GenerateRequest {
    GenerateRequest {
        request_id: id.into(),
        prompt: prompt.to_vec(),
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        namespace: String::new(),
        policy: None,
        ignore_eos,
        profile_queries: Vec::new(),
        logprobs: None,
        prompt_logprobs: None,
        priority: 0,
        tenant_weight: 1,
        tier_codec: None,
        lora: None,
    }
}

/// A greedy request that always generates `max_tokens` tokens.
pub fn greedy(prompt: &[u32], max_tokens: u32) -> GenerateRequest {
    greedy_request("r", prompt, max_tokens, true)
}

/// Runs one request to the end and waits for the engine to go idle. Returns the tokens and the stats delta
/// (computed tokens, prefix hits per tier).
pub fn run(h: &EngineHandle, prompt: &[u32], max_tokens: u32) -> (Vec<u32>, u32, EngineStats) {
    run_request(h, greedy(prompt, max_tokens))
}

/// [`run`] for any request.
pub fn run_request(h: &EngineHandle, req: GenerateRequest) -> (Vec<u32>, u32, EngineStats) {
    let before = h.stats();
    let mut rx = h.submit(req).unwrap();
    let mut tokens = Vec::new();
    let cached = loop {
        match rx.blocking_recv() {
            Some(GenerateEvent::Token { id: t, .. }) => tokens.push(t),
            Some(GenerateEvent::Finished { cached_tokens, .. }) => break cached_tokens,
            other => panic!("unexpected event {other:?}"),
        }
    };
    let after = wait_stats(h, "the engine to go idle", |s| {
        s.running == 0 && s.waiting == 0 && s.computed_tokens_total > before.computed_tokens_total
    });
    let mut delta = after.clone();
    delta.computed_tokens_total -= before.computed_tokens_total;
    for t in 0..3 {
        delta.prefix_hit_tokens[t] = delta.prefix_hit_tokens[t].wrapping_sub(before.prefix_hit_tokens[t]);
    }
    (tokens, cached, delta)
}
