//! The device KV arenas ([`CudaKv`]: head-paged, **f16** K and V arenas, same block layout as [`KvStorage`]) and
//! the kernels that maintain them (`kv.cu`): KV write, block copy/compaction, and the eviction-policy scores.
//!
//! CPU twins: [`CudaContext::kv_write`] ↔ `Backend::kv_write`, [`CudaContext::copy_blocks`] ↔
//! `KvStorage::copy_block`, [`CudaContext::window_attention_scores`] ↔ `scores::window_attention_scores`; the norm
//! and cosine kernels are held to their definitions in the parity tests.

use super::context::CudaContext;
use super::error::CudaError;
use super::ops::{grid_dim, to_i32};
use crate::paged::{AttnSeq, KvArenas, KvStorage};
use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};

/// Head-paged K and V arenas in device memory, f16: block `b`, slot `s` starts at `(b * block_size + s) * head_dim`.
/// A block holds `block_size` consecutive slots of ONE (layer, kv-head). K and V share block indices.
pub struct CudaKv {
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    num_blocks: usize,
    block_size: usize,
    head_dim: usize,
}

impl std::fmt::Debug for CudaKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKv")
            .field("num_blocks", &self.num_blocks)
            .field("block_size", &self.block_size)
            .field("head_dim", &self.head_dim)
            .finish()
    }
}

fn arena_len(num_blocks: usize, block_size: usize, head_dim: usize) -> Result<usize, CudaError> {
    if block_size == 0 || head_dim == 0 {
        return Err(CudaError::invalid("CudaKv", "block_size and head_dim must be non-zero"));
    }
    let len = num_blocks
        .checked_mul(block_size)
        .and_then(|x| x.checked_mul(head_dim))
        .ok_or_else(|| CudaError::invalid("CudaKv", "arena size overflows"))?;
    // Slot indices travel as u32.
    if num_blocks.saturating_mul(block_size) > u32::MAX as usize {
        return Err(CudaError::invalid("CudaKv", "num_blocks * block_size must fit in u32"));
    }
    Ok(len)
}

impl CudaKv {
    /// Zeroed arenas.
    pub fn new(cx: &CudaContext, num_blocks: usize, block_size: usize, head_dim: usize) -> Result<CudaKv, CudaError> {
        let len = arena_len(num_blocks, block_size, head_dim)?;
        Ok(CudaKv { k: cx.zeros(len)?, v: cx.zeros(len)?, num_blocks, block_size, head_dim })
    }

    /// Uploads a host cache: an f16 one as it is, an f32 one rounded to f16.
    pub fn from_host(cx: &CudaContext, kv: &KvStorage) -> Result<CudaKv, CudaError> {
        arena_len(kv.num_blocks(), kv.block_size(), kv.head_dim())?;
        let h = |a: &[f32]| a.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect::<Vec<u16>>();
        let (k, v) = match kv.arenas_any() {
            KvArenas::F32 { k, v } => (cx.upload(&h(k))?, cx.upload(&h(v))?),
            KvArenas::F16 { k, v } => (cx.upload(k)?, cx.upload(v)?),
            KvArenas::Scaled { dtype, .. } => {
                return Err(CudaError::Unsupported(format!("{dtype} KV caches on the GPU backend")));
            }
        };
        Ok(CudaKv { k, v, num_blocks: kv.num_blocks(), block_size: kv.block_size(), head_dim: kv.head_dim() })
    }

    /// Downloads into a host cache (f16 widened to f32).
    pub fn to_host(&self, cx: &CudaContext) -> Result<KvStorage, CudaError> {
        let mut out = KvStorage::new(self.num_blocks, self.block_size, self.head_dim);
        let (k, v) = (cx.download(&self.k)?, cx.download(&self.v)?);
        let (hk, hv) = out.arenas_mut();
        for (o, &b) in hk.iter_mut().zip(&k) {
            *o = half::f16::from_bits(b).to_f32();
        }
        for (o, &b) in hv.iter_mut().zip(&v) {
            *o = half::f16::from_bits(b).to_f32();
        }
        Ok(out)
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Values per slot.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Bytes of one arena.
    pub fn arena_bytes(&self) -> usize {
        self.k.len() * 2
    }

    /// The K and V arenas (f16 bits).
    pub fn arenas(&self) -> (&CudaSlice<u16>, &CudaSlice<u16>) {
        (&self.k, &self.v)
    }

    /// The K and V arenas, mutable.
    pub fn arenas_mut(&mut self) -> (&mut CudaSlice<u16>, &mut CudaSlice<u16>) {
        (&mut self.k, &mut self.v)
    }

    pub(crate) fn check_table(&self, op: &'static str, table: &[u32], slots: usize) -> Result<(), CudaError> {
        if let Some(&b) =
            visible_blocks(op, table, slots, self.block_size)?.iter().find(|&&b| b as usize >= self.num_blocks)
        {
            return Err(CudaError::invalid(op, format!("block {b} out of range ({} blocks)", self.num_blocks)));
        }
        Ok(())
    }
}

/// The blocks of `table` that hold its first `slots` slots, or an error when the table is shorter.
pub(crate) fn visible_blocks<'a>(
    op: &'static str,
    table: &'a [u32],
    slots: usize,
    block_size: usize,
) -> Result<&'a [u32], CudaError> {
    let need = slots.div_ceil(block_size);
    table
        .get(..need)
        .ok_or_else(|| CudaError::invalid(op, format!("block table has {} blocks, {need} needed", table.len())))
}

/// One (sequence, kv-head) table to score: its first `len` slots.
#[derive(Debug, Clone, Copy)]
pub struct ScoreEntry<'a> {
    /// Block table of one (sequence, layer, kv-head).
    pub table: &'a [u32],
    /// Slots in use.
    pub len: usize,
}

/// Per-slot scores of several [`ScoreEntry`]s, concatenated: entry `e` owns `offsets[e]..offsets[e + 1]`.
#[derive(Debug, Clone, Default)]
pub struct SlotScores {
    /// Start of each entry, plus the total at the end.
    pub offsets: Vec<usize>,
    /// `‖K‖₂` per slot (only for [`CudaContext::slot_norms`]).
    pub knorm: Vec<f32>,
    /// `‖V‖₂ / ‖K‖₂` per slot ([`CudaContext::slot_norms`]) or `cos(K, anchor)` ([`CudaContext::anchor_cosine`]).
    pub score: Vec<f32>,
}

/// One (sequence, kv-head) entry of [`CudaContext::window_attention_scores`]: its table, its first `len` slots,
/// and the observation window's queries `q` (`[n_q][group][head_dim]`, post-RoPE), query `i` seeing slots
/// `0..=first_q_slot + i`.
#[derive(Debug, Clone, Copy)]
pub struct WindowEntry<'a> {
    pub table: &'a [u32],
    pub len: usize,
    pub q: &'a [f32],
    pub n_q: usize,
    pub first_q_slot: usize,
}

/// Slots `from..to` of one (sequence, kv-head) table ([`CudaContext::unit_key_sums`]).
#[derive(Debug, Clone, Copy)]
pub struct SlotRange<'a> {
    pub table: &'a [u32],
    pub from: usize,
    pub to: usize,
}

/// Warps per CTA of `unit_key_sum_f16` (its `UKS_WARPS`).
const UKS_WARPS: u32 = 4;

/// Largest `power` [`CudaContext::window_attention_scores`] takes (the papers use 1 and 2; 0 counts queries).
pub const MAX_WINDOW_POWER: u32 = 8;

struct ScoreMeta {
    meta: CudaSlice<u32>,
    n_tab: usize,
    n: usize,
    offsets: Vec<usize>,
    max_len: usize,
}

impl ScoreMeta {
    /// The device metadata's four parts: the entries' concatenated tables, and per entry its length, table offset
    /// and output offset.
    fn views(&self) -> [CudaView<'_, u32>; 4] {
        let (t, n) = (self.n_tab, self.n);
        [
            self.meta.slice(..t),
            self.meta.slice(t..t + n),
            self.meta.slice(t + n..t + 2 * n),
            self.meta.slice(t + 2 * n..),
        ]
    }

    /// Slots scored over all entries.
    fn total(&self) -> usize {
        self.offsets[self.offsets.len() - 1]
    }
}

/// `ids` sorted, or `None` when one repeats: destinations written in parallel must be distinct.
pub(crate) fn sorted_distinct(ids: impl Iterator<Item = u32>) -> Option<Vec<u32>> {
    let mut v: Vec<u32> = ids.collect();
    v.sort_unstable();
    (!v.windows(2).any(|w| w[0] == w[1])).then_some(v)
}

/// One CUDA block of 256 threads per (arena block, half: K or V): the grid of the kernels that move or code whole
/// blocks.
pub(crate) fn per_block_cfg(op: &'static str, blocks: usize) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (grid_dim(op, "blocks", blocks, i32::MAX as usize)?, 2, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

const SCORE_WARPS: usize = 4;

/// A KV write staged into a step buffer ([`CudaContext::stage_kv_write`]): token rows at `tok_start..dst_start`,
/// destination slots (token-major, then kv-head) at `dst_start..end`.
#[derive(Debug, Clone, Copy)]
pub struct KvWritePlan {
    rows: usize,
    n_kv_heads: usize,
    tokens: usize,
    tok_start: usize,
    dst_start: usize,
    end: usize,
}

impl CudaContext {
    /// Writes this step's K and V rows (`k`, `v`: `[rows][n_kv_heads * head_dim]` f32) into slots
    /// `prior_lens[h] .. prior_lens[h] + n_new` of each kv-head, rounding to f16.
    pub fn kv_write(
        &self,
        kv: &mut CudaKv,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        seqs: &[AttnSeq<'_>],
        n_kv_heads: usize,
    ) -> Result<(), CudaError> {
        let w = n_kv_heads * kv.head_dim;
        if w == 0 || !k.len().is_multiple_of(w) {
            return Err(CudaError::invalid("kv_write", "k and v must both be [rows][n_kv_heads*head_dim]"));
        }
        let mut host = Vec::new();
        let plan = self.stage_kv_write(kv, k.len() / w, seqs, n_kv_heads, &mut host)?;
        if plan.tokens == 0 {
            return Ok(());
        }
        let meta = self.upload(&host)?;
        self.run_staged_kv_write(&plan, &meta, kv, k, v)
    }

    /// Validates a KV write of `rows` rows over `seqs` and appends its metadata (each token's row, then its
    /// destination slot per kv-head) to `stage`, the host copy of a step buffer uploaded once for all the step's
    /// plans and passed to [`CudaContext::run_staged_kv_write`].
    pub fn stage_kv_write(
        &self,
        kv: &CudaKv,
        rows: usize,
        seqs: &[AttnSeq<'_>],
        n_kv_heads: usize,
        stage: &mut Vec<u32>,
    ) -> Result<KvWritePlan, CudaError> {
        const OP: &str = "kv_write";
        let bs = kv.block_size;
        for s in seqs {
            check_seq(OP, s, n_kv_heads, rows)?;
            for h in 0..n_kv_heads {
                kv.check_table(OP, &s.tables[h], s.prior_lens[h] + s.n_new)?;
            }
        }
        let tok_start = stage.len();
        for s in seqs {
            stage.extend((0..s.n_new).map(|j| (s.q_row + j) as u32));
        }
        let dst_start = stage.len();
        for s in seqs {
            for j in 0..s.n_new {
                for h in 0..n_kv_heads {
                    let slot = s.prior_lens[h] + j;
                    stage.push(s.tables[h][slot / bs] * bs as u32 + (slot % bs) as u32);
                }
            }
        }
        Ok(KvWritePlan { rows, n_kv_heads, tokens: dst_start - tok_start, tok_start, dst_start, end: stage.len() })
    }

    /// Launches a KV write staged into the step buffer `meta`.
    pub fn run_staged_kv_write(
        &self,
        plan: &KvWritePlan,
        meta: &CudaSlice<u32>,
        kv: &mut CudaKv,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "kv_write";
        let hd = kv.head_dim;
        if k.len() != plan.rows * plan.n_kv_heads * hd || v.len() != k.len() {
            return Err(CudaError::invalid(OP, "k and v must both be [rows][n_kv_heads*head_dim] of the plan"));
        }
        if meta.len() < plan.end {
            return Err(CudaError::invalid(OP, "the step buffer is shorter than the plan's metadata"));
        }
        if plan.tokens == 0 {
            return Ok(());
        }
        let tok = meta.slice(plan.tok_start..plan.dst_start);
        let dst = meta.slice(plan.dst_start..plan.end);
        let cfg = LaunchConfig {
            grid_dim: (
                grid_dim(OP, "tokens", plan.tokens, i32::MAX as usize)?,
                grid_dim(OP, "n_kv_heads", plan.n_kv_heads, 65535)?,
                1,
            ),
            block_dim: (hd.next_multiple_of(32).min(256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (nkv, hd) = (to_i32(OP, "n_kv_heads", plan.n_kv_heads)?, to_i32(OP, "head_dim", hd)?);
        let (kc, vc) = (&mut kv.k, &mut kv.v);
        // SAFETY: rows and destination slots were validated against the batch and the arena when staged; the
        // arena's shape is checked above.
        unsafe {
            self.stream()
                .launch_builder(self.func("kv_write_f16")?)
                .arg(k)
                .arg(v)
                .arg(&tok)
                .arg(&dst)
                .arg(&nkv)
                .arg(&hd)
                .arg(kc)
                .arg(vc)
                .launch(cfg)
        }?;
        Ok(())
    }

    /// Copies K and V of block `src` into block `dst` for every pair (MoveCache compaction / block gather).
    /// Destinations must be distinct and no destination may also be a source, so the pairs are order-free.
    pub fn copy_blocks(&self, kv: &mut CudaKv, pairs: &[(u32, u32)]) -> Result<(), CudaError> {
        const OP: &str = "copy_blocks";
        if pairs.is_empty() {
            return Ok(());
        }
        let Some(dsts) = sorted_distinct(pairs.iter().map(|p| p.1)) else {
            return Err(CudaError::invalid(OP, "destination blocks must be distinct"));
        };
        let mut flat = Vec::with_capacity(pairs.len() * 2);
        for &(s, d) in pairs {
            if s as usize >= kv.num_blocks || d as usize >= kv.num_blocks {
                return Err(CudaError::invalid(OP, format!("pair ({s}, {d}) out of range ({} blocks)", kv.num_blocks)));
            }
            if s != d && dsts.binary_search(&s).is_ok() {
                return Err(CudaError::invalid(OP, format!("block {s} is both a source and a destination")));
            }
            flat.extend_from_slice(&[s, d]);
        }
        let dev = self.upload(&flat)?;
        let block_len = to_i32(OP, "block_size*head_dim", kv.block_size * kv.head_dim)?;
        let cfg = per_block_cfg(OP, pairs.len())?;
        let (kc, vc) = (&mut kv.k, &mut kv.v);
        // SAFETY: every block index is < num_blocks (checked); destinations do not alias sources.
        unsafe {
            self.stream()
                .launch_builder(self.func("copy_blocks_f16")?)
                .arg(kc)
                .arg(vc)
                .arg(&dev)
                .arg(&block_len)
                .launch(cfg)
        }?;
        Ok(())
    }

    /// Copies blocks `ids` out of the arenas, packed: entry `i` is block `ids[i]`'s K then its V,
    /// `block_size * head_dim` f16 bits each. That is the tiers' native f16 group layout, so a GPU worker's groups
    /// are a CPU f16 worker's. CPU twin: `KvStorage::arenas_any` sliced per block.
    pub fn read_blocks(&self, kv: &CudaKv, ids: &[u32]) -> Result<Vec<u16>, CudaError> {
        const OP: &str = "read_blocks";
        if let Some(&b) = ids.iter().find(|&&b| b as usize >= kv.num_blocks) {
            return Err(CudaError::invalid(OP, format!("block {b} out of range ({} blocks)", kv.num_blocks)));
        }
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let unit = kv.block_size * kv.head_dim;
        let mut packed = self.zeros::<u16>(ids.len() * 2 * unit)?;
        self.gather_units(OP, kv, &self.upload(ids)?, ids.len(), unit, &mut packed)?;
        self.download(&packed)
    }

    /// Writes `packed` (the layout of [`CudaContext::read_blocks`]) into arena blocks `ids`, which must be
    /// distinct.
    pub fn write_blocks(&self, kv: &mut CudaKv, ids: &[u32], packed: &[u16]) -> Result<(), CudaError> {
        const OP: &str = "write_blocks";
        let unit = kv.block_size * kv.head_dim;
        if packed.len() != ids.len() * 2 * unit {
            return Err(CudaError::invalid(OP, format!("{} halves for {} blocks of {unit}", packed.len(), ids.len())));
        }
        if sorted_distinct(ids.iter().copied()).is_none_or(|d| d.last().is_some_and(|&b| b as usize >= kv.num_blocks)) {
            return Err(CudaError::invalid(OP, "destinations must be distinct blocks of the arena"));
        }
        if ids.is_empty() {
            return Ok(());
        }
        self.scatter_units(OP, kv, &self.upload(ids)?, ids.len(), unit, &self.upload(packed)?)
    }

    /// Moves slots within the arenas: for each `(src, dst)` pair of global slot indices (`block * block_size +
    /// slot`), slot `dst` becomes what slot `src` held before the call, K and V. Destinations must be distinct; a
    /// destination may be another pair's source (compaction), since every source is read before any destination
    /// is written. CPU twin: `KvStorage::move_slot` applied in order, for moves whose sources are not earlier
    /// destinations (`compact_table`, a swap-remove).
    pub fn move_slots(&self, kv: &mut CudaKv, pairs: &[(u32, u32)]) -> Result<(), CudaError> {
        const OP: &str = "move_slots";
        let slots = kv.num_blocks * kv.block_size;
        if let Some(&(s, d)) = pairs.iter().find(|&&(s, d)| s as usize >= slots || d as usize >= slots) {
            return Err(CudaError::invalid(OP, format!("slot pair ({s}, {d}) out of range ({slots} slots)")));
        }
        if sorted_distinct(pairs.iter().map(|p| p.1)).is_none() {
            return Err(CudaError::invalid(OP, "destination slots must be distinct"));
        }
        let moves: Vec<(u32, u32)> = pairs.iter().copied().filter(|&(s, d)| s != d).collect();
        if moves.is_empty() {
            return Ok(());
        }
        let (src, dst): (Vec<u32>, Vec<u32>) = moves.into_iter().unzip();
        let hd = kv.head_dim;
        let mut staged = self.zeros::<u16>(src.len() * 2 * hd)?;
        self.gather_units(OP, kv, &self.upload(&src)?, src.len(), hd, &mut staged)?;
        self.scatter_units(OP, kv, &self.upload(&dst)?, dst.len(), hd, &staged)
    }

    /// `gather_blocks_f16` over units of `unit` halves (a block, or a slot when `unit` is head_dim): entry `i` of
    /// `packed` is unit `ids[i]` of K, then of V. The ids were checked by the caller.
    fn gather_units(
        &self,
        op: &'static str,
        kv: &CudaKv,
        ids: &CudaSlice<u32>,
        n: usize,
        unit: usize,
        packed: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        let cfg = per_block_cfg(op, n)?;
        let unit = to_i32(op, "unit length", unit)?;
        // SAFETY: every id addresses a unit inside the arenas (checked by the caller); `packed` holds 2 units per id.
        unsafe {
            self.stream()
                .launch_builder(self.func("gather_blocks_f16")?)
                .arg(&kv.k)
                .arg(&kv.v)
                .arg(ids)
                .arg(&unit)
                .arg(packed)
                .launch(cfg)
        }?;
        Ok(())
    }

    /// `scatter_blocks_f16`, the inverse of [`CudaContext::gather_units`]; the ids are distinct (checked by the
    /// caller).
    fn scatter_units(
        &self,
        op: &'static str,
        kv: &mut CudaKv,
        ids: &CudaSlice<u32>,
        n: usize,
        unit: usize,
        packed: &CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        let cfg = per_block_cfg(op, n)?;
        let unit = to_i32(op, "unit length", unit)?;
        let (kc, vc) = (&mut kv.k, &mut kv.v);
        // SAFETY: distinct ids inside the arenas (checked by the caller); `packed` holds 2 units per id.
        unsafe {
            self.stream()
                .launch_builder(self.func("scatter_blocks_f16")?)
                .arg(packed)
                .arg(ids)
                .arg(&unit)
                .arg(kc)
                .arg(vc)
                .launch(cfg)
        }?;
        Ok(())
    }

    /// Per range: `Σ k_s / max(‖k_s‖₂, eps)` over the slots `from..to` of its table, `[ranges][head_dim]` (KeyDiff's
    /// anchor sum; CPU twin: `scores::add_unit_keys` with the norms recomputed, summed in f32).
    pub fn unit_key_sums(&self, kv: &CudaKv, ranges: &[SlotRange<'_>], eps: f32) -> Result<Vec<f32>, CudaError> {
        const OP: &str = "unit_key_sums";
        let hd = kv.head_dim;
        if hd > 256 {
            return Err(CudaError::invalid(OP, "head_dim must be at most 256"));
        }
        if ranges.is_empty() {
            return Ok(Vec::new());
        }
        let (mut tables, mut from, mut to, mut tab_off) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for r in ranges {
            if r.from > r.to {
                return Err(CudaError::invalid(OP, format!("slot range {}..{} is reversed", r.from, r.to)));
            }
            kv.check_table(OP, r.table, r.to)?;
            tab_off.push(to_i32(OP, "table offset", tables.len())?);
            from.push(to_i32(OP, "from", r.from)?);
            to.push(to_i32(OP, "to", r.to)?);
            tables.extend_from_slice(&r.table[..r.to.div_ceil(kv.block_size)]);
        }
        let tables = self.upload(&tables)?;
        let (from, to, tab_off) = (self.upload(&from)?, self.upload(&to)?, self.upload(&tab_off)?);
        let mut out = self.zeros::<f32>(ranges.len() * hd)?;
        let cfg = LaunchConfig {
            grid_dim: (grid_dim(OP, "ranges", ranges.len(), i32::MAX as usize)?, 1, 1),
            block_dim: (32 * UKS_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (bs, hd) = (to_i32(OP, "block_size", kv.block_size)?, to_i32(OP, "head_dim", hd)?);
        // SAFETY: every table covers its range's slots inside the arena (checked); `out` holds head_dim per range.
        unsafe {
            self.stream()
                .launch_builder(self.func("unit_key_sum_f16")?)
                .arg(&kv.k)
                .arg(&tables)
                .arg(&from)
                .arg(&to)
                .arg(&tab_off)
                .arg(&bs)
                .arg(&hd)
                .arg(&eps)
                .arg(&mut out)
                .launch(cfg)
        }?;
        self.download(&out)
    }

    fn score_meta(&self, op: &'static str, kv: &CudaKv, entries: &[ScoreEntry<'_>]) -> Result<ScoreMeta, CudaError> {
        let mut tables = Vec::new();
        let (mut len, mut tab_off, mut out_off) = (Vec::new(), Vec::new(), Vec::new());
        let mut offsets = vec![0usize];
        for e in entries {
            kv.check_table(op, e.table, e.len)?;
            len.push(to_i32(op, "len", e.len)? as u32);
            tab_off.push(to_i32(op, "table offset", tables.len())? as u32);
            out_off.push(to_i32(op, "output offset", offsets[offsets.len() - 1])? as u32);
            tables.extend_from_slice(&e.table[..e.len.div_ceil(kv.block_size)]);
            offsets.push(offsets[offsets.len() - 1] + e.len);
        }
        let n_tab = tables.len();
        let n = entries.len();
        tables.extend(len);
        tables.extend(tab_off);
        tables.extend(out_off);
        let max_len = entries.iter().map(|e| e.len).max().unwrap_or(0);
        Ok(ScoreMeta { meta: self.upload(&tables)?, n_tab, n, offsets, max_len })
    }

    /// Per slot of each entry: `‖K‖₂` and `‖V‖₂ / ‖K‖₂` (0 when both norms are 0, +inf when only ‖K‖ is 0).
    /// Synchronous: returns host vectors for the policy code.
    pub fn slot_norms(&self, kv: &CudaKv, entries: &[ScoreEntry<'_>]) -> Result<SlotScores, CudaError> {
        const OP: &str = "slot_norms";
        let m = self.score_meta(OP, kv, entries)?;
        let total = m.total();
        if total == 0 {
            return Ok(SlotScores { offsets: m.offsets, ..Default::default() });
        }
        let mut knorm = self.zeros::<f32>(total)?;
        let mut score = self.zeros::<f32>(total)?;
        let cfg = score_cfg(OP, m.max_len, m.n)?;
        let (bs, hd) = (to_i32(OP, "block_size", kv.block_size)?, to_i32(OP, "head_dim", kv.head_dim)?);
        let [tab, len, toff, ooff] = m.views();
        // SAFETY: tables were validated against the arena; outputs hold `total` floats at the prefix offsets.
        unsafe {
            self.stream()
                .launch_builder(self.func("slot_norms_f16")?)
                .arg(&kv.k)
                .arg(&kv.v)
                .arg(&tab)
                .arg(&len)
                .arg(&toff)
                .arg(&ooff)
                .arg(&bs)
                .arg(&hd)
                .arg(&mut knorm)
                .arg(&mut score)
                .launch(cfg)
        }?;
        Ok(SlotScores { offsets: m.offsets, knorm: self.download(&knorm)?, score: self.download(&score)? })
    }

    /// Per slot of each entry: `cos(K, anchors[e])` (0 when a norm is 0). anchors: `[entries][head_dim]` f32.
    pub fn anchor_cosine(
        &self,
        kv: &CudaKv,
        entries: &[ScoreEntry<'_>],
        anchors: &[f32],
    ) -> Result<SlotScores, CudaError> {
        const OP: &str = "anchor_cosine";
        if anchors.len() != entries.len() * kv.head_dim {
            return Err(CudaError::invalid(OP, "anchors must be [entries][head_dim]"));
        }
        let m = self.score_meta(OP, kv, entries)?;
        let total = m.total();
        if total == 0 {
            return Ok(SlotScores { offsets: m.offsets, ..Default::default() });
        }
        let an = self.upload(anchors)?;
        let mut score = self.zeros::<f32>(total)?;
        let cfg = score_cfg(OP, m.max_len, m.n)?;
        let (bs, hd) = (to_i32(OP, "block_size", kv.block_size)?, to_i32(OP, "head_dim", kv.head_dim)?);
        let [tab, len, toff, ooff] = m.views();
        // SAFETY: as in slot_norms; anchors hold entries * head_dim floats (checked).
        unsafe {
            self.stream()
                .launch_builder(self.func("anchor_cosine_f16")?)
                .arg(&kv.k)
                .arg(&tab)
                .arg(&len)
                .arg(&toff)
                .arg(&ooff)
                .arg(&an)
                .arg(&bs)
                .arg(&hd)
                .arg(&mut score)
                .launch(cfg)
        }?;
        Ok(SlotScores { offsets: m.offsets, knorm: Vec::new(), score: self.download(&score)? })
    }

    /// Observation-window attention per slot, summed over each entry's queries and their `group` query heads, each
    /// probability raised to `power` (the metric of SnapKV, H2O, SAGE-KV and, with `power = 2`, KV-Compress). Each
    /// entry's scores start from zero. Same contract as the CPU's `scores::window_attention_scores`.
    pub fn window_attention_scores(
        &self,
        kv: &CudaKv,
        entries: &[WindowEntry<'_>],
        group: usize,
        scale: f32,
        power: u32,
    ) -> Result<SlotScores, CudaError> {
        const OP: &str = "window_attention_scores";
        let hd = kv.head_dim;
        if hd > 256 || group == 0 {
            return Err(CudaError::invalid(OP, "head_dim must be at most 256 and group at least 1"));
        }
        if power > MAX_WINDOW_POWER {
            return Err(CudaError::invalid(OP, format!("power {power} exceeds {MAX_WINDOW_POWER}")));
        }
        let score_entries: Vec<ScoreEntry<'_>> =
            entries.iter().map(|e| ScoreEntry { table: e.table, len: e.len }).collect();
        let m = self.score_meta(OP, kv, &score_entries)?;
        let (mut queries, mut row_e, mut row_q, mut row_vis) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (ei, e) in entries.iter().enumerate() {
            if e.q.len() != e.n_q * group * hd {
                return Err(CudaError::invalid(OP, format!("entry {ei}: q must be [n_q][group][head_dim]")));
            }
            for i in 0..e.n_q {
                let vis = e.first_q_slot.saturating_add(i).saturating_add(1).min(e.len);
                for g in 0..group {
                    row_e.push(to_i32(OP, "entry", ei)?);
                    row_q.push((queries.len() + (i * group + g) * hd) as i64);
                    row_vis.push(to_i32(OP, "visible slots", vis)?);
                }
            }
            queries.extend_from_slice(e.q);
        }
        let total = m.total();
        if total == 0 {
            return Ok(SlotScores { offsets: m.offsets, ..Default::default() });
        }
        let mut score = self.zeros::<f32>(total)?;
        if !row_e.is_empty() {
            let [tab, _, toff, ooff] = m.views();
            let (row_e, row_q, row_vis, q) =
                (self.upload(&row_e)?, self.upload(&row_q)?, self.upload(&row_vis)?, self.upload(&queries)?);
            let cfg = LaunchConfig {
                grid_dim: (grid_dim(OP, "rows", row_e.len(), i32::MAX as usize)?, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let (bs, hd32, pw) = (to_i32(OP, "block_size", kv.block_size)?, to_i32(OP, "head_dim", hd)?, power as i32);
            // SAFETY: tables were validated against the arena for `len` slots and every row sees at most `len`; query
            // offsets index `queries` (built above); outputs hold `total` floats at the entries' prefix offsets.
            unsafe {
                self.stream()
                    .launch_builder(self.func("window_scores_f16")?)
                    .arg(&kv.k)
                    .arg(&tab)
                    .arg(&toff)
                    .arg(&ooff)
                    .arg(&row_e)
                    .arg(&row_q)
                    .arg(&row_vis)
                    .arg(&q)
                    .arg(&bs)
                    .arg(&hd32)
                    .arg(&scale)
                    .arg(&pw)
                    .arg(&mut score)
                    .launch(cfg)
            }?;
        }
        Ok(SlotScores { offsets: m.offsets, knorm: Vec::new(), score: self.download(&score)? })
    }
}

fn score_cfg(op: &'static str, max_len: usize, entries: usize) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (
            grid_dim(op, "slot groups", max_len.div_ceil(SCORE_WARPS).max(1), i32::MAX as usize)?,
            grid_dim(op, "entries", entries, 65535)?,
            1,
        ),
        block_dim: (32 * SCORE_WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

pub(crate) fn check_seq(op: &'static str, s: &AttnSeq<'_>, n_kv_heads: usize, rows: usize) -> Result<(), CudaError> {
    if s.tables.len() < n_kv_heads || s.prior_lens.len() < n_kv_heads {
        return Err(CudaError::invalid(op, "AttnSeq needs one table and one prior_len per kv-head"));
    }
    if s.q_row.checked_add(s.n_new).is_none_or(|end| end > rows) {
        return Err(CudaError::invalid(op, format!("rows [{}, +{}) exceed the batch of {rows}", s.q_row, s.n_new)));
    }
    Ok(())
}
