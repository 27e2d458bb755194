//! The engine with the REAL model (SmolLM2-135M-Instruct Q4_1): prefix caching, concurrent batching,
//! preemption under a tiny pool, cancellation by dropping the receiver, and seeded sampling.

mod common;

use common::{GROUP, model_path, wait_stats};

use pagoda_worker::engine::{
    Engine, EngineConfig, EngineHandle, FinishReason, GenerateEvent, GenerateRequest, SamplingParams,
};
use pagoda_worker::model::{ChatMessage, ChatTemplate, Gguf, Tokenizer};
use pagoda_worker::sampling::TokenLogprobs;
use pagoda_worker::scheduler::{ReserveConfig, SchedulingPolicy};
use pagoda_worker::speculative::NgramConfig;
use tokio::sync::mpsc::UnboundedReceiver;

fn engine(num_groups: usize, prefix_cache: bool) -> EngineHandle {
    engine_admitting(num_groups, prefix_cache, ReserveConfig::default())
}

fn engine_admitting(num_groups: usize, prefix_cache: bool, reserve: ReserveConfig) -> EngineHandle {
    Engine::start(config(num_groups, prefix_cache, reserve)).expect("engine starts")
}

fn config(num_groups: usize, prefix_cache: bool, reserve: ReserveConfig) -> EngineConfig {
    EngineConfig {
        num_blocks: num_groups * GROUP,
        enable_prefix_cache: prefix_cache,
        threads: 2,
        reserve,
        ..EngineConfig::new(model_path())
    }
}

fn tokenize(texts: &[&str]) -> Vec<Vec<u32>> {
    let g = Gguf::open(model_path()).expect("gguf");
    let t = Tokenizer::from_gguf(&g).expect("tokenizer");
    texts.iter().map(|s| t.encode(s, false)).collect()
}

/// A chat prompt (rendered with the model's template, generation prompt added), tokenized.
fn chat(user: &str) -> Vec<u32> {
    let g = Gguf::open(model_path()).expect("gguf");
    let t = Tokenizer::from_gguf(&g).expect("tokenizer");
    let tpl = ChatTemplate::from_gguf(&g).expect("chat template");
    let text = tpl.render(&[ChatMessage { role: "user".into(), content: user.into() }], true).expect("render");
    t.encode(&text, false)
}

fn greedy(id: &str, prompt: &[u32], max_tokens: u32) -> GenerateRequest {
    common::greedy_request(id, prompt, max_tokens, false)
}

struct Done {
    tokens: Vec<u32>,
    /// Tokens sampled, including a stop token that ended the stream (not streamed).
    sampled: usize,
    reason: FinishReason,
    completion: u32,
    cached: u32,
    /// Slots the request's policy evicted and the blocks that freed.
    evicted: (u64, u64),
    /// Seconds from arrival to its first step.
    queue_seconds: f64,
}

fn collect(mut rx: UnboundedReceiver<GenerateEvent>) -> Done {
    let mut tokens = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            GenerateEvent::Token { id: t, .. } => tokens.push(t),
            GenerateEvent::PromptLogprobs(_) => panic!("no prompt log-probabilities were asked for"),
            GenerateEvent::Finished {
                reason,
                completion_tokens,
                cached_tokens,
                evicted_slots,
                evicted_blocks,
                queue_seconds,
                ..
            } => {
                let sampled = tokens.len() + usize::from(reason == FinishReason::Stop);
                let evicted = (evicted_slots, evicted_blocks);
                let (completion, cached) = (completion_tokens, cached_tokens);
                return Done { tokens, sampled, reason, completion, cached, evicted, queue_seconds };
            }
            GenerateEvent::Failed(e) | GenerateEvent::Refused(e) => panic!("request failed: {e}"),
        }
    }
    panic!("stream ended without Finished");
}

const DOC: &str = "The library on the hill keeps three kinds of books: maps of rivers that no longer flow, \
    recipes written by sailors, and letters that were never sent. Every morning the librarian opens the \
    windows, counts the books, and writes the number on a slate by the door.";

#[test]
fn prefix_cache_hit_skips_matched_tokens_with_identical_output() {
    let h = engine(64, true);
    let p = &tokenize(&[&format!("{DOC} Question: what does the librarian count?")])[0];
    assert!(p.len() > 40, "prompt long enough to span several blocks: {}", p.len());
    let first = collect(h.submit(greedy("a", p, 12)).unwrap());
    // Stats are published after the step that sent Finished: wait for that snapshot.
    let s1 = wait_stats(&h, "idle", |s| s.running == 0 && s.waiting == 0);
    assert_eq!(first.cached, 0);
    assert_eq!(s1.computed_tokens_total, (p.len() + first.sampled - 1) as u64);

    let second = collect(h.submit(greedy("b", p, 12)).unwrap());
    let s2 =
        wait_stats(&h, "idle", |s| s.running == 0 && s.waiting == 0 && s.cached_tokens_total > s1.cached_tokens_total);
    let matched = (p.len() - 1) / 16 * 16;
    assert_eq!(second.cached as usize, matched);
    assert_eq!(s2.cached_tokens_total - s1.cached_tokens_total, matched as u64);
    assert_eq!(
        s2.computed_tokens_total - s1.computed_tokens_total,
        (p.len() - matched + second.sampled - 1) as u64,
        "computed tokens drop by the matched count"
    );
    assert_eq!(first.tokens, second.tokens, "cached KV gives the same greedy output");

    // A different namespace shares nothing.
    let mut r = greedy("c", p, 4);
    r.namespace = "tenant-2".into();
    assert_eq!(collect(h.submit(r).unwrap()).cached, 0);
}

#[test]
fn eight_concurrent_requests_match_solo_runs() {
    concurrent_matches_solo(engine(256, false));
}

/// The same with the matmuls in bf16 (`--bf16-matmuls`, on AMX tiles or AVX-512 BF16 dot products): every call, a
/// lone decode token or a batched prefill, runs the same bf16 arithmetic per row, so batching still changes nothing.
#[test]
fn eight_concurrent_requests_match_solo_runs_on_bf16_matmuls() {
    if !pagoda_kernels::cpu::bf16_matmuls_available() {
        eprintln!("skipped: neither AMX bf16 tiles nor AVX-512 BF16 on this CPU");
        return;
    }
    let cfg = EngineConfig { bf16_matmuls: true, ..config(256, false, ReserveConfig::default()) };
    concurrent_matches_solo(Engine::start(cfg).expect("engine starts"));
}

fn concurrent_matches_solo(h: EngineHandle) {
    let texts: Vec<String> = (0..8).map(|i| format!("Story {i}: once upon a time, a fox number {i} found")).collect();
    let prompts = tokenize(&texts.iter().map(String::as_str).collect::<Vec<_>>());
    let solo: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| collect(h.submit(greedy(&i.to_string(), p, 10)).unwrap()).tokens)
        .collect();
    let rxs: Vec<_> =
        prompts.iter().enumerate().map(|(i, p)| h.submit(greedy(&format!("c{i}"), p, 10)).unwrap()).collect();
    let together: Vec<Done> = rxs.into_iter().map(collect).collect();
    for (i, d) in together.iter().enumerate() {
        assert_eq!(d.reason, FinishReason::Length);
        assert_eq!(d.completion, 10);
        assert_eq!(d.tokens, solo[i], "request {i}");
    }
}

/// Four chat prompts of about 40 tokens whose greedy answers run long.
fn long_answer_prompts() -> Vec<Vec<u32>> {
    [
        "Count from 1 to 60, separated by commas.",
        "List the names of twenty animals, one per line.",
        "Write a long poem about the sea.",
        "Explain in detail how a bicycle works.",
    ]
    .iter()
    .map(|u| chat(u))
    .collect()
}

fn tiny_pool_run(prefix_cache: bool) {
    let prompts = long_answer_prompts();
    let new = 40u32;
    // Unpressured reference.
    let big = engine(128, false);
    let want: Vec<Vec<u32>> =
        prompts.iter().map(|p| collect(big.submit(greedy("r", p, new)).unwrap()).tokens).collect();
    drop(big);
    // Each request needs ~5 groups (≈40 prompt + 40 new tokens); 4 running need ~20; the pool has 7.
    // Greedy admission, so that the tiny pool really preempts (the default reserve would avoid it).
    let h = engine_admitting(7, prefix_cache, ReserveConfig::off());
    let rxs: Vec<_> = prompts.iter().map(|p| h.submit(greedy("t", p, new)).unwrap()).collect();
    let got: Vec<Done> = rxs.into_iter().map(collect).collect();
    let mut minimal = 0u64;
    for (i, d) in got.iter().enumerate() {
        assert_eq!(d.tokens, want[i], "request {i}");
        minimal += (prompts[i].len() + d.sampled - 1) as u64;
    }
    let s = wait_stats(&h, "idle", |s| s.running == 0 && s.waiting == 0);
    if prefix_cache {
        // Resumed sequences re-adopt their own cached groups when nothing evicted them.
        assert!(s.cached_tokens_total > 0 || s.computed_tokens_total > minimal, "{s:?}");
    } else {
        assert!(
            s.computed_tokens_total > minimal,
            "recompute after preemption: {} vs {minimal}",
            s.computed_tokens_total
        );
    }
    assert_eq!(s.blocks_used, 0);
    // A request that can never fit is refused at submit.
    assert!(h.submit(greedy("huge", &prompts[0], 200)).is_err());
}

/// A request's events to the end: its prompt scores, its tokens with their log-probabilities, and the cached
/// tokens it reported.
type Collected = (Vec<TokenLogprobs>, Vec<(u32, Option<TokenLogprobs>)>, u32);

fn collect_events(mut rx: UnboundedReceiver<GenerateEvent>) -> Collected {
    let (mut scored, mut generated) = (Vec::new(), Vec::new());
    loop {
        match rx.blocking_recv() {
            Some(GenerateEvent::PromptLogprobs(e)) => {
                assert!(generated.is_empty(), "prompt log-probabilities come first");
                scored.extend(e);
            }
            Some(GenerateEvent::Token { id, logprobs }) => generated.push((id, logprobs)),
            Some(GenerateEvent::Finished { cached_tokens, .. }) => return (scored, generated, cached_tokens),
            other => panic!("unexpected event {other:?}"),
        }
    }
}

/// A request's prompt scores and tokens, to the end.
fn collect_scored(rx: UnboundedReceiver<GenerateEvent>) -> (Vec<TokenLogprobs>, Vec<u32>) {
    let (scored, generated, _) = collect_events(rx);
    (scored, generated.into_iter().map(|(id, _)| id).collect())
}

/// Scoring requests preempted in a tiny pool compute their prompts again on resuming: each position is still
/// reported once, with what an unpressured run reports, and the tokens are the same.
#[test]
fn prompt_logprobs_survive_preemption() {
    let prompts = long_answer_prompts();
    let scoring = |p: &[u32]| GenerateRequest { prompt_logprobs: Some(1), ..greedy("s", p, 40) };
    let big = engine(128, false);
    let want: Vec<_> = prompts.iter().map(|p| collect_scored(big.submit(scoring(p)).unwrap())).collect();
    drop(big);
    let h = engine_admitting(7, true, ReserveConfig::off());
    let rxs: Vec<_> = prompts.iter().map(|p| h.submit(scoring(p)).unwrap()).collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        let (scored, tokens) = collect_scored(rx);
        assert_eq!(tokens, want[i].1, "request {i}");
        assert_eq!(scored.len(), prompts[i].len() - 1, "request {i}: every position once");
        for (q, (a, b)) in scored.iter().zip(&want[i].0).enumerate() {
            assert!((a.logprob - b.logprob).abs() < 1e-3 && a.top[0].0 == b.top[0].0, "request {i}, {q}: {a:?} {b:?}");
        }
    }
    let s = wait_stats(&h, "idle", |s| s.running == 0 && s.waiting == 0);
    assert!(s.preemptions_total > 0, "the pool should have preempted: {s:?}");
}

#[test]
fn tiny_pool_preempts_and_outputs_match_unpressured_run() {
    tiny_pool_run(false);
}

#[test]
fn tiny_pool_with_prefix_cache_resumes_from_cached_blocks() {
    tiny_pool_run(true);
}

#[test]
fn dropping_the_receiver_frees_blocks() {
    let h = engine(64, true);
    let base = h.stats();
    assert_eq!(base.blocks_used, 0);
    assert_eq!(base.prefill_tokens_per_s, 0.0, "nothing measured yet");
    let p = &tokenize(&[DOC])[0];
    let mut rx = h.submit(greedy("gone", p, 500)).unwrap();
    // Wait for a couple of tokens, then walk away.
    for _ in 0..2 {
        assert!(matches!(rx.blocking_recv(), Some(GenerateEvent::Token { .. })));
    }
    // An engine without lower tiers measures its prefill speed itself (with them, the tiers' cost model does).
    let s = h.stats();
    assert!(s.blocks_used > 0 && s.prefill_tokens_per_s > 0.0, "{s:?}");
    drop(rx);
    let s = wait_stats(&h, "blocks back to baseline", |s| s.running == 0 && s.blocks_used == base.blocks_used);
    assert_eq!(s.waiting, 0);
    // The cancelled request's full groups stay cached (reusable), not used.
    assert!(s.blocks_cached_free > 0);
    assert!(s.blocks_used + s.blocks_cached_free <= s.blocks_total);
}

#[test]
fn seeded_sampling_is_deterministic() {
    let h = engine(64, true);
    let p = &chat("Tell me a short story about a lighthouse keeper and a storm.");
    let run = |seed: u64| {
        let mut r = greedy("s", p, 16);
        r.sampling =
            SamplingParams { temperature: 0.9, top_p: 0.95, top_k: 50, seed: Some(seed), ..SamplingParams::greedy() };
        collect(h.submit(r).unwrap()).tokens
    };
    let a = run(7);
    let b = run(7);
    assert_eq!(a, b);
    assert!(!a.is_empty());
    let others: Vec<Vec<u32>> = (8..11).map(run).collect();
    assert!(others.iter().any(|o| *o != a), "different seeds should (almost surely) differ");
}

/// Each token's log-probabilities: a greedy token is the most likely one, asking for them does not change what is
/// generated (the runner's argmax path against the sampler's), and they are the model's own distribution, not
/// the sampling settings' (the first position's alternatives are the same at temperature 0 and 1.5).
#[test]
fn logprobs_report_the_models_distribution() {
    let h = engine(64, true);
    let p = &chat("Name three colours of the rainbow.");
    let run = |r: GenerateRequest| {
        let mut rx = h.submit(r).unwrap();
        let mut out = Vec::new();
        loop {
            match rx.blocking_recv() {
                Some(GenerateEvent::Token { id, logprobs }) => out.push((id, logprobs)),
                Some(GenerateEvent::Finished { .. }) => return out,
                other => panic!("unexpected event {other:?}"),
            }
        }
    };
    let plain = run(greedy("g", p, 12));
    assert!(plain.iter().all(|(_, lp)| lp.is_none()));
    let with = run(GenerateRequest { logprobs: Some(5), ..greedy("l", p, 12) });
    let ids = |v: &[(u32, Option<TokenLogprobs>)]| v.iter().map(|e| e.0).collect::<Vec<_>>();
    assert_eq!(ids(&with), ids(&plain));
    for (id, lp) in &with {
        let lp = lp.as_ref().expect("logprobs asked for");
        assert_eq!(lp.top.len(), 5);
        assert_eq!(lp.top[0], (*id, lp.logprob), "greedy takes the most likely token");
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        let mass: f32 = lp.top.iter().map(|e| e.1.exp()).sum();
        assert!(mass <= 1.0 + 1e-4 && lp.logprob < 0.0 && lp.logprob > -20.0, "{lp:?}");
    }
    let mut hot = GenerateRequest { logprobs: Some(3), ..greedy("t", p, 12) };
    hot.sampling = SamplingParams { temperature: 1.5, seed: Some(3), ..SamplingParams::greedy() };
    let sampled = run(hot);
    for (id, lp) in &sampled {
        let lp = lp.as_ref().expect("logprobs asked for");
        assert!(lp.logprob <= 0.0 && lp.logprob >= pagoda_worker::sampling::LOGPROB_FLOOR);
        if let Some(&(_, v)) = lp.top.iter().find(|e| e.0 == *id) {
            assert_eq!(v, lp.logprob);
        } else {
            assert!(lp.logprob <= lp.top[2].1, "a token outside the top 3 is less likely than all of them");
        }
    }
    let (first_greedy, first_hot) = (with[0].1.as_ref().unwrap(), sampled[0].1.as_ref().unwrap());
    for (a, b) in first_greedy.top.iter().zip(&first_hot.top) {
        assert_eq!(a.0, b.0);
        assert!((a.1 - b.1).abs() < 1e-3, "{a:?} {b:?}");
    }
    let err = h.submit(GenerateRequest { logprobs: Some(21), ..greedy("x", p, 2) }).unwrap_err();
    assert!(err.to_string().contains("top_logprobs"), "{err}");
}

/// Scoring a text: each prompt position's log-probability is what generation gives the same token at the same
/// position, over a prompt longer than a step's prompt-logits share (so in several chunks), and again in full
/// when the whole prompt is already in the prefix cache.
#[test]
fn prompt_logprobs_score_a_text_as_generation_does() {
    let h = engine(64, true);
    let mut prompt = chat(&format!("{} Summarise that in one line.", [DOC; 5].join(" ")));
    assert!(prompt.len() > 2 * pagoda_worker::scheduler::PROMPT_LOGITS_STEP_TOKENS, "{}", prompt.len());
    let generate = |r: GenerateRequest| collect_events(h.submit(r).unwrap());
    let (none, generated, _) = generate(GenerateRequest { logprobs: Some(2), ..greedy("g", &prompt, 10) });
    assert!(none.is_empty());
    let text_len = prompt.len();
    prompt.extend(generated.iter().map(|g| g.0));
    let score = |id: &str| {
        let r = GenerateRequest { prompt_logprobs: Some(2), ..greedy(id, &prompt, 1) };
        let (scored, _, cached) = generate(r);
        assert_eq!(cached, 0, "the prompt is computed, not adopted from the cache");
        scored
    };
    assert!(generate(greedy("c", &prompt, 1)).2 > 0, "a plain request adopts the cached prompt");
    // Computed in full, not adopted from the cache (which holds all but its last token after `generate`).
    let scored = score("s1");
    assert_eq!(scored.len(), prompt.len() - 1, "every position after the first");
    for (q, e) in scored.iter().enumerate().map(|(i, e)| (i + 1, e)) {
        assert_eq!(e.top.len(), 2);
        assert!(e.logprob <= e.top[0].1 && e.top[0].1 >= e.top[1].1, "{q}: {e:?}");
        assert!(e.top.iter().all(|&(t, l)| t != prompt[q] || l == e.logprob), "{q}: {e:?}");
    }
    // The generated part, scored: the greedy tokens were the most likely, with the logprobs decoding gave them.
    for (k, (id, g)) in generated.iter().enumerate() {
        let g = g.as_ref().expect("logprobs asked for");
        let e = &scored[text_len + k - 1];
        assert_eq!(e.top[0].0, *id, "position {}", text_len + k);
        assert!(
            (e.logprob - g.logprob).abs() < 1e-3,
            "position {}: {} scored, {} generated",
            text_len + k,
            e.logprob,
            g.logprob
        );
    }
    // Scored again with the whole prompt cached: the same entries.
    let again = score("s2");
    assert_eq!(again.len(), scored.len());
    for (a, b) in again.iter().zip(&scored) {
        assert!((a.logprob - b.logprob).abs() < 1e-3 && a.top[0].0 == b.top[0].0, "{a:?} {b:?}");
    }
    let err = h.submit(GenerateRequest { prompt_logprobs: Some(21), ..greedy("x", &prompt, 1) }).unwrap_err();
    assert!(err.to_string().contains("top_logprobs"), "{err}");
}

/// Every eviction policy through the real engine: with a budget above the sequence length it changes nothing
/// (same greedy tokens as the full cache); with a tight budget it evicts, returns blocks to the pool, and the
/// request still completes.
#[test]
fn every_policy_evicts_frees_blocks_and_matches_full_cache_when_the_budget_fits() {
    use pagoda_worker::policy::{PolicyKind, PolicySpec};
    let h = engine(128, false);
    let long = format!("{DOC} {DOC} {DOC} {DOC} {DOC} Question: what does the librarian write on the slate?");
    let p = chat(&long);
    assert!(p.len() > 200, "prompt long enough to evict from: {}", p.len());
    let new = 24u32;
    let full = collect(h.submit(greedy("full", &p, new)).unwrap()).tokens;
    for kind in PolicyKind::ALL.into_iter().filter(|k| *k != PolicyKind::Full) {
        let before = h.stats();
        let mut roomy = greedy(kind.name(), &p, new);
        roomy.policy = Some(PolicySpec { kind, budget_tokens: 1024 });
        let got = collect(h.submit(roomy).unwrap());
        assert_eq!(got.tokens, full, "{}: a budget larger than the sequence keeps the full-cache output", kind.name());
        assert_eq!(got.evicted, (0, 0), "{}", kind.name());
        let s = wait_stats(&h, "idle", |s| s.running == 0 && s.waiting == 0);
        assert_eq!(s.evicted_slots[kind.index()], before.evicted_slots[kind.index()], "{}", kind.name());

        let mut tight = greedy(kind.name(), &p, new);
        tight.policy = Some(PolicySpec { kind, budget_tokens: 64 });
        let got = collect(h.submit(tight).unwrap());
        // A tight budget may change the answer (even end it early), never break it.
        assert!(
            got.completion >= 1 && (got.reason == FinishReason::Length) == (got.completion == new),
            "{}",
            kind.name()
        );
        let s = wait_stats(&h, "idle", |s| s.running == 0 && s.waiting == 0);
        let k = kind.index();
        assert!(s.evicted_slots[k] > before.evicted_slots[k], "{} evicted nothing: {s:?}", kind.name());
        assert!(s.evicted_blocks[k] > before.evicted_blocks[k], "{} freed no block: {s:?}", kind.name());
        // The only request running: its own eviction totals are the engine's increase.
        let delta = (s.evicted_slots[k] - before.evicted_slots[k], s.evicted_blocks[k] - before.evicted_blocks[k]);
        assert_eq!(got.evicted, delta, "{}: per-request eviction totals", kind.name());
        assert_eq!(s.blocks_used, 0, "{}: every block back in the pool", kind.name());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_sized_in_tokens_holds_that_many_tokens_in_every_layer_and_head() {
    // 1000 tokens round up to 63 groups of 16.
    let cfg = EngineConfig { kv_cache_tokens: 1000, num_blocks: 5, threads: 1, ..EngineConfig::new(model_path()) };
    let engine = Engine::start(cfg).expect("engine starts");
    assert_eq!(engine.model_info().num_blocks, 63 * GROUP, "kv_cache_tokens wins over num_blocks");
    engine.shutdown();
}

/// The CPU runner, saying its forward does not sum attention (as the GPU runner's does not): H2O and
/// KV-Compress then capture every query of a step and score them against the keys themselves.
struct SumlessRunner(pagoda_worker::engine::LlamaRunner);

impl pagoda_worker::engine::ModelRunner for SumlessRunner {
    fn info(&self) -> &pagoda_worker::engine::ModelInfo {
        self.0.info()
    }
    fn forward(
        &mut self,
        seqs: &[pagoda_worker::engine::StepSeq<'_>],
        logits: &mut Vec<f32>,
    ) -> Result<(), pagoda_worker::engine::EngineError> {
        assert!(seqs.iter().all(|s| s.attention_sums.is_none()), "no sums asked of a forward that does not sum");
        self.0.forward(seqs, logits)
    }
    fn policy_io(&mut self) -> Option<pagoda_worker::engine::PolicyIo<'_>> {
        self.0.policy_io()
    }
    fn sums_attention(&self) -> bool {
        false
    }
}

/// H2O and KV-Compress through an engine whose forward does not sum attention score the step's captured queries
/// instead (`PolicyKv::window_attention_scores`), the path the GPU runner takes: the same metric, so the same
/// evictions and the same answer as the engine that takes the kernel's sums.
#[test]
fn attention_policies_score_captured_queries_where_the_forward_does_not_sum() {
    use pagoda_worker::engine::LlamaRunner;
    use pagoda_worker::policy::{PolicyKind, PolicySpec};
    let cfg = config(128, false, ReserveConfig::default());
    let summing = Engine::start(cfg.clone()).expect("engine starts");
    let sumless = Engine::start_with(cfg, |c| LlamaRunner::load(c).map(SumlessRunner)).expect("engine starts");
    let p = chat(&format!("{DOC} {DOC} {DOC} Question: what does the librarian write on the slate?"));
    for kind in [PolicyKind::H2o, PolicyKind::KvCompress] {
        let request = || {
            let mut r = greedy(kind.name(), &p, 16);
            r.policy = Some(PolicySpec { kind, budget_tokens: 64 });
            r
        };
        let want = collect(summing.submit(request()).unwrap());
        let got = collect(sumless.submit(request()).unwrap());
        assert!(want.evicted.0 > 0, "{}: the budget evicts", kind.name());
        assert_eq!(got.evicted, want.evicted, "{}: evicted slots and blocks", kind.name());
        assert_eq!(got.tokens, want.tokens, "{}: the answer", kind.name());
    }
}

/// What a guide forces (the rest of a `guided_choice` string, a JSON schema's keys, a grammar's literals) is
/// drafted whole when speculation is on: every answer, greedy or seeded, is the engine's without speculation,
/// and the forced drafts are accepted. The n-gram lookup is set so that it cannot match (16 tokens), so the
/// drafts are the guides'.
#[test]
fn guide_forced_drafts_change_no_answer_and_are_accepted() {
    use pagoda_worker::grammar_guide::Grammar;
    use pagoda_worker::json_schema::JsonSchema;
    use pagoda_worker::regex_guide::ByteDfa;
    use std::sync::Arc;

    let plain = engine(128, true);
    let ngram = NgramConfig { num_tokens: 8, min_n: 16, max_n: 16, max_batch: 4, draft_cost: Some(0.0) };
    let spec = Engine::start(EngineConfig { speculative: ngram, ..config(128, true, ReserveConfig::default()) })
        .expect("engine starts");
    let choices = ["The capital of France is Paris, on the river Seine.".to_string(), "I cannot say.".to_string()];
    let dfa = Arc::new(ByteDfa::compile(&ByteDfa::choice_pattern(&choices).unwrap()).unwrap());
    let schema = Arc::new(
        JsonSchema::parse(
            r#"{"type": "object", "properties": {"name_of_the_capital_city": {"type": "string", "maxLength": 24},
                "population_in_millions": {"type": "integer"}, "lies_on_a_river": {"type": "boolean"}},
                "required": ["name_of_the_capital_city", "population_in_millions", "lies_on_a_river"],
                "additionalProperties": false}"#,
        )
        .unwrap(),
    );
    let grammar =
        Arc::new(Grammar::compile(r#"root ::= "Answer: the capital of France is " [A-Z] [a-z]{1,12} ".""#).unwrap());
    let prompt = chat("What is the capital of France? Answer as asked.");
    let seeded = |s: SamplingParams| SamplingParams { temperature: 0.8, seed: Some(3), ..s };
    let cases = [
        ("choice", SamplingParams { regex: Some(dfa), ..SamplingParams::greedy() }),
        ("schema", SamplingParams { json_schema: Some(schema.clone()), ..SamplingParams::greedy() }),
        ("schema, seeded", seeded(SamplingParams { json_schema: Some(schema), ..SamplingParams::greedy() })),
        ("grammar", SamplingParams { grammar: Some(grammar.clone()), ..SamplingParams::greedy() }),
        ("grammar, seeded", seeded(SamplingParams { grammar: Some(grammar), ..SamplingParams::greedy() })),
    ];
    for (name, sampling) in cases {
        let request = GenerateRequest { sampling, ..greedy(name, &prompt, 96) };
        let want = collect(plain.submit(request.clone()).unwrap());
        let got = collect(spec.submit(request).unwrap());
        assert_eq!((&got.tokens, got.reason), (&want.tokens, want.reason), "{name}");
        assert_eq!(want.reason, FinishReason::Stop, "{name}: the guided answer completes");
    }
    let s = wait_stats(&spec, "idle", |s| s.running == 0 && s.waiting == 0);
    assert!(s.accepted_draft_tokens_total >= 10, "forced drafts are accepted: {s:?}");
    assert!(s.draft_tokens_total >= s.accepted_draft_tokens_total);
    assert_eq!(s.blocks_used, 0);
}

/// `guided_regex: "b+"` with `allowed_token_ids: [id("a")]` on the real model: no allowed token starts a match,
/// so the request fails with the reason, before any token, and frees its blocks; it does not end as a "stop" on
/// an empty answer.
#[test]
fn a_guide_no_allowed_token_fits_fails_the_request() {
    use pagoda_worker::regex_guide::ByteDfa;
    use pagoda_worker::sampling::GUIDE_DEAD_END;
    use std::sync::Arc;

    let h = engine(16, false);
    let a = tokenize(&["a"])[0].clone();
    assert_eq!(a.len(), 1, "{a:?}");
    let sampling = SamplingParams {
        regex: Some(Arc::new(ByteDfa::compile("b+").unwrap())),
        allowed_token_ids: a,
        ..SamplingParams::greedy()
    };
    let request = GenerateRequest { sampling, ..greedy("dead-end", &chat("Say b."), 8) };
    let mut rx = h.submit(request).unwrap();
    let mut tokens = Vec::new();
    let failed = loop {
        match rx.blocking_recv().expect("the request ends with an event") {
            GenerateEvent::Token { id, .. } => tokens.push(id),
            GenerateEvent::Refused(e) => break e,
            other => panic!("{other:?} after {tokens:?}"),
        }
    };
    assert!(tokens.is_empty(), "{tokens:?}");
    assert!(failed.contains(GUIDE_DEAD_END) && failed.contains("regex"), "{failed}");
    let s = wait_stats(&h, "idle", |s| s.running == 0 && s.waiting == 0);
    assert_eq!(s.blocks_used, 0);
}

/// N-gram speculative decoding on the real model changes no answer: greedy and seeded answers, their
/// log-probabilities, and where a stop token ends them are those of the engine without it; the drafts are
/// accepted where the answers repeat themselves. The groups its steps registered in the prefix cache hold the
/// answer's own KV: a request that adopts them goes on as the answer did.
#[test]
fn speculative_decoding_changes_no_answer_and_accepts_drafts() {
    let plain = engine(128, true);
    // Drafts as long as allowed whenever a suffix matches: what is drafted does not depend on step times.
    let ngram = NgramConfig { num_tokens: 4, min_n: 2, max_n: 4, max_batch: 4, draft_cost: Some(0.0) };
    let spec = Engine::start(EngineConfig { speculative: ngram, ..config(128, true, ReserveConfig::default()) })
        .expect("engine starts");
    let run = |h: &EngineHandle, r: GenerateRequest| {
        let mut rx = h.submit(r).unwrap();
        let mut out = Vec::new();
        loop {
            match rx.blocking_recv() {
                Some(GenerateEvent::Token { id, logprobs }) => out.push((id, logprobs)),
                Some(GenerateEvent::Finished { reason, .. }) => return (out, reason),
                other => panic!("unexpected event {other:?}"),
            }
        }
    };
    let ids = |v: &[(u32, Option<TokenLogprobs>)]| v.iter().map(|e| e.0).collect::<Vec<_>>();
    let prompts = long_answer_prompts();
    for (i, p) in prompts.iter().enumerate() {
        let (want, _) = run(&plain, greedy("g", p, 64));
        let (got, _) = run(&spec, greedy("g", p, 64));
        assert_eq!(ids(&got), ids(&want), "greedy, prompt {i}");

        let mut seeded = GenerateRequest { logprobs: Some(2), ..greedy("s", p, 48) };
        seeded.sampling = SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(11), ..SamplingParams::greedy() };
        let (want, _) = run(&plain, seeded.clone());
        let (got, _) = run(&spec, seeded);
        assert_eq!(ids(&got), ids(&want), "seeded, prompt {i}");
        for ((_, a), (_, b)) in got.iter().zip(&want) {
            let (a, b) = (a.as_ref().expect("logprobs"), b.as_ref().expect("logprobs"));
            assert!((a.logprob - b.logprob).abs() < 1e-3, "prompt {i}: {a:?} against {b:?}");
        }
    }
    // A stop token that a draft carries ends the answer where it would without speculation. Replaying the
    // proposer over the plain greedy answers finds one: the first token of an answer that a draft accepted up to
    // it proposes, where that token did not occur in the answer before.
    let answers: Vec<Vec<u32>> = prompts.iter().map(|p| ids(&run(&plain, greedy("a", p, 64)).0)).collect();
    let carried = |p: &[u32], answer: &[u32], j: usize| {
        let mut draft = Vec::new();
        (1..=4.min(j)).any(|back| {
            let mut tokens = p.to_vec();
            tokens.extend_from_slice(&answer[..=j - back]);
            pagoda_worker::speculative::propose(&tokens, &ngram, 4, &mut draft) >= back
                && draft[..back] == answer[j - back + 1..=j]
        })
    };
    let (i, stop_at) = (0..prompts.len())
        .flat_map(|i| (1..answers[i].len()).map(move |j| (i, j)))
        .find(|&(i, j)| !answers[i][..j].contains(&answers[i][j]) && carried(&prompts[i], &answers[i], j))
        .expect("an accepted draft brings a new token");
    let stop = answers[i][stop_at];
    let stopped =
        |h: &EngineHandle| run(h, GenerateRequest { stop_token_ids: vec![stop], ..greedy("c", &prompts[i], 64) });
    let ((want, want_reason), (got, reason)) = (stopped(&plain), stopped(&spec));
    assert_eq!((ids(&got), reason), (ids(&want), want_reason));
    assert_eq!((want.len(), reason), (stop_at, FinishReason::Stop));
    let counting = &answers[0];

    let s = wait_stats(&spec, "idle", |s| s.running == 0 && s.waiting == 0);
    assert!(s.accepted_draft_tokens_total > 20, "the counting answer repeats itself: {s:?}");
    assert!(s.draft_tokens_total >= s.accepted_draft_tokens_total);
    assert_eq!(s.blocks_used, 0);
    let p = wait_stats(&plain, "idle", |s| s.running == 0 && s.waiting == 0);
    assert_eq!((p.draft_tokens_total, p.accepted_draft_tokens_total), (0, 0));

    let mut longer = prompts[0].clone();
    longer.extend_from_slice(&counting[..40]);
    let resumed = collect(spec.submit(greedy("r", &longer, 24)).unwrap());
    assert!(resumed.cached as usize >= (prompts[0].len() + 32) / 16 * 16, "adopted {}", resumed.cached);
    assert_eq!(resumed.tokens, counting[40..64], "a continuation over groups the speculative steps registered");

    // A client that walks away while its drafts are being accepted: the request ends and its blocks come back.
    let before = wait_stats(&spec, "idle", |s| s.running == 0 && s.waiting == 0);
    let mut rx = spec.submit(greedy("gone", &prompts[2], 400)).unwrap();
    for _ in 0..40 {
        assert!(matches!(rx.blocking_recv(), Some(GenerateEvent::Token { .. })));
    }
    drop(rx);
    let after = wait_stats(&spec, "blocks back", |s| s.running == 0 && s.blocks_used == before.blocks_used);
    assert!(after.accepted_draft_tokens_total > before.accepted_draft_tokens_total, "the poem's drafts: {after:?}");
    assert_eq!(after.blocks_used, 0);
}

/// The whole answer a receiver already holds, without waiting: `None` unless its `Finished` has arrived.
fn try_collect(rx: &mut UnboundedReceiver<GenerateEvent>) -> Option<(Vec<u32>, FinishReason, f64)> {
    let mut tokens = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        match ev {
            GenerateEvent::Token { id, .. } => tokens.push(id),
            GenerateEvent::Finished { reason, queue_seconds, .. } => return Some((tokens, reason, queue_seconds)),
            other => panic!("unexpected event {other:?}"),
        }
    }
    None
}

/// An engine that runs one sequence at a time under `scheduling`.
fn one_slot(scheduling: SchedulingPolicy) -> EngineHandle {
    Engine::start(EngineConfig { max_running: 1, scheduling, ..config(64, true, ReserveConfig::default()) })
        .expect("engine starts")
}

/// A greedy request of `tenant` (its namespace) that generates exactly `max_tokens`.
fn of_tenant(id: &str, prompt: &[u32], max_tokens: u32, tenant: &str) -> GenerateRequest {
    GenerateRequest { ignore_eos: true, namespace: tenant.to_string(), ..greedy(id, prompt, max_tokens) }
}

/// Fair scheduling on the real engine, one sequence at a time: with tenant `a`'s burst queued first, tenant `b`'s
/// request (namespace salted by a client's cache salt, the same tenant) runs right after the burst's first, not after all
/// of it; a priority is refused as under FCFS.
#[test]
fn fair_scheduling_serves_the_tenant_running_the_fewest_next() {
    let h = one_slot(SchedulingPolicy::Fair);
    let prompts = tokenize(&[DOC, "Count from one to ten:", "The capital of France is", "Write a haiku:"]);
    assert!(h.submit(GenerateRequest { priority: 1, ..of_tenant("p", &prompts[1], 2, "a") }).is_err());
    // Tenant a's blocker holds the only running slot until the queue is complete.
    let mut blocker = h.submit(of_tenant("blocker", &prompts[0], 500, "a")).unwrap();
    assert!(matches!(blocker.blocking_recv(), Some(GenerateEvent::Token { .. })));
    let a1 = h.submit(of_tenant("a1", &prompts[1], 4, "a")).unwrap();
    let a2 = h.submit(of_tenant("a2", &prompts[2], 4, "a")).unwrap();
    let b = h.submit(of_tenant("b", &prompts[3], 4, "b\u{0}salt\u{0}x1")).unwrap();
    h.cancel("blocker").unwrap();
    // With the blocker gone nobody runs: a1 (the earliest) goes first; then neither tenant runs anything, and b,
    // admitted less recently than a, goes before a2.
    let (a1, b, a2) = (collect(a1), collect(b), collect(a2));
    assert!(a2.queue_seconds > b.queue_seconds, "a2 queued {} s, b {} s", a2.queue_seconds, b.queue_seconds);
    assert!([&a1, &b, &a2].iter().all(|r| r.tokens.len() == 4 && r.reason == FinishReason::Length));
    assert_eq!(collect(blocker).reason, FinishReason::Cancelled);
    wait_stats(&h, "the engine to go idle", |s| s.running == 0 && s.waiting == 0 && s.blocks_used == 0);
}

/// VTC scheduling on the real engine, one sequence at a time: tenant `a`'s first request has a long prompt, which
/// its counter is charged for, so tenant `b`'s three short requests all run before `a`'s second; slot fairness
/// would alternate the tenants and run `a`'s second before `b`'s last two.
#[test]
fn vtc_scheduling_charges_a_long_prompt_to_its_tenant() {
    let h = one_slot(SchedulingPolicy::Vtc);
    let long = [DOC; 4].join(" ");
    let prompts = tokenize(&[&long, "Count from one to ten:", "The capital of France is", "Write a haiku:"]);
    assert!(prompts[0].len() > 4 * (prompts[1].len() + 2 * 4), "the long prompt outweighs three short requests");
    assert!(h.submit(GenerateRequest { priority: 1, ..of_tenant("p", &prompts[1], 2, "a") }).is_err());
    // A third tenant's blocker holds the only running slot until the queue is complete.
    let mut blocker = h.submit(of_tenant("blocker", &prompts[1], 500, "c")).unwrap();
    assert!(matches!(blocker.blocking_recv(), Some(GenerateEvent::Token { .. })));
    let a1 = h.submit(of_tenant("a1", &prompts[0], 4, "a")).unwrap();
    let a2 = h.submit(of_tenant("a2", &prompts[1], 4, "a")).unwrap();
    let b: Vec<_> = (0..3).map(|i| h.submit(of_tenant(&format!("b{i}"), &prompts[1 + i], 4, "b")).unwrap()).collect();
    h.cancel("blocker").unwrap();
    let (a1, a2) = (collect(a1), collect(a2));
    let b: Vec<_> = b.into_iter().map(collect).collect();
    for r in b.iter() {
        assert!(
            a2.queue_seconds > r.queue_seconds,
            "a2 queued {} s, a b request {} s",
            a2.queue_seconds,
            r.queue_seconds
        );
    }
    assert!(b[0].queue_seconds > a1.queue_seconds, "a1 arrived first with the same counter and ran first");
    assert!(b.iter().chain([&a1, &a2]).all(|r| r.tokens.len() == 4 && r.reason == FinishReason::Length));
    assert_eq!(collect(blocker).reason, FinishReason::Cancelled);
    wait_stats(&h, "the engine to go idle", |s| s.running == 0 && s.waiting == 0 && s.blocks_used == 0);
}

/// Priority scheduling on the real engine, one sequence at a time: queued requests run by priority, then arrival.
/// Every event of a request is sent before the next request computes anything, so when one request's answer has
/// arrived, the answers of those served before it are already in their receivers.
#[test]
fn priority_scheduling_serves_the_queue_by_priority_then_arrival() {
    let h = one_slot(SchedulingPolicy::Priority);
    let prompts = tokenize(&[DOC, "Count from one to ten:", "The capital of France is", "Write a haiku:"]);
    let req = |id: &str, prompt: &[u32], max_tokens: u32, priority: i32| GenerateRequest {
        ignore_eos: true,
        priority,
        ..greedy(id, prompt, max_tokens)
    };
    // The blocker holds the only running slot until the queue is complete.
    let mut blocker = h.submit(req("blocker", &prompts[0], 500, 0)).unwrap();
    assert!(matches!(blocker.blocking_recv(), Some(GenerateEvent::Token { .. })));
    let late = h.submit(req("late", &prompts[1], 4, 5)).unwrap();
    let mut urgent = h.submit(req("urgent", &prompts[2], 8, -2)).unwrap();
    let later = h.submit(req("later", &prompts[3], 4, 5)).unwrap();
    // Commands reach the engine in order: the three are queued when the blocker goes.
    h.cancel("blocker").unwrap();
    let late = collect(late);
    let urgent = try_collect(&mut urgent).expect("the urgent request was served before the one that came first");
    // The late one arrived first and ran second: it waited longer, by the urgent one's whole run.
    assert!(late.queue_seconds > urgent.2, "queued {} s against {} s", late.queue_seconds, urgent.2);
    assert_eq!((urgent.0.len(), urgent.1), (8, FinishReason::Length));
    assert!(urgent.2 > 0.0);
    assert_eq!((late.tokens.len(), late.reason), (4, FinishReason::Length));
    assert_eq!(collect(later).tokens.len(), 4);
    let blocked = collect(blocker);
    assert_eq!(blocked.reason, FinishReason::Cancelled);
    assert!(blocked.tokens.len() < 499, "the blocker was cancelled early");
    wait_stats(&h, "the engine to go idle", |s| s.running == 0 && s.waiting == 0 && s.blocks_used == 0);
}

/// Through the gRPC service on the real model, a guide compiles once the request is admitted (on a blocking
/// thread, off the runtime's) and guides the answer; a broken one is still refused as invalid.
#[test]
fn the_service_compiles_a_guide_after_admission_and_follows_it() {
    use futures::StreamExt;
    use pagoda_proto::worker::worker_server::Worker;
    use pagoda_proto::worker::{self as pb, FinishReason as PbFinish};
    use pagoda_worker::service::WorkerService;
    use tonic::{Code, Request};

    let svc = WorkerService::new(engine(32, false));
    let prompt = chat("Pick a number between 10 and 99.");
    let guided = |grammar: &str| pb::GenerateRequest {
        request_id: "g".into(),
        prompt_token_ids: prompt.clone(),
        max_tokens: 24,
        sampling: Some(pb::SamplingParams { grammar: grammar.into(), ..Default::default() }),
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (tokens, finished) = rt.block_on(async {
        let mut stream = svc
            .generate(Request::new(guided(r#"root ::= "Number: " [1-9] [0-9] ".""#)))
            .await
            .expect("admitted")
            .into_inner();
        let (mut tokens, mut finished) = (Vec::new(), None);
        while let Some(m) = stream.next().await {
            let m = m.expect("a stream message");
            tokens.extend(m.token_ids);
            finished = m.finished.or(finished);
        }
        (tokens, finished.expect("a finish message"))
    });
    assert_eq!(finished.reason, PbFinish::Stop as i32);
    let g = Gguf::open(model_path()).expect("gguf");
    let text = Tokenizer::from_gguf(&g).expect("tokenizer").decode(&tokens, true);
    let digits = text.strip_prefix("Number: ").and_then(|t| t.strip_suffix('.')).unwrap_or_default();
    assert!(digits.len() == 2 && digits.bytes().all(|b| b.is_ascii_digit()), "{text:?}");
    let err = rt.block_on(svc.generate(Request::new(guided(r#"start ::= "a""#)))).err().expect("refused");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("grammar"), "{err:?}");
}
