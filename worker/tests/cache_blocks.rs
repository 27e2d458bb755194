//! Block pool, prefix index and sequence block tables working together (no model).

use pagoda_worker::cache::{BlockPool, CacheError, CacheLayout, SeqBlocks, block_hashes};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const LAYOUT: CacheLayout = CacheLayout { n_layers: 2, n_kv_heads: 3, block_size: 4 };
const GS: usize = 6;

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

/// Simulates computing `tokens` for a fresh sequence: adopt the cached prefix, reserve, advance, register.
fn run_seq(pool: &mut BlockPool, ns: &str, tokens: &[u32], cache: bool) -> (SeqBlocks, usize) {
    let hashes = block_hashes("model", ns, tokens, LAYOUT.block_size);
    let mut s = SeqBlocks::new(LAYOUT);
    let matched = if cache {
        // Keep at least one token to compute, as the scheduler does.
        let max = (tokens.len().saturating_sub(1)) / LAYOUT.block_size;
        s.adopt(pool, &hashes[..max.min(hashes.len())]).unwrap()
    } else {
        0
    };
    let done = matched * LAYOUT.block_size;
    s.reserve(pool, tokens.len() - done).unwrap();
    s.advance(tokens.len() - done);
    if cache {
        s.register_full(pool, &hashes);
    }
    (s, done)
}

#[test]
fn blocks_are_freed_and_reused() {
    let mut pool = BlockPool::new(10 * GS);
    let mut a = SeqBlocks::new(LAYOUT);
    a.reserve(&mut pool, 9).unwrap(); // 3 groups
    assert_eq!(a.num_groups(), 3);
    assert_eq!(pool.num_used(), 3 * GS);
    a.advance(9);
    assert_eq!(a.lens(), &[9; GS]);
    // Reserving within capacity allocates nothing.
    a.reserve(&mut pool, 3).unwrap();
    assert_eq!(pool.num_used(), 3 * GS);
    let first: Vec<u32> = a.tables().iter().flatten().copied().collect();
    a.free(&mut pool).unwrap();
    assert_eq!((pool.num_used(), pool.num_free()), (0, 10 * GS));
    // The same physical blocks come back.
    let mut b = SeqBlocks::new(LAYOUT);
    b.reserve(&mut pool, 40).unwrap();
    assert_eq!(pool.num_used(), 10 * GS);
    let mut all: Vec<u32> = b.tables().iter().flatten().copied().collect();
    all.sort();
    assert!(first.iter().all(|x| all.binary_search(x).is_ok()));
    // Pool exhausted: a further reservation fails cleanly and changes nothing.
    let mut c = SeqBlocks::new(LAYOUT);
    assert!(matches!(c.reserve(&mut pool, 1), Err(CacheError::OutOfBlocks { .. })));
    assert!(c.is_empty());
    b.free(&mut pool).unwrap();
    assert_eq!(pool.num_used(), 0);
    pool.check_invariants().unwrap();
}

#[test]
fn lru_evicts_least_recently_finished_first() {
    let mut pool = BlockPool::new(4 * GS);
    // Two sequences, each with one full cached group (5 tokens: 1 full block + 1 token).
    let ta = toks(0..5);
    let tb = toks(100..105);
    let (mut a, _) = run_seq(&mut pool, "", &ta, true);
    let (mut b, _) = run_seq(&mut pool, "", &tb, true);
    let ha = block_hashes("model", "", &ta, 4)[0];
    let hb = block_hashes("model", "", &tb, 4)[0];
    // Finish b first, then a: b is the least recently used.
    b.finish(&mut pool, &[hb]).unwrap();
    a.finish(&mut pool, &[ha]).unwrap();
    assert_eq!(pool.num_used(), 0);
    assert_eq!(pool.num_cached_free(), 2 * GS);
    assert_eq!(pool.lru_order(), vec![hb, ha]);
    // Two free groups remain; taking them leaves the cache intact.
    let mut x = SeqBlocks::new(LAYOUT);
    x.reserve(&mut pool, 8).unwrap();
    assert!(pool.lookup(ha).is_some() && pool.lookup(hb).is_some());
    // The next group evicts b's, then a's.
    x.reserve(&mut pool, 12).unwrap();
    assert!(pool.lookup(hb).is_none());
    assert!(pool.lookup(ha).is_some());
    x.reserve(&mut pool, 16).unwrap();
    assert!(pool.lookup(ha).is_none());
    assert_eq!(pool.evicted_groups(), 2);
    x.free(&mut pool).unwrap();
    pool.check_invariants().unwrap();
}

#[test]
fn prefix_hit_reuses_the_same_physical_blocks() {
    let mut pool = BlockPool::new(20 * GS);
    let prompt = toks(0..14); // 3 full blocks + 2
    let hashes = block_hashes("model", "t", &prompt, 4);
    let (mut a, computed_from) = run_seq(&mut pool, "t", &prompt, true);
    assert_eq!(computed_from, 0);
    let a_tables: Vec<Vec<u32>> = a.tables().to_vec();
    a.finish(&mut pool, &hashes).unwrap();
    assert_eq!(pool.num_cached_free(), 3 * GS);
    // Same prompt: 3 groups matched, the very same block ids, only 2 tokens computed.
    let (b, done) = run_seq(&mut pool, "t", &prompt, true);
    assert_eq!(done, 12);
    for (ta, tb) in a_tables.iter().zip(b.tables()) {
        assert_eq!(&ta[..3], &tb[..3]);
    }
    assert_eq!(pool.num_cached_free(), 0);
    // A longer prompt sharing 2 blocks matches exactly those.
    let mut longer = toks(0..8);
    longer.extend(500..510);
    let (c, done) = run_seq(&mut pool, "t", &longer, true);
    assert_eq!(done, 8);
    for (tb, tc) in b.tables().iter().zip(c.tables()) {
        assert_eq!(&tb[..2], &tc[..2]);
        assert_ne!(tb[2], tc[2]);
    }
    // A prompt that is exactly 3 blocks matches only 2: the last token must be computed for logits.
    let (d, done) = run_seq(&mut pool, "t", &prompt[..12], true);
    assert_eq!(done, 8);
    for mut s in [b, c, d] {
        s.free(&mut pool).unwrap();
    }
    assert_eq!(pool.num_used(), 0);
    pool.check_invariants().unwrap();
}

#[test]
fn namespaces_never_share_blocks() {
    let mut pool = BlockPool::new(20 * GS);
    let prompt = toks(0..13);
    let (a, _) = run_seq(&mut pool, "tenant-a", &prompt, true);
    let (b, done_b) = run_seq(&mut pool, "tenant-b", &prompt, true);
    assert_eq!(done_b, 0);
    let ids_a: Vec<u32> = a.tables().iter().flatten().copied().collect();
    assert!(b.tables().iter().flatten().all(|x| !ids_a.contains(x)));
    // Within a namespace the prefix is shared.
    let (c, done_c) = run_seq(&mut pool, "tenant-a", &prompt, true);
    assert_eq!(done_c, 12);
    assert_eq!(a.tables()[0][..3], c.tables()[0][..3]);
    for mut s in [a, b, c] {
        s.free(&mut pool).unwrap();
    }
    pool.check_invariants().unwrap();
}

#[test]
fn refcounts_under_shared_prefixes() {
    let mut pool = BlockPool::new(20 * GS);
    let prompt = toks(0..9); // 2 full blocks + 1
    let (a, _) = run_seq(&mut pool, "", &prompt, true);
    let (b, db) = run_seq(&mut pool, "", &prompt, true);
    let (c, dc) = run_seq(&mut pool, "", &prompt, true);
    assert_eq!((db, dc), (8, 8));
    let shared = a.tables()[4][1];
    assert_eq!(pool.ref_count(shared), 3);
    assert_eq!(pool.ref_count(a.tables()[4][2]), 1, "tail blocks are private");
    // 2 shared groups + 3 private tail groups.
    assert_eq!(pool.num_used(), 5 * GS);
    let mut seqs = vec![a, b, c];
    for (i, mut s) in seqs.drain(..).enumerate() {
        s.free(&mut pool).unwrap();
        let holders = 2 - i as u32;
        assert_eq!(pool.ref_count(shared), holders);
        if holders > 0 {
            assert_eq!(pool.num_cached_free(), 0, "a held group is not evictable");
        }
        pool.check_invariants().unwrap();
    }
    assert_eq!((pool.num_used(), pool.num_cached_free()), (0, 2 * GS));
}

#[test]
fn random_alloc_free_cycles_leak_nothing() {
    let mut rng = StdRng::seed_from_u64(0xC0FFEE);
    let total = 40 * GS;
    let mut pool = BlockPool::new(total);
    let namespaces = ["", "x"];
    let mut live: Vec<(SeqBlocks, Vec<u64>, usize)> = Vec::new();
    for step in 0..4000 {
        match rng.random_range(0..10) {
            // Start a sequence from one of a few shared prompt families.
            0..=3 => {
                let fam = rng.random_range(0..4u32);
                let len = rng.random_range(1..30usize);
                let ns = namespaces[rng.random_range(0..2)];
                let tokens: Vec<u32> = (0..len as u32).map(|i| fam * 1000 + i).collect();
                let hashes = block_hashes("model", ns, &tokens, 4);
                let mut s = SeqBlocks::new(LAYOUT);
                let max = (len - 1) / 4;
                let matched = s.adopt(&mut pool, &hashes[..max]).unwrap();
                let done = matched * 4;
                match s.reserve(&mut pool, len - done) {
                    Ok(()) => {
                        s.advance(len - done);
                        s.register_full(&mut pool, &hashes);
                        live.push((s, hashes, len));
                    }
                    Err(CacheError::OutOfBlocks { .. }) => s.free(&mut pool).unwrap(),
                    Err(e) => panic!("{e}"),
                }
            }
            // Grow a sequence (decode a few tokens).
            4..=6 if !live.is_empty() => {
                let i = rng.random_range(0..live.len());
                let n = rng.random_range(1..6);
                let (s, _, len) = &mut live[i];
                if s.reserve(&mut pool, n).is_ok() {
                    s.advance(n);
                    *len += n;
                }
            }
            // Finish or drop a sequence.
            _ if !live.is_empty() => {
                let i = rng.random_range(0..live.len());
                let (mut s, hashes, _) = live.swap_remove(i);
                if rng.random_bool(0.5) {
                    s.finish(&mut pool, &hashes).unwrap();
                } else {
                    s.free(&mut pool).unwrap();
                }
            }
            _ => {}
        }
        let held: usize = live.iter().map(|(s, ..)| s.num_blocks()).sum();
        assert!(pool.num_used() <= held, "step {step}: used {} > held {held}", pool.num_used());
        assert_eq!(pool.num_used() + pool.num_available(), total);
        if step % 97 == 0 {
            pool.check_invariants().unwrap_or_else(|e| panic!("step {step}: {e}"));
        }
    }
    for (mut s, hashes, _) in live.drain(..) {
        s.finish(&mut pool, &hashes).unwrap();
    }
    pool.check_invariants().unwrap();
    assert_eq!(pool.num_used(), 0);
    pool.clear_cached();
    assert_eq!(pool.num_free(), total);
    assert!(pool.index().is_empty());
}
