/* Fused elementwise steps of a decoder layer on the CPU (fp32 and bf16): each reads its
 * inputs and writes its outputs once, where the eager torch ops pass over the activations
 * three to seven times. Built at first use together with the paged decode kernel
 * (kvmem/engine/attention/cpu_kernels.py) and called through kvmem/engine/models/cpu_ops.py.
 *
 * Rotary embedding is the eager path's arithmetic, operation for operation
 * (x * cos + rotate_half(x) * sin, compiled without FMA contraction); the RMSNorm sum of
 * squares is accumulated in double. Each kernel is written once for both dtypes: values
 * widen to fp32 on load and round back to the storage type wherever an eager op would
 * round its result (a no-op in fp32), so bf16 agrees with the eager bf16 ops bit for bit
 * up to the norm's sum of squares.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define SAME(x) (x)

/* out[t] = rms_norm(x[t] (+ residual[t])) * weight; with a residual, sum_out[t] = x + res.
 * The normalised row rounds before the weight multiplies it (as HuggingFace's RMSNorm). */
#define DEFINE_ADD_RMS_NORM(suffix, T, WIDEN, ROUND)                                          \
void kvmem_add_rms_norm_##suffix(const T *x, const T *residual, T *sum_out, T *out,           \
                                 const T *weight, int64_t rows, int64_t size,                 \
                                 int64_t x_stride, float eps, int num_threads) {              \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                     \
    for (int64_t t = 0; t < rows; ++t) {                                                      \
        const T *xr = x + t * x_stride;                                                       \
        T *o = out + t * size;                                                                \
        const T *src = xr;                                                                    \
        if (residual) {                                                                       \
            const T *rr = residual + t * size;                                                \
            T *s = sum_out + t * size;                                                        \
            for (int64_t i = 0; i < size; ++i) s[i] = ROUND(WIDEN(xr[i]) + WIDEN(rr[i]));     \
            src = s;                                                                          \
        }                                                                                     \
        double squares = 0.0;                                                                 \
        for (int64_t i = 0; i < size; ++i) {                                                  \
            const float v = WIDEN(src[i]);                                                    \
            squares += (double)v * v;                                                         \
        }                                                                                     \
        const float inv = 1.0f / sqrtf((float)(squares / size) + eps);                       \
        for (int64_t i = 0; i < size; ++i)                                                    \
            o[i] = ROUND(WIDEN(weight[i]) * WIDEN(ROUND(WIDEN(src[i]) * inv)));               \
    }                                                                                         \
}

/* Rotate the first `heads` heads of each row in place (the q heads then the k heads of a
 * fused qkv row); cos/sin hold `head_dim` values per row (each half repeated). */
#define DEFINE_ROTARY(suffix, T, WIDEN, ROUND)                                                \
void kvmem_rotary_##suffix(T *qk, int64_t rows, int64_t row_stride, int heads, int head_dim,  \
                           const T *cos, const T *sin, int num_threads) {                     \
    const int half = head_dim / 2;                                                            \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                     \
    for (int64_t t = 0; t < rows; ++t) {                                                      \
        const T *c = cos + t * head_dim, *s = sin + t * head_dim;                             \
        for (int h = 0; h < heads; ++h) {                                                     \
            T *x = qk + t * row_stride + (int64_t)h * head_dim;                               \
            for (int i = 0; i < half; ++i) {                                                  \
                const float a = WIDEN(x[i]), b = WIDEN(x[i + half]);                          \
                x[i] = ROUND(WIDEN(ROUND(a * WIDEN(c[i])))                                    \
                             + WIDEN(ROUND(-b * WIDEN(s[i]))));                               \
                x[i + half] = ROUND(WIDEN(ROUND(b * WIDEN(c[i + half])))                      \
                                    + WIDEN(ROUND(a * WIDEN(s[i + half]))));                  \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}

DEFINE_ADD_RMS_NORM(f32, float, SAME, SAME)
DEFINE_ADD_RMS_NORM(bf16, uint16_t, bf16_widen, bf16_round)
DEFINE_ROTARY(f32, float, SAME, SAME)
DEFINE_ROTARY(bf16, uint16_t, bf16_widen, bf16_round)
