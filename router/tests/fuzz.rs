//! Property tests of everything the router parses from a client or an operator before a request reaches a worker:
//! request bodies (arbitrary bytes, arbitrary JSON values, and near-valid objects with hostile field values) through
//! the JSON extractor and both endpoints' validation, the `Authorization` header, and the keys file. The property:
//! no panic, a bounded time, and either a valid request or a well-formed 4xx OpenAI error.

use std::path::Path;
use std::time::{Duration, Instant};

use axum::http::HeaderValue;
use pagoda_router::ApiError;
use pagoda_router::auth::{KeyTable, KeysFileError, bearer};
use pagoda_router::extract::parse_json;
use pagoda_router::openai::{
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeInput, TokenizeRequest, check_lengths,
};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

const VOCAB: usize = 49152;
const CONTEXT: usize = 8192;
/// Far above what one case needs (microseconds); a case over it means a hang or a blow-up.
const CASE_LIMIT: Duration = Duration::from_secs(2);

fn assert_client_error(e: &ApiError) {
    assert!(e.status.is_client_error(), "not a 4xx: {e:?}");
    assert!(!e.message.is_empty());
    let v: Value = serde_json::from_str(&e.body_json()).expect("error body is JSON");
    assert!(v["error"]["message"].is_string() && v["error"]["type"].is_string(), "{v}");
}

/// Runs a body through every JSON endpoint's parsing and validation, as the handlers do before tokenizing.
fn check_body(bytes: &[u8]) {
    let t0 = Instant::now();
    match parse_json::<ChatCompletionRequest>(bytes) {
        Ok(req) => match req.validate(VOCAB) {
            Ok((turns, params)) => {
                assert!(!turns.is_empty());
                if let Err(e) = check_lengths(1, params.max_tokens, CONTEXT) {
                    assert_client_error(&e);
                }
            }
            Err(e) => assert_client_error(&e),
        },
        Err(e) => assert_client_error(&e),
    }
    match parse_json::<CompletionRequest>(bytes) {
        Ok(req) => match req.validate(VOCAB) {
            Ok((_, params)) => {
                if let Err(e) = check_lengths(CONTEXT, params.max_tokens, CONTEXT) {
                    assert_client_error(&e);
                }
            }
            Err(e) => assert_client_error(&e),
        },
        Err(e) => assert_client_error(&e),
    }
    match parse_json::<TokenizeRequest>(bytes) {
        Ok(req) => match req.validate() {
            Ok(TokenizeInput::Chat(turns, _)) => assert!(!turns.is_empty()),
            Ok(TokenizeInput::Prompt { .. }) => {}
            Err(e) => assert_client_error(&e),
        },
        Err(e) => assert_client_error(&e),
    }
    match parse_json::<DetokenizeRequest>(bytes) {
        Ok(req) => match req.validate(VOCAB) {
            Ok(ids) => assert!(ids.iter().all(|&t| (t as usize) < VOCAB)),
            Err(e) => assert_client_error(&e),
        },
        Err(e) => assert_client_error(&e),
    }
    assert!(t0.elapsed() < CASE_LIMIT, "took {:?}", t0.elapsed());
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        ".{0,40}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::btree_map(".{0,12}", inner, 0..8).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Field values that sit on or past the validators' edges.
fn edge_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(1)),
        Just(json!(i64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!(u64::MAX)),
        Just(json!(1e308)),
        Just(json!(-0.0)),
        Just(json!(0.5)),
        Just(json!(100.0001)),
        Just(json!(8192)),
        Just(json!(49152)),
        Just(json!("")),
        Just(json!("\u{0}")),
        Just(json!(["a", "b", "c", "d", "e", "f", "g", "h", "i"])),
        Just(json!([[1, 2], [3]])),
        Just(json!([49151, 0, 49152])),
        Just(json!({"policy": "lru"})),
        Just(json!({"policy": "snapkv", "budget_tokens": 4})),
        Just(json!({"policy": "h2o", "budget_tokens": u64::MAX, "codec": "int4_kivi"})),
        Just(json!({"include_usage": "yes"})),
        Just(json!([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url"}]}])),
        Just(json!({"42": 5, "7": -100})),
        Just(json!({"007": 1, "7": 2})),
        Just(json!({"-1": 1, "1e3": 2, " 4": 3})),
        Just(json!({"4294967296": 1, "12": 1e308})),
        Just(json!([{"role": "tool", "content": "x"}])),
        Just(json!([{"role": "user"}])),
        Just(json!([{"role": "user", "content": null}])),
        Just(Value::String("x".repeat(300))),
        any_json(),
    ]
}

const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "ignore_eos",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "echo",
    "suffix",
    "user",
    "kv",
    "tools",
    "tool_choice",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "response_format",
    "tokens",
    "add_special_tokens",
    "return_token_strs",
];

/// A valid request of either endpoint with some fields replaced by edge values.
fn near_valid() -> impl Strategy<Value = Value> {
    let base = json!({
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "prompt": "hello",
        "max_tokens": 16,
    });
    prop::collection::vec((prop::sample::select(FIELDS), edge_value()), 0..6).prop_map(move |edits| {
        let mut obj: Map<String, Value> = base.as_object().cloned().unwrap_or_default();
        for (k, v) in edits {
            obj.insert(k.to_string(), v);
        }
        Value::Object(obj)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        check_body(&bytes);
    }

    #[test]
    fn arbitrary_json_never_panics(v in any_json()) {
        check_body(v.to_string().as_bytes());
    }

    #[test]
    fn near_valid_requests_validate_or_get_400(v in near_valid()) {
        check_body(v.to_string().as_bytes());
    }

    #[test]
    fn truncated_valid_json_is_a_400(v in near_valid(), cut in any::<prop::sample::Index>()) {
        let text = v.to_string();
        let end = cut.index(text.len().max(1));
        // Cut on a char boundary so this exercises truncation, not UTF-8 (covered above).
        let end = (0..=end).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
        if end < text.len() {
            let e = parse_json::<ChatCompletionRequest>(&text.as_bytes()[..end]).unwrap_err();
            assert_client_error(&e);
        }
    }

    #[test]
    fn authorization_header_is_401_unless_the_key(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let table = KeyTable::parse("sk-fuzz-key-0123456789 acme\n", Path::new("keys")).unwrap();
        let Ok(h) = HeaderValue::from_bytes(&bytes) else { return Ok(()) };
        match bearer(Some(&h)) {
            Ok(key) => {
                let found = table.find(key);
                prop_assert_eq!(found.is_some(), key == b"sk-fuzz-key-0123456789");
            }
            Err(e) => {
                prop_assert_eq!(e.status.as_u16(), 401);
                prop_assert_eq!(e.code, Some("invalid_api_key"));
            }
        }
        let with_scheme = [b"Bearer ".as_slice(), &bytes].concat();
        if let Ok(h) = HeaderValue::from_bytes(&with_scheme)
            && let Ok(key) = bearer(Some(&h))
        {
            prop_assert_eq!(table.find(key).is_some(), key == b"sk-fuzz-key-0123456789");
        }
    }

    #[test]
    fn keys_file_parses_or_names_a_line(lines in prop::collection::vec(
        prop_oneof![
            ".{0,80}",
            "[ -~]{16,40} [a-z]{1,8}",
            "[ -~]{16,40} [a-z]{1,8}( (rps|burst|concurrency|x)=[-0-9.eE]{0,6}){0,4}",
            Just("# comment".to_string()),
            Just(String::new()),
        ],
        0..12,
    )) {
        let text = lines.join("\n");
        match KeyTable::parse(&text, Path::new("keys")) {
            Ok(t) => {
                prop_assert!(!t.entries().is_empty());
                for e in t.entries() {
                    prop_assert!(!e.tenant.is_empty());
                    if let Some(r) = e.limits.rate {
                        prop_assert!(r.per_second > 0.0 && r.per_second.is_finite() && r.burst >= 1);
                    }
                }
            }
            Err(KeysFileError::Line { line, message, .. }) => {
                prop_assert!(line >= 1 && line <= lines.len(), "line {line} of {}", lines.len());
                prop_assert!(!message.is_empty());
            }
            Err(KeysFileError::Empty { .. }) => {
                prop_assert!(lines.iter().all(|l| l.trim().is_empty() || l.trim().starts_with('#')));
            }
            Err(other) => prop_assert!(false, "unexpected error {other}"),
        }
    }
}
