// A Full indexer layer's selection on a CPU, scores and top-k in one pass: dsv41.ops.index_cpu builds this file
// with the machine's own instruction set (-march=native) and loads it; it registers the op
// torch.ops.dsv41.index_topk_cpu.
//
// The same selection as dsv41.ops.indexer (its reference: index_scores, mask_invisible, topk_canonical): for
// query s and a visible entry t (t < visible[s]), per head h the dot product q[s, h] . k[t] rounded to bf16,
// ReLU, times w[s, h] rounded to bf16, summed over the heads in order in fp32 and rounded to bf16; the k best
// entries by (score desc, position asc), returned in ascending position order. Nothing of size [S, T] is ever
// written: each query keeps its running top-k while it scans the keys.
//
// The products are exact integers. q and k are MXFP4 values (E2M1 times a power of two per block of 32), so
// within a block of 32 every value is an integer m, |m| < 16, times one power of two (the block's largest
// magnitude fixes it), and a block's dot product is an exact int32 sum: on a CPU with AVX512-VNNI, 64 int8
// products per instruction (twice the bf16 dot-product instruction's 32). The block sums, scaled by their powers
// of two, are added in fp32: exact wherever the bf16 GEMM of the reference is, so a score has the reference's
// bits (tested equal).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DSV41_VNNI 1
#endif

#include "cpu_bf16.h"

namespace {

using namespace dsv41_bf16;

constexpr int kBlock = 32;  // the MXFP4 block
constexpr int kTile = 16;   // keys scored together (one 512-bit register of int32 sums)
constexpr int kBias = 16;   // keys are stored as m + 16 (unsigned bytes, what VNNI's first operand is)

// One block of 32 bf16 values on an MXFP4 grid -> integers m (|m| < 16) and the power of two they scale:
// value = m * scale. The largest magnitude M = f * 2^E (f in [0.5, 1)) has at most two significant bits
// and every other value of the block is a multiple of M's grid step, which is at least 2^(E - 4); so with
// scale = 2^(E - 4), M / scale is in [8, 16) and every value is an integer. Returns false when a value is
// not on that grid (not MXFP4-rounded).
inline bool to_ints(const uint16_t* v, int8_t* m, float* scale) {
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(bf16_to_f32(v[i])));
    if (amax == 0.f) {
        std::memset(m, 0, kBlock);
        *scale = 0.f;
        return true;
    }
    int e;
    std::frexp(amax, &e);
    const float unit = std::ldexp(1.f, e - 4), inv = std::ldexp(1.f, 4 - e);
    for (int i = 0; i < kBlock; ++i) {
        const float x = bf16_to_f32(v[i]) * inv;  // exact: a power of two
        if (x != std::nearbyint(x) || std::fabs(x) >= 16.f) return false;
        m[i] = int8_t(x);
    }
    *scale = unit;
    return true;
}

struct Pick {
    float score;
    int64_t pos;
};

// worse = lower score, or the same score at a higher position (ties go to the lowest position)
inline bool worse(const Pick& a, const Pick& b) { return a.score < b.score || (a.score == b.score && a.pos > b.pos); }

// A query's running top-k: a heap whose top is the worst kept pick. Keys arrive in ascending position, so a
// new entry that ties the worst kept score is worse than it and never enters.
struct TopK {
    std::vector<Pick> heap;
    int64_t k;
    float floor = -INFINITY;  // the worst kept score once the heap is full
    explicit TopK(int64_t k_) : k(k_) { heap.reserve(k_); }
    void offer(float score, int64_t pos) {
        auto cmp = [](const Pick& a, const Pick& b) { return worse(b, a); };  // max-heap of "worse" = min at top
        if (int64_t(heap.size()) < k) {
            heap.push_back({score, pos});
            std::push_heap(heap.begin(), heap.end(), cmp);
        } else if (score > heap.front().score) {
            std::pop_heap(heap.begin(), heap.end(), cmp);
            heap.back() = {score, pos};
            std::push_heap(heap.begin(), heap.end(), cmp);
        } else {
            return;
        }
        if (int64_t(heap.size()) == k) floor = heap.front().score;
    }
};

// Keys packed for the scan: per tile of 16 keys, per block, per group of 4 values: 16 x 4 bytes (m + 16), the
// layout VNNI multiplies (each 32-bit lane one key's 4 values); and per tile and block 16 scales.
struct PackedKeys {
    int64_t tiles, blocks;
    std::vector<uint8_t> bytes;   // [tiles][blocks][8][16][4]
    std::vector<float> scales;    // [tiles][blocks][16]
};

bool pack_keys(const uint16_t* k, int64_t T, int64_t D, PackedKeys& out) {
    out.blocks = D / kBlock;
    out.tiles = (T + kTile - 1) / kTile;
    out.bytes.assign(out.tiles * out.blocks * kBlock * kTile, uint8_t(kBias));
    out.scales.assign(out.tiles * out.blocks * kTile, 0.f);
    std::atomic<bool> ok{true};
    at::parallel_for(0, out.tiles, 64, [&](int64_t t0, int64_t t1) {
        int8_t m[kBlock];
        for (int64_t tile = t0; tile < t1; ++tile)
            for (int64_t j = 0; j < kTile; ++j) {
                const int64_t t = tile * kTile + j;
                if (t >= T) break;
                for (int64_t b = 0; b < out.blocks; ++b) {
                    float scale;
                    if (!to_ints(k + t * D + b * kBlock, m, &scale)) ok = false;
                    out.scales[(tile * out.blocks + b) * kTile + j] = scale;
                    uint8_t* dst = out.bytes.data() + (tile * out.blocks + b) * kBlock * kTile;
                    for (int g = 0; g < kBlock / 4; ++g)
                        for (int i = 0; i < 4; ++i) dst[(g * kTile + j) * 4 + i] = uint8_t(m[g * 4 + i] + kBias);
                }
            }
    });
    return ok;
}

// One query's heads, as the scan reads them: per head and block 32 signed bytes, the scale, and the bias
// correction kBias * sum(m) (what the keys' bias adds to each int32 sum).
struct PackedQuery {
    std::vector<int8_t> m;        // [H][blocks][32]
    std::vector<float> scale;     // [H][blocks]
    std::vector<int32_t> bias;    // [H][blocks]
};

bool pack_query(const uint16_t* q, int64_t H, int64_t D, PackedQuery& out) {
    const int64_t blocks = D / kBlock;
    out.m.resize(H * D);
    out.scale.resize(H * blocks);
    out.bias.resize(H * blocks);
    for (int64_t hb = 0; hb < H * blocks; ++hb) {
        if (!to_ints(q + hb * kBlock, out.m.data() + hb * kBlock, &out.scale[hb])) return false;
        int32_t sum = 0;
        for (int i = 0; i < kBlock; ++i) sum += out.m[hb * kBlock + i];
        out.bias[hb] = kBias * sum;
    }
    return true;
}

// The scores of one tile of 16 keys for one query -> out[16] (bf16 values as floats).
#if defined(DSV41_VNNI)
// to the nearest bf16 value, ties to even, subnormals kept (the conversion instruction would flush them, and
// the reference's rounding does not)
inline __m512 to_bf16(__m512 x) {
    __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(int32_t(0xffff0000u))));
}

// NB blocks a key (a compile-time count, so the tile's NB * 8 key registers stay in registers across the heads),
// NQ queries a pass (independent chains for the CPU to overlap)
template <int NB, int NQ>
inline void score_tile_nb(const PackedKeys& keys, int64_t tile, const PackedQuery* const* q, const float* const* w,
                          int64_t H, float (*out)[kTile]) {
    const uint8_t* kb = keys.bytes.data() + tile * NB * kBlock * kTile;
    const float* ks = keys.scales.data() + tile * NB * kTile;
    __m512i kreg[NB * 8];
    __m512 kscale[NB];
    for (int i = 0; i < NB * 8; ++i) kreg[i] = _mm512_loadu_si512(kb + i * 64);
    for (int b = 0; b < NB; ++b) kscale[b] = _mm512_loadu_ps(ks + b * kTile);
    __m512 total[NQ];
    for (int j = 0; j < NQ; ++j) total[j] = _mm512_setzero_ps();
    for (int64_t h = 0; h < H; ++h) {
        for (int j = 0; j < NQ; ++j) {
            const int32_t* qw = reinterpret_cast<const int32_t*>(q[j]->m.data());  // 4 signed bytes a word
            __m512 head = _mm512_setzero_ps();
            for (int b = 0; b < NB; ++b) {
                const int32_t* qb = qw + (h * NB + b) * 8;
                // the sum starts at minus the keys' bias (one chain: the other heads' and queries' chains overlap it)
                __m512i sums = _mm512_set1_epi32(-q[j]->bias[h * NB + b]);
                for (int g = 0; g < 8; ++g) sums = _mm512_dpbusd_epi32(sums, kreg[b * 8 + g], _mm512_set1_epi32(qb[g]));
                const __m512 scale = _mm512_mul_ps(kscale[b], _mm512_set1_ps(q[j]->scale[h * NB + b]));
                head = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, head);  // exact product: a power of two
            }
            head = _mm512_max_ps(to_bf16(head), _mm512_setzero_ps());
            total[j] = _mm512_add_ps(total[j], to_bf16(_mm512_mul_ps(head, _mm512_set1_ps(w[j][h]))));
        }
    }
    for (int j = 0; j < NQ; ++j) _mm512_storeu_ps(out[j], to_bf16(total[j]));
}

template <int NQ>
inline void score_tile(const PackedKeys& keys, int64_t tile, const PackedQuery* const* q, const float* const* w,
                       int64_t H, float (*out)[kTile]) {
    switch (keys.blocks) {
        case 1: return score_tile_nb<1, NQ>(keys, tile, q, w, H, out);
        case 2: return score_tile_nb<2, NQ>(keys, tile, q, w, H, out);
        case 3: return score_tile_nb<3, NQ>(keys, tile, q, w, H, out);
        default: return score_tile_nb<4, NQ>(keys, tile, q, w, H, out);
    }
}
constexpr bool kVnni = true;
#else
template <int NQ>
inline void score_tile(const PackedKeys& keys, int64_t tile, const PackedQuery* const* qs, const float* const* ws,
                       int64_t H, float (*out)[kTile]) {
    const int64_t blocks = keys.blocks;
    const uint8_t* kb = keys.bytes.data() + tile * blocks * kBlock * kTile;
    const float* ks = keys.scales.data() + tile * blocks * kTile;
    for (int n = 0; n < NQ; ++n) {
        const PackedQuery& q = *qs[n];
        float total[kTile] = {};
        for (int64_t h = 0; h < H; ++h) {
            float head[kTile] = {};
            for (int64_t b = 0; b < blocks; ++b) {
                const int8_t* qm = q.m.data() + (h * blocks + b) * kBlock;
                const uint8_t* kv = kb + b * kBlock * kTile;
                int32_t acc[kTile] = {};
                for (int g = 0; g < kBlock / 4; ++g)
                    for (int j = 0; j < kTile; ++j)
                        for (int i = 0; i < 4; ++i) acc[j] += int32_t(kv[(g * kTile + j) * 4 + i]) * qm[4 * g + i];
                const float qs_ = q.scale[h * blocks + b];
                const int32_t bias = q.bias[h * blocks + b];
                for (int j = 0; j < kTile; ++j) head[j] += float(acc[j] - bias) * (ks[b * kTile + j] * qs_);
            }
            for (int j = 0; j < kTile; ++j) total[j] += round_bf16(std::max(round_bf16(head[j]), 0.f) * ws[n][h]);
        }
        for (int j = 0; j < kTile; ++j) out[n][j] = round_bf16(total[j]);
    }
}
constexpr bool kVnni = false;
#endif

// The first m scores of a tile (keys base .. base + m - 1) into a query's running top-k. Most scores of a long
// scan fall below the floor: with AVX-512 one compare finds the few that do not.
inline void offer_tile(TopK& top, const float* scores, int64_t base, int64_t m) {
#if defined(DSV41_VNNI)
    uint32_t mask = _mm512_cmp_ps_mask(_mm512_loadu_ps(scores), _mm512_set1_ps(top.floor), _CMP_GT_OQ);
    mask &= m >= kTile ? 0xffffu : (1u << m) - 1u;
    while (mask) {
        const int e = __builtin_ctz(mask);
        mask &= mask - 1;
        if (scores[e] > top.floor) top.offer(scores[e], base + e);  // the floor may have risen meanwhile
    }
#else
    for (int64_t e = 0; e < m; ++e)
        if (scores[e] > top.floor) top.offer(scores[e], base + e);
#endif
}

// q [S, H, D], k [T, D], weights [S, H] bf16; visible [S] int64 -> picks [S, topk] int64: the positions of each
// query's top-k visible entries in ascending order, -1 after them when fewer than topk are visible.
at::Tensor index_topk_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& weights,
                         const at::Tensor& visible, int64_t topk) {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                    weights.scalar_type() == at::kBFloat16,
                "index_topk_cpu: q, k and weights must be bf16");
    TORCH_CHECK(q.dim() == 3 && k.dim() == 2 && weights.dim() == 2 && visible.dim() == 1,
                "index_topk_cpu: q [S, H, D], k [T, D], weights [S, H], visible [S]");
    const int64_t S = q.size(0), H = q.size(1), D = q.size(2), T = k.size(0);
    TORCH_CHECK(k.size(1) == D && D % kBlock == 0 && D <= 4 * kBlock && weights.size(0) == S && weights.size(1) == H &&
                    visible.size(0) == S && topk > 0,
                "index_topk_cpu: shapes do not match (D must be 32, 64, 96 or 128)");
    const at::Tensor qc = q.contiguous(), kc = k.contiguous(), wc = weights.to(at::kFloat).contiguous();
    const at::Tensor vc = visible.to(at::kLong).contiguous();
    PackedKeys keys;
    TORCH_CHECK(pack_keys(reinterpret_cast<const uint16_t*>(kc.data_ptr()), T, D, keys),
                "index_topk_cpu: the keys are not MXFP4-rounded (fp4_qdq, block 32)");
    at::Tensor picks = at::empty({S, topk}, qc.options().dtype(at::kLong));
    const uint16_t* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
    const float* wp = wc.data_ptr<float>();
    const int64_t* vp = vc.data_ptr<int64_t>();
    int64_t* out = picks.data_ptr<int64_t>();
    std::atomic<bool> ok{true};
    // queries interleaved over the threads: later queries of a chunk see more keys
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), S));
    at::parallel_for(0, threads, 1, [&](int64_t r0, int64_t r1) {
        constexpr int kPair = 2;  // queries scored together
        PackedQuery pq[kPair];
        TopK top[kPair] = {TopK(topk), TopK(topk)};
        float scores[kPair][kTile];
        for (int64_t r = r0; r < r1; ++r) {
            std::vector<int64_t> mine;
            for (int64_t s = r; s < S; s += threads) mine.push_back(s);
            for (size_t i = 0; i < mine.size(); i += kPair) {
                const int nq = int(std::min<size_t>(kPair, mine.size() - i));
                int64_t n[kPair] = {0, 0}, reach = 0;
                const PackedQuery* qs[kPair] = {&pq[0], &pq[nq - 1]};
                const float* ws[kPair];
                for (int j = 0; j < nq; ++j) {
                    const int64_t s = mine[i + j];
                    if (!pack_query(qp + s * H * D, H, D, pq[j])) ok = false;
                    n[j] = std::min(std::max<int64_t>(vp[s], 0), T);
                    reach = std::max(reach, n[j]);
                    ws[j] = wp + s * H;
                    top[j].heap.clear();
                    top[j].floor = -INFINITY;
                }
                if (nq < kPair) ws[1] = ws[0];
                for (int64_t tile = 0; tile * kTile < reach; ++tile) {
                    if (nq == kPair)
                        score_tile<kPair>(keys, tile, qs, ws, H, scores);
                    else
                        score_tile<1>(keys, tile, qs, ws, H, scores);
                    const int64_t base = tile * kTile;
                    for (int j = 0; j < nq; ++j) {
                        const int64_t m = std::min<int64_t>(kTile, n[j] - base);  // <= 0: past this query's reach
                        if (m <= 0) continue;
                        // finite scores always beat the empty heap's -inf floor; a tie with a full heap's worst
                        // never enters (it sits at a higher position)
                        offer_tile(top[j], scores[j], base, m);
                    }
                }
                for (int j = 0; j < nq; ++j) {
                    int64_t* row = out + mine[i + j] * topk;
                    const int64_t got = int64_t(top[j].heap.size());
                    for (int64_t e = 0; e < got; ++e) row[e] = top[j].heap[e].pos;
                    std::sort(row, row + got);
                    std::fill(row + got, row + topk, int64_t(-1));
                }
            }
        }
    });
    TORCH_CHECK(ok, "index_topk_cpu: the queries are not MXFP4-rounded (fp4_qdq, block 32)");
    return picks;
}

// One tile of a sequence's keys (rows[0..m), m <= 16) read from the engine's packed pool into the scan's layout
// (tile 0 of `out`): E2M1 codes two a byte (the even value in the low nibble, the sign in bit 3) and one UE8M0
// scale byte per 32 values. Exact: a doubled E2M1 magnitude is an integer (0, 1, 2, 3, 4, 6, 8, 12) and the
// scale byte e means 2^(e - 127), so value = m * 2^(e - 128).
#if defined(__AVX512BW__)
// One key's values (D a multiple of 64) into tile slot j, as the scalar loop below writes them: 32 code bytes
// split into their 64 nibbles in order, each mapped through the 16-entry table of biased doubled values, and
// each group of 4 consecutive values stored as one dword at (group * kTile + j), 16 groups by one scatter.
inline void pack_key_avx512(const uint8_t* c, int64_t D, int64_t j, uint8_t* bytes) {
    // code -> doubled magnitude, negated for codes 8-15, plus kBias; in both 128-bit lanes (the shuffle is per lane)
    const __m256i table = _mm256_setr_epi8(16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4,  //
                                           16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4);
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m512i groups = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(kTile));
    for (int64_t q = 0; q < D / 64; ++q) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + q * 32));
        const __m256i lo = _mm256_and_si256(raw, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        const __m256i a = _mm256_unpacklo_epi8(lo, hi);  // values 0-15 | 32-47 (unpack works per 128-bit lane)
        const __m256i b = _mm256_unpackhi_epi8(lo, hi);  // values 16-31 | 48-63
        const __m256i first = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(a, b, 0x20));   // 0-31
        const __m256i second = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(a, b, 0x31));  // 32-63
        const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
        _mm512_i32scatter_epi32(reinterpret_cast<int*>(bytes) + q * 16 * kTile + j, groups, words, 4);
    }
}
#endif

void pack_tile_from_codes(const uint8_t* codes, const uint8_t* scale_bytes, const int64_t* rows, int64_t m,
                          int64_t D, PackedKeys& out) {
    static constexpr int8_t kDoubled[8] = {0, 1, 2, 3, 4, 6, 8, 12};
    const int64_t blocks = D / kBlock;
    std::fill(out.bytes.begin(), out.bytes.end(), uint8_t(kBias));
    std::fill(out.scales.begin(), out.scales.end(), 0.f);
    for (int64_t j = 0; j < m; ++j) {
        const uint8_t* c = codes + rows[j] * (D / 2);
        for (int64_t b = 0; b < blocks; ++b)
            out.scales[b * kTile + j] = std::ldexp(1.f, int(scale_bytes[rows[j] * blocks + b]) - 128);
#if defined(__AVX512BW__)
        if (D % 64 == 0) {  // the vector form (a scalar loop per value was most of a decode step's scan)
            pack_key_avx512(c, D, j, out.bytes.data());
            continue;
        }
#endif
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t* dst = out.bytes.data() + b * kBlock * kTile;
            for (int i = 0; i < kBlock; ++i) {
                const uint8_t code = (c[(b * kBlock + i) / 2] >> (4 * (i & 1))) & 0xF;
                const int8_t v = (code & 8) ? -kDoubled[code & 7] : kDoubled[code & 7];
                dst[((i / 4) * kTile + j) * 4 + (i % 4)] = uint8_t(v + kBias);
            }
        }
    }
}

// An index layer's decode scores read from the packed pool, one query per sequence: q [B, H, D] and weights
// [B, H] bf16, key_codes [rows, D/2] and key_scale [rows, D/32] uint8, tables [B, max_blocks] int64 (the
// sequences' block tables, `per` entries a block), visible [B] -> bf16 scores [B, n]. Without `entries` (a Full
// layer's scan) score j is entry j's, -inf past each sequence's visible count; with entries [B, n] int64 (a
// Reindex layer's candidates) score j is entry entries[b, j]'s, -inf where that entry is not visible, or where
// `usable` [B, n] bool is false. The scores of `ops.index_scores` on the dequantised keys, bit for bit.
at::Tensor paged_index_scores_op(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& key_codes,
                                 const at::Tensor& key_scale, const at::Tensor& tables, int64_t per,
                                 const at::Tensor& visible, int64_t n, const std::optional<at::Tensor>& entries,
                                 const std::optional<at::Tensor>& usable) {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && weights.scalar_type() == at::kBFloat16,
                "paged_index_scores_cpu: q and weights must be bf16");
    TORCH_CHECK(key_codes.scalar_type() == at::kByte && key_scale.scalar_type() == at::kByte,
                "paged_index_scores_cpu: key codes and scales must be uint8");
    TORCH_CHECK(q.dim() == 3 && weights.dim() == 2 && tables.dim() == 2 && visible.dim() == 1,
                "paged_index_scores_cpu: q [B, H, D], weights [B, H], tables [B, blocks], visible [B]");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
    TORCH_CHECK(D % kBlock == 0 && D <= 4 * kBlock && key_codes.size(1) == D / 2 && key_scale.size(1) == D / kBlock &&
                    weights.size(0) == B && weights.size(1) == H && tables.size(0) == B && visible.size(0) == B &&
                    per > 0 && n >= 0,
                "paged_index_scores_cpu: shapes do not match");
    at::Tensor ec, uc;
    if (entries.has_value()) {
        ec = entries->to(at::kLong).contiguous();
        TORCH_CHECK(ec.dim() == 2 && ec.size(0) == B && ec.size(1) == n, "paged_index_scores_cpu: entries [B, n]");
        if (usable.has_value()) {
            uc = usable->to(at::kBool).contiguous();
            TORCH_CHECK(uc.sizes() == ec.sizes(), "paged_index_scores_cpu: usable [B, n], as entries");
        }
    }
    const at::Tensor qc = q.contiguous(), wc = weights.to(at::kFloat).contiguous();
    const at::Tensor cc = key_codes.contiguous(), sc = key_scale.contiguous();
    const at::Tensor tc = tables.to(at::kLong).contiguous(), vc = visible.to(at::kLong).contiguous();
    const int64_t rows_total = cc.size(0), max_blocks = tc.size(1);
    std::vector<PackedQuery> queries(B);
    for (int64_t b = 0; b < B; ++b)
        TORCH_CHECK(pack_query(reinterpret_cast<const uint16_t*>(qc.data_ptr()) + b * H * D, H, D, queries[b]),
                    "paged_index_scores_cpu: the queries are not MXFP4-rounded (fp4_qdq, block 32)");
    at::Tensor out = at::empty({B, n}, qc.options());
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    const int64_t* tp = tc.data_ptr<int64_t>();
    const int64_t* vp = vc.data_ptr<int64_t>();
    const int64_t* ep = ec.defined() ? ec.data_ptr<int64_t>() : nullptr;
    const bool* up = uc.defined() ? uc.data_ptr<bool>() : nullptr;
    const float* wp = wc.data_ptr<float>();
    const uint8_t* codes = cc.data_ptr<uint8_t>();
    const uint8_t* scales = sc.data_ptr<uint8_t>();
    const int64_t tiles = (n + kTile - 1) / kTile;
    std::atomic<bool> ok{true};
    at::parallel_for(0, B * tiles, 16, [&](int64_t i0, int64_t i1) {
        PackedKeys keys;
        keys.tiles = 1;
        keys.blocks = D / kBlock;
        keys.bytes.resize(keys.blocks * kBlock * kTile);
        keys.scales.resize(keys.blocks * kTile);
        float scores[1][kTile];
        int64_t rows[kTile], at[kTile];
        for (int64_t item = i0; item < i1; ++item) {
            const int64_t b = item / tiles, base = (item % tiles) * kTile;
            const int64_t width = std::min<int64_t>(kTile, n - base);
            int64_t m = 0;  // the tile's live scores: their entries' pool rows, and where each score goes
            for (int64_t j = 0; j < width; ++j) {
                const int64_t e = ep != nullptr ? ep[b * n + base + j] : base + j;
                if (e < 0 || e >= vp[b] || (up != nullptr && !up[b * n + base + j])) continue;
                const int64_t block = e / per;
                const int64_t row = block < max_blocks ? tp[b * max_blocks + block] * per + e % per : -1;
                if (row < 0 || row >= rows_total) ok = false;
                rows[m] = row < 0 || row >= rows_total ? 0 : row;
                at[m++] = j;
            }
            uint16_t* dst = op + b * n + base;
            for (int64_t j = 0; j < width; ++j) dst[j] = uint16_t(0xFF80);  // -inf where no live entry scores
            if (m == 0) continue;
            pack_tile_from_codes(codes, scales, rows, m, D, keys);
            const PackedQuery* qs[1] = {&queries[b]};
            const float* ws[1] = {wp + b * H};
            score_tile<1>(keys, 0, qs, ws, H, scores);
            for (int64_t j = 0; j < m; ++j) {
                uint32_t bits;
                std::memcpy(&bits, &scores[0][j], 4);
                dst[at[j]] = uint16_t(bits >> 16);  // bf16 already
            }
        }
    });
    TORCH_CHECK(ok, "paged_index_scores_cpu: a visible entry's block is outside the pool");
    return out;
}

// The E2M1 values as bf16 bits, codes 0-15 (8-15 negative, 8 a negative zero), twice: a 32-entry table for
// one AVX-512 permute.
constexpr uint16_t kE2M1Bits[32] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
                                    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

inline float bits_to_f32(uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// One packed row (D values, a scale byte per `block`) -> D bf16 values: each value times its block's scale in
// fp32, exact, and its upper half kept (exact too: the low half is zero).
inline void gather_fp4_row(const uint8_t* c, const uint8_t* s, const float* scale_of, int64_t D, int64_t block,
                           uint16_t* o) {
    int64_t j = 0;
#if defined(__AVX512BW__)
    const __m512i table = _mm512_loadu_si512(kE2M1Bits);
    const __m512i nibble = _mm512_set1_epi32(0xF), high = _mm512_set1_epi32(int(0xFFFF0000u));
    for (; (block == 16 || block == 32) && j + 32 <= D; j += 32) {  // 32 values: 16 bytes, lane i: values 2i, 2i+1
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j / 2)));
        const __m512i idx = _mm512_or_si512(_mm512_and_si512(bytes, nibble),
                                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(bytes, 4), nibble), 16));
        const __m512i vals = _mm512_permutexvar_epi16(idx, table);  // bf16 pairs
        const uint8_t* sj = s + j / block;  // lanes 0-7 in the first block, 8-15 in the second (block 16) or the first
        const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(scale_of[sj[0]]),
                                             _mm256_set1_ps(scale_of[sj[block == 16 ? 1 : 0]]), 1);
        const __m512 even = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(vals, 16)), sv);
        const __m512 odd = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(vals, high)), sv);
        const __m512i packed = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even), 16),
                                               _mm512_and_si512(_mm512_castps_si512(odd), high));
        _mm512_storeu_si512(o + j, packed);
    }
#endif
    for (; j < D; ++j) {
        const uint8_t code = (c[j / 2] >> (4 * (j & 1))) & 0xF;
        const float v = bits_to_f32(uint32_t(kE2M1Bits[code]) << 16) * scale_of[s[j / block]];
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        o[j] = uint16_t(bits >> 16);
    }
}

// Packed FP4 rows of the pool read back as bf16: codes [R, D/2] uint8 (two E2M1 codes a byte, the even value in
// the low nibble), scale [R, D/block] uint8 (E4M3 bytes, or UE8M0 with ue8m0), rows [...] int64 flat pool rows
// -> bf16 [..., D]: `ops.quant.fp4_dequant_bf16` of the gathered rows, the same bits (an E2M1 value times its
// scale has at most 6 significant bits: exact in fp32 and in bf16, so no rounding happens anywhere).
at::Tensor gather_fp4_op(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& rows, bool ue8m0) {
    TORCH_CHECK(codes.scalar_type() == at::kByte && scale.scalar_type() == at::kByte && codes.dim() == 2 &&
                    scale.dim() == 2 && codes.size(0) == scale.size(0),
                "gather_fp4_cpu: codes [R, D/2] and scale [R, D/block] uint8");
    const int64_t R = codes.size(0), half = codes.size(1), D = 2 * half, nb = scale.size(1);
    TORCH_CHECK(nb > 0 && D % nb == 0 && (D / nb) % 2 == 0, "gather_fp4_cpu: D must be a multiple of the blocks");
    const int64_t block = D / nb;
    const at::Tensor cc = codes.contiguous(), sc = scale.contiguous(), rc = rows.to(at::kLong).contiguous();
    std::vector<int64_t> shape(rc.sizes().begin(), rc.sizes().end());
    shape.push_back(D);
    at::Tensor out = at::empty(shape, cc.options().dtype(at::kBFloat16));
    const int64_t count = rc.numel();
    const int64_t* rp = rc.data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i)
        TORCH_CHECK(rp[i] >= 0 && rp[i] < R, "gather_fp4_cpu: row ", rp[i], " is outside the pool of ", R);
    float scale_of[256];
    for (int e = 0; e < 256; ++e)
        scale_of[e] = ue8m0 ? (e == 255 ? NAN : std::ldexp(1.f, e - 127))
                            : float(c10::Float8_e4m3fn(uint8_t(e), c10::Float8_e4m3fn::from_bits()));
    const uint8_t* cp = cc.data_ptr<uint8_t>();
    const uint8_t* sp = sc.data_ptr<uint8_t>();
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    auto run = [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) gather_fp4_row(cp + rp[i] * half, sp + rp[i] * nb, scale_of, D, block, op + i * D);
    };
    if (count * D < (int64_t(1) << 18))  // a decode step's picks: on the calling thread
        run(0, count);
    else
        at::parallel_for(0, count, 64, run);
    return out;
}

// true where the products use AVX512-VNNI
bool vnni() { return kVnni; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsv41, m) {
    m.def("index_topk_cpu(Tensor q, Tensor k, Tensor weights, Tensor visible, int topk) -> Tensor");
    m.def("index_topk_cpu_vnni() -> bool", &vnni);
    m.def("paged_index_scores_cpu(Tensor q, Tensor weights, Tensor key_codes, Tensor key_scale, Tensor tables, "
          "int per, Tensor visible, int n, Tensor? entries=None, Tensor? usable=None) -> Tensor");
    m.def("gather_fp4_cpu(Tensor codes, Tensor scale, Tensor rows, bool ue8m0) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsv41, CPU, m) {
    m.impl("index_topk_cpu", &index_topk_op);
    m.impl("paged_index_scores_cpu", &paged_index_scores_op);
    m.impl("gather_fp4_cpu", &gather_fp4_op);
}
