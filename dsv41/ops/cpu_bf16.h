// bf16 <-> fp32 for the C++ CPU kernels beside this file (moe_cpu.cpp, index_cpu.cpp, attn_cpu.cpp), rounding
// as torch rounds: to the nearest, ties to even, subnormals kept, NaN stays NaN.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace dsv41_bf16 {

inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return uint16_t(bits >> 16);
}

// f rounded to the nearest bf16 value, as a float
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if defined(__AVX512F__)
// out[u] = the sum of the 16 lanes of a[u], u < n <= 8 (every a[u] set, zeros past n): the eight reductions by one
// tree of lane shuffles, ~3 instructions a sum against ~8 for each alone. Each sum adds its own lanes in one fixed
// order, whatever the other vectors hold.
inline void sum8(const __m512* a, int n, float* out) {
    __m512 b[4];  // 16 lanes -> 8: [u.l0 + u.l2, u.l1 + u.l3] of vectors u, u + 1 side by side
    for (int j = 0; j < 4; ++j)
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE));
    // 8 -> 4: one 128-bit lane per vector, vectors 0-3 and 4-7
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    // 4 -> 1 within each lane: element 0 of lane j holds vector j, element 1 vector j + 4
    const __m512 e = _mm512_add_ps(_mm512_unpacklo_ps(c0, c1), _mm512_unpackhi_ps(c0, c1));
    alignas(64) float t[16];
    _mm512_store_ps(t, _mm512_add_ps(e, _mm512_permute_ps(e, 0x4E)));
    for (int u = 0; u < n; ++u) out[u] = t[u < 4 ? 4 * u : 4 * (u - 4) + 1];
}
#endif

}  // namespace dsv41_bf16
