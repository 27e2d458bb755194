//! KV-cache eviction score kernels: every number an eviction policy ranks slots or blocks by is computed here,
//! so that policy code only decides *which* scores to ask for and what to do with the ranking.
//!
//! All kernels read one (layer, kv-head) cache of a [`KvStorage`], addressed by its block `table` and the number
//! of slots in use `len`: slot `i` lives in block `table[i / block_size]` at offset `i % block_size`.
//!
//! | kernel | rule | policy keeps |
//! |---|---|---|
//! | [`key_norms`] | ‖K_i‖₂ (Inverse Key L2-Norm, Devoto et al. 2024, as described in PagedEviction §5.2) | lowest |
//! | [`value_key_ratio`] | ‖V_i‖₂ / ‖K_i‖₂ (PagedEviction §4.1, Alg. 1 line 3) | highest |
//! | [`block_means`] | mean of a per-slot score over each block (PagedEviction Alg. 1 lines 6–9, Alg. 3) | highest |
//! | [`keydiff_cosine`] | cos(µ(K̂), k_i) (KeyDiff Eq. 8, App. A.2.1) | lowest |
//! | [`keydiff_cosine_kept`] | the same from a kept anchor sum ([`add_unit_keys`]) and kept norms (decode steps) | lowest |
//! | [`window_attention_scores`] | Σ attention (SnapKV, H2O, SAGE-KV) or Σ attention² (KV-Compress Eq. 19/20) | highest |
//! | [`accumulate_probs`] | the same sums, inside the attention kernel, from the probabilities it computed | highest |
//! | [`max_pool1d`] | SnapKV pooling (KV-Compress Eq. 8) | — |
//! | [`select_k`] | deterministic top/bottom-k (the `topk` of KeyDiff Eq. 5/8) | — |
//! | [`select_one`] | the same for k = 1 among eligible indices, in one pass (one victim per decode step) | — |
//!
//! Slot compaction after eviction lives with the storage: [`KvStorage::move_slot`] and
//! [`KvStorage::compact_table`].
//!
//! None of the kernels allocate per slot: scratch vectors are passed in and only grow, so a caller that keeps them
//! across steps allocates once; blocks of non-f32 caches are widened into per-thread buffers that only grow as well.

use super::scalar::dot_f32;
use crate::paged::{KvDtype, KvStorage};
use std::cell::Cell;
use std::cmp::Ordering;
use std::ops::Range;

/// Lower bound on ‖K_i‖₂ in [`value_key_ratio`]. The paper's ratio is undefined for a zero key. Its premise
/// (Devoto et al., PagedEviction §4.1) is that smaller key norms draw more attention, so a zero key is the limiting
/// case and a very large but finite score is the faithful reading; finiteness matters because an `inf` would make
/// every block mean containing it `inf` (or `NaN` with a zero value). 1e-6 is far below real key norms (≈1–100).
pub const RATIO_EPS: f32 = 1e-6;

/// Lower bound on norms in [`keydiff_cosine`]: the ϵ of KeyDiff App. A.2.1, `max(‖µ(K̂)‖·‖k_i‖, ϵ)`, also used
/// when normalising keys for the anchor (so a zero key contributes a zero vector instead of NaN). The paper gives
/// no value; 1e-8 is PyTorch's `cosine_similarity` default, which its reference implementation inherits.
pub const COSINE_EPS: f32 = 1e-8;

thread_local! {
    /// One block of keys and one of values widened to f32 by [`for_each_slot_in`], kept between calls.
    static WIDENED: Cell<(Vec<f32>, Vec<f32>)> = const { Cell::new((Vec::new(), Vec::new())) };
}

/// Calls `f(i, k_i, v_i)` for slots `0..len` of one cache, walking the block table once.
#[inline]
fn for_each_slot(kv: &KvStorage, table: &[u32], len: usize, f: impl FnMut(usize, &[f32], &[f32])) {
    for_each_slot_in(kv, table, 0..len, f);
}

/// Calls `f(i, k_i, v_i)` for the slots `i` in `slots`, reading only the blocks that hold them.
#[inline]
fn for_each_slot_in(kv: &KvStorage, table: &[u32], slots: Range<usize>, mut f: impl FnMut(usize, &[f32], &[f32])) {
    let bs = kv.block_size();
    let hd = kv.head_dim();
    let len = slots.end;
    if slots.start >= len {
        return;
    }
    let first_block = slots.start / bs;
    let blocks = len.div_ceil(bs);
    debug_assert!(table.len() >= blocks, "score kernels: table has {} blocks, len {len} needs {blocks}", table.len());
    let f32_cache = kv.dtype() == KvDtype::F32;
    // Other dtypes are widened a block at a time into this thread's buffers, which only grow: these kernels run per
    // (layer, kv-head) table at every decode step, so a buffer per call (or a fixed stack one that large blocks
    // outgrow) would allocate on the hot path. Taken rather than borrowed, so that an `f` that itself walks a table
    // gets buffers of its own instead of a panic.
    let (mut kw, mut vw) = WIDENED.take();
    if !f32_cache && kw.len() < kv.block_len() {
        kw.resize(kv.block_len(), 0.0);
        vw.resize(kv.block_len(), 0.0);
    }
    for (bi, &b) in table[..blocks].iter().enumerate().skip(first_block) {
        let n = (len - bi * bs).min(bs);
        let e = n * hd;
        let (kb, vb): (&[f32], &[f32]) = if f32_cache {
            (&kv.block_k(b)[..e], &kv.block_v(b)[..e])
        } else {
            kv.read_block(b, &mut kw[..e], &mut vw[..e]);
            (&kw[..e], &vw[..e])
        };
        let skip = slots.start.saturating_sub(bi * bs);
        for (s, (k, v)) in kb.chunks_exact(hd).zip(vb.chunks_exact(hd)).enumerate().skip(skip) {
            f(bi * bs + s, k, v);
        }
    }
    WIDENED.set((kw, vw));
}

/// ‖K_i‖₂ for the slots in `slots`, written to `out[slots]`. A key's norm never changes once written, so a caller
/// that keeps the norms per slot (moving them with their slots) computes only the new slots' each step.
///
/// This is the score of the Inverse Key L2-Norm policy (knorm): keys with a LOW norm attract the most attention
/// (Devoto et al. 2024, via PagedEviction §4.1), so that policy evicts the HIGHEST values. (EvicPress §6.1 words it
/// the other way round, "drops those with low L2 norm"; the original paper and PagedEviction §5.2 agree on
/// evicting high norms.)
pub fn key_norms(kv: &KvStorage, table: &[u32], slots: Range<usize>, out: &mut [f32]) {
    debug_assert!(out.len() >= slots.end, "key_norms: out has {} entries, slots end at {}", out.len(), slots.end);
    for_each_slot_in(kv, table, slots, |i, k, _| out[i] = dot_f32(k, k).sqrt());
}

/// PagedEviction token importance `S_i = ‖V_i‖₂ / ‖K_i‖₂` (PagedEviction §4.1, Alg. 1 line 3, Alg. 2 line 8) for
/// slots `0..len`, written to `out[..len]`. The policy keeps the HIGHEST.
///
/// The denominator is clamped to [`RATIO_EPS`] so that an all-zero key (never produced by a real projection, but
/// possible in a zeroed slot) yields a large finite score rather than `inf`/`NaN`, which would poison block means.
pub fn value_key_ratio(kv: &KvStorage, table: &[u32], len: usize, out: &mut [f32]) {
    value_key_ratio_in(kv, table, 0..len, out);
}

/// [`value_key_ratio`] of the slots in `slots` only, written to `out[slots]`: a slot's ratio never changes once
/// written, so a caller that keeps the ratios per slot scores only the slots written since.
pub fn value_key_ratio_in(kv: &KvStorage, table: &[u32], slots: Range<usize>, out: &mut [f32]) {
    debug_assert!(out.len() >= slots.end, "value_key_ratio: out has {} entries, slots end at {}", out.len(), slots.end);
    for_each_slot_in(kv, table, slots, |i, k, v| {
        out[i] = dot_f32(v, v).sqrt() / dot_f32(k, k).sqrt().max(RATIO_EPS);
    });
}

/// KeyDiff eviction score: the cosine similarity of every key with the anchor `µ(K̂) = (1/n) Σ_i k_i/‖k_i‖` over
/// slots `0..len` (KeyDiff Eq. 8 and App. A.2.1: `s_i = µ(K̂)·k_i / max(‖µ(K̂)‖·‖k_i‖, ϵ)`), written to
/// `out[..len]`. The policy evicts the HIGHEST similarity (Eq. 8 keeps `topk(−s)`): keys that point where most keys
/// point are redundant.
///
/// The anchor is the mean of the *normalised* keys, as in Eq. 8, not the plain mean `µ(K)` the paper's Table 2
/// found equally good; the two rank differently when key norms vary. On return `anchor[..head_dim]` holds
/// `µ(K̂)` (all zeros when `len == 0`). Zero keys are normalised with the [`COSINE_EPS`] clamp, i.e. they add a
/// zero vector to the mean but still count in `n`, and score 0.
pub fn keydiff_cosine(kv: &KvStorage, table: &[u32], len: usize, anchor: &mut Vec<f32>, out: &mut [f32]) {
    let hd = kv.head_dim();
    debug_assert!(out.len() >= len, "keydiff_cosine: out has {} entries, len is {len}", out.len());
    anchor.clear();
    anchor.resize(hd, 0.0);
    if len == 0 {
        return;
    }
    // Pass 1: accumulate k̂_i, keeping ‖k_i‖ in out[i] so pass 2 need not recompute it.
    for_each_slot(kv, table, len, |i, k, _| {
        let n = dot_f32(k, k).sqrt();
        out[i] = n;
        let inv = 1.0 / n.max(COSINE_EPS);
        for (a, &x) in anchor.iter_mut().zip(k) {
            *a += x * inv;
        }
    });
    let inv_len = 1.0 / len as f32;
    for a in anchor.iter_mut() {
        *a *= inv_len;
    }
    let anchor_norm = dot_f32(anchor, anchor).sqrt();
    let anchor = &anchor[..];
    // Pass 2: cosine with the anchor.
    for_each_slot(kv, table, len, |i, k, _| {
        out[i] = dot_f32(anchor, k) / (anchor_norm * out[i]).max(COSINE_EPS);
    });
}

/// Adds `sign · k_i / max(‖k_i‖, ϵ)` for the slots in `slots` to `unit_key_sum` (`head_dim` entries), reading
/// `‖k_i‖` from `norms[i]` as [`key_norms`] wrote it: the sum of normalised keys behind KeyDiff's anchor. A caller
/// that adds each new key once and subtracts each evicted one keeps the anchor without walking the cache, so a
/// decode step reads every key once ([`keydiff_cosine_kept`]) instead of twice. The sum is f64 so that thousands of
/// additions and removals do not drift.
pub fn add_unit_keys(
    kv: &KvStorage,
    table: &[u32],
    slots: Range<usize>,
    norms: &[f32],
    sign: f64,
    unit_key_sum: &mut [f64],
) {
    debug_assert!(norms.len() >= slots.end, "add_unit_keys: {} norms, slots end at {}", norms.len(), slots.end);
    debug_assert_eq!(unit_key_sum.len(), kv.head_dim(), "add_unit_keys: sum length");
    for_each_slot_in(kv, table, slots, |i, k, _| {
        let w = sign / f64::from(norms[i].max(COSINE_EPS));
        for (a, &x) in unit_key_sum.iter_mut().zip(k) {
            *a += w * f64::from(x);
        }
    });
}

/// [`keydiff_cosine`] from a kept sum of the normalised keys of slots `0..len` ([`add_unit_keys`]) and kept key
/// norms (`norms[..len]`, [`key_norms`]): one pass over the keys instead of two. `anchor` is scratch; on return it
/// holds `µ(K̂)`.
pub fn keydiff_cosine_kept(
    kv: &KvStorage,
    table: &[u32],
    len: usize,
    unit_key_sum: &[f64],
    norms: &[f32],
    anchor: &mut Vec<f32>,
    out: &mut [f32],
) {
    debug_assert!(out.len() >= len && norms.len() >= len, "keydiff_cosine_kept: out or norms shorter than {len}");
    anchor.clear();
    if len == 0 {
        anchor.resize(kv.head_dim(), 0.0);
        return;
    }
    let inv_len = 1.0 / len as f64;
    anchor.extend(unit_key_sum.iter().map(|&a| (a * inv_len) as f32));
    let anchor_norm = dot_f32(anchor, anchor).sqrt();
    let anchor = &anchor[..];
    #[cfg(target_arch = "x86_64")]
    if kv.head_dim().is_multiple_of(8) && super::avx2_available() && anchor_dots_avx2(kv, table, len, anchor, out) {
        for (o, &n) in out[..len].iter_mut().zip(&norms[..len]) {
            *o /= (anchor_norm * n).max(COSINE_EPS);
        }
        return;
    }
    for_each_slot(kv, table, len, |i, k, _| {
        out[i] = dot_f32(anchor, k) / (anchor_norm * norms[i]).max(COSINE_EPS);
    });
}

/// `out[i] = anchor · k_i` for slots `0..len`, keys read in place ([`logits_in_place`]) and values not read at
/// all: the pass KeyDiff makes over the whole cache at every decode step. Returns false, having written nothing,
/// for 8-bit caches (the caller takes the portable path).
#[cfg(target_arch = "x86_64")]
fn anchor_dots_avx2(kv: &KvStorage, table: &[u32], len: usize, anchor: &[f32], out: &mut [f32]) -> bool {
    assert!(anchor.len() == kv.head_dim() && out.len() >= len, "anchor_dots: anchor or out too short");
    logits_in_place(kv, table, len, anchor, 1, |first, _| len - first, 1.0, &mut out[..len], len)
}

/// `logits[row · stride + s] = scale · q_row · k_s` for the slots `s < seen` of `table` with `s - first <
/// limit(first, row)` (`first` the slot where `s`'s block starts), keys read in place with AVX2/FMA/F16C
/// ([`super::scores_avx2::block_logits`]: f16 widened in registers) block by block, the next block's keys
/// prefetched. The shared key pass of [`window_attention_scores`] and [`keydiff_cosine_kept`]. Returns false,
/// having written nothing, for 8-bit caches.
///
/// The caller has checked the CPU features and that `head_dim` is a multiple of 8; `q` holds `rows · head_dim`
/// floats and `logits` `rows · stride` with `seen <= stride`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn logits_in_place(
    kv: &KvStorage,
    table: &[u32],
    seen: usize,
    q: &[f32],
    rows: usize,
    limit: impl Fn(usize, usize) -> usize,
    scale: f32,
    logits: &mut [f32],
    stride: usize,
) -> bool {
    use super::scores_avx2::{block_logits, prefetch};
    use crate::paged::KvArenas;
    let (hd, bs) = (kv.head_dim(), kv.block_size());
    let (k, h16, arena_len) = match kv.arenas_any() {
        KvArenas::F32 { k, .. } => (k.as_ptr().cast::<u8>(), false, k.len()),
        KvArenas::F16 { k, .. } => (k.as_ptr().cast::<u8>(), true, k.len()),
        KvArenas::Scaled { .. } => return false,
    };
    assert!(q.len() >= rows * hd && logits.len() >= rows * stride && seen <= stride, "logits_in_place: bad sizes");
    for (bi, &b) in table[..seen.div_ceil(bs)].iter().enumerate() {
        let first = bi * bs;
        let n = (seen - first).min(bs);
        let base = b as usize * bs * hd;
        // The kernel reads raw pointers: a bad block id must stop here, as the portable path's slicing would.
        assert!(base + n * hd <= arena_len, "score kernels: block {b} out of range");
        // Blocks are scattered over an arena far larger than the caches, so reading keys is bound by memory
        // latency, not arithmetic: ask for the next block's keys while this one is scored.
        if let Some(&next) = table.get(bi + 1).filter(|_| (bi + 1) * bs < seen) {
            let next_base = next as usize * bs * hd;
            if next_base + bs * hd <= arena_len {
                let elem = if h16 { 2 } else { 4 };
                // SAFETY: prefetching is a hint; the range is inside the arena (checked just above).
                unsafe { prefetch(k, next_base * elem, bs * hd * elem) };
            }
        }
        let limit = |row: usize| limit(first, row);
        // SAFETY: the block is inside the arena (checked above), hd is a multiple of 8 and the features are present
        // (checked by the caller); q and logits have the sizes asserted above.
        unsafe {
            if h16 {
                block_logits::<true>(k, base, n, hd, q, rows, limit, scale, logits, stride, first);
            } else {
                block_logits::<false>(k, base, n, hd, q, rows, limit, scale, logits, stride, first);
            }
        }
    }
    true
}

/// The queries of an observation window, as [`window_attention_scores`] reads them.
#[derive(Clone, Copy, Debug)]
pub struct Window<'a> {
    /// `[n_q][group][head_dim]`: the query heads sharing one kv-head for `n_q` consecutive tokens, RoPE'd.
    pub q: &'a [f32],
    pub n_q: usize,
    pub group: usize,
    /// Multiplies each logit `q·k`.
    pub scale: f32,
    /// The slot of the first query's token: query `i` sees slots `0..=first_q_slot + i`.
    pub first_q_slot: usize,
    /// Each probability is raised to it (2 for KV-Compress's squared attention, 0 counts the queries).
    pub power: u32,
}

/// Attention of observation-window queries over slots `0..len`, accumulated per slot:
/// `out[s] += Σ_{i<n_q} Σ_{g<group} p_{i,g}(s)^power`.
///
/// This is the aggregated-attention metric of KV-Compress Eq. 7/10 (SnapKV's observation window; the sum over the
/// query group `H_k` of Eq. 10 is the GQA aggregation), with `power = 2` giving KV-Compress's squared attention
/// (§4.3, "KVC-w", Eq. 19/20) and `power = 1` the plain sum used by SnapKV, H2O and SAGE-KV (§2 step 2; SAGE-KV
/// selects top-k per *query head*, which a caller gets by calling with `group = 1` and that head's query).
/// `power = 0` counts the queries that see each slot.
///
/// `q` is `[n_q][group][head_dim]`: the query heads sharing this kv-head for `n_q` consecutive query tokens,
/// already RoPE'd. Query `i` sees slots `[0, first_q_slot + i]` (causal in slot space, as in [`crate::AttnSeq`]);
/// later slots get nothing from it. Each (query, head) row is a softmax with logits `scale · q·k_s` over the slots
/// it sees, exactly the probabilities the attention kernel used. `out` is NOT zeroed, so decode steps can be added
/// to prefill metrics (H2O's running sum, KV-Compress Eq. 20). `probs` is scratch, grown to `n_q · group · len`
/// plus one block of keys (kept by the caller, so repeated calls do not allocate).
///
/// KVC-full's exclusion of the `v` queries nearest each key (Eq. 19) is not applied here.
pub fn window_attention_scores(
    kv: &KvStorage,
    table: &[u32],
    len: usize,
    window: Window<'_>,
    probs: &mut Vec<f32>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if kv.head_dim().is_multiple_of(8) && super::avx2_available() {
        return window_attention_scores_avx2(kv, table, len, window, probs, out);
    }
    window_attention_scores_portable(kv, table, len, window, probs, out);
}

/// Adds one row of attention probabilities, raised to `power`, to the per-slot metric: `out[s] += p[s]^power`
/// for `s < probs.len()`. The attention kernel calls it on each row it computed
/// ([`crate::Backend::paged_attention_with_probs`]), so this is [`window_attention_scores`] for a query whose
/// softmax is already known: the same metric without reading the keys again. As there, a row holding a NaN or an
/// infinity carries no usable ranking and is skipped.
pub fn accumulate_probs(probs: &[f32], power: u32, out: &mut [f32]) {
    assert!(out.len() >= probs.len(), "accumulate_probs: out has {} entries, the row {}", out.len(), probs.len());
    if !probs.iter().all(|p| p.is_finite()) {
        return;
    }
    match power {
        1 => out.iter_mut().zip(probs).for_each(|(o, &p)| *o += p),
        2 => out.iter_mut().zip(probs).for_each(|(o, &p)| *o += p * p),
        _ => out.iter_mut().zip(probs).for_each(|(o, &p)| *o += pow_u32(p, power)),
    }
}

/// [`window_attention_scores`] with AVX2/FMA/F16C ([`super::scores_avx2`]): the same logits and softmax, keys read
/// in place.
#[cfg(target_arch = "x86_64")]
fn window_attention_scores_avx2(
    kv: &KvStorage,
    table: &[u32],
    len: usize,
    window: Window<'_>,
    probs: &mut Vec<f32>,
    out: &mut [f32],
) {
    let Window { q, n_q, group, scale, first_q_slot, power } = window;
    use super::scores_avx2::softmax_accumulate;
    let hd = kv.head_dim();
    assert_eq!(q.len(), n_q * group * hd, "window_attention_scores: q must be [n_q][group][head_dim]");
    assert!(out.len() >= len, "window_attention_scores: out has {} entries, len is {len}", out.len());
    let visible = |i: usize| first_q_slot.saturating_add(i).saturating_add(1).min(len);
    let seen = if n_q == 0 { 0 } else { visible(n_q - 1) };
    if seen == 0 {
        return;
    }
    let rows = n_q * group;
    if probs.len() < rows * len {
        probs.resize(rows * len, 0.0);
    }
    let limit = |first: usize, row: usize| visible(row / group).saturating_sub(first);
    if !logits_in_place(kv, table, seen, q, rows, limit, scale, &mut probs[..rows * len], len) {
        // 8-bit keys take the portable path (widened a block at a time by `read_block_k`).
        return window_attention_scores_portable(kv, table, len, window, probs, out);
    }
    let logits = &mut probs[..rows * len];
    for i in 0..n_q {
        let vis = visible(i);
        for g in 0..group {
            let row = i * group + g;
            // SAFETY: out has at least len >= vis entries; the features are present.
            unsafe { softmax_accumulate(&mut logits[row * len..row * len + vis], power, &mut out[..vis]) };
        }
    }
}

/// [`window_attention_scores`] in portable Rust: each key block widened to f32 once for all rows. Public so that
/// tests can hold the SIMD path to it on machines that take the SIMD path.
#[doc(hidden)]
pub fn window_attention_scores_portable(
    kv: &KvStorage,
    table: &[u32],
    len: usize,
    window: Window<'_>,
    probs: &mut Vec<f32>,
    out: &mut [f32],
) {
    let Window { q, n_q, group, scale, first_q_slot, power } = window;
    let hd = kv.head_dim();
    let bs = kv.block_size();
    debug_assert_eq!(q.len(), n_q * group * hd, "window_attention_scores: q must be [n_q][group][head_dim]");
    debug_assert!(out.len() >= len, "window_attention_scores: out has {} entries, len is {len}", out.len());
    debug_assert!(table.len() >= len.div_ceil(bs), "window_attention_scores: table too short for len {len}");
    // Query i sees slots 0..visible(i); the last query sees the most.
    let visible = |i: usize| first_q_slot.saturating_add(i).saturating_add(1).min(len);
    let seen = if n_q == 0 { 0 } else { visible(n_q - 1) };
    if seen == 0 {
        return;
    }
    // One row of logits per (query, head), then one block of widened keys: each block is read (and widened from
    // f16) once for all the rows, not once per row.
    let rows = n_q * group;
    let widen = if kv.dtype() == KvDtype::F32 { 0 } else { bs * hd };
    if probs.len() < rows * len + widen {
        probs.resize(rows * len + widen, 0.0);
    }
    let (logits, widened) = probs.split_at_mut(rows * len);
    for (bi, &b) in table[..seen.div_ceil(bs)].iter().enumerate() {
        let first = bi * bs;
        let n = (seen - first).min(bs);
        let keys: &[f32] = if widen == 0 {
            &kv.block_k(b)[..n * hd]
        } else {
            kv.read_block_k(b, &mut widened[..n * hd]);
            &widened[..n * hd]
        };
        for i in 0..n_q {
            let m = visible(i).saturating_sub(first).min(n);
            for g in 0..group {
                let row = i * group + g;
                let qv = &q[row * hd..(row + 1) * hd];
                let dst = &mut logits[row * len + first..row * len + first + m];
                for (l, k) in dst.iter_mut().zip(keys.chunks_exact(hd)) {
                    *l = dot_f32(qv, k) * scale;
                }
            }
        }
    }
    for i in 0..n_q {
        let vis = visible(i);
        if vis == 0 {
            continue;
        }
        for g in 0..group {
            let row = i * group + g;
            let p = &mut logits[row * len..row * len + vis];
            let max = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for pv in p.iter_mut() {
                *pv = (*pv - max).exp();
                sum += *pv;
            }
            // sum >= 1 (the max logit contributes exp(0)) unless a logit is NaN or infinite; such a row carries no
            // usable ranking, so it is skipped rather than spreading NaN into every slot's score.
            if sum.is_nan() || sum <= 0.0 {
                continue;
            }
            let inv = 1.0 / sum;
            for (o, &pv) in out[..vis].iter_mut().zip(p.iter()) {
                *o += pow_u32(pv * inv, power);
            }
        }
    }
}

#[inline]
pub(crate) fn pow_u32(p: f32, power: u32) -> f32 {
    match power {
        0 => 1.0,
        1 => p,
        2 => p * p,
        _ => p.powi(i32::try_from(power).unwrap_or(i32::MAX)),
    }
}

/// Same-length 1-D max pooling with a centred window of `kernel` slots: `out[j] = max x[j−p/2 ..= j+p/2]`
/// (KV-Compress Eq. 8, SnapKV's pooling, p = 7 in both papers), so a slot next to a heavily attended one survives
/// with it. Near the edges the window is cut to `0..x.len()` rather than padded, so padding values never win.
/// `kernel` should be odd (an even one is treated as `kernel + 1`); `kernel <= 1` copies.
pub fn max_pool1d(x: &[f32], kernel: usize, out: &mut [f32]) {
    debug_assert_eq!(out.len(), x.len(), "max_pool1d: out and x differ in length");
    debug_assert!(kernel == 0 || kernel % 2 == 1, "max_pool1d: kernel {kernel} is not odd");
    let half = kernel / 2;
    let n = x.len();
    for (j, o) in out.iter_mut().enumerate().take(n) {
        let lo = j.saturating_sub(half);
        let hi = j.saturating_add(half).min(n - 1);
        *o = x[lo..=hi].iter().copied().fold(f32::NEG_INFINITY, f32::max);
    }
}

/// Mean of `x[..len]` over each block of `block_size` slots, written to `out[..len.div_ceil(block_size)]`:
/// PagedEviction's block score (Alg. 1 lines 6–9, Alg. 3 line 5), the policy evicting the LOWEST block.
///
/// Alg. 1 divides by `B`; for the last, partially filled block this divides by its filled slot count instead, so a
/// block is not ranked low merely for being young. Alg. 3 only scores when `L % B == 0`, where the two agree.
pub fn block_means(x: &[f32], len: usize, block_size: usize, out: &mut [f32]) {
    debug_assert!(block_size > 0, "block_means: block_size is 0");
    debug_assert!(x.len() >= len, "block_means: x has {} entries, len is {len}", x.len());
    debug_assert!(out.len() >= len.div_ceil(block_size), "block_means: out too short");
    for (o, c) in out.iter_mut().zip(x[..len].chunks(block_size)) {
        *o = c.iter().sum::<f32>() / c.len() as f32;
    }
}

/// A total order on f32 where −0 equals +0 (so they tie and fall back to the index) and NaNs sort
/// deterministically (positive NaN above +∞, negative NaN below −∞, as [`f32::total_cmp`]).
#[inline]
fn cmp_f32(a: f32, b: f32) -> Ordering {
    // Adding +0 maps −0 to +0 and leaves every other value (NaN included) unchanged.
    (a + 0.0).total_cmp(&(b + 0.0))
}

/// The index [`select_k`] with `k = 1` would pick among the indices `eligible` accepts: the smallest (or, `largest`,
/// the largest) value, the lower index on ties; `None` when none is eligible. One pass and no scratch: the per-token
/// policies pick one victim per table at every decode step.
pub fn select_one(x: &[f32], largest: bool, mut eligible: impl FnMut(usize) -> bool) -> Option<usize> {
    let want = if largest { Ordering::Greater } else { Ordering::Less };
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        if eligible(i) && best.is_none_or(|(_, b)| cmp_f32(v, b) == want) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

/// Indices of the `k` smallest (`largest == false`) or largest values of `x`, written to `out` (cleared first) in
/// ascending index order; `k > x.len()` selects everything. This is the `topk` of KeyDiff Eq. 5/8: average O(n)
/// by quickselect instead of a full sort.
///
/// Equal values are ranked by lower index first, so the result is deterministic and, for example, an eviction policy
/// that keeps the largest scores prefers older slots on ties. `idx` is scratch (grown to `x.len()`).
pub fn select_k(x: &[f32], k: usize, largest: bool, idx: &mut Vec<u32>, out: &mut Vec<u32>) {
    debug_assert!(u32::try_from(x.len()).is_ok(), "select_k: more than u32::MAX values");
    out.clear();
    let n = x.len();
    let k = k.min(n);
    if k == 0 {
        return;
    }
    idx.clear();
    idx.extend(0..n as u32);
    if k < n {
        let rank = |a: &u32, b: &u32| {
            let (va, vb) = (x[*a as usize], x[*b as usize]);
            let by_value = if largest { cmp_f32(vb, va) } else { cmp_f32(va, vb) };
            by_value.then(a.cmp(b))
        };
        idx.select_nth_unstable_by(k, rank);
    }
    out.extend_from_slice(&idx[..k]);
    out.sort_unstable();
}
