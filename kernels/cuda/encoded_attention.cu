// Dequantise-on-load paged decode attention over an arena of encoded KV blocks (CPU twin:
// Backend::paged_attention_encoded): decode_split.cuh's split-K kernel with a row source that reads a slot's codes
// from its block (codec_layout.cuh) and dequantises them in registers, so the bytes read are the encoded bytes.
// Kernels `paged_decode_{int8,fp8_e4m3,int4_kivi,int2_kivi}_hd{HD}_g{G}`; their splits are merged by attention.cu's
// `paged_decode_reduce`.
//
// A lane's 8 channels 8c..8c+7 are 8 consecutive code bytes (int8, fp8), or 8 bytes of a packed KIVI row whose
// nibbles (int4: channels j and j + HD/2 share byte j) or bit pairs (int2: j, j + HD/4, j + HD/2, j + 3HD/4) hold
// them at one shift. For HD in {64, 128, 256} and every block size, each half, its parameters and its code rows
// start 4-byte aligned in a 4-byte-aligned block length (see the offsets in codec_layout.cuh), so codes load as
// two 32-bit words and f32 scales as one. The values are encoded_value's, with the same rounding steps.

template <int CODEC, int HD>
struct EncodedRows {
    const unsigned char* arena;
    long long block_len;
    int block_size;
    struct Raw {
        unsigned int lo, hi;  // the 8 code bytes
        float scale, min;     // int8: the slot's scale; fp8: the half's; KIVI V: the (slot, group)'s scale and min
        const unsigned char* params;  // KIVI K: the half's per-channel scales (then mins)
    };

    // Block and slot in one word (the host keeps arenas under 2^24 blocks; block_size <= 256), so a load needs no
    // division.
    __device__ __forceinline__ unsigned int slot(unsigned int block, unsigned int s) const { return block << 8 | s; }

    __device__ __forceinline__ Raw load(int half, unsigned int slot, int c) const {
        const unsigned int b = slot >> 8, s = slot & 0xffu;
        const unsigned char* h = arena + (size_t)b * block_len + encoded_half_offset(half, CODEC, block_size, HD);
        const unsigned char* codes;
        Raw raw;
        raw.scale = 0.0f;
        raw.min = 0.0f;
        raw.params = h;
        if (CODEC == PAGODA_CODEC_INT8) {
            raw.scale = *reinterpret_cast<const float*>(h + 4 * s);
            codes = h + 4 * block_size + (size_t)s * HD + 8 * c;
        } else if (CODEC == PAGODA_CODEC_FP8) {
            raw.scale = *reinterpret_cast<const float*>(h);
            codes = h + 4 + (size_t)s * HD + 8 * c;
        } else {
            constexpr int RL = CODEC == PAGODA_CODEC_INT4_KIVI ? HD / 2 : HD / 4;
            codes = h + kivi_params_len(half, block_size, HD) + (size_t)s * RL + (8 * c) % RL;
            if (half == 1) {
                constexpr int GROUPS = (HD + PAGODA_KIVI_GROUP - 1) / PAGODA_KIVI_GROUP;
                const long long p = 2LL * ((long long)s * GROUPS + (8 * c) / PAGODA_KIVI_GROUP);
                raw.scale = h2f(*reinterpret_cast<const unsigned short*>(h + p));
                raw.min = h2f(*reinterpret_cast<const unsigned short*>(h + 2LL * block_size * GROUPS + p));
            }
        }
        raw.lo = *reinterpret_cast<const unsigned int*>(codes);
        raw.hi = *reinterpret_cast<const unsigned int*>(codes + 4);
        return raw;
    }

    __device__ __forceinline__ void unpack(const Raw& raw, int half, int c, float* v) const {
        // Small integers become floats without a conversion instruction: byte k of a word goes into the low
        // mantissa of 2^23 (one byte permute), and subtracting 2^23 leaves the integer, exactly.
        constexpr float TWO23 = 8388608.0f;
        if (CODEC == PAGODA_CODEC_INT8) {
            // Flipping the sign bit maps a signed code x to x + 128.
            const unsigned int w[2] = {raw.lo ^ 0x80808080u, raw.hi ^ 0x80808080u};
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float x = __uint_as_float(__byte_perm(w[k >> 2], 0x4B000000u, 0x7440u | (k & 3))) - (TWO23 + 128.0f);
                v[k] = x * raw.scale;
            }
        } else if (CODEC == PAGODA_CODEC_FP8) {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const unsigned int byte = ((k < 4 ? raw.lo : raw.hi) >> (8 * (k & 3))) & 0xffu;
                v[k] = e4m3_to_f32((unsigned char)byte) * raw.scale;
            }
        } else {
            constexpr int RL = CODEC == PAGODA_CODEC_INT4_KIVI ? HD / 2 : HD / 4;
            constexpr int BITS = CODEC == PAGODA_CODEC_INT4_KIVI ? 4 : 2;
            constexpr unsigned int MASK = CODEC == PAGODA_CODEC_INT4_KIVI ? 0x0F0F0F0Fu : 0x03030303u;
            // Every channel of the lane sits at the same shift in its byte.
            const int shift = BITS * ((8 * c) / RL);
            const unsigned int w[2] = {(raw.lo >> shift) & MASK, (raw.hi >> shift) & MASK};
            // KIVI keys: the 8 channels' f16 scales and mins, 16 contiguous bytes each.
            unsigned int sc_w[4], mn_w[4];
            if (half == 0) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    sc_w[i] = reinterpret_cast<const unsigned int*>(raw.params + 16 * c)[i];
                    mn_w[i] = reinterpret_cast<const unsigned int*>(raw.params + 2 * HD + 16 * c)[i];
                }
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float code = __uint_as_float(__byte_perm(w[k >> 2], 0x4B000000u, 0x7440u | (k & 3))) - TWO23;
                float sc = raw.scale, mn = raw.min;
                if (half == 0) {
                    sc = h2f((unsigned short)(sc_w[k >> 1] >> (16 * (k & 1))));
                    mn = h2f((unsigned short)(mn_w[k >> 1] >> (16 * (k & 1))));
                }
                v[k] = __fadd_rn(mn, __fmul_rn(code, sc));
            }
        }
    }
};

#define PAGODA_DECODE_ENCODED(NAME, CODEC, HD, G)                                                                  \
    extern "C" __global__ void __launch_bounds__(NT) paged_decode_##NAME##_hd##HD##_g##G(                          \
        const float* __restrict__ q, const unsigned char* __restrict__ arena, long long block_len,                \
        const unsigned int* __restrict__ tables, const int* __restrict__ item_row,                                \
        const int* __restrict__ ent_len, const int* __restrict__ ent_tab, int n_heads, int n_kv, int block_size,  \
        int chunk, int max_splits, float scale, float* __restrict__ part_o, float* __restrict__ part_ml) {        \
        decode_split<HD, G>(q, EncodedRows<CODEC, HD>{arena, block_len, block_size}, tables, item_row, ent_len,   \
                            ent_tab, n_heads, n_kv, block_size, chunk, max_splits, scale, part_o, part_ml);       \
    }

#define PAGODA_DECODE_ENCODED_SHAPES(NAME, CODEC) \
    PAGODA_DECODE_ENCODED(NAME, CODEC, 64, 1)     \
    PAGODA_DECODE_ENCODED(NAME, CODEC, 64, 2)     \
    PAGODA_DECODE_ENCODED(NAME, CODEC, 64, 4)     \
    PAGODA_DECODE_ENCODED(NAME, CODEC, 64, 8)     \
    PAGODA_DECODE_ENCODED(NAME, CODEC, 128, 1)    \
    PAGODA_DECODE_ENCODED(NAME, CODEC, 128, 2)    \
    PAGODA_DECODE_ENCODED(NAME, CODEC, 128, 4)    \
    PAGODA_DECODE_ENCODED(NAME, CODEC, 128, 8)    \
    PAGODA_DECODE_ENCODED(NAME, CODEC, 256, 1)    \
    PAGODA_DECODE_ENCODED(NAME, CODEC, 256, 2)    \
    PAGODA_DECODE_ENCODED(NAME, CODEC, 256, 4)    \
    PAGODA_DECODE_ENCODED(NAME, CODEC, 256, 8)

PAGODA_DECODE_ENCODED_SHAPES(int8, PAGODA_CODEC_INT8)
PAGODA_DECODE_ENCODED_SHAPES(fp8_e4m3, PAGODA_CODEC_FP8)
PAGODA_DECODE_ENCODED_SHAPES(int4_kivi, PAGODA_CODEC_INT4_KIVI)
PAGODA_DECODE_ENCODED_SHAPES(int2_kivi, PAGODA_CODEC_INT2_KIVI)
