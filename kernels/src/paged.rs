//! Device-tier KV storage ([`KvStorage`]: one f32 arena for K, one for V, addressed by block index) and the
//! per-sequence attention view ([`AttnSeq`]) that `kv_write` and `paged_attention` read through.
//!
//! Block `b`, slot `s` starts at `(b * block_size + s) * head_dim` in each arena. A block holds `block_size`
//! consecutive slots of ONE (layer, kv-head).

/// K and V arenas of `num_blocks` blocks, each `[block_size][head_dim]` f32.
#[derive(Clone, Debug)]
pub struct KvStorage {
    num_blocks: usize,
    block_size: usize,
    head_dim: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvStorage {
    /// Allocates zeroed K and V arenas. Panics if the size overflows or a dimension is zero.
    pub fn new(num_blocks: usize, block_size: usize, head_dim: usize) -> KvStorage {
        assert!(block_size > 0 && head_dim > 0, "block_size and head_dim must be non-zero");
        let len = num_blocks
            .checked_mul(block_size)
            .and_then(|x| x.checked_mul(head_dim))
            .expect("KvStorage size overflows usize");
        KvStorage { num_blocks, block_size, head_dim, k: vec![0.0; len], v: vec![0.0; len] }
    }

    /// Number of blocks in each arena.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Floats per slot.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Floats per block.
    #[inline]
    pub fn block_len(&self) -> usize {
        self.block_size * self.head_dim
    }

    #[inline]
    fn range(&self, b: u32) -> std::ops::Range<usize> {
        let b = b as usize;
        assert!(b < self.num_blocks, "block {b} out of range ({} blocks)", self.num_blocks);
        let l = self.block_len();
        b * l..(b + 1) * l
    }

    /// K of block `b`: `[block_size][head_dim]`.
    pub fn block_k(&self, b: u32) -> &[f32] {
        &self.k[self.range(b)]
    }

    /// V of block `b`: `[block_size][head_dim]`.
    pub fn block_v(&self, b: u32) -> &[f32] {
        &self.v[self.range(b)]
    }

    /// Mutable K of block `b`.
    pub fn block_k_mut(&mut self, b: u32) -> &mut [f32] {
        let r = self.range(b);
        &mut self.k[r]
    }

    /// Mutable V of block `b`.
    pub fn block_v_mut(&mut self, b: u32) -> &mut [f32] {
        let r = self.range(b);
        &mut self.v[r]
    }

    /// Copies K and V of block `src` into block `dst`.
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let s = self.range(src);
        let d = self.range(dst);
        self.k.copy_within(s.clone(), d.start);
        self.v.copy_within(s, d.start);
    }

    /// Copies K and V of slot `src_slot` of block `src` over slot `dst_slot` of block `dst`: the per-KV move of the
    /// KV-Compress paper's MoveCache (Alg. 1 lines 12–13), used to pack surviving slots after eviction so whole
    /// blocks can be freed. `src == dst` with `src_slot == dst_slot` is a no-op. Panics if a block or slot is out
    /// of range.
    pub fn move_slot(&mut self, src: u32, src_slot: usize, dst: u32, dst_slot: usize) {
        assert!(src_slot < self.block_size && dst_slot < self.block_size, "move_slot: slot out of range");
        let (s, d) = (self.range(src).start, self.range(dst).start);
        if s == d && src_slot == dst_slot {
            return;
        }
        let hd = self.head_dim;
        let (s, d) = (s + src_slot * hd, d + dst_slot * hd);
        self.k.copy_within(s..s + hd, d);
        self.v.copy_within(s..s + hd, d);
    }

    /// Compacts one (layer, kv-head) cache in place after eviction: slot `keep[j]` moves to slot `j`, so the
    /// survivors occupy `0..keep.len()` and blocks from `keep.len().div_ceil(block_size)` on can be freed by the
    /// caller. Returns `keep.len()`, the new length.
    ///
    /// Unlike KV-Compress's MoveCache, which fills holes with KVs taken from the tail (fewer moves, order lost),
    /// this preserves slot order: attention is causal in slot space ([`AttnSeq`]), so reordering would change
    /// which cached tokens later chunk tokens may see. `keep` must be strictly ascending with every entry `< len`
    /// (checked in debug builds); then each destination `j <= keep[j]` is never the source of a later move. Slots
    /// past the new length keep stale data.
    pub fn compact_table(&mut self, table: &[u32], len: usize, keep: &[u32]) -> usize {
        debug_assert!(keep.windows(2).all(|w| w[0] < w[1]), "compact_table: keep is not strictly ascending");
        debug_assert!(keep.last().is_none_or(|&l| (l as usize) < len), "compact_table: keep has a slot >= len");
        debug_assert!(table.len() >= len.div_ceil(self.block_size), "compact_table: table too short for len");
        let bs = self.block_size;
        for (j, &src) in keep.iter().enumerate() {
            let src = src as usize;
            if src != j {
                self.move_slot(table[src / bs], src % bs, table[j / bs], j % bs);
            }
        }
        keep.len()
    }

    /// Both arenas, whole (`num_blocks * block_size * head_dim` each).
    pub fn arenas(&self) -> (&[f32], &[f32]) {
        (&self.k, &self.v)
    }

    /// Both arenas, mutable.
    pub fn arenas_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        (&mut self.k, &mut self.v)
    }
}

/// One sequence's view for ONE layer during a forward step.
///
/// Causality is in slot space: new token `j` of a sequence attends to slots `[0, prior_lens[h] + j]` of each
/// kv-head `h`. The caller guarantees `tables[h]` has capacity for `prior_lens[h] + n_new` slots.
#[derive(Clone, Copy, Debug)]
pub struct AttnSeq<'a> {
    /// First row of this sequence in the batch's q/k/v/out matrices.
    pub q_row: usize,
    /// Tokens computed this step (1 for decode, chunk length for prefill).
    pub n_new: usize,
    /// Block table per kv-head of this layer (len n_kv_heads).
    pub tables: &'a [Vec<u32>],
    /// Cache length per kv-head BEFORE this step's tokens (len n_kv_heads).
    pub prior_lens: &'a [usize],
}
