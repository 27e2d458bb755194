//! End-to-end tests of `pagoda up` (engine + worker gRPC + router in one process) on the real SmolLM2 model:
//! coherent answers, the exact OpenAI JSON and SSE formats, usage accounting, stop strings, `logit_bias` and the
//! frequency penalty, `ignore_eos`, `/tokenize`, every bad-input case, and block release when a client disconnects
//! mid-stream (checked through the worker's gRPC Stats).

mod common;

use std::time::{Duration, Instant};

use common::{assert_error, chat, start_up, still_serves};
use pagoda_e2e::serde_json::{Value, json};
use pagoda_e2e::{MODEL_ID, sse_payloads, worker_stats};

/// A question whose greedy answer has a clear margin. "What is the capital of France?" nearly ties "The" and "L" for
/// the first token, so a mere change of float summation order in a kernel flips the answer.
const QUESTION: &str = "What is the capital city of France? Answer in one word.";

/// Posts a completion request and returns its `n` choices' texts, each of which must have ended on a stop.
async fn stopped_completions(http: &pagoda_e2e::Http, body: &Value, n: usize) -> Vec<String> {
    let (s, v) = http.post_json("/v1/completions", body).await.unwrap();
    assert_eq!(s, 200, "{v}");
    let choices = v["choices"].as_array().unwrap_or_else(|| panic!("{v}"));
    assert_eq!(choices.len(), n, "{v}");
    choices
        .iter()
        .map(|c| {
            assert_eq!(c["finish_reason"], "stop", "{v}");
            c["text"].as_str().unwrap_or_else(|| panic!("{v}")).to_string()
        })
        .collect()
}

/// Parses `[e,e,...]` of 1 to `max` elements off the front of `s`, each a number of one or two digits or (when
/// `nest`) such a list of at most three numbers, and returns what follows it.
fn parse_list(s: &[u8], nest: bool, max: usize) -> Option<&[u8]> {
    let mut s = s.strip_prefix(b"[")?;
    for i in 0..max {
        s = if nest && s.starts_with(b"[") {
            parse_list(s, false, 3)?
        } else {
            let digits = s.iter().take_while(|c| c.is_ascii_digit()).count();
            if !(1..=2).contains(&digits) {
                return None;
            }
            &s[digits..]
        };
        if let Some(rest) = s.strip_prefix(b"]") {
            return Some(rest);
        }
        if i + 1 < max {
            s = s.strip_prefix(b",")?;
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_answers_chat_streaming_and_not() {
    let up = start_up("up-chat", &[]).await.unwrap();
    let http = &up.http;

    // Non-streaming, greedy.
    let (s, v) = http
        .post_json("/v1/chat/completions", &chat(QUESTION, json!({"temperature": 0, "max_tokens": 48})))
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL_ID);
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let answer = choice["message"]["content"].as_str().unwrap().to_string();
    eprintln!("answer: {answer:?}");
    assert!(!answer.trim().is_empty());
    assert!(answer.contains("Paris"), "greedy answer should name Paris: {answer:?}");
    let finish = choice["finish_reason"].as_str().unwrap().to_string();
    assert!(finish == "stop" || finish == "length", "{v}");
    let usage = &v["usage"];
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    let completion_tokens = usage["completion_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 8);
    assert!((1..=48).contains(&completion_tokens), "{usage}");
    if finish == "length" {
        assert_eq!(completion_tokens, 48);
    }
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), prompt_tokens + completion_tokens);

    // Streaming, greedy, with usage: exact SSE framing and chunk objects.
    let body = chat(
        QUESTION,
        json!({"temperature": 0, "max_tokens": 48, "stream": true, "stream_options": {"include_usage": true}}),
    );
    let r = http.client.post(http.url("/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let ctype = r.headers()["content-type"].to_str().unwrap().to_string();
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    let text = r.text().await.unwrap();
    let payloads = sse_payloads(&text).unwrap();
    assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"), "{text}");
    let chunks: Vec<Value> = payloads[..payloads.len() - 1]
        .iter()
        .map(|p| pagoda_e2e::serde_json::from_str(p).unwrap_or_else(|e| panic!("bad chunk {p}: {e}")))
        .collect();
    assert!(chunks.len() >= 3, "{text}");
    let id = chunks[0]["id"].as_str().unwrap();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk", "{c}");
        assert_eq!(c["id"], id);
        assert_eq!(c["model"], MODEL_ID);
    }
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    let n = chunks.len();
    let fin = &chunks[n - 2]["choices"][0];
    assert_eq!(fin["delta"], json!({}));
    let s_finish = fin["finish_reason"].as_str().unwrap();
    let streamed: String = chunks[1..n - 2]
        .iter()
        .map(|c| {
            assert!(c["choices"][0]["finish_reason"].is_null());
            c["choices"][0]["delta"]["content"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(streamed, answer, "greedy streaming and non-streaming answers differ");
    assert_eq!(s_finish, finish);
    let su = &chunks[n - 1]["usage"];
    assert_eq!(chunks[n - 1]["choices"], json!([]));
    assert_eq!(su["prompt_tokens"].as_u64().unwrap(), prompt_tokens);
    assert_eq!(su["completion_tokens"].as_u64().unwrap(), completion_tokens);
    assert_eq!(su["total_tokens"].as_u64().unwrap(), prompt_tokens + completion_tokens);
    // The same prompt again: its full blocks come from the prefix cache.
    assert!(su["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{su}");
    // vLLM's continuous_usage_stats: each text chunk counts the tokens generated so far, up to the total.
    let mut continuous = body.clone();
    continuous["stream_options"]["continuous_usage_stats"] = json!(true);
    let text = http.client.post(http.url("/v1/chat/completions")).json(&continuous).send().await.unwrap();
    let text = text.text().await.unwrap();
    let payloads = sse_payloads(&text).unwrap();
    let counts: Vec<u64> = payloads[..payloads.len() - 1]
        .iter()
        .map(|p| pagoda_e2e::serde_json::from_str::<Value>(p).unwrap()["usage"]["completion_tokens"].as_u64().unwrap())
        .collect();
    assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
    assert_eq!((counts[0], counts.last().copied()), (0, Some(completion_tokens)), "{text}");

    // A stop string from the middle of the answer truncates it there.
    let words: Vec<&str> = answer.split_whitespace().collect();
    if words.len() >= 3 {
        let stop = format!(" {}", words[words.len() / 2]);
        let expected = &answer[..answer.find(&stop).unwrap()];
        let (s, v) = http
            .post_json(
                "/v1/chat/completions",
                &chat(QUESTION, json!({"temperature": 0, "max_tokens": 48, "stop": [stop.clone(), "\u{1F980}"]})),
            )
            .await
            .unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["choices"][0]["message"]["content"], expected, "stop {stop:?}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert!(v["usage"]["completion_tokens"].as_u64().unwrap() < completion_tokens);
    }

    // max_tokens gives "length" with exactly that many tokens.
    let (s, v) = http
        .post_json(
            "/v1/chat/completions",
            &chat("Tell me a long story about a dragon.", json!({"max_tokens": 5, "seed": 7})),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);

    // Seeded sampling is reproducible.
    let sampled = chat(
        "Write one sentence about the sea.",
        json!({"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 42, "max_tokens": 16}),
    );
    let (_, a) = http.post_json("/v1/chat/completions", &sampled).await.unwrap();
    let (_, b) = http.post_json("/v1/chat/completions", &sampled).await.unwrap();
    assert_eq!(a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]);

    // Legacy completions, streaming and not.
    let (s, v) = http
        .post_json(
            "/v1/completions",
            &json!({"model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert!(!v["choices"][0]["text"].as_str().unwrap().is_empty(), "{v}");
    let r = http
        .client
        .post(http.url("/v1/completions"))
        .json(&json!({"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 6, "stream": true}))
        .send()
        .await
        .unwrap();
    let payloads = sse_payloads(&r.text().await.unwrap()).unwrap();
    assert_eq!(payloads.last().unwrap(), "[DONE]");
    let last: Value = pagoda_e2e::serde_json::from_str(&payloads[payloads.len() - 2]).unwrap();
    assert_eq!(last["object"], "text_completion");
    assert_eq!(last["choices"][0]["finish_reason"], "length");

    // /tokenize and /detokenize: a chat's count is the prompt_tokens its completion reports.
    let (s, v) =
        http.post_json("/tokenize", &json!({"messages": [{"role": "user", "content": QUESTION}]})).await.unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["count"].as_u64(), Some(prompt_tokens), "{v}");
    let (s, d) = http.post_json("/detokenize", &json!({"tokens": v["tokens"]})).await.unwrap();
    assert_eq!(s, 200, "{d}");
    assert!(d["prompt"].as_str().unwrap().contains(QUESTION), "{d}");
    let tokenize = |text: &str| {
        let body = json!({"prompt": text, "add_special_tokens": false});
        async move {
            let (s, v) = http.post_json("/tokenize", &body).await.unwrap();
            assert_eq!(s, 200, "{v}");
            v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect::<Vec<u32>>()
        }
    };

    // logit_bias, through the router's validation, the worker's gRPC and the sampler.
    let sea = tokenize(" sea").await;
    assert_eq!(sea.len(), 1, "\" sea\" should be one token: {sea:?}");
    for extra in [json!({"temperature": 0}), json!({"temperature": 1.0, "seed": 3})] {
        let mut body = chat(QUESTION, extra.clone());
        body["max_tokens"] = json!(4);
        body["logit_bias"] = json!({ sea[0].to_string(): 100 });
        let (s, v) = http.post_json("/v1/chat/completions", &body).await.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["choices"][0]["message"]["content"], " sea sea sea sea", "+100 forces the token ({extra})");
    }
    // -100 bans the greedy next token: the next-best one comes instead.
    // A greedy one-token completion of the capital, with `extra` fields on top.
    let capital = |extra: Value| {
        let mut body = json!({"model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 1,
                              "temperature": 0});
        for (k, v) in extra.as_object().into_iter().flatten() {
            body[k] = v.clone();
        }
        body
    };
    let (s, v) = http.post_json("/v1/completions", &capital(json!({}))).await.unwrap();
    assert_eq!(s, 200, "{v}");
    let first = v["choices"][0]["text"].as_str().unwrap().to_string();
    let first_ids = tokenize(&first).await;
    assert_eq!(first_ids.len(), 1, "{first:?} is one token");
    let (s, v) = http
        .post_json("/v1/completions", &capital(json!({"logit_bias": { first_ids[0].to_string(): -100 }})))
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    let banned = v["choices"][0]["text"].as_str().unwrap();
    assert!(!banned.is_empty() && banned != first, "banning {first:?} still gave {banned:?}");

    // logprobs: the model's own distribution (before the bias), with the greedy token the most likely.
    let (s, v) = http.post_json("/v1/completions", &capital(json!({"logprobs": 5}))).await.unwrap();
    assert_eq!(s, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"][0], first.as_str(), "{v}");
    assert_eq!(lp["text_offset"], json!([0]), "{v}");
    let top = lp["top_logprobs"][0].as_object().unwrap();
    assert_eq!(top.len(), 5, "{v}");
    let chosen = lp["token_logprobs"][0].as_f64().unwrap();
    assert_eq!(top[first.as_str()].as_f64(), Some(chosen), "{v}");
    assert!(top.values().all(|l| l.as_f64().unwrap() <= chosen) && chosen < 0.0, "{v}");
    let mass: f64 = top.values().map(|l| l.as_f64().unwrap().exp()).sum();
    assert!(mass <= 1.0 + 1e-4, "{v}");
    let biased = capital(json!({"logprobs": 5, "logit_bias": { first_ids[0].to_string(): -100 }}));
    let (s, v) = http.post_json("/v1/completions", &biased).await.unwrap();
    assert_eq!(s, 200, "{v}");
    let runner_up = v["choices"][0]["logprobs"]["token_logprobs"][0].as_f64().unwrap();
    assert_eq!(v["choices"][0]["text"], banned, "{v}");
    if let Some(unbiased) = top.get(banned).and_then(Value::as_f64) {
        assert!((runner_up - unbiased).abs() < 1e-3, "{banned:?}: {runner_up} biased, {unbiased} unbiased");
    }
    // A batch of prompts, two choices each, runs together: greedy choices agree with the single request's answer.
    let (s, v) = http
        .post_json(
            "/v1/completions",
            &json!({"model": MODEL_ID, "prompt": ["The capital of France is", "Water is made of"], "n": 2,
                    "max_tokens": 1, "temperature": 0}),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    let texts: Vec<&str> = v["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(texts.len(), 4, "{v}");
    assert_eq!((texts[0], texts[1]), (first.as_str(), first.as_str()), "{v}");
    assert_eq!(texts[2], texts[3], "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    // echo with logprobs scores a text (lm-eval's log-likelihood request): the greedy answer, appended to its
    // prompt, scores what generating it did, and is the most likely token there.
    let text = format!("The capital of France is{first}");
    let (s, v) = http
        .post_json(
            "/v1/completions",
            &json!({"model": MODEL_ID, "prompt": text, "max_tokens": 1, "temperature": 0,
                    "logprobs": 1, "echo": true}),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    let n = tokens.len();
    assert!(v["choices"][0]["text"].as_str().unwrap().starts_with(&text), "{v}");
    assert_eq!(tokens[..n - 1].concat(), text, "{v}");
    assert_eq!(tokens[n - 2], first, "{v}");
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(), "{v}");
    let scored = lp["token_logprobs"][n - 2].as_f64().unwrap();
    assert!((scored - chosen).abs() < 1e-3, "{first:?} scored {scored}, generated at {chosen}");
    assert!(lp["top_logprobs"][n - 2].as_object().unwrap().contains_key(first.as_str()), "{v}");
    assert!(lp["token_logprobs"].as_array().unwrap()[1..].iter().all(|l| l.as_f64().is_some_and(|l| l <= 0.0)));
    let (s, v) = http
        .post_json(
            "/v1/chat/completions",
            &chat(QUESTION, json!({"temperature": 0, "max_tokens": 8, "logprobs": true, "top_logprobs": 3})),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len() as u64, v["usage"]["completion_tokens"].as_u64().unwrap(), "{v}");
    let bytes: Vec<u8> =
        content.iter().flat_map(|e| e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8)).collect();
    assert_eq!(bytes, v["choices"][0]["message"]["content"].as_str().unwrap().as_bytes(), "{v}");
    for e in content {
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 3, "{e}");
        assert_eq!(e["top_logprobs"][0]["token"], e["token"], "greedy takes the most likely token: {e}");
    }

    // frequency_penalty: greedy SmolLM2 cycles through the week; a penalty growing with each use breaks the cycle.
    let week = |penalty: f64| {
        chat(
            "List the days of the week, one per line, over and over.",
            json!({"temperature": 0, "max_tokens": 48, "frequency_penalty": penalty}),
        )
    };
    let (s, plain) = http.post_json("/v1/chat/completions", &week(0.0)).await.unwrap();
    assert_eq!(s, 200, "{plain}");
    let (s, penalised) = http.post_json("/v1/chat/completions", &week(1.5)).await.unwrap();
    assert_eq!(s, 200, "{penalised}");
    let mondays = |v: &Value| v["choices"][0]["message"]["content"].as_str().unwrap().matches("Monday").count();
    assert!(mondays(&plain) >= 2, "the unpenalised answer repeats the week: {plain}");
    assert!(mondays(&penalised) < mondays(&plain), "the penalty should cut the repeats: {penalised}");
    // repetition_penalty (HF's and vLLM's) cuts them too; min_p 1 keeps only the most likely token, so even a hot
    // sample is the greedy answer.
    let mut repeat = week(0.0);
    repeat["repetition_penalty"] = json!(1.5);
    let (s, repeat) = http.post_json("/v1/chat/completions", &repeat).await.unwrap();
    assert_eq!(s, 200, "{repeat}");
    assert!(mondays(&repeat) < mondays(&plain), "the repetition penalty should cut the repeats: {repeat}");
    let mut hot = week(0.0);
    hot["temperature"] = json!(1.5);
    hot["min_p"] = json!(1.0);
    let (s, hot) = http.post_json("/v1/chat/completions", &hot).await.unwrap();
    assert_eq!(s, 200, "{hot}");
    assert_eq!(hot["choices"][0]["message"]["content"], plain["choices"][0]["message"]["content"], "{hot}");

    // ignore_eos (vLLM's extension, which benchmark clients send): the one-word answer goes on past its end token.
    assert_eq!(finish, "stop", "the plain greedy answer ends by itself: {answer:?}");
    let (s, v) = http
        .post_json(
            "/v1/chat/completions",
            &chat(QUESTION, json!({"temperature": 0, "max_tokens": completion_tokens + 8, "ignore_eos": true})),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], completion_tokens + 8, "{v}");
    let longer = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(longer.starts_with(&answer) && longer.len() > answer.len(), "{answer:?} then {longer:?}");
    // response_format json_object: the answer is one JSON object, and generation ends when it closes.
    let (s, v) = http
        .post_json(
            "/v1/chat/completions",
            &chat(
                "Describe a cat as a JSON object with name and age.",
                json!({"temperature": 0, "max_tokens": 200, "response_format": {"type": "json_object"}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let object: Value = pagoda_e2e::serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content:?}"));
    assert!(object.as_object().is_some_and(|o| !o.is_empty()), "{content}");
    // response_format json_schema: greedy and sampled answers are documents of the schema, keys in its order.
    let city = json!({"type": "object", "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 40},
            "country": {"enum": ["France", "Germany", "Italy", "Spain"]},
            "population": {"type": "integer"},
            "sights": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 1, "maxItems": 3},
            "capital": {"type": "boolean"}},
        "required": ["city", "country", "population", "sights", "capital"], "additionalProperties": false});
    for (temperature, seed) in [(0.0, 0), (0.8, 11), (0.8, 12)] {
        let format = json!({"type": "json_schema", "json_schema": {"name": "city", "schema": city, "strict": true}});
        let body = json!({"temperature": temperature, "seed": seed, "max_tokens": 300, "response_format": format});
        let (s, v) = http.post_json("/v1/chat/completions", &chat("Describe Paris as JSON.", body)).await.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let content = v["choices"][0]["message"]["content"].as_str().unwrap();
        let doc: Value = pagoda_e2e::serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content:?}"));
        let o = doc.as_object().unwrap_or_else(|| panic!("{content}"));
        assert_eq!(o.keys().collect::<Vec<_>>(), ["city", "country", "population", "sights", "capital"], "{content}");
        let city_name = o["city"].as_str().unwrap_or_default().chars().count();
        assert!((1..=40).contains(&city_name), "{content}");
        assert!(["France", "Germany", "Italy", "Spain"].contains(&o["country"].as_str().unwrap_or("")), "{content}");
        assert!(o["population"].is_i64() || o["population"].is_u64(), "{content}");
        let sights = o["sights"].as_array().unwrap_or_else(|| panic!("{content}"));
        assert!((1..=3).contains(&sights.len()) && sights.iter().all(Value::is_string), "{content}");
        assert!(o["capital"].is_boolean(), "{content}");
    }
    // vLLM's guided_json on a completion, two seeded samples: each text is a document of the schema.
    let body = json!({"model": MODEL_ID, "prompt": "A city, as JSON:", "max_tokens": 200, "temperature": 0.8,
        "seed": 5, "n": 2, "guided_json": city});
    for text in stopped_completions(http, &body, 2).await {
        let doc: Value = pagoda_e2e::serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        let keys: Vec<&String> = doc.as_object().unwrap_or_else(|| panic!("{text}")).keys().collect();
        assert_eq!(keys, ["city", "country", "population", "sights", "capital"], "{text}");
    }
    // vLLM's guided_choice, greedy and sampled: the answer is one of the choices, whole.
    let capitals = ["Paris", "London", "Berlin", "Madrid", "Rome"];
    for (temperature, seed) in [(0.0, 0), (1.0, 3), (1.0, 4)] {
        let body = json!({"temperature": temperature, "seed": seed, "max_tokens": 20, "guided_choice": capitals});
        let (s, v) =
            http.post_json("/v1/chat/completions", &chat("What is the capital of France?", body)).await.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let answer = v["choices"][0]["message"]["content"].as_str().unwrap_or_default();
        assert!(capitals.contains(&answer), "{v}");
    }
    // Streamed, the deltas of a guided choice add up to one of the choices, and the stream ends on a stop.
    let body = json!({"model": MODEL_ID, "prompt": "The largest city in Germany is", "max_tokens": 20,
        "temperature": 1.0, "seed": 9, "stream": true, "guided_choice": capitals});
    let r = http.client.post(http.url("/v1/completions")).json(&body).send().await.unwrap();
    let payloads = sse_payloads(&r.text().await.unwrap()).unwrap();
    assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"), "{payloads:?}");
    let chunks: Vec<Value> =
        payloads[..payloads.len() - 1].iter().map(|p| pagoda_e2e::serde_json::from_str(p).unwrap()).collect();
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert!(capitals.contains(&streamed.as_str()), "{payloads:?}");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop", "{payloads:?}");
    // vLLM's guided_regex on a completion, two seeded samples: each text matches the whole pattern.
    let body = json!({"model": MODEL_ID, "prompt": "Call our office at", "max_tokens": 30, "temperature": 0.9,
        "seed": 7, "n": 2, "guided_regex": r" \(\d{3}\) \d{3}-\d{4}"});
    for text in stopped_completions(http, &body, 2).await {
        let text = text.as_bytes();
        let digit = |i: &usize| text.get(*i).is_some_and(u8::is_ascii_digit);
        let shape = text.len() == 15 && text.starts_with(b" (") && text[5..7] == *b") " && text[10] == b'-';
        assert!(shape && [2, 3, 4, 7, 8, 9, 11, 12, 13, 14].iter().all(digit), "{v}");
    }
    // vLLM's structured_outputs.grammar: nested lists, which no regular expression describes, sampled twice and
    // once greedily (as guided_grammar on a chat): each answer parses.
    let lists = r#"
        root ::= " [" elem ("," elem){0,3} "]"   # up to four elements
        elem ::= num | "[" num ("," num){0,2} "]"
        num ::= [0-9]{1,2}
    "#;
    let body = json!({"model": MODEL_ID, "prompt": "A nested list of small numbers:", "max_tokens": 60,
        "temperature": 1.0, "seed": 5, "n": 2, "structured_outputs": {"grammar": lists}});
    for text in stopped_completions(http, &body, 2).await {
        let rest = text.strip_prefix(' ').and_then(|t| parse_list(t.as_bytes(), true, 4));
        assert_eq!(rest, Some(&b""[..]), "{text:?}");
    }
    let body = json!({"temperature": 0, "max_tokens": 60, "guided_grammar": lists});
    let (s, v) = http.post_json("/v1/chat/completions", &chat("List some numbers.", body)).await.unwrap();
    assert_eq!((s, &v["choices"][0]["finish_reason"]), (200, &json!("stop")), "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap_or_default();
    let rest = content.strip_prefix(' ').and_then(|t| parse_list(t.as_bytes(), true, 4));
    assert_eq!(rest, Some(&b""[..]), "{v}");
    // A schema's `pattern`, `format`, a one-sided integer bound and a bounded number, sampled: each value fits.
    let booking = json!({"type": "object", "properties": {
            "flight": {"type": "string", "pattern": "[A-Z]{2}[0-9]{3,4}"},
            "date": {"type": "string", "format": "date"},
            "passengers": {"type": "integer", "minimum": 1},
            "price": {"type": "number", "minimum": 0.5, "maximum": 4999.99},
            "note": {"type": "string", "pattern": "[A-Za-z ]+", "minLength": 3, "maxLength": 20}},
        "required": ["flight", "date", "passengers", "price", "note"], "additionalProperties": false});
    for seed in [21, 22] {
        let body = json!({"temperature": 0.9, "seed": seed, "max_tokens": 200, "guided_json": booking});
        let (s, v) = http.post_json("/v1/chat/completions", &chat("Book me a flight, as JSON.", body)).await.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let content = v["choices"][0]["message"]["content"].as_str().unwrap_or_default();
        let doc: Value = pagoda_e2e::serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content:?}"));
        let flight = doc["flight"].as_str().unwrap_or_default().as_bytes();
        let letters = flight.len() >= 2 && flight[..2].iter().all(u8::is_ascii_uppercase);
        assert!(letters && (5..=6).contains(&flight.len()) && flight[2..].iter().all(u8::is_ascii_digit), "{content}");
        let date = doc["date"].as_str().unwrap_or_default().as_bytes();
        let digits = |r: std::ops::Range<usize>| date.get(r).is_some_and(|d| d.iter().all(u8::is_ascii_digit));
        let shape = date.len() == 10 && date[4] == b'-' && date[7] == b'-';
        assert!(shape && digits(0..4) && digits(5..7) && digits(8..10), "{content}");
        assert!(doc["passengers"].as_i64().is_some_and(|n| n >= 1), "{content}");
        assert!(doc["price"].as_f64().is_some_and(|p| (0.5..=4999.99).contains(&p)), "{content}");
        let note = doc["note"].as_str().unwrap_or_default();
        assert!(
            (3..=20).contains(&note.len()) && note.bytes().all(|b| b == b' ' || b.is_ascii_alphabetic()),
            "{content}"
        );
    }
    // A forced function call: the arguments are a document of the function's parameters.
    let weather = json!({"type": "function", "function": {"name": "get_weather", "description": "Current weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": false}}});
    let body = json!({"temperature": 0, "max_tokens": 100, "tools": [weather],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let (s, v) = http.post_json("/v1/chat/completions", &chat("What is the weather in Paris?", body)).await.unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let call = &v["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather", "{v}");
    let arguments = call["function"]["arguments"].as_str().unwrap_or_else(|| panic!("{v}"));
    let args: Value = pagoda_e2e::serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{e}: {arguments:?}"));
    assert!(args["city"].as_str().is_some_and(|c| !c.is_empty()), "{arguments}");
    assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap_or("")), "{arguments}");
    // The call and its result go back as turns of the chat, and the model answers in text.
    let body = json!({"model": MODEL_ID, "temperature": 0, "max_tokens": 40, "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees celsius and sunny"}]});
    let (s, v) = http.post_json("/v1/chat/completions", &body).await.unwrap();
    assert_eq!(s, 200, "{v}");
    assert!(v["choices"][0]["message"]["content"].as_str().is_some_and(|c| !c.is_empty()), "{v}");
    // min_tokens (vLLM's): the end token cannot come before it, so the same answer goes on past its end.
    let (s, v) = http
        .post_json(
            "/v1/chat/completions",
            &chat(
                QUESTION,
                json!({"temperature": 0, "max_tokens": completion_tokens + 20, "min_tokens": completion_tokens + 4}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= completion_tokens + 4, "{v}");
    let at_least = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(at_least.starts_with(&answer) && at_least.len() > answer.len(), "{answer:?} then {at_least:?}");
    // stop_token_ids (vLLM's): the greedy continuation of the capital stops at its second token, unsent.
    let (s, v) = http.post_json("/v1/completions", &capital(json!({"max_tokens": 3, "logprobs": 0}))).await.unwrap();
    assert_eq!(s, 200, "{v}");
    let second = v["choices"][0]["logprobs"]["tokens"][1].as_str().unwrap().to_string();
    let second_ids = tokenize(&second).await;
    assert_eq!(second_ids.len(), 1, "{second:?} is one token");
    let stopped = capital(json!({"max_tokens": 3, "stop_token_ids": second_ids}));
    let (s, v) = http.post_json("/v1/completions", &stopped).await.unwrap();
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["choices"][0]["text"].as_str(), v["choices"][0]["finish_reason"].as_str()),
        (Some(first.as_str()), Some("stop")),
        "{v}"
    );

    // vLLM's `allowed_token_ids`: a yes/no question answered with one of the two tokens, whichever the model
    // prefers, even though its own first choice is another token.
    let mut ids = Vec::new();
    for word in [" Yes", " No"] {
        let (s, t) = http.post_json("/tokenize", &json!({"prompt": word, "add_special_tokens": false})).await.unwrap();
        assert_eq!((s, t["count"].as_u64()), (200, Some(1)), "{word}: {t}");
        ids.push(t["tokens"][0].clone());
    }
    let prompt = "Question: Is Paris the capital of France? Answer:";
    let body = json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": 1, "temperature": 0});
    let (s, free) = http.post_json("/v1/completions", &body).await.unwrap();
    assert_eq!(s, 200, "{free}");
    let mut restricted = body.clone();
    restricted["allowed_token_ids"] = json!(ids);
    let (s, v) = http.post_json("/v1/completions", &restricted).await.unwrap();
    assert_eq!(s, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(text == " Yes" || text == " No", "{v}, unrestricted {free}");
    assert_ne!(free["choices"][0]["text"], v["choices"][0]["text"], "the restriction must change this answer");

    // vLLM's `bad_words`: the token that would complete the word is never sampled, at the start of the answer
    // ("Paris") or after a space (" Paris"), whichever the model would pick.
    let body = json!({"model": MODEL_ID, "prompt": "The capital city of France is", "max_tokens": 6,
                      "temperature": 0, "logprobs": 0});
    let tokens = |v: &Value| -> Vec<String> {
        v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap_or_else(|| panic!("{v}"))
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect()
    };
    let (s, free) = http.post_json("/v1/completions", &body).await.unwrap();
    assert_eq!(s, 200, "{free}");
    assert_eq!(tokens(&free)[0], " Paris", "{free}");
    let mut banned = body.clone();
    banned["bad_words"] = json!(["Paris"]);
    let (s, v) = http.post_json("/v1/completions", &banned).await.unwrap();
    assert_eq!(s, 200, "{v}");
    assert!(tokens(&v).iter().all(|t| t.trim() != "Paris"), "{v}");
    assert_ne!(tokens(&v)[0], " Paris");

    // vLLM's `continue_final_message`: the model goes on with the assistant's started answer, and `/tokenize`
    // counts the same prompt, which ends with that answer's text rather than an end of turn.
    let started = json!([{"role": "user", "content": QUESTION},
                         {"role": "assistant", "content": "The capital city of France is"}]);
    let body = json!({"model": MODEL_ID, "messages": started, "continue_final_message": true, "temperature": 0,
                      "max_tokens": 8});
    let (s, v) = http.post_json("/v1/chat/completions", &body).await.unwrap();
    assert_eq!(s, 200, "{v}");
    let continued = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(continued.starts_with(" Paris"), "{v}");
    let (s, t) = http
        .post_json(
            "/tokenize",
            &json!({"messages": started, "continue_final_message": true, "return_token_strs": true}),
        )
        .await
        .unwrap();
    assert_eq!(s, 200, "{t}");
    assert_eq!(t["count"], v["usage"]["prompt_tokens"], "{t} {v}");
    let strs: Vec<&str> = t["token_strs"].as_array().unwrap().iter().map(|x| x.as_str().unwrap()).collect();
    assert!(strs.concat().ends_with("France is"), "{strs:?}");

    // Models, health, metrics.
    let (s, body) = http.get("/v1/models").await.unwrap();
    assert_eq!(s, 200);
    let models: Value = pagoda_e2e::serde_json::from_str(&body).unwrap();
    assert_eq!(models["data"][0]["id"], MODEL_ID);
    let (s, card) = http.get(&format!("/v1/models/{MODEL_ID}")).await.unwrap();
    assert_eq!((s, pagoda_e2e::serde_json::from_str::<Value>(&card).unwrap()), (200, models["data"][0].clone()));
    assert_eq!(http.get("/v1/models/gpt-5").await.unwrap().0, 404);
    assert_eq!(http.get("/healthz").await.unwrap().0, 200);
    assert_eq!(http.get("/health").await.unwrap().0, 200);
    let (s, metrics) = http.get("/metrics").await.unwrap();
    assert_eq!(s, 200);
    for name in [
        "pagoda_router_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}",
        "pagoda_router_ttft_seconds_bucket",
        "pagoda_router_inter_token_latency_seconds_bucket",
        "pagoda_router_prompt_tokens_total",
        "pagoda_router_completion_tokens_total",
        "pagoda_router_worker_used_blocks",
        "pagoda_router_worker_capacity_blocks",
    ] {
        assert!(metrics.contains(name), "metrics lack {name}:\n{metrics}");
    }
    // The requests above ran forward steps, each computing at least one sequence (the mean batch is the ratio).
    let (steps, sequences) = (
        http.metric_sum("pagoda_router_worker_steps").await,
        http.metric_sum("pagoda_router_worker_step_sequences").await,
    );
    assert!(steps > 0.0 && sequences >= steps, "steps {steps}, sequences {sequences}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_bad_inputs_get_openai_errors_and_server_keeps_serving() {
    let up = start_up("up-bad", &[]).await.unwrap();
    let http = &up.http;
    let user = json!([{"role": "user", "content": "hello"}]);
    let j = |v: Value| v.to_string().into_bytes();
    let long_prompt = "hello ".repeat(9000);
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("malformed JSON", b"{\"model\": \"x\", \"messages\": [".to_vec(), 400),
        ("not JSON at all", b"hello".to_vec(), 400),
        ("messages of wrong type", j(json!({"model": MODEL_ID, "messages": "hello"})), 400),
        ("temperature of wrong type", j(json!({"model": MODEL_ID, "messages": user, "temperature": "hot"})), 400),
        ("empty messages", j(json!({"model": MODEL_ID, "messages": []})), 400),
        ("unknown role", j(json!({"model": MODEL_ID, "messages": [{"role": "oracle", "content": "x"}]})), 400),
        ("max_tokens 0", j(json!({"model": MODEL_ID, "messages": user, "max_tokens": 0})), 400),
        ("max_tokens negative", j(json!({"model": MODEL_ID, "messages": user, "max_tokens": -3})), 400),
        ("max_tokens above context", j(json!({"model": MODEL_ID, "messages": user, "max_tokens": 9000})), 400),
        ("unknown model", j(json!({"model": "gpt-5", "messages": user})), 404),
        ("unknown kv policy", j(json!({"model": MODEL_ID, "messages": user, "kv": {"policy": "lru"}})), 400),
        ("n above 16", j(json!({"model": MODEL_ID, "messages": user, "n": 17})), 400),
        ("json_schema", j(json!({"model": MODEL_ID, "messages": user, "response_format": {"type": "json_schema"}})), 400),
        ("logit_bias outside the vocabulary", j(json!({"model": MODEL_ID, "messages": user, "logit_bias": {"49152": 1}})), 400),
        ("logit_bias above 100", j(json!({"model": MODEL_ID, "messages": user, "logit_bias": {"7": 101}})), 400),
        ("too many stop strings", j(json!({"model": MODEL_ID, "messages": user, "stop": ["a","b","c","d","e","f","g","h","i"]})), 400),
        // This server serves in arrival order (the default --scheduling-policy fcfs): the worker refuses a priority.
        ("priority without priority scheduling", j(json!({"model": MODEL_ID, "messages": user, "priority": 2})), 400),
        ("priority out of range", j(json!({"model": MODEL_ID, "messages": user, "priority": 1u64 << 40})), 400),
        (
            "invalid UTF-8",
            b"{\"model\": \"SmolLM2-135M-Instruct.Q4_1\", \"messages\": [{\"role\": \"user\", \"content\": \"caf\xe9\"}]}".to_vec(),
            400,
        ),
        ("body over 4 MiB", j(json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "a".repeat(5 << 20)}]})), 413),
    ];
    for (name, body, want) in cases {
        let (s, text) = http.post_raw("/v1/chat/completions", body).await.unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let v = assert_error(name, s, &text, want);
        eprintln!("{name}: {s} {}", v["error"]["message"]);
        still_serves(http, name).await;
    }
    // A prompt longer than the context: 400 naming both lengths.
    let (s, text) = http
        .post_raw(
            "/v1/chat/completions",
            j(json!({"model": MODEL_ID, "messages": [{"role": "user", "content": long_prompt}]})),
        )
        .await
        .unwrap();
    let v = assert_error("prompt longer than context", s, &text, 400);
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("8192"), "{msg}");
    assert!(msg.split(|c: char| !c.is_ascii_digit()).filter_map(|d| d.parse::<u64>().ok()).any(|n| n > 8192), "{msg}");
    still_serves(http, "prompt longer than context").await;
    // Prompt + max_tokens over the context.
    let (s, text) = http
        .post_raw("/v1/chat/completions", j(json!({"model": MODEL_ID, "messages": user, "max_tokens": 8190})))
        .await
        .unwrap();
    assert_error("prompt + max_tokens over context", s, &text, 400);
    // Unknown routes and methods are JSON errors as well.
    let (s, text) = http.get("/v1/unknown").await.unwrap();
    assert_error("unknown route", s, &text, 404);
    let (s, text) = http.get("/v1/chat/completions").await.unwrap();
    assert_error("wrong method", s, &text, 405);
    still_serves(http, "everything").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_client_disconnect_cancels_and_frees_blocks() {
    let up = start_up("up-cancel", &[]).await.unwrap();
    let http = &up.http;
    let before = worker_stats(&up.worker).await.unwrap();
    assert_eq!(before.running, 0);
    let mut r = http
        .client
        .post(http.url("/v1/completions"))
        .json(&json!({"model": MODEL_ID, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 2000,
                      "temperature": 0, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut got = String::new();
    while got.matches("data: ").count() < 4 {
        let chunk = r.chunk().await.unwrap().expect("stream ended early");
        got.push_str(&String::from_utf8_lossy(&chunk));
    }
    let during = worker_stats(&up.worker).await.unwrap();
    assert_eq!(during.running + during.waiting, 1, "{during:?}");
    assert!(during.blocks_used > before.blocks_used, "{during:?}");
    drop(r);
    let t0 = Instant::now();
    loop {
        let s = worker_stats(&up.worker).await.unwrap();
        if s.running == 0 && s.waiting == 0 && s.blocks_used == before.blocks_used {
            eprintln!("freed after {:?}: {s:?}", t0.elapsed());
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "blocks not freed after disconnect: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Far fewer tokens were computed than the 2000 requested.
    let after = worker_stats(&up.worker).await.unwrap();
    assert!(after.computed_tokens_total - before.computed_tokens_total < 1000, "{after:?}");
    still_serves(http, "disconnect").await;
}

/// Every eviction policy serves chat through the real binary: the request's `kv` extension reaches the worker,
/// the answer comes back, the worker's eviction counters move for that policy, and `/metrics` shows them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_serves_chat_under_every_eviction_policy() {
    let up = start_up("up-policies", &[]).await.unwrap();
    let http = &up.http;
    let context = "Pagoda is a serving system. ".repeat(30);
    let question = format!("{context}\nQuestion: what is the capital of France? Answer in one word.");
    let policies = ["streaming", "knorm", "keydiff", "paged_eviction", "sage", "snapkv", "h2o", "kv_compress", "full"];
    for policy in policies {
        let body =
            chat(&question, json!({"temperature": 0, "max_tokens": 24, "kv": {"policy": policy, "budget_tokens": 64}}));
        let (s, v) = http.post_json("/v1/chat/completions", &body).await.unwrap();
        assert_eq!(s, 200, "{policy}: {v}");
        let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
        eprintln!("{policy}: {answer:?}");
        assert!(!answer.trim().is_empty(), "{policy}");
        let stats = worker_stats(&up.worker).await.unwrap();
        let ev = stats.evictions.iter().find(|e| e.policy == policy);
        if policy == "full" {
            assert!(ev.is_none(), "full never evicts: {stats:?}");
        } else {
            let ev = ev.unwrap_or_else(|| panic!("{policy}: no evictions reported: {stats:?}"));
            assert!(ev.evicted_slots > 0 && ev.freed_blocks > 0, "{policy}: {ev:?}");
        }
    }
    let (s, text) = http.get("/metrics").await.unwrap();
    assert_eq!(s, 200);
    assert!(text.contains("pagoda_router_worker_evicted_blocks{") && text.contains("policy=\"kv_compress\""), "{text}");
    // `kv.codec`: this request's KV goes down to the host tier in int4_kivi, where the worker's own codec is native.
    let body =
        chat(&format!("{context}\nQuestion: name a colour."), json!({"max_tokens": 8, "kv": {"codec": "int4_kivi"}}));
    let (s, v) = http.post_json("/v1/chat/completions", &body).await.unwrap();
    assert_eq!(s, 200, "{v}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats = worker_stats(&up.worker).await.unwrap();
        if stats.tiers.iter().any(|t| t.tier == "host" && t.codec == "int4_kivi" && t.used_bytes > 0) {
            break;
        }
        assert!(Instant::now() < deadline, "no int4_kivi groups on the host tier: {:?}", stats.tiers);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // An unknown policy, a budget below the minimum and an unknown codec are 400s naming the field.
    for (kv, param) in [
        (json!({"policy": "lru"}), "kv.policy"),
        (json!({"budget_tokens": 4}), "kv.budget_tokens"),
        (json!({"codec": "zstd"}), "kv.codec"),
    ] {
        let (s, v) = http.post_json("/v1/chat/completions", &chat(QUESTION, json!({"kv": kv}))).await.unwrap();
        assert_eq!(s, 400, "{v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    still_serves(http, "policies").await;
}

/// `--scheduling-policy priority` through the real binary: requests that name a priority are served, one at a time
/// here (`--max-running 1`), and each gets the answer it gets alone. (Which goes first is checked on the engine
/// itself, in `engine_model`, where the order can be observed without timing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_priority_scheduling_serves_every_priority() {
    let up = start_up("up-priority", &["--scheduling-policy", "priority", "--max-running", "1"]).await.unwrap();
    let http = &up.http;
    let ask = |priority: i64| {
        let body = chat(QUESTION, json!({"temperature": 0, "max_tokens": 12, "priority": priority}));
        async move { http.post_json("/v1/chat/completions", &body).await.unwrap() }
    };
    let (a, b, c) = tokio::join!(ask(3), ask(-1), ask(0));
    for (s, v) in [&a, &b, &c] {
        assert_eq!(*s, 200, "{v}");
        assert!(v["choices"][0]["message"]["content"].as_str().is_some_and(|t| t.contains("Paris")), "{v}");
    }
    assert_eq!(a.1["choices"], b.1["choices"]);
    assert_eq!(a.1["choices"], c.1["choices"]);
    // The worker reports each request's time in its queue; the router's histogram has all three.
    let (_, metrics) = http.get("/metrics").await.unwrap();
    let count = metrics.lines().find_map(|l| l.strip_prefix("pagoda_router_queue_seconds_count ")).map(str::trim);
    assert_eq!(count, Some("3"), "{metrics}");
    let completion = json!({"model": MODEL_ID, "prompt": "The capital city of France is", "max_tokens": 3,
                            "temperature": 0, "priority": -7});
    let (s, v) = http.post_json("/v1/completions", &completion).await.unwrap();
    assert_eq!(s, 200, "{v}");
    let (s, v) =
        http.post_json("/v1/chat/completions", &chat(QUESTION, json!({"priority": -(1i64 << 40)}))).await.unwrap();
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["param"], "priority", "{v}");
    still_serves(http, "priority").await;
}

/// Fair scheduling through the real binary, one running slot: while a heavy tenant's long request holds it, two
/// more of the heavy tenant's and then one of the light tenant's queue (keys file with `weight=`). The light one
/// runs next, before the heavy burst's rest (its tenant was admitted least recently); in arrival order it would
/// run last. Every answer is the same greedy one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_fair_scheduling_serves_a_light_tenant_before_a_heavy_burst() {
    let keys = std::env::temp_dir().join(format!("pagoda-e2e-fair-keys-{}", std::process::id()));
    std::fs::write(&keys, "sk-fair-heavy-0123456789 heavy\nsk-fair-light-0123456789 light weight=2\n").unwrap();
    let flags = ["--scheduling-policy", "fair", "--max-running", "1", "--api-keys-file", keys.to_str().unwrap()];
    let up = start_up("up-fair", &flags).await.unwrap();
    let heavy = up.http.clone().with_api_key("sk-fair-heavy-0123456789").unwrap();
    let light = up.http.clone().with_api_key("sk-fair-light-0123456789").unwrap();
    let ask = |http: pagoda_e2e::Http, max_tokens: u32| async move {
        let body = chat(QUESTION, json!({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": true}));
        let (s, v) = http.post_json("/v1/chat/completions", &body).await.unwrap();
        assert_eq!(s, 200, "{v}");
        (v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string(), Instant::now())
    };
    let blocker = tokio::spawn(ask(heavy.clone(), 160));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let h1 = tokio::spawn(ask(heavy.clone(), 4));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let h2 = tokio::spawn(ask(heavy.clone(), 4));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let l = tokio::spawn(ask(light.clone(), 4));
    let (blocker, h1, h2, l) = (blocker.await.unwrap(), h1.await.unwrap(), h2.await.unwrap(), l.await.unwrap());
    assert!(blocker.1 < l.1, "the blocker held the slot while the others queued");
    assert!(l.1 < h1.1 && l.1 < h2.1, "the light tenant waited for the heavy burst");
    assert!(h1.0 == h2.0 && h1.0 == l.0 && blocker.0.starts_with(&l.0), "{blocker:?} {h1:?} {h2:?} {l:?}");
    let _ = std::fs::remove_file(&keys);
}

/// `--scheduling-policy vtc` through `pagoda up`, one running slot: while a third tenant's request holds it, tenant
/// `long` queues a long-prompt request and then a short one, and tenant `short` two short ones. VTC charges the
/// long prompt to its tenant, so both of `short`'s requests run before `long`'s second; slot fairness would run
/// it before `short`'s second. Every short answer is the same greedy one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_vtc_scheduling_charges_a_tenant_for_its_long_prompt() {
    let keys = std::env::temp_dir().join(format!("pagoda-e2e-vtc-keys-{}", std::process::id()));
    std::fs::write(
        &keys,
        "sk-vtc-other-0123456789 other\nsk-vtc-long-01234567890 long\nsk-vtc-short-0123456789 short\n",
    )
    .unwrap();
    let flags = ["--scheduling-policy", "vtc", "--max-running", "1", "--api-keys-file", keys.to_str().unwrap()];
    let up = start_up("up-vtc", &flags).await.unwrap();
    let key = |k: &str| up.http.clone().with_api_key(k).unwrap();
    let (other, long, short) =
        (key("sk-vtc-other-0123456789"), key("sk-vtc-long-01234567890"), key("sk-vtc-short-0123456789"));
    let ask = |http: pagoda_e2e::Http, prompt: String, max_tokens: u32| async move {
        let body = chat(&prompt, json!({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": true}));
        let (s, v) = http.post_json("/v1/chat/completions", &body).await.unwrap();
        assert_eq!(s, 200, "{v}");
        (v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string(), Instant::now())
    };
    let long_prompt =
        format!("{} {QUESTION}", ["The lighthouse keeper counted the ships and the birds."; 30].join(" "));
    let blocker = tokio::spawn(ask(other, QUESTION.to_string(), 160));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut queued = Vec::new();
    for (http, prompt) in [
        (&long, &long_prompt),
        (&long, &QUESTION.to_string()),
        (&short, &QUESTION.to_string()),
        (&short, &QUESTION.to_string()),
    ] {
        queued.push(tokio::spawn(ask(http.clone(), prompt.clone(), 4)));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let blocker = blocker.await.unwrap();
    let mut done = Vec::new();
    for q in queued {
        done.push(q.await.unwrap());
    }
    let (long_1, long_2, short_1, short_2) = (&done[0], &done[1], &done[2], &done[3]);
    assert!(blocker.1 < long_1.1, "the blocker held the slot while the others queued");
    assert!(long_1.1 < short_1.1, "the long request arrived first at the same counter and ran first");
    assert!(short_2.1 < long_2.1, "the short tenant's second request ran before the long tenant's second");
    assert!(long_2.0 == short_1.0 && short_1.0 == short_2.0, "{done:?}");
    // The router counts each tenant's tokens: the long tenant's prompts outweigh the short tenant's.
    let (_, metrics) = up.http.get("/metrics").await.unwrap();
    let tokens = |tenant: &str, kind: &str| -> u64 {
        let series = format!("pagoda_router_tenant_tokens_total{{tenant=\"{tenant}\",kind=\"{kind}\"}} ");
        let line = metrics.lines().find(|l| l.starts_with(&series)).unwrap_or_else(|| panic!("{series}: {metrics}"));
        line[series.len()..].trim().parse().unwrap()
    };
    assert_eq!(
        (tokens("long", "completion"), tokens("short", "completion"), tokens("other", "completion")),
        (8, 8, 160)
    );
    assert!(tokens("long", "prompt") > 3 * tokens("short", "prompt"), "{metrics}");
    let _ = std::fs::remove_file(&keys);
}

/// The named events of a Responses stream: (event, data as JSON), checking the framing (`event:` then `data:`, no
/// `[DONE]`).
fn named_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .map(|block| {
            let mut lines = block.lines();
            let event = lines.next().and_then(|l| l.strip_prefix("event: ")).unwrap_or_else(|| panic!("{block}"));
            let data = lines.next().and_then(|l| l.strip_prefix("data: ")).unwrap_or_else(|| panic!("{block}"));
            let v: Value = pagoda_e2e::serde_json::from_str(data).unwrap_or_else(|e| panic!("{data}: {e}"));
            assert_eq!(v["type"], event, "{block}");
            (event.to_string(), v)
        })
        .collect()
}

/// OpenAI's Responses API through `pagoda up`: the answer is the chat path's for the same messages, streamed as
/// named events that add up to it, stored and retrievable, continued with `previous_response_id` (whose prompt
/// starts with the stored turn, so the worker serves it from the prefix cache), deletable, and bad input is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_responses_api_answers_streams_stores_and_continues_a_conversation() {
    let up = start_up("up-responses", &[]).await.unwrap();
    let http = &up.http;
    let get_json = |path: String| async move {
        let (s, text) = http.get(&path).await.unwrap();
        (s, pagoda_e2e::serde_json::from_str::<Value>(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}")))
    };
    let refused = |(s, v): (u16, Value), want: u16, param: Option<&str>| {
        assert_eq!((s, v["error"]["param"].as_str()), (want, param), "{v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    };
    let ask = json!({"model": MODEL_ID, "input": QUESTION, "temperature": 0, "max_output_tokens": 24});
    let (s, r) = http.post_json("/v1/responses", &ask).await.unwrap();
    assert_eq!(s, 200, "{r}");
    assert_eq!((r["object"].as_str(), r["model"].as_str()), (Some("response"), Some(MODEL_ID)));
    let id = r["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("resp_"), "{r}");
    let answer = r["output"][0]["content"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(r["output"][0]["role"], "assistant");
    assert!(answer.contains("Paris"), "{r}");
    let chat_answer = |messages: Value, max_tokens: u32| async move {
        let body = json!({"model": MODEL_ID, "messages": messages, "temperature": 0, "max_tokens": max_tokens});
        let (s, c) = http.post_json("/v1/chat/completions", &body).await.unwrap();
        assert_eq!(s, 200, "{c}");
        c
    };
    let c = chat_answer(json!([{"role": "user", "content": QUESTION}]), 24).await;
    assert_eq!(c["choices"][0]["message"]["content"], answer.as_str(), "the chat path's answer");
    assert_eq!(r["usage"]["input_tokens"], c["usage"]["prompt_tokens"]);
    assert_eq!(r["usage"]["output_tokens"], c["usage"]["completion_tokens"]);
    let status = if c["choices"][0]["finish_reason"] == "length" { "incomplete" } else { "completed" };
    assert_eq!(r["status"], status, "{r}");

    // Streamed: named events whose deltas add up to the same answer.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let resp = http.client.post(http.url("/v1/responses")).json(&streamed).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let events = named_events(&resp.text().await.unwrap());
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        &names[..4],
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    );
    assert_eq!(names.last().copied(), Some(format!("response.{status}").as_str()), "{names:?}");
    for (i, (_, v)) in events.iter().enumerate() {
        assert_eq!(v["sequence_number"], i as u64);
    }
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, v)| v["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, answer);
    let last = &events.last().unwrap().1["response"];
    assert_eq!(last["output"][0]["content"][0]["text"], answer.as_str());
    let streamed_id = last["id"].as_str().unwrap();
    assert_ne!(streamed_id, id);
    let (s, got) = get_json(format!("/v1/responses/{streamed_id}")).await;
    assert_eq!((s, &got), (200, last), "a streamed response is stored too");

    // Stored: retrieved as returned, and continued.
    let (s, got) = get_json(format!("/v1/responses/{id}")).await;
    assert_eq!((s, &got), (200, &r));
    let follow = json!({"model": MODEL_ID, "input": "And of Germany?", "previous_response_id": id, "temperature": 0,
        "max_output_tokens": 16});
    let (s, f) = http.post_json("/v1/responses", &follow).await.unwrap();
    assert_eq!(s, 200, "{f}");
    assert_eq!(f["previous_response_id"], id.as_str());
    // The conversation goes on as these chat messages do; its prompt starts with the first turn and its answer,
    // which the worker has cached.
    let whole = json!([{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer},
        {"role": "user", "content": "And of Germany?"}]);
    let c2 = chat_answer(whole, 16).await;
    assert_eq!(f["output"][0]["content"][0]["text"], c2["choices"][0]["message"]["content"]);
    assert_eq!(f["usage"]["input_tokens"], c2["usage"]["prompt_tokens"]);
    assert!(f["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{f}");

    // A forced function call: a function_call item whose arguments fit the parameters; its output goes back as a
    // function_call_output item after it, and the model answers in words.
    let weather = json!({"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"], "additionalProperties": false}});
    let call_body = json!({"model": MODEL_ID, "input": "What is the weather in Paris?", "tools": [weather],
        "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0, "max_output_tokens": 32});
    let (s, call) = http.post_json("/v1/responses", &call_body).await.unwrap();
    assert_eq!(s, 200, "{call}");
    let item = &call["output"][0];
    assert_eq!((item["type"].as_str(), item["name"].as_str()), (Some("function_call"), Some("get_weather")), "{call}");
    let arguments: Value = pagoda_e2e::serde_json::from_str(item["arguments"].as_str().unwrap()).unwrap();
    assert!(arguments["city"].is_string(), "{arguments}");
    let mut streamed_call = call_body.clone();
    streamed_call["stream"] = json!(true);
    let resp = http.client.post(http.url("/v1/responses")).json(&streamed_call).send().await.unwrap();
    let events = named_events(&resp.text().await.unwrap());
    let args: String = events
        .iter()
        .filter(|(n, _)| n == "response.function_call_arguments.delta")
        .map(|(_, v)| v["delta"].as_str().unwrap())
        .collect();
    assert_eq!(args, item["arguments"].as_str().unwrap(), "streamed arguments");
    let result = json!({"model": MODEL_ID, "previous_response_id": call["id"], "temperature": 0, "max_output_tokens": 24,
        "input": [{"type": "function_call_output", "call_id": item["call_id"], "output": "Sunny, 21 degrees."}]});
    let (s, told) = http.post_json("/v1/responses", &result).await.unwrap();
    assert_eq!(s, 200, "{told}");
    assert_eq!(told["output"][0]["type"], "message");
    assert!(!told["output"][0]["content"][0]["text"].as_str().unwrap().is_empty(), "{told}");

    // Instructions are a system message; not stored; deleted; bad input.
    let mut unstored = ask.clone();
    unstored["store"] = json!(false);
    unstored["instructions"] = json!("You are brief.");
    let (s, u) = http.post_json("/v1/responses", &unstored).await.unwrap();
    assert_eq!(s, 200, "{u}");
    let c3 = chat_answer(
        json!([{"role": "system", "content": "You are brief."}, {"role": "user", "content": QUESTION}]),
        24,
    )
    .await;
    assert_eq!(u["output"][0]["content"][0]["text"], c3["choices"][0]["message"]["content"]);
    assert_eq!(u["instructions"], "You are brief.");
    let uid = u["id"].as_str().unwrap();
    refused(get_json(format!("/v1/responses/{uid}")).await, 404, None);
    let (s, e) = http
        .post_json("/v1/responses", &json!({"model": MODEL_ID, "input": "x", "previous_response_id": uid}))
        .await
        .unwrap();
    assert_eq!((s, e["error"]["code"].as_str()), (400, Some("previous_response_not_found")), "{e}");
    let resp = http.client.delete(http.url(&format!("/v1/responses/{id}"))).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let deleted: Value = resp.json().await.unwrap();
    assert_eq!(deleted, json!({"id": id, "object": "response", "deleted": true}));
    refused(get_json(format!("/v1/responses/{id}")).await, 404, None);
    for (body, param) in [
        (json!({"model": MODEL_ID}), "input"),
        (json!({"model": MODEL_ID, "input": "x", "tools": [{"type": "web_search"}]}), "tools[0]"),
        // The model's template defines no tool-call format: it cannot choose a call itself.
        (json!({"model": MODEL_ID, "input": "x", "tools": [{"type": "function", "name": "f"}]}), "tool_choice"),
        (json!({"model": MODEL_ID, "input": "x", "max_output_tokens": -1}), "max_output_tokens"),
        (json!({"model": MODEL_ID, "input": "x", "temperature": 9}), "temperature"),
        (
            json!({"model": MODEL_ID, "input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
            "input[0].content[0]",
        ),
    ] {
        refused(http.post_json("/v1/responses", &body).await.unwrap(), 400, Some(param));
    }
    refused(
        http.post_json("/v1/responses", &json!({"model": "nope", "input": "x"})).await.unwrap(),
        404,
        Some("model"),
    );
    still_serves(http, "the Responses API").await;
}

/// vLLM's `cache_salt` through `pagoda up`: a prompt is served from the prefix cache only to requests with the same
/// salt (and only an unsalted request to an unsalted one); a bad salt is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_cache_salt_shares_cached_blocks_only_between_requests_with_the_same_salt() {
    let up = start_up("up-salt", &[]).await.unwrap();
    let http = &up.http;
    let prompt = common::river_log_prompt();
    let cached = |salt: Option<&'static str>| {
        let prompt = prompt.clone();
        async move {
            let mut extra = json!({"temperature": 0, "max_tokens": 1});
            if let Some(s) = salt {
                extra["cache_salt"] = json!(s);
            }
            let (s, v) = http.post_json("/v1/chat/completions", &chat(&prompt, extra)).await.unwrap();
            assert_eq!(s, 200, "{v}");
            v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
        }
    };
    assert_eq!(cached(Some("salt-a")).await, 0, "a first request finds nothing");
    assert!(cached(Some("salt-a")).await > 600, "the same salt finds the whole prompt");
    assert_eq!(cached(Some("salt-b")).await, 0, "another salt finds nothing");
    assert_eq!(cached(None).await, 0, "an unsalted request finds nothing salted");
    assert!(cached(None).await > 600);
    let (s, v) =
        http.post_json("/v1/chat/completions", &chat("x", json!({"max_tokens": 1, "cache_salt": ""}))).await.unwrap();
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("cache_salt")), "{v}");
}

/// Streams a chat completion and returns its text, put together from the deltas.
async fn streamed_chat(http: &pagoda_e2e::Http, body: &Value) -> String {
    let r = http.client.post(http.url("/v1/chat/completions")).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let payloads = sse_payloads(&text).unwrap();
    assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"), "{text}");
    payloads[..payloads.len() - 1]
        .iter()
        .filter_map(|p| {
            let c: Value = pagoda_e2e::serde_json::from_str(p).unwrap_or_else(|e| panic!("bad chunk {p}: {e}"));
            c["choices"][0]["delta"]["content"].as_str().map(str::to_owned)
        })
        .collect()
}

/// `--speculative-tokens` through the real binary: the answers of a server with n-gram speculation are those of
/// one without (greedy, seeded, streamed, with a stop string, with penalties, and guided by a regex or a JSON
/// schema), the worker reports the drafts it computed and accepted, and `/metrics` shows them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_speculative_decoding_answers_as_without_it() {
    let plain = start_up("up-plain", &[]).await.unwrap();
    // A pinned draft cost: what is drafted does not depend on how fast this (debug) build runs its steps.
    let spec = start_up("up-spec", &["--speculative-tokens", "4", "--speculative-draft-cost", "0"]).await.unwrap();
    let prompts = ["Count from 1 to 30, one number per line.", "Write a long poem about the sea."];
    for prompt in prompts {
        for extra in [
            json!({"temperature": 0, "max_tokens": 96}),
            json!({"temperature": 0.8, "seed": 5, "max_tokens": 64}),
            json!({"temperature": 0, "max_tokens": 96, "stop": ["\n7", "waves"]}),
            // The sampler's state advances with every accepted draft token: penalties and guides see each one.
            json!({"temperature": 0.7, "seed": 9, "max_tokens": 64, "frequency_penalty": 0.5, "presence_penalty": 0.3}),
            json!({"temperature": 0, "max_tokens": 64, "guided_regex": "([0-9]+\n){1,40}[0-9]+"}),
            json!({"temperature": 0.8, "seed": 2, "max_tokens": 96, "response_format": {"type": "json_schema",
                "json_schema": {"name": "lines", "schema": {"type": "object", "required": ["lines"],
                    "properties": {"lines": {"type": "array", "items": {"type": "string"}, "maxItems": 8}}}}}}),
        ] {
            let body = chat(prompt, extra.clone());
            let (s1, want) = plain.http.post_json("/v1/chat/completions", &body).await.unwrap();
            let (s2, got) = spec.http.post_json("/v1/chat/completions", &body).await.unwrap();
            assert_eq!((s1, s2), (200, 200), "{want} {got}");
            assert_eq!(got["choices"], want["choices"], "{prompt:?} {extra}");
            assert_eq!(got["usage"]["completion_tokens"], want["usage"]["completion_tokens"]);
            let mut stream = body.clone();
            stream["stream"] = json!(true);
            let text = streamed_chat(&spec.http, &stream).await;
            assert_eq!(text, want["choices"][0]["message"]["content"].as_str().unwrap(), "streamed {extra}");
        }
    }
    let stats = worker_stats(&spec.worker).await.unwrap();
    assert!(stats.spec_accepted_tokens_total > 10, "{stats:?}");
    assert!(stats.spec_draft_tokens_total >= stats.spec_accepted_tokens_total);
    let plain_stats = worker_stats(&plain.worker).await.unwrap();
    assert_eq!(plain_stats.spec_draft_tokens_total, 0);
    let (s, text) = spec.http.get("/metrics").await.unwrap();
    assert_eq!(s, 200);
    let accepted = text
        .lines()
        .find(|l| l.starts_with("pagoda_router_worker_spec_accepted_tokens{"))
        .unwrap_or_else(|| panic!("no accepted-drafts gauge: {text}"));
    let value: u64 = accepted.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{accepted}"));
    assert!(value > 0, "{accepted}");
    still_serves(&spec.http, "speculative decoding").await;
}

/// Anthropic's Messages API through `pagoda up` with a keys file, the key sent in `x-api-key` as Anthropic's clients
/// send it: the answer is the chat path's for the same messages, streamed as Anthropic's events that add up to it,
/// cut by a stop sequence the message names, counted by count_tokens; a forced tool call comes back as a `tool_use`
/// block, and bad input is a 400 in Anthropic's error shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_messages_api_answers_streams_and_calls_tools_with_an_x_api_key() {
    const KEY: &str = "sk-messages-0123456789";
    let keys = std::env::temp_dir().join(format!("pagoda-e2e-messages-keys-{}", std::process::id()));
    std::fs::write(&keys, format!("{KEY} anthropic\n")).unwrap();
    let up = start_up("up-messages", &["--api-keys-file", keys.to_str().unwrap()]).await.unwrap();
    let http = &up.http;
    let post = |path: &'static str, body: Value, key: Option<&'static str>| async move {
        let mut req = http.client.post(http.url(path)).header("anthropic-version", "2023-06-01").json(&body);
        if let Some(key) = key {
            req = req.header("x-api-key", key);
        }
        let resp = req.send().await.unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    };
    let post_json = |path: &'static str, body: Value| async move {
        let (s, text) = post(path, body, Some(KEY)).await;
        (s, pagoda_e2e::serde_json::from_str::<Value>(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
    };
    let ask = json!({"model": MODEL_ID, "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": QUESTION}]});
    assert_eq!(post("/v1/messages", ask.clone(), None).await.0, 401, "no key, no answer");

    let (s, m) = post_json("/v1/messages", ask.clone()).await;
    assert_eq!(s, 200, "{m}");
    assert_eq!((m["type"].as_str(), m["role"].as_str()), (Some("message"), Some("assistant")), "{m}");
    let answer = m["content"][0]["text"].as_str().unwrap().to_string();
    let bearer = http.clone().with_api_key(KEY).unwrap();
    let (s, c) = bearer
        .post_json("/v1/chat/completions", &chat(QUESTION, json!({"temperature": 0, "max_tokens": 24})))
        .await
        .unwrap();
    assert_eq!(s, 200, "{c}");
    assert_eq!(c["choices"][0]["message"]["content"], answer.as_str(), "the chat path's answer");
    let prompt_tokens = c["usage"]["prompt_tokens"].as_u64().unwrap();
    let usage = &m["usage"];
    assert_eq!(
        usage["input_tokens"].as_u64().unwrap() + usage["cache_read_input_tokens"].as_u64().unwrap(),
        prompt_tokens
    );
    assert_eq!(usage["output_tokens"], c["usage"]["completion_tokens"]);
    let end = if c["choices"][0]["finish_reason"] == "length" { "max_tokens" } else { "end_turn" };
    assert_eq!(m["stop_reason"], end, "{m}");

    // Streamed: Anthropic's events, whose text deltas add up to the same answer.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let (s, text) = post("/v1/messages", streamed, Some(KEY)).await;
    assert_eq!(s, 200, "{text}");
    let events = named_events(&text);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(&names[..3], ["message_start", "content_block_start", "ping"], "{names:?}");
    assert_eq!(&names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"], "{names:?}");
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, v)| v["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, answer);
    assert_eq!(events[names.len() - 2].1["delta"]["stop_reason"], end);

    // A stop sequence cuts the text and is named.
    let word = answer.split_whitespace().next().unwrap().trim_matches(|c: char| !c.is_alphanumeric()).to_string();
    let mut stopped = ask.clone();
    stopped["stop_sequences"] = json!([word, "never-generated"]);
    let (s, m) = post_json("/v1/messages", stopped).await;
    assert_eq!(s, 200, "{m}");
    assert_eq!((m["stop_reason"].as_str(), m["stop_sequence"].as_str()), (Some("stop_sequence"), Some(word.as_str())));
    assert!(!m["content"][0]["text"].as_str().unwrap().contains(&word), "{m}");

    // count_tokens: the prompt a request would run.
    let (s, counted) =
        post_json("/v1/messages/count_tokens", json!({"model": MODEL_ID, "messages": ask["messages"]})).await;
    assert_eq!((s, counted["input_tokens"].as_u64()), (200, Some(prompt_tokens)), "{counted}");

    // A forced tool call.
    let tool = json!({"name": "get_weather", "description": "The weather in a city.", "input_schema": {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"], "additionalProperties": false}});
    let call = json!({"model": MODEL_ID, "max_tokens": 32, "temperature": 0, "tools": [tool],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}]});
    let (s, m) = post_json("/v1/messages", call).await;
    assert_eq!(s, 200, "{m}");
    assert_eq!(
        (m["stop_reason"].as_str(), m["content"][0]["type"].as_str()),
        (Some("tool_use"), Some("tool_use")),
        "{m}"
    );
    assert!(m["content"][0]["input"]["city"].is_string(), "{m}");

    // Bad input: Anthropic's error shape, naming the field.
    let mut bad = ask.clone();
    bad["max_tokens"] = json!(0);
    let (s, e) = post_json("/v1/messages", bad).await;
    assert_eq!(
        (s, e["type"].as_str(), e["error"]["type"].as_str()),
        (400, Some("error"), Some("invalid_request_error"))
    );
    assert!(e["error"]["message"].as_str().unwrap().contains("max_tokens"), "{e}");
    let mut unknown = ask.clone();
    unknown["model"] = json!("no-such-model");
    let (s, e) = post_json("/v1/messages", unknown).await;
    assert_eq!((s, e["error"]["type"].as_str()), (404, Some("not_found_error")), "{e}");
    let _ = std::fs::remove_file(&keys);
}

/// vLLM's `stop_reason` through `pagoda up` on the real model: the worker reports the token it stopped on, and the
/// router names the request's own stop token id (the answer's first token, found with `/tokenize`) or the stop
/// string that matched; the model's end token and a length finish are `null`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_stop_reason_names_the_stop_token_or_string() {
    let up = start_up("up-stop-reason", &[]).await.unwrap();
    let http = &up.http;
    let ask = |extra: Value| async move {
        let (s, v) = http.post_json("/v1/chat/completions", &chat(QUESTION, extra)).await.unwrap();
        assert_eq!(s, 200, "{v}");
        v["choices"][0].clone()
    };
    let plain = ask(json!({"temperature": 0, "max_tokens": 48})).await;
    let answer = plain["message"]["content"].as_str().unwrap().to_string();
    assert_eq!(plain["stop_reason"], Value::Null, "the model's end token, or a length finish: {plain}");
    let (s, t) = http.post_json("/tokenize", &json!({"prompt": answer, "add_special_tokens": false})).await.unwrap();
    assert_eq!(s, 200, "{t}");
    let first = t["tokens"][0].as_u64().unwrap();
    let by_token = ask(json!({"temperature": 0, "max_tokens": 48, "stop_token_ids": [first]})).await;
    assert_eq!((by_token["finish_reason"].as_str(), by_token["stop_reason"].as_u64()), (Some("stop"), Some(first)));
    assert_eq!(by_token["message"]["content"], "", "the stop token is not sent");
    let word = answer.split_whitespace().next().unwrap().trim_matches(|c: char| !c.is_alphanumeric()).to_string();
    let by_string = ask(json!({"temperature": 0, "max_tokens": 48, "stop": ["never-generated", word]})).await;
    assert_eq!(by_string["stop_reason"], word.as_str(), "{by_string}");
    let cut = ask(json!({"temperature": 0, "max_tokens": 1, "ignore_eos": true})).await;
    assert_eq!((cut["finish_reason"].as_str(), &cut["stop_reason"]), (Some("length"), &Value::Null));
}

/// Ctrl-C drains: `up` waits for the stream in flight. A second Ctrl-C means not to wait: the process exits at
/// once, with 128 + SIGINT, as a shell reports a process that signal ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_exits_at_once_on_a_second_ctrl_c() {
    let mut up = start_up("up-second-signal", &[]).await.unwrap();
    let body = chat(QUESTION, json!({"temperature": 0, "max_tokens": 2000, "ignore_eos": true}));
    let http = up.http.clone();
    let long = tokio::spawn(async move { http.post_json("/v1/chat/completions", &body).await });
    let t0 = Instant::now();
    while worker_stats(&up.worker).await.map(|s| s.running).unwrap_or(0) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "the long request never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let interrupt = |pid: u32| {
        let status = std::process::Command::new("kill").args(["-INT", &pid.to_string()]).status().unwrap();
        assert!(status.success());
    };
    interrupt(up.proc.pid());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(up.proc.alive(), "the first Ctrl-C drains the stream in flight\n{}", up.proc.log_tail());
    interrupt(up.proc.pid());
    let t1 = Instant::now();
    let status = tokio::task::block_in_place(|| up.proc.wait_exit(Duration::from_secs(3)));
    let status = status.unwrap_or_else(|| panic!("still running 3 s after the second Ctrl-C\n{}", up.proc.log_tail()));
    assert_eq!(status.code(), Some(130), "{}", up.proc.log_tail());
    assert!(t1.elapsed() < Duration::from_secs(2), "{:?}", t1.elapsed());
    assert!(up.proc.log_tail().contains("a second stop signal"), "{}", up.proc.log_tail());
    // The client of the cut stream gets an error, not a hang.
    let cut = tokio::time::timeout(Duration::from_secs(10), long).await.expect("the client was left hanging");
    let cut = cut.unwrap();
    assert!(cut.is_err(), "the process is gone, yet the request answered: {cut:?}");
}
