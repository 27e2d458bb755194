//! AVX-512 paged attention over a head-paged block table (online softmax): the [`super::Simd::Avx512`] form of
//! [`super::avx2::attend_one`] (one query over f16 or 8-bit blocks), with the same contract, and its two multi-row
//! forms with the same arithmetic per row: [`attend_rows`] (prefill tokens, through a widened copy of each block)
//! and [`attend_group`] (a decode step's GQA group, widened in registers). The 8-bit pools (int8, e4m3) apply
//! each slot's scales as the AVX2 kernels do: a key's to its dot product, a value's to its probability.
//!
//! Why a second form: at head_dim 64 the AVX2 kernel needs 8 ymm registers for the query and 8 for the
//! accumulators, so the compiler spills accumulators inside the value loop and every FMA waits on a store-forward.
//! With 32 zmm registers of 16 lanes the query takes 4, two interleaved accumulator sets take 8, and eight
//! independent score chains fit beside them, with half the instructions. Scores for eight slots are reduced by one
//! transpose-add, not eight horizontal sums; the block's probabilities and their sum stay in vectors.

#![allow(unsafe_op_in_unsafe_fn, clippy::needless_range_loop)]

use super::avx2::{
    Ahead, Arenas, ELEM_F16, ELEM_F32, ELEM_F32_SCALED, ELEM_FP8, ELEM_I8, code_rescale, exp256, hmax, hsum,
    prefetch_block, probs_from_logits, scaled,
};
use core::arch::x86_64::*;

/// Adds the two 256-bit halves of `a`.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn fold256(a: __m512) -> __m256 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    _mm256_add_ps(_mm512_castps512_ps256(a), hi)
}

/// Sixteen elements of an arena of element type `E` at element index `i`, widened to f32: f16 bit patterns,
/// int8 codes, e4m3 codes (their value × 2^-8, as `codecs_avx2::load_e4m3_unscaled` widens eight), or f32.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn ld16<const E: u8>(base: *const u8, i: usize) -> __m512 {
    match E {
        ELEM_F16 => _mm512_cvtph_ps(_mm256_loadu_si256(base.add(2 * i) as *const __m256i)),
        ELEM_I8 => _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(base.add(i) as *const __m128i))),
        ELEM_FP8 => {
            // Sign-extended, a negative code's bit 15 (after the shift) is its sign; bit 14 is cleared.
            let x = _mm256_cvtepi8_epi16(_mm_loadu_si128(base.add(i) as *const __m128i));
            _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(0xBF80u16 as i16)))
        }
        _ => _mm512_loadu_ps((base as *const f32).add(i)),
    }
}

/// Dot products of `q` (`NV` vectors of 16) with the 8 consecutive key rows from element `at` of the arena `k` (row
/// stride `NV * 16`), as one vector of 8 scores: eight independent FMA chains, then a transpose-add.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn scores8<const NV: usize, const E: u8>(q: &[__m512; NV], k: *const u8, at: usize) -> __m256 {
    let hd = NV * 16;
    let mut a = [_mm512_setzero_ps(); 8];
    for (t, acc) in a.iter_mut().enumerate() {
        *acc = _mm512_mul_ps(q[0], ld16::<E>(k, at + t * hd));
    }
    for (j, qj) in q.iter().enumerate().skip(1) {
        for (t, acc) in a.iter_mut().enumerate() {
            *acc = _mm512_fmadd_ps(*qj, ld16::<E>(k, at + t * hd + j * 16), *acc);
        }
    }
    sum8(&a.map(|x| fold256(x)))
}

/// Lane `t` of the result is the sum of the 8 lanes of `f[t]` (a transpose-add): the reduction of every score's
/// folded chain, whether [`scores8`] or [`group_pass`] computed the chain.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn sum8(f: &[__m256; 8]) -> __m256 {
    let h01 = _mm256_hadd_ps(f[0], f[1]);
    let h23 = _mm256_hadd_ps(f[2], f[3]);
    let h45 = _mm256_hadd_ps(f[4], f[5]);
    let h67 = _mm256_hadd_ps(f[6], f[7]);
    let h0123 = _mm256_hadd_ps(h01, h23);
    let h4567 = _mm256_hadd_ps(h45, h67);
    let lo = _mm256_permute2f128_ps(h0123, h4567, 0x20);
    let hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
    _mm256_add_ps(lo, hi)
}

/// The sum of the 8 lanes of `f` in [`sum8`]'s tree, `((f0 + f1) + (f2 + f3)) + ((f4 + f5) + (f6 + f7))`, so that a
/// slot scored alone gets the score it would get in a group of eight (and from [`scores16_t`]).
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn tree8(f: __m256) -> f32 {
    let h = _mm256_hadd_ps(f, f);
    let h = _mm256_hadd_ps(h, h);
    _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)))
}

/// Dot product of `q` with the one key row from element `at` of the arena `k`.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn score1<const NV: usize, const E: u8>(q: &[__m512; NV], k: *const u8, at: usize) -> f32 {
    let mut a = _mm512_mul_ps(q[0], ld16::<E>(k, at));
    for (j, qj) in q.iter().enumerate().skip(1) {
        a = _mm512_fmadd_ps(*qj, ld16::<E>(k, at + j * 16), a);
    }
    tree8(fold256(a))
}

/// One query's online-softmax state over the blocks seen so far: running max `m`, running sum `l`, and the output
/// accumulated in two interleaved sets (even and odd slots: two independent FMA chains per output vector).
struct Online<const NV: usize> {
    m: f32,
    l: f32,
    even: [__m512; NV],
    odd: [__m512; NV],
}

impl<const NV: usize> Online<NV> {
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    #[inline]
    fn new() -> Online<NV> {
        Online { m: f32::NEG_INFINITY, l: 0.0, even: [_mm512_setzero_ps(); NV], odd: [_mm512_setzero_ps(); NV] }
    }

    /// Enters a block whose scores `sc[..n]` peak at `bmax` (at least the running max): turns them into
    /// `exp(s - bmax)` in place, over whole 8-lane chunks (so `sc` must reach `n` rounded up to 8), rescales the
    /// output sets and the running sum by `exp(m - bmax)`, adds the block's probabilities to the sum (lanes past `n`
    /// masked out) and makes `bmax` the running max.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn enter_block(&mut self, sc: &mut [f32; 64], n: usize, bmax: f32) {
        let mv = _mm256_set1_ps(bmax);
        let mut lsum = _mm256_setzero_ps();
        let mut i = 0;
        while i < n {
            let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc.as_ptr().add(i)), mv));
            _mm256_storeu_ps(sc.as_mut_ptr().add(i), e);
            let live = (n - i).min(8);
            lsum = _mm256_add_ps(lsum, _mm256_maskz_mov_ps(((1u32 << live) - 1) as u8, e));
            i += 8;
        }
        // A block that does not raise the running max (after the first few, nearly every block, since the
        // attention sink's score leads) would rescale by exp(0) = 1: skipping it is exact and saves an `expf` and
        // 2·NV multiplies per block.
        if bmax == self.m {
            self.l += hsum(lsum);
            return;
        }
        let corr = if self.m == f32::NEG_INFINITY { 0.0 } else { (self.m - bmax).exp() };
        self.m = bmax;
        let cv = _mm512_set1_ps(corr);
        for (e, o) in self.even.iter_mut().zip(self.odd.iter_mut()) {
            *e = _mm512_mul_ps(*e, cv);
            *o = _mm512_mul_ps(*o, cv);
        }
        self.l = self.l * corr + hsum(lsum);
    }

    /// Writes `(even + odd) / l` into `out` (head_dim floats) and returns `1 / l` (0 when nothing was seen).
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn finish(&self, out: *mut f32) -> f32 {
        let inv_l = if self.l > 0.0 { 1.0 / self.l } else { 0.0 };
        let inv = _mm512_set1_ps(inv_l);
        for (j, (e, o)) in self.even.iter().zip(self.odd.iter()).enumerate() {
            _mm512_storeu_ps(out.add(j * 16), _mm512_mul_ps(_mm512_add_ps(*e, *o), inv));
        }
        inv_l
    }
}

/// Folds the `n` slots (`n <= 64`) starting at element `base` of the arenas `a.k`, `a.v` (element type `E`; for the
/// scaled types, slot scales from slot `slot0` of `a.k_scale`, `a.v_scale`) into `st`, for the scaled query `qv`.
/// `sc` is scratch for the block's scores; with `logits`, the block's scaled logits are copied there. A key's
/// scale (times [`code_rescale`]) multiplies its slot's score and a value's its probability, as in the AVX2 fold.
/// `ahead(i)` runs as slot `i` is scored: [`attend_one`] prefetches the next block's slot `i` there
/// ([`Ahead::slot`]).
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn fold_block<const NV: usize, const E: u8>(
    qv: &[__m512; NV],
    a: &Arenas,
    base: usize,
    slot0: usize,
    n: usize,
    st: &mut Online<NV>,
    sc: &mut [f32; 64],
    logits: Option<&mut [f32]>,
    ahead: impl Fn(usize),
) {
    let hd = NV * 16;
    let rescale = _mm256_set1_ps(code_rescale::<E>());
    let mut bmaxv = _mm256_set1_ps(st.m);
    let mut i = 0;
    while i + 8 <= n {
        for t in i..i + 8 {
            ahead(t);
        }
        let mut s8 = scores8::<NV, E>(qv, a.k, base + i * hd);
        if scaled::<E>() {
            s8 = _mm256_mul_ps(s8, _mm256_mul_ps(_mm256_loadu_ps(a.k_scale.add(slot0 + i)), rescale));
        }
        _mm256_storeu_ps(sc.as_mut_ptr().add(i), s8);
        bmaxv = _mm256_max_ps(bmaxv, s8);
        i += 8;
    }
    enter_scores::<NV, E>(qv, a, base, slot0, (i, n), hmax(bmaxv), st, sc, logits, ahead);
    fold_values::<NV, E>(a, base, slot0, n, st, sc);
}

/// The values of the `n` slots from element `base` of `a.v` (value scales from slot `slot0`), each weighted by its
/// probability in `sc`, added to `st`'s even and odd chains: the end of [`fold_block`] and [`fold_scored`].
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn fold_values<const NV: usize, const E: u8>(
    a: &Arenas,
    base: usize,
    slot0: usize,
    n: usize,
    st: &mut Online<NV>,
    sc: &[f32; 64],
) {
    let hd = NV * 16;
    let p = |i: usize| prob::<E>(a, slot0, sc, i);
    let v = a.v;
    let mut i = 0;
    while i + 2 <= n {
        let (p0, p1) = (p(i), p(i + 1));
        let v0 = base + i * hd;
        let v1 = v0 + hd;
        for j in 0..NV {
            st.even[j] = _mm512_fmadd_ps(p0, ld16::<E>(v, v0 + j * 16), st.even[j]);
            st.odd[j] = _mm512_fmadd_ps(p1, ld16::<E>(v, v1 + j * 16), st.odd[j]);
        }
        i += 2;
    }
    if i < n {
        let p0 = p(i);
        let v0 = base + i * hd;
        for (j, e) in st.even.iter_mut().enumerate() {
            *e = _mm512_fmadd_ps(p0, ld16::<E>(v, v0 + j * 16), *e);
        }
    }
}

/// The end of a block's scoring in [`fold_block`]: slots `from..n` (past the whole groups of eight, which peak at
/// `bmax`) scored one at a time, the logits copied out, and the block entered into `st`.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn enter_scores<const NV: usize, const E: u8>(
    qv: &[__m512; NV],
    a: &Arenas,
    base: usize,
    slot0: usize,
    (from, n): (usize, usize),
    mut bmax: f32,
    st: &mut Online<NV>,
    sc: &mut [f32; 64],
    logits: Option<&mut [f32]>,
    ahead: impl Fn(usize),
) {
    let hd = NV * 16;
    for i in from..n {
        ahead(i);
        let s = score1::<NV, E>(qv, a.k, base + i * hd);
        sc[i] = if scaled::<E>() { s * (*a.k_scale.add(slot0 + i) * code_rescale::<E>()) } else { s };
        bmax = bmax.max(sc[i]);
    }
    if let Some(p) = logits {
        p.copy_from_slice(&sc[..n]);
    }
    st.enter_block(sc, n, bmax);
}

/// Slot `i`'s probability in `sc` (after [`Online::enter_block`]) times its value scale, broadcast: what each
/// value vector of the slot is multiplied by.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn prob<const E: u8>(a: &Arenas, slot0: usize, sc: &[f32; 64], i: usize) -> __m512 {
    _mm512_set1_ps(if scaled::<E>() { sc[i] * (*a.v_scale.add(slot0 + i) * code_rescale::<E>()) } else { sc[i] })
}

/// `r[i]` lane `j` becomes lane `i` of result `j`: a 16 × 16 transpose in three stages (pairs of lanes, pairs of
/// pairs, then 128-bit quarters).
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn transpose16(r: &[__m512; 16]) -> [__m512; 16] {
    let t: [__m512; 16] = core::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i & 1 == 0 { _mm512_unpacklo_ps(a, b) } else { _mm512_unpackhi_ps(a, b) }
    });
    // u[4g + k] holds, in each 128-bit quarter L, element 4L + k of rows 4g..4g + 4.
    let pd = _mm512_castps_pd;
    let u: [__m512; 16] = core::array::from_fn(|i| {
        let (g, k) = (i / 4, i % 4);
        let (a, b) = (pd(t[4 * g + (k >> 1)]), pd(t[4 * g + 2 + (k >> 1)]));
        _mm512_castpd_ps(if k & 1 == 0 { _mm512_unpacklo_pd(a, b) } else { _mm512_unpackhi_pd(a, b) })
    });
    let mut out = [_mm512_setzero_ps(); 16];
    for k in 0..4 {
        let (g0, g1, g2, g3) = (u[k], u[4 + k], u[8 + k], u[12 + k]);
        let v0 = _mm512_shuffle_f32x4(g0, g1, 0x44);
        let v1 = _mm512_shuffle_f32x4(g0, g1, 0xEE);
        let v2 = _mm512_shuffle_f32x4(g2, g3, 0x44);
        let v3 = _mm512_shuffle_f32x4(g2, g3, 0xEE);
        out[k] = _mm512_shuffle_f32x4(v0, v2, 0x88);
        out[4 + k] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
        out[8 + k] = _mm512_shuffle_f32x4(v1, v3, 0x88);
        out[12 + k] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
    }
    out
}

/// Widens the keys of the `n` slots (`n <= 16`) of the arena `k` (element type `E`) from element `src` and stores
/// them transposed at `kt`: vector `d` (16 floats at `kt + 16 d`) holds dimension `d` of the 16 slots, zeros for
/// slots from `n`.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn widen_keys_t<const NV: usize, const E: u8>(k: *const u8, src: usize, n: usize, kt: *mut f32) {
    let hd = NV * 16;
    for j in 0..NV {
        let rows: [__m512; 16] =
            core::array::from_fn(|i| if i < n { ld16::<E>(k, src + i * hd + j * 16) } else { _mm512_setzero_ps() });
        for (d, v) in transpose16(&rows).iter().enumerate() {
            _mm512_storeu_ps(kt.add((j * 16 + d) * 16), *v);
        }
    }
}

/// The scores of `R` scaled queries (`qs[r]`, head_dim floats) against 16 slots of transposed keys ([`widen_keys_t`]),
/// lane `s` of result `r` for slot `s`. Each score is [`scores8`]'s, bit for bit: chain `c_l` runs over dimensions
/// `l, l + 16, …` (a multiply, then multiply-adds), `a_l = c_l + c_(l+8)` is [`fold256`], and the `a_l` meet in
/// [`sum8`]'s tree. Here the 16 slots are the lanes, so nothing is reduced across lanes: the 12 shuffles and the
/// folds per eight scores that [`scores8`] needs become 15 vector adds per sixteen.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn scores16_t<const NV: usize, const R: usize>(qs: [*const f32; R], kt: *const f32) -> [__m512; R] {
    let key = |d: usize| _mm512_loadu_ps(kt.add(d * 16));
    let q = |r: usize, d: usize| _mm512_set1_ps(*qs[r].add(d));
    let a = |l: usize| -> [__m512; R] {
        let (k0, k8) = (key(l), key(l + 8));
        let mut c0: [__m512; R] = core::array::from_fn(|r| _mm512_mul_ps(q(r, l), k0));
        let mut c8: [__m512; R] = core::array::from_fn(|r| _mm512_mul_ps(q(r, l + 8), k8));
        for j in 1..NV {
            let (d0, d8) = (l + 16 * j, l + 8 + 16 * j);
            let (k0, k8) = (key(d0), key(d8));
            for r in 0..R {
                c0[r] = _mm512_fmadd_ps(q(r, d0), k0, c0[r]);
                c8[r] = _mm512_fmadd_ps(q(r, d8), k8, c8[r]);
            }
        }
        core::array::from_fn(|r| _mm512_add_ps(c0[r], c8[r]))
    };
    let add = |x: [__m512; R], y: [__m512; R]| -> [__m512; R] { core::array::from_fn(|r| _mm512_add_ps(x[r], y[r])) };
    let s0123 = add(add(a(0), a(1)), add(a(2), a(3)));
    let s4567 = add(add(a(4), a(5)), add(a(6), a(7)));
    add(s0123, s4567)
}

/// The running max after a block whose scores are `sc[..n]`: the larger of `m` and their max.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn block_max(m: f32, sc: &[f32; 64], n: usize) -> f32 {
    let mut mv = _mm512_set1_ps(m);
    let mut i = 0;
    while i < n {
        let live = ((1u32 << (n - i).min(16)) - 1) as u16;
        mv = _mm512_mask_max_ps(mv, live, mv, _mm512_loadu_ps(sc.as_ptr().add(i)));
        i += 16;
    }
    _mm512_reduce_max_ps(mv)
}

/// Enters a block whose scaled scores are `sc[..n]` into `st` (copying them to `logits` first) and folds the
/// block's values, from slot 0 of the widened arenas `a` ([`ELEM_F32`] or [`ELEM_F32_SCALED`]): [`fold_block`]
/// after its scoring.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn fold_scored<const NV: usize, const E: u8>(
    a: &Arenas,
    n: usize,
    st: &mut Online<NV>,
    sc: &mut [f32; 64],
    logits: Option<&mut [f32]>,
) {
    enter_scored(st, sc, n, logits);
    fold_values::<NV, E>(a, 0, 0, n, st, sc);
}

/// Enters a block whose scaled scores are `sc[..n]` into `st`, copying them to `logits` first.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn enter_scored<const NV: usize>(st: &mut Online<NV>, sc: &mut [f32; 64], n: usize, logits: Option<&mut [f32]>) {
    if let Some(p) = logits {
        p.copy_from_slice(&sc[..n]);
    }
    st.enter_block(sc, n, block_max(st.m, sc, n));
}

/// [`fold_scored`] for two rows over the same `n` slots: each value vector loaded feeds both rows' accumulators.
/// Each row meets exactly [`fold_scored`]'s operations in its order, so both states come out bit-identical to two
/// calls of it. (Entering the blocks of all rows first, then folding values, measured slower: the exponentials of
/// one pair overlap the previous pair's multiply-adds only when they alternate.)
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn fold_scored_pair<const NV: usize, const E: u8>(
    a: &Arenas,
    n: usize,
    (st0, st1): (&mut Online<NV>, &mut Online<NV>),
    (sc0, sc1): (&mut [f32; 64], &mut [f32; 64]),
    (lg0, lg1): (Option<&mut [f32]>, Option<&mut [f32]>),
) {
    enter_scored(st0, sc0, n, lg0);
    enter_scored(st1, sc1, n, lg1);
    let hd = NV * 16;
    // The four accumulator sets in locals, so that they stay in registers across the loads of the values.
    let (mut e0, mut o0, mut e1, mut o1) = (st0.even, st0.odd, st1.even, st1.odd);
    let v = a.v;
    let mut i = 0;
    while i + 2 <= n {
        let (p00, p01) = (prob::<E>(a, 0, sc0, i), prob::<E>(a, 0, sc0, i + 1));
        let (p10, p11) = (prob::<E>(a, 0, sc1, i), prob::<E>(a, 0, sc1, i + 1));
        for j in 0..NV {
            let (x0, x1) = (ld16::<E>(v, i * hd + j * 16), ld16::<E>(v, (i + 1) * hd + j * 16));
            e0[j] = _mm512_fmadd_ps(p00, x0, e0[j]);
            o0[j] = _mm512_fmadd_ps(p01, x1, o0[j]);
            e1[j] = _mm512_fmadd_ps(p10, x0, e1[j]);
            o1[j] = _mm512_fmadd_ps(p11, x1, o1[j]);
        }
        i += 2;
    }
    if i < n {
        let (p0, p1) = (prob::<E>(a, 0, sc0, i), prob::<E>(a, 0, sc1, i));
        for j in 0..NV {
            let x = ld16::<E>(v, i * hd + j * 16);
            e0[j] = _mm512_fmadd_ps(p0, x, e0[j]);
            e1[j] = _mm512_fmadd_ps(p1, x, e1[j]);
        }
    }
    (st0.even, st0.odd, st1.even, st1.odd) = (e0, o0, e1, o1);
}

/// `q` (head_dim floats) times `scale`, as `NV` vectors.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn scaled_query<const NV: usize>(q: *const f32, scale: f32) -> [__m512; NV] {
    let sv = _mm512_set1_ps(scale);
    let mut qv = [_mm512_setzero_ps(); NV];
    for (j, r) in qv.iter_mut().enumerate() {
        *r = _mm512_mul_ps(_mm512_loadu_ps(q.add(j * 16)), sv);
    }
    qv
}

/// Attention of one query `q` (`head_dim = NV * 16`) over the first `len` slots of `table` in `arenas` (blocks of
/// `bs <= 64` slots × head_dim of element type `E`: [`ELEM_F16`], [`ELEM_I8`] or [`ELEM_FP8`], the 8-bit types
/// with per-slot scales indexed `block * bs + slot`); writes the result into `out` and, with `probs` (`len`
/// floats), the slots' softmax probabilities.
///
/// # Safety
/// Requires AVX-512 F/VL, AVX2, FMA and F16C. Every block id in `table[..len.div_ceil(bs)]` must be in range of
/// both arenas (and of the scale arrays), and `q`, `out` must hold head_dim floats.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
pub unsafe fn attend_one<const NV: usize, const E: u8>(
    q: &[f32],
    arenas: Arenas,
    table: &[u32],
    len: usize,
    scale: f32,
    out: &mut [f32],
    mut probs: Option<&mut [f32]>,
) {
    let (hd, bs) = (NV * 16, arenas.bs);
    debug_assert!(q.len() == hd && out.len() == hd && bs <= 64 && matches!(E, ELEM_F16 | ELEM_I8 | ELEM_FP8));
    let qv = scaled_query::<NV>(q.as_ptr(), scale);
    let mut st = Online::<NV>::new();
    let mut sc = [f32::NEG_INFINITY; 64];
    let blocks = &table[..len.div_ceil(bs)];
    for (bi, &b) in blocks.iter().enumerate() {
        let n = (len - bi * bs).min(bs);
        let ahead = Ahead::<E>::enter(&arenas, hd, blocks, bi);
        let logits = probs.as_deref_mut().map(|p| &mut p[bi * bs..bi * bs + n]);
        let (base, slot0) = (b as usize * bs * hd, b as usize * bs);
        fold_block::<NV, E>(&qv, &arenas, base, slot0, n, &mut st, &mut sc, logits, |i| ahead.slot(i));
    }
    let inv_l = st.finish(out.as_mut_ptr());
    if let Some(p) = probs {
        probs_from_logits(p, st.m, inv_l);
    }
}

/// Most query rows [`attend_rows`] takes at once.
pub const MAX_ROWS: usize = 32;
/// Largest block (slots × head_dim) [`attend_rows`] widens on its stack.
pub const MAX_BLOCK_ELEMS: usize = 4096;

/// Floats of [`attend_rows`]'s transposed keys: a block of up to [`MAX_BLOCK_ELEMS`] elements, its slots rounded up
/// to a whole chunk of 16.
const KT_ELEMS: usize = MAX_BLOCK_ELEMS + 15 * 128;

/// The scaled scores of the `R` rows from `r0` (scaled queries at `qs + r * hd`) for the `n` slots of a block whose
/// keys `kt` holds transposed ([`widen_keys_t`]; for 8-bit arenas `ks` holds the slots' key scales, rescaled), into
/// `sc[r][..n]` (whole chunks of 16 are written).
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn score_rows<const NV: usize, const E: u8, const R: usize>(
    qs: *const f32,
    r0: usize,
    kt: *const f32,
    ks: *const f32,
    n: usize,
    sc: &mut [[f32; 64]; MAX_ROWS],
) {
    let hd = NV * 16;
    let rows: [*const f32; R] = core::array::from_fn(|i| qs.add((r0 + i) * hd));
    for c in 0..n.div_ceil(16) {
        let s = scores16_t::<NV, R>(rows, kt.add(c * 16 * hd));
        // A key's scale multiplies its score, as in `fold_block` (the widened scales carry the e4m3 rescale).
        let kscale = scaled::<E>().then(|| _mm512_loadu_ps(ks.add(c * 16)));
        for (i, v) in s.into_iter().enumerate() {
            let v = kscale.map_or(v, |k| _mm512_mul_ps(v, k));
            _mm512_storeu_ps(sc[r0 + i].as_mut_ptr().add(c * 16), v);
        }
    }
}

/// Attention of `rows` queries over one head-paged table of element type `E` (as for [`attend_one`]): query `r`
/// (at `q + r * q_stride`, head_dim floats) sees the first `len0 + r` slots when `causal` (consecutive tokens of
/// one head) or `len0` slots otherwise, and writes its result at `out + r * out_stride`.
///
/// The prefill form of [`attend_one`]: each block is widened to f32 once (8-bit codes unscaled, their slot scales
/// copied beside them with [`code_rescale`] applied) and then read from L1 by every row that sees it, instead of
/// being widened again for each query; each row keeps its own online-softmax state between blocks. Same
/// arithmetic per row as [`attend_one`] (the widening is exact and the scales meet the same products), so the
/// results are `attend_one`'s. With `logits = Some((p, stride))`, row `r`'s softmax probabilities over the slots
/// it sees go to `p + r * stride`, as [`attend_one`]'s `probs` (the same values).
///
/// # Safety
/// Requires AVX-512 F/VL, AVX2, FMA and F16C. `1 <= rows <= MAX_ROWS`, `len0 >= 1`, `bs <= 64`,
/// `bs * NV * 16 <= MAX_BLOCK_ELEMS`; every block id the last row reads (`table[..(len0 + rows - 1).div_ceil(bs)]`
/// when causal, `table[..len0.div_ceil(bs)]` otherwise) must be in range of both arenas (and of the scale arrays);
/// the `rows` query and output rows must be in bounds, and no output row may overlap another row or a query; with
/// `logits`, its `rows` rows of `stride` floats (at least the slots the last row sees) are writable and overlap
/// nothing else.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
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
    let (hd, bs) = (NV * 16, arenas.bs);
    debug_assert!((1..=MAX_ROWS).contains(&rows) && len0 >= 1 && bs <= 64 && bs * hd <= MAX_BLOCK_ELEMS);
    debug_assert!(matches!(E, ELEM_F16 | ELEM_I8 | ELEM_FP8));
    let mut states: [Online<NV>; MAX_ROWS] = core::array::from_fn(|_| Online::new());
    // The block's keys widened and transposed, 16 slots a chunk ([`widen_keys_t`]), and its values widened.
    let mut kt = [0.0f32; KT_ELEMS];
    let mut vf = [0.0f32; MAX_BLOCK_ELEMS];
    // The block's slot scales (8-bit arenas), copied beside its widened codes.
    let (mut ksf, mut vsf) = ([0.0f32; 64], [0.0f32; 64]);
    // Each row's scaled query, and its scores for the block.
    let mut qs = [0.0f32; MAX_ROWS * 128];
    let mut sc = [[f32::NEG_INFINITY; 64]; MAX_ROWS];
    for r in 0..rows {
        let qv = scaled_query::<NV>(q.add(r * q_stride), scale);
        for (j, v) in qv.iter().enumerate() {
            _mm512_storeu_ps(qs.as_mut_ptr().add(r * hd + j * 16), *v);
        }
    }
    let (ktw, vw) = (kt.as_mut_ptr(), vf.as_mut_ptr());
    let (ksw, vsw) = (ksf.as_mut_ptr(), vsf.as_mut_ptr());
    let widened = Arenas {
        k: ktw.cast_const().cast::<u8>(),
        v: vw.cast_const().cast::<u8>(),
        k_scale: ksw.cast_const(),
        v_scale: vsw.cast_const(),
        bs,
    };
    let widen = |src: usize, elems: usize, next: Option<usize>| {
        if let Some(nb) = next {
            prefetch_block::<E>(&arenas, hd, nb);
        }
        let n = elems / hd;
        if scaled::<E>() {
            let slot0 = src / hd;
            for s in 0..n {
                *ksw.add(s) = *arenas.k_scale.add(slot0 + s) * code_rescale::<E>();
                *vsw.add(s) = *arenas.v_scale.add(slot0 + s) * code_rescale::<E>();
            }
        }
        for c in 0..n.div_ceil(16) {
            widen_keys_t::<NV, E>(arenas.k, src + c * 16 * hd, (n - c * 16).min(16), ktw.add(c * 16 * hd));
        }
        let mut e = 0;
        while e < elems {
            _mm512_storeu_ps(vw.add(e), ld16::<E>(arenas.v, src + e));
            e += 16;
        }
    };
    let qs = qs.as_ptr();
    let fold = |rs: core::ops::Range<usize>, n_r: usize, s0: usize| {
        // Row r's logits hold its visible slots (the caller's contract), slots s0..s0 + n_r among them.
        let lg = |r: usize| super::attention::logits_row(logits, r, s0, n_r);
        // Every row's scores first, four rows to a pass over the transposed keys (each key vector loaded once
        // for them), then each row's softmax and values.
        let mut r = rs.start;
        while r < rs.end {
            match rs.end - r {
                1 => score_rows::<NV, E, 1>(qs, r, kt.as_ptr(), ksw, n_r, &mut sc),
                2 => score_rows::<NV, E, 2>(qs, r, kt.as_ptr(), ksw, n_r, &mut sc),
                3 => score_rows::<NV, E, 3>(qs, r, kt.as_ptr(), ksw, n_r, &mut sc),
                _ => score_rows::<NV, E, 4>(qs, r, kt.as_ptr(), ksw, n_r, &mut sc),
            }
            r += 4;
        }
        let mut r = rs.start;
        // Rows in pairs where two rows' accumulators fit in registers (head_dim up to 64).
        while NV <= 4 && r + 2 <= rs.end {
            let (done, rest) = states.split_at_mut(r + 1);
            let st = (&mut done[r], &mut rest[0]);
            let (sd, sr) = sc.split_at_mut(r + 1);
            let pair = (&mut sd[r], &mut sr[0]);
            if scaled::<E>() {
                fold_scored_pair::<NV, ELEM_F32_SCALED>(&widened, n_r, st, pair, (lg(r), lg(r + 1)));
            } else {
                fold_scored_pair::<NV, ELEM_F32>(&widened, n_r, st, pair, (lg(r), lg(r + 1)));
            }
            r += 2;
        }
        for r in r..rs.end {
            if scaled::<E>() {
                fold_scored::<NV, ELEM_F32_SCALED>(&widened, n_r, &mut states[r], &mut sc[r], lg(r));
            } else {
                fold_scored::<NV, ELEM_F32>(&widened, n_r, &mut states[r], &mut sc[r], lg(r));
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

/// The most query heads [`attend_group`] folds in one pass over a table.
pub const GROUP_PASS: usize = 4;

/// Decode attention of the `rows` query heads of one GQA group over a table of element type `E` (as for
/// [`attend_one`]; row `r` at `q + r * q_stride`, output at `out + r * out_stride`), each seeing the first `len`
/// slots. Where [`attend_rows`] widens a block into an f32 copy for its rows to read back, this widens each 16
/// elements in a register and hands them to up to [`GROUP_PASS`] heads at once: nothing is written back, and a
/// lone sequence's three tasks do not pay for a copy that only three rows read. Each head runs [`attend_one`]'s
/// operations in its order (scores chain by chain, reduced eight at a time by [`sum8`] and scaled as there, the
/// block's softmax by [`Online::enter_block`], each output vector's even and odd chains over the slots unchanged),
/// so a head's output is bit-identical to [`attend_one`]'s.
///
/// # Safety
/// As [`attend_one`] for every row; `rows >= 1`; the output rows do not overlap the queries or each other.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
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
    debug_assert!(rows >= 1 && arenas.bs <= 64 && matches!(E, ELEM_F16 | ELEM_I8 | ELEM_FP8));
    let mut r = 0;
    while r < rows {
        let (qr, or) = (q.add(r * q_stride), out.add(r * out_stride));
        match rows - r {
            1 => group_pass::<NV, E, 1>(qr, q_stride, or, out_stride, &arenas, table, len, scale),
            2 => group_pass::<NV, E, 2>(qr, q_stride, or, out_stride, &arenas, table, len, scale),
            3 => group_pass::<NV, E, 3>(qr, q_stride, or, out_stride, &arenas, table, len, scale),
            _ => group_pass::<NV, E, 4>(qr, q_stride, or, out_stride, &arenas, table, len, scale),
        }
        r += GROUP_PASS;
    }
}

/// One pass of [`attend_group`] over `G` heads.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn group_pass<const NV: usize, const E: u8, const G: usize>(
    q: *const f32,
    q_stride: usize,
    out: *mut f32,
    out_stride: usize,
    a: &Arenas,
    table: &[u32],
    len: usize,
    scale: f32,
) {
    let (hd, bs) = (NV * 16, a.bs);
    let (k, v) = (a.k, a.v);
    let qv: [[__m512; NV]; G] = core::array::from_fn(|g| scaled_query::<NV>(q.add(g * q_stride), scale));
    let mut st: [Online<NV>; G] = core::array::from_fn(|_| Online::new());
    let mut sc = [[f32::NEG_INFINITY; 64]; G];
    // Each head's probability times each slot's value scale, as `fold_block` broadcasts it.
    let mut pv = [[0.0f32; 64]; G];
    let rescale = _mm256_set1_ps(code_rescale::<E>());
    let blocks = &table[..len.div_ceil(bs)];
    for (bi, &b) in blocks.iter().enumerate() {
        let n = (len - bi * bs).min(bs);
        // The next block's lines go out slot by slot as this block's slots are scored.
        let ahead = Ahead::<E>::enter(a, hd, blocks, bi);
        let (base, slot0) = (b as usize * bs * hd, b as usize * bs);
        // Every head's score chain for slot `i`, folded to 8 lanes, the key widened once for all of them.
        let chains = |i: usize| -> [__m256; G] {
            ahead.slot(i);
            let at = base + i * hd;
            let k0 = ld16::<E>(k, at);
            let mut acc: [__m512; G] = core::array::from_fn(|g| _mm512_mul_ps(qv[g][0], k0));
            for j in 1..NV {
                let kj = ld16::<E>(k, at + j * 16);
                for g in 0..G {
                    acc[g] = _mm512_fmadd_ps(qv[g][j], kj, acc[g]);
                }
            }
            acc.map(|x| fold256(x))
        };
        let mut bmaxv: [__m256; G] = core::array::from_fn(|g| _mm256_set1_ps(st[g].m));
        let mut i = 0;
        while i + 8 <= n {
            let mut f = [[_mm256_setzero_ps(); 8]; G];
            for t in 0..8 {
                let c = chains(i + t);
                for g in 0..G {
                    f[g][t] = c[g];
                }
            }
            let ks = scaled::<E>().then(|| _mm256_mul_ps(_mm256_loadu_ps(a.k_scale.add(slot0 + i)), rescale));
            for g in 0..G {
                let mut s8 = sum8(&f[g]);
                if let Some(ks) = ks {
                    s8 = _mm256_mul_ps(s8, ks);
                }
                _mm256_storeu_ps(sc[g].as_mut_ptr().add(i), s8);
                bmaxv[g] = _mm256_max_ps(bmaxv[g], s8);
            }
            i += 8;
        }
        let mut bmax: [f32; G] = core::array::from_fn(|g| hmax(bmaxv[g]));
        while i < n {
            let c = chains(i);
            let ks = scaled::<E>().then(|| *a.k_scale.add(slot0 + i) * code_rescale::<E>());
            for g in 0..G {
                let s = tree8(c[g]);
                sc[g][i] = ks.map_or(s, |ks| s * ks);
                bmax[g] = bmax[g].max(sc[g][i]);
            }
            i += 1;
        }
        for g in 0..G {
            st[g].enter_block(&mut sc[g], n, bmax[g]);
            for i in 0..n {
                let p = sc[g][i];
                pv[g][i] = if scaled::<E>() { p * (*a.v_scale.add(slot0 + i) * code_rescale::<E>()) } else { p };
            }
        }
        // Each output vector's even and odd chains over the slots, in `fold_block`'s order, for every head.
        for j in 0..NV {
            let mut even: [__m512; G] = core::array::from_fn(|g| st[g].even[j]);
            let mut odd: [__m512; G] = core::array::from_fn(|g| st[g].odd[j]);
            let mut i = 0;
            while i + 2 <= n {
                let v0 = ld16::<E>(v, base + i * hd + j * 16);
                let v1 = ld16::<E>(v, base + (i + 1) * hd + j * 16);
                for g in 0..G {
                    even[g] = _mm512_fmadd_ps(_mm512_set1_ps(pv[g][i]), v0, even[g]);
                    odd[g] = _mm512_fmadd_ps(_mm512_set1_ps(pv[g][i + 1]), v1, odd[g]);
                }
                i += 2;
            }
            if i < n {
                let v0 = ld16::<E>(v, base + i * hd + j * 16);
                for g in 0..G {
                    even[g] = _mm512_fmadd_ps(_mm512_set1_ps(pv[g][i]), v0, even[g]);
                }
            }
            for g in 0..G {
                st[g].even[j] = even[g];
                st[g].odd[j] = odd[g];
            }
        }
    }
    for (g, s) in st.iter().enumerate() {
        s.finish(out.add(g * out_stride));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_scored_alone_gets_its_score_in_a_group_of_eight() {
        if !crate::cpu::avx512_available() {
            return;
        }
        let f: [f32; 8] = [1.0e-3, 3.7, -2.25, 1.0e7, 0.1, -1.0e7, 7.5e-4, 2.0];
        let mut group = [[0.0f32; 8]; 8];
        group[5] = f;
        // SAFETY: as above.
        let (alone, grouped) = unsafe {
            let vs: [__m256; 8] = core::array::from_fn(|t| _mm256_loadu_ps(group[t].as_ptr()));
            let mut out = [0.0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), sum8(&vs));
            let halves_first = hsum(_mm256_loadu_ps(f.as_ptr()));
            assert_ne!(halves_first.to_bits(), out[5].to_bits(), "the values must tell the trees apart");
            (tree8(_mm256_loadu_ps(f.as_ptr())), out[5])
        };
        assert_eq!(alone.to_bits(), grouped.to_bits());
    }
}
