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
