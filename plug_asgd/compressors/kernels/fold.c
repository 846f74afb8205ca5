#include <stdint.h>
#include <string.h>

/* The PS's fold of a dense update out of place (modes/fold.py): o = u + c, or (u * s) + c where s is not 1, the
   float32 operations numpy's two calls make, compiled without contraction; and whether every result is finite
   (no exponent of all ones), checked in the same pass instead of a second one over o. */

#if defined(__x86_64__) && defined(__GNUC__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

CLONES
int plug_asgd_add_finite(const float *u, const float *c, float *o, int64_t n, float s) {
    uint32_t bad = 0;
    if (s != 1.0f) {
        for (int64_t i = 0; i < n; i++) {
            float v = u[i] * s + c[i];
            uint32_t b;
            memcpy(&b, &v, 4);
            o[i] = v;
            bad |= (b & 0x7f800000u) == 0x7f800000u;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float v = u[i] + c[i];
            uint32_t b;
            memcpy(&b, &v, 4);
            o[i] = v;
            bad |= (b & 0x7f800000u) == 0x7f800000u;
        }
    }
    return bad == 0;
}

/* A worker's guess of an "own" reply (worker/exchange/held_base.py, HeldPush.guess_own): v = u + c, the PS's
   float32 addition of the decoded update u to the central values c, written to both o1 (the weights) and o2 (the
   central model held next): one read of u and c where numpy's add and copy read the sum again. */
CLONES
void plug_asgd_add_twice(const float *u, const float *c, float *o1, float *o2, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float v = u[i] + c[i];
        o1[i] = v;
        o2[i] = v;
    }
}
