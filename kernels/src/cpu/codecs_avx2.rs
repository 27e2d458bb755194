//! AVX2 + FMA + F16C dequantise-on-load attention over encoded KV blocks (x86-64). Codes are widened to f32 in
//! registers, and each codec's scales are folded into the query (keys) or the probability (values) instead of
//! being applied per element:
//!
//! - int8: `score_i = s_i · Σ q_c k_ic`, `acc += (p_i s_i) · v_i`;
//! - fp8 e4m3: the 7 magnitude bits go to f32 bits 20..27 (see [`crate::codec::e4m3_to_f32`]); the block scale and
//!   the 2^120 rebias are folded into the query and the probability;
//! - KIVI keys (per channel): `score_i = Σ q_c m_c + Σ (q_c s_c) u_ic`, with both per-block terms precomputed;
//! - KIVI values (per token, groups of 32): `acc_c += (p_i s_ig) u_ic`, and `Σ_i p_i m_ig` added once per block.
//!
//! Every function is `unsafe` because it requires those CPU features; callers check them first.

#![allow(unsafe_op_in_unsafe_fn, clippy::needless_range_loop, clippy::too_many_arguments)]

use super::avx2::{Online, scaled_query};
use crate::codec::{Codec, E4M3_F16_RESCALE, HEADER_LEN, Half, KIVI_GROUP, KeyMean, MAX_BLOCK_SIZE};
use core::arch::x86_64::*;

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_f32(p: *const u8) -> __m256 {
    _mm256_loadu_ps(p as *const f32)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_f16(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_bf16(p: *const u8) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)), 16))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_i8(p: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
}

/// Eight bytes widened to 32-bit lanes (still integers).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_u8x8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
}

/// Eight e4m3 codes as f32, still to be multiplied by 2^8 ([`E4M3_F16_RESCALE`], folded into the caller's factor).
/// An e4m3 byte's sign and 7 magnitude bits placed at an f16's bits 15 and 7..14 make an f16 whose exponent is the
/// e4m3 exponent biased by 15 instead of 7 (subnormals included), so `vcvtph2ps` gives the exact value × 2^-8, a
/// normal f32 for every code. This is four 128-bit integer operations and one conversion, against the f32 form's
/// seven (`e4m3_to_f32`), and no subnormal operand reaches the dot products.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn load_e4m3_unscaled(p: *const u8) -> __m256 {
    // Sign-extended, a negative code's bit 15 (after the shift) is its sign; bit 14 is cleared.
    let x = _mm_cvtepi8_epi16(_mm_loadl_epi64(p as *const __m128i));
    let h = _mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16(0xBF80u16 as i16));
    _mm256_cvtph_ps(h)
}

/// Code `t` (of 8 / bits per byte) of eight packed bytes, as f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn codes(x: __m256i, shift: i32, mask: i32) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(x, _mm256_set1_epi32(shift)), _mm256_set1_epi32(mask)))
}

/// `Σ_j qv[j] · row chunk j` for rows whose chunk `j` is `load(p + j * step)`.
macro_rules! dot_rows {
    ($qv:expr, $nv:expr, $load:ident, $p:expr, $step:expr) => {{
        let mut a0 = _mm256_mul_ps($qv[0], $load($p));
        let mut a1 = _mm256_setzero_ps();
        let mut j = 1;
        while j + 1 < $nv {
            a1 = _mm256_fmadd_ps($qv[j], $load($p.add(j * $step)), a1);
            a0 = _mm256_fmadd_ps($qv[j + 1], $load($p.add((j + 1) * $step)), a0);
            j += 2;
        }
        if j < $nv {
            a1 = _mm256_fmadd_ps($qv[j], $load($p.add(j * $step)), a1);
        }
        hsum(_mm256_add_ps(a0, a1))
    }};
}

/// KIVI rows: packed codes of `8 / bits` channel quarters/halves; returns `Σ_c w_c u_ic` for one row.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn kivi_dot<const NV: usize>(w: &[__m256; NV], row: *const u8, bits: i32) -> f32 {
    let parts = (8 / bits) as usize;
    let per = NV / parts;
    let mask = (1 << bits) - 1;
    let mut a0 = _mm256_setzero_ps();
    let mut a1 = _mm256_setzero_ps();
    for m in 0..per {
        let x = load_u8x8(row.add(8 * m));
        for t in 0..parts {
            let c = codes(x, bits * t as i32, mask);
            if t % 2 == 0 {
                a0 = _mm256_fmadd_ps(w[t * per + m], c, a0);
            } else {
                a1 = _mm256_fmadd_ps(w[t * per + m], c, a1);
            }
        }
    }
    hsum(_mm256_add_ps(a0, a1))
}

/// KIVI rows: `acc[j] += a[group of j] · u_j` for one row.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn kivi_axpy<const NV: usize>(a: &[__m256; 8], row: *const u8, bits: i32, acc: &mut [__m256; NV]) {
    let parts = (8 / bits) as usize;
    let per = NV / parts;
    let mask = (1 << bits) - 1;
    for m in 0..per {
        let x = load_u8x8(row.add(8 * m));
        for t in 0..parts {
            let j = t * per + m;
            acc[j] = _mm256_fmadd_ps(a[j * 8 / KIVI_GROUP], codes(x, bits * t as i32, mask), acc[j]);
        }
    }
}

#[inline]
fn f32_at(p: *const u8, i: usize) -> f32 {
    // SAFETY: callers pass offsets inside a block they hold a reference to.
    unsafe { f32::from_le_bytes(*(p.add(i) as *const [u8; 4])) }
}

#[inline]
fn f16_at(p: *const u8, i: usize) -> f32 {
    // SAFETY: as above.
    unsafe { half::f16::from_le_bytes(*(p.add(i) as *const [u8; 2])).to_f32() }
}

/// Scaled scores `sc[i] = q·k_i · scale` (the scale is already in `qv`) for the `n` first slots of a K half.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores<const NV: usize>(codec: Codec, qv: &[__m256; NV], kb: *const u8, bs: usize, n: usize, sc: &mut [f32]) {
    let hd = NV * 8;
    match codec {
        Codec::F32 => {
            for i in 0..n {
                sc[i] = dot_rows!(qv, NV, load_f32, kb.add(4 * i * hd), 32);
            }
        }
        Codec::F16 => {
            for i in 0..n {
                sc[i] = dot_rows!(qv, NV, load_f16, kb.add(2 * i * hd), 16);
            }
        }
        Codec::Bf16 => {
            for i in 0..n {
                sc[i] = dot_rows!(qv, NV, load_bf16, kb.add(2 * i * hd), 16);
            }
        }
        Codec::Int8 => {
            let qs = kb.add(4 * bs);
            for i in 0..n {
                sc[i] = f32_at(kb, 4 * i) * dot_rows!(qv, NV, load_i8, qs.add(i * hd), 8);
            }
        }
        Codec::Fp8E4m3 | Codec::Fp8E4m3Rotated => {
            let f = _mm256_set1_ps(f32_at(kb, 0) * E4M3_F16_RESCALE);
            let mut w = [_mm256_setzero_ps(); NV];
            for j in 0..NV {
                w[j] = _mm256_mul_ps(qv[j], f);
            }
            for i in 0..n {
                sc[i] = dot_rows!(w, NV, load_e4m3_unscaled, kb.add(4 + i * hd), 8);
            }
            // fp8_e4m3_rotated's keys are e4m3 codes of rotated keys, less the block's rotated channel mean where
            // the slot's bit says so, scored against a query its caller rotated: q·k = q·codes + q·mean.
            if codec == Codec::Fp8E4m3Rotated {
                let at = KeyMean::offset(bs, hd);
                let f = _mm256_set1_ps(f32_at(kb, at) * E4M3_F16_RESCALE);
                for j in 0..NV {
                    w[j] = _mm256_mul_ps(qv[j], f);
                }
                let q_mean = dot_rows!(w, NV, load_e4m3_unscaled, kb.add(at + 4), 8);
                let centred = kb.add(at + 4 + hd);
                for i in 0..n {
                    if *centred.add(i / 8) >> (i % 8) & 1 == 1 {
                        sc[i] += q_mean;
                    }
                }
            }
        }
        Codec::Int4Kivi | Codec::Int2Kivi => {
            let bits = if codec == Codec::Int4Kivi { 4 } else { 2 };
            let mut w = [_mm256_setzero_ps(); NV];
            let mut qm = _mm256_setzero_ps();
            for j in 0..NV {
                w[j] = _mm256_mul_ps(qv[j], load_f16(kb.add(16 * j)));
                qm = _mm256_fmadd_ps(qv[j], load_f16(kb.add(2 * hd + 16 * j)), qm);
            }
            let qm = hsum(qm);
            let rl = hd * bits as usize / 8;
            let rows = kb.add(4 * hd);
            for i in 0..n {
                sc[i] = qm + kivi_dot::<NV>(&w, rows.add(i * rl), bits);
            }
        }
    }
}

/// `acc += Σ_i p[i] · v_i` over the `n = p.len()` first slots of a V half.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate<const NV: usize>(codec: Codec, p: &[f32], vb: *const u8, bs: usize, acc: &mut [__m256; NV]) {
    let hd = NV * 8;
    macro_rules! axpy {
        ($w:expr, $load:ident, $row:expr, $step:expr) => {{
            let w = _mm256_set1_ps($w);
            for j in 0..NV {
                acc[j] = _mm256_fmadd_ps(w, $load($row.add(j * $step)), acc[j]);
            }
        }};
    }
    match codec {
        Codec::F32 => {
            for (i, &pi) in p.iter().enumerate() {
                axpy!(pi, load_f32, vb.add(4 * i * hd), 32);
            }
        }
        Codec::F16 => {
            for (i, &pi) in p.iter().enumerate() {
                axpy!(pi, load_f16, vb.add(2 * i * hd), 16);
            }
        }
        Codec::Bf16 => {
            for (i, &pi) in p.iter().enumerate() {
                axpy!(pi, load_bf16, vb.add(2 * i * hd), 16);
            }
        }
        Codec::Int8 => {
            let qs = vb.add(4 * bs);
            for (i, &pi) in p.iter().enumerate() {
                axpy!(pi * f32_at(vb, 4 * i), load_i8, qs.add(i * hd), 8);
            }
        }
        Codec::Fp8E4m3 | Codec::Fp8E4m3Rotated => {
            let f = f32_at(vb, 0) * E4M3_F16_RESCALE;
            for (i, &pi) in p.iter().enumerate() {
                axpy!(pi * f, load_e4m3_unscaled, vb.add(4 + i * hd), 8);
            }
        }
        Codec::Int4Kivi | Codec::Int2Kivi => {
            let bits = if codec == Codec::Int4Kivi { 4 } else { 2 };
            let groups = hd.div_ceil(KIVI_GROUP);
            let mins = 2 * bs * groups;
            let rows = vb.add(4 * bs * groups);
            let rl = hd * bits as usize / 8;
            let mut a = [_mm256_setzero_ps(); 8];
            let mut msum = [0.0f32; 8];
            for (i, &pi) in p.iter().enumerate() {
                for g in 0..groups {
                    let at = 2 * (i * groups + g);
                    a[g] = _mm256_set1_ps(pi * f16_at(vb, at));
                    msum[g] += pi * f16_at(vb, mins + at);
                }
                kivi_axpy::<NV>(&a, rows.add(i * rl), bits, acc);
            }
            for j in 0..NV {
                acc[j] = _mm256_add_ps(acc[j], _mm256_set1_ps(msum[j * 8 / KIVI_GROUP]));
            }
        }
    }
}

/// Attention of one query over the first `len` slots of the blocks `ids`, `NV` = head_dim / 8; writes the
/// normalised result into `out`. Returns false (and writes nothing) for a shape this kernel does not cover.
///
/// # Safety
/// Every id addresses a block of `arena` (`block_len` bytes each) that the encoder wrote or that was validated on
/// load, with codec `codec`, `bs` slots and head_dim `NV * 8`; AVX2/FMA/F16C present.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attend_one<const NV: usize>(
    codec: Codec,
    q: &[f32],
    arena: &[u8],
    block_len: usize,
    bs: usize,
    ids: &[u32],
    len: usize,
    scale: f32,
    out: &mut [f32],
) -> bool {
    let hd = NV * 8;
    // The KIVI kernels split rows into 2 or 4 channel parts of whole 8-lane chunks.
    if bs > MAX_BLOCK_SIZE
        || q.len() != hd
        || out.len() != hd
        || (matches!(codec, Codec::Int2Kivi) && !NV.is_multiple_of(4))
    {
        return false;
    }
    let khl = codec.half_len(Half::K, bs, hd);
    let qv = scaled_query::<NV>(q.as_ptr(), scale);
    let mut st = Online::<NV>::new();
    // Eight spare lanes: the vectorised exp of `enter_block` runs over whole 8-lane chunks.
    let mut sc = [f32::NEG_INFINITY; MAX_BLOCK_SIZE + 8];
    for (bi, &b) in ids.iter().enumerate() {
        let n = (len - bi * bs).min(bs);
        let kb = arena.as_ptr().add(b as usize * block_len + HEADER_LEN);
        scores::<NV>(codec, &qv, kb, bs, n, &mut sc);
        let bmax = sc[..n].iter().fold(st.m, |a, &s| a.max(s));
        let corr = st.enter_block(&mut sc, n, bmax);
        st.l = st.l * corr + sc[..n].iter().sum::<f32>();
        accumulate::<NV>(codec, &sc[..n], kb.add(khl), bs, &mut st.acc);
    }
    st.finish(out.as_mut_ptr());
    true
}

/// [`crate::codec::hadamard_rotate`] on chunks of `n` floats (a power of two, at least 8, dividing `x.len()`),
/// bit for bit the scalar butterflies' result. The three stages within eight floats pair each lane with a
/// permuted copy: `v·sign + swapped` is `a + b` in the lanes that keep the sum and `a − b` in those that keep the
/// difference, since a product by ±1 is exact and the fused add rounds once, as the scalar sum does. The wider
/// stages add and subtract whole registers; the last one also multiplies by `norm`, as the scalar loop does after
/// its last stage.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hadamard_rotate(x: &mut [f32], n: usize, norm: f32) {
    debug_assert!(n.is_power_of_two() && n >= 8 && x.len().is_multiple_of(n));
    let pairs = _mm256_setr_ps(1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0);
    let quads = _mm256_setr_ps(1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0);
    let halves = _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0);
    let vnorm = _mm256_set1_ps(norm);
    for c in x.chunks_exact_mut(n) {
        let p = c.as_mut_ptr();
        for i in (0..n).step_by(8) {
            let mut v = _mm256_loadu_ps(p.add(i));
            v = _mm256_fmadd_ps(v, pairs, _mm256_permute_ps::<0b10_11_00_01>(v));
            v = _mm256_fmadd_ps(v, quads, _mm256_permute_ps::<0b01_00_11_10>(v));
            v = _mm256_fmadd_ps(v, halves, _mm256_permute2f128_ps::<1>(v, v));
            if n == 8 {
                v = _mm256_mul_ps(v, vnorm);
            }
            _mm256_storeu_ps(p.add(i), v);
        }
        let mut h = 8;
        while h < n {
            let last = 2 * h == n;
            for i in (0..n).step_by(2 * h) {
                for j in (i..i + h).step_by(8) {
                    let (a, b) = (_mm256_loadu_ps(p.add(j)), _mm256_loadu_ps(p.add(j + h)));
                    let (mut sum, mut diff) = (_mm256_add_ps(a, b), _mm256_sub_ps(a, b));
                    if last {
                        sum = _mm256_mul_ps(sum, vnorm);
                        diff = _mm256_mul_ps(diff, vnorm);
                    }
                    _mm256_storeu_ps(p.add(j), sum);
                    _mm256_storeu_ps(p.add(j + h), diff);
                }
            }
            h *= 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::e4m3_to_f32;

    /// The AVX2 transform equals the scalar butterflies bit for bit, for every chunk size from 8 to 256 and for
    /// rows of several chunks (96 = three of 32), on values of mixed signs and magnitudes, zeros included.
    #[test]
    fn hadamard_rotation_matches_the_scalar_butterflies_bit_for_bit() {
        if !crate::cpu::avx2_available() {
            return;
        }
        for len in [8usize, 16, 24, 32, 48, 64, 96, 128, 256] {
            let n = 1usize << len.trailing_zeros();
            let norm = 1.0 / (n as f32).sqrt();
            let x: Vec<f32> = (0..len)
                .map(|i| if i % 13 == 5 { 0.0 } else { (i as f32 * 0.731).sin() * 10f32.powi((i % 7) as i32 - 3) })
                .collect();
            let (mut want, mut got) = (x.clone(), x);
            crate::codec::hadamard_rotate_scalar(&mut want, n, norm);
            // SAFETY: AVX2/FMA/F16C checked above; `n` is a power of two of at least 8 dividing `len`.
            unsafe { hadamard_rotate(&mut got, n, norm) };
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "length {len}");
        }
    }

    /// Every one of the 256 codes, subnormals, zeros of both signs and the two NaN codes included (both forms read
    /// those as ±480), widens through the f16 form to exactly the scalar decoder's value once rescaled.
    #[test]
    fn e4m3_widening_through_f16_is_exact_for_every_code() {
        if !crate::cpu::avx2_available() {
            return;
        }
        let codes: Vec<u8> = (0..=255).collect();
        for chunk in codes.chunks_exact(8) {
            let mut got = [0.0f32; 8];
            // SAFETY: AVX2/FMA/F16C checked above; `chunk` holds the eight bytes read.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), load_e4m3_unscaled(chunk.as_ptr())) };
            for (&b, &g) in chunk.iter().zip(&got) {
                assert!(g == 0.0 || g.is_normal(), "code {b:#04x} widened to a subnormal {g:e}");
                let want = e4m3_to_f32(b);
                assert_eq!((g * E4M3_F16_RESCALE).to_bits(), want.to_bits(), "code {b:#04x}");
            }
        }
    }
}
