//! Eviction score kernels and slot compaction against plain f64 references on random caches (scattered block
//! tables, lengths that are not multiples of the block size, NaN in every unused slot so that reading past `len`
//! fails the test), plus hand-made caches whose answers are known.

#![allow(clippy::needless_range_loop)]

mod common;

use common::rand_vec;
use pagoda_kernels::KvDtype;
use pagoda_kernels::KvStorage;
use pagoda_kernels::scores::{
    RATIO_EPS, Window, add_unit_keys, block_means, key_norms, keydiff_cosine, keydiff_cosine_kept, max_pool1d,
    select_k, select_one, value_key_ratio, window_attention_scores, window_attention_scores_portable,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const LENS: [usize; 7] = [0, 1, 7, 16, 17, 33, 100];
/// (block_size, head_dim): the served shape, a head_dim that is not a multiple of 8 (dot remainder path), and
/// blocks of one slot.
const SHAPES: [(usize, usize); 3] = [(16, 64), (4, 12), (1, 8)];

/// One (layer, kv-head) cache: the storage, its scattered table and the dense K/V it holds (`[len][hd]`).
struct Cache {
    kv: KvStorage,
    table: Vec<u32>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl Cache {
    /// A cache of `len` slots in `len.div_ceil(bs)` blocks picked at random from a larger arena whose every other
    /// float is NaN.
    fn random(rng: &mut StdRng, len: usize, bs: usize, hd: usize) -> Cache {
        let k: Vec<Vec<f32>> = (0..len).map(|_| rand_vec(rng, hd, 2.0)).collect();
        let v: Vec<Vec<f32>> = (0..len).map(|_| rand_vec(rng, hd, 2.0)).collect();
        Cache::with(rng, bs, hd, k, v)
    }

    /// [`Cache::random`] with every key shifted along one shared direction, so KeyDiff's anchor is well away from
    /// zero and the cosines spread out.
    fn clustered(rng: &mut StdRng, len: usize, bs: usize, hd: usize) -> Cache {
        let mut c = Cache::random(rng, len, bs, hd);
        let common = rand_vec(rng, hd, 1.0);
        for i in 0..len {
            for (x, &d) in c.k[i].iter_mut().zip(&common) {
                *x += 2.0 * d;
            }
            c.write(i);
        }
        c
    }

    fn with(rng: &mut StdRng, bs: usize, hd: usize, k: Vec<Vec<f32>>, v: Vec<Vec<f32>>) -> Cache {
        let len = k.len();
        let need = len.div_ceil(bs);
        let num_blocks = 2 * need + 3;
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        ids.shuffle(rng);
        let table = ids[..need].to_vec();
        let mut kv = KvStorage::new(num_blocks, bs, hd);
        let (ka, va) = kv.arenas_mut();
        ka.fill(f32::NAN);
        va.fill(f32::NAN);
        let mut c = Cache { kv, table, k, v };
        for i in 0..len {
            c.write(i);
        }
        c
    }

    fn write(&mut self, i: usize) {
        let (bs, hd) = (self.kv.block_size(), self.kv.head_dim());
        let b = self.table[i / bs];
        let off = (i % bs) * hd;
        self.kv.block_k_mut(b)[off..off + hd].copy_from_slice(&self.k[i]);
        self.kv.block_v_mut(b)[off..off + hd].copy_from_slice(&self.v[i]);
    }

    /// K and V of slot `i` as stored.
    fn read(&self, i: usize) -> (Vec<f32>, Vec<f32>) {
        let (bs, hd) = (self.kv.block_size(), self.kv.head_dim());
        let b = self.table[i / bs];
        let off = (i % bs) * hd;
        (self.kv.block_k(b)[off..off + hd].to_vec(), self.kv.block_v(b)[off..off + hd].to_vec())
    }
}

fn norm64(x: &[f32]) -> f64 {
    x.iter().map(|&a| f64::from(a) * f64::from(a)).sum::<f64>().sqrt()
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum()
}

#[track_caller]
fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(err <= tol * w.abs().max(1.0), "{what}: [{i}] got {g}, want {w} (err {err:e})");
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Random caches against the f64 references.

#[test]
fn key_norms_match_reference() {
    let mut rng = StdRng::seed_from_u64(1);
    for (bs, hd) in SHAPES {
        for len in LENS {
            let c = Cache::random(&mut rng, len, bs, hd);
            let mut out = vec![-1.0f32; len + 2];
            key_norms(&c.kv, &c.table, 0..len, &mut out);
            let want: Vec<f64> = c.k.iter().map(|k| norm64(k)).collect();
            assert_close(&out[..len], &want, 1e-5, &format!("key_norms bs={bs} hd={hd} len={len}"));
            assert_eq!(&out[len..], &[-1.0, -1.0], "key_norms wrote past len");
            // Any sub-range (within a block, across blocks, empty) writes exactly its slots, the same values.
            for from in [0, 1, bs.saturating_sub(1), bs, bs + 1, len.saturating_sub(1), len] {
                let from = from.min(len);
                let mut part = vec![-1.0f32; len + 2];
                key_norms(&c.kv, &c.table, from..len, &mut part);
                assert!(part[..from].iter().all(|&x| x == -1.0), "key_norms wrote before {from} (len {len})");
                assert_eq!(&part[from..len], &out[from..len], "key_norms {from}..{len} bs={bs} hd={hd}");
                assert_eq!(&part[len..], &[-1.0, -1.0]);
            }
        }
    }
}

#[test]
fn value_key_ratio_matches_reference() {
    let mut rng = StdRng::seed_from_u64(2);
    for (bs, hd) in SHAPES {
        for len in LENS {
            let c = Cache::random(&mut rng, len, bs, hd);
            let mut out = vec![-1.0f32; len + 1];
            value_key_ratio(&c.kv, &c.table, len, &mut out);
            let want: Vec<f64> = c.k.iter().zip(&c.v).map(|(k, v)| norm64(v) / norm64(k)).collect();
            assert_close(&out[..len], &want, 1e-5, &format!("value_key_ratio bs={bs} hd={hd} len={len}"));
            assert_eq!(out[len], -1.0, "value_key_ratio wrote past len");
        }
    }
}

/// KeyDiff Eq. 8 in f64: anchor = mean of normalised keys, score = cosine(anchor, k_i).
fn keydiff_ref(k: &[Vec<f32>]) -> (Vec<f64>, Vec<f64>) {
    let hd = k.first().map_or(0, Vec::len);
    let mut anchor = vec![0.0f64; hd];
    for key in k {
        let n = norm64(key);
        for (a, &x) in anchor.iter_mut().zip(key) {
            *a += f64::from(x) / n;
        }
    }
    for a in anchor.iter_mut() {
        *a /= k.len() as f64;
    }
    let an = anchor.iter().map(|a| a * a).sum::<f64>().sqrt();
    let scores = k
        .iter()
        .map(|key| key.iter().zip(&anchor).map(|(&x, a)| f64::from(x) * a).sum::<f64>() / (an * norm64(key)))
        .collect();
    (anchor, scores)
}

#[test]
fn keydiff_cosine_matches_reference() {
    let mut rng = StdRng::seed_from_u64(3);
    let mut anchor = Vec::new();
    for (bs, hd) in SHAPES {
        for len in LENS {
            let c = Cache::clustered(&mut rng, len, bs, hd);
            let mut out = vec![-7.0f32; len + 1];
            keydiff_cosine(&c.kv, &c.table, len, &mut anchor, &mut out);
            let what = format!("keydiff_cosine bs={bs} hd={hd} len={len}");
            assert_eq!(out[len], -7.0, "{what}: wrote past len");
            assert_eq!(anchor.len(), hd, "{what}: anchor length");
            if len == 0 {
                assert!(anchor.iter().all(|&a| a == 0.0), "{what}: anchor of an empty cache");
                continue;
            }
            let (want_anchor, want) = keydiff_ref(&c.k);
            assert_close(&anchor, &want_anchor, 1e-5, &format!("{what} anchor"));
            assert_close(&out[..len], &want, 1e-5, &what);
        }
    }
}

#[test]
fn keydiff_from_a_kept_anchor_sum_matches_the_two_pass_kernel() {
    let mut rng = StdRng::seed_from_u64(31);
    let (mut anchor, mut kept_anchor) = (Vec::new(), Vec::new());
    for (bs, hd) in SHAPES {
        for len in LENS {
            let c = Cache::clustered(&mut rng, len, bs, hd);
            let what = format!("keydiff_cosine_kept bs={bs} hd={hd} len={len}");
            let mut norms = vec![0.0f32; len];
            key_norms(&c.kv, &c.table, 0..len, &mut norms);
            let mut sum = vec![0.0f64; hd];
            add_unit_keys(&c.kv, &c.table, 0..len, &norms, 1.0, &mut sum);
            // Removing a slot and adding it back (an eviction, then the same key written again) leaves the sum.
            let before = sum.clone();
            for j in [0, len / 2, len.saturating_sub(1)].into_iter().filter(|&j| j < len) {
                add_unit_keys(&c.kv, &c.table, j..j + 1, &norms, -1.0, &mut sum);
                add_unit_keys(&c.kv, &c.table, j..j + 1, &norms, 1.0, &mut sum);
            }
            for (a, b) in sum.iter().zip(&before) {
                assert!((a - b).abs() < 1e-12, "{what}: sum drifted {a} vs {b}");
            }
            let (mut want, mut got) = (vec![-7.0f32; len + 1], vec![-7.0f32; len + 1]);
            keydiff_cosine(&c.kv, &c.table, len, &mut anchor, &mut want);
            keydiff_cosine_kept(&c.kv, &c.table, len, &sum, &norms, &mut kept_anchor, &mut got);
            assert_eq!(got[len], -7.0, "{what}: wrote past len");
            let want64: Vec<f64> = want[..len].iter().map(|&x| f64::from(x)).collect();
            assert_close(&got[..len], &want64, 1e-5, &what);
            let anchor64: Vec<f64> = anchor.iter().map(|&x| f64::from(x)).collect();
            assert_close(&kept_anchor, &anchor64, 1e-5, &format!("{what} anchor"));
            // The same over an f16 cache (where the CPU has AVX2, keys widened in registers, values never read).
            let mut kv16 = KvStorage::with_dtype(c.kv.num_blocks(), bs, hd, KvDtype::F16);
            for &b in &c.table {
                kv16.write_block(b, c.kv.block_k(b), c.kv.block_v(b));
            }
            key_norms(&kv16, &c.table, 0..len, &mut norms);
            let mut sum16 = vec![0.0f64; hd];
            add_unit_keys(&kv16, &c.table, 0..len, &norms, 1.0, &mut sum16);
            let (mut want, mut got) = (vec![-7.0f32; len + 1], vec![-7.0f32; len + 1]);
            keydiff_cosine(&kv16, &c.table, len, &mut anchor, &mut want);
            keydiff_cosine_kept(&kv16, &c.table, len, &sum16, &norms, &mut kept_anchor, &mut got);
            assert_eq!(got[len], -7.0, "{what} f16: wrote past len");
            let want64: Vec<f64> = want[..len].iter().map(|&x| f64::from(x)).collect();
            assert_close(&got[..len], &want64, 1e-5, &format!("{what} f16"));
        }
    }
}

/// Dense softmax attention of every (query, head) over its visible slots, in f64, accumulated as p^power.
#[allow(clippy::too_many_arguments)]
fn window_ref(
    k: &[Vec<f32>],
    q: &[f32],
    n_q: usize,
    group: usize,
    hd: usize,
    scale: f32,
    first_q_slot: usize,
    power: u32,
) -> Vec<f64> {
    let len = k.len();
    let mut out = vec![0.0f64; len];
    for i in 0..n_q {
        let vis = (first_q_slot + i + 1).min(len);
        for g in 0..group {
            let qv = &q[(i * group + g) * hd..(i * group + g + 1) * hd];
            let logits: Vec<f64> = (0..vis).map(|s| dot64(qv, &k[s]) * f64::from(scale)).collect();
            let mx = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
            let sum: f64 = e.iter().sum();
            for s in 0..vis {
                out[s] += (e[s] / sum).powi(power as i32);
            }
        }
    }
    out
}

#[test]
fn window_attention_scores_match_reference() {
    let mut rng = StdRng::seed_from_u64(4);
    let mut probs = Vec::new();
    for (bs, hd) in SHAPES {
        for len in LENS {
            let c = Cache::random(&mut rng, len, bs, hd);
            let scale = 1.0 / (hd as f32).sqrt();
            for &(n_q, group, power) in &[(1, 1, 1), (1, 4, 1), (5, 2, 2), (8, 3, 1), (3, 1, 3), (2, 2, 0)] {
                // Window at the end of the cache, in the middle (later slots masked for early queries), past it.
                for first in [len.saturating_sub(n_q), len / 3, len + 4] {
                    let q = rand_vec(&mut rng, n_q * group * hd, 1.5);
                    let init = rand_vec(&mut rng, len, 1.0);
                    let mut out = init.clone();
                    out.push(-3.0);
                    window_attention_scores(
                        &c.kv,
                        &c.table,
                        len,
                        Window { q: &q, n_q, group, scale, first_q_slot: first, power },
                        &mut probs,
                        &mut out,
                    );
                    let want: Vec<f64> = window_ref(&c.k, &q, n_q, group, hd, scale, first, power)
                        .iter()
                        .zip(&init)
                        .map(|(w, &i)| w + f64::from(i))
                        .collect();
                    let what = format!("window bs={bs} hd={hd} len={len} n_q={n_q} g={group} p={power} first={first}");
                    assert_close(&out[..len], &want, 1e-5, &what);
                    assert_eq!(out[len], -3.0, "{what}: wrote past len");
                    // The portable path too (the call above takes the SIMD one where the CPU has it).
                    let mut portable = init.clone();
                    portable.push(-3.0);
                    window_attention_scores_portable(
                        &c.kv,
                        &c.table,
                        len,
                        Window { q: &q, n_q, group, scale, first_q_slot: first, power },
                        &mut probs,
                        &mut portable,
                    );
                    assert_close(&portable[..len], &want, 1e-5, &format!("{what} (portable)"));
                    assert_eq!(portable[len], -3.0, "{what} (portable): wrote past len");
                }
            }
        }
    }
}

/// An f16 cache (what the worker serves with): keys are read as stored, so both paths must match the reference
/// over the f16-rounded keys.
#[test]
fn window_attention_scores_over_an_f16_cache_match_reference() {
    let mut rng = StdRng::seed_from_u64(9);
    let mut probs = Vec::new();
    for (bs, hd) in SHAPES {
        for len in [1usize, 17, 100, 300] {
            let need = len.div_ceil(bs);
            let mut ids: Vec<u32> = (0..(2 * need + 3) as u32).collect();
            ids.shuffle(&mut rng);
            let table = ids[..need].to_vec();
            let mut kv = KvStorage::with_dtype(2 * need + 3, bs, hd, KvDtype::F16);
            let mut k = Vec::with_capacity(len);
            for i in 0..len {
                let (kr, vr) = (rand_vec(&mut rng, hd, 2.0), rand_vec(&mut rng, hd, 2.0));
                kv.write_slot(table[i / bs], i % bs, &kr, &vr);
                let (mut kw, mut vw) = (vec![0.0; bs * hd], vec![0.0; bs * hd]);
                kv.read_block(table[i / bs], &mut kw, &mut vw);
                k.push(kw[(i % bs) * hd..(i % bs + 1) * hd].to_vec());
            }
            let scale = 1.0 / (hd as f32).sqrt();
            for &(n_q, group, power) in &[(1, 3, 2), (8, 3, 1), (2, 2, 2)] {
                let first = len.saturating_sub(n_q);
                let q = rand_vec(&mut rng, n_q * group * hd, 1.5);
                let want = window_ref(&k, &q, n_q, group, hd, scale, first, power);
                let what = format!("f16 window bs={bs} hd={hd} len={len} n_q={n_q} g={group} p={power}");
                let mut out = vec![0.0; len];
                window_attention_scores(
                    &kv,
                    &table,
                    len,
                    Window { q: &q, n_q, group, scale, first_q_slot: first, power },
                    &mut probs,
                    &mut out,
                );
                assert_close(&out, &want, 1e-5, &what);
                let mut portable = vec![0.0; len];
                window_attention_scores_portable(
                    &kv,
                    &table,
                    len,
                    Window { q: &q, n_q, group, scale, first_q_slot: first, power },
                    &mut probs,
                    &mut portable,
                );
                assert_close(&portable, &want, 1e-5, &format!("{what} (portable)"));
            }
        }
    }
}

#[test]
fn window_attention_scores_accumulate_across_calls() {
    // H2O's running sum: two decode steps added into the same metrics equal the two contributions summed.
    let mut rng = StdRng::seed_from_u64(5);
    let c = Cache::random(&mut rng, 37, 16, 64);
    let q1 = rand_vec(&mut rng, 2 * 64, 1.0);
    let q2 = rand_vec(&mut rng, 2 * 64, 1.0);
    let mut probs = Vec::new();
    let mut both = vec![0.0f32; 37];
    window_attention_scores(
        &c.kv,
        &c.table,
        36,
        Window { q: &q1, n_q: 1, group: 2, scale: 0.125, first_q_slot: 35, power: 1 },
        &mut probs,
        &mut both,
    );
    window_attention_scores(
        &c.kv,
        &c.table,
        37,
        Window { q: &q2, n_q: 1, group: 2, scale: 0.125, first_q_slot: 36, power: 1 },
        &mut probs,
        &mut both,
    );
    let mut want = window_ref(&c.k[..36], &q1, 1, 2, 64, 0.125, 35, 1);
    want.push(0.0);
    for (w, x) in want.iter_mut().zip(window_ref(&c.k, &q2, 1, 2, 64, 0.125, 36, 1)) {
        *w += x;
    }
    assert_close(&both, &want, 1e-5, "two accumulated steps");
}

fn max_pool_ref(x: &[f32], kernel: usize) -> Vec<f64> {
    let h = kernel / 2;
    (0..x.len())
        .map(|j| {
            let lo = j.saturating_sub(h);
            let hi = (j + h).min(x.len() - 1);
            f64::from(x[lo..=hi].iter().copied().fold(f32::NEG_INFINITY, f32::max))
        })
        .collect()
}

#[test]
fn max_pool1d_matches_reference() {
    let mut rng = StdRng::seed_from_u64(6);
    for n in [0, 1, 2, 3, 6, 7, 8, 100] {
        let x = rand_vec(&mut rng, n, 5.0);
        for kernel in [1, 3, 5, 7, 9, 15] {
            let mut out = vec![0.0f32; n];
            max_pool1d(&x, kernel, &mut out);
            assert_close(&out, &max_pool_ref(&x, kernel), 0.0, &format!("max_pool1d n={n} kernel={kernel}"));
        }
    }
}

#[test]
fn block_means_match_reference() {
    let mut rng = StdRng::seed_from_u64(7);
    for bs in [1, 4, 16] {
        for len in LENS {
            // x longer than len: entries past len must not count.
            let x = rand_vec(&mut rng, len + 5, 3.0);
            let nb = len.div_ceil(bs);
            let mut out = vec![-9.0f32; nb + 1];
            block_means(&x, len, bs, &mut out);
            let want: Vec<f64> = (0..nb)
                .map(|b| {
                    let s = &x[b * bs..((b + 1) * bs).min(len)];
                    s.iter().map(|&v| f64::from(v)).sum::<f64>() / s.len() as f64
                })
                .collect();
            assert_close(&out[..nb], &want, 1e-6, &format!("block_means bs={bs} len={len}"));
            assert_eq!(out[nb], -9.0, "block_means wrote past the last block");
        }
    }
}

/// Full sort by (value, index) — descending value for `largest` — then the first k indices, ascending.
fn select_ref(x: &[f32], k: usize, largest: bool) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..x.len() as u32).collect();
    idx.sort_by(|&a, &b| {
        let (va, vb) = (x[a as usize], x[b as usize]);
        let o = if largest { vb.partial_cmp(&va) } else { va.partial_cmp(&vb) };
        o.expect("no NaN in test data").then(a.cmp(&b))
    });
    let mut r = idx[..k.min(x.len())].to_vec();
    r.sort_unstable();
    r
}

#[test]
fn select_k_matches_reference() {
    let mut rng = StdRng::seed_from_u64(8);
    let (mut idx, mut out) = (Vec::new(), vec![99u32; 3]);
    for n in [0, 1, 2, 7, 16, 17, 100, 1000] {
        // Continuous values, and values from a set of 4 so that ties decide most of the selection.
        let cont = rand_vec(&mut rng, n, 1.0);
        let tied: Vec<f32> = (0..n).map(|_| f32::from(rng.random_range(0u8..4))).collect();
        for x in [&cont, &tied] {
            for k in [0, 1, 2, n / 3, n / 2, n.saturating_sub(1), n, n + 5] {
                for largest in [false, true] {
                    select_k(x, k, largest, &mut idx, &mut out);
                    assert_eq!(out, select_ref(x, k, largest), "select_k n={n} k={k} largest={largest}");
                }
            }
        }
    }
}

#[test]
fn select_one_is_select_k_of_one_over_the_eligible() {
    let mut rng = StdRng::seed_from_u64(32);
    let (mut idx, mut out) = (Vec::new(), Vec::new());
    for n in [0, 1, 2, 7, 100, 1000] {
        let cont = rand_vec(&mut rng, n, 1.0);
        let tied: Vec<f32> = (0..n).map(|_| f32::from(rng.random_range(0u8..4))).collect();
        for x in [&cont, &tied] {
            for largest in [false, true] {
                select_k(x, 1, largest, &mut idx, &mut out);
                assert_eq!(select_one(x, largest, |_| true), out.first().map(|&i| i as usize), "n={n}");
                // Only every third index eligible: the same as select_k over those values alone.
                let eligible: Vec<usize> = (0..n).filter(|i| i % 3 == 1).collect();
                let sub: Vec<f32> = eligible.iter().map(|&i| x[i]).collect();
                select_k(&sub, 1, largest, &mut idx, &mut out);
                let want = out.first().map(|&j| eligible[j as usize]);
                assert_eq!(select_one(x, largest, |i| i % 3 == 1), want, "n={n} largest={largest}, filtered");
            }
        }
    }
    assert_eq!(select_one(&[1.0, 2.0], false, |_| false), None);
    assert_eq!(select_one(&[0.0, -0.0], false, |_| true), Some(0), "-0 and +0 tie");
}

#[test]
fn compact_table_matches_reference() {
    let mut rng = StdRng::seed_from_u64(9);
    for (bs, hd) in SHAPES {
        for len in LENS {
            for keep_p in [0.0, 0.3, 0.7, 1.0] {
                let mut c = Cache::random(&mut rng, len, bs, hd);
                let keep: Vec<u32> = (0..len as u32).filter(|_| rng.random_bool(keep_p)).collect();
                let new_len = c.kv.compact_table(&c.table, len, &keep);
                assert_eq!(new_len, keep.len());
                for (j, &src) in keep.iter().enumerate() {
                    let (k, v) = c.read(j);
                    assert_eq!(k, c.k[src as usize], "bs={bs} len={len}: K of new slot {j} (was {src})");
                    assert_eq!(v, c.v[src as usize], "bs={bs} len={len}: V of new slot {j} (was {src})");
                }
                // Blocks outside the table are untouched (still all NaN).
                let (ka, _) = c.kv.arenas();
                for b in 0..c.kv.num_blocks() as u32 {
                    if !c.table.contains(&b) {
                        let r = b as usize * bs * hd..(b as usize + 1) * bs * hd;
                        assert!(ka[r].iter().all(|x| x.is_nan()), "block {b} outside the table was written");
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Hand-made caches with known answers.

/// `e(hd, i, x)`: x times the i-th unit vector.
fn e(hd: usize, i: usize, x: f32) -> Vec<f32> {
    let mut v = vec![0.0; hd];
    v[i] = x;
    v
}

#[test]
fn knorm_picks_the_big_key() {
    let mut rng = StdRng::seed_from_u64(10);
    let hd = 8;
    let mut k: Vec<Vec<f32>> = (0..20).map(|_| rand_vec(&mut rng, hd, 1.0)).collect();
    k[13] = vec![5.0; hd];
    let v = vec![vec![1.0; hd]; 20];
    let c = Cache::with(&mut rng, 4, hd, k, v);
    let mut out = vec![0.0; 20];
    key_norms(&c.kv, &c.table, 0..20, &mut out);
    assert!((out[13] - 5.0 * (hd as f32).sqrt()).abs() < 1e-5);
    let (mut idx, mut sel) = (Vec::new(), Vec::new());
    select_k(&out, 1, true, &mut idx, &mut sel);
    assert_eq!(sel, [13], "knorm evicts the largest-norm key");
}

#[test]
fn value_key_ratio_exact_values() {
    let mut rng = StdRng::seed_from_u64(11);
    let k = vec![vec![3.0, 4.0, 0.0, 0.0], vec![0.0, 0.0, 0.0, 2.0], vec![0.0; 4], vec![1.0, 1.0, 1.0, 1.0]];
    let v = vec![vec![0.0, 0.0, 6.0, 8.0], vec![1.0, 0.0, 0.0, 0.0], vec![0.0, 3.0, 4.0, 0.0], vec![0.0; 4]];
    let c = Cache::with(&mut rng, 3, 4, k, v);
    let mut out = vec![0.0; 4];
    value_key_ratio(&c.kv, &c.table, 4, &mut out);
    assert_eq!(out[0], 2.0);
    assert_eq!(out[1], 0.5);
    // Zero key: finite, ‖V‖ / RATIO_EPS.
    assert!(out[2].is_finite());
    assert!((out[2] - 5.0 / RATIO_EPS).abs() <= 1e-6 * (5.0 / RATIO_EPS));
    assert_eq!(out[3], 0.0);
}

#[test]
fn keydiff_ranks_the_outlier_least_similar() {
    let mut rng = StdRng::seed_from_u64(12);
    let hd = 16;
    // Twenty keys around +e0 with different norms, one pointing along e5.
    let mut k: Vec<Vec<f32>> = (0..21)
        .map(|i| {
            let mut x = e(hd, 0, 1.0 + i as f32);
            for (j, n) in rand_vec(&mut rng, hd, 0.1).into_iter().enumerate() {
                x[j] += n;
            }
            x
        })
        .collect();
    k[9] = e(hd, 5, 0.5);
    let v = vec![vec![1.0; hd]; 21];
    let c = Cache::with(&mut rng, 16, hd, k, v);
    let (mut anchor, mut out) = (Vec::new(), vec![0.0; 21]);
    keydiff_cosine(&c.kv, &c.table, 21, &mut anchor, &mut out);
    let (mut idx, mut sel) = (Vec::new(), Vec::new());
    select_k(&out, 1, false, &mut idx, &mut sel);
    assert_eq!(sel, [9], "the outlier is the least similar to the anchor");
    // Evicting the 5 most similar never touches the outlier.
    select_k(&out, 5, true, &mut idx, &mut sel);
    assert!(!sel.contains(&9));
    // The anchor is the mean of unit vectors: 20 near e0 and one at e5.
    assert!((anchor[0] - 20.0 / 21.0).abs() < 0.02, "anchor[0] = {}", anchor[0]);
    assert!((anchor[5] - 1.0 / 21.0).abs() < 0.02, "anchor[5] = {}", anchor[5]);
    assert!(out[..21].iter().enumerate().all(|(i, &s)| i == 9 || s > 0.95));
}

#[test]
fn window_scores_sum_to_query_count_when_all_visible() {
    let mut rng = StdRng::seed_from_u64(13);
    let (hd, len, n_q, group) = (64, 50, 6, 4);
    let c = Cache::random(&mut rng, len, 16, hd);
    let q = rand_vec(&mut rng, n_q * group * hd, 2.0);
    let mut probs = Vec::new();
    let mut out = vec![0.0; len];
    window_attention_scores(
        &c.kv,
        &c.table,
        len,
        Window { q: &q, n_q, group, scale: 0.125, first_q_slot: len - 1, power: 1 },
        &mut probs,
        &mut out,
    );
    let total: f32 = out.iter().sum();
    assert!((total - (n_q * group) as f32).abs() < 1e-4, "sum {total}");
    // Squared attention sums to less (probabilities below 1), but to at least (n_q*group)/len.
    let mut sq = vec![0.0; len];
    window_attention_scores(
        &c.kv,
        &c.table,
        len,
        Window { q: &q, n_q, group, scale: 0.125, first_q_slot: len - 1, power: 2 },
        &mut probs,
        &mut sq,
    );
    let total_sq: f32 = sq.iter().sum();
    assert!(total_sq < total && total_sq >= (n_q * group) as f32 / len as f32 - 1e-5, "squared sum {total_sq}");
}

#[test]
fn window_scores_mask_future_slots() {
    let mut rng = StdRng::seed_from_u64(14);
    let (hd, len, group) = (8, 10, 2);
    // Slot 7 matches the query perfectly and is huge: it would take almost all the attention were it visible.
    let mut k: Vec<Vec<f32>> = (0..len).map(|_| rand_vec(&mut rng, hd, 0.1)).collect();
    k[7] = vec![10.0; hd];
    let v = vec![vec![0.0; hd]; len];
    let c = Cache::with(&mut rng, 4, hd, k, v);
    let q = vec![1.0f32; 2 * group * hd];
    let mut probs = Vec::new();

    // One query at slot 0 sees only slot 0: all of each head's weight lands there.
    let mut out = vec![0.0; len];
    window_attention_scores(
        &c.kv,
        &c.table,
        len,
        Window { q: &q[..group * hd], n_q: 1, group, scale: 1.0, first_q_slot: 0, power: 1 },
        &mut probs,
        &mut out,
    );
    assert!((out[0] - group as f32).abs() < 1e-6, "{out:?}");
    assert!(out[1..].iter().all(|&x| x == 0.0), "{out:?}");

    // Queries at slots 3 and 4: slots 5.. (including the huge slot 7) get exactly nothing; slot 4 only from the
    // second query.
    let mut out = vec![0.0; len];
    window_attention_scores(
        &c.kv,
        &c.table,
        len,
        Window { q: &q, n_q: 2, group, scale: 1.0, first_q_slot: 3, power: 1 },
        &mut probs,
        &mut out,
    );
    assert!(out[5..].iter().all(|&x| x == 0.0), "{out:?}");
    assert!((out.iter().sum::<f32>() - 2.0 * group as f32).abs() < 1e-5, "{out:?}");
    let mut first_only = vec![0.0; len];
    window_attention_scores(
        &c.kv,
        &c.table,
        len,
        Window { q: &q[..group * hd], n_q: 1, group, scale: 1.0, first_q_slot: 3, power: 1 },
        &mut probs,
        &mut first_only,
    );
    assert_eq!(first_only[4], 0.0);
    assert!(out[4] > 0.0);

    // Once visible, slot 7 dominates.
    let mut out = vec![0.0; len];
    window_attention_scores(
        &c.kv,
        &c.table,
        len,
        Window { q: &q[..group * hd], n_q: 1, group, scale: 1.0, first_q_slot: 9, power: 1 },
        &mut probs,
        &mut out,
    );
    assert!(out[7] > 0.99 * group as f32, "{out:?}");
}

#[test]
fn max_pool_edges() {
    let x = [5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0];
    let mut out = [0.0; 7];
    max_pool1d(&x, 3, &mut out);
    assert_eq!(out, [5.0, 5.0, 0.0, 0.0, 0.0, 9.0, 9.0]);
    max_pool1d(&x, 7, &mut out);
    assert_eq!(out, [5.0, 5.0, 5.0, 9.0, 9.0, 9.0, 9.0]);
    max_pool1d(&x, 1, &mut out);
    assert_eq!(out, x);
    // A window wider than the input: everything sees the max; negative values are not beaten by padding.
    let y = [-3.0, -1.0, -2.0];
    let mut o = [0.0; 3];
    max_pool1d(&y, 9, &mut o);
    assert_eq!(o, [-1.0; 3]);
    let mut one = [0.0];
    max_pool1d(&[-4.0], 7, &mut one);
    assert_eq!(one, [-4.0]);
}

#[test]
fn block_means_partial_last_block() {
    let mut out = [0.0; 3];
    block_means(&[1.0, 2.0, 3.0, 4.0, 5.0], 5, 2, &mut out);
    assert_eq!(out, [1.5, 3.5, 5.0]);
}

#[test]
fn select_k_ties_and_edges() {
    let (mut idx, mut out) = (Vec::new(), Vec::new());
    select_k(&[1.0, 1.0, 1.0, 1.0], 2, false, &mut idx, &mut out);
    assert_eq!(out, [0, 1]);
    select_k(&[1.0, 1.0, 1.0, 1.0], 2, true, &mut idx, &mut out);
    assert_eq!(out, [0, 1]);
    select_k(&[2.0, 1.0, 1.0, 2.0], 1, false, &mut idx, &mut out);
    assert_eq!(out, [1]);
    select_k(&[2.0, 1.0, 1.0, 2.0], 1, true, &mut idx, &mut out);
    assert_eq!(out, [0]);
    select_k(&[2.0, 1.0, 1.0, 2.0], 3, true, &mut idx, &mut out);
    assert_eq!(out, [0, 1, 3]);
    // −0 and +0 tie, so the lower index wins either way.
    select_k(&[0.0, -0.0], 1, false, &mut idx, &mut out);
    assert_eq!(out, [0]);
    select_k(&[-0.0, 0.0], 1, true, &mut idx, &mut out);
    assert_eq!(out, [0]);
    // Output is ascending by index, not by value.
    select_k(&[9.0, 3.0, 7.0, 1.0, 8.0], 3, true, &mut idx, &mut out);
    assert_eq!(out, [0, 2, 4]);
    select_k(&[9.0, 3.0, 7.0], 10, false, &mut idx, &mut out);
    assert_eq!(out, [0, 1, 2]);
    select_k(&[], 3, false, &mut idx, &mut out);
    assert!(out.is_empty());
    // NaN does not panic and sorts above +inf.
    select_k(&[f32::NAN, f32::INFINITY, 0.0], 1, true, &mut idx, &mut out);
    assert_eq!(out, [0]);
}

#[test]
fn compact_table_preserves_order_and_values() {
    let mut rng = StdRng::seed_from_u64(15);
    let k: Vec<Vec<f32>> = (0..10).map(|i| vec![i as f32, -(i as f32)]).collect();
    let v: Vec<Vec<f32>> = (0..10).map(|i| vec![100.0 + i as f32, 0.5]).collect();
    let mut c = Cache::with(&mut rng, 3, 2, k, v);
    let keep = [1u32, 2, 5, 8, 9];
    assert_eq!(c.kv.compact_table(&c.table, 10, &keep), 5);
    for (j, &s) in keep.iter().enumerate() {
        assert_eq!(c.read(j), (vec![s as f32, -(s as f32)], vec![100.0 + s as f32, 0.5]), "slot {j}");
    }
    // Keeping a prefix moves nothing.
    let before = c.kv.arenas().0.to_vec();
    assert_eq!(c.kv.compact_table(&c.table, 5, &[0, 1, 2]), 3);
    assert_eq!(c.kv.arenas().0.len(), before.len());
    assert!(c.kv.arenas().0.iter().zip(&before).all(|(a, b)| a.to_bits() == b.to_bits()));
    assert_eq!(c.kv.compact_table(&c.table, 5, &[]), 0);
}

#[test]
fn move_slot_copies_k_and_v() {
    let mut kv = KvStorage::new(3, 4, 2);
    let (ka, va) = kv.arenas_mut();
    for (i, (k, v)) in ka.iter_mut().zip(va.iter_mut()).enumerate() {
        *k = i as f32;
        *v = 1000.0 + i as f32;
    }
    let before = (kv.arenas().0.to_vec(), kv.arenas().1.to_vec());
    kv.move_slot(2, 1, 0, 3);
    // Block 2 slot 1 = floats 18..20; block 0 slot 3 = floats 6..8.
    assert_eq!(&kv.block_k(0)[6..8], &[18.0, 19.0]);
    assert_eq!(&kv.block_v(0)[6..8], &[1018.0, 1019.0]);
    assert_eq!(&kv.block_k(2)[2..4], &[18.0, 19.0], "the source is left as it was");
    let (ka, va) = kv.arenas();
    for i in (0..24).filter(|i| !(6..8).contains(i)) {
        assert_eq!((ka[i], va[i]), (before.0[i], before.1[i]), "float {i} changed");
    }
    // Same block, other slot; then the no-op.
    kv.move_slot(1, 0, 1, 2);
    assert_eq!(&kv.block_k(1)[4..6], &[8.0, 9.0]);
    assert_eq!(&kv.block_v(1)[4..6], &[1008.0, 1009.0]);
    let snap = (kv.arenas().0.to_vec(), kv.arenas().1.to_vec());
    kv.move_slot(1, 3, 1, 3);
    assert_eq!((kv.arenas().0.to_vec(), kv.arenas().1.to_vec()), snap);
}

#[test]
#[should_panic(expected = "slot out of range")]
fn move_slot_rejects_bad_slot() {
    let mut kv = KvStorage::new(2, 4, 2);
    kv.move_slot(0, 4, 1, 0);
}

#[test]
#[should_panic(expected = "out of range")]
fn move_slot_rejects_bad_block() {
    let mut kv = KvStorage::new(2, 4, 2);
    kv.move_slot(0, 0, 2, 0);
}
