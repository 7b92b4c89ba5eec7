// bf16 <-> fp32 for the C++ CPU kernels beside this file (moe_cpu.cpp, index_cpu.cpp, attn_cpu.cpp), rounding
// as torch rounds: to the nearest, ties to even, subnormals kept, NaN stays NaN.
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace dsv41_bf16
