//! Random fixtures shared by the kernels' integration tests (each test binary uses what it needs).

#![allow(dead_code)]

use rand::Rng;
use rand::rngs::StdRng;

/// `n` values drawn uniformly from `[-amp, amp)`.
pub fn rand_vec(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

/// `slots` keys of `head_dim` (at least 62) channels: small values (±0.3) but for two outlier channels, 60 in
/// 8..12 and 61 in -10..-6, as RoPE's low frequencies concentrate a real model's keys in a few channels.
pub fn outlier_channel_keys(rng: &mut StdRng, slots: usize, head_dim: usize) -> Vec<f32> {
    assert!(head_dim >= 62, "the outlier channels are 60 and 61");
    let mut k = rand_vec(rng, slots * head_dim, 0.3);
    for slot in 0..slots {
        k[slot * head_dim + 60] = rng.random_range(8.0..12.0);
        k[slot * head_dim + 61] = rng.random_range(-10.0..-6.0);
    }
    k
}
