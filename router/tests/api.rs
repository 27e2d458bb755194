//! Router HTTP tests against an in-process fake worker that speaks the real `Worker` gRPC service, with a
//! byte-level codec (token id = byte). They cover the OpenAI wire format (JSON and exact SSE), validation errors,
//! stop strings, readiness, metrics, cancellation of the worker stream when the client leaves, and the dashboard's
//! state, cache and access rules.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::Stream;
use pagoda_proto::worker::worker_server::{Worker, WorkerServer};
use pagoda_proto::worker::{
    FinishReason, Finished, GenerateRequest, GenerateResponse, HealthRequest, HealthResponse, StatsRequest,
    StatsResponse, TokenLogprobs, Usage,
};
use pagoda_router::auth::{AdminKey, KeyTable};
use pagoda_router::codec::cut_after_final_message;
use pagoda_router::openai::{ChatRender, Turn};
use pagoda_router::placer::{PlacerConfig, Strategy};
use pagoda_router::{MigrationConfig, RouterConfig, Security, TextCodec};
use serde_json::{Value, json};
use tonic::{Request, Response, Status};

const MODEL: &str = "fake-model";
const CONTEXT: usize = 256;
const EOS: u32 = 256;
/// The fake model's answer, one byte per token (so multi-byte characters are split across tokens).
const REPLY: &str = "Paris is the capital of France. ünïcødé 🦀 END of answer.";

struct ByteCodec;

impl TextCodec for ByteCodec {
    fn model_id(&self) -> &str {
        MODEL
    }
    fn context_length(&self) -> usize {
        CONTEXT
    }
    fn vocab_size(&self) -> usize {
        257
    }
    fn render_chat(&self, turns: &[Turn], render: ChatRender) -> Result<String, String> {
        let mut s: String = turns.iter().map(|t| format!("{}: {}\n", t.role, t.content)).collect();
        if render.add_generation_prompt {
            s.push_str("assistant:");
        }
        if render.continue_final_message { cut_after_final_message(s, turns) } else { Ok(s) }
    }
    fn encode(&self, text: &str, _add_special: bool) -> Result<Vec<u32>, String> {
        Ok(text.bytes().map(u32::from).collect())
    }
    fn token_bytes(&self, id: u32) -> Cow<'_, [u8]> {
        match u8::try_from(id) {
            Ok(b) => Cow::Owned(vec![b]),
            Err(_) => Cow::Borrowed(&[]),
        }
    }
    fn stop_token_ids(&self) -> Vec<u32> {
        vec![EOS]
    }
}

/// Counts open Generate streams; decremented when tonic drops a stream (client cancelled or finished).
#[derive(Default)]
struct Fake {
    open: Arc<AtomicUsize>,
    started: Arc<AtomicUsize>,
    /// The `namespace` of every Generate call, in order.
    namespaces: Arc<std::sync::Mutex<Vec<String>>>,
    /// `Stats` calls answered.
    stats_calls: Arc<AtomicUsize>,
    /// Every stream breaks (as a dying worker's would) after this many tokens.
    die_after: Option<usize>,
    /// Every stream goes silent (as a stopped worker's would) after this many tokens.
    stall_after: Option<usize>,
    /// The `max_tokens` of every Generate call, in order.
    max_tokens_seen: Arc<std::sync::Mutex<Vec<u32>>>,
    /// The prompt length and the number of `kv_profile_queries` of every Generate call, in order.
    profile_queries_seen: Arc<std::sync::Mutex<Vec<(usize, usize)>>>,
    /// Every Generate is refused as a full admission queue would refuse it.
    busy: bool,
    /// Every Generate call, in order.
    requests_seen: Arc<std::sync::Mutex<Vec<GenerateRequest>>>,
    /// Every stream that scores its prompt breaks after this many messages of scores.
    scores_die_after: Option<usize>,
    /// The role its health announces (`prefill`, `decode`; empty: both).
    role: &'static str,
    /// `Stats.blocks_total` (default 100).
    blocks_total: Option<u64>,
    /// `Stats` also names tiers, prefix hits, evictions and EvicPress state, as a tiered worker's does.
    rich_stats: bool,
    /// Takes run-time LoRA loads, as a worker with `--lora-dir` and `--max-loras 3` does: a `lora_path` starting
    /// with `missing` is refused as a path that does not open, one starting with `vanished` with NotFound.
    lora_dir: bool,
    /// Loaded adapters: name → path.
    loras: Arc<std::sync::Mutex<std::collections::BTreeMap<String, String>>>,
    /// Every LoadLora and UnloadLora call, in order: `load NAME`, `replace NAME` or `unload NAME`.
    lora_calls: Arc<std::sync::Mutex<Vec<String>>>,
    /// Every LoadLora takes this long before it changes anything (as reading a large adapter does).
    lora_load_delay: Option<Duration>,
    /// Every stream waits this long before its first message (as a long prefill does).
    first_message_delay: Option<Duration>,
}

/// Most adapters the fake holds at once.
const FAKE_MAX_LORAS: usize = 3;

/// The fake's log-probabilities for the reply's token at `position` (when `top_n` asks for them), as a greedy
/// model's: the token at `-position / 100` is the most likely, then `'0'`, `'1'`, ... each 1 less likely.
fn fake_logprobs(top_n: Option<usize>, token: u32, position: usize) -> Vec<TokenLogprobs> {
    let Some(n) = top_n else { return Vec::new() };
    let logprob = -(position as f32) / 100.0;
    let top_token_ids: Vec<u32> = std::iter::once(token).chain(u32::from(b'0')..).take(n).collect();
    let top_logprobs = (0..n).map(|k| logprob - k as f32).collect();
    vec![TokenLogprobs { logprob, top_token_ids, top_logprobs }]
}

struct OpenGuard(Arc<AtomicUsize>);
impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

type GenStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Worker for Fake {
    type GenerateStream = GenStream;

    async fn generate(&self, req: Request<GenerateRequest>) -> Result<Response<GenStream>, Status> {
        let req = req.into_inner();
        self.namespaces.lock().unwrap().push(req.namespace.clone());
        if req.prompt_token_ids.is_empty() {
            return Err(Status::invalid_argument("empty prompt"));
        }
        let prompt =
            String::from_utf8_lossy(&req.prompt_token_ids.iter().map(|&t| t as u8).collect::<Vec<_>>()).into_owned();
        if prompt.contains("overload") {
            return Err(Status::resource_exhausted("the request needs more KV blocks than the pool has"));
        }
        // "enormous": more KV blocks than the pool has at all, refused as a real worker refuses it.
        if prompt.contains("enormous") {
            use pagoda_worker::engine::EngineError;
            use pagoda_worker::scheduler::SchedError;
            let too_large = EngineError::Rejected(SchedError::TooLargeForPool { needed: 40, capacity: 8 });
            return Err(pagoda_worker::service::status_from_engine(&too_large));
        }
        if self.busy {
            let mut st = Status::resource_exhausted("worker busy: 8 requests wait for their first token");
            st.metadata_mut().insert(pagoda_proto::BUSY_RETRY_AFTER_MS, "2500".parse().unwrap());
            return Err(st);
        }
        // "forever" in the prompt: an endless slow stream, for the disconnect test.
        let forever = prompt.contains("forever");
        // "flood" in the prompt: an endless stream of 256-token messages, as fast as the router takes them.
        let flood = prompt.contains("flood");
        // "fail" in the prompt: the stream breaks after three tokens.
        let fail = prompt.contains("fail");
        // "deadend" in the prompt: after two tokens the guide leaves no token, as the real worker reports it.
        let dead_end = prompt.contains("deadend");
        let prompt_tokens = req.prompt_token_ids.len() as u32;
        let max = req.max_tokens as usize;
        self.max_tokens_seen.lock().unwrap().push(req.max_tokens);
        self.profile_queries_seen.lock().unwrap().push((req.prompt_token_ids.len(), req.kv_profile_queries.len()));
        self.requests_seen.lock().unwrap().push(req.clone());
        // Like a deterministic model, continue the reply from whatever part of it already ends the prompt (a
        // migrated request carries the tokens produced so far).
        let answer = prompt.rsplit_once("assistant:").map_or("", |(_, a)| a);
        let resumed = if REPLY.as_bytes().starts_with(answer.as_bytes()) { answer.len() } else { 0 };
        let (die_after, stall_after, first_delay) = (self.die_after, self.stall_after, self.first_message_delay);
        self.open.fetch_add(1, Ordering::SeqCst);
        self.started.fetch_add(1, Ordering::SeqCst);
        let guard = OpenGuard(self.open.clone());
        let reply: Vec<u32> = REPLY.bytes().map(u32::from).collect();
        let top_n = req.logprobs.then_some(req.top_logprobs as usize);
        // What a real worker reports at a stop: the token it stopped on (here the last of the stop ids it was sent:
        // the request's own when it gave some, else the model's end token).
        let stop_token = req.stop_token_ids.last().copied();
        let s = futures::stream::unfold((0usize, Some(guard)), move |(i, guard)| {
            let reply = reply[resumed..].to_vec();
            async move {
                let guard = guard?;
                if let Some(delay) = first_delay.filter(|_| i == 0) {
                    tokio::time::sleep(delay).await;
                }
                if die_after == Some(i) {
                    return Some((Err(Status::unavailable("connection reset")), (i, None)));
                }
                if stall_after == Some(i) {
                    std::future::pending::<()>().await;
                }
                if flood {
                    tokio::task::yield_now().await;
                    let message = GenerateResponse { token_ids: vec![u32::from(b'a'); 256], ..Default::default() };
                    return Some((Ok(message), (i + 1, Some(guard))));
                }
                if forever {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let token = u32::from(b'a');
                    let logprobs = fake_logprobs(top_n, token, resumed + i);
                    return Some((
                        Ok(GenerateResponse { token_ids: vec![token], logprobs, ..Default::default() }),
                        (i + 1, Some(guard)),
                    ));
                }
                let finish = |reason: FinishReason, n: usize| GenerateResponse {
                    finished: Some(Finished {
                        reason: reason as i32,
                        usage: Some(Usage { prompt_tokens, completion_tokens: n as u32, cached_tokens: 0 }),
                        // What this stand-in's queue held it for: a quarter of a second.
                        queue_seconds: 0.25,
                        stop_token_id: stop_token.filter(|_| reason == FinishReason::Stop),
                    }),
                    ..Default::default()
                };
                if fail && i == 3 {
                    return Some((Err(Status::internal("forward step failed")), (i, None)));
                }
                if dead_end && i == 2 {
                    let err = pagoda_worker::sampling::SampleError::NoTokenFits { guide: "regex-guided", generated: 2 };
                    return Some((Err(Status::invalid_argument(err.to_string())), (i, None)));
                }
                if i == max {
                    return Some((Ok(finish(FinishReason::Length, i)), (i, None)));
                }
                if i == reply.len() {
                    return Some((Ok(finish(FinishReason::Stop, i)), (i, None)));
                }
                let logprobs = fake_logprobs(top_n, reply[i], resumed + i);
                Some((
                    Ok(GenerateResponse { token_ids: vec![reply[i]], logprobs, ..Default::default() }),
                    (i + 1, Some(guard)),
                ))
            }
        });
        // Asked to score the prompt: its scores come first, three positions per message (position q at -q / 10);
        // `scores_die_after` breaks the stream after that many such messages.
        let mut scores: Vec<Result<GenerateResponse, Status>> = Vec::new();
        if req.prompt_logprobs {
            let n = Some(req.top_logprobs as usize);
            let positions: Vec<usize> = (1..req.prompt_token_ids.len()).collect();
            for chunk in positions.chunks(3) {
                let prompt_logprobs =
                    chunk.iter().flat_map(|&q| fake_logprobs(n, req.prompt_token_ids[q], 10 * q)).collect();
                scores.push(Ok(GenerateResponse { prompt_logprobs, ..Default::default() }));
                if self.scores_die_after == Some(scores.len()) {
                    scores.push(Err(Status::unavailable("connection reset")));
                    break;
                }
            }
        }
        let s = futures::StreamExt::chain(futures::stream::iter(scores), s);
        Ok(Response::new(Box::pin(s)))
    }

    async fn load_lora(
        &self,
        req: Request<pagoda_proto::worker::LoadLoraRequest>,
    ) -> Result<Response<pagoda_proto::worker::LoadLoraResponse>, Status> {
        if !self.lora_dir {
            return Err(Status::failed_precondition(
                "run-time LoRA loading is off on this worker: start it with --lora-dir",
            ));
        }
        let pagoda_proto::worker::LoadLoraRequest { name, path, replace } = req.into_inner();
        self.lora_calls.lock().unwrap().push(format!("{} {name}", if replace { "replace" } else { "load" }));
        if let Some(delay) = self.lora_load_delay {
            tokio::time::sleep(delay).await;
        }
        let mut loras = self.loras.lock().unwrap();
        let present = loras.contains_key(&name);
        if present && !replace {
            return Err(Status::already_exists(format!("LoRA adapter {name:?} is already loaded")));
        }
        // A replace takes the old adapter's slot, as the worker's does.
        if !present && loras.len() >= FAKE_MAX_LORAS {
            return Err(Status::resource_exhausted(format!("{FAKE_MAX_LORAS} LoRA adapters are loaded already")));
        }
        if path.starts_with("missing") {
            return Err(Status::invalid_argument(format!("lora_path {path:?}: cannot open it")));
        }
        if path.starts_with("vanished") {
            return Err(Status::not_found(format!("no adapter directory {path:?}")));
        }
        loras.insert(name.clone(), path.clone());
        let adapter = pagoda_proto::worker::LoraAdapterInfo { name, cache_id: path, rank: 8, on_demand: false };
        Ok(Response::new(pagoda_proto::worker::LoadLoraResponse { adapter: Some(adapter) }))
    }

    async fn unload_lora(
        &self,
        req: Request<pagoda_proto::worker::UnloadLoraRequest>,
    ) -> Result<Response<pagoda_proto::worker::UnloadLoraResponse>, Status> {
        let name = req.into_inner().name;
        self.lora_calls.lock().unwrap().push(format!("unload {name}"));
        match self.loras.lock().unwrap().remove(&name) {
            Some(_) => Ok(Response::new(pagoda_proto::worker::UnloadLoraResponse {})),
            None => Err(Status::not_found("not loaded")),
        }
    }

    async fn health(&self, _: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        Ok(Response::new(HealthResponse {
            ready: true,
            model: MODEL.into(),
            context_length: CONTEXT as u32,
            block_size: 16,
            kv_group_size: 2,
            worker_id: String::new(),
            role: self.role.into(),
            ..HealthResponse::default()
        }))
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<StatsResponse>, Status> {
        self.stats_calls.fetch_add(1, Ordering::SeqCst);
        use pagoda_proto::worker::{
            EvicPressStats, PolicyEvictions, TierContexts, TierHits, TierUsage, VariantQuality,
        };
        let open = self.open.load(Ordering::SeqCst) as u64;
        let blocks_total = self.blocks_total.unwrap_or(100);
        let mut stats = StatsResponse {
            blocks_total,
            blocks_used: open * 3,
            blocks_free: blocks_total - open * 3,
            running: open,
            ..Default::default()
        };
        if self.rich_stats {
            stats.tiers =
                vec![TierUsage { tier: "host".into(), codec: "int8".into(), used_bytes: 1, capacity_bytes: 2 }];
            stats.prefix_hits = vec![TierHits { tier: "host".into(), tokens: 3 }];
            stats.evictions = vec![PolicyEvictions { policy: "snapkv".into(), evicted_slots: 4, freed_blocks: 5 }];
            stats.evicpress = Some(EvicPressStats {
                contexts: 1,
                placed: vec![TierContexts { tier: "host".into(), contexts: 1 }],
                variants: vec![VariantQuality {
                    variant: "int4".into(),
                    mean_quality: 0.5,
                    mean_embedding_similarity: Some(0.5),
                }],
                ..Default::default()
            });
        }
        Ok(Response::new(stats))
    }

    /// The fake computes no KV, so it holds none.
    async fn residency(
        &self,
        _: Request<pagoda_proto::worker::ResidencyRequest>,
    ) -> Result<Response<pagoda_proto::worker::ResidencyResponse>, Status> {
        Ok(Response::new(pagoda_proto::worker::ResidencyResponse::default()))
    }
}

struct Cluster {
    http: String,
    open: Arc<AtomicUsize>,
    started: Arc<AtomicUsize>,
    client: reqwest::Client,
}

async fn spawn_worker(fake: Fake) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(async move {
        tonic::transport::Server::builder().add_service(WorkerServer::new(fake)).serve_with_incoming(incoming).await
    });
    addr
}

async fn spawn_router(workers: Vec<String>, body_limit: usize) -> String {
    spawn_router_with(workers, body_limit, Security::default(), Strategy::Kv).await
}

async fn spawn_router_placing(workers: Vec<String>, body_limit: usize, strategy: Strategy) -> String {
    spawn_router_with(workers, body_limit, Security::default(), strategy).await
}

async fn spawn_router_with(workers: Vec<String>, body_limit: usize, security: Security, strategy: Strategy) -> String {
    serve_router(RouterConfig {
        workers,
        body_limit,
        health_interval: Duration::from_millis(100),
        placement: PlacerConfig { strategy, ..PlacerConfig::default() },
        security,
        ..RouterConfig::default()
    })
    .await
}

async fn cluster_with_limit(body_limit: usize) -> Cluster {
    cluster_of(Fake::default(), body_limit).await
}

/// A ready router over the one worker `fake`.
async fn cluster_of(fake: Fake, body_limit: usize) -> Cluster {
    let (open, started) = (fake.open.clone(), fake.started.clone());
    let waddr = spawn_worker(fake).await;
    let http = spawn_router(vec![waddr.to_string()], body_limit).await;
    let client = reqwest::Client::new();
    wait_ready(&client, &http).await;
    Cluster { http, open, started, client }
}

async fn cluster() -> Cluster {
    cluster_with_limit(pagoda_router::DEFAULT_BODY_LIMIT).await
}

impl Cluster {
    async fn post(&self, path: &str, body: impl Into<reqwest::Body>) -> (u16, String) {
        let r = self
            .client
            .post(format!("{}{path}", self.http))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.text().await.unwrap())
    }

    /// POSTs `body` and expects a 200; the body text.
    async fn post_ok(&self, path: &str, body: &Value) -> String {
        let (s, text) = self.post(path, body.to_string()).await;
        assert_eq!(s, 200, "{text}");
        text
    }

    async fn chat(&self, body: Value) -> (u16, Value) {
        let (s, text) = self.post("/v1/chat/completions", body.to_string()).await;
        (s, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
    }

    /// Checks the server still answers a normal request.
    async fn still_serves(&self) {
        let (s, v) = self.chat(json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})).await;
        assert_eq!(s, 200, "{v}");
    }
}

/// Posts each case and checks that it is a 400 naming `param` whose message contains `why`.
async fn assert_refused(c: &Cluster, cases: &[(&str, Value, &str, &str)]) {
    for (path, body, param, why) in cases {
        let (s, text) = c.post(path, body.to_string()).await;
        let v = assert_error(s, &text, 400);
        assert_eq!(v["error"]["param"], *param, "{body}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(why), "{body}: {v}");
    }
}

fn assert_error(status: u16, body: &str, want: u16) -> Value {
    assert_eq!(status, want, "{body}");
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("error body is not JSON ({e}): {body}"));
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    v
}

/// `/tokenize` gives a prompt's ids, or a chat's after the template with the count a chat completion reports as
/// `prompt_tokens`; `/detokenize` inverts it; bad input is a 400 naming the field.
#[tokio::test]
async fn tokenize_and_detokenize() {
    let c = cluster().await;
    let json = |(s, text): (u16, String)| -> (u16, Value) { (s, serde_json::from_str(&text).unwrap()) };
    let (s, v) = json(c.post("/tokenize", json!({"prompt": "hi", "return_token_strs": true}).to_string()).await);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v, json!({"count": 2, "max_model_len": CONTEXT, "tokens": [104, 105], "token_strs": ["h", "i"]}));
    let messages = json!([{"role": "user", "content": "Capital of France?"}]);
    let (s, v) = json(c.post("/tokenize", json!({"model": MODEL, "messages": messages}).to_string()).await);
    assert_eq!(s, 200, "{v}");
    assert!(v.get("token_strs").is_none(), "{v}");
    let (_, chat) = c.chat(json!({"model": MODEL, "messages": messages})).await;
    assert_eq!(v["count"], chat["usage"]["prompt_tokens"], "{v} {chat}");
    let (s, v) = json(c.post("/detokenize", json!({"tokens": v["tokens"]}).to_string()).await);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["prompt"], "user: Capital of France?\nassistant:");

    for (path, body, want, param) in [
        ("/tokenize", json!({"prompt": "a", "messages": messages}), 400, "prompt"),
        ("/tokenize", json!({}), 400, "prompt"),
        ("/tokenize", json!({"messages": []}), 400, "messages"),
        ("/tokenize", json!({"messages": messages, "add_special_tokens": false}), 400, "add_special_tokens"),
        ("/tokenize", json!({"prompt": "a", "model": "gpt-5"}), 404, "model"),
        ("/tokenize", json!({"prompt": "a", "extra": 1}), 400, ""),
        ("/detokenize", json!({"tokens": [104, 257]}), 400, "tokens[1]"),
        ("/detokenize", json!({"tokens": [-1]}), 400, "tokens[0]"),
        ("/detokenize", json!({"tokens": "hi"}), 400, "tokens"),
    ] {
        let (s, text) = c.post(path, body.to_string()).await;
        let v = assert_error(s, &text, want);
        if !param.is_empty() {
            assert_eq!(v["error"]["param"], param, "{path} {body}: {v}");
        }
    }
    let (s, text) = c.post("/detokenize", json!({"tokens": vec![1; (1 << 16) + 1]}).to_string()).await;
    assert_error(s, &text, 400);
    c.still_serves().await;
}

/// vLLM's chat rendering fields and `truncate_prompt_tokens`: what the worker is sent follows them (`/tokenize`
/// and the usage count show it), and their bad combinations are 400s naming the field, as are bad
/// `allowed_token_ids` and `bad_words`.
#[tokio::test]
async fn chat_rendering_and_prompt_truncation() {
    let c = cluster().await;
    let detok = |v: &Value| -> String {
        v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u8 as char).collect()
    };
    let question = json!({"role": "user", "content": "Capital of France?"});
    let started = json!([question, {"role": "assistant", "content": "The capital is"}]);
    let tokenize = |body: Value| {
        let c = &c;
        async move { serde_json::from_str::<Value>(&c.post_ok("/tokenize", &body).await).unwrap() }
    };
    let v = tokenize(json!({"messages": started, "continue_final_message": true})).await;
    assert_eq!(detok(&v), "user: Capital of France?\nassistant: The capital is");
    let v = tokenize(json!({"messages": [question], "add_generation_prompt": false})).await;
    assert_eq!(detok(&v), "user: Capital of France?\n");

    let (s, v) = c.chat(json!({"model": MODEL, "messages": started, "continue_final_message": true})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], "user: Capital of France?\nassistant: The capital is".len());
    let (s, v) = c.chat(json!({"model": MODEL, "messages": [question], "truncate_prompt_tokens": 10})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 10);
    // A prompt shorter than the limit is kept whole; completions truncate every prompt of a batch.
    let (s, v) = c.chat(json!({"model": MODEL, "messages": [question], "truncate_prompt_tokens": 1000})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], "user: Capital of France?\nassistant:".len());
    let body = json!({"model": MODEL, "prompt": ["abcdefghij", "hijklmnop"], "max_tokens": 3,
                      "truncate_prompt_tokens": 4});
    let v: Value = serde_json::from_str(&c.post_ok("/v1/completions", &body).await).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], 8, "{v}");

    let chat = |extra: Value| {
        let mut body = json!({"model": MODEL, "messages": [question]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    assert_refused(
        &c,
        &[
            ("/v1/chat/completions", chat(json!({"continue_final_message": true})), "continue_final_message",
             "the assistant's"),
            ("/v1/chat/completions",
             json!({"model": MODEL, "messages": started, "continue_final_message": true, "add_generation_prompt": true}),
             "continue_final_message", "cannot be combined"),
            ("/v1/chat/completions", chat(json!({"truncate_prompt_tokens": 0})), "truncate_prompt_tokens", "between 1"),
            ("/v1/completions", json!({"model": MODEL, "prompt": "x", "truncate_prompt_tokens": -1}),
             "truncate_prompt_tokens", "between 1"),
            ("/tokenize", json!({"prompt": "x", "add_generation_prompt": false}), "add_generation_prompt",
             "apply to `messages`"),
            ("/v1/chat/completions", chat(json!({"allowed_token_ids": []})), "allowed_token_ids", "at least one"),
            ("/v1/chat/completions", chat(json!({"allowed_token_ids": [1, 257]})), "allowed_token_ids[1]",
             "not in the vocabulary"),
            ("/v1/completions", json!({"model": MODEL, "prompt": "x", "allowed_token_ids": "a"}), "allowed_token_ids",
             "array of token ids"),
            // One token per byte here: 40 tokens, over the worker's 32.
            ("/v1/chat/completions", chat(json!({"bad_words": ["x".repeat(40)]})), "bad_words", "1 to 32"),
            ("/v1/completions", json!({"model": MODEL, "prompt": "x", "bad_words": [""]}), "bad_words[0]", "with text"),
        ],
    )
    .await;
    c.still_serves().await;
}

#[tokio::test]
async fn chat_non_streaming() {
    let c = cluster().await;
    let (s, v) = c.chat(json!({"model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}]})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], REPLY);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["stop_reason"], Value::Null, "the model's end token is no stop_reason (vLLM's rule)");
    let prompt_len = "user: Capital of France?\nassistant:".len() as u64;
    assert_eq!(v["usage"]["prompt_tokens"], prompt_len);
    assert_eq!(v["usage"]["completion_tokens"], REPLY.len() as u64);
    assert_eq!(v["usage"]["total_tokens"], prompt_len + REPLY.len() as u64);
}

#[tokio::test]
async fn max_tokens_gives_length() {
    let c = cluster().await;
    let (s, v) = c.chat(json!({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "Paris");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
}

#[tokio::test]
async fn stop_string_truncates_and_cancels() {
    let c = cluster().await;
    let (s, v) =
        c.chat(json!({"model": MODEL, "stop": ["END", "zzz"], "messages": [{"role": "user", "content": "x"}]})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "Paris is the capital of France. ünïcødé 🦀 ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["stop_reason"], "END", "the stop string that matched");
    // The worker stream was dropped at the stop string.
    assert!(streams_close(&c.open).await, "worker stream still open after a stop string");
}

/// Parses an SSE body strictly: every event is exactly `data: <payload>\n\n`.
fn sse_payloads(body: &str) -> Vec<String> {
    assert!(body.ends_with("\n\n"), "{body:?}");
    body.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|ev| {
            assert!(!ev.contains('\n'), "multi-line event {ev:?}");
            ev.strip_prefix("data: ").unwrap_or_else(|| panic!("not a data line: {ev:?}")).to_string()
        })
        .collect()
}

#[tokio::test]
async fn chat_streaming_exact_format() {
    let c = cluster().await;
    let r = c
        .client
        .post(format!("{}/v1/chat/completions", c.http))
        .json(&json!({"model": MODEL, "stream": true, "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let body = r.text().await.unwrap();
    let payloads = sse_payloads(&body);
    assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = payloads[..payloads.len() - 1].iter().map(|p| serde_json::from_str(p).unwrap()).collect();
    let id = chunks[0]["id"].as_str().unwrap();
    for ch in &chunks {
        assert_eq!(ch["object"], "chat.completion.chunk");
        assert_eq!(ch["id"], id);
        assert_eq!(ch["model"], MODEL);
        assert!(ch["created"].is_u64());
        assert!(ch.get("usage").is_some(), "include_usage puts usage on every chunk: {ch}");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    assert!(chunks[0]["choices"][0]["finish_reason"].is_null());
    let n = chunks.len();
    let text: String =
        chunks[1..n - 2].iter().map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap().to_string()).collect();
    assert_eq!(text, REPLY);
    for c in &chunks[1..n - 2] {
        assert!(c["choices"][0]["delta"].get("role").is_none());
        assert!(c["usage"].is_null());
    }
    assert_eq!(chunks[n - 2]["choices"][0]["delta"], json!({}));
    assert_eq!(chunks[n - 2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks[n - 1]["choices"], json!([]));
    assert_eq!(chunks[n - 1]["usage"]["completion_tokens"], REPLY.len() as u64);
    assert_eq!(
        chunks[n - 1]["usage"]["total_tokens"].as_u64().unwrap(),
        chunks[n - 1]["usage"]["prompt_tokens"].as_u64().unwrap() + REPLY.len() as u64
    );
}

/// vLLM's `stream_options.continuous_usage_stats`: every chunk of a choice carries its usage so far (prompt, tokens
/// generated, total; no cached count until the finish chunk), the counts only grow, and the finish chunk and the
/// last one carry the final usage. Without `include_usage` it changes nothing.
#[tokio::test]
async fn continuous_usage_stats_put_the_usage_so_far_on_every_chunk() {
    let c = cluster().await;
    for (path, body) in [
        ("/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}]})),
        ("/v1/completions", json!({"model": MODEL, "prompt": "xyz"})),
    ] {
        let mut body = body;
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
        let text = c.post_ok(path, &body).await;
        let payloads = sse_payloads(&text);
        assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
        let chunks: Vec<Value> =
            payloads[..payloads.len() - 1].iter().map(|p| serde_json::from_str(p).unwrap()).collect();
        let n = chunks.len();
        let last = &chunks[n - 1]["usage"];
        assert_eq!(last["completion_tokens"], REPLY.len() as u64, "{path}: {text}");
        let prompt = last["prompt_tokens"].as_u64().unwrap();
        let mut so_far = 0;
        for ch in &chunks[..n - 2] {
            let u = &ch["usage"];
            assert_eq!(u["prompt_tokens"], prompt, "{path}: {ch}");
            let done = u["completion_tokens"].as_u64().unwrap();
            assert!(done >= so_far && done <= REPLY.len() as u64, "{path}: {ch}");
            assert_eq!(u["total_tokens"].as_u64(), Some(prompt + done), "{path}: {ch}");
            assert!(u.get("prompt_tokens_details").is_none(), "{path}: {ch}");
            so_far = done;
        }
        assert!(so_far > 0, "{path}: text chunks count their tokens: {text}");
        let finish = &chunks[n - 2];
        assert!(finish["choices"][0]["finish_reason"].is_string(), "{path}: {finish}");
        assert_eq!(finish["usage"], *last, "{path}");
        assert!(last["prompt_tokens_details"]["cached_tokens"].is_u64(), "{path}: {last}");
    }
    // Without include_usage the option adds nothing.
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": true,
                      "stream_options": {"continuous_usage_stats": true}});
    let text = c.post_ok("/v1/chat/completions", &body).await;
    assert!(!text.contains("\"usage\""), "{text}");
}

#[tokio::test]
async fn streaming_without_usage_and_completions_endpoint() {
    let c = cluster().await;
    let (s, body) = c
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "stream": true, "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]})
                .to_string(),
        )
        .await;
    assert_eq!(s, 200);
    let p = sse_payloads(&body);
    assert_eq!(p.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(&p[p.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(p.iter().all(|x| !x.contains("\"usage\"")));

    let (s, body) =
        c.post("/v1/completions", json!({"model": MODEL, "prompt": "Once", "max_tokens": 5}).to_string()).await;
    assert_eq!(s, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "Paris");
    assert_eq!(v["usage"]["prompt_tokens"], 4);

    let (s, body) = c
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": [80, 81], "max_tokens": 2, "stream": true}).to_string(),
        )
        .await;
    assert_eq!(s, 200, "{body}");
    let p = sse_payloads(&body);
    assert_eq!(p.last().unwrap(), "[DONE]");
    let first: Value = serde_json::from_str(&p[0]).unwrap();
    assert_eq!(first["object"], "text_completion");
    let text: String = p[..p.len() - 1]
        .iter()
        .map(|x| serde_json::from_str::<Value>(x).unwrap()["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, "Pa");
}

#[tokio::test]
async fn bad_inputs_get_openai_errors_and_server_keeps_serving() {
    let c = cluster_with_limit(64 * 1024).await;
    let user = json!([{"role": "user", "content": "x"}]);
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("malformed json", b"{\"model\": ".to_vec(), 400),
        ("not an object", b"[1,2]".to_vec(), 400),
        ("empty body", Vec::new(), 400),
        ("wrong type", json!({"model": MODEL, "messages": "hello"}).to_string().into_bytes(), 400),
        ("empty messages", json!({"model": MODEL, "messages": []}).to_string().into_bytes(), 400),
        (
            "unknown role",
            json!({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).to_string().into_bytes(),
            400,
        ),
        ("max_tokens 0", json!({"model": MODEL, "messages": user, "max_tokens": 0}).to_string().into_bytes(), 400),
        (
            "max_tokens negative",
            json!({"model": MODEL, "messages": user, "max_tokens": -1}).to_string().into_bytes(),
            400,
        ),
        (
            "max_tokens over context",
            json!({"model": MODEL, "messages": user, "max_tokens": CONTEXT + 1}).to_string().into_bytes(),
            400,
        ),
        ("unknown model", json!({"model": "gpt-9", "messages": user}).to_string().into_bytes(), 404),
        ("kv policy", json!({"model": MODEL, "messages": user, "kv": {"policy": "lru"}}).to_string().into_bytes(), 400),
        ("n=17", json!({"model": MODEL, "messages": user, "n": 17}).to_string().into_bytes(), 400),
        (
            "invalid utf-8",
            b"{\"model\": \"fake-model\", \"messages\": [{\"role\": \"user\", \"content\": \"\xc3\x28\"}]}".to_vec(),
            400,
        ),
        (
            "too large",
            format!(
                "{{\"model\": \"{MODEL}\", \"messages\": [{{\"role\": \"user\", \"content\": \"{}\"}}]}}",
                "a".repeat(70 * 1024)
            )
            .into_bytes(),
            413,
        ),
    ];
    for (name, body, want) in cases {
        let (s, text) = c.post("/v1/chat/completions", body).await;
        let v = assert_error(s, &text, want);
        eprintln!("{name}: {v}");
        c.still_serves().await;
    }
    // Prompt longer than the context: both lengths in the message.
    let long = "y".repeat(CONTEXT * 2);
    let (s, text) = c
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": long}]}).to_string(),
        )
        .await;
    let v = assert_error(s, &text, 400);
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&CONTEXT.to_string()) && msg.contains(&format!("user: {long}\nassistant:").len().to_string()),
        "{msg}"
    );
    // Unknown route and wrong method are JSON too.
    let r = c.client.get(format!("{}/v1/nope", c.http)).send().await.unwrap();
    let s = r.status().as_u16();
    assert_error(s, &r.text().await.unwrap(), 404);
    let r = c.client.get(format!("{}/v1/chat/completions", c.http)).send().await.unwrap();
    let s = r.status().as_u16();
    assert_error(s, &r.text().await.unwrap(), 405);
    // Nothing reached the worker except the successful requests.
    c.still_serves().await;
}

#[tokio::test]
async fn client_disconnect_cancels_worker_stream() {
    let c = cluster().await;
    let mut r = c
        .client
        .post(format!("{}/v1/chat/completions", c.http))
        .json(&json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "talk forever"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Read a few chunks, then hang up.
    for _ in 0..3 {
        r.chunk().await.unwrap().unwrap();
    }
    assert_eq!(c.open.load(Ordering::SeqCst), 1);
    let metrics = c.client.get(format!("{}/metrics", c.http)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("pagoda_router_worker_running_sequences{worker="), "{metrics}");
    drop(r);
    for _ in 0..200 {
        if c.open.load(Ordering::SeqCst) == 0 {
            assert_eq!(c.started.load(Ordering::SeqCst), 1);
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("worker stream still open after the client disconnected");
}

#[tokio::test]
async fn models_health_ready_metrics() {
    let c = cluster().await;
    let v: Value = c.client.get(format!("{}/v1/models", c.http)).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);
    // OpenAI's retrieve: the same card, and a 404 naming an unknown model (its id cut short).
    let r = c.client.get(format!("{}/v1/models/{MODEL}", c.http)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let card: Value = r.json().await.unwrap();
    assert_eq!(card, v["data"][0]);
    for unknown in ["gpt-5".to_string(), format!("{MODEL}/x"), "m".repeat(5000)] {
        let r = c.client.get(format!("{}/v1/models/{unknown}", c.http)).send().await.unwrap();
        let s = r.status().as_u16();
        let body = r.text().await.unwrap();
        let e = assert_error(s, &body, 404);
        assert_eq!(e["error"]["code"], "model_not_found", "{body}");
        assert!(body.len() < 1024, "{body}");
    }
    let r = c.client.get(format!("{}/healthz", c.http)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = c.client.get(format!("{}/health", c.http)).send().await.unwrap();
    assert_eq!((r.status().as_u16(), r.text().await.unwrap()), (200, String::new()));
    let v: Value = c.client.get(format!("{}/version", c.http)).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    c.still_serves().await;
    let r = c.client.get(format!("{}/metrics", c.http)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    for name in [
        "pagoda_router_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}",
        "pagoda_router_ttft_seconds_count 1",
        "pagoda_router_queue_seconds_count 1",
        "pagoda_router_queue_seconds_sum 0.25",
        "pagoda_router_inter_token_latency_seconds_count",
        "pagoda_router_prompt_tokens_total",
        "pagoda_router_completion_tokens_total",
        "pagoda_router_worker_used_blocks{worker=",
        "pagoda_router_worker_capacity_blocks{worker=",
    ] {
        assert!(text.contains(name), "missing {name}:\n{text}");
    }
}

#[tokio::test]
async fn not_ready_without_worker_then_ready() {
    // Reserve a port, start the router pointing at it, then start the worker there.
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let waddr = probe.local_addr().unwrap();
    drop(probe);
    let http = spawn_router(vec![waddr.to_string()], 1024).await;
    let client = reqwest::Client::new();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = client.get(format!("{http}/readyz")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(client.get(format!("{http}/healthz")).send().await.unwrap().status(), 200);
    assert_eq!(client.get(format!("{http}/health")).send().await.unwrap().status(), 503, "vLLM's /health: not ready");
    let r = client
        .post(format!("{http}/v1/chat/completions"))
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    assert_error(s, &r.text().await.unwrap(), 503);

    let listener = tokio::net::TcpListener::bind(waddr).await.unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(WorkerServer::new(Fake::default()))
            .serve_with_incoming(incoming)
            .await
    });
    for _ in 0..100 {
        if client.get(format!("{http}/readyz")).send().await.unwrap().status() == 200 {
            assert_eq!(client.get(format!("{http}/health")).send().await.unwrap().status(), 200);
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("router never became ready after the worker started");
}

/// Two fake workers behind a router with `strategy`, both ready; returns the router URL and each worker's count of
/// started requests.
async fn two_workers(strategy: Strategy) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let (a, b) = (Fake::default(), Fake::default());
    let (sa, sb) = (a.started.clone(), b.started.clone());
    let wa = spawn_worker(a).await;
    let wb = spawn_worker(b).await;
    let http = spawn_router_placing(vec![wa.to_string(), wb.to_string()], 1 << 20, strategy).await;
    let client = reqwest::Client::new();
    for _ in 0..100 {
        let v: Value = client.get(format!("{http}/readyz")).send().await.unwrap().json().await.unwrap();
        if v["workers"].as_array().unwrap().iter().all(|w| w["ready"] == true) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (http, sa, sb)
}

#[tokio::test]
async fn kv_placement_sends_a_repeated_prefix_to_the_worker_that_has_it() {
    let (http, sa, sb) = two_workers(Strategy::Kv).await;
    let client = reqwest::Client::new();
    let chat = |content: &str, stream: bool| {
        client.post(format!("{http}/v1/chat/completions")).json(&json!({
            "model": MODEL, "max_tokens": 2, "stream": stream, "messages": [{"role": "user", "content": content}]
        }))
    };
    // 100 bytes = 6 full 16-token blocks with the byte codec: the router predicts them where it places the first.
    let long = "a shared system prompt that every turn of this conversation repeats verbatim, padded to 100 bytes..";
    assert_eq!(chat(long, false).send().await.unwrap().status(), 200);
    let holder = if sa.load(Ordering::SeqCst) == 1 { sa.clone() } else { sb.clone() };
    // Make the prefix holder the busier worker: an endless stream decoding there (ties go by a rank hashed from the
    // worker's address and the prompt, and the holder is idle now, so an equal-cost short prompt may or may not land
    // on the holder; either way check where it went).
    let mut busy = chat("forever", true).send().await.unwrap();
    assert_eq!(busy.status(), 200);
    busy.chunk().await.unwrap().expect("the endless stream started");
    let busy_on_holder = holder.load(Ordering::SeqCst) == 2;
    for _ in 0..3 {
        assert_eq!(chat(long, false).send().await.unwrap().status(), 200);
    }
    let on_holder = holder.load(Ordering::SeqCst) - 1 - busy_on_holder as usize;
    assert_eq!(on_holder, 3, "every repeat goes to the worker with the prefix (busy there: {busy_on_holder})");
    drop(busy);
    // The decisions are exported with their cost breakdown (admin endpoint; open without a keys file).
    let d: Value = client.get(format!("{http}/debug/placements")).send().await.unwrap().json().await.unwrap();
    let last = &d["decisions"][0];
    assert_eq!(last["strategy"], "kv");
    // The chat template wraps the 100 bytes, so the prompt has at least 6 full blocks.
    let blocks = last["prompt_blocks"].as_u64().unwrap();
    assert!(blocks >= 6, "{last}");
    let cands = last["candidates"].as_array().unwrap();
    assert_eq!(cands.len(), 2);
    assert!(cands.iter().any(|c| c["hits_device"] == blocks && c["worker"] == last["chosen"]), "{last}");
    assert!(cands.iter().all(|c| c["total_s"].as_f64().unwrap() > 0.0));

    // A dry run places the same way and changes nothing: no decision recorded, no request started.
    let started = sa.load(Ordering::SeqCst) + sb.load(Ordering::SeqCst);
    let place = |body: Value, query: &str| client.post(format!("{http}/debug/place{query}")).json(&body).send();
    let body = json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": long}]});
    let r = place(body.clone(), "").await.unwrap();
    assert_eq!(r.status(), 200);
    let dry: Value = r.json().await.unwrap();
    assert_eq!(dry["chosen"], last["chosen"], "{dry}");
    assert_eq!(dry["prompt_blocks"], blocks);
    assert_eq!(dry["request_id"], "debug-place");
    let again: Value = client.get(format!("{http}/debug/placements")).send().await.unwrap().json().await.unwrap();
    assert_eq!(again["decisions"].as_array().unwrap().len(), d["decisions"].as_array().unwrap().len());
    assert_eq!(sa.load(Ordering::SeqCst) + sb.load(Ordering::SeqCst), started);
    // Another tenant's namespace hashes the prompt apart: nothing is cached for it.
    let other: Value = place(body.clone(), "?tenant=other").await.unwrap().json().await.unwrap();
    assert!(other["candidates"].as_array().unwrap().iter().all(|c| c["hits_device"] == 0), "{other}");
    // Bad input gets the API's errors.
    let r = place(body.clone(), "?tenant=bad%20name").await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "tenant", "{v}");
    let r = place(json!({"model": MODEL, "messages": []}), "").await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].is_string(), "{v}");
}

#[tokio::test]
async fn round_robin_over_two_workers() {
    let (http, sa, sb) = two_workers(Strategy::RoundRobin).await;
    let client = reqwest::Client::new();
    for _ in 0..4 {
        let r = client
            .post(format!("{http}/v1/chat/completions"))
            .json(&json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    assert_eq!(sa.load(Ordering::SeqCst), 2);
    assert_eq!(sb.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn worker_errors_map_to_http_errors() {
    let c = cluster().await;
    // Refused before streaming: a proper status code.
    let (s, text) = c
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "overload"}]}).to_string(),
        )
        .await;
    let v = assert_error(s, &text, 429);
    assert_eq!(v["error"]["code"], "resource_exhausted");
    // Failing mid-stream: non-streaming gets a 500 error body ...
    let (s, text) = c
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "fail"}]}).to_string(),
        )
        .await;
    assert_error(s, &text, 500);
    // ... and streaming gets an error event, then [DONE].
    let (s, body) = c
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "fail"}]}).to_string(),
        )
        .await;
    assert_eq!(s, 200);
    let p = sse_payloads(&body);
    assert_eq!(p.last().unwrap(), "[DONE]");
    let err: Value = serde_json::from_str(&p[p.len() - 2]).unwrap();
    assert!(err["error"]["message"].as_str().unwrap().contains("forward step failed"), "{err}");
    c.still_serves().await;
}

/// A guided answer's dead end on the worker is the request's fault: a 400 (or, mid-stream, an error event) that
/// says why, never a silent "stop", and no migration to another worker, which would only reach it again.
#[tokio::test]
async fn a_guide_dead_end_is_a_request_error_and_is_not_retried() {
    let (a, b) = (Fake::default(), Fake::default());
    let (sa, sb) = (a.started.clone(), b.started.clone());
    let http = migrating_cluster(vec![a, b], migration(2000, 2)).await;
    let client = reqwest::Client::new();
    let body = |stream: bool| {
        json!({"model": MODEL, "stream": stream, "guided_regex": "b+",
            "messages": [{"role": "user", "content": "deadend"}]})
    };
    let r = client.post(format!("{http}/v1/chat/completions")).json(&body(false)).send().await.unwrap();
    let status = r.status().as_u16();
    let v = assert_error(status, &r.text().await.unwrap(), 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("dead end"), "{v}");
    let r = client.post(format!("{http}/v1/chat/completions")).json(&body(true)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let p = sse_payloads(&r.text().await.unwrap());
    assert_eq!(p.last().unwrap(), "[DONE]");
    let err: Value = serde_json::from_str(&p[p.len() - 2]).unwrap();
    assert!(err["error"]["message"].as_str().unwrap().contains("dead end"), "{err}");
    assert!(p.iter().all(|e| !e.contains("\"finish_reason\":\"stop\"")), "{p:?}");
    assert_eq!(sa.load(Ordering::SeqCst) + sb.load(Ordering::SeqCst), 2, "one attempt per request");
    assert_eq!(migrations_counted(&http, "worker_error").await, 0);
}

const KEY_A: &str = "sk-test-a-0123456789";
const KEY_B: &str = "sk-test-b-0123456789";
const ADMIN: &str = "sk-test-admin-0123456789";

/// Auth, limits and tenants over HTTP against the real router: keys map to tenants that reach the worker as the
/// cache namespace, the in-flight cap holds while a stream runs and frees on disconnect, the bucket refuses past
/// its burst with `Retry-After`, and `/debug/keys` needs the admin key. (The same against the real model is in
/// e2e/tests/security.rs.)
#[tokio::test]
async fn api_keys_tenants_limits_and_admin() {
    let keys = KeyTable::parse(
        &format!("{KEY_A} acme concurrency=1\n{KEY_B} globex rps=0.2 burst=2\n"),
        std::path::Path::new("keys"),
    )
    .unwrap();
    let admin = AdminKey::parse(ADMIN, std::path::Path::new("admin")).unwrap();
    let fake = Fake::default();
    let (open, namespaces) = (fake.open.clone(), fake.namespaces.clone());
    let waddr = spawn_worker(fake).await;
    let security = Security { keys: Some(Arc::new(keys)), admin: Some(admin) };
    let http =
        spawn_router_with(vec![waddr.to_string()], pagoda_router::DEFAULT_BODY_LIMIT, security, Strategy::Kv).await;
    let client = reqwest::Client::new();
    let hi = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let post = |key: Option<&str>, body: &Value| {
        let mut r = client.post(format!("{http}/v1/chat/completions")).json(body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    wait_ready(&client, &http).await;

    let r = post(None, &hi).await.unwrap();
    let s = r.status().as_u16();
    let v = assert_error(s, &r.text().await.unwrap(), 401);
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let r = post(Some("sk-test-c-0123456789"), &hi).await.unwrap();
    assert_eq!(r.status(), 401);
    // The tokenizer endpoints take a key too.
    for path in ["/tokenize", "/detokenize"] {
        let body = json!({"prompt": "hi", "tokens": []});
        let r = client.post(format!("{http}{path}")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path}");
    }
    let r = client.post(format!("{http}/tokenize")).bearer_auth(KEY_A).json(&json!({"prompt": "hi"})).send().await;
    assert_eq!(r.unwrap().status(), 200);
    let r = post(Some(KEY_A), &hi).await.unwrap();
    assert_eq!(r.status(), 200);
    let r = post(Some(KEY_B), &hi).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(*namespaces.lock().unwrap(), ["acme", "globex"], "the tenant is the worker's cache namespace");

    // Concurrency: acme's endless stream holds its only slot; globex is unaffected.
    let forever = json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "talk forever"}]});
    let mut stream = post(Some(KEY_A), &forever).await.unwrap();
    assert_eq!(stream.status(), 200);
    stream.chunk().await.unwrap().unwrap();
    let r = post(Some(KEY_A), &hi).await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let v = assert_error(429, &r.text().await.unwrap(), 429);
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    let admin_view = |key: Option<&'static str>| {
        let mut r = client.get(format!("{http}/debug/keys"));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    let v: Value = admin_view(Some(ADMIN)).await.unwrap().json().await.unwrap();
    assert_eq!(v["keys"][0]["tenant"], "acme", "{v}");
    assert_eq!(v["keys"][0]["usage"]["in_flight"], 1, "{v}");
    assert_eq!(v["keys"][0]["usage"]["rejected_concurrency_total"], 1, "{v}");
    assert!(!v.to_string().contains(KEY_A) && !v.to_string().contains(ADMIN));
    assert_eq!(admin_view(None).await.unwrap().status(), 401);
    assert_eq!(admin_view(Some(KEY_A)).await.unwrap().status(), 403);
    drop(stream);
    let mut released = false;
    for _ in 0..200 {
        if post(Some(KEY_A), &hi).await.unwrap().status() == 200 {
            released = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(released, "the slot was not released after the client disconnected");
    assert_eq!(open.load(Ordering::SeqCst), 0);

    // Rate: globex used one of its two tokens above; one more, then 429 with the wait until the next token.
    assert_eq!(post(Some(KEY_B), &hi).await.unwrap().status(), 200);
    let r = post(Some(KEY_B), &hi).await.unwrap();
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=5).contains(&retry), "{retry}");
}

async fn wait_ready(client: &reqwest::Client, http: &str) {
    for _ in 0..100 {
        if client.get(format!("{http}/readyz")).send().await.is_ok_and(|r| r.status() == 200) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("router never became ready");
}

/// In dev mode the dashboard is open; its state follows the traffic, and however many polls arrive at once the
/// workers see about one `Stats` call a second from it (the health probes add theirs, every 100 ms here).
#[tokio::test]
async fn dashboard_state_follows_traffic_and_caches_worker_stats() {
    let fake = Fake::default();
    let stats_calls = fake.stats_calls.clone();
    let waddr = spawn_worker(fake).await;
    let http = spawn_router(vec![waddr.to_string()], pagoda_router::DEFAULT_BODY_LIMIT).await;
    let client = reqwest::Client::new();
    wait_ready(&client, &http).await;
    let page = client.get(format!("{http}/dashboard")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("id=\"requests-total\""));
    let state = || async {
        let r = client.get(format!("{http}/dashboard/api/state")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()
    };
    let v = state().await;
    assert_eq!(v["workers"][0]["address"], waddr.to_string(), "{v}");
    assert_eq!(v["workers"][0]["stats"]["blocks_total"], 100, "{v}");
    assert_eq!(v["kvstore"]["configured"], false, "{v}");
    assert_eq!(v["router"]["placements_total"], 0, "{v}");
    assert_eq!(v["timeline"]["requests_total"], 0, "{v}");

    let r = client
        .post(format!("{http}/v1/chat/completions"))
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let id = r.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
    let v = state().await;
    assert_eq!(v["timeline"]["requests_total"], 1, "{v}");
    assert_eq!(v["router"]["placements_total"], 1, "{v}");
    assert_eq!(v["placements"][0]["request_id"], id.as_str(), "{v}");
    assert_eq!(v["placements"][0]["chosen"], waddr.to_string(), "{v}");
    let last = v["timeline"]["windows"].as_array().unwrap().iter().rev().find(|w| w["requests"] == 1).cloned();
    let last = last.unwrap_or_else(|| panic!("no window counts the request: {v}"));
    assert!(last["ttft"]["p50_s"].as_f64().unwrap() > 0.0, "{last}");
    assert!(last["inter_token"]["count"].as_u64().unwrap() > 10, "{last}");

    // 20 bursts of 50 concurrent polls over ~2 s: without the cache that is 1000 Stats calls.
    let before = stats_calls.load(Ordering::SeqCst);
    let t0 = std::time::Instant::now();
    for _ in 0..20 {
        let burst = (0..50).map(|_| client.get(format!("{http}/dashboard/api/state")).send());
        for r in futures::future::join_all(burst).await {
            assert_eq!(r.unwrap().status(), 200);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let calls = stats_calls.load(Ordering::SeqCst) - before;
    let secs = t0.elapsed().as_secs_f64();
    eprintln!("{calls} Stats calls in {secs:.1} s for 1000 dashboard polls");
    // Health probes: 10 a second; the dashboard: about 1 a second.
    assert!((calls as f64) < 14.0 * secs + 4.0, "{calls} Stats calls in {secs:.1} s for 1000 dashboard polls");
}

/// The dashboard's access rules are the admin endpoints': 403 with keys but no admin key; with an admin key, 401
/// without it, 403 for a tenant key, and the login's session cookie opens the page and the state.
#[tokio::test]
async fn dashboard_access_follows_the_admin_endpoints() {
    let waddr = spawn_worker(Fake::default()).await;
    let keys = || Arc::new(KeyTable::parse(&format!("{KEY_A} acme\n"), std::path::Path::new("keys")).unwrap());
    let no_redirects = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let limit = pagoda_router::DEFAULT_BODY_LIMIT;

    let closed = Security { keys: Some(keys()), admin: None };
    let http = spawn_router_with(vec![waddr.to_string()], limit, closed, Strategy::Kv).await;
    wait_ready(&no_redirects, &http).await;
    for path in ["/dashboard", "/dashboard/api/state"] {
        let r = no_redirects.get(format!("{http}{path}")).bearer_auth(KEY_A).send().await.unwrap();
        assert_eq!(r.status(), 403, "{path}");
    }
    let r = no_redirects.post(format!("{http}/dashboard/login")).form(&[("key", KEY_A)]).send().await.unwrap();
    assert_eq!(r.status(), 403);

    let admin = AdminKey::parse(ADMIN, std::path::Path::new("admin")).unwrap();
    let guarded = Security { keys: Some(keys()), admin: Some(admin) };
    let http = spawn_router_with(vec![waddr.to_string()], limit, guarded, Strategy::Kv).await;
    wait_ready(&no_redirects, &http).await;
    let get = |path: &str, auth: Option<(&'static str, String)>| {
        let mut r = no_redirects.get(format!("{http}{path}"));
        if let Some((name, value)) = auth {
            r = r.header(name, value);
        }
        r.send()
    };
    let page = get("/dashboard", None).await.unwrap();
    assert_eq!(page.status(), 401);
    assert!(page.text().await.unwrap().contains("login-form"));
    assert_eq!(get("/dashboard/api/state", None).await.unwrap().status(), 401);
    let tenant = Some(("authorization", format!("Bearer {KEY_A}")));
    assert_eq!(get("/dashboard/api/state", tenant).await.unwrap().status(), 403);
    let admin_bearer = Some(("authorization", format!("Bearer {ADMIN}")));
    assert_eq!(get("/dashboard/api/state", admin_bearer).await.unwrap().status(), 200);
    // Assets carry no data and are public (the login page needs the style sheet).
    assert_eq!(get("/dashboard/dashboard.css", None).await.unwrap().status(), 200);

    let login = |key: &'static str| no_redirects.post(format!("{http}/dashboard/login")).form(&[("key", key)]).send();
    let r = login(KEY_A).await.unwrap();
    assert_eq!(r.status(), 401, "a tenant key is no admin key");
    assert!(r.headers().get("set-cookie").is_none());
    let r = login(ADMIN).await.unwrap();
    assert_eq!(r.status(), 303);
    let cookie = r.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string();
    assert_eq!(get("/dashboard/api/state", Some(("cookie", cookie.clone()))).await.unwrap().status(), 200);
    assert_eq!(get("/dashboard", Some(("cookie", cookie.clone()))).await.unwrap().status(), 200);
    let tampered = format!("{}0", &cookie[..cookie.len() - 1]);
    let tampered = if tampered == cookie { format!("{}1", &cookie[..cookie.len() - 1]) } else { tampered };
    assert_eq!(get("/dashboard/api/state", Some(("cookie", tampered))).await.unwrap().status(), 401);
    let r = no_redirects.post(format!("{http}/dashboard/logout")).send().await.unwrap();
    assert_eq!(r.status(), 303);
    assert!(r.headers()["set-cookie"].to_str().unwrap().contains("Max-Age=0"));
}

/// A router over `fakes` (round-robin, so every worker gets requests) with `migration`, once every worker is ready.
async fn migrating_cluster(fakes: Vec<Fake>, migration: MigrationConfig) -> String {
    let mut addrs = Vec::new();
    for f in fakes {
        addrs.push(spawn_worker(f).await.to_string());
    }
    let http = serve_router(RouterConfig {
        workers: addrs,
        health_interval: Duration::from_millis(100),
        placement: PlacerConfig { strategy: Strategy::RoundRobin, ..PlacerConfig::default() },
        migration,
        ..RouterConfig::default()
    })
    .await;
    let client = reqwest::Client::new();
    for _ in 0..100 {
        if let Ok(r) = client.get(format!("{http}/readyz")).send().await
            && let Ok(v) = r.json::<Value>().await
            && v["workers"].as_array().is_some_and(|ws| ws.iter().all(|w| w["ready"] == true))
        {
            return http;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("router never saw every worker ready");
}

fn migration(stall_ms: u64, max_retries: u32) -> MigrationConfig {
    MigrationConfig {
        stall_timeout: Duration::from_millis(stall_ms),
        first_token_timeout: Duration::from_millis(stall_ms * 4),
        max_retries,
    }
}

/// The streamed text and the final usage of an SSE chat body; panics on an error event.
fn streamed_text(body: &str) -> (String, Value) {
    let mut text = String::new();
    let mut usage = Value::Null;
    for p in sse_payloads(body) {
        if p == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&p).unwrap();
        assert!(v.get("error").is_none(), "error event: {v}");
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(c);
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (text, usage)
}

async fn migrations_counted(http: &str, reason: &str) -> u64 {
    let text = reqwest::get(format!("{http}/metrics")).await.unwrap().text().await.unwrap();
    let key = format!("pagoda_router_migrations_total{{reason=\"{reason}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&key)).map_or(0, |n| n.trim().parse().unwrap())
}

/// A worker whose streams break after 5 tokens: every request placed there continues on the healthy one, and the
/// client sees exactly the reply (no duplicate, no gap, the multi-byte characters intact), with the full usage.
#[tokio::test]
async fn a_dying_worker_migrates_the_stream_without_duplicates() {
    let healthy = Fake::default();
    let seen = healthy.max_tokens_seen.clone();
    let http =
        migrating_cluster(vec![Fake { die_after: Some(5), ..Fake::default() }, healthy], migration(2000, 2)).await;
    let client = reqwest::Client::new();
    let body = |stream: bool| {
        json!({"model": MODEL, "stream": stream, "stream_options": if stream { json!({"include_usage": true}) }
            else { Value::Null }, "messages": [{"role": "user", "content": "Capital of France?"}]})
    };
    for _ in 0..2 {
        let v: Value = client
            .post(format!("{http}/v1/chat/completions"))
            .json(&body(false))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], REPLY, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        assert_eq!(v["usage"]["completion_tokens"], REPLY.len(), "{v}");
        let r = client.post(format!("{http}/v1/chat/completions")).json(&body(true)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let (text, usage) = streamed_text(&r.text().await.unwrap());
        assert_eq!(text, REPLY);
        assert_eq!(usage["completion_tokens"], REPLY.len(), "{usage}");
    }
    assert!(migrations_counted(&http, "stream_error").await >= 1);
    // A continued request asks only for what is left.
    let prompt_len = "user: Capital of France?\nassistant:".len();
    let continued = (CONTEXT - prompt_len - 5) as u32;
    assert!(seen.lock().unwrap().contains(&continued), "{continued} not in {:?}", seen.lock().unwrap());
}

/// `kv.profile_queries` reach the worker tokenized, while they fit beside the prompt: a migrated attempt, whose
/// prompt carries the tokens generated so far, leaves out a query that no longer fits rather than failing the
/// request. A query too long for the context is a 400 naming the field.
#[tokio::test]
async fn profile_queries_ride_with_the_request_while_they_fit() {
    let (dying, healthy) = (Fake { die_after: Some(5), ..Fake::default() }, Fake::default());
    let seen = [dying.profile_queries_seen.clone(), healthy.profile_queries_seen.clone()];
    let http = migrating_cluster(vec![dying, healthy], migration(2000, 2)).await;
    let client = reqwest::Client::new();
    let answer = pagoda_worker::placement::EvicPressConfig::default().answer_tokens;
    let content = "Tell me about France. ".repeat(5);
    let prompt_len = format!("user: {content}\nassistant:").len();
    // Fits beside the prompt with 2 tokens to spare, and no longer once 5 generated tokens join it.
    let query = "q".repeat(CONTEXT - prompt_len - answer - 2);
    let body = |query: &str| {
        json!({"model": MODEL, "messages": [{"role": "user", "content": content}],
            "kv": {"profile_queries": [query]}})
    };
    for _ in 0..2 {
        let r = client.post(format!("{http}/v1/chat/completions")).json(&body(&query)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], REPLY, "{v}");
    }
    let calls: Vec<(usize, usize)> = seen.iter().flat_map(|s| s.lock().unwrap().clone()).collect();
    assert!(calls.contains(&(prompt_len, 1)), "a first attempt carries the query: {calls:?}");
    assert!(calls.contains(&(prompt_len + 5, 0)), "the migrated attempt leaves it out: {calls:?}");
    assert!(calls.iter().all(|&(len, n)| (len == prompt_len) == (n == 1)), "{calls:?}");

    let too_long = "q".repeat(CONTEXT - prompt_len - answer + 1);
    let r = client.post(format!("{http}/v1/chat/completions")).json(&body(&too_long)).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "kv.profile_queries", "{v}");
}

/// The bytes of a chat `logprobs.content` list, joined.
fn logprob_bytes(content: &Value) -> Vec<u8> {
    let entries = content.as_array().unwrap_or_else(|| panic!("no logprobs list: {content}"));
    entries.iter().flat_map(|e| e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8)).collect()
}

/// Each generated token's log-probabilities reach the client with the text they belong to: one entry per token,
/// as the worker reported it, whose bytes are the text's, in the chat and the completion shapes, streamed or
/// not, across a stop string (whose tokens are not reported) and across a migration to another worker.
#[tokio::test]
async fn logprobs_follow_the_text_they_belong_to() {
    let fake = Fake::default();
    let seen = fake.requests_seen.clone();
    let c = cluster_of(fake, pagoda_router::DEFAULT_BODY_LIMIT).await;
    let client = c.client.clone();
    let post = |path: &'static str, body: Value| {
        let c = &c;
        async move { c.post_ok(path, &body).await }
    };
    let messages = json!([{"role": "user", "content": "x"}]);

    let v: Value = serde_json::from_str(
        &post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": messages, "logprobs": true, "top_logprobs": 2}),
        )
        .await,
    )
    .unwrap();
    let req = seen.lock().unwrap().last().cloned().unwrap();
    assert!(req.logprobs && req.top_logprobs == 2, "{req:?}");
    let content = &v["choices"][0]["logprobs"]["content"];
    assert_eq!(logprob_bytes(content), REPLY.as_bytes());
    for (i, e) in content.as_array().unwrap().iter().enumerate() {
        assert!((e["logprob"].as_f64().unwrap() + i as f64 / 100.0).abs() < 1e-6, "{e}");
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!((&top[0]["token"], &top[0]["bytes"]), (&e["token"], &e["bytes"]));
        assert_eq!(top[1]["token"], "0");
    }
    // A byte of a multi-byte character is no text of its own: its token is the replacement character.
    let crab = REPLY.find('🦀').unwrap();
    assert_eq!(content[crab]["token"], "\u{fffd}");
    assert_eq!(content[crab]["bytes"], json!([0xf0]));
    let v: Value =
        serde_json::from_str(&post("/v1/chat/completions", json!({"model": MODEL, "messages": messages})).await)
            .unwrap();
    assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
    assert!(!seen.lock().unwrap().last().unwrap().logprobs);

    // Streamed: every chunk carries the entries of its own text.
    let body = post(
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": messages, "logprobs": true, "stream": true, "stop": ["END"]}),
    )
    .await;
    let mut all = Vec::new();
    for p in sse_payloads(&body).iter().filter(|p| *p != "[DONE]") {
        let v: Value = serde_json::from_str(p).unwrap();
        let choice = &v["choices"][0];
        let Some(text) = choice["delta"]["content"].as_str().filter(|t| !t.is_empty()) else { continue };
        let bytes = logprob_bytes(&choice["logprobs"]["content"]);
        assert_eq!(bytes, text.as_bytes(), "{v}");
        assert!(choice["logprobs"]["content"].as_array().unwrap().iter().all(|e| e["top_logprobs"] == json!([])));
        all.extend(bytes);
    }
    let before_stop = &REPLY[..REPLY.find("END").unwrap()];
    assert_eq!(all, before_stop.as_bytes(), "the stop string's tokens are not reported");

    // The completion shape, with a stop string.
    let v: Value = serde_json::from_str(
        &post("/v1/completions", json!({"model": MODEL, "prompt": "x", "logprobs": 1, "stop": ["capital"]})).await,
    )
    .unwrap();
    let (text, lp) = (v["choices"][0]["text"].as_str().unwrap(), &v["choices"][0]["logprobs"]);
    assert_eq!(text, "Paris is the ");
    let tokens: String = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens, text);
    assert_eq!(lp["text_offset"], json!((0..text.len()).collect::<Vec<_>>()));
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), text.len());
    assert_eq!(lp["top_logprobs"][0], json!({"P": 0.0}));
    assert_eq!(lp["top_logprobs"][2], json!({"r": -0.02}));
    // vLLM's include_stop_str_in_output keeps the stop string, and its tokens' log-probabilities with it.
    let v: Value = serde_json::from_str(
        &post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "logprobs": 0, "stop": ["capital"], "include_stop_str_in_output": true}),
        )
        .await,
    )
    .unwrap();
    let (text, lp) = (v["choices"][0]["text"].as_str().unwrap(), &v["choices"][0]["logprobs"]);
    assert_eq!((text, v["choices"][0]["finish_reason"].as_str()), ("Paris is the capital", Some("stop")), "{v}");
    let tokens: String = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens, text);
    // logprobs 0: the chosen token alone, as OpenAI's `logprobs + 1`.
    let v: Value = serde_json::from_str(
        &post("/v1/completions", json!({"model": MODEL, "prompt": "x", "logprobs": 0, "max_tokens": 2})).await,
    )
    .unwrap();
    assert_eq!(v["choices"][0]["logprobs"]["top_logprobs"], json!([{"P": 0.0}, {"a": -0.01}]));
    // Streamed completions: offsets run on across chunks.
    let body =
        post("/v1/completions", json!({"model": MODEL, "prompt": "x", "logprobs": 0, "max_tokens": 6, "stream": true}))
            .await;
    let offsets: Vec<Value> = sse_payloads(&body)
        .iter()
        .filter(|p| *p != "[DONE]")
        .filter_map(|p| {
            serde_json::from_str::<Value>(p).unwrap()["choices"][0]["logprobs"]["text_offset"].as_array().cloned()
        })
        .flatten()
        .collect();
    assert_eq!(offsets, json!([0, 1, 2, 3, 4, 5]).as_array().unwrap().clone());

    // Across a migration: the second worker goes on from the first one's position.
    let http =
        migrating_cluster(vec![Fake { die_after: Some(5), ..Fake::default() }, Fake::default()], migration(2000, 2))
            .await;
    for _ in 0..2 {
        let v: Value = client
            .post(format!("{http}/v1/chat/completions"))
            .json(&json!({"model": MODEL, "messages": messages, "logprobs": true}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let content = &v["choices"][0]["logprobs"]["content"];
        assert_eq!(logprob_bytes(content), REPLY.as_bytes(), "{v}");
        let logprobs: Vec<f64> = content.as_array().unwrap().iter().map(|e| e["logprob"].as_f64().unwrap()).collect();
        assert!(logprobs.iter().enumerate().all(|(i, &l)| (l + i as f64 / 100.0).abs() < 1e-6), "{logprobs:?}");
    }
    assert!(migrations_counted(&http, "stream_error").await >= 1);
}

/// `n` choices of a chat, and a batch of completion prompts with `n` choices each, run together: the choices come
/// back in OpenAI's order (by prompt, then sample), streamed interleaved under their `index`, with one usage that
/// counts each prompt once; seeded samples take consecutive seeds; one choice that cannot start fails the request
/// and cancels the others.
#[tokio::test]
async fn several_choices_run_together() {
    let fake = Fake::default();
    let (seen, open) = (fake.requests_seen.clone(), fake.open.clone());
    let c = cluster_of(fake, pagoda_router::DEFAULT_BODY_LIMIT).await;
    let post = |path: &'static str, body: Value| {
        let c = &c;
        async move { c.post(path, body.to_string()).await }
    };
    let messages = json!([{"role": "user", "content": "x"}]);
    let prompt_len = "user: x\nassistant:".len() as u64;

    let (s, body) =
        post("/v1/chat/completions", json!({"model": MODEL, "messages": messages, "n": 3, "seed": 7})).await;
    assert_eq!(s, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!((c["index"].as_u64(), c["message"]["content"].as_str()), (Some(i as u64), Some(REPLY)), "{v}");
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt_len, "the prompt counts once");
    assert_eq!(v["usage"]["completion_tokens"], 3 * REPLY.len() as u64);
    let mut seeds: Vec<u64> =
        seen.lock().unwrap().iter().rev().take(3).map(|r| r.sampling.as_ref().unwrap().seed.unwrap()).collect();
    seeds.sort();
    assert_eq!(seeds, [7, 8, 9]);

    // Streamed: a role chunk per choice, each choice's text whole under its index, one usage chunk, [DONE].
    let (s, body) = post(
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": messages, "n": 2, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    let payloads = sse_payloads(&body);
    assert_eq!(payloads.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = payloads[..payloads.len() - 1].iter().map(|p| serde_json::from_str(p).unwrap()).collect();
    let (mut texts, mut roles, mut finishes) = (vec![String::new(); 2], 0, 0);
    for c in &chunks[..chunks.len() - 1] {
        let choice = &c["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        roles += usize::from(choice["delta"]["role"] == "assistant");
        finishes += usize::from(choice["finish_reason"] == "stop");
        texts[i].push_str(choice["delta"]["content"].as_str().unwrap_or(""));
    }
    assert_eq!((roles, finishes), (2, 2));
    assert_eq!(texts, [REPLY, REPLY]);
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 2 * REPLY.len() as u64);

    // A batch of prompts, n each, echoed so that each choice shows its prompt.
    let batch = json!({"model": MODEL, "prompt": ["ab", "cd"], "n": 2, "max_tokens": 3, "echo": true});
    let (s, body) = post("/v1/completions", batch.clone()).await;
    assert_eq!(s, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let texts: Vec<&str> = v["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(texts, ["abPar", "abPar", "cdPar", "cdPar"]);
    assert_eq!((v["usage"]["prompt_tokens"].as_u64(), v["usage"]["completion_tokens"].as_u64()), (Some(4), Some(12)));
    let mut stream = batch.clone();
    stream["stream"] = json!(true);
    stream["prompt"] = json!([[97, 98], [99]]);
    let (s, body) = post("/v1/completions", stream).await;
    assert_eq!(s, 200, "{body}");
    let mut texts = vec![String::new(); 4];
    for p in sse_payloads(&body).iter().filter(|p| *p != "[DONE]") {
        let v: Value = serde_json::from_str(p).unwrap();
        let c = &v["choices"][0];
        texts[c["index"].as_u64().unwrap() as usize].push_str(c["text"].as_str().unwrap());
    }
    assert_eq!(texts, ["abPar", "abPar", "cPar", "cPar"]);

    // One choice that cannot run fails the request, and the others are cancelled on the worker.
    let long = "y".repeat(CONTEXT + 10);
    let (s, body) = post("/v1/completions", json!({"model": MODEL, "prompt": ["ab", long], "max_tokens": 3})).await;
    assert_error(s, &body, 400);
    let (s, body) =
        post("/v1/completions", json!({"model": MODEL, "prompt": ["forever", "overload"], "max_tokens": 100})).await;
    assert!(s >= 400, "{s} {body}");
    assert!(streams_close(&open).await, "a choice's worker stream stayed open after the request failed");
}

/// Whether every worker stream `open` counts closes within two seconds.
async fn streams_close(open: &AtomicUsize) -> bool {
    for _ in 0..100 {
        if open.load(Ordering::SeqCst) == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// `echo` puts the prompt before the completion; with `logprobs` the worker scores the prompt, and its tokens
/// lead the lists (the first unscored, `null`), streamed or not, and across a migration in the middle of the
/// scores (none is taken twice).
#[tokio::test]
async fn echo_scores_the_prompt() {
    let fake = Fake::default();
    let seen = fake.requests_seen.clone();
    let c = cluster_of(fake, pagoda_router::DEFAULT_BODY_LIMIT).await;
    let client = c.client.clone();
    let completion = |body: Value| {
        let c = &c;
        async move { c.post_ok("/v1/completions", &body).await }
    };
    let v: Value =
        serde_json::from_str(&completion(json!({"model": MODEL, "prompt": "x", "echo": true, "max_tokens": 5})).await)
            .unwrap();
    assert_eq!(v["choices"][0]["text"], "xParis", "{v}");
    assert!(v["choices"][0]["logprobs"].is_null());
    assert!(!seen.lock().unwrap().last().unwrap().prompt_logprobs);
    let v: Value =
        serde_json::from_str(&completion(json!({"model": MODEL, "prompt": "x", "logprobs": 1, "max_tokens": 1})).await)
            .unwrap();
    assert_eq!(v["choices"][0]["logprobs"]["tokens"], json!(["P"]), "{v}");
    assert!(!seen.lock().unwrap().last().unwrap().prompt_logprobs, "no echo, no prompt scores");

    let scored = |q: usize| -(q as f64) / 10.0;
    let check = |lp: &Value, prompt: &str| {
        let n = prompt.len();
        let tokens: String = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(tokens, format!("{prompt}Pa"), "{lp}");
        assert_eq!(lp["text_offset"], json!((0..n + 2).collect::<Vec<_>>()));
        assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(), "{lp}");
        for q in 1..n {
            let l = lp["token_logprobs"][q].as_f64().unwrap();
            assert!((l - scored(q)).abs() < 1e-6, "position {q}: {l}");
            assert_eq!(lp["top_logprobs"][q].as_object().unwrap().len(), 1, "{lp}");
        }
        assert_eq!(lp["token_logprobs"][n], json!(0.0));
        assert!((lp["token_logprobs"][n + 1].as_f64().unwrap() + 0.01).abs() < 1e-6, "{lp}");
    };
    let body = json!({"model": MODEL, "prompt": "abcdefg", "echo": true, "logprobs": 1, "max_tokens": 2});
    let v: Value = serde_json::from_str(&completion(body.clone()).await).unwrap();
    assert_eq!(v["choices"][0]["text"], "abcdefgPa", "{v}");
    check(&v["choices"][0]["logprobs"], "abcdefg");
    let req = seen.lock().unwrap().last().cloned().unwrap();
    assert!(req.prompt_logprobs && req.logprobs && req.top_logprobs == 1, "{req:?}");

    // Streamed: the prompt is the first chunk; the completion's offsets start after it.
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let sse = completion(stream).await;
    let chunks: Vec<Value> =
        sse_payloads(&sse).iter().filter(|p| *p != "[DONE]").map(|p| serde_json::from_str(p).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["text"], "abcdefg");
    let mut merged = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for c in &chunks {
        let lp = &c["choices"][0]["logprobs"];
        for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let more = lp[k].as_array().cloned().unwrap_or_default();
            merged[k].as_array_mut().unwrap().extend(more);
        }
    }
    check(&merged, "abcdefg");

    // A worker dies in the middle of the prompt's scores: the next one scores it again, and each position is
    // taken once.
    let dying = Fake { scores_die_after: Some(2), ..Fake::default() };
    let http = migrating_cluster(vec![dying, Fake::default()], migration(2000, 2)).await;
    let prompt = "abcdefghijklmnopq";
    for _ in 0..2 {
        let r = client
            .post(format!("{http}/v1/completions"))
            .json(&json!({"model": MODEL, "prompt": prompt, "echo": true, "logprobs": 1, "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        let v: Value = r.json().await.unwrap();
        check(&v["choices"][0]["logprobs"], prompt);
    }
    assert!(migrations_counted(&http, "stream_error").await >= 1);
}

/// `logit_bias` and the penalties reach the worker on every attempt; a migrated attempt, whose prompt ends with
/// the tokens generated so far, tells the worker to count them as output.
#[tokio::test]
async fn sampling_settings_ride_every_attempt() {
    let (dying, healthy) = (Fake { die_after: Some(5), ..Fake::default() }, Fake::default());
    let seen = [dying.requests_seen.clone(), healthy.requests_seen.clone()];
    let http = migrating_cluster(vec![dying, healthy], migration(2000, 2)).await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}],
        "logit_bias": {"66": -100, "65": 2.5}, "presence_penalty": 0.5, "frequency_penalty": -1.25,
        "repetition_penalty": 1.25, "min_p": 0.1, "min_tokens": 12, "response_format": {"type": "json_object"}});
    for _ in 0..2 {
        let r = reqwest::Client::new().post(format!("{http}/v1/chat/completions")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], REPLY, "{v}");
    }
    let calls: Vec<GenerateRequest> = seen.iter().flat_map(|s| s.lock().unwrap().clone()).collect();
    let prompt_len = "user: Capital of France?\nassistant:".len();
    let mut priors = Vec::new();
    for req in &calls {
        let (len, s) = (req.prompt_token_ids.len(), req.sampling.as_ref().expect("sampling settings"));
        let bias: Vec<(u32, f32)> = s.logit_bias.iter().map(|b| (b.token_id, b.bias)).collect();
        assert_eq!(bias, vec![(65, 2.5), (66, -100.0)]);
        assert_eq!((s.presence_penalty, s.frequency_penalty), (0.5, -1.25));
        assert_eq!((s.repetition_penalty, s.min_p, s.json_object), (1.25, 0.1, true));
        // What is left of min_tokens after the tokens an earlier attempt generated.
        assert_eq!(s.min_tokens + s.prior_output_tokens, 12, "{calls:?}");
        assert_eq!(len, prompt_len + s.prior_output_tokens as usize, "{calls:?}");
        priors.push(s.prior_output_tokens);
    }
    assert!(priors.contains(&0) && priors.contains(&5), "a first and a migrated attempt: {priors:?}");
}

/// `response_format: json_schema`, and vLLM's `guided_json` (an object or its text), reach the worker as the
/// schema's compact JSON text with the properties in the request's order; a schema the guide cannot follow is a
/// 400 that names the parameter and says why, and nothing reaches the worker.
#[tokio::test]
async fn json_schemas_reach_the_worker_and_bad_ones_are_refused() {
    let fake = Fake::default();
    let seen = fake.requests_seen.clone();
    let c = cluster_of(fake, pagoda_router::DEFAULT_BODY_LIMIT).await;
    let schema = json!({"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"enum": ["a", "b"]}},
        "required": ["zeta"], "additionalProperties": false});
    let chat =
        |rf: Value| json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": rf});
    let named =
        |schema: Value| json!({"type": "json_schema", "json_schema": {"name": "z", "schema": schema, "strict": true}});
    for (path, body) in [
        ("/v1/chat/completions", chat(named(schema.clone()))),
        ("/v1/completions", json!({"model": MODEL, "prompt": "hi", "guided_json": schema})),
        ("/v1/completions", json!({"model": MODEL, "prompt": "hi", "guided_json": schema.to_string()})),
        ("/v1/completions", json!({"model": MODEL, "prompt": "hi", "response_format": named(schema.clone())})),
    ] {
        c.post_ok(path, &body).await;
        let req = seen.lock().unwrap().pop().expect("a Generate call");
        let s = req.sampling.expect("sampling settings");
        assert_eq!(s.json_schema, schema.to_string(), "{path} {body}");
        assert!(s.json_schema.find("zeta") < s.json_schema.find("alpha"), "{}", s.json_schema);
        assert!(!s.json_object);
    }
    let uri = json!({"type": "object", "properties": {"e": {"type": "string", "format": "uri"}}});
    let cases = [
        (
            "/v1/chat/completions",
            chat(named(uri)),
            "response_format.json_schema.schema",
            "the format `uri` is not supported",
        ),
        ("/v1/chat/completions", chat(named(json!({"type": "array"}))), "response_format.json_schema.schema", "root"),
        (
            "/v1/chat/completions",
            chat(json!({"type": "json_schema", "json_schema": {"name": "z"}})),
            "response_format.json_schema.schema",
            "with a `schema`",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"type": "json_schema", "json_schema": {"name": "no spaces", "schema": schema}})),
            "response_format.json_schema.name",
            "letters",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "hi", "guided_json": "{"}),
            "guided_json",
            "not valid JSON",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "hi", "guided_json": schema, "response_format": {"type": "json_object"}}),
            "guided_json",
            "only one of `response_format` and `guided_json`",
        ),
    ];
    assert_refused(&c, &cases).await;
    assert!(seen.lock().unwrap().is_empty(), "no refused request reached the worker");
    c.still_serves().await;
}

/// A chat request saying "hi", with `extra`'s fields added.
fn chat_saying_hi(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// A completion request of "hi", with `extra`'s fields added.
fn completion_of_hi(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "prompt": "hi"});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// vLLM's `guided_regex` and `guided_choice`, and their `structured_outputs` forms, reach the worker as one
/// pattern (a choice as the alternation of its escaped strings); a pattern that does not compile, a bad choice
/// list, two guides at once, and a regex that could never end (`ignore_eos` without `stop_token_ids`) are 400s
/// that name the parameter, and nothing reaches the worker.
#[tokio::test]
async fn regex_and_choice_guides_reach_the_worker_and_bad_ones_are_refused() {
    let fake = Fake::default();
    let seen = fake.requests_seen.clone();
    let c = cluster_of(fake, pagoda_router::DEFAULT_BODY_LIMIT).await;
    let (chat, completion) = (chat_saying_hi, completion_of_hi);
    for (path, body, pattern) in [
        ("/v1/chat/completions", chat(json!({"guided_regex": r"\d{3}"})), r"\d{3}"),
        ("/v1/completions", completion(json!({"guided_regex": "[a-z]+"})), "[a-z]+"),
        ("/v1/chat/completions", chat(json!({"guided_choice": ["yes", "no (maybe)"]})), r"yes|no \(maybe\)"),
        ("/v1/completions", completion(json!({"structured_outputs": {"choice": ["a.b", "c"]}})), r"a\.b|c"),
        ("/v1/chat/completions", chat(json!({"structured_outputs": {"regex": "x+", "disable_fallback": true}})), "x+"),
        // With ignore_eos, a stop token of the request's own can still end the match.
        ("/v1/completions", completion(json!({"guided_regex": "x", "ignore_eos": true, "stop_token_ids": [3]})), "x"),
    ] {
        c.post_ok(path, &body).await;
        let req = seen.lock().unwrap().pop().expect("a Generate call");
        let s = req.sampling.expect("sampling settings");
        assert_eq!((s.regex.as_str(), s.json_schema.as_str(), s.json_object), (pattern, "", false), "{path} {body}");
    }
    // structured_outputs.json is a schema, as guided_json is.
    c.post_ok("/v1/completions", &completion(json!({"structured_outputs": {"json": {"type": "object"}}}))).await;
    let s = seen.lock().unwrap().pop().expect("a Generate call").sampling.expect("sampling settings");
    assert_eq!((s.json_schema.as_str(), s.regex.as_str()), (r#"{"type":"object"}"#, ""));
    // `/metrics` counts the admitted guided requests by guide.
    let metrics = c.client.get(format!("{}/metrics", c.http)).send().await.unwrap().text().await.unwrap();
    for line in [r#"guided_requests_total{guide="regex"} 6"#, r#"guided_requests_total{guide="json_schema"} 1"#] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }

    let cases = [
        ("/v1/chat/completions", chat(json!({"guided_regex": "(unclosed"})), "guided_regex", "does not compile"),
        ("/v1/completions", completion(json!({"guided_regex": 7})), "guided_regex", "must be a string"),
        (
            "/v1/completions",
            completion(json!({"guided_regex": "(a|b)*a(a|b){13}"})),
            "guided_regex",
            "automaton states",
        ),
        ("/v1/completions", completion(json!({"guided_choice": []})), "guided_choice", "1 to"),
        ("/v1/completions", completion(json!({"guided_choice": ["a", 1]})), "guided_choice", "array of strings"),
        ("/v1/completions", completion(json!({"guided_choice": ["a", ""]})), "guided_choice", "is empty"),
        (
            "/v1/chat/completions",
            chat(json!({"guided_choice": ["a"], "response_format": {"type": "json_object"}})),
            "guided_choice",
            "only one of `response_format` and `guided_choice`",
        ),
        (
            "/v1/completions",
            completion(json!({"guided_regex": "a", "structured_outputs": {"choice": ["b"]}})),
            "structured_outputs.choice",
            "only one",
        ),
        (
            "/v1/completions",
            completion(json!({"structured_outputs": {"structural_tag": "{}"}})),
            "structured_outputs.structural_tag",
            "not supported",
        ),
        ("/v1/completions", completion(json!({"structured_outputs": "x"})), "structured_outputs", "an object"),
        ("/v1/completions", completion(json!({"guided_regex": "a+", "ignore_eos": true})), "ignore_eos", "stop token"),
    ];
    assert_refused(&c, &cases).await;
    assert!(seen.lock().unwrap().is_empty(), "no refused request reached the worker");
    c.still_serves().await;
}

/// vLLM's `structured_outputs.grammar` and `guided_grammar` reach the worker as the grammar's text; a grammar that
/// does not compile (with where it fails), one that is not a string, two guides at once, and a grammar that could
/// never end (`ignore_eos` without `stop_token_ids`) are 400s that name the parameter, and nothing reaches the
/// worker.
#[tokio::test]
async fn grammar_guides_reach_the_worker_and_bad_ones_are_refused() {
    let fake = Fake::default();
    let seen = fake.requests_seen.clone();
    let c = cluster_of(fake, pagoda_router::DEFAULT_BODY_LIMIT).await;
    let (chat, completion) = (chat_saying_hi, completion_of_hi);
    let list = "root ::= \"[\" num (\",\" num)* \"]\"\nnum ::= [0-9]+";
    for (path, body) in [
        ("/v1/chat/completions", chat(json!({"structured_outputs": {"grammar": list}}))),
        ("/v1/completions", completion(json!({"guided_grammar": list}))),
        ("/v1/completions", completion(json!({"guided_grammar": list, "ignore_eos": true, "stop_token_ids": [3]}))),
    ] {
        c.post_ok(path, &body).await;
        let req = seen.lock().unwrap().pop().expect("a Generate call");
        let s = req.sampling.expect("sampling settings");
        assert_eq!((s.grammar.as_str(), s.regex.as_str(), s.json_schema.as_str()), (list, "", ""), "{path} {body}");
    }
    let metrics = c.client.get(format!("{}/metrics", c.http)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"guided_requests_total{guide="grammar"} 3"#), "{metrics}");

    let cases = [
        (
            "/v1/completions",
            completion(json!({"guided_grammar": "root ::= \"a\"\nroot ::= \"b\""})),
            "guided_grammar",
            "line 2, column 9: rule `root` is defined twice",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"structured_outputs": {"grammar": "root ::= item\nitem ::= \"(\" item \")\""}})),
            "structured_outputs.grammar",
            "rule `item` can never finish",
        ),
        ("/v1/completions", completion(json!({"guided_grammar": "root ::= num"})), "guided_grammar", "never defined"),
        ("/v1/completions", completion(json!({"guided_grammar": ["root"]})), "guided_grammar", "must be a string"),
        (
            "/v1/completions",
            completion(json!({"guided_grammar": "x".repeat(70_000)})),
            "guided_grammar",
            "at most 65536",
        ),
        (
            "/v1/completions",
            completion(json!({"guided_regex": "a", "structured_outputs": {"grammar": list}})),
            "structured_outputs.grammar",
            "only one",
        ),
        (
            "/v1/completions",
            completion(json!({"guided_grammar": list, "ignore_eos": true})),
            "ignore_eos",
            "stop token",
        ),
    ];
    assert_refused(&c, &cases).await;
    assert!(seen.lock().unwrap().is_empty(), "no refused request reached the worker");
    c.still_serves().await;
}

/// A forced function call (`tool_choice` naming a function) reaches the worker as its parameters' schema, and the
/// answer comes back as the call's arguments: a `tool_calls` message with `content: null`, or, streamed, a first
/// delta that names the call (its id, type and name) and argument deltas that add up to the answer.
#[tokio::test]
async fn forced_function_calls_come_back_as_tool_calls() {
    let fake = Fake::default();
    let seen = fake.requests_seen.clone();
    let c = cluster_of(fake, pagoda_router::DEFAULT_BODY_LIMIT).await;
    let parameters = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let (s, v) = c.chat(body.clone()).await;
    assert_eq!(s, 200, "{v}");
    let message = &v["choices"][0]["message"];
    assert!(message["content"].is_null(), "{v}");
    let call = &message["tool_calls"][0];
    assert_eq!((&call["type"], &call["function"]["name"]), (&json!("function"), &json!("get_weather")), "{v}");
    assert_eq!(call["function"]["arguments"], REPLY, "{v}");
    assert!(call["id"].as_str().is_some_and(|id| id.starts_with("call-")), "{v}");
    let sent = seen.lock().unwrap().pop().expect("a Generate call").sampling.expect("sampling settings");
    assert_eq!(sent.json_schema, parameters.to_string());

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let text = c.post_ok("/v1/chat/completions", &streamed).await;
    let chunks: Vec<Value> =
        sse_payloads(&text).iter().filter(|p| *p != "[DONE]").map(|p| serde_json::from_str(p).unwrap()).collect();
    let first = &chunks[0]["choices"][0]["delta"];
    assert_eq!(first["role"], "assistant", "{first}");
    assert!(first.get("content").is_none(), "{first}");
    let head = &first["tool_calls"][0];
    assert_eq!(
        (&head["index"], &head["type"], &head["function"]["name"]),
        (&json!(0), &json!("function"), &json!("get_weather"))
    );
    assert!(head["id"].is_string() && head["function"]["arguments"] == "", "{head}");
    let mut arguments = String::new();
    for chunk in &chunks[1..] {
        let delta = &chunk["choices"][0]["delta"];
        assert!(delta.get("content").is_none(), "{chunk}");
        if let Some(call) = delta.get("tool_calls") {
            assert!(call[0].get("id").is_none() && call[0]["function"].get("name").is_none(), "{chunk}");
            arguments.push_str(call[0]["function"]["arguments"].as_str().unwrap());
        }
    }
    assert_eq!(arguments, REPLY);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

/// vLLM's `stop_reason`: the request's own stop token id that ended a choice, on chat and completions, plain and
/// streamed (the stream's finish chunk carries it); `null` for the model's end token and for a length finish.
#[tokio::test]
async fn stop_reason_names_the_requests_stop_token() {
    let Cluster { http, client, .. } = cluster_of(Fake::default(), pagoda_router::DEFAULT_BODY_LIMIT).await;
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [65]});
    let completion = json!({"model": MODEL, "prompt": "hi", "stop_token_ids": [65]});
    for (path, body) in [("/v1/chat/completions", chat), ("/v1/completions", completion)] {
        let v: Value = client.post(format!("{http}{path}")).json(&body).send().await.unwrap().json().await.unwrap();
        assert_eq!(
            (v["choices"][0]["finish_reason"].as_str(), v["choices"][0]["stop_reason"].as_u64()),
            (Some("stop"), Some(65)),
            "{path}: {v}"
        );
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let text = client.post(format!("{http}{path}")).json(&streamed).send().await.unwrap().text().await.unwrap();
        let chunks: Vec<Value> =
            sse_payloads(&text).iter().filter(|p| *p != "[DONE]").map(|p| serde_json::from_str(p).unwrap()).collect();
        let last = &chunks.last().unwrap()["choices"][0];
        assert_eq!(
            (last["finish_reason"].as_str(), last["stop_reason"].as_u64()),
            (Some("stop"), Some(65)),
            "{path}: {last}"
        );
        assert!(chunks[..chunks.len() - 1].iter().all(|c| c["choices"][0]["stop_reason"].is_null()), "{path}");
        let mut short = body.clone();
        short["max_tokens"] = json!(3);
        let v: Value = client.post(format!("{http}{path}")).json(&short).send().await.unwrap().json().await.unwrap();
        assert_eq!(
            (v["choices"][0]["finish_reason"].as_str(), &v["choices"][0]["stop_reason"]),
            (Some("length"), &Value::Null),
            "{path}"
        );
    }
}

/// `ignore_eos` (vLLM's extension) reaches the worker, and the router then sends none of the model's stop ids;
/// `stop_token_ids` are sent with or without them.
#[tokio::test]
async fn ignore_eos_sends_no_stop_ids() {
    let fake = Fake::default();
    let seen = fake.requests_seen.clone();
    let Cluster { http, client, .. } = cluster_of(fake, pagoda_router::DEFAULT_BODY_LIMIT).await;
    for (path, body) in [
        ("/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})),
        ("/v1/completions", json!({"model": MODEL, "prompt": "hi"})),
    ] {
        for ignore_eos in [None, Some(false), Some(true)] {
            let mut body = body.clone();
            if let Some(i) = ignore_eos {
                body["ignore_eos"] = json!(i);
            }
            let r = client.post(format!("{http}{path}")).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200, "{path} {body}");
            let req = seen.lock().unwrap().pop().expect("a Generate call");
            let want = ignore_eos == Some(true);
            assert_eq!(req.ignore_eos, want, "{path} {body}");
            assert_eq!(req.stop_token_ids.is_empty(), want, "{path} {body}: {:?}", req.stop_token_ids);
            // The request's own stop ids stop it either way, after the model's.
            body["stop_token_ids"] = json!([65, EOS]);
            let r = client.post(format!("{http}{path}")).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200, "{path} {body}");
            let req = seen.lock().unwrap().pop().expect("a Generate call");
            assert_eq!(req.stop_token_ids, if want { vec![65, EOS] } else { vec![EOS, 65] }, "{path} {body}");
        }
    }
    let r =
        client.post(format!("{http}/v1/completions")).json(&json!({"model": MODEL, "prompt": "hi", "ignore_eos": 1}));
    assert_eq!(r.send().await.unwrap().status(), 400);
}

/// A worker that goes silent mid-stream: after the stall timeout the request continues elsewhere.
#[tokio::test]
async fn a_stalled_worker_migrates_after_the_stall_timeout() {
    let http =
        migrating_cluster(vec![Fake { stall_after: Some(7), ..Fake::default() }, Fake::default()], migration(300, 2))
            .await;
    let client = reqwest::Client::new();
    for _ in 0..2 {
        let r = client
            .post(format!("{http}/v1/chat/completions"))
            .json(&json!({"model": MODEL, "stream": true, "max_tokens": 20,
                "messages": [{"role": "user", "content": "Capital of France?"}]}))
            .send()
            .await
            .unwrap();
        let (text, _) = streamed_text(&r.text().await.unwrap());
        assert_eq!(text, &REPLY[..20]);
    }
    assert!(migrations_counted(&http, "stall").await >= 1);
}

/// Every worker fails: past the retry limit the client gets a clean error, never a hang: 503 JSON before the first
/// token, an error event then the end of the stream after it.
#[tokio::test]
async fn past_the_retry_limit_the_client_gets_a_clean_error() {
    let http = migrating_cluster(
        vec![Fake { die_after: Some(0), ..Fake::default() }, Fake { die_after: Some(0), ..Fake::default() }],
        migration(300, 1),
    )
    .await;
    let client = reqwest::Client::new();
    let r = client
        .post(format!("{http}/v1/chat/completions"))
        .json(&json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    assert_error(s, &r.text().await.unwrap(), 503);

    let http = migrating_cluster(
        vec![Fake { die_after: Some(3), ..Fake::default() }, Fake { stall_after: Some(3), ..Fake::default() }],
        migration(300, 1),
    )
    .await;
    let started = std::time::Instant::now();
    let r = client
        .post(format!("{http}/v1/chat/completions"))
        .json(&json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let p = sse_payloads(&r.text().await.unwrap());
    assert_eq!(p.last().unwrap(), "[DONE]");
    let err: Value = serde_json::from_str(&p[p.len() - 2]).unwrap();
    assert_eq!(err["error"]["code"], "unavailable", "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    // Non-streaming: the same failure is a 503.
    let (s, text) = {
        let r = client
            .post(format!("{http}/v1/chat/completions"))
            .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    };
    assert_error(s, &text, 503);
}

async fn counter(http: &str, line_prefix: &str) -> u64 {
    let text = reqwest::get(format!("{http}/metrics")).await.unwrap().text().await.unwrap();
    text.lines().filter(|l| l.starts_with(line_prefix)).filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok()).sum()
}

/// A worker whose admission queue is full refuses with `resource_exhausted` + the busy hint: the router tries
/// the next worker without taking the busy one out of placement, and when every worker is busy it sheds the
/// request with 503 and a `Retry-After` taken from the hint.
#[tokio::test]
async fn busy_workers_are_skipped_then_the_request_is_shed_with_retry_after() {
    let client = reqwest::Client::new();
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let http =
        migrating_cluster(vec![Fake { busy: true, ..Fake::default() }, Fake::default()], migration(300, 0)).await;
    for _ in 0..4 {
        let r = client.post(format!("{http}/v1/chat/completions")).json(&chat).send().await.unwrap();
        assert_eq!(r.status(), 200, "a busy worker moves the request on, without using up a retry (max 0)");
    }
    assert!(counter(&http, "pagoda_router_worker_busy_total{").await >= 2);
    assert_eq!(counter(&http, "pagoda_router_shed_total{").await, 0);
    let ready: Value = client.get(format!("{http}/readyz")).send().await.unwrap().json().await.unwrap();
    assert!(ready["workers"].as_array().unwrap().iter().all(|w| w["ready"] == true), "{ready}");

    let http = migrating_cluster(
        vec![Fake { busy: true, ..Fake::default() }, Fake { busy: true, ..Fake::default() }],
        migration(300, 0),
    )
    .await;
    for stream in [false, true] {
        let mut body = chat.clone();
        body["stream"] = json!(stream);
        let r = client.post(format!("{http}/v1/chat/completions")).json(&body).send().await.unwrap();
        assert_eq!(r.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("3"));
        let s = r.status().as_u16();
        let v = assert_error(s, &r.text().await.unwrap(), 503);
        assert_eq!(v["error"]["code"], "server_overloaded", "{v}");
    }
    assert_eq!(counter(&http, "pagoda_router_shed_total{reason=\"workers_busy\"}").await, 2);
}

/// The router's own in-flight cap: past it a generation request gets 503 + `Retry-After` at once, the slot frees
/// when the running response ends (here: its client leaves), and `/v1/models` is not counted.
#[tokio::test]
async fn router_in_flight_cap_sheds_with_retry_after_and_frees_on_end() {
    let fake = Fake::default();
    let open = fake.open.clone();
    let waddr = spawn_worker(fake).await;
    let http = serve_router(RouterConfig {
        workers: vec![waddr.to_string()],
        health_interval: Duration::from_millis(100),
        max_inflight: 1,
        ..RouterConfig::default()
    })
    .await;
    let client = reqwest::Client::new();
    wait_ready(&client, &http).await;
    let forever = json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "forever"}]});
    let running = client.post(format!("{http}/v1/chat/completions")).json(&forever).send().await.unwrap();
    assert_eq!(running.status(), 200);
    let hi = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let r = client.post(format!("{http}/v1/chat/completions")).json(&hi).send().await.unwrap();
    assert_eq!(r.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
    let s = r.status().as_u16();
    let v = assert_error(s, &r.text().await.unwrap(), 503);
    assert_eq!(v["error"]["code"], "server_overloaded");
    assert_eq!(client.get(format!("{http}/v1/models")).send().await.unwrap().status(), 200);
    assert_eq!(counter(&http, "pagoda_router_shed_total{reason=\"router_inflight\"}").await, 1);
    drop(running);
    for _ in 0..100 {
        if open.load(Ordering::SeqCst) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = client.post(format!("{http}/v1/chat/completions")).json(&hi).send().await.unwrap();
    assert_eq!(r.status(), 200, "the slot came back when the stream's client left");
}

/// A router over one fake worker with an in-flight cap of 1 and a short client timeout; its address and the
/// fake's open-stream count.
async fn capped_router(client_timeout: Duration) -> (String, Arc<AtomicUsize>) {
    let fake = Fake::default();
    let open = fake.open.clone();
    let waddr = spawn_worker(fake).await;
    let http = serve_ready(RouterConfig {
        workers: vec![waddr.to_string()],
        health_interval: Duration::from_millis(100),
        max_inflight: 1,
        client_timeout,
        ..RouterConfig::default()
    })
    .await;
    (http, open)
}

/// A raw HTTP/1.1 connection to `http` (so that the test decides when the body is sent and when the answer is
/// read), with a small receive buffer so that a client that stops reading fills its connection quickly.
async fn raw_connection(http: &str) -> tokio::net::TcpStream {
    let addr: SocketAddr = http.trim_start_matches("http://").parse().unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.connect(addr).await.unwrap()
}

/// Reads from `conn` until `needle` has arrived (or the connection ends), for at most `within`.
async fn read_until(conn: &mut tokio::net::TcpStream, got: &mut Vec<u8>, needle: &str, within: Duration) {
    use tokio::io::AsyncReadExt;
    let deadline = tokio::time::Instant::now() + within;
    let mut buf = [0u8; 8192];
    while !String::from_utf8_lossy(got).contains(needle) {
        match tokio::time::timeout_at(deadline, conn.read(&mut buf)).await {
            Ok(Ok(0)) => return,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => panic!("read failed: {e}"),
            Err(_) => panic!("no {needle:?} within {within:?}; got: {}", String::from_utf8_lossy(got)),
        }
    }
}

async fn chat_status(http: &str) -> u16 {
    let hi = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let r = reqwest::Client::new().post(format!("{http}/v1/chat/completions")).json(&hi).send().await.unwrap();
    r.status().as_u16()
}

/// A client that sends its headers and then stops sending its body holds an in-flight slot only until the client
/// timeout: then it gets a JSON 408, and the slot is free again for the next request.
#[tokio::test]
async fn a_body_that_never_arrives_gets_408_and_frees_its_slot() {
    use tokio::io::AsyncWriteExt;
    let (http, _) = capped_router(Duration::from_millis(500)).await;
    let mut conn = raw_connection(&http).await;
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n";
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(br#"{"model": "#).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(chat_status(&http).await, 503, "the stalled body holds the only slot meanwhile");
    let mut got = Vec::new();
    read_until(&mut conn, &mut got, "request_timeout", Duration::from_secs(10)).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.to_ascii_lowercase().contains("content-type: application/json"), "{text}");
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    assert_error(408, body, 408);
    // The stalled connection stays open on the client's side; the slot must not wait for it.
    assert_eq!(chat_status(&http).await, 200, "the slot came back with the 408");
    drop(conn);
}

/// A streaming client that stops reading (but keeps its connection) fills the router's buffers: past the client
/// timeout the generation is cancelled on the worker and the in-flight slot is freed; when the client reads on,
/// its stream ends with an error event and `[DONE]` instead of just stopping.
#[tokio::test]
async fn a_stream_whose_client_stops_reading_is_cancelled_and_frees_its_slot() {
    use tokio::io::AsyncWriteExt;
    let (http, open) = capped_router(Duration::from_millis(300)).await;
    let mut conn = raw_connection(&http).await;
    let body = json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "flood"}]}).to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    read_until(&mut conn, &mut got, "data: ", Duration::from_secs(10)).await;
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
    assert_eq!(open.load(Ordering::SeqCst), 1);
    // Stop reading: the fake worker streams on until the router gives up on this client.
    let mut cancelled = false;
    for _ in 0..600 {
        if open.load(Ordering::SeqCst) == 0 {
            cancelled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(cancelled, "the worker still generates for a client that stopped reading");
    let mut freed = false;
    for _ in 0..100 {
        if chat_status(&http).await == 200 {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(freed, "the slot of a client that stopped reading was not freed");
    read_until(&mut conn, &mut got, "data: [DONE]", Duration::from_secs(30)).await;
    let text = String::from_utf8_lossy(&got);
    let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let err: Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert!(err["error"]["message"].as_str().is_some_and(|m| m.contains("ended without finishing")), "{err}");
}

/// `top_p` and `repetition_penalty` are checked as the worker gets them (f32): values that are positive as
/// f64 but 0 in f32 (nucleus sampling silently off) or so small that the logits become infinite are a 400, and
/// nothing reaches the worker.
#[tokio::test]
async fn sampling_values_that_vanish_in_f32_are_refused() {
    let c = cluster().await;
    let mut cases = Vec::new();
    for (extra, param) in [
        (json!({"top_p": 1e-46}), "top_p"),
        (json!({"repetition_penalty": 1e-38}), "repetition_penalty"),
        (json!({"repetition_penalty": 0.001}), "repetition_penalty"),
    ] {
        cases.push(("/v1/chat/completions", chat_saying_hi(extra.clone()), param, param));
        cases.push(("/v1/completions", completion_of_hi(extra), param, param));
    }
    assert_refused(&c, &cases).await;
    assert_eq!(c.started.load(Ordering::SeqCst), 0, "nothing reached the worker");
    // The smallest documented penalty is taken.
    let (s, v) = c.chat(chat_saying_hi(json!({"repetition_penalty": 0.01}))).await;
    assert_eq!(s, 200, "{v}");
}

/// Two guide fields are refused as such before either is compiled: even when both are invalid, the answer is
/// the "only one" error, not a compile error of the first.
#[tokio::test]
async fn two_guides_are_refused_before_either_is_compiled() {
    let c = cluster().await;
    assert_refused(
        &c,
        &[
            (
                "/v1/chat/completions",
                chat_saying_hi(json!({"guided_regex": "(unclosed", "guided_grammar": "not a grammar ::= ("})),
                "guided_grammar",
                "only one of `guided_regex` and `guided_grammar`",
            ),
            (
                "/v1/completions",
                completion_of_hi(json!({"guided_json": {"type": 5}, "guided_choice": "not a list"})),
                "guided_choice",
                "only one of `guided_json` and `guided_choice`",
            ),
            (
                "/v1/chat/completions",
                chat_saying_hi(json!({"guided_grammar": "(", "structured_outputs": {"regex": "("}})),
                "structured_outputs.regex",
                "only one of `guided_grammar` and `structured_outputs.regex`",
            ),
        ],
    )
    .await;
    assert_eq!(c.started.load(Ordering::SeqCst), 0);
}

/// A request that needs more KV blocks than the worker's pool has can never run: the worker refuses it as an
/// invalid argument, and the client gets a 400 (not a 429 that SDKs would retry forever).
#[tokio::test]
async fn a_request_too_large_for_the_pool_is_a_400() {
    let c = cluster().await;
    for stream in [false, true] {
        let body = json!({"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": "enormous"}]});
        let (s, text) = c.post("/v1/chat/completions", body.to_string()).await;
        let v = assert_error(s, &text, 400);
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains("KV blocks") && m.contains("max_tokens"), "{v}");
    }
    c.still_serves().await;
}

/// The dashboard login answers what is not its form with the router's JSON errors, not axum's plain text.
#[tokio::test]
async fn dashboard_login_rejects_bad_forms_with_json_errors() {
    let c = cluster().await;
    let url = format!("{}/dashboard/login", c.http);
    let r = c.client.post(&url).body("key=x").send().await.unwrap();
    let s = r.status().as_u16();
    let v = assert_error(s, &r.text().await.unwrap(), 415);
    assert_eq!(v["error"]["param"], "key", "{v}");
    let r = c
        .client
        .post(&url)
        .header("content-type", "application/x-www-form-urlencoded")
        .body("other=1")
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    assert_error(s, &r.text().await.unwrap(), 422);
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// HMAC-SHA256 (RFC 2104) with a key of at most one block.
fn hmac_sha256(key: &[u8], msg: &[u8]) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let mut block = [0u8; 64];
    block[..key.len()].copy_from_slice(key);
    let pad = |byte: u8| block.map(|k| k ^ byte);
    let inner = Sha256::new().chain_update(pad(0x36)).chain_update(msg).finalize();
    Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize().to_vec()
}

/// A dashboard session cookie is no HMAC under the admin key's SHA-256, which a `sha256:` admin key file shows:
/// one forged from that digest is refused, whichever form the file takes, and a real login's cookie works.
#[tokio::test]
async fn dashboard_sessions_cannot_be_forged_from_the_admin_key_digest() {
    use sha2::{Digest, Sha256};
    let waddr = spawn_worker(Fake::default()).await;
    let no_redirects = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let digest = Sha256::digest(ADMIN.as_bytes());
    let expires = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() + 3600;
    let mac = hmac_sha256(&digest, format!("pagoda-dashboard-session:{expires}").as_bytes());
    let forged = format!("pagoda_dashboard={expires}.{}", hex(&mac));
    for file in [ADMIN.to_string(), format!("sha256:{}", hex(&digest))] {
        let admin = AdminKey::parse(&file, std::path::Path::new("admin")).unwrap();
        let security = Security { keys: None, admin: Some(admin) };
        let http =
            spawn_router_with(vec![waddr.to_string()], pagoda_router::DEFAULT_BODY_LIMIT, security, Strategy::Kv).await;
        wait_ready(&no_redirects, &http).await;
        let state =
            |cookie: String| no_redirects.get(format!("{http}/dashboard/api/state")).header("cookie", cookie).send();
        assert_eq!(state(forged.clone()).await.unwrap().status(), 401, "{file}");
        let r = no_redirects.post(format!("{http}/dashboard/login")).form(&[("key", ADMIN)]).send().await.unwrap();
        assert_eq!(r.status(), 303, "{file}");
        let cookie = r.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string();
        assert_ne!(cookie, forged);
        assert_eq!(state(cookie).await.unwrap().status(), 200, "{file}");
    }
}

/// `load_inplace` with a path that does not load leaves the adapter it was to replace loaded; one that loads
/// replaces it, in one call to the worker (no trial copy, no unload), even with every slot taken. A load's NotFound
/// is about its `lora_path`, not a missing model.
#[tokio::test]
async fn lora_load_inplace_keeps_the_old_adapter_when_the_new_one_fails() {
    let fake = Fake { lora_dir: true, ..Fake::default() };
    let (loras, calls) = (fake.loras.clone(), fake.lora_calls.clone());
    let c = cluster_of(fake, pagoda_router::DEFAULT_BODY_LIMIT).await;
    let load = |name: &str, path: &str, inplace: bool| {
        c.post(
            "/v1/load_lora_adapter",
            json!({"lora_name": name, "lora_path": path, "load_inplace": inplace}).to_string(),
        )
    };
    let loaded = || loras.lock().unwrap().clone().into_iter().collect::<Vec<_>>();
    let pair = |n: &str, p: &str| (n.to_string(), p.to_string());

    let (s, body) = load("sql", "sql-v1", false).await;
    assert_eq!(s, 200, "{body}");
    let (s, body) = load("sql", "missing/sql-v2", true).await;
    assert_error(s, &body, 400);
    assert_eq!(loaded(), [pair("sql", "sql-v1")], "a failed replacement keeps the adapter");
    let (s, body) = load("sql", "sql-v2", true).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(loaded(), [pair("sql", "sql-v2")], "replaced, and the trial copy is gone");

    let (s, body) = load("other", "vanished/x", false).await;
    let v = assert_error(s, &body, 400);
    assert_eq!(v["error"]["param"], "lora_path", "{v}");

    for name in ["a1", "a2"] {
        assert_eq!(load(name, name, false).await.0, 200);
    }
    let (s, body) = load("sql", "sql-v3", true).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(
        loaded(),
        [pair("a1", "a1"), pair("a2", "a2"), pair("sql", "sql-v3")],
        "a full worker replaces in the old one's slot"
    );
    let calls = calls.lock().unwrap().clone();
    assert_eq!(
        calls,
        ["load sql", "replace sql", "replace sql", "load other", "load a1", "load a2", "replace sql"],
        "one call per replacement, and never an unload or a trial copy"
    );

    let (s, body) = c.post("/v1/unload_lora_adapter", json!({"lora_name": "nope"}).to_string()).await;
    assert_error(s, &body, 404);
}

/// A client that hangs up while an in-place replace is under way does not cut it off: the worker still gets its
/// one replace call through, and ends with the new adapter.
#[tokio::test]
async fn lora_load_inplace_completes_when_the_client_hangs_up() {
    let fake = Fake { lora_dir: true, lora_load_delay: Some(Duration::from_millis(400)), ..Fake::default() };
    let (loras, calls) = (fake.loras.clone(), fake.lora_calls.clone());
    let c = cluster_of(fake, pagoda_router::DEFAULT_BODY_LIMIT).await;
    let (s, body) = c.post("/v1/load_lora_adapter", json!({"lora_name": "sql", "lora_path": "v1"}).to_string()).await;
    assert_eq!(s, 200, "{body}");
    let replace = json!({"lora_name": "sql", "lora_path": "v2", "load_inplace": true});
    let sent = c
        .client
        .post(format!("{}/v1/load_lora_adapter", c.http))
        .header("content-type", "application/json")
        .body(replace.to_string())
        .timeout(Duration::from_millis(100))
        .send()
        .await;
    assert!(sent.is_err_and(|e| e.is_timeout()), "the client was to hang up before the worker answered");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while loras.lock().unwrap().get("sql").map(String::as_str) != Some("v2") {
        assert!(tokio::time::Instant::now() < deadline, "the replace was cut off: {:?}", loras.lock().unwrap());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(*calls.lock().unwrap(), ["load sql", "replace sql"]);
}

/// A remote prefill runs with the tenant's weight, as the decode request does, so fair scheduling on the prefill
/// worker shares it out by the same weights.
#[tokio::test]
async fn remote_prefill_carries_the_tenant_weight() {
    let prefill = Fake { role: "prefill", ..Fake::default() };
    let decode = Fake { role: "decode", ..Fake::default() };
    let (prefill_seen, decode_seen) = (prefill.requests_seen.clone(), decode.requests_seen.clone());
    let workers = vec![spawn_worker(prefill).await.to_string(), spawn_worker(decode).await.to_string()];
    let keys = KeyTable::parse(&format!("{KEY_A} acme weight=3\n"), std::path::Path::new("keys")).unwrap();
    let http = serve_router(RouterConfig {
        workers,
        health_interval: Duration::from_millis(100),
        placement: PlacerConfig { remote_prefill_min_tokens: 1, ..PlacerConfig::default() },
        security: Security { keys: Some(Arc::new(keys)), admin: None },
        ..RouterConfig::default()
    })
    .await;
    let client = reqwest::Client::new();
    wait_all_ready(&client, &http).await;
    let hi = json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let r = client.post(format!("{http}/v1/chat/completions")).bearer_auth(KEY_A).json(&hi).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let weights = |seen: &std::sync::Mutex<Vec<GenerateRequest>>| {
        seen.lock().unwrap().iter().map(|r| (r.max_tokens, r.tenant_weight)).collect::<Vec<_>>()
    };
    assert_eq!(weights(&prefill_seen), [(1, 3)], "the prefill request");
    assert_eq!(weights(&decode_seen), [(4, 3)], "the decode request");
}

/// A chat request for four tokens of an answer to `content`.
fn ask_four_tokens(content: &str) -> Value {
    json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]})
}

/// A prefill worker that takes a long prompt and then stays silent (its engine stuck, its health check still
/// answering) is ejected from placement: the request waits the first-token timeout once and its decode worker
/// prefills, and the next long prompt goes straight to the decode worker instead of waiting on it again, though
/// every health probe since said it was ready.
#[tokio::test]
async fn a_silent_prefill_worker_is_ejected_though_its_health_check_answers() {
    let prefill = Fake { role: "prefill", stall_after: Some(0), ..Fake::default() };
    let decode = Fake { role: "decode", ..Fake::default() };
    let (prefill_seen, decode_seen) = (prefill.requests_seen.clone(), decode.requests_seen.clone());
    let prefill_addr = spawn_worker(prefill).await.to_string();
    let workers = vec![prefill_addr.clone(), spawn_worker(decode).await.to_string()];
    let http = serve_router(RouterConfig {
        workers,
        health_interval: Duration::from_millis(50),
        placement: PlacerConfig { remote_prefill_min_tokens: 1, ..PlacerConfig::default() },
        // A 400 ms first-token timeout.
        migration: migration(100, 2),
        ..RouterConfig::default()
    })
    .await;
    let client = reqwest::Client::new();
    wait_all_ready(&client, &http).await;
    let started = Instant::now();
    let r = client.post(format!("{http}/v1/chat/completions")).json(&ask_four_tokens("first")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(started.elapsed() >= Duration::from_millis(400), "it waited on the prefill worker");
    // Several health rounds pass: each finds the prefill worker ready.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ready: Value = client.get(format!("{http}/readyz")).send().await.unwrap().json().await.unwrap();
    let entry = ready["workers"].as_array().unwrap().iter().find(|w| w["address"] == prefill_addr.as_str()).unwrap();
    assert_eq!(entry["ready"], true, "{ready}");
    assert!(entry["ejected_for_ms"].as_u64().unwrap() > 0, "{ready}");
    let started = Instant::now();
    let r = client.post(format!("{http}/v1/chat/completions")).json(&ask_four_tokens("second")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(started.elapsed() < Duration::from_millis(400), "waited again: {:?}", started.elapsed());
    assert_eq!(prefill_seen.lock().unwrap().len(), 1, "the second prompt skipped the silent prefill worker");
    assert_eq!(decode_seen.lock().unwrap().len(), 2);
    let metrics = client.get(format!("{http}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("pagoda_router_remote_prefills_total{outcome=\"timeout\"} 1"), "{metrics}");
}

/// While a prefill worker computes a long prompt, the decode worker chosen for it already counts the stream coming
/// its way: a second long prompt arriving meanwhile goes to the other, idle, decode worker.
#[tokio::test]
async fn a_decode_worker_waiting_on_a_remote_prefill_counts_as_loaded() {
    let prefill = Fake { role: "prefill", first_message_delay: Some(Duration::from_millis(800)), ..Fake::default() };
    let decoders = [Fake { role: "decode", ..Fake::default() }, Fake { role: "decode", ..Fake::default() }];
    let seen: Vec<_> = decoders.iter().map(|d| d.requests_seen.clone()).collect();
    let mut workers = vec![spawn_worker(prefill).await.to_string()];
    for d in decoders {
        workers.push(spawn_worker(d).await.to_string());
    }
    let http = serve_router(RouterConfig {
        workers,
        health_interval: Duration::from_millis(100),
        placement: PlacerConfig { remote_prefill_min_tokens: 1, ..PlacerConfig::default() },
        ..RouterConfig::default()
    })
    .await;
    let client = reqwest::Client::new();
    wait_all_ready(&client, &http).await;
    let first = {
        let (client, http, body) = (client.clone(), http.clone(), ask_four_tokens("the first long prompt"));
        tokio::spawn(async move { client.post(format!("{http}/v1/chat/completions")).json(&body).send().await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second =
        client.post(format!("{http}/v1/chat/completions")).json(&ask_four_tokens("another long prompt")).send();
    assert_eq!(second.await.unwrap().status(), 200);
    assert_eq!(first.await.unwrap().unwrap().status(), 200);
    let decoded: Vec<usize> = seen.iter().map(|s| s.lock().unwrap().len()).collect();
    assert_eq!(decoded, [1, 1], "one stream on each decode worker");
}

/// Waits until the router sees every worker ready.
async fn wait_all_ready(client: &reqwest::Client, http: &str) {
    for _ in 0..100 {
        if let Ok(r) = client.get(format!("{http}/readyz")).send().await
            && let Ok(v) = r.json::<Value>().await
            && v["workers"].as_array().is_some_and(|ws| !ws.is_empty() && ws.iter().all(|w| w["ready"] == true))
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("router never saw every worker ready");
}

/// A worker that leaves the pool leaves the dashboard's rows (the others keep their own stats, not the rows
/// above them) and every per-worker metric.
#[tokio::test]
async fn a_departed_worker_leaves_the_dashboard_and_the_metrics() {
    use pagoda_router::workers::WorkerPool;
    let gone = spawn_worker(Fake { blocks_total: Some(111), rich_stats: true, ..Fake::default() }).await.to_string();
    let kept = spawn_worker(Fake { blocks_total: Some(222), rich_stats: true, ..Fake::default() }).await.to_string();
    let pool = Arc::new(WorkerPool::dynamic(&[gone.clone(), kept.clone()], PlacerConfig::default()).unwrap());
    let state = pagoda_router::AppState::new(Arc::new(ByteCodec), pool.clone(), pagoda_router::DEFAULT_BODY_LIMIT);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, pagoda_router::app(state)).await });
    let client = reqwest::Client::new();
    let rows = || async {
        let v: Value = client.get(format!("{http}/dashboard/api/state")).send().await.unwrap().json().await.unwrap();
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| (w["address"].as_str().unwrap().to_string(), w["stats"]["blocks_total"].as_u64()))
            .collect::<Vec<_>>()
    };
    let metric_lines = |worker: String| {
        let client = client.clone();
        let url = format!("{http}/metrics");
        async move {
            let text = client.get(url).send().await.unwrap().text().await.unwrap();
            text.lines().filter(|l| l.contains(&format!("worker=\"{worker}\""))).map(String::from).collect::<Vec<_>>()
        }
    };
    assert_eq!(rows().await, [(gone.clone(), Some(111)), (kept.clone(), Some(222))]);
    assert!(metric_lines(gone.clone()).await.len() >= 30);
    assert!(pool.remove(&gone));
    // Within the dashboard's cache age, so the rows are read against the two-worker fetch.
    assert_eq!(rows().await, [(kept.clone(), Some(222))]);
    assert_eq!(metric_lines(gone).await, Vec::<String>::new());
    assert!(metric_lines(kept).await.iter().any(|l| l.starts_with("pagoda_router_worker_tier_used_bytes")));
}

/// Anthropic's API gets Anthropic's error shape from the admission middlewares too: a missing or wrong key,
/// a key past its rate, and the router's in-flight cap. The OpenAI endpoints keep theirs.
#[tokio::test]
async fn admission_refusals_on_v1_messages_are_anthropic_errors() {
    let keys =
        KeyTable::parse(&format!("{KEY_A} acme\n{KEY_B} globex rps=0.01 burst=1\n"), std::path::Path::new("keys"))
            .unwrap();
    let waddr = spawn_worker(Fake::default()).await;
    let http = serve_router(RouterConfig {
        workers: vec![waddr.to_string()],
        health_interval: Duration::from_millis(100),
        security: Security { keys: Some(Arc::new(keys)), admin: None },
        max_inflight: 1,
        ..RouterConfig::default()
    })
    .await;
    let client = reqwest::Client::new();
    wait_ready(&client, &http).await;
    let ask = json!({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
    let post = |path: &str, key: Option<&str>, body: &Value| {
        let mut r = client.post(format!("{http}{path}")).json(body);
        if let Some(k) = key {
            r = r.header("x-api-key", k);
        }
        async move {
            let r = r.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    let anthropic = |(status, v): (u16, Value), want: u16, kind: &str| {
        assert_eq!(status, want, "{v}");
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], kind, "{v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    };
    anthropic(post("/v1/messages", None, &ask).await, 401, "authentication_error");
    anthropic(post("/v1/messages", Some("sk-wrong-key-0123456789"), &ask).await, 401, "authentication_error");
    anthropic(post("/v1/messages/count_tokens", None, &ask).await, 401, "authentication_error");
    let (s, v) = post("/v1/chat/completions", None, &ask).await;
    assert_eq!((s, v["error"]["code"].as_str()), (401, Some("invalid_api_key")), "{v}");

    assert_eq!(post("/v1/messages", Some(KEY_B), &ask).await.0, 200);
    anthropic(post("/v1/messages", Some(KEY_B), &ask).await, 429, "rate_limit_error");

    let forever = json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "forever"}]});
    let running =
        client.post(format!("{http}/v1/chat/completions")).bearer_auth(KEY_A).json(&forever).send().await.unwrap();
    assert_eq!(running.status(), 200);
    anthropic(post("/v1/messages", Some(KEY_A), &ask).await, 503, "overloaded_error");
    drop(running);
}

/// Starts a router with `cfg` on a free port; its base URL.
async fn serve_router(cfg: RouterConfig) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(pagoda_router::serve(listener, Arc::new(ByteCodec), cfg, std::future::pending()));
    http
}

/// Starts a router with `cfg` and waits until it is ready; its base URL.
async fn serve_ready(cfg: RouterConfig) -> String {
    let http = serve_router(cfg).await;
    wait_ready(&reqwest::Client::new(), &http).await;
    http
}

/// The value of the series `line_prefix` (its name and labels) in a metrics text.
fn metric_value(text: &str, line_prefix: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(line_prefix)?.strip_prefix(' ')?.parse().ok())
}

/// `/metrics` reads the worker gauges from the `Stats` snapshot it shares with the dashboard: a burst of scrapes
/// (and a dashboard poll) within the snapshot's age costs the worker one `Stats` call, and once the snapshot has
/// aged the next scrape fetches again and shows what changed.
#[tokio::test]
async fn metrics_scrapes_share_one_stats_fan_out_per_snapshot_age() {
    let fake = Fake::default();
    let stats_calls = fake.stats_calls.clone();
    let waddr = spawn_worker(fake).await;
    // The health probe that makes the worker ready asks for its Stats too; the next is an hour away.
    let cfg = RouterConfig {
        workers: vec![waddr.to_string()],
        health_interval: Duration::from_secs(3600),
        ..RouterConfig::default()
    };
    let http = serve_ready(cfg).await;
    let client = reqwest::Client::new();
    let used = format!("pagoda_router_worker_used_blocks{{worker=\"{waddr}\"}}");
    let scrape = || async { client.get(format!("{http}/metrics")).send().await.unwrap().text().await.unwrap() };
    let before = stats_calls.load(Ordering::SeqCst);
    let t0 = std::time::Instant::now();
    let burst = futures::future::join_all((0..16).map(|_| scrape())).await;
    for text in &burst {
        assert_eq!(metric_value(text, &used), Some(0.0), "{text}");
    }
    let r = client.get(format!("{http}/dashboard/api/state")).send().await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["workers"][0]["stats"]["blocks_used"], 0);
    for _ in 0..4 {
        scrape().await;
    }
    let calls = stats_calls.load(Ordering::SeqCst) - before;
    // One snapshot age is far more than the scrapes take; a machine slow enough to exceed it gets one more per age.
    let ages = (t0.elapsed().as_secs_f64() / pagoda_router::stats_cache::STATS_MAX_AGE.as_secs_f64()) as usize;
    assert!((1..=1 + ages).contains(&calls), "{calls} Stats fan-outs for 20 scrapes and a dashboard poll");

    // A stream open on the worker: its Stats now say 3 blocks used.
    let forever = json!({"model": MODEL, "stream": true, "messages": [{"role": "user", "content": "forever"}]});
    let mut stream = client.post(format!("{http}/v1/chat/completions")).json(&forever).send().await.unwrap();
    assert_eq!(stream.status(), 200);
    stream.chunk().await.unwrap().unwrap();
    tokio::time::sleep(pagoda_router::stats_cache::STATS_MAX_AGE + Duration::from_millis(100)).await;
    let aged = stats_calls.load(Ordering::SeqCst);
    let text = scrape().await;
    assert_eq!(metric_value(&text, &used), Some(3.0), "{text}");
    assert_eq!(stats_calls.load(Ordering::SeqCst) - aged, 1, "one more fan-out once the snapshot aged");
    drop(stream);
}

/// Two API keys of two tenants, and a router over one fake worker whose response store holds `max_entries`
/// responses.
async fn two_tenants_with_a_small_store(max_entries: usize) -> String {
    use pagoda_router::responses::{ResponseBackend, ResponseStore};
    use pagoda_router::workers::WorkerPool;
    let keys = KeyTable::parse(&format!("{KEY_A} acme\n{KEY_B} globex\n"), std::path::Path::new("keys")).unwrap();
    let waddr = spawn_worker(Fake::default()).await;
    let pool = Arc::new(WorkerPool::new(&[waddr.to_string()]).unwrap());
    let health = pool.spawn_health_loop(Duration::from_millis(100));
    let security = Security { keys: Some(Arc::new(keys)), admin: None };
    let state =
        pagoda_router::AppState::with_security(Arc::new(ByteCodec), pool, pagoda_router::DEFAULT_BODY_LIMIT, security)
            .with_responses(ResponseBackend::Local(std::sync::Mutex::new(ResponseStore::new(max_entries, 1 << 20))));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let served = axum::serve(listener, pagoda_router::app(state)).await;
        health.abort();
        served
    });
    wait_ready(&reqwest::Client::new(), &http).await;
    http
}

/// Stored responses are shared out between tenants: one tenant storing many evicts its own oldest, never
/// another tenant's response.
#[tokio::test]
async fn one_tenants_stored_responses_do_not_evict_anothers() {
    let http = two_tenants_with_a_small_store(4).await;
    let client = reqwest::Client::new();
    let store = |key: &'static str| {
        let r = client
            .post(format!("{http}/v1/responses"))
            .bearer_auth(key)
            .json(&json!({"model": MODEL, "input": "hi", "max_output_tokens": 4}))
            .send();
        async move {
            let r = r.await.unwrap();
            assert_eq!(r.status(), 200);
            r.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string()
        }
    };
    let get = |key: &'static str, id: &str| {
        let r = client.get(format!("{http}/v1/responses/{id}")).bearer_auth(key).send();
        async move { r.await.unwrap().status().as_u16() }
    };
    let globex = store(KEY_B).await;
    let mut acme = Vec::new();
    for _ in 0..10 {
        acme.push(store(KEY_A).await);
    }
    assert_eq!(get(KEY_B, &globex).await, 200, "acme's traffic evicted globex's stored response");
    assert_eq!(get(KEY_A, &acme[0]).await, 404, "the store stays bounded: acme's oldest went");
    assert_eq!(get(KEY_A, &acme[9]).await, 200);
    assert_eq!(get(KEY_A, &globex).await, 404, "a tenant sees only its own");
}

/// A Responses request whose input the chat path refuses gets an error naming the client's `input[j]` item (and
/// its field), not the translated chat's `messages[k]`, whatever came before it: `instructions`, or an earlier
/// conversation.
#[tokio::test]
async fn responses_errors_name_the_input_item_not_the_chat_message() {
    let c = cluster().await;
    let long_id = "c".repeat(pagoda_router::openai::MAX_NAME_BYTES + 1);
    let items = json!([
        {"role": "user", "content": "What is the weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": long_id, "output": "sunny"},
    ]);
    let body = json!({"model": MODEL, "instructions": "Be brief.", "input": items, "store": false});
    let (s, text) = c.post("/v1/responses", body.to_string()).await;
    let v = assert_error(s, &text, 400);
    assert_eq!(v["error"]["param"], "input[2].call_id", "{v}");
    assert!(!v["error"]["message"].as_str().unwrap().contains("messages["), "{v}");

    // After a stored turn (its input and answer come first in the chat), without instructions.
    let first = c.post_ok("/v1/responses", &json!({"model": MODEL, "input": "hi", "max_output_tokens": 4})).await;
    let first: Value = serde_json::from_str(&first).unwrap();
    let follow_up = json!({"model": MODEL, "previous_response_id": first["id"], "input": [
        {"role": "user", "content": "And tomorrow?"},
        {"type": "function_call_output", "call_id": long_id, "output": "rain"},
    ]});
    let (s, text) = c.post("/v1/responses", follow_up.to_string()).await;
    let v = assert_error(s, &text, 400);
    assert_eq!(v["error"]["param"], "input[1].call_id", "{v}");
}

/// Reads one HTTP/1.1 response from `conn` (a `content-length` or chunked body); its status and body.
async fn read_response(conn: &mut tokio::net::TcpStream) -> (u16, String) {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    read_until(conn, &mut got, "\r\n\r\n", Duration::from_secs(10)).await;
    let text = String::from_utf8_lossy(&got).into_owned();
    let (head, _) = text.split_once("\r\n\r\n").unwrap();
    let head_len = head.len() + 4;
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let lower = head.to_ascii_lowercase();
    let length: Option<usize> =
        lower.lines().find_map(|l| l.strip_prefix("content-length:")).map(|n| n.trim().parse().unwrap());
    let mut buf = [0u8; 8192];
    match length {
        Some(n) => {
            while got.len() < head_len + n {
                let read = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut buf)).await.unwrap().unwrap();
                assert!(read > 0, "the connection closed mid-body");
                got.extend_from_slice(&buf[..read]);
            }
        }
        None => {
            assert!(lower.contains("transfer-encoding: chunked"), "{head}");
            read_until(conn, &mut got, "\r\n0\r\n\r\n", Duration::from_secs(10)).await;
        }
    }
    (status, String::from_utf8_lossy(&got[head_len..]).into_owned())
}

/// A key's concurrency permit is held for its response, not its connection: with a limit of 1, requests one after
/// another on one keep-alive connection all pass, and so does a request on another connection while the first
/// stays open between its requests (plain and streamed answers alike).
#[tokio::test]
async fn a_keys_concurrency_permit_ends_with_the_response_not_the_connection() {
    use tokio::io::AsyncWriteExt;
    let keys = KeyTable::parse(&format!("{KEY_A} acme concurrency=1\n"), std::path::Path::new("keys")).unwrap();
    let waddr = spawn_worker(Fake::default()).await;
    let http = serve_ready(RouterConfig {
        workers: vec![waddr.to_string()],
        health_interval: Duration::from_millis(100),
        security: Security { keys: Some(Arc::new(keys)), admin: None },
        ..RouterConfig::default()
    })
    .await;
    let other_connection = || async {
        // A fresh client: its own connection.
        let hi = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
        let r = reqwest::Client::new().post(format!("{http}/v1/chat/completions")).bearer_auth(KEY_A).json(&hi);
        r.send().await.unwrap().status().as_u16()
    };
    let mut conn = raw_connection(&http).await;
    for stream in [false, true, false, true] {
        let body = json!({"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": "hi"}]});
        let body = body.to_string();
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY_A}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        conn.write_all(request.as_bytes()).await.unwrap();
        let (status, answer) = read_response(&mut conn).await;
        assert_eq!(status, 200, "on the kept-alive connection (stream: {stream}): {answer}");
        assert!(answer.contains(if stream { "[DONE]" } else { "chat.completion" }), "{answer}");
        // The first connection is open and idle: its permit must be back already.
        assert_eq!(other_connection().await, 200, "refused while the first connection idles (stream: {stream})");
    }
}

/// The dashboard login's form is read under the client timeout like every other body: a client that sends its
/// headers and part of the form, then stalls, gets a JSON 408 instead of holding the handler open.
#[tokio::test]
async fn a_stalled_dashboard_login_gets_408() {
    use tokio::io::AsyncWriteExt;
    let waddr = spawn_worker(Fake::default()).await;
    let http = serve_ready(RouterConfig {
        workers: vec![waddr.to_string()],
        health_interval: Duration::from_millis(100),
        client_timeout: Duration::from_millis(300),
        ..RouterConfig::default()
    })
    .await;
    let mut conn = raw_connection(&http).await;
    let head = "POST /dashboard/login HTTP/1.1\r\nhost: x\r\ncontent-type: application/x-www-form-urlencoded\r\n\
                content-length: 100\r\n\r\n";
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(b"key=sk-").await.unwrap();
    let mut got = Vec::new();
    read_until(&mut conn, &mut got, "request_timeout", Duration::from_secs(5)).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.to_ascii_lowercase().contains("content-type: application/json"), "{text}");
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    assert_error(408, body, 408);
}
