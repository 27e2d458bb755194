//! Portable scalar kernels. They are the fallback on CPUs without AVX2/FMA/F16C and the reference every SIMD
//! kernel is tested against.

use crate::quant::{BlockQ8_1x4, Q4_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES, QK, f16_at};
use half::f16;

/// Q4_1 weight row (raw blocks) · lane `c` of interleaved Q8_1 blocks: Σ_b d_w d_x Σ(q_w q_x) + m_w s_x.
pub fn dot_q4_1_q8_1(w: &[u8], x: &[BlockQ8_1x4], c: usize) -> f32 {
    let mut acc = 0.0f32;
    for (blk, xb) in w.chunks_exact(Q4_1_BLOCK_BYTES).zip(x) {
        let d = f16_at(blk, 0);
        let m = f16_at(blk, 2);
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            let q = blk[4 + j];
            sumi += i32::from(q & 0x0F) * i32::from(xb.qs[c][j]);
            sumi += i32::from(q >> 4) * i32::from(xb.qs[c][j + QK / 2]);
        }
        acc += d * xb.d[c] * sumi as f32 + m * xb.s[c];
    }
    acc
}

/// Q8_0 weight row (raw blocks) · lane `c` of interleaved Q8_1 blocks: Σ_b d_w d_x Σ(q_w q_x).
pub fn dot_q8_0_q8_1(w: &[u8], x: &[BlockQ8_1x4], c: usize) -> f32 {
    let mut acc = 0.0f32;
    for (blk, xb) in w.chunks_exact(Q8_0_BLOCK_BYTES).zip(x) {
        let d = f16_at(blk, 0);
        let mut sumi = 0i32;
        for j in 0..QK {
            sumi += i32::from(blk[2 + j] as i8) * i32::from(xb.qs[c][j]);
        }
        acc += d * xb.d[c] * sumi as f32;
    }
    acc
}

/// f32 · f32.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    // Four partial sums: lets the compiler vectorise without changing results much.
    let mut s = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            s[i] += x[i] * y[i];
        }
    }
    let mut t: f32 = s.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        t += x * y;
    }
    t
}

/// f16 · f32.
pub fn dot_f16_f32(a: &[u16], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(&h, &x)| f16::from_bits(h).to_f32() * x).sum()
}

/// `out = x / sqrt(mean(x²) + eps) * w` for one row.
pub fn rmsnorm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let r = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * r * g;
    }
}

/// `ln Σ exp(x)` over a row, NaN counted as `-inf`: `-inf` when nothing is above `-inf`, `+inf` when an element
/// is. Eight partial sums, so the compiler can keep them in vector lanes.
pub fn log_sum_exp(x: &[f32]) -> f32 {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if !max.is_finite() {
        return max;
    }
    const LANES: usize = 8;
    let mut lanes = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    let term = |v: f32| if v.is_nan() { 0.0 } else { (v - max).exp() };
    for c in chunks {
        for (s, &v) in lanes.iter_mut().zip(c) {
            *s += term(v);
        }
    }
    let sum: f32 = lanes.iter().sum::<f32>() + tail.iter().map(|&v| term(v)).sum::<f32>();
    max + sum.ln()
}

/// `gate = silu(gate) * up`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Rotates adjacent pairs of one head vector given the per-element tables of [`crate::RopeTable`]
/// (`cc = [c0, c0, ..]`, `ss = [-s0, s0, ..]`): `(a, b) -> (a·c - b·s, a·s + b·c)`.
pub fn rope_head(x: &mut [f32], cc: &[f32], ss: &[f32]) {
    for ((p, c), s) in x.chunks_exact_mut(2).zip(cc.chunks_exact(2)).zip(ss.chunks_exact(2)) {
        let (a, b) = (p[0], p[1]);
        p[0] = a * c[0] + b * s[0];
        p[1] = a * s[1] + b * c[1];
    }
}

/// Online-softmax state for one (query, head): running max, running denominator, accumulator `[head_dim]`.
pub struct OnlineSoftmax<'a> {
    pub m: f32,
    pub l: f32,
    pub acc: &'a mut [f32],
}

/// Folds `n` slots of one KV block (`k`, `v`: `[n][hd]`) into the online-softmax state of query `q`; with
/// `logits` (`n` floats), also writes the block's scaled logits there.
pub fn attend_block(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    scale: f32,
    st: &mut OnlineSoftmax<'_>,
    logits: Option<&mut [f32]>,
) {
    let hd = q.len();
    let mut s = [0.0f32; 256];
    let mut sc: Vec<f32>;
    let scores: &mut [f32] = if n <= 256 {
        &mut s[..n]
    } else {
        sc = vec![0.0; n];
        &mut sc
    };
    let mut mx = st.m;
    for (i, sv) in scores.iter_mut().enumerate() {
        *sv = dot_f32(q, &k[i * hd..(i + 1) * hd]) * scale;
        mx = mx.max(*sv);
    }
    if let Some(out) = logits {
        out.copy_from_slice(scores);
    }
    let corr = (st.m - mx).exp();
    st.l *= corr;
    for a in st.acc.iter_mut() {
        *a *= corr;
    }
    for (i, &sv) in scores.iter().enumerate() {
        let p = (sv - mx).exp();
        st.l += p;
        for (a, &vv) in st.acc.iter_mut().zip(&v[i * hd..(i + 1) * hd]) {
            *a += p * vv;
        }
    }
    st.m = mx;
}

/// Turns a row of scaled logits into softmax probabilities in place, given the row's maximum `m` and the inverse
/// of its exponential sum `inv_l` (the online softmax's final state): `p_i = exp(s_i - m) * inv_l`.
pub fn probs_from_logits(row: &mut [f32], m: f32, inv_l: f32) {
    for x in row.iter_mut() {
        *x = (*x - m).exp() * inv_l;
    }
}
