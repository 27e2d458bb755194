//! One generation as the router runs it: place it (hash the prompt's blocks, [`WorkerPool::place`]), open the
//! chosen worker's `Generate` stream, detokenize incrementally, apply stop strings, record latency metrics, and
//! hand text pieces to the HTTP layer.
//!
//! It also owns request migration: when the serving worker fails (the stream errors, resets or ends without
//! finishing) or stalls (no token for [`MigrationConfig::stall_timeout`] and no answer to a health check, or no token
//! for [`MigrationConfig::first_token_timeout`]), the generation is re-issued to another
//! worker as prompt + the tokens produced so far, with `max_tokens` reduced by those and the same sampling
//! settings. The detokenizer and stop matcher carry on over the switch, so the client sees one uninterrupted,
//! duplicate-free stream. At most [`MigrationConfig::max_retries`] re-issues happen; beyond that the client gets a
//! clean error: an HTTP status before the first token, an error event mid-stream.
//!
//! Dropping the receiver (the client went away) or matching a stop string drops the gRPC stream, which cancels the
//! request on the worker and frees its blocks.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pagoda_proto::trace_context;
use pagoda_proto::worker::{
    FinishReason, GenerateRequest, GenerateResponse, LogitBias as PbLogitBias, PeerHint as PbPeerHint, ProfileQuery,
    SamplingParams, TokenLogprobs as PbTokenLogprobs, TokenSequence,
};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::{mpsc, oneshot};
use tonic::Streaming;
use tracing::{Instrument as _, Span};

use crate::codec::TextCodec;
use crate::detok::{StopMatcher, StopOutcome, Utf8Decoder};
use crate::disagg;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::openai::{GenParams, StopReason, Usage};
use crate::placement::{PlacementError, RequestView};
use crate::placer::PlaceRequest;
use crate::spans;
use crate::workers::{Candidate, InFlight, Worker, WorkerPool};

/// What the HTTP layer receives, in order: an `Echo` for a completion with `echo`, any number of `Text`, then
/// exactly one `Done` or `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// The prompt, first, for a completion with `echo`: its text (its tokens' bytes, lossily decoded), its first
    /// token, and (with `logprobs`) the log-probabilities of the tokens after it, which the model scored.
    Echo {
        text: String,
        first_token: u32,
        logprobs: Vec<TokenLogprob>,
    },
    /// Newly released text, with the log-probabilities of the tokens it starts (only when the request asked for
    /// them). Either may be empty, not both.
    Text {
        text: String,
        logprobs: Vec<TokenLogprob>,
        /// Tokens this choice has generated so far (for `continuous_usage_stats`).
        completion_tokens: u32,
    },
    Done {
        finish_reason: &'static str,
        usage: Usage,
        /// The stop string, or the request's own stop token, that ended the text (vLLM's `stop_reason`; a stop
        /// string is Anthropic's `stop_sequence`).
        stop: Option<StopReason>,
    },
    Error(ApiError),
}

/// One generated token's log-probabilities, as the worker reported them (a log-softmax of the model's raw
/// logits), and where its text starts.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens at this position, most likely first.
    pub top: Vec<(u32, f32)>,
    /// Byte offset in the completion's text where this token's text starts. A token whose bytes end inside a
    /// UTF-8 character starts where that character does.
    pub text_offset: u32,
}

impl TokenLogprob {
    /// The worker's entry for `token`, whose text starts at `text_offset`.
    fn from_pb(lp: PbTokenLogprobs, token: u32, text_offset: u32) -> TokenLogprob {
        let top = lp.top_token_ids.into_iter().zip(lp.top_logprobs).collect();
        TokenLogprob { token, logprob: lp.logprob, top, text_offset }
    }
}

/// Ties the tokens' log-probabilities to the text the stop matcher releases: an entry goes out with the first
/// piece of text that reaches past its start, so a token held back with a possible stop string is held with it,
/// and a token wholly inside a matched stop string (whose text is never sent) is never sent either.
#[derive(Debug, Default)]
struct LogprobQueue {
    pending: std::collections::VecDeque<TokenLogprob>,
    /// Bytes the decoder has produced, all attempts together: where the next token's text starts.
    decoded: usize,
    /// Bytes released to the client.
    released: usize,
}

impl LogprobQueue {
    /// The entries whose text starts before `released + len`, after releasing `len` more bytes.
    fn release(&mut self, len: usize) -> Vec<TokenLogprob> {
        self.released += len;
        let n = self.pending.iter().take_while(|e| (e.text_offset as usize) < self.released).count();
        self.pending.drain(..n).collect()
    }

    /// Everything still pending (the stream ended without a stop string: all its text went out).
    fn release_all(&mut self) -> Vec<TokenLogprob> {
        self.pending.drain(..).collect()
    }
}

/// A validated, tokenized request.
pub struct Job {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub params: GenParams,
    /// `kv.profile_queries`, tokenized: the training queries the worker keeps for the context this request creates.
    pub profile_queries: Vec<Vec<u32>>,
    /// `bad_words`, tokenized: the token sequences the worker never completes.
    pub bad_words: Vec<Vec<u32>>,
    /// The prefix-cache namespace: the tenant, salted by `cache_salt` when the request has one.
    pub namespace: String,
    /// The API key's tenant (`default` with auth off), for per-tenant metrics.
    pub tenant: Arc<str>,
    /// The tenant's weight under fair scheduling (its API key's `weight=`).
    pub tenant_weight: u32,
    /// The LoRA adapter the request's `model` names (`None`: the base model).
    pub lora: Option<String>,
    pub arrived: Instant,
}

/// When a worker counts as failed under a request, and how often the request moves on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationConfig {
    /// Longest wait between two tokens of one stream before the worker counts as stalled, unless it still answers
    /// its health check (then it is only slow, and the wait goes on up to `first_token_timeout`).
    pub stall_timeout: Duration,
    /// Longest wait from opening a stream to its first token (queueing and prefill included), and the hard bound
    /// on any silence of a stream.
    pub first_token_timeout: Duration,
    /// Re-issues after a worker failure, per request; the failure after the last one reaches the client.
    pub max_retries: u32,
}

impl Default for MigrationConfig {
    fn default() -> Self {
        MigrationConfig {
            stall_timeout: Duration::from_secs(5),
            first_token_timeout: Duration::from_secs(30),
            max_retries: 2,
        }
    }
}

/// Everything a generation needs from the router.
#[derive(Clone)]
pub struct GenerateContext {
    pub pool: Arc<WorkerPool>,
    pub codec: Arc<dyn TextCodec>,
    pub metrics: Arc<Metrics>,
    pub migration: MigrationConfig,
    /// Longest wait for the client to take a piece when its buffer is full ([`crate::RouterConfig::client_timeout`]).
    pub client_timeout: Duration,
}

/// Runs `job` and returns its pieces. Errors before the first token (invalid, exhausted, no worker, every attempt
/// failed) come back here, so the client gets a proper status code; later ones arrive as [`Piece::Error`].
pub async fn start(ctx: GenerateContext, job: Job) -> Result<mpsc::Receiver<Piece>, ApiError> {
    spans::record_request(&job.params.model, &job.request_id);
    let (tx, rx) = mpsc::channel(64);
    let (first_tx, first_rx) = oneshot::channel();
    let request_span = Span::current();
    tokio::spawn(Generation::new(ctx, job, tx, first_tx).run().instrument(request_span));
    match first_rx.await {
        Ok(Ok(())) => Ok(rx),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ApiError::internal("The generation ended before it started.")),
    }
}

/// Why an attempt on one worker ended.
enum AttemptEnd {
    /// The client has everything (or left); nothing more to do.
    Over,
    /// The request itself is at fault or cannot run anywhere: no retry.
    Fatal(ApiError),
    /// The worker failed under the request: try another one.
    WorkerFailed(WorkerFailure),
    /// After a failure, no other worker is there to continue: the failure reaches the client.
    NoOtherWorker,
    /// The worker's admission queue is full (it refused before doing any work): try the next candidate, without
    /// using up a retry or taking the worker out of placement.
    Busy { worker: String, retry_after_ms: u64 },
}

struct WorkerFailure {
    worker: String,
    /// The `reason` label of `pagoda_router_migrations_total`.
    reason: &'static str,
    /// What the client sees if no retry is left.
    error: ApiError,
    /// What the failure costs the worker beyond this request.
    penalty: Penalty,
}

/// What a worker's failure costs it beyond the request that saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Penalty {
    /// It answered with an error of its own: it is alive, only this request moves.
    None,
    /// A transport-level failure: out of placement until its health check passes again.
    MarkDown,
    /// It stayed silent past the request's bound: marked down, and also ejected for a while
    /// ([`Worker::eject_silent`]), which its health check does not clear.
    Eject,
}

/// One request's progress across its attempts: the tokens produced so far and the text pipeline they feed.
struct Generation {
    ctx: GenerateContext,
    job: Job,
    tx: mpsc::Sender<Piece>,
    /// Present until the HTTP layer has been told whether the request started.
    first: Option<oneshot::Sender<Result<(), ApiError>>>,
    generated: Vec<u32>,
    decoder: Utf8Decoder,
    stops: StopMatcher,
    /// Generated tokens' log-probabilities waiting for their text (only when the request asked for them).
    logprobs: LogprobQueue,
    /// The prompt's scores so far (`echo` with `logprobs`: positions 1.., in order), and whether the echo went out.
    prompt_scores: Vec<PbTokenLogprobs>,
    echoed: bool,
    last_token: Option<Instant>,
    /// Workers that failed under this request; never tried again for it.
    excluded: Vec<String>,
    /// The prompt is counted in the metrics once, when the first stream opens.
    prompt_counted: bool,
    /// This request's tenant's prompt and completion token counters.
    tenant_tokens: (Counter, Counter),
    /// Set after a worker failed; the next attempt that finds a worker is a migration.
    pending_migration: Option<PendingMigration>,
}

struct PendingMigration {
    from: String,
    reason: &'static str,
    attempt: u32,
}

impl Generation {
    fn new(
        ctx: GenerateContext,
        job: Job,
        tx: mpsc::Sender<Piece>,
        first: oneshot::Sender<Result<(), ApiError>>,
    ) -> Generation {
        let stops = StopMatcher::new(job.params.stop.clone()).keeping_stop(job.params.include_stop_str);
        let tenant_tokens = ctx.metrics.tenant_token_counters(&job.tenant);
        Generation {
            ctx,
            job,
            tx,
            first: Some(first),
            generated: Vec::new(),
            decoder: Utf8Decoder::new(),
            stops,
            logprobs: LogprobQueue::default(),
            prompt_scores: Vec::new(),
            echoed: false,
            last_token: None,
            excluded: Vec::new(),
            prompt_counted: false,
            tenant_tokens,
            pending_migration: None,
        }
    }

    async fn run(mut self) {
        let mut retries = 0u32;
        let mut last_failure = None;
        let mut busy: Option<u64> = None;
        loop {
            match self.attempt().await {
                AttemptEnd::Over => return,
                AttemptEnd::Fatal(e) => return self.fail(e).await,
                AttemptEnd::NoOtherWorker => {
                    let e = match (last_failure, busy) {
                        (Some(e), _) => e,
                        (None, Some(ms)) => {
                            self.ctx.metrics.count_shed("workers_busy");
                            ApiError::saturated(
                                "Every worker is at capacity; retry after the time in Retry-After.",
                                ms.div_ceil(1000),
                            )
                        }
                        (None, None) => ApiError::unavailable("No worker could take the request."),
                    };
                    return self.fail(e).await;
                }
                AttemptEnd::Busy { worker, retry_after_ms } => {
                    self.ctx.metrics.count_worker_busy(&worker);
                    busy = Some(busy.map_or(retry_after_ms, |b| b.min(retry_after_ms)));
                    self.excluded.push(worker);
                }
                AttemptEnd::WorkerFailed(f) => {
                    if let Some(w) = self.ctx.pool.find(&f.worker) {
                        if f.penalty != Penalty::None {
                            w.mark_down(f.error.message.clone());
                        }
                        if f.penalty == Penalty::Eject {
                            w.eject_silent(f.reason);
                        }
                    }
                    self.excluded.push(f.worker.clone());
                    if retries >= self.ctx.migration.max_retries {
                        tracing::warn!(
                            request_id = %self.job.request_id, worker = %f.worker, reason = f.reason, retries,
                            "worker failed and no retry is left; failing the request"
                        );
                        return self.fail(f.error).await;
                    }
                    retries += 1;
                    tracing::debug!(
                        request_id = %self.job.request_id, worker = %f.worker, reason = f.reason,
                        error = %f.error.message, "worker failed under the request"
                    );
                    self.pending_migration =
                        Some(PendingMigration { from: f.worker, reason: f.reason, attempt: retries });
                    last_failure = Some(f.error);
                }
            }
        }
    }

    /// Tells the client about `e`: as the HTTP status before the first token, as an error piece after it.
    async fn fail(&mut self, e: ApiError) {
        match self.first.take() {
            Some(first) => {
                let _ = first.send(Err(e));
            }
            None => {
                self.deliver(Piece::Error(e)).await;
            }
        }
    }

    /// Hands `piece` to the HTTP layer; false when the client is gone or has stopped reading. A streaming client
    /// that stops reading (but keeps its connection) fills the channel, and an unbounded wait here would keep the
    /// worker generating for nobody; past the client timeout the request counts as abandoned instead, and the
    /// caller drops the worker's stream, which cancels it there.
    async fn deliver(&self, piece: Piece) -> bool {
        match tokio::time::timeout(self.ctx.client_timeout, self.tx.send(piece)).await {
            Ok(sent) => sent.is_ok(),
            Err(_) => {
                tracing::warn!(
                    request_id = %self.job.request_id,
                    timeout_ms = self.ctx.client_timeout.as_millis() as u64,
                    "the client stopped reading the stream; cancelling the generation"
                );
                false
            }
        }
    }

    /// Lets the HTTP layer start answering (once).
    fn started(&mut self) {
        if let Some(first) = self.first.take() {
            let _ = first.send(Ok(()));
        }
    }

    /// The job's training queries for an attempt whose prompt is `prompt_len` tokens. A migrated attempt's prompt
    /// carries the tokens generated so far, and a query that fitted beside the original prompt may no longer fit
    /// beside it: the queries are then left out, since they only steer placement and must not fail the request.
    fn profile_queries_for(&self, prompt_len: usize) -> Vec<ProfileQuery> {
        let queries = &self.job.profile_queries;
        let codec = &self.ctx.codec;
        if queries.is_empty()
            || pagoda_worker::placement::check_profile_queries(
                queries,
                prompt_len,
                codec.vocab_size(),
                codec.context_length(),
            )
            .is_err()
        {
            return Vec::new();
        }
        queries.iter().map(|q| ProfileQuery { token_ids: q.clone() }).collect()
    }

    /// The candidates for `prompt`, best first, without the workers that failed this request, and its shape (its
    /// block hashes), which a remote prefill places again.
    fn place(&self, prompt: &[u32], max_tokens: u32) -> Result<(Vec<Candidate>, RequestShape), ApiError> {
        let pool = &self.ctx.pool;
        let shape = RequestShape::of(
            pool,
            &self.job.namespace,
            self.job.lora.as_deref(),
            prompt,
            &self.job.params,
            max_tokens,
        )?;
        let mut place = shape.request(&self.job.request_id);
        place.exclude = &self.excluded;
        let span = spans::place_span(pool.strategy_name(), pool.workers().len());
        let started = Instant::now();
        let placed = pool.place(&place);
        let took = started.elapsed();
        match &placed {
            Ok(c) => {
                let chosen = c.first().map_or("", |c| c.worker.addr.as_str());
                self.ctx.metrics.count_placement(chosen, pool.strategy_name(), took);
                spans::placed(&span, chosen, &pool.last_reason())
            }
            Err(e) => spans::placed(&span, "", &e.to_string()),
        }
        match placed {
            Ok(c) => Ok((c, shape)),
            Err(PlacementError::NoReadyWorker) => Err(no_ready_worker()),
            Err(e) => Err(ApiError::internal(format!("placement failed: {e}"))),
        }
    }

    /// Disaggregated serving ([`crate::disagg`]): when the worker chosen would compute enough of `prompt` (it
    /// holds `cached_tokens` of it) and a prefill worker is ready, has the prefill worker compute the prompt, and
    /// returns the hint that makes the chosen worker pull it, with the prompt tokens it then holds. `None`: the
    /// chosen worker prefills (as it does when the remote prefill fails).
    async fn remote_prefill(
        &self,
        prompt: &[u32],
        shape: &RequestShape,
        cached_tokens: u64,
        decode: &Worker,
    ) -> Option<(PbPeerHint, u64)> {
        let pool = &self.ctx.pool;
        let uncached = (prompt.len() as u64).saturating_sub(cached_tokens);
        let params = &self.job.params;
        let (min_tokens, max_queued) = pool.remote_prefill_bounds();
        if !disagg::wants_remote_prefill(uncached, min_tokens, &params.kv_policy, self.scores_prompt()) {
            return None;
        }
        // The prefill worker generates one token.
        let mut place = shape.request(&self.job.request_id);
        place.view.max_tokens = 1;
        place.exclude = &self.excluded;
        let worker = pool.place_remote_prefill(&place)?;
        if disagg::queue_full(worker.load().queued_tokens(), max_queued) {
            self.ctx.metrics.count_remote_prefill_skipped("queue_full");
            return None;
        }
        let req = disagg::prefill_request(
            &self.job.request_id,
            prompt,
            &self.job.namespace,
            self.job.tenant_weight,
            self.job.lora.as_deref(),
            &params.kv_codec,
            params.priority,
        );
        // The decode worker is this request's from now on: while the prefill worker computes the prompt, placement
        // must see the stream coming its way, or a burst of long prompts all pick the same idle decode worker. The
        // caller counts the request there before anything else can place (no await in between).
        let _reserved = InFlight::reserved_decode(Arc::clone(decode.load()), self.job.lora.as_deref());
        let started = Instant::now();
        let timeout = self.ctx.migration.first_token_timeout;
        let outcome = disagg::prefill_on(&worker, req, uncached, timeout, self.tx.closed()).await;
        self.ctx.metrics.count_remote_prefill(outcome.name(), started.elapsed());
        if outcome != disagg::PrefillOutcome::Ok {
            tracing::debug!(request_id = %self.job.request_id, worker = %worker.addr, outcome = outcome.name(),
                "remote prefill did not finish; the decode worker prefills");
            match outcome {
                disagg::PrefillOutcome::Unreachable => worker.mark_down("remote prefill: unreachable".to_owned()),
                disagg::PrefillOutcome::Timeout => worker.eject_silent("remote_prefill_timeout"),
                _ => {}
            }
            return None;
        }
        worker.answered();
        let pull_cap = decode.with_status(|st| st.costs.pull_cap_blocks());
        Some(disagg::decode_hint(&worker.addr, prompt.len(), shape.view.block_size as usize, pull_cap))
    }

    /// One attempt: place prompt + what was generated so far, open the stream on the best candidate, and pump it
    /// until the request is over or the worker fails.
    async fn attempt(&mut self) -> AttemptEnd {
        let remaining = self.job.max_tokens.saturating_sub(self.generated.len() as u32);
        if remaining == 0 {
            // Every token arrived but the finish message was lost with the worker.
            return self.finish("length", 0).await;
        }
        let mut prompt = self.job.prompt.clone();
        prompt.extend_from_slice(&self.generated);
        let (candidates, shape) = match self.place(&prompt, remaining) {
            Ok(c) => c,
            Err(_) if !self.excluded.is_empty() => return AttemptEnd::NoOtherWorker,
            Err(e) => return AttemptEnd::Fatal(e),
        };
        let Some(Candidate { worker, peer_hint, cached_tokens }) = candidates.first() else {
            return AttemptEnd::NoOtherWorker;
        };
        let (addr, mut client, load) = (worker.addr.clone(), worker.client(), worker.load().clone());
        let chosen = Arc::clone(worker);
        // A peer that failed this request is not worth pulling from either.
        let mut peer_hint = peer_hint.as_ref().filter(|h| !self.excluded.contains(&h.address)).map(|h| PbPeerHint {
            address: h.address.clone(),
            blocks: h.blocks,
            remote_prefill: false,
        });
        let mut cached_tokens = *cached_tokens;
        drop(candidates);
        if let Some((hint, pulled)) = self.remote_prefill(&prompt, &shape, cached_tokens, &chosen).await {
            peer_hint = Some(hint);
            cached_tokens = cached_tokens.max(pulled);
        }
        if self.tx.is_closed() {
            return AttemptEnd::Over;
        }
        let uncached = (prompt.len() as u64).saturating_sub(cached_tokens);
        let in_flight = InFlight::with_adapter(load, uncached, self.job.lora.as_deref());
        if let Some(m) = self.pending_migration.take() {
            self.ctx.metrics.count_migration(m.reason);
            tracing::warn!(
                request_id = %self.job.request_id,
                from = %m.from,
                to = %addr,
                reason = m.reason,
                generated = self.generated.len() as i64,
                attempt = i64::from(m.attempt),
                "migrate"
            );
        }
        let kv_profile_queries = self.profile_queries_for(prompt.len());
        let params = &self.job.params;
        let req = GenerateRequest {
            request_id: self.job.request_id.clone(),
            prompt_token_ids: prompt,
            max_tokens: remaining,
            sampling: Some(SamplingParams {
                temperature: params.sampling.temperature,
                top_p: params.sampling.top_p,
                top_k: params.sampling.top_k,
                seed: params.sampling.seed,
                logit_bias: params.logit_bias.iter().map(|&(token_id, bias)| PbLogitBias { token_id, bias }).collect(),
                presence_penalty: params.sampling.presence_penalty,
                frequency_penalty: params.sampling.frequency_penalty,
                // A resumed attempt's prompt ends with what earlier attempts generated: the penalties count it.
                prior_output_tokens: self.generated.len() as u32,
                repetition_penalty: params.sampling.repetition_penalty,
                min_p: params.sampling.min_p,
                min_tokens: params.sampling.min_tokens.saturating_sub(self.generated.len() as u32),
                // A resumed attempt's guide replays the prior output tokens, so the object goes on where it was.
                json_object: params.sampling.json_object,
                json_schema: params.json_schema.clone().unwrap_or_default(),
                regex: params.regex.clone().unwrap_or_default(),
                grammar: params.grammar.clone().unwrap_or_default(),
                allowed_token_ids: params.allowed_token_ids.clone(),
                bad_words: self.job.bad_words.iter().map(|w| TokenSequence { token_ids: w.clone() }).collect(),
            }),
            // The model's end tokens stop the request unless it asked to ignore them (the worker then does not add
            // its own either); the request's own stop ids stop it either way.
            stop_token_ids: {
                let mut ids = if params.ignore_eos { Vec::new() } else { self.ctx.codec.stop_token_ids() };
                for &t in &params.stop_token_ids {
                    if !ids.contains(&t) {
                        ids.push(t);
                    }
                }
                ids
            },
            ignore_eos: params.ignore_eos,
            namespace: self.job.namespace.clone(),
            tenant_weight: self.job.tenant_weight,
            lora: self.job.lora.clone().unwrap_or_default(),
            kv_policy: params.kv_policy.clone(),
            kv_budget_tokens: params.kv_budget_tokens,
            kv_codec: params.kv_codec.clone(),
            peer_hint,
            kv_profile_queries,
            logprobs: params.logprobs.is_some(),
            top_logprobs: params.logprobs.unwrap_or(0),
            // A resumed attempt's prompt carries generated tokens, which come after every prompt score.
            priority: params.priority,
            prompt_logprobs: self.scores_prompt() && self.prompt_scores.len() + 1 < self.job.prompt.len(),
        };
        let prompt_tokens = req.prompt_token_ids.len() as u64;
        let call = spans::generate_call_span(&addr);
        let mut request = tonic::Request::new(req);
        trace_context::inject_into_metadata(&call, request.metadata_mut());
        let opened_at = Instant::now();
        let first_token_timeout = self.ctx.migration.first_token_timeout;
        let opened = tokio::select! {
            biased;
            _ = self.tx.closed() => return AttemptEnd::Over,
            r = tokio::time::timeout(first_token_timeout, client.generate(request).instrument(call.clone())) => r,
        };
        let stream = match opened {
            Ok(Ok(resp)) => resp.into_inner(),
            Ok(Err(status)) => {
                spans::call_failed(&call, &status);
                return classify_status(&addr, &status, "unavailable");
            }
            Err(_) => {
                return AttemptEnd::WorkerFailed(WorkerFailure {
                    worker: addr,
                    reason: "first_token_timeout",
                    error: ApiError::unavailable(format!(
                        "The worker did not answer within {} ms.",
                        first_token_timeout.as_millis()
                    )),
                    penalty: Penalty::Eject,
                });
            }
        };
        // The worker took the request, so it holds the adapter now (a worker loads one on demand before it
        // answers): probe it at once rather than keep charging it the load until the next health round.
        if let Some(name) = &self.job.lora
            && !chosen.with_status(|s| s.serves_lora(name))
        {
            chosen.probe_soon();
        }
        if !self.prompt_counted {
            self.prompt_counted = true;
            self.ctx.metrics.prompt_tokens.inc_by(prompt_tokens);
            self.tenant_tokens.0.inc_by(prompt_tokens);
        }
        self.pump(stream, in_flight, call, chosen, opened_at).await
    }

    async fn pump(
        &mut self,
        mut stream: Streaming<GenerateResponse>,
        mut in_flight: InFlight,
        call: Span,
        worker: Arc<Worker>,
        opened_at: Instant,
    ) -> AttemptEnd {
        let addr = worker.addr.clone();
        let before = self.generated.len() as u32;
        // A retried attempt scores the prompt from its start again: what arrived before is not taken twice.
        let mut scores_seen = 0usize;
        let cfg = self.ctx.migration;
        let mut got_token = false;
        let mut last_progress = Instant::now();
        loop {
            let (wait, stalled_reason) = if got_token {
                (cfg.stall_timeout, "stall")
            } else {
                (cfg.first_token_timeout.saturating_sub(opened_at.elapsed()), "first_token_timeout")
            };
            let msg = tokio::select! {
                biased;
                _ = self.tx.closed() => {
                    tracing::debug!(request_id = %self.job.request_id, "client went away; cancelling");
                    return AttemptEnd::Over; // drops `stream`: the worker cancels the request
                }
                m = tokio::time::timeout(wait, stream.message()) => m,
            };
            let msg = match msg {
                Ok(m) => m,
                Err(_) => {
                    let silent = last_progress.elapsed();
                    // Slow is not stalled: a worker that still answers its health check is overloaded, not stuck,
                    // and moving its requests would only add prefill work. Wait on, up to the hard bound.
                    if silent < cfg.first_token_timeout && self.worker_answers(&addr).await {
                        tracing::debug!(request_id = %self.job.request_id, worker = %addr, "slow stream; the worker is alive");
                        continue;
                    }
                    return AttemptEnd::WorkerFailed(WorkerFailure {
                        worker: addr,
                        reason: stalled_reason,
                        error: ApiError::unavailable(format!("The worker sent nothing for {} ms.", silent.as_millis())),
                        penalty: Penalty::Eject,
                    });
                }
            };
            last_progress = Instant::now();
            match msg {
                Ok(Some(resp)) => {
                    let wants_logprobs = self.job.params.logprobs.is_some();
                    if wants_logprobs && resp.logprobs.len() != resp.token_ids.len() {
                        return AttemptEnd::WorkerFailed(WorkerFailure {
                            worker: addr,
                            reason: "worker_error",
                            error: ApiError::internal(format!(
                                "The worker sent {} log-probabilities for {} tokens.",
                                resp.logprobs.len(),
                                resp.token_ids.len()
                            )),
                            penalty: Penalty::None,
                        });
                    }
                    for score in resp.prompt_logprobs {
                        if scores_seen == self.prompt_scores.len()
                            && self.prompt_scores.len() + 1 < self.job.prompt.len()
                        {
                            self.prompt_scores.push(score);
                        }
                        scores_seen += 1;
                    }
                    let mut logprobs = resp.logprobs.into_iter();
                    for id in resp.token_ids {
                        if !got_token {
                            got_token = true;
                            in_flight.first_token();
                            worker.answered();
                        }
                        if self.push_token(id, logprobs.next()).await {
                            return AttemptEnd::Over;
                        }
                    }
                    let Some(fin) = resp.finished else { continue };
                    let Some(reason) = reason_str(fin.reason) else {
                        // The worker cancelled the request itself (it is shutting down): continue elsewhere.
                        return AttemptEnd::WorkerFailed(WorkerFailure {
                            worker: addr,
                            reason: "cancelled",
                            error: ApiError::unavailable("The worker cancelled the request."),
                            penalty: Penalty::MarkDown,
                        });
                    };
                    let u = fin.usage.unwrap_or_default();
                    if fin.queue_seconds.is_finite() && fin.queue_seconds >= 0.0 {
                        self.ctx.metrics.queue.observe(fin.queue_seconds);
                    }
                    let this_attempt = (self.generated.len() as u32 - before).max(u.completion_tokens);
                    call.record("completion_tokens", i64::from(this_attempt));
                    call.record("rpc.grpc.status_code", tonic::Code::Ok as i32);
                    let completion = before + this_attempt;
                    return self.finish_with(reason, completion, u.cached_tokens, fin.stop_token_id).await;
                }
                Ok(None) => {
                    return AttemptEnd::WorkerFailed(WorkerFailure {
                        worker: addr,
                        reason: "stream_ended",
                        error: ApiError::unavailable("The worker ended the stream without finishing."),
                        penalty: Penalty::MarkDown,
                    });
                }
                Err(status) => {
                    spans::call_failed(&call, &status);
                    return classify_status(&addr, &status, "stream_error");
                }
            }
        }
    }

    /// Whether the worker at `addr` answers its health check as ready within the stall timeout.
    async fn worker_answers(&self, addr: &str) -> bool {
        let Some(w) = self.ctx.pool.find(addr) else { return false };
        tokio::time::timeout(self.ctx.migration.stall_timeout, w.probe()).await.unwrap_or(false)
    }

    /// Feeds one token (and its log-probabilities, when asked for) through the text pipeline; returns true when the
    /// request is over (a stop string matched, or the client left).
    async fn push_token(&mut self, id: u32, logprobs: Option<PbTokenLogprobs>) -> bool {
        self.started();
        self.generated.push(id);
        let now = Instant::now();
        match self.last_token {
            None => self.ctx.metrics.observe_ttft(now.duration_since(self.job.arrived).as_secs_f64(), now),
            Some(t) => self.ctx.metrics.observe_inter_token(now.duration_since(t).as_secs_f64(), now),
        }
        self.last_token = Some(now);
        self.ctx.metrics.completion_tokens.inc();
        self.tenant_tokens.1.inc();
        if let Some(lp) = logprobs {
            let text_offset = u32::try_from(self.logprobs.decoded).unwrap_or(u32::MAX);
            self.logprobs.pending.push_back(TokenLogprob::from_pb(lp, id, text_offset));
        }
        let text = self.decoder.push(&self.ctx.codec.token_bytes(id));
        if text.is_empty() {
            return false;
        }
        self.logprobs.decoded += text.len();
        match self.stops.push(&text) {
            StopOutcome::Continue(t) => self.send_text(t, false).await,
            StopOutcome::Stopped(t) => {
                if self.send_text(t, false).await {
                    return true;
                }
                let usage = Usage::new(self.job.prompt.len() as u32, self.generated.len() as u32, 0);
                let stop = self.stops.matched().map(|s| StopReason::Text(s.to_owned()));
                self.deliver(Piece::Done { finish_reason: "stop", usage, stop }).await;
                true // drops the stream: cancels the rest of the generation
            }
        }
    }

    /// Whether the worker scores the prompt for this request (`echo` with `logprobs`).
    fn scores_prompt(&self) -> bool {
        self.job.params.echo && self.job.params.logprobs.is_some()
    }

    /// Sends the prompt once, before any text, for `echo`; true when the client has gone.
    async fn send_echo(&mut self) -> bool {
        if !self.job.params.echo || std::mem::replace(&mut self.echoed, true) {
            return false;
        }
        let codec = &self.ctx.codec;
        let mut bytes = Vec::new();
        let mut offsets = Vec::with_capacity(self.job.prompt.len());
        for &t in &self.job.prompt {
            offsets.push(u32::try_from(bytes.len()).unwrap_or(u32::MAX));
            bytes.extend_from_slice(&codec.token_bytes(t));
        }
        let scores = std::mem::take(&mut self.prompt_scores);
        let logprobs = scores
            .into_iter()
            .zip(self.job.prompt.iter().zip(&offsets).skip(1))
            .map(|(lp, (&token, &text_offset))| TokenLogprob::from_pb(lp, token, text_offset))
            .collect();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let first_token = self.job.prompt.first().copied().unwrap_or_default();
        !self.deliver(Piece::Echo { text, first_token, logprobs }).await
    }

    /// Sends released text with the log-probabilities it releases (at the `end` of a stream that stopped at no
    /// stop string, every one still pending: all the text is out); true when the client has gone.
    async fn send_text(&mut self, text: String, end: bool) -> bool {
        if self.send_echo().await {
            return true;
        }
        let mut logprobs = self.logprobs.release(text.len());
        if end {
            logprobs.extend(self.logprobs.release_all());
        }
        if text.is_empty() && logprobs.is_empty() {
            return false;
        }
        let completion_tokens = self.generated.len() as u32;
        !self.deliver(Piece::Text { text, logprobs, completion_tokens }).await
    }

    async fn finish(&mut self, reason: &'static str, cached_tokens: u32) -> AttemptEnd {
        let completion = self.generated.len() as u32;
        self.finish_with(reason, completion, cached_tokens, None).await
    }

    /// Flushes the held-back text and sends `Done`. `stop_token`: the token the worker stopped on, when it did.
    async fn finish_with(
        &mut self,
        reason: &'static str,
        completion: u32,
        cached_tokens: u32,
        stop_token: Option<u32>,
    ) -> AttemptEnd {
        self.started();
        let tail = self.decoder.finish();
        self.logprobs.decoded += tail.len();
        let (mut text, stopped) = match self.stops.push(&tail) {
            StopOutcome::Continue(t) => (t, false),
            StopOutcome::Stopped(t) => (t, true),
        };
        if !stopped {
            text.push_str(&self.stops.finish());
        }
        if self.send_text(text, !stopped).await {
            return AttemptEnd::Over;
        }
        let prompt_tokens = self.job.prompt.len() as u32;
        // After a migration the last worker's prompt included the earlier completion: cap what it calls cached.
        let usage = Usage::new(prompt_tokens, completion, cached_tokens.min(prompt_tokens));
        let finish_reason = if stopped { "stop" } else { reason };
        // vLLM reports the request's own stop ids, not the model's end tokens.
        let stop = match self.stops.matched() {
            Some(s) => Some(StopReason::Text(s.to_owned())),
            None => stop_token
                .filter(|t| finish_reason == "stop" && self.job.params.stop_token_ids.contains(t))
                .map(StopReason::Token),
        };
        self.deliver(Piece::Done { finish_reason, usage, stop }).await;
        AttemptEnd::Over
    }
}

/// Sorts a worker's gRPC error: the request's own fault ends it; anything else is the worker's and moves it on.
fn classify_status(addr: &str, status: &tonic::Status, transport_reason: &'static str) -> AttemptEnd {
    use tonic::Code;
    if disagg::is_transport_failure(status) {
        return AttemptEnd::WorkerFailed(WorkerFailure {
            worker: addr.to_string(),
            reason: transport_reason,
            error: ApiError::unavailable(format!("worker unavailable: {}", status.message())),
            penalty: Penalty::MarkDown,
        });
    }
    if status.code() == Code::ResourceExhausted
        && let Some(ms) = status.metadata().get(pagoda_proto::BUSY_RETRY_AFTER_MS)
    {
        let retry_after_ms = ms.to_str().ok().and_then(|v| v.parse().ok()).unwrap_or(1000u64).clamp(1, 60_000);
        return AttemptEnd::Busy { worker: addr.to_string(), retry_after_ms };
    }
    match status.code() {
        Code::InvalidArgument | Code::OutOfRange | Code::ResourceExhausted | Code::FailedPrecondition => {
            AttemptEnd::Fatal(ApiError::from_status(status))
        }
        // The worker answered with an error of its own: it is alive, only this request moves.
        _ => AttemptEnd::WorkerFailed(WorkerFailure {
            worker: addr.to_string(),
            reason: "worker_error",
            error: ApiError::from_status(status),
            penalty: Penalty::None,
        }),
    }
}

fn reason_str(r: i32) -> Option<&'static str> {
    match FinishReason::try_from(r) {
        Ok(FinishReason::Stop) => Some("stop"),
        Ok(FinishReason::Length) => Some("length"),
        _ => None,
    }
}

/// What placement needs of a request: its block chain in the tenant's namespace (salted by its adapter's cache
/// id, as the worker salts it) and its shape.
pub struct RequestShape {
    hashes: Vec<u64>,
    lora: Option<String>,
    view: RequestView,
    /// Only full-cache sequences publish their blocks as a reusable prefix.
    publishes_prefix: bool,
}

impl RequestShape {
    /// Fails while no worker has told the router its block size and model (nothing is ready to serve), or while
    /// no ready worker serves the adapter `lora`.
    pub fn of(
        pool: &WorkerPool,
        namespace: &str,
        lora: Option<&str>,
        prompt: &[u32],
        params: &GenParams,
        max_tokens: u32,
    ) -> Result<RequestShape, ApiError> {
        let (block_size, model_id) = pool.hashing().ok_or_else(no_ready_worker)?;
        let salted = match lora {
            Some(name) => {
                // An adapter no worker has had loaded has no cached blocks anywhere: a salt no worker uses keeps
                // its chain from matching the base model's.
                let cache_id = match pool.lora_cache_id(name) {
                    Some(id) => id,
                    None if pool.lora_servable(name) => format!("{name}@not-loaded"),
                    None => {
                        return Err(ApiError::unavailable(format!(
                            "No ready worker serves the LoRA adapter {name:?}; try again shortly."
                        )));
                    }
                };
                pagoda_worker::model::lora::cache_namespace(namespace, &cache_id)
            }
            None => namespace.to_string(),
        };
        let hashes = if block_size > 0 {
            pagoda_worker::cache::block_hashes(&model_id, &salted, prompt, block_size as usize)
        } else {
            Vec::new()
        };
        let full_cache = params.kv_policy.is_empty() || params.kv_policy == "full";
        Ok(RequestShape {
            hashes,
            lora: lora.map(str::to_owned),
            view: RequestView {
                prompt_tokens: u32::try_from(prompt.len()).unwrap_or(u32::MAX),
                max_tokens,
                block_size,
                budget_tokens: (!full_cache).then_some(match params.kv_budget_tokens {
                    0 => pagoda_worker::policy::defaults::BUDGET_TOKENS as u32,
                    b => b,
                }),
            },
            publishes_prefix: full_cache,
        })
    }

    pub fn request<'a>(&'a self, request_id: &'a str) -> PlaceRequest<'a> {
        PlaceRequest {
            request_id,
            hashes: &self.hashes,
            view: self.view,
            publishes_prefix: self.publishes_prefix,
            lora: self.lora.as_deref(),
            exclude: &[],
        }
    }
}

pub fn no_ready_worker() -> ApiError {
    ApiError::unavailable("No worker is ready to serve this request; try again shortly.")
}
