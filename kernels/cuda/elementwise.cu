// Row-wise and element-wise model math in f32 with f32 accumulation: RMSNorm, llama "normal" RoPE (adjacent pairs),
// SiLU·mul, f16 embedding gather, GGUF Q4_1 / Q8_0 dequantisation to f16, and f32 <-> f16 conversion.
// Each kernel mirrors a CPU twin in pagoda_kernels (see kernels/src/cuda/ops.rs for the mapping).

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w. One block per row. `rmsnorm_f16` rounds each value to f16 for the
// GEMMs that read it (the same values as rmsnorm_f32 followed by f32_to_f16, in one launch).
__device__ __forceinline__ void store_as(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_as(unsigned short* p, float v) { *p = f2h(v); }

template <typename Out>
__device__ __forceinline__ void rmsnorm_row(const float* __restrict__ x, const float* __restrict__ w, float eps,
                                            int dim, Out* __restrict__ out) {
    __shared__ float scratch[33];
    const size_t base = (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = x[base + i];
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) store_as(out + base + i, __fmul_rn(__fmul_rn(x[base + i], r), w[i]));
}

extern "C" __global__ void rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w, float eps, int dim,
                                       float* __restrict__ out) {
    rmsnorm_row(x, w, eps, dim, out);
}

extern "C" __global__ void rmsnorm_f16(const float* __restrict__ x, const float* __restrict__ w, float eps, int dim,
                                       unsigned short* __restrict__ out) {
    rmsnorm_row(x, w, eps, dim, out);
}

// Rotates pair i of one head (at p) by pos * theta^(-2i/head_dim). The angle is computed in double, like the CPU
// twin, then applied in f32 without contraction.
__device__ __forceinline__ void rope_pair(float* p, unsigned int pos, int i, int head_dim, float theta) {
    const double inv = pow((double)theta, -2.0 * (double)i / (double)head_dim);
    double s, c;
    sincos((double)pos * inv, &s, &c);
    const float cf = (float)c, sf = (float)s;
    const float a = p[0], b = p[1];
    p[0] = __fsub_rn(__fmul_rn(a, cf), __fmul_rn(b, sf));
    p[1] = __fadd_rn(__fmul_rn(a, sf), __fmul_rn(b, cf));
}

// x: [n][n_heads*head_dim]; rotates pairs (2i, 2i+1) of every head by pos * theta^(-2i/head_dim).
extern "C" __global__ void rope_f32(float* __restrict__ x, const unsigned int* __restrict__ pos, int n, int n_heads,
                                    int head_dim, float theta) {
    const int half = head_dim >> 1;
    const long long total = (long long)n * n_heads * half;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (long long)gridDim.x * blockDim.x) {
        const long long rh = t / half;  // row * n_heads + head
        rope_pair(x + rh * head_dim + 2 * (t % half), pos[rh / n_heads], (int)(t % half), head_dim, theta);
    }
}

// qkv: [n][(n_heads + 2 * n_kv) * head_dim], the output of one stacked q|k|v projection. Writes q, k and v
// ([n][heads * head_dim] each), rotating q's and k's pairs as rope_f32 does and copying v's.
extern "C" __global__ void rope_split_qkv_f32(const float* __restrict__ qkv, float* __restrict__ q,
                                              float* __restrict__ k, float* __restrict__ v,
                                              const unsigned int* __restrict__ pos, int n, int n_heads, int n_kv,
                                              int head_dim, float theta) {
    const int half = head_dim >> 1, heads = n_heads + 2 * n_kv;
    const long long total = (long long)n * heads * half;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total;
         t += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(t % half);
        const long long rh = t / half;
        const long long row = rh / heads;
        const int h = (int)(rh % heads);
        const float* src = qkv + rh * head_dim + 2 * i;
        float* dst;
        if (h < n_heads) {
            dst = q + (row * n_heads + h) * head_dim + 2 * i;
        } else if (h < n_heads + n_kv) {
            dst = k + (row * n_kv + (h - n_heads)) * head_dim + 2 * i;
        } else {
            float* d = v + (row * n_kv + (h - n_heads - n_kv)) * head_dim + 2 * i;
            d[0] = src[0];
            d[1] = src[1];
            continue;
        }
        dst[0] = src[0];
        dst[1] = src[1];
        rope_pair(dst, pos[row], i, head_dim, theta);
    }
}

__device__ __forceinline__ float silu_times(float g, float u) { return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u); }

// gate[i] = silu(gate[i]) * up[i]
extern "C" __global__ void silu_mul_f32(float* __restrict__ gate, const float* __restrict__ up, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        gate[i] = silu_times(gate[i], up[i]);
}

// gu: [rows][2 * ffn], the output of one stacked gate|up projection; out[r][i] = f16(silu(gate) * up), i.e.
// silu_mul_f32 and f32_to_f16 on the two halves, in one launch, for the down projection's GEMM.
extern "C" __global__ void silu_mul_stacked_f16(const float* __restrict__ gu, int ffn, long long n,
                                                unsigned short* __restrict__ out) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / ffn, c = i % ffn;
        const float* row = gu + r * 2 * ffn;
        out[i] = f2h(silu_times(row[c], row[ffn + c]));
    }
}

// out[i][:] = table[ids[i]][:] (f16 table, f32 out); an id >= vocab yields a zero row, as on the CPU.
extern "C" __global__ void embedding_f16(const unsigned short* __restrict__ table, const unsigned int* __restrict__ ids,
                                         int vocab, int dim, float* __restrict__ out) {
    const unsigned int id = ids[blockIdx.x];
    float* o = out + (size_t)blockIdx.x * dim;
    if (id >= (unsigned int)vocab) {
        for (int d = threadIdx.x; d < dim; d += blockDim.x) o[d] = 0.0f;
        return;
    }
    const unsigned short* row = table + (size_t)id * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) o[d] = h2f(row[d]);
}

__device__ __forceinline__ float ld_f16_le(const unsigned char* b) {
    return h2f((unsigned short)(b[0] | (b[1] << 8)));
}

// GGUF Q4_1 blocks (20 bytes: f16 d, f16 m, 16 bytes of nibbles; value j<16 = low nibble of byte j, j>=16 = high
// nibble of byte j-16) -> f16, one thread per value. n = number of values.
extern "C" __global__ void dequant_q4_1_f16(const unsigned char* __restrict__ src, long long n,
                                            unsigned short* __restrict__ out) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const unsigned char* blk = src + (i >> 5) * 20;
        const int j = (int)(i & 31);
        const float d = ld_f16_le(blk), m = ld_f16_le(blk + 2);
        const unsigned char q = blk[4 + (j & 15)];
        const int nib = j < 16 ? (q & 0x0F) : (q >> 4);
        out[i] = f2h(__fadd_rn(__fmul_rn(d, (float)nib), m));
    }
}

// GGUF Q8_0 blocks (34 bytes: f16 d, 32 x i8) -> f16.
extern "C" __global__ void dequant_q8_0_f16(const unsigned char* __restrict__ src, long long n,
                                            unsigned short* __restrict__ out) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const unsigned char* blk = src + (i >> 5) * 34;
        const float d = ld_f16_le(blk);
        const signed char q = (signed char)blk[2 + (i & 31)];
        out[i] = f2h(__fmul_rn(d, (float)q));
    }
}

extern "C" __global__ void f32_to_f16(const float* __restrict__ x, long long n, unsigned short* __restrict__ out) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = f2h(x[i]);
}

extern "C" __global__ void f16_to_f32(const unsigned short* __restrict__ x, long long n, float* __restrict__ out) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = h2f(x[i]);
}

// out[r] = the index of the largest of logits[r][0..vocab] (CPU twin: the engine's greedy argmax): the lowest index
// wins ties, NaN never wins, and a row with nothing above -inf gives 0. One block per row (blockDim.x a multiple of
// 32, at most 1024).
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab, unsigned int* __restrict__ out) {
    __shared__ float s_v[32];
    __shared__ unsigned int s_i[32];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float v = -PAGODA_INF;
    unsigned int idx = 0xffffffffu;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float x = row[j];
        if (x > v) {  // false for NaN; a thread's own indices rise, so its first maximum stays
            v = x;
            idx = (unsigned int)j;
        }
    }
    // Larger value wins; on equal values the lower index.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const unsigned int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) {
            v = ov;
            idx = oi;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    if (lane == 0) {
        s_v[warp] = v;
        s_i[warp] = idx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < nw; ++w) {
            if (s_v[w] > v || (s_v[w] == v && s_i[w] < idx)) {
                v = s_v[w];
                idx = s_i[w];
            }
        }
        out[blockIdx.x] = v == -PAGODA_INF ? 0u : idx;
    }
}
