//! `pagoda bench kernels`: decode-attention bandwidth per KV format, batch size and context length, on the CPU
//! backend or (binaries built with `--features cuda`) the GPU, next to the machine's own copy bandwidth. The
//! measurements live in `pagoda_kernels::attention_bench` (CPU) and `pagoda_kernels::cuda::bench` (GPU); this
//! module owns the flags, the table and the JSON (the chart is `kernels_plot`).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use pagoda_kernels::CpuBackend;
use pagoda_kernels::attention_bench::{
    AttnBenchPoint, AttnBenchShape, KvFormat, cpu_copy_bandwidth, cpu_decode_attention, markdown_table,
};
use pagoda_worker::engine::Device;
use serde_json::json;

/// Most batch sizes or contexts one run takes, and their ranges (every input has a bound).
const MAX_POINTS: usize = 16;
const MAX_BATCH: usize = 256;
const MAX_CONTEXT: usize = 131_072;

#[derive(Args)]
pub struct BenchKernelsArgs {
    /// cpu, or cuda / cuda:N (binaries built with `--features cuda`).
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    device: Device,
    /// Attention shape: smollm2 (9 q / 3 kv heads of 64) or llama-8b (32 q / 8 kv heads of 128).
    #[arg(long, default_value = "smollm2", value_parser = parse_shape)]
    shape: AttnBenchShape,
    /// KV formats, comma-separated: f16 and f32 (the pool's arenas), pool:int8, pool:fp8_e4m3 and
    /// pool:fp8_e4m3_rotated (the pool's 8-bit dtypes), and the encoded codecs bf16, int8, fp8_e4m3, fp8_e4m3_rotated, int4_kivi, int2_kivi ("all" for every
    /// one). The GPU measures f16 and the encoded int8, fp8_e4m3, int4_kivi and int2_kivi.
    #[arg(long, value_delimiter = ',', default_value = "f16,int8,fp8_e4m3,int4_kivi,int2_kivi")]
    kv_formats: Vec<String>,
    /// Decode batch sizes (default: 1,8,32 on the CPU; 1,4,16,64 on the GPU).
    #[arg(long, value_delimiter = ',')]
    batches: Vec<usize>,
    /// Context lengths in tokens (default: 1024,4096,16384 on the CPU; 1K to 32K on the GPU).
    #[arg(long, value_delimiter = ',')]
    contexts: Vec<usize>,
    /// CPU threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Timing budget per point in milliseconds (the median of the runs inside it is reported).
    #[arg(long, default_value_t = 300, value_parser = clap::builder::RangedU64ValueParser::<u64>::new().range(1..=60_000))]
    budget_ms: u64,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw bandwidth against context, a panel per batch size and a line per format (PNG).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Measure nothing: print and draw (`--plot`) the report an earlier run wrote with `--json`, for example on a
    /// GPU machine that had no room for the chart.
    #[arg(long, conflicts_with_all = ["json", "kv_formats", "batches", "contexts"])]
    from_json: Option<PathBuf>,
}

/// Largest `--from-json` report read.
const MAX_REPORT_BYTES: u64 = 16 << 20;

/// The device name, copy bandwidth and points of a report written with `--json`.
fn read_report(path: &std::path::Path) -> Result<(String, String, f64, Vec<AttnBenchPoint>)> {
    let len = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?.len();
    if len > MAX_REPORT_BYTES {
        bail!("{} is {len} bytes, more than a report's {MAX_REPORT_BYTES}", path.display());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let field = |p: &serde_json::Value, k: &str| p.get(k).cloned().with_context(|| format!("report point lacks {k}"));
    let num = |p: &serde_json::Value, k: &str| -> Result<f64> {
        field(p, k)?.as_f64().with_context(|| format!("{k} is not a number"))
    };
    let device = v.get("device").and_then(|d| d.as_str()).context("report lacks device")?.to_owned();
    let shape = v.pointer("/shape/name").and_then(|d| d.as_str()).unwrap_or("?").to_owned();
    let copy = num(&v, "copy_bytes_per_s")?;
    let points = v
        .get("points")
        .and_then(|p| p.as_array())
        .context("report lacks points")?
        .iter()
        .map(|p| {
            Ok(AttnBenchPoint {
                format: field(p, "format")?.as_str().context("format is not a string")?.to_owned(),
                batch: num(p, "batch")? as usize,
                context: num(p, "context")? as usize,
                kv_bytes: num(p, "kv_bytes")? as usize,
                seconds: num(p, "seconds")?,
                bytes_per_s: num(p, "bytes_per_s")?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if !(copy.is_finite() && copy > 0.0) || points.is_empty() {
        bail!("{}: a report needs a positive copy bandwidth and at least one point", path.display());
    }
    Ok((device, shape, copy, points))
}

fn parse_shape(s: &str) -> Result<AttnBenchShape, String> {
    s.parse()
}

fn formats(names: &[String]) -> Result<Vec<KvFormat>> {
    if names.iter().any(|n| n == "all") {
        return Ok(KvFormat::ALL.to_vec());
    }
    if names.is_empty() || names.len() > KvFormat::ALL.len() {
        bail!("--kv-formats takes 1 to {} formats", KvFormat::ALL.len());
    }
    names.iter().map(|n| n.parse::<KvFormat>().map_err(anyhow::Error::msg).context("--kv-formats")).collect()
}

fn bounded(what: &str, values: Vec<usize>, default: &[usize], max: usize) -> Result<Vec<usize>> {
    let values = if values.is_empty() { default.to_vec() } else { values };
    if values.len() > MAX_POINTS {
        bail!("--{what} takes at most {MAX_POINTS} values");
    }
    if let Some(bad) = values.iter().find(|&&v| v == 0 || v > max) {
        bail!("--{what}: {bad} is outside 1..={max}");
    }
    Ok(values)
}

pub fn run(a: BenchKernelsArgs) -> Result<()> {
    if let Some(path) = &a.from_json {
        let (device, shape, copy_bw, points) = read_report(path)?;
        println!(
            "Decode attention on {device} (from {}): shape {shape}; memory copy {:.1} GB/s (read + write)\n\n{}",
            path.display(),
            copy_bw / 1e9,
            markdown_table(&points, copy_bw)
        );
        if let Some(plot) = &a.plot {
            crate::kernels_plot::draw_kernels(
                &points,
                copy_bw,
                &format!("Decode attention on {device}, {shape}"),
                plot,
            )?;
            eprintln!("wrote {}", plot.display());
        }
        return Ok(());
    }
    let formats = formats(&a.kv_formats)?;
    let gpu = a.device != Device::Cpu;
    let batches = bounded("batches", a.batches, if gpu { &[1, 4, 16, 64] } else { &[1, 8, 32] }, MAX_BATCH)?;
    let contexts = bounded(
        "contexts",
        a.contexts,
        if gpu { &[1024, 2048, 4096, 8192, 16384, 32768] } else { &[1024, 4096, 16384] },
        MAX_CONTEXT,
    )?;
    let budget_s = a.budget_ms as f64 / 1e3;
    let shape = a.shape;
    let (device_name, copy_bw, points) = match a.device {
        Device::Cpu => {
            let threads = pagoda_worker::engine::resolve_threads(a.threads);
            let be = CpuBackend::new(threads);
            let copy = cpu_copy_bandwidth(512 << 20, budget_s.max(0.5));
            let points = cpu_decode_attention(&be, &shape, &formats, &batches, &contexts, budget_s)
                .context("decode attention on the CPU")?;
            (format!("cpu ({threads} threads)"), copy, points)
        }
        Device::Cuda(ordinal) => gpu_points(ordinal, &shape, &formats, &batches, &contexts)?,
    };
    let md = format!(
        "Decode attention on {device_name}: shape {} ({} q / {} kv heads, head_dim {}, block {}); memory copy \
         {:.1} GB/s (read + write)\n\n{}",
        shape.name,
        shape.n_heads,
        shape.n_kv_heads,
        shape.head_dim,
        shape.block_size,
        copy_bw / 1e9,
        markdown_table(&points, copy_bw)
    );
    let report = json!({
        "device": device_name,
        "shape": {"name": shape.name, "n_heads": shape.n_heads, "n_kv_heads": shape.n_kv_heads,
                  "head_dim": shape.head_dim, "block_size": shape.block_size},
        "copy_bytes_per_s": copy_bw,
        "points": points.iter().map(|p| json!({
            "format": p.format, "batch": p.batch, "context": p.context, "kv_bytes": p.kv_bytes,
            "seconds": p.seconds, "bytes_per_s": p.bytes_per_s, "fraction_of_copy": p.bytes_per_s / copy_bw,
        })).collect::<Vec<_>>(),
    });
    crate::print_report(&md, &serde_json::to_string_pretty(&report)?, a.json.as_deref())?;
    if let Some(path) = &a.plot {
        let title = format!(
            "Decode attention on {device_name}, {} ({} q / {} kv heads, head_dim {})",
            shape.name, shape.n_heads, shape.n_kv_heads, shape.head_dim
        );
        crate::kernels_plot::draw_kernels(&points, copy_bw, &title, path)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn gpu_points(
    ordinal: usize,
    shape: &AttnBenchShape,
    formats: &[KvFormat],
    batches: &[usize],
    contexts: &[usize],
) -> Result<(String, f64, Vec<AttnBenchPoint>)> {
    use pagoda_kernels::KvDtype;
    use pagoda_kernels::cuda::codecs::GPU_CODECS;
    use pagoda_kernels::cuda::{CudaContext, bench};
    let on_gpu = |f: &KvFormat| match f {
        KvFormat::Pool(d) => *d == KvDtype::F16,
        KvFormat::Encoded(c) => GPU_CODECS.contains(c),
    };
    if let Some(f) = formats.iter().find(|f| !on_gpu(f)) {
        bail!(
            "the GPU kernels read the f16 pool and the int8, fp8_e4m3, int4_kivi and int2_kivi encodings; {} is \
             CPU-only",
            f.name()
        );
    }
    let cx = CudaContext::new(ordinal).with_context(|| format!("CUDA device {ordinal}"))?;
    let name = format!("cuda:{ordinal} ({})", cx.info().name);
    let copy = bench::copy_bandwidth(&cx)?;
    let mut points = Vec::new();
    for f in formats {
        points.extend(match *f {
            KvFormat::Pool(_) => bench::decode_attention(&cx, shape, batches, contexts)?,
            KvFormat::Encoded(c) => bench::decode_attention_encoded(&cx, shape, c, batches, contexts)?,
        });
    }
    Ok((name, copy, points))
}

#[cfg(not(feature = "cuda"))]
fn gpu_points(
    _: usize,
    _: &AttnBenchShape,
    _: &[KvFormat],
    _: &[usize],
    _: &[usize],
) -> Result<(String, f64, Vec<AttnBenchPoint>)> {
    bail!("this binary was built without the CUDA backend: rebuild with `--features cuda`")
}
