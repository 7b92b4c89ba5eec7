// A bf16 linear layer of a few rows with fp32 sums and an fp32 result, on a CPU with bf16 dot-product
// instructions (AVX512-BF16): dsv41.ops.linear_cpu builds this file with the machine's own instruction set
// (-march=native) and loads it; it registers torch.ops.dsv41.rows_linear_cpu, which a compiled graph calls
// through the dispatcher.
//
// y[t, n] = sum_k x[t, k] w[n, k]: the products of bf16 values are exact in fp32, summed in fp32. Each block of
// 16 weight rows is read from memory once and kept in the L1 cache while every token's dot products with it
// are taken, 32 products per instruction; a token's 16 sums are then reduced together by a transposing add
// tree. Every output is its own token's dot product, summed in one fixed order whatever the other rows of the
// call: batch-invariant by construction. A token equal to the one before it (a padding row) is computed once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

// a + b after picking lanes of the pair: 128-bit quarters (`shuffle_f32x4`) or, within each quarter, single
// floats (`shuffle_ps`); LO and HI pick the two halves of every sum
template <int LO, int HI>
inline __m512 fold_quarters(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, LO), _mm512_shuffle_f32x4(a, b, HI));
}
template <int LO, int HI>
inline __m512 fold_floats(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, LO), _mm512_shuffle_ps(a, b, HI));
}

// the 16 vectors' lane sums, in order, as one vector: a transposing add tree (each level halves the vectors
// and doubles the rows a vector holds), 15 adds instead of 16 full horizontal reductions
inline __m512 sum16(__m512 v[16]) {
    __m512 u[8], w[4], s[2];
    // 256-bit halves: u[i] = [row 2i: 8 partials | row 2i+1: 8 partials] ([a.q0 a.q1 b.q0 b.q1] + [a.q2 a.q3 ..])
    for (int i = 0; i < 8; ++i) u[i] = fold_quarters<0x44, 0xEE>(v[2 * i], v[2 * i + 1]);
    // quarters: w[i] = [row 4i | 4i+1 | 4i+2 | 4i+3], 4 partials each ([c.q0 c.q2 d.q0 d.q2] + [c.q1 c.q3 ..])
    for (int i = 0; i < 4; ++i) w[i] = fold_quarters<0x88, 0xDD>(u[2 * i], u[2 * i + 1]);
    // within quarters: quarter j of s[i] = [row 8i+j: 2 partials | row 8i+4+j: 2 partials] ([g0 g1 h0 h1] + [g2 ..])
    for (int i = 0; i < 2; ++i) s[i] = fold_floats<0x44, 0xEE>(w[2 * i], w[2 * i + 1]);
    // quarter j = [row j, row 4 + j, row 8 + j, row 12 + j] ([s0.0 s0.2 s1.0 s1.2] + [s0.1 s0.3 s1.1 s1.3])
    const __m512 r = fold_floats<0x88, 0xDD>(s[0], s[1]);
    // element 4j + m holds row 4m + j: transpose the 4 x 4 back to row order
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, r);
}

// rows n0 .. n0+15 of w against the tokens `rows` lists: out[t, n0 .. n0+15]
inline void block16(const uint16_t* x, const uint16_t* w, float* out, const std::vector<int64_t>& rows, int64_t K,
                    int64_t N, int64_t n0) {
    for (const int64_t t : rows) {
        const uint16_t* xt = x + t * K;
        __m512 acc[16];
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xt + k);
            for (int r = 0; r < 16; ++r)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w + (n0 + r) * K + k), xv);
        }
        _mm512_storeu_ps(out + t * N + n0, sum16(acc));
    }
}

// one row n of w against every token (the rows past the last whole block of 16)
inline void row1(const uint16_t* x, const uint16_t* w, float* out, const std::vector<int64_t>& rows, int64_t K,
                 int64_t N, int64_t n) {
    for (const int64_t t : rows) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + n * K + k),
                                   (__m512bh)_mm512_loadu_si512(x + t * K + k));
        out[t * N + n] = _mm512_reduce_add_ps(acc);
    }
}

void rows_linear(const uint16_t* x, const uint16_t* w, float* out, int64_t T, int64_t K, int64_t N) {
    if (T == 0) return;
    // a token equal to the one before it (the padding rows of a compiled step's bucket or tile repeat a row)
    // takes that token's output at the end: the same inputs give the same bits, so they are computed once
    std::vector<int64_t> rows{0}, same(T, -1);
    for (int64_t t = 1; t < T; ++t) {
        const int64_t s = same[t - 1] >= 0 ? same[t - 1] : t - 1;
        if (std::memcmp(x + t * K, x + s * K, K * sizeof(uint16_t)) == 0)
            same[t] = s;
        else
            rows.push_back(t);
    }
    const int64_t blocks = N / 16;
    auto run = [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) block16(x, w, out, rows, K, N, b * 16);
    };
    // two threads for a weight of 128 KB or more: inside a decode step the weights come from memory, not the
    // caches (the step reads tens of MB between two reads of a layer), and two threads stream them faster
    // (every bf16 layer of `small` once, after 128 MB of other reads: 1.5 against 2.1 ms at 1 row, 2.1 against
    // 2.8 at 8; a step 1.04x faster at batch 1). Smaller ones (a few microseconds) on the calling thread, as
    // waking a worker costs more than it saves
    if (N * K < (int64_t(1) << 16))
        run(0, blocks);
    else
        at::parallel_for(0, blocks, 4, run);
    for (int64_t n = blocks * 16; n < N; ++n) row1(x, w, out, rows, K, N, n);
    for (int64_t t = 1; t < T; ++t)
        if (same[t] >= 0) std::memcpy(out + t * N, out + same[t] * N, N * sizeof(float));
}
#else
constexpr bool kBf16Dot = false;

void rows_linear(const uint16_t*, const uint16_t*, float*, int64_t, int64_t, int64_t) {
    TORCH_CHECK(false, "rows_linear_cpu: built without the bf16 dot-product instructions");
}
#endif

// x [T, K] bf16, w [N, K] bf16, K a multiple of 32 -> fp32 [T, N]
at::Tensor rows_linear_op(const at::Tensor& x, const at::Tensor& w) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
                "rows_linear_cpu: x and w must be bf16");
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && w.size(1) % 32 == 0,
                "rows_linear_cpu: x [T, K], w [N, K], K a multiple of 32");
    const at::Tensor xc = x.contiguous(), wc = w.contiguous();
    const int64_t T = xc.size(0), K = xc.size(1), N = wc.size(0);
    at::Tensor out = at::empty({T, N}, xc.options().dtype(at::kFloat));
    rows_linear(reinterpret_cast<const uint16_t*>(xc.data_ptr()), reinterpret_cast<const uint16_t*>(wc.data_ptr()),
                out.data_ptr<float>(), T, K, N);
    return out;
}

bool bf16_dot() { return kBf16Dot; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsv41, m) {
    m.def("rows_linear_cpu(Tensor x, Tensor w) -> Tensor");
    m.def("rows_linear_cpu_bf16_dot() -> bool", &bf16_dot);
}

TORCH_LIBRARY_IMPL(dsv41, CPU, m) { m.impl("rows_linear_cpu", &rows_linear_op); }
