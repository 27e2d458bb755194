//! Query-aware rounding of rotated fp8 keys: which e4m3 code each key element gets, so that the error the keys
//! carry into attention scores is small for the queries the model actually asks.
//!
//! Round-to-nearest makes each element's error as small as it can be alone. A score is `q · k`, though, and the
//! model's queries are far from isotropic: a few directions carry most of their energy. GPTQ (Frantar et al.,
//! 2023) rounds the columns of a weight matrix one at a time and pushes each rounding error onto the columns not yet
//! rounded, weighted by the inverse of the inputs' second-moment matrix, so the output error lands where the inputs
//! are weak. Here the "weights" are one key row and the "inputs" the queries: each element of a rotated key is
//! rounded in turn and its error moved onto the elements after it through the upper Cholesky factor of
//! `(R M R + λI)⁻¹`, `M` the post-RoPE queries' second moment for that layer and kv head, `R` the Hadamard rotation
//! the codec applies to keys, `λ` 1% of the mean diagonal (GPTQ's damping).
//!
//! Only the encoder changes: the bytes are `fp8_e4m3_rotated`'s (one scale per block and head, codes, the same
//! rotation) and every decoder and attention kernel reads them as before. [`QueryMoments`] accumulates `M` from
//! captured queries; [`KeyRounding`] holds the factor for one layer and kv head.

use crate::codec::{CodecError, MAX_HEAD_DIM, e4m3_from_f32, e4m3_to_f32, hadamard_rotate};

/// GPTQ's damping: this fraction of the mean diagonal is added before inverting.
const DAMPING: f64 = 0.01;

/// Sums of `q qᵀ` over the post-RoPE queries of one layer and kv head (every query head of its group).
#[derive(Debug, Clone, PartialEq)]
pub struct QueryMoments {
    head_dim: usize,
    sums: Vec<f64>,
    rows: u64,
}

impl QueryMoments {
    pub fn new(head_dim: usize) -> QueryMoments {
        QueryMoments { head_dim, sums: vec![0.0; head_dim * head_dim], rows: 0 }
    }

    /// Adds query vectors of `head_dim` floats each, one after another.
    pub fn add(&mut self, queries: &[f32]) {
        let hd = self.head_dim;
        for q in queries.chunks_exact(hd) {
            for (i, &a) in q.iter().enumerate() {
                let row = &mut self.sums[i * hd..(i + 1) * hd];
                let a = f64::from(a);
                row.iter_mut().zip(q).for_each(|(s, &b)| *s += a * f64::from(b));
            }
            self.rows += 1;
        }
    }

    /// Query vectors added so far.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// The moments of the same queries had they come `offset` positions later, summed over `offsets`: llama's
    /// RoPE (adjacent pairs, base `theta`) turns pair `i` of a query by `offset · θ^(-2i/head_dim)` more, so each
    /// 2×2 block of the sums turns with its two pairs. A short calibration text then stands for queries at every
    /// position a context reaches, which matters for the slow pairs: over a few hundred positions they barely turn.
    pub fn spread_over_positions(&self, theta: f32, offsets: impl IntoIterator<Item = u32>) -> QueryMoments {
        let hd = self.head_dim;
        let mut out = QueryMoments { head_dim: hd, sums: vec![0.0; hd * hd], rows: 0 };
        let mut turned = self.sums.clone();
        for offset in offsets {
            let turns: Vec<(f64, f64)> = (0..hd / 2)
                .map(|i| (f64::from(offset) * f64::from(theta).powf(-2.0 * i as f64 / hd as f64)).sin_cos())
                .collect();
            turned.copy_from_slice(&self.sums);
            // R M Rᵀ: turn every column's pairs, then every row's.
            for columns in [true, false] {
                for line in 0..hd {
                    for (i, &(sin, cos)) in turns.iter().enumerate() {
                        let at = |e: usize| if columns { e * hd + line } else { line * hd + e };
                        let (a, b) = (turned[at(2 * i)], turned[at(2 * i + 1)]);
                        turned[at(2 * i)] = a * cos - b * sin;
                        turned[at(2 * i + 1)] = a * sin + b * cos;
                    }
                }
            }
            out.sums.iter_mut().zip(&turned).for_each(|(o, t)| *o += t);
            out.rows += self.rows;
        }
        out
    }
}

/// The rounding order's weights for one layer and kv head: the upper Cholesky factor `U` of the damped, rotated
/// inverse query moment (`(R M R + λI)⁻¹ = Uᵀ U`), `head_dim × head_dim`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRounding {
    head_dim: usize,
    factor: Vec<f32>,
}

impl KeyRounding {
    /// The factor for queries with moments `m`. Fails when `m` holds no query, or nothing finite.
    pub fn from_moments(m: &QueryMoments) -> Result<KeyRounding, CodecError> {
        let hd = m.head_dim;
        let bad = |reason| CodecError::BadKeyRounding { head_dim: hd, reason };
        if hd == 0 || hd > MAX_HEAD_DIM {
            return Err(bad("head_dim out of range"));
        }
        if m.rows == 0 || m.sums.iter().any(|v| !v.is_finite()) {
            return Err(bad("query moments hold no finite queries"));
        }
        let rotated = rotate_both_sides(&m.sums, hd);
        let mean_diag = (0..hd).map(|i| rotated[i * hd + i]).sum::<f64>() / hd as f64;
        if mean_diag.is_nan() || mean_diag <= 0.0 {
            return Err(bad("query moments are zero"));
        }
        let mut h = rotated;
        for i in 0..hd {
            h[i * hd + i] += DAMPING * mean_diag;
        }
        let inverse = spd_inverse(h, hd);
        let factor = upper_cholesky(&inverse, hd).into_iter().map(|v| v as f32).collect();
        Ok(KeyRounding { head_dim: hd, factor })
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Rounds rotated key row `y` (`head_dim` floats, overwritten as scratch) to e4m3 codes of `y / scale`.
    pub(crate) fn round_row(&self, y: &mut [f32], scale: f32, codes: &mut [u8]) {
        let hd = self.head_dim;
        for j in 0..hd {
            let code = e4m3_from_f32(y[j] / scale);
            codes[j] = code;
            let u = &self.factor[j * hd..(j + 1) * hd];
            let err = (y[j] - e4m3_to_f32(code) * scale) / u[j];
            y[j + 1..].iter_mut().zip(&u[j + 1..]).for_each(|(v, &w)| *v -= err * w);
        }
    }
}

/// `R A R` for the symmetric Hadamard rotation `R` of [`hadamard_rotate`].
fn rotate_both_sides(a: &[f64], hd: usize) -> Vec<f64> {
    let mut out = a.to_vec();
    let mut line = vec![0.0f32; hd];
    for columns in [false, true] {
        for i in 0..hd {
            let at = |j: usize| if columns { j * hd + i } else { i * hd + j };
            line.iter_mut().enumerate().for_each(|(j, v)| *v = out[at(j)] as f32);
            hadamard_rotate(&mut line);
            line.iter().enumerate().for_each(|(j, &v)| out[at(j)] = f64::from(v));
        }
    }
    out
}

/// The inverse of a symmetric positive definite matrix, by Gauss-Jordan elimination (the damping keeps the pivots
/// positive).
fn spd_inverse(mut a: Vec<f64>, n: usize) -> Vec<f64> {
    let mut inv = vec![0.0f64; n * n];
    (0..n).for_each(|i| inv[i * n + i] = 1.0);
    for c in 0..n {
        let p = a[c * n + c];
        for j in 0..n {
            a[c * n + j] /= p;
            inv[c * n + j] /= p;
        }
        for r in (0..n).filter(|&r| r != c) {
            let f = a[r * n + c];
            if f != 0.0 {
                for j in 0..n {
                    a[r * n + j] -= f * a[c * n + j];
                    inv[r * n + j] -= f * inv[c * n + j];
                }
            }
        }
    }
    inv
}

/// `U` with `a = Uᵀ U`, upper triangular.
fn upper_cholesky(a: &[f64], n: usize) -> Vec<f64> {
    let mut u = vec![0.0f64; n * n];
    for i in 0..n {
        let d = (a[i * n + i] - (0..i).map(|k| u[k * n + i] * u[k * n + i]).sum::<f64>()).max(f64::MIN_POSITIVE);
        let d = d.sqrt();
        u[i * n + i] = d;
        for j in i + 1..n {
            u[i * n + j] = (a[i * n + j] - (0..i).map(|k| u[k * n + i] * u[k * n + j]).sum::<f64>()) / d;
        }
    }
    u
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Codec;
    use crate::codec::decode_block;

    /// A deterministic generator (no test depends on a crate's RNG stream).
    struct Lcg(u64);
    impl Lcg {
        fn normal(&mut self) -> f32 {
            let mut u = || {
                self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
            };
            let (a, b) = (u(), u());
            ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
        }
    }

    const HD: usize = 64;
    const BS: usize = 16;

    /// Queries whose energy falls off with the channel (as RoPE'd llama queries' does, a few pairs carrying most).
    fn queries(rng: &mut Lcg, n: usize) -> Vec<f32> {
        (0..n * HD).map(|i| rng.normal() * 4.0 * 0.8f32.powi((i % HD) as i32 / 2)).collect()
    }

    fn encode(k: &[f32], v: &[f32], keys: Option<&KeyRounding>) -> Vec<f32> {
        let codec = Codec::Fp8E4m3Rotated;
        let mut bytes = vec![0u8; codec.encoded_len(BS, HD).unwrap()];
        codec.encode_block_with(BS, HD, k, v, &mut bytes, keys).unwrap();
        let (mut dk, mut dv) = (vec![0.0; BS * HD], vec![0.0; BS * HD]);
        decode_block(&bytes, &mut dk, &mut dv).unwrap();
        dk
    }

    fn score_error(keys: &[f32], decoded: &[f32], qs: &[f32]) -> f64 {
        let mut sum = 0.0;
        for q in qs.chunks_exact(HD) {
            for (k, d) in keys.chunks_exact(HD).zip(decoded.chunks_exact(HD)) {
                let e: f32 = q.iter().zip(k.iter().zip(d)).map(|(q, (k, d))| q * (d - k)).sum();
                sum += f64::from(e * e);
            }
        }
        sum
    }

    #[test]
    fn isotropic_queries_round_to_nearest() {
        let mut rng = Lcg(1);
        let k: Vec<f32> = (0..BS * HD).map(|_| rng.normal()).collect();
        let v: Vec<f32> = (0..BS * HD).map(|_| rng.normal()).collect();
        let mut m = QueryMoments::new(HD);
        let mut eye = vec![0.0f32; HD * HD];
        (0..HD).for_each(|i| eye[i * HD + i] = 1.0);
        m.add(&eye);
        let r = KeyRounding::from_moments(&m).unwrap();
        let codec = Codec::Fp8E4m3Rotated;
        let mut plain = vec![0u8; codec.encoded_len(BS, HD).unwrap()];
        let mut rounded = plain.clone();
        codec.encode_block(BS, HD, &k, &v, &mut plain).unwrap();
        codec.encode_block_with(BS, HD, &k, &v, &mut rounded, Some(&r)).unwrap();
        assert_eq!(plain, rounded, "no direction to prefer: every element rounds to its nearest code");
    }

    #[test]
    fn rounding_for_the_queries_lowers_their_score_error() {
        let mut rng = Lcg(7);
        let mut m = QueryMoments::new(HD);
        m.add(&queries(&mut rng, 4096));
        assert_eq!(m.rows(), 4096);
        let r = KeyRounding::from_moments(&m).unwrap();
        let held_out = queries(&mut rng, 256);
        let (mut nearest, mut aware) = (0.0, 0.0);
        for _ in 0..8 {
            let k: Vec<f32> = (0..BS * HD).map(|i| rng.normal() * (1.0 + (i % HD) as f32 / 16.0)).collect();
            let v = vec![0.0f32; BS * HD];
            nearest += score_error(&k, &encode(&k, &v, None), &held_out);
            aware += score_error(&k, &encode(&k, &v, Some(&r)), &held_out);
        }
        assert!(aware < 0.7 * nearest, "query-aware {aware:.4} against round-to-nearest {nearest:.4}");
    }

    #[test]
    fn spreading_over_positions_matches_queries_turned_by_rope() {
        let mut rng = Lcg(3);
        let qs = queries(&mut rng, 32);
        let mut m = QueryMoments::new(HD);
        m.add(&qs);
        let offsets = [0u32, 100, 2500];
        let spread = m.spread_over_positions(10_000.0, offsets);
        // The same queries through the kernels' own RoPE at each offset.
        let mut direct = QueryMoments::new(HD);
        let mut table = crate::RopeTable::new();
        for &o in &offsets {
            table.fill(&[o], HD, 10_000.0);
            let (cc, ss) = table.row(0);
            for q in qs.chunks_exact(HD) {
                let mut t = q.to_vec();
                crate::cpu::scalar::rope_head(&mut t, cc, ss);
                direct.add(&t);
            }
        }
        assert_eq!(spread.rows(), direct.rows());
        let scale = direct.sums.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (a, b) in spread.sums.iter().zip(&direct.sums) {
            assert!((a - b).abs() <= 1e-5 * scale, "{a} against {b}");
        }
    }

    #[test]
    fn moments_without_queries_are_refused() {
        assert!(KeyRounding::from_moments(&QueryMoments::new(HD)).is_err());
        let mut zero = QueryMoments::new(HD);
        zero.add(&[0.0; HD]);
        assert!(KeyRounding::from_moments(&zero).is_err());
        let mut inf = QueryMoments::new(HD);
        inf.add(&[f32::INFINITY; HD]);
        assert!(KeyRounding::from_moments(&inf).is_err());
        assert!(KeyRounding::from_moments(&QueryMoments::new(MAX_HEAD_DIM + 1)).is_err());
        let mut m = QueryMoments::new(HD);
        m.add(&queries(&mut Lcg(5), 8));
        let r = KeyRounding::from_moments(&m).unwrap();
        let (k, v) = (vec![0.5f32; BS * 32], vec![0.5f32; BS * 32]);
        let mut out = vec![0u8; Codec::Fp8E4m3Rotated.encoded_len(BS, 32).unwrap()];
        let err = Codec::Fp8E4m3Rotated.encode_block_with(BS, 32, &k, &v, &mut out, Some(&r)).unwrap_err();
        assert_eq!(err, CodecError::BadKeyRounding { head_dim: HD, reason: "made for another head_dim" });
    }
}
