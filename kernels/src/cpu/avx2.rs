//! AVX2 + FMA + F16C kernels (x86-64): Q8_1 activation quantisation, Q4_1·Q8_1 and Q8_0·Q8_1 tile kernels that
//! decode each weight block once for several activation rows, float dot products, a vectorised `exp`, RMSNorm,
//! RoPE, SiLU·mul and the per-query paged-attention loop.
//!
//! Every function here is `unsafe` only because it requires those CPU features; [`super::CpuBackend`] calls them
//! only after `is_x86_feature_detected!` confirmed them.

#![allow(unsafe_op_in_unsafe_fn, clippy::needless_range_loop)]

use crate::quant::{BlockQ8_1x4, Q4_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES, QK, q8_1x4_len};
use core::arch::x86_64::*;

/// Horizontal sum of 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    hreduce(v, |a, b| _mm_add_ps(a, b))
}

/// Horizontal max of 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn hmax(v: __m256) -> f32 {
    hreduce(v, |a, b| _mm_max_ps(a, b))
}

/// The horizontal sums of eight vectors, as one vector in their order: lane `t` is exactly [`hsum`]`(a[t])` (the
/// same additions in the same tree: halves, then pairs, then neighbours), in 12 shuffles and adds instead of 8
/// dependent reductions.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn hsum8(a: &[__m256; 8]) -> __m256 {
    // Halves: lanes [x0..x3 of a[t] | x0..x3 of a[t + 1]] with x_i = a_i + a_{i+4}.
    let halves =
        |p: __m256, q: __m256| _mm256_add_ps(_mm256_permute2f128_ps(p, q, 0x20), _mm256_permute2f128_ps(p, q, 0x31));
    let (t01, t23, t45, t67) = (halves(a[0], a[1]), halves(a[2], a[3]), halves(a[4], a[5]), halves(a[6], a[7]));
    // Pairs: [x0 + x2, x1 + x3] of a[t] and a[t + 2] in each 128-bit lane.
    let pairs = |p: __m256, q: __m256| {
        _mm256_add_ps(_mm256_shuffle_ps(p, q, 0b01_00_01_00), _mm256_shuffle_ps(p, q, 0b11_10_11_10))
    };
    let (v0, v1) = (pairs(t01, t23), pairs(t45, t67));
    // Neighbours: (x0 + x2) + (x1 + x3), lanes [a0 a2 a4 a6 | a1 a3 a5 a7].
    let r = _mm256_add_ps(_mm256_shuffle_ps(v0, v1, 0b10_00_10_00), _mm256_shuffle_ps(v0, v1, 0b11_01_11_01));
    _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// Folds the 8 lanes of `v` with the lane-wise `op` (halves, then pairs, then neighbours).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hreduce(v: __m256, op: impl Fn(__m128, __m128) -> __m128) -> f32 {
    let s = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = op(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(op(s, _mm_movehdup_ps(s)))
}

/// Quantises one block of 32 floats at `p` into `qs`; returns `(d, d * Σq)`. Bit-identical to
/// [`crate::quant::quantize_block_q8_1`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn quantize_block(p: *const f32, qs: *mut i8) -> (f32, f32) {
    let sign = _mm256_set1_ps(-0.0);
    let v0 = _mm256_loadu_ps(p);
    let v1 = _mm256_loadu_ps(p.add(8));
    let v2 = _mm256_loadu_ps(p.add(16));
    let v3 = _mm256_loadu_ps(p.add(24));
    let m = _mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
        _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)),
    );
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    let amax = _mm_cvtss_f32(m4);
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let idv = _mm256_set1_ps(id);
    let i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, idv));
    let i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, idv));
    let i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, idv));
    let i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, idv));
    let s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    let s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0b01_00_11_10));
    let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0b10_11_00_01));
    let sum = _mm_cvtsi128_si32(s4);
    // Pack 32 x i32 -> 32 x i8 and undo the lane interleaving of the packs.
    let a = _mm256_packs_epi32(i0, i1);
    let c = _mm256_packs_epi32(i2, i3);
    let q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, c), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(qs as *mut __m256i, q);
    (d, d * sum as f32)
}

/// Quantises `x` (`[n][cols]`) into interleaved Q8_1 blocks; bit-identical to
/// [`crate::quant::quantize_rows_q8_1x4`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_rows_q8_1x4(x: &[f32], n: usize, cols: usize, out: &mut [BlockQ8_1x4]) {
    let nb = cols / QK;
    assert!(cols.is_multiple_of(QK) && x.len() == n * cols && out.len() == q8_1x4_len(n, cols));
    for (g, grp) in out.chunks_exact_mut(nb.max(1)).enumerate() {
        for c in 0..4 {
            let i = 4 * g + c;
            for (b, o) in grp.iter_mut().enumerate() {
                if i < n {
                    let (d, s) = quantize_block(x.as_ptr().add(i * cols + b * QK), o.qs[c].as_mut_ptr());
                    o.d[c] = d;
                    o.s[c] = s;
                } else {
                    o.d[c] = 0.0;
                    o.s[c] = 0.0;
                    o.qs[c] = [0; QK];
                }
            }
        }
    }
}

/// Broadcasts lane `C` of a 4-lane vector to all 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn lane<const C: usize>(v: __m128) -> __m256 {
    match C {
        0 => _mm256_broadcastss_ps(v),
        1 => _mm256_broadcastss_ps(_mm_movehdup_ps(v)),
        2 => _mm256_broadcastss_ps(_mm_movehl_ps(v, v)),
        _ => _mm256_broadcastss_ps(_mm_shuffle_ps(v, v, 0b11_11_11_11)),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn lane_dyn(v: __m128, c: usize) -> __m256 {
    match c {
        0 => lane::<0>(v),
        1 => lane::<1>(v),
        2 => lane::<2>(v),
        _ => lane::<3>(v),
    }
}

/// `R` Q4_1 weight rows × the first `C` lanes of one interleaved activation group over `nb` blocks.
/// Returns `out[r][c]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile_q4_1<const R: usize, const C: usize>(
    w: [*const u8; R],
    x: *const BlockQ8_1x4,
    nb: usize,
) -> [[f32; C]; R] {
    let ones = _mm256_set1_epi16(1);
    let m4 = _mm256_set1_epi8(0x0F);
    let shift = _mm256_setr_epi64x(0, 0, 4, 4);
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let mut summ = [_mm_setzero_ps(); R];
    for b in 0..nb {
        let xb = x.add(b);
        let xd = _mm_load_ps((*xb).d.as_ptr());
        let xs = _mm_load_ps((*xb).s.as_ptr());
        for r in 0..R {
            let p = w[r].add(b * Q4_1_BLOCK_BYTES);
            // [d, m] of the weight block.
            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(core::ptr::read_unaligned(p as *const i32)));
            let dd = _mm_mul_ps(_mm_broadcastss_ps(dm), xd);
            summ[r] = _mm_fmadd_ps(_mm_permute_ps(dm, 0b01_01_01_01), xs, summ[r]);
            // Nibbles: low lane = weights 0..15 (low nibbles), high lane = 16..31 (high nibbles).
            let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.add(4) as *const __m128i));
            let wv = _mm256_and_si256(_mm256_srlv_epi64(q, shift), m4);
            for c in 0..C {
                let xv = _mm256_load_si256((*xb).qs[c].as_ptr() as *const __m256i);
                let pi = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones));
                acc[r][c] = _mm256_fmadd_ps(pi, lane_dyn(dd, c), acc[r][c]);
            }
        }
    }
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        let mut sm = [0.0f32; 4];
        _mm_storeu_ps(sm.as_mut_ptr(), summ[r]);
        for c in 0..C {
            out[r][c] = hsum(acc[r][c]) + sm[c];
        }
    }
    out
}

/// `R` Q8_0 weight rows × the first `C` lanes of one interleaved activation group over `nb` blocks.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile_q8_0<const R: usize, const C: usize>(
    w: [*const u8; R],
    x: *const BlockQ8_1x4,
    nb: usize,
) -> [[f32; C]; R] {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    for b in 0..nb {
        let xb = x.add(b);
        let xd = _mm_load_ps((*xb).d.as_ptr());
        for r in 0..R {
            let p = w[r].add(b * Q8_0_BLOCK_BYTES);
            let d = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(core::ptr::read_unaligned(p as *const u16))));
            let dd = _mm_mul_ps(_mm_broadcastss_ps(d), xd);
            let wv = _mm256_loadu_si256(p.add(2) as *const __m256i);
            let aw = _mm256_sign_epi8(wv, wv);
            for c in 0..C {
                let xv = _mm256_load_si256((*xb).qs[c].as_ptr() as *const __m256i);
                let sx = _mm256_sign_epi8(xv, wv);
                let pi = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
                acc[r][c] = _mm256_fmadd_ps(pi, lane_dyn(dd, c), acc[r][c]);
            }
        }
    }
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            out[r][c] = hsum(acc[r][c]);
        }
    }
    out
}

/// Which quantised weight format a row kernel reads.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum QKind {
    Q4_1,
    Q8_0,
}

/// Runs an `R`-row weight tile against activation groups `g0..g1`, writing `out[i - 4*g0][r - c0 .. r - c0 + R]`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn rows_tile<const R: usize>(
    kind: QKind,
    w: [*const u8; R],
    r: usize,
    xq: *const BlockQ8_1x4,
    nb: usize,
    n: usize,
    g0: usize,
    g1: usize,
    out: *mut f32,
    ld: usize,
    c0: usize,
) {
    macro_rules! emit {
        ($g:expr, $c:literal) => {{
            let xg = xq.add($g * nb);
            let o = match kind {
                QKind::Q4_1 => tile_q4_1::<R, $c>(w, xg, nb),
                QKind::Q8_0 => tile_q8_0::<R, $c>(w, xg, nb),
            };
            for rr in 0..R {
                for k in 0..$c {
                    *out.add((4 * ($g - g0) + k) * ld + r - c0 + rr) = o[rr][k];
                }
            }
        }};
    }
    for g in g0..g1 {
        match (n - 4 * g).min(4) {
            4 => emit!(g, 4),
            3 => emit!(g, 3),
            2 => emit!(g, 2),
            _ => emit!(g, 1),
        }
    }
}

/// Output rows `r0..r1` of a quantised matmul: `out[i][r] = w[r] · x[i]` for all `n` activation rows.
///
/// # Safety
/// `w` holds `rows * nb` blocks of `kind`, `xq` holds `q8_1x4_len(n, nb * 32)` blocks, `out` points at `[n][ld]`
/// floats and the CPU supports AVX2, FMA and F16C.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quant_rows(
    kind: QKind,
    w: &[u8],
    row_bytes: usize,
    xq: &[BlockQ8_1x4],
    n: usize,
    nb: usize,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    debug_assert!(xq.len() >= n.div_ceil(4) * nb && w.len() >= r1 * row_bytes);
    let wp = w.as_ptr();
    let xp = xq.as_ptr();
    let groups = n.div_ceil(4);
    // Activation groups per cache tile: keep the tile of quantised x within ~12 KiB of L1.
    let gt = ((12 * 1024) / (nb * std::mem::size_of::<BlockQ8_1x4>())).clamp(1, TILE_GROUPS);
    // Results go to a small row-major buffer first: writing `out` directly would touch up to 16 rows `ld` floats
    // apart, which alias in L1/L2 when `ld` is a multiple of 1024 (e.g. the 49152-row output head).
    let mut buf = [0.0f32; TILE_ROWS * TILE_GROUPS * 4];
    let wend = r1 * row_bytes;
    let mut rt0 = r0;
    while rt0 < r1 {
        let rt1 = (rt0 + TILE_ROWS).min(r1);
        let mut g0 = 0;
        while g0 < groups {
            let g1 = (g0 + gt).min(groups);
            let bp = buf.as_mut_ptr();
            let mut r = rt0;
            if n < 4 {
                while r + 4 <= rt1 {
                    // Decode streams weights from DRAM: prefetch the rows a few tiles ahead.
                    let pf0 = ((r + PREFETCH_ROWS) * row_bytes).min(wend);
                    let pf1 = ((r + PREFETCH_ROWS + 4) * row_bytes).min(wend);
                    let mut off = pf0;
                    while off < pf1 {
                        _mm_prefetch::<_MM_HINT_T0>(wp.add(off) as *const i8);
                        off += 64;
                    }
                    let ws = core::array::from_fn(|k| wp.add((r + k) * row_bytes));
                    rows_tile::<4>(kind, ws, r, xp, nb, n, g0, g1, bp, TILE_ROWS, rt0);
                    r += 4;
                }
            } else {
                while r + 2 <= rt1 {
                    let ws = core::array::from_fn(|k| wp.add((r + k) * row_bytes));
                    rows_tile::<2>(kind, ws, r, xp, nb, n, g0, g1, bp, TILE_ROWS, rt0);
                    r += 2;
                }
            }
            while r < rt1 {
                rows_tile::<1>(kind, [wp.add(r * row_bytes)], r, xp, nb, n, g0, g1, bp, TILE_ROWS, rt0);
                r += 1;
            }
            for i in 4 * g0..(4 * g1).min(n) {
                let src = bp.add((i - 4 * g0) * TILE_ROWS);
                core::ptr::copy_nonoverlapping(src, out.add(i * ld + rt0), rt1 - rt0);
            }
            g0 = g1;
        }
        rt0 = rt1;
    }
}

/// How far ahead (in weight rows) the single-row decode path prefetches.
const PREFETCH_ROWS: usize = 32;
/// Weight rows per output tile of [`quant_rows`].
const TILE_ROWS: usize = 64;
/// Most activation groups (of 4 rows) per output tile of [`quant_rows`].
const TILE_GROUPS: usize = 4;

/// f32 · f32 (any length).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), acc1);
        i += 16;
    }
    if i + 8 <= n {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        i += 8;
    }
    let mut s = hsum(_mm256_add_ps(acc0, acc1));
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

/// `y += Σ_j low[j]·bt[j]`, `bt` being `low.len()` rows of `out` f16 values: eight columns at a time, the sum kept in
/// a register across the rows (the second half of [`super::lora`]'s kernel).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rank_axpy_f16(low: &[f32], bt: &[u16], out: usize, y: &mut [f32]) {
    assert!(bt.len() >= low.len() * out && y.len() >= out, "rank_axpy_f16: short bt or y");
    let (pb, py) = (bt.as_ptr(), y.as_mut_ptr());
    let mut o = 0;
    while o + 8 <= out {
        let mut acc = _mm256_loadu_ps(py.add(o));
        for (j, &l) in low.iter().enumerate() {
            let b = _mm256_cvtph_ps(_mm_loadu_si128(pb.add(j * out + o).cast()));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(l), b, acc);
        }
        _mm256_storeu_ps(py.add(o), acc);
        o += 8;
    }
    while o < out {
        let mut s = y[o];
        for (j, &l) in low.iter().enumerate() {
            s += l * half::f16::from_bits(bt[j * out + o]).to_f32();
        }
        y[o] = s;
        o += 1;
    }
}

/// Widens `src` (f16 bit patterns) into `out[..src.len()]`, 16 at a time: exact, as every f16 is an f32.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn widen_f16(src: &[u16], out: &mut [f32]) {
    let n = src.len().min(out.len());
    let (ps, po) = (src.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 16 <= n {
        let a = _mm256_cvtph_ps(_mm_loadu_si128(ps.add(i) as *const __m128i));
        let b = _mm256_cvtph_ps(_mm_loadu_si128(ps.add(i + 8) as *const __m128i));
        _mm256_storeu_ps(po.add(i), a);
        _mm256_storeu_ps(po.add(i + 8), b);
        i += 16;
    }
    while i < n {
        *po.add(i) = half::f16::from_bits(*ps.add(i)).to_f32();
        i += 1;
    }
}

/// f16 · f32 (any length).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16_f32(a: &[u16], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        let w0 = _mm256_cvtph_ps(_mm_loadu_si128(pa.add(i) as *const __m128i));
        let w1 = _mm256_cvtph_ps(_mm_loadu_si128(pa.add(i + 8) as *const __m128i));
        acc0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(pb.add(i + 8)), acc1);
        i += 16;
    }
    let mut s = hsum(_mm256_add_ps(acc0, acc1));
    while i < n {
        s += half::f16::from_bits(a[i]).to_f32() * b[i];
        i += 1;
    }
    s
}

/// Vectorised `exp` (Cephes polynomial, ~1 ulp over the clamped range [-88.38, 88.38]).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub unsafe fn exp256(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.336_54)), _mm256_set1_ps(88.376_26));
    let fx = _mm256_round_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E), _mm256_set1_ps(0.5)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC,
    );
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.398_199_9e-3));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.333_452e-3));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.166_579_6e-2));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.666_666_5e-1));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(0.5));
    let x2 = _mm256_mul_ps(x, x);
    y = _mm256_fmadd_ps(y, x2, _mm256_add_ps(x, _mm256_set1_ps(1.0)));
    let e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    _mm256_mul_ps(y, _mm256_castsi256_ps(e))
}

/// [`super::scalar::log_sum_exp`]: the maximum (NaN skipped), then the sum of [`exp256`] of the differences in
/// two accumulators. A row whose maximum is not finite goes to the scalar form, which defines those cases.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn log_sum_exp(x: &[f32]) -> f32 {
    let (n, p) = (x.len(), x.as_ptr());
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 8 <= n {
        // `max(v, m)` returns `m` when `v` is NaN.
        m = _mm256_max_ps(_mm256_loadu_ps(p.add(i)), m);
        i += 8;
    }
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    let max = x[i..].iter().chain(&lanes).fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    if !max.is_finite() {
        return super::scalar::log_sum_exp(x);
    }
    let mv = _mm256_set1_ps(max);
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    // NaN and -inf differences clamp to exp256's floor (~1e-38): nothing next to the maximum's 1.
    while i + 16 <= n {
        s0 = _mm256_add_ps(s0, exp256(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv)));
        s1 = _mm256_add_ps(s1, exp256(_mm256_sub_ps(_mm256_loadu_ps(p.add(i + 8)), mv)));
        i += 16;
    }
    while i + 8 <= n {
        s0 = _mm256_add_ps(s0, exp256(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv)));
        i += 8;
    }
    let tail: f32 = x[i..].iter().map(|&v| if v.is_nan() { 0.0 } else { (v - max).exp() }).sum();
    max + (hsum(_mm256_add_ps(s0, s1)) + tail).ln()
}

/// `gate = silu(gate) * up`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    let (pg, pu) = (gate.as_mut_ptr(), up.as_ptr());
    let one = _mm256_set1_ps(1.0);
    let sign = _mm256_set1_ps(-0.0);
    let mut i = 0;
    while i + 8 <= n {
        let g = _mm256_loadu_ps(pg.add(i));
        let e = exp256(_mm256_xor_ps(g, sign));
        let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(pg.add(i), _mm256_mul_ps(s, _mm256_loadu_ps(pu.add(i))));
        i += 8;
    }
    super::scalar::silu_mul(&mut gate[i..n], &up[i..n]);
}

/// `out = x / sqrt(mean(x²) + eps) * w` for one row.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rmsnorm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    let ss = dot_f32(x, x);
    let r = 1.0 / (ss / n as f32 + eps).sqrt();
    let rv = _mm256_set1_ps(r);
    let (px, pw, po) = (x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(px.add(i)), rv), _mm256_loadu_ps(pw.add(i)));
        _mm256_storeu_ps(po.add(i), v);
        i += 8;
    }
    while i < n {
        out[i] = x[i] * r * w[i];
        i += 1;
    }
}

/// Rotates adjacent pairs of every head in `row` given the per-element tables `cc = [c0,c0,c1,c1,..]` and
/// `ss = [-s0,s0,-s1,s1,..]` (len = head_dim, a multiple of 8).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rope_row(row: &mut [f32], cc: &[f32], ss: &[f32]) {
    let hd = cc.len();
    debug_assert!(hd.is_multiple_of(8) && row.len().is_multiple_of(hd));
    let p = row.as_mut_ptr();
    for h in 0..row.len() / hd {
        for d in (0..hd).step_by(8) {
            let x = _mm256_loadu_ps(p.add(h * hd + d));
            let sw = _mm256_permute_ps(x, 0b10_11_00_01);
            let y = _mm256_fmadd_ps(
                x,
                _mm256_loadu_ps(cc.as_ptr().add(d)),
                _mm256_mul_ps(sw, _mm256_loadu_ps(ss.as_ptr().add(d))),
            );
            _mm256_storeu_ps(p.add(h * hd + d), y);
        }
    }
}

/// Eight elements of an arena at element index `i`, widened to f32: f16 bit patterns when `H`, f32 otherwise.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn ld8<const H: bool>(base: *const u8, i: usize) -> __m256 {
    if H {
        _mm256_cvtph_ps(_mm_loadu_si128(base.add(2 * i) as *const __m128i))
    } else {
        _mm256_loadu_ps((base as *const f32).add(i))
    }
}

/// Element type of an arena for [`attend_one`]: f32.
pub const ELEM_F32: u8 = 0;
/// f16 bit patterns.
pub const ELEM_F16: u8 = 1;
/// int8 codes with one f32 scale per slot.
pub const ELEM_I8: u8 = 2;
/// e4m3 codes with one f32 scale per slot.
pub const ELEM_FP8: u8 = 3;
/// f32 copies of 8-bit codes (`attend_rows`' widened block: the codes as [`lde`] widens them), with the per-slot
/// scales (already times [`code_rescale`]) still to apply as the 8-bit kernels apply them.
pub(crate) const ELEM_F32_SCALED: u8 = 4;

/// Whether element type `E` carries per-slot scales (the 8-bit codes, and their widened f32 copy).
pub(crate) const fn scaled<const E: u8>() -> bool {
    matches!(E, ELEM_I8 | ELEM_FP8 | ELEM_F32_SCALED)
}

/// Bytes of one element of type `E` in an arena.
pub(crate) const fn elem_bytes<const E: u8>() -> usize {
    match E {
        ELEM_F16 => 2,
        ELEM_I8 | ELEM_FP8 => 1,
        _ => 4,
    }
}

/// Eight elements of an arena of element type `E` at element index `i`, widened to f32 (8-bit codes unscaled;
/// e4m3 codes also still to be multiplied by [`code_rescale`]).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn lde<const E: u8>(base: *const u8, i: usize) -> __m256 {
    match E {
        ELEM_F16 => _mm256_cvtph_ps(_mm_loadu_si128(base.add(2 * i) as *const __m128i)),
        ELEM_I8 => _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(base.add(i) as *const __m128i))),
        ELEM_FP8 => super::codecs_avx2::load_e4m3_unscaled(base.add(i)),
        _ => _mm256_loadu_ps((base as *const f32).add(i)),
    }
}

/// What a slot's scale is multiplied by before it meets [`lde`]'s codes of element type `E`: 2^8 for e4m3 codes,
/// whose widening leaves them at 2^-8 of their value (`codecs_avx2::load_e4m3_unscaled`). Both attention kernels
/// fold it into the scales the same way, once per slot rather than once per 8 elements, so a row's result is the
/// same whichever kernel computed it; a power of two, it changes no rounding (a finite scale is at most 2^-8 of
/// f32's largest value, absmax / 448).
#[inline]
pub(crate) const fn code_rescale<const E: u8>() -> f32 {
    if E == ELEM_FP8 { crate::codec::E4M3_F16_RESCALE } else { 1.0 }
}

/// One query's online-softmax state between blocks: running max, running sum and the unnormalised output. Shared
/// by the float/8-bit kernels here and the encoded-block kernel of `codecs_avx2`.
pub(crate) struct Online<const NV: usize> {
    pub(crate) m: f32,
    pub(crate) l: f32,
    pub(crate) acc: [__m256; NV],
}

impl<const NV: usize> Online<NV> {
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) fn new() -> Online<NV> {
        Online { m: f32::NEG_INFINITY, l: 0.0, acc: [_mm256_setzero_ps(); NV] }
    }

    /// Enters a block whose scores `sc[..n]` peak at `bmax` (at least the running max): turns them into
    /// `exp(s - bmax)` in place, over whole 8-lane chunks (so `sc` must reach `n` rounded up to 8), rescales the
    /// output by `exp(m - bmax)` and makes `bmax` the running max. Returns that factor, for the running sum:
    /// `l = l * factor + Σ exp`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn enter_block(&mut self, sc: &mut [f32], n: usize, bmax: f32) -> f32 {
        debug_assert!(sc.len() >= n.div_ceil(8) * 8);
        let mv = _mm256_set1_ps(bmax);
        let mut i = 0;
        while i < n {
            let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc.as_ptr().add(i)), mv));
            _mm256_storeu_ps(sc.as_mut_ptr().add(i), e);
            i += 8;
        }
        // A block that does not raise the running max would rescale by exp(0) = 1: skipping that is exact.
        if bmax == self.m {
            return 1.0;
        }
        let corr = if self.m == f32::NEG_INFINITY { 0.0 } else { (self.m - bmax).exp() };
        self.m = bmax;
        let cv = _mm256_set1_ps(corr);
        for a in self.acc.iter_mut() {
            *a = _mm256_mul_ps(*a, cv);
        }
        corr
    }

    /// Writes `acc / l` into `out` (head_dim floats) and returns `1 / l` (0 when nothing was seen).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn finish(&self, out: *mut f32) -> f32 {
        let inv_l = if self.l > 0.0 { 1.0 / self.l } else { 0.0 };
        let inv = _mm256_set1_ps(inv_l);
        for (j, a) in self.acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(j * 8), _mm256_mul_ps(*a, inv));
        }
        inv_l
    }
}

/// Folds the `n` slots (`n <= 64`) starting at element `base` of the arenas `k`, `v` (element type `E`; for the
/// 8-bit types, scales from slot `slot0` of `k_scale`, `v_scale`) into `st`, for the scaled query `qv`. `sc` is
/// scratch for the block's scores; with `logits`, the block's scaled logits are copied there. Each slot's score is
/// its own chain of multiply-adds and one [`hsum`] tree whether it is reduced alone or with seven others
/// ([`hsum8`]), so a score does not depend on where in a block its slot falls, nor on which kernel computed it.
/// `ahead(i)` runs as slot `i` is scored: [`attend_one`] prefetches the next block's slot `i` there
/// ([`Ahead::slot`]).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn fold_block<const NV: usize, const E: u8>(
    qv: &[__m256; NV],
    k: *const u8,
    v: *const u8,
    k_scale: *const f32,
    v_scale: *const f32,
    base: usize,
    slot0: usize,
    n: usize,
    st: &mut Online<NV>,
    sc: &mut [f32; 64],
    logits: Option<&mut [f32]>,
    ahead: impl Fn(usize),
) {
    let hd = NV * 8;
    let scaled = scaled::<E>();
    let ks = |i: usize| if scaled { *k_scale.add(slot0 + i) * code_rescale::<E>() } else { 1.0 };
    let vs = |i: usize| if scaled { *v_scale.add(slot0 + i) * code_rescale::<E>() } else { 1.0 };
    // Scores, eight slots at a time (eight independent chains, one transposed reduction, the scales and the
    // running max in vectors), then two at a time.
    let mut bmax = st.m;
    let mut i = 0;
    if n >= 8 {
        let rescale = _mm256_set1_ps(code_rescale::<E>());
        let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
        while i + 8 <= n {
            let at = base + i * hd;
            let mut a: [__m256; 8] = core::array::from_fn(|t| {
                ahead(i + t);
                _mm256_mul_ps(qv[0], lde::<E>(k, at + t * hd))
            });
            for j in 1..NV {
                for (t, acc) in a.iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(qv[j], lde::<E>(k, at + t * hd + j * 8), *acc);
                }
            }
            let mut s8 = hsum8(&a);
            if scaled {
                s8 = _mm256_mul_ps(s8, _mm256_mul_ps(_mm256_loadu_ps(k_scale.add(slot0 + i)), rescale));
            }
            _mm256_storeu_ps(sc.as_mut_ptr().add(i), s8);
            // A NaN score leaves the lane's max as it was, as `f32::max` below ignores it.
            mv = _mm256_max_ps(s8, mv);
            i += 8;
        }
        bmax = bmax.max(hmax(mv));
    }
    while i + 2 <= n {
        ahead(i);
        ahead(i + 1);
        let k0 = base + i * hd;
        let k1 = base + (i + 1) * hd;
        let mut a0 = _mm256_mul_ps(qv[0], lde::<E>(k, k0));
        let mut a1 = _mm256_mul_ps(qv[0], lde::<E>(k, k1));
        for j in 1..NV {
            a0 = _mm256_fmadd_ps(qv[j], lde::<E>(k, k0 + j * 8), a0);
            a1 = _mm256_fmadd_ps(qv[j], lde::<E>(k, k1 + j * 8), a1);
        }
        sc[i] = hsum(a0) * ks(i);
        sc[i + 1] = hsum(a1) * ks(i + 1);
        bmax = bmax.max(sc[i]).max(sc[i + 1]);
        i += 2;
    }
    if i < n {
        ahead(i);
        let k0 = base + i * hd;
        let mut a0 = _mm256_mul_ps(qv[0], lde::<E>(k, k0));
        for j in 1..NV {
            a0 = _mm256_fmadd_ps(qv[j], lde::<E>(k, k0 + j * 8), a0);
        }
        sc[i] = hsum(a0) * ks(i);
        bmax = bmax.max(sc[i]);
    }
    if let Some(p) = logits {
        p.copy_from_slice(&sc[..n]);
    }
    let corr = st.enter_block(sc, n, bmax);
    let mut bl = 0.0f32;
    for (i, &p) in sc[..n].iter().enumerate() {
        bl += p;
        let pv = _mm256_set1_ps(p * vs(i));
        let vr = base + i * hd;
        for (j, a) in st.acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(pv, lde::<E>(v, vr + j * 8), *a);
        }
    }
    st.l = st.l * corr + bl;
}

/// `q` (head_dim floats) times `scale`, as `NV` vectors.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn scaled_query<const NV: usize>(q: *const f32, scale: f32) -> [__m256; NV] {
    let sv = _mm256_set1_ps(scale);
    let mut qv = [_mm256_setzero_ps(); NV];
    for (j, r) in qv.iter_mut().enumerate() {
        *r = _mm256_mul_ps(_mm256_loadu_ps(q.add(j * 8)), sv);
    }
    qv
}

/// Attention of one query over the first `len` slots reachable through `table`, `NV` = head_dim / 8.
/// `arenas.k`, `arenas.v` point at the whole arenas, of element type `E` ([`ELEM_F32`], [`ELEM_F16`], [`ELEM_I8`],
/// [`ELEM_FP8`]); for the 8-bit types, `arenas.k_scale`, `arenas.v_scale` point at the per-slot scales (indexed
/// `block * bs + slot`) and are unused otherwise. A key's scale multiplies its dot product and a value's scale its
/// probability, so the 8-bit types cost one multiply per slot over the float kernels. Writes the normalised result
/// into `out` and, with `probs` (`len` floats), the slots' softmax probabilities.
///
/// # Safety
/// Every block id in `table[..len.div_ceil(bs)]` addresses a block inside the arenas (and, for the 8-bit types,
/// inside the scale arrays); AVX2/FMA/F16C present.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attend_one<const NV: usize, const E: u8>(
    q: &[f32],
    arenas: Arenas,
    table: &[u32],
    len: usize,
    scale: f32,
    out: &mut [f32],
    mut probs: Option<&mut [f32]>,
) {
    let Arenas { k, v, k_scale, v_scale, bs } = arenas;
    let hd = NV * 8;
    debug_assert!(q.len() == hd && out.len() == hd && bs <= 64);
    let qv = scaled_query::<NV>(q.as_ptr(), scale);
    let mut st = Online::<NV>::new();
    let mut sc = [f32::NEG_INFINITY; 64];
    let blocks = &table[..len.div_ceil(bs)];
    for (bi, &b) in blocks.iter().enumerate() {
        let n = (len - bi * bs).min(bs);
        let ahead = Ahead::<E>::enter(&arenas, hd, blocks, bi);
        let logits = probs.as_deref_mut().map(|p| &mut p[bi * bs..bi * bs + n]);
        let (base, slot0) = (b as usize * bs * hd, b as usize * bs);
        fold_block::<NV, E>(&qv, k, v, k_scale, v_scale, base, slot0, n, &mut st, &mut sc, logits, |i| ahead.slot(i));
    }
    let inv_l = st.finish(out.as_mut_ptr());
    if let Some(p) = probs {
        probs_from_logits(p, st.m, inv_l);
    }
}

/// A pool's K and V arenas as the multi-row kernels read them: element pointers, the per-slot scales of the 8-bit
/// types (unused for f16) and the block size.
#[derive(Clone, Copy)]
pub struct Arenas {
    pub k: *const u8,
    pub v: *const u8,
    pub k_scale: *const f32,
    pub v_scale: *const f32,
    pub bs: usize,
}

/// The AVX2 form of [`super::avx512_attention::attend_rows`], same contract: `rows` consecutive queries of one head
/// (or the query heads of one GQA group) over a table, each block widened to f32 once and folded into every row
/// that sees it. `NV` = head_dim / 8. Besides f16 arenas (`E` = [`ELEM_F16`]) it reads the 8-bit ones
/// ([`ELEM_I8`], [`ELEM_FP8`], with `k_scale` / `v_scale` as for [`attend_one`]): their codes are widened unscaled
/// and each slot's scales applied to its dot product and its probability, exactly as [`attend_one`] applies them,
/// so a row's result does not depend on which of the two kernels computed it; `logits` as there.
///
/// # Safety
/// As [`super::avx512_attention::attend_rows`], with AVX2/FMA/F16C in place of AVX-512; for the 8-bit types the
/// scale arrays must hold every slot of every block read (indexed `block * bs + slot`).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn attend_rows<const NV: usize, const E: u8>(
    q: *const f32,
    q_stride: usize,
    out: *mut f32,
    out_stride: usize,
    rows: usize,
    arenas: Arenas,
    table: &[u32],
    len0: usize,
    causal: bool,
    scale: f32,
    logits: Option<(*mut f32, usize)>,
) {
    use super::avx512_attention::{MAX_BLOCK_ELEMS, MAX_ROWS};
    let Arenas { k, v, k_scale, v_scale, bs } = arenas;
    let hd = NV * 8;
    debug_assert!((1..=MAX_ROWS).contains(&rows) && len0 >= 1 && bs <= 64 && bs * hd <= MAX_BLOCK_ELEMS);
    debug_assert!(matches!(E, ELEM_F16 | ELEM_I8 | ELEM_FP8));
    let scaled = scaled::<E>();
    let mut states: [Online<NV>; MAX_ROWS] = core::array::from_fn(|_| Online::new());
    let mut kf = [0.0f32; MAX_BLOCK_ELEMS];
    let mut vf = [0.0f32; MAX_BLOCK_ELEMS];
    // The block's slot scales (8-bit arenas), copied beside its widened codes.
    let (mut ksf, mut vsf) = ([0.0f32; 64], [0.0f32; 64]);
    let mut sc = [f32::NEG_INFINITY; 64];
    let (kw, vw) = (kf.as_mut_ptr(), vf.as_mut_ptr());
    let (kp, vp) = (kw.cast_const().cast::<u8>(), vw.cast_const().cast::<u8>());
    let (ksw, vsw) = (ksf.as_mut_ptr(), vsf.as_mut_ptr());
    let (ksp, vsp) = (ksw.cast_const(), vsw.cast_const());
    let widen = |src: usize, elems: usize, next: Option<usize>| {
        if let Some(nb) = next {
            prefetch_block::<E>(&arenas, hd, nb);
        }
        if scaled {
            let slot0 = src / hd;
            for s in 0..elems / hd {
                *ksw.add(s) = *k_scale.add(slot0 + s) * code_rescale::<E>();
                *vsw.add(s) = *v_scale.add(slot0 + s) * code_rescale::<E>();
            }
        }
        let mut e = 0;
        while e < elems {
            _mm256_storeu_ps(kw.add(e), lde::<E>(k, src + e));
            _mm256_storeu_ps(vw.add(e), lde::<E>(v, src + e));
            e += 8;
        }
    };
    let fold = |rs: core::ops::Range<usize>, n_r: usize, s0: usize| {
        for r in rs {
            // Row r's logits hold its visible slots (the caller's contract), slots s0..s0 + n_r among them.
            let lg = super::attention::logits_row(logits, r, s0, n_r);
            let qv = scaled_query::<NV>(q.add(r * q_stride), scale);
            let st = &mut states[r];
            if scaled {
                fold_block::<NV, ELEM_F32_SCALED>(&qv, kp, vp, ksp, vsp, 0, 0, n_r, st, &mut sc, lg, |_| {});
            } else {
                fold_block::<NV, ELEM_F32>(&qv, kp, vp, ksp, vsp, 0, 0, n_r, st, &mut sc, lg, |_| {});
            }
        }
    };
    super::attention::for_row_blocks(rows, len0, causal, bs, hd, table, widen, fold);
    for (r, st) in states.iter().enumerate().take(rows) {
        let inv_l = st.finish(out.add(r * out_stride));
        let seen = super::attention::last_row_len(r + 1, len0, causal);
        if let Some(p) = super::attention::logits_row(logits, r, 0, seen) {
            probs_from_logits(p, st.m, inv_l);
        }
    }
}

/// Prefetches block `b` of the arenas (element type `E`, head_dim `hd`), and for the 8-bit types its slot scales
/// (a line each, as scattered as the codes): the table's next block, fetched while this one is folded, since the
/// pool hands out blocks in no order a hardware prefetcher could follow. The rows kernels of both instruction
/// sets call it (a block folds up to 32 rows, time enough for a burst to land); the decode kernels spread the same
/// lines over the block they fold ([`Ahead`]).
///
/// # Safety
/// Block `b` is inside the arenas (and, for the 8-bit types, the scale arrays).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn prefetch_block<const E: u8>(a: &Arenas, hd: usize, b: usize) {
    let bytes = elem_bytes::<E>() * a.bs * hd;
    super::scores_avx2::prefetch_kv(a.k, a.v, b * bytes, bytes);
    prefetch_scales::<E>(a, b);
}

/// Prefetches block `b`'s slot scales, K's and V's (8-bit types; nothing for the float types).
///
/// # Safety
/// As [`prefetch_block`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn prefetch_scales<const E: u8>(a: &Arenas, b: usize) {
    if matches!(E, ELEM_I8 | ELEM_FP8) {
        let f = size_of::<f32>();
        super::scores_avx2::prefetch_kv(a.k_scale.cast(), a.v_scale.cast(), b * a.bs * f, a.bs * f);
    }
}

/// Prefetches slot `s`'s K and V rows of block `b` (`hd` elements of type `E` each). A decode kernel calls it
/// ([`Ahead::slot`]) for slot `s` of the next block as it scores slot `s` of this one: a block's worth of prefetches issued at
/// once (`prefetch_block`, 64 lines for an f16 block) queue behind the core's few outstanding misses and stall
/// the loads of the block being folded, where one slot's rows at a time keep the misses in flight without that.
///
/// # Safety
/// Block `b` is inside the arenas and `s < bs`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn prefetch_slot<const E: u8>(a: &Arenas, hd: usize, b: usize, s: usize) {
    let row = elem_bytes::<E>() * hd;
    super::scores_avx2::prefetch_kv(a.k, a.v, (b * a.bs + s) * row, row);
}

/// The next block of a table, prefetched while a decode kernel folds the current one: its slot scales when the
/// kernel enters the current block ([`Ahead::enter`]), and each slot's K and V rows as the kernel scores the same
/// slot of the current block ([`Ahead::slot`]).
pub(crate) struct Ahead<'a, const E: u8> {
    arenas: &'a Arenas,
    hd: usize,
    next: Option<usize>,
}

impl<'a, const E: u8> Ahead<'a, E> {
    /// Entering block `bi` of `blocks`: block `bi + 1`, if any, is the one to prefetch; its scales go out now.
    ///
    /// # Safety
    /// Every block of `blocks` is inside the arenas (and, for the 8-bit types, the scale arrays).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn enter(arenas: &'a Arenas, hd: usize, blocks: &[u32], bi: usize) -> Ahead<'a, E> {
        let next = blocks.get(bi + 1).map(|&nb| nb as usize);
        if let Some(nb) = next {
            prefetch_scales::<E>(arenas, nb);
        }
        Ahead { arenas, hd, next }
    }

    /// Prefetches slot `i` of the next block.
    ///
    /// # Safety
    /// As [`Ahead::enter`]; `i` is below the block size.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn slot(&self, i: usize) {
        if let Some(nb) = self.next {
            prefetch_slot::<E>(self.arenas, self.hd, nb, i);
        }
    }
}

/// The most query heads [`attend_group`] folds in one pass over a table (its accumulators stay in registers).
pub const GROUP_PASS: usize = 4;

/// Decode attention of the `rows` query heads of one GQA group (row `r` at `q + r * q_stride`, output at
/// `out + r * out_stride`), each seeing the first `len` slots of `table`, over an f16 or 8-bit arena (`E` =
/// [`ELEM_F16`], [`ELEM_I8`], [`ELEM_FP8`]; scales as for [`attend_one`]). Where [`attend_rows`] widens a block into
/// an f32 copy for its rows to read back, this widens each 8 elements in a register and hands them to up to
/// [`GROUP_PASS`] heads at once, so a group of 3 widens and loads every element once instead of 3 times and
/// nothing is written back. Each head's dot
/// products, softmax and weighted sums run the operations of [`attend_one`] in its order (the value sums go chunk
/// by chunk instead of slot by slot, each chunk's chain over the slots unchanged), so a head's output is
/// bit-identical to [`attend_one`]'s. Groups larger than [`GROUP_PASS`] take several passes.
///
/// # Safety
/// As [`attend_one`] for every row; `rows >= 1`; the output rows do not overlap the queries or each other.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn attend_group<const NV: usize, const E: u8>(
    q: *const f32,
    q_stride: usize,
    out: *mut f32,
    out_stride: usize,
    rows: usize,
    arenas: Arenas,
    table: &[u32],
    len: usize,
    scale: f32,
) {
    debug_assert!(matches!(E, ELEM_F16 | ELEM_I8 | ELEM_FP8) && rows >= 1 && arenas.bs <= 64);
    let mut r = 0;
    while r < rows {
        let (qr, or) = (q.add(r * q_stride), out.add(r * out_stride));
        match rows - r {
            1 => group_pass::<NV, E, 1>(qr, q_stride, or, out_stride, arenas, table, len, scale),
            2 => group_pass::<NV, E, 2>(qr, q_stride, or, out_stride, arenas, table, len, scale),
            3 => group_pass::<NV, E, 3>(qr, q_stride, or, out_stride, arenas, table, len, scale),
            _ => group_pass::<NV, E, 4>(qr, q_stride, or, out_stride, arenas, table, len, scale),
        }
        r += GROUP_PASS;
    }
}

/// One pass of [`attend_group`] over `G` heads.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn group_pass<const NV: usize, const E: u8, const G: usize>(
    q: *const f32,
    q_stride: usize,
    out: *mut f32,
    out_stride: usize,
    arenas: Arenas,
    table: &[u32],
    len: usize,
    scale: f32,
) {
    let Arenas { k, v, k_scale, v_scale, bs } = arenas;
    let hd = NV * 8;
    // f16 blocks have no slot scales; the products with 1.0 that `fold_block` skips for them are skipped here too.
    let scaled = scaled::<E>();
    let qv: [[__m256; NV]; G] = core::array::from_fn(|g| scaled_query::<NV>(q.add(g * q_stride), scale));
    let mut st: [Online<NV>; G] = core::array::from_fn(|_| Online::new());
    let mut sc = [[f32::NEG_INFINITY; 64]; G];
    // Each head's probability times each slot's value scale, as `fold_block` broadcasts it.
    let mut pv = [[0.0f32; 64]; G];
    let blocks = &table[..len.div_ceil(bs)];
    for (bi, &b) in blocks.iter().enumerate() {
        let n = (len - bi * bs).min(bs);
        // The next block's lines go out slot by slot as this block's slots are scored.
        let ahead = Ahead::<E>::enter(&arenas, hd, blocks, bi);
        let (base, slot0) = (b as usize * bs * hd, b as usize * bs);
        let mut bmax: [f32; G] = core::array::from_fn(|g| st[g].m);
        // Every head's dot product with slot `i`'s key, the codes widened once for all of them.
        let dots = |i: usize| -> [__m256; G] {
            ahead.slot(i);
            let kr = base + i * hd;
            let k0 = lde::<E>(k, kr);
            let mut a: [__m256; G] = core::array::from_fn(|g| _mm256_mul_ps(qv[g][0], k0));
            for j in 1..NV {
                let kj = lde::<E>(k, kr + j * 8);
                for g in 0..G {
                    a[g] = _mm256_fmadd_ps(qv[g][j], kj, a[g]);
                }
            }
            a
        };
        // Eight slots at a time, each head's eight chains reduced in one `hsum8` and scaled in a vector, as
        // `fold_block` does for one head (the same values as one `hsum` per slot), then the rest one by one.
        let mut i = 0;
        if n >= 8 {
            let rescale = _mm256_set1_ps(code_rescale::<E>());
            let mut mv = [_mm256_set1_ps(f32::NEG_INFINITY); G];
            let mut chains = [[_mm256_setzero_ps(); 8]; G];
            while i + 8 <= n {
                for t in 0..8 {
                    let a = dots(i + t);
                    for g in 0..G {
                        chains[g][t] = a[g];
                    }
                }
                let ks = scaled.then(|| _mm256_mul_ps(_mm256_loadu_ps(k_scale.add(slot0 + i)), rescale));
                for g in 0..G {
                    let mut s8 = hsum8(&chains[g]);
                    if let Some(ks) = ks {
                        s8 = _mm256_mul_ps(s8, ks);
                    }
                    _mm256_storeu_ps(sc[g].as_mut_ptr().add(i), s8);
                    mv[g] = _mm256_max_ps(s8, mv[g]);
                }
                i += 8;
            }
            for g in 0..G {
                bmax[g] = bmax[g].max(hmax(mv[g]));
            }
        }
        while i < n {
            let a = dots(i);
            let ks = scaled.then(|| *k_scale.add(slot0 + i) * code_rescale::<E>());
            for g in 0..G {
                sc[g][i] = ks.map_or(hsum(a[g]), |ks| hsum(a[g]) * ks);
                bmax[g] = bmax[g].max(sc[g][i]);
            }
            i += 1;
        }
        for g in 0..G {
            let corr = st[g].enter_block(&mut sc[g], n, bmax[g]);
            let mut bl = 0.0f32;
            for i in 0..n {
                let p = sc[g][i];
                bl += p;
                pv[g][i] = if scaled { p * (*v_scale.add(slot0 + i) * code_rescale::<E>()) } else { p };
            }
            st[g].l = st[g].l * corr + bl;
        }
        for j in 0..NV {
            let mut acc: [__m256; G] = core::array::from_fn(|g| st[g].acc[j]);
            for i in 0..n {
                let vij = lde::<E>(v, base + i * hd + j * 8);
                for g in 0..G {
                    acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(pv[g][i]), vij, acc[g]);
                }
            }
            for g in 0..G {
                st[g].acc[j] = acc[g];
            }
        }
    }
    for (g, s) in st.iter().enumerate() {
        s.finish(out.add(g * out_stride));
    }
}

/// [`super::scalar::probs_from_logits`] with the vectorised `exp`: `p_i = exp(s_i - m) * inv_l` in place.
///
/// # Safety
/// AVX2/FMA/F16C present.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn probs_from_logits(row: &mut [f32], m: f32, inv_l: f32) {
    let (mv, iv) = (_mm256_set1_ps(m), _mm256_set1_ps(inv_l));
    let mut chunks = row.chunks_exact_mut(8);
    for c in &mut chunks {
        let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv));
        _mm256_storeu_ps(c.as_mut_ptr(), _mm256_mul_ps(e, iv));
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let mut t = [0.0f32; 8];
        t[..tail.len()].copy_from_slice(tail);
        let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(t.as_ptr()), mv));
        _mm256_storeu_ps(t.as_mut_ptr(), _mm256_mul_ps(e, iv));
        tail.copy_from_slice(&t[..tail.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_rows_q8_1x4 as scalar_quantize;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn quantize_is_bit_identical_to_scalar() {
        if !crate::cpu::avx2_available() {
            return;
        }
        let mut seed = 7;
        let mut x: Vec<f32> = (0..32 * 40).map(|_| lcg(&mut seed) * 5.0).collect();
        x[..32].fill(0.0);
        x[40] = 1e6;
        x[70] = -3.5;
        for (i, v) in x.iter_mut().enumerate().skip(96).take(32) {
            *v = (i as f32 - 110.0) * 0.5; // exact .5 ties
        }
        // 5 rows of 256: two groups, the second with one live lane.
        let (n, cols) = (5, 256);
        let mut a = vec![BlockQ8_1x4::default(); q8_1x4_len(n, cols)];
        let mut b = vec![BlockQ8_1x4::default(); q8_1x4_len(n, cols)];
        scalar_quantize(&x, n, cols, &mut a);
        // SAFETY: features checked above.
        unsafe { quantize_rows_q8_1x4(&x, n, cols, &mut b) };
        for (p, q) in a.iter().zip(&b) {
            assert_eq!(p.qs, q.qs);
            assert_eq!(p.d.map(f32::to_bits), q.d.map(f32::to_bits));
            assert_eq!(p.s.map(f32::to_bits), q.s.map(f32::to_bits));
        }
    }

    /// The transposed reduction gives each vector's `hsum` bit for bit, cancellation and specials included.
    #[test]
    fn hsum8_is_eight_hsums_bit_for_bit() {
        if !crate::cpu::avx2_available() {
            return;
        }
        let mut seed = 5;
        for round in 0..200 {
            let mut x: Vec<f32> = (0..64).map(|_| lcg(&mut seed) * 10f32.powi((round % 9) - 4)).collect();
            if round % 7 == 0 {
                x[3] = 1e30;
                x[7] = -1e30;
                x[20] = f32::INFINITY;
                x[41] = f32::NAN;
            }
            // SAFETY: features checked above; every load is inside `x`.
            unsafe {
                let a: [__m256; 8] = core::array::from_fn(|t| _mm256_loadu_ps(x.as_ptr().add(8 * t)));
                let mut got = [0.0f32; 8];
                _mm256_storeu_ps(got.as_mut_ptr(), hsum8(&a));
                for t in 0..8 {
                    assert_eq!(got[t].to_bits(), hsum(a[t]).to_bits(), "round {round}, vector {t}");
                }
            }
        }
    }

    #[test]
    fn log_sum_exp_matches_scalar() {
        if !crate::cpu::avx2_available() {
            return;
        }
        let mut seed = 11;
        for n in [1usize, 7, 8, 9, 16, 17, 100, 49_152] {
            let mut x: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 20.0).collect();
            // SAFETY: features checked above.
            let (a, b) = (crate::cpu::scalar::log_sum_exp(&x), unsafe { log_sum_exp(&x) });
            assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "n {n}: {a} {b}");
            if n > 9 {
                x[3] = f32::NAN;
                x[8] = f32::NEG_INFINITY;
                let (a, b) = (crate::cpu::scalar::log_sum_exp(&x), unsafe { log_sum_exp(&x) });
                assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "n {n} with NaN and -inf: {a} {b}");
                x[5] = f32::INFINITY;
                assert_eq!(unsafe { log_sum_exp(&x) }, f32::INFINITY);
            }
        }
        let dead = [f32::NEG_INFINITY; 12];
        assert_eq!(unsafe { log_sum_exp(&dead) }, f32::NEG_INFINITY);
        let nan = [f32::NAN; 12];
        assert_eq!(unsafe { log_sum_exp(&nan) }, f32::NEG_INFINITY);
    }

    #[test]
    fn exp256_is_accurate() {
        if !crate::cpu::avx2_available() {
            return;
        }
        let mut x = -87.0f32;
        while x < 88.0 {
            let v: [f32; 8] = core::array::from_fn(|i| x + i as f32 * 0.013);
            let mut o = [0.0f32; 8];
            // SAFETY: features checked above.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), exp256(_mm256_loadu_ps(v.as_ptr()))) };
            for i in 0..8 {
                let want = (v[i] as f64).exp();
                assert!(((o[i] as f64 - want) / want).abs() < 2e-7, "exp({}) = {} want {}", v[i], o[i], want);
            }
            x += 0.37;
        }
    }
}
