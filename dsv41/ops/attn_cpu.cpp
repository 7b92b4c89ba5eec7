// Sparse attention of a `fast` prefill chunk on a CPU: dsv41.ops.attn_cpu builds this file with the machine's own
// instruction set (-march=native) and loads it; it registers the op torch.ops.dsv41.sparse_attn_cpu.
//
// The math of dsv41.ops.sparse_attn (every query attends to its own list of rows of one latent KV tensor, K = V,
// with a per-head sink logit that joins only the denominator), under `fast` numerics: the logits q . kv in fp32
// from the bf16 values, one softmax over the query's valid rows relative to their largest logit (the reference
// goes by blocks of 64 rows with a running one), the probabilities rounded to bf16 for P . V as the reference
// rounds them, P . V in fp32, the output rounded once to bf16. Each query reads its rows where they lie:
// nothing of size [queries, picks, D] is gathered first, which is what the reference's tensor ops spend most
// of their time on.
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

// the dot products of H query heads with one row (D a multiple of 32), fp32 sums of the bf16 products
inline void head_dots(const uint16_t* q, const uint16_t* row, int64_t H, int64_t D, float* out) {
    for (int64_t h = 0; h < H; ++h) {
        const uint16_t* qh = q + h * D;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 64 <= D; i += 64) {
            acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(qh + i), (__m512bh)_mm512_loadu_si512(row + i));
            acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(qh + i + 32),
                                    (__m512bh)_mm512_loadu_si512(row + i + 32));
        }
        for (; i < D; i += 32)
            acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(qh + i), (__m512bh)_mm512_loadu_si512(row + i));
        out[h] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
}

// acc[h] += p[h] * row for the H heads (row widened to fp32 once, 16 values at a time)
inline void add_weighted_row(const uint16_t* row, const float* p, int64_t H, int64_t D, float* acc) {
    for (int64_t i = 0; i < D; i += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i)));
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
        for (int64_t h = 0; h < H; ++h) {
            float* a = acc + h * D + i;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(p[h]), v, _mm512_loadu_ps(a)));
        }
    }
}
#else
constexpr bool kBf16Dot = false;

inline void head_dots(const uint16_t* q, const uint16_t* row, int64_t H, int64_t D, float* out) {
    for (int64_t h = 0; h < H; ++h) {
        float acc[16] = {};
        for (int64_t i = 0; i < D; i += 16)
#pragma omp simd
            for (int l = 0; l < 16; ++l) acc[l] += bf16_to_f32(q[h * D + i + l]) * bf16_to_f32(row[i + l]);
        float total = 0.f;
        for (int l = 0; l < 16; ++l) total += acc[l];
        out[h] = total;
    }
}

inline void add_weighted_row(const uint16_t* row, const float* p, int64_t H, int64_t D, float* acc) {
    for (int64_t h = 0; h < H; ++h)
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) acc[h * D + i] += p[h] * bf16_to_f32(row[i]);
}
#endif

// q [B, M, H, D] bf16, kv [B, N, D] bf16, sink [H] fp32, indices [B, M, K] int64 (-1 unused) -> [B, M, H, D] bf16
at::Tensor sparse_attn_op(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& sink, const at::Tensor& indices,
                          double scale) {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16,
                "sparse_attn_cpu: q and kv must be bf16");
    TORCH_CHECK(q.dim() == 4 && kv.dim() == 3 && indices.dim() == 3 && sink.dim() == 1,
                "sparse_attn_cpu: q [B, M, H, D], kv [B, N, D], sink [H], indices [B, M, K]");
    const int64_t B = q.size(0), M = q.size(1), H = q.size(2), D = q.size(3), N = kv.size(1), K = indices.size(2);
    TORCH_CHECK(kv.size(0) == B && kv.size(2) == D && indices.size(0) == B && indices.size(1) == M &&
                    sink.size(0) == H && D % 32 == 0,
                "sparse_attn_cpu: shapes do not match (D must be a multiple of 32)");
    const at::Tensor qc = q.contiguous(), kc = kv.contiguous(), ic = indices.to(at::kLong).contiguous();
    const at::Tensor sc = sink.to(at::kFloat).contiguous();
    at::Tensor out = at::empty({B, M, H, D}, qc.options());
    const uint16_t* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
    const uint16_t* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr());
    const int64_t* ip = ic.data_ptr<int64_t>();
    const float* sp = sc.data_ptr<float>();
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    const float fscale = float(scale);
    at::parallel_for(0, B * M, 8, [&](int64_t r0, int64_t r1) {
        std::vector<float> logits(K * H), acc(H * D), p(H), top(H), denom(H);
        std::vector<int64_t> rows(K);
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t b = r / M;
            const uint16_t* qr = qp + r * H * D;
            int64_t n = 0;  // the valid rows, in list order
            for (int64_t k = 0; k < K; ++k) {
                const int64_t id = ip[r * K + k];
                if (id >= 0 && id < N) rows[n++] = id;
            }
            std::fill(top.begin(), top.end(), -INFINITY);
            for (int64_t k = 0; k < n; ++k) {
                float* l = logits.data() + k * H;
                head_dots(qr, kp + (b * N + rows[k]) * D, H, D, l);
                for (int64_t h = 0; h < H; ++h) {
                    l[h] *= fscale;
                    top[h] = std::max(top[h], l[h]);
                }
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            std::fill(denom.begin(), denom.end(), 0.f);
            for (int64_t k = 0; k < n; ++k) {
                const float* l = logits.data() + k * H;
                for (int64_t h = 0; h < H; ++h) {
                    const float e = std::exp(l[h] - top[h]);
                    denom[h] += e;
                    // P . V takes the probability rounded to bf16, as the model's attention does (its
                    // denominator the unrounded one): a cheap rounding that keeps fast closer to the reference
                    p[h] = round_bf16(e);
                }
                add_weighted_row(kp + (b * N + rows[k]) * D, p.data(), H, D, acc.data());
            }
            uint16_t* o = op + r * H * D;
            for (int64_t h = 0; h < H; ++h) {
                // the sink joins the denominator only; a query with no valid row gets 0 (its sum is 0)
                const float d = n ? denom[h] + std::exp(sp[h] - top[h]) : 1.f;
                for (int64_t i = 0; i < D; ++i) o[h * D + i] = f32_to_bf16(acc[h * D + i] / d);
            }
        }
    });
    return out;
}

// true where the logits use the bf16 dot-product instructions
bool bf16_dot() { return kBf16Dot; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsv41, m) {
    m.def("sparse_attn_cpu(Tensor q, Tensor kv, Tensor sink, Tensor indices, float scale) -> Tensor");
    m.def("sparse_attn_cpu_bf16_dot() -> bool", &bf16_dot);
}

TORCH_LIBRARY_IMPL(dsv41, CPU, m) { m.impl("sparse_attn_cpu", &sparse_attn_op); }
