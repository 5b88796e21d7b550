/* SiLU-and-multiply of a gated MLP on the CPU (fp32 and bf16): out = silu(gate) * up, read
 * from the fused gate/up projection's output [rows][2 * inter] (gate first) in one pass
 * into a dense [rows][inter], the down projection's input. The exponential is inline
 * arithmetic (within 3 ulp of silu in fp32) and every loop vectorises (-ffast-math); bf16
 * values widen to fp32 on load, and silu(gate) rounds to bf16 before the product, as the
 * eager bf16 ops do. Called through kvmem/engine/models/cpu_ops.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define SAME(x) (x)

/* e^x for x in [-87, 88]: 2^n e^r with n = round(x / ln 2) and r = x - n ln 2 (ln 2 in two
 * parts), e^r by Cephes' polynomial, 2^n put in the exponent bits: it vectorises without
 * a call (with libmvec's expf, silu took 1.5x the time). */
static inline float exp_in_range(float x) {
    const float n = rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Below -88 e^-x overflows (silu is 0 there to fp32's precision); above 87 e^-x is
 * clamped at e^-87, far below 1. */
static inline float silu(float x) {
    return x < -88.0f ? 0.0f : x / (1.0f + exp_in_range(fmaxf(-x, -87.0f)));
}

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
