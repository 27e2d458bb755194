//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), served as vLLM and SGLang serve
//! it: over the chat-completions path. This module owns the translation of a Messages request into a chat request,
//! the message object, its stream of named events and Anthropic's error shape; the handlers in [`crate::server`]
//! run the generation itself.
//!
//! Content blocks map onto chat turns: text blocks are joined into one message's text; an assistant's `tool_use`
//! blocks become the chat path's tool calls, and a user's `tool_result` blocks its `tool` turns. Tools map to the
//! chat path's forced function calling (`tool_choice` `tool` or `any`): the answer is then one `tool_use` block whose
//! `input` the function's `input_schema` guided. `auto` is the chat path's answer for it (a 400 on a model whose
//! chat template defines no tool-call format). Structured output (`output_config.format`, a JSON schema) is the chat
//! path's guided decoding. Images, documents and extended thinking are a 400 that names them.
//!
//! Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens not read from the prefix cache, and
//! `cache_read_input_tokens` those that were, so their sum is the prompt.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::openai::Usage;
use crate::responses::{NamedEvent, new_response_id};

/// Most messages in a request.
pub const MAX_MESSAGES: usize = 1024;
/// Most content blocks in one message.
pub const MAX_BLOCKS: usize = 256;

/// Fields passed to the chat request unchanged: the sampling fields both APIs share and vLLM's extensions.
const PASSED_THROUGH: [&str; 14] = [
    "model",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "seed",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "priority",
    "kv",
    "cache_salt",
];

/// A validated Messages request, as the chat request it becomes.
#[derive(Debug)]
pub struct MessagesRequest {
    chat: Map<String, Value>,
}

impl MessagesRequest {
    /// Validates a request body. Unknown fields are ignored, as on the chat endpoint. `max_tokens` is required
    /// unless `count_only` (`/v1/messages/count_tokens` takes the same body without it).
    pub fn parse(body: Value, count_only: bool) -> Result<MessagesRequest, ApiError> {
        let Value::Object(mut body) = body else {
            return Err(ApiError::invalid("The request body must be a JSON object."));
        };
        let mut chat = Map::new();
        for key in PASSED_THROUGH {
            if let Some(v) = body.remove(key) {
                chat.insert(key.to_string(), v);
            }
        }
        if !chat.get("model").is_some_and(Value::is_string) {
            return Err(ApiError::invalid_param("model", "`model` is required and must be a string."));
        }
        if count_only {
            chat.remove("stream");
        }
        match body.remove("max_tokens") {
            Some(v) if v.as_i64().is_some_and(|n| n >= 1) => {
                chat.insert("max_tokens".into(), v);
            }
            None | Some(Value::Null) if count_only => {}
            _ => return Err(ApiError::invalid_param("max_tokens", "`max_tokens` is required: a positive integer.")),
        }
        if let Some(thinking) = body.remove("thinking").filter(|t| !t.is_null())
            && thinking.get("type").and_then(Value::as_str) != Some("disabled")
        {
            return Err(ApiError::invalid_param("thinking", "Extended thinking is not supported: only `disabled`."));
        }
        match body.remove("stop_sequences") {
            None | Some(Value::Null) => {}
            Some(Value::Array(stops)) if stops.iter().all(Value::is_string) => {
                chat.insert("stop".into(), Value::Array(stops));
            }
            Some(_) => {
                return Err(ApiError::invalid_param("stop_sequences", "`stop_sequences` must be a list of strings."));
            }
        }
        match body.remove("metadata") {
            None | Some(Value::Null) => {}
            Some(Value::Object(m)) => match m.get("user_id") {
                None | Some(Value::Null) => {}
                Some(Value::String(user)) => {
                    chat.insert("user".into(), Value::String(user.clone()));
                }
                Some(_) => {
                    return Err(ApiError::invalid_param("metadata.user_id", "`metadata.user_id` must be a string."));
                }
            },
            Some(_) => return Err(ApiError::invalid_param("metadata", "`metadata` must be an object.")),
        }
        let tools = tools(body.remove("tools").unwrap_or(Value::Null))?;
        if !tools.is_empty() {
            chat.insert("tools".into(), Value::Array(tools));
        }
        if let Some(choice) = tool_choice(body.remove("tool_choice").unwrap_or(Value::Null))? {
            chat.insert("tool_choice".into(), choice);
        }
        let config_format = match body.remove("output_config") {
            None | Some(Value::Null) => None,
            Some(Value::Object(mut config)) => config.remove("format").filter(|f| !f.is_null()),
            Some(_) => return Err(ApiError::invalid_param("output_config", "`output_config` must be an object.")),
        };
        let legacy_format = body.remove("output_format").filter(|f| !f.is_null());
        if let Some(format) =
            config_format.map(|f| ("output_config.format", f)).or(legacy_format.map(|f| ("output_format", f)))
        {
            chat.insert("response_format".into(), output_format(format)?);
        }
        let mut messages = system(body.remove("system").unwrap_or(Value::Null))?;
        messages.extend(conversation(body.remove("messages").unwrap_or(Value::Null))?);
        chat.insert("messages".into(), Value::Array(messages));
        Ok(MessagesRequest { chat })
    }

    /// The chat request body, and the message under way.
    pub fn into_chat(self) -> (Value, PendingMessage) {
        let pending = PendingMessage {
            id: new_response_id("msg"),
            tool_use_id: new_response_id("toolu"),
            tool_call: None,
            model: self.chat.get("model").cloned().unwrap_or(Value::Null),
        };
        (Value::Object(self.chat), pending)
    }
}

/// The chat request's error, as the Messages request's fields name it.
pub fn rename_param(mut e: ApiError) -> ApiError {
    let renamed = match e.param.as_deref() {
        Some("stop") => "stop_sequences".to_string(),
        Some("user") => "metadata.user_id".to_string(),
        Some("response_format") => "output_config.format".to_string(),
        // An Anthropic tool is flat: the chat tool's `tools[i].function.parameters` is its `tools[i].input_schema`.
        Some(p) if p.starts_with("tools[") && p.contains(".function.") => {
            p.replacen(".function.parameters", ".input_schema", 1).replacen(".function.", ".", 1)
        }
        _ => return e,
    };
    e.param = Some(renamed);
    e
}

/// Structured output (`output_config.format`, or the older `output_format`): `{"type": "json_schema", "schema"}`, as
/// the chat request's `response_format`, whose guided decoding holds the answer to the schema.
fn output_format((at, format): (&str, Value)) -> Result<Value, ApiError> {
    match (format.get("type").and_then(Value::as_str), format.get("schema")) {
        (Some("json_schema"), Some(schema)) if schema.is_object() => {
            Ok(json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}))
        }
        _ => Err(ApiError::invalid_param(
            at,
            "The output format must be {\"type\": \"json_schema\", \"schema\": {...}}.",
        )),
    }
}

/// `system`: a string or a list of text blocks, as a leading system message (none when absent).
fn system(system: Value) -> Result<Vec<Value>, ApiError> {
    match system {
        Value::Null => Ok(Vec::new()),
        Value::String(s) => Ok(vec![json!({"role": "system", "content": s})]),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (j, block) in blocks.iter().enumerate() {
                text.push_str(&text_block(block, &format!("system[{j}]"))?);
            }
            Ok(vec![json!({"role": "system", "content": text})])
        }
        _ => Err(ApiError::invalid_param("system", "`system` must be a string or a list of text blocks.")),
    }
}

/// `messages`: alternating user and assistant turns with string or block content, as chat turns.
fn conversation(messages: Value) -> Result<Vec<Value>, ApiError> {
    let messages = match messages {
        Value::Array(m) if !m.is_empty() && m.len() <= MAX_MESSAGES => m,
        Value::Array(m) if !m.is_empty() => {
            return Err(ApiError::invalid_param("messages", format!("At most {MAX_MESSAGES} messages.")));
        }
        _ => return Err(ApiError::invalid_param("messages", "`messages` must be a non-empty list.")),
    };
    let mut chat = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = match message.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => return Err(ApiError::invalid_param(format!("{at}.role"), "`role` must be user or assistant.")),
        };
        let blocks = match message.get("content") {
            Some(Value::String(s)) => {
                chat.push(json!({"role": role, "content": s}));
                continue;
            }
            Some(Value::Array(b)) if b.len() <= MAX_BLOCKS => b,
            Some(Value::Array(_)) => {
                return Err(ApiError::invalid_param(
                    format!("{at}.content"),
                    format!("At most {MAX_BLOCKS} content blocks per message."),
                ));
            }
            _ => {
                return Err(ApiError::invalid_param(
                    format!("{at}.content"),
                    "`content` must be a string or a list of content blocks.",
                ));
            }
        };
        let (mut text, mut calls, mut results) = (String::new(), Vec::new(), Vec::new());
        for (j, block) in blocks.iter().enumerate() {
            let at = format!("{at}.content[{j}]");
            match (role, block.get("type").and_then(Value::as_str)) {
                (_, Some("text")) => text.push_str(&text_block(block, &at)?),
                ("assistant", Some("tool_use")) => {
                    let field = |key: &str| {
                        block.get(key).and_then(Value::as_str).filter(|s| !s.is_empty()).ok_or_else(|| {
                            ApiError::invalid_param(format!("{at}.{key}"), format!("A tool_use block needs `{key}`."))
                        })
                    };
                    let (id, name) = (field("id")?, field("name")?);
                    let input = block.get("input").filter(|v| v.is_object()).ok_or_else(|| {
                        ApiError::invalid_param(format!("{at}.input"), "A tool_use block's `input` must be an object.")
                    })?;
                    calls.push(json!({"id": id, "type": "function",
                        "function": {"name": name, "arguments": input.to_string()}}));
                }
                ("user", Some("tool_result")) => {
                    let id = block.get("tool_use_id").and_then(Value::as_str).filter(|s| !s.is_empty());
                    let Some(id) = id else {
                        return Err(ApiError::invalid_param(
                            format!("{at}.tool_use_id"),
                            "A tool_result block needs `tool_use_id`.",
                        ));
                    };
                    let content = match block.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Array(parts)) => {
                            let mut s = String::new();
                            for (k, part) in parts.iter().enumerate() {
                                s.push_str(&text_block(part, &format!("{at}.content[{k}]"))?);
                            }
                            s
                        }
                        Some(_) => {
                            return Err(ApiError::invalid_param(
                                format!("{at}.content"),
                                "A tool_result's `content` must be a string or a list of text blocks.",
                            ));
                        }
                    };
                    results.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                }
                (_, kind) => {
                    return Err(ApiError::invalid_param(
                        format!("{at}.type"),
                        format!(
                            "Content blocks of type `{}` are not supported in a {role} message; text, tool_use \
                             (assistant) and tool_result (user) are.",
                            kind.unwrap_or("(none)")
                        ),
                    ));
                }
            }
        }
        // Tool results answer the previous turn's calls, so they come before this turn's own text.
        chat.extend(results);
        if !calls.is_empty() {
            let content = if text.is_empty() { Value::Null } else { Value::String(text) };
            chat.push(json!({"role": "assistant", "content": content, "tool_calls": calls}));
        } else if !text.is_empty() || role == "assistant" {
            chat.push(json!({"role": role, "content": text}));
        }
    }
    Ok(chat)
}

/// A `text` block's text.
fn text_block(block: &Value, at: &str) -> Result<String, ApiError> {
    match (block.get("type").and_then(Value::as_str), block.get("text").and_then(Value::as_str)) {
        (Some("text"), Some(t)) => Ok(t.to_owned()),
        _ => Err(ApiError::invalid_param(at, "Expected a text block: {\"type\": \"text\", \"text\": ...}.")),
    }
}

/// `tools`: client tools (`{"name", "description", "input_schema"}`) in the chat request's form, whose validation
/// bounds their number, names and schemas. Anthropic's server tools (web search, code execution) are a 400.
fn tools(tools: Value) -> Result<Vec<Value>, ApiError> {
    let tools = match tools {
        Value::Null => return Ok(Vec::new()),
        Value::Array(tools) => tools,
        _ => return Err(ApiError::invalid_param("tools", "`tools` must be a list.")),
    };
    tools
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            let client_tool = matches!(tool.get("type").and_then(Value::as_str), None | Some("custom"));
            let name = tool.get("name").filter(|n| n.is_string() && client_tool).ok_or_else(|| {
                ApiError::invalid_param(
                    format!("tools[{i}]"),
                    "Only client tools are supported: {\"name\": ..., \"input_schema\": {...}}.",
                )
            })?;
            let mut function = Map::new();
            function.insert("name".into(), name.clone());
            if let Some(d) = tool.get("description").filter(|v| !v.is_null()) {
                function.insert("description".into(), d.clone());
            }
            let schema = tool.get("input_schema").filter(|v| v.is_object()).ok_or_else(|| {
                ApiError::invalid_param(format!("tools[{i}].input_schema"), "A tool needs an `input_schema` object.")
            })?;
            function.insert("parameters".into(), schema.clone());
            Ok(json!({"type": "function", "function": function}))
        })
        .collect()
}

/// `tool_choice`: `{"type": "auto" | "any" | "none"}` or `{"type": "tool", "name": ...}`, in the chat request's form.
fn tool_choice(choice: Value) -> Result<Option<Value>, ApiError> {
    if choice.is_null() {
        return Ok(None);
    }
    let chat = match (choice.get("type").and_then(Value::as_str), choice.get("name")) {
        (Some("auto"), _) => json!("auto"),
        (Some("any"), _) => json!("required"),
        (Some("none"), _) => json!("none"),
        (Some("tool"), Some(name)) if name.is_string() => json!({"type": "function", "function": {"name": name}}),
        _ => {
            return Err(ApiError::invalid_param(
                "tool_choice",
                "`tool_choice` must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or \
                 {\"type\": \"tool\", \"name\": ...}.",
            ));
        }
    };
    Ok(Some(chat))
}

/// A message being generated: its ids, and the tool its answer calls, if the chat path forces one.
#[derive(Debug, Clone)]
pub struct PendingMessage {
    pub id: String,
    tool_use_id: String,
    tool_call: Option<String>,
    model: Value,
}

impl PendingMessage {
    /// The answer calls `name` (the chat request's forced function call): its content is a `tool_use` block.
    pub fn set_tool_call(&mut self, name: Option<String>) {
        self.tool_call = name;
    }

    /// The message object of a finished answer.
    pub fn message(&self, text: &str, finish_reason: &str, stop: Option<&str>, usage: &Usage) -> Value {
        let (stop_reason, stop_sequence) = self.stop_reason(finish_reason, stop);
        let content = match (&self.tool_call, serde_json::from_str::<Value>(text)) {
            (Some(name), Ok(input)) if input.is_object() => {
                json!([{"type": "tool_use", "id": self.tool_use_id, "name": name, "input": input}])
            }
            // A call cut short (max_tokens) has no whole input: its text is handed back as it is.
            _ => json!([{"type": "text", "text": text}]),
        };
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage_object(usage),
        })
    }

    /// Anthropic's `stop_reason` and `stop_sequence` for a chat finish reason and the stop string that matched.
    fn stop_reason(&self, finish_reason: &str, stop: Option<&str>) -> (&'static str, Value) {
        match (finish_reason, stop) {
            ("length", _) => ("max_tokens", Value::Null),
            (_, Some(s)) => ("stop_sequence", Value::String(s.to_owned())),
            _ if self.tool_call.is_some() => ("tool_use", Value::Null),
            _ => ("end_turn", Value::Null),
        }
    }
}

/// Anthropic's usage object: uncached prompt tokens, cache reads, generated tokens.
fn usage_object(u: &Usage) -> Value {
    let cached = u.cached_tokens();
    json!({
        "input_tokens": u.prompt_tokens.saturating_sub(cached),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": u.completion_tokens,
    })
}

/// The named events of a streamed message: `message_start`, one content block (start, deltas, stop), then
/// `message_delta` with the stop reason and usage, and `message_stop`.
#[derive(Debug)]
pub struct MessageEvents {
    pending: PendingMessage,
    /// Whether a tool call's JSON has begun: the whitespace the guide allows before it is not sent, because
    /// clients parse the partial JSON after every delta and a buffer of whitespace alone does not parse.
    json_begun: bool,
}

impl MessageEvents {
    pub fn new(pending: PendingMessage) -> MessageEvents {
        MessageEvents { pending, json_begun: false }
    }

    /// The opening events, before any text: the message shell with the prompt's size, the content block, a ping.
    pub fn start(&self, prompt_tokens: u32) -> Vec<NamedEvent> {
        let p = &self.pending;
        let block = match &p.tool_call {
            Some(name) => json!({"type": "tool_use", "id": p.tool_use_id, "name": name, "input": {}}),
            None => json!({"type": "text", "text": ""}),
        };
        vec![
            event(
                "message_start",
                json!({"type": "message_start", "message": {
                    "id": p.id, "type": "message", "role": "assistant", "model": p.model, "content": [],
                    "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0,
                        "cache_read_input_tokens": 0, "output_tokens": 0}}}),
            ),
            event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": block})),
            event("ping", json!({"type": "ping"})),
        ]
    }

    /// Newly generated text: a text delta, or for a tool call a piece of its input's JSON (none for the whitespace
    /// before the JSON begins).
    pub fn delta(&mut self, text: &str) -> Vec<NamedEvent> {
        let delta = match self.pending.tool_call {
            Some(_) => {
                let text = if self.json_begun { text } else { text.trim_start() };
                if text.is_empty() {
                    return Vec::new();
                }
                self.json_begun = true;
                json!({"type": "input_json_delta", "partial_json": text})
            }
            None => json!({"type": "text_delta", "text": text}),
        };
        vec![event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": delta}))]
    }

    /// The closing events.
    pub fn done(&self, finish_reason: &str, stop: Option<&str>, usage: &Usage) -> Vec<NamedEvent> {
        let (stop_reason, stop_sequence) = self.pending.stop_reason(finish_reason, stop);
        vec![
            event("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
            event(
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": usage_object(usage)}),
            ),
            event("message_stop", json!({"type": "message_stop"})),
        ]
    }

    /// The event that ends a stream which failed after it started.
    pub fn failed(&self, e: &ApiError) -> Vec<NamedEvent> {
        vec![event("error", error_body(e))]
    }
}

fn event(name: &'static str, data: Value) -> NamedEvent {
    (name, data.to_string())
}

/// Anthropic's error type for an HTTP status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// `{"type": "error", "error": {"type", "message"}}`, the message naming the field where there is one.
fn error_body(e: &ApiError) -> Value {
    let message = match &e.param {
        Some(p) if !e.message.contains(p.as_str()) => format!("{p}: {}", e.message),
        _ => e.message.clone(),
    };
    json!({"type": "error", "error": {"type": error_type(e.status), "message": message}})
}

/// An error in Anthropic's shape, with the status (and `Retry-After`) the router gives it elsewhere.
pub fn error_response(e: ApiError) -> Response {
    let body = error_body(&e).to_string();
    let mut resp = e.into_response();
    *resp.body_mut() = axum::body::Body::from(body);
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Value {
        MessagesRequest::parse(body, false).expect("valid").into_chat().0
    }

    fn param(body: Value) -> Option<String> {
        MessagesRequest::parse(body, false).expect_err("invalid").param
    }

    #[test]
    fn a_conversation_with_a_system_prompt_becomes_chat_turns() {
        let c = chat(json!({"model": "m", "max_tokens": 16, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": [{"type": "text", "text": "Capital "}, {"type": "text", "text": "of France?"}]}],
            "stop_sequences": ["\n\n"], "temperature": 0, "top_k": 5, "metadata": {"user_id": "u1"}, "stream": true,
            "kv": {"policy": "h2o"}, "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}}}));
        assert_eq!(
            c["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}})
        );
        assert_eq!(
            c["messages"],
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}])
        );
        assert_eq!(
            (c["max_tokens"].clone(), c["stop"].clone(), c["user"].clone()),
            (json!(16), json!(["\n\n"]), json!("u1"))
        );
        assert_eq!(
            (c["top_k"].clone(), c["stream"].clone(), c["kv"]["policy"].clone()),
            (json!(5), json!(true), json!("h2o"))
        );
    }

    #[test]
    fn tool_use_and_tool_result_blocks_become_calls_and_tool_turns() {
        let c = chat(json!({"model": "m", "max_tokens": 16,
            "tools": [{"name": "weather", "description": "Weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "weather"},
            "messages": [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                    {"type": "text", "text": "And so?"}]}]}));
        assert_eq!(
            c["tools"][0]["function"],
            json!({"name": "weather", "description": "Weather", "parameters": {"type": "object"}})
        );
        assert_eq!(c["tool_choice"], json!({"type": "function", "function": {"name": "weather"}}));
        let m = c["messages"].as_array().unwrap();
        assert_eq!(m[1]["tool_calls"][0]["function"], json!({"name": "weather", "arguments": "{\"city\":\"Paris\"}"}));
        assert_eq!(m[1]["content"], Value::Null);
        assert_eq!(m[2], json!({"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"}));
        assert_eq!(m[3], json!({"role": "user", "content": "And so?"}));
        for (choice, chat) in [("any", json!("required")), ("auto", json!("auto")), ("none", json!("none"))] {
            let c = chat_with_choice(choice);
            assert_eq!(c["tool_choice"], chat, "{choice}");
        }
    }

    fn chat_with_choice(kind: &str) -> Value {
        chat(json!({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "t", "input_schema": {"type": "object"}}], "tool_choice": {"type": kind}}))
    }

    #[test]
    fn bad_requests_name_their_field() {
        let ok = json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]});
        let with = |key: &str, v: Value| {
            let mut b = ok.clone();
            b[key] = v;
            b
        };
        assert_eq!(param(with("max_tokens", json!(0))).as_deref(), Some("max_tokens"));
        assert_eq!(
            param(json!({"model": "m", "messages": [{"role": "user", "content": "x"}]})).as_deref(),
            Some("max_tokens")
        );
        assert_eq!(param(with("model", json!(3))).as_deref(), Some("model"));
        assert_eq!(param(with("messages", json!([]))).as_deref(), Some("messages"));
        assert_eq!(
            param(with("messages", json!([{"role": "system", "content": "x"}]))).as_deref(),
            Some("messages[0].role")
        );
        let image = json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]);
        assert_eq!(param(with("messages", image)).as_deref(), Some("messages[0].content[0].type"));
        let result_in_assistant =
            json!([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]);
        assert_eq!(param(with("messages", result_in_assistant)).as_deref(), Some("messages[0].content[0].type"));
        let bad_input =
            json!([{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "t", "input": 3}]}]);
        assert_eq!(param(with("messages", bad_input)).as_deref(), Some("messages[0].content[0].input"));
        assert_eq!(param(with("stop_sequences", json!([1]))).as_deref(), Some("stop_sequences"));
        assert_eq!(param(with("system", json!(5))).as_deref(), Some("system"));
        assert_eq!(
            param(with("tools", json!([{"type": "web_search_20250305", "name": "web"}]))).as_deref(),
            Some("tools[0]")
        );
        assert_eq!(param(with("tools", json!([{"name": "t"}]))).as_deref(), Some("tools[0].input_schema"));
        assert_eq!(param(with("tool_choice", json!({"type": "tool"}))).as_deref(), Some("tool_choice"));
        assert_eq!(
            param(with("thinking", json!({"type": "enabled", "budget_tokens": 1024}))).as_deref(),
            Some("thinking")
        );
        assert_eq!(param(with("thinking", json!({"type": "adaptive"}))).as_deref(), Some("thinking"));
        assert!(MessagesRequest::parse(with("thinking", json!({"type": "disabled"})), false).is_ok());
        assert_eq!(param(with("metadata", json!({"user_id": 7}))).as_deref(), Some("metadata.user_id"));
        assert_eq!(
            param(with("output_config", json!({"format": {"type": "text"}}))).as_deref(),
            Some("output_config.format")
        );
        assert_eq!(param(with("output_format", json!({"type": "json_schema"}))).as_deref(), Some("output_format"));
        let many = Value::Array(vec![json!({"role": "user", "content": "x"}); MAX_MESSAGES + 1]);
        assert_eq!(param(with("messages", many)).as_deref(), Some("messages"));
        assert!(MessagesRequest::parse(json!([1]), false).is_err());
        // count_tokens takes the body without max_tokens.
        let count = json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true});
        let c = MessagesRequest::parse(count, true).expect("count_tokens body").into_chat().0;
        assert!(c.get("max_tokens").is_none() && c.get("stream").is_none());
    }

    #[test]
    fn chat_errors_are_renamed_to_the_messages_fields() {
        let renamed = |p: &str| rename_param(ApiError::invalid_param(p, "bad")).param.unwrap();
        assert_eq!(renamed("stop"), "stop_sequences");
        assert_eq!(renamed("user"), "metadata.user_id");
        assert_eq!(renamed("tools[2].function.parameters"), "tools[2].input_schema");
        assert_eq!(renamed("tools[0].function.name"), "tools[0].name");
        assert_eq!(renamed("temperature"), "temperature");
    }

    fn pending(tool: Option<&str>) -> PendingMessage {
        let (_, mut p) = MessagesRequest::parse(
            json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}),
            false,
        )
        .unwrap()
        .into_chat();
        p.set_tool_call(tool.map(str::to_owned));
        p
    }

    #[test]
    fn messages_carry_anthropic_stop_reasons_and_usage() {
        let usage = Usage::new(30, 5, 16);
        let m = pending(None).message("Paris.", "stop", None, &usage);
        assert_eq!(
            (m["type"].as_str(), m["role"].as_str(), m["model"].as_str()),
            (Some("message"), Some("assistant"), Some("m"))
        );
        assert!(m["id"].as_str().unwrap().starts_with("msg_"));
        assert_eq!(m["content"], json!([{"type": "text", "text": "Paris."}]));
        assert_eq!((m["stop_reason"].clone(), m["stop_sequence"].clone()), (json!("end_turn"), Value::Null));
        assert_eq!(
            m["usage"],
            json!({"input_tokens": 14, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 16, "output_tokens": 5})
        );
        let m = pending(None).message("Par", "stop", Some("is"), &usage);
        assert_eq!((m["stop_reason"].clone(), m["stop_sequence"].clone()), (json!("stop_sequence"), json!("is")));
        assert_eq!(pending(None).message("P", "length", None, &usage)["stop_reason"], "max_tokens");
        let m = pending(Some("weather")).message("{\"city\": \"Paris\"}", "stop", None, &usage);
        assert_eq!(m["stop_reason"], "tool_use");
        assert_eq!(m["content"][0]["type"], "tool_use");
        assert_eq!(m["content"][0]["input"], json!({"city": "Paris"}));
        assert!(m["content"][0]["id"].as_str().unwrap().starts_with("toolu_"));
        let cut = pending(Some("weather")).message("{\"city\": \"Pa", "length", None, &usage);
        assert_eq!(
            (cut["stop_reason"].clone(), cut["content"][0]["type"].clone()),
            (json!("max_tokens"), json!("text"))
        );
    }

    #[test]
    fn streamed_events_open_delta_and_close_in_order() {
        let usage = Usage::new(30, 2, 0);
        for (tool, delta_type, block_type) in
            [(None, "text_delta", "text"), (Some("weather"), "input_json_delta", "tool_use")]
        {
            let mut ev = MessageEvents::new(pending(tool));
            let mut all = ev.start(30);
            if tool.is_some() {
                assert!(ev.delta(" \n").is_empty(), "whitespace before a call's JSON is held back");
            }
            all.extend(ev.delta("Pa"));
            all.extend(ev.delta("ris"));
            all.extend(ev.done("stop", None, &usage));
            let names: Vec<&str> = all.iter().map(|e| e.0).collect();
            assert_eq!(
                names,
                [
                    "message_start",
                    "content_block_start",
                    "ping",
                    "content_block_delta",
                    "content_block_delta",
                    "content_block_stop",
                    "message_delta",
                    "message_stop"
                ]
            );
            let data: Vec<Value> = all.iter().map(|e| serde_json::from_str(&e.1).unwrap()).collect();
            for (name, d) in names.iter().zip(&data) {
                assert_eq!(d["type"], *name, "every event's data names its type");
            }
            assert_eq!(data[0]["message"]["usage"]["input_tokens"], 30);
            assert_eq!(data[1]["content_block"]["type"], block_type);
            assert_eq!(data[3]["delta"]["type"], delta_type);
            let stop = if tool.is_some() { "tool_use" } else { "end_turn" };
            assert_eq!(data[6]["delta"]["stop_reason"], stop);
            assert_eq!(data[6]["usage"]["output_tokens"], 2);
        }
    }

    #[test]
    fn errors_take_anthropics_shape() {
        let e = ApiError::invalid_param("max_tokens", "must be positive");
        let body = error_body(&e);
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["message"], "max_tokens: must be positive");
        assert_eq!(error_type(StatusCode::NOT_FOUND), "not_found_error");
        assert_eq!(error_type(StatusCode::TOO_MANY_REQUESTS), "rate_limit_error");
        assert_eq!(error_type(StatusCode::SERVICE_UNAVAILABLE), "overloaded_error");
        assert_eq!(error_type(StatusCode::INTERNAL_SERVER_ERROR), "api_error");
        assert_eq!(error_response(e).status(), StatusCode::BAD_REQUEST);
    }
}
