// Split-K paged decode attention (flash-decoding), generic over where a slot's K and V rows come from: the f16
// arenas (attention.cu) or encoded blocks dequantised as they load (encoded_attention.cu). One CTA takes one
// (item, kv-head) entry, one split of `chunk` consecutive slots and up to G query heads of the GQA group, so each
// K/V byte is read once per group: phase 1 scores the split (HD/8 lanes per slot, 8 channels each), phase 2 takes
// the split's max and sum, phase 3 accumulates P·V. It writes unnormalised partial outputs with their (max, sum);
// `paged_decode_reduce` (attention.cu) merges the splits. Item i's query row is item_row[i]; entry e = i * n_kv + h
// has ent_len[e] visible slots (prior_len + j + 1) and its block table at tables + ent_tab[e].
//
// A Rows source provides
//   unsigned int slot(unsigned int block, unsigned int s)  its name for slot s of a block (computed once per slot
//                                                       of the split, kept in shared memory);
//   Raw load(int half, unsigned int slot, int c)       the loads for channels 8c..8c+7 of the slot's K (half 0) or
//                                                       V (half 1) row, issued UNR at a time to keep loads in flight;
//   void unpack(const Raw&, int half, int c, float* v)  those 8 channels as f32.

#define NT 128
#define NW 4

// Issues the loads of half `half` for the UNR slots t0, t0 + RPS, ... of the split (those below n), all before
// any is used, so UNR loads per lane are in flight at once.
template <int UNR, int RPS, class Rows>
__device__ __forceinline__ void load_rows(const Rows& rows, int half, const unsigned int* slot, int t0, int n, int c,
                                          typename Rows::Raw* raw) {
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
        const int t = t0 + u * RPS;
        if (t < n) raw[u] = rows.load(half, slot[t], c);
    }
}

template <int HD, int G, class Rows>
__device__ __forceinline__ void decode_split(const float* __restrict__ q, const Rows& rows,
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
    // [chunk] the rows' name of each slot of the split: one table lookup per slot, done once for the K and V
    // passes, instead of a dependent table load and a division before every K or V load.
    unsigned int* slot = reinterpret_cast<unsigned int*>(ml + 2 * G);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int r = lane / LPR, c = lane % LPR;
    for (int t = threadIdx.x; t < n; t += NT) {
        const int ts = t0 + t;
        slot[t] = rows.slot(tab[ts / block_size], (unsigned int)(ts % block_size));
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
        typename Rows::Raw kk[UNR];
        load_rows<UNR, RPS>(rows, 0, slot, base + r, n, c, kk);
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            float kf[8];
            const int t = base + u * RPS + r;
            if (t < n) {
                rows.unpack(kk[u], 0, c, kf);
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) kf[k] = 0.0f;
            }
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
        typename Rows::Raw vv[UNR];
        load_rows<UNR, RPS>(rows, 1, slot, base + r, n, c, vv);
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const int t = base + u * RPS + r;
            if (t < n) {
                float vf[8];
                rows.unpack(vv[u], 1, c, vf);
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
