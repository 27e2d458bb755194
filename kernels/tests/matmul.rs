//! Matmul, dequantisation and GGUF-loading tests against an f32 reference.

#![allow(clippy::needless_range_loop)]

mod common;

use common::rand_vec;
use pagoda_kernels::cpu::Bf16Kernel;
use pagoda_kernels::{Backend, CpuBackend, KernelError, QMatrix, Simd, WeightType};
use rand::SeedableRng;
use rand::rngs::StdRng;

const TYPES: [WeightType; 4] = [WeightType::F32, WeightType::F16, WeightType::Q4_1, WeightType::Q8_0];

fn backends() -> Vec<CpuBackend> {
    vec![
        CpuBackend::with_simd(1, Simd::Scalar),
        CpuBackend::with_simd(2, Simd::Scalar),
        CpuBackend::with_simd(1, Simd::Avx2),
        CpuBackend::with_simd(2, Simd::Avx2),
        CpuBackend::with_simd(3, Simd::Avx2),
        // Falls back to Avx2 (then Scalar) where the CPU lacks AVX-512 VNNI.
        CpuBackend::with_simd(1, Simd::Avx512),
        CpuBackend::with_simd(2, Simd::Avx512),
        CpuBackend::with_simd(3, Simd::Avx512),
    ]
}

/// Reference: dequantise every row and take f32 dot products; also returns an error bound per output from the
/// Q8_1 quantisation of x (|Δx| <= amax/254 per block) for quantised types.
fn reference(w: &QMatrix, x: &[f32], n: usize) -> (Vec<f32>, Vec<f32>) {
    let (rows, cols) = (w.rows(), w.cols());
    let mut out = vec![0.0; n * rows];
    let mut tol = vec![0.0; n * rows];
    let mut wr = vec![0.0; cols];
    let quant = matches!(w.weight_type(), WeightType::Q4_1 | WeightType::Q8_0);
    for r in 0..rows {
        w.dequantize_row(r, &mut wr);
        for i in 0..n {
            let xr = &x[i * cols..(i + 1) * cols];
            let mut s = 0.0f64;
            let mut bound = 0.0f64;
            let mut mag = 0.0f64;
            for b in 0..cols.div_ceil(32) {
                let lo = b * 32;
                let hi = (lo + 32).min(cols);
                let amax = xr[lo..hi].iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64;
                for j in lo..hi {
                    s += wr[j] as f64 * xr[j] as f64;
                    mag += (wr[j] as f64 * xr[j] as f64).abs();
                    if quant {
                        bound += (wr[j] as f64).abs() * amax / 254.0;
                    }
                }
            }
            out[i * rows + r] = s as f32;
            tol[i * rows + r] = (1.01 * bound + 1e-5 * mag + 1e-5) as f32;
        }
    }
    (out, tol)
}

/// `be`'s matmul of `w` by `x` (`n` rows) lies within `tol` of `want` (both from [`reference`]) everywhere.
fn assert_within_reference(be: &CpuBackend, w: &QMatrix, x: &[f32], n: usize, want: &[f32], tol: &[f32]) {
    let (ty, rows, cols) = (w.weight_type(), w.rows(), w.cols());
    let mut got = vec![f32::NAN; n * rows];
    be.matmul(w, x, n, &mut got);
    for k in 0..n * rows {
        assert!(
            (got[k] - want[k]).abs() <= tol[k],
            "{ty:?} {rows}x{cols} n={n} {be:?}: out[{k}] = {} want {} (tol {})",
            got[k],
            want[k],
            tol[k]
        );
    }
}

#[test]
fn matmul_matches_dequantised_reference() {
    let mut rng = StdRng::seed_from_u64(1);
    let shapes = [(1, 32), (5, 64), (13, 96), (37, 576), (64, 160), (130, 320)];
    for ty in TYPES {
        for &(rows, cols) in &shapes {
            let wv = rand_vec(&mut rng, rows * cols, 1.0);
            let w = QMatrix::quantize(ty, rows, cols, &wv).expect("quantize");
            for n in [1usize, 2, 3, 4, 5, 7, 8, 9, 17] {
                let mut x = rand_vec(&mut rng, n * cols, 2.0);
                // Some rows with a wide dynamic range and an all-zero block.
                if n > 2 {
                    x[cols] = 50.0;
                    x[..32].fill(0.0);
                }
                let (want, tol) = reference(&w, &x, n);
                for be in backends() {
                    assert_within_reference(&be, &w, &x, n, &want, &tol);
                }
            }
        }
    }
}

#[test]
fn fast_path_matches_scalar_path() {
    let mut rng = StdRng::seed_from_u64(2);
    let scalar = CpuBackend::with_simd(1, Simd::Scalar);
    // The same Q8_1 arithmetic on the best instruction set; the bf16 kernels round differently and are held to the
    // dequantised reference (bf16_matmuls_match_dequantised_reference).
    let fast = CpuBackend::new(2).with_bf16_matmuls(false);
    for ty in TYPES {
        for &(rows, cols, n) in &[(576, 576, 1), (203, 1536, 6), (96, 576, 33), (1000, 64, 64)] {
            let wv = rand_vec(&mut rng, rows * cols, 0.5);
            let w = QMatrix::quantize(ty, rows, cols, &wv).expect("quantize");
            let x = rand_vec(&mut rng, n * cols, 3.0);
            let mut a = vec![0.0; n * rows];
            let mut b = vec![0.0; n * rows];
            scalar.matmul(&w, &x, n, &mut a);
            fast.matmul(&w, &x, n, &mut b);
            for k in 0..n * rows {
                let tol = 1e-4 * (1.0 + a[k].abs()) + 2e-3;
                assert!((a[k] - b[k]).abs() <= tol, "{ty:?} {rows}x{cols} n={n}: {} vs {}", a[k], b[k]);
            }
        }
    }
}

/// A prefill-sized call quantises its activations on the pool (in runs of whole 4-row groups) and a decode-sized
/// one on the calling thread: the products are bit for bit those of one thread, at row counts on both sides of the
/// cut and off the 4-row groups, on every instruction set.
#[test]
fn threads_do_not_change_the_product() {
    let mut rng = StdRng::seed_from_u64(12);
    for simd in [Simd::Scalar, Simd::Avx2, Simd::Avx512] {
        let one = CpuBackend::with_simd(1, simd).with_bf16_matmuls(false);
        let many = CpuBackend::with_simd(3, simd).with_bf16_matmuls(false);
        for ty in TYPES {
            for &(rows, cols, n) in &[(64, 576, 63), (48, 576, 64), (64, 96, 65), (32, 1536, 130), (16, 64, 517)] {
                let wv = rand_vec(&mut rng, rows * cols, 0.5);
                let w = QMatrix::quantize(ty, rows, cols, &wv).expect("quantize");
                let x = rand_vec(&mut rng, n * cols, 3.0);
                let (mut a, mut b) = (vec![0.0; n * rows], vec![1.0; n * rows]);
                one.matmul(&w, &x, n, &mut a);
                many.matmul(&w, &x, n, &mut b);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(bits(&a) == bits(&b), "{simd:?} {ty:?} {rows}x{cols} n={n}");
            }
        }
    }
}

/// The AVX-512 VNNI Q4_1 and Q8_0 kernels (16-row groups, token tiles of up to 8, 4/2/1 groups per tile) against
/// the scalar path, over row counts that leave partial 16-row groups and token counts hitting every tile width and
/// remainder.
#[test]
fn avx512_matches_scalar_on_ragged_shapes() {
    let fast = CpuBackend::with_simd(1, Simd::Avx512);
    let fast2 = CpuBackend::with_simd(2, Simd::Avx512);
    if fast.simd() != Simd::Avx512 {
        eprintln!(
            "CPU lacks AVX-512 VNNI: the Avx512 backend fell back to {:?}, which this compares instead",
            fast.simd()
        );
    }
    let scalar = CpuBackend::with_simd(1, Simd::Scalar);
    let mut rng = StdRng::seed_from_u64(4);
    let shapes = [(1, 32), (15, 64), (16, 32), (17, 96), (47, 160), (64, 576), (100, 1536), (333, 576)];
    for (ty, &(rows, cols)) in
        [WeightType::Q4_1, WeightType::Q8_0].into_iter().flat_map(|t| shapes.iter().map(move |s| (t, s)))
    {
        let wv = rand_vec(&mut rng, rows * cols, 0.7);
        let w = QMatrix::quantize(ty, rows, cols, &wv).expect("quantize");
        for n in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 11, 16, 17, 31, 32, 35] {
            let mut x = rand_vec(&mut rng, n * cols, 2.5);
            x[..16].fill(0.0);
            let mut want = vec![0.0; n * rows];
            scalar.matmul(&w, &x, n, &mut want);
            for be in [&fast, &fast2] {
                let mut got = vec![f32::NAN; n * rows];
                be.matmul(&w, &x, n, &mut got);
                for k in 0..n * rows {
                    // Same integer dot products; only the f32 scale-and-accumulate order differs.
                    let tol = 2e-5 * (1.0 + want[k].abs()) + 1e-4;
                    assert!(
                        (got[k] - want[k]).abs() <= tol,
                        "{ty:?} {rows}x{cols} n={n} {be:?}: out[{k}] = {} want {}",
                        got[k],
                        want[k]
                    );
                }
            }
        }
    }
}

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

#[test]
fn dequantize_hand_built_blocks() {
    // Q4_1: d = 0.5, m = -1, nibble j = j % 16 in low half, 15 - j%16 in high half.
    let mut b = Vec::new();
    b.extend_from_slice(&f16_bytes(0.5));
    b.extend_from_slice(&f16_bytes(-1.0));
    for j in 0..16u8 {
        b.push(j | ((15 - j) << 4));
    }
    let w = QMatrix::from_gguf(WeightType::Q4_1, 1, 32, &b).expect("q4_1");
    let mut out = vec![0.0; 32];
    w.dequantize_row(0, &mut out);
    for j in 0..16 {
        assert_eq!(out[j], 0.5 * j as f32 - 1.0);
        assert_eq!(out[j + 16], 0.5 * (15 - j) as f32 - 1.0);
    }
    // Q8_0: d = 0.25, q = j - 16.
    let mut b = Vec::new();
    for row in 0..2 {
        b.extend_from_slice(&f16_bytes(0.25 * (row + 1) as f32));
        for j in 0..32i8 {
            b.push((j - 16) as u8);
        }
    }
    let w = QMatrix::from_gguf(WeightType::Q8_0, 2, 32, &b).expect("q8_0");
    w.dequantize_row(1, &mut out);
    for (j, &o) in out.iter().enumerate() {
        assert_eq!(o, 0.5 * (j as f32 - 16.0));
    }
    // F16 and F32.
    let vals = [1.5f32, -2.0, 0.125, 3.0];
    let b16: Vec<u8> = vals.iter().flat_map(|&v| f16_bytes(v)).collect();
    let w = QMatrix::from_gguf(WeightType::F16, 2, 2, &b16).expect("f16");
    let mut o2 = [0.0; 2];
    w.dequantize_row(1, &mut o2);
    assert_eq!(o2, [0.125, 3.0]);
    let b32: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let w = QMatrix::from_gguf(WeightType::F32, 2, 2, &b32).expect("f32");
    w.dequantize_row(0, &mut o2);
    assert_eq!(o2, [1.5, -2.0]);
    assert_eq!((w.rows(), w.cols()), (2, 2));
}

#[test]
fn from_gguf_rejects_bad_shapes() {
    assert!(matches!(
        QMatrix::from_gguf(WeightType::Q4_1, 1, 48, &[0; 30]),
        Err(KernelError::BadCols { cols: 48, block: 32, .. })
    ));
    assert!(matches!(
        QMatrix::from_gguf(WeightType::Q8_0, 2, 32, &[0; 67]),
        Err(KernelError::BadLength { expected: 68, got: 67, .. })
    ));
    assert!(matches!(QMatrix::from_gguf(WeightType::F32, 2, 3, &[0; 23]), Err(KernelError::BadLength { .. })));
    assert!(matches!(QMatrix::from_gguf(WeightType::F16, usize::MAX, 4, &[]), Err(KernelError::TooLarge { .. })));
    assert!(matches!(WeightType::from_ggml(2), Err(KernelError::UnsupportedType(2))));
    assert_eq!(WeightType::from_ggml(3), Ok(WeightType::Q4_1));
    assert!(QMatrix::from_gguf(WeightType::Q4_1, 0, 32, &[]).is_ok());
}

#[test]
fn embedding_reads_rows() {
    let mut rng = StdRng::seed_from_u64(3);
    for ty in TYPES {
        let (rows, cols) = (50, 64);
        let w = QMatrix::quantize(ty, rows, cols, &rand_vec(&mut rng, rows * cols, 1.0)).expect("quantize");
        let ids = [3u32, 49, 0, 3, 1000];
        let mut out = vec![1.0; ids.len() * cols];
        for be in backends() {
            be.embedding(&w, &ids, &mut out);
            let mut want = vec![0.0; cols];
            for (i, &id) in ids.iter().enumerate() {
                if (id as usize) < rows {
                    w.dequantize_row(id as usize, &mut want);
                } else {
                    want.fill(0.0);
                }
                assert_eq!(&out[i * cols..(i + 1) * cols], &want[..]);
            }
        }
    }
}

/// Median µs per call of `old` and `new` on `w` × `x` (`n` rows): `samples` samples of `reps` calls each,
/// alternating between the two so machine noise hits both alike.
fn time_side_by_side(
    old: &CpuBackend,
    new: &CpuBackend,
    w: &QMatrix,
    x: &[f32],
    n: usize,
    reps: usize,
    samples: usize,
) -> (f64, f64) {
    use std::time::Instant;
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut out = vec![0.0; n * w.rows()];
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    new.matmul(w, x, n, &mut out);
    for _ in 0..samples {
        for (be, t) in [(old, &mut ta), (new, &mut tb)] {
            let s = Instant::now();
            for _ in 0..reps {
                be.matmul(w, std::hint::black_box(x), n, &mut out);
            }
            t.push(s.elapsed().as_secs_f64() * 1e6 / reps as f64);
        }
    }
    (median(&mut ta), median(&mut tb))
}

/// Side-by-side timing of the Q4_1 (and the tied Q8_0 LM head's) matmul, AVX2 tiles vs AVX-512 VNNI over
/// repacked weights, at SmolLM2-135M shapes, 2 threads. Repetitions alternate between the two so machine noise hits both alike; prints medians and
/// the ratio. `cargo test --release -p pagoda-kernels --test matmul avx512_vs_avx2_speed -- --ignored --nocapture`
#[test]
#[ignore = "timing, not a check; run by hand"]
fn avx512_vs_avx2_speed() {
    let old = CpuBackend::with_simd(2, Simd::Avx2);
    let new = CpuBackend::with_simd(2, Simd::Avx512);
    if new.simd() != Simd::Avx512 {
        eprintln!("CPU lacks AVX-512 VNNI; nothing to compare");
        return;
    }
    let mut rng = StdRng::seed_from_u64(5);
    println!("{:>17} {:>3} {:>11} {:>11} {:>7}", "shape", "n", "avx2 us", "avx512 us", "ratio");
    let shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)];
    let cases = shapes.iter().map(|&s| (WeightType::Q4_1, s)).chain([(WeightType::Q8_0, (49152, 576))]);
    for (ty, (rows, cols)) in cases {
        let w = QMatrix::quantize(ty, rows, cols, &rand_vec(&mut rng, rows * cols, 1.0)).expect("q");
        for n in [1usize, 8, 32] {
            let x = rand_vec(&mut rng, n * cols, 1.0);
            // Enough calls per sample for ~2 ms of work at the old speed.
            let reps = (4_000_000_000 / (rows * cols * n * 60).max(1)).clamp(1, 2000);
            let (a, b) = time_side_by_side(&old, &new, &w, &x, n, reps, 15);
            println!("{:>17} {n:>3} {a:>11.1} {b:>11.1} {:>7.2}", format!("{ty:?} {rows}x{cols}"), a / b);
        }
    }
}

/// Both bf16 matmul kernels (AMX tiles, AVX-512 BF16 dot products), each where this CPU runs it, against the f64
/// reference over dequantised weights, held to the same bound as the Q8_1 kernels (bf16 rounding of weights and
/// activations stays inside it). Shapes leave partial 16-row weight groups, an odd group at the end of a task,
/// single token tiles (up to 16 rows), partial tiles and pairs, passes of 1-4 tokens and 1-4 groups, and chunks
/// split across 1 and 3 threads; one activation row spans a wide dynamic range and one block is all zeros.
#[test]
fn bf16_matmuls_match_dequantised_reference() {
    let kernels: Vec<CpuBackend> = [Bf16Kernel::Tiles, Bf16Kernel::Dot]
        .into_iter()
        .flat_map(|k| [1, 3].map(|t| CpuBackend::with_simd(t, Simd::Avx512).with_bf16_kernel(Some(k))))
        .filter(CpuBackend::bf16_matmuls)
        .collect();
    if kernels.is_empty() {
        eprintln!("skipped: this CPU has neither AMX bf16 tiles nor AVX-512 BF16");
        return;
    }
    let mut rng = StdRng::seed_from_u64(6);
    let shapes = [(16, 32), (17, 96), (47, 160), (64, 576), (100, 1536), (333, 576)];
    for (ty, &(rows, cols)) in
        [WeightType::Q4_1, WeightType::Q8_0].into_iter().flat_map(|t| shapes.iter().map(move |s| (t, s)))
    {
        let wv = rand_vec(&mut rng, rows * cols, 0.7);
        let w = QMatrix::quantize(ty, rows, cols, &wv).expect("quantize");
        for n in [1usize, 2, 7, 16, 17, 31, 32, 33, 47, 64, 130] {
            let mut x = rand_vec(&mut rng, n * cols, 2.0);
            if n > 1 {
                x[cols] = 60.0;
                x[..32].fill(0.0);
            }
            let (want, tol) = reference(&w, &x, n);
            for be in &kernels {
                assert_within_reference(be, &w, &x, n, &want, &tol);
            }
        }
    }
}

/// Side-by-side timing of the quantised matmul, AVX-512 VNNI vs each bf16 kernel this CPU runs (AMX tiles, AVX-512
/// BF16 dot products), at SmolLM2-135M shapes, 2 threads, repetitions alternated; prints medians and the ratio, from
/// one token (decode) to 512 (a prefill chunk).
/// `cargo test --release -p pagoda-kernels --test matmul bf16_vs_vnni_speed -- --ignored --nocapture`
#[test]
#[ignore = "timing, not a check; run by hand"]
fn bf16_vs_vnni_speed() {
    let old = CpuBackend::with_simd(2, Simd::Avx512);
    for kernel in [Bf16Kernel::Tiles, Bf16Kernel::Dot] {
        let new = CpuBackend::with_simd(2, Simd::Avx512).with_bf16_kernel(Some(kernel));
        if new.bf16_matmuls() {
            compare_with_vnni(&old, &new, &format!("{kernel:?} us"));
        } else {
            eprintln!("no {kernel:?} bf16 kernel on this CPU");
        }
    }
}

fn compare_with_vnni(old: &CpuBackend, new: &CpuBackend, label: &str) {
    let mut rng = StdRng::seed_from_u64(7);
    println!("{:>17} {:>4} {:>11} {:>11} {:>7}", "shape", "n", "vnni us", label, "ratio");
    for (rows, cols) in [(576, 576), (192, 576), (1536, 576), (576, 1536)] {
        let w = QMatrix::quantize(WeightType::Q4_1, rows, cols, &rand_vec(&mut rng, rows * cols, 1.0)).expect("q");
        for n in [1usize, 8, 32, 128, 512] {
            let x = rand_vec(&mut rng, n * cols, 1.0);
            let reps = (2_000_000_000 / (rows * cols * n * 20).max(1)).clamp(1, 2000);
            let (a, b) = time_side_by_side(old, new, &w, &x, n, reps, 11);
            println!("{:>17} {n:>4} {a:>11.1} {b:>11.1} {:>7.2}", format!("Q4_1 {rows}x{cols}"), a / b);
        }
    }
}

/// A layer's Q, K and V (and gate and up) in one call give bit for bit what one call per weight gives, on every
/// backend (the VNNI path quantises the activations once and runs every weight's rows as one job), with weights of
/// both quantised types, rows that are not a multiple of 16, batches from one row to a prefill chunk's, and on
/// one thread and on a pool. Widths that differ, and the float types, take the per-weight path.
#[test]
fn shared_input_matmul_equals_one_call_per_weight() {
    let mut rng = StdRng::seed_from_u64(11);
    let cols = 96;
    let shapes: [&[(WeightType, usize)]; 3] = [
        &[(WeightType::Q4_1, 64), (WeightType::Q4_1, 24), (WeightType::Q4_1, 24)],
        &[(WeightType::Q8_0, 48), (WeightType::Q4_1, 160)],
        &[(WeightType::F16, 40), (WeightType::Q4_1, 40)],
    ];
    for ws in shapes {
        let mats: Vec<QMatrix> = ws
            .iter()
            .map(|&(ty, rows)| QMatrix::quantize(ty, rows, cols, &rand_vec(&mut rng, rows * cols, 1.0)).expect("q"))
            .collect();
        let refs: Vec<&QMatrix> = mats.iter().collect();
        for n in [1usize, 3, 8, 37, 200] {
            let x = rand_vec(&mut rng, n * cols, 2.0);
            for be in backends() {
                let mut fused: Vec<Vec<f32>> = mats.iter().map(|w| vec![f32::NAN; n * w.rows()]).collect();
                let mut outs: Vec<&mut [f32]> = fused.iter_mut().map(|o| &mut o[..]).collect();
                be.matmul_shared_input(&refs, &x, n, &mut outs);
                for (w, got) in mats.iter().zip(&fused) {
                    let mut want = vec![0.0; n * w.rows()];
                    be.matmul(w, &x, n, &mut want);
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{} {ws:?} n={n}: fused and per-weight results differ", be.name());
                }
            }
        }
    }
    // A width that differs from the first weight's goes weight by weight too.
    let (a, b) = (
        QMatrix::quantize(WeightType::Q4_1, 32, 64, &rand_vec(&mut rng, 32 * 64, 1.0)).expect("q"),
        QMatrix::quantize(WeightType::Q4_1, 32, 128, &rand_vec(&mut rng, 32 * 128, 1.0)).expect("q"),
    );
    let be = CpuBackend::with_simd(2, Simd::Avx512);
    let x = rand_vec(&mut rng, 64, 1.0);
    let (mut out_a, mut out_b) = ([0.0; 32], [0.0; 32]);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        be.matmul_shared_input(&[&a, &b], &x, 1, &mut [&mut out_a[..], &mut out_b[..]])
    }));
    assert!(r.is_err(), "a weight wider than x must be refused, as matmul refuses it");
}
