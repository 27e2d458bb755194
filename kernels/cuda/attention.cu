// Paged attention over the head-paged f16 K and V arenas (layout in kv.cu), GQA, f32 accumulation.
// q, out: f32 [rows][n_heads * HD]; query head qh reads kv-head qh / (n_heads / n_kv).
//
// Decode: `paged_decode_hd{HD}_g{G}` is decode_split.cuh's split-K kernel over the f16 arenas (16-byte K and V
// loads, HD/8 lanes per slot); `paged_decode_reduce` merges the splits, for this module's kernels and for the
// encoded ones (encoded_attention.cu).
//
// Prefill: `paged_prefill_hd{HD}` is tiled flash attention: one CTA per (tile of TQ new tokens, query head), K/V
// tiles of TK slots in shared memory, online softmax; causal in slot space: new token j sees slots [0, prior + j].

// The f16 arenas as a decode_split row source: one 16-byte load per lane and row.
template <int HD>
struct F16Rows {
    const unsigned short* kc;
    const unsigned short* vc;
    int block_size;
    typedef uint4 Raw;
    // The arena slot.
    __device__ __forceinline__ unsigned int slot(unsigned int block, unsigned int s) const {
        return block * (unsigned int)block_size + s;
    }
    __device__ __forceinline__ Raw load(int half, unsigned int slot, int c) const {
        return *reinterpret_cast<const uint4*>((half == 0 ? kc : vc) + (size_t)slot * HD + c * 8);
    }
    __device__ __forceinline__ void unpack(const Raw& raw, int, int, float* v) const { unpack8(raw, v); }
};

#define PAGODA_DECODE(HD, G)                                                                                       \
    extern "C" __global__ void __launch_bounds__(NT) paged_decode_hd##HD##_g##G(                                   \
        const float* __restrict__ q, const unsigned short* __restrict__ kc, const unsigned short* __restrict__ vc, \
        const unsigned int* __restrict__ tables, const int* __restrict__ item_row,                                \
        const int* __restrict__ ent_len, const int* __restrict__ ent_tab, int n_heads, int n_kv, int block_size,  \
        int chunk, int max_splits, float scale, float* __restrict__ part_o, float* __restrict__ part_ml) {        \
        decode_split<HD, G>(q, F16Rows<HD>{kc, vc, block_size}, tables, item_row, ent_len, ent_tab, n_heads, n_kv, block_size, \
                            chunk, max_splits, scale, part_o, part_ml);                                           \
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
