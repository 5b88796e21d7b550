/* Paged decode attention on the CPU: one query token per sequence, read straight from
 * the block-major KV cache [num_blocks, 2, block_size, kv_heads, head_dim] (no gather copy).
 *
 * Two loops, both walking each sequence's blocks once in address order:
 * - 16 tokens at a time (AVX-512; head_dim 64 or 128, block_size a multiple of 16; 1, 2,
 *   3, 4, 6 or 8 query heads per KV head): a query head's 16 scores come out as one vector
 *   from a transpose-and-add tree instead of one horizontal sum per token, each value row
 *   is read once for all query heads of its KV head with their accumulators in registers,
 *   and the next 16 tokens' key rows are prefetched into L2 while these tokens' scores
 *   compute, their value rows while these tokens' values are summed (blocks are scattered,
 *   so the hardware prefetcher starts cold on each one); the next sequence's first 16
 *   while this sequence runs.
 * - token by token (any other shape, or no AVX-512): each key row, then each value row,
 *   serves all query heads.
 * Both keep an online softmax per query head with fp32 accumulation (the 16-token loop in
 * base 2, on exp2.h's polynomial). Sequences that start with the same block (a shared
 * cached prefix) run one after another, so the prefix's rows are still in the core's cache
 * for the next one. Built at first use by kvmem/engine/attention/cpu_kernels.py with the
 * system C compiler and called via ctypes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../models/bf16.h"
#include "aligned.h"

#define MAX_GROUP 16   /* query heads per KV head */
#define MAX_DIM 256    /* head_dim */
#define MAX_BLOCK 128  /* block_size */


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
#define LOAD_BF16(x) bf16_widen(x)
DEFINE_ROW_OPS(f32, float, LOAD_F32)
DEFINE_ROW_OPS(bf16, uint16_t, LOAD_BF16)

/* Per-sequence scratch: scaled queries, accumulators, running max and sum, block scores. */
typedef struct {
    float *q, *acc, *m, *l, *s;
} Scratch;

static int scratch_alloc(Scratch *w, int num_heads, int head_dim, int block_size) {
    w->q = aligned_scratch(sizeof(float) * num_heads * head_dim);
    w->acc = aligned_scratch(sizeof(float) * num_heads * head_dim);
    w->m = aligned_scratch(sizeof(float) * num_heads);
    w->l = aligned_scratch(sizeof(float) * num_heads);
    w->s = aligned_scratch(sizeof(float) * num_heads * block_size);
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

typedef void (*fast_fn_f32)(const float *, const int32_t *, int, int, Scratch, float *, int, int);
typedef void (*fast_fn_bf16)(const uint16_t *, const int32_t *, int, int, Scratch, float *, int,
                             int);

#if defined(__AVX512F__)
#include <immintrin.h>

#include "exp2.h"
#include "sum16.h"

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}

/* One sequence, 16 tokens at a time. A query head's 16 scores come out as one vector (no
 * horizontal sum per token), and each value row is read once for the G query heads of its
 * KV head, their accumulators in registers (kept in w.acc between chunks). Needs
 * block_size % 16 == 0; rows past the sequence's end inside its last block are read for
 * the scores but masked out. */
#define DEFINE_FAST_SEQ(SUFFIX, T, D, G)                                                     \
    static void fast_seq_##SUFFIX##_##D##_##G(                                              \
            const T *cache, const int32_t *table, int seq_len, int window, Scratch w,       \
            float *dst, int num_kv_heads, int block_size) {                                 \
        enum { C = D / 16 };                                                                \
        const int64_t heads_dim = (int64_t)num_kv_heads * D;                                \
        const int64_t side = (int64_t)block_size * heads_dim;                               \
        const int pos = seq_len - 1;                                                        \
        const int first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;        \
        const int num_heads = num_kv_heads * G;                                             \
        memset(w.acc, 0, sizeof(float) * num_heads * D);                                    \
        for (int h = 0; h < num_heads; ++h) { w.m[h] = -FLT_MAX; w.l[h] = 0.0f; }           \
        for (int base = first / 16 * 16; base < seq_len; base += 16) {                      \
            const T *keys = cache + (int64_t)table[base / block_size] * 2 * side            \
                            + (int64_t)(base % block_size) * heads_dim;                     \
            const T *values = keys + side;                                                  \
            const int lo = first > base ? first - base : 0;                                 \
            const int hi = seq_len - base < 16 ? seq_len - base : 16;                       \
            const __mmask16 valid = (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));      \
            /* the next chunk's key rows are fetched while this one's scores compute, and */ \
            /* its value rows while this one's values are summed (blocks are scattered, so */ \
            /* the hardware prefetcher starts cold on each one). Into L2, not L1: on a Zen */ \
            /* 4 core an L1 prefetch waits for one of the few L1 miss buffers. fp32 decode */ \
            /* read 9.1 GB/s with L1 hints, 13.6 with L2, 15.7 with the two spread apart */   \
            const char *next_k = base + 16 < seq_len ? (const char *)(cache                  \
                + (int64_t)table[(base + 16) / block_size] * 2 * side                       \
                + (int64_t)((base + 16) % block_size) * heads_dim) : 0;                     \
            const char *next_v = next_k + side * (int64_t)sizeof(T);                        \
            const int64_t chunk_bytes = 16 * heads_dim * (int64_t)sizeof(T);                \
            const int lines_per_row = (int)((chunk_bytes / 64 + num_heads * 16 - 1)         \
                                            / (num_heads * 16));                            \
            int64_t fetched = 0;                                                            \
            const int v_lines_per_row = (int)((chunk_bytes / 64 + num_kv_heads * 16 - 1)    \
                                              / (num_kv_heads * 16));                       \
            int64_t v_fetched = 0;                                                          \
            for (int kh = 0; kh < num_kv_heads; ++kh) {                                     \
                float p[G][16] __attribute__((aligned(64)));                                \
                float alpha[G];                                                             \
                for (int g = 0; g < G; ++g) {                                               \
                    const int h = kh * G + g;                                               \
                    const float *q = w.q + h * D;                                           \
                    __m512 part[16];                                                        \
                    for (int t = 0; t < 16; ++t) {                                          \
                        const T *k = keys + t * heads_dim + kh * D;                         \
                        for (int i = 0; next_k && i < lines_per_row                         \
                                        && fetched < chunk_bytes; ++i, fetched += 64) {     \
                            _mm_prefetch(next_k + fetched, _MM_HINT_T1);                    \
                        }                                                                   \
                        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(q), load16_##SUFFIX(k));   \
                        for (int c = 1; c < C; ++c)                                         \
                            x = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c),                \
                                                load16_##SUFFIX(k + 16 * c), x);            \
                        part[t] = x;                                                        \
                    }                                                                       \
                    const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-FLT_MAX),  \
                                                          sum16(part));                     \
                    const float top = _mm512_reduce_max_ps(s);                              \
                    const float mx = top > w.m[h] ? top : w.m[h];                           \
                    alpha[g] = _mm512_cvtss_f32(exp2_ps(_mm512_set1_ps(w.m[h] - mx)));      \
                    const __m512 e = _mm512_maskz_mov_ps(                                   \
                        valid, exp2_ps(_mm512_sub_ps(s, _mm512_set1_ps(mx))));              \
                    _mm512_store_ps(p[g], e);                                               \
                    w.l[h] = w.l[h] * alpha[g] + _mm512_reduce_add_ps(e);                   \
                    w.m[h] = mx;                                                            \
                }                                                                           \
                __m512 acc[G][C];                                                           \
                for (int g = 0; g < G; ++g)                                                 \
                    for (int c = 0; c < C; ++c)                                             \
                        acc[g][c] = _mm512_mul_ps(                                          \
                            _mm512_loadu_ps(w.acc + (kh * G + g) * D + 16 * c),             \
                            _mm512_set1_ps(alpha[g]));                                      \
                for (int t = lo; t < hi; ++t) {                                             \
                    const T *v = values + t * heads_dim + kh * D;                           \
                    for (int i = 0; next_k && i < v_lines_per_row                           \
                                    && v_fetched < chunk_bytes; ++i, v_fetched += 64)       \
                        _mm_prefetch(next_v + v_fetched, _MM_HINT_T1);                      \
                    for (int c = 0; c < C; ++c) {                                           \
                        const __m512 x = load16_##SUFFIX(v + 16 * c);                       \
                        for (int g = 0; g < G; ++g)                                         \
                            acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][t]), x,         \
                                                        acc[g][c]);                         \
                    }                                                                       \
                }                                                                           \
                for (int g = 0; g < G; ++g)                                                 \
                    for (int c = 0; c < C; ++c)                                             \
                        _mm512_storeu_ps(w.acc + (kh * G + g) * D + 16 * c, acc[g][c]);     \
            }                                                                               \
        }                                                                                   \
        for (int h = 0; h < num_heads; ++h) {                                               \
            const float inv = 1.0f / w.l[h];                                                \
            for (int d = 0; d < D; ++d) dst[h * D + d] = w.acc[h * D + d] * inv;            \
        }                                                                                   \
    }

#define DEFINE_FAST_GROUPS(SUFFIX, T, D)                                                     \
    DEFINE_FAST_SEQ(SUFFIX, T, D, 1) DEFINE_FAST_SEQ(SUFFIX, T, D, 2)                        \
    DEFINE_FAST_SEQ(SUFFIX, T, D, 3) DEFINE_FAST_SEQ(SUFFIX, T, D, 4)                        \
    DEFINE_FAST_SEQ(SUFFIX, T, D, 6) DEFINE_FAST_SEQ(SUFFIX, T, D, 8)
DEFINE_FAST_GROUPS(f32, float, 64)
DEFINE_FAST_GROUPS(f32, float, 128)
DEFINE_FAST_GROUPS(bf16, uint16_t, 64)
DEFINE_FAST_GROUPS(bf16, uint16_t, 128)

#define FAST_ROW(SUFFIX, D)                                                                  \
    {fast_seq_##SUFFIX##_##D##_1, fast_seq_##SUFFIX##_##D##_2, fast_seq_##SUFFIX##_##D##_3,  \
     fast_seq_##SUFFIX##_##D##_4, 0, fast_seq_##SUFFIX##_##D##_6, 0,                          \
     fast_seq_##SUFFIX##_##D##_8}
static const fast_fn_f32 FAST_f32[2][8] = {FAST_ROW(f32, 64), FAST_ROW(f32, 128)};
static const fast_fn_bf16 FAST_bf16[2][8] = {FAST_ROW(bf16, 64), FAST_ROW(bf16, 128)};
/* the 16-token kernel where it applies, else NULL (the loop above) */
#define FAST_KERNEL(SUFFIX, head_dim, group, block_size)                                     \
    (block_size % 16 == 0 && (head_dim == 64 || head_dim == 128) && group <= 8               \
         ? FAST_##SUFFIX[head_dim == 128][group - 1] : 0)
#else
#define FAST_KERNEL(SUFFIX, head_dim, group, block_size) 0
#endif

/* Sequences that start with the same block (a shared, cached prefix) run one after
 * another, so the prefix's rows are still in the core's cache for the next one; their
 * outputs go where they would have gone. NULL (natural order) if memory is short. */
typedef struct { int32_t first_block, seq; } SeqKey;

static int by_first_block(const void *x, const void *y) {
    const SeqKey *a = x, *b = y;
    if (a->first_block != b->first_block) return a->first_block < b->first_block ? -1 : 1;
    return a->seq - b->seq;
}

static SeqKey *prefix_order(const int32_t *block_tables, int64_t table_stride, int num_seqs) {
    SeqKey *order = malloc(sizeof(SeqKey) * (num_seqs > 0 ? num_seqs : 1));
    if (!order) return NULL;
    for (int b = 0; b < num_seqs; ++b) {
        order[b].first_block = block_tables[b * table_stride];
        order[b].seq = b;
    }
    qsort(order, num_seqs, sizeof(SeqKey), by_first_block);
    return order;
}

/* The first 16 tokens' key and value rows of sequence b into L2 (a no-op hint), fetched
 * while the sequence before it runs: the in-loop prefetch only reaches a sequence's
 * second chunk onwards. */
static inline void prefetch_first_chunk(const void *cache, const int32_t *block_tables,
                                        int64_t table_stride, int b, int num_kv_heads,
                                        int head_dim, int block_size, size_t elem) {
    const int64_t rows = (int64_t)num_kv_heads * head_dim * elem;
    const char *keys = (const char *)cache + block_tables[b * table_stride] * 2 * block_size * rows;
    const int64_t bytes = (block_size < 16 ? block_size : 16) * rows;
    for (int64_t f = 0; f < bytes; f += 64) {
        __builtin_prefetch(keys + f, 0, 2);
        __builtin_prefetch(keys + block_size * rows + f, 0, 2);
    }
}

/* The common head sizes get their own copy of the loop, with head_dim a constant. */
#define DECODE_BODY(SUFFIX)                                                             \
    int failed = 0;                                                                     \
    SeqKey *order = prefix_order(block_tables, table_stride, num_seqs);                 \
    _Pragma("omp parallel num_threads(num_threads) reduction(|:failed)")                \
    {                                                                                   \
    Scratch w;                                                                          \
    const int ok = scratch_alloc(&w, num_heads, head_dim, block_size);                  \
    failed |= !ok;                                                                      \
    const fast_fn_##SUFFIX fast =                                                       \
        FAST_KERNEL(SUFFIX, head_dim, num_heads / num_kv_heads, block_size);            \
    /* the 16-token loop's softmax is in base 2 */                                      \
    const float q_scale = fast ? scale * 1.44269504088896341f : scale;                  \
    _Pragma("omp for schedule(dynamic)")                                                \
    for (int i = 0; i < num_seqs; ++i) {                                                \
        if (!ok) continue;                                                              \
        const int b = order ? order[i].seq : i;                                         \
        const float *src = q + (rows ? rows[b] : b) * q_stride;                         \
        for (int j = 0; j < num_heads * head_dim; ++j) w.q[j] = src[j] * q_scale;       \
        const int32_t *table = block_tables + b * table_stride;                         \
        if (i + 1 < num_seqs)                                                           \
            prefetch_first_chunk(cache, block_tables, table_stride,                     \
                                 order ? order[i + 1].seq : i + 1, num_kv_heads,        \
                                 head_dim, block_size, sizeof(*cache));                 \
        float *dst = out + (int64_t)b * out_stride;                                     \
        if (fast)                                                                       \
            fast(cache, table, seq_lens[b], window, w, dst, num_kv_heads, block_size);  \
        else if (head_dim == 64)                                                        \
            decode_seq_##SUFFIX(cache, table, seq_lens[b], window, w, dst, num_heads,   \
                                num_kv_heads, 64, block_size);                          \
        else if (head_dim == 128)                                                       \
            decode_seq_##SUFFIX(cache, table, seq_lens[b], window, w, dst, num_heads,   \
                                num_kv_heads, 128, block_size);                         \
        else                                                                            \
            decode_seq_##SUFFIX(cache, table, seq_lens[b], window, w, dst, num_heads,   \
                                num_kv_heads, head_dim, block_size);                    \
    }                                                                                   \
    scratch_free(&w);                                                                   \
    }                                                                                   \
    free(order);                                                                        \
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
