//! Incremental detokenisation and stop strings.
//!
//! [`Utf8Decoder`] turns a stream of token byte strings into text without ever splitting a UTF-8 sequence: an
//! incomplete trailing sequence is held back until the bytes that complete it arrive. [`StopMatcher`] checks stop
//! strings on the decoded text and holds back any suffix that could still become a stop string, so text that is
//! emitted never has to be taken back.

/// Byte-to-text decoder that holds back incomplete UTF-8 sequences.
#[derive(Debug, Default)]
pub struct Utf8Decoder {
    pending: Vec<u8>,
}

impl Utf8Decoder {
    pub fn new() -> Utf8Decoder {
        Utf8Decoder::default()
    }

    /// Appends `bytes` and returns the text that is now complete. Invalid sequences become U+FFFD.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Safe: from_utf8 vouched for these bytes.
                    out.push_str(std::str::from_utf8(&self.pending[start..start + valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start += valid + n;
                        }
                        None => {
                            // Incomplete sequence at the end: keep it for the next push.
                            start += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Bytes held back, waiting for the rest of their sequence.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Ends the stream: whatever is held back is emitted lossily.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// What [`StopMatcher::push`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text safe to emit now; generation goes on.
    Continue(String),
    /// A stop string matched: emit this text (everything before the stop string) and stop.
    Stopped(String),
}

/// Finds stop strings in streamed text.
#[derive(Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
    /// Index in `stops` of the stop string that matched.
    matched: Option<usize>,
    /// vLLM's `include_stop_str_in_output`: the matched stop string ends the emitted text instead of being cut.
    include_stop: bool,
}

impl StopMatcher {
    /// `stops` must not contain empty strings (validation rejects them).
    pub fn new(stops: Vec<String>) -> StopMatcher {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        StopMatcher { stops, held: String::new(), stopped: false, matched: None, include_stop: false }
    }

    /// Whether the matched stop string stays at the end of the text (vLLM's `include_stop_str_in_output`).
    pub fn keeping_stop(mut self, keep: bool) -> StopMatcher {
        self.include_stop = keep;
        self
    }

    /// The stop string that stopped the text, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// Feeds newly decoded text.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stopped {
            return StopOutcome::Stopped(String::new());
        }
        self.held.push_str(text);
        if self.stops.is_empty() {
            return StopOutcome::Continue(std::mem::take(&mut self.held));
        }
        // Earliest match wins; on a tie, the longest stop string (which only matters when it is kept).
        let first = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|pos| (pos, std::cmp::Reverse(s.len()), i)))
            .min();
        if let Some((pos, std::cmp::Reverse(len), i)) = first {
            self.stopped = true;
            self.matched = Some(i);
            let end = if self.include_stop { pos + len } else { pos };
            let out = self.held[..end].to_string();
            self.held.clear();
            return StopOutcome::Stopped(out);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            let max = (s.len() - 1).min(self.held.len());
            for k in (hold + 1..=max).rev() {
                let tail = &self.held.as_bytes()[self.held.len() - k..];
                if s.as_bytes().starts_with(tail) {
                    hold = k;
                    break;
                }
            }
        }
        let cut = self.held.len() - hold;
        // A suffix equal to a stop-string prefix starts on a char boundary (it starts with a lead byte).
        debug_assert!(self.held.is_char_boundary(cut));
        let rest = self.held.split_off(cut);
        StopOutcome::Continue(std::mem::replace(&mut self.held, rest))
    }

    /// Ends the stream without a match: the held-back text is emitted.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_split_sequences_are_held_back() {
        let text = "héllo wörld — 日本語 🦀!";
        let bytes = text.as_bytes();
        // Every split into one-byte pieces must reproduce the text, and never emit a partial character.
        let mut d = Utf8Decoder::new();
        let mut out = String::new();
        for b in bytes {
            let piece = d.push(std::slice::from_ref(b));
            assert!(!piece.contains(char::REPLACEMENT_CHARACTER));
            out.push_str(&piece);
        }
        out.push_str(&d.finish());
        assert_eq!(out, text);
        // The crab emoji is 4 bytes: 3 of them are held.
        let mut d = Utf8Decoder::new();
        let crab = "🦀".as_bytes();
        assert_eq!(d.push(&crab[..3]), "");
        assert_eq!(d.pending_len(), 3);
        assert_eq!(d.push(&crab[3..]), "🦀");
    }

    #[test]
    fn utf8_invalid_bytes_become_replacement() {
        let mut d = Utf8Decoder::new();
        assert_eq!(d.push(b"a\xffb"), "a\u{fffd}b");
        assert_eq!(d.push(b"\xe6\x97"), "");
        assert_eq!(d.finish(), "\u{fffd}");
    }

    #[test]
    fn stop_string_across_pieces() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("hello E"), StopOutcome::Continue("hello ".into()));
        assert_eq!(m.push("N"), StopOutcome::Continue(String::new()));
        assert_eq!(m.push("D and more"), StopOutcome::Stopped(String::new()));
    }

    #[test]
    fn stop_false_start_is_released() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("EN"), StopOutcome::Continue(String::new()));
        assert_eq!(m.push("x"), StopOutcome::Continue("ENx".into()));
        assert_eq!(m.push("E"), StopOutcome::Continue(String::new()));
        assert_eq!(m.finish(), "E");
    }

    #[test]
    fn earliest_of_several_stops() {
        let mut m = StopMatcher::new(vec!["world".into(), "o w".into()]);
        assert_eq!(m.push("hello world"), StopOutcome::Stopped("hell".into()));
        assert_eq!(m.matched(), Some("o w"), "the stop that matched is the one reported");
        let mut m = StopMatcher::new(vec!["\n\n".into(), "User:".into()]);
        assert_eq!(m.push("Paris.\n"), StopOutcome::Continue("Paris.".into()));
        assert_eq!(m.matched(), None);
        assert_eq!(m.push("\nUser: hi"), StopOutcome::Stopped(String::new()));
        assert_eq!(m.matched(), Some("\n\n"));
    }

    #[test]
    fn stop_string_kept_when_asked() {
        let mut m = StopMatcher::new(vec!["END".into(), "EN".into()]).keeping_stop(true);
        assert_eq!(m.push("hello E"), StopOutcome::Continue("hello ".into()));
        assert_eq!(m.push("ND and more"), StopOutcome::Stopped("END".into()));
        let mut m = StopMatcher::new(vec!["o w".into()]).keeping_stop(true);
        assert_eq!(m.push("hello world"), StopOutcome::Stopped("hello w".into()));
    }

    #[test]
    fn multibyte_stop_strings() {
        let mut m = StopMatcher::new(vec!["日本".into()]);
        assert_eq!(m.push("abc日"), StopOutcome::Continue("abc".into()));
        assert_eq!(m.push("本語"), StopOutcome::Stopped(String::new()));
    }

    #[test]
    fn no_stops_passes_through() {
        let mut m = StopMatcher::new(vec![]);
        assert_eq!(m.push("abc"), StopOutcome::Continue("abc".into()));
        assert_eq!(m.finish(), "");
    }
}
