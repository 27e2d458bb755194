//! The runner of `pagoda eval`: drives the real model through the scheduler and the eviction policies, inline on
//! the calling thread, and scores every policy × budget against the full cache on the same items.
//!
//! - **Synthetic tasks** ([`super::tasks`]): greedy generation, scored by RULER's string match.
//! - **Prose** ([`super::prose`]): teacher forcing over a continuation; per position, top-1 agreement with the
//!   full cache's next-token distribution and KL(full ‖ policy) (task `prose`, fidelity to the full cache), and
//!   top-1 accuracy on the real next token with its negative log-likelihood (task `prose_next_token`, the
//!   language-modelling score, which the full cache has too).
//!
//! Each item runs in two phases. First the full cache alone computes it, which publishes the prompt's blocks in
//! the prefix cache. Then every (policy, budget) lane runs together in one batch: lanes adopt the cached prompt
//! wherever their policy allows (all but H2O, which observes every prompt query, and KeyDiff, whose block prompt
//! processing changes the cache from the first block), so a sweep pays for one prefill per item instead of one
//! per lane, and decode steps are batched.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::engine::{EngineConfig, EngineError, LlamaRunner, ModelRunner, StepSeq, forward_step};
use crate::model::{ChatTemplate, Gguf, Tokenizer};
use crate::policy::{PolicyKind, PolicySpec};
use crate::sampling::argmax;
use crate::scheduler::{ReserveConfig, Scheduler, SchedulerConfig, SeqId, SeqRequest};

use super::{Document, EvalItem, TaskKind};

/// Task name of the prose fidelity score: top-1 agreement with, and KL from, the full cache.
pub const PROSE: &str = "prose";
/// Task name of the prose language-modelling score: top-1 accuracy on, and NLL of, the real next token.
pub const PROSE_NEXT_TOKEN: &str = "prose_next_token";

/// What to evaluate.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalOptions {
    pub threads: usize,
    pub policies: Vec<PolicyKind>,
    pub budgets: Vec<usize>,
    pub tasks: Vec<TaskKind>,
    /// Context sizes (tokens) of the synthetic items.
    pub contexts: Vec<usize>,
    pub items_per_task: usize,
    pub seed: u64,
    /// Prose documents to score (0 = none).
    pub prose_docs: usize,
    /// Context tokens before the scored continuation.
    pub prose_context: usize,
    /// Continuation tokens scored by teacher forcing.
    pub prose_continuation: usize,
    /// Upper bound on the KV pool (bytes); past it the scheduler preempts and recomputes.
    pub pool_bytes: usize,
}

impl Default for EvalOptions {
    fn default() -> EvalOptions {
        EvalOptions {
            threads: 0,
            policies: PolicyKind::ALL.into_iter().filter(|k| *k != PolicyKind::Full).collect(),
            budgets: vec![128, 256, 512, 1024, 2048],
            tasks: TaskKind::ALL.to_vec(),
            contexts: vec![1024, 2048, 4096, 6144],
            items_per_task: 2,
            seed: 7,
            prose_docs: 4,
            prose_context: 2048,
            prose_continuation: 64,
            pool_bytes: 4 << 30,
        }
    }
}

/// One lane's result on one item.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ItemResult {
    /// Which item (task, context and seed, or the prose document): lanes of one item share it.
    pub item: String,
    /// `passkey`, … or `prose`.
    pub task: String,
    pub context_tokens: usize,
    pub policy: String,
    /// 0 for the full cache.
    pub budget: usize,
    /// Synthetic tasks: string-match score in [0, 1]. `prose`: top-1 agreement with the full cache.
    /// `prose_next_token`: top-1 accuracy on the document's real next token.
    pub score: f64,
    /// `prose` only: mean KL(full ‖ policy) over the continuation, in nats.
    pub kl: Option<f64>,
    /// `prose_next_token` only: mean negative log-likelihood of the real next token, in nats.
    #[serde(default)]
    pub nll: Option<f64>,
    /// The generated text (synthetic tasks).
    pub output: Option<String>,
}

/// A policy × budget cell, averaged over items, next to the full cache on the same items.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cell {
    pub task: String,
    pub policy: String,
    pub budget: usize,
    pub items: usize,
    pub score: f64,
    /// Standard error of `score`, the mean over `items` (0 for a single item). Reports written before it read 0.
    #[serde(default)]
    pub score_se: f64,
    pub full_score: f64,
    pub kl: Option<f64>,
    #[serde(default)]
    pub nll: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalReport {
    pub options: EvalOptions,
    pub items: Vec<ItemResult>,
    pub cells: Vec<Cell>,
    pub seconds: f64,
}

enum Mode {
    /// Greedy generation up to `max_new` tokens or EOS.
    Generate { max_new: usize, out: Vec<u32> },
    /// Teacher forcing over `cont`: each position is scored against the reference (`agree`, `kl`) and against the
    /// real next token, `cont[next]` (`correct`, `nll`).
    Force { cont: Vec<u32>, next: usize, agree: usize, kl: f64, correct: usize, nll: f64 },
}

struct Lane {
    spec: PolicySpec,
    seq: SeqId,
    mode: Mode,
}

/// The inline model driver: a scheduler and the runner, one step at a time.
pub struct Evaluator {
    runner: LlamaRunner,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    sched_cfg: SchedulerConfig,
    num_blocks: usize,
    eos: Vec<u32>,
    logits: Vec<f32>,
    batch: Vec<StepSeq<'static>>,
    /// Log-softmax rows of the full cache's forced continuation (reference for prose).
    reference: Vec<f32>,
    logp: Vec<f32>,
}

impl Evaluator {
    pub fn load(model_path: &std::path::Path, opts: &EvalOptions) -> Result<Evaluator, EngineError> {
        let gguf = Gguf::open(model_path).map_err(|e| EngineError::Model(e.to_string()))?;
        let tokenizer = Tokenizer::from_gguf(&gguf).map_err(|e| EngineError::Model(e.to_string()))?;
        let template = ChatTemplate::from_gguf(&gguf).map_err(|e| EngineError::Model(e.to_string()))?;
        let probe = LlamaRunner::load(&EngineConfig {
            model_path: model_path.to_path_buf(),
            num_blocks: 90,
            threads: 1,
            ..EngineConfig::default()
        })?;
        let info = probe.info().clone();
        drop(probe);
        let block_bytes = info.block_size * info.head_dim * 4 * 2;
        let num_blocks = (opts.pool_bytes / block_bytes.max(1)).max(info.layout().group_size() * 16);
        let runner = LlamaRunner::load(&EngineConfig {
            model_path: model_path.to_path_buf(),
            num_blocks,
            threads: opts.threads,
            enable_prefix_cache: true,
            ..EngineConfig::default()
        })?;
        let sched_cfg = SchedulerConfig {
            max_step_tokens: 512,
            max_running: 256,
            enable_prefix_cache: true,
            max_model_len: info.context_length,
            model_id: info.model_id.clone(),
            attn: info.attn_dims(),
            // Every item is admitted at once: the pool is sized for them (quality, not admission, is measured).
            reserve: ReserveConfig::off(),
            speculative: crate::speculative::NgramConfig::off(),
            scheduling: crate::scheduler::SchedulingPolicy::Fcfs,
        };
        Ok(Evaluator {
            eos: info.eos_token_ids.clone(),
            runner,
            tokenizer,
            template,
            sched_cfg,
            num_blocks,
            logits: Vec::new(),
            batch: Vec::new(),
            reference: Vec::new(),
            logp: Vec::new(),
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat prompt for a user message, tokenized.
    pub fn chat_tokens(&self, user: &str) -> Result<Vec<u32>, EngineError> {
        super::chat_tokens(&self.template, &self.tokenizer, user)
    }

    fn lanes_for(opts: &EvalOptions, context: usize) -> Vec<PolicySpec> {
        let mut specs = vec![PolicySpec::full()];
        for &kind in &opts.policies {
            for &b in &opts.budgets {
                // A budget at or above the context evicts nothing: it equals the full cache.
                if b < context {
                    specs.push(PolicySpec { kind, budget_tokens: b });
                }
            }
        }
        specs
    }

    /// Runs one synthetic item under the full cache, then under every lane; returns one result per lane.
    pub fn run_item(&mut self, item: &EvalItem, opts: &EvalOptions) -> Result<Vec<ItemResult>, EngineError> {
        let prompt = self.chat_tokens(&item.prompt)?;
        let specs = Self::lanes_for(opts, prompt.len());
        let mut sched = self.scheduler();
        let mut results = Vec::with_capacity(specs.len());
        for phase in [&specs[..1], &specs[1..]] {
            let mut lanes = Vec::with_capacity(phase.len());
            for &spec in phase {
                let seq = sched.add(SeqRequest {
                    prompt: prompt.clone(),
                    max_tokens: item.max_new_tokens,
                    stop_token_ids: self.eos.clone(),
                    namespace: String::new(),
                    policy: spec,
                    prompt_logits: false,
                    priority: 0,
                    tenant_weight: 1,
                    lora: None,
                    payload: (),
                })?;
                lanes.push(Lane { spec, seq, mode: Mode::Generate { max_new: item.max_new_tokens, out: Vec::new() } });
            }
            self.drive(&mut sched, &mut lanes, false)?;
            for lane in lanes {
                let Mode::Generate { out, .. } = lane.mode else { continue };
                let text = self.tokenizer.decode(&out, true);
                results.push(ItemResult {
                    item: format!("{}/{}/{}", item.task.name(), item.context_tokens, item.seed),
                    task: item.task.name().to_owned(),
                    context_tokens: item.context_tokens,
                    policy: lane.spec.kind.name().to_owned(),
                    budget: lane.spec.budget_tokens,
                    score: f64::from(super::score(item, &text)),
                    kl: None,
                    nll: None,
                    output: Some(text),
                });
            }
        }
        Ok(results)
    }

    /// Teacher-forced scoring of one document: its first `context` tokens as the prompt, the next
    /// `continuation` tokens forced.
    pub fn run_prose(&mut self, doc: &Document, opts: &EvalOptions) -> Result<Vec<ItemResult>, EngineError> {
        let ids = self.tokenizer.encode(&doc.text, false);
        if ids.len() < opts.prose_context + opts.prose_continuation {
            return Err(EngineError::InvalidRequest(format!(
                "document {} has {} tokens, fewer than context + continuation",
                doc.name,
                ids.len()
            )));
        }
        let prompt = ids[..opts.prose_context].to_vec();
        let cont = ids[opts.prose_context..opts.prose_context + opts.prose_continuation].to_vec();
        let specs = Self::lanes_for(opts, prompt.len());
        let mut sched = self.scheduler();
        let mut results = Vec::with_capacity(specs.len());
        for (pi, phase) in [&specs[..1], &specs[1..]].into_iter().enumerate() {
            let mut lanes = Vec::with_capacity(phase.len());
            for &spec in phase {
                let seq = sched.add(SeqRequest {
                    prompt: prompt.clone(),
                    max_tokens: cont.len(),
                    stop_token_ids: Vec::new(),
                    namespace: String::new(),
                    policy: spec,
                    prompt_logits: false,
                    priority: 0,
                    tenant_weight: 1,
                    lora: None,
                    payload: (),
                })?;
                let mode = Mode::Force { cont: cont.clone(), next: 0, agree: 0, kl: 0.0, correct: 0, nll: 0.0 };
                lanes.push(Lane { spec, seq, mode });
            }
            self.drive(&mut sched, &mut lanes, pi == 0)?;
            for lane in lanes {
                let Mode::Force { agree, kl, cont, correct, nll, .. } = lane.mode else { continue };
                let n = cont.len().max(1) as f64;
                // The full cache is the reference: it agrees with itself everywhere.
                let (agree, kl) = if lane.spec.is_full() { (cont.len(), 0.0) } else { (agree, kl) };
                let result = |task: &str, score: f64, kl: Option<f64>, nll: Option<f64>| ItemResult {
                    item: doc.name.clone(),
                    task: task.into(),
                    context_tokens: prompt.len(),
                    policy: lane.spec.kind.name().to_owned(),
                    budget: lane.spec.budget_tokens,
                    score,
                    kl,
                    nll,
                    output: None,
                };
                results.push(result(PROSE, agree as f64 / n, Some(kl / n), None));
                results.push(result(PROSE_NEXT_TOKEN, correct as f64 / n, None, Some(nll / n)));
            }
        }
        Ok(results)
    }

    fn scheduler(&self) -> Scheduler<()> {
        Scheduler::new(self.sched_cfg.clone(), self.runner.info().layout(), self.num_blocks)
    }

    /// Runs the lanes to completion. `record_reference`: this is the full-cache pass of a forced item, whose
    /// log-probabilities become the reference the later lanes are scored against.
    fn drive(
        &mut self,
        sched: &mut Scheduler<()>,
        lanes: &mut [Lane],
        record_reference: bool,
    ) -> Result<(), EngineError> {
        let vocab = self.runner.info().vocab_size;
        let index: HashMap<SeqId, usize> = lanes.iter().enumerate().map(|(i, l)| (l.seq, i)).collect();
        if record_reference {
            self.reference.clear();
        }
        while sched.has_work() {
            let plan = sched.schedule();
            if plan.is_empty() {
                return Err(EngineError::Forward("the eval batch does not fit the KV pool".into()));
            }
            forward_step(sched, &mut self.runner, &plan, &mut self.batch, &mut self.logits, None)?;
            for (row, e) in plan.seqs.iter().filter(|e| e.wants_logits).enumerate() {
                let logits = &self.logits[row * vocab..(row + 1) * vocab];
                let Some(&li) = index.get(&e.seq) else { continue };
                let lane = &mut lanes[li];
                let (token, done) = match &mut lane.mode {
                    Mode::Generate { max_new, out } => {
                        let t = argmax(logits);
                        let stop = self.eos.contains(&t);
                        if !stop {
                            out.push(t);
                        }
                        (t, stop || out.len() >= *max_new)
                    }
                    Mode::Force { cont, next, agree, kl, correct, nll } => {
                        log_softmax(logits, &mut self.logp);
                        let j = *next;
                        // One scan of the vocabulary serves both scores.
                        let top = argmax(&self.logp);
                        let truth = cont[j] as usize;
                        *correct += usize::from(top as usize == truth);
                        *nll -= f64::from(self.logp.get(truth).copied().unwrap_or(f32::NEG_INFINITY));
                        if record_reference {
                            self.reference.extend_from_slice(&self.logp);
                        } else if let Some(r) = self.reference.get(j * vocab..(j + 1) * vocab) {
                            *kl += kl_div(r, &self.logp);
                            *agree += usize::from(argmax(r) == top);
                        }
                        *next += 1;
                        (cont[j], *next >= cont.len())
                    }
                };
                let finished = sched.append_token(e.seq, token).map_err(|err| EngineError::Forward(err.to_string()))?;
                if done || finished.is_some() {
                    sched.finish(e.seq);
                }
            }
        }
        Ok(())
    }
}

/// `out = log softmax(x)`.
fn log_softmax(x: &[f32], out: &mut Vec<f32>) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = x.iter().map(|&v| f64::from((v - max).exp())).sum();
    let lse = max + sum.ln() as f32;
    out.clear();
    out.extend(x.iter().map(|&v| v - lse));
}

/// KL(p ‖ q) from log-probabilities.
fn kl_div(logp: &[f32], logq: &[f32]) -> f64 {
    logp.iter().zip(logq).map(|(&a, &b)| f64::from(a.exp()) * f64::from(a - b)).sum::<f64>().max(0.0)
}

/// Averages item results into cells (task × policy × budget), each next to the full cache on the same items.
pub fn summarize(items: &[ItemResult]) -> Vec<Cell> {
    // (task, item) → the full cache's score on it (a prose document carries two tasks); (task, policy, budget) →
    // the cell's items.
    type CellKey = (String, String, usize);
    let full: HashMap<(&str, &str), f64> =
        items.iter().filter(|r| r.budget == 0).map(|r| ((r.task.as_str(), r.item.as_str()), r.score)).collect();
    let mut groups: Vec<(CellKey, Vec<&ItemResult>)> = Vec::new();
    for r in items {
        let key = (r.task.clone(), r.policy.clone(), r.budget);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(r),
            None => groups.push((key, vec![r])),
        }
    }
    let mut cells = Vec::new();
    for ((task, policy, budget), rs) in groups {
        let n = rs.len() as f64;
        let score = rs.iter().map(|r| r.score).sum::<f64>() / n;
        let score_se = if rs.len() > 1 {
            (rs.iter().map(|r| (r.score - score).powi(2)).sum::<f64>() / (n - 1.0) / n).sqrt()
        } else {
            0.0
        };
        let kl = rs.iter().all(|r| r.kl.is_some()).then(|| rs.iter().filter_map(|r| r.kl).sum::<f64>() / n);
        let nll = rs.iter().all(|r| r.nll.is_some()).then(|| rs.iter().filter_map(|r| r.nll).sum::<f64>() / n);
        // The full-cache score on exactly these items (same task and contexts).
        let full_score = rs.iter().filter_map(|r| full.get(&(r.task.as_str(), r.item.as_str()))).sum::<f64>() / n;
        cells.push(Cell { task, policy, budget, items: rs.len(), score, score_se, full_score, kl, nll });
    }
    cells
}

/// Why reports could not be merged.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MergeError {
    #[error("no report to merge")]
    Empty,
    /// Two reports score the same lane on the same item: pooling them would count it twice.
    #[error("lane {policy}@{budget} on item {item} is in more than one report")]
    Duplicate { item: String, policy: String, budget: usize },
}

/// Pools the items of several reports (runs of the same sweep on different items, such as `--seed` continuing
/// where another run's items stopped) into one report, with every cell recomputed over the pooled items. The
/// options are the first report's, with the budgets, tasks, contexts and policies of all of them and their item
/// counts added up; `seed` stays the first's, so a merged report names its items only through `items`.
pub fn merge(reports: Vec<EvalReport>) -> Result<EvalReport, MergeError> {
    let mut reports = reports.into_iter();
    let mut merged = reports.next().ok_or(MergeError::Empty)?;
    let mut seen: HashSet<(String, String, usize)> = HashSet::new();
    for r in &merged.items {
        seen.insert((r.item.clone(), r.policy.clone(), r.budget));
    }
    for report in reports {
        for r in &report.items {
            if !seen.insert((r.item.clone(), r.policy.clone(), r.budget)) {
                return Err(MergeError::Duplicate { item: r.item.clone(), policy: r.policy.clone(), budget: r.budget });
            }
        }
        let o = &mut merged.options;
        union_into(&mut o.budgets, report.options.budgets);
        o.budgets.sort_unstable();
        union_into(&mut o.tasks, report.options.tasks);
        union_into(&mut o.contexts, report.options.contexts);
        o.contexts.sort_unstable();
        union_into(&mut o.policies, report.options.policies);
        o.items_per_task += report.options.items_per_task;
        merged.items.extend(report.items);
        merged.seconds += report.seconds;
    }
    merged.cells = summarize(&merged.items);
    Ok(merged)
}

/// Appends the values of `more` that `into` lacks, in their order.
fn union_into<T: PartialEq>(into: &mut Vec<T>, more: Vec<T>) {
    for v in more {
        if !into.contains(&v) {
            into.push(v);
        }
    }
}

/// Runs the whole evaluation.
pub fn run(model_path: &std::path::Path, opts: &EvalOptions, prose: &[Document]) -> Result<EvalReport, EngineError> {
    let t0 = Instant::now();
    let mut ev = Evaluator::load(model_path, opts)?;
    let mut items = Vec::new();
    for &ctx in &opts.contexts {
        for &task in &opts.tasks {
            for i in 0..opts.items_per_task {
                let seed = opts.seed.wrapping_add(i as u64 * 7919);
                let tok = ev.tokenizer();
                let item = super::generate(task, seed, ctx, &|s: &str| tok.encode(s, false).len());
                let rs = ev.run_item(&item, opts)?;
                tracing::info!(task = task.name(), ctx, item = i, lanes = rs.len(), "eval item done");
                items.extend(rs);
            }
        }
    }
    for doc in prose.iter().take(opts.prose_docs) {
        let rs = ev.run_prose(doc, opts)?;
        tracing::info!(doc = %doc.name, lanes = rs.len(), "eval prose done");
        items.extend(rs);
    }
    let cells = summarize(&items);
    Ok(EvalReport { options: opts.clone(), items, cells, seconds: t0.elapsed().as_secs_f64() })
}

/// Markdown: one table per task, policies as rows, budgets as columns, each cell `score (full)`.
pub fn render_markdown(report: &EvalReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let mut tasks: Vec<&str> = report.cells.iter().map(|c| c.task.as_str()).collect();
    tasks.dedup();
    tasks.sort();
    tasks.dedup();
    let budgets = &report.options.budgets;
    for task in tasks {
        let metric = match task {
            PROSE => "top-1 agreement with full cache (mean KL nats)",
            PROSE_NEXT_TOKEN => "top-1 accuracy on the real next token (mean NLL nats)",
            _ => "score ± standard error",
        };
        // The full cache runs on every item; a lane whose budget holds an item's whole prompt does not (it would
        // equal the full cache), so a cell of a large budget may count fewer, its `items`.
        let n = report.cells.iter().find(|c| c.task == task && c.policy == "full").map_or(0, |c| c.items);
        let _ = writeln!(s, "\n**{task}** — {metric}; {n} items; full cache on the same items in the first row\n");
        let _ = write!(s, "| policy |");
        for b in budgets {
            let _ = write!(s, " {b} |");
        }
        let _ = write!(s, "\n|---|");
        for _ in budgets {
            let _ = write!(s, "---|");
        }
        s.push('\n');
        let mut policies: Vec<&str> = vec!["full"];
        for c in report.cells.iter().filter(|c| c.task == task && c.policy != "full") {
            if !policies.contains(&c.policy.as_str()) {
                policies.push(&c.policy);
            }
        }
        for p in policies {
            let _ = write!(s, "| {p} |");
            for &b in budgets {
                let cell =
                    report.cells.iter().find(|c| c.task == task && c.policy == p && (c.budget == b || p == "full"));
                match cell {
                    Some(c) => match c.kl.or(c.nll) {
                        Some(x) => {
                            let _ = write!(s, " {:.3} ({x:.3}) |", c.score);
                        }
                        None => {
                            let _ = write!(s, " {:.2} ± {:.2} |", c.score, c.score_se);
                        }
                    },
                    None => s.push_str(" – |"),
                }
            }
            s.push('\n');
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_is_zero_for_equal_and_positive_otherwise() {
        let mut a = Vec::new();
        let mut b = Vec::new();
        log_softmax(&[1.0, 2.0, 3.0], &mut a);
        log_softmax(&[3.0, 2.0, 1.0], &mut b);
        assert!(kl_div(&a, &a).abs() < 1e-9);
        assert!(kl_div(&a, &b) > 0.5);
        let total: f32 = a.iter().map(|x| x.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    /// A passkey lane's result on item `item`.
    fn task_result(item: &str, ctx: usize, policy: &str, budget: usize, score: f64) -> ItemResult {
        let (kl, nll, output) = (None, None, None);
        let (item, task, policy) = (item.into(), "passkey".into(), policy.into());
        ItemResult { item, task, context_tokens: ctx, policy, budget, score, kl, nll, output }
    }

    #[test]
    fn summary_pairs_each_cell_with_full_cache_on_the_same_items() {
        let r = |task: &str, ctx, policy: &str, budget, score| {
            task_result(&format!("{task}/{ctx}"), ctx, policy, budget, score)
        };
        let items = vec![
            r("passkey", 1024, "full", 0, 1.0),
            r("passkey", 1024, "snapkv", 128, 0.0),
            r("passkey", 2048, "full", 0, 0.0),
            r("passkey", 2048, "snapkv", 128, 0.0),
        ];
        let cells = summarize(&items);
        let c = cells.iter().find(|c| c.policy == "snapkv").unwrap();
        assert_eq!((c.items, c.score, c.full_score), (2, 0.0, 0.5));
        // Scores 1 and 0: sample standard deviation √0.5, over √2 items.
        let full = cells.iter().find(|c| c.policy == "full").unwrap();
        assert!((full.score_se - 0.5).abs() < 1e-12, "{}", full.score_se);
        assert_eq!(c.score_se, 0.0);
    }

    #[test]
    fn merged_reports_pool_their_items_and_refuse_a_lane_twice() {
        let r = |seed: u64, policy: &str, budget, score| {
            task_result(&format!("passkey/1000/{seed}"), 1000, policy, budget, score)
        };
        let report = |budgets: Vec<usize>, items: Vec<ItemResult>| EvalReport {
            options: EvalOptions { budgets, items_per_task: 1, ..EvalOptions::default() },
            cells: summarize(&items),
            items,
            seconds: 1.0,
        };
        let a = report(vec![256], vec![r(7, "full", 0, 1.0), r(7, "snapkv", 256, 1.0)]);
        let b = report(vec![128, 256], vec![r(9, "full", 0, 0.0), r(9, "snapkv", 256, 0.0), r(9, "snapkv", 128, 0.0)]);
        let m = merge(vec![a.clone(), b]).unwrap();
        assert_eq!((m.items.len(), m.options.items_per_task, m.options.budgets.clone()), (5, 2, vec![128, 256]));
        let cell = |budget| m.cells.iter().find(|c| c.policy == "snapkv" && c.budget == budget).unwrap();
        assert_eq!((cell(256).items, cell(256).score, cell(256).full_score), (2, 0.5, 0.5));
        assert_eq!((cell(128).items, cell(128).score, cell(128).full_score), (1, 0.0, 0.0));
        let dup = merge(vec![a.clone(), a]).unwrap_err();
        assert_eq!(dup, MergeError::Duplicate { item: "passkey/1000/7".into(), policy: "full".into(), budget: 0 });
        assert_eq!(merge(Vec::new()).unwrap_err(), MergeError::Empty);
    }

    #[test]
    fn a_document_scored_two_ways_keeps_each_full_cache_score() {
        let r = |task: &str, policy: &str, budget, score, nll| ItemResult {
            item: "alice29:0".into(),
            task: task.into(),
            context_tokens: 512,
            policy: policy.into(),
            budget,
            score,
            kl: None,
            nll,
            output: None,
        };
        let items = vec![
            r(PROSE, "full", 0, 1.0, None),
            r(PROSE_NEXT_TOKEN, "full", 0, 0.4, Some(2.5)),
            r(PROSE, "h2o", 128, 0.8, None),
            r(PROSE_NEXT_TOKEN, "h2o", 128, 0.3, Some(3.0)),
        ];
        let cells = summarize(&items);
        let cell = |task| cells.iter().find(|c| c.task == task && c.policy == "h2o").unwrap();
        assert_eq!((cell(PROSE).score, cell(PROSE).full_score, cell(PROSE).nll), (0.8, 1.0, None));
        let lm = cell(PROSE_NEXT_TOKEN);
        assert_eq!((lm.score, lm.full_score, lm.nll), (0.3, 0.4, Some(3.0)));
        let md = render_markdown(&EvalReport {
            options: EvalOptions { budgets: vec![128], ..EvalOptions::default() },
            items,
            cells: cells.clone(),
            seconds: 0.0,
        });
        assert!(md.contains("| h2o | 0.300 (3.000) |"), "{md}");
        assert!(md.contains("| full | 0.400 (2.500) |"), "{md}");
    }
}
