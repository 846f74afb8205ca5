#include <math.h>
#include <stdint.h>

/* On x86-64 the pass has an AVX2 path, taken where the CPU runs AVX2 (plug_asgd_above); the portable loop
   elsewhere, and for the tail. */
#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2_PATH 1
#include <immintrin.h>
#else
#define HAVE_AVX2_PATH 0
#endif

/* Blocks of BLOCK values, made branch-free (vectorised): v = w - c (mode 0), r += s * (w - c) written back
   (mode 1), or r itself (mode 2), the scale s applied only where it is not 1, as numpy's path does. A block
   with a coordinate where !(|v| < t) (NaN included) is then compacted: its index and v appended to idx and
   val while fewer than cap were found. Returns how many were found, which may exceed cap. */
#define BLOCK 16
static int64_t above_blocks(const float *w, const float *c, float *r, int64_t n, float t, float s, int mode,
                            int64_t *idx, float *val, int64_t cap) {
    int64_t m = 0;
    float v[BLOCK];
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t len = n - b < BLOCK ? n - b : BLOCK;
        int hit = 0;
        if (mode == 2) {
            for (int64_t j = 0; j < len; j++) { v[j] = r[b + j]; hit |= !(fabsf(v[j]) < t); }
        } else if (mode == 1 && s != 1.0f) {
            for (int64_t j = 0; j < len; j++) {
                float d = r[b + j] + (w[b + j] - c[b + j]) * s;
                r[b + j] = d; v[j] = d; hit |= !(fabsf(d) < t);
            }
        } else if (mode == 1) {
            for (int64_t j = 0; j < len; j++) {
                float d = r[b + j] + (w[b + j] - c[b + j]);
                r[b + j] = d; v[j] = d; hit |= !(fabsf(d) < t);
            }
        } else if (s != 1.0f) {
            for (int64_t j = 0; j < len; j++) { v[j] = (w[b + j] - c[b + j]) * s; hit |= !(fabsf(v[j]) < t); }
        } else {
            for (int64_t j = 0; j < len; j++) { v[j] = w[b + j] - c[b + j]; hit |= !(fabsf(v[j]) < t); }
        }
        if (!hit) continue;
        if (m + len <= cap) {  /* room for the whole block: written unconditionally, kept where a hit */
            for (int64_t j = 0; j < len; j++) { idx[m] = b + j; val[m] = v[j]; m += !(fabsf(v[j]) < t); }
        } else {
            for (int64_t j = 0; j < len; j++) {
                if (!(fabsf(v[j]) < t)) {
                    if (m < cap) { idx[m] = b + j; val[m] = v[j]; }
                    m++;
                }
            }
        }
    }
    return m;
}

#if HAVE_AVX2_PATH
/* above_blocks with AVX2 intrinsics: 8 values a vector, the same IEEE operations in the same order (a
   subtraction, then the scaling, then the residual's sum; no fused multiply-add), so the same v; the hits of a
   vector come as the bits of its comparison's mask, so only they are visited, where the portable loop walks every
   value of a block with a hit in it. The tail is the portable loop's. */
__attribute__((target("avx2")))
static int64_t above_avx2(const float *w, const float *c, float *r, int64_t n, float t, float s, int mode,
                          int64_t *idx, float *val, int64_t cap) {
    const __m256 sign = _mm256_set1_ps(-0.0f), tv = _mm256_set1_ps(t), sv = _mm256_set1_ps(s);
    const int scaled = s != 1.0f;
    int64_t m = 0, b = 0;
    float v[8];
    for (; b + 8 <= n; b += 8) {
        __m256 d;
        if (mode == 2) {
            d = _mm256_loadu_ps(r + b);
        } else {
            d = _mm256_sub_ps(_mm256_loadu_ps(w + b), _mm256_loadu_ps(c + b));
            if (scaled) d = _mm256_mul_ps(d, sv);
            if (mode == 1) {
                d = _mm256_add_ps(_mm256_loadu_ps(r + b), d);
                _mm256_storeu_ps(r + b, d);
            }
        }
        /* !(|v| < t): not-less-than, unordered (NaN) true */
        unsigned hits = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, d), tv, _CMP_NLT_UQ));
        if (!hits) continue;
        _mm256_storeu_ps(v, d);
        while (hits) {
            int j = __builtin_ctz(hits);
            hits &= hits - 1;
            if (m < cap) { idx[m] = b + j; val[m] = v[j]; }
            m++;
        }
    }
    if (b < n) {
        int64_t more = above_blocks(w ? w + b : w, c ? c + b : c, r ? r + b : r, n - b, t, s, mode,
                                    idx + (m < cap ? m : cap), val + (m < cap ? m : cap), m < cap ? cap - m : 0);
        for (int64_t i = 0; i < more && m + i < cap; i++) idx[m + i] += b;
        m += more;
    }
    return m;
}
#endif

/* The coordinates where !(|v| < t) (NaN included), v = w - c (mode 0), r += s * (w - c) (mode 1, written back)
   or r (mode 2): their ascending indices and v appended to idx and val while fewer than cap were found. Returns
   how many were found, which may exceed cap. */
int64_t plug_asgd_above(const float *w, const float *c, float *r, int64_t n, float t, float s, int mode,
                        int64_t *idx, float *val, int64_t cap) {
#if HAVE_AVX2_PATH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) return above_avx2(w, c, r, n, t, s, mode, idx, val, cap);
#endif
    return above_blocks(w, c, r, n, t, s, mode, idx, val, cap);
}

/* dst[idx[i]] += val[i] for i in [0, k): a sparse update folded in. Unless the indices ascend strictly within
   [0, n), nothing is written and -1 is returned. */
int64_t plug_asgd_scatter_add(float *dst, int64_t n, const int64_t *idx, const float *val, int64_t k) {
    int64_t prev = -1;
    for (int64_t i = 0; i < k; i++) {
        if (idx[i] <= prev || idx[i] >= n) return -1;
        prev = idx[i];
    }
    for (int64_t i = 0; i < k; i++) dst[idx[i]] += val[i];
    return k;
}
