//! The bf16 matmul without AMX tiles: `vdpbf16ps` (AVX-512 BF16, e.g. AMD Zen 4 and 5, Intel Cooper Lake) over the same
//! widened weights and bf16 activations as [`super::amx`], for CPUs that have the instruction but not the tiles.
//!
//! The AMX weight layout is already what a vector dot product wants: row `p` of a block's weight tile holds the
//! column pair `(32b + 2p, 32b + 2p + 1)` of 16 weight rows, so one 64-byte load times one broadcast activation
//! pair adds both columns into 16 row sums. Each sum takes its columns in the tile kernel's order (pairs, ascending),
//! with f32 sums and the same bf16 roundings, and a row depends on its own activations only: batch invariance holds
//! as on the tiles.
//!
//! Blocking: up to four tokens by up to four 16-row groups per pass, sixteen independent sums, so a lone decode token
//! still keeps four dot-product chains in flight; each weight load serves every token of the pass.

#![allow(unsafe_op_in_unsafe_fn, clippy::needless_range_loop)]

use super::SyncPtr;
use super::amx::{Align64, W_TILE_BYTES};
use crate::quant::{Q4_1X16_ROWS, QK};
use core::arch::x86_64::*;

/// Tokens, and 16-row weight groups, per pass.
const PASS: usize = 4;

/// True when the CPU has what this kernel and the widening of the weights need (AVX-512 F/BW/VL, BF16, VBMI, F16C).
pub fn available() -> bool {
    super::avx512_available() && is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512vbmi")
}

/// Output rows `r0..r1` (`r0` a multiple of 16) of a matmul over [`super::amx::widen_matrix`]'s weights, for all `n`
/// activation rows packed by [`super::amx::pack_activations`]: `out[i][r] = w[r] · x[i]`.
///
/// # Safety
/// [`available`] returned true; `tiles` is the widened matrix of `nb` blocks per row and at least `r1` rows; `act`
/// holds `n` packed rows of `32 nb` values; `out` points at `[n][ld]` floats with `ld >= r1`, and this task alone
/// writes rows `r0..r1` of it.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn quant_rows(
    tiles: &[Align64],
    nb: usize,
    act: &[Align64],
    n: usize,
    r0: usize,
    r1: usize,
    out: SyncPtr,
    ld: usize,
) {
    debug_assert!(r0.is_multiple_of(Q4_1X16_ROWS) && r1 <= ld);
    debug_assert!(tiles.len() >= r1.div_ceil(Q4_1X16_ROWS) * nb * W_TILE_BYTES / 64);
    debug_assert!(act.len() * 64 >= n * nb * QK * 2);
    let args = Args { w: tiles.as_ptr() as *const u8, a: act.as_ptr() as *const u8, nb, r1, out: out.get(), ld };
    let (g0, g1) = (r0 / Q4_1X16_ROWS, r1.div_ceil(Q4_1X16_ROWS));
    let mut g = g0;
    while g < g1 {
        let groups = (g1 - g).min(PASS);
        let mut i = 0;
        while i < n {
            let tokens = (n - i).min(PASS);
            macro_rules! pass {
                ($($t:literal, $g:literal);*) => {
                    match (tokens, groups) {
                        $(($t, $g) => pass::<$t, $g>(&args, i, g),)*
                        _ => unreachable!(),
                    }
                };
            }
            pass!(1, 1; 1, 2; 1, 3; 1, 4; 2, 1; 2, 2; 2, 3; 2, 4; 3, 1; 3, 2; 3, 3; 3, 4; 4, 1; 4, 2; 4, 3; 4, 4);
            i += tokens;
        }
        g += groups;
    }
}

/// What every pass of one call shares.
#[derive(Clone, Copy)]
struct Args {
    w: *const u8,
    a: *const u8,
    nb: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
}

/// Tokens `i0..i0 + T` against weight groups `g0..g0 + G`.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pass<const T: usize, const G: usize>(args: &Args, i0: usize, g0: usize) {
    let Args { w, a, nb, r1, out, ld } = *args;
    let group_bytes = nb * W_TILE_BYTES;
    let stride = 2 * nb * QK;
    let mut sums = [[_mm512_setzero_ps(); G]; T];
    for b in 0..nb {
        let wb = w.add(g0 * group_bytes + b * W_TILE_BYTES);
        let ab = a.add(i0 * stride + 64 * b);
        for p in 0..16 {
            let mut x = [_mm512_setzero_si512(); T];
            for (t, x) in x.iter_mut().enumerate() {
                *x = _mm512_set1_epi32((ab.add(t * stride + 4 * p) as *const i32).read_unaligned());
            }
            for gi in 0..G {
                let wv: __m512bh =
                    core::mem::transmute(_mm512_load_si512(wb.add(gi * group_bytes + 64 * p) as *const _));
                for t in 0..T {
                    sums[t][gi] = _mm512_dpbf16_ps(sums[t][gi], wv, core::mem::transmute::<__m512i, __m512bh>(x[t]));
                }
            }
        }
    }
    for (t, row) in sums.iter().enumerate() {
        for (gi, &s) in row.iter().enumerate() {
            let r = (g0 + gi) * Q4_1X16_ROWS;
            let live = r1 - r.min(r1);
            if live == 0 {
                continue;
            }
            let mask: __mmask16 = if live >= 16 { !0 } else { (1u16 << live) - 1 };
            _mm512_mask_storeu_ps(out.add((i0 + t) * ld + r), mask, s);
        }
    }
}
