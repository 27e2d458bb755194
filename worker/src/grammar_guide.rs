//! Constrained decoding to a context-free grammar: vLLM's `structured_outputs.grammar` (and its older
//! `guided_grammar`), in the EBNF that xgrammar and llama.cpp's GBNF read.
//!
//! [`Grammar::compile`] parses `name ::= ...` rules of quoted literals, character classes (`[a-z]`, `[^"\\]`),
//! `.` (any character), rule references, groups, alternation and the `*`, `+`, `?`, `{m}`, `{m,}` and `{m,n}`
//! repetitions; `#` starts a comment; `root` is the start. It lowers them to productions over bytes: a literal
//! becomes its UTF-8 bytes and a character class the UTF-8 byte sequences of its ranges (regex-syntax's
//! `Utf8Sequences`), so a token that ends inside a character is followed like any other. A repetition becomes a
//! left-recursive rule (`R ::= ε | R x`), which the recognizer follows in constant work per byte.
//!
//! [`GrammarState`] is an Earley recognizer (with Aycock and Horspool's rule for nullable symbols): one Earley set
//! per byte of the answer, all kept in one flat vector that grows and shrinks like a stack. Trying a token
//! ([`GrammarState::fits`]) pushes its bytes and pops them again, and allocates nothing once warm. Every rule must
//! be able to finish (checked when compiling), so a byte the grammar accepts always leaves a way to a complete
//! answer in the grammar; the work bounds below may still refuse every byte of that way (see Bounds).
//! [`GrammarState::token_mask`] tries the whole
//! vocabulary in byte order, sharing the sets of common prefixes and skipping every token under a prefix that
//! failed. [`MaskCache`] keeps the masks of the last few states, keyed by everything a byte could read from them
//! ([`GrammarState::signature`]): inside a string or a repeated character class the answer comes back to the same
//! key step after step, and a sampled step then tests a bit per token.
//!
//! Bounds: the text is at most [`MAX_GRAMMAR_BYTES`], its lowered form at most [`MAX_SYMBOLS`] symbols, a
//! repetition count at most [`MAX_REPEAT`], and groups nest at most [`MAX_NESTING`] deep; anything else is a
//! [`GrammarError`] that says where. An ambiguous grammar can make an Earley set's work grow with the answer, so
//! the work is bounded too: a byte whose set would take more than [`MAX_WORK_PER_BYTE`] item steps is refused,
//! as is any byte once the answer's sets hold [`MAX_CHART_ITEMS`] items, and a token mask stops trying tokens
//! after [`MAX_MASK_WORK`] steps (the tokens left untried do not fit). Refusing never lets a byte through that
//! the grammar refuses, but it can refuse every byte the grammar allows next, so an answer in a highly ambiguous
//! grammar can paint itself into a corner (`s ::= s s | "a" | "b"` under `root ::= s "b"` does after a few hundred
//! bytes): [`GrammarState::stalled_by_work_bound`] tells that dead end apart, and the sampler ends the request
//! with an error there rather than cutting the answer short. A right-recursive rule (`chars ::= char chars | ""`)
//! costs work per byte in proportion to how far it has run; `char*` does not.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use regex_syntax::utf8::Utf8Sequences;
use thiserror::Error;

use crate::json_guide::TokenTable;

/// Longest grammar text a request may give.
pub const MAX_GRAMMAR_BYTES: usize = 64 * 1024;
/// Most symbols the lowered grammar may hold, over all its productions.
pub const MAX_SYMBOLS: usize = 64 * 1024;
/// Largest count in a `{m,n}` repetition.
pub const MAX_REPEAT: u32 = 1024;
/// Deepest nesting of groups.
pub const MAX_NESTING: usize = 64;
/// Most item steps (an item added, or one looked at while completing) one byte's Earley set may take.
pub const MAX_WORK_PER_BYTE: usize = 64 * 1024;
/// Most items the sets of one answer may hold together (12 bytes each).
pub const MAX_CHART_ITEMS: usize = 1 << 20;
/// Most item steps one [`GrammarState::token_mask`] may take: tens of milliseconds here.
pub const MAX_MASK_WORK: usize = 16 << 20;
/// Longest [`GrammarState::signature`] (in `u32`s) a [`MaskCache`] keys a mask by; a state with a longer one has
/// its mask computed afresh.
pub const MAX_SIGNATURE: usize = 4096;
/// How many masks a [`MaskCache`] keeps.
const CACHED_MASKS: usize = 16;

/// A grammar the guide cannot follow, and why.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

/// 256 bits, one per byte value.
type ByteSet = [u64; 4];

fn contains(set: &ByteSet, b: u8) -> bool {
    set[(b >> 6) as usize] >> (b & 63) & 1 == 1
}

fn insert_range(set: &mut ByteSet, lo: u8, hi: u8) {
    for b in lo..=hi {
        set[(b >> 6) as usize] |= 1 << (b & 63);
    }
}

/// One symbol of a production: a byte from a set, or a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Sym {
    Bytes(u32),
    Rule(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Production {
    lhs: u32,
    start: u32,
    len: u32,
}

/// A compiled grammar: see the module docs.
#[derive(Clone, PartialEq, Eq)]
pub struct Grammar {
    byte_sets: Vec<ByteSet>,
    symbols: Vec<Sym>,
    productions: Vec<Production>,
    /// Rule `r`'s productions are `productions[rule_prods[r]..rule_prods[r + 1]]`.
    rule_prods: Vec<u32>,
    nullable: Vec<bool>,
    root: u32,
    /// The first Earley set: `root`'s productions and what they predict.
    start_items: Vec<Item>,
    start_meta: SetMeta,
}

/// An Earley item: production, how much of it has been matched, and the set it started in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Item {
    prod: u32,
    dot: u32,
    origin: u32,
}

/// One Earley set's place in [`GrammarState::items`], whether the whole answer may end there, and the bytes that
/// may come next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SetMeta {
    start: u32,
    end: u32,
    accepts: bool,
    next: ByteSet,
}

impl std::fmt::Debug for Grammar {
    /// A summary: the lowered form runs to thousands of symbols, and requests are logged.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("rules", &(self.rule_prods.len() - 1))
            .field("productions", &self.productions.len())
            .field("symbols", &self.symbols.len())
            .finish()
    }
}

impl Grammar {
    /// Parses and lowers `text`; see the module docs for the syntax and the bounds.
    pub fn compile(text: &str) -> Result<Grammar, GrammarError> {
        if text.len() > MAX_GRAMMAR_BYTES {
            return Err(GrammarError(format!(
                "the grammar is {} bytes; at most {MAX_GRAMMAR_BYTES} are allowed",
                text.len()
            )));
        }
        let mut parser = Parser { src: text, pos: 0, lowered: Lowered::default() };
        parser.grammar()?;
        parser.lowered.finish()
    }

    fn next_sym(&self, it: Item) -> Option<Sym> {
        let p = self.productions[it.prod as usize];
        (it.dot < p.len).then(|| self.symbols[(p.start + it.dot) as usize])
    }

    fn prods_of(&self, rule: u32) -> std::ops::Range<u32> {
        self.rule_prods[rule as usize]..self.rule_prods[rule as usize + 1]
    }

    /// A recognizer at the start of an answer.
    pub fn start(&self) -> GrammarState {
        let mut seen = ItemSet::default();
        for &it in &self.start_items {
            seen.insert(self.key(it));
        }
        GrammarState {
            items: self.start_items.clone(),
            sets: vec![self.start_meta],
            seen,
            scratch: MaskScratch::default(),
            committed: 0,
        }
    }

    /// An item's identity: its place among all productions' positions, and its origin.
    fn key(&self, it: Item) -> u64 {
        let p = self.productions[it.prod as usize];
        (u64::from(p.start + it.dot + it.prod) << 32) | u64::from(it.origin)
    }
}

/// Where an answer stands in a [`Grammar`]: see the module docs.
#[derive(Debug, Clone)]
pub struct GrammarState {
    /// Every set's items, set after set.
    items: Vec<Item>,
    sets: Vec<SetMeta>,
    /// The items of the set being built, for de-duplication (reused).
    seen: ItemSet,
    /// Scratch for [`GrammarState::token_mask`].
    scratch: MaskScratch,
    /// The sets below this one keep only the items a later byte can read ([`GrammarState::commit`]).
    committed: usize,
}

/// What [`GrammarState::token_mask`] reuses from one call to the next.
#[derive(Debug, Clone, Default)]
struct MaskScratch {
    /// Signatures and the sets they reached, for [`GrammarState::loop_bytes`].
    keys: [Vec<u32>; 3],
    /// The signature after a first byte, and the sets it reached.
    first: [Vec<u32>; 2],
    /// The loop bytes of each signature met after a first byte in this call; `memo_len` of them are current.
    memo: Vec<(Vec<u32>, ByteSet)>,
}

impl GrammarState {
    /// Whether the answer so far is a whole sentence of the grammar.
    pub fn may_end(&self) -> bool {
        self.top().accepts
    }

    /// Whether any byte may follow.
    pub fn continues(&self) -> bool {
        self.top().next.iter().any(|&w| w != 0)
    }

    /// Whether `b` may follow (as far as the last set's expectations tell; [`GrammarState::fits`] decides).
    pub fn may_start_with(&self, b: u8) -> bool {
        contains(&self.top().next, b)
    }

    /// The one byte that may follow, if exactly one may.
    pub fn only_next_byte(&self) -> Option<u8> {
        let next = self.top().next;
        let count: u32 = next.iter().map(|w| w.count_ones()).sum();
        let word = next.iter().position(|&w| w != 0)?;
        (count == 1).then(|| (word * 64) as u8 + next[word].trailing_zeros() as u8)
    }

    /// Goes back to the answer's first `len` bytes (no further than where it is, nor than the last
    /// [`GrammarState::commit`]).
    pub fn rewind(&mut self, len: usize) {
        self.truncate(len + 1);
    }

    /// Makes the answer so far final: every set below the last keeps only its items that expect a rule, the only
    /// ones a later byte reads (a completion looks for them; bytes are scanned from the last set alone, and a
    /// completed item is never read again). For an answer that a JSON grammar guides, that is about a fifth of
    /// the items. The state can no longer go back before here.
    pub fn commit(&mut self, g: &Grammar) {
        let top = self.sets.len() - 1;
        if self.committed >= top {
            return;
        }
        let mut write = self.sets[self.committed].start as usize;
        for k in self.committed..=top {
            let (start, end) = (self.sets[k].start as usize, self.sets[k].end as usize);
            self.sets[k].start = write as u32;
            for i in start..end {
                let it = self.items[i];
                if k == top || matches!(g.next_sym(it), Some(Sym::Rule(_))) {
                    self.items[write] = it;
                    write += 1;
                }
            }
            self.sets[k].end = write as u32;
        }
        self.items.truncate(write);
        self.committed = top;
    }

    /// Whether the grammar allows more bytes here but the work bounds ([`MAX_WORK_PER_BYTE`], [`MAX_CHART_ITEMS`])
    /// refuse every one of them: a dead end of the recognizer, not of the grammar. The state is unchanged.
    pub fn stalled_by_work_bound(&mut self, g: &Grammar) -> bool {
        let next = self.top().next;
        let depth = self.sets.len();
        // Every byte in `next` is scanned by some item of the last set, so `push_byte` refuses one only for the
        // bounds: a state that continues and takes none of them is stalled by work alone.
        let mut allowed = (0..=255u8).filter(|&b| contains(&next, b)).peekable();
        allowed.peek().is_some()
            && allowed.all(|b| {
                let mut budget = MAX_WORK_PER_BYTE;
                let fed = self.push_byte(g, b, &mut budget);
                self.truncate(depth);
                !fed
            })
    }

    /// How many Earley items the answer's sets hold (its memory, at 12 bytes each).
    pub fn chart_items(&self) -> usize {
        self.items.len()
    }

    /// How many bytes the answer has.
    pub fn len(&self) -> usize {
        self.sets.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn top(&self) -> &SetMeta {
        // `sets` always holds the first set.
        &self.sets[self.sets.len() - 1]
    }

    /// Moves past `bytes` if they all fit; returns whether they did (if not, the state is unchanged).
    pub fn feed(&mut self, g: &Grammar, bytes: &[u8]) -> bool {
        let depth = self.sets.len();
        for &b in bytes {
            let mut budget = MAX_WORK_PER_BYTE;
            if !self.push_byte(g, b, &mut budget) {
                self.truncate(depth);
                return false;
            }
        }
        true
    }

    /// Whether `bytes` may come next; the state is unchanged.
    pub fn fits(&mut self, g: &Grammar, bytes: &[u8]) -> bool {
        let depth = self.sets.len();
        let ok = self.feed(g, bytes);
        self.truncate(depth);
        ok
    }

    /// Sets bit `t` of `bits` for every non-empty token `t` of `tokens` that may come next, and clears the others.
    ///
    /// The *loop bytes* of a state are those after which it has the same [`GrammarState::signature`] as before (a
    /// string's plain characters, a number's further digits): a run of them fits without being fed, since each
    /// leaves a state that behaves exactly like the one before it. So for each first byte that fits, the mask
    /// finds the loop bytes of the state after it (once per distinct signature), and a token whose other bytes
    /// are all among them fits unfed. It feeds the rest, in [`TokenTable::by_bytes`] order, so that tokens
    /// sharing a prefix share its sets, and only under first bytes that fit. Past [`MAX_MASK_WORK`], the tokens
    /// not fed yet stay cleared.
    pub fn token_mask(&mut self, g: &Grammar, tokens: &TokenTable, bits: &mut Vec<u64>) {
        bits.clear();
        bits.resize(tokens.len().div_ceil(64), 0);
        let base = self.sets.len();
        let next = self.top().next;
        // For each first byte that fits: the loop bytes after it (empty when its state has no signature).
        let mut after_first = [[0u64; 4]; 256];
        let mut fits_first: ByteSet = [0; 4];
        let mut memo = std::mem::take(&mut self.scratch.memo);
        let [mut key, mut reached] = std::mem::take(&mut self.scratch.first);
        let mut memo_len = 0;
        for b0 in (0..=255u8).filter(|&b| contains(&next, b)) {
            let mut budget = MAX_WORK_PER_BYTE;
            if !self.push_byte(g, b0, &mut budget) {
                continue;
            }
            insert_range(&mut fits_first, b0, b0);
            if self.signature(g, &mut key, &mut reached) {
                after_first[usize::from(b0)] = match memo[..memo_len].iter().find(|e| e.0 == key) {
                    Some(e) => e.1,
                    None => {
                        let loops = self.loop_bytes(g);
                        if memo_len == memo.len() {
                            memo.push((Vec::new(), [0; 4]));
                        }
                        memo[memo_len].0.clone_from(&key);
                        memo[memo_len].1 = loops;
                        memo_len += 1;
                        loops
                    }
                };
            }
            self.truncate(base);
        }
        self.scratch.memo = memo;
        self.scratch.first = [key, reached];

        let mut prev: &[u8] = &[];
        // How many of `prev`'s bytes are pushed, and whether the next one failed.
        let mut pushed = 0;
        let mut failed = false;
        let mut work = MAX_MASK_WORK;
        for b0 in (0..=255u8).filter(|&b| contains(&fits_first, b)) {
            let loops = after_first[usize::from(b0)];
            for i in tokens.starting_with(b0) {
                let t = tokens.by_bytes()[i];
                let later = tokens.later_bytes(i);
                if later.iter().zip(&loops).all(|(&l, &ok)| l & !ok == 0) {
                    bits[t as usize / 64] |= 1 << (t % 64);
                    continue;
                }
                let b = tokens.bytes(t);
                if work == 0 {
                    continue;
                }
                let common = prev.iter().zip(b).take_while(|(x, y)| x == y).count();
                prev = b;
                if failed && common > pushed {
                    // It starts with the prefix that failed.
                    continue;
                }
                let keep = common.min(pushed);
                self.truncate(base + keep);
                pushed = keep;
                failed = false;
                for &c in &b[keep..] {
                    let mut budget = MAX_WORK_PER_BYTE.min(work);
                    let ok = self.push_byte(g, c, &mut budget);
                    work -= MAX_WORK_PER_BYTE.min(work) - budget;
                    if !ok {
                        failed = true;
                        break;
                    }
                    pushed += 1;
                }
                if !failed {
                    bits[t as usize / 64] |= 1 << (t % 64);
                }
            }
        }
        self.truncate(base);
    }

    /// The bytes that fit and lead back to a state with this one's signature (none when it has none).
    fn loop_bytes(&mut self, g: &Grammar) -> ByteSet {
        let mut loops = [0; 4];
        let [mut key, mut after, mut reached] = std::mem::take(&mut self.scratch.keys);
        if self.signature(g, &mut key, &mut reached) {
            let depth = self.sets.len();
            let next = self.top().next;
            for b in (0..=255u8).filter(|&b| contains(&next, b)) {
                let mut budget = MAX_WORK_PER_BYTE;
                if self.push_byte(g, b, &mut budget) {
                    if self.signature_is(g, &key, &mut after, &mut reached) {
                        insert_range(&mut loops, b, b);
                    }
                    self.truncate(depth);
                }
            }
        }
        self.scratch.keys = [key, after, reached];
        loops
    }

    /// Writes into `out` a key of everything pushing bytes from here can read: the items of the last set that
    /// still expect a symbol, and, transitively through their origins, the items of earlier sets that expect a
    /// rule (the only ones a completion looks for), with origins renumbered in order of discovery. Completed
    /// items are never read again, nor are earlier sets' items that expect a byte, and leaving them out is what
    /// lets a repetition come back to the same key. Two states with equal keys accept exactly the same byte
    /// sequences (near the [`MAX_CHART_ITEMS`] bound a longer answer may refuse sooner, so no key is given
    /// there). Returns false, with `out` unspecified, past [`MAX_SIGNATURE`].
    pub fn signature(&self, g: &Grammar, out: &mut Vec<u32>, reached: &mut Vec<u32>) -> bool {
        self.build_signature(g, out, reached, None)
    }

    /// Whether this state's [`GrammarState::signature`] is `key`: it builds the signature into `out` and stops at
    /// the first difference.
    fn signature_is(&self, g: &Grammar, key: &[u32], out: &mut Vec<u32>, reached: &mut Vec<u32>) -> bool {
        self.build_signature(g, out, reached, Some(key))
    }

    /// [`GrammarState::signature`], compared with `key` as it is built when one is given.
    fn build_signature(&self, g: &Grammar, out: &mut Vec<u32>, reached: &mut Vec<u32>, key: Option<&[u32]>) -> bool {
        out.clear();
        reached.clear();
        if self.items.len() > MAX_CHART_ITEMS / 2 {
            return false;
        }
        let differs = |out: &[u32], from: usize| key.is_some_and(|k| k.get(from..out.len()) != Some(&out[from..]));
        reached.push(self.sets.len() as u32 - 1);
        let mut next = 0;
        while next < reached.len() {
            let set = self.sets[reached[next] as usize];
            let top = next == 0;
            next += 1;
            // Where this set's items start in `out`, so that their count can go before them.
            let at = out.len();
            out.push(0);
            for &it in &self.items[set.start as usize..set.end as usize] {
                match g.next_sym(it) {
                    None => continue,
                    Some(Sym::Bytes(_)) if !top => continue,
                    _ => {}
                }
                out[at] += 1;
                let id = match reached.iter().position(|&r| r == it.origin) {
                    Some(id) => id,
                    None => {
                        reached.push(it.origin);
                        reached.len() - 1
                    }
                };
                let from = out.len();
                out.extend([it.prod, it.dot, id as u32]);
                if out.len() > MAX_SIGNATURE || differs(out, from) {
                    return false;
                }
            }
            // The set's count, now complete, with its items.
            if differs(out, at) {
                return false;
            }
        }
        key.is_none_or(|k| k.len() == out.len())
    }

    /// Keeps the first `depth` sets (never fewer than the last commit left).
    fn truncate(&mut self, depth: usize) {
        self.sets.truncate(depth.max(self.committed + 1));
        let end = self.top().end as usize;
        self.items.truncate(end);
    }

    /// Scans `b` from the last set into a new one and closes it; false (and nothing pushed) if `b` does not fit,
    /// or the set would take more than `budget` steps (which it counts down) or outgrow [`MAX_CHART_ITEMS`].
    fn push_byte(&mut self, g: &Grammar, b: u8, budget: &mut usize) -> bool {
        let cur = *self.top();
        if !contains(&cur.next, b) {
            return false;
        }
        let index = self.sets.len() as u32;
        let start = self.items.len();
        self.seen.clear();
        for i in cur.start as usize..cur.end as usize {
            let it = self.items[i];
            if let Some(Sym::Bytes(s)) = g.next_sym(it)
                && contains(&g.byte_sets[s as usize], b)
            {
                let next = Item { dot: it.dot + 1, ..it };
                if self.seen.insert(g.key(next)) {
                    self.items.push(next);
                }
            }
        }
        let room = MAX_CHART_ITEMS.saturating_sub(start);
        match close(g, &mut self.items, &self.sets, &mut self.seen, index, start, budget, room) {
            Some(meta) => {
                self.sets.push(meta);
                true
            }
            None => {
                self.items.truncate(start);
                false
            }
        }
    }
}

/// The token masks of the last [`CACHED_MASKS`] grammar states a sampled step started from, by their
/// [`GrammarState::signature`]. Masks and keys are allocated when first needed and reused after.
#[derive(Debug, Clone, Default)]
pub struct MaskCache {
    entries: Vec<(Vec<u32>, Vec<u64>)>,
    /// The entry to replace next once all are in use.
    next: usize,
    key: Vec<u32>,
    reached: Vec<u32>,
    /// The mask of a state without a key.
    uncached: Vec<u64>,
}

impl MaskCache {
    /// Bit `t` set for every token `t` that may come next from `state` ([`GrammarState::token_mask`]).
    pub fn mask(&mut self, g: &Grammar, state: &mut GrammarState, tokens: &TokenTable) -> &[u64] {
        if !state.signature(g, &mut self.key, &mut self.reached) {
            state.token_mask(g, tokens, &mut self.uncached);
            return &self.uncached;
        }
        if let Some(i) = self.entries.iter().position(|e| e.0 == self.key) {
            return &self.entries[i].1;
        }
        let i = if self.entries.len() < CACHED_MASKS {
            self.entries.push((Vec::new(), Vec::new()));
            self.entries.len() - 1
        } else {
            let i = self.next;
            self.next = (i + 1) % CACHED_MASKS;
            i
        };
        let (key, bits) = &mut self.entries[i];
        key.clone_from(&self.key);
        state.token_mask(g, tokens, bits);
        bits
    }
}

/// Predicts and completes the items of set `index` (which start at `items[start]` and are all in `seen`) until
/// nothing new comes, and returns the set's summary; `None` once it has taken `budget` steps (counted down) or
/// holds more than `room` items.
#[allow(clippy::too_many_arguments)]
fn close(
    g: &Grammar,
    items: &mut Vec<Item>,
    sets: &[SetMeta],
    seen: &mut ItemSet,
    index: u32,
    start: usize,
    budget: &mut usize,
    room: usize,
) -> Option<SetMeta> {
    let mut add = |items: &mut Vec<Item>, it: Item| {
        if seen.insert(g.key(it)) {
            items.push(it);
        }
    };
    let mut i = start;
    while i < items.len() {
        let steps = items.len() - start;
        if steps > room || *budget == 0 {
            return None;
        }
        *budget -= 1;
        let it = items[i];
        i += 1;
        match g.next_sym(it) {
            Some(Sym::Rule(r)) => {
                for prod in g.prods_of(r) {
                    add(items, Item { prod, dot: 0, origin: index });
                }
                // Aycock and Horspool: a nullable rule may be skipped right away, so completing an empty match
                // never has to look back into the set being built.
                if g.nullable[r as usize] {
                    add(items, Item { dot: it.dot + 1, ..it });
                }
            }
            Some(Sym::Bytes(_)) => {}
            None if it.origin == index => {}
            None => {
                let lhs = g.productions[it.prod as usize].lhs;
                let from = sets[it.origin as usize];
                let waiting = (from.end - from.start) as usize;
                if *budget < waiting {
                    *budget = 0;
                    return None;
                }
                *budget -= waiting;
                for k in from.start as usize..from.end as usize {
                    let w = items[k];
                    if g.next_sym(w) == Some(Sym::Rule(lhs)) {
                        add(items, Item { dot: w.dot + 1, ..w });
                    }
                }
            }
        }
    }
    let mut meta = SetMeta { start: start as u32, end: items.len() as u32, accepts: false, next: [0; 4] };
    for it in &items[start..] {
        match g.next_sym(*it) {
            Some(Sym::Bytes(s)) => {
                for (w, x) in meta.next.iter_mut().zip(g.byte_sets[s as usize]) {
                    *w |= x;
                }
            }
            Some(Sym::Rule(_)) => {}
            None => meta.accepts |= it.origin == 0 && g.productions[it.prod as usize].lhs == g.root,
        }
    }
    Some(meta)
}

/// A multiply-and-fold hash for item keys: the de-duplication set is on the per-byte path.
#[derive(Default, Clone, Copy)]
struct ItemHasher(u64);

impl Hasher for ItemHasher {
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type ItemSet = HashSet<u64, BuildHasherDefault<ItemHasher>>;

/// The grammar as the parser builds it: rules as alternatives of symbol sequences.
#[derive(Default)]
struct Lowered {
    byte_sets: Vec<ByteSet>,
    set_ids: HashMap<ByteSet, u32>,
    /// Each rule's alternatives; `None` until a named rule is defined.
    rules: Vec<Option<Vec<Vec<Sym>>>>,
    /// Each rule's name (anonymous rules: the named rule they were made in, for messages).
    names: Vec<String>,
    named: HashMap<String, u32>,
    /// Character classes already lowered, by their ranges.
    classes: HashMap<Vec<(u32, u32)>, Vec<Sym>>,
    symbols: usize,
}

impl Lowered {
    fn byte_set(&mut self, set: ByteSet) -> Sym {
        let next = self.byte_sets.len() as u32;
        let id = *self.set_ids.entry(set).or_insert(next);
        if id == next {
            self.byte_sets.push(set);
        }
        Sym::Bytes(id)
    }

    fn named_rule(&mut self, name: &str) -> u32 {
        if let Some(&r) = self.named.get(name) {
            return r;
        }
        let r = self.rules.len() as u32;
        self.rules.push(None);
        self.names.push(name.to_string());
        self.named.insert(name.to_string(), r);
        r
    }

    fn count(&mut self, n: usize) -> Result<(), GrammarError> {
        self.symbols += n;
        if self.symbols > MAX_SYMBOLS {
            return Err(GrammarError(format!(
                "the grammar lowers to more than {MAX_SYMBOLS} symbols; simplify it or lower its repetition counts"
            )));
        }
        Ok(())
    }

    fn anonymous(&mut self, within: &str, alternatives: Vec<Vec<Sym>>) -> Result<Sym, GrammarError> {
        self.count(alternatives.iter().map(Vec::len).sum::<usize>() + 1)?;
        let r = self.rules.len() as u32;
        self.rules.push(Some(alternatives));
        self.names.push(within.to_string());
        Ok(Sym::Rule(r))
    }

    /// A sequence as one symbol.
    fn single(&mut self, within: &str, seq: Vec<Sym>) -> Result<Sym, GrammarError> {
        match seq.as_slice() {
            [one] => Ok(*one),
            _ => self.anonymous(within, vec![seq]),
        }
    }

    /// The sequence that matches one character of the (sorted, merged) `ranges` of code points.
    fn class(&mut self, within: &str, ranges: Vec<(u32, u32)>) -> Result<Vec<Sym>, GrammarError> {
        if let Some(seq) = self.classes.get(&ranges) {
            return Ok(seq.clone());
        }
        let mut single: ByteSet = [0; 4];
        let mut longer: Vec<Vec<ByteSet>> = Vec::new();
        for &(lo, hi) in &ranges {
            let (Some(lo), Some(hi)) = (char_at_or_after(lo), char_at_or_before(hi)) else { continue };
            if lo > hi {
                continue;
            }
            for seq in Utf8Sequences::new(lo, hi) {
                match seq.as_slice() {
                    [r] => insert_range(&mut single, r.start, r.end),
                    rs => longer.push(
                        rs.iter()
                            .map(|r| {
                                let mut s = [0; 4];
                                insert_range(&mut s, r.start, r.end);
                                s
                            })
                            .collect(),
                    ),
                }
            }
        }
        let mut alternatives = Vec::new();
        if single != [0; 4] {
            alternatives.push(vec![self.byte_set(single)]);
        }
        for seq in longer {
            let syms = seq.into_iter().map(|s| self.byte_set(s)).collect();
            alternatives.push(syms);
        }
        let seq = match alternatives.len() {
            0 => return Err(GrammarError(format!("a character class in rule `{within}` matches no character"))),
            1 => alternatives.remove(0),
            _ => vec![self.anonymous(within, alternatives)?],
        };
        self.classes.insert(ranges, seq.clone());
        Ok(seq)
    }

    fn finish(self) -> Result<Grammar, GrammarError> {
        let Some(&root) = self.named.get("root") else {
            return Err(GrammarError("the grammar has no `root` rule, where every answer starts".into()));
        };
        let mut rules = Vec::with_capacity(self.rules.len());
        for (r, alts) in self.rules.into_iter().enumerate() {
            match alts {
                Some(a) => rules.push(a),
                None => return Err(GrammarError(format!("rule `{}` is used but never defined", self.names[r]))),
            }
        }
        // A rule is productive when one of its alternatives is made of terminals and productive rules only.
        let mut productive = vec![false; rules.len()];
        let mut nullable = vec![false; rules.len()];
        loop {
            let mut changed = false;
            for (r, alts) in rules.iter().enumerate() {
                let sym_ok = |s: &Sym, by: &[bool]| match s {
                    Sym::Bytes(_) => true,
                    Sym::Rule(x) => by[*x as usize],
                };
                if !productive[r] && alts.iter().any(|a| a.iter().all(|s| sym_ok(s, &productive))) {
                    productive[r] = true;
                    changed = true;
                }
                let null_ok = |s: &Sym| matches!(s, Sym::Rule(x) if nullable[*x as usize]);
                if !nullable[r] && alts.iter().any(|a| a.iter().all(null_ok)) {
                    nullable[r] = true;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        // Name a rule that loops on itself where there is one: the others never finish only because they need it.
        let loops = |r: usize| rules[r].iter().flatten().any(|&s| s == Sym::Rule(r as u32));
        let stuck = (0..rules.len()).filter(|&r| !productive[r]);
        if let Some(r) = stuck.clone().find(|&r| loops(r)).or(stuck.min()) {
            return Err(GrammarError(format!(
                "rule `{}` can never finish: each of its alternatives needs itself or another rule that never finishes",
                self.names[r]
            )));
        }
        let mut g = Grammar {
            byte_sets: self.byte_sets,
            symbols: Vec::with_capacity(self.symbols),
            productions: Vec::new(),
            rule_prods: vec![0],
            nullable,
            root,
            start_items: Vec::new(),
            start_meta: SetMeta { start: 0, end: 0, accepts: false, next: [0; 4] },
        };
        for (lhs, alts) in rules.into_iter().enumerate() {
            for alt in alts {
                g.productions.push(Production {
                    lhs: lhs as u32,
                    start: g.symbols.len() as u32,
                    len: alt.len() as u32,
                });
                g.symbols.extend(alt);
            }
            g.rule_prods.push(g.productions.len() as u32);
        }
        let mut items = Vec::new();
        let mut seen = ItemSet::default();
        for prod in g.prods_of(root) {
            let it = Item { prod, dot: 0, origin: 0 };
            seen.insert(g.key(it));
            items.push(it);
        }
        let mut budget = MAX_WORK_PER_BYTE;
        let Some(meta) = close(&g, &mut items, &[], &mut seen, 0, 0, &mut budget, MAX_CHART_ITEMS) else {
            return Err(GrammarError(format!(
                "the grammar's first step takes more than {MAX_WORK_PER_BYTE} parser steps"
            )));
        };
        g.start_items = items;
        g.start_meta = meta;
        Ok(g)
    }
}

fn char_at_or_after(mut c: u32) -> Option<char> {
    if (0xD800..0xE000).contains(&c) {
        c = 0xE000;
    }
    char::from_u32(c)
}

fn char_at_or_before(mut c: u32) -> Option<char> {
    if (0xD800..0xE000).contains(&c) {
        c = 0xD7FF;
    }
    char::from_u32(c.min(0x10FFFF))
}

/// The largest code point.
const MAX_CHAR: u32 = 0x10FFFF;

/// A recursive-descent parser over the grammar text.
struct Parser<'a> {
    src: &'a str,
    pos: usize,
    lowered: Lowered,
}

impl Parser<'_> {
    fn error(&self, what: impl std::fmt::Display) -> GrammarError {
        let before = &self.src[..self.pos.min(self.src.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        GrammarError(format!("line {line}, column {column}: {what}"))
    }

    fn peek(&self) -> Option<char> {
        self.src[self.pos..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn eat(&mut self, s: &str) -> bool {
        if self.src[self.pos..].starts_with(s) {
            self.pos += s.len();
            true
        } else {
            false
        }
    }

    /// Skips blanks, line ends and `#` comments.
    fn skip_space(&mut self) {
        loop {
            match self.peek() {
                Some(c) if c.is_whitespace() => {
                    self.bump();
                }
                Some('#') => {
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.bump();
                    }
                }
                _ => return,
            }
        }
    }

    fn is_name_char(c: char) -> bool {
        c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.'
    }

    fn name(&mut self) -> Option<&str> {
        let start = self.pos;
        while self.peek().is_some_and(Self::is_name_char) {
            self.bump();
        }
        (self.pos > start).then(|| &self.src[start..self.pos])
    }

    /// Whether a rule definition (`name ::=`) starts here.
    fn at_definition(&mut self) -> bool {
        let at = self.pos;
        let found = self.name().is_some() && {
            self.skip_space();
            self.src[self.pos..].starts_with("::=")
        };
        self.pos = at;
        found
    }

    fn grammar(&mut self) -> Result<(), GrammarError> {
        self.skip_space();
        while self.pos < self.src.len() {
            let Some(name) = self.name().map(str::to_string) else {
                return Err(self.error("expected a rule name"));
            };
            self.skip_space();
            if !self.eat("::=") {
                return Err(self.error(format!("expected `::=` after the rule name `{name}`")));
            }
            let rule = self.lowered.named_rule(&name);
            if self.lowered.rules[rule as usize].is_some() {
                return Err(self.error(format!("rule `{name}` is defined twice")));
            }
            let alternatives = self.alternatives(&name, 0)?;
            self.lowered.count(alternatives.iter().map(Vec::len).sum::<usize>() + 1)?;
            self.lowered.rules[rule as usize] = Some(alternatives);
            self.skip_space();
        }
        Ok(())
    }

    fn alternatives(&mut self, rule: &str, depth: usize) -> Result<Vec<Vec<Sym>>, GrammarError> {
        let mut alternatives = vec![self.sequence(rule, depth)?];
        loop {
            self.skip_space();
            if !self.eat("|") {
                return Ok(alternatives);
            }
            alternatives.push(self.sequence(rule, depth)?);
        }
    }

    fn sequence(&mut self, rule: &str, depth: usize) -> Result<Vec<Sym>, GrammarError> {
        let mut seq = Vec::new();
        loop {
            self.skip_space();
            match self.peek() {
                None | Some('|') | Some(')') => return Ok(seq),
                _ if self.at_definition() => return Ok(seq),
                _ => {}
            }
            let mut item = self.primary(rule, depth)?;
            loop {
                self.skip_space();
                let (lo, hi) = match self.peek() {
                    Some('*') => (0, None),
                    Some('+') => (1, None),
                    Some('?') => (0, Some(1)),
                    Some('{') => {
                        self.bump();
                        let (lo, hi) = self.counts()?;
                        self.pos -= 1; // the `}` that `bump` below takes
                        (lo, hi)
                    }
                    _ => break,
                };
                self.bump();
                item = self.repeat(rule, item, lo, hi)?;
            }
            if seq.len() + item.len() > MAX_SYMBOLS {
                return Err(self.error("a sequence this long is more than the grammar may lower to"));
            }
            seq.extend(item);
        }
    }

    /// `m}`, `m,}` or `m,n}` after a `{`; leaves the position after the `}`.
    fn counts(&mut self) -> Result<(u32, Option<u32>), GrammarError> {
        let number = |p: &mut Self| -> Result<Option<u32>, GrammarError> {
            p.skip_space();
            let start = p.pos;
            while p.peek().is_some_and(|c| c.is_ascii_digit()) {
                p.bump();
            }
            if p.pos == start {
                return Ok(None);
            }
            match p.src[start..p.pos].parse::<u32>() {
                Ok(n) if n <= MAX_REPEAT => Ok(Some(n)),
                _ => Err(p.error(format!("a repetition count is at most {MAX_REPEAT}"))),
            }
        };
        let Some(lo) = number(self)? else {
            return Err(self.error("expected a count after `{`"));
        };
        self.skip_space();
        let hi = if self.eat(",") {
            let hi = number(self)?;
            if hi.is_some_and(|h| h < lo) {
                return Err(self.error(format!("`{{{lo},{}}}` counts down", hi.unwrap_or(0))));
            }
            hi
        } else {
            Some(lo)
        };
        self.skip_space();
        if !self.eat("}") {
            return Err(self.error("expected `}` to close the repetition"));
        }
        Ok((lo, hi))
    }

    /// `item` repeated `lo` to `hi` (unbounded: `None`) times.
    fn repeat(&mut self, rule: &str, item: Vec<Sym>, lo: u32, hi: Option<u32>) -> Result<Vec<Sym>, GrammarError> {
        let l = &mut self.lowered;
        let x = l.single(rule, item)?;
        let mut seq = vec![x; lo as usize];
        l.count(seq.len())?;
        match hi {
            None => {
                // R ::= ε | R x: left recursion, which Earley follows in constant work per repetition.
                let r = l.rules.len() as u32;
                let star = l.anonymous(rule, vec![vec![], vec![Sym::Rule(r), x]])?;
                seq.push(star);
            }
            Some(hi) if hi > lo => {
                // T1 ::= ε | x, Tk ::= ε | x T(k-1).
                let mut tail = l.anonymous(rule, vec![vec![], vec![x]])?;
                for _ in 1..hi - lo {
                    tail = l.anonymous(rule, vec![vec![], vec![x, tail]])?;
                }
                seq.push(tail);
            }
            Some(_) => {}
        }
        Ok(seq)
    }

    fn primary(&mut self, rule: &str, depth: usize) -> Result<Vec<Sym>, GrammarError> {
        match self.peek() {
            Some('"') => {
                self.bump();
                let mut bytes = Vec::new();
                loop {
                    let c = match self.bump() {
                        None => return Err(self.error("the literal is never closed with `\"`")),
                        Some('"') => break,
                        Some('\\') => self.escape()?,
                        Some(c) => c,
                    };
                    let mut buf = [0u8; 4];
                    bytes.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
                self.lowered.count(bytes.len())?;
                Ok(bytes
                    .into_iter()
                    .map(|b| {
                        let mut s = [0; 4];
                        insert_range(&mut s, b, b);
                        self.lowered.byte_set(s)
                    })
                    .collect())
            }
            Some('[') => {
                self.bump();
                let negated = self.eat("^");
                let mut ranges = Vec::new();
                loop {
                    let lo = match self.bump() {
                        None => return Err(self.error("the character class is never closed with `]`")),
                        Some(']') => break,
                        Some('\\') => self.escape()?,
                        Some(c) => c,
                    };
                    let hi = if self.peek() == Some('-') && !self.src[self.pos + 1..].starts_with(']') {
                        self.bump();
                        match self.bump() {
                            None => return Err(self.error("the character class is never closed with `]`")),
                            Some('\\') => self.escape()?,
                            Some(c) => c,
                        }
                    } else {
                        lo
                    };
                    if hi < lo {
                        return Err(self.error(format!("the range `{lo}-{hi}` runs backwards")));
                    }
                    ranges.push((lo as u32, hi as u32));
                }
                let ranges = normalize(ranges, negated);
                self.lowered.class(rule, ranges)
            }
            Some('.') => {
                self.bump();
                self.lowered.class(rule, vec![(0, MAX_CHAR)])
            }
            Some('(') => {
                if depth >= MAX_NESTING {
                    return Err(self.error(format!("groups nest more than {MAX_NESTING} deep")));
                }
                self.bump();
                let mut alternatives = self.alternatives(rule, depth + 1)?;
                self.skip_space();
                if !self.eat(")") {
                    return Err(self.error("expected `)` to close the group"));
                }
                if alternatives.len() == 1 {
                    Ok(alternatives.remove(0))
                } else {
                    Ok(vec![self.lowered.anonymous(rule, alternatives)?])
                }
            }
            Some(c) if Self::is_name_char(c) => {
                let name = self.name().unwrap_or_default().to_string();
                Ok(vec![Sym::Rule(self.lowered.named_rule(&name))])
            }
            Some(c) => Err(self.error(format!("unexpected `{c}`"))),
            None => Err(self.error("unexpected end of the grammar")),
        }
    }

    /// The character after a `\`.
    fn escape(&mut self) -> Result<char, GrammarError> {
        let hex = |p: &mut Self, digits: usize| -> Result<char, GrammarError> {
            let start = p.pos;
            for _ in 0..digits {
                if !p.peek().is_some_and(|c| c.is_ascii_hexdigit()) {
                    return Err(p.error(format!("expected {digits} hexadecimal digits")));
                }
                p.bump();
            }
            u32::from_str_radix(&p.src[start..p.pos], 16)
                .ok()
                .and_then(char::from_u32)
                .ok_or_else(|| p.error("the escape names no character"))
        };
        match self.bump() {
            Some('n') => Ok('\n'),
            Some('r') => Ok('\r'),
            Some('t') => Ok('\t'),
            Some('x') => hex(self, 2),
            Some('u') => hex(self, 4),
            Some('U') => hex(self, 8),
            Some(c @ ('\\' | '"' | '[' | ']' | '-' | '^' | '/' | '.' | '\'')) => Ok(c),
            Some(c) => Err(self.error(format!("unknown escape `\\{c}`"))),
            None => Err(self.error("unexpected end after `\\`")),
        }
    }
}

/// Sorted, merged ranges of code points; their complement over all characters when `negated`.
fn normalize(mut ranges: Vec<(u32, u32)>, negated: bool) -> Vec<(u32, u32)> {
    ranges.sort_unstable();
    let mut merged: Vec<(u32, u32)> = Vec::with_capacity(ranges.len());
    for (lo, hi) in ranges {
        match merged.last_mut() {
            Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
            _ => merged.push((lo, hi)),
        }
    }
    if !negated {
        return merged;
    }
    let mut out = Vec::with_capacity(merged.len() + 1);
    let mut next = 0u32;
    for (lo, hi) in merged {
        if lo > next {
            out.push((next, lo - 1));
        }
        next = hi + 1;
    }
    if next <= MAX_CHAR {
        out.push((next, MAX_CHAR));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn accepts(g: &Grammar, text: &str) -> bool {
        let mut s = g.start();
        s.feed(g, text.as_bytes()) && s.may_end()
    }

    fn prefix_ok(g: &Grammar, text: &[u8]) -> bool {
        g.start().feed(g, text)
    }

    #[test]
    fn literals_alternatives_and_references() {
        let g = Grammar::compile(
            r#"
            # a greeting
            root ::= greeting " " name
            greeting ::= "hello" | "hi"
            name ::= "world" | "pagoda"
            "#,
        )
        .unwrap();
        for ok in ["hello world", "hi pagoda", "hi world"] {
            assert!(accepts(&g, ok), "{ok}");
        }
        for bad in ["hello", "hey world", "hi  world", "hi worlds", ""] {
            assert!(!accepts(&g, bad), "{bad}");
        }
        assert!(prefix_ok(&g, b"hel"));
        assert!(!prefix_ok(&g, b"hex"));
    }

    /// Balanced brackets: a language no regular expression describes, checked against counting.
    #[test]
    fn balanced_brackets_match_a_counter_on_every_short_string() {
        let g = Grammar::compile(r#"root ::= item*  item ::= "(" root ")" | "[" root "]""#).unwrap();
        let alphabet = [b'(', b')', b'[', b']', b'x'];
        let balanced = |s: &[u8]| {
            let mut stack = Vec::new();
            for &c in s {
                match c {
                    b'(' | b'[' => stack.push(c),
                    b')' if stack.pop() == Some(b'(') => {}
                    b']' if stack.pop() == Some(b'[') => {}
                    _ => return None,
                }
            }
            Some(stack.is_empty())
        };
        for len in 0..=7u32 {
            for n in 0..alphabet.len().pow(len) {
                let mut k = n;
                let s: Vec<u8> = (0..len)
                    .map(|_| {
                        let c = alphabet[k % alphabet.len()];
                        k /= alphabet.len();
                        c
                    })
                    .collect();
                let mut st = g.start();
                let fed = st.feed(&g, &s);
                // A prefix is viable exactly when no bracket closes wrongly.
                assert_eq!(fed, balanced(&s).is_some(), "{:?}", String::from_utf8_lossy(&s));
                assert_eq!(fed && st.may_end(), balanced(&s) == Some(true), "{:?}", String::from_utf8_lossy(&s));
            }
        }
    }

    #[test]
    fn character_classes_dot_and_utf8_split_across_tokens() {
        let g = Grammar::compile(r#"root ::= [a-cé] [^a-z\n]+ ."#).unwrap();
        assert!(accepts(&g, "aXY!"));
        assert!(accepts(&g, "éΩ€z"));
        assert!(!accepts(&g, "da!x"));
        assert!(!accepts(&g, "aa!x"));
        assert!(!accepts(&g, "a\n!x"));
        // 'é' is two bytes: its first alone is a viable prefix, a wrong second byte is not.
        let e = "é".as_bytes();
        assert!(prefix_ok(&g, &e[..1]));
        assert!(!prefix_ok(&g, &[e[0], b'a']));
        // '€' is three bytes, fed one at a time.
        let mut s = g.start();
        assert!(s.feed(&g, b"a"));
        for &b in "€".as_bytes() {
            assert!(s.feed(&g, &[b]));
        }
        assert!(!s.may_end());
        assert!(s.feed(&g, b"q") && s.may_end());
    }

    #[test]
    fn repetition_counts() {
        let g = Grammar::compile(r#"root ::= "a"{2,4} "b"{3} "c"{1,} "d"?"#).unwrap();
        assert!(accepts(&g, "aabbbc"));
        assert!(accepts(&g, "aaaabbbcccd"));
        assert!(!accepts(&g, "abbbc"));
        assert!(!accepts(&g, "aaaaabbbc"));
        assert!(!accepts(&g, "aabbc"));
        assert!(!accepts(&g, "aabbb"));
        assert!(!accepts(&g, "aabbbcdd"));
        let g = Grammar::compile(r#"root ::= ("x" | "yz"){0,2}"#).unwrap();
        for ok in ["", "x", "yz", "xyz", "yzyz", "xx"] {
            assert!(accepts(&g, ok), "{ok}");
        }
        assert!(!accepts(&g, "xxx"));
    }

    /// Arithmetic: left recursion, nullable rules and nesting.
    const EXPRESSIONS: &str = r#"
        root   ::= ws expr ws
        expr   ::= expr ws [+-] ws term | term
        term   ::= term ws [*/] ws factor | factor
        factor ::= num | "(" ws expr ws ")" | "-" factor
        num    ::= [0-9]+ ("." [0-9]+)?
        ws     ::= [ ]*
    "#;

    /// An arithmetic grammar with left recursion, nullable rules and nesting, against random expressions.
    #[test]
    fn an_expression_grammar_accepts_what_it_generates_and_refuses_mutations() {
        let g = Grammar::compile(EXPRESSIONS).unwrap();
        let mut rng = StdRng::seed_from_u64(7);
        fn expression(rng: &mut StdRng, depth: u32, out: &mut String) {
            match if depth > 3 { 0 } else { rng.random_range(0..4) } {
                0 => out.push_str(&rng.random_range(0..1000).to_string()),
                1 => {
                    out.push('(');
                    expression(rng, depth + 1, out);
                    out.push(')');
                }
                2 => {
                    out.push('-');
                    expression(rng, depth + 1, out);
                }
                _ => {
                    expression(rng, depth + 1, out);
                    out.push_str([" + ", "*", " / ", "-"][rng.random_range(0..4)]);
                    expression(rng, depth + 1, out);
                }
            }
        }
        for _ in 0..300 {
            let mut e = String::new();
            expression(&mut rng, 0, &mut e);
            assert!(accepts(&g, &e), "{e}");
            assert!(!accepts(&g, &format!("{e})")), "{e})");
            assert!(!accepts(&g, &format!("{e}+")), "{e}+");
        }
    }

    /// Following random accepted bytes always leaves a way to finish: a walk that ends when the grammar allows
    /// stays inside the language.
    #[test]
    fn random_walks_over_accepted_bytes_always_reach_a_complete_answer() {
        let g = Grammar::compile(
            r#"
            root ::= "{" ws pair (ws "," ws pair)* ws "}"
            pair ::= key ws ":" ws value
            key ::= "\"" [a-z]{1,8} "\""
            value ::= [0-9]{1,3} | "true" | "false" | root
            ws ::= [ \t]{0,2}
            "#,
        )
        .unwrap();
        let mut rng = StdRng::seed_from_u64(11);
        for _ in 0..200 {
            let mut s = g.start();
            let mut text = Vec::new();
            for step in 0..400 {
                if s.may_end() && (step > 60 || rng.random_bool(0.3)) {
                    break;
                }
                let choices: Vec<u8> = (0..=255u8).filter(|&b| s.clone().feed(&g, &[b])).collect();
                assert!(!choices.is_empty() || s.may_end(), "stuck after {:?}", String::from_utf8_lossy(&text));
                if choices.is_empty() {
                    break;
                }
                // Prefer closing once long, so walks finish.
                let b = if step > 40 && choices.contains(&b'}') {
                    b'}'
                } else {
                    choices[rng.random_range(0..choices.len())]
                };
                assert!(s.may_start_with(b));
                assert!(s.feed(&g, &[b]));
                text.push(b);
            }
            // Finish by the shortest route: closing braces and digits.
            while !s.may_end() {
                let b = [b'}', b'1', b'"', b'a', b':', b','].into_iter().find(|&b| s.clone().feed(&g, &[b])).unwrap();
                assert!(s.feed(&g, &[b]));
                text.push(b);
            }
            assert!(accepts(&g, std::str::from_utf8(&text).unwrap()));
        }
    }

    /// A committed answer accepts exactly what an uncommitted one does, and keeps fewer items.
    #[test]
    fn committing_keeps_what_later_bytes_read() {
        let g = Grammar::compile(EXPRESSIONS).unwrap();
        let mut rng = StdRng::seed_from_u64(23);
        for _ in 0..100 {
            let (mut kept, mut whole) = (g.start(), g.start());
            for _ in 0..60 {
                let fitting: Vec<u8> = (0..=255u8).filter(|&b| whole.fits(&g, &[b])).collect();
                let committed: Vec<u8> = (0..=255u8).filter(|&b| kept.fits(&g, &[b])).collect();
                assert_eq!(committed, fitting);
                assert_eq!(kept.may_end(), whole.may_end());
                let Some(&b) = fitting.get(rng.random_range(0..fitting.len().max(1))) else { break };
                assert!(whole.feed(&g, &[b]) && kept.feed(&g, &[b]));
                kept.commit(&g);
            }
            assert!(kept.items.len() < whole.items.len(), "{} against {}", kept.items.len(), whole.items.len());
            // A failed feed after a commit leaves the committed answer whole.
            let len = kept.len();
            assert!(!kept.feed(&g, b"))))x"));
            assert_eq!(kept.len(), len);
        }
    }

    #[test]
    fn fits_and_failed_feeds_leave_the_state_unchanged() {
        let g = Grammar::compile(r#"root ::= "ab" [0-9]* "c""#).unwrap();
        let mut s = g.start();
        assert!(s.feed(&g, b"ab1"));
        assert!(s.fits(&g, b"23c"));
        assert!(!s.fits(&g, b"2x"));
        assert!(!s.feed(&g, b"4c5"));
        assert_eq!(s.len(), 3);
        assert!(s.feed(&g, b"c") && s.may_end() && !s.continues());
    }

    /// The mask matches trying every token on its own, over a vocabulary with shared prefixes, duplicates, empty
    /// tokens and split UTF-8.
    #[test]
    fn token_masks_match_trying_every_token() {
        let g = Grammar::compile(r#"root ::= ("ab" | "a" [0-9]+ | "é" | "b"+ " ")* "!""#).unwrap();
        let words: Vec<&[u8]> = vec![
            b"a",
            b"ab",
            b"abc",
            b"a1",
            b"a12",
            b"1",
            b"12",
            b"b",
            b"bb",
            b"b ",
            b" ",
            b"!",
            b"!!",
            b"",
            b"ab",
            &[0xC3],
            &[0xA9],
            &[0xC3, 0xA9],
            b"\xC3\xA9a",
            b"z",
        ];
        let table = TokenTable::new(words.iter().copied());
        let mut rng = StdRng::seed_from_u64(3);
        let mut s = g.start();
        let mut bits = Vec::new();
        for _ in 0..60 {
            s.token_mask(&g, &table, &mut bits);
            let mut allowed = Vec::new();
            for (t, w) in words.iter().enumerate() {
                let fits = !w.is_empty() && s.clone().feed(&g, w);
                assert_eq!(bits[t / 64] >> (t % 64) & 1 == 1, fits, "token {:?} after {} bytes", w, s.len());
                if fits {
                    allowed.push(t);
                }
            }
            if allowed.is_empty() {
                break;
            }
            let t = allowed[rng.random_range(0..allowed.len())];
            assert!(s.feed(&g, words[t]));
        }
    }

    /// Cached masks equal fresh ones along random walks, and a repeated character class comes back to one key.
    #[test]
    fn cached_masks_match_fresh_ones_and_repeats_share_a_key() {
        let g = Grammar::compile(
            r#"
            root ::= "[" (item ("," item)*)? "]"
            item ::= "\"" [a-z ]* "\"" | [0-9]+ | root
            "#,
        )
        .unwrap();
        let words: Vec<&[u8]> = vec![
            b"[", b"]", b"[\"", b"\"", b"\",", b",", b"a", b"ab", b"b c", b" ", b"1", b"12", b"]]", b"],", b"x",
            b"\"]", b"",
        ];
        let table = TokenTable::new(words.iter().copied());
        let mut rng = StdRng::seed_from_u64(5);
        let mut cache = MaskCache::default();
        let mut fresh = Vec::new();
        for _ in 0..40 {
            let mut s = g.start();
            for _ in 0..30 {
                let cached = cache.mask(&g, &mut s, &table).to_vec();
                s.token_mask(&g, &table, &mut fresh);
                assert_eq!(cached, fresh, "after {} bytes", s.len());
                let allowed: Vec<usize> = (0..words.len()).filter(|&t| fresh[t / 64] >> (t % 64) & 1 == 1).collect();
                let Some(&t) = allowed.get(rng.random_range(0..allowed.len().max(1))) else { break };
                assert!(s.feed(&g, words[t]));
            }
        }
        // Inside a string, each letter leads back to the same key.
        let (mut a, mut b, mut reached) = (Vec::new(), Vec::new(), Vec::new());
        let mut s = g.start();
        assert!(s.feed(&g, b"[\"ab"));
        assert!(s.signature(&g, &mut a, &mut reached));
        assert!(s.feed(&g, b" c"));
        assert!(s.signature(&g, &mut b, &mut reached));
        assert_eq!(a, b);
        assert!(s.feed(&g, b"\""));
        assert!(s.signature(&g, &mut b, &mut reached));
        assert_ne!(a, b);
        // So does each digit of a number, and the next item of a list at the same depth.
        // (the first digit starts the repetition, so the key settles from the second on; the items after the
        // first two commas differ from the ones after them).
        let mut s = g.start();
        assert!(s.feed(&g, b"[12"));
        assert!(s.signature(&g, &mut a, &mut reached));
        assert!(s.feed(&g, b"34"));
        assert!(s.signature(&g, &mut b, &mut reached));
        assert_eq!(a, b);
        assert!(s.feed(&g, b",56,78"));
        assert!(s.signature(&g, &mut a, &mut reached));
        assert!(s.feed(&g, b",90"));
        assert!(s.signature(&g, &mut b, &mut reached));
        assert_eq!(a, b);
    }

    /// Random text made of the syntax's own pieces never panics the compiler; what compiles, a random walk over
    /// its accepted bytes follows without panicking, every byte it takes fits, and a mask agrees with feeding.
    #[test]
    fn random_grammar_text_compiles_or_errs_and_never_panics() {
        let pieces = [
            "root", " ::= ", "a", "b", "\"x\"", "\"\"", "\"\\n\"", "\"\\x4", "[a-z]", "[^\"]", "[", "]", "(", ")", "|",
            "*", "+", "?", "{2}", "{1,3}", "{0,}", "{9999}", "{3,1}", ".", "\n", " ", "#c\n", "\\", "é", "::=", "-",
            "^",
        ];
        let words: Vec<&[u8]> = vec![b"x", b"a", b"", b"xx", b"\n", "é".as_bytes(), b"z", b"\"", b"ab"];
        let table = TokenTable::new(words.iter().copied());
        let mut rng = StdRng::seed_from_u64(17);
        let mut compiled = 0;
        for _ in 0..20_000 {
            let n = rng.random_range(1..12);
            let mut text = String::from("root ::= ");
            for _ in 0..n {
                text.push_str(pieces[rng.random_range(0..pieces.len())]);
            }
            let Ok(g) = Grammar::compile(&text) else { continue };
            compiled += 1;
            let mut s = g.start();
            let mut bits = Vec::new();
            for _ in 0..20 {
                s.token_mask(&g, &table, &mut bits);
                for (t, w) in words.iter().enumerate() {
                    let fits = !w.is_empty() && s.clone().feed(&g, w);
                    assert_eq!(bits[t / 64] >> (t % 64) & 1 == 1, fits, "{text:?}: token {w:?}");
                }
                let fitting: Vec<u8> = (0..=255u8).filter(|&b| s.fits(&g, &[b])).collect();
                let Some(&b) = fitting.get(rng.random_range(0..fitting.len().max(1))) else { break };
                assert!(s.may_start_with(b) && s.feed(&g, &[b]), "{text:?}");
            }
        }
        assert!(compiled > 1000, "{compiled} of 20000 compiled");
    }

    #[test]
    fn errors_say_what_and_where() {
        let cases = [
            ("", "no `root` rule"),
            ("root ::= foo", "rule `foo` is used but never defined"),
            ("root ::= \"a\"\nroot ::= \"b\"", "line 2, column 9: rule `root` is defined twice"),
            ("root ::= \"abc", "never closed"),
            ("root ::= [abc", "never closed"),
            ("root ::= (\"a\"", "expected `)`"),
            ("root ::= \"a\"{3,2}", "counts down"),
            ("root ::= \"a\"{2000}", "at most 1024"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= [z-a]", "runs backwards"),
            ("root ::= [^\\x00-\\U0010FFFF]", "matches no character"),
            ("root ::= loop\nloop ::= \"a\" loop", "can never finish"),
            ("root = \"a\"", "expected `::=`"),
            ("root ::= \"a\" )", "expected a rule name"),
        ];
        let error_of = |text: &str| Grammar::compile(text).err().map(|e| e.0).unwrap_or_default();
        for (text, want) in cases {
            let err = error_of(text);
            assert!(err.contains(want), "{text:?}: {err}");
        }
        let deep = format!("root ::= {}\"a\"{}", "(".repeat(70), ")".repeat(70));
        assert!(error_of(&deep).contains("nest"));
        let long = format!("root ::= \"{}\"", "a".repeat(MAX_GRAMMAR_BYTES));
        assert!(error_of(&long).contains("at most"));
        let wide = format!("root ::= {}", "\"a\"{1000} ".repeat(70));
        assert!(error_of(&wide).contains("symbols"), "{}", error_of(&wide));
        // Nested repetitions share their inner rule: a thousand cubed bytes in a few thousand symbols.
        let nested = Grammar::compile("root ::= ((\"a\"{1000}){1000}){1000}").unwrap();
        assert!(nested.symbols.len() < 4000, "{nested:?}");
    }

    #[test]
    fn an_earley_set_past_its_work_bound_refuses_the_byte() {
        // Every split of the input is a parse: each set's work grows with the answer until the bound refuses a
        // byte, and what was fed before still ends the answer.
        let g = Grammar::compile(r#"root ::= x  x ::= x x | "a""#).unwrap();
        let mut s = g.start();
        let mut fed = 0;
        while fed < 100_000 && s.feed(&g, b"a") {
            fed += 1;
        }
        assert!(fed > 10 && fed < 100_000, "{fed}");
        assert!(s.may_end());
    }

    /// Following `a`s as far as the work bound lets an ambiguous `s` go: either another byte still fits, or the
    /// state says the bound alone stalls it; never a silent dead end.
    #[test]
    fn a_work_bound_dead_end_is_reported_not_silent() {
        // Bytes left here: `b` is scanned by `root` alone and costs nothing, so it fits after the `a`s stop.
        let g = Grammar::compile(r#"root ::= s "a" "b"  s ::= s s | "a""#).unwrap();
        // Committed as the sampler commits, so the chart holds what a real answer's does.
        fn feed_as(g: &Grammar, s: &mut GrammarState) -> usize {
            let mut fed = 0;
            while fed < 400 && s.feed(g, b"a") {
                s.commit(g);
                fed += 1;
            }
            fed
        }
        let mut s = g.start();
        let fed = feed_as(&g, &mut s);
        assert!(fed > 10 && fed < 400, "{fed}");
        assert!(!s.fits(&g, b"a") && s.fits(&g, b"b"));
        assert!(!s.stalled_by_work_bound(&g));
        // No byte left: `b` completes the ambiguous `s` too, so it costs what `a` does.
        let g = Grammar::compile(r#"root ::= s "b"  s ::= s s | "a" | "b""#).unwrap();
        let mut s = g.start();
        let fed = feed_as(&g, &mut s);
        assert!(fed > 10 && fed < 400, "{fed}");
        assert!(s.continues() && !s.may_end());
        assert!((0..=255u8).all(|b| !s.fits(&g, &[b])), "a byte still fits after {fed} bytes");
        let len = s.len();
        assert!(s.stalled_by_work_bound(&g));
        assert_eq!(s.len(), len);
        // A state the grammar itself ends is not stalled.
        let g = Grammar::compile(r#"root ::= "a""#).unwrap();
        let mut s = g.start();
        assert!(s.feed(&g, b"a") && !s.stalled_by_work_bound(&g));
    }
}
