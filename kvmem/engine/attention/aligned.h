/* aligned: scratch memory on cache-line boundaries for the CPU kernels. At malloc's 16-byte
 * alignment every 64-byte vector load from it spans two cache lines; in the prefill kernel
 * that alone cost 1.4x. */
#ifndef KVMEM_ALIGNED_H
#define KVMEM_ALIGNED_H
#include <stdlib.h>

/* `bytes` starting on a 64-byte boundary, or NULL; free() releases it. */
static inline void *aligned_scratch(size_t bytes) {
    void *p = NULL;
    return posix_memalign(&p, 64, bytes ? bytes : 64) ? NULL : p;
}

#endif
