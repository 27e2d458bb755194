//! `cuda-bench`: achieved memory bandwidth of paged decode attention on the GPU (bytes of K and V read per second)
//! at contexts 1K–32K and batch sizes 1–64, next to a device-to-device copy for comparison.
//!
//! Run: `cargo run --release -p pagoda-kernels --features cuda --bin cuda-bench [-- --quick]`.
//! Synthetic cache (zeros; values do not change the work), llama-8B attention shape by default
//! (32 query heads, 8 kv-heads, head_dim 128, block 16); `--shape smollm2` uses 9/3 heads, head_dim 64.
//! `pagoda bench kernels --device cuda` runs the same measurement (`pagoda_kernels::cuda::bench`, feature `cuda`).

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
    use pagoda_kernels::attention_bench::{LLAMA_8B, SMOLLM2, markdown_table};
    use pagoda_kernels::cuda::{CudaContext, CudaError, bench};

    pub fn run() -> Result<(), CudaError> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let quick = args.iter().any(|a| a == "--quick");
        let shape = if args.windows(2).any(|w| w[0] == "--shape" && w[1] == "smollm2") { SMOLLM2 } else { LLAMA_8B };
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
        let copy_bw = bench::copy_bandwidth(&cx)?;
        println!("device-to-device copy: {:.0} GB/s (read + write, 1024 MiB)", copy_bw / 1e9);
        let contexts: &[usize] = if quick { &[1024, 32768] } else { &[1024, 2048, 4096, 8192, 16384, 32768] };
        let batches: &[usize] = if quick { &[1, 64] } else { &[1, 4, 16, 64] };
        println!(
            "\npaged decode attention, {} ({} q / {} kv heads, head_dim {}), block {}, f16 K/V",
            shape.name, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.block_size
        );
        let points = bench::decode_attention(&cx, &shape, batches, contexts)?;
        println!("{}", markdown_table(&points, copy_bw));
        Ok(())
    }
}
