//! Criterion benches for the CPU kernels at SmolLM2-135M shapes, scalar vs AVX2 (both on 2 threads).
//!
//! Filter with e.g. `cargo bench -p pagoda-kernels -- matmul/q4_1_1536x576`.
//!
//! `window_scores/*` is the eviction policies' attention-score kernel (KV-Compress's per-step metric), portable vs
//! AVX2 on one thread.
//!
//! `attention_codec/*` runs decode attention over the same KV stored as f32 (the f32 kernel) and encoded with each
//! codec (the dequantise-on-load kernel), one thread, AVX2, with throughput in KV bytes read per second.
//!
//! `encode_fp8_e4m3_rotated_16x64/*` is what query-aware key rounding adds to encoding a block for a tier.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use pagoda_kernels::scores::{Window, window_attention_scores, window_attention_scores_portable};
use pagoda_kernels::{AttnSeq, Backend, Codec, CpuBackend, EncodedKv, KvDtype, KvStorage, QMatrix, Simd, WeightType};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::time::Duration;

fn rand_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

fn backends() -> [(&'static str, CpuBackend); 2] {
    [("scalar", CpuBackend::with_simd(2, Simd::Scalar)), ("avx2", CpuBackend::with_simd(2, Simd::Avx2))]
}

/// Scalar runs above this many multiply-adds per iteration are skipped (they take seconds).
const SCALAR_MAX_MACS: usize = 400_000_000;

fn matmul(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(1);
    let shapes = [
        (WeightType::Q4_1, 576, 576),
        (WeightType::Q4_1, 1536, 576),
        (WeightType::Q4_1, 576, 1536),
        (WeightType::Q8_0, 49152, 576),
        (WeightType::Q4_1, 49152, 576),
    ];
    let bes = backends();
    for (ty, rows, cols) in shapes {
        let w = QMatrix::quantize(ty, rows, cols, &rand_vec(&mut rng, rows * cols)).expect("quantize");
        let name = format!("matmul/{}_{rows}x{cols}", format!("{ty:?}").to_lowercase());
        let mut g = c.benchmark_group(name);
        g.warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2)).sample_size(20);
        for n in [1usize, 8, 32, 512] {
            let x = rand_vec(&mut rng, n * cols);
            let mut out = vec![0.0; n * rows];
            g.throughput(Throughput::Elements((n * rows * cols) as u64));
            for (label, be) in &bes {
                if *label == "scalar" && n * rows * cols > SCALAR_MAX_MACS {
                    continue;
                }
                g.bench_function(BenchmarkId::new(*label, n), |b| {
                    b.iter(|| be.matmul(black_box(&w), black_box(&x), n, black_box(&mut out)))
                });
            }
        }
        g.finish();
    }
}

fn attention(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(2);
    let (n_heads, n_kv, hd, bs) = (9usize, 3usize, 64usize, 16usize);
    let bes = backends();
    for (ctx, batch) in [(512usize, 1usize), (4096, 1), (512, 32)] {
        let per_head = (ctx + 1).div_ceil(bs);
        let num_blocks = per_head * n_kv * batch;
        let mut kv = KvStorage::new(num_blocks, bs, hd);
        {
            let (k, v) = kv.arenas_mut();
            for x in k.iter_mut().chain(v.iter_mut()) {
                *x = rng.random_range(-1.0..1.0);
            }
        }
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        ids.shuffle(&mut rng);
        let tables: Vec<Vec<Vec<u32>>> = (0..batch)
            .map(|s| {
                (0..n_kv).map(|h| ids[(s * n_kv + h) * per_head..(s * n_kv + h + 1) * per_head].to_vec()).collect()
            })
            .collect();
        let prior = vec![ctx; n_kv];
        let seqs: Vec<AttnSeq<'_>> = tables
            .iter()
            .enumerate()
            .map(|(s, t)| AttnSeq { q_row: s, n_new: 1, tables: t, prior_lens: &prior })
            .collect();
        let q = rand_vec(&mut rng, batch * n_heads * hd);
        let mut out = vec![0.0; q.len()];
        let mut g = c.benchmark_group(format!("attention/decode_ctx{ctx}_batch{batch}"));
        g.warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2)).sample_size(20);
        for (label, be) in &bes {
            g.bench_function(*label, |b| {
                b.iter(|| be.paged_attention(black_box(&q), &kv, &seqs, n_heads, n_kv, 0.125, black_box(&mut out)))
            });
        }
        g.finish();
    }
    // Prefill: one 512-token chunk from scratch.
    let n_new: usize = 512;
    let per_head = n_new.div_ceil(bs);
    let mut kv = KvStorage::new(per_head * n_kv, bs, hd);
    {
        let (k, v) = kv.arenas_mut();
        for x in k.iter_mut().chain(v.iter_mut()) {
            *x = rng.random_range(-1.0..1.0);
        }
    }
    let tables: Vec<Vec<u32>> =
        (0..n_kv).map(|h| ((h * per_head) as u32..((h + 1) * per_head) as u32).collect()).collect();
    let prior = vec![0; n_kv];
    let seqs = [AttnSeq { q_row: 0, n_new, tables: &tables, prior_lens: &prior }];
    let q = rand_vec(&mut rng, n_new * n_heads * hd);
    let mut out = vec![0.0; q.len()];
    let mut g = c.benchmark_group("attention/prefill_512");
    g.warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2)).sample_size(10);
    for (label, be) in &bes {
        g.bench_function(*label, |b| {
            b.iter(|| be.paged_attention(black_box(&q), &kv, &seqs, n_heads, n_kv, 0.125, black_box(&mut out)))
        });
    }
    g.finish();
}

/// Decode attention per codec at SmolLM2 shapes (9 heads, 3 kv-heads, head_dim 64, 16-slot blocks), 8 sequences
/// of 4096 cached tokens (one layer: 48 MiB of f32 KV, beyond the last-level cache), one thread.
fn attention_codec(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(3);
    let (n_heads, n_kv, hd, bs, ctx, batch) = (9usize, 3usize, 64usize, 16usize, 4096usize, 8usize);
    let per_head = (ctx + 1).div_ceil(bs);
    let num_blocks = per_head * n_kv * batch;
    let mut kv = KvStorage::new(num_blocks, bs, hd);
    {
        let (k, v) = kv.arenas_mut();
        for x in k.iter_mut().chain(v.iter_mut()) {
            *x = rng.random_range(-1.0..1.0);
        }
    }
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(&mut rng);
    let tables: Vec<Vec<Vec<u32>>> = (0..batch)
        .map(|s| (0..n_kv).map(|h| ids[(s * n_kv + h) * per_head..(s * n_kv + h + 1) * per_head].to_vec()).collect())
        .collect();
    let prior = vec![ctx; n_kv];
    let seqs: Vec<AttnSeq<'_>> =
        tables.iter().enumerate().map(|(s, t)| AttnSeq { q_row: s, n_new: 1, tables: t, prior_lens: &prior }).collect();
    let q = rand_vec(&mut rng, batch * n_heads * hd);
    let mut out = vec![0.0; q.len()];
    let be = CpuBackend::with_simd(1, Simd::Avx2);
    let mut g = c.benchmark_group(format!("attention_codec/decode_ctx{ctx}_batch{batch}"));
    g.warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2)).sample_size(10);
    g.throughput(Throughput::Bytes((num_blocks * 2 * bs * hd * 4) as u64));
    g.bench_function("f32_kernel", |b| {
        b.iter(|| be.paged_attention(black_box(&q), &kv, &seqs, n_heads, n_kv, 0.125, black_box(&mut out)))
    });
    for codec in Codec::ALL {
        let mut enc = EncodedKv::new(codec, num_blocks, bs, hd).expect("arena");
        for b in 0..num_blocks as u32 {
            enc.store(b as usize, kv.block_k(b), kv.block_v(b)).expect("encode");
        }
        // Every sequence reads all of its blocks (ctx + 1 slots fill them but the last).
        g.throughput(Throughput::Bytes((num_blocks * enc.block_len()) as u64));
        g.bench_function(codec.name(), |b| {
            b.iter(|| be.paged_attention_encoded(black_box(&q), &enc, &seqs, n_heads, n_kv, 0.125, black_box(&mut out)))
        });
    }
    g.finish();
}

/// The KV-Compress / H2O per-step metric: one decode query's group (3 heads) scored against a 1,024-slot f16 cache,
/// and SnapKV's 8-query observation window, portable vs the AVX2 path (one thread each).
fn window_scores(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(5);
    let (hd, bs, len, group) = (64usize, 16usize, 1024usize, 3usize);
    let blocks = len.div_ceil(bs);
    let mut kv = KvStorage::with_dtype(blocks, bs, hd, KvDtype::F16);
    for b in 0..blocks as u32 {
        let (k, v) = (rand_vec(&mut rng, bs * hd), rand_vec(&mut rng, bs * hd));
        kv.write_block(b, &k, &v);
    }
    let mut table: Vec<u32> = (0..blocks as u32).collect();
    table.shuffle(&mut rng);
    let mut probs = Vec::new();
    let mut out = vec![0.0f32; len];
    for n_q in [1usize, 8, 512] {
        let q = rand_vec(&mut rng, n_q * group * hd);
        let mut g = c.benchmark_group(format!("window_scores/f16_len{len}_nq{n_q}_group{group}"));
        g.warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2)).sample_size(20);
        g.throughput(Throughput::Elements((n_q * group * len) as u64));
        let first = if n_q > 8 { 0 } else { len - n_q };
        g.bench_function("portable", |b| {
            b.iter(|| {
                window_attention_scores_portable(
                    &kv,
                    &table,
                    len,
                    Window { q: black_box(&q), n_q, group, scale: 0.125, first_q_slot: first, power: 2 },
                    &mut probs,
                    &mut out,
                )
            })
        });
        g.bench_function("dispatch (avx2 here)", |b| {
            b.iter(|| {
                window_attention_scores(
                    &kv,
                    &table,
                    len,
                    Window { q: black_box(&q), n_q, group, scale: 0.125, first_q_slot: first, power: 2 },
                    &mut probs,
                    &mut out,
                )
            })
        });
        g.finish();
    }
}

fn elementwise(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(3);
    let bes = backends();
    for n in [1usize, 512] {
        let mut g = c.benchmark_group(format!("elementwise/n{n}"));
        g.warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1)).sample_size(20);
        let x = rand_vec(&mut rng, n * 576);
        let wt = rand_vec(&mut rng, 576);
        let mut out = vec![0.0; n * 576];
        let mut qx = rand_vec(&mut rng, n * 576);
        let pos: Vec<u32> = (0..n as u32).map(|p| p + 100).collect();
        let mut table = pagoda_kernels::RopeTable::new();
        table.fill(&pos, 64, 100000.0);
        let mut gate = rand_vec(&mut rng, n * 1536);
        let up = rand_vec(&mut rng, n * 1536);
        for (label, be) in &bes {
            g.bench_function(BenchmarkId::new("rmsnorm_576", label), |b| {
                b.iter(|| be.rmsnorm(black_box(&x), &wt, 1e-5, black_box(&mut out)))
            });
            g.bench_function(BenchmarkId::new("rope_9x64", label), |b| {
                b.iter(|| be.rope(black_box(&mut qx), &table, 9))
            });
            g.bench_function(BenchmarkId::new("silu_mul_1536", label), |b| {
                b.iter(|| be.silu_mul(black_box(&mut gate), &up))
            });
        }
        g.finish();
    }
}

/// Encoding one 16 × 64 block as `fp8_e4m3_rotated`: keys rounded to the nearest code, and rounded for the queries
/// (`key_rounding`, moments of queries whose energy falls off with the channel, as a RoPE'd model's do).
fn encode_fp8_keys(c: &mut Criterion) {
    use pagoda_kernels::{KeyRounding, QueryMoments};
    let (bs, hd) = (16, 64);
    let k: Vec<f32> = (0..bs * hd).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
    let v: Vec<f32> = (0..bs * hd).map(|i| (i as f32 * 0.11).cos() * 0.5).collect();
    let mut m = QueryMoments::new(hd);
    let q: Vec<f32> = (0..256 * hd).map(|i| (i as f32 * 0.71).sin() * 0.8f32.powi((i % hd) as i32 / 2)).collect();
    m.add(&q);
    let rounding = KeyRounding::from_moments(&m).expect("moments");
    let codec = Codec::Fp8E4m3Rotated;
    let mut out = vec![0u8; codec.encoded_len(bs, hd).expect("shape")];
    let mut g = c.benchmark_group("encode_fp8_e4m3_rotated_16x64");
    g.throughput(Throughput::Elements((bs * hd) as u64));
    for (name, keys) in [("nearest", None), ("for_queries", Some(&rounding))] {
        g.bench_function(name, |b| {
            b.iter(|| codec.encode_block_with(bs, hd, black_box(&k), black_box(&v), black_box(&mut out), keys))
        });
    }
    g.finish();
}

criterion_group!(benches, matmul, attention, attention_codec, window_scores, elementwise, encode_fp8_keys);
criterion_main!(benches);
