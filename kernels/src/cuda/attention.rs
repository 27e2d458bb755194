//! Paged attention on the GPU (`attention.cu`): decode (split-K over long contexts, GQA group per CTA, then a
//! reduction kernel) and prefill (tiled flash attention, causal in slot space).
//!
//! CPU twin: `Backend::paged_attention`. [`CudaContext::plan_attention`] turns a batch's [`AttnSeq`]s into device
//! metadata once ([`AttnPlan`]); [`CudaContext::run_attention`] launches it, so a layer loop or a benchmark can
//! replay a plan. Sequences with at most [`DECODE_MAX_NEW`] new tokens take the decode path (one work item per
//! token), longer ones the prefill path.
//!
//! The same planner and decode kernel template serve attention over encoded blocks (dequantise on load,
//! `encoded_attention.cu`; CPU twin `Backend::paged_attention_encoded`): [`CudaContext::plan_attention_encoded`]
//! makes every new token a decode item, and [`CudaContext::run_attention_encoded`] launches the codec's kernels.

use super::codecs::CudaEncodedKv;
use super::compile::decode_kernel;
use super::context::CudaContext;
use super::error::CudaError;
use super::kv::{CudaKv, check_seq};
use super::ops::{grid_dim, to_i32};
use crate::codec::Codec;
use crate::paged::AttnSeq;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// What the planner needs of a paged KV source: the f16 arenas ([`CudaKv`]) or an encoded arena
/// ([`CudaEncodedKv`]).
pub(crate) trait PagedKv {
    fn block_size(&self) -> usize;
    fn head_dim(&self) -> usize;
    /// Checks that `table` lists enough blocks, inside the source and holding its slots, for `slots` visible slots.
    fn check_table(&self, op: &'static str, table: &[u32], slots: usize) -> Result<(), CudaError>;
    /// Bytes of K and V that decoding over `slots` visible slots of one kv-head reads.
    fn read_bytes(&self, slots: usize) -> usize;
    /// The blocks' codec; `None` for the f16 arenas.
    fn codec(&self) -> Option<Codec>;
    /// Blocks in the source (every table entry is below it).
    fn num_blocks(&self) -> usize;
}

impl PagedKv for CudaKv {
    fn block_size(&self) -> usize {
        CudaKv::block_size(self)
    }
    fn head_dim(&self) -> usize {
        CudaKv::head_dim(self)
    }
    fn check_table(&self, op: &'static str, table: &[u32], slots: usize) -> Result<(), CudaError> {
        CudaKv::check_table(self, op, table, slots)
    }
    fn read_bytes(&self, slots: usize) -> usize {
        2 * slots * CudaKv::head_dim(self) * 2
    }
    fn codec(&self) -> Option<Codec> {
        None
    }
    fn num_blocks(&self) -> usize {
        CudaKv::num_blocks(self)
    }
}

/// The K/V arguments of a decode launch.
#[derive(Clone, Copy)]
enum DecodeKv<'a> {
    F16(&'a CudaKv),
    Encoded(&'a CudaEncodedKv),
}

impl DecodeKv<'_> {
    fn source(&self) -> &dyn PagedKv {
        match self {
            DecodeKv::F16(kv) => *kv,
            DecodeKv::Encoded(kv) => *kv,
        }
    }
}

/// Sequences with at most this many new tokens use the decode kernel.
pub const DECODE_MAX_NEW: usize = 4;
/// Head dims the kernels are instantiated for.
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];
const THREADS: u32 = 128;
const WARPS: usize = 4;
/// Largest dynamic shared memory a launch gets without opting in (every kernel here stays under it).
pub(crate) const SMEM_LIMIT: usize = 48 * 1024;
/// Split lengths are multiples of this many slots.
const CHUNK_STEP: usize = 32;
/// Fixed cost of one decode CTA, in slots' worth of time, for the split-length model.
const CTA_OVERHEAD_SLOTS: usize = 128;
/// Shortest split.
const MIN_CHUNK: usize = 64;
/// Most splits per context (the reduction keeps one weight per split in shared memory).
const MAX_SPLITS: usize = 8192;

/// Query heads handled per decode CTA for a GQA group size.
fn heads_per_cta(group: usize) -> usize {
    match group {
        0..=1 => 1,
        2 => 2,
        3..=4 => 4,
        _ => 8,
    }
}

/// Dynamic shared memory of a decode CTA: per slot of the split, G scores and its arena slot; the warps' partial
/// outputs; G (max, sum) pairs (the layout at the top of `decode_split`).
fn decode_smem(hd: usize, g: usize, chunk: usize) -> usize {
    4 * (g * chunk + chunk + WARPS * g * hd + 2 * g)
}

/// Largest power-of-two split length whose shared memory fits.
fn max_chunk(hd: usize, g: usize) -> usize {
    let mut c = 1024;
    while c > 32 && decode_smem(hd, g, c) > SMEM_LIMIT {
        c /= 2;
    }
    c
}

fn prefill_tile_q(hd: usize) -> usize {
    if hd >= 256 { 8 } else { 16 }
}

/// A batch's attention metadata on the device, plus the split-K workspace. A plan from
/// [`CudaContext::stage_attention`] owns neither: its metadata sits in a caller's step buffer (one upload for every
/// layer of a step) and the caller lends the workspace.
pub struct AttnPlan {
    meta: Option<CudaSlice<u32>>,
    // Offsets into the metadata (`meta`, or the step buffer the plan was staged into).
    tables: (usize, usize),
    item_row: (usize, usize),
    ent_len: (usize, usize),
    ent_tab: (usize, usize),
    tile_seq: (usize, usize),
    tile_j0: (usize, usize),
    seq_qrow: (usize, usize),
    seq_nnew: (usize, usize),
    pre_prior: (usize, usize),
    pre_tab: (usize, usize),
    n_items: usize,
    n_tiles: usize,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
    block_size: usize,
    rows: usize,
    chunk: usize,
    max_splits: usize,
    g: usize,
    /// The codec of the blocks the plan reads (`None`: the f16 arenas).
    codec: Option<Codec>,
    part_o: Option<CudaSlice<f32>>,
    part_ml: Option<CudaSlice<f32>>,
    kv_bytes: usize,
    /// One past the last metadata word the plan reads.
    meta_end: usize,
    /// Blocks of the cache the plan's tables were checked against: a run needs a cache at least this large.
    arena_blocks: usize,
}

impl std::fmt::Debug for AttnPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttnPlan")
            .field("decode_items", &self.n_items)
            .field("prefill_tiles", &self.n_tiles)
            .field("chunk", &self.chunk)
            .field("max_splits", &self.max_splits)
            .field("heads_per_cta", &self.g)
            .finish()
    }
}

impl AttnPlan {
    /// Bytes of K and V the decode items read (each visible slot's K and V once per kv-head).
    pub fn decode_kv_bytes(&self) -> usize {
        self.kv_bytes
    }

    /// Slots per decode split.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Decode work items (query tokens) and prefill tiles.
    pub fn work(&self) -> (usize, usize) {
        (self.n_items, self.n_tiles)
    }

    /// Split-K partials the decode items need: the workspace holds `parts * head_dim` outputs and `parts * 2`
    /// (max, sum) pairs.
    pub fn workspace_parts(&self) -> usize {
        if self.n_items > 0 { self.n_items * self.n_heads * self.max_splits } else { 0 }
    }
}

struct MetaBuilder<'a>(&'a mut Vec<u32>);

impl MetaBuilder<'_> {
    fn push(&mut self, v: &[u32]) -> (usize, usize) {
        let start = self.0.len();
        self.0.extend_from_slice(v);
        // Never hand out an empty range: a kernel may still receive the pointer.
        if v.is_empty() {
            self.0.push(0);
        }
        (start, self.0.len())
    }
}

impl CudaContext {
    /// Builds the device metadata for one layer's attention over `seqs` (see `Backend::paged_attention`), uploads
    /// it and allocates the split-K workspace.
    pub fn plan_attention(
        &self,
        kv: &CudaKv,
        seqs: &[AttnSeq<'_>],
        rows: usize,
        n_heads: usize,
        n_kv_heads: usize,
    ) -> Result<AttnPlan, CudaError> {
        self.plan_paged(kv, seqs, rows, n_heads, n_kv_heads)
    }

    /// [`CudaContext::plan_attention`] over encoded blocks: every new token is a decode item (there is no encoded
    /// prefill kernel), read through `kv`'s codec. Each table's blocks must hold the slots attention reads.
    pub fn plan_attention_encoded(
        &self,
        kv: &CudaEncodedKv,
        seqs: &[AttnSeq<'_>],
        rows: usize,
        n_heads: usize,
        n_kv_heads: usize,
    ) -> Result<AttnPlan, CudaError> {
        self.plan_paged(kv, seqs, rows, n_heads, n_kv_heads)
    }

    fn plan_paged(
        &self,
        kv: &dyn PagedKv,
        seqs: &[AttnSeq<'_>],
        rows: usize,
        n_heads: usize,
        n_kv_heads: usize,
    ) -> Result<AttnPlan, CudaError> {
        let mut host = Vec::new();
        let mut plan = self.stage_paged(kv, seqs, rows, n_heads, n_kv_heads, &mut host)?;
        plan.meta = Some(self.upload(&host)?);
        let parts = plan.workspace_parts();
        if parts > 0 {
            plan.part_o = Some(self.zeros::<f32>(parts * plan.head_dim)?);
            plan.part_ml = Some(self.zeros::<f32>(parts * 2)?);
        }
        Ok(plan)
    }

    /// Validates one layer's attention over `seqs` and appends its metadata to `stage`, the host copy of a step
    /// buffer that the caller uploads once for all its plans and passes to [`CudaContext::run_staged_attention`].
    pub fn stage_attention(
        &self,
        kv: &CudaKv,
        seqs: &[AttnSeq<'_>],
        rows: usize,
        n_heads: usize,
        n_kv_heads: usize,
        stage: &mut Vec<u32>,
    ) -> Result<AttnPlan, CudaError> {
        self.stage_paged(kv, seqs, rows, n_heads, n_kv_heads, stage)
    }

    fn stage_paged(
        &self,
        kv: &dyn PagedKv,
        seqs: &[AttnSeq<'_>],
        rows: usize,
        n_heads: usize,
        n_kv_heads: usize,
        stage: &mut Vec<u32>,
    ) -> Result<AttnPlan, CudaError> {
        const OP: &str = "paged_attention";
        let (hd, bs, codec) = (kv.head_dim(), kv.block_size(), kv.codec());
        // Encoded blocks have decode kernels only.
        let decode_max_new = if codec.is_some() { usize::MAX } else { DECODE_MAX_NEW };
        if !HEAD_DIMS.contains(&hd) {
            return Err(CudaError::Unsupported(format!("head_dim {hd} (kernels exist for {HEAD_DIMS:?})")));
        }
        if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(CudaError::invalid(OP, "n_heads must be a non-zero multiple of n_kv_heads"));
        }
        let group = n_heads / n_kv_heads;
        let u = |what: &str, v: usize| to_i32(OP, what, v).map(|x| x as u32);
        let mut tables: Vec<u32> = Vec::new();
        let (mut item_row, mut ent_len, mut ent_tab) = (Vec::new(), Vec::new(), Vec::new());
        let (mut tile_seq, mut tile_j0, mut seq_qrow, mut seq_nnew, mut pre_prior, mut pre_tab) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let tq = prefill_tile_q(hd);
        let mut max_len = 0usize;
        let mut kv_bytes = 0usize;
        for s in seqs {
            check_seq(OP, s, n_kv_heads, rows)?;
            if s.n_new == 0 {
                continue;
            }
            let mut offs = Vec::with_capacity(n_kv_heads);
            for h in 0..n_kv_heads {
                let len = s.prior_lens[h] + s.n_new;
                kv.check_table(OP, &s.tables[h], len)?;
                offs.push(u("table offset", tables.len())?);
                tables.extend_from_slice(&s.tables[h][..len.div_ceil(bs)]);
            }
            if s.n_new <= decode_max_new {
                for j in 0..s.n_new {
                    item_row.push(u("row", s.q_row + j)?);
                    for (&prior, &off) in s.prior_lens[..n_kv_heads].iter().zip(&offs) {
                        let l = prior + j + 1;
                        max_len = max_len.max(l);
                        kv_bytes += kv.read_bytes(l);
                        ent_len.push(u("context length", l)?);
                        ent_tab.push(off);
                    }
                }
            } else {
                let p = u("prefill sequences", seq_qrow.len())?;
                seq_qrow.push(u("row", s.q_row)?);
                seq_nnew.push(u("n_new", s.n_new)?);
                for (&prior, &off) in s.prior_lens[..n_kv_heads].iter().zip(&offs) {
                    u("prior_len + n_new", prior + s.n_new)?;
                    pre_prior.push(prior as u32);
                    pre_tab.push(off);
                }
                for j0 in (0..s.n_new).step_by(tq) {
                    tile_seq.push(p);
                    tile_j0.push(j0 as u32);
                }
            }
        }
        let g = heads_per_cta(group);
        let entries = item_row.len() * n_kv_heads;
        let subs = group.div_ceil(g);
        let chunk = self.pick_chunk(decode_kernel(codec, hd, g)?, hd, g, entries * subs, max_len)?;
        let max_splits = max_len.div_ceil(chunk).max(1);
        if max_splits > MAX_SPLITS {
            return Err(CudaError::invalid(OP, format!("context of {max_len} slots needs too many splits")));
        }
        let n_items = item_row.len();
        let mut mb = MetaBuilder(stage);
        let tables_r = mb.push(&tables);
        let item_row_r = mb.push(&item_row);
        let ent_len_r = mb.push(&ent_len);
        let ent_tab_r = mb.push(&ent_tab);
        let tile_seq_r = mb.push(&tile_seq);
        let tile_j0_r = mb.push(&tile_j0);
        let seq_qrow_r = mb.push(&seq_qrow);
        let seq_nnew_r = mb.push(&seq_nnew);
        let pre_prior_r = mb.push(&pre_prior);
        let pre_tab_r = mb.push(&pre_tab);
        let meta_end = mb.0.len();
        Ok(AttnPlan {
            meta: None,
            tables: tables_r,
            item_row: item_row_r,
            ent_len: ent_len_r,
            ent_tab: ent_tab_r,
            tile_seq: tile_seq_r,
            tile_j0: tile_j0_r,
            seq_qrow: seq_qrow_r,
            seq_nnew: seq_nnew_r,
            pre_prior: pre_prior_r,
            pre_tab: pre_tab_r,
            n_items,
            n_tiles: tile_seq.len(),
            n_heads,
            n_kv: n_kv_heads,
            head_dim: hd,
            block_size: bs,
            rows,
            chunk,
            max_splits,
            g,
            codec,
            part_o: None,
            part_ml: None,
            kv_bytes,
            meta_end,
            arena_blocks: kv.num_blocks(),
        })
    }

    /// Split length for `ctas_per_split` CTAs per split over contexts of up to `max_len` slots: minimises
    /// (waves of resident CTAs) × (slots per CTA + a fixed per-CTA cost), so the last wave is not left mostly empty.
    fn pick_chunk(
        &self,
        kernel: &'static str,
        hd: usize,
        g: usize,
        ctas_per_split: usize,
        max_len: usize,
    ) -> Result<usize, CudaError> {
        let maxc = max_chunk(hd, g);
        if ctas_per_split == 0 || max_len == 0 {
            return Ok(maxc);
        }
        let smem = decode_smem(hd, g, maxc);
        let per_sm = self.func(kernel)?.occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None)?;
        let resident = (per_sm.max(1) as usize) * self.info().sm_count.max(1);
        let mut best = (usize::MAX, maxc);
        let min_splits = max_len.div_ceil(maxc);
        for splits in min_splits..=max_len.div_ceil(MIN_CHUNK).max(min_splits) {
            let chunk = max_len.div_ceil(splits).next_multiple_of(CHUNK_STEP).clamp(MIN_CHUNK.min(maxc), maxc);
            let waves = (ctas_per_split * max_len.div_ceil(chunk)).div_ceil(resident);
            let cost = waves * (chunk + CTA_OVERHEAD_SLOTS);
            if cost < best.0 {
                best = (cost, chunk);
            }
        }
        Ok(best.1)
    }

    /// Launches a plan from [`CudaContext::plan_attention`]: `out` rows of the plan's sequences are overwritten;
    /// other rows are left as they are. q, out: `[rows][n_heads * head_dim]` f32.
    pub fn run_attention(
        &self,
        plan: &mut AttnPlan,
        q: &CudaSlice<f32>,
        kv: &CudaKv,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.run_planned(plan, q, DecodeKv::F16(kv), scale, out)
    }

    /// Launches a plan from [`CudaContext::plan_attention_encoded`] over `kv`: the arena it was planned for, or one
    /// of the same codec and shape, at least as large, whose blocks hold the same slots.
    pub fn run_attention_encoded(
        &self,
        plan: &mut AttnPlan,
        q: &CudaSlice<f32>,
        kv: &CudaEncodedKv,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.run_planned(plan, q, DecodeKv::Encoded(kv), scale, out)
    }

    fn run_planned(
        &self,
        plan: &mut AttnPlan,
        q: &CudaSlice<f32>,
        kv: DecodeKv<'_>,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let meta = plan
            .meta
            .take()
            .ok_or_else(|| CudaError::invalid("paged_attention", "a staged plan runs through run_staged_attention"))?;
        let (mut po, mut pml) = (plan.part_o.take(), plan.part_ml.take());
        let ws = po.as_mut().zip(pml.as_mut());
        let r = self.run_staged(plan, &meta, ws, q, kv, scale, out);
        (plan.meta, plan.part_o, plan.part_ml) = (Some(meta), po, pml);
        r
    }

    /// Launches a plan staged into the step buffer `meta` (uploaded after staging), with the split-K workspace
    /// `ws` (`workspace_parts() * head_dim` outputs, `workspace_parts() * 2` pairs, or more; none when the plan
    /// has no decode items).
    #[allow(clippy::too_many_arguments)]
    pub fn run_staged_attention(
        &self,
        plan: &AttnPlan,
        meta: &CudaSlice<u32>,
        ws: Option<(&mut CudaSlice<f32>, &mut CudaSlice<f32>)>,
        q: &CudaSlice<f32>,
        kv: &CudaKv,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.run_staged(plan, meta, ws, q, DecodeKv::F16(kv), scale, out)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_staged(
        &self,
        plan: &AttnPlan,
        meta: &CudaSlice<u32>,
        ws: Option<(&mut CudaSlice<f32>, &mut CudaSlice<f32>)>,
        q: &CudaSlice<f32>,
        kv: DecodeKv<'_>,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "paged_attention";
        let w = plan.n_heads * plan.head_dim;
        if q.len() != plan.rows * w || out.len() != q.len() {
            return Err(CudaError::invalid(OP, "q and out must be [rows][n_heads*head_dim] of the plan"));
        }
        let src = kv.source();
        if src.head_dim() != plan.head_dim || src.block_size() != plan.block_size || src.codec() != plan.codec {
            return Err(CudaError::invalid(OP, "the plan was built for another cache shape or format"));
        }
        if src.num_blocks() < plan.arena_blocks {
            return Err(CudaError::invalid(OP, "the plan was checked against a larger cache than this one"));
        }
        if meta.len() < plan.meta_end {
            return Err(CudaError::invalid(OP, "the step buffer is shorter than the plan's metadata"));
        }
        let parts = plan.workspace_parts();
        // A plan without decode items launches no decode kernel, whatever workspace it is lent.
        let ws = match ws {
            _ if parts == 0 => None,
            Some((po, pml)) if po.len() >= parts * plan.head_dim && pml.len() >= parts * 2 => Some((po, pml)),
            _ => return Err(CudaError::invalid(OP, format!("the split-K workspace holds fewer than {parts} parts"))),
        };
        let r = |x: (usize, usize)| meta.slice(x.0..x.1);
        let (nh, nkv) = (to_i32(OP, "n_heads", plan.n_heads)?, to_i32(OP, "n_kv_heads", plan.n_kv)?);
        let (bs, hd) = (to_i32(OP, "block_size", plan.block_size)?, to_i32(OP, "head_dim", plan.head_dim)?);
        let tables = r(plan.tables);
        if let Some((po, pml)) = ws {
            let name = decode_kernel(plan.codec, plan.head_dim, plan.g)?;
            let entries = plan.n_items * plan.n_kv;
            let subs = (plan.n_heads / plan.n_kv).div_ceil(plan.g);
            let smem = decode_smem(plan.head_dim, plan.g, plan.chunk);
            let cfg = LaunchConfig {
                grid_dim: (
                    grid_dim(OP, "decode entries", entries, i32::MAX as usize)?,
                    grid_dim(OP, "splits", plan.max_splits, 65535)?,
                    grid_dim(OP, "head groups", subs, 65535)?,
                ),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            let (chunk, ms) = (to_i32(OP, "chunk", plan.chunk)?, to_i32(OP, "splits", plan.max_splits)?);
            let (item_row, ent_len, ent_tab) = (r(plan.item_row), r(plan.ent_len), r(plan.ent_tab));
            let func = self.func(name)?;
            let mut launch = self.stream().launch_builder(func);
            launch.arg(q);
            let block_len;
            match kv {
                DecodeKv::F16(kv) => {
                    let (kc, vc) = kv.arenas();
                    launch.arg(kc).arg(vc);
                }
                DecodeKv::Encoded(kv) => {
                    let (arena, len) = kv.arena();
                    block_len = len as i64;
                    launch.arg(arena).arg(&block_len);
                }
            }
            // SAFETY: every table, row and length was validated in plan_attention against this cache shape (and,
            // encoded, against the blocks' filled slots) and q; the workspace holds n_items * n_heads * max_splits
            // partials; an encoded arena's blocks are validated encodings of the plan's codec and shape.
            unsafe {
                launch
                    .arg(&tables)
                    .arg(&item_row)
                    .arg(&ent_len)
                    .arg(&ent_tab)
                    .arg(&nh)
                    .arg(&nkv)
                    .arg(&bs)
                    .arg(&chunk)
                    .arg(&ms)
                    .arg(&scale)
                    .arg(&mut *po)
                    .arg(&mut *pml)
                    .launch(cfg)
            }?;
            let cfg = LaunchConfig {
                grid_dim: (
                    grid_dim(OP, "decode items", plan.n_items, i32::MAX as usize)?,
                    grid_dim(OP, "n_heads", plan.n_heads, 65535)?,
                    1,
                ),
                block_dim: (plan.head_dim.min(256) as u32, 1, 1),
                shared_mem_bytes: (4 * plan.max_splits) as u32,
            };
            // SAFETY: reads the partials written above; writes n_items rows of out.
            unsafe {
                self.stream()
                    .launch_builder(self.func("paged_decode_reduce")?)
                    .arg(&*po)
                    .arg(&*pml)
                    .arg(&item_row)
                    .arg(&ent_len)
                    .arg(&nh)
                    .arg(&nkv)
                    .arg(&hd)
                    .arg(&chunk)
                    .arg(&ms)
                    .arg(&mut *out)
                    .launch(cfg)
            }?;
        }
        if plan.n_tiles > 0 {
            let DecodeKv::F16(kv) = kv else {
                return Err(CudaError::invalid(OP, "encoded blocks have no prefill kernel"));
            };
            let (kc, vc) = kv.arenas();
            let name = match plan.head_dim {
                64 => "paged_prefill_hd64",
                128 => "paged_prefill_hd128",
                256 => "paged_prefill_hd256",
                other => return Err(CudaError::Unsupported(format!("head_dim {other}"))),
            };
            let cfg = LaunchConfig {
                grid_dim: (
                    grid_dim(OP, "prefill tiles", plan.n_tiles, i32::MAX as usize)?,
                    grid_dim(OP, "n_heads", plan.n_heads, 65535)?,
                    1,
                ),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let (ts, tj, sq, sn, pp, pt) = (
                r(plan.tile_seq),
                r(plan.tile_j0),
                r(plan.seq_qrow),
                r(plan.seq_nnew),
                r(plan.pre_prior),
                r(plan.pre_tab),
            );
            // SAFETY: as for decode; each tile writes its own rows and head.
            unsafe {
                self.stream()
                    .launch_builder(self.func(name)?)
                    .arg(q)
                    .arg(kc)
                    .arg(vc)
                    .arg(&tables)
                    .arg(&ts)
                    .arg(&tj)
                    .arg(&sq)
                    .arg(&sn)
                    .arg(&pp)
                    .arg(&pt)
                    .arg(&nh)
                    .arg(&nkv)
                    .arg(&bs)
                    .arg(&scale)
                    .arg(&mut *out)
                    .launch(cfg)
            }?;
        }
        Ok(())
    }

    /// One-shot paged attention (plan + run); see `Backend::paged_attention` for the contract.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        q: &CudaSlice<f32>,
        kv: &CudaKv,
        seqs: &[AttnSeq<'_>],
        n_heads: usize,
        n_kv_heads: usize,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.attend_once(q, DecodeKv::F16(kv), seqs, (n_heads, n_kv_heads), scale, out)
    }

    /// Paged attention reading K and V straight from encoded blocks (dequantise on load); the contract is
    /// [`crate::Backend::paged_attention`]'s with `kv` encoded. One-shot [`CudaContext::plan_attention_encoded`]
    /// and [`CudaContext::run_attention_encoded`]: tables, block ids, each block's filled slots and the sequences'
    /// rows are checked before the launch.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_encoded(
        &self,
        q: &CudaSlice<f32>,
        kv: &CudaEncodedKv,
        seqs: &[AttnSeq<'_>],
        n_heads: usize,
        n_kv_heads: usize,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.attend_once(q, DecodeKv::Encoded(kv), seqs, (n_heads, n_kv_heads), scale, out)
    }

    fn attend_once(
        &self,
        q: &CudaSlice<f32>,
        kv: DecodeKv<'_>,
        seqs: &[AttnSeq<'_>],
        (n_heads, n_kv_heads): (usize, usize),
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let w = n_heads * kv.source().head_dim();
        if w == 0 || !q.len().is_multiple_of(w) {
            return Err(CudaError::invalid("paged_attention", "q must be [rows][n_heads*head_dim]"));
        }
        let mut plan = self.plan_paged(kv.source(), seqs, q.len() / w, n_heads, n_kv_heads)?;
        self.run_planned(&mut plan, q, kv, scale, out)
    }
}
