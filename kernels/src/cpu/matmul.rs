//! Matmul driver: quantises the activations once per call into Q8_1 (reusing a thread-local scratch), splits the
//! output rows across the pool in large chunks, and runs the per-ISA row kernels (for Q4_1 and Q8_0 on AVX-512
//! VNNI over the weights repacked into 16-row groups, and in bf16 when the backend asks for it: AMX tiles, or
//! AVX-512 BF16 dot products).

#[cfg(target_arch = "x86_64")]
use super::Bf16Kernel;
use super::{CpuBackend, Simd, SyncPtr, scalar};
#[cfg(target_arch = "x86_64")]
use super::{amx, avx2, avx512, bf16_dot};
use crate::quant::{BlockQ8_1x4, Q4_1X16_ROWS, QData, QK, QMatrix, q8_1x4_len, quantize_rows_q8_1x4};
#[cfg(target_arch = "x86_64")]
use avx512::Packed;
use std::cell::Cell;

thread_local! {
    /// Quantised activations of the current call, kept between calls to avoid reallocating.
    static XQ: Cell<Vec<BlockQ8_1x4>> = const { Cell::new(Vec::new()) };
    /// The same activations in bf16, for backends that run the matmuls in bf16.
    #[cfg(target_arch = "x86_64")]
    static XT: Cell<Vec<amx::Align64>> = const { Cell::new(Vec::new()) };
}

/// Below this many multiply-adds a call runs on the calling thread only.
const PAR_MIN_WORK: usize = 1 << 16;

/// `out[n][w.rows()] = x[n][w.cols()] · wᵀ`.
pub fn matmul(be: &CpuBackend, w: &QMatrix, x: &[f32], n: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), n * cols, "matmul: x must be [n][cols]");
    assert_eq!(out.len(), n * rows, "matmul: out must be [n][rows]");
    if n == 0 || rows == 0 {
        return;
    }
    let simd = be.simd();
    #[cfg(target_arch = "x86_64")]
    if let Some(kernel) = be.bf16_kernel()
        && let Some(tiles) = w.bf16_weights()
    {
        let nb = cols / QK;
        let mut xt = XT.take();
        // No clear: pack_activations writes every unit, padding included, so only newly grown units need a value.
        xt.resize(amx::act_len(n, cols), amx::Align64::default());
        // SAFETY: a bf16 kernel implies AVX-512 F/BW, BF16 and F16C were detected; xt has act_len(n, cols) units.
        unsafe { amx::pack_activations(x, n, cols, &mut xt) };
        run_rows(be, rows, n * cols, Q4_1X16_ROWS, out, &|r0, r1, o| match kernel {
            // SAFETY: Tiles is only selected when AMX was detected and the tile state granted; `tiles` is `w`
            // widened; xt holds n rows of nb blocks; rows r0..r1 (r0 a multiple of 16) belong to this task.
            Bf16Kernel::Tiles => unsafe { amx::quant_rows(tiles, nb, &xt, n, r0, r1, o, rows) },
            // SAFETY: Dot is only selected after bf16_dot::available(); the rest as above.
            Bf16Kernel::Dot => unsafe { bf16_dot::quant_rows(tiles, nb, &xt, n, r0, r1, o, rows) },
        });
        XT.set(xt);
        return;
    }
    match &w.data {
        QData::Q4_1(_) | QData::Q8_0(_) => {
            let mut xq = XQ.take();
            xq.clear();
            xq.resize(q8_1x4_len(n, cols), BlockQ8_1x4::default());
            quantize_rows_on_pool(be, x, n, cols, &mut xq);
            match (simd, w.x16_for(simd)) {
                #[cfg(target_arch = "x86_64")]
                (Simd::Avx512, Some(packed)) => {
                    let nb = cols / QK;
                    let kind = packed_kind(w);
                    run_rows(be, rows, n * cols, Q4_1X16_ROWS, out, &|r0, r1, o| {
                        // SAFETY: `packed` is `w` repacked for `kind`; xq holds n rows of nb blocks; rows r0..r1
                        // (r0 a multiple of 16) belong to this task; Simd::Avx512 is only selected after detection.
                        unsafe { avx512::quant_rows_x16(kind, packed, rows, nb, &xq, n, r0, r1, o.get(), rows) }
                    });
                }
                _ => run_rows(be, rows, n * cols, 4, out, &|r0, r1, o| quant_rows(simd, w, &xq, n, r0, r1, o)),
            }
            XQ.set(xq);
        }
        QData::F32(_) | QData::F16(_) => {
            run_rows(be, rows, n * cols, 4, out, &|r0, r1, o| float_rows(simd, w, x, n, r0, r1, o));
        }
    }
}

/// Most weights [`matmul_shared_input`] runs as one job (a layer's Q, K and V).
const MAX_SHARED: usize = 4;

/// `outs[i][n][ws[i].rows()] = x[n][cols] · ws[i]ᵀ` for weights that read the same activations. On the VNNI
/// path the activations are quantised once and every weight's row chunks go to the pool as one job: separate
/// calls would quantise `x` once per weight and wait for the pool's slowest task once per weight. Other paths,
/// and weights of different widths, run [`matmul`] per weight (bit-identical either way: the same kernel sees the
/// same quantised rows).
pub fn matmul_shared_input(be: &CpuBackend, ws: &[&QMatrix], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
    assert_eq!(ws.len(), outs.len(), "matmul_shared_input: one output per weight");
    #[cfg(target_arch = "x86_64")]
    if be.simd() == Simd::Avx512 && be.bf16_kernel().is_none() && (2..=MAX_SHARED).contains(&ws.len()) && n > 0 {
        let cols = ws[0].cols();
        let mut packed: [&[u8]; MAX_SHARED] = [&[]; MAX_SHARED];
        let fusable = ws
            .iter()
            .zip(packed.iter_mut())
            .all(|(w, p)| w.cols() == cols && w.rows() > 0 && w.x16_for(Simd::Avx512).map(|x16| *p = x16).is_some());
        if fusable {
            return shared_vnni(be, ws, &packed[..ws.len()], x, n, outs);
        }
    }
    for (w, out) in ws.iter().zip(outs.iter_mut()) {
        matmul(be, w, x, n, out);
    }
}

/// Which repacked format the VNNI kernel reads for `w` (Q4_1 or Q8_0 weights).
#[cfg(target_arch = "x86_64")]
fn packed_kind(w: &QMatrix) -> Packed {
    if matches!(w.data, QData::Q8_0(_)) { Packed::Q8_0 } else { Packed::Q4_1 }
}

/// One weight of a [`shared_vnni`] job: its repacked rows and their format, its output, and its rows' chunk
/// length and count.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct SharedPart<'a> {
    rows: usize,
    kind: Packed,
    packed: &'a [u8],
    out: SyncPtr,
    step: usize,
    chunks: usize,
}

/// The fused VNNI path of [`matmul_shared_input`]: every weight is Q4_1 or Q8_0, `packed` its 16-row repacking,
/// and all are as wide as the first.
#[cfg(target_arch = "x86_64")]
fn shared_vnni(be: &CpuBackend, ws: &[&QMatrix], packed: &[&[u8]], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
    let cols = ws[0].cols();
    assert_eq!(x.len(), n * cols, "matmul: x must be [n][cols]");
    let nb = cols / QK;
    let mut xq = XQ.take();
    xq.clear();
    xq.resize(q8_1x4_len(n, cols), BlockQ8_1x4::default());
    quantize_rows_on_pool(be, x, n, cols, &mut xq);
    // Per weight: its packed rows, output, chunk length in rows and chunk count; task t runs chunk t of the
    // concatenation. No allocation: at most MAX_SHARED weights.
    let mut parts: [Option<SharedPart<'_>>; MAX_SHARED] = [None; MAX_SHARED];
    let threads = be.threads();
    let total_rows: usize = ws.iter().map(|w| w.rows()).sum();
    let parallel = threads > 1 && total_rows.saturating_mul(n * cols) >= PAR_MIN_WORK;
    let mut tasks = 0;
    for (i, ((w, &packed), out)) in ws.iter().zip(packed).zip(outs.iter_mut()).enumerate() {
        let rows = w.rows();
        assert_eq!(out.len(), n * rows, "matmul: out must be [n][rows]");
        // As run_rows splits one weight: a few chunks per thread, 16-row aligned, here in proportion to its rows.
        let chunks =
            if parallel { (threads * 4 * rows).div_ceil(total_rows).min(rows / Q4_1X16_ROWS).max(1) } else { 1 };
        let step = rows.div_ceil(chunks).next_multiple_of(Q4_1X16_ROWS);
        let chunks = rows.div_ceil(step);
        parts[i] = Some(SharedPart { rows, kind: packed_kind(w), packed, out: SyncPtr::new(out), step, chunks });
        tasks += chunks;
    }
    let xq_ref = &xq;
    let run = |mut t: usize| {
        for &SharedPart { rows, kind, packed, out, step, chunks } in parts.iter().flatten() {
            if t >= chunks {
                t -= chunks;
                continue;
            }
            let (r0, r1) = (t * step, ((t + 1) * step).min(rows));
            // SAFETY: `packed` is `w` repacked for `kind`; xq holds n rows of nb blocks of `x`, which every weight
            // reads (same cols); rows r0..r1 (r0 a multiple of 16) of this weight's output belong to this task;
            // Simd::Avx512 is only selected after detection.
            unsafe { avx512::quant_rows_x16(kind, packed, rows, nb, xq_ref, n, r0, r1, out.get(), rows) };
            return;
        }
    };
    if parallel {
        be.par_for(tasks, &run);
    } else {
        (0..tasks).for_each(run);
    }
    XQ.set(xq);
}

/// Splits `0..rows` into large chunks starting at multiples of `align` and runs `f(r0, r1, out)` for each, on the
/// pool when the work is big enough.
fn run_rows(
    be: &CpuBackend,
    rows: usize,
    per_row: usize,
    align: usize,
    out: &mut [f32],
    f: &(dyn Fn(usize, usize, SyncPtr) + Sync),
) {
    let o = SyncPtr::new(out);
    let work = rows.saturating_mul(per_row);
    let threads = be.threads();
    if threads <= 1 || work < PAR_MIN_WORK || rows < 8 {
        f(0, rows, o);
        return;
    }
    // A few chunks per thread so a busy core does not stall the call; rounded to `align` rows for the tile kernels.
    let chunks = (threads * 4).min(rows / align).max(threads);
    let step = rows.div_ceil(chunks).next_multiple_of(align);
    let chunks = rows.div_ceil(step);
    be.par_for(chunks, &|c| {
        let r0 = c * step;
        let r1 = (r0 + step).min(rows);
        f(r0, r1, o);
    });
}

/// Quantises every 32-value block of `x` into `xq`.
pub(crate) fn quantize_rows(simd: Simd, x: &[f32], n: usize, cols: usize, xq: &mut [BlockQ8_1x4]) {
    match simd {
        Simd::Scalar => quantize_rows_q8_1x4(x, n, cols, xq),
        // SAFETY: Simd::Avx2 is only selected after run-time detection of AVX2/FMA/F16C.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 | Simd::Avx512 => unsafe { avx2::quantize_rows_q8_1x4(x, n, cols, xq) },
        #[cfg(not(target_arch = "x86_64"))]
        Simd::Avx2 | Simd::Avx512 => quantize_rows_q8_1x4(x, n, cols, xq),
    }
}

/// Fewest activation rows whose quantisation goes to the pool: a prefill chunk's, not a decode batch's.
const PAR_MIN_QUANT_ROWS: usize = 64;

/// [`quantize_rows`] on the pool, each task a run of whole 4-row groups, when there are at least
/// [`PAR_MIN_QUANT_ROWS`] rows; otherwise on the calling thread. A group's blocks are the same either way. On the
/// calling thread alone a prefill chunk's quantisation kept the helpers waiting (2.6% of a 2K-token prefill's
/// samples, all on the calling thread).
fn quantize_rows_on_pool(be: &CpuBackend, x: &[f32], n: usize, cols: usize, xq: &mut [BlockQ8_1x4]) {
    let simd = be.simd();
    let threads = be.threads();
    if threads <= 1 || n < PAR_MIN_QUANT_ROWS {
        return quantize_rows(simd, x, n, cols, xq);
    }
    let nb = cols / QK;
    let blocks = SyncPtr::new(xq);
    be.par_runs(n.div_ceil(4), 1, &|gs| {
        let (r0, r1) = (4 * gs.start, (4 * gs.end).min(n));
        // SAFETY: groups gs of xq (blocks gs.start * nb .. gs.end * nb) belong to this task alone.
        let out = unsafe { blocks.slice(gs.start * nb..gs.end * nb) };
        quantize_rows(simd, &x[r0 * cols..r1 * cols], r1 - r0, cols, out);
    });
}

/// Rows `r0..r1` of a quantised matmul. `out` points at the whole `[n][rows]` output.
fn quant_rows(simd: Simd, w: &QMatrix, xq: &[BlockQ8_1x4], n: usize, r0: usize, r1: usize, out: SyncPtr) {
    let rows = w.rows();
    let nb = w.cols() / QK;
    let rb = w.row_bytes();
    match (&w.data, simd) {
        #[cfg(target_arch = "x86_64")]
        (QData::Q4_1(b), Simd::Avx2 | Simd::Avx512) => {
            // SAFETY: shapes checked by `matmul`; rows r0..r1 belong to this task; CPU features detected.
            unsafe { avx2::quant_rows(avx2::QKind::Q4_1, b, rb, xq, n, nb, r0, r1, out.get(), rows) }
        }
        #[cfg(target_arch = "x86_64")]
        (QData::Q8_0(b), Simd::Avx2 | Simd::Avx512) => {
            // SAFETY: as above.
            unsafe { avx2::quant_rows(avx2::QKind::Q8_0, b, rb, xq, n, nb, r0, r1, out.get(), rows) }
        }
        (QData::Q4_1(b), _) => {
            for r in r0..r1 {
                let wr = &b[r * rb..(r + 1) * rb];
                for i in 0..n {
                    let v = scalar::dot_q4_1_q8_1(wr, &xq[i / 4 * nb..(i / 4 + 1) * nb], i % 4);
                    // SAFETY: (i, r) lies in [n][rows] and row range r0..r1 belongs to this task only.
                    unsafe { *out.get().add(i * rows + r) = v };
                }
            }
        }
        (QData::Q8_0(b), _) => {
            for r in r0..r1 {
                let wr = &b[r * rb..(r + 1) * rb];
                for i in 0..n {
                    let v = scalar::dot_q8_0_q8_1(wr, &xq[i / 4 * nb..(i / 4 + 1) * nb], i % 4);
                    // SAFETY: as above.
                    unsafe { *out.get().add(i * rows + r) = v };
                }
            }
        }
        _ => unreachable!("quant_rows called on a float matrix"),
    }
}

/// Rows `r0..r1` of an F32 / F16 matmul.
fn float_rows(simd: Simd, w: &QMatrix, x: &[f32], n: usize, r0: usize, r1: usize, out: SyncPtr) {
    let (rows, cols) = (w.rows(), w.cols());
    for r in r0..r1 {
        for i in 0..n {
            let xr = &x[i * cols..(i + 1) * cols];
            let v = match (&w.data, simd) {
                // SAFETY: CPU features detected before Simd::Avx2 is selected.
                #[cfg(target_arch = "x86_64")]
                (QData::F32(d), Simd::Avx2 | Simd::Avx512) => unsafe {
                    avx2::dot_f32(&d[r * cols..(r + 1) * cols], xr)
                },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                (QData::F16(d), Simd::Avx2 | Simd::Avx512) => unsafe {
                    avx2::dot_f16_f32(&d[r * cols..(r + 1) * cols], xr)
                },
                (QData::F32(d), _) => scalar::dot_f32(&d[r * cols..(r + 1) * cols], xr),
                (QData::F16(d), _) => scalar::dot_f16_f32(&d[r * cols..(r + 1) * cols], xr),
                _ => unreachable!("float_rows called on a quantised matrix"),
            };
            // SAFETY: as in quant_rows.
            unsafe { *out.get().add(i * rows + r) = v };
        }
    }
}
