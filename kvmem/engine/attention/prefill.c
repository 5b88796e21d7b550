/* Causal prefill attention on the CPU, read from the paged KV cache: each chunk of new
 * tokens attends over its sequence's cached context and itself (this step's keys and values
 * are stored before attention runs), under an optional sliding window.
 *
 * A chunk's keys are first copied per KV head into a [head_dim][keys] copy and its values
 * into [keys][head_dim], in cache-line-aligned scratch. The query rows of all query heads
 * that share a KV head are taken position by position (row = position * group + head),
 * ROWS at a time, and walk the keys they may see in tiles of 32 with an online softmax,
 * everything in registers: the scores of ROWS rows x 32 keys (an outer-product
 * micro-kernel: a key tile is two vectors per dimension), then the value rows, each read
 * once for all ROWS rows. Keys past a row's position (or before its window) are masked in
 * the tiles that cross those edges, and tiles no row may see are not read, so causal
 * attention costs half of full attention (softmax in base 2, exp2.h).
 *
 * fp32 caches run on fp32 FMAs. bf16 caches run on the CPU's bf16 dot products where it
 * has them (AVX-512 BF16: pairs of dimensions for the scores, pairs of keys for the values,
 * the probabilities rounded to bf16 for that product as PyTorch's flash attention does),
 * else widened to fp32 once, in the copy. Output fp32; head_dim 64 or 128, AVX-512 only
 * (elsewhere the caller keeps PyTorch's SDPA). Built at first use by
 * kvmem/engine/attention/cpu_kernels.py.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../models/bf16.h"
#include "aligned.h"

#define TILE 32

#if defined(__AVX512F__)
#include <immintrin.h>

#include "exp2.h"

static inline float scalar_f32(const float *p) { return *p; }

static inline float scalar_bf16(const uint16_t *p) { return bf16_widen(*p); }

/* The scores of ROWS rows x one tile of 32 keys into s[r][0..1], fp32: the query rows
 * qs[r] (fp32, scaled) against the key copy kt (fp32 [D][kstride]). */
#define SCORES_F32(D, ROWS)                                                                 \
    const float *kd = kt + k0;                                                              \
    for (int d = 0; d < D; ++d, kd += kstride) {                                            \
        const __m512 k_lo = _mm512_loadu_ps(kd), k_hi = _mm512_loadu_ps(kd + 16);           \
        for (int r = 0; r < ROWS; ++r) {                                                    \
            const __m512 b = _mm512_set1_ps(qs[r][d]);                                      \
            s[r][0] = _mm512_fmadd_ps(b, k_lo, s[r][0]);                                    \
            s[r][1] = _mm512_fmadd_ps(b, k_hi, s[r][1]);                                    \
        }                                                                                   \
    }

/* acc[r] += the tile's probabilities p[r] times its value rows (fp32 [keys][D]). */
#define VALUES_F32(D, ROWS)                                                                 \
    float pf[ROWS][TILE];                                                                   \
    for (int r = 0; r < ROWS; ++r) {                                                        \
        _mm512_storeu_ps(pf[r], p[r][0]);                                                   \
        _mm512_storeu_ps(pf[r] + 16, p[r][1]);                                              \
    }                                                                                       \
    const float *vj = vc + k0 * D;                                                          \
    for (int j = 0; j < n; ++j, vj += D) {                                                  \
        __m512 vv[VD];                                                                      \
        for (int c = 0; c < VD; ++c) vv[c] = _mm512_loadu_ps(vj + 16 * c);                  \
        for (int r = 0; r < ROWS; ++r) {                                                    \
            const __m512 b = _mm512_set1_ps(pf[r][j]);                                      \
            for (int c = 0; c < VD; ++c) acc[r][c] = _mm512_fmadd_ps(b, vv[c], acc[r][c]);  \
        }                                                                                   \
    }

#if defined(__AVX512BF16__)
/* The bf16 forms, on the CPU's bf16 dot products (two products a lane, fp32 sums): query
 * rows qs[r] hold unscaled bf16 pairs (dims 2i, 2i+1), the key copy kt pairs [D/2][kstride]
 * (the scale multiplies the scores after); value rows are pairs of keys [keys/2][D], and
 * the probabilities round to bf16 for their product (their sum stays fp32), as PyTorch's
 * flash attention does for bf16. */
#define SCORES_BF16(D, ROWS)                                                                \
    const uint32_t *kd = kt + k0;                                                           \
    for (int d = 0; d < D / 2; ++d, kd += kstride) {                                        \
        const __m512bh k_lo = (__m512bh)_mm512_loadu_si512(kd);                             \
        const __m512bh k_hi = (__m512bh)_mm512_loadu_si512(kd + 16);                        \
        for (int r = 0; r < ROWS; ++r) {                                                    \
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)qs[r][d]);                  \
            s[r][0] = _mm512_dpbf16_ps(s[r][0], b, k_lo);                                   \
            s[r][1] = _mm512_dpbf16_ps(s[r][1], b, k_hi);                                   \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < ROWS; ++r) {                                                        \
        s[r][0] = _mm512_mul_ps(s[r][0], _mm512_set1_ps(scale));                            \
        s[r][1] = _mm512_mul_ps(s[r][1], _mm512_set1_ps(scale));                            \
    }

#define VALUES_BF16(D, ROWS)                                                                \
    uint32_t pb[ROWS][TILE / 2];                                                            \
    for (int r = 0; r < ROWS; ++r)                                                          \
        _mm512_storeu_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(p[r][1], p[r][0]));         \
    const uint32_t *vj = vc + k0 / 2 * D;                                                   \
    for (int j = 0; j < (n + 1) / 2; ++j, vj += D) {                                        \
        __m512bh vv[VD];                                                                    \
        for (int c = 0; c < VD; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vj + 16 * c);     \
        for (int r = 0; r < ROWS; ++r) {                                                    \
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pb[r][j]);                  \
            for (int c = 0; c < VD; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], b, vv[c]); \
        }                                                                                   \
    }
#endif

/* One set of up to ROWS query rows (row = position * group + head, positions counted from
 * the chunk's first query) of one KV head, against the keys each row may see: per tile of
 * keys the scores (SCORES), the online softmax, then the values (VALUES). Q is the type
 * of the query and key copies' elements, V the value copy's, QD a query row's length. */
#define DEFINE_ROWS(NAME, D, ROWS, Q, V, QD, SCORES, VALUES)                               \
static void NAME(const Q *qs_all, const Q *kt, int64_t kstride, const V *vc, float *out,    \
                 int64_t out_stride, int64_t first_row, int64_t num_rows, int group,        \
                 int kv_head, int64_t context, int64_t window, float scale) {               \
    enum { VD = D / 16 };                                                                   \
    (void)scale;                                                                            \
    const Q *qs[ROWS];                                                                      \
    int64_t pos[ROWS], local[ROWS];                                                         \
    int head[ROWS];                                                                         \
    for (int r = 0; r < ROWS; ++r) {                                                        \
        const int64_t row = first_row + (r < num_rows ? r : num_rows - 1);                  \
        local[r] = row / group;                                                             \
        pos[r] = context + local[r];                                                        \
        head[r] = kv_head * group + (int)(row % group);                                     \
        qs[r] = qs_all + row * (QD);                                                        \
    }                                                                                       \
    const int64_t num_keys = pos[ROWS - 1] + 1;                                             \
    /* the window's lower edge: key > pos - window */                                       \
    const int64_t lowest = window > 0 && pos[0] - window + 1 > 0 ? pos[0] - window + 1 : 0; \
    __m512 acc[ROWS][VD], lsum[ROWS];                                                       \
    float m[ROWS];                                                                          \
    for (int r = 0; r < ROWS; ++r) {                                                        \
        for (int c = 0; c < VD; ++c) acc[r][c] = _mm512_setzero_ps();                       \
        lsum[r] = _mm512_setzero_ps();                                                      \
        m[r] = -FLT_MAX;                                                                    \
    }                                                                                       \
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,  \
                                          1, 0);                                            \
    const __m512i lane_hi = _mm512_add_epi32(lane, _mm512_set1_epi32(16));                  \
    for (int64_t k0 = lowest / TILE * TILE; k0 < num_keys; k0 += TILE) {                    \
        __m512 s[ROWS][2], p[ROWS][2];                                                      \
        for (int r = 0; r < ROWS; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();             \
        SCORES(D, ROWS)                                                                     \
        const int edge = k0 + TILE > pos[0] + 1                                             \
                         || (window > 0 && k0 <= pos[ROWS - 1] - window);                   \
        for (int r = 0; r < ROWS; ++r) {                                                    \
            __mmask16 keep[2] = {0xFFFF, 0xFFFF};                                           \
            if (edge) {                                                                     \
                const __m512i hi = _mm512_set1_epi32((int)(pos[r] - k0));                   \
                const __m512i lo = _mm512_set1_epi32(                                       \
                    window > 0 ? (int)(pos[r] - window + 1 - k0) : INT32_MIN);              \
                keep[0] = _mm512_cmple_epi32_mask(lane, hi)                                 \
                          & _mm512_cmpge_epi32_mask(lane, lo);                              \
                keep[1] = _mm512_cmple_epi32_mask(lane_hi, hi)                              \
                          & _mm512_cmpge_epi32_mask(lane_hi, lo);                           \
                s[r][0] = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), keep[0], s[r][0]);   \
                s[r][1] = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), keep[1], s[r][1]);   \
            }                                                                               \
            const float top = _mm512_reduce_max_ps(_mm512_max_ps(s[r][0], s[r][1]));       \
            if (top > m[r]) {                                                               \
                const __m512 alpha = _mm512_set1_ps(                                        \
                    _mm512_cvtss_f32(exp2_ps(_mm512_set1_ps(m[r] - top))));                 \
                for (int c = 0; c < VD; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], alpha);   \
                lsum[r] = _mm512_mul_ps(lsum[r], alpha);                                    \
                m[r] = top;                                                                 \
            }                                                                               \
            const __m512 mx = _mm512_set1_ps(m[r]);                                         \
            p[r][0] = _mm512_maskz_mov_ps(keep[0], exp2_ps(_mm512_sub_ps(s[r][0], mx)));    \
            p[r][1] = _mm512_maskz_mov_ps(keep[1], exp2_ps(_mm512_sub_ps(s[r][1], mx)));    \
            lsum[r] = _mm512_add_ps(lsum[r], _mm512_add_ps(p[r][0], p[r][1]));              \
        }                                                                                   \
        const int64_t n = num_keys - k0 < TILE ? num_keys - k0 : TILE;                      \
        VALUES(D, ROWS)                                                                     \
    }                                                                                       \
    for (int r = 0; r < ROWS && r < num_rows; ++r) {                                        \
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(lsum[r]));            \
        float *o = out + local[r] * out_stride + (int64_t)head[r] * D;                      \
        for (int c = 0; c < VD; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[r][c], inv)); \
    }                                                                                       \
}

DEFINE_ROWS(rows_f32_64, 64, 4, float, float, 64, SCORES_F32, VALUES_F32)
DEFINE_ROWS(rows_f32_128, 128, 2, float, float, 128, SCORES_F32, VALUES_F32)
#if defined(__AVX512BF16__)
DEFINE_ROWS(rows_bf16_64, 64, 4, uint32_t, uint32_t, 32, SCORES_BF16, VALUES_BF16)
DEFINE_ROWS(rows_bf16_128, 128, 2, uint32_t, uint32_t, 64, SCORES_BF16, VALUES_BF16)
#endif

/* How a chunk's keys, values and queries are copied for the row kernels. fp32 (from
 * fp32, or bf16 widened): keys [D][kstride], values [keys][D], queries [row][D] scaled.
 * Pairs (bf16 on the dot-product kernels): keys [D/2][kstride] and values [keys/2][D] as
 * 32-bit pairs of bf16 (dims 2i, 2i+1 of a key; keys 2j, 2j+1 of a dim), queries [row][D/2]
 * unscaled. */
#define COPY_KEY_F32(SCALAR)                                                                \
    for (int d = 0; d < head_dim; ++d) kdst[d * kstride] = SCALAR(key + d);
#define COPY_VALUE_F32(SCALAR)                                                              \
    float *vdst = vc + h * v_per_head + t * head_dim;                                       \
    for (int d = 0; d < head_dim; ++d) vdst[d] = SCALAR(value + d);
#define COPY_QUERY_F32(SCALAR)                                                              \
    for (int d = 0; d < head_dim; ++d) dst[d] = SCALAR(src + d) * scale;
#define COPY_KEY_PAIRS(SCALAR)                                                              \
    for (int d = 0; d < head_dim / 2; ++d) kdst[d * kstride] = ((const uint32_t *)key)[d];
#define COPY_VALUE_PAIRS(SCALAR)                                                            \
    uint16_t *vdst = (uint16_t *)(vc + h * v_per_head + t / 2 * head_dim) + (t & 1);        \
    for (int d = 0; d < head_dim; ++d) vdst[2 * d] = value[d];
#define COPY_QUERY_PAIRS(SCALAR)                                                            \
    for (int d = 0; d < head_dim / 2; ++d) dst[d] = ((const uint32_t *)src)[d];

/* One chunk: per KV head its keys, values and query rows (row = position * group + head
 * within the KV head) copied from the cache's blocks in the layout of E (elements of
 * E_DIMS dims each), then the row kernels over sets of rows. Keys are zero-padded to whole
 * tiles (the last tile reads past the sequence, masked), values to whole pairs. */
#define DEFINE_CHUNK(NAME, T, SCALAR, E, E_DIMS, LAYOUT, ROWS_64, ROWS_128)                \
static int NAME(const T *q, int64_t q_stride, int64_t q_len, const T *cache,                \
                const int32_t *table, int64_t block_stride, int64_t side_stride,            \
                int64_t token_stride, int block_size, int64_t seq_len, float *out,          \
                int64_t out_stride, int num_heads, int num_kv_heads, int head_dim,          \
                float scale, int64_t window, int num_threads) {                             \
    const int group = num_heads / num_kv_heads;                                             \
    const int rows_per_set = head_dim == 64 ? 4 : 2;                                        \
    const int64_t padded = (seq_len + TILE - 1) / TILE * TILE;                              \
    /* a key copy row is a cache line longer than the keys: at a power-of-two stride the */ \
    /* rows of a tile fall in a few L1 sets and evict each other */                         \
    const int64_t kstride = padded + 16;                                                    \
    const int64_t dims = head_dim / (E_DIMS);  /* elements of a key or query row */        \
    const int64_t per_head = dims * kstride, v_per_head = padded / (E_DIMS) * head_dim;     \
    const int64_t rows = q_len * group;                                                     \
    E *kt = aligned_scratch(sizeof(E) * (size_t)(num_kv_heads * (per_head + v_per_head)     \
                                                 + num_heads * q_len * dims));              \
    if (!kt) return 1;                                                                      \
    E *vc = kt + num_kv_heads * per_head, *qs = vc + num_kv_heads * v_per_head;             \
    for (int64_t col = 0; col < num_kv_heads * dims; ++col)                                 \
        memset(kt + col * kstride + seq_len, 0, sizeof(E) * (size_t)(padded - seq_len));    \
    const int64_t v_rows = seq_len / (E_DIMS) * (E_DIMS);  /* whole rows of the copy */    \
    for (int h = 0; h < num_kv_heads; ++h)                                                  \
        memset(vc + h * v_per_head + v_rows / (E_DIMS) * head_dim, 0,                       \
               sizeof(E) * (size_t)(v_per_head - v_rows / (E_DIMS) * head_dim));            \
    for (int64_t t = 0; t < seq_len; ++t) {                                                 \
        const T *row = cache + table[t / block_size] * block_stride                         \
                       + (t % block_size) * token_stride;                                   \
        for (int h = 0; h < num_kv_heads; ++h) {                                            \
            const T *key = row + (int64_t)h * head_dim, *value = key + side_stride;         \
            E *kdst = kt + h * per_head + t;                                                \
            COPY_KEY_##LAYOUT(SCALAR)                                                       \
            COPY_VALUE_##LAYOUT(SCALAR)                                                     \
        }                                                                                   \
    }                                                                                       \
    for (int h = 0; h < num_kv_heads; ++h)                                                  \
        for (int64_t row = 0; row < rows; ++row) {                                          \
            const T *src = q + (row / group) * q_stride                                     \
                           + (int64_t)(h * group + row % group) * head_dim;                 \
            E *dst = qs + (h * rows + row) * dims;                                          \
            COPY_QUERY_##LAYOUT(SCALAR)                                                     \
        }                                                                                   \
    const int64_t sets = (rows + rows_per_set - 1) / rows_per_set;                          \
    const int64_t context = seq_len - q_len;                                                \
    _Pragma("omp parallel for num_threads(num_threads) schedule(dynamic, 4) collapse(2)")   \
    for (int h = 0; h < num_kv_heads; ++h)                                                  \
        for (int64_t i = 0; i < sets; ++i) {                                                \
            const int64_t first = i * rows_per_set;                                         \
            const int64_t count = rows - first < rows_per_set ? rows - first : rows_per_set; \
            const E *qh = qs + h * rows * dims;                                             \
            if (head_dim == 64)                                                             \
                ROWS_64(qh, kt + h * per_head, kstride, vc + h * v_per_head, out,           \
                        out_stride, first, count, group, h, context, window, scale);        \
            else                                                                            \
                ROWS_128(qh, kt + h * per_head, kstride, vc + h * v_per_head, out,          \
                         out_stride, first, count, group, h, context, window, scale);       \
        }                                                                                   \
    free(kt);                                                                               \
    return 0;                                                                               \
}

DEFINE_CHUNK(chunk_f32, float, scalar_f32, float, 1, F32, rows_f32_64, rows_f32_128)
#if defined(__AVX512BF16__)
DEFINE_CHUNK(chunk_bf16, uint16_t, scalar_bf16, uint32_t, 2, PAIRS, rows_bf16_64,
             rows_bf16_128)
#else
DEFINE_CHUNK(chunk_bf16, uint16_t, scalar_bf16, float, 1, F32, rows_f32_64, rows_f32_128)
#endif
#endif

/* Whether this build runs the kernel for head_dim and query heads per KV head. */
int kvmem_prefill_supported(int head_dim, int group) {
#if defined(__AVX512F__)
    return (head_dim == 64 || head_dim == 128) && group >= 1;
#else
    (void)head_dim; (void)group;
    return 0;
#endif
}

/* Chunk c: token rows starts[c] .. starts[c] + q_lens[c] - 1 of q (rows of [num_heads,
 * head_dim], q_stride elements apart), the last q_lens[c] of seq_lens[c] tokens of a
 * sequence whose keys and values (this step's included) are in the cache [blocks, 2,
 * block_size, num_kv_heads, head_dim] at the blocks tables[c * table_stride ...]. out (fp32)
 * gets the same rows. scale multiplies q.k (softmax in base 2: the caller passes scale *
 * log2(e)); window > 0 limits keys to the last `window` positions. dtype 0: fp32, 1: bf16.
 * Returns 0, 1 when out of memory, 2 when not supported here. */
int kvmem_prefill_attention(const void *q, int64_t q_stride, const void *cache,
                            int64_t block_stride, int64_t side_stride, int64_t token_stride,
                            int block_size, const int32_t *tables, int64_t table_stride,
                            const int64_t *starts, const int64_t *q_lens,
                            const int64_t *seq_lens, int num_chunks, float *out,
                            int64_t out_stride, int num_heads, int num_kv_heads, int head_dim,
                            float scale, int64_t window, int dtype, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads
            || !kvmem_prefill_supported(head_dim, num_heads / num_kv_heads))
        return 2;
#if defined(__AVX512F__)
    for (int c = 0; c < num_chunks; ++c) {
        const int64_t s = starts[c];
        const int32_t *table = tables + c * table_stride;
        int status;
        if (dtype == 1)
            status = chunk_bf16((const uint16_t *)q + s * q_stride, q_stride, q_lens[c],
                                (const uint16_t *)cache, table, block_stride, side_stride,
                                token_stride, block_size, seq_lens[c], out + s * out_stride,
                                out_stride, num_heads, num_kv_heads, head_dim, scale, window,
                                num_threads);
        else
            status = chunk_f32((const float *)q + s * q_stride, q_stride, q_lens[c],
                               (const float *)cache, table, block_stride, side_stride,
                               token_stride, block_size, seq_lens[c], out + s * out_stride,
                               out_stride, num_heads, num_kv_heads, head_dim, scale, window,
                               num_threads);
        if (status) return status;
    }
    return 0;
#else
    (void)q; (void)q_stride; (void)cache; (void)block_stride; (void)side_stride;
    (void)token_stride; (void)block_size; (void)tables; (void)table_stride; (void)starts;
    (void)q_lens; (void)seq_lens; (void)num_chunks; (void)out; (void)out_stride;
    (void)scale; (void)window; (void)dtype; (void)num_threads;
    return 2;
#endif
}
