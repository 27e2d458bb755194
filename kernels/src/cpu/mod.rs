//! The CPU backend: [`CpuBackend`] implements [`Backend`] with a private pool of helper threads (`pool`), picking
//! AVX2/FMA/F16C kernels (plus an AVX-512 VNNI quantised matmul and AVX-512 paged attention where the CPU has them)
//! at run time and falling back to the portable scalar kernels in [`scalar`].

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
pub mod attention;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_attention;
#[cfg(target_arch = "x86_64")]
pub(crate) mod bf16_dot;
pub mod codecs;
#[cfg(target_arch = "x86_64")]
pub(crate) mod codecs_avx2;
pub mod lora;
pub mod matmul;
pub(crate) mod pool;
pub mod scalar;
pub mod scores;
#[cfg(target_arch = "x86_64")]
pub(crate) mod scores_avx2;

use crate::backend::Backend;
use crate::paged::{AttnProbs, AttnSeq, KvStorage};
use crate::quant::QMatrix;
use crate::rope::RopeTable;

/// Instruction set the CPU backend runs its kernels with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Simd {
    /// Portable scalar code (the reference).
    Scalar,
    /// AVX2 + FMA + F16C (x86-64, detected at run time).
    Avx2,
    /// [`Simd::Avx2`] plus AVX-512 F/BW/VL/VNNI, used by the quantised matmul and paged attention (f16 and 8-bit
    /// caches; f32 caches and head_dim 96 take the AVX2 kernels); every other kernel runs its AVX2 form.
    Avx512,
}

impl Simd {
    /// The best instruction set this CPU supports.
    pub fn detect() -> Simd {
        if avx512_available() {
            Simd::Avx512
        } else if avx2_available() {
            Simd::Avx2
        } else {
            Simd::Scalar
        }
    }

    /// True for levels that include AVX2/FMA/F16C.
    pub fn has_avx2(self) -> bool {
        matches!(self, Simd::Avx2 | Simd::Avx512)
    }
}

/// True if [`Simd::Avx512`] can run: AVX2/FMA/F16C and AVX-512 F, BW, VL and VNNI.
pub fn avx512_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2_available()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// True if [`Simd::Avx512`] can run and the CPU's AMX bf16 tiles are usable by this process.
pub fn amx_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512_available() && amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// True if this CPU can run the quantised matmuls in bf16 ([`CpuBackend::with_bf16_matmuls`]): on AMX tiles, or
/// with AVX-512 BF16 dot products.
pub fn bf16_matmuls_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        bf16_dot::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Which kernel runs the quantised matmuls in bf16 (weight-only quantisation, bf16 compute, f32 sums).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// AMX `tdpbf16ps` tiles (Sapphire Rapids and later).
    Tiles,
    /// AVX-512 BF16 `vdpbf16ps` over the same widened weights (AMD Zen 4 and 5, Cooper Lake, and AMX CPUs told not to use
    /// their tiles).
    Dot,
}

/// True if AVX2, FMA and F16C are all available at run time.
pub fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Widens f16 bit patterns to f32 into `out[..src.len()]` (exact): the F16C loop where the CPU has it, without
/// the `half` crate's call per eight values, which took 4% of a PagedEviction run's samples (its scoring widens
/// every block of a sequence at each block boundary).
pub(crate) fn widen_f16(src: &[u16], out: &mut [f32]) {
    assert!(out.len() >= src.len(), "widen_f16: {} values into {}", src.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if avx2_available() {
        // SAFETY: the features were detected just above.
        return unsafe { avx2::widen_f16(src, out) };
    }
    for (o, &h) in out.iter_mut().zip(src) {
        *o = half::f16::from_bits(h).to_f32();
    }
}

/// `ln Σ exp(x)` over one row (a log-softmax's normaliser), NaN counted as `-inf`; `-inf` when nothing is above
/// `-inf`, `+inf` when an element is. AVX2 where the CPU has it.
pub fn log_sum_exp(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2_available() {
        // SAFETY: the features are checked at run time above.
        return unsafe { avx2::log_sum_exp(x) };
    }
    scalar::log_sum_exp(x)
}

/// CPU implementation of [`Backend`]: the calling thread plus a pool of `threads - 1` helpers.
pub struct CpuBackend {
    /// Helpers; `None` when `threads == 1`.
    pool: Option<pool::PollingPool>,
    threads: usize,
    simd: Simd,
    /// The Q4_1/Q8_0 matmuls in bf16 rather than over Q8_1 activations (only with [`Simd::Avx512`]).
    bf16: Option<Bf16Kernel>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("threads", &self.threads)
            .field("simd", &self.simd)
            .field("bf16", &self.bf16)
            .finish()
    }
}

impl CpuBackend {
    /// A backend with `threads` worker threads (0 = number of logical CPUs) and the best detected SIMD level, its
    /// matmuls over Q8_1 activations ([`CpuBackend::with_bf16_matmuls`]).
    pub fn new(threads: usize) -> CpuBackend {
        CpuBackend::with_simd(threads, Simd::detect())
    }

    /// This backend with its Q4_1/Q8_0 matmuls in bf16 (`true`, where the CPU can: on AMX tiles if it has them,
    /// else with AVX-512 BF16 dot products) or over Q8_1 activations. Off by default: each matrix then keeps a bf16
    /// copy of its weights (2 bytes per weight), and single-sequence decode, which streams every weight per token,
    /// reads 4× the bytes of Q4_1. On bf16 the activations keep 8 significant bits each, where Q8_1 keeps about
    /// 7 below each 32-value block's largest: the arithmetic to measure a KV codec's own error with.
    pub fn with_bf16_matmuls(self, on: bool) -> CpuBackend {
        let kernel = if amx_available() { Bf16Kernel::Tiles } else { Bf16Kernel::Dot };
        self.with_bf16_kernel(on.then_some(kernel))
    }

    /// This backend with the given bf16 matmul kernel (`None`: Q8_1 activations); a kernel the CPU cannot run gives
    /// `None`. Tests and benches use it to run both kernels on an AMX CPU.
    pub fn with_bf16_kernel(mut self, kernel: Option<Bf16Kernel>) -> CpuBackend {
        let ok = |k: &Bf16Kernel| {
            self.simd == Simd::Avx512
                && match k {
                    Bf16Kernel::Tiles => amx_available(),
                    Bf16Kernel::Dot => bf16_matmuls_available(),
                }
        };
        self.bf16 = kernel.filter(ok);
        self
    }

    /// The kernel running the quantised matmuls in bf16, if they do.
    pub fn bf16_kernel(&self) -> Option<Bf16Kernel> {
        self.bf16
    }

    /// True if the quantised matmuls run in bf16.
    pub fn bf16_matmuls(&self) -> bool {
        self.bf16.is_some()
    }

    /// A backend forced to `simd` (matmuls over Q8_1: see [`CpuBackend::with_bf16_matmuls`]); a level the CPU lacks falls back to
    /// [`Simd::Scalar`].
    pub fn with_simd(threads: usize, simd: Simd) -> CpuBackend {
        let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        let simd = match simd {
            Simd::Avx512 if !avx512_available() => Simd::Avx2,
            s => s,
        };
        let simd = if simd.has_avx2() && !avx2_available() { Simd::Scalar } else { simd };
        let pool = (threads > 1).then(|| {
            pool::PollingPool::new(threads - 1).unwrap_or_else(|e| panic!("cannot start the kernel thread pool: {e}"))
        });
        CpuBackend { pool, threads, simd, bf16: None }
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The instruction set in use.
    pub fn simd(&self) -> Simd {
        self.simd
    }

    /// Runs `f` on the pool over about two runs of `0..n` a thread, every run but the last a multiple of `align`
    /// long: for kernels split on whole units (4-row groups, 8-lane spans, rows), so that each unit is computed as
    /// on one thread.
    pub(crate) fn par_runs(&self, n: usize, align: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        if n == 0 {
            return;
        }
        let run = n.div_ceil(self.threads * 2).next_multiple_of(align);
        self.par_for(n.div_ceil(run), &|t| f(t * run..((t + 1) * run).min(n)));
    }

    /// Runs `f(t)` for every `t in 0..tasks` on the calling thread and up to `threads - 1` helpers, which pull
    /// task indices from a shared counter (so a descheduled core does not hold a fixed share of the work).
    pub(crate) fn par_for(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        match &self.pool {
            Some(pool) => pool.run(tasks, f),
            None => (0..tasks).for_each(f),
        }
    }
}

/// Fewest elements an elementwise or row-wise kernel ([`Backend::silu_mul`], [`Backend::rmsnorm`]) splits across
/// the pool: a prefill chunk's activations, not a decode batch's.
const PAR_MIN_ELEMENTWISE: usize = 1 << 16;

/// A raw pointer that may cross threads; users guarantee disjoint writes.
pub(crate) struct SyncPtr<T = f32>(*mut T);
// SAFETY: only used to hand disjoint output ranges to pool workers while the owner is blocked in the call.
unsafe impl<T> Send for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SyncPtr<T> {}
impl<T> Clone for SyncPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SyncPtr<T> {}
impl<T> SyncPtr<T> {
    pub(crate) fn new(p: &mut [T]) -> SyncPtr<T> {
        SyncPtr(p.as_mut_ptr())
    }
    #[inline]
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
    /// Elements `r` of the slice the pointer came from.
    ///
    /// # Safety
    /// `r` lies inside that slice, the slice outlives the borrow, and nothing else touches `r` meanwhile.
    #[inline]
    pub(crate) unsafe fn slice<'a>(self, r: std::ops::Range<usize>) -> &'a mut [T] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(r.start), r.len()) }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        match self.simd {
            Simd::Scalar => "cpu-scalar",
            Simd::Avx2 => "cpu-avx2",
            Simd::Avx512 if self.bf16 == Some(Bf16Kernel::Tiles) => "cpu-avx512-amx",
            Simd::Avx512 if self.bf16 == Some(Bf16Kernel::Dot) => "cpu-avx512-bf16",
            Simd::Avx512 => "cpu-avx512",
        }
    }

    fn matmul(&self, w: &QMatrix, x: &[f32], n: usize, out: &mut [f32]) {
        matmul::matmul(self, w, x, n, out);
    }

    fn matmul_shared_input(&self, ws: &[&QMatrix], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
        matmul::matmul_shared_input(self, ws, x, n, outs);
    }

    fn embedding(&self, table: &QMatrix, ids: &[u32], out: &mut [f32]) {
        let c = table.cols();
        assert_eq!(out.len(), ids.len() * c, "embedding: out must be [ids.len()][cols]");
        for (&id, o) in ids.iter().zip(out.chunks_exact_mut(c)) {
            if (id as usize) < table.rows() {
                table.dequantize_row(id as usize, o);
            } else {
                // Token ids come from outside; an invalid one yields a zero row rather than a panic.
                o.fill(0.0);
            }
        }
    }

    fn rmsnorm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        let d = weight.len();
        assert!(
            d > 0 && x.len() == out.len() && x.len().is_multiple_of(d),
            "rmsnorm: x, out must be [n][weight.len()]"
        );
        let simd = self.simd;
        let norm = move |x: &[f32], out: &mut [f32]| {
            for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
                match simd {
                    // SAFETY: CPU features detected before Simd::Avx2 / Avx512 is selected.
                    #[cfg(target_arch = "x86_64")]
                    Simd::Avx2 | Simd::Avx512 => unsafe { avx2::rmsnorm_row(xr, weight, eps, or) },
                    _ => scalar::rmsnorm_row(xr, weight, eps, or),
                }
            }
        };
        // A prefill chunk's rows go to the pool, whole rows to a task (each row's result is its own).
        let (n, threads) = (x.len() / d, self.threads());
        if threads <= 1 || x.len() < PAR_MIN_ELEMENTWISE {
            return norm(x, out);
        }
        let o = SyncPtr::new(out);
        self.par_runs(n, 1, &|rs| {
            let span = rs.start * d..rs.end * d;
            // SAFETY: rows rs of out belong to this task alone, and out outlives the call.
            norm(&x[span.clone()], unsafe { o.slice(span) });
        });
    }

    fn rope(&self, x: &mut [f32], table: &RopeTable, n_heads: usize) {
        let head_dim = table.head_dim();
        let w = n_heads * head_dim;
        assert_eq!(x.len(), table.len() * w, "rope: x must be [table.len()][n_heads*head_dim]");
        if x.is_empty() {
            return;
        }
        let wide = self.simd.has_avx2() && head_dim.is_multiple_of(8);
        for (r, row) in x.chunks_exact_mut(w).enumerate() {
            let (cc, ss) = table.row(r);
            if wide {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: CPU features detected; head_dim is a multiple of 8 and row is whole heads.
                unsafe {
                    avx2::rope_row(row, cc, ss)
                };
                #[cfg(not(target_arch = "x86_64"))]
                for h in row.chunks_exact_mut(head_dim) {
                    scalar::rope_head(h, cc, ss);
                }
            } else {
                for h in row.chunks_exact_mut(head_dim) {
                    scalar::rope_head(h, cc, ss);
                }
            }
        }
    }

    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) {
        assert_eq!(gate.len(), up.len(), "silu_mul: gate and up differ in length");
        let simd = self.simd;
        let run = move |gate: &mut [f32], up: &[f32]| match simd {
            // SAFETY: CPU features detected before Simd::Avx2 / Avx512 is selected.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 | Simd::Avx512 => unsafe { avx2::silu_mul(gate, up) },
            _ => scalar::silu_mul(gate, up),
        };
        // A prefill chunk's gate goes to the pool (on the calling thread alone it kept the helpers waiting), in
        // spans of whole 8-lane vectors, so that every element takes the path it takes on one thread.
        let (len, threads) = (gate.len(), self.threads());
        if threads <= 1 || len < PAR_MIN_ELEMENTWISE {
            return run(gate, up);
        }
        let g = SyncPtr::new(gate);
        // SAFETY: each run of gate belongs to its task alone, and gate outlives the call.
        self.par_runs(len, 8, &|r| run(unsafe { g.slice(r.clone()) }, &up[r]));
    }

    fn kv_write(&self, kv: &mut KvStorage, k: &[f32], v: &[f32], seqs: &[AttnSeq<'_>], n_kv_heads: usize) {
        // A prefill chunk's rows into an 8-bit pool are quantised on the pool; a decode batch's on this thread.
        if kv.slot_scaled() && self.threads() > 1 && k.len() >= PAR_MIN_ELEMENTWISE {
            return attention::kv_write_encoded(self, kv, k, v, seqs, n_kv_heads);
        }
        attention::kv_write(kv, k, v, seqs, n_kv_heads);
    }

    fn lora_add(&self, x: &[f32], input: usize, y: &mut [f32], out: usize, segments: &[lora::LoraSegment<'_>]) {
        lora::lora_add(self, x, input, y, out, segments);
    }

    fn paged_attention_with_probs(
        &self,
        q: &[f32],
        kv: &KvStorage,
        seqs: &[AttnSeq<'_>],
        n_heads: usize,
        n_kv_heads: usize,
        scale: f32,
        out: &mut [f32],
        probs: &mut [AttnProbs<'_>],
    ) {
        attention::paged_attention(self, q, kv, seqs, n_heads, n_kv_heads, scale, out, probs);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn widening_f16_gives_every_pattern_its_value() {
        // Every bit pattern, at an odd length so that the scalar tail runs too.
        let src: Vec<u16> = (0..=u16::MAX).chain([0x3C00, 0xC000, 0x7BFF]).collect();
        let mut out = vec![0.0f32; src.len()];
        super::widen_f16(&src, &mut out);
        for (&h, &o) in src.iter().zip(&out) {
            let want = half::f16::from_bits(h).to_f32();
            assert!(o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()), "{h:#06x}: {o} want {want}");
        }
    }
}
