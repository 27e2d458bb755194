//! Synthetic long-context tasks after RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
//! Long-Context Language Models?"), sized to a token target and scored by RULER's string match.
//!
//! Every prompt is laid out as `instruction`, blank line, `context`, blank line, `question`: the question comes
//! last because the eviction policies decide what to keep by looking at the most recent tokens, and a question
//! that came first would leak the needle's key into the observation window before the haystack.
//!
//! Items are a pure function of `(kind, seed, target_tokens)` and of the `count_tokens` callback. Randomness comes
//! from a SplitMix64 generator written here rather than `rand`'s `StdRng`, whose algorithm `rand` does not
//! promise to keep across releases: an item must stay the same item for as long as scores are compared.
//! The same seed at a different target keeps the same secrets (pass key, keys, values) and relative depths, so a
//! length sweep changes only the amount of haystack.

use super::words::{ADJECTIVES, NOUNS, VERBS};

/// The synthetic task families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskKind {
    /// One pass key in repeated filler (Mohtashami & Jaggi, 2023), RULER's simplest needle.
    Passkey,
    /// Four `adjective-noun` → 7-digit needles in essay-like text; one is asked for (RULER `niah_multikey_1`).
    #[serde(rename = "multikey_niah")]
    MultiKeyNiah,
    /// A JSON object of UUID keys → UUID values; one key is asked for (Liu et al., 2023, "Lost in the Middle").
    KvRetrieval,
    /// One chain of five variable assignments in filler; all variables holding the value are asked for (RULER `vt`).
    VariableTracking,
    /// A numbered word list where ten words are frequent; those ten are asked for (RULER `cwe`).
    CommonWords,
}

impl TaskKind {
    /// Every kind, in a fixed order (report columns, CLI help).
    pub const ALL: [TaskKind; 5] = [
        TaskKind::Passkey,
        TaskKind::MultiKeyNiah,
        TaskKind::KvRetrieval,
        TaskKind::VariableTracking,
        TaskKind::CommonWords,
    ];

    /// The stable name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::Passkey => "passkey",
            TaskKind::MultiKeyNiah => "multikey_niah",
            TaskKind::KvRetrieval => "kv_retrieval",
            TaskKind::VariableTracking => "variable_tracking",
            TaskKind::CommonWords => "common_words",
        }
    }

    /// Parses a [`TaskKind::name`]; ASCII case and `-` for `_` are forgiven since people type these.
    pub fn parse(s: &str) -> Option<TaskKind> {
        let norm = s.trim().to_ascii_lowercase().replace('-', "_");
        TaskKind::ALL.into_iter().find(|k| k.name() == norm)
    }

    /// Salt mixed into the seed so that two kinds with the same seed draw unrelated secrets.
    fn salt(self) -> u64 {
        match self {
            TaskKind::Passkey => 1,
            TaskKind::MultiKeyNiah => 2,
            TaskKind::KvRetrieval => 3,
            TaskKind::VariableTracking => 4,
            TaskKind::CommonWords => 5,
        }
    }
}

impl std::fmt::Display for TaskKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One generated task instance.
#[derive(Debug, Clone)]
pub struct EvalItem {
    pub task: TaskKind,
    pub seed: u64,
    /// Tokens in `prompt` as measured by the `count_tokens` given to [`generate`] (the raw message, before any
    /// chat template).
    pub context_tokens: usize,
    /// The whole user message (context + question), to be put through the chat template.
    pub prompt: String,
    /// Strings the answer must contain; [`score`] is the fraction found.
    pub answers: Vec<String>,
    /// Room for the answers twice over plus a short lead-in, so that a model that restates the question or
    /// numbers its list is not cut off before the answer.
    pub max_new_tokens: usize,
    /// [`TRAINING_QUESTIONS`] other questions on the same context in the item's own form (another needle's key,
    /// another JSON key (fewer when the object has fewer other keys), or other questions on the one fact or
    /// chain the context holds), none of them
    /// `prompt`'s question: the per-context training queries EvicPress profiles on (its paper, §4.3), kept apart
    /// from the question an item is scored on.
    pub training_questions: Vec<String>,
}

impl EvalItem {
    /// The prompt's context (instruction and haystack) and its question: every prompt ends in a question after
    /// the last blank line (see the module docs). `None` only for a prompt not made by [`generate`].
    pub fn context_and_question(&self) -> Option<(&str, &str)> {
        self.prompt.rsplit_once("\n\n")
    }
}

/// Training questions every item carries ([`EvalItem::training_questions`]).
pub const TRAINING_QUESTIONS: usize = 4;

/// Smallest target for which every kind fits under it. Below it, [`generate`] returns the smallest item it can
/// make, which may be longer than the target (its `context_tokens` says by how much).
pub const MIN_TARGET_TOKENS: usize = 256;

/// Generates one item. Deterministic: the same `(kind, seed, target_tokens)` with the same counter gives the same
/// item. The prompt's token count (measured with `count_tokens`) lands within about 5 % below `target_tokens` and
/// never above it, for targets of at least [`MIN_TARGET_TOKENS`]; the band is wider only when one haystack unit is
/// a large share of the target (a JSON pair of the key-value task is about 55 tokens of SmolLM2's vocabulary).
///
/// The haystack is sized by estimating from characters and correcting with a handful of `count_tokens` calls on
/// the whole prompt (a secant search on the number of haystack units), not by counting piece by piece.
pub fn generate(kind: TaskKind, seed: u64, target_tokens: usize, count_tokens: &dyn Fn(&str) -> usize) -> EvalItem {
    let task: Box<dyn Task> = match kind {
        TaskKind::Passkey => Box::new(Passkey::new(kind, seed)),
        TaskKind::MultiKeyNiah => Box::new(MultiKey::new(kind, seed)),
        TaskKind::KvRetrieval => Box::new(KvRetrieval::new(kind, seed)),
        TaskKind::VariableTracking => Box::new(VariableTracking::new(kind, seed)),
        TaskKind::CommonWords => Box::new(CommonWords::new(kind, seed)),
    };
    let (rendered, context_tokens) = fit(task.as_ref(), target_tokens, count_tokens);
    let answer_tokens = count_tokens(&rendered.answers.join(", "));
    EvalItem {
        task: kind,
        seed,
        context_tokens,
        prompt: rendered.prompt,
        answers: rendered.answers,
        max_new_tokens: 2 * answer_tokens + ANSWER_LEAD_IN_TOKENS,
        training_questions: rendered.training_questions,
    }
}

/// RULER's `string_match_all`: the fraction of `item.answers` found in `output`, ignoring case. An item without
/// answers scores 0 rather than a vacuous 1, so that a broken item cannot pass for a perfect one.
pub fn score(item: &EvalItem, output: &str) -> f32 {
    if item.answers.is_empty() {
        return 0.0;
    }
    let out = output.to_lowercase();
    let hits = item.answers.iter().filter(|a| out.contains(&a.to_lowercase())).count();
    hits as f32 / item.answers.len() as f32
}

/// Tokens allowed for "The pass key is" and the like before the answer itself.
const ANSWER_LEAD_IN_TOKENS: usize = 48;

/// The search stops once the prompt is within this fraction (1/20 = 5 %) below the target...
const ACCEPT_BELOW_DIV: usize = 20;
/// ...and aims at half that, so that one step of overshoot still lands inside.
const AIM_BELOW_DIV: usize = 40;
/// `count_tokens` calls allowed after the first; the secant converges in two or three, the rest is bisection
/// headroom for a counter that is far from linear.
const MAX_FIT_STEPS: usize = 24;
/// Initial guess of characters per token for English-like text, corrected by the first measurement.
const GUESS_CHARS_PER_TOKEN: usize = 4;

/// RULER's noise haystack (from the original passkey test), used by the passkey and variable-tracking tasks.
const NOISE: [&str; 5] =
    ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."];

/// Essay-like haystack sentences for the multi-key task, standing in for RULER's Paul Graham essays (which are not
/// ours to ship). Written for this file; general statements without numbers, so that no digit in the haystack can
/// be mistaken for a needle's value.
const ESSAY: &[&str] = &[
    "Most good ideas look small at first, which is why so few people bother to work on them.",
    "A city grows the way a tree does, by adding rings around whatever was there before.",
    "The hardest part of learning a craft is the long stretch where you can see your mistakes but cannot yet fix them.",
    "People rarely change their minds in an argument, but they often change them a week later, alone.",
    "A well-kept notebook is less a record of what happened than a map of what seemed to matter.",
    "Every tool shapes the hand that holds it, and after a while the hand forgets it was ever otherwise.",
    "The first version of anything is mostly a way of finding out what the second version should be.",
    "Rivers were the first roads, and most old towns still face the water as if waiting for a boat.",
    "It is easier to notice what is missing from a room than to say what makes it feel like home.",
    "Good teachers are patient with questions and impatient with answers that stop the questions.",
    "A library is quiet not because nothing happens there but because everything happens inside people.",
    "Habits are decisions we made once and then stopped noticing that we keep making.",
    "The weather decides more of our plans than we admit, and the calendar takes the credit.",
    "When a problem seems impossible, it is often because it has been stated in the wrong words.",
    "Old maps are full of confident guesses, and that confidence is part of why people kept exploring.",
    "Writing something down forces a vague feeling to choose what it actually means.",
    "A market at dawn is a lesson in how much order can come from people who never planned together.",
    "Children ask why until the answers run out, and adults mostly stop asking before that point.",
    "The best conversations wander, because the interesting parts are rarely where anyone expected.",
    "Every craft has a few rules that beginners must follow and masters may quietly break.",
    "A bridge is a promise made in stone that the far bank is worth reaching.",
    "Most of what we call talent is attention that has been paid for a very long time.",
    "Gardens teach patience by refusing to be hurried, no matter how often they are checked.",
    "The easiest way to understand a machine is to take it apart and try to put it back together.",
    "News travels fast, but understanding travels at the speed of careful reading.",
    "A good plan leaves room for surprises, since the world seldom reads our plans.",
    "Small towns remember everything, which is both their comfort and their burden.",
    "Curiosity is cheap to start and expensive to keep, because it always asks for more time.",
    "The sea looks the same from the shore every day, yet sailors never describe it the same way twice.",
    "A room full of experts can still miss what a newcomer sees in the first minute.",
    "Stories last longer than facts because they give the facts somewhere to live.",
    "Most arguments about taste are really arguments about what each person grew up with.",
    "Building something useful usually begins with being annoyed by something that is not.",
    "Mountains look closer in clear air, which has fooled more than one traveller into a long walk.",
    "Practice feels slow while it happens and fast when you look back on it.",
    "A kitchen is a small laboratory where the experiments are eaten at the end.",
    "The quiet hours before everyone wakes are when many people do their clearest thinking.",
    "Cities at night are maps drawn in light, showing where people chose to stay awake.",
    "An honest question can do more work than a clever answer.",
    "Work that is done for its own sake tends to be done more carefully than work done for praise.",
    "Forgetting is not only a failure of memory but also a way of making room.",
    "Letters written by hand carry the pauses of the writer in the shape of the lines.",
    "A long walk often solves what an hour at the desk only tangled further.",
    "The simplest explanation is a good place to start and a dangerous place to stop.",
    "Seasons repeat, yet nobody lives the same autumn twice.",
    "Trust is built slowly in small moments and spent quickly in large ones.",
    "Clear instructions are rare because writing them requires imagining someone who knows nothing.",
    "Every generation believes it invented both hard work and the shortcut around it.",
];

/// SplitMix64 (Steele, Lea & Flood, 2014): tiny, fast, and defined bit for bit, so items are identical on every
/// platform and every future build.
struct Rng(u64);

impl Rng {
    /// A stream for `(kind, seed, stream)`; the streams of one item are independent of each other.
    fn for_item(kind: TaskKind, seed: u64, stream: u64) -> Rng {
        let mut r = Rng(seed
            ^ kind.salt().wrapping_mul(0xA076_1D64_78BD_642F)
            ^ stream.wrapping_add(1).wrapping_mul(0xE703_7ED1_A0B4_28DB));
        r.next_u64();
        r
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` by multiply-shift (bias below n/2^64, irrelevant here); `n` must be non-zero.
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Uniform in `lo..hi` (`lo < hi`).
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + ((u128::from(self.next_u64()) * u128::from(hi - lo)) >> 64) as u64
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }

    /// `count` distinct values in `lo..hi`, in draw order.
    fn distinct(&mut self, count: usize, lo: u64, hi: u64) -> Vec<u64> {
        let mut out: Vec<u64> = Vec::with_capacity(count);
        while out.len() < count {
            let v = self.range(lo, hi);
            if !out.contains(&v) {
                out.push(v);
            }
        }
        out
    }

    /// A depth in per-mille of the haystack, 0 (start) ..= 1000 (end).
    fn depth(&mut self) -> usize {
        self.below(1001)
    }
}

fn words(list: &'static str) -> Vec<&'static str> {
    list.split_ascii_whitespace().collect()
}

/// The unit index after which a needle at `depth` per-mille goes, in a haystack of `n` units.
fn at_depth(n: usize, depth: usize) -> usize {
    n * depth / 1000
}

/// A prompt and its answers for one haystack size, and the item's training questions on that haystack.
struct Rendered {
    prompt: String,
    answers: Vec<String>,
    training_questions: Vec<String>,
}

/// A task instance whose secrets are fixed and whose haystack length, in units (sentences, JSON pairs, list
/// entries), is free.
trait Task {
    /// Fewest units that still make a well-formed task.
    fn min_units(&self) -> usize;
    fn render(&self, units: usize) -> Rendered;
}

/// Finds the haystack size whose prompt is the longest not above `target`, stopping early inside the accepted
/// band. Returns the rendered item and its token count; every returned prompt was measured, so it is never above
/// `target` unless even the smallest item is.
fn fit(task: &dyn Task, target: usize, count: &dyn Fn(&str) -> usize) -> (Rendered, usize) {
    let min_n = task.min_units();
    let smallest = task.render(min_n);
    let t_min = count(&smallest.prompt);
    let accept = target - target / ACCEPT_BELOW_DIV;
    if t_min >= accept {
        return (smallest, t_min);
    }
    let aim = target - target / AIM_BELOW_DIV;
    // Each unit is at least one token, so no answer needs more than `target` units on top of the minimum.
    let max_n = min_n + target;

    // First guess from characters: render a probe (cheap, no counting) to learn how long a unit is, then assume
    // English-like text. The secant below corrects the ratio for digits, UUIDs and lists.
    const PROBE_UNITS: usize = 64;
    let probe_len = task.render(min_n + PROBE_UNITS).prompt.len();
    let unit_chars = (probe_len.saturating_sub(smallest.prompt.len()) / PROBE_UNITS).max(1);
    let mut n = min_n + aim.saturating_sub(t_min) * GUESS_CHARS_PER_TOKEN / unit_chars;

    let mut lo = (min_n, smallest, t_min);
    let mut hi: Option<(usize, usize)> = None;
    let mut last = (min_n, t_min);
    for _ in 0..MAX_FIT_STEPS {
        let upper = hi.map_or(max_n, |(hn, _)| hn - 1);
        if upper <= lo.0 {
            break;
        }
        n = n.clamp(lo.0 + 1, upper);
        let r = task.render(n);
        let t = count(&r.prompt);
        let previous = std::mem::replace(&mut last, (n, t));
        if t <= target {
            lo = (n, r, t);
            if t >= accept {
                break;
            }
        } else {
            hi = Some((n, t));
        }
        n = secant(previous, last, aim).unwrap_or(lo.0 + 1);
        if let Some((hn, _)) = hi
            && !(lo.0 < n && n < hn)
        {
            // The counter is not locally linear here: fall back to bisection inside the bracket.
            n = lo.0 + (hn - lo.0) / 2;
        }
    }
    (lo.1, lo.2)
}

/// The unit count at which the line through two `(units, tokens)` measurements reaches `aim` tokens, if the line
/// rises.
fn secant(a: (usize, usize), b: (usize, usize), aim: usize) -> Option<usize> {
    let dn = b.0 as i128 - a.0 as i128;
    let dt = b.1 as i128 - a.1 as i128;
    if dn == 0 || dt == 0 || (dn > 0) != (dt > 0) {
        return None;
    }
    let next = b.0 as i128 + (aim as i128 - b.1 as i128) * dn / dt;
    usize::try_from(next.max(0)).ok()
}

/// Joins haystack units with spaces, putting each `(after_unit, text)` insert after that many units (inserts at
/// the same place keep their order).
fn weave(units: &[&str], inserts: &[(usize, String)], sep: &str) -> String {
    fn push(out: &mut String, sep: &str, s: &str) {
        if !out.is_empty() {
            out.push_str(sep);
        }
        out.push_str(s);
    }
    let mut out = String::new();
    let mut ins = inserts.iter().peekable();
    for i in 0..=units.len() {
        while let Some((_, text)) = ins.next_if(|(at, _)| *at <= i) {
            push(&mut out, sep, text);
        }
        if let Some(u) = units.get(i) {
            push(&mut out, sep, u);
        }
    }
    out
}

fn layout(instruction: &str, context: &str, question: &str) -> String {
    format!("{instruction}\n\n{context}\n\n{question}")
}

struct Passkey {
    key: u64,
    depth: usize,
}

impl Passkey {
    fn new(kind: TaskKind, seed: u64) -> Passkey {
        let mut rng = Rng::for_item(kind, seed, 0);
        Passkey { key: rng.range(10_000, 100_000), depth: rng.depth() }
    }
}

impl Task for Passkey {
    fn min_units(&self) -> usize {
        0
    }

    fn render(&self, n: usize) -> Rendered {
        let units: Vec<&str> = (0..n).map(|i| NOISE[i % NOISE.len()]).collect();
        let k = self.key;
        let needle = format!("The pass key is {k}. Remember it. {k} is the pass key.");
        let context = weave(&units, &[(at_depth(n, self.depth), needle)], " ");
        let prompt = layout(
            "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz \
             you about the important information there.",
            &context,
            "What is the pass key?",
        );
        // One fact: the training questions ask it in other words.
        let training_questions = [
            "What is the pass key mentioned in the text?",
            "Which number is the pass key?",
            "What number did the text ask you to remember?",
            "Repeat the pass key hidden in the text above.",
        ]
        .map(str::to_owned)
        .to_vec();
        Rendered { prompt, answers: vec![k.to_string()], training_questions }
    }
}

/// Needles in the multi-key task: RULER's `niah_multikey_1` uses four, one queried and three distractors.
const MULTIKEY_NEEDLES: usize = 4;

struct MultiKey {
    /// `(key, value, depth)` per needle.
    needles: Vec<(String, u64, usize)>,
    query: usize,
    seed: u64,
    kind: TaskKind,
}

impl MultiKey {
    fn new(kind: TaskKind, seed: u64) -> MultiKey {
        let mut rng = Rng::for_item(kind, seed, 0);
        let (adjs, nouns) = (words(ADJECTIVES), words(NOUNS));
        let mut keys: Vec<String> = Vec::new();
        while keys.len() < MULTIKEY_NEEDLES {
            let key = format!("{}-{}", adjs[rng.below(adjs.len())], nouns[rng.below(nouns.len())]);
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        let values = rng.distinct(MULTIKEY_NEEDLES, 1_000_000, 10_000_000);
        let needles = keys.into_iter().zip(values).map(|(k, v)| (k, v, rng.depth())).collect();
        MultiKey { needles, query: rng.below(MULTIKEY_NEEDLES), seed, kind }
    }
}

impl Task for MultiKey {
    fn min_units(&self) -> usize {
        0
    }

    fn render(&self, n: usize) -> Rendered {
        // Sentence i is the same for every n (one sequential stream), so a longer haystack extends a shorter one.
        let mut rng = Rng::for_item(self.kind, self.seed, 1);
        let mut units: Vec<String> = Vec::with_capacity(n);
        let mut last = usize::MAX;
        for _ in 0..n {
            let mut s = rng.below(ESSAY.len());
            if s == last {
                s = (s + 1) % ESSAY.len();
            }
            last = s;
            // A paragraph break before roughly one sentence in six, so the haystack reads like an essay.
            let unit = if rng.below(6) == 0 { format!("\n\n{}", ESSAY[s]) } else { ESSAY[s].to_string() };
            units.push(unit);
        }
        let mut inserts: Vec<(usize, String)> = self
            .needles
            .iter()
            .map(|(k, v, d)| (at_depth(n, *d), format!("One of the special magic numbers for {k} is: {v}.")))
            .collect();
        inserts.sort_by_key(|(at, _)| *at);
        let refs: Vec<&str> = units.iter().map(|u| u.as_str()).collect();
        let context = weave(&refs, &inserts, " ").replace(" \n\n", "\n\n");
        let context = context.trim_start();
        let (key, value, _) = &self.needles[self.query];
        let ask = |key: &str| format!("What is the special magic number for {key} mentioned in the provided text?");
        let prompt = layout(
            "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz \
             you about the numbers afterwards.",
            context,
            &ask(key),
        );
        // The three distractor needles, then every number at once.
        let mut training_questions: Vec<String> =
            self.needles.iter().enumerate().filter(|&(i, _)| i != self.query).map(|(_, (k, _, _))| ask(k)).collect();
        training_questions.push("Which special magic numbers are mentioned in the provided text?".to_owned());
        Rendered { prompt, answers: vec![value.to_string()], training_questions }
    }
}

struct KvRetrieval {
    seed: u64,
    kind: TaskKind,
    depth: usize,
}

impl KvRetrieval {
    fn new(kind: TaskKind, seed: u64) -> KvRetrieval {
        let mut rng = Rng::for_item(kind, seed, 0);
        KvRetrieval { seed, kind, depth: rng.depth() }
    }
}

/// A random version-4 UUID, lowercase.
fn uuid(rng: &mut Rng) -> String {
    let hi = (rng.next_u64() & !0xF000) | 0x4000;
    let lo = (rng.next_u64() & !(0b11 << 62)) | (0b10 << 62);
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        hi >> 32,
        (hi >> 16) & 0xFFFF,
        hi & 0xFFFF,
        lo >> 48,
        lo & 0xFFFF_FFFF_FFFF
    )
}

impl Task for KvRetrieval {
    fn min_units(&self) -> usize {
        // The queried pair and at least one distractor.
        2
    }

    fn render(&self, n: usize) -> Rendered {
        let mut rng = Rng::for_item(self.kind, self.seed, 1);
        let pairs: Vec<(String, String)> = (0..n).map(|_| (uuid(&mut rng), uuid(&mut rng))).collect();
        let query = at_depth(n, self.depth).min(n - 1);
        let body: Vec<String> = pairs.iter().map(|(k, v)| format!(" \"{k}\": \"{v}\"")).collect();
        let context = format!("JSON data:\n{{\n{}\n}}", body.join(",\n"));
        let (key, value) = &pairs[query];
        let ask = |key: &str| format!("Key: \"{key}\"\nCorresponding value:");
        let prompt = layout(
            "Extract the value corresponding to the specified key in the JSON object below.",
            &context,
            &ask(key),
        );
        // Other keys, spread over the object (evenly placed, skipping the asked one).
        let others: Vec<usize> = (0..n).filter(|&i| i != query).collect();
        let training_questions = (0..TRAINING_QUESTIONS.min(others.len()))
            .map(|j| ask(&pairs[others[(2 * j + 1) * others.len() / (2 * TRAINING_QUESTIONS)]].0))
            .collect();
        Rendered { prompt, answers: vec![value.clone()], training_questions }
    }
}

/// RULER's `vt` defaults: one chain of four hops, so five variables share the value.
const VT_VARIABLES: usize = 5;

struct VariableTracking {
    names: Vec<String>,
    value: u64,
    depths: Vec<usize>,
}

impl VariableTracking {
    fn new(kind: TaskKind, seed: u64) -> VariableTracking {
        let mut rng = Rng::for_item(kind, seed, 0);
        let mut names: Vec<String> = Vec::new();
        while names.len() < VT_VARIABLES {
            let name: String = (0..5).map(|_| char::from(b'A' + rng.below(26) as u8)).collect();
            if !names.contains(&name) {
                names.push(name);
            }
        }
        let value = rng.range(10_000, 100_000);
        let mut depths: Vec<usize> = (0..VT_VARIABLES).map(|_| rng.depth()).collect();
        depths.sort_unstable();
        VariableTracking { names, value, depths }
    }
}

impl Task for VariableTracking {
    fn min_units(&self) -> usize {
        0
    }

    fn render(&self, n: usize) -> Rendered {
        let units: Vec<&str> = (0..n).map(|i| NOISE[i % NOISE.len()]).collect();
        // Sorted depths keep the chain in assignment order: each hop refers to a variable already defined.
        let inserts: Vec<(usize, String)> = self
            .names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let rhs = if i == 0 { self.value.to_string() } else { format!("VAR {}", self.names[i - 1]) };
                (at_depth(n, self.depths[i]), format!("VAR {name} = {rhs}."))
            })
            .collect();
        let context = weave(&units, &inserts, " ");
        let prompt = layout(
            "Memorize and track the chain(s) of variable assignment hidden in the following text.",
            &context,
            &format!("Question: Find all variables that are assigned the value {} in the text above.", self.value),
        );
        let v = self.value;
        let training_questions = vec![
            format!("Question: Which variable is assigned the value {v} first in the text above?"),
            format!("Question: Which variables hold the value {v} in the text above?"),
            "Question: Which variable is assigned last in the chain above?".to_owned(),
            "Question: What value is passed along the chain of variables above?".to_owned(),
        ];
        Rendered { prompt, answers: self.names.clone(), training_questions }
    }
}

/// RULER's `cwe` defaults: ten common words, each 30 times, against uncommon words 3 times each.
const CWE_COMMON: usize = 10;
const CWE_FREQ_COMMON: usize = 30;
const CWE_FREQ_UNCOMMON: usize = 3;

struct CommonWords {
    /// The vocabulary in this item's order: the first [`CWE_COMMON`] are the common words.
    vocab: Vec<&'static str>,
    seed: u64,
    kind: TaskKind,
}

impl CommonWords {
    fn new(kind: TaskKind, seed: u64) -> CommonWords {
        let mut rng = Rng::for_item(kind, seed, 0);
        let mut vocab: Vec<&'static str> =
            words(NOUNS).into_iter().chain(words(ADJECTIVES)).chain(words(VERBS)).collect();
        rng.shuffle(&mut vocab);
        CommonWords { vocab, seed, kind }
    }

    /// `(common frequency, uncommon frequency)` for a list of `n` entries. RULER's 30:3 where it fits; shorter
    /// lists scale the common frequency down so it fills at most half the list (keeping at least 2:1 over the
    /// uncommon); longer lists than the vocabulary covers scale both up by the same factor.
    fn freqs(&self, n: usize) -> (usize, usize) {
        let uncommon_words = self.vocab.len() - CWE_COMMON;
        let capacity = CWE_COMMON * CWE_FREQ_COMMON + uncommon_words * CWE_FREQ_UNCOMMON;
        let scale = n.div_ceil(capacity).max(1);
        let (fc, fu) = (CWE_FREQ_COMMON * scale, CWE_FREQ_UNCOMMON * scale);
        if CWE_COMMON * fc <= n / 2 {
            return (fc, fu);
        }
        let fc = (n / (2 * CWE_COMMON)).max(2);
        (fc, (fc / 3).clamp(1, CWE_FREQ_UNCOMMON))
    }
}

impl Task for CommonWords {
    fn min_units(&self) -> usize {
        4 * CWE_COMMON
    }

    fn render(&self, n: usize) -> Rendered {
        let (fc, fu) = self.freqs(n);
        let common = &self.vocab[..CWE_COMMON];
        let mut list: Vec<&str> = Vec::with_capacity(n);
        for w in common {
            list.extend(std::iter::repeat_n(*w, fc));
        }
        // `freqs` sizes the frequencies so the vocabulary always suffices; the bound only guards the indexing.
        for w in &self.vocab[CWE_COMMON..] {
            if list.len() >= n {
                break;
            }
            list.extend(std::iter::repeat_n(*w, fu.min(n - list.len())));
        }
        let mut rng = Rng::for_item(self.kind, self.seed, 1);
        rng.shuffle(&mut list);
        let entries: Vec<String> = list.iter().enumerate().map(|(i, w)| format!("{}. {w}", i + 1)).collect();
        let prompt = layout(
            "Below is a numbered list of words. In these words, some appear more often than others. Memorize the \
             ones that appear most often.",
            &entries.join(" "),
            &format!("Question: What are the {CWE_COMMON} most common words in the above list?"),
        );
        let training_questions = [
            "Question: Which word appears most often in the above list?".to_owned(),
            format!("Question: Which {CWE_COMMON} words are repeated the most in the list above?"),
            "Question: Name the words that occur many times in the numbered list.".to_owned(),
            "Question: Which words in the above list appear only a few times?".to_owned(),
        ]
        .to_vec();
        Rendered { prompt, answers: common.iter().map(|w| w.to_string()).collect(), training_questions }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::HashMap;
    use std::sync::OnceLock;

    use super::*;
    use crate::model::{Gguf, Tokenizer};

    /// The real tokenizer, loaded once. Like the model tests, a missing model is a failure, not a skip: the sizing
    /// promise is about real token counts.
    pub(crate) fn tokenizer() -> &'static Tokenizer {
        static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
        TOKENIZER.get_or_init(|| {
            let path: std::path::PathBuf = match std::env::var_os("PAGODA_MODEL") {
                Some(p) => p.into(),
                None => {
                    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
                }
            };
            let g = Gguf::open(&path).expect("open model (set PAGODA_MODEL or run scripts/fetch-model.sh)");
            Tokenizer::from_gguf(&g).expect("tokenizer")
        })
    }

    fn real_count(s: &str) -> usize {
        tokenizer().encode(s, false).len()
    }

    /// A stand-in counter for tests about structure rather than size.
    fn rough_count(s: &str) -> usize {
        s.len().div_ceil(4)
    }

    fn split(item: &EvalItem) -> (&str, &str) {
        item.context_and_question().expect("prompt has a context and a question")
    }

    fn occurrences(hay: &str, needle: &str) -> usize {
        hay.matches(needle).count()
    }

    /// Checks that the item is well formed: answers in the context and not in the question, and the kind's own
    /// structure (the needle sentence, the chain, the word frequencies).
    fn check_structure(item: &EvalItem) {
        let what = format!("{} seed {} ({} tokens)", item.task, item.seed, item.context_tokens);
        let (ctx, question) = split(item);
        assert!(!item.answers.is_empty(), "{what}: no answers");
        for a in &item.answers {
            assert!(ctx.contains(a.as_str()), "{what}: answer {a} not in the context");
            assert!(!question.contains(a.as_str()), "{what}: answer {a} given away in the question");
        }
        assert!(item.max_new_tokens > item.answers.len(), "{what}: max_new_tokens {}", item.max_new_tokens);
        let training = &item.training_questions;
        // A key-value item of few pairs has fewer other keys to ask.
        let want = if item.task == TaskKind::KvRetrieval {
            1..=TRAINING_QUESTIONS
        } else {
            TRAINING_QUESTIONS..=TRAINING_QUESTIONS
        };
        assert!(want.contains(&training.len()), "{what}: training questions {training:?}");
        for (i, t) in training.iter().enumerate() {
            assert_ne!(t, question, "{what}: a training question is the item's own");
            assert!(!training[..i].contains(t), "{what}: training question {t:?} twice");
            assert!(item.answers.iter().all(|a| !t.contains(a.as_str())), "{what}: {t:?} gives an answer away");
        }
        // Where a training question names something in the context (a needle's key, a JSON key), it is there.
        fn named(task: TaskKind, t: &str) -> Option<&str> {
            let rest = match task {
                TaskKind::MultiKeyNiah => t.strip_prefix("What is the special magic number for ")?,
                TaskKind::KvRetrieval => t.strip_prefix("Key: \"")?,
                _ => return None,
            };
            rest.split([' ', '"']).next()
        }
        for t in training {
            if let Some(name) = named(item.task, t) {
                assert!(ctx.contains(name), "{what}: {t:?} names {name}, not in the context");
            }
        }
        match item.task {
            TaskKind::Passkey => {
                let k = &item.answers[0];
                assert_eq!(k.len(), 5);
                assert_eq!(occurrences(ctx, &format!("The pass key is {k}. Remember it. {k} is the pass key.")), 1);
                assert_eq!(occurrences(ctx, k), 2, "{what}: the key appears only in its needle");
                assert_eq!(question, "What is the pass key?");
            }
            TaskKind::MultiKeyNiah => {
                let key = question
                    .strip_prefix("What is the special magic number for ")
                    .and_then(|q| q.strip_suffix(" mentioned in the provided text?"))
                    .expect("multikey question");
                let v = &item.answers[0];
                assert_eq!(v.len(), 7);
                let needle = format!("One of the special magic numbers for {key} is: {v}.");
                assert_eq!(occurrences(ctx, &needle), 1, "{what}: needle for {key}");
                assert_eq!(occurrences(ctx, "One of the special magic numbers for "), MULTIKEY_NEEDLES);
                assert_eq!(occurrences(ctx, v), 1);
            }
            TaskKind::KvRetrieval => {
                let key = question
                    .strip_prefix("Key: \"")
                    .and_then(|q| q.strip_suffix("\"\nCorresponding value:"))
                    .expect("kv question");
                assert_eq!(key.len(), 36);
                let v = &item.answers[0];
                assert_eq!(occurrences(ctx, &format!("\"{key}\": \"{v}\"")), 1, "{what}: pair for {key}");
                assert_eq!(occurrences(ctx, key), 1);
                assert_eq!(occurrences(ctx, v), 1);
                let json = ctx.strip_prefix("Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n").expect("kv header");
                let parsed: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_str(json).expect("the context holds valid JSON");
                assert_eq!(parsed.get(key).and_then(|x| x.as_str()), Some(v.as_str()));
            }
            TaskKind::VariableTracking => {
                let value = question
                    .strip_prefix("Question: Find all variables that are assigned the value ")
                    .and_then(|q| q.strip_suffix(" in the text above."))
                    .expect("vt question");
                let names = &item.answers;
                assert_eq!(names.len(), VT_VARIABLES);
                let mut last = 0;
                for (i, name) in names.iter().enumerate() {
                    let rhs = if i == 0 { value.to_string() } else { format!("VAR {}", names[i - 1]) };
                    let stmt = format!("VAR {name} = {rhs}.");
                    let at = ctx.find(&stmt).unwrap_or_else(|| panic!("{what}: missing {stmt}"));
                    assert!(at >= last, "{what}: chain out of order at {stmt}");
                    last = at;
                    assert_eq!(occurrences(ctx, name), if i + 1 < names.len() { 2 } else { 1 }, "{what}: {name}");
                }
            }
            TaskKind::CommonWords => {
                assert_eq!(item.answers.len(), CWE_COMMON);
                let list = ctx.rsplit_once("\n\n").expect("cwe header").1;
                let mut freq: HashMap<&str, usize> = HashMap::new();
                let entries: Vec<&str> = list.split(' ').collect();
                assert_eq!(entries.len() % 2, 0);
                for (i, pair) in entries.chunks(2).enumerate() {
                    assert_eq!(pair[0], format!("{}.", i + 1), "{what}: numbering");
                    *freq.entry(pair[1]).or_default() += 1;
                }
                let least_common =
                    item.answers.iter().map(|a| freq.get(a.as_str()).copied().unwrap_or(0)).min().unwrap_or(0);
                let most_uncommon = freq
                    .iter()
                    .filter(|(w, _)| !item.answers.iter().any(|a| a == *w))
                    .map(|(_, c)| *c)
                    .max()
                    .unwrap_or(0);
                assert!(least_common >= 2 * most_uncommon.max(1), "{what}: {least_common} vs {most_uncommon}");
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for k in TaskKind::ALL {
            assert_eq!(TaskKind::parse(k.name()), Some(k));
            assert_eq!(TaskKind::parse(&k.name().to_uppercase().replace('_', "-")), Some(k));
            assert_eq!(k.to_string(), k.name());
        }
        assert_eq!(TaskKind::parse("niah"), None);
        assert_eq!(TaskKind::parse(""), None);
    }

    #[test]
    fn word_lists_are_clean() {
        let all: Vec<&str> = words(NOUNS).into_iter().chain(words(ADJECTIVES)).chain(words(VERBS)).collect();
        assert!(all.len() >= 400, "{} words", all.len());
        for (i, a) in all.iter().enumerate() {
            assert!(a.len() >= 4 && a.bytes().all(|b| b.is_ascii_lowercase()), "{a}");
            for (j, b) in all.iter().enumerate() {
                assert!(i == j || !b.contains(a), "{a} is inside {b}: substring scoring would confuse them");
            }
        }
        assert!(ESSAY.iter().all(|s| !s.bytes().any(|b| b.is_ascii_digit())));
    }

    #[test]
    fn same_inputs_same_item() {
        for k in TaskKind::ALL {
            let a = generate(k, 42, 2048, &rough_count);
            let b = generate(k, 42, 2048, &rough_count);
            assert_eq!(
                (a.prompt, a.answers, a.context_tokens, a.max_new_tokens),
                (b.prompt, b.answers, b.context_tokens, b.max_new_tokens)
            );
            let other = generate(k, 43, 2048, &rough_count);
            assert_ne!(generate(k, 42, 2048, &rough_count).answers, other.answers, "{k}: seeds 42 and 43 agree");
        }
    }

    #[test]
    fn kinds_with_one_seed_draw_different_secrets() {
        let p = generate(TaskKind::Passkey, 5, 1024, &rough_count);
        let v = generate(TaskKind::VariableTracking, 5, 1024, &rough_count);
        assert_ne!(
            split(&v).1,
            format!("Question: Find all variables that are assigned the value {} in the text above.", p.answers[0])
        );
    }

    #[test]
    fn longer_target_keeps_the_secrets() {
        for k in [TaskKind::Passkey, TaskKind::MultiKeyNiah, TaskKind::VariableTracking, TaskKind::CommonWords] {
            let short = generate(k, 9, 1024, &rough_count);
            let long = generate(k, 9, 8192, &rough_count);
            assert_eq!(short.answers, long.answers, "{k}");
            assert!(long.prompt.len() > 6 * short.prompt.len(), "{k}");
        }
    }

    /// Pins the generator: if these change, scores from before and after the change are not comparable, and this
    /// test is where that is decided on purpose.
    #[test]
    fn pinned_secrets() {
        let got: Vec<(TaskKind, Vec<String>)> =
            TaskKind::ALL.into_iter().map(|k| (k, generate(k, 7, 1024, &rough_count).answers)).collect();
        let want: [(TaskKind, &[&str]); 5] = [
            (TaskKind::Passkey, &["75594"]),
            (TaskKind::MultiKeyNiah, &["4643042"]),
            (TaskKind::KvRetrieval, &["5dae4004-5c09-45e4-86c3-f66c65ed55d3"]),
            (TaskKind::VariableTracking, &["LWEFQ", "HUHRH", "NQXOR", "NRWCR", "MLOZV"]),
            (
                TaskKind::CommonWords,
                &["gusty", "marble", "cupboard", "summer", "shadow", "storm", "damp", "curtain", "harvest", "lift"],
            ),
        ];
        let want: Vec<(TaskKind, Vec<String>)> =
            want.iter().map(|(k, a)| (*k, a.iter().map(|s| s.to_string()).collect())).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn structure_holds_across_seeds_and_lengths() {
        for k in TaskKind::ALL {
            for seed in 0..16 {
                for target in [MIN_TARGET_TOKENS, 700, 3000, 32_768] {
                    let item = generate(k, seed, target, &rough_count);
                    assert!(item.context_tokens <= target, "{k} seed {seed}: {} > {target}", item.context_tokens);
                    assert_eq!(item.context_tokens, rough_count(&item.prompt));
                    check_structure(&item);
                }
            }
        }
    }

    /// At the smallest supported target every kind fits (not necessarily within 10 %: one JSON pair is a fifth of
    /// it).
    #[test]
    fn smallest_supported_target_fits() {
        for k in TaskKind::ALL {
            let item = generate(k, 2, MIN_TARGET_TOKENS, &real_count);
            assert!(item.context_tokens <= MIN_TARGET_TOKENS, "{k}: {}", item.context_tokens);
            assert!(item.context_tokens * 2 >= MIN_TARGET_TOKENS, "{k}: {}", item.context_tokens);
            check_structure(&item);
        }
    }

    #[test]
    fn below_the_minimum_gives_the_smallest_item() {
        for k in TaskKind::ALL {
            let item = generate(k, 1, 16, &real_count);
            assert!(item.context_tokens > 16);
            assert_eq!(item.context_tokens, real_count(&item.prompt));
            check_structure(&item);
        }
    }

    /// The sizing promise with the real tokenizer: within [0.9, 1.0] of the target (the search aims at 5 %).
    #[test]
    fn real_token_counts_land_in_band() {
        for k in TaskKind::ALL {
            for target in [1024, 2048, 4096, 6144] {
                for seed in [0, 1] {
                    let item = generate(k, seed, target, &real_count);
                    let tokens = real_count(&item.prompt);
                    assert_eq!(item.context_tokens, tokens);
                    assert!(tokens <= target, "{k} seed {seed}: {tokens} > {target}");
                    assert!(tokens * 10 >= target * 9, "{k} seed {seed}: {tokens} < 0.9 * {target}");
                    check_structure(&item);
                    let answer_tokens = real_count(&item.answers.join(", "));
                    assert!(item.max_new_tokens >= 2 * answer_tokens, "{k}: {} new tokens", item.max_new_tokens);
                }
            }
        }
    }

    #[test]
    fn needle_depth_follows_the_seed() {
        // Over many seeds the passkey lands both in the first and in the last quarter of the haystack.
        let (mut early, mut late) = (false, false);
        for seed in 0..32 {
            let item = generate(TaskKind::Passkey, seed, 2048, &rough_count);
            let at = item.prompt.find("The pass key is").expect("needle") as f64 / item.prompt.len() as f64;
            early |= at < 0.25;
            late |= at > 0.75;
        }
        assert!(early && late);
    }

    fn item_with(answers: &[&str]) -> EvalItem {
        EvalItem {
            task: TaskKind::CommonWords,
            seed: 0,
            context_tokens: 0,
            prompt: String::new(),
            answers: answers.iter().map(|a| a.to_string()).collect(),
            max_new_tokens: 8,
            training_questions: Vec::new(),
        }
    }

    #[test]
    fn score_is_the_fraction_of_answers_found_ignoring_case() {
        let item = item_with(&["apple", "Banana", "XQZTR", "4711"]);
        assert_eq!(score(&item, "APPLE, banana, xqztr and 4711"), 1.0);
        assert_eq!(score(&item, "The words are apple and BANANA."), 0.5);
        assert_eq!(score(&item, "4711"), 0.25);
        assert_eq!(score(&item, ""), 0.0);
        assert_eq!(score(&item, "app ban 471"), 0.0);
        assert_eq!(score(&item_with(&[]), "anything"), 0.0);
        let passkey = generate(TaskKind::Passkey, 3, 512, &rough_count);
        let key = passkey.answers[0].clone();
        assert_eq!(score(&passkey, &format!("The pass key is {key}.")), 1.0);
        assert_eq!(score(&passkey, "I do not know."), 0.0);
    }

    #[test]
    fn uuids_are_version_4() {
        let mut rng = Rng(1);
        for _ in 0..100 {
            let u = uuid(&mut rng);
            let groups: Vec<&str> = u.split('-').collect();
            assert_eq!(groups.iter().map(|g| g.len()).collect::<Vec<_>>(), [8, 4, 4, 4, 12]);
            assert!(groups[2].starts_with('4'));
            assert!(matches!(groups[3].as_bytes()[0], b'8' | b'9' | b'a' | b'b'));
        }
    }

    #[test]
    fn splitmix_matches_the_reference_sequence() {
        // First outputs of SplitMix64 from state 0, as published with the algorithm.
        let mut r = Rng(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(r.next_u64(), 0x06C4_5D18_8009_454F);
    }
}
