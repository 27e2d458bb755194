//! Paged attention and KV-write tests against a plain dense causal attention on random data, with shuffled
//! (non-contiguous) block tables, per-head cache lengths and mixed prefill/decode batches, over f32, f16, int8, fp8
//! and rotated-key fp8 caches (the dense reference attends over the same rounded keys and values) and every
//! instruction set.

#![allow(clippy::needless_range_loop)]

mod common;

use common::{outlier_channel_keys, rand_vec};
use pagoda_kernels::codec::{e4m3_from_f32, e4m3_to_f32};
use pagoda_kernels::{AttnProbs, AttnSeq, Backend, CpuBackend, KvDtype, KvStorage, Simd, hadamard_rotate};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

fn backends() -> Vec<CpuBackend> {
    vec![
        CpuBackend::with_simd(1, Simd::Scalar),
        CpuBackend::with_simd(2, Simd::Scalar),
        CpuBackend::with_simd(1, Simd::Avx2),
        CpuBackend::with_simd(2, Simd::Avx2),
        // Falls back to AVX2 on CPUs without AVX-512 (then it repeats the case above).
        CpuBackend::with_simd(1, Simd::Avx512),
        CpuBackend::with_simd(2, Simd::Avx512),
    ]
}

/// The value a cache of `dtype` stores for `x`.
fn stored(dtype: KvDtype, x: f32) -> f32 {
    match dtype {
        KvDtype::F32 => x,
        KvDtype::F16 => half::f16::from_f32(x).to_f32(),
        KvDtype::Int8 | KvDtype::Fp8 | KvDtype::Fp8Rotated => panic!("{dtype} rounds per slot: use stored_rows"),
    }
}

/// What a cache of `dtype` stores for rows of `hd` values: per element for the float types; for the 8-bit types per
/// slot, the arena's rule (int8: scale = absmax / 127, codes = round(x / scale); fp8: scale = absmax / 448, codes =
/// e4m3(x / scale); rotated fp8: fp8's rule on the row rotated, rotated back).
fn stored_rows(dtype: KvDtype, x: Vec<f32>, hd: usize) -> Vec<f32> {
    if !dtype.slot_scaled() {
        return x.into_iter().map(|v| stored(dtype, v)).collect();
    }
    let top = if dtype.is_e4m3() { 448.0 } else { 127.0 };
    let code =
        move |y: f32| if dtype.is_e4m3() { e4m3_to_f32(e4m3_from_f32(y)) } else { y.round().clamp(-127.0, 127.0) };
    x.chunks_exact(hd)
        .flat_map(|row| {
            let mut row = row.to_vec();
            if dtype.rotates_keys() {
                hadamard_rotate(&mut row);
            }
            let s = row.iter().fold(0.0f32, |m, v| m.max(v.abs())) / top;
            let mut out: Vec<f32> = row.iter().map(|&v| if s > 0.0 { code(v / s) * s } else { 0.0 }).collect();
            if dtype.rotates_keys() {
                hadamard_rotate(&mut out);
            }
            out
        })
        .collect()
}

/// One sequence of a test batch: dense K/V per kv-head (prior + new slots), its q rows and block tables.
struct Seq {
    prior: Vec<usize>,
    n_new: usize,
    /// [kv-head][slot][hd]
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    tables: Vec<Vec<u32>>,
    q_row: usize,
}

struct Shape {
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    bs: usize,
}

/// Dense causal attention of one sequence (f64), written into `out` rows; returns each row's softmax probabilities
/// (f64), indexed `qh * n_new + j`.
fn dense(sh: &Shape, s: &Seq, q: &[f32], scale: f32, out: &mut [f32]) -> Vec<Vec<f64>> {
    let mut probs = vec![Vec::new(); sh.n_heads * s.n_new];
    let w = sh.n_heads * sh.hd;
    let group = sh.n_heads / sh.n_kv;
    for j in 0..s.n_new {
        let row = s.q_row + j;
        for qh in 0..sh.n_heads {
            let h = qh / group;
            let len = s.prior[h] + j + 1;
            let qv = &q[row * w + qh * sh.hd..row * w + (qh + 1) * sh.hd];
            let scores: Vec<f64> = (0..len)
                .map(|t| {
                    let kv = &s.k[h][t * sh.hd..(t + 1) * sh.hd];
                    qv.iter().zip(kv).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64
                })
                .collect();
            let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let l: f64 = p.iter().sum();
            for d in 0..sh.hd {
                let acc: f64 = (0..len).map(|t| p[t] * s.v[h][t * sh.hd + d] as f64).sum();
                out[row * w + qh * sh.hd + d] = (acc / l) as f32;
            }
            probs[qh * s.n_new + j] = p.iter().map(|x| x / l).collect();
        }
    }
    probs
}

/// Builds a batch: random lengths, shuffled block ids, prior slots written straight into blocks; returns the
/// storage, the sequences and this step's k / v matrices (`[rows][n_kv*hd]`).
fn build(
    rng: &mut StdRng,
    sh: &Shape,
    specs: &[(Vec<usize>, usize)],
    dtype: KvDtype,
) -> (KvStorage, Vec<Seq>, Vec<f32>, Vec<f32>) {
    let need: usize = specs.iter().map(|(p, n)| p.iter().map(|&pl| (pl + n).div_ceil(sh.bs) + 1).sum::<usize>()).sum();
    let num_blocks = need + 7;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(rng);
    let mut kv = KvStorage::with_dtype(num_blocks, sh.bs, sh.hd, dtype);
    // Fill all blocks with garbage so reads past the causal limit would show.
    let (garbage_k, garbage_v) = (vec![1e3; kv.block_len()], vec![-1e3; kv.block_len()]);
    for b in 0..num_blocks as u32 {
        kv.write_block(b, &garbage_k, &garbage_v);
    }
    let rows: usize = specs.iter().map(|(_, n)| n).sum();
    let kw = sh.n_kv * sh.hd;
    let mut kmat = vec![0.0; rows * kw];
    let mut vmat = vec![0.0; rows * kw];
    let mut seqs = Vec::new();
    let mut next = 0;
    let mut q_row = 0;
    for (prior, n_new) in specs {
        let mut s = Seq { prior: prior.clone(), n_new: *n_new, k: vec![], v: vec![], tables: vec![], q_row };
        for h in 0..sh.n_kv {
            let total = prior[h] + n_new;
            let k = stored_rows(dtype, rand_vec(rng, total * sh.hd, 1.0), sh.hd);
            let v = stored_rows(dtype.value_dtype(), rand_vec(rng, total * sh.hd, 1.0), sh.hd);
            // Capacity: enough blocks, sometimes one spare.
            let nb = total.div_ceil(sh.bs) + usize::from(rng.random_bool(0.5));
            let table: Vec<u32> = ids[next..next + nb].to_vec();
            next += nb;
            for t in 0..prior[h] {
                let row = t * sh.hd..(t + 1) * sh.hd;
                kv.write_slot(table[t / sh.bs], t % sh.bs, &k[row.clone()], &v[row]);
            }
            for j in 0..*n_new {
                let t = prior[h] + j;
                let dst = (q_row + j) * kw + h * sh.hd;
                kmat[dst..dst + sh.hd].copy_from_slice(&k[t * sh.hd..(t + 1) * sh.hd]);
                vmat[dst..dst + sh.hd].copy_from_slice(&v[t * sh.hd..(t + 1) * sh.hd]);
            }
            s.k.push(k);
            s.v.push(v);
            s.tables.push(table);
        }
        q_row += n_new;
        seqs.push(s);
    }
    (kv, seqs, kmat, vmat)
}

fn run_case(rng: &mut StdRng, sh: &Shape, specs: &[(Vec<usize>, usize)]) {
    for dtype in KvDtype::ALL {
        run_case_dtype(rng, sh, specs, dtype);
    }
}

fn run_case_dtype(rng: &mut StdRng, sh: &Shape, specs: &[(Vec<usize>, usize)], dtype: KvDtype) {
    let (kv0, seqs, kmat, vmat) = build(rng, sh, specs, dtype);
    let rows: usize = specs.iter().map(|(_, n)| n).sum();
    let w = sh.n_heads * sh.hd;
    let q = rand_vec(rng, rows * w, 1.5);
    let scale = 1.0 / (sh.hd as f32).sqrt();
    let mut want = vec![0.0; rows * w];
    let want_probs: Vec<Vec<Vec<f64>>> = seqs.iter().map(|s| dense(sh, s, &q, scale, &mut want)).collect();
    for be in backends() {
        let mut kv = kv0.clone();
        let views: Vec<AttnSeq<'_>> = seqs
            .iter()
            .map(|s| AttnSeq { q_row: s.q_row, n_new: s.n_new, tables: &s.tables, prior_lens: &s.prior })
            .collect();
        be.kv_write(&mut kv, &kmat, &vmat, &views, sh.n_kv);
        let mut got = vec![f32::NAN; rows * w];
        be.paged_attention(&q, &kv, &views, sh.n_heads, sh.n_kv, scale, &mut got);
        for i in 0..rows * w {
            assert!(
                (got[i] - want[i]).abs() <= 2e-5 + 2e-5 * want[i].abs(),
                "{be:?} {dtype} heads {}/{} hd {} bs {} specs {specs:?}: out[{i}] (row {}, col {}) = {} want {}",
                sh.n_heads,
                sh.n_kv,
                sh.hd,
                sh.bs,
                i / w,
                i % w,
                got[i],
                want[i]
            );
        }
        // The same attention, summing the probabilities of every other sequence (squared for one of them, as
        // KV-Compress asks): the output must not change, each head's sums must match the dense softmax summed over
        // the step's tokens, and nothing past a head's visible length may be written.
        const UNTOUCHED: f32 = -7.0;
        let strides: Vec<usize> = seqs.iter().map(|s| s.prior.iter().max().unwrap() + s.n_new + 3).collect();
        let power = |i: usize| if i % 4 == 2 { 2 } else { 1 };
        let mut bufs: Vec<Vec<f32>> = strides.iter().map(|st| vec![UNTOUCHED; sh.n_heads * st]).collect();
        let mut sinks: Vec<AttnProbs<'_>> = bufs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(i, sums)| AttnProbs { seq: i, power: power(i), stride: strides[i], sums })
            .collect();
        let mut got2 = vec![f32::NAN; rows * w];
        be.paged_attention_with_probs(&q, &kv, &views, sh.n_heads, sh.n_kv, scale, &mut got2, &mut sinks);
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            got2.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        for (i, s) in seqs.iter().enumerate() {
            let buf = &bufs[i];
            for qh in 0..sh.n_heads {
                let row = &buf[qh * strides[i]..(qh + 1) * strides[i]];
                let mut want_sums = Vec::<f64>::new();
                for j in 0..s.n_new {
                    let p = &want_probs[i][qh * s.n_new + j];
                    want_sums.resize(want_sums.len().max(p.len()), 0.0);
                    for (w, &e) in want_sums.iter_mut().zip(p) {
                        *w += e.powi(power(i) as i32);
                    }
                }
                for (t, &p) in row.iter().enumerate() {
                    if i % 2 == 1 || t >= want_sums.len() {
                        assert_eq!(p, UNTOUCHED, "{be:?} {dtype} seq {i} head {qh}: slot {t} written");
                    } else {
                        let e = want_sums[t];
                        assert!(
                            (p as f64 - e).abs() <= 1e-6 * s.n_new as f64 + 1e-5 * e,
                            "{be:?} {dtype} seq {i} head {qh}: sum[{t}] = {p} want {e}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn paged_attention_matches_dense_smollm_shape() {
    let mut rng = StdRng::seed_from_u64(10);
    let sh = Shape { n_heads: 9, n_kv: 3, hd: 64, bs: 16 };
    // Decode at many lengths, including non-multiples of the block size.
    for prior in [0usize, 1, 2, 15, 16, 17, 31, 32, 33, 47, 100, 255, 256, 257, 600] {
        run_case(&mut rng, &sh, &[(vec![prior; 3], 1)]);
    }
    // Prefill chunks, from scratch and on top of a cache.
    for (prior, n_new) in [(0usize, 1usize), (0, 5), (0, 16), (0, 17), (0, 40), (0, 77), (16, 16), (21, 33), (5, 130)] {
        run_case(&mut rng, &sh, &[(vec![prior; 3], n_new)]);
    }
    // A mixed batch: decodes and prefills, different per-head lengths (variable-head eviction).
    run_case(
        &mut rng,
        &sh,
        &[
            (vec![10, 10, 10], 1),
            (vec![0, 0, 0], 23),
            (vec![40, 7, 65], 1),
            (vec![33, 16, 1], 9),
            (vec![200, 150, 3], 1),
        ],
    );
}

#[test]
fn paged_attention_matches_dense_other_shapes() {
    let mut rng = StdRng::seed_from_u64(11);
    let shapes = [
        Shape { n_heads: 4, n_kv: 4, hd: 32, bs: 8 },
        Shape { n_heads: 8, n_kv: 2, hd: 128, bs: 16 },
        Shape { n_heads: 6, n_kv: 1, hd: 24, bs: 5 },
        Shape { n_heads: 2, n_kv: 1, hd: 64, bs: 32 },
        Shape { n_heads: 4, n_kv: 2, hd: 80, bs: 3 },
    ];
    for sh in &shapes {
        for (prior, n_new) in [(0usize, 1usize), (0, 9), (3, 1), (17, 1), (40, 7), (64, 33), (99, 2)] {
            let pl: Vec<usize> = (0..sh.n_kv).map(|h| prior + h * 3).collect();
            run_case(&mut rng, sh, &[(pl.clone(), n_new), (vec![prior / 2; sh.n_kv], 1)]);
        }
    }
}

#[test]
fn kv_write_then_read_back() {
    let mut rng = StdRng::seed_from_u64(12);
    let sh = Shape { n_heads: 9, n_kv: 3, hd: 64, bs: 16 };
    let specs = [(vec![0usize, 0, 0], 37usize), (vec![15, 16, 17], 3), (vec![31, 2, 90], 1)];
    let (mut kv, seqs, kmat, vmat) = build(&mut rng, &sh, &specs, KvDtype::F32);
    let be = CpuBackend::new(2);
    let views: Vec<AttnSeq<'_>> = seqs
        .iter()
        .map(|s| AttnSeq { q_row: s.q_row, n_new: s.n_new, tables: &s.tables, prior_lens: &s.prior })
        .collect();
    be.kv_write(&mut kv, &kmat, &vmat, &views, sh.n_kv);
    for s in &seqs {
        for h in 0..sh.n_kv {
            for t in 0..s.prior[h] + s.n_new {
                let b = s.tables[h][t / sh.bs];
                let off = (t % sh.bs) * sh.hd;
                assert_eq!(&kv.block_k(b)[off..off + sh.hd], &s.k[h][t * sh.hd..(t + 1) * sh.hd]);
                assert_eq!(&kv.block_v(b)[off..off + sh.hd], &s.v[h][t * sh.hd..(t + 1) * sh.hd]);
            }
            // The slot after the written ones is untouched.
            let t = s.prior[h] + s.n_new;
            if t / sh.bs < s.tables[h].len() {
                let b = s.tables[h][t / sh.bs];
                assert_eq!(kv.block_k(b)[(t % sh.bs) * sh.hd], 1e3);
            }
        }
    }
    // copy_block copies both arenas.
    let (a, b) = (seqs[0].tables[0][0], seqs[0].tables[0][1]);
    kv.copy_block(a, b);
    assert_eq!(kv.block_k(a), kv.block_k(b));
    assert_eq!(kv.block_v(a), kv.block_v(b));
    assert_eq!((kv.block_size(), kv.head_dim()), (16, 64));
    assert_eq!(kv.block_k(0).len(), 16 * 64);
}

#[test]
fn f16_cache_rounds_on_write_and_reads_back_widened() {
    let mut rng = StdRng::seed_from_u64(13);
    let sh = Shape { n_heads: 9, n_kv: 3, hd: 64, bs: 16 };
    let specs = [(vec![0usize, 0, 0], 21usize), (vec![5, 16, 40], 1)];
    let (mut kv, seqs, kmat, vmat) = build(&mut rng, &sh, &specs, KvDtype::F16);
    assert_eq!(kv.dtype(), KvDtype::F16);
    assert_eq!(kv.block_bytes(), 2 * 16 * 64 * 2);
    // Rows that are not f16 values: the cache must hold their rounding.
    let kmat: Vec<f32> = kmat.iter().map(|x| x + 1e-4).collect();
    let views: Vec<AttnSeq<'_>> = seqs
        .iter()
        .map(|s| AttnSeq { q_row: s.q_row, n_new: s.n_new, tables: &s.tables, prior_lens: &s.prior })
        .collect();
    CpuBackend::new(2).kv_write(&mut kv, &kmat, &vmat, &views, sh.n_kv);
    let (mut k, mut v) = (vec![0.0; kv.block_len()], vec![0.0; kv.block_len()]);
    let kw = sh.n_kv * sh.hd;
    for s in &seqs {
        for h in 0..sh.n_kv {
            for j in 0..s.n_new {
                let t = s.prior[h] + j;
                kv.read_block(s.tables[h][t / sh.bs], &mut k, &mut v);
                let off = (t % sh.bs) * sh.hd;
                let src = (s.q_row + j) * kw + h * sh.hd;
                for d in 0..sh.hd {
                    assert_eq!(k[off + d], stored(KvDtype::F16, kmat[src + d]));
                    assert_eq!(v[off + d], vmat[src + d], "v rows were f16 values already");
                }
            }
        }
    }
}

#[test]
fn int8_cache_quantises_each_slot_and_moves_scales_with_it() {
    eight_bit_cache_quantises_each_slot_and_moves_scales_with_it(KvDtype::Int8);
}

#[test]
fn fp8_cache_quantises_each_slot_and_moves_scales_with_it() {
    eight_bit_cache_quantises_each_slot_and_moves_scales_with_it(KvDtype::Fp8);
}

fn eight_bit_cache_quantises_each_slot_and_moves_scales_with_it(dtype: KvDtype) {
    let (bs, hd) = (4, 8);
    let mut kv = KvStorage::with_dtype(4, bs, hd, dtype);
    assert_eq!(kv.block_bytes(), 2 * bs * (hd + 4));
    let mut rng = StdRng::seed_from_u64(14);
    // Rows of very different magnitudes: each slot keeps its own scale.
    let rows: Vec<Vec<f32>> = (0..bs).map(|i| rand_vec(&mut rng, hd, 10f32.powi(i as i32 - 2))).collect();
    let neg: Vec<Vec<f32>> = rows.iter().map(|r| r.iter().map(|x| -x).collect()).collect();
    for (i, (k, v)) in rows.iter().zip(&neg).enumerate() {
        kv.write_slot(1, i, k, v);
    }
    let (mut k, mut v) = (vec![0.0; bs * hd], vec![0.0; bs * hd]);
    kv.read_block(1, &mut k, &mut v);
    for (i, row) in rows.iter().enumerate() {
        let amax = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        for d in 0..hd {
            // int8: half a step of absmax / 127. e4m3: 2^-4 relative for normals, half a subnormal step (2^-10 of
            // the scale absmax / 448) below.
            let bound = match dtype {
                KvDtype::Fp8 => (row[d].abs() / 16.0).max(amax / 448.0 / 1024.0),
                _ => amax / 127.0 * 0.5,
            } * (1.0 + 1e-5);
            assert!((k[i * hd + d] - row[d]).abs() <= bound, "{dtype} slot {i}: {} vs {}", k[i * hd + d], row[d]);
            assert_eq!(v[i * hd + d], -k[i * hd + d], "symmetric codes");
        }
    }
    // Moving and compacting slots moves their scales: the values come back unchanged.
    kv.move_slot(1, 3, 2, 0);
    kv.copy_block(1, 3);
    let (mut k2, mut v2) = (vec![0.0; hd], vec![0.0; hd]);
    kv.read_block(2, &mut k2, &mut v2);
    assert_eq!(k2, k[3 * hd..4 * hd]);
    let (mut k3, mut v3) = (vec![0.0; bs * hd], vec![0.0; bs * hd]);
    kv.read_block(3, &mut k3, &mut v3);
    assert_eq!((&k3, &v3), (&k, &v));
    assert_eq!(kv.compact_table(&[1], bs, &[0, 2]), 2);
    kv.read_block(1, &mut k2, &mut v2);
    assert_eq!(k2, k[..hd]);
    let mut k4 = vec![0.0; hd];
    kv.read_block_k(1, &mut k4);
    assert_eq!(k4, k[..hd]);
    kv.read_block(1, &mut k3[..2 * hd], &mut v3[..2 * hd]);
    assert_eq!(&k3[hd..2 * hd], &k[2 * hd..3 * hd]);
    // A zero row stores zeros; a row with a NaN reads back as NaN rather than as numbers.
    kv.write_slot(0, 0, &[0.0; 8], &[0.0; 8]);
    let mut bad = [1.0f32; 8];
    bad[3] = f32::NAN;
    kv.write_slot(0, 1, &bad, &[f32::INFINITY; 8]);
    kv.read_block(0, &mut k[..2 * hd], &mut v[..2 * hd]);
    assert!(k[..hd].iter().all(|&x| x == 0.0));
    assert!(k[hd..2 * hd].iter().all(|x| x.is_nan()) && v[hd..2 * hd].iter().all(|x| x.is_nan()));
}

/// The rotated fp8 cache stores `H k` by fp8's rule and reads `H` of that back (the normalised transform is its own
/// inverse): exactly what an fp8 cache holding the rotated keys reads, rotated. Values are stored as fp8's. Moving
/// and copying slots keeps that, and a row with a NaN still reads back as NaN.
#[test]
fn fp8_rotated_cache_reads_back_fp8_of_the_rotated_keys() {
    let (bs, hd) = (16, 64);
    let mut rng = StdRng::seed_from_u64(15);
    let k = rand_vec(&mut rng, bs * hd, 2.0);
    let v = rand_vec(&mut rng, bs * hd, 1.0);
    let mut rotated = KvStorage::with_dtype(3, bs, hd, KvDtype::Fp8Rotated);
    assert_eq!(rotated.block_bytes(), KvStorage::with_dtype(1, bs, hd, KvDtype::Fp8).block_bytes());
    rotated.write_block(1, &k, &v);
    let mut hk = k.clone();
    hk.chunks_exact_mut(hd).for_each(hadamard_rotate);
    let mut plain = KvStorage::with_dtype(1, bs, hd, KvDtype::Fp8);
    plain.write_block(0, &hk, &v);
    let (mut pk, mut pv) = (vec![0.0; bs * hd], vec![0.0; bs * hd]);
    plain.read_block(0, &mut pk, &mut pv);
    pk.chunks_exact_mut(hd).for_each(hadamard_rotate);
    let (mut rk, mut rv) = (vec![0.0; bs * hd], vec![0.0; bs * hd]);
    rotated.read_block(1, &mut rk, &mut rv);
    assert_eq!(rk, pk, "keys: fp8 of the rotated rows, rotated back");
    assert_eq!(rv, pv, "values: plain fp8");
    let worst = rk.iter().zip(&k).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst < 2.0 * 8.0 / 16.0, "keys within fp8's relative error of the rotated row's absmax: {worst}");
    let mut row = vec![0.0; hd];
    rotated.read_block_k(1, &mut row);
    assert_eq!(row, rk[..hd]);
    let mut rv1 = vec![0.0; hd];
    rotated.read_slot(1, 5, &mut row, &mut rv1);
    assert_eq!(row, rk[5 * hd..6 * hd]);
    rotated.move_slot(1, 5, 2, 0);
    rotated.copy_block(1, 0);
    rotated.read_slot(2, 0, &mut row, &mut rv1);
    assert_eq!((&row[..], &rv1[..]), (&rk[5 * hd..6 * hd], &rv[5 * hd..6 * hd]));
    let (mut ck, mut cv) = (vec![0.0; bs * hd], vec![0.0; bs * hd]);
    rotated.read_block(0, &mut ck, &mut cv);
    assert_eq!((&ck, &cv), (&rk, &rv));
    let mut bad = vec![1.0f32; hd];
    bad[3] = f32::NAN;
    rotated.write_slot(0, 1, &bad, &bad);
    rotated.read_slot(0, 1, &mut row, &mut rv1);
    assert!(row.iter().all(|x| x.is_nan()), "a NaN key reads back as NaN, not as numbers");
}

/// Why the rotated pool exists: keys whose weight sits in a few channels and a query that reads those channels (as
/// RoPE's low frequencies put them). Attention over the rotated cache scores every key closer to its exact score
/// than over the plain fp8 cache, through the kernels the engine runs (every backend, rotated query or widened
/// keys), so the weights and the output are closer (the reference holds fp8's values: only the keys differ).
#[test]
fn fp8_rotated_cache_attends_closer_than_fp8_on_outlier_channels() {
    let (bs, hd, n) = (16, 64, 256);
    let mut rng = StdRng::seed_from_u64(16);
    let k = outlier_channel_keys(&mut rng, n, hd);
    let v = rand_vec(&mut rng, n * hd, 1.0);
    let mut q = rand_vec(&mut rng, hd, 0.3);
    q[60] = 0.6;
    q[61] = -0.45;
    let table: Vec<u32> = (0..(n / bs) as u32).collect();
    let cache = |dtype: KvDtype| {
        let mut kv = KvStorage::with_dtype(n / bs, bs, hd, dtype);
        for (b, (kb, vb)) in k.chunks_exact(bs * hd).zip(v.chunks_exact(bs * hd)).enumerate() {
            kv.write_block(b as u32, kb, vb);
        }
        kv
    };
    let (plain, rotated) = (cache(KvDtype::Fp8), cache(KvDtype::Fp8Rotated));
    // The reference holds the exact keys beside the values both fp8 caches store, so that what differs is the keys.
    let mut exact = KvStorage::with_dtype(n / bs, bs, hd, KvDtype::F32);
    let (mut scratch_k, mut fp8_v) = (vec![0.0; bs * hd], vec![0.0; bs * hd]);
    for (b, kb) in k.chunks_exact(bs * hd).enumerate() {
        plain.read_block(b as u32, &mut scratch_k, &mut fp8_v);
        exact.write_block(b as u32, kb, &fp8_v);
    }
    let tables = [table];
    let prior = [n - 1];
    let views = [AttnSeq { q_row: 0, n_new: 1, tables: &tables, prior_lens: &prior }];
    // The new token's own slot was written above, so attention sees all n slots; kv_write is not called.
    let attend = |be: &CpuBackend, kv: &KvStorage| {
        let (mut out, mut sums) = (vec![0.0; hd], vec![0.0; n]);
        let mut sink = [AttnProbs { seq: 0, power: 1, stride: n, sums: &mut sums }];
        be.paged_attention_with_probs(&q, kv, &views, 1, 1, 1.0 / 8.0, &mut out, &mut sink);
        (out, sums)
    };
    let dist = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| f64::from((x - y).abs())).sum::<f64>();
    for be in backends() {
        let (want, want_p) = attend(&be, &exact);
        let (got_plain, p_plain) = attend(&be, &plain);
        let (got_rot, p_rot) = attend(&be, &rotated);
        let (e_plain, e_rot) = (dist(&got_plain, &want), dist(&got_rot, &want));
        let (w_plain, w_rot) = (dist(&p_plain, &want_p), dist(&p_rot, &want_p));
        println!(
            "{be:?}: output L1 error fp8 {e_plain:.5} rotated {e_rot:.5}; weights fp8 {w_plain:.5} rotated {w_rot:.5}"
        );
        assert!(w_rot * 1.4 < w_plain, "{be:?}: attention weights {w_rot} rotated against {w_plain}");
        assert!(e_rot * 1.1 < e_plain, "{be:?}: output {e_rot} rotated against {e_plain}");
    }
}
