//! Decode-attention bandwidth, the measurement behind `pagoda bench kernels`: bytes of K and V that one paged
//! decode step reads per second, per KV format, over batch sizes and context lengths, next to a plain memory copy
//! on the same machine as the ceiling. This module owns the shapes, the formats, the scattered block tables and the
//! CPU measurement; the GPU one is `crate::cuda::bench` (feature `cuda`), over the same [`AttnBenchShape`]s.
//!
//! Each (format, batch, context) point runs a decode step of `batch` sequences, each at `context` cached slots per
//! kv-head, over blocks scattered through an arena the size of the largest point (so nothing is served from a
//! cache the previous point warmed), and reports the median of repeated timings.

use std::time::Instant;

use crate::codec::{Codec, CodecError, EncodedKv};
use crate::paged::{AttnSeq, KvDtype, KvStorage};
use crate::{Backend, CpuBackend};

/// The attention shape of a model: query and kv heads, head width, block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnBenchShape {
    pub name: &'static str,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// SmolLM2-135M: 9 query / 3 kv heads of 64.
pub const SMOLLM2: AttnBenchShape =
    AttnBenchShape { name: "smollm2", n_heads: 9, n_kv_heads: 3, head_dim: 64, block_size: 16 };
/// Llama 3.1 8B: 32 query / 8 kv heads of 128.
pub const LLAMA_8B: AttnBenchShape =
    AttnBenchShape { name: "llama-8b", n_heads: 32, n_kv_heads: 8, head_dim: 128, block_size: 16 };

impl std::str::FromStr for AttnBenchShape {
    type Err = String;

    fn from_str(s: &str) -> Result<AttnBenchShape, String> {
        [SMOLLM2, LLAMA_8B]
            .into_iter()
            .find(|sh| sh.name.eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| format!("attention shape {s:?}: expected smollm2 or llama-8b"))
    }
}

/// How the cache under test stores K and V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvFormat {
    /// The device pool's own arenas ([`KvStorage`]): f16, f32, or 8-bit with a scale per slot.
    Pool(KvDtype),
    /// Encoded blocks ([`EncodedKv`]) read by the dequantise-on-load kernel.
    Encoded(Codec),
}

impl KvFormat {
    /// Every format `pagoda bench kernels` measures ("all").
    pub const ALL: [KvFormat; 11] = [
        KvFormat::Pool(KvDtype::F16),
        KvFormat::Pool(KvDtype::F32),
        KvFormat::Pool(KvDtype::Int8),
        KvFormat::Pool(KvDtype::Fp8),
        KvFormat::Pool(KvDtype::Fp8Rotated),
        KvFormat::Encoded(Codec::Bf16),
        KvFormat::Encoded(Codec::Int8),
        KvFormat::Encoded(Codec::Fp8E4m3),
        KvFormat::Encoded(Codec::Fp8E4m3Rotated),
        KvFormat::Encoded(Codec::Int4Kivi),
        KvFormat::Encoded(Codec::Int2Kivi),
    ];

    /// `f16`, `f32` and the pool's 8-bit dtypes as `pool:int8` / `pool:fp8_e4m3` / `pool:fp8_e4m3_rotated`; every
    /// codec by its name.
    pub fn name(self) -> String {
        match self {
            KvFormat::Pool(d @ (KvDtype::F16 | KvDtype::F32)) => d.name().to_string(),
            KvFormat::Pool(d) => format!("pool:{}", d.name()),
            KvFormat::Encoded(c) => c.name().to_string(),
        }
    }

    /// Bytes of K and V one block of `shape` holds in this format (what a decode step reads per visible block).
    pub fn block_bytes(self, shape: &AttnBenchShape) -> Result<usize, CodecError> {
        Ok(match self {
            KvFormat::Pool(d) => 2 * shape.block_size * d.slot_bytes(shape.head_dim),
            KvFormat::Encoded(c) => c.encoded_len(shape.block_size, shape.head_dim)?,
        })
    }
}

impl std::str::FromStr for KvFormat {
    type Err = String;

    /// `f16` and `f32` are the pool's arenas; `pool:int8` / `pool:fp8_e4m3` its 8-bit dtypes; any other codec name
    /// (`bf16`, `int8`, `fp8_e4m3`, `int4_kivi`, `int2_kivi`) is an encoded arena.
    fn from_str(s: &str) -> Result<KvFormat, String> {
        let s = s.trim();
        if let Some(dtype) = s.strip_prefix("pool:") {
            return Ok(KvFormat::Pool(dtype.parse()?));
        }
        match s {
            "f16" => Ok(KvFormat::Pool(KvDtype::F16)),
            "f32" => Ok(KvFormat::Pool(KvDtype::F32)),
            other => other.parse::<Codec>().map(KvFormat::Encoded).map_err(|e| e.to_string()),
        }
    }
}

/// One measured point.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnBenchPoint {
    pub format: String,
    pub batch: usize,
    pub context: usize,
    /// Bytes of K and V the step reads (every visible block, K and V, once per kv-head).
    pub kv_bytes: usize,
    /// Median seconds per decode step.
    pub seconds: f64,
    /// `kv_bytes / seconds`.
    pub bytes_per_s: f64,
}

/// The points as a markdown table, bandwidth also as a fraction of `copy_bytes_per_s`.
pub fn markdown_table(points: &[AttnBenchPoint], copy_bytes_per_s: f64) -> String {
    let mut md = String::from(
        "| format | batch | context | KV read (MiB) | time (µs) | GB/s | % of copy |\n|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in points {
        md.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.0}% |\n",
            p.format,
            p.batch,
            p.context,
            p.kv_bytes as f64 / (1u64 << 20) as f64,
            p.seconds * 1e6,
            p.bytes_per_s / 1e9,
            100.0 * p.bytes_per_s / copy_bytes_per_s
        ));
    }
    md
}

/// Blocks of the arena the grid's largest point reads (every point's tables fit in it).
pub fn arena_blocks(shape: &AttnBenchShape, batches: &[usize], contexts: &[usize]) -> usize {
    batches.iter().max().copied().unwrap_or(1)
        * shape.n_kv_heads
        * contexts.iter().max().copied().unwrap_or(1).div_ceil(shape.block_size)
}

/// The decode step of one point: sequence `i` is query row `i`, one new token after `prior[h]` cached slots.
pub fn decode_seqs<'a>(tables: &'a [Vec<Vec<u32>>], prior: &'a [usize]) -> Vec<AttnSeq<'a>> {
    tables.iter().enumerate().map(|(i, t)| AttnSeq { q_row: i, n_new: 1, tables: t, prior_lens: prior }).collect()
}

/// Block tables of `batch` sequences × `n_kv_heads` heads × `⌈context / block_size⌉` blocks, all distinct, drawn
/// from a fixed scattered permutation of the arena's `arena_blocks` block ids (at least as many as the tables
/// need), so that consecutive blocks of a table are far apart, as in a pool that has been running for a while.
pub fn scattered_tables(
    shape: &AttnBenchShape,
    batch: usize,
    context: usize,
    arena_blocks: usize,
) -> Vec<Vec<Vec<u32>>> {
    let per = context.div_ceil(shape.block_size);
    let m = arena_blocks.max(batch * shape.n_kv_heads * per).max(1) as u64;
    let mut step = 7_919u64 % m;
    while m > 1 && (step == 0 || gcd(step, m) != 1) {
        step += 1;
    }
    let mut next = 0u64;
    (0..batch)
        .map(|_| {
            (0..shape.n_kv_heads)
                .map(|_| {
                    (0..per)
                        .map(|_| {
                            let b = (next * step + 13) % m;
                            next += 1;
                            b as u32
                        })
                        .collect()
                })
                .collect()
        })
        .collect()
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// A small counter-based generator for the cache's contents (values only set the data, not the work).
fn fill(state: &mut u64, out: &mut [f32]) {
    for x in out {
        *state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        *x = ((*state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0;
    }
}

/// Median of `f`'s run times in seconds: one warm-up run, then runs until `budget_s` has passed (at least 3, at
/// most 200).
pub fn median_time(budget_s: f64, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut times = Vec::new();
    while times.len() < 3 || (start.elapsed().as_secs_f64() < budget_s && times.len() < 200) {
        let t = Instant::now();
        f();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Bytes read plus bytes written per second by a copy of `bytes` bytes in host memory (median).
pub fn cpu_copy_bandwidth(bytes: usize, budget_s: f64) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let t = median_time(budget_s, || {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
    });
    2.0 * bytes as f64 / t
}

/// The cache under test, filled with pseudo-random K and V.
enum Arena {
    Pool(KvStorage),
    Encoded(EncodedKv),
}

fn arena(format: KvFormat, shape: &AttnBenchShape, num_blocks: usize) -> Result<Arena, CodecError> {
    let (bs, hd) = (shape.block_size, shape.head_dim);
    let (mut k, mut v) = (vec![0.0f32; bs * hd], vec![0.0f32; bs * hd]);
    let mut state = 0x5EED;
    Ok(match format {
        KvFormat::Pool(dtype) => {
            let mut kv = KvStorage::with_dtype(num_blocks, bs, hd, dtype);
            for b in 0..num_blocks as u32 {
                fill(&mut state, &mut k);
                fill(&mut state, &mut v);
                kv.write_block(b, &k, &v);
            }
            Arena::Pool(kv)
        }
        KvFormat::Encoded(codec) => {
            let mut kv = EncodedKv::new(codec, num_blocks, bs, hd)?;
            for b in 0..num_blocks {
                fill(&mut state, &mut k);
                fill(&mut state, &mut v);
                kv.store(b, &k, &v)?;
            }
            Arena::Encoded(kv)
        }
    })
}

/// Measures CPU decode attention for every (format, batch, context); `budget_s` bounds the timing of each point.
pub fn cpu_decode_attention(
    be: &CpuBackend,
    shape: &AttnBenchShape,
    formats: &[KvFormat],
    batches: &[usize],
    contexts: &[usize],
    budget_s: f64,
) -> Result<Vec<AttnBenchPoint>, CodecError> {
    let max_blocks = arena_blocks(shape, batches, contexts);
    let (nh, nkv, hd) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut points = Vec::new();
    for &format in formats {
        let kv = arena(format, shape, max_blocks)?;
        let block_bytes = format.block_bytes(shape)?;
        for &batch in batches {
            for &context in contexts {
                let tables = scattered_tables(shape, batch, context, max_blocks);
                let prior = vec![context - 1; nkv];
                let seqs = decode_seqs(&tables, &prior);
                let mut q = vec![0.0f32; batch * nh * hd];
                fill(&mut 7u64, &mut q);
                let mut out = vec![0.0f32; batch * nh * hd];
                let seconds = match &kv {
                    Arena::Pool(kv) => median_time(budget_s, || {
                        be.paged_attention(&q, kv, &seqs, nh, nkv, scale, &mut out);
                    }),
                    Arena::Encoded(kv) => median_time(budget_s, || {
                        be.paged_attention_encoded(&q, kv, &seqs, nh, nkv, scale, &mut out);
                    }),
                };
                let kv_bytes = batch * nkv * context.div_ceil(shape.block_size) * block_bytes;
                points.push(AttnBenchPoint {
                    format: format.name(),
                    batch,
                    context,
                    kv_bytes,
                    seconds,
                    bytes_per_s: kv_bytes as f64 / seconds,
                });
            }
        }
    }
    Ok(points)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_shapes_parse_and_name_themselves() {
        for name in [
            "f16",
            "f32",
            "pool:int8",
            "pool:fp8_e4m3",
            "pool:fp8_e4m3_rotated",
            "bf16",
            "int8",
            "fp8_e4m3",
            "fp8_e4m3_rotated",
            "int4_kivi",
            "int2_kivi",
        ] {
            let f: KvFormat = name.parse().unwrap();
            assert_eq!(f.name(), name);
            assert!(KvFormat::ALL.contains(&f), "{name}");
        }
        assert!("int3".parse::<KvFormat>().is_err());
        assert!("pool:int4".parse::<KvFormat>().is_err());
        assert_eq!("LLAMA-8B".parse::<AttnBenchShape>().unwrap(), LLAMA_8B);
        assert!("llama-70b".parse::<AttnBenchShape>().is_err());
        // f16: 16 slots x 64 x 2 bytes, K and V. int4 KIVI: 1,024 bytes of codes, plus 256 of per-channel key
        // parameters, 128 of per-group value parameters and the 16-byte header.
        assert_eq!(KvFormat::Pool(KvDtype::F16).block_bytes(&SMOLLM2).unwrap(), 4096);
        assert_eq!(KvFormat::Encoded(Codec::Int4Kivi).block_bytes(&SMOLLM2).unwrap(), 1424);
    }

    #[test]
    fn tables_are_disjoint_and_scattered_over_the_arena() {
        let t = scattered_tables(&SMOLLM2, 4, 100, 0);
        let mut all: Vec<u32> = t.iter().flatten().flatten().copied().collect();
        assert_eq!(all.len(), 4 * 3 * 7);
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 4 * 3 * 7, "every block once");
        assert_eq!(*all.last().unwrap() as usize, 4 * 3 * 7 - 1);
        // A small point in a big arena spreads over all of it.
        let small: Vec<u32> = scattered_tables(&SMOLLM2, 1, 64, 10_000).into_iter().flatten().flatten().collect();
        assert_eq!(small.len(), 12);
        assert!(small.iter().all(|&b| b < 10_000) && small.iter().any(|&b| b > 5_000), "{small:?}");
        // Scattered: neighbours in a table are not neighbours in the arena.
        assert!(t[0][0].windows(2).all(|w| w[0].abs_diff(w[1]) > 1), "{:?}", t[0][0]);
    }

    #[test]
    fn cpu_points_count_the_bytes_they_read() {
        let be = CpuBackend::new(1);
        let formats = [KvFormat::Pool(KvDtype::F16), KvFormat::Encoded(Codec::Int8)];
        let points = cpu_decode_attention(&be, &SMOLLM2, &formats, &[1, 2], &[64, 100], 0.0).unwrap();
        assert_eq!(points.len(), 2 * 2 * 2);
        let p = &points[3];
        assert_eq!((p.format.as_str(), p.batch, p.context), ("f16", 2, 100));
        assert_eq!(p.kv_bytes, 2 * 3 * 7 * 4096);
        assert!(points.iter().all(|p| p.seconds > 0.0 && p.bytes_per_s > 0.0));
        let int8 = &points[7];
        assert_eq!(int8.kv_bytes, 2 * 3 * 7 * Codec::Int8.encoded_len(16, 64).unwrap());
    }
}
