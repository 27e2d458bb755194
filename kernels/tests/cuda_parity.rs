//! GPU ↔ CPU parity: every CUDA kernel against its CPU twin in pagoda_kernels on random inputs, across shapes and
//! edge lengths (non-multiples of the block size, contexts 1..4096, GQA ratios 1, 3, 4 and 16).
//!
//! K and V values are rounded to f16 before the CPU sees them, because the GPU arenas are f16: the comparison then
//! measures the kernels, not the storage format. Without a CUDA driver or device every test prints
//! "skipped: no CUDA device" and returns. Each test prints its max error (`parity <name>: max err ...`).
#![cfg(feature = "cuda")]

use half::f16;
use pagoda_kernels::cuda::codecs::GPU_CODECS;
use pagoda_kernels::cuda::{CudaContext, CudaKv, CudaWeight, ScoreEntry, SlotRange, WindowEntry};
use pagoda_kernels::{AttnSeq, Backend, CpuBackend, KvStorage, QMatrix, WeightType, scores};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

static CX: OnceLock<Option<Mutex<CudaContext>>> = OnceLock::new();

/// The shared GPU context, or None (after printing why) when this machine has no usable CUDA device.
fn gpu(test: &str) -> Option<MutexGuard<'static, CudaContext>> {
    let cx = CX.get_or_init(|| match CudaContext::new(0) {
        Ok(cx) => {
            eprintln!("device: {:?}; PTX cache: {:?}", cx.info(), cx.cache_status());
            Some(Mutex::new(cx))
        }
        Err(e) if e.is_no_device() => {
            eprintln!("({e})");
            None
        }
        Err(e) => panic!("a CUDA device is present but the backend failed to start: {e}"),
    });
    match cx {
        Some(m) => Some(m.lock().unwrap_or_else(|p| p.into_inner())),
        None => {
            eprintln!("{test}: skipped: no CUDA device");
            None
        }
    }
}

fn rvec(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

fn round16(v: &mut [f32]) {
    for x in v {
        *x = f16::from_f32(*x).to_f32();
    }
}

/// max |a - b| / (1 + |b|): absolute near zero, relative for large values.
fn max_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() / (1.0 + y.abs()) }).fold(0.0, f32::max)
}

fn report(name: &str, err: f32, tol: f32) {
    eprintln!("parity {name}: max err {err:.3e} (tol {tol:.0e})");
    assert!(err <= tol, "{name}: max err {err} exceeds {tol}");
}

#[test]
fn rmsnorm_matches_cpu() {
    let Some(cx) = gpu("rmsnorm") else { return };
    let cpu = CpuBackend::new(0);
    let mut rng = StdRng::seed_from_u64(1);
    let mut worst = 0.0f32;
    for &(rows, dim) in &[(1, 1), (3, 7), (17, 64), (5, 576), (2, 4099), (64, 2048)] {
        let x = rvec(&mut rng, rows * dim, 3.0);
        let w = rvec(&mut rng, dim, 1.5);
        let mut want = vec![0.0; x.len()];
        cpu.rmsnorm(&x, &w, 1e-5, &mut want);
        let (dx, dw) = (cx.upload(&x).unwrap(), cx.upload(&w).unwrap());
        let mut dout = cx.zeros::<f32>(x.len()).unwrap();
        cx.rmsnorm(&dx, &dw, 1e-5, &mut dout).unwrap();
        worst = worst.max(max_err(&cx.download(&dout).unwrap(), &want));
    }
    report("rmsnorm", worst, 1e-5);
}

#[test]
fn rope_matches_cpu() {
    let Some(cx) = gpu("rope") else { return };
    let cpu = CpuBackend::new(0);
    let mut rng = StdRng::seed_from_u64(2);
    let mut worst = 0.0f32;
    for &(n, heads, hd, theta) in &[(1, 1, 2, 10000.0), (5, 3, 64, 10000.0), (9, 8, 128, 500000.0), (3, 2, 256, 1e6)] {
        let mut x = rvec(&mut rng, n * heads * hd, 2.0);
        let pos: Vec<u32> = (0..n).map(|i| if i == 0 { 0 } else { rng.random_range(0..131072) }).collect();
        let dpos = cx.upload(&pos).unwrap();
        let mut dx = cx.upload(&x).unwrap();
        let mut table = pagoda_kernels::RopeTable::new();
        table.fill(&pos, hd, theta);
        cpu.rope(&mut x, &table, heads);
        cx.rope(&mut dx, &dpos, heads, hd, theta).unwrap();
        worst = worst.max(max_err(&cx.download(&dx).unwrap(), &x));
    }
    report("rope", worst, 1e-5);
}

#[test]
fn silu_mul_matches_cpu() {
    let Some(cx) = gpu("silu_mul") else { return };
    let cpu = CpuBackend::new(0);
    let mut rng = StdRng::seed_from_u64(3);
    let mut worst = 0.0f32;
    for n in [1usize, 31, 1536, 100_003] {
        let mut g = rvec(&mut rng, n, 12.0);
        let u = rvec(&mut rng, n, 3.0);
        let mut dg = cx.upload(&g).unwrap();
        let du = cx.upload(&u).unwrap();
        cpu.silu_mul(&mut g, &u);
        cx.silu_mul(&mut dg, &du).unwrap();
        worst = worst.max(max_err(&cx.download(&dg).unwrap(), &g));
    }
    report("silu_mul", worst, 1e-6);
}

/// The fused kernels the GPU forward uses (RMSNorm to f16; the q|k|v split with RoPE; SiLU·mul to f16 from a
/// stacked gate|up) give exactly the bits of the plain kernels they fuse, which the tests above hold to their CPU
/// twins; a GEMM over stacked weights gives the parts' GEMMs.
#[test]
fn fused_kernels_equal_their_parts() {
    let Some(cx) = gpu("fused kernels") else { return };
    let mut rng = StdRng::seed_from_u64(31);
    for &(rows, dim) in &[(1, 64), (7, 576), (33, 2048)] {
        let x = cx.upload(&rvec(&mut rng, rows * dim, 3.0)).unwrap();
        let w = cx.upload(&rvec(&mut rng, dim, 1.5)).unwrap();
        let mut f32_out = cx.zeros::<f32>(rows * dim).unwrap();
        let (mut parts, mut fused) = (cx.zeros::<u16>(rows * dim).unwrap(), cx.zeros::<u16>(rows * dim).unwrap());
        cx.rmsnorm(&x, &w, 1e-5, &mut f32_out).unwrap();
        cx.f32_to_f16(&f32_out, &mut parts).unwrap();
        cx.rmsnorm_f16(&x, &w, 1e-5, &mut fused).unwrap();
        assert_eq!(cx.download(&fused).unwrap(), cx.download(&parts).unwrap(), "rmsnorm_f16 {rows}x{dim}");
    }
    // A stacked q|k|v output: split and rotated in one launch, or split on the host and rotated by rope.
    for &(n, heads, kv, hd, theta) in &[(1, 1, 1, 2, 10000.0), (5, 9, 3, 64, 10000.0), (4, 32, 8, 128, 500000.0)] {
        let (qd, kd) = (heads * hd, kv * hd);
        let qkv = rvec(&mut rng, n * (qd + 2 * kd), 2.0);
        let pos: Vec<u32> = (0..n).map(|_| rng.random_range(0..131072)).collect();
        let dpos = cx.upload(&pos).unwrap();
        let part = |lo: usize, w: usize| -> Vec<f32> {
            (0..n).flat_map(|r| qkv[r * (qd + 2 * kd) + lo..r * (qd + 2 * kd) + lo + w].to_vec()).collect()
        };
        let (mut q1, mut k1) = (cx.upload(&part(0, qd)).unwrap(), cx.upload(&part(qd, kd)).unwrap());
        cx.rope(&mut q1, &dpos, heads, hd, theta).unwrap();
        cx.rope(&mut k1, &dpos, kv, hd, theta).unwrap();
        let (mut q2, mut k2, mut v2) =
            (cx.zeros::<f32>(n * qd).unwrap(), cx.zeros::<f32>(n * kd).unwrap(), cx.zeros::<f32>(n * kd).unwrap());
        let dqkv = cx.upload(&qkv).unwrap();
        cx.rope_split_qkv(&dqkv, &mut q2, &mut k2, &mut v2, &dpos, (heads, kv), hd, theta).unwrap();
        assert_eq!(cx.download(&q2).unwrap(), cx.download(&q1).unwrap(), "rope_split_qkv q, {n}x{heads}x{hd}");
        assert_eq!(cx.download(&k2).unwrap(), cx.download(&k1).unwrap(), "rope_split_qkv k, {n}x{kv}x{hd}");
        assert_eq!(cx.download(&v2).unwrap(), part(qd + kd, kd), "rope_split_qkv v, {n}x{kv}x{hd}");
        let short = cx.zeros::<f32>(n * kd + 2).unwrap();
        assert!(cx.rope_split_qkv(&short, &mut q2, &mut k2, &mut v2, &dpos, (heads, kv), hd, theta).is_err());
    }
    // A stacked gate|up output: SiLU·mul to f16 straight from it, or SiLU·mul then f16 on the split halves.
    for &(rows, ffn) in &[(1, 32), (7, 1536), (33, 8192)] {
        let gu = rvec(&mut rng, rows * 2 * ffn, 6.0);
        let half = |lo: usize| -> Vec<f32> {
            (0..rows).flat_map(|r| gu[r * 2 * ffn + lo..r * 2 * ffn + lo + ffn].to_vec()).collect()
        };
        let (mut dg, du) = (cx.upload(&half(0)).unwrap(), cx.upload(&half(ffn)).unwrap());
        let (mut parts, mut fused) = (cx.zeros::<u16>(rows * ffn).unwrap(), cx.zeros::<u16>(rows * ffn).unwrap());
        cx.silu_mul(&mut dg, &du).unwrap();
        cx.f32_to_f16(&dg, &mut parts).unwrap();
        cx.silu_mul_stacked_f16(&cx.upload(&gu).unwrap(), ffn, &mut fused).unwrap();
        assert_eq!(cx.download(&fused).unwrap(), cx.download(&parts).unwrap(), "silu_mul_stacked_f16 {rows}x{ffn}");
    }
    // Stacked weights: one GEMM gives each part's GEMM, row by row (cuBLAS may tile the wider product
    // differently, so within f32 accumulation error).
    let mut worst = 0.0f32;
    for &(n, rows, cols) in &[(1, (64, 32), 64), (7, (576, 192), 576), (32, (1536, 1536), 576)] {
        let x = cx
            .upload(&rvec(&mut rng, n * cols, 1.0).iter().map(|&v| f16::from_f32(v).to_bits()).collect::<Vec<u16>>())
            .unwrap();
        let (a, b) = rows;
        let wa = QMatrix::quantize(WeightType::F16, a, cols, &rvec(&mut rng, a * cols, 1.0)).unwrap();
        let wb = QMatrix::quantize(WeightType::F16, b, cols, &rvec(&mut rng, b * cols, 1.0)).unwrap();
        let (da, db) = (CudaWeight::from_qmatrix(&cx, &wa).unwrap(), CudaWeight::from_qmatrix(&cx, &wb).unwrap());
        let stacked = CudaWeight::stacked(&cx, &[&da, &db]).unwrap();
        assert_eq!((stacked.rows(), stacked.cols()), (a + b, cols));
        let (mut ya, mut yb, mut y) =
            (cx.zeros::<f32>(n * a).unwrap(), cx.zeros::<f32>(n * b).unwrap(), cx.zeros::<f32>(n * (a + b)).unwrap());
        cx.gemm_f16(&da, &x, n, &mut ya).unwrap();
        cx.gemm_f16(&db, &x, n, &mut yb).unwrap();
        cx.gemm_f16(&stacked, &x, n, &mut y).unwrap();
        let (ya, yb, y) = (cx.download(&ya).unwrap(), cx.download(&yb).unwrap(), cx.download(&y).unwrap());
        let want: Vec<f32> = (0..n)
            .flat_map(|r| ya[r * a..(r + 1) * a].iter().chain(&yb[r * b..(r + 1) * b]).copied().collect::<Vec<f32>>())
            .collect();
        worst = worst.max(max_err(&y, &want));
    }
    assert!(CudaWeight::stacked(&cx, &[]).is_err());
    report("stacked weights' GEMM vs the parts' GEMMs", worst, 1e-3);
    report("fused rmsnorm / q|k|v split / silu_mul (exact)", 0.0, 0.0);
}

/// The GPU's greedy pick per row equals a strict `>` scan (the engine's `sampling::argmax`): first maximum, NaN
/// skipped, 0 for a row with nothing above -inf; across vocabulary sizes around the block width.
#[test]
fn argmax_rows_is_the_first_maximum() {
    let Some(cx) = gpu("argmax_rows") else { return };
    let mut rng = StdRng::seed_from_u64(71);
    let scan = |row: &[f32]| {
        let (mut best, mut best_v) = (0u32, f32::NEG_INFINITY);
        for (i, &v) in row.iter().enumerate() {
            if v > best_v {
                (best, best_v) = (i as u32, v);
            }
        }
        best
    };
    for vocab in [1usize, 31, 512, 513, 49_152, 128_256] {
        let rows = 6;
        let mut logits = rvec(&mut rng, rows * vocab, 8.0);
        // Row 1: ties at the maximum; row 2: NaNs around a maximum; row 3: all -inf; row 4: NaN and -inf only;
        // row 5: +inf twice.
        let row = |r: usize| r * vocab..(r + 1) * vocab;
        for i in row(1).step_by(7) {
            logits[i] = 100.0;
        }
        for i in row(2).step_by(3) {
            logits[i] = f32::NAN;
        }
        logits[row(3)].fill(f32::NEG_INFINITY);
        for (j, x) in logits[row(4)].iter_mut().enumerate() {
            *x = if j % 2 == 0 { f32::NAN } else { f32::NEG_INFINITY };
        }
        logits[row(5).end - 1] = f32::INFINITY;
        logits[row(5).start + vocab / 2] = f32::INFINITY;
        let want: Vec<u32> = (0..rows).map(|r| scan(&logits[row(r)])).collect();
        let dl = cx.upload(&logits).unwrap();
        let mut out = cx.zeros::<u32>(rows).unwrap();
        cx.argmax_rows(&dl, vocab, &mut out).unwrap();
        assert_eq!(cx.download(&out).unwrap(), want, "vocab {vocab}");
    }
    let dl = cx.zeros::<f32>(10).unwrap();
    assert!(cx.argmax_rows(&dl, 3, &mut cx.zeros::<u32>(3).unwrap()).is_err(), "10 is not 3 rows of 3");
    report("argmax_rows (exact)", 0.0, 0.0);
}

/// Q4_1 / Q8_0 / F16 / F32 weights: device dequantisation to f16 equals the CPU's rows rounded to f16.
#[test]
fn dequant_and_embedding_match_cpu() {
    let Some(cx) = gpu("dequant/embedding") else { return };
    let cpu = CpuBackend::new(0);
    let mut rng = StdRng::seed_from_u64(4);
    let mut worst = 0.0f32;
    for ty in [WeightType::F32, WeightType::F16, WeightType::Q4_1, WeightType::Q8_0] {
        for &(rows, cols) in &[(1, 32), (37, 96), (300, 576)] {
            let vals = rvec(&mut rng, rows * cols, 2.0);
            let w = QMatrix::quantize(ty, rows, cols, &vals).unwrap();
            let dw = CudaWeight::from_qmatrix(&cx, &w).unwrap();
            let got: Vec<f32> =
                cx.download(dw.data()).unwrap().into_iter().map(|b| f16::from_bits(b).to_f32()).collect();
            let mut want = vec![0.0; rows * cols];
            for (r, o) in want.chunks_exact_mut(cols).enumerate() {
                w.dequantize_row(r, o);
            }
            round16(&mut want);
            worst = worst.max(max_err(&got, &want));
            // Embedding: ids include out-of-range ones (zero rows on both sides).
            let ids: Vec<u32> =
                (0..11).map(|i| if i == 5 { rows as u32 + 3 } else { rng.random_range(0..rows as u32) }).collect();
            let mut want_e = vec![0.0; ids.len() * cols];
            cpu.embedding(&w, &ids, &mut want_e);
            round16(&mut want_e);
            let dids = cx.upload(&ids).unwrap();
            let mut de = cx.zeros::<f32>(ids.len() * cols).unwrap();
            cx.embedding(&dw, &dids, &mut de).unwrap();
            worst = worst.max(max_err(&cx.download(&de).unwrap(), &want_e));
        }
    }
    report("dequant+embedding", worst, 0.0);
}

/// cuBLAS GEMM against an f64 reference over the same f16-rounded inputs, and against the CPU twin.
#[test]
fn gemm_matches_reference_and_cpu() {
    let Some(cx) = gpu("gemm") else { return };
    let cpu = CpuBackend::new(0);
    let mut rng = StdRng::seed_from_u64(5);
    let (mut worst_ref, mut worst_cpu) = (0.0f32, 0.0f32);
    for &(n, rows, cols) in &[(1, 1, 32), (1, 64, 64), (7, 300, 576), (33, 1000, 1536), (64, 2048, 2048)] {
        let mut x = rvec(&mut rng, n * cols, 1.0);
        let vals = rvec(&mut rng, rows * cols, 1.0);
        let w = QMatrix::quantize(WeightType::F16, rows, cols, &vals).unwrap();
        let dw = CudaWeight::from_qmatrix(&cx, &w).unwrap();
        let dx = cx.upload(&x).unwrap();
        let mut dy = cx.zeros::<f32>(n * rows).unwrap();
        cx.matmul(&dw, &dx, n, &mut dy).unwrap();
        let got = cx.download(&dy).unwrap();
        let mut want_cpu = vec![0.0; n * rows];
        cpu.matmul(&w, &x, n, &mut want_cpu);
        round16(&mut x);
        let mut wr = vec![0.0; cols];
        for r in 0..rows {
            w.dequantize_row(r, &mut wr);
            for i in 0..n {
                let xr = &x[i * cols..(i + 1) * cols];
                let (dot, mag) = xr.iter().zip(&wr).fold((0.0f64, 0.0f64), |(d, m), (&a, &b)| {
                    (d + f64::from(a) * f64::from(b), m + f64::from((a * b).abs()))
                });
                let g = f64::from(got[i * rows + r]);
                worst_ref = worst_ref.max(((g - dot).abs() / (mag + 1e-6)) as f32);
                let c = f64::from(want_cpu[i * rows + r]);
                worst_cpu = worst_cpu.max(((g - c).abs() / (mag + 1e-6)) as f32);
            }
        }
    }
    // Relative to Σ|x·w|: f32 accumulation vs f64 (tight), and x rounded to f16 vs f32 x on the CPU (looser).
    report("gemm vs f64 reference (rel. to sum|xw|)", worst_ref, 1e-5);
    report("gemm vs CPU matmul (rel. to sum|xw|)", worst_cpu, 2e-3);
}

/// The accumulating GEMM (the o- and down-projections onto the residual stream) adds what the plain GEMM writes
/// (`gemm_matches_reference_and_cpu` checks that one against the CPU twin): `out + x·wᵀ`.
#[test]
fn gemm_accumulate_adds_the_product() {
    let Some(cx) = gpu("gemm_accumulate") else { return };
    let mut rng = StdRng::seed_from_u64(6);
    let mut worst = 0.0f32;
    for &(n, rows, cols) in &[(1, 64, 64), (5, 576, 1536), (32, 576, 576)] {
        let x = rvec(&mut rng, n * cols, 1.0);
        let residual = rvec(&mut rng, n * rows, 4.0);
        let w = QMatrix::quantize(WeightType::F16, rows, cols, &rvec(&mut rng, rows * cols, 0.1)).unwrap();
        let dw = CudaWeight::from_qmatrix(&cx, &w).unwrap();
        let xh: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let dxh = cx.upload(&xh).unwrap();
        let mut plain = cx.zeros::<f32>(n * rows).unwrap();
        cx.gemm_f16(&dw, &dxh, n, &mut plain).unwrap();
        let mut acc = cx.upload(&residual).unwrap();
        cx.gemm_f16_accumulate(&dw, &dxh, n, &mut acc).unwrap();
        let (plain, acc) = (cx.download(&plain).unwrap(), cx.download(&acc).unwrap());
        let sum: Vec<f32> = plain.iter().zip(&residual).map(|(p, r)| p + r).collect();
        worst = worst.max(max_err(&acc, &sum));
    }
    report("gemm_f16_accumulate vs gemm + add", worst, 1e-5);
}

/// A batch of sequences with per-kv-head tables drawn from a shuffled block pool.
struct Batch {
    tables: Vec<Vec<Vec<u32>>>,
    prior: Vec<Vec<usize>>,
    n_new: Vec<usize>,
    q_row: Vec<usize>,
    rows: usize,
    num_blocks: usize,
}

impl Batch {
    /// `specs`: (n_new, prior lens per kv-head).
    fn new(rng: &mut StdRng, specs: &[(usize, Vec<usize>)], bs: usize) -> Batch {
        let need: usize = specs.iter().map(|(n, p)| p.iter().map(|l| (l + n).div_ceil(bs) + 1).sum::<usize>()).sum();
        let num_blocks = need + 5;
        let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
        pool.shuffle(rng);
        let mut it = pool.into_iter();
        let (mut tables, mut prior, mut n_new, mut q_row) = (vec![], vec![], vec![], vec![]);
        let mut rows = 0;
        for (n, p) in specs {
            // One spare block per table: capacity beyond what is used must not matter.
            tables
                .push(p.iter().map(|l| (0..(l + n).div_ceil(bs) + 1).map(|_| it.next().unwrap()).collect()).collect());
            prior.push(p.clone());
            n_new.push(*n);
            q_row.push(rows);
            rows += n;
        }
        Batch { tables, prior, n_new, q_row, rows, num_blocks }
    }

    fn seqs(&self) -> Vec<AttnSeq<'_>> {
        (0..self.n_new.len())
            .map(|i| AttnSeq {
                q_row: self.q_row[i],
                n_new: self.n_new[i],
                tables: &self.tables[i],
                prior_lens: &self.prior[i],
            })
            .collect()
    }
}

fn random_cache(rng: &mut StdRng, num_blocks: usize, bs: usize, hd: usize) -> KvStorage {
    let mut kv = KvStorage::new(num_blocks, bs, hd);
    let (k, v) = kv.arenas_mut();
    for x in k.iter_mut().chain(v.iter_mut()) {
        *x = f16::from_f32(rng.random_range(-1.0f32..1.0)).to_f32();
    }
    kv
}

/// Runs GPU and CPU attention on the same batch; returns the max error over the batch's rows.
fn attention_case(cx: &CudaContext, rng: &mut StdRng, b: &Batch, kv: &KvStorage, n_heads: usize, n_kv: usize) -> f32 {
    let hd = kv.head_dim();
    let q = rvec(rng, b.rows * n_heads * hd, 1.0);
    let scale = 1.0 / (hd as f32).sqrt() * 2.0;
    let seqs = b.seqs();
    let mut want = vec![0.0; q.len()];
    CpuBackend::new(0).paged_attention(&q, kv, &seqs, n_heads, n_kv, scale, &mut want);
    let dkv = CudaKv::from_host(cx, kv).unwrap();
    let dq = cx.upload(&q).unwrap();
    let mut dout = cx.zeros::<f32>(q.len()).unwrap();
    cx.paged_attention(&dq, &dkv, &seqs, n_heads, n_kv, scale, &mut dout).unwrap();
    max_err(&cx.download(&dout).unwrap(), &want)
}

/// Plans staged into one step buffer (as the GPU forward stages every layer) and run with one lent split-K
/// workspace give exactly what one-shot attention gives: a decode batch, a prefill-only batch (no decode items,
/// so no decode launch whatever workspace it is lent) and a mixed one, in one buffer. A workspace too small for a
/// decode plan, or a buffer shorter than a plan, is refused.
#[test]
fn staged_plans_equal_one_shot_attention() {
    let Some(cx) = gpu("staged attention") else { return };
    let mut rng = StdRng::seed_from_u64(61);
    let (hd, nh, nkv, bs) = (64usize, 9usize, 3usize, 16usize);
    let batches = [
        Batch::new(&mut rng, &[(1, vec![300; nkv]), (1, vec![17, 5, 0]), (1, vec![2000; nkv])], bs),
        Batch::new(&mut rng, &[(40, vec![0; nkv]), (9, vec![64; nkv])], bs),
        Batch::new(&mut rng, &[(1, vec![100; nkv]), (20, vec![3; nkv])], bs),
    ];
    let num_blocks = batches.iter().map(|b| b.num_blocks).max().unwrap();
    let kv = random_cache(&mut rng, num_blocks, bs, hd);
    let dkv = CudaKv::from_host(&cx, &kv).unwrap();
    let scale = 0.125;
    let mut stage = Vec::new();
    let plans: Vec<_> =
        batches.iter().map(|b| cx.stage_attention(&dkv, &b.seqs(), b.rows, nh, nkv, &mut stage).unwrap()).collect();
    let meta = cx.upload(&stage).unwrap();
    let parts = plans.iter().map(|p| p.workspace_parts()).max().unwrap();
    assert!(parts > 0 && plans[1].workspace_parts() == 0);
    let (mut po, mut pml) = (cx.zeros::<f32>(parts * hd).unwrap(), cx.zeros::<f32>(parts * 2).unwrap());
    for (b, plan) in batches.iter().zip(&plans) {
        let q = cx.upload(&rvec(&mut rng, b.rows * nh * hd, 1.0)).unwrap();
        let mut want = cx.zeros::<f32>(b.rows * nh * hd).unwrap();
        cx.paged_attention(&q, &dkv, &b.seqs(), nh, nkv, scale, &mut want).unwrap();
        let mut got = cx.zeros::<f32>(b.rows * nh * hd).unwrap();
        cx.run_staged_attention(plan, &meta, Some((&mut po, &mut pml)), &q, &dkv, scale, &mut got).unwrap();
        assert_eq!(cx.download(&got).unwrap(), cx.download(&want).unwrap(), "staged plan of {} rows", b.rows);
    }
    let q = cx.upload(&vec![0.0f32; batches[0].rows * nh * hd]).unwrap();
    let mut out = cx.zeros::<f32>(q.len()).unwrap();
    let (mut small_o, mut small_ml) = (cx.zeros::<f32>(hd).unwrap(), cx.zeros::<f32>(2).unwrap());
    let small = Some((&mut small_o, &mut small_ml));
    assert!(cx.run_staged_attention(&plans[0], &meta, small, &q, &dkv, scale, &mut out).is_err());
    let short = cx.upload(&stage[..1]).unwrap();
    assert!(cx.run_staged_attention(&plans[0], &short, Some((&mut po, &mut pml)), &q, &dkv, scale, &mut out).is_err());
    // A cache too small for the plan's block ids is refused, not read past its end.
    let tiny = CudaKv::new(&cx, 1, bs, hd).unwrap();
    assert!(cx.run_staged_attention(&plans[0], &meta, Some((&mut po, &mut pml)), &q, &tiny, scale, &mut out).is_err());
    report("staged plans vs one-shot attention (exact)", 0.0, 0.0);
}

#[test]
fn decode_attention_matches_cpu() {
    let Some(cx) = gpu("decode attention") else { return };
    let mut rng = StdRng::seed_from_u64(6);
    let mut worst = 0.0f32;
    // (head_dim, n_heads, n_kv): GQA ratios 1, 3, 4 and 16 (two head groups per CTA).
    for &(hd, nh, nkv) in &[(64, 4, 4), (64, 9, 3), (128, 16, 4), (128, 12, 4), (256, 4, 1), (128, 32, 2)] {
        for &bs in &[16usize, 5] {
            let lens = [0usize, 1, 4, 15, 16, 17, 100, 1000, 4095];
            let specs: Vec<(usize, Vec<usize>)> = lens
                .iter()
                .map(|&l| (1, (0..nkv).map(|h| if h % 2 == 1 { l / 2 } else { l }).collect()))
                .chain(std::iter::once((1, vec![4095; nkv])))
                .chain(std::iter::once((3, vec![33; nkv])))
                .collect();
            let b = Batch::new(&mut rng, &specs, bs);
            let kv = random_cache(&mut rng, b.num_blocks, bs, hd);
            let e = attention_case(&cx, &mut rng, &b, &kv, nh, nkv);
            eprintln!("  decode hd={hd} heads={nh}/{nkv} bs={bs}: {e:.3e}");
            worst = worst.max(e);
        }
    }
    report("decode attention", worst, 2e-5);
}

#[test]
fn prefill_attention_matches_cpu() {
    let Some(cx) = gpu("prefill attention") else { return };
    let mut rng = StdRng::seed_from_u64(7);
    let mut worst = 0.0f32;
    for &(hd, nh, nkv) in &[(64, 9, 3), (128, 8, 8), (128, 16, 4), (256, 8, 2)] {
        for &bs in &[16usize, 7] {
            // Prefill chunks (n_new > 4) with and without prior context, one long, plus decode rows in the batch.
            let specs = vec![
                (5, vec![0; nkv]),
                (17, (0..nkv).map(|h| 3 * h).collect()),
                (64, vec![50; nkv]),
                (100, (0..nkv).map(|h| 1000 + h).collect()),
                (1, vec![200; nkv]),
                (300, vec![0; nkv]),
            ];
            let b = Batch::new(&mut rng, &specs, bs);
            let kv = random_cache(&mut rng, b.num_blocks, bs, hd);
            let e = attention_case(&cx, &mut rng, &b, &kv, nh, nkv);
            eprintln!("  prefill hd={hd} heads={nh}/{nkv} bs={bs}: {e:.3e}");
            worst = worst.max(e);
        }
    }
    report("prefill attention", worst, 2e-5);
}

/// kv_write, then attention over what was written, on both sides (one layer step).
#[test]
fn kv_write_then_attention_matches_cpu() {
    let Some(cx) = gpu("kv_write") else { return };
    let cpu = CpuBackend::new(0);
    let mut rng = StdRng::seed_from_u64(8);
    let (mut worst_kv, mut worst_attn) = (0.0f32, 0.0f32);
    for &(hd, nh, nkv, bs) in &[(64, 9, 3, 16), (128, 32, 8, 16), (128, 12, 4, 3)] {
        let specs =
            vec![(1, vec![37; nkv]), (20, vec![0; nkv]), (1, (0..nkv).map(|h| 5 * h).collect()), (6, vec![16; nkv])];
        let b = Batch::new(&mut rng, &specs, bs);
        let mut kv = random_cache(&mut rng, b.num_blocks, bs, hd);
        let mut k = rvec(&mut rng, b.rows * nkv * hd, 1.0);
        let mut v = rvec(&mut rng, b.rows * nkv * hd, 1.0);
        round16(&mut k);
        round16(&mut v);
        let seqs = b.seqs();
        let mut dkv = CudaKv::from_host(&cx, &kv).unwrap();
        let (dk, dv) = (cx.upload(&k).unwrap(), cx.upload(&v).unwrap());
        cpu.kv_write(&mut kv, &k, &v, &seqs, nkv);
        cx.kv_write(&mut dkv, &dk, &dv, &seqs, nkv).unwrap();
        let back = dkv.to_host(&cx).unwrap();
        worst_kv = worst_kv.max(max_err(back.arenas().0, kv.arenas().0)).max(max_err(back.arenas().1, kv.arenas().1));
        let q = rvec(&mut rng, b.rows * nh * hd, 1.0);
        let mut want = vec![0.0; q.len()];
        let scale = 1.0 / (hd as f32).sqrt();
        cpu.paged_attention(&q, &kv, &seqs, nh, nkv, scale, &mut want);
        let dq = cx.upload(&q).unwrap();
        let mut dout = cx.zeros::<f32>(q.len()).unwrap();
        cx.paged_attention(&dq, &dkv, &seqs, nh, nkv, scale, &mut dout).unwrap();
        worst_attn = worst_attn.max(max_err(&cx.download(&dout).unwrap(), &want));
    }
    report("kv_write", worst_kv, 0.0);
    report("kv_write+attention", worst_attn, 2e-5);
}

#[test]
fn copy_blocks_matches_cpu() {
    let Some(cx) = gpu("copy_blocks") else { return };
    let mut rng = StdRng::seed_from_u64(9);
    let mut worst = 0.0f32;
    for &(nb, bs, hd) in &[(64, 16, 128), (40, 5, 64), (10, 3, 3)] {
        let mut kv = random_cache(&mut rng, nb, bs, hd);
        let mut ids: Vec<u32> = (0..nb as u32).collect();
        ids.shuffle(&mut rng);
        let pairs: Vec<(u32, u32)> = (0..nb / 3).map(|i| (ids[2 * i], ids[2 * i + 1])).collect();
        let mut dkv = CudaKv::from_host(&cx, &kv).unwrap();
        for &(s, d) in &pairs {
            kv.copy_block(s, d);
        }
        cx.copy_blocks(&mut dkv, &pairs).unwrap();
        let back = dkv.to_host(&cx).unwrap();
        worst = worst.max(max_err(back.arenas().0, kv.arenas().0)).max(max_err(back.arenas().1, kv.arenas().1));
        // A chain (a destination that is also a source) is refused rather than applied in a racy order.
        assert!(cx.copy_blocks(&mut dkv, &[(0, 1), (1, 2)]).is_err());
        assert!(cx.copy_blocks(&mut dkv, &[(0, nb as u32)]).is_err());
    }
    report("copy_blocks", worst, 0.0);
}

/// Blocks out of the arenas into the tiers' packed layout and back: each entry is its block's K then V as f16 bits,
/// exactly the halves of the host arenas; written into other blocks, they round-trip; bad ids are refused.
#[test]
fn block_transfer_matches_the_host_arenas() {
    let Some(cx) = gpu("read_blocks/write_blocks") else { return };
    let mut rng = StdRng::seed_from_u64(19);
    for &(nb, bs, hd) in &[(64, 16, 64), (40, 5, 30), (3, 1, 1)] {
        let host = random_cache(&mut rng, nb, bs, hd);
        let dkv = CudaKv::from_host(&cx, &host).unwrap();
        let mut ids: Vec<u32> = (0..nb as u32).collect();
        ids.shuffle(&mut rng);
        let ids = &ids[..nb.div_ceil(2)];
        let packed = cx.read_blocks(&dkv, ids).unwrap();
        let bl = bs * hd;
        let (k, v) = host.arenas();
        let h = |x: &[f32]| x.iter().map(|&x| f16::from_f32(x).to_bits()).collect::<Vec<u16>>();
        for (i, &b) in ids.iter().enumerate() {
            let r = b as usize * bl..(b as usize + 1) * bl;
            assert_eq!(packed[2 * i * bl..(2 * i + 1) * bl], h(&k[r.clone()]), "K of block {b}");
            assert_eq!(packed[(2 * i + 1) * bl..(2 * i + 2) * bl], h(&v[r]), "V of block {b}");
        }
        let mut other = CudaKv::new(&cx, nb, bs, hd).unwrap();
        let dst: Vec<u32> = ids.iter().rev().copied().collect();
        cx.write_blocks(&mut other, &dst, &packed).unwrap();
        assert_eq!(cx.read_blocks(&other, &dst).unwrap(), packed);
        assert!(cx.read_blocks(&dkv, &[nb as u32]).is_err());
        assert!(cx.write_blocks(&mut other, &[0, 0], &vec![0; 4 * bl]).is_err());
        assert!(cx.write_blocks(&mut other, &[0], &vec![0; bl]).is_err());
    }
    eprintln!("parity read_blocks/write_blocks: bit-exact");
}

/// Slot moves as the policies make them (a table compacted to a random kept set, then a swap-remove) against
/// `KvStorage::compact_table` and `move_slot`, bit for bit; repeated destinations and slots past the arena are
/// refused.
#[test]
fn slot_moves_match_cpu() {
    let Some(cx) = gpu("move_slots") else { return };
    let mut rng = StdRng::seed_from_u64(23);
    for &(nb, bs, hd) in &[(48, 16, 64), (30, 5, 30)] {
        let mut kv = random_cache(&mut rng, nb, bs, hd);
        let mut dkv = CudaKv::from_host(&cx, &kv).unwrap();
        let mut blocks: Vec<u32> = (0..nb as u32).collect();
        blocks.shuffle(&mut rng);
        let table = &blocks[..nb / 2];
        let len = table.len() * bs - bs / 2;
        let addr = |i: usize| table[i / bs] * bs as u32 + (i % bs) as u32;
        let keep: Vec<u32> = (0..len as u32).filter(|_| rng.random_range(0..3) > 0).collect();
        kv.compact_table(table, len, &keep);
        let pairs: Vec<(u32, u32)> = keep.iter().enumerate().map(|(i, &k)| (addr(k as usize), addr(i))).collect();
        cx.move_slots(&mut dkv, &pairs).unwrap();
        let (last, victim) = (keep.len() - 1, keep.len() / 3);
        kv.move_slot(table[last / bs], last % bs, table[victim / bs], victim % bs);
        cx.move_slots(&mut dkv, &[(addr(last), addr(victim))]).unwrap();
        let back = dkv.to_host(&cx).unwrap();
        assert_eq!(back.arenas().0, kv.arenas().0, "K after the moves");
        assert_eq!(back.arenas().1, kv.arenas().1, "V after the moves");
        assert!(cx.move_slots(&mut dkv, &[(0, 1), (2, 1)]).is_err());
        assert!(cx.move_slots(&mut dkv, &[(0, (nb * bs) as u32)]).is_err());
    }
    eprintln!("parity move_slots: bit-exact");
}

/// KeyDiff's anchor sums (normalised keys over a slot range) against `scores::add_unit_keys` with the norms of
/// `scores::key_norms`, summed in f64 on the CPU and f32 on the GPU.
#[test]
fn unit_key_sums_match_cpu() {
    let Some(cx) = gpu("unit_key_sums") else { return };
    let mut rng = StdRng::seed_from_u64(29);
    let mut worst = 0.0f32;
    for &(nb, bs, hd) in &[(64, 16, 64), (40, 5, 30), (16, 16, 256)] {
        let kv = random_cache(&mut rng, nb, bs, hd);
        let dkv = CudaKv::from_host(&cx, &kv).unwrap();
        let mut blocks: Vec<u32> = (0..nb as u32).collect();
        blocks.shuffle(&mut rng);
        let (t1, t2) = blocks.split_at(nb / 2);
        let ranges = [
            SlotRange { table: t1, from: 0, to: t1.len() * bs - 1 },
            SlotRange { table: t2, from: bs + 1, to: t2.len() * bs },
            SlotRange { table: t2, from: 3, to: 3 },
        ];
        let got = cx.unit_key_sums(&dkv, &ranges, scores::COSINE_EPS).unwrap();
        for (r, got) in ranges.iter().zip(got.chunks_exact(hd)) {
            let mut norms = vec![0.0f32; r.to];
            scores::key_norms(&kv, r.table, r.from..r.to, &mut norms);
            let mut want = vec![0.0f64; hd];
            scores::add_unit_keys(&kv, r.table, r.from..r.to, &norms, 1.0, &mut want);
            let want: Vec<f32> = want.iter().map(|&x| x as f32).collect();
            worst = worst.max(max_err(got, &want));
        }
        assert!(cx.unit_key_sums(&dkv, &[SlotRange { table: t1, from: 2, to: 1 }], 1e-8).is_err());
    }
    report("unit_key_sums", worst, 1e-4);
}

/// Observation-window attention (SnapKV / H2O / SAGE-KV with power 1, KV-Compress with power 2, query counts with
/// power 0) against the CPU's `scores::window_attention_scores`: windows at the end of the context and causal
/// windows from slot 0, GQA groups 1 to 4, lengths off the block size.
#[test]
fn window_scores_match_cpu() {
    let Some(cx) = gpu("window scores") else { return };
    let mut rng = StdRng::seed_from_u64(12);
    let mut worst = 0.0f32;
    for &(bs, hd) in &[(16usize, 128usize), (5, 64), (16, 64)] {
        let lens = [1usize, 17, 300, 1000];
        let specs: Vec<(usize, Vec<usize>)> = lens.iter().map(|&l| (0, vec![l])).collect();
        let b = Batch::new(&mut rng, &specs, bs);
        let kv = random_cache(&mut rng, b.num_blocks, bs, hd);
        let dkv = CudaKv::from_host(&cx, &kv).unwrap();
        for &(group, n_q, power, at_end) in
            &[(1usize, 1usize, 1u32, true), (3, 8, 2, true), (4, 8, 1, false), (3, 2, 0, true), (1, 16, 2, false)]
        {
            let queries: Vec<Vec<f32>> = lens.iter().map(|_| rvec(&mut rng, n_q * group * hd, 1.0)).collect();
            let firsts: Vec<usize> = lens.iter().map(|&l| if at_end { l.saturating_sub(n_q) } else { 0 }).collect();
            let entries: Vec<WindowEntry<'_>> = (0..lens.len())
                .map(|i| WindowEntry {
                    table: &b.tables[i][0],
                    len: lens[i],
                    q: &queries[i],
                    n_q,
                    first_q_slot: firsts[i],
                })
                .collect();
            let scale = 1.0 / (hd as f32).sqrt();
            let got = cx.window_attention_scores(&dkv, &entries, group, scale, power).unwrap();
            let mut probs = Vec::new();
            for (i, e) in entries.iter().enumerate() {
                let mut want = vec![0.0f32; e.len];
                pagoda_kernels::scores::window_attention_scores(
                    &kv,
                    e.table,
                    e.len,
                    pagoda_kernels::scores::Window { q: e.q, n_q, group, scale, first_q_slot: e.first_q_slot, power },
                    &mut probs,
                    &mut want,
                );
                let g = &got.score[got.offsets[i]..got.offsets[i + 1]];
                worst = worst.max(max_err(g, &want));
            }
        }
    }
    report("window attention scores", worst, 1e-4);
    // Bad input is an error, not a launch.
    let kv = CudaKv::new(&cx, 4, 16, 64).unwrap();
    let q = vec![0.0f32; 64];
    let e = [WindowEntry { table: &[0, 1], len: 20, q: &q, n_q: 1, first_q_slot: 19 }];
    assert!(cx.window_attention_scores(&kv, &e, 2, 1.0, 1).is_err(), "q of the wrong size");
    assert!(cx.window_attention_scores(&kv, &e, 1, 1.0, 99).is_err(), "power out of range");
    let far = [WindowEntry { table: &[0, 7], len: 20, q: &q, n_q: 1, first_q_slot: 19 }];
    assert!(cx.window_attention_scores(&kv, &far, 1, 1.0, 1).is_err(), "block out of range");
}

/// int8, fp8 e4m3, int4_kivi and int2_kivi block encoding on the GPU gives the CPU encoder's bytes exactly
/// (header, scales and mins, codes, the zeros past `filled`), and decoding CPU-encoded blocks on the GPU gives
/// `decode_block`'s values rounded to f16.
#[test]
fn codecs_match_cpu_bit_for_bit() {
    use pagoda_kernels::codec::{Codec, decode_block};
    let Some(cx) = gpu("codecs") else { return };
    let mut rng = StdRng::seed_from_u64(13);
    // head_dim 30: one partial KIVI value group, and a shape int2_kivi refuses.
    for &(bs, hd) in &[(16usize, 64usize), (16, 128), (5, 96), (5, 30)] {
        let nb = 12;
        let mut kv = random_cache(&mut rng, nb, bs, hd);
        // A block of zeros (scale 0) and a block with one large value (fp8 saturation, int8 clamping).
        kv.block_k_mut(3).fill(0.0);
        kv.block_v_mut(4)[7] = 300.0;
        let dkv = CudaKv::from_host(&cx, &kv).unwrap();
        let blocks: Vec<(u32, usize)> = vec![(0, bs), (1, 1), (3, bs), (4, bs - 1), (6, 0), (11, bs)];
        for codec in GPU_CODECS {
            let Ok(len) = codec.encoded_len(bs, hd) else {
                // int2_kivi packs four channels per byte: a head_dim it cannot take is refused, not launched.
                assert!(cx.encode_blocks(&dkv, codec, &blocks).is_err(), "{codec} {bs}x{hd}");
                continue;
            };
            let got = cx.encode_blocks(&dkv, codec, &blocks).unwrap();
            assert_eq!(got.len(), blocks.len() * len);
            let mut want = vec![0u8; blocks.len() * len];
            for (i, &(b, f)) in blocks.iter().enumerate() {
                let (k, v) = (&kv.block_k(b)[..f * hd], &kv.block_v(b)[..f * hd]);
                codec.encode_block(bs, hd, k, v, &mut want[i * len..(i + 1) * len]).unwrap();
            }
            if got != want {
                // Say where: the first differing bytes (offset in the encoded block, GPU, CPU), and whether a block
                // encoded alone differs too (one launch per block rules out interference between blocks).
                let diffs: Vec<(usize, usize, u8, u8)> = got
                    .iter()
                    .zip(&want)
                    .enumerate()
                    .filter(|(_, (g, w))| g != w)
                    .take(12)
                    .map(|(i, (&g, &w))| (i / len, i % len, g, w))
                    .collect();
                let alone: Vec<bool> = blocks
                    .iter()
                    .enumerate()
                    .map(|(i, b)| cx.encode_blocks(&dkv, codec, &[*b]).unwrap()[..] != want[i * len..(i + 1) * len])
                    .collect();
                panic!(
                    "{codec} {bs}x{hd}: GPU bytes differ from the CPU encoder's: (block, offset, gpu, cpu) {diffs:?}; \
                     differing when encoded alone: {alone:?}"
                );
            }

            // Decode the CPU's bytes into other blocks of a GPU arena.
            let mut back = CudaKv::new(&cx, nb, bs, hd).unwrap();
            let dst: Vec<u32> = (0..blocks.len() as u32).map(|i| nb as u32 - 1 - i).collect();
            cx.decode_blocks(&mut back, codec, &want, &dst).unwrap();
            let host = back.to_host(&cx).unwrap();
            let (mut k, mut v) = (vec![0.0f32; bs * hd], vec![0.0f32; bs * hd]);
            for (i, &d) in dst.iter().enumerate() {
                decode_block(&want[i * len..(i + 1) * len], &mut k, &mut v).unwrap();
                round16(&mut k);
                round16(&mut v);
                assert_eq!(host.block_k(d), &k[..], "{codec}: decoded K of block {i}");
                assert_eq!(host.block_v(d), &v[..], "{codec}: decoded V of block {i}");
            }

            // Refusals: a corrupt scale, the wrong codec, a destination twice, a short buffer.
            let mut bad = want[..len].to_vec();
            // The first scale of the K half: an f32 for the 8-bit codecs, an f16 for KIVI.
            if matches!(codec, Codec::Int8 | Codec::Fp8E4m3) {
                bad[16..20].copy_from_slice(&f32::NAN.to_le_bytes());
            } else {
                bad[16..18].copy_from_slice(&f16::NAN.to_le_bytes());
            }
            assert!(cx.decode_blocks(&mut back, codec, &bad, &[0]).is_err());
            let other = if codec == Codec::Int8 { Codec::Int4Kivi } else { Codec::Int8 };
            assert!(cx.decode_blocks(&mut back, other, &want[..len], &[0]).is_err());
            assert!(cx.decode_blocks(&mut back, codec, &want[..2 * len], &[0, 0]).is_err());
            assert!(cx.decode_blocks(&mut back, codec, &want[..len - 1], &[0]).is_err());
        }
        assert!(cx.encode_blocks(&dkv, Codec::F16, &blocks).is_err(), "lossless formats stay on the host");
        assert!(cx.encode_blocks(&dkv, Codec::Int8, &[(nb as u32, 1)]).is_err());
        assert!(cx.encode_blocks(&dkv, Codec::Int8, &[(0, bs + 1)]).is_err());
    }
    report("int8/fp8/KIVI encode and decode (exact)", 0.0, 0.0);
}

/// Dequantise-on-load attention on the GPU against the CPU's (`paged_attention_encoded`) over the same encoded
/// arena, for every GPU codec: decode rows at edge lengths and a prefill chunk, GQA 3 and 4, two block sizes.
#[test]
fn encoded_attention_matches_cpu() {
    use pagoda_kernels::codec::{Codec, EncodedKv};
    let Some(cx) = gpu("encoded attention") else { return };
    let mut rng = StdRng::seed_from_u64(14);
    let mut worst = 0.0f32;
    for &(hd, nh, nkv) in &[(64usize, 9usize, 3usize), (128, 16, 4)] {
        for &bs in &[16usize, 5] {
            let specs: Vec<(usize, Vec<usize>)> = [0usize, 1, 15, 16, 17, 300]
                .iter()
                .map(|&l| (1, (0..nkv).map(|h| if h % 2 == 1 { l / 2 } else { l }).collect()))
                .chain(std::iter::once((7, vec![40; nkv])))
                .collect();
            let b = Batch::new(&mut rng, &specs, bs);
            let kv = random_cache(&mut rng, b.num_blocks, bs, hd);
            let q = rvec(&mut rng, b.rows * nh * hd, 1.0);
            let scale = 1.0 / (hd as f32).sqrt() * 2.0;
            let seqs = b.seqs();
            for codec in GPU_CODECS {
                let mut ekv = EncodedKv::new(codec, b.num_blocks, bs, hd).unwrap();
                for blk in 0..b.num_blocks {
                    ekv.store(blk, kv.block_k(blk as u32), kv.block_v(blk as u32)).unwrap();
                }
                let mut want = vec![0.0; q.len()];
                CpuBackend::new(0).paged_attention_encoded(&q, &ekv, &seqs, nh, nkv, scale, &mut want);
                let dkv = pagoda_kernels::cuda::CudaEncodedKv::from_host(&cx, &ekv).unwrap();
                let dq = cx.upload(&q).unwrap();
                let mut dout = cx.zeros::<f32>(q.len()).unwrap();
                cx.paged_attention_encoded(&dq, &dkv, &seqs, nh, nkv, scale, &mut dout).unwrap();
                let e = max_err(&cx.download(&dout).unwrap(), &want);
                eprintln!("  encoded {codec} hd={hd} heads={nh}/{nkv} bs={bs}: {e:.3e}");
                worst = worst.max(e);
            }
            // A plan replays, and runs only over blocks of the codec and shape it was made for.
            let mut plans = Vec::new();
            for codec in [Codec::Int8, Codec::Fp8E4m3] {
                let mut ekv = EncodedKv::new(codec, b.num_blocks, bs, hd).unwrap();
                for blk in 0..b.num_blocks {
                    ekv.store(blk, kv.block_k(blk as u32), kv.block_v(blk as u32)).unwrap();
                }
                let dkv = pagoda_kernels::cuda::CudaEncodedKv::from_host(&cx, &ekv).unwrap();
                let plan = cx.plan_attention_encoded(&dkv, &seqs, b.rows, nh, nkv).unwrap();
                plans.push((plan, dkv));
            }
            let dq = cx.upload(&q).unwrap();
            let (mut first, mut again) = (cx.zeros::<f32>(q.len()).unwrap(), cx.zeros::<f32>(q.len()).unwrap());
            let (plan, dkv) = &mut plans[0];
            cx.run_attention_encoded(plan, &dq, dkv, scale, &mut first).unwrap();
            cx.run_attention_encoded(plan, &dq, dkv, scale, &mut again).unwrap();
            assert_eq!(cx.download(&first).unwrap(), cx.download(&again).unwrap(), "a replayed plan differs");
            let (int8, fp8) = plans.split_at_mut(1);
            assert!(cx.run_attention_encoded(&mut int8[0].0, &dq, &fp8[0].1, scale, &mut first).is_err());
            // So is an arena of the plan's codec and shape with fewer blocks than its tables name.
            let mut one = EncodedKv::new(Codec::Int8, 1, bs, hd).unwrap();
            one.store(0, kv.block_k(0), kv.block_v(0)).unwrap();
            let one = pagoda_kernels::cuda::CudaEncodedKv::from_host(&cx, &one).unwrap();
            assert!(cx.run_attention_encoded(&mut int8[0].0, &dq, &one, scale, &mut first).is_err());
            // A block that holds fewer slots than attention reads is refused before the launch.
            let mut short = EncodedKv::new(Codec::Int8, b.num_blocks, bs, hd).unwrap();
            short.store(0, &kv.block_k(0)[..hd], &kv.block_v(0)[..hd]).unwrap();
            let dshort = pagoda_kernels::cuda::CudaEncodedKv::from_host(&cx, &short).unwrap();
            let dq = cx.upload(&q).unwrap();
            let mut dout = cx.zeros::<f32>(q.len()).unwrap();
            assert!(cx.paged_attention_encoded(&dq, &dshort, &seqs, nh, nkv, scale, &mut dout).is_err());
        }
    }
    let lossless = EncodedKv::new(Codec::F16, 2, 16, 64).unwrap();
    assert!(pagoda_kernels::cuda::CudaEncodedKv::from_host(&cx, &lossless).is_err());
    report("encoded (dequantise-on-load) attention", worst, 1e-4);
}

/// The device for an NCCL test, or `None` (with the reason printed) without a GPU or without libnccl.
fn nccl_gpu(test: &str) -> Option<MutexGuard<'static, CudaContext>> {
    let cx = gpu(test)?;
    if !pagoda_kernels::cuda::nccl_available() {
        eprintln!("{test}: skipped: libnccl is not on the library path");
        return None;
    }
    Some(cx)
}

/// The NCCL path as far as one GPU allows: a communicator of one rank linked to itself sends blocks of one arena
/// and receives them into other blocks of another in one grouped exchange, bit for bit; bad block lists are
/// refused before any NCCL call. (Two ranks need two GPUs: NCCL refuses two ranks of one communicator on one
/// device.)
#[test]
fn nccl_link_moves_blocks_to_itself() {
    use pagoda_kernels::cuda::{NcclLink, NcclUniqueId};
    let Some(cx) = nccl_gpu("nccl") else { return };
    let mut rng = StdRng::seed_from_u64(15);
    let (nb, bs, hd) = (9, 16, 64);
    let src_host = random_cache(&mut rng, nb, bs, hd);
    let src = CudaKv::from_host(&cx, &src_host).unwrap();
    let mut dst = CudaKv::new(&cx, nb, bs, hd).unwrap();
    let id = NcclUniqueId::new().unwrap();
    let link = NcclLink::connect(cx.stream(), &id, 0, 1, 0, Duration::from_secs(30), None).unwrap();
    let (from, to) = ([3u32, 1, 7, 8], [0u32, 5, 2, 8]);
    link.exchange(Some((&src, &from)), Some((&mut dst, &to))).unwrap();
    cx.synchronize().unwrap();
    let got = dst.to_host(&cx).unwrap();
    for (&f, &t) in from.iter().zip(&to) {
        assert_eq!(got.block_k(t), src_host.block_k(f), "K of block {f} -> {t}");
        assert_eq!(got.block_v(t), src_host.block_v(f), "V of block {f} -> {t}");
    }
    assert!(link.exchange(None, Some((&mut dst, &[0, 0]))).is_err(), "a destination twice");
    assert!(link.exchange(Some((&src, &[nb as u32])), None).is_err(), "a block outside the arena");
    assert!(
        NcclLink::connect(cx.stream(), &id, 1, 1, 0, Duration::from_secs(1), None).is_err(),
        "rank outside the world"
    );
    report("nccl self exchange (exact)", 0.0, 0.0);
}

/// A peer that never joins cannot hang the joining thread: rank 0 of a world of two, alone, gives up at its
/// deadline with `NcclTimeout` (and its half-built communicator is aborted), or at once when told to cancel.
#[test]
fn nccl_connect_gives_up_on_a_peer_that_never_joins() {
    use pagoda_kernels::cuda::{CudaError, NcclLink, NcclUniqueId};
    use std::sync::atomic::AtomicBool;
    let Some(cx) = nccl_gpu("nccl timeout") else { return };
    let id = NcclUniqueId::new().unwrap();
    let started = std::time::Instant::now();
    let err = NcclLink::connect(cx.stream(), &id, 0, 2, 1, Duration::from_secs(2), None).unwrap_err();
    let waited = started.elapsed();
    assert!(matches!(err, CudaError::NcclTimeout { .. }), "{err}");
    assert!(waited >= Duration::from_secs(2) && waited < Duration::from_secs(10), "gave up after {waited:?}");
    let cancel = AtomicBool::new(true);
    let started = std::time::Instant::now();
    let id = NcclUniqueId::new().unwrap();
    assert!(NcclLink::connect(cx.stream(), &id, 0, 2, 1, Duration::from_secs(60), Some(&cancel)).is_err());
    assert!(started.elapsed() < Duration::from_secs(10), "a cancelled join returns promptly");
    report("nccl join timeout and cancel", 0.0, 0.0);
}

/// The byte pipe the peer tier uses between GPU workers, on one GPU: a one-rank loopback moves byte strings of
/// several lengths (one byte, odd sizes, the whole capacity) from host through device staging and back, exactly,
/// and refuses more than its capacity.
#[test]
fn nccl_pipe_moves_bytes_to_itself() {
    use pagoda_kernels::cuda::NcclPipe;
    let Some(_cx) = nccl_gpu("nccl pipe") else { return };
    let cap = 1 << 20;
    let mut pipe = NcclPipe::loopback(0, cap, Duration::from_secs(30)).unwrap();
    let mut rng = StdRng::seed_from_u64(16);
    let mut got = Vec::new();
    for len in [1usize, 4093, 65_536, cap] {
        let sent: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        pipe.transfer(Some(&sent), Some((len, &mut got)), Duration::from_secs(30)).unwrap();
        assert_eq!(got, sent, "{len} bytes");
    }
    let too_big = vec![0u8; cap + 1];
    assert!(pipe.transfer(Some(&too_big), Some((cap + 1, &mut got)), Duration::from_secs(1)).is_err());
    report("nccl pipe loopback (exact)", 0.0, 0.0);
}

#[test]
fn policy_scores_match_reference() {
    let Some(cx) = gpu("policy scores") else { return };
    let mut rng = StdRng::seed_from_u64(10);
    let (mut worst_n, mut worst_c) = (0.0f32, 0.0f32);
    for &(bs, hd) in &[(16usize, 128usize), (5, 64), (16, 40)] {
        let specs = vec![(0, vec![1, 0, 17]), (0, vec![300, 4096, 16])];
        let b = Batch::new(&mut rng, &specs, bs);
        let mut kv = random_cache(&mut rng, b.num_blocks, bs, hd);
        // One all-zero key slot: its ratio must follow the documented rule.
        let z = b.tables[0][0][0];
        kv.block_k_mut(z)[..hd].fill(0.0);
        let entries: Vec<ScoreEntry<'_>> = (0..2)
            .flat_map(|s| (0..3).map(move |h| (s, h)))
            .map(|(s, h)| ScoreEntry { table: &b.tables[s][h], len: b.prior[s][h] })
            .collect();
        let anchors = rvec(&mut rng, entries.len() * hd, 1.0);
        let dkv = CudaKv::from_host(&cx, &kv).unwrap();
        let norms = cx.slot_norms(&dkv, &entries).unwrap();
        let cos = cx.anchor_cosine(&dkv, &entries, &anchors).unwrap();
        assert_eq!(norms.offsets, cos.offsets);
        for (e, ent) in entries.iter().enumerate() {
            let an = &anchors[e * hd..(e + 1) * hd];
            let na = an.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            for t in 0..ent.len {
                let blk = ent.table[t / bs];
                let off = (t % bs) * hd;
                let k = &kv.block_k(blk)[off..off + hd];
                let v = &kv.block_v(blk)[off..off + hd];
                let nk = k.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
                let nv = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
                let ratio = if nk > 0.0 { nv / nk } else { f64::INFINITY };
                let dot: f64 = k.iter().zip(an).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                let c = if nk > 0.0 && na > 0.0 { dot / (nk * na) } else { 0.0 };
                let i = norms.offsets[e] + t;
                worst_n = worst_n.max(((f64::from(norms.knorm[i]) - nk).abs() / (1.0 + nk)) as f32);
                if ratio.is_finite() {
                    worst_n = worst_n.max(((f64::from(norms.score[i]) - ratio).abs() / (1.0 + ratio)) as f32);
                } else {
                    assert!(norms.score[i].is_infinite(), "zero key: ratio must be +inf");
                }
                worst_c = worst_c.max((f64::from(cos.score[i]) - c).abs() as f32);
            }
        }
    }
    report("slot norms (||K||, ||V||/||K||)", worst_n, 1e-5);
    report("anchor cosine", worst_c, 1e-5);
}

#[test]
fn invalid_inputs_are_errors() {
    let Some(cx) = gpu("invalid inputs") else { return };
    let kv = CudaKv::new(&cx, 4, 16, 96).unwrap();
    let tables = vec![vec![0u32]];
    let seqs = [AttnSeq { q_row: 0, n_new: 1, tables: &tables, prior_lens: &[3] }];
    let q = cx.zeros::<f32>(96).unwrap();
    let mut out = cx.zeros::<f32>(96).unwrap();
    // head_dim 96 has no kernel instantiation.
    assert!(cx.paged_attention(&q, &kv, &seqs, 1, 1, 1.0, &mut out).is_err());
    let kv = CudaKv::new(&cx, 4, 16, 64).unwrap();
    let q = cx.zeros::<f32>(64).unwrap();
    let mut out = cx.zeros::<f32>(64).unwrap();
    // The table is too short for prior_len + n_new = 20 slots.
    let seqs = [AttnSeq { q_row: 0, n_new: 1, tables: &tables, prior_lens: &[19] }];
    assert!(cx.paged_attention(&q, &kv, &seqs, 1, 1, 1.0, &mut out).is_err());
    // Block index out of range.
    let bad = vec![vec![9u32]];
    let seqs = [AttnSeq { q_row: 0, n_new: 1, tables: &bad, prior_lens: &[0] }];
    assert!(cx.paged_attention(&q, &kv, &seqs, 1, 1, 1.0, &mut out).is_err());
    eprintln!("parity invalid inputs: rejected as errors");
}
