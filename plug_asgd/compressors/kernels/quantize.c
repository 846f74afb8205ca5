#include <math.h>
#include <stdint.h>
#include <string.h>

/* The quantisers' passes (compressors/quantize.py): sign's and qsgd's encodings and decodings. An encoding reads
   x = (w - c) * s (s applied only where it is not 1), or w itself where c is NULL, by blocks of QBLOCK values:
   the same float32 operations as numpy's path, compiled without contraction. A sum over x is kept in eight
   float64 lanes, lane i % 8 taking coordinate i in order, the lanes added 0 to 7 at the end: numpy's path sums
   in the same order (quantize.py, lane_sum), so both give the same bits. Sign bits are packed least significant
   first, set where x < 0, as np.packbits(x < 0, bitorder="little"). */

#if defined(__x86_64__) && defined(__GNUC__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

#define QBLOCK 64
#define LANES 8

static inline void quantize_block(const float *w, const float *c, int64_t b, int64_t len, float s, float *v) {
    if (c == 0) {
        for (int64_t j = 0; j < len; j++) v[j] = w[b + j];
    } else if (s != 1.0f) {
        for (int64_t j = 0; j < len; j++) v[j] = (w[b + j] - c[b + j]) * s;
    } else {
        for (int64_t j = 0; j < len; j++) v[j] = w[b + j] - c[b + j];
    }
    for (int64_t j = len; j < QBLOCK; j++) v[j] = 0.0f;  /* the tail's lanes add +0.0: no change to a sum */
}

/* The sign bits of a block of QBLOCK values (flags 0 or 1), eight to a byte: the multiply gathers byte k's
   lowest bit into bit k of the top byte (byte k of the eight read being bits 8k to 8k + 7: little-endian, as
   x86-64 and ARM run; a big-endian machine gets numpy's path, the library refusing to load there). */
static inline void pack_signs(const uint8_t *flags, int64_t len, uint8_t *out) {
    for (int64_t k = 0; k < (len + 7) / 8; k++) {
        uint64_t eight;
        memcpy(&eight, flags + 8 * k, 8);
        out[k] = (uint8_t)((eight * 0x0102040810204080ULL) >> 56);
    }
}

static double lanes_total(const double *acc) {
    double total = 0.0;
    for (int k = 0; k < LANES; k++) total += acc[k];
    return total;
}

/* 32-bit integer hash (Wellons' lowbias32): a bijection whose outputs pass as independent uniform draws. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

/* Sign's encoding: the sign bits of x into bits (ceil(n / 8) bytes), and the sum of |x| in float64. */
CLONES
double plug_asgd_sign_encode(const float *w, const float *c, int64_t n, float s, uint8_t *bits) {
    double acc[LANES] = {0};
    float v[QBLOCK];
    uint8_t flags[QBLOCK];
    for (int64_t b = 0; b < n; b += QBLOCK) {
        int64_t len = n - b < QBLOCK ? n - b : QBLOCK;
        quantize_block(w, c, b, len, s, v);
        for (int64_t j = 0; j < QBLOCK; j += LANES)
            for (int k = 0; k < LANES; k++) acc[k] += (double)fabsf(v[j + k]);
        for (int64_t j = 0; j < QBLOCK; j++) flags[j] = v[j] < 0.0f;
        pack_signs(flags, len, bits + b / 8);
    }
    return lanes_total(acc);
}

/* The sum of the float32 squares of x, in float64 (qsgd's norm, squared). */
CLONES
double plug_asgd_square_sum(const float *w, const float *c, int64_t n, float s) {
    double acc[LANES] = {0};
    float v[QBLOCK];
    for (int64_t b = 0; b < n; b += QBLOCK) {
        int64_t len = n - b < QBLOCK ? n - b : QBLOCK;
        quantize_block(w, c, b, len, s, v);
        for (int64_t j = 0; j < QBLOCK; j += LANES)
            for (int k = 0; k < LANES; k++) acc[k] += (double)(v[j + k] * v[j + k]);
    }
    return lanes_total(acc);
}

/* qsgd's levels and sign bits: r = min(|x| * ratio, top), its floor, one more with probability r - floor(r);
   coordinate i's draw is u_i = (h_i >> 8) / 2**24, h_i = mix32(mix32(lo ^ k1) ^ (hi + k2)) for i's low and high
   32 bits. Levels are bytes (wide 0) or 16-bit words (wide 1). */
CLONES
void plug_asgd_qsgd_encode(const float *w, const float *c, int64_t n, float s, float ratio, float top,
                           uint32_t k1, uint32_t k2, int wide, void *levels, uint8_t *bits) {
    float v[QBLOCK];
    uint8_t flags[QBLOCK];
    int32_t level[QBLOCK];
    uint8_t *narrow = (uint8_t *)levels;
    uint16_t *words = (uint16_t *)levels;
    for (int64_t b = 0; b < n; b += QBLOCK) {
        int64_t len = n - b < QBLOCK ? n - b : QBLOCK;
        quantize_block(w, c, b, len, s, v);
        uint32_t high = (uint32_t)((uint64_t)b >> 32) + k2;
        uint32_t first = (uint32_t)b;
        for (int32_t j = 0; j < QBLOCK; j++) {  /* in int32 and float32 only: vectorised */
            float r = fabsf(v[j]) * ratio;
            r = r < top ? r : top;
            float low = (float)(int32_t)r;  /* floor: r is in [0, top], top below 2**16 */
            uint32_t h = mix32(mix32((first + (uint32_t)j) ^ k1) ^ high);
            float u = (float)(int32_t)(h >> 8) * 0x1p-24f;
            level[j] = (int32_t)low + (int32_t)(u < r - low);
        }
        for (int64_t j = 0; j < QBLOCK; j++) flags[j] = v[j] < 0.0f;
        if (wide) {
            for (int64_t j = 0; j < len; j++) words[b + j] = (uint16_t)level[j];
        } else {
            for (int64_t j = 0; j < len; j++) narrow[b + j] = (uint8_t)level[j];
        }
        pack_signs(flags, len, bits + b / 8);
    }
}

/* Sign's decoding: -value where a coordinate's bit is set, value elsewhere (value itself where it is 0, as numpy's
   value - 2 * value gives +0.0), by flipping the float's sign bit: eight coordinates a byte, vectorised. */
CLONES
void plug_asgd_sign_decode(const uint8_t *bits, int64_t n, float value, float *out) {
    uint32_t magnitude, flip = value != 0.0f ? 1u : 0u;
    memcpy(&magnitude, &value, 4);
    uint32_t *words = (uint32_t *)out;
    int64_t whole = n / 8;
    for (int64_t k = 0; k < whole; k++) {
        uint32_t byte = bits[k];
        for (uint32_t j = 0; j < 8; j++) words[8 * k + j] = magnitude ^ ((((byte >> j) & 1u) & flip) << 31);
    }
    for (int64_t i = 8 * whole; i < n; i++) words[i] = magnitude ^ ((((uint32_t)bits[i >> 3] >> (i & 7)) & flip) << 31);
}

/* The PS's fold of a packed update out of place (Codec.fold_packed): block by block, the values decoded into a
   buffer that stays in L1, then o = d + c (d * s + c where s is not 1) by plug_asgd_add_finite (fold.c), which
   also says whether every value written is finite: the bits of decoding, then folding, without the decoding
   written whole and read again. FUSED_BLOCK is a multiple of 8: each block starts at a sign byte. */
#define FUSED_BLOCK 2048

int plug_asgd_add_finite(const float *u, const float *c, float *o, int64_t n, float s);

/* Sign's decoding folded (Sign.fold_packed): whether every value written is finite. */
int plug_asgd_sign_add_finite(const uint8_t *bits, int64_t n, float value, const float *c, float *o, float s) {
    float d[FUSED_BLOCK];
    int finite = 1;
    for (int64_t b = 0; b < n; b += FUSED_BLOCK) {
        int64_t len = n - b < FUSED_BLOCK ? n - b : FUSED_BLOCK;
        plug_asgd_sign_decode(bits + b / 8, len, value, d);
        finite &= plug_asgd_add_finite(d, c + b, o + b, len, s);
    }
    return finite;
}

/* qsgd's decoding (QSGD.decode_packed): the level (8 or 16 bits) times 1 - 2 * its sign bit, in int32, times q in
   float64, rounded to float32. Eight coordinates a sign byte, each level width a loop of its own: vectorised. */
#define QSGD_DECODE(LEVELS)                                                                  \
    for (int64_t k = 0; k < n / 8; k++) {                                                   \
        int32_t byte = signs[k];                                                             \
        for (int32_t j = 0; j < 8; j++) {                                                    \
            int32_t level = (int32_t)LEVELS[8 * k + j] * (1 - 2 * ((byte >> j) & 1));         \
            out[8 * k + j] = (float)((double)level * q);                                     \
        }                                                                                    \
    }                                                                                        \
    for (int64_t i = n / 8 * 8; i < n; i++) {                                               \
        int32_t level = (int32_t)LEVELS[i] * (1 - 2 * ((signs[i >> 3] >> (i & 7)) & 1));      \
        out[i] = (float)((double)level * q);                                                 \
    }

CLONES
void plug_asgd_qsgd_decode(const void *levels, int wide, const uint8_t *signs, int64_t n, double q, float *out) {
    const uint8_t *narrow = (const uint8_t *)levels;
    const uint16_t *words = (const uint16_t *)levels;
    if (wide) {
        QSGD_DECODE(words)
    } else {
        QSGD_DECODE(narrow)
    }
}

/* qsgd's decoding added to the central values c, the sum written to o1 and o2 (a worker's guess of an "own" reply,
   worker/exchange/held_base.py), block by block as the fold below: the same bits as decoding, then
   plug_asgd_add_twice (fold.c); the decoding is never written whole. */
void plug_asgd_add_twice(const float *u, const float *c, float *o1, float *o2, int64_t n);

void plug_asgd_qsgd_add_twice(const void *levels, int wide, const uint8_t *signs, int64_t n, double q,
                              const float *c, float *o1, float *o2) {
    float d[FUSED_BLOCK];
    for (int64_t b = 0; b < n; b += FUSED_BLOCK) {
        int64_t len = n - b < FUSED_BLOCK ? n - b : FUSED_BLOCK;
        plug_asgd_qsgd_decode((const uint8_t *)levels + (wide ? 2 * b : b), wide, signs + b / 8, len, q, d);
        plug_asgd_add_twice(d, c + b, o1 + b, o2 + b, len);
    }
}

/* qsgd's decoding folded (QSGD.fold_packed): whether every value written is finite. */
int plug_asgd_qsgd_add_finite(const void *levels, int wide, const uint8_t *signs, int64_t n, double q,
                              const float *c, float *o, float s) {
    float d[FUSED_BLOCK];
    int finite = 1;
    for (int64_t b = 0; b < n; b += FUSED_BLOCK) {
        int64_t len = n - b < FUSED_BLOCK ? n - b : FUSED_BLOCK;
        const uint8_t *from = (const uint8_t *)levels + (wide ? 2 * b : b);
        plug_asgd_qsgd_decode(from, wide, signs + b / 8, len, q, d);
        finite &= plug_asgd_add_finite(d, c + b, o + b, len, s);
    }
    return finite;
}
