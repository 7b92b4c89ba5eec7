// Sparse attention on a CPU, a `fast` prefill chunk's and a compiled engine's decode step's: dsv41.ops.attn_cpu
// builds this file with the machine's own instruction set (-march=native) and loads it; it registers the ops
// torch.ops.dsv41.sparse_attn_cpu, torch.ops.dsv41.decode_attn_cpu and torch.ops.dsv41.chunk_attn_cpu.
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
#include <numeric>
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

// the dot products of H query heads with one row (D a multiple of 32), fp32 sums of the bf16 products, times
// `scale`: eight heads at a time, their sixteen-lane partial sums reduced together (`sum8`)
template <int HN>
inline void head_dots8(const uint16_t* q, const uint16_t* row, int64_t D, float scale, float* out) {
    __m512 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 32) {
        const __m512bh r = (__m512bh)_mm512_loadu_si512(row + i);
        for (int u = 0; u < HN; ++u) a[u] = _mm512_dpbf16_ps(a[u], (__m512bh)_mm512_loadu_si512(q + u * D + i), r);
    }
    sum8(a, HN, out);
    for (int u = 0; u < HN; ++u) out[u] *= scale;
}

inline void head_dots(const uint16_t* q, const uint16_t* row, int64_t H, int64_t D, float scale, float* out) {
    for (int64_t h0 = 0; h0 < H; h0 += 8) {
        const uint16_t* qh = q + h0 * D;
        float* o = out + h0;
        switch (std::min<int64_t>(8, H - h0)) {
            case 1: head_dots8<1>(qh, row, D, scale, o); break;
            case 2: head_dots8<2>(qh, row, D, scale, o); break;
            case 3: head_dots8<3>(qh, row, D, scale, o); break;
            case 4: head_dots8<4>(qh, row, D, scale, o); break;
            case 5: head_dots8<5>(qh, row, D, scale, o); break;
            case 6: head_dots8<6>(qh, row, D, scale, o); break;
            case 7: head_dots8<7>(qh, row, D, scale, o); break;
            default: head_dots8<8>(qh, row, D, scale, o); break;
        }
    }
}

// x[i] = exp(x[i] - shift[i % period]) (a softmax's logits less their head's largest; period a multiple of 16), 16
// at a time: n = round(v / ln 2), r = v - n ln 2 in two parts, e^r by Cephes' degree-6 polynomial (within ~1 ulp
// of fp32), times 2^n by scalef (which gives the subnormals and 0 where e^v underflows). NaN stays NaN.
inline void exp_shifted(float* x, int64_t count, const float* shift, int64_t period) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), c1 = _mm512_set1_ps(0.693359375f),
                 c2 = _mm512_set1_ps(-2.12194440e-4f), lowest = _mm512_set1_ps(-104.f), one = _mm512_set1_ps(1.f);
    for (int64_t i = 0, j = 0; i < count; i += 16, j = j + 16 == period ? 0 : j + 16) {
        const __mmask16 m = count - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (count - i)) - 1);
        const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_loadu_ps(shift + j));
        const __m512 v = _mm512_max_ps(lowest, d);  // (NaN: the second operand)
        const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 r = _mm512_fnmadd_ps(n, c2, _mm512_fnmadd_ps(n, c1, v));
        __m512 p = _mm512_set1_ps(1.9875691500e-4f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
        const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, one));
        _mm512_mask_storeu_ps(x + i, m, _mm512_scalef_ps(y, n));
    }
}

// per head, over the n rows of logits l [n, H]: e = exp(l - top) in place (`exp_shifted`), denom = sum of e in row
// order, p = e rounded to bf16 (to the nearest, ties to even: the rounding P . V takes); 16 heads at a time
inline void softmax_terms(float* l, const float* top, int64_t n, int64_t H, float* denom, uint16_t* p,
                          float* shift) {
    // shift [lcm(H, 16)] (scratch of 16 H floats): top[i % H], the shift of every 16 values of the flat [n, H] array
    const int64_t period = std::lcm<int64_t>(H, 16);
    for (int64_t i = 0; i < period; ++i) shift[i] = top[i % H];
    exp_shifted(l, n * H, shift, period);
    for (int64_t h0 = 0; h0 < H; h0 += 16) {
        const __mmask16 m = H - h0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (H - h0)) - 1);
        __m512 d = _mm512_setzero_ps();
        for (int64_t k = 0; k < n; ++k) d = _mm512_add_ps(d, _mm512_maskz_loadu_ps(m, l + k * H + h0));
        _mm512_mask_storeu_ps(denom + h0, m, d);
    }
    for (int64_t i = 0; i < n * H; ++i) p[i] = f32_to_bf16(l[i]);
}

// acc [H, D] = sum_k p[k, h] * rows[k] over the n rows, p [n, H] bf16 bits: two rows at a time, their values
// interleaved so that one bf16 dot-product instruction adds p_k v_k + p_k+1 v_k+1 for 16 dims; two heads at a time
// in registers (16 accumulators), 128 dims per pass. The interleave permutes the dims within each 128-bit lane
// (lane j of the low half holds dims 8j..8j+3, of the high half 8j+4..8j+7); undone when the sums are stored.
inline void weighted_sum(const uint16_t* const* rows, const uint16_t* p, int64_t n, int64_t H, int64_t D, float* acc) {
    alignas(64) static const uint16_t zero_row[128] = {};
    for (int64_t h0 = 0; h0 < H; h0 += 2) {
        const int64_t hn = std::min<int64_t>(2, H - h0);
        for (int64_t d0 = 0; d0 < D; d0 += 128) {
            const int64_t chunks = std::min<int64_t>(4, (D - d0) / 32);
            __m512 a[2][8];
            for (int u = 0; u < 2; ++u)
                for (int c = 0; c < 8; ++c) a[u][c] = _mm512_setzero_ps();
            for (int64_t k = 0; k < n; k += 2) {
                const bool pair = k + 1 < n;
                const uint16_t* ra = rows[k] + d0;
                const uint16_t* rb = pair ? rows[k + 1] + d0 : zero_row;
                __m512i pw[2];
                for (int64_t u = 0; u < hn; ++u) {
                    const uint32_t lo = p[k * H + h0 + u], hi = pair ? p[(k + 1) * H + h0 + u] : 0;
                    pw[u] = _mm512_set1_epi32(int32_t(lo | (hi << 16)));
                }
                for (int64_t c = 0; c < chunks; ++c) {
                    const __m512i va = _mm512_loadu_si512(ra + 32 * c), vb = _mm512_loadu_si512(rb + 32 * c);
                    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(va, vb), hi = (__m512bh)_mm512_unpackhi_epi16(va, vb);
                    for (int64_t u = 0; u < hn; ++u) {
                        a[u][2 * c] = _mm512_dpbf16_ps(a[u][2 * c], lo, (__m512bh)pw[u]);
                        a[u][2 * c + 1] = _mm512_dpbf16_ps(a[u][2 * c + 1], hi, (__m512bh)pw[u]);
                    }
                }
            }
            alignas(64) float t[16];
            for (int64_t u = 0; u < hn; ++u)
                for (int64_t c = 0; c < chunks; ++c)
                    for (int half = 0; half < 2; ++half) {
                        _mm512_store_ps(t, a[u][2 * c + half]);
                        float* dst = acc + (h0 + u) * D + d0 + 32 * c + 4 * half;
                        for (int j = 0; j < 4; ++j)
                            for (int e = 0; e < 4; ++e) dst[8 * j + e] = t[4 * j + e];
                    }
        }
    }
}
#else
constexpr bool kBf16Dot = false;

inline void head_dots(const uint16_t* q, const uint16_t* row, int64_t H, int64_t D, float scale, float* out) {
    for (int64_t h = 0; h < H; ++h) {
        float acc[16] = {};
        for (int64_t i = 0; i < D; i += 16)
#pragma omp simd
            for (int l = 0; l < 16; ++l) acc[l] += bf16_to_f32(q[h * D + i + l]) * bf16_to_f32(row[i + l]);
        float total = 0.f;
        for (int l = 0; l < 16; ++l) total += acc[l];
        out[h] = total * scale;
    }
}

inline void softmax_terms(float* l, const float* top, int64_t n, int64_t H, float* denom, uint16_t* p, float*) {
    std::fill(denom, denom + H, 0.f);
    for (int64_t k = 0; k < n; ++k)
        for (int64_t h = 0; h < H; ++h) {
            const float e = std::exp(l[k * H + h] - top[h]);
            denom[h] += e;
            p[k * H + h] = f32_to_bf16(e);
        }
}

inline void weighted_sum(const uint16_t* const* rows, const uint16_t* p, int64_t n, int64_t H, int64_t D, float* acc) {
    std::fill(acc, acc + H * D, 0.f);
    for (int64_t k = 0; k < n; ++k)
        for (int64_t h = 0; h < H; ++h) {
            const float w = bf16_to_f32(p[k * H + h]);
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) acc[h * D + i] += w * bf16_to_f32(rows[k][i]);
        }
}
#endif

struct Work {  // one thread's scratch for `attend`
    std::vector<float> logits, acc, top, denom, shift;
    std::vector<uint16_t> p;
    Work(int64_t rows, int64_t H, int64_t D)
        : logits(rows * H), acc(H * D), top(H), denom(H), shift(16 * H), p(rows * H) {}
};

// One query's attention over its n rows (bf16 [D] each, K = V): the logits q . row in fp32 from the bf16
// values, one softmax per head relative to the largest logit with the sink in the denominator, the
// probabilities rounded to bf16 for P . V as the reference rounds them (the denominator the unrounded sum),
// P . V in fp32, out [H, D] rounded once to bf16. A query with no rows gets 0. Rows are taken in list order,
// and nothing but this query's inputs enters its sums: its bits do not depend on the other queries of a call.
void attend(const uint16_t* q, const uint16_t* const* rows, int64_t n, int64_t H, int64_t D, const float* sink,
            float scale, Work& w, uint16_t* out) {
    std::fill(w.top.begin(), w.top.end(), -INFINITY);
    float* l = w.logits.data();
    for (int64_t k = 0; k < n; ++k) {
        head_dots(q, rows[k], H, D, scale, l + k * H);
        for (int64_t h = 0; h < H; ++h) w.top[h] = std::max(w.top[h], l[k * H + h]);
    }
    // P . V takes the probabilities rounded to bf16, as the model's attention does (its denominator the unrounded
    // sum): a cheap rounding that keeps fast closer to the reference
    softmax_terms(l, w.top.data(), n, H, w.denom.data(), w.p.data(), w.shift.data());
    weighted_sum(rows, w.p.data(), n, H, D, w.acc.data());
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

// every E4M3 code's value
struct E4m3Table {
    float v[256];
    E4m3Table() {
        for (int c = 0; c < 256; ++c) v[c] = float(c10::Float8_e4m3fn(uint8_t(c), c10::Float8_e4m3fn::from_bits()));
    }
};

// one ring row's D values, E4M3 codes times their block's UE8M0 scale, decoded to the bf16 values the reference
// attends (exact: 3 mantissa bits times a power of two)
inline void decode_ring_row(const uint8_t* codes, const uint8_t* scale, int64_t D, const float* e4m3, uint16_t* dst) {
    for (int64_t b = 0; b < D / 32; ++b) {
        const float s = ue8m0(scale[b]);
        for (int64_t i = b * 32; i < b * 32 + 32; ++i) dst[i] = f32_to_bf16(e4m3[codes[i]] * s);
    }
}

// One query's rows, in the order it attends them: its window ring's valid rows (W of them, decoded to bf16 in
// `ring`), then its `n_new` rows of this forward (bf16, each kept where valid), then its K selected compressed
// rows; valid [W + n_new + K]. Returns how many rows it listed.
int64_t list_rows(const bool* v, const uint16_t* ring, int64_t W, int64_t D, const uint16_t* fresh, int64_t n_new,
                  const uint16_t* selected, int64_t K, const uint16_t** rows) {
    int64_t n = 0;
    for (int64_t j = 0; j < W; ++j)
        if (v[j]) rows[n++] = ring + j * D;
    for (int64_t j = 0; j < n_new; ++j)
        if (v[W + j]) rows[n++] = fresh + j * D;
    for (int64_t k = 0; k < K; ++k)
        if (v[W + n_new + k]) rows[n++] = selected + k * D;
    return n;
}

void check_ring(const at::Tensor& q, const at::Tensor& ring_codes, const at::Tensor& ring_scale,
                const at::Tensor& valid, const at::Tensor& selected, const char* name) {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && selected.scalar_type() == at::kBFloat16, name,
                ": q and selected must be bf16");
    TORCH_CHECK(ring_codes.scalar_type() == at::kFloat8_e4m3fn && ring_scale.scalar_type() == at::kByte &&
                    valid.scalar_type() == at::kBool,
                name, ": ring_codes e4m3, ring_scale uint8 (UE8M0 bits), valid bool");
    TORCH_CHECK(q.dim() == 4 && q.size(1) == 1 && ring_codes.dim() == 3 && ring_scale.dim() == 3 &&
                    selected.dim() == 3 && valid.dim() == 2,
                name, ": q [B, 1, H, D], ring_codes [S, W, D], ring_scale [S, W, D/32], selected [B, K, D], valid [B, ...]");
    const int64_t D = q.size(3), W = ring_codes.size(1);
    TORCH_CHECK(D % 32 == 0 && ring_codes.size(2) == D && ring_scale.size(0) == ring_codes.size(0) &&
                    ring_scale.size(1) == W && ring_scale.size(2) == D / 32 && selected.size(0) == q.size(0) &&
                    selected.size(2) == D && valid.size(0) == q.size(0),
                name, ": shapes do not match (D must be a multiple of 32)");
}

// the contiguous inputs of a ring kernel (decode step or verify chunks) and their data
struct RingInputs {
    at::Tensor q, codes, scale, fresh, selected, valid, sink;
    const uint16_t *qp, *fp, *selp;
    const uint8_t *cp, *scp;
    const bool* vp;
    const float* sp;
    RingInputs(const at::Tensor& q_, const at::Tensor& codes_, const at::Tensor& scale_, const at::Tensor& fresh_,
               const at::Tensor& selected_, const at::Tensor& valid_, const at::Tensor& sink_)
        : q(q_.contiguous()), codes(codes_.contiguous()), scale(scale_.contiguous()), fresh(fresh_.contiguous()),
          selected(selected_.contiguous()), valid(valid_.contiguous()), sink(sink_.to(at::kFloat).contiguous()) {
        qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
        fp = reinterpret_cast<const uint16_t*>(fresh.data_ptr());
        selp = reinterpret_cast<const uint16_t*>(selected.data_ptr());
        cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
        scp = scale.data_ptr<uint8_t>();
        vp = valid.data_ptr<bool>();
        sp = sink.data_ptr<float>();
    }
};

// The per-sequence work of a decode step (decode_attn_op, decode_ring_attn_op): sequence b's W ring rows start
// ring_first(b) rows into codes / scale (D E4M3 codes and D/32 UE8M0 bytes a row); its new row's codes and scale
// bits go new_row(b) rows into new_codes / new_scale, after it has read its ring (the row it replaces may be one it
// reads). Each sequence is one task of its own rows in one order: its bits do not depend on the batch.
template <class RingFirst, class NewRow>
void decode_sequences(const uint16_t* qp, const uint16_t* kp, const uint16_t* selp, const bool* vp, const float* sp,
                      const uint8_t* cp, const uint8_t* scp, uint8_t* new_codes, uint8_t* new_scale, int64_t B,
                      int64_t H, int64_t D, int64_t W, int64_t K, float fscale, uint16_t* op, RingFirst ring_first,
                      NewRow new_row) {
    const E4m3Table e4m3;
    const int64_t N = W + 1 + K;
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
        Work work(N, H, D);
        std::vector<uint16_t> ring(W * D);  // this sequence's valid ring rows, decoded to bf16
        std::vector<const uint16_t*> rows(N);
        for (int64_t b = b0; b < b1; ++b) {
            const int64_t first = ring_first(b);
            const bool* v = vp + b * N;
            for (int64_t j = 0; j < W; ++j)  // only the rows it reads: the others may hold any bits
                if (v[j]) decode_ring_row(cp + (first + j) * D, scp + (first + j) * (D / 32), D, e4m3.v, ring.data() + j * D);
            const int64_t n = list_rows(v, ring.data(), W, D, kp + b * D, 1, selp + b * K * D, K, rows.data());
            attend(qp + b * H * D, rows.data(), n, H, D, sp, fscale, work, op + b * H * D);
            const int64_t at_row = new_row(b);
            fp8_quant_row(kp + b * D, D, new_codes + at_row * D, new_scale + at_row * (D / 32));
        }
    });
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
    check_ring(q, ring_codes, ring_scale, valid, selected, "decode_attn_cpu");
    const int64_t B = q.size(0), H = q.size(2), D = q.size(3), W = ring_codes.size(1), K = selected.size(1);
    TORCH_CHECK(kv.scalar_type() == at::kBFloat16 && kv.dim() == 3 && kv.size(0) == B && kv.size(1) == 1 &&
                    kv.size(2) == D && ring_codes.size(0) == B && valid.size(1) == W + 1 + K && sink.dim() == 1 &&
                    sink.size(0) == H,
                "decode_attn_cpu: shapes do not match: q [B, 1, H, D], ring_codes [B, W, D], kv [B, 1, D] bf16, "
                "selected [B, K, D], valid [B, W + 1 + K], sink [H]");
    const RingInputs in(q, ring_codes, ring_scale, kv, selected, valid, sink);
    at::Tensor out = at::empty({B, 1, H, D}, in.q.options());
    at::Tensor codes = at::empty({B, D}, in.codes.options());
    at::Tensor bits = at::empty({B, D / 32}, in.scale.options());
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    uint8_t* codes_p = reinterpret_cast<uint8_t*>(codes.data_ptr());
    uint8_t* bits_p = bits.data_ptr<uint8_t>();
    decode_sequences(in.qp, in.fp, in.selp, in.vp, in.sp, in.cp, in.scp, codes_p, bits_p, B, H, D, W, K, float(scale),
                     op, [W](int64_t b) { return b * W; }, [](int64_t b) { return b; });
    return {out, codes, bits};
}

// The attention of the tokens of several sequences' chunks of consecutive new positions in one call
// (dsv41.engine.batched.chunk_decode_attend, whose tensor ops are its reference): q [T, 1, H, D] bf16 for T tokens;
// the rings as they were before the chunks, ring_codes [S, W, D] E4M3 and ring_scale [S, W, D/32] UE8M0 bits, one
// per sequence, ring_of [T] int64 the ring of each token; chunk [T, n, D] bf16 the rows of each token's chunk (the
// ones it may see marked in valid); selected [T, K, D] bf16; valid [T, W + n + K] (ring, chunk rows, selected)
// -> o [T, 1, H, D] bf16. Each token is one task of its own rows in one order, as in `decode_attn_op`.
at::Tensor chunk_attn_op(const at::Tensor& q, const at::Tensor& ring_codes, const at::Tensor& ring_scale,
                         const at::Tensor& ring_of, const at::Tensor& chunk, const at::Tensor& valid,
                         const at::Tensor& selected, const at::Tensor& sink, double scale) {
    check_ring(q, ring_codes, ring_scale, valid, selected, "chunk_attn_cpu");
    const int64_t T = q.size(0), H = q.size(2), D = q.size(3), S = ring_codes.size(0), W = ring_codes.size(1);
    const int64_t K = selected.size(1);
    TORCH_CHECK(chunk.scalar_type() == at::kBFloat16 && chunk.dim() == 3 && chunk.size(0) == T && chunk.size(2) == D,
                "chunk_attn_cpu: shapes do not match: chunk [T, n, D] bf16");
    const int64_t n_new = chunk.size(1);
    TORCH_CHECK(ring_of.dim() == 1 && ring_of.size(0) == T && valid.size(1) == W + n_new + K && sink.dim() == 1 &&
                    sink.size(0) == H,
                "chunk_attn_cpu: shapes do not match: ring_of [T], valid [T, W + n + K], sink [H]");
    const RingInputs in(q, ring_codes, ring_scale, chunk, selected, valid, sink);
    const uint16_t *qp = in.qp, *kp = in.fp, *selp = in.selp;
    const uint8_t *cp = in.cp, *scp = in.scp;
    const bool* vp = in.vp;
    const float* sp = in.sp;
    const at::Tensor rc = ring_of.to(at::kLong).contiguous();
    const int64_t* rp = rc.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(rp[t] >= 0 && rp[t] < S, "chunk_attn_cpu: ring_of out of range");
    at::Tensor out = at::empty({T, 1, H, D}, in.q.options());
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    const float fscale = float(scale);
    const E4m3Table e4m3;
    const int64_t N = W + n_new + K;
    // each ring decoded once for all the tokens that read it (a row no token reads may hold any bits: the
    // decode of those is never attended)
    std::vector<uint16_t> rings(S * W * D);
    at::parallel_for(0, S * W, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) decode_ring_row(cp + r * D, scp + r * (D / 32), D, e4m3.v, rings.data() + r * D);
    });
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
        Work work(N, H, D);
        std::vector<const uint16_t*> rows(N);
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t n = list_rows(vp + t * N, rings.data() + rp[t] * W * D, W, D, kp + t * n_new * D, n_new,
                                        selp + t * K * D, K, rows.data());
            attend(qp + t * H * D, rows.data(), n, H, D, sp, fscale, work, op + t * H * D);
        }
    });
    return out;
}

// decode_attn_op with each sequence's ring read, and its new row's codes written, where they lie in the engine's
// state pool: window_codes [S, L, W, D] E4M3 and window_scale [S, L, W, D/32] UE8M0 bits (every slot's rings, all
// layers, contiguous), slots [B] (each sequence's slot, distinct), layer, ring_rows [B] (the ring row the new token
// takes) -> o [B, 1, H, D] bf16; window_codes[slots[b], layer, ring_rows[b]] and its scale hold the new row's bits after
// the call. The same work and bits as gathering the rings, decode_attn_op and writing its codes back, without the
// gathered copies. A sequence reads its ring before it writes the new row (the row it replaces may be one it
// reads); sequences write distinct slots.
at::Tensor decode_ring_attn_op(const at::Tensor& q, at::Tensor& window_codes, at::Tensor& window_scale,
                               const at::Tensor& slots, int64_t layer, const at::Tensor& ring_rows, const at::Tensor& kv,
                               const at::Tensor& valid, const at::Tensor& selected, const at::Tensor& sink,
                               double scale) {
    TORCH_CHECK(window_codes.dim() == 4 && window_scale.dim() == 4 && window_codes.is_contiguous() &&
                    window_scale.is_contiguous(),
                "decode_ring_attn_cpu: window_codes [S, L, W, D] and window_scale [S, L, W, D/32], contiguous");
    const int64_t S = window_codes.size(0), L = window_codes.size(1), W = window_codes.size(2);
    check_ring(q, window_codes[0][0].unsqueeze(0), window_scale[0][0].unsqueeze(0), valid, selected,
               "decode_ring_attn_cpu");
    const int64_t B = q.size(0), H = q.size(2), D = q.size(3), K = selected.size(1);
    TORCH_CHECK(window_scale.size(0) == S && window_scale.size(1) == L && layer >= 0 && layer < L,
                "decode_ring_attn_cpu: window_scale's slots and layers differ from window_codes', or layer out of range");
    TORCH_CHECK(kv.scalar_type() == at::kBFloat16 && kv.dim() == 3 && kv.size(0) == B && kv.size(1) == 1 &&
                    kv.size(2) == D && valid.size(1) == W + 1 + K && sink.dim() == 1 && sink.size(0) == H &&
                    slots.dim() == 1 && slots.size(0) == B && ring_rows.dim() == 1 && ring_rows.size(0) == B,
                "decode_ring_attn_cpu: shapes do not match: q [B, 1, H, D], kv [B, 1, D] bf16, selected [B, K, D], "
                "valid [B, W + 1 + K], sink [H], slots [B], ring_rows [B]");
    const at::Tensor sc = slots.to(at::kLong).contiguous(), ac = ring_rows.to(at::kLong).contiguous();
    const int64_t *slot = sc.data_ptr<int64_t>(), *row = ac.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
        TORCH_CHECK(slot[b] >= 0 && slot[b] < S && row[b] >= 0 && row[b] < W,
                    "decode_ring_attn_cpu: a slot or ring row out of range");
    const RingInputs in(q, window_codes, window_scale, kv, selected, valid, sink);  // (the pool is contiguous: no copy)
    uint8_t* cp = reinterpret_cast<uint8_t*>(window_codes.data_ptr());
    uint8_t* scp = window_scale.data_ptr<uint8_t>();
    at::Tensor out = at::empty({B, 1, H, D}, in.q.options());
    auto first = [&](int64_t b) { return (slot[b] * L + layer) * W; };  // sequence b's ring in the pool
    decode_sequences(in.qp, in.fp, in.selp, in.vp, in.sp, cp, scp, cp, scp, B, H, D, W, K, float(scale),
                     reinterpret_cast<uint16_t*>(out.data_ptr()), first,
                     [&](int64_t b) { return first(b) + row[b]; });
    return out;
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
    m.def(
        "decode_ring_attn_cpu(Tensor q, Tensor(a!) window_codes, Tensor(b!) window_scale, Tensor slots, int layer, "
        "Tensor ring_rows, Tensor kv, Tensor valid, Tensor selected, Tensor sink, float scale) -> Tensor");
    m.def(
        "chunk_attn_cpu(Tensor q, Tensor ring_codes, Tensor ring_scale, Tensor ring_of, Tensor chunk, Tensor valid, "
        "Tensor selected, Tensor sink, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsv41, CPU, m) {
    m.impl("sparse_attn_cpu", &sparse_attn_op);
    m.impl("decode_attn_cpu", &decode_attn_op);
    m.impl("decode_ring_attn_cpu", &decode_ring_attn_op);
    m.impl("chunk_attn_cpu", &chunk_attn_op);
}
