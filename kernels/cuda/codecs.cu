// KV block codecs on the device (CPU twin: pagoda_kernels::codec): encode blocks of the f16 arenas into the
// self-describing block format the tiers store, and decode such blocks back into arena blocks. The byte layout is
// the CPU's exactly (16-byte header "PGKV", version 1, codec id, block_size, head_dim, filled, 0; then the K half
// and the V half), so a block encoded here decodes on the CPU and the other way round.
//
// Codecs here: int8 (codec id 3: f32 scale per slot = absmax / 127, codes round(x / scale)), fp8 e4m3 (id 4:
// one f32 scale per half = absmax / 448, codes e4m3(x / scale) with round-to-nearest-even, saturating), and the
// KIVI codecs int4_kivi (id 5) and int2_kivi (id 6): keys quantised per channel over the block's slots, values per
// slot in groups of 32 channels, each group with an f16 scale and min, codes packed two (four) channels per byte.
// Slots past `filled` are zero. Inputs are finite by construction (f16 arena values), as the CPU encoder requires.
// The KIVI arithmetic is spelled with explicit IEEE operations (__fsub_rn, __fdiv_rn, __fmul_rn, __fadd_rn) so
// that no multiply-add is fused: the CPU computes each step rounded, and the bytes and values must match it.
// The read side of the layout (offsets, value decoding) is in codec_layout.cuh, which this module is compiled with.

__device__ __forceinline__ void put_u16(unsigned char* p, unsigned int v) {
    p[0] = (unsigned char)(v & 0xffu);
    p[1] = (unsigned char)(v >> 8);
}

// The 16-byte block header: "PGKV", version 1, codec id, block_size, head_dim, filled, 4 zero bytes.
__device__ __forceinline__ void put_header(unsigned char* blk, int codec, int block_size, int head_dim, int filled) {
    blk[0] = 'P';
    blk[1] = 'G';
    blk[2] = 'K';
    blk[3] = 'V';
    blk[4] = 1;
    blk[5] = (unsigned char)codec;
    put_u16(blk + 6, (unsigned int)block_size);
    put_u16(blk + 8, (unsigned int)head_dim);
    put_u16(blk + 10, (unsigned int)filled);
    blk[12] = blk[13] = blk[14] = blk[15] = 0;
}

__device__ __forceinline__ void put_f32(unsigned char* p, float f) {
    const unsigned int u = __float_as_uint(f);
    p[0] = (unsigned char)(u & 0xffu);
    p[1] = (unsigned char)((u >> 8) & 0xffu);
    p[2] = (unsigned char)((u >> 16) & 0xffu);
    p[3] = (unsigned char)(u >> 24);
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

// pagoda_kernels::codec::kivi_params for a group with extremes mn, mx (f16 inputs: min_h == mn, scale finite):
// the f16 bits of the scale and the min.
__device__ __forceinline__ void kivi_params_of(float mn, float mx, float levels, unsigned short* scale_h,
                                               unsigned short* min_h) {
    *min_h = f2h(mn);
    const float range = fmaxf(__fsub_rn(mx, h2f(*min_h)), 0.0f);
    *scale_h = f2h(__fdiv_rn(range, levels));
}

// pagoda_kernels::codec::kivi_code: round half away from zero, clamped to the levels.
__device__ __forceinline__ unsigned int kivi_code(float x, float mn, float sc, float levels) {
    if (!(sc > 0.0f)) return 0u;
    return (unsigned int)fminf(fmaxf(roundf(__fdiv_rn(__fsub_rn(x, mn), sc)), 0.0f), levels);
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
    unsigned char* h = blk + encoded_half_offset(half, codec, block_size, head_dim);
    if (half == 0 && threadIdx.x == 0) put_header(blk, codec, block_size, head_dim, f);
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

// Encodes block blocks[i] (its first filled[i] slots) with a KIVI codec into out + i * block_len. Grid (n_blocks,
// 2): y = 0 the K half (and the header), y = 1 the V half. Each half's parameters (an f16 scale and min per channel
// for K, per (slot, group) for V) are computed into shared memory first (dynamic, 4 bytes per parameter pair: see
// kivi_encode_smem in codecs.rs), then copied out and read from there by the threads that pack the codes, so no
// thread reads back another's global writes.
extern "C" __global__ void encode_blocks_kivi(const unsigned short* __restrict__ kc,
                                              const unsigned short* __restrict__ vc,
                                              const unsigned int* __restrict__ blocks, const int* __restrict__ filled,
                                              int block_size, int head_dim, int codec, long long block_len,
                                              unsigned char* __restrict__ out) {
    extern __shared__ unsigned short kivi_params[];  // [n_params] scales, then [n_params] mins
    const int i = blockIdx.x, half = blockIdx.y, f = filled[i];
    const unsigned short* src = (half == 0 ? kc : vc) + (size_t)blocks[i] * block_size * head_dim;
    unsigned char* blk = out + (size_t)i * block_len;
    const int rl = kivi_row_len(codec, head_dim);
    const int groups = kivi_groups(head_dim);
    unsigned char* h = blk + encoded_half_offset(half, codec, block_size, head_dim);
    const int n_params = half == 0 ? head_dim : block_size * groups;
    unsigned short* p_scale = kivi_params;
    unsigned short* p_min = kivi_params + n_params;
    unsigned char* codes = h + kivi_params_len(half, block_size, head_dim);
    const float levels = codec == PAGODA_CODEC_INT4_KIVI ? 15.0f : 3.0f;
    if (half == 0 && threadIdx.x == 0) put_header(blk, codec, block_size, head_dim, f);
    // K: one channel per parameter, its extremes over the filled slots. V: one (slot, group) per parameter; slots
    // past `filled` (and every channel of an empty block) keep zero parameters.
    for (int t = threadIdx.x; t < n_params; t += blockDim.x) {
        float mn = PAGODA_INF, mx = -PAGODA_INF;
        bool any = false;
        if (half == 0) {
            for (int s = 0; s < f; ++s) {
                const float x = h2f(src[(size_t)s * head_dim + t]);
                mn = fminf(mn, x);
                mx = fmaxf(mx, x);
                any = true;
            }
        } else {
            const int s = t / groups, g = t % groups;
            const int end = min(head_dim, (g + 1) * PAGODA_KIVI_GROUP);
            if (s < f) {
                for (int c = g * PAGODA_KIVI_GROUP; c < end; ++c) {
                    const float x = h2f(src[(size_t)s * head_dim + c]);
                    mn = fminf(mn, x);
                    mx = fmaxf(mx, x);
                    any = true;
                }
            }
        }
        unsigned short sc_h = 0, min_h = 0;
        if (any) kivi_params_of(mn, mx, levels, &sc_h, &min_h);
        p_scale[t] = sc_h;
        p_min[t] = min_h;
    }
    __syncthreads();
    for (int t = threadIdx.x; t < n_params; t += blockDim.x) {
        put_u16(h + 2LL * t, p_scale[t]);
        put_u16(h + 2LL * (n_params + t), p_min[t]);
    }
    // One packed byte per thread: channels j, j + D/2 (int4) or j, j + D/4, j + D/2, j + 3D/4 (int2).
    const int per_byte = codec == PAGODA_CODEC_INT4_KIVI ? 2 : 4;
    const int bits = codec == PAGODA_CODEC_INT4_KIVI ? 4 : 2;
    for (long long t = threadIdx.x; t < (long long)block_size * rl; t += blockDim.x) {
        const int s = (int)(t / rl), j = (int)(t % rl);
        unsigned int byte = 0;
        if (s < f) {
            for (int k = 0; k < per_byte; ++k) {
                const int c = j + k * rl;
                const int p = half == 0 ? c : s * groups + c / PAGODA_KIVI_GROUP;
                const float sc = h2f(p_scale[p]), mn = h2f(p_min[p]);
                byte |= kivi_code(h2f(src[(size_t)s * head_dim + c]), mn, sc, levels) << (bits * k);
            }
        }
        codes[t] = (unsigned char)byte;
    }
}

// Decodes the validated block at bytes + i * block_len (int8, fp8 or KIVI) into arena block dst[i] (f16, rounded to
// nearest): each value as encoded_value gives it, slots past the header's `filled` zero. Grid (n_blocks, 2): y = 0
// the K half, y = 1 the V half.
extern "C" __global__ void decode_blocks(const unsigned char* __restrict__ bytes, const unsigned int* __restrict__ dst,
                                         int block_size, int head_dim, int codec, long long block_len,
                                         unsigned short* __restrict__ kc, unsigned short* __restrict__ vc) {
    const int i = blockIdx.x, half = blockIdx.y;
    const unsigned char* blk = bytes + (size_t)i * block_len;
    const int f = (int)get_u16(blk + 10);
    const unsigned char* h = blk + encoded_half_offset(half, codec, block_size, head_dim);
    unsigned short* out = (half == 0 ? kc : vc) + (size_t)dst[i] * block_size * head_dim;
    const long long n = (long long)block_size * head_dim;
    for (long long j = threadIdx.x; j < n; j += blockDim.x) {
        const int s = (int)(j / head_dim), c = (int)(j % head_dim);
        out[j] = f2h(s < f ? encoded_value(h, half, codec, block_size, head_dim, s, c) : 0.0f);
    }
}
