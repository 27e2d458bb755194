//! The device-tier KV cache bookkeeping (DESIGN §3): which physical blocks exist and who holds them.
//!
//! - [`block_pool`]: a bounded pool of block ids with ref counts, the truly-free list, the LRU queue of idle
//!   prefix-cached block groups, and the prefix index it evicts from.
//! - [`prefix`]: the xxh3 chain hash over full token blocks (salted with model id and namespace) and the
//!   hash → block group index.
//! - [`sequence`]: one sequence's block tables and cache lengths per (layer, kv-head).
//!
//! Everything here is a plain struct with a single owner (the engine thread); no locks.

pub mod block_pool;
pub mod prefix;
pub mod sequence;

pub use block_pool::{BlockPool, IndexChange};
pub use prefix::{
    CLIENT_SALT_KIND, PrefixIndex, block_hashes, chain_hash, check_namespace, extend_block_hashes, salted_namespace,
};
pub use sequence::SeqBlocks;

/// Index of a block in the KV arena (K and V share it).
pub type BlockId = u32;

/// Shape of the cache: how many block tables a sequence has and how many slots a block holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub block_size: usize,
}

impl CacheLayout {
    /// Blocks in one block group: one block per (layer, kv-head) for one block of tokens.
    pub fn group_size(&self) -> usize {
        self.n_layers * self.n_kv_heads
    }

    /// Block groups needed to hold `tokens` slots in every table.
    pub fn groups_for_tokens(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Blocks needed to hold `tokens` slots in every table.
    pub fn blocks_for_tokens(&self, tokens: usize) -> usize {
        self.groups_for_tokens(tokens) * self.group_size()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    #[error("out of KV blocks: need {needed}, only {available} free or evictable")]
    OutOfBlocks { needed: usize, available: usize },
    #[error("block id {0} is outside the pool")]
    InvalidBlock(BlockId),
    #[error("block {0} is free; it cannot be shared or released")]
    NotAllocated(BlockId),
    #[error("invalid eviction for table {table} of length {len}")]
    BadKeep { table: usize, len: usize },
}
