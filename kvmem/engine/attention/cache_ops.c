/* The paged KV cache's store on the CPU: each new token's key and value rows are copied to
 * their slot in one pass (slot -1: a token with no slot, skipped), where the indexed torch
 * store takes a mask, two divisions and two scatters per layer. Any element type: rows are
 * copied as bytes. Called through kvmem/engine/attention/cpu_kernels.py.
 */
#include <stdint.h>
#include <string.h>

/* Strides are in bytes: k/v per token; the cache per block, between its key and value
 * halves, and per slot within a block. Returns 0, or 1 + the first token whose slot lies
 * past the cache (nothing is written from that token on). */
int64_t kvmem_store_kv(const char *k, const char *v, int64_t k_stride, int64_t v_stride,
                       const int64_t *slots, int64_t tokens, char *cache, int64_t num_blocks,
                       int64_t block_stride, int64_t side_stride, int64_t slot_stride,
                       int64_t block_size, int64_t row_bytes) {
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t block = slot / block_size;
        if (block >= num_blocks) return t + 1;
        char *dst = cache + block * block_stride + (slot % block_size) * slot_stride;
        memcpy(dst, k + t * k_stride, row_bytes);
        memcpy(dst + side_stride, v + t * v_stride, row_bytes);
    }
    return 0;
}
