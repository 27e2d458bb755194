//! Scheduler logic without the model: a stand-in forward writes each computed token into a fake KV arena through
//! the sequence's block tables, reads the whole cache back through the tables when logits are wanted (so wrong
//! block bookkeeping changes the output), and returns one-hot logits of a deterministic function of that cache.

use std::collections::HashMap;

use pagoda_worker::cache::CacheLayout;
use pagoda_worker::policy::PolicySpec;
use pagoda_worker::sampling::argmax;
use pagoda_worker::scheduler::{
    FinishReason, PROMPT_LOGITS_STEP_TOKENS, ReserveConfig, SchedError, SchedStats, Scheduler, SchedulerConfig,
    SchedulingPolicy, SeqId, SeqRequest, StepPlan,
};
use pagoda_worker::speculative::NgramConfig;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use xxhash_rust::xxh3::xxh3_64;

const LAYOUT: CacheLayout = CacheLayout { n_layers: 2, n_kv_heads: 2, block_size: 4 };
const GS: usize = 4;
const VOCAB: usize = 50;

struct FakeModel {
    arena: Vec<u32>,
    logits: Vec<f32>,
    /// `Some(p)`: the next token mostly counts on from the last one modulo `p` (text that repeats, which n-gram
    /// drafts predict); every fifth position it is the hash of the cache instead (where drafts fail).
    cycle: Option<u32>,
}

impl FakeModel {
    fn new(num_blocks: usize) -> FakeModel {
        FakeModel { arena: vec![u32::MAX; num_blocks * LAYOUT.block_size], logits: vec![0.0; VOCAB], cycle: None }
    }

    fn cycling(num_blocks: usize, period: u32) -> FakeModel {
        FakeModel { cycle: Some(period), ..FakeModel::new(num_blocks) }
    }

    /// The next token after `cache` (the tokens read back through the block tables), as one-hot logits' argmax.
    fn next(&mut self, cache: &[u32]) -> u32 {
        let mut bytes = Vec::new();
        for t in cache {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let hash = (xxh3_64(&bytes) % VOCAB as u64) as usize;
        let hot = match (self.cycle, cache.last()) {
            (Some(p), Some(&last)) if !cache.len().is_multiple_of(5) => (last as usize + 1) % p as usize,
            _ => hash,
        };
        self.logits.iter_mut().for_each(|l| *l = 0.0);
        self.logits[hot] = 1.0;
        argmax(&self.logits)
    }
}

#[derive(Default)]
struct Outcome {
    tokens: HashMap<SeqId, Vec<u32>>,
    finished: HashMap<SeqId, FinishReason>,
    /// The step (0-based) in which each sequence finished.
    finish_step: HashMap<SeqId, usize>,
    steps: usize,
}

fn cfg(max_step_tokens: usize, max_running: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_step_tokens,
        max_running,
        enable_prefix_cache: true,
        max_model_len: 1000,
        model_id: "fake".into(),
        ..SchedulerConfig::default()
    }
}

fn req(prompt: Vec<u32>, max_tokens: usize) -> SeqRequest<()> {
    SeqRequest {
        prompt,
        max_tokens,
        stop_token_ids: Vec::new(),
        namespace: String::new(),
        policy: Default::default(),
        prompt_logits: false,
        priority: 0,
        tenant_weight: 1,
        lora: None,
        payload: (),
    }
}

/// Runs one step: schedule, fake forward, complete, sample, append, finish. An entry with a speculative draft
/// samples its rows in order while they agree with the draft (as the engine does), then settles it.
fn step(s: &mut Scheduler<()>, m: &mut FakeModel, out: &mut Outcome) -> StepPlan {
    let plan = s.schedule();
    let bs = LAYOUT.block_size;
    let mut sampled = Vec::new();
    for e in &plan.seqs {
        let seq = s.get(e.seq).expect("scheduled sequence exists");
        assert_eq!(seq.lens()[0], e.start, "cache length must equal computed tokens");
        assert!(e.start + e.n <= seq.tokens().len());
        assert_eq!(seq.draft().len(), e.draft, "the entry's draft ends the tokens");
        for (t, table) in seq.tables().iter().enumerate() {
            assert!(table.len() * bs >= seq.lens()[t] + e.n, "reserved capacity");
            for j in 0..e.n {
                let slot = seq.lens()[t] + j;
                m.arena[table[slot / bs] as usize * bs + slot % bs] = seq.tokens()[e.start + j];
            }
        }
        if e.wants_logits {
            let mut emitted = Vec::new();
            for i in 0..=e.draft {
                let end = e.start + e.n - e.draft + i;
                for table in seq.tables() {
                    let read: Vec<u32> =
                        (0..end).map(|slot| m.arena[table[slot / bs] as usize * bs + slot % bs]).collect();
                    assert_eq!(&read[..], &seq.tokens()[..end], "KV read through the tables must be the tokens");
                }
                let tok = m.next(&seq.tokens()[..end]);
                emitted.push(tok);
                if i == e.draft || seq.draft()[i] != tok || seq.stops_on(tok) {
                    break;
                }
            }
            sampled.push((e.seq, emitted));
        }
    }
    s.complete_step(&plan);
    for (id, emitted) in sampled {
        s.settle_draft(id, emitted.len() - 1).unwrap();
        out.tokens.entry(id).or_default().extend_from_slice(&emitted);
        let Some(&last) = emitted.last() else { continue };
        if let Some(reason) = s.append_token(id, last).unwrap() {
            s.finish(id);
            out.finished.insert(id, reason);
            out.finish_step.insert(id, out.steps);
        }
    }
    out.steps += 1;
    plan
}

fn run_to_end(s: &mut Scheduler<()>, m: &mut FakeModel, max_steps: usize) -> Outcome {
    let mut out = Outcome::default();
    while s.has_work() {
        assert!(out.steps < max_steps, "no progress after {max_steps} steps: deadlock?");
        let plan = step(s, m, &mut out);
        assert!(!plan.is_empty(), "a scheduler with work must schedule something");
    }
    out
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (seed * 7 + i * 3) % VOCAB as u32).collect()
}

/// Generates each request alone on a big pool: the reference outputs.
fn reference(reqs: &[(Vec<u32>, usize)]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|(p, n)| {
            let mut s = Scheduler::new(cfg(512, 64), LAYOUT, 1000 * GS);
            let mut m = FakeModel::new(1000 * GS);
            let id = s.add(req(p.clone(), *n)).unwrap();
            let out = run_to_end(&mut s, &mut m, 10_000);
            out.tokens[&id].clone()
        })
        .collect()
}

#[test]
fn budget_and_chunked_prefill() {
    let mut s = Scheduler::new(cfg(32, 8), LAYOUT, 200 * GS);
    let mut m = FakeModel::new(200 * GS);
    let mut out = Outcome::default();
    let id = s.add(req(prompt(1, 100), 3)).unwrap();
    let chunks: Vec<(usize, usize, bool)> = (0..4)
        .map(|_| {
            let p = step(&mut s, &mut m, &mut out);
            assert_eq!(p.seqs.len(), 1);
            (p.seqs[0].start, p.seqs[0].n, p.seqs[0].wants_logits)
        })
        .collect();
    assert_eq!(chunks, vec![(0, 32, false), (32, 32, false), (64, 32, false), (96, 4, true)]);
    assert_eq!(out.tokens[&id].len(), 1);
    // Decode: one token per step.
    let p = step(&mut s, &mut m, &mut out);
    assert_eq!((p.seqs[0].start, p.seqs[0].n, p.seqs[0].wants_logits), (100, 1, true));
    assert_eq!(s.stats().computed_tokens_total, 101);
}

/// Sequences that want every prompt position's logits adopt no cached prefix, and share
/// [`PROMPT_LOGITS_STEP_TOKENS`] per step while the rest of the step budget goes to the others; they produce
/// what they would alone.
#[test]
fn prompt_logits_sequences_share_a_step_cap_and_adopt_no_prefix() {
    let cap = PROMPT_LOGITS_STEP_TOKENS;
    let long = prompt(4, 2 * cap + 40);
    let want = reference(&[(long.clone(), 3)]);
    let mut s = Scheduler::new(cfg(4 * cap, 8), LAYOUT, 1000 * GS);
    let mut m = FakeModel::new(1000 * GS);
    let mut out = Outcome::default();
    // The prompt goes into the prefix cache first.
    let warm = s.add(req(long.clone(), 1)).unwrap();
    while s.get(warm).is_some() {
        step(&mut s, &mut m, &mut out);
    }
    let scoring = |p: &[u32]| SeqRequest { prompt_logits: true, ..req(p.to_vec(), 3) };
    let a = s.add(scoring(&long)).unwrap();
    let b = s.add(scoring(&long)).unwrap();
    let plain = s.add(req(long.clone(), 3)).unwrap();
    let mut logits_tokens = Vec::new();
    while s.has_work() {
        let plan = step(&mut s, &mut m, &mut out);
        let mut n = 0;
        for e in &plan.seqs {
            let seq = s.get(e.seq).map(|q| q.prompt_logits_from(e.start));
            if seq == Some(true) {
                n += e.n;
            }
        }
        assert!(n <= cap, "{n} prompt-logits tokens in one step");
        logits_tokens.push(n);
        assert!(out.steps < 100);
    }
    assert!(logits_tokens.iter().filter(|&&n| n == cap).count() >= 3, "{logits_tokens:?}");
    for id in [a, b, plain] {
        assert_eq!(out.tokens[&id], want[0], "{id}");
    }
    // Only the plain request adopted the cached prompt.
    let cached = s.stats().cached_tokens_total;
    assert_eq!(cached as usize, (long.len() - 1) / LAYOUT.block_size * LAYOUT.block_size, "{cached}");
}

#[test]
fn decodes_first_then_prefill_fills_the_budget() {
    let mut s = Scheduler::new(cfg(16, 8), LAYOUT, 200 * GS);
    let mut m = FakeModel::new(200 * GS);
    let mut out = Outcome::default();
    let a = s.add(req(prompt(1, 5), 50)).unwrap();
    let b = s.add(req(prompt(2, 6), 50)).unwrap();
    step(&mut s, &mut m, &mut out); // both prompts (11 tokens) in one step
    let c = s.add(req(prompt(3, 40), 5)).unwrap();
    let p = step(&mut s, &mut m, &mut out);
    // a and b decode (1 each), c gets the remaining 14 tokens as a prefill chunk.
    let got: Vec<(SeqId, usize)> = p.seqs.iter().map(|e| (e.seq, e.n)).collect();
    assert_eq!(got, vec![(a, 1), (b, 1), (c, 14)]);
    let p = step(&mut s, &mut m, &mut out);
    let got: Vec<(SeqId, usize)> = p.seqs.iter().map(|e| (e.seq, e.n)).collect();
    assert_eq!(got, vec![(a, 1), (b, 1), (c, 14)]);
    for _ in 0..20 {
        let p = step(&mut s, &mut m, &mut out);
        assert!(p.num_tokens() <= 16);
    }
}

#[test]
fn fairness_fifo_admission_and_every_runner_decodes_each_step() {
    let mut s = Scheduler::new(cfg(64, 3), LAYOUT, 400 * GS);
    let mut m = FakeModel::new(400 * GS);
    let mut out = Outcome::default();
    let ids: Vec<SeqId> = (0..6).map(|i| s.add(req(prompt(i, 8), 4)).unwrap()).collect();
    let p = step(&mut s, &mut m, &mut out);
    // max_running = 3: the first three, in arrival order.
    assert_eq!(p.seqs.iter().map(|e| e.seq).collect::<Vec<_>>(), ids[..3]);
    // Each following step decodes all three runners until they finish.
    for _ in 0..3 {
        let p = step(&mut s, &mut m, &mut out);
        assert_eq!(p.seqs.iter().map(|e| e.seq).collect::<Vec<_>>(), ids[..3]);
    }
    // They finished (4 tokens); the next three are admitted in order.
    assert!(ids[..3].iter().all(|id| out.finished[id] == FinishReason::Length));
    let p = step(&mut s, &mut m, &mut out);
    assert_eq!(p.seqs.iter().map(|e| e.seq).collect::<Vec<_>>(), ids[3..]);
    run_to_end(&mut s, &mut m, 100);
    assert!(ids.iter().all(|id| out.tokens.get(id).is_some_and(|t| !t.is_empty())));
}

#[test]
fn preemption_resumes_without_losing_or_duplicating_tokens() {
    let reqs: Vec<(Vec<u32>, usize)> = (0..6).map(|i| (prompt(i, 10 + 3 * i as usize), 30)).collect();
    let want = reference(&reqs);
    // 16 groups = 64 tokens of KV for 6 sequences that each grow to ~50 tokens; greedy admission.
    let blocks = 16 * GS;
    let mut s = Scheduler::new(SchedulerConfig { reserve: ReserveConfig::off(), ..cfg(64, 8) }, LAYOUT, blocks);
    let mut m = FakeModel::new(blocks);
    let ids: Vec<SeqId> = reqs.iter().map(|(p, n)| s.add(req(p.clone(), *n)).unwrap()).collect();
    let out = run_to_end(&mut s, &mut m, 5_000);
    assert!(s.stats().preemptions_total > 0, "the tiny pool must force preemption");
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(out.tokens[id], want[i], "request {i}");
        assert_eq!(out.finished[id], FinishReason::Length);
    }
    assert_eq!(s.pool().num_used(), 0);
    s.pool().check_invariants().unwrap();
}

fn by_priority(max_step_tokens: usize, max_running: usize) -> SchedulerConfig {
    SchedulerConfig { scheduling: SchedulingPolicy::Priority, ..cfg(max_step_tokens, max_running) }
}

fn prioritized(prompt: Vec<u32>, max_tokens: usize, priority: i32) -> SeqRequest<()> {
    SeqRequest { priority, ..req(prompt, max_tokens) }
}

/// The order in which sequences were first scheduled, running `s` to the end.
fn first_scheduled(s: &mut Scheduler<()>, m: &mut FakeModel, out: &mut Outcome) -> Vec<SeqId> {
    let mut order = Vec::new();
    while s.has_work() {
        assert!(out.steps < 5_000, "no progress: deadlock?");
        for e in step(s, m, out).seqs {
            if !order.contains(&e.seq) {
                order.push(e.seq);
            }
        }
    }
    order
}

#[test]
fn priority_scheduling_admits_the_lowest_priority_first_and_arrival_breaks_ties() {
    let mut s = Scheduler::new(by_priority(64, 1), LAYOUT, 400 * GS);
    let mut m = FakeModel::new(400 * GS);
    let mut out = Outcome::default();
    let [a, b, c, d, e] = [(0, 0), (1, 5), (2, -1), (3, 5), (4, i32::MIN)]
        .map(|(seed, priority)| s.add(prioritized(prompt(seed, 8), 3, priority)).unwrap());
    assert_eq!(first_scheduled(&mut s, &mut m, &mut out), vec![e, c, a, b, d]);
    // A later, more urgent arrival overtakes the queue but not the running sequence.
    let (x, y) = (s.add(prioritized(prompt(5, 8), 3, 0)).unwrap(), s.add(prioritized(prompt(6, 8), 3, 1)).unwrap());
    step(&mut s, &mut m, &mut out);
    let z = s.add(prioritized(prompt(7, 8), 3, -3)).unwrap();
    assert_eq!(first_scheduled(&mut s, &mut m, &mut out), vec![x, z, y]);
    assert!([a, b, c, d, e, x, y, z].iter().all(|id| out.finished[id] == FinishReason::Length));
}

#[test]
fn fcfs_refuses_a_priority_and_orders_by_arrival() {
    let mut s = Scheduler::new(cfg(64, 1), LAYOUT, 400 * GS);
    assert_eq!(s.add(prioritized(prompt(0, 8), 3, -1)).unwrap_err(), SchedError::PriorityNotEnabled(-1));
    assert_eq!(s.add(prioritized(prompt(0, 8), 3, 7)).unwrap_err(), SchedError::PriorityNotEnabled(7));
    let mut m = FakeModel::new(400 * GS);
    let mut out = Outcome::default();
    let ids: Vec<SeqId> = (0..4).map(|i| s.add(req(prompt(i, 8), 3)).unwrap()).collect();
    assert_eq!(first_scheduled(&mut s, &mut m, &mut out), ids);
}

/// Under memory pressure the sequence preempted is the last in queue order: the least urgent, even when it is
/// the oldest; a preempted one goes back to its place in the queue; and every answer is what it is alone.
#[test]
fn priority_scheduling_preempts_the_least_urgent_and_keeps_every_answer() {
    let mut reqs: Vec<(Vec<u32>, usize, i32)> =
        (0..6).map(|i| (prompt(i, 10 + 3 * i as usize), 30, [0, 0, 9, 1, 9, 2][i as usize])).collect();
    // Arrives at step 10, more urgent than everything running then.
    reqs.push((prompt(6, 8), 10, -1));
    let want = reference(&reqs.iter().map(|(p, n, _)| (p.clone(), *n)).collect::<Vec<_>>());
    // 28 groups = 112 tokens of KV for sequences that each grow to 40-55 tokens; the urgent ones (40, 43 and 18
    // tokens: 26 groups) fit together. Greedy admission.
    let blocks = 28 * GS;
    let mut s = Scheduler::new(SchedulerConfig { reserve: ReserveConfig::off(), ..by_priority(64, 8) }, LAYOUT, blocks);
    let mut m = FakeModel::new(blocks);
    let mut ids: Vec<SeqId> =
        reqs[..6].iter().map(|(p, n, pr)| s.add(prioritized(p.clone(), *n, *pr)).unwrap()).collect();
    let key = |s: &Scheduler<()>, id: SeqId| (s.get(id).unwrap().priority(), id);
    let mut out = Outcome::default();
    let mut preempted = Vec::new();
    while s.has_work() {
        assert!(out.steps < 5_000, "no progress: deadlock?");
        if out.steps == 10 {
            let (p, n, pr) = &reqs[6];
            ids.push(s.add(prioritized(p.clone(), *n, *pr)).unwrap());
        }
        let running: Vec<(i32, SeqId)> = s.running_ids().iter().map(|&id| key(&s, id)).collect();
        let waiting: Vec<(i32, SeqId)> = s.waiting_ids().map(|id| key(&s, id)).collect();
        let plan = step(&mut s, &mut m, &mut out);
        for victim in &plan.preempted {
            // Everything less urgent than the victim that was running went too.
            let victim_key = key(&s, *victim);
            for r in running.iter().filter(|r| **r > victim_key) {
                assert!(plan.preempted.contains(&r.1), "{victim} preempted while {} ran on", r.1);
            }
            preempted.push(*victim);
        }
        // Admission takes the waiting queue in order: nothing more urgent than an admitted sequence stays behind.
        let admitted = waiting.iter().filter(|w| plan.seqs.iter().any(|e| e.seq == w.1));
        if let Some(last) = admitted.max() {
            for w in waiting.iter().filter(|w| *w < last) {
                assert!(plan.seqs.iter().any(|e| e.seq == w.1), "{last:?} admitted before {w:?}");
            }
        }
    }
    assert!(!preempted.is_empty(), "the tiny pool must force preemption");
    // The urgent requests (priority 0: ids[0], ids[1]; -1: the late one) are never the ones to go, and the first
    // two finish before the least urgent (priority 9: ids[2], ids[4]).
    assert!([0, 1, 6].iter().all(|&i| !preempted.contains(&ids[i])), "preempted {preempted:?} of {ids:?}");
    let finish_step: Vec<usize> = ids.iter().map(|id| out.finish_step[id]).collect();
    assert!(finish_step[0].max(finish_step[1]) < finish_step[2].min(finish_step[4]), "{finish_step:?}");
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(out.tokens[id], want[i], "request {i}");
        assert_eq!(out.finished[id], FinishReason::Length);
    }
    assert_eq!(s.pool().num_used(), 0);
    s.pool().check_invariants().unwrap();
}

fn fair(max_step_tokens: usize, max_running: usize) -> SchedulerConfig {
    SchedulerConfig { scheduling: SchedulingPolicy::Fair, ..cfg(max_step_tokens, max_running) }
}

fn of_tenant(prompt: Vec<u32>, max_tokens: usize, namespace: &str) -> SeqRequest<()> {
    SeqRequest { namespace: namespace.to_string(), ..req(prompt, max_tokens) }
}

/// A burst of one tenant does not hold the batch: the other tenant's requests, queued behind it, are admitted
/// as soon as a slot frees, ahead of the burst's rest; a LoRA adapter's salt does not make another tenant; a
/// priority is refused as under FCFS; and every answer is what it is alone.
#[test]
fn fair_scheduling_admits_the_tenant_running_the_fewest_first() {
    let mut s = Scheduler::new(fair(64, 2), LAYOUT, 400 * GS);
    assert_eq!(s.add(prioritized(prompt(0, 8), 3, 1)).unwrap_err(), SchedError::PriorityNotEnabled(1));
    let mut m = FakeModel::new(400 * GS);
    let mut out = Outcome::default();
    let burst: Vec<SeqId> = (0..5).map(|i| s.add(of_tenant(prompt(i, 8), 3, "heavy")).unwrap()).collect();
    // The light tenant's second request runs with an adapter: same tenant, salted namespace.
    let light = [
        s.add(of_tenant(prompt(10, 8), 3, "light")).unwrap(),
        s.add(of_tenant(prompt(11, 8), 3, "light\u{0}lora\u{0}sql@1")).unwrap(),
    ];
    let order = first_scheduled(&mut s, &mut m, &mut out);
    // Two slots: heavy's first and light's first start together; then light's second, before heavy's second,
    // since light runs one sequence and heavy one.
    assert_eq!(&order[..2], &[burst[0], light[0]], "{order:?}");
    let pos = |id: SeqId| order.iter().position(|&o| o == id).unwrap();
    assert!(pos(light[1]) < pos(burst[1]) || pos(light[1]) < pos(burst[2]), "{order:?}");
    assert!(pos(light[1]) <= 3, "{order:?}");
    // Under FCFS the same queue serves the whole burst first.
    let mut f = Scheduler::new(cfg(64, 2), LAYOUT, 400 * GS);
    let tenants = [(0, "heavy"), (1, "heavy"), (2, "heavy"), (3, "heavy"), (4, "heavy"), (10, "light"), (11, "light")];
    let ids: Vec<SeqId> = tenants.iter().map(|&(i, t)| f.add(of_tenant(prompt(i, 8), 3, t)).unwrap()).collect();
    assert_eq!(first_scheduled(&mut f, &mut FakeModel::new(400 * GS), &mut Outcome::default()), ids);
    let want = reference(&[0, 1, 2, 3, 4, 10, 11].map(|i| (prompt(i, 8), 3)));
    for (i, id) in burst.iter().chain(&light).enumerate() {
        assert_eq!(out.tokens[id], want[i], "request {i}");
    }
    s.pool().check_invariants().unwrap();
}

/// Weights share the slots in proportion: with 4 slots, a tenant of weight 3 gets 3 while one of weight 1 gets 1;
/// with equal weights they get 2 each.
#[test]
fn fair_scheduling_shares_the_slots_by_tenant_weight() {
    let first_four = |heavy_weight: u32| {
        let mut s = Scheduler::new(fair(512, 4), LAYOUT, 400 * GS);
        let weighted = |i: u32, t: &str, w: u32| SeqRequest { tenant_weight: w, ..of_tenant(prompt(i, 8), 3, t) };
        let heavy: Vec<SeqId> = (0..6).map(|i| s.add(weighted(i, "heavy", heavy_weight)).unwrap()).collect();
        let light: Vec<SeqId> = (10..16).map(|i| s.add(weighted(i, "light", 1)).unwrap()).collect();
        let plan = s.schedule();
        let admitted: Vec<SeqId> = plan.seqs.iter().map(|e| e.seq).collect();
        let count = |ids: &[SeqId]| admitted.iter().filter(|a| ids.contains(a)).count();
        (count(&heavy), count(&light))
    };
    assert_eq!(first_four(3), (3, 1));
    assert_eq!(first_four(1), (2, 2));
    // A weight of 0 counts as 1.
    assert_eq!(first_four(0), (2, 2));
}

/// Four sequences of a heavy tenant and one of a light tenant (the youngest of all) on a pool too small for them:
/// under `config` the light tenant's sequence is never the preemption victim, and every answer is what it is alone.
fn light_tenant_is_never_preempted(config: SchedulerConfig) {
    let reqs: Vec<(Vec<u32>, usize, &str)> =
        (0..5).map(|i| (prompt(i, 10 + 3 * i as usize), 30, if i < 4 { "heavy" } else { "light" })).collect();
    let want = reference(&reqs.iter().map(|(p, n, _)| (p.clone(), *n)).collect::<Vec<_>>());
    let blocks = 28 * GS;
    let mut s = Scheduler::new(SchedulerConfig { reserve: ReserveConfig::off(), ..config }, LAYOUT, blocks);
    let mut m = FakeModel::new(blocks);
    let ids: Vec<SeqId> = reqs.iter().map(|(p, n, t)| s.add(of_tenant(p.clone(), *n, t)).unwrap()).collect();
    let mut out = Outcome::default();
    let mut preempted = Vec::new();
    while s.has_work() {
        assert!(out.steps < 5_000, "no progress: deadlock?");
        let plan = step(&mut s, &mut m, &mut out);
        preempted.extend(plan.preempted.iter().copied());
    }
    assert!(!preempted.is_empty(), "the tiny pool must force preemption");
    assert!(!preempted.contains(&ids[4]), "the light tenant's one sequence is never the victim: {preempted:?}");
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(out.tokens[id], want[i], "request {i}");
    }
    assert_eq!(s.pool().num_used(), 0);
    s.pool().check_invariants().unwrap();
}

/// Under memory pressure fair scheduling preempts from the tenant running the most, its youngest first, even
/// when the other tenant's sequence is the youngest of all (FCFS would take it).
#[test]
fn fair_scheduling_preempts_the_tenant_running_the_most() {
    light_tenant_is_never_preempted(fair(64, 8));
}

fn vtc(max_step_tokens: usize, max_running: usize) -> SchedulerConfig {
    SchedulerConfig { scheduling: SchedulingPolicy::Vtc, ..cfg(max_step_tokens, max_running) }
}

/// Both tenants backlogged, one slot: a tenant of 40-token prompts and one of 4-token prompts (2 tokens out each).
/// Returns how many of the long tenant's requests were admitted by the time the short tenant's 8 had been, and
/// checks every answer against its solo run.
fn long_admitted_while_short_runs(config: SchedulerConfig, long_weight: u32) -> usize {
    let mut s = Scheduler::new(config, LAYOUT, 400 * GS);
    let mut m = FakeModel::new(400 * GS);
    let mut out = Outcome::default();
    let weighted = |p: Vec<u32>, t: &str, w: u32| SeqRequest { tenant_weight: w, ..of_tenant(p, 2, t) };
    let long: Vec<SeqId> = (0..8).map(|i| s.add(weighted(prompt(i, 40), "long", long_weight)).unwrap()).collect();
    let short: Vec<SeqId> = (20..28).map(|i| s.add(weighted(prompt(i, 4), "short", 1)).unwrap()).collect();
    let order = first_scheduled(&mut s, &mut m, &mut out);
    let last_short = order.iter().rposition(|id| short.contains(id)).unwrap();
    let want =
        reference(&(0..8).map(|i| (prompt(i, 40), 2)).chain((20..28).map(|i| (prompt(i, 4), 2))).collect::<Vec<_>>());
    for (i, id) in long.iter().chain(&short).enumerate() {
        assert_eq!(out.tokens[id], want[i], "request {i}");
    }
    assert_eq!(s.pool().num_used(), 0);
    s.pool().check_invariants().unwrap();
    order[..last_short].iter().filter(|id| long.contains(id)).count()
}

/// VTC shares weighted tokens, not slots: a long-prompt request costs 44 (40 prompt + 2 x 2 output) against 8 for
/// a short one, so the short tenant's 8 requests (64) are served while the long tenant gets about 2, where slot
/// fairness alternates the two (7 or 8). A weight of 4 gives the long tenant four times the tokens; and a
/// priority is refused as under FCFS.
#[test]
fn vtc_scheduling_shares_weighted_tokens_between_tenants_not_slots() {
    let by_slots = long_admitted_while_short_runs(fair(64, 1), 1);
    let by_tokens = long_admitted_while_short_runs(vtc(64, 1), 1);
    let weighted = long_admitted_while_short_runs(vtc(64, 1), 4);
    assert!(by_slots >= 7, "slot fairness alternates the tenants: {by_slots}");
    assert!((1..=3).contains(&by_tokens), "VTC: {by_tokens} long requests beside 8 short ones");
    assert!((5..=8).contains(&weighted), "VTC, long tenant at weight 4: {weighted}");
    let mut s: Scheduler<()> = Scheduler::new(vtc(64, 1), LAYOUT, 400 * GS);
    assert_eq!(s.add(prioritized(prompt(0, 8), 3, 1)).unwrap_err(), SchedError::PriorityNotEnabled(1));
}

/// A tenant that was idle does not bank service: arriving while another tenant has been served for a while, its
/// counter starts at the waiting tenant's, so the two alternate instead of the newcomer taking every admission
/// until it has caught up.
#[test]
fn vtc_lifts_an_arriving_tenant_to_the_waiting_minimum() {
    let mut s = Scheduler::new(vtc(64, 1), LAYOUT, 400 * GS);
    let mut m = FakeModel::new(400 * GS);
    let mut out = Outcome::default();
    let early: Vec<SeqId> = (0..12).map(|i| s.add(of_tenant(prompt(i, 8), 2, "early")).unwrap()).collect();
    let mut seen = Vec::new();
    while out.finished.len() < 6 {
        assert!(out.steps < 5_000, "no progress");
        seen.extend(step(&mut s, &mut m, &mut out).seqs.iter().map(|e| e.seq));
    }
    let tenant = pagoda_worker::scheduler::tenant_of;
    let served = s.vtc_counter(tenant("early"));
    assert!(served >= 6.0 * 12.0, "six requests of 8 + 2 x 2: {served}");
    let late: Vec<SeqId> = (20..26).map(|i| s.add(of_tenant(prompt(i, 8), 2, "late")).unwrap()).collect();
    assert_eq!(s.vtc_counter(tenant("late")), served, "lifted to the waiting tenant's counter");
    let order = first_scheduled(&mut s, &mut m, &mut out);
    let next: Vec<SeqId> = order.into_iter().filter(|id| !seen.contains(id)).take(4).collect();
    let count = |ids: &[SeqId]| next.iter().filter(|id| ids.contains(id)).count();
    assert_eq!((count(&early), count(&late)), (2, 2), "the tenants alternate: {next:?}");
    assert_eq!(s.pool().num_used(), 0);
}

/// Under memory pressure VTC preempts from the tenant that has received the most, its youngest first.
#[test]
fn vtc_preempts_the_tenant_that_has_received_the_most() {
    light_tenant_is_never_preempted(vtc(64, 8));
}

/// Fair and VTC scheduling may preempt a sequence ahead of the one that needs blocks: the step still reaches every
/// sequence after it. Running [A1, A2, B, C] on a full pool, B's decode opens a block, A2 (of the tenant running
/// the most, which has also received the most) is preempted, and C still decodes in that step.
#[test]
fn a_victim_ahead_of_the_sequence_needing_blocks_costs_no_later_sequence_its_step() {
    for config in [fair(64, 4), vtc(64, 4)] {
        let name = config.scheduling.name();
        let reqs = [(prompt(0, 6), "a"), (prompt(1, 6), "a"), (prompt(2, 8), "b"), (prompt(3, 6), "c")];
        let want = reference(&reqs.iter().map(|(p, _)| (p.clone(), 4)).collect::<Vec<_>>());
        // Two blocks per table each: the first step fills the pool exactly, and B's 9th token needs a third.
        let blocks = 8 * GS;
        let mut s = Scheduler::new(SchedulerConfig { reserve: ReserveConfig::off(), ..config }, LAYOUT, blocks);
        let mut m = FakeModel::new(blocks);
        let mut out = Outcome::default();
        let ids: Vec<SeqId> = reqs.iter().map(|(p, t)| s.add(of_tenant(p.clone(), 4, t)).unwrap()).collect();
        assert_eq!(step(&mut s, &mut m, &mut out).seqs.len(), 4, "{name}: all four start together");
        assert_eq!(s.pool().num_available(), 0, "{name}");
        let plan = step(&mut s, &mut m, &mut out);
        assert_eq!(plan.preempted, [ids[1]], "{name}");
        let decoded: Vec<SeqId> = plan.seqs.iter().map(|e| e.seq).collect();
        assert_eq!(decoded, [ids[0], ids[2], ids[3]], "{name}: C decodes after B's preemption of A2");
        while s.has_work() {
            assert!(out.steps < 1_000, "{name}: no progress");
            step(&mut s, &mut m, &mut out);
        }
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(out.tokens[id], want[i], "{name}: request {i}");
        }
        assert_eq!(s.pool().num_used(), 0, "{name}");
        s.pool().check_invariants().unwrap();
    }
}

#[test]
fn an_exact_growth_reserve_admits_only_what_can_finish_so_nothing_is_preempted() {
    let reqs: Vec<(Vec<u32>, usize)> = (0..6).map(|i| (prompt(i, 10 + 3 * i as usize), 30)).collect();
    let want = reference(&reqs);
    let blocks = 16 * GS;
    let run = |reserve: ReserveConfig| {
        let mut s = Scheduler::new(SchedulerConfig { reserve, ..cfg(64, 8) }, LAYOUT, blocks);
        let mut m = FakeModel::new(blocks);
        let ids: Vec<SeqId> = reqs.iter().map(|(p, n)| s.add(req(p.clone(), *n)).unwrap()).collect();
        let out = run_to_end(&mut s, &mut m, 5_000);
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(out.tokens[id], want[i], "request {i}");
        }
        s.pool().check_invariants().unwrap();
        (s.stats().preemptions_total, s.stats().computed_tokens_total)
    };
    // Every sequence decodes its whole max_tokens here, so a ratio of 1 is the exact worst case.
    let exact = ReserveConfig { init_ratio: 1.0, min_ratio: 1.0, decay_per_step: 0.0, clip_tokens: 4096 };
    let (greedy_preempt, greedy_work) = run(ReserveConfig::off());
    let (reserved_preempt, reserved_work) = run(exact);
    assert!(greedy_preempt > 0, "the tiny pool preempts greedy admission");
    assert_eq!(reserved_preempt, 0, "the exact reserve never admits into room a runner will need");
    assert!(reserved_work < greedy_work, "no prompt is recomputed: {reserved_work} vs {greedy_work} tokens");
    // The default (SGLang's decaying estimate) sits in between and still finishes everything correctly.
    let (default_preempt, _) = run(ReserveConfig::default());
    assert!(default_preempt <= greedy_preempt, "{default_preempt} > {greedy_preempt}");
}

#[test]
fn no_deadlock_under_a_tiny_pool_random_workloads() {
    let mut rng = StdRng::seed_from_u64(99);
    for round in 0..30 {
        let groups = rng.random_range(4..12usize);
        let blocks = groups * GS;
        let budget = rng.random_range(1..40usize);
        let mut s = Scheduler::new(cfg(budget, rng.random_range(1..10)), LAYOUT, blocks);
        let mut m = FakeModel::new(blocks);
        let mut reqs = Vec::new();
        for i in 0..rng.random_range(1..12u32) {
            let cap = groups * LAYOUT.block_size;
            let len = rng.random_range(1..cap);
            let max_tokens = rng.random_range(1..=cap - len);
            let p = prompt(round * 100 + i, len);
            s.add(req(p.clone(), max_tokens)).unwrap();
            reqs.push((p, max_tokens));
        }
        let out = run_to_end(&mut s, &mut m, 20_000);
        assert_eq!(out.finished.len(), reqs.len());
        // Outputs are the unpressured ones (ids are 1.. in order).
        let want = reference(&reqs);
        for (i, w) in want.iter().enumerate() {
            assert_eq!(&out.tokens[&(i as u64 + 1)], w, "round {round} request {i}");
        }
        assert_eq!(s.pool().num_used(), 0);
        s.pool().check_invariants().unwrap();
    }
}

#[test]
fn a_request_that_can_never_fit_is_refused_at_submit() {
    let mut s: Scheduler<()> = Scheduler::new(cfg(64, 8), LAYOUT, 10 * GS);
    // 10 groups = 40 tokens.
    assert!(s.add(req(prompt(0, 20), 20)).is_ok());
    assert!(matches!(s.add(req(prompt(0, 20), 21)), Err(SchedError::TooLargeForPool { .. })));
    assert!(matches!(s.add(req(Vec::new(), 1)), Err(SchedError::EmptyPrompt)));
    assert!(matches!(s.add(req(prompt(0, 3), 0)), Err(SchedError::ZeroMaxTokens)));
    assert!(matches!(s.add(req(prompt(0, 1000), 1)), Err(SchedError::PromptTooLong { .. })));
    // max_tokens beyond the context is capped by the context, not refused.
    let mut big: Scheduler<()> = Scheduler::new(cfg(64, 8), LAYOUT, 1000 * GS);
    assert!(big.add(req(prompt(0, 10), 1_000_000)).is_ok());
}

#[test]
fn stops_at_context_length_and_stop_tokens() {
    let mut c = cfg(64, 8);
    c.max_model_len = 20;
    let mut s = Scheduler::new(c, LAYOUT, 100 * GS);
    let mut m = FakeModel::new(100 * GS);
    let id = s.add(req(prompt(5, 15), 100)).unwrap();
    let out = run_to_end(&mut s, &mut m, 100);
    assert_eq!(out.tokens[&id].len(), 5);
    assert_eq!(out.finished[&id], FinishReason::Length);
    // Stop on the first token the fake model produces.
    let first = reference(&[(prompt(6, 9), 5)])[0][0];
    let mut s = Scheduler::new(cfg(64, 8), LAYOUT, 100 * GS);
    let mut r = req(prompt(6, 9), 5);
    r.stop_token_ids = vec![first];
    let id = s.add(r).unwrap();
    let out = run_to_end(&mut s, &mut m, 100);
    assert_eq!(out.tokens[&id], vec![first]);
    assert_eq!(out.finished[&id], FinishReason::Stop);
}

#[test]
fn cancellation_frees_blocks() {
    let mut s = Scheduler::new(cfg(20, 2), LAYOUT, 100 * GS);
    let mut m = FakeModel::new(100 * GS);
    let mut out = Outcome::default();
    let a = s.add(req(prompt(1, 30), 10)).unwrap();
    let b = s.add(req(prompt(2, 30), 10)).unwrap();
    let c = s.add(req(prompt(3, 30), 10)).unwrap();
    step(&mut s, &mut m, &mut out); // a: 20
    step(&mut s, &mut m, &mut out); // a: 10 (prefill done), b: 10
    assert_eq!(s.get(b).unwrap().num_computed(), 10);
    assert_eq!(s.stats().waiting, 1);
    // b is mid-prefill, c is waiting.
    assert!(s.cancel(b).is_some());
    assert!(s.cancel(c).is_some());
    assert!(s.cancel(c).is_none());
    assert_eq!((s.stats().running, s.stats().waiting), (1, 0));
    let held_a = s.get(a).unwrap().blocks().num_blocks();
    assert_eq!(s.pool().num_used(), held_a);
    s.cancel(a);
    assert_eq!(s.pool().num_used(), 0);
    assert!(!s.has_work());
    s.pool().check_invariants().unwrap();
}

#[test]
fn prefix_hit_skips_matched_tokens() {
    let mut s = Scheduler::new(cfg(512, 8), LAYOUT, 100 * GS);
    let mut m = FakeModel::new(100 * GS);
    let p = prompt(4, 22); // 5 full blocks + 2
    let a = s.add(req(p.clone(), 3)).unwrap();
    let out_a = run_to_end(&mut s, &mut m, 100);
    let computed_a = s.stats().computed_tokens_total;
    assert_eq!(computed_a, 22 + 2);
    let b = s.add(req(p.clone(), 3)).unwrap();
    let out_b = run_to_end(&mut s, &mut m, 100);
    // 5 blocks = 20 tokens adopted; 2 prompt tokens + 2 decodes computed.
    assert_eq!(s.stats().computed_tokens_total - computed_a, 4);
    assert_eq!(s.stats().cached_tokens_total, 20);
    assert_eq!(out_a.tokens[&a], out_b.tokens[&b]);
    // Another namespace gets nothing.
    let mut r = req(p, 3);
    r.namespace = "other".into();
    s.add(r).unwrap();
    run_to_end(&mut s, &mut m, 100);
    assert_eq!(s.stats().cached_tokens_total, 20);
}

#[test]
fn a_preloaded_pruned_copy_is_owned_admitted_past_the_context_and_freed() {
    let mut s = Scheduler::new(cfg(512, 8), LAYOUT, 100 * GS);
    assert!(!s.preload_front(&[], &[], 1, 4), "nothing is waiting");
    assert_eq!(s.preload_chunk_blocks(4, 512), None, "nothing is waiting");
    let id = s.add(req(prompt(5, 30), 3)).unwrap();
    assert_eq!(s.admission_budget_left(), 512, "nothing runs");
    // A copy up to token 24 leaves a 6-token chunk: at least one more block per table (the copy's last block may
    // take the first slots), none when one token is left.
    assert_eq!(s.preload_chunk_blocks(24, s.admission_budget_left()), Some(GS));
    assert_eq!(s.preload_chunk_blocks(29, 512), Some(0));
    assert_eq!(s.preload_chunk_blocks(30, 512), None, "nothing left to compute");
    // A pruned copy of the first 24 tokens (6 blocks of 4) keeping 3 slots per table: one packed group.
    let mut packed = Vec::new();
    s.pool_mut().allocate(GS, &mut packed).unwrap();
    assert!(!s.preload_front(&[], &packed, 3, 30), "a copy must leave a prompt token to compute");
    assert!(s.preload_front(&[], &packed, 3, 24));
    assert_eq!(s.get(id).unwrap().lens(), [3; GS]);
    let plan = s.schedule();
    assert_eq!((plan.seqs.len(), plan.seqs[0].start, plan.seqs[0].n), (1, 24, 6), "admitted at the context's end");
    let seq = s.get(id).unwrap();
    assert_eq!(seq.cached_tokens(), 24);
    let first: Vec<u32> = seq.tables().iter().map(|t| t[0]).collect();
    assert_eq!(first, packed, "block t of the packed group leads table t");
    s.cancel(id);
    assert_eq!(s.pool().num_used(), 0, "the copy's blocks went back with the sequence");
    s.pool().check_invariants().unwrap();
}

/// A pruned copy preloaded for the front of the queue lasts one scheduling: when that scheduling does not admit
/// the sequence (here a running prefill takes the whole step budget), the copy's blocks go back to the pool at
/// once, since admission counts only running sequences' blocks, and the sequence is later admitted and served
/// from scratch like any other.
#[test]
fn a_preloaded_copy_the_step_does_not_admit_goes_back_to_the_pool() {
    let reqs = [(prompt(6, 40), 3), (prompt(5, 30), 3)];
    let want = reference(&reqs);
    let mut s = Scheduler::new(cfg(8, 8), LAYOUT, 100 * GS);
    let mut m = FakeModel::new(100 * GS);
    let mut out = Outcome::default();
    let long = s.add(req(reqs[0].0.clone(), reqs[0].1)).unwrap();
    step(&mut s, &mut m, &mut out);
    let late = s.add(req(reqs[1].0.clone(), reqs[1].1)).unwrap();
    // The running prefill has 32 tokens left and the step 8: the engine is told not to decode a copy now.
    assert_eq!(s.admission_budget_left(), 0);
    assert_eq!(s.preload_chunk_blocks(24, s.admission_budget_left()), None);
    let mut packed = Vec::new();
    s.pool_mut().allocate(GS, &mut packed).unwrap();
    assert!(s.preload_front(&[], &packed, 3, 24));
    let plan = step(&mut s, &mut m, &mut out);
    let scheduled: Vec<SeqId> = plan.seqs.iter().map(|e| e.seq).collect();
    assert_eq!(scheduled, [long], "the running prefill takes the budget");
    assert!(s.get(late).unwrap().blocks().is_empty(), "the waiting sequence holds no blocks");
    let held = s.get(long).unwrap().blocks().num_blocks();
    assert_eq!(s.pool().num_used(), held, "the pool holds only the running sequence's blocks");
    s.pool().check_invariants().unwrap();
    while s.has_work() {
        assert!(out.steps < 1_000, "no progress");
        step(&mut s, &mut m, &mut out);
    }
    assert_eq!(out.tokens[&long], want[0]);
    assert_eq!(out.tokens[&late], want[1], "served from a recomputed prompt");
    assert_eq!(s.stats().cached_tokens_total, 0, "nothing was served from the dropped copy");
    assert_eq!(s.pool().num_used(), 0);
    s.pool().check_invariants().unwrap();
}

/// N-gram speculation on: `k` draft tokens, suffixes of 2–3 tokens, at most `max_batch` running.
fn speculating(max_step_tokens: usize, max_running: usize, k: usize, max_batch: usize) -> SchedulerConfig {
    SchedulerConfig {
        speculative: NgramConfig { num_tokens: k, min_n: 2, max_n: 3, max_batch, draft_cost: None },
        ..cfg(max_step_tokens, max_running)
    }
}

/// Prompts that count on modulo 7 from different points with `max_tokens` from 1 to 60, and one that does not
/// repeat.
fn cycling_requests() -> Vec<(Vec<u32>, usize)> {
    let mut reqs: Vec<(Vec<u32>, usize)> = [1, 2, 5, 30, 60]
        .iter()
        .enumerate()
        .map(|(s, &n)| ((0..12 + 3 * s as u32).map(|i| (s as u32 + i) % 7).collect(), n))
        .collect();
    reqs.push((prompt(9, 13), 40));
    reqs
}

/// Runs `reqs` (prompt, max_tokens, stop ids) to the end, all queued at once, on a scheduler with `config` and
/// `blocks` block groups over the cycling model.
/// What [`run_cycling`] leaves: each request's tokens and finish reason, the stats, the steps taken, and the
/// (idle) scheduler with its model.
struct CyclingRun {
    results: Vec<(Vec<u32>, FinishReason)>,
    stats: SchedStats,
    steps: usize,
    sched: Scheduler<()>,
    model: FakeModel,
}

fn run_cycling(config: SchedulerConfig, blocks: usize, reqs: &[(Vec<u32>, usize, Vec<u32>)]) -> CyclingRun {
    let mut s = Scheduler::new(config, LAYOUT, blocks * GS);
    let mut m = FakeModel::cycling(blocks * GS, 7);
    let ids: Vec<SeqId> = reqs
        .iter()
        .map(|(p, n, stops)| s.add(SeqRequest { stop_token_ids: stops.clone(), ..req(p.clone(), *n) }).unwrap())
        .collect();
    let out = run_to_end(&mut s, &mut m, 10_000);
    let results = ids.iter().map(|id| (out.tokens[id].clone(), out.finished[id])).collect();
    CyclingRun { results, stats: s.stats(), steps: out.steps, sched: s, model: m }
}

/// VTC charges every generated token, the accepted speculative ones included, and every prompt once: after a run
/// with drafts the tenant's counter is exactly prompt tokens + 2 x generated tokens.
#[test]
fn vtc_charges_accepted_draft_tokens_like_sampled_ones() {
    let reqs: Vec<(Vec<u32>, usize, Vec<u32>)> =
        cycling_requests().into_iter().map(|(p, n)| (p, n, Vec::new())).collect();
    let config = SchedulerConfig { scheduling: SchedulingPolicy::Vtc, ..speculating(64, 8, 4, 8) };
    let CyclingRun { results, stats, sched: s, .. } = run_cycling(config, 200, &reqs);
    assert!(stats.accepted_draft_tokens_total > 0, "{stats:?}");
    let prompts: usize = reqs.iter().map(|(p, _, _)| p.len()).sum();
    let generated: usize = results.iter().map(|(tokens, _)| tokens.len()).sum();
    let served = s.vtc_counter(pagoda_worker::scheduler::tenant_of(""));
    assert_eq!(served, (prompts + 2 * generated) as f64, "{prompts} prompt and {generated} generated tokens");
}

/// Drafts change no answer (the stand-in model reads every computed position's KV back through the tables, so a
/// rejected draft left in the cache would show), stay within `max_tokens`, are accepted where the text repeats,
/// save steps, and leave no block behind.
#[test]
fn speculative_drafts_change_no_output_and_save_steps() {
    let reqs: Vec<(Vec<u32>, usize, Vec<u32>)> =
        cycling_requests().into_iter().map(|(p, n)| (p, n, Vec::new())).collect();
    let CyclingRun { results: want, stats: plain, steps: plain_steps, .. } = run_cycling(cfg(64, 8), 200, &reqs);
    assert_eq!((plain.draft_tokens_total, plain.accepted_draft_tokens_total), (0, 0));
    for k in [1, 4, 7] {
        let CyclingRun { results: got, stats, steps, sched: s, .. } = run_cycling(speculating(64, 8, k, 8), 200, &reqs);
        assert_eq!(got, want, "k = {k}");
        for ((tokens, _), (_, n, _)) in got.iter().zip(&reqs) {
            assert_eq!(tokens.len(), *n);
        }
        assert!(stats.accepted_draft_tokens_total > 0, "k = {k}: {stats:?}");
        assert!(stats.draft_tokens_total > stats.accepted_draft_tokens_total, "the model breaks every fifth position");
        assert!(steps < plain_steps, "k = {k}: {steps} steps against {plain_steps}");
        assert_eq!(s.pool().num_used(), 0);
    }
}

/// A stop token inside a draft ends the answer there, as it would without speculation.
#[test]
fn a_stop_token_inside_a_draft_ends_the_answer() {
    let p: Vec<u32> = (0..14).map(|i| i % 7).collect();
    let want = run_cycling(cfg(64, 8), 100, &[(p.clone(), 30, vec![])]).results;
    // The tenth token: drafts cover it once the cycle has been seen.
    let stop = want[0].0[9];
    let first = want[0].0.iter().position(|&t| t == stop).unwrap();
    let reqs = [(p, 30, vec![stop])];
    let plain = run_cycling(cfg(64, 8), 100, &reqs).results;
    let CyclingRun { results: got, stats, .. } = run_cycling(speculating(64, 8, 6, 8), 100, &reqs);
    assert_eq!(got, plain);
    assert_eq!(got[0].0.len(), first + 1);
    assert_eq!(got[0].1, FinishReason::Stop);
    assert!(stats.accepted_draft_tokens_total > 0);
}

/// The prefix cache holds only verified tokens: a second request whose prompt is the first one's prompt and
/// answer adopts the groups the speculative steps registered, and the stand-in model reads them back as exactly
/// its prompt's tokens.
#[test]
fn drafts_register_only_accepted_tokens_in_the_prefix_cache() {
    let p: Vec<u32> = (0..12).map(|i| (i * 2) % 7).collect();
    let CyclingRun { results: first, sched: mut s, model: mut m, .. } =
        run_cycling(speculating(64, 8, 5, 8), 100, &[(p.clone(), 41, vec![])]);
    let answer = &first[0].0;
    let mut longer = p.clone();
    longer.extend_from_slice(&answer[..33]);
    let cached_before = s.stats().cached_tokens_total;
    let id = s.add(req(longer.clone(), 8)).unwrap();
    let out = run_to_end(&mut s, &mut m, 1000);
    let adopted = s.stats().cached_tokens_total - cached_before;
    assert!(adopted as usize >= (longer.len() - 1) / 4 * 4 - 4, "adopted {adopted} of {}", longer.len());
    assert_eq!(out.tokens[&id], answer[33..41], "a continuation over adopted groups");
}

/// Preempting a sequence with a draft in its step drops the draft: it resumes with only its verified tokens.
#[test]
fn preemption_under_a_tiny_pool_keeps_speculative_answers() {
    let reqs: Vec<(Vec<u32>, usize, Vec<u32>)> =
        (0..6u32).map(|s| ((0..10 + s).map(|i| (s + i) % 7).collect(), 40, Vec::new())).collect();
    let want = run_cycling(cfg(64, 8), 400, &reqs).results;
    let tiny = SchedulerConfig { reserve: ReserveConfig::off(), ..speculating(64, 8, 4, 8) };
    let CyclingRun { results: got, stats, sched: s, .. } = run_cycling(tiny, 30, &reqs);
    assert_eq!(got, want);
    assert!(stats.preemptions_total > 0, "the pool must be small enough to preempt: {stats:?}");
    assert!(stats.accepted_draft_tokens_total > 0);
    assert_eq!(s.pool().num_used(), 0);
}

/// No drafts while more sequences run than the limit allows, nor for a sequence under an eviction policy.
#[test]
fn no_drafts_above_the_batch_limit_or_under_an_eviction_policy() {
    let p: Vec<u32> = (0..20).map(|i| i % 7).collect();
    let mut s = Scheduler::new(speculating(64, 8, 4, 1), LAYOUT, 100 * GS);
    let mut m = FakeModel::cycling(100 * GS, 7);
    let mut out = Outcome::default();
    s.add(req(p.clone(), 12)).unwrap();
    s.add(req(p.clone(), 20)).unwrap();
    while s.has_work() {
        let plan = step(&mut s, &mut m, &mut out);
        if plan.seqs.len() > 1 {
            assert!(plan.seqs.iter().all(|e| e.draft == 0), "{plan:?}");
        }
    }
    assert!(s.stats().accepted_draft_tokens_total > 0, "the second one speculates once it runs alone");

    let mut s = Scheduler::new(speculating(64, 8, 4, 8), LAYOUT, 100 * GS);
    let streaming = PolicySpec::parse(Some("streaming"), Some(16), PolicySpec::full(), 1000).unwrap();
    s.add(SeqRequest { policy: streaming, ..req(p, 20) }).unwrap();
    run_to_end(&mut s, &mut m, 1000);
    assert_eq!(s.stats().draft_tokens_total, 0);
}

/// A decoding sequence preempted in the step that gave it a draft (a longer prefill behind it needs its blocks)
/// drops the draft: it resumes with only its verified tokens.
#[test]
fn a_sequence_preempted_with_a_draft_resumes_without_it() {
    // The long prompt prefills in KeyDiff's 128-token blocks, so the short one is admitted beside it, decodes,
    // and is the youngest when the next block finds the pool short.
    let keydiff = PolicySpec::parse(Some("keydiff"), Some(16), PolicySpec::full(), 1000).unwrap();
    let long = SeqRequest { policy: keydiff, ..req(prompt(3, 200), 4) };
    let short: Vec<u32> = (0..14).map(|i| i % 7).collect();
    let run = |config: SchedulerConfig, groups: usize| {
        let mut s = Scheduler::new(config, LAYOUT, groups * GS);
        let mut m = FakeModel::cycling(groups * GS, 7);
        let a = s.add(SeqRequest { policy: long.policy, ..req(long.prompt.clone(), 4) }).unwrap();
        let b = s.add(req(short.clone(), 20)).unwrap();
        let out = run_to_end(&mut s, &mut m, 1000);
        ([out.tokens[&a].clone(), out.tokens[&b].clone()], s.stats())
    };
    let (want, _) = run(cfg(160, 8), 400);
    let tight = SchedulerConfig { reserve: ReserveConfig::off(), ..speculating(160, 8, 4, 8) };
    let (got, stats) = run(tight, 52);
    assert!(stats.preemptions_total > 0, "{stats:?}");
    assert_eq!(got, want);
}
