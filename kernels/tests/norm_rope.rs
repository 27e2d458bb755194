//! RMSNorm, RoPE and SiLU·mul tests against direct formulas.

#![allow(clippy::needless_range_loop)]

mod common;

use common::rand_vec;
use pagoda_kernels::{Backend, CpuBackend, Simd};
use rand::SeedableRng;
use rand::rngs::StdRng;

fn backends() -> Vec<CpuBackend> {
    vec![CpuBackend::with_simd(1, Simd::Scalar), CpuBackend::with_simd(2, Simd::Avx2)]
}

#[test]
fn rmsnorm_matches_formula() {
    let mut rng = StdRng::seed_from_u64(20);
    for d in [1usize, 7, 8, 64, 576, 1000] {
        for n in [1usize, 3, 17] {
            let x = rand_vec(&mut rng, n * d, 4.0);
            let w = rand_vec(&mut rng, d, 2.0);
            for be in backends() {
                let mut out = vec![0.0; n * d];
                be.rmsnorm(&x, &w, 1e-5, &mut out);
                for i in 0..n {
                    let row = &x[i * d..(i + 1) * d];
                    let ms: f64 = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
                    let r = 1.0 / (ms + 1e-5).sqrt();
                    for j in 0..d {
                        let want = row[j] as f64 * r * w[j] as f64;
                        let got = out[i * d + j] as f64;
                        assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "{be:?} d={d}: {got} vs {want}");
                    }
                }
            }
        }
    }
}

#[test]
fn rope_matches_formula() {
    let mut rng = StdRng::seed_from_u64(21);
    for (n_heads, hd, theta) in [(9usize, 64usize, 100000.0f32), (3, 64, 10000.0), (2, 128, 500000.0), (4, 10, 10000.0)]
    {
        let positions: Vec<u32> = vec![0, 1, 2, 7, 100, 1023, 4097, 8191];
        let x = rand_vec(&mut rng, positions.len() * n_heads * hd, 1.0);
        let mut table = pagoda_kernels::RopeTable::new();
        table.fill(&positions, hd, theta);
        for be in backends() {
            let mut y = x.clone();
            be.rope(&mut y, &table, n_heads);
            for (r, &p) in positions.iter().enumerate() {
                for h in 0..n_heads {
                    let base = (r * n_heads + h) * hd;
                    for i in 0..hd / 2 {
                        let ang = p as f64 * (theta as f64).powf(-2.0 * i as f64 / hd as f64);
                        let (s, c) = ang.sin_cos();
                        let (a, b) = (x[base + 2 * i] as f64, x[base + 2 * i + 1] as f64);
                        let w0 = a * c - b * s;
                        let w1 = a * s + b * c;
                        assert!((y[base + 2 * i] as f64 - w0).abs() < 2e-5, "{be:?} pos {p} pair {i}");
                        assert!((y[base + 2 * i + 1] as f64 - w1).abs() < 2e-5, "{be:?} pos {p} pair {i}");
                    }
                }
            }
        }
    }
}

#[test]
fn silu_mul_matches_formula() {
    let mut rng = StdRng::seed_from_u64(22);
    for len in [1usize, 5, 8, 13, 1536, 3000] {
        let mut g = rand_vec(&mut rng, len, 12.0);
        g[0] = -100.0;
        if len > 1 {
            g[1] = 100.0;
        }
        let u = rand_vec(&mut rng, len, 3.0);
        for be in backends() {
            let mut out = g.clone();
            be.silu_mul(&mut out, &u);
            for i in 0..len {
                let x = g[i] as f64;
                let want = x / (1.0 + (-x).exp()) * u[i] as f64;
                assert!(
                    (out[i] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{be:?} silu({x})*{}: {}",
                    u[i],
                    out[i]
                );
            }
        }
    }
}

/// A prefill-sized gate goes to the pool in spans of whole 8-lane vectors: bit for bit what one thread computes,
/// at lengths on both sides of the cut and off the vector width.
#[test]
fn silu_mul_threads_do_not_change_the_result() {
    let mut rng = StdRng::seed_from_u64(23);
    for simd in [Simd::Scalar, Simd::Avx2] {
        let (one, many) = (CpuBackend::with_simd(1, simd), CpuBackend::with_simd(3, simd));
        for len in [65_535usize, 65_536, 65_541, 512 * 1536 + 3] {
            let g = rand_vec(&mut rng, len, 12.0);
            let u = rand_vec(&mut rng, len, 3.0);
            let (mut a, mut b) = (g.clone(), g);
            one.silu_mul(&mut a, &u);
            many.silu_mul(&mut b, &u);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&a) == bits(&b), "{simd:?} len {len}");
        }
    }
}

/// A prefill chunk's rows are normalised on the pool, whole rows to a task: bit for bit what one thread computes.
#[test]
fn rmsnorm_threads_do_not_change_the_result() {
    let mut rng = StdRng::seed_from_u64(24);
    for simd in [Simd::Scalar, Simd::Avx2] {
        let (one, many) = (CpuBackend::with_simd(1, simd), CpuBackend::with_simd(3, simd));
        for (n, d) in [(113usize, 576usize), (512, 576), (7, 10_000), (40, 1536)] {
            let x = rand_vec(&mut rng, n * d, 4.0);
            let w = rand_vec(&mut rng, d, 2.0);
            let (mut a, mut b) = (vec![0.0; n * d], vec![1.0; n * d]);
            one.rmsnorm(&x, &w, 1e-5, &mut a);
            many.rmsnorm(&x, &w, 1e-5, &mut b);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&a) == bits(&b), "{simd:?} {n} x {d}");
        }
    }
}
