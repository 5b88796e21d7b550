/* Fused elementwise steps of a decoder layer on the CPU (fp32): each reads its inputs and
 * writes its outputs once, where the eager torch ops pass over the activations three to
 * seven times. Built at first use together with the paged decode kernel
 * (kvmem/engine/attention/cpu_kernels.py) and called through kvmem/engine/models/cpu_ops.py.
 *
 * Rotary embedding is the eager path's arithmetic, operation for operation
 * (x * cos + rotate_half(x) * sin, compiled without FMA contraction); the RMSNorm sum of
 * squares is accumulated in double.
 */
#include <math.h>
#include <stdint.h>

/* out[t] = rms_norm(x[t] (+ residual[t])) * weight; with a residual, sum_out[t] = x + res. */
void kvmem_add_rms_norm_f32(const float *x, const float *residual, float *sum_out,
                            float *out, const float *weight, int64_t rows, int64_t size,
                            int64_t x_stride, float eps, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const float *xr = x + t * x_stride;
        float *o = out + t * size;
        const float *src = xr;
        if (residual) {
            const float *rr = residual + t * size;
            float *s = sum_out + t * size;
            for (int64_t i = 0; i < size; ++i) s[i] = xr[i] + rr[i];
            src = s;
        }
        double squares = 0.0;
        for (int64_t i = 0; i < size; ++i) squares += (double)src[i] * src[i];
        const float inv = 1.0f / sqrtf((float)(squares / size) + eps);
        for (int64_t i = 0; i < size; ++i) o[i] = weight[i] * (src[i] * inv);
    }
}

/* Rotate the first `heads` heads of each row in place (the q heads then the k heads of a
 * fused qkv row); cos/sin hold `head_dim` values per row (each half repeated). */
void kvmem_rotary_f32(float *qk, int64_t rows, int64_t row_stride, int heads, int head_dim,
                      const float *cos, const float *sin, int num_threads) {
    const int half = head_dim / 2;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int h = 0; h < heads; ++h) {
            float *x = qk + t * row_stride + (int64_t)h * head_dim;
            for (int i = 0; i < half; ++i) {
                const float a = x[i], b = x[i + half];
                x[i] = a * c[i] + (-b) * s[i];
                x[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}
