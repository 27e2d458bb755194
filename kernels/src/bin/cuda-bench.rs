//! `cuda-bench`: achieved memory bandwidth of paged decode attention on the GPU (bytes of K and V read per second)
//! at contexts 1K–32K and batch sizes 1–64, next to a device-to-device copy for comparison.
//!
//! Run: `cargo run --release -p pagoda-kernels --features cuda --bin cuda-bench [-- --quick]`.
//! Synthetic cache (zeros; values do not change the work), llama-8B attention shape by default
//! (32 query heads, 8 kv-heads, head_dim 128, block 16); `--shape smollm2` uses 9/3 heads, head_dim 64.

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!(
        "cuda-bench needs the `cuda` feature: cargo run --release -p pagoda-kernels --features cuda --bin cuda-bench"
    );
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = bench::run() {
        eprintln!("cuda-bench: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
mod bench {
    use pagoda_kernels::AttnSeq;
    use pagoda_kernels::cuda::{CudaContext, CudaError, CudaKv};

    struct Shape {
        name: &'static str,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
        block_size: usize,
    }

    /// Seconds per call of `f`, timed with CUDA events over enough repetitions to fill ~`budget_ms`.
    fn time_it(
        cx: &CudaContext,
        budget_ms: f32,
        mut f: impl FnMut() -> Result<(), CudaError>,
    ) -> Result<f64, CudaError> {
        let drv = cx.driver();
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        for _ in 0..3 {
            f()?;
        }
        let (a, b) = (drv.new_event(flags)?, drv.new_event(flags)?);
        a.record(cx.stream())?;
        f()?;
        b.record(cx.stream())?;
        let one = a.elapsed_ms(&b)?.max(1e-3);
        let reps = ((budget_ms / one) as usize).clamp(5, 500);
        a.record(cx.stream())?;
        for _ in 0..reps {
            f()?;
        }
        b.record(cx.stream())?;
        Ok(f64::from(a.elapsed_ms(&b)?) / 1e3 / reps as f64)
    }

    pub fn run() -> Result<(), CudaError> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let quick = args.iter().any(|a| a == "--quick");
        let shape = if args.windows(2).any(|w| w[0] == "--shape" && w[1] == "smollm2") {
            Shape {
                name: "SmolLM2-135M (9 q / 3 kv heads, head_dim 64)",
                n_heads: 9,
                n_kv: 3,
                head_dim: 64,
                block_size: 16,
            }
        } else {
            Shape {
                name: "llama-8B (32 q / 8 kv heads, head_dim 128)",
                n_heads: 32,
                n_kv: 8,
                head_dim: 128,
                block_size: 16,
            }
        };
        let cx = CudaContext::new(0)?;
        let info = cx.info().clone();
        println!(
            "device: {} (sm_{}{}, {} SMs, {:.1} GiB), NVRTC {}.{}",
            info.name,
            info.compute_capability.0,
            info.compute_capability.1,
            info.sm_count,
            info.total_mem as f64 / (1u64 << 30) as f64,
            info.nvrtc.0,
            info.nvrtc.1
        );

        // Device-to-device copy: 1 GiB each way; bytes read + bytes written per second.
        let n = 1usize << 28;
        let src = cx.zeros::<f32>(n)?;
        let mut dst = cx.zeros::<f32>(n)?;
        let t = time_it(&cx, 200.0, || Ok(cx.stream().memcpy_dtod(&src, &mut dst)?))?;
        let copy_bw = 2.0 * (n * 4) as f64 / t;
        println!("device-to-device copy: {:.0} GB/s (read + write, {} MiB)", copy_bw / 1e9, (n * 4) >> 20);
        drop((src, dst));

        let contexts: &[usize] = if quick { &[1024, 32768] } else { &[1024, 2048, 4096, 8192, 16384, 32768] };
        let batches: &[usize] = if quick { &[1, 64] } else { &[1, 4, 16, 64] };
        let (bs, hd, nkv, nh) = (shape.block_size, shape.head_dim, shape.n_kv, shape.n_heads);
        let max_blocks =
            batches.iter().max().copied().unwrap_or(1) * nkv * contexts.iter().max().copied().unwrap_or(1) / bs;
        let kv = CudaKv::new(&cx, max_blocks, bs, hd)?;
        println!(
            "\npaged decode attention, {}, block {bs}, f16 K/V, {:.1} GiB arena per K and V",
            shape.name,
            kv.arena_bytes() as f64 / (1u64 << 30) as f64
        );
        println!("| batch | context | KV read (MiB) | time (µs) | bandwidth (GB/s) | % of copy | split |");
        println!("|---:|---:|---:|---:|---:|---:|---:|");
        // A fixed pseudo-random permutation of blocks, so tables are scattered like a real pool's.
        let perm: Vec<u32> = {
            let m = max_blocks as u64;
            let mut step = 7_919u64 % m.max(1);
            while step == 0 || gcd(step, m) != 1 {
                step += 1;
            }
            (0..m).map(|i| ((i * step + 13) % m) as u32).collect()
        };
        for &b in batches {
            for &ctx in contexts {
                let per = ctx / bs;
                let mut next = 0usize;
                let tables: Vec<Vec<Vec<u32>>> = (0..b)
                    .map(|_| {
                        (0..nkv)
                            .map(|_| {
                                let t = perm[next..next + per].to_vec();
                                next += per;
                                t
                            })
                            .collect()
                    })
                    .collect();
                let prior = vec![ctx - 1; nkv];
                let seqs: Vec<AttnSeq<'_>> =
                    (0..b).map(|i| AttnSeq { q_row: i, n_new: 1, tables: &tables[i], prior_lens: &prior }).collect();
                let q = cx.zeros::<f32>(b * nh * hd)?;
                let mut out = cx.zeros::<f32>(b * nh * hd)?;
                let mut plan = cx.plan_attention(&kv, &seqs, b, nh, nkv)?;
                let scale = 1.0 / (hd as f32).sqrt();
                let t = time_it(&cx, 100.0, || cx.run_attention(&mut plan, &q, &kv, scale, &mut out))?;
                let bytes = plan.decode_kv_bytes() as f64;
                let bw = bytes / t;
                println!(
                    "| {b} | {ctx} | {:.1} | {:.1} | {:.0} | {:.0}% | {} |",
                    bytes / (1u64 << 20) as f64,
                    t * 1e6,
                    bw / 1e9,
                    100.0 * bw / copy_bw,
                    plan.chunk()
                );
            }
        }
        Ok(())
    }

    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 { a } else { gcd(b, a % b) }
    }
}
