//! Constrained decoding to one JSON object (OpenAI's `response_format: {"type": "json_object"}`).
//!
//! [`JsonState`] is a pushdown automaton over bytes that accepts exactly the prefixes of an RFC 8259 document
//! whose top-level value is an object, nested at most [`MAX_DEPTH`] deep. It is `Copy` (the nesting is a bit
//! stack), so the sampler can try every token of the vocabulary against it without allocating:
//! [`JsonState::accepts`] feeds a token's bytes to a copy. [`TokenTable`] holds those bytes.

/// Deepest nesting of objects and arrays a guided answer may have.
pub const MAX_DEPTH: u8 = 64;

/// Each token's bytes, as the sampler tests them against the automaton; empty for special tokens, which never
/// appear in text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TokenTable {
    bytes: Vec<u8>,
    /// `bytes[offsets[t]..offsets[t + 1]]` is token `t`.
    offsets: Vec<u32>,
    /// For a token that can only be the inside of a JSON string (non-empty, no quote, backslash or control byte):
    /// how many characters it starts (bytes that are not UTF-8 continuations); [`NOT_PLAIN`] for any other.
    plain_chars: Vec<u32>,
    /// Every token id, ascending by the token's bytes ([`TokenTable::by_bytes`]).
    by_bytes: Vec<u32>,
    /// `by_bytes[starts[b]..starts[b + 1]]` are the tokens whose first byte is `b`.
    starts: Vec<u32>,
    /// The bytes after the first of each token of `by_bytes`, in that order, as sets of 256 bits
    /// ([`TokenTable::later_bytes`]).
    later: Vec<[u64; 4]>,
    /// The longest token's length in bytes.
    longest: usize,
}

/// [`TokenTable::plain_chars`] of a token that is not plain string content.
const NOT_PLAIN: u32 = u32::MAX;

impl TokenTable {
    /// A table of `tokens` (token id = index).
    pub fn new<'a>(tokens: impl IntoIterator<Item = &'a [u8]>) -> TokenTable {
        let mut t = TokenTable {
            bytes: Vec::new(),
            offsets: vec![0],
            plain_chars: Vec::new(),
            by_bytes: Vec::new(),
            starts: Vec::new(),
            later: Vec::new(),
            longest: 0,
        };
        for b in tokens {
            t.bytes.extend_from_slice(b);
            t.offsets.push(u32::try_from(t.bytes.len()).unwrap_or(u32::MAX));
            let plain = !b.is_empty() && b.iter().all(|&c| c >= 0x20 && c != b'"' && c != b'\\');
            t.plain_chars.push(if plain { b.iter().filter(|&&c| c & 0xC0 != 0x80).count() as u32 } else { NOT_PLAIN });
        }
        let mut order: Vec<u32> = (0..t.len() as u32).collect();
        order.sort_by(|&a, &b| t.bytes(a).cmp(t.bytes(b)));
        // Empty tokens sort first, then by first byte.
        t.starts = (0..=256usize)
            .map(|b| order.partition_point(|&x| t.bytes(x).first().is_none_or(|&f| usize::from(f) < b)) as u32)
            .collect();
        t.later = order
            .iter()
            .map(|&x| {
                let mut later = [0u64; 4];
                for &c in t.bytes(x).iter().skip(1) {
                    later[usize::from(c >> 6)] |= 1 << (c & 63);
                }
                later
            })
            .collect();
        t.longest = (0..t.len() as u32).map(|x| t.bytes(x).len()).max().unwrap_or(0);
        t.by_bytes = order;
        t
    }

    /// The longest token whose bytes start `bytes`, and its length (the lowest id among tokens with the same
    /// bytes); `None` if no token does. A binary search of [`TokenTable::by_bytes`] per candidate length.
    pub fn longest_prefix(&self, bytes: &[u8]) -> Option<(u32, usize)> {
        (1..=bytes.len().min(self.longest)).rev().find_map(|n| {
            let want = &bytes[..n];
            let first = self.by_bytes.partition_point(|&t| self.bytes(t) < want);
            let t = *self.by_bytes.get(first)?;
            (self.bytes(t) == want).then_some((t, n))
        })
    }

    /// The bytes after the first of the token at position `i` of [`TokenTable::by_bytes`], as 256 bits (bit
    /// `c % 64` of word `c / 64` for byte `c`): a guide that knows which bytes keep it where it is tests a
    /// token's tail with four word operations. Kept in that order, so that a pass over a range reads memory in
    /// sequence.
    pub fn later_bytes(&self, i: usize) -> [u64; 4] {
        self.later.get(i).copied().unwrap_or_default()
    }

    /// The positions in [`TokenTable::by_bytes`] of the tokens whose first byte is `b`.
    pub fn starting_with(&self, b: u8) -> std::ops::Range<usize> {
        self.starts[usize::from(b)] as usize..self.starts[usize::from(b) + 1] as usize
    }

    /// Every token id, ascending by the token's bytes: tokens that share a prefix sit together, so a guide that
    /// walks them in this order can share the work of the prefix ([`crate::grammar_guide`]).
    pub fn by_bytes(&self) -> &[u32] {
        &self.by_bytes
    }

    /// When token `t` can only be string content, the characters it adds: a guide standing inside a string (not
    /// in an escape) with room for that many accepts it without feeding it byte by byte.
    pub fn plain_chars(&self, t: u32) -> Option<u32> {
        self.plain_chars.get(t as usize).copied().filter(|&c| c != NOT_PLAIN)
    }

    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Token `t`'s bytes (empty for a special token or an id outside the table).
    pub fn bytes(&self, t: u32) -> &[u8] {
        let t = t as usize;
        match (self.offsets.get(t), self.offsets.get(t + 1)) {
            (Some(&a), Some(&b)) => &self.bytes[a as usize..b as usize],
            _ => &[],
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Before the top-level object: whitespace or `{`.
    Start,
    /// After `{`: a key or `}`.
    KeyOrClose,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// A value.
    Value,
    /// After `[`: a value or `]`.
    ValueOrClose,
    /// After a value inside an object or array: `,` or the closing bracket.
    AfterValue,
    /// Inside a string (a key when `key`); `esc`: after a backslash; `hex`: hex digits left of a `\u` escape.
    Str {
        key: bool,
        esc: bool,
        hex: u8,
    },
    Num(Num),
    /// Inside `true`, `false` or `null`: the rest still to come, as an index into [`LITERALS`] and a position.
    Lit {
        which: u8,
        at: u8,
    },
    /// The top-level object is closed.
    Done,
}

/// Where a JSON number stands (this guide's and [`crate::json_schema`]'s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Num {
    /// After `-`: a digit.
    Minus,
    /// A leading `0`: `.`, an exponent, or the end.
    Zero,
    Int,
    /// After `.`: a digit.
    Dot,
    Frac,
    /// After `e`/`E`: a sign or a digit.
    Exp,
    /// After the exponent's sign: a digit.
    ExpSign,
    ExpDigits,
}

impl Num {
    /// A number that starts with `b`.
    pub(crate) fn start(b: u8) -> Option<Num> {
        match b {
            b'-' => Some(Num::Minus),
            b'0' => Some(Num::Zero),
            b'1'..=b'9' => Some(Num::Int),
            _ => None,
        }
    }

    /// The number after `b`, or `None` when `b` does not continue it.
    pub(crate) fn next(self, b: u8) -> Option<Num> {
        match (self, b) {
            (Num::Minus, b'0') => Some(Num::Zero),
            (Num::Minus, b'1'..=b'9') => Some(Num::Int),
            (Num::Int, b'0'..=b'9') => Some(Num::Int),
            (Num::Zero | Num::Int, b'.') => Some(Num::Dot),
            (Num::Dot | Num::Frac, b'0'..=b'9') => Some(Num::Frac),
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Some(Num::Exp),
            (Num::Exp, b'+' | b'-') => Some(Num::ExpSign),
            (Num::Exp | Num::ExpSign | Num::ExpDigits, b'0'..=b'9') => Some(Num::ExpDigits),
            _ => None,
        }
    }

    /// Whether the number may end here.
    pub(crate) fn may_end(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::ExpDigits)
    }
}

/// What one byte does inside a JSON string.
pub(crate) enum StrByte {
    /// The closing quote.
    Close,
    /// A byte of the content; `true` when it starts a character (an escape counts as one, at its backslash).
    Content(bool),
    Reject,
}

/// Feeds `b` to a string whose lexer stands at `esc` (after a backslash) and `hex` (hex digits left of a `\u`).
pub(crate) fn string_byte(esc: &mut bool, hex: &mut u8, b: u8) -> StrByte {
    if *hex > 0 {
        if !b.is_ascii_hexdigit() {
            return StrByte::Reject;
        }
        *hex -= 1;
        return StrByte::Content(false);
    }
    if *esc {
        *esc = false;
        return match b {
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => StrByte::Content(false),
            b'u' => {
                *hex = 4;
                StrByte::Content(false)
            }
            _ => StrByte::Reject,
        };
    }
    match b {
        b'"' => StrByte::Close,
        b'\\' => {
            *esc = true;
            StrByte::Content(true)
        }
        // Control characters must be escaped.
        0..=0x1f => StrByte::Reject,
        _ => StrByte::Content(b & 0xC0 != 0x80),
    }
}

const LITERALS: [&[u8]; 3] = [b"true", b"false", b"null"];

/// How far a byte prefix of one JSON object has come; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JsonState {
    mode: Mode,
    depth: u8,
    /// Bit `i`: level `i` is an object (else an array).
    objects: u64,
}

impl Default for JsonState {
    fn default() -> JsonState {
        JsonState::new()
    }
}

pub(crate) fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl JsonState {
    pub fn new() -> JsonState {
        JsonState { mode: Mode::Start, depth: 0, objects: 0 }
    }

    /// Whether the top-level object is complete: nothing but the end of generation may follow.
    pub fn is_done(&self) -> bool {
        self.mode == Mode::Done
    }

    /// Inside a string and not in an escape: any plain content fits ([`TokenTable::plain_chars`]).
    pub fn in_plain_string(&self) -> bool {
        matches!(self.mode, Mode::Str { esc: false, hex: 0, .. })
    }

    /// This state after `bytes`, or `None` when they leave the language (an empty slice is refused, since a token
    /// without text cannot advance an answer).
    pub fn accepts(mut self, bytes: &[u8]) -> Option<JsonState> {
        if bytes.is_empty() {
            return None;
        }
        for &b in bytes {
            if !self.step(b) {
                return None;
            }
        }
        Some(self)
    }

    fn in_object(&self) -> bool {
        self.depth > 0 && self.objects >> (self.depth - 1) & 1 == 1
    }

    fn open(&mut self, object: bool) -> bool {
        if self.depth >= MAX_DEPTH {
            return false;
        }
        if object {
            self.objects |= 1 << self.depth;
        } else {
            self.objects &= !(1 << self.depth);
        }
        self.depth += 1;
        self.mode = if object { Mode::KeyOrClose } else { Mode::ValueOrClose };
        true
    }

    fn close(&mut self, object: bool) -> bool {
        if self.depth == 0 || self.in_object() != object {
            return false;
        }
        self.depth -= 1;
        self.value_ended();
        true
    }

    fn value_ended(&mut self) {
        self.mode = if self.depth == 0 { Mode::Done } else { Mode::AfterValue };
    }

    /// The first byte of a value.
    fn start_value(&mut self, b: u8) -> bool {
        match b {
            b'{' => self.open(true),
            b'[' => self.open(false),
            b'"' => {
                self.mode = Mode::Str { key: false, esc: false, hex: 0 };
                true
            }
            _ if Num::start(b).is_some() => {
                self.mode = Mode::Num(Num::start(b).unwrap_or(Num::Int));
                true
            }
            _ => match LITERALS.iter().position(|l| l[0] == b) {
                Some(which) => {
                    self.mode = Mode::Lit { which: which as u8, at: 1 };
                    true
                }
                None => false,
            },
        }
    }

    fn step(&mut self, b: u8) -> bool {
        match self.mode {
            Mode::Start => is_ws(b) || (b == b'{' && self.open(true)),
            Mode::KeyOrClose | Mode::Key => match b {
                _ if is_ws(b) => true,
                b'"' => {
                    self.mode = Mode::Str { key: true, esc: false, hex: 0 };
                    true
                }
                b'}' if self.mode == Mode::KeyOrClose => self.close(true),
                _ => false,
            },
            Mode::Colon => match b {
                _ if is_ws(b) => true,
                b':' => {
                    self.mode = Mode::Value;
                    true
                }
                _ => false,
            },
            Mode::Value => is_ws(b) || self.start_value(b),
            Mode::ValueOrClose => is_ws(b) || (b == b']' && self.close(false)) || self.start_value(b),
            Mode::AfterValue => match b {
                _ if is_ws(b) => true,
                b',' => {
                    self.mode = if self.in_object() { Mode::Key } else { Mode::Value };
                    true
                }
                b'}' => self.close(true),
                b']' => self.close(false),
                _ => false,
            },
            Mode::Str { key, mut esc, mut hex } => match string_byte(&mut esc, &mut hex, b) {
                StrByte::Close if key => {
                    self.mode = Mode::Colon;
                    true
                }
                StrByte::Close => {
                    self.value_ended();
                    true
                }
                StrByte::Content(_) => {
                    self.mode = Mode::Str { key, esc, hex };
                    true
                }
                StrByte::Reject => false,
            },
            Mode::Num(n) => match n.next(b) {
                Some(n) => {
                    self.mode = Mode::Num(n);
                    true
                }
                // The number ends here if it may, and the byte belongs to what follows it.
                None if n.may_end() => {
                    self.value_ended();
                    self.step(b)
                }
                None => false,
            },
            Mode::Lit { which, at } => {
                let lit = LITERALS[which as usize];
                if lit.get(at as usize) != Some(&b) {
                    return false;
                }
                if at as usize + 1 == lit.len() {
                    self.value_ended();
                } else {
                    self.mode = Mode::Lit { which, at: at + 1 };
                }
                true
            }
            Mode::Done => false,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn longest_prefix_finds_the_longest_token_that_starts_the_bytes() {
        let t = TokenTable::new([&b"a"[..], b"ab", b"abc", b"", b"b", b"ab", b"xyz"]);
        assert_eq!(t.longest_prefix(b"abcd"), Some((2, 3)));
        assert_eq!(t.longest_prefix(b"abx"), Some((1, 2)), "the lowest id of equal tokens");
        assert_eq!(t.longest_prefix(b"xy"), None);
        assert_eq!(t.longest_prefix(b""), None);
        assert_eq!(t.longest_prefix(b"b"), Some((4, 1)));
        assert_eq!(t.starting_with(b'a').len(), 4);
        assert!(t.starting_with(b'q').is_empty());
    }

    use super::*;

    fn run(text: &str) -> Option<JsonState> {
        JsonState::new().accepts(text.as_bytes())
    }

    #[test]
    fn accepts_objects_byte_by_byte_and_knows_when_they_end() {
        let docs = [
            r#"{}"#,
            r#" { "a" : 1 } "#,
            r#"{"name": "Paris", "pop": 2.1e6, "capital": true, "parts": [1, -0.5, "x", null, {}, []], "n": {"d": {}}}"#,
            r#"{"esc": "a\"b\\c\/d\b\f\n\r\t\u00e9\uD83D\uDE00", "utf8": "日本 🦀"}"#,
            r#"{"z": 0, "e": 1E+2, "f": 0.0e-1, "big": -12345678901234567890}"#,
        ];
        for doc in docs {
            let trimmed = doc.trim_end();
            let mut s = JsonState::new();
            for (i, b) in trimmed.bytes().enumerate() {
                assert!(!s.is_done(), "{doc}: done early at {i}");
                s = s.accepts(&[b]).unwrap_or_else(|| panic!("{doc}: refused byte {i} ({:?})", b as char));
            }
            assert!(s.is_done(), "{doc}");
            assert!(s.accepts(b" ").is_none(), "nothing follows the object");
            assert_eq!(serde_json::from_str::<serde_json::Value>(doc).map(|v| v.is_object()).ok(), Some(true));
        }
    }

    #[test]
    fn refuses_what_is_not_an_object_prefix() {
        for bad in [
            "[1]",
            "\"x\"",
            "1",
            "{1",
            "{\"a\" 1}",
            "{\"a\":}",
            "{\"a\":1,}",
            "{\"a\":1]",
            "{\"a\":[1}",
            "{\"a\":01}",
            "{\"a\":-}",
            "{\"a\":1.}",
            "{\"a\":1e}",
            "{\"a\":tru}",
            "{\"a\":True}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u12G4\"}",
            "{\"a\":\"line\nbreak\"}",
            "{,}",
            "{}}",
            "{\"a\":1}x",
        ] {
            assert!(run(bad).is_none(), "{bad:?}");
        }
        assert!(run("{\"a\":\"x").is_some_and(|s| s.in_plain_string()));
        assert!(!run("{\"a\":\"x\\").unwrap().in_plain_string(), "an escape is not plain content");
        assert!(!run("{\"a\":").unwrap().in_plain_string());
        // Prefixes that can still go on are fine.
        for ok in [" ", "{", "{\"a", "{\"a\":", "{\"a\":1", "{\"a\":1.", "{\"a\":-", "{\"a\":tr", "{\"a\":\"\\u12"] {
            assert!(run(ok).is_some_and(|s| !s.is_done()), "{ok:?}");
        }
        assert!(JsonState::new().accepts(b"").is_none(), "a token with no bytes advances nothing");
    }

    #[test]
    fn nesting_is_bounded() {
        let deep = format!("{{\"a\":{}", "[".repeat(MAX_DEPTH as usize - 1));
        let s = run(&deep).expect("at the limit");
        assert!(s.accepts(b"[").is_none(), "one more level is refused");
        let closed = format!("{deep}{}}}", "]".repeat(MAX_DEPTH as usize - 1));
        assert!(run(&closed).is_some_and(|s| s.is_done()));
    }

    #[test]
    fn token_table_holds_each_tokens_bytes() {
        let t = TokenTable::new([&b"{"[..], b"", b"\"ab", "é日x".as_bytes(), b"a\\", b"\x80 "]);
        assert_eq!(
            (t.len(), t.bytes(0), t.bytes(1), t.bytes(2), t.bytes(6)),
            (6, &b"{"[..], &b""[..], &b"\"ab"[..], &b""[..])
        );
        // Plain string content, by characters: a quote, a backslash or nothing at all is not.
        let plain: Vec<Option<u32>> = (0..7).map(|i| t.plain_chars(i)).collect();
        assert_eq!(plain, [Some(1), None, None, Some(3), None, Some(1), None]);
    }
}
