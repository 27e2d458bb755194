//! Eviction policies on hand-made caches: each policy's scoring rule picks the slots its paper says it should,
//! and every eviction returns whole blocks to the pool (no model involved).

use pagoda_kernels::{AttnProbs, AttnSeq, Backend, CpuBackend, KvStorage};
use pagoda_worker::cache::{BlockPool, CacheLayout, SeqBlocks, block_hashes};
use pagoda_worker::policy::{AttnDims, CacheView, PolicyKind, PolicySpec, PolicyState, StepProbs, StepView};

const BS: usize = 4;
const HD: usize = 4;

struct Cache {
    pool: BlockPool,
    kv: KvStorage,
    blocks: SeqBlocks,
    policy: PolicyState,
    dims: AttnDims,
    /// Next token position.
    pos: usize,
    /// Give the policy the attention kernel's probabilities where it asks for them (as the engine does); when
    /// false, capture the queries instead, so the policy scores the keys itself.
    fused: bool,
}

impl Cache {
    fn new(kind: PolicyKind, budget: usize, n_kv_heads: usize, n_heads: usize) -> Cache {
        let layout = CacheLayout { n_layers: 1, n_kv_heads, block_size: BS };
        let dims = AttnDims { n_layers: 1, n_heads, n_kv_heads, head_dim: HD };
        Cache {
            pool: BlockPool::new(64),
            kv: KvStorage::new(64, BS, HD),
            blocks: SeqBlocks::new(layout),
            policy: PolicyState::new(PolicySpec { kind, budget_tokens: budget }, dims, BS),
            dims,
            pos: 0,
            fused: true,
        }
    }

    /// Writes tokens with keys/values from `kv(table, position)` and runs the policy hooks for that step.
    /// `q(position)` gives each token's query row (all heads), captured as the policy asks.
    fn step(
        &mut self,
        n: usize,
        total: usize,
        kv: impl Fn(usize, usize) -> ([f32; HD], [f32; HD]),
        q: impl Fn(usize) -> Vec<f32>,
    ) -> pagoda_worker::policy::Eviction {
        self.try_step(n, total, kv, q).unwrap()
    }

    /// [`Cache::step`], returning what the hooks returned.
    fn try_step(
        &mut self,
        n: usize,
        total: usize,
        kv: impl Fn(usize, usize) -> ([f32; HD], [f32; HD]),
        q: impl Fn(usize) -> Vec<f32>,
    ) -> Result<pagoda_worker::policy::Eviction, pagoda_worker::cache::CacheError> {
        self.blocks.reserve(&mut self.pool, n).unwrap();
        for t in 0..self.blocks.tables().len() {
            let len = self.blocks.lens()[t];
            for i in 0..n {
                let slot = len + i;
                let b = self.blocks.tables()[t][slot / BS];
                let (k, v) = kv(t, self.pos + i);
                self.kv.block_k_mut(b)[(slot % BS) * HD..][..HD].copy_from_slice(&k);
                self.kv.block_v_mut(b)[(slot % BS) * HD..][..HD].copy_from_slice(&v);
            }
        }
        self.blocks.advance(n);
        let sums_power = self.policy.attention_sums();
        // Without the kernel's sums a policy that reads them takes every query of the step.
        let cap = self.policy.capture_for(self.pos, n, total, self.fused);
        let mut captured = Vec::new();
        for p in self.pos + n - cap..self.pos + n {
            let row = q(p);
            assert_eq!(row.len(), self.dims.q_dim());
            captured.extend(row);
        }
        // The probabilities as the engine gets them: summed by the attention kernel, over the cache as it stands.
        let stride = self.blocks.lens().iter().max().copied().unwrap_or(0);
        let mut probs = vec![f32::NAN; self.dims.n_heads * stride];
        let fused_power = sums_power.filter(|_| self.fused);
        if let Some(power) = fused_power {
            let qm: Vec<f32> = (self.pos..self.pos + n).flat_map(&q).collect();
            let prior: Vec<usize> = self.blocks.lens().iter().map(|l| l - n).collect();
            let seqs = [AttnSeq { q_row: 0, n_new: n, tables: self.blocks.tables(), prior_lens: &prior }];
            let mut out = vec![0.0; qm.len()];
            let scale = 1.0 / (HD as f32).sqrt();
            let (heads, kv_heads) = (self.dims.n_heads, self.dims.n_kv_heads);
            let mut sinks = [AttnProbs { seq: 0, power, stride, sums: &mut probs }];
            CpuBackend::new(1)
                .paged_attention_with_probs(&qm, &self.kv, &seqs, heads, kv_heads, scale, &mut out, &mut sinks);
        }
        let probs = fused_power.map(|_| StepProbs { sums: &probs, stride });
        let start = self.pos;
        self.pos += n;
        let mut view = CacheView { blocks: &mut self.blocks, pool: &mut self.pool, kv: &mut self.kv };
        self.policy.on_step(&mut view, StepView { start, n, total, captured_q: &captured, probs })
    }

    fn kept(&self, t: usize) -> Vec<u32> {
        let mut p = self.policy.positions(t).to_vec();
        p.sort();
        p
    }

    /// The key stored in slot `s` of table `t`.
    fn key(&self, t: usize, s: usize) -> Vec<f32> {
        let b = self.blocks.tables()[t][s / BS];
        self.kv.block_k(b)[(s % BS) * HD..][..HD].to_vec()
    }

    fn check_blocks(&self) {
        for t in 0..self.blocks.tables().len() {
            let len = self.blocks.lens()[t];
            assert_eq!(self.blocks.tables()[t].len(), len.div_ceil(BS), "table {t}: blocks match length {len}");
            assert_eq!(self.policy.positions(t).len(), len, "table {t}: one position per slot");
        }
        assert_eq!(self.pool.num_used(), self.blocks.num_blocks(), "pool holds exactly the tables' blocks");
        self.pool.check_invariants().unwrap();
    }
}

fn no_q(_: usize) -> Vec<f32> {
    Vec::new()
}

fn scaled(x: f32) -> [f32; HD] {
    [x, 0.5 * x, 0.25 * x, 0.0]
}

#[test]
fn knorm_keeps_the_lowest_key_norms_and_frees_blocks() {
    let mut c = Cache::new(PolicyKind::Knorm, 8, 1, 1);
    // Key norm grows with position, except positions 10..14 which are tiny.
    let kv = |_: usize, p: usize| (scaled(if (10..14).contains(&p) { 0.01 } else { 1.0 + p as f32 }), [1.0; HD]);
    let ev = c.step(16, 16, kv, no_q);
    assert_eq!(c.kept(0), vec![0, 1, 2, 3, 10, 11, 12, 13]);
    assert_eq!((ev.slots, ev.blocks), (8, 2));
    c.check_blocks();
    // Decode: each new token over budget evicts the largest-norm key (the new one here: 1 + 16).
    c.step(1, 17, kv, no_q);
    assert_eq!(c.kept(0), vec![0, 1, 2, 3, 10, 11, 12, 13]);
    c.check_blocks();
    // A small new key stays, and the largest kept one (position 3) goes.
    let small_at_17 = |t: usize, p: usize| if p == 17 { (scaled(0.02), [1.0; HD]) } else { kv(t, p) };
    c.step(1, 18, small_at_17, no_q);
    assert_eq!(c.kept(0), vec![0, 1, 2, 10, 11, 12, 13, 17]);
    c.check_blocks();
    // The policy computes each key's norm once, when it is written, and the norms move with their slots through
    // the compaction and the swap-removes above.
    let len = c.blocks.lens()[0];
    assert_eq!(c.policy.metrics(0).len(), len);
    for s in 0..len {
        let norm = c.key(0, s).iter().map(|x| x * x).sum::<f32>().sqrt();
        let kept = c.policy.metrics(0)[s];
        assert!((kept - norm).abs() <= 1e-6 * norm.max(1.0), "slot {s}: kept norm {kept}, key's norm {norm}");
    }
}

#[test]
fn paged_eviction_keeps_high_value_key_ratio_then_evicts_whole_blocks() {
    let mut c = Cache::new(PolicyKind::PagedEviction, 16, 1, 1);
    // ‖V‖/‖K‖ = ratio(p): the sink (position 0) and the prompt's last tokens have the lowest ratios, as a real
    // sink's small value has; between them it is highest at 5, 7, 8 and 10, then at 12..16.
    let ratio = |p: usize| match p {
        0 | 21..24 => 0.01,
        5 | 7 | 8 | 10 => 5.0,
        12..16 => 2.0,
        _ => 1.0,
    };
    let kv = move |_: usize, p: usize| ([1.0, 0.0, 0.0, 0.0], [ratio(p), 0.0, 0.0, 0.0]);
    let ev = c.step(24, 24, kv, no_q);
    // Prefill: the first and last blocks stay whole and the top ratios between them fill the budget, [0..4)
    // [5 7 8 10] [12..16) [20..24). That ends on a full block at the budget, so the decode step's block eviction
    // (Algorithm 3) runs before the next token opens a fifth block: of the blocks between the first and the
    // recent one, the lower mean (12..16: 2.0) goes.
    assert_eq!(c.kept(0), vec![0, 1, 2, 3, 5, 7, 8, 10, 20, 21, 22, 23]);
    assert_eq!((ev.slots, ev.blocks), (12, 3), "8 prompt slots, then one whole block");
    c.check_blocks();
    // Decode: nothing until the last block fills at the budget; then the block with the lowest mean ratio goes,
    // whole, and the cache never holds more than its budget.
    let low_from_24 =
        |_: usize, p: usize| ([1.0, 0.0, 0.0, 0.0], [if p >= 24 { 0.001 } else { ratio(p) }, 0.0, 0.0, 0.0]);
    for i in 0..3 {
        let ev = c.step(1, 25 + i, low_from_24, no_q);
        assert_eq!(ev.slots, 0);
    }
    let blocks_before = c.pool.num_used();
    let ev = c.step(1, 28, low_from_24, no_q);
    assert_eq!((ev.slots, ev.blocks), (4, 1), "one whole block evicted when the last block fills");
    // Blocks held [0..4) [5 7 8 10] [20..24) [24..28): the recent block (lowest of all) stays, the first block
    // (mean 0.76) stays, and of the two between them the lower mean (20..24: 0.01) goes.
    assert_eq!(c.kept(0), vec![0, 1, 2, 3, 5, 7, 8, 10, 24, 25, 26, 27]);
    assert_eq!(c.pool.num_used(), blocks_before - 1);
    c.check_blocks();
    // Four more: the blocks between the first and the recent one are [5 7 8 10] (5.0) and [24..28) (0.001).
    for i in 0..4 {
        c.step(1, 29 + i, low_from_24, no_q);
        assert!(c.blocks.len() <= 16, "the cache holds at most its budget");
    }
    assert_eq!(c.kept(0), vec![0, 1, 2, 3, 5, 7, 8, 10, 28, 29, 30, 31]);
    c.check_blocks();
    // The ratios the policy keeps per slot (scoring only new slots at a boundary) are the cache's own, slot for
    // slot, after three evictions moved them.
    let len = c.blocks.lens()[0];
    let mut fresh = vec![0.0; len];
    pagoda_kernels::scores::value_key_ratio(&c.kv, &c.blocks.tables()[0], len, &mut fresh);
    assert_eq!(&c.policy.metrics(0)[..len], &fresh[..]);
}

#[test]
fn paged_eviction_under_two_blocks_still_holds_its_budget() {
    // A budget of one block: each end keeps half of it, and decode may evict the first block, as nothing else
    // lies before the recent one.
    let mut c = Cache::new(PolicyKind::PagedEviction, 4, 1, 1);
    let kv = |_: usize, p: usize| ([1.0, 0.0, 0.0, 0.0], [1.0 + p as f32, 0.0, 0.0, 0.0]);
    c.step(10, 10, kv, no_q);
    assert_eq!(c.kept(0), vec![0, 1, 8, 9]);
    c.check_blocks();
    for i in 0..12 {
        c.step(1, 11 + i, kv, no_q);
        assert!(c.blocks.len() <= 2 * BS, "the cache stays within two blocks");
        c.check_blocks();
    }
}

#[test]
fn streaming_keeps_sinks_and_a_sliding_recent_window() {
    let mut c = Cache::new(PolicyKind::Streaming, 8, 1, 1);
    let kv = |_: usize, p: usize| (scaled(p as f32), [p as f32; HD]);
    c.step(20, 20, kv, no_q);
    assert_eq!(c.kept(0), vec![0, 1, 2, 3, 16, 17, 18, 19]);
    c.step(1, 21, kv, no_q);
    assert_eq!(c.kept(0), vec![0, 1, 2, 3, 17, 18, 19, 20], "the oldest non-sink token slides out");
    c.step(1, 22, kv, no_q);
    assert_eq!(c.kept(0), vec![0, 1, 2, 3, 18, 19, 20, 21]);
    // Slot data moved with the positions: every slot's key still matches its position.
    for s in 0..8 {
        let p = c.policy.positions(0)[s];
        assert_eq!(c.key(0, s), scaled(p as f32).to_vec());
    }
    c.check_blocks();
}

#[test]
fn keydiff_keeps_the_most_distinctive_keys_during_chunked_prefill() {
    let mut c = Cache::new(PolicyKind::Keydiff, 8, 1, 1);
    // Most keys point one way; positions 3, 9, 21 and 30 point elsewhere (low cosine with the anchor).
    let odd = [3usize, 9, 21, 30];
    let kv = move |_: usize, p: usize| {
        let k = if odd.contains(&p) { [0.0, 1.0, (p % 3) as f32, -1.0] } else { [1.0, 0.1 * (p % 5) as f32, 0.0, 0.0] };
        (k, [1.0; HD])
    };
    // Block prompt processing: after each chunk the cache is cut back to the budget.
    let ev = c.step(16, 32, kv, no_q);
    assert_eq!(c.blocks.len(), 8, "evicted down to the budget after the first prompt block");
    assert!(ev.blocks >= 2);
    c.step(16, 32, kv, no_q);
    assert_eq!(c.blocks.len(), 8);
    let kept = c.kept(0);
    for p in odd {
        assert!(kept.contains(&(p as u32)), "distinctive key {p} kept: {kept:?}");
    }
    c.check_blocks();
}

#[test]
fn keydiff_decode_with_its_kept_anchor_evicts_what_rescoring_the_cache_would() {
    // Keys share a direction plus pseudo-random noise (distinct per table), so no two cosines tie.
    let key = |t: usize, p: usize| {
        let mut k = [0.0f32; HD];
        for (d, x) in k.iter_mut().enumerate() {
            let h = (p as u64 * 2_654_435_761 + t as u64 * 97 + d as u64 * 40_503).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            *x = 1.0 + ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0;
        }
        k
    };
    let kv = move |t: usize, p: usize| (key(t, p), [1.0; HD]);
    let mut c = Cache::new(PolicyKind::Keydiff, 8, 2, 2);
    c.step(16, 16, kv, no_q);
    // The reference: KeyDiff Eq. 8 over the positions kept so far, in f64, rescored from scratch each step.
    let mut want: Vec<Vec<u32>> = (0..2).map(|t| c.kept(t)).collect();
    for step in 0..60 {
        let p = 16 + step;
        c.step(1, p + 1, kv, no_q);
        for (t, kept) in want.iter_mut().enumerate() {
            kept.push(p as u32);
            let keys: Vec<[f64; HD]> = kept.iter().map(|&q| key(t, q as usize).map(f64::from)).collect();
            let norm = |k: &[f64; HD]| k.iter().map(|x| x * x).sum::<f64>().sqrt();
            let mut anchor = [0.0f64; HD];
            for k in &keys {
                for d in 0..HD {
                    anchor[d] += k[d] / norm(k) / keys.len() as f64;
                }
            }
            let cos = |k: &[f64; HD]| (0..HD).map(|d| k[d] * anchor[d]).sum::<f64>() / (norm(k) * norm(&anchor));
            let victim = (0..keys.len()).max_by(|&a, &b| cos(&keys[a]).total_cmp(&cos(&keys[b]))).unwrap();
            kept.remove(victim);
            assert_eq!(c.kept(t), *kept, "table {t}, decode step {step}");
        }
        c.check_blocks();
    }
}

/// One-hot-ish keys: position p points along axis p % HD, scaled so a query on that axis singles it out.
fn axis_key(p: usize, special: &[usize]) -> [f32; HD] {
    let mut k = [0.05; HD];
    if special.contains(&p) {
        k[0] = 4.0;
    } else {
        k[1 + p % 3] = 1.0;
    }
    k
}

#[test]
fn snapkv_keeps_what_the_observation_window_attends_to() {
    let special = [5usize, 11];
    let mut c = Cache::new(PolicyKind::Snapkv, 22, 1, 2);
    let kv = move |_: usize, p: usize| (axis_key(p, &special), [1.0; HD]);
    // The window queries (both heads of the group) look along axis 0.
    let q = |_: usize| vec![4.0, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0];
    c.step(40, 40, kv, q);
    let kept = c.kept(0);
    assert_eq!(kept.len(), 22);
    // The last 8 (window) are always kept; the 14 prefix slots left go to the attended keys and, by max-pooling
    // (p = 7), their neighbours within 3 slots.
    assert!((32..40).all(|p| kept.contains(&p)), "{kept:?}");
    assert!((2..15).all(|p| kept.contains(&p)), "{kept:?}");
    c.check_blocks();
    // Decode never reads the window again: no query is captured (nor kept) for it.
    assert_eq!(c.policy.capture_for(40, 1, 41, true), 0);
    assert_eq!(c.policy.capture_for(40, 1, 41, false), 0);
    c.step(1, 41, kv, |_| panic!("a decode step captures no query"));
    assert_eq!(c.kept(0).len(), 23, "decoded tokens accumulate");
    c.check_blocks();
}

/// A one-shot prefill selection that runs out of copy-on-write blocks part way (the first table's shared blocks
/// are copied and it is pruned, the second's cannot be) is not lost: the next step selects again, and every table
/// ends at the budget.
#[test]
fn a_prefill_selection_the_pool_cannot_finish_is_retried_at_the_next_step() {
    let mut c = Cache::new(PolicyKind::Snapkv, 8, 2, 2);
    let kv = |t: usize, p: usize| (scaled(1.0 + (p + t) as f32), [1.0; HD]);
    let q = |_: usize| vec![1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0];
    // Another sequence computed and registered the first 8 tokens (two groups); this one adopts them, so a
    // compaction writes into them only through copies.
    let layout = CacheLayout { n_layers: 1, n_kv_heads: 2, block_size: BS };
    let hashes = block_hashes("m", "", &(0..9).collect::<Vec<u32>>(), BS);
    let mut first = SeqBlocks::new(layout);
    first.reserve(&mut c.pool, 8).unwrap();
    for t in 0..2 {
        for p in 0..8 {
            let b = first.tables()[t][p / BS];
            let (k, v) = kv(t, p);
            c.kv.block_k_mut(b)[(p % BS) * HD..][..HD].copy_from_slice(&k);
            c.kv.block_v_mut(b)[(p % BS) * HD..][..HD].copy_from_slice(&v);
        }
    }
    first.advance(8);
    first.finish(&mut c.pool, &hashes).unwrap();
    assert_eq!(c.blocks.adopt(&mut c.pool, &hashes[..2]).unwrap(), 2);
    c.blocks.mark_pruned();
    c.pos = 8;
    // The step's 4 tokens take a block per table; 2 blocks more copy one table's two kept blocks, not both.
    let mut hog = Vec::new();
    let spare = c.pool.num_available() - 4;
    c.pool.allocate(spare, &mut hog).unwrap();
    assert!(c.try_step(4, 12, kv, q).is_err(), "the second table's copies cannot be had");
    assert_eq!(c.blocks.lens(), [8, 12], "the first table was pruned, the second was left whole");
    c.pool.release(&hog).unwrap();
    c.step(1, 13, kv, q);
    assert_eq!(c.blocks.lens(), [8, 8], "the selection ran again over both tables");
    // The window (the prompt's last 4 queries kept from the failed step, and the new token's) is kept whole.
    for t in 0..2 {
        let kept = c.kept(t);
        assert!((8..13).all(|p| kept.contains(&p)), "table {t}: {kept:?}");
    }
    c.check_blocks();
}

#[test]
fn sage_keeps_sinks_top_k_per_query_head_and_recent_then_slides() {
    // C = 32, G = 2 → sink 8, k = 8, recent 32 - 8 - 16 = 8.
    let mut c = Cache::new(PolicyKind::Sage, 32, 1, 2);
    let special = [20usize, 30, 40];
    let kv = move |_: usize, p: usize| (axis_key(p, &special), [1.0; HD]);
    let q = |_: usize| vec![4.0, 0.0, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0];
    c.step(64, 64, kv, q);
    let kept = c.kept(0);
    assert!((0..8).all(|p| kept.contains(&p)), "sinks: {kept:?}");
    assert!((55..64).all(|p| kept.contains(&p)), "recent + last: {kept:?}");
    assert!(special.iter().all(|&p| kept.contains(&(p as u32))), "head 0's top-k: {kept:?}");
    assert!(kept.len() <= 32 + 1);
    c.check_blocks();
    // Decode: the recent window slides once the cache is over budget; sinks and selected tokens stay.
    c.step(1, 65, kv, q);
    c.step(1, 66, kv, q);
    let after = c.kept(0);
    assert!(after.len() <= 32, "{after:?}");
    assert!(after.contains(&64) && after.contains(&65) && !after.contains(&55), "{after:?}");
    assert!(special.iter().all(|&p| after.contains(&(p as u32))));
    c.check_blocks();
}

#[test]
fn h2o_keeps_heavy_hitters_by_accumulated_attention() {
    let special = [6usize, 14];
    let mut c = Cache::new(PolicyKind::H2o, 16, 1, 1);
    let kv = move |_: usize, p: usize| (axis_key(p, &special), [1.0; HD]);
    let q = |_: usize| vec![4.0, 0.0, 0.0, 0.0];
    c.step(20, 40, kv, q);
    c.step(20, 40, kv, q);
    let kept = c.kept(0);
    assert_eq!(kept.len(), 16);
    assert!((32..40).all(|p| kept.contains(&p)), "recent half: {kept:?}");
    assert!(kept.contains(&6) && kept.contains(&14), "heavy hitters: {kept:?}");
    // Decode keeps the size at the budget and keeps the heavy hitters.
    for i in 0..6 {
        c.step(1, 41 + i, kv, q);
    }
    let kept = c.kept(0);
    assert_eq!(kept.len(), 16);
    assert!(kept.contains(&6) && kept.contains(&14), "{kept:?}");
    c.check_blocks();
}

/// H2O (prefill chunks and decode steps) and KV-Compress (decode steps) take their attention metric from the sums
/// of the attention kernel's probabilities; scoring the keys again from captured queries must give the same
/// metric and evict exactly the same slots.
#[test]
fn attention_metric_from_the_kernel_evicts_as_scoring_the_keys_does() {
    for kind in [PolicyKind::H2o, PolicyKind::KvCompress] {
        let special = [5usize, 22, 37, 51];
        let kv = move |t: usize, p: usize| {
            let mut k = axis_key(p, &special);
            k[1] += 0.05 * ((p * 7 + t * 3) % 11) as f32;
            (k, [1.0 + p as f32 * 0.01; HD])
        };
        let q = |p: usize| {
            let a = 1.0 + (p % 5) as f32 * 0.5;
            // Four query heads, two per kv-head.
            [[a, 0.3, 0.0, 0.1], [0.5 * a, 0.0, 0.2, 0.0], [2.0, 0.0, 0.0, 0.4], [a, a, 0.0, 0.0]].concat()
        };
        // After the prompt (two prefill chunks) and per decode step, each table's metric per slot.
        let run = |fused: bool, metrics: &mut Vec<Vec<f32>>| {
            let mut c = Cache::new(kind, 24, 2, 4);
            c.fused = fused;
            c.step(20, 32, kv, q);
            c.step(12, 32, kv, q);
            metrics.extend((0..2).map(|t| c.policy.metrics(t).to_vec()));
            for i in 0..40 {
                c.step(1, 33 + i, kv, q);
                metrics.extend((0..2).map(|t| c.policy.metrics(t).to_vec()));
                if kind == PolicyKind::KvCompress && i % 8 == 7 {
                    let target = c.policy.budget_blocks(&c.blocks);
                    let mut view = CacheView { blocks: &mut c.blocks, pool: &mut c.pool, kv: &mut c.kv };
                    c.policy.compress_to(&mut view, target).unwrap();
                }
            }
            c.check_blocks();
            (c.kept(0), c.kept(1))
        };
        let (mut from_kernel, mut from_keys) = (Vec::new(), Vec::new());
        let (fused, scored) = (run(true, &mut from_kernel), run(false, &mut from_keys));
        assert_eq!(fused, scored, "{kind:?}: kernel probabilities and key scoring disagree");
        assert_eq!(from_kernel.len(), from_keys.len());
        for (step, (a, b)) in from_kernel.iter().zip(&from_keys).enumerate() {
            assert!(!a.is_empty() && a.len() == b.len(), "{kind:?} step {step}: {} vs {} slots", a.len(), b.len());
            for (s, (x, y)) in a.iter().zip(b).enumerate() {
                assert!((x - y).abs() <= 1e-5 + 1e-5 * y.abs(), "{kind:?} step {step} slot {s}: {x} vs {y}");
            }
        }
        assert!(special.iter().all(|&p| fused.0.contains(&(p as u32))), "{kind:?} heavy hitters: {fused:?}");
    }
}

#[test]
fn kv_compress_evicts_variable_blocks_per_head_within_the_total_budget() {
    // Two kv-heads. Head 0's window attends to a handful of keys; head 1 attends uniformly (all keys equal). With
    // squared attention a diffuse head's keys each carry little (48 keys at 1/48 → 1/48² each), so the global
    // ranking takes more blocks from head 1 and keeps head 0's heavy hitters (and their pooled neighbours).
    let special = [3usize, 17, 29];
    let mut c = Cache::new(PolicyKind::KvCompress, 12, 2, 2);
    let kv = move |t: usize, p: usize| (if t == 0 { axis_key(p, &special) } else { [0.3; HD] }, [1.0; HD]);
    let q = |_: usize| vec![4.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
    let used_before = 2 * 48usize.div_ceil(BS);
    let ev = c.step(48, 48, kv, q);
    let budget_blocks = 2 * 12usize.div_ceil(BS);
    assert!(c.blocks.num_blocks() <= budget_blocks, "{} blocks > budget {budget_blocks}", c.blocks.num_blocks());
    assert_eq!(ev.blocks as usize, used_before - c.blocks.num_blocks());
    let (l0, l1) = (c.blocks.lens()[0], c.blocks.lens()[1]);
    assert!(l1 < l0, "head 1 (diffuse) compressed harder than head 0 (concentrated): {l1} vs {l0}");
    let kept0 = c.kept(0);
    // Every non-window survivor of head 0 is a heavy hitter or within the pooling radius (3) of one.
    let near = |p: u32| special.iter().any(|&s| (s as i64 - p as i64).abs() <= 3);
    assert!(kept0.iter().filter(|&&p| p < 40).all(|&p| near(p)), "{kept0:?}");
    assert!(kept0.contains(&3), "{kept0:?}");
    assert!((40..48).all(|p| kept0.contains(&p)), "window protected: {kept0:?}");
    c.check_blocks();
    // Decode grows the cache; compression under pressure brings it back to the budget.
    for i in 0..8 {
        c.step(1, 49 + i, kv, q);
    }
    assert!(c.blocks.num_blocks() > budget_blocks);
    let target = c.policy.budget_blocks(&c.blocks);
    let mut view = CacheView { blocks: &mut c.blocks, pool: &mut c.pool, kv: &mut c.kv };
    let ev = c.policy.compress_to(&mut view, target).unwrap();
    assert!(ev.blocks > 0);
    assert!(c.blocks.num_blocks() <= budget_blocks);
    c.check_blocks();
}

#[test]
fn full_policy_never_evicts() {
    let mut c = Cache::new(PolicyKind::Full, 0, 1, 1);
    let kv = |_: usize, p: usize| (scaled(p as f32), [1.0; HD]);
    let ev = c.step(30, 30, kv, no_q);
    assert_eq!((ev.slots, ev.blocks), (0, 0));
    assert_eq!(c.blocks.len(), 30);
}

#[test]
fn compaction_copies_shared_prefix_blocks_instead_of_writing_them() {
    let layout = CacheLayout { n_layers: 1, n_kv_heads: 1, block_size: BS };
    let mut pool = BlockPool::new(16);
    let mut kv = KvStorage::new(16, BS, HD);
    // A finished full-cache sequence leaves a registered 2-block prefix.
    let tokens: Vec<u32> = (0..9).collect();
    let hashes = block_hashes("m", "", &tokens, BS);
    let mut a = SeqBlocks::new(layout);
    a.reserve(&mut pool, 8).unwrap();
    for s in 0..8 {
        let b = a.tables()[0][s / BS];
        kv.block_k_mut(b)[(s % BS) * HD..][..HD].copy_from_slice(&[s as f32; HD]);
    }
    a.advance(8);
    a.finish(&mut pool, &hashes).unwrap();
    let shared: Vec<u32> = hashes[..2].iter().map(|&h| pool.lookup(h).unwrap()[0]).collect();
    // A pruning sequence adopts it and drops slots 0..3: its destination block must be a fresh copy.
    let mut b = SeqBlocks::new(layout);
    assert_eq!(b.adopt(&mut pool, &hashes[..2]).unwrap(), 2);
    b.mark_pruned();
    b.compact(&mut pool, &mut kv, 0, &[3, 4, 5, 6, 7]).unwrap();
    assert_ne!(b.tables()[0][0], shared[0], "written block was replaced");
    for (s, want) in [3.0f32, 4.0, 5.0, 6.0, 7.0].iter().enumerate() {
        let blk = b.tables()[0][s / BS];
        assert_eq!(kv.block_k(blk)[(s % BS) * HD], *want);
    }
    // The cached prefix is untouched and still matches.
    for (j, &blk) in shared.iter().enumerate() {
        for s in 0..BS {
            assert_eq!(kv.block_k(blk)[s * HD], (j * BS + s) as f32);
        }
    }
    b.free(&mut pool).unwrap();
    pool.check_invariants().unwrap();
    assert_eq!(pool.num_used(), 0);
    assert!(pool.lookup(hashes[0]).is_some() && pool.lookup(hashes[1]).is_some());
}
