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

/* Row i of the product into row (m values). */
static inline void product_row(const float *pi, const float *qt, int64_t m, int64_t r, float *row) {
    float first = pi[0];
    for (int64_t j = 0; j < m; j++) row[j] = first * qt[j];
    for (int64_t k = 1; k < r; k++) {
        float pk = pi[k];
        const float *qk = qt + k * m;
        for (int64_t j = 0; j < m; j++) row[j] = row[j] + pk * qk[j];
    }
}

CLONES
void plug_asgd_low_rank_product(const float *p, const float *qt, int64_t n, int64_t m, int64_t r, float *out) {
    for (int64_t i = 0; i < n; i++) product_row(p + i * r, qt, m, r, out + i * m);
}

int plug_asgd_add_finite(const float *u, const float *c, float *o, int64_t n, float s);  /* fold.c */

/* The PS's fold of PowerSGD's decoding out of place (PowerSGD.fold_packed): each row of the product made into o,
   then o = row + c (row * s + c where s is not 1) by plug_asgd_add_finite while the row is in L1: the bits of
   decoding, then folding, without a pass over the decoding written whole. Whether every value is finite. */
CLONES
int plug_asgd_low_rank_add_finite(const float *p, const float *qt, int64_t n, int64_t m, int64_t r, const float *c,
                                  float *o, float s) {
    int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        product_row(p + i * r, qt, m, r, o + i * m);
        finite &= plug_asgd_add_finite(o + i * m, c + i * m, o + i * m, m, s);
    }
    return finite;
}
