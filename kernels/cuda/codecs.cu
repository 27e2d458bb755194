// KV block codecs on the device (CPU twin: pagoda_kernels::codec): encode blocks of the f16 arenas into the
// self-describing block format the tiers store, and decode such blocks back into arena blocks. The byte layout is
// the CPU's exactly (16-byte header "PGKV", version 1, codec id, block_size, head_dim, filled, 0; then the K half
// and the V half), so a block encoded here decodes on the CPU and the other way round.
//
// Codecs here: int8 (codec id 3: f32 scale per slot = absmax / 127, codes round(x / scale)) and fp8 e4m3 (id 4:
// one f32 scale per half = absmax / 448, codes e4m3(x / scale) with round-to-nearest-even, saturating). Slots past
// `filled` are zero. Inputs are finite by construction (f16 arena values), as the CPU encoder requires.

#define PAGODA_CODEC_INT8 3
#define PAGODA_CODEC_FP8 4

__device__ __forceinline__ void put_u16(unsigned char* p, unsigned int v) {
    p[0] = (unsigned char)(v & 0xffu);
    p[1] = (unsigned char)(v >> 8);
}

__device__ __forceinline__ void put_f32(unsigned char* p, float f) {
    const unsigned int u = __float_as_uint(f);
    p[0] = (unsigned char)(u & 0xffu);
    p[1] = (unsigned char)((u >> 8) & 0xffu);
    p[2] = (unsigned char)((u >> 16) & 0xffu);
    p[3] = (unsigned char)(u >> 24);
}

__device__ __forceinline__ float get_f32(const unsigned char* p) {
    return __uint_as_float((unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) |
                           ((unsigned int)p[3] << 24));
}

// pagoda_kernels::codec::e4m3_from_f32, bit for bit: y finite.
__device__ __forceinline__ unsigned char e4m3_from_f32(float y) {
    const unsigned int sign = (__float_as_uint(y) >> 31) ? 0x80u : 0u;
    const float a = fabsf(y);
    if (a >= 448.0f) return (unsigned char)(sign | 0x7Eu);
    if (a < 0.015625f) {  // 2^-6: subnormal range, step 2^-9, ties to even
        return (unsigned char)(sign | (unsigned int)rintf(a * 512.0f));
    }
    const unsigned int bits = __float_as_uint(a);
    const int e = (int)(bits >> 23) - 127;
    const unsigned int man = bits & 0x7FFFFFu;
    unsigned int q = ((unsigned int)(e + 7) << 3) | (man >> 20);
    const unsigned int rem = man & 0xFFFFFu;
    if (rem > 0x80000u || (rem == 0x80000u && (q & 1u))) q += 1;
    return (unsigned char)(sign | (q < 0x7Eu ? q : 0x7Eu));
}

// pagoda_kernels::codec::e4m3_to_f32: the 7 magnitude bits at f32 bits 20..27, times 2^120.
__device__ __forceinline__ float e4m3_to_f32(unsigned char b) {
    const float mag = __uint_as_float(((unsigned int)(b & 0x7Fu)) << 20) * __uint_as_float((120u + 127u) << 23);
    return (b & 0x80u) ? -mag : mag;
}

// Encodes block blocks[i] (its first filled[i] slots) into out + i * block_len. Grid (n_blocks, 2): y = 0 encodes
// the K half (and writes the header), y = 1 the V half. One warp per slot for int8; the block-wide absmax first for
// fp8. blockDim.x a multiple of 32.
extern "C" __global__ void encode_blocks_q8(const unsigned short* __restrict__ kc, const unsigned short* __restrict__ vc,
                                            const unsigned int* __restrict__ blocks, const int* __restrict__ filled,
                                            int block_size, int head_dim, int codec, long long block_len,
                                            unsigned char* __restrict__ out) {
    __shared__ float scratch[33];
    const int i = blockIdx.x, half = blockIdx.y, f = filled[i];
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned short* src = (half == 0 ? kc : vc) + (size_t)blocks[i] * block_size * head_dim;
    unsigned char* blk = out + (size_t)i * block_len;
    const long long n = (long long)block_size * head_dim;
    const long long half_len = codec == PAGODA_CODEC_INT8 ? 4LL * block_size + n : 4LL + n;
    unsigned char* h = blk + 16 + (half == 0 ? 0 : half_len);
    if (half == 0 && threadIdx.x == 0) {
        blk[0] = 'P';
        blk[1] = 'G';
        blk[2] = 'K';
        blk[3] = 'V';
        blk[4] = 1;
        blk[5] = (unsigned char)codec;
        put_u16(blk + 6, (unsigned int)block_size);
        put_u16(blk + 8, (unsigned int)head_dim);
        put_u16(blk + 10, (unsigned int)f);
        blk[12] = blk[13] = blk[14] = blk[15] = 0;
    }
    if (codec == PAGODA_CODEC_INT8) {
        unsigned char* codes = h + 4 * block_size;
        for (int s = warp; s < block_size; s += warps) {
            float amax = 0.0f;
            if (s < f)
                for (int d = lane; d < head_dim; d += 32) amax = fmaxf(amax, fabsf(h2f(src[(size_t)s * head_dim + d])));
            amax = warp_max(amax);
            const float sc = amax / 127.0f;
            if (lane == 0) put_f32(h + 4 * s, s < f ? sc : 0.0f);
            for (int d = lane; d < head_dim; d += 32) {
                signed char q = 0;
                if (s < f && sc > 0.0f) {
                    const float y = fminf(fmaxf(roundf(h2f(src[(size_t)s * head_dim + d]) / sc), -127.0f), 127.0f);
                    q = (signed char)(int)y;
                }
                codes[(size_t)s * head_dim + d] = (unsigned char)q;
            }
        }
    } else {
        const long long used = (long long)f * head_dim;
        float amax = 0.0f;
        for (long long j = threadIdx.x; j < used; j += blockDim.x) amax = fmaxf(amax, fabsf(h2f(src[j])));
        amax = block_max(amax, scratch);
        const float sc = amax / 448.0f;
        if (threadIdx.x == 0) put_f32(h, sc);
        for (long long j = threadIdx.x; j < n; j += blockDim.x)
            h[4 + j] = (j < used && sc > 0.0f) ? e4m3_from_f32(h2f(src[j]) / sc) : (unsigned char)0;
    }
}

// Decodes the validated block at bytes + i * block_len into arena block dst[i] (f16, rounded to nearest): slots
// past the header's `filled` become zero. Grid (n_blocks, 2): y = 0 the K half, y = 1 the V half.
extern "C" __global__ void decode_blocks_q8(const unsigned char* __restrict__ bytes, const unsigned int* __restrict__ dst,
                                            int block_size, int head_dim, int codec, long long block_len,
                                            unsigned short* __restrict__ kc, unsigned short* __restrict__ vc) {
    const int i = blockIdx.x, half = blockIdx.y;
    const unsigned char* blk = bytes + (size_t)i * block_len;
    const int f = (int)blk[10] | ((int)blk[11] << 8);
    const long long n = (long long)block_size * head_dim;
    const long long half_len = codec == PAGODA_CODEC_INT8 ? 4LL * block_size + n : 4LL + n;
    const unsigned char* h = blk + 16 + (half == 0 ? 0 : half_len);
    unsigned short* out = (half == 0 ? kc : vc) + (size_t)dst[i] * block_size * head_dim;
    const long long used = (long long)f * head_dim;
    const float half_scale = codec == PAGODA_CODEC_INT8 ? 0.0f : get_f32(h);  // fp8: one scale per half
    for (long long j = threadIdx.x; j < n; j += blockDim.x) {
        float x = 0.0f;
        if (j < used) {
            if (codec == PAGODA_CODEC_INT8) {
                const int s = (int)(j / head_dim);
                x = (float)(signed char)h[4 * block_size + j] * get_f32(h + 4 * s);
            } else {
                x = e4m3_to_f32(h[4 + j]) * half_scale;
            }
        }
        out[j] = f2h(x);
    }
}
