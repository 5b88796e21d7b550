/* Paged decode attention on the CPU: one query token per sequence, read straight from
 * the block-major KV cache [num_blocks, 2, block_size, kv_heads, head_dim] (no gather copy).
 *
 * Decode is bound by memory traffic, so each sequence walks its blocks once and reads every
 * key row, then every value row, in address order: a token's row holds all KV heads side
 * by side, and all query heads are served from it (an online softmax per query head, fp32
 * accumulation). Reading per KV head instead would stride through each block once per head.
 * Built at first use by kvmem/engine/attention/cpu_kernels.py with the system C compiler
 * and called via ctypes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16   /* query heads per KV head */
#define MAX_DIM 256    /* head_dim */
#define MAX_BLOCK 128  /* block_size */

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v = { (uint32_t)x << 16 };
    return v.f;
}

#define DEFINE_ROW_OPS(SUFFIX, T, LOAD)                                                      \
    static inline float dot_##SUFFIX(const float *q, const T *k, int n) {                  \
        float sum = 0.0f;                                                                  \
        _Pragma("omp simd reduction(+:sum)")                                               \
        for (int d = 0; d < n; ++d) sum += q[d] * LOAD(k[d]);                              \
        return sum;                                                                        \
    }                                                                                      \
    static inline void axpy_##SUFFIX(float *acc, float p, const T *v, int n) {             \
        _Pragma("omp simd")                                                                \
        for (int d = 0; d < n; ++d) acc[d] += p * LOAD(v[d]);                              \
    }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_ROW_OPS(f32, float, LOAD_F32)
DEFINE_ROW_OPS(bf16, uint16_t, LOAD_BF16)

/* Per-sequence scratch: scaled queries, accumulators, running max and sum, block scores. */
typedef struct {
    float *q, *acc, *m, *l, *s;
} Scratch;

static int scratch_alloc(Scratch *w, int num_heads, int head_dim, int block_size) {
    w->q = malloc(sizeof(float) * num_heads * head_dim);
    w->acc = malloc(sizeof(float) * num_heads * head_dim);
    w->m = malloc(sizeof(float) * num_heads);
    w->l = malloc(sizeof(float) * num_heads);
    w->s = malloc(sizeof(float) * num_heads * block_size);
    return w->q && w->acc && w->m && w->l && w->s;
}

static void scratch_free(Scratch *w) {
    free(w->q); free(w->acc); free(w->m); free(w->l); free(w->s);
}

/* One sequence's attention: w.q holds its scaled queries; the result goes to dst. */
#define DEFINE_DECODE_SEQ(SUFFIX, T)                                                         \
    static inline __attribute__((always_inline)) void decode_seq_##SUFFIX(                  \
            const T *cache, const int32_t *table, int seq_len, int window, Scratch w,       \
            float *dst, int num_heads, int num_kv_heads, const int head_dim,               \
            int block_size) {                                                               \
        const int64_t heads_dim = (int64_t)num_kv_heads * head_dim;                         \
        const int64_t side = (int64_t)block_size * heads_dim; /* K -> V in a block */       \
        const int group = num_heads / num_kv_heads;                                         \
        const int pos = seq_len - 1;                                                        \
        const int first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;        \
        memset(w.acc, 0, sizeof(float) * num_heads * head_dim);                             \
        for (int h = 0; h < num_heads; ++h) { w.m[h] = -FLT_MAX; w.l[h] = 0.0f; }           \
        for (int j = first / block_size; j * block_size < seq_len; ++j) {                   \
            const T *keys = cache + (int64_t)table[j] * 2 * side;                           \
            const T *values = keys + side;                                                  \
            const int t0 = j * block_size < first ? first - j * block_size : 0;             \
            const int t1 = seq_len - j * block_size < block_size                            \
                               ? seq_len - j * block_size : block_size;                     \
            for (int t = t0; t < t1; ++t) {                                                 \
                const T *key = keys + t * heads_dim;                                        \
                for (int kh = 0, h = 0; kh < num_kv_heads; ++kh)                            \
                    for (int g = 0; g < group; ++g, ++h)                                    \
                        w.s[h * block_size + t] = dot_##SUFFIX(                             \
                            w.q + h * head_dim, key + kh * head_dim, head_dim);             \
            }                                                                               \
            for (int h = 0; h < num_heads; ++h) {                                           \
                float *s = w.s + h * block_size;                                            \
                float mx = w.m[h];                                                          \
                for (int t = t0; t < t1; ++t) mx = s[t] > mx ? s[t] : mx;                   \
                const float alpha = expf(w.m[h] - mx);                                      \
                float sum = 0.0f;                                                           \
                _Pragma("omp simd reduction(+:sum)")                                        \
                for (int t = t0; t < t1; ++t) { s[t] = expf(s[t] - mx); sum += s[t]; }      \
                w.l[h] = w.l[h] * alpha + sum;                                              \
                w.m[h] = mx;                                                                \
                if (alpha != 1.0f) {                                                        \
                    float *acc = w.acc + h * head_dim;                                      \
                    for (int d = 0; d < head_dim; ++d) acc[d] *= alpha;                     \
                }                                                                           \
            }                                                                               \
            for (int t = t0; t < t1; ++t) {                                                 \
                const T *value = values + t * heads_dim;                                    \
                for (int kh = 0, h = 0; kh < num_kv_heads; ++kh)                            \
                    for (int g = 0; g < group; ++g, ++h)                                    \
                        axpy_##SUFFIX(w.acc + h * head_dim, w.s[h * block_size + t],        \
                                      value + kh * head_dim, head_dim);                     \
            }                                                                               \
        }                                                                                   \
        for (int h = 0; h < num_heads; ++h) {                                               \
            const float inv = 1.0f / w.l[h];                                                \
            for (int d = 0; d < head_dim; ++d)                                              \
                dst[h * head_dim + d] = w.acc[h * head_dim + d] * inv;                      \
        }                                                                                   \
    }

DEFINE_DECODE_SEQ(f32, float)
DEFINE_DECODE_SEQ(bf16, uint16_t)

/* The common head sizes get their own copy of the loop, with head_dim a constant. */
#define DECODE_BODY(SUFFIX)                                                                  \
    int failed = 0;                                                                         \
    _Pragma("omp parallel num_threads(num_threads) reduction(|:failed)")                    \
    {                                                                                       \
    Scratch w;                                                                              \
    const int ok = scratch_alloc(&w, num_heads, head_dim, block_size);                      \
    failed |= !ok;                                                                          \
    _Pragma("omp for schedule(dynamic)")                                                    \
    for (int b = 0; b < num_seqs; ++b) {                                                    \
        if (!ok) continue;                                                                  \
        const float *src = q + (rows ? rows[b] : b) * q_stride;                             \
        for (int i = 0; i < num_heads * head_dim; ++i) w.q[i] = src[i] * scale;             \
        const int32_t *table = block_tables + b * table_stride;                             \
        float *dst = out + (int64_t)b * out_stride;                                         \
        if (head_dim == 64)                                                                 \
            decode_seq_##SUFFIX(cache, table, seq_lens[b], window, w, dst, num_heads,       \
                                num_kv_heads, 64, block_size);                              \
        else if (head_dim == 128)                                                           \
            decode_seq_##SUFFIX(cache, table, seq_lens[b], window, w, dst, num_heads,       \
                                num_kv_heads, 128, block_size);                             \
        else                                                                                \
            decode_seq_##SUFFIX(cache, table, seq_lens[b], window, w, dst, num_heads,       \
                                num_kv_heads, head_dim, block_size);                        \
    }                                                                                       \
    scratch_free(&w);                                                                       \
    }                                                                                       \
    return failed ? -1 : 0;

#define ARGS                                                                                 \
    const float *q, int64_t q_stride, const int64_t *rows, float *out, int64_t out_stride,  \
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,             \
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,            \
    float scale, int window, int num_threads

int kvmem_paged_decode_limits(int group, int head_dim, int block_size) {
    return group <= MAX_GROUP && head_dim <= MAX_DIM && block_size <= MAX_BLOCK;
}

/* Both return 0, or -1 when scratch memory could not be allocated (out is then undefined). */
int kvmem_paged_decode_f32(const float *cache, ARGS) {
    DECODE_BODY(f32)
}

int kvmem_paged_decode_bf16(const uint16_t *cache, ARGS) {
    DECODE_BODY(bf16)
}
