//! OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`), served as vLLM serves it:
//! over the chat-completions path. This module owns the translation of a Responses request into a chat request,
//! the response object and its stream of named events (with the chat path's errors mapped back to the request's
//! fields), and the bounded in-memory store, shared out between tenants, that `store` and `previous_response_id`
//! use; the handlers in [`crate::server`] run the generation itself.
//!
//! Function tools map to the chat path's forced function calling: `tool_choice` naming a function (or `required`
//! with one tool) guides the answer by the function's parameters, and the answer is a `function_call` output item;
//! `function_call` and `function_call_output` input items become the chat path's assistant calls and tool turns.
//!
//! Where the responses are kept ([`ResponseBackend`]): in the router's memory ([`ResponseStore`]) when it runs
//! alone, and in etcd ([`SharedResponses`], `pagoda_registry::documents`) when it runs with the registry, so that
//! behind several routers a follow-up finds its conversation through any of them.
//!
//! A follow-up turn (`previous_response_id`) is the earlier conversation (its input items and its answer, without
//! its `instructions`, as OpenAI documents) followed by the new input, rendered by the chat template again. Its
//! prompt therefore starts with the previous turn's tokens, which the router places where they are cached: the
//! stored conversation costs no recompute of the earlier turns on a worker that still holds them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pagoda_registry::RegistryConfig;
use pagoda_registry::documents::{DocumentStore, MAX_DOCUMENT_BYTES};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::openai::Usage;

/// Most responses the store keeps, over all tenants; beyond it the oldest of the tenant holding the most goes.
pub const MAX_STORED_RESPONSES: usize = 4096;
/// Most bytes of stored conversations and response objects (as JSON), over all tenants; beyond it the oldest of the
/// tenant holding the most bytes go.
pub const MAX_STORED_BYTES: usize = 64 << 20;
/// Most items in a request's `input`.
pub const MAX_INPUT_ITEMS: usize = 1024;
/// Longest response id accepted in a path or `previous_response_id`.
const MAX_ID_LEN: usize = 128;
/// How long etcd keeps a shared response after it was written.
pub const SHARED_RESPONSE_TTL: Duration = Duration::from_secs(24 * 3600);
/// OpenAI's bounds on `metadata`: pairs, key length, value length.
const MAX_METADATA_PAIRS: usize = 16;
const MAX_METADATA_KEY: usize = 64;
const MAX_METADATA_VALUE: usize = 512;

/// Fields a Responses request passes to the chat path unchanged: OpenAI's sampling fields and vLLM's extensions.
const PASSED_THROUGH: [&str; 17] = [
    "model",
    "temperature",
    "top_p",
    "stream",
    "user",
    "seed",
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "ignore_eos",
    "priority",
    "kv",
    "cache_salt",
];

/// Fields accepted and repeated in the response object, with no effect on generation here.
const ACCEPTED: [&str; 4] = ["parallel_tool_calls", "reasoning", "service_tier", "prompt_cache_key"];

/// A validated Responses request, before its earlier conversation is known.
#[derive(Debug)]
pub struct ResponsesRequest {
    /// The fields passed to the chat request as they are.
    passed: Map<String, Value>,
    instructions: Option<String>,
    /// This turn's input as chat messages.
    input: Vec<Value>,
    /// `input` was a string (one user message) rather than a list of items.
    input_is_text: bool,
    max_output_tokens: Option<i64>,
    store: bool,
    previous_response_id: Option<String>,
    /// `text.format` as the chat request's `response_format` (None: plain text).
    response_format: Option<Value>,
    /// What the response object repeats of the request.
    text: Value,
    metadata: Value,
    truncation: String,
    /// `tools` in the chat request's form (empty: none), and as the response object repeats them.
    chat_tools: Vec<Value>,
    tools: Vec<Value>,
    /// `tool_choice` in the chat request's form, and as the response object repeats it.
    chat_tool_choice: Option<Value>,
    tool_choice: Value,
}

impl ResponsesRequest {
    /// Validates a request body. Unknown fields are ignored, as on the chat endpoint; fields that would change the
    /// answer in ways this server does not serve (tools, images, background mode) are a 400 that names them.
    pub fn parse(body: Value) -> Result<ResponsesRequest, ApiError> {
        let Value::Object(mut body) = body else {
            return Err(ApiError::invalid("The request body must be a JSON object."));
        };
        let mut passed = Map::new();
        for key in PASSED_THROUGH {
            if let Some(v) = body.remove(key) {
                passed.insert(key.to_string(), v);
            }
        }
        if !passed.contains_key("model") {
            return Err(ApiError::invalid_param("model", "`model` is required."));
        }
        for key in ACCEPTED {
            body.remove(key);
        }
        let (chat_tools, tools) = function_tools(body.remove("tools").unwrap_or(Value::Null))?;
        let (chat_tool_choice, tool_choice) = tool_choice(body.remove("tool_choice").unwrap_or(Value::Null))?;
        if body.remove("background").is_some_and(|b| b.as_bool() == Some(true)) {
            return Err(ApiError::invalid_param("background", "Background responses are not supported."));
        }
        if let Some(include) = body.remove("include")
            && !(include.is_null() || include.as_array().is_some_and(Vec::is_empty))
        {
            return Err(ApiError::invalid_param("include", "`include` is not supported."));
        }
        let truncation = match body.remove("truncation") {
            None | Some(Value::Null) => "disabled".to_string(),
            Some(Value::String(s)) if s == "disabled" => s,
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "truncation",
                    "Only `truncation: \"disabled\"` is supported: a prompt over the context is a 400.",
                ));
            }
        };
        let instructions = match body.remove("instructions") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s),
            Some(_) => return Err(ApiError::invalid_param("instructions", "`instructions` must be a string.")),
        };
        let input = body.remove("input").unwrap_or(Value::Null);
        let input_is_text = input.is_string();
        let input = input_messages(input)?;
        let max_output_tokens = match body.remove("max_output_tokens") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_i64().filter(|&n| n >= 1).ok_or_else(|| {
                ApiError::invalid_param("max_output_tokens", "`max_output_tokens` must be a positive integer.")
            })?),
        };
        let store = match body.remove("store") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => b,
            Some(_) => return Err(ApiError::invalid_param("store", "`store` must be a boolean.")),
        };
        let previous_response_id = match body.remove("previous_response_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(id)) if !id.is_empty() && id.len() <= MAX_ID_LEN => Some(id),
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "previous_response_id",
                    format!("`previous_response_id` must be a response id of 1 to {MAX_ID_LEN} characters."),
                ));
            }
        };
        let (text, response_format) = text_format(body.remove("text").unwrap_or(Value::Null))?;
        let metadata = metadata(body.remove("metadata").unwrap_or(Value::Null))?;
        Ok(ResponsesRequest {
            passed,
            instructions,
            input,
            input_is_text,
            max_output_tokens,
            store,
            previous_response_id,
            response_format,
            text,
            metadata,
            truncation,
            chat_tools,
            tools,
            chat_tool_choice,
            tool_choice,
        })
    }

    pub fn previous_response_id(&self) -> Option<&str> {
        self.previous_response_id.as_deref()
    }

    pub fn stream(&self) -> bool {
        self.passed.get("stream").and_then(Value::as_bool).unwrap_or(false)
    }

    /// The chat request body for this turn after `previous` (the earlier conversation, when there is one), and the
    /// response under way.
    pub fn into_chat(self, previous: Vec<Value>) -> (Value, PendingResponse) {
        let origins = MessageOrigins {
            instructions: self.instructions.is_some(),
            previous: previous.len(),
            input_is_text: self.input_is_text,
        };
        let mut conversation = previous;
        conversation.extend(self.input);
        let mut messages = Vec::with_capacity(conversation.len() + 1);
        if let Some(text) = &self.instructions {
            messages.push(json!({"role": "system", "content": text}));
        }
        messages.extend(conversation.iter().cloned());
        let mut chat = self.passed.clone();
        chat.insert("messages".into(), Value::Array(messages));
        if let Some(n) = self.max_output_tokens {
            chat.insert("max_tokens".into(), n.into());
        }
        if let Some(format) = self.response_format {
            chat.insert("response_format".into(), format);
        }
        if !self.chat_tools.is_empty() {
            chat.insert("tools".into(), Value::Array(self.chat_tools));
        }
        if let Some(choice) = self.chat_tool_choice {
            chat.insert("tool_choice".into(), choice);
        }
        let get = |key: &str| self.passed.get(key).cloned().unwrap_or(Value::Null);
        let pending = PendingResponse {
            id: new_response_id("resp"),
            message_id: new_response_id("msg"),
            call_id: new_response_id("call"),
            tool_call: None,
            created_at: crate::server::unix_now(),
            model: get("model"),
            store: self.store,
            conversation,
            origins,
            echo: json!({
                "instructions": self.instructions,
                "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata,
                "parallel_tool_calls": true,
                "previous_response_id": self.previous_response_id,
                "store": self.store,
                "temperature": get("temperature"),
                "text": self.text,
                "tool_choice": self.tool_choice,
                "tools": self.tools,
                "top_p": get("top_p"),
                "truncation": self.truncation,
                "user": get("user"),
            }),
        };
        (Value::Object(chat), pending)
    }
}

/// Where the chat messages of a turn came from, in order: the `instructions` (as a system message), the earlier
/// conversation (`previous_response_id`), then one message per item of this turn's `input`.
#[derive(Debug, Clone, Copy)]
struct MessageOrigins {
    instructions: bool,
    /// Messages of the earlier conversation.
    previous: usize,
    input_is_text: bool,
}

/// `messages[k]` and what follows it in a chat error's `param`.
fn message_param(param: &str) -> Option<(usize, &str)> {
    let rest = param.strip_prefix("messages[")?;
    let (k, rest) = rest.split_once(']')?;
    Some((k.parse().ok()?, rest))
}

impl MessageOrigins {
    /// The client's field for the chat path's `messages[k]` + `rest`; `conversation` is the earlier conversation
    /// followed by this turn's input, as chat messages.
    fn client_param(&self, k: usize, rest: &str, conversation: &[Value]) -> String {
        let Some(k) = k.checked_sub(usize::from(self.instructions)) else { return "instructions".into() };
        let Some(j) = k.checked_sub(self.previous) else { return "previous_response_id".into() };
        if self.input_is_text {
            return "input".into();
        }
        let message = conversation.get(k);
        let role = message.and_then(|m| m.get("role")).and_then(Value::as_str);
        let field = match role {
            // A `function_call_output` item: its `call_id` and `output` became the tool message's.
            Some("tool") if rest == ".tool_call_id" => ".call_id",
            Some("tool") if rest.starts_with(".content") => ".output",
            // A `function_call` item became an assistant message whose one call carries its name and arguments.
            Some("assistant") if message.is_some_and(|m| m.get("tool_calls").is_some()) => "",
            _ => rest,
        };
        format!("input[{j}]{field}")
    }
}

/// The chat request's error, as the Responses request's fields name it.
pub fn rename_param(mut e: ApiError) -> ApiError {
    let renamed = match e.param.as_deref() {
        Some("messages") => "input".to_string(),
        Some("max_tokens" | "max_completion_tokens") => "max_output_tokens".to_string(),
        Some("response_format") => "text.format".to_string(),
        // A Responses tool is flat: the chat tool's `tools[i].function.parameters` is its `tools[i].parameters`.
        Some(p) if p.starts_with("tools[") && p.contains(".function.") => p.replacen(".function.", ".", 1),
        _ => return e,
    };
    e.param = Some(renamed);
    e
}

/// `input`: a string (one user message) or a list of message items, as chat messages with text content.
fn input_messages(input: Value) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        Value::String(s) => return Ok(vec![json!({"role": "user", "content": s})]),
        Value::Array(items) if !items.is_empty() && items.len() <= MAX_INPUT_ITEMS => items,
        Value::Array(items) if !items.is_empty() => {
            return Err(ApiError::invalid_param("input", format!("At most {MAX_INPUT_ITEMS} input items.")));
        }
        Value::Null => return Err(ApiError::invalid_param("input", "`input` is required.")),
        _ => return Err(ApiError::invalid_param("input", "`input` must be a string or a non-empty list of items.")),
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let at = format!("input[{i}]");
            let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
            let text_of = |key: &str| {
                item.get(key).and_then(Value::as_str).map(str::to_owned).ok_or_else(|| {
                    ApiError::invalid_param(format!("{at}.{key}"), format!("A `{kind}` item needs a string `{key}`."))
                })
            };
            match kind {
                "message" => {}
                "function_call" => {
                    let (call_id, name, arguments) = (text_of("call_id")?, text_of("name")?, text_of("arguments")?);
                    return Ok(function_call_message(&call_id, &name, &arguments));
                }
                "function_call_output" => {
                    let (call_id, output) = (text_of("call_id")?, text_of("output")?);
                    return Ok(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
                }
                _ => {
                    return Err(ApiError::invalid_param(
                        format!("{at}.type"),
                        format!(
                            "Input items of type `{kind}` are not supported; messages, function_call and \
                             function_call_output are."
                        ),
                    ));
                }
            }
            let role = match item.get("role").and_then(Value::as_str) {
                Some(r @ ("user" | "system" | "developer" | "assistant")) => r,
                _ => {
                    return Err(ApiError::invalid_param(
                        format!("{at}.role"),
                        "A message's `role` must be one of user, system, developer, assistant.",
                    ));
                }
            };
            let content = message_text(item.get("content"), &at)?;
            Ok(json!({"role": role, "content": content}))
        })
        .collect()
}

/// A message's content as one string: a string, or text parts (`input_text`, `output_text`, or chat's `text`).
fn message_text(content: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                match (kind, part.get("text").and_then(Value::as_str)) {
                    ("input_text" | "output_text" | "text", Some(t)) => text.push_str(t),
                    _ => {
                        return Err(ApiError::invalid_param(
                            format!("{at}.content[{j}]"),
                            format!(
                                "Content parts of type `{kind}` are not supported; only text parts \
                                 (input_text, output_text) are."
                            ),
                        ));
                    }
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::invalid_param(
            format!("{at}.content"),
            "A message's `content` must be a string or a list of text parts.",
        )),
    }
}

/// `text.format` → (what the response repeats as `text`, the chat request's `response_format`).
fn text_format(text: Value) -> Result<(Value, Option<Value>), ApiError> {
    let plain = json!({"format": {"type": "text"}});
    let format = match &text {
        Value::Null => return Ok((plain, None)),
        Value::Object(o) => match o.get("format") {
            None | Some(Value::Null) => return Ok((plain, None)),
            Some(f) => f.clone(),
        },
        _ => return Err(ApiError::invalid_param("text", "`text` must be an object.")),
    };
    let bad = |msg: &str| ApiError::invalid_param("text.format", msg.to_string());
    let response_format = match format.get("type").and_then(Value::as_str) {
        Some("text") => None,
        Some("json_object") => Some(json!({"type": "json_object"})),
        Some("json_schema") => {
            let schema = format.get("schema").ok_or_else(|| bad("A `json_schema` format needs a `schema`."))?;
            let name = format.get("name").and_then(Value::as_str).unwrap_or("response");
            Some(json!({"type": "json_schema", "json_schema": {"name": name, "schema": schema}}))
        }
        _ => return Err(bad("`text.format.type` must be text, json_object or json_schema.")),
    };
    Ok((json!({"format": format}), response_format))
}

/// `tools`: function tools only (`{"type": "function", "name", "description", "parameters"}`), in the chat
/// request's form (whose validation bounds their number and names) and as given.
fn function_tools(tools: Value) -> Result<(Vec<Value>, Vec<Value>), ApiError> {
    let tools = match tools {
        Value::Null => return Ok((Vec::new(), Vec::new())),
        Value::Array(tools) => tools,
        _ => return Err(ApiError::invalid_param("tools", "`tools` must be a list.")),
    };
    let mut chat = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let name = tool.get("name").filter(|_| tool.get("type").and_then(Value::as_str) == Some("function"));
        let Some(name) = name else {
            return Err(ApiError::invalid_param(
                format!("tools[{i}]"),
                "Only function tools are supported: {\"type\": \"function\", \"name\": ..., \"parameters\": {...}}.",
            ));
        };
        let mut function = Map::new();
        function.insert("name".into(), name.clone());
        for key in ["description", "parameters"] {
            if let Some(v) = tool.get(key).filter(|v| !v.is_null()) {
                function.insert(key.into(), v.clone());
            }
        }
        chat.push(json!({"type": "function", "function": function}));
    }
    Ok((chat, tools))
}

/// `tool_choice`: `none`, `auto`, `required` or `{"type": "function", "name": ...}`, in the chat request's form
/// (which decides what it can serve) and as the response repeats it (default `auto`).
fn tool_choice(choice: Value) -> Result<(Option<Value>, Value), ApiError> {
    match &choice {
        Value::Null => Ok((None, json!("auto"))),
        Value::String(s) if matches!(s.as_str(), "none" | "auto" | "required") => Ok((Some(choice.clone()), choice)),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name").cloned().unwrap_or(Value::Null);
            Ok((Some(json!({"type": "function", "function": {"name": name}})), choice))
        }
        _ => Err(ApiError::invalid_param(
            "tool_choice",
            "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"name\": ...}.",
        )),
    }
}

/// An assistant turn that called `name` with `arguments` (the chat path's form).
fn function_call_message(call_id: &str, name: &str, arguments: &str) -> Value {
    json!({"role": "assistant", "content": null,
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]})
}

/// `metadata`: at most 16 string pairs, keys up to 64 and values up to 512 characters (OpenAI's bounds).
fn metadata(metadata: Value) -> Result<Value, ApiError> {
    let bad = || {
        ApiError::invalid_param(
            "metadata",
            format!(
                "`metadata` must be an object of at most {MAX_METADATA_PAIRS} string values, keys up to \
                 {MAX_METADATA_KEY} and values up to {MAX_METADATA_VALUE} characters."
            ),
        )
    };
    match &metadata {
        Value::Null => Ok(json!({})),
        Value::Object(o)
            if o.len() <= MAX_METADATA_PAIRS
                && o.iter().all(|(k, v)| {
                    k.chars().count() <= MAX_METADATA_KEY
                        && v.as_str().is_some_and(|s| s.chars().count() <= MAX_METADATA_VALUE)
                }) =>
        {
            Ok(metadata)
        }
        _ => Err(bad()),
    }
}

/// A response being generated: its ids, the conversation so far, and what its object repeats of the request.
#[derive(Debug, Clone)]
pub struct PendingResponse {
    pub id: String,
    message_id: String,
    /// The `call_id` of the answer's function call, when it is one.
    call_id: String,
    /// The function the answer calls (the chat path's forced call), or `None` for a message.
    tool_call: Option<String>,
    created_at: u64,
    model: Value,
    store: bool,
    /// The conversation without `instructions`, up to this turn's input.
    conversation: Vec<Value>,
    /// Where the chat request's messages came from, to name the client's field in its errors.
    origins: MessageOrigins,
    echo: Value,
}

impl PendingResponse {
    /// The chat path's error, as this request's fields name it: [`rename_param`], and a `messages[k]` of the
    /// translated chat mapped back to the `input[j]` item (or the `instructions`, or the earlier conversation) it
    /// came from, in `param` and in the message.
    pub fn rename_param(&self, e: ApiError) -> ApiError {
        let Some((k, rest)) = e.param.as_deref().and_then(message_param) else { return rename_param(e) };
        let chat_param = format!("messages[{k}]{rest}");
        let param = self.origins.client_param(k, rest, &self.conversation);
        let message = e.message.replace(&chat_param, &param);
        ApiError { param: Some(param), message, ..e }
    }

    /// The answer calls `name` (the chat request's forced function call): its output is a `function_call` item.
    pub fn set_tool_call(&mut self, name: Option<String>) {
        self.tool_call = name;
    }

    /// The response object. `answer`: the output text and finish reason, once there is one; `usage` at the end.
    pub fn object(&self, status: &str, answer: Option<(&str, &str)>, usage: Option<&Usage>) -> Value {
        let mut o = self.echo.clone();
        let output = match answer {
            Some((text, _)) => vec![self.output_item(text, "completed")],
            None => Vec::new(),
        };
        let incomplete =
            answer.filter(|(_, finish)| *finish == "length").map(|_| json!({"reason": "max_output_tokens"}));
        let fields = [
            ("id", json!(self.id)),
            ("object", json!("response")),
            ("created_at", json!(self.created_at)),
            ("status", json!(status)),
            ("error", Value::Null),
            ("incomplete_details", incomplete.unwrap_or(Value::Null)),
            ("model", self.model.clone()),
            ("output", Value::Array(output)),
            ("usage", usage.map_or(Value::Null, usage_object)),
        ];
        if let Value::Object(map) = &mut o {
            for (k, v) in fields {
                map.insert(k.into(), v);
            }
        }
        o
    }

    /// The status an answer that ended for `finish_reason` gives its response.
    pub fn status_of(finish_reason: &str) -> &'static str {
        if finish_reason == "length" { "incomplete" } else { "completed" }
    }

    /// The final response object, and what the store keeps of it (`None` with `store: false`, built only when
    /// kept).
    pub fn finish(&self, text: &str, finish_reason: &str, usage: &Usage) -> (Value, Option<Stored>) {
        let response = self.object(Self::status_of(finish_reason), Some((text, finish_reason)), Some(usage));
        if !self.store {
            return (response, None);
        }
        let mut conversation = self.conversation.clone();
        conversation.push(match &self.tool_call {
            Some(name) => function_call_message(&self.call_id, name, text),
            None => json!({"role": "assistant", "content": text}),
        });
        (response.clone(), Some(Stored { conversation, response }))
    }

    /// The answer's output item: a `function_call` when the answer calls a function, else a `message`.
    fn output_item(&self, text: &str, status: &str) -> Value {
        match &self.tool_call {
            Some(name) => json!({
                "id": self.message_id,
                "type": "function_call",
                "status": status,
                "call_id": self.call_id,
                "name": name,
                "arguments": text,
            }),
            None => self.message_item(text, status),
        }
    }

    fn message_item(&self, text: &str, status: &str) -> Value {
        json!({
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        })
    }
}

fn usage_object(u: &Usage) -> Value {
    let cached = u.cached_tokens();
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    })
}

/// The named events of a streamed response (`event:` name, `data:` JSON), each with its sequence number.
#[derive(Debug)]
pub struct ResponseEvents {
    pending: PendingResponse,
    text: String,
    sequence: u64,
}

/// One server-sent event: its name and its JSON.
pub type NamedEvent = (&'static str, String);

impl ResponseEvents {
    pub fn new(pending: PendingResponse) -> ResponseEvents {
        ResponseEvents { pending, text: String::new(), sequence: 0 }
    }

    /// The response's id.
    pub fn id(&self) -> &str {
        &self.pending.id
    }

    fn event(&mut self, name: &'static str, mut body: Value) -> NamedEvent {
        if let Value::Object(map) = &mut body {
            map.insert("type".into(), json!(name));
            map.insert("sequence_number".into(), json!(self.sequence));
        }
        self.sequence += 1;
        (name, body.to_string())
    }

    /// The response is created, in progress, and its output item is open (a message with its text part, or a
    /// function call).
    pub fn start(&mut self) -> Vec<NamedEvent> {
        let response = self.pending.object("in_progress", None, None);
        let item_id = self.pending.message_id.clone();
        let mut events = vec![
            self.event("response.created", json!({"response": response})),
            self.event("response.in_progress", json!({"response": response})),
        ];
        if self.pending.tool_call.is_some() {
            let item = self.pending.output_item("", "in_progress");
            events.push(self.event("response.output_item.added", json!({"output_index": 0, "item": item})));
            return events;
        }
        let item = json!({"id": item_id, "type": "message", "status": "in_progress", "role": "assistant",
            "content": []});
        let part = json!({"type": "output_text", "text": "", "annotations": []});
        events.push(self.event("response.output_item.added", json!({"output_index": 0, "item": item})));
        events.push(self.event(
            "response.content_part.added",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part}),
        ));
        events
    }

    /// Text released by the generation: the message's text, or the call's arguments.
    pub fn delta(&mut self, text: &str) -> Vec<NamedEvent> {
        if text.is_empty() {
            return Vec::new();
        }
        self.text.push_str(text);
        let item_id = &self.pending.message_id;
        let (name, body) = if self.pending.tool_call.is_some() {
            ("response.function_call_arguments.delta", json!({"item_id": item_id, "output_index": 0, "delta": text}))
        } else {
            let body =
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": text, "logprobs": []});
            ("response.output_text.delta", body)
        };
        vec![self.event(name, body)]
    }

    /// The generation ended: the text and part (or the call's arguments) and the item close, then
    /// `response.completed` (or `response.incomplete` when it ran out of `max_output_tokens`). Returns the events
    /// and what the store keeps.
    pub fn done(&mut self, finish_reason: &str, usage: &Usage) -> (Vec<NamedEvent>, Option<Stored>) {
        let text = std::mem::take(&mut self.text);
        let (response, stored) = self.pending.finish(&text, finish_reason, usage);
        let item = self.pending.output_item(&text, "completed");
        let item_id = self.pending.message_id.clone();
        let last = if finish_reason == "length" { "response.incomplete" } else { "response.completed" };
        let mut events = Vec::with_capacity(4);
        if let Some(name) = self.pending.tool_call.clone() {
            events.push(self.event(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": 0, "name": name, "arguments": text}),
            ));
        } else {
            let part = json!({"type": "output_text", "text": text, "annotations": []});
            events.push(self.event(
                "response.output_text.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
            ));
            events.push(self.event(
                "response.content_part.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part}),
            ));
        }
        events.push(self.event("response.output_item.done", json!({"output_index": 0, "item": item})));
        events.push(self.event(last, json!({"response": response})));
        (events, stored)
    }

    /// The generation failed: an `error` event, then `response.failed`.
    pub fn failed(&mut self, e: &ApiError) -> Vec<NamedEvent> {
        let mut response = self.pending.object("failed", None, None);
        let error = json!({"code": e.code.unwrap_or(e.kind), "message": e.message});
        if let Value::Object(map) = &mut response {
            map.insert("error".into(), error);
        }
        vec![
            self.event("error", json!({"code": e.code, "message": e.message, "param": e.param})),
            self.event("response.failed", json!({"response": response})),
        ]
    }
}

/// A stored response: its conversation (for `previous_response_id`) and its object (for `GET`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stored {
    conversation: Vec<Value>,
    response: Value,
}

/// [`Stored`] borrowed, to encode without copying it.
#[derive(Serialize)]
struct StoredRef<'a> {
    conversation: &'a [Value],
    response: &'a Value,
}

impl Stored {
    fn as_ref(&self) -> StoredRef<'_> {
        StoredRef { conversation: &self.conversation, response: &self.response }
    }

    fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(&self.as_ref()).unwrap_or_default()
    }

    fn from_bytes(bytes: &[u8]) -> Option<Stored> {
        serde_json::from_slice(bytes).ok()
    }

    /// Its size as JSON, what the stores' byte bounds count, measured without building the text.
    fn size(&self) -> usize {
        struct Count(usize);
        impl std::io::Write for Count {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0 += buf.len();
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut count = Count(0);
        let _ = serde_json::to_writer(&mut count, &self.as_ref());
        count.0
    }
}

/// Keys kept per tenant, each tenant's oldest first, with their sizes, bounded in count and bytes over all tenants.
/// Past a bound, the tenant holding the most (responses for the count, bytes for the bytes) gives up its oldest, the
/// tenant storing now losing ties: a tenant that stores a lot evicts its own responses before anyone else's, and
/// every tenant keeps at least an equal share of the store whatever the others store. The local store and the
/// shared store's record of what this router wrote both bound themselves with it.
#[derive(Debug)]
struct TenantShares {
    tenants: BTreeMap<Arc<str>, TenantKeys>,
    count: usize,
    bytes: usize,
    max_keys: usize,
    max_bytes: usize,
}

/// One tenant's keys, oldest first, with their sizes.
#[derive(Debug, Default)]
struct TenantKeys {
    keys: VecDeque<(String, usize)>,
    bytes: usize,
}

impl TenantShares {
    fn new(max_keys: usize, max_bytes: usize) -> TenantShares {
        TenantShares { tenants: BTreeMap::new(), count: 0, bytes: 0, max_keys, max_bytes }
    }

    /// Keeps `tenant`'s `key` of `size` bytes and returns the keys to drop so that both bounds hold (which may be
    /// `key` itself, when `tenant` already holds the most); `None` (nothing kept) for one that could never fit.
    fn keep(&mut self, tenant: &Arc<str>, key: String, size: usize) -> Option<Vec<String>> {
        if size > self.max_bytes || self.max_keys == 0 {
            return None;
        }
        let own = self.tenants.entry(tenant.clone()).or_default();
        own.keys.push_back((key, size));
        own.bytes += size;
        self.count += 1;
        self.bytes += size;
        let mut dropped = Vec::new();
        while self.count > self.max_keys || self.bytes > self.max_bytes {
            let by_bytes = self.count <= self.max_keys;
            let Some(victim) = self.largest(tenant, by_bytes) else { break };
            let Some(keys) = self.tenants.get_mut(&victim) else { break };
            let Some((old, n)) = keys.keys.pop_front() else { break };
            keys.bytes -= n;
            if keys.keys.is_empty() {
                self.tenants.remove(&victim);
            }
            self.count -= 1;
            self.bytes -= n;
            dropped.push(old);
        }
        Some(dropped)
    }

    /// The tenant holding the most bytes (`by_bytes`) or responses; `storing` on a tie.
    fn largest(&self, storing: &str, by_bytes: bool) -> Option<Arc<str>> {
        let held = |k: &TenantKeys| if by_bytes { k.bytes } else { k.keys.len() };
        self.tenants.iter().max_by_key(|(t, k)| (held(k), &***t == storing)).map(|(t, _)| t.clone())
    }

    fn forget(&mut self, tenant: &str, key: &str) {
        let Some(keys) = self.tenants.get_mut(tenant) else { return };
        if let Some((_, n)) = keys.keys.iter().position(|(k, _)| k == key).and_then(|at| keys.keys.remove(at)) {
            keys.bytes -= n;
            self.count -= 1;
            self.bytes -= n;
        }
        if keys.keys.is_empty() {
            self.tenants.remove(tenant);
        }
    }

    /// Responses held by `tenant`.
    #[cfg(test)]
    fn held(&self, tenant: &str) -> usize {
        self.tenants.get(tenant).map_or(0, |k| k.keys.len())
    }
}

/// Whether `id` can be a response id: 1 to 128 of `[A-Za-z0-9_-]` (what this router hands out is `resp_` and hex).
/// Anything else is not found without a lookup, so an id never reaches an etcd key unchecked.
fn is_response_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_ID_LEN && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn previous_not_found(id: &str) -> ApiError {
    let shown: String = id.chars().take(MAX_ID_LEN).collect();
    ApiError {
        code: Some("previous_response_not_found"),
        ..ApiError::invalid_param("previous_response_id", format!("Previous response with id '{shown}' not found."))
    }
}

/// Where stored responses live.
pub enum ResponseBackend {
    /// This router's memory.
    Local(Mutex<ResponseStore>),
    /// etcd, shared by every router of the cluster.
    Shared(Box<SharedResponses>),
}

impl Default for ResponseBackend {
    fn default() -> ResponseBackend {
        ResponseBackend::Local(Mutex::new(ResponseStore::default()))
    }
}

impl ResponseBackend {
    /// Responses in etcd under `<cfg.prefix>/responses/`.
    pub fn shared(cfg: RegistryConfig) -> ResponseBackend {
        ResponseBackend::Shared(Box::new(SharedResponses::new(cfg)))
    }

    /// The local store. A poisoned lock still holds a consistent store (every update completes before it unlocks).
    fn local(store: &Mutex<ResponseStore>) -> std::sync::MutexGuard<'_, ResponseStore> {
        store.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps `stored` as `tenant`'s response `id`. A failure to store is logged, not the request's failure: the
    /// answer stands, and a follow-up naming it is then a clear 400.
    pub async fn insert(&self, tenant: Arc<str>, id: String, stored: Stored) {
        match self {
            ResponseBackend::Local(store) => Self::local(store).insert(tenant, id, stored),
            ResponseBackend::Shared(shared) => shared.insert(&tenant, &id, &stored).await,
        }
    }

    /// The conversation of `tenant`'s response `id`, for a follow-up turn.
    pub async fn conversation(&self, tenant: &str, id: &str) -> Result<Vec<Value>, ApiError> {
        match self {
            ResponseBackend::Local(store) => Self::local(store).conversation(tenant, id),
            ResponseBackend::Shared(shared) => {
                shared.get(tenant, id).await?.map(|s| s.conversation).ok_or_else(|| previous_not_found(id))
            }
        }
    }

    /// `tenant`'s response `id`, as `GET /v1/responses/{id}` returns it.
    pub async fn response(&self, tenant: &str, id: &str) -> Result<Value, ApiError> {
        match self {
            ResponseBackend::Local(store) => Self::local(store).response(tenant, id),
            ResponseBackend::Shared(shared) => {
                shared.get(tenant, id).await?.map(|s| s.response).ok_or_else(|| not_found(id))
            }
        }
    }

    /// Deletes `tenant`'s response `id`.
    pub async fn delete(&self, tenant: &str, id: &str) -> Result<Value, ApiError> {
        match self {
            ResponseBackend::Local(store) => Self::local(store).delete(tenant, id),
            ResponseBackend::Shared(shared) => {
                if !shared.delete(tenant, id).await? {
                    return Err(not_found(id));
                }
                Ok(json!({"id": id, "object": "response", "deleted": true}))
            }
        }
    }
}

/// Responses in etcd, one document each under `<tenant>/<id>`, on leases of [`SHARED_RESPONSE_TTL`]. What this
/// router wrote is bounded as the local store is ([`MAX_STORED_RESPONSES`], [`MAX_STORED_BYTES`], shared out
/// between tenants): beyond it, it deletes the oldest of the tenant holding the most, so the registry's etcd never
/// fills with conversations and one tenant's traffic cannot push out another's.
pub struct SharedResponses {
    docs: DocumentStore,
    /// Keys this router wrote, per tenant, oldest first (locked only between awaits).
    written: Mutex<TenantShares>,
}

impl SharedResponses {
    fn new(cfg: RegistryConfig) -> SharedResponses {
        SharedResponses {
            docs: DocumentStore::new(cfg, "responses", SHARED_RESPONSE_TTL),
            written: Mutex::new(TenantShares::new(MAX_STORED_RESPONSES, MAX_STORED_BYTES)),
        }
    }

    fn written(&self) -> std::sync::MutexGuard<'_, TenantShares> {
        self.written.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn unavailable(e: pagoda_registry::RegistryError) -> ApiError {
        ApiError::unavailable(format!("The response store (etcd) is unavailable: {e}."))
    }

    async fn insert(&self, tenant: &Arc<str>, id: &str, stored: &Stored) {
        let bytes = stored.to_bytes();
        if bytes.len() > MAX_DOCUMENT_BYTES {
            tracing::warn!(id, bytes = bytes.len(), "response too large to share; not stored");
            return;
        }
        let key = format!("{tenant}/{id}");
        let size = bytes.len();
        if let Err(e) = self.docs.put(&key, bytes).await {
            tracing::warn!(id, error = %e, "storing the response in etcd failed");
            return;
        }
        let evicted = self.written().keep(tenant, key, size).unwrap_or_default();
        for old in evicted {
            if let Err(e) = self.docs.delete(&old).await {
                tracing::warn!(key = old, error = %e, "deleting an old shared response failed; its lease expires it");
            }
        }
    }

    async fn get(&self, tenant: &str, id: &str) -> Result<Option<Stored>, ApiError> {
        if !is_response_id(id) {
            return Ok(None);
        }
        let bytes = self.docs.get(&format!("{tenant}/{id}")).await.map_err(Self::unavailable)?;
        Ok(bytes.and_then(|b| Stored::from_bytes(&b)))
    }

    async fn delete(&self, tenant: &str, id: &str) -> Result<bool, ApiError> {
        if !is_response_id(id) {
            return Ok(false);
        }
        let key = format!("{tenant}/{id}");
        let deleted = self.docs.delete(&key).await.map_err(Self::unavailable)?;
        self.written().forget(tenant, &key);
        Ok(deleted)
    }
}

/// Stored responses, bounded in count and bytes and shared out between tenants (`TenantShares`): past a bound,
/// the oldest of the tenant holding the most goes. Each is visible to its tenant only.
#[derive(Debug)]
pub struct ResponseStore {
    entries: HashMap<String, (Arc<str>, Stored)>,
    oldest: TenantShares,
}

impl Default for ResponseStore {
    fn default() -> ResponseStore {
        ResponseStore::new(MAX_STORED_RESPONSES, MAX_STORED_BYTES)
    }
}

impl ResponseStore {
    pub fn new(max_entries: usize, max_bytes: usize) -> ResponseStore {
        ResponseStore { entries: HashMap::new(), oldest: TenantShares::new(max_entries, max_bytes) }
    }

    /// Keeps `stored` under `id` for `tenant`, evicting as needed: the oldest of whichever tenant holds the most.
    /// One larger than the whole store is not kept (a later `previous_response_id` naming it is then not found).
    pub fn insert(&mut self, tenant: Arc<str>, id: String, stored: Stored) {
        let Some(evicted) = self.oldest.keep(&tenant, id.clone(), stored.size()) else { return };
        // Inserted first: the eviction may be of this very entry (its tenant already holds the most bytes).
        self.entries.insert(id, (tenant, stored));
        for old in evicted {
            self.entries.remove(&old);
        }
    }

    fn get(&self, tenant: &str, id: &str) -> Option<&Stored> {
        self.entries.get(id).filter(|(owner, _)| &**owner == tenant).map(|(_, s)| s)
    }

    /// The conversation of `tenant`'s response `id`, for a follow-up turn.
    pub fn conversation(&self, tenant: &str, id: &str) -> Result<Vec<Value>, ApiError> {
        self.get(tenant, id).map(|s| s.conversation.clone()).ok_or_else(|| previous_not_found(id))
    }

    /// `tenant`'s response `id`, as `GET /v1/responses/{id}` returns it.
    pub fn response(&self, tenant: &str, id: &str) -> Result<Value, ApiError> {
        self.get(tenant, id).map(|s| s.response.clone()).ok_or_else(|| not_found(id))
    }

    /// Deletes `tenant`'s response `id`.
    pub fn delete(&mut self, tenant: &str, id: &str) -> Result<Value, ApiError> {
        if self.get(tenant, id).is_none() {
            return Err(not_found(id));
        }
        self.entries.remove(id);
        self.oldest.forget(tenant, id);
        Ok(json!({"id": id, "object": "response", "deleted": true}))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// 404 for a response id this tenant has not stored (or that was evicted).
fn not_found(id: &str) -> ApiError {
    let shown: String = id.chars().take(MAX_ID_LEN).collect();
    ApiError {
        status: axum::http::StatusCode::NOT_FOUND,
        code: Some("response_not_found"),
        ..ApiError::invalid(format!("Response with id '{shown}' not found."))
    }
}

/// A random id `<prefix>_<32 hex digits>` (responses, their items, Anthropic's messages and tool uses).
pub(crate) fn new_response_id(prefix: &str) -> String {
    format!("{prefix}_{:032x}", rand::random::<u128>())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: Value) -> Result<ResponsesRequest, ApiError> {
        ResponsesRequest::parse(body)
    }

    #[test]
    fn a_string_input_with_instructions_becomes_a_system_and_a_user_message() {
        let r = parse(json!({"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7,
            "temperature": 0, "seed": 3, "stream": true, "metadata": {"k": "v"}}))
        .unwrap();
        assert!(r.stream());
        let (chat, pending) = r.into_chat(Vec::new());
        assert_eq!(
            chat["messages"],
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
        );
        assert_eq!(
            (chat["max_tokens"].clone(), chat["seed"].clone(), chat["temperature"].clone()),
            (json!(7), json!(3), json!(0))
        );
        assert!(chat.get("instructions").is_none() && chat.get("metadata").is_none());
        let o = pending.object("in_progress", None, None);
        assert_eq!(
            (o["object"].clone(), o["status"].clone(), o["metadata"].clone()),
            (json!("response"), json!("in_progress"), json!({"k": "v"}))
        );
        assert!(pending.id.starts_with("resp_"));
    }

    #[test]
    fn items_and_text_parts_become_chat_messages_after_the_previous_conversation() {
        let r = parse(json!({"model": "m", "input": [
            {"role": "developer", "content": "Rules."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        ]}))
        .unwrap();
        let earlier = vec![json!({"role": "user", "content": "x"}), json!({"role": "assistant", "content": "y"})];
        let (chat, pending) = r.into_chat(earlier);
        assert_eq!(chat["messages"].as_array().unwrap().len(), 4);
        assert_eq!(chat["messages"][3], json!({"role": "user", "content": "ab"}));
        let usage = Usage::new(10, 2, 4);
        let (response, stored) = pending.finish("z", "stop", &usage);
        let stored = stored.expect("stored by default");
        assert_eq!(response["status"], "completed");
        assert_eq!(response["output"][0]["content"][0]["text"], "z");
        assert_eq!(response["usage"]["input_tokens_details"]["cached_tokens"], 4);
        assert_eq!(stored.conversation.len(), 5, "earlier turns, this input, the answer");
        assert_eq!(stored.conversation[4], json!({"role": "assistant", "content": "z"}));
        let (cut, _) = pending.finish("z", "length", &usage);
        let unstored = parse(json!({"model": "m", "input": "q", "store": false})).unwrap().into_chat(Vec::new()).1;
        assert!(unstored.finish("z", "stop", &usage).1.is_none(), "store: false keeps nothing");
        assert_eq!(
            (cut["status"].clone(), cut["incomplete_details"]["reason"].clone()),
            (json!("incomplete"), json!("max_output_tokens"))
        );
    }

    #[test]
    fn text_format_maps_to_response_format() {
        let schema = json!({"type": "object"});
        let r = parse(json!({"model": "m", "input": "q", "text": {"format": {"type": "json_schema", "name": "n", "schema": schema}}})).unwrap();
        let (chat, _) = r.into_chat(Vec::new());
        assert_eq!(
            chat["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
        );
        let r = parse(json!({"model": "m", "input": "q", "text": {"format": {"type": "json_object"}}})).unwrap();
        assert_eq!(r.into_chat(Vec::new()).0["response_format"], json!({"type": "json_object"}));
        let r = parse(json!({"model": "m", "input": "q", "text": {"format": {"type": "text"}}})).unwrap();
        assert!(r.into_chat(Vec::new()).0.get("response_format").is_none());
    }

    #[test]
    fn what_is_not_served_is_a_400_naming_its_field() {
        let cases = [
            (json!({"input": "q"}), "model"),
            (json!({"model": "m"}), "input"),
            (json!({"model": "m", "input": []}), "input"),
            (json!({"model": "m", "input": 5}), "input"),
            (json!({"model": "m", "input": [{"role": "tool", "content": "x"}]}), "input[0].role"),
            (json!({"model": "m", "input": [{"type": "reasoning", "summary": []}]}), "input[0].type"),
            (json!({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}), "input[0].call_id"),
            (
                json!({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f"}]}),
                "input[0].arguments",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
                "input[0].content[0]",
            ),
            (json!({"model": "m", "input": [{"role": "user"}]}), "input[0].content"),
            (json!({"model": "m", "input": "q", "tools": [{"type": "web_search"}]}), "tools[0]"),
            (json!({"model": "m", "input": "q", "tools": {"type": "function"}}), "tools"),
            (json!({"model": "m", "input": "q", "tool_choice": {"type": "web_search"}}), "tool_choice"),
            (json!({"model": "m", "input": "q", "background": true}), "background"),
            (json!({"model": "m", "input": "q", "include": ["x"]}), "include"),
            (json!({"model": "m", "input": "q", "truncation": "auto"}), "truncation"),
            (json!({"model": "m", "input": "q", "max_output_tokens": 0}), "max_output_tokens"),
            (json!({"model": "m", "input": "q", "store": "yes"}), "store"),
            (json!({"model": "m", "input": "q", "previous_response_id": ""}), "previous_response_id"),
            (json!({"model": "m", "input": "q", "previous_response_id": "x".repeat(200)}), "previous_response_id"),
            (json!({"model": "m", "input": "q", "text": {"format": {"type": "xml"}}}), "text.format"),
            (json!({"model": "m", "input": "q", "text": {"format": {"type": "json_schema"}}}), "text.format"),
            (json!({"model": "m", "input": "q", "metadata": {"k": 1}}), "metadata"),
            (json!({"model": "m", "input": "q", "instructions": 3}), "instructions"),
        ];
        for (body, param) in cases {
            let e = parse(body.clone()).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{body}");
        }
        let many: Vec<Value> = (0..=MAX_INPUT_ITEMS).map(|_| json!({"role": "user", "content": "x"})).collect();
        assert_eq!(parse(json!({"model": "m", "input": many})).unwrap_err().param.as_deref(), Some("input"));
        let big: Map<String, Value> = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
        assert!(parse(json!({"model": "m", "input": "q", "metadata": big})).is_err());
        assert!(parse(json!("not an object")).is_err());
        // Accepted and without effect: empty tools, tool_choice none, reasoning, unknown fields.
        assert!(
            parse(json!({"model": "m", "input": "q", "tools": [], "tool_choice": "none", "reasoning": {},
            "parallel_tool_calls": false, "made_up": 1}))
            .is_ok()
        );
        assert_eq!(
            rename_param(ApiError::invalid_param("max_tokens", "x")).param.as_deref(),
            Some("max_output_tokens")
        );
        assert_eq!(rename_param(ApiError::invalid_param("messages", "x")).param.as_deref(), Some("input"));
    }

    /// Streams `deltas` through `ev` to a normal end: every event, and what the store keeps.
    fn stream(ev: &mut ResponseEvents, deltas: &[&str], usage: Usage) -> (Vec<NamedEvent>, Stored) {
        let mut all = ev.start();
        for d in deltas {
            all.extend(ev.delta(d));
        }
        let (end, stored) = ev.done("stop", &usage);
        all.extend(end);
        (all, stored.expect("stored by default"))
    }

    #[test]
    fn function_tools_and_call_items_map_to_the_chat_paths_forced_calls() {
        let params = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let r = parse(json!({"model": "m", "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ], "tools": [{"type": "function", "name": "weather", "description": "d", "parameters": params, "strict": true}],
            "tool_choice": {"type": "function", "name": "weather"}}))
        .unwrap();
        let (chat, mut pending) = r.into_chat(Vec::new());
        assert_eq!(
            chat["tools"],
            json!([{"type": "function", "function": {"name": "weather", "description": "d", "parameters": params}}])
        );
        assert_eq!(chat["tool_choice"], json!({"type": "function", "function": {"name": "weather"}}));
        assert_eq!(chat["messages"][1]["tool_calls"][0]["function"]["name"], "weather");
        assert_eq!(chat["messages"][1]["content"], Value::Null);
        assert_eq!(chat["messages"][2], json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}));
        pending.set_tool_call(Some("weather".into()));
        let o = pending.object("in_progress", None, None);
        assert_eq!(
            (o["tool_choice"]["name"].as_str(), o["tools"][0]["strict"].as_bool()),
            (Some("weather"), Some(true))
        );
        let mut ev = ResponseEvents::new(pending.clone());
        let (all, stored) = stream(&mut ev, &["{\"city\":", "\"Lyon\"}"], Usage::new(5, 4, 0));
        let names: Vec<&str> = all.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        let item = &stored.response["output"][0];
        assert_eq!(
            (item["type"].as_str(), item["name"].as_str(), item["arguments"].as_str()),
            (Some("function_call"), Some("weather"), Some("{\"city\":\"Lyon\"}"))
        );
        assert!(item["call_id"].as_str().unwrap().starts_with("call_"));
        let last = stored.conversation.last().unwrap();
        assert_eq!(last["tool_calls"][0]["id"], item["call_id"], "a follow-up answers the call by its call_id");
        // Without tools, the echo says auto and nothing goes to the chat request.
        let (chat, pending) = parse(json!({"model": "m", "input": "q"})).unwrap().into_chat(Vec::new());
        assert!(chat.get("tools").is_none() && chat.get("tool_choice").is_none());
        assert_eq!(pending.object("in_progress", None, None)["tool_choice"], "auto");
        let e = rename_param(ApiError::invalid_param("tools[0].function.parameters", "x"));
        assert_eq!(e.param.as_deref(), Some("tools[0].parameters"));
    }

    #[test]
    fn events_carry_sequence_numbers_and_end_with_the_final_response() {
        let r = parse(json!({"model": "m", "input": "q"})).unwrap();
        let (_, pending) = r.into_chat(Vec::new());
        let mut ev = ResponseEvents::new(pending);
        let (all, stored) = stream(&mut ev, &["Hel", "", "lo"], Usage::new(3, 2, 0));
        let names: Vec<&str> = all.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, (name, data)) in all.iter().enumerate() {
            let v: Value = serde_json::from_str(data).unwrap();
            assert_eq!((v["type"].as_str(), v["sequence_number"].as_u64()), (Some(*name), Some(i as u64)));
        }
        let last: Value = serde_json::from_str(&all[9].1).unwrap();
        assert_eq!(last["response"]["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(stored.response, last["response"]);
        let failed = ev.failed(&ApiError::unavailable("gone"));
        assert_eq!((failed[0].0, failed[1].0), ("error", "response.failed"));
        let v: Value = serde_json::from_str(&failed[1].1).unwrap();
        assert_eq!(
            (v["response"]["status"].as_str(), v["response"]["error"]["message"].as_str()),
            (Some("failed"), Some("gone"))
        );
    }

    #[test]
    fn a_stored_response_round_trips_through_its_shared_form_and_ids_are_checked() {
        let stored = Stored {
            conversation: vec![json!({"role": "user", "content": "q"})],
            response: json!({"id": "resp_1", "output": []}),
        };
        let back = Stored::from_bytes(&stored.to_bytes()).unwrap();
        assert_eq!(
            (back.conversation.clone(), back.response.clone(), back.size()),
            (stored.conversation.clone(), stored.response.clone(), stored.size())
        );
        assert!(Stored::from_bytes(b"{}").is_none() && Stored::from_bytes(b"not json").is_none());
        assert!(Stored::from_bytes(br#"{"conversation": 1, "response": {}}"#).is_none());
        assert!(is_response_id("resp_0123abcdef") && is_response_id("a-b_C"));
        for bad in ["", "a/b", "../x", "a b", "é", &"x".repeat(MAX_ID_LEN + 1)] {
            assert!(!is_response_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn the_store_is_bounded_per_tenant_and_forgets_the_oldest() {
        let stored = |text: &str| Stored {
            conversation: vec![json!({"role": "user", "content": text})],
            response: json!({"id": text}),
        };
        let mut s = ResponseStore::new(2, 1 << 20);
        let acme: Arc<str> = "acme".into();
        s.insert(acme.clone(), "a".into(), stored("a"));
        s.insert(acme.clone(), "b".into(), stored("b"));
        assert_eq!(s.response("acme", "a").unwrap(), json!({"id": "a"}));
        assert_eq!(s.response("globex", "a").unwrap_err().status.as_u16(), 404, "another tenant's response");
        assert_eq!(s.conversation("globex", "a").unwrap_err().param.as_deref(), Some("previous_response_id"));
        s.insert(acme.clone(), "c".into(), stored("c"));
        assert_eq!(s.len(), 2);
        assert!(s.response("acme", "a").is_err(), "the oldest went");
        assert_eq!(s.conversation("acme", "b").unwrap().len(), 1);
        assert_eq!(s.delete("acme", "b").unwrap()["deleted"], true);
        assert!(s.delete("acme", "b").is_err());
        assert_eq!((s.len(), s.oldest.count, s.oldest.held("acme")), (1, 1, 1));
        // Bytes: an entry larger than the store is not kept; others make room by evicting.
        let one = stored("x").size();
        let mut s = ResponseStore::new(100, 2 * one);
        s.insert(acme.clone(), "x".into(), stored("x"));
        s.insert(acme.clone(), "y".into(), stored("y"));
        s.insert(acme.clone(), "z".into(), stored("z"));
        assert_eq!((s.len(), s.oldest.bytes), (2, 2 * one));
        s.insert(acme.clone(), "big".into(), stored(&"w".repeat(4 * one)));
        assert!(s.response("acme", "big").is_err());
        assert!(!s.is_empty());
    }

    #[test]
    fn chat_message_errors_name_the_field_they_came_from() {
        let previous = vec![json!({"role": "user", "content": "a"}), json!({"role": "assistant", "content": "b"})];
        let r = parse(json!({"model": "m", "instructions": "Be brief.", "input": [
            {"role": "user", "content": "c"},
            {"type": "function_call", "call_id": "x", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "x", "output": "y"},
        ]}))
        .unwrap();
        let (_, pending) = r.into_chat(previous.clone());
        let named = |param: &str| {
            let e = pending.rename_param(ApiError::invalid_param(param, format!("`{param}` is bad.")));
            (e.param.unwrap(), e.message)
        };
        assert_eq!(named("messages[0].content").0, "instructions");
        assert_eq!(named("messages[2].content").0, "previous_response_id");
        assert_eq!(named("messages[3].content"), ("input[0].content".into(), "`input[0].content` is bad.".into()));
        assert_eq!(named("messages[4].tool_calls[0]").0, "input[1]");
        assert_eq!(named("messages[5].tool_call_id").0, "input[2].call_id");
        assert_eq!(named("messages[5].content").0, "input[2].output");
        assert_eq!(named("messages").0, "input");
        assert_eq!(named("max_tokens").0, "max_output_tokens");
        let (_, pending) = parse(json!({"model": "m", "input": "hi"})).unwrap().into_chat(previous);
        assert_eq!(pending.rename_param(ApiError::invalid_param("messages[2].content", "x")).param.unwrap(), "input");
    }

    #[test]
    fn one_tenants_traffic_evicts_its_own_responses_not_anothers() {
        let stored = |text: &str| Stored {
            conversation: vec![json!({"role": "user", "content": text})],
            response: json!({"id": text}),
        };
        let (acme, globex): (Arc<str>, Arc<str>) = ("acme".into(), "globex".into());
        let mut s = ResponseStore::new(4, 1 << 20);
        s.insert(globex.clone(), "g0".into(), stored("g0"));
        for i in 0..20 {
            s.insert(acme.clone(), format!("a{i:02}"), stored(&format!("a{i:02}")));
        }
        assert!(s.response("globex", "g0").is_ok(), "acme's traffic evicted globex's response");
        assert_eq!((s.len(), s.oldest.held("acme")), (4, 3));
        assert!(s.response("acme", "a16").is_err() && s.response("acme", "a17").is_ok(), "acme's oldest went");
        // globex grows to an equal share at acme's expense, then past it only at its own.
        s.insert(globex.clone(), "g1".into(), stored("g1"));
        assert_eq!((s.oldest.held("acme"), s.oldest.held("globex")), (2, 2));
        s.insert(globex.clone(), "g2".into(), stored("g2"));
        assert_eq!((s.oldest.held("acme"), s.oldest.held("globex")), (2, 2));
        assert!(s.response("globex", "g0").is_err() && s.response("globex", "g2").is_ok());
        assert!(s.response("acme", "a18").is_ok() && s.response("acme", "a19").is_ok());

        // Bytes: the tenant holding the most bytes gives up its oldest, even when that is what it stores now.
        let one = stored("x0").size();
        let mut s = ResponseStore::new(100, 3 * one);
        s.insert(acme.clone(), "x0".into(), stored("x0"));
        s.insert(acme.clone(), "x1".into(), stored("x1"));
        let big = stored(&"w".repeat(one));
        assert!(big.size() <= 3 * one && big.size() > 2 * one);
        s.insert(globex.clone(), "big".into(), big);
        assert!(s.response("globex", "big").is_err(), "globex's entry alone is over its share");
        assert!(s.response("acme", "x0").is_ok() && s.response("acme", "x1").is_ok());
        assert_eq!((s.len(), s.oldest.count, s.oldest.bytes), (2, 2, 2 * one));
    }
}
