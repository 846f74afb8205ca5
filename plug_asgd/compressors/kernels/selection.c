#include <math.h>
#include <stdint.h>

/* Compiled twice on x86-64 (AVX2 and the baseline), the loader picking the one the CPU runs. */
#if defined(__x86_64__) && defined(__GNUC__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* Blocks of BLOCK values, made branch-free (vectorised): v = w - c (mode 0), r += s * (w - c) written back
   (mode 1), or r itself (mode 2), the scale s applied only where it is not 1, as numpy's path does. A block
   with a coordinate where !(|v| < t) (NaN included) is then compacted: its index and v appended to idx and
   val while fewer than cap were found. Returns how many were found, which may exceed cap. */
#define BLOCK 16
CLONES
int64_t plug_asgd_above(const float *w, const float *c, float *r, int64_t n, float t, float s, int mode,
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
