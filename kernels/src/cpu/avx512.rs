//! AVX-512 VNNI kernels (x86-64): the Q4_1 × Q8_1 and Q8_0 × Q8_1 matmuls over weights repacked into 16-row
//! groups ([`crate::quant::repack_q4_1x16`], [`crate::quant::repack_q8_0x16`]). One `vpdpbusd` multiplies four
//! columns of 16 weight rows by four broadcast activations of one token and accumulates the 16 int32 sums, so a
//! 32-column block of 16 rows × 1 token costs 8 instructions plus one scale step, and results come out as 16
//! contiguous output floats: no horizontal sums.
//!
//! Every function here is `unsafe` only because it requires AVX-512 F/BW/VNNI (and F16C); [`super::CpuBackend`]
//! selects [`super::Simd::Avx512`] only after `is_x86_feature_detected!` confirmed them.

#![allow(unsafe_op_in_unsafe_fn, clippy::needless_range_loop)]

use crate::quant::{BlockQ8_1x4, Q4_1X16_BLOCK_BYTES, Q4_1X16_ROWS, Q8_0X16_BLOCK_BYTES};
use core::arch::x86_64::*;

/// Bytes between consecutive blocks of one activation group.
const XB: usize = std::mem::size_of::<BlockQ8_1x4>();
/// Byte offsets inside a [`BlockQ8_1x4`]: scales, then `d * Σq`, then the four lanes' quants.
const XD: usize = 0;
const XS: usize = 16;
const XQ: usize = 32;

/// 16-row groups per pass over the token tiles: their weights stay in L1 while every token tile reads them.
const GROUPS_PER_PASS: usize = 4;

/// Most tokens per tile: `C` int32 and `C` float accumulators stay in registers up to 8.
const TILE_TOKENS: usize = 8;

/// Which repacked weight format a kernel reads.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Packed {
    /// [`crate::quant::repack_q4_1x16`].
    Q4_1,
    /// [`crate::quant::repack_q8_0x16`].
    Q8_0,
}

/// Bytes per (group, block) of the format: `Q8` selects Q8_0.
const fn block_bytes(q8: bool) -> usize {
    if q8 { Q8_0X16_BLOCK_BYTES } else { Q4_1X16_BLOCK_BYTES }
}

/// Where one token's Q8_1 data lives: its group's first block and its lane in that group.
#[derive(Clone, Copy)]
struct Tok {
    base: *const u8,
    lane: usize,
}

/// `G` consecutive 16-row groups × `C` tokens over `nb` blocks of Q4_1 (`Q8 = false`) or Q8_0 (`Q8 = true`)
/// weights. Returns one 16-lane vector of results per (group, token): lane `j` is row `16g + j`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn tile<const Q8: bool, const G: usize, const C: usize>(
    w: *const u8,
    nb: usize,
    x: [Tok; C],
) -> [[__m512; C]; G] {
    let bb = block_bytes(Q8);
    let m4 = _mm512_set1_epi8(0x0F);
    let k80 = _mm512_set1_epi8(-128);
    let mut facc = [[_mm512_setzero_ps(); C]; G];
    let gstride = nb * bb;
    for b in 0..nb {
        let mut iacc = [[_mm512_setzero_si512(); C]; G];
        if Q8 {
            for k in 0..8 {
                let mut wk = [_mm512_setzero_si512(); G];
                for g in 0..G {
                    wk[g] = _mm512_loadu_si512(w.add(g * gstride + b * bb + 64 + 64 * k) as *const _);
                }
                for c in 0..C {
                    let xq = x[c].base.add(b * XB + XQ + 32 * x[c].lane + 4 * k);
                    // vpdpbusd wants one unsigned operand: activations + 128 (the weights' Σq corrects it below).
                    let xv = _mm512_xor_si512(_mm512_set1_epi32(core::ptr::read_unaligned(xq as *const i32)), k80);
                    for g in 0..G {
                        iacc[g][c] = _mm512_dpbusd_epi32(iacc[g][c], xv, wk[g]);
                    }
                }
            }
        } else {
            for t in 0..4 {
                let mut lo = [_mm512_setzero_si512(); G];
                let mut hi = [_mm512_setzero_si512(); G];
                for g in 0..G {
                    let q = _mm512_loadu_si512(w.add(g * gstride + b * bb + 64 + 64 * t) as *const _);
                    lo[g] = _mm512_and_si512(q, m4);
                    hi[g] = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
                }
                for c in 0..C {
                    // Low nibbles of chunk t are columns 4t..4t+4, high nibbles columns 16+4t..16+4t+4.
                    let xq = x[c].base.add(b * XB + XQ + 32 * x[c].lane + 4 * t);
                    let xlo = _mm512_set1_epi32(core::ptr::read_unaligned(xq as *const i32));
                    let xhi = _mm512_set1_epi32(core::ptr::read_unaligned(xq.add(16) as *const i32));
                    for g in 0..G {
                        iacc[g][c] = _mm512_dpbusd_epi32(iacc[g][c], lo[g], xlo);
                        iacc[g][c] = _mm512_dpbusd_epi32(iacc[g][c], hi[g], xhi);
                    }
                }
            }
        }
        for g in 0..G {
            let p = w.add(g * gstride + b * bb);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i));
            // Q4_1: the mins; Q8_0: 128 Σq, the excess from the +128 activation offset.
            let (mw, bias) = if Q8 {
                let sq = _mm512_cvtepi16_epi32(_mm256_loadu_si256(p.add(32) as *const __m256i));
                (_mm512_setzero_ps(), _mm512_slli_epi32::<7>(sq))
            } else {
                (_mm512_cvtph_ps(_mm256_loadu_si256(p.add(32) as *const __m256i)), _mm512_setzero_si512())
            };
            for c in 0..C {
                let xb = x[c].base.add(b * XB + 4 * x[c].lane);
                let dx = _mm512_set1_ps(core::ptr::read(xb.add(XD) as *const f32));
                let dot = if Q8 { _mm512_sub_epi32(iacc[g][c], bias) } else { iacc[g][c] };
                // Σ_b d_w d_x Σ(q_w q_x) (+ m_w s_x for Q4_1), as in the scalar reference (which rounds differently).
                facc[g][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx), facc[g][c]);
                if !Q8 {
                    let sx = _mm512_set1_ps(core::ptr::read(xb.add(XS) as *const f32));
                    facc[g][c] = _mm512_fmadd_ps(mw, sx, facc[g][c]);
                }
            }
        }
    }
    facc
}

/// Runs [`tile`] for groups `g..g+G` and tokens `i0..i0+C`, storing rows `< rows` of `out[i][ld]`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn run<const Q8: bool, const G: usize, const C: usize>(
    packed: *const u8,
    nb: usize,
    xq: *const BlockQ8_1x4,
    g: usize,
    i0: usize,
    rows: usize,
    out: *mut f32,
    ld: usize,
) {
    // A plain loop: `array::from_fn` was not inlined here (3.7% of samples in `perf record pagoda bench engine
    // --threads 2 --concurrency 32 --prefill-tokens 64 --decode-new-tokens 48`).
    let mut x = [Tok { base: xq as *const u8, lane: 0 }; C];
    for (c, t) in x.iter_mut().enumerate() {
        let i = i0 + c;
        *t = Tok { base: xq.add(i / 4 * nb) as *const u8, lane: i % 4 };
    }
    let res = tile::<Q8, G, C>(packed.add(g * nb * block_bytes(Q8)), nb, x);
    for gg in 0..G {
        let r = (g + gg) * Q4_1X16_ROWS;
        let valid = (rows - r).min(Q4_1X16_ROWS);
        let mask: __mmask16 = if valid == Q4_1X16_ROWS { !0 } else { (1u16 << valid) - 1 };
        for c in 0..C {
            _mm512_mask_storeu_ps(out.add((i0 + c) * ld + r), mask, res[gg][c]);
        }
    }
}

/// Tokens `i0..i0+t` (`1 <= t <= 8`) against groups `g0..g1`: as many groups per tile as keep at least ~8
/// independent accumulator chains in flight (a single `vpdpbusd` chain would be latency-bound at small batches).
// int_plus_one: `g + $gw <= g1` reads as "a whole tile of $gw groups fits", also for $gw = 1.
#[allow(clippy::too_many_arguments, clippy::int_plus_one)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn token_tile<const Q8: bool>(
    packed: *const u8,
    nb: usize,
    xq: *const BlockQ8_1x4,
    g0: usize,
    g1: usize,
    i0: usize,
    t: usize,
    rows: usize,
    out: *mut f32,
    ld: usize,
) {
    macro_rules! go {
        ($gw:literal, $c:literal) => {{
            let mut g = g0;
            while g + $gw <= g1 {
                run::<Q8, $gw, $c>(packed, nb, xq, g, i0, rows, out, ld);
                g += $gw;
            }
            while g < g1 {
                run::<Q8, 1, $c>(packed, nb, xq, g, i0, rows, out, ld);
                g += 1;
            }
        }};
    }
    match t {
        1 => go!(4, 1),
        2 => go!(4, 2),
        3 => go!(2, 3),
        4 => go!(2, 4),
        5 => go!(1, 5),
        6 => go!(1, 6),
        7 => go!(1, 7),
        _ => go!(1, 8),
    }
}

/// Output rows `r0..r1` (`r0` a multiple of 16) of a Q4_1 or Q8_0 matmul over repacked weights:
/// `out[i][r] = w[r] · x[i]` for all `n` activation rows.
///
/// # Safety
/// `packed` is the `kind` repacking of a `rows × nb`-block matrix, `xq` holds
/// `q8_1x4_len(n, nb * 32)` blocks, `out` points at `[n][ld]` floats with `ld >= rows`, and the CPU supports
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn quant_rows_x16(
    kind: Packed,
    packed: &[u8],
    rows: usize,
    nb: usize,
    xq: &[BlockQ8_1x4],
    n: usize,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    debug_assert!(r0.is_multiple_of(Q4_1X16_ROWS) && r1 <= rows && rows <= ld);
    let bb = block_bytes(kind == Packed::Q8_0);
    debug_assert!(packed.len() >= rows.div_ceil(Q4_1X16_ROWS) * nb * bb);
    debug_assert!(xq.len() >= n.div_ceil(4) * nb);
    let (g0, g1) = (r0 / Q4_1X16_ROWS, r1.div_ceil(Q4_1X16_ROWS));
    let mut ga = g0;
    while ga < g1 {
        let gb = (ga + GROUPS_PER_PASS).min(g1);
        let mut i0 = 0;
        while i0 < n {
            let t = (n - i0).min(TILE_TOKENS);
            match kind {
                Packed::Q4_1 => token_tile::<false>(packed.as_ptr(), nb, xq.as_ptr(), ga, gb, i0, t, r1, out, ld),
                Packed::Q8_0 => token_tile::<true>(packed.as_ptr(), nb, xq.as_ptr(), ga, gb, i0, t, r1, out, ld),
            }
            i0 += t;
        }
        ga = gb;
    }
}
