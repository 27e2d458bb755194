//! OpenAI wire types: the request bodies of `/v1/chat/completions` and `/v1/completions` with their validation
//! (every input bounded), and the response and streaming-chunk bodies.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use pagoda_worker::grammar_guide::Grammar;
use pagoda_worker::json_schema::JsonSchema;
use pagoda_worker::regex_guide::ByteDfa;
use pagoda_worker::tiers::GroupCodec;

use crate::codec::TextCodec;
use crate::error::ApiError;
use crate::generate::TokenLogprob;

/// At most this many chat messages per request.
pub const MAX_MESSAGES: usize = 1024;
/// At most this many stop strings.
pub const MAX_STOP: usize = 8;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 256;
/// Longest message content or prompt string, in bytes.
pub const MAX_TEXT_BYTES: usize = 1 << 20;
/// Longest short string field (model, name, user), in bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// Most generations one request may ask for: `n` times the prompts of a completion batch. Each runs as its own
/// request on the workers, while the request counts once against its key's limits, so this bounds what one
/// request can cost.
pub const MAX_CHOICES: usize = 16;
/// At most this many content parts in one message.
pub const MAX_PARTS: usize = 256;
pub use pagoda_worker::sampling::{
    LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS, PENALTY_LIMIT,
};
/// Longest `kv.profile_queries` entry, in bytes, before it is tokenized (then it must fit
/// [`MAX_PROFILE_QUERY_TOKENS`](pagoda_worker::placement::MAX_PROFILE_QUERY_TOKENS)).
pub const MAX_PROFILE_QUERY_BYTES: usize = 1024;

/// The `kv` request extension (DESIGN §8): per-request KV-cache policy.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct KvOptions {
    pub policy: Option<String>,
    pub budget_tokens: Option<i64>,
    pub codec: Option<String>,
    /// Training queries for the context this request creates, as text (EvicPress §4.3): the worker profiles the
    /// context's compressed variants on them instead of its own generic profiling questions.
    pub profile_queries: Option<Vec<String>>,
}

/// `stream_options`.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    /// vLLM's extension: with `include_usage`, every chunk carries the usage so far.
    pub continuous_usage_stats: Option<bool>,
}

/// One chat message as sent by the client.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: Role,
    #[serde(default)]
    pub content: Value,
    pub name: Option<String>,
    /// An assistant turn's function calls (what an earlier forced call returned).
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` turn's answer to that call.
    pub tool_call_id: Option<String>,
}

/// Chat roles we accept; anything else is rejected by deserialisation with the list of valid roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    /// A function's result, answering an assistant turn's call.
    Tool,
}

impl Role {
    /// The role name the chat template sees (`developer` is rendered as `system`).
    pub fn template_name(self) -> &'static str {
        match self {
            Role::System | Role::Developer => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<ChatMessageIn>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<serde_json::Number>,
    pub stop: Option<Value>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub logit_bias: Option<Value>,
    pub ignore_eos: Option<bool>,
    pub repetition_penalty: Option<f64>,
    pub min_p: Option<f64>,
    pub min_tokens: Option<i64>,
    pub stop_token_ids: Option<Value>,
    pub include_stop_str_in_output: Option<bool>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub response_format: Option<Value>,
    /// vLLM's extension: a JSON Schema (an object, or its JSON text) the answer must follow.
    pub guided_json: Option<Value>,
    /// vLLM's extension: a pattern the whole answer must match.
    pub guided_regex: Option<Value>,
    /// vLLM's extension: strings the answer must be one of.
    pub guided_choice: Option<Value>,
    /// vLLM's extension: an EBNF grammar (xgrammar's and llama.cpp's GBNF) the answer must be a sentence of.
    pub guided_grammar: Option<Value>,
    /// vLLM's successor of the `guided_*` fields: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`.
    pub structured_outputs: Option<Value>,
    pub user: Option<String>,
    pub kv: Option<KvOptions>,
    /// vLLM's chat extensions: end the rendered prompt with the assistant turn's header (default true, false
    /// with `continue_final_message`), or continue the final (assistant) message where it stops.
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    /// vLLM's extension: keep only the last this many prompt tokens.
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's extension: only these tokens may be sampled.
    pub allowed_token_ids: Option<Value>,
    /// vLLM's extension: words the answer must not contain.
    pub bad_words: Option<Value>,
    /// vLLM's extension: the request's priority under priority scheduling (lower first; default 0).
    pub priority: Option<i64>,
    /// vLLM's extension: a secret that salts the prefix cache, so that only requests with the same salt share
    /// cached blocks.
    pub cache_salt: Option<Value>,
}

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Value,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<serde_json::Number>,
    pub stop: Option<Value>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logprobs: Option<i64>,
    pub logit_bias: Option<Value>,
    pub ignore_eos: Option<bool>,
    pub repetition_penalty: Option<f64>,
    pub min_p: Option<f64>,
    pub min_tokens: Option<i64>,
    pub stop_token_ids: Option<Value>,
    pub include_stop_str_in_output: Option<bool>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    /// vLLM accepts `response_format` on completions too.
    pub response_format: Option<Value>,
    /// vLLM's extension: a JSON Schema (an object, or its JSON text) the answer must follow.
    pub guided_json: Option<Value>,
    /// vLLM's extension: a pattern the whole answer must match.
    pub guided_regex: Option<Value>,
    /// vLLM's extension: strings the answer must be one of.
    pub guided_choice: Option<Value>,
    /// vLLM's extension: an EBNF grammar (xgrammar's and llama.cpp's GBNF) the answer must be a sentence of.
    pub guided_grammar: Option<Value>,
    /// vLLM's successor of the `guided_*` fields: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`.
    pub structured_outputs: Option<Value>,
    pub user: Option<String>,
    pub kv: Option<KvOptions>,
    /// vLLM's extension: keep only the last this many tokens of each prompt.
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's extension: only these tokens may be sampled.
    pub allowed_token_ids: Option<Value>,
    /// vLLM's extension: words the answer must not contain.
    pub bad_words: Option<Value>,
    /// vLLM's extension: the request's priority under priority scheduling (lower first; default 0).
    pub priority: Option<i64>,
    /// vLLM's extension: a secret that salts the prefix cache, so that only requests with the same salt share
    /// cached blocks.
    pub cache_salt: Option<Value>,
}

/// At most this many token ids in a `/detokenize` request.
pub const MAX_DETOKENIZE_TOKENS: usize = 1 << 16;

/// `POST /tokenize` body (vLLM's shape): a completion `prompt`, or chat `messages`, which are rendered with the
/// chat template exactly as a chat completion's would be, so that `count` is that request's prompt length.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    /// Optional; when given it must name the served model.
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessageIn>>,
    /// For `prompt`: add the model's BOS/EOS where it asks for them, as a completion does (default true).
    pub add_special_tokens: Option<bool>,
    /// Also return each token's text (its bytes, lossily decoded).
    pub return_token_strs: Option<bool>,
    /// For `messages`: as in a chat completion.
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
}

/// What to tokenize, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizeInput {
    Prompt { text: String, add_special: bool },
    Chat(Vec<Turn>, ChatRender),
}

/// How a chat is rendered with the template (vLLM's `add_generation_prompt` and `continue_final_message`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatRender {
    /// Append the assistant turn's header, so the model answers.
    pub add_generation_prompt: bool,
    /// End the prompt where the final message's content ends (no end-of-turn), so the model continues it.
    pub continue_final_message: bool,
}

impl Default for ChatRender {
    fn default() -> ChatRender {
        ChatRender { add_generation_prompt: true, continue_final_message: false }
    }
}

impl ChatRender {
    /// Validates the two fields against the chat: continuing needs a final assistant message, and a prompt
    /// cannot both continue that message and open a new turn.
    pub fn parse(add: Option<bool>, cont: Option<bool>, turns: &[Turn]) -> Result<ChatRender, ApiError> {
        let continue_final_message = cont.unwrap_or(false);
        let add_generation_prompt = add.unwrap_or(!continue_final_message);
        if continue_final_message && add_generation_prompt {
            return Err(ApiError::invalid_param(
                "continue_final_message",
                "`continue_final_message` continues the final message; it cannot be combined with \
                 `add_generation_prompt`, which opens a new turn.",
            ));
        }
        if continue_final_message && turns.last().is_none_or(|t| t.role != "assistant") {
            return Err(ApiError::invalid_param(
                "continue_final_message",
                "`continue_final_message` needs the last message to be the assistant's.",
            ));
        }
        Ok(ChatRender { add_generation_prompt, continue_final_message })
    }
}

impl TokenizeRequest {
    pub fn validate(&self) -> Result<TokenizeInput, ApiError> {
        if let Some(m) = &self.model {
            check_model_field(m)?;
        }
        match (&self.prompt, &self.messages) {
            (Some(text), None) => {
                if self.add_generation_prompt.is_some() || self.continue_final_message.is_some() {
                    return Err(ApiError::invalid_param(
                        "add_generation_prompt",
                        "`add_generation_prompt` and `continue_final_message` apply to `messages`.",
                    ));
                }
                if text.len() > MAX_TEXT_BYTES {
                    return Err(ApiError::invalid_param(
                        "prompt",
                        format!("`prompt` is {} bytes; the limit is {MAX_TEXT_BYTES}.", text.len()),
                    ));
                }
                Ok(TokenizeInput::Prompt { text: text.clone(), add_special: self.add_special_tokens.unwrap_or(true) })
            }
            (None, Some(messages)) => {
                if self.add_special_tokens.is_some() {
                    return Err(ApiError::invalid_param(
                        "add_special_tokens",
                        "`add_special_tokens` applies to `prompt`; `messages` follow the chat template.",
                    ));
                }
                let turns = validate_messages(messages)?;
                let render = ChatRender::parse(self.add_generation_prompt, self.continue_final_message, &turns)?;
                Ok(TokenizeInput::Chat(turns, render))
            }
            _ => Err(ApiError::invalid_param("prompt", "Give exactly one of `prompt` and `messages`.")),
        }
    }
}

/// `POST /tokenize` response.
#[derive(Debug, Clone, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_strs: Option<Vec<String>>,
}

/// `POST /detokenize` body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<i64>,
}

impl DetokenizeRequest {
    /// The token ids, each below `vocab_size`, at most [`MAX_DETOKENIZE_TOKENS`].
    pub fn validate(&self, vocab_size: usize) -> Result<Vec<u32>, ApiError> {
        if let Some(m) = &self.model {
            check_model_field(m)?;
        }
        if self.tokens.len() > MAX_DETOKENIZE_TOKENS {
            return Err(ApiError::invalid_param(
                "tokens",
                format!("`tokens` has {} ids; at most {MAX_DETOKENIZE_TOKENS} are allowed.", self.tokens.len()),
            ));
        }
        self.tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                u32::try_from(t).ok().filter(|&t| (t as usize) < vocab_size).ok_or_else(|| {
                    ApiError::invalid_param(
                        format!("tokens[{i}]"),
                        format!("Token id {t} is not in the vocabulary (size {vocab_size})."),
                    )
                })
            })
            .collect()
    }
}

/// `POST /detokenize` response.
#[derive(Debug, Clone, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// Sampling settings after validation (0 temperature = greedy, 0 top_k = off, 1.0 top_p = off, 0 penalties =
/// off).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub seed: Option<u64>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// vLLM's extensions: 1 and 0 are off; `min_tokens` is checked against the completion budget by
    /// [`check_min_tokens`] once the prompt is tokenized.
    pub repetition_penalty: f32,
    pub min_p: f32,
    pub min_tokens: u32,
    /// `response_format: {"type": "json_object"}`: the answer is guided to one JSON object.
    pub json_object: bool,
}

/// Validated generation parameters shared by both endpoints.
#[derive(Debug, Clone, PartialEq)]
pub struct GenParams {
    pub model: String,
    /// `None`: as many as the context allows.
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): every chunk carries its choice's usage
    /// so far.
    pub continuous_usage: bool,
    pub sampling: Sampling,
    /// `logit_bias` as (token id, bias), ascending by token id: added to the logits before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM's extension: generate past the model's end-of-sequence tokens, up to `max_tokens` or a stop string.
    pub ignore_eos: bool,
    /// vLLM's `stop_token_ids`: more tokens that end generation (not emitted), `ignore_eos` or not.
    pub stop_token_ids: Vec<u32>,
    /// vLLM's `allowed_token_ids`, ascending without repeats: when not empty, only these may be sampled.
    pub allowed_token_ids: Vec<u32>,
    /// vLLM's `bad_words`, checked for count and size; tokenized when the prompt is ([`bad_word_sequences`]).
    pub bad_words: Vec<String>,
    /// vLLM's `include_stop_str_in_output`: a matched stop string ends the text instead of being cut from it.
    pub include_stop_str: bool,
    /// `response_format: {"type": "json_schema", ...}` or vLLM's `guided_json`: the schema, as compact JSON text,
    /// already compiled once here so that a schema the worker's guide cannot follow is a 400.
    pub json_schema: Option<String>,
    /// vLLM's `guided_regex`, or `guided_choice` as the alternation of its strings: a pattern the whole answer
    /// must match, already compiled once here.
    pub regex: Option<String>,
    /// vLLM's `structured_outputs.grammar` or `guided_grammar`: an EBNF grammar the answer must be a sentence of,
    /// already compiled once here.
    pub grammar: Option<String>,
    /// A chat's forced function call (`tool_choice` naming a function, or `required` with one tool): its name.
    /// The answer is guided by the function's `parameters` (in `json_schema`) and returned as its arguments.
    pub tool_call: Option<String>,
    /// The `kv` extension, validated: policy name (empty = the worker's default) and budget (0 = default).
    pub kv_policy: String,
    pub kv_budget_tokens: u32,
    /// `kv.codec`, canonical (`native` or a codec's name); empty = the worker's `--tier-codec`.
    pub kv_codec: String,
    /// `kv.profile_queries`, checked for count and size; tokenized when the prompt is.
    pub kv_profile_queries: Vec<String>,
    /// Report each generated token's log-probability with this many alternatives (at most [`MAX_TOP_LOGPROBS`]);
    /// `None` when the request did not ask.
    pub logprobs: Option<u32>,
    /// A completion's `echo`: the answer starts with the prompt, and with `logprobs` the prompt's tokens are
    /// scored too (how clients such as lm-eval score a text's log-likelihood).
    pub echo: bool,
    /// Generations per prompt (`n`), each a choice of its own; at most [`MAX_CHOICES`] with the prompts.
    pub n: u32,
    /// vLLM's `truncate_prompt_tokens`: each prompt keeps only its last this many tokens.
    pub truncate_prompt_tokens: Option<u32>,
    /// vLLM's `priority`: lower is served first by a worker that runs priority scheduling; a worker that serves in
    /// arrival order refuses anything but 0.
    pub priority: i32,
    /// vLLM's `cache_salt`: the request's blocks hash in a namespace this salts ([`salted_namespace`]).
    pub cache_salt: Option<String>,
    /// A chat's rendering with the template (the default for completions, which have none).
    pub chat_render: ChatRender,
}

impl GenParams {
    /// Drops the front of `prompt` beyond `truncate_prompt_tokens`.
    pub fn truncate_prompt(&self, prompt: &mut Vec<u32>) {
        if let Some(keep) = self.truncate_prompt_tokens
            && prompt.len() > keep as usize
        {
            prompt.drain(..prompt.len() - keep as usize);
        }
    }
}

/// The prefix-cache namespace of a tenant's request with `cache_salt`: the tenant, then a separator the worker's
/// fair schedulers cut at (so the salt does not make another tenant), then a digest of the salt (the salt itself
/// never leaves the router). Requests share cached blocks only with requests of the same tenant and salt.
pub fn salted_namespace(tenant: &str, cache_salt: &str) -> String {
    let digest = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(cache_salt.as_bytes()));
    pagoda_worker::cache::salted_namespace(tenant, "salt", &digest)
}

/// Largest `truncate_prompt_tokens` (no context is longer).
pub const MAX_TRUNCATE_PROMPT_TOKENS: u32 = 1 << 24;

/// A chat turn ready for the template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    pub role: &'static str,
    pub content: String,
}

/// What a completion prompt turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

struct CommonIn<'a> {
    model: &'a str,
    max_tokens: Option<i64>,
    max_tokens_param: &'static str,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    seed: Option<&'a serde_json::Number>,
    stop: Option<&'a Value>,
    stream: Option<bool>,
    stream_options: Option<&'a StreamOptions>,
    n: Option<i64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    logit_bias: Option<&'a Value>,
    ignore_eos: Option<bool>,
    repetition_penalty: Option<f64>,
    min_p: Option<f64>,
    min_tokens: Option<i64>,
    stop_token_ids: Option<&'a Value>,
    allowed_token_ids: Option<&'a Value>,
    bad_words: Option<&'a Value>,
    include_stop_str_in_output: Option<bool>,
    vocab_size: usize,
    user: Option<&'a str>,
    kv: Option<&'a KvOptions>,
    truncate_prompt_tokens: Option<i64>,
    priority: Option<i64>,
    cache_salt: Option<&'a Value>,
}

/// [`CommonIn`] borrowed from a request (chat or legacy completion) whose sampling fields carry the same names;
/// only `max_tokens` (and the parameter it came from) differ between the two.
macro_rules! common_in {
    ($req:expr, $max_tokens:expr, $max_tokens_param:expr, $vocab_size:expr) => {
        CommonIn {
            model: &$req.model,
            max_tokens: $max_tokens,
            max_tokens_param: $max_tokens_param,
            temperature: $req.temperature,
            top_p: $req.top_p,
            top_k: $req.top_k,
            seed: $req.seed.as_ref(),
            stop: $req.stop.as_ref(),
            stream: $req.stream,
            stream_options: $req.stream_options.as_ref(),
            n: $req.n,
            presence_penalty: $req.presence_penalty,
            frequency_penalty: $req.frequency_penalty,
            logit_bias: $req.logit_bias.as_ref(),
            ignore_eos: $req.ignore_eos,
            repetition_penalty: $req.repetition_penalty,
            min_p: $req.min_p,
            min_tokens: $req.min_tokens,
            stop_token_ids: $req.stop_token_ids.as_ref(),
            allowed_token_ids: $req.allowed_token_ids.as_ref(),
            bad_words: $req.bad_words.as_ref(),
            include_stop_str_in_output: $req.include_stop_str_in_output,
            vocab_size: $vocab_size,
            user: $req.user.as_deref(),
            kv: $req.kv.as_ref(),
            truncate_prompt_tokens: $req.truncate_prompt_tokens,
            priority: $req.priority,
            cache_salt: $req.cache_salt.as_ref(),
        }
    };
}

/// `model` is non-empty and bounded (whether it is served is the handler's question).
fn check_model_field(model: &str) -> Result<(), ApiError> {
    if model.is_empty() {
        return Err(ApiError::invalid_param("model", "`model` must not be empty."));
    }
    if model.len() > MAX_NAME_BYTES {
        return Err(ApiError::invalid_param("model", format!("`model` is longer than {MAX_NAME_BYTES} bytes.")));
    }
    Ok(())
}

fn validate_common(c: CommonIn<'_>) -> Result<GenParams, ApiError> {
    check_model_field(c.model)?;
    if let Some(u) = c.user
        && u.len() > MAX_NAME_BYTES
    {
        return Err(ApiError::invalid_param("user", format!("`user` is longer than {MAX_NAME_BYTES} bytes.")));
    }
    let truncate_prompt_tokens = match c.truncate_prompt_tokens {
        None => None,
        Some(n) if (1..=i64::from(MAX_TRUNCATE_PROMPT_TOKENS)).contains(&n) => Some(n as u32),
        Some(n) => {
            return Err(ApiError::invalid_param(
                "truncate_prompt_tokens",
                format!("`truncate_prompt_tokens` must be between 1 and {MAX_TRUNCATE_PROMPT_TOKENS}, got {n}."),
            ));
        }
    };
    let priority = match c.priority {
        None => 0,
        Some(p) => i32::try_from(p).map_err(|_| {
            ApiError::invalid_param(
                "priority",
                format!("`priority` must be between {} and {}, got {p}.", i32::MIN, i32::MAX),
            )
        })?,
    };
    let max_tokens = match c.max_tokens {
        None => None,
        Some(m) if m <= 0 => {
            return Err(ApiError::invalid_param(
                c.max_tokens_param,
                format!("`{}` must be at least 1, got {m}.", c.max_tokens_param),
            ));
        }
        Some(m) => Some(u32::try_from(m).map_err(|_| {
            ApiError::invalid_param(c.max_tokens_param, format!("`{}` is too large: {m}.", c.max_tokens_param))
        })?),
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid_param(
            "temperature",
            format!("`temperature` must be between 0 and 2, got {temperature}."),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    // Checked as the worker gets it: a tiny `top_p` rounds to 0 in f32, which the worker reads as "off".
    if !(top_p as f32 > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid_param(
            "top_p",
            format!("`top_p` must be in (0, 1] and at least {:e}, got {top_p}.", f32::from_bits(1)),
        ));
    }
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k < 0 => {
            return Err(ApiError::invalid_param("top_k", format!("`top_k` must be -1, 0 or positive, got {k}.")));
        }
        Some(k) => {
            u32::try_from(k).map_err(|_| ApiError::invalid_param("top_k", format!("`top_k` is too large: {k}.")))?
        }
    };
    let seed = match c.seed {
        None => None,
        Some(n) => Some(if let Some(u) = n.as_u64() {
            u
        } else if let Some(i) = n.as_i64() {
            i as u64
        } else {
            return Err(ApiError::invalid_param("seed", format!("`seed` must be an integer, got {n}.")));
        }),
    };
    let stop = parse_stop(c.stop)?;
    let logit_bias = parse_logit_bias(c.logit_bias, c.vocab_size)?;
    let n = match c.n {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as u32,
        Some(n) => {
            return Err(ApiError::invalid_param("n", format!("`n` must be between 1 and {MAX_CHOICES}, got {n}.")));
        }
    };
    let mut penalties = [0.0f32; 2];
    for (p, (name, v)) in
        penalties.iter_mut().zip([("presence_penalty", c.presence_penalty), ("frequency_penalty", c.frequency_penalty)])
    {
        let v = v.unwrap_or(0.0);
        if !(-f64::from(PENALTY_LIMIT)..=f64::from(PENALTY_LIMIT)).contains(&v) {
            return Err(ApiError::invalid_param(name, format!("`{name}` must be between -2 and 2, got {v}.")));
        }
        *p = v as f32;
    }
    let [presence_penalty, frequency_penalty] = penalties;
    let repetition_penalty = c.repetition_penalty.unwrap_or(1.0);
    if !(f64::from(MIN_REPETITION_PENALTY)..=f64::from(MAX_REPETITION_PENALTY)).contains(&repetition_penalty) {
        return Err(ApiError::invalid_param(
            "repetition_penalty",
            format!(
                "`repetition_penalty` must be between {MIN_REPETITION_PENALTY} and {MAX_REPETITION_PENALTY}, got \
                 {repetition_penalty}."
            ),
        ));
    }
    let min_p = c.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::invalid_param("min_p", format!("`min_p` must be between 0 and 1, got {min_p}.")));
    }
    let min_tokens = match c.min_tokens {
        None => 0,
        Some(m) => u32::try_from(m).ok().filter(|&m| max_tokens.is_none_or(|max| m <= max)).ok_or_else(|| {
            ApiError::invalid_param(
                "min_tokens",
                format!("`min_tokens` must be between 0 and `{}`, got {m}.", c.max_tokens_param),
            )
        })?,
    };
    let stop_token_ids = parse_stop_token_ids(c.stop_token_ids, c.vocab_size)?;
    let bad_words = parse_bad_words(c.bad_words)?;
    let allowed_token_ids = parse_allowed_token_ids(c.allowed_token_ids, c.vocab_size)?;
    let ValidKv {
        policy: kv_policy,
        budget_tokens: kv_budget_tokens,
        codec: kv_codec,
        profile_queries: kv_profile_queries,
    } = match c.kv {
        Some(kv) => validate_kv(kv)?,
        None => ValidKv::default(),
    };
    let stream = c.stream.unwrap_or(false);
    let include_usage = c.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
    let continuous_usage = include_usage && c.stream_options.and_then(|o| o.continuous_usage_stats).unwrap_or(false);
    if c.stream_options.is_some() && !stream {
        return Err(ApiError::invalid_param(
            "stream_options",
            "`stream_options` is only allowed when `stream` is true.",
        ));
    }
    Ok(GenParams {
        model: c.model.to_string(),
        max_tokens,
        stop,
        stream,
        include_usage,
        continuous_usage,
        sampling: Sampling {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            seed,
            presence_penalty,
            frequency_penalty,
            repetition_penalty: repetition_penalty as f32,
            min_p: min_p as f32,
            min_tokens,
            json_object: false,
        },
        logit_bias,
        ignore_eos: c.ignore_eos.unwrap_or(false),
        stop_token_ids,
        allowed_token_ids,
        bad_words,
        include_stop_str: c.include_stop_str_in_output.unwrap_or(false),
        json_schema: None,
        regex: None,
        grammar: None,
        tool_call: None,
        kv_policy,
        kv_budget_tokens,
        kv_codec,
        kv_profile_queries,
        logprobs: None,
        echo: false,
        n,
        truncate_prompt_tokens,
        priority,
        cache_salt: cache_salt(c.cache_salt)?,
        chat_render: ChatRender::default(),
    })
}

/// Smallest `repetition_penalty`. The worker divides the logits of repeated tokens by it, so one near 0 makes them
/// infinite and the softmax NaN; at 0.01 a logit grows at most 100-fold, which stays finite. (Below 1 the penalty
/// favours repeats; values that low are never useful, but vLLM takes anything above 0.)
pub const MIN_REPETITION_PENALTY: f32 = 0.01;

/// Longest `cache_salt`, in bytes.
pub const MAX_CACHE_SALT_BYTES: usize = 256;

/// `cache_salt`: a non-empty string of at most [`MAX_CACHE_SALT_BYTES`].
fn cache_salt(salt: Option<&Value>) -> Result<Option<String>, ApiError> {
    match salt {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_CACHE_SALT_BYTES => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::invalid_param(
            "cache_salt",
            format!("`cache_salt` must be a non-empty string of at most {MAX_CACHE_SALT_BYTES} bytes."),
        )),
    }
}

impl GenParams {
    /// The guide that constrains the answer, as `/metrics` labels it, or `None` for free text.
    pub fn guide_kind(&self) -> Option<&'static str> {
        if self.tool_call.is_some() {
            Some("tool_call")
        } else if self.json_schema.is_some() {
            Some("json_schema")
        } else if self.regex.is_some() {
            Some("regex")
        } else if self.grammar.is_some() {
            Some("grammar")
        } else {
            self.sampling.json_object.then_some("json_object")
        }
    }
}

/// What the answer must be: free text, one JSON object, a document of a JSON Schema, or a match of a pattern.
#[derive(Debug, Clone, PartialEq)]
enum Guide {
    Text,
    JsonObject,
    /// Compact JSON text of a schema that compiles.
    Schema(String),
    /// A pattern that compiles (`guided_choice` as the alternation of its strings).
    Regex(String),
    /// An EBNF grammar that compiles.
    Grammar(String),
}

impl Guide {
    fn apply(self, params: &mut GenParams) {
        match self {
            Guide::Text => {}
            Guide::JsonObject => params.sampling.json_object = true,
            Guide::Schema(s) => params.json_schema = Some(s),
            Guide::Regex(r) => params.regex = Some(r),
            Guide::Grammar(g) => params.grammar = Some(g),
        }
    }
}

/// [`GuideFields`] borrowed from a request whose guide fields carry the same names (chat, legacy completion).
macro_rules! guide_fields {
    ($req:expr) => {
        GuideFields {
            response_format: $req.response_format.as_ref(),
            guided_json: $req.guided_json.as_ref(),
            guided_regex: $req.guided_regex.as_ref(),
            guided_choice: $req.guided_choice.as_ref(),
            guided_grammar: $req.guided_grammar.as_ref(),
            structured_outputs: $req.structured_outputs.as_ref(),
        }
    };
}

/// The request fields that may guide the answer: OpenAI's `response_format`, vLLM's `guided_json`,
/// `guided_regex`, `guided_choice` and `guided_grammar`, and their successor `structured_outputs` (`json`,
/// `regex`, `choice`, `grammar`, `json_object`).
#[derive(Debug, Clone, Copy, Default)]
struct GuideFields<'a> {
    response_format: Option<&'a Value>,
    guided_json: Option<&'a Value>,
    guided_regex: Option<&'a Value>,
    guided_choice: Option<&'a Value>,
    guided_grammar: Option<&'a Value>,
    structured_outputs: Option<&'a Value>,
}

/// A guide field as given, before anything is compiled.
enum GivenGuide<'a> {
    /// `response_format` other than `text` (it compiles its own schema).
    ResponseFormat(&'a Value),
    JsonObject,
    Schema(&'a Value),
    Regex(&'a Value),
    Choice(&'a Value),
    Grammar(&'a Value),
}

/// The guide of a request; at most one field may give one. Schemas and patterns are compiled here, so one the
/// worker's guide cannot follow is a 400 that says why. Compiling costs up to a tenth of a second, so the fields
/// are counted first: a request with two guides is refused without compiling either.
fn parse_guide<'a>(f: GuideFields<'a>) -> Result<Guide, ApiError> {
    let mut found: Vec<(String, GivenGuide<'a>)> = Vec::new();
    if let Some(rf) = f.response_format.filter(|v| !v.is_null())
        && rf.get("type").and_then(Value::as_str) != Some("text")
    {
        found.push(("response_format".into(), GivenGuide::ResponseFormat(rf)));
    }
    let given = |v: Option<&'a Value>| v.filter(|v| !v.is_null());
    if let Some(v) = given(f.guided_json) {
        found.push(("guided_json".into(), GivenGuide::Schema(v)));
    }
    if let Some(v) = given(f.guided_regex) {
        found.push(("guided_regex".into(), GivenGuide::Regex(v)));
    }
    if let Some(v) = given(f.guided_choice) {
        found.push(("guided_choice".into(), GivenGuide::Choice(v)));
    }
    if let Some(v) = given(f.guided_grammar) {
        found.push(("guided_grammar".into(), GivenGuide::Grammar(v)));
    }
    if let Some(v) = given(f.structured_outputs) {
        let Some(fields) = v.as_object() else {
            return Err(ApiError::invalid_param("structured_outputs", "`structured_outputs` must be an object."));
        };
        for (key, v) in fields.iter().filter(|(_, v)| !v.is_null()) {
            let param = format!("structured_outputs.{key}");
            let guide = match key.as_str() {
                "json" => GivenGuide::Schema(v),
                "regex" => GivenGuide::Regex(v),
                "choice" => GivenGuide::Choice(v),
                "grammar" => GivenGuide::Grammar(v),
                "json_object" => match v {
                    Value::Bool(true) => GivenGuide::JsonObject,
                    Value::Bool(false) => continue,
                    _ => return Err(ApiError::invalid_param(param, "`json_object` must be a boolean.")),
                },
                // A backend hint: there is one backend, and it has no fallback to disable.
                "disable_fallback" => continue,
                _ => {
                    return Err(ApiError::invalid_param(
                        param,
                        format!(
                            "`structured_outputs.{key}` is not supported; use `json`, `regex`, `choice`, `grammar` or `json_object`."
                        ),
                    ));
                }
            };
            found.push((param, guide));
        }
    }
    if found.len() > 1 {
        return Err(ApiError::invalid_param(
            found[1].0.clone(),
            format!("Give only one of `{}` and `{}`: each guides the whole answer.", found[0].0, found[1].0),
        ));
    }
    let Some((param, given)) = found.pop() else { return Ok(Guide::Text) };
    Ok(match given {
        GivenGuide::ResponseFormat(rf) => parse_response_format(Some(rf))?,
        GivenGuide::JsonObject => Guide::JsonObject,
        GivenGuide::Schema(v) => Guide::Schema(schema_value(v, &param)?),
        GivenGuide::Regex(v) => Guide::Regex(regex_value(v, &param)?),
        GivenGuide::Choice(v) => Guide::Regex(choice_value(v, &param)?),
        GivenGuide::Grammar(v) => Guide::Grammar(grammar_value(v, &param)?),
    })
}

/// A regex- or grammar-guided answer ends on a stop token once it matches, so it needs one: `ignore_eos` drops
/// the model's, and then `stop_token_ids` must give another.
fn check_regex_can_end(params: &GenParams) -> Result<(), ApiError> {
    let guide = if params.regex.is_some() {
        "regex"
    } else if params.grammar.is_some() {
        "grammar"
    } else {
        return Ok(());
    };
    if params.ignore_eos && params.stop_token_ids.is_empty() {
        return Err(ApiError::invalid_param(
            "ignore_eos",
            format!(
                "A {guide}-guided answer ends on a stop token once it matches: drop `ignore_eos` or give `stop_token_ids`."
            ),
        ));
    }
    Ok(())
}

/// OpenAI's `response_format`: `text`, `json_object` or `json_schema`.
fn parse_response_format(response_format: Option<&Value>) -> Result<Guide, ApiError> {
    const FORMATS: &str = "`response_format` must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \
         \"json_schema\": {\"name\": ..., \"schema\": {...}}}.";
    Ok(match response_format {
        None | Some(Value::Null) => Guide::Text,
        Some(rf) => match rf.get("type").and_then(Value::as_str) {
            Some("text") => Guide::Text,
            Some("json_object") => Guide::JsonObject,
            Some("json_schema") => {
                let spec = rf.get("json_schema").and_then(Value::as_object);
                let Some(schema) = spec.and_then(|s| s.get("schema")) else {
                    return Err(ApiError::invalid_param(
                        "response_format.json_schema.schema",
                        "`response_format.json_schema` must be an object with a `schema`.",
                    ));
                };
                match spec.and_then(|s| s.get("name")) {
                    None => {}
                    Some(Value::String(n)) if is_identifier(n) => {}
                    Some(_) => {
                        return Err(ApiError::invalid_param(
                            "response_format.json_schema.name",
                            "`name` must be 1 to 64 letters, digits, underscores or dashes.",
                        ));
                    }
                }
                Guide::Schema(compile_schema(schema, "response_format.json_schema.schema")?)
            }
            _ => return Err(ApiError::invalid_param("response_format", FORMATS)),
        },
    })
}

/// A schema given as an object or as its JSON text (vLLM takes both).
fn schema_value(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::String(text) => match serde_json::from_str::<Value>(text) {
            Ok(v) => compile_schema(&v, param),
            Err(e) => Err(ApiError::invalid_param(param, format!("`{param}` is not valid JSON: {e}."))),
        },
        v => compile_schema(v, param),
    }
}

/// A pattern the worker's guide compiles.
fn regex_value(v: &Value, param: &str) -> Result<String, ApiError> {
    let Value::String(pattern) = v else {
        return Err(ApiError::invalid_param(param, format!("`{param}` must be a string.")));
    };
    ByteDfa::compile(pattern).map_err(|e| ApiError::invalid_param(param, format!("`{param}`: {e}.")))?;
    Ok(pattern.clone())
}

/// A grammar the worker's guide compiles.
fn grammar_value(v: &Value, param: &str) -> Result<String, ApiError> {
    let Value::String(text) = v else {
        return Err(ApiError::invalid_param(param, format!("`{param}` must be a string.")));
    };
    Grammar::compile(text).map_err(|e| ApiError::invalid_param(param, format!("`{param}`: {e}.")))?;
    Ok(text.clone())
}

/// A list of strings the answer must be one of, as the pattern of their alternation.
fn choice_value(v: &Value, param: &str) -> Result<String, ApiError> {
    let choices: Option<Vec<String>> =
        v.as_array().and_then(|items| items.iter().map(|c| c.as_str().map(str::to_string)).collect());
    let Some(choices) = choices else {
        return Err(ApiError::invalid_param(param, format!("`{param}` must be an array of strings.")));
    };
    let pattern =
        ByteDfa::choice_pattern(&choices).map_err(|e| ApiError::invalid_param(param, format!("`{param}`: {e}.")))?;
    ByteDfa::compile(&pattern).map_err(|e| ApiError::invalid_param(param, format!("`{param}`: {e}.")))?;
    Ok(pattern)
}

/// A schema's or a function's name as OpenAI takes it: 1 to 64 letters, digits, underscores or dashes.
fn is_identifier(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// At most this many `tools` in one request.
pub const MAX_TOOLS: usize = 128;

/// `tools` and `tool_choice`: the function the answer must call, with its `parameters` schema's text, or `None`
/// when no call is forced. The model's chat template defines no tool-call format, so a call cannot be parsed out
/// of free text (`auto`); a call is forced instead (vLLM's named function calling): `tool_choice` names the
/// function, or is `required` with a single tool, and the answer is guided by its parameters.
fn parse_tool_call(tools: Option<&[Value]>, choice: Option<&Value>) -> Result<Option<(String, String)>, ApiError> {
    let tools = tools.unwrap_or_default();
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::invalid_param("tools", format!("At most {MAX_TOOLS} tools are allowed.")));
    }
    let mut functions = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let f = tool.get("function").filter(|_| tool.get("type").and_then(Value::as_str) == Some("function"));
        let name = f.and_then(|f| f.get("name")).and_then(Value::as_str).filter(|n| is_identifier(n));
        let (Some(f), Some(name)) = (f, name) else {
            return Err(ApiError::invalid_param(
                format!("tools[{i}]"),
                "A tool must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}, with \
                 a name of 1 to 64 letters, digits, underscores or dashes.",
            ));
        };
        functions.push((name, f.get("parameters")));
    }
    let none = || Ok(None);
    let chosen = match choice {
        Some(Value::String(c)) if c == "none" => return none(),
        None | Some(Value::Null) if functions.is_empty() => return none(),
        _ if functions.is_empty() => {
            return Err(ApiError::invalid_param("tool_choice", "`tool_choice` needs `tools`."));
        }
        Some(Value::String(c)) if c == "required" && functions.len() == 1 => 0,
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).unwrap_or_default();
            match functions.iter().position(|(n, _)| *n == name) {
                Some(i) => i,
                None => {
                    return Err(ApiError::invalid_param(
                        "tool_choice",
                        format!("`tool_choice` names {name:?}, which is not among `tools`."),
                    ));
                }
            }
        }
        _ => {
            return Err(ApiError::invalid_param(
                "tool_choice",
                "This model's chat template defines no tool-call format, so the model cannot choose a call itself \
                 (`auto`, or `required` among several tools). Force one: `tool_choice` {\"type\": \"function\", \
                 \"function\": {\"name\": ...}}, or `required` with a single tool.",
            ));
        }
    };
    let (name, parameters) = functions[chosen];
    let empty = Value::Object(serde_json::Map::from_iter([
        ("type".to_string(), Value::String("object".into())),
        ("properties".to_string(), Value::Object(serde_json::Map::new())),
        ("additionalProperties".to_string(), Value::Bool(false)),
    ]));
    let schema = compile_schema(parameters.unwrap_or(&empty), &format!("tools[{chosen}].function.parameters"))?;
    Ok(Some((name.to_string(), schema)))
}

/// The schema's compact JSON text, once it is known to compile and fit [`MAX_SCHEMA_BYTES`](pagoda_worker::json_schema::MAX_SCHEMA_BYTES).
fn compile_schema(schema: &Value, param: &str) -> Result<String, ApiError> {
    let text = serde_json::to_string(schema)
        .map_err(|e| ApiError::invalid_param(param, format!("The schema cannot be serialised: {e}.")))?;
    JsonSchema::parse(&text).map_err(|e| ApiError::invalid_param(param, format!("{e}.")))?;
    Ok(text)
}

/// At most this many `stop_token_ids` in one request.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// `stop_token_ids`: null or an array of at most [`MAX_STOP_TOKEN_IDS`] token ids below `vocab_size`.
fn parse_stop_token_ids(v: Option<&Value>, vocab_size: usize) -> Result<Vec<u32>, ApiError> {
    parse_token_ids(v, vocab_size, "stop_token_ids", MAX_STOP_TOKEN_IDS)
}

/// vLLM's `allowed_token_ids`: null, or a non-empty array of token ids below `vocab_size` (at most that many),
/// returned sorted without repeats.
fn parse_allowed_token_ids(v: Option<&Value>, vocab_size: usize) -> Result<Vec<u32>, ApiError> {
    let mut ids = parse_token_ids(v, vocab_size, "allowed_token_ids", vocab_size)?;
    if matches!(v, Some(Value::Array(_))) && ids.is_empty() {
        return Err(ApiError::invalid_param(
            "allowed_token_ids",
            "`allowed_token_ids` must name at least one token; leave it out to allow them all.",
        ));
    }
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

/// `param`: null or an array of at most `max` token ids below `vocab_size`.
/// At most this many `bad_words` (each becomes up to two token sequences: as written and after a space).
pub const MAX_BAD_WORDS: usize = pagoda_worker::sampling::MAX_BAD_WORDS / 2;
/// Longest `bad_words` entry, in bytes, before it is tokenized (then it must fit
/// [`pagoda_worker::sampling::MAX_BAD_WORD_TOKENS`]).
pub const MAX_BAD_WORD_BYTES: usize = 256;

/// vLLM's `bad_words`: null, or an array of at most [`MAX_BAD_WORDS`] strings, each with some text that is not
/// whitespace, of at most [`MAX_BAD_WORD_BYTES`] bytes.
fn parse_bad_words(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    bounded_array(v, "bad_words", MAX_BAD_WORDS, "strings")?
        .iter()
        .enumerate()
        .map(|(i, v)| match v.as_str() {
            Some(w) if !w.trim().is_empty() && w.len() <= MAX_BAD_WORD_BYTES => Ok(w.to_string()),
            _ => Err(ApiError::invalid_param(
                format!("bad_words[{i}]"),
                format!("`bad_words[{i}]` must be a string with text, of at most {MAX_BAD_WORD_BYTES} bytes."),
            )),
        })
        .collect()
}

/// An optional array field: empty for null or absent, else its items, at most `max` of them (400s naming `param`
/// otherwise; `of` says what the items are, for the message).
fn bounded_array<'a>(v: Option<&'a Value>, param: &str, max: usize, of: &str) -> Result<&'a [Value], ApiError> {
    match v {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(items)) if items.len() <= max => Ok(items),
        Some(Value::Array(items)) => Err(ApiError::invalid_param(
            param,
            format!("`{param}` has {} entries; at most {max} are allowed.", items.len()),
        )),
        Some(other) => Err(ApiError::invalid_param(
            param,
            format!("`{param}` must be an array of {of}, got {}.", type_name(other)),
        )),
    }
}

/// vLLM's tokenization of `bad_words`: each word without its leading whitespace, as it would start the answer,
/// and after a space, as it would follow another word, where that is a different token sequence of the same
/// length (vLLM's rule: otherwise the space would only add a token of its own). `encode` tokenizes without
/// special tokens.
pub fn bad_word_sequences<E>(
    words: &[String],
    mut encode: impl FnMut(&str) -> Result<Vec<u32>, E>,
) -> Result<Vec<Vec<u32>>, (usize, E)> {
    let mut out = Vec::with_capacity(2 * words.len());
    for (i, word) in words.iter().enumerate() {
        let word = word.trim_start();
        let bare = encode(word).map_err(|e| (i, e))?;
        let spaced = encode(&format!(" {word}")).map_err(|e| (i, e))?;
        let distinct = spaced.len() == bare.len() && spaced.first() != bare.first();
        out.push(bare);
        if distinct {
            out.push(spaced);
        }
    }
    Ok(out)
}

fn parse_token_ids(v: Option<&Value>, vocab_size: usize, param: &str, max: usize) -> Result<Vec<u32>, ApiError> {
    bounded_array(v, param, max, "token ids")?
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64().filter(|&t| (t as usize) < vocab_size).map(|t| t as u32).ok_or_else(|| {
                ApiError::invalid_param(
                    format!("{param}[{i}]"),
                    format!("Token id {v} is not in the vocabulary (size {vocab_size})."),
                )
            })
        })
        .collect()
}

/// `min_tokens` against the completion budget a prompt leaves (`max_tokens` may have been left to the context).
pub fn check_min_tokens(params: &GenParams, max_tokens: u32) -> Result<(), ApiError> {
    let m = params.sampling.min_tokens;
    if m > max_tokens {
        return Err(ApiError::invalid_param(
            "min_tokens",
            format!("`min_tokens` is {m}, more than the {max_tokens} tokens the completion may have."),
        ));
    }
    Ok(())
}

/// A count of alternatives per token, `0..=MAX_TOP_LOGPROBS`, named `param` in the error.
fn top_logprobs_count(n: i64, param: &'static str) -> Result<u32, ApiError> {
    u32::try_from(n).ok().filter(|&n| n <= MAX_TOP_LOGPROBS).ok_or_else(|| {
        ApiError::invalid_param(param, format!("`{param}` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}."))
    })
}

/// `logit_bias`: null or an object from token ids (decimal strings, below `vocab_size`) to biases in
/// `[-100, 100]`, at most [`MAX_LOGIT_BIAS`] of them; returned ascending by token id, as the worker's
/// [`check_logit_bias`](pagoda_worker::sampling::check_logit_bias) leaves it.
pub fn parse_logit_bias(v: Option<&Value>, vocab_size: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(_) => {
            return Err(ApiError::invalid_param(
                "logit_bias",
                "`logit_bias` must be an object from token ids to biases.",
            ));
        }
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid_param(
            "logit_bias",
            format!("`logit_bias` has {} entries; at most {MAX_LOGIT_BIAS} are allowed.", map.len()),
        ));
    }
    let mut bias = Vec::with_capacity(map.len());
    for (key, value) in map {
        let token = key
            .parse::<u32>()
            .ok()
            .filter(|&t| key.bytes().all(|b| b.is_ascii_digit()) && (t as usize) < vocab_size)
            .ok_or_else(|| {
                ApiError::invalid_param(
                    "logit_bias",
                    format!("`logit_bias` key {key:?} is not a token id in the vocabulary (size {vocab_size})."),
                )
            })?;
        let limit = f64::from(LOGIT_BIAS_LIMIT);
        let b = value.as_f64().filter(|b| (-limit..=limit).contains(b)).ok_or_else(|| {
            ApiError::invalid_param(
                "logit_bias",
                format!("`logit_bias[{key:?}]` must be a number from -100 to 100, got {value}."),
            )
        })?;
        bias.push((token, b as f32));
    }
    // Sorts, and finds a token named twice ("5" and "05"): the worker's own check, so both sides agree.
    pagoda_worker::sampling::check_logit_bias(&mut bias, vocab_size)
        .map_err(|e| ApiError::invalid_param("logit_bias", format!("{e}.")))?;
    Ok(bias)
}

/// `stop`: null, a string, or an array of strings; bounded count and length, no empty strings.
pub fn parse_stop(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list: Vec<String> = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP {
                return Err(ApiError::invalid_param(
                    "stop",
                    format!("`stop` has {} strings; at most {MAX_STOP} are allowed.", items.len()),
                ));
            }
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::String(s) => out.push(s.clone()),
                    other => {
                        return Err(ApiError::invalid_param(
                            format!("stop[{i}]"),
                            format!("`stop[{i}]` must be a string, got {}.", type_name(other)),
                        ));
                    }
                }
            }
            out
        }
        Some(other) => {
            return Err(ApiError::invalid_param(
                "stop",
                format!("`stop` must be a string or an array of strings, got {}.", type_name(other)),
            ));
        }
    };
    for s in &list {
        if s.is_empty() {
            return Err(ApiError::invalid_param("stop", "Stop strings must not be empty."));
        }
        if s.len() > MAX_STOP_BYTES {
            return Err(ApiError::invalid_param(
                "stop",
                format!("A stop string is {} bytes long; the limit is {MAX_STOP_BYTES}.", s.len()),
            ));
        }
    }
    Ok(list)
}

/// The `kv` extension once checked, as it is forwarded to the worker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ValidKv {
    /// Policy name; empty takes the worker's default.
    pub policy: String,
    /// Budget in tokens per (layer, kv-head); 0 takes the policy's default.
    pub budget_tokens: u32,
    /// The codec of the request's groups in the lower tiers; empty takes the worker's.
    pub codec: String,
    /// Training queries, as text.
    pub profile_queries: Vec<String>,
}

/// The codecs a request may name for its groups in the lower tiers, besides `native` (`kv.codec`).
pub const KV_CODECS: [&str; 6] = ["bf16", "int8", "fp8_e4m3", "fp8_e4m3_rotated", "int4_kivi", "int2_kivi"];

/// The `kv` extension: a known eviction policy, a budget within bounds, a known codec, and at most
/// [`MAX_PROFILE_QUESTIONS`](pagoda_worker::placement::MAX_PROFILE_QUESTIONS) non-empty training queries of at
/// most [`MAX_PROFILE_QUERY_BYTES`] each.
pub fn validate_kv(kv: &KvOptions) -> Result<ValidKv, ApiError> {
    use pagoda_worker::placement::MAX_PROFILE_QUESTIONS;
    use pagoda_worker::policy::{PolicyKind, defaults, policy_names};
    let policy = match &kv.policy {
        None => String::new(),
        Some(p) => match PolicyKind::parse(p) {
            Some(k) => k.name().to_owned(),
            None => {
                let shown: String = p.chars().take(64).collect();
                return Err(ApiError::invalid_param(
                    "kv.policy",
                    format!("Unknown kv.policy `{shown}`; supported policies: {}.", policy_names()),
                ));
            }
        },
    };
    let budget = match kv.budget_tokens {
        None => 0,
        Some(b) if b >= defaults::MIN_BUDGET_TOKENS as i64 && b <= u32::MAX as i64 => b as u32,
        Some(b) => {
            return Err(ApiError::invalid_param(
                "kv.budget_tokens",
                format!("`kv.budget_tokens` must be an integer of at least {}, got {b}.", defaults::MIN_BUDGET_TOKENS),
            ));
        }
    };
    let codec = match kv.codec.as_deref() {
        None => String::new(),
        Some(c) => match c.parse::<GroupCodec>() {
            Ok(GroupCodec::Native(_)) => "native".to_string(),
            Ok(GroupCodec::Kv(k)) if KV_CODECS.contains(&k.name()) => k.name().to_string(),
            _ => {
                let shown: String = c.chars().take(64).collect();
                return Err(ApiError::invalid_param(
                    "kv.codec",
                    format!("Unknown kv.codec `{shown}`; supported codecs: native, {}.", KV_CODECS.join(", ")),
                ));
            }
        },
    };
    let profile_queries = kv.profile_queries.clone().unwrap_or_default();
    if profile_queries.len() > MAX_PROFILE_QUESTIONS {
        return Err(ApiError::invalid_param(
            "kv.profile_queries",
            format!(
                "`kv.profile_queries` has {} entries; at most {MAX_PROFILE_QUESTIONS} are allowed.",
                profile_queries.len()
            ),
        ));
    }
    for (i, q) in profile_queries.iter().enumerate() {
        if q.trim().is_empty() || q.len() > MAX_PROFILE_QUERY_BYTES {
            return Err(ApiError::invalid_param(
                format!("kv.profile_queries[{i}]"),
                format!(
                    "`kv.profile_queries[{i}]` must be non-empty text of at most {MAX_PROFILE_QUERY_BYTES} bytes, got {} bytes.",
                    q.len()
                ),
            ));
        }
    }
    Ok(ValidKv { policy, budget_tokens: budget, codec, profile_queries })
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Chat messages ready for the template: at least one, at most [`MAX_MESSAGES`], names and contents bounded.
fn validate_messages(messages: &[ChatMessageIn]) -> Result<Vec<Turn>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "`messages` must contain at least one message."));
    }
    if messages.len() > MAX_MESSAGES {
        return Err(ApiError::invalid_param(
            "messages",
            format!("`messages` has {} messages; at most {MAX_MESSAGES} are allowed.", messages.len()),
        ));
    }
    let mut turns = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if let Some(name) = &m.name
            && name.len() > MAX_NAME_BYTES
        {
            return Err(ApiError::invalid_param(
                format!("messages[{i}].name"),
                format!("`name` is longer than {MAX_NAME_BYTES} bytes."),
            ));
        }
        if m.tool_call_id.as_ref().is_some_and(|id| id.len() > MAX_NAME_BYTES) {
            return Err(ApiError::invalid_param(
                format!("messages[{i}].tool_call_id"),
                format!("`tool_call_id` is longer than {MAX_NAME_BYTES} bytes."),
            ));
        }
        let content = match m.tool_calls.as_deref() {
            None | Some([]) => message_text(i, &m.content)?,
            Some(calls) if m.role == Role::Assistant => assistant_calls_text(i, &m.content, calls)?,
            Some(_) => {
                return Err(ApiError::invalid_param(
                    format!("messages[{i}].tool_calls"),
                    "Only an assistant message has `tool_calls`.",
                ));
            }
        };
        turns.push(Turn { role: m.role.template_name(), content });
    }
    Ok(turns)
}

/// An assistant turn that called functions, as the template sees it: its text, if any, then one line per call,
/// `{"name": ..., "arguments": ...}` (the arguments as JSON where they parse). The chat template has no tool-call
/// format of its own; this one is what the model reads back of its own calls.
fn assistant_calls_text(i: usize, content: &Value, calls: &[Value]) -> Result<String, ApiError> {
    if calls.len() > MAX_TOOLS {
        return Err(ApiError::invalid_param(
            format!("messages[{i}].tool_calls"),
            format!("At most {MAX_TOOLS} calls are allowed."),
        ));
    }
    let mut lines = Vec::with_capacity(calls.len() + 1);
    if !content.is_null() {
        lines.push(message_text(i, content)?);
    }
    for (j, call) in calls.iter().enumerate() {
        let f = call.get("function");
        let (Some(name), Some(arguments)) = (
            f.and_then(|f| f.get("name")).and_then(Value::as_str),
            f.and_then(|f| f.get("arguments")).and_then(Value::as_str),
        ) else {
            return Err(ApiError::invalid_param(
                format!("messages[{i}].tool_calls[{j}]"),
                "A call must be {\"function\": {\"name\": ..., \"arguments\": \"<JSON text>\"}}.",
            ));
        };
        let arguments = serde_json::from_str::<Value>(arguments).unwrap_or_else(|_| Value::String(arguments.into()));
        let line = serde_json::json!({"name": name, "arguments": arguments});
        lines.push(line.to_string());
    }
    let text = lines.join("\n");
    if text.len() > MAX_TEXT_BYTES {
        return Err(ApiError::invalid_param(
            format!("messages[{i}].tool_calls"),
            format!("The calls are {} bytes; the limit is {MAX_TEXT_BYTES}.", text.len()),
        ));
    }
    Ok(text)
}

/// Message content: a string, or an array of `{"type": "text", "text": ...}` parts (joined).
fn message_text(i: usize, content: &Value) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    let text = match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => {
            if parts.len() > MAX_PARTS {
                return Err(ApiError::invalid_param(param, format!("At most {MAX_PARTS} content parts are allowed.")));
            }
            let mut out = String::new();
            for (j, part) in parts.iter().enumerate() {
                let ty = part.get("type").and_then(Value::as_str);
                match (ty, part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (Some("text"), None) => {
                        return Err(ApiError::invalid_param(
                            format!("{param}[{j}].text"),
                            "A text content part needs a string `text`.",
                        ));
                    }
                    (Some(other), _) => {
                        let shown: String = other.chars().take(32).collect();
                        return Err(ApiError::invalid_param(
                            format!("{param}[{j}].type"),
                            format!("Content part type `{shown}` is not supported; only `text` is."),
                        ));
                    }
                    (None, _) => {
                        return Err(ApiError::invalid_param(
                            format!("{param}[{j}]"),
                            "A content part must be an object with a string `type`.",
                        ));
                    }
                }
            }
            out
        }
        Value::Null => {
            return Err(ApiError::invalid_param(param, format!("`messages[{i}].content` is required.")));
        }
        other => {
            return Err(ApiError::invalid_param(
                param,
                format!(
                    "`messages[{i}].content` must be a string or an array of text parts, got {}.",
                    type_name(other)
                ),
            ));
        }
    };
    if text.len() > MAX_TEXT_BYTES {
        return Err(ApiError::invalid_param(
            format!("messages[{i}].content"),
            format!("Message content is {} bytes; the limit is {MAX_TEXT_BYTES}.", text.len()),
        ));
    }
    Ok(text)
}

impl ChatCompletionRequest {
    /// Validates everything that does not need the tokenizer; `logit_bias` token ids are checked against
    /// `vocab_size`.
    pub fn validate(&self, vocab_size: usize) -> Result<(Vec<Turn>, GenParams), ApiError> {
        let turns = validate_messages(&self.messages)?;
        if let (Some(a), Some(b)) = (self.max_tokens, self.max_completion_tokens)
            && a != b
        {
            return Err(ApiError::invalid_param(
                "max_completion_tokens",
                "`max_tokens` and `max_completion_tokens` disagree; send only one.",
            ));
        }
        let (max_tokens, max_tokens_param) = match self.max_completion_tokens {
            Some(m) => (Some(m), "max_completion_tokens"),
            None => (self.max_tokens, "max_tokens"),
        };
        let top_logprobs = self.top_logprobs.map(|n| top_logprobs_count(n, "top_logprobs")).transpose()?;
        let logprobs = match (self.logprobs, top_logprobs) {
            (Some(true), n) => Some(n.unwrap_or(0)),
            (_, Some(n)) if n > 0 => {
                return Err(ApiError::invalid_param("top_logprobs", "`top_logprobs` needs `logprobs` set to true."));
            }
            _ => None,
        };
        let guide = parse_guide(guide_fields!(self))?;
        let tool_call = parse_tool_call(self.tools.as_deref(), self.tool_choice.as_ref())?;
        if tool_call.is_some() && guide != Guide::Text {
            return Err(ApiError::invalid_param(
                "tool_choice",
                "A forced function call is guided by the function's parameters; drop the other guide.",
            ));
        }
        let mut params = validate_common(common_in!(self, max_tokens, max_tokens_param, vocab_size))?;
        params.logprobs = logprobs;
        params.chat_render = ChatRender::parse(self.add_generation_prompt, self.continue_final_message, &turns)?;
        guide.apply(&mut params);
        check_regex_can_end(&params)?;
        if let Some((name, schema)) = tool_call {
            params.tool_call = Some(name);
            params.json_schema = Some(schema);
        }
        Ok((turns, params))
    }
}

impl CompletionRequest {
    /// Validates everything that does not need the tokenizer; token-id prompts are checked against `vocab_size`.
    /// `prompt` is one prompt (a string or token ids) or a batch of them (strings, or arrays of token ids), each
    /// with its own `n` choices.
    pub fn validate(&self, vocab_size: usize) -> Result<(Vec<PromptInput>, GenParams), ApiError> {
        let ids = |items: &[Value], param: &dyn Fn(usize) -> String| -> Result<PromptInput, ApiError> {
            if items.is_empty() {
                return Err(ApiError::invalid_param(param(0), "A token-id prompt must not be empty."));
            }
            let mut ids = Vec::with_capacity(items.len());
            for (i, v) in items.iter().enumerate() {
                match v.as_u64() {
                    Some(id) if (id as usize) < vocab_size => ids.push(id as u32),
                    _ => {
                        return Err(ApiError::invalid_param(
                            param(i),
                            format!("Token id {v} is not in the vocabulary (size {vocab_size})."),
                        ));
                    }
                }
            }
            Ok(PromptInput::Tokens(ids))
        };
        let prompts = match &self.prompt {
            Value::String(s) => vec![PromptInput::Text(s.clone())],
            Value::Array(items) if items.is_empty() => {
                return Err(ApiError::invalid_param("prompt", "`prompt` must not be empty."));
            }
            // A token-id prompt is one prompt however long (the context length bounds it); only batches count.
            Value::Array(items) if items.len() > MAX_CHOICES && !items.iter().all(Value::is_number) => {
                return Err(ApiError::invalid_param(
                    "prompt",
                    format!("`prompt` is a batch of {}; at most {MAX_CHOICES} prompts are allowed.", items.len()),
                ));
            }
            Value::Array(items) if items.iter().all(Value::is_string) => {
                items.iter().map(|s| PromptInput::Text(s.as_str().unwrap_or_default().to_string())).collect()
            }
            Value::Array(items) if items.iter().all(Value::is_number) => {
                vec![ids(items, &|i| format!("prompt[{i}]"))?]
            }
            Value::Array(items) if items.iter().all(Value::is_array) => items
                .iter()
                .enumerate()
                .map(|(b, v)| ids(v.as_array().map_or(&[], Vec::as_slice), &|i| format!("prompt[{b}][{i}]")))
                .collect::<Result<_, _>>()?,
            Value::Array(_) => {
                return Err(ApiError::invalid_param(
                    "prompt",
                    "`prompt` must be a string, an array of token ids, or a batch: an array of strings or of \
                     token-id arrays.",
                ));
            }
            Value::Null => return Err(ApiError::invalid_param("prompt", "`prompt` is required.")),
            other => {
                return Err(ApiError::invalid_param(
                    "prompt",
                    format!("`prompt` must be a string or an array of token ids, got {}.", type_name(other)),
                ));
            }
        };
        for (b, prompt) in prompts.iter().enumerate() {
            let param = if prompts.len() == 1 { "prompt".to_string() } else { format!("prompt[{b}]") };
            if let PromptInput::Text(t) = prompt {
                if t.is_empty() {
                    return Err(ApiError::invalid_param(param, "`prompt` must not be empty."));
                }
                if t.len() > MAX_TEXT_BYTES {
                    return Err(ApiError::invalid_param(
                        param,
                        format!("`prompt` is {} bytes; the limit is {MAX_TEXT_BYTES}.", t.len()),
                    ));
                }
            }
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid_param("suffix", "`suffix` is not supported."));
        }
        let logprobs = self.logprobs.map(|n| top_logprobs_count(n, "logprobs")).transpose()?;
        let mut params = validate_common(common_in!(self, self.max_tokens, "max_tokens", vocab_size))?;
        params.logprobs = logprobs;
        params.echo = self.echo.unwrap_or(false);
        parse_guide(guide_fields!(self))?.apply(&mut params);
        check_regex_can_end(&params)?;
        if let Some(b) = self.best_of.filter(|&b| b != i64::from(params.n)) {
            return Err(ApiError::invalid_param(
                "best_of",
                format!("Only `best_of` equal to `n` ({}) is supported, got {b}.", params.n),
            ));
        }
        if prompts.len() * params.n as usize > MAX_CHOICES {
            return Err(ApiError::invalid_param(
                "n",
                format!(
                    "{} prompts with `n` = {} make {} choices; at most {MAX_CHOICES} are allowed.",
                    prompts.len(),
                    params.n,
                    prompts.len() * params.n as usize
                ),
            ));
        }
        Ok((prompts, params))
    }
}

/// Checks the prompt and completion lengths against the context and returns the completion budget.
pub fn check_lengths(prompt_tokens: usize, max_tokens: Option<u32>, context: usize) -> Result<u32, ApiError> {
    if prompt_tokens == 0 {
        return Err(ApiError::invalid_param("messages", "The prompt is empty after tokenization."));
    }
    if prompt_tokens >= context {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid_param(
                "messages",
                format!(
                    "This model's maximum context length is {context} tokens. However, your prompt is \
                     {prompt_tokens} tokens, which leaves no room for a completion."
                ),
            )
        });
    }
    match max_tokens {
        None => Ok((context - prompt_tokens) as u32),
        Some(m) if m as usize > context => Err(ApiError::invalid_param(
            "max_tokens",
            format!("`max_tokens` is {m}, more than the model's maximum context length of {context} tokens."),
        )),
        Some(m) if prompt_tokens + m as usize > context => Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid_param(
                "max_tokens",
                format!(
                    "This model's maximum context length is {context} tokens. However, you requested {} tokens \
                     ({prompt_tokens} in the prompt, {m} in the completion). Please reduce the prompt or the \
                     completion length.",
                    prompt_tokens + m as usize
                ),
            )
        }),
        Some(m) => Ok(m),
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Responses.

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    /// Absent from the running usage of a chunk under `continuous_usage_stats` (vLLM omits it there too: the cached
    /// count arrives with the end of the generation).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
        }
    }

    /// Prompt tokens served from the prefix cache (0 where the count is absent).
    pub fn cached_tokens(&self) -> u32 {
        self.prompt_tokens_details.as_ref().map_or(0, |d| d.cached_tokens)
    }

    /// The usage of a choice still generating (`continuous_usage_stats`): tokens so far, no cached count.
    pub fn running(prompt_tokens: u32, completion_tokens: u32) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// `null` when the answer is a function call.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

impl AssistantMessage {
    /// The answer `text`: the content, or the arguments of the request's forced function call.
    pub fn new(text: String, tool_call: Option<&str>, call_id: impl FnOnce() -> String) -> AssistantMessage {
        match tool_call {
            None => AssistantMessage { role: "assistant", content: Some(text), tool_calls: None },
            Some(name) => AssistantMessage {
                role: "assistant",
                content: None,
                tool_calls: Some(vec![ToolCall {
                    id: call_id(),
                    kind: "function",
                    function: FunctionCall { name: name.to_string(), arguments: text },
                }]),
            },
        }
    }
}

/// A function call in an assistant message.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as JSON text, as OpenAI sends them.
    pub arguments: String,
}

/// A function call's piece of a stream: the first one carries its id, type and name, the rest more arguments.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// vLLM's `stop_reason` on a choice: the stop string, or the request's own stop token id, that ended it; `null`
/// when it ended otherwise (the model's end token, its length).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum StopReason {
    Text(String),
    Token(u32),
}

impl StopReason {
    /// The stop string, when a stop string ended the choice.
    pub fn text(&self) -> Option<&str> {
        match self {
            StopReason::Text(s) => Some(s),
            StopReason::Token(_) => None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
    pub stop_reason: Option<StopReason>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<StopReason>,
}

/// One `chat.completion.chunk`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    /// Present (as null until the last chunk) only when `stream_options.include_usage` is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<StopReason>,
}

/// A chat choice's `logprobs`: one entry per generated token.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

/// One generated token of a chat answer, and the most likely tokens at its position.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatTokenLogprob {
    #[serde(flatten)]
    pub chosen: ChatLogprob,
    pub top_logprobs: Vec<ChatLogprob>,
}

/// A token's text (its bytes lossily decoded when they end inside a UTF-8 character), log-probability and bytes.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

impl ChatLogprob {
    fn new(codec: &dyn TextCodec, token: u32, logprob: f32) -> ChatLogprob {
        let bytes = codec.token_bytes(token).into_owned();
        ChatLogprob { token: String::from_utf8_lossy(&bytes).into_owned(), logprob, bytes }
    }
}

impl ChatLogprobs {
    pub fn render(entries: &[TokenLogprob], codec: &dyn TextCodec) -> ChatLogprobs {
        let content = entries
            .iter()
            .map(|e| ChatTokenLogprob {
                chosen: ChatLogprob::new(codec, e.token, e.logprob),
                top_logprobs: e.top.iter().map(|&(t, l)| ChatLogprob::new(codec, t, l)).collect(),
            })
            .collect();
        ChatLogprobs { content }
    }
}

/// A completion choice's `logprobs` (the legacy shape): parallel lists over the tokens. With `echo` they start
/// with the prompt's tokens, the first of which has no log-probability (`null`).
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    /// Per token, the most likely tokens' text and log-probability, with the chosen token among them (so up to
    /// `logprobs` + 1 entries, as OpenAI's).
    pub top_logprobs: Vec<Option<TopLogprobMap>>,
    /// Where each token's text starts in the choice's `text`, in bytes.
    pub text_offset: Vec<u32>,
}

impl CompletionLogprobs {
    /// The lists of `entries`, their `text_offset` moved by `offset` bytes (what the choice's text has before
    /// the completion: the echoed prompt).
    pub fn render(entries: &[TokenLogprob], codec: &dyn TextCodec, offset: u32) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        out.extend(entries, codec, offset);
        out
    }

    /// The echoed prompt's lists: its first token, unscored, then the scored `entries`.
    pub fn echo(first_token: u32, entries: &[TokenLogprob], codec: &dyn TextCodec) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        out.tokens.push(token_text(codec, first_token));
        out.token_logprobs.push(None);
        out.top_logprobs.push(None);
        out.text_offset.push(0);
        out.extend(entries, codec, 0);
        out
    }

    pub fn extend(&mut self, entries: &[TokenLogprob], codec: &dyn TextCodec, offset: u32) {
        for e in entries {
            let chosen = (!e.top.iter().any(|&(t, _)| t == e.token)).then_some((e.token, e.logprob));
            let mut top: Vec<(String, f32)> = Vec::with_capacity(e.top.len() + 1);
            for (t, lp) in e.top.iter().copied().chain(chosen) {
                let s = token_text(codec, t);
                // Two tokens with the same lossy text would be one key: the likelier stays.
                if !top.iter().any(|(k, _)| *k == s) {
                    top.push((s, lp));
                }
            }
            self.tokens.push(token_text(codec, e.token));
            self.token_logprobs.push(Some(e.logprob));
            self.top_logprobs.push(Some(TopLogprobMap(top)));
            self.text_offset.push(e.text_offset.saturating_add(offset));
        }
    }
}

/// A token's text: its bytes, lossily decoded.
pub fn token_text(codec: &dyn TextCodec, token: u32) -> String {
    String::from_utf8_lossy(&codec.token_bytes(token)).into_owned()
}

/// `{token text: log-probability}`, in the order given (most likely first).
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprobMap(pub Vec<(String, f32)>);

impl Serialize for TopLogprobMap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// `text_completion` (also the streaming chunk object of `/v1/completions`).
#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: usize,
    /// For a LoRA adapter: the base model it runs on (vLLM's model card field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Anthropic's model object beside OpenAI's, so either SDK's `models` calls read it: `type` ("model"),
    /// `display_name` (the id) and `created_at` (`created` in RFC 3339).
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub display_name: String,
    pub created_at: String,
}

impl ModelCard {
    pub fn new(id: String, created: u64, max_model_len: usize, parent: Option<String>) -> ModelCard {
        ModelCard {
            display_name: id.clone(),
            id,
            object: "model",
            created,
            owned_by: "pagoda",
            max_model_len,
            parent,
            kind: "model",
            created_at: rfc3339_utc(created),
        }
    }
}

/// The model list, with Anthropic's paging fields beside OpenAI's `object` (one page: `has_more` false).
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
    pub has_more: bool,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
}

impl ModelList {
    pub fn new(data: Vec<ModelCard>) -> ModelList {
        let (first_id, last_id) = (data.first().map(|m| m.id.clone()), data.last().map(|m| m.id.clone()));
        ModelList { object: "list", data, has_more: false, first_id, last_id }
    }
}

/// Seconds since the Unix epoch as an RFC 3339 UTC timestamp (`1970-01-01T00:00:00Z`).
pub fn rfc3339_utc(secs: u64) -> String {
    let (year, month, day, rem) = pagoda_worker::model::chat::civil_utc(i64::try_from(secs).unwrap_or(i64::MAX));
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extract::parse_json;
    use axum::http::StatusCode;

    fn chat(body: &str) -> Result<(Vec<Turn>, GenParams), ApiError> {
        parse_json::<ChatCompletionRequest>(body.as_bytes())?.validate(100)
    }

    #[test]
    fn rfc3339_timestamps() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_utc(1_796_067_278), "2026-11-30T19:34:38Z");
        assert_eq!(rfc3339_utc(4_102_444_799), "2099-12-31T23:59:59Z");
    }

    #[test]
    fn minimal_chat_is_valid() {
        let (turns, p) = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        assert_eq!(turns, vec![Turn { role: "user", content: "hi".into() }]);
        assert_eq!(p.max_tokens, None);
        assert!(!p.stream);
        assert_eq!(p.sampling.temperature, 1.0);
    }

    #[test]
    fn cache_salt_is_a_bounded_string_that_salts_the_tenant_namespace() {
        let with = |salt: &str| {
            chat(&format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"cache_salt":{salt}}}"#))
        };
        assert_eq!(with(r#""s3cret""#).unwrap().1.cache_salt.as_deref(), Some("s3cret"));
        assert_eq!(with("null").unwrap().1.cache_salt, None);
        let long = format!("\"{}\"", "x".repeat(MAX_CACHE_SALT_BYTES + 1));
        for bad in ["\"\"", "5", "[\"a\"]", long.as_str()] {
            assert_eq!(with(bad).unwrap_err().param.as_deref(), Some("cache_salt"), "{bad}");
        }
        let c = parse_json::<CompletionRequest>(br#"{"model":"m","prompt":"hi","cache_salt":"a"}"#).unwrap();
        assert_eq!(c.validate(100).unwrap().1.cache_salt.as_deref(), Some("a"));
        let (a, b) = (salted_namespace("acme", "one"), salted_namespace("acme", "two"));
        assert_ne!(a, b);
        assert_eq!(a, salted_namespace("acme", "one"));
        assert_ne!(a, salted_namespace("globex", "one"));
        // The worker's fair schedulers take the tenant as the namespace up to the first NUL; the salt never shows.
        assert_eq!(a.split('\u{0}').next(), Some("acme"));
        assert!(!a.contains("one"));
    }

    #[test]
    fn content_parts_and_roles() {
        let (turns, _) = chat(
            r#"{"model":"m","messages":[{"role":"developer","content":"be brief"},
               {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        )
        .unwrap();
        assert_eq!(turns[0].role, "system");
        assert_eq!(turns[1].content, "ab");
        let e = chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0].type"));
    }

    #[test]
    fn bad_chats_are_400_with_param() {
        let cases = [
            (r#"{"model":"m","messages":[]}"#, "messages"),
            (r#"{"model":"m","messages":[{"role":"robot","content":"x"}]}"#, "messages[0].role"),
            (r#"{"model":"m","messages":[{"role":"user","content":5}]}"#, "messages[0].content"),
            (r#"{"model":"m","messages":[{"role":"user"}]}"#, "messages[0].content"),
            (r#"{"model":"m","messages":"hi"}"#, "messages"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0}"#, "max_tokens"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":-5}"#, "max_tokens"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":"ten"}"#, "max_tokens"),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":0}"#,
                "max_completion_tokens",
            ),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":3}"#, "temperature"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"top_p":0}"#, "top_p"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"top_k":-2}"#, "top_k"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":0}"#, "n"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":17}"#, "n"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stop":[""]}"#, "stop"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stop":[1]}"#, "stop[0]"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stop":{}}"#, "stop"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":"yes"}"#, "stream"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"kv":{"policy":"lru"}}"#, "kv.policy"),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"kv":{"codec":"int4"}}"#, "kv.codec"),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"kv":{"budget_tokens":0}}"#,
                "kv.budget_tokens",
            ),
            (r#"{"model":"m","messages":[{"role":"user","content":"x"}],"kv":{"polcy":"full"}}"#, "kv.polcy"),
            (r#"{"model":"","messages":[{"role":"user","content":"x"}]}"#, "model"),
            (r#"{"model":7,"messages":[{"role":"user","content":"x"}]}"#, "model"),
        ];
        for (body, param) in cases {
            let e = chat(body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn bounds_are_enforced() {
        let stops: Vec<String> = (0..MAX_STOP + 1).map(|i| format!("s{i}")).collect();
        let body = serde_json::json!({"model":"m","messages":[{"role":"user","content":"x"}],"stop":stops});
        assert_eq!(chat(&body.to_string()).unwrap_err().param.as_deref(), Some("stop"));
        let body = serde_json::json!({"model":"m","messages":[{"role":"user","content":"x"}],
            "stop":"x".repeat(MAX_STOP_BYTES + 1)});
        assert_eq!(chat(&body.to_string()).unwrap_err().param.as_deref(), Some("stop"));
        let msgs: Vec<_> = (0..MAX_MESSAGES + 1).map(|_| serde_json::json!({"role":"user","content":"x"})).collect();
        let body = serde_json::json!({"model":"m","messages":msgs});
        assert_eq!(chat(&body.to_string()).unwrap_err().param.as_deref(), Some("messages"));
        let body =
            serde_json::json!({"model":"m","messages":[{"role":"user","content":"x".repeat(MAX_TEXT_BYTES + 1)}]});
        assert_eq!(chat(&body.to_string()).unwrap_err().param.as_deref(), Some("messages[0].content"));
    }

    #[test]
    fn kv_full_is_accepted() {
        chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"kv":{"policy":"full","budget_tokens":512,"codec":"native"}}"#)
            .unwrap();
    }

    #[test]
    fn kv_codec_names_a_tier_codec() {
        let codec = |c: &str| {
            chat(&format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"kv":{{"codec":"{c}"}}}}"#))
                .map(|(_, p)| p.kv_codec)
        };
        assert_eq!(chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#).unwrap().1.kv_codec, "");
        for (name, canonical) in [("native", "native"), ("f16", "native"), ("int8", "int8"), ("int4_kivi", "int4_kivi")]
        {
            assert_eq!(codec(name).unwrap(), canonical, "{name}");
        }
        // A layered KIVI format is how a worker stores a codec (`--kivi-int8-layers`), not a codec to name.
        for bad in ["int4", "f32x", "", "zstd", "int4_kivi+int8@18/30"] {
            let e = codec(bad).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("kv.codec"), "{bad}");
            assert!(e.message.contains("int2_kivi"), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn bad_words_are_bounded_and_tokenized_as_vllm_does() {
        let with = |words: serde_json::Value| {
            chat(
                &serde_json::json!({"model":"m","messages":[{"role":"user","content":"x"}],"bad_words":words})
                    .to_string(),
            )
        };
        let (_, p) = with(serde_json::json!(["Paris", " the end"])).unwrap();
        assert_eq!(p.bad_words, vec!["Paris".to_string(), " the end".to_string()]);
        let too_many: Vec<String> = (0..=MAX_BAD_WORDS).map(|i| format!("w{i}")).collect();
        for (words, param) in [
            (serde_json::json!(too_many), "bad_words"),
            (serde_json::json!(["ok", " \n"]), "bad_words[1]"),
            (serde_json::json!(["x".repeat(MAX_BAD_WORD_BYTES + 1)]), "bad_words[0]"),
            (serde_json::json!("Paris"), "bad_words"),
            (serde_json::json!([7]), "bad_words[0]"),
        ] {
            let e = with(words.clone()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{words}");
            assert_eq!(e.param.as_deref(), Some(param), "{words}: {}", e.message);
        }
        // A word-level stand-in for a BPE tokenizer: a word after a space is one token of its own ("Ġword"),
        // and a space alone is a token too.
        let vocab = ["Paris", "ĠParis", "the", "Ġthe", "end", "Ġend", "Ġ", "x,y", "Ġx", ",y"];
        let encode = |text: &str| -> Result<Vec<u32>, String> {
            let mut ids = Vec::new();
            for (i, word) in text.split(' ').enumerate() {
                let piece = if i == 0 { word.to_string() } else { format!("Ġ{word}") };
                if word.is_empty() {
                    continue;
                }
                match vocab.iter().position(|&v| v == piece) {
                    Some(id) => ids.push(id as u32),
                    None if piece == "Ġx,y" => ids.extend([8, 9]),
                    None => return Err(format!("no token for {piece:?}")),
                }
            }
            Ok(ids)
        };
        let words = |ws: &[&str]| ws.iter().map(|w| w.to_string()).collect::<Vec<_>>();
        // Both forms when the space makes another token sequence of the same length; the leading space of a word
        // as written does not count.
        assert_eq!(
            bad_word_sequences(&words(&["Paris", "  the end"]), encode).unwrap(),
            vec![vec![0], vec![1], vec![2, 5], vec![3, 5]]
        );
        // " x,y" splits differently from "x,y": only the bare form (vLLM's length rule).
        assert_eq!(bad_word_sequences(&words(&["x,y"]), encode).unwrap(), vec![vec![7]]);
        assert_eq!(bad_word_sequences(&words(&["ok", "Rome"]), encode).unwrap_err().0, 0);
    }

    #[test]
    fn kv_profile_queries_are_bounded() {
        let with = |queries: serde_json::Value| {
            chat(
                &serde_json::json!({"model":"m","messages":[{"role":"user","content":"x"}],
                "kv":{"profile_queries":queries}})
                .to_string(),
            )
        };
        let (_, p) = with(serde_json::json!(["Who wrote it?", "When?"])).unwrap();
        assert_eq!(p.kv_profile_queries, vec!["Who wrote it?".to_string(), "When?".to_string()]);
        let most = pagoda_worker::placement::MAX_PROFILE_QUESTIONS;
        let too_many: Vec<String> = (0..=most).map(|i| format!("q{i}?")).collect();
        for (queries, param) in [
            (serde_json::json!(too_many), "kv.profile_queries"),
            (serde_json::json!(["ok", "  "]), "kv.profile_queries[1]"),
            (serde_json::json!(["x".repeat(MAX_PROFILE_QUERY_BYTES + 1)]), "kv.profile_queries[0]"),
            (serde_json::json!("one string"), "kv.profile_queries"),
            (serde_json::json!([3]), "kv.profile_queries[0]"),
        ] {
            let e = with(queries.clone()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{queries}");
            assert_eq!(e.param.as_deref(), Some(param), "{queries}: {}", e.message);
        }
    }

    #[test]
    fn sampling_fields() {
        let (_, p) = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":0,"top_p":0.9,"top_k":40,
               "seed":18446744073709551615,"stop":"\n","max_completion_tokens":7,"stream":true,
               "stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        assert_eq!(
            p.sampling,
            Sampling {
                temperature: 0.0,
                top_p: 0.9,
                top_k: 40,
                seed: Some(u64::MAX),
                presence_penalty: 0.0,
                frequency_penalty: 0.0,
                repetition_penalty: 1.0,
                min_p: 0.0,
                min_tokens: 0,
                json_object: false,
            }
        );
        let (_, penalised) = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"presence_penalty":-2,"frequency_penalty":1.5}"#,
        )
        .unwrap();
        assert_eq!((penalised.sampling.presence_penalty, penalised.sampling.frequency_penalty), (-2.0, 1.5));
        assert!(!penalised.ignore_eos);
        let (_, past_eos) =
            chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"ignore_eos":true}"#).unwrap();
        assert!(past_eos.ignore_eos);
        assert_eq!(past_eos.priority, 0);
        let (_, urgent) =
            chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"priority":-2147483648}"#).unwrap();
        assert_eq!(urgent.priority, i32::MIN);
        let e = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"priority":2147483648}"#).unwrap_err();
        assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some("priority")));
        for bad in [r#""presence_penalty":2.01"#, r#""frequency_penalty":-3"#, r#""frequency_penalty":"1""#] {
            let e =
                chat(&format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{bad}}}"#)).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
            assert!(e.param.as_deref().is_some_and(|p| p.ends_with("_penalty")), "{bad}: {e:?}");
        }
        assert_eq!(p.stop, vec!["\n".to_string()]);
        assert_eq!(p.max_tokens, Some(7));
        assert!(p.stream && p.include_usage);
        let (_, p) = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"seed":-1}"#).unwrap();
        assert_eq!(p.sampling.seed, Some(u64::MAX));
    }

    #[test]
    fn logit_bias_is_bounded_and_sorted() {
        let with = |bias: &str| {
            chat(&format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"logit_bias":{bias}}}"#))
        };
        let (_, p) = with(r#"{"42": -100, "7": 2.5, "99": 100}"#).unwrap();
        assert_eq!(p.logit_bias, vec![(7, 2.5), (42, -100.0), (99, 100.0)]);
        assert!(with("null").unwrap().1.logit_bias.is_empty());
        assert!(with("{}").unwrap().1.logit_bias.is_empty());
        let many = (0..=MAX_LOGIT_BIAS).map(|t| format!(r#""{t}": 0"#)).collect::<Vec<_>>().join(",");
        for (bias, want) in [
            ("[1, 2]".to_string(), "must be an object"),
            (r#"{"100": 1}"#.to_string(), "not a token id in the vocabulary (size 100)"),
            (r#"{"-1": 1}"#.to_string(), "not a token id"),
            (r#"{"+5": 1}"#.to_string(), "not a token id"),
            (r#"{" 5": 1}"#.to_string(), "not a token id"),
            (r#"{"1e1": 1}"#.to_string(), "not a token id"),
            (r#"{"5": 100.5}"#.to_string(), "from -100 to 100"),
            (r#"{"5": "1"}"#.to_string(), "from -100 to 100"),
            (r#"{"5": null}"#.to_string(), "from -100 to 100"),
            (r#"{"5": 1, "05": 2}"#.to_string(), "more than once"),
            (format!("{{{many}}}"), "at most 300"),
        ] {
            let e = with(&bias).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some("logit_bias")), "{bias}");
            assert!(e.message.contains(want), "{bias}: {}", e.message);
        }
        let req = |s: &str| parse_json::<CompletionRequest>(s.as_bytes()).unwrap().validate(100);
        let (_, p) = req(r#"{"model":"m","prompt":"x","logit_bias":{"3":-1}}"#).unwrap();
        assert_eq!(p.logit_bias, vec![(3, -1.0)]);
        assert!(req(r#"{"model":"m","prompt":"x","logit_bias":{"100":-1}}"#).is_err());
    }

    #[test]
    fn forced_function_calls_are_guided_by_their_parameters() {
        let chat = |extra: &str| {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}]{extra}}}"#);
            parse_json::<ChatCompletionRequest>(body.as_bytes()).unwrap().validate(100)
        };
        let weather = r#"{"type":"function","function":{"name":"weather","parameters":{"type":"object",
            "properties":{"city":{"type":"string"}},"required":["city"]}}}"#;
        let time = r#"{"type":"function","function":{"name":"time"}}"#;
        let named = r#""tool_choice":{"type":"function","function":{"name":"weather"}}"#;
        let (_, p) = chat(&format!(r#","tools":[{time},{weather}],{named}"#)).unwrap();
        assert_eq!(p.tool_call.as_deref(), Some("weather"));
        let schema = p.json_schema.unwrap();
        assert!(schema.contains("\"city\"") && !p.sampling.json_object, "{schema}");
        // `required` with one tool forces it; a function without parameters takes an empty object.
        let (_, p) = chat(&format!(r#","tools":[{time}],"tool_choice":"required""#)).unwrap();
        assert_eq!(p.tool_call.as_deref(), Some("time"));
        assert_eq!(p.json_schema.as_deref(), Some(r#"{"type":"object","properties":{},"additionalProperties":false}"#));
        // `none`, or no tools at all: plain text.
        for extra in [format!(r#","tools":[{weather}],"tool_choice":"none""#), String::new()] {
            let (_, p) = chat(&extra).unwrap();
            assert_eq!((p.tool_call, p.json_schema), (None, None), "{extra}");
        }
        for (extra, param, why) in [
            (format!(r#","tools":[{weather}]"#), "tool_choice", "no tool-call format"),
            (format!(r#","tools":[{weather}],"tool_choice":"auto""#), "tool_choice", "no tool-call format"),
            (format!(r#","tools":[{weather},{time}],"tool_choice":"required""#), "tool_choice", "single tool"),
            (format!(r#","tools":[{time}],"tool_choice":{{"type":"function","function":{{"name":"x"}}}}"#), "tool_choice", "not among"),
            (r#","tool_choice":"required""#.to_string(), "tool_choice", "needs `tools`"),
            (r#","tools":[{"type":"function","function":{"name":"a b"}}],"tool_choice":"required""#.to_string(), "tools[0]", "name"),
            (r#","tools":[{"type":"retrieval"}]"#.to_string(), "tools[0]", "function"),
            (
                r#","tools":[{"type":"function","function":{"name":"f","parameters":{"type":"string"}}}],"tool_choice":"required""#
                    .to_string(),
                "tools[0].function.parameters",
                "root",
            ),
            (format!(r#","tools":[{weather}],{named},"response_format":{{"type":"json_object"}}"#), "tool_choice", "drop"),
        ] {
            let e = chat(&extra).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{extra}: {e:?}");
            assert!(e.message.contains(why), "{extra}: {e:?}");
        }
    }

    #[test]
    fn a_function_call_and_its_result_are_turns_of_the_chat() {
        let messages = |extra: &str| {
            let body =
                format!(r#"{{"model":"m","messages":[{{"role":"user","content":"Weather in Paris?"}},{extra}]}}"#);
            parse_json::<ChatCompletionRequest>(body.as_bytes()).unwrap().validate(100).map(|(turns, _)| turns)
        };
        let turns = messages(
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"call-1","type":"function",
                "function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
               {"role":"tool","tool_call_id":"call-1","content":"18 C, sunny"}"#,
        )
        .unwrap();
        assert_eq!(
            turns[1],
            Turn { role: "assistant", content: r#"{"name":"get_weather","arguments":{"city":"Paris"}}"#.into() }
        );
        assert_eq!(turns[2], Turn { role: "tool", content: "18 C, sunny".into() });
        for (extra, param) in [
            (
                r#"{"role":"user","content":"x","tool_calls":[{"function":{"name":"f","arguments":"{}"}}]}"#,
                "messages[1].tool_calls",
            ),
            (
                r#"{"role":"assistant","content":null,"tool_calls":[{"function":{"name":"f"}}]}"#,
                "messages[1].tool_calls[0]",
            ),
            (r#"{"role":"tool","content":null}"#, "messages[1].content"),
        ] {
            assert_eq!(messages(extra).unwrap_err().param.as_deref(), Some(param), "{extra}");
        }
    }

    #[test]
    fn vllm_sampling_extensions() {
        let chat = |extra: &str| {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}]{extra}}}"#);
            parse_json::<ChatCompletionRequest>(body.as_bytes()).unwrap().validate(100)
        };
        let (_, p) =
            chat(r#","repetition_penalty":1.3,"min_p":0.05,"min_tokens":4,"max_tokens":8,"stop_token_ids":[7,9]"#)
                .unwrap();
        assert_eq!((p.sampling.repetition_penalty, p.sampling.min_p, p.sampling.min_tokens), (1.3, 0.05, 4));
        assert_eq!(p.stop_token_ids, [7, 9]);
        assert!(check_min_tokens(&p, 4).is_ok());
        assert_eq!(check_min_tokens(&p, 3).unwrap_err().param.as_deref(), Some("min_tokens"));
        for (extra, param) in [
            (r#","repetition_penalty":0"#, "repetition_penalty"),
            (r#","repetition_penalty":11"#, "repetition_penalty"),
            // Positive as f64, but 0 or infinite logits once the worker has it as f32.
            (r#","repetition_penalty":1e-38"#, "repetition_penalty"),
            (r#","repetition_penalty":0.0099"#, "repetition_penalty"),
            (r#","top_p":1e-46"#, "top_p"),
            (r#","min_p":1.5"#, "min_p"),
            (r#","min_p":-0.1"#, "min_p"),
            (r#","min_tokens":-1"#, "min_tokens"),
            (r#","min_tokens":9,"max_tokens":8"#, "min_tokens"),
            (r#","stop_token_ids":[100]"#, "stop_token_ids[0]"),
            (r#","stop_token_ids":[1,-2]"#, "stop_token_ids[1]"),
            (r#","stop_token_ids":5"#, "stop_token_ids"),
        ] {
            assert_eq!(chat(extra).unwrap_err().param.as_deref(), Some(param), "{extra}");
        }
        assert!(chat(r#","response_format":{"type":"json_object"}"#).unwrap().1.sampling.json_object);
        assert!(!chat(r#","response_format":{"type":"text"}"#).unwrap().1.sampling.json_object);
        for rf in [r#"{"type":"json_schema","json_schema":{}}"#, r#"{"type":"xml"}"#, r#""json""#] {
            let e = chat(&format!(r#","response_format":{rf}"#)).unwrap_err();
            assert!(e.param.as_deref().is_some_and(|p| p.starts_with("response_format")), "{rf}");
        }
        let many = format!(r#","stop_token_ids":[{}]"#, vec!["1"; MAX_STOP_TOKEN_IDS + 1].join(","));
        assert_eq!(chat(&many).unwrap_err().param.as_deref(), Some("stop_token_ids"));
    }

    #[test]
    fn logprobs_options() {
        let chat = |extra: &str| {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}]{extra}}}"#);
            parse_json::<ChatCompletionRequest>(body.as_bytes()).unwrap().validate(100)
        };
        assert_eq!(chat("").unwrap().1.logprobs, None);
        assert_eq!(chat(r#","logprobs":false"#).unwrap().1.logprobs, None);
        assert_eq!(chat(r#","logprobs":false,"top_logprobs":0"#).unwrap().1.logprobs, None);
        assert_eq!(chat(r#","logprobs":true"#).unwrap().1.logprobs, Some(0));
        assert_eq!(chat(r#","logprobs":true,"top_logprobs":20"#).unwrap().1.logprobs, Some(20));
        for (extra, want) in [
            (r#","logprobs":true,"top_logprobs":21"#, "between 0 and 20"),
            (r#","logprobs":true,"top_logprobs":-1"#, "between 0 and 20"),
            (r#","top_logprobs":3"#, "needs `logprobs`"),
        ] {
            let e = chat(extra).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("top_logprobs"), "{extra}");
            assert!(e.message.contains(want), "{extra}: {}", e.message);
        }
        let completion = |extra: &str| {
            let body = format!(r#"{{"model":"m","prompt":"x"{extra}}}"#);
            parse_json::<CompletionRequest>(body.as_bytes()).unwrap().validate(100)
        };
        assert_eq!(completion("").unwrap().1.logprobs, None);
        assert_eq!(completion(r#","logprobs":0"#).unwrap().1.logprobs, Some(0));
        assert_eq!(completion(r#","logprobs":5"#).unwrap().1.logprobs, Some(5));
        for bad in [r#","logprobs":21"#, r#","logprobs":-1"#] {
            assert_eq!(completion(bad).unwrap_err().param.as_deref(), Some("logprobs"), "{bad}");
        }
    }

    #[test]
    fn completion_prompts() {
        let req = |s: &str| parse_json::<CompletionRequest>(s.as_bytes()).unwrap().validate(100);
        let text = |t: &str| PromptInput::Text(t.into());
        assert_eq!(req(r#"{"model":"m","prompt":"hi"}"#).unwrap().0, [text("hi")]);
        assert_eq!(req(r#"{"model":"m","prompt":["hi"]}"#).unwrap().0, [text("hi")]);
        assert_eq!(req(r#"{"model":"m","prompt":[1,2,3]}"#).unwrap().0, [PromptInput::Tokens(vec![1, 2, 3])]);
        // A token-id prompt longer than the batch bound is still one prompt.
        let long: Vec<u32> = (0..500).map(|i| i % 100).collect();
        let body = format!(r#"{{"model":"m","prompt":{}}}"#, serde_json::to_string(&long).unwrap());
        assert_eq!(req(&body).unwrap().0, [PromptInput::Tokens(long)]);
        assert_eq!(req(r#"{"model":"m","prompt":[1,200]}"#).unwrap_err().param.as_deref(), Some("prompt[1]"));
        // Batches: strings, or token-id arrays, each with `n` choices, at most MAX_CHOICES in all.
        assert_eq!(req(r#"{"model":"m","prompt":["a","b"]}"#).unwrap().0, [text("a"), text("b")]);
        let (prompts, p) = req(r#"{"model":"m","prompt":[[1],[2,3]],"n":8}"#).unwrap();
        assert_eq!(prompts, [PromptInput::Tokens(vec![1]), PromptInput::Tokens(vec![2, 3])]);
        assert_eq!(p.n, 8);
        for (body, param) in [
            (r#"{"model":"m","prompt":[[1],[2,300]]}"#, "prompt[1][1]"),
            (r#"{"model":"m","prompt":[[1],[]]}"#, "prompt[1][0]"),
            (r#"{"model":"m","prompt":["a",""]}"#, "prompt[1]"),
            (r#"{"model":"m","prompt":["a",[1]]}"#, "prompt"),
            (r#"{"model":"m","prompt":[[1],[2]],"n":9}"#, "n"),
            (r#"{"model":"m","prompt":"a","n":2,"best_of":3}"#, "best_of"),
        ] {
            assert_eq!(req(body).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
        let many = format!(r#"{{"model":"m","prompt":[{}]}}"#, vec!["\"a\""; MAX_CHOICES + 1].join(","));
        assert_eq!(req(&many).unwrap_err().param.as_deref(), Some("prompt"));
        assert_eq!(req(r#"{"model":"m","prompt":"a","n":2,"best_of":2}"#).unwrap().1.n, 2);
        assert_eq!(req(r#"{"model":"m","prompt":""}"#).unwrap_err().param.as_deref(), Some("prompt"));
        assert_eq!(req(r#"{"model":"m","prompt":{}}"#).unwrap_err().param.as_deref(), Some("prompt"));
        assert!(req(r#"{"model":"m","prompt":"x","echo":true}"#).unwrap().1.echo);
    }

    #[test]
    fn lengths() {
        assert_eq!(check_lengths(10, None, 100).unwrap(), 90);
        assert_eq!(check_lengths(10, Some(5), 100).unwrap(), 5);
        let e = check_lengths(100, None, 100).unwrap_err();
        assert!(e.message.contains("100") && e.message.contains("maximum context length"), "{}", e.message);
        let e = check_lengths(150, Some(5), 100).unwrap_err();
        assert!(e.message.contains("150") && e.message.contains("100"), "{}", e.message);
        let e = check_lengths(10, Some(101), 100).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = check_lengths(10, Some(95), 100).unwrap_err();
        assert!(e.message.contains("105"), "{}", e.message);
    }

    #[test]
    fn chunk_serialisation_shape() {
        let c = ChatChunk {
            id: "chatcmpl-1".into(),
            object: "chat.completion.chunk",
            created: 1,
            model: "m".into(),
            choices: vec![ChunkChoice {
                index: 0,
                delta: Delta { role: Some("assistant"), content: Some(String::new()), tool_calls: None },
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            }],
            usage: Some(None),
        };
        let v: serde_json::Value = serde_json::to_value(&c).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",
                "choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null,
                    "stop_reason":null}],
                "usage":null})
        );
        let c = ChatChunk { usage: None, ..c };
        let v: serde_json::Value = serde_json::to_value(&c).unwrap();
        assert!(v.get("usage").is_none());
    }
}
