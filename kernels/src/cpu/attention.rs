//! KV write into head-paged blocks and paged attention (prefill + decode, GQA) with online softmax,
//! parallelised over (sequence, query head, token chunk), optionally writing each row's softmax probabilities
//! for the eviction policies that rank slots by attention.

use super::{CpuBackend, Simd, SyncPtr, scalar};
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512_attention};
use crate::paged::{AttnProbs, AttnSeq, KvArenas, KvDtype, KvStorage};
use std::cell::Cell;
use std::ops::Range;

/// New tokens per attention task during prefill.
const TOKEN_CHUNK: usize = 32;
/// Most query heads per kv-head that one grouped decode task folds together (the rows kernel's row limit).
const MAX_GROUP_ROWS: usize = 32;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(MAX_GROUP_ROWS <= avx512_attention::MAX_ROWS, "a GQA group must fit the rows kernel");
#[cfg(target_arch = "x86_64")]
const _: () = assert!(TOKEN_CHUNK <= avx512_attention::MAX_ROWS, "a task's tokens must fit the rows kernel");

/// Writes rows `[q_row, q_row + n_new)` of `k`, `v` (`[rows][n_kv_heads*head_dim]`) into the cache slots
/// `prior_lens[h] ..` of each kv-head's table.
pub fn kv_write(kv: &mut KvStorage, k: &[f32], v: &[f32], seqs: &[AttnSeq<'_>], n_kv_heads: usize) {
    let hd = kv.head_dim();
    for_each_new_slot((hd, kv.block_size()), (k.len(), v.len()), seqs, n_kv_heads, |b, slot, i| {
        kv.write_slot(b, slot, &k[i * hd..(i + 1) * hd], &v[i * hd..(i + 1) * hd]);
    });
}

/// The slot walk of the KV writes: checks `k` and `v` (of lengths `lens`, `[rows][n_kv_heads*head_dim]`) and
/// `seqs` against each other, then calls `store(block, slot in block, i)` for each new slot in order, `i` being the
/// index of its row among the runs of head_dim in `k` (token `i / n_kv_heads`, kv-head `i % n_kv_heads`).
fn for_each_new_slot(
    (hd, bs): (usize, usize),
    lens: (usize, usize),
    seqs: &[AttnSeq<'_>],
    n_kv_heads: usize,
    mut store: impl FnMut(u32, usize, usize),
) {
    let w = n_kv_heads * hd;
    assert_eq!(lens.0, lens.1, "kv_write: k and v differ in length");
    assert!(w > 0 && lens.0.is_multiple_of(w), "kv_write: k must be [rows][n_kv_heads*head_dim]");
    for s in seqs {
        check_seq(s, n_kv_heads, lens.0 / w);
    }
    for s in seqs {
        for h in 0..n_kv_heads {
            let table = &s.tables[h];
            for j in 0..s.n_new {
                let slot = s.prior_lens[h] + j;
                store(table[slot / bs], slot % bs, (s.q_row + j) * n_kv_heads + h);
            }
        }
    }
}

thread_local! {
    /// Codes and scales of a step's rows that [`kv_write_encoded`] encodes before it stores them, kept between
    /// calls so that prefill steps do not allocate.
    static ENCODED: Cell<(Vec<u8>, Vec<f32>)> = const { Cell::new((Vec::new(), Vec::new())) };
}

/// [`kv_write`] into a pool that keeps codes and a scale per slot (int8, e4m3), with the rows encoded on the pool
/// first: the quantisation is most of such a write, and on the calling thread alone it held up the helpers
/// through a prefill. The slots are then stored on the calling thread, in [`kv_write`]'s order. The cache comes out
/// bit for bit as [`kv_write`] writes it. Panics unless [`KvStorage::slot_scaled`].
pub(crate) fn kv_write_encoded(
    be: &CpuBackend,
    kv: &mut KvStorage,
    k: &[f32],
    v: &[f32],
    seqs: &[AttnSeq<'_>],
    n_kv_heads: usize,
) {
    let hd = kv.head_dim();
    assert_eq!(k.len(), v.len(), "kv_write: k and v differ in length");
    // Row i of the encoded buffers is k's and v's i-th run of head_dim: token i / n_kv_heads, kv-head i % n_kv_heads.
    let rows = k.len() / hd;
    let (mut codes, mut scales) = ENCODED.take();
    codes.resize(2 * rows * hd, 0);
    scales.resize(2 * rows, 0.0);
    let (c, sc) = (SyncPtr::new(&mut codes), SyncPtr::new(&mut scales));
    let encoder: &KvStorage = kv;
    be.par_runs(rows, 1, &|rs| {
        for i in rs {
            // SAFETY: rows i and rows + i of the buffers belong to this task alone, and they outlive the call.
            let (kc, vc) = unsafe { (c.slice(i * hd..(i + 1) * hd), c.slice((rows + i) * hd..(rows + i + 1) * hd)) };
            let (ks, vs) = encoder.encode_slot(&k[i * hd..(i + 1) * hd], &v[i * hd..(i + 1) * hd], kc, vc);
            // SAFETY: as above.
            unsafe { (sc.slice(i..i + 1)[0], sc.slice(rows + i..rows + i + 1)[0]) = (ks, vs) };
        }
    });
    for_each_new_slot((hd, kv.block_size()), (k.len(), v.len()), seqs, n_kv_heads, |b, slot, i| {
        let kr = (&codes[i * hd..(i + 1) * hd], scales[i]);
        let vr = (&codes[(rows + i) * hd..(rows + i + 1) * hd], scales[rows + i]);
        kv.write_encoded_slot(b, slot, kr, vr);
    });
    ENCODED.set((codes, scales));
}

pub(crate) fn check_seq(s: &AttnSeq<'_>, n_kv_heads: usize, rows: usize) {
    assert!(s.tables.len() >= n_kv_heads, "AttnSeq: tables must have one entry per kv-head");
    assert!(s.prior_lens.len() >= n_kv_heads, "AttnSeq: prior_lens must have one entry per kv-head");
    assert!(s.q_row + s.n_new <= rows, "AttnSeq: rows [q_row, q_row+n_new) exceed the batch");
}

/// Paged attention for every sequence of the batch; see [`crate::Backend::paged_attention`] and, with `probs`,
/// [`crate::Backend::paged_attention_with_probs`].
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    be: &CpuBackend,
    q: &[f32],
    kv: &KvStorage,
    seqs: &[AttnSeq<'_>],
    n_heads: usize,
    n_kv_heads: usize,
    scale: f32,
    out: &mut [f32],
    probs: &mut [AttnProbs<'_>],
) {
    let hd = kv.head_dim();
    let w = n_heads * hd;
    assert!(n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads), "n_heads must be a multiple of n_kv_heads");
    assert_eq!(q.len(), out.len(), "paged_attention: q and out differ in length");
    assert!(w > 0 && q.len().is_multiple_of(w), "paged_attention: q must be [rows][n_heads*head_dim]");
    let rows = q.len() / w;
    let bs = kv.block_size();
    for s in seqs {
        check_seq(s, n_kv_heads, rows);
        for h in 0..n_kv_heads {
            let need = (s.prior_lens[h] + s.n_new).div_ceil(bs);
            assert!(s.tables[h].len() >= need, "AttnSeq: block table too short for prior_len + n_new");
        }
    }
    check_disjoint(seqs);
    let mut sinks = SINKS.take();
    prob_sinks(seqs, n_heads, n_kv_heads, probs, &mut sinks);
    let simd = be.simd();
    let one = |qv: &[f32], table: &[u32], len: usize, acc: &mut [f32], p: Option<&mut [f32]>| {
        attend_one(simd, qv, kv, table, len, scale, acc, p)
    };
    #[cfg(target_arch = "x86_64")]
    let many = RowsKernel::select(simd, kv).map(|rows| rows.bind(kv, scale));
    #[cfg(target_arch = "x86_64")]
    let rows = many.as_ref().map(|m| m as AttendRows<'_>);
    #[cfg(not(target_arch = "x86_64"))]
    let rows = None;
    par_queries(be, q, seqs, n_heads, n_kv_heads, hd, out, &sinks, &one, rows);
    // Cleared so that the kept buffer holds no pointers into this call's sums.
    sinks.clear();
    SINKS.set(sinks);
}

/// The block walk of the rows kernels (`avx2::attend_rows`, `avx512_attention::attend_rows`): `rows` queries of
/// one kv-head's table, query `r` seeing the first `len0 + r` slots when `causal` (consecutive tokens of a prefill
/// chunk) or `len0` slots otherwise (the query heads of one GQA group at one decode token). For each block that the
/// last row sees, `widen(element offset of the block, elements the rows read, id of the next block the rows
/// read)`, then `fold(rs, n_r, s0)` for the rows `rs` that see `n_r > 0` of its slots, the block's first slot
/// being slot `s0` of the table: one call for the rows that see all `n` slots the block holds for them (all rows
/// but the causal diagonal's), and one call a row for the diagonal's, which each see a different part. Inlined
/// into each kernel, so the closures compile with its instruction set.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn for_row_blocks(
    rows: usize,
    len0: usize,
    causal: bool,
    bs: usize,
    hd: usize,
    table: &[u32],
    mut widen: impl FnMut(usize, usize, Option<usize>),
    mut fold: impl FnMut(Range<usize>, usize, usize),
) {
    let last = last_row_len(rows, len0, causal);
    let blocks = &table[..last.div_ceil(bs)];
    for (bi, &b) in blocks.iter().enumerate() {
        let s0 = bi * bs;
        let n = (last - s0).min(bs);
        let next = blocks.get(bi + 1).map(|&nb| nb as usize);
        widen(b as usize * bs * hd, n * hd, next);
        // Causal query r sees the slots below len0 + r: rows before `first` see none of this block, rows from
        // `whole` on see all n of its slots, and each row between sees len0 + r - s0 of them.
        let (first, whole) = if causal {
            let first = (s0 + 1).saturating_sub(len0);
            (first, (s0 + n).saturating_sub(len0).clamp(first, rows))
        } else {
            (0, 0)
        };
        for r in first..whole {
            fold(r..r + 1, len0 + r - s0, s0);
        }
        if whole < rows {
            fold(whole..rows, n, s0);
        }
    }
}

/// Slots `s0..s0 + n` of row `r` of a rows kernel's probability buffer (`logits`: its start and row stride), or
/// `None` without one.
///
/// # Safety
/// The buffer holds row `r` up to slot `s0 + n`, and nothing else refers to those slots while the slice lives.
#[inline(always)]
pub(crate) unsafe fn logits_row<'a>(
    logits: Option<(*mut f32, usize)>,
    r: usize,
    s0: usize,
    n: usize,
) -> Option<&'a mut [f32]> {
    logits.map(|(p, stride)| unsafe { std::slice::from_raw_parts_mut(p.add(r * stride + s0), n) })
}

/// Slots the last of `rows` rows sees (see [`for_row_blocks`]): the blocks a rows kernel reads end there.
#[inline(always)]
pub(crate) fn last_row_len(rows: usize, len0: usize, causal: bool) -> usize {
    if causal { len0 + rows - 1 } else { len0 }
}

/// Where [`par_queries`] asks a rows kernel to write: row `r` of the result goes to `ptr + r * stride` (head_dim
/// floats), rows owned by the calling task alone.
#[derive(Clone, Copy)]
pub(crate) struct RowsOut {
    ptr: SyncPtr,
    stride: usize,
}

/// A rows kernel as [`par_queries`] calls it: `(queries, query stride, output rows, rows, table, visible length of
/// the first row, causal, probability rows)`. Called once per task, so dynamic dispatch costs nothing measurable.
/// [`par_queries`] hands it a prefill task's tokens, and a one-token step's GQA group of query heads: folding a
/// group of 3 reads each block once instead of 3 times, widened in registers (`avx2::attend_group`,
/// `avx512_attention::attend_group`; against the per-query kernel at 1-8 sequences, 1K-4K tokens, AVX-512: f16
/// 1.22-1.80x, int8 1.13-1.48x, fp8 1.32-1.72x; AVX2: f16 0.95-1.33x, int8 1.10-1.35x, fp8 1.46-1.79x;
/// `grouped_decode_vs_per_query`, the command in its doc).
pub(crate) type AttendRows<'a> = &'a dyn AttendRowsFn;

/// The signature of [`AttendRows`].
pub(crate) trait AttendRowsFn:
    Fn(&[f32], usize, RowsOut, usize, &[u32], usize, bool, Option<&mut [f32]>) + Sync
{
}
impl<F: Fn(&[f32], usize, RowsOut, usize, &[u32], usize, bool, Option<&mut [f32]>) + Sync> AttendRowsFn for F {}

/// The pool's arenas as the SIMD kernels read them (null scale pointers for the float types), and their element
/// type (`avx2::ELEM_*`).
#[cfg(target_arch = "x86_64")]
fn simd_arenas(kv: &KvStorage) -> (avx2::Arenas, u8) {
    let bs = kv.block_size();
    let null = std::ptr::null::<f32>();
    let float = |k: *const u8, v: *const u8, elem| (avx2::Arenas { k, v, k_scale: null, v_scale: null, bs }, elem);
    match kv.arenas_any() {
        KvArenas::F32 { k, v } => float(k.as_ptr().cast(), v.as_ptr().cast(), avx2::ELEM_F32),
        KvArenas::F16 { k, v } => float(k.as_ptr().cast(), v.as_ptr().cast(), avx2::ELEM_F16),
        KvArenas::Scaled { k, v, k_scale, v_scale, dtype } => {
            let elem = if dtype.is_e4m3() { avx2::ELEM_FP8 } else { avx2::ELEM_I8 };
            (
                avx2::Arenas { k: k.as_ptr(), v: v.as_ptr(), k_scale: k_scale.as_ptr(), v_scale: v_scale.as_ptr(), bs },
                elem,
            )
        }
    }
}

/// The multi-query prefill kernel ([`avx512_attention::attend_rows`], [`avx2::attend_rows`]), when the backend
/// and cache allow it: AVX-512 or AVX2 over an f16 or 8-bit arena (int8, fp8, rotated fp8), on the instruction set
/// [`attend_one`] runs for the same arena and head_dim (a row's result must not depend on which of the two computed
/// it), head_dim 32, 64 or 128 (AVX2 also 96), blocks of at most 64 slots that fit its stack buffer.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct RowsKernel {
    avx512: bool,
    hd: usize,
    /// The arena's element type, as `avx2`'s `ELEM_*`.
    elem: u8,
    /// Keys are stored rotated: the queries are rotated to match, as [`attend_one`] rotates its query.
    rotate: bool,
}

#[cfg(target_arch = "x86_64")]
impl RowsKernel {
    fn select(simd: Simd, kv: &KvStorage) -> Option<RowsKernel> {
        let (bs, hd) = (kv.block_size(), kv.head_dim());
        let (_, elem) = simd_arenas(kv);
        if elem == avx2::ELEM_F32 {
            return None;
        }
        let fits = bs <= 64 && bs * hd <= avx512_attention::MAX_BLOCK_ELEMS;
        let avx512 = simd == Simd::Avx512 && hd != 96;
        let shape = matches!(hd, 32 | 64 | 96 | 128);
        let rotate = kv.dtype().rotates_keys();
        (simd.has_avx2() && fits && shape).then_some(RowsKernel { avx512, hd, elem, rotate })
    }

    /// [`Self::run`] over `kv` with `scale`, as [`par_queries`] calls a rows kernel ([`AttendRows`]).
    fn bind(self, kv: &KvStorage, scale: f32) -> impl AttendRowsFn + '_ {
        move |q: &[f32],
              q_stride: usize,
              out: RowsOut,
              rows: usize,
              table: &[u32],
              len0: usize,
              causal: bool,
              probs: Option<&mut [f32]>| {
            self.run(q, q_stride, out, rows, kv, table, len0, causal, scale, probs)
        }
    }

    /// Attention of `rows` queries (row `r` at `q[r * q_stride..][..head_dim]`, seeing `len0 + r` slots of `table`
    /// when `causal`, else `len0`). With `probs`, row `r`'s softmax probabilities go to
    /// `probs[r * stride..][..slots it sees]`, `stride` being the slots the last row sees.
    #[allow(clippy::too_many_arguments)]
    fn run(
        self,
        q: &[f32],
        q_stride: usize,
        out: RowsOut,
        rows: usize,
        kv: &KvStorage,
        table: &[u32],
        len0: usize,
        causal: bool,
        scale: f32,
        probs: Option<&mut [f32]>,
    ) {
        let (bs, hd) = (kv.block_size(), kv.head_dim());
        assert!((1..=avx512_attention::MAX_ROWS).contains(&rows) && len0 >= 1, "attend_rows: bad row count");
        assert!(q.len() >= (rows - 1) * q_stride + hd, "attend_rows: queries out of bounds");
        // Row r's probabilities at probs[r * stride..], `stride` the slots the last row sees.
        let stride = last_row_len(rows, len0, causal);
        let logits = probs.map(|p| {
            assert!(
                p.len() >= rows * stride,
                "attend_rows: {} floats for {rows} probability rows of {stride}",
                p.len()
            );
            (p.as_mut_ptr(), stride)
        });
        for &b in &table[..stride.div_ceil(bs)] {
            assert!((b as usize) < kv.num_blocks(), "block id {b} out of range");
        }
        let (arenas, _) = simd_arenas(kv);
        let (op, os) = (out.ptr.get(), out.stride);
        // SAFETY: the instruction set was detected (`select` takes Simd::Avx512 or Simd::Avx2); block ids were
        // checked against the arenas, whose scale arrays (8-bit) hold block_size scales per block; rows and
        // lengths are in the kernel's bounds (asserted above, and by `select` for the block); the query rows are
        // inside `q` (or the rotated copy of them below); the output rows belong to the calling task
        // (`par_queries`), apart from each other.
        let go = |qp: *const f32, q_stride: usize| unsafe {
            // One kernel family per instruction set (`avx512_attention`, `avx2`), the same signatures in both.
            macro_rules! family {
                ($module:ident, $nv:literal, $e:expr) => {
                    // A decode group: every row sees the same slots, and widening in registers for the group beats
                    // copying the block out widened (`attend_group`).
                    if !causal && logits.is_none() {
                        $module::attend_group::<$nv, { $e }>(qp, q_stride, op, os, rows, arenas, table, len0, scale)
                    } else {
                        $module::attend_rows::<$nv, { $e }>(
                            qp, q_stride, op, os, rows, arenas, table, len0, causal, scale, logits,
                        )
                    }
                };
            }
            macro_rules! by_elem {
                ($module:ident, $nv:literal) => {
                    match self.elem {
                        avx2::ELEM_F16 => family!($module, $nv, avx2::ELEM_F16),
                        avx2::ELEM_I8 => family!($module, $nv, avx2::ELEM_I8),
                        _ => family!($module, $nv, avx2::ELEM_FP8),
                    }
                };
            }
            match (self.avx512, self.hd) {
                (true, 32) => by_elem!(avx512_attention, 2),
                (true, 64) => by_elem!(avx512_attention, 4),
                (true, _) => by_elem!(avx512_attention, 8),
                (false, 32) => by_elem!(avx2, 4),
                (false, 64) => by_elem!(avx2, 8),
                (false, 96) => by_elem!(avx2, 12),
                (false, _) => by_elem!(avx2, 16),
            }
        };
        if !self.rotate {
            return go(q.as_ptr(), q_stride);
        }
        // Rotated keys: the rows' queries, rotated, on the stack (at most MAX_ROWS of 128 floats; only here, so
        // that the other caches' tasks do not clear 16 KiB each).
        let mut rotated = [0.0f32; avx512_attention::MAX_ROWS * 128];
        for (r, dst) in rotated.chunks_exact_mut(hd).take(rows).enumerate() {
            crate::codec::rotated_copy(&q[r * q_stride..r * q_stride + hd], dst);
        }
        go(rotated.as_ptr(), hd);
    }
}

/// Where one sequence's summed probabilities go inside [`par_queries`]: the start of its `[n_heads][stride]` rows,
/// the stride and the power each probability is raised to.
#[derive(Clone, Copy)]
pub(crate) struct ProbSink {
    sums: SyncPtr,
    stride: usize,
    power: u32,
}

// Scratch of the attention call, kept between calls because it runs per layer at every step. Each is taken for the
// call and put back, so a nested call gets fresh ones instead of a panic.
thread_local! {
    /// [`prob_sinks`]' index of the batch's sinks.
    static SINKS: Cell<Vec<Option<ProbSink>>> = const { Cell::new(Vec::new()) };
    /// The row ranges [`check_disjoint`] sorts.
    static RANGES: Cell<Vec<(usize, usize)>> = const { Cell::new(Vec::new()) };
    /// [`par_queries`]' first task of each sequence.
    static STARTS: Cell<Vec<usize>> = const { Cell::new(Vec::new()) };
}

/// Checks `probs` against the batch and indexes it by sequence into `sinks` (left empty when no sequence wants
/// probabilities). Panics if a sequence index is out of range or repeated, a stride is shorter than a row, or rows
/// are too short.
fn prob_sinks(
    seqs: &[AttnSeq<'_>],
    n_heads: usize,
    n_kv_heads: usize,
    probs: &mut [AttnProbs<'_>],
    sinks: &mut Vec<Option<ProbSink>>,
) {
    sinks.clear();
    if probs.is_empty() {
        return;
    }
    sinks.resize(seqs.len(), None);
    for p in probs.iter_mut() {
        let s = seqs.get(p.seq).unwrap_or_else(|| panic!("AttnProbs: sequence {} not in the batch", p.seq));
        let longest = s.prior_lens[..n_kv_heads].iter().map(|&l| l + s.n_new).max().unwrap_or(0);
        assert!(p.stride >= longest, "AttnProbs: stride {} shorter than a row of {longest}", p.stride);
        let need = n_heads.checked_mul(p.stride).expect("AttnProbs size overflows");
        assert!(p.sums.len() >= need, "AttnProbs: {} floats, the rows need {need}", p.sums.len());
        assert!(sinks[p.seq].is_none(), "AttnProbs: sequence {} given twice", p.seq);
        sinks[p.seq] = Some(ProbSink { sums: SyncPtr::new(p.sums), stride: p.stride, power: p.power });
    }
}

thread_local! {
    /// One query's probability row, for tasks that sum rows into an [`AttnProbs`]: reused by every task a pool
    /// thread runs, so summing allocates nothing once the longest row has been seen.
    static PROB_ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `attend(query, kv-head table, visible length, output, probability row)` for every (sequence, query head,
/// new token) of the batch on the backend's pool, in tasks of up to [`TOKEN_CHUNK`] tokens of one head. For a
/// sequence with a sink in `sinks` (indexed by sequence; empty for none) a task takes all its new tokens of one
/// head, hands `attend` a probability row of exactly the visible length, and sums the rows into the head's row of
/// the sink. With `attend_rows` ([`AttendRows`]), a task of several tokens without a sink hands them to it in one
/// call. The caller has
/// checked the sequences (`check_seq`, `check_disjoint`) and the sinks (`prob_sinks`): each output slice and each
/// sink row is then written by exactly one task.
#[allow(clippy::too_many_arguments)]
pub(crate) fn par_queries<F>(
    be: &CpuBackend,
    q: &[f32],
    seqs: &[AttnSeq<'_>],
    n_heads: usize,
    n_kv_heads: usize,
    hd: usize,
    out: &mut [f32],
    sinks: &[Option<ProbSink>],
    attend: &F,
    attend_rows: Option<AttendRows<'_>>,
) where
    F: Fn(&[f32], &[u32], usize, &mut [f32], Option<&mut [f32]>) + Sync,
{
    let w = n_heads * hd;
    let o = SyncPtr::new(out);
    let group = n_heads / n_kv_heads;
    let sink_of = |si: usize| sinks.get(si).copied().flatten();
    // A summing task must own its head's sink row, so it takes all of the sequence's tokens.
    let chunk_of = |si: usize, s: &AttnSeq<'_>| if sink_of(si).is_some() { s.n_new.max(1) } else { TOKEN_CHUNK };
    // A one-token step (decode) without a sink: one task per kv-head, whose GQA group of query heads the rows
    // kernel folds together, so each block is read from memory and widened once for the group, not once per head.
    let grouped = |si: usize, s: &AttnSeq<'_>| {
        attend_rows.is_some() && (2..=MAX_GROUP_ROWS).contains(&group) && s.n_new == 1 && sink_of(si).is_none()
    };
    let tasks_of = |si: usize, s: &AttnSeq<'_>| {
        if grouped(si, s) { n_kv_heads } else { s.n_new.div_ceil(chunk_of(si, s)) * n_heads }
    };
    let task = |si: usize, t: usize| {
        let s = &seqs[si];
        if let (true, Some(rows)) = (grouped(si, s), attend_rows) {
            let (kvh, row) = (t, s.q_row);
            let h0 = row * w + kvh * group * hd;
            // SAFETY: row `row`'s heads kvh*group .. (kvh+1)*group belong to this task alone (one task per kv-head
            // of a one-token sequence; the caller checked that row ranges are disjoint and in bounds).
            let out = RowsOut { ptr: SyncPtr(unsafe { o.get().add(h0) }), stride: hd };
            rows(&q[h0..h0 + group * hd], hd, out, group, &s.tables[kvh], s.prior_lens[kvh] + 1, false, None);
            return;
        }
        let chunk = chunk_of(si, s);
        let chunks = s.n_new.div_ceil(chunk);
        let qh = t / chunks;
        let c = t % chunks;
        let kvh = qh / group;
        let j0 = c * chunk;
        let j1 = (j0 + chunk).min(s.n_new);
        let query = |j: usize| {
            let row = s.q_row + j;
            let len = s.prior_lens[kvh] + j + 1;
            let qv = &q[row * w + qh * hd..row * w + (qh + 1) * hd];
            // SAFETY: each (row, head) output slice is written by exactly one task: rows are in bounds and the
            // sequences' row ranges are disjoint (both checked by the caller).
            let acc = unsafe { std::slice::from_raw_parts_mut(o.get().add(row * w + qh * hd), hd) };
            (qv, len, acc)
        };
        // Tokens c0..c0 + n of head qh through the rows kernel: the first sees len0(c0) slots.
        let len0 = |c0: usize| s.prior_lens[kvh] + c0 + 1;
        let rows_call = |rows: AttendRows<'_>, c0: usize, n: usize, probs: Option<&mut [f32]>| {
            let r0 = s.q_row + c0;
            let queries = &q[r0 * w + qh * hd..(r0 + n - 1) * w + (qh + 1) * hd];
            // SAFETY: as for `query` above: rows r0.. of head qh belong to this task alone.
            let out = RowsOut { ptr: SyncPtr(unsafe { o.get().add(r0 * w + qh * hd) }), stride: w };
            rows(queries, w, out, n, &s.tables[kvh], len0(c0), true, probs);
        };
        let Some(k) = sink_of(si) else {
            if let Some(rows) = attend_rows.filter(|_| j1 - j0 >= 2) {
                rows_call(rows, j0, j1 - j0, None);
                return;
            }
            for j in j0..j1 {
                let (qv, len, acc) = query(j);
                attend(qv, &s.tables[kvh], len, acc, None);
            }
            return;
        };
        let visible = s.prior_lens[kvh] + s.n_new;
        // SAFETY: row qh of the sink is inside its sums (`prob_sinks` checked n_heads * stride and stride >=
        // visible) and this task, the only one of head qh, is its only writer.
        let sums = unsafe { std::slice::from_raw_parts_mut(k.sums.get().add(qh * k.stride), visible) };
        sums.fill(0.0);
        PROB_ROW.with_borrow_mut(|row| {
            // Several tokens: the rows kernel in chunks of its most rows, each row's probabilities in its own row
            // of the buffer, summed in token order as the per-query loop below sums them (the same values: the
            // kernels' arithmetic per row is the same).
            if let Some(rows) = attend_rows.filter(|_| j1 - j0 >= 2) {
                let mut c0 = j0;
                while c0 < j1 {
                    let n = (j1 - c0).min(avx512_attention::MAX_ROWS);
                    let stride = last_row_len(n, len0(c0), true);
                    row.resize(row.len().max(n * stride), 0.0);
                    rows_call(rows, c0, n, Some(&mut row[..n * stride]));
                    for r in 0..n {
                        let seen = len0(c0) + r;
                        let probs = &row[r * stride..r * stride + seen];
                        super::scores::accumulate_probs(probs, k.power, &mut sums[..seen]);
                    }
                    c0 += n;
                }
                return;
            }
            row.resize(row.len().max(visible), 0.0);
            for j in j0..j1 {
                let (qv, len, acc) = query(j);
                attend(qv, &s.tables[kvh], len, acc, Some(&mut row[..len]));
                super::scores::accumulate_probs(&row[..len], k.power, &mut sums[..len]);
            }
        });
    };
    // Flatten (sequence, head, token chunk) into task indices: starts[i] = first task of sequence i.
    let mut starts = STARTS.take();
    starts.clear();
    let mut total = 0usize;
    for (si, s) in seqs.iter().enumerate() {
        starts.push(total);
        total += tasks_of(si, s);
    }
    starts.push(total);
    be.par_for(total, &|t| {
        let i = starts.partition_point(|&st| st <= t) - 1;
        task(i, t - starts[i]);
    });
    STARTS.set(starts);
}

/// Panics unless the sequences' row ranges `[q_row, q_row + n_new)` are pairwise disjoint (each output row
/// must be written by one task only).
pub(crate) fn check_disjoint(seqs: &[AttnSeq<'_>]) {
    let mut ranges = RANGES.take();
    ranges.clear();
    ranges.extend(seqs.iter().filter(|s| s.n_new > 0).map(|s| (s.q_row, s.q_row + s.n_new)));
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        assert!(w[0].1 <= w[1].0, "AttnSeq row ranges overlap: {:?} and {:?}", w[0], w[1]);
    }
    RANGES.set(ranges);
}

thread_local! {
    /// One block of keys and one of values widened to f32 by the portable path of [`attend_one`], kept between
    /// calls.
    static WIDENED: Cell<(Vec<f32>, Vec<f32>)> = const { Cell::new((Vec::new(), Vec::new())) };
}

/// Attention of one query vector over the first `len` slots of `table`; writes the result into `out` and, with
/// `probs` (`len` floats), the softmax probabilities of the slots.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    simd: Simd,
    q: &[f32],
    kv: &KvStorage,
    table: &[u32],
    len: usize,
    scale: f32,
    out: &mut [f32],
    mut probs: Option<&mut [f32]>,
) {
    let bs = kv.block_size();
    let ids = &table[..len.div_ceil(bs)];
    #[cfg(target_arch = "x86_64")]
    if simd.has_avx2() && bs <= 64 {
        for &b in ids {
            assert!((b as usize) < kv.num_blocks(), "block id {b} out of range");
        }
        let (arenas, elem) = simd_arenas(kv);
        // Keys stored rotated are scored against the query rotated the same way (the transform is orthonormal);
        // the buffer is cleared only then, since this runs per (query, head). Queries longer than 128 take the
        // portable path below, which reads keys rotated back.
        let mut rotated: [f32; 128];
        let q = if kv.dtype().rotates_keys() && q.len() <= 128 {
            rotated = [0.0; 128];
            crate::codec::rotated_copy(q, &mut rotated)
        } else {
            q
        };
        // SAFETY (both macros): every block id read was checked against the arenas above, which hold `num_blocks`
        // blocks of the element type `elem` names (8-bit arenas with `num_blocks * bs` scales); the CPU features of
        // `simd` were detected at run time.
        macro_rules! one {
            ($module:ident, $nv:literal, $e:expr) => {
                return unsafe { $module::attend_one::<$nv, { $e }>(q, arenas, table, len, scale, out, probs) }
            };
        }
        macro_rules! avx2 {
            ($nv:literal) => {
                match elem {
                    avx2::ELEM_F16 => one!(avx2, $nv, avx2::ELEM_F16),
                    avx2::ELEM_I8 => one!(avx2, $nv, avx2::ELEM_I8),
                    avx2::ELEM_FP8 => one!(avx2, $nv, avx2::ELEM_FP8),
                    _ => one!(avx2, $nv, avx2::ELEM_F32),
                }
            };
        }
        macro_rules! avx512 {
            ($nv:literal) => {
                match elem {
                    avx2::ELEM_F16 => one!(avx512_attention, $nv, avx2::ELEM_F16),
                    avx2::ELEM_I8 => one!(avx512_attention, $nv, avx2::ELEM_I8),
                    _ => one!(avx512_attention, $nv, avx2::ELEM_FP8),
                }
            };
        }
        // AVX-512 for f16 and the 8-bit pools, not f32: over f32 blocks it was slower than the AVX2 kernel once
        // memory-bound (batch 32; see docs/BENCHMARKS.md, measured at 0f1611d); over f16 it is as fast there and
        // ~14% faster at 4K single-stream. The rows kernel takes the same form (`RowsKernel::select`), so a row's
        // result does not depend on which of the two computed it.
        if simd == Simd::Avx512 && elem != avx2::ELEM_F32 {
            match q.len() {
                32 => avx512!(2),
                64 => avx512!(4),
                128 => avx512!(8),
                _ => {}
            }
        }
        match q.len() {
            32 => avx2!(4),
            64 => avx2!(8),
            96 => avx2!(12),
            128 => avx2!(16),
            _ => {}
        }
    }
    out.fill(0.0);
    let hd = kv.head_dim();
    let mut st = scalar::OnlineSoftmax { m: f32::NEG_INFINITY, l: 0.0, acc: out };
    let n_of = |bi: usize| (len - bi * bs).min(bs);
    // The block's slice of the probability row, which `attend_block` fills with the scaled logits.
    macro_rules! logits {
        ($bi:expr) => {
            probs.as_deref_mut().map(|p| &mut p[$bi * bs..$bi * bs + n_of($bi)])
        };
    }
    if kv.dtype() == KvDtype::F32 {
        for (bi, &b) in ids.iter().enumerate() {
            scalar::attend_block(q, kv.block_k(b), kv.block_v(b), n_of(bi), scale, &mut st, logits!(bi));
        }
    } else {
        // Blocks are widened a block at a time into this thread's buffers, which only grow: this runs per (query,
        // head), where a stack buffer had to be cleared every call and larger blocks allocated.
        let (mut kb, mut vb) = WIDENED.take();
        if kb.len() < kv.block_len() {
            kb.resize(kv.block_len(), 0.0);
            vb.resize(kv.block_len(), 0.0);
        }
        for (bi, &b) in ids.iter().enumerate() {
            let e = n_of(bi) * hd;
            kv.read_block(b, &mut kb[..e], &mut vb[..e]);
            scalar::attend_block(q, &kb[..e], &vb[..e], n_of(bi), scale, &mut st, logits!(bi));
        }
        WIDENED.set((kb, vb));
    }
    let inv = if st.l > 0.0 { 1.0 / st.l } else { 0.0 };
    for a in st.acc.iter_mut() {
        *a *= inv;
    }
    if let Some(p) = probs {
        scalar::probs_from_logits(p, st.m, inv);
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::Backend;
    use std::time::Instant;

    /// The per-query kernel and the rows kernel over `kv`, as `par_queries` takes them.
    #[allow(clippy::type_complexity)]
    fn kernel_pair<'a>(
        be: &'a CpuBackend,
        kv: &'a KvStorage,
        rows: RowsKernel,
        scale: f32,
    ) -> (impl Fn(&[f32], &[u32], usize, &mut [f32], Option<&mut [f32]>) + Sync + 'a, impl AttendRowsFn + 'a) {
        let one = move |qv: &[f32], table: &[u32], len: usize, acc: &mut [f32], p: Option<&mut [f32]>| {
            attend_one(be.simd(), qv, kv, table, len, scale, acc, p)
        };
        (one, rows.bind(kv, scale))
    }

    /// A decode batch whose kv-heads' tables are scattered through an arena of `dtype`: the cache and each
    /// sequence's tables.
    fn decode_cache(
        dtype: KvDtype,
        n_kv: usize,
        hd: usize,
        bs: usize,
        lens: &[usize],
    ) -> (KvStorage, Vec<Vec<Vec<u32>>>) {
        let per: Vec<usize> = lens.iter().map(|&l| (l + 1).div_ceil(bs)).collect();
        let total: usize = per.iter().sum::<usize>() * n_kv;
        let mut kv = KvStorage::with_dtype(total, bs, hd, dtype);
        let val = |i: usize| ((i as f32 * 0.618).fract() - 0.5) * 2.0;
        for b in 0..total as u32 {
            let k: Vec<f32> = (0..bs * hd).map(|i| val(i + 7 * b as usize)).collect();
            let v: Vec<f32> = (0..bs * hd).map(|i| val(3 * i + b as usize)).collect();
            kv.write_block(b, &k, &v);
        }
        // Block i of the arena goes to (sequence, head, position) in a stride-7 order, so tables interleave.
        let mut order: Vec<u32> = (0..total as u32).collect();
        order.sort_by_key(|&b| (b as usize * 7) % total);
        let mut next = order.into_iter();
        let tables = per.iter().map(|&n| (0..n_kv).map(|_| next.by_ref().take(n).collect()).collect()).collect();
        (kv, tables)
    }

    /// A prefill step's sequences over `tables`: sequence `i` computes `news[i]` tokens on top of `prior_lens[i]`,
    /// its rows after the previous sequence's.
    fn prefill_seqs<'a>(tables: &'a [Vec<Vec<u32>>], prior_lens: &'a [Vec<usize>], news: &[usize]) -> Vec<AttnSeq<'a>> {
        let mut q_row = 0;
        let mut seqs = Vec::new();
        for (i, &n_new) in news.iter().enumerate() {
            seqs.push(AttnSeq { q_row, n_new, tables: &tables[i], prior_lens: &prior_lens[i] });
            q_row += n_new;
        }
        seqs
    }

    /// One decode step (one token per sequence, `lens[i]` cached slots) over `decode_cache`, both ways on `simd`:
    /// `(per-query output, grouped output, per-query ms, grouped ms)`, medians over `reps`; `None` where the rows
    /// kernel does not apply.
    #[allow(clippy::type_complexity)]
    fn decode_both_ways(
        dtype: KvDtype,
        simd: Simd,
        (n_heads, n_kv, hd, bs): (usize, usize, usize, usize),
        lens: &[usize],
        reps: usize,
    ) -> Option<(Vec<f32>, Vec<f32>, f64, f64)> {
        let (kv, tables) = decode_cache(dtype, n_kv, hd, bs, lens);
        let priors: Vec<Vec<usize>> = lens.iter().map(|&l| vec![l; n_kv]).collect();
        let seqs: Vec<AttnSeq<'_>> = (0..lens.len())
            .map(|i| AttnSeq { q_row: i, n_new: 1, tables: &tables[i], prior_lens: &priors[i] })
            .collect();
        let q: Vec<f32> = (0..lens.len() * n_heads * hd).map(|i| ((i as f32 * 0.377).fract() - 0.5) * 3.0).collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let be = CpuBackend::with_simd(2, simd);
        let rows = RowsKernel::select(be.simd(), &kv)?;
        let (one, many) = kernel_pair(&be, &kv, rows, scale);
        let (mut per_query, mut grouped) = (vec![0.0; q.len()], vec![1.0; q.len()]);
        let (mut t_one, mut t_grouped) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let t = Instant::now();
            par_queries(&be, &q, &seqs, n_heads, n_kv, hd, &mut per_query, &[], &one, None);
            t_one.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            let rows: AttendRows<'_> = &many;
            par_queries(&be, &q, &seqs, n_heads, n_kv, hd, &mut grouped, &[], &one, Some(rows));
            t_grouped.push(t.elapsed().as_secs_f64() * 1e3);
        }
        // The public entry point takes the grouped path and must agree as well.
        let mut public = vec![2.0; q.len()];
        be.paged_attention(&q, &kv, &seqs, n_heads, n_kv, scale, &mut public);
        assert_eq!(grouped, public, "{simd:?} {dtype}: Backend::paged_attention");
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        Some((per_query, grouped, median(&mut t_one), median(&mut t_grouped)))
    }

    /// A prefill chunk's K and V rows encoded on the pool and then stored (`kv_write_encoded`) leave an 8-bit
    /// cache bit for bit as the one-thread write does: codes and slot scales, every dtype, three sequences with
    /// cached prefixes over interleaved tables, rows that hold a zero row and an outlier.
    #[test]
    fn encoded_kv_write_matches_the_plain_write_bit_for_bit() {
        let (n_kv, hd, bs) = (3usize, 64usize, 16usize);
        let (priors, news) = ([0usize, 37, 5], [70usize, 2, 33]);
        let lens: Vec<usize> = priors.iter().zip(&news).map(|(p, n)| p + n).collect();
        let rows: usize = news.iter().sum();
        let val = |i: usize| ((i as f32 * 0.618).fract() - 0.5) * 4.0;
        let mut k: Vec<f32> = (0..rows * n_kv * hd).map(val).collect();
        let v: Vec<f32> = (0..rows * n_kv * hd).map(|i| val(3 * i + 1)).collect();
        k[..hd].fill(0.0);
        k[5 * hd + 3] = 900.0;
        let be = CpuBackend::new(3);
        for dtype in [KvDtype::Int8, KvDtype::Fp8, KvDtype::Fp8Rotated] {
            let (mut plain, tables) = decode_cache(dtype, n_kv, hd, bs, &lens);
            let mut encoded = plain.clone();
            let prior_lens: Vec<Vec<usize>> = priors.iter().map(|&p| vec![p; n_kv]).collect();
            let seqs = prefill_seqs(&tables, &prior_lens, &news);
            kv_write(&mut plain, &k, &v, &seqs, n_kv);
            kv_write_encoded(&be, &mut encoded, &k, &v, &seqs, n_kv);
            let raw = |kv: &KvStorage| match kv.arenas_any() {
                KvArenas::Scaled { k, v, k_scale, v_scale, .. } => {
                    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    (k.to_vec(), v.to_vec(), bits(k_scale), bits(v_scale))
                }
                _ => panic!("not a scaled cache"),
            };
            assert!(raw(&plain) == raw(&encoded), "{dtype}: the encoded write differs");
        }
    }

    /// The rows kernels' block walk hands every row exactly the slots of each block it sees (query r of a causal
    /// walk sees the first len0 + r slots, of a plain walk len0), once, in block order, with the rows that see a
    /// whole block in one run: checked against that rule over block sizes, first lengths and row counts.
    #[test]
    fn row_block_walk_hands_each_row_its_visible_slots_once() {
        for bs in [1usize, 4, 16] {
            for len0 in [1usize, 2, 15, 16, 17, 40] {
                for rows in [1usize, 2, 3, 16, 31, 32] {
                    for causal in [false, true] {
                        let table: Vec<u32> = (0..(len0 + rows).div_ceil(bs) as u32).map(|b| 1000 + b).collect();
                        let mut widened = Vec::new();
                        let mut seen = vec![Vec::new(); rows];
                        let current = std::cell::Cell::new(usize::MAX);
                        for_row_blocks(
                            rows,
                            len0,
                            causal,
                            bs,
                            1,
                            &table,
                            |src, _, _| {
                                current.set(src);
                                widened.push(src);
                            },
                            |rs, n, s0| {
                                assert!(!rs.is_empty() && n > 0 && n <= bs);
                                assert_eq!(
                                    current.get(),
                                    table[s0 / bs] as usize * bs,
                                    "fold before its block's widen"
                                );
                                if rs.len() > 1 {
                                    let whole = (last_row_len(rows, len0, causal) - s0).min(bs);
                                    assert_eq!(n, whole, "a run of rows sees the whole block");
                                }
                                for r in rs {
                                    seen[r].push((s0, n));
                                }
                            },
                        );
                        for (r, blocks) in seen.iter().enumerate() {
                            let visible = if causal { len0 + r } else { len0 };
                            let want: Vec<(usize, usize)> =
                                (0..visible.div_ceil(bs)).map(|b| (b * bs, (visible - b * bs).min(bs))).collect();
                            assert_eq!(blocks, &want, "bs {bs}, len0 {len0}, rows {rows}, causal {causal}, row {r}");
                        }
                        assert_eq!(widened.len(), last_row_len(rows, len0, causal).div_ceil(bs));
                    }
                }
            }
        }
    }

    /// Decode with the GQA group folded per kv-head (one task per kv-head, each block widened once for the group)
    /// gives exactly the per-query kernel's values, for group sizes 2 to 8 (the 8-bit kernel's passes of 4 with
    /// every remainder), head_dim 32 to 128, context lengths on and off block boundaries, and several sequences in
    /// one batch, on both instruction sets, over every dtype the rows kernel reads.
    #[test]
    fn grouped_decode_matches_per_query_decode_bit_for_bit() {
        let lens = [0usize, 14, 15, 16, 31, 100, 257];
        for dtype in [KvDtype::F16, KvDtype::Int8, KvDtype::Fp8, KvDtype::Fp8Rotated] {
            let shapes = [(4usize, 2usize, 64usize), (9, 3, 64), (32, 8, 64), (16, 2, 64), (10, 2, 64), (28, 4, 32)];
            for (n_heads, n_kv, hd) in shapes.into_iter().chain([(9, 3, 96), (12, 4, 128)]) {
                for simd in [Simd::Avx2, Simd::Avx512] {
                    let shape = (n_heads, n_kv, hd, 16);
                    if let Some((per_query, grouped, _, _)) = decode_both_ways(dtype, simd, shape, &lens, 1) {
                        assert_eq!(per_query, grouped, "{simd:?} {dtype}, {n_heads}/{n_kv} heads of {hd}");
                    }
                }
            }
        }
    }

    /// Prefill chunks of sequences that sum probabilities (H2O, KV-Compress) go through the rows kernel in chunks
    /// of up to 32 rows, with each row's probabilities in a buffer: outputs and sums are the per-query kernel's bit
    /// for bit, for every dtype the rows kernel reads, both instruction sets, chunks of 2 to 70 tokens (three
    /// kernel calls) beside a sequence without a sink, and both powers.
    #[test]
    fn summing_prefill_through_the_rows_kernel_matches_per_query_bit_for_bit() {
        let (n_heads, n_kv, hd, bs) = (9usize, 3usize, 64usize, 16usize);
        let (priors, news) = ([0usize, 37, 5], [70usize, 2, 33]);
        let lens: Vec<usize> = priors.iter().zip(&news).map(|(p, n)| p + n).collect();
        for dtype in [KvDtype::F16, KvDtype::Int8, KvDtype::Fp8, KvDtype::Fp8Rotated] {
            let (kv, tables) = decode_cache(dtype, n_kv, hd, bs, &lens);
            let prior_lens: Vec<Vec<usize>> = priors.iter().map(|&p| vec![p; n_kv]).collect();
            let seqs = prefill_seqs(&tables, &prior_lens, &news);
            let rows: usize = news.iter().sum();
            let q: Vec<f32> = (0..rows * n_heads * hd).map(|i| ((i as f32 * 0.377).fract() - 0.5) * 3.0).collect();
            let scale = 1.0 / (hd as f32).sqrt();
            for simd in [Simd::Avx2, Simd::Avx512] {
                let be = CpuBackend::with_simd(2, simd);
                let Some(rows) = RowsKernel::select(be.simd(), &kv) else { continue };
                let (one, many) = kernel_pair(&be, &kv, rows, scale);
                let mut results = Vec::new();
                for with_rows in [false, true] {
                    let stride = lens[0] + 3;
                    let (mut h2o, mut kvc) = (vec![-1.0; n_heads * stride], vec![-1.0; n_heads * (lens[2] + 1)]);
                    let mut probs = [
                        AttnProbs { seq: 0, power: 1, stride, sums: &mut h2o },
                        AttnProbs { seq: 2, power: 2, stride: lens[2] + 1, sums: &mut kvc },
                    ];
                    let mut sinks = Vec::new();
                    prob_sinks(&seqs, n_heads, n_kv, &mut probs, &mut sinks);
                    let mut out = vec![0.0; q.len()];
                    let rows_kernel: Option<AttendRows<'_>> = with_rows.then_some(&many);
                    par_queries(&be, &q, &seqs, n_heads, n_kv, hd, &mut out, &sinks, &one, rows_kernel);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    results.push((bits(&out), bits(&h2o), bits(&kvc)));
                }
                assert!(results[0] == results[1], "{simd:?} {dtype}: rows kernel and per-query sums differ");
            }
        }
    }

    /// Timing of grouped against per-query decode (SmolLM2's 9/3 heads, two threads, interleaved 7 times): 32
    /// sequences at 4,096 tokens over f16, then 1 and 8 sequences at 1,024 and 4,096 tokens over f16 and the 8-bit
    /// pools. Asserts equal values and prints the medians.
    /// `cargo test --release -p pagoda-kernels --lib grouped_decode_vs_per_query -- --ignored --nocapture`
    #[test]
    #[ignore = "timing; run by hand"]
    fn grouped_decode_vs_per_query() {
        let mut cases = vec![(KvDtype::F16, 32, 4095)];
        for dtype in [KvDtype::F16, KvDtype::Int8, KvDtype::Fp8, KvDtype::Fp8Rotated] {
            for (batch, len) in [(1, 1023), (1, 4095), (8, 1023), (8, 4095)] {
                cases.push((dtype, batch, len));
            }
        }
        for (dtype, batch, len) in cases {
            for simd in [Simd::Avx2, Simd::Avx512] {
                let lens = vec![len; batch];
                if let Some((per_query, grouped, a, b)) = decode_both_ways(dtype, simd, (9, 3, 64, 16), &lens, 7) {
                    assert_eq!(per_query, grouped);
                    println!(
                        "{dtype} {simd:?}, {batch} x {len}: per-query {a:.3} ms, grouped {b:.3} ms, {:.2}x",
                        a / b
                    );
                }
            }
        }
    }

    /// The rows kernel against the per-query kernel it replaces in prefill, same instruction set, same data: a
    /// 512-token chunk on top of 3,584 cached tokens (f16, then int8; SmolLM2's 9 heads over 3 kv-heads, head_dim
    /// 64), two threads, the two paths interleaved. They must agree bit for bit (same arithmetic per row); the
    /// timing is printed. `cargo test --release -p pagoda-kernels --lib rows_kernel_vs_per_query -- --ignored
    /// --nocapture`
    #[test]
    #[ignore = "timing; run by hand"]
    fn rows_kernel_vs_per_query() {
        for dtype in [KvDtype::F16, KvDtype::Int8] {
            rows_kernel_vs_per_query_over(dtype);
        }
    }

    fn rows_kernel_vs_per_query_over(dtype: KvDtype) {
        let (n_heads, n_kv, hd, bs, prior, n_new) = (9usize, 3usize, 64usize, 16usize, 3584usize, 512usize);
        let per_head = (prior + n_new).div_ceil(bs);
        let mut kv = KvStorage::with_dtype(per_head * n_kv, bs, hd, dtype);
        let val = |i: usize| ((i as f32 * 0.618).fract() - 0.5) * 2.0;
        for b in 0..(per_head * n_kv) as u32 {
            let k: Vec<f32> = (0..bs * hd).map(|i| val(i + 7 * b as usize)).collect();
            let v: Vec<f32> = (0..bs * hd).map(|i| val(3 * i + b as usize)).collect();
            kv.write_block(b, &k, &v);
        }
        let tables: Vec<Vec<u32>> =
            (0..n_kv).map(|h| ((h * per_head) as u32..((h + 1) * per_head) as u32).collect()).collect();
        let prior_lens = vec![prior; n_kv];
        let seqs = [AttnSeq { q_row: 0, n_new, tables: &tables, prior_lens: &prior_lens }];
        let q: Vec<f32> = (0..n_new * n_heads * hd).map(|i| val(5 * i + 1)).collect();
        let scale = 1.0 / (hd as f32).sqrt();
        for simd in [Simd::Avx2, Simd::Avx512] {
            let be = CpuBackend::with_simd(2, simd);
            let Some(rows) = RowsKernel::select(be.simd(), &kv) else { continue };
            let (one, many) = kernel_pair(&be, &kv, rows, scale);
            let (mut per_query, mut tiled) = (vec![0.0; q.len()], vec![0.0; q.len()]);
            let (mut t_one, mut t_rows) = (Vec::new(), Vec::new());
            for _ in 0..7 {
                let t = Instant::now();
                par_queries(&be, &q, &seqs, n_heads, n_kv, hd, &mut per_query, &[], &one, None);
                t_one.push(t.elapsed().as_secs_f64() * 1e3);
                let t = Instant::now();
                let rows: AttendRows<'_> = &many;
                par_queries(&be, &q, &seqs, n_heads, n_kv, hd, &mut tiled, &[], &one, Some(rows));
                t_rows.push(t.elapsed().as_secs_f64() * 1e3);
            }
            assert_eq!(per_query, tiled, "{simd:?}: the rows kernel must give the per-query kernel's values");
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (a, b) = (median(&mut t_one), median(&mut t_rows));
            println!("{dtype} {:?}: per-query {a:.2} ms, rows {b:.2} ms, {:.2}x", be.simd(), a / b);
        }
    }
}
