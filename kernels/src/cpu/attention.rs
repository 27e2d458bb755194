//! KV write into head-paged blocks and paged attention (prefill + decode, GQA) with online softmax,
//! parallelised over (sequence, query head, token chunk).

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::{CpuBackend, Simd, SyncPtr, scalar};
use crate::paged::{AttnSeq, KvStorage};

/// New tokens per attention task during prefill.
const TOKEN_CHUNK: usize = 32;

/// Writes rows `[q_row, q_row + n_new)` of `k`, `v` (`[rows][n_kv_heads*head_dim]`) into the cache slots
/// `prior_lens[h] ..` of each kv-head's table.
pub fn kv_write(kv: &mut KvStorage, k: &[f32], v: &[f32], seqs: &[AttnSeq<'_>], n_kv_heads: usize) {
    let hd = kv.head_dim();
    let bs = kv.block_size();
    let w = n_kv_heads * hd;
    assert_eq!(k.len(), v.len(), "kv_write: k and v differ in length");
    assert!(w > 0 && k.len().is_multiple_of(w), "kv_write: k must be [rows][n_kv_heads*head_dim]");
    for s in seqs {
        check_seq(s, n_kv_heads, k.len() / w);
        for h in 0..n_kv_heads {
            let table = &s.tables[h];
            for j in 0..s.n_new {
                let slot = s.prior_lens[h] + j;
                let b = table[slot / bs];
                let off = (slot % bs) * hd;
                let src = (s.q_row + j) * w + h * hd;
                kv.block_k_mut(b)[off..off + hd].copy_from_slice(&k[src..src + hd]);
                kv.block_v_mut(b)[off..off + hd].copy_from_slice(&v[src..src + hd]);
            }
        }
    }
}

fn check_seq(s: &AttnSeq<'_>, n_kv_heads: usize, rows: usize) {
    assert!(s.tables.len() >= n_kv_heads, "AttnSeq: tables must have one entry per kv-head");
    assert!(s.prior_lens.len() >= n_kv_heads, "AttnSeq: prior_lens must have one entry per kv-head");
    assert!(s.q_row + s.n_new <= rows, "AttnSeq: rows [q_row, q_row+n_new) exceed the batch");
}

/// Paged attention for every sequence of the batch; see [`crate::Backend::paged_attention`].
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    be: &CpuBackend,
    q: &[f32],
    kv: &KvStorage,
    seqs: &[AttnSeq<'_>],
    n_heads: usize,
    n_kv_heads: usize,
    scale: f32,
    out: &mut [f32],
) {
    let hd = kv.head_dim();
    let w = n_heads * hd;
    assert!(n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads), "n_heads must be a multiple of n_kv_heads");
    assert_eq!(q.len(), out.len(), "paged_attention: q and out differ in length");
    assert!(w > 0 && q.len().is_multiple_of(w), "paged_attention: q must be [rows][n_heads*head_dim]");
    let rows = q.len() / w;
    let bs = kv.block_size();
    for s in seqs {
        check_seq(s, n_kv_heads, rows);
        for h in 0..n_kv_heads {
            let need = (s.prior_lens[h] + s.n_new).div_ceil(bs);
            assert!(s.tables[h].len() >= need, "AttnSeq: block table too short for prior_len + n_new");
        }
    }
    check_disjoint(seqs);
    let o = SyncPtr::new(out);
    let simd = be.simd();
    let group = n_heads / n_kv_heads;
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx2 && bs <= 64 && group <= avx2::MAX_GROUP && matches!(hd, 32 | 64 | 96 | 128) {
        grouped_attention(be, q, kv, seqs, n_heads, n_kv_heads, scale, &o);
        return;
    }
    let task = |s: &AttnSeq<'_>, t: usize| {
        let chunks = s.n_new.div_ceil(TOKEN_CHUNK);
        let qh = t / chunks;
        let c = t % chunks;
        let kvh = qh / group;
        let j0 = c * TOKEN_CHUNK;
        let j1 = (j0 + TOKEN_CHUNK).min(s.n_new);
        for j in j0..j1 {
            let row = s.q_row + j;
            let qv = &q[row * w + qh * hd..row * w + (qh + 1) * hd];
            // SAFETY: each (row, head) output slice is written by exactly one task: rows are in bounds and the
            // sequences' row ranges are disjoint (both checked above).
            let acc = unsafe { std::slice::from_raw_parts_mut(o.get().add(row * w + qh * hd), hd) };
            attend_one(simd, qv, kv, &s.tables[kvh], s.prior_lens[kvh] + j + 1, scale, acc);
        }
    };
    run_tasks(be, seqs, n_heads, &task);
}

/// Runs `task(seq, t)` for every (sequence, head, token chunk), flattened into task indices `t` per sequence
/// (`heads` per chunk), in parallel.
fn run_tasks(be: &CpuBackend, seqs: &[AttnSeq<'_>], heads: usize, task: &(dyn Fn(&AttnSeq<'_>, usize) + Sync)) {
    // starts[i] = first task of sequence i.
    let mut starts = Vec::with_capacity(seqs.len() + 1);
    let mut total = 0usize;
    for s in seqs {
        starts.push(total);
        total += s.n_new.div_ceil(TOKEN_CHUNK) * heads;
    }
    starts.push(total);
    be.par_for(total, &|t| {
        let i = starts.partition_point(|&st| st <= t) - 1;
        task(&seqs[i], t - starts[i]);
    });
}

/// [`paged_attention`] with one task per (sequence, kv-head, token chunk): the query heads of a GQA group are
/// computed together so that each K/V block is read once per group (see `avx2::attend_group`).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn grouped_attention(
    be: &CpuBackend,
    q: &[f32],
    kv: &KvStorage,
    seqs: &[AttnSeq<'_>],
    n_heads: usize,
    n_kv_heads: usize,
    scale: f32,
    o: &SyncPtr,
) {
    let hd = kv.head_dim();
    let w = n_heads * hd;
    let bs = kv.block_size();
    let group = n_heads / n_kv_heads;
    let (k, v) = kv.arenas();
    for s in seqs {
        for (h, table) in s.tables.iter().enumerate().take(n_kv_heads) {
            let used = (s.prior_lens[h] + s.n_new).div_ceil(bs);
            for &b in &table[..used] {
                assert!((b as usize) < kv.num_blocks(), "block id {b} out of range");
            }
        }
    }
    let task = |s: &AttnSeq<'_>, t: usize| {
        let chunks = s.n_new.div_ceil(TOKEN_CHUNK);
        let kvh = t / chunks;
        let c = t % chunks;
        let j0 = c * TOKEN_CHUNK;
        let j1 = (j0 + TOKEN_CHUNK).min(s.n_new);
        let gw = group * hd;
        for j in j0..j1 {
            let row = s.q_row + j;
            let qs = &q[row * w + kvh * gw..row * w + (kvh + 1) * gw];
            // SAFETY: each (row, kv-head group) output slice is written by exactly one task (rows in bounds and
            // sequence row ranges disjoint, checked by the caller); block ids were checked above; AVX2 detected.
            unsafe {
                let acc = std::slice::from_raw_parts_mut(o.get().add(row * w + kvh * gw), gw);
                let table = &s.tables[kvh];
                let len = s.prior_lens[kvh] + j + 1;
                match hd {
                    32 => avx2::attend_group::<4>(qs, group, k, v, bs, table, len, scale, acc),
                    64 => avx2::attend_group::<8>(qs, group, k, v, bs, table, len, scale, acc),
                    96 => avx2::attend_group::<12>(qs, group, k, v, bs, table, len, scale, acc),
                    _ => avx2::attend_group::<16>(qs, group, k, v, bs, table, len, scale, acc),
                }
            }
        }
    };
    run_tasks(be, seqs, n_kv_heads, &task);
}

/// Panics unless the sequences' row ranges `[q_row, q_row + n_new)` are pairwise disjoint (each output row
/// must be written by one task only).
fn check_disjoint(seqs: &[AttnSeq<'_>]) {
    let mut ranges: Vec<(usize, usize)> =
        seqs.iter().filter(|s| s.n_new > 0).map(|s| (s.q_row, s.q_row + s.n_new)).collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        assert!(w[0].1 <= w[1].0, "AttnSeq row ranges overlap: {:?} and {:?}", w[0], w[1]);
    }
}

/// Attention of one query vector over the first `len` slots of `table`; writes the result into `out`.
fn attend_one(simd: Simd, q: &[f32], kv: &KvStorage, table: &[u32], len: usize, scale: f32, out: &mut [f32]) {
    let bs = kv.block_size();
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx2 && bs <= 64 {
        let (k, v) = kv.arenas();
        // SAFETY: block ids come from tables whose length was checked; `KvStorage::block_k` bounds-checks each id
        // below before the kernel reads it; CPU features detected.
        let ids = &table[..len.div_ceil(bs)];
        for &b in ids {
            assert!((b as usize) < kv.num_blocks(), "block id {b} out of range");
        }
        match q.len() {
            32 => return unsafe { avx2::attend_one::<4>(q, k, v, bs, table, len, scale, out) },
            64 => return unsafe { avx2::attend_one::<8>(q, k, v, bs, table, len, scale, out) },
            96 => return unsafe { avx2::attend_one::<12>(q, k, v, bs, table, len, scale, out) },
            128 => return unsafe { avx2::attend_one::<16>(q, k, v, bs, table, len, scale, out) },
            _ => {}
        }
    }
    out.fill(0.0);
    let mut st = scalar::OnlineSoftmax { m: f32::NEG_INFINITY, l: 0.0, acc: out };
    for (bi, &b) in table[..len.div_ceil(bs)].iter().enumerate() {
        let n = (len - bi * bs).min(bs);
        scalar::attend_block(q, kv.block_k(b), kv.block_v(b), n, scale, &mut st);
    }
    let inv = if st.l > 0.0 { 1.0 / st.l } else { 0.0 };
    for a in st.acc.iter_mut() {
        *a *= inv;
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Side-by-side timing of decode attention, per query head vs per GQA group, at the engine bench's decode
    /// shape (32 sequences, ~576 cached tokens, 9 query heads over 3 kv-heads, head_dim 64). Run with
    /// `cargo test --release -p pagoda-kernels grouped_vs_per_head -- --ignored --nocapture`.
    #[test]
    #[ignore]
    #[allow(clippy::needless_range_loop)]
    fn grouped_vs_per_head_decode_timing() {
        if !crate::cpu::avx2_available() {
            return;
        }
        let (hd, bs, nq, nkv, seqs, len) = (64usize, 16usize, 9usize, 3usize, 32usize, 576usize);
        let per = len.div_ceil(bs);
        let mut kv = KvStorage::new(seqs * nkv * per, bs, hd);
        let mut x = 1u32;
        let mut rnd = || {
            x = x.wrapping_mul(1664525).wrapping_add(1013904223);
            (x >> 9) as f32 / (1u32 << 23) as f32 - 0.5
        };
        let (k, v) = kv.arenas_mut();
        k.iter_mut().for_each(|a| *a = rnd());
        v.iter_mut().for_each(|a| *a = rnd());
        let q: Vec<f32> = (0..seqs * nq * hd).map(|_| rnd()).collect();
        let tables: Vec<Vec<Vec<u32>>> = (0..seqs)
            .map(|s| {
                (0..nkv).map(|h| (((s * nkv + h) * per) as u32..((s * nkv + h + 1) * per) as u32).collect()).collect()
            })
            .collect();
        let (k, v) = kv.arenas();
        let scale = 0.125;
        let mut out = vec![0.0f32; q.len()];
        let per_head = |out: &mut [f32]| {
            for s in 0..seqs {
                for qh in 0..nq {
                    let r = (s * nq + qh) * hd..(s * nq + qh + 1) * hd;
                    unsafe {
                        avx2::attend_one::<8>(&q[r.clone()], k, v, bs, &tables[s][qh / 3], len, scale, &mut out[r])
                    };
                }
            }
        };
        let grouped = |out: &mut [f32]| {
            for s in 0..seqs {
                for h in 0..nkv {
                    let r = (s * nq + h * 3) * hd..(s * nq + h * 3 + 3) * hd;
                    unsafe {
                        avx2::attend_group::<8>(&q[r.clone()], 3, k, v, bs, &tables[s][h], len, scale, &mut out[r])
                    };
                }
            }
        };
        let mut a = Vec::new();
        let mut b = Vec::new();
        for _ in 0..15 {
            let t = std::time::Instant::now();
            per_head(&mut out);
            a.push(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            grouped(&mut out);
            b.push(t.elapsed().as_secs_f64());
        }
        a.sort_by(f64::total_cmp);
        b.sort_by(f64::total_cmp);
        let (ma, mb) = (a[a.len() / 2], b[b.len() / 2]);
        eprintln!("per head {:.3} ms, grouped {:.3} ms, speedup {:.2}x", ma * 1e3, mb * 1e3, ma / mb);
    }
}
