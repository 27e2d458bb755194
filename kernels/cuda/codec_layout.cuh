// The encoded KV block layout, read side (CPU twin: pagoda_kernels::codec): the codec ids, the offsets of a
// block's halves, parameters and code rows, and the decoding of one value. Shared by the codecs module (encode and
// decode blocks) and the encoded attention module (dequantise on load); the layout itself is described in codecs.cu.

#define PAGODA_CODEC_INT8 3
#define PAGODA_CODEC_FP8 4
#define PAGODA_CODEC_INT4_KIVI 5
#define PAGODA_CODEC_INT2_KIVI 6
#define PAGODA_KIVI_GROUP 32

__device__ __forceinline__ float get_f32(const unsigned char* p) {
    return __uint_as_float((unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) |
                           ((unsigned int)p[3] << 24));
}

// pagoda_kernels::codec::e4m3_to_f32: the 7 magnitude bits at f32 bits 20..27, times 2^120.
__device__ __forceinline__ float e4m3_to_f32(unsigned char b) {
    const float mag = __uint_as_float(((unsigned int)(b & 0x7Fu)) << 20) * __uint_as_float((120u + 127u) << 23);
    return (b & 0x80u) ? -mag : mag;
}

__device__ __forceinline__ unsigned int get_u16(const unsigned char* p) {
    return (unsigned int)p[0] | ((unsigned int)p[1] << 8);
}

// Bytes of one KIVI half and of its parameters (f16 scales, then f16 mins).
__device__ __forceinline__ int kivi_groups(int head_dim) { return (head_dim + PAGODA_KIVI_GROUP - 1) / PAGODA_KIVI_GROUP; }

__device__ __forceinline__ long long kivi_params_len(int half, int block_size, int head_dim) {
    return half == 0 ? 4LL * head_dim : 4LL * block_size * kivi_groups(head_dim);
}

__device__ __forceinline__ int kivi_row_len(int codec, int head_dim) {
    return codec == PAGODA_CODEC_INT4_KIVI ? head_dim / 2 : head_dim / 4;
}

// Scale and min of channel c of slot s in a KIVI half whose parameters start at h.
__device__ __forceinline__ void kivi_param_of(const unsigned char* h, int half, int block_size, int head_dim, int s,
                                              int c, float* sc, float* mn) {
    if (half == 0) {
        *sc = h2f((unsigned short)get_u16(h + 2 * c));
        *mn = h2f((unsigned short)get_u16(h + 2 * (head_dim + c)));
    } else {
        const int groups = kivi_groups(head_dim);
        const long long p = 2LL * ((long long)s * groups + c / PAGODA_KIVI_GROUP);
        *sc = h2f((unsigned short)get_u16(h + p));
        *mn = h2f((unsigned short)get_u16(h + 2LL * block_size * groups + p));
    }
}

// Code of channel c in a packed row (pagoda_kernels::codec::unpack).
__device__ __forceinline__ unsigned int kivi_unpack(int codec, const unsigned char* row, int head_dim, int c) {
    if (codec == PAGODA_CODEC_INT4_KIVI) {
        const int h = head_dim / 2;
        return c < h ? (row[c] & 0x0Fu) : (row[c - h] >> 4);
    }
    const int q = head_dim / 4;
    return (row[c % q] >> (2 * (c / q))) & 0x03u;
}

// Bytes of the K half of a block of `codec` (the V half follows it).
__device__ __forceinline__ long long encoded_k_half_len(int codec, int block_size, int head_dim) {
    const long long n = (long long)block_size * head_dim;
    if (codec == PAGODA_CODEC_INT8) return 4LL * block_size + n;
    if (codec == PAGODA_CODEC_FP8) return 4LL + n;
    return kivi_params_len(0, block_size, head_dim) + (long long)block_size * kivi_row_len(codec, head_dim);
}

// Value of channel c of slot s in one half h of a validated block of `codec` (the CPU's decode_row).
__device__ __forceinline__ float encoded_value(const unsigned char* h, int half, int codec, int block_size,
                                               int head_dim, int s, int c) {
    if (codec == PAGODA_CODEC_INT8) {
        return (float)(signed char)h[4 * block_size + (size_t)s * head_dim + c] * get_f32(h + 4 * s);
    }
    if (codec == PAGODA_CODEC_FP8) {
        return e4m3_to_f32(h[4 + (size_t)s * head_dim + c]) * get_f32(h);
    }
    float sc, mn;
    kivi_param_of(h, half, block_size, head_dim, s, c, &sc, &mn);
    const int rl = kivi_row_len(codec, head_dim);
    const unsigned char* codes = h + kivi_params_len(half, block_size, head_dim) + (size_t)s * rl;
    return __fadd_rn(mn, __fmul_rn((float)kivi_unpack(codec, codes, head_dim, c), sc));
}

// Start of half `half` (0: K, 1: V) of the block at blk: the header, then the K half, then the V half.
__device__ __forceinline__ long long encoded_half_offset(int half, int codec, int block_size, int head_dim) {
    return 16 + (half == 0 ? 0 : encoded_k_half_len(codec, block_size, head_dim));
}
