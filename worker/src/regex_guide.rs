//! Constrained decoding to a regular expression: vLLM's `guided_regex`, `guided_choice` as the alternation of
//! its strings, and a JSON schema's string `pattern` and `format` ([`ByteDfa::compile_json_string`]).
//!
//! [`ByteDfa::compile`] has regex-automata build a dense DFA for the pattern (the `regex` crate's syntax, Unicode
//! classes included) and copies the part reachable from its anchored start into a table over the DFA's byte
//! classes. The whole answer must match, as vLLM's guides read a pattern: `\d{3}` is three digits, not text that
//! contains them. States from which no match can be reached any more are dropped while copying, so a byte that
//! [`ByteDfa::step`] accepts always leaves a way to a match in bytes. Whether a token spells it is another matter:
//! the vocabulary, or the request's `allowed_token_ids` or `bad_words`, may leave none, and the sampler then ends
//! the request with an error ([`crate::sampling::SampleError`]). The sampler feeds each token's bytes through the
//! table ([`crate::sampling`]); the table is a plain `Vec`, so feeding allocates nothing.
//!
//! A pattern with `\b` or `\B` guides to ASCII text only: a DFA decides a Unicode word boundary only for ASCII
//! bytes, so any other byte ends every match there.
//!
//! Bounds: a pattern is at most [`MAX_PATTERN_BYTES`], nests at most 64 deep, and its DFA may have at most
//! [`MAX_STATES`] states; anything larger, and any syntax error, is a [`RegexError`] that says so.

use std::collections::HashMap;

use regex_automata::dfa::{Automaton, StartKind, dense};
use regex_automata::nfa::thompson;
use regex_automata::util::{start, syntax};
use regex_automata::{Anchored, MatchKind};
use thiserror::Error;

/// Longest pattern a request may give (`guided_choice` counts as the alternation it becomes).
pub const MAX_PATTERN_BYTES: usize = 64 * 1024;
/// Most states a pattern's DFA may keep: the table is at most this many rows of one `u32` per byte class.
pub const MAX_STATES: usize = 4096;
/// Most strings one `guided_choice` may list.
pub const MAX_CHOICES: usize = 1024;
/// Deepest nesting of groups and repetitions in a pattern.
const NEST_LIMIT: u32 = 64;
/// The memory regex-automata may use while determinizing, and for the DFA.
const BUILD_BYTES: usize = 2 << 20;
/// The memory regex-automata may use for the NFA. With [`BUILD_BYTES`], this keeps the slowest refusal measured
/// (`(.{2,40}\d){1,5}`, which exceeds the DFA limit) at about 0.1 s here (`regex_compile_times` below). With 16 MiB
/// limits, `(.{2,40}\d){1,50}` took 4.2 s to be refused (one run of the same test against those limits); it now
/// fails at the NFA limit in about 1 ms.
const NFA_BYTES: usize = 256 << 10;

/// No match can be reached from here.
const DEAD: u32 = u32::MAX;

/// A pattern the guide cannot follow, and why.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct RegexError(pub String);

/// Where an answer stands in a [`ByteDfa`]: [`ByteDfa::start`], then what [`ByteDfa::step`] returns.
pub type RegexState = u32;

/// A compiled pattern: see the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ByteDfa {
    pattern: String,
    /// Each byte's class; bytes of one class move every state alike.
    classes: [u8; 256],
    stride: usize,
    /// `next[state * stride + class]`, or [`DEAD`].
    next: Vec<u32>,
    /// The bytes so far match the whole pattern.
    matches: Vec<bool>,
    /// Some byte leads on from here.
    continues: Vec<bool>,
    /// Whether each class's bytes start a character.
    starts_char: Vec<bool>,
}

impl ByteDfa {
    /// Compiles `pattern`, anchored at both ends.
    pub fn compile(pattern: &str) -> Result<ByteDfa, RegexError> {
        Self::compile_without(pattern, |_| false)
    }

    /// Compiles `pattern` for the inside of a JSON string written without escapes: a quote, a backslash or a
    /// control byte never fits, and states that would need one to reach a match are dropped with the rest, so a
    /// string guided by it can always be closed on a match. Refused when no match avoids them.
    pub fn compile_json_string(pattern: &str) -> Result<ByteDfa, RegexError> {
        Self::compile_without(pattern, |b| b == b'"' || b == b'\\' || b < 0x20).map_err(|e| {
            if e.0.contains("matches no text") {
                RegexError(format!("{} written in a JSON string without escapes", e.0))
            } else {
                e
            }
        })
    }

    /// [`ByteDfa::compile`] with every byte that `excluded` names refused everywhere.
    fn compile_without(pattern: &str, excluded: impl Fn(u8) -> bool) -> Result<ByteDfa, RegexError> {
        if pattern.len() > MAX_PATTERN_BYTES {
            return Err(RegexError(format!(
                "the pattern is {} bytes; at most {MAX_PATTERN_BYTES} are allowed",
                pattern.len()
            )));
        }
        let dfa = dense::Builder::new()
            .syntax(syntax::Config::new().nest_limit(NEST_LIMIT))
            .thompson(thompson::Config::new().nfa_size_limit(Some(NFA_BYTES)))
            .configure(
                dense::Config::new()
                    // Every way to match counts: with leftmost-first `a|ab` would give up on `ab` after `a`.
                    .match_kind(MatchKind::All)
                    .start_kind(StartKind::Anchored)
                    // `\b` in a DFA: exact on ASCII, and any other byte ends every match (see the module docs).
                    .unicode_word_boundary(true)
                    .dfa_size_limit(Some(BUILD_BYTES))
                    .determinize_size_limit(Some(BUILD_BYTES)),
            )
            .build(pattern)
            .map_err(|e| {
                let why = error_chain(&e);
                let hint =
                    if why.contains("exceeded") { " (the pattern's automaton is too large; simplify it)" } else { "" };
                RegexError(format!("the pattern does not compile: {why}{hint}"))
            })?;
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|e| RegexError(format!("the pattern has no start: {e}")))?;

        // The DFA's byte classes, split where `excluded` cuts one: a class is a DFA class and whether it is
        // excluded, numbered in byte order; `None` marks an excluded class's representative.
        let src_classes = dfa.byte_classes();
        let mut classes = [0u8; 256];
        // Classes are also split by whether their bytes start a character, so that a class's move adds a
        // character or does not (UTF-8 continuation bytes do not).
        let mut kinds: Vec<(u8, bool, bool)> = Vec::new();
        let mut representative: Vec<Option<u8>> = Vec::new();
        for b in 0..=255u8 {
            let kind = (src_classes.get(b), excluded(b), b & 0xC0 != 0x80);
            let c = match kinds.iter().position(|&k| k == kind) {
                Some(c) => c,
                None => {
                    kinds.push(kind);
                    representative.push((!kind.1).then_some(b));
                    kinds.len() - 1
                }
            };
            classes[b as usize] = c as u8;
        }
        let stride = representative.len();
        let starts_char = kinds.iter().map(|k| k.2).collect();

        // Breadth first from the start, numbering states as they are found (the start is 0).
        let mut ids = HashMap::from([(start, 0u32)]);
        let mut order = vec![start];
        let mut next = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let from = order[i];
            for &b in &representative {
                let Some(b) = b else {
                    next.push(DEAD);
                    continue;
                };
                let to = dfa.next_state(from, b);
                if dfa.is_dead_state(to) || dfa.is_quit_state(to) {
                    next.push(DEAD);
                    continue;
                }
                let id = match ids.get(&to) {
                    Some(&id) => id,
                    None => {
                        if order.len() >= MAX_STATES {
                            return Err(RegexError(format!(
                                "the pattern needs more than {MAX_STATES} automaton states; simplify it (bounded \
                                 repetitions such as `{{1,1000}}` multiply states)"
                            )));
                        }
                        let id = order.len() as u32;
                        ids.insert(to, id);
                        order.push(to);
                        id
                    }
                };
                next.push(id);
            }
            i += 1;
        }
        let matches: Vec<bool> = order.iter().map(|&s| dfa.is_match_state(dfa.next_eoi_state(s))).collect();

        // Keep only the states from which a match is reachable: walk the edges backwards from the matches.
        let n = order.len();
        let mut into: Vec<Vec<u32>> = vec![Vec::new(); n];
        for (edge, &to) in next.iter().enumerate() {
            if to != DEAD {
                into[to as usize].push((edge / stride) as u32);
            }
        }
        let mut live = matches.clone();
        let mut todo: Vec<u32> = (0..n as u32).filter(|&s| live[s as usize]).collect();
        while let Some(s) = todo.pop() {
            for &from in &into[s as usize] {
                if !live[from as usize] {
                    live[from as usize] = true;
                    todo.push(from);
                }
            }
        }
        if !live[0] {
            return Err(RegexError("the pattern matches no text".into()));
        }
        for to in next.iter_mut() {
            if *to != DEAD && !live[*to as usize] {
                *to = DEAD;
            }
        }
        let continues = next.chunks(stride).map(|row| row.iter().any(|&t| t != DEAD)).collect();
        Ok(ByteDfa { pattern: pattern.to_string(), classes, stride, next, matches, continues, starts_char })
    }

    /// The pattern that matches exactly one of `choices`, each taken literally (vLLM's `guided_choice`).
    pub fn choice_pattern(choices: &[String]) -> Result<String, RegexError> {
        if choices.is_empty() || choices.len() > MAX_CHOICES {
            return Err(RegexError(format!("give 1 to {MAX_CHOICES} choices, not {}", choices.len())));
        }
        if let Some(i) = choices.iter().position(String::is_empty) {
            return Err(RegexError(format!("choice {i} is empty")));
        }
        let pattern = choices.iter().map(|c| regex_syntax::escape(c)).collect::<Vec<_>>().join("|");
        if pattern.len() > MAX_PATTERN_BYTES {
            return Err(RegexError(format!("the choices come to more than {MAX_PATTERN_BYTES} bytes")));
        }
        Ok(pattern)
    }

    /// How many byte classes the table has.
    pub fn byte_classes(&self) -> usize {
        self.stride
    }

    /// Where each byte class leads from `state`, if anywhere: whether its bytes start a character, and the state
    /// after.
    pub fn moves(&self, state: RegexState) -> impl Iterator<Item = (bool, RegexState)> + '_ {
        let row = self.next.get(state as usize * self.stride..(state as usize + 1) * self.stride).unwrap_or_default();
        row.iter().zip(&self.starts_char).filter(|(to, _)| **to != DEAD).map(|(&to, &starts)| (starts, to))
    }

    /// How many states the table keeps.
    pub fn states(&self) -> usize {
        self.matches.len()
    }

    /// The pattern this was compiled from.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// The state before the answer's first byte.
    pub fn start(&self) -> RegexState {
        0
    }

    /// The state after `b`, or `None` when no match can follow it.
    pub fn step(&self, state: RegexState, b: u8) -> Option<RegexState> {
        let row = (state as usize).checked_mul(self.stride)?;
        let to = *self.next.get(row + self.classes[b as usize] as usize)?;
        (to != DEAD).then_some(to)
    }

    /// The state after `bytes`, or `None` when they leave every match behind (an empty slice is refused, since a
    /// token without text cannot advance an answer).
    pub fn feed(&self, state: RegexState, bytes: &[u8]) -> Option<RegexState> {
        if bytes.is_empty() {
            return None;
        }
        bytes.iter().try_fold(state, |s, &b| self.step(s, b))
    }

    /// Whether the bytes so far match the whole pattern, so that the answer may end here.
    pub fn is_match(&self, state: RegexState) -> bool {
        self.matches.get(state as usize).copied().unwrap_or(false)
    }

    /// Whether some byte may still follow.
    pub fn continues(&self, state: RegexState) -> bool {
        self.continues.get(state as usize).copied().unwrap_or(false)
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full_match(dfa: &ByteDfa, text: &str) -> bool {
        dfa.feed(dfa.start(), text.as_bytes()).is_some_and(|s| dfa.is_match(s))
    }

    #[test]
    fn the_whole_text_must_match() {
        let dfa = ByteDfa::compile(r"\d{3}-\d{4}").unwrap();
        assert!(full_match(&dfa, "555-1234"));
        for text in ["555-123", "a555-1234", "555-12345", "5551234"] {
            assert!(!full_match(&dfa, text), "{text}");
        }
        // A prefix of a match is live and not a match; a byte that leaves every match is refused at once.
        let s = dfa.feed(dfa.start(), b"555").unwrap();
        assert!(!dfa.is_match(s) && dfa.continues(s));
        assert_eq!(dfa.step(s, b'x'), None);
        let end = dfa.feed(dfa.start(), b"555-1234").unwrap();
        assert!(dfa.is_match(end) && !dfa.continues(end));
        assert_eq!(dfa.feed(dfa.start(), b""), None);
    }

    #[test]
    fn alternatives_that_prefix_one_another_all_match() {
        let dfa = ByteDfa::compile("a|ab|abc").unwrap();
        for text in ["a", "ab", "abc"] {
            assert!(full_match(&dfa, text), "{text}");
        }
        let s = dfa.feed(dfa.start(), b"ab").unwrap();
        assert!(dfa.is_match(s) && dfa.continues(s));
        // Anchors written out mean what they say at the ends.
        assert!(full_match(&ByteDfa::compile("^(yes|no)$").unwrap(), "no"));
    }

    #[test]
    fn states_that_cannot_reach_a_match_are_refused() {
        // `a` followed by `x` can never complete `a(b|c)d`, so `ax` is refused at `x`, not later.
        let dfa = ByteDfa::compile("a(b|c)d|q[^z]*z").unwrap();
        let a = dfa.feed(dfa.start(), b"a").unwrap();
        assert_eq!(dfa.step(a, b'x'), None);
        // A lookahead-free empty intersection: a class that excludes everything the rest needs.
        assert!(
            matches!(ByteDfa::compile("[a&&b]"), Err(RegexError(m)) if m.contains("does not compile") || m.contains("matches no text"))
        );
    }

    #[test]
    fn unicode_classes_walk_whole_characters() {
        let dfa = ByteDfa::compile(r"\p{Greek}{2}").unwrap();
        assert!(full_match(&dfa, "αβ"));
        assert!(!full_match(&dfa, "ab"));
        // The first byte of a two-byte character is a live prefix, not a match.
        let half = dfa.feed(dfa.start(), &"α".as_bytes()[..1]).unwrap();
        assert!(!dfa.is_match(half));
        // Bytes that are not UTF-8 are refused.
        assert_eq!(dfa.feed(dfa.start(), &[0xFF]), None);
    }

    #[test]
    fn bad_and_oversized_patterns_say_why() {
        let cases = [
            ("(unclosed".to_string(), "does not compile"),
            ("a".repeat(MAX_PATTERN_BYTES + 1), "at most"),
            (r"(a|b)*a(a|b){13}".to_string(), "automaton states"),
            (r"[a-z]{5000}".to_string(), "too large"),
            (r"(a|b)*a(a|b){24}".to_string(), "does not compile"),
            (r"(.{2,40}\d){1,5}".to_string(), "too large"),
            (r"(.{2,40}\d){1,50}".to_string(), "does not compile"),
            ("(".repeat(100) + &")".repeat(100), "does not compile"),
        ];
        for (pattern, why) in cases {
            match ByteDfa::compile(&pattern) {
                Err(RegexError(m)) => assert!(m.contains(why), "{}: {m}", &pattern[..pattern.len().min(40)]),
                Ok(_) => panic!("{} compiled", &pattern[..pattern.len().min(40)]),
            }
        }
    }

    #[test]
    fn word_boundaries_hold_on_ascii_text() {
        let dfa = ByteDfa::compile(r"\w+\b.*").unwrap();
        assert!(full_match(&dfa, "word, more"));
        assert!(!full_match(&dfa, "wörd"));
    }

    #[test]
    fn json_string_patterns_never_need_an_escape() {
        let dfa = ByteDfa::compile_json_string(r#"[a-z"\\]+|q\d"#).unwrap();
        assert!(full_match(&dfa, "abc") && full_match(&dfa, "q7"));
        for text in ["a\"b", "a\\b", "a\nb"] {
            assert!(!full_match(&dfa, text), "{text:?}");
        }
        // A pattern that needs a quote somewhere is cut back to what avoids it, or refused when nothing does.
        let dfa = ByteDfa::compile_json_string(r#"a("b|c)"#).unwrap();
        assert!(full_match(&dfa, "ac"));
        assert_eq!(dfa.step(dfa.feed(dfa.start(), b"a").unwrap(), b'"'), None);
        let e = ByteDfa::compile_json_string(r#"say "hi""#).unwrap_err();
        assert!(e.0.contains("without escapes"), "{e}");
        // Byte classes that straddle an excluded byte are split: `[ -~]` holds both the quote and plain text.
        let dfa = ByteDfa::compile_json_string("[ -~]{2}").unwrap();
        assert!(full_match(&dfa, "a!") && !full_match(&dfa, "a\""));
    }

    /// A random pattern over `a`, `b` and digits, at most `depth` deep.
    fn random_pattern(rng: &mut rand::rngs::StdRng, depth: u32) -> String {
        use rand::Rng;
        let atom =
            |rng: &mut rand::rngs::StdRng| ["a", "b", "1", "[ab]", "[^a]", ".", r"\d", "ab"][rng.random_range(0..8)];
        if depth == 0 {
            return atom(rng).to_string();
        }
        match rng.random_range(0..6) {
            0 => format!("{}{}", random_pattern(rng, depth - 1), random_pattern(rng, depth - 1)),
            1 => format!("(?:{}|{})", random_pattern(rng, depth - 1), random_pattern(rng, depth - 1)),
            2 => format!("(?:{})*", random_pattern(rng, depth - 1)),
            3 => format!("(?:{})?", random_pattern(rng, depth - 1)),
            4 => format!("(?:{}){{1,3}}", random_pattern(rng, depth - 1)),
            _ => atom(rng).to_string(),
        }
    }

    #[test]
    fn the_table_agrees_with_the_regex_crate_and_never_cuts_a_live_prefix() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        let alphabet = [b'a', b'b', b'1', b'\n'];
        for _ in 0..300 {
            let pattern = random_pattern(&mut rng, 4);
            let dfa = ByteDfa::compile(&pattern).unwrap();
            let reference = regex_automata::meta::Regex::new(&format!("^(?:{pattern})$")).unwrap();
            for _ in 0..40 {
                let len = rng.random_range(0..8);
                let text: Vec<u8> = (0..len).map(|_| alphabet[rng.random_range(0..4)]).collect();
                let state = dfa.feed(dfa.start(), &text);
                let matched = state.is_some_and(|s| dfa.is_match(s)) || (text.is_empty() && dfa.is_match(dfa.start()));
                assert_eq!(matched, reference.is_match(&text), "{pattern} on {:?}", String::from_utf8_lossy(&text));
                // A refused prefix has no match among its extensions (up to three bytes here).
                if state.is_none() && !text.is_empty() {
                    for ext in 0..(1 + 4 + 16 + 64) {
                        let mut longer = text.clone();
                        let (mut k, mut n) = (ext, 0);
                        while k > 0 && n < 3 {
                            longer.push(alphabet[(k - 1) % 4]);
                            k = (k - 1) / 4;
                            n += 1;
                        }
                        assert!(
                            !reference.is_match(&longer),
                            "{pattern}: {:?} was cut",
                            String::from_utf8_lossy(&text)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn choices_are_literal_strings() {
        let pattern = ByteDfa::choice_pattern(&["a.b".into(), "(x)".into(), "yes".into()]).unwrap();
        let dfa = ByteDfa::compile(&pattern).unwrap();
        for text in ["a.b", "(x)", "yes"] {
            assert!(full_match(&dfa, text), "{text}");
        }
        for text in ["axb", "x", "ye", "yess"] {
            assert!(!full_match(&dfa, text), "{text}");
        }
        assert!(ByteDfa::choice_pattern(&[]).is_err());
        assert!(ByteDfa::choice_pattern(&["a".into(), String::new()]).unwrap_err().0.contains("choice 1 is empty"));
        assert!(ByteDfa::choice_pattern(&vec!["x".to_string(); MAX_CHOICES + 1]).is_err());
    }
}

/// How long compiling takes at the bounds (the numbers in this module's docs and ARCHITECTURE.md):
/// `cargo test --release -p pagoda-worker --lib regex_compile_times -- --ignored --nocapture`.
#[cfg(test)]
#[test]
#[ignore = "timing; prints, asserts only the outcomes"]
fn regex_compile_times() {
    for (pattern, compiles) in [
        (r"(.{2,40}\d){1,5}", false),
        (r"(.{2,40}\d){1,50}", false),
        (r"(a|b)*a(a|b){13}", false),
        (r".{1,200}x", true),
        (r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]+([.][A-Za-z0-9-]+)*[.][A-Za-z]{2,}", true),
    ] {
        let t = std::time::Instant::now();
        let r = ByteDfa::compile(pattern);
        eprintln!(
            "{pattern}: {:?}, {}",
            t.elapsed(),
            r.as_ref().map_or_else(|e| e.0.clone(), |d| format!("{} states", d.states()))
        );
        assert_eq!(r.is_ok(), compiles, "{pattern}");
    }
}
