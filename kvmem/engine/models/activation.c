/* SiLU-and-multiply of a gated MLP on the CPU (fp32 and bf16): out = silu(gate) * up, read
 * from the fused gate/up projection's output [rows][2 * inter] (gate first) in one pass
 * into a dense [rows][inter], the down projection's input. Compiled with -ffast-math so the
 * exponential vectorises (glibc's libmvec); bf16 values widen to fp32 on load, and
 * silu(gate) rounds to bf16 before the product, as the eager bf16 ops do. Called through
 * kvmem/engine/models/cpu_ops.py.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define SAME(x) (x)

/* Below -88 expf(-x) overflows, and the fast reciprocal of infinity is NaN, not 0. */
static inline float silu(float x) { return x < -88.0f ? 0.0f : x / (1.0f + expf(-x)); }

#define DEFINE_SILU_MUL(suffix, T, WIDEN, ROUND)                                              \
void kvmem_silu_mul_##suffix(const T *gate_up, int64_t rows, int64_t inter, int64_t stride,   \
                             T *out, int num_threads) {                                       \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                     \
    for (int64_t t = 0; t < rows; ++t) {                                                      \
        const T *g = gate_up + t * stride, *u = g + inter;                                    \
        T *o = out + t * inter;                                                               \
        for (int64_t i = 0; i < inter; ++i)                                                   \
            o[i] = ROUND(WIDEN(ROUND(silu(WIDEN(g[i])))) * WIDEN(u[i]));                      \
    }                                                                                         \
}

DEFINE_SILU_MUL(f32, float, SAME, SAME)
DEFINE_SILU_MUL(bf16, uint16_t, bf16_widen, bf16_round)
