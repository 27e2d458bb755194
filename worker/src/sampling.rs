//! Token sampling: greedy (temperature 0), temperature, top-k and top-p (nucleus) over one logits row.
//!
//! Each request owns a [`Sampler`] with its own seeded RNG (`StdRng`, ChaCha12), so the same seed and the same
//! logits give the same tokens. The per-token work uses only a caller-provided [`SampleBuffer`] that is reused
//! across tokens and requests: no allocation per token once the buffer has grown to the vocabulary size.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Temperatures at or below this are treated as greedy.
pub const GREEDY_EPSILON: f32 = 1e-5;

/// How one request samples. `top_k == 0` and `top_p >= 1` disable those filters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub seed: Option<u64>,
}

impl SamplingParams {
    pub fn greedy() -> SamplingParams {
        SamplingParams { temperature: 0.0, top_p: 1.0, top_k: 0, seed: None }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= GREEDY_EPSILON || self.top_k == 1
    }
}

/// Scratch space shared by all samplers on one thread: `(probability or logit, token)` candidates.
#[derive(Debug, Default)]
pub struct SampleBuffer {
    cand: Vec<(f32, u32)>,
}

impl SampleBuffer {
    pub fn new() -> SampleBuffer {
        SampleBuffer::default()
    }

    pub fn with_capacity(vocab: usize) -> SampleBuffer {
        SampleBuffer { cand: Vec::with_capacity(vocab) }
    }
}

/// One request's sampler: its parameters and its RNG.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    /// A sampler seeded from `cfg.seed`, or from the OS when the request gives no seed.
    pub fn new(cfg: SamplingParams) -> Sampler {
        let rng = match cfg.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Sampler { cfg, rng }
    }

    pub fn config(&self) -> &SamplingParams {
        &self.cfg
    }

    /// Picks the next token from one row of logits. Returns 0 for an empty row.
    pub fn sample(&mut self, logits: &[f32], buf: &mut SampleBuffer) -> u32 {
        if logits.is_empty() {
            return 0;
        }
        if self.cfg.is_greedy() {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.cfg.temperature;
        let top_k = self.cfg.top_k as usize;
        let top_p = if self.cfg.top_p.is_finite() && self.cfg.top_p > 0.0 { self.cfg.top_p } else { 1.0 };
        let cand = &mut buf.cand;
        cand.clear();
        cand.extend(logits.iter().enumerate().map(|(i, &l)| (sanitize(l), i as u32)));

        // top-k: keep the k largest logits (unordered).
        if top_k > 0 && top_k < cand.len() {
            cand.select_nth_unstable_by(top_k - 1, desc);
            cand.truncate(top_k);
        }
        // softmax with temperature over the survivors.
        let max = cand.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.0));
        let mut sum = 0.0f64;
        for c in cand.iter_mut() {
            let p = ((c.0 - max) * inv_t).exp();
            c.0 = p;
            sum += p as f64;
        }
        if sum.is_nan() || sum <= 0.0 {
            return argmax(logits);
        }
        // top-p: smallest prefix (by probability) whose mass reaches top_p.
        let mut keep_mass = sum;
        if top_p < 1.0 {
            cand.sort_unstable_by(desc);
            let target = top_p as f64 * sum;
            let mut acc = 0.0f64;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.0 as f64;
                if acc >= target {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
            keep_mass = acc.min(sum);
        }
        let r = self.rng.random::<f64>() * keep_mass;
        let mut acc = 0.0f64;
        for c in cand.iter() {
            acc += c.0 as f64;
            if r < acc {
                return c.1;
            }
        }
        // Rounding left r at the very top: the last candidate with non-zero mass.
        cand.iter().rev().find(|c| c.0 > 0.0).map_or(cand[0].1, |c| c.1)
    }
}

/// Index of the largest logit; the lowest index wins ties; NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    // Two branch-free passes instead of one compare-and-branch loop: the maximum over eight lanes (which the
    // compiler vectorises; `f32::max` skips NaN), then the first index holding it. A greedy batch runs this over
    // every logits row of every step, so it is on the decode path.
    const LANES: usize = 8;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = m.max(v);
        }
    }
    let best_v = tail.iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if best_v == f32::NEG_INFINITY {
        // Nothing above -inf (or all NaN): the first token, as a strict `>` scan from -inf gives.
        return 0;
    }
    logits.iter().position(|&v| v == best_v).unwrap_or(0) as u32
}

#[inline]
fn sanitize(l: f32) -> f32 {
    if l.is_nan() { f32::NEG_INFINITY } else { l }
}

#[inline]
fn desc(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_p: f32, top_k: u32, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_p, top_k, seed: Some(seed) }
    }

    fn logits_from_probs(p: &[f32]) -> Vec<f32> {
        p.iter().map(|x| x.ln()).collect()
    }

    fn histogram(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<usize> {
        let mut buf = SampleBuffer::new();
        let mut h = vec![0usize; logits.len()];
        for _ in 0..n {
            h[s.sample(logits, &mut buf) as usize] += 1;
        }
        h
    }

    #[test]
    fn greedy_picks_argmax_and_first_on_ties() {
        let mut s = Sampler::new(SamplingParams::greedy());
        let mut buf = SampleBuffer::new();
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0], &mut buf), 1);
        assert_eq!(s.sample(&[f32::NAN, -5.0], &mut buf), 1);
        assert_eq!(argmax(&[2.0, 2.0]), 0);
        // top_k == 1 is greedy whatever the temperature.
        let mut s = Sampler::new(cfg(1.5, 1.0, 1, 3));
        for _ in 0..50 {
            assert_eq!(s.sample(&[0.0, 0.5, 0.4], &mut buf), 1);
        }
    }

    /// The two-pass argmax is the strict `>` scan: first index of the maximum, NaN skipped, 0 when nothing
    /// exceeds -inf, for lengths around the lane width.
    #[test]
    fn argmax_is_the_first_maximum_of_a_scan() {
        fn scan(l: &[f32]) -> u32 {
            let (mut best, mut best_v) = (0, f32::NEG_INFINITY);
            for (i, &v) in l.iter().enumerate() {
                if v > best_v {
                    (best, best_v) = (i, v);
                }
            }
            best as u32
        }
        let mut x = 12345u32;
        for len in [0usize, 1, 7, 8, 9, 15, 16, 17, 100, 49_152] {
            for case in 0..6 {
                let l: Vec<f32> = (0..len)
                    .map(|_| {
                        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                        match (case, x % 11) {
                            (0, _) => (x >> 8) as f32 / 1e6,
                            (1, 0) => f32::NAN,
                            (2, _) => ((x >> 8) % 5) as f32, // many ties
                            (3, _) => f32::NEG_INFINITY,
                            (4, 0) => f32::NAN,
                            (4, _) => f32::NEG_INFINITY,
                            (5, 0) => f32::INFINITY,
                            _ => -((x >> 8) as f32),
                        }
                    })
                    .collect();
                assert_eq!(argmax(&l), scan(&l), "len {len}, case {case}");
            }
        }
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 101) as f32 / 25.0).collect();
        let run = |seed| {
            let mut s = Sampler::new(cfg(1.0, 0.95, 50, seed));
            let mut buf = SampleBuffer::new();
            (0..64).map(|_| s.sample(&logits, &mut buf)).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn temperature_matches_softmax_statistically() {
        let probs = [0.5f32, 0.3, 0.15, 0.05];
        let logits = logits_from_probs(&probs);
        let n = 40_000;
        let h = histogram(&mut Sampler::new(cfg(1.0, 1.0, 0, 7)), &logits, n);
        for (i, &p) in probs.iter().enumerate() {
            let f = h[i] as f32 / n as f32;
            assert!((f - p).abs() < 0.015, "token {i}: freq {f} vs p {p}");
        }
        // Low temperature sharpens towards the argmax.
        let h = histogram(&mut Sampler::new(cfg(0.1, 1.0, 0, 7)), &logits, 2000);
        assert!(h[0] > 1950 && h[2] + h[3] == 0, "{h:?}");
    }

    #[test]
    fn top_k_support_and_ratios() {
        let probs = [0.05f32, 0.5, 0.15, 0.3];
        let logits = logits_from_probs(&probs);
        let n = 40_000;
        let h = histogram(&mut Sampler::new(cfg(1.0, 1.0, 2, 11)), &logits, n);
        assert_eq!(h[0], 0, "{h:?}");
        assert_eq!(h[2], 0, "{h:?}");
        let f1 = h[1] as f32 / n as f32;
        assert!((f1 - 0.5 / 0.8).abs() < 0.015, "{h:?}");
    }

    #[test]
    fn top_p_support_and_ratios() {
        let probs = [0.15f32, 0.05, 0.5, 0.3];
        let logits = logits_from_probs(&probs);
        let n = 40_000;
        // 0.5 < 0.6 <= 0.5 + 0.3: nucleus is {2, 3}.
        let h = histogram(&mut Sampler::new(cfg(1.0, 0.6, 0, 5)), &logits, n);
        assert_eq!(h[0] + h[1], 0, "{h:?}");
        let f2 = h[2] as f32 / n as f32;
        assert!((f2 - 0.5 / 0.8).abs() < 0.015, "{h:?}");
        // A tiny top_p keeps only the most likely token.
        let h = histogram(&mut Sampler::new(cfg(1.0, 0.01, 0, 5)), &logits, 1000);
        assert_eq!(h[2], 1000);
        // top-k and top-p compose: k=3 keeps {2,3,0}; p=0.9 of (0.5+0.3+0.15) keeps all three.
        let h = histogram(&mut Sampler::new(cfg(1.0, 0.9, 3, 5)), &logits, n);
        assert_eq!(h[1], 0);
        assert!(h[0] > 0 && h[2] > 0 && h[3] > 0, "{h:?}");
    }

    #[test]
    fn buffer_is_reused_without_growth() {
        let logits: Vec<f32> = (0..4096).map(|i| (i % 13) as f32).collect();
        let mut buf = SampleBuffer::with_capacity(logits.len());
        let cap = buf.cand.capacity();
        let mut s = Sampler::new(cfg(0.8, 0.9, 0, 1));
        for _ in 0..100 {
            s.sample(&logits, &mut buf);
        }
        assert_eq!(buf.cand.capacity(), cap);
    }
}
