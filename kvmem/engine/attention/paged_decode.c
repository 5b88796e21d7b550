/* Paged decode attention on the CPU: one query token per sequence, read straight from
 * the block-major KV cache [num_blocks, 2, block_size, kv_heads, head_dim] (no gather copy).
 *
 * For each (sequence, KV head) the query heads that share the KV head walk the sequence's
 * blocks once with an online softmax; accumulation is fp32. Built at first use by
 * kvmem/engine/attention/cpu_kernels.py with the system C compiler and called via ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16   /* query heads per KV head */
#define MAX_DIM 256    /* head_dim */
#define MAX_BLOCK 128  /* block_size */

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v = { (uint32_t)x << 16 };
    return v.f;
}

/* dot products of G query rows with one key row */
#define DECODE_BODY(LOAD)                                                                    \
    const int64_t heads_dim = (int64_t)num_kv_heads * head_dim;                             \
    const int64_t block_stride = 2 * (int64_t)block_size * heads_dim;                       \
    const int64_t side = (int64_t)block_size * heads_dim; /* K -> V within a block */       \
    const int group = num_heads / num_kv_heads;                                             \
    _Pragma("omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)")      \
    for (int b = 0; b < num_seqs; ++b) {                                                    \
        for (int h = 0; h < num_kv_heads; ++h) {                                            \
            float qv[MAX_GROUP][MAX_DIM];                                                   \
            float acc[MAX_GROUP][MAX_DIM];                                                  \
            float s[MAX_GROUP][MAX_BLOCK];                                                  \
            float m[MAX_GROUP], l[MAX_GROUP];                                               \
            const int64_t row = rows ? rows[b] : b;                                         \
            const int seq_len = seq_lens[b];                                                \
            const int pos = seq_len - 1;                                                    \
            const int first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;    \
            for (int g = 0; g < group; ++g) {                                               \
                const float *src = q + row * q_stride + (int64_t)(h * group + g) * head_dim; \
                for (int d = 0; d < head_dim; ++d) qv[g][d] = src[d] * scale;               \
                memset(acc[g], 0, sizeof(float) * head_dim);                                \
                m[g] = -INFINITY;                                                           \
                l[g] = 0.0f;                                                                \
            }                                                                               \
            for (int j = first / block_size; j * block_size < seq_len; ++j) {               \
                const int64_t blk = block_tables[b * table_stride + j];                     \
                const int64_t base = blk * block_stride + (int64_t)h * head_dim;            \
                const int t0 = j * block_size < first ? first - j * block_size : 0;         \
                const int t1 = seq_len - j * block_size < block_size                        \
                                   ? seq_len - j * block_size : block_size;                 \
                for (int g = 0; g < group; ++g) {                                           \
                    float mx = m[g];                                                        \
                    for (int t = t0; t < t1; ++t) {                                         \
                        const int64_t off = base + (int64_t)t * heads_dim;                  \
                        float dot = 0.0f;                                                   \
                        for (int d = 0; d < head_dim; ++d) dot += qv[g][d] * LOAD(off + d); \
                        s[g][t] = dot;                                                      \
                        mx = dot > mx ? dot : mx;                                           \
                    }                                                                       \
                    const float alpha = expf(m[g] - mx);                                    \
                    l[g] *= alpha;                                                          \
                    for (int d = 0; d < head_dim; ++d) acc[g][d] *= alpha;                  \
                    for (int t = t0; t < t1; ++t) {                                         \
                        const float p = expf(s[g][t] - mx);                                 \
                        const int64_t off = base + side + (int64_t)t * heads_dim;           \
                        l[g] += p;                                                          \
                        for (int d = 0; d < head_dim; ++d) acc[g][d] += p * LOAD(off + d);  \
                    }                                                                       \
                    m[g] = mx;                                                              \
                }                                                                           \
            }                                                                               \
            for (int g = 0; g < group; ++g) {                                               \
                float *dst = out + (int64_t)b * out_stride + (int64_t)(h * group + g) * head_dim; \
                const float inv = 1.0f / l[g];                                              \
                for (int d = 0; d < head_dim; ++d) dst[d] = acc[g][d] * inv;                \
            }                                                                               \
        }                                                                                   \
    }

#define ARGS                                                                                 \
    const float *q, int64_t q_stride, const int64_t *rows, float *out, int64_t out_stride,  \
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,             \
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,            \
    float scale, int window, int num_threads

int kvmem_paged_decode_limits(int group, int head_dim, int block_size) {
    return group <= MAX_GROUP && head_dim <= MAX_DIM && block_size <= MAX_BLOCK;
}

void kvmem_paged_decode_f32(const float *cache, ARGS) {
#define LOAD_F32(i) cache[i]
    DECODE_BODY(LOAD_F32)
}

void kvmem_paged_decode_bf16(const uint16_t *cache, ARGS) {
#define LOAD_BF16(i) bf16_to_f32(cache[i])
    DECODE_BODY(LOAD_BF16)
}
