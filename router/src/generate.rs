//! One generation as the router runs it: place it (hash the prompt's blocks, [`WorkerPool::place`]), open the
//! chosen worker's `Generate` stream (the next candidates if it is unavailable), detokenize
//! incrementally, apply stop strings, record latency metrics, and hand text pieces to the HTTP layer. Dropping the
//! receiver (the client went away) or matching a stop string drops the gRPC stream, which cancels the request
//! on the worker and frees its blocks.

use std::sync::Arc;
use std::time::Instant;

use pagoda_proto::trace_context;
use pagoda_proto::worker::{FinishReason, GenerateRequest, GenerateResponse, SamplingParams};
use tokio::sync::mpsc;
use tonic::Streaming;
use tracing::{Instrument as _, Span};

use crate::codec::TextCodec;
use crate::detok::{StopMatcher, StopOutcome, Utf8Decoder};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::openai::{GenParams, Usage};
use crate::placement::{PlacementError, RequestView};
use crate::placer::PlaceRequest;
use crate::spans;
use crate::workers::{InFlight, WorkerPool};

/// What the HTTP layer receives, in order: any number of `Text`, then exactly one `Done` or `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Done { finish_reason: &'static str, usage: Usage },
    Error(ApiError),
}

/// A validated, tokenized request.
pub struct Job {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub params: GenParams,
    pub namespace: String,
    pub arrived: Instant,
}

/// Opens a worker stream for `job`. Errors the worker reports before streaming (invalid, exhausted, no worker)
/// come back here so the client gets a proper status code; later ones arrive as [`Piece::Error`].
pub async fn start(
    pool: &WorkerPool,
    codec: Arc<dyn TextCodec>,
    metrics: Arc<Metrics>,
    job: Job,
) -> Result<mpsc::Receiver<Piece>, ApiError> {
    spans::record_request(&job.params.model, &job.request_id);
    let req = GenerateRequest {
        request_id: job.request_id.clone(),
        prompt_token_ids: job.prompt.clone(),
        max_tokens: job.max_tokens,
        sampling: Some(SamplingParams {
            temperature: job.params.sampling.temperature,
            top_p: job.params.sampling.top_p,
            top_k: job.params.sampling.top_k,
            seed: job.params.sampling.seed,
        }),
        stop_token_ids: codec.stop_token_ids(),
        namespace: job.namespace.clone(),
        kv_policy: job.params.kv_policy.clone(),
        kv_budget_tokens: job.params.kv_budget_tokens,
    };
    let no_worker = || ApiError::unavailable("No worker is ready to serve this request; try again shortly.");
    let (block_size, model_id) = pool.hashing().ok_or_else(no_worker)?;
    let hashes = if block_size > 0 {
        pagoda_worker::cache::block_hashes(&model_id, &job.namespace, &job.prompt, block_size as usize)
    } else {
        Vec::new()
    };
    // Only full-cache sequences publish their blocks as a reusable prefix.
    let full_cache = job.params.kv_policy.is_empty() || job.params.kv_policy == "full";
    let place = PlaceRequest {
        request_id: &job.request_id,
        hashes: &hashes,
        view: RequestView {
            prompt_tokens: u32::try_from(job.prompt.len()).unwrap_or(u32::MAX),
            max_tokens: job.max_tokens,
            block_size,
            budget_tokens: (!full_cache).then_some(match job.params.kv_budget_tokens {
                0 => pagoda_worker::policy::defaults::BUDGET_TOKENS as u32,
                b => b,
            }),
        },
        publishes_prefix: full_cache,
    };
    let candidates = {
        let span = spans::place_span(pool.strategy_name(), pool.workers().len());
        let started = Instant::now();
        let placed = pool.place(&place);
        let took = started.elapsed();
        match &placed {
            Ok(c) => {
                let chosen = c.first().map_or("", |w| w.addr.as_str());
                metrics.count_placement(chosen, pool.strategy_name(), took);
                spans::placed(&span, chosen, &pool.last_reason())
            }
            Err(e) => spans::placed(&span, "", &e.to_string()),
        }
        match placed {
            Ok(c) => c,
            Err(PlacementError::NoReadyWorker) => return Err(no_worker()),
            Err(e) => return Err(ApiError::internal(format!("placement failed: {e}"))),
        }
    };
    let mut last_err = None;
    let mut opened = None;
    for w in candidates {
        let mut client = w.client();
        let call = spans::generate_call_span(&w.addr);
        let mut request = tonic::Request::new(req.clone());
        trace_context::inject_into_metadata(&call, request.metadata_mut());
        match client.generate(request).instrument(call.clone()).await {
            Ok(resp) => {
                opened = Some((resp.into_inner(), call, InFlight::new(w.load().clone(), job.prompt.len() as u64)));
                break;
            }
            Err(status) if status.code() == tonic::Code::Unavailable => {
                spans::call_failed(&call, &status);
                tracing::warn!(worker = %w.addr, error = %status.message(), "worker unavailable; trying the next");
                w.mark_down(status.message().to_string());
                last_err = Some(ApiError::from_status(&status));
            }
            Err(status) => {
                spans::call_failed(&call, &status);
                return Err(ApiError::from_status(&status));
            }
        }
    }
    let Some((stream, call, in_flight)) = opened else {
        return Err(last_err.unwrap_or_else(|| ApiError::unavailable("No worker could take the request.")));
    };
    metrics.prompt_tokens.inc_by(job.prompt.len() as u64);
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(pump(stream, in_flight, tx, codec, metrics, job, call));
    Ok(rx)
}

fn reason_str(r: i32) -> Option<&'static str> {
    match FinishReason::try_from(r) {
        Ok(FinishReason::Stop) => Some("stop"),
        Ok(FinishReason::Length) => Some("length"),
        _ => None,
    }
}

async fn pump(
    mut stream: Streaming<GenerateResponse>,
    mut in_flight: InFlight,
    tx: mpsc::Sender<Piece>,
    codec: Arc<dyn TextCodec>,
    metrics: Arc<Metrics>,
    job: Job,
    call: Span,
) {
    let mut decoder = Utf8Decoder::new();
    let mut stops = StopMatcher::new(job.params.stop.clone());
    let prompt_tokens = job.prompt.len() as u32;
    let mut completion: u32 = 0;
    let mut last_token: Option<Instant> = None;
    loop {
        let msg = tokio::select! {
            biased;
            _ = tx.closed() => {
                tracing::debug!(request_id = %job.request_id, "client went away; cancelling");
                return; // drops `stream`: the worker cancels the request
            }
            m = stream.message() => m,
        };
        match msg {
            Ok(Some(resp)) => {
                for id in resp.token_ids {
                    completion += 1;
                    let now = Instant::now();
                    match last_token {
                        None => {
                            in_flight.first_token();
                            metrics.observe_ttft(now.duration_since(job.arrived).as_secs_f64(), now)
                        }
                        Some(t) => metrics.observe_inter_token(now.duration_since(t).as_secs_f64(), now),
                    }
                    last_token = Some(now);
                    metrics.completion_tokens.inc();
                    let text = decoder.push(&codec.token_bytes(id));
                    if text.is_empty() {
                        continue;
                    }
                    match stops.push(&text) {
                        StopOutcome::Continue(t) => {
                            if !t.is_empty() && tx.send(Piece::Text(t)).await.is_err() {
                                return;
                            }
                        }
                        StopOutcome::Stopped(t) => {
                            if !t.is_empty() && tx.send(Piece::Text(t)).await.is_err() {
                                return;
                            }
                            let usage = Usage::new(prompt_tokens, completion, 0);
                            let _ = tx.send(Piece::Done { finish_reason: "stop", usage }).await;
                            return; // drops `stream`: cancels the rest of the generation
                        }
                    }
                }
                if let Some(fin) = resp.finished {
                    let Some(reason) = reason_str(fin.reason) else {
                        let _ = tx.send(Piece::Error(ApiError::internal("The worker cancelled the request."))).await;
                        return;
                    };
                    let tail = decoder.finish();
                    let (mut text, stopped) = match stops.push(&tail) {
                        StopOutcome::Continue(t) => (t, false),
                        StopOutcome::Stopped(t) => (t, true),
                    };
                    if !stopped {
                        text.push_str(&stops.finish());
                    }
                    if !text.is_empty() && tx.send(Piece::Text(text)).await.is_err() {
                        return;
                    }
                    let u = fin.usage.unwrap_or_default();
                    let usage = Usage::new(
                        if u.prompt_tokens > 0 { u.prompt_tokens } else { prompt_tokens },
                        completion.max(u.completion_tokens),
                        u.cached_tokens,
                    );
                    let finish_reason = if stopped { "stop" } else { reason };
                    call.record("completion_tokens", i64::from(usage.completion_tokens));
                    call.record("rpc.grpc.status_code", tonic::Code::Ok as i32);
                    let _ = tx.send(Piece::Done { finish_reason, usage }).await;
                    return;
                }
            }
            Ok(None) => {
                let _ =
                    tx.send(Piece::Error(ApiError::internal("The worker ended the stream without finishing."))).await;
                return;
            }
            Err(status) => {
                spans::call_failed(&call, &status);
                let _ = tx.send(Piece::Error(ApiError::from_status(&status))).await;
                return;
            }
        }
    }
}
