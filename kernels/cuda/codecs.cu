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

#define PAGODA_CODEC_INT8 3
#define PAGODA_CODEC_FP8 4
#define PAGODA_CODEC_INT4_KIVI 5
#define PAGODA_CODEC_INT2_KIVI 6
#define PAGODA_KIVI_GROUP 32

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

#define ENC_NW 4
#define ENC_MAX_PER_LANE 8  // head_dim <= 256

// Per-lane decoding of one slot's row of an encoded half, for the attention kernel below: lane l holds channels
// l, l + 32, ... (k-th in v[k]). The values are encoded_value's, bit for bit; what is per slot or per block (an
// int8 slot scale, the fp8 half scale, a KIVI key channel's scale and min) is loaded once per slot or block, not
// per value.
template <int CODEC>
struct RowDecoder {
    // KIVI keys: the lane's channels' scales and mins, for the block `blk` they were loaded from.
    float sc[ENC_MAX_PER_LANE], mn[ENC_MAX_PER_LANE];
    const unsigned char* blk = nullptr;

    __device__ __forceinline__ void row(const unsigned char* b, const unsigned char* h, int half, int block_size,
                                        int head_dim, int s, int lane, float* v) {
        if (CODEC == PAGODA_CODEC_INT8) {
            const float scale = get_f32(h + 4 * s);
            const unsigned char* codes = h + 4 * block_size + (size_t)s * head_dim;
#pragma unroll
            for (int k = 0; k < ENC_MAX_PER_LANE; ++k) {
                const int c = lane + 32 * k;
                v[k] = c < head_dim ? (float)(signed char)codes[c] * scale : 0.0f;
            }
        } else if (CODEC == PAGODA_CODEC_FP8) {
            const float scale = get_f32(h);
            const unsigned char* codes = h + 4 + (size_t)s * head_dim;
#pragma unroll
            for (int k = 0; k < ENC_MAX_PER_LANE; ++k) {
                const int c = lane + 32 * k;
                v[k] = c < head_dim ? e4m3_to_f32(codes[c]) * scale : 0.0f;
            }
        } else {
            const int rl = kivi_row_len(CODEC, head_dim);
            const unsigned char* codes = h + kivi_params_len(half, block_size, head_dim) + (size_t)s * rl;
            if (half == 0 && b != blk) {
                blk = b;
#pragma unroll
                for (int k = 0; k < ENC_MAX_PER_LANE; ++k) {
                    const int c = lane + 32 * k;
                    if (c < head_dim) kivi_param_of(h, 0, block_size, head_dim, s, c, &sc[k], &mn[k]);
                }
            }
#pragma unroll
            for (int k = 0; k < ENC_MAX_PER_LANE; ++k) {
                const int c = lane + 32 * k;
                if (c >= head_dim) {
                    v[k] = 0.0f;
                    continue;
                }
                float scale, lo;
                if (half == 0) {
                    scale = sc[k];
                    lo = mn[k];
                } else {
                    kivi_param_of(h, 1, block_size, head_dim, s, c, &scale, &lo);
                }
                v[k] = __fadd_rn(lo, __fmul_rn((float)kivi_unpack(CODEC, codes, head_dim, c), scale));
            }
        }
    }
};

// Dequantise-on-load paged attention over an arena of encoded blocks (CPU twin: paged_attention_encoded), split-K
// like the f16 decode path. One CTA per (entry, query head of the entry's GQA group, split of `chunk` slots); entry
// e is one query row ent_row[e] against kv-head ent_head[e], whose ent_len[e] visible slots are listed by the block
// table at tables + ent_tab[e]. Each warp takes every ENC_NW-th slot of the split: it decodes the slot's key row in
// registers (RowDecoder), scores it against the query, and folds the decoded value row into its online softmax;
// the warps' results are merged and written unnormalised with their (max, sum) to part_o / part_ml at
// ((e * group + g) * max_splits + split), which `paged_encoded_reduce` merges. Memory traffic is the encoded size
// of the blocks read.
template <int CODEC>
__device__ __forceinline__ void encoded_split(const float* __restrict__ q, const unsigned char* __restrict__ arena,
                                              long long block_len, const unsigned int* __restrict__ tables,
                                              const int* __restrict__ ent_row, const int* __restrict__ ent_head,
                                              const int* __restrict__ ent_len, const int* __restrict__ ent_tab,
                                              int n_heads, int n_kv, int block_size, int head_dim, float scale,
                                              int chunk, int max_splits, float* __restrict__ part_o,
                                              float* __restrict__ part_ml) {
    __shared__ float s_acc[ENC_NW][32 * ENC_MAX_PER_LANE];
    __shared__ float s_m[ENC_NW], s_l[ENC_NW];
    const int e = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
    const int group = n_heads / n_kv, h = ent_head[e], qh = h * group + g, row = ent_row[e], L = ent_len[e];
    const int t0 = split * chunk, t1 = min(L, t0 + chunk);
    if (t0 >= L) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* qp = q + (size_t)row * n_heads * head_dim + (size_t)qh * head_dim;
    float qv[ENC_MAX_PER_LANE], acc[ENC_MAX_PER_LANE], kr[ENC_MAX_PER_LANE], vr[ENC_MAX_PER_LANE];
#pragma unroll
    for (int k = 0; k < ENC_MAX_PER_LANE; ++k) {
        const int c = lane + 32 * k;
        qv[k] = c < head_dim ? qp[c] * scale : 0.0f;
        acc[k] = 0.0f;
    }
    const long long k_off = encoded_half_offset(0, CODEC, block_size, head_dim);
    const long long v_off = encoded_half_offset(1, CODEC, block_size, head_dim);
    const unsigned int* tab = tables + ent_tab[e];
    RowDecoder<CODEC> kdec, vdec;
    float m = -PAGODA_INF, l = 0.0f;
    for (int t = t0 + warp; t < t1; t += ENC_NW) {
        const unsigned char* blk = arena + (size_t)tab[t / block_size] * block_len;
        const int s = t % block_size;
        kdec.row(blk, blk + k_off, 0, block_size, head_dim, s, lane, kr);
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < ENC_MAX_PER_LANE; ++k) dot += qv[k] * kr[k];
        dot = warp_sum(dot);
        const float m_new = fmaxf(m, dot);
        const float corr = expf(m - m_new), p = expf(dot - m_new);
        l = l * corr + p;
        vdec.row(blk, blk + v_off, 1, block_size, head_dim, s, lane, vr);
#pragma unroll
        for (int k = 0; k < ENC_MAX_PER_LANE; ++k) acc[k] = acc[k] * corr + p * vr[k];
        m = m_new;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int k = 0; k < ENC_MAX_PER_LANE; ++k) s_acc[warp][lane + 32 * k] = acc[k];
    __syncthreads();
    float big = -PAGODA_INF;
    for (int w = 0; w < ENC_NW; ++w) big = fmaxf(big, s_m[w]);
    float sum = 0.0f;
    for (int w = 0; w < ENC_NW; ++w) sum += s_m[w] == -PAGODA_INF ? 0.0f : s_l[w] * expf(s_m[w] - big);
    const size_t p = ((size_t)e * group + g) * max_splits + split;
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < ENC_NW; ++w)
            if (s_m[w] != -PAGODA_INF) o += s_acc[w][c] * expf(s_m[w] - big);
        part_o[p * head_dim + c] = o;
    }
    if (threadIdx.x == 0) {
        part_ml[2 * p] = big;
        part_ml[2 * p + 1] = sum;
    }
}

// One kernel per codec (paged_attention_encoded_{int8,fp8,int4_kivi,int2_kivi}), so each holds one set of the
// shared arrays above.
#define PAGODA_ENCODED_ATTENTION(NAME, C)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * ENC_NW) paged_attention_encoded_##NAME(                      \
        const float* __restrict__ q, const unsigned char* __restrict__ arena, long long block_len,                \
        const unsigned int* __restrict__ tables, const int* __restrict__ ent_row, const int* __restrict__ ent_head,\
        const int* __restrict__ ent_len, const int* __restrict__ ent_tab, int n_heads, int n_kv, int block_size,  \
        int head_dim, float scale, int chunk, int max_splits, float* __restrict__ part_o,                         \
        float* __restrict__ part_ml) {                                                                            \
        encoded_split<C>(q, arena, block_len, tables, ent_row, ent_head, ent_len, ent_tab, n_heads, n_kv,         \
                         block_size, head_dim, scale, chunk, max_splits, part_o, part_ml);                        \
    }

PAGODA_ENCODED_ATTENTION(int8, PAGODA_CODEC_INT8)
PAGODA_ENCODED_ATTENTION(fp8_e4m3, PAGODA_CODEC_FP8)
PAGODA_ENCODED_ATTENTION(int4_kivi, PAGODA_CODEC_INT4_KIVI)
PAGODA_ENCODED_ATTENTION(int2_kivi, PAGODA_CODEC_INT2_KIVI)

// Merges the splits of (entry = blockIdx.x, query head g = blockIdx.y of its group) into out (the same merge as
// paged_decode_reduce, indexed by entry). Dynamic shared memory: max_splits floats.
extern "C" __global__ void paged_encoded_reduce(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                const int* __restrict__ ent_row, const int* __restrict__ ent_head,
                                                const int* __restrict__ ent_len, int n_heads, int n_kv, int head_dim,
                                                int chunk, int max_splits, float* __restrict__ out) {
    extern __shared__ float wts[];
    __shared__ float scratch[33];
    const int e = blockIdx.x, g = blockIdx.y;
    const int group = n_heads / n_kv, qh = ent_head[e] * group + g;
    const int ns = (ent_len[e] + chunk - 1) / chunk;
    const size_t base = ((size_t)e * group + g) * max_splits;
    float* o = out + (size_t)ent_row[e] * n_heads * head_dim + (size_t)qh * head_dim;
    merge_splits(part_o, part_ml, base, ns, head_dim, wts, scratch, o);
}
