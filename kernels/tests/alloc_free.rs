//! The kernels that run per layer (attention) or per table (eviction scores) at every decode step must not
//! allocate once warm: a counting global allocator, which is why this is a test binary of its own, checks that a
//! second identical call allocates nothing.
//!
//! Allocations are counted per thread and the backend has one thread, so every task runs on the calling thread and
//! nothing the test harness does on its own threads is counted. A multi-threaded backend runs the same code per
//! task, with its thread-local buffers warmed per helper.

use pagoda_kernels::scores::{key_norms, value_key_ratio_in};
use pagoda_kernels::{AttnProbs, AttnSeq, Backend, CpuBackend, KvDtype, KvStorage};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    /// Allocations on this thread since counting began; `None` while not counting.
    static ALLOCATIONS: Cell<Option<usize>> = const { Cell::new(None) };
}

fn note() {
    // try_with: the allocator also runs while thread-locals are torn down.
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get().map(|n| n + 1)));
}

// SAFETY: every call is forwarded to the system allocator unchanged; counting touches only a const thread-local
// without a destructor, which itself never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations `f` makes on this thread.
fn allocations(f: impl FnOnce()) -> usize {
    ALLOCATIONS.set(Some(0));
    f();
    ALLOCATIONS.replace(None).expect("counting was on")
}

/// A cache of `dtype` whose blocks hold deterministic non-zero values, and `n_tables` tables of `blocks` ids each,
/// interleaved through the arena so that no table reads contiguous blocks.
fn cache(dtype: KvDtype, bs: usize, hd: usize, n_tables: usize, blocks: usize) -> (KvStorage, Vec<Vec<u32>>) {
    let total = n_tables * blocks;
    let mut kv = KvStorage::with_dtype(total, bs, hd, dtype);
    let val = |i: usize| ((i as f32 * 0.618).fract() - 0.5) * 2.0;
    for b in 0..total {
        let k: Vec<f32> = (0..bs * hd).map(|i| val(i + 7 * b)).collect();
        let v: Vec<f32> = (0..bs * hd).map(|i| val(3 * i + b)).collect();
        kv.write_block(b as u32, &k, &v);
    }
    let tables = (0..n_tables).map(|t| (0..blocks).map(|i| (i * n_tables + t) as u32).collect()).collect();
    (kv, tables)
}

/// One attention step over `kv` (sequence `i` computes `news[i]` tokens on top of `prior` cached slots per
/// kv-head), the sequences in `probs_for` also summing probabilities (H2O's power 1, then KV-Compress's 2): the
/// allocations of a second call after a warm-up, and the output of each call.
fn attention_allocations(
    kv: &KvStorage,
    tables: &[Vec<u32>],
    (n_heads, n_kv): (usize, usize),
    prior: usize,
    news: &[usize],
    probs_for: &[usize],
) -> (usize, Vec<f32>, Vec<f32>) {
    let be = CpuBackend::new(1);
    let hd = kv.head_dim();
    let per_seq: Vec<Vec<u32>> = tables.to_vec();
    let seq_tables: Vec<&[Vec<u32>]> = per_seq.chunks(n_kv).collect();
    let priors = vec![prior; n_kv];
    let mut q_row = 0;
    let seqs: Vec<AttnSeq<'_>> = news
        .iter()
        .enumerate()
        .map(|(i, &n_new)| {
            let s = AttnSeq { q_row, n_new, tables: seq_tables[i], prior_lens: &priors };
            q_row += n_new;
            s
        })
        .collect();
    let q: Vec<f32> = (0..q_row * n_heads * hd).map(|i| ((i as f32 * 0.377).fract() - 0.5) * 3.0).collect();
    let scale = 1.0 / (hd as f32).sqrt();
    let stride = prior + news.iter().max().unwrap();
    let mut sums: Vec<Vec<f32>> = probs_for.iter().map(|_| vec![0.0; n_heads * stride]).collect();
    let run = |out: &mut Vec<f32>, sums: &mut [Vec<f32>]| {
        let mut probs: Vec<AttnProbs<'_>> = Vec::with_capacity(probs_for.len());
        for ((&seq, s), power) in probs_for.iter().zip(sums.iter_mut()).zip(1..) {
            probs.push(AttnProbs { seq, power, stride, sums: s });
        }
        allocations(|| be.paged_attention_with_probs(&q, kv, &seqs, n_heads, n_kv, scale, out, &mut probs))
    };
    let (mut first, mut second) = (vec![0.0; q.len()], vec![0.0; q.len()]);
    run(&mut first, &mut sums);
    let n = run(&mut second, &mut sums);
    (n, first, second)
}

/// `key_norms` and `value_key_ratio_in`, which walk one table with its blocks widened to f32, allocate nothing
/// once warm, for blocks larger than any fixed stack buffer they had (f16 and int8, head_dim 128, 16 and 64 slots a
/// block: 2,048 and 8,192 floats).
#[test]
fn score_kernels_do_not_allocate_when_warm() {
    for dtype in [KvDtype::F16, KvDtype::Int8] {
        for bs in [16usize, 64] {
            let (kv, tables) = cache(dtype, bs, 128, 1, 4);
            let len = 3 * bs + 5;
            let (mut norms, mut ratios) = (vec![0.0f32; len], vec![0.0f32; len]);
            let mut step = || {
                allocations(|| {
                    key_norms(&kv, &tables[0], 0..len, &mut norms);
                    value_key_ratio_in(&kv, &tables[0], 0..len, &mut ratios);
                })
            };
            step();
            let warm = step();
            assert_eq!(warm, 0, "{dtype} bs {bs}: the warm score kernels allocated {warm} times");
            assert!(norms.iter().chain(&ratios).all(|x| x.is_finite() && *x > 0.0), "{dtype} bs {bs}: no scores");
        }
    }
}

/// Paged attention allocates nothing once warm: the portable kernel over blocks of 128 slots (8,192 floats a
/// block, past its old stack buffer), and the SIMD kernels over the served shape (16 slots of 64), each for a
/// decode step of three sequences and a prefill step of two, without and with probability sums (H2O,
/// KV-Compress). The warm call must also reproduce the first call's output.
#[test]
fn paged_attention_does_not_allocate_when_warm() {
    let (n_heads, n_kv) = (9usize, 3usize);
    for (dtype, bs, hd) in [(KvDtype::F16, 128usize, 64usize), (KvDtype::F16, 16, 64), (KvDtype::Int8, 16, 64)] {
        let prior = 2 * bs + 3;
        for news in [&[1usize, 1, 1][..], &[5, 40]] {
            let blocks = (prior + 40).div_ceil(bs);
            let (kv, tables) = cache(dtype, bs, hd, news.len() * n_kv, blocks);
            for probs_for in [&[][..], &[0usize][..], &[0, 1][..]] {
                let (n, first, second) = attention_allocations(&kv, &tables, (n_heads, n_kv), prior, news, probs_for);
                let case = format!("{dtype} bs {bs}, news {news:?}, probs for {probs_for:?}");
                assert_eq!(n, 0, "{case}: the warm attention call allocated {n} times");
                assert!(first.iter().any(|&x| x != 0.0), "{case}: attention wrote nothing");
                assert_eq!(first, second, "{case}: the warm call's output differs");
            }
        }
    }
}
