//! Constrained decoding to one JSON document that a JSON Schema describes (OpenAI's `response_format:
//! {"type": "json_schema", ...}`, vLLM's `guided_json`).
//!
//! [`JsonSchema::compile`] turns the supported subset of JSON Schema into a graph of nodes (objects with their
//! properties in the schema's order, arrays, strings, numbers, literal alternatives, and `anyOf` choices), and
//! refuses what it cannot guide with a [`SchemaError`] that names the keyword and where it is. [`SchemaState`] is a
//! pushdown automaton over that graph: it accepts exactly the byte prefixes of the documents the guide can
//! produce, one frame per open object or array, at most [`MAX_FRAMES`] deep.
//!
//! What is guided, and what it means for the answer:
//! - Objects emit their declared properties in the schema's order, each required one exactly once, an optional
//!   one at most once. No undeclared property is generated (`additionalProperties` other than `false` is
//!   satisfied by generating none); an object that declares no properties is a map of its
//!   `additionalProperties` schema (any JSON value by default).
//! - `enum` and `const` are matched against each value's compact serialisation; `boolean` and `null` are the
//!   literals they name.
//! - `anyOf`, `oneOf` and lists of types are choices among alternatives that must start with different characters
//!   (a string or a number, an object or null), so that the first character picks one; others are refused.
//! - `$ref` to `#`, `#/$defs/NAME` or `#/definitions/NAME` may recurse; the nesting bound then ends it: a key,
//!   item or alternative is offered only where its shallowest value still fits within [`MAX_FRAMES`], and a schema
//!   whose documents cannot fit at all is refused.
//! - Strings honour `minLength` and `maxLength` (in characters), and a `pattern` or one of the [`FORMATS`], which
//!   the whole string must match (as vLLM's guides read a pattern; JSON Schema's own reading is a search) and
//!   which is written without escapes ([`ByteDfa::compile_json_string`]); both together through a `LengthTable`,
//!   so that the string can always end on a match of an allowed length; arrays `minItems` and `maxItems`; integers
//!   `minimum`, `maximum` and their exclusive forms, one end or both, as the pattern of the decimal numerals in
//!   the range (an open end stops at [`OPEN_INTEGER_BOUND`], and an integer without bounds is the range of two
//!   open ends); numbers the same bounds (of at most
//!   [`BOUND_FRACTION_DIGITS`] decimals), as the pattern of the plain decimals (no exponent, at most 15 fraction
//!   digits) in the range.
//! - Whitespace between tokens is allowed, [`MAX_WS_RUN`] bytes in a row at most, and numbers are at most
//!   [`MAX_NUMBER_BYTES`] long, so that the guide always makes progress.

use std::collections::HashMap;

use serde_json::Value;
use thiserror::Error;

use std::sync::Arc;

use crate::json_guide::{Num, StrByte, is_ws, string_byte};
use crate::regex_guide::{ByteDfa, RegexState};

/// Deepest nesting of objects and arrays in a guided answer.
pub const MAX_FRAMES: usize = 32;
/// Most nodes a compiled schema may have.
pub const MAX_NODES: usize = 2048;
/// Most properties one object may declare.
pub const MAX_PROPERTIES: usize = 128;
/// Most values one `enum` may list.
pub const MAX_ENUM_VALUES: usize = 2048;
/// Most alternatives of one `anyOf`.
pub const MAX_ALTERNATIVES: usize = 16;
/// Longest serialised schema the API accepts.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// Longest property name an object may declare, in bytes as JSON writes it.
pub const MAX_PROPERTY_NAME_BYTES: usize = 4096;
/// Largest `minItems` or `minLength`: a document that must be longer fits no answer's token budget.
pub const MAX_MIN_COUNT: u32 = 65_536;
/// Deepest nesting of subschemas (through properties, items, alternatives and `$ref`s) that is compiled, so that
/// compiling, which recurses once per level, stays well within a thread's stack.
pub const MAX_SCHEMA_NESTING: usize = 128;
/// Longest run of whitespace the guide allows between two tokens of JSON.
pub const MAX_WS_RUN: u8 = 32;
/// Longest number the guide lets the model write, in bytes (so that a stream of digits ends).
pub const MAX_NUMBER_BYTES: u8 = 32;

/// Most automaton states the patterns and formats of one schema may keep in all (each distinct pattern is
/// compiled once).
pub const MAX_PATTERN_STATES: usize = 16_384;

/// The largest magnitude a bounded integer with an open end may take: 15 digits.
pub const OPEN_INTEGER_BOUND: i64 = 999_999_999_999_999;

/// The string formats the guide follows, each as the pattern its strings match. `format` on other types is an
/// annotation (OpenAPI's `int32` and the like) and ignored.
pub const FORMATS: [(&str, &str); 6] = [
    // RFC 3339's full-date, full-time (seconds, an optional fraction, an offset) and date-time.
    ("date", "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("time", "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]([.][0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"),
    (
        "date-time",
        "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])\
         T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]([.][0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])",
    ),
    ("uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"),
    ("ipv4", "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])([.](25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])){3}"),
    // A practical address: a local part of common characters, and a domain whose last label is letters.
    ("email", "[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]+([.][A-Za-z0-9-]+)*[.][A-Za-z]{2,}"),
];

/// A schema the guide cannot follow, with the JSON pointer of the part that is wrong.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("json_schema at `{path}`: {message}")]
pub struct SchemaError {
    pub path: String,
    pub message: String,
}

fn err<T>(path: &str, message: impl Into<String>) -> Result<T, SchemaError> {
    let path = if path.starts_with('#') { path.to_string() } else { format!("#{path}") };
    Err(SchemaError { path, message: message.into() })
}

type NodeId = u16;

#[derive(Debug, Clone, PartialEq)]
struct Prop {
    /// The key as it appears after its opening quote: JSON-escaped, with the closing quote.
    key: Vec<u8>,
    node: NodeId,
    required: bool,
}

#[derive(Debug, Clone, PartialEq)]
enum Node {
    /// Declared properties in order (`sorted`: their indices by key bytes, for prefix matching); `map`: the value
    /// schema of an object that declares none and takes any keys.
    Object {
        props: Vec<Prop>,
        sorted: Vec<u8>,
        map: Option<NodeId>,
    },
    Array {
        items: NodeId,
        min: u32,
        max: u32,
    },
    /// `pattern`: the pattern (or format) the whole string matches; `lengths`: with length bounds beside it,
    /// where the pattern and the length can still end together.
    Str {
        min: u32,
        max: u32,
        pattern: Option<Arc<ByteDfa>>,
        lengths: Option<Arc<LengthTable>>,
    },
    /// A number without bounds (JSON's grammar, at most [`MAX_NUMBER_BYTES`] long).
    Number,
    /// A value written bare (not quoted) that matches the pattern in full, ended by the byte after it: an
    /// integer, or a number with bounds.
    Bare(Arc<ByteDfa>),
    /// Compact serialisations, sorted and distinct.
    Literals(Vec<Vec<u8>>),
    Choice(Vec<NodeId>),
    /// A `$ref` or a definition, resolved away after compiling.
    Alias(NodeId),
}

/// A compiled schema: see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonSchema {
    nodes: Vec<Node>,
    root: NodeId,
    /// The bytes each node's value may start with (a bitset), which make `anyOf` deterministic.
    first: Vec<[u64; 4]>,
    /// The frames the shallowest value of each node opens, its own included ([`frames_needed`]).
    need: Vec<u8>,
}

/// What [`frames_needed`] gives a node none of whose values ends within [`MAX_FRAMES`].
const NEVER: u8 = u8::MAX;

/// For each node, how many frames its shallowest value opens at once, its own included, or [`NEVER`] past
/// [`MAX_FRAMES`]: an object needs one more than its deepest required property, an array with `minItems` one more
/// than its items, a choice what its shallowest alternative needs, and anything else its own frame. The guide
/// starts a value only where what it needs fits, so that an answer can always be finished.
///
/// Settled shallowest first (as Dijkstra's shortest paths are): a node is settled when its last required part is,
/// so each edge is looked at once.
fn frames_needed(nodes: &[Node]) -> Vec<u8> {
    let mut need = vec![NEVER; nodes.len()];
    // The nodes whose need waits on each node, and how many parts each object still waits on.
    let mut parents: Vec<Vec<NodeId>> = vec![Vec::new(); nodes.len()];
    let mut waiting = vec![0usize; nodes.len()];
    let mut settle: Vec<Vec<NodeId>> = vec![Vec::new(); MAX_FRAMES + 1];
    for (id, node) in nodes.iter().enumerate() {
        let id = id as NodeId;
        match node {
            Node::Object { props, .. } => {
                for p in props.iter().filter(|p| p.required) {
                    parents[p.node as usize].push(id);
                    waiting[id as usize] += 1;
                }
                if waiting[id as usize] == 0 {
                    settle[1].push(id);
                }
            }
            Node::Array { items, min, .. } if *min > 0 => parents[*items as usize].push(id),
            Node::Choice(alts) => alts.iter().for_each(|&a| parents[a as usize].push(id)),
            // Resolved away: nothing refers to it.
            Node::Alias(_) => {}
            _ => settle[1].push(id),
        }
    }
    for frames in 1..=MAX_FRAMES {
        // A choice settles at its alternative's depth, so this level may grow while it is worked through.
        while let Some(id) = settle[frames].pop() {
            if need[id as usize] != NEVER {
                continue;
            }
            need[id as usize] = frames as u8;
            for &p in &parents[id as usize] {
                let up = match &nodes[p as usize] {
                    Node::Choice(_) => frames,
                    Node::Object { .. } => {
                        waiting[p as usize] -= 1;
                        if waiting[p as usize] > 0 {
                            continue;
                        }
                        // Settled in order, so this last part is the deepest.
                        frames + 1
                    }
                    _ => frames + 1,
                };
                if up <= MAX_FRAMES {
                    settle[up].push(p);
                }
            }
        }
    }
    need
}

const KEYWORDS_IGNORED: [&str; 9] =
    ["title", "description", "$schema", "$id", "$comment", "default", "examples", "strict", "deprecated"];
const KEYWORDS_GUIDED: [&str; 22] = [
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "$ref",
    "$defs",
    "definitions",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
];

/// The numeric bounds, on integers and numbers.
const BOUNDS: [&str; 4] = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"];

struct Compiler<'a> {
    root_value: &'a Value,
    nodes: Vec<Node>,
    paths: Vec<String>,
    defs: HashMap<String, NodeId>,
    any: Option<NodeId>,
    /// Each distinct pattern, compiled once, and the states they keep in all.
    patterns: HashMap<(String, bool), Arc<ByteDfa>>,
    pattern_states: usize,
    /// What the length tables built so far cost ([`LengthTable::work`]).
    length_work: usize,
    /// How many subschemas enclose the one being compiled.
    nesting: usize,
}

fn set_bit(set: &mut [u64; 4], b: u8) {
    set[(b >> 6) as usize] |= 1 << (b & 63);
}

fn has_bit(set: &[u64; 4], b: u8) -> bool {
    set[(b >> 6) as usize] >> (b & 63) & 1 == 1
}

/// The pattern of the decimal numerals of the integers `lo..=hi` as JSON writes them: no leading zeros, and `0`
/// rather than `-0`.
fn integer_range_pattern(lo: i64, hi: i64) -> String {
    let mut alternatives = Vec::new();
    if lo < 0 {
        let magnitudes = digit_ranges(hi.min(-1).unsigned_abs(), lo.unsigned_abs());
        alternatives.push(format!("-({})", magnitudes.join("|")));
    }
    if lo <= 0 && hi >= 0 {
        alternatives.push("0".to_string());
    }
    if hi > 0 {
        alternatives.extend(digit_ranges(lo.max(1) as u64, hi as u64));
    }
    alternatives.join("|")
}

/// Patterns that together match the numerals of `a..=b` (`1 <= a <= b`): the range is cut where the numerals'
/// length changes and where a run of trailing digits fills up, so that each piece is a common prefix, one digit
/// range and then any digits.
fn digit_ranges(a: u64, b: u64) -> Vec<String> {
    let mut stops = vec![b];
    // Ends of runs from `a` up: `a` with its last 1, 2, ... digits set to 9.
    for digits in 1..=18 {
        let p = 10u64.pow(digits);
        let stop = a - a % p + (p - 1);
        if !(a <= stop && stop < b) {
            break;
        }
        stops.push(stop);
    }
    // Ends of runs below `b + 1` with its last 1, 2, ... digits set to 0.
    for digits in 1..=18 {
        let p = 10u64.pow(digits);
        match (b + 1 - (b + 1) % p).checked_sub(1) {
            Some(stop) if a < stop && stop <= b => stops.push(stop),
            _ => break,
        }
    }
    stops.sort_unstable();
    stops.dedup();
    let mut start = a;
    let mut out = Vec::with_capacity(stops.len());
    for stop in stops {
        let (from, to) = (start.to_string(), stop.to_string());
        let mut piece = String::new();
        let mut any = 0;
        for (x, y) in from.bytes().zip(to.bytes()) {
            if x == y {
                piece.push(x as char);
            } else if (x, y) == (b'0', b'9') {
                any += 1;
            } else {
                piece.push_str(&format!("[{}-{}]", x as char, y as char));
            }
        }
        if any > 0 {
            piece.push_str(&format!("[0-9]{{{any}}}"));
        }
        out.push(piece);
        start = stop + 1;
    }
    out
}

/// Which (pattern state, characters so far) pairs of a pattern string with length bounds can still reach a match
/// of an allowed length: the pattern's table times a character counter, walked backwards once at compile time, so
/// that a string guided by both can always be closed. Without `maxLength` the counter stops at `minLength`, past
/// which lengths no longer differ. A schema's tables are built only while what they cost ([`LengthTable::work`])
/// stays under [`MAX_LENGTH_WORK`] in all.
#[derive(Debug, Clone, PartialEq)]
struct LengthTable {
    min: u32,
    max: u32,
    /// The counter's last value.
    cap: u32,
    /// `live[state * (cap + 1) + count]`.
    live: Vec<bool>,
}

/// The most work a schema's [`LengthTable`]s may take to build, in all (and a bound on their size).
const MAX_LENGTH_WORK: usize = 1 << 24;

impl LengthTable {
    /// States × (counts + 1) × (byte classes + 1): a bound on the steps [`LengthTable::build`] takes, which visits
    /// each (state, count) pair and each reversed move once per count, after one pass to reverse the moves
    /// (`None` on overflow).
    fn work(dfa: &ByteDfa, min: u32, max: u32) -> Option<usize> {
        let cap = if max == u32::MAX { min } else { max };
        dfa.states().checked_mul(cap as usize + 2)?.checked_mul(dfa.byte_classes() + 1)
    }

    fn new(dfa: &ByteDfa, min: u32, max: u32) -> LengthTable {
        Self::build(dfa, min, max).0
    }

    /// The table, and the steps building it took (at most [`LengthTable::work`]).
    fn build(dfa: &ByteDfa, min: u32, max: u32) -> (LengthTable, usize) {
        let cap = if max == u32::MAX { min } else { max };
        let width = cap as usize + 1;
        let states = dfa.states();
        let mut table = LengthTable { min, max, cap, live: vec![false; states * width] };
        let mut steps = 0;
        // The moves reversed, split by whether they add a character, so that each count is settled by walking
        // backwards from its live pairs: repeating sweeps until nothing changes would take a sweep per state on a
        // chain such as `a{2000}`, far more than the budget charges.
        let (back_char, back_stay) = {
            let mut char_moves = Vec::new();
            let mut stay_moves = Vec::new();
            for s in 0..states as u32 {
                for (starts, to) in dfa.moves(s) {
                    steps += 1;
                    let moves = if starts { &mut char_moves } else { &mut stay_moves };
                    moves.push((to, s));
                }
            }
            (Reversed::new(states, &char_moves), Reversed::new(states, &stay_moves))
        };
        let unbounded = max == u32::MAX;
        let mut todo: Vec<u32> = Vec::new();
        for count in (0..=cap).rev() {
            let at = |s: u32| s as usize * width + count as usize;
            for s in 0..states as u32 {
                steps += 1;
                if dfa.is_match(s) && table.allows(count) && !table.live[at(s)] {
                    table.live[at(s)] = true;
                    todo.push(s);
                }
                // A character from `from` leads to `s` one count up.
                if count < cap && table.live[s as usize * width + count as usize + 1] {
                    for &from in back_char.entering(s) {
                        steps += 1;
                        if !table.live[at(from)] {
                            table.live[at(from)] = true;
                            todo.push(from);
                        }
                    }
                }
            }
            // Without `maxLength` a character at the cap keeps the counter there, as a continuation byte does.
            let top = unbounded && count == cap;
            while let Some(s) = todo.pop() {
                let char_moves = if top { back_char.entering(s) } else { &[] };
                for &from in back_stay.entering(s).iter().chain(char_moves) {
                    steps += 1;
                    if !table.live[at(from)] {
                        table.live[at(from)] = true;
                        todo.push(from);
                    }
                }
            }
        }
        (table, steps)
    }

    /// Whether a string of `len` characters is within the bounds.
    fn allows(&self, len: u32) -> bool {
        self.min <= len && len <= self.max
    }

    /// Whether a string at `state` with `len` characters so far can still end on a match of an allowed length.
    fn live(&self, state: RegexState, len: u32) -> bool {
        let count = if self.max == u32::MAX { len.min(self.cap) } else { len };
        count <= self.cap && self.live.get(state as usize * (self.cap as usize + 1) + count as usize) == Some(&true)
    }
}

/// A pattern's moves reversed: the states each state is entered from.
struct Reversed {
    /// `from[starts[s]..starts[s + 1]]`: the states with a move into `s`.
    starts: Vec<usize>,
    from: Vec<u32>,
}

impl Reversed {
    /// From `(to, from)` moves, placed by a counting sort (linear, as the budget charges).
    fn new(states: usize, moves: &[(u32, u32)]) -> Reversed {
        let mut starts = vec![0; states + 1];
        for &(to, _) in moves {
            starts[to as usize + 1] += 1;
        }
        for s in 0..states {
            starts[s + 1] += starts[s];
        }
        let mut next = starts.clone();
        let mut from = vec![0; moves.len()];
        for &(to, f) in moves {
            from[next[to as usize]] = f;
            next[to as usize] += 1;
        }
        Reversed { starts, from }
    }

    fn entering(&self, s: u32) -> &[u32] {
        &self.from[self.starts[s as usize]..self.starts[s as usize + 1]]
    }
}

/// A decimal bound as written: its sign, integer part and fraction digits (ASCII, no trailing zeros). Zero is not
/// negative.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Decimal {
    negative: bool,
    int: u64,
    frac: Vec<u8>,
}

/// Most fraction digits a number's bound may have.
pub const BOUND_FRACTION_DIGITS: usize = 12;

impl Decimal {
    /// `x` as its shortest decimal (Rust's `Display` for `f64`, which never uses an exponent), or `None` beyond
    /// ±1e15 or [`BOUND_FRACTION_DIGITS`].
    fn of(x: f64) -> Option<Decimal> {
        if !x.is_finite() || x.abs() >= 1e15 {
            return None;
        }
        let text = format!("{}", x.abs());
        let (int, frac) = text.split_once('.').unwrap_or((&text, ""));
        let frac = frac.trim_end_matches('0').as_bytes().to_vec();
        let int: u64 = int.parse().ok()?;
        let negative = x < 0.0 && (int > 0 || !frac.is_empty());
        (frac.len() <= BOUND_FRACTION_DIGITS).then_some(Decimal { negative, int, frac })
    }

    fn whole(n: i64) -> Decimal {
        Decimal { negative: n < 0, int: n.unsigned_abs(), frac: Vec::new() }
    }

    fn zero() -> Decimal {
        Decimal::whole(0)
    }

    fn negated(&self) -> Decimal {
        let zero = self.int == 0 && self.frac.is_empty();
        Decimal { negative: !self.negative && !zero, ..self.clone() }
    }

    /// Compares magnitudes.
    fn cmp_magnitude(&self, other: &Decimal) -> std::cmp::Ordering {
        let n = self.frac.len().max(other.frac.len());
        let digit = |d: &Decimal, i: usize| d.frac.get(i).copied().unwrap_or(b'0');
        self.int.cmp(&other.int).then_with(|| {
            (0..n)
                .map(|i| digit(self, i).cmp(&digit(other, i)))
                .fold(std::cmp::Ordering::Equal, std::cmp::Ordering::then)
        })
    }
}

/// One end of a number's range, and whether the end itself is excluded.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Bound {
    at: Decimal,
    strict: bool,
}

/// Digits a bounded number's fraction may have.
const FRACTION_DIGITS: usize = 15;

/// The pattern of the plain decimals (`12`, `-0.5`; no exponent) between `lo` and `hi`, or `None` when none is.
/// Negative numbers are the non-negative pattern of their magnitudes behind a `-`, which is never `-0`.
fn number_range_pattern(lo: &Bound, hi: &Bound) -> Option<String> {
    let mut alternatives = Vec::new();
    if !hi.at.negative {
        let low = if lo.at.negative { Bound { at: Decimal::zero(), strict: false } } else { lo.clone() };
        alternatives.extend(magnitude_range_pattern(&low, hi));
    }
    if lo.at.negative {
        // x in [lo, hi] with x < 0 is -y with y in [max(-hi, 0), -lo], both ends swapped, and y > 0.
        let low = if hi.at.negative {
            Bound { at: hi.at.negated(), strict: hi.strict }
        } else {
            Bound { at: Decimal::zero(), strict: true }
        };
        let high = Bound { at: lo.at.negated(), strict: lo.strict };
        if let Some(negative) = magnitude_range_pattern(&low, &high) {
            alternatives.push(format!("-({negative})"));
        }
    }
    (!alternatives.is_empty()).then(|| alternatives.join("|"))
}

/// The pattern of the non-negative plain decimals between two non-negative bounds, by integer part: strictly
/// between the bounds' integer parts any fraction fits; at the lower one, fractions at or above its fraction; at
/// the upper one, fractions at or below its fraction.
fn magnitude_range_pattern(low: &Bound, high: &Bound) -> Option<String> {
    use std::cmp::Ordering;
    match low.at.cmp_magnitude(&high.at) {
        Ordering::Greater => return None,
        Ordering::Equal if low.strict || high.strict => return None,
        _ => {}
    }
    let n = FRACTION_DIGITS;
    let mut pieces = Vec::new();
    let mut piece = |int: String, fraction: Fraction| {
        if let Some(p) = fraction.pattern(&int) {
            pieces.push(p);
        }
    };
    if low.at.int == high.at.int {
        piece(low.at.int.to_string(), Fraction::between(&low.at.frac, low.strict, &high.at.frac, high.strict, n));
    } else {
        piece(low.at.int.to_string(), Fraction::at_least(&low.at.frac, low.strict, n));
        if low.at.int + 1 < high.at.int {
            let ints = integer_range_pattern(low.at.int as i64 + 1, high.at.int as i64 - 1);
            piece(format!("({ints})"), Fraction::at_least(&[], false, n));
        }
        piece(high.at.int.to_string(), Fraction::at_most(&high.at.frac, high.strict, n));
    }
    (!pieces.is_empty()).then(|| pieces.join("|"))
}

/// The fractions an integer part may take: whether it may have none (a fraction of 0), and the pattern of the
/// digits after its point (at least one), if any fit.
struct Fraction {
    none: bool,
    digits: Option<String>,
}

impl Fraction {
    /// After `int`: the pattern of the number, or `None` when no fraction fits.
    fn pattern(&self, int: &str) -> Option<String> {
        match (&self.digits, self.none) {
            (Some(d), true) => Some(format!(r"{int}(\.{d})?")),
            (Some(d), false) => Some(format!(r"{int}\.{d}")),
            (None, true) => Some(int.to_string()),
            (None, false) => None,
        }
    }

    /// Fractions `0.f >= 0.d` (`>` when `strict`), of at most `n` digits.
    fn at_least(d: &[u8], strict: bool, n: usize) -> Fraction {
        let zero = d.iter().all(|&c| c == b'0');
        Fraction { none: zero && !strict, digits: compare_digits(d, true, strict, 1, n) }
    }

    /// Fractions `0.f <= 0.d` (`<` when `strict`).
    fn at_most(d: &[u8], strict: bool, n: usize) -> Fraction {
        let zero = d.iter().all(|&c| c == b'0');
        Fraction { none: !(zero && strict), digits: compare_digits(d, false, strict, 1, n) }
    }

    /// Fractions between `0.lo` and `0.hi` (`lo <= hi`), each end excluded when strict.
    fn between(lo: &[u8], lo_strict: bool, hi: &[u8], hi_strict: bool, n: usize) -> Fraction {
        let zero = |d: &[u8]| d.iter().all(|&c| c == b'0');
        Fraction {
            none: zero(lo) && !lo_strict && !(zero(hi) && hi_strict),
            digits: between_digits(lo, lo_strict, hi, hi_strict, 1, n),
        }
    }
}

/// The pattern of digit strings `r` of `min..=max` digits (`min` 0 or 1; the empty string reads as 0) with `0.r`
/// at least `0.d` (`ge`) or at most it, excluding equality when `strict`; `None` when none is.
fn compare_digits(d: &[u8], ge: bool, strict: bool, min: usize, max: usize) -> Option<String> {
    if d.iter().all(|&c| c == b'0') {
        return match (ge, strict) {
            (true, false) => Some(format!("[0-9]{{{min},{max}}}")),
            (true, true) if max > 0 => Some(format!("0{{0,{}}}[1-9][0-9]{{0,{}}}", max - 1, max - 1)),
            (false, false) => Some(format!("0{{{min},{max}}}")),
            _ => None,
        };
    }
    let mut alternatives = Vec::new();
    // The empty string is 0, below a `d` that is not.
    if !ge && min == 0 {
        alternatives.push(String::new());
    }
    if max > 0 {
        let (c, rest) = (d[0], &d[1..]);
        if ge && c < b'9' {
            alternatives.push(format!("[{}-9][0-9]{{0,{}}}", (c + 1) as char, max - 1));
        }
        if !ge && c > b'0' {
            alternatives.push(format!("[0-{}][0-9]{{0,{}}}", (c - 1) as char, max - 1));
        }
        if let Some(tail) = compare_digits(rest, ge, strict, 0, max - 1) {
            alternatives.push(format!("{}(?:{tail})", c as char));
        }
    }
    (!alternatives.is_empty()).then(|| format!("(?:{})", alternatives.join("|")))
}

/// [`compare_digits`] for `0.lo <= 0.r <= 0.hi` (`lo <= hi`), an end excluded when its flag says so.
fn between_digits(lo: &[u8], lo_strict: bool, hi: &[u8], hi_strict: bool, min: usize, max: usize) -> Option<String> {
    let zero = |d: &[u8]| d.iter().all(|&c| c == b'0');
    if zero(lo) && !lo_strict {
        return compare_digits(hi, false, hi_strict, min, max);
    }
    let mut alternatives = Vec::new();
    // The empty string is 0, which fits only a lower end of 0 that is not excluded: handled above.
    if max > 0 {
        let first = |d: &[u8]| d.first().copied().unwrap_or(b'0');
        let rest = |d: &[u8]| d.get(1..).unwrap_or_default().to_vec();
        let (a, b) = (first(lo), first(hi));
        if a == b {
            if let Some(tail) = between_digits(&rest(lo), lo_strict, &rest(hi), hi_strict, 0, max - 1) {
                alternatives.push(format!("{}(?:{tail})", a as char));
            }
        } else {
            if let Some(tail) = compare_digits(&rest(lo), true, lo_strict, 0, max - 1) {
                alternatives.push(format!("{}(?:{tail})", a as char));
            }
            if a + 1 < b {
                alternatives.push(format!("[{}-{}][0-9]{{0,{}}}", (a + 1) as char, (b - 1) as char, max - 1));
            }
            if let Some(tail) = compare_digits(&rest(hi), false, hi_strict, 0, max - 1) {
                alternatives.push(format!("{}(?:{tail})", b as char));
            }
        }
    }
    (!alternatives.is_empty()).then(|| format!("(?:{})", alternatives.join("|")))
}

fn escape_pointer(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

fn unescape_pointer(s: &str) -> String {
    s.replace("~1", "/").replace("~0", "~")
}

impl Compiler<'_> {
    fn push(&mut self, node: Node, path: &str) -> Result<NodeId, SchemaError> {
        if self.nodes.len() >= MAX_NODES {
            return err(path, format!("the schema needs more than {MAX_NODES} nodes"));
        }
        self.nodes.push(node);
        self.paths.push(path.to_string());
        Ok((self.nodes.len() - 1) as NodeId)
    }

    /// Any JSON value (the schema `{}` or `true`), built once and shared.
    fn any(&mut self, path: &str) -> Result<NodeId, SchemaError> {
        if let Some(id) = self.any {
            return Ok(id);
        }
        let any = self.push(Node::Choice(Vec::new()), path)?;
        self.any = Some(any);
        let alts = vec![
            self.push(Node::Object { props: Vec::new(), sorted: Vec::new(), map: Some(any) }, path)?,
            self.push(Node::Array { items: any, min: 0, max: u32::MAX }, path)?,
            self.push(Node::Str { min: 0, max: u32::MAX, pattern: None, lengths: None }, path)?,
            self.push(Node::Number, path)?,
            self.push(Node::Literals(vec![b"false".to_vec(), b"null".to_vec(), b"true".to_vec()]), path)?,
        ];
        self.nodes[any as usize] = Node::Choice(alts);
        Ok(any)
    }

    fn reference(&mut self, r: &str, path: &str) -> Result<NodeId, SchemaError> {
        if let Some(&id) = self.defs.get(r) {
            return Ok(id);
        }
        let target = if r == "#" {
            self.root_value
        } else {
            let Some((section, name)) = r
                .strip_prefix("#/$defs/")
                .map(|n| ("$defs", n))
                .or(r.strip_prefix("#/definitions/").map(|n| ("definitions", n)))
            else {
                return err(
                    path,
                    format!("`$ref` {r:?} is not supported: only \"#\", \"#/$defs/NAME\" and \"#/definitions/NAME\""),
                );
            };
            match self.root_value.get(section).and_then(|d| d.get(unescape_pointer(name))) {
                Some(v) => v,
                None => return err(path, format!("`$ref` {r:?} names no definition")),
            }
        };
        let def_path = if r == "#" { String::new() } else { r.trim_start_matches('#').to_string() };
        let id = self.push(Node::Alias(0), &def_path)?;
        self.defs.insert(r.to_string(), id);
        let body = self.compile(target, &def_path)?;
        self.nodes[id as usize] = Node::Alias(body);
        Ok(id)
    }

    fn compile(&mut self, v: &Value, path: &str) -> Result<NodeId, SchemaError> {
        // Each level recurses through a few frames, and a chain of `$ref`s is bounded by nothing else but
        // MAX_NODES, which allows some thousand levels: too deep for the stack of a blocking thread.
        if self.nesting >= MAX_SCHEMA_NESTING {
            return err(path, format!("subschemas nest more than {MAX_SCHEMA_NESTING} deep"));
        }
        self.nesting += 1;
        let id = self.compile_nested(v, path);
        self.nesting -= 1;
        id
    }

    fn compile_nested(&mut self, v: &Value, path: &str) -> Result<NodeId, SchemaError> {
        let obj = match v {
            Value::Bool(true) => return self.any(path),
            Value::Bool(false) => return err(path, "the schema `false` accepts no value"),
            Value::Object(o) => o,
            _ => return err(path, "a schema must be an object or a boolean"),
        };
        for key in obj.keys() {
            if !KEYWORDS_GUIDED.contains(&key.as_str()) && !KEYWORDS_IGNORED.contains(&key.as_str()) {
                return err(path, format!("the keyword `{key}` is not supported"));
            }
        }
        if let Some(r) = obj.get("$ref") {
            let Some(r) = r.as_str() else { return err(path, "`$ref` must be a string") };
            if let Some(k) = obj.keys().find(|k| {
                KEYWORDS_GUIDED.contains(&k.as_str()) && !matches!(k.as_str(), "$ref" | "$defs" | "definitions")
            }) {
                return err(path, format!("`$ref` beside `{k}` is not supported"));
            }
            return self.reference(r, path);
        }
        if let Some(c) = obj.get("const") {
            return self.literals(std::slice::from_ref(c), path);
        }
        if let Some(e) = obj.get("enum") {
            let Some(values) = e.as_array() else { return err(&format!("{path}/enum"), "`enum` must be an array") };
            return self.literals(values, &format!("{path}/enum"));
        }
        let alternatives = match (obj.get("anyOf"), obj.get("oneOf")) {
            (Some(_), Some(_)) => return err(path, "`anyOf` beside `oneOf` is not supported"),
            (Some(a), None) => Some(("anyOf", a)),
            (None, Some(a)) => Some(("oneOf", a)),
            (None, None) => None,
        };
        if let Some((word, alts)) = alternatives {
            if obj.contains_key("type") {
                return err(path, format!("`{word}` beside `type` is not supported"));
            }
            let Some(alts) = alts.as_array().filter(|a| !a.is_empty() && a.len() <= MAX_ALTERNATIVES) else {
                return err(
                    &format!("{path}/{word}"),
                    format!("`{word}` must be an array of 1 to {MAX_ALTERNATIVES} schemas"),
                );
            };
            let mut ids = Vec::with_capacity(alts.len());
            for (i, a) in alts.iter().enumerate() {
                ids.push(self.compile(a, &format!("{path}/{word}/{i}"))?);
            }
            return self.push(Node::Choice(ids), &format!("{path}/{word}"));
        }
        let types: Vec<&str> = match obj.get("type") {
            None => {
                // An untyped schema is what its keywords imply, or any value.
                if obj.contains_key("properties") || obj.contains_key("additionalProperties") {
                    vec!["object"]
                } else if obj.contains_key("items") {
                    vec!["array"]
                } else if ["minLength", "maxLength", "pattern", "format"].iter().any(|k| obj.contains_key(*k)) {
                    vec!["string"]
                } else if BOUNDS.iter().any(|k| obj.contains_key(*k)) {
                    vec!["number"]
                } else {
                    return self.any(path);
                }
            }
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) if !ts.is_empty() => {
                let mut out = Vec::with_capacity(ts.len());
                for t in ts {
                    match t.as_str() {
                        Some(t) if !out.contains(&t) => out.push(t),
                        _ => return err(&format!("{path}/type"), "`type` must list distinct type names"),
                    }
                }
                out
            }
            Some(_) => return err(&format!("{path}/type"), "`type` must be a type name or an array of them"),
        };
        let mut ids = Vec::with_capacity(types.len());
        for t in types {
            ids.push(self.typed(obj, t, path)?);
        }
        if ids.len() == 1 { Ok(ids[0]) } else { self.push(Node::Choice(ids), &format!("{path}/type")) }
    }

    fn literals(&mut self, values: &[Value], path: &str) -> Result<NodeId, SchemaError> {
        if values.is_empty() || values.len() > MAX_ENUM_VALUES {
            return err(path, format!("`enum` must list 1 to {MAX_ENUM_VALUES} values"));
        }
        let mut lits = Vec::with_capacity(values.len());
        for v in values {
            match serde_json::to_vec(v) {
                Ok(b) => lits.push(b),
                Err(e) => return err(path, format!("a value cannot be serialised: {e}")),
            }
        }
        lits.sort();
        lits.dedup();
        self.push(Node::Literals(lits), path)
    }

    fn count(obj: &serde_json::Map<String, Value>, key: &str, path: &str) -> Result<Option<u32>, SchemaError> {
        match obj.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                // A lower bound past any answer's length would leave the model writing until its budget ends.
                Some(n) if key.starts_with("min") && n > u64::from(MAX_MIN_COUNT) => {
                    err(&format!("{path}/{key}"), format!("`{key}` is {n}, more than {MAX_MIN_COUNT}"))
                }
                // An upper bound past u32::MAX bounds nothing a guide can reach.
                Some(n) => Ok(Some(n.min(u64::from(u32::MAX)) as u32)),
                None => err(&format!("{path}/{key}"), format!("`{key}` must be a non-negative integer")),
            },
        }
    }

    /// An integer's bounds as the inclusive range of values they leave, an open end at [`OPEN_INTEGER_BOUND`], or
    /// `None` when it has none.
    fn integer_range(obj: &serde_json::Map<String, Value>, path: &str) -> Result<Option<(i64, i64)>, SchemaError> {
        let bound = |k: &str| match obj.get(k) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x.abs() < 1e15 => Ok(Some(x)),
                _ => err(&format!("{path}/{k}"), format!("`{k}` must be a number within ±1e15")),
            },
        };
        let (min, exclusive_min) = (bound("minimum")?, bound("exclusiveMinimum")?);
        let (max, exclusive_max) = (bound("maximum")?, bound("exclusiveMaximum")?);
        if [min, exclusive_min, max, exclusive_max].iter().all(Option::is_none) {
            return Ok(None);
        }
        let lo =
            min.map_or(i64::MIN, |m| m.ceil() as i64).max(exclusive_min.map_or(i64::MIN, |m| m.floor() as i64 + 1));
        let hi =
            max.map_or(i64::MAX, |m| m.floor() as i64).min(exclusive_max.map_or(i64::MAX, |m| m.ceil() as i64 - 1));
        let (lo, hi) = (lo.max(-OPEN_INTEGER_BOUND), hi.min(OPEN_INTEGER_BOUND));
        if lo > hi {
            return err(path, "the bounds leave no integer");
        }
        Ok(Some((lo, hi)))
    }

    /// A number's bounds, each a decimal of at most [`BOUND_FRACTION_DIGITS`] fraction digits and whether it is
    /// exclusive, an open end at [`OPEN_INTEGER_BOUND`], or `None` when it has none. A bounded number is written as
    /// a plain decimal.
    fn number_bounds(obj: &serde_json::Map<String, Value>, path: &str) -> Result<Option<(Bound, Bound)>, SchemaError> {
        let bound = |k: &str| match obj.get(k) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if Decimal::of(x).is_some() => Ok(Some(x)),
                _ => err(
                    &format!("{path}/{k}"),
                    format!("`{k}` must be a number within ±1e15 with at most {BOUND_FRACTION_DIGITS} decimals"),
                ),
            },
        };
        // Both forms of one end: the tighter one.
        let pick = |inclusive: Option<f64>, exclusive: Option<f64>, lower: bool| -> Option<Bound> {
            let (at, strict) = match (inclusive, exclusive) {
                (None, None) => return None,
                (Some(i), None) => (i, false),
                (None, Some(e)) => (e, true),
                (Some(i), Some(e)) if (lower && e >= i) || (!lower && e <= i) => (e, true),
                (Some(i), Some(_)) => (i, false),
            };
            Decimal::of(at).map(|at| Bound { at, strict })
        };
        let lo = pick(bound("minimum")?, bound("exclusiveMinimum")?, true);
        let hi = pick(bound("maximum")?, bound("exclusiveMaximum")?, false);
        if lo.is_none() && hi.is_none() {
            return Ok(None);
        }
        let open = |n| Bound { at: Decimal::whole(n), strict: false };
        Ok(Some((lo.unwrap_or_else(|| open(-OPEN_INTEGER_BOUND)), hi.unwrap_or_else(|| open(OPEN_INTEGER_BOUND)))))
    }

    fn typed(&mut self, obj: &serde_json::Map<String, Value>, t: &str, path: &str) -> Result<NodeId, SchemaError> {
        match t {
            "object" => self.object(obj, path),
            "array" => {
                let items = match obj.get("items") {
                    None => self.any(path)?,
                    Some(items) => self.compile(items, &format!("{path}/items"))?,
                };
                let min = Self::count(obj, "minItems", path)?.unwrap_or(0);
                let max = Self::count(obj, "maxItems", path)?.unwrap_or(u32::MAX);
                if min > max {
                    return err(path, "`minItems` is more than `maxItems`");
                }
                self.push(Node::Array { items, min, max }, path)
            }
            "string" => {
                let min = Self::count(obj, "minLength", path)?.unwrap_or(0);
                let max = Self::count(obj, "maxLength", path)?.unwrap_or(u32::MAX);
                if min > max {
                    return err(path, "`minLength` is more than `maxLength`");
                }
                let pattern = self.string_pattern(obj, path)?;
                let lengths = match &pattern {
                    Some(dfa) if min > 0 || max < u32::MAX => {
                        let work = LengthTable::work(dfa, min, max).map(|w| w.saturating_add(self.length_work));
                        let Some(table) = work.filter(|&w| w <= MAX_LENGTH_WORK).map(|w| {
                            self.length_work = w;
                            LengthTable::new(dfa, min, max)
                        }) else {
                            return err(
                                path,
                                "`minLength`/`maxLength` beside `pattern` or `format` make too large an automaton; \
                                 write the length into the pattern, as in `[a-z]{2,8}`",
                            );
                        };
                        if !table.live(dfa.start(), 0) {
                            return err(path, "no string of the pattern has a length within `minLength`/`maxLength`");
                        }
                        Some(Arc::new(table))
                    }
                    _ => None,
                };
                self.push(Node::Str { min, max, pattern, lengths }, path)
            }
            "number" => match Self::number_bounds(obj, path)? {
                None => self.push(Node::Number, path),
                Some((lo, hi)) => match number_range_pattern(&lo, &hi) {
                    Some(pattern) => {
                        let dfa = self.pattern(&pattern, false, path)?;
                        self.push(Node::Bare(dfa), path)
                    }
                    None => err(path, "the bounds leave no number"),
                },
            },
            "integer" => {
                // Without bounds, the range an open end leaves: 15 digits, so that every client reads the value
                // exactly (JavaScript's doubles hold integers to 2^53), as with one open end.
                let (lo, hi) = Self::integer_range(obj, path)?.unwrap_or((-OPEN_INTEGER_BOUND, OPEN_INTEGER_BOUND));
                let dfa = self.pattern(&integer_range_pattern(lo, hi), false, path)?;
                self.push(Node::Bare(dfa), path)
            }
            "boolean" => self.push(Node::Literals(vec![b"false".to_vec(), b"true".to_vec()]), path),
            "null" => self.push(Node::Literals(vec![b"null".to_vec()]), path),
            other => err(&format!("{path}/type"), format!("unknown type `{other}`")),
        }
    }

    /// A string's `pattern`, or the pattern of its `format`, compiled once per schema.
    fn string_pattern(
        &mut self,
        obj: &serde_json::Map<String, Value>,
        path: &str,
    ) -> Result<Option<Arc<ByteDfa>>, SchemaError> {
        let (pattern, at) = match (obj.get("pattern"), obj.get("format")) {
            (None, None) => return Ok(None),
            (Some(_), Some(_)) => return err(path, "`pattern` beside `format` is not supported"),
            (Some(Value::String(p)), None) => (p.as_str(), format!("{path}/pattern")),
            (None, Some(Value::String(f))) => match FORMATS.iter().find(|(name, _)| name == f) {
                Some((_, p)) => (*p, format!("{path}/format")),
                None => {
                    let names: Vec<&str> = FORMATS.iter().map(|(n, _)| *n).collect();
                    return err(
                        &format!("{path}/format"),
                        format!("the format `{f}` is not supported; the guided ones are {}", names.join(", ")),
                    );
                }
            },
            (Some(_), None) => return err(&format!("{path}/pattern"), "`pattern` must be a string"),
            (None, Some(_)) => return err(&format!("{path}/format"), "`format` must be a string"),
        };
        self.pattern(pattern, true, &at).map(Some)
    }

    /// `pattern`, compiled once per schema for the inside of a JSON string or for a bare value.
    fn pattern(&mut self, pattern: &str, json_string: bool, path: &str) -> Result<Arc<ByteDfa>, SchemaError> {
        let key = (pattern.to_string(), json_string);
        if let Some(dfa) = self.patterns.get(&key) {
            return Ok(dfa.clone());
        }
        let compiled = if json_string { ByteDfa::compile_json_string(pattern) } else { ByteDfa::compile(pattern) };
        let dfa = match compiled {
            Ok(dfa) => Arc::new(dfa),
            Err(e) => return err(path, e.0),
        };
        self.pattern_states += dfa.states();
        if self.pattern_states > MAX_PATTERN_STATES {
            return err(
                path,
                format!("the schema's patterns need more than {MAX_PATTERN_STATES} automaton states in all"),
            );
        }
        self.patterns.insert(key, dfa.clone());
        Ok(dfa)
    }

    fn object(&mut self, obj: &serde_json::Map<String, Value>, path: &str) -> Result<NodeId, SchemaError> {
        let empty = serde_json::Map::new();
        let declared = match obj.get("properties") {
            None => &empty,
            Some(Value::Object(p)) => p,
            Some(_) => return err(&format!("{path}/properties"), "`properties` must be an object"),
        };
        if declared.len() > MAX_PROPERTIES {
            return err(&format!("{path}/properties"), format!("more than {MAX_PROPERTIES} properties"));
        }
        let mut required: Vec<&str> = Vec::new();
        match obj.get("required") {
            None => {}
            Some(Value::Array(r)) => {
                for name in r {
                    match name.as_str() {
                        Some(n) if declared.contains_key(n) => required.push(n),
                        Some(n) => {
                            return err(
                                &format!("{path}/required"),
                                format!("`{n}` is required but not among `properties`"),
                            );
                        }
                        None => return err(&format!("{path}/required"), "`required` must list property names"),
                    }
                }
            }
            Some(_) => return err(&format!("{path}/required"), "`required` must be an array"),
        }
        let map = if declared.is_empty() {
            match obj.get("additionalProperties") {
                Some(Value::Bool(false)) => None,
                None | Some(Value::Bool(true)) => Some(self.any(path)?),
                Some(s) => Some(self.compile(s, &format!("{path}/additionalProperties"))?),
            }
        } else {
            None
        };
        let mut props = Vec::with_capacity(declared.len());
        for (name, schema) in declared {
            let node = self.compile(schema, &format!("{path}/properties/{}", escape_pointer(name)))?;
            let mut key = match serde_json::to_vec(&Value::String(name.clone())) {
                Ok(k) => k,
                Err(e) => return err(path, format!("a property name cannot be serialised: {e}")),
            };
            key.remove(0);
            if key.len() > MAX_PROPERTY_NAME_BYTES {
                return err(
                    &format!("{path}/properties"),
                    format!("a property name is {} bytes, more than {MAX_PROPERTY_NAME_BYTES}", key.len()),
                );
            }
            props.push(Prop { key, node, required: required.contains(&name.as_str()) });
        }
        let mut sorted: Vec<u8> = (0..props.len() as u8).collect();
        sorted.sort_by(|&a, &b| props[a as usize].key.cmp(&props[b as usize].key));
        self.push(Node::Object { props, sorted, map }, path)
    }
}

impl JsonSchema {
    /// Parses and compiles a schema sent as JSON text of at most [`MAX_SCHEMA_BYTES`].
    pub fn parse(text: &str) -> Result<JsonSchema, SchemaError> {
        if text.len() > MAX_SCHEMA_BYTES {
            return err("#", format!("the schema is {} bytes, more than {MAX_SCHEMA_BYTES}", text.len()));
        }
        match serde_json::from_str::<Value>(text) {
            Ok(v) => JsonSchema::compile(&v),
            Err(e) => err("#", format!("the schema is not valid JSON: {e}")),
        }
    }

    /// Compiles `schema`; its root must describe an object, as OpenAI's structured outputs require.
    pub fn compile(schema: &Value) -> Result<JsonSchema, SchemaError> {
        let mut c = Compiler {
            root_value: schema,
            nodes: Vec::new(),
            paths: Vec::new(),
            defs: HashMap::new(),
            any: None,
            patterns: HashMap::new(),
            pattern_states: 0,
            length_work: 0,
            nesting: 0,
        };
        // The root is reachable as "#" too.
        let root = c.reference("#", "")?;
        let Compiler { mut nodes, paths, .. } = c;
        // Resolve aliases, refusing cycles of bare references.
        let mut resolved: Vec<NodeId> = (0..nodes.len() as NodeId).collect();
        for target in resolved.iter_mut() {
            let mut at = *target;
            let mut hops = 0;
            while let Node::Alias(next) = nodes[at as usize] {
                at = next;
                hops += 1;
                if hops > nodes.len() {
                    // `at` is on the cycle by now.
                    return err(&paths[at as usize], "`$ref` refers to itself without a value between");
                }
            }
            *target = at;
        }
        let r = |id: &mut NodeId| *id = resolved[*id as usize];
        for node in nodes.iter_mut() {
            match node {
                Node::Object { props, map, .. } => {
                    props.iter_mut().for_each(|p| r(&mut p.node));
                    if let Some(m) = map {
                        r(m);
                    }
                }
                Node::Array { items, .. } => r(items),
                Node::Choice(alts) => alts.iter_mut().for_each(r),
                _ => {}
            }
        }
        let root = resolved[root as usize];
        // First bytes, to a fixed point (choices may refer to each other through references).
        let mut first = vec![[0u64; 4]; nodes.len()];
        loop {
            let mut changed = false;
            for id in 0..nodes.len() {
                let mut set = first[id];
                match &nodes[id] {
                    Node::Object { .. } => set_bit(&mut set, b'{'),
                    Node::Array { .. } => set_bit(&mut set, b'['),
                    Node::Str { .. } => set_bit(&mut set, b'"'),
                    Node::Number => {
                        for b in b"-0123456789" {
                            set_bit(&mut set, *b);
                        }
                    }
                    Node::Literals(lits) => lits.iter().filter_map(|l| l.first()).for_each(|&b| set_bit(&mut set, b)),
                    Node::Bare(dfa) => {
                        (0..=255u8).filter(|&b| dfa.step(dfa.start(), b).is_some()).for_each(|b| set_bit(&mut set, b))
                    }
                    Node::Choice(alts) => {
                        for &a in alts {
                            for (s, f) in set.iter_mut().zip(first[a as usize]) {
                                *s |= f;
                            }
                        }
                    }
                    Node::Alias(_) => {}
                }
                if set != first[id] {
                    first[id] = set;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        for (id, node) in nodes.iter().enumerate() {
            if let Node::Choice(alts) = node {
                for (i, &a) in alts.iter().enumerate() {
                    for &b in &alts[i + 1..] {
                        if first[a as usize].iter().zip(&first[b as usize]).any(|(x, y)| x & y != 0) {
                            return err(
                                &paths[id],
                                "alternatives that can start with the same character are not supported (each must \
                                 be a different kind of value: object, array, string, number, or literals that \
                                 start differently)",
                            );
                        }
                    }
                }
            }
        }
        if !matches!(nodes[root as usize], Node::Object { .. }) {
            return err("#", "the root schema must be an object (`\"type\": \"object\"`)");
        }
        let need = frames_needed(&nodes);
        if need[root as usize] == NEVER {
            return err(
                "#",
                format!(
                    "no document of the schema nests at most {MAX_FRAMES} deep: required properties or `minItems` \
                     recur without end, or too deep"
                ),
            );
        }
        Ok(JsonSchema { nodes, root, first, need })
    }

    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }
}

/// Where one open value stands. `next`: the first declared property still to come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Before the value's first byte.
    Start,
    /// After `{`: a key, or `}`.
    ObjOpen { next: u8 },
    /// After `,` in an object: a key.
    ObjComma { next: u8 },
    /// Inside a declared key, after its opening quote: the sorted keys `lo..hi` still match the first `pos` bytes.
    ObjKey { next: u8, lo: u8, hi: u8, pos: u16 },
    /// Inside a map's key.
    MapKey { esc: bool, hex: u8 },
    /// After a key: `:`. `prop` is the declared property, or [`MAP_PROP`].
    ObjColon { prop: u8 },
    /// After a property's value: `,` or `}`.
    ObjAfter { next: u8 },
    /// After `[`: an item, or `]`.
    ArrOpen,
    /// After `,` in an array: an item.
    ArrComma { count: u32 },
    /// After an item: `,` or `]`.
    ArrAfter { count: u32 },
    /// Inside a string of `len` characters so far (not counted under a pattern); `re`: where a pattern string's
    /// bytes stand in its pattern.
    Str { len: u32, esc: bool, hex: u8, re: RegexState },
    /// Inside a number of `len` bytes so far.
    Num { n: Num, len: u8 },
    /// Inside a bare value, at `re` in its pattern.
    Bare { re: RegexState },
    /// Inside a literal: the sorted literals `lo..hi` still match the first `pos` bytes.
    Lit { lo: u16, hi: u16, pos: u16 },
}

const MAP_PROP: u8 = u8::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Frame {
    node: NodeId,
    phase: Phase,
}

/// How far a byte prefix of a guided answer has come; see the module docs. Tries of a token copy only the frames
/// in use ([`SchemaState::fits`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaState {
    frames: [Frame; MAX_FRAMES],
    depth: u8,
    ws: u8,
}

impl SchemaState {
    /// The state before the answer's first byte.
    pub fn new(schema: &JsonSchema) -> SchemaState {
        let mut frames = [Frame { node: 0, phase: Phase::Start }; MAX_FRAMES];
        frames[0].node = schema.root;
        SchemaState { frames, depth: 1, ws: 0 }
    }

    /// Whether the answer is complete: nothing but the end of generation may follow.
    pub fn is_done(&self) -> bool {
        self.depth == 0
    }

    /// Inside a string and not in an escape: how many more characters it may take. Plain content of at most
    /// that many characters fits ([`crate::json_guide::TokenTable::plain_chars`]) without being fed.
    pub fn plain_string_room(&self, schema: &JsonSchema) -> Option<u32> {
        let top = self.frames[self.depth.checked_sub(1)? as usize];
        match (top.phase, schema.node(top.node)) {
            (Phase::Str { len, esc: false, hex: 0, .. }, Node::Str { max, pattern: None, .. }) => {
                Some(max.saturating_sub(len))
            }
            (Phase::MapKey { esc: false, hex: 0 }, _) => Some(u32::MAX),
            _ => None,
        }
    }

    /// This state after `bytes`, or `None` when they leave the language (an empty slice is refused, since a token
    /// without text cannot advance an answer).
    pub fn accepts(&self, schema: &JsonSchema, bytes: &[u8]) -> Option<SchemaState> {
        let mut next = self.clone();
        next.feed(schema, bytes).then_some(next)
    }

    /// Whether `bytes` may follow, tried on `trial`, which gets a copy of the frames in use.
    pub fn fits(&self, schema: &JsonSchema, bytes: &[u8], trial: &mut SchemaState) -> bool {
        let d = self.depth as usize;
        trial.frames[..d].copy_from_slice(&self.frames[..d]);
        trial.depth = self.depth;
        trial.ws = self.ws;
        trial.feed(schema, bytes)
    }

    fn feed(&mut self, schema: &JsonSchema, bytes: &[u8]) -> bool {
        !bytes.is_empty() && bytes.iter().all(|&b| self.step(schema, b))
    }

    fn top(&mut self) -> &mut Frame {
        &mut self.frames[self.depth as usize - 1]
    }

    fn whitespace(&mut self) -> bool {
        self.ws += 1;
        self.ws <= MAX_WS_RUN
    }

    /// Whether a value of `node` opened on a new frame now could still end within [`MAX_FRAMES`]: what the guide
    /// offers must be finishable, or the model is left where no byte fits.
    fn room_for(&self, schema: &JsonSchema, node: NodeId) -> bool {
        self.depth as usize + schema.need[node as usize] as usize <= MAX_FRAMES
    }

    /// Whether a declared key may start after `next`: one that may come and whose value fits. A required one
    /// always fits, since the object was opened only where its required values do.
    fn key_ahead(&self, schema: &JsonSchema, props: &[Prop], next: u8) -> bool {
        for p in &props[(next as usize).min(props.len())..] {
            if self.room_for(schema, p.node) {
                return true;
            }
            if p.required {
                return false;
            }
        }
        false
    }

    /// Opens a child value of `node` and feeds it `b`.
    fn push(&mut self, schema: &JsonSchema, node: NodeId, b: Option<u8>) -> bool {
        if !self.room_for(schema, node) {
            return false;
        }
        self.frames[self.depth as usize] = Frame { node, phase: Phase::Start };
        self.depth += 1;
        b.is_none_or(|b| self.step(schema, b))
    }

    /// The open value is complete.
    fn pop(&mut self) -> bool {
        self.depth -= 1;
        true
    }

    fn step(&mut self, schema: &JsonSchema, b: u8) -> bool {
        if self.depth == 0 {
            return false;
        }
        let Frame { node: id, phase } = *self.top();
        let node = schema.node(id);
        let structural = !matches!(
            phase,
            Phase::Str { .. }
                | Phase::MapKey { .. }
                | Phase::ObjKey { .. }
                | Phase::Lit { .. }
                | Phase::Num { .. }
                | Phase::Bare { .. }
        );
        if structural {
            if is_ws(b) {
                return self.whitespace();
            }
            self.ws = 0;
        }
        match (phase, node) {
            (Phase::Start, Node::Choice(alts)) => match alts.iter().find(|&&a| has_bit(&schema.first[a as usize], b)) {
                // This frame is open already: the alternative must fit in it and those above.
                Some(&alt) if self.depth as usize - 1 + schema.need[alt as usize] as usize <= MAX_FRAMES => {
                    self.top().node = alt;
                    self.step(schema, b)
                }
                _ => false,
            },
            (Phase::Start, Node::Object { .. }) => self.set_if(b == b'{', Phase::ObjOpen { next: 0 }),
            (Phase::Start, Node::Array { .. }) => self.set_if(b == b'[', Phase::ArrOpen),
            (Phase::Start, Node::Str { pattern, .. }) => {
                let re = pattern.as_ref().map_or(0, |dfa| dfa.start());
                self.set_if(b == b'"', Phase::Str { len: 0, esc: false, hex: 0, re })
            }
            // A pattern string has no escapes: its bytes are the string, fed to the pattern, and its closing quote
            // comes on a match.
            (Phase::Str { re, len, .. }, Node::Str { pattern: Some(dfa), lengths, .. }) => match b {
                b'"' => dfa.is_match(re) && lengths.as_ref().is_none_or(|l| l.allows(len)) && self.pop(),
                _ => match dfa.step(re, b) {
                    Some(re) => {
                        let len = len.saturating_add(u32::from(b & 0xC0 != 0x80));
                        lengths.as_ref().is_none_or(|l| l.live(re, len))
                            && self.set_if(true, Phase::Str { len, esc: false, hex: 0, re })
                    }
                    None => false,
                },
            },
            (Phase::Start, Node::Number) => match Num::start(b) {
                Some(n) => self.set_if(true, Phase::Num { n, len: 1 }),
                None => false,
            },
            (Phase::Start, Node::Bare(dfa)) => match dfa.step(dfa.start(), b) {
                Some(re) => self.set_if(true, Phase::Bare { re }),
                None => false,
            },
            (Phase::Bare { re }, Node::Bare(dfa)) => match dfa.step(re, b) {
                Some(re) => self.set_if(true, Phase::Bare { re }),
                // The value ends here on a match, and the byte belongs to what follows it.
                None if dfa.is_match(re) => {
                    self.pop();
                    self.step(schema, b)
                }
                None => false,
            },
            (Phase::Start, Node::Literals(lits)) => self.literal(schema, lits, 0, lits.len() as u16, 0, b),
            (Phase::Lit { lo, hi, pos }, Node::Literals(lits)) => self.literal(schema, lits, lo, hi, pos, b),
            (Phase::ObjOpen { next } | Phase::ObjComma { next }, Node::Object { props, sorted, map }) => {
                let open = matches!(phase, Phase::ObjOpen { .. });
                match b {
                    b'"' => match map {
                        Some(m) => self.room_for(schema, *m) && self.set_if(true, Phase::MapKey { esc: false, hex: 0 }),
                        None => {
                            self.key_ahead(schema, props, next)
                                && self.set_if(true, Phase::ObjKey { next, lo: 0, hi: sorted.len() as u8, pos: 0 })
                        }
                    },
                    b'}' if open && (map.is_some() || Self::may_close(props, next)) => self.pop(),
                    _ => false,
                }
            }
            (Phase::ObjKey { next, lo, hi, pos }, Node::Object { props, sorted, .. }) => {
                let key = |i: u8| &props[sorted[i as usize] as usize].key;
                let p = pos as usize;
                // Keys never prefix one another (each ends at its unescaped closing quote), so every key in the
                // range is longer than `pos`.
                let (mut a, mut z) = (lo, hi);
                while a < z && key(a)[p] < b {
                    a += 1;
                }
                let mut e = a;
                while e < z && key(e)[p] == b {
                    e += 1;
                }
                z = e;
                let fits = |i: u8| {
                    let prop = sorted[i as usize];
                    Self::allowed(props, next, prop) && self.room_for(schema, props[prop as usize].node)
                };
                if !(a..z).any(fits) {
                    return false;
                }
                if z - a == 1 && key(a).len() == p + 1 {
                    self.set_if(true, Phase::ObjColon { prop: sorted[a as usize] })
                } else {
                    self.set_if(true, Phase::ObjKey { next, lo: a, hi: z, pos: pos + 1 })
                }
            }
            (Phase::MapKey { mut esc, mut hex }, Node::Object { .. }) => match string_byte(&mut esc, &mut hex, b) {
                StrByte::Close => self.set_if(true, Phase::ObjColon { prop: MAP_PROP }),
                StrByte::Content(_) => self.set_if(true, Phase::MapKey { esc, hex }),
                StrByte::Reject => false,
            },
            (Phase::ObjColon { prop }, Node::Object { props, map, .. }) => {
                if b != b':' {
                    return false;
                }
                let (child, next) = match map {
                    Some(m) if prop == MAP_PROP => (*m, 0),
                    _ => (props[prop as usize].node, prop + 1),
                };
                self.top().phase = Phase::ObjAfter { next };
                self.push(schema, child, None)
            }
            (Phase::ObjAfter { next }, Node::Object { props, map, .. }) => match b {
                b',' if map.map_or_else(|| self.key_ahead(schema, props, next), |m| self.room_for(schema, m)) => {
                    self.set_if(true, Phase::ObjComma { next })
                }
                b'}' if map.is_some() || Self::may_close(props, next) => self.pop(),
                _ => false,
            },
            (Phase::ArrOpen, Node::Array { items, min, max }) => {
                if b == b']' {
                    return *min == 0 && self.pop();
                }
                if *max == 0 || !self.room_for(schema, *items) {
                    return false;
                }
                self.top().phase = Phase::ArrAfter { count: 1 };
                self.push(schema, *items, Some(b))
            }
            (Phase::ArrComma { count }, Node::Array { items, .. }) => {
                self.top().phase = Phase::ArrAfter { count: count + 1 };
                self.push(schema, *items, Some(b))
            }
            (Phase::ArrAfter { count }, Node::Array { items, min, max }) => match b {
                b',' if count < *max && self.room_for(schema, *items) => self.set_if(true, Phase::ArrComma { count }),
                b']' if count >= *min => self.pop(),
                _ => false,
            },
            (Phase::Str { len, mut esc, mut hex, re }, Node::Str { min, max, pattern: None, .. }) => {
                match string_byte(&mut esc, &mut hex, b) {
                    StrByte::Close => len >= *min && self.pop(),
                    StrByte::Content(starts) => {
                        let len = len + u32::from(starts);
                        len <= *max && self.set_if(true, Phase::Str { len, esc, hex, re })
                    }
                    StrByte::Reject => false,
                }
            }
            (Phase::Num { n, len }, Node::Number) => match n.next(b) {
                // The last byte the bound allows must leave a number that may end.
                Some(n) => {
                    let len = len + 1;
                    self.set_if(
                        len < MAX_NUMBER_BYTES || (len == MAX_NUMBER_BYTES && n.may_end()),
                        Phase::Num { n, len },
                    )
                }
                // The number ends here if it may, and the byte belongs to what follows it.
                None if n.may_end() => {
                    self.pop();
                    self.step(schema, b)
                }
                None => false,
            },
            // A phase always belongs to its node's kind; anything else is a broken state, refused.
            _ => false,
        }
    }

    fn set_if(&mut self, ok: bool, phase: Phase) -> bool {
        if ok {
            self.top().phase = phase;
        }
        ok
    }

    /// Whether declared property `prop` may come next, after `next`: every one between them is optional.
    fn allowed(props: &[Prop], next: u8, prop: u8) -> bool {
        prop >= next && props[next as usize..prop as usize].iter().all(|p| !p.required)
    }

    /// Whether the object may close with `next` the first property still to come.
    fn may_close(props: &[Prop], next: u8) -> bool {
        props[(next as usize).min(props.len())..].iter().all(|p| !p.required)
    }

    /// Feeds `b` to a literal of which `lits[lo..hi]` match the first `pos` bytes.
    fn literal(&mut self, schema: &JsonSchema, lits: &[Vec<u8>], lo: u16, hi: u16, pos: u16, b: u8) -> bool {
        let p = pos as usize;
        let range = &lits[lo as usize..hi as usize];
        // Sorted: a literal that ends at `pos` comes first; the rest are ordered by their byte at `pos`.
        let complete = range.first().is_some_and(|l| l.len() == p);
        let rest = &range[usize::from(complete)..];
        let a = rest.partition_point(|l| l[p] < b);
        let z = rest.partition_point(|l| l[p] <= b);
        if a == z {
            // Nothing goes on with `b`: the value ends if a literal is complete, and `b` belongs to what follows.
            return complete && self.pop() && self.step(schema, b);
        }
        let base = lo as usize + usize::from(complete);
        let (lo, hi) = ((base + a) as u16, (base + z) as u16);
        if hi - lo == 1 && lits[lo as usize].len() == p + 1 {
            return self.pop();
        }
        self.set_if(true, Phase::Lit { lo, hi, pos: pos + 1 })
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use serde_json::json;

    use super::*;

    fn schema(v: Value) -> JsonSchema {
        JsonSchema::compile(&v).unwrap_or_else(|e| panic!("{v}: {e}"))
    }

    /// Feeds `text` one byte at a time; `Some(done)` when every byte fits.
    fn run(s: &JsonSchema, text: &str) -> Option<bool> {
        let mut state = SchemaState::new(s);
        for b in text.bytes() {
            state = state.accepts(s, &[b])?;
        }
        Some(state.is_done())
    }

    fn person() -> JsonSchema {
        schema(json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 5},
                "age": {"type": "integer"},
                "nick": {"type": ["string", "null"]},
                "tags": {"type": "array", "items": {"enum": ["a", "b", 12, 1]}, "minItems": 1, "maxItems": 2},
                "ok": {"type": "boolean"},
            },
            "required": ["name", "age", "ok"],
            "additionalProperties": false,
        }))
    }

    #[test]
    fn documents_of_the_schema_are_accepted_and_end_where_they_end() {
        let s = person();
        for doc in [
            r#"{"name":"Ann","age":31,"ok":true}"#,
            r#"{"name":"Ann","age":-999999999999999,"nick":null,"tags":["a",12],"ok":false}"#,
            r#"{ "name" : "Zoë" , "age" : 7 , "nick" : "z" , "tags" : [ 1 ] , "ok" : true }"#,
            r#"{"name":"a\"\u00e9","age":12,"tags":[12,1],"ok":true}"#,
            "{\n  \"name\": \"日本\",\n  \"age\": 100,\n  \"ok\": false\n}",
        ] {
            assert_eq!(run(&s, doc), Some(true), "{doc}");
            assert!(serde_json::from_str::<Value>(doc).is_ok(), "{doc}");
            let mut state = SchemaState::new(&s);
            for (i, b) in doc.bytes().enumerate() {
                assert!(!state.is_done(), "{doc}: done early at {i}");
                state = state.accepts(&s, &[b]).unwrap();
            }
            assert!(state.accepts(&s, b" ").is_none(), "nothing follows the document");
        }
    }

    #[test]
    fn what_the_schema_excludes_is_refused_at_the_first_byte_that_shows_it() {
        let s = person();
        for bad in [
            r#"["#,
            r#"{"age""#,                                 // a required property skipped
            r#"{"name":"Ann","age":3,"ok":true,"nick""#, // out of order
            r#"{"name":"Ann","age":3}"#,                 // `ok` missing
            r#"{"name":"Ann","name""#,                   // twice
            r#"{"nam":"#,                                // unknown key
            r#"{"name":"","#,                            // minLength 1
            r#"{"name":"abcdef""#,                       // maxLength 5
            r#"{"name":"日本語ですよ""#,                 // 6 characters
            r#"{"name":1"#,                              // a string expected
            r#"{"name":"a","age":1.5"#,                  // an integer
            r#"{"name":"a","age":1e3"#,
            r#"{"name":"a","age":01"#,
            r#"{"name":"a","age":1,"nick":nul,"#,
            r#"{"name":"a","age":1,"tags":[]"#,        // minItems 1
            r#"{"name":"a","age":1,"tags":["a","b","#, // maxItems 2
            r#"{"name":"a","age":1,"tags":["c""#,      // not in the enum
            r#"{"name":"a","age":1,"tags":[2"#,
            r#"{"name":"a","age":1,"tags":[123"#,
            r#"{"name":"a","age":1,"ok":yes"#,
            r#"{"name":"a","age":1,"ok":true,}"#,
            r#"{"name":"a\x"#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        // Prefixes that can still go on are fine, numbers and literals included.
        for ok in
            [r#"{"na"#, r#"{"name":"a","age":-"#, r#"{"name":"a","age":1,"tags":[1"#, r#"{"name":"a","age":1,"ok":tr"#]
        {
            assert_eq!(run(&s, ok), Some(false), "{ok}");
        }
        // `1` ends where `12` would go on.
        assert_eq!(run(&s, r#"{"name":"a","age":1,"tags":[1,12],"ok":true}"#), Some(true));
    }

    #[test]
    fn unsupported_schemas_are_refused_with_where_and_why() {
        let cases = [
            (
                json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z]{5}", "maxLength": 3}}}),
                "#/properties/a",
                "no string of the pattern",
            ),
            (
                json!({"type": "object", "properties": {"a": {"pattern": "(aa)*", "minLength": 3, "maxLength": 3}}}),
                "#/properties/a",
                "no string of the pattern",
            ),
            (
                json!({"type": "object", "properties": {"a": {"pattern": "[a-z ]+", "maxLength": 4_000_000}}}),
                "#/properties/a",
                "too large an automaton",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "string", "format": "uri"}}}),
                "#/properties/a/format",
                "the format `uri` is not supported",
            ),
            (
                json!({"type": "object", "properties": {"a": {"pattern": "(x"}}}),
                "#/properties/a/pattern",
                "does not compile",
            ),
            (
                json!({"type": "object", "properties": {"a": {"pattern": "say \"hi\""}}}),
                "#/properties/a/pattern",
                "without escapes",
            ),
            (
                json!({"type": "object", "properties": {"a": {"pattern": "x", "format": "date"}}}),
                "#/properties/a",
                "`pattern` beside `format`",
            ),
            (json!({"type": "string"}), "#", "root schema must be an object"),
            (json!({"type": "object", "properties": {}, "required": ["a"]}), "#/required", "not among"),
            (
                json!({"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, {"type": "number"}]}}}),
                "#/properties/a/anyOf",
                "same character",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/b"}}}),
                "#/properties/a",
                "names no definition",
            ),
            (json!({"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}), "#/$defs/x", "refers to itself"),
            (json!({"type": "object", "properties": {"a": false}}), "#/properties/a", "accepts no value"),
            (
                json!({"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 2}}}),
                "#/properties/a",
                "minItems",
            ),
            (json!({"type": "object", "properties": {"a": {"type": "date"}}}), "#/properties/a/type", "unknown type"),
            (json!({"type": "object", "properties": {"a": {"enum": []}}}), "#/properties/a/enum", "1 to"),
            (
                json!({"type": "object", "properties": {"a": {"type": "number", "maximum": 0.1234567890123}}}),
                "#/properties/a/maximum",
                "at most 12 decimals",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "number", "minimum": 2, "exclusiveMaximum": 2}}}),
                "#/properties/a",
                "no number",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 3, "exclusiveMaximum": 3}}}),
                "#/properties/a",
                "no integer",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1e16}}}),
                "#/properties/a/minimum",
                "within",
            ),
        ];
        for (v, path, why) in cases {
            let e = JsonSchema::compile(&v).expect_err(&v.to_string());
            assert_eq!(e.path, path, "{v}: {e}");
            assert!(e.message.contains(why), "{v}: {e}");
        }
        let big = format!("{{\"description\": \"{}\"}}", "x".repeat(MAX_SCHEMA_BYTES));
        assert!(JsonSchema::parse(&big).unwrap_err().message.contains("more than"));
        assert!(JsonSchema::parse("{").unwrap_err().message.contains("not valid JSON"));
    }

    #[test]
    fn references_recurse_and_the_nesting_bound_ends_them() {
        let s = schema(json!({
            "$defs": {"node": {"type": "object", "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            }, "required": ["v", "kids"], "additionalProperties": false}},
            "$ref": "#/$defs/node",
        }));
        assert_eq!(run(&s, r#"{"v":1,"kids":[{"v":2,"kids":[]},{"v":3,"kids":[{"v":4,"kids":[]}]}]}"#), Some(true));
        assert_eq!(run(&s, r#"{"v":1,"kids":[{"v":2}]}"#), None);
        // Each level is an object and an array: the frames run out at half of MAX_FRAMES levels.
        let deep = r#"{"v":1,"kids":["#.repeat(MAX_FRAMES / 2);
        assert_eq!(run(&s, &deep), Some(false));
        assert_eq!(run(&s, &format!("{deep}{{")), None);
    }

    #[test]
    fn objects_without_properties_are_maps_and_empty_schemas_any_value() {
        let s = schema(json!({"type": "object", "additionalProperties": {"type": "integer"}}));
        assert_eq!(run(&s, r#"{"a":1,"b\"":-2}"#), Some(true));
        assert_eq!(run(&s, r#"{"a":"x""#), None);
        let s = schema(json!({"type": "object"}));
        assert_eq!(run(&s, r#"{"a":[1,{"b":null},"c",true],"d":{},"e":-1.5e+3}"#), Some(true));
        let s = schema(json!({"type": "object", "properties": {}, "additionalProperties": false}));
        assert_eq!(run(&s, "{}"), Some(true));
        assert_eq!(run(&s, "{\""), None);
        let s = schema(json!({"type": "object", "properties": {"c": {"const": {"x": [1, "y"]}}}, "required": ["c"]}));
        assert_eq!(run(&s, r#"{"c":{"x":[1,"y"]}}"#), Some(true));
        assert_eq!(run(&s, r#"{"c":{"x": "#), None, "literals are matched in their compact form");
    }

    #[test]
    fn bounded_integers_take_only_their_values() {
        let s = schema(json!({"type": "object", "properties": {
            "stars": {"type": "integer", "minimum": 1, "maximum": 12},
            "t": {"type": "integer", "exclusiveMinimum": -3.5, "exclusiveMaximum": 0}},
            "required": ["stars", "t"]}));
        for ok in [r#"{"stars":1,"t":-3}"#, r#"{"stars":12,"t":-1}"#, r#"{"stars": 10 ,"t":-2}"#] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"stars":0"#,
            r#"{"stars":13"#,
            r#"{"stars":1.5"#,
            r#"{"stars":01"#,
            r#"{"stars":1,"t":0"#,
            r#"{"stars":1,"t":-4"#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        // One end, or a range too wide to list: an open end stops at 15 digits.
        let s = schema(json!({"type": "object", "properties": {
            "age": {"type": "integer", "minimum": 0},
            "debt": {"type": "integer", "exclusiveMaximum": 0},
            "year": {"type": "integer", "minimum": -5000, "maximum": 100000}},
            "required": ["age", "debt", "year"]}));
        for ok in [r#"{"age":0,"debt":-1,"year":-5000}"#, r#"{"age":999999999999999,"debt":-77,"year":100000}"#] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in
            [r#"{"age":-"#, r#"{"age":1000000000000000"#, r#"{"age":1,"debt":0"#, r#"{"age":1,"debt":-1,"year":100001"#]
        {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        // A bounded integer ends at the byte after it, which its container then takes.
        assert_eq!(run(&s, r#"{"age": 12 , "debt":-3,"year":7 }"#), Some(true));
    }

    #[test]
    fn integer_range_patterns_match_exactly_the_range() {
        let numeral =
            |n: i64, dfa: &ByteDfa| dfa.feed(dfa.start(), n.to_string().as_bytes()).is_some_and(|s| dfa.is_match(s));
        let ends = [-1000, -101, -100, -99, -10, -9, -1, 0, 1, 9, 10, 19, 99, 100, 101, 109, 199, 999, 1000, 1234];
        for &lo in &ends {
            for &hi in ends.iter().filter(|&&hi| hi >= lo) {
                let pattern = integer_range_pattern(lo, hi);
                let dfa = ByteDfa::compile(&pattern).unwrap();
                for n in -1300..=1300 {
                    assert_eq!(numeral(n, &dfa), (lo..=hi).contains(&n), "{n} in {lo}..={hi}: {pattern}");
                }
                for odd in ["-0", "01", "00", "-01", "+1"] {
                    assert!(dfa.feed(dfa.start(), odd.as_bytes()).is_none_or(|s| !dfa.is_match(s)), "{odd}: {pattern}");
                }
            }
        }
        // The widest ranges stay small automata.
        let widest = ByteDfa::compile(&integer_range_pattern(-OPEN_INTEGER_BOUND, OPEN_INTEGER_BOUND)).unwrap();
        assert!(widest.states() < 64, "{}", widest.states());
        let odd = ByteDfa::compile(&integer_range_pattern(-123_456_789_012_345, 987_654_321_098_765)).unwrap();
        assert!(numeral(987_654_321_098_765, &odd) && !numeral(987_654_321_098_766, &odd) && numeral(-5, &odd));
        assert!(numeral(-123_456_789_012_345, &odd) && !numeral(-123_456_789_012_346, &odd));
    }

    #[test]
    fn number_range_patterns_match_exactly_the_range() {
        // Every plain decimal with an integer part up to 14 and some fractions, in ten-thousandths.
        let fractions = [
            ("", 0),
            (".0", 0),
            (".00", 0),
            (".5", 5000),
            (".05", 500),
            (".50", 5000),
            (".9", 9000),
            (".001", 10),
            (".25", 2500),
            (".249", 2490),
            (".2501", 2501),
            (".04", 400),
            (".06", 600),
            (".0501", 501),
            (".0499", 499),
        ];
        let mut numerals: Vec<(String, i64)> = Vec::new();
        for int in 0..=14i64 {
            for (frac, units) in fractions {
                let v = int * 10_000 + units;
                numerals.push((format!("{int}{frac}"), v));
                numerals.push((format!("-{int}{frac}"), -v));
            }
        }
        let ends = [-13.0, -5.0, -1.5, -1.0, -0.05, 0.0, 0.05, 0.25, 1.0, 2.25, 5.0, 13.0];
        let bounds: Vec<(f64, bool)> = ends.iter().flat_map(|&x| [(x, false), (x, true)]).collect();
        let mut checked = 0;
        for &(l, ls) in &bounds {
            for &(h, hs) in &bounds {
                let lo = Bound { at: Decimal::of(l).unwrap(), strict: ls };
                let hi = Bound { at: Decimal::of(h).unwrap(), strict: hs };
                let Some(pattern) = number_range_pattern(&lo, &hi) else {
                    assert!(l > h || (l == h && (ls || hs)), "{lo:?} {hi:?} left nothing");
                    continue;
                };
                let dfa = ByteDfa::compile(&pattern).unwrap();
                let (l, h) = ((l * 10_000.0).round() as i64, (h * 10_000.0).round() as i64);
                for (text, v) in &numerals {
                    let above = if ls { *v > l } else { *v >= l };
                    let below = if hs { *v < h } else { *v <= h };
                    // `-0` and its fractions of zero are not written: JSON's zero is `0`.
                    let canonical = !(text.starts_with('-') && *v == 0);
                    let matched = dfa.feed(dfa.start(), text.as_bytes()).is_some_and(|s| dfa.is_match(s));
                    assert_eq!(matched, above && below && canonical, "{text} in {lo:?}..{hi:?}: {pattern}");
                    checked += 1;
                }
                for odd in ["01", "1.", ".5", "1e3", "+1", "00.5"] {
                    assert!(dfa.feed(dfa.start(), odd.as_bytes()).is_none_or(|s| !dfa.is_match(s)), "{odd}");
                }
            }
        }
        assert!(checked > 100_000, "{checked}");
        // Through the schema: probabilities, latitudes, and a price with one end.
        let s = schema(json!({"type": "object", "properties": {
            "p": {"type": "number", "minimum": 0, "maximum": 1},
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "price": {"type": "number", "exclusiveMinimum": 0}},
            "required": ["p", "lat", "price"]}));
        assert_eq!(run(&s, r#"{"p":0.25,"lat":-89.999,"price":0.01}"#), Some(true));
        assert_eq!(run(&s, r#"{"p":1.0,"lat":90,"price":12}"#), Some(true));
        for bad in [r#"{"p":1.5"#, r#"{"p":-0.1"#, r#"{"p":1,"lat":90.5"#, r#"{"p":1,"lat":0,"price":0,"#, r#"{"p":1e"#]
        {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        // Bounds between whole numbers.
        let s = schema(json!({"type": "object", "properties": {
            "temp": {"type": "number", "minimum": 35.5, "exclusiveMaximum": 42.25}}, "required": ["temp"]}));
        for ok in [r#"{"temp":35.5}"#, r#"{"temp":36}"#, r#"{"temp":42.2499}"#, r#"{"temp":38.75}"#] {
            assert_eq!(run(&s, ok), Some(true), "{ok}");
        }
        for bad in [r#"{"temp":35.4"#, r#"{"temp":42.25}"#, r#"{"temp":42.3"#, r#"{"temp":43"#, r#"{"temp":3}"#] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
    }

    #[test]
    fn whitespace_runs_and_numbers_are_bounded() {
        let s = person();
        let pad = " ".repeat(MAX_WS_RUN as usize);
        assert_eq!(run(&s, &format!("{pad}{{{pad}\"name\"")), Some(false));
        assert_eq!(run(&s, &format!("{pad} ")), None);
        // An integer without bounds stops where an open end does: 15 digits; `-0` is not written.
        let at = |digits: &str| format!(r#"{{"name":"a","age":{digits}"#);
        let longest = "9".repeat(15);
        assert_eq!(run(&s, &at(&longest)), Some(false));
        assert_eq!(run(&s, &at(&format!("{longest}9"))), None);
        assert_eq!(run(&s, &at(&format!("-{longest}9"))), None);
        assert_eq!(run(&s, &at("-0")), None);
        assert_eq!(run(&s, &format!("{},\"ok\":true}}", at(&longest))), Some(true));
        // A number cannot be left where it could only go on.
        let any = schema(json!({"type": "object", "additionalProperties": {"type": "number"}}));
        let head = format!(r#"{{"x":{}"#, "1".repeat(MAX_NUMBER_BYTES as usize - 2));
        assert_eq!(run(&any, &format!("{head}.")), Some(false));
        assert_eq!(run(&any, &format!("{head}.5}}")), Some(true));
        assert_eq!(run(&any, &format!("{head}1.")), None);
    }

    /// Random walks: wherever a walk stands before the end, some byte goes on (the guide never leaves the model
    /// without a way forward), and a walk that ends is a JSON document with the schema's shape.
    #[test]
    fn patterns_and_formats_guide_whole_strings() {
        let s = schema(json!({
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "[A-Z]{2}-[0-9]{1,3}"},
                "day": {"format": "date"},
                "id": {"type": ["string", "null"], "format": "uuid"},
                "n": {"type": "integer", "format": "int32"},
                "again": {"type": "string", "pattern": "[A-Z]{2}-[0-9]{1,3}"},
            },
            "required": ["code", "day", "id", "n"],
            "additionalProperties": false,
        }));
        let uuid = "123e4567-e89b-12d3-a456-426614174000";
        for ok in [
            format!(r#"{{"code":"AB-1","day":"2024-02-29","id":"{uuid}","n":5}}"#),
            r#"{"code":"XY-123","day":"1999-12-31","id":null,"n":-1,"again":"QQ-9"}"#.to_string(),
        ] {
            assert_eq!(run(&s, &ok), Some(true), "{ok}");
        }
        for bad in [
            r#"{"code":"ab"#,                   // lower case
            r#"{"code":"AB-1234"#,              // four digits
            r#"{"code":"AB-""#,                 // closed before a match
            r#"{"code":"AB-1","day":"2024-13"#, // month 13
            r#"{"code":"A\u0042"#,              // no escapes in a pattern string
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        // The two equal patterns are compiled once; inside a pattern string the plain-content shortcut is off.
        let dfas: Vec<&Arc<ByteDfa>> = s
            .nodes
            .iter()
            .filter_map(|n| match n {
                Node::Str { pattern: Some(d), .. } => Some(d),
                _ => None,
            })
            .collect();
        assert_eq!(dfas.len(), 4);
        assert!(Arc::ptr_eq(dfas[0], dfas[3]));
        let inside = SchemaState::new(&s).accepts(&s, br#"{"code":"A"#).unwrap();
        assert_eq!(inside.plain_string_room(&s), None);
        // Random walks from every state end in documents whose strings match in full.
        let full = |p: &str, v: &Value| {
            regex_automata::meta::Regex::new(&format!("^(?:{p})$")).unwrap().is_match(v.as_str().unwrap_or_default())
        };
        let mut rng = StdRng::seed_from_u64(5);
        let mut trial = SchemaState::new(&s);
        let mut finished = 0;
        for _ in 0..100 {
            let mut state = SchemaState::new(&s);
            let mut text = Vec::new();
            while !state.is_done() && text.len() < 400 {
                let ok: Vec<u8> = (0x20..0x7fu8).filter(|&b| state.fits(&s, &[b], &mut trial)).collect();
                assert!(!ok.is_empty(), "stuck after {:?}", String::from_utf8_lossy(&text));
                let b = ok[rng.random_range(0..ok.len())];
                state = state.accepts(&s, &[b]).unwrap();
                text.push(b);
            }
            if !state.is_done() {
                continue;
            }
            finished += 1;
            let v: Value = serde_json::from_slice(&text).unwrap();
            let date = FORMATS[0].1;
            assert!(full("[A-Z]{2}-[0-9]{1,3}", &v["code"]) && full(date, &v["day"]), "{v}");
            assert!(v["id"].is_null() || full(FORMATS[3].1, &v["id"]), "{v}");
        }
        assert!(finished > 30, "{finished} walks finished");
    }

    #[test]
    fn pattern_strings_with_length_bounds_end_on_a_match_of_an_allowed_length() {
        let s = schema(json!({
            "type": "object",
            "properties": {
                "even": {"type": "string", "pattern": "(ab)+", "minLength": 3, "maxLength": 6},
                "greek": {"type": "string", "pattern": "[α-ω]+|x+", "maxLength": 4},
                "long": {"type": "string", "pattern": "[a-c]*", "minLength": 5},
            },
            "required": ["even", "greek", "long"],
            "additionalProperties": false,
        }));
        assert_eq!(run(&s, r#"{"even":"abab","greek":"αβγδ","long":"abcab"}"#), Some(true));
        assert_eq!(run(&s, r#"{"even":"ababab","greek":"x","long":"aaaaaaaaaa"}"#), Some(true));
        for bad in [
            r#"{"even":"ab""#,                  // 2 characters
            r#"{"even":"abababa"#,              // past 6, and not a match
            r#"{"even":"abab","greek":"αβγδε"#, // 5 characters
            r#"{"even":"abab","greek":"x","long":"abca""#,
        ] {
            assert_eq!(run(&s, bad), None, "{bad}");
        }
        // Random walks over every byte never get stuck, and end in strings of the patterns within the bounds.
        let mut rng = StdRng::seed_from_u64(9);
        let mut trial = SchemaState::new(&s);
        let mut finished = 0;
        for _ in 0..200 {
            let mut state = SchemaState::new(&s);
            let mut text = Vec::new();
            while !state.is_done() && text.len() < 300 {
                let ok: Vec<u8> = (0..=255u8).filter(|&b| state.fits(&s, &[b], &mut trial)).collect();
                assert!(!ok.is_empty(), "stuck after {:?}", String::from_utf8_lossy(&text));
                let b = ok[rng.random_range(0..ok.len())];
                state = state.accepts(&s, &[b]).unwrap();
                text.push(b);
            }
            if !state.is_done() {
                continue;
            }
            finished += 1;
            let v: Value = serde_json::from_slice(&text).unwrap();
            let chars = |k: &str| v[k].as_str().unwrap().chars().count();
            assert!((3..=6).contains(&chars("even")) && chars("greek") <= 4 && chars("long") >= 5, "{v}");
        }
        assert!(finished > 50, "{finished} walks finished");
    }

    #[test]
    fn random_walks_never_get_stuck_and_end_in_valid_documents() {
        let s = person();
        let mut rng = StdRng::seed_from_u64(7);
        let mut trial = SchemaState::new(&s);
        let mut finished = 0;
        for _ in 0..300 {
            let mut state = SchemaState::new(&s);
            let mut text = Vec::new();
            for _ in 0..400 {
                if state.is_done() {
                    break;
                }
                let ok: Vec<u8> = (0..=255u8).filter(|&b| state.fits(&s, &[b], &mut trial)).collect();
                // The sampler's shortcut inside strings agrees with feeding the bytes.
                if let Some(room) = state.plain_string_room(&s) {
                    for (plain, chars) in [("ab", 2), ("é日", 2), (" x y", 4), ("abcdef", 6), ("\u{80}", 1)] {
                        assert_eq!(state.fits(&s, plain.as_bytes(), &mut trial), chars <= room, "{plain:?} {room}");
                    }
                }
                assert!(!ok.is_empty(), "stuck after {:?}", String::from_utf8_lossy(&text));
                // Printable ASCII without escapes (so that the text is UTF-8 without lone surrogates), leaning
                // towards closing, so that walks finish.
                let ascii: Vec<u8> = ok.iter().copied().filter(|&b| (0x20..0x7f).contains(&b) && b != b'\\').collect();
                let closers: Vec<u8> = ascii.iter().copied().filter(|b| b"\"}],".contains(b)).collect();
                let b = if !closers.is_empty() && rng.random_bool(0.5) {
                    closers[rng.random_range(0..closers.len())]
                } else {
                    ascii[rng.random_range(0..ascii.len())]
                };
                assert_eq!(state.accepts(&s, &[b]).is_some(), state.fits(&s, &[b], &mut trial));
                state = state.accepts(&s, &[b]).unwrap();
                text.push(b);
            }
            if state.is_done() {
                finished += 1;
                let v: Value = serde_json::from_slice(&text)
                    .unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(&text)));
                let o = v.as_object().unwrap();
                assert!(o["name"].is_string() && o["age"].is_number() && o["ok"].is_boolean(), "{v}");
                assert!(o.keys().all(|k| ["name", "age", "nick", "tags", "ok"].contains(&k.as_str())), "{v}");
            }
        }
        assert!(finished > 100, "{finished} walks finished");
    }

    /// The table by sweeping every state until nothing changes, as it was first built: slow on chains, but plainly
    /// right.
    fn swept_table(dfa: &ByteDfa, min: u32, max: u32) -> Vec<bool> {
        let cap = if max == u32::MAX { min } else { max };
        let width = cap as usize + 1;
        let mut table = LengthTable { min, max, cap, live: vec![false; dfa.states() * width] };
        for count in (0..=cap).rev() {
            loop {
                let mut changed = false;
                for s in 0..dfa.states() as u32 {
                    let at = s as usize * width + count as usize;
                    if !table.live[at]
                        && ((dfa.is_match(s) && table.allows(count))
                            || dfa.moves(s).any(|(starts, to)| table.live(to, count + u32::from(starts))))
                    {
                        table.live[at] = true;
                        changed = true;
                    }
                }
                if !changed {
                    break;
                }
            }
        }
        table.live
    }

    #[test]
    fn length_tables_take_no_more_steps_than_the_budget_charges() {
        // Chains settle one state per sweep when swept: a{2000} with `minLength` took some 2,001 sweeps of 2,001
        // states, a hundred times what the budget charged.
        let cases = [
            ("a{2000}", 1, u32::MAX),
            ("a{2000}", 2000, u32::MAX),
            ("a{300}", 0, 300),
            ("é{300}", 2, u32::MAX),
            ("(ab)+", 3, 6),
            ("[α-ω]+|x+", 0, 4),
            ("[a-c]*", 5, u32::MAX),
            ("[a-z ]+", 0, 4000),
            ("x[0-9]{5,40}(é|y)*", 30, u32::MAX),
            ("x[0-9]{5,40}(é|y)*", 12, 50),
        ];
        for (pattern, min, max) in cases {
            let dfa = ByteDfa::compile_json_string(pattern).unwrap();
            let (table, steps) = LengthTable::build(&dfa, min, max);
            let work = LengthTable::work(&dfa, min, max).unwrap();
            assert!(steps <= work, "{pattern} {min}..{max}: {steps} steps, {work} charged");
            if dfa.states() < 500 {
                assert_eq!(table.live, swept_table(&dfa, min, max), "{pattern} {min}..{max}");
            }
        }
        // What the audit sent: many chains of 2,000 with `minLength`. The budget, now what the tables cost, ends it.
        let objects: serde_json::Map<String, Value> = (0..7)
            .map(|j| {
                let props: serde_json::Map<String, Value> =
                    (0..128).map(|i| (format!("p{i}"), json!({"pattern": "a{2000}", "minLength": 1}))).collect();
                (format!("o{j}"), json!({"type": "object", "properties": props}))
            })
            .collect();
        let e = JsonSchema::compile(&json!({"type": "object", "properties": objects})).unwrap_err();
        assert!(e.message.contains("too large an automaton"), "{e}");
    }

    #[test]
    fn schemas_whose_documents_cannot_end_within_the_frames_are_refused() {
        for v in [
            json!({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}),
            json!({"type": "object", "properties": {"a": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
                "required": ["a"]}),
            json!({"$defs": {"n": {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 2},
                {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]}]}},
                "type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]}),
        ] {
            let e = JsonSchema::compile(&v).expect_err(&v.to_string());
            assert_eq!(e.path, "#", "{v}: {e}");
            assert!(e.message.contains("nests at most 32 deep"), "{v}: {e}");
        }
        // Required objects nested exactly as deep as the frames go, and one more.
        let nested = |levels: usize| {
            (1..levels).fold(
                json!({"type": "object"}),
                |inner, _| json!({"type": "object", "properties": {"a": inner}, "required": ["a"]}),
            )
        };
        let s = schema(nested(MAX_FRAMES));
        let doc = format!("{}{}", r#"{"a":"#.repeat(MAX_FRAMES - 1), "{}") + &"}".repeat(MAX_FRAMES - 1);
        assert_eq!(run(&s, &doc), Some(true));
        assert!(JsonSchema::compile(&nested(MAX_FRAMES + 1)).is_err());
        // An optional way down is fine: it is cut off where it could not end.
        schema(json!({"type": "object", "properties": {"next": {"$ref": "#"}}}));
    }

    /// Walks that open whatever they may until `turn` bytes, then close what they can: some byte always fits, and the
    /// walks end in JSON documents. Returns the documents and the most frames the walks held.
    fn deep_walks(s: &JsonSchema, seed: u64, walks: usize, turn: usize) -> (Vec<Value>, usize) {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut trial = SchemaState::new(s);
        let mut deepest = 0;
        let mut docs = Vec::new();
        for _ in 0..walks {
            let mut state = SchemaState::new(s);
            let mut text = Vec::new();
            while !state.is_done() {
                assert!(text.len() < turn + 4000, "no end after {:?}", String::from_utf8_lossy(&text));
                let ok: Vec<u8> = (0..=255u8).filter(|&b| state.fits(s, &[b], &mut trial)).collect();
                // Whitespace only puts off being stuck.
                assert!(ok.iter().any(|&b| !is_ws(b)), "stuck after {:?}", String::from_utf8_lossy(&text));
                // Printable, without escapes, and without exponents where a literal does not need them (they may
                // leave f64's range).
                let printable: Vec<u8> =
                    ok.iter().copied().filter(|&b| (0x21..0x7f).contains(&b) && b != b'\\').collect();
                let plain: Vec<u8> = printable.iter().copied().filter(|b| !b"eE".contains(b)).collect();
                let plain = if plain.is_empty() { printable } else { plain };
                let pick = |from: &[u8], rng: &mut StdRng| from[rng.random_range(0..from.len())];
                let b = if text.len() < turn {
                    let openers: Vec<u8> = plain.iter().copied().filter(|b| b"{[\":".contains(b)).collect();
                    if !openers.is_empty() && rng.random_bool(0.8) {
                        pick(&openers, &mut rng)
                    } else {
                        pick(&plain, &mut rng)
                    }
                } else {
                    let closers: Vec<u8> = plain.iter().copied().filter(|b| b"}]\"".contains(b)).collect();
                    let calm: Vec<u8> = plain.iter().copied().filter(|b| !b"{[,".contains(b)).collect();
                    if !closers.is_empty() && rng.random_bool(0.8) {
                        pick(&closers, &mut rng)
                    } else if !calm.is_empty() {
                        pick(&calm, &mut rng)
                    } else {
                        pick(&plain, &mut rng)
                    }
                };
                state = state.accepts(s, &[b]).unwrap();
                deepest = deepest.max(state.depth as usize);
                text.push(b);
            }
            docs.push(
                serde_json::from_slice(&text).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&text))),
            );
        }
        (docs, deepest)
    }

    #[test]
    fn walks_to_the_nesting_limit_never_get_stuck_and_always_end() {
        let tree = schema(json!({
            "$defs": {"node": {"type": "object", "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            }, "required": ["v", "kids"], "additionalProperties": false}},
            "type": "object",
            "properties": {"tree": {"$ref": "#/$defs/node"}},
            "required": ["tree"],
        }));
        // A node takes two frames (itself, and its `kids`), so the deepest one opens a frame short of the limit.
        let (docs, deepest) = deep_walks(&tree, 11, 40, 300);
        assert_eq!(deepest, MAX_FRAMES - 1);
        for doc in docs {
            fn check(node: &Value) {
                assert!(node["v"].is_i64(), "{node}");
                node["kids"].as_array().unwrap().iter().for_each(check);
            }
            check(&doc["tree"]);
        }
        let (docs, deepest) = deep_walks(&schema(json!({"type": "object"})), 12, 40, 1500);
        assert_eq!(deepest, MAX_FRAMES);
        assert!(docs.iter().all(Value::is_object));
    }

    #[test]
    fn maps_at_the_nesting_limit_offer_no_key_they_cannot_finish() {
        let s = schema(json!({"type": "object"}));
        let full = format!("{}{{", r#"{"k":"#.repeat(MAX_FRAMES - 1));
        let state = SchemaState::new(&s).accepts(&s, full.as_bytes()).unwrap();
        assert_eq!(state.depth as usize, MAX_FRAMES);
        assert!(state.accepts(&s, b"\"").is_none(), "a key whose value has no frame left");
        assert!(state.accepts(&s, b" }").is_some());
        // One frame below: a key, and a value of one frame: a scalar, or an empty object or array.
        let below = format!("{}{{", r#"{"k":"#.repeat(MAX_FRAMES - 2));
        let state = SchemaState::new(&s).accepts(&s, below.as_bytes()).unwrap();
        for ok in [r#""k":1"#, r#""k":"x""#, r#""k":{}"#, r#""k":[]"#, r#""k":{},"j":null}"#] {
            assert!(state.accepts(&s, ok.as_bytes()).is_some(), "{ok}");
        }
        for bad in [r#""k":{""#, r#""k":[1"#, r#""k":[{"#] {
            assert!(state.accepts(&s, bad.as_bytes()).is_none(), "{bad}");
        }
        // Declared optional properties the same: offered only while their values fit.
        let s = schema(json!({"type": "object", "properties": {
            "deep": {"type": "object", "properties": {"x": {"type": "object"}}, "required": ["x"]},
            "flat": {"type": "integer"}}}));
        let state = SchemaState::new(&s).accepts(&s, br#"{"#).unwrap();
        assert!(state.accepts(&s, br#""deep":{"x":{}}}"#).is_some());
        let mut shallow = state.clone();
        shallow.depth = (MAX_FRAMES - 1) as u8;
        shallow.frames[shallow.depth as usize - 1] = state.frames[0];
        assert!(shallow.accepts(&s, br#""d"#).is_none());
        assert!(shallow.accepts(&s, br#""flat":1}"#).is_some());
    }

    #[test]
    fn property_names_longer_than_a_byte_counts_are_guided_to_their_end() {
        let name: String = (0..300).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
        let s =
            schema(json!({"type": "object", "properties": {name.clone(): {"type": "integer"}}, "required": [name]}));
        assert_eq!(run(&s, &format!(r#"{{"{name}":1}}"#)), Some(true));
        assert_eq!(run(&s, &format!(r#"{{"{name}x"#)), None);
        let long = "k".repeat(MAX_PROPERTY_NAME_BYTES);
        let e = JsonSchema::compile(&json!({"type": "object", "properties": {long: {}}})).unwrap_err();
        assert_eq!(e.path, "#/properties");
        assert!(e.message.contains("property name"), "{e}");
    }

    #[test]
    fn lower_bounds_past_any_answer_are_refused() {
        for (kind, key) in [("array", "minItems"), ("string", "minLength")] {
            let v = json!({"type": "object", "properties": {"a": {"type": kind, key: 4_000_000_000u64}}});
            let e = JsonSchema::compile(&v).unwrap_err();
            assert_eq!(e.path, format!("#/properties/a/{key}"));
            assert!(e.message.contains(key) && e.message.contains("more than"), "{e}");
            schema(json!({"type": "object", "properties": {"a": {"type": kind, key: MAX_MIN_COUNT}}}));
        }
        // Upper bounds that large bound nothing, and are fine.
        schema(json!({"type": "object", "properties": {"a": {"type": "array", "maxItems": 4_000_000_000u64}}}));
    }

    #[test]
    fn deep_reference_chains_are_refused_within_a_small_stack() {
        let links = 1000;
        let defs: serde_json::Map<String, Value> = (0..links)
            .map(|i| {
                let def = if i + 1 == links {
                    json!({"type": "integer"})
                } else {
                    json!({"type": "array", "items": {"$ref": format!("#/$defs/a{}", i + 1)}})
                };
                (format!("a{i}"), def)
            })
            .collect();
        let v = json!({"$defs": defs, "type": "object", "properties": {"x": {"$ref": "#/$defs/a0"}}});
        let compiled = std::thread::Builder::new()
            .stack_size(512 * 1024)
            .spawn(move || JsonSchema::compile(&v).map(|_| ()))
            .unwrap()
            .join()
            .unwrap();
        let e = compiled.unwrap_err();
        assert!(e.message.contains("nest more than"), "{e}");
        // A chain within the bound compiles.
        let defs: serde_json::Map<String, Value> = (0..20)
            .map(|i| (format!("a{i}"), json!({"type": "array", "items": {"$ref": format!("#/$defs/a{}", i + 1)}})))
            .chain([("a20".to_string(), json!({"type": "integer"}))])
            .collect();
        schema(json!({"$defs": defs, "type": "object", "properties": {"x": {"$ref": "#/$defs/a0"}}}));
    }
}

/// How long schemas at the pattern bounds take to compile (the numbers in ARCHITECTURE.md):
/// `cargo test --release -p pagoda-worker --lib schema_compile_times -- --ignored --nocapture`.
#[cfg(test)]
#[test]
#[ignore = "timing; prints, asserts only the outcomes"]
fn schema_compile_times() {
    let bounded =
        serde_json::json!({"type": "object", "properties": {"a": {"pattern": "[a-z ]+", "maxLength": 400_000}}});
    let mut outer = serde_json::Map::new();
    for j in 0..15 {
        let props: serde_json::Map<String, Value> =
            (0..128).map(|i| (format!("p{i}"), serde_json::json!({"pattern": format!("a{j}x{i}")}))).collect();
        outer.insert(format!("o{j}"), serde_json::json!({"type": "object", "properties": props}));
    }
    let many = serde_json::json!({"type": "object", "properties": outer});
    for (name, schema) in [("a 400,000-character bound beside a pattern", bounded), ("1,920 distinct patterns", many)] {
        let t = std::time::Instant::now();
        let r = JsonSchema::compile(&schema);
        eprintln!("{name}: {:?}", t.elapsed());
        assert!(r.is_ok(), "{name}: {r:?}");
    }
}
