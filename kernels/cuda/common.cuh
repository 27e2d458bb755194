// Shared device helpers for every Pagoda CUDA module. NVRTC compiles each module as `common.cuh` + `<module>.cu`
// (the Rust side concatenates them), so no include paths or CUDA headers are needed: f16 conversion is inline PTX.
// f16 values travel as raw `unsigned short` bits.

#define PAGODA_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Eight f16 values packed in a uint4 -> eight floats.
__device__ __forceinline__ void unpack8(uint4 u, float* f) {
    const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = h2f((unsigned short)(w[i] & 0xffffu));
        f[2 * i + 1] = h2f((unsigned short)(w[i] >> 16));
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum (or, with MAX, max) over the whole thread block (blockDim.x a multiple of 32, at most 1024). Every thread gets
// the result.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* scratch /* >= 33 floats */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = scratch[0];
    for (int i = 1; i < nw; ++i) t = MAX ? fmaxf(t, scratch[i]) : t + scratch[i];
    return t;
}

__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce<false>(v, scratch); }

__device__ __forceinline__ float block_max(float v, float* scratch) { return block_reduce<true>(v, scratch); }

// Merges the `ns` split-K partials at part_o / part_ml + base (unnormalised outputs of head_dim floats, and
// (max, sum) pairs) into o[0..head_dim]: the splits' max and weighted sum, each thread over a stride of splits and
// then across the block (a long context has hundreds of splits), then each output dimension. `wts` holds ns
// floats (shared); blockDim.x a multiple of 32.
__device__ __forceinline__ void merge_splits(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                             size_t base, int ns, int head_dim, float* wts, float* scratch,
                                             float* __restrict__ o) {
    float m = -PAGODA_INF;
    for (int i = threadIdx.x; i < ns; i += blockDim.x) m = fmaxf(m, part_ml[2 * (base + i)]);
    m = block_max(m, scratch);
    float l = 0.0f;
    for (int i = threadIdx.x; i < ns; i += blockDim.x) {
        const float wi = expf(part_ml[2 * (base + i)] - m);
        wts[i] = wi;
        l += part_ml[2 * (base + i) + 1] * wi;
    }
    l = block_sum(l, scratch);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (int i = 0; i < ns; ++i) a = fmaf(part_o[(base + i) * head_dim + d], wts[i], a);
        o[d] = a * inv;
    }
}
