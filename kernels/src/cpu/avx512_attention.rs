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

/// Dot product of `q` with the one key row from element `at` of the arena `k`.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn score1<const NV: usize, const E: u8>(q: &[__m512; NV], k: *const u8, at: usize) -> f32 {
    let mut a = _mm512_mul_ps(q[0], ld16::<E>(k, at));
    for (j, qj) in q.iter().enumerate().skip(1) {
        a = _mm512_fmadd_ps(*qj, ld16::<E>(k, at + j * 16), a);
    }
    hsum(fold256(a))
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

/// [`scores8`] for two queries over the same 8 key rows: each key vector loaded once for both.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn scores8_pair<const NV: usize, const E: u8>(
    q0: &[__m512; NV],
    q1: &[__m512; NV],
    k: *const u8,
    at: usize,
) -> (__m256, __m256) {
    let hd = NV * 16;
    let (mut a0, mut a1) = ([_mm512_setzero_ps(); 8], [_mm512_setzero_ps(); 8]);
    for t in 0..8 {
        let kv = ld16::<E>(k, at + t * hd);
        a0[t] = _mm512_mul_ps(q0[0], kv);
        a1[t] = _mm512_mul_ps(q1[0], kv);
    }
    for j in 1..NV {
        for t in 0..8 {
            let kv = ld16::<E>(k, at + t * hd + j * 16);
            a0[t] = _mm512_fmadd_ps(q0[j], kv, a0[t]);
            a1[t] = _mm512_fmadd_ps(q1[j], kv, a1[t]);
        }
    }
    (sum8(&a0.map(|x| fold256(x))), sum8(&a1.map(|x| fold256(x))))
}

/// [`fold_block`] for two rows over the same `n` slots of a widened block ([`ELEM_F32`] or [`ELEM_F32_SCALED`],
/// from slot 0, nothing to prefetch). One row's fold loads a key or value vector for every FMA, so it is bound by
/// loads from L1 as much as by FMAs; here each vector loaded feeds both rows. Each row meets exactly
/// [`fold_block`]'s operations in its order, so both states come out bit-identical to two calls of it.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn fold_block_pair<const NV: usize, const E: u8>(
    (q0, q1): (&[__m512; NV], &[__m512; NV]),
    a: &Arenas,
    n: usize,
    (st0, st1): (&mut Online<NV>, &mut Online<NV>),
    (sc0, sc1): (&mut [f32; 64], &mut [f32; 64]),
    (lg0, lg1): (Option<&mut [f32]>, Option<&mut [f32]>),
) {
    let hd = NV * 16;
    let rescale = _mm256_set1_ps(code_rescale::<E>());
    let (mut max0, mut max1) = (_mm256_set1_ps(st0.m), _mm256_set1_ps(st1.m));
    let mut i = 0;
    while i + 8 <= n {
        let (mut s0, mut s1) = scores8_pair::<NV, E>(q0, q1, a.k, i * hd);
        if scaled::<E>() {
            let ks = _mm256_mul_ps(_mm256_loadu_ps(a.k_scale.add(i)), rescale);
            (s0, s1) = (_mm256_mul_ps(s0, ks), _mm256_mul_ps(s1, ks));
        }
        _mm256_storeu_ps(sc0.as_mut_ptr().add(i), s0);
        _mm256_storeu_ps(sc1.as_mut_ptr().add(i), s1);
        (max0, max1) = (_mm256_max_ps(max0, s0), _mm256_max_ps(max1, s1));
        i += 8;
    }
    enter_scores::<NV, E>(q0, a, 0, 0, (i, n), hmax(max0), st0, sc0, lg0, |_| {});
    enter_scores::<NV, E>(q1, a, 0, 0, (i, n), hmax(max1), st1, sc1, lg1, |_| {});
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
    let mut kf = [0.0f32; MAX_BLOCK_ELEMS];
    let mut vf = [0.0f32; MAX_BLOCK_ELEMS];
    // The block's slot scales (8-bit arenas), copied beside its widened codes.
    let (mut ksf, mut vsf) = ([0.0f32; 64], [0.0f32; 64]);
    let (mut sc, mut sc_pair) = ([f32::NEG_INFINITY; 64], [f32::NEG_INFINITY; 64]);
    let (kw, vw) = (kf.as_mut_ptr(), vf.as_mut_ptr());
    let (ksw, vsw) = (ksf.as_mut_ptr(), vsf.as_mut_ptr());
    let widened = Arenas {
        k: kw.cast_const().cast::<u8>(),
        v: vw.cast_const().cast::<u8>(),
        k_scale: ksw.cast_const(),
        v_scale: vsw.cast_const(),
        bs,
    };
    let widen = |src: usize, elems: usize, next: Option<usize>| {
        if let Some(nb) = next {
            prefetch_block::<E>(&arenas, hd, nb);
        }
        if scaled::<E>() {
            let slot0 = src / hd;
            for s in 0..elems / hd {
                *ksw.add(s) = *arenas.k_scale.add(slot0 + s) * code_rescale::<E>();
                *vsw.add(s) = *arenas.v_scale.add(slot0 + s) * code_rescale::<E>();
            }
        }
        let mut e = 0;
        while e < elems {
            _mm512_storeu_ps(kw.add(e), ld16::<E>(arenas.k, src + e));
            _mm512_storeu_ps(vw.add(e), ld16::<E>(arenas.v, src + e));
            e += 16;
        }
    };
    let fold = |rs: core::ops::Range<usize>, n_r: usize, s0: usize| {
        // Row r's logits hold its visible slots (the caller's contract), slots s0..s0 + n_r among them.
        let lg = |r: usize| super::attention::logits_row(logits, r, s0, n_r);
        let qv = |r: usize| scaled_query::<NV>(q.add(r * q_stride), scale);
        let mut r = rs.start;
        // Rows in pairs where two queries fit in registers beside their accumulators (head_dim up to 64).
        while NV <= 4 && r + 2 <= rs.end {
            let (q0, q1) = (qv(r), qv(r + 1));
            let (done, rest) = states.split_at_mut(r + 1);
            let st = (&mut done[r], &mut rest[0]);
            let (sc, lg) = ((&mut sc, &mut sc_pair), (lg(r), lg(r + 1)));
            if scaled::<E>() {
                fold_block_pair::<NV, ELEM_F32_SCALED>((&q0, &q1), &widened, n_r, st, sc, lg);
            } else {
                fold_block_pair::<NV, ELEM_F32>((&q0, &q1), &widened, n_r, st, sc, lg);
            }
            r += 2;
        }
        for r in r..rs.end {
            let st = &mut states[r];
            if scaled::<E>() {
                fold_block::<NV, ELEM_F32_SCALED>(&qv(r), &widened, 0, 0, n_r, st, &mut sc, lg(r), |_| {});
            } else {
                fold_block::<NV, ELEM_F32>(&qv(r), &widened, 0, 0, n_r, st, &mut sc, lg(r), |_| {});
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
                sc[g][i] = ks.map_or(hsum(c[g]), |ks| hsum(c[g]) * ks);
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
