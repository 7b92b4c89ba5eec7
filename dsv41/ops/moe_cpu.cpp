// The picked experts of a few tokens (a fast decode step's MoE) on a CPU: dsv41.ops.moe_cpu builds this file
// with the machine's own instruction set (-march=native) and loads it; it registers the op
// torch.ops.dsv41.gathered_experts_cpu, which a compiled graph calls through the dispatcher.
//
// Same math as dsv41.ops.moe.gathered_experts (its reference): for each (token, pick) pair, gate and up are
// dot products of the token with rows of w1 and w3, rounded to bf16; h = silu(min(gate, limit)) *
// clamp(up, +-limit) * the pick's weight, rounded to bf16; the pair's output is the dot products of h with the
// rows of w2, rounded to bf16, and a token's pairs are summed in fp32. Two differences from the compiled
// reference: the pairs are grouped by expert, so a picked expert's rows are read from memory once for all the
// tokens that picked it (the reference reads them once per pair), and on a CPU with bf16 dot-product
// instructions (AVX512-BF16) the dot products take the bf16 rows as they are, 32 products per instruction,
// instead of widening each row to fp32 first. Sums run in another order than the reference's: `fast`
// numerics only (and the `deterministic` mode's compiled tiles, where a token's bits never depend on the others:
// each pair's dot products and a token's sum over its pairs run in one fixed order). A token that repeats the
// previous one (a padding row) is computed once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "cpu_bf16.h"

namespace {

using namespace dsv41_bf16;

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

// a . b over n bf16 values (n a multiple of 32; the caller checks), fp32 accumulation in four independent
// registers (one would wait on each instruction's latency)
inline float dot(const uint16_t* a, const uint16_t* b, int64_t n) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        for (int r = 0; r < 4; ++r) {
            __m512i va = _mm512_loadu_si512(a + i + 32 * r), vb = _mm512_loadu_si512(b + i + 32 * r);
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)va, (__m512bh)vb);
        }
    }
    for (; i < n; i += 32) {
        __m512i va = _mm512_loadu_si512(a + i), vb = _mm512_loadu_si512(b + i);
        acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)va, (__m512bh)vb);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}
#else
constexpr bool kBf16Dot = false;

// the portable form: widened to fp32 in blocks, four partial sums; the compiler vectorises it
inline float dot(const uint16_t* a, const uint16_t* b, int64_t n) {
    float acc[4][16] = {};
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        for (int r = 0; r < 4; ++r) {
#pragma omp simd
            for (int l = 0; l < 16; ++l) acc[r][l] += bf16_to_f32(a[i + 16 * r + l]) * bf16_to_f32(b[i + 16 * r + l]);
        }
    }
    float total = 0.f;
    for (; i < n; ++i) total += bf16_to_f32(a[i]) * bf16_to_f32(b[i]);
    for (int l = 0; l < 16; ++l) total += (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    return total;
}
#endif

}  // namespace

namespace {

// x [T, D] bf16, weights [T, K] fp32, indices [T, K] int64 into w1, w3 [E, I, D] and w2 [E, D, I] bf16 (all
// contiguous) -> out [T, D] fp32. `threads` OpenMP threads.
void gathered_experts(const uint16_t* x, const float* weights, const int64_t* indices, const uint16_t* w1,
                      const uint16_t* w3, const uint16_t* w2, float* out, int64_t T, int64_t K, int64_t E,
                      int64_t D, int64_t I, float limit, int64_t threads) {
    const int64_t P = T * K;
    // a token whose row, picks and weights equal the previous one's (the padding rows of a compiled step's
    // bucket or tile repeat a row) takes that token's output at the end: the same inputs give the same bits,
    // so they are computed once. same[t]: the first token of t's run of copies, or -1
    std::vector<int64_t> same(T, -1);
    for (int64_t t = 1; t < T; ++t) {
        const int64_t s = same[t - 1] >= 0 ? same[t - 1] : t - 1;
        if (std::memcmp(x + t * D, x + s * D, D * sizeof(uint16_t)) == 0 &&
            std::memcmp(indices + t * K, indices + s * K, K * sizeof(int64_t)) == 0 &&
            std::memcmp(weights + t * K, weights + s * K, K * sizeof(float)) == 0)
            same[t] = s;
    }
    // the pairs grouped by expert (a counting sort): start[e] .. start[e + 1] in `order`
    std::vector<int64_t> start(E + 1, 0);
    for (int64_t p = 0; p < P; ++p)
        if (same[p / K] < 0) start[indices[p] + 1]++;
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    std::vector<int64_t> order(start[E]);
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < P; ++p)
        if (same[p / K] < 0) order[fill[indices[p]]++] = p;
    std::vector<int64_t> experts;  // the picked ones
    for (int64_t e = 0; e < E; ++e)
        if (start[e + 1] > start[e]) experts.push_back(e);
    const int64_t U = int64_t(experts.size());
    std::vector<uint16_t> h(P * I);  // [P, I] the pairs' bf16 hidden rows

    constexpr int64_t kRows = 32;  // rows of one expert per work item
    const int64_t blocks_i = (I + kRows - 1) / kRows;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < U * blocks_i; ++item) {
        const int64_t e = experts[item / blocks_i];
        const int64_t i0 = (item % blocks_i) * kRows, i1 = std::min(I, i0 + kRows);
        for (int64_t i = i0; i < i1; ++i) {
            const uint16_t* r1 = w1 + (e * I + i) * D;
            const uint16_t* r3 = w3 + (e * I + i) * D;
            for (int64_t q = start[e]; q < start[e + 1]; ++q) {
                const int64_t p = order[q];
                const uint16_t* xt = x + (p / K) * D;
                float gate = round_bf16(dot(xt, r1, D)), up = round_bf16(dot(xt, r3, D));
                if (limit > 0) {
                    up = std::min(std::max(up, -limit), limit);
                    gate = std::min(gate, limit);
                }
                h[p * I + i] = f32_to_bf16(gate / (1.f + std::exp(-gate)) * up * weights[p]);
            }
        }
    }
    // each work item owns a block of output columns for every token: no two threads write one value
    const int64_t blocks_o = (D + kRows - 1) / kRows;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < blocks_o; ++item) {
        const int64_t o0 = item * kRows, o1 = std::min(D, o0 + kRows);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t o = o0; o < o1; ++o) out[t * D + o] = 0.f;
        for (int64_t u = 0; u < U; ++u) {
            const int64_t e = experts[u];
            for (int64_t o = o0; o < o1; ++o) {
                const uint16_t* r2 = w2 + (e * D + o) * I;
                for (int64_t q = start[e]; q < start[e + 1]; ++q) {
                    const int64_t p = order[q];
                    out[(p / K) * D + o] += round_bf16(dot(h.data() + p * I, r2, I));
                }
            }
        }
    }
    for (int64_t t = 1; t < T; ++t)
        if (same[t] >= 0) std::memcpy(out + t * D, out + same[t] * D, D * sizeof(float));
}

// the op: contiguous CPU tensors as `gathered_experts` takes them -> out [T, D] fp32
at::Tensor gathered_experts_op(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& indices,
                               const at::Tensor& w1, const at::Tensor& w3, const at::Tensor& w2, double limit) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w1.scalar_type() == at::kBFloat16 &&
                    w3.scalar_type() == at::kBFloat16 && w2.scalar_type() == at::kBFloat16,
                "gathered_experts_cpu: x and the expert stacks must be bf16");
    TORCH_CHECK(x.dim() == 2 && indices.dim() == 2 && w1.dim() == 3 && w1.sizes() == w3.sizes() && w2.dim() == 3,
                "gathered_experts_cpu: x [T, D], indices [T, k], w1 and w3 [E, I, D], w2 [E, D, I]");
    const at::Tensor xc = x.contiguous(), wc = weights.to(at::kFloat).contiguous();
    const at::Tensor ic = indices.to(at::kLong).contiguous();
    const at::Tensor a = w1.contiguous(), b = w3.contiguous(), c = w2.contiguous();
    const int64_t T = ic.size(0), K = ic.size(1), E = a.size(0), I = a.size(1), D = a.size(2);
    TORCH_CHECK(xc.size(0) == T && xc.size(1) == D && wc.numel() == T * K && c.size(1) == D && c.size(2) == I,
                "gathered_experts_cpu: shapes do not match");
    at::Tensor out = at::empty({T, D}, xc.options().dtype(at::kFloat));
    gathered_experts(reinterpret_cast<const uint16_t*>(xc.data_ptr()), wc.data_ptr<float>(), ic.data_ptr<int64_t>(),
                     reinterpret_cast<const uint16_t*>(a.data_ptr()), reinterpret_cast<const uint16_t*>(b.data_ptr()),
                     reinterpret_cast<const uint16_t*>(c.data_ptr()), out.data_ptr<float>(), T, K, E, D, I,
                     float(limit), at::get_num_threads());
    return out;
}

// true where the dot products use the bf16 dot-product instructions
bool bf16_dot() { return kBf16Dot; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsv41, m) {
    m.def("gathered_experts_cpu(Tensor x, Tensor weights, Tensor indices, Tensor w1, Tensor w3, Tensor w2, "
          "float limit) -> Tensor");
    m.def("gathered_experts_cpu_bf16_dot() -> bool", &bf16_dot);
}

TORCH_LIBRARY_IMPL(dsv41, CPU, m) { m.impl("gathered_experts_cpu", &gathered_experts_op); }
