#include <stdint.h>

/* PowerSGD's decoding (compressors/lowrank.py, low_rank_product): out = P @ Q.T for P [n, r] and Q [m, r], float32,
   each value p[i, 0] * q[j, 0] + p[i, 1] * q[j, 1] + ... added in k's order, every product and sum rounded to
   float32 (compiled without contraction): numpy's path makes the same operations, so both give the same bits, on
   one thread or many. qt is Q transposed ([r, m], the caller's): a row of out is r passes over it in L1. */

#if defined(__x86_64__) && defined(__GNUC__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

CLONES
void plug_asgd_low_rank_product(const float *p, const float *qt, int64_t n, int64_t m, int64_t r, float *out) {
    for (int64_t i = 0; i < n; i++) {
        float *row = out + i * m;
        const float *pi = p + i * r;
        float first = pi[0];
        for (int64_t j = 0; j < m; j++) row[j] = first * qt[j];
        for (int64_t k = 1; k < r; k++) {
            float pk = pi[k];
            const float *qk = qt + k * m;
            for (int64_t j = 0; j < m; j++) row[j] = row[j] + pk * qk[j];
        }
    }
}
