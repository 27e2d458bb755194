//! N-gram speculative decoding (prompt lookup, vLLM's `ngram` method): the draft proposer and its settings.
//!
//! A running sequence whose last tokens repeat an earlier stretch of its own tokens (prompt or answer) is
//! likely to go on as that stretch did: code edited in place, a quoted passage, a JSON answer that repeats the
//! prompt's keys. The proposer looks the longest such suffix up and offers the tokens that followed it as a
//! draft; the scheduler computes the draft together with the sequence's next token in one step, and the engine
//! keeps the draft's longest prefix that the sampler itself picks, plus the sampler's own token after it.
//!
//! Verification samples each position with the request's own sampler, in order, and stops at the first token
//! that differs from the draft. Every emitted token is therefore one the sampler drew from the same logits it
//! would have seen without speculation: greedy answers are the same, and so are seeded samples, because a
//! draft token costs the random stream nothing until the sampler draws it. (This is rejection sampling with a
//! one-hot draft distribution: accept draft `d` with probability `p(d)`, else draw from `p` without `d`, which
//! is a draw from `p`.)

/// Settings of the n-gram proposer. `num_tokens == 0` turns speculation off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NgramConfig {
    /// Draft tokens proposed per step and sequence (vLLM's `num_speculative_tokens`).
    pub num_tokens: usize,
    /// Shortest suffix looked up (vLLM's `prompt_lookup_min`).
    pub min_n: usize,
    /// Longest suffix looked up (vLLM's `prompt_lookup_max`); the longest that matches wins.
    pub max_n: usize,
    /// Speculate only while at most this many sequences run: a larger batch fills the step with real work, and
    /// drafts then cost compute the batch would have used (vLLM's `disable_by_batch_size`).
    pub max_batch: usize,
    /// The cost of a draft token in single-token steps, pinned; `None` measures it from the engine's own steps
    /// ([`DraftCost`]). `Some(0.0)` drafts as long as allowed whenever a suffix matches, which makes what is
    /// drafted independent of timing (the tests pin it so).
    pub draft_cost: Option<f64>,
}

/// Most draft tokens per step a configuration may ask for.
pub const MAX_DRAFT_TOKENS: usize = 16;
/// Longest suffix a configuration may look up.
pub const MAX_NGRAM: usize = 16;
/// How far back the lookup scans (tokens): bounds its work per step on long contexts.
pub const LOOKBACK_TOKENS: usize = 8192;

impl NgramConfig {
    /// Speculation off.
    pub const fn off() -> NgramConfig {
        NgramConfig { num_tokens: 0, min_n: 2, max_n: 4, max_batch: 4, draft_cost: None }
    }

    pub fn enabled(&self) -> bool {
        self.num_tokens > 0
    }

    /// Checks the bounds; the message names the setting.
    pub fn validate(&self) -> Result<(), String> {
        if self.num_tokens > MAX_DRAFT_TOKENS {
            return Err(format!("speculative tokens: at most {MAX_DRAFT_TOKENS}, got {}", self.num_tokens));
        }
        if self.min_n == 0 || self.min_n > self.max_n || self.max_n > MAX_NGRAM {
            return Err(format!("n-gram sizes: need 1 <= min ({}) <= max ({}) <= {MAX_NGRAM}", self.min_n, self.max_n));
        }
        if self.max_batch == 0 {
            return Err("speculation batch limit: at least 1".into());
        }
        if let Some(c) = self.draft_cost
            && !(0.0..=16.0).contains(&c)
        {
            return Err(format!("draft token cost: between 0 and 16 single-token steps, got {c}"));
        }
        Ok(())
    }
}

impl Default for NgramConfig {
    fn default() -> NgramConfig {
        NgramConfig::off()
    }
}

/// A step that computes a draft of `k` tokens costs `1 + cost · k` single-token steps before any timing is seen: a
/// starting guess (from step-time logs of SmolLM2-135M on two CPU cores) that the engine replaces with what its own
/// steps take ([`DraftCost`]).
pub const PRIOR_DRAFT_TOKEN_COST: f64 = 0.2;
/// What the running estimates keep of the past per observation (acceptance per sequence, cost per engine): about
/// the last five drafts count.
const DECAY: f64 = 0.8;
/// What a step that does not draft because acceptance was too low forgets of the rejections: the estimate drifts
/// back up, and a later step tries a draft again (the text may have started to repeat).
const IDLE_FORGET: f64 = 0.95;

/// How often a sequence's drafts have been accepted lately: the draft length that pays for itself follows from it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Acceptance {
    /// Accepted draft tokens and rejections (a draft with a token the sampler did not pick), both decayed by
    /// [`DECAY`] per draft.
    accepted: f64,
    rejected: f64,
}

impl Acceptance {
    /// The probability that the next draft token is accepted, under a geometric model (each draft token is
    /// accepted with the same probability, until the first is not): the decayed maximum-likelihood estimate
    /// with one accepted and one rejected token as its prior.
    pub fn rate(&self) -> f64 {
        (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)
    }

    /// Records a settled draft of `proposed` tokens of which the first `accepted` were taken.
    pub fn record(&mut self, accepted: usize, proposed: usize) {
        self.accepted = self.accepted * DECAY + accepted as f64;
        self.rejected = self.rejected * DECAY + f64::from(u8::from(accepted < proposed));
    }

    /// A step where no draft was worth it: forget some rejections.
    pub fn idle(&mut self) {
        self.rejected *= IDLE_FORGET;
    }
}

/// The draft length, at most `max`, that maximises the expected tokens per unit of step time: with acceptance
/// probability `accept` a draft of `k` yields `1 + a + … + a^k` tokens for a step costing `1 + cost · k`
/// single-token steps. 0 when no draft pays for itself.
pub fn draft_length(accept: f64, cost: f64, max: usize) -> usize {
    let (accept, cost) = (accept.clamp(0.0, 1.0), cost.max(0.0));
    let (mut best, mut best_k) = (1.0, 0);
    let (mut expected, mut p) = (1.0, 1.0);
    for k in 1..=max {
        p *= accept;
        expected += p;
        let per_cost = expected / (1.0 + cost * k as f64);
        if per_cost > best * (1.0 + 1e-9) {
            (best, best_k) = (per_cost, k);
        }
    }
    best_k
}

/// The running estimate of what a draft token costs, in single-token steps, from the engine's own step times.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftCost {
    /// Seconds of a one-sequence step computing one token (decayed mean); `None` before the first.
    single: Option<f64>,
    /// Extra cost of one draft token relative to `single`.
    per_token: f64,
}

impl Default for DraftCost {
    fn default() -> DraftCost {
        DraftCost { single: None, per_token: PRIOR_DRAFT_TOKEN_COST }
    }
}

impl DraftCost {
    pub fn per_token(&self) -> f64 {
        self.per_token
    }

    /// Records a one-sequence step of `1 + draft` tokens that took `seconds`.
    pub fn observe(&mut self, draft: usize, seconds: f64) {
        if !(seconds.is_finite() && seconds > 0.0) {
            return;
        }
        match (draft, self.single) {
            (0, None) => self.single = Some(seconds),
            (0, Some(t)) => self.single = Some(t * DECAY + seconds * (1.0 - DECAY)),
            (d, Some(t)) => {
                let sample = ((seconds / t - 1.0) / d as f64).clamp(0.0, 4.0);
                self.per_token = self.per_token * DECAY + sample * (1.0 - DECAY);
            }
            (_, None) => {}
        }
    }
}

/// Proposes up to `k` draft tokens for a sequence whose tokens so far are `tokens`, into `out` (cleared first):
/// the tokens that followed the most recent earlier occurrence of the longest suffix of `min_n..=max_n` tokens
/// that occurred before. Scans at most [`LOOKBACK_TOKENS`] back. Returns the number proposed (0: no match).
pub fn propose(tokens: &[u32], cfg: &NgramConfig, k: usize, out: &mut Vec<u32>) -> usize {
    out.clear();
    let len = tokens.len();
    if k == 0 || cfg.min_n == 0 {
        return 0;
    }
    let window_start = len.saturating_sub(LOOKBACK_TOKENS);
    for n in (cfg.min_n..=cfg.max_n).rev() {
        if len <= n {
            continue;
        }
        let suffix = &tokens[len - n..];
        let last = suffix[n - 1];
        // Occurrences ending before the suffix's own last token, most recent first, so at least one token
        // follows each.
        let mut end = len - 1;
        while end > window_start.max(n - 1) {
            end -= 1;
            if tokens[end] != last {
                continue;
            }
            let start = end + 1 - n;
            if start < window_start || tokens[start..=end] != *suffix {
                continue;
            }
            let follow = &tokens[end + 1..(end + 1 + k).min(len)];
            out.extend_from_slice(follow);
            return out.len();
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(min_n: usize, max_n: usize) -> NgramConfig {
        NgramConfig { num_tokens: 4, min_n, max_n, max_batch: 4, draft_cost: None }
    }

    fn naive(tokens: &[u32], c: &NgramConfig, k: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (c.min_n..=c.max_n).rev() {
            if len <= n {
                continue;
            }
            let suffix = &tokens[len - n..];
            for start in (0..len - n).rev() {
                if &tokens[start..start + n] == suffix {
                    return tokens[start + n..(start + n + k).min(len)].to_vec();
                }
            }
        }
        Vec::new()
    }

    #[test]
    fn the_longest_suffix_wins_and_its_latest_occurrence() {
        let mut out = Vec::new();
        // Suffix [2, 3]: occurs at 1 (followed by 9) and at 5 (followed by 7); the latest wins.
        let t = [1, 2, 3, 9, 0, 2, 3, 7, 5, 2, 3];
        assert_eq!(propose(&t, &cfg(1, 3), 2, &mut out), 2);
        assert_eq!(out, [7, 5]);
        // A longer suffix [5, 2, 3] would win, but it occurs nowhere earlier; [0, 2, 3] does, once.
        let t = [1, 0, 2, 3, 8, 8, 6, 2, 3, 4, 0, 2, 3];
        propose(&t, &cfg(1, 3), 3, &mut out);
        assert_eq!(out, [8, 8, 6]);
    }

    #[test]
    fn no_match_shorter_than_min_and_the_draft_stops_at_the_end() {
        let mut out = vec![42];
        assert_eq!(propose(&[1, 2, 3, 4], &cfg(2, 4), 4, &mut out), 0);
        assert!(out.is_empty());
        // [1, 2] at 0 is followed by [1, 2] itself: the draft may run into the suffix, not past the end.
        assert_eq!(propose(&[1, 2, 1, 2], &cfg(2, 2), 5, &mut out), 2);
        assert_eq!(out, [1, 2]);
        assert_eq!(propose(&[5; 3], &cfg(1, 1), 8, &mut out), 1);
        assert_eq!(propose(&[], &cfg(1, 1), 8, &mut out), 0);
        assert_eq!(propose(&[3, 3], &cfg(1, 1), 0, &mut out), 0);
    }

    #[test]
    fn agrees_with_a_naive_search_on_random_sequences() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut out = Vec::new();
        for round in 0..2_000 {
            let len = (next() % 60) as usize;
            let alphabet = 2 + (next() % 5) as u32;
            let t: Vec<u32> = (0..len).map(|_| (next() % alphabet as u64) as u32).collect();
            let min_n = 1 + round % 3;
            let c = cfg(min_n, min_n + round % 4);
            let k = 1 + round % 6;
            propose(&t, &c, k, &mut out);
            assert_eq!(out, naive(&t, &c, k), "tokens {t:?} cfg {c:?} k {k}");
        }
    }

    #[test]
    fn the_draft_length_pays_for_itself() {
        // Free drafts: as long as allowed, unless nothing is ever accepted.
        assert_eq!(draft_length(0.5, 0.0, 6), 6);
        assert_eq!(draft_length(0.0, 0.0, 6), 0);
        // Costly drafts: none at low acceptance, a few at high acceptance, longer ones as it nears 1.
        assert_eq!(draft_length(0.1, 0.2, 8), 0);
        assert_eq!(draft_length(0.3, 0.2, 8), 1);
        let (mid, high) = (draft_length(0.7, 0.2, 16), draft_length(0.95, 0.2, 16));
        assert!((2..=4).contains(&mid) && high > mid && high <= 16, "{mid} {high}");
        // The choice is the best of every length, by brute force.
        for a in [0.05f64, 0.2, 0.45, 0.6, 0.8, 0.9, 0.99] {
            for c in [0.01, 0.1, 0.2, 0.5, 1.0] {
                let rate = |k: usize| (0..=k).map(|i| a.powi(i as i32)).sum::<f64>() / (1.0 + c * k as f64);
                let k = draft_length(a, c, 10);
                assert!((0..=10).all(|j| rate(j) <= rate(k) + 1e-9), "a {a} c {c}: {k}");
            }
        }
    }

    #[test]
    fn acceptance_follows_recent_drafts_and_recovers_when_idle() {
        let mut a = Acceptance::default();
        assert_eq!(a.rate(), 0.5);
        for _ in 0..20 {
            a.record(4, 4);
        }
        assert!(a.rate() > 0.95, "{}", a.rate());
        for _ in 0..20 {
            a.record(0, 4);
        }
        let low = a.rate();
        assert!(low < 0.2, "{low}");
        a.idle();
        a.idle();
        assert!(a.rate() > low);
    }

    #[test]
    fn the_cost_estimate_follows_step_times() {
        let mut c = DraftCost::default();
        assert_eq!(c.per_token(), PRIOR_DRAFT_TOKEN_COST);
        c.observe(4, 0.010); // no single-token step seen yet: ignored
        assert_eq!(c.per_token(), PRIOR_DRAFT_TOKEN_COST);
        for _ in 0..100 {
            c.observe(0, 0.004);
            c.observe(4, 0.0048); // 4 draft tokens cost 0.2 of a step: 0.05 each
        }
        assert!((c.per_token() - 0.05).abs() < 0.01, "{}", c.per_token());
        c.observe(0, f64::NAN);
        c.observe(2, -1.0);
        assert!((c.per_token() - 0.05).abs() < 0.01);
    }

    #[test]
    fn settings_are_bounded() {
        assert!(NgramConfig::off().validate().is_ok());
        assert!(NgramConfig { num_tokens: 17, ..NgramConfig::off() }.validate().is_err());
        assert!(NgramConfig { min_n: 0, ..NgramConfig::off() }.validate().is_err());
        assert!(NgramConfig { min_n: 5, max_n: 4, ..NgramConfig::off() }.validate().is_err());
        assert!(NgramConfig { max_n: 17, ..NgramConfig::off() }.validate().is_err());
        assert!(NgramConfig { max_batch: 0, ..NgramConfig::off() }.validate().is_err());
        assert!(NgramConfig { draft_cost: Some(0.0), ..NgramConfig::off() }.validate().is_ok());
        assert!(NgramConfig { draft_cost: Some(-0.1), ..NgramConfig::off() }.validate().is_err());
        assert!(NgramConfig { draft_cost: Some(f64::NAN), ..NgramConfig::off() }.validate().is_err());
    }
}
