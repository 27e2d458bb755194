//! A load generator for fault tests against a router's OpenAI API, and the checks of what it saw.
//!
//! - [`run`] drives chat requests in a closed loop (a fixed number in flight) or an open loop (a fixed arrival
//!   rate), streaming and non-streaming, over a mix of shared-prefix and unique prompts ([`prompt_mix`]). Every
//!   request has a deadline; the number of requests and the time spent issuing them are bounded.
//! - Each request leaves a [`Record`]: accepted or rejected, time to first token, the full streamed text, finish
//!   reason, usage and error.
//! - [`reference()`] computes the greedy answer of every prompt at every output length on a healthy cluster;
//!   [`Report::new`] checks every completed request against it (duplicates, gaps and any other divergence all show
//!   as a mismatch), counts the lost ones (accepted but never completed, or no clean answer at all), and measures
//!   throughput and the time to recover after a fault.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use serde_json::{Value, json};

use crate::Http;

/// The most delta arrival times a [`Record`] keeps (answers are bounded by the API's `max_tokens` anyway).
pub const MAX_DELTA_TIMES: usize = 8192;

/// How requests arrive.
#[derive(Debug, Clone, Copy)]
pub enum Mode {
    /// `concurrency` requests in flight at all times: each one that ends is replaced at once.
    Closed { concurrency: usize },
    /// One request every `1 / per_second` seconds, whatever is in flight, up to `max_in_flight` (arrivals beyond
    /// it are recorded as shed, not sent).
    Open { per_second: f64, max_in_flight: usize },
}

/// Which requests stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Streaming {
    All,
    None,
    /// Three of every four stream; the fourth is non-streaming.
    Mixed,
}

/// A load run.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    pub mode: Mode,
    /// Chat user messages, used in turn.
    pub prompts: Vec<String>,
    /// The `max_tokens` of the requests: request `i` asks prompt `i % P` for entry `(i / P) % L`, so every prompt is
    /// asked at every length. Several lengths keep a closed loop from completing its requests in lockstep waves (as
    /// real traffic's varied answer lengths do); one entry gives every request the same length.
    pub max_tokens: Vec<u32>,
    pub streaming: Streaming,
    /// Each request must end (completed or failed) within this.
    pub deadline: Duration,
    /// No request is issued after this much time.
    pub duration: Duration,
    /// No more requests than this are issued.
    pub max_requests: usize,
    /// A class of requests that carry a `priority` ([`Urgent`]); `None`: no request names one.
    pub urgent: Option<Urgent>,
}

/// Every `every`-th request (indices `every - 1`, `2·every - 1`, …) is urgent and sends `"priority": priority`. A
/// priority of 0 marks the class without asking the server for anything, which an FCFS server accepts: the same
/// load's baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Urgent {
    pub every: usize,
    pub priority: i32,
}

impl LoadConfig {
    /// Whether request `index` belongs to the urgent class.
    pub fn is_urgent(&self, index: usize) -> bool {
        self.urgent.is_some_and(|u| u.every > 0 && index % u.every == u.every - 1)
    }
}

/// How one request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// HTTP 200 and a finished answer.
    Completed,
    /// A clean OpenAI error status before any token (the client may retry).
    Rejected,
    /// Accepted, then an error or a cut-off after tokens were delivered: a lost request.
    Broken,
    /// No answer within the deadline: a lost request.
    TimedOut,
    /// The connection failed or the answer was not the API's: a lost request.
    Transport,
    /// Open loop only: not sent because too many were in flight.
    Shed,
}

/// What one request saw.
#[derive(Debug, Clone)]
pub struct Record {
    pub index: usize,
    /// Index into [`LoadConfig::prompts`].
    pub prompt: usize,
    /// The `max_tokens` it asked for.
    pub max_tokens: u32,
    pub stream: bool,
    /// It belonged to the urgent class ([`LoadConfig::urgent`]).
    pub urgent: bool,
    /// When it was sent and when it ended, from the start of the run.
    pub sent_at: Duration,
    pub ended_at: Duration,
    pub status: Option<u16>,
    pub ttft: Option<Duration>,
    /// When each non-empty content delta of a stream arrived, from when the request was sent (at most
    /// [`MAX_DELTA_TIMES`]).
    pub delta_times: Vec<Duration>,
    /// The answer as the client assembled it (all deltas in order).
    pub text: String,
    pub finish_reason: Option<String>,
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens` of a completed answer.
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub error: Option<String>,
    /// The `Retry-After` header of a refusal.
    pub retry_after: Option<String>,
    pub outcome: Outcome,
    /// The connection failed (refused, reset, or cut before the end): nothing the API said, so a client may send the
    /// request again elsewhere.
    pub connection_failed: bool,
    /// Times the client sent it again to another router after a connection failure ([`run_across`]).
    pub client_retries: u32,
}

impl Record {
    /// A request not (yet) answered: it ends as [`Outcome::Transport`] unless something better is recorded.
    fn new(index: usize, prompt: usize, max_tokens: u32, stream: bool, sent_at: Duration) -> Record {
        Record {
            index,
            prompt,
            max_tokens,
            stream,
            urgent: false,
            sent_at,
            ended_at: sent_at,
            status: None,
            ttft: None,
            delta_times: Vec::new(),
            text: String::new(),
            finish_reason: None,
            completion_tokens: None,
            prompt_tokens: None,
            cached_tokens: None,
            error: None,
            retry_after: None,
            outcome: Outcome::Transport,
            connection_failed: false,
            client_retries: 0,
        }
    }

    pub fn accepted(&self) -> bool {
        self.status == Some(200)
    }

    pub fn latency(&self) -> Duration {
        self.ended_at.saturating_sub(self.sent_at)
    }
}

/// `n_shared` prompts that share a long common prefix (a system-like preamble, so prefix caching matters) and
/// `n_unique` prompts that share nothing; deterministic.
pub fn prompt_mix(n_shared: usize, n_unique: usize) -> Vec<String> {
    const PREAMBLE: &str = "You are reading the logbook of a lighthouse keeper on a cold northern island. The keeper \
        writes down the weather every morning, the ships that pass in the afternoon, and the birds that nest on the \
        rocks in the evening. The logbook is old and some pages are stained with salt.";
    const TOPICS: [&str; 8] =
        ["the weather", "the ships", "the birds", "the keeper", "the island", "the lamp", "the salt", "the pages"];
    const SUBJECTS: [&str; 12] = [
        "a baker",
        "a river",
        "a clockmaker",
        "a violin",
        "a mountain goat",
        "a library",
        "a comet",
        "a gardener",
        "a train station",
        "an old map",
        "a fox",
        "a teapot",
    ];
    const ASKS: [&str; 4] =
        ["Write one sentence about", "Describe in a few words", "Tell a short story about", "List three facts about"];
    let mut out = Vec::with_capacity(n_shared + n_unique);
    for i in 0..n_shared {
        out.push(format!(
            "{PREAMBLE} Question {}: what does the logbook say about {}?",
            i + 1,
            TOPICS[i % TOPICS.len()]
        ));
    }
    for i in 0..n_unique {
        out.push(format!(
            "{} {} (number {}).",
            ASKS[i % ASKS.len()],
            SUBJECTS[(i / ASKS.len() + i) % SUBJECTS.len()],
            i + 1
        ));
    }
    out
}

/// Prefixes each prompt with `words` words of filler notes drawn from `seed` and the prompt's index, so that long
/// prompts share no prefix with each other or with another seed's (a tenant of long, uncached prompts).
pub fn pad_prompts(prompts: &mut [String], words: usize, seed: u64) {
    const WORDS: [&str; 32] = [
        "harbour", "lantern", "quiet", "granite", "meadow", "copper", "winter", "ledger", "orchard", "signal",
        "pebble", "thread", "summit", "candle", "willow", "anchor", "marble", "valley", "ember", "parcel", "hollow",
        "timber", "beacon", "saddle", "crystal", "furrow", "garnet", "mirror", "pillar", "ribbon", "shadow", "thistle",
    ];
    if words == 0 {
        return;
    }
    for (i, prompt) in prompts.iter_mut().enumerate() {
        // splitmix64 over (seed, index): deterministic, and distinct from the first word on.
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_add(1);
        let mut next = || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let notes: Vec<&str> = (0..words).map(|_| WORDS[(next() % WORDS.len() as u64) as usize]).collect();
        *prompt = format!("Notes: {}.\n\n{prompt}", notes.join(" "));
    }
}

/// A chat request of one user message.
fn body(model: &str, prompt: &str, max_tokens: u32, stream: bool, priority: Option<i32>) -> Value {
    let mut b = json!({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
    });
    if stream {
        b["stream_options"] = json!({"include_usage": true});
    }
    if let Some(p) = priority {
        b["priority"] = json!(p);
    }
    b
}

/// The greedy answers of a healthy cluster, by prompt and `max_tokens`.
#[derive(Debug, Clone, Default)]
pub struct Reference {
    answers: std::collections::HashMap<(usize, u32), String>,
}

impl Reference {
    /// The greedy answer of prompt `prompt` at `max_tokens`, if it was computed.
    pub fn get(&self, prompt: usize, max_tokens: u32) -> Option<&str> {
        self.answers.get(&(prompt, max_tokens)).map(String::as_str)
    }
}

/// Computes the greedy answer of every prompt at every length in `max_tokens` (non-streaming, four requests at a
/// time).
pub async fn reference(http: &Http, prompts: &[String], max_tokens: &[u32]) -> Result<Reference> {
    let cases = prompts.iter().enumerate().flat_map(|(i, p)| max_tokens.iter().map(move |&n| (i, p, n)));
    let answers = futures::stream::iter(cases)
        .map(|(i, p, n)| async move {
            let (s, v) = http.post_json("/v1/chat/completions", &body(&http.model, p, n, false, None)).await?;
            if s != 200 {
                bail!("reference for prompt {i} at {n} tokens failed: {s} {v}");
            }
            let text = v["choices"][0]["message"]["content"]
                .as_str()
                .map(str::to_string)
                .context("no content in the answer")?;
            Ok(((i, n), text))
        })
        .buffered(4)
        .collect::<Vec<_>>()
        .await;
    Ok(Reference { answers: answers.into_iter().collect::<Result<_>>()? })
}

/// The `max_tokens` of request `index` (see [`LoadConfig::max_tokens`]).
fn max_tokens_of(cfg: &LoadConfig, index: usize) -> u32 {
    let lengths = &cfg.max_tokens;
    lengths[(index / cfg.prompts.len().max(1)) % lengths.len().max(1)]
}

/// Sends one request and records what happened. It goes to `routers[index % n]` first; when the connection fails
/// (a dead router) the client sends it again to the next router, as a client behind a Service or a list of router
/// endpoints would, once per router and within the one deadline.
async fn one(
    routers: &[Http],
    index: usize,
    prompt: usize,
    text: &str,
    cfg: &LoadConfig,
    stream: bool,
    t0: Instant,
) -> Record {
    let sent = Instant::now();
    let max_tokens = max_tokens_of(cfg, index);
    let urgent = cfg.is_urgent(index);
    let priority = cfg.urgent.filter(|_| urgent).map(|u| u.priority);
    let mut rec = Record { urgent, ..Record::new(index, prompt, max_tokens, stream, sent - t0) };
    let fut = async {
        for attempt in 0..routers.len() {
            let http = &routers[(index + attempt) % routers.len()];
            let request = body(&http.model, text, max_tokens, stream, priority);
            rec = Record {
                client_retries: attempt as u32,
                urgent,
                ..Record::new(index, prompt, max_tokens, stream, sent - t0)
            };
            drive(http, &mut rec, &request, stream, sent).await;
            if !rec.connection_failed {
                break;
            }
        }
    };
    if tokio::time::timeout(cfg.deadline, fut).await.is_err() {
        rec.outcome = Outcome::TimedOut;
        rec.error = Some(format!("no end within {:?}", cfg.deadline));
    }
    rec.ended_at = t0.elapsed();
    rec
}

/// Sends one chat completion request `body` (any messages; `stream` must match its `"stream"`) and records the
/// answer: text, time to first token, usage, or how it failed. Unbounded in time: the caller puts the deadline.
pub async fn chat_once(http: &Http, body: &Value, stream: bool) -> Record {
    let max_tokens = body["max_tokens"].as_u64().and_then(|n| u32::try_from(n).ok()).unwrap_or(0);
    let mut rec = Record::new(0, 0, max_tokens, stream, Duration::ZERO);
    let sent = Instant::now();
    drive(http, &mut rec, body, stream, sent).await;
    rec.ended_at = sent.elapsed();
    rec
}

async fn drive(http: &Http, rec: &mut Record, request: &Value, stream: bool, sent: Instant) {
    let resp = match http.client.post(http.url("/v1/chat/completions")).json(request).send().await {
        Ok(r) => r,
        Err(e) => {
            rec.error = Some(format!("send: {e}"));
            rec.connection_failed = true;
            return;
        }
    };
    let status = resp.status().as_u16();
    rec.status = Some(status);
    if status != 200 {
        rec.retry_after =
            resp.headers().get(reqwest::header::RETRY_AFTER).and_then(|v| v.to_str().ok()).map(str::to_string);
        let text = resp.text().await.unwrap_or_default();
        let clean = serde_json::from_str::<Value>(&text).is_ok_and(|v| v["error"]["message"].is_string());
        rec.outcome = if clean { Outcome::Rejected } else { Outcome::Transport };
        rec.error = Some(format!("{status}: {text}"));
        return;
    }
    if !stream {
        let v: Value = match resp.json().await {
            Ok(v) => v,
            Err(e) => {
                rec.outcome = Outcome::Broken;
                rec.error = Some(format!("body: {e}"));
                rec.connection_failed = true;
                return;
            }
        };
        rec.ttft = Some(sent.elapsed());
        rec.text = v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
        rec.finish_reason = v["choices"][0]["finish_reason"].as_str().map(str::to_string);
        record_usage(rec, &v["usage"]);
        rec.outcome = if rec.finish_reason.is_some() { Outcome::Completed } else { Outcome::Broken };
        return;
    }
    let mut bytes = resp.bytes_stream();
    let mut buf = String::new();
    let mut done = false;
    while let Some(chunk) = bytes.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                rec.outcome = Outcome::Broken;
                rec.error = Some(format!("stream: {e}"));
                rec.connection_failed = true;
                return;
            }
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim_end().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = match serde_json::from_str(data) {
                Ok(v) => v,
                Err(e) => {
                    rec.outcome = Outcome::Broken;
                    rec.error = Some(format!("bad event {data:?}: {e}"));
                    return;
                }
            };
            if v.get("error").is_some() {
                rec.outcome = Outcome::Broken;
                rec.error = Some(format!("error event after {} bytes: {v}", rec.text.len()));
                return;
            }
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str()
                && !c.is_empty()
            {
                let at = sent.elapsed();
                rec.ttft.get_or_insert(at);
                if rec.delta_times.len() < MAX_DELTA_TIMES {
                    rec.delta_times.push(at);
                }
                rec.text.push_str(c);
            }
            if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
                rec.finish_reason = Some(f.to_string());
            }
            if v["usage"].is_object() {
                record_usage(rec, &v["usage"]);
            }
        }
    }
    rec.outcome = if done && rec.finish_reason.is_some() { Outcome::Completed } else { Outcome::Broken };
    if rec.outcome == Outcome::Broken {
        rec.error = Some(format!("stream ended without [DONE] after {} bytes", rec.text.len()));
        rec.connection_failed = !done;
    }
}

fn record_usage(rec: &mut Record, usage: &Value) {
    rec.completion_tokens = usage["completion_tokens"].as_u64();
    rec.prompt_tokens = usage["prompt_tokens"].as_u64();
    rec.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
}

fn is_streaming(mix: Streaming, index: usize) -> bool {
    match mix {
        Streaming::All => true,
        Streaming::None => false,
        Streaming::Mixed => index % 4 != 3,
    }
}

/// Runs the load against `http` until `duration` or `max_requests`, then waits for every request to end (each is
/// bounded by its deadline).
pub async fn run(http: &Http, cfg: &LoadConfig) -> Result<Vec<Record>> {
    run_across(std::slice::from_ref(http), cfg).await
}

/// [`run`] against several routers: request `i` goes to router `i % n`, and to the next one when its connection
/// fails (see [`Record::client_retries`]).
pub async fn run_across(routers: &[Http], cfg: &LoadConfig) -> Result<Vec<Record>> {
    if cfg.prompts.is_empty() {
        bail!("no prompts");
    }
    if cfg.max_tokens.is_empty() {
        bail!("no max_tokens");
    }
    if routers.is_empty() {
        bail!("no routers");
    }
    let t0 = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut records = Vec::new();
    let mut next = 0usize;
    let spawn = |tasks: &mut tokio::task::JoinSet<Record>, i: usize| {
        let (routers, cfg) = (routers.to_vec(), cfg.clone());
        let p = i % cfg.prompts.len();
        tasks
            .spawn(async move { one(&routers, i, p, &cfg.prompts[p], &cfg, is_streaming(cfg.streaming, i), t0).await });
    };
    let issuing = |next: usize| next < cfg.max_requests && t0.elapsed() < cfg.duration;
    match cfg.mode {
        Mode::Closed { concurrency } => {
            while next < concurrency.max(1) && issuing(next) {
                spawn(&mut tasks, next);
                next += 1;
            }
            while let Some(r) = tasks.join_next().await {
                records.push(r.context("load task panicked")?);
                if issuing(next) {
                    spawn(&mut tasks, next);
                    next += 1;
                }
            }
        }
        Mode::Open { per_second, max_in_flight } => {
            if !(per_second.is_finite() && per_second > 0.0) {
                bail!("arrival rate must be positive, got {per_second}");
            }
            let gap = Duration::from_secs_f64(1.0 / per_second);
            // Arrivals follow the schedule: one due after `duration` is never sent, however early the loop asks.
            while next < cfg.max_requests && gap.mul_f64(next as f64) < cfg.duration {
                let due = t0 + gap.mul_f64(next as f64);
                tokio::select! {
                    r = tasks.join_next(), if !tasks.is_empty() => {
                        if let Some(r) = r { records.push(r.context("load task panicked")?); }
                        continue;
                    }
                    _ = tokio::time::sleep_until(due.into()) => {}
                }
                if tasks.len() >= max_in_flight {
                    let stream = is_streaming(cfg.streaming, next);
                    let (prompt, max_tokens) = (next % cfg.prompts.len(), max_tokens_of(cfg, next));
                    let mut shed = Record::new(next, prompt, max_tokens, stream, t0.elapsed());
                    shed.error = Some("shed: too many in flight".into());
                    shed.outcome = Outcome::Shed;
                    records.push(shed);
                } else {
                    spawn(&mut tasks, next);
                }
                next += 1;
            }
            while let Some(r) = tasks.join_next().await {
                records.push(r.context("load task panicked")?);
            }
        }
    }
    records.sort_by_key(|r| r.index);
    Ok(records)
}

/// A completed request whose answer is not the greedy reference.
#[derive(Debug, Clone)]
pub struct Mismatch {
    pub index: usize,
    pub prompt: usize,
    pub max_tokens: u32,
    /// Byte offset of the first difference.
    pub at: usize,
    pub got: String,
    pub want: String,
}

/// Counts and latencies of a run, checked against the reference.
#[derive(Debug, Clone)]
pub struct Report {
    pub sent: usize,
    pub accepted: usize,
    pub completed: usize,
    /// Rejected with a clean error before any token.
    pub failed_clean: usize,
    /// Accepted but broken, timed out, or no clean answer at all.
    pub lost: usize,
    pub timed_out: usize,
    pub shed: usize,
    /// Requests the client sent again to another router after a connection failure.
    pub client_retried: usize,
    pub mismatches: Vec<Mismatch>,
    /// Lost requests, with their errors (at most 10).
    pub lost_examples: Vec<String>,
    pub p50_latency: Duration,
    pub p99_latency: Duration,
    pub p50_ttft: Duration,
    pub p99_ttft: Duration,
    pub max_latency: Duration,
}

fn percentile(mut v: Vec<Duration>, p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort();
    let i = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

impl Report {
    pub fn new(records: &[Record], reference: &Reference) -> Report {
        let mut r = Report {
            sent: 0,
            accepted: 0,
            completed: 0,
            failed_clean: 0,
            lost: 0,
            timed_out: 0,
            shed: 0,
            client_retried: 0,
            mismatches: Vec::new(),
            lost_examples: Vec::new(),
            p50_latency: Duration::ZERO,
            p99_latency: Duration::ZERO,
            p50_ttft: Duration::ZERO,
            p99_ttft: Duration::ZERO,
            max_latency: Duration::ZERO,
        };
        for rec in records {
            if rec.outcome == Outcome::Shed {
                r.shed += 1;
                continue;
            }
            r.sent += 1;
            r.accepted += usize::from(rec.accepted());
            r.client_retried += usize::from(rec.client_retries > 0);
            match rec.outcome {
                Outcome::Completed => {
                    r.completed += 1;
                    let want = reference.get(rec.prompt, rec.max_tokens).unwrap_or("");
                    if rec.text != want {
                        let at = rec.text.bytes().zip(want.bytes()).take_while(|(a, b)| a == b).count();
                        r.mismatches.push(Mismatch {
                            index: rec.index,
                            prompt: rec.prompt,
                            max_tokens: rec.max_tokens,
                            at,
                            got: rec.text.clone(),
                            want: want.to_string(),
                        });
                    }
                }
                Outcome::Rejected => r.failed_clean += 1,
                Outcome::Broken | Outcome::TimedOut | Outcome::Transport => {
                    r.lost += 1;
                    r.timed_out += usize::from(rec.outcome == Outcome::TimedOut);
                    if r.lost_examples.len() < 10 {
                        r.lost_examples.push(format!(
                            "#{} ({:?}, stream {}, after {:?}): {}",
                            rec.index,
                            rec.outcome,
                            rec.stream,
                            rec.latency(),
                            rec.error.as_deref().unwrap_or("")
                        ));
                    }
                }
                Outcome::Shed => {}
            }
        }
        let done: Vec<&Record> = records.iter().filter(|r| r.outcome == Outcome::Completed).collect();
        r.p50_latency = percentile(done.iter().map(|r| r.latency()).collect(), 0.50);
        r.p99_latency = percentile(done.iter().map(|r| r.latency()).collect(), 0.99);
        r.p50_ttft = percentile(done.iter().filter_map(|r| r.ttft).collect(), 0.50);
        r.p99_ttft = percentile(done.iter().filter_map(|r| r.ttft).collect(), 0.99);
        r.max_latency = records.iter().map(Record::latency).max().unwrap_or_default();
        r
    }
}

/// Time to first token and latency of the completed requests of one class ([`LoadConfig::urgent`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClassStats {
    pub completed: usize,
    pub p50_ttft: Duration,
    pub p99_ttft: Duration,
    pub p50_latency: Duration,
    pub p99_latency: Duration,
}

impl ClassStats {
    /// Over the completed records with `urgent` as given.
    pub fn of(records: &[Record], urgent: bool) -> ClassStats {
        let done: Vec<&Record> =
            records.iter().filter(|r| r.outcome == Outcome::Completed && r.urgent == urgent).collect();
        let ttft = || done.iter().filter_map(|r| r.ttft).collect::<Vec<_>>();
        let latency = || done.iter().map(|r| r.latency()).collect::<Vec<_>>();
        ClassStats {
            completed: done.len(),
            p50_ttft: percentile(ttft(), 0.50),
            p99_ttft: percentile(ttft(), 0.99),
            p50_latency: percentile(latency(), 0.50),
            p99_latency: percentile(latency(), 0.99),
        }
    }

    pub fn to_json(self) -> Value {
        json!({
            "completed": self.completed,
            "p50_ttft_s": self.p50_ttft.as_secs_f64(),
            "p99_ttft_s": self.p99_ttft.as_secs_f64(),
            "p50_latency_s": self.p50_latency.as_secs_f64(),
            "p99_latency_s": self.p99_latency.as_secs_f64(),
        })
    }
}

/// Completed requests per second among those that ended in `[from, to)`.
pub fn throughput(records: &[Record], from: Duration, to: Duration) -> f64 {
    if to <= from {
        return 0.0;
    }
    let n = records.iter().filter(|r| r.outcome == Outcome::Completed && r.ended_at >= from && r.ended_at < to).count();
    n as f64 / (to - from).as_secs_f64()
}

/// Generated tokens per second in `[from, to)`, over the completed requests: a stream's `completion_tokens` spread
/// evenly over its content deltas, each counted when it arrived; a non-streaming answer's over its whole latency
/// (the cluster generated them while the client waited). Unlike completions per second, which a closed loop
/// delivers in waves about one request latency apart, this changes only as fast as the cluster's decode rate does.
pub fn token_rate(records: &[Record], from: Duration, to: Duration) -> f64 {
    if to <= from {
        return 0.0;
    }
    let within = |at: Duration| at >= from && at < to;
    let tokens: f64 = records
        .iter()
        .filter(|r| r.outcome == Outcome::Completed)
        .filter_map(|r| {
            let tokens = r.completion_tokens? as f64;
            if r.stream && !r.delta_times.is_empty() {
                let each = tokens / r.delta_times.len() as f64;
                return Some(each * r.delta_times.iter().filter(|&&d| within(r.sent_at + d)).count() as f64);
            }
            let (start, end) = (r.sent_at, r.ended_at);
            if end <= start {
                return within(start).then_some(tokens);
            }
            let overlap = end.min(to).saturating_sub(start.max(from));
            Some(tokens * overlap.as_secs_f64() / (end - start).as_secs_f64())
        })
        .sum();
    tokens / (to - from).as_secs_f64()
}

/// The p99 latency of the completed requests that were in flight at some point of `[from, to)`.
pub fn p99_latency_between(records: &[Record], from: Duration, to: Duration) -> Duration {
    percentile(
        records
            .iter()
            .filter(|r| r.outcome == Outcome::Completed && r.sent_at < to && r.ended_at >= from)
            .map(Record::latency)
            .collect(),
        0.99,
    )
}

/// The window to judge recovery over: the mean latency of the requests completed in `[from, to)` (the healthy
/// load before a fault), and at least `floor`. A closed loop of N streams completes its requests in waves about one
/// request latency apart; windows shorter than that see the waves, not the cluster: with 100 streams (latency about
/// 6 s) the healthy load itself dipped below 90% of its mean in 3 s windows.
pub fn recovery_window(records: &[Record], from: Duration, to: Duration, floor: Duration) -> Duration {
    let latencies: Vec<Duration> = records
        .iter()
        .filter(|r| r.outcome == Outcome::Completed && r.ended_at >= from && r.ended_at < to)
        .map(Record::latency)
        .collect();
    if latencies.is_empty() {
        return floor;
    }
    let mean = latencies.iter().sum::<Duration>() / latencies.len() as u32;
    mean.max(floor)
}

/// The lowest throughput of any `window` starting every 250 ms within `[from, to)`: how far the healthy load
/// itself swings below its mean.
pub fn worst_window(records: &[Record], from: Duration, to: Duration, window: Duration) -> f64 {
    windows(records, from, to, window, throughput).map(|(_, t)| t).reduce(f64::min).unwrap_or(0.0)
}

/// Each `window` starting every 250 ms from `from` and ending by `to`: its start and its `rate`.
fn windows(
    records: &[Record],
    from: Duration,
    to: Duration,
    window: Duration,
    rate: impl Fn(&[Record], Duration, Duration) -> f64,
) -> impl Iterator<Item = (Duration, f64)> {
    const STEP: Duration = Duration::from_millis(250);
    (0u32..)
        .map(move |i| from + STEP * i)
        .take_while(move |start| *start + window <= to)
        .map(move |start| (start, rate(records, start, start + window)))
}

/// Throughput before a fault and how long after it the cluster was back to `fraction` of it for good.
#[derive(Debug, Clone, Copy)]
pub struct Recovery {
    /// Completed requests per second over `[warmup, fault)`.
    pub baseline: f64,
    /// From the fault to the start of the first window from which on every window's throughput is at least
    /// `fraction × baseline`; `None` if the last window before `until` is still below.
    pub recovered_after: Option<Duration>,
    /// The lowest throughput of any window after the fault.
    pub worst: f64,
}

/// Measures recovery over windows of `window` starting every 250 ms from the fault and ending no later than
/// `until` (the end of steady load).
pub fn recovery(
    records: &[Record],
    warmup: Duration,
    fault: Duration,
    until: Duration,
    window: Duration,
    fraction: f64,
) -> Recovery {
    let baseline = throughput(records, warmup, fault);
    let (recovered_after, worst) = recovered_above(records, fault, until, window, fraction * baseline, throughput);
    Recovery { baseline, recovered_after, worst }
}

/// From `fault` to the start of the first window (of `window`, every 250 ms, ending by `until`) from which on every
/// window's `rate` is at least `threshold` (`None` if the last one is still below), and the lowest window rate
/// after the fault.
pub fn recovered_above(
    records: &[Record],
    fault: Duration,
    until: Duration,
    window: Duration,
    threshold: f64,
    rate: impl Fn(&[Record], Duration, Duration) -> f64,
) -> (Option<Duration>, f64) {
    let mut worst = f64::INFINITY;
    let mut recovered_from = Some(fault);
    for (start, t) in windows(records, fault, until, window, rate) {
        worst = worst.min(t);
        recovered_from = if t >= threshold { recovered_from.or(Some(start)) } else { None };
    }
    (recovered_from.map(|s| s - fault), if worst.is_finite() { worst } else { 0.0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_prompts_share_no_prefix_across_prompts_or_seeds() {
        let base = prompt_mix(0, 3);
        let mut a = base.clone();
        pad_prompts(&mut a, 50, 1);
        let mut b = base.clone();
        pad_prompts(&mut b, 50, 2);
        let mut again = base.clone();
        pad_prompts(&mut again, 50, 1);
        assert_eq!(a, again, "deterministic");
        let first_words = |p: &str| p.split_whitespace().take(4).collect::<Vec<_>>().join(" ");
        let mut starts: Vec<String> = a.iter().chain(&b).map(|p| first_words(p)).collect();
        starts.sort();
        starts.dedup();
        assert_eq!(starts.len(), 6, "{starts:?}");
        for (padded, plain) in a.iter().zip(&base) {
            assert!(padded.ends_with(plain.as_str()));
            assert_eq!(padded.split_whitespace().count(), plain.split_whitespace().count() + 51);
        }
        let mut unpadded = base.clone();
        pad_prompts(&mut unpadded, 0, 1);
        assert_eq!(unpadded, base);
    }

    /// Completions every 100 ms from 1 s to 10 s, none from 4 s to 6 s; each took 1 s.
    fn with_a_gap() -> Vec<Record> {
        (10..100u64)
            .filter(|i| !(40..60).contains(i))
            .map(|i| {
                let end = Duration::from_millis(100 * i);
                let mut r = Record::new(i as usize, 0, 1, false, end - Duration::from_secs(1));
                r.ended_at = end;
                r.outcome = Outcome::Completed;
                r
            })
            .collect()
    }

    #[test]
    fn recovery_is_the_start_of_the_first_window_from_which_on_all_are_above() {
        let records = with_a_gap();
        let w = Duration::from_secs(1);
        let (warmup, fault) = (Duration::from_secs(1), Duration::from_secs(4));
        assert_eq!(recovery_window(&records, warmup, fault, Duration::from_millis(500)), w);
        assert_eq!(recovery_window(&records, warmup, fault, Duration::from_secs(3)), Duration::from_secs(3));
        assert_eq!(worst_window(&records, warmup, fault, w), 10.0);
        let (after, worst) =
            recovered_above(&records, Duration::from_secs(4), Duration::from_secs(10), w, 9.0, throughput);
        assert_eq!(after, Some(Duration::from_secs(2)), "the first full window after the gap starts at 6 s");
        assert_eq!(worst, 0.0);
        let rec = recovery(&records, warmup, fault, Duration::from_secs(10), w, 0.9);
        assert_eq!((rec.baseline, rec.recovered_after), (10.0, Some(Duration::from_secs(2))));
    }

    #[test]
    fn token_rate_counts_each_delta_when_it_arrived() {
        let mut r = Record::new(0, 0, 8, true, Duration::from_secs(1));
        r.delta_times = [1, 2, 3, 5].map(Duration::from_secs).to_vec();
        r.ended_at = Duration::from_secs(6);
        r.completion_tokens = Some(8);
        r.outcome = Outcome::Completed;
        // Two tokens per delta, arriving at 2, 3, 4 and 6 s.
        let records = [r.clone()];
        assert_eq!(token_rate(&records, Duration::ZERO, Duration::from_secs(2)), 0.0);
        assert_eq!(token_rate(&records, Duration::from_secs(2), Duration::from_secs(4)), 2.0);
        assert_eq!(token_rate(&records, Duration::from_secs(4), Duration::from_secs(8)), 1.0);
        // Not streamed: spread over its whole latency, 1 s to 6 s.
        r.stream = false;
        assert_eq!(token_rate(&[r.clone()], Duration::from_secs(1), Duration::from_secs(6)), 1.6);
        r.outcome = Outcome::Broken;
        assert_eq!(token_rate(&[r], Duration::ZERO, Duration::from_secs(10)), 0.0);
    }
}
