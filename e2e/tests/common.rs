//! Shared by the e2e test files: starting `pagoda up` and small request helpers.

#![allow(dead_code)]

use std::time::Duration;

use anyhow::Result;
use pagoda_e2e::serde_json::{Value, json};
use pagoda_e2e::{Http, MODEL_ID, Proc};

pub const BIN: &str = env!("CARGO_BIN_EXE_pagoda");

/// A `pagoda up` process with its router URL and its embedded worker's gRPC address.
pub struct Up {
    pub proc: Proc,
    pub http: Http,
    pub worker: String,
}

/// Starts `pagoda up` on ephemeral ports and waits until `/readyz` is 200.
pub async fn start_up(name: &str, extra: &[&str]) -> Result<Up> {
    let model = pagoda_e2e::require_model()?;
    let model = model.to_string_lossy().into_owned();
    let mut args = vec!["up", "--listen", "127.0.0.1:0", "--model", model.as_str(), "--threads", "1"];
    args.extend_from_slice(extra);
    let mut proc = Proc::spawn(BIN.as_ref(), name, &args)?;
    let worker = proc.wait_line("pagoda worker listening on ", Duration::from_secs(120))?;
    let base = proc.wait_line("pagoda router listening on ", Duration::from_secs(60))?;
    let http = Http::new(base);
    http.wait_ready(Duration::from_secs(60)).await?;
    Ok(Up { proc, http, worker })
}

/// A chat request body for one user message.
pub fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": MODEL_ID, "messages": [{"role": "user", "content": content}]});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

/// Asserts an OpenAI-style error body with the given status.
pub fn assert_error(case: &str, status: u16, body: &str, want: u16) -> Value {
    assert_eq!(status, want, "{case}: {body}");
    let v: Value = pagoda_e2e::serde_json::from_str(body).unwrap_or_else(|e| panic!("{case}: not JSON ({e}): {body}"));
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{case}: {v}");
    assert!(e["type"].is_string(), "{case}: {v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{case}: {v}");
    v
}

/// Asserts that a small request still succeeds.
pub async fn still_serves(http: &Http, after: &str) {
    let (s, v) = http
        .post_json("/v1/chat/completions", &chat("Say hi.", json!({"max_tokens": 2, "temperature": 0})))
        .await
        .unwrap_or_else(|e| panic!("after {after}: {e:#}"));
    assert_eq!(s, 200, "after {after}: {v}");
}
