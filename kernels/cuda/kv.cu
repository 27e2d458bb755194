// Head-paged KV cache maintenance: kv_write (this step's K and V rows into their slots), block copy/compaction
// (gather a list of (src, dst) block pairs), block transfer to and from the tiers' packed layout, and the
// eviction-policy score kernels (per-slot ||K||2, ||V||2/||K||2, the cosine of each key to a per-(sequence, kv-head)
// anchor vector, and observation-window attention).
//
// Arenas: K and V are separate f16 arenas; block b, slot s starts at (b * block_size + s) * head_dim. A block holds
// block_size consecutive slots of ONE (layer, kv-head).

// Writes token t's head h (src rows k/v [rows][n_kv*head_dim], f32) into arena slot dst[t*n_kv + h] (f16).
// Grid: (tokens, n_kv).
extern "C" __global__ void kv_write_f16(const float* __restrict__ k, const float* __restrict__ v,
                                        const int* __restrict__ tok_row, const unsigned int* __restrict__ dst, int n_kv,
                                        int head_dim, unsigned short* __restrict__ kc, unsigned short* __restrict__ vc) {
    const int t = blockIdx.x, h = blockIdx.y;
    const size_t src = ((size_t)tok_row[t] * n_kv + h) * head_dim;
    const size_t d0 = (size_t)dst[(size_t)t * n_kv + h] * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        kc[d0 + d] = f2h(k[src + d]);
        vc[d0 + d] = f2h(v[src + d]);
    }
}

// For pair p: block pairs[2p+1] <- block pairs[2p] in K (blockIdx.y == 0) or V (blockIdx.y == 1).
// block_len = block_size * head_dim halves. Destinations are distinct and no destination is also a source.
extern "C" __global__ void copy_blocks_f16(unsigned short* __restrict__ kc, unsigned short* __restrict__ vc,
                                           const unsigned int* __restrict__ pairs, int block_len) {
    unsigned short* a = blockIdx.y == 0 ? kc : vc;
    const size_t s = (size_t)pairs[2 * blockIdx.x] * block_len, d = (size_t)pairs[2 * blockIdx.x + 1] * block_len;
    if ((block_len & 7) == 0) {
        const uint4* src = reinterpret_cast<const uint4*>(a + s);
        uint4* dstp = reinterpret_cast<uint4*>(a + d);
        for (int i = threadIdx.x; i < (block_len >> 3); i += blockDim.x) dstp[i] = src[i];
    } else {
        for (int i = threadIdx.x; i < block_len; i += blockDim.x) a[d + i] = a[s + i];
    }
}

// The tiers' packed f16 layout: entry i is block ids[i]'s K then its V, block_len halves each (a group's native
// f16 bytes). gather: packed <- arenas; scatter: arenas <- packed, destinations distinct. Grid: (blocks, 2), y = K/V.
extern "C" __global__ void gather_blocks_f16(const unsigned short* __restrict__ kc,
                                             const unsigned short* __restrict__ vc,
                                             const unsigned int* __restrict__ ids, int block_len,
                                             unsigned short* __restrict__ packed) {
    const unsigned short* a = blockIdx.y == 0 ? kc : vc;
    const size_t s = (size_t)ids[blockIdx.x] * block_len, d = ((size_t)blockIdx.x * 2 + blockIdx.y) * block_len;
    for (int i = threadIdx.x; i < block_len; i += blockDim.x) packed[d + i] = a[s + i];
}

extern "C" __global__ void scatter_blocks_f16(const unsigned short* __restrict__ packed,
                                              const unsigned int* __restrict__ ids, int block_len,
                                              unsigned short* __restrict__ kc, unsigned short* __restrict__ vc) {
    unsigned short* a = blockIdx.y == 0 ? kc : vc;
    const size_t d = (size_t)ids[blockIdx.x] * block_len, s = ((size_t)blockIdx.x * 2 + blockIdx.y) * block_len;
    for (int i = threadIdx.x; i < block_len; i += blockDim.x) a[d + i] = packed[s + i];
}

__device__ __forceinline__ size_t slot_addr(const unsigned int* tab, int t, int block_size, int head_dim) {
    return ((size_t)tab[t / block_size] * block_size + (t % block_size)) * head_dim;
}

// Per slot of entry e (one sequence's table for one kv-head, len[e] slots): knorm = ||K||2 and
// ratio = ||V||2 / ||K||2 (0 when both are 0, +inf when only ||K|| is 0). Outputs at out_off[e] + slot.
// One warp per slot; grid (ceil(max_len / warps), entries).
extern "C" __global__ void slot_norms_f16(const unsigned short* __restrict__ kc, const unsigned short* __restrict__ vc,
                                          const unsigned int* __restrict__ tables, const int* __restrict__ len,
                                          const int* __restrict__ tab_off, const int* __restrict__ out_off,
                                          int block_size, int head_dim, float* __restrict__ knorm,
                                          float* __restrict__ ratio) {
    const int e = blockIdx.y, warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * warps + (threadIdx.x >> 5);
    if (t >= len[e]) return;
    const size_t a = slot_addr(tables + tab_off[e], t, block_size, head_dim);
    float sk = 0.0f, sv = 0.0f;
    for (int d = lane; d < head_dim; d += 32) {
        const float kv = h2f(kc[a + d]), vv = h2f(vc[a + d]);
        sk = fmaf(kv, kv, sk);
        sv = fmaf(vv, vv, sv);
    }
    sk = warp_sum(sk);
    sv = warp_sum(sv);
    if (lane == 0) {
        const float nk = sqrtf(sk), nv = sqrtf(sv);
        knorm[out_off[e] + t] = nk;
        ratio[out_off[e] + t] = nk > 0.0f ? nv / nk : (nv > 0.0f ? PAGODA_INF : 0.0f);
    }
}

// Per slot of entry e: cos(K[slot], anchor[e]) (0 when either norm is 0). anchors: [entries][head_dim] f32.
extern "C" __global__ void anchor_cosine_f16(const unsigned short* __restrict__ kc,
                                             const unsigned int* __restrict__ tables, const int* __restrict__ len,
                                             const int* __restrict__ tab_off, const int* __restrict__ out_off,
                                             const float* __restrict__ anchors, int block_size, int head_dim,
                                             float* __restrict__ out) {
    const int e = blockIdx.y, warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * warps + (threadIdx.x >> 5);
    if (t >= len[e]) return;
    const size_t a = slot_addr(tables + tab_off[e], t, block_size, head_dim);
    const float* an = anchors + (size_t)e * head_dim;
    float dot = 0.0f, sk = 0.0f, sa = 0.0f;
    for (int d = lane; d < head_dim; d += 32) {
        const float kv = h2f(kc[a + d]), av = an[d];
        dot = fmaf(kv, av, dot);
        sk = fmaf(kv, kv, sk);
        sa = fmaf(av, av, sa);
    }
    dot = warp_sum(dot);
    sk = warp_sum(sk);
    sa = warp_sum(sa);
    if (lane == 0) {
        const float den = sqrtf(sk) * sqrtf(sa);
        out[out_off[e] + t] = den > 0.0f ? dot / den : 0.0f;
    }
}

// Sum over slots [from[e], to[e]) of entry e of k / max(||k||2, eps) (KeyDiff's anchor before the mean), into
// out[e * head_dim ..]. One CTA per entry, UKS_WARPS warps: each warp takes every UKS_WARPS-th slot, holds its part of
// the sum in registers (head_dim <= 256: 8 channels per lane) and the warps add up in shared memory at the end.
#define UKS_WARPS 4
extern "C" __global__ void __launch_bounds__(32 * UKS_WARPS)
    unit_key_sum_f16(const unsigned short* __restrict__ kc, const unsigned int* __restrict__ tables,
                     const int* __restrict__ from, const int* __restrict__ to, const int* __restrict__ tab_off,
                     int block_size, int head_dim, float eps, float* __restrict__ out) {
    __shared__ float part[UKS_WARPS][256];
    const int e = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned int* tab = tables + tab_off[e];
    float acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
    for (int t = from[e] + warp; t < to[e]; t += UKS_WARPS) {
        const size_t a = slot_addr(tab, t, block_size, head_dim);
        float ss = 0.0f;
        for (int d = lane; d < head_dim; d += 32) {
            const float x = h2f(kc[a + d]);
            ss = fmaf(x, x, ss);
        }
        const float inv = 1.0f / fmaxf(sqrtf(warp_sum(ss)), eps);
        for (int j = 0, d = lane; d < head_dim; ++j, d += 32) acc[j] = fmaf(h2f(kc[a + d]), inv, acc[j]);
    }
    for (int j = 0, d = lane; d < head_dim; ++j, d += 32) part[warp][d] = acc[j];
    __syncthreads();
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < UKS_WARPS; ++w) sum += part[w][d];
        out[(size_t)e * head_dim + d] = sum;
    }
}

// scale * q.k for slot t of a table: one warp, lanes over head_dim; every lane gets the result.
__device__ __forceinline__ float window_logit(const unsigned short* __restrict__ kc, const unsigned int* tab, int t,
                                              int block_size, int head_dim, const float* qs, float scale) {
    const int lane = threadIdx.x & 31;
    const size_t a = slot_addr(tab, t, block_size, head_dim);
    float dot = 0.0f;
    for (int d = lane; d < head_dim; d += 32) dot = fmaf(qs[d], h2f(kc[a + d]), dot);
    return warp_sum(dot) * scale;
}

// Observation-window attention per slot (CPU twin: pagoda_kernels::scores::window_attention_scores): for row r, one
// (query token, query head) of entry row_e[r], the softmax over its row_vis[r] visible slots of logits
// scale * q.k, each probability raised to `power`, added to out[out_off[e] + slot]. Rows from several queries of one
// entry add into the same slots, hence the atomics. A row whose logits hold a NaN or +inf adds nothing (as on the
// CPU). One block per row; warps take slots, lanes split head_dim. Three passes over the keys (max, sum, add), so no
// row of logits needs to fit in shared memory.
extern "C" __global__ void window_scores_f16(const unsigned short* __restrict__ kc,
                                             const unsigned int* __restrict__ tables, const int* __restrict__ tab_off,
                                             const int* __restrict__ out_off, const int* __restrict__ row_e,
                                             const long long* __restrict__ row_q, const int* __restrict__ row_vis,
                                             const float* __restrict__ q, int block_size, int head_dim, float scale,
                                             int power, float* __restrict__ out) {
    __shared__ float qs[256];
    __shared__ float scratch[33];
    const int r = blockIdx.x, e = row_e[r], vis = row_vis[r];
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned int* tab = tables + tab_off[e];
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = q[row_q[r] + d];
    __syncthreads();
    float m = -PAGODA_INF, bad = 0.0f;
    for (int t = warp; t < vis; t += warps) {
        const float dot = window_logit(kc, tab, t, block_size, head_dim, qs, scale);
        if (dot != dot || dot == PAGODA_INF) bad = 1.0f;
        m = fmaxf(m, dot);
    }
    m = block_max(m, scratch);
    if (block_sum(bad, scratch) > 0.0f || vis == 0) return;
    float l = 0.0f;
    for (int t = warp; t < vis; t += warps) {
        const float dot = window_logit(kc, tab, t, block_size, head_dim, qs, scale);
        if (lane == 0) l += expf(dot - m);
    }
    const float inv = 1.0f / block_sum(l, scratch);
    for (int t = warp; t < vis; t += warps) {
        const float dot = window_logit(kc, tab, t, block_size, head_dim, qs, scale);
        if (lane == 0) {
            const float p = expf(dot - m) * inv;
            float pw = 1.0f;
            for (int i = 0; i < power; ++i) pw *= p;
            atomicAdd(out + out_off[e] + t, pw);
        }
    }
}
