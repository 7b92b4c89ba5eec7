// Sparse attention on a CPU, a `fast` prefill chunk's and a compiled engine's decode step's: dsv41.ops.attn_cpu
// builds this file with the machine's own instruction set (-march=native) and loads it; it registers the ops
// torch.ops.dsv41.sparse_attn_cpu and torch.ops.dsv41.decode_attn_cpu.
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
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
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

struct Work {  // one thread's scratch for `attend`
    std::vector<float> logits, acc, p, top, denom;
    Work(int64_t rows, int64_t H, int64_t D) : logits(rows * H), acc(H * D), p(H), top(H), denom(H) {}
};

// One query's attention over its n rows (bf16 [D] each, K = V): the logits q . row in fp32 from the bf16
// values, one softmax per head relative to the largest logit with the sink in the denominator, the
// probabilities rounded to bf16 for P . V as the reference rounds them (the denominator the unrounded sum),
// P . V in fp32, out [H, D] rounded once to bf16. A query with no rows gets 0. Rows are taken in list order,
// and nothing but this query's inputs enters its sums: its bits do not depend on the other queries of a call.
void attend(const uint16_t* q, const uint16_t* const* rows, int64_t n, int64_t H, int64_t D, const float* sink,
            float scale, Work& w, uint16_t* out) {
    std::fill(w.top.begin(), w.top.end(), -INFINITY);
    for (int64_t k = 0; k < n; ++k) {
        float* l = w.logits.data() + k * H;
        head_dots(q, rows[k], H, D, l);
        for (int64_t h = 0; h < H; ++h) {
            l[h] *= scale;
            w.top[h] = std::max(w.top[h], l[h]);
        }
    }
    std::fill(w.acc.begin(), w.acc.end(), 0.f);
    std::fill(w.denom.begin(), w.denom.end(), 0.f);
    for (int64_t k = 0; k < n; ++k) {
        const float* l = w.logits.data() + k * H;
        for (int64_t h = 0; h < H; ++h) {
            const float e = std::exp(l[h] - w.top[h]);
            w.denom[h] += e;
            // P . V takes the probability rounded to bf16, as the model's attention does (its denominator the
            // unrounded one): a cheap rounding that keeps fast closer to the reference
            w.p[h] = round_bf16(e);
        }
        add_weighted_row(rows[k], w.p.data(), H, D, w.acc.data());
    }
    for (int64_t h = 0; h < H; ++h) {
        // the sink joins the denominator only; a query with no valid row gets 0 (its sum is 0)
        const float d = n ? w.denom[h] + std::exp(sink[h] - w.top[h]) : 1.f;
        for (int64_t i = 0; i < D; ++i) out[h * D + i] = f32_to_bf16(w.acc[h * D + i] / d);
    }
}

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
        Work work(K, H, D);
        std::vector<const uint16_t*> rows(K);
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t b = r / M;
            const uint16_t* qr = qp + r * H * D;
            int64_t n = 0;  // the valid rows, in list order
            for (int64_t k = 0; k < K; ++k) {
                const int64_t id = ip[r * K + k];
                if (id >= 0 && id < N) rows[n++] = kp + (b * N + id) * D;
            }
            attend(qr, rows.data(), n, H, D, sp, fscale, work, op + r * H * D);
        }
    });
    return out;
}

// 2^(bits - 127), the value of a UE8M0 scale (bits 0: 2^-127, a subnormal float, as torch reads it)
inline float ue8m0(uint8_t bits) {
    const uint32_t v = bits ? uint32_t(bits) << 23 : 0x00400000u;
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}

// dsv41.ops.quant.fp8_quant of one row of D bf16 values (blocks of 32): amax clamped below at 1e-4, times the
// fp32 reciprocal of 448, rounded up to a power of two (exact powers stay), the values divided by it, clamped to
// +-448 and rounded to E4M3 (ties to even). Writes the codes' bits and the scales' UE8M0 bits.
void fp8_quant_row(const uint16_t* x, int64_t D, uint8_t* codes, uint8_t* scale_bits) {
    const float inv = float(1.0 / 448.0);
    for (int64_t b = 0; b < D / 32; ++b) {
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(bf16_to_f32(x[b * 32 + i])));
        int e;
        const float m = std::frexp(std::max(amax, 1e-4f) * inv, &e);
        if (m == 0.5f) --e;
        const float scale = std::ldexp(1.f, e);
        scale_bits[b] = uint8_t(e + 127);
        for (int i = 0; i < 32; ++i) {
            const float v = std::clamp(bf16_to_f32(x[b * 32 + i]) / scale, -448.f, 448.f);
            codes[b * 32 + i] = c10::Float8_e4m3fn(v).x;
        }
    }
}

// One decode step's attention of B sequences, one new token each (dsv41.engine.batched.window_attention, whose
// tensor ops are its reference): q [B, 1, H, D] bf16; the window ring as it was, ring_codes [B, W, D] E4M3 and
// ring_scale [B, W, D/32] UE8M0 bits; the new token's row kv [B, 1, D] bf16; the selected compressed rows
// selected [B, K, D] bf16 (K may be 0); valid [B, W + 1 + K] (ring, new row, selected) -> (o [B, 1, H, D] bf16, the
// new row's ring codes [B, D] E4M3 and scale bits [B, D/32]). A ring row is decoded to the bf16 value the
// reference attends (E4M3 times a power of two: exact). Each sequence is one task of its own rows in one order:
// its bits do not depend on the batch (the `deterministic` mode's guarantee, by construction).
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_attn_op(const at::Tensor& q, const at::Tensor& ring_codes,
                                                              const at::Tensor& ring_scale, const at::Tensor& kv,
                                                              const at::Tensor& valid, const at::Tensor& selected,
                                                              const at::Tensor& sink, double scale) {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16 &&
                    selected.scalar_type() == at::kBFloat16,
                "decode_attn_cpu: q, kv and selected must be bf16");
    TORCH_CHECK(ring_codes.scalar_type() == at::kFloat8_e4m3fn && ring_scale.scalar_type() == at::kByte &&
                    valid.scalar_type() == at::kBool,
                "decode_attn_cpu: ring_codes e4m3, ring_scale uint8 (UE8M0 bits), valid bool");
    TORCH_CHECK(q.dim() == 4 && q.size(1) == 1 && ring_codes.dim() == 3 && kv.dim() == 3 && selected.dim() == 3 &&
                    valid.dim() == 2 && sink.dim() == 1,
                "decode_attn_cpu: q [B, 1, H, D], ring_codes [B, W, D], kv [B, 1, D], selected [B, K, D], valid "
                "[B, W + 1 + K], sink [H]");
    const int64_t B = q.size(0), H = q.size(2), D = q.size(3), W = ring_codes.size(1), K = selected.size(1);
    TORCH_CHECK(D % 32 == 0 && ring_codes.size(0) == B && ring_codes.size(2) == D && ring_scale.size(0) == B &&
                    ring_scale.size(1) == W && ring_scale.size(2) == D / 32 && kv.size(0) == B && kv.size(1) == 1 &&
                    kv.size(2) == D && selected.size(0) == B && selected.size(2) == D && valid.size(0) == B &&
                    valid.size(1) == W + 1 + K && sink.size(0) == H,
                "decode_attn_cpu: shapes do not match (D must be a multiple of 32)");
    const at::Tensor qc = q.contiguous(), cc = ring_codes.contiguous(), scc = ring_scale.contiguous();
    const at::Tensor kc = kv.contiguous(), sel = selected.contiguous(), vc = valid.contiguous();
    const at::Tensor sc = sink.to(at::kFloat).contiguous();
    at::Tensor out = at::empty({B, 1, H, D}, qc.options());
    at::Tensor codes = at::empty({B, D}, cc.options());
    at::Tensor bits = at::empty({B, D / 32}, scc.options());
    const uint16_t* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
    const uint8_t* cp = reinterpret_cast<const uint8_t*>(cc.data_ptr());
    const uint8_t* scp = scc.data_ptr<uint8_t>();
    const uint16_t* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr());
    const uint16_t* selp = reinterpret_cast<const uint16_t*>(sel.data_ptr());
    const bool* vp = vc.data_ptr<bool>();
    const float* sp = sc.data_ptr<float>();
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    uint8_t* codes_p = reinterpret_cast<uint8_t*>(codes.data_ptr());
    uint8_t* bits_p = bits.data_ptr<uint8_t>();
    const float fscale = float(scale);
    float e4m3[256];  // every E4M3 code's value
    for (int c = 0; c < 256; ++c) e4m3[c] = float(c10::Float8_e4m3fn(uint8_t(c), c10::Float8_e4m3fn::from_bits()));
    const int64_t N = W + 1 + K;
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
        Work work(N, H, D);
        std::vector<uint16_t> ring(W * D);  // this sequence's valid ring rows, decoded to bf16
        std::vector<const uint16_t*> rows(N);
        for (int64_t b = b0; b < b1; ++b) {
            const bool* v = vp + b * N;
            int64_t n = 0;
            for (int64_t j = 0; j < W; ++j) {
                if (!v[j]) continue;
                const uint8_t* c = cp + (b * W + j) * D;
                const uint8_t* s = scp + (b * W + j) * (D / 32);
                uint16_t* dst = ring.data() + j * D;
                for (int64_t i = 0; i < D; ++i) dst[i] = f32_to_bf16(e4m3[c[i]] * ue8m0(s[i / 32]));
                rows[n++] = dst;
            }
            if (v[W]) rows[n++] = kp + b * D;
            for (int64_t k = 0; k < K; ++k)
                if (v[W + 1 + k]) rows[n++] = selp + (b * K + k) * D;
            attend(qp + b * H * D, rows.data(), n, H, D, sp, fscale, work, op + b * H * D);
            fp8_quant_row(kp + b * D, D, codes_p + b * D, bits_p + b * (D / 32));
        }
    });
    return {out, codes, bits};
}

// true where the logits use the bf16 dot-product instructions
bool bf16_dot() { return kBf16Dot; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsv41, m) {
    m.def("sparse_attn_cpu(Tensor q, Tensor kv, Tensor sink, Tensor indices, float scale) -> Tensor");
    m.def("sparse_attn_cpu_bf16_dot() -> bool", &bf16_dot);
    m.def(
        "decode_attn_cpu(Tensor q, Tensor ring_codes, Tensor ring_scale, Tensor kv, Tensor valid, Tensor selected, "
        "Tensor sink, float scale) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dsv41, CPU, m) {
    m.impl("sparse_attn_cpu", &sparse_attn_op);
    m.impl("decode_attn_cpu", &decode_attn_op);
}
