//! Min-of-N timings of the CPU kernels (robust on a shared machine): `cargo run --release -p pagoda-kernels
//! --example microbench [threads] [filter]`.

use pagoda_kernels::{AttnSeq, Backend, CpuBackend, KvDtype, KvStorage, QMatrix, Simd, WeightType};
use std::time::{Duration, Instant};

fn rand_vec(seed: &mut u64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Minimum wall time of `f` over repeated runs within ~`budget`.
fn min_time(budget: Duration, mut f: impl FnMut()) -> Duration {
    f();
    let start = Instant::now();
    let mut best = Duration::MAX;
    let mut runs = 0;
    while runs < 3 || (start.elapsed() < budget && runs < 100_000) {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
        runs += 1;
    }
    best
}

/// What one core sustains of 512-bit FMAs (12 independent chains, enough to cover their latency) and of 512-bit
/// loads from L1 (a 16 KiB buffer summed into 8 chains, 2 loads per add), per second: the ceilings the attention
/// and matmul kernels are measured against.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn peak_rates() -> (f64, f64) {
    use std::arch::x86_64::*;
    const FMA_ITERS: usize = 20_000_000;
    let (b, c) = (_mm512_set1_ps(0.999_9), _mm512_set1_ps(1e-4));
    let mut acc = [_mm512_set1_ps(0.5); 12];
    let t = Instant::now();
    for _ in 0..FMA_ITERS {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, b, c);
        }
    }
    let fma_rate = (FMA_ITERS * 12) as f64 / t.elapsed().as_secs_f64() / 1e9;
    std::hint::black_box(acc);
    const LOAD_PASSES: usize = 200_000;
    let buf = vec![1.0f32; 4096];
    let mut sum = [_mm512_setzero_ps(); 8];
    let t = Instant::now();
    for _ in 0..LOAD_PASSES {
        let p = std::hint::black_box(buf.as_ptr());
        for i in (0..4096).step_by(256) {
            for (k, s) in sum.iter_mut().enumerate() {
                // SAFETY: i + k * 32 + 32 <= 4096, the buffer's length.
                let (x0, x1) = unsafe { (_mm512_loadu_ps(p.add(i + k * 32)), _mm512_loadu_ps(p.add(i + k * 32 + 16))) };
                let x = _mm512_add_ps(x0, x1);
                *s = _mm512_add_ps(*s, x);
            }
        }
    }
    let load_rate = (LOAD_PASSES * 256) as f64 / t.elapsed().as_secs_f64() / 1e9;
    std::hint::black_box(sum);
    (fma_rate, load_rate)
}

/// What one core sustains of 512-bit `vpdpbusd` (12 independent chains), per second: the VNNI matmul's ceiling.
///
/// # Safety
/// The CPU must support AVX-512 F and VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn peak_dpbusd_rate() -> f64 {
    use std::arch::x86_64::*;
    const ITERS: usize = 20_000_000;
    let (a, b) = (_mm512_set1_epi8(3), _mm512_set1_epi8(5));
    let mut acc = [_mm512_setzero_si512(); 12];
    let t = Instant::now();
    for _ in 0..ITERS {
        for s in acc.iter_mut() {
            *s = _mm512_dpbusd_epi32(*s, a, b);
        }
    }
    let rate = (ITERS * 12) as f64 / t.elapsed().as_secs_f64() / 1e9;
    std::hint::black_box(acc);
    rate
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1);
    let filter = args.get(2).cloned().unwrap_or_default();
    let mut seed = 1u64;
    let bes = [
        ("scalar", CpuBackend::with_simd(threads, Simd::Scalar)),
        ("avx2", CpuBackend::with_simd(threads, Simd::Avx2)),
        ("avx512", CpuBackend::with_simd(threads, Simd::Avx512)),
    ];
    let budget = Duration::from_millis(600);
    for (ty, rows, cols) in [
        (WeightType::Q4_1, 576, 576),
        (WeightType::Q4_1, 1536, 576),
        (WeightType::Q4_1, 576, 1536),
        (WeightType::Q8_0, 49152, 576),
        (WeightType::Q8_0, 1536, 576),
        (WeightType::Q4_1, 49152, 576),
    ] {
        let w = QMatrix::quantize(ty, rows, cols, &rand_vec(&mut seed, rows * cols)).expect("quantize");
        for n in [1usize, 8, 32, 512] {
            let name = format!("matmul {ty:?} {rows}x{cols} n={n}");
            if !name.contains(&filter) {
                continue;
            }
            let x = rand_vec(&mut seed, n * cols);
            let mut out = vec![0.0; n * rows];
            let mut line = format!("{name:<48}");
            let mut times = vec![];
            for (label, be) in &bes {
                if *label == "scalar" && n * rows * cols > 100_000_000 {
                    continue;
                }
                let t = min_time(budget, || be.matmul(&w, &x, n, &mut out));
                let gmacs = (n * rows * cols) as f64 / t.as_secs_f64() / 1e9;
                line += &format!("  {label} {:>10.1?} ({gmacs:5.1} GMAC/s)", t);
                times.push(t);
            }
            if let [.., a, b] = times[..] {
                line += &format!("  x{:.2}", a.as_secs_f64() / b.as_secs_f64());
            }
            println!("{line}");
        }
    }
    #[cfg(target_arch = "x86_64")]
    if "peak".contains(&filter) && std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512 F was detected just above.
        let (fmas, loads) = unsafe { peak_rates() };
        println!("one core: {fmas:.2} G 512-bit FMAs/s, {loads:.2} G 512-bit L1 loads/s");
        if std::arch::is_x86_feature_detected!("avx512vnni") {
            // SAFETY: AVX-512 F and VNNI were detected.
            let dots = unsafe { peak_dpbusd_rate() };
            println!("one core: {dots:.2} G 512-bit vpdpbusd/s ({:.0} G int8 multiply-adds/s)", dots * 64.0);
        }
    }
    if "bandwidth".contains(&filter) || filter == "bw" {
        let v: Vec<u64> = (0..(96usize << 20) / 8).map(|i| i as u64).collect();
        let t = min_time(Duration::from_secs(2), || {
            let s: u64 = v.chunks(8).map(|c| c.iter().fold(0u64, |a, b| a ^ b)).fold(0, |a, b| a.wrapping_add(b));
            std::hint::black_box(s);
        });
        println!("read 96 MiB single thread: {:?} = {:.1} GB/s", t, 96.0 * 1.048576e6 / t.as_secs_f64() / 1e9);
    }
    // A whole SmolLM2-135M decode step's kernels (30 layers + Q8_0 output head), batch of `n` sequences.
    for n in [1usize, 32] {
        let name = format!("model step n={n}");
        if !name.contains(&filter) {
            continue;
        }
        let layers: Vec<[QMatrix; 7]> = (0..30)
            .map(|_| {
                [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)].map(|(r, c)| {
                    QMatrix::quantize(WeightType::Q4_1, r, c, &rand_vec(&mut seed, r * c)).expect("quantize")
                })
            })
            .collect();
        let head =
            QMatrix::quantize(WeightType::Q8_0, 49152, 576, &rand_vec(&mut seed, 49152 * 576)).expect("quantize");
        let x = rand_vec(&mut seed, n * 1536);
        let mut out = vec![0.0; n * 49152];
        let (label, be) = bes.last().expect("the scalar backend is always there");
        let t = min_time(Duration::from_secs(3), || {
            for l in &layers {
                for w in l {
                    be.matmul(w, &x[..n * w.cols()], n, &mut out[..n * w.rows()]);
                }
            }
            be.matmul(&head, &x[..n * 576], n, &mut out);
        });
        println!("{name:<34}  {label} {t:>10.1?}  => {:.0} tok/s (matmuls only)", n as f64 / t.as_secs_f64());
    }
    let (n_heads, n_kv, hd, bs) = (9usize, 3usize, 64usize, 16usize);
    // Block layouts: "interleaved" gives consecutive blocks of one table pages far apart (the worst case for the
    // hardware prefetcher); "contiguous" puts each table's blocks side by side, as a pool hands out a long prefill.
    let cases = [(512usize, 1usize, false), (4096, 1, false), (512, 32, false), (512, 32, true)];
    for ((ctx, batch, contiguous), dtype) in cases.into_iter().flat_map(|c| [(c, KvDtype::F32), (c, KvDtype::F16)]) {
        let layout = if contiguous { "contiguous" } else { "interleaved" };
        let name = format!("attn decode ctx={ctx} batch={batch} {layout} {dtype}");
        if !name.contains(&filter) {
            continue;
        }
        let per_head = (ctx + 1).div_ceil(bs);
        let num_blocks = per_head * n_kv * batch;
        let mut kv = KvStorage::with_dtype(num_blocks, bs, hd, dtype);
        let r = rand_vec(&mut seed, bs * hd);
        for b in 0..num_blocks as u32 {
            kv.write_block(b, &r, &r);
        }
        let block_id = |s: usize, h: usize, i: usize| -> u32 {
            let id = if contiguous { (s * n_kv + h) * per_head + i } else { i * n_kv * batch + s * n_kv + h };
            (id % num_blocks) as u32
        };
        let tables: Vec<Vec<Vec<u32>>> = (0..batch)
            .map(|s| (0..n_kv).map(|h| (0..per_head).map(|i| block_id(s, h, i)).collect()).collect())
            .collect();
        let prior = vec![ctx; n_kv];
        let seqs: Vec<AttnSeq<'_>> = tables
            .iter()
            .enumerate()
            .map(|(s, t)| AttnSeq { q_row: s, n_new: 1, tables: t, prior_lens: &prior })
            .collect();
        let q = rand_vec(&mut seed, batch * n_heads * hd);
        let mut out = vec![0.0; q.len()];
        let mut line = format!("{name:<48}");
        let mut times = vec![];
        for (label, be) in &bes {
            let t = min_time(budget, || be.paged_attention(&q, &kv, &seqs, n_heads, n_kv, 0.125, &mut out));
            line += &format!("  {label} {:>10.1?}", t);
            times.push(t);
        }
        line += &format!("  x{:.1}", times[0].as_secs_f64() / times[1].as_secs_f64());
        println!("{line}");
    }
}
