// Paged attention over the head-paged f16 K and V arenas (layout in kv.cu), GQA, f32 accumulation.
// q, out: f32 [rows][n_heads * HD]; query head qh reads kv-head qh / (n_heads / n_kv).
//
// Decode: `paged_decode_hd{HD}_g{G}` is split-K (flash-decoding). One CTA takes one (item, kv-head) entry, one
// split of `chunk` consecutive slots and up to G query heads of the GQA group, so each K/V byte is read once per
// group: phase 1 scores the split with 16-byte K loads (HD/8 lanes per slot), phase 2 takes the split's max and sum,
// phase 3 accumulates P·V. It writes unnormalised partial outputs with their (max, sum); `paged_decode_reduce`
// merges the splits. Item i's query row is item_row[i]; entry e = i * n_kv + h has ent_len[e] visible slots
// (prior_len + j + 1) and its block table at tables + ent_tab[e].
//
// Prefill: `paged_prefill_hd{HD}` is tiled flash attention: one CTA per (tile of TQ new tokens, query head), K/V
// tiles of TK slots in shared memory, online softmax; causal in slot space: new token j sees slots [0, prior + j].

#define NT 128
#define NW 4

template <int HD, int G>
__device__ __forceinline__ void decode_split(const float* __restrict__ q, const unsigned short* __restrict__ kc,
                                             const unsigned short* __restrict__ vc,
                                             const unsigned int* __restrict__ tables, const int* __restrict__ item_row,
                                             const int* __restrict__ ent_len, const int* __restrict__ ent_tab,
                                             int n_heads, int n_kv, int block_size, int chunk, int max_splits,
                                             float scale, float* __restrict__ part_o, float* __restrict__ part_ml) {
    constexpr int LPR = HD / 8;    // lanes per slot (one 16-byte load each)
    constexpr int RPW = 32 / LPR;  // slots per warp step
    constexpr int RPS = NW * RPW;  // slots per CTA step
    constexpr int UNR = 4;         // loads in flight per lane
    const int e = blockIdx.x, split = blockIdx.y, sub = blockIdx.z;
    const int item = e / n_kv, h = e - item * n_kv;
    const int group = n_heads / n_kv;
    const int L = ent_len[e];
    const int t0 = split * chunk;
    const int g0 = sub * G;
    if (t0 >= L || g0 >= group) return;
    const int n = min(L - t0, chunk);
    const int ng = min(G, group - g0);
    const int qh0 = h * group + g0;
    const unsigned int* tab = tables + ent_tab[e];
    const int row = item_row[item];
    extern __shared__ float sm[];
    float* s = sm;                  // [G][chunk] scores, then probabilities
    float* red = sm + G * chunk;    // [NW][G][HD]
    float* ml = red + NW * G * HD;  // [G][2] (max, sum)
    // [chunk] arena slot of each slot of the split: one table lookup per slot, done once for the K and V passes,
    // instead of a dependent table load and a division before every 16-byte K or V load.
    unsigned int* slot = reinterpret_cast<unsigned int*>(ml + 2 * G);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int r = lane / LPR, c = lane % LPR;
    for (int t = threadIdx.x; t < n; t += NT) {
        const int ts = t0 + t;
        slot[t] = tab[ts / block_size] * (unsigned int)block_size + (unsigned int)(ts % block_size);
    }
    __syncthreads();

    float qr[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float* qp = q + (size_t)row * n_heads * HD + (size_t)(qh0 + g) * HD + c * 8;
#pragma unroll
        for (int k = 0; k < 8; ++k) qr[g][k] = g < ng ? qp[k] * scale : 0.0f;
    }

    for (int base = w * RPW; base < n; base += RPS * UNR) {
        uint4 kk[UNR];
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const int t = base + u * RPS + r;
            if (t < n) {
                const size_t a = (size_t)slot[t] * HD + c * 8;
                kk[u] = *reinterpret_cast<const uint4*>(kc + a);
            } else {
                kk[u] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            float kf[8];
            unpack8(kk[u], kf);
            const int t = base + u * RPS + r;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float d = 0.0f;
#pragma unroll
                for (int k = 0; k < 8; ++k) d = fmaf(qr[g][k], kf[k], d);
#pragma unroll
                for (int o = LPR / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                if (c == 0 && t < n) s[g * chunk + t] = d;
            }
        }
    }
    __syncthreads();

    for (int g = w; g < ng; g += NW) {
        float m = -PAGODA_INF;
        for (int t = lane; t < n; t += 32) m = fmaxf(m, s[g * chunk + t]);
        m = warp_max(m);
        float l = 0.0f;
        for (int t = lane; t < n; t += 32) {
            const float p = expf(s[g * chunk + t] - m);
            s[g * chunk + t] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            ml[2 * g] = m;
            ml[2 * g + 1] = l;
        }
    }
    __syncthreads();

    float acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[g][k] = 0.0f;
    for (int base = w * RPW; base < n; base += RPS * UNR) {
        uint4 vv[UNR];
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const int t = base + u * RPS + r;
            if (t < n) {
                const size_t a = (size_t)slot[t] * HD + c * 8;
                vv[u] = *reinterpret_cast<const uint4*>(vc + a);
            } else {
                vv[u] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const int t = base + u * RPS + r;
            if (t < n) {
                float vf[8];
                unpack8(vv[u], vf);
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float p = s[g * chunk + t];
#pragma unroll
                    for (int k = 0; k < 8; ++k) acc[g][k] = fmaf(p, vf[k], acc[g][k]);
                }
            }
        }
    }
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int k = 0; k < 8; ++k)
#pragma unroll
            for (int o = LPR; o < 32; o <<= 1) acc[g][k] += __shfl_xor_sync(0xffffffffu, acc[g][k], o);
    if (r == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int k = 0; k < 8; ++k) red[(w * G + g) * HD + c * 8 + k] = acc[g][k];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < ng * HD; i += NT) {
        const int g = i / HD, d = i - g * HD;
        float o = 0.0f;
#pragma unroll
        for (int ww = 0; ww < NW; ++ww) o += red[(ww * G + g) * HD + d];
        const size_t p = ((size_t)item * n_heads + qh0 + g) * max_splits + split;
        part_o[p * HD + d] = o;
        if (d == 0) {
            part_ml[2 * p] = ml[2 * g];
            part_ml[2 * p + 1] = ml[2 * g + 1];
        }
    }
}

#define PAGODA_DECODE(HD, G)                                                                                       \
    extern "C" __global__ void __launch_bounds__(NT) paged_decode_hd##HD##_g##G(                                   \
        const float* __restrict__ q, const unsigned short* __restrict__ kc, const unsigned short* __restrict__ vc, \
        const unsigned int* __restrict__ tables, const int* __restrict__ item_row,                                \
        const int* __restrict__ ent_len, const int* __restrict__ ent_tab, int n_heads, int n_kv, int block_size,  \
        int chunk, int max_splits, float scale, float* __restrict__ part_o, float* __restrict__ part_ml) {        \
        decode_split<HD, G>(q, kc, vc, tables, item_row, ent_len, ent_tab, n_heads, n_kv, block_size, chunk,      \
                            max_splits, scale, part_o, part_ml);                                                  \
    }

PAGODA_DECODE(64, 1)
PAGODA_DECODE(64, 2)
PAGODA_DECODE(64, 4)
PAGODA_DECODE(64, 8)
PAGODA_DECODE(128, 1)
PAGODA_DECODE(128, 2)
PAGODA_DECODE(128, 4)
PAGODA_DECODE(128, 8)
PAGODA_DECODE(256, 1)
PAGODA_DECODE(256, 2)
PAGODA_DECODE(256, 4)
PAGODA_DECODE(256, 8)

// Merges the splits of (item = blockIdx.x, query head = blockIdx.y) into out. Dynamic shared memory: max_splits
// floats (the per-split weights exp(m_i - m)).
extern "C" __global__ void paged_decode_reduce(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                               const int* __restrict__ item_row, const int* __restrict__ ent_len,
                                               int n_heads, int n_kv, int head_dim, int chunk, int max_splits,
                                               float* __restrict__ out) {
    extern __shared__ float wts[];
    __shared__ float scratch[33];
    const int item = blockIdx.x, qh = blockIdx.y;
    const int group = n_heads / n_kv;
    const int L = ent_len[item * n_kv + qh / group];
    const int ns = (L + chunk - 1) / chunk;
    const size_t base = ((size_t)item * n_heads + qh) * max_splits;
    float* o = out + (size_t)item_row[item] * n_heads * head_dim + (size_t)qh * head_dim;
    merge_splits(part_o, part_ml, base, ns, head_dim, wts, scratch, o);
}

template <int HD, int TQ, int TK>
__device__ __forceinline__ void prefill_tile(const float* __restrict__ q, const unsigned short* __restrict__ kc,
                                             const unsigned short* __restrict__ vc,
                                             const unsigned int* __restrict__ tables, const int* __restrict__ tile_seq,
                                             const int* __restrict__ tile_j0, const int* __restrict__ seq_qrow,
                                             const int* __restrict__ seq_nnew, const int* __restrict__ ent_prior,
                                             const int* __restrict__ ent_tab, int n_heads, int n_kv, int block_size,
                                             float scale, float* __restrict__ out) {
    constexpr int TPR = NT / TQ;   // threads per query row
    constexpr int DPT = HD / TPR;  // output dims per thread
    constexpr int C8 = HD / 8;
    __shared__ float Qs[TQ][HD];
    __shared__ float Ks[TK][HD + 1];
    __shared__ float Vs[TK][HD];
    __shared__ float Ss[TQ][TK + 1];
    const int tile = blockIdx.x, qh = blockIdx.y, tid = threadIdx.x;
    const int sq = tile_seq[tile], j0 = tile_j0[tile];
    const int group = n_heads / n_kv, h = qh / group;
    const int nq = min(TQ, seq_nnew[sq] - j0);
    const int prior = ent_prior[sq * n_kv + h];
    const unsigned int* tab = tables + ent_tab[sq * n_kv + h];
    const int qrow0 = seq_qrow[sq] + j0;
    const int L = prior + j0 + nq;
    const size_t qstride = (size_t)n_heads * HD;
    for (int i = tid; i < TQ * HD; i += NT) {
        const int rr = i / HD, d = i - rr * HD;
        Qs[rr][d] = rr < nq ? q[(size_t)(qrow0 + rr) * qstride + (size_t)qh * HD + d] * scale : 0.0f;
    }
    const int r = tid / TPR, cidx = tid % TPR;
    float acc[DPT];
#pragma unroll
    for (int i = 0; i < DPT; ++i) acc[i] = 0.0f;
    float m_run = -PAGODA_INF, l_run = 0.0f;
    for (int kt0 = 0; kt0 < L; kt0 += TK) {
        __syncthreads();
        for (int i = tid; i < TK * C8; i += NT) {
            const int ti = i / C8, cc = i - ti * C8, t = kt0 + ti;
            float kf[8], vf[8];
            if (t < L) {
                const size_t a = ((size_t)tab[t / block_size] * block_size + t % block_size) * HD + cc * 8;
                unpack8(*reinterpret_cast<const uint4*>(kc + a), kf);
                unpack8(*reinterpret_cast<const uint4*>(vc + a), vf);
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) kf[k] = vf[k] = 0.0f;
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                Ks[ti][cc * 8 + k] = kf[k];
                Vs[ti][cc * 8 + k] = vf[k];
            }
        }
        __syncthreads();
        for (int i = tid; i < TQ * TK; i += NT) {
            const int qi = i / TK, ti = i - qi * TK, t = kt0 + ti;
            float sc = -PAGODA_INF;
            if (qi < nq && t <= prior + j0 + qi) {
                float d = 0.0f;
#pragma unroll 16
                for (int k = 0; k < HD; ++k) d = fmaf(Qs[qi][k], Ks[ti][k], d);
                sc = d;
            }
            Ss[qi][ti] = sc;
        }
        __syncthreads();
        float mx = -PAGODA_INF;
        for (int ti = cidx; ti < TK; ti += TPR) mx = fmaxf(mx, Ss[r][ti]);
#pragma unroll
        for (int o = TPR / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_new = fmaxf(m_run, mx);
        const float corr = m_new == -PAGODA_INF ? 1.0f : expf(m_run - m_new);
        float ps = 0.0f;
        for (int ti = cidx; ti < TK; ti += TPR) {
            const float sv = Ss[r][ti];
            const float p = sv == -PAGODA_INF ? 0.0f : expf(sv - m_new);
            Ss[r][ti] = p;
            ps += p;
        }
#pragma unroll
        for (int o = TPR / 2; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
        l_run = l_run * corr + ps;
        m_run = m_new;
#pragma unroll
        for (int i = 0; i < DPT; ++i) acc[i] *= corr;
        __syncwarp();
        for (int ti = 0; ti < TK; ++ti) {
            const float p = Ss[r][ti];
#pragma unroll
            for (int i = 0; i < DPT; ++i) acc[i] = fmaf(p, Vs[ti][cidx + i * TPR], acc[i]);
        }
    }
    if (r < nq) {
        const float inv = l_run > 0.0f ? 1.0f / l_run : 0.0f;
        float* o = out + (size_t)(qrow0 + r) * qstride + (size_t)qh * HD;
#pragma unroll
        for (int i = 0; i < DPT; ++i) o[cidx + i * TPR] = acc[i] * inv;
    }
}

#define PAGODA_PREFILL(HD, TQ, TK)                                                                                 \
    extern "C" __global__ void __launch_bounds__(NT) paged_prefill_hd##HD(                                         \
        const float* __restrict__ q, const unsigned short* __restrict__ kc, const unsigned short* __restrict__ vc, \
        const unsigned int* __restrict__ tables, const int* __restrict__ tile_seq, const int* __restrict__ tile_j0,\
        const int* __restrict__ seq_qrow, const int* __restrict__ seq_nnew, const int* __restrict__ ent_prior,     \
        const int* __restrict__ ent_tab, int n_heads, int n_kv, int block_size, float scale,                      \
        float* __restrict__ out) {                                                                                \
        prefill_tile<HD, TQ, TK>(q, kc, vc, tables, tile_seq, tile_j0, seq_qrow, seq_nnew, ent_prior, ent_tab,     \
                                 n_heads, n_kv, block_size, scale, out);                                          \
    }

PAGODA_PREFILL(64, 16, 64)
PAGODA_PREFILL(128, 16, 32)
PAGODA_PREFILL(256, 8, 16)
