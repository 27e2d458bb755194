//! End-to-end tests of API keys, tenants, per-key limits and the admin key through the real `pagoda up` binary
//! and the real model: 401/403 cases, rate and concurrency 429s with `Retry-After`, concurrency slots released when
//! a stream ends and when its client disconnects, tenant isolation of the prefix cache (checked through the
//! worker's gRPC Stats and `usage.prompt_tokens_details.cached_tokens`, with the TTFT difference), and malformed
//! bodies and headers that must get a 4xx, never a 5xx or a hang.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, assert_error, chat, start_up};
use pagoda_e2e::reqwest;
use pagoda_e2e::reqwest::header::{AUTHORIZATION, HeaderValue};
use pagoda_e2e::serde_json::{Value, json};
use pagoda_e2e::{Http, MODEL_ID, worker_stats};

const ACME: &str = "sk-acme-0123456789abcdef";
const GLOBEX: &str = "sk-globex-0123456789abcdef";
const SLOW: &str = "sk-slow-0123456789abcdef";
const SINGLE: &str = "sk-single-0123456789abcdef";
const ADMIN: &str = "sk-admin-0123456789abcdef";

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("pagoda-sec-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn write(&self, name: &str, text: &str) -> String {
        let p = self.0.join(name);
        let mut f = std::fs::File::create(&p).unwrap();
        f.write_all(text.as_bytes()).unwrap();
        p.to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn keys_file() -> String {
    format!(
        "# Pagoda API keys: <key> <tenant> [rps=N] [burst=N] [concurrency=N]\n\n\
         {ACME} acme\n\
         {GLOBEX}\tglobex\n\
         {SLOW} throttled rps=0.5 burst=2\n\
         {SINGLE} single concurrency=1\n"
    )
}

async fn send(
    http: &Http,
    key: Option<&str>,
    path: &str,
    body: Option<&Value>,
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut req = match body {
        Some(b) => http.client.post(http.url(path)).json(b),
        None => http.client.get(http.url(path)),
    };
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let r = req.send().await.unwrap_or_else(|e| panic!("{path}: {e}"));
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, headers, r.text().await.unwrap())
}

fn parse(body: &str) -> Value {
    pagoda_e2e::serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// A non-streaming one-token chat as `key`: the latency of such a request is its time to first token.
async fn one_token(http: &Http, key: &str, prompt: &str) -> (Duration, Value) {
    let body = chat(prompt, json!({"max_tokens": 1, "temperature": 0}));
    let t0 = Instant::now();
    let (s, _, text) = send(http, Some(key), "/v1/chat/completions", Some(&body)).await;
    let took = t0.elapsed();
    assert_eq!(s, 200, "{text}");
    (took, parse(&text))
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or_else(|| panic!("no cached_tokens: {v}"))
}

/// Starts a long stream as `key` and reads until some tokens have arrived, so the request is surely in flight.
async fn start_long_stream(http: &Http, key: &str) -> reqwest::Response {
    let mut r = http
        .client
        .post(http.url("/v1/completions"))
        .bearer_auth(key)
        .json(&json!({"model": MODEL_ID, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 2000,
                      "temperature": 0, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut got = String::new();
    while got.matches("data: ").count() < 3 {
        let chunk = r.chunk().await.unwrap().expect("stream ended early");
        got.push_str(&String::from_utf8_lossy(&chunk));
    }
    r
}

async fn key_usage(http: &Http, tenant: &str) -> Value {
    let (s, _, text) = send(http, Some(ADMIN), "/debug/keys", None).await;
    assert_eq!(s, 200, "{text}");
    let v = parse(&text);
    v["keys"].as_array().unwrap().iter().find(|k| k["tenant"] == tenant).cloned().unwrap_or_else(|| panic!("{v}"))
}

fn assert_rate_limited(case: &str, status: u16, headers: &reqwest::header::HeaderMap, body: &str) -> u64 {
    let v = assert_error(case, status, body, 429);
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{case}: {v}");
    let retry = headers
        .get("retry-after")
        .and_then(|h| h.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("{case}: no numeric Retry-After: {headers:?}"));
    assert!(retry >= 1, "{case}: Retry-After {retry}");
    retry
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_limits_admin_and_tenant_isolation() {
    let dir = TempDir::new("main");
    let keys = dir.write("keys.txt", &keys_file());
    let admin = dir.write("admin.txt", &format!("# admin\n{ADMIN}\n"));
    let up = start_up("sec-main", &["--api-keys-file", &keys, "--admin-key-file", &admin]).await.unwrap();
    let http = &up.http;
    let hello = chat("Say hi.", json!({"max_tokens": 2, "temperature": 0}));

    // --- Authentication on /v1/*.
    for (case, key) in [("no key", None), ("wrong key", Some("sk-wrong-0123456789abcdef")), ("admin key", Some(ADMIN))]
    {
        let (s, h, text) = send(http, key, "/v1/chat/completions", Some(&hello)).await;
        let v = assert_error(case, s, &text, 401);
        assert_eq!(v["error"]["code"], "invalid_api_key", "{case}: {v}");
        assert_eq!(h.get("www-authenticate").map(|v| v.to_str().unwrap()), Some("Bearer"), "{case}");
        let (s, _, text) = send(http, key, "/v1/models", None).await;
        assert_error(case, s, &text, 401);
    }
    let (s, _, text) = send(http, Some(ACME), "/v1/chat/completions", Some(&hello)).await;
    assert_eq!(s, 200, "{text}");
    let (s, _, text) = send(http, Some(GLOBEX), "/v1/models", None).await;
    assert_eq!(s, 200, "{text}");
    for open in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(send(http, None, open, None).await.0, 200, "{open} stays open");
    }

    // --- Admin endpoint.
    let (s, h, text) = send(http, None, "/debug/keys", None).await;
    assert_error("admin without key", s, &text, 401);
    assert!(h.contains_key("www-authenticate"));
    let (s, _, text) = send(http, Some("sk-wrong-0123456789abcdef"), "/debug/keys", None).await;
    assert_error("admin with a wrong key", s, &text, 401);
    let (s, _, text) = send(http, Some(ACME), "/debug/keys", None).await;
    let v = assert_error("admin with a tenant key", s, &text, 403);
    assert_eq!(v["error"]["code"], "permission_denied");
    let (s, _, text) = send(http, Some(ADMIN), "/debug/keys", None).await;
    assert_eq!(s, 200, "{text}");
    for secret in [ACME, GLOBEX, SLOW, SINGLE, ADMIN] {
        assert!(!text.contains(secret), "/debug/keys leaks a key: {text}");
    }
    let v = parse(&text);
    assert_eq!(v["tenants"], 4, "{v}");
    assert_eq!(v["keys"].as_array().unwrap().len(), 4, "{v}");
    let acme = key_usage(http, "acme").await;
    assert!(acme["usage"]["admitted_total"].as_u64().unwrap() >= 1, "{acme}");

    // --- Tenant = prefix-cache namespace: the same long prompt, two tenants.
    let prompt: String =
        (0..40).map(|i| format!("Line {i}: the quick brown fox number {i} jumps over the lazy dog.\n")).collect();
    let prompt = format!("{prompt}\nHow many lines are there?");
    let s0 = worker_stats(&up.worker).await.unwrap();
    let (ttft_cold_a, a1) = one_token(http, ACME, &prompt).await;
    let (ttft_warm_a, a2) = one_token(http, ACME, &prompt).await;
    let s1 = worker_stats(&up.worker).await.unwrap();
    let (ttft_cold_g, g1) = one_token(http, GLOBEX, &prompt).await;
    let s2 = worker_stats(&up.worker).await.unwrap();
    let (ttft_warm_g, g2) = one_token(http, GLOBEX, &prompt).await;
    let prompt_tokens = a1["usage"]["prompt_tokens"].as_u64().unwrap();
    eprintln!(
        "tenant isolation: prompt {prompt_tokens} tokens; cached acme {} then {}, globex {} then {}; \
         TTFT acme cold {ttft_cold_a:?} warm {ttft_warm_a:?}, globex cold {ttft_cold_g:?} warm {ttft_warm_g:?}",
        cached(&a1),
        cached(&a2),
        cached(&g1),
        cached(&g2)
    );
    assert!(prompt_tokens > 600, "the prompt should span many blocks: {prompt_tokens}");
    // The same tenant repeating the prompt reuses every full block of it.
    assert!(cached(&a2) >= prompt_tokens - 32, "acme's repeat should hit: {a2}");
    assert!(s1.cached_tokens_total - s0.cached_tokens_total >= cached(&a2), "{s0:?} {s1:?}");
    // Another tenant gets no hit at all, not even on the chat template's shared system prompt.
    assert_eq!(cached(&g1), 0, "globex must not hit acme's cache: {g1}");
    assert_eq!(s2.cached_tokens_total, s1.cached_tokens_total, "worker counted a cross-tenant hit: {s1:?} {s2:?}");
    assert_eq!(cached(&g2), cached(&a2), "globex's own repeat hits its own cache: {g2}");
    // The isolation costs the second tenant a full prefill: its first request is as slow as acme's first.
    assert!(ttft_cold_g > ttft_warm_a, "cold {ttft_cold_g:?} should exceed warm {ttft_warm_a:?}");

    // --- Rate limit: rps=0.5, burst=2.
    for i in 0..2 {
        let (s, _, text) = send(http, Some(SLOW), "/v1/models", None).await;
        assert_eq!(s, 200, "burst request {i}: {text}");
    }
    let (s, h, text) = send(http, Some(SLOW), "/v1/models", None).await;
    let retry = assert_rate_limited("over rate", s, &h, &text);
    assert!(retry <= 2, "one token at 0.5/s is at most 2 s away: {retry}");
    // Other keys are not affected.
    assert_eq!(send(http, Some(ACME), "/v1/models", None).await.0, 200);
    tokio::time::sleep(Duration::from_secs(retry)).await;
    let (s, _, text) = send(http, Some(SLOW), "/v1/models", None).await;
    assert_eq!(s, 200, "after Retry-After: {text}");
    let throttled = key_usage(http, "throttled").await;
    assert_eq!(throttled["usage"]["rejected_rate_total"], 1, "{throttled}");
    let (_, _, metrics) = send(http, None, "/metrics", None).await;
    assert!(
        metrics.contains("pagoda_router_rate_limited_requests_total{tenant=\"throttled\",reason=\"rate\"} 1"),
        "{metrics}"
    );

    // --- Concurrency limit: a slow stream holds the only slot.
    let stream = start_long_stream(http, SINGLE).await;
    assert_eq!(key_usage(http, "single").await["usage"]["in_flight"], 1);
    let (s, h, text) = send(http, Some(SINGLE), "/v1/chat/completions", Some(&hello)).await;
    let retry = assert_rate_limited("over concurrency", s, &h, &text);
    assert_eq!(retry, 1);
    let (s, h, text) = send(http, Some(SINGLE), "/v1/models", None).await;
    assert_rate_limited("over concurrency, cheap endpoint", s, &h, &text);
    // Another tenant is served meanwhile.
    let (s, _, text) = send(http, Some(GLOBEX), "/v1/chat/completions", Some(&hello)).await;
    assert_eq!(s, 200, "{text}");
    // The client disconnects: the slot comes back (and the worker stops the generation).
    drop(stream);
    let t0 = Instant::now();
    loop {
        let (s, _, text) = send(http, Some(SINGLE), "/v1/models", None).await;
        if s == 200 {
            eprintln!("slot released {:?} after the disconnect", t0.elapsed());
            break;
        }
        assert_eq!(s, 429, "{text}");
        assert!(t0.elapsed() < Duration::from_secs(20), "slot not released after the client disconnected");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let t0 = Instant::now();
    loop {
        let st = worker_stats(&up.worker).await.unwrap();
        if st.running == 0 && st.waiting == 0 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "worker still runs the abandoned stream: {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A stream read to its end frees the slot before the client sees the end: the next request is admitted at once.
    for i in 0..3 {
        let body = chat("Count to three.", json!({"max_tokens": 4, "stream": true, "temperature": 0}));
        let (s, _, text) = send(http, Some(SINGLE), "/v1/chat/completions", Some(&body)).await;
        assert_eq!(s, 200, "stream {i}: {text}");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        let (s, _, text) = send(http, Some(SINGLE), "/v1/chat/completions", Some(&hello)).await;
        assert_eq!(s, 200, "right after stream {i} ended: {text}");
    }
    assert_eq!(key_usage(http, "single").await["usage"]["in_flight"], 0);

    // --- Malformed headers and bodies: always a 4xx, never a 5xx or a hang.
    let bad_headers: Vec<HeaderValue> = vec![
        HeaderValue::from_static("Bearer"),
        HeaderValue::from_static("Bearer "),
        HeaderValue::from_static("Basic c2stYWNtZQ=="),
        HeaderValue::from_static("bearer sk-acme-0123456789abcde"),
        HeaderValue::from_bytes(b"Bearer \xff\xfe\x80sk").unwrap(),
        HeaderValue::from_str(&format!("Bearer {}", "k".repeat(8000))).unwrap(),
        HeaderValue::from_str(&format!("Bearer {ACME} {ACME}")).unwrap(),
    ];
    for h in bad_headers {
        let r = http.client.post(http.url("/v1/chat/completions")).header(AUTHORIZATION, h.clone()).json(&hello);
        let r = r.send().await.unwrap();
        let s = r.status().as_u16();
        let text = r.text().await.unwrap();
        assert_error(&format!("header {h:?}"), s, &text, 401);
    }
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut bodies: Vec<Vec<u8>> = (0..40)
        .map(|i| {
            (0..(i * 13 % 300))
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    (seed >> 32) as u8
                })
                .collect()
        })
        .collect();
    bodies.push("[".repeat(100_000).into_bytes());
    bodies.push(format!("{{\"model\": \"{MODEL_ID}\", \"messages\": {}}}", "[".repeat(5000)).into_bytes());
    bodies.push(b"{\"model\": \"x\", \"messages\": [{\"role\": \"user\", \"content\": \"\\ud800\"}]}".to_vec());
    bodies.push(
        json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e300})
            .to_string()
            .into_bytes(),
    );
    for (i, body) in bodies.into_iter().enumerate() {
        let t0 = Instant::now();
        let r = http
            .client
            .post(http.url("/v1/chat/completions"))
            .bearer_auth(ACME)
            .header("content-type", "application/json")
            .body(body.clone())
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap_or_else(|e| panic!("body {i}: {e}"));
        let s = r.status().as_u16();
        let text = r.text().await.unwrap();
        assert!(
            (400..500).contains(&s),
            "body {i} ({:?}): {s} {text}",
            String::from_utf8_lossy(&body[..body.len().min(80)])
        );
        assert_error(&format!("body {i}"), s, &text, s);
        assert!(t0.elapsed() < Duration::from_secs(10), "body {i} took {:?}", t0.elapsed());
    }
    let (s, _, text) = send(http, Some(ACME), "/v1/chat/completions", Some(&hello)).await;
    assert_eq!(s, 200, "still serves: {text}");
}

/// Runs `pagoda args...`, which must exit with an error before serving; returns its stderr.
fn start_failure(args: &[&str]) -> String {
    let mut child = Command::new(BIN)
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .env("RUST_LIB_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("pagoda {args:?} still runs after 60 s; it should have refused to start");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        e.read_to_string(&mut err).unwrap();
    }
    assert!(!status.success(), "pagoda {args:?} exited successfully: {err}");
    err
}

#[test]
fn malformed_keys_files_stop_the_start_naming_the_line() {
    let dir = TempDir::new("bad");
    let bad = dir.write("keys.txt", &format!("# ok so far\n{ACME} acme\n{GLOBEX} globex rps=fast\n"));
    let model = pagoda_e2e::require_model().unwrap();
    let model = model.to_string_lossy();
    let err = start_failure(&["up", "--listen", "127.0.0.1:0", "--model", &model, "--api-keys-file", &bad]);
    assert!(err.contains("line 3") && err.contains("rps"), "{err}");
    let short_admin = dir.write("admin.txt", "\n# admin\nshort\n");
    let err = start_failure(&[
        "router",
        "--listen",
        "127.0.0.1:0",
        "--worker",
        "127.0.0.1:1",
        "--model",
        &model,
        "--admin-key-file",
        &short_admin,
    ]);
    assert!(err.contains("line 3"), "{err}");
    let missing = Path::new(&dir.0).join("nope.txt");
    let err = start_failure(&[
        "router",
        "--listen",
        "127.0.0.1:0",
        "--worker",
        "127.0.0.1:1",
        "--model",
        &model,
        "--api-keys-file",
        &missing.to_string_lossy(),
    ]);
    assert!(err.contains("nope.txt"), "{err}");
}
