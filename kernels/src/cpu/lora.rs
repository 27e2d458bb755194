//! The LoRA delta kernel, segmented as punica's SGMV is: one call adds, for each [`LoraSegment`] (a run of rows
//! and the adapter they share), `y[t] += (A·x[t])·Bᵀ` over its rows, with `A` (`[rank][in]`) and `B` stored
//! transposed (`bt`, `[rank][out]`, its scale folded in), both f16 (the adapter's bytes are what a decode step
//! streams, as the base weights are; f32 would double them). A row's `rank` dot products land in a stack buffer and
//! its output is then swept once, eight columns at a time, with the `rank` values broadcast; so a row costs
//! `rank·(in + out)` multiply-adds and no allocation. The rows of all segments are split across the pool together
//! when the call carries enough work: a decode batch whose sequences use different adapters is one dispatch, not
//! one single-threaded call per sequence.

use std::ops::Range;

use super::{CpuBackend, Simd, SyncPtr};

/// The largest rank the kernel takes (its stack buffer).
pub const MAX_LORA_RANK: usize = 256;

/// Below this many multiply-adds a call stays on the calling thread.
const PAR_MIN_WORK: usize = 1 << 18;

/// Rows of the batch that run with one adapter, and that adapter's matrices for the projection.
#[derive(Debug, Clone, Copy)]
pub struct LoraSegment<'a> {
    pub rows: (usize, usize),
    /// `[rank][in]`, f16 bits.
    pub a: &'a [u16],
    /// `[rank][out]` (B transposed, scaled), f16 bits.
    pub bt: &'a [u16],
    pub rank: usize,
}

impl LoraSegment<'_> {
    fn range(&self) -> Range<usize> {
        self.rows.0..self.rows.1
    }
}

/// Checks the shapes (segments in row order, disjoint, inside the batch) and runs every segment's rows.
pub fn lora_add(be: &CpuBackend, x: &[f32], input: usize, y: &mut [f32], out: usize, segments: &[LoraSegment<'_>]) {
    assert!(input > 0 && x.len().is_multiple_of(input), "lora_add: x must be [n][in]");
    let n = x.len() / input;
    assert_eq!(y.len(), n * out, "lora_add: y must be [n][out]");
    let mut end = 0;
    let (mut rows, mut work) = (0, 0usize);
    for s in segments {
        assert!((1..=MAX_LORA_RANK).contains(&s.rank), "lora_add: rank {} outside 1..={MAX_LORA_RANK}", s.rank);
        assert!(s.a.len() == s.rank * input && s.bt.len() == s.rank * out, "lora_add: a or bt of the wrong shape");
        assert!(end <= s.rows.0 && s.rows.0 <= s.rows.1 && s.rows.1 <= n, "lora_add: segments out of order");
        end = s.rows.1;
        rows += s.rows.1 - s.rows.0;
        work += (s.rows.1 - s.rows.0) * s.rank * (input + out);
    }
    if rows == 0 || out == 0 {
        return;
    }
    let (simd, threads) = (be.simd(), be.threads());
    let yp = SyncPtr::new(y);
    if threads <= 1 || work < PAR_MIN_WORK || rows < 2 {
        for s in segments {
            run_rows(simd, x, input, s, s.range(), out, yp.get());
        }
        return;
    }
    // Chunks of `step` rows counted across the segments in order; a chunk may span several segments.
    let chunks = (threads * 4).min(rows);
    let step = rows.div_ceil(chunks);
    be.par_for(rows.div_ceil(step), &|c| {
        let (lo, hi) = (c * step, (c + 1) * step);
        let mut seen = 0;
        for s in segments {
            let len = s.rows.1 - s.rows.0;
            let (from, to) = (lo.max(seen), hi.min(seen + len));
            if from < to {
                let r0 = s.rows.0 + (from - seen);
                run_rows(simd, x, input, s, r0..r0 + (to - from), out, yp.get());
            }
            seen += len;
            if seen >= hi {
                break;
            }
        }
    });
}

/// Rows `rows` of segment `s`. `y` points at the whole `[n][out]` output; each task writes only its own rows.
fn run_rows(simd: Simd, x: &[f32], input: usize, s: &LoraSegment<'_>, rows: Range<usize>, out: usize, y: *mut f32) {
    let (a, bt, rank) = (s.a, s.bt, s.rank);
    let mut low = [0.0f32; MAX_LORA_RANK];
    for t in rows {
        let xt = &x[t * input..(t + 1) * input];
        // SAFETY: row t of the [n][out] output is in bounds (checked by `lora_add`) and written only by this task.
        let yt = unsafe { std::slice::from_raw_parts_mut(y.add(t * out), out) };
        match simd {
            // SAFETY: Simd::Avx2 / Avx512 are selected only after run-time detection of AVX2/FMA/F16C.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 | Simd::Avx512 => unsafe {
                for (j, l) in low[..rank].iter_mut().enumerate() {
                    *l = super::avx2::dot_f16_f32(&a[j * input..(j + 1) * input], xt);
                }
                super::avx2::rank_axpy_f16(&low[..rank], bt, out, yt);
            },
            _ => {
                for (j, l) in low[..rank].iter_mut().enumerate() {
                    *l = super::scalar::dot_f16_f32(&a[j * input..(j + 1) * input], xt);
                }
                scalar_rank_axpy(&low[..rank], bt, out, yt);
            }
        }
    }
}

/// `y += Σ_j low[j]·bt[j]` (the portable form of `avx2::rank_axpy_f16`).
pub(crate) fn scalar_rank_axpy(low: &[f32], bt: &[u16], out: usize, y: &mut [f32]) {
    for (j, &l) in low.iter().enumerate() {
        for (o, &b) in y.iter_mut().zip(&bt[j * out..(j + 1) * out]) {
            *o += l * half::f16::from_bits(b).to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], n: usize, input: usize, a: &[u16], bt: &[u16], rank: usize, y: &mut [f32]) {
        let out = bt.len() / rank;
        let h = |v: u16| f64::from(half::f16::from_bits(v).to_f32());
        for t in 0..n {
            for o in 0..out {
                let mut s = 0.0f64;
                for j in 0..rank {
                    let low: f64 = (0..input).map(|i| h(a[j * input + i]) * f64::from(x[t * input + i])).sum();
                    s += low * h(bt[j * out + o]);
                }
                y[t * out + o] += s as f32;
            }
        }
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len as u32)
            .map(|i| ((i.wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn every_simd_level_and_thread_count_adds_the_same_delta() {
        let f16s = |v: Vec<f32>| v.into_iter().map(|x| half::f16::from_f32(x).to_bits()).collect::<Vec<u16>>();
        // Odd widths exercise the kernels' tails; 300 rows × rank 16 crosses the parallel threshold.
        for &(n, input, out) in &[(1, 37, 53), (5, 576, 192), (300, 96, 136)] {
            let x = values(n * input, 1);
            // Two adapters of ranks 3 and 16: rows [0, n/3) on the first, a gap, then [n/2, n) on the second.
            let (ra, rb) = (3, 16);
            let (a1, b1) = (f16s(values(ra * input, 2)), f16s(values(ra * out, 3)));
            let (a2, b2) = (f16s(values(rb * input, 4)), f16s(values(rb * out, 5)));
            let segments = [
                LoraSegment { rows: (0, n / 3), a: &a1, bt: &b1, rank: ra },
                LoraSegment { rows: (n / 2, n), a: &a2, bt: &b2, rank: rb },
            ];
            let start = values(n * out, 6);
            let mut want = start.clone();
            for s in &segments {
                let rows = s.rows.1 - s.rows.0;
                let (x0, y0) = (s.rows.0 * input, s.rows.0 * out);
                reference(&x[x0..x0 + rows * input], rows, input, s.a, s.bt, s.rank, &mut want[y0..y0 + rows * out]);
            }
            for simd in [Simd::Scalar, Simd::Avx2, Simd::Avx512] {
                for threads in [1, 2, 3] {
                    let be = CpuBackend::with_simd(threads, simd);
                    let mut y = start.clone();
                    lora_add(&be, &x, input, &mut y, out, &segments);
                    let err = y.iter().zip(&want).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
                    assert!(err < 1e-3, "{simd:?} × {threads} threads, shape {n}×{input}→{out}: {err}");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "segments out of order")]
    fn overlapping_segments_are_refused() {
        let (a, bt) = (vec![0u16; 4], vec![0u16; 4]);
        let s = LoraSegment { rows: (0, 2), a: &a, bt: &bt, rank: 1 };
        lora_add(&CpuBackend::with_simd(1, Simd::Scalar), &[0.0; 12], 4, &mut [0.0; 12], 4, &[s, s]);
    }
}
