//! Token sampling: greedy (temperature 0), temperature, top-k, top-p (nucleus) and min-p over one logits row,
//! after OpenAI's `logit_bias` and its presence and frequency penalties, the repetition penalty of HF/vLLM,
//! vLLM's `min_tokens` (no stop token before that many) and its `bad_words` (no token that completes one).
//!
//! Each request owns a [`Sampler`] with its own seeded RNG (`StdRng`, ChaCha12), so the same seed and the same
//! logits give the same tokens. The per-token work uses only a caller-provided [`SampleBuffer`] that is reused
//! across tokens and requests: no allocation per token once the buffer has grown to the vocabulary size.

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::grammar_guide::{Grammar, GrammarState, MaskCache};
use crate::json_guide::{JsonState, TokenTable};
use crate::json_schema::{JsonSchema, SchemaState};
use crate::regex_guide::{ByteDfa, RegexState};

/// Temperatures at or below this are treated as greedy.
pub const GREEDY_EPSILON: f32 = 1e-5;

/// At most this many `logit_bias` entries in one request (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;
/// Biases lie in `[-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]`, as OpenAI's do: -100 bans a token in practice, 100
/// forces it.
pub const LOGIT_BIAS_LIMIT: f32 = 100.0;
/// Presence and frequency penalties lie in `[-PENALTY_LIMIT, PENALTY_LIMIT]`, as OpenAI's do.
pub const PENALTY_LIMIT: f32 = 2.0;
/// The repetition penalty lies in `(0, MAX_REPETITION_PENALTY]` (1 is off; vLLM asks only for > 0, but above a
/// few it only ever bans: this bounds it).
pub const MAX_REPETITION_PENALTY: f32 = 10.0;
/// At most this many `bad_words` token sequences in one request (vLLM sets none; each word becomes up to two).
pub const MAX_BAD_WORDS: usize = 128;
/// At most this many tokens in one `bad_words` sequence.
pub const MAX_BAD_WORD_TOKENS: usize = 32;
/// At most this many alternatives per token in `top_logprobs` (OpenAI's limit, and vLLM's default).
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// The log-probability reported for a token the model gives no probability at all (a `-inf` or NaN logit, or one
/// that underflows): OpenAI's `-9999.0`, since JSON has no `-inf`.
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// The words every [`SampleError`] starts with. The engine ends such a request with
/// [`crate::engine::GenerateEvent::Refused`] (an `invalid_argument` status on the wire): it is the request's own
/// doing, and no other worker would get past it.
pub const GUIDE_DEAD_END: &str = "guided decoding reached a dead end";

/// Why a guided sampler cannot go on. The request must end with this error: any token it could still emit would
/// break the answer the guide promised, and a stop token would pass off a cut answer as a whole one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SampleError {
    /// No token the request allows (`allowed_token_ids`, `bad_words`, `min_tokens`, the vocabulary) continues the
    /// answer, and it is not complete (or no stop token may end it).
    NoTokenFits { guide: &'static str, generated: u32 },
    /// The grammar allows more, but its work bounds refuse every byte of it ([`GrammarState::stalled_by_work_bound`]).
    WorkBound { generated: u32 },
}

impl std::fmt::Display for SampleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SampleError::NoTokenFits { guide, generated } => write!(
                f,
                "{GUIDE_DEAD_END} after {generated} tokens: no token the request allows (allowed_token_ids, \
                 bad_words, min_tokens, the model's vocabulary) continues the {guide} answer, and it cannot end here"
            ),
            SampleError::WorkBound { generated } => write!(
                f,
                "{GUIDE_DEAD_END} after {generated} tokens: the grammar is too ambiguous to follow further; every \
                 byte it allows next exceeds the recognizer's work bound (make the grammar less ambiguous)"
            ),
        }
    }
}

impl std::error::Error for SampleError {}

/// How one request samples. `top_k == 0` and `top_p >= 1` disable those filters.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub seed: Option<u64>,
    /// `(token id, bias)` added to the logits before anything else, greedy included; distinct token ids below
    /// the vocabulary ([`check_logit_bias`], which the engine applies to every request).
    pub logit_bias: Vec<(u32, f32)>,
    /// Subtracted from the logit of every token already generated, once (OpenAI's `presence_penalty`).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once for every time it has been generated (`frequency_penalty`).
    pub frequency_penalty: f32,
    /// The prompt's last this-many tokens count as generated: a stream resumed on this worker after another one
    /// failed carries what that one produced in its prompt.
    pub prior_output_tokens: u32,
    /// HF's and vLLM's `repetition_penalty`: the logit of every token in the prompt or the output so far is divided
    /// by it when positive and multiplied by it when not. 1 is off.
    pub repetition_penalty: f32,
    /// vLLM's `min_p`: after temperature, tokens less likely than `min_p` times the most likely one are dropped.
    /// 0 is off.
    pub min_p: f32,
    /// vLLM's `min_tokens`: the request's stop tokens are banned until it has generated this many.
    pub min_tokens: u32,
    /// OpenAI's `response_format: {"type": "json_object"}`: only tokens that keep the output a prefix of one JSON
    /// object may be sampled, and a stop token only once it is complete ([`crate::json_guide`]).
    pub json_object: bool,
    /// OpenAI's `response_format: {"type": "json_schema"}`: only tokens that keep the output a prefix of a document
    /// the compiled schema describes may be sampled ([`crate::json_schema`]); it takes precedence over
    /// `json_object`.
    pub json_schema: Option<Arc<JsonSchema>>,
    /// vLLM's `guided_regex` (and `guided_choice`, as the alternation of its strings): only tokens that keep the
    /// output a prefix of a match of the whole pattern may be sampled, and a stop token only on a match
    /// ([`crate::regex_guide`]). At most one of `json_object`, `json_schema`, `regex` and `grammar` is set.
    pub regex: Option<Arc<ByteDfa>>,
    /// vLLM's `structured_outputs.grammar` (and `guided_grammar`): only tokens that keep the output a prefix of a
    /// sentence of the grammar may be sampled, and a stop token only on a whole sentence
    /// ([`crate::grammar_guide`]).
    pub grammar: Option<Arc<Grammar>>,
    /// vLLM's `allowed_token_ids`: when not empty, only these tokens may be sampled (greedy included); ids below
    /// the vocabulary ([`check_allowed_tokens`]). A stop token outside them never ends the answer.
    pub allowed_token_ids: Vec<u32>,
    /// vLLM's `bad_words`, tokenized: a token that would complete one of these sequences after the output so far
    /// (the prior output tokens included) is never sampled, greedy included ([`check_bad_words`]).
    pub bad_words: Vec<Vec<u32>>,
}

impl SamplingParams {
    pub fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            logit_bias: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            prior_output_tokens: 0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            min_tokens: 0,
            json_object: false,
            json_schema: None,
            regex: None,
            grammar: None,
            allowed_token_ids: Vec::new(),
            bad_words: Vec::new(),
        }
    }

    /// Whether a penalty applies, so that the sampler counts what it emits.
    pub fn penalizes(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= GREEDY_EPSILON || self.top_k == 1
    }

    /// Whether a repetition penalty applies, so that the sampler keeps the prompt's and the output's tokens.
    pub fn repeats(&self) -> bool {
        self.repetition_penalty != 1.0
    }

    /// Whether the token is the argmax of the model's own logits, so a runner may pick it without handing the
    /// row back: greedy, unbiased, unpenalised, with no stop token banned.
    pub fn picks_argmax(&self) -> bool {
        self.is_greedy()
            && self.logit_bias.is_empty()
            && !self.penalizes()
            && !self.repeats()
            && self.min_tokens == 0
            && !self.guided()
            && self.allowed_token_ids.is_empty()
            && self.bad_words.is_empty()
    }

    /// Whether a grammar guides the output (`json_object`, `json_schema`, `regex` or `grammar`).
    pub fn guided(&self) -> bool {
        self.json_object || self.json_schema.is_some() || self.regex.is_some() || self.grammar.is_some()
    }

    /// Whether the guide ends the answer only with a stop token: a pattern or a grammar whose sentence may go on
    /// (a JSON document ends itself, and whitespace pads it where nothing else may follow).
    pub fn ends_on_stop(&self) -> bool {
        self.regex.is_some() || self.grammar.is_some()
    }

    /// The tail of `prompt` that an earlier attempt generated ([`SamplingParams::prior_output_tokens`]).
    pub fn prior_output<'a>(&self, prompt: &'a [u32]) -> &'a [u32] {
        &prompt[prompt.len().saturating_sub(self.prior_output_tokens as usize)..]
    }

    /// Checks the penalties and `prior_output_tokens` against a prompt of `prompt_len` tokens.
    pub fn check_penalties(&self, prompt_len: usize) -> Result<(), String> {
        for (name, p) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-PENALTY_LIMIT..=PENALTY_LIMIT).contains(&p) {
                return Err(format!("{name} must be in [-2, 2], got {p}"));
            }
        }
        if self.prior_output_tokens as usize > prompt_len {
            return Err(format!(
                "prior_output_tokens {} is more than the prompt's {prompt_len} tokens",
                self.prior_output_tokens
            ));
        }
        let r = self.repetition_penalty;
        if !(r > 0.0 && r <= MAX_REPETITION_PENALTY) {
            return Err(format!("repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {r}"));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        Ok(())
    }
}

/// Checks a `logit_bias` list for a vocabulary of `vocab_size` and sorts it by token id: at most
/// [`MAX_LOGIT_BIAS`] entries, token ids below `vocab_size` and distinct, finite biases within
/// [`LOGIT_BIAS_LIMIT`].
pub fn check_logit_bias(bias: &mut [(u32, f32)], vocab_size: usize) -> Result<(), String> {
    if bias.len() > MAX_LOGIT_BIAS {
        return Err(format!("logit_bias has {} entries; at most {MAX_LOGIT_BIAS} are allowed", bias.len()));
    }
    if let Some(&(t, _)) = bias.iter().find(|&&(t, _)| t as usize >= vocab_size) {
        return Err(format!("logit_bias token id {t} is outside the vocabulary ({vocab_size})"));
    }
    if let Some(&(t, b)) = bias.iter().find(|&&(_, b)| !(-LOGIT_BIAS_LIMIT..=LOGIT_BIAS_LIMIT).contains(&b)) {
        return Err(format!("logit_bias of token {t} must be in [-100, 100], got {b}"));
    }
    bias.sort_unstable_by_key(|&(t, _)| t);
    if let Some(w) = bias.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(format!("logit_bias names token {} more than once", w[0].0));
    }
    Ok(())
}

/// Checks vLLM's `allowed_token_ids`: every id below `vocab_size`, at most `vocab_size` of them.
pub fn check_allowed_tokens(ids: &[u32], vocab_size: usize) -> Result<(), String> {
    if ids.len() > vocab_size {
        return Err(format!("allowed_token_ids has {} entries; the vocabulary has {vocab_size}", ids.len()));
    }
    match ids.iter().find(|&&t| t as usize >= vocab_size) {
        Some(t) => Err(format!("allowed_token_ids: token id {t} is outside the vocabulary ({vocab_size})")),
        None => Ok(()),
    }
}

/// Checks vLLM's `bad_words` token sequences: at most [`MAX_BAD_WORDS`], each of 1..=[`MAX_BAD_WORD_TOKENS`] ids
/// below `vocab_size`.
pub fn check_bad_words(words: &[Vec<u32>], vocab_size: usize) -> Result<(), String> {
    if words.len() > MAX_BAD_WORDS {
        return Err(format!("bad_words has {} token sequences; at most {MAX_BAD_WORDS} are allowed", words.len()));
    }
    for (i, w) in words.iter().enumerate() {
        if w.is_empty() || w.len() > MAX_BAD_WORD_TOKENS {
            return Err(format!("bad_words[{i}] has {} tokens; 1 to {MAX_BAD_WORD_TOKENS} are allowed", w.len()));
        }
        if let Some(t) = w.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(format!("bad_words[{i}]: token id {t} is outside the vocabulary ({vocab_size})"));
        }
    }
    Ok(())
}

/// Scratch space shared by all samplers on one thread: `(probability or logit, token)` candidates.
#[derive(Debug, Default)]
pub struct SampleBuffer {
    cand: Vec<(f32, u32)>,
}

impl SampleBuffer {
    pub fn new() -> SampleBuffer {
        SampleBuffer::default()
    }

    pub fn with_capacity(vocab: usize) -> SampleBuffer {
        SampleBuffer { cand: Vec::with_capacity(vocab) }
    }
}

/// One request's sampler: its parameters, its RNG, how often it has emitted each token (under a presence or
/// frequency penalty), the tokens it has seen (under a repetition penalty), and the stop tokens it may not emit yet
/// (under `min_tokens`).
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplingParams,
    rng: StdRng,
    /// `(token, times generated)`, ascending by token; kept only under a penalty.
    counts: Vec<(u32, u32)>,
    /// Distinct tokens of the prompt and the output, ascending; kept only under a repetition penalty.
    seen: Vec<u32>,
    /// The request's stop tokens: banned while fewer than `min_tokens` have been generated, and under the JSON
    /// guide until the object is complete.
    stops: Vec<u32>,
    generated: u32,
    /// Where the guided answer stands, and every token's bytes to test against it.
    guide: Option<(Guide, Arc<TokenTable>)>,
    /// Under a regex guide, which tokens fit the states sampled from lately.
    masks: TokenMasks,
    /// Under a grammar guide, which tokens fit the states sampled from lately.
    grammar_masks: MaskCache,
    /// The allowed tokens' logits while every other is set to minus infinity (reused).
    allowed_logits: Vec<f32>,
    /// The last output tokens, at most `recent_window` (oldest first); kept only under `bad_words`.
    recent: Vec<u32>,
    /// The bytes the guide forces next ([`Sampler::forced_tokens`]; reused).
    forced: Vec<u8>,
    /// The longest bad word's length less its last token: how many output tokens `bad_words` look at.
    recent_window: usize,
}

/// Most bytes [`Sampler::forced_tokens`] looks ahead.
const MAX_FORCED_BYTES: usize = 128;

/// How many of a regex guide's states keep their token masks.
const MASKED_STATES: usize = 16;

/// Which tokens fit each of the last [`MASKED_STATES`] regex states a sampled step started from (one bit per
/// token), so that a step from a state seen before tests a bit per token instead of feeding every token's bytes.
/// A pattern's answer tends to stay in a few states (a character class repeated, a fixed shape), so most steps
/// hit. Each mask is allocated when its state is first seen and reused after.
#[derive(Debug, Clone, Default)]
struct TokenMasks {
    entries: Vec<(RegexState, Vec<u64>)>,
    /// The entry to replace next once all are in use.
    next: usize,
}

impl TokenMasks {
    fn get(&mut self, dfa: &ByteDfa, state: RegexState, tokens: &TokenTable) -> &[u64] {
        if let Some(i) = self.entries.iter().position(|e| e.0 == state) {
            return &self.entries[i].1;
        }
        let i = if self.entries.len() < MASKED_STATES {
            self.entries.push((state, vec![0; tokens.len().div_ceil(64)]));
            self.entries.len() - 1
        } else {
            let i = self.next;
            self.next = (i + 1) % MASKED_STATES;
            i
        };
        let (at, bits) = &mut self.entries[i];
        *at = state;
        bits.fill(0);
        for t in 0..tokens.len() {
            if dfa.feed(state, tokens.bytes(t as u32)).is_some() {
                bits[t / 64] |= 1 << (t % 64);
            }
        }
        bits
    }
}

/// The grammar a guided sampler follows, and where the answer stands in it.
#[derive(Debug, Clone)]
enum Guide {
    Object(JsonState),
    /// `trial` is scratch for trying tokens without allocating.
    Schema {
        schema: Arc<JsonSchema>,
        state: Box<SchemaState>,
        trial: Box<SchemaState>,
    },
    Regex {
        dfa: Arc<ByteDfa>,
        state: RegexState,
    },
    Grammar {
        grammar: Arc<Grammar>,
        state: Box<GrammarState>,
    },
}

impl Guide {
    /// Whether the answer may end here (a stop token fits).
    fn may_end(&self) -> bool {
        match self {
            Guide::Object(s) => s.is_done(),
            Guide::Schema { state, .. } => state.is_done(),
            Guide::Regex { dfa, state } => dfa.is_match(*state),
            Guide::Grammar { state, .. } => state.may_end(),
        }
    }

    /// Whether nothing but the end may follow.
    fn is_done(&self) -> bool {
        match self {
            Guide::Regex { dfa, state } => !dfa.continues(*state),
            Guide::Grammar { state, .. } => !state.continues(),
            _ => self.may_end(),
        }
    }

    /// Whether whitespace may pad a complete answer (a JSON document's, when there is no stop token to end it).
    fn pads(&self) -> bool {
        !matches!(self, Guide::Regex { .. } | Guide::Grammar { .. })
    }

    /// What the client asked for, as error messages name it.
    fn name(&self) -> &'static str {
        match self {
            Guide::Object(_) => "json_object-guided",
            Guide::Schema { .. } => "json_schema-guided",
            Guide::Regex { .. } => "regex-guided",
            Guide::Grammar { .. } => "grammar-guided",
        }
    }

    /// Why nothing can follow here, once nothing does.
    fn dead_end(&mut self, generated: u32) -> SampleError {
        let stalled = match self {
            Guide::Grammar { grammar, state } => state.stalled_by_work_bound(grammar),
            _ => false,
        };
        if stalled {
            SampleError::WorkBound { generated }
        } else {
            SampleError::NoTokenFits { guide: self.name(), generated }
        }
    }

    /// Moves past `bytes` if they fit; returns whether they did.
    fn advance(&mut self, bytes: &[u8]) -> bool {
        match self {
            Guide::Object(s) => s.accepts(bytes).map(|next| *s = next).is_some(),
            Guide::Schema { schema, state, .. } => state.accepts(schema, bytes).map(|next| **state = next).is_some(),
            Guide::Regex { dfa, state } => dfa.feed(*state, bytes).map(|next| *state = next).is_some(),
            Guide::Grammar { grammar, state } => {
                let fed = state.feed(grammar, bytes);
                // What the answer has become is final: sets below it keep only what later bytes read.
                state.commit(grammar);
                fed
            }
        }
    }

    /// Inside a string and not in an escape: how many more characters plain content may add.
    fn plain_string_room(&self) -> Option<u32> {
        match self {
            Guide::Object(s) => s.in_plain_string().then_some(u32::MAX),
            Guide::Schema { schema, state, .. } => state.plain_string_room(schema),
            Guide::Regex { .. } | Guide::Grammar { .. } => None,
        }
    }

    /// The bytes the guide leaves no choice about: while exactly one byte fits and the answer may not end there,
    /// that byte; at most `max`. The guide's state is unchanged.
    fn forced_bytes(&mut self, out: &mut Vec<u8>, max: usize) {
        /// The one byte that fits, with where it leads, if exactly one does.
        fn only<S>(mut fitting: impl Iterator<Item = (u8, S)>) -> Option<(u8, S)> {
            let first = fitting.next()?;
            fitting.next().is_none().then_some(first)
        }
        out.clear();
        match self {
            Guide::Object(s) => {
                let mut s = *s;
                while out.len() < max && !s.is_done() {
                    let Some((b, next)) = only((0..=255u8).filter_map(|b| Some((b, s.accepts(&[b])?)))) else { break };
                    out.push(b);
                    s = next;
                }
            }
            Guide::Schema { schema, state, trial } => {
                let mut s = SchemaState::clone(state);
                while out.len() < max && !s.is_done() {
                    let fitting = (0..=255u8).filter(|&b| s.fits(schema, &[b], trial)).map(|b| (b, ()));
                    let Some((b, ())) = only(fitting) else { break };
                    let Some(next) = s.accepts(schema, &[b]) else { break };
                    out.push(b);
                    s = next;
                }
            }
            Guide::Regex { dfa, state } => {
                let mut s = *state;
                while out.len() < max && !dfa.is_match(s) {
                    let Some((b, next)) = only((0..=255u8).filter_map(|b| Some((b, dfa.feed(s, &[b])?)))) else {
                        break;
                    };
                    out.push(b);
                    s = next;
                }
            }
            Guide::Grammar { grammar, state } => {
                let len = state.len();
                while out.len() < max && !state.may_end() {
                    let Some(b) = state.only_next_byte() else { break };
                    if !state.feed(grammar, &[b]) {
                        break;
                    }
                    out.push(b);
                }
                state.rewind(len);
            }
        }
    }

    /// Whether `bytes` may come next.
    fn fits(&mut self, bytes: &[u8]) -> bool {
        match self {
            Guide::Object(s) => s.accepts(bytes).is_some(),
            Guide::Schema { schema, state, trial } => state.fits(schema, bytes, trial),
            Guide::Regex { dfa, state } => dfa.feed(*state, bytes).is_some(),
            Guide::Grammar { grammar, state } => state.fits(grammar, bytes),
        }
    }
}

impl Sampler {
    /// A sampler seeded from `cfg.seed`, or from the OS when the request gives no seed.
    pub fn new(cfg: SamplingParams) -> Sampler {
        let rng = match cfg.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Sampler {
            cfg,
            rng,
            counts: Vec::new(),
            seen: Vec::new(),
            stops: Vec::new(),
            generated: 0,
            guide: None,
            masks: TokenMasks::default(),
            grammar_masks: MaskCache::default(),
            allowed_logits: Vec::new(),
            recent: Vec::new(),
            recent_window: 0,
            forced: Vec::new(),
        }
    }

    /// [`Sampler::new`] for a request with this prompt that generates at most `max_tokens` and stops at
    /// `stop_tokens`: under a penalty, the prompt's last `prior_output_tokens` count as generated; under a
    /// repetition penalty, the prompt's tokens are seen; room for every distinct token the request can emit is
    /// reserved now, so that sampling never allocates.
    pub fn for_request(cfg: SamplingParams, prompt: &[u32], max_tokens: usize, stop_tokens: &[u32]) -> Sampler {
        let mut s = Sampler::new(cfg);
        if s.cfg.penalizes() {
            let prior = s.cfg.prior_output(prompt);
            s.counts.reserve(prior.len() + max_tokens);
            for &t in prior {
                s.count(t);
            }
        }
        if s.cfg.repeats() {
            s.seen.reserve(prompt.len() + max_tokens);
            s.seen.extend_from_slice(prompt);
            s.seen.sort_unstable();
            s.seen.dedup();
        }
        if s.cfg.min_tokens > 0 || s.cfg.guided() {
            s.stops = stop_tokens.to_vec();
        }
        s.recent_window = s.cfg.bad_words.iter().map(|w| w.len().saturating_sub(1)).max().unwrap_or(0);
        if s.recent_window > 0 {
            let keep = s.recent_window;
            s.recent.reserve_exact(keep);
            let prior = s.cfg.prior_output(prompt);
            s.recent.extend_from_slice(&prior[prior.len().saturating_sub(keep)..]);
        }
        s
    }

    /// Whether a bad word's last token would complete it now: the output ends with the rest of it.
    fn completes_bad_word(recent: &[u32], word: &[u32]) -> bool {
        let Some((_, prefix)) = word.split_last() else { return false };
        recent.ends_with(prefix)
    }

    /// Guides a `json_object`, `json_schema`, `regex` or `grammar` sampler with the model's token bytes (without them it
    /// samples unguided: the engine refuses such requests where it has no table). The prompt's last
    /// `prior_output_tokens` are the answer so far (a resumed stream): the guide starts after them, as far as
    /// they fit.
    pub fn with_guide(mut self, tokens: Option<&Arc<TokenTable>>, prompt: &[u32]) -> Sampler {
        let Some(tokens) = tokens.filter(|_| self.cfg.guided()) else {
            return self;
        };
        let mut guide = match (&self.cfg.json_schema, &self.cfg.regex, &self.cfg.grammar) {
            (Some(schema), _, _) => {
                let state = Box::new(SchemaState::new(schema));
                Guide::Schema { schema: schema.clone(), trial: state.clone(), state }
            }
            (None, Some(dfa), _) => Guide::Regex { state: dfa.start(), dfa: dfa.clone() },
            (None, None, Some(grammar)) => {
                Guide::Grammar { state: Box::new(grammar.start()), grammar: grammar.clone() }
            }
            (None, None, None) => Guide::Object(JsonState::new()),
        };
        for &t in self.cfg.prior_output(prompt) {
            if !guide.advance(tokens.bytes(t)) {
                break;
            }
        }
        self.guide = Some((guide, tokens.clone()));
        self
    }

    pub fn config(&self) -> &SamplingParams {
        &self.cfg
    }

    /// Writes into `out` the tokens a speculative draft can propose where the guide leaves no choice: the bytes it
    /// forces next (inside a JSON schema's key, the rest of a `guided_choice` string, a grammar's literal), cut
    /// into the longest tokens of the vocabulary that start what is left of them; at most `max` tokens. Empty
    /// without a guide or where nothing is forced. The draft is only a proposal: verification samples each of
    /// its positions as usual, so a split the model would not have chosen is rejected, not forced on it.
    pub fn forced_tokens(&mut self, out: &mut Vec<u32>, max: usize) {
        out.clear();
        let Some((guide, tokens)) = &mut self.guide else { return };
        guide.forced_bytes(&mut self.forced, MAX_FORCED_BYTES);
        let mut rest = &self.forced[..];
        while out.len() < max
            && let Some((t, n)) = tokens.longest_prefix(rest)
        {
            out.push(t);
            rest = &rest[n..];
        }
    }

    fn count(&mut self, token: u32) {
        match self.counts.binary_search_by_key(&token, |&(t, _)| t) {
            Ok(i) => self.counts[i].1 += 1,
            Err(i) => self.counts.insert(i, (token, 1)),
        }
    }

    /// Picks the next token from one row of logits, and counts it under a penalty. Returns 0 for an empty row.
    ///
    /// Fails where a guide leaves no token the request allows and the answer may not end: the request must then
    /// end with the error ([`SampleError`]).
    pub fn sample(&mut self, logits: &[f32], buf: &mut SampleBuffer) -> Result<u32, SampleError> {
        let token = self.pick(logits, buf)?;
        if logits.is_empty() {
            return Ok(token);
        }
        // A stop token ends the answer and is no part of it (its bytes, if any, need not fit); whitespace after a
        // complete JSON document pads it outside the guide.
        if let Some((guide, tokens)) = &mut self.guide
            && !self.stops.contains(&token)
            && !(guide.pads() && guide.is_done())
            && !guide.advance(tokens.bytes(token))
        {
            // A token the guide refuses got past its test (the NaN fallback in `pick` takes the raw row's argmax,
            // or a guide's test and feed disagree): going on would part the answer from the guide for good.
            return Err(guide.dead_end(self.generated));
        }
        if self.cfg.penalizes() {
            self.count(token);
        }
        if self.cfg.repeats()
            && let Err(i) = self.seen.binary_search(&token)
        {
            self.seen.insert(i, token);
        }
        let keep = self.recent_window;
        if keep > 0 {
            if self.recent.len() == keep {
                self.recent.remove(0);
            }
            self.recent.push(token);
        }
        self.generated = self.generated.saturating_add(1);
        Ok(token)
    }

    /// Where a guide leaves no token: a complete answer ends on the request's stop token even where `min_tokens`
    /// or `allowed_token_ids` ban it (ending is the only way left that keeps the answer whole); anything else is a
    /// dead end.
    fn no_token_fits(stops: &[u32], guide: &mut Guide, generated: u32) -> Result<u32, SampleError> {
        match stops.first() {
            Some(&stop) if guide.may_end() => Ok(stop),
            _ => Err(guide.dead_end(generated)),
        }
    }

    /// The pick for a row where nothing the filters leave has any weight (every logit left is -inf or NaN: a
    /// broken row, or filters that ban everything): the first allowed token when the request names them, so the
    /// answer keeps to its vocabulary, else the raw row's argmax.
    fn weightless_row(&self, logits: &[f32]) -> u32 {
        self.cfg.allowed_token_ids.first().copied().unwrap_or_else(|| argmax(logits))
    }

    fn pick(&mut self, logits: &[f32], buf: &mut SampleBuffer) -> Result<u32, SampleError> {
        if logits.is_empty() {
            return Ok(0);
        }
        if self.cfg.picks_argmax() {
            return Ok(argmax(logits));
        }
        let inv_t = 1.0 / self.cfg.temperature;
        let top_k = self.cfg.top_k as usize;
        let top_p = if self.cfg.top_p.is_finite() && self.cfg.top_p > 0.0 { self.cfg.top_p } else { 1.0 };
        let cand = &mut buf.cand;
        cand.clear();
        cand.extend(logits.iter().enumerate().map(|(i, &l)| (sanitize(l), i as u32)));
        for &(token, bias) in &self.cfg.logit_bias {
            if let Some(c) = cand.get_mut(token as usize) {
                c.0 += bias;
            }
        }
        if !self.cfg.allowed_token_ids.is_empty() {
            let allowed = &self.cfg.allowed_token_ids;
            let kept = &mut self.allowed_logits;
            kept.clear();
            kept.extend(allowed.iter().map(|&t| cand.get(t as usize).map_or(f32::NEG_INFINITY, |c| c.0)));
            cand.iter_mut().for_each(|c| c.0 = f32::NEG_INFINITY);
            for (&t, &l) in allowed.iter().zip(kept.iter()) {
                if let Some(c) = cand.get_mut(t as usize) {
                    c.0 = l;
                }
            }
        }
        for word in &self.cfg.bad_words {
            if Self::completes_bad_word(&self.recent, word)
                && let Some(c) = word.last().and_then(|&t| cand.get_mut(t as usize))
            {
                c.0 = f32::NEG_INFINITY;
            }
        }
        if self.generated < self.cfg.min_tokens {
            for &token in &self.stops {
                if let Some(c) = cand.get_mut(token as usize) {
                    c.0 = f32::NEG_INFINITY;
                }
            }
        }
        let r = self.cfg.repetition_penalty;
        for &token in &self.seen {
            if let Some(c) = cand.get_mut(token as usize) {
                c.0 = if c.0 > 0.0 { c.0 / r } else { c.0 * r };
            }
        }
        let (presence, frequency) = (self.cfg.presence_penalty, self.cfg.frequency_penalty);
        for &(token, n) in &self.counts {
            if let Some(c) = cand.get_mut(token as usize) {
                c.0 -= presence + frequency * n as f32;
            }
        }
        if let Some((guide, tokens)) = &mut self.guide {
            // A stop token fits only a complete answer. Nothing else fits a complete JSON document; without stop
            // tokens (`ignore_eos`) whitespace pads it. A regex's match may go on where the pattern allows.
            let may_end = guide.may_end();
            let done = guide.is_done();
            let pad = done && self.stops.is_empty() && guide.pads();
            // A sampled regex or grammar step tests each token's bit in a mask (the greedy scan below tries a
            // handful of tokens and needs none).
            let mask = match &mut *guide {
                Guide::Regex { dfa, state } if !done && !self.cfg.is_greedy() => {
                    Some(self.masks.get(dfa, *state, tokens))
                }
                Guide::Grammar { grammar, state } if !done && !self.cfg.is_greedy() => {
                    Some(self.grammar_masks.mask(grammar, state, tokens))
                }
                _ => None,
            };
            // The bytes a token may start with, tried once for all the tokens that start with them (sampling
            // tries the whole vocabulary; the greedy scan below tries a handful and skips this).
            let mut first = [true; 256];
            if !done && !self.cfg.is_greedy() && mask.is_none() {
                for (b, ok) in first.iter_mut().enumerate() {
                    *ok = guide.fits(&[b as u8]);
                }
            }
            // Inside a string, most tokens are plain content, which fits as long as the string has room for it.
            let room = guide.plain_string_room();
            let stops = &self.stops;
            let mut fits = |t: u32| {
                let b = tokens.bytes(t);
                if stops.contains(&t) {
                    may_end
                } else if pad {
                    !b.is_empty() && b.iter().all(|b| b.is_ascii_whitespace())
                } else if let (Some(room), Some(chars)) = (room, tokens.plain_chars(t)) {
                    chars <= room
                } else if let Some(mask) = mask {
                    mask.get(t as usize / 64).is_some_and(|w| w >> (t % 64) & 1 == 1)
                } else {
                    !done && b.first().is_some_and(|&f| first[f as usize]) && guide.fits(b)
                }
            };
            if self.cfg.is_greedy() {
                // The first maximum among the tokens that fit, in one pass that tries a token only when it beats
                // the best so far: a handful of tries instead of the vocabulary's.
                let mut best = (f32::NEG_INFINITY, None);
                for &(l, t) in cand.iter() {
                    if l > best.0 && fits(t) {
                        best = (l, Some(t));
                    }
                }
                return match best.1 {
                    Some(t) => Ok(t),
                    None => Self::no_token_fits(stops, guide, self.generated),
                };
            }
            for c in cand.iter_mut() {
                if !fits(c.1) {
                    c.0 = f32::NEG_INFINITY;
                }
            }
            // Nothing fits: the nesting bound is reached, the request's filters leave nothing the guide allows,
            // or `min_tokens` bans the end of a complete answer.
            if !cand.iter().any(|c| c.0 > f32::NEG_INFINITY) {
                return Self::no_token_fits(stops, guide, self.generated);
            }
        }
        if self.cfg.is_greedy() {
            // Biased or penalised greedy: the first maximum, as `argmax` picks it.
            let first_max = cand
                .iter()
                .fold((f32::NEG_INFINITY, None), |best, &c| if c.0 > best.0 { (c.0, Some(c.1)) } else { best });
            return Ok(first_max.1.unwrap_or_else(|| self.weightless_row(logits)));
        }

        // top-k: keep the k largest logits (unordered).
        if top_k > 0 && top_k < cand.len() {
            cand.select_nth_unstable_by(top_k - 1, desc);
            cand.truncate(top_k);
        }
        // softmax with temperature over the survivors. An infinite logit outweighs every finite one (the softmax
        // would be NaN): the first token holding one, among the survivors, so the request's filters still hold.
        let max = cand.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.0));
        if max == f32::INFINITY {
            return Ok(cand.iter().filter(|c| c.0 == max).map(|c| c.1).min().unwrap_or(0));
        }
        if max == f32::NEG_INFINITY {
            return Ok(self.weightless_row(logits));
        }
        let mut sum = 0.0f64;
        for c in cand.iter_mut() {
            let p = ((c.0 - max) * inv_t).exp();
            c.0 = p;
            sum += p as f64;
        }
        if sum.is_nan() || sum <= 0.0 {
            return Ok(argmax(logits));
        }
        // min-p: drop what is less likely than min_p times the most likely (whose weight is exp(0) = 1).
        if self.cfg.min_p > 0.0 {
            let floor = self.cfg.min_p;
            cand.retain(|c| c.0 >= floor);
            sum = cand.iter().map(|c| c.0 as f64).sum();
        }
        // top-p: smallest prefix (by probability) whose mass reaches top_p.
        let mut keep_mass = sum;
        if top_p < 1.0 {
            cand.sort_unstable_by(desc);
            let target = top_p as f64 * sum;
            let mut acc = 0.0f64;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.0 as f64;
                if acc >= target {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
            keep_mass = acc.min(sum);
        }
        let r = self.rng.random::<f64>() * keep_mass;
        let mut acc = 0.0f64;
        for c in cand.iter() {
            acc += c.0 as f64;
            if r < acc {
                return Ok(c.1);
            }
        }
        // Rounding left r at the very top: the last candidate with non-zero mass.
        Ok(cand.iter().rev().find(|c| c.0 > 0.0).map_or(cand[0].1, |c| c.1))
    }
}

/// A generated token's log-probability and the most likely tokens at its position, as the model gave them: a
/// log-softmax of the raw logits row, before temperature, `logit_bias` and penalties (vLLM's default
/// `raw_logprobs`), so the numbers describe the model and not the request's sampling settings.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// `(token, log-probability)`, most likely first; ties go to the lower token id.
    pub top: Vec<(u32, f32)>,
}

/// [`TokenLogprobs`] of `token` in one row of logits, with the `top_n` most likely tokens (at most
/// [`MAX_TOP_LOGPROBS`]). Every value is finite: at least [`LOGPROB_FLOOR`]. The only allocation is the `top_n`
/// entries it returns.
pub fn token_logprobs(logits: &[f32], token: u32, top_n: usize) -> TokenLogprobs {
    let top_n = top_n.min(MAX_TOP_LOGPROBS as usize).min(logits.len());
    let lse = pagoda_kernels::cpu::log_sum_exp(logits);
    let logprob_of = |v: f32| {
        if v == f32::INFINITY {
            0.0
        } else if v.is_nan() || !lse.is_finite() {
            LOGPROB_FLOOR
        } else {
            // Rounding may put the largest a hair above zero.
            (v - lse).clamp(LOGPROB_FLOOR, 0.0)
        }
    };
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(top_n);
    if top_n > 0 {
        for (i, &v) in logits.iter().enumerate() {
            let v = sanitize(v);
            if top.len() == top_n && v <= top[top_n - 1].1 {
                continue;
            }
            // After every equal value: the lower id, seen first, stays ahead.
            let at = top.partition_point(|&(_, t)| t >= v);
            if top.len() == top_n {
                top.pop();
            }
            top.insert(at, (i as u32, v));
        }
        for e in &mut top {
            e.1 = logprob_of(e.1);
        }
    }
    let logprob = logits.get(token as usize).map_or(LOGPROB_FLOOR, |&v| logprob_of(v));
    TokenLogprobs { logprob, top }
}

/// Index of the largest logit; the lowest index wins ties; NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    // Two branch-free passes instead of one compare-and-branch loop: the maximum over eight lanes (which the
    // compiler vectorises; `f32::max` skips NaN), then the first index holding it. A greedy batch runs this over
    // every logits row of every step, so it is on the decode path.
    const LANES: usize = 8;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = m.max(v);
        }
    }
    let best_v = tail.iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if best_v == f32::NEG_INFINITY {
        // Nothing above -inf (or all NaN): the first token, as a strict `>` scan from -inf gives.
        return 0;
    }
    logits.iter().position(|&v| v == best_v).unwrap_or(0) as u32
}

#[inline]
fn sanitize(l: f32) -> f32 {
    if l.is_nan() { f32::NEG_INFINITY } else { l }
}

#[inline]
fn desc(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_p: f32, top_k: u32, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_p, top_k, seed: Some(seed), ..SamplingParams::greedy() }
    }

    fn biased(mut cfg: SamplingParams, bias: &[(u32, f32)]) -> SamplingParams {
        cfg.logit_bias = bias.to_vec();
        cfg
    }

    fn logits_from_probs(p: &[f32]) -> Vec<f32> {
        p.iter().map(|x| x.ln()).collect()
    }

    fn histogram(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<usize> {
        let mut buf = SampleBuffer::new();
        let mut h = vec![0usize; logits.len()];
        for _ in 0..n {
            h[s.sample(logits, &mut buf).unwrap() as usize] += 1;
        }
        h
    }

    #[test]
    fn greedy_picks_argmax_and_first_on_ties() {
        let mut s = Sampler::new(SamplingParams::greedy());
        let mut buf = SampleBuffer::new();
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0], &mut buf).unwrap(), 1);
        assert_eq!(s.sample(&[f32::NAN, -5.0], &mut buf).unwrap(), 1);
        assert_eq!(argmax(&[2.0, 2.0]), 0);
        // top_k == 1 is greedy whatever the temperature.
        let mut s = Sampler::new(cfg(1.5, 1.0, 1, 3));
        for _ in 0..50 {
            assert_eq!(s.sample(&[0.0, 0.5, 0.4], &mut buf).unwrap(), 1);
        }
    }

    /// The two-pass argmax is the strict `>` scan: first index of the maximum, NaN skipped, 0 when nothing
    /// exceeds -inf, for lengths around the lane width.
    #[test]
    fn argmax_is_the_first_maximum_of_a_scan() {
        fn scan(l: &[f32]) -> u32 {
            let (mut best, mut best_v) = (0, f32::NEG_INFINITY);
            for (i, &v) in l.iter().enumerate() {
                if v > best_v {
                    (best, best_v) = (i, v);
                }
            }
            best as u32
        }
        let mut x = 12345u32;
        for len in [0usize, 1, 7, 8, 9, 15, 16, 17, 100, 49_152] {
            for case in 0..6 {
                let l: Vec<f32> = (0..len)
                    .map(|_| {
                        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                        match (case, x % 11) {
                            (0, _) => (x >> 8) as f32 / 1e6,
                            (1, 0) => f32::NAN,
                            (2, _) => ((x >> 8) % 5) as f32, // many ties
                            (3, _) => f32::NEG_INFINITY,
                            (4, 0) => f32::NAN,
                            (4, _) => f32::NEG_INFINITY,
                            (5, 0) => f32::INFINITY,
                            _ => -((x >> 8) as f32),
                        }
                    })
                    .collect();
                assert_eq!(argmax(&l), scan(&l), "len {len}, case {case}");
            }
        }
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 101) as f32 / 25.0).collect();
        let run = |seed| {
            let mut s = Sampler::new(cfg(1.0, 0.95, 50, seed));
            let mut buf = SampleBuffer::new();
            (0..64).map(|_| s.sample(&logits, &mut buf).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn temperature_matches_softmax_statistically() {
        let probs = [0.5f32, 0.3, 0.15, 0.05];
        let logits = logits_from_probs(&probs);
        let n = 40_000;
        let h = histogram(&mut Sampler::new(cfg(1.0, 1.0, 0, 7)), &logits, n);
        for (i, &p) in probs.iter().enumerate() {
            let f = h[i] as f32 / n as f32;
            assert!((f - p).abs() < 0.015, "token {i}: freq {f} vs p {p}");
        }
        // Low temperature sharpens towards the argmax.
        let h = histogram(&mut Sampler::new(cfg(0.1, 1.0, 0, 7)), &logits, 2000);
        assert!(h[0] > 1950 && h[2] + h[3] == 0, "{h:?}");
    }

    #[test]
    fn top_k_support_and_ratios() {
        let probs = [0.05f32, 0.5, 0.15, 0.3];
        let logits = logits_from_probs(&probs);
        let n = 40_000;
        let h = histogram(&mut Sampler::new(cfg(1.0, 1.0, 2, 11)), &logits, n);
        assert_eq!(h[0], 0, "{h:?}");
        assert_eq!(h[2], 0, "{h:?}");
        let f1 = h[1] as f32 / n as f32;
        assert!((f1 - 0.5 / 0.8).abs() < 0.015, "{h:?}");
    }

    #[test]
    fn top_p_support_and_ratios() {
        let probs = [0.15f32, 0.05, 0.5, 0.3];
        let logits = logits_from_probs(&probs);
        let n = 40_000;
        // 0.5 < 0.6 <= 0.5 + 0.3: nucleus is {2, 3}.
        let h = histogram(&mut Sampler::new(cfg(1.0, 0.6, 0, 5)), &logits, n);
        assert_eq!(h[0] + h[1], 0, "{h:?}");
        let f2 = h[2] as f32 / n as f32;
        assert!((f2 - 0.5 / 0.8).abs() < 0.015, "{h:?}");
        // A tiny top_p keeps only the most likely token.
        let h = histogram(&mut Sampler::new(cfg(1.0, 0.01, 0, 5)), &logits, 1000);
        assert_eq!(h[2], 1000);
        // top-k and top-p compose: k=3 keeps {2,3,0}; p=0.9 of (0.5+0.3+0.15) keeps all three.
        let h = histogram(&mut Sampler::new(cfg(1.0, 0.9, 3, 5)), &logits, n);
        assert_eq!(h[1], 0);
        assert!(h[0] > 0 && h[2] > 0 && h[3] > 0, "{h:?}");
    }

    #[test]
    fn min_p_drops_the_unlikely_and_keeps_ratios() {
        let probs = [0.5f32, 0.3, 0.14, 0.06];
        let logits = logits_from_probs(&probs);
        let n = 40_000;
        // 0.25 x 0.5 = 0.125: tokens 0, 1 and 2 stay, 3 goes; the rest keep their ratios.
        let params = SamplingParams { min_p: 0.25, ..cfg(1.0, 1.0, 0, 9) };
        assert!(!params.is_greedy() && params.check_penalties(0).is_ok());
        let h = histogram(&mut Sampler::new(params), &logits, n);
        assert_eq!(h[3], 0, "{h:?}");
        let f0 = h[0] as f32 / n as f32;
        assert!((f0 - 0.5 / 0.94).abs() < 0.015, "{h:?}");
        // min_p 1 keeps only the most likely token.
        let h = histogram(&mut Sampler::new(SamplingParams { min_p: 1.0, ..cfg(1.0, 1.0, 0, 9) }), &logits, 500);
        assert_eq!(h[0], 500);
        for bad in [-0.1, 1.5, f32::NAN] {
            assert!(SamplingParams { min_p: bad, ..SamplingParams::greedy() }.check_penalties(0).is_err(), "{bad}");
        }
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
        let mut buf = SampleBuffer::new();
        let rep = |r: f32| SamplingParams { repetition_penalty: r, ..SamplingParams::greedy() };
        assert!(!rep(1.3).picks_argmax() && rep(1.0).picks_argmax());
        // Token 0 (logit 3) is in the prompt: 3 / 2 = 1.5 < 2, so token 1 wins; then token 1 is seen too.
        let logits = [3.0f32, 2.0, -1.0, -1.5];
        let mut s = Sampler::for_request(rep(2.0), &[0], 8, &[]);
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 1);
        // Both seen: 1.5 and 1.0; token 0 is back on top.
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 0);
        // A negative logit is multiplied: -1 x 2 = -2 < -1.5, so 3 beats 2 once 2 is seen.
        let negative = [-1.0f32, -1.5];
        let mut s = Sampler::for_request(rep(2.0), &[0], 8, &[]);
        assert_eq!(s.sample(&negative, &mut buf).unwrap(), 1);
        // Below 1 it favours repeats.
        let mut s = Sampler::for_request(rep(0.5), &[1], 8, &[]);
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 1);
        for bad in [0.0, -1.0, 10.5, f32::NAN] {
            assert!(rep(bad).check_penalties(0).is_err(), "{bad}");
        }
        assert!(rep(10.0).check_penalties(0).is_ok());
    }

    #[test]
    fn min_tokens_bans_the_stop_tokens_until_reached() {
        let mut buf = SampleBuffer::new();
        // Token 2 is the stop token and the most likely: banned for the first two tokens only.
        let logits = [1.0f32, 2.0, 5.0];
        let params = SamplingParams { min_tokens: 2, ..SamplingParams::greedy() };
        assert!(!params.picks_argmax());
        let mut s = Sampler::for_request(params.clone(), &[0], 8, &[2]);
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 1);
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 1);
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 2);
        // Sampled too: the stop token never comes out early.
        let mut s = Sampler::for_request(SamplingParams { temperature: 1.0, seed: Some(4), ..params }, &[0], 8, &[2]);
        for _ in 0..2 {
            assert_ne!(s.sample(&logits, &mut buf).unwrap(), 2);
        }
    }

    /// A guide's state as the tests follow it beside a sampler.
    trait Follow: Clone {
        fn accepts(&self, bytes: &[u8]) -> Option<Self>;
        fn is_done(&self) -> bool;
    }

    impl Follow for JsonState {
        fn accepts(&self, bytes: &[u8]) -> Option<Self> {
            JsonState::accepts(*self, bytes)
        }
        fn is_done(&self) -> bool {
            JsonState::is_done(self)
        }
    }

    impl Follow for (SchemaState, &JsonSchema) {
        fn accepts(&self, bytes: &[u8]) -> Option<Self> {
            Some((self.0.accepts(self.1, bytes)?, self.1))
        }
        fn is_done(&self) -> bool {
            self.0.is_done()
        }
    }

    impl Follow for (RegexState, &ByteDfa) {
        fn accepts(&self, bytes: &[u8]) -> Option<Self> {
            Some((self.1.feed(self.0, bytes)?, self.1))
        }
        fn is_done(&self) -> bool {
            self.1.is_match(self.0)
        }
    }

    impl Follow for (GrammarState, &Grammar) {
        fn accepts(&self, bytes: &[u8]) -> Option<Self> {
            let mut next = self.0.clone();
            next.feed(self.1, bytes).then_some((next, self.1))
        }
        fn is_done(&self) -> bool {
            self.0.may_end()
        }
    }

    /// Samples from random logits in which token `never` is always the likeliest and never fits, until the stop
    /// token `eos` or 400 tokens: every token fits what the guide allowed before it (followed from `state`), the
    /// stop comes only once the answer is complete, and a greedy sampler picks the likeliest token that fits.
    /// Returns the text.
    fn walk_guided<S: Follow>(
        s: &mut Sampler,
        vocab: &[&[u8]],
        eos: u32,
        never: usize,
        rng: &mut StdRng,
        mut state: S,
    ) -> Vec<u8> {
        let mut buf = SampleBuffer::new();
        let mut text = Vec::new();
        for _ in 0..400 {
            let mut logits: Vec<f32> = (0..vocab.len()).map(|_| rng.random::<f32>() * 4.0).collect();
            logits[never] = 10.0;
            let t = s.sample(&logits, &mut buf).unwrap();
            if t == eos {
                assert!(state.is_done(), "the end only after a complete answer: {text:?}");
                break;
            }
            let before = state.clone();
            state = before
                .accepts(vocab[t as usize])
                .unwrap_or_else(|| panic!("{t} does not fit {:?}", String::from_utf8_lossy(&text)));
            text.extend_from_slice(vocab[t as usize]);
            if s.config().is_greedy() {
                // Greedy: nothing that fits was likelier.
                let best = (0..vocab.len() as u32)
                    .filter(|&c| c != eos && before.accepts(vocab[c as usize]).is_some())
                    .map(|c| logits[c as usize])
                    .fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(logits[t as usize], best, "{text:?}");
            }
        }
        text
    }

    #[test]
    fn json_guide_samples_only_prefixes_of_one_object_then_stops() {
        let vocab: [&[u8]; 13] = [b"{", b"}", b"\"a\"", b":", b"1", b"x", b"", b" ", b",", b"[", b"]", b"\"", b"b"];
        let table = Arc::new(TokenTable::new(vocab));
        let eos = 6u32;
        let guided = |temperature: f32| {
            let cfg = SamplingParams { json_object: true, temperature, seed: Some(5), ..SamplingParams::greedy() };
            assert!(!cfg.picks_argmax());
            Sampler::for_request(cfg, &[0], 400, &[eos]).with_guide(Some(&table), &[0])
        };
        let mut buf = SampleBuffer::new();
        let mut rng = StdRng::seed_from_u64(1);
        for temperature in [0.0, 1.0] {
            // "x" is always the likeliest and never fits.
            walk_guided(&mut guided(temperature), &vocab, eos, 5, &mut rng, JsonState::new());
        }
        // A resumed stream's guide starts after the answer so far ("{" then "\"a\"", the prompt's last two tokens):
        // a colon is next.
        let cfg = SamplingParams { json_object: true, prior_output_tokens: 2, ..SamplingParams::greedy() };
        let mut s = Sampler::for_request(cfg, &[5, 0, 2], 8, &[eos]).with_guide(Some(&table), &[5, 0, 2]);
        let mut logits = [0.0f32; 13];
        logits[3] = 1.0;
        logits[0] = 2.0;
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 3);
        // Once the object is closed only the end of generation may come, however unlikely.
        let mut s = guided(0.0);
        for t in [0u32, 1] {
            logits.fill(0.0);
            logits[t as usize] = 5.0;
            assert_eq!(s.sample(&logits, &mut buf).unwrap(), t);
        }
        logits.fill(3.0);
        logits[eos as usize] = -20.0;
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), eos);
        // Where nothing fits, a sampled request fails rather than passing `{` off as a whole answer: `{` then `{`
        // is no object, and "x" never is.
        let small: [&[u8]; 3] = [b"{", b"x", b""];
        let small_table = Arc::new(TokenTable::new(small));
        let cfg = SamplingParams { json_object: true, temperature: 1.0, seed: Some(9), ..SamplingParams::greedy() };
        let mut s = Sampler::for_request(cfg, &[0], 8, &[2]).with_guide(Some(&small_table), &[0]);
        assert_eq!(s.sample(&[0.0, 9.0, -9.0], &mut buf).unwrap(), 0);
        assert_eq!(
            s.sample(&[0.0, 9.0, -9.0], &mut buf),
            Err(SampleError::NoTokenFits { guide: "json_object-guided", generated: 1 })
        );
        // Without stop tokens (ignore_eos), whitespace pads a complete object.
        let cfg = SamplingParams { json_object: true, ..SamplingParams::greedy() };
        let mut s = Sampler::for_request(cfg, &[0], 8, &[]).with_guide(Some(&table), &[0]);
        for t in [0u32, 1, 7, 7] {
            logits.fill(0.0);
            logits[t as usize] = 1.0;
            logits[5] = 9.0;
            assert_eq!(s.sample(&logits, &mut buf).unwrap(), t);
        }
    }

    #[test]
    fn schema_guide_samples_only_prefixes_of_its_documents_then_stops() {
        let schema = Arc::new(
            JsonSchema::compile(&serde_json::json!({"type": "object", "properties": {
                "a": {"enum": [1, 12]},
                "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}},
                "required": ["a", "b"], "additionalProperties": false}))
            .unwrap(),
        );
        let vocab: [&[u8]; 14] =
            [b"{", b"}", b"\"a\"", b"\"b\"", b":", b"1", b"2", b"x", b"", b",", b"[", b"]", b"{\"a\":", b" "];
        let table = Arc::new(TokenTable::new(vocab));
        let eos = 8u32;
        let mut buf = SampleBuffer::new();
        let mut rng = StdRng::seed_from_u64(3);
        for (temperature, seed) in [(0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3)] {
            let cfg = SamplingParams {
                json_schema: Some(schema.clone()),
                temperature,
                seed: Some(seed),
                ..SamplingParams::greedy()
            };
            assert!(!cfg.picks_argmax());
            let mut s = Sampler::for_request(cfg, &[0], 200, &[eos]).with_guide(Some(&table), &[0]);
            // "x" is always the likeliest and never fits.
            let text = walk_guided(&mut s, &vocab, eos, 7, &mut rng, (SchemaState::new(&schema), &*schema));
            let doc: serde_json::Value = serde_json::from_slice(&text).unwrap();
            assert!([1, 12].contains(&doc["a"].as_i64().unwrap()) && doc["b"].as_array().unwrap().len() <= 2, "{doc}");
        }
        // A resumed stream's guide starts after the answer so far (`{"a":` then `1`): `2`, `,` or ` ` may follow,
        // not `}` (`b` is required).
        let cfg =
            SamplingParams { json_schema: Some(schema.clone()), prior_output_tokens: 2, ..SamplingParams::greedy() };
        let mut s = Sampler::for_request(cfg, &[7, 12, 5], 8, &[eos]).with_guide(Some(&table), &[7, 12, 5]);
        let mut logits = [0.0f32; 14];
        logits[1] = 3.0;
        logits[9] = 2.0;
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 9);
    }

    /// Each guide's forced bytes, cut into the longest tokens that start them.
    #[test]
    fn forced_tokens_are_what_each_guide_leaves_no_choice_about() {
        let vocab: [&[u8]; 15] = [
            b"y", b"es", b"yes", b" please", b"n", b"o", b"ab", b"a", b"1", b"cd", b"{", b"\"", b"name", b"\":", b"rue",
        ];
        let table = Arc::new(TokenTable::new(vocab));
        let text = |out: &[u32]| out.iter().flat_map(|&t| vocab[t as usize].to_vec()).collect::<Vec<u8>>();
        let mut out = Vec::new();
        let guided = |cfg: SamplingParams, prompt: &[u32], prior: u32| {
            let cfg = SamplingParams { prior_output_tokens: prior, ..cfg };
            Sampler::for_request(cfg, prompt, 16, &[99]).with_guide(Some(&table), prompt)
        };
        // A choice: nothing is forced before the first byte decides; after "y", the rest of that choice.
        let dfa = Arc::new(ByteDfa::compile("yes please|no").unwrap());
        let regex = SamplingParams { regex: Some(dfa), ..SamplingParams::greedy() };
        let mut s = guided(regex.clone(), &[0], 0);
        s.forced_tokens(&mut out, 8);
        assert!(out.is_empty(), "{out:?}");
        let mut s = guided(regex, &[0], 1);
        s.forced_tokens(&mut out, 8);
        assert_eq!(out, [1, 3], "es + please");
        assert_eq!(text(&out), b"es please");
        s.forced_tokens(&mut out, 1);
        assert_eq!(out, [1], "at most max tokens");
        // A grammar: its opening literal; then digits or the closing literal may come, so nothing.
        let g = Arc::new(Grammar::compile(r#"root ::= "ab" [0-9]+ "cd""#).unwrap());
        let grammar = SamplingParams { grammar: Some(g), ..SamplingParams::greedy() };
        let mut s = guided(grammar.clone(), &[0], 0);
        s.forced_tokens(&mut out, 8);
        assert_eq!(out, [6]);
        let mut s = guided(grammar, &[6, 8], 2);
        s.forced_tokens(&mut out, 8);
        assert!(out.is_empty());
        // A JSON object's literal: after `t`, the rest of `true`.
        let object = SamplingParams { json_object: true, ..SamplingParams::greedy() };
        let mut s = Sampler::for_request(object, &[0], 16, &[99]).with_guide(Some(&table), &[0]);
        for b in [&b"{"[..], b"\"", b"name", b"\":"] {
            assert!(s.guide.as_mut().unwrap().0.advance(b));
        }
        assert!(s.guide.as_mut().unwrap().0.advance(b"t"));
        s.forced_tokens(&mut out, 8);
        assert_eq!(text(&out), b"rue");
        // A schema's only key, after its opening quote; no guide, nothing.
        let schema = Arc::new(
            JsonSchema::parse(
                r#"{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}"#,
            )
            .unwrap(),
        );
        let mut s = guided(SamplingParams { json_schema: Some(schema), ..SamplingParams::greedy() }, &[10, 11], 2);
        s.forced_tokens(&mut out, 8);
        // (whitespace may come before the colon, so the key's closing quote is where the forcing stops).
        assert_eq!(out, [12, 11]);
        let mut s = Sampler::for_request(SamplingParams::greedy(), &[0], 16, &[99]);
        s.forced_tokens(&mut out, 8);
        assert!(out.is_empty());
    }

    /// Numbers, dashes and "ok"/"okay" in pieces; 4 ("x") never fits the guides below, 5 is the stop token.
    const NUMBERED_OK: [&[u8]; 10] = [b"1", b"23", b"-", b"4-", b"x", b"", b"ok", b"ay", b"o", b"k"];

    #[test]
    fn grammar_guide_samples_only_prefixes_of_a_sentence_and_stops_on_one() {
        let vocab = NUMBERED_OK;
        let table = Arc::new(TokenTable::new(vocab));
        let eos = 5u32;
        let mut rng = StdRng::seed_from_u64(12);
        let grammar = Arc::new(
            Grammar::compile(
                r#"
                root ::= list "ok" "ay"?
                list ::= num | list "-" num     # left recursion
                num ::= [0-9]{1,3}
                "#,
            )
            .unwrap(),
        );
        for (temperature, seed) in [(0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3), (1.0, 4), (0.7, 5)] {
            let cfg = SamplingParams {
                grammar: Some(grammar.clone()),
                temperature,
                seed: Some(seed),
                ..SamplingParams::greedy()
            };
            assert!(cfg.guided() && cfg.ends_on_stop() && !cfg.picks_argmax());
            let mut s = Sampler::for_request(cfg, &[0], 200, &[eos]).with_guide(Some(&table), &[0]);
            // "x" is always the likeliest and never fits.
            let text = walk_guided(&mut s, &vocab, eos, 4, &mut rng, (grammar.start(), &*grammar));
            let mut check = grammar.start();
            assert!(check.feed(&grammar, &text) && check.may_end(), "{:?}", String::from_utf8_lossy(&text));
        }
        // A resumed answer: the guide starts after the prior output tokens ("23", "-").
        let cfg = SamplingParams { grammar: Some(grammar.clone()), prior_output_tokens: 2, ..SamplingParams::greedy() };
        let mut s = Sampler::for_request(cfg, &[9, 1, 2], 8, &[eos]).with_guide(Some(&table), &[9, 1, 2]);
        let mut logits = [0.0f32; 10];
        logits[6] = 3.0; // "ok" right after "-" does not fit
        logits[0] = 1.0;
        assert_eq!(s.sample(&logits, &mut SampleBuffer::new()).unwrap(), 0);
    }

    #[test]
    fn regex_guide_samples_only_prefixes_of_a_match_and_stops_on_one() {
        let vocab = NUMBERED_OK;
        let table = Arc::new(TokenTable::new(vocab));
        let eos = 5u32;
        let mut rng = StdRng::seed_from_u64(11);
        // The second pattern has more states than the sampler keeps masks for, so its masks are replaced as it
        // goes.
        for pattern in [r"(\d{1,3}-){1,2}(ok|okay)", r"(1|23|4-){8,40}ok"] {
            let dfa = Arc::new(ByteDfa::compile(pattern).unwrap());
            let full = regex_automata::meta::Regex::new(&format!("^(?:{pattern})$")).unwrap();
            for (temperature, seed) in [(0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3), (1.0, 4)] {
                let cfg = SamplingParams {
                    regex: Some(dfa.clone()),
                    temperature,
                    seed: Some(seed),
                    ..SamplingParams::greedy()
                };
                assert!(cfg.guided() && !cfg.picks_argmax());
                let mut s = Sampler::for_request(cfg, &[0], 200, &[eos]).with_guide(Some(&table), &[0]);
                // "x" is always the likeliest and never fits.
                let text = walk_guided(&mut s, &vocab, eos, 4, &mut rng, (dfa.start(), &*dfa));
                assert!(full.is_match(&text), "{pattern}: {:?}", String::from_utf8_lossy(&text));
            }
        }
        let dfa = Arc::new(ByteDfa::compile(r"(\d{1,3}-){1,2}(ok|okay)").unwrap());
        // On a match that may go on ("1-ok", then "ay"), the stop token and the continuation both fit, and the
        // likelier wins; at the end of every match only the stop token does.
        let mut buf = SampleBuffer::new();
        let mut s = Sampler::for_request(
            SamplingParams { regex: Some(dfa.clone()), ..SamplingParams::greedy() },
            &[0],
            8,
            &[eos],
        )
        .with_guide(Some(&table), &[0]);
        let mut logits = [0.0f32; 10];
        for t in [0u32, 2, 6] {
            logits.fill(0.0);
            logits[t as usize] = 1.0;
            assert_eq!(s.sample(&logits, &mut buf).unwrap(), t);
        }
        logits.fill(0.0);
        logits[7] = 2.0;
        logits[eos as usize] = 1.0;
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 7);
        logits.fill(3.0);
        logits[eos as usize] = -20.0;
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), eos);
    }

    /// `guided_regex: "b"` with `allowed_token_ids: [a]`: no allowed token starts a match, so the request fails
    /// instead of ending on the stop token as if "" matched (greedy) or taking a token the guide refuses.
    #[test]
    fn a_guide_no_allowed_token_fits_fails_instead_of_stopping() {
        let vocab: [&[u8]; 3] = [b"a", b"b", b""];
        let table = Arc::new(TokenTable::new(vocab));
        let eos = 2u32;
        let dfa = Arc::new(ByteDfa::compile("b").unwrap());
        let mut buf = SampleBuffer::new();
        for temperature in [0.0, 1.0] {
            let cfg = SamplingParams {
                regex: Some(dfa.clone()),
                allowed_token_ids: vec![0],
                temperature,
                seed: Some(1),
                ..SamplingParams::greedy()
            };
            let mut s = Sampler::for_request(cfg, &[0], 8, &[eos]).with_guide(Some(&table), &[0]);
            let err = s.sample(&[1.0, 0.0, 2.0], &mut buf).unwrap_err();
            assert_eq!(err, SampleError::NoTokenFits { guide: "regex-guided", generated: 0 });
            assert!(err.to_string().starts_with(GUIDE_DEAD_END), "{err}");
        }
        // A whole match whose stop token the request's filters ban still ends on it: nothing is cut.
        let cfg =
            SamplingParams { regex: Some(dfa.clone()), allowed_token_ids: vec![0, 1], ..SamplingParams::greedy() };
        let mut s = Sampler::for_request(cfg, &[0], 8, &[eos]).with_guide(Some(&table), &[0]);
        assert_eq!(s.sample(&[1.0, 0.0, 2.0], &mut buf), Ok(1));
        assert_eq!(s.sample(&[1.0, 0.0, -2.0], &mut buf), Ok(eos));
        // Infinite logits (every softmax weight would be NaN) do not get past the guide: of the two, the one it
        // allows ("b") is taken, where the row's raw argmax ("a") would have left the guide behind the text.
        let cfg = SamplingParams { regex: Some(dfa), temperature: 1.0, seed: Some(2), ..SamplingParams::greedy() };
        let mut s = Sampler::for_request(cfg, &[0], 8, &[eos]).with_guide(Some(&table), &[0]);
        assert_eq!(s.sample(&[f32::INFINITY, f32::INFINITY, 0.0], &mut buf), Ok(1));
    }

    /// A grammar whose ambiguity outgrows the recognizer's work bound: favouring `a`, greedy follows it until the
    /// bound refuses every byte (`b` completes the ambiguous rule too), and the request fails there with the
    /// reason, rather than ending on the stop token short of the required `b`.
    #[test]
    fn a_grammar_stalled_by_its_work_bound_fails_with_the_reason() {
        let vocab: [&[u8]; 3] = [b"a", b"b", b""];
        let table = Arc::new(TokenTable::new(vocab));
        let eos = 2u32;
        let mut buf = SampleBuffer::new();
        let stalled = Arc::new(Grammar::compile(r#"root ::= s "b"  s ::= s s | "a" | "b""#).unwrap());
        let cfg = SamplingParams { grammar: Some(stalled), logit_bias: vec![(0, 100.0)], ..SamplingParams::greedy() };
        let mut s = Sampler::for_request(cfg, &[0], 1000, &[eos]).with_guide(Some(&table), &[0]);
        let logits = [0.0f32, 1.0, 2.0];
        let mut emitted = 0u32;
        let err = loop {
            match s.sample(&logits, &mut buf) {
                Ok(t) => {
                    assert_eq!(t, 0, "after {emitted} tokens");
                    emitted += 1;
                    assert!(emitted < 1000);
                }
                Err(e) => break e,
            }
        };
        assert!(emitted > 10, "{emitted}");
        assert_eq!(err, SampleError::WorkBound { generated: emitted });
        assert!(err.to_string().contains("ambiguous"), "{err}");
        // The audit's grammar: once `a` is refused, `b` still fits, so the answer completes and ends on the stop.
        let open = Arc::new(Grammar::compile(r#"root ::= s "a" "b"  s ::= s s | "a""#).unwrap());
        let cfg = SamplingParams { grammar: Some(open), logit_bias: vec![(0, 100.0)], ..SamplingParams::greedy() };
        let mut s = Sampler::for_request(cfg, &[0], 1000, &[eos]).with_guide(Some(&table), &[0]);
        let mut out = Vec::new();
        loop {
            match s.sample(&logits, &mut buf).unwrap() {
                t if t == eos => break,
                t => out.push(t),
            }
            assert!(out.len() < 1000);
        }
        assert!(out.len() > 10 && out.ends_with(&[0, 1]), "{}", out.len());
    }

    #[test]
    fn logit_bias_moves_greedy_and_sampled_choices() {
        let mut buf = SampleBuffer::new();
        let logits = [1.0f32, 3.0, 2.0, f32::NAN];
        // Greedy: banning the argmax gives the runner-up; +100 forces a token; a bias that creates a tie keeps
        // the lower index, as the unbiased argmax does.
        let mut s = Sampler::new(biased(SamplingParams::greedy(), &[(1, -100.0)]));
        assert!(!s.config().picks_argmax());
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 2);
        let mut s = Sampler::new(biased(SamplingParams::greedy(), &[(0, 100.0)]));
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 0);
        let mut s = Sampler::new(biased(SamplingParams::greedy(), &[(2, 1.0)]));
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 1);
        // NaN stays out of reach, whatever its bias.
        let mut s = Sampler::new(biased(SamplingParams::greedy(), &[(3, 100.0)]));
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 1);
        // Sampled: a banned token never comes out, and the others keep their ratio (ln 3 on token 0 makes
        // tokens 0 and 1 equally likely).
        let probs = [0.25f32, 0.75, 0.0001];
        let h = histogram(
            &mut Sampler::new(biased(cfg(1.0, 1.0, 0, 9), &[(0, 3f32.ln()), (2, -100.0)])),
            &logits_from_probs(&probs),
            20_000,
        );
        assert_eq!(h[2], 0, "{h:?}");
        let f0 = h[0] as f32 / 20_000.0;
        assert!((f0 - 0.5).abs() < 0.015, "{h:?}");
        // Top-k ranks the biased logits.
        let h = histogram(&mut Sampler::new(biased(cfg(1.0, 1.0, 1, 9), &[(1, -100.0)])), &[1.0, 3.0, 2.0], 100);
        assert_eq!(h, vec![0, 0, 100]);
    }

    #[test]
    fn allowed_token_ids_restrict_greedy_and_sampled_choices() {
        let mut buf = SampleBuffer::new();
        let allowed = |cfg: SamplingParams, ids: &[u32]| SamplingParams { allowed_token_ids: ids.to_vec(), ..cfg };
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        // Greedy: the best allowed token, not the argmax; the runner's argmax path is off.
        let mut s = Sampler::new(allowed(SamplingParams::greedy(), &[0, 2]));
        assert!(!s.config().picks_argmax());
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 2);
        // A bias still ranks the allowed ones.
        let mut s = Sampler::new(biased(allowed(SamplingParams::greedy(), &[0, 2]), &[(0, 5.0)]));
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 0);
        // Sampled: only allowed tokens come out, in their own ratio (0.25 : 0.25 of the whole).
        let probs = logits_from_probs(&[0.25, 0.5, 0.0, 0.25]);
        let h = histogram(&mut Sampler::new(allowed(cfg(1.0, 1.0, 0, 4), &[0, 3])), &probs, 20_000);
        assert_eq!((h[1], h[2]), (0, 0), "{h:?}");
        assert!((h[0] as f32 / 20_000.0 - 0.5).abs() < 0.015, "{h:?}");
        // An infinite logit outside the allowed set does not get past it, sampled or greedy; one inside it wins.
        let infinite = [1.0f32, f32::INFINITY, 2.0, 0.5];
        for params in [cfg(1.0, 1.0, 0, 4), biased(SamplingParams::greedy(), &[(3, 0.5)])] {
            let mut s = Sampler::new(allowed(params.clone(), &[0, 2]));
            assert_eq!(s.sample(&infinite, &mut buf).unwrap(), 2, "{params:?}");
            let mut s = Sampler::new(allowed(params.clone(), &[0, 1]));
            assert_eq!(s.sample(&infinite, &mut buf).unwrap(), 1, "{params:?}");
            // A row with no weight left in the allowed set (NaN and -inf) still keeps to it.
            let weightless = [f32::NAN, 5.0, f32::NEG_INFINITY, 1.0];
            let mut s = Sampler::new(allowed(params.clone(), &[2, 0]));
            assert_eq!(s.sample(&weightless, &mut buf).unwrap(), 2, "{params:?}");
        }
        // Bounds.
        assert!(check_allowed_tokens(&[0, 3, 3], 4).is_ok());
        assert!(check_allowed_tokens(&[4], 4).unwrap_err().contains("outside the vocabulary"));
        assert!(check_allowed_tokens(&[0; 5], 4).unwrap_err().contains("5 entries"));
    }

    #[test]
    fn bad_words_ban_the_token_that_would_complete_them() {
        let mut buf = SampleBuffer::new();
        // Token 0 always leads, then 1, then 2, then 3.
        let logits = [4.0f32, 3.0, 2.0, 1.0];
        let banning = |words: &[&[u32]], prior: u32| SamplingParams {
            bad_words: words.iter().map(|w| w.to_vec()).collect(),
            prior_output_tokens: prior,
            ..SamplingParams::greedy()
        };
        // A one-token word is never sampled; the runner's argmax path is off.
        let mut s = Sampler::for_request(banning(&[&[0]], 0), &[7], 8, &[]);
        assert!(!s.config().picks_argmax());
        assert_eq!((0..3).map(|_| s.sample(&logits, &mut buf).unwrap()).collect::<Vec<_>>(), vec![1, 1, 1]);
        // [0, 0]: the first 0 is free, a second one would complete the word, a third is free again after a 1.
        let mut s = Sampler::for_request(banning(&[&[0, 0]], 0), &[0], 8, &[]);
        assert_eq!((0..4).map(|_| s.sample(&logits, &mut buf).unwrap()).collect::<Vec<_>>(), vec![0, 1, 0, 1]);
        // The prompt is not output: its last 0 does not count, unless an earlier attempt generated it.
        let mut s = Sampler::for_request(banning(&[&[0, 0]], 1), &[0], 8, &[]);
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 1);
        // Longer words look that far back; several words ban several tokens at once.
        let mut s = Sampler::for_request(banning(&[&[0, 0], &[0, 1, 0]], 0), &[], 8, &[]);
        assert_eq!((0..6).map(|_| s.sample(&logits, &mut buf).unwrap()).collect::<Vec<_>>(), vec![0, 1, 1, 0, 1, 1]);
        let mut s = Sampler::for_request(banning(&[&[1, 0], &[1, 1], &[1, 2]], 0), &[], 8, &[]);
        let biased_to_1 = [4.0f32, 5.0, 2.0, 1.0];
        assert_eq!(s.sample(&biased_to_1, &mut buf).unwrap(), 1);
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 3, "after 1, each of 0, 1 and 2 completes a word");
        // Sampled: the banned token never comes out.
        let probs = logits_from_probs(&[0.5, 0.25, 0.25, 0.0]);
        let mut s = Sampler::for_request(
            SamplingParams { temperature: 1.0, seed: Some(3), ..banning(&[&[1, 1]], 0) },
            &[],
            4000,
            &[],
        );
        let out: Vec<u32> = (0..4000).map(|_| s.sample(&probs, &mut buf).unwrap()).collect();
        assert!(out.windows(2).all(|w| w != [1, 1]), "a sampled [1, 1]");
        assert!(out.contains(&1) && out.contains(&2));
        // Bounds.
        assert!(check_bad_words(&[vec![3; MAX_BAD_WORD_TOKENS]], 4).is_ok());
        assert!(check_bad_words(&[vec![]], 4).unwrap_err().contains("bad_words[0]"));
        assert!(check_bad_words(&[vec![1], vec![3; MAX_BAD_WORD_TOKENS + 1]], 4).unwrap_err().contains("bad_words[1]"));
        assert!(check_bad_words(&[vec![4]], 4).unwrap_err().contains("outside the vocabulary"));
        assert!(check_bad_words(&vec![vec![1]; MAX_BAD_WORDS + 1], 4).unwrap_err().contains("at most"));
    }

    fn penalised(presence: f32, frequency: f32, prior: u32) -> SamplingParams {
        SamplingParams {
            presence_penalty: presence,
            frequency_penalty: frequency,
            prior_output_tokens: prior,
            ..SamplingParams::greedy()
        }
    }

    #[test]
    fn penalties_count_what_was_generated() {
        let mut buf = SampleBuffer::new();
        // Token 0 leads by 1.0 and token 1 by 0.5 over token 2.
        let logits = [3.0f32, 2.5, 2.0];
        // Frequency 0.4: each emission costs its token 0.4, so greedy goes 0, 0 (2.6 > 2.5), 1 (2.2 < 2.5), ...
        let mut s = Sampler::for_request(penalised(0.0, 0.4, 0), &[], 8, &[]);
        assert!(!s.config().picks_argmax());
        let got: Vec<u32> = (0..6).map(|_| s.sample(&logits, &mut buf).unwrap()).collect();
        assert_eq!(got, vec![0, 0, 1, 0, 1, 2]);
        // Presence 0.75: once each is used, each drops the same, so the order repeats.
        let mut s = Sampler::for_request(penalised(0.75, 0.0, 0), &[], 8, &[]);
        let got: Vec<u32> = (0..5).map(|_| s.sample(&logits, &mut buf).unwrap()).collect();
        assert_eq!(got, vec![0, 1, 0, 0, 0]);
        // A negative penalty rewards repetition.
        let mut s = Sampler::for_request(penalised(-1.0, -1.0, 0), &[], 8, &[]);
        assert!((0..5).all(|_| s.sample(&[2.0, 3.0], &mut buf).unwrap() == 1));
        // A resumed stream counts the prompt's tail as output: token 0 twice, at 0.6 each, puts it below token 1.
        let mut s = Sampler::for_request(penalised(0.0, 0.6, 2), &[0, 0, 0], 4, &[]);
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 1);
        let mut s = Sampler::for_request(penalised(0.0, 0.6, 0), &[0, 0, 0], 4, &[]);
        assert_eq!(s.sample(&logits, &mut buf).unwrap(), 0);
        // Sampled: a large frequency penalty spreads the choice over all three (about 39 zeros in 40 without it).
        let mut s = Sampler::for_request(SamplingParams { temperature: 1.0, ..penalised(0.0, 2.0, 0) }, &[], 64, &[]);
        let probs = logits_from_probs(&[0.98, 0.01, 0.01]);
        let got: Vec<u32> = (0..40).map(|_| s.sample(&probs, &mut buf).unwrap()).collect();
        let zeros = got.iter().filter(|&&t| t == 0).count();
        assert!(zeros <= 20, "{got:?}");
        // Bounds.
        assert!(penalised(2.0, -2.0, 3).check_penalties(3).is_ok());
        assert!(penalised(2.5, 0.0, 0).check_penalties(3).unwrap_err().contains("presence_penalty"));
        assert!(penalised(0.0, f32::NAN, 0).check_penalties(3).unwrap_err().contains("frequency_penalty"));
        assert!(penalised(0.0, 0.0, 4).check_penalties(3).unwrap_err().contains("prior_output_tokens"));
    }

    #[test]
    fn logit_bias_checks_sort_and_bound() {
        let mut ok = vec![(9, 1.0), (2, -100.0), (5, 100.0)];
        check_logit_bias(&mut ok, 10).unwrap();
        assert_eq!(ok, vec![(2, -100.0), (5, 100.0), (9, 1.0)]);
        for (mut bad, want) in [
            (vec![(1000, 1.0)], "outside the vocabulary"),
            (vec![(1, 100.5)], "[-100, 100]"),
            (vec![(1, f32::NAN)], "[-100, 100]"),
            (vec![(3, 1.0), (3, 2.0)], "more than once"),
            ((0..301).map(|t| (t, 0.0)).collect(), "at most 300"),
        ] {
            let e = check_logit_bias(&mut bad, 1000).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn logprobs_are_a_log_softmax_of_the_raw_row() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0, 0.5, 0.0, 2.5, -2.0];
        let lse = logits.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
        let want = |i: usize| (logits[i] as f64 - lse) as f32;
        let got = token_logprobs(&logits, 2, 4);
        assert!((got.logprob - want(2)).abs() < 1e-5, "{got:?}");
        // Most likely first; the tie between tokens 1 and 3 goes to the lower id.
        let ids: Vec<u32> = got.top.iter().map(|e| e.0).collect();
        assert_eq!(ids, [1, 3, 7, 2]);
        for &(t, lp) in &got.top {
            assert!((lp - want(t as usize)).abs() < 1e-5);
        }
        let total: f64 = (0..logits.len()).map(|i| (want(i) as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
        // No alternatives asked, or more than the row has.
        assert!(token_logprobs(&logits, 0, 0).top.is_empty());
        assert_eq!(token_logprobs(&logits, 0, 100).top.len(), logits.len());
        // Every alternative the cap allows on a vocabulary-sized row, against a full sort.
        let row: Vec<f32> = (0..5000u32).map(|i| ((i * 7919) % 1013) as f32 * 0.01).collect();
        let got = token_logprobs(&row, 17, 25);
        assert_eq!(got.top.len(), MAX_TOP_LOGPROBS as usize);
        let mut sorted: Vec<(f32, u32)> = row.iter().enumerate().map(|(i, &v)| (v, i as u32)).collect();
        sorted.sort_by(desc);
        let want_ids: Vec<u32> = sorted[..20].iter().map(|e| e.1).collect();
        assert_eq!(got.top.iter().map(|e| e.0).collect::<Vec<_>>(), want_ids);
    }

    #[test]
    fn logprobs_stay_finite_on_degenerate_rows() {
        // A banned token (-inf), NaN, and a token out of the row are all at the floor; the rest is unharmed.
        let logits = [0.0f32, f32::NEG_INFINITY, f32::NAN, 0.0];
        let got = token_logprobs(&logits, 1, 4);
        assert_eq!(got.logprob, LOGPROB_FLOOR);
        assert!((token_logprobs(&logits, 0, 0).logprob - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(token_logprobs(&logits, 2, 0).logprob, LOGPROB_FLOOR);
        assert_eq!(token_logprobs(&logits, 99, 0).logprob, LOGPROB_FLOOR);
        assert_eq!(got.top.iter().map(|e| e.0).collect::<Vec<_>>(), [0, 3, 1, 2]);
        assert!(got.top.iter().all(|e| e.1.is_finite() && e.1 <= 0.0));
        // Nothing above -inf, or an infinite logit.
        let dead = [f32::NEG_INFINITY, f32::NAN];
        assert_eq!(token_logprobs(&dead, 0, 2).top, [(0, LOGPROB_FLOOR), (1, LOGPROB_FLOOR)]);
        let sure = [1.0f32, f32::INFINITY];
        assert_eq!(token_logprobs(&sure, 1, 0).logprob, 0.0);
        assert_eq!(token_logprobs(&sure, 0, 0).logprob, LOGPROB_FLOOR);
        // A confident row: the top token at (almost) zero, never above it.
        let peaked = [100.0f32, 0.0, 0.0];
        let got = token_logprobs(&peaked, 0, 1);
        assert!(got.logprob <= 0.0 && got.logprob > -1e-6);
        assert_eq!(token_logprobs(&[], 0, 3), TokenLogprobs { logprob: LOGPROB_FLOOR, top: vec![] });
    }

    #[test]
    fn buffer_is_reused_without_growth() {
        let logits: Vec<f32> = (0..4096).map(|i| (i % 13) as f32).collect();
        let mut buf = SampleBuffer::with_capacity(logits.len());
        let cap = buf.cand.capacity();
        let mut s = Sampler::new(cfg(0.8, 0.9, 0, 1));
        for _ in 0..100 {
            s.sample(&logits, &mut buf).unwrap();
        }
        assert_eq!(buf.cand.capacity(), cap);
    }
}
