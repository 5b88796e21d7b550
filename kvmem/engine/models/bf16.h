/* bf16 <-> fp32 as PyTorch converts them on the CPU: widening is exact, narrowing rounds
 * to nearest even and turns every NaN into the quiet NaN 0x7FC0. Plain C, so loops over
 * them vectorise on any target. */
#ifndef KVMEM_BF16_H
#define KVMEM_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#endif
