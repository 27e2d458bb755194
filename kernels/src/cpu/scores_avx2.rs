//! AVX2 + FMA + F16C path of [`super::scores::window_attention_scores`] (x86-64), the per-step cost of KV-Compress's
//! continual compression and H2O's running sum: at every decode step each sequence scores its new query against
//! every cached key of every (layer, kv-head).
//!
//! Against the portable path it differs in three ways, each measured in `docs/BENCHMARKS.md`:
//! - keys are read in place, f16 widened in registers (F16C), instead of being copied block by block into f32;
//! - the query rows of a kv-head's group are taken four at a time, so each key is loaded once per four rows;
//! - the softmax's `exp` is the vectorised one the attention kernel uses ([`super::avx2::exp256`]).
//!
//! Every function is `unsafe` because it requires those CPU features; the caller checks them first.

#![allow(unsafe_op_in_unsafe_fn, clippy::too_many_arguments)]

use super::avx2::{exp256, hmax, hsum, ld8};
use core::arch::x86_64::*;

/// Query rows whose dot products share one pass over a key.
const ROW_TILE: usize = 4;

/// `logits[row · stride + first + s] = scale · q_row · k_s` for the `n` slots of the block whose first element is at
/// element index `base` of the key arena `k` (f16 bit patterns when `H`, f32 otherwise), for slots `s < limit(row)`.
///
/// # Safety
/// `base + n · hd` elements are inside the arena; `hd` is a multiple of 8; `q` holds `rows · hd` floats and
/// `logits` `rows · stride` with `first + n <= stride`; AVX2/FMA/F16C present.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn block_logits<const H: bool>(
    k: *const u8,
    base: usize,
    n: usize,
    hd: usize,
    q: &[f32],
    rows: usize,
    limit: impl Fn(usize) -> usize,
    scale: f32,
    logits: &mut [f32],
    stride: usize,
    first: usize,
) {
    debug_assert!(hd.is_multiple_of(8) && q.len() >= rows * hd && logits.len() >= rows * stride);
    let qp = q.as_ptr();
    let mut r0 = 0;
    while r0 < rows {
        let tile = (rows - r0).min(ROW_TILE);
        let lim: [usize; ROW_TILE] = std::array::from_fn(|t| if t < tile { limit(r0 + t).min(n) } else { 0 });
        let most = lim.iter().copied().max().unwrap_or(0);
        for s in 0..most {
            let ks = base + s * hd;
            let mut acc = [_mm256_setzero_ps(); ROW_TILE];
            let mut c = 0;
            while c < hd {
                let kv = ld8::<H>(k, ks + c);
                for (t, a) in acc.iter_mut().enumerate().take(tile) {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add((r0 + t) * hd + c)), kv, *a);
                }
                c += 8;
            }
            for (t, a) in acc.iter().enumerate().take(tile) {
                if s < lim[t] {
                    *logits.get_unchecked_mut((r0 + t) * stride + first + s) = hsum(*a) * scale;
                }
            }
        }
        r0 += tile;
    }
}

/// One row's softmax over `logits` (overwritten with the unnormalised exponentials), added to `out` as
/// `p^power`. A row with a NaN or +∞ logit carries no usable ranking and is skipped, as in the portable path.
///
/// # Safety
/// `out.len() >= logits.len()`; AVX2/FMA/F16C present.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn softmax_accumulate(logits: &mut [f32], power: u32, out: &mut [f32]) {
    let n = logits.len();
    debug_assert!(out.len() >= n);
    let lp = logits.as_mut_ptr();
    // Max, and whether any logit is NaN or +∞ (max_ps would hide a NaN).
    let inf = _mm256_set1_ps(f32::INFINITY);
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut bad = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        let x = _mm256_loadu_ps(lp.add(i));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_EQ_OQ>(x, inf));
        mv = _mm256_max_ps(mv, x);
        i += 8;
    }
    let mut max = hmax(mv);
    let mut any_bad = _mm256_movemask_ps(bad) != 0;
    for &x in &logits[i..] {
        any_bad |= x.is_nan() || x == f32::INFINITY;
        max = max.max(x);
    }
    if any_bad || n == 0 {
        return;
    }
    let mv = _mm256_set1_ps(max);
    let mut sv = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(lp.add(i)), mv));
        _mm256_storeu_ps(lp.add(i), e);
        sv = _mm256_add_ps(sv, e);
        i += 8;
    }
    let mut sum = hsum(sv);
    for x in &mut logits[i..] {
        *x = (*x - max).exp();
        sum += *x;
    }
    // sum >= 1: the max logit contributes exp(0).
    let inv = 1.0 / sum;
    let iv = _mm256_set1_ps(inv);
    let op = out.as_mut_ptr();
    let mut i = 0;
    if power == 1 || power == 2 {
        while i + 8 <= n {
            let p = _mm256_mul_ps(_mm256_loadu_ps(lp.add(i)), iv);
            let p = if power == 2 { _mm256_mul_ps(p, p) } else { p };
            _mm256_storeu_ps(op.add(i), _mm256_add_ps(_mm256_loadu_ps(op.add(i)), p));
            i += 8;
        }
    }
    for (o, &e) in out[i..n].iter_mut().zip(&logits[i..]) {
        *o += super::scores::pow_u32(e * inv, power);
    }
}

/// Prefetches the same `bytes` bytes at byte `offset` of both arenas `k` and `v` (the next block of an attention
/// table: its blocks are scattered through the arenas, so the hardware prefetcher cannot follow them).
///
/// # Safety
/// The range is inside both allocations.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn prefetch_kv(k: *const u8, v: *const u8, offset: usize, bytes: usize) {
    prefetch(k, offset, bytes);
    prefetch(v, offset, bytes);
}

/// Prefetches the `bytes` bytes from `base + offset` into the cache: every line the range touches, the first one
/// from its start where the range does not begin on a line (the pool's arenas are line-aligned; encoded blocks
/// need not be).
///
/// # Safety
/// The range is inside one allocation.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn prefetch(base: *const u8, offset: usize, bytes: usize) {
    let first = base.add(offset);
    let lead = first as usize % 64;
    // A prefetch never faults, so the line start before `first` (same line) needs no allocation behind it.
    let line0 = first.wrapping_sub(lead);
    let mut at = 0;
    while at < lead + bytes {
        _mm_prefetch::<_MM_HINT_T0>(line0.wrapping_add(at).cast::<i8>());
        at += 64;
    }
}
