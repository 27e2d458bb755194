//! Which eviction policy a sequence runs and with what budget ([`PolicySpec`]), parsed and validated from the
//! API's names, with each paper's default hyper-parameters in one place.

/// The eviction policies (DESIGN §4). Budgets are tokens per (layer, kv-head); `KvCompress` spends the same
/// total (budget × tables) unevenly across heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Keep everything.
    Full,
    /// StreamingLLM: 4 sink tokens + the most recent tokens, every step.
    Streaming,
    /// Inverse key L2 norm: drop the keys with the highest ‖K‖₂, after prefill and on each decode step.
    Knorm,
    /// KeyDiff: drop the keys most similar (cosine) to the mean normalised key, with block prompt processing
    /// (evicting after every 128-token prompt block, so the cache never exceeds budget + block).
    Keydiff,
    /// PagedEviction: ‖V‖/‖K‖ token eviction after prefill between the kept first and last blocks, then one whole
    /// block each time the last block fills.
    PagedEviction,
    /// SAGE-KV: once after prefill, sinks + per-query-head top-k by last-token attention + a recent window that
    /// slides during decode.
    Sage,
    /// SnapKV: attention of the last w = 8 prompt queries, max-pooled (p = 7), summed over the query group.
    Snapkv,
    /// H2O: accumulated attention of every query (prompt and generated); half heavy hitters, half recent.
    H2o,
    /// KV-Compress: squared window attention (w = 8, p = 7, query-group sum); variable per-(layer, head)
    /// block eviction across the whole sequence; after prefill and under memory pressure.
    KvCompress,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 9] = [
        PolicyKind::Full,
        PolicyKind::Streaming,
        PolicyKind::Knorm,
        PolicyKind::Keydiff,
        PolicyKind::PagedEviction,
        PolicyKind::Sage,
        PolicyKind::Snapkv,
        PolicyKind::H2o,
        PolicyKind::KvCompress,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Full => "full",
            PolicyKind::Streaming => "streaming",
            PolicyKind::Knorm => "knorm",
            PolicyKind::Keydiff => "keydiff",
            PolicyKind::PagedEviction => "paged_eviction",
            PolicyKind::Sage => "sage",
            PolicyKind::Snapkv => "snapkv",
            PolicyKind::H2o => "h2o",
            PolicyKind::KvCompress => "kv_compress",
        }
    }

    pub fn parse(s: &str) -> Option<PolicyKind> {
        PolicyKind::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Index into per-policy counters.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Names accepted by [`PolicyKind::parse`], for error messages.
pub fn policy_names() -> String {
    PolicyKind::ALL.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ")
}

/// The papers' defaults.
pub mod defaults {
    /// StreamingLLM (and H2O's implementation) keep the first 4 tokens as attention sinks.
    pub const SINK_TOKENS: usize = 4;
    /// SnapKV / KV-Compress observation window.
    pub const WINDOW: usize = 8;
    /// SnapKV / KV-Compress max-pool kernel.
    pub const POOL: usize = 7;
    /// KeyDiff's prompt block size B (paper §4: B = 128 for every experiment).
    pub const KEYDIFF_PROMPT_BLOCK: usize = 128;
    /// Budget when a request names a pruning policy but no budget.
    pub const BUDGET_TOKENS: usize = 1024;
    /// Smallest budget: below this the sinks and windows above no longer fit.
    pub const MIN_BUDGET_TOKENS: usize = 16;
}

/// A sequence's policy: which one and its budget in tokens per (layer, kv-head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PolicySpec {
    pub kind: PolicyKind,
    pub budget_tokens: usize,
}

impl Default for PolicySpec {
    fn default() -> PolicySpec {
        PolicySpec::full()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("unknown KV policy `{0}`; known policies: {names}", names = policy_names())]
    Unknown(String),
    #[error("KV budget {got} tokens is below the minimum of {min}")]
    BudgetTooSmall { got: usize, min: usize },
    #[error("KV budget {got} tokens exceeds the context length {max}")]
    BudgetTooLarge { got: usize, max: usize },
}

impl PolicySpec {
    pub fn full() -> PolicySpec {
        PolicySpec { kind: PolicyKind::Full, budget_tokens: 0 }
    }

    /// Builds a spec from API input: `name` (None = `default`), `budget` (None or 0 = the default budget).
    pub fn parse(
        name: Option<&str>,
        budget: Option<usize>,
        default: PolicySpec,
        max_budget: usize,
    ) -> Result<PolicySpec, PolicyError> {
        let kind = match name {
            None | Some("") => default.kind,
            Some(n) => PolicyKind::parse(n).ok_or_else(|| PolicyError::Unknown(n.chars().take(64).collect()))?,
        };
        if kind == PolicyKind::Full {
            return Ok(PolicySpec::full());
        }
        let budget = match budget {
            Some(b) if b > 0 => b,
            _ if default.kind != PolicyKind::Full && default.budget_tokens > 0 => default.budget_tokens,
            _ => defaults::BUDGET_TOKENS,
        };
        if budget < defaults::MIN_BUDGET_TOKENS {
            return Err(PolicyError::BudgetTooSmall { got: budget, min: defaults::MIN_BUDGET_TOKENS });
        }
        if budget > max_budget {
            return Err(PolicyError::BudgetTooLarge { got: budget, max: max_budget });
        }
        Ok(PolicySpec { kind, budget_tokens: budget })
    }

    pub fn is_full(&self) -> bool {
        self.kind == PolicyKind::Full
    }

    /// Prompt tokens at the end that must be computed (not adopted from the prefix cache) so the policy can
    /// observe their queries.
    pub fn min_computed_tail(&self, prompt_len: usize) -> usize {
        match self.kind {
            PolicyKind::Snapkv | PolicyKind::KvCompress => defaults::WINDOW,
            // H2O accumulates the attention of every prompt query; KeyDiff's block prompt processing evicts from
            // the first prompt block on, so a full-cache prefix is not its cache.
            PolicyKind::H2o | PolicyKind::Keydiff => prompt_len,
            _ => 1,
        }
    }

    /// Largest prefill chunk this policy accepts (KeyDiff's block prompt processing).
    pub fn max_prefill_chunk(&self) -> usize {
        match self.kind {
            PolicyKind::Keydiff => defaults::KEYDIFF_PROMPT_BLOCK,
            _ => usize::MAX,
        }
    }

    /// SAGE-KV's split of the budget C for query group size G (paper appendix: sink C/4, top-k per query head
    /// = the power of two at or below C/(2G), the rest recent). Returns (sink, k, recent).
    pub fn sage_split(&self, group: usize) -> (usize, usize, usize) {
        let c = self.budget_tokens;
        let sink = c / 4;
        let per = (c / (2 * group.max(1))).max(1);
        let k = 1usize << (usize::BITS - 1 - per.leading_zeros());
        let recent = c.saturating_sub(sink + group * k);
        (sink, k, recent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_names_budgets_and_errors() {
        let d = PolicySpec::full();
        assert_eq!(PolicySpec::parse(None, None, d, 8192), Ok(PolicySpec::full()));
        assert_eq!(
            PolicySpec::parse(Some("snapkv"), Some(256), d, 8192),
            Ok(PolicySpec { kind: PolicyKind::Snapkv, budget_tokens: 256 })
        );
        assert_eq!(PolicySpec::parse(Some("knorm"), None, d, 8192).unwrap().budget_tokens, 1024);
        assert!(matches!(PolicySpec::parse(Some("lru"), None, d, 8192), Err(PolicyError::Unknown(_))));
        assert!(matches!(PolicySpec::parse(Some("h2o"), Some(8), d, 8192), Err(PolicyError::BudgetTooSmall { .. })));
        assert!(matches!(PolicySpec::parse(Some("h2o"), Some(9000), d, 8192), Err(PolicyError::BudgetTooLarge { .. })));
        for k in PolicyKind::ALL {
            assert_eq!(PolicyKind::parse(k.name()), Some(k));
        }
        // A worker default applies when the request names none.
        let wd = PolicySpec { kind: PolicyKind::Streaming, budget_tokens: 512 };
        assert_eq!(PolicySpec::parse(None, None, wd, 8192), Ok(wd));
        assert_eq!(PolicySpec::parse(Some("knorm"), None, wd, 8192).unwrap().budget_tokens, 512);
    }

    #[test]
    fn sage_split_matches_the_paper_examples() {
        // Llama-3.1-8B: C = 8192, G = 4 → sink 2048, k = 1024, recent 2048.
        let s = PolicySpec { kind: PolicyKind::Sage, budget_tokens: 8192 };
        assert_eq!(s.sage_split(4), (2048, 1024, 2048));
        // Qwen2.5: G = 7 → k = 512, recent = 8192 - 2048 - 7·512 = 2560.
        assert_eq!(s.sage_split(7), (2048, 512, 2560));
    }
}
